//! Capability-authenticated transport connections (docs/ARCHITECTURE.md, "Capabilities") against
//! a real transport server: a token reaches only the chunks of its region, with its rights, until it
//! expires, within its byte range, and until the manager revokes it; forged, expired and revoked
//! tokens are refused.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::{Client, TOKEN, server, status};
use regions_daemon::pools::Pools;
use regions_proto::auth::Secret;
use regions_proto::capability::{
    Capability, CapabilityKey, RIGHT_READ, RIGHT_WRITE, WHOLE_REGION, now_ms,
};
use regions_proto::frame::{Frame, Range, Request};
use regions_proto::layout::CHUNK_SIZE;

const C: u64 = CHUNK_SIZE;

/// Pool 1: chunks 0..4 back region 10, chunks 4..6 region 11.
fn pools() -> Arc<Pools> {
    let pools = Arc::new(Pools::new());
    pools.add_pool(1, 16 * C).unwrap();
    pools.assign(1, 0, 10, 0, 4 * C).unwrap();
    pools.assign(1, 4 * C, 11, 0, 2 * C).unwrap();
    pools
}

fn token(secret: &str, ino: u64, rights: u8, ttl_ms: i64) -> Bytes {
    ranged(secret, ino, rights, ttl_ms, (0, WHOLE_REGION), 3)
}

/// A token for region bytes `range` (offset, len), issued at `issued`.
fn ranged(
    secret: &str,
    ino: u64,
    rights: u8,
    ttl_ms: i64,
    range: (u64, u64),
    issued: u64,
) -> Bytes {
    let key = CapabilityKey::from_secret(&Secret::new(secret).unwrap());
    Bytes::from(key.mint(&Capability {
        ino,
        rights,
        expires_ms: (now_ms() as i64 + ttl_ms) as u64,
        issued,
        offset: range.0,
        len: range.1,
        host: 0,
    }))
}

/// Sends `req` naming capability `cap` and returns the reply (`None`: connection closed).
fn call(c: &mut Client, req: &Request, cap: u64) -> Option<Frame> {
    let mut out = BytesMut::new();
    req.to_frame(99, cap).encode(&mut out);
    c.send_raw(&out).unwrap();
    c.recv()
}

fn hello(c: &mut Client, token: Bytes, cap: u64) -> Option<Frame> {
    call(c, &Request::Hello { token }, cap)
}

fn read(offset: u64, len: u64) -> Request {
    Request::Read {
        pool: 1,
        offset,
        len,
    }
}

fn write(offset: u64) -> Request {
    Request::Write {
        pool: 1,
        offset,
        data: Bytes::from_static(b"12345678"),
    }
}

