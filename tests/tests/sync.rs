//! Barriers, mutexes and doorbells across three host ids: real manager and daemon processes,
//! separate OS processes (`regions-sync-helper`, the `regionfs sync` CLI) on each host's agent.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use regions::sync::SyncClient;
use regions::{Client, ClientConfig};
use regions_tests::{Cluster, bin_path};

/// Bound of every wait for a helper process.
const HELPER_TIMEOUT: Duration = Duration::from_secs(120);

/// A helper process, killed (by pid) if still running when dropped; stdout lines arrive on
/// a channel.
struct Helper {
    child: Child,
    lines: Receiver<String>,
}

impl Helper {
    fn start(program: &Path, args: &[String]) -> anyhow::Result<Helper> {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {}", program.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Helper { child, lines: rx })
    }

    fn sync_helper(args: &[String]) -> anyhow::Result<Helper> {
        Helper::start(&helper_bin(), args)
    }

    /// The next stdout line, within `timeout`.
    fn line(&self, timeout: Duration) -> anyhow::Result<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Ok(l),
            Err(RecvTimeoutError::Timeout) => bail!("no output within {timeout:?}"),
            Err(RecvTimeoutError::Disconnected) => bail!("the helper exited without that output"),
        }
    }

    /// Waits (bounded) for the exit; returns all remaining stdout lines; fails unless 0.
    fn finish(mut self, timeout: Duration) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                let lines: Vec<String> = self.lines.try_iter().collect();
                // The reader thread may still be draining the pipe.
                let mut lines = lines;
                while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    lines.push(l);
                }
                if !status.success() {
                    bail!("helper failed with {status}; output: {lines:?}");
                }
                return Ok(lines);
            }
            if Instant::now() > deadline {
                bail!("helper did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn sigkill(&mut self) -> anyhow::Result<()> {
        let pid = libc::pid_t::try_from(self.child.id())?;
        // SAFETY: kill(2) on our own child's pid.
        if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
            bail!("kill failed: {}", std::io::Error::last_os_error());
        }
        let _ = self.child.wait();
        Ok(())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn helper_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_regions-sync-helper"))
}

fn socket(c: &Cluster, host: u32) -> PathBuf {
    c.daemon(host).expect("daemon").socket.clone()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// A region of one page for shared test data, written through the manager with the secret.
fn shared_region(c: &Cluster, path: &str) -> anyhow::Result<()> {
    let client = Client::connect(ClientConfig::new(&c.manager_url(), c.secret.clone(), 1))?;
    let attr = client.create_path(path, 0o666, None, 4096)?;
    client.open(attr.ino, true)?.write_at(0, &[0u8; 8])?;
    Ok(())
}

fn read_word(c: &Cluster, path: &str) -> anyhow::Result<u64> {
    let client = Client::connect(ClientConfig::new(&c.manager_url(), c.secret.clone(), 2))?;
    let attr = client.lookup_path(path)?;
    let mut word = [0u8; 8];
    client.open(attr.ino, false)?.read_at(0, &mut word)?;
    Ok(u64::from_le_bytes(word))
}

#[test]
fn barrier_of_three_processes_on_three_hosts_for_100_rounds() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    SyncClient::connect(&socket(&c, 1)).barrier_init("b", 3)?;
    shared_region(&c, "arrivals")?;
    let rounds = 100u64;
    let helpers: Vec<Helper> = (1..=3)
        .map(|h| {
            Helper::sync_helper(&[
                "barrier".into(),
                s(&socket(&c, h)),
                "b".into(),
                rounds.to_string(),
                c.manager_url(),
                s(&c.secret_file),
                h.to_string(),
                "arrivals".into(),
            ])
        })
        .collect::<anyhow::Result<_>>()?;
    for h in helpers {
        let lines = h.finish(HELPER_TIMEOUT)?;
        assert_eq!(lines.len(), rounds as usize);
        for line in lines {
            let v: Vec<u64> = line.split(' ').map(str::parse).collect::<Result<_, _>>()?;
            let (round, generation, arrived) = (v[0], v[1], v[2]);
            assert_eq!(generation, round, "generations count rounds from 1");
            assert!(
                arrived >= 3 * round,
                "round {round}: passed the barrier after only {arrived} arrivals (need {})",
                3 * round
            );
        }
    }
    assert_eq!(read_word(&c, "arrivals")?, 3 * rounds);
    Ok(())
}

