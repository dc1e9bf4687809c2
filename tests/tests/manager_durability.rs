//! Durability of the manager's namespace across SIGKILL.
//!
//! Runs the real `regions-manager` binary, drives it with a seeded random mix
//! of namespace operations (mkdir, create, unlink, rmdir, rename — also over
//! existing names —, setxattr of `user.*` and `user.regions.persistent`,
//! removexattr) and keeps a model of the tree that is updated only for
//! operations whose reply arrived OK. Every reply is also checked against
//! the model's prediction (success, or the exact errno).
//!
//! At a random operation the manager is SIGKILLed while that operation may be
//! in flight; it is then restarted on the same data directory and the whole
//! tree is walked (ReadDir with small pages, Lookup, ListXattr, GetXattr).
//! The tree must equal the model exactly, except that the one operation in
//! flight at the kill may or may not have been applied. This is repeated for
//! several kill/restart cycles, then once more with a clean SIGTERM.
//!
//! Set `REGIONS_TEST_SEED` to replay an operation sequence (the kill timing
//! stays random).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use regions_proto::auth::Secret;
use regions_proto::v1;
use regions_tests::{
    Clients, ManagerProcess, ROOT_INO, caller, connect, errno_of, has_errno, write_secret,
};
use tonic::Status;

/// The uid every operation runs as (not root: permission checks apply).
const UID: u32 = 1000;
const HOST: u32 = 1;
/// Kill/restart cycles.
const CYCLES: usize = 4;
/// Operations per cycle before the kill: a random number in this range.
const OPS_BEFORE_KILL: std::ops::RangeInclusive<usize> = 300..=1000;
/// Names drawn for new entries: few, so that collisions and renames over
/// existing names are common.
const NAMES: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];
/// `user.*` attribute names drawn by setxattr and removexattr.
const XATTRS: [&str; 5] = ["user.k0", "user.k1", "user.k2", "user.note", "user.x.y"];
const PERSISTENT: &str = "user.regions.persistent";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Dir,
    Region,
}

/// What the test knows about one inode.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Node {
    /// 0 when unknown (created by the operation in flight at a kill).
    ino: u64,
    kind: Kind,
    persistent: bool,
    xattrs: BTreeMap<String, Vec<u8>>,
}

/// The tree: path → node; the root is `""`, its children `"a"`, theirs `"a/b"`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Model {
    nodes: BTreeMap<String, Node>,
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}/{name}")
    }
}

/// Whether `path` is `ancestor` or lies below it.
fn within(path: &str, ancestor: &str) -> bool {
    path == ancestor
        || ancestor.is_empty()
        || path
            .strip_prefix(ancestor)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// One namespace operation, by path.
#[derive(Clone, Debug)]
enum Op {
    Mkdir {
        parent: String,
        name: String,
    },
    Create {
        parent: String,
        name: String,
        persistent: Option<bool>,
    },
    Unlink {
        parent: String,
        name: String,
    },
    Rmdir {
        parent: String,
        name: String,
    },
    Rename {
        parent: String,
        name: String,
        new_parent: String,
        new_name: String,
        noreplace: bool,
    },
    SetXattr {
        path: String,
        name: String,
        value: Vec<u8>,
    },
    SetPersistent {
        path: String,
        value: bool,
    },
    RemoveXattr {
        path: String,
        name: String,
    },
}

impl Op {
    fn label(&self) -> &'static str {
        match self {
            Op::Mkdir { .. } => "mkdir",
            Op::Create { .. } => "create",
            Op::Unlink { .. } => "unlink",
            Op::Rmdir { .. } => "rmdir",
            Op::Rename { .. } => "rename",
            Op::SetXattr { .. } => "setxattr",
            Op::SetPersistent { .. } => "setpersistent",
            Op::RemoveXattr { .. } => "removexattr",
        }
    }
}

impl Model {
    fn root() -> Model {
        let mut nodes = BTreeMap::new();
        nodes.insert(
            String::new(),
            Node {
                ino: ROOT_INO,
                kind: Kind::Dir,
                persistent: true,
                xattrs: BTreeMap::new(),
            },
        );
        Model { nodes }
    }

