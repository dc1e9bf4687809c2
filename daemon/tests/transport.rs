//! The tcp transport server over a real loopback socket, with pools built directly (no
//! manager): authentication, every op, pipelining, atomics under threads, slow peers.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use common::{Client, TOKEN, server, status};
use regions_daemon::pools::Pools;
use regions_daemon::transport::TransportConfig;
use regions_proto::frame::{HEADER_LEN, Header, Limits, Op, Range, Request};
use regions_proto::handshake::ClientHello;
use regions_proto::layout::CHUNK_SIZE;

const C: u64 = CHUNK_SIZE;

/// Pool 1 of 16 chunks: chunks 0..4 back region 10, 4..6 region 11, the rest unassigned.
fn pools() -> Arc<Pools> {
    let pools = Arc::new(Pools::new());
    pools.add_pool(1, 16 * C).unwrap();
    pools.assign(1, 0, 10, 0, 4 * C).unwrap();
    pools.assign(1, 4 * C, 11, 0, 2 * C).unwrap();
    pools
}

fn read(pool: u32, offset: u64, len: u64) -> Request {
    Request::Read { pool, offset, len }
}

fn write(pool: u32, offset: u64, data: &[u8]) -> Request {
    Request::Write {
        pool,
        offset,
        data: Bytes::copy_from_slice(data),
    }
}

