//! Sync primitives against the transport they are built on, measured in the same run.
//!
//! ```sh
//! cargo build --release --bins
//! cargo bench -p regions-tests --bench sync
//! ```
//!
//! A cluster of three hosts on loopback (release binaries, see
//! [`regions_tests::bin_path`]). Baseline: one transport round trip, an 8-byte
//! compare-and-swap from this process to the daemon of host 2 (tcp transport). Measured:
//!
//! - uncontended `mutex_lock` + `mutex_unlock` from a process whose lock word is on another
//!   host (tcp transport with the manager's capability: target at most 2 round trips), and
//!   from a process on the word's own host (the segment mapped: CPU atomics);
//! - a 3-party barrier, one party per host (target at most 3 round trips per round): the
//!   fast path (fetch-add on the arrival word, then polling it), and for comparison the same
//!   barrier with every call through agent and manager.
//!
//! `BENCH_OPS` sets the iterations (default 5,000; barrier rounds are a tenth of that).
//! `-- --transport rdma [--rdma-device NAME]` runs it on RDMA (the fast paths' words through
//! memory windows; [`regions_tests::bench_transport`], `benches/rdma-vm.sh`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use regions::sync::SyncClient;
use regions::{Client, ClientConfig};
use regions_proto::v1;
use regions_tests::Cluster;
use regions_tests::bench_transport::BenchTransport;

fn per_op(total: Duration, n: usize) -> Duration {
    total / n.max(1) as u32
}

fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

