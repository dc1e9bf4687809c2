//! Tests of the core without FUSE, over an in-process manager and daemon
//! (the same ones `regionfs up` runs).

use std::ffi::OsStr;
use std::process::Command;
use std::sync::Mutex;

use super::*;
use regions_embedded::{Cluster, UpConfig};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Inval(u64, i64, i64),
    Store(u64, u64, Vec<u8>),
    InvalEntry(u64, String),
}

#[derive(Default)]
struct FakeKernel {
    calls: Mutex<Vec<Call>>,
    /// Stores refused from now on (as the kernel refuses one for an inode it is evicting).
    refuse_stores: std::sync::atomic::AtomicBool,
}

impl FakeKernel {
    fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}

impl KernelCache for FakeKernel {
    fn invalidate(&self, ino: u64, offset: i64, len: i64) -> std::io::Result<()> {
        self.calls
            .lock()
            .unwrap()
            .push(Call::Inval(ino, offset, len));
        Ok(())
    }
    fn invalidate_entry(&self, parent: u64, name: &OsStr) -> std::io::Result<()> {
        self.calls.lock().unwrap().push(Call::InvalEntry(
            parent,
            name.to_string_lossy().into_owned(),
        ));
        Ok(())
    }
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> std::io::Result<()> {
        if self
            .refuse_stores
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(std::io::Error::from_raw_os_error(libc::ENOENT));
        }
        self.calls
            .lock()
            .unwrap()
            .push(Call::Store(ino, offset, data.to_vec()));
        Ok(())
    }
}

struct Env {
    fs: RegionFs,
    kernel: Arc<FakeKernel>,
    _cluster: Cluster,
    _dir: tempfile::TempDir,
}

fn env_with(options: FsOptions) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(&UpConfig {
        data_dir: dir.path().to_owned(),
        memory: 64 << 20,
        listen: "127.0.0.1:0".parse().unwrap(),
        transport_listen: "127.0.0.1:0".parse().unwrap(),
        share_writable_segments: false,
        transport: regions_proto::transport_choice::TransportChoice::Tcp,
        rdma_device: None,
        small_regions: 0,
    })
    .unwrap();
    let client = Client::connect(cluster.client_config()).unwrap();
    let fs = RegionFs::new(client, options).unwrap();
    let kernel = Arc::new(FakeKernel::default());
    fs.set_kernel(kernel.clone());
    Env {
        fs,
        kernel,
        _cluster: cluster,
        _dir: dir,
    }
}

fn env() -> Env {
    env_with(FsOptions::default())
}

fn root() -> RequestCtx {
    RequestCtx::new(0, 0, std::process::id())
}

