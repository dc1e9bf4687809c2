//! The data plane end to end: real manager and daemon processes on
//! loopback, libregions clients with distinct host ids moving region bytes
//! over the tcp transport and through same-host segment memfds.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions::agent::AgentClient;
use regions::transport::tcp::RetryPolicy;
use regions::{Client, ClientConfig};
use regions_proto::v1;
use regions_tests::Cluster;

const MIB: usize = 1 << 20;
/// A region chunk (the grain of the map).
const CHUNK: usize = regions_proto::layout::CHUNK_SIZE as usize;

/// A client acting for host `host`; with `agent`, it may map regions held
/// on its own host.
fn client(cluster: &Cluster, host: u32, agent: bool) -> Client {
    let mut config = ClientConfig::new(&cluster.manager_url(), cluster.secret.clone(), host);
    if agent {
        config.agent_socket = Some(cluster.daemon(host).unwrap().socket.clone());
    }
    config.retry = RetryPolicy {
        deadline: Duration::from_secs(3),
        ..RetryPolicy::default()
    };
    Client::connect(config).unwrap()
}

fn on_hosts(hosts: &str, multihosted: bool) -> Option<v1::RegionAttrOverrides> {
    Some(v1::RegionAttrOverrides {
        hostalloc: Some(hosts.into()),
        multihosted: Some(multihosted),
        ..Default::default()
    })
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

fn hosts_of(client: &Client, ino: u64) -> String {
    let raw = client
        .manager()
        .getxattr(client.caller(), ino, "user.regions.hosts")
        .unwrap();
    String::from_utf8(raw).unwrap()
}

/// Reads the whole region in `piece`-sized reads.
fn read_all(region: &regions::Region, len: usize, piece: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for (i, chunk) in out.chunks_mut(piece).enumerate() {
        let n = region.read_at((i * piece) as u64, chunk).unwrap();
        assert_eq!(n, chunk.len(), "short read at {}", i * piece);
    }
    out
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[test]
fn cross_host_256_mib_round_trip_is_bit_exact() {
    let cluster = Cluster::start(2, "512M").unwrap();
    let writer = client(&cluster, 1, true);
    let attr = writer
        .create_path("big", 0o644, on_hosts("2", false), 0)
        .unwrap();
    let data = random_bytes(256 * MIB, 1);
    let region = writer.open(attr.ino, true).unwrap();
    for (i, piece) in data.chunks(16 * MIB).enumerate() {
        region.write_at((i * 16 * MIB) as u64, piece).unwrap();
    }
    assert_eq!(region.size(), 256 * MIB as u64);
    assert_eq!(
        hosts_of(&writer, attr.ino),
        "2",
        "held by host 2's daemon only"
    );
    let stats = writer.stats();
    assert_eq!(
        stats.remote_bytes_written,
        256 * MIB as u64,
        "all of it crossed the transport"
    );
    assert_eq!(stats.local_bytes_written, 0);

    // A fresh client on host 1 reads it back.
    let reader = client(&cluster, 1, false);
    let region = reader.open(attr.ino, false).unwrap();
    let back = read_all(&region, 256 * MIB, 8 * MIB);
    assert_eq!(first_difference(&back, &data), None);
    assert_eq!(reader.stats().remote_bytes_read, 256 * MIB as u64);
    // Unaligned reads that straddle chunks.
    let mut odd = vec![0u8; 300_000];
    let at = 128 * 1024 - 7;
    region.read_at(at as u64, &mut odd).unwrap();
    assert_eq!(odd, data[at..at + odd.len()]);
}

#[test]
fn multihosted_region_spreads_over_three_daemons() {
    let cluster = Cluster::start(3, "128M").unwrap();
    let writer = client(&cluster, 1, false);
    let attr = writer
        .create_path("spread", 0o644, on_hosts("", true), 0)
        .unwrap();
    let data = random_bytes(48 * MIB, 2);
    let region = writer.open(attr.ino, true).unwrap();
    region.write_at(0, &data).unwrap();
    assert_eq!(hosts_of(&writer, attr.ino), "1,2,3");
    drop(region);
    // A reader on host 3 maps host 3's part and fetches the rest.
    let reader = client(&cluster, 3, true);
    let region = reader.open(attr.ino, false).unwrap();
    let back = read_all(&region, data.len(), 5 * MIB + 3);
    assert_eq!(first_difference(&back, &data), None);
    assert!(region.has_local_segment());
    let stats = reader.stats();
    assert_eq!(
        stats.local_bytes_read,
        16 * MIB as u64,
        "one extent in three is local"
    );
    assert_eq!(stats.remote_bytes_read, 32 * MIB as u64);
}

#[test]
fn eight_concurrent_writers_to_disjoint_ranges() {
    let cluster = Cluster::start(2, "256M").unwrap();
    let owner = client(&cluster, 1, false);
    let attr = owner
        .create_path("shared", 0o666, on_hosts("2", false), 64 * MIB as u64)
        .unwrap();
    owner
        .open(attr.ino, true)
        .unwrap()
        .set_len(64 * MIB as u64)
        .unwrap();
    let slice = 8 * MIB;
    std::thread::scope(|s| {
        for w in 0..8usize {
            let cluster = &cluster;
            s.spawn(move || {
                let c = client(cluster, 1 + (w % 2) as u32, false);
                let region = c.open(attr.ino, true).unwrap();
                let data = random_bytes(slice, 100 + w as u64);
                for (i, piece) in data.chunks(256 * 1024).enumerate() {
                    region
                        .write_at((w * slice + i * 256 * 1024) as u64, piece)
                        .unwrap();
                }
            });
        }
    });
    let region = owner.open(attr.ino, false).unwrap();
    let back = read_all(&region, 64 * MIB, 4 * MIB);
    for w in 0..8usize {
        let want = random_bytes(slice, 100 + w as u64);
        assert_eq!(
            first_difference(&back[w * slice..(w + 1) * slice], &want),
            None,
            "writer {w}"
        );
    }
}

#[test]
fn atomics_from_four_clients_give_exact_totals() {
    let cluster = Cluster::start(2, "64M").unwrap();
    let owner = client(&cluster, 1, false);
    let attr = owner
        .create_path("counters", 0o666, on_hosts("2", false), 0)
        .unwrap();
    owner.open(attr.ino, true).unwrap().set_len(4096).unwrap();
    std::thread::scope(|s| {
        for w in 0..4u32 {
            let cluster = &cluster;
            s.spawn(move || {
                // Clients on host 2 use the mapped segment, the others the
                // transport: both kinds of atomics must agree.
                let c = client(cluster, 1 + w % 2, true);
                let region = c.open(attr.ino, true).unwrap();
                for _ in 0..2_500 {
                    region.fetch_add(0, 1).unwrap();
                }
                for _ in 0..250 {
                    loop {
                        let old = region.fetch_add(8, 0).unwrap();
                        if region.compare_and_swap(8, old, old + 1).unwrap() == old {
                            break;
                        }
                    }
                }
            });
        }
    });
    let region = owner.open(attr.ino, true).unwrap();
    assert_eq!(region.fetch_add(0, 0).unwrap(), 10_000);
    assert_eq!(region.fetch_add(8, 0).unwrap(), 1_000);
    let err = region.fetch_add(4, 1).unwrap_err();
    assert_eq!(
        err.errno(),
        libc::EINVAL,
        "unaligned atomics are refused: {err}"
    );
}

#[test]
fn same_host_access_goes_through_the_memfd_with_no_transport_traffic() {
    let cluster = Cluster::start(2, "256M").unwrap();
    let local = client(&cluster, 2, true);
    let attr = local.create_path("near", 0o644, None, 0).unwrap();
    let data = random_bytes(32 * MIB, 3);
    let region = local.open(attr.ino, true).unwrap();
    region.write_at(0, &data).unwrap();
    assert_eq!(
        hosts_of(&local, attr.ino),
        "2",
        "a region lives on its owner's host"
    );
    let mut agent = AgentClient::connect(&cluster.daemon(2).unwrap().socket).unwrap();
    let served_before = agent.stats().unwrap().transport_requests;
    let back = read_all(&region, data.len(), MIB);
    assert_eq!(first_difference(&back, &data), None);
    assert!(region.has_local_segment());
    let stats = local.stats();
    assert_eq!(
        stats.remote_requests, 0,
        "no transport request from the same host"
    );
    assert_eq!(stats.connections, 0);
    assert_eq!(stats.local_bytes_read, 32 * MIB as u64);
    let served_after = agent.stats().unwrap().transport_requests;
    assert_eq!(
        served_after, served_before,
        "the daemon served no transport request"
    );
    // Another host sees the same bytes over the transport.
    let remote = client(&cluster, 1, true);
    let region = remote.open(attr.ino, false).unwrap();
    assert_eq!(
        first_difference(&read_all(&region, data.len(), 4 * MIB), &data),
        None
    );
    assert!(remote.stats().remote_requests > 0);
}

#[test]
fn deleting_regions_returns_their_memory_to_the_kernel() {
    const GIB: u64 = 1 << 30;
    let cluster = Cluster::start(1, "2G").unwrap();
    let c = client(&cluster, 1, true);
    // The daemon reports the allocated blocks (st_blocks) of its memfds:
    // exactly the memory its regions hold, whoever faulted the pages in.
    let mut agent = AgentClient::connect(&cluster.daemon(1).unwrap().socket).unwrap();
    let held = |agent: &mut AgentClient| agent.stats().unwrap().segment_bytes;
    assert_eq!(held(&mut agent), 0);
    let piece = random_bytes(8 * MIB, 4);
    let mut names = Vec::new();
    for r in 0..8 {
        let name = format!("r{r}");
        let attr = c.create_path(&name, 0o644, None, 0).unwrap();
        let region = c.open(attr.ino, true).unwrap();
        for i in 0..16 {
            region.write_at((i * 8 * MIB) as u64, &piece).unwrap();
        }
        names.push(name);
    }
    let peak = held(&mut agent);
    assert!(
        peak >= GIB,
        "1 GiB written, but the memfds hold {peak} bytes"
    );
    for name in &names {
        c.unlink_path(name).unwrap();
    }
    // The daemon applies the releases as their events arrive.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = held(&mut agent);
        if peak - now >= GIB * 9 / 10 && now == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "10 s after deleting 1 GiB the memfds still hold {now} bytes"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_unreachable_daemon_gives_eio_within_the_retry_bound() {
    let mut cluster = Cluster::start(2, "64M").unwrap();
    let c = client(&cluster, 1, false);
    let attr = c
        .create_path("doomed", 0o644, on_hosts("2", false), 0)
        .unwrap();
    let region = c.open(attr.ino, true).unwrap();
    region.write_at(0, b"still here").unwrap();
    let daemon = cluster.daemons.iter_mut().find(|d| d.host_id == 2).unwrap();
    daemon.sigkill().unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 10];
    let err = region.read_at(0, &mut buf).unwrap_err();
    let took = t.elapsed();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(took < Duration::from_secs(6), "gave up after {took:?}");
    assert!(err.to_string().contains("unreachable"), "{err}");
}

/// A two-host cluster, a client on each host (host 2's first), and region `a`, created by host
/// 2 and held by host 1: the set-up of the stale-map tests.
fn two_hosts_and_a_region_on_host_1() -> (Cluster, Client, Client, v1::Attr) {
    // Regions in chunks (these tests move chunks between regions), none stored as objects.
    let cluster = Cluster::start_with(2, "64M", &["--small-regions", "0"]).unwrap();
    let host2 = client(&cluster, 2, false);
    let host1 = client(&cluster, 1, false);
    let a = host2
        .create_path("a", 0o644, on_hosts("1", false), 0)
        .unwrap();
    (cluster, host2, host1, a)
}

/// A map from before a truncate never reaches the chunks another region got since: the
/// transport names the region, the daemon answers `ESTALE`, and the client refreshes its map.
#[test]
fn an_old_map_never_reaches_the_chunks_of_another_region() {
    const LEN: usize = 512 << 10;
    let (cluster, host2, host1, a) = two_hosts_and_a_region_on_host_1();
    let old = host2.open(a.ino, true).unwrap();
    old.write_at(0, &vec![b'A'; LEN]).unwrap();
    let stale: std::collections::HashSet<u64> = old.map().into_iter().collect();

    // Host 1 truncates `a` and gives its memory to `b`.
    host1.open(a.ino, true).unwrap().set_len(0).unwrap();
    let b = host1
        .create_path("b", 0o644, on_hosts("1", false), 0)
        .unwrap();
    let rb = host1.open(b.ino, true).unwrap();
    rb.write_at(0, &vec![b'B'; LEN]).unwrap();
    assert!(
        rb.map().iter().any(|e| stale.contains(e)),
        "b did not reuse a's chunks, so this test would prove nothing: {:?} vs {stale:?}",
        rb.map()
    );

    // Host 2's old open: its reads never return b's bytes, its writes never land in b.
    let mut buf = vec![0u8; LEN];
    if let Ok(n) = old.read_at(0, &mut buf) {
        assert!(
            !buf[..n].contains(&b'B'),
            "a stale map read another region's bytes"
        );
    }
    let _ = old.write_at(0, &vec![b'X'; LEN]);
    let fresh = client(&cluster, 1, false).open(b.ino, false).unwrap();
    let back = read_all(&fresh, LEN, 64 << 10);
    assert!(
        back.iter().all(|&c| c == b'B'),
        "a stale map wrote into another region"
    );
}

#[test]
fn an_old_map_never_reaches_a_chunk_that_moved_within_its_region() {
    const CHUNKS: usize = 4;
    const LEN: usize = CHUNKS * CHUNK;
    let (cluster, host2, host1, a) = two_hosts_and_a_region_on_host_1();
    let pattern = |base: u8| -> Vec<u8> { (0..LEN).map(|i| base + (i / CHUNK) as u8).collect() };
    let old = host2.open(a.ino, true).unwrap();
    old.write_at(0, &pattern(b'0')).unwrap();
    let stale = old.map();
    // A second old open, for the write (a refused access refreshes the map of its open).
    let old_writer = host2.open(a.ino, true).unwrap();
    assert_eq!(old_writer.map(), stale);

    // Host 1 truncates `a`, lets `pad` take a freed chunk, and grows `a` again: its chunks
    // come back at other offsets of the same region.
    host1.open(a.ino, true).unwrap().set_len(0).unwrap();
    let pad = host1
        .create_path("pad", 0o644, on_hosts("1", false), 0)
        .unwrap();
    host1
        .open(pad.ino, true)
        .unwrap()
        .write_at(0, b"pad")
        .unwrap();
    let ra = host1.open(a.ino, true).unwrap();
    ra.write_at(0, &pattern(b'a')).unwrap();
    let moved = ra
        .map()
        .iter()
        .enumerate()
        .any(|(i, e)| stale.iter().position(|s| s == e).is_some_and(|j| j != i));
    assert!(
        moved,
        "no chunk of a came back at another offset, so this test would prove nothing: {:?} vs \
         {stale:?}",
        ra.map()
    );

    // Host 2's old opens, one chunk at a time from the last (a chunk that went to `pad`
    // would refresh the whole map first): each read gets its own offset's bytes (after
    // refreshing the map), never another offset's, and each write lands where it means.
    let mut buf = vec![0u8; CHUNK];
    for i in (0..CHUNKS).rev() {
        if let Ok(n) = old.read_at((i * CHUNK) as u64, &mut buf) {
            assert!(
                buf[..n].iter().all(|&c| c == b'a' + i as u8),
                "a stale map read chunk {i} of a from another offset"
            );
        }
    }
    let last = CHUNKS - 1;
    let _ = old_writer.write_at((last * CHUNK) as u64, &vec![b'X'; CHUNK]);
    let fresh = client(&cluster, 1, false).open(a.ino, false).unwrap();
    let back = read_all(&fresh, LEN, 64 << 10);
    for (i, &c) in back.iter().enumerate().take(last * CHUNK) {
        assert_eq!(c, b'a' + (i / CHUNK) as u8, "a stale map wrote offset {i}");
    }
}
