//! The FUSE adapter: `fuser::Filesystem` over [`RegionFs`], one call into
//! the core per request, plus what only FUSE has (kernel configuration,
//! passthrough backing ids, notifications).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, Notifier, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
    WriteFlags,
};
use regions_proto::v1::{self, FileKind};

use crate::cache_leases::Covered;
use crate::error::FsError;
use crate::fs::{CacheMode, EntryCache, KernelCache, Opened, RegionFs, XattrOut};
use crate::identity::RequestCtx;
use regions::manager_client::{SetAttrIn, SetTime};

/// How long the kernel trusts attributes and names.
pub const TTL: Duration = Duration::from_secs(1);
/// Largest write request the kernel sends.
pub const MAX_WRITE: u32 = 1 << 20;
/// Preferred I/O size reported by stat (cp and friends use it as buffer).
pub const BLKSIZE: u32 = 1 << 20;
/// Largest readahead window: several 1 MiB reads in flight at once keep
/// the transport busy on cold sequential reads.
pub const MAX_READAHEAD: u32 = 8 << 20;
/// Background requests (readahead, writeback) the kernel keeps in flight.
const MAX_BACKGROUND: u16 = 64;

/// Counts and times one FUSE request when dropped: `regions_fuse_requests_total{op}` and
/// `regions_fuse_request_duration_seconds{op}` (failures: `regions_fuse_errors_total{op,
/// errno}`, in [`FuseFs::fail`]; bytes: `regions_fuse_bytes_total{op}`; open files:
/// `regions_fuse_open_handles`). No-ops unless the process serves metrics.
struct Timed {
    op: &'static str,
    started: Instant,
}

impl Timed {
    fn start(op: &'static str) -> Timed {
        Timed {
            op,
            started: Instant::now(),
        }
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        metrics::counter!("regions_fuse_requests_total", "op" => self.op).increment(1);
        metrics::histogram!("regions_fuse_request_duration_seconds", "op" => self.op)
            .record(self.started.elapsed());
    }
}

/// The kernel cache, through FUSE notifications.
pub struct Kernel(pub Notifier);

impl KernelCache for Kernel {
    fn invalidate(&self, ino: u64, offset: i64, len: i64) -> io::Result<()> {
        self.0.inval_inode(INodeNo(ino), offset, len)
    }

    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.store(INodeNo(ino), offset, data)
    }

    fn invalidate_entry(&self, parent: u64, name: &OsStr) -> io::Result<()> {
        self.0.inval_entry(INodeNo(parent), name)
    }
}

/// The FUSE file system.
pub struct FuseFs {
    core: Arc<RegionFs>,
    /// Passthrough backing files per inode, with their open counts (the
    /// kernel wants one backing file per inode while any is open).
    backing: Mutex<HashMap<u64, (BackingId, u32)>>,
}

impl FuseFs {
    /// The adapter over `core`.
    pub fn new(core: Arc<RegionFs>) -> FuseFs {
        FuseFs {
            core,
            backing: Mutex::new(HashMap::new()),
        }
    }

    /// The core.
    pub fn core(&self) -> &Arc<RegionFs> {
        &self.core
    }

    /// Logs a failure as loudly as it deserves and gives its errno.
    fn fail(&self, op: &'static str, ino: u64, e: &FsError) -> Errno {
        let errno = e.errno();
        metrics::counter!("regions_fuse_errors_total", "op" => op, "errno" => errno.to_string())
            .increment(1);
        if e.is_fault() {
            tracing::warn!(op, ino, errno, error = %e, "request failed: a daemon or the manager is unreachable; check them (see .regions/hosts)");
        } else if e.is_routine() {
            tracing::trace!(op, ino, errno, error = %e, "request failed");
        } else {
            tracing::info!(op, ino, errno, error = %e, "request refused");
        }
        Errno::from_i32(errno)
    }

