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
use regions_tests::{Cluster, ManagerProcess, bin_path};

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
        Helper::start_env(program, args, &[])
    }

    fn start_env(program: &Path, args: &[String], env: &[(&str, &str)]) -> anyhow::Result<Helper> {
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().copied())
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
fn a_deleted_objects_slot_is_reused_clear_after_its_tokens_expire() -> anyhow::Result<()> {
    // Capabilities live 2 s here, so a freed slot is due 4 to 5 s after its object's deletion
    // (a lifetime and a margin of at most another).
    let c = Cluster::start_with(2, "64M", &["--capability-ttl-secs", "2"])?;
    let a = SyncClient::connect(&socket(&c, 1));
    let b = SyncClient::connect(&socket(&c, 2));
    a.mutex_init("old")?;
    a.barrier_init("old-barrier", 1)?;
    let old = a.mutex_locate("old")?.region_offset;
    // Deleted while held, and with arrivals counted: the words are not 0.
    a.mutex_lock("old")?;
    assert_eq!(a.barrier_wait("old-barrier")?, 1);
    let deleted = std::time::Instant::now();
    a.delete("old")?;
    a.delete("old-barrier")?;
    // Right away, a new object gets a new slot: tokens for the old one may still live.
    b.mutex_init("early")?;
    let early = b.mutex_locate("early")?.region_offset;
    assert_ne!(early, old);
    std::thread::sleep(Duration::from_secs(6).saturating_sub(deleted.elapsed()));
    // Due now: the new objects get the old slots (first freed, first reused), cleared.
    b.mutex_init("new")?;
    b.barrier_init("new-barrier", 1)?;
    assert_eq!(
        b.mutex_locate("new")?.region_offset,
        old,
        "the freed mutex slot is reused"
    );
    // Were the word not cleared, these would wait for the deleted mutex's holder: bounded.
    for host in [2, 1] {
        let sock = socket(&c, host);
        let done = on_thread(move || {
            let client = SyncClient::connect(&sock);
            client.mutex_lock("new")?;
            client.mutex_unlock("new")?;
            client.barrier_wait("new-barrier")
        });
        let arrivals = done
            .recv_timeout(Duration::from_secs(30))
            .context("locking the new mutex on a reused slot hangs")??;
        assert!(
            arrivals == 1 || arrivals == 2,
            "a new barrier counts from 0: {arrivals}"
        );
    }
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

/// `counter` helper arguments: TIMES increments of REGION's word under mutex NAME, through
/// host `h`'s agent, by `threads` threads.
fn counter_args(
    c: &Cluster,
    h: u32,
    name: &str,
    times: u64,
    region: &str,
    threads: usize,
) -> Vec<String> {
    vec![
        "counter".into(),
        s(&socket(c, h)),
        name.into(),
        times.to_string(),
        c.manager_url(),
        s(&c.secret_file),
        h.to_string(),
        region.into(),
        threads.to_string(),
    ]
}

#[test]
fn mutex_excludes_threads_of_one_process_and_other_processes() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    SyncClient::connect(&socket(&c, 1)).mutex_init("tm")?;
    shared_region(&c, "tcounter")?;
    // Four threads of one process on host 1 (the word's host: CPU atomics on the mapped
    // segment), one process each on hosts 2 and 3 (tcp transport); one of those goes
    // through the manager only.
    let threads = Helper::sync_helper(&counter_args(&c, 1, "tm", 500, "tcounter", 4))?;
    let second = Helper::sync_helper(&counter_args(&c, 2, "tm", 1000, "tcounter", 1))?;
    let third = Helper::start_env(
        &helper_bin(),
        &counter_args(&c, 3, "tm", 1000, "tcounter", 1),
        &[("SYNC_HELPER_THROUGH_MANAGER", "1")],
    )?;
    let mut paths = Vec::new();
    for h in [threads, second, third] {
        paths.extend(h.finish(HELPER_TIMEOUT)?);
    }
    assert_eq!(
        read_word(&c, "tcounter")?,
        4 * 500 + 2 * 1000,
        "an increment was lost: two holders at once"
    );
    assert_eq!(paths.len(), 3);
    assert!(paths[0].contains("local"), "{paths:?}");
    assert!(paths[1].contains("tcp"), "{paths:?}");
    assert!(paths[2].contains("manager"), "{paths:?}");
    // The holding thread unlocks: another thread of this process gets EPERM.
    let me = std::sync::Arc::new(SyncClient::connect(&socket(&c, 2)));
    me.mutex_lock("tm")?;
    let other = std::sync::Arc::clone(&me);
    let errno = std::thread::spawn(move || other.mutex_unlock("tm").map_err(|e| e.errno()))
        .join()
        .map_err(|_| anyhow::anyhow!("thread panicked"))?;
    assert_eq!(errno, Err(libc::EPERM));
    me.mutex_unlock("tm")?;
    Ok(())
}