#[test]
fn a_capability_reaches_its_region_with_its_rights() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let mut c = Client::connect(srv.local_addr());
    let ok = hello(&mut c, token(TOKEN, 10, RIGHT_READ, 60_000), 5).unwrap();
    assert_eq!(status(&ok), 0);
    assert_eq!(status(&call(&mut c, &read(0, 4096), 5).unwrap()), 0);
    assert_eq!(status(&call(&mut c, &read(3 * C, C), 5).unwrap()), 0);
    // Read-only: writes, vector writes, CAS and fetch-add are refused.
    for req in [
        write(0),
        Request::WriteV {
            ranges: vec![Range {
                pool: 1,
                offset: 0,
                len: 8,
                delta: None,
            }],
            data: Bytes::from_static(b"12345678"),
        },
        Request::Cas {
            pool: 1,
            offset: 0,
            expected: 0,
            new: 1,
        },
        Request::FetchAdd {
            pool: 1,
            offset: 0,
            addend: 1,
        },
        // RDMA keys for writing are refused as a write is (before any RDMA is involved).
        Request::RdmaKeys {
            pool: 1,
            offset: 0,
            len: 8,
            write: true,
        },
    ] {
        let r = call(&mut c, &req, 5).unwrap();
        assert_eq!(status(&r), libc::EACCES, "{:?}", req.op());
        assert!(r.error_message().unwrap().contains("read-only"));
    }
    // Another region's chunks, also as part of a vector, and unknown ids are refused.
    assert_eq!(
        status(&call(&mut c, &read(4 * C, 8), 5).unwrap()),
        libc::EACCES
    );
    let across = Request::ReadV {
        ranges: vec![
            Range {
                pool: 1,
                offset: 0,
                len: 8,
                delta: None,
            },
            Range {
                pool: 1,
                offset: 4 * C,
                len: 8,
                delta: None,
            },
        ],
    };
    assert_eq!(status(&call(&mut c, &across, 5).unwrap()), libc::EACCES);
    assert_eq!(status(&call(&mut c, &read(0, 8), 6).unwrap()), libc::EACCES);
    assert_eq!(status(&call(&mut c, &read(0, 8), 0).unwrap()), libc::EACCES);
    // A second, writable capability on the same connection for region 11.
    let ok = hello(
        &mut c,
        token(TOKEN, 11, RIGHT_READ | RIGHT_WRITE, 60_000),
        7,
    )
    .unwrap();
    assert_eq!(status(&ok), 0);
    assert_eq!(status(&call(&mut c, &write(4 * C), 7).unwrap()), 0);
    let r = call(&mut c, &read(4 * C, 8), 7).unwrap();
    assert_eq!(&r.payload[..], b"12345678");
    assert_eq!(status(&call(&mut c, &write(0), 7).unwrap()), libc::EACCES);
    // The connection is still usable after refusals.
    assert_eq!(status(&call(&mut c, &Request::Ping, 5).unwrap()), 0);
}

#[test]
fn forged_and_expired_tokens_are_refused_and_renewal_works() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    // Minted with another cluster's secret: refused, connection closed.
    let mut c = Client::connect(srv.local_addr());
    let r = hello(&mut c, token("other-cluster", 10, RIGHT_READ, 60_000), 1).unwrap();
    assert_eq!(status(&r), libc::EACCES);
    assert!(c.recv().is_none());
    // Expired when presented.
    let mut c = Client::connect(srv.local_addr());
    let r = hello(&mut c, token(TOKEN, 10, RIGHT_READ, -1), 1).unwrap();
    assert_eq!(status(&r), libc::EACCES);
    assert!(r.error_message().unwrap().contains("expired"));
    // Expires while in use, then renewed under the same id.
    let mut c = Client::connect(srv.local_addr());
    assert_eq!(
        status(&hello(&mut c, token(TOKEN, 10, RIGHT_READ, 300), 1).unwrap()),
        0
    );
    assert_eq!(status(&call(&mut c, &read(0, 8), 1).unwrap()), 0);
    std::thread::sleep(Duration::from_millis(400));
    let r = call(&mut c, &read(0, 8), 1).unwrap();
    assert_eq!(status(&r), libc::EACCES);
    assert!(r.error_message().unwrap().contains("expired"));
    assert_eq!(
        status(&hello(&mut c, token(TOKEN, 10, RIGHT_READ, 60_000), 1).unwrap()),
        0
    );
    assert_eq!(status(&call(&mut c, &read(0, 8), 1).unwrap()), 0);
    // The cluster secret still reaches everything.
    let mut s = Client::authenticated(srv.local_addr(), TOKEN);
    assert_eq!(status(&s.call(&read(4 * C, 8))), 0);
}

