//! Host failure across three host ids (docs/SEMANTICS.md, "Host failure"): a daemon SIGKILLed
//! makes reads and writes of the regions it held fail with `EIO` on the other hosts' mounts
//! within the retry bound, while regions held elsewhere keep working; the daemon restarted
//! with the same host id has lost its memory, so the manager marks those regions lost: `EIO`
//! (never zeros) until they are unlinked, and new regions work.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions::transport::tcp::RetryPolicy;
use regions::{Client, ClientConfig};
use regions_tests::{Cluster, DaemonProcess};

/// The retry bound of regionfs and libregions (their default).
const BOUND: Duration = Duration::from_secs(5);
/// What a failing read may take beyond the bound: a FUSE read can be retried once by the
/// kernel (readahead, then the page itself), and the machine is shared.
const SLACK: Duration = Duration::from_secs(3);

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

fn client(cluster: &Cluster, host: u32) -> Client {
    let mut config = ClientConfig::new(&cluster.manager_url(), cluster.secret.clone(), host);
    config.retry = RetryPolicy::default();
    Client::connect(config).unwrap()
}

fn hosts_of(c: &Client, path: &str) -> String {
    let ino = c.lookup_path(path).unwrap().ino;
    String::from_utf8(
        c.manager()
            .getxattr(c.caller(), ino, "user.regions.hosts")
            .unwrap(),
    )
    .unwrap()
}

/// Runs `dd` with `args` under a hard 60 s limit; its output and how long it took.
fn dd(args: &[String]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new("timeout")
        .args(["-s", "KILL", "60", "dd", "status=none"])
        .args(args)
        .output()
        .unwrap();
    (out, start.elapsed())
}

fn read_cmd(path: &Path) -> Vec<String> {
    vec![
        format!("if={}", path.display()),
        "of=/dev/null".into(),
        "bs=64k".into(),
        "count=1".into(),
    ]
}

fn write_cmd(path: &Path) -> Vec<String> {
    vec![
        "if=/dev/zero".into(),
        format!("of={}", path.display()),
        "bs=4k".into(),
        "count=1".into(),
        // Away from the bytes the reads ask for: the page this write dirties is cached.
        "seek=128".into(),
        "conv=notrunc,fsync".into(),
    ]
}

/// Asserts that `dd` failed with EIO within the bound.
fn assert_eio(what: &str, (out, took): &(Output, Duration)) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("Input/output error"),
        "{what}: expected EIO, got {} after {took:?}: {stderr}",
        out.status
    );
    assert!(
        *took < BOUND + SLACK,
        "{what}: EIO only after {took:?} (bound {BOUND:?})"
    );
    eprintln!("{what}: EIO after {took:?}");
}

fn restart(cluster: &mut Cluster, host: u32) {
    let daemon = DaemonProcess::start(
        cluster.manager.addr,
        &cluster.secret_file,
        host,
        "64M",
        cluster.dir.path(),
    )
    .unwrap();
    let slot = cluster
        .daemons
        .iter_mut()
        .find(|d| d.host_id == host)
        .unwrap();
    *slot = daemon;
}

#[test]
fn a_dead_daemon_gives_bounded_eio_and_its_restart_loses_its_regions() {
    let mut cluster = Cluster::start(3, "64M").unwrap();
    let mounts: Vec<_> = (1..=3).map(|h| cluster.mount(h).unwrap()).collect();
    let c = client(&cluster, 2);
    // `doomed` lives on host 3 (its creator's host), `fine` on host 1.
    let doomed_data = random_bytes(1 << 20, 71);
    let fine_data = random_bytes(1 << 20, 72);
    std::fs::write(mounts[2].path("doomed"), &doomed_data).unwrap();
    std::fs::write(mounts[0].path("fine"), &fine_data).unwrap();
    assert_eq!(hosts_of(&c, "doomed"), "3");
    assert_eq!(hosts_of(&c, "fine"), "1");
    // A libregions client that has the region open and its map cached.
    let doomed_ino = c.lookup_path("doomed").unwrap().ino;
    let open_before = c.open(doomed_ino, false).unwrap();
    let mut got = vec![0u8; 4096];
    open_before.read_at(0, &mut got).unwrap();
    assert_eq!(got, doomed_data[..4096]);

    cluster
        .daemons
        .iter_mut()
        .find(|d| d.host_id == 3)
        .unwrap()
        .sigkill()
        .unwrap();

    // Reads on the other hosts' mounts (none has read it before, so nothing is cached) and a
    // synced write fail with EIO within the bound, concurrently.
    let doomed = |i: usize| mounts[i].path("doomed");
    std::thread::scope(|s| {
        let r1 = s.spawn(|| dd(&read_cmd(&doomed(0))));
        let r2 = s.spawn(|| dd(&read_cmd(&doomed(1))));
        let w1 = s.spawn(|| dd(&write_cmd(&doomed(0))));
        // Meanwhile regions held elsewhere keep working, on every mount.
        for m in &mounts {
            assert_eq!(std::fs::read(m.path("fine")).unwrap(), fine_data);
        }
        let fresh = random_bytes(300_000, 73);
        std::fs::write(mounts[1].path("fresh"), &fresh).unwrap();
        assert_eq!(std::fs::read(mounts[0].path("fresh")).unwrap(), fresh);
        assert_eio("read on host 1's mount", &r1.join().unwrap());
        assert_eio("read on host 2's mount", &r2.join().unwrap());
        assert_eio("synced write on host 1's mount", &w1.join().unwrap());
    });
    // The open libregions handle too.
    let t = Instant::now();
    let err = open_before.read_at(0, &mut got).unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(t.elapsed() < BOUND + SLACK, "{:?}", t.elapsed());

    // The daemon comes back with the same host id and none of its memory.
    restart(&mut cluster, 3);
    let err = c.open(doomed_ino, false).expect_err("a lost region opened");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(err.to_string().contains("lost"), "{err}");
    for m in &mounts {
        let e = std::fs::read(m.path("doomed")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{}: {e}", m.host_id);
        // Still listed, so that it can be found and removed.
        assert!(m.path("doomed").exists());
    }
    // A handle opened before the loss never reads zeros as data.
    let t = Instant::now();
    let err = open_before.read_at(0, &mut got).unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(t.elapsed() < BOUND + SLACK, "{:?}", t.elapsed());
    drop(open_before);
    // Unlinking works, and new regions on host 3 work.
    std::fs::remove_file(mounts[0].path("doomed")).unwrap();
    assert_eq!(c.lookup_path("doomed").unwrap_err().errno(), libc::ENOENT);
    let again = random_bytes(1 << 20, 74);
    std::fs::write(mounts[2].path("reborn"), &again).unwrap();
    assert_eq!(hosts_of(&c, "reborn"), "3");
    assert_eq!(std::fs::read(mounts[1].path("reborn")).unwrap(), again);
    assert_eq!(std::fs::read(mounts[1].path("fine")).unwrap(), fine_data);
}
