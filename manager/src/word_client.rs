//! The manager's requests to daemons, over their transport port with the cluster secret: a
//! compare-and-swap or a fetch-add on the 8-byte lock word a daemon holds
//! (docs/ARCHITECTURE.md, "Barriers, mutexes and doorbells"), and the object requests that
//! place, move and free small regions ([`WordClient::call`]).
//!
//! The manager moves no region data. It changes a mutex's word only to queue callers and hand
//! the mutex on, and reads a barrier's word to wake sleepers; the daemon that holds the word
//! applies each operation atomically against the clients' own operations on it. This client
//! speaks the transport's frame format (`regions_proto::frame`) and HELLO handshake
//! (`regions_proto::handshake`) on tokio sockets, keeping idle connections per daemon. An
//! operation is sent once and never again (it is not idempotent), its reply awaited for a
//! bounded time; a daemon that failed is not tried again for a second.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use regions_proto::auth::Secret;
pub use regions_proto::frame::WordAt;
use regions_proto::frame::{FLAG_REPLY, HEADER_LEN, Header, Op, Request};
use regions_proto::handshake::{CHALLENGE_REPLY_LEN, ClientHello};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long the client waits, and for what.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// How long connecting to a daemon is retried for one operation.
    pub deadline: Duration,
    /// How long a request waits for its reply.
    pub io: Duration,
    /// After a daemon failed, how long operations on it fail at once.
    pub quiet: Duration,
    /// The connection deadline of the operation that probes a daemon that failed.
    pub probe: Duration,
}

impl Default for Timeouts {
    /// As the client library's transports: an unreachable daemon is `EIO` within 5 s.
    fn default() -> Timeouts {
        Timeouts {
            deadline: Duration::from_millis(4500),
            io: Duration::from_millis(4500),
            quiet: Duration::from_secs(1),
            probe: Duration::from_millis(500),
        }
    }
}

/// The least time one connection attempt is given.
const MIN_ATTEMPT: Duration = Duration::from_millis(10);
/// Idle connections kept per daemon.
const MAX_IDLE: usize = 16;
/// The first pause between attempts (doubling, at most half a second).
const BACKOFF: Duration = Duration::from_millis(20);
/// Longest error message read from a daemon's reply.
const MAX_MESSAGE: usize = 64 << 10;

/// Why an operation on a word failed.
#[derive(Debug, thiserror::Error)]
pub enum WordError {
    /// The daemon could not be reached (or the connection failed mid-request).
    #[error("daemon {addr} unreachable after {attempts} attempts: {reason}")]
    Unreachable {
        addr: String,
        attempts: u32,
        reason: String,
    },
    /// The daemon refused the operation.
    #[error("daemon {addr} refused the operation (errno {errno}): {message}")]
    Refused {
        addr: String,
        errno: u32,
        message: String,
    },
}

/// Why one attempt failed: worth another connection, or final.
enum Failure {
    Retry(String),
    Final(WordError),
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        Failure::Retry(e.to_string())
    }
}

/// What the client keeps per daemon.
#[derive(Default)]
struct Daemon {
    /// Authenticated connections not in use.
    idle: Vec<TcpStream>,
    /// When an operation last gave up on the daemon (cleared by an answer).
    down_at: Option<Instant>,
}

/// Atomic word operations on daemons, with the cluster secret.
pub struct WordClient {
    secret: Secret,
    timeouts: Timeouts,
    next_id: AtomicU64,
    daemons: Mutex<HashMap<String, Daemon>>,
}

impl WordClient {
    pub fn new(secret: Secret) -> WordClient {
        Self::with_timeouts(secret, Timeouts::default())
    }

    pub fn with_timeouts(secret: Secret, timeouts: Timeouts) -> WordClient {
        WordClient {
            secret,
            timeouts,
            next_id: AtomicU64::new(1),
            daemons: Mutex::new(HashMap::new()),
        }
    }

    /// Compare-and-swap on the word at `at` held by the daemon at `addr`; the old value.
    pub async fn compare_and_swap(
        &self,
        addr: &str,
        at: &WordAt,
        expected: u64,
        new: u64,
    ) -> Result<u64, WordError> {
        self.atomic(addr, Op::Cas, at, &[expected, new]).await
    }