    fn has_children(&self, dir: &str) -> bool {
        let prefix = format!("{dir}/");
        self.nodes
            .range(prefix.clone()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(&prefix))
    }

    fn paths_of(&self, kind: Option<Kind>) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|(p, n)| !p.is_empty() && kind.is_none_or(|k| n.kind == k))
            .map(|(p, _)| p.clone())
            .collect()
    }

    fn dirs(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.kind == Kind::Dir)
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Names directly in `dir`.
    fn children(&self, dir: &str) -> Vec<String> {
        self.nodes
            .keys()
            .filter(|p| !p.is_empty())
            .filter_map(|p| {
                let (parent, name) = p.rsplit_once('/').unwrap_or(("", p));
                (parent == dir).then(|| name.to_owned())
            })
            .collect()
    }

    /// Applies `op` as the manager should: `Err(errno)` (model unchanged)
    /// when the manager must refuse it. `new_ino` is the inode a mkdir or
    /// create produced (0 when unknown).
    fn apply(&mut self, op: &Op, new_ino: u64) -> Result<(), i32> {
        match op {
            Op::Mkdir { parent, name } | Op::Create { parent, name, .. } => {
                let path = join(parent, name);
                if self.nodes.contains_key(&path) {
                    return Err(libc::EEXIST);
                }
                let inherited = self.nodes[parent].persistent;
                let (kind, persistent) = match op {
                    Op::Create { persistent, .. } => {
                        (Kind::Region, persistent.unwrap_or(inherited))
                    }
                    _ => (Kind::Dir, inherited),
                };
                self.nodes.insert(
                    path,
                    Node {
                        ino: new_ino,
                        kind,
                        persistent,
                        xattrs: BTreeMap::new(),
                    },
                );
                Ok(())
            }
            Op::Unlink { parent, name } => {
                let path = join(parent, name);
                match self.nodes.get(&path).map(|n| n.kind) {
                    None => Err(libc::ENOENT),
                    Some(Kind::Dir) => Err(libc::EISDIR),
                    Some(Kind::Region) => {
                        self.nodes.remove(&path);
                        Ok(())
                    }
                }
            }
            Op::Rmdir { parent, name } => {
                let path = join(parent, name);
                match self.nodes.get(&path).map(|n| n.kind) {
                    None => Err(libc::ENOENT),
                    Some(Kind::Region) => Err(libc::ENOTDIR),
                    Some(Kind::Dir) if self.has_children(&path) => Err(libc::ENOTEMPTY),
                    Some(Kind::Dir) => {
                        self.nodes.remove(&path);
                        Ok(())
                    }
                }
            }
            Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                noreplace,
            } => {
                let src = join(parent, name);
                let dst = join(new_parent, new_name);
                let Some(src_kind) = self.nodes.get(&src).map(|n| n.kind) else {
                    return Err(libc::ENOENT);
                };
                // As Linux: an existing target refuses RENAME_NOREPLACE before anything
                // else is looked at (the same name, or a directory into itself).
                if *noreplace && self.nodes.contains_key(&dst) {
                    return Err(libc::EEXIST);
                }
                if src == dst {
                    return Ok(());
                }
                if src_kind == Kind::Dir && within(new_parent, &src) {
                    return Err(libc::EINVAL);
                }
                if let Some(dst_kind) = self.nodes.get(&dst).map(|n| n.kind) {
                    if *noreplace {
                        return Err(libc::EEXIST);
                    }
                    match (src_kind, dst_kind) {
                        (Kind::Dir, Kind::Region) => return Err(libc::ENOTDIR),
                        (Kind::Region, Kind::Dir) => return Err(libc::EISDIR),
                        (Kind::Dir, Kind::Dir) if self.has_children(&dst) => {
                            return Err(libc::ENOTEMPTY);
                        }
                        _ => {}
                    }
                    self.nodes.remove(&dst);
                }
                let moved: Vec<String> = self
                    .nodes
                    .keys()
                    .filter(|p| within(p, &src))
                    .cloned()
                    .collect();
                for old in moved {
                    let node = self.nodes.remove(&old).expect("listed above");
                    let new = format!("{dst}{}", &old[src.len()..]);
                    self.nodes.insert(new, node);
                }
                Ok(())
            }
            Op::SetXattr { path, name, value } => {
                let node = self.nodes.get_mut(path).ok_or(libc::ENOENT)?;
                node.xattrs.insert(name.clone(), value.clone());
                Ok(())
            }
            Op::SetPersistent { path, value } => {
                if path.is_empty() {
                    return Err(libc::EPERM); // the root belongs to root
                }
                let node = self.nodes.get_mut(path).ok_or(libc::ENOENT)?;
                node.persistent = *value;
                Ok(())
            }
            Op::RemoveXattr { path, name } => {
                let node = self.nodes.get_mut(path).ok_or(libc::ENOENT)?;
                node.xattrs.remove(name).map(|_| ()).ok_or(libc::ENODATA)
            }
        }
    }

    /// Differences between this (expected) tree and `actual`; inode numbers
    /// are compared where known.
    fn diff(&self, actual: &Model) -> Vec<String> {
        let mut out = Vec::new();
        for (path, want) in &self.nodes {
            match actual.nodes.get(path) {
                None => out.push(format!("missing {path:?}: expected {want:?}")),
                Some(got) => {
                    let same_ino = want.ino == 0 || want.ino == got.ino;
                    if !same_ino
                        || want.kind != got.kind
                        || want.persistent != got.persistent
                        || want.xattrs != got.xattrs
                    {
                        out.push(format!("{path:?}: expected {want:?}, found {got:?}"));
                    }
                }
            }
        }
        for (path, got) in &actual.nodes {
            if !self.nodes.contains_key(path) {
                out.push(format!("unexpected {path:?}: {got:?}"));
            }
        }
        out
    }
}

