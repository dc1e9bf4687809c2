//! `regionfs`: mounts a regions cluster as a file system.
//!
//! - `regionfs mount --manager URL --host-id N --secret-file FILE MOUNTPOINT`
//!   mounts an existing cluster on this host.
//! - `regionfs up MOUNTPOINT` runs a whole single-host cluster (manager,
//!   daemon, mount) in this process.
//!
//! SIGINT or SIGTERM unmounts cleanly and stops everything.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use regionfs::fs::{CacheMode, FsOptions, RegionFs};
use regionfs::mount::{MountOptions, Mounted, prepare_mountpoint, write_ready_file};
use regions::{Client, ClientConfig};
use regions_embedded::{Cluster, UpConfig};
use regions_proto::auth::Secret;
use regions_proto::transport_choice::TransportChoice;
use tokio::signal::unix::{SignalKind, signal};

mod cluster_access;
mod compact_cli;
mod sync_cli;

/// Remote memory regions as files.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Mount a running cluster on this host.
    Mount(MountArgs),
    /// Run a single-host cluster (manager + daemon + mount) in this process.
    Up(UpArgs),
    /// Barriers, mutexes and doorbells for shell scripts (through a mount's host agent).
    Sync(sync_cli::SyncArgs),
    /// The cluster at a glance: manager health, hosts and leases, memory, regions, warnings.
    Status(StatusArgs),
    /// Compact the object stores of small regions now (every live host, or --host N) and say
    /// what each gave back.
    Compact(compact_cli::CompactArgs),
}

#[derive(Args, Debug)]
struct StatusArgs {
    #[command(flatten)]
    cluster: cluster_access::ClusterAccess,
    /// Print JSON for scripts instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    config: regions_proto::config::ConfigArgs,
}

/// Options of the mount itself, shared by both commands.
#[derive(Args, Debug, Clone)]
struct FsArgs {
    /// How the kernel caches region data: `writeback` (writes buffered in
    /// the page cache) or `passthrough` (write-through, and read-only opens
    /// of regions held on this host read their memory directly).
    #[arg(long, env = "REGIONFS_CACHE", value_enum, default_value_t = CacheMode::Writeback)]
    cache: CacheMode,
    /// Threads serving FUSE requests (at least 2).
    #[arg(long, env = "REGIONFS_THREADS", default_value_t = 4)]
    threads: usize,
    /// Bytes of a region held on other hosts that one background fill streams into the page
    /// cache once the region is read at random (K, M, G suffixes; 0 turns fills off; default:
    /// a quarter of this host's memory). Fills stop when the host runs short of memory.
    #[arg(long, env = "REGIONFS_FILL_BUDGET", value_parser = regions_proto::config::parse_size)]
    fill_budget: Option<u64>,
    /// Write the mountpoint path to this file once the mount answers.
    #[arg(long, env = "REGIONS_READY_FILE")]
    ready_file: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP on this address (`GET /metrics`; with `up`, one
    /// endpoint for the manager, the daemon and the mount); off by default.
    #[arg(long, env = "REGIONS_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

#[derive(Args, Debug)]
struct MountArgs {
    /// URL of the manager (`http://host:port`, `https://host:port` when it serves TLS; a bare
    /// `host:port` means http).
    #[arg(long, env = "REGIONS_MANAGER")]
    manager: String,
    /// CA certificate (PEM) that signed the manager's TLS certificate (https:// URLs; default:
    /// the system's roots).
    #[arg(long, env = "REGIONS_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This host's id (the one its daemon registered with).
    #[arg(long, env = "REGIONS_HOST_ID")]
    host_id: u32,
    /// File holding the cluster secret.
    #[arg(
        long,
        env = "REGIONS_SECRET_FILE",
        default_value = "/etc/regions/secret"
    )]
    secret_file: PathBuf,
    /// This host's daemon agent socket (same-host zero-copy access).
    #[arg(long, env = "REGIONS_AGENT_SOCKET")]
    agent_socket: Option<PathBuf>,
    /// How to reach daemons: `auto` (RDMA where this host and the daemon have devices on a
    /// common fabric, else tcp), `tcp`, or `rdma` only.
    #[arg(long, env = "REGIONS_TRANSPORT", value_enum, default_value_t = TransportChoice::Auto)]
    transport: TransportChoice,
    /// RDMA device to use (default: the first one).
    #[arg(long, env = "REGIONS_RDMA_DEVICE")]
    rdma_device: Option<String>,
    #[command(flatten)]
    fs: FsArgs,
    /// Where to mount (created when missing).
    #[arg(env = "REGIONFS_MOUNTPOINT")]
    mountpoint: PathBuf,
    #[command(flatten)]
    config: regions_proto::config::ConfigArgs,
}