    fn reply_open(&self, reply: ReplyOpen, ino: u64, o: Opened) {
        let mut flags = FopenFlags::empty();
        if o.keep_cache {
            flags |= FopenFlags::FOPEN_KEEP_CACHE;
        }
        if o.direct_io {
            flags |= FopenFlags::FOPEN_DIRECT_IO;
        }
        let fh = FileHandle(o.fh);
        if !o.passthrough {
            reply.opened(fh, flags);
            return;
        }
        let Ok(mut backing) = self.backing.lock() else {
            self.core.passthrough_failed(o.fh);
            reply.opened(fh, flags | FopenFlags::FOPEN_DIRECT_IO);
            return;
        };
        // One backing file per inode while any passthrough open lasts.
        if let Some((id, n)) = backing.get_mut(&ino) {
            *n += 1;
            reply.opened_passthrough(fh, flags, id);
            return;
        }
        let made = match &o.backing {
            Some(fd) => reply.open_backing(fd),
            None => Err(io::Error::from(io::ErrorKind::NotFound)),
        };
        match made {
            Ok(id) => {
                reply.opened_passthrough(fh, flags, &id);
                backing.insert(ino, (id, 1));
            }
            Err(e) => {
                tracing::info!(ino, error = %e, "no passthrough file for this open; serving it with direct I/O");
                self.core.passthrough_failed(o.fh);
                reply.opened(fh, flags | FopenFlags::FOPEN_DIRECT_IO);
            }
        }
    }

    /// Answers a request that hands entry `name` of `parent`, with attributes `a`, to the
    /// kernel.
    fn reply_entry(&self, reply: ReplyEntry, parent: u64, name: &OsStr, a: &v1::Attr) {
        let (attr_ttl, entry_ttl) = self.entry_ttls(parent, name, a);
        self.core.handing(a.ino);
        reply.entry_with_ttls(
            &attr_ttl,
            &entry_ttl,
            &file_attr(a),
            Generation(self.core.generation(a.ino)),
        );
    }

    /// TTL of attributes `a`: longer when their reply brought a lease this mount holds.
    fn attr_ttl(&self, a: &v1::Attr) -> Duration {
        self.core
            .lease_ttl(Covered::Attrs(a.ino), a.attr_lease)
            .map_or(TTL, |t| t.max(TTL))
    }

    /// The (attribute, entry) TTLs of entry `name` of `parent` with attributes `a`, for a
    /// reply that hands the entry to the kernel. An entry is looked up (and checked) every
    /// time where not everyone may search `parent`; it is kept longer when its reply brought
    /// a lease on the directory's names that this mount holds, and its attributes likewise.
    fn entry_ttls(&self, parent: u64, name: &OsStr, a: &v1::Attr) -> (Duration, Duration) {
        let entry = match self.core.entry_cache(parent, name, TTL) {
            EntryCache::No => return (Duration::ZERO, Duration::ZERO),
            EntryCache::Default => TTL,
            EntryCache::Leased => match self.core.lease_ttl(Covered::Names(parent), a.dir_lease) {
                Some(t) if self.core.leased_entry(parent, name, a.ino) => t.max(TTL),
                _ => TTL,
            },
        };
        (self.attr_ttl(a), entry)
    }

    fn unref_backing(&self, ino: u64) {
        if let Ok(mut backing) = self.backing.lock()
            && let Some((_, n)) = backing.get_mut(&ino)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                backing.remove(&ino);
            }
        }
    }
}

fn ctx(req: &Request) -> RequestCtx {
    RequestCtx::new(req.uid(), req.gid(), req.pid())
}

fn time(t: Option<v1::Timespec>) -> SystemTime {
    let t = t.unwrap_or_default();
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec.min(999_999_999))
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(t.sec.unsigned_abs()))
            .unwrap_or(UNIX_EPOCH)
    }
}

/// The kernel's file type of a kind.
fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
        FileKind::Region | FileKind::Unspecified => FileType::RegularFile,
    }
}

/// The kernel's view of an attribute.
pub fn file_attr(a: &v1::Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.allocated.div_ceil(512),
        atime: time(a.atime),
        mtime: time(a.mtime),
        ctime: time(a.ctime),
        crtime: time(a.crtime),
        kind: file_type(a.kind()),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        // The kernel's dev_t is 32 bits: major in 12, minor in 20.
        rdev: a.rdev as u32,
        blksize: BLKSIZE,
        flags: 0,
    }
}

/// Attributes for "." and ".." entries (the kernel does not keep them).
fn dot_attr(ino: u64) -> FileAttr {
    file_attr(&v1::Attr {
        ino,
        kind: FileKind::Directory as i32,
        mode: 0o755,
        nlink: 2,
        ..Default::default()
    })
}

fn set_time(t: Option<TimeOrNow>) -> Option<SetTime> {
    t.map(|t| match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(st) => match st.duration_since(UNIX_EPOCH) {
            Ok(d) => SetTime::At(d.as_secs() as i64, d.subsec_nanos()),
            Err(e) => {
                let d = e.duration();
                SetTime::At(-(d.as_secs() as i64), 0)
            }
        },
    })
}

