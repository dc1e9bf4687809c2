//! Three hosts in their own network namespaces, joined to a bridge by veth pairs (the manager
//! sits on the bridge's namespace). Cutting one host's link, with no RST reaching anyone,
//! makes reads of that host's regions fail with `EIO` on the other hosts' mounts within the
//! retry bound while the other regions keep working; restoring the link brings the same
//! region back, bytes intact, since its daemon kept its memory.
//!
//! A host cut off from the manager alone (it still reaches the other hosts) past its lease is
//! fenced: a mutex it held goes to a waiter only once the daemons refuse the holder's
//! capabilities, the holder can neither write through them nor unlock, and when the host
//! comes back its daemon registers again and its mount answers `EIO` for the opens the
//! manager closed (a region deleted meanwhile included).
//!
//! Needs root, `ip` (iproute2) and `nsenter` (util-linux).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::{Receiver, channel};
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
    start_with(&[])
}

/// [`start`] with extra manager arguments.
fn start_with(manager_args: &[&str]) -> Net {
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
        manager_args,
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

/// A helper process in a host's namespace, driven line by line; killed (by pid) on drop.
struct Driven {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Driven {
    fn start(wrapper: &[std::ffi::OsString], args: &[String]) -> Driven {
        let helper = env!("CARGO_BIN_EXE_regions-sync-helper");
        let mut child = Command::new(&wrapper[0])
            .args(&wrapper[1..])
            .arg(helper)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Driven {
            child,
            stdin,
            lines,
        }
    }

    /// The next line within `timeout` (`None`: none came).
    fn line(&self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// Sends `command` and returns its answer (at most 60 s).
    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        self.line(Duration::from_secs(60))
            .unwrap_or_else(|| panic!("no answer to {command} within 60 s"))
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 100 ms until it returns `Some` (at most `within`).
fn wait_for<T>(what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            eprintln!("{what} after {:?}", start.elapsed());
            return v;
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_host_cut_from_the_manager_past_its_lease_is_fenced_and_told_what_it_lost() {
    let net = start_with(&["--lease-ms", "1500"]);
    let m = &net.mounts;
    let socket = |h: usize| net.daemons[h - 1].socket.display().to_string();
    // The mutex's lock word lives on host 1 (its first object was made there).
    let sync = regions::sync::SyncClient::connect(&net.daemons[0].socket);
    sync.mutex_init("m").unwrap();
    // `shared` on host 1; `kept` on host 3; new files of `tmp` belong to their creator.
    std::fs::write(m[0].path("shared"), [0u8; 4096]).unwrap();
    std::fs::write(m[2].path("kept"), b"kept").unwrap();
    std::fs::create_dir(m[2].path("tmp")).unwrap();
    regions_tests::set_xattr(&m[2].path("tmp"), "user.regions.persistent", b"0").unwrap();

    // On host 3: hold the mutex, write `shared` with a capability, keep `tmp/gone` (its own)
    // and `kept` open.
    let mut holder = Driven::start(
        &net.topology.host_wrapper(3),
        &[
            "fenced".into(),
            socket(3),
            "m".into(),
            m[2].path("shared").display().to_string(),
            m[2].path("tmp/gone").display().to_string(),
            m[2].path("kept").display().to_string(),
        ],
    );
    assert_eq!(
        holder.line(Duration::from_secs(60)).as_deref(),
        Some("ready")
    );
    assert_eq!(&direct_read(&m[0].path("shared"))[..8], b"holder-1");
    assert_eq!(holder.ask("read-gone"), "ok");
    // A waiter on host 1 queues behind the holder (and keeps the mutex once it has it).
    let waiter = Driven::start(
        &net.topology.host_wrapper(1),
        &["hold".into(), socket(1), "m".into()],
    );
    assert_eq!(
        waiter.line(Duration::from_millis(500)),
        None,
        "the waiter got a held mutex"
    );

    // Host 3 loses the manager, not the other hosts. Past its lease it is fenced, and only
    // then does the mutex go to the waiter.
    net.topology.cut_from_hub(3, true).unwrap();
    let cut = Instant::now();
    assert_eq!(
        waiter.line(Duration::from_secs(30)).as_deref(),
        Some("locked"),
        "the waiter never got the mutex of the partitioned holder"
    );
    eprintln!("the waiter got the mutex {:?} after the cut", cut.elapsed());
    // The holder still runs and still reaches host 1's daemon, but cannot act as holder:
    // its capability is refused and cannot be renewed, and its unlock (posted, so it answers
    // at once) frees nothing: a third party still finds the mutex taken.
    assert!(
        holder.ask("write").starts_with("err "),
        "a fenced holder wrote"
    );
    holder.ask("unlock");
    let mutex_still_taken = || {
        let prober = Driven::start(
            &net.topology.host_wrapper(2),
            &["lock-once".into(), socket(2), "m".into()],
        );
        prober.line(Duration::from_millis(1500)).is_none()
    };
    assert!(
        mutex_still_taken(),
        "the fenced holder's unlock freed the new holder's mutex"
    );
    assert_eq!(&direct_read(&m[0].path("shared"))[..8], b"holder-1");
    // Its mount, out of touch with the manager, refuses writes too.
    assert_eq!(holder.ask("write-kept"), format!("err {}", libc::EIO));
    // Its non-persistent region went with its host's lease.
    wait_for("tmp/gone deleted", Duration::from_secs(10), || {
        (!m[0].path("tmp/gone").exists()).then_some(())
    });

    // Back: the daemon registers again, the mount learns that the manager closed its opens.
    net.topology.cut_from_hub(3, false).unwrap();
    let gone = wait_for(
        "EIO from the open of a deleted region",
        Duration::from_secs(30),
        || {
            let a = holder.ask("read-gone");
            (a != "ok").then_some(a)
        },
    );
    assert_eq!(gone, format!("err {}", libc::EIO));
    assert_eq!(holder.ask("read-kept"), format!("err {}", libc::EIO));
    // Still fenced: the old opens renew nothing, and the lock is not the holder's.
    assert_eq!(holder.ask("write"), format!("err {}", libc::EIO));
    holder.ask("unlock");
    assert!(
        mutex_still_taken(),
        "the fenced holder's unlock freed the new holder's mutex"
    );
    assert_eq!(&direct_read(&m[0].path("shared"))[..8], b"holder-1");
    // New opens on host 3 work: the host is back.
    wait_for("a new open on host 3", Duration::from_secs(30), || {
        std::fs::read(m[2].path("kept"))
            .ok()
            .filter(|b| b == b"kept")
    });
    assert!(!m[2].path("tmp/gone").exists());
    std::fs::write(m[2].path("after"), b"after").unwrap();
    assert_eq!(std::fs::read(m[0].path("after")).unwrap(), b"after");
}

/// The first 4 KiB of `path` read with `O_DIRECT` (past the page cache: library writes do not
/// tell other mounts' caches).
fn direct_read(path: &Path) -> Vec<u8> {
    let out = Command::new("dd")
        .args(["status=none", "bs=4096", "count=1", "iflag=direct"])
        .arg(format!("if={}", path.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "dd: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