#[test]
fn mutex_counter_incremented_10000_times_by_three_processes_is_exact() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    SyncClient::connect(&socket(&c, 1)).mutex_init("m")?;
    shared_region(&c, "counter")?;
    let shares = [3334u64, 3333, 3333];
    let helpers: Vec<Helper> = (1..=3u32)
        .map(|h| {
            Helper::sync_helper(&[
                "counter".into(),
                s(&socket(&c, h)),
                "m".into(),
                shares[h as usize - 1].to_string(),
                c.manager_url(),
                s(&c.secret_file),
                h.to_string(),
                "counter".into(),
            ])
        })
        .collect::<anyhow::Result<_>>()?;
    let mut paths = Vec::new();
    for h in helpers {
        paths.extend(h.finish(HELPER_TIMEOUT)?);
    }
    assert_eq!(read_word(&c, "counter")?, 10_000);
    // Host 1 holds the word (mapped segment); the others use the tcp transport.
    assert!(paths.iter().any(|p| p.contains("local")), "{paths:?}");
    assert!(paths.iter().any(|p| p.contains("tcp")), "{paths:?}");
    Ok(())
}

#[test]
fn doorbell_rings_and_waits_in_order() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    let a = SyncClient::connect(&socket(&c, 1));
    let b = SyncClient::connect(&socket(&c, 2));
    a.bell_init("ping")?;
    a.bell_init("pong")?;
    // Rings before a caller's first wait are seen by it at once.
    a.bell_ring("ping")?;
    a.bell_ring("ping")?;
    assert_eq!(b.bell_wait("ping")?, 2);
    // Ping-pong between hosts 1 and 2: every wait sees exactly the next ring.
    let rounds = 100;
    let bsock = socket(&c, 2);
    let responder = std::thread::spawn(move || -> anyhow::Result<Vec<i64>> {
        let b = SyncClient::connect(&bsock);
        let mut seen = Vec::new();
        for _ in 0..rounds {
            seen.push(b.bell_wait("ping")?);
            b.bell_ring("pong")?;
        }
        Ok(seen)
    });
    let mut pongs = Vec::new();
    for _ in 0..rounds {
        a.bell_ring("ping")?;
        pongs.push(a.bell_wait("pong")?);
    }
    let pings = responder
        .join()
        .map_err(|_| anyhow::anyhow!("responder panicked"))??;
    assert_eq!(pings, (3..3 + rounds).collect::<Vec<i64>>());
    assert_eq!(pongs, (1..=rounds).collect::<Vec<i64>>());
    // A first wait sees the rings so far at once; the next blocks until the next ring;
    // deleting the bell ends a wait with ENOENT.
    let csock = socket(&c, 3);
    let waiter = std::thread::spawn(move || {
        let c3 = SyncClient::connect(&csock);
        let errno = |r: regions::Result<i64>| r.map_err(|e| e.errno());
        (
            errno(c3.bell_wait("pong")),
            errno(c3.bell_wait("pong")),
            errno(c3.bell_wait("pong")),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    a.bell_ring("pong")?;
    std::thread::sleep(Duration::from_millis(300));
    a.delete("pong")?;
    let (first, second, third) = waiter
        .join()
        .map_err(|_| anyhow::anyhow!("waiter panicked"))?;
    assert_eq!(first, Ok(rounds));
    assert_eq!(second, Ok(rounds + 1));
    assert_eq!(third, Err(libc::ENOENT));
    Ok(())
}

#[test]
fn a_killed_holder_loses_the_mutex_and_the_next_waiter_gets_it() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    let me = SyncClient::connect(&socket(&c, 3));
    me.mutex_init("k")?;
    let mut holder = Helper::sync_helper(&["hold".into(), s(&socket(&c, 2)), "k".into()])?;
    assert_eq!(holder.line(HELPER_TIMEOUT)?, "locked");
    // A waiter on host 1 queues at the manager.
    let waiter = Helper::sync_helper(&["lock-once".into(), s(&socket(&c, 1)), "k".into()])?;
    assert!(
        waiter.line(Duration::from_millis(500)).is_err(),
        "the waiter got a held mutex"
    );
    // Only the holder may unlock.
    assert_eq!(me.mutex_unlock("k").unwrap_err().errno(), libc::EPERM);
    holder.sigkill()?;
    assert_eq!(waiter.line(HELPER_TIMEOUT)?, "locked");
    waiter.finish(HELPER_TIMEOUT)?;
    // Free again: this process takes it on the fast path.
    me.mutex_lock("k")?;
    me.mutex_unlock("k")?;
    Ok(())
}

#[test]
fn unknown_existing_and_invalid_objects() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    let a = SyncClient::connect(&socket(&c, 1));
    let b = SyncClient::connect(&socket(&c, 2));
    let errno = |r: regions::Result<()>| r.unwrap_err().errno();
    assert_eq!(errno(a.barrier_wait("nope").map(drop)), libc::ENOENT);
    assert_eq!(errno(a.mutex_lock("nope")), libc::ENOENT);
    assert_eq!(errno(a.bell_ring("nope")), libc::ENOENT);
    assert_eq!(errno(a.delete("nope")), libc::ENOENT);
    assert_eq!(errno(a.barrier_init("zero", 0)), libc::EINVAL);
    assert_eq!(errno(a.barrier_init("", 2)), libc::EINVAL);
    a.barrier_init("b", 2)?;
    b.barrier_init("b", 2)?; // same parameters: fine
    assert_eq!(errno(b.barrier_init("b", 3)), libc::EEXIST);
    assert_eq!(errno(b.mutex_init("b")), libc::EEXIST);
    assert_eq!(errno(b.bell_init("b")), libc::EEXIST);
    a.mutex_init("m")?;
    b.mutex_init("m")?;
    assert_eq!(errno(a.bell_ring("m")), libc::EINVAL, "wrong kind");
    // A deleted object is gone; a barrier of 1 never waits.
    a.delete("b")?;
    assert_eq!(errno(a.barrier_wait("b").map(drop)), libc::ENOENT);
    a.barrier_init("one", 1)?;
    assert_eq!(a.barrier_wait("one")?, 1);
    assert_eq!(a.barrier_wait("one")?, 2);
    Ok(())
}

