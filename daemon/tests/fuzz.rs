//! Random and malformed frames over several concurrent connections: the server never panics,
//! every connection ends (reply or close) in bounded time, and a fresh well-formed connection
//! still gets correct answers afterwards.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::{Client, TOKEN, server, status};
use proptest::prelude::*;
use regions_daemon::pools::Pools;
use regions_proto::frame::{Header, MAX_POOL, ObjectRef, Op, Range, Request, Settle};
use regions_proto::layout::CHUNK_SIZE;

const C: u64 = CHUNK_SIZE;

/// Panics seen on the server's connection threads.
static SERVER_PANICS: AtomicUsize = AtomicUsize::new(0);

fn install_panic_counter() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_owned();
            if name.starts_with("transport") {
                SERVER_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

fn encode(req: &Request, id: u64) -> Vec<u8> {
    let mut out = BytesMut::new();
    req.to_frame(id, 0).encode(&mut out);
    out.to_vec()
}

fn arb_offset() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..8 * C,
        6 * C..10 * C,
        any::<u64>(),
        Just(u64::MAX - 3),
        Just(8 * C - 4),
    ]
}

fn arb_pool() -> impl Strategy<Value = u32> {
    prop_oneof![4 => Just(1u32), 1 => 0..=MAX_POOL, 1 => any::<u32>()]
}

/// Well-formed requests, many of them out of bounds or to unassigned chunks.
fn arb_request() -> impl Strategy<Value = Request> {
    let data = prop::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from);
    let ranges = || {
        prop::collection::vec(
            // Now and then long ranges: vector payloads past a connection's input buffer.
            (
                arb_pool(),
                arb_offset(),
                prop_oneof![9 => 0u64..2000, 1 => 60_000u64..300_000],
            )
                .prop_map(|(pool, offset, len)| Range {
                    pool: pool & MAX_POOL,
                    offset: offset.min(u64::MAX - len),
                    len,
                    delta: None,
                }),
            0..6,
        )
    };
    prop_oneof![
        (arb_pool(), arb_offset(), 0u64..70_000).prop_map(|(pool, offset, len)| {
            Request::Read {
                pool: pool & MAX_POOL,
                offset: offset.min(u64::MAX - len),
                len,
            }
        }),
        (arb_pool(), arb_offset(), data.clone()).prop_map(|(pool, offset, data)| {
            Request::Write {
                pool: pool & MAX_POOL,
                offset: offset.min(u64::MAX - data.len() as u64),
                data,
            }
        }),
        ranges().prop_map(|ranges| Request::ReadV { ranges }),
        ranges().prop_map(|ranges| {
            let total: u64 = ranges.iter().map(|r| r.len).sum();
            Request::WriteV {
                ranges,
                data: Bytes::from(vec![7u8; total as usize]),
            }
        }),
        (arb_pool(), arb_offset(), any::<u64>(), any::<u64>()).prop_map(
            |(pool, offset, expected, new)| Request::Cas {
                pool: pool & MAX_POOL,
                offset,
                expected,
                new,
            }
        ),
        (arb_pool(), arb_offset(), any::<u64>()).prop_map(|(pool, offset, addend)| {
            Request::FetchAdd {
                pool: pool & MAX_POOL,
                offset,
                addend,
            }
        }),
        Just(Request::Ping),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(|t| Request::Hello { token: t.into() }),
        arb_object_request(),
    ]
}

/// Object requests: of the objects the fuzzed server's store holds (regions 1 and 2) and of
/// made-up ones, at any offset.
fn arb_object_request() -> impl Strategy<Value = Request> {
    let ino = prop_oneof![1u64..3, any::<u64>()];
    let at = (0u32..4, 0u32..300, any::<u32>()).prop_map(|(address, slot, id)| ObjectRef {
        address,
        slot,
        id,
    });
    let offset = prop_oneof![0u32..9000, any::<u32>()];
    prop_oneof![
        (ino.clone(), 0u32..10_000, 0u64..3)
            .prop_map(|(ino, len, manager)| { Request::ObjAlloc { ino, len, manager } }),
        (0u64..3, 0u32..100).prop_map(|(manager, max)| Request::ObjInherited { manager, max }),
        (ino.clone(), at.clone(), 0u64..3, 0u32..3).prop_map(|(ino, at, manager, action)| {
            Request::ObjSettle {
                manager,
                objects: vec![regions_proto::frame::SettleObject {
                    ino,
                    at,
                    settle: [Settle::Keep, Settle::KeepAndThaw, Settle::Free][action as usize],
                }],
            }
        }),
        (ino.clone(), at.clone()).prop_map(|(ino, at)| Request::ObjFree { ino, at }),
        (ino.clone(), at.clone(), offset.clone(), 0u32..9000).prop_map(|(ino, at, offset, len)| {
            Request::ObjRead {
                ino,
                at,
                offset,
                len,
            }
        }),
        (ino, at, offset, prop::collection::vec(any::<u8>(), 0..600)).prop_map(
            |(ino, at, offset, data)| Request::ObjWrite {
                ino,
                at,
                offset,
                data: data.into()
            }
        ),
        Just(Request::ObjCompact),
    ]
}

