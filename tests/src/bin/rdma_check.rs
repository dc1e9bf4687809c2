//! `regions-rdma-check DEVICE`: the RDMA transport end to end on a real device (soft-RoCE in
//! the VM of `tests/tests/rdma.rs`): a manager and three daemons (hosts 1 and 2 serving RDMA
//! on DEVICE, host 3 tcp only) and libregions clients of host 1.
//!
//! Checks, each printed as it passes:
//! - the manager lists which transports each host serves;
//! - bytes written and read back through an RDMA client go over RDMA (its tcp byte counters
//!   stay 0) and are what a tcp-only client reads;
//! - after the region is truncated and written again over tcp (its chunks released and
//!   assigned anew, so the RDMA client's keys are stale), the RDMA client reads the new
//!   bytes, and goes on over RDMA;
//! - after a truncate inside a chunk and growing back, RDMA reads zeros past the old end
//!   (the chunk's registration does not keep the punched pages);
//! - a region spread over two hosts goes over RDMA to both, and an atomic sees what RDMA
//!   wrote and RDMA sees the atomic;
//! - fetch-adds and compare-and-swaps go one-sided over RDMA while a tcp client's go to the
//!   same word at the same time, and none is lost; where the device's atomics exclude only
//!   one another (soft-RoCE), the daemon applies the tcp client's through its device and its
//!   host agent tells local processes not to use CPU atomics;
//! - with `auto`, a region on the tcp-only host is served over tcp; with `rdma` only, the
//!   same request fails and says why;
//! - applications (capability connections, through the host agent) read, write and apply
//!   atomics over RDMA, and the mutex and barrier fast paths go over RDMA;
//! - a capability connection's keys are memory windows: they reach the capability's bytes
//!   only, with its rights, through its own queue pair only, and stop working when the
//!   capability is revoked (a shrinking truncate) or expires;
//! - a read from a daemon that was killed fails (`EIO`) within the bound.
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

    let rdma = client(&cluster, 1, TransportChoice::Rdma, device)?;
    let tcp = client(&cluster, 1, TransportChoice::Tcp, device)?;

    // 0. The manager knows which transports each host serves (`.regions/hosts`, status).
    let served: Vec<(u32, String)> = tcp
        .manager()
        .list_hosts()?
        .into_iter()
        .map(|h| (h.host_id, h.transports))
        .collect();
    let rdma_too = format!("tcp rdma:{device}");
    ensure!(
        served
            == vec![
                (1, rdma_too.clone()),
                (2, rdma_too.clone()),
                (3, "tcp".to_owned())
            ],
        "hosts report transports {served:?}"
    );
    println!("hosts report their transports ({served:?}): ok");

    // 1. Write and read back over RDMA; a tcp client reads the same bytes.
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

    // For information (not a check): 64 KiB reads of the region, RDMA against tcp, in this
    // VM (software emulation: the ratio, not the times, says something).
    for (name, c) in [("rdma", &rdma), ("tcp", &tcp)] {
        let r = c.open(attr.ino, false)?;
        let mut piece = vec![0u8; 64 << 10];
        let mut times = Vec::new();
        for i in 0..40u64 {
            let t = std::time::Instant::now();
            r.read_at((i % 48) * (64 << 10), &mut piece)?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "measured: 64 KiB read over {name}: p50 {:.0} us",
            times[times.len() / 2]
        );
    }

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
    // The stale key broke the queue pair (that read went over tcp); after the back-off
    // (0.1 s) reads go over RDMA again.
    let before = rdma.stats().rdma_bytes_read;
    let mut back_on_rdma = false;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        ensure!(reader.read_at(0, &mut now)? == LEN, "short read");
        ensure!(now == fresh, "a later read differs");
        if rdma.stats().rdma_bytes_read > before {
            back_on_rdma = true;
            break;
        }
    }
    ensure!(
        back_on_rdma,
        "reads did not go back to RDMA after the rewrite: {:?}",
        rdma.stats()
    );
    println!("after a truncate and rewrite elsewhere the RDMA client reads the new bytes: ok");

    // 2b. A truncate inside a chunk punches the pages past the new end out of region memory;
    // the chunk's registration (made for the reads above) must not keep reaching the old
    // pages: after growing again, the RDMA client reads zeros there, as tcp does.
    let writer = tcp.open(attr.ino, true)?;
    writer.set_len(100)?;
    writer.set_len(8192)?;
    drop(writer);
    let mut head = vec![0xffu8; 8192];
    let mut zeros_over_rdma = false;
    for _ in 0..50 {
        ensure!(
            reader.read_at(0, &mut head)? == 8192,
            "short read after the truncate"
        );
        ensure!(
            head[..100] == fresh[..100] && head[100..].iter().all(|&b| b == 0),
            "after a truncate to 100 bytes and growing back, bytes past 100 read {:?}",
            &head[100..116]
        );
        let before = rdma.stats().rdma_bytes_read;
        reader.read_at(0, &mut head)?;
        if rdma.stats().rdma_bytes_read > before {
            ensure!(
                head[100..].iter().all(|&b| b == 0),
                "over RDMA, bytes past a truncate read {:?}",
                &head[100..116]
            );
            zeros_over_rdma = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(
        zeros_over_rdma,
        "reads never went over RDMA after the truncate"
    );
    println!("after a truncate inside a chunk, RDMA reads zeros past the end: ok");

    // 3. A region spread over hosts 1 and 2 (2 MiB extents, each host's daemon its own queue
    // pair); then an atomic (over tcp) sees what RDMA wrote.
    let spread = rdma.create_path(
        "spread",
        0o644,
        Some(v1::RegionAttrOverrides {
            hostalloc: Some("1,2".into()),
            multihosted: Some(true),
            ..Default::default()
        }),
        0,
    )?;
    let wide = rdma.open(spread.ino, true)?;
    let big = pattern(8 << 20, 29);
    let before = rdma.stats();
    wide.write_at(0, &big)?;
    let mut again = vec![0u8; big.len()];
    ensure!(wide.read_at(0, &mut again)? == big.len(), "short read");
    ensure!(
        again == big,
        "a region over two hosts read back other bytes"
    );
    let after = rdma.stats();
    ensure!(
        after.rdma_bytes_written - before.rdma_bytes_written >= big.len() as u64
            && after.rdma_bytes_read - before.rdma_bytes_read >= big.len() as u64
            && after.remote_bytes_read == before.remote_bytes_read
            && after.remote_bytes_written == before.remote_bytes_written,
        "a region over two hosts did not go over RDMA: {before:?} then {after:?}"
    );
    let word = u64::from_le_bytes(big[(2 << 20)..(2 << 20) + 8].try_into()?);
    let old = wide.fetch_add(2 << 20, 1)?;
    ensure!(old == word, "fetch-add saw {old:#x}, RDMA wrote {word:#x}");
    let mut now8 = [0u8; 8];
    wide.read_at(2 << 20, &mut now8)?;
    ensure!(
        u64::from_le_bytes(now8) == word.wrapping_add(1),
        "RDMA read does not see the fetch-add"
    );
    println!("a region over two hosts over RDMA, and atomics see its bytes: ok");

    atomics(&cluster, &rdma, &tcp, device)?;

    // 4. A tcp-only daemon: auto falls back, rdma-only says why.
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

    // 4b. Applications over RDMA, and what their keys (memory windows) can reach.
    applications(&cluster, &rdma, device)?;
    windows(&cluster, &rdma, device)?;

    // 5. A dead daemon: a request to it fails (EIO) within the bound, RDMA or not.
    let doomed = rdma.create_path("doomed", 0o644, on_host(2), 0)?;
    let d = rdma.open(doomed.ino, true)?;
    d.write_at(0, &pattern(1 << 20, 3))?;
    let mut cluster = cluster;
    let host2 = cluster
        .daemons
        .iter()
        .position(|d| d.host_id == 2)
        .context("host 2's daemon")?;
    drop(cluster.daemons.remove(host2));
    let started = std::time::Instant::now();
    let mut probe = vec![0u8; 4096];
    match d.read_at(0, &mut probe) {
        Err(e) => println!(
            "a dead daemon fails a read in {:.1} s ({e}): ok",
            started.elapsed().as_secs_f64()
        ),
        Ok(_) => bail!("a read from a dead daemon succeeded"),
    }
    ensure!(
        started.elapsed() < Duration::from_secs(30),
        "a read from a dead daemon took {:?}",
        started.elapsed()
    );
    Ok(())
}

/// Section 3b: one-sided atomics racing tcp ones on one word of host 2.
fn atomics(cluster: &Cluster, rdma: &Client, tcp: &Client, device: &str) -> anyhow::Result<()> {
    use regions::agent::AgentClient;
    use regions_verbs::AtomicScope;
    const N: u64 = 300;
    let scope = regions_verbs::Device::open(Some(device), 0)?.atomic_scope();
    ensure!(scope != AtomicScope::None, "{device} performs no atomics");
    let through_device = scope == AtomicScope::Device;
    let socket = &cluster
        .daemons
        .iter()
        .find(|d| d.host_id == 2)
        .context("host 2's daemon")?
        .socket;
    let attr = rdma.create_path("counter", 0o644, on_host(2), 0)?;
    let one_sided = rdma.open(attr.ino, true)?;
    one_sided.write_at(0, &[0u8; 64])?;
    let over_tcp = tcp.open(attr.ino, true)?;
    let device_before = AgentClient::connect(socket)?.stats()?.device_atomics;
    let rdma_before = rdma.stats().rdma_atomics;
    std::thread::scope(|s| -> anyhow::Result<()> {
        let a = s.spawn(|| -> regions::Result<()> {
            for _ in 0..N {
                one_sided.fetch_add(8, 1)?;
            }
            Ok(())
        });
        let b = s.spawn(|| -> regions::Result<()> {
            for _ in 0..N {
                over_tcp.fetch_add(8, 1)?;
            }
            Ok(())
        });
        a.join()
            .map_err(|_| anyhow::anyhow!("RDMA adder panicked"))??;
        b.join()
            .map_err(|_| anyhow::anyhow!("tcp adder panicked"))??;
        Ok(())
    })?;
    let mut word = [0u8; 8];
    over_tcp.read_at(8, &mut word)?;
    ensure!(
        u64::from_le_bytes(word) == 2 * N,
        "{} fetch-adds over RDMA and {N} over tcp at once left {} (updates lost)",
        N,
        u64::from_le_bytes(word)
    );
    ensure!(
        one_sided.compare_and_swap(8, 2 * N, 7)? == 2 * N
            && over_tcp.compare_and_swap(8, 7, 9)? == 7
            && one_sided.compare_and_swap(8, 7, 11)? == 9
            && over_tcp.fetch_add(8, 0)? == 9,
        "compare-and-swaps over RDMA and tcp do not see each other"
    );
    let rdma_atomics = rdma.stats().rdma_atomics - rdma_before;
    ensure!(
        rdma_atomics == N + 2,
        "{rdma_atomics} atomics went over RDMA (expected {})",
        N + 2
    );
    let device_atomics = AgentClient::connect(socket)?.stats()?.device_atomics - device_before;
    let expected = if through_device { N + 2 } else { 0 };
    ensure!(
        device_atomics == expected,
        "the daemon applied {device_atomics} tcp atomics through its device (atomics \
         {scope:?}: expected {expected})"
    );
    let segment = AgentClient::connect(socket)?
        .segment(attr.ino, true)?
        .context("no segment of the counter on its host")?;
    ensure!(
        segment.atomics_through_daemon == through_device,
        "the host agent says atomics through the daemon: {} (device atomics {scope:?})",
        segment.atomics_through_daemon
    );
    println!(
        "atomics ({scope:?}): {N} fetch-adds over RDMA and {N} over tcp at once, none lost; \
         {device_atomics} tcp atomics applied through the device; local processes told \
         {}: ok",
        if through_device {
            "to send atomics to the daemon"
        } else {
            "they may use CPU atomics"
        }
    );
    Ok(())
}

/// Section 4b, through the library: a process of host 1 opens regions held by host 2 through
/// host 1's agent (a capability, no cluster secret) and reads, writes and applies atomics over
/// RDMA; the mutex and barrier fast paths go over RDMA.
fn applications(cluster: &Cluster, rdma: &Client, device: &str) -> anyhow::Result<()> {
    use regions::Region;
    use regions::sync::SyncClient;
    // SAFETY: set before any thread of this process reads the environment for it.
    unsafe {
        std::env::set_var("REGIONS_TRANSPORT", "rdma");
        std::env::set_var("REGIONS_RDMA_DEVICE", device);
    }
    let socket = cluster.daemon(1)?.socket.clone();
    let attr = rdma.create_path("app", 0o644, on_host(2), 0)?;
    let data = pattern(1 << 20, 41);
    rdma.open(attr.ino, true)?.write_at(0, &data)?;

    let reader = Region::open_ino(&socket, attr.ino, false)?;
    let mut back = vec![0u8; data.len()];
    ensure!(reader.read_at(0, &mut back)? == data.len(), "short read");
    ensure!(back == data, "an application read other bytes over RDMA");
    let s = reader.stats();
    ensure!(
        s.rdma_bytes_read >= data.len() as u64 && s.remote_bytes_read == 0,
        "an application's reads did not go over RDMA: {s:?}"
    );
    let writer = Region::open_ino(&socket, attr.ino, true)?;
    let piece = pattern(64 << 10, 43);
    writer.write_at(4096, &piece)?;
    ensure!(writer.fetch_add(0, 5)? == u64::from_le_bytes(data[..8].try_into()?));
    let s = writer.stats();
    ensure!(
        s.rdma_bytes_written >= piece.len() as u64 && s.rdma_atomics == 1,
        "an application's writes and atomics did not go over RDMA: {s:?}"
    );
    let mut check = vec![0u8; piece.len()];
    rdma.open(attr.ino, false)?.read_at(4096, &mut check)?;
    ensure!(
        check == piece,
        "a node component does not see the application's RDMA write"
    );
    println!("applications read, write and apply atomics over RDMA (memory windows): ok");

    let sync = SyncClient::connect(&socket);
    sync.mutex_init("rdma-mutex")?;
    sync.mutex_lock("rdma-mutex")?;
    sync.mutex_unlock("rdma-mutex")?;
    sync.mutex_lock("rdma-mutex")?;
    let mutex_path = sync.mutex_path("rdma-mutex")?;
    sync.mutex_unlock("rdma-mutex")?;
    sync.barrier_init("rdma-barrier", 1)?;
    ensure!(sync.barrier_wait("rdma-barrier")? == 1, "first round");
    ensure!(sync.barrier_wait("rdma-barrier")? == 2, "second round");
    let barrier_path = sync.barrier_path("rdma-barrier")?;
    // Two parties: the one that waits is woken (the other's arrival was one-sided).
    sync.barrier_init("rdma-barrier-2", 2)?;
    let rounds = std::thread::scope(|s| -> anyhow::Result<Vec<u64>> {
        let other = s.spawn(|| -> anyhow::Result<Vec<u64>> {
            let mine = SyncClient::connect(&socket);
            (0..20)
                .map(|_| Ok(mine.barrier_wait("rdma-barrier-2")?))
                .collect()
        });
        let here: Vec<u64> = (0..20)
            .map(|_| sync.barrier_wait("rdma-barrier-2"))
            .collect::<regions::Result<_>>()?;
        let there = other
            .join()
            .map_err(|_| anyhow::anyhow!("the other party panicked"))??;
        ensure!(
            here == there,
            "the parties saw rounds {here:?} and {there:?}"
        );
        Ok(here)
    })?;
    ensure!(
        rounds == (1..=20).collect::<Vec<u64>>(),
        "a 2-party barrier went through rounds {rounds:?}"
    );
    ensure!(
        mutex_path.starts_with("rdma ") && barrier_path.starts_with("rdma "),
        "the sync fast paths are not on RDMA: mutex {mutex_path:?}, barrier {barrier_path:?}"
    );
    println!("mutex ({mutex_path}) and barrier ({barrier_path}) fast paths over RDMA: ok");
    // SAFETY: as above; nothing else reads them now.
    unsafe {
        std::env::remove_var("REGIONS_TRANSPORT");
        std::env::remove_var("REGIONS_RDMA_DEVICE");
    }
    Ok(())
}

/// A raw transport connection that presented a capability, with a queue pair of this process
/// connected to the daemon's for it (what an application's RDMA transport does, without the
/// library's checks, to try what its keys reach).
struct CapConn {
    stream: std::net::TcpStream,
    buf: bytes::BytesMut,
    pd: std::sync::Arc<regions_verbs::ProtectionDomain>,
    qp: regions_verbs::QueuePair,
    mem: regions_verbs::RegisteredBuffer,
    next_id: u64,
}

/// What a refused request got: status and message.
type Refusal = (u32, String);

impl CapConn {
    fn open(
        daemon: &str,
        device: &str,
        cap: &regions_proto::capability::Capability,
        secret: &regions_proto::auth::Secret,
    ) -> anyhow::Result<CapConn> {
        use regions_proto::capability::CapabilityKey;
        use regions_proto::frame::Request;
        let token = CapabilityKey::from_secret(secret).mint(cap);
        let stream = std::net::TcpStream::connect(daemon)?;
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        let pd = regions_verbs::Device::open(Some(device), 0)?.protection_domain()?;
        let qp = regions_verbs::QueuePair::create(&pd, 16)?;
        let mem = regions_verbs::RegisteredBuffer::new(&pd, 1 << 16)?;
        let mut c = CapConn {
            stream,
            buf: bytes::BytesMut::new(),
            pd,
            qp,
            mem,
            next_id: 1,
        };
        let hello = c.call(
            Request::Hello {
                token: token.into(),
            }
            .to_frame(0, 7),
        )?;
        ensure!(
            hello.header.status == 0,
            "HELLO with a capability refused: {:?}",
            hello.error_message()
        );
        c.connect()?;
        Ok(c)
    }

    fn call(
        &mut self,
        mut f: regions_proto::frame::Frame,
    ) -> anyhow::Result<regions_proto::frame::Frame> {
        use regions_proto::frame::{Limits, decode_frame};
        use std::io::{Read, Write};
        f.header.request_id = self.next_id;
        self.next_id += 1;
        let mut out = bytes::BytesMut::new();
        f.encode(&mut out);
        self.stream.write_all(&out)?;
        let limits = Limits::default();
        loop {
            if let Some(f) = decode_frame(&mut self.buf, &limits)? {
                return Ok(f);
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk)?;
            ensure!(n > 0, "the daemon closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// A new queue pair of ours, connected to a new one of the daemon's (RDMA-CONNECT again:
    /// the daemon drops the old one and its windows).
    fn connect(&mut self) -> anyhow::Result<()> {
        use regions_proto::frame::Request;
        use regions_verbs::{Endpoint, QueuePair};
        self.qp = QueuePair::create(&self.pd, 16)?;
        let reply = self.call(
            Request::RdmaConnect {
                endpoint: self.qp.endpoint().to_bytes().to_vec().into(),
            }
            .to_frame(0, 7),
        )?;
        ensure!(
            reply.header.status == 0,
            "RDMA-CONNECT refused: {:?}",
            reply.error_message()
        );
        let theirs = Endpoint::from_bytes(&reply.payload[..Endpoint::LEN])?;
        self.qp.connect(&theirs)?;
        Ok(())
    }

    /// Keys for `len` bytes at `region_offset` of region `ino`, whose chunk is at
    /// `chunk_offset` of `pool`.
    fn keys(
        &mut self,
        (ino, pool, chunk_offset): (u64, u32, u64),
        region_offset: u64,
        len: u64,
        write: bool,
    ) -> anyhow::Result<std::result::Result<Vec<regions_proto::frame::RdmaChunkKey>, Refusal>> {
        use regions_proto::frame::{RdmaChunkKey, Request};
        use regions_proto::layout::CHUNK_SIZE;
        let pool_offset = chunk_offset + region_offset % CHUNK_SIZE;
        let mut f = Request::RdmaKeys {
            pool,
            offset: pool_offset,
            len,
            write,
        }
        .to_frame(0, 7);
        f.header.name_region(ino, region_offset, pool_offset);
        let reply = self.call(f)?;
        if reply.header.status != 0 {
            return Ok(Err((
                reply.header.status,
                reply.error_message().unwrap_or_default().to_owned(),
            )));
        }
        Ok(Ok(RdmaChunkKey::decode_all(&reply.payload)?))
    }

    /// The first key of [`CapConn::keys`] as a remote address and key (an error when refused).
    fn window(
        &mut self,
        at: (u64, u32, u64),
        region_offset: u64,
        len: u64,
        write: bool,
    ) -> anyhow::Result<regions_verbs::Remote> {
        let keys = self
            .keys(at, region_offset, len, write)?
            .map_err(|r| anyhow::anyhow!("keys refused: {r:?}"))?;
        let k = keys.first().context("an empty keys reply")?;
        Ok(regions_verbs::Remote {
            addr: k.addr,
            rkey: k.rkey,
        })
    }

    /// One-sided READ of `len` bytes at `remote` into our buffer; `Err` says why it failed
    /// (the queue pair is then broken: [`CapConn::connect`] again).
    fn read(
        &mut self,
        remote: regions_verbs::Remote,
        len: usize,
    ) -> std::result::Result<Vec<u8>, String> {
        use regions_verbs::{Local, Op};
        self.qp
            .execute(
                &mut self.mem,
                &[Op::Read {
                    local: Local { offset: 0, len },
                    remote,
                }],
                Duration::from_secs(5),
            )
            .map_err(|e| e.to_string())?;
        Ok(self.mem.bytes()[..len].to_vec())
    }

    fn write(
        &mut self,
        remote: regions_verbs::Remote,
        data: &[u8],
    ) -> std::result::Result<(), String> {
        use regions_verbs::{Local, Op};
        self.mem.bytes_mut()[..data.len()].copy_from_slice(data);
        self.qp
            .execute(
                &mut self.mem,
                &[Op::Write {
                    local: Local {
                        offset: 0,
                        len: data.len(),
                    },
                    remote,
                }],
                Duration::from_secs(5),
            )
            .map_err(|e| e.to_string())
    }
}

/// Section 4b, raw: what a capability connection's keys reach.
fn windows(cluster: &Cluster, rdma: &Client, device: &str) -> anyhow::Result<()> {
    use regions_proto::capability::{Capability, RIGHT_READ, RIGHT_WRITE, WHOLE_REGION, now_ms};
    use regions_verbs::Remote;
    let attr = rdma.create_path("windows", 0o644, on_host(2), 0)?;
    let data = pattern(256 << 10, 47);
    let region = rdma.open(attr.ino, true)?;
    region.write_at(0, &data)?;
    let chunk = region.chunk(0)?;
    let at = (attr.ino, chunk.pool, chunk.pool_offset);
    let now_ns = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    };
    let cap = |rights: u8, offset: u64, len: u64, ttl_ms: u64| Capability {
        ino: attr.ino,
        rights,
        expires_ms: now_ms() + ttl_ms,
        issued: now_ns(),
        offset,
        len,
        host: 1,
    };
    let daemon = chunk.addr.clone();
    // Read-only, bytes [4096, 12288) of the region.
    let mut a = CapConn::open(
        &daemon,
        device,
        &cap(RIGHT_READ, 4096, 8192, 60_000),
        &cluster.secret,
    )?;
    let keys = a
        .keys(at, 4096, 100, false)?
        .map_err(|r| anyhow::anyhow!("keys refused: {r:?}"))?;
    ensure!(
        keys.len() == 1 && keys[0].len == 8192 && keys[0].pool_offset == chunk.pool_offset + 4096,
        "the window is not the capability's bytes of the chunk: {keys:?}"
    );
    let w = Remote {
        addr: keys[0].addr,
        rkey: keys[0].rkey,
    };
    let bytes = a
        .read(w, 8192)
        .map_err(|e| anyhow::anyhow!("read in the window: {e}"))?;
    ensure!(bytes == data[4096..12288], "the window reads other bytes");
    println!("a read-only capability's window reads its 8192 bytes: ok");
    for (what, remote, len) in [
        (
            "the byte before the window",
            Remote {
                addr: w.addr - 1,
                rkey: w.rkey,
            },
            1,
        ),
        (
            "bytes past the window",
            Remote {
                addr: w.addr + 8192,
                rkey: w.rkey,
            },
            64,
        ),
        (
            "a read across its end",
            Remote {
                addr: w.addr + 8000,
                rkey: w.rkey,
            },
            400,
        ),
    ] {
        match a.read(remote, len) {
            Err(e) => println!("{what}: refused ({e}): ok"),
            Ok(_) => bail!("{what} was read through a window"),
        }
        a.connect()?;
    }
    let w = a.window(at, 4096, 100, false)?;
    match a.write(w, b"overwrite") {
        Err(e) => println!("a WRITE through a read-only window: refused ({e}): ok"),
        Ok(()) => bail!("a read-only capability's window took a WRITE"),
    }
    a.connect()?;
    for (what, offset, write) in [
        ("outside the capability", 0u64, false),
        ("write keys with a read-only capability", 4096, true),
    ] {
        match a.keys(at, offset, 100, write)? {
            Err((status, msg)) => println!("keys {what}: refused ({status}: {msg}): ok"),
            Ok(k) => bail!("keys {what} were given: {k:?}"),
        }
    }
    // Another connection's window key does not work on this queue pair (type 2B windows
    // belong to the queue pair they were bound on).
    let mut b = CapConn::open(
        &daemon,
        device,
        &cap(RIGHT_READ | RIGHT_WRITE, 0, WHOLE_REGION, 60_000),
        &cluster.secret,
    )?;
    let wa = a.window(at, 4096, 100, false)?;
    match b.read(wa, 64) {
        Err(e) => {
            println!("a window used through another connection's queue pair: refused ({e}): ok")
        }
        Ok(_) => bail!("a window worked through another connection's queue pair"),
    }
    b.connect()?;
    // The read-write capability's window takes writes; the bytes land.
    let keys = b
        .keys(at, 0, 64, true)?
        .map_err(|r| anyhow::anyhow!("write keys refused: {r:?}"))?;
    ensure!(keys[0].len == regions_proto::layout::CHUNK_SIZE, "{keys:?}");
    b.write(
        Remote {
            addr: keys[0].addr,
            rkey: keys[0].rkey,
        },
        b"window write",
    )
    .map_err(|e| anyhow::anyhow!("write through a read-write window: {e}"))?;
    let mut landed = [0u8; 12];
    region.read_at(0, &mut landed)?;
    ensure!(
        &landed == b"window write",
        "the window's WRITE did not land"
    );
    println!("a read-write capability's window takes a WRITE: ok");

    // Expiry: a window of a capability that expired stops working.
    let mut e = CapConn::open(
        &daemon,
        device,
        &cap(RIGHT_READ, 0, WHOLE_REGION, 2_500),
        &cluster.secret,
    )?;
    let we = e.window(at, 0, 64, false)?;
    e.read(we, 64)
        .map_err(|err| anyhow::anyhow!("read before expiry: {err}"))?;
    std::thread::sleep(Duration::from_millis(4_500));
    match e.read(we, 64) {
        Err(err) => println!("a window after its capability expired: refused ({err}): ok"),
        Ok(_) => bail!("a window worked after its capability expired"),
    }

    // Revocation: a shrinking truncate revokes the region's tokens; their windows go with
    // them before the truncate returns.
    let wa = a.window(at, 4096, 100, false)?;
    a.read(wa, 64)
        .map_err(|err| anyhow::anyhow!("read before the revocation: {err}"))?;
    region.set_len(200 << 10)?;
    match a.read(wa, 64) {
        Err(err) => println!("a window after its capability was revoked: refused ({err}): ok"),
        Ok(_) => bail!("a window worked after its capability was revoked"),
    }
    Ok(())
}
