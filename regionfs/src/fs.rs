//! The file-system core: every operation of the mount as a plain method
//! over a [`regions::Client`], driven by the FUSE adapter ([`crate::fuse`])
//! and by tests without FUSE.
//!
//! Methods take the kernel's [`RequestCtx`] (uid, gid, pid) and turn it into
//! a [`v1::Caller`] for this mount's host; the manager checks permissions
//! (regionfs does not mount with `default_permissions`). Failures are
//! [`FsError`]s whose [`FsError::errno`] is what the application sees.
//!
//! Caching (docs/SEMANTICS.md, "Close-to-open consistency"): the kernel page cache is the
//! paper's write-back cache. Writes reach the region synchronously when the
//! kernel sends them; an open keeps the cached pages only when the region's
//! mtime and size at the manager are what this mount last saw
//! (close-to-open consistency), and a handle that wrote bumps the region's
//! mtime when flushed, synced or released, so that other mounts drop their
//! copies at their next open. With [`CacheMode::Passthrough`] a read-only
//! open of a region held wholly on this host reads its memory directly.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use regions::{Client, ROOT_INO, Region, SizePolicy};
use regions_proto::layout::CHUNK_SIZE;
use regions_proto::lease_contact::LeaseContact;
use regions_proto::v1::{self, FileKind};

use crate::error::{FsError, FsResult};
use crate::identity::{Identity, RequestCtx};
use crate::ioctl;
use crate::names;
use crate::owners::{Owned, OwnerWatch};
use crate::pseudo::{self, Node};
use regions::manager_client::{ManagerClient, SetAttrIn, SetTime};

/// Page size of the kernel page cache.
const PAGE: u64 = 4096;
/// Entries asked of the manager per readdir call.
const READDIR_BATCH: u32 = 512;
/// Prefix of the region attributes (paper 003 §5.4).
pub const REGION_XATTR_PREFIX: &str = "user.regions.";
/// The host agent socket of this mount (answered by regionfs, read-only).
pub const MOUNT_XATTR_AGENT: &str = "user.regions.agent";
/// The host id of this mount (answered by regionfs, read-only).
pub const MOUNT_XATTR_HOSTID: &str = "user.regions.hostid";
/// `__FMODE_EXEC`: the open flag of an execve.
const FMODE_EXEC: i32 = 0x20;
/// How long attributes given to the kernel answer its re-reads while this
/// mount writes the region (the kernel's attribute TTL).
const ATTR_REUSE: Duration = Duration::from_secs(1);
/// The attribute the kernel reads before each first write to a file.
const SECURITY_CAPABILITY: &str = "security.capability";
/// Bytes moved per step of prefetch and zeroing.
const STEP: u64 = 1 << 20;

/// How the kernel caches region data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheMode {
    /// FUSE writeback cache: writes are buffered in the page cache and sent
    /// on fsync, msync, close or memory pressure.
    #[default]
    Writeback,
    /// Write-through page cache, and read-only opens of regions held wholly
    /// on this host served from their memory by FUSE passthrough (the
    /// kernel refuses passthrough together with the writeback cache).
    Passthrough,
}

/// Settings of a [`RegionFs`].
#[derive(Clone, Debug)]
pub struct FsOptions {
    /// How the kernel caches region data.
    pub cache: CacheMode,
    /// How long an open for writing retries `ETXTBSY` (a ONEWRITER region
    /// whose previous writer closed a moment ago: FUSE releases
    /// asynchronously).
    pub busy_retry: Duration,
    /// Delete non-persistent regions when their creating process exits.
    pub watch_owners: bool,
}

impl Default for FsOptions {
    fn default() -> Self {
        FsOptions {
            cache: CacheMode::Writeback,
            busy_retry: Duration::from_millis(300),
            watch_owners: true,
        }
    }
}

/// What the core asks of the kernel's cache (FUSE notifications).
pub trait KernelCache: Send + Sync {
    /// Drops cached attributes and, for `offset >= 0`, the cached pages of
    /// `[offset, offset + len)` (`len <= 0`: to the end).
    fn invalidate(&self, ino: u64, offset: i64, len: i64) -> std::io::Result<()>;
    /// Puts `data` into the page cache at `offset` (growing the kernel's
    /// file size when it ends past it).
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> std::io::Result<()>;
    /// Drops the cached entry `name` of directory `parent`.
    fn invalidate_entry(&self, parent: u64, name: &OsStr) -> std::io::Result<()>;
}

/// How an open file's data moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// Through the page cache and this process.
    Cached,
    /// FUSE passthrough to the region's segment memfd.
    Passthrough,
    /// Direct I/O through this process (no page cache).
    Direct,
}

impl IoMode {
    fn name(self) -> &'static str {
        match self {
            IoMode::Cached => "cached",
            IoMode::Passthrough => "passthrough",
            IoMode::Direct => "direct",
        }
    }
}

/// The result of an open or create.
#[derive(Debug)]
pub struct Opened {
    /// The file handle the kernel passes back.
    pub fh: u64,
    /// Keep the kernel's cached pages (FOPEN_KEEP_CACHE).
    pub keep_cache: bool,
    /// Bypass the page cache (FOPEN_DIRECT_IO).
    pub direct_io: bool,
    /// Serve the file by FUSE passthrough.
    pub passthrough: bool,
    /// The descriptor to pass through to (absent: reuse the inode's).
    pub backing: Option<OwnedFd>,
}

/// The result of a release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    /// The inode the handle was open on.
    pub ino: u64,
    /// The handle was served by passthrough.
    pub passthrough: bool,
}

/// One directory entry.
#[derive(Clone, Debug)]
pub struct DirEntryOut {
    /// The entry's inode.
    pub ino: u64,
    /// Cookie to resume after this entry.
    pub cookie: u64,
    /// The entry's name.
    pub name: std::ffi::OsString,
    /// The entry's kind.
    pub kind: FileKind,
    /// Attributes (absent for "." and "..").
    pub attr: Option<v1::Attr>,
}

/// File-system statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatFs {
    /// Blocks of cluster memory in all.
    pub blocks: u64,
    /// Free blocks.
    pub bfree: u64,
    /// Free blocks for unprivileged users (the same).
    pub bavail: u64,
    /// Inodes in all.
    pub files: u64,
    /// Free inodes.
    pub ffree: u64,
    /// Block size (a chunk).
    pub bsize: u32,
    /// Longest name.
    pub namelen: u32,
}

/// An extended attribute answer: its size (probe) or its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XattrOut {
    /// The size of the value (the caller probed with size 0).
    Size(u32),
    /// The value.
    Data(Vec<u8>),
}

/// A region open through this mount.
struct RegionHandle {
    region: Region,
    caller: v1::Caller,
    write: bool,
    io: Mutex<IoMode>,
    /// The manager closed this open's handle for it: this host's lease ended (see
    /// [`RegionFs::check_handles`]). Every use answers `EIO` from then on.
    fenced: AtomicBool,
}

enum Body {
    Region(Box<RegionHandle>),
    /// A pseudo file's content, generated at open.
    Pseudo(Vec<u8>),
}

struct Handle {
    ino: u64,
    pid: u32,
    uid: u32,
    body: Body,
}

impl Handle {
    fn region(&self) -> FsResult<&RegionHandle> {
        match &self.body {
            Body::Region(r) if r.fenced.load(Ordering::Relaxed) => Err(FsError::Fenced(format!(
                "region {:#x} was open here when this host's lease ended, so the manager \
                 closed the open (the region may have been deleted since): close the file and \
                 open it again",
                self.ino
            ))),
            Body::Region(r) => Ok(r),
            Body::Pseudo(_) => Err(FsError::BadHandle(format!(
                "inode {:#x} is a metadata file",
                self.ino
            ))),
        }
    }
}

/// What this mount knows of a region inode the kernel holds.
#[derive(Debug, Default)]
struct InodeState {
    /// Manager mtime and size when this mount last made its cache agree.
    seen: Option<(v1::Timespec, u64)>,
    /// The file size the kernel believes (writeback mode keeps its own).
    kernel_size: u64,
    /// Written since the last mtime update at the manager.
    dirty: bool,
    cached_opens: u32,
    passthrough_opens: u32,
    /// The attributes last given to the kernel, and when (answers the
    /// kernel's re-reads while this mount writes the region).
    attr: Option<(v1::Attr, Instant)>,
    /// When this mount created the region (cleared when an extended
    /// attribute is set or removed through it).
    created_here: Option<Instant>,
}

