//! The tcp transport server (docs/ARCHITECTURE.md, "Data plane"; frames: `regions_proto::frame`):
//! one thread per connection on blocking std sockets, `TCP_NODELAY`, many pipelined requests per connection.
//!
//! - The first frame must be HELLO: the cluster-secret challenge–response
//!   ([`regions_proto::handshake`]) or a capability; anything else gets `EACCES` and the
//!   connection closes with a log line. A connection that has not authenticated within
//!   [`TransportConfig::auth_timeout`] is closed.
//! - READ and READV replies go from the pool window to the socket with one `sendmsg` of header +
//!   window ranges (no copy); WRITE payloads go from the socket straight into the window; WRITEV
//!   payloads are buffered once and copied in.
//! - Every range is bounds-checked against the pool and its assigned chunks
//!   ([`Pools::resolve`], [`crate::pools::Resolved::pin`]); errors are replies with an errno
//!   (`EFAULT` unassigned or out of bounds, `ENOENT` unknown pool, `EINVAL` malformed request).
//! - A frame that cannot be decoded (bad header, oversized payload) closes the connection with
//!   a log line. Nothing a peer sends makes the daemon panic.
//! - Connections are capped, waiting ones evicted oldest first ([`crate::transport::admission`]); a
//!   connection that has not authenticated holds a 4 KiB input buffer, an authenticated one
//!   [`TransportConfig::buffer`]; payloads read and not yet served are bounded in total by
//!   [`TransportConfig::max_buffered`]. A peer that stalls inside a frame for
//!   [`TransportConfig::io_timeout`], or sends nothing for [`TransportConfig::idle_timeout`],
//!   is disconnected (clients reconnect).

pub mod admission;
pub mod auth;
pub mod objects;
pub mod rawio;
pub mod revocations;

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use metrics::{counter, histogram};
use regions_proto::auth::Secret;
use regions_proto::frame::{
    FLAG_REPLY, Frame, FrameError, HEADER_LEN, Header, Limits, Op, Range, Request,
};

use crate::error::{DaemonError, Result};
use crate::objects::ObjectStore;
use crate::pools::{Pinned, Pools, Resolved, WordOp};
use crate::stats::Stats;
use crate::transport::auth::{ConnAuth, Reach};
use crate::transport::rawio::{Ready, wait_ready};
use admission::{Admission, Budget};

/// Largest HELLO payload accepted (before authentication nothing bigger is read).
const MAX_HELLO: u32 = 4096;
/// Input buffer of a connection that has not authenticated: a header and a HELLO.
const UNAUTHENTICATED_BUFFER: usize = HEADER_LEN + MAX_HELLO as usize;
/// Payload buffers of at most this many bytes are not counted in the budget.
const UNBUDGETED: usize = 64 << 10;
/// A payload buffer grows (and its budget is reserved) by at least this much at a time.
const PAYLOAD_PIECE: usize = 1 << 20;
/// Replies buffered before they are written even though more requests are waiting.
const FLUSH_AT: usize = 64 << 10;
/// Longest `WaitChange` served (callers ask again).
const MAX_WAIT: Duration = Duration::from_secs(1);
/// A waiting `WaitChange` re-reads its word at least this often.
const WAIT_SLICE: Duration = Duration::from_millis(10);
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(100);
/// Connections the kernel queues for the accept loop (capped by `net.core.somaxconn`).
const LISTEN_BACKLOG: i32 = 1024;
/// Vector reads of at least this many ranges, moving at most
/// [`GATHER_MAX_BYTES`], are gathered into one buffer and sent at once.
const GATHER_MIN_RANGES: usize = 16;
/// Largest vector read that is gathered (see [`GATHER_MIN_RANGES`]).
const GATHER_MAX_BYTES: u64 = 4 << 20;

/// Tunables of the transport server.
#[derive(Clone, Copy, Debug)]
pub struct TransportConfig {
    /// Limits on frames.
    pub limits: Limits,
    /// How long a request touching an unassigned chunk waits for the manager's event.
    pub assign_wait: Duration,
    /// How long a peer may stall in the middle of a frame or a reply before it is dropped.
    pub io_timeout: Duration,
    /// Size of each connection's input buffer.
    pub buffer: usize,
    /// How long a new connection has to authenticate before it is closed.
    pub auth_timeout: Duration,
    /// How long an authenticated connection may send nothing before it is closed.
    pub idle_timeout: Duration,
    /// Caps on open and unauthenticated connections.
    pub admission: admission::Limits,
    /// Bytes of request payloads all connections together may hold.
    pub max_buffered: u64,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            limits: Limits::default(),
            assign_wait: Duration::from_secs(2),
            io_timeout: Duration::from_secs(30),
            buffer: 256 << 10,
            auth_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            admission: admission::Limits::default(),
            max_buffered: 256 << 20,
        }
    }
}

/// What connections share.
#[derive(Debug)]
struct Shared {
    pools: Arc<Pools>,
    secret: Secret,
    /// Verifies capability tokens (derived from the secret).
    key: regions_proto::capability::CapabilityKey,
    stats: Arc<Stats>,
    config: TransportConfig,
    stop: AtomicBool,
    admission: Admission,
    budget: Budget,
    next_conn: AtomicU64,
    /// The RDMA device connections may set up queue pairs on ([`TransportServer::serve_rdma`]).
    #[cfg(feature = "rdma")]
    rdma: std::sync::OnceLock<Arc<crate::rdma::Rdma>>,
    /// The object store object requests reach ([`TransportServer::serve_objects`]).
    objects: std::sync::OnceLock<Arc<ObjectStore>>,
}

