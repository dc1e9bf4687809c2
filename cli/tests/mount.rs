//! End-to-end tests of real mounts: `regionfs up` (a whole cluster in one
//! process) and, across two hosts, `regionfs mount` over the workspace's
//! `regions-manager` and `regions-daemon` binaries (`cargo build --bins`
//! first). Everything is checked with std::fs and ordinary tools.

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cluster, Proc, errno_of, mount_type, sh, up, up_in};
use regionfs::ioctl;
use regions_tests::python_with_numpy;

/// `setxattr(2)`: 0, or the errno.
fn setxattr(p: &Path, name: &str, value: &[u8]) -> i32 {
    match regions_tests::set_xattr(p, name, value) {
        Ok(()) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

fn getxattr(p: &Path, name: &str) -> Result<Vec<u8>, i32> {
    regions_tests::get_xattr(p, name).map_err(|e| e.raw_os_error().unwrap_or(-1))
}

#[test]
fn files_through_an_up_mount() {
    let u = up(&[]);
    assert_eq!(mount_type(&u.mountpoint).as_deref(), Some("fuse.regions"));
    // create, write, read
    let a = u.path("a");
    std::fs::write(&a, b"hello").unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), b"hello");
    // append
    let mut f = std::fs::OpenOptions::new().append(true).open(&a).unwrap();
    f.write_all(b" world").unwrap();
    drop(f);
    assert_eq!(std::fs::read_to_string(&a).unwrap(), "hello world");
    sh(&format!("echo line >> {}", a.display()));
    assert_eq!(std::fs::read_to_string(&a).unwrap(), "hello worldline\n");
    // truncate up and down: holes read as zeros
    let f = std::fs::OpenOptions::new().write(true).open(&a).unwrap();
    f.set_len(3).unwrap();
    f.set_len(200_000).unwrap();
    drop(f);
    let back = std::fs::read(&a).unwrap();
    assert_eq!(back.len(), 200_000);
    assert_eq!(&back[..3], b"hel");
    assert!(back[3..].iter().all(|b| *b == 0));
    let mut f = std::fs::OpenOptions::new().write(true).open(&a).unwrap();
    f.seek(SeekFrom::Start(3 << 20)).unwrap();
    f.write_all(b"far").unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&a).unwrap().len(), (3 << 20) + 3);
    let mut f = std::fs::File::open(&a).unwrap();
    let mut buf = vec![1u8; 1 << 20];
    f.seek(SeekFrom::Start(1 << 20)).unwrap();
    f.read_exact(&mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 0));
    // rename over an existing file
    std::fs::write(u.path("old"), b"old").unwrap();
    std::fs::write(u.path("new"), b"new").unwrap();
    std::fs::rename(u.path("new"), u.path("old")).unwrap();
    assert_eq!(std::fs::read(u.path("old")).unwrap(), b"new");
    assert_eq!(errno_of(std::fs::metadata(u.path("new"))), libc::ENOENT);
    // mkdir / rmdir
    std::fs::create_dir(u.path("d")).unwrap();
    std::fs::write(u.path("d/f"), b"x").unwrap();
    assert_eq!(errno_of(std::fs::remove_dir(u.path("d"))), libc::ENOTEMPTY);
    std::fs::remove_file(u.path("d/f")).unwrap();
    std::fs::remove_dir(u.path("d")).unwrap();
    // listing (the metadata directory is hidden)
    let mut names: Vec<String> = std::fs::read_dir(&u.mountpoint)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["a", "old"]);
    // xattrs
    assert_eq!(setxattr(&a, "user.note", b"value"), 0);
    assert_eq!(getxattr(&a, "user.note").unwrap(), b"value");
    assert_eq!(getxattr(&a, "user.regions.persistent").unwrap(), b"1");
    assert_eq!(
        setxattr(&a, "user.regions.persistent", b"yes please"),
        libc::EINVAL
    );
    assert_eq!(getxattr(&a, "user.missing"), Err(libc::ENODATA));
    assert!(!getxattr(&a, "user.regions.ownerpid").unwrap().is_empty());
    // symlinks, hard links and fifos, as shell tools make them
    std::os::unix::fs::symlink("a", u.path("l")).unwrap();
    assert_eq!(std::fs::read_link(u.path("l")).unwrap(), Path::new("a"));
    std::fs::hard_link(&a, u.path("h")).unwrap();
    assert_eq!(std::fs::metadata(u.path("h")).unwrap().nlink(), 2);
    let fifo = Command::new("mkfifo").arg(u.path("p")).output().unwrap();
    assert!(fifo.status.success(), "mkfifo: {fifo:?}");
    for name in ["l", "h", "p"] {
        std::fs::remove_file(u.path(name)).unwrap();
    }
    // permissions are the manager's
    std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o600)).unwrap();
    let denied = Command::new("cat")
        .arg(&a)
        .uid(1000)
        .gid(1000)
        .output()
        .unwrap();
    assert!(!denied.status.success());
    assert!(String::from_utf8_lossy(&denied.stderr).contains("Permission denied"));
    // statfs: the cluster's memory
    let st = rustix::fs::statvfs(&u.mountpoint).unwrap();
    assert!(
        st.f_blocks * st.f_frsize >= 500 << 20,
        "total {}",
        st.f_blocks * st.f_frsize
    );
}

