//! A reference-model property test of the file-system core (docs/SEMANTICS.md): random
//! sequences of operations (create, write, read, truncate, unlink, rename, mkdir, rmdir,
//! listing, and handles held open across all of these) run against the core over an
//! in-process manager and daemon, and against an in-memory model of what a program on one
//! mount must observe. Every result (bytes, sizes, listings, errnos) must match the model.
//!
//! Each case runs in a fresh directory of one cluster and removes what it made. The number of
//! cases is `PROPTEST_CASES` (default 64, about a second); set it higher for a longer search.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use regions_embedded::{Cluster, UpConfig};

use super::*;

/// File names a case uses in each directory.
const FILES: u8 = 2;
/// Directories of a case: 0 is the case's own directory, 1 and 2 are inside it.
const DIRS: u8 = 3;
/// Writes and truncates reach past two 128 KiB chunks.
const MAX_OFFSET: u32 = 300_000;
const MAX_WRITE: u32 = 70_000;

/// A kernel that caches nothing (the core's notifications go nowhere).
struct NoKernel;

impl KernelCache for NoKernel {
    fn invalidate(&self, _: u64, _: i64, _: i64) -> std::io::Result<()> {
        Ok(())
    }
    fn store(&self, _: u64, _: u64, _: &[u8]) -> std::io::Result<()> {
        Ok(())
    }
    fn invalidate_entry(&self, _: u64, _: &OsStr) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
struct At {
    dir: u8,
    file: u8,
}

#[derive(Clone, Debug)]
enum Op {
    /// `O_CREAT | O_EXCL | O_RDWR`, then close.
    Create(At),
    /// Open read-write, write `len` bytes made from `seed` at `offset`, close.
    Write {
        at: At,
        offset: u32,
        len: u32,
        seed: u8,
    },
    /// Open read-only, read to the end, close.
    Read(At),
    /// `truncate(2)` by name.
    Truncate {
        at: At,
        size: u32,
    },
    Unlink(At),
    Rename {
        from: At,
        to: At,
    },
    Mkdir(u8),
    Rmdir(u8),
    List(u8),
    /// Open read-only and keep the handle.
    Hold(At),
    /// Read to the end through a held handle (by index, modulo how many are held).
    ReadHeld(u8),
    /// Close a held handle.
    ReleaseHeld(u8),
}

/// A file name in a directory, most often the case's own directory (which always exists).
fn at() -> impl Strategy<Value = At> {
    let dir = prop_oneof![3 => Just(0u8), 2 => 1..DIRS];
    (dir, 0..FILES).prop_map(|(dir, file)| At { dir, file })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => at().prop_map(Op::Create),
        4 => (at(), 0..MAX_OFFSET, 1..MAX_WRITE, any::<u8>())
            .prop_map(|(at, offset, len, seed)| Op::Write { at, offset, len, seed }),
        3 => at().prop_map(Op::Read),
        2 => (at(), 0..MAX_OFFSET).prop_map(|(at, size)| Op::Truncate { at, size }),
        2 => at().prop_map(Op::Unlink),
        2 => (at(), at()).prop_map(|(from, to)| Op::Rename { from, to }),
        2 => (1..DIRS).prop_map(Op::Mkdir),
        1 => (1..DIRS).prop_map(Op::Rmdir),
        1 => (0..DIRS).prop_map(Op::List),
        2 => at().prop_map(Op::Hold),
        2 => any::<u8>().prop_map(Op::ReadHeld),
        1 => any::<u8>().prop_map(Op::ReleaseHeld),
    ]
}

/// The bytes of a write.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

/// A handle held open, in the model.
struct Held {
    fh: u64,
    id: u64,
    /// Nothing changed the file since the open: a read must show exactly its bytes. After a
    /// change through another handle, what an older handle sees is close-to-open's business
    /// (docs/SEMANTICS.md), and only that the read succeeds is checked.
    exact: bool,
}

/// What a program on one mount must observe.
#[derive(Default)]
struct Model {
    /// Which of the case's inner directories exist (index 0, the case's own, always does).
    dirs: [bool; DIRS as usize],
    /// Names to file ids.
    names: BTreeMap<(u8, u8), u64>,
    /// File contents by id (kept while a handle holds an unlinked file).
    files: HashMap<u64, Vec<u8>>,
    held: Vec<Held>,
    next_id: u64,
}

impl Model {
    fn dir_exists(&self, dir: u8) -> bool {
        dir == 0 || self.dirs[dir as usize]
    }

    /// The errno of reaching the file at `at`, or its id.
    fn file(&self, at: At) -> Result<u64, i32> {
        if !self.dir_exists(at.dir) {
            return Err(libc::ENOENT);
        }
        self.names
            .get(&(at.dir, at.file))
            .copied()
            .ok_or(libc::ENOENT)
    }