#[test]
fn regionfs_sync_cli_on_three_mounts() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    let mounts: Vec<_> = (1..=3).map(|h| c.mount(h)).collect::<anyhow::Result<_>>()?;
    let regionfs = bin_path("regionfs")?;
    let cli = |mount: &Path, args: &[&str]| -> anyhow::Result<Helper> {
        let mut all = vec!["sync".to_owned(), "--mount".into(), s(mount)];
        all.extend(args.iter().map(|a| a.to_string()));
        Helper::start(&regionfs, &all)
    };
    cli(&mounts[0].mountpoint, &["init-barrier", "gate", "3"])?.finish(HELPER_TIMEOUT)?;
    // Two parties wait; the third releases them.
    let first = cli(&mounts[0].mountpoint, &["barrier", "gate", "3"])?;
    let second = cli(&mounts[1].mountpoint, &["barrier", "gate", "3"])?;
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        first.lines.try_recv().is_err(),
        "a party passed before the third arrived"
    );
    let third = cli(&mounts[2].mountpoint, &["barrier", "gate", "3"])?;
    for h in [first, second, third] {
        assert_eq!(h.finish(HELPER_TIMEOUT)?, vec!["1".to_owned()]);
    }
    // lock -- CMD runs CMD holding the mutex and exits with its status; three shells on
    // three mounts append to one file under the mutex.
    let file = mounts[0].path("log");
    std::fs::write(&file, "")?;
    let script = |m: &Path| {
        format!(
            "for i in 1 2 3 4 5; do n=$(wc -l < {f}); echo \"$n\" >> {f}; done",
            f = m.join("log").display()
        )
    };
    let shells: Vec<Helper> = mounts
        .iter()
        .map(|m| {
            cli(
                &m.mountpoint,
                &[
                    "lock",
                    "--init",
                    "logm",
                    "--",
                    "sh",
                    "-c",
                    &script(&m.mountpoint),
                ],
            )
        })
        .collect::<anyhow::Result<_>>()?;
    for h in shells {
        h.finish(HELPER_TIMEOUT)?;
    }
    let text = std::fs::read_to_string(&file)?;
    let lines: Vec<&str> = text.lines().collect();
    let expected: Vec<String> = (0..15).map(|i| i.to_string()).collect();
    assert_eq!(lines, expected, "appends under the mutex never interleave");
    let status = Command::new(&regionfs)
        .args([
            "sync",
            "--mount",
            &s(&mounts[1].mountpoint),
            "lock",
            "logm",
            "--",
            "sh",
            "-c",
            "exit 7",
        ])
        .status()?;
    assert_eq!(status.code(), Some(7));
    // ring / wait, and a clear error for unknown names.
    cli(&mounts[0].mountpoint, &["init-bell", "door"])?.finish(HELPER_TIMEOUT)?;
    cli(&mounts[1].mountpoint, &["ring", "door"])?.finish(HELPER_TIMEOUT)?;
    assert_eq!(
        cli(&mounts[2].mountpoint, &["wait", "door"])?.finish(HELPER_TIMEOUT)?,
        vec!["1".to_owned()]
    );
    let out = Command::new(&regionfs)
        .args([
            "sync",
            "--mount",
            &s(&mounts[2].mountpoint),
            "ring",
            "missing",
        ])
        .output()?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("init-bell"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    cli(&mounts[0].mountpoint, &["delete", "door"])?.finish(HELPER_TIMEOUT)?;
    Ok(())
}