#[test]
fn a_range_token_reaches_its_bytes_only() {
    // Region 10's chunks 0..4 sit at pool offsets 0..4C; the token covers 64 bytes at C + 128.
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let mut c = Client::connect(srv.local_addr());
    let t = ranged(
        TOKEN,
        10,
        RIGHT_READ | RIGHT_WRITE,
        60_000,
        (C + 128, 64),
        9,
    );
    assert_eq!(status(&hello(&mut c, t, 1).unwrap()), 0);
    let inside = Request::Write {
        pool: 1,
        offset: C + 128,
        data: Bytes::from_static(b"12345678"),
    };
    assert_eq!(status(&call(&mut c, &inside, 1).unwrap()), 0);
    assert_eq!(status(&call(&mut c, &read(C + 184, 8), 1).unwrap()), 0);
    let cas = |offset| Request::Cas {
        pool: 1,
        offset,
        expected: 0,
        new: 1,
    };
    assert_eq!(status(&call(&mut c, &cas(C + 136), 1).unwrap()), 0);
    // One byte past either end, the neighbouring word, another chunk: refused.
    for (req, what) in [
        (read(C + 127, 8), "before"),
        (read(C + 185, 8), "after"),
        (cas(C + 192), "the next slot"),
        (write(0), "another chunk"),
        (read(0, 2 * C), "a span over the range"),
    ] {
        let r = call(&mut c, &req, 1).unwrap();
        assert_eq!(status(&r), libc::EACCES, "{what}");
        assert!(r.error_message().unwrap().contains("byte range"), "{what}");
    }
}

#[test]
fn revoked_tokens_are_refused_and_renewed_ones_work() {
    let pools = pools();
    let (srv, _) = server(Arc::clone(&pools), Duration::from_millis(50));
    let mut c = Client::connect(srv.local_addr());
    let old = ranged(TOKEN, 10, RIGHT_READ, 60_000, (0, WHOLE_REGION), 100);
    assert_eq!(status(&hello(&mut c, old.clone(), 1).unwrap()), 0);
    assert_eq!(status(&call(&mut c, &read(0, 8), 1).unwrap()), 0);
    // The manager revoked region 10's tokens issued before 200 (a chmod, say).
    pools.revocations().revoke(10, 200, now_ms() + 60_000);
    let r = call(&mut c, &read(0, 8), 1).unwrap();
    assert_eq!(status(&r), libc::EKEYREVOKED);
    assert!(r.error_message().unwrap().contains("revoked"));
    // Presenting the old token again is refused and the connection closed.
    let mut d = Client::connect(srv.local_addr());
    assert_eq!(status(&hello(&mut d, old, 1).unwrap()), libc::EKEYREVOKED);
    assert!(d.recv().is_none());
    // A token issued after the revocation works on the first connection.
    let new = ranged(TOKEN, 10, RIGHT_READ, 60_000, (0, WHOLE_REGION), 201);
    assert_eq!(status(&hello(&mut c, new, 1).unwrap()), 0);
    assert_eq!(status(&call(&mut c, &read(0, 8), 1).unwrap()), 0);
    // Another region's tokens are untouched; a revocation of every region reaches them.
    let other = ranged(TOKEN, 11, RIGHT_READ, 60_000, (0, WHOLE_REGION), 150);
    assert_eq!(status(&hello(&mut c, other, 2).unwrap()), 0);
    assert_eq!(status(&call(&mut c, &read(4 * C, 8), 2).unwrap()), 0);
    pools.revocations().revoke(0, 160, now_ms() + 60_000);
    assert_eq!(
        status(&call(&mut c, &read(4 * C, 8), 2).unwrap()),
        libc::EKEYREVOKED
    );
    assert_eq!(status(&call(&mut c, &read(0, 8), 1).unwrap()), 0);
}

/// A daemon that serves no RDMA (this test's server has no device) answers RDMA set-up and
/// read keys with `EOPNOTSUPP` and a message saying to use tcp.
#[test]
fn rdma_requests_to_a_daemon_without_rdma_say_to_use_tcp() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let mut c = Client::connect(srv.local_addr());
    assert_eq!(
        status(&hello(&mut c, token(TOKEN, 10, RIGHT_READ, 60_000), 5).unwrap()),
        0
    );
    let connect = Request::RdmaConnect {
        endpoint: Bytes::from(vec![0u8; regions_proto::frame::RDMA_ENDPOINT_LEN]),
    };
    let keys = Request::RdmaKeys {
        pool: 1,
        offset: 0,
        len: 8,
        write: false,
    };
    for req in [connect, keys] {
        let r = call(&mut c, &req, 5).unwrap();
        assert_eq!(status(&r), libc::EOPNOTSUPP, "{:?}", req.op());
        assert!(r.error_message().unwrap().contains("use the tcp transport"));
    }
}