/// A name for a new entry: mostly from [`NAMES`], sometimes an unusual one.
fn random_name(rng: &mut StdRng) -> String {
    match rng.random_range(0..40) {
        0 => "L".repeat(255),
        1 => "ünïcødé ñame".to_owned(),
        2 => "with space".to_owned(),
        3 => ".hidden".to_owned(),
        _ => (*NAMES.choose(rng).expect("non-empty")).to_owned(),
    }
}

fn random_value(rng: &mut StdRng) -> Vec<u8> {
    let len = if rng.random_bool(0.05) {
        rng.random_range(1000..=4096)
    } else {
        rng.random_range(0..=64)
    };
    (0..len).map(|_| rng.random()).collect()
}

/// Splits a non-root path into (parent, name).
fn split(path: &str) -> (String, String) {
    match path.rsplit_once('/') {
        Some((p, n)) => (p.to_owned(), n.to_owned()),
        None => (String::new(), path.to_owned()),
    }
}

/// An existing entry (usually) or a random name in a random directory.
fn random_entry(model: &Model, rng: &mut StdRng, kind: Option<Kind>) -> (String, String) {
    let existing = model.paths_of(kind);
    if !existing.is_empty() && rng.random_bool(0.85) {
        split(existing.choose(rng).expect("non-empty"))
    } else {
        let dirs = model.dirs();
        (
            dirs.choose(rng).expect("root exists").clone(),
            random_name(rng),
        )
    }
}

