//! The tcp transport client: blocking sockets (lowest latency for one
//! request), a pool of authenticated connections per daemon, pipelined
//! requests for large or many ranges, bounded retries on broken connections.

use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use metrics::counter;
use regions_proto::auth::Secret;
use regions_proto::frame::{FLAG_REPLY, HEADER_LEN, Header, Op, RANGE_LEN, WordAt, range_delta};
use regions_proto::handshake::{CHALLENGE_REPLY_LEN, ClientHello};
use std::borrow::Cow;

use super::{Completion, Span, Transport, TransportStats};
use crate::error::{RegionsError, Result};

mod posted;

/// Largest payload of one READ or WRITE request.
const MAX_IO: u64 = 4 << 20;
/// Ranges smaller than this are batched into vector requests.
const SMALL_RANGE: u64 = 64 << 10;
/// Most ranges in one vector request.
const MAX_VECTOR_RANGES: usize = 4096;
/// Most bytes one vector request moves.
const MAX_VECTOR_BYTES: u64 = 1 << 20;
/// Requests in flight on one connection.
const PIPELINE: usize = 8;
/// Idle connections kept per daemon.
const MAX_IDLE: usize = 16;

/// How long and how often to retry a daemon that does not answer.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Give up (EIO) once this much time has passed.
    pub deadline: Duration,
    /// First pause between attempts (doubles, at most 500 ms).
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    /// Gives up after 4.5 s, so that with the request's own overhead (a FUSE
    /// round trip, a page fault) the caller sees `EIO` within 5 s.
    fn default() -> Self {
        RetryPolicy {
            deadline: Duration::from_millis(4500),
            backoff: Duration::from_millis(20),
        }
    }
}

/// One authenticated connection.
struct Conn {
    stream: TcpStream,
    /// [`Auth::generation`] it authenticated with.
    generation: u64,
}

/// What connections present in HELLO: a capability token stored under `cap_id` and named in
/// every request (with `cap_id` 0 connections prove the cluster secret instead, see
/// [`TcpTransport::new`]).
struct Auth {
    token: Bytes,
    /// Bumped when the token is renewed: older connections are not reused.
    generation: u64,
}

/// Why an attempt failed: worth retrying on a new connection, or final.
enum Failure {
    Retry(String),
    Final(RegionsError),
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        Failure::Retry(e.to_string())
    }
}

/// A request waiting for its reply.
struct Pending {
    id: u64,
    /// Where the reply's payload goes in the caller's buffer.
    dst: std::ops::Range<usize>,
}

/// The tcp transport to one daemon.
pub struct TcpTransport {
    addr: String,
    auth: Mutex<Auth>,
    /// `auth.cap_id`, readable without the lock.
    cap_id: u64,
    /// The cluster secret, proven (never sent) when `cap_id` is 0.
    secret: Option<Secret>,
    idle: Mutex<Vec<Conn>>,
    next_id: AtomicU64,
    retry: RetryPolicy,
    stats: Arc<TransportStats>,
    /// Set when a request gave up on the daemon, cleared when it answers again: meanwhile
    /// requests fail at once for [`QUIET`] after the last failure, then one makes a quick
    /// attempt ([`PROBE`]) instead of retrying for the whole deadline, so that a caller
    /// issuing several requests (a FUSE read, then the same page again) gets `EIO` once
    /// within the bound, not once per request.
    down: std::sync::atomic::AtomicBool,
    /// When the daemon last failed a request while `down`.
    down_at: Mutex<Instant>,
    /// Posted atomics and writes, and the replies they are owed.
    lane: Arc<posted::Lane>,
}

/// Counts a request that failed because its daemon is unreachable (the caller sees `EIO`):
/// `gave_up` after retrying up to the bound, `down` at once (the daemon failed moments ago),
/// `not_idempotent` after a broken connection that a retry could have applied twice.
fn count_unreachable(reason: &'static str) {
    counter!("regions_client_unreachable_total", "reason" => reason).increment(1);
}

/// The deadline of a request to a daemon known to be unreachable.
const PROBE: Duration = Duration::from_millis(500);
/// How long after a failure requests to an unreachable daemon fail without an attempt.
const QUIET: Duration = Duration::from_secs(1);

impl TcpTransport {
    /// A transport to the daemon at `addr` ("host:port") whose connections prove the cluster
    /// `secret` with the challenge–response HELLO ([`regions_proto::handshake`]); the secret
    /// itself is never sent.
    pub fn new(
        addr: &str,
        secret: &Secret,
        retry: RetryPolicy,
        stats: Arc<TransportStats>,
    ) -> TcpTransport {
        TcpTransport {
            secret: Some(secret.clone()),
            ..Self::with_capability(addr, 0, &[], retry, stats)
        }
    }

