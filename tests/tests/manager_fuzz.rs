//! Hostile and malformed callers of the real manager's gRPC services: random requests from
//! random users and hosts, with names, inode numbers, handles, sizes, modes and attributes
//! drawn from both the plausible and the absurd. The manager must answer every one with a
//! result or a refusal that carries an errno (never an internal error or a dropped
//! connection), keep serving, and after a SIGKILL come back with exactly the namespace it had
//! acknowledged.
//!
//! `REGIONS_FUZZ_CASES` sets the number of requests (default 3,000, what CI runs); the
//! long run is `REGIONS_FUZZ_CASES=100000 cargo test --release -p regions-tests --test
//! manager_fuzz` (README, "Benchmarks"). `REGIONS_FUZZ_SEED` replays one run.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use regions_proto::v1;
use regions_tests::{
    Clients, Cluster, ManagerProcess, ROOT_INO, connect, fuzz_cases, fuzz_seed, has_errno,
};
use tonic::{Code, Status};

/// What the fuzzer knows of the namespace so far (inode numbers and handles it saw).
#[derive(Default)]
struct Seen {
    inos: Vec<u64>,
    dirs: Vec<u64>,
    handles: Vec<u64>,
}

struct Gen {
    rng: StdRng,
    seen: Seen,
}

impl Gen {
    fn caller(&mut self) -> Option<v1::Caller> {
        if self.rng.random_ratio(1, 50) {
            return None;
        }
        let uid = match self.rng.random_range(0..10) {
            0 | 1 => 0,
            2..=6 => 1000,
            7 => 1001,
            8 => u32::MAX,
            _ => self.rng.random(),
        };
        let groups = (0..self.rng.random_range(0..3))
            .map(|_| self.rng.random_range(999..1003))
            .collect();
        Some(v1::Caller {
            uid,
            gid: if self.rng.random_bool(0.8) {
                uid
            } else {
                self.rng.random()
            },
            groups,
            pid: self.rng.random_range(0..5),
            host_id: match self.rng.random_range(0..8) {
                0 => 0,
                1 => self.rng.random(),
                _ => 1,
            },
            by_inode: self.rng.random_bool(0.3),
            // A session the manager never opened: nothing is granted or spared.
            lease_session: if self.rng.random_bool(0.2) {
                self.rng.random()
            } else {
                0
            },
        })
    }

    fn pick(&mut self, from: &[u64]) -> Option<u64> {
        (!from.is_empty()).then(|| from[self.rng.random_range(0..from.len())])
    }

    fn ino(&mut self) -> u64 {
        match self.rng.random_range(0..10) {
            0 => 0,
            1 => ROOT_INO,
            2 => self.rng.random(),
            3 => u64::MAX,
            _ => {
                let inos = self.seen.inos.clone();
                self.pick(&inos).unwrap_or(ROOT_INO)
            }
        }
    }

    fn dir(&mut self) -> u64 {
        if self.rng.random_ratio(1, 8) {
            return self.ino();
        }
        let dirs = self.seen.dirs.clone();
        self.pick(&dirs).unwrap_or(ROOT_INO)
    }

    fn name(&mut self) -> String {
        match self.rng.random_range(0..24) {
            0 => String::new(),
            1 => ".".into(),
            2 => "..".into(),
            3 => "a/b".into(),
            4 => "x".repeat(self.rng.random_range(250..300)),
            5 => "nul\0byte".into(),
            6 => (0..self.rng.random_range(1..8))
                .map(|_| char::from_u32(self.rng.random_range(0x20..0x3000)).unwrap_or('?'))
                .collect(),
            _ => format!("n{}", self.rng.random_range(0..4)),
        }
    }

    fn mode(&mut self) -> u32 {
        match self.rng.random_range(0..4) {
            0 => self.rng.random(),
            1 => 0,
            _ => [0o644, 0o600, 0o755, 0o700, 0o777, 0o1777, 0o4755, 0o2775]
                [self.rng.random_range(0..8)],
        }
    }

    fn size(&mut self) -> u64 {
        match self.rng.random_range(0..8) {
            0 => 0,
            1 => u64::MAX,
            2 => self.rng.random(),
            3 => 1 << 40,
            4 => self.rng.random_range(0..(4 << 20)),
            _ => self.rng.random_range(0..(256 << 10)),
        }
    }