fn user() -> RequestCtx {
    RequestCtx::new(1000, 1000, std::process::id())
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn errno<T: std::fmt::Debug>(r: FsResult<T>) -> i32 {
    r.expect_err("expected an error").errno()
}

const RW: i32 = libc::O_RDWR;

impl Env {
    fn create(&self, parent: u64, name: &str) -> (v1::Attr, u64) {
        let (a, o) = self
            .fs
            .create(&root(), parent, os(name), 0o644, 0o022, RW)
            .unwrap();
        (a, o.fh)
    }

    fn read_all(&self, ino: u64) -> Vec<u8> {
        let o = self.fs.open(&root(), ino, libc::O_RDONLY).unwrap();
        let mut out = Vec::new();
        loop {
            let chunk = self.fs.read(o.fh, out.len() as u64, 1 << 20).unwrap();
            if chunk.is_empty() {
                break;
            }
            out.extend_from_slice(&chunk);
        }
        self.fs.release(o.fh).unwrap();
        out
    }
}

#[test]
fn namespace_operations() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "a");
    e.fs.release(fh).unwrap();
    assert_eq!(e.fs.lookup(&root(), ROOT_INO, os("a")).unwrap().ino, a.ino);
    assert_eq!(
        errno(e.fs.lookup(&root(), ROOT_INO, os("nope"))),
        libc::ENOENT
    );
    // rename over an existing file
    let (b, fh) = e.create(ROOT_INO, "b");
    e.fs.release(fh).unwrap();
    e.fs.rename(&root(), (ROOT_INO, os("a")), (ROOT_INO, os("b")), 0)
        .unwrap();
    assert_eq!(e.fs.lookup(&root(), ROOT_INO, os("b")).unwrap().ino, a.ino);
    // The old b is freed once its handle's close (in the background, as FUSE releases are)
    // reaches the manager.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while e.fs.getattr(&root(), b.ino).is_ok() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(errno(e.fs.getattr(&root(), b.ino)), libc::ENOENT);
    let (_, fh) = e.create(ROOT_INO, "c");
    e.fs.release(fh).unwrap();
    assert_eq!(
        errno(e.fs.rename(
            &root(),
            (ROOT_INO, os("b")),
            (ROOT_INO, os("c")),
            libc::RENAME_NOREPLACE
        )),
        libc::EEXIST
    );
    assert_eq!(
        errno(e.fs.rename(&root(), (ROOT_INO, os("b")), (ROOT_INO, os("c")), 4)),
        libc::EINVAL
    );
    // directories
    let d =
        e.fs.mkdir(&root(), ROOT_INO, os("d"), 0o777, 0o022)
            .unwrap();
    assert_eq!(d.mode & 0o777, 0o755);
    let (_, fh) = e.create(d.ino, "f");
    e.fs.release(fh).unwrap();
    assert_eq!(
        errno(e.fs.rmdir(&root(), ROOT_INO, os("d"))),
        libc::ENOTEMPTY
    );
    e.fs.unlink(&root(), d.ino, os("f")).unwrap();
    e.fs.rmdir(&root(), ROOT_INO, os("d")).unwrap();
    // listing: dots, then the entries, resumable by cookie
    let list = e.fs.readdir(&root(), ROOT_INO, 0, true).unwrap();
    let names: Vec<&str> = list.iter().map(|x| x.name.to_str().unwrap()).collect();
    assert_eq!(names, [".", "..", "b", "c"]);
    let after =
        e.fs.readdir(&root(), ROOT_INO, list[2].cookie, false)
            .unwrap();
    assert_eq!(
        after
            .iter()
            .map(|x| x.name.to_str().unwrap())
            .collect::<Vec<_>>(),
        ["c"]
    );
    // reserved and unsupported
    assert_eq!(
        errno(e.fs.mkdir(&root(), ROOT_INO, os(".regions"), 0o755, 0)),
        libc::EEXIST
    );
    // symbolic links, hard links and special files
    let l =
        e.fs.symlink(&root(), ROOT_INO, os("l"), Path::new("b"))
            .unwrap();
    assert_eq!(l.kind(), FileKind::Symlink);
    assert_eq!(e.fs.readlink(&root(), l.ino).unwrap(), b"b");
    assert_eq!(errno(e.fs.readlink(&root(), a.ino)), libc::EINVAL);
    let twin = e.fs.link(&root(), a.ino, ROOT_INO, os("twin")).unwrap();
    assert_eq!((twin.ino, twin.nlink), (a.ino, 2));
    assert_eq!(
        errno(e.fs.link(&root(), a.ino, ROOT_INO, os("l"))),
        libc::EEXIST
    );
    let fifo =
        e.fs.mknod(
            &root(),
            ROOT_INO,
            os("fifo"),
            libc::S_IFIFO | 0o666,
            0o022,
            0,
        )
        .unwrap();
    assert_eq!((fifo.kind(), fifo.mode), (FileKind::Fifo, 0o644));
    assert_eq!(
        errno(e.fs.mknod(
            &user(),
            ROOT_INO,
            os("dev"),
            libc::S_IFCHR | 0o600,
            0,
            0x103
        )),
        libc::EPERM
    );
    for name in ["l", "twin", "fifo"] {
        e.fs.unlink(&root(), ROOT_INO, os(name)).unwrap();
    }
    let n =
        e.fs.mknod(&root(), ROOT_INO, os("plain"), libc::S_IFREG | 0o600, 0, 0)
            .unwrap();
    assert_eq!(n.mode & 0o777, 0o600);
    // permissions are the manager's
    e.fs.setattr(
        &root(),
        n.ino,
        SetAttrIn {
            mode: Some(0o600),
            ..SetAttrIn::default()
        },
        false,
        None,
    )
    .unwrap();
    assert_eq!(
        errno(e.fs.open(&user(), n.ino, libc::O_RDONLY)),
        libc::EACCES
    );
    assert_eq!(errno(e.fs.access(&user(), n.ino, 4)), libc::EACCES);
    e.fs.access(&root(), n.ino, 4).unwrap();
    let st = e.fs.statfs(&root()).unwrap();
    assert!(st.blocks * u64::from(st.bsize) >= 60 << 20, "{st:?}");
}

