//! A distributed histogram in the style of Metis (Remote Regions paper §8.7) over
//! regions, checked against a single-process in-memory run.
//!
//! `regions-mapreduce run --mounts M1,M2,M3` (one regionfs mount per host
//! id; `examples/run-demo.sh mapreduce` starts such a cluster):
//!
//! 1. generates the input (RGB pixel triples, at least 1 GiB; `--small`:
//!    24 MiB) in memory and times the single-process histogram of it;
//! 2. writes it into a region held on the first host, and drops the first
//!    mount's cached copy (the other mappers then read it from host 1's
//!    memory through the transport; host 1's own mapper maps host 1's
//!    memory, by FUSE passthrough when the mount offers it);
//! 3. starts one worker process per mount, each of which:
//!    counts map tasks (`--tasks` slices of the input, each mapped with
//!    `mmap`): its own share first, then any other worker's it can claim
//!    before that worker gets to it (a work queue; a claim is a `mkdir`),
//!    writes its partial histogram into a region on its own host,
//!    meets the others at a barrier,
//!    sums its disjoint range of bins over all partial histograms (reduce)
//!    into a region on its own host, meets the others again, and
//!    worker 0 collects the reducers' ranges into the `result` region;
//! 4. reads `result`, checks it equals the single-process histogram, and
//!    prints the wall times of both and their ratio.
//!
//! What the timers cover: the single-process time is the counting of the
//! in-memory input by one thread (and, beside it, by one thread per
//! worker), without generating the input. The distributed time runs from
//! spawning the first worker to reaping the last: worker start, map
//! (claims, mmaps, the page faults that fetch the input, counting, writing
//! the partial histogram), barriers, reduce and collect. Writing the input
//! into its region is data placement, like generating it for the
//! baseline, and is not in either time.
//!
//! Only `cluster.rs` knows about regions; see its header.

mod cluster;
mod hist;

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    version,
    about = "Distributed histogram map-reduce over regions (Remote Regions paper §8.7)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the whole job: one worker per mount, checked against one process.
    Run(RunArgs),
    /// One worker process (started by `run`).
    Worker(WorkerArgs),
}

#[derive(Parser)]
struct RunArgs {
    /// Comma-separated regionfs mounts, one per host id; the input lives on
    /// the first one's host.
    #[arg(
        long,
        env = "REGIONS_MAPREDUCE_MOUNTS",
        value_delimiter = ',',
        required = true
    )]
    mounts: Vec<PathBuf>,
    /// Reduced size for CI (24 MiB instead of 1 GiB).
    #[arg(long, env = "REGIONS_DEMO_SMALL")]
    small: bool,
    /// Input size in bytes (rounded up to whole pages of whole pixels);
    /// overrides the default of --small or full size.
    #[arg(long)]
    size: Option<u64>,
    /// Seed of the generated input.
    #[arg(long, default_value_t = 2018)]
    seed: u64,
    /// Seconds the workers may take before the job is killed.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Map tasks the input is split into: each worker counts its own share
    /// of them, then takes over tasks other workers have not started (a
    /// work queue, claimed with one mkdir each). Equal to the number of
    /// mounts, it is a static split.
    #[arg(long, default_value_t = 24)]
    tasks: usize,
    /// Keep the job's regions afterwards (default: removed).
    #[arg(long)]
    keep: bool,
}

#[derive(Parser)]
struct WorkerArgs {
    /// This worker's regionfs mount.
    #[arg(long)]
    mount: PathBuf,
    /// The job directory, relative to the mount root.
    #[arg(long)]
    job: String,
    /// This worker's index (0-based) and the number of workers.
    #[arg(long)]
    index: usize,
    #[arg(long)]
    workers: usize,
    /// The job's barrier.
    #[arg(long)]
    barrier: String,
    /// Map tasks the input is split into.
    #[arg(long)]
    tasks: usize,
    /// When `run` spawned this worker (microseconds since the Unix epoch).
    #[arg(long, default_value_t = 0)]
    spawned_at: u128,
}

