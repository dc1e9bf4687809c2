//! The FUSE floor of this machine, for `benches/regionfs.sh`: a file system that keeps every
//! file in a memfd of its own and answers each request from memory at once (no network, no
//! manager, nothing durable), mounted with regionfs's kernel settings (writeback cache,
//! 1 MiB writes, 8 MiB read-ahead, 64 background requests, the same threads and init flags).
//! Whatever regionfs does on top of that costs time; whatever this does not reach, no FUSE
//! file system reaches here.
//!
//! ```sh
//! regions-fuse-floor MOUNTPOINT [THREADS]   # until SIGTERM or SIGINT, then unmounts
//! ```
//! Prints `ready` on stdout once the mount answers.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::FromRawFd as _;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, Session, SessionACL, TimeOrNow, WriteFlags,
};

/// regionfs's attribute and entry TTL.
const TTL: Duration = Duration::from_secs(1);

enum Body {
    Dir(BTreeMap<OsString, u64>),
    File(File),
}

struct Node {
    body: Body,
    mode: u32,
    uid: u32,
    gid: u32,
}

struct Floor {
    nodes: RwLock<HashMap<u64, Arc<RwLock<Node>>>>,
    next: AtomicU64,
    started: SystemTime,
}

fn errno(e: i32) -> Errno {
    Errno::from_i32(e)
}

