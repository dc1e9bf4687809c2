//! `regions-rdma-check DEVICE`: the RDMA transport end to end on a real device (soft-RoCE in
//! the VM of `tests/tests/rdma.rs`): a manager and three daemons (hosts 1 and 2 serving RDMA
//! on DEVICE, host 3 tcp only) and libregions clients of host 1.
//!
//! Checks, each printed as it passes:
//! - bytes written and read back through an RDMA client go over RDMA (its tcp byte counters
//!   stay 0) and are what a tcp-only client reads;
//! - after the region is truncated and written again over tcp (its chunks released and
//!   assigned anew, so the RDMA client's keys are stale), the RDMA client reads the new
//!   bytes, and goes on over RDMA;
//! - with `auto`, a region on the tcp-only host is served over tcp; with `rdma` only, the
//!   same request fails and says why.
//!
//! Prints `regions-rdma-check: all passed` and exits 0, else says what failed and exits 1.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use regions::transport::tcp::RetryPolicy;
use regions::{Client, ClientConfig};
use regions_proto::transport_choice::TransportChoice;
use regions_proto::v1;
use regions_tests::{Cluster, DaemonProcess};

const LEN: usize = 3 << 20;

fn client(
    cluster: &Cluster,
    host: u32,
    transport: TransportChoice,
    device: &str,
) -> anyhow::Result<Client> {
    let mut config = ClientConfig::new(&cluster.manager_url(), cluster.secret.clone(), host);
    config.transport = transport;
    config.rdma_device = Some(device.to_owned());
    config.retry = RetryPolicy {
        deadline: Duration::from_secs(10),
        ..RetryPolicy::default()
    };
    Ok(Client::connect(config)?)
}

fn on_host(host: u32) -> Option<v1::RegionAttrOverrides> {
    Some(v1::RegionAttrOverrides {
        hostalloc: Some(host.to_string()),
        multihosted: Some(false),
        ..Default::default()
    })
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(seed) ^ (i >> 12) as u8)
        .collect()
}

fn main() -> ExitCode {
    let device = std::env::args().nth(1).unwrap_or_else(|| "rxe0".into());
    match run(&device) {
        Ok(()) => {
            println!("regions-rdma-check: all passed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("regions-rdma-check: FAILED: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(device: &str) -> anyhow::Result<()> {
    let cluster = Cluster::start_with_daemon_args(
        2,
        "64M",
        &[],
        &["--transport", "rdma", "--rdma-device", device],
    )
    .context("start the cluster")?;
    let tcp_host = DaemonProcess::start_with_args(
        cluster.manager.addr,
        &cluster.secret_file,
        3,
        "64M",
        cluster.dir.path(),
        &["--transport", "tcp"],
    )
    .context("start the tcp-only daemon")?;

    // 1. Write and read back over RDMA; a tcp client reads the same bytes.
    let rdma = client(&cluster, 1, TransportChoice::Rdma, device)?;
    let tcp = client(&cluster, 1, TransportChoice::Tcp, device)?;
    let attr = rdma.create_path("r", 0o644, on_host(2), 0)?;
    let region = rdma.open(attr.ino, true)?;
    let data = pattern(LEN, 7);
    for (i, piece) in data.chunks(1 << 20).enumerate() {
        region.write_at((i << 20) as u64, piece)?;
    }
    let mut back = vec![0u8; LEN];
    ensure!(region.read_at(0, &mut back)? == LEN, "short read");
    ensure!(back == data, "RDMA read returned other bytes than written");
    let stats = rdma.stats();
    ensure!(
        stats.rdma_bytes_written >= LEN as u64 && stats.rdma_bytes_read >= LEN as u64,
        "bytes did not go over RDMA: {stats:?}"
    );
    ensure!(
        stats.remote_bytes_read == 0 && stats.remote_bytes_written == 0,
        "bytes went over tcp: {stats:?}"
    );
    let other = tcp.open(attr.ino, false)?;
    let mut seen = vec![0u8; LEN];
    ensure!(other.read_at(0, &mut seen)? == LEN, "short tcp read");
    ensure!(seen == data, "a tcp client reads other bytes");
    ensure!(tcp.stats().rdma_requests == 0, "the tcp client used RDMA");
    println!("write and read back over RDMA, a tcp client sees the same bytes: ok");

    // 2. Truncate and rewrite over tcp: chunks are released and assigned anew, the RDMA
    // client's keys are stale; it must read the new bytes, and go on over RDMA.
    let writer = tcp.open(attr.ino, true)?;
    writer.set_len(0)?;
    let fresh = pattern(LEN, 13);
    writer.write_at(0, &fresh)?;
    drop(writer);
    let reader = rdma.open(attr.ino, false)?;
    let mut now = vec![0u8; LEN];
    ensure!(
        reader.read_at(0, &mut now)? == LEN,
        "short read after rewrite"
    );
    ensure!(
        now == fresh,
        "the RDMA client read stale bytes after the region was rewritten"
    );
    let before = rdma.stats().rdma_bytes_read;
    ensure!(reader.read_at(0, &mut now)? == LEN, "short read");
    ensure!(now == fresh, "second read differs");
    ensure!(
        rdma.stats().rdma_bytes_read > before,
        "reads did not go back to RDMA after the rewrite: {:?}",
        rdma.stats()
    );
    println!("after a truncate and rewrite elsewhere the RDMA client reads the new bytes: ok");

    // 3. A tcp-only daemon: auto falls back, rdma-only says why.
    let attr3 = tcp.create_path("on3", 0o644, on_host(3), 0)?;
    let w3 = tcp.open(attr3.ino, true)?;
    w3.write_at(0, b"held by a tcp-only host")?;
    drop(w3);
    let auto = client(&cluster, 1, TransportChoice::Auto, device)?;
    let r3 = auto.open(attr3.ino, false)?;
    let mut small = vec![0u8; 23];
    r3.read_at(0, &mut small)?;
    ensure!(
        &small == b"held by a tcp-only host",
        "auto read other bytes"
    );
    println!("auto: a tcp-only daemon is read over tcp: ok");
    let strict = rdma.open(attr3.ino, false)?;
    match strict.read_at(0, &mut small) {
        Err(e) if e.to_string().contains("RDMA is not available") => {
            println!("rdma only: a tcp-only daemon is refused ({e}): ok");
        }
        other => bail!("rdma only against a tcp-only daemon: expected a refusal, got {other:?}"),
    }
    drop(tcp_host);
    Ok(())
}