/// Every open and create counts in the page of descriptor epochs before it is answered, and
/// every flush (a close) counts in its inode's word; the mount names the page on every inode.
#[test]
fn opens_and_closes_count_in_the_descriptor_epoch_page() {
    use regions_proto::descriptor_epochs::{OPENS, close_word};
    let e = env();
    let d = e.fs.descriptor_epochs().expect("a descriptor-epoch page");
    let opens = d.value(OPENS);
    let (a, fh) = e.create(ROOT_INO, "epochs");
    assert_eq!(d.value(OPENS), opens + 1, "create did not count");
    let closes = d.value(close_word(a.ino));
    e.fs.flush(a.ino, fh).unwrap();
    assert_eq!(
        d.value(close_word(a.ino)),
        closes + 1,
        "flush did not count"
    );
    e.fs.release(fh).unwrap();
    let o = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    assert_eq!(d.value(OPENS), opens + 2, "open did not count");
    e.fs.release(o.fh).unwrap();
    let XattrOut::Data(path) =
        e.fs.getxattr(
            &user(),
            a.ino,
            os(regions_proto::descriptor_epochs::XATTR),
            4096,
        )
        .unwrap()
    else {
        panic!("no value");
    };
    assert_eq!(path, d.path().as_os_str().as_bytes());
}

#[test]
fn data_append_truncate_and_holes() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "data");
    assert_eq!(e.fs.write(fh, 0, b"hello ").unwrap(), 6);
    assert_eq!(e.fs.write(fh, 6, b"world").unwrap(), 5);
    e.fs.flush(a.ino, fh).unwrap();
    e.fs.release(fh).unwrap();
    assert_eq!(e.read_all(a.ino), b"hello world");
    // truncate up: the hole reads as zeros; truncate down: gone
    let up = SetAttrIn {
        size: Some(300_000),
        ..SetAttrIn::default()
    };
    assert_eq!(
        e.fs.setattr(&root(), a.ino, up, false, None).unwrap().size,
        300_000
    );
    let back = e.read_all(a.ino);
    assert_eq!(back.len(), 300_000);
    assert_eq!(&back[..11], b"hello world");
    assert!(back[11..].iter().all(|b| *b == 0));
    let down = SetAttrIn {
        size: Some(5),
        ..SetAttrIn::default()
    };
    e.fs.setattr(&root(), a.ino, down, false, None).unwrap();
    assert_eq!(e.read_all(a.ino), b"hello");
    // a write far past the end leaves a hole of zeros
    let o = e.fs.open(&root(), a.ino, RW).unwrap();
    e.fs.write(o.fh, 1 << 20, b"end").unwrap();
    e.fs.release(o.fh).unwrap();
    let back = e.read_all(a.ino);
    assert_eq!(back.len(), (1 << 20) + 3);
    assert!(back[5..1 << 20].iter().all(|b| *b == 0));
    // a read-only handle cannot write
    let ro = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    assert_eq!(errno(e.fs.write(ro.fh, 0, b"x")), libc::EBADF);
    e.fs.release(ro.fh).unwrap();
    assert_eq!(errno(e.fs.read(ro.fh, 0, 1)), libc::EBADF);
}

#[test]
fn a_handle_sees_growth_through_another() {
    let e = env();
    let (a, w) = e.create(ROOT_INO, "g");
    e.fs.write(w, 0, b"1234").unwrap();
    let r = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    e.fs.write(w, 4, b"5678").unwrap();
    assert_eq!(e.fs.read(r.fh, 0, 100).unwrap(), b"12345678");
    e.fs.release(r.fh).unwrap();
    e.fs.release(w).unwrap();
}