#[derive(Args, Debug)]
struct UpArgs {
    /// Where to mount (created when missing).
    #[arg(env = "REGIONFS_MOUNTPOINT")]
    mountpoint: PathBuf,
    /// State directory: manager store, secret, agent socket.
    #[arg(long, env = "REGIONS_DATA_DIR", default_value = "/var/lib/regions")]
    data_dir: PathBuf,
    /// Memory this host offers to regions (K, M, G, T suffixes).
    #[arg(long, env = "REGIONS_MEMORY", default_value = "1G", value_parser = regions_proto::config::parse_size)]
    memory: u64,
    /// Address of the manager's gRPC service (port 0 picks a free one).
    #[arg(long, env = "REGIONS_MANAGER_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Address of the daemon's data transport (port 0 picks a free one).
    #[arg(long, env = "REGIONS_DAEMON_LISTEN", default_value = "127.0.0.1:7171")]
    transport_listen: SocketAddr,
    /// Hand every local process that may write a region a writable descriptor of its memory,
    /// not only root and this process's user (see the daemon's flag of the same name and
    /// docs/SECURITY.md).
    #[arg(long, env = "REGIONS_SHARE_WRITABLE_SEGMENTS")]
    share_writable_segments: bool,
    /// Transports the daemon serves and the mount uses: `auto` (RDMA beside tcp where a
    /// device is found), `tcp`, or `rdma` (fails to start without a device). On one host the
    /// mount reaches the memory through the memfd either way.
    #[arg(long, env = "REGIONS_TRANSPORT", value_enum, default_value_t = TransportChoice::Auto)]
    transport: TransportChoice,
    /// RDMA device to use (default: the first one).
    #[arg(long, env = "REGIONS_RDMA_DEVICE")]
    rdma_device: Option<String>,
    /// Regions that stay at most this many bytes (at most 8160) are stored as objects in the
    /// daemon's object store instead of whole 128 KiB chunks (the manager's flag of the same
    /// name); 0 stores none.
    #[arg(long, env = "REGIONS_SMALL_REGIONS", default_value = "4K", value_parser = regions_proto::config::parse_size)]
    small_regions: u64,
    #[command(flatten)]
    fs: FsArgs,
    #[command(flatten)]
    config: regions_proto::config::ConfigArgs,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,fuser=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli: Cli = regions_proto::config::parse();
    let result = match cli.command {
        Command::Mount(args) => run_mount(args),
        Command::Up(args) => run_up(args),
        Command::Sync(args) => sync_cli::run(args).map(|code| std::process::exit(code)),
        Command::Status(args) => run_status(args),
        Command::Compact(args) => compact_cli::run(&args),
    };
    if let Err(e) = result {
        tracing::error!("{e:#}");
        std::process::exit(1);
    }
}

fn manager_url(text: &str) -> String {
    if text.contains("://") {
        text.to_owned()
    } else {
        format!("http://{text}")
    }
}