fn rg(pool: u32, offset: u64, len: u64) -> Range {
    Range {
        pool,
        offset,
        len,
        delta: None,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn hello_is_required_and_checked() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let addr = srv.local_addr();

    // Anything before HELLO: EACCES, then the connection closes.
    let mut c = Client::connect(addr);
    c.send(&read(1, 0, 8));
    c.send(&Request::Ping);
    let replies = c.drain();
    assert_eq!(replies.len(), 1);
    assert_eq!(status(&replies[0]), libc::EACCES);
    assert!(replies[0].error_message().unwrap().contains("HELLO"));

    // The raw secret is no HELLO (the handshake never sends it): EACCES and closed.
    let mut c = Client::connect(addr);
    c.send(&Request::Hello {
        token: Bytes::from_static(TOKEN.as_bytes()),
    });
    let replies = c.drain();
    assert_eq!(
        replies.iter().map(status).collect::<Vec<_>>(),
        [libc::EACCES]
    );
    assert!(
        replies[0]
            .error_message()
            .unwrap()
            .contains("malformed HELLO")
    );

    // A client with a wrong secret: the daemon's challenge cannot be verified by it, and a
    // proof made with it is refused with EACCES, then the connection closes.
    let mut c = Client::connect(addr);
    let (_, open) = ClientHello::start().unwrap();
    let challenge = c.call(&Request::Hello { token: open.into() });
    assert_eq!(status(&challenge), 0);
    assert_eq!(challenge.payload.len(), 64, "server nonce + server proof");
    let mut forged = vec![regions_proto::handshake::STEP_PROOF];
    forged.extend_from_slice(&[7u8; 32]);
    c.send(&Request::Hello {
        token: forged.into(),
    });
    let replies = c.drain();
    assert_eq!(
        replies.iter().map(status).collect::<Vec<_>>(),
        [libc::EACCES]
    );
    assert!(
        replies[0]
            .error_message()
            .unwrap()
            .contains("wrong cluster secret")
    );
    // Requests between the challenge and the proof are refused too.
    let mut c = Client::connect(addr);
    let (_, open) = ClientHello::start().unwrap();
    assert_eq!(status(&c.call(&Request::Hello { token: open.into() })), 0);
    c.send(&Request::Ping);
    let replies = c.drain();
    assert_eq!(
        replies.iter().map(status).collect::<Vec<_>>(),
        [libc::EACCES]
    );

    // The right one: served.
    let mut c = Client::authenticated(addr, TOKEN);
    assert_eq!(status(&c.call(&Request::Ping)), 0);
    // A later malformed HELLO ends the connection too.
    c.send(&Request::Hello {
        token: Bytes::from_static(b"nope"),
    });
    assert_eq!(
        c.drain().iter().map(status).collect::<Vec<_>>(),
        [libc::EACCES]
    );
}

#[test]
fn connections_must_authenticate_in_time() {
    let config = TransportConfig {
        auth_timeout: Duration::from_millis(300),
        ..TransportConfig::default()
    };
    let srv = common::server_with(pools(), config);
    let addr = srv.local_addr();
    // Silent: closed after the deadline.
    let started = Instant::now();
    let mut c = Client::connect(addr);
    assert!(c.recv().is_none(), "closed without a reply");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    // Stalling after the challenge: closed too.
    let mut c = Client::connect(addr);
    let (_, open) = ClientHello::start().unwrap();
    assert_eq!(status(&c.call(&Request::Hello { token: open.into() })), 0);
    assert!(c.recv().is_none());
    // Authenticated connections may stay idle longer.
    let mut c = Client::authenticated(addr, TOKEN);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(status(&c.call(&Request::Ping)), 0);
}

#[test]
fn read_write_readv_writev_round_trip() {
    let pools = pools();
    let (srv, stats) = server(Arc::clone(&pools), Duration::from_millis(50));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);

    // A write spanning chunks 1..=4 (two regions), read back whole and in pieces.
    let data = pattern(3 * C as usize + 100, 7);
    let reply = c.call(&write(1, C - 50, &data));
    assert_eq!(status(&reply), 0, "{:?}", reply.error_message());
    let reply = c.call(&read(1, C - 50, data.len() as u64));
    assert_eq!(status(&reply), 0);
    assert_eq!(&reply.payload[..], &data[..]);
    // The bytes are in the segments at region offsets.
    let mut seg = [0u8; 100];
    pools
        .segment(11)
        .unwrap()
        .read_at(0, &mut seg[..50])
        .unwrap();
    assert_eq!(&seg[..50], &data[data.len() - 50..]);

    let ranges = vec![rg(1, 5, 10), rg(1, 4 * C + 1, 3), rg(1, 5, 2), rg(1, 0, 0)];
    let reply = c.call(&Request::ReadV {
        ranges: ranges.clone(),
    });
    assert_eq!(status(&reply), 0);
    assert_eq!(reply.payload.len(), 15);

    let wv = Request::WriteV {
        ranges: vec![rg(1, 100, 4), rg(1, 5 * C + 7, 3)],
        data: Bytes::from_static(b"abcdxyz"),
    };
    assert_eq!(status(&c.call(&wv)), 0);
    let reply = c.call(&Request::ReadV {
        ranges: vec![rg(1, 5 * C + 7, 3), rg(1, 100, 4)],
    });
    assert_eq!(&reply.payload[..], b"xyzabcd");

    // A big read: larger than socket buffers, read slowly by the client.
    let big = pattern(4 * C as usize, 3);
    assert_eq!(status(&c.call(&write(1, 0, &big))), 0);
    let id = c.send(&read(1, 0, big.len() as u64));
    std::thread::sleep(Duration::from_millis(100));
    let reply = c.recv().unwrap();
    assert_eq!(reply.header.request_id, id);
    assert_eq!(&reply.payload[..], &big[..]);

    let s = stats.snapshot(1, &pools, None, 0);
    assert_eq!(s.transport_requests, 9, "two hello steps + 7 requests");
    assert!(s.transport_bytes_read >= (data.len() + big.len()) as u64);
    assert!(s.transport_bytes_written >= (data.len() + big.len() + 7) as u64);
    assert_eq!(s.transport_connections, 1);
}

/// A WRITEV whose payload is larger than a connection's input buffer (256 KiB) and smaller
/// than the piece its in-memory copy grows by (1 MiB): rmsync of scattered dirty pages sends
/// such requests. The connection used to panic growing the buffer, and the write was lost.
#[test]
fn writev_payload_between_the_input_buffer_and_a_piece() {
    let pools = pools();
    let (srv, _) = server(Arc::clone(&pools), Duration::from_millis(50));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    // 90 ranges of 4 KiB, every other page of chunks 0..=5 (assigned): 360 KiB of payload.
    let ranges: Vec<_> = (0..90u64).map(|i| rg(1, i * 8192, 4096)).collect();
    let data = pattern(90 * 4096, 11);
    let reply = c.call(&Request::WriteV {
        ranges: ranges.clone(),
        data: Bytes::from(data.clone()),
    });
    assert_eq!(status(&reply), 0, "{:?}", reply.error_message());
    let reply = c.call(&Request::ReadV { ranges });
    assert_eq!(status(&reply), 0);
    assert!(
        reply.payload[..] == data[..],
        "the scattered pages read back"
    );
    // The connection still serves.
    assert_eq!(status(&c.call(&Request::Ping)), 0);
}