    fn xattr_name(&mut self) -> String {
        let names = [
            "user.note",
            "user.regions.persistent",
            "user.regions.onewriter",
            "user.regions.multihosted",
            "user.regions.fixvaddr",
            "user.regions.hostalloc",
            "user.regions.hosts",
            "user.regions.vaddr",
            "user.regions.nonsense",
            "security.capability",
            "trusted.x",
            "",
        ];
        if self.rng.random_ratio(1, 10) {
            return self.name();
        }
        names[self.rng.random_range(0..names.len())].to_owned()
    }

    fn value(&mut self) -> Vec<u8> {
        match self.rng.random_range(0..6) {
            0 => b"1".to_vec(),
            1 => b"0".to_vec(),
            2 => b"1,2".to_vec(),
            3 => vec![0xff; self.rng.random_range(0..70_000)],
            _ => (0..self.rng.random_range(0..40))
                .map(|_| self.rng.random())
                .collect(),
        }
    }

    fn time(&mut self) -> Option<v1::TimeSet> {
        match self.rng.random_range(0..4) {
            0 => None,
            1 => Some(v1::TimeSet {
                how: Some(v1::time_set::How::Now(self.rng.random())),
            }),
            2 => Some(v1::TimeSet { how: None }),
            _ => Some(v1::TimeSet {
                how: Some(v1::time_set::How::Time(v1::Timespec {
                    sec: self.rng.random(),
                    nsec: self.rng.random(),
                })),
            }),
        }
    }
}

/// What one answer taught the fuzzer.
fn learn(seen: &mut Seen, attr: Option<&v1::Attr>, handle: u64) {
    if let Some(a) = attr {
        if !seen.inos.contains(&a.ino) {
            seen.inos.push(a.ino);
        }
        if a.kind == v1::FileKind::Directory as i32 && !seen.dirs.contains(&a.ino) {
            seen.dirs.push(a.ino);
        }
    }
    if handle != 0 {
        seen.handles.push(handle);
    }
}

/// A refusal is fine when it is the manager's (an errno) or a plain argument check; anything
/// else means the request hurt it.
fn acceptable(status: &Status) -> bool {
    has_errno(status)
        || matches!(
            status.code(),
            Code::InvalidArgument | Code::OutOfRange | Code::NotFound | Code::PermissionDenied
        )
}