#[test]
fn close_to_open_keeps_cache_only_when_unchanged() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "k");
    e.fs.write(fh, 0, b"v1").unwrap();
    e.fs.release(fh).unwrap();
    // Our own writes were published with the new mtime: keep the cache.
    let o = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    assert!(o.keep_cache);
    e.fs.release(o.fh).unwrap();
    // Another host changes the region (same size, new mtime): drop it.
    std::thread::sleep(Duration::from_millis(5));
    let other = e.fs.client().open(a.ino, true).unwrap();
    other.write_at(0, b"v2").unwrap();
    drop(other);
    e.fs.manager()
        .setattr(
            &e.fs.identity.internal(),
            a.ino,
            &SetAttrIn {
                mtime: Some(SetTime::Now),
                ..SetAttrIn::default()
            },
        )
        .unwrap();
    e.kernel.take();
    let o = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    assert!(!o.keep_cache);
    assert_eq!(e.kernel.take(), vec![Call::Inval(a.ino, -1, 0)]);
    assert_eq!(e.fs.read(o.fh, 0, 10).unwrap(), b"v2");
    e.fs.release(o.fh).unwrap();
    let o = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    assert!(o.keep_cache);
    e.fs.release(o.fh).unwrap();
}

#[test]
fn growth_elsewhere_reaches_the_kernel_size() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "grow");
    e.fs.write(fh, 0, &[1u8; 10_000]).unwrap();
    e.fs.release(fh).unwrap();
    e.kernel.take();
    // Another writer appends (as another host would).
    let other = e.fs.client().open(a.ino, true).unwrap();
    other.write_at(10_000, &[9u8; 100]).unwrap();
    drop(other);
    let attr = e.fs.getattr(&root(), a.ino).unwrap();
    assert_eq!(attr.size, 10_100);
    assert_eq!(
        e.kernel.take(),
        vec![
            Call::Inval(a.ino, 8192, 0),
            Call::Store(a.ino, 10_099, vec![9])
        ]
    );
    // Known now: no second announcement.
    e.fs.getattr(&root(), a.ino).unwrap();
    assert!(e.kernel.take().is_empty());
}

#[test]
fn a_late_forget_keeps_what_the_kernel_holds_now() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "late");
    e.fs.write(fh, 0, &[1u8; 100]).unwrap();
    e.fs.release(fh).unwrap();
    // Handed out by the create, evicted by the kernel (its forget of 1 still queued), then
    // handed out again by a new lookup before that forget arrives.
    e.fs.handing(a.ino);
    e.fs.handing(a.ino);
    e.fs.forget(a.ino, 1);
    let other = e.fs.client().open(a.ino, true).unwrap();
    other.write_at(100, &[5u8; 20]).unwrap();
    drop(other);
    e.kernel.take();
    assert_eq!(e.fs.getattr(&root(), a.ino).unwrap().size, 120);
    assert!(
        e.kernel.take().contains(&Call::Store(a.ino, 119, vec![5])),
        "the kernel's inode (100 bytes) learns the growth: the late forget did not drop what \
         this mount knew of it"
    );
    // Its last lookup forgotten, the next one is a new inode, which takes the size it is given.
    e.fs.forget(a.ino, 1);
    let other = e.fs.client().open(a.ino, true).unwrap();
    other.write_at(120, &[6u8; 10]).unwrap();
    drop(other);
    e.kernel.take();
    assert_eq!(e.fs.getattr(&root(), a.ino).unwrap().size, 130);
    assert!(
        e.kernel.take().is_empty(),
        "a new inode needs no announcement"
    );
}

#[test]
fn a_growth_the_kernel_refused_is_announced_again() {
    use std::sync::atomic::Ordering::Relaxed;
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "grow");
    e.fs.write(fh, 0, &[1u8; 100]).unwrap();
    e.fs.release(fh).unwrap();
    let other = e.fs.client().open(a.ino, true).unwrap();
    other.write_at(100, &[7u8; 20]).unwrap();
    drop(other);
    e.kernel.take();
    e.kernel.refuse_stores.store(true, Relaxed);
    assert_eq!(e.fs.getattr(&root(), a.ino).unwrap().size, 120);
    e.kernel.refuse_stores.store(false, Relaxed);
    e.kernel.take();
    // The kernel still holds 100 bytes: the next open announces the growth again.
    let o = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    assert!(
        e.kernel.take().contains(&Call::Store(a.ino, 119, vec![7])),
        "the open after a refused store announces the growth again"
    );
    e.fs.release(o.fh).unwrap();
}

