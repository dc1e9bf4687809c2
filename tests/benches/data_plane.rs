//! The data plane against what the machine does without it: reads of real regions through the
//! real `regions-daemon` (tcp transport and same-host memfd), each next to a baseline measured
//! in the same run.
//!
//! ```sh
//! cargo build --release --bins
//! cargo bench -p regions-tests --bench data_plane
//! ```
//!
//! The bench starts a manager and two daemons on loopback (`target/release` binaries, see
//! [`regions_tests::bin_path`]), writes random bytes to a region held by host 2 and to one held
//! by host 1, checks samples read back (and every read of measurements 1 and 3, outside the
//! timed calls), and measures, from host 1:
//!
//! 1. 4 KiB READ latency: `Region::read_at` of a host-2 region (tcp, no local segment) and one
//!    raw `TcpTransport::read` of a 4 KiB span, vs a bare 4 KiB / 4 KiB TCP ping-pong between two
//!    threads of this process (std::net, `TCP_NODELAY`, blocking). Target: p50 ratio <= 1.3.
//!    Two diagnostic ping-pongs split the difference: one shaped like a transport READ (64-byte
//!    request; 64-byte header read on its own, then 4 KiB from a random place of a region-sized
//!    buffer), and the same with the server in another process (this executable, started with
//!    [`SERVER_ENV`]), as the daemon is.
//! 2. 1 MiB READ throughput: sequential 1 MiB `read_at`s of the host-2 region vs a bare TCP
//!    stream of 1 MiB writes read into a 1 MiB buffer, same bytes. Target: ratio >= 0.8. The
//!    bare sender writes its 1 MiB pieces from a region-sized buffer in turn, so that it reads
//!    memory out of cache as the daemon does; a stream reusing one cache-hot 1 MiB buffer is
//!    shown too.
//! 3. 64-byte reads batched in READV: `TcpTransport::read` of 4,096 random 64-byte spans per
//!    call for about a second. Target: >= 1,000,000 reads/s. Baseline: gathering the same spans
//!    from a Vec in this process (what the memory itself costs); also shown: a bare TCP round
//!    trip moving the same bytes, and READV of spans that all lie in 256 KiB (cache-hot).
//! 4. Same-host reads: `read_at` of 1 MiB from a host-1 region through the segment memfd the
//!    host agent hands over, vs `copy_from_slice` of 1 MiB from a Vec, same bytes. Target:
//!    ratio >= 0.9. The client's counters must show no remote request during the runs.
//!
//! Every measurement runs a few times, interleaved with its baseline, after a warm-up; the
//! median run is reported. CPU time per operation is reported for both ends (the measuring
//! thread; the daemon or the baseline's server), which, unlike latency, hardly depends on how
//! the scheduler places the two ends. `BENCH_QUICK=1`, or running without `--bench` (as `cargo
//! test --benches` does), runs a tiny version as a smoke test; `BENCH_ONLY=1,3` runs only the
//! measurements listed.
//!
//! Latencies on loopback depend on what else runs on the machine: with other work on the CPUs
//! they can double (the load average is printed at the start and the end).
//!
//! `-- --transport rdma [--rdma-device NAME]` runs the daemons and the host-1 client on RDMA
//! ([`regions_tests::bench_transport`]; on this machine inside the soft-RoCE VM:
//! `benches/rdma-vm.sh`).

use std::io::{self, BufRead as _, IoSlice, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use rand::rngs::SmallRng;
use rand::{Rng as _, RngCore as _, SeedableRng as _};
use regions::transport::tcp::{RetryPolicy, TcpTransport};
use regions::transport::{Span, Transport as _, TransportStats};
use regions::{Client, ClientConfig, Region};
use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1;
use regions_tests::bench_transport::BenchTransport;
use regions_tests::{Cluster, bin_path};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Bytes of a small read (measurement 1).
const SMALL: usize = 4 * KIB;
/// Bytes of a large read (measurements 2 and 4).
const LARGE: usize = MIB;
/// Bytes of one batched read (measurement 3).
const TINY: usize = 64;
/// Size of a READV request's range entry (pool u32, pad u32, offset u64, len u64).
const RANGE_ENTRY: usize = 24;
/// Size of a transport frame header.
const FRAME_HEADER: usize = 64;
/// Reads of one kind in a row before measurement 1 switches to the next kind.
const LATENCY_BLOCK: usize = 100;
/// Batches of random spans measurement 3 cycles through.
const READV_BATCHES: usize = 64;
/// Piece size when filling the regions.
const WRITE_PIECE: usize = 4 * MIB;

/// Sizes and repetitions of one run of the bench.
struct Params {
    quick: bool,
    /// Bytes of each region.
    region: usize,
    /// Runs of each measurement (the median is reported).
    runs: usize,
    /// Timed 4 KiB reads per run, per variant.
    latency_iters: usize,
    /// Bytes read per throughput run (measurements 2 and 4).
    stream_bytes: usize,
    /// Spans per READV call.
    readv_spans: usize,
    /// Time of one READV run.
    readv_time: Duration,
    /// Measurements to run (`BENCH_ONLY=1,3`; all by default).
    only: Vec<u32>,
}

impl Params {
    fn from_env() -> anyhow::Result<Params> {
        let only = match std::env::var("BENCH_ONLY") {
            Ok(list) => list
                .split(',')
                .map(|m| {
                    m.trim()
                        .parse::<u32>()
                        .ok()
                        .filter(|m| (1..=4).contains(m))
                        .with_context(|| format!("BENCH_ONLY lists measurements 1 to 4, not {m:?}"))
                })
                .collect::<anyhow::Result<Vec<u32>>>()?,
            Err(_) => vec![1, 2, 3, 4],
        };
        let quick = std::env::var_os("BENCH_QUICK").is_some_and(|v| v != "0")
            || !std::env::args().any(|a| a == "--bench");
        Ok(if quick {
            Params {
                only,
                quick,
                region: 8 * MIB,
                runs: 1,
                latency_iters: 200,
                stream_bytes: 16 * MIB,
                readv_spans: 4096,
                readv_time: Duration::from_millis(50),
            }
        } else {
            Params {
                only,
                quick,
                region: 256 * MIB,
                runs: 5,
                latency_iters: 5_000,
                stream_bytes: 512 * MIB,
                readv_spans: 4096,
                readv_time: Duration::from_secs(1),
            }
        })
    }

    fn selected(&self, measurement: u32) -> bool {
        self.only.contains(&measurement)
    }
}

// ---------------------------------------------------------------- statistics

/// The median of `values` (mean of the two middle ones for an even count).
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Latency summary of one run, in microseconds.
#[derive(Clone, Copy, Debug)]
struct Latency {
    p50: f64,
    p99: f64,
    mean: f64,
}

impl Latency {
    fn of(samples: &mut [Duration]) -> Latency {
        samples.sort_unstable();
        let q = |q: f64| {
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1].as_secs_f64() * 1e6
        };
        let mean = samples.iter().sum::<Duration>().as_secs_f64() * 1e6 / samples.len() as f64;
        Latency {
            p50: q(0.5),
            p99: q(0.99),
            mean,
        }
    }

    /// The median of each statistic over runs.
    fn median(runs: &[Latency]) -> Latency {
        let pick = |f: fn(&Latency) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        Latency {
            p50: pick(|l| l.p50),
            p99: pick(|l| l.p99),
            mean: pick(|l| l.mean),
        }
    }

    fn row(&self, name: &str, runs: &[Latency]) -> String {
        let p50s: Vec<String> = runs.iter().map(|l| format!("{:.1}", l.p50)).collect();
        format!(
            "  {name:<36} p50 {:>7.1} µs   p99 {:>7.1} µs   mean {:>7.1} µs   (p50 per run: {})",
            self.p50,
            self.p99,
            self.mean,
            p50s.join(", ")
        )
    }
}