fn run_mount(args: MountArgs) -> anyhow::Result<()> {
    regions_proto::fd_limit::raise_and_report(
        "the mount holds one per open file of this host's memory",
    );
    if let Some(addr) = args.fs.metrics_listen {
        regions_proto::metrics::serve(addr)?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the signal runtime")?;
    let signals = Signals::install(&runtime)?;
    let secret = Secret::from_file(&args.secret_file)?;
    let mountpoint = prepare_mountpoint(&args.mountpoint)?;
    let url = manager_url(&args.manager);
    let mut config = ClientConfig::new(&url, secret, args.host_id);
    config.agent_socket = args.agent_socket.clone();
    config.transport = args.transport;
    config.rdma_device = args.rdma_device.clone();
    config.tls_ca = args.tls_ca.clone();
    let client = Client::connect(config)
        .with_context(|| format!("cannot connect to the manager at {url}"))?;
    let ready = format!("host {} of the cluster at {url}", args.host_id);
    serve(client, &mountpoint, &args.fs, &runtime, signals, &ready)
}

/// The secret files `regionfs status` tries when none is named: a cluster's, then the one
/// `regionfs up` writes under its default data directory.
fn run_status(args: StatusArgs) -> anyhow::Result<()> {
    let (manager, _, url) = args.cluster.connect()?;
    let status = regionfs::status::Status::gather(&manager)
        .with_context(|| format!("the manager at {url} did not answer the status requests"))?;
    if args.json {
        println!("{}", status.render_json());
    } else {
        print!("{}", status.render_text());
    }
    Ok(())
}

fn run_up(args: UpArgs) -> anyhow::Result<()> {
    regions_proto::fd_limit::raise_and_report(
        "this process's daemon holds one per region with memory here (and refuses new ones a \
         sixteenth short of it), its mount one per open file",
    );
    // Before the manager and the daemon start, so that their metrics are recorded too.
    if let Some(addr) = args.fs.metrics_listen {
        regions_proto::metrics::serve(addr)?;
    }
    let mountpoint = prepare_mountpoint(&args.mountpoint)?;
    let cluster = Cluster::start(&UpConfig {
        data_dir: args.data_dir.clone(),
        memory: args.memory,
        listen: args.listen,
        transport_listen: args.transport_listen,
        share_writable_segments: args.share_writable_segments,
        transport: args.transport,
        rdma_device: args.rdma_device.clone(),
        small_regions: args.small_regions,
    })?;
    let signals = Signals::install(cluster.runtime())?;
    let client = Client::connect(cluster.client_config()).with_context(|| {
        format!(
            "cannot connect to the embedded manager at {}",
            cluster.manager_url()
        )
    })?;
    let ready = format!(
        "single-host cluster up: manager {}, host agent {}, {} of memory, state in {}; \
         other hosts join with `regions-daemon --manager {}` and the secret in {}; \
         `regionfs status --manager {} --secret-file {}` shows it; Ctrl-C stops it",
        cluster.manager_url(),
        cluster.agent_socket().display(),
        regionfs::status::bytes(args.memory),
        args.data_dir.display(),
        cluster.manager_url(),
        args.data_dir.join("secret").display(),
        cluster.manager_url(),
        args.data_dir.join("secret").display(),
    );
    let result = serve(
        client,
        &mountpoint,
        &args.fs,
        cluster.runtime(),
        signals,
        &ready,
    );
    cluster.shutdown();
    result
}

/// SIGINT and SIGTERM.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install(runtime: &tokio::runtime::Runtime) -> anyhow::Result<Signals> {
        let _guard = runtime.enter();
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
        })
    }
}

/// Mounts, writes the ready file, says on stdout that it is ready (with `what`), waits for a
/// signal or an external unmount, unmounts.
fn serve(
    client: Client,
    mountpoint: &Path,
    args: &FsArgs,
    runtime: &tokio::runtime::Runtime,
    mut signals: Signals,
    what: &str,
) -> anyhow::Result<()> {
    let options = FsOptions {
        cache: args.cache,
        fill_budget: args.fill_budget,
        ..FsOptions::default()
    };
    let core = Arc::new(RegionFs::new(client, options)?);
    let mut mounted = Mounted::mount(
        Arc::clone(&core),
        mountpoint,
        &MountOptions {
            threads: args.threads,
        },
    )?;
    if let Some(path) = &args.ready_file {
        write_ready_file(path, &format!("{}\n", mountpoint.display()))
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }
    // The one line a person starting it in a terminal waits for (logs go to stderr).
    // A closed stdout is no reason to stop serving.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready: {} is mounted; {what}", mountpoint.display());
    let _ = out.flush();
    drop(out);
    let ended = runtime.block_on(async {
        loop {
            tokio::select! {
                _ = signals.term.recv() => { tracing::info!("SIGTERM: unmounting"); return false; }
                _ = signals.int.recv() => { tracing::info!("SIGINT: unmounting"); return false; }
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if mounted.wait_ended(Duration::ZERO) {
                        return true;
                    }
                }
            }
        }
    });
    if ended {
        tracing::info!(mountpoint = %mountpoint.display(), "unmounted from outside; stopping");
    } else {
        mounted.unmount(Duration::from_secs(5))?;
    }
    drop(core);
    Ok(())
}