#[test]
fn barrier_parties_through_the_manager_and_the_fast_path_mix() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    SyncClient::connect(&socket(&c, 1)).barrier_init("mix", 3)?;
    shared_region(&c, "mixarrivals")?;
    let rounds = 40u64;
    let helpers: Vec<Helper> = (1..=3)
        .map(|h| {
            let args = [
                "barrier".into(),
                s(&socket(&c, h)),
                "mix".into(),
                rounds.to_string(),
                c.manager_url(),
                s(&c.secret_file),
                h.to_string(),
                "mixarrivals".into(),
            ];
            let env: &[(&str, &str)] = if h == 2 {
                &[("SYNC_HELPER_THROUGH_MANAGER", "1")]
            } else {
                &[]
            };
            Helper::start_env(&helper_bin(), &args, env)
        })
        .collect::<anyhow::Result<_>>()?;
    for h in helpers {
        let lines = h.finish(HELPER_TIMEOUT)?;
        assert_eq!(lines.len(), rounds as usize);
        for line in lines {
            let v: Vec<u64> = line.split(' ').map(str::parse).collect::<Result<_, _>>()?;
            assert_eq!(v[1], v[0], "generations count rounds from 1");
            assert!(
                v[2] >= 3 * v[0],
                "round {} passed after {} arrivals",
                v[0],
                v[2]
            );
        }
    }
    assert_eq!(
        SyncClient::connect(&socket(&c, 3)).barrier_arrivals("mix")?,
        3 * rounds
    );
    Ok(())
}

/// Runs `f` on a thread; its result arrives on the returned channel.
fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Receiver<T> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

#[test]
fn barrier_sleepers_wake_and_delete_and_reinit_are_seen() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    let (s1, s2, s3) = (socket(&c, 1), socket(&c, 2), socket(&c, 3));
    let a = std::sync::Arc::new(SyncClient::connect(&s1));
    let b = SyncClient::connect(&s2);
    a.barrier_init("slow", 2)?;
    // A waits long past its polling budget (it sleeps at the manager); B's late arrival
    // completes the round and wakes it. Then the other way round.
    for generation in 1..=2u64 {
        let a2 = std::sync::Arc::clone(&a);
        let waiter = on_thread(move || a2.barrier_wait("slow").map_err(|e| e.errno()));
        std::thread::sleep(Duration::from_millis(400));
        assert!(waiter.try_recv().is_err(), "passed a barrier of 2 alone");
        assert_eq!(b.barrier_wait("slow")?, generation);
        assert_eq!(waiter.recv_timeout(HELPER_TIMEOUT)?, Ok(generation));
    }
    assert_eq!(b.barrier_arrivals("slow")?, 4);
    // Deleting the barrier ends a sleeping wait with ENOENT.
    let a2 = std::sync::Arc::clone(&a);
    let waiter = on_thread(move || a2.barrier_wait("slow").map_err(|e| e.errno()));
    std::thread::sleep(Duration::from_millis(400));
    SyncClient::connect(&s3).delete("slow")?;
    assert_eq!(waiter.recv_timeout(HELPER_TIMEOUT)?, Err(libc::ENOENT));
    // Created again with 3 parties: B still has the old word cached, sees it deleted and
    // finds the new one; all three pass round 1 of the new barrier.
    SyncClient::connect(&s3).barrier_init("slow", 3)?;
    let b_wait = on_thread(move || b.barrier_wait("slow").map_err(|e| e.errno()));
    let c3 = on_thread(move || {
        SyncClient::connect(&s3)
            .barrier_wait("slow")
            .map_err(|e| e.errno())
    });
    assert_eq!(a.barrier_wait("slow")?, 1);
    assert_eq!(b_wait.recv_timeout(HELPER_TIMEOUT)?, Ok(1));
    assert_eq!(c3.recv_timeout(HELPER_TIMEOUT)?, Ok(1));
    assert_eq!(a.barrier_arrivals("slow")?, 3);
    Ok(())
}

#[test]
fn a_party_killed_while_waiting_leaves_the_barrier_usable() -> anyhow::Result<()> {
    let c = Cluster::start(3, "64M")?;
    let a = SyncClient::connect(&socket(&c, 1));
    a.barrier_init("k", 2)?;
    shared_region(&c, "karrivals")?;
    let mut party = Helper::sync_helper(&[
        "barrier".into(),
        s(&socket(&c, 2)),
        "k".into(),
        "1".into(),
        c.manager_url(),
        s(&c.secret_file),
        "2".into(),
        "karrivals".into(),
    ])?;
    let deadline = Instant::now() + HELPER_TIMEOUT;
    while a.barrier_arrivals("k")? < 1 {
        anyhow::ensure!(Instant::now() < deadline, "the party never arrived");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Past its polling budget: it sleeps at the manager, which set the sleepers bit.
    std::thread::sleep(Duration::from_millis(300));
    party.sigkill()?;
    // Its arrival counted: the next arrival completes round 1 (and finds no one to wake).
    assert_eq!(a.barrier_wait("k")?, 1);
    // Later rounds work as before.
    let s3 = socket(&c, 3);
    let other = on_thread(move || {
        SyncClient::connect(&s3)
            .barrier_wait("k")
            .map_err(|e| e.errno())
    });
    assert_eq!(a.barrier_wait("k")?, 2);
    assert_eq!(other.recv_timeout(HELPER_TIMEOUT)?, Ok(2));
    Ok(())
}

/// Retries `f` (bounded) while the restarted manager and the agents' connections come back.
fn eventually<T>(what: &str, mut f: impl FnMut() -> regions::Result<T>) -> anyhow::Result<T> {
    let deadline = Instant::now() + HELPER_TIMEOUT;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline => {
                eprintln!("{what}: not yet ({e}); retrying");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => bail!("{what}: {e}"),
        }
    }
}