#[test]
fn errors_are_replies_with_errnos() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    let cases = [
        (read(2, 0, 8), libc::ENOENT),           // unknown pool
        (read(1, 6 * C, 8), libc::EFAULT),       // unassigned chunk
        (read(1, 6 * C - 4, 8), libc::EFAULT),   // runs into an unassigned chunk
        (read(1, 16 * C - 4, 8), libc::EFAULT),  // past the end of the pool
        (write(1, 7 * C, b"x"), libc::EFAULT),   // write to an unassigned chunk
        (write(1, 16 * C, b"xy"), libc::EFAULT), // write past the end
        (write(9, 0, b"xy"), libc::ENOENT),      // write to an unknown pool
        (
            Request::ReadV {
                ranges: vec![rg(1, 0, 1), rg(1, 9 * C, 1)],
            },
            libc::EFAULT,
        ),
        (
            Request::Cas {
                pool: 1,
                offset: 6 * C,
                expected: 0,
                new: 1,
            },
            libc::EFAULT,
        ),
    ];
    for (req, errno) in cases {
        let reply = c.call(&req);
        assert_eq!(
            status(&reply),
            errno,
            "{req:?}: {:?}",
            reply.error_message()
        );
    }
    // Malformed requests with intact framing: EINVAL, and the connection goes on.
    let misaligned = Request::FetchAdd {
        pool: 1,
        offset: 12,
        addend: 1,
    };
    assert_eq!(status(&c.call(&misaligned)), libc::EINVAL);
    let mut lying = write(1, 0, b"abcd").to_frame(77, 0);
    lying.header.length = 3;
    let mut out = BytesMut::new();
    lying.encode(&mut out);
    c.send_raw(&out).unwrap();
    let reply = c.recv().unwrap();
    assert_eq!(
        (reply.header.request_id, status(&reply)),
        (77, libc::EINVAL)
    );
    let mut read_with_payload = read(1, 0, 4).to_frame(78, 0);
    read_with_payload.payload = Bytes::from_static(b"zz");
    let mut out = BytesMut::new();
    read_with_payload.encode(&mut out);
    c.send_raw(&out).unwrap();
    assert_eq!(status(&c.recv().unwrap()), libc::EINVAL);
    assert_eq!(status(&c.call(&read(1, 0, 4))), 0);

    // A frame that cannot be decoded closes the connection.
    let mut bad = [0u8; HEADER_LEN];
    bad[0] = 0x12;
    c.send_raw(&bad).unwrap();
    assert!(c.drain().is_empty());
    // Others are unaffected.
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    assert_eq!(status(&c.call(&Request::Ping)), 0);
}

#[test]
fn a_request_waits_for_a_late_assignment() {
    let pools = pools();
    let (srv, _) = server(Arc::clone(&pools), Duration::from_secs(5));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    let id = c.send(&write(1, 8 * C + 3, b"late"));
    std::thread::sleep(Duration::from_millis(100));
    pools.assign(1, 8 * C, 12, 0, C).unwrap();
    let reply = c.recv().unwrap();
    assert_eq!((reply.header.request_id, status(&reply)), (id, 0));
    assert_eq!(&c.call(&read(1, 8 * C + 3, 4)).payload[..], b"late");

    // Without an assignment the wait is bounded: EFAULT.
    let (srv, _) = server(Arc::clone(&pools), Duration::from_millis(200));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    let start = Instant::now();
    assert_eq!(status(&c.call(&read(1, 9 * C, 4))), libc::EFAULT);
    assert!(start.elapsed() >= Duration::from_millis(200));
}

#[test]
fn pipelined_requests_are_answered_by_id() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    let mut expected = Vec::new();
    for i in 0..200u64 {
        let offset = i * 1000;
        let data = pattern(100, i as u8);
        let wid = c.send(&write(1, offset, &data));
        let rid = c.send(&read(1, offset, 100));
        let pid = c.send(&Request::Ping);
        expected.push((wid, Vec::new()));
        expected.push((rid, data));
        expected.push((pid, Vec::new()));
    }
    for (id, payload) in expected {
        let reply = c.recv().unwrap();
        assert_eq!(reply.header.request_id, id);
        assert!(reply.is_reply());
        assert_eq!(status(&reply), 0);
        assert_eq!(&reply.payload[..], &payload[..]);
    }
}