#[test]
fn writeback_bookkeeping_times_need_no_ownership() {
    let e = env();
    let d =
        e.fs.mkdir(&root(), ROOT_INO, os("shared"), 0o777, 0)
            .unwrap();
    let (a, fh) = e.create(d.ino, "f");
    e.fs.release(fh).unwrap();
    e.fs.setattr(
        &root(),
        a.ino,
        SetAttrIn {
            mode: Some(0o666),
            ..SetAttrIn::default()
        },
        false,
        None,
    )
    .unwrap();
    // uid 1000 may write but does not own the file.
    let o = e.fs.open(&user(), a.ino, RW).unwrap();
    e.fs.write(o.fh, 0, b"x").unwrap();
    let explicit = SetAttrIn {
        mtime: Some(SetTime::At(1000, 0)),
        ..SetAttrIn::default()
    };
    // The kernel flushing its mtime (with ctime and the open file).
    e.fs.setattr(&user(), a.ino, explicit.clone(), true, Some(o.fh))
        .unwrap();
    // A truncate carrying the kernel's mtime.
    let trunc = SetAttrIn {
        size: Some(0),
        ..explicit.clone()
    };
    e.fs.setattr(&user(), a.ino, trunc, true, Some(o.fh))
        .unwrap();
    // utimensat with an explicit time still needs ownership.
    assert_eq!(
        errno(e.fs.setattr(&user(), a.ino, explicit, false, None)),
        libc::EPERM
    );
    e.fs.release(o.fh).unwrap();
}

#[test]
fn create_with_a_mode_that_forbids_the_open() {
    let e = env();
    let d = e.fs.mkdir(&root(), ROOT_INO, os("pub"), 0o777, 0).unwrap();
    let (a, o) =
        e.fs.create(&user(), d.ino, os("ro"), 0o444, 0, libc::O_WRONLY)
            .unwrap();
    assert_eq!(a.mode & 0o777, 0o444);
    e.fs.write(o.fh, 0, b"data").unwrap();
    e.fs.release(o.fh).unwrap();
    assert_eq!(errno(e.fs.open(&user(), a.ino, RW)), libc::EACCES);
    assert_eq!(e.read_all(a.ino), b"data");
}

#[test]
fn xattrs_with_size_probes() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "x");
    e.fs.release(fh).unwrap();
    e.fs.setxattr(&root(), a.ino, os("user.note"), b"hello", 0)
        .unwrap();
    assert_eq!(
        e.fs.getxattr(&root(), a.ino, os("user.note"), 0).unwrap(),
        XattrOut::Size(5)
    );
    assert_eq!(
        e.fs.getxattr(&root(), a.ino, os("user.note"), 64).unwrap(),
        XattrOut::Data(b"hello".to_vec())
    );
    assert_eq!(
        errno(e.fs.getxattr(&root(), a.ino, os("user.note"), 2)),
        libc::ERANGE
    );
    assert_eq!(
        errno(e.fs.getxattr(&root(), a.ino, os("user.none"), 64)),
        libc::ENODATA
    );
    assert_eq!(
        errno(e.fs.setxattr(&root(), a.ino, os("user.regions.persistent"), b"2", 0)),
        libc::EINVAL
    );
    let XattrOut::Size(n) = e.fs.listxattr(&root(), a.ino, 0).unwrap() else {
        panic!("size expected")
    };
    let XattrOut::Data(list) = e.fs.listxattr(&root(), a.ino, n).unwrap() else {
        panic!("data expected")
    };
    assert_eq!(list.len(), n as usize);
    let names: Vec<&[u8]> = list.split(|b| *b == 0).filter(|s| !s.is_empty()).collect();
    assert!(names.contains(&&b"user.note"[..]));
    assert!(
        !names.contains(&&b"user.regions.persistent"[..]),
        "region attributes are not listed"
    );
    assert_eq!(errno(e.fs.listxattr(&root(), a.ino, 3)), libc::ERANGE);
    e.fs.removexattr(&root(), a.ino, os("user.note")).unwrap();
    assert_eq!(
        errno(e.fs.getxattr(&root(), a.ino, os("user.note"), 64)),
        libc::ENODATA
    );
    let pid =
        e.fs.getxattr(&root(), a.ino, os("user.regions.ownerpid"), 64)
            .unwrap();
    assert_eq!(
        pid,
        XattrOut::Data(std::process::id().to_string().into_bytes())
    );
}

