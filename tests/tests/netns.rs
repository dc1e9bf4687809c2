//! Three hosts in their own network namespaces, joined to a bridge by veth pairs (the manager
//! sits on the bridge's namespace). Cutting one host's link, with no RST reaching anyone,
//! makes reads of that host's regions fail with `EIO` on the other hosts' mounts within the
//! retry bound while the other regions keep working; restoring the link brings the same
//! region back, bytes intact, since its daemon kept its memory.
//!
//! Needs root, `ip` (iproute2) and `nsenter` (util-linux).

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions_tests::netns::Topology;
use regions_tests::{DaemonProcess, ManagerProcess, MountProcess, write_secret};

/// The retry bound of regionfs (its default).
const BOUND: Duration = Duration::from_secs(5);
/// What a failing read may take beyond the bound on a shared machine.
const SLACK: Duration = Duration::from_secs(3);

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

/// Reads the first 64 KiB of `path` with `dd` (hard limit 60 s); output and time taken.
fn dd_read(path: &Path) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new("timeout")
        .args(["-s", "KILL", "60", "dd", "status=none", "bs=64k", "count=1"])
        .arg(format!("if={}", path.display()))
        .output()
        .unwrap();
    (out, start.elapsed())
}

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

/// Everything one test runs; fields drop in order: processes before the namespaces.
struct Net {
    mounts: Vec<MountProcess>,
    daemons: Vec<DaemonProcess>,
    _manager: ManagerProcess,
    topology: Topology,
    _dir: tempfile::TempDir,
}

fn start() -> Net {
    let topology = Topology::create(3).unwrap();
    let dir = tempfile::Builder::new()
        .prefix("regions-netns")
        .tempdir()
        .unwrap();
    let secret_file = dir.path().join("secret");
    write_secret(&secret_file).unwrap();
    let data = dir.path().join("manager");
    std::fs::create_dir_all(&data).unwrap();
    let manager = ManagerProcess::start_in(
        &topology.hub_wrapper(),
        &format!("{}:0", topology.hub_addr()),
        &data,
        &secret_file,
        &[],
    )
    .unwrap();
    let mut daemons = Vec::new();
    let mut mounts = Vec::new();
    for h in 1..=3 {
        let daemon = DaemonProcess::start_in(
            &topology.host_wrapper(h),
            &format!("{}:0", topology.addr(h)),
            manager.addr,
            &secret_file,
            h,
            "64M",
            dir.path(),
        )
        .unwrap();
        mounts.push(
            MountProcess::start_in(
                &topology.host_wrapper(h),
                manager.addr,
                &secret_file,
                h,
                &daemon.socket,
                &dir.path().join(format!("mnt{h}")),
            )
            .unwrap(),
        );
        daemons.push(daemon);
    }
    Net {
        mounts,
        daemons,
        _manager: manager,
        topology,
        _dir: dir,
    }
}

#[test]
fn a_cut_link_gives_bounded_eio_and_recovers_when_restored() {
    let net = start();
    let m = &net.mounts;
    assert!(
        net.daemons[2].addr.starts_with(&net.topology.addr(3)),
        "daemon 3 serves on {}",
        net.daemons[2].addr
    );
    // `far` lives on host 3 (its creator's host); `near` on host 1.
    let far = random_bytes(1 << 20, 81);
    let near = random_bytes(1 << 20, 82);
    std::fs::write(m[2].path("far"), &far).unwrap();
    std::fs::write(m[0].path("near"), &near).unwrap();
    // Host 2 reads host 1's region across the bridge.
    assert_eq!(std::fs::read(m[1].path("near")).unwrap(), near);

    net.topology.set_link(3, false).unwrap();
    std::thread::scope(|s| {
        // Nothing of `far` is cached on hosts 1 and 2: they never read it.
        let r1 = s.spawn(|| dd_read(&m[0].path("far")));
        let r2 = s.spawn(|| dd_read(&m[1].path("far")));
        // Meanwhile hosts 1 and 2 keep working with each other.
        let fresh = random_bytes(500_000, 83);
        std::fs::write(m[1].path("fresh"), &fresh).unwrap();
        assert_eq!(std::fs::read(m[0].path("fresh")).unwrap(), fresh);
        assert_eq!(std::fs::read(m[1].path("near")).unwrap(), near);
        assert_eio(
            "host 1 reading host 3's region over a cut link",
            &r1.join().unwrap(),
        );
        assert_eio(
            "host 2 reading host 3's region over a cut link",
            &r2.join().unwrap(),
        );
    });

    net.topology.set_link(3, true).unwrap();
    let start = Instant::now();
    for mount in &m[..2] {
        loop {
            match std::fs::read(mount.path("far")) {
                Ok(bytes) => {
                    assert_eq!(bytes, far, "host {} read other bytes", mount.host_id);
                    break;
                }
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
                    assert!(
                        start.elapsed() < Duration::from_secs(30),
                        "host {} still cannot read host 3's region 30 s after the link came back: {e}",
                        mount.host_id
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
    eprintln!("recovered {:?} after the link came back", start.elapsed());
    // Host 3 writes again, and the others see it.
    let newer = random_bytes(200_000, 84);
    std::fs::write(m[2].path("after"), &newer).unwrap();
    assert_eq!(std::fs::read(m[0].path("after")).unwrap(), newer);
}