/// A running transport server.
#[derive(Debug)]
pub struct TransportServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl TransportServer {
    /// Lets connections set up RDMA on `rdma` ([`Op::RdmaConnect`]) and ask for remote keys
    /// of pool chunks. Without it they are answered `EOPNOTSUPP`.
    #[cfg(feature = "rdma")]
    pub fn serve_rdma(&self, rdma: Arc<crate::rdma::Rdma>) {
        let _ = self.shared.rdma.set(rdma);
    }

    /// Serves object requests from `objects` ([`objects`]). Without it they are answered
    /// `EOPNOTSUPP`.
    pub fn serve_objects(&self, objects: Arc<ObjectStore>) {
        let _ = self.shared.objects.set(objects);
    }

    /// Binds the transport address (port 0 picks a free port).
    /// The accept queue holds [`LISTEN_BACKLOG`] connections, so that a burst of new ones
    /// (a flood, or many clients at once) is not answered with dropped SYNs and retries.
    pub fn bind(addr: SocketAddr) -> Result<TcpListener> {
        let bind_error = |source| DaemonError::Bind {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(addr).map_err(bind_error)?;
        // Listening again on a listening socket only changes its backlog.
        let backlog = nix::sys::socket::Backlog::new(LISTEN_BACKLOG)
            .map_err(|e| bind_error(io::Error::from(e)))?;
        nix::sys::socket::listen(&listener, backlog).map_err(|e| bind_error(io::Error::from(e)))?;
        Ok(listener)
    }

    /// Serves `listener` on a background thread until [`TransportServer::shutdown`].
    pub fn start(
        listener: TcpListener,
        pools: Arc<Pools>,
        secret: Secret,
        stats: Arc<Stats>,
        config: TransportConfig,
    ) -> Result<TransportServer> {
        let addr = listener
            .local_addr()
            .map_err(|e| DaemonError::sys("transport listener address", e))?;
        let shared = Arc::new(Shared {
            pools,
            key: regions_proto::capability::CapabilityKey::from_secret(&secret),
            secret,
            stats,
            config,
            stop: AtomicBool::new(false),
            admission: Admission::new(config.admission),
            budget: Budget::new(config.max_buffered),
            next_conn: AtomicU64::new(1),
            #[cfg(feature = "rdma")]
            rdma: std::sync::OnceLock::new(),
            objects: std::sync::OnceLock::new(),
        });
        let for_thread = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("transport-accept".into())
            .spawn(move || accept_loop(&listener, &for_thread))
            .map_err(|e| DaemonError::sys("spawning the transport accept thread", e))?;
        tracing::info!(%addr, "transport serving");
        Ok(TransportServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every connection and waits for the accept thread.
    pub fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.admission.close_all();
        if let Some(handle) = self.accept.take() {
            // Wake the accept loop now rather than at its next poll timeout.
            let mut wake = self.addr;
            if wake.ip().is_unspecified() {
                wake.set_ip(if wake.is_ipv4() {
                    std::net::Ipv4Addr::LOCALHOST.into()
                } else {
                    std::net::Ipv6Addr::LOCALHOST.into()
                });
            }
            let _ = TcpStream::connect_timeout(&wake, ACCEPT_POLL);
            let _ = handle.join();
        }
    }
}

impl Drop for TransportServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match wait_ready(listener, Ready::Read, ACCEPT_POLL) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::TimedOut => continue,
            Err(e) => {
                tracing::warn!(error = %e, "transport accept poll failed");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        }
        let (stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "transport accept failed (out of file descriptors?)");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let handle = match stream.try_clone() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "cannot keep a handle of a new connection; dropping it");
                continue;
            }
        };
        if let Err(refused) = shared.admission.admit(id, handle) {
            let n = shared.admission.refusals();
            if n.is_power_of_two() {
                tracing::warn!(%peer, open = refused.open, refused_so_far = n, "transport full of authenticated connections; closing a new one");
            }
            continue;
        }
        let for_thread = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("transport-{id}"))
            .spawn(move || {
                Stats::add(&for_thread.stats.connections, 1);
                Stats::add(&for_thread.stats.connections_total, 1);
                serve_connection(id, stream, peer, &for_thread);
                Stats::dec(&for_thread.stats.connections);
                for_thread.admission.remove(id);
            });
        if let Err(e) = spawned {
            tracing::warn!(%peer, error = %e, "cannot start a connection thread; dropping the connection");
            shared.admission.remove(id);
        }
    }
}

fn serve_connection(id: u64, stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) {
    if let Err(e) = stream
        .set_nodelay(true)
        .and_then(|()| stream.set_write_timeout(Some(shared.config.io_timeout)))
    {
        tracing::warn!(%peer, error = %e, "cannot configure a transport connection");
        return;
    }
    tracing::debug!(%peer, "transport connection opened");
    let mut conn = Conn {
        id,
        stream,
        peer,
        shared: Arc::clone(shared),
        input: InBuf::new(UNAUTHENTICATED_BUFFER),
        held: 0,
        out: BytesMut::with_capacity(FLUSH_AT),
        auth: ConnAuth::default(),
        auth_deadline: Some(Instant::now() + shared.config.auth_timeout),
        #[cfg(feature = "rdma")]
        windows: std::collections::HashMap::new(),
        #[cfg(feature = "rdma")]
        queue_pair: None,
    };
    match conn.run() {
        Ok(()) => tracing::debug!(%peer, "transport connection closed by the peer"),
        Err(Close::Quiet(reason)) => tracing::debug!(%peer, %reason, "transport connection closed"),
        Err(Close::Logged) => {}
    }
}

/// The refusal of an RDMA request by a daemon that serves none.
fn no_rdma() -> DaemonError {
    DaemonError::NoRdma(
        "this daemon serves no RDMA (started with --transport tcp, no RDMA device found, or \
         built without the rdma feature): use the tcp transport"
            .into(),
    )
}

