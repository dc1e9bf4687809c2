//! `regions-manager`: the cluster's control plane.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use regions_manager::{Config, Manager, server};
use regions_proto::auth::Secret;
use tokio::signal::unix::{SignalKind, signal};

/// The regions manager: namespace, region maps, hosts, pools and fixed
/// virtual addresses, durable under --data-dir, served over gRPC.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to serve gRPC on (port 0 picks a free port).
    #[arg(long, env = "REGIONS_MANAGER_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Directory of the durable store.
    #[arg(
        long,
        env = "REGIONS_DATA_DIR",
        default_value = "/var/lib/regions/manager"
    )]
    data_dir: PathBuf,
    /// File holding the cluster secret that every node component presents.
    #[arg(
        long,
        env = "REGIONS_SECRET_FILE",
        default_value = "/etc/regions/secret"
    )]
    secret_file: PathBuf,
    /// Milliseconds a host stays live without a heartbeat.
    #[arg(long, env = "REGIONS_LEASE_MS", default_value_t = 10_000)]
    lease_ms: u64,
    /// Seconds a transport capability lives; holders renew it at half its life, and a
    /// deleted mutex or barrier's lock-word slot is reused after it (every token for the
    /// slot has expired by then).
    #[arg(long, env = "REGIONS_CAPABILITY_TTL_SECS", default_value_t = 600)]
    capability_ttl_secs: u64,
    /// Milliseconds a mount's cache lease lasts after its last heartbeat: while it holds
    /// one on a directory's names or a file's attributes, its kernel caches them, and a
    /// change elsewhere first recalls the lease (waiting at most this and a second for a
    /// mount that does not answer). 0 grants no leases (kernels cache for a second).
    #[arg(long, env = "REGIONS_CACHE_LEASE_TERM_MS", default_value_t = regions_manager::cache_leases::DEFAULT_TERM.as_millis() as u64)]
    cache_lease_term_ms: u64,
    /// Regions that stay at most this many bytes (K suffix; at most 8160) are stored as
    /// objects packed into the daemons' object stores instead of whole 128 KiB chunks, and
    /// move to chunks when they grow past it or are mapped; 0 stores none.
    #[arg(long, env = "REGIONS_SMALL_REGIONS", default_value = "4K", value_parser = regions_proto::config::parse_size)]
    small_regions: u64,
    /// Bytes of the write-ahead log, written out in full when created: changes are durable
    /// there first, and it keeps them while the data directory is full.
    #[arg(long, env = "REGIONS_WAL_SIZE", default_value_t = regions_manager::wal::WAL_SIZE)]
    wal_size: u64,
    /// Write the bound address to this file once serving (for scripts and tests).
    #[arg(long, env = "REGIONS_READY_FILE")]
    ready_file: Option<PathBuf>,
    /// Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key. Clients then
    /// use an https:// manager URL (and --tls-ca unless a system root signed it).
    #[arg(long, env = "REGIONS_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "REGIONS_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP on this address (`GET /metrics`); off by default.
    #[arg(long, env = "REGIONS_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    #[command(flatten)]
    config: regions_proto::config::ConfigArgs,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Args = regions_proto::config::parse();
    if let Some(addr) = args.metrics_listen {
        regions_proto::metrics::serve(addr)?;
    }
    let secret = Secret::from_file(&args.secret_file)?;
    let tls = regions_proto::tls::server_config(args.tls_cert.as_deref(), args.tls_key.as_deref())?;
    if let Some(tls) = &tls {
        // Parse the certificate and key now: a bad pair stops the start, not the first call.
        tonic::transport::Server::builder()
            .tls_config(tls.clone())
            .map_err(|e| {
                let cause = std::error::Error::source(&e).map_or(String::new(), |s| format!(": {s}"));
                anyhow::anyhow!(
                    "cannot use --tls-cert/--tls-key ({e}{cause}); give a PEM certificate chain and its PEM private key"
                )
            })?;
        tracing::info!("serving gRPC over TLS");
    }
    let config = Config {
        lease: Duration::from_millis(args.lease_ms.max(100)),
        capability_ttl: Duration::from_secs(
            args.capability_ttl_secs
                .clamp(1, regions_manager::revocations::MAX_TTL.as_secs()),
        ),
        wal_size: args.wal_size,
        cache_lease_term: Duration::from_millis(args.cache_lease_term_ms),
        small_regions: args.small_regions,
        ..Config::default()
    };
    let manager = Manager::open(&args.data_dir, config)?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}: is another manager running? pick another --listen",
                args.listen
            )
        })?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, data_dir = %args.data_dir.display(), "manager serving");
    if let Some(path) = &args.ready_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, addr.to_string())
            .and_then(|()| std::fs::rename(&tmp, path))
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut durability = manager.durability();
    let mut failure = None;
    let shutdown = async {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
            state = durability.wait_for(|d| d.failed.is_some()) => {
                failure = state.ok().and_then(|d| d.failed.clone());
            }
        }
    };
    server::serve_with_tls(manager, listener, secret, tls, shutdown).await?;
    if let Some(reason) = failure {
        anyhow::bail!("stopped because the store failed: {reason}; fix the disk and restart");
    }
    tracing::info!("manager stopped");
    Ok(())
}
