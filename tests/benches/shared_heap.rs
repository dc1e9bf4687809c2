//! rmalloc from several hosts in one region at once (issue target: 3 hosts x 2 threads for
//! 10 s, then a full heap check from a fourth host; throughput per host >= 0.5x a host
//! allocating alone).
//!
//! ```sh
//! cargo build --release --bins
//! cargo bench -p regions-tests --bench shared_heap
//! ```
//!
//! One cluster of four hosts on this machine; the region lives on host 1, so host 1's process
//! allocates in the segment memfd and hosts 2 and 3 through their mappings' page caches.
//! Each process (`regions-heap-helper stress`) allocates blocks of 16 B to 32 KiB, fills them,
//! checks them before it frees them, and keeps up to 512 live per thread. First each host runs
//! alone (same region, one after the other), then all three at once; then host 4 checks every
//! live block and every arena's heap. Printed: operations per second per host alone and
//! together, their ratio, and the floor of this machine: the three processes share its cores,
//! so when a lone host already keeps every core busy, a host's share together is at most
//! cores / (3 x min(threads, cores)) of what it had alone.
//!
//! `BENCH_QUICK=1`, or running without `--bench` (as `cargo test --benches` does), runs 1 s
//! rounds as a smoke test.

use std::ffi::OsStr;
use std::process::ExitCode;
use std::time::Duration;

use regions_tests::Cluster;
use regions_tests::heap_runs::{check, start_stress};

const THREADS: usize = 2;

fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some() || !std::env::args().any(|a| a == "--bench")
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shared_heap bench failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let seconds = if quick() { 1.0 } else { 10.0 };
    let wait = Duration::from_secs_f64(seconds + 120.0);
    let cluster = Cluster::start(4, "4G")?;
    let mounts = (1..=4)
        .map(|h| cluster.mount(h))
        .collect::<anyhow::Result<Vec<_>>>()?;
    std::fs::File::create(mounts[0].path("heap"))?;
    let dir = tempfile::tempdir()?;
    let mut lists = Vec::new();
    let mut alone = Vec::new();
    for (h, m) in mounts.iter().take(3).enumerate() {
        let live = dir.path().join(format!("alone-{h}"));
        let ops = start_stress(
            &m.path("heap"),
            h as u32 + 1,
            seconds,
            THREADS,
            live.clone(),
        )?
        .finish(wait)?;
        alone.push(ops as f64 / seconds);
        lists.push(live);
    }
    let runs = mounts
        .iter()
        .take(3)
        .enumerate()
        .map(|(h, m)| {
            let live = dir.path().join(format!("together-{h}"));
            start_stress(&m.path("heap"), h as u32 + 1, seconds, THREADS, live)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut together = Vec::new();
    for r in runs {
        lists.push(r.live.clone());
        together.push(r.finish(wait)? as f64 / seconds);
    }
    let mut args: Vec<&OsStr> = Vec::new();
    for l in &lists {
        args.extend([OsStr::new("--live"), l.as_os_str()]);
    }
    let c = check(&mounts[3].path("heap"), &args, wait)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let floor = (cores / (3.0 * (THREADS as f64).min(cores))).min(1.0);
    println!(
        "shared heap, {THREADS} threads per host, {seconds} s rounds, {cores} cores (floor of a \
         host's share together: {floor:.2}x)"
    );
    println!(
        "{:<8} {:>14} {:>14} {:>8} {:>10}",
        "host", "alone ops/s", "together ops/s", "ratio", "vs floor"
    );
    for h in 0..3 {
        let ratio = together[h] / alone[h];
        println!(
            "{:<8} {:>14.0} {:>14.0} {:>7.2}x {:>9.2}x",
            h + 1,
            alone[h],
            together[h],
            ratio,
            ratio / floor
        );
    }
    let (sa, st): (f64, f64) = (alone.iter().sum::<f64>() / 3.0, together.iter().sum());
    println!(
        "all three together: {st:.0} ops/s, {:.2}x one host alone on average",
        st / sa
    );
    println!(
        "check from host 4: {} live blocks in {} arenas intact, every arena's heap valid",
        c.blocks, c.arenas
    );
    Ok(())
}