const FULL_SIZE: u64 = 1 << 30;
const SMALL_SIZE: u64 = 24 << 20;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Run(args) => run(args),
        Cmd::Worker(args) => worker(args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("regions-mapreduce: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn input_path(job: &Path) -> PathBuf {
    job.join("input").join("pixels")
}
fn partial_path(job: &Path, i: usize) -> PathBuf {
    job.join(format!("partial-{i}"))
}
fn reduced_path(job: &Path, i: usize) -> PathBuf {
    job.join(format!("reduced-{i}"))
}
fn claims_path(job: &Path) -> PathBuf {
    job.join("claims")
}
fn result_path(job: &Path) -> PathBuf {
    job.join("result")
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One worker: map, barrier, reduce, barrier, and (worker 0) collect.
fn worker(a: WorkerArgs) -> Result<bool> {
    let job = a.mount.join(&a.job);
    let started = Instant::now();
    let start_latency = (epoch_micros().saturating_sub(a.spawned_at) as f64 / 1e6).min(60.0);

    // Map: count map tasks of the input, each read through mmap.
    let input = input_path(&job);
    let size = std::fs::metadata(&input)
        .with_context(|| format!("cannot stat {}", input.display()))?
        .len();
    let order = hist::task_order(a.tasks, a.workers, a.index);
    let claims = claims_path(&job);
    let mut partial = [0u64; hist::BINS];
    let (mut own, mut taken, mut counted) = (0, 0, 0u64);
    for t in order {
        // A work queue over the cluster: whoever claims a task counts it.
        if !cluster::claim(&claims.join(t.to_string()))? {
            continue;
        }
        let range = hist::slice(size, a.tasks, t);
        let mapped = cluster::Mapped::new(&input, range.clone())?;
        hist::count(mapped.bytes(), &mut partial);
        counted += range.end - range.start;
        if hist::own_tasks(a.tasks, a.workers, a.index).contains(&t) {
            own += 1;
        } else {
            taken += 1;
        }
    }
    cluster::publish(&partial_path(&job, a.index), &hist::to_bytes(&partial))?;
    let mapped_at = started.elapsed();

    cluster::barrier_wait(&a.mount, &a.barrier)?;
    let met_at = started.elapsed();

    // Reduce: sum this worker's bins over every mapper's partial histogram.
    let bins = hist::bins(a.workers, a.index);
    let bytes = (bins.start as u64 * 8)..(bins.end as u64 * 8);
    let mut reduced = vec![0u64; bins.len()];
    for j in 0..a.workers {
        let part = cluster::read_range(&partial_path(&job, j), bytes.clone())?;
        let part = hist::from_bytes(&part).context("a partial histogram is torn")?;
        for (r, p) in reduced.iter_mut().zip(part) {
            *r += p;
        }
    }
    cluster::publish(&reduced_path(&job, a.index), &hist::to_bytes(&reduced))?;
    let reduced_at = started.elapsed();

    cluster::barrier_wait(&a.mount, &a.barrier)?;
    let met2_at = started.elapsed();

    // Collect (worker 0): the reducers' ranges, in order, into one region.
    if a.index == 0 {
        let mut result = Vec::with_capacity(hist::BINS);
        for j in 0..a.workers {
            let path = reduced_path(&job, j);
            let len = hist::bins(a.workers, j).len() as u64 * 8;
            let part = cluster::read_range(&path, 0..len)?;
            result.extend(hist::from_bytes(&part).context("a reduced range is torn")?);
        }
        cluster::publish(&result_path(&job), &hist::to_bytes(&result))?;
    }
    let done = started.elapsed();
    let cpu = cpu_time();
    let host = cluster::host_id(&a.mount)?;
    println!(
        "worker {} on host {host}: start {start_latency:.3} s, map {:.3} s ({:.0} MiB at {:.0} MiB/s: {own} own tasks, {taken} taken over), barrier {:.3} s, reduce {:.3} s, barrier {:.3} s, collect {:.3} s, cpu {:.3} s",
        a.index,
        secs(mapped_at),
        counted as f64 / 1048576.0,
        counted as f64 / 1048576.0 / secs(mapped_at).max(1e-9),
        secs(met_at - mapped_at),
        secs(reduced_at - met_at),
        secs(met2_at - reduced_at),
        secs(done - met2_at),
        cpu,
    );
    Ok(true)
}

fn epoch_micros() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// CPU seconds (user and system) this process has used so far.
fn cpu_time() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage of this process.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Kills every child still running (by PID) and reaps it.
fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().filter_map(Option::as_mut) {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Runs the workers; returns their outputs in index order.
fn run_workers(a: &RunArgs, job_rel: &str, barrier: &str) -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    let n = a.mounts.len();
    let mut children: Vec<Option<Child>> = Vec::new();
    for (i, mount) in a.mounts.iter().enumerate() {
        let child = Command::new(&exe)
            .args(["worker", "--job", job_rel, "--barrier", barrier])
            .arg("--mount")
            .arg(mount)
            .args(["--index", &i.to_string(), "--workers", &n.to_string()])
            .args(["--tasks", &a.tasks.to_string()])
            .args(["--spawned-at", &epoch_micros().to_string()])
            .env("REGIONS_MOUNT", mount)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match child {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                kill_all(&mut children);
                bail!("cannot start worker {i}: {e}");
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(a.timeout);
    let mut outputs = vec![String::new(); n];
    let mut running = n;
    while running > 0 {
        for i in 0..n {
            let Some(child) = children[i].as_mut() else {
                continue;
            };
            let Some(status) = child.try_wait().context("waitpid failed")? else {
                continue;
            };
            let mut out = String::new();
            let mut err = String::new();
            if let Some(mut s) = child.stdout.take() {
                let _ = s.read_to_string(&mut out);
            }
            if let Some(mut s) = child.stderr.take() {
                let _ = s.read_to_string(&mut err);
            }
            children[i] = None;
            running -= 1;
            if !status.success() {
                kill_all(&mut children);
                bail!(
                    "worker {i} ({}) failed with {status}: {}",
                    a.mounts[i].display(),
                    err.trim()
                );
            }
            outputs[i] = out.trim().to_owned();
        }
        if running > 0 && Instant::now() > deadline {
            kill_all(&mut children);
            bail!(
                "the workers did not finish within {} s; killed them",
                a.timeout
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(outputs)
}

fn run(a: RunArgs) -> Result<bool> {
    let n = a.mounts.len();
    if n == 0 {
        bail!("--mounts names no mount");
    }
    if a.tasks < n {
        bail!(
            "--tasks {} is fewer than the {n} workers: give each at least one",
            a.tasks
        );
    }
    let hosts = a
        .mounts
        .iter()
        .map(|m| cluster::host_id(m))
        .collect::<Result<Vec<u32>>>()?;
    let size = hist::input_size(
        a.size
            .unwrap_or(if a.small { SMALL_SIZE } else { FULL_SIZE }),
    );
    let threads = std::thread::available_parallelism().map_or(2, |p| p.get());

    println!(
        "mapreduce: histogram of {:.0} MiB of RGB pixels ({} bins), {n} workers on hosts {:?}",
        size as f64 / 1048576.0,
        hist::BINS,
        hosts
    );
    let data = hist::generate_all(size, a.seed, threads);

    // The single-process in-memory baselines.
    let t = Instant::now();
    let single = hist::histogram(&data, 1);
    let single_time = t.elapsed();
    let t = Instant::now();
    let threaded = hist::histogram(&data, n);
    let threaded_time = t.elapsed();
    if threaded != single {
        bail!("the threaded baseline differs from the single-threaded one: a bug in hist.rs");
    }

    // The input, in a region on the first host.
    let job_rel = format!("mapreduce-{}", std::process::id());
    let job = a.mounts[0].join(&job_rel);
    std::fs::create_dir(&job).with_context(|| format!("cannot create {}", job.display()))?;
    let barrier = format!("{job_rel}-phase");
    let outcome = (|| -> Result<bool> {
        cluster::mkdir_on_host(&job.join("input"), hosts[0])?;
        std::fs::create_dir(claims_path(&job)).context("cannot create the claims directory")?;
        let input = input_path(&job);
        let t = Instant::now();
        cluster::publish(&input, &data)?;
        cluster::drop_cached(&input)?;
        let placed = t.elapsed();
        let held = cluster::hosts_of(&input)?;
        println!(
            "input: {} held on host {held} (written in {:.3} s: data placement, in no timer below)",
            input.display(),
            secs(placed)
        );
        drop(data);

        cluster::barrier_init(&a.mounts[0], &barrier, n as u32)?;
        let t = Instant::now();
        let outputs = run_workers(&a, &job_rel, &barrier)?;
        let job_time = t.elapsed();
        for o in &outputs {
            println!("  {o}");
        }

        let result = cluster::read_range(&result_path(&job), 0..hist::BINS as u64 * 8)?;
        let result = hist::from_bytes(&result).context("the result region is torn")?;
        let equal = result == single;
        println!(
            "timers: single process = counting the in-memory input (not generating it); distributed = first worker spawned to last worker reaped (start, map with fetch, barriers, reduce, collect); {threads} cores on this machine, shared by all hosts"
        );
        println!(
            "single process, in memory, 1 thread : {:8.3} s",
            secs(single_time)
        );
        println!(
            "single process, in memory, {n} threads: {:8.3} s",
            secs(threaded_time)
        );
        println!(
            "distributed, {n} hosts through regions: {:8.3} s",
            secs(job_time)
        );
        println!(
            "ratio distributed / single process: {:.2} (1 thread), {:.2} ({n} threads)",
            secs(job_time) / secs(single_time).max(1e-9),
            secs(job_time) / secs(threaded_time).max(1e-9)
        );
        println!(
            "histogram equal to the single-process one: {} ({} pixels counted, {} in bin R=128)",
            if equal { "yes" } else { "NO" },
            result.iter().sum::<u64>() / 3,
            result[128]
        );
        Ok(equal)
    })();
    let _ = cluster::barrier_delete(&a.mounts[0], &barrier);
    if !a.keep {
        std::fs::remove_dir_all(&job)
            .with_context(|| format!("cannot remove {}", job.display()))?;
    }
    outcome
}