fn random_op(model: &Model, rng: &mut StdRng) -> Op {
    let dirs = model.dirs();
    let any_dir = |rng: &mut StdRng| dirs.choose(rng).expect("root exists").clone();
    let any_path = |rng: &mut StdRng| {
        model
            .nodes
            .keys()
            .collect::<Vec<_>>()
            .choose(rng)
            .map(|p| (*p).clone())
            .expect("root exists")
    };
    match rng.random_range(0..100) {
        0..15 => Op::Mkdir {
            parent: any_dir(rng),
            name: random_name(rng),
        },
        15..40 => Op::Create {
            parent: any_dir(rng),
            name: random_name(rng),
            persistent: [None, Some(false), Some(true)]
                .choose(rng)
                .copied()
                .flatten(),
        },
        40..50 => {
            // Mostly regions, sometimes a directory (EISDIR).
            let kind = if rng.random_bool(0.9) {
                Some(Kind::Region)
            } else {
                None
            };
            let (parent, name) = random_entry(model, rng, kind);
            Op::Unlink { parent, name }
        }
        50..57 => {
            let kind = if rng.random_bool(0.9) {
                Some(Kind::Dir)
            } else {
                None
            };
            let (parent, name) = random_entry(model, rng, kind);
            Op::Rmdir { parent, name }
        }
        57..75 => {
            let (parent, name) = random_entry(model, rng, None);
            let new_parent = any_dir(rng);
            let siblings = model.children(&new_parent);
            let new_name = match siblings.choose(rng) {
                Some(existing) if rng.random_bool(0.5) => existing.clone(), // over an existing name
                _ => random_name(rng),
            };
            Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                noreplace: rng.random_bool(0.1),
            }
        }
        75..90 => Op::SetXattr {
            path: any_path(rng),
            name: (*XATTRS.choose(rng).expect("non-empty")).to_owned(),
            value: random_value(rng),
        },
        90..95 => {
            // The root only rarely: uid 1000 may not change it (EPERM).
            let mut path = any_path(rng);
            if path.is_empty() && rng.random_bool(0.8) {
                path = model
                    .paths_of(None)
                    .choose(rng)
                    .cloned()
                    .unwrap_or_default();
            }
            Op::SetPersistent {
                path,
                value: rng.random_bool(0.5),
            }
        }
        _ => Op::RemoveXattr {
            path: any_path(rng),
            name: (*XATTRS.choose(rng).expect("non-empty")).to_owned(),
        },
    }
}

/// Inode of `path` in the model, or an inode that cannot exist.
fn ino_or_missing(model: &Model, path: &str) -> u64 {
    model.nodes.get(path).map_or(u64::MAX - 1, |n| n.ino)
}

/// Sends `op` to the manager (inode numbers resolved from `model` first, so
/// the future does not borrow the model). Returns the new inode of a mkdir or
/// create, else 0.
fn send(
    clients: &Clients,
    model: &Model,
    op: &Op,
) -> impl Future<Output = Result<u64, Status>> + Send + 'static {
    let mut ns = clients.namespace.clone();
    let c = caller(UID, HOST);
    let op = op.clone();
    let ino = |p: &str| ino_or_missing(model, p);
    let (a, b) = match &op {
        Op::Mkdir { parent, .. }
        | Op::Create { parent, .. }
        | Op::Unlink { parent, .. }
        | Op::Rmdir { parent, .. } => (ino(parent), 0),
        Op::Rename {
            parent, new_parent, ..
        } => (ino(parent), ino(new_parent)),
        Op::SetXattr { path, .. }
        | Op::SetPersistent { path, .. }
        | Op::RemoveXattr { path, .. } => (ino(path), 0),
    };
    async move {
        match op {
            Op::Mkdir { name, .. } => {
                let r = ns
                    .mkdir(v1::MkdirRequest {
                        caller: c,
                        parent: a,
                        name,
                        mode: 0o755,
                    })
                    .await?;
                Ok(r.into_inner().ino)
            }
            Op::Create {
                name, persistent, ..
            } => {
                let attrs = persistent.map(|p| v1::RegionAttrOverrides {
                    persistent: Some(p),
                    ..Default::default()
                });
                let r = ns
                    .create(v1::CreateRequest {
                        caller: c,
                        parent: a,
                        name,
                        mode: 0o644,
                        attrs,
                        preallocate: 0,
                    })
                    .await?;
                Ok(r.into_inner().ino)
            }
            Op::Unlink { name, .. } => ns
                .unlink(v1::RemoveRequest {
                    caller: c,
                    parent: a,
                    name,
                })
                .await
                .map(|_| 0),
            Op::Rmdir { name, .. } => ns
                .rmdir(v1::RemoveRequest {
                    caller: c,
                    parent: a,
                    name,
                })
                .await
                .map(|_| 0),
            Op::Rename {
                name,
                new_name,
                noreplace,
                ..
            } => ns
                .rename(v1::RenameRequest {
                    caller: c,
                    parent: a,
                    name,
                    new_parent: b,
                    new_name,
                    flags: u32::from(noreplace),
                })
                .await
                .map(|_| 0),
            Op::SetXattr { name, value, .. } => ns
                .set_xattr(v1::SetXattrRequest {
                    caller: c,
                    ino: a,
                    name,
                    value,
                    flags: 0,
                })
                .await
                .map(|_| 0),
            Op::SetPersistent { value, .. } => ns
                .set_xattr(v1::SetXattrRequest {
                    caller: c,
                    ino: a,
                    name: PERSISTENT.to_owned(),
                    value: if value { b"1".to_vec() } else { b"0".to_vec() },
                    flags: 0,
                })
                .await
                .map(|_| 0),
            Op::RemoveXattr { name, .. } => ns
                .remove_xattr(v1::RemoveXattrRequest {
                    caller: c,
                    ino: a,
                    name,
                })
                .await
                .map(|_| 0),
        }
    }
}