/// Whether a read failed because its timeout passed.
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Why a connection ends.
enum Close {
    /// Already logged at the level it deserved.
    Logged,
    /// Ordinary end (peer gone, shutdown): logged at debug level.
    Quiet(String),
}

impl From<io::Error> for Close {
    fn from(e: io::Error) -> Close {
        Close::Quiet(e.to_string())
    }
}

/// A connection's input buffer.
struct InBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    fn new(capacity: usize) -> InBuf {
        InBuf {
            buf: vec![0; capacity.max(HEADER_LEN)],
            start: 0,
            end: 0,
        }
    }

    fn available(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Makes the buffer hold `capacity` bytes (never less than it holds now).
    fn grow(&mut self, capacity: usize) {
        if capacity > self.buf.len() {
            self.buf.resize(capacity, 0);
        }
    }

    fn len(&self) -> usize {
        self.end - self.start
    }

    fn consume(&mut self, n: usize) {
        self.start += n.min(self.len());
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Reads more bytes from `stream` (blocking); `Ok(0)` at end of stream.
    fn fill(&mut self, mut stream: &TcpStream) -> io::Result<usize> {
        if self.end == self.buf.len() && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match stream.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

/// One transport connection.
struct Conn {
    /// Its number in [`Shared::admission`].
    id: u64,
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    input: InBuf,
    /// Replies not written yet.
    out: BytesMut,
    /// The secret or the capabilities presented.
    auth: ConnAuth,
    /// Until the connection authenticates: when it is closed if it has not.
    auth_deadline: Option<Instant>,
    /// Bytes of [`Shared::budget`] this connection holds for the request it serves.
    held: u64,
    /// Memory windows bound on [`Conn::queue_pair`] for the capabilities of this
    /// connection, by (capability's issue number, pool, chunk, write). Declared before the
    /// queue pair: they are dropped (deallocated) before it.
    #[cfg(feature = "rdma")]
    windows: std::collections::HashMap<(u64, u32, u64, bool), Arc<crate::rdma::BoundWindow>>,
    /// The queue pair the peer's reaches pool memory through, set up by
    /// [`Op::RdmaConnect`]; destroyed with the connection.
    #[cfg(feature = "rdma")]
    queue_pair: Option<regions_verbs::QueuePair>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.release_budget();
        #[cfg(feature = "rdma")]
        self.drop_windows();
    }
}

impl Conn {
    fn run(&mut self) -> Result<(), Close> {
        loop {
            let Some(header) = self.next_header()? else {
                return Ok(());
            };
            Stats::add(&self.shared.stats.requests, 1);
            let (op, started) = (header.op.name(), Instant::now());
            let handled = self.handle(header);
            self.release_budget();
            counter!("regions_daemon_transport_requests_total", "op" => op).increment(1);
            histogram!("regions_daemon_transport_request_duration_seconds", "op" => op)
                .record(started.elapsed());
            handled?;
            if self.out.len() >= FLUSH_AT {
                self.flush()?;
            }
        }
    }

    /// Writes buffered replies.
    fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.stream.write_all(&self.out)?;
            self.out.clear();
        }
        Ok(())
    }

    /// The next request header; `None` when the peer closed between frames.
    fn next_header(&mut self) -> Result<Option<Header>, Close> {
        let mut idle = Duration::ZERO;
        while self.input.len() < HEADER_LEN {
            // Nothing more is pipelined: the buffered replies go out before we block.
            self.flush()?;
            self.limit_unauthenticated()?;
            let filled = match self.input.fill(&self.stream) {
                Err(e) if self.auth_deadline.is_some() && is_timeout(&e) => {
                    return Err(self.too_slow());
                }
                Err(e) if is_timeout(&e) && self.input.len() == 0 => {
                    // Between frames: idle, up to the idle timeout.
                    idle += self.shared.config.io_timeout;
                    if idle >= self.shared.config.idle_timeout {
                        return Err(Close::Quiet(format!("idle for {idle:?}")));
                    }
                    continue;
                }
                filled => filled?,
            };
            if filled == 0 {
                if self.input.len() > 0 {
                    return Err(Close::Quiet(format!(
                        "peer closed in the middle of a frame header ({} bytes)",
                        self.input.len()
                    )));
                }
                return Ok(None);
            }
        }
        let header = match Header::decode(self.input.available()) {
            Ok(h) => h,
            Err(e) => return Err(self.malformed(&e)),
        };
        let max = self.shared.config.limits.max_payload;
        if header.payload_len > max {
            let e = FrameError::Oversized {
                len: u64::from(header.payload_len),
                max,
            };
            return Err(self.malformed(&e));
        }
        self.input.consume(HEADER_LEN);
        Ok(Some(header))
    }

    /// Before authentication, bounds blocking reads by what is left of the deadline.
    fn limit_unauthenticated(&mut self) -> Result<(), Close> {
        let Some(deadline) = self.auth_deadline else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.too_slow());
        }
        self.stream.set_read_timeout(Some(left))?;
        Ok(())
    }

    fn too_slow(&mut self) -> Close {
        let after = self.shared.config.auth_timeout;
        tracing::warn!(peer = %self.peer, ?after, "transport connection did not authenticate in time; closing it");
        Close::Logged
    }

    fn malformed(&mut self, e: &FrameError) -> Close {
        let _ = self.flush();
        tracing::warn!(peer = %self.peer, error = %e, "malformed transport frame; closing the connection");
        Close::Logged
    }

    /// Reads a whole payload of `len` bytes into memory. Memory grows with the bytes that
    /// actually arrive, so a peer announcing a large payload and sending none costs nothing.
    /// The buffer's capacity is reserved in [`Shared::budget`] before it grows, and it grows
    /// (doubling, up to `len`) only as bytes arrive; the reservation is held until the request
    /// has been served.
    fn read_payload(&mut self, len: u32) -> io::Result<Bytes> {
        let len = len as usize;
        let take = len.min(self.input.len());
        let first = take.max(len.min(self.input.buf.len()));
        self.reserve(first)?;
        let mut payload = Vec::with_capacity(first);
        payload.extend_from_slice(&self.input.available()[..take]);
        self.input.consume(take);
        while payload.len() < len {
            if payload.len() == payload.capacity() {
                // At least a piece, at most the payload (which may be less than a piece:
                // `clamp` would panic there).
                let grown = (payload.capacity() * 2).max(PAYLOAD_PIECE).min(len);
                let more = grown - payload.capacity();
                self.reserve(more)?;
                payload.reserve_exact(more);
            }
            let piece = (len - payload.len()).min(payload.capacity() - payload.len());
            let before = payload.len();
            (&self.stream)
                .take(piece as u64)
                .read_to_end(&mut payload)?;
            if payload.len() - before < piece {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(Bytes::from(payload))
    }

    /// Reserves `n` more bytes of the shared budget for the request being served. Pieces of
    /// at most [`UNBUDGETED`] bytes are not counted (they are bounded per connection, like the
    /// input buffer), so that handshakes and small requests never wait behind large payloads.
    fn reserve(&mut self, n: usize) -> io::Result<()> {
        if n <= UNBUDGETED {
            return Ok(());
        }
        if !self
            .shared
            .budget
            .reserve(n as u64, self.shared.config.io_timeout)
        {
            tracing::warn!(
                peer = %self.peer,
                bytes = n,
                held = self.shared.budget.used(),
                max = self.shared.budget.max(),
                "transport payload budget stayed spent; closing the connection"
            );
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                "the daemon's payload budget is spent",
            ));
        }
        self.held += n as u64;
        Ok(())
    }

    /// Gives back what the served request held of the budget.
    fn release_budget(&mut self) {
        if self.held > 0 {
            self.shared.budget.release(self.held);
            self.held = 0;
        }
    }

    /// Reads and drops `len` bytes of payload.
    fn discard(&mut self, mut len: u64) -> io::Result<()> {
        let take = len.min(self.input.len() as u64);
        self.input.consume(take as usize);
        len -= take;
        let mut sink = [0u8; 8192];
        while len > 0 {
            let n = (&self.stream).read(&mut sink[..len.min(8192) as usize])?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            len -= n as u64;
        }
        Ok(())
    }

    fn reply_ok(&mut self, req: &Header, payload: Bytes) {
        Frame::reply_ok(req, payload).encode(&mut self.out);
    }

    fn reply_err(&mut self, req: &Header, errno: i32, message: &str) {
        counter!("regions_daemon_transport_errors_total", "op" => req.op.name()).increment(1);
        tracing::debug!(peer = %self.peer, op = %req.op, request = req.request_id, errno, message, "transport request refused");
        Frame::reply_err(req, errno as u32, message).encode(&mut self.out);
    }

    fn reply_error(&mut self, req: &Header, e: &DaemonError) {
        self.reply_err(req, e.errno(), &e.to_string());
    }

    /// Refuses an unauthenticated or wrongly authenticated connection, then closes it.
    fn refuse(&mut self, req: &Header, message: &str) -> Close {
        self.refuse_with(req, libc::EACCES, message)
    }

    /// [`Self::refuse`] with another errno (`EKEYREVOKED` for a revoked token).
    fn refuse_with(&mut self, req: &Header, errno: i32, message: &str) -> Close {
        tracing::warn!(peer = %self.peer, op = %req.op, reason = message, "transport connection refused");
        Frame::reply_err(req, errno as u32, message).encode(&mut self.out);
        let _ = self.flush();
        // Let the reply reach the peer before the close: stop writing, and drain briefly what
        // it already sent (closing with unread input would reset the connection).
        let _ = self.stream.shutdown(Shutdown::Write);
        let _ = self
            .stream
            .set_read_timeout(Some(Duration::from_millis(200)));
        let mut sink = [0u8; 8192];
        let mut drained = 0usize;
        while drained < (1 << 20) {
            match (&self.stream).read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
        Close::Logged
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.shared.config.assign_wait
    }

    fn handle(&mut self, h: Header) -> Result<(), Close> {
        if h.op == Op::Hello || !self.auth.is_authenticated() {
            return self.hello(&h);
        }
        let reach = match self.auth.authorize(&h, self.shared.pools.revocations()) {
            Ok(reach) => reach,
            Err(refusal) => {
                if h.op == Op::Write {
                    self.discard(u64::from(h.payload_len))?;
                } else {
                    self.read_payload(h.payload_len)?;
                }
                self.reply_error(&h, &refusal);
                return Ok(());
            }
        };
        if h.op == Op::Write {
            return self.write_direct(&h, reach);
        }
        let payload = self.read_payload(h.payload_len)?;
        let frame = Frame { header: h, payload };
        let request = match Request::parse(&frame, &self.shared.config.limits) {
            Ok(r) => r,
            Err(e) => {
                self.reply_err(&h, libc::EINVAL, &e.to_string());
                return Ok(());
            }
        };
        match request {
            Request::Ping => self.reply_ok(&h, Bytes::new()),
            Request::Read { pool, offset, len } => {
                let delta = h.stated_delta();
                self.send_ranges(
                    &h,
                    &[Range {
                        pool,
                        offset,
                        len,
                        delta,
                    }],
                    reach,
                )?;
            }
            Request::ReadV { ranges } => self.send_ranges(&h, &ranges, reach)?,
            Request::WriteV { ranges, data } => self.write_vector(&h, &ranges, &data, reach),
            Request::Cas {
                pool,
                offset,
                expected,
                new,
            } => self.atomic(
                &h,
                pool,
                offset,
                reach,
                WordOp::CompareSwap { expected, new },
            ),
            Request::FetchAdd {
                pool,
                offset,
                addend,
            } => self.atomic(&h, pool, offset, reach, WordOp::FetchAdd(addend)),
            Request::WaitChange {
                pool,
                offset,
                expected,
                timeout_us,
            } => {
                let timeout = Duration::from_micros(timeout_us).min(MAX_WAIT);
                self.wait_change(
                    &h,
                    Range {
                        pool,
                        offset,
                        len: 8,
                        delta: h.stated_delta(),
                    },
                    reach,
                    expected,
                    timeout,
                )?;
            }
            Request::Wake { pool, offset } => self.wake(&h, pool, offset, reach),
            Request::RdmaConnect { endpoint } => self.rdma_connect(&h, &endpoint),
            Request::RdmaKeys {
                pool,
                offset,
                len,
                write,
            } => self.rdma_keys(&h, pool, offset, len, write, reach),
            request @ (Request::ObjAlloc { .. }
            | Request::ObjFree { .. }
            | Request::ObjRead { .. }
            | Request::ObjWrite { .. }
            | Request::ObjCompact
            | Request::ObjFreeze { .. }
            | Request::ObjThaw { .. }
            | Request::ObjRefit { .. }
            | Request::ObjIndirect { .. }
            | Request::ObjCorrect { .. }
            | Request::ObjInherited { .. }
            | Request::ObjSettle { .. }) => {
                let served = match self.shared.objects.get() {
                    Some(store) => objects::serve(store, self.auth.proved_secret(), reach, request),
                    None => Err(DaemonError::NoObjects(
                        "this daemon keeps no object store (its small regions are segments)".into(),
                    )),
                };
                match served {
                    Ok(payload) => {
                        match h.op {
                            Op::ObjRead => self.shared.stats.bytes_out(h.length),
                            Op::ObjWrite => self.shared.stats.bytes_in(h.length),
                            _ => {}
                        }
                        self.reply_ok(&h, payload);
                    }
                    Err(e) => self.reply_error(&h, &e),
                }
            }
            // Handled above; kept for exhaustiveness.
            Request::Hello { .. } | Request::Write { .. } => {
                self.reply_err(&h, libc::EINVAL, "unexpected request");
            }
        }
        Ok(())
    }

    fn hello(&mut self, h: &Header) -> Result<(), Close> {
        if h.op != Op::Hello {
            return Err(self.refuse(
                h,
                "not authenticated: the first frame must be HELLO (the cluster-secret handshake or a capability)",
            ));
        }
        if h.flags & FLAG_REPLY != 0 || h.payload_len > MAX_HELLO {
            return Err(self.refuse(h, "malformed HELLO"));
        }
        self.limit_unauthenticated()?;
        let token = match self.read_payload(h.payload_len) {
            Err(e) if self.auth_deadline.is_some() && is_timeout(&e) => {
                return Err(self.too_slow());
            }
            token => token?,
        };
        let shared = Arc::clone(&self.shared);
        let reply = match self.auth.present(
            &shared.secret,
            &shared.key,
            shared.pools.revocations(),
            h.capability,
            &token,
        ) {
            Ok(reply) => reply,
            Err(refusal) => {
                return Err(self.refuse_with(h, refusal.errno(), &refusal.to_string()));
            }
        };
        if !self.auth.is_authenticated() {
            // The first step of the handshake went well: a client at work.
            self.shared.admission.started(self.id);
        }
        if self.auth_deadline.is_some() && self.auth.is_authenticated() {
            self.auth_deadline = None;
            self.shared.admission.authenticated(self.id);
            self.input.grow(self.shared.config.buffer);
            // From now on a stall inside a frame ends the connection after the I/O timeout,
            // silence between frames after the idle timeout (see `next_header`).
            self.stream
                .set_read_timeout(Some(self.shared.config.io_timeout))?;
            tracing::debug!(peer = %self.peer, capability = h.capability, "transport connection authenticated");
        }
        self.reply_ok(h, Bytes::from(reply));
        Ok(())
    }

    /// [`Op::RdmaConnect`]: a queue pair for this connection, connected to the peer's.
    fn rdma_connect(&mut self, h: &Header, endpoint: &[u8]) {
        #[cfg(feature = "rdma")]
        {
            let Some(rdma) = self.shared.rdma.get().cloned() else {
                return self.reply_error(h, &no_rdma());
            };
            // Node components (which may touch any pool range over tcp too) get a queue pair
            // in the protection domain of the chunks' keys; applications' capability
            // connections one in the windows' domain, where nothing is reachable but the
            // memory windows bound on that queue pair (docs/SECURITY.md).
            let for_capabilities = !self.auth.proved_secret();
            if for_capabilities && !rdma.serves_capabilities() {
                return self.reply_error(h, &DaemonError::NoRdma(crate::rdma::NO_WINDOWS.into()));
            }
            match rdma.accept(endpoint, for_capabilities) {
                Ok((qp, mut mine)) => {
                    mine.push(rdma.connect_flags());
                    // The old queue pair's windows go before it does.
                    self.drop_windows();
                    self.queue_pair = Some(qp);
                    tracing::debug!(peer = %self.peer, device = rdma.device_name(), "RDMA queue pair connected");
                    self.reply_ok(h, Bytes::from(mine));
                }
                Err(e) => self.reply_error(h, &e),
            }
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = endpoint;
            self.reply_error(h, &no_rdma());
        }
    }

    /// Deallocates every memory window bound for this connection (before its queue pair
    /// goes or is replaced).
    #[cfg(feature = "rdma")]
    fn drop_windows(&mut self) {
        for w in self.windows.values() {
            w.invalidate();
        }
        self.windows.clear();
    }

    /// [`Op::RdmaReadKeys`] / [`Op::RdmaWriteKeys`] on a capability connection: per chunk
    /// under the range (checked as a READ or WRITE of exactly the range), a memory window over
    /// the capability's bytes of that chunk, bound on this connection's queue pair with the
    /// request's rights (reused while it lasts).
    #[cfg(feature = "rdma")]
    #[allow(clippy::too_many_arguments)]
    fn window_keys(
        &mut self,
        h: &Header,
        rdma: &Arc<crate::rdma::Rdma>,
        pool: u32,
        offset: u64,
        len: u64,
        write: bool,
        reach: Reach,
    ) {
        use regions_proto::layout::CHUNK_SIZE;
        /// Windows one connection keeps at most; past it they are all dropped (the client
        /// asks again for those it still uses).
        const MAX_WINDOWS: usize = 4096;
        let Reach::Capability(cap) = reach else {
            return self.reply_error(h, &reach.refusal());
        };
        let range = Range {
            pool,
            offset,
            len: len.max(1),
            delta: h.stated_delta(),
        };
        let shared = Arc::clone(&self.shared);
        let deadline = self.deadline();
        if self.windows.len() >= MAX_WINDOWS {
            self.drop_windows();
        }
        let (windows, queue_pair) = (&mut self.windows, &mut self.queue_pair);
        let result = shared.pools.resolve(&[range]).and_then(|resolved| {
            let pinned = resolved.pin(deadline)?;
            reach.check(&pinned)?;
            let Some(qp) = queue_pair.as_mut() else {
                return Err(DaemonError::NoRdma("the queue pair went away".into()));
            };
            let mut out = Vec::new();
            for (index, chunk, gid, region_offset) in pinned.chunk_backings() {
                let Some((from, to)) = crate::rdma::capability_bytes_of_chunk(&cap, region_offset)
                else {
                    return Err(reach.refusal());
                };
                let keys = pinned.chunk_keys_of(rdma, index, chunk)?;
                let slot = (cap.issued, gid, chunk as u64, write);
                let reuse = windows
                    .get(&slot)
                    .filter(|w| w.is_live() && w.is_for(&cap) && (w.from, w.to) == (from, to));
                let window = match reuse {
                    Some(w) => Arc::clone(w),
                    None => {
                        let w = rdma.bind_window(qp, &keys, cap, (from, to), write)?;
                        if let Some(old) = windows.insert(slot, Arc::clone(&w)) {
                            old.invalidate();
                        }
                        w
                    }
                };
                out.push(regions_proto::frame::RdmaChunkKey {
                    pool_offset: chunk as u64 * CHUNK_SIZE + from,
                    addr: keys.addr() + from,
                    rkey: window.rkey,
                    len: to - from,
                });
            }
            // A revocation that came meanwhile wins (and may have missed a window bound
            // after it swept).
            if !reach.still_valid(shared.pools.revocations()) {
                windows.retain(|_, w| {
                    let revoked = w.is_for(&cap);
                    if revoked {
                        w.invalidate();
                    }
                    !revoked
                });
                return Err(reach.refusal());
            }
            Ok(out)
        });
        match result {
            Ok(keys) => {
                let mut payload =
                    BytesMut::with_capacity(keys.len() * regions_proto::frame::RDMA_CHUNK_KEY_LEN);
                keys.iter().for_each(|k| k.encode(&mut payload));
                self.reply_ok(h, payload.freeze());
            }
            Err(e) => {
                // A queue pair that failed to bind is broken: the client sets RDMA up anew.
                if self.queue_pair.as_ref().is_some_and(|q| q.is_broken()) {
                    self.drop_windows();
                    self.queue_pair = None;
                }
                self.reply_error(h, &e);
            }
        }
    }

    /// [`Op::RdmaReadKeys`] / [`Op::RdmaWriteKeys`]: the remote keys of the whole chunks
    /// under the range, after the checks of a READ (WRITE) of those chunks.
    fn rdma_keys(
        &mut self,
        h: &Header,
        pool: u32,
        offset: u64,
        len: u64,
        write: bool,
        reach: Reach,
    ) {
        #[cfg(feature = "rdma")]
        {
            use regions_proto::layout::CHUNK_SIZE;
            let Some(rdma) = self.shared.rdma.get().cloned() else {
                return self.reply_error(h, &no_rdma());
            };
            if self.queue_pair.is_none() {
                return self.reply_err(
                    h,
                    libc::ENOTCONN,
                    "no RDMA queue pair on this connection: send RDMA-CONNECT first",
                );
            }
            if !self.auth.proved_secret() {
                return self.window_keys(h, &rdma, pool, offset, len, write, reach);
            }
            // Whole chunks: a key reaches its whole registration.
            let start = offset - offset % CHUNK_SIZE;
            let end = offset
                .saturating_add(len.max(1))
                .div_ceil(CHUNK_SIZE)
                .saturating_mul(CHUNK_SIZE);
            let range = Range {
                pool,
                offset: start,
                len: end - start,
                delta: h.stated_delta(),
            };
            let shared = Arc::clone(&self.shared);
            let result = shared.pools.resolve(&[range]).and_then(|resolved| {
                let pinned = resolved.pin(self.deadline())?;
                reach.check(&pinned)?;
                let keys = pinned.chunk_keys(&rdma, write)?;
                // A revocation that came meanwhile wins.
                if !reach.still_valid(shared.pools.revocations()) {
                    return Err(reach.refusal());
                }
                Ok(keys)
            });
            match result {
                Ok(keys) => {
                    let mut payload = BytesMut::with_capacity(
                        keys.len() * regions_proto::frame::RDMA_CHUNK_KEY_LEN,
                    );
                    keys.iter().for_each(|k| k.encode(&mut payload));
                    self.reply_ok(h, payload.freeze());
                }
                Err(e) => self.reply_error(h, &e),
            }
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (pool, offset, len, write, reach);
            self.reply_error(h, &no_rdma());
        }
    }

    fn atomic(&mut self, h: &Header, pool: u32, offset: u64, reach: Reach, op: WordOp) {
        let shared = Arc::clone(&self.shared);
        self.on_word(h, pool, offset, reach, |pinned| {
            // Where the device's atomics exclude only one another and clients apply them
            // one-sided, the daemon applies its own through the device too.
            #[cfg(feature = "rdma")]
            if let Some(rdma) = shared.rdma.get()
                && rdma.routes_atomics()
            {
                let old = pinned.device_word_op(rdma, op)?;
                Stats::add(&shared.stats.device_atomics, 1);
                counter!("regions_daemon_device_atomics_total").increment(1);
                return Ok(old);
            }
            pinned.word_op(op)
        });
    }

    /// [`Op::Wake`]: wakes the waiters of the word (changed one-sided over RDMA) and replies
    /// with its value.
    fn wake(&mut self, h: &Header, pool: u32, offset: u64, reach: Reach) {
        self.on_word(h, pool, offset, reach, |p| p.wake());
    }

    /// Runs `f` on the 8-byte word at `offset` of `pool`, pinned and checked against
    /// `reach`, and replies with the value it returns.
    fn on_word(
        &mut self,
        h: &Header,
        pool: u32,
        offset: u64,
        reach: Reach,
        f: impl FnOnce(&Pinned<'_>) -> Result<u64>,
    ) {
        let shared = Arc::clone(&self.shared);
        let result = shared
            .pools
            .resolve(&[Range {
                pool,
                offset,
                len: 8,
                delta: h.stated_delta(),
            }])
            .and_then(|resolved| {
                let pinned = resolved.pin(self.deadline())?;
                reach.check(&pinned)?;
                f(&pinned)
            });
        match result {
            Ok(v) => self.reply_ok(h, Bytes::copy_from_slice(&v.to_le_bytes())),
            Err(e) => self.reply_error(h, &e),
        }
    }

    /// Replies once the word at `at` differs from `expected` or `timeout` passed, re-reading
    /// it (pinned) at least every [`WAIT_SLICE`].
    fn wait_change(
        &mut self,
        h: &Header,
        at: Range,
        reach: Reach,
        expected: u64,
        timeout: Duration,
    ) -> Result<(), Close> {
        // Replies to the requests before this one go out before it sleeps.
        self.flush()?;
        let deadline = Instant::now() + timeout;
        let shared = Arc::clone(&self.shared);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let seen = shared.pools.resolve(&[at]).and_then(|resolved| {
                let pinned = resolved.pin(self.deadline())?;
                reach.check(&pinned)?;
                pinned.wait_change(expected, left.min(WAIT_SLICE))
            });
            match seen {
                Ok(v) if v != expected || left.is_zero() => {
                    self.reply_ok(h, Bytes::copy_from_slice(&v.to_le_bytes()));
                    return Ok(());
                }
                Ok(_) => {}
                Err(e) => {
                    self.reply_error(h, &e);
                    return Ok(());
                }
            }
        }
    }

    fn write_vector(&mut self, h: &Header, ranges: &[Range], data: &[u8], reach: Reach) {
        let shared = Arc::clone(&self.shared);
        let result = shared.pools.resolve(ranges).and_then(|resolved| {
            let pinned = resolved.pin(self.deadline())?;
            reach.check(&pinned)?;
            pinned.copy_in_at(0, data);
            Ok(())
        });
        match result {
            Ok(()) => {
                self.shared.stats.bytes_in(data.len() as u64);
                self.reply_ok(h, Bytes::new());
            }
            Err(e) => self.reply_error(h, &e),
        }
    }

    /// Replies to READ / READV: header and the window's bytes in one `sendmsg`, never blocking
    /// while chunks are pinned.
    fn send_ranges(&mut self, h: &Header, ranges: &[Range], reach: Reach) -> Result<(), Close> {
        use std::io::Write as _;
        let shared = Arc::clone(&self.shared);
        let resolved = match shared.pools.resolve(ranges) {
            Ok(r) => r,
            Err(e) => {
                self.reply_error(h, &e);
                return Ok(());
            }
        };
        let total = resolved.len();
        let Ok(payload_len) = u32::try_from(total) else {
            self.reply_err(h, libc::EINVAL, "read larger than a frame");
            return Ok(());
        };
        let mut pinned = match resolved.pin(self.deadline()) {
            Ok(p) => p,
            Err(e) => {
                self.reply_error(h, &e);
                return Ok(());
            }
        };
        if let Err(e) = reach.check(&pinned) {
            drop(pinned);
            self.reply_error(h, &e);
            return Ok(());
        }
        let reply = Header {
            flags: h.flags | FLAG_REPLY,
            capability: 0,
            status: 0,
            payload_len,
            ..*h
        };
        reply.encode(&mut self.out);
        if ranges.len() >= GATHER_MIN_RANGES && total <= GATHER_MAX_BYTES {
            // Many small ranges: copy them into one buffer while pinned and
            // send that, rather than handing the kernel thousands of tiny
            // pieces (each a separate copy and cache miss in tcp_sendmsg).
            let head = self.out.len();
            self.out.resize(head + total as usize, 0);
            pinned.copy_out(&mut self.out[head..]);
            drop(pinned);
            let mut sent = 0;
            while sent < self.out.len() {
                match (&self.stream).write(&self.out[sent..]) {
                    Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        wait_ready(&self.stream, Ready::Write, shared.config.io_timeout)?;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            self.out.clear();
            self.shared.stats.bytes_out(total);
            return Ok(());
        }
        let whole = self.out.len() + total as usize;
        let fingerprint = pinned.fingerprint().to_vec();
        let mut sent = 0;
        while sent < whole {
            match pinned.send(&self.stream, &self.out, sent) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    drop(pinned);
                    wait_ready(&self.stream, Ready::Write, shared.config.io_timeout)?;
                    if !reach.still_valid(shared.pools.revocations()) {
                        tracing::info!(peer = %self.peer, "capability revoked during a read reply; closing the connection");
                        return Err(Close::Logged);
                    }
                    pinned = self.repin(&resolved, &fingerprint)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        drop(pinned);
        self.out.clear();
        self.shared.stats.bytes_out(total);
        Ok(())
    }

    /// Pins `resolved` again after waiting for the socket; the mapping must be unchanged, or
    /// the reply cannot be completed and the connection closes.
    fn repin<'r>(
        &self,
        resolved: &'r Resolved<'_>,
        fingerprint: &[u64],
    ) -> Result<Pinned<'r>, Close> {
        match resolved.pin(Instant::now()) {
            Ok(p) if p.fingerprint() == fingerprint => Ok(p),
            _ => {
                tracing::warn!(peer = %self.peer, "region memory was released during a read reply; closing the connection");
                Err(Close::Logged)
            }
        }
    }

    /// WRITE: the payload goes from the socket straight into the pinned window.
    fn write_direct(&mut self, h: &Header, reach: Reach) -> Result<(), Close> {
        let len = u64::from(h.payload_len);
        let invalid = if h.flags & FLAG_REPLY != 0 {
            Some(FrameError::UnexpectedReply(h.op).to_string())
        } else if h.length != len {
            Some(format!(
                "malformed write frame: length field (must equal payload length) is {}, \
                 expected {len}",
                h.length
            ))
        } else if h.offset.checked_add(len).is_none() {
            Some(
                FrameError::Overflow {
                    offset: h.offset,
                    len,
                }
                .to_string(),
            )
        } else {
            None
        };
        if let Some(message) = invalid {
            self.discard(len)?;
            self.reply_err(h, libc::EINVAL, &message);
            return Ok(());
        }
        let shared = Arc::clone(&self.shared);
        let range = Range {
            pool: h.pool,
            offset: h.offset,
            len,
            delta: h.stated_delta(),
        };
        let resolved = match shared.pools.resolve(&[range]) {
            Ok(r) => r,
            Err(e) => {
                self.discard(len)?;
                self.reply_error(h, &e);
                return Ok(());
            }
        };
        let mut pinned = match resolved.pin(self.deadline()) {
            Ok(p) => p,
            Err(e) => {
                self.discard(len)?;
                self.reply_error(h, &e);
                return Ok(());
            }
        };
        if let Err(e) = reach.check(&pinned) {
            drop(pinned);
            self.discard(len)?;
            self.reply_error(h, &e);
            return Ok(());
        }
        let fingerprint = pinned.fingerprint().to_vec();
        let take = (len as usize).min(self.input.len());
        pinned.copy_in_at(0, &self.input.available()[..take]);
        self.input.consume(take);
        let mut done = take;
        while (done as u64) < len {
            match pinned.recv(&self.stream, done) {
                Ok(0) => return Err(Close::Quiet("peer closed in the middle of a write".into())),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    drop(pinned);
                    wait_ready(&self.stream, Ready::Read, shared.config.io_timeout)?;
                    if !reach.still_valid(shared.pools.revocations()) {
                        // The rest of the payload is dropped; what arrived is written.
                        self.discard(len - done as u64)?;
                        let e = DaemonError::Revoked(
                            "the capability was revoked while the write's payload arrived: \
                             renew it and write again"
                                .into(),
                        );
                        self.reply_error(h, &e);
                        return Ok(());
                    }
                    pinned = match resolved.pin(Instant::now()) {
                        Ok(p) if p.fingerprint() == fingerprint => p,
                        _ => return self.write_lost(h, len, done),
                    };
                }
                Err(e) => return Err(e.into()),
            }
        }
        drop(pinned);
        self.shared.stats.bytes_in(len);
        self.reply_ok(h, Bytes::new());
        Ok(())
    }

    /// The target of a WRITE was released while its payload arrived: drop the rest, `EFAULT`.
    fn write_lost(&mut self, h: &Header, len: u64, done: usize) -> Result<(), Close> {
        self.discard(len - done as u64)?;
        let e = DaemonError::Remapped { gid: h.pool };
        self.reply_error(h, &e);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbuf_fills_compacts_and_consumes() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let mut buf = InBuf::new(100);
        client.write_all(&[1u8; 80]).unwrap();
        let mut got = 0;
        while got < 80 {
            got += buf.fill(&server).unwrap();
        }
        buf.consume(70);
        assert_eq!(buf.len(), 10);
        client.write_all(&[2u8; 60]).unwrap();
        while buf.len() < 30 {
            buf.fill(&server).unwrap();
        }
        // Filling at the end compacts first.
        while buf.len() < 70 {
            buf.fill(&server).unwrap();
        }
        assert_eq!(&buf.available()[..10], &[1u8; 10]);
        assert_eq!(&buf.available()[10..], &[2u8; 60]);
        buf.consume(1000);
        assert_eq!(buf.len(), 0);
        drop(client);
        assert_eq!(buf.fill(&server).unwrap(), 0);
    }
}