#[test]
fn sync_definitions_survive_a_manager_restart() -> anyhow::Result<()> {
    let mut c = Cluster::start(3, "64M")?;
    let (s1, s2) = (socket(&c, 1), socket(&c, 2));
    let a = SyncClient::connect(&s1);
    a.barrier_init("rb", 2)?;
    a.mutex_init("rm")?;
    a.bell_init("rr")?;
    let b2 = std::sync::Arc::new(SyncClient::connect(&s2));
    for generation in 1..=3u64 {
        let b = std::sync::Arc::clone(&b2);
        let other = on_thread(move || b.barrier_wait("rb").map_err(|e| e.errno()));
        assert_eq!(a.barrier_wait("rb")?, generation);
        assert_eq!(other.recv_timeout(HELPER_TIMEOUT)?, Ok(generation));
    }
    a.mutex_lock("rm")?;
    a.mutex_unlock("rm")?;
    a.bell_ring("rr")?;

    let addr = c.manager.addr.to_string();
    c.manager.sigkill()?;
    let data = c.dir.path().join("manager");
    c.manager = ManagerProcess::start_in(&[], &addr, &data, &c.secret_file, &[])?;

    // Fresh clients (nothing cached): every definition is still there with its parameters.
    let fresh = SyncClient::connect(&s2);
    eventually("mutex_init after the restart", || fresh.mutex_init("rm"))?;
    assert_eq!(
        fresh.barrier_init("rb", 3).unwrap_err().errno(),
        libc::EEXIST
    );
    fresh.barrier_init("rb", 2)?;
    assert_eq!(fresh.bell_init("rb").unwrap_err().errno(), libc::EEXIST);
    fresh.bell_init("rr")?;
    assert_eq!(fresh.bell_ring("nope").unwrap_err().errno(), libc::ENOENT);
    // The barrier carries on with the next generation (its word outlived the manager).
    for generation in 4..=6u64 {
        let b = std::sync::Arc::clone(&b2);
        let other = on_thread(move || b.barrier_wait("rb").map_err(|e| e.errno()));
        assert_eq!(fresh.barrier_wait("rb")?, generation);
        assert_eq!(other.recv_timeout(HELPER_TIMEOUT)?, Ok(generation));
    }
    // The mutex still excludes (a holder here blocks a waiter there) and hands over.
    fresh.mutex_lock("rm")?;
    let s1b = s1.clone();
    let waiter = on_thread(move || {
        let w = SyncClient::connect(&s1b);
        w.mutex_lock("rm")
            .and_then(|()| w.mutex_unlock("rm"))
            .map_err(|e| e.errno())
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(waiter.try_recv().is_err(), "the waiter got a held mutex");
    fresh.mutex_unlock("rm")?;
    assert_eq!(waiter.recv_timeout(HELPER_TIMEOUT)?, Ok(()));
    // The doorbell rings on: a first wait sees both rings.
    fresh.bell_ring("rr")?;
    assert!(SyncClient::connect(&s1).bell_wait("rr")? >= 1);
    Ok(())
}

#[test]
fn a_dead_hosts_mutex_is_released_when_its_lease_ends() -> anyhow::Result<()> {
    let c = Cluster::start_with(3, "64M", &["--lease-ms", "1000"])?;
    // The lock word lives on host 1; the holder uses host 2's agent, the waiter host 3's.
    SyncClient::connect(&socket(&c, 1)).mutex_init("lease")?;
    let holder = Helper::sync_helper(&["hold".into(), s(&socket(&c, 2)), "lease".into()])?;
    assert_eq!(holder.line(HELPER_TIMEOUT)?, "locked");
    let waiter = Helper::sync_helper(&["lock-once".into(), s(&socket(&c, 3)), "lease".into()])?;
    assert!(
        waiter.line(Duration::from_millis(1500)).is_err(),
        "the waiter got a held mutex while the holder's host was alive"
    );
    // Host 2 dies (its agent, which watched the holder, with it); the holder process
    // itself lives on, cut off. Its host's lease ends and the manager hands the mutex on.
    let mut c = c;
    let d2 = c
        .daemons
        .iter_mut()
        .find(|d| d.host_id == 2)
        .context("no daemon 2")?;
    d2.sigkill()?;
    assert_eq!(waiter.line(HELPER_TIMEOUT)?, "locked");
    waiter.finish(HELPER_TIMEOUT)?;
    let mut holder = holder;
    assert!(
        holder.child.try_wait()?.is_none(),
        "the holder process is still alive"
    );
    // Free again for anyone.
    let me = SyncClient::connect(&socket(&c, 1));
    me.mutex_lock("lease")?;
    me.mutex_unlock("lease")?;
    Ok(())
}