/// Checks a reply that came from the manager against the model's prediction
/// and applies it to the model.
fn settle(model: &mut Model, op: &Op, reply: &Result<u64, Status>, step: usize) {
    let mut predicted = model.clone();
    let expected = predicted.apply(op, *reply.as_ref().unwrap_or(&0));
    match (reply, expected) {
        (Ok(_), Ok(())) => *model = predicted,
        (Err(status), Err(errno)) => {
            assert_eq!(
                errno_of(status),
                errno,
                "op {step} {op:?}: wrong errno: {status:?}"
            );
        }
        (Ok(_), Err(errno)) => panic!("op {step} {op:?}: succeeded, expected errno {errno}"),
        (Err(status), Ok(())) => {
            panic!("op {step} {op:?}: refused with {status:?}, expected success")
        }
    }
}

/// Every entry of directory `ino`, read in pages of `limit` (0 = server
/// default), checking cookies increase and names do not repeat.
async fn read_dir_all(clients: &mut Clients, ino: u64, limit: u32) -> Vec<v1::DirEntry> {
    let mut out: Vec<v1::DirEntry> = Vec::new();
    let mut offset = 0;
    for _ in 0..100_000 {
        let reply = clients
            .namespace
            .read_dir(v1::ReadDirRequest {
                caller: caller(UID, HOST),
                ino,
                offset,
                limit,
            })
            .await
            .unwrap_or_else(|s| panic!("readdir {ino} at {offset}: {s:?}"))
            .into_inner();
        if limit > 0 {
            assert!(
                reply.entries.len() <= limit as usize,
                "readdir returned more than limit {limit}"
            );
        }
        assert!(
            !reply.entries.is_empty() || reply.end,
            "readdir of {ino} at {offset}: empty page that is not the end"
        );
        for entry in reply.entries {
            assert!(
                entry.offset > offset && entry.offset >= 3,
                "cookie {} after {offset}",
                entry.offset
            );
            offset = entry.offset;
            out.push(entry);
        }
        if reply.end {
            let names: BTreeSet<&str> = out.iter().map(|e| e.name.as_str()).collect();
            assert_eq!(names.len(), out.len(), "readdir of {ino} repeated a name");
            return out;
        }
    }
    panic!("readdir of {ino} did not end");
}

/// Reads the xattrs the model tracks for `ino`.
async fn read_node(clients: &mut Clients, ino: u64, kind: Kind) -> Node {
    let ns = &mut clients.namespace;
    let names = ns
        .list_xattr(v1::ListXattrRequest {
            caller: caller(UID, HOST),
            ino,
        })
        .await
        .unwrap_or_else(|s| panic!("listxattr {ino}: {s:?}"))
        .into_inner()
        .names;
    let mut xattrs = BTreeMap::new();
    for name in names
        .into_iter()
        .filter(|n| n.starts_with("user.") && !n.starts_with("user.regions."))
    {
        let value = ns
            .get_xattr(v1::GetXattrRequest {
                caller: caller(UID, HOST),
                ino,
                name: name.clone(),
            })
            .await
            .unwrap_or_else(|s| panic!("getxattr {ino} {name}: {s:?}"))
            .into_inner()
            .value;
        xattrs.insert(name, value);
    }
    let persistent = ns
        .get_xattr(v1::GetXattrRequest {
            caller: caller(UID, HOST),
            ino,
            name: PERSISTENT.to_owned(),
        })
        .await
        .unwrap_or_else(|s| panic!("getxattr {ino} persistent: {s:?}"))
        .into_inner()
        .value;
    let persistent = match persistent.as_slice() {
        b"1" => true,
        b"0" => false,
        other => panic!("{PERSISTENT} of {ino} is {other:?}"),
    };
    Node {
        ino,
        kind,
        persistent,
        xattrs,
    }
}