#[test]
fn atomics_are_exact_under_four_threads() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let addr = srv.local_addr();
    const OPS: u64 = 10_000;
    let word = |offset| Request::FetchAdd {
        pool: 1,
        offset,
        addend: 0,
    };
    let successes: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(move || {
                    let mut c = Client::authenticated(addr, TOKEN);
                    for _ in 0..OPS {
                        let r = c.call(&Request::FetchAdd {
                            pool: 1,
                            offset: 4 * C + 64,
                            addend: 1,
                        });
                        assert_eq!(status(&r), 0);
                    }
                    // CAS increments: `OPS` attempts, counting the ones that won.
                    let mut seen = 0u64;
                    let mut won = 0;
                    for _ in 0..OPS {
                        let r = c.call(&Request::Cas {
                            pool: 1,
                            offset: 2 * C + 8,
                            expected: seen,
                            new: seen + 1,
                        });
                        let old = u64::from_le_bytes(r.payload[..8].try_into().unwrap());
                        if old == seen {
                            won += 1;
                            seen += 1;
                        } else {
                            seen = old;
                        }
                    }
                    won
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut c = Client::authenticated(addr, TOKEN);
    let value = |c: &mut Client, offset| {
        let r = c.call(&word(offset));
        u64::from_le_bytes(r.payload[..8].try_into().unwrap())
    };
    assert_eq!(value(&mut c, 4 * C + 64), 4 * OPS);
    assert_eq!(value(&mut c, 2 * C + 8), successes.iter().sum::<u64>());
    assert!(successes.iter().sum::<u64>() >= OPS);
}

#[test]
fn a_slow_reader_never_holds_up_a_release() {
    let pools = Arc::new(Pools::new());
    pools.add_pool(1, 64 * C).unwrap();
    pools.assign(1, 0, 1, 0, 64 * C).unwrap();
    let (srv, _) = server(Arc::clone(&pools), Duration::from_millis(50));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    // 8 MiB: far more than the socket buffers hold while the client does not read.
    c.send(&read(1, 0, 64 * C));
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    pools.release(1, 0, 1, 0, 64 * C).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "the release waited for the slow reader"
    );
    // The reply cannot be completed from released memory: the connection closes early.
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match std::io::Read::read(&mut c.stream, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    assert!(got < HEADER_LEN + (64 * C) as usize);
}

#[test]
fn a_slow_writer_never_holds_up_a_release() {
    let pools = Arc::new(Pools::new());
    pools.add_pool(1, 8 * C).unwrap();
    pools.assign(1, 0, 1, 0, 8 * C).unwrap();
    let (srv, _) = server(Arc::clone(&pools), Duration::from_millis(50));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    // The header and a first part of a write; the rest comes after a release.
    let header = Header {
        pool: 1,
        offset: 0,
        length: 2 * C,
        payload_len: 2 * C as u32,
        ..Header::new(Op::Write, 5)
    };
    let mut out = BytesMut::new();
    header.encode(&mut out);
    out.put_bytes(1, 1000);
    c.send_raw(&out).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    pools.release(1, 0, 1, 0, 8 * C).unwrap();
    assert!(start.elapsed() < Duration::from_secs(1));
    c.send_raw(&vec![2u8; 2 * C as usize - 1000]).unwrap();
    let reply = c.recv().unwrap();
    assert_eq!((reply.header.request_id, status(&reply)), (5, libc::EFAULT));
    // The connection is still in step.
    assert_eq!(status(&c.call(&Request::Ping)), 0);
}

/// Rough loopback numbers: `cargo test --release -p regions-daemon --test transport -- --ignored
/// --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn loopback_latency_and_throughput() {
    let pools = Arc::new(Pools::new());
    pools.add_pool(1, 512 * C).unwrap();
    pools.assign(1, 0, 1, 0, 512 * C).unwrap();
    let (srv, _) = server(Arc::clone(&pools), Duration::from_millis(50));
    let mut c = Client::authenticated(srv.local_addr(), TOKEN);
    let n = 20_000;
    let start = Instant::now();
    for i in 0..n {
        c.call(&read(1, (i % 512) * 4096, 4096));
    }
    let small = start.elapsed() / n as u32;
    let big = 64 * C;
    let rounds = 40;
    let start = Instant::now();
    for _ in 0..rounds {
        assert_eq!(c.call(&read(1, 0, big)).payload.len() as u64, big);
    }
    let read_gbs = (big * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9;
    let data = vec![5u8; big as usize];
    let start = Instant::now();
    for _ in 0..rounds {
        assert_eq!(status(&c.call(&write(1, 0, &data))), 0);
    }
    let write_gbs = (big * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9;
    eprintln!(
        "4 KiB read round trip: {small:?}; 8 MiB reads: {read_gbs:.2} GB/s; 8 MiB writes: \
         {write_gbs:.2} GB/s"
    );
}

#[test]
fn wait_change_answers_when_an_atomic_changes_the_word_or_at_its_timeout() {
    let (srv, _) = server(pools(), Duration::from_millis(50));
    let addr = srv.local_addr();
    let value = |f: &regions_proto::frame::Frame| {
        assert_eq!(status(f), 0);
        u64::from_le_bytes(f.payload[..8].try_into().unwrap())
    };
    let wait = |expected, timeout_us| Request::WaitChange {
        pool: 1,
        offset: 3 * C + 16,
        expected,
        timeout_us,
    };
    let mut waiter = Client::authenticated(addr, TOKEN);
    // Unchanged: the reply comes at the timeout, with the same value.
    let start = Instant::now();
    assert_eq!(value(&waiter.call(&wait(0, 50_000))), 0);
    assert!(start.elapsed() >= Duration::from_millis(45));
    // A value other than the expected one: at once.
    let start = Instant::now();
    assert_eq!(value(&waiter.call(&wait(9, 5_000_000))), 0);
    assert!(start.elapsed() < Duration::from_secs(4));
    // A fetch-add on another connection ends a long wait early.
    let adder = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let mut c = Client::authenticated(addr, TOKEN);
        c.call(&Request::FetchAdd {
            pool: 1,
            offset: 3 * C + 16,
            addend: 5,
        })
    });
    let start = Instant::now();
    assert_eq!(value(&waiter.call(&wait(0, 5_000_000))), 5);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(90) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    assert_eq!(status(&adder.join().unwrap()), 0);
    // Misaligned words are refused like other atomics.
    let r = waiter.call(&Request::WaitChange {
        pool: 1,
        offset: 3,
        expected: 0,
        timeout_us: 1000,
    });
    assert_eq!(status(&r), libc::EINVAL);
}