#[test]
fn metadata_files() {
    let u = up(&[]);
    std::fs::write(u.path("r"), vec![3u8; 300_000]).unwrap();
    let hosts = std::fs::read_to_string(u.path(".regions/hosts")).unwrap();
    assert!(hosts.starts_with("host\taddress\tlive"), "{hosts}");
    assert!(
        hosts.lines().nth(1).unwrap().starts_with("1\t127.0.0.1:"),
        "{hosts}"
    );
    for name in ["memusage", "pools", "daemon", "procs"] {
        let text = std::fs::read_to_string(u.path(&format!(".regions/{name}"))).unwrap();
        assert!(!text.is_empty(), "{name} is empty");
    }
    let daemon = std::fs::read_to_string(u.path(".regions/daemon")).unwrap();
    assert!(daemon.contains(&format!("pid\t{}", u.proc.pid)), "{daemon}");
    let meta = std::fs::read_to_string(u.path(".regions/files/r")).unwrap();
    assert!(meta.contains("size\t300000"), "{meta}");
    assert!(meta.contains("-> pool"), "{meta}");
    let denied = Command::new("cat")
        .arg(u.path(".regions/hosts"))
        .uid(1000)
        .gid(1000)
        .output()
        .unwrap();
    assert!(!denied.status.success());
    assert!(String::from_utf8_lossy(&denied.stderr).contains("Permission denied"));
    assert_eq!(
        errno_of(std::fs::write(u.path(".regions/hosts"), b"x")),
        libc::EACCES
    );
}

