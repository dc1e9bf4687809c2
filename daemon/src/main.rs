//! `regions-daemon`: this host's memory for the regions cluster
//! (docs/ARCHITECTURE.md, "Data plane").

use anyhow::Context;
use regions_daemon::config::Args;
use regions_daemon::{Config, Daemon};
use tokio::signal::unix::{SignalKind, signal};

/// What the daemon's open files stand for (logged with its open-file limit at start).
const DAEMON_DESCRIPTORS: &str = "the daemon holds one per region with memory on this host \
     and refuses new ones a sixteenth short of it";

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Args = regions_proto::config::parse();
    regions_proto::fd_limit::raise_and_report(DAEMON_DESCRIPTORS);
    regions_daemon::transport::admission::return_large_buffers_to_the_os();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("regions-daemon")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run(&args))
}

async fn run(args: &Args) -> anyhow::Result<()> {
    let config = Config::from_args(args)?;
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let daemon = tokio::select! {
        started = Daemon::start(config) => started?,
        _ = term.recv() => { tracing::info!("SIGTERM during start-up: stopping"); return Ok(()) }
        _ = int.recv() => { tracing::info!("SIGINT during start-up: stopping"); return Ok(()) }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    daemon.shutdown().await;
    Ok(())
}