    /// A transport to the daemon at `addr` that presents the capability `token` under id
    /// `cap_id` (nonzero) and names it in every request (application sessions).
    pub fn with_capability(
        addr: &str,
        cap_id: u64,
        token: &[u8],
        retry: RetryPolicy,
        stats: Arc<TransportStats>,
    ) -> TcpTransport {
        TcpTransport {
            addr: addr.to_owned(),
            auth: Mutex::new(Auth {
                token: Bytes::copy_from_slice(token),
                generation: 0,
            }),
            cap_id,
            secret: None,
            idle: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            retry,
            stats,
            down: std::sync::atomic::AtomicBool::new(false),
            down_at: Mutex::new(Instant::now()),
            lane: Arc::default(),
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Replaces the token (a renewed capability): new connections present it, idle ones are
    /// dropped, busy ones are not pooled again.
    pub fn set_token(&self, token: &[u8]) {
        if let Ok(mut auth) = self.auth.lock() {
            auth.token = Bytes::copy_from_slice(token);
            auth.generation += 1;
        }
        if let Ok(mut idle) = self.idle.lock() {
            idle.clear();
        }
    }

    /// How many times the token was replaced ([`TcpTransport::set_token`]).
    pub(crate) fn generation(&self) -> u64 {
        self.auth.lock().map_or(0, |a| a.generation)
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn connect(&self, timeout: Duration, io_timeout: Duration) -> Result<Conn, Failure> {
        let addr = self
            .addr
            .to_socket_addrs()
            .map_err(|e| {
                Failure::Final(RegionsError::io(
                    format!("cannot resolve daemon address {}", self.addr),
                    e,
                ))
            })?
            .next()
            .ok_or_else(|| {
                Failure::Final(RegionsError::Invalid(format!(
                    "daemon address {} resolves to nothing",
                    self.addr
                )))
            })?;
        let stream = TcpStream::connect_timeout(&addr, timeout.max(Duration::from_millis(10)))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        let (token, generation) = match self.auth.lock() {
            Ok(a) => (a.token.clone(), a.generation),
            Err(_) => (Bytes::new(), 0),
        };
        let mut conn = Conn { stream, generation };
        match (self.cap_id, &self.secret) {
            (0, Some(secret)) => self.prove_secret(&mut conn.stream, secret)?,
            (0, None) => {
                return Err(Failure::Final(RegionsError::Invalid(
                    "a transport without capability needs the cluster secret".into(),
                )));
            }
            _ => {
                self.hello(&mut conn.stream, &token)?;
            }
        }
        TransportStats::add(&self.stats.connections, 1);
        Ok(conn)
    }

    /// Sends one HELLO with `payload` and returns the payload of the daemon's (ok) reply.
    fn hello(&self, stream: &mut TcpStream, payload: &[u8]) -> Result<Vec<u8>, Failure> {
        let mut hello = Header::new(Op::Hello, self.id());
        hello.capability = self.cap_id;
        hello.payload_len = payload.len() as u32;
        send(stream, &hello, &[payload])?;
        let reply = recv_header(stream)?;
        if reply.status != 0 {
            let msg = recv_message(stream, &reply)?;
            return Err(Failure::Final(self.daemon_error(reply.status, &msg)));
        }
        if reply.payload_len as usize > CHALLENGE_REPLY_LEN {
            return Err(Failure::Final(RegionsError::Protocol {
                peer: self.addr.clone(),
                reason: format!("HELLO reply of {} bytes", reply.payload_len),
            }));
        }
        let mut out = vec![0u8; reply.payload_len as usize];
        stream.read_exact(&mut out)?;
        Ok(out)
    }

    /// The cluster-secret handshake: the daemon proves the secret to us, then we to it.
    fn prove_secret(&self, stream: &mut TcpStream, secret: &Secret) -> Result<(), Failure> {
        let refused = |e: regions_proto::handshake::HelloError| {
            Failure::Final(self.daemon_error(libc::EACCES as u32, &e.to_string()))
        };
        let (hello, open) = ClientHello::start().map_err(refused)?;
        let challenge = self.hello(stream, &open)?;
        let answer = hello.answer(secret, &challenge).map_err(refused)?;
        self.hello(stream, &answer)?;
        Ok(())
    }

    fn daemon_error(&self, status: u32, message: &str) -> RegionsError {
        daemon_error(&self.addr, status, message)
    }

    /// Whether the daemon failed a request recently (see `down`).
    /// Whether a request gave up on the daemon lately (until one gets through again).
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// Notes that the daemon did not answer within the retry bound (see `down`).
    fn mark_down(&self) {
        if let Ok(mut at) = self.down_at.lock() {
            *at = Instant::now();
        }
        if !self.down.swap(true, Ordering::Relaxed) {
            tracing::warn!(addr = %self.addr, "daemon unreachable; giving up (further requests make one quick attempt until it answers)");
            if let Ok(mut idle) = self.idle.lock() {
                idle.clear();
            }
        }
    }

    /// The error of a connection attempt that failed.
    fn failure_error(&self, failure: Failure) -> RegionsError {
        match failure {
            Failure::Final(e) => e,
            Failure::Retry(reason) => RegionsError::DaemonUnreachable {
                addr: self.addr.clone(),
                attempts: 1,
                elapsed_ms: 0,
                reason,
            },
        }
    }

    /// Runs `op` on a pooled connection, retrying on a fresh connection
    /// while the deadline allows. `idempotent` ops are retried after a
    /// failure mid-request; others only when the connection failed before
    /// anything was sent.
    fn with_conn<T>(
        &self,
        idempotent: bool,
        mut op: impl FnMut(&mut Conn) -> Result<T, Failure>,
    ) -> Result<T> {
        let start = Instant::now();
        let mut backoff = self.retry.backoff;
        let mut attempts = 0u32;
        let down = self.down.load(Ordering::Relaxed);
        if down && let Ok(mut at) = self.down_at.lock() {
            let since = at.elapsed();
            if since < QUIET {
                count_unreachable("down");
                return Err(RegionsError::DaemonUnreachable {
                    addr: self.addr.clone(),
                    attempts: 0,
                    elapsed_ms: 0,
                    reason: format!(
                        "it failed {} ms ago; not tried again for {} ms",
                        since.as_millis(),
                        QUIET.as_millis()
                    ),
                });
            }
            // This request probes; others keep failing at once meanwhile.
            *at = Instant::now();
        }
        let deadline = if down {
            self.retry.deadline.min(PROBE)
        } else {
            self.retry.deadline
        };
        let answered = || {
            if down && self.down.swap(false, Ordering::Relaxed) {
                tracing::info!(addr = %self.addr, "daemon reachable again");
            }
        };
        loop {
            attempts += 1;
            let remaining = deadline.saturating_sub(start.elapsed());
            let pooled = self.idle.lock().ok().and_then(|mut idle| idle.pop());
            let (conn, fresh) = match pooled {
                Some(c) => (Ok(c), false),
                None => (self.connect(remaining, deadline), true),
            };
            let reason = match conn {
                Ok(mut conn) => match op(&mut conn) {
                    Ok(v) => {
                        answered();
                        // A probe's connection has probe timeouts: not kept.
                        let current = conn.generation == self.generation() && !down;
                        if let Ok(mut idle) = self.idle.lock()
                            && idle.len() < MAX_IDLE
                            && current
                        {
                            idle.push(conn);
                        }
                        return Ok(v);
                    }
                    Err(Failure::Final(e)) => {
                        answered();
                        return Err(e);
                    }
                    // A pooled connection may have gone stale: one free retry.
                    Err(Failure::Retry(r)) if !fresh && attempts == 1 => {
                        tracing::debug!(addr = %self.addr, reason = %r, "stale connection, reconnecting");
                        continue;
                    }
                    Err(Failure::Retry(r)) if !idempotent => {
                        count_unreachable("not_idempotent");
                        return Err(RegionsError::DaemonUnreachable {
                            addr: self.addr.clone(),
                            attempts,
                            elapsed_ms: start.elapsed().as_millis() as u64,
                            reason: format!("{r} (not retried: the operation is not idempotent)"),
                        });
                    }
                    Err(Failure::Retry(r)) => r,
                },
                Err(Failure::Final(e)) => return Err(e),
                Err(Failure::Retry(r)) => r,
            };
            if start.elapsed() + backoff >= deadline {
                tracing::debug!(addr = %self.addr, attempts, reason = %reason, "giving up on the daemon");
                self.mark_down();
                count_unreachable("gave_up");
                return Err(RegionsError::DaemonUnreachable {
                    addr: self.addr.clone(),
                    attempts,
                    elapsed_ms: start.elapsed().as_millis() as u64,
                    reason,
                });
            }
            tracing::debug!(addr = %self.addr, attempts, reason = %reason, "retrying daemon");
            counter!("regions_client_transport_retries_total").increment(1);
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// Sends the requests built by `requests` with up to [`PIPELINE`] in
    /// flight and reads each reply's payload into `dst`.
    fn pipeline(
        &self,
        conn: &mut Conn,
        requests: &[IoRequest<'_>],
        dst: &mut [u8],
    ) -> Result<(), Failure> {
        let mut pending: VecDeque<Pending> = VecDeque::new();
        let mut next = 0;
        while next < requests.len() || !pending.is_empty() {
            while next < requests.len() && pending.len() < PIPELINE {
                let r = &requests[next];
                let id = self.id();
                let mut header = r.header;
                header.request_id = id;
                header.capability = self.cap_id;
                let payload: Vec<&[u8]> = r.payload.iter().map(|p| &p[..]).collect();
                send(&mut conn.stream, &header, &payload)?;
                TransportStats::add(&self.stats.remote_requests, 1);
                pending.push_back(Pending {
                    id,
                    dst: r.reply_into.clone(),
                });
                next += 1;
            }
            let Some(p) = pending.pop_front() else { break };
            let reply = recv_header(&mut conn.stream)?;
            if reply.request_id != p.id {
                return Err(Failure::Retry(format!(
                    "reply to request {} while waiting for {}",
                    reply.request_id, p.id
                )));
            }
            if reply.status != 0 {
                let msg = recv_message(&mut conn.stream, &reply)?;
                // Drain the other replies so the connection stays usable.
                for q in pending.drain(..) {
                    let h = recv_header(&mut conn.stream)?;
                    let _ = q;
                    skip_payload(&mut conn.stream, &h)?;
                }
                return Err(Failure::Final(self.daemon_error(reply.status, &msg)));
            }
            let want = p.dst.len();
            if reply.payload_len as usize != want {
                return Err(Failure::Retry(format!(
                    "reply of {} bytes to a request for {want}",
                    reply.payload_len
                )));
            }
            conn.stream.read_exact(&mut dst[p.dst])?;
        }
        Ok(())
    }
}

/// One request to send: a header and its payload pieces, and where its
/// reply's payload goes.
struct IoRequest<'a> {
    header: Header,
    payload: Vec<Cow<'a, [u8]>>,
    reply_into: std::ops::Range<usize>,
}

/// Splits spans into READ/WRITE requests of at most [`MAX_IO`] bytes, and
/// batches small spans into vector requests.
fn plan_requests<'a>(spans: &[Span], write: Option<&'a [u8]>) -> Vec<IoRequest<'a>> {
    let mut out = Vec::new();
    let mut cursor = 0usize; // offset in the caller's buffer
    let mut batch: Vec<(Span, usize)> = Vec::new();
    let mut batch_bytes = 0u64;
    let flush =
        |batch: &mut Vec<(Span, usize)>, batch_bytes: &mut u64, out: &mut Vec<IoRequest<'a>>| {
            if batch.is_empty() {
                return;
            }
            out.push(vector_request(batch, write));
            batch.clear();
            *batch_bytes = 0;
        };
    for span in spans {
        if span.len < SMALL_RANGE {
            if batch.len() >= MAX_VECTOR_RANGES || batch_bytes + span.len > MAX_VECTOR_BYTES {
                flush(&mut batch, &mut batch_bytes, &mut out);
            }
            batch.push((*span, cursor));
            batch_bytes += span.len;
            cursor += span.len as usize;
            continue;
        }
        flush(&mut batch, &mut batch_bytes, &mut out);
        let mut done = 0u64;
        while done < span.len {
            let len = (span.len - done).min(MAX_IO);
            let at = cursor + done as usize;
            let mut header = Header::new(if write.is_some() { Op::Write } else { Op::Read }, 0);
            name_region(&mut header, span);
            header.pool = span.pool;
            header.offset = span.pool_offset + done;
            header.length = len;
            let (payload, reply_into) = match write {
                Some(src) => {
                    header.payload_len = len as u32;
                    (vec![Cow::Borrowed(&src[at..at + len as usize])], 0..0)
                }
                None => (Vec::new(), at..at + len as usize),
            };
            out.push(IoRequest {
                header,
                payload,
                reply_into,
            });
            done += len;
        }
        cursor += span.len as usize;
    }
    flush(&mut batch, &mut batch_bytes, &mut out);
    out
}

/// A READV or WRITEV of small spans; `at` is each span's place in the buffer.
fn vector_request<'a>(batch: &[(Span, usize)], write: Option<&'a [u8]>) -> IoRequest<'a> {
    let total: u64 = batch.iter().map(|(s, _)| s.len).sum();
    let mut table = BytesMut::with_capacity(8 + batch.len() * RANGE_LEN);
    if write.is_some() {
        table.extend_from_slice(&(batch.len() as u32).to_le_bytes());
        table.extend_from_slice(&0u32.to_le_bytes());
    }
    for (s, _) in batch {
        table.extend_from_slice(&s.pool.to_le_bytes());
        table.extend_from_slice(&stated_delta(s).unwrap_or(0).to_le_bytes());
        table.extend_from_slice(&s.pool_offset.to_le_bytes());
        table.extend_from_slice(&s.len.to_le_bytes());
    }
    let mut header = Header::new(
        if write.is_some() {
            Op::WriteV
        } else {
            Op::ReadV
        },
        0,
    );
    header.length = total;
    // The spans of one call belong to one region.
    if let Some((s, _)) = batch.first() {
        name_region(&mut header, s);
    }
    let first = batch.first().map_or(0, |(_, at)| *at);
    // Spans of a batch are consecutive in the caller's buffer.
    let contiguous = batch
        .windows(2)
        .all(|w| w[0].1 + w[0].0.len as usize == w[1].1);
    match write {
        Some(src) => {
            let mut payload = vec![Cow::Owned(table.to_vec())];
            if contiguous {
                payload.push(Cow::Borrowed(&src[first..first + total as usize]));
            } else {
                for (s, at) in batch {
                    payload.push(Cow::Borrowed(&src[*at..*at + s.len as usize]));
                }
            }
            header.payload_len = payload.iter().map(|p| p.len()).sum::<usize>() as u32;
            IoRequest {
                header,
                payload,
                reply_into: 0..0,
            }
        }
        None => {
            header.payload_len = table.len() as u32;
            IoRequest {
                header,
                payload: vec![Cow::Owned(table.to_vec())],
                reply_into: first..first + total as usize,
            }
        }
    }
}

