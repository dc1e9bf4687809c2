//! The manager's requests to the daemon that holds a lock word (docs/ARCHITECTURE.md,
//! "Barriers, mutexes and doorbells"): a compare-and-swap or a fetch-add on one 8-byte word,
//! sent over that daemon's transport port with the cluster secret.
//!
//! The manager moves no region data. It changes a mutex's word only to queue callers and hand
//! the mutex on, and reads a barrier's word to wake sleepers; the daemon that holds the word
//! applies each operation atomically against the clients' own operations on it. This client
//! speaks the transport's frame format (`regions_proto::frame`) and HELLO handshake
//! (`regions_proto::handshake`) on tokio sockets, one idle connection kept per daemon.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use regions_proto::auth::Secret;
use regions_proto::frame::{FLAG_DELTAS, FLAG_REPLY, HEADER_LEN, Header, Op};
use regions_proto::handshake::{CHALLENGE_REPLY_LEN, ClientHello};
use regions_proto::layout::chunk_delta;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long the manager keeps trying to reach a daemon for one operation.
const DEADLINE: Duration = Duration::from_millis(4500);
/// The first pause between attempts (doubling, at most half a second).
const BACKOFF: Duration = Duration::from_millis(20);
/// Longest error message read from a daemon's reply.
const MAX_MESSAGE: usize = 64 << 10;

/// Where one word lives: its region and offset there, and the pool range behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WordAt {
    pub ino: u64,
    pub region_offset: u64,
    pub pool: u32,
    pub pool_offset: u64,
}

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

/// Atomic word operations on daemons, with the cluster secret.
pub struct WordClient {
    secret: Secret,
    next_id: AtomicU64,
    /// One idle authenticated connection per daemon address.
    idle: Mutex<HashMap<String, TcpStream>>,
}