fn kind_of(attr: &v1::Attr) -> Kind {
    match v1::FileKind::try_from(attr.kind) {
        Ok(v1::FileKind::Directory) => Kind::Dir,
        Ok(v1::FileKind::Region) => Kind::Region,
        _ => panic!("inode {} has kind {}", attr.ino, attr.kind),
    }
}

/// Walks the whole tree through the manager (ReadDir in random small
/// pages, Lookup of every entry, xattrs of every inode).
async fn walk(clients: &mut Clients, rng: &mut StdRng) -> Model {
    let mut nodes = BTreeMap::new();
    nodes.insert(String::new(), read_node(clients, ROOT_INO, Kind::Dir).await);
    let mut queue = vec![(String::new(), ROOT_INO)];
    while let Some((path, ino)) = queue.pop() {
        let limit = rng.random_range(0..=5);
        for entry in read_dir_all(clients, ino, limit).await {
            let attr = entry
                .attr
                .as_ref()
                .expect("readdir entry without attributes");
            let kind = kind_of(attr);
            let looked_up = clients
                .namespace
                .lookup(v1::LookupRequest {
                    caller: caller(UID, HOST),
                    parent: ino,
                    name: entry.name.clone(),
                })
                .await
                .unwrap_or_else(|s| panic!("lookup {:?} in {ino}: {s:?}", entry.name))
                .into_inner();
            assert_eq!(
                (looked_up.ino, looked_up.kind),
                (attr.ino, attr.kind),
                "lookup disagrees with readdir"
            );
            let child = join(&path, &entry.name);
            nodes.insert(child.clone(), read_node(clients, attr.ino, kind).await);
            if kind == Kind::Dir {
                queue.push((child, attr.ino));
            }
        }
    }
    Model { nodes }
}

/// Walks the tree and checks it against `model` (or, when an operation was
/// in flight at the kill, against `model` with that operation applied).
/// Returns the tree as found (with the inode numbers it revealed).
async fn verify(
    clients: &mut Clients,
    rng: &mut StdRng,
    model: &Model,
    in_flight: Option<&Op>,
    cycle: usize,
) -> (Model, bool) {
    let actual = walk(clients, rng).await;
    let without = model.diff(&actual);
    if without.is_empty() {
        return (actual, false);
    }
    if let Some(op) = in_flight {
        let mut with = model.clone();
        if with.apply(op, 0).is_ok() {
            let diff = with.diff(&actual);
            if diff.is_empty() {
                return (actual, true);
            }
            panic!(
                "cycle {cycle}: tree after restart matches neither the acknowledged state nor it plus the in-flight {op:?}.\n\
                 Without it: {without:#?}\nWith it: {diff:#?}"
            );
        }
    }
    panic!(
        "cycle {cycle}: tree after restart differs from the acknowledged state (in flight: {in_flight:?}): {without:#?}"
    );
}

fn seed() -> u64 {
    match std::env::var("REGIONS_TEST_SEED") {
        Ok(s) => s.parse().expect("REGIONS_TEST_SEED must be a u64"),
        Err(_) => rand::random(),
    }
}

struct Cluster {
    dir: tempfile::TempDir,
    secret: Secret,
}

impl Cluster {
    fn new() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let secret = write_secret(&dir.path().join("secret")).unwrap();
        Cluster { dir, secret }
    }

    fn data(&self) -> std::path::PathBuf {
        self.dir.path().join("data")
    }

    fn secret_file(&self) -> std::path::PathBuf {
        self.dir.path().join("secret")
    }

    async fn start(&self) -> (ManagerProcess, Clients) {
        start(&self.data(), &self.secret_file(), &self.secret).await
    }
}

