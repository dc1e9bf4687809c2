//! Latency and throughput of durable namespace operations on the real
//! `regions-manager`, against the disk's own fdatasync latency.
//!
//! ```sh
//! cargo build --release --bins
//! cargo bench -p regions-tests --bench manager_ops
//! ```
//!
//! The bench runs `target/release/regions-manager` (see
//! [`regions_tests::bin_path`]; build it first, as above, or point
//! `REGIONS_BIN_DIR` elsewhere). One client on loopback runs `BENCH_OPS`
//! (default 3,000) iterations of create + lookup + unlink, one request at a
//! time, and reports each request's latency. Every create and unlink is
//! committed to the store (fsync) before its reply, so their latency is
//! bounded below by the disk's sync latency, which the bench measures in the
//! same data directory (4 KiB write + fdatasync, 200 times) as a baseline.
//!
//! The data directory is made under `BENCH_DIR` if set, else under cargo's
//! target tmp directory (on the same disk as the build, not a tmpfs).

use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::fd::AsRawFd as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use regions_proto::v1;
use regions_tests::{ManagerProcess, ROOT_INO, bin_path, caller, connect, write_secret};

/// Default number of create + lookup + unlink iterations.
const DEFAULT_OPS: usize = 3_000;
/// Iterations when run as a smoke test rather than by `cargo bench`.
const SMOKE_OPS: usize = 50;
/// Number of 4 KiB write + fdatasync samples of the baseline.
const SYNC_SAMPLES: usize = 200;
const UID: u32 = 1000;
const HOST: u32 = 1;

/// Latency samples of one kind of operation.
struct Samples {
    name: &'static str,
    all: Vec<Duration>,
}

impl Samples {
    fn new(name: &'static str, capacity: usize) -> Samples {
        Samples {
            name,
            all: Vec::with_capacity(capacity),
        }
    }

    /// The `q`-quantile (nearest rank) of the samples; `all` must be sorted.
    fn quantile(&self, q: f64) -> Duration {
        if self.all.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((q * self.all.len() as f64).ceil() as usize).clamp(1, self.all.len());
        self.all[rank - 1]
    }

    fn mean(&self) -> Duration {
        if self.all.is_empty() {
            return Duration::ZERO;
        }
        self.all.iter().sum::<Duration>() / self.all.len() as u32
    }

    fn sort(&mut self) {
        self.all.sort_unstable();
    }

    fn row(&self) -> String {
        format!(
            "| {:<12} | {:>7} | {:>10} | {:>10} | {:>10} | {:>10} |",
            self.name,
            self.all.len(),
            us(self.mean()),
            us(self.quantile(0.50)),
            us(self.quantile(0.99)),
            us(self.all.last().copied().unwrap_or_default()),
        )
    }
}

/// A duration in microseconds, for the table.
fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn header() -> String {
    format!(
        "| {:<12} | {:>7} | {:>10} | {:>10} | {:>10} | {:>10} |\n|{:-<14}|{:->9}|{:->12}|{:->12}|{:->12}|{:->12}|",
        "operation", "count", "mean µs", "p50 µs", "p99 µs", "max µs", "", "", "", "", "", ""
    )
}

/// Times `SYNC_SAMPLES` rounds of a 4 KiB write followed by fdatasync to a
/// file in `dir`.
fn fdatasync_baseline(dir: &Path) -> anyhow::Result<Samples> {
    let path = dir.join("fdatasync-probe");
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    let block = [0x5au8; 4096];
    let mut samples = Samples::new("fdatasync", SYNC_SAMPLES);
    for _ in 0..SYNC_SAMPLES {
        let start = Instant::now();
        file.write_all(&block).context("write to the probe file")?;
        // SAFETY: the descriptor belongs to `file`, open for the whole call.
        if unsafe { libc::fdatasync(file.as_raw_fd()) } != 0 {
            return Err(std::io::Error::last_os_error()).context("fdatasync");
        }
        samples.all.push(start.elapsed());
    }
    drop(file);
    std::fs::remove_file(&path).context("remove the probe file")?;
    samples.sort();
    Ok(samples)
}

/// Iterations: `BENCH_OPS`, else [`DEFAULT_OPS`] under `cargo bench` (which
/// passes `--bench`) and [`SMOKE_OPS`] when run as a test (`cargo test
/// --benches` or `--all-targets` run harness-less benches without it).
fn ops_from_env() -> anyhow::Result<usize> {
    match std::env::var("BENCH_OPS") {
        Ok(s) => s
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .with_context(|| format!("BENCH_OPS must be a positive integer, not {s:?}")),
        Err(_) if std::env::args().any(|a| a == "--bench") => Ok(DEFAULT_OPS),
        Err(_) => Ok(SMOKE_OPS),
    }
}

