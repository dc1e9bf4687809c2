//! regionfs end to end: one manager, two daemons and two real FUSE mounts
//! with different host ids, so that data written on one mount crosses the
//! transport to be read on the other. Shell tools and Python do the I/O, as
//! users would.

use std::ffi::CString;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions_tests::{Cluster, MountProcess};

/// A cluster of two hosts, each with its own mount.
struct Two {
    a: MountProcess,
    b: MountProcess,
    _cluster: Cluster,
}

fn two_mounts(memory: &str) -> Two {
    let cluster = Cluster::start(2, memory).unwrap();
    let a = cluster.mount(1).unwrap();
    let b = cluster.mount(2).unwrap();
    Two {
        a,
        b,
        _cluster: cluster,
    }
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn sh(script: &str) -> String {
    String::from_utf8(run(Command::new("sh").arg("-c").arg(script)).stdout).unwrap()
}

fn errno_of(r: std::io::Result<impl Sized>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

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

fn statvfs(p: &Path) -> (u64, u64) {
    // SAFETY: statvfs fills the zeroed struct for a valid path.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(cpath(p).as_ptr(), &mut s), 0);
        (s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize)
    }
}

#[test]
fn shell_tools_across_two_mounts() {
    let t = two_mounts("512M");
    // echo / cat
    sh(&format!(
        "echo hello regions > {}",
        t.a.path("greeting").display()
    ));
    assert_eq!(
        sh(&format!("cat {}", t.b.path("greeting").display())),
        "hello regions\n"
    );
    // append
    sh(&format!(
        "echo second line >> {}",
        t.a.path("greeting").display()
    ));
    assert_eq!(
        std::fs::read_to_string(t.b.path("greeting")).unwrap(),
        "hello regions\nsecond line\n"
    );
    // dd a few MiB with odd block sizes, read back on the other host.
    sh(&format!(
        "dd if=/dev/urandom of={dir}/src bs=1000000 count=7 status=none && dd if={dir}/src of={a} bs=65537 status=none",
        dir = t._cluster.dir.path().display(),
        a = t.a.path("dd").display()
    ));
    run(Command::new("cmp")
        .arg(t._cluster.dir.path().join("src"))
        .arg(t.b.path("dd")));
    // rename over an existing file
    std::fs::write(t.a.path("old"), b"old contents").unwrap();
    std::fs::write(t.a.path("new"), b"new contents").unwrap();
    std::fs::rename(t.a.path("new"), t.a.path("old")).unwrap();
    assert_eq!(std::fs::read(t.b.path("old")).unwrap(), b"new contents");
    assert!(!t.b.path("new").exists());
    // rmdir of a non-empty directory
    std::fs::create_dir(t.a.path("dir")).unwrap();
    std::fs::write(t.a.path("dir/f"), b"x").unwrap();
    assert_eq!(
        errno_of(std::fs::remove_dir(t.b.path("dir"))),
        libc::ENOTEMPTY
    );
    std::fs::remove_file(t.b.path("dir/f")).unwrap();
    std::fs::remove_dir(t.b.path("dir")).unwrap();
    assert!(!t.a.path("dir").exists());
    // listing
    let mut names: Vec<String> = std::fs::read_dir(&t.b.mountpoint)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    assert_eq!(names, ["dd", "greeting", "old"]);
}

#[test]
fn truncate_up_and_down_reads_holes_as_zeros() {
    let t = two_mounts("256M");
    let path = t.a.path("t");
    std::fs::write(&path, vec![7u8; 300_000]).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(1000).unwrap();
    f.set_len(600_000).unwrap();
    drop(f);
    let back = std::fs::read(t.b.path("t")).unwrap();
    assert_eq!(back.len(), 600_000);
    assert!(back[..1000].iter().all(|b| *b == 7));
    assert!(
        back[1000..].iter().all(|b| *b == 0),
        "the hole reads as zeros"
    );
    // Sparse write far past the end.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(t.b.path("t"))
        .unwrap();
    f.seek(SeekFrom::Start(5 << 20)).unwrap();
    f.write_all(b"end").unwrap();
    drop(f);
    let mut f = std::fs::File::open(t.a.path("t")).unwrap();
    assert_eq!(f.metadata().unwrap().len(), (5 << 20) + 3);
    f.seek(SeekFrom::Start(4 << 20)).unwrap();
    let mut buf = vec![1u8; 1 << 20];
    f.read_exact(&mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 0));
}

