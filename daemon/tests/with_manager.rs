//! The daemon against the real `regions-manager` binary (build it first:
//! `cargo build -p regions-manager`): registration, a region created through the manager read
//! and written over the transport and through the host agent, pages released at unlink, and
//! re-registration after a manager restart.

mod common;

use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use bytes::Bytes;
use common::{Client, ManagerProcess, TOKEN, status, wait_until};
use regions_daemon::{Config, Daemon};
use regions_proto::auth::AttachSecret;
use regions_proto::frame::Request;
use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1::{
    self, AgentRequest, AgentSegment, Caller, agent_reply, agent_request,
    cluster_client::ClusterClient, namespace_client::NamespaceClient,
    regions_client::RegionsClient,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const HOST: u32 = 7;
const ROOT: u64 = 1;

type Svc = InterceptedService<Channel, AttachSecret>;

struct Clients {
    cluster: ClusterClient<Svc>,
    namespace: NamespaceClient<Svc>,
    regions: RegionsClient<Svc>,
}

async fn clients(m: &ManagerProcess) -> Clients {
    let channel = tonic::transport::Endpoint::from_shared(m.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let auth = AttachSecret::new(&m.secret);
    Clients {
        cluster: ClusterClient::with_interceptor(channel.clone(), auth.clone())
            .max_decoding_message_size(256 << 20),
        namespace: NamespaceClient::with_interceptor(channel.clone(), auth.clone())
            .max_decoding_message_size(256 << 20),
        regions: RegionsClient::with_interceptor(channel, auth)
            .max_decoding_message_size(256 << 20),
    }
}

fn root() -> Caller {
    Caller {
        uid: 0,
        gid: 0,
        groups: vec![],
        pid: std::process::id(),
        host_id: HOST,
        by_inode: false,
        lease_session: 0,
    }
}

async fn create(c: &mut Clients, name: &str, bytes: u64) -> u64 {
    c.namespace
        .create(v1::CreateRequest {
            caller: Some(root()),
            parent: ROOT,
            name: name.into(),
            mode: 0o644,
            attrs: None,
            preallocate: bytes,
        })
        .await
        .unwrap()
        .into_inner()
        .ino
}

/// Opens region `ino`: its map as (pool gid, pool offset) per chunk, and the handle.
async fn open(c: &mut Clients, ino: u64) -> (Vec<MapEntry>, u64, v1::RegionInfo) {
    let info = c
        .regions
        .open(v1::OpenRequest {
            caller: Some(root()),
            ino,
            write: true,
        })
        .await
        .unwrap()
        .into_inner();
    let map = info
        .map
        .iter()
        .map(|raw| MapEntry::decode(*raw).unwrap())
        .collect();
    (map, info.handle, info)
}

/// Writes `data` at region offset `at` following the map (chunk by chunk), then reads it
/// back the same way.
fn transport_round_trip(addr: &str, token: &str, map: &[MapEntry], at: u64, data: &[u8]) {
    let mut client = Client::authenticated(addr.parse().unwrap(), token);
    let mut done = 0usize;
    while done < data.len() {
        let off = at + done as u64;
        let entry = map[(off / CHUNK_SIZE) as usize];
        let n = ((CHUNK_SIZE - off % CHUNK_SIZE) as usize).min(data.len() - done);
        let reply = client.call(&Request::Write {
            pool: entry.gid,
            offset: entry.pool_offset + off % CHUNK_SIZE,
            data: Bytes::copy_from_slice(&data[done..done + n]),
        });
        assert_eq!(status(&reply), 0, "{:?}", reply.error_message());
        done += n;
    }
    let mut back = Vec::new();
    while back.len() < data.len() {
        let off = at + back.len() as u64;
        let entry = map[(off / CHUNK_SIZE) as usize];
        let n = (CHUNK_SIZE - off % CHUNK_SIZE).min((data.len() - back.len()) as u64);
        let reply = client.call(&Request::Read {
            pool: entry.gid,
            offset: entry.pool_offset + off % CHUNK_SIZE,
            len: n,
        });
        assert_eq!(status(&reply), 0);
        back.extend_from_slice(&reply.payload);
    }
    assert_eq!(back, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_serves_a_region_and_releases_it() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    let mut manager = ManagerProcess::start(dir.path(), "127.0.0.1:0", 3_000);
    let ready = dir.path().join("daemon.ready");
    let socket = dir.path().join("agent.sock");
    let mut config = Config::new(
        &manager.url(),
        HOST,
        4 << 20,
        socket.clone(),
        manager.secret.clone(),
    );
    config.ready_file = Some(ready.clone());
    config.startup_timeout = Duration::from_secs(20);
    config.transport.assign_wait = Duration::from_millis(300);
    let daemon = Daemon::start(config.clone()).await.unwrap();
    let addr = daemon.advertised_addr().to_owned();
    assert_eq!(std::fs::read_to_string(&ready).unwrap(), addr);
    assert_eq!(
        daemon.transport_addr().map(|a| a.to_string()),
        Some(addr.clone())
    );

    // Registered: the host is live, its pool is known.
    let mut c = clients(&manager).await;
    let hosts = c
        .cluster
        .list_hosts(v1::ListHostsRequest {})
        .await
        .unwrap()
        .into_inner()
        .hosts;
    let host = hosts.iter().find(|h| h.host_id == HOST).unwrap();
    assert!(host.live);
    assert_eq!(host.transport_addr, addr);
    assert_eq!(host.agent_socket, socket.display().to_string());
    let pools = c
        .cluster
        .list_pools(v1::ListPoolsRequest { host_id: HOST })
        .await
        .unwrap()
        .into_inner()
        .pools;
    assert_eq!(pools.len(), 1);
    assert_eq!(pools[0].size, 4 << 20);
    assert_eq!(daemon.pools().list(), vec![(pools[0].gid, 4 << 20)]);

    // A region of 3 chunks, written and read over the transport across chunk boundaries.
    let ino = create(&mut c, "r", 3 * CHUNK_SIZE).await;
    let (map, handle, info) = open(&mut c, ino).await;
    assert_eq!(map.len(), 3);
    assert!(map.iter().all(|e| e.gid == pools[0].gid));
    assert_eq!(info.pools[0].transport_addr, addr);
    let data: Vec<u8> = (0..2 * CHUNK_SIZE as usize)
        .map(|i| (i % 253) as u8)
        .collect();
    let token = TOKEN.to_owned();
    let addr2 = addr.clone();
    let map2 = map.clone();
    let data2 = data.clone();
    let token2 = token.clone();
    tokio::task::spawn_blocking(move || {
        transport_round_trip(&addr2, &token2, &map2, CHUNK_SIZE / 2, &data2)
    })
    .await
    .unwrap();

    // The host agent hands out the segment: the same bytes at region offsets.
    let sock = socket.clone();
    let (reply, fd) = tokio::task::spawn_blocking(move || {
        let stream = UnixStream::connect(&sock).unwrap();
        regions_daemon::agent::call(
            &stream,
            &AgentRequest {
                request: Some(agent_request::Request::Segment(AgentSegment {
                    ino,
                    write: false,
                    covering: 3 * CHUNK_SIZE,
                })),
            },
        )
        .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(reply.errno, 0, "{}", reply.message);
    let Some(agent_reply::Body::Segment(seg)) = reply.body else {
        panic!("no segment in the agent's reply")
    };
    assert!(seg.has_fd && !seg.writable);
    assert_eq!(seg.size, 3 * CHUNK_SIZE);
    let file = std::fs::File::from(fd.unwrap());
    let mut got = vec![0u8; 100];
    file.read_exact_at(&mut got, CHUNK_SIZE / 2).unwrap();
    assert_eq!(got, data[..100]);

    // Unlink (after closing): the daemon releases the chunks and punches the pages.
    let segment = daemon.pools().segment(ino).unwrap();
    assert!(segment.allocated_bytes() >= 2 * CHUNK_SIZE);
    let stats = daemon.stats();
    assert_eq!(stats.segments, 1);
    c.regions
        .close(v1::CloseRequest {
            caller: Some(root()),
            handle,
            wrote_within_size: false,
        })
        .await
        .unwrap();
    c.namespace
        .unlink(v1::RemoveRequest {
            caller: Some(root()),
            parent: ROOT,
            name: "r".into(),
        })
        .await
        .unwrap();
    let pools2 = std::sync::Arc::clone(daemon.pools());
    let released = tokio::task::spawn_blocking(move || {
        wait_until(Duration::from_secs(10), || pools2.segment(ino).is_none())
    })
    .await
    .unwrap();
    assert!(released, "the daemon did not release the region's segment");
    assert_eq!(
        segment.allocated_bytes(),
        0,
        "pages went back to the kernel"
    );
    assert_eq!(daemon.stats().segment_bytes, 0);
    let e = map[0];
    let reply = tokio::task::spawn_blocking(move || {
        let mut client = Client::authenticated(addr.parse().unwrap(), &token);
        client.call(&Request::Read {
            pool: e.gid,
            offset: e.pool_offset,
            len: 8,
        })
    })
    .await
    .unwrap();
    assert_eq!(status(&reply), libc::EFAULT);

    // The manager restarts on the same address: the daemon registers again, resyncs, and
    // serves regions created after the restart.
    let keep = create(&mut c, "keep", CHUNK_SIZE).await;
    let (keep_map, _, _) = open(&mut c, keep).await;
    let (a, m) = (daemon.advertised_addr().to_owned(), keep_map.clone());
    tokio::task::spawn_blocking(move || transport_round_trip(&a, TOKEN, &m, 100, b"persist"))
        .await
        .unwrap();
    let registrations = daemon.registrations();
    let listen = manager.addr.to_string();
    manager.kill();
    let manager = ManagerProcess::start(dir.path(), &listen, 3_000);
    let mut waited = 0;
    while daemon.registrations() <= registrations && waited < 200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
    }
    assert!(
        daemon.registrations() > registrations,
        "no re-registration; manager log:\n{}",
        manager.log()
    );
    let mut c = clients(&manager).await;
    let ino = create(&mut c, "after-restart", CHUNK_SIZE).await;
    let (map, _, _) = open(&mut c, ino).await;
    let addr = daemon.advertised_addr().to_owned();
    tokio::task::spawn_blocking(move || transport_round_trip(&addr, TOKEN, &map, 10, b"alive"))
        .await
        .unwrap();
    // Data written before the restart is still served (the daemon's memory did not move).
    let a = daemon.advertised_addr().to_owned();
    let kept = tokio::task::spawn_blocking(move || transport_read(&a, &keep_map, 100, 7))
        .await
        .unwrap();
    assert_eq!(kept, b"persist");
    let hosts = c
        .cluster
        .list_hosts(v1::ListHostsRequest {})
        .await
        .unwrap()
        .into_inner()
        .hosts;
    assert!(hosts.iter().any(|h| h.host_id == HOST && h.live));

    daemon.shutdown().await;
    assert!(!socket.exists(), "the agent socket is removed at shutdown");
}

/// Reads `len` bytes at region offset `at` over the transport, following the map.
fn transport_read(addr: &str, map: &[MapEntry], at: u64, len: u64) -> Vec<u8> {
    let mut client = Client::authenticated(addr.parse().unwrap(), TOKEN);
    let mut back = Vec::new();
    while (back.len() as u64) < len {
        let off = at + back.len() as u64;
        let entry = map[(off / CHUNK_SIZE) as usize];
        let n = (CHUNK_SIZE - off % CHUNK_SIZE).min(len - back.len() as u64);
        let reply = client.call(&Request::Read {
            pool: entry.gid,
            offset: entry.pool_offset + off % CHUNK_SIZE,
            len: n,
        });
        assert_eq!(status(&reply), 0, "{:?}", reply.error_message());
        back.extend_from_slice(&reply.payload);
    }
    back
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_takes_over_its_pools_and_handles_several() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
    const HOST8: u32 = 8;
    let caller = Caller {
        host_id: HOST8,
        by_inode: false,
        ..root()
    };
    let dir = tempfile::tempdir().unwrap();
    let manager = ManagerProcess::start(dir.path(), "127.0.0.1:0", 5_000);
    let socket = dir.path().join("h8.sock");
    let mut config = Config::new(
        &manager.url(),
        HOST8,
        2 << 20,
        socket,
        manager.secret.clone(),
    );
    config.transport.assign_wait = Duration::from_millis(500);
    let first = Daemon::start(config.clone()).await.unwrap();
    let first_pools = first.pools().list();
    let mut c = clients(&manager).await;
    let create_as = |name: &str, bytes: u64| v1::CreateRequest {
        caller: Some(caller.clone()),
        parent: ROOT,
        name: name.into(),
        mode: 0o644,
        attrs: None,
        preallocate: bytes,
    };
    let a = c
        .namespace
        .create(create_as("a", 2 * CHUNK_SIZE))
        .await
        .unwrap()
        .into_inner()
        .ino;
    let (map_a, _, _) = open(&mut c, a).await;
    let addr = first.advertised_addr().to_owned();
    let m = map_a.clone();
    tokio::task::spawn_blocking(move || transport_round_trip(&addr, TOKEN, &m, 0, b"before"))
        .await
        .unwrap();
    first.shutdown().await;

    // A new daemon for the same host with more memory: it takes over the old pool (whose data
    // died with the old daemon) and adds one for the rest.
    config.memory = 4 << 20;
    let second = Daemon::start(config).await.unwrap();
    let pools = second.pools().list();
    assert_eq!(pools.len(), 2, "{pools:?}");
    assert_eq!(pools[0], first_pools[0]);
    // The old daemon's data died with it: the manager marks the region lost (EIO until
    // unlinked) and the new daemon never serves its chunks as zeros.
    let lost = c
        .regions
        .open(v1::OpenRequest {
            caller: Some(root()),
            ino: a,
            write: false,
        })
        .await
        .expect_err("opening a region whose memory died must fail");
    assert_eq!(
        regions_proto::errno::errno_of(&lost),
        libc::EIO,
        "{}",
        lost.message()
    );
    let addr = second.advertised_addr().to_owned();
    let first_chunk = map_a[0];
    let status_of_old = tokio::task::spawn_blocking(move || {
        let mut client = Client::authenticated(addr.parse().unwrap(), TOKEN);
        let reply = client.call(&Request::Read {
            pool: first_chunk.gid,
            offset: first_chunk.pool_offset,
            len: 6,
        });
        status(&reply)
    })
    .await
    .unwrap();
    assert_ne!(status_of_old, 0, "a lost chunk must not be served");

    // With two pools, events name no pool: the daemon resyncs, and a region spanning both
    // pools works.
    let b = c
        .namespace
        .create(create_as("b", 20 * CHUNK_SIZE))
        .await
        .unwrap()
        .into_inner()
        .ino;
    let (map_b, handle_b, _) = open(&mut c, b).await;
    let gids: std::collections::BTreeSet<u32> = map_b.iter().map(|e| e.gid).collect();
    assert_eq!(gids.len(), 2, "region b spans both pools");
    let data: Vec<u8> = (0..20 * CHUNK_SIZE as usize)
        .map(|i| (i % 241) as u8)
        .collect();
    let addr = second.advertised_addr().to_owned();
    let m = map_b.clone();
    tokio::task::spawn_blocking(move || transport_round_trip(&addr, TOKEN, &m, 0, &data))
        .await
        .unwrap();
    c.regions
        .close(v1::CloseRequest {
            caller: Some(caller.clone()),
            handle: handle_b,
            wrote_within_size: false,
        })
        .await
        .unwrap();
    c.namespace
        .unlink(v1::RemoveRequest {
            caller: Some(caller.clone()),
            parent: ROOT,
            name: "b".into(),
        })
        .await
        .unwrap();
    let p = std::sync::Arc::clone(second.pools());
    let released = tokio::task::spawn_blocking(move || {
        wait_until(Duration::from_secs(10), || p.segment(b).is_none())
    })
    .await
    .unwrap();
    assert!(released, "region b's segment was not released");
    assert!(
        second.pools().segment(a).is_none(),
        "the lost region a has no memory on the new daemon"
    );
    second.shutdown().await;
}