    /// A change to file `id`: handles opened before it may see older bytes.
    fn changed(&mut self, id: u64) {
        for h in self.held.iter_mut().filter(|h| h.id == id) {
            h.exact = false;
        }
    }
}

/// The core and where a case runs in it.
struct Case<'a> {
    fs: &'a RegionFs,
    /// Inode of the case's directory.
    base: u64,
    model: Model,
}

fn root() -> RequestCtx {
    RequestCtx::new(0, 0, std::process::id())
}

fn dir_name(dir: u8) -> String {
    format!("d{dir}")
}

fn file_name(file: u8) -> String {
    format!("f{file}")
}

/// The errno of a result (0: success).
fn errno_of<T>(r: FsResult<T>) -> i32 {
    r.err().map_or(0, |e| e.errno())
}

macro_rules! check {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(TestCaseError::fail(format!($($fmt)*)));
        }
    };
}

impl Case<'_> {
    /// Inode of directory `dir` as the core resolves it.
    fn dir_ino(&self, dir: u8) -> FsResult<u64> {
        if dir == 0 {
            return Ok(self.base);
        }
        let name = dir_name(dir);
        self.fs
            .lookup(&root(), self.base, OsStr::new(&name))
            .map(|a| a.ino)
    }

    /// Inode of the file at `at` as the core resolves it.
    fn file_ino(&self, at: At) -> FsResult<u64> {
        let parent = self.dir_ino(at.dir)?;
        let name = file_name(at.file);
        self.fs
            .lookup(&root(), parent, OsStr::new(&name))
            .map(|a| a.ino)
    }

    fn read_to_end(&self, fh: u64) -> FsResult<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            let chunk = self.fs.read(fh, out.len() as u64, 1 << 17)?;
            if chunk.is_empty() {
                return Ok(out);
            }
            out.extend_from_slice(&chunk);
        }
    }

    fn expect_errno<T>(
        &self,
        what: &str,
        got: FsResult<T>,
        want: i32,
    ) -> Result<(), TestCaseError> {
        let got = errno_of(got);
        check!(got == want, "{what}: errno {got}, the model says {want}");
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let ctx = root();
        match *op {
            Op::Create(at) => {
                let want = match (self.model.dir_exists(at.dir), self.model.file(at)) {
                    (false, _) => libc::ENOENT,
                    (true, Ok(_)) => libc::EEXIST,
                    (true, Err(_)) => 0,
                };
                let name = file_name(at.file);
                let got = self.dir_ino(at.dir).and_then(|parent| {
                    self.fs.create(
                        &ctx,
                        parent,
                        OsStr::new(&name),
                        0o644,
                        0,
                        libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                    )
                });
                if let Ok((_, opened)) = &got {
                    self.fs
                        .release(opened.fh)
                        .map_err(|e| TestCaseError::fail(format!("close after create: {e}")))?;
                }
                self.expect_errno("create", got, want)?;
                if want == 0 {
                    let id = self.model.next_id;
                    self.model.next_id += 1;
                    self.model.names.insert((at.dir, at.file), id);
                    self.model.files.insert(id, Vec::new());
                }
            }
            Op::Write {
                at,
                offset,
                len,
                seed,
            } => {
                let id = self.model.file(at);
                let got = self.file_ino(at).and_then(|ino| {
                    let opened = self.fs.open(&ctx, ino, libc::O_RDWR)?;
                    let data = pattern(seed, len as usize);
                    let wrote = self.fs.write(opened.fh, u64::from(offset), &data);
                    let closed = self.fs.release(opened.fh);
                    let n = wrote?;
                    closed?;
                    Ok(n)
                });
                match id {
                    Err(want) => self.expect_errno("write", got, want)?,
                    Ok(id) => {
                        let n = got.map_err(|e| TestCaseError::fail(format!("write: {e}")))?;
                        check!(n == len, "write of {len} bytes wrote {n}");
                        let bytes = self.model.files.entry(id).or_default();
                        let end = (offset + len) as usize;
                        if bytes.len() < end {
                            bytes.resize(end, 0);
                        }
                        bytes[offset as usize..end].copy_from_slice(&pattern(seed, len as usize));
                        self.model.changed(id);
                    }
                }
            }
            Op::Read(at) => {
                let id = self.model.file(at);
                let got = self.file_ino(at).and_then(|ino| {
                    let opened = self.fs.open(&ctx, ino, libc::O_RDONLY)?;
                    let data = self.read_to_end(opened.fh);
                    self.fs.release(opened.fh)?;
                    data
                });
                match id {
                    Err(want) => self.expect_errno("read", got, want)?,
                    Ok(id) => {
                        let data = got.map_err(|e| TestCaseError::fail(format!("read: {e}")))?;
                        let want = &self.model.files[&id];
                        check!(
                            data == *want,
                            "read {} bytes, the model holds {}; first difference at {:?}",
                            data.len(),
                            want.len(),
                            data.iter().zip(want.iter()).position(|(a, b)| a != b)
                        );
                        let size = self.file_ino(at).and_then(|ino| self.fs.getattr(&ctx, ino));
                        let size = size
                            .map_err(|e| TestCaseError::fail(format!("getattr: {e}")))?
                            .size;
                        check!(
                            size == want.len() as u64,
                            "size {size}, the model says {}",
                            want.len()
                        );
                    }
                }
            }
            Op::Truncate { at, size } => {
                let id = self.model.file(at);
                let got = self.file_ino(at).and_then(|ino| {
                    self.fs.setattr(
                        &ctx,
                        ino,
                        SetAttrIn {
                            size: Some(u64::from(size)),
                            ..SetAttrIn::default()
                        },
                        true,
                        None,
                    )
                });
                match id {
                    Err(want) => self.expect_errno("truncate", got, want)?,
                    Ok(id) => {
                        let attr =
                            got.map_err(|e| TestCaseError::fail(format!("truncate: {e}")))?;
                        check!(
                            attr.size == u64::from(size),
                            "truncate to {size} gave size {}",
                            attr.size
                        );
                        self.model
                            .files
                            .entry(id)
                            .or_default()
                            .resize(size as usize, 0);
                        self.model.changed(id);
                    }
                }
            }
            Op::Unlink(at) => {
                let want = self.model.file(at).err().unwrap_or(0);
                let name = file_name(at.file);
                let got = self
                    .dir_ino(at.dir)
                    .and_then(|parent| self.fs.unlink(&ctx, parent, OsStr::new(&name)));
                self.expect_errno("unlink", got, want)?;
                if want == 0 {
                    self.model.names.remove(&(at.dir, at.file));
                }
            }
            Op::Rename { from, to } => {
                let want = match self.model.file(from) {
                    Err(e) => e,
                    Ok(_) if !self.model.dir_exists(to.dir) => libc::ENOENT,
                    Ok(_) => 0,
                };
                let (from_name, to_name) = (file_name(from.file), file_name(to.file));
                let got = self.dir_ino(from.dir).and_then(|p| {
                    let q = self.dir_ino(to.dir)?;
                    self.fs.rename(
                        &ctx,
                        (p, OsStr::new(&from_name)),
                        (q, OsStr::new(&to_name)),
                        0,
                    )
                });
                self.expect_errno("rename", got, want)?;
                if want == 0
                    && (from.dir, from.file) != (to.dir, to.file)
                    && let Some(id) = self.model.names.remove(&(from.dir, from.file))
                {
                    self.model.names.insert((to.dir, to.file), id);
                }
            }
            Op::Mkdir(dir) => {
                let want = if self.model.dir_exists(dir) {
                    libc::EEXIST
                } else {
                    0
                };
                let name = dir_name(dir);
                let got = self.fs.mkdir(&ctx, self.base, OsStr::new(&name), 0o755, 0);
                self.expect_errno("mkdir", got, want)?;
                self.model.dirs[dir as usize] = true;
            }
            Op::Rmdir(dir) => {
                let want = if !self.model.dir_exists(dir) {
                    libc::ENOENT
                } else if self.model.names.keys().any(|(d, _)| *d == dir) {
                    libc::ENOTEMPTY
                } else {
                    0
                };
                let name = dir_name(dir);
                let got = self.fs.rmdir(&ctx, self.base, OsStr::new(&name));
                self.expect_errno("rmdir", got, want)?;
                if want == 0 {
                    self.model.dirs[dir as usize] = false;
                }
            }
            Op::List(dir) => {
                let got = self
                    .dir_ino(dir)
                    .and_then(|ino| self.fs.readdir(&ctx, ino, 0, false));
                if !self.model.dir_exists(dir) {
                    return self.expect_errno("list", got, libc::ENOENT);
                }
                let entries = got.map_err(|e| TestCaseError::fail(format!("readdir: {e}")))?;
                let names: BTreeSet<String> = entries
                    .iter()
                    .map(|e| e.name.to_string_lossy().into_owned())
                    .filter(|n| n != "." && n != "..")
                    .collect();
                let mut want: BTreeSet<String> = self
                    .model
                    .names
                    .keys()
                    .filter(|(d, _)| *d == dir)
                    .map(|(_, f)| file_name(*f))
                    .collect();
                if dir == 0 {
                    want.extend(
                        (1..DIRS)
                            .filter(|d| self.model.dirs[*d as usize])
                            .map(dir_name),
                    );
                }
                check!(
                    names == want,
                    "listing of d{dir}: {names:?}, the model says {want:?}"
                );
            }
            Op::Hold(at) => {
                let id = self.model.file(at);
                let got = self
                    .file_ino(at)
                    .and_then(|ino| self.fs.open(&ctx, ino, libc::O_RDONLY));
                match id {
                    Err(want) => self.expect_errno("open to hold", got, want)?,
                    Ok(id) => {
                        let opened = got.map_err(|e| TestCaseError::fail(format!("open: {e}")))?;
                        self.model.held.push(Held {
                            fh: opened.fh,
                            id,
                            exact: true,
                        });
                    }
                }
            }
            Op::ReadHeld(i) => {
                if self.model.held.is_empty() {
                    return Ok(());
                }
                let h = &self.model.held[i as usize % self.model.held.len()];
                let data = self
                    .read_to_end(h.fh)
                    .map_err(|e| TestCaseError::fail(format!("read through a held handle: {e}")))?;
                if h.exact {
                    let want = &self.model.files[&h.id];
                    check!(
                        data == *want,
                        "a held handle read {} bytes, the model holds {} (its name may be gone)",
                        data.len(),
                        want.len()
                    );
                }
            }
            Op::ReleaseHeld(i) => {
                if self.model.held.is_empty() {
                    return Ok(());
                }
                let i = i as usize % self.model.held.len();
                let h = self.model.held.remove(i);
                self.fs
                    .release(h.fh)
                    .map_err(|e| TestCaseError::fail(format!("close a held handle: {e}")))?;
            }
        }
        Ok(())
    }

    /// Closes held handles and removes everything the case made.
    fn clean_up(mut self) -> Result<(), TestCaseError> {
        let ctx = root();
        for h in std::mem::take(&mut self.model.held) {
            self.fs
                .release(h.fh)
                .map_err(|e| TestCaseError::fail(format!("close at the end: {e}")))?;
        }
        let names: Vec<(u8, u8)> = self.model.names.keys().copied().collect();
        for (dir, file) in names {
            let parent = self
                .dir_ino(dir)
                .map_err(|e| TestCaseError::fail(format!("clean-up lookup: {e}")))?;
            self.fs
                .unlink(&ctx, parent, OsStr::new(&file_name(file)))
                .map_err(|e| TestCaseError::fail(format!("clean-up unlink: {e}")))?;
        }
        for dir in 1..DIRS {
            if self.model.dirs[dir as usize] {
                self.fs
                    .rmdir(&ctx, self.base, OsStr::new(&dir_name(dir)))
                    .map_err(|e| TestCaseError::fail(format!("clean-up rmdir: {e}")))?;
            }
        }
        Ok(())
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

#[test]
fn random_operations_match_a_model_of_the_semantics() {
    run_model(0);
}

/// The same with small regions stored as objects (4 KiB at most: files move to chunks as
/// writes and truncates take them past it).
#[test]
fn random_operations_on_small_regions_stored_as_objects_match_the_model() {
    run_model(4096);
}

fn run_model(small_regions: u64) {
    let dir = tempfile::tempdir().expect("a data directory");
    let cluster = Cluster::start(&UpConfig {
        data_dir: dir.path().to_owned(),
        memory: 256 << 20,
        listen: "127.0.0.1:0".parse().expect("an address"),
        transport_listen: "127.0.0.1:0".parse().expect("an address"),
        share_writable_segments: false,
        transport: regions_proto::transport_choice::TransportChoice::Tcp,
        rdma_device: None,
        small_regions,
    })
    .expect("an in-process cluster");
    let client = Client::connect(cluster.client_config()).expect("a client");
    let fs = RegionFs::new(client, FsOptions::default()).expect("the core");
    fs.set_kernel(Arc::new(NoKernel));
    let next_case = AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(op(), 1..64), |ops| {
        let n = next_case.fetch_add(1, Ordering::Relaxed);
        let name = format!("case{n}");
        let base = fs
            .mkdir(&root(), ROOT_INO, OsStr::new(&name), 0o755, 0)
            .map_err(|e| TestCaseError::fail(format!("mkdir {name}: {e}")))?
            .ino;
        let mut case = Case {
            fs: &fs,
            base,
            model: Model::default(),
        };
        for (i, op) in ops.iter().enumerate() {
            case.apply(op)
                .map_err(|e| TestCaseError::fail(format!("operation {i} ({op:?}): {e}")))?;
        }
        case.clean_up()
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