/// What this mount knows of a directory.
#[derive(Clone, Copy, Debug, Default)]
struct DirInfo {
    /// Its parent (for "..").
    parent: Option<u64>,
    /// Its permission bits.
    mode: u32,
}

/// Mtime and size of an attribute.
fn stamp(attr: &v1::Attr) -> (v1::Timespec, u64) {
    (attr.mtime.unwrap_or_default(), attr.size)
}

fn is_dir(attr: &v1::Attr) -> bool {
    attr.kind() == FileKind::Directory
}

/// Whether `attr` is a region's (not a directory, symlink or special file).
fn is_region(attr: &v1::Attr) -> bool {
    attr.kind() == FileKind::Region
}

/// The special file kind `mknod` makes for file type `mode & S_IFMT`.
fn node_kind(mode: u32) -> Option<FileKind> {
    match mode & libc::S_IFMT {
        libc::S_IFIFO => Some(FileKind::Fifo),
        libc::S_IFSOCK => Some(FileKind::Socket),
        libc::S_IFCHR => Some(FileKind::CharDevice),
        libc::S_IFBLK => Some(FileKind::BlockDevice),
        _ => None,
    }
}

fn wire(name: &OsStr) -> FsResult<std::borrow::Cow<'_, str>> {
    names::to_wire(name)
}

fn utf8(name: &OsStr) -> FsResult<&str> {
    name.to_str().ok_or_else(|| {
        FsError::Invalid(format!(
            "name {name:?} is not UTF-8; regions names are UTF-8 strings"
        ))
    })
}

fn now_ts() -> v1::Timespec {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    v1::Timespec {
        sec: d.as_secs() as i64,
        nsec: d.subsec_nanos(),
    }
}

/// The regions file system.
pub struct RegionFs {
    client: Client,
    identity: Arc<Identity>,
    options: FsOptions,
    handles: RwLock<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    inodes: Mutex<HashMap<u64, InodeState>>,
    /// Directories the kernel learned through this mount.
    dirs: Mutex<HashMap<u64, DirInfo>>,
    /// Directories removed through this mount, for fstat of an open one.
    removed_dirs: Mutex<HashMap<u64, v1::Attr>>,
    /// Paths of mirrored regions under `.regions/files`, learned from lookups.
    pseudo_paths: Mutex<HashMap<u64, String>>,
    owners: Option<OwnerWatch>,
    kernel: OnceLock<Arc<dyn KernelCache>>,
    passthrough: AtomicBool,
    started: v1::Timespec,
    /// Per-thread default attributes (rsetdefaultattr).
    thread_defaults: crate::thread_defaults::ThreadDefaults,
    /// Inode generations given to the kernel (kept across forgets: a
    /// generation is bumped to make the kernel drop an inode whose size it
    /// would otherwise keep; see [`RegionFs::open`]).
    generations: Mutex<HashMap<u64, u64>>,
    /// Closes released handles at the manager off the kernel's release
    /// path (the written size is already published at flush).
    closer: Closer,
    /// When the manager last answered [`RegionFs::check_handles`], and its lease.
    contact: LeaseContact,
}

/// `Err(Fenced)` once the manager has not answered this mount's handle checks for most of a
/// lease (see [`regions_proto::lease_contact`]): writes are refused then.
fn check_contact(contact: &LeaseContact) -> FsResult<()> {
    match contact.out_of_touch() {
        None => Ok(()),
        Some((silent, lease)) => Err(FsError::Fenced(format!(
            "the manager has not answered this mount for {} ms (its lease is {} ms): writes \
             are refused until it does, since it may give this host's locks and handles to \
             others",
            silent.as_millis(),
            lease.as_millis()
        ))),
    }
}