    /// Fetch-add on the word at `at` held by the daemon at `addr`; the old value.
    pub async fn fetch_add(&self, addr: &str, at: &WordAt, addend: u64) -> Result<u64, WordError> {
        self.atomic(addr, Op::FetchAdd, at, &[addend]).await
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// One atomic, sent once (see [`WordClient::once`]); the old value of the word.
    async fn atomic(
        &self,
        addr: &str,
        op: Op,
        at: &WordAt,
        operands: &[u64],
    ) -> Result<u64, WordError> {
        // Capability 0: the connection proved the cluster secret.
        let (header, payload) = Header::atomic(op, self.id(), 0, at, operands);
        let reply = self.once(addr, header, &payload, 8).await?;
        let word: [u8; 8] = reply
            .try_into()
            .map_err(|r: Vec<u8>| WordError::Unreachable {
                addr: addr.to_owned(),
                attempts: 1,
                reason: format!("atomic reply of {} bytes", r.len()),
            })?;
        Ok(u64::from_le_bytes(word))
    }

    /// Sends `request` (cluster secret, no capability) to the daemon at `addr` once, as
    /// [`WordClient::once`] does; the payload of its reply, at most `max_reply` bytes. The
    /// objects of small regions are allocated, moved and freed this way.
    pub async fn call(
        &self,
        addr: &str,
        request: &Request,
        max_reply: usize,
    ) -> Result<Vec<u8>, WordError> {
        let frame = request.to_frame(self.id(), 0);
        self.once(addr, frame.header, &frame.payload, max_reply)
            .await
    }

    /// Writes `data` at the start of the chunk `entry` of region `ino` (its first chunk),
    /// naming the region, so that the daemon refuses (`ESTALE`) a chunk that backs anything
    /// else by then.
    pub async fn write_region(
        &self,
        addr: &str,
        ino: u64,
        entry: regions_proto::layout::MapEntry,
        data: &[u8],
    ) -> Result<(), WordError> {
        let mut frame = Request::Write {
            pool: entry.gid,
            offset: entry.pool_offset,
            data: bytes::Bytes::copy_from_slice(data),
        }
        .to_frame(self.id(), 0);
        frame.header.name_region(ino, 0, entry.pool_offset);
        self.once(addr, frame.header, &frame.payload, 0)
            .await
            .map(drop)
    }

    /// One request, sent once: on an idle connection that is still open, else on a new one
    /// (connecting is retried until the deadline). Once the request is out, nothing is sent
    /// again: the operation may have been applied. The reply is awaited for a bounded time.
    /// After a daemon failed, operations on it fail at once for a while, then one probes
    /// with a shorter deadline ([`Timeouts`]).
    async fn once(
        &self,
        addr: &str,
        header: Header,
        payload: &[u8],
        max_reply: usize,
    ) -> Result<Vec<u8>, WordError> {
        let (pooled, deadline) = self.take(addr)?;
        let mut stream = match pooled {
            Some(stream) => stream,
            None => self.connect_within(addr, deadline).await?,
        };
        let io = self.timeouts.io;
        let exchange = self.exchange(addr, &mut stream, &header, payload, max_reply);
        let reason = match tokio::time::timeout(io, exchange).await {
            Ok(Ok(reply)) => {
                self.answered(addr, Some(stream));
                return Ok(reply);
            }
            Ok(Err(Failure::Final(e))) => {
                self.answered(addr, None);
                return Err(e);
            }
            Ok(Err(Failure::Retry(reason))) => reason,
            Err(_) => format!("no reply within {io:?}"),
        };
        self.gave_up(addr);
        Err(WordError::Unreachable {
            addr: addr.to_owned(),
            attempts: 1,
            reason: format!("{reason} (not retried: the operation may have been applied)"),
        })
    }

    /// An idle connection to `addr` that the daemon has not closed, if any, and how long a
    /// new connection may take; or the error of a daemon that failed a moment ago.
    fn take(&self, addr: &str) -> Result<(Option<TcpStream>, Duration), WordError> {
        let mut daemons = self.daemons.lock().map_err(|_| WordError::Unreachable {
            addr: addr.to_owned(),
            attempts: 0,
            reason: "the word client's lock was poisoned".into(),
        })?;
        let daemon = daemons.entry(addr.to_owned()).or_default();
        if let Some(at) = daemon.down_at {
            let since = at.elapsed();
            if since < self.timeouts.quiet {
                return Err(WordError::Unreachable {
                    addr: addr.to_owned(),
                    attempts: 0,
                    reason: format!(
                        "it failed {} ms ago; not tried again for {} ms",
                        since.as_millis(),
                        self.timeouts.quiet.as_millis()
                    ),
                });
            }
            // This operation probes; others keep failing at once meanwhile.
            daemon.down_at = Some(Instant::now());
            daemon.idle.clear();
            return Ok((None, self.timeouts.probe));
        }
        while let Some(stream) = daemon.idle.pop() {
            if still_open(&stream) {
                return Ok((Some(stream), self.timeouts.deadline));
            }
        }
        Ok((None, self.timeouts.deadline))
    }

    /// The daemon answered: it is up, and `stream` (if still usable) goes back to the pool.
    fn answered(&self, addr: &str, stream: Option<TcpStream>) {
        if let Ok(mut daemons) = self.daemons.lock() {
            let daemon = daemons.entry(addr.to_owned()).or_default();
            if daemon.down_at.take().is_some() {
                tracing::info!(addr, "daemon holding lock words reachable again");
            }
            if let Some(stream) = stream
                && daemon.idle.len() < MAX_IDLE
            {
                daemon.idle.push(stream);
            }
        }
    }

    /// An operation gave up on the daemon.
    fn gave_up(&self, addr: &str) {
        if let Ok(mut daemons) = self.daemons.lock() {
            let daemon = daemons.entry(addr.to_owned()).or_default();
            if daemon.down_at.replace(Instant::now()).is_none() {
                tracing::warn!(addr, "daemon holding lock words unreachable");
            }
            daemon.idle.clear();
        }
    }

    /// A new authenticated connection, retried with backoff until `deadline` has passed.
    async fn connect_within(&self, addr: &str, deadline: Duration) -> Result<TcpStream, WordError> {
        let start = Instant::now();
        let mut backoff = BACKOFF;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let left = deadline.saturating_sub(start.elapsed());
            let reason = match tokio::time::timeout(left.max(MIN_ATTEMPT), self.connect(addr)).await
            {
                Ok(Ok(stream)) => return Ok(stream),
                Ok(Err(Failure::Final(e))) => return Err(e),
                Ok(Err(Failure::Retry(reason))) => reason,
                Err(_) => format!("no connection within {:?}", left.max(MIN_ATTEMPT)),
            };
            if start.elapsed() + backoff >= deadline {
                self.gave_up(addr);
                return Err(WordError::Unreachable {
                    addr: addr.to_owned(),
                    attempts,
                    reason,
                });
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// A connection to `addr` that has passed the cluster-secret handshake (the caller bounds
    /// how long it may take).
    async fn connect(&self, addr: &str) -> Result<TcpStream, Failure> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        self.prove_secret(addr, &mut stream).await?;
        Ok(stream)
    }

    /// The handshake: the daemon proves the cluster secret to us, then we to it.
    async fn prove_secret(&self, addr: &str, stream: &mut TcpStream) -> Result<(), Failure> {
        let refused = |e: regions_proto::handshake::HelloError| {
            Failure::Final(WordError::Refused {
                addr: addr.to_owned(),
                errno: libc::EACCES as u32,
                message: e.to_string(),
            })
        };
        let (hello, open) = ClientHello::start().map_err(refused)?;
        let challenge = self.hello(addr, stream, &open).await?;
        let answer = hello.answer(&self.secret, &challenge).map_err(refused)?;
        self.hello(addr, stream, &answer).await?;
        Ok(())
    }

    /// Sends one HELLO with `payload`; the payload of the daemon's (ok) reply.
    async fn hello(
        &self,
        addr: &str,
        stream: &mut TcpStream,
        payload: &[u8],
    ) -> Result<Vec<u8>, Failure> {
        let mut header = Header::new(Op::Hello, self.id());
        header.payload_len = payload.len() as u32;
        send(stream, &header, payload).await?;
        let reply = recv_reply(addr, stream, header.request_id).await?;
        if reply.payload_len as usize > CHALLENGE_REPLY_LEN {
            return Err(Failure::Retry(format!(
                "HELLO reply of {} bytes",
                reply.payload_len
            )));
        }
        let mut out = vec![0u8; reply.payload_len as usize];
        stream.read_exact(&mut out).await?;
        Ok(out)
    }

    /// Sends one request to the daemon at `addr` and reads the payload of its reply.
    async fn exchange(
        &self,
        addr: &str,
        stream: &mut TcpStream,
        header: &Header,
        payload: &[u8],
        max_reply: usize,
    ) -> Result<Vec<u8>, Failure> {
        send(stream, header, payload).await?;
        let reply = recv_reply(addr, stream, header.request_id).await?;
        if reply.payload_len as usize > max_reply {
            return Err(Failure::Retry(format!(
                "{} reply of {} bytes (at most {max_reply} expected)",
                header.op, reply.payload_len
            )));
        }
        let mut body = vec![0u8; reply.payload_len as usize];
        stream.read_exact(&mut body).await?;
        Ok(body)
    }
}

/// Whether the daemon has not closed an idle connection (nor sent anything on it).
fn still_open(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(stream.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

async fn send(stream: &mut TcpStream, header: &Header, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = BytesMut::with_capacity(HEADER_LEN + payload.len());
    header.encode(&mut buf);
    buf.extend_from_slice(payload);
    stream.write_all(&buf).await
}

/// Reads the reply to request `id`; a daemon's error becomes [`WordError::Refused`].
async fn recv_reply(addr: &str, stream: &mut TcpStream, id: u64) -> Result<Header, Failure> {
    let mut buf = [0u8; HEADER_LEN];
    stream.read_exact(&mut buf).await?;
    let reply =
        Header::decode(&buf).map_err(|e| Failure::Retry(format!("bad reply header: {e}")))?;
    if reply.flags & FLAG_REPLY == 0 || reply.request_id != id {
        return Err(Failure::Retry(format!(
            "unexpected frame (request {}) while waiting for the reply to {id}",
            reply.request_id
        )));
    }
    if reply.status != 0 {
        let len = (reply.payload_len as usize).min(MAX_MESSAGE);
        let mut message = vec![0u8; len];
        stream.read_exact(&mut message).await?;
        return Err(Failure::Final(WordError::Refused {
            addr: addr.to_owned(),
            errno: reply.status,
            message: String::from_utf8_lossy(&message).into_owned(),
        }));
    }
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;
    use regions_proto::frame::FLAG_DELTAS;
    use regions_proto::handshake::ServerHello;
    use tokio::net::TcpListener;

    /// Answers the handshake on `s`.
    async fn accept_hello(s: &mut TcpStream, secret: &Secret) {
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head).await.unwrap();
        let h = Header::decode(&head).unwrap();
        let mut open = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut open).await.unwrap();
        let (server, challenge) = ServerHello::challenge(secret, &open).unwrap();
        reply(s, &h, 0, &challenge).await;
        s.read_exact(&mut head).await.unwrap();
        let h = Header::decode(&head).unwrap();
        let mut proof = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut proof).await.unwrap();
        server.verify(secret, &proof).unwrap();
        reply(s, &h, 0, &[]).await;
    }

    /// Applies `requests` atomics from `s` to `word`; returns the word.
    async fn serve(s: &mut TcpStream, mut word: u64, requests: usize) -> u64 {
        let mut head = [0u8; HEADER_LEN];
        for _ in 0..requests {
            s.read_exact(&mut head).await.unwrap();
            let h = Header::decode(&head).unwrap();
            let mut ops = vec![0u8; h.payload_len as usize];
            s.read_exact(&mut ops).await.unwrap();
            let arg = |i: usize| u64::from_le_bytes(ops[i * 8..i * 8 + 8].try_into().unwrap());
            assert_eq!((h.pool, h.offset, h.length, h.object_id), (3, 4096, 8, 7));
            assert_ne!(
                h.flags & FLAG_DELTAS,
                0,
                "the word's place in its region is stated"
            );
            let old = word;
            match h.op {
                Op::Cas if word == arg(0) => word = arg(1),
                Op::Cas => {}
                Op::FetchAdd => word = word.wrapping_add(arg(0)),
                other => panic!("unexpected {other:?}"),
            }
            reply(s, &h, 0, &old.to_le_bytes()).await;
        }
        word
    }

    async fn reply(s: &mut TcpStream, req: &Header, status: u32, payload: &[u8]) {
        let mut h = *req;
        h.flags = FLAG_REPLY;
        h.delta = 0;
        h.status = status;
        h.payload_len = payload.len() as u32;
        send(s, &h, payload).await.unwrap();
    }

    fn at() -> WordAt {
        WordAt {
            ino: 7,
            region_offset: 0,
            pool: 3,
            pool_offset: 4096,
        }
    }

    fn secret() -> Secret {
        Secret::new("cluster").unwrap()
    }

    fn quick() -> Timeouts {
        Timeouts {
            deadline: Duration::from_millis(300),
            io: Duration::from_millis(300),
            quiet: Duration::from_millis(400),
            probe: Duration::from_millis(100),
        }
    }

    async fn listener() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (l, addr)
    }