#[test]
fn mmap_write_then_read() {
    let u = up(&[]);
    let path = u.path("mapped");
    let script = format!(
        r#"
import mmap, random
size = 16 << 20
data = random.Random(7).randbytes(size)
with open({p:?}, "w+b") as f:
    f.truncate(size)
    m = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[:] = data
    m.flush()
    m.close()
with open({p:?}, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
    back = m[:]
    m.close()
assert back == data, "mmap read back differs"
print("ok")
"#,
        p = path.display().to_string()
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Another process reads the same bytes with read(2).
    let expected = {
        let out = Command::new("python3")
            .arg("-c")
            .arg("import random,sys; sys.stdout.buffer.write(random.Random(7).randbytes(16 << 20))")
            .output()
            .unwrap();
        out.stdout
    };
    common::assert_same(
        &std::fs::read(&path).unwrap(),
        &expected,
        "mmap-written bytes read back",
    );
}

#[test]
fn ioctls_on_an_open_region() {
    let u = up(&[]);
    let path = u.path("io");
    std::fs::write(&path, vec![1u8; 100_000]).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut info = vec![0u8; ioctl::INFO_SIZE];
    // SAFETY: RINFO writes INFO_SIZE bytes into the buffer, which has them.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), ioctl::RINFO as _, info.as_mut_ptr()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let info = ioctl::Info::parse(&info).unwrap();
    assert_eq!(info.ino, std::fs::metadata(&path).unwrap().ino());
    assert_eq!(info.size, 100_000);
    assert_eq!(info.hosts, vec![1]);
    let range = ioctl::Range::default().encode();
    for cmd in [ioctl::RCLEARCACHE, ioctl::RPREFETCH] {
        // SAFETY: the command reads RANGE_SIZE bytes from the buffer.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), cmd as _, range.as_ptr()) };
        assert_eq!(r, 0, "{cmd:#x}: {}", std::io::Error::last_os_error());
    }
    let zero = ioctl::MarkDirty {
        range: ioctl::Range {
            offset: 10,
            len: 10,
        },
        zero: true,
    }
    .encode();
    // SAFETY: RMARKDIRTY reads MARKDIRTY_SIZE bytes from the buffer.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), ioctl::RMARKDIRTY as _, zero.as_ptr()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let back = std::fs::read(&path).unwrap();
    assert_eq!(&back[..10], &[1u8; 10]);
    assert_eq!(&back[10..20], &[0u8; 10]);
    assert_eq!(&back[20..30], &[1u8; 10]);
    // SAFETY: an unknown _IO command carries no argument.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), ioctl::ioc(0, ioctl::IOC_MAGIC, 99, 0) as _) };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
}

#[test]
fn sigterm_unmounts_and_a_live_mount_is_refused() {
    let mut u = up(&[]);
    std::fs::write(u.path("f"), b"x").unwrap();
    // A second instance on the same mountpoint says to unmount it.
    let second = Command::new(common::regionfs_bin())
        .args(common::up_args(u.dir.path(), &[]))
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("already mounted"), "{err}");
    let status = u.proc.sigterm();
    assert!(status.success(), "{status}: {}", u.proc.log());
    assert_eq!(mount_type(&u.mountpoint), None, "nothing left mounted");
    assert!(u.proc.log().contains("unmounted"));
}

#[test]
fn a_stale_mount_is_detached_at_the_next_start() {
    let dir = tempfile::Builder::new()
        .prefix("regionfs-stale")
        .tempdir()
        .unwrap();
    let mut first = up_in(dir.path(), &[]);
    std::fs::write(first.path("kept"), b"x").unwrap();
    first.proc.sigkill();
    // The mount is dead but still there.
    assert!(mount_type(&first.mountpoint).is_some());
    assert_eq!(
        errno_of(std::fs::metadata(&first.mountpoint)),
        libc::ENOTCONN
    );
    let second = up_in(dir.path(), &[]);
    assert!(
        second.proc.log().contains("stale mount"),
        "{}",
        second.proc.log()
    );
    // The mount answers again.
    std::fs::read_dir(&second.mountpoint).unwrap();
    std::fs::write(second.path("new"), b"works").unwrap();
    assert_eq!(std::fs::read(second.path("new")).unwrap(), b"works");
    drop(second);
    drop(first);
    assert_eq!(mount_type(&dir.path().join("mnt")), None);
}

#[test]
fn passthrough_mode_reads_local_memory() {
    let u = up(&["--cache", "passthrough"]);
    let path = u.path("pt");
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    // A chunk-aligned region held here: a read-only open reads its memory.
    let f = std::fs::File::open(&path).unwrap();
    let mut info = vec![0u8; ioctl::INFO_SIZE];
    // SAFETY: RINFO writes INFO_SIZE bytes into the buffer, which has them.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), ioctl::RINFO as _, info.as_mut_ptr()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let info = ioctl::Info::parse(&info).unwrap();
    assert_ne!(info.flags & ioctl::INFO_LOCAL, 0);
    let passthrough = info.flags & ioctl::INFO_PASSTHROUGH != 0;
    common::assert_same(&std::fs::read(&path).unwrap(), &data, "passthrough read");
    // While it is read at memory speed, writers wait (ETXTBSY after a
    // moment): the kernel wants every open of the file to pass through.
    assert_eq!(
        errno_of(std::fs::OpenOptions::new().write(true).open(&path)),
        libc::ETXTBSY
    );
    drop(f);
    let mut w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    w.write_all(b"changed").unwrap();
    drop(w);
    let mut head = [0u8; 7];
    let mut r = std::fs::File::open(&path).unwrap();
    r.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"changed");
    // An odd-sized region is not passthrough (its memory spans whole chunks).
    std::fs::write(u.path("odd"), b"odd size").unwrap();
    assert_eq!(std::fs::read(u.path("odd")).unwrap(), b"odd size");
    assert!(
        passthrough,
        "the kernel took no passthrough file: {}",
        u.proc.log()
    );
}