/// A thread that drops released handles (closing them at the manager), so
/// that a release costs the application no manager round trip.
struct Closer {
    queue: Option<std::sync::mpsc::Sender<Arc<Handle>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Closer {
    fn start() -> Closer {
        let (tx, rx) = std::sync::mpsc::channel::<Arc<Handle>>();
        let thread = std::thread::Builder::new()
            .name("regionfs-close".into())
            .spawn(move || {
                for handle in rx {
                    drop(handle);
                }
            });
        match thread {
            Ok(t) => Closer {
                queue: Some(tx),
                thread: Some(t),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the handle closer thread; closing on release");
                Closer {
                    queue: None,
                    thread: None,
                }
            }
        }
    }

    /// Closes `handle` in the background (at once when no thread runs).
    fn close(&self, handle: Arc<Handle>) {
        if let Some(tx) = &self.queue {
            // A send fails only when the thread is gone: the handle comes
            // back and is dropped (closed) here.
            let _ = tx.send(handle);
        }
    }
}

impl Drop for Closer {
    /// Waits for the handles still queued to close.
    fn drop(&mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl RegionFs {
    /// A file system over `client` (whose configuration names the manager,
    /// the secret, this host and its agent socket).
    pub fn new(client: Client, options: FsOptions) -> FsResult<RegionFs> {
        let identity = Arc::new(Identity::new(client.config().host_id));
        let owners = if options.watch_owners {
            let client = client.clone();
            let identity = Arc::clone(&identity);
            let reaper = Arc::new(move |o: &Owned| reap(client.manager(), &identity, o));
            Some(OwnerWatch::start(reaper).map_err(|source| FsError::Io {
                what: "cannot start the owner watcher thread".into(),
                source,
            })?)
        } else {
            None
        };
        Ok(RegionFs {
            client,
            identity,
            options,
            handles: RwLock::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            inodes: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            removed_dirs: Mutex::new(HashMap::new()),
            pseudo_paths: Mutex::new(HashMap::new()),
            owners,
            kernel: OnceLock::new(),
            passthrough: AtomicBool::new(false),
            started: now_ts(),
            thread_defaults: Default::default(),
            generations: Mutex::new(HashMap::new()),
            closer: Closer::start(),
            contact: LeaseContact::new(),
        })
    }

    /// The client the file system runs on.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The settings.
    pub fn options(&self) -> &FsOptions {
        &self.options
    }

    /// Connects the kernel cache (FUSE notifier); set once, at mount.
    pub fn set_kernel(&self, kernel: Arc<dyn KernelCache>) {
        if self.kernel.set(kernel).is_err() {
            tracing::warn!("kernel cache connected twice; keeping the first");
        }
    }

    /// Tells the core whether the kernel accepted FUSE passthrough.
    pub fn set_passthrough(&self, enabled: bool) {
        self.passthrough.store(enabled, Ordering::Relaxed);
    }

    /// The manager's services (the client's one connection).
    fn manager(&self) -> &ManagerClient {
        self.client.manager()
    }

    fn caller(&self, ctx: &RequestCtx) -> v1::Caller {
        self.identity.caller(ctx)
    }

    fn writeback(&self) -> bool {
        self.options.cache == CacheMode::Writeback
    }

    fn lock_inodes(&self) -> std::sync::MutexGuard<'_, HashMap<u64, InodeState>> {
        self.inodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn handle(&self, fh: u64) -> FsResult<Arc<Handle>> {
        self.handles
            .read()
            .ok()
            .and_then(|h| h.get(&fh).cloned())
            .ok_or_else(|| FsError::BadHandle(format!("file handle {fh} is not open")))
    }

    fn add_handle(&self, handle: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut h) = self.handles.write() {
            h.insert(fh, Arc::new(handle));
            metrics::gauge!("regions_fuse_open_handles").set(h.len() as f64);
        }
        fh
    }

    /// Asks the manager which of this mount's open region handles it still holds, and fences
    /// the opens whose handles it closed (this host's lease ended while they were open, behind
    /// a partition or a stalled daemon): they answer `EIO` from now on, and their cached pages
    /// are dropped so that no read is served from the page cache either. Returns how many
    /// opens were fenced now.
    pub fn check_handles(&self) -> FsResult<usize> {
        // Ids only: holding the handles across the call would hold up their close.
        let ids: Vec<u64> = self
            .handles
            .read()
            .map(|h| {
                h.values()
                    .filter_map(|x| match &x.body {
                        Body::Region(r) if !r.fenced.load(Ordering::Relaxed) => {
                            Some(r.region.handle())
                        }
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        // Asked even with nothing open: the answer is also this mount's sign of life.
        let reply = self
            .client
            .manager()
            .check_handles(self.client.caller(), &ids)?;
        self.contact.heard(Duration::from_millis(reply.lease_ms));
        if reply.gone.is_empty() {
            return Ok(0);
        }
        let gone: HashSet<u64> = reply.gone.into_iter().collect();
        // (inode, handle, opener) of the opens fenced now.
        let fenced: Vec<(u64, u64, u32)> = self
            .handles
            .read()
            .map(|h| {
                h.values()
                    .filter_map(|x| match &x.body {
                        Body::Region(r)
                            if gone.contains(&r.region.handle())
                                && !r.fenced.swap(true, Ordering::Relaxed) =>
                        {
                            Some((x.ino, r.region.handle(), x.pid))
                        }
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        for &(ino, handle, pid) in &fenced {
            tracing::warn!(
                ino,
                handle,
                pid,
                "the manager closed this open when the host's lease ended: it answers EIO now"
            );
            if let Some(kernel) = self.kernel.get()
                && let Err(e) = kernel.invalidate(ino, 0, 0)
            {
                tracing::debug!(ino, error = %e, "cannot drop the cached pages of a fenced open");
            }
        }
        Ok(fenced.len())
    }

    /// Checks the open handles with the manager every `every` (see
    /// [`RegionFs::check_handles`]), or every quarter lease when that is shorter, on a thread
    /// of its own, until the file system is dropped.
    pub fn start_handle_watch(self: &Arc<Self>, every: Duration) -> std::io::Result<()> {
        let fs = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("regionfs-handle-watch".into())
            .spawn(move || {
                let mut step = every;
                loop {
                    std::thread::sleep(step);
                    let Some(fs) = fs.upgrade() else { return };
                    if let Some(lease) = fs.contact.lease() {
                        step = every.min(lease / 4).max(Duration::from_millis(20));
                    }
                    if let Err(e) = fs.check_handles() {
                        // The manager is out of reach (a partition, a restart): try again.
                        tracing::debug!(error = %e, "cannot check open handles with the manager");
                    }
                }
            })
            .map(drop)
    }

    /// Open region handles of `ino`.
    fn handles_of(&self, ino: u64) -> Vec<Arc<Handle>> {
        self.handles
            .read()
            .map(|h| h.values().filter(|x| x.ino == ino).cloned().collect())
            .unwrap_or_default()
    }

    // ---- attributes and the kernel's view of sizes ----

    /// Records an attribute this mount gives the kernel. In writeback mode
    /// the kernel trusts its own size of a file it caches, so a region that
    /// grew elsewhere is announced with a one-byte cache store.
    fn note_reply(&self, attr: &v1::Attr) {
        if !is_region(attr) {
            return;
        }
        let grown_from = {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(attr.ino).or_insert_with(|| InodeState {
                kernel_size: attr.size,
                ..InodeState::default()
            });
            st.attr = Some((attr.clone(), Instant::now()));
            if self.writeback() && attr.size > st.kernel_size {
                let old = st.kernel_size;
                st.kernel_size = attr.size;
                Some(old)
            } else {
                None
            }
        };
        if let Some(old) = grown_from {
            self.push_size(attr.ino, old, attr.size, None);
        }
    }

    /// Makes the kernel's size of `ino` `size` (from `old`): drops the page
    /// that held the old end and stores the new last byte.
    fn push_size(&self, ino: u64, old: u64, size: u64, region: Option<&Region>) {
        let Some(kernel) = self.kernel.get() else {
            return;
        };
        if size == 0 {
            return;
        }
        let from = (old / PAGE) * PAGE;
        if let Err(e) = kernel.invalidate(ino, from as i64, 0) {
            tracing::debug!(ino, error = %e, "cannot invalidate the old end of a grown region");
        }
        let byte = match self.last_byte(ino, size, region) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(ino, error = %e, "cannot read the last byte of a grown region");
                return;
            }
        };
        match kernel.store(ino, size - 1, &[byte]) {
            Ok(()) => tracing::debug!(
                ino,
                old,
                size,
                "kernel size of a region grown elsewhere updated"
            ),
            Err(e) => {
                tracing::debug!(ino, error = %e, "cannot announce a grown region to the kernel")
            }
        }
    }

    fn last_byte(&self, ino: u64, size: u64, region: Option<&Region>) -> FsResult<u8> {
        let mut b = [0u8; 1];
        let mut read = |r: &Region| -> FsResult<usize> {
            if r.size() < size {
                r.refresh()?;
            }
            Ok(r.read_at(size - 1, &mut b)?)
        };
        let n = match region {
            Some(r) => read(r)?,
            None => {
                let open = self
                    .handles_of(ino)
                    .into_iter()
                    .find_map(|h| match &h.body {
                        Body::Region(_) => Some(h),
                        Body::Pseudo(_) => None,
                    });
                match open {
                    Some(h) => read(&h.region()?.region)?,
                    None => {
                        let r = self.client.open_as(&self.identity.internal(), ino, false)?;
                        read(&r)?
                    }
                }
            }
        };
        if n == 1 {
            Ok(b[0])
        } else {
            Err(FsError::Invalid(format!(
                "region {ino} is shorter than {size}"
            )))
        }
    }

    /// The attributes of a pseudo node.
    fn pseudo_attr(&self, node: Node) -> FsResult<v1::Attr> {
        let (dir, times) = match node {
            Node::Root => (true, self.started),
            Node::Files(ino) => {
                let a = self.manager().getattr(&self.identity.internal(), ino)?;
                (is_dir(&a), a.mtime.unwrap_or(self.started))
            }
            _ => (false, now_ts()),
        };
        Ok(v1::Attr {
            ino: node.ino(),
            kind: if dir {
                FileKind::Directory as i32
            } else {
                FileKind::Region as i32
            },
            mode: if dir { 0o500 } else { 0o400 },
            nlink: if dir { 2 } else { 1 },
            uid: 0,
            gid: 0,
            size: 0,
            atime: Some(times),
            mtime: Some(times),
            ctime: Some(times),
            crtime: Some(times),
            ..Default::default()
        })
    }

    fn root_only(ctx: &RequestCtx) -> FsResult<()> {
        if ctx.is_root() {
            Ok(())
        } else {
            Err(FsError::Denied(format!(
                "{} (region metadata) is readable by root only",
                pseudo::DIR_NAME
            )))
        }
    }

    // ---- namespace ----

    /// Looks up `name` in directory `parent`.
    pub fn lookup(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<v1::Attr> {
        if parent == ROOT_INO && name == pseudo::DIR_NAME {
            Self::root_only(ctx)?;
            return self.pseudo_attr(Node::Root);
        }
        if let Some(node) = Node::from_ino(parent) {
            return self.pseudo_lookup(ctx, node, name);
        }
        let name = wire(name)?;
        let name: &str = &name;
        let attr = self.with_local_size(self.manager().lookup(&self.caller(ctx), parent, name)?);
        if is_dir(&attr) {
            self.note_dir(&attr, Some(parent));
        } else {
            self.kernel_size_stale(&attr);
            self.note_reply(&attr);
        }
        Ok(attr)
    }

    /// The attributes of `ino`.
    pub fn getattr(&self, ctx: &RequestCtx, ino: u64) -> FsResult<v1::Attr> {
        if let Some(node) = Node::from_ino(ino) {
            return self.pseudo_attr(node);
        }
        if let Some(attr) = self.recent_attr_while_writing(ino) {
            return Ok(attr);
        }
        let attr = match self.manager().getattr(&self.caller(ctx), ino) {
            Ok(a) => self.with_local_size(a),
            Err(e) if e.errno() == libc::ENOENT => {
                // fstat of a directory removed while open: st_nlink 0.
                return self
                    .removed_dirs
                    .lock()
                    .ok()
                    .and_then(|r| r.get(&ino).cloned())
                    .ok_or(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        if is_dir(&attr) {
            self.note_dir(&attr, None);
        } else {
            self.note_reply(&attr);
        }
        Ok(attr)
    }

    /// The attributes this mount gave the kernel within the attribute TTL,
    /// while it has the region open for writing: the kernel re-reads them
    /// after each direct write, and they can only have changed through
    /// this mount's own writes (another host's changes show at open).
    fn recent_attr_while_writing(&self, ino: u64) -> Option<v1::Attr> {
        let writing = self
            .handles_of(ino)
            .iter()
            .any(|h| matches!(&h.body, Body::Region(r) if r.write));
        if !writing {
            return None;
        }
        let cached = {
            let inodes = self.lock_inodes();
            let (attr, at) = inodes.get(&ino)?.attr.as_ref()?;
            (at.elapsed() < ATTR_REUSE).then(|| attr.clone())?
        };
        Some(self.with_local_size(cached))
    }

    fn note_dir(&self, attr: &v1::Attr, parent: Option<u64>) {
        if let Ok(mut d) = self.dirs.lock() {
            let info = d.entry(attr.ino).or_default();
            info.mode = attr.mode;
            if parent.is_some() {
                info.parent = parent;
            }
        }
    }

    /// Whether the kernel may cache the entry `name` of `parent`. Without
    /// `default_permissions` the kernel checks no search permission on the
    /// way through cached entries, so the entries of directories that not
    /// everyone may search are looked up (and checked by the manager) every
    /// time, as are those of the `.regions` tree.
    pub fn entry_cacheable(&self, parent: u64, name: &OsStr) -> bool {
        if pseudo::is_pseudo(parent) || (parent == ROOT_INO && name == pseudo::DIR_NAME) {
            return false;
        }
        self.dirs
            .lock()
            .ok()
            .and_then(|d| d.get(&parent).map(|i| i.mode & 0o111 == 0o111))
            .unwrap_or(true)
    }

    /// chmod, chown, truncate, utimens. `fh` is the open file the change
    /// came through, if any.
    pub fn setattr(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        change: SetAttrIn,
        ctime: bool,
        fh: Option<u64>,
    ) -> FsResult<v1::Attr> {
        if pseudo::is_pseudo(ino) {
            return Err(FsError::Denied(
                "region metadata files cannot be changed".into(),
            ));
        }
        let mut change = change;
        let handle = fh.and_then(|fh| self.handle(fh).ok());
        // In writeback mode the kernel keeps mtime itself and sends it as an
        // explicit time with truncations and when it flushes (with ctime, and
        // the open file). Those are bookkeeping, not utimensat: setting
        // "now" needs only write permission where an explicit time needs
        // ownership.
        let bookkeeping = matches!(change.mtime, Some(SetTime::At(..)))
            && ctime
            && (change.size.is_some()
                || (fh.is_some() && change.atime.is_none())
                || change.atime == Some(SetTime::Now));
        if bookkeeping {
            change.mtime = Some(SetTime::Now);
        }
        let only_times = change.mode.is_none()
            && change.uid.is_none()
            && change.gid.is_none()
            && change.size.is_none();
        let caller = match &handle {
            Some(h) if bookkeeping && only_times => match &h.body {
                Body::Region(r) => r.caller.clone(),
                Body::Pseudo(_) => self.caller(ctx),
            },
            _ => self.caller(ctx),
        };
        let writer = handle
            .as_ref()
            .is_some_and(|h| matches!(&h.body, Body::Region(r) if r.write));
        // ftruncate: the descriptor was opened for writing, which is the
        // permission a size change needs (a later chmod does not take it).
        change.through_write_handle = writer && change.size.is_some();
        if bookkeeping && only_times && writer {
            // The kernel flushing the mtime of a file written through this
            // handle: the next publish (flush, fsync or release) sets it at
            // the manager together with the size, in one request.
            let cached = {
                let mut inodes = self.lock_inodes();
                let st = inodes.entry(ino).or_default();
                st.dirty = true;
                st.attr.as_ref().map(|(a, _)| a.clone())
            };
            if let Some(mut attr) = cached {
                let now = now_ts();
                attr.mtime = Some(now);
                attr.ctime = Some(now);
                return Ok(self.with_local_size(attr));
            }
        }
        if let Some(size) = change.size {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(ino).or_default();
            st.kernel_size = size;
        }
        let attr = match self.manager().setattr(&caller, ino, &change) {
            Ok(a) => a,
            Err(e) if bookkeeping && only_times && fh.is_some() && e.errno() != libc::EIO => {
                // The kernel flushing its mtime must not fail a close.
                tracing::debug!(ino, error = %e, "mtime update refused; keeping the manager's");
                return Ok(self.manager().getattr(&caller, ino)?);
            }
            Err(e) => return Err(e.into()),
        };
        if !is_dir(&attr)
            && let Some(st) = self.lock_inodes().get_mut(&ino)
        {
            st.attr = Some((attr.clone(), Instant::now()));
        }
        if is_dir(&attr) {
            self.note_dir(&attr, None);
            if change.mode.is_some() && attr.mode & 0o111 != 0o111 {
                self.forget_entries_later(ino);
            }
        }
        if let Some(size) = change.size {
            for h in self.handles_of(ino) {
                if let Body::Region(r) = &h.body
                    && let Err(e) = r.region.note_truncated(size)
                {
                    tracing::debug!(ino, error = %e, "cannot refresh an open handle after a truncate");
                }
            }
        }
        if change.size.is_some() || bookkeeping {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(ino).or_default();
            st.seen = Some(stamp(&attr));
            if bookkeeping {
                st.dirty = false;
            }
        }
        Ok(attr)
    }

    /// A directory stopped being searchable by everyone: the kernel must
    /// look its entries up again (so that the manager checks each caller).
    /// Done on a thread of its own, since the kernel holds the directory's
    /// lock until this setattr is answered.
    fn forget_entries_later(&self, dir: u64) {
        let Some(kernel) = self.kernel.get().cloned() else {
            return;
        };
        let client = self.client.clone();
        let caller = self.identity.internal();
        let spawned = std::thread::Builder::new()
            .name("regionfs-inval".into())
            .spawn(move || {
                let mut offset = 0;
                loop {
                    let reply = match client.manager().readdir(&caller, dir, offset, READDIR_BATCH) {
                        Ok(r) => r,
                        Err(e) => {
                            tracing::debug!(dir, error = %e, "cannot list a directory to drop its cached entries");
                            return;
                        }
                    };
                    for e in &reply.entries {
                        let name = names::from_wire(&e.name);
                        let _ = kernel.invalidate_entry(dir, &name);
                        offset = e.offset;
                    }
                    if reply.end || reply.entries.is_empty() {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(dir, error = %e, "cannot start a thread to drop cached entries");
        }
    }

    /// Creates directory `name`.
    pub fn mkdir(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
    ) -> FsResult<v1::Attr> {
        self.check_creatable(ctx, parent, name)?;
        let attr = self.manager().mkdir(
            &self.caller(ctx),
            parent,
            &wire(name)?,
            mode & !umask & 0o7777,
        )?;
        self.note_dir(&attr, Some(parent));
        Ok(attr)
    }

    fn check_creatable(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<()> {
        if pseudo::is_pseudo(parent) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied(
                "nothing can be created under .regions (read-only metadata)".into(),
            ));
        }
        if parent == ROOT_INO && name == pseudo::DIR_NAME {
            return Err(FsError::Exists(format!(
                "{} is reserved for region metadata",
                pseudo::DIR_NAME
            )));
        }
        Ok(())
    }

    /// Creates a region (a regular file), or a FIFO, socket or device node
    /// (a namespace entry without region memory: the kernel of the host that
    /// opens it serves it, so a FIFO connects processes of one host).
    pub fn mknod(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
    ) -> FsResult<v1::Attr> {
        self.check_creatable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let name = wire(name)?;
        let name: &str = &name;
        let bits = mode & !umask & 0o7777;
        if let Some(kind) = node_kind(mode) {
            return Ok(self.manager().make_node(
                &caller,
                parent,
                name,
                kind,
                bits,
                u64::from(rdev),
            )?);
        }
        if mode & libc::S_IFMT != libc::S_IFREG && mode & libc::S_IFMT != 0 {
            return Err(FsError::Invalid(format!(
                "mknod of file type {:o}: regions makes regular files, FIFOs, sockets and device nodes",
                mode & libc::S_IFMT
            )));
        }
        let defaults = self.thread_defaults.overrides(ctx.pid);
        let attr = self.manager().create(v1::CreateRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            mode: bits,
            attrs: defaults,
            preallocate: 0,
        })?;
        self.created(&caller, parent, name, &attr);
        Ok(attr)
    }

    /// Bookkeeping of a new region: the kernel learns it with size 0, and a
    /// non-persistent one is watched for its owner's exit.
    fn created(&self, caller: &v1::Caller, parent: u64, name: &str, attr: &v1::Attr) {
        {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(attr.ino).or_default();
            st.kernel_size = attr.size;
            st.seen = Some(stamp(attr));
            st.attr = Some((attr.clone(), Instant::now()));
            st.created_here = Some(Instant::now());
        }
        let persistent = attr.region_attrs.as_ref().is_some_and(|a| a.persistent);
        if let Some(w) = &self.owners
            && !persistent
            && caller.pid != 0
        {
            w.watch(Owned {
                ino: attr.ino,
                parent,
                name: name.to_owned(),
                pid: caller.pid,
            });
        }
    }

    /// Creates and opens a region.
    pub fn create(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
    ) -> FsResult<(v1::Attr, Opened)> {
        self.check_creatable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let name = wire(name)?;
        let name: &str = &name;
        let mode = mode & !umask & 0o7777;
        let acc = flags & libc::O_ACCMODE;
        let write = acc != libc::O_RDONLY;
        // A new file may be opened as asked even if its mode forbids it
        // (open(O_CREAT|O_WRONLY, 0444)): create it usable, then set the mode.
        let needed = (if write { 2 } else { 0 }) | (if acc != libc::O_WRONLY { 4 } else { 0 });
        let create_mode = if caller.uid != 0 && (mode >> 6) & needed != needed {
            mode | (needed << 6)
        } else {
            mode
        };
        let defaults = self.thread_defaults.overrides(ctx.pid);
        // One manager request creates and opens it; a writer gets its first
        // chunk with it (freed at close if nothing was written).
        let create = v1::CreateRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            mode: create_mode,
            attrs: defaults,
            preallocate: if write { CHUNK_SIZE } else { 0 },
        };
        let region = self
            .client
            .create_open_as(create, write)?
            .with_size_policy(SizePolicy::Lazy);
        let mut attr = region.opened_attr().clone();
        self.created(&caller, parent, name, &attr);
        if create_mode != mode {
            // The open write handle keeps its rights after the chmod.
            let change = SetAttrIn {
                mode: Some(mode),
                ..SetAttrIn::default()
            };
            match self.manager().setattr(&caller, attr.ino, &change) {
                Ok(a) => attr = a,
                Err(e) => {
                    tracing::warn!(ino = attr.ino, error = %e, "cannot set the mode of a new region")
                }
            }
        }
        {
            let mut inodes = self.lock_inodes();
            inodes.entry(attr.ino).or_default().cached_opens += 1;
        }
        let fh = self.add_handle(Handle {
            ino: attr.ino,
            pid: caller.pid,
            uid: caller.uid,
            body: Body::Region(Box::new(RegionHandle {
                region,
                caller,
                write,
                io: Mutex::new(IoMode::Cached),
                fenced: AtomicBool::new(false),
            })),
        });
        Ok((
            attr,
            Opened {
                fh,
                keep_cache: false,
                direct_io: false,
                passthrough: false,
                backing: None,
            },
        ))
    }

    /// Opens a region, retrying a moment on `ETXTBSY` (see
    /// [`FsOptions::busy_retry`]).
    fn open_region(&self, caller: &v1::Caller, ino: u64, write: bool) -> FsResult<Region> {
        let deadline = Instant::now() + self.options.busy_retry;
        loop {
            match self.client.open_as(caller, ino, write) {
                Ok(r) => return Ok(r.with_size_policy(SizePolicy::Lazy)),
                Err(e) if e.errno() == libc::ETXTBSY && write && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Removes region `name`.
    pub fn unlink(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<()> {
        self.check_removable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let name = wire(name)?;
        let name: &str = &name;
        // A watched region (its owner lives) stops being watched with its
        // last name; one that has other names stays watched, by inode: its
        // lifetime is the region's, not this name's.
        let watched = match &self.owners {
            Some(w) if w.watches_name(parent, name) => {
                self.manager().lookup(&caller, parent, name).ok()
            }
            _ => None,
        };
        self.manager().unlink(&caller, parent, name)?;
        self.forget_cached_attrs();
        if let (Some(w), Some(a)) = (&self.owners, watched)
            && a.nlink <= 1
        {
            w.forget(a.ino);
        }
        Ok(())
    }

    fn check_removable(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<()> {
        if pseudo::is_pseudo(parent) || (parent == ROOT_INO && name == pseudo::DIR_NAME) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied(
                ".regions is read-only region metadata".into(),
            ));
        }
        Ok(())
    }

    /// Drops the attributes kept for answering the kernel while writing: a
    /// name went away or moved, so link counts and times changed.
    fn forget_cached_attrs(&self) {
        for st in self.lock_inodes().values_mut() {
            st.attr = None;
        }
    }

    /// Removes directory `name` (ENOTEMPTY unless empty).
    pub fn rmdir(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<()> {
        self.check_removable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let name = wire(name)?;
        let before = self.manager().lookup(&caller, parent, &name).ok();
        self.manager().rmdir(&caller, parent, &name)?;
        if let Some(mut a) = before
            && let Ok(mut r) = self.removed_dirs.lock()
        {
            a.nlink = 0;
            r.insert(a.ino, a);
        }
        Ok(())
    }

    /// Renames (renameat2 flags: RENAME_NOREPLACE, RENAME_EXCHANGE).
    pub fn rename(
        &self,
        ctx: &RequestCtx,
        (parent, name): (u64, &OsStr),
        (new_parent, new_name): (u64, &OsStr),
        flags: u32,
    ) -> FsResult<()> {
        self.check_removable(ctx, parent, name)?;
        self.check_removable(ctx, new_parent, new_name)?;
        const KNOWN: u32 = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE;
        if flags & !KNOWN != 0 {
            return Err(FsError::Invalid(format!(
                "rename flags {flags:#x}: regions supports RENAME_NOREPLACE and RENAME_EXCHANGE only"
            )));
        }
        let caller = self.caller(ctx);
        let (name, new_name) = (wire(name)?, wire(new_name)?);
        let (name, new_name) = (&*name, &*new_name);
        let moved = if self.owners.is_some() {
            self.manager().lookup(&caller, parent, name).ok()
        } else {
            None
        };
        let replaced = if self.owners.is_some() {
            self.manager().lookup(&caller, new_parent, new_name).ok()
        } else {
            None
        };
        self.manager()
            .rename(&caller, (parent, name), (new_parent, new_name), flags)?;
        self.forget_cached_attrs();
        if let Some(w) = &self.owners {
            if let Some(a) = &moved {
                w.renamed(a.ino, new_parent, new_name);
            }
            if let Some(b) = &replaced {
                if flags & libc::RENAME_EXCHANGE != 0 {
                    w.renamed(b.ino, parent, name);
                } else if b.nlink <= 1 {
                    w.forget(b.ino);
                }
            }
        }
        if let Some(a) = moved.filter(is_dir) {
            self.note_dir(&a, Some(new_parent));
        }
        Ok(())
    }

    /// Makes `name` in `parent` a symbolic link to `target` (kept at the
    /// manager: every host follows it).
    pub fn symlink(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        target: &Path,
    ) -> FsResult<v1::Attr> {
        self.check_creatable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let name = wire(name)?;
        Ok(self
            .manager()
            .symlink(&caller, parent, &name, target.as_os_str().as_bytes())?)
    }

    /// The target of symbolic link `ino`.
    pub fn readlink(&self, ctx: &RequestCtx, ino: u64) -> FsResult<Vec<u8>> {
        if pseudo::is_pseudo(ino) {
            return Err(FsError::Invalid(format!(
                "inode {ino} is region metadata, not a symbolic link"
            )));
        }
        Ok(self.manager().readlink(&self.caller(ctx), ino)?)
    }

    /// Gives `ino` the further name `new_name` in `new_parent`.
    pub fn link(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        new_parent: u64,
        new_name: &OsStr,
    ) -> FsResult<v1::Attr> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied(
                "region metadata files cannot be linked".into(),
            ));
        }
        self.check_creatable(ctx, new_parent, new_name)?;
        let caller = self.caller(ctx);
        let new_name = wire(new_name)?;
        let attr = self.manager().link(&caller, ino, new_parent, &new_name)?;
        // The link count changed: answers kept for the kernel are stale.
        self.forget_cached_attrs();
        Ok(self.with_local_size(attr))
    }

    /// Checks that a directory may be opened (pseudo directories: root only).
    pub fn opendir(&self, ctx: &RequestCtx, ino: u64) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
        }
        Ok(())
    }

    /// Entries of directory `ino` after cookie `offset`; `plus` when the
    /// kernel will remember the attributes (readdirplus).
    pub fn readdir(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        offset: u64,
        plus: bool,
    ) -> FsResult<Vec<DirEntryOut>> {
        if let Some(node) = Node::from_ino(ino) {
            Self::root_only(ctx)?;
            return self.pseudo_readdir(node, offset);
        }
        let parent = self
            .dirs
            .lock()
            .ok()
            .and_then(|d| d.get(&ino).and_then(|i| i.parent))
            .unwrap_or(ino);
        let mut out = self.dots(ino, parent, offset);
        let reply = self.manager().readdir(
            &self.caller(ctx),
            ino,
            if offset < 3 { 0 } else { offset },
            READDIR_BATCH,
        )?;
        for e in reply.entries {
            let Some(attr) = e.attr else { continue };
            if ino == ROOT_INO && e.name == pseudo::DIR_NAME {
                continue;
            }
            if plus {
                if is_dir(&attr) {
                    self.note_dir(&attr, Some(ino));
                } else {
                    self.note_reply(&attr);
                }
            }
            out.push(DirEntryOut {
                ino: attr.ino,
                cookie: e.offset,
                name: names::from_wire(&e.name),
                kind: attr.kind(),
                attr: Some(attr),
            });
        }
        Ok(out)
    }

    fn dots(&self, ino: u64, parent: u64, offset: u64) -> Vec<DirEntryOut> {
        let mut out = Vec::new();
        for (cookie, name, i) in [(1, ".", ino), (2, "..", parent)] {
            if offset < cookie {
                out.push(DirEntryOut {
                    ino: i,
                    cookie,
                    name: name.into(),
                    kind: FileKind::Directory,
                    attr: None,
                });
            }
        }
        out
    }

    /// File-system statistics (cluster capacity and free memory).
    pub fn statfs(&self, ctx: &RequestCtx) -> FsResult<StatFs> {
        let r = self.manager().statfs(&self.caller(ctx))?;
        let bsize = r.block_size.max(512);
        Ok(StatFs {
            blocks: r.total_bytes / u64::from(bsize),
            bfree: r.free_bytes / u64::from(bsize),
            bavail: r.free_bytes / u64::from(bsize),
            files: r.inodes + r.free_inodes,
            ffree: r.free_inodes,
            bsize,
            namelen: r.max_name_len.max(1),
        })
    }

    /// access(2): the manager decides.
    pub fn access(&self, ctx: &RequestCtx, ino: u64, mask: u32) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            if mask & libc::W_OK as u32 != 0 {
                return Err(FsError::Denied("region metadata is read-only".into()));
            }
            return Ok(());
        }
        Ok(self.manager().access(&self.caller(ctx), ino, mask)?)
    }

    /// The kernel forgot `ino`.
    pub fn forget(&self, ino: u64) {
        if pseudo::is_pseudo(ino) {
            return;
        }
        let open = !self.handles_of(ino).is_empty();
        if !open {
            self.lock_inodes().remove(&ino);
        }
        if let Ok(mut d) = self.dirs.lock() {
            d.remove(&ino);
        }
        if let Ok(mut r) = self.removed_dirs.lock() {
            r.remove(&ino);
        }
    }

    // ---- extended attributes ----

    fn xattr_out(value: Vec<u8>, size: u32) -> FsResult<XattrOut> {
        if size == 0 {
            return Ok(XattrOut::Size(
                u32::try_from(value.len())
                    .map_err(|_| FsError::Invalid("attribute too large".into()))?,
            ));
        }
        if value.len() > size as usize {
            return Err(FsError::Range {
                needed: value.len(),
                given: size as usize,
            });
        }
        Ok(XattrOut::Data(value))
    }

    /// getxattr; `size` 0 asks for the size only.
    pub fn getxattr(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        name: &OsStr,
        size: u32,
    ) -> FsResult<XattrOut> {
        if pseudo::is_pseudo(ino) {
            return Err(FsError::NoData(
                "metadata files have no extended attributes".into(),
            ));
        }
        if let Some(value) = self.mount_xattr(name) {
            return Self::xattr_out(value?, size);
        }
        if let Some(value) = self.thread_defaults.getxattr(ctx.pid, ino, name) {
            return Self::xattr_out(value?, size);
        }
        if name == SECURITY_CAPABILITY && self.created_here_recently(ino) {
            // The kernel asks before the first write to every file; a
            // region this mount just created has no extended attributes.
            return Err(FsError::NoData(format!(
                "region {ino} has no {SECURITY_CAPABILITY}"
            )));
        }
        let value = self
            .manager()
            .getxattr(&self.caller(ctx), ino, utf8(name)?)?;
        Self::xattr_out(value, size)
    }

    /// Whether `ino` was created through this mount within the attribute
    /// TTL, with no extended attribute set through it since.
    fn created_here_recently(&self, ino: u64) -> bool {
        self.lock_inodes()
            .get(&ino)
            .and_then(|st| st.created_here)
            .is_some_and(|at| at.elapsed() < ATTR_REUSE)
    }

    /// Attributes this mount answers itself, on every inode: how a program
    /// holding a region fd (or the mount's path) finds this host's agent
    /// (`user.regions.agent`) and host id (`user.regions.hostid`).
    fn mount_xattr(&self, name: &OsStr) -> Option<FsResult<Vec<u8>>> {
        let config = self.client.config();
        if name == MOUNT_XATTR_AGENT {
            return Some(match &config.agent_socket {
                Some(path) => Ok(path.as_os_str().as_bytes().to_vec()),
                None => Err(FsError::NoData(
                    "this mount has no host agent (start it with --agent-socket)".into(),
                )),
            });
        }
        if name == MOUNT_XATTR_HOSTID {
            return Some(Ok(config.host_id.to_string().into_bytes()));
        }
        None
    }

    /// setxattr (flags: XATTR_CREATE, XATTR_REPLACE).
    pub fn setxattr(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        name: &OsStr,
        value: &[u8],
        flags: i32,
    ) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied("region metadata is read-only".into()));
        }
        if let Some(r) = self.thread_defaults.setxattr(ctx.pid, ino, name, value) {
            return r;
        }
        self.not_created_here(ino);
        Ok(self
            .manager()
            .setxattr(&self.caller(ctx), ino, utf8(name)?, value, flags as u32)?)
    }

    /// Forgets that this mount just created `ino` (its attributes changed).
    fn not_created_here(&self, ino: u64) {
        if let Some(st) = self.lock_inodes().get_mut(&ino) {
            st.created_here = None;
        }
    }

    /// listxattr; `size` 0 asks for the size only.
    pub fn listxattr(&self, ctx: &RequestCtx, ino: u64, size: u32) -> FsResult<XattrOut> {
        if pseudo::is_pseudo(ino) {
            return Self::xattr_out(Vec::new(), size);
        }
        let names = self.manager().listxattr(&self.caller(ctx), ino)?;
        let mut list = Vec::new();
        // Region attributes are read and set by name but not listed (like
        // ceph.* attributes): tools that copy every listed attribute would
        // otherwise try to copy read-only ones (ownerpid, vaddr, hosts).
        for n in names
            .into_iter()
            .filter(|n| !n.starts_with(REGION_XATTR_PREFIX))
        {
            list.extend_from_slice(n.as_bytes());
            list.push(0);
        }
        Self::xattr_out(list, size)
    }

    /// removexattr.
    pub fn removexattr(&self, ctx: &RequestCtx, ino: u64, name: &OsStr) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied("region metadata is read-only".into()));
        }
        if let Some(r) = self.thread_defaults.removexattr(ctx.pid, ino, name) {
            return r;
        }
        self.not_created_here(ino);
        Ok(self
            .manager()
            .removexattr(&self.caller(ctx), ino, utf8(name)?)?)
    }

    // ---- data ----

    /// Opens `ino` with open(2) `flags`.
    pub fn open(&self, ctx: &RequestCtx, ino: u64, flags: i32) -> FsResult<Opened> {
        if let Some(node) = Node::from_ino(ino) {
            return self.pseudo_open(ctx, node, flags);
        }
        let caller = self.caller(ctx);
        let write = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if flags & FMODE_EXEC != 0 {
            // execve: the kernel checks only that some execute bit is set.
            self.manager().access(&caller, ino, libc::X_OK as u32)?;
        }
        if write {
            self.wait_for_passthrough_readers(ino)?;
        }
        let region = self.open_region(&caller, ino, write)?;
        let attr = self.with_local_size(region.opened_attr().clone());
        if is_dir(&attr) {
            return Err(FsError::IsDir(format!("inode {ino}")));
        }
        if self.kernel_size_stale(&attr) {
            return Err(FsError::Stale(format!(
                "region {ino} shrank to {} bytes on another host; the kernel looks it up again",
                attr.size
            )));
        }
        let now = stamp(&attr);
        // Close-to-open: keep the cached pages only if nothing changed.
        let (keep, grown_from) = {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(ino).or_insert_with(|| InodeState {
                kernel_size: attr.size,
                ..InodeState::default()
            });
            let keep = st.seen == Some(now);
            st.seen = Some(now);
            let grown = if self.writeback() && attr.size > st.kernel_size {
                let old = st.kernel_size;
                st.kernel_size = attr.size;
                Some(old)
            } else {
                None
            };
            (keep, grown)
        };
        if !keep && let Some(k) = self.kernel.get() {
            // Attributes only: the open without keep_cache drops the pages.
            let _ = k.invalidate(ino, -1, 0);
        }
        if let Some(old) = grown_from {
            self.push_size(ino, old, attr.size, Some(&region));
        }
        let (io, fd) = self.choose_io(ino, write, &region, &attr)?;
        let fh = self.add_handle(Handle {
            ino,
            pid: caller.pid,
            uid: caller.uid,
            body: Body::Region(Box::new(RegionHandle {
                region,
                caller,
                write,
                io: Mutex::new(io),
                fenced: AtomicBool::new(false),
            })),
        });
        tracing::trace!(ino, fh, write, keep, io = io.name(), "open");
        Ok(Opened {
            fh,
            keep_cache: keep && io == IoMode::Cached,
            direct_io: io == IoMode::Direct,
            passthrough: io == IoMode::Passthrough,
            backing: fd,
        })
    }

    /// Whether the kernel's inode of `attr`'s region holds a larger size
    /// than the region has (it shrank on another host). In writeback mode
    /// the kernel never takes a file's size from the file system again, so
    /// when no descriptor of this mount has the region open the inode gets
    /// a new generation: the kernel's next lookup of the name replaces the
    /// inode (with the right size) instead of reusing it. Its caller makes
    /// the kernel look up again (a lookup reply, or `ESTALE` from open,
    /// which the kernel retries once after looking the path up afresh).
    fn kernel_size_stale(&self, attr: &v1::Attr) -> bool {
        if !self.writeback() || !is_region(attr) {
            return false;
        }
        let busy = !self.handles_of(attr.ino).is_empty();
        {
            let mut inodes = self.lock_inodes();
            let Some(st) = inodes.get_mut(&attr.ino) else {
                return false;
            };
            if attr.size >= st.kernel_size || busy {
                return false;
            }
            st.kernel_size = attr.size;
            st.seen = None;
            st.attr = None;
        }
        if let Ok(mut g) = self.generations.lock() {
            *g.entry(attr.ino).or_insert(0) += 1;
        }
        tracing::debug!(
            ino = attr.ino,
            size = attr.size,
            "region shrank elsewhere; new inode generation for the kernel"
        );
        true
    }

    /// The generation of inode `ino` for the kernel.
    pub fn generation(&self, ino: u64) -> u64 {
        self.generations
            .lock()
            .ok()
            .and_then(|g| g.get(&ino).copied())
            .unwrap_or(0)
    }

    /// Picks how an open's data moves and counts it. The kernel wants
    /// every open of an inode that has passthrough opens to be passthrough
    /// too (with the same backing file), so readers join them and writers
    /// are refused until they close ([`FsError::Busy`]).
    fn choose_io(
        &self,
        ino: u64,
        write: bool,
        region: &Region,
        attr: &v1::Attr,
    ) -> FsResult<(IoMode, Option<OwnedFd>)> {
        let candidate = self.options.cache == CacheMode::Passthrough
            && self.passthrough.load(Ordering::Relaxed)
            && !write
            && attr.size > 0
            && region.is_wholly_local();
        let segment = if candidate {
            match self.client.local_segment(ino, false) {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(ino, error = %e, "no segment for passthrough");
                    None
                }
            }
        } else {
            None
        };
        let mut inodes = self.lock_inodes();
        let st = inodes.entry(ino).or_default();
        if st.passthrough_opens > 0 {
            if write {
                return Err(Self::passthrough_busy(ino));
            }
            st.passthrough_opens += 1;
            return Ok((IoMode::Passthrough, segment.map(|s| s.fd)));
        }
        // The segment spans whole chunks and passthrough reads to its end,
        // so only a region that fills it exactly qualifies.
        if let Some(seg) = segment
            && seg.size == attr.size
            && st.cached_opens == 0
        {
            st.passthrough_opens += 1;
            return Ok((IoMode::Passthrough, Some(seg.fd)));
        }
        st.cached_opens += 1;
        Ok((IoMode::Cached, None))
    }

    fn passthrough_busy(ino: u64) -> FsError {
        FsError::Busy(format!(
            "region {ino} is being read at memory speed (FUSE passthrough) on this host; it can be opened for writing once those readers close (or mount with --cache writeback)"
        ))
    }

    /// In passthrough mode, waits a moment for passthrough readers of `ino`
    /// to go before a writer opens it (FUSE releases asynchronously).
    fn wait_for_passthrough_readers(&self, ino: u64) -> FsResult<()> {
        if self.options.cache != CacheMode::Passthrough {
            return Ok(());
        }
        let deadline = Instant::now() + self.options.busy_retry;
        loop {
            let busy = self
                .lock_inodes()
                .get(&ino)
                .is_some_and(|st| st.passthrough_opens > 0);
            if !busy {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Self::passthrough_busy(ino));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The kernel would not take the passthrough descriptor: serve `fh`
    /// with direct I/O instead.
    pub fn passthrough_failed(&self, fh: u64) {
        let Ok(h) = self.handle(fh) else { return };
        if let Body::Region(r) = &h.body
            && let Ok(mut io) = r.io.lock()
            && *io == IoMode::Passthrough
        {
            *io = IoMode::Direct;
            let mut inodes = self.lock_inodes();
            if let Some(st) = inodes.get_mut(&h.ino) {
                st.passthrough_opens = st.passthrough_opens.saturating_sub(1);
            }
        }
    }

    /// Reads up to `size` bytes at `offset`.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        self.read_with(fh, offset, size, <[u8]>::to_vec)
    }

    /// Reads up to `size` bytes at `offset` and hands them to `reply`
    /// without allocating: region bytes land in a buffer kept per thread
    /// (a fresh zeroed megabyte per read costs page faults and a memset
    /// that show up next to the transfer itself).
    pub fn read_with<T>(
        &self,
        fh: u64,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[u8]) -> T,
    ) -> FsResult<T> {
        thread_local! {
            static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let h = self.handle(fh)?;
        match &h.body {
            Body::Pseudo(data) => {
                let start = (offset as usize).min(data.len());
                let end = start.saturating_add(size as usize).min(data.len());
                Ok(reply(&data[start..end]))
            }
            Body::Region(_) => {
                let r = h.region()?;
                let end = offset.saturating_add(u64::from(size));
                let kernel_size = self
                    .lock_inodes()
                    .get(&h.ino)
                    .map_or(u64::MAX, |st| st.kernel_size);
                if end > r.region.size() && kernel_size > r.region.size() {
                    // Grown through another handle since this open (the
                    // kernel, which asks only below the size it knows,
                    // believes it larger; a read of the page holding the
                    // end needs no refresh).
                    r.region.refresh()?;
                    let local = self.unpublished_size(h.ino);
                    if local > r.region.size() {
                        // A writer of this mount has not published yet.
                        r.region.note_size(local);
                    }
                }
                READ_BUF.with(|cell| {
                    let mut guard = cell.try_borrow_mut();
                    let mut own = Vec::new();
                    // Re-entrance cannot happen here, but fall back to a
                    // fresh buffer rather than panic if it ever does.
                    let buf = match guard.as_mut() {
                        Ok(b) => &mut **b,
                        Err(_) => &mut own,
                    };
                    if buf.len() < size as usize {
                        buf.resize(size as usize, 0);
                    }
                    let n = r.region.read_at(offset, &mut buf[..size as usize])?;
                    Ok(reply(&buf[..n]))
                })
            }
        }
    }

    /// Writes `data` at `offset` through to the region. Growth past the
    /// size lands in space the region reserves ahead in steps; the new size
    /// reaches the manager at flush, fsync or release ([`Self::publish`]).
    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let h = self.handle(fh)?;
        let r = h.region()?;
        // A host out of touch with the manager for most of a lease may be fenced soon.
        check_contact(&self.contact)?;
        if !r.write {
            return Err(FsError::BadHandle(format!(
                "file handle {fh} of inode {} is not open for writing",
                h.ino
            )));
        }
        let end = offset.saturating_add(data.len() as u64);
        {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(h.ino).or_default();
            st.kernel_size = st.kernel_size.max(end);
            st.dirty = true;
        }
        r.region.write_at(offset, data)?;
        u32::try_from(data.len()).map_err(|_| FsError::Invalid("write too large".into()))
    }

    /// Clears the setuid bit of region `ino`, and its setgid bit when the
    /// group may execute it or the writer is not in its group (the kernel's
    /// rule since Linux 6.2), before a write by someone the kernel says must
    /// not keep them: it asks only when the writer lacks `CAP_FSETID` (the
    /// file system handles this: `FUSE_HANDLE_KILLPRIV_V2`).
    pub fn kill_suidgid(&self, ctx: &RequestCtx, ino: u64) {
        let writer = self.caller(ctx);
        let internal = self.identity.internal();
        let Ok(attr) = self.manager().getattr(&internal, ino) else {
            return;
        };
        let in_group = writer.gid == attr.gid || writer.groups.contains(&attr.gid);
        let mut mode = attr.mode & !libc::S_ISUID;
        if attr.mode & libc::S_IXGRP != 0 || !in_group {
            mode &= !libc::S_ISGID;
        }
        if mode == attr.mode {
            return;
        }
        let change = SetAttrIn {
            mode: Some(mode & 0o7777),
            ..SetAttrIn::default()
        };
        match self.manager().setattr(&internal, ino, &change) {
            Ok(_) => {
                if let Some(k) = self.kernel.get() {
                    let _ = k.invalidate(ino, -1, 0);
                }
            }
            Err(e) => {
                tracing::warn!(ino, error = %e, "cannot clear setuid/setgid before a write")
            }
        }
    }

    /// Write handles of `ino` open through this mount whose growth of the
    /// size has not reached the manager, largest size first.
    fn unpublished(&self, ino: u64) -> Vec<Arc<Handle>> {
        let mut open: Vec<(u64, Arc<Handle>)> = self
            .handles_of(ino)
            .into_iter()
            .filter_map(|h| match &h.body {
                Body::Region(r) if r.write && r.region.has_unpublished_size() => {
                    Some((r.region.size(), Arc::clone(&h)))
                }
                _ => None,
            })
            .collect();
        open.sort_by_key(|(size, _)| std::cmp::Reverse(*size));
        open.into_iter().map(|(_, h)| h).collect()
    }

    /// The size of `attr` as this mount knows it: the manager's, or what
    /// this mount's writers grew it to and have not published yet.
    fn with_local_size(&self, mut attr: v1::Attr) -> v1::Attr {
        if is_region(&attr) {
            attr.size = attr.size.max(self.unpublished_size(attr.ino));
        }
        attr
    }

    /// The largest size a writer of this mount grew `ino` to and has not
    /// published (0: none).
    fn unpublished_size(&self, ino: u64) -> u64 {
        match self.unpublished(ino).first().map(|h| &h.body) {
            Some(Body::Region(r)) => r.region.size(),
            _ => 0,
        }
    }

    /// Makes what this mount wrote to the region durable and visible to
    /// the next opener on any host: the size its writers grew it to and a
    /// new mtime (so that other mounts drop their cached pages at their
    /// next open), in one manager request. The kernel writes back through
    /// any writable handle of the inode, so the growth may sit on another
    /// handle of this mount than the one flushed.
    fn publish(&self, h: &Handle) -> FsResult<()> {
        let r = match &h.body {
            Body::Region(_) => h.region()?,
            Body::Pseudo(_) => return Ok(()),
        };
        if !r.write {
            return Ok(());
        }
        let dirty = {
            let mut inodes = self.lock_inodes();
            inodes
                .get_mut(&h.ino)
                .map(|st| std::mem::replace(&mut st.dirty, false))
                .unwrap_or(false)
        };
        let holders = self.unpublished(h.ino);
        let region = match holders.first().map(|x| &x.body) {
            Some(Body::Region(x)) => &x.region,
            _ if dirty => &r.region,
            _ => return Ok(()),
        };
        match region.publish(dirty) {
            Ok(attr) => {
                if let Some(attr) = attr {
                    for other in &holders {
                        if let Body::Region(x) = &other.body {
                            x.region.note_published(attr.size);
                        }
                    }
                    let mut inodes = self.lock_inodes();
                    if let Some(st) = inodes.get_mut(&h.ino) {
                        st.seen = Some(stamp(&attr));
                        st.attr = Some((attr, Instant::now()));
                    }
                }
                Ok(())
            }
            Err(e) => {
                if dirty {
                    let mut inodes = self.lock_inodes();
                    if let Some(st) = inodes.get_mut(&h.ino) {
                        st.dirty = true;
                    }
                }
                Err(e.into())
            }
        }
    }

    /// close(2) of a descriptor of `fh` (the kernel has written back).
    pub fn flush(&self, fh: u64) -> FsResult<()> {
        let h = self.handle(fh)?;
        self.publish(&h)
    }

    /// fsync(2) / msync(2): written data is in the region already.
    pub fn fsync(&self, fh: u64) -> FsResult<()> {
        let h = self.handle(fh)?;
        self.publish(&h)
    }

    /// The last reference to an open file went away.
    pub fn release(&self, fh: u64) -> FsResult<Released> {
        let h = self
            .handles
            .write()
            .ok()
            .and_then(|mut m| {
                let removed = m.remove(&fh);
                metrics::gauge!("regions_fuse_open_handles").set(m.len() as f64);
                removed
            })
            .ok_or_else(|| FsError::BadHandle(format!("file handle {fh} is not open")))?;
        let mut passthrough = false;
        if let Body::Region(r) = &h.body {
            if let Err(e) = self.publish(&h) {
                tracing::warn!(ino = h.ino, error = %e, "cannot record the new mtime of a written region at release; other hosts may keep stale cached pages");
            }
            let io = r.io.lock().map(|i| *i).unwrap_or(IoMode::Direct);
            passthrough = io == IoMode::Passthrough;
            let mut inodes = self.lock_inodes();
            if let Some(st) = inodes.get_mut(&h.ino) {
                match io {
                    IoMode::Cached => st.cached_opens = st.cached_opens.saturating_sub(1),
                    IoMode::Passthrough => {
                        st.passthrough_opens = st.passthrough_opens.saturating_sub(1)
                    }
                    IoMode::Direct => {}
                }
            }
        }
        let ino = h.ino;
        // The region handle closes at the manager when the last reference
        // (this one, unless a read is still running) goes.
        self.closer.close(h);
        Ok(Released { ino, passthrough })
    }
}

/// Deletes a region whose owner exited, unless it was made persistent. A
/// region with one name, still where it was created (or renamed to through
/// this mount), loses that name; otherwise (hard links, or a rename through
/// another host) the manager deletes every name of the owner's
/// non-persistent regions, as the daemon does for owners it watches.
fn reap(manager: &ManagerClient, identity: &Identity, o: &Owned) {
    let caller = identity.internal();
    let attr = match manager.getattr(&caller, o.ino) {
        Ok(a) if a.nlink > 0 => a,
        Ok(_) | Err(_) => {
            tracing::info!(pid = o.pid, ino = o.ino, name = %o.name, "owner exited; its region is already gone");
            return;
        }
    };
    if attr.region_attrs.as_ref().is_some_and(|r| r.persistent) {
        tracing::info!(ino = o.ino, name = %o.name, "owner exited but the region was made persistent; keeping it");
        return;
    }
    let at_its_name = manager
        .lookup(&caller, o.parent, &o.name)
        .is_ok_and(|a| a.ino == o.ino);
    let outcome = if at_its_name && attr.nlink == 1 {
        manager
            .unlink(&caller, o.parent, &o.name)
            .map(|()| vec![o.ino])
    } else {
        manager.release_owner(identity.host_id(), o.pid)
    };
    match outcome {
        Ok(deleted) => {
            tracing::info!(pid = o.pid, ino = o.ino, name = %o.name, ?deleted, "deleted the non-persistent regions of an exited owner")
        }
        Err(e) => {
            tracing::warn!(pid = o.pid, ino = o.ino, name = %o.name, error = %e, "cannot delete the region of an exited owner")
        }
    }
}

mod ioctls;
mod meta;

#[cfg(test)]
mod tests;