async fn one(c: &mut Clients, g: &mut Gen) -> (&'static str, Result<(), Status>) {
    let caller = g.caller();
    macro_rules! call {
        ($name:literal, $fut:expr, |$r:ident| $learn:expr) => {{
            let result = $fut.await.map(|$r| {
                let $r = $r.into_inner();
                $learn
            });
            ($name, result)
        }};
    }
    match g.rng.random_range(0..26) {
        0 => call!(
            "lookup",
            c.namespace.lookup(v1::LookupRequest {
                caller,
                parent: g.dir(),
                name: g.name(),
            }),
            |a| learn(&mut g.seen, Some(&a), 0)
        ),
        1 => call!(
            "getattr",
            c.namespace.get_attr(v1::GetAttrRequest {
                caller,
                ino: g.ino()
            }),
            |a| learn(&mut g.seen, Some(&a), 0)
        ),
        2 => {
            let size = g.rng.random_ratio(1, 3).then(|| g.size());
            let mode = g.rng.random_bool(0.3).then(|| g.mode());
            let uid = g
                .rng
                .random_ratio(1, 5)
                .then(|| g.rng.random_range(0..1003));
            let gid = g
                .rng
                .random_ratio(1, 5)
                .then(|| g.rng.random_range(0..1003));
            let (atime, mtime) = (g.time(), g.time());
            call!(
                "setattr",
                c.namespace.set_attr(v1::SetAttrRequest {
                    caller,
                    ino: g.ino(),
                    mode,
                    uid,
                    gid,
                    size,
                    atime,
                    mtime,
                    through_write_handle: g.rng.random_bool(0.3),
                }),
                |a| learn(&mut g.seen, Some(&a), 0)
            )
        }
        3 | 4 => call!(
            "mkdir",
            c.namespace.mkdir(v1::MkdirRequest {
                caller,
                parent: g.dir(),
                name: g.name(),
                mode: g.mode(),
            }),
            |a| learn(&mut g.seen, Some(&a), 0)
        ),
        5 | 6 => {
            let attrs = g.rng.random_ratio(1, 3).then(|| v1::RegionAttrOverrides {
                persistent: Some(g.rng.random()),
                onewriter: g.rng.random_bool(0.3).then(|| g.rng.random()),
                ..Default::default()
            });
            call!(
                "create",
                c.namespace.create(v1::CreateRequest {
                    caller,
                    parent: g.dir(),
                    name: g.name(),
                    mode: g.mode(),
                    attrs,
                    preallocate: if g.rng.random_bool(0.7) { 0 } else { g.size() },
                }),
                |a| learn(&mut g.seen, Some(&a), 0)
            )
        }
        7 => call!(
            "rmdir",
            c.namespace.rmdir(v1::RemoveRequest {
                caller,
                parent: g.dir(),
                name: g.name(),
            }),
            |_r| ()
        ),
        8 => call!(
            "unlink",
            c.namespace.unlink(v1::RemoveRequest {
                caller,
                parent: g.dir(),
                name: g.name(),
            }),
            |_r| ()
        ),
        9 => call!(
            "rename",
            c.namespace.rename(v1::RenameRequest {
                caller,
                parent: g.dir(),
                name: g.name(),
                new_parent: g.dir(),
                new_name: g.name(),
                flags: [0, 0, 1, 2, 3, g.rng.random()][g.rng.random_range(0..6)],
            }),
            |_r| ()
        ),
        10 => call!(
            "readdir",
            c.namespace.read_dir(v1::ReadDirRequest {
                caller,
                ino: g.dir(),
                offset: if g.rng.random_bool(0.7) {
                    0
                } else {
                    g.rng.random()
                },
                limit: g.rng.random_range(0..5),
            }),
            |r| {
                for e in &r.entries {
                    learn(&mut g.seen, e.attr.as_ref(), 0);
                }
            }
        ),
        11 => call!(
            "getxattr",
            c.namespace.get_xattr(v1::GetXattrRequest {
                caller,
                ino: g.ino(),
                name: g.xattr_name(),
            }),
            |_r| ()
        ),
        12 => call!(
            "setxattr",
            c.namespace.set_xattr(v1::SetXattrRequest {
                caller,
                ino: g.ino(),
                name: g.xattr_name(),
                value: g.value(),
                flags: g.rng.random_range(0..4),
            }),
            |_r| ()
        ),
        13 => call!(
            "removexattr",
            c.namespace.remove_xattr(v1::RemoveXattrRequest {
                caller,
                ino: g.ino(),
                name: g.xattr_name(),
            }),
            |_r| ()
        ),
        14 => call!(
            "access",
            c.namespace.access(v1::AccessRequest {
                caller,
                ino: g.ino(),
                mask: g.rng.random_range(0..16),
            }),
            |_r| ()
        ),
        15 | 16 => call!(
            "open",
            c.regions.open(v1::OpenRequest {
                caller,
                ino: g.ino(),
                write: g.rng.random(),
            }),
            |r| learn(&mut g.seen, r.attr.as_ref(), r.handle)
        ),
        17 => {
            let handles = g.seen.handles.clone();
            let handle = if g.rng.random_bool(0.8) {
                g.pick(&handles).unwrap_or(0)
            } else {
                g.rng.random()
            };
            call!(
                "close",
                c.regions.close(v1::CloseRequest {
                    caller,
                    handle,
                    wrote_within_size: g.rng.random(),
                }),
                |_r| ()
            )
        }
        18 => call!(
            "extend",
            c.regions.extend(v1::ExtendRequest {
                caller,
                ino: g.ino(),
                size: g.size(),
                capacity: if g.rng.random_bool(0.8) { 0 } else { g.size() },
                touch: g.rng.random(),
                chunks: g.rng.random_bool(0.1),
            }),
            |r| learn(&mut g.seen, r.attr.as_ref(), 0)
        ),
        19 => call!(
            "truncate",
            c.regions.truncate(v1::TruncateRequest {
                caller,
                ino: g.ino(),
                size: g.size(),
            }),
            |r| learn(&mut g.seen, r.attr.as_ref(), 0)
        ),
        20 => call!(
            "get_map",
            c.regions.get_map(v1::GetMapRequest {
                caller,
                ino: g.ino(),
                known_version: if g.rng.random_bool(0.8) {
                    0
                } else {
                    g.rng.random()
                },
                want_capability: g.rng.random(),
                write: g.rng.random(),
                handle: if g.rng.random_bool(0.5) {
                    0
                } else {
                    g.rng.random_range(0..64)
                },
            }),
            |_r| ()
        ),
        21 => {
            let len = [0, 1, 20, 4095, 4096, 5000][g.rng.random_range(0..6)];
            let target: Vec<u8> = (0..len).map(|_| g.rng.random()).collect();
            call!(
                "symlink",
                c.namespace.symlink(v1::SymlinkRequest {
                    caller,
                    parent: g.dir(),
                    name: g.name(),
                    target,
                }),
                |a| learn(&mut g.seen, Some(&a), 0)
            )
        }
        22 => call!(
            "readlink",
            c.namespace.read_link(v1::GetAttrRequest {
                caller,
                ino: g.ino()
            }),
            |_r| ()
        ),
        23 => call!(
            "link",
            c.namespace.link(v1::LinkRequest {
                caller,
                ino: g.ino(),
                new_parent: g.dir(),
                new_name: g.name(),
            }),
            |a| learn(&mut g.seen, Some(&a), 0)
        ),
        24 => call!(
            "mknod",
            c.namespace.make_node(v1::MakeNodeRequest {
                caller,
                parent: g.dir(),
                name: g.name(),
                kind: g.rng.random_range(-1..9),
                mode: g.mode(),
                rdev: g.rng.random(),
            }),
            |a| learn(&mut g.seen, Some(&a), 0)
        ),
        _ => call!(
            "heartbeat",
            c.cluster.heartbeat(v1::HeartbeatRequest {
                host_id: g.rng.random_range(2..u32::MAX),
                incarnation: g.rng.random(),
            }),
            |_r| ()
        ),
    }
}