/// Bytes per second as GB/s.
fn gbps(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}

fn list(values: &[f64], digits: usize) -> String {
    values
        .iter()
        .map(|v| format!("{v:.digits$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The 1, 5 and 15 minute load averages (`/proc/loadavg`), to tell a busy machine.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

// ---------------------------------------------------------------- CPU time

/// `clock_gettime(clock)`.
fn clock(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time of a process: the sum of its threads' run time (`/proc/PID/task/*/schedstat`).
fn process_cpu(pid: u32) -> Duration {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

/// CPU time spent on both ends of a measurement: the measuring thread ("client") and the
/// other end ("server": the daemon process, plus this process's other threads, which is where
/// a bare baseline's server thread runs).
#[derive(Clone, Copy, Debug, Default)]
struct Cpu {
    client: Duration,
    server: Duration,
}

impl std::ops::AddAssign for Cpu {
    fn add_assign(&mut self, o: Cpu) {
        self.client += o.client;
        self.server += o.server;
    }
}

impl Cpu {
    /// Per operation, in microseconds, for printing.
    fn per_op(&self, ops: usize) -> String {
        let us = |d: Duration| d.as_secs_f64() * 1e6 / ops.max(1) as f64;
        format!(
            "client {:.1} µs + server {:.1} µs",
            us(self.client),
            us(self.server)
        )
    }
}

/// Measures [`Cpu`] over intervals.
struct CpuMeter {
    daemon: u32,
}

/// A reading of (this thread, this process, the other process), and which process that is.
struct CpuMark {
    times: [Duration; 3],
    other: u32,
}

impl CpuMeter {
    /// Starts an interval whose server is the daemon (or threads of this process).
    fn start(&self) -> CpuMark {
        self.start_for(self.daemon)
    }

    /// Starts an interval whose server is process `other` (or threads of this process).
    fn start_for(&self, other: u32) -> CpuMark {
        // The slow /proc read first, so that its cost falls outside the interval.
        let server = process_cpu(other);
        let process = clock(libc::CLOCK_PROCESS_CPUTIME_ID);
        let thread = clock(libc::CLOCK_THREAD_CPUTIME_ID);
        CpuMark {
            times: [thread, process, server],
            other,
        }
    }

    fn stop(&self, mark: CpuMark) -> Cpu {
        let thread = clock(libc::CLOCK_THREAD_CPUTIME_ID);
        let process = clock(libc::CLOCK_PROCESS_CPUTIME_ID);
        let server = process_cpu(mark.other);
        let [t0, p0, s0] = mark.times;
        let client = thread.saturating_sub(t0);
        let others = process.saturating_sub(p0).saturating_sub(client);
        Cpu {
            client,
            server: others + server.saturating_sub(s0),
        }
    }
}

// ---------------------------------------------------------------- bare TCP baselines

/// What a [`PingPong`] exchange looks like.
#[derive(Clone, Copy, Debug)]
struct Shape {
    /// Bytes of each request.
    request: usize,
    /// Bytes of a header sent ahead of each reply's payload, which the client reads on its own
    /// as the transport client does (0: no header).
    header: usize,
    /// Bytes of each reply's payload.
    reply: usize,
    /// Serve payloads from random `reply`-aligned places of a buffer this large, as a daemon
    /// serves random reads from its pool (0: from one buffer that stays in cache).
    window: usize,
}

impl Shape {
    /// A bare request of `request` bytes answered with `reply` bytes.
    fn plain(request: usize, reply: usize) -> Shape {
        Shape {
            request,
            header: 0,
            reply,
            window: 0,
        }
    }
}

/// A loopback TCP connection to a server that answers every request with a reply (blocking
/// std sockets, `TCP_NODELAY`), shaped as a [`Shape`] says. The server is a thread of this
/// process, or for diagnosis another process (this executable, run with [`SERVER_ENV`]).
struct PingPong {
    stream: TcpStream,
    request: Vec<u8>,
    header: Vec<u8>,
    reply: Vec<u8>,
    server: Option<Server>,
}

enum Server {
    Thread(JoinHandle<io::Result<()>>),
    Process(Child),
}

/// Environment variable that makes this executable a ping-pong server process:
/// `request,header,reply,window` (see [`Shape`]). It prints its port, serves one connection.
const SERVER_ENV: &str = "DATA_PLANE_PINGPONG_SERVER";

/// `write_all` of several slices with as few system calls as the socket allows.
fn write_all_vectored(s: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match s.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Serves one ping-pong connection of `listener` until the peer closes it.
fn serve_pingpong(listener: &TcpListener, shape: Shape) -> io::Result<()> {
    let (mut s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    let mut req = vec![0u8; shape.request];
    let header = vec![0x11u8; shape.header];
    // A non-zero fill touches every page up front.
    let source = vec![0xa5u8; shape.window.max(shape.reply)];
    let places = (source.len() / shape.reply).max(1);
    let mut rng = SmallRng::seed_from_u64(11);
    loop {
        match s.read_exact(&mut req) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let at = rng.random_range(0..places) * shape.reply;
        let payload = &source[at..at + shape.reply];
        if header.is_empty() {
            s.write_all(payload)?;
        } else {
            write_all_vectored(&mut s, &mut [IoSlice::new(&header), IoSlice::new(payload)])?;
        }
    }
}

/// The [`SERVER_ENV`] mode of this executable.
fn pingpong_server_process(spec: &str) -> anyhow::Result<()> {
    let n: Vec<usize> = spec
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad {SERVER_ENV}={spec:?}"))?;
    let [request, header, reply, window] = n[..] else {
        bail!("{SERVER_ENV}={spec:?} needs 4 numbers");
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("{}", listener.local_addr()?.port());
    io::stdout().flush()?;
    let shape = Shape {
        request,
        header,
        reply,
        window,
    };
    serve_pingpong(&listener, shape)?;
    Ok(())
}

impl PingPong {
    /// A ping-pong with a server thread.
    fn start(shape: Shape) -> anyhow::Result<PingPong> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the ping-pong listener")?;
        let addr = listener.local_addr()?;
        let server = std::thread::Builder::new()
            .name("bare-pingpong".into())
            .spawn(move || serve_pingpong(&listener, shape))
            .context("spawn the ping-pong server")?;
        PingPong::connect(addr.port(), shape, Server::Thread(server))
    }

    /// A ping-pong with a server process.
    fn start_process(shape: Shape) -> anyhow::Result<PingPong> {
        let exe = std::env::current_exe().context("find this executable")?;
        let mut child = Command::new(exe)
            .env(
                SERVER_ENV,
                format!(
                    "{},{},{},{}",
                    shape.request, shape.header, shape.reply, shape.window
                ),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("start a ping-pong server process")?;
        let mut line = String::new();
        let read = child
            .stdout
            .take()
            .map(|out| io::BufReader::new(out).read_line(&mut line));
        let port = match (read, line.trim().parse::<u16>()) {
            (Some(Ok(_)), Ok(port)) => port,
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the ping-pong server process did not say its port (said {line:?})");
            }
        };
        PingPong::connect(port, shape, Server::Process(child))
    }

    fn connect(port: u16, shape: Shape, server: Server) -> anyhow::Result<PingPong> {
        let stream =
            TcpStream::connect(("127.0.0.1", port)).context("connect to the ping-pong server")?;
        stream.set_nodelay(true)?;
        Ok(PingPong {
            stream,
            request: vec![0x5au8; shape.request],
            header: vec![0u8; shape.header],
            reply: vec![0u8; shape.reply],
            server: Some(server),
        })
    }

    /// The server process's id (`None` for a server thread).
    fn server_pid(&self) -> Option<u32> {
        match &self.server {
            Some(Server::Process(child)) => Some(child.id()),
            _ => None,
        }
    }

    fn round_trip(&mut self) -> io::Result<()> {
        self.stream.write_all(&self.request)?;
        if !self.header.is_empty() {
            self.stream.read_exact(&mut self.header)?;
        }
        self.stream.read_exact(&mut self.reply)
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.stream.shutdown(std::net::Shutdown::Write)?;
        match self.server.take() {
            Some(Server::Thread(t)) => t
                .join()
                .map_err(|_| anyhow::anyhow!("the ping-pong server panicked"))?
                .context("ping-pong server")?,
            Some(Server::Process(mut child)) => {
                let status = child
                    .wait()
                    .context("wait for the ping-pong server process")?;
                ensure!(
                    status.success(),
                    "the ping-pong server process exited with {status}"
                );
            }
            None => {}
        }
        Ok(())
    }
}

impl Drop for PingPong {
    fn drop(&mut self) {
        // Only on an error path: `finish` takes the server.
        if let Some(Server::Process(mut child)) = self.server.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A loopback TCP connection to a thread that, asked for n bytes (an 8-byte request), writes
/// them in [`LARGE`] pieces, taken in turn from a buffer of `window` bytes (a region-sized one
/// makes the sender read memory that is not in cache, as the daemon does).
struct Streamer {
    stream: TcpStream,
    buf: Vec<u8>,
    server: Option<JoinHandle<io::Result<()>>>,
}

impl Streamer {
    fn start(window: usize) -> anyhow::Result<Streamer> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the stream listener")?;
        let addr = listener.local_addr()?;
        let server = std::thread::Builder::new()
            .name("bare-stream".into())
            .spawn(move || -> io::Result<()> {
                let (mut s, _) = listener.accept()?;
                s.set_nodelay(true)?;
                // A non-zero fill touches every page up front.
                let source = vec![0xa5u8; window.max(LARGE) / LARGE * LARGE];
                let mut at = 0;
                let mut ask = [0u8; 8];
                loop {
                    match s.read_exact(&mut ask) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                        Err(e) => return Err(e),
                    }
                    let mut left = u64::from_le_bytes(ask) as usize;
                    while left > 0 {
                        let n = left.min(LARGE);
                        s.write_all(&source[at..at + n])?;
                        at = (at + LARGE) % source.len();
                        left -= n;
                    }
                }
            })
            .context("spawn the stream server")?;
        let stream = TcpStream::connect(addr).context("connect to the stream server")?;
        stream.set_nodelay(true)?;
        Ok(Streamer {
            stream,
            buf: vec![0u8; LARGE],
            server: Some(server),
        })
    }

    /// Receives `total` bytes in [`LARGE`] reads; returns the time taken.
    fn receive(&mut self, total: usize) -> io::Result<Duration> {
        let start = Instant::now();
        self.stream.write_all(&(total as u64).to_le_bytes())?;
        let mut left = total;
        while left > 0 {
            let n = left.min(LARGE);
            self.stream.read_exact(&mut self.buf[..n])?;
            left -= n;
        }
        Ok(start.elapsed())
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.stream.shutdown(std::net::Shutdown::Write)?;
        if let Some(server) = self.server.take() {
            server
                .join()
                .map_err(|_| anyhow::anyhow!("the stream server panicked"))?
                .context("stream server")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- regions helpers

/// Where the chunks of a region live: its decoded map entries.
struct Placement {
    entries: Vec<MapEntry>,
}

impl Placement {
    /// The map of `ino`, checking that every chunk of the first `bytes` lives on `host`.
    fn fetch(client: &Client, ino: u64, bytes: usize, host: u32) -> anyhow::Result<Placement> {
        let info: v1::RegionInfo = client
            .manager()
            .get_map(client.caller(), ino, 0)
            .context("get the region map")?;
        ensure!(info.map_included, "the manager left the map out");
        let chunks = bytes.div_ceil(CHUNK_SIZE as usize);
        ensure!(
            info.map.len() >= chunks,
            "the map has {} entries, the region needs {chunks}",
            info.map.len()
        );
        let mut entries = Vec::with_capacity(chunks);
        for (i, raw) in info.map.iter().take(chunks).enumerate() {
            let entry = MapEntry::decode(*raw).with_context(|| format!("chunk {i} has no pool"))?;
            let pool = info
                .pools
                .iter()
                .find(|p| p.gid == entry.gid)
                .with_context(|| format!("chunk {i} names pool {}, not in the reply", entry.gid))?;
            ensure!(
                pool.host_id == host,
                "chunk {i} is in pool {} on host {}, not on host {host} as hostalloc asked",
                entry.gid,
                pool.host_id
            );
            entries.push(entry);
        }
        Ok(Placement { entries })
    }

    /// The span of `len` bytes at `offset`, which must not cross a chunk.
    fn span(&self, offset: u64, len: u64) -> Span {
        let entry = self.entries[(offset / CHUNK_SIZE) as usize];
        let within = offset % CHUNK_SIZE;
        assert!(within + len <= CHUNK_SIZE, "span crosses a chunk");
        Span {
            ino: 0,
            region_offset: offset,
            pool: entry.gid,
            pool_offset: entry.pool_offset + within,
            len,
        }
    }
}

/// Creates region `name` of `data.len()` bytes held by `host`, fills it with `data` through
/// `client`, and returns its inode.
fn create_filled(client: &Client, name: &str, host: u32, data: &[u8]) -> anyhow::Result<u64> {
    let attrs = v1::RegionAttrOverrides {
        hostalloc: Some(host.to_string()),
        ..Default::default()
    };
    let attr = client
        .create_path(name, 0o644, Some(attrs), data.len() as u64)
        .with_context(|| format!("create {name} on host {host}"))?;
    let region = client
        .open(attr.ino, true)
        .with_context(|| format!("open {name} for writing"))?;
    region
        .set_len(data.len() as u64)
        .with_context(|| format!("set the size of {name}"))?;
    for (i, piece) in data.chunks(WRITE_PIECE).enumerate() {
        region
            .write_at((i * WRITE_PIECE) as u64, piece)
            .with_context(|| format!("write {name} at {}", i * WRITE_PIECE))?;
    }
    region.close().with_context(|| format!("close {name}"))?;
    Ok(attr.ino)
}

/// Reads samples of `region` back and compares them with `data`: the first and last
/// [`LARGE`] bytes and 32 random 4 KiB pieces.
fn verify_sample(
    region: &Region,
    data: &[u8],
    rng: &mut SmallRng,
    what: &str,
) -> anyhow::Result<()> {
    let mut ranges = vec![(0, LARGE.min(data.len()))];
    ranges.push((data.len() - LARGE.min(data.len()), LARGE.min(data.len())));
    for _ in 0..32 {
        let at = rng.random_range(0..data.len() - SMALL);
        ranges.push((at, SMALL));
    }
    let mut buf = vec![0u8; LARGE];
    for (at, len) in ranges {
        let n = region
            .read_at(at as u64, &mut buf[..len])
            .with_context(|| format!("{what}: read back {len} bytes at {at}"))?;
        ensure!(n == len, "{what}: read back {n} bytes at {at}, asked {len}");
        check_equal(&buf[..len], &data[at..at + len], at, what)?;
    }
    Ok(())
}

/// Fails loudly when bytes read at region offset `at` differ from what was written.
fn check_equal(got: &[u8], want: &[u8], at: usize, what: &str) -> anyhow::Result<()> {
    if got != want {
        let first = got
            .iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len()));
        bail!(
            "{what}: DATA MISMATCH reading {} bytes at region offset {at}: first difference at \
             offset {} (read {:#04x}, wrote {:#04x})",
            got.len(),
            at + first,
            got.get(first).copied().unwrap_or_default(),
            want.get(first).copied().unwrap_or_default()
        );
    }
    Ok(())
}

/// Random [`SMALL`]-aligned offsets of 4 KiB reads within `bytes`.
fn small_offsets(rng: &mut SmallRng, bytes: usize, n: usize) -> Vec<u64> {
    (0..n)
        .map(|_| (rng.random_range(0..bytes / SMALL) * SMALL) as u64)
        .collect()
}

// ---------------------------------------------------------------- results

/// One row of the final table.
struct Row {
    name: String,
    regions: String,
    baseline: String,
    ratio: f64,
    target: String,
    met: bool,
}

fn print_table(rows: &[Row], quick: bool) {
    let w = rows
        .iter()
        .map(|r| r.name.len())
        .max()
        .unwrap_or(10)
        .max(11);
    println!();
    println!(
        "| {:<w$} | {:>16} | {:>16} | {:>6} | {:<22} | {:<4} |",
        "measurement", "regions", "baseline", "ratio", "target", "met?"
    );
    println!(
        "|{:-<a$}|{:->18}|{:->18}|{:->8}|{:-<24}|{:-<6}|",
        "",
        "",
        "",
        "",
        "",
        "",
        a = w + 2
    );
    for r in rows {
        let met = match (quick, r.met) {
            (true, _) => "n/a",
            (false, true) => "yes",
            (false, false) => "NO",
        };
        println!(
            "| {:<w$} | {:>16} | {:>16} | {:>6.2} | {:<22} | {:<4} |",
            r.name, r.regions, r.baseline, r.ratio, r.target, met
        );
    }
    if quick {
        println!(
            "\n(smoke run: BENCH_QUICK or no --bench; sizes are tiny and targets are not judged)"
        );
    }
}

// ---------------------------------------------------------------- the measurements

/// What measurements 1 to 3 read, and with what.
#[derive(Clone, Copy)]
struct Remote<'a> {
    /// The host-1 client (tcp only) that opened `region`.
    client: &'a Client,
    /// The host-2 region, opened by a host-1 client (tcp only).
    region: &'a Region,
    /// A transport of its own to host 2's daemon.
    raw: &'a TcpTransport,
    placement: &'a Placement,
    /// What the region holds.
    data: &'a [u8],
    meter: &'a CpuMeter,
}

/// Measurement 1: 4 KiB read latency.
fn small_read_latency(
    p: &Params,
    remote: Remote<'_>,
    rng: &mut SmallRng,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let Remote {
        client,
        region,
        raw,
        placement,
        data,
        meter,
    } = remote;
    let mut bare = PingPong::start(Shape::plain(SMALL, SMALL))?;
    // Diagnostic: a bare exchange shaped like a transport READ (64-byte request; 64-byte header
    // and 4 KiB from a random place of a region-sized buffer; header read on its own).
    let mut shaped = PingPong::start(Shape {
        request: FRAME_HEADER,
        header: FRAME_HEADER,
        reply: SMALL,
        window: data.len(),
    })?;
    // Diagnostic: the same with the server in another process, as the daemon is.
    let mut shaped_process = PingPong::start_process(Shape {
        request: FRAME_HEADER,
        header: FRAME_HEADER,
        reply: SMALL,
        window: data.len(),
    })?;
    let server_process = shaped_process.server_pid();
    let mut buf = vec![0u8; SMALL];
    // One 4 KiB read of each kind; the regions ones return the region offset they read.
    const NAMES: [&str; 5] = [
        "Region::read_at (no local segment)",
        "TcpTransport::read, one span",
        "bare TCP 4 KiB ping-pong (threads)",
        "diag: bare READ-shaped, threads",
        "diag: bare READ-shaped, 2 processes",
    ];
    let mut op = |kind: usize, at: u64, buf: &mut [u8]| -> anyhow::Result<()> {
        match kind {
            0 => {
                let n = region.read_at(at, buf)?;
                ensure!(n == SMALL, "read_at returned {n} bytes");
            }
            1 => raw.read(&[placement.span(at, SMALL as u64)], buf)?,
            2 => bare.round_trip()?,
            3 => shaped.round_trip()?,
            _ => shaped_process.round_trip()?,
        }
        Ok(())
    };
    // Warm-up: connections, caches, branch predictors.
    let warm = (p.latency_iters / 5).max(50);
    for at in small_offsets(rng, data.len(), warm) {
        for kind in 0..NAMES.len() {
            op(kind, at, &mut buf)?;
        }
    }
    // Each run times `latency_iters` reads of each kind, alternating the kinds every
    // LATENCY_BLOCK reads, so that whatever else the machine does meanwhile weighs on all alike.
    let requests_before = requests_sent(client);
    let mut runs: [Vec<Latency>; 5] = Default::default();
    let mut cpu = [Cpu::default(); 5];
    for _ in 0..p.runs {
        let mut samples: [Vec<Duration>; 5] =
            std::array::from_fn(|_| Vec::with_capacity(p.latency_iters));
        let mut done = 0;
        while done < p.latency_iters {
            let block = LATENCY_BLOCK.min(p.latency_iters - done);
            for kind in 0..NAMES.len() {
                let mark = match (kind, server_process) {
                    (4, Some(pid)) => meter.start_for(pid),
                    _ => meter.start(),
                };
                for at in small_offsets(rng, data.len(), block) {
                    let t = Instant::now();
                    op(kind, at, &mut buf)?;
                    samples[kind].push(t.elapsed());
                    // Every regions read is checked, outside the timed call.
                    if kind < 2 {
                        let at = at as usize;
                        check_equal(&buf, &data[at..at + SMALL], at, NAMES[kind])?;
                    }
                }
                cpu[kind] += meter.stop(mark);
            }
            done += block;
        }
        for (kind, s) in samples.iter_mut().enumerate() {
            runs[kind].push(Latency::of(s));
        }
    }
    bare.finish()?;
    shaped.finish()?;
    shaped_process.finish()?;

    let [r, t, b, d, e] = std::array::from_fn(|kind| Latency::median(&runs[kind]));
    let ops = p.runs * p.latency_iters;
    let requests = requests_sent(client) - requests_before;
    ensure!(
        requests == ops as u64,
        "{ops} 4 KiB read_at calls sent {requests} transport requests, not one each"
    );
    println!(
        "\n1. 4 KiB READ latency, host 1 -> host 2 daemon over loopback tcp ({} runs x {} reads, median run)",
        p.runs, p.latency_iters
    );
    for (kind, l) in [r, t, b, d, e].iter().enumerate() {
        println!(
            "{}\n{:>40} CPU per read: {}",
            l.row(NAMES[kind], &runs[kind]),
            "",
            cpu[kind].per_op(ops)
        );
    }
    println!(
        "  p50 ratios to bare: read_at {:.2}, TcpTransport::read {:.2}; diagnostics: READ-shaped {:.2}, \
         READ-shaped across processes {:.2}",
        r.p50 / b.p50,
        t.p50 / b.p50,
        d.p50 / b.p50,
        e.p50 / b.p50,
    );
    println!(
        "  p50 steps: READ shape and random memory {:+.1} µs, other process {:+.1} µs, daemon + \
         TcpTransport {:+.1} µs, Region::read_at {:+.1} µs",
        d.p50 - b.p50,
        e.p50 - d.p50,
        t.p50 - e.p50,
        r.p50 - t.p50
    );
    for (name, l) in [
        ("4 KiB read p50, Region::read_at", r),
        ("4 KiB read p50, TcpTransport::read", t),
    ] {
        let ratio = l.p50 / b.p50;
        rows.push(Row {
            name: name.into(),
            regions: format!("{:.1} µs", l.p50),
            baseline: format!("{:.1} µs", b.p50),
            ratio,
            target: "ratio <= 1.3".into(),
            met: ratio <= 1.3,
        });
    }
    Ok(())
}

/// Measurement 2: 1 MiB sequential read throughput.
fn large_read_throughput(
    p: &Params,
    remote: Remote<'_>,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let Remote {
        client,
        region,
        data,
        meter,
        ..
    } = remote;
    let mut bare = Streamer::start(data.len())?;
    // Diagnostic: the same stream from one 1 MiB buffer, which stays in cache.
    let mut hot = Streamer::start(LARGE)?;
    let mut buf = vec![0u8; LARGE];
    let pieces = data.len() / LARGE;
    let mut next = 0usize;
    let mut read_run = |bytes: usize| -> anyhow::Result<Duration> {
        let start = Instant::now();
        let mut last = 0;
        for _ in 0..bytes / LARGE {
            last = next * LARGE;
            let n = region.read_at(last as u64, &mut buf)?;
            ensure!(n == LARGE, "read_at returned {n} bytes");
            next = (next + 1) % pieces;
        }
        let elapsed = start.elapsed();
        check_equal(&buf, &data[last..last + LARGE], last, "1 MiB read_at")?;
        Ok(elapsed)
    };
    // Warm-up: one pass over the region, and as much through the bare stream.
    read_run(data.len())?;
    bare.receive(data.len())?;
    hot.receive(data.len())?;
    let (mut via_region, mut via_bare, mut via_hot) = (Vec::new(), Vec::new(), Vec::new());
    let mut cpu = [Cpu::default(); 3];
    let requests_before = requests_sent(client);
    for _ in 0..p.runs {
        let mark = meter.start();
        via_region.push(gbps(p.stream_bytes, read_run(p.stream_bytes)?));
        cpu[0] += meter.stop(mark);
        let mark = meter.start();
        via_bare.push(gbps(p.stream_bytes, bare.receive(p.stream_bytes)?));
        cpu[1] += meter.stop(mark);
        let mark = meter.start();
        via_hot.push(gbps(p.stream_bytes, hot.receive(p.stream_bytes)?));
        cpu[2] += meter.stop(mark);
    }
    bare.finish()?;
    hot.finish()?;
    let (r, b, h) = (median(&via_region), median(&via_bare), median(&via_hot));
    println!(
        "\n2. 1 MiB READ throughput, host 1 -> host 2 daemon, {} MiB per run, {} runs (median run)",
        p.stream_bytes / MIB,
        p.runs
    );
    println!(
        "  Region::read_at of 1 MiB, sequential  {r:>6.2} GB/s   (runs: {})",
        list(&via_region, 2)
    );
    println!(
        "  bare TCP stream, 1 MiB reads          {b:>6.2} GB/s   (runs: {}), sender walks {} MiB",
        list(&via_bare, 2),
        data.len() / MIB
    );
    println!(
        "  diag: bare stream, one hot 1 MiB      {h:>6.2} GB/s   (runs: {}), sender reuses 1 MiB",
        list(&via_hot, 2)
    );
    let mibs = p.runs * p.stream_bytes / MIB;
    let requests = requests_sent(client) - requests_before;
    println!(
        "  transport requests per 1 MiB read_at: {:.2} (the region's 128 KiB chunks merge when \
         their pool offsets are consecutive)",
        requests as f64 / mibs as f64
    );
    println!(
        "  ratio {:.2} (to the hot stream {:.2}); CPU per MiB: read_at {}; bare {}; hot {}",
        r / b,
        r / h,
        cpu[0].per_op(mibs),
        cpu[1].per_op(mibs),
        cpu[2].per_op(mibs)
    );
    rows.push(Row {
        name: "1 MiB read throughput".into(),
        regions: format!("{r:.2} GB/s"),
        baseline: format!("{b:.2} GB/s"),
        ratio: r / b,
        target: "ratio >= 0.8".into(),
        met: r / b >= 0.8,
    });
    Ok(())
}

/// Measurement 3: 64-byte reads batched into READV.
fn batched_tiny_reads(
    p: &Params,
    remote: Remote<'_>,
    rng: &mut SmallRng,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let Remote {
        raw,
        placement,
        data,
        meter,
        ..
    } = remote;
    // Batches of random 64-byte-aligned spans, made before timing.
    let slots = data.len() / TINY;
    let batches: Vec<Vec<Span>> = (0..READV_BATCHES)
        .map(|_| {
            (0..p.readv_spans)
                .map(|_| placement.span((rng.random_range(0..slots) * TINY) as u64, TINY as u64))
                .collect()
        })
        .collect();
    // Diagnostic: spans at random places of the first 256 KiB only, which stay in cache.
    let hot_slots = (256 * KIB).min(data.len()) / TINY;
    let hot: Vec<Vec<Span>> = (0..4)
        .map(|_| {
            (0..p.readv_spans)
                .map(|_| {
                    placement.span((rng.random_range(0..hot_slots) * TINY) as u64, TINY as u64)
                })
                .collect()
        })
        .collect();
    let mut buf = vec![0u8; p.readv_spans * TINY];
    let verify = |spans: &[Span], buf: &[u8]| -> anyhow::Result<()> {
        for (i, s) in spans.iter().enumerate() {
            let at = s.region_offset as usize;
            check_equal(
                &buf[i * TINY..(i + 1) * TINY],
                &data[at..at + TINY],
                at,
                "READV of 64-byte spans",
            )?;
        }
        Ok(())
    };
    // The same spans gathered from `data` in this process: the memory's own cost.
    let gather = |spans: &[Span], out: &mut [u8]| {
        for (i, s) in spans.iter().enumerate() {
            let at = s.region_offset as usize;
            out[i * TINY..(i + 1) * TINY].copy_from_slice(&data[at..at + TINY]);
        }
        std::hint::black_box(out);
    };
    let mut gathered = vec![0u8; p.readv_spans * TINY];
    let request = FRAME_HEADER + p.readv_spans * RANGE_ENTRY;
    let reply = FRAME_HEADER + p.readv_spans * TINY;
    let mut bare = PingPong::start(Shape::plain(request, reply))?;
    // Warm-up, and every batch checked once.
    for batch in batches.iter().chain(&hot) {
        raw.read(batch, &mut buf)?;
        verify(batch, &buf)?;
        gather(batch, &mut gathered);
        bare.round_trip()?;
    }
    // Runs `op` on the batches in turn for `time`; returns calls per second and their CPU.
    let timed = |batches: &[Vec<Span>],
                 time: Duration,
                 op: &mut dyn FnMut(&[Span]) -> anyhow::Result<()>| {
        let mark = meter.start();
        let start = Instant::now();
        let mut calls = 0usize;
        while start.elapsed() < time {
            op(&batches[calls % batches.len()])?;
            calls += 1;
        }
        let elapsed = start.elapsed();
        anyhow::Ok((
            calls,
            calls as f64 / elapsed.as_secs_f64(),
            meter.stop(mark),
        ))
    };
    let (mut via_raw, mut via_gather, mut via_bare) = (Vec::new(), Vec::new(), Vec::new());
    let mut via_hot = Vec::new();
    let mut cpu = [Cpu::default(); 4];
    let mut calls = [0usize; 4];
    for _ in 0..p.runs.min(3) {
        let (n, rate, c) = timed(&batches, p.readv_time, &mut |b| Ok(raw.read(b, &mut buf)?))?;
        verify(&batches[(n - 1) % batches.len()], &buf)?;
        via_raw.push(rate * p.readv_spans as f64);
        cpu[0] += c;
        calls[0] += n;

        let (n, rate, c) = timed(&batches, p.readv_time / 4, &mut |b| {
            gather(b, &mut gathered);
            Ok(())
        })?;
        via_gather.push(rate * p.readv_spans as f64);
        cpu[1] += c;
        calls[1] += n;

        let (n, rate, c) = timed(&batches, p.readv_time / 4, &mut |_| Ok(bare.round_trip()?))?;
        via_bare.push(rate * p.readv_spans as f64);
        cpu[2] += c;
        calls[2] += n;

        let (n, rate, c) = timed(&hot, p.readv_time / 4, &mut |b| Ok(raw.read(b, &mut buf)?))?;
        verify(&hot[(n - 1) % hot.len()], &buf)?;
        via_hot.push(rate * p.readv_spans as f64);
        cpu[3] += c;
        calls[3] += n;
    }
    bare.finish()?;
    let (r, g, b) = (median(&via_raw), median(&via_gather), median(&via_bare));
    println!(
        "\n3. 64-byte reads, {} random spans per READV (TcpTransport::read), host 1 -> host 2 daemon, {:?} per run",
        p.readv_spans, p.readv_time
    );
    let m = |v: &[f64]| list(&v.iter().map(|x| x / 1e6).collect::<Vec<_>>(), 2);
    let per_call = |rate: f64| p.readv_spans as f64 / rate * 1e6;
    println!(
        "  READV                                  {:>7.2} M reads/s = {:>5.0} µs per call (runs: {}); CPU per call {}",
        r / 1e6,
        per_call(r),
        m(&via_raw),
        cpu[0].per_op(calls[0])
    );
    println!(
        "  gather of the same spans from a Vec    {:>7.2} M reads/s = {:>5.0} µs per call (runs: {})",
        g / 1e6,
        per_call(g),
        m(&via_gather)
    );
    println!(
        "  bare TCP round trip of the same bytes  {:>7.2} M \"reads\"/s = {:>5.0} µs per trip (runs: {}); CPU per trip {}   ({request} B up, {reply} B down)",
        b / 1e6,
        per_call(b),
        m(&via_bare),
        cpu[2].per_op(calls[2])
    );
    let h = median(&via_hot);
    println!(
        "  diag: READV, spans within 256 KiB      {:>7.2} M reads/s = {:>5.0} µs per call (runs: {}); CPU per call {}",
        h / 1e6,
        per_call(h),
        m(&via_hot),
        cpu[3].per_op(calls[3])
    );
    println!(
        "  READV / gather = {:.2}; a READV call costs {:.0} µs over gather + bare round trip",
        r / g,
        per_call(r) - per_call(g) - per_call(b)
    );
    rows.push(Row {
        name: "64 B reads, READV of 4096".into(),
        regions: format!("{:.2} M/s", r / 1e6),
        baseline: format!("{:.2} M/s", g / 1e6),
        ratio: r / g,
        target: ">= 1.00 M reads/s".into(),
        met: r >= 1e6,
    });
    Ok(())
}

/// Measurement 4: same-host reads through the segment memfd vs memcpy.
fn local_reads(
    p: &Params,
    client: &Client,
    ino: u64,
    data: &[u8],
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let region = client.open(ino, false).context("open the host-1 region")?;
    let mut buf = vec![0u8; LARGE];
    let pieces = data.len() / LARGE;
    // Warm-up: one pass maps the segment and faults its pages into this process.
    for i in 0..pieces {
        let n = region.read_at((i * LARGE) as u64, &mut buf)?;
        ensure!(n == LARGE, "read_at returned {n} bytes");
        check_equal(
            &buf,
            &data[i * LARGE..(i + 1) * LARGE],
            i * LARGE,
            "1 MiB local read_at",
        )?;
    }
    ensure!(
        region.has_local_segment(),
        "a host-1 client with the host agent socket has no local segment for a host-1 region"
    );
    let before = client.stats();
    let mut next = 0usize;
    let mut read_run = |bytes: usize| -> anyhow::Result<Duration> {
        let start = Instant::now();
        let mut last = 0;
        for _ in 0..bytes / LARGE {
            last = next * LARGE;
            let n = region.read_at(last as u64, &mut buf)?;
            ensure!(n == LARGE, "read_at returned {n} bytes");
            next = (next + 1) % pieces;
        }
        let elapsed = start.elapsed();
        check_equal(&buf, &data[last..last + LARGE], last, "1 MiB local read_at")?;
        Ok(elapsed)
    };
    let mut copy = vec![0u8; LARGE];
    let mut cnext = 0usize;
    let mut copy_run = |bytes: usize| -> Duration {
        let start = Instant::now();
        for _ in 0..bytes / LARGE {
            copy.copy_from_slice(&data[cnext * LARGE..(cnext + 1) * LARGE]);
            std::hint::black_box(&mut copy);
            cnext = (cnext + 1) % pieces;
        }
        start.elapsed()
    };
    copy_run(data.len());
    let (mut via_region, mut via_copy) = (Vec::new(), Vec::new());
    let mut local_total = 0u64;
    for _ in 0..p.runs {
        via_region.push(gbps(p.stream_bytes, read_run(p.stream_bytes)?));
        local_total += p.stream_bytes as u64;
        via_copy.push(gbps(p.stream_bytes, copy_run(p.stream_bytes)));
    }
    let after = client.stats();
    ensure!(
        after.remote_requests == before.remote_requests,
        "same-host reads sent {} remote transport requests",
        after.remote_requests - before.remote_requests
    );
    ensure!(
        after.local_bytes_read - before.local_bytes_read == local_total,
        "local bytes read grew by {}, expected {local_total}",
        after.local_bytes_read - before.local_bytes_read
    );
    let (r, b) = (median(&via_region), median(&via_copy));
    println!(
        "\n4. same-host 1 MiB reads through the segment memfd, {} MiB per run, {} runs (median run)",
        p.stream_bytes / MIB,
        p.runs
    );
    println!(
        "  Region::read_at, local segment        {r:>6.2} GB/s   (runs: {})",
        list(&via_region, 2)
    );
    println!(
        "  copy_from_slice from a Vec            {b:>6.2} GB/s   (runs: {})",
        list(&via_copy, 2)
    );
    println!(
        "  ratio {:.2}; remote requests during the runs: {}; local bytes read: {} MiB",
        r / b,
        after.remote_requests - before.remote_requests,
        (after.local_bytes_read - before.local_bytes_read) / MIB as u64
    );
    rows.push(Row {
        name: "1 MiB same-host read (memfd)".into(),
        regions: format!("{r:.2} GB/s"),
        baseline: format!("{b:.2} GB/s"),
        ratio: r / b,
        target: "ratio >= 0.9".into(),
        met: r / b >= 0.9,
    });
    drop(region);
    Ok(())
}

/// Transport requests `client` sent so far, over tcp or RDMA.
fn requests_sent(client: &Client) -> u64 {
    let s = client.stats();
    s.remote_requests + s.rdma_requests
}

fn bench() -> anyhow::Result<()> {
    let p = Params::from_env()?;
    let total = Instant::now();
    let seed: u64 = rand::random();
    let mut rng = SmallRng::seed_from_u64(seed);

    let transport = BenchTransport::from_args()?;
    transport.export();
    let cluster = Cluster::start_with_daemon_args(
        2,
        if p.quick { "64M" } else { "1G" },
        &[],
        &transport.daemon_args(),
    )?;
    let url = cluster.manager_url();
    let mut remote_config = ClientConfig::new(&url, cluster.secret.clone(), 1);
    transport.apply(&mut remote_config);
    let remote_client = Client::connect(remote_config).context("connect a host-1 client")?;
    let mut local_config = ClientConfig::new(&url, cluster.secret.clone(), 1);
    local_config.agent_socket = Some(cluster.daemon(1)?.socket.clone());
    let local_client =
        Client::connect(local_config).context("connect a host-1 client with the host agent")?;

    let mut data = vec![0u8; p.region];
    rng.fill_bytes(&mut data);
    let t = Instant::now();
    let remote_ino = create_filled(&remote_client, "data-plane-remote", 2, &data)?;
    let remote_fill = t.elapsed();
    let t = Instant::now();
    let local_ino = create_filled(&local_client, "data-plane-local", 1, &data)?;
    let local_fill = t.elapsed();
    let local_written = local_client.stats();

    let region = remote_client
        .open(remote_ino, false)
        .context("open the host-2 region")?;
    verify_sample(&region, &data, &mut rng, "host-2 region, read over tcp")?;
    ensure!(
        !region.has_local_segment(),
        "a host-1 client has a local segment of a host-2 region"
    );
    // The host-1 region read over tcp (no agent) must hold what went in through the memfd.
    let over_tcp = remote_client
        .open(local_ino, false)
        .context("open the host-1 region over tcp")?;
    verify_sample(&over_tcp, &data, &mut rng, "host-1 region, read over tcp")?;
    drop(over_tcp);
    let placement = Placement::fetch(&remote_client, remote_ino, p.region, 2)?;
    Placement::fetch(&remote_client, local_ino, p.region, 1)?;
    let raw = TcpTransport::new(
        &cluster.daemon(2)?.addr,
        &cluster.secret,
        RetryPolicy::default(),
        Arc::new(TransportStats::default()),
    );

    println!();
    println!(
        "regions data plane: manager + 2 daemons on loopback, host-1 client, {} MiB regions, \
         transport {}, seed {seed:#x}",
        p.region / MIB,
        transport.describe()
    );
    println!(
        "cpus: {}, load average before measuring: {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average()
    );
    println!(
        "binaries: {}",
        bin_path("regions-daemon")?
            .parent()
            .map(|d| d.display().to_string())
            .unwrap_or_default()
    );
    println!(
        "filled the host-2 region over tcp at {:.2} GB/s, the host-1 region at {:.2} GB/s \
         ({} MiB through the memfd, {} MiB over tcp); samples read back match",
        gbps(p.region, remote_fill),
        gbps(p.region, local_fill),
        local_written.local_bytes_written / MIB as u64,
        local_written.remote_bytes_written / MIB as u64
    );

    let meter = CpuMeter {
        daemon: cluster.daemon(2)?.pid,
    };
    let remote = Remote {
        client: &remote_client,
        region: &region,
        raw: &raw,
        placement: &placement,
        data: &data,
        meter: &meter,
    };
    let mut rows = Vec::new();
    if p.selected(1) {
        small_read_latency(&p, remote, &mut rng, &mut rows)?;
    }
    if p.selected(2) {
        large_read_throughput(&p, remote, &mut rows)?;
    }
    if p.selected(3) {
        batched_tiny_reads(&p, remote, &mut rng, &mut rows)?;
    }
    if p.selected(4) {
        local_reads(&p, &local_client, local_ino, &data, &mut rows)?;
    }
    drop(region);
    if transport.is_rdma() {
        let s = remote_client.stats();
        ensure!(
            s.rdma_bytes_read > 0,
            "--transport rdma, but no byte went over RDMA: {s:?}"
        );
        println!(
            "over RDMA: {} requests, {} MiB read, {} MiB written (Region::read_at rows; the raw \
             TcpTransport rows and measurement 3 stay on tcp, 4 on the memfd)",
            s.rdma_requests,
            s.rdma_bytes_read / MIB as u64,
            s.rdma_bytes_written / MIB as u64
        );
    }

    print_table(&rows, p.quick);
    println!(
        "\ntotal time {:.1} s; load average at end: {} (anything else running on these CPUs shows up \
         as noise, most in the latencies)",
        total.elapsed().as_secs_f64(),
        load_average()
    );
    drop(cluster);
    Ok(())
}

fn main() -> ExitCode {
    if let Ok(spec) = std::env::var(SERVER_ENV) {
        return match pingpong_server_process(&spec) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("data_plane ping-pong server: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    for name in ["regions-manager", "regions-daemon"] {
        if let Err(e) = bin_path(name) {
            eprintln!("data_plane: {e:#}");
            eprintln!(
                "data_plane: run `cargo build --release --bins` before `cargo bench -p regions-tests --bench data_plane`"
            );
            return ExitCode::from(2);
        }
    }
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("data_plane: {e:#}");
            ExitCode::FAILURE
        }
    }
}