#[test]
fn ioctls() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "io");
    e.fs.write(fh, 0, &[5u8; 200_000]).unwrap();
    let info = ioctl::Info::parse(&e.fs.ioctl(fh, ioctl::RINFO, &[]).unwrap()).unwrap();
    assert_eq!((info.ino, info.size), (a.ino, 200_000));
    assert_eq!(info.hosts, vec![regions_embedded::HOST_ID]);
    assert_ne!(info.flags & ioctl::INFO_LOCAL, 0);
    assert_ne!(info.flags & ioctl::INFO_WRITABLE, 0);
    assert_ne!(info.flags & ioctl::INFO_PERSISTENT, 0);
    assert!(info.map_version > 0);
    e.kernel.take();
    let all = ioctl::Range::default().encode();
    e.fs.ioctl(fh, ioctl::RCLEARCACHE, &all).unwrap();
    assert_eq!(e.kernel.take()[0], Call::Inval(a.ino, 0, 0));
    let range = ioctl::Range {
        offset: 4096,
        len: 8192,
    }
    .encode();
    e.fs.ioctl(fh, ioctl::RPREFETCH, &range).unwrap();
    assert_eq!(
        e.kernel.take(),
        vec![
            Call::Inval(a.ino, 4096, 8192),
            Call::Store(a.ino, 4096, vec![5u8; 8192])
        ]
    );
    let zero = ioctl::MarkDirty {
        range: ioctl::Range {
            offset: 100,
            len: 1000,
        },
        zero: true,
    }
    .encode();
    e.fs.ioctl(fh, ioctl::RMARKDIRTY, &zero).unwrap();
    let back = e.fs.read(fh, 0, 2000).unwrap();
    assert!(back[..100].iter().all(|b| *b == 5));
    assert!(back[100..1100].iter().all(|b| *b == 0));
    assert!(back[1100..].iter().all(|b| *b == 5));
    assert_eq!(errno(e.fs.ioctl(fh, 0x1234, &[])), libc::ENOTTY);
    assert_eq!(
        errno(e.fs.ioctl(fh, ioctl::RPREFETCH, &[1, 2])),
        libc::EINVAL
    );
    e.fs.release(fh).unwrap();
    let ro = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    assert_eq!(
        errno(e.fs.ioctl(ro.fh, ioctl::RMARKDIRTY, &zero)),
        libc::EBADF
    );
    e.fs.release(ro.fh).unwrap();
}