fn memfd() -> std::io::Result<File> {
    // SAFETY: memfd_create with a NUL-terminated name; the returned descriptor is new and
    // owned by the File from here on.
    let fd = unsafe { libc::memfd_create(c"floor".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

impl Floor {
    fn new() -> Floor {
        let root = Node {
            body: Body::Dir(BTreeMap::new()),
            mode: 0o755,
            uid: 0,
            gid: 0,
        };
        let nodes = HashMap::from([(1, Arc::new(RwLock::new(root)))]);
        Floor {
            nodes: RwLock::new(nodes),
            next: AtomicU64::new(2),
            started: SystemTime::now(),
        }
    }

    fn node(&self, ino: u64) -> Result<Arc<RwLock<Node>>, Errno> {
        self.nodes
            .read()
            .map_err(|_| errno(libc::EIO))?
            .get(&ino)
            .cloned()
            .ok_or(errno(libc::ENOENT))
    }

    fn attr(&self, ino: u64, n: &Node) -> FileAttr {
        let (kind, size) = match &n.body {
            Body::Dir(c) => (FileType::Directory, c.len() as u64),
            Body::File(f) => (FileType::RegularFile, f.metadata().map_or(0, |m| m.size())),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind,
            perm: (n.mode & 0o7777) as u16,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: n.uid,
            gid: n.gid,
            rdev: 0,
            blksize: regionfs::fuse::BLKSIZE,
            flags: 0,
        }
    }

    fn child(&self, parent: u64, name: &OsStr) -> Result<u64, Errno> {
        let p = self.node(parent)?;
        let p = p.read().map_err(|_| errno(libc::EIO))?;
        match &p.body {
            Body::Dir(c) => c.get(name).copied().ok_or(errno(libc::ENOENT)),
            Body::File(_) => Err(errno(libc::ENOTDIR)),
        }
    }

    fn add(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        body: Body,
        mode: u32,
    ) -> Result<(u64, FileAttr), Errno> {
        let p = self.node(parent)?;
        let mut p = p.write().map_err(|_| errno(libc::EIO))?;
        let Body::Dir(children) = &mut p.body else {
            return Err(errno(libc::ENOTDIR));
        };
        if children.contains_key(name) {
            return Err(errno(libc::EEXIST));
        }
        let ino = self.next.fetch_add(1, Ordering::Relaxed);
        let node = Node {
            body,
            mode,
            uid: req.uid(),
            gid: req.gid(),
        };
        let attr = self.attr(ino, &node);
        self.nodes
            .write()
            .map_err(|_| errno(libc::EIO))?
            .insert(ino, Arc::new(RwLock::new(node)));
        children.insert(name.to_owned(), ino);
        Ok((ino, attr))
    }

    fn remove(&self, parent: u64, name: &OsStr, dir: bool) -> Result<(), Errno> {
        let ino = self.child(parent, name)?;
        let node = self.node(ino)?;
        match (&node.read().map_err(|_| errno(libc::EIO))?.body, dir) {
            (Body::Dir(c), true) if !c.is_empty() => return Err(errno(libc::ENOTEMPTY)),
            (Body::Dir(_), false) => return Err(errno(libc::EISDIR)),
            (Body::File(_), true) => return Err(errno(libc::ENOTDIR)),
            _ => {}
        }
        let p = self.node(parent)?;
        if let Body::Dir(c) = &mut p.write().map_err(|_| errno(libc::EIO))?.body {
            c.remove(name);
        }
        // An unlinked file is gone at once, open or not (the benchmark never reads one).
        self.nodes
            .write()
            .map_err(|_| errno(libc::EIO))?
            .remove(&ino);
        Ok(())
    }

    /// The entries of directory `ino` with their attributes, in name order.
    fn list(&self, ino: u64) -> Result<Vec<(OsString, FileAttr)>, Errno> {
        let children: Vec<(OsString, u64)> = {
            let n = self.node(ino)?;
            let n = n.read().map_err(|_| errno(libc::EIO))?;
            match &n.body {
                Body::Dir(c) => c.iter().map(|(k, v)| (k.clone(), *v)).collect(),
                Body::File(_) => return Err(errno(libc::ENOTDIR)),
            }
        };
        Ok(children
            .into_iter()
            .filter_map(|(name, child)| {
                let n = self.node(child).ok()?;
                let n = n.read().ok()?;
                Some((name, self.attr(child, &n)))
            })
            .collect())
    }

    fn file(&self, ino: u64) -> Result<Arc<RwLock<Node>>, Errno> {
        self.node(ino)
    }
}

fn with_file<T>(
    node: &RwLock<Node>,
    f: impl FnOnce(&File) -> std::io::Result<T>,
) -> Result<T, Errno> {
    let n = node.read().map_err(|_| errno(libc::EIO))?;
    match &n.body {
        Body::File(file) => f(file).map_err(|e| errno(e.raw_os_error().unwrap_or(libc::EIO))),
        Body::Dir(_) => Err(errno(libc::EISDIR)),
    }
}

impl Filesystem for Floor {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        regionfs::fuse::configure_kernel(config);
        let _ = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = self.child(parent.0, name).and_then(|ino| {
            let n = self.node(ino)?;
            let n = n.read().map_err(|_| errno(libc::EIO))?;
            Ok(self.attr(ino, &n))
        });
        match found {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.node(ino.0).and_then(|n| {
            let n = n.read().map_err(|_| errno(libc::EIO))?;
            Ok(self.attr(ino.0, &n))
        }) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let done = self.node(ino.0).and_then(|n| {
            if let Some(size) = size {
                with_file(&n, |f| f.set_len(size))?;
            }
            let mut n = n.write().map_err(|_| errno(libc::EIO))?;
            if let Some(mode) = mode {
                n.mode = mode & 0o7777;
            }
            Ok(self.attr(ino.0, &n))
        });
        match done {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
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
        match self.add(
            req,
            parent.0,
            name,
            Body::Dir(BTreeMap::new()),
            mode & !umask,
        ) {
            Ok((_, a)) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.remove(parent.0, name, false) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.remove(parent.0, name, true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.file(ino.0) {
            // Nothing changes a file behind this mount's back, so the cache is always kept
            // (regionfs keeps it when the region did not change).
            Ok(_) => reply.opened(FileHandle(ino.0), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        thread_local! {
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let mut reply = Some(reply);
        let got = self.file(ino.0).and_then(|n| {
            BUF.with(|b| {
                let mut b = b.borrow_mut();
                if b.len() < size as usize {
                    b.resize(size as usize, 0);
                }
                let len = with_file(&n, |f| f.read_at(&mut b[..size as usize], offset))?;
                if let Some(r) = reply.take() {
                    r.data(&b[..len]);
                }
                Ok(())
            })
        });
        if let (Err(e), Some(r)) = (got, reply) {
            r.error(e);
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self
            .file(ino.0)
            .and_then(|n| with_file(&n, |f| f.write_all_at(data, offset)))
        {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.list(ino.0) {
            Ok(entries) => {
                for (i, (name, attr)) in entries.iter().enumerate().skip(offset as usize) {
                    if reply.add(attr.ino, (i + 1) as u64, attr.kind, name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        match self.list(ino.0) {
            Ok(entries) => {
                for (i, (name, attr)) in entries.iter().enumerate().skip(offset as usize) {
                    if reply.add(attr.ino, (i + 1) as u64, name, &TTL, attr, Generation(0)) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 4096, 255, 4096);
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(errno(libc::ENODATA));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: ReplyXattr) {
        reply.size(0);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let made = memfd()
            .map_err(|e| errno(e.raw_os_error().unwrap_or(libc::EIO)))
            .and_then(|f| self.add(req, parent.0, name, Body::File(f), mode & !umask));
        match made {
            Ok((ino, a)) => reply.created(
                &TTL,
                &a,
                Generation(0),
                FileHandle(ino),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(e),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let Some(mountpoint) = args.next() else {
        bail!("usage: regions-fuse-floor MOUNTPOINT [THREADS]");
    };
    let threads: usize = match args.next() {
        Some(t) => t
            .to_string_lossy()
            .parse()
            .context("THREADS must be a number")?,
        None => 4,
    };
    let mountpoint = Path::new(&mountpoint);
    // SIGTERM and SIGINT wait for sigwait below, in every thread started from here on.
    // SAFETY: a signal set on the stack, filled and passed by pointer to calls that only
    // read it.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("floor".into()),
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(threads.max(2));
    config.clone_fd = true;
    let mut session = Session::new(Floor::new(), mountpoint, &config)
        .with_context(|| format!("cannot mount the FUSE floor at {}", mountpoint.display()))?;
    let mut unmounter = session.unmount_callable();
    let thread = std::thread::spawn(move || session.run());
    // The kernel's read-ahead of this mount, as regionfs sets its own.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !is_fuse(mountpoint) {
        if std::time::Instant::now() > deadline {
            bail!("the FUSE floor at {} did not answer", mountpoint.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    regionfs::mount::raise_readahead(mountpoint);
    println!("ready");
    let mut sig = 0;
    // SAFETY: `set` is the initialised set above; sig is a valid out pointer.
    unsafe { libc::sigwait(&set, &mut sig) };
    unmounter
        .unmount()
        .context("cannot unmount the FUSE floor")?;
    let _ = thread.join();
    Ok(())
}

/// Whether `path` is the root of a FUSE mount (statfs magic).
fn is_fuse(path: &Path) -> bool {
    const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: a NUL-terminated path and a zeroed statfs buffer the call fills.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == FUSE_SUPER_MAGIC
    }
}