impl WordClient {
    pub fn new(secret: Secret) -> WordClient {
        WordClient {
            secret,
            next_id: AtomicU64::new(1),
            idle: Mutex::new(HashMap::new()),
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

    /// One atomic on a pooled connection (one free retry when it has gone stale), else on
    /// fresh ones until [`DEADLINE`]. An operation whose request went out on a fresh
    /// connection is not sent again: it is not idempotent.
    async fn atomic(
        &self,
        addr: &str,
        op: Op,
        at: &WordAt,
        operands: &[u64],
    ) -> Result<u64, WordError> {
        let pooled = self.idle.lock().ok().and_then(|mut idle| idle.remove(addr));
        if let Some(mut stream) = pooled {
            match self.request(&mut stream, op, at, operands).await {
                Ok(word) => {
                    self.keep(addr, stream);
                    return Ok(word);
                }
                Err(Failure::Final(e)) => return Err(e),
                Err(Failure::Retry(reason)) => {
                    tracing::debug!(addr, %reason, "stale connection to the daemon; reconnecting");
                }
            }
        }
        let start = Instant::now();
        let mut backoff = BACKOFF;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let reason = match self
                .connect(addr, DEADLINE.saturating_sub(start.elapsed()))
                .await
            {
                Ok(mut stream) => {
                    return match self.request(&mut stream, op, at, operands).await {
                        Ok(word) => {
                            self.keep(addr, stream);
                            Ok(word)
                        }
                        Err(Failure::Final(e)) => Err(e),
                        Err(Failure::Retry(reason)) => Err(WordError::Unreachable {
                            addr: addr.to_owned(),
                            attempts,
                            reason: format!(
                                "{reason} (not retried: the operation may have been applied)"
                            ),
                        }),
                    };
                }
                Err(Failure::Final(e)) => return Err(e),
                Err(Failure::Retry(reason)) => reason,
            };
            if start.elapsed() + backoff >= DEADLINE {
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

    fn keep(&self, addr: &str, stream: TcpStream) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.insert(addr.to_owned(), stream);
        }
    }

    /// A connection to `addr` that has passed the cluster-secret handshake.
    async fn connect(&self, addr: &str, timeout: Duration) -> Result<TcpStream, Failure> {
        let timeout = timeout.max(Duration::from_millis(10));
        let mut stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| Failure::Retry(format!("no connection within {timeout:?}")))??;
        stream.set_nodelay(true)?;
        tokio::time::timeout(timeout, self.prove_secret(addr, &mut stream))
            .await
            .map_err(|_| Failure::Retry(format!("no handshake within {timeout:?}")))??;
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

    /// Sends one atomic request and reads the old value of the word.
    async fn request(
        &self,
        stream: &mut TcpStream,
        op: Op,
        at: &WordAt,
        operands: &[u64],
    ) -> Result<u64, Failure> {
        let addr = stream
            .peer_addr()
            .map_or_else(|_| "the daemon".to_owned(), |a| a.to_string());
        let payload: Vec<u8> = operands.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut header = Header::new(op, self.id());
        header.object_id = at.ino;
        if at.ino != 0 {
            // Where in the region the word lies, so that a daemon refuses a stale location.
            header.flags |= FLAG_DELTAS;
            header.delta = chunk_delta(at.region_offset, at.pool_offset);
        }
        header.pool = at.pool;
        header.offset = at.pool_offset;
        header.length = 8;
        header.payload_len = payload.len() as u32;
        send(stream, &header, &payload).await?;
        let reply = recv_reply(&addr, stream, header.request_id).await?;
        if reply.payload_len != 8 {
            return Err(Failure::Retry(format!(
                "atomic reply of {} bytes",
                reply.payload_len
            )));
        }
        let mut word = [0u8; 8];
        stream.read_exact(&mut word).await?;
        Ok(u64::from_le_bytes(word))
    }
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
    use regions_proto::handshake::ServerHello;
    use tokio::net::TcpListener;

    /// A daemon stand-in: answers the handshake, then applies atomics to one word.
    async fn fake_daemon(secret: Secret, listener: TcpListener, mut word: u64, requests: usize) {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut head = [0u8; HEADER_LEN];
        // Opening HELLO.
        s.read_exact(&mut head).await.unwrap();
        let h = Header::decode(&head).unwrap();
        let mut open = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut open).await.unwrap();
        let (server, challenge) = ServerHello::challenge(&secret, &open).unwrap();
        reply(&mut s, &h, 0, &challenge).await;
        // Proof.
        s.read_exact(&mut head).await.unwrap();
        let h = Header::decode(&head).unwrap();
        let mut proof = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut proof).await.unwrap();
        server.verify(&secret, &proof).unwrap();
        reply(&mut s, &h, 0, &[]).await;
        for _ in 0..requests {
            s.read_exact(&mut head).await.unwrap();
            let h = Header::decode(&head).unwrap();
            let mut ops = vec![0u8; h.payload_len as usize];
            s.read_exact(&mut ops).await.unwrap();
            let arg = |i: usize| u64::from_le_bytes(ops[i * 8..i * 8 + 8].try_into().unwrap());
            assert_eq!((h.pool, h.offset, h.length, h.object_id), (3, 4096, 8, 7));
            let old = word;
            match h.op {
                Op::Cas if word == arg(0) => word = arg(1),
                Op::Cas => {}
                Op::FetchAdd => word = word.wrapping_add(arg(0)),
                other => panic!("unexpected {other:?}"),
            }
            reply(&mut s, &h, 0, &old.to_le_bytes()).await;
        }
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

    #[tokio::test]
    async fn atomics_reach_the_daemon_on_one_authenticated_connection() {
        let secret = Secret::new("cluster").unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let daemon = tokio::spawn(fake_daemon(secret.clone(), listener, 0, 4));
        let c = WordClient::new(secret);
        assert_eq!(c.compare_and_swap(&addr, &at(), 0, 42).await.unwrap(), 0);
        assert_eq!(
            c.compare_and_swap(&addr, &at(), 0, 9).await.unwrap(),
            42,
            "lost"
        );
        assert_eq!(c.fetch_add(&addr, &at(), 8).await.unwrap(), 42);
        assert_eq!(c.fetch_add(&addr, &at(), 0).await.unwrap(), 50);
        daemon.await.unwrap();
    }

    #[tokio::test]
    async fn a_daemon_with_another_secret_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
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
        let c = WordClient::new(Secret::new("cluster").unwrap());
        let err = c.fetch_add(&addr, &at(), 0).await.unwrap_err();
        assert!(
            matches!(&err, WordError::Refused { errno, .. } if *errno == libc::EACCES as u32),
            "{err}"
        );
        daemon.await.unwrap();
    }

    #[tokio::test]
    async fn an_unreachable_daemon_is_reported_with_its_address() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let c = WordClient::new(Secret::new("cluster").unwrap());
        let err = c.fetch_add(&addr, &at(), 0).await.unwrap_err();
        assert!(
            matches!(&err, WordError::Unreachable { attempts, .. } if *attempts > 1),
            "{err}"
        );
        assert!(err.to_string().contains(&addr), "{err}");
    }
}
