//! Cache leases through two real mounts (docs/SEMANTICS.md, "Cache leases"): a mount that
//! holds leases lets its kernel keep names and attributes past the default second, asking
//! the manager nothing; a change on another host recalls them first, so it is seen at once;
//! a mount that stops answering holds changes up for at most its term; and a chmod that
//! takes search permission away is enforced at once for an unprivileged user who passed
//! through the directory before.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use regions_tests::LeaseMounts;

/// The lease term the manager is started with here.
const TERM_MS: u64 = 3000;
/// Past the default TTL of what a kernel caches without a lease.
const PAST_DEFAULT_TTL: Duration = Duration::from_millis(1500);

/// Sends `sig` (`-STOP`, `-CONT`) to process `pid`.
fn signal(sig: &str, pid: &str) {
    let status = Command::new("kill").args([sig, pid]).status().unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

fn size(path: &std::path::Path) -> std::io::Result<u64> {
    std::fs::metadata(path).map(|m| m.len())
}

#[test]
fn a_lease_keeps_names_and_attributes_cached_and_a_change_elsewhere_is_seen_at_once() {
    let t = LeaseMounts::start(TERM_MS).unwrap();
    std::fs::create_dir(t.b.path("d")).unwrap();
    std::fs::write(t.b.path("d/f"), b"one").unwrap();
    // A looks the file up (its first sight of it): the manager grants the leases.
    assert_eq!(size(&t.a.path("d/f")).unwrap(), 3);

    // Past the default TTL, the lease still keeps the entry and its attributes: the manager
    // is not asked again.
    std::thread::sleep(PAST_DEFAULT_TTL);
    let before = t.cluster.file_requests().unwrap();
    assert_eq!(size(&t.a.path("d/f")).unwrap(), 3);
    assert_eq!(
        t.cluster.file_requests().unwrap() - before,
        0,
        "a stat under a lease asked the manager"
    );

    // Another host writes: A's lease on the attributes is recalled before that write opens,
    // so A sees the new size at once (without the recall it would see 3 for the term).
    std::fs::write(t.b.path("d/f"), b"a longer content").unwrap();
    assert_eq!(size(&t.a.path("d/f")).unwrap(), 16);
    assert_eq!(std::fs::read(t.a.path("d/f")).unwrap(), b"a longer content");

    // Names: A caches d/f again, then B renames it; A sees the rename at once.
    std::thread::sleep(PAST_DEFAULT_TTL);
    assert_eq!(size(&t.a.path("d/f")).unwrap(), 16);
    std::fs::rename(t.b.path("d/f"), t.b.path("d/g")).unwrap();
    let gone = size(&t.a.path("d/f")).unwrap_err();
    assert_eq!(
        gone.raw_os_error(),
        Some(libc::ENOENT),
        "d/f after the rename"
    );
    assert_eq!(size(&t.a.path("d/g")).unwrap(), 16);

    // A truncate elsewhere (a shrink) is seen at once too.
    std::thread::sleep(PAST_DEFAULT_TTL);
    assert_eq!(size(&t.a.path("d/g")).unwrap(), 16);
    std::fs::OpenOptions::new()
        .write(true)
        .open(t.b.path("d/g"))
        .unwrap()
        .set_len(5)
        .unwrap();
    assert_eq!(size(&t.a.path("d/g")).unwrap(), 5);
    assert_eq!(std::fs::read(t.a.path("d/g")).unwrap(), b"a lon");

    // And an unlink.
    std::thread::sleep(PAST_DEFAULT_TTL);
    assert_eq!(size(&t.a.path("d/g")).unwrap(), 5);
    std::fs::remove_file(t.b.path("d/g")).unwrap();
    let gone = size(&t.a.path("d/g")).unwrap_err();
    assert_eq!(
        gone.raw_os_error(),
        Some(libc::ENOENT),
        "d/g after the unlink"
    );
    drop(t);
}

/// Runs `cat path` as nobody; returns its exit status and stderr.
fn cat_as_nobody(path: &std::path::Path) -> (bool, String) {
    let out = regions_tests::cat_as_nobody(path).unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_chmod_elsewhere_shuts_an_unprivileged_user_out_at_once() {
    let t = LeaseMounts::start(TERM_MS).unwrap();
    let dir = t.a.path("open");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.join("secret"), b"s3cret").unwrap();
    std::fs::set_permissions(dir.join("secret"), std::fs::Permissions::from_mode(0o644)).unwrap();
    // Nobody reads it (the kernel of A caches the path under the lease).
    let (ok, err) = cat_as_nobody(&dir.join("secret"));
    assert!(ok, "nobody may read it before the chmod: {err}");
    std::thread::sleep(PAST_DEFAULT_TTL);
    // Root on host 2 takes search permission away from others.
    std::fs::set_permissions(t.b.path("open"), std::fs::Permissions::from_mode(0o700)).unwrap();
    // On host 1, nobody is refused at once: the cached entry was recalled.
    let (ok, err) = cat_as_nobody(&dir.join("secret"));
    assert!(!ok, "nobody passed through a cached entry after the chmod");
    assert!(err.contains("Permission denied"), "{err}");
    drop(t);
}

#[test]
fn a_mount_that_stops_answering_holds_a_change_up_for_at_most_its_term() {
    let term_ms = 1000;
    let t = LeaseMounts::start(term_ms).unwrap();
    std::fs::create_dir(t.a.path("d")).unwrap();
    std::fs::write(t.a.path("d/f"), b"x").unwrap();
    assert_eq!(size(&t.a.path("d/f")).unwrap(), 1);
    // A stops (it cannot answer a recall, nor serve its kernel).
    let pid = t.a.pid.to_string();
    signal("-STOP", &pid);
    let started = Instant::now();
    let unlinked = std::fs::remove_file(t.b.path("d/f"));
    let waited = started.elapsed();
    signal("-CONT", &pid);
    unlinked.unwrap();
    assert!(
        waited >= Duration::from_millis(term_ms) && waited < Duration::from_millis(term_ms + 4000),
        "the unlink waited {waited:?} for a silent lease holder (term {term_ms} ms)"
    );
    // A, running again, has lost its session with everything it leased.
    let gone = size(&t.a.path("d/f")).unwrap_err();
    assert_eq!(gone.raw_os_error(), Some(libc::ENOENT));
    // It opens a new session and its changes work as before.
    std::fs::write(t.a.path("d/h"), b"again").unwrap();
    assert_eq!(std::fs::read(t.b.path("d/h")).unwrap(), b"again");
    drop(t);
}