#[test]
fn two_hosts_share_regions() {
    let c = Cluster::start(2, "256M");
    let (a, b) = (&c.mounts[0], &c.mounts[1]);
    std::fs::write(a.path("shared"), b"from host 1").unwrap();
    assert_eq!(std::fs::read(b.path("shared")).unwrap(), b"from host 1");
    // Host 2 caches it; host 1 appends: host 2's next open sees the new size.
    sh(&format!(
        "echo ' and more' >> {}",
        a.path("shared").display()
    ));
    assert_eq!(
        std::fs::read_to_string(b.path("shared")).unwrap(),
        "from host 1 and more\n"
    );
    assert_eq!(std::fs::metadata(b.path("shared")).unwrap().len(), 21);
    // Same size, new bytes: the new mtime makes host 2 drop its cache.
    std::fs::write(a.path("shared"), b"FROM HOST 1 AND MORE\n").unwrap();
    assert_eq!(
        std::fs::read_to_string(b.path("shared")).unwrap(),
        "FROM HOST 1 AND MORE\n"
    );
    // Big data across the transport.
    let big: Vec<u8> = (0..(8u32 << 20)).map(|i| (i * 7 % 253) as u8).collect();
    std::fs::write(b.path("big"), &big).unwrap();
    common::assert_same(
        &std::fs::read(a.path("big")).unwrap(),
        &big,
        "8 MiB written on host 2, read on host 1",
    );
    // rename on one host, seen on the other
    std::fs::rename(a.path("big"), a.path("big2")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.path("big").exists() {
        assert!(Instant::now() < deadline, "rename not visible on host 2");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(std::fs::metadata(b.path("big2")).unwrap().len(), 8 << 20);
    let hosts = std::fs::read_to_string(b.path(".regions/hosts")).unwrap();
    assert_eq!(hosts.lines().count(), 3, "{hosts}");
    let _: &Proc = &c.manager;
}

/// The C program of `mmap_from_c_and_numpy`: maps a region read-write,
/// fills it, msyncs, maps it again read-only to check, and asks RINFO
/// through the checked-in header.
const C_MMAP: &str = r#"
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>
#include "regions_ioctl.h"

int main(int argc, char **argv) {
    size_t size = 4u << 20;
    int fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ftruncate(fd, size) != 0) { perror("open/ftruncate"); return 1; }
    uint8_t *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 1; }
    for (size_t i = 0; i < size; i++) p[i] = (uint8_t)(i * 13 + 1);
    if (msync(p, size, MS_SYNC) != 0) { perror("msync"); return 1; }
    munmap(p, size);
    struct regions_info info;
    if (ioctl(fd, RINFO, &info) != 0) { perror("RINFO"); return 1; }
    if (info.size != size || info.nhosts != 1) { fprintf(stderr, "RINFO size %llu\n", (unsigned long long)info.size); return 1; }
    close(fd);
    fd = open(argv[1], O_RDONLY);
    const uint8_t *q = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (q == MAP_FAILED) { perror("mmap ro"); return 1; }
    for (size_t i = 0; i < size; i++)
        if (q[i] != (uint8_t)(i * 13 + 1)) { fprintf(stderr, "byte %zu differs\n", i); return 1; }
    printf("ok\n");
    return 0;
}
"#;

#[test]
fn mmap_from_c_and_numpy() {
    let u = up(&[]);
    let src = u.dir.path().join("mmap.c");
    let prog = u.dir.path().join("mmap");
    std::fs::write(&src, C_MMAP).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../regionfs/include");
    let cc = Command::new("cc")
        .arg("-O1")
        .arg("-I")
        .arg(&include)
        .arg("-o")
        .arg(&prog)
        .arg(&src)
        .output();
    match cc {
        Ok(out) if out.status.success() => {
            let run = Command::new(&prog)
                .arg(u.path("c-mapped"))
                .output()
                .unwrap();
            assert!(
                run.status.success(),
                "C mmap failed: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            let back = std::fs::read(u.path("c-mapped")).unwrap();
            assert_eq!(back.len(), 4 << 20);
            assert!(
                back.iter()
                    .enumerate()
                    .all(|(i, b)| *b == (i * 13 + 1) as u8)
            );
        }
        Ok(out) => panic!(
            "the C test (and regions_ioctl.h) does not compile: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!(
            "cannot run cc ({e}): this test needs a C compiler (apt-get install -y gcc; \
             scripts/install-deps.sh installs everything the tests need)"
        ),
    }
    let python = python_with_numpy();
    let script = format!(
        r#"
import numpy as np
n = 1 << 20
a = np.memmap({p:?}, dtype=np.uint32, mode="w+", shape=(n,))
a[:] = np.arange(n, dtype=np.uint32) * 3
a.flush()
del a
b = np.memmap({p:?}, dtype=np.uint32, mode="r", shape=(n,))
assert (b == np.arange(n, dtype=np.uint32) * 3).all()
print("ok")
"#,
        p = u.path("np-mapped").display().to_string()
    );
    let out = Command::new(&python)
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "numpy.memmap failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn sigterm_with_a_busy_mount_detaches_and_exits() {
    let mut u = up(&[]);
    std::fs::write(u.path("f"), b"x").unwrap();
    // A process sits inside the mount (its working directory).
    let mut inside = Command::new("sleep")
        .arg("60")
        .current_dir(&u.mountpoint)
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = u.proc.sigterm();
    let _ = inside.kill();
    let _ = inside.wait();
    assert!(status.success(), "{status}: {}", u.proc.log());
    assert!(started.elapsed() < Duration::from_secs(14));
    assert_eq!(mount_type(&u.mountpoint), None, "detached, not left behind");
    assert!(
        u.proc.log().contains("detaching lazily"),
        "{}",
        u.proc.log()
    );
}