#[test]
fn metadata_files_for_root_only() {
    let e = env();
    let (a, fh) = e.create(ROOT_INO, "meta");
    e.fs.write(fh, 0, b"abc").unwrap();
    assert_eq!(
        errno(e.fs.lookup(&user(), ROOT_INO, os(".regions"))),
        libc::EACCES
    );
    let dir = e.fs.lookup(&root(), ROOT_INO, os(".regions")).unwrap();
    assert!(pseudo::is_pseudo(dir.ino));
    assert_eq!(
        errno(e.fs.readdir(&user(), dir.ino, 0, false)),
        libc::EACCES
    );
    let names: Vec<String> =
        e.fs.readdir(&root(), dir.ino, 0, false)
            .unwrap()
            .into_iter()
            .map(|x| x.name.into_string().unwrap())
            .collect();
    assert_eq!(
        names,
        [
            ".", "..", "hosts", "memusage", "pools", "daemon", "procs", "files"
        ]
    );
    // .regions does not show in the root listing
    assert!(
        e.fs.readdir(&root(), ROOT_INO, 0, false)
            .unwrap()
            .iter()
            .all(|x| x.name != ".regions")
    );
    let read = |name: &str| -> String {
        let at = e.fs.lookup(&root(), dir.ino, os(name)).unwrap();
        let o = e.fs.open(&root(), at.ino, libc::O_RDONLY).unwrap();
        assert!(o.direct_io);
        let text = String::from_utf8(e.fs.read(o.fh, 0, 1 << 20).unwrap()).unwrap();
        e.fs.release(o.fh).unwrap();
        text
    };
    let hosts = read("hosts");
    assert!(hosts.lines().nth(1).unwrap().starts_with("1\t"), "{hosts}");
    assert!(read("pools").lines().count() >= 2);
    assert!(read("memusage").contains("regions_held"));
    let daemon = read("daemon");
    assert!(
        daemon.contains(&format!("pid\t{}", std::process::id())),
        "{daemon}"
    );
    let procs = read("procs");
    assert!(
        procs.contains(&format!("\t{}\t{fh}\trw\tcached", a.ino)),
        "{procs}"
    );
    // The size shown is the durable one: make the writes durable first.
    e.fs.fsync(fh).unwrap();
    let files = e.fs.lookup(&root(), dir.ino, os("files")).unwrap();
    let meta = e.fs.lookup(&root(), files.ino, os("meta")).unwrap();
    let o = e.fs.open(&root(), meta.ino, libc::O_RDONLY).unwrap();
    let text = String::from_utf8(e.fs.read(o.fh, 0, 1 << 20).unwrap()).unwrap();
    e.fs.release(o.fh).unwrap();
    assert!(text.contains("path\t/meta"), "{text}");
    assert!(text.contains("size\t3"), "{text}");
    assert!(text.contains("-> pool"), "{text}");
    let at = e.fs.lookup(&root(), dir.ino, os("hosts")).unwrap();
    assert_eq!(errno(e.fs.open(&root(), at.ino, RW)), libc::EACCES);
    assert_eq!(
        errno(e.fs.open(&user(), at.ino, libc::O_RDONLY)),
        libc::EACCES
    );
    assert_eq!(
        errno(e.fs.unlink(&root(), dir.ino, os("hosts"))),
        libc::EACCES
    );
    e.fs.release(fh).unwrap();
}

#[test]
fn non_persistent_regions_die_with_their_owner() {
    let e = env();
    let d = e.fs.mkdir(&root(), ROOT_INO, os("tmp"), 0o777, 0).unwrap();
    e.fs.setxattr(&root(), d.ino, os("user.regions.persistent"), b"0", 0)
        .unwrap();
    let mut child = Command::new("sleep").arg("0.5").spawn().unwrap();
    let owner = RequestCtx::new(0, 0, child.id());
    let (a, o) =
        e.fs.create(&owner, d.ino, os("mine"), 0o644, 0, RW)
            .unwrap();
    assert_eq!(a.owner_pid, child.id());
    e.fs.release(o.fh).unwrap();
    // A persistent one in the same place survives.
    let (keep, o) = e.create(ROOT_INO, "kept");
    e.fs.release(o).unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.fs.lookup(&root(), d.ino, os("mine")).is_ok() {
        assert!(Instant::now() < deadline, "the region outlived its owner");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        e.fs.lookup(&root(), ROOT_INO, os("kept")).unwrap().ino,
        keep.ino
    );
}

#[test]
fn onewriter_conflict_is_etxtbsy() {
    let e = env_with(FsOptions {
        busy_retry: Duration::from_millis(50),
        ..FsOptions::default()
    });
    let (a, fh) = e.create(ROOT_INO, "one");
    e.fs.setxattr(&root(), a.ino, os("user.regions.onewriter"), b"1", 0)
        .unwrap();
    let started = Instant::now();
    assert_eq!(errno(e.fs.open(&root(), a.ino, RW)), libc::ETXTBSY);
    assert!(started.elapsed() >= Duration::from_millis(50));
    let ro = e.fs.open(&root(), a.ino, libc::O_RDONLY).unwrap();
    e.fs.release(fh).unwrap();
    let w = e.fs.open(&root(), a.ino, RW).unwrap();
    e.fs.release(w.fh).unwrap();
    e.fs.release(ro.fh).unwrap();
}

#[test]
fn names_that_are_not_utf8_round_trip() {
    use std::os::unix::ffi::OsStrExt;
    let e = env();
    let raw = OsStr::from_bytes(b"bad\xffname");
    let (a, o) = e.fs.create(&root(), ROOT_INO, raw, 0o644, 0, RW).unwrap();
    e.fs.release(o.fh).unwrap();
    assert_eq!(e.fs.lookup(&root(), ROOT_INO, raw).unwrap().ino, a.ino);
    let list = e.fs.readdir(&root(), ROOT_INO, 0, false).unwrap();
    assert!(list.iter().any(|x| x.name.as_bytes() == b"bad\xffname"));
    assert_eq!(
        errno(e.fs.lookup(&root(), ROOT_INO, os("\u{10FFAA}"))),
        libc::EINVAL
    );
}

