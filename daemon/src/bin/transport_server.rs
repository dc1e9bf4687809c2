//! `regions-transport-server`: the daemon's tcp transport server alone, over one memfd pool and
//! no manager, for load tests that measure the server apart from the client (its resident
//! memory, its open connections). Not a daemon: it registers nowhere and has no host agent.
//!
//! Serves pool 1 (`--pool-size`), its first chunks assigned to regions 10 and 11 (four and
//! two chunks), with the cluster secret `--secret-token`. Prints `addr ADDR` once listening,
//! then answers every line on standard input with `open N` (connections open now), and exits
//! when standard input ends.

use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use regions_daemon::pools::Pools;
use regions_daemon::stats::Stats;
use regions_daemon::transport::{TransportConfig, TransportServer};
use regions_proto::auth::Secret;
use regions_proto::layout::CHUNK_SIZE;

#[derive(Parser, Debug)]
#[command(version, about = "The tcp transport server alone, for load tests")]
struct Args {
    /// The cluster secret clients prove in the HELLO handshake.
    #[arg(long, env = "REGIONS_SECRET_TOKEN")]
    secret_token: String,
    /// Bytes of request payload buffered across connections at once.
    #[arg(long, default_value_t = 64 << 20)]
    payload_budget: u64,
    /// Size of the pool in bytes.
    #[arg(long, default_value_t = 16 * CHUNK_SIZE)]
    pool_size: u64,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
}

fn main() -> anyhow::Result<()> {
    regions_daemon::transport::admission::return_large_buffers_to_the_os();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let pools = Arc::new(Pools::new());
    pools
        .add_pool(1, args.pool_size)
        .context("create the pool")?;
    pools
        .assign(1, 0, 10, 0, 4 * CHUNK_SIZE)
        .context("assign region 10")?;
    pools
        .assign(1, 4 * CHUNK_SIZE, 11, 0, 2 * CHUNK_SIZE)
        .context("assign region 11")?;
    let stats = Arc::new(Stats::default());
    let config = TransportConfig {
        io_timeout: Duration::from_secs(5),
        max_buffered: args.payload_budget,
        ..TransportConfig::default()
    };
    let listener =
        TransportServer::bind(args.listen).with_context(|| format!("listen on {}", args.listen))?;
    let secret = Secret::new(&args.secret_token).context("the secret token")?;
    let server = TransportServer::start(listener, pools, secret, Arc::clone(&stats), config)
        .context("start the transport server")?;
    let mut out = std::io::stdout().lock();
    use std::io::Write;
    writeln!(out, "addr {}", server.local_addr())?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        line.context("read standard input")?;
        writeln!(out, "open {}", stats.connections.load(Ordering::Relaxed))?;
        out.flush()?;
    }
    Ok(())
}