fn run() -> anyhow::Result<()> {
    let ops: usize = std::env::var("BENCH_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let transport = BenchTransport::from_args()?;
    transport.export();
    let cluster = Cluster::start_with_daemon_args(3, "256M", &[], &transport.daemon_args())?;
    println!("transport: {}", transport.describe());
    let sock =
        |h: u32| -> anyhow::Result<std::path::PathBuf> { Ok(cluster.daemon(h)?.socket.clone()) };

    // Baseline: one CAS round trip to host 2's daemon.
    let mut config = ClientConfig::new(&cluster.manager_url(), cluster.secret.clone(), 1);
    transport.apply(&mut config);
    let client = Client::connect(config)?;
    let attr = client.create_path(
        "rt",
        0o644,
        Some(v1::RegionAttrOverrides {
            hostalloc: Some("2".into()),
            ..Default::default()
        }),
        4096,
    )?;
    let region = client.open(attr.ino, true)?;
    region.write_at(0, &[0u8; 8])?;
    anyhow::ensure!(
        region.hosts() == vec![2],
        "baseline region is not on host 2"
    );
    for _ in 0..200 {
        region.compare_and_swap(0, 0, 0)?;
    }
    let t = Instant::now();
    for i in 0..ops as u64 {
        region.compare_and_swap(0, i, i + 1)?;
    }
    let rtt = per_op(t.elapsed(), ops);

    // The mutex's word is placed on host 1 (the host of its first init).
    let local = SyncClient::connect(&sock(1)?);
    local.mutex_init("bench")?;
    let remote = SyncClient::connect(&sock(2)?);
    let measure = |c: &SyncClient| -> anyhow::Result<Duration> {
        for _ in 0..200 {
            c.mutex_lock("bench")?;
            c.mutex_unlock("bench")?;
        }
        let t = Instant::now();
        for _ in 0..ops {
            c.mutex_lock("bench")?;
            c.mutex_unlock("bench")?;
        }
        Ok(per_op(t.elapsed(), ops))
    };
    let remote_lock = measure(&remote)?;
    // The two halves of the remote pair, timed one by one.
    let (mut lock_t, mut unlock_t) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..ops {
        let t = Instant::now();
        remote.mutex_lock("bench")?;
        let m = Instant::now();
        remote.mutex_unlock("bench")?;
        lock_t += m - t;
        unlock_t += m.elapsed();
    }
    let (remote_lock_half, remote_unlock_half) = (per_op(lock_t, ops), per_op(unlock_t, ops));
    let remote_path = remote.mutex_path("bench")?;
    let local_lock = measure(&local)?;
    let local_path = local.mutex_path("bench")?;

    // 3-party barrier, one party per host (threads of this process, one agent each).
    let rounds = (ops / 10).max(20);
    local.barrier_init("bench-barrier", 3)?;
    let parties: Vec<Arc<SyncClient>> = (1..=3)
        .map(|h| sock(h).map(|s| Arc::new(SyncClient::connect(&s))))
        .collect::<anyhow::Result<_>>()?;
    for p in &parties {
        // Warm the connections.
        p.bell_init("bench-warm")?;
    }
    let t = Instant::now();
    let handles: Vec<_> = parties
        .iter()
        .map(|p| {
            let p = Arc::clone(p);
            std::thread::spawn(move || -> anyhow::Result<Vec<Duration>> {
                let mut times = Vec::with_capacity(rounds);
                let mut last = Instant::now();
                for _ in 0..rounds {
                    p.barrier_wait("bench-barrier")?;
                    let now = Instant::now();
                    times.push(now - last);
                    last = now;
                }
                Ok(times)
            })
        })
        .collect();
    let mut round_times = Vec::new();
    for h in handles {
        let times = h
            .join()
            .map_err(|_| anyhow::anyhow!("barrier thread panicked"))??;
        if round_times.is_empty() {
            round_times = times; // host 1's party: the time between its passes
        }
    }
    let barrier = per_op(t.elapsed(), rounds);
    round_times.sort();
    let median = round_times
        .get(round_times.len() / 2)
        .copied()
        .unwrap_or_default();
    let barrier_path = parties
        .iter()
        .map(|p| p.barrier_path("bench-barrier"))
        .collect::<regions::Result<Vec<_>>>()?
        .join(", ");

    // The same barrier with every call through the manager (no fast path), for comparison.
    let slow_rounds = (rounds / 4).max(10);
    let slow: Vec<Arc<SyncClient>> = (1..=3)
        .map(|h| sock(h).map(|s| Arc::new(SyncClient::connect(&s).through_manager())))
        .collect::<anyhow::Result<_>>()?;
    for p in &slow {
        p.bell_init("bench-warm")?;
    }
    let t = Instant::now();
    let handles: Vec<_> = slow
        .iter()
        .map(|p| {
            let p = Arc::clone(p);
            std::thread::spawn(move || -> anyhow::Result<()> {
                for _ in 0..slow_rounds {
                    p.barrier_wait("bench-barrier")?;
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("barrier thread panicked"))??;
    }
    let slow_barrier = per_op(t.elapsed(), slow_rounds);

    let ratio = |d: Duration| d.as_secs_f64() / rtt.as_secs_f64();
    println!("sync primitives vs one transport round trip (same run, {ops} ops)");
    println!("| what | per op | x round trip | target |");
    println!("|---|---:|---:|---:|");
    println!(
        "| transport CAS round trip (baseline) | {} | 1.00 | |",
        us(rtt)
    );
    println!(
        "| mutex lock+unlock, word on another host ({remote_path}) | {} | {:.2} | <= 2 |",
        us(remote_lock),
        ratio(remote_lock)
    );
    println!(
        "| of which lock / unlock (timed one by one) | {} / {} | {:.2} / {:.2} | |",
        us(remote_lock_half),
        us(remote_unlock_half),
        ratio(remote_lock_half),
        ratio(remote_unlock_half)
    );
    println!(
        "| mutex lock+unlock, word on this host ({local_path}) | {} | {:.2} | <= 2 |",
        us(local_lock),
        ratio(local_lock)
    );
    println!(
        "| 3-party barrier round ({rounds} rounds; {barrier_path}) | {} | {:.2} | <= 3 |",
        us(barrier),
        ratio(barrier)
    );
    println!(
        "| 3-party barrier round, median of host 1's rounds | {} | {:.2} | <= 3 |",
        us(median),
        ratio(median)
    );
    println!(
        "| 3-party barrier round, all through the manager ({slow_rounds} rounds) | {} | {:.2} | |",
        us(slow_barrier),
        ratio(slow_barrier)
    );
    drop(cluster);
    Ok(())
}

fn main() -> ExitCode {
    // `cargo test --benches` runs benches with --bench absent: keep it short then.
    if !std::env::args().any(|a| a == "--bench") && std::env::var_os("BENCH_OPS").is_none() {
        // SAFETY: single-threaded at this point; nothing else reads the environment yet.
        unsafe { std::env::set_var("BENCH_OPS", "200") };
    }
    match run().context("sync bench") {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