#[test]
fn search_and_exec_permissions() {
    let e = env();
    let d = e.fs.mkdir(&root(), ROOT_INO, os("s"), 0o755, 0).unwrap();
    let (f, o) = e.create(d.ino, "f");
    e.fs.release(o).unwrap();
    assert!(e.fs.entry_cacheable(d.ino, os("f")));
    // An entry the kernel was told to cache that the manager no longer lists (a name
    // another host removed meanwhile): forgotten all the same, from this mount's record.
    assert!(e.fs.entry_cacheable_noting(d.ino, os("gone"), Duration::from_secs(1)));
    e.kernel.take();
    let chmod = |mode| SetAttrIn {
        mode: Some(mode),
        ..SetAttrIn::default()
    };
    e.fs.setattr(&root(), d.ino, chmod(0o766), false, None)
        .unwrap();
    assert!(!e.fs.entry_cacheable(d.ino, os("f")));
    assert!(!e.fs.entry_cacheable(ROOT_INO, os(".regions")));
    // Cached entries of the directory are dropped (on another thread).
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen = Vec::new();
    while !(seen.contains(&Call::InvalEntry(d.ino, "f".into()))
        && seen.contains(&Call::InvalEntry(d.ino, "gone".into())))
    {
        assert!(
            Instant::now() < deadline,
            "entries not invalidated: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
        seen.extend(e.kernel.take());
    }
    assert_eq!(errno(e.fs.lookup(&user(), d.ino, os("f"))), libc::EACCES);
    // execve of a file whose execute bit is not the caller's.
    e.fs.setattr(&root(), f.ino, chmod(0o744), false, None)
        .unwrap();
    assert_eq!(
        errno(e.fs.open(&user(), f.ino, libc::O_RDONLY | FMODE_EXEC)),
        libc::EACCES
    );
    let o =
        e.fs.open(&root(), f.ino, libc::O_RDONLY | FMODE_EXEC)
            .unwrap();
    e.fs.release(o.fh).unwrap();
}

/// The record of entries handed to the kernel stays bounded: once it holds many, entries
/// older than the TTL (which the kernel no longer caches) are swept, at most once per TTL, and
/// none is recorded past the bound meanwhile. A directory forgotten by the kernel takes its
/// records with it.
#[test]
fn cached_entry_records_are_swept() {
    let e = env();
    let d = e.fs.mkdir(&root(), ROOT_INO, os("big"), 0o755, 0).unwrap();
    let held = || e.fs.cached_names.load(std::sync::atomic::Ordering::Relaxed);
    let note = |name: &str, ttl| e.fs.entry_cacheable_noting(d.ino, os(name), ttl);
    for i in 0..(1 << 16) + 10 {
        assert!(note(&format!("n{i}"), Duration::ZERO));
    }
    assert!(held() < 100, "{} records kept", held());
    // Past the bound nothing more is recorded, and no sweep runs again within the TTL (a
    // sweep would keep these: they are fresh).
    let before = held();
    for i in 0..(1 << 16) {
        note(&format!("m{i}"), Duration::from_secs(60));
    }
    assert_eq!(held(), 1 << 16);
    let recorded = (1 << 16) - before;
    {
        let dirs = e.fs.dirs.lock().unwrap();
        let cached = &dirs[&d.ino].cached;
        assert!(cached.contains_key(OsStr::new("m0")));
        assert!(cached.contains_key(OsStr::new(&format!("m{}", recorded - 1))));
        assert!(!cached.contains_key(OsStr::new(&format!("m{recorded}"))));
    }
    e.fs.forget(d.ino, 1);
    assert_eq!(held(), 0, "the forgotten directory's records are gone");
    // A directory this mount does not know records nothing (its mode is unknown).
    assert!(e.fs.entry_cacheable_noting(999_999, os("x"), Duration::from_secs(1)));
    assert_eq!(held(), 0);
}