    #[tokio::test]
    async fn atomics_reach_the_daemon_on_one_authenticated_connection() {
        let (listener, addr) = listener().await;
        let daemon = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            accept_hello(&mut s, &secret()).await;
            serve(&mut s, 0, 4).await
        });
        let c = WordClient::new(secret());
        assert_eq!(c.compare_and_swap(&addr, &at(), 0, 42).await.unwrap(), 0);
        assert_eq!(
            c.compare_and_swap(&addr, &at(), 0, 9).await.unwrap(),
            42,
            "lost"
        );
        assert_eq!(c.fetch_add(&addr, &at(), 8).await.unwrap(), 42);
        assert_eq!(c.fetch_add(&addr, &at(), 0).await.unwrap(), 50);
        assert_eq!(daemon.await.unwrap(), 50);
    }

    #[tokio::test]
    async fn a_connection_the_daemon_closed_is_replaced_before_sending() {
        let (listener, addr) = listener().await;
        let daemon = tokio::spawn(async move {
            // The first connection serves one request and is closed (an idle timeout).
            let (mut s, _) = listener.accept().await.unwrap();
            accept_hello(&mut s, &secret()).await;
            let word = serve(&mut s, 5, 1).await;
            drop(s);
            let (mut s, _) = listener.accept().await.unwrap();
            accept_hello(&mut s, &secret()).await;
            serve(&mut s, word, 1).await
        });
        let c = WordClient::with_timeouts(secret(), quick());
        assert_eq!(c.fetch_add(&addr, &at(), 1).await.unwrap(), 5);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(c.fetch_add(&addr, &at(), 1).await.unwrap(), 6);
        assert_eq!(daemon.await.unwrap(), 7, "each operation applied once");
    }

    #[tokio::test]
    async fn a_silent_daemon_is_given_up_once_and_then_refused_at_once_until_it_is_probed() {
        let (listener, addr) = listener().await;
        let daemon = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            accept_hello(&mut s, &secret()).await;
            // Reads the request and never answers.
            let mut sink = [0u8; 256];
            let _ = s.read(&mut sink).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        });
        let c = WordClient::with_timeouts(secret(), quick());
        let started = Instant::now();
        let err = c.fetch_add(&addr, &at(), 1).await.unwrap_err();
        assert!(err.to_string().contains("no reply"), "{err}");
        assert!(err.to_string().contains("not retried"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "bounded by the reply timeout"
        );
        let refused = Instant::now();
        let err = c.fetch_add(&addr, &at(), 1).await.unwrap_err();
        assert!(
            matches!(&err, WordError::Unreachable { attempts: 0, .. }),
            "refused at once: {err}"
        );
        assert!(refused.elapsed() < Duration::from_millis(50));
        daemon.abort();
    }

    #[tokio::test]
    async fn a_daemon_with_another_secret_is_refused() {
        let (listener, addr) = listener().await;
        let daemon = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut head = [0u8; HEADER_LEN];
            s.read_exact(&mut head).await.unwrap();
            let h = Header::decode(&head).unwrap();
            let mut open = vec![0u8; h.payload_len as usize];
            s.read_exact(&mut open).await.unwrap();
            let (_, challenge) =
                ServerHello::challenge(&Secret::new("another").unwrap(), &open).unwrap();
            reply(&mut s, &h, 0, &challenge).await;
        });
        let c = WordClient::with_timeouts(secret(), quick());
        let err = c.fetch_add(&addr, &at(), 0).await.unwrap_err();
        assert!(
            matches!(&err, WordError::Refused { errno, .. } if *errno == libc::EACCES as u32),
            "{err}"
        );
        daemon.await.unwrap();
    }

    #[tokio::test]
    async fn an_unreachable_daemon_is_reported_with_its_address() {
        let (listener, addr) = listener().await;
        drop(listener);
        let c = WordClient::with_timeouts(secret(), quick());
        let err = c.fetch_add(&addr, &at(), 0).await.unwrap_err();
        assert!(
            matches!(&err, WordError::Unreachable { attempts, .. } if *attempts > 1),
            "{err}"
        );
        assert!(err.to_string().contains(&addr), "{err}");
    }
}