/// What regionfs asks of the kernel at `init` whatever its cache mode (the FUSE floor of the
/// mount benchmark, `tests/src/bin/fuse_floor.rs`, asks the same): readdirplus, parallel
/// directory operations, asynchronous direct I/O, `mmap` of direct-I/O files, setuid/setgid
/// clearing by the file system, 1 MiB writes, 8 MiB read-ahead and 64 background requests.
pub fn configure_kernel(config: &mut KernelConfig) {
    try_add(
        config,
        InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO,
        "readdirplus",
    );
    try_add(
        config,
        InitFlags::FUSE_PARALLEL_DIROPS,
        "parallel directory operations",
    );
    try_add(config, InitFlags::FUSE_ASYNC_DIO, "asynchronous direct I/O");
    try_add(
        config,
        InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
        "mmap of direct-I/O files",
    );
    // regionfs clears setuid/setgid on writes that ask for it (the
    // WRITE's kill flag), so the kernel need not ask for the
    // `security.capability` attribute before every write.
    try_add(
        config,
        InitFlags::FUSE_HANDLE_KILLPRIV_V2,
        "setuid/setgid clearing by the file system",
    );
    if let Err(max) = config.set_max_write(MAX_WRITE) {
        let _ = config.set_max_write(max);
    }
    if let Err(max) = config.set_max_readahead(MAX_READAHEAD) {
        let _ = config.set_max_readahead(max);
    }
    let _ = config.set_max_background(MAX_BACKGROUND);
    let _ = config.set_congestion_threshold(MAX_BACKGROUND * 3 / 4);
}