/// Raises this process's limit of open files to `n` (tests run as root, who may).
fn raise_fd_limit(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    if lim.rlim_cur >= n {
        return;
    }
    let want = libc::rlimit {
        rlim_cur: n,
        rlim_max: lim.rlim_max.max(n),
    };
    // SAFETY: setrlimit reads the rlimit we own; it changes only this process's limit.
    let r = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) };
    assert_eq!(
        r,
        0,
        "raise RLIMIT_NOFILE to {n}: {}",
        std::io::Error::last_os_error()
    );
}

/// The median round trip of `n` pings on `c`.
fn median_ping(c: &mut Client, n: usize) -> Duration {
    let mut times: Vec<Duration> = (0..n)
        .map(|_| {
            let started = Instant::now();
            assert_eq!(status(&c.call(&Request::Ping)), 0);
            started.elapsed()
        })
        .collect();
    times.sort();
    times[n / 2]
}

/// A header announcing `op` with a payload of `len` bytes.
fn raw_header(op: Op, len: u32) -> Vec<u8> {
    let mut out = BytesMut::new();
    Header {
        pool: 1,
        payload_len: len,
        ..Header::new(op, 1)
    }
    .encode(&mut out);
    out.to_vec()
}

/// What follows `prefix` on the next line from `lines` that has it (bounded wait).
fn next_with(lines: &std::sync::mpsc::Receiver<String>, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("the flood server never said {prefix:?}"));
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.trim().to_owned();
        }
    }
}

/// The flood server (`regions-transport-server`): its process, address and output lines.
struct FloodServer {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    lines: std::sync::mpsc::Receiver<String>,
}

impl FloodServer {
    fn start(budget: u64) -> FloodServer {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new(env!("CARGO_BIN_EXE_regions-transport-server"))
            .args(["--payload-budget", &budget.to_string()])
            .env("REGIONS_SECRET_TOKEN", TOKEN)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "off".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        let addr = next_with(&lines, "addr ").parse().unwrap();
        FloodServer { child, addr, lines }
    }

    /// Connections open at the server now.
    fn open(&mut self) -> usize {
        writeln!(self.child.stdin.as_mut().unwrap()).unwrap();
        next_with(&self.lines, "open ").parse().unwrap()
    }

    /// The server's resident memory.
    fn rss(pid: u32) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            << 10
    }
}