#[test]
fn permissions_xattrs_onewriter_and_statfs() {
    let t = two_mounts("256M");
    // chmod 600, then a non-root user cannot read it on the other host.
    let secret = t.a.path("secret");
    std::fs::write(&secret, b"classified").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = Command::new("setpriv")
        .args([
            "--reuid",
            "1000",
            "--regid",
            "1000",
            "--clear-groups",
            "cat",
        ])
        .arg(t.b.path("secret"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("setpriv")
        .args([
            "--reuid",
            "1000",
            "--regid",
            "1000",
            "--clear-groups",
            "cat",
        ])
        .arg(t.b.path("secret"))
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"classified");

    // xattr round trip, and inheritance from a directory.
    let f = t.a.path("attrs");
    std::fs::write(&f, b"x").unwrap();
    assert_eq!(setxattr(&f, "user.note", b"hello"), 0);
    assert_eq!(getxattr(&t.b.path("attrs"), "user.note").unwrap(), b"hello");
    assert_eq!(setxattr(&f, "user.regions.persistent", b"2"), libc::EINVAL);
    std::fs::create_dir(t.a.path("defaults")).unwrap();
    assert_eq!(
        setxattr(&t.a.path("defaults"), "user.regions.onewriter", b"1"),
        0
    );
    std::fs::write(t.a.path("defaults/child"), b"").unwrap();
    assert_eq!(
        getxattr(&t.b.path("defaults/child"), "user.regions.onewriter").unwrap(),
        b"1"
    );
    assert_eq!(
        getxattr(&t.b.path("defaults/child"), "user.regions.ownerpid").map(|v| !v.is_empty()),
        Ok(true)
    );

    // ONEWRITER: a second writer on the other mount gets ETXTBSY.
    let first = std::fs::OpenOptions::new()
        .write(true)
        .open(t.a.path("defaults/child"))
        .unwrap();
    let second = std::fs::OpenOptions::new()
        .write(true)
        .open(t.b.path("defaults/child"));
    assert_eq!(errno_of(second), libc::ETXTBSY);
    drop(first);
    std::fs::OpenOptions::new()
        .write(true)
        .open(t.b.path("defaults/child"))
        .unwrap();

    // statfs numbers change with use.
    let (total, free_before) = statvfs(&t.a.mountpoint);
    assert!(total >= 500 << 20, "two daemons of 256 MiB: total {total}");
    std::fs::write(t.a.path("filler"), vec![1u8; 32 << 20]).unwrap();
    // Bounded: memory another request holds for a moment (a background close) comes back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let free_after = loop {
        let (_, free) = statvfs(&t.b.mountpoint);
        if free_before.saturating_sub(free) >= 32 << 20 {
            break free;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "free went from {free_before} to {free}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    // Small files (objects in the daemons' object stores, no pool chunk) count as well.
    std::fs::create_dir(t.a.path("smalls")).unwrap();
    for i in 0..300 {
        std::fs::write(t.a.path(&format!("smalls/{i}")), vec![2u8; 3000]).unwrap();
    }
    let (_, free_small) = statvfs(&t.b.mountpoint);
    assert!(
        free_after - free_small >= 300 * 3000,
        "300 files of 3,000 bytes took {} bytes of the free space",
        free_after - free_small
    );
}

#[test]
fn copy_one_gib_in_and_out() {
    let t = two_mounts("1536M");
    let dir = t._cluster.dir.path();
    let src = dir.join("gib.in");
    {
        let mut f = std::fs::File::create(&src).unwrap();
        let mut rng = StdRng::seed_from_u64(9);
        let mut buf = vec![0u8; 8 << 20];
        for _ in 0..128 {
            rng.fill(&mut buf[..]);
            f.write_all(&buf).unwrap();
        }
    }
    run(Command::new("cp").arg(&src).arg(t.a.path("gib")));
    run(Command::new("cp")
        .arg(t.b.path("gib"))
        .arg(dir.join("gib.out")));
    run(Command::new("cmp").arg(&src).arg(dir.join("gib.out")));
    assert_eq!(std::fs::metadata(t.b.path("gib")).unwrap().len(), 1 << 30);
}

/// Python writes through mmap on one mount and reads on the other.
fn python_mmap(writer: &Path, reader: &Path, seed: u32) {
    let script = format!(
        r#"
import mmap, os, random, sys
size = 64 << 20
rnd = random.Random({seed})
data = rnd.randbytes(size)
with open({w:?}, "w+b") as f:
    f.truncate(size)
    m = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[:] = data
    m.flush()
    m.close()
with open({r:?}, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
    back = m[:]
    m.close()
if back != data:
    first = next(i for i in range(size) if back[i] != data[i])
    sys.exit(f"mismatch at byte {{first}}")
print("ok")
"#,
        w = writer.display().to_string(),
        r = reader.display().to_string(),
    );
    let out = run(Command::new("python3").arg("-c").arg(script));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
}

#[test]
fn python_mmap_between_mounts_both_ways() {
    let t = two_mounts("512M");
    python_mmap(&t.a.path("ab"), &t.b.path("ab"), 1);
    python_mmap(&t.b.path("ba"), &t.a.path("ba"), 2);
}

/// Runs the POSIX suite on `dir`; returns its output and its FAIL and SKIP lines.
fn posix_suite(dir: &Path) -> (String, Vec<String>, Vec<String>) {
    let suite = Path::new(env!("CARGO_MANIFEST_DIR")).join("posix/conformance.py");
    let out = regions_tests::output_within(
        Command::new("python3").arg(&suite).arg(dir),
        std::time::Duration::from_secs(900),
    )
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let summary = text.lines().last().unwrap_or_default().to_owned();
    assert!(
        summary.contains("passed"),
        "no summary line from the suite on {}: {text}\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = |prefix: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .map(str::to_owned)
            .collect()
    };
    (text.clone(), lines("FAIL "), lines("SKIP "))
}

/// The POSIX suite, links, special files and permission rules included, on
/// a tmpfs and on a mount in the same run: every check passes on both, and
/// none is skipped. The hosts offer 6 GiB each so that the 4 GiB sparse
/// offset fits (pool memory is only touched where it is written).
#[test]
fn posix_conformance_suite_on_tmpfs_and_on_a_mount() {
    let t = two_mounts("6G");
    let tmpfs = tempfile::tempdir().unwrap();
    run(Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1g", "regions-posix-baseline"])
        .arg(tmpfs.path()));
    let (text, failed, skipped) = posix_suite(tmpfs.path());
    let _ = Command::new("umount").arg(tmpfs.path()).status();
    println!("tmpfs:\n{text}");
    assert!(
        failed.is_empty(),
        "POSIX checks failed on tmpfs:\n{}",
        failed.join("\n")
    );
    assert!(
        skipped.is_empty(),
        "POSIX checks skipped on tmpfs:\n{}",
        skipped.join("\n")
    );

    let dir = t.a.path("posix");
    std::fs::create_dir(&dir).unwrap();
    let (text, failed, skipped) = posix_suite(&dir);
    println!("regionfs:\n{text}");
    assert!(
        failed.is_empty(),
        "POSIX checks failed on regionfs:\n{}",
        failed.join("\n")
    );
    assert!(
        skipped.is_empty(),
        "POSIX checks skipped on regionfs:\n{}",
        skipped.join("\n")
    );
}

/// Symbolic links, hard links and special files made through one host's
/// mount are what the other host sees: the link is followed there, the
/// names share one region, a FIFO is a FIFO.
#[test]
fn links_and_special_files_made_on_one_host_are_seen_on_another() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let t = two_mounts("64M");
    std::fs::create_dir(t.a.path("d")).unwrap();
    std::fs::write(t.a.path("d/data"), b"written on host 1").unwrap();
    std::os::unix::fs::symlink("d/data", t.a.path("sym")).unwrap();
    std::os::unix::fs::symlink("d", t.a.path("dirlink")).unwrap();
    std::fs::hard_link(t.a.path("d/data"), t.a.path("twin")).unwrap();
    run(Command::new("mkfifo").arg(t.a.path("fifo")));

    assert_eq!(
        std::fs::read_link(t.b.path("sym")).unwrap(),
        Path::new("d/data")
    );
    assert_eq!(
        std::fs::read(t.b.path("sym")).unwrap(),
        b"written on host 1"
    );
    assert_eq!(
        std::fs::read(t.b.path("dirlink/data")).unwrap(),
        b"written on host 1"
    );
    let twin = std::fs::metadata(t.b.path("twin")).unwrap();
    let data = std::fs::metadata(t.b.path("d/data")).unwrap();
    assert_eq!((twin.ino(), twin.nlink()), (data.ino(), 2));
    assert!(
        std::fs::symlink_metadata(t.b.path("fifo"))
            .unwrap()
            .file_type()
            .is_fifo()
    );

    // The library resolves paths as the kernel does: links followed in the
    // middle and at the end (unless asked not to), loops refused.
    let c = regions::Client::connect(regions::ClientConfig::new(
        &t._cluster.manager_url(),
        t._cluster.secret.clone(),
        2,
    ))
    .unwrap();
    assert_eq!(c.lookup_path("sym").unwrap().ino, data.ino());
    assert_eq!(c.lookup_path("dirlink/data").unwrap().ino, data.ino());
    assert_eq!(c.lookup_path("dirlink/../twin").unwrap().ino, data.ino());
    let link = c.resolve("sym", false).unwrap();
    assert_eq!(link.kind(), regions_proto::v1::FileKind::Symlink);
    std::os::unix::fs::symlink("loop2", t.a.path("loop1")).unwrap();
    std::os::unix::fs::symlink("loop1", t.a.path("loop2")).unwrap();
    assert_eq!(c.lookup_path("loop1").unwrap_err().errno(), libc::ELOOP);
    // A target above the root leads out of the namespace; the library does not guess.
    std::os::unix::fs::symlink("../../etc/passwd", t.a.path("d/out")).unwrap();
    assert_eq!(c.lookup_path("d/out").unwrap_err().errno(), libc::EINVAL);
    // protected_symlinks: another user's link in the sticky, world-writable root is not
    // followed for root (the caller here).
    std::os::unix::fs::symlink("d/data", t.a.path("planted")).unwrap();
    std::os::unix::fs::lchown(t.a.path("planted"), Some(1000), Some(1000)).unwrap();
    assert_eq!(c.lookup_path("planted").unwrap_err().errno(), libc::EACCES);
    assert_eq!(c.resolve("planted", false).unwrap().uid, 1000);
    assert_eq!(errno_of(std::fs::read(t.b.path("loop1"))), libc::ELOOP);

    // ONEWRITER belongs to the region: a writer through one name on host 1 keeps a writer
    // through the other name on host 2 out.
    assert_eq!(
        setxattr(&t.a.path("twin"), "user.regions.onewriter", b"1"),
        0
    );
    {
        let _writer = std::fs::OpenOptions::new()
            .write(true)
            .open(t.a.path("d/data"))
            .unwrap();
        assert_eq!(
            errno_of(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(t.b.path("twin"))
            ),
            libc::ETXTBSY
        );
    }
    assert_eq!(
        setxattr(&t.a.path("twin"), "user.regions.onewriter", b"0"),
        0
    );

    // A write through a hard link on host 2 is read through the first name on host 1.
    std::fs::write(t.b.path("twin"), b"rewritten on host 2").unwrap();
    assert_eq!(
        std::fs::read(t.a.path("d/data")).unwrap(),
        b"rewritten on host 2"
    );
    // Unlinking one name on host 2 leaves the region to the other on host 1.
    std::fs::remove_file(t.b.path("d/data")).unwrap();
    assert_eq!(
        std::fs::read(t.a.path("twin")).unwrap(),
        b"rewritten on host 2"
    );
    assert_eq!(std::fs::metadata(t.a.path("twin")).unwrap().nlink(), 1);
    // The symlink now dangles on both hosts (on host 1 once its cached
    // entry for d/data expires: names follow the 1 s entry TTL).
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(errno_of(std::fs::read(t.a.path("sym"))), libc::ENOENT);
    assert_eq!(errno_of(std::fs::read(t.b.path("sym"))), libc::ENOENT);
}

/// A program finds its host agent and host id from the mount alone
/// (`user.regions.agent` / `user.regions.hostid`), from a path or an fd.
#[test]
fn mounts_tell_programs_their_host_agent() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let two = two_mounts("64M");
    let mut agent_a = regions::agent::AgentClient::for_mount(Some(&two.a.mountpoint)).unwrap();
    assert_eq!(agent_a.stats().unwrap().host_id, 1);
    assert_eq!(
        regions::agent::host_id_for(&two.b.mountpoint).unwrap(),
        2,
        "host id of mount B"
    );
    std::fs::write(two.b.path("f"), b"data").unwrap();
    let file = std::fs::File::open(two.b.path("f")).unwrap();
    let (mut agent_b, ino) = regions::agent::AgentClient::for_fd(file.as_fd()).unwrap();
    assert_eq!(ino, file.metadata().unwrap().ino());
    assert_eq!(agent_b.stats().unwrap().host_id, 2);
    assert_eq!(
        regions::agent::AgentClient::host_id_of_fd(file.as_fd()).unwrap(),
        2
    );
    // Not a regions mount: the error says where to look.
    let err = regions::agent::AgentClient::for_mount(Some(Path::new("/tmp"))).err();
    let text = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("REGIONS_MOUNT"), "{text}");
}