/// Writes a header and payload pieces with as few system calls as possible.
fn send(stream: &mut TcpStream, header: &Header, payload: &[&[u8]]) -> std::io::Result<()> {
    let mut head = BytesMut::with_capacity(HEADER_LEN);
    header.encode(&mut head);
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(1 + payload.len());
    slices.push(IoSlice::new(&head));
    slices.extend(
        payload
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| IoSlice::new(p)),
    );
    let mut slices = &mut slices[..];
    while !slices.is_empty() {
        let n = stream.write_vectored(slices)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                "daemon closed the connection",
            ));
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

fn recv_header(stream: &mut TcpStream) -> Result<Header, Failure> {
    let mut buf = [0u8; HEADER_LEN];
    stream.read_exact(&mut buf)?;
    let header =
        Header::decode(&buf).map_err(|e| Failure::Retry(format!("bad reply header: {e}")))?;
    if header.flags & FLAG_REPLY == 0 {
        return Err(Failure::Retry("daemon sent a request, not a reply".into()));
    }
    Ok(header)
}

fn recv_message(stream: &mut TcpStream, header: &Header) -> Result<String, Failure> {
    let mut buf = vec![0u8; (header.payload_len as usize).min(64 << 10)];
    stream.read_exact(&mut buf)?;
    skip(stream, header.payload_len as u64 - buf.len() as u64)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

fn skip_payload(stream: &mut TcpStream, header: &Header) -> Result<(), Failure> {
    skip(stream, u64::from(header.payload_len))
}

fn skip(stream: &mut TcpStream, mut n: u64) -> Result<(), Failure> {
    let mut sink = [0u8; 4096];
    while n > 0 {
        let k = n.min(sink.len() as u64) as usize;
        stream.read_exact(&mut sink[..k])?;
        n -= k as u64;
    }
    Ok(())
}

fn read_word(stream: &mut TcpStream, header: &Header) -> Result<u64, Failure> {
    if header.payload_len != 8 {
        return Err(Failure::Retry(format!(
            "atomic reply of {} bytes",
            header.payload_len
        )));
    }
    let mut word = [0u8; 8];
    stream.read_exact(&mut word)?;
    Ok(u64::from_le_bytes(word))
}

/// The error a daemon reported.
fn daemon_error(addr: &str, status: u32, message: &str) -> RegionsError {
    RegionsError::Daemon {
        addr: addr.to_owned(),
        errno: status as i32,
        message: if message.is_empty() {
            format!("error {status}")
        } else {
            message.to_owned()
        },
    }
}

/// Where `span` lies in its region as a request states it (none for a span of no region).
fn stated_delta(span: &Span) -> Option<u32> {
    range_delta(span.ino, span.region_offset, span.pool_offset)
}

/// Names `span`'s region in `header` ([`Header::name_region`]).
fn name_region(header: &mut Header, span: &Span) {
    header.name_region(span.ino, span.region_offset, span.pool_offset);
}

/// The request of an 8-byte atomic on `at`, with a fresh id, and its payload.
fn atomic_header(t: &TcpTransport, op: Op, at: &Span, operands: &[u64]) -> (Header, Vec<u8>) {
    let word = WordAt {
        ino: at.ino,
        region_offset: at.region_offset,
        pool: at.pool,
        pool_offset: at.pool_offset,
    };
    Header::atomic(op, t.id(), t.cap_id, &word, operands)
}

/// Reads the reply to atomic request `id`: the old value of the word.
/// Whether a pooled connection is still open: nothing is owed on it, so anything to read
/// means the daemon closed it (or broke it); an error counts as closed.
fn still_open(stream: &TcpStream) -> bool {
    use std::os::fd::AsFd;
    let mut fds = [nix::poll::PollFd::new(
        stream.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    matches!(
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO),
        Ok(0)
    )
}

fn read_atomic_reply(stream: &mut TcpStream, id: u64, addr: &str) -> Result<u64, Failure> {
    let reply = recv_ok_header(stream, id, addr)?;
    read_word(stream, &reply)
}

/// The header of the reply to request `id`; a daemon's refusal (its message read) is
/// [`RegionsError::Daemon`], a reply to another request a broken stream.
fn recv_ok_header(stream: &mut TcpStream, id: u64, addr: &str) -> Result<Header, Failure> {
    let reply = recv_header(stream)?;
    if reply.request_id != id {
        return Err(Failure::Retry(format!(
            "reply to request {} while waiting for {id}",
            reply.request_id
        )));
    }
    if reply.status != 0 {
        let msg = recv_message(stream, &reply)?;
        return Err(Failure::Final(daemon_error(addr, reply.status, &msg)));
    }
    Ok(reply)
}

impl TcpTransport {
    /// Sends one `request` (its id and this transport's capability filled in) and returns the
    /// payload of its reply; a daemon's refusal is [`RegionsError::Daemon`]. An `idempotent`
    /// request is sent again on another connection when one breaks. Any other is sent at most
    /// once: a pooled connection the daemon closed is found before the send (and another
    /// taken), and a failure after the send is reported, not retried. Object requests and
    /// administration (`regionfs compact`) go this way.
    pub fn request(
        &self,
        request: &regions_proto::frame::Request,
        idempotent: bool,
    ) -> Result<Vec<u8>> {
        self.wait_posted_writes();
        self.with_conn(idempotent, |conn| {
            if !idempotent && !still_open(&conn.stream) {
                return Err(Failure::Retry(
                    "the daemon closed the pooled connection".into(),
                ));
            }
            let frame = request.to_frame(self.id(), self.cap_id);
            send(&mut conn.stream, &frame.header, &[&frame.payload])?;
            TransportStats::add(&self.stats.remote_requests, 1);
            let reply = self.reply_payload(&mut conn.stream, frame.header.request_id);
            match reply {
                Err(Failure::Retry(reason)) if !idempotent => {
                    count_unreachable("not_idempotent");
                    Err(Failure::Final(RegionsError::DaemonUnreachable {
                        addr: self.addr.clone(),
                        attempts: 1,
                        elapsed_ms: 0,
                        reason: format!(
                            "{reason} after the {} request was sent (not retried: it may have \
                             been applied)",
                            request.op()
                        ),
                    }))
                }
                other => other,
            }
        })
    }

    /// The payload of the reply to request `id`, read from `stream`.
    fn reply_payload(&self, stream: &mut TcpStream, id: u64) -> Result<Vec<u8>, Failure> {
        let reply = recv_ok_header(stream, id, &self.addr)?;
        let most = regions_proto::frame::Limits::default().max_payload;
        if reply.payload_len > most {
            return Err(Failure::Final(RegionsError::Invalid(format!(
                "the daemon at {} replied with {} bytes, more than any reply holds ({most})",
                self.addr, reply.payload_len
            ))));
        }
        let mut body = vec![0u8; reply.payload_len as usize];
        stream.read_exact(&mut body)?;
        Ok(body)
    }

    /// Writes `src` to the spans and waits for the replies (not ordered after posted
    /// writes: [`Transport::write`] is).
    fn write_spans(&self, spans: &[Span], src: &[u8]) -> Result<()> {
        let requests = plan_requests(spans, Some(src));
        self.with_conn(true, |conn| self.pipeline(conn, &requests, &mut []))?;
        TransportStats::add(&self.stats.remote_bytes_written, src.len() as u64);
        counter!("regions_client_bytes_total", "op" => "write", "transport" => "tcp")
            .increment(src.len() as u64);
        Ok(())
    }

    fn atomic(&self, op: Op, at: &Span, operands: &[u64]) -> Result<u64> {
        self.wait_posted_writes();
        // Behind posted requests whose replies are still owed, on their connection.
        if let Some(result) = self.atomic_on_lane(op, at, operands) {
            return result;
        }
        self.with_conn(false, |conn| {
            let (header, payload) = atomic_header(self, op, at, operands);
            send(&mut conn.stream, &header, &[&payload])?;
            TransportStats::add(&self.stats.remote_requests, 1);
            read_atomic_reply(&mut conn.stream, header.request_id, &self.addr)
        })
    }
}

/// A connection of the transport's own, kept out of its pool: the RDMA transport's control
/// connection (the daemon ties the queue pair it makes for the client to it).
#[cfg(feature = "rdma")]
pub(crate) struct ControlConn(Conn);

#[cfg(feature = "rdma")]
impl TcpTransport {
    /// A new authenticated connection for [`Self::control_request`].
    pub(crate) fn open_control(&self) -> Result<ControlConn> {
        let deadline = self.retry.deadline;
        self.connect(deadline, deadline)
            .map(ControlConn)
            .map_err(|f| self.failure_error(f))
    }

    /// Sends request `header` (its id and capability filled in here) with `payload` on `c`
    /// and returns the payload of the reply; a daemon's refusal is [`RegionsError::Daemon`].
    /// Posts a WAKE of the word at `at` (see [`Transport::wake_waiters`]); a failure only
    /// delays the waiters until the daemon re-reads the word.
    pub(crate) fn post_wake(&self, at: &Span) {
        let addr = self.addr.clone();
        let done: super::Completion = Box::new(move |r| {
            if let Err(e) = r {
                tracing::debug!(daemon = %addr, error = %e, "wake of a word's waiters failed");
            }
        });
        if let Err(e) = self.post_atomic(Op::Wake, at, &[], done) {
            tracing::debug!(daemon = %self.addr, error = %e, "cannot post a wake of a word's waiters");
        }
    }

    pub(crate) fn control_request(
        &self,
        c: &mut ControlConn,
        mut header: Header,
        payload: &[u8],
    ) -> Result<Vec<u8>> {
        header.request_id = self.id();
        header.capability = self.cap_id;
        header.payload_len = u32::try_from(payload.len())
            .map_err(|_| RegionsError::Invalid("control request too large".into()))?;
        let stream = &mut c.0.stream;
        let exchange = |stream: &mut TcpStream| -> Result<Vec<u8>, Failure> {
            send(stream, &header, &[payload])?;
            TransportStats::add(&self.stats.remote_requests, 1);
            let reply = recv_header(stream)?;
            if reply.request_id != header.request_id {
                return Err(Failure::Retry(format!(
                    "reply to request {} while waiting for {}",
                    reply.request_id, header.request_id
                )));
            }
            if reply.status != 0 {
                let msg = recv_message(stream, &reply)?;
                return Err(Failure::Final(daemon_error(&self.addr, reply.status, &msg)));
            }
            let mut body = vec![0u8; reply.payload_len as usize];
            stream.read_exact(&mut body)?;
            Ok(body)
        };
        exchange(stream).map_err(|f| self.failure_error(f))
    }
}

impl Transport for TcpTransport {
    fn read(&self, spans: &[Span], dst: &mut [u8]) -> Result<()> {
        // After the posted writes.
        self.wait_posted_writes();
        let requests = plan_requests(spans, None);
        self.with_conn(true, |conn| self.pipeline(conn, &requests, dst))?;
        TransportStats::add(&self.stats.remote_bytes_read, dst.len() as u64);
        counter!("regions_client_bytes_total", "op" => "read", "transport" => "tcp")
            .increment(dst.len() as u64);
        Ok(())
    }

    fn write(&self, spans: &[Span], src: &[u8]) -> Result<()> {
        self.wait_posted_writes();
        self.write_spans(spans, src)
    }

    fn compare_and_swap(&self, at: &Span, expected: u64, new: u64) -> Result<u64> {
        self.atomic(Op::Cas, at, &[expected, new])
    }

    fn fetch_add(&self, at: &Span, addend: u64) -> Result<u64> {
        self.atomic(Op::FetchAdd, at, &[addend])
    }

    fn wait_change(&self, at: &Span, expected: u64, timeout: Duration) -> Result<u64> {
        // The daemon serves at most a second; connections time out later than that.
        let timeout = timeout.min(Duration::from_secs(1));
        let timeout_us = u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX);
        self.wait_posted_writes();
        self.with_conn(true, |conn| {
            let (header, payload) =
                atomic_header(self, Op::WaitChange, at, &[expected, timeout_us]);
            send(&mut conn.stream, &header, &[&payload])?;
            TransportStats::add(&self.stats.remote_requests, 1);
            read_atomic_reply(&mut conn.stream, header.request_id, &self.addr)
        })
    }

    fn posts_atomics(&self) -> bool {
        true
    }

    fn post_compare_and_swap(
        &self,
        at: &Span,
        expected: u64,
        new: u64,
        done: Completion,
    ) -> Result<()> {
        self.post_atomic(Op::Cas, at, &[expected, new], done)
    }

    fn posts_writes(&self) -> bool {
        true
    }

    fn post_write(&self, owner: u64, spans: &[Span], src: &[u8]) -> bool {
        self.post_write_on_lane(owner, spans, src)
    }

    fn wait_writes(&self) {
        self.wait_posted_writes();
    }

    fn settle_writes(&self, owner: u64) -> Option<RegionsError> {
        self.settle_posted_writes(owner)
    }

    fn forget_failed_writes(&self, owner: u64) {
        self.forget_posted_failure(owner);
    }

    fn describe(&self) -> String {
        format!("tcp {}", self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_daemon_is_waited_for_once_then_probed() {
        // A port with nothing listening: connections are refused.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let retry = RetryPolicy {
            deadline: Duration::from_millis(300),
            backoff: Duration::from_millis(10),
        };
        let secret = Secret::new("secret").unwrap();
        let t = TcpTransport::new(&addr.to_string(), &secret, retry, Arc::default());
        let spans = [span(0, 0, 4096)];
        let mut buf = vec![0u8; 4096];
        let first = t.read(&spans, &mut buf).unwrap_err();
        assert_eq!(first.errno(), libc::EIO);
        assert!(
            matches!(first, RegionsError::DaemonUnreachable { attempts, .. } if attempts > 1),
            "retried until the deadline: {first}"
        );
        // Right after: no attempt at all.
        let second = t.read(&spans, &mut buf).unwrap_err();
        assert!(
            matches!(second, RegionsError::DaemonUnreachable { attempts: 0, .. }),
            "{second}"
        );
        assert_eq!(second.errno(), libc::EIO);
        // After the quiet time: one request probes (and fails again), the next is quiet.
        std::thread::sleep(QUIET);
        let probe = t.read(&spans, &mut buf).unwrap_err();
        assert!(
            matches!(probe, RegionsError::DaemonUnreachable { attempts, .. } if attempts > 0),
            "{probe}"
        );
        assert!(matches!(
            t.read(&spans, &mut buf).unwrap_err(),
            RegionsError::DaemonUnreachable { attempts: 0, .. }
        ));
    }

    fn span(region_offset: u64, pool_offset: u64, len: u64) -> Span {
        Span {
            ino: 0,
            region_offset,
            pool: 3,
            pool_offset,
            len,
        }
    }

    #[test]
    fn large_spans_split_into_bounded_requests() {
        let spans = [span(0, 0, 10 << 20)];
        let reqs = plan_requests(&spans, None);
        assert_eq!(reqs.len(), 3);
        assert!(
            reqs.iter()
                .all(|r| r.header.op == Op::Read && r.header.length <= MAX_IO)
        );
        assert_eq!(reqs[1].header.offset, MAX_IO);
        assert_eq!(reqs[2].reply_into, (2 * MAX_IO as usize)..(10 << 20));
    }

    #[test]
    fn small_spans_are_batched_into_vectors() {
        let spans: Vec<Span> = (0..5000).map(|i| span(i * 64, i * 4096, 64)).collect();
        let reqs = plan_requests(&spans, None);
        assert_eq!(reqs.len(), 2, "4096 ranges per vector");
        assert_eq!(reqs[0].header.op, Op::ReadV);
        assert_eq!(reqs[0].header.length, 4096 * 64);
        assert_eq!(reqs[0].header.payload_len as usize, 4096 * RANGE_LEN);
        assert_eq!(reqs[1].reply_into, 4096 * 64..5000 * 64);
        let data = vec![7u8; 5000 * 64];
        let w = plan_requests(&spans, Some(&data));
        assert_eq!(w[0].header.op, Op::WriteV);
        assert_eq!(
            w[0].header.payload_len as usize,
            8 + 4096 * RANGE_LEN + 4096 * 64
        );
    }

    #[test]
    fn mixed_spans_keep_buffer_order() {
        let spans = [
            span(0, 0, 100),
            span(100, 1 << 20, 1 << 20),
            span(100 + (1 << 20), 0, 50),
        ];
        let reqs = plan_requests(&spans, None);
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].reply_into, 0..100);
        assert_eq!(reqs[1].reply_into, 100..100 + (1 << 20));
        assert_eq!(reqs[2].reply_into, 100 + (1 << 20)..150 + (1 << 20));
    }
}