impl Drop for FloodServer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// 2,000 connections that never authenticate, 50 announcing maximum-size HELLOs and 50
/// authenticated ones streaming into maximum-size frames, against a transport server in a
/// process of its own: it keeps at most its cap of waiting connections (the oldest make room),
/// its resident memory grows by at most its payload budget and its buffers, and an
/// authenticated client is served throughout, as is a new one. (Latency under the flood is
/// printed, not asserted.)
#[test]
fn a_flood_of_connections_leaves_authenticated_clients_served() {
    raise_fd_limit(8192);
    let budget: u64 = 64 << 20;
    let caps = regions_daemon::transport::admission::Limits::default();
    let mut server = FloodServer::start(budget);
    let (addr, pid) = (server.addr, server.child.id());
    let mut c = Client::authenticated(addr, TOKEN);
    let unloaded = median_ping(&mut c, 200);
    let rss_before = FloodServer::rss(pid);
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(rss_before));
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (Arc::clone(&peak), Arc::clone(&sampling));
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(FloodServer::rss(pid), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };

    let idle: Vec<TcpStream> = (0..2000)
        .map(|i| TcpStream::connect(addr).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    let max = Limits::default().max_payload;
    let hellos: Vec<TcpStream> = (0..50)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(&raw_header(Op::Hello, max));
            s
        })
        .collect();
    let junk = Arc::new(vec![0x5au8; 1 << 20]);
    let writers: Vec<_> = (0..50)
        .map(|_| {
            let w = Client::authenticated(addr, TOKEN);
            let junk = Arc::clone(&junk);
            std::thread::spawn(move || {
                let mut s = w.stream;
                s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
                let _ = s.write_all(&raw_header(Op::WriteV, max));
                for _ in 0..8 {
                    if s.write_all(&junk).is_err() {
                        break;
                    }
                }
                s
            })
        })
        .collect();
    let loaded = median_ping(&mut c, 200);
    let mut fresh = Client::authenticated(addr, TOKEN);
    assert_eq!(
        status(&fresh.call(&Request::Ping)),
        0,
        "a new client during the flood"
    );
    let writers: Vec<TcpStream> = writers.into_iter().map(|t| t.join().unwrap()).collect();
    let open = server.open();
    assert_eq!(
        status(&c.call(&Request::Ping)),
        0,
        "still served after the flood"
    );
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let grew = peak
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(rss_before);
    eprintln!(
        "flood: ping {unloaded:?} unloaded, {loaded:?} under 2,100 connections ({:.1}x); \
         {open} connections open at the server; its resident memory peaked {} MiB above the start",
        loaded.as_secs_f64() / unloaded.as_secs_f64().max(1e-9),
        grew >> 20
    );
    assert!(
        open <= caps.max_unauthenticated + writers.len() + 2 + 16,
        "{open} connections open at the server: waiting ones are not capped at {}",
        caps.max_unauthenticated
    );
    // The budget, the input buffers of 52 authenticated connections (256 KiB each), and the
    // stacks of the connection threads.
    let bound = budget + 52 * (256 << 10) + (48 << 20);
    assert!(
        grew < bound,
        "the server's resident memory grew by {} MiB under the flood (bound {} MiB)",
        grew >> 20,
        bound >> 20
    );
    drop((idle, hellos, writers));
}

/// An authenticated connection that sends nothing for the idle timeout, or stops inside a
/// frame for the I/O timeout, is closed; one that keeps talking is not.
#[test]
fn silent_and_stalled_connections_are_closed() {
    let config = TransportConfig {
        io_timeout: Duration::from_millis(100),
        idle_timeout: Duration::from_millis(500),
        ..TransportConfig::default()
    };
    let srv = common::server_with(pools(), config);
    let addr = srv.local_addr();
    let mut busy = Client::authenticated(addr, TOKEN);
    let mut silent = Client::authenticated(addr, TOKEN);
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(
            status(&busy.call(&Request::Ping)),
            0,
            "a talking client stays"
        );
    }
    silent.send(&Request::Ping);
    assert!(silent.recv().is_none(), "closed after 1.2 s of silence");

    let mut stalled = Client::authenticated(addr, TOKEN);
    let header = raw_header(Op::Read, 0);
    stalled.send_raw(&header[..HEADER_LEN / 2]).unwrap();
    let started = Instant::now();
    assert!(stalled.recv().is_none(), "closed inside a frame");
    assert!(started.elapsed() < Duration::from_secs(5));
}