fn try_add(config: &mut KernelConfig, flag: InitFlags, what: &str) -> bool {
    match config.add_capabilities(flag) {
        Ok(()) => true,
        Err(missing) => {
            tracing::info!(?missing, "the kernel lacks {what}; continuing without it");
            false
        }
    }
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        configure_kernel(config);
        match self.core.options().cache {
            CacheMode::Writeback => {
                if try_add(
                    config,
                    InitFlags::FUSE_WRITEBACK_CACHE,
                    "the writeback cache",
                ) {
                    tracing::info!("kernel page cache in writeback mode");
                }
            }
            CacheMode::Passthrough => {
                try_add(
                    config,
                    InitFlags::FUSE_AUTO_INVAL_DATA,
                    "automatic cache invalidation",
                );
                let ok = config.set_max_stack_depth(1).is_ok()
                    && try_add(config, InitFlags::FUSE_PASSTHROUGH, "FUSE passthrough");
                self.core.set_passthrough(ok);
                if ok {
                    tracing::info!(
                        "FUSE passthrough on: read-only opens of local regions read memory directly"
                    );
                }
            }
        }
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _timed = Timed::start("lookup");
        match self.core.lookup(&ctx(req), parent.0, name) {
            Ok(a) => self.reply_entry(reply, parent.0, name, &a),
            Err(e) => reply.error(self.fail("lookup", parent.0, &e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let _timed = Timed::start("forget");
        self.core.forget(ino.0, nlookup);
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _timed = Timed::start("getattr");
        match self.core.getattr(&ctx(req), ino.0) {
            Ok(a) => reply.attr(&self.attr_ttl(&a), &file_attr(&a)),
            Err(e) => reply.error(self.fail("getattr", ino.0, &e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _timed = Timed::start("setattr");
        let change = SetAttrIn {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            size,
            atime: set_time(atime),
            mtime: set_time(mtime),
            through_write_handle: false,
        };
        match self
            .core
            .setattr(&ctx(req), ino.0, change, ctime.is_some(), fh.map(|f| f.0))
        {
            Ok(a) => reply.attr(&self.attr_ttl(&a), &file_attr(&a)),
            Err(e) => reply.error(self.fail("setattr", ino.0, &e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _timed = Timed::start("mknod");
        match self
            .core
            .mknod(&ctx(req), parent.0, name, mode, umask, rdev)
        {
            Ok(a) => self.reply_entry(reply, parent.0, name, &a),
            Err(e) => reply.error(self.fail("mknod", parent.0, &e)),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _timed = Timed::start("mkdir");
        match self.core.mkdir(&ctx(req), parent.0, name, mode, umask) {
            Ok(a) => self.reply_entry(reply, parent.0, name, &a),
            Err(e) => reply.error(self.fail("mkdir", parent.0, &e)),
        }
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _timed = Timed::start("unlink");
        match self.core.unlink(&ctx(req), parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("unlink", parent.0, &e)),
        }
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _timed = Timed::start("rmdir");
        match self.core.rmdir(&ctx(req), parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("rmdir", parent.0, &e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _timed = Timed::start("symlink");
        match self.core.symlink(&ctx(req), parent.0, link_name, target) {
            Ok(a) => self.reply_entry(reply, parent.0, link_name, &a),
            Err(e) => reply.error(self.fail("symlink", parent.0, &e)),
        }
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _timed = Timed::start("rename");
        match self.core.rename(
            &ctx(req),
            (parent.0, name),
            (newparent.0, newname),
            flags.bits(),
        ) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("rename", parent.0, &e)),
        }
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let _timed = Timed::start("readlink");
        match self.core.readlink(&ctx(req), ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(self.fail("readlink", ino.0, &e)),
        }
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _timed = Timed::start("link");
        match self.core.link(&ctx(req), ino.0, newparent.0, newname) {
            Ok(a) => self.reply_entry(reply, newparent.0, newname, &a),
            Err(e) => reply.error(self.fail("link", ino.0, &e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _timed = Timed::start("open");
        match self.core.open(&ctx(req), ino.0, flags.0) {
            Ok(o) => self.reply_open(reply, ino.0, o),
            Err(e) => reply.error(self.fail("open", ino.0, &e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _timed = Timed::start("read");
        let mut reply = Some(reply);
        let result = self.core.read_with(fh.0, offset, size, |data| {
            metrics::counter!("regions_fuse_bytes_total", "op" => "read")
                .increment(data.len() as u64);
            if let Some(r) = reply.take() {
                r.data(data);
            }
        });
        // The closure runs (and answers) only on success.
        if let (Err(e), Some(r)) = (result, reply) {
            r.error(self.fail("read", ino.0, &e));
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _timed = Timed::start("write");
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            self.core.kill_suidgid(&ctx(req), ino.0);
        }
        match self.core.write(fh.0, offset, data) {
            Ok(n) => {
                metrics::counter!("regions_fuse_bytes_total", "op" => "write").increment(n.into());
                reply.written(n)
            }
            Err(e) => reply.error(self.fail("write", ino.0, &e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _timed = Timed::start("flush");
        match self.core.flush(ino.0, fh.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("flush", ino.0, &e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _timed = Timed::start("release");
        match self.core.release(fh.0) {
            Ok(r) => {
                if r.passthrough {
                    self.unref_backing(r.ino);
                }
                reply.ok();
            }
            Err(e) => reply.error(self.fail("release", ino.0, &e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _timed = Timed::start("fsync");
        match self.core.fsync(fh.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("fsync", ino.0, &e)),
        }
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _timed = Timed::start("opendir");
        match self.core.opendir(&ctx(req), ino.0) {
            Ok(()) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(self.fail("opendir", ino.0, &e)),
        }
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _timed = Timed::start("readdir");
        match self.core.readdir(&ctx(req), ino.0, offset, false) {
            Ok(entries) => {
                for e in entries {
                    if reply.add(INodeNo(e.ino), e.cookie, file_type(e.kind), &e.name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(self.fail("readdir", ino.0, &e)),
        }
    }

    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let _timed = Timed::start("readdirplus");
        match self.core.readdir(&ctx(req), ino.0, offset, true) {
            Ok(entries) => {
                for e in entries {
                    let attr = match &e.attr {
                        Some(a) => file_attr(a),
                        None => dot_attr(e.ino),
                    };
                    // One TTL for the entry and its attributes: the shorter (listings
                    // bring no lease, so the default at most).
                    let granted = v1::Attr {
                        ino: e.ino,
                        ..v1::Attr::default()
                    };
                    let (attr_ttl, entry_ttl) =
                        self.entry_ttls(ino.0, &e.name, e.attr.as_ref().unwrap_or(&granted));
                    let ttl = attr_ttl.min(entry_ttl);
                    // The kernel counts a lookup of every entry it links but `.` and `..`;
                    // counted before it can be forgotten, taken back if it did not fit.
                    let counted = e.name != "." && e.name != ".." && e.ino != 0;
                    if counted {
                        self.core.handing(e.ino);
                    }
                    if reply.add(
                        INodeNo(e.ino),
                        e.cookie,
                        &e.name,
                        &ttl,
                        &attr,
                        Generation(self.core.generation(e.ino)),
                    ) {
                        if counted {
                            self.core.forget(e.ino, 1);
                        }
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(self.fail("readdirplus", ino.0, &e)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _timed = Timed::start("fsyncdir");
        // Directory changes are durable at the manager before it replies.
        reply.ok();
    }

    fn statfs(&self, req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let _timed = Timed::start("statfs");
        match self.core.statfs(&ctx(req)) {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize,
            ),
            Err(e) => reply.error(self.fail("statfs", ino.0, &e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _timed = Timed::start("setxattr");
        match self.core.setxattr(&ctx(req), ino.0, name, value, flags) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("setxattr", ino.0, &e)),
        }
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _timed = Timed::start("getxattr");
        match self.core.getxattr(&ctx(req), ino.0, name, size) {
            Ok(XattrOut::Size(n)) => reply.size(n),
            Ok(XattrOut::Data(d)) => reply.data(&d),
            Err(e) => reply.error(self.fail("getxattr", ino.0, &e)),
        }
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _timed = Timed::start("listxattr");
        match self.core.listxattr(&ctx(req), ino.0, size) {
            Ok(XattrOut::Size(n)) => reply.size(n),
            Ok(XattrOut::Data(d)) => reply.data(&d),
            Err(e) => reply.error(self.fail("listxattr", ino.0, &e)),
        }
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _timed = Timed::start("removexattr");
        match self.core.removexattr(&ctx(req), ino.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("removexattr", ino.0, &e)),
        }
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let _timed = Timed::start("access");
        match self.core.access(&ctx(req), ino.0, mask.bits() as u32) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("access", ino.0, &e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _timed = Timed::start("create");
        match self
            .core
            .create(&ctx(req), parent.0, name, mode, umask, flags)
        {
            Ok((a, o)) => {
                let mut f = FopenFlags::empty();
                if o.direct_io {
                    f |= FopenFlags::FOPEN_DIRECT_IO;
                }
                // One TTL for the entry and its attributes: the shorter.
                let (attr_ttl, entry_ttl) = self.entry_ttls(parent.0, name, &a);
                self.core.handing(a.ino);
                reply.created(
                    &attr_ttl.min(entry_ttl),
                    &file_attr(&a),
                    Generation(self.core.generation(a.ino)),
                    FileHandle(o.fh),
                    f,
                );
            }
            Err(e) => reply.error(self.fail("create", parent.0, &e)),
        }
    }

    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        let _timed = Timed::start("ioctl");
        if flags.contains(IoctlFlags::FUSE_IOCTL_DIR) {
            reply.error(Errno::from_i32(libc::ENOTTY));
            return;
        }
        match self.core.ioctl(fh.0, cmd, in_data) {
            Ok(out) => {
                let n = out.len().min(out_size as usize);
                reply.ioctl(0, &out[..n]);
            }
            Err(FsError::BadHandle(_)) => reply.error(Errno::from_i32(libc::ENOTTY)),
            Err(e) => reply.error(self.fail("ioctl", ino.0, &e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attrs_convert() {
        let a = v1::Attr {
            ino: 5,
            kind: FileKind::Region as i32,
            mode: 0o100644,
            nlink: 1,
            uid: 1000,
            gid: 100,
            size: 10,
            allocated: 131072,
            mtime: Some(v1::Timespec { sec: 10, nsec: 5 }),
            atime: Some(v1::Timespec { sec: -3, nsec: 0 }),
            ..Default::default()
        };
        let f = file_attr(&a);
        assert_eq!(f.ino, INodeNo(5));
        assert_eq!(f.kind, FileType::RegularFile);
        assert_eq!(f.perm, 0o644);
        assert_eq!(f.blocks, 256);
        assert_eq!(f.mtime, UNIX_EPOCH + Duration::new(10, 5));
        assert_eq!(f.atime, UNIX_EPOCH - Duration::from_secs(3));
        assert_eq!(dot_attr(7).kind, FileType::Directory);
        assert_eq!(set_time(Some(TimeOrNow::Now)), Some(SetTime::Now));
        assert_eq!(
            set_time(Some(TimeOrNow::SpecificTime(
                UNIX_EPOCH + Duration::new(4, 2)
            ))),
            Some(SetTime::At(4, 2))
        );
    }
}