async fn start(data: &Path, secret_file: &Path, secret: &Secret) -> (ManagerProcess, Clients) {
    let manager = ManagerProcess::start(data, secret_file).unwrap();
    let clients = connect(manager.addr, secret).await.unwrap();
    (manager, clients)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_namespace_ops_survive_sigkill() {
    let seed = seed();
    eprintln!("seed {seed} (set REGIONS_TEST_SEED={seed} to replay the operations)");
    let mut rng = StdRng::seed_from_u64(seed);
    let cluster = Cluster::new();
    let (mut manager, mut clients) = cluster.start().await;
    let mut model = Model::root();
    let mut total_ops = 0;
    let mut refused = 0;
    let mut per_op: BTreeMap<&str, usize> = BTreeMap::new();

    for cycle in 0..CYCLES {
        let kill_at = rng.random_range(OPS_BEFORE_KILL);
        let started = Instant::now();
        for step in 0..kill_at {
            let op = random_op(&model, &mut rng);
            let reply = send(&clients, &model, &op).await;
            if let Err(status) = &reply
                && !has_errno(status)
            {
                panic!(
                    "op {step} {op:?}: transport failure {status:?}; manager log:\n{}",
                    manager.log()
                );
            }
            refused += usize::from(reply.is_err());
            *per_op.entry(op.label()).or_default() += 1;
            settle(&mut model, &op, &reply, step);
        }
        total_ops += kill_at;

        // One more operation, with SIGKILL racing it: the kill comes after a
        // random delay of up to twice the mean latency of this cycle's
        // operations, so that it lands before, during or after the commit.
        let mean = started.elapsed() / kill_at as u32;
        let delay = mean.mul_f64(rng.random_range(0.0..2.0));
        let op = random_op(&model, &mut rng);
        let task = tokio::spawn(send(&clients, &model, &op));
        std::thread::sleep(delay);
        manager.sigkill().unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("in-flight op did not finish after the kill")
            .expect("in-flight op task panicked");
        let (in_flight, outcome) = match &reply {
            Err(status) if !has_errno(status) => (Some(op.clone()), "unknown (cut off)"),
            Ok(_) => {
                settle(&mut model, &op, &reply, kill_at);
                (None, "acknowledged")
            }
            Err(_) => {
                settle(&mut model, &op, &reply, kill_at);
                (None, "refused")
            }
        };
        drop(clients);

        let (m, c) = cluster.start().await;
        manager = m;
        clients = c;
        let (found, applied) =
            verify(&mut clients, &mut rng, &model, in_flight.as_ref(), cycle).await;
        eprintln!(
            "cycle {cycle}: killed after {kill_at} ops (mean {mean:?}) {delay:?} into {} ({outcome}{}); {} inodes verified",
            op.label(),
            if in_flight.is_some() {
                if applied {
                    ", was applied"
                } else {
                    ", was not applied"
                }
            } else {
                ""
            },
            found.nodes.len()
        );
        model = found;
    }

    // A clean stop must keep everything too.
    let status = manager.sigterm_and_wait(Duration::from_secs(5)).unwrap();
    assert!(status.success(), "manager exited with {status} on SIGTERM");
    drop(clients);
    let (_manager, mut clients) = cluster.start().await;
    let (found, _) = verify(&mut clients, &mut rng, &model, None, CYCLES).await;
    eprintln!(
        "{total_ops} ops ({refused} refused as predicted) over {CYCLES} SIGKILL cycles; final tree {} inodes; mix {per_op:?}",
        found.nodes.len()
    );
    assert!(total_ops >= 1000);
}

/// Names of `entries`.
fn names(entries: &[v1::DirEntry]) -> Vec<String> {
    entries.iter().map(|e| e.name.clone()).collect()
}

/// One ReadDir page of `dir`.
async fn page(clients: &mut Clients, dir: u64, offset: u64, limit: u32) -> v1::ReadDirReply {
    clients
        .namespace
        .read_dir(v1::ReadDirRequest {
            caller: caller(UID, HOST),
            ino: dir,
            offset,
            limit,
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readdir_pages_resume_at_their_cookie() {
    let cluster = Cluster::new();
    let (mut manager, mut clients) = cluster.start().await;
    let ns = &mut clients.namespace;
    let dir = ns
        .mkdir(v1::MkdirRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "many".into(),
            mode: 0o755,
        })
        .await
        .unwrap()
        .into_inner()
        .ino;
    let mut created = Vec::new();
    for i in 0..40 {
        let name = format!("entry-{i:02}");
        if i % 3 == 0 {
            ns.mkdir(v1::MkdirRequest {
                caller: caller(UID, HOST),
                parent: dir,
                name: name.clone(),
                mode: 0o755,
            })
            .await
            .unwrap();
        } else {
            ns.create(v1::CreateRequest {
                caller: caller(UID, HOST),
                parent: dir,
                name: name.clone(),
                mode: 0o644,
                ..Default::default()
            })
            .await
            .unwrap();
        }
        created.push(name);
    }

    // Every page size lists the same entries, in creation order, ending once.
    let full = read_dir_all(&mut clients, dir, 0).await;
    assert_eq!(names(&full), created);
    for limit in [1, 2, 3, 7, 39, 40, 41] {
        let mut got = Vec::new();
        let mut offset = 0;
        loop {
            let reply = page(&mut clients, dir, offset, limit).await;
            assert!(reply.entries.len() <= limit as usize);
            assert!(
                !reply.entries.is_empty() || reply.end,
                "empty page that is not the end"
            );
            got.extend(reply.entries.iter().map(|e| e.name.clone()));
            if let Some(last) = reply.entries.last() {
                offset = last.offset;
            }
            if reply.end {
                break;
            }
            assert!(
                got.len() <= created.len(),
                "limit {limit}: more entries than exist"
            );
        }
        assert_eq!(got, created, "limit {limit}");
    }
    // Past the last cookie: nothing, and the end.
    let last = full.last().unwrap().offset;
    let reply = page(&mut clients, dir, last, 5).await;
    assert!(reply.entries.is_empty() && reply.end);

    // Changes between pages: removing the entry whose cookie we hold, an
    // entry already returned and one not yet returned; adding one.
    let first = page(&mut clients, dir, 0, 10).await;
    assert_eq!(names(&first.entries), created[..10]);
    assert!(!first.end);
    let cookie = first.entries[9].offset;
    let ns = &mut clients.namespace;
    // entry-09 is a directory (every third entry is), the others regions.
    ns.rmdir(v1::RemoveRequest {
        caller: caller(UID, HOST),
        parent: dir,
        name: "entry-09".into(),
    })
    .await
    .unwrap();
    for name in ["entry-04", "entry-20"] {
        ns.unlink(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: dir,
            name: name.into(),
        })
        .await
        .unwrap();
    }
    ns.create(v1::CreateRequest {
        caller: caller(UID, HOST),
        parent: dir,
        name: "late".into(),
        mode: 0o644,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut rest = Vec::new();
    let mut offset = cookie;
    loop {
        let reply = page(&mut clients, dir, offset, 4).await;
        rest.extend(reply.entries.iter().map(|e| e.name.clone()));
        if let Some(e) = reply.entries.last() {
            offset = e.offset;
        }
        if reply.end {
            break;
        }
    }
    let mut expected: Vec<String> = created[10..]
        .iter()
        .filter(|n| *n != "entry-20")
        .cloned()
        .collect();
    expected.push("late".into());
    assert_eq!(rest, expected);

    // Cookies survive a restart: continue a listing on the new process.
    let before = page(&mut clients, dir, 0, 15).await;
    let cookie = before.entries.last().unwrap().offset;
    manager.sigkill().unwrap();
    drop(clients);
    let (_manager, mut clients) = cluster.start().await;
    let mut after = names(&before.entries);
    let mut offset = cookie;
    loop {
        let reply = page(&mut clients, dir, offset, 6).await;
        after.extend(reply.entries.iter().map(|e| e.name.clone()));
        if let Some(e) = reply.entries.last() {
            offset = e.offset;
        }
        if reply.end {
            break;
        }
    }
    let all = read_dir_all(&mut clients, dir, 0).await;
    assert_eq!(after, names(&all), "a listing resumed after a restart");
    assert_eq!(all.len(), 40 - 3 + 1);
}