/// One piece of a connection's byte stream.
fn arb_piece() -> impl Strategy<Value = Vec<u8>> {
    let valid = (arb_request(), any::<u64>()).prop_map(|(r, id)| encode(&r, id));
    // A valid header whose sizes lie: payload_len vs the bytes sent, length vs payload.
    let lying = (
        1u8..=8,
        any::<u64>(),
        arb_offset(),
        prop_oneof![
            0u32..400,
            Just(64 << 20),
            Just((64 << 20) + 1),
            Just(u32::MAX)
        ],
        0usize..400,
        any::<u64>(),
    )
        .prop_map(|(op, length, offset, payload_len, sent, id)| {
            let header = Header {
                pool: 1,
                offset,
                length,
                payload_len,
                ..Header::new(Op::try_from(op).unwrap_or(Op::Ping), id)
            };
            let mut out = BytesMut::new();
            header.encode(&mut out);
            out.extend_from_slice(&vec![0u8; sent]);
            out.to_vec()
        });
    let random = prop::collection::vec(any::<u8>(), 0..200);
    // A valid request with one byte flipped.
    let flipped =
        (arb_request(), any::<prop::sample::Index>(), 1u8..=255).prop_map(|(r, at, x)| {
            let mut bytes = encode(&r, 9);
            let i = at.index(bytes.len());
            bytes[i] ^= x;
            bytes
        });
    prop_oneof![4 => valid, 2 => lying, 1 => random, 2 => flipped]
}

/// A connection: maybe authenticated first, then some pieces.
fn arb_script() -> impl Strategy<Value = (bool, Vec<Vec<u8>>)> {
    (
        prop::bool::weighted(0.8),
        prop::collection::vec(arb_piece(), 1..8),
    )
}

/// Sends the script, half-closes, and reads until the server closes (bounded).
fn play(addr: SocketAddr, (auth, pieces): &(bool, Vec<Vec<u8>>)) {
    let mut c = Client::connect(addr);
    c.stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    if *auth {
        c.handshake(TOKEN);
    }
    for piece in pieces {
        // The server may close early (bad frame): later writes fail, which is fine.
        if c.send_raw(piece).is_err() {
            break;
        }
    }
    let _ = c.stream.shutdown(std::net::Shutdown::Write);
    let start = Instant::now();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match std::io::Read::read(&mut c.stream, &mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the server neither answered nor closed: {e}"),
        }
        assert!(start.elapsed() < Duration::from_secs(15));
    }
}

/// A fresh connection gets exact answers.
fn check_sane(addr: SocketAddr, pools: &Pools) {
    let mut c = Client::authenticated(addr, TOKEN);
    let data: Vec<u8> = (0..C as usize + 64).map(|i| (i % 251) as u8).collect();
    let w = c.call(&Request::Write {
        pool: 1,
        offset: 3 * C - 32,
        data: Bytes::from(data.clone()),
    });
    assert_eq!(status(&w), 0);
    let r = c.call(&Request::Read {
        pool: 1,
        offset: 3 * C - 32,
        len: data.len() as u64,
    });
    assert_eq!((status(&r), &r.payload[..]), (0, &data[..]));
    let set = c.call(&Request::Cas {
        pool: 1,
        offset: 5 * C,
        expected: 0,
        new: 0,
    });
    let old = u64::from_le_bytes(set.payload[..8].try_into().unwrap());
    let add = c.call(&Request::FetchAdd {
        pool: 1,
        offset: 5 * C,
        addend: 3,
    });
    assert_eq!(
        u64::from_le_bytes(add.payload[..8].try_into().unwrap()),
        old
    );
    assert_eq!(pools.list(), vec![(1, 8 * C)]);
    assert_eq!(
        status(&c.call(&Request::Read {
            pool: 1,
            offset: 7 * C,
            len: 1
        })),
        libc::EFAULT
    );
}

fn fixture() -> (regions_daemon::transport::TransportServer, Arc<Pools>) {
    let pools = Arc::new(Pools::new());
    pools.add_pool(1, 8 * C).unwrap();
    pools.assign(1, 0, 10, 0, 6 * C).unwrap();
    let (srv, _) = server(Arc::clone(&pools), Duration::from_millis(5));
    // An object store holding objects of regions 1 and 2, for object requests to reach.
    let store = regions_daemon::objects::ObjectStore::new(1 << 20).unwrap();
    for ino in [1, 2, 1, 2] {
        let owner = regions_daemon::objects::Owner { ino, generation: 0 };
        store.alloc(owner, 100 * ino as u32).unwrap();
    }
    srv.serve_objects(Arc::new(store));
    (srv, pools)
}

proptest! {
    #![proptest_config(ProptestConfig {
        // REGIONS_FUZZ_CASES=100000 for the long run (README, "Benchmarks").
        cases: std::env::var("REGIONS_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(128),
        failure_persistence: None,
        // A failing case is shrunk for at most 60 s (a panic can leave timeouts behind).
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_and_malformed_frames_never_hurt_the_server(
        scripts in prop::collection::vec(arb_script(), 3..5),
    ) {
        install_panic_counter();
        // Counted per case, so that shrinking sees which cases panic.
        SERVER_PANICS.store(0, Ordering::SeqCst);
        let (srv, pools) = fixture();
        let addr = srv.local_addr();
        std::thread::scope(|s| {
            for script in &scripts {
                s.spawn(move || play(addr, script));
            }
        });
        check_sane(addr, &pools);
        prop_assert_eq!(SERVER_PANICS.load(Ordering::SeqCst), 0);
    }
}

#[test]
fn pure_noise_on_many_connections() {
    install_panic_counter();
    let (srv, pools) = fixture();
    let addr = srv.local_addr();
    std::thread::scope(|s| {
        for seed in 0..8u64 {
            s.spawn(move || {
                let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let noise: Vec<u8> = (0..4096)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect();
                play(addr, &(seed % 2 == 0, vec![noise]));
            });
        }
    });
    check_sane(addr, &pools);
    assert_eq!(SERVER_PANICS.load(Ordering::SeqCst), 0);
}
