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
//!
//! This module holds the types, [`RegionFs`] and the kernel's view of sizes; the operations
//! are in `namespace` (names, attributes, directories), `xattrs`, `data` (open, read, write,
//! size publication, release), `handles` (the handle table, the background closer, the
//! fencing watch), `passthrough`, `ioctls` and `meta` (the `.regions/` tree).

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
/// Prefix of the region attributes (Remote Regions paper §5.4).
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
    /// Bytes one background fill stores at most in the page cache (a region on other hosts
    /// read at random is streamed in behind the reader; see `fs/fill.rs`). `None`: a quarter
    /// of this host's memory; `Some(0)`: no background fill.
    pub fill_budget: Option<u64>,
}

impl Default for FsOptions {
    fn default() -> Self {
        FsOptions {
            cache: CacheMode::Writeback,
            busy_retry: Duration::from_millis(300),
            watch_owners: true,
            fill_budget: None,
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
    /// How it was opened: at the manager, as a writer whose release keeps the placement it
    /// knows, or under a cache lease without asking the manager (`fs/leased_opens.rs`: its
    /// region has no handle there).
    opening: Opening,
    /// For a leased open, the handle it took at the manager once the region could lose its
    /// last name (shared by the leased opens of the region, closed with the last).
    pin: Mutex<Option<Arc<Region>>>,
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
    /// Where the last read that reached this mount ended, and how many reads in a row began
    /// elsewhere (scattered reads start a background fill: `fs/fill.rs`).
    read_next: u64,
    scattered: u32,
    /// Write opens of this mount and changes under way: no background fill meanwhile.
    writers: u32,
    /// The inode's background fill (running or ended).
    fill: Option<Arc<fill::Fill>>,
    /// The mtime and size a fill last ran for: it does not run again until they change.
    filled: Option<(v1::Timespec, u64)>,
}

/// What this mount knows of a directory.
#[derive(Clone, Debug, Default)]
struct DirInfo {
    /// Its parent (for "..").
    parent: Option<u64>,
    /// Its permission bits.
    mode: u32,
    /// Names of its entries the kernel was told to cache, and when: what a chmod that takes
    /// away search permission must make the kernel forget at once.
    cached: HashMap<std::ffi::OsString, Instant>,
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
    /// The kernel's lookup count of each inode: what is kept about its inode goes at zero.
    lookups: crate::lookup_counts::LookupCounts,
    /// Directories the kernel learned through this mount.
    dirs: Mutex<HashMap<u64, DirInfo>>,
    /// Names recorded in every `DirInfo::cached` (kept under a bound: see
    /// `entry_cacheable_noting`).
    cached_names: std::sync::atomic::AtomicUsize,
    /// When those records were last swept.
    cached_swept: Mutex<Instant>,
    /// Directories removed through this mount, for fstat of an open one.
    removed_dirs: Mutex<HashMap<u64, v1::Attr>>,
    /// Regions whose last name this mount removed while it had them open nowhere: the
    /// kernel's flush of their times right after is answered here (until it forgets them).
    unlinked: Mutex<HashSet<u64>>,
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
    /// Background fills of the page cache.
    fills: fill::Fills,
    /// The page of open and close counts `rmalloc(fd)` checks its descriptor against.
    descriptor_epochs: Option<crate::descriptor_epochs::DescriptorEpochs>,
    /// What the kernel may cache for longer than the default (names, attributes).
    cache_leases: crate::cache_leases::CacheLeases,
    /// Inode → the entries naming it handed to the kernel under a names lease.
    leased_entries: Mutex<HashMap<u64, Vec<(u64, std::ffi::OsString)>>>,
    /// What leased opens and getattrs are answered from (see `fs/leased_opens.rs`).
    placements: Arc<crate::placements::Placements>,
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
        let fills = fill::Fills::new(options.fill_budget);
        Ok(RegionFs {
            client,
            identity,
            options,
            handles: RwLock::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            inodes: Mutex::new(HashMap::new()),
            lookups: Default::default(),
            dirs: Mutex::new(HashMap::new()),
            cached_names: std::sync::atomic::AtomicUsize::new(0),
            cached_swept: Mutex::new(Instant::now()),
            removed_dirs: Mutex::new(HashMap::new()),
            unlinked: Mutex::new(HashSet::new()),
            pseudo_paths: Mutex::new(HashMap::new()),
            owners,
            kernel: OnceLock::new(),
            passthrough: AtomicBool::new(false),
            started: now_ts(),
            thread_defaults: Default::default(),
            generations: Mutex::new(HashMap::new()),
            closer: Closer::start(),
            contact: LeaseContact::new(),
            fills,
            descriptor_epochs: crate::descriptor_epochs::DescriptorEpochs::start(),
            cache_leases: Default::default(),
            leased_entries: Mutex::new(HashMap::new()),
            placements: Arc::default(),
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
        let mut caller = self.identity.caller(ctx);
        caller.lease_session = self.cache_leases.session();
        caller
    }

    /// Counts an open or create of a region for `rmalloc(fd)` (before it is answered).
    fn count_open(&self) {
        if let Some(d) = &self.descriptor_epochs {
            d.opened();
        }
    }

    /// The page of descriptor epochs, if this mount keeps one.
    pub fn descriptor_epochs(&self) -> Option<&crate::descriptor_epochs::DescriptorEpochs> {
        self.descriptor_epochs.as_ref()
    }

    fn writeback(&self) -> bool {
        self.options.cache == CacheMode::Writeback
    }

    fn lock_inodes(&self) -> std::sync::MutexGuard<'_, HashMap<u64, InodeState>> {
        self.inodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
            tracing::trace!(
                ino = attr.ino,
                size = attr.size,
                kernel_size = st.kernel_size,
                "reply"
            );
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
        // A fill's store between the invalidation and the store below would leave the old
        // last page cached with zeros past the old end.
        let _hold = match self.hold_fills(ino) {
            Ok(h) => h,
            Err(e) => {
                self.kernel_kept_size(ino, old, size);
                tracing::debug!(ino, error = %e, "cannot raise the kernel's size of a grown region now");
                return;
            }
        };
        let from = (old / PAGE) * PAGE;
        if let Err(e) = kernel.invalidate(ino, from as i64, 0) {
            tracing::debug!(ino, error = %e, "cannot invalidate the old end of a grown region");
        }
        let byte = match self.last_byte(ino, size, region) {
            Ok(b) => b,
            Err(e) => {
                self.kernel_kept_size(ino, old, size);
                tracing::warn!(ino, old, size, error = %e, "cannot read the last byte of a region grown on another host; the kernel keeps its old size until the next open or lookup");
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
                self.kernel_kept_size(ino, old, size);
                tracing::warn!(ino, old, size, error = %e, "cannot announce a region grown on another host to the kernel; it keeps its old size until the next open or lookup")
            }
        }
    }

    /// A push of `ino`'s size from `old` to `size` did not reach the kernel, which keeps
    /// `old`: so must this mount's record of it (unless another push changed it since), so
    /// that the next reply showing the growth pushes it again and a fill stays under it.
    fn kernel_kept_size(&self, ino: u64, old: u64, size: u64) {
        if let Some(st) = self.lock_inodes().get_mut(&ino)
            && st.kernel_size == size
        {
            st.kernel_size = old;
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
}

/// The creator of region `o` exited: the manager deletes every name of the non-persistent
/// regions that process created on this host, the same call the host agent makes for the
/// owners it watches (one owner-lifetime policy; docs/SEMANTICS.md, "Lifetime"). A persistent
/// region, or one already gone, is left as it is.
fn reap(manager: &ManagerClient, identity: &Identity, o: &Owned) {
    match manager.release_owner(identity.host_id(), o.pid) {
        Ok(deleted) if deleted.is_empty() => {
            tracing::debug!(pid = o.pid, ino = o.ino, name = %o.name, "owner exited; nothing of it left to delete")
        }
        Ok(deleted) => {
            tracing::info!(pid = o.pid, ino = o.ino, name = %o.name, ?deleted, "deleted the non-persistent regions of an exited owner")
        }
        Err(e) => {
            tracing::warn!(pid = o.pid, ino = o.ino, name = %o.name, error = %e, "cannot delete the regions of an exited owner")
        }
    }
}

mod data;
mod fill;
mod handles;
mod ioctls;
mod leased_opens;
mod leases;
mod meta;
mod namespace;
mod passthrough;
mod xattrs;

use crate::placements::LeasedCheck;
use handles::Opening;

use handles::Closer;
pub use leases::EntryCache;

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;