/// Requests in flight in the concurrent phase (`BENCH_CONCURRENCY`, default 8).
fn concurrency_from_env() -> anyhow::Result<usize> {
    match std::env::var("BENCH_CONCURRENCY") {
        Ok(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .with_context(|| format!("BENCH_CONCURRENCY must be a positive integer, not {v:?}")),
        Err(_) => Ok(8),
    }
}

async fn bench() -> anyhow::Result<()> {
    let iterations = ops_from_env()?;
    let base = match std::env::var_os("BENCH_DIR") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
    };
    std::fs::create_dir_all(&base).with_context(|| format!("cannot create {}", base.display()))?;
    let dir = tempfile::Builder::new()
        .prefix("manager-bench")
        .tempdir_in(&base)
        .with_context(|| format!("cannot make a directory in {}", base.display()))?;
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data)?;
    let secret_file = dir.path().join("secret");
    let secret = write_secret(&secret_file)?;

    let mut manager = ManagerProcess::start(&data, &secret_file)?;
    let mut clients = connect(manager.addr, &secret).await?;
    let ns = &mut clients.namespace;

    let bench_dir = ns
        .mkdir(v1::MkdirRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "bench".into(),
            mode: 0o755,
        })
        .await
        .context("mkdir bench")?
        .into_inner()
        .ino;
    // Warm up the connection and the store.
    for i in 0..50 {
        let name = format!("warm-{i}");
        ns.create(v1::CreateRequest {
            caller: caller(UID, HOST),
            parent: bench_dir,
            name: name.clone(),
            mode: 0o644,
            ..Default::default()
        })
        .await
        .context("warm-up create")?;
        ns.unlink(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: bench_dir,
            name,
        })
        .await
        .context("warm-up unlink")?;
    }

    let mut create = Samples::new("create", iterations);
    let mut lookup = Samples::new("lookup", iterations);
    let mut unlink = Samples::new("unlink", iterations);
    let started = Instant::now();
    for i in 0..iterations {
        let name = format!("region-{i}");
        let t = Instant::now();
        let made = ns
            .create(v1::CreateRequest {
                caller: caller(UID, HOST),
                parent: bench_dir,
                name: name.clone(),
                mode: 0o644,
                ..Default::default()
            })
            .await
            .with_context(|| format!("create {name}"))?
            .into_inner();
        create.all.push(t.elapsed());

        let t = Instant::now();
        let found = ns
            .lookup(v1::LookupRequest {
                caller: caller(UID, HOST),
                parent: bench_dir,
                name: name.clone(),
            })
            .await
            .with_context(|| format!("lookup {name}"))?
            .into_inner();
        lookup.all.push(t.elapsed());
        if found.ino != made.ino {
            bail!(
                "lookup of {name} found inode {}, create made {}",
                found.ino,
                made.ino
            );
        }

        let t = Instant::now();
        ns.unlink(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: bench_dir,
            name: name.clone(),
        })
        .await
        .with_context(|| format!("unlink {name}"))?;
        unlink.all.push(t.elapsed());
    }
    let elapsed = started.elapsed();

    // The same work from one client with several requests in flight on its
    // connection: the manager commits concurrent changes together.
    let concurrent = concurrency_from_env()?;
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..concurrent {
        let mut ns = clients.namespace.clone();
        let per = iterations / concurrent;
        workers.push(tokio::spawn(async move {
            for i in 0..per {
                let name = format!("c{w}-{i}");
                ns.create(v1::CreateRequest {
                    caller: caller(UID, HOST),
                    parent: bench_dir,
                    name: name.clone(),
                    mode: 0o644,
                    ..Default::default()
                })
                .await?;
                ns.lookup(v1::LookupRequest {
                    caller: caller(UID, HOST),
                    parent: bench_dir,
                    name: name.clone(),
                })
                .await?;
                ns.unlink(v1::RemoveRequest {
                    caller: caller(UID, HOST),
                    parent: bench_dir,
                    name,
                })
                .await?;
            }
            Ok::<usize, tonic::Status>(per)
        }));
    }
    let mut concurrent_triples = 0;
    for w in workers {
        concurrent_triples += w
            .await
            .context("worker task")?
            .context("concurrent worker")?;
    }
    let concurrent_elapsed = started.elapsed();
    let status = manager.sigterm_and_wait(Duration::from_secs(10))?;
    if !status.success() {
        bail!(
            "the manager exited with {status} after the run; its log:\n{}",
            manager.log()
        );
    }

    let sync = fdatasync_baseline(&data)?;
    for s in [&mut create, &mut lookup, &mut unlink] {
        s.sort();
    }
    let mut overall = Samples::new("all", 3 * iterations);
    for s in [&create, &lookup, &unlink] {
        overall.all.extend_from_slice(&s.all);
    }
    overall.sort();

    let ops = 3 * iterations;
    println!();
    println!(
        "regions-manager: {iterations} × (create + lookup + unlink), one client, loopback, durable commits"
    );
    println!("data dir: {}", data.display());
    println!("binary:   {}", bin_path("regions-manager")?.display());
    println!();
    println!("{}", header());
    for s in [&create, &lookup, &unlink, &overall, &sync] {
        println!("{}", s.row());
    }
    println!();
    let secs = elapsed.as_secs_f64();
    println!("wall time      {secs:.3} s");
    println!(
        "throughput     {:.0} ops/s (each create, lookup, unlink one op)",
        ops as f64 / secs
    );
    println!(
        "               {:.0} create+lookup+unlink triples/s",
        iterations as f64 / secs
    );
    let csecs = concurrent_elapsed.as_secs_f64();
    println!(
        "concurrent     {:.0} ops/s with {concurrent} requests in flight on the one connection ({} triples in {csecs:.3} s)",
        (3 * concurrent_triples) as f64 / csecs,
        concurrent_triples
    );
    let sync_p50 = sync.quantile(0.5).as_secs_f64();
    if sync_p50 > 0.0 {
        println!(
            "p50 create / p50 fdatasync = {:.2} (p50 unlink / p50 fdatasync = {:.2})",
            create.quantile(0.5).as_secs_f64() / sync_p50,
            unlink.quantile(0.5).as_secs_f64() / sync_p50,
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Err(e) = bin_path("regions-manager") {
        eprintln!("manager_ops: {e:#}");
        eprintln!(
            "manager_ops: run `cargo build --release --bins` before `cargo bench -p regions-tests --bench manager_ops`"
        );
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("manager_ops: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(bench()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("manager_ops: {e:#}");
            ExitCode::FAILURE
        }
    }
}