/// Every name under the root as root sees it: path → (ino, kind, mode, uid, gid, size).
async fn tree(c: &mut Clients) -> BTreeMap<String, (u64, i32, u32, u32, u32, u64)> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![(String::new(), ROOT_INO)];
    while let Some((path, ino)) = dirs.pop() {
        let mut offset = 0;
        loop {
            let reply = c
                .namespace
                .read_dir(v1::ReadDirRequest {
                    caller: regions_tests::caller(0, 1),
                    ino,
                    offset,
                    limit: 0,
                })
                .await
                .unwrap_or_else(|e| panic!("readdir of {path:?} (inode {ino}): {e}"))
                .into_inner();
            for e in &reply.entries {
                offset = e.offset;
                if e.name == "." || e.name == ".." {
                    continue;
                }
                let a = e.attr.clone().unwrap_or_default();
                let p = format!("{path}/{}", e.name);
                if a.kind == v1::FileKind::Directory as i32 {
                    dirs.push((p.clone(), a.ino));
                }
                out.insert(p, (a.ino, a.kind, a.mode, a.uid, a.gid, a.size));
            }
            if reply.end || reply.entries.is_empty() {
                break;
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_never_hurt_the_manager_and_acknowledged_changes_survive_a_kill() {
    let seed = fuzz_seed();
    let mut cluster = Cluster::start(1, "256M").expect("cluster");
    let mut c = connect(cluster.manager.addr, &cluster.secret)
        .await
        .expect("connect");
    let mut g = Gen {
        rng: StdRng::seed_from_u64(seed),
        seen: Seen::default(),
    };
    // A world-writable playground, so that ordinary users have somewhere to create.
    let play = c
        .namespace
        .mkdir(v1::MkdirRequest {
            caller: regions_tests::caller(0, 1),
            parent: ROOT_INO,
            name: "play".into(),
            mode: 0o777,
        })
        .await
        .expect("mkdir play")
        .into_inner();
    learn(&mut g.seen, Some(&play), 0);
    let mut counts: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
    for i in 0..fuzz_cases(3_000) {
        let (name, result) = tokio::time::timeout(Duration::from_secs(30), one(&mut c, &mut g))
            .await
            .unwrap_or_else(|_| panic!("request {i} got no answer in 30 s (seed {seed})"));
        let entry = counts.entry(name).or_default();
        match result {
            Ok(()) => entry.0 += 1,
            Err(status) => {
                entry.1 += 1;
                if std::env::var_os("REGIONS_FUZZ_VERBOSE").is_some() {
                    eprintln!("{name}: {}", status.message());
                }
                assert!(
                    acceptable(&status),
                    "request {i} ({name}) hurt the manager: {status:?} (seed {seed})"
                );
            }
        }
    }
    eprintln!("answered (ok, refused): {counts:?}");
    let ok: u32 = counts.values().map(|(ok, _)| ok).sum();
    assert!(
        ok > 0,
        "no request succeeded: the fuzzer is not reaching the manager"
    );

    // Everything acknowledged is durable: kill the manager and compare the namespace.
    let before = tree(&mut c).await;
    cluster.manager.sigkill().expect("kill the manager");
    let data = cluster.dir.path().join("manager");
    let restarted = ManagerProcess::start(&data, &cluster.secret_file)
        .expect("the manager restarts on its data");
    let mut c = connect(restarted.addr, &cluster.secret)
        .await
        .expect("reconnect");
    let after = tree(&mut c).await;
    assert_eq!(before, after, "the namespace after a SIGKILL (seed {seed})");
}
