//! Leased opens through real mounts (docs/SEMANTICS.md, "Cache leases"): a mount that holds
//! a lease on a region's attributes opens it for reading again without asking the manager,
//! and still sees another host's write at once; an open made that way keeps reading a
//! region whose last name goes, here or elsewhere; and the permission check it makes
//! itself refuses what the manager would.

use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use regions_tests::{Cluster, LeaseMounts};

/// The lease term the manager is started with here (long enough for a slow machine to
/// read several times within one).
const TERM_MS: u64 = 8000;
/// Bytes of the regions read through their memory (several chunks, on purpose).
const LEN: usize = 3 << 17;

fn open_handles(cluster: &Cluster) -> u64 {
    cluster.stats().unwrap().open_handles
}

/// Bytes that differ at every offset of a chunk and between `seed`s.
fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

/// Opens `path` read-only with `O_DIRECT`: its reads reach the region's memory, not the
/// page cache.
fn open_direct(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap()
}

/// Reads all of `f` (`LEN` bytes) through a page-aligned buffer.
fn read_direct(f: &std::fs::File) -> std::io::Result<Vec<u8>> {
    let mut raw = vec![0u8; LEN + 4096];
    let skew = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[skew..skew + LEN];
    let mut done = 0;
    while done < LEN {
        let n = f.read_at(&mut buf[done..], done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(buf[..done].to_vec())
}

/// Reads `path` with open, read and close only, as `cat` would without its fstat (after a
/// close in writeback mode the kernel asks for attributes again at the next fstat).
fn read_plain(path: &Path) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

/// Waits (10 s at most) until the manager holds `want` open handles.
fn wait_open_handles(cluster: &Cluster, want: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = open_handles(cluster);
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the manager holds {now} open handles, not {want}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn reading_again_under_a_lease_asks_the_manager_nothing_and_sees_a_write_elsewhere() {
    let t = LeaseMounts::start(TERM_MS).unwrap();
    std::fs::create_dir(t.a.path("d")).unwrap();
    let first = pattern(1);
    std::fs::write(t.a.path("d/f"), &first).unwrap();
    // The kernel releases a closed file after close(2) returns: once the writer's handle
    // is closed at the manager, its release kept the placement.
    wait_open_handles(&t.cluster, 0, "after the write");
    // A wrote it: reading it back, again and again, asks the manager nothing.
    let before = t.cluster.file_requests().unwrap();
    for _ in 0..10 {
        assert!(read_plain(&t.a.path("d/f")) == first);
    }
    assert_eq!(
        t.cluster.file_requests().unwrap() - before,
        0,
        "opens of a file this mount wrote, under its lease, asked the manager"
    );
    // B opens it at the manager once, then under its own lease (through the region's
    // memory on host 1: O_DIRECT).
    assert!(read_direct(&open_direct(&t.b.path("d/f"))).unwrap() == first);
    wait_open_handles(&t.cluster, 0, "after B's first open");
    let before = t.cluster.file_requests().unwrap();
    for _ in 0..10 {
        assert!(read_direct(&open_direct(&t.b.path("d/f"))).unwrap() == first);
    }
    assert_eq!(
        t.cluster.file_requests().unwrap() - before,
        0,
        "opens on another host, under its lease, asked the manager"
    );
    assert_eq!(
        open_handles(&t.cluster),
        0,
        "leased opens hold handles at the manager"
    );

    // A writes new bytes (same size): B's lease is recalled before A's write opens, so B's
    // next open sees them at once, through the page cache or not.
    let second = pattern(2);
    std::fs::write(t.a.path("d/f"), &second).unwrap();
    assert!(read_direct(&open_direct(&t.b.path("d/f"))).unwrap() == second);
    assert!(std::fs::read(t.b.path("d/f")).unwrap() == second);
    // And B's write is seen by A.
    let third = pattern(3);
    std::fs::write(t.b.path("d/f"), &third).unwrap();
    assert!(std::fs::read(t.a.path("d/f")).unwrap() == third);
    assert!(read_direct(&open_direct(&t.a.path("d/f"))).unwrap() == third);
    // A shrink elsewhere too.
    std::fs::OpenOptions::new()
        .write(true)
        .open(t.a.path("d/f"))
        .unwrap()
        .set_len(100)
        .unwrap();
    assert!(std::fs::read(t.b.path("d/f")).unwrap() == third[..100]);
    drop(t);
}

#[test]
fn a_leased_open_keeps_reading_a_region_whose_last_name_goes() {
    let t = LeaseMounts::start(TERM_MS).unwrap();
    let data = pattern(7);
    // Removed elsewhere: B created it (its memory is on host 2), A opens it under a lease.
    std::fs::write(t.b.path("elsewhere"), &data).unwrap();
    // (No lease while B's writer is open: its release closes it a moment after close(2).)
    wait_open_handles(&t.cluster, 0, "after B's write");
    assert!(read_direct(&open_direct(&t.a.path("elsewhere"))).unwrap() == data);
    wait_open_handles(&t.cluster, 0, "after A's first open");
    let before = t.cluster.file_requests().unwrap();
    let f = open_direct(&t.a.path("elsewhere"));
    assert_eq!(
        t.cluster.file_requests().unwrap() - before,
        0,
        "the second open was not leased"
    );
    std::fs::remove_file(t.b.path("elsewhere")).unwrap();
    // The recall made A's open take a handle before the unlink went ahead, so the memory
    // stays until A closes it, whatever is written meanwhile.
    assert_eq!(open_handles(&t.cluster), 1);
    for i in 0..4 {
        let mut other = std::fs::File::create(t.b.path(&format!("filler{i}"))).unwrap();
        other.write_all(&pattern(100 + i)).unwrap();
    }
    assert!(read_direct(&f).unwrap() == data);
    drop(f);
    wait_open_handles(
        &t.cluster,
        0,
        "after the leased open of a removed region closed",
    );

    // Removed here: A created it, reads it under a lease and unlinks it itself.
    std::fs::write(t.a.path("here"), &data).unwrap();
    wait_open_handles(&t.cluster, 0, "after A's write");
    let f = open_direct(&t.a.path("here"));
    assert_eq!(open_handles(&t.cluster), 0, "the open was not leased");
    std::fs::remove_file(t.a.path("here")).unwrap();
    assert_eq!(open_handles(&t.cluster), 1);
    for i in 0..4 {
        std::fs::write(t.a.path(&format!("more{i}")), pattern(110 + i)).unwrap();
    }
    assert!(read_direct(&f).unwrap() == data);
    drop(f);
    wait_open_handles(
        &t.cluster,
        0,
        "after the leased open of a region removed here",
    );
    drop(t);
}

#[test]
fn stat_after_close_is_answered_under_the_lease_and_sees_every_change() {
    use std::os::unix::fs::MetadataExt;
    let t = LeaseMounts::start(TERM_MS).unwrap();
    std::fs::write(t.a.path("s"), b"0123456789").unwrap();
    wait_open_handles(&t.cluster, 0, "after the write");
    // A read and a stat, as cat does: after the close the kernel asks for the attributes
    // again at the next stat, which the mount answers under its lease from the second on.
    assert_eq!(std::fs::read(t.a.path("s")).unwrap(), b"0123456789");
    let before = t.cluster.file_requests().unwrap();
    for _ in 0..10 {
        assert_eq!(std::fs::read(t.a.path("s")).unwrap(), b"0123456789");
        assert_eq!(std::fs::metadata(t.a.path("s")).unwrap().len(), 10);
    }
    assert!(
        t.cluster.file_requests().unwrap() - before <= 1,
        "reads and stats under a lease asked the manager {} times",
        t.cluster.file_requests().unwrap() - before
    );
    // This mount's own changes show at once: mode, links, times.
    std::fs::set_permissions(t.a.path("s"), std::fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(std::fs::read(t.a.path("s")).unwrap(), b"0123456789");
    assert_eq!(
        std::fs::metadata(t.a.path("s")).unwrap().mode() & 0o777,
        0o640
    );
    std::fs::hard_link(t.a.path("s"), t.a.path("s2")).unwrap();
    assert_eq!(std::fs::read(t.a.path("s")).unwrap(), b"0123456789");
    assert_eq!(std::fs::metadata(t.a.path("s")).unwrap().nlink(), 2);
    std::fs::remove_file(t.a.path("s2")).unwrap();
    assert_eq!(std::fs::read(t.a.path("s")).unwrap(), b"0123456789");
    assert_eq!(std::fs::metadata(t.a.path("s")).unwrap().nlink(), 1);
    // And another host's.
    std::fs::set_permissions(t.b.path("s"), std::fs::Permissions::from_mode(0o604)).unwrap();
    assert_eq!(
        std::fs::metadata(t.a.path("s")).unwrap().mode() & 0o777,
        0o604
    );
    std::fs::write(t.b.path("s"), b"longer, from host 2").unwrap();
    assert_eq!(std::fs::metadata(t.a.path("s")).unwrap().len(), 19);
    assert_eq!(
        std::fs::read(t.a.path("s")).unwrap(),
        b"longer, from host 2"
    );
    drop(t);
}

#[test]
fn a_leased_open_reads_on_across_a_manager_restart_and_an_unlink_after_it() {
    let mut t = LeaseMounts::start(TERM_MS).unwrap();
    let data = pattern(5);
    std::fs::write(t.b.path("kept"), &data).unwrap();
    wait_open_handles(&t.cluster, 0, "after B's write");
    assert!(read_direct(&open_direct(&t.a.path("kept"))).unwrap() == data);
    wait_open_handles(&t.cluster, 0, "after A's first open");
    let f = open_direct(&t.a.path("kept"));
    assert_eq!(open_handles(&t.cluster), 0, "the open was not leased");

    // The manager dies and comes back on its address. A's session ends while the manager
    // is out of reach: its leased open cannot take a handle then, and is not fenced for
    // that (it reads on); it takes one when a new session begins, or at the next recall.
    let addr = t.cluster.manager.addr.to_string();
    t.cluster.manager.sigkill().unwrap();
    let data_dir = t.cluster.dir.path().join("manager");
    let term = TERM_MS.to_string();
    t.cluster.manager = regions_tests::ManagerProcess::start_in(
        &[],
        &addr,
        &data_dir,
        &t.cluster.secret_file,
        &["--cache-lease-term-ms", term.as_str()],
    )
    .unwrap();
    assert!(read_direct(&f).unwrap() == data, "a read after the restart");

    // B removes the file (once the restarted manager has waited out the old leases) and
    // writes others: A's open still reads what it opened.
    std::fs::remove_file(t.b.path("kept")).unwrap();
    for i in 0..4 {
        std::fs::write(t.b.path(&format!("after{i}")), pattern(120 + i)).unwrap();
    }
    assert!(read_direct(&f).unwrap() == data, "a read after the unlink");
    drop(f);
    drop(t);
}

#[test]
fn the_last_of_two_writers_leaves_no_placement_it_did_not_see_grow() {
    let t = LeaseMounts::start(TERM_MS).unwrap();
    std::fs::write(t.a.path("w"), b"").unwrap();
    // Two write handles of one mount; only the first writes (O_DIRECT: through its own
    // handle, not the page cache) and closes first: the second, released last, never saw
    // the region grow.
    let data = pattern(9);
    let mut first = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(t.a.path("w"))
        .unwrap();
    let second = std::fs::OpenOptions::new()
        .write(true)
        .open(t.a.path("w"))
        .unwrap();
    let mut raw = vec![0u8; LEN + 4096];
    let skew = raw.as_ptr().align_offset(4096);
    raw[skew..skew + LEN].copy_from_slice(&data);
    first.write_all(&raw[skew..skew + LEN]).unwrap();
    drop(first);
    drop(second);
    wait_open_handles(&t.cluster, 0, "after both writers");
    // Read through the region (O_DIRECT), by whatever this mount kept: the whole of it.
    for _ in 0..3 {
        assert!(read_direct(&open_direct(&t.a.path("w"))).unwrap() == data);
    }
    drop(t);
}

/// Runs `cat path` as nobody; returns whether it succeeded, and its stdout.
fn cat_as_nobody(path: &Path) -> (bool, Vec<u8>) {
    let out = regions_tests::cat_as_nobody(path).unwrap();
    (out.status.success(), out.stdout)
}

#[test]
fn a_leased_open_refuses_what_the_manager_would() {
    let t = LeaseMounts::start(TERM_MS).unwrap();
    let dir = t.a.path("open");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Root writes a file only root may read, and reads it (a lease and a placement): nobody
    // on the same mount is refused all the same.
    std::fs::write(dir.join("private"), b"root only").unwrap();
    std::fs::set_permissions(dir.join("private"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(std::fs::read(dir.join("private")).unwrap(), b"root only");
    assert_eq!(std::fs::read(dir.join("private")).unwrap(), b"root only");
    let (ok, out) = cat_as_nobody(&dir.join("private"));
    assert!(!ok && out.is_empty(), "nobody read a 0600 file of root's");

    // A file everyone may read: nobody reads it (twice: the second under the lease); root
    // on host 2 takes read permission away; nobody's next open on host 1 is refused.
    std::fs::write(dir.join("public"), b"for now").unwrap();
    std::fs::set_permissions(dir.join("public"), std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        cat_as_nobody(&dir.join("public")),
        (true, b"for now".to_vec())
    );
    assert_eq!(
        cat_as_nobody(&dir.join("public")),
        (true, b"for now".to_vec())
    );
    std::fs::set_permissions(
        t.b.path("open/public"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let (ok, out) = cat_as_nobody(&dir.join("public"));
    assert!(
        !ok && out.is_empty(),
        "nobody read a file after its chmod 600 elsewhere"
    );
    // And a chmod on this very mount.
    std::fs::set_permissions(dir.join("public"), std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        cat_as_nobody(&dir.join("public")),
        (true, b"for now".to_vec())
    );
    std::fs::set_permissions(dir.join("public"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let (ok, _) = cat_as_nobody(&dir.join("public"));
    assert!(
        !ok,
        "nobody read a file after its chmod 600 on the same mount"
    );
    drop(t);
}
