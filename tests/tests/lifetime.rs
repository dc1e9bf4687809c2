//! Region lifetime across three host ids (docs/SEMANTICS.md, "Lifetime"; Remote Regions paper
//! §5.1, §5.5):
//!
//! - a process that creates regions through a mount, or through its host agent, owns them:
//!   when it exits, its non-persistent regions are deleted cluster-wide within 1 s, and its
//!   persistent ones stay byte for byte;
//! - when a host's lease expires at the manager (its daemon was SIGKILLed), the
//!   non-persistent regions of that host's owners are deleted, even though the owner
//!   processes still run; other hosts' regions and persistent ones stay.
//!
//! Owner processes are real children: Python for the mount, and `regions-owner-helper`
//! (tests/src/bin/owner_helper.rs) for the host agent.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions::{Client, ClientConfig};
use regions_proto::v1;
use regions_tests::Cluster;

/// How long a deletion after an owner's exit may take (the requirement).
const OWNER_BOUND: Duration = Duration::from_secs(1);

/// Bound on everything else a test waits for.
const WAIT: Duration = Duration::from_secs(20);

fn client(cluster: &Cluster, host: u32) -> Client {
    Client::connect(ClientConfig::new(
        &cluster.manager_url(),
        cluster.secret.clone(),
        host,
    ))
    .unwrap()
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

/// Whether `path` (relative to the root) names something at the manager.
fn exists(c: &Client, path: &str) -> bool {
    match c.lookup_path(path) {
        Ok(_) => true,
        Err(e) if e.errno() == libc::ENOENT => false,
        Err(e) => panic!("lookup of {path} failed: {e}"),
    }
}

/// Polls until `path` is gone at the manager; how long that took (panics after [`WAIT`]).
fn wait_gone(c: &Client, path: &str) -> Duration {
    let start = Instant::now();
    while exists(c, path) {
        assert!(start.elapsed() < WAIT, "{path} still exists {WAIT:?} later");
        std::thread::sleep(Duration::from_millis(5));
    }
    start.elapsed()
}

/// An owner process: stays alive until [`Owner::exit`] closes its stdin.
struct Owner {
    child: Child,
    stdin: Option<ChildStdin>,
    /// Lines it printed before it was ready.
    lines: Vec<String>,
}

impl Owner {
    /// Starts `cmd` with piped stdin/stdout and waits (bounded) for a line `ready`.
    fn start(mut cmd: Command) -> Owner {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let pid = child.id();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Reads to the end, so the owner never writes into a closed pipe.
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut owner = Owner {
            child,
            stdin,
            lines: Vec::new(),
        };
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line == "ready" => return owner,
                Ok(line) => owner.lines.push(line),
                Err(_) => {
                    let _ = owner.child.kill();
                    panic!(
                        "owner process {pid} did not get ready; it said {:?}",
                        owner.lines
                    );
                }
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Closes its stdin, so it exits; waits for the exit (bounded).
    fn exit(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "owner exited with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "owner did not exit");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A Python owner that creates `owned` (whatever its directory's default) and copies `src`
/// to `kept`, through a mount.
fn python_owner(owned: &Path, kept: &Path, src: &Path) -> Owner {
    let script = r#"
import sys, shutil
owned, kept, src = sys.argv[1:4]
with open(owned, "wb") as f:
    f.write(b"owned by a process " * 1000)
shutil.copyfile(src, kept)
print("ready", flush=True)
sys.stdin.read()
"#;
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(script).arg(owned).arg(kept).arg(src);
    Owner::start(cmd)
}

/// A `regions-owner-helper` process creating `regions` (name, persistent) through the agent
/// at `socket`.
fn agent_owner(socket: &Path, regions: &[(&str, bool)]) -> Owner {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_regions-owner-helper"));
    cmd.arg(socket);
    for (name, persistent) in regions {
        cmd.arg(format!("{name}={}", u8::from(*persistent)));
    }
    Owner::start(cmd)
}

fn owner_pid_of(c: &Client, path: &str) -> u32 {
    let attr = c.lookup_path(path).unwrap();
    let raw = c
        .manager()
        .getxattr(c.caller(), attr.ino, "user.regions.ownerpid")
        .unwrap();
    String::from_utf8(raw).unwrap().parse().unwrap()
}

#[test]
fn owner_exit_deletes_its_non_persistent_region_through_a_mount() {
    let cluster = Cluster::start(3, "64M").unwrap();
    let mounts: Vec<_> = (1..=3).map(|h| cluster.mount(h).unwrap()).collect();
    let c = client(&cluster, 1);
    // Owner-bound regions go in a directory whose default is persistent=0; the root keeps
    // persistent=1.
    let dir = c.mkdir_path("owned", 0o777).unwrap();
    c.manager()
        .setxattr(c.caller(), dir.ino, "user.regions.persistent", b"0", 0)
        .unwrap();
    let data = random_bytes(3 << 20, 61);
    let src = cluster.dir.path().join("kept.src");
    std::fs::write(&src, &data).unwrap();

    let mut owner = python_owner(&mounts[1].path("owned/a"), &mounts[1].path("kept"), &src);
    assert_eq!(owner_pid_of(&c, "owned/a"), owner.pid());
    assert_eq!(owner_pid_of(&c, "kept"), owner.pid());
    // Visible on the other hosts while the owner lives.
    assert!(mounts[2].path("owned/a").exists());
    std::thread::sleep(Duration::from_millis(300));
    assert!(exists(&c, "owned/a"), "deleted while its owner lives");

    owner.exit();
    let took = wait_gone(&c, "owned/a");
    eprintln!("mount owner: region deleted {took:?} after the owner's exit");
    assert!(took < OWNER_BOUND, "deleted only {took:?} after the exit");
    // The other mounts see it gone (their entry caches last at most 1 s).
    let start = Instant::now();
    while mounts[0].path("owned/a").exists() || mounts[2].path("owned/a").exists() {
        assert!(start.elapsed() < WAIT, "another mount still shows owned/a");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The persistent one stays, byte for byte, on every host.
    for m in &mounts {
        assert_eq!(std::fs::read(m.path("kept")).unwrap(), data);
    }
    assert!(exists(&c, "owned"), "the directory itself stays");
}

/// OWNERPID follows the region, not a name: an owner that gives its region a
/// second name and removes the first still takes the region with it when it
/// exits, and a region with two names loses both.
#[test]
fn owner_exit_deletes_every_name_of_its_hard_linked_regions() {
    let cluster = Cluster::start(1, "64M").unwrap();
    let mount = cluster.mount(1).unwrap();
    let c = client(&cluster, 1);
    let dir = c.mkdir_path("owned", 0o777).unwrap();
    c.manager()
        .setxattr(c.caller(), dir.ino, "user.regions.persistent", b"0", 0)
        .unwrap();
    // Two owners, so that the second's only way out is its own watch: one that gives its
    // regions second names, and one whose new region at a reused name is removed while its old
    // region lives on under another name (removing the new one must not end the old one's
    // watch).
    let script = r#"
import os, sys
d, mode = sys.argv[1:3]
def make(name):
    with open(os.path.join(d, name), "wb") as f:
        f.write(b"owned " * 100)
if mode == "links":
    make("moved"); make("twice")
    os.link(os.path.join(d, "moved"), os.path.join(d, "moved2"))
    os.unlink(os.path.join(d, "moved"))
    os.link(os.path.join(d, "twice"), os.path.join(d, "twice2"))
else:
    make("x"); make("keep")
    os.link(os.path.join(d, "x"), os.path.join(d, "y"))
    os.unlink(os.path.join(d, "x"))
    make("x")
    os.unlink(os.path.join(d, "x"))
print("ready", flush=True)
sys.stdin.read()
"#;
    for (mode, names) in [
        (
            "links",
            &["owned/moved2", "owned/twice", "owned/twice2"][..],
        ),
        ("reuse", &["owned/y", "owned/keep"][..]),
    ] {
        let mut cmd = Command::new("python3");
        cmd.arg("-c").arg(script).arg(mount.path("owned")).arg(mode);
        let mut owner = Owner::start(cmd);
        for name in names {
            assert_eq!(owner_pid_of(&c, name), owner.pid(), "{name}");
        }
        std::thread::sleep(Duration::from_millis(300));
        assert!(exists(&c, names[0]), "deleted while its owner lives");
        owner.exit();
        for name in names {
            let took = wait_gone(&c, name);
            assert!(
                took < OWNER_BOUND,
                "{name} deleted only {took:?} after the exit"
            );
        }
    }
}

#[test]
fn owner_exit_deletes_its_non_persistent_region_through_the_agent() {
    let cluster = Cluster::start(3, "64M").unwrap();
    let reader = cluster.mount(3).unwrap();
    let c = client(&cluster, 1);
    let socket = cluster.daemon(2).unwrap().socket.clone();
    let mut owner = agent_owner(&socket, &[("temp", false), ("kept", true)]);
    let created = owner
        .lines
        .iter()
        .filter(|l| l.contains("created "))
        .count();
    assert_eq!(created, 2, "{:?}", owner.lines);
    assert_eq!(owner_pid_of(&c, "temp"), owner.pid());
    assert_eq!(owner_pid_of(&c, "kept"), owner.pid());
    let kept = c.lookup_path("kept").unwrap();
    let temp = c.lookup_path("temp").unwrap();
    assert_eq!((kept.owner_host, temp.owner_host), (2, 2));
    // Someone else fills the persistent region (1 MiB, preallocated on host 2).
    let data = random_bytes(1 << 20, 62);
    c.open(kept.ino, true).unwrap().write_at(0, &data).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(exists(&c, "temp"), "deleted while its owner lives");

    owner.exit();
    let took = wait_gone(&c, "temp");
    eprintln!("agent owner: region deleted {took:?} after the owner's exit");
    assert!(took < OWNER_BOUND, "deleted only {took:?} after the exit");
    assert_eq!(std::fs::read(reader.path("kept")).unwrap(), data);
    let mut got = vec![0u8; data.len()];
    c.open(kept.ino, false)
        .unwrap()
        .read_at(0, &mut got)
        .unwrap();
    assert_eq!(got, data);
}

#[test]
fn an_expired_lease_deletes_the_owners_regions_of_that_host() {
    let mut cluster = Cluster::start_with(3, "64M", &["--lease-ms", "1000"]).unwrap();
    let c = client(&cluster, 1);
    let on3 = agent_owner(
        &cluster.daemon(3).unwrap().socket,
        &[("h3-temp", false), ("h3-kept", true)],
    );
    let on1 = agent_owner(&cluster.daemon(1).unwrap().socket, &[("h1-temp", false)]);
    // A region owned by host 2 whose data lives on host 3 stays: it is host 2's.
    let o = v1::RegionAttrOverrides {
        persistent: Some(false),
        hostalloc: Some("3".into()),
        ..Default::default()
    };
    client(&cluster, 2)
        .create_path("h2-temp-on3", 0o644, Some(o), 1 << 20)
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    for p in ["h3-temp", "h3-kept", "h1-temp", "h2-temp-on3"] {
        assert!(exists(&c, p), "{p} vanished while every host is live");
    }

    cluster
        .daemons
        .iter_mut()
        .find(|d| d.host_id == 3)
        .unwrap()
        .sigkill()
        .unwrap();
    let took = wait_gone(&c, "h3-temp");
    eprintln!("host 3's owner's region deleted {took:?} after its daemon died (lease 1 s)");
    let hosts = c.manager().list_hosts().unwrap();
    let h3 = hosts.iter().find(|h| h.host_id == 3).unwrap();
    assert!(!h3.live, "deleted before the lease ended");
    for p in ["h3-kept", "h1-temp", "h2-temp-on3"] {
        assert!(exists(&c, p), "{p} was deleted with host 3's lease");
    }
    // The owner processes still run: it was the lease, not an exit.
    drop((on3, on1));
}
