//! Requests whose callers do not wait for the reply ("posted"): a mutex unlock costs one send
//! instead of a round trip, and so does a small write through the mount.
//!
//! Posted requests go out on one connection, the *lane*, and their replies are owed in order.
//! While any reply is owed, every atomic of the transport goes out on the lane too, so it is
//! applied after the posted ones (one connection, one daemon thread, in order); its sender
//! reads the owed replies before its own. Reads and unposted writes first wait for the
//! replies of posted writes. A reaper thread reads owed replies when nobody else does within
//! about a millisecond, so a reply that asks for follow-up work (a lock with waiters) is
//! handled promptly.
//!
//! A posted write keeps its bytes until its reply says the daemon applied them. When the
//! lane breaks, the writes whose replies it owed are written again, in order, on other
//! connections (with the usual retries) before anything else of this transport is sent:
//! every request goes through the lane's lock first. A write the daemon refused, or one
//! that could not be written again, is recorded for its owner (regionfs: the inode), which
//! learns it at its next `fsync` or close ([`TcpTransport::settle_posted_writes`]).
//!
//! Completions run on whatever thread reads the reply, with the lane locked: they must be
//! short and must not call back into the transport.

use std::collections::{HashMap, VecDeque};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use regions_proto::frame::Op;

use super::{
    Conn, Failure, TcpTransport, atomic_header, plan_requests, read_atomic_reply, recv_header,
    recv_message, send, skip_payload,
};
use crate::error::{RegionsError, Result};
use crate::transport::{Completion, PostedWrite, Span, TransportStats};

/// How often the reaper looks at the lane while replies are owed.
const REAP_TICK: Duration = Duration::from_micros(500);
/// Ticks without owed replies before the reaper parks until the next post.
const PARK_AFTER_TICKS: u32 = 100;
/// How long the reaper waits for a reply before looking at the lane again.
const REAP_POLL: Duration = Duration::from_millis(50);
/// How long an idle reaper waits before checking that its transport still exists.
const REAP_IDLE: Duration = Duration::from_secs(1);
/// Bytes of posted writes whose replies may be owed at once; a poster past it reads replies.
const WRITE_WINDOW: usize = 8 << 20;
/// Posted write requests whose replies may be owed at once (their replies must fit in the
/// daemon's socket buffer while nobody reads them, or the daemon stops reading requests).
const MAX_OWED_WRITES: usize = 256;
/// A lane connection idle this long is replaced before a post (daemons close connections
/// idle for minutes; a post on one the daemon closed would only be written again).
const LANE_IDLE_MAX: Duration = Duration::from_secs(30);
/// How long a post waits to connect the lane before the write goes the usual way.
const LANE_CONNECT: Duration = Duration::from_millis(500);

/// The connection of posted requests and the replies it owes.
#[derive(Default)]
pub(super) struct Lane {
    state: Mutex<LaneState>,
    owed_changed: Condvar,
}

#[derive(Default)]
struct LaneState {
    conn: Option<Conn>,
    /// A second handle on `conn`'s socket, polled by the reaper without the lock.
    watch: Option<Arc<TcpStream>>,
    owed: VecDeque<Owed>,
    /// Bytes and requests of the posted writes among `owed`.
    owed_write_bytes: usize,
    owed_writes: usize,
    /// Posted writes lost with a lane connection, oldest first: written again before
    /// anything else goes to the daemon ([`TcpTransport::rewrite_lost`]).
    rewrite: VecDeque<Arc<PostedWrite>>,
    /// Per owner: the first posted write that did not land (refused by the daemon, or not
    /// written again), until the owner forgets it ([`TcpTransport::forget_posted_failure`]).
    failed: HashMap<u64, Lost>,
    /// When the lane connection last carried a request.
    last_used: Option<Instant>,
    reaper: bool,
    /// The reaper waits for a post (else it looks every tick).
    reaper_parked: bool,
}

/// A posted write that did not land: where, and why.
struct Lost {
    ino: u64,
    offset: u64,
    len: u64,
    reason: String,
}

impl Lost {
    fn error(&self) -> RegionsError {
        RegionsError::WriteLost {
            ino: self.ino,
            offset: self.offset,
            len: self.len,
            errno: libc::EIO,
            reason: self.reason.clone(),
        }
    }
}

/// A posted request's reply, not read yet.
struct Owed {
    id: u64,
    then: Then,
}

/// What a posted request's reply settles.
enum Then {
    /// An atomic: the old value (or the error) goes to the completion.
    Atomic(Completion),
    /// One request (of `bytes` bytes) of a posted write.
    Write {
        write: Arc<PostedWrite>,
        bytes: usize,
    },
}

impl LaneState {
    /// The lane connection broke: every owed reply is lost. Owed atomics fail; owed writes
    /// are to be written again ([`TcpTransport::rewrite_lost`]).
    fn fail(&mut self, addr: &str, reason: &str) {
        if let Some(conn) = self.conn.take() {
            // Reset, not close, once the reaper's copy goes too: requests still in the
            // daemon's socket buffer are then dropped rather than applied after they are
            // written again elsewhere (one the daemon already read may still be applied
            // late: posted writes are at most 64 KiB, which a daemon never holds waiting for
            // buffer space, so that takes a daemon stalled for the whole retry bound).
            let off = nix::sys::socket::sockopt::Linger;
            let _ = nix::sys::socket::setsockopt(
                &conn.stream,
                off,
                &libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                },
            );
        }
        self.watch = None;
        for owed in std::mem::take(&mut self.owed) {
            match owed.then {
                Then::Atomic(done) => done(Err(RegionsError::DaemonUnreachable {
                    addr: addr.to_owned(),
                    attempts: 1,
                    elapsed_ms: 0,
                    reason: format!("{reason} (before the reply to a posted request)"),
                })),
                Then::Write { write, bytes } => {
                    self.write_answered(bytes);
                    self.keep_for_rewrite(write);
                }
            }
        }
    }

    /// Counts a posted write request as answered.
    fn write_answered(&mut self, bytes: usize) {
        self.owed_write_bytes = self.owed_write_bytes.saturating_sub(bytes);
        self.owed_writes = self.owed_writes.saturating_sub(1);
    }

    /// Queues `write` to be written again (once, however many requests it took).
    fn keep_for_rewrite(&mut self, write: Arc<PostedWrite>) {
        if !self.rewrite.back().is_some_and(|w| Arc::ptr_eq(w, &write)) {
            self.rewrite.push_back(write);
        }
    }

    /// Records that posted `write` did not land, and why (its owner's first failure counts).
    fn note_failed(&mut self, write: &PostedWrite, reason: String) {
        self.failed.entry(write.owner).or_insert_with(|| Lost {
            ino: write.spans.first().map_or(0, |s| s.ino),
            offset: write.spans.first().map_or(0, |s| s.region_offset),
            len: write.data.len() as u64,
            reason,
        });
    }

    /// Reads the oldest owed reply and settles it.
    fn reap_one(&mut self, transport_addr: &str) -> std::result::Result<(), String> {
        let Some(conn) = self.conn.as_mut() else {
            if self.owed.is_empty() {
                return Ok(());
            }
            // Cannot happen (`fail` clears both), but never drop an owed request unsettled.
            return Err("the lane lost its connection".into());
        };
        let Some(owed) = self.owed.pop_front() else {
            return Ok(());
        };
        match owed.then {
            Then::Atomic(done) => {
                match read_atomic_reply(&mut conn.stream, owed.id, transport_addr) {
                    Ok(v) => {
                        done(Ok(v));
                        Ok(())
                    }
                    Err(Failure::Final(e)) => {
                        done(Err(e));
                        Ok(())
                    }
                    Err(Failure::Retry(reason)) => {
                        // The owed request's outcome is unknown: its completion says so.
                        done(Err(RegionsError::DaemonUnreachable {
                            addr: transport_addr.to_owned(),
                            attempts: 1,
                            elapsed_ms: 0,
                            reason: reason.clone(),
                        }));
                        Err(reason)
                    }
                }
            }
            Then::Write { write, bytes } => match read_write_reply(&mut conn.stream, owed.id) {
                Ok(None) => {
                    self.write_answered(bytes);
                    Ok(())
                }
                Ok(Some((errno, message))) => {
                    // Refused (the chunk no longer backs the region: a truncate raced it).
                    tracing::warn!(addr = %transport_addr, owner = write.owner, errno, %message, "a daemon refused a posted write");
                    self.write_answered(bytes);
                    self.note_failed(
                        &write,
                        format!("daemon {transport_addr} refused it: {message}"),
                    );
                    Ok(())
                }
                Err(reason) => {
                    self.write_answered(bytes);
                    self.keep_for_rewrite(write);
                    Err(reason)
                }
            },
        }
    }

    /// Reads every owed reply (`Err`: the lane broke, and its owed requests failed).
    fn reap_all(&mut self, addr: &str) -> std::result::Result<(), String> {
        while !self.owed.is_empty() {
            if let Err(reason) = self.reap_one(addr) {
                self.fail(addr, &reason);
                return Err(reason);
            }
        }
        Ok(())
    }
}

/// Reads the reply to write request `id`: `None` when the daemon applied it, else its errno
/// and message (`Err`: the lane is broken).
fn read_write_reply(
    stream: &mut TcpStream,
    id: u64,
) -> std::result::Result<Option<(u32, String)>, String> {
    let reply = recv_header(stream).map_err(failure_reason)?;
    if reply.request_id != id {
        return Err(format!(
            "reply to request {} while waiting for {id}",
            reply.request_id
        ));
    }
    if reply.status != 0 {
        let message = recv_message(stream, &reply).map_err(failure_reason)?;
        return Ok(Some((reply.status, message)));
    }
    skip_payload(stream, &reply).map_err(failure_reason)?;
    Ok(None)
}

fn failure_reason(f: Failure) -> String {
    match f {
        Failure::Retry(reason) => reason,
        Failure::Final(e) => e.to_string(),
    }
}

impl Lane {
    fn lock(&self) -> MutexGuard<'_, LaneState> {
        // A panicking completion cannot leave the state half-changed: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl TcpTransport {
    /// Sends an atomic whose reply goes to `done`; see the module docs.
    pub(super) fn post_atomic(
        &self,
        op: Op,
        at: &Span,
        operands: &[u64],
        done: Completion,
    ) -> Result<()> {
        if self.is_down() {
            return Err(RegionsError::DaemonUnreachable {
                addr: self.addr.clone(),
                attempts: 0,
                elapsed_ms: 0,
                reason: "it failed recently; not posting to it".into(),
            });
        }
        let mut st = self.lane.lock();
        // Behind posted writes a broken lane lost, like everything else.
        self.rewrite_lost(&mut st);
        self.open_lane(&mut st, self.retry.deadline)?;
        let (header, payload) = atomic_header(self, op, at, operands);
        let sent = match st.conn.as_mut() {
            Some(conn) => send(&mut conn.stream, &header, &[&payload]),
            None => Ok(()),
        };
        if let Err(e) = sent {
            st.fail(&self.addr, &e.to_string());
            return Err(RegionsError::DaemonUnreachable {
                addr: self.addr.clone(),
                attempts: 1,
                elapsed_ms: 0,
                reason: format!("cannot send a posted request: {e}"),
            });
        }
        TransportStats::add(&self.stats.remote_requests, 1);
        st.owed.push_back(Owed {
            id: header.request_id,
            then: Then::Atomic(done),
        });
        self.wake_reaper(&mut st);
        Ok(())
    }

    /// Connects the lane (within `timeout`) if it has no connection.
    fn open_lane(&self, st: &mut LaneState, timeout: Duration) -> Result<()> {
        if st.conn.is_none() {
            let conn = match self.idle.lock().ok().and_then(|mut idle| idle.pop()) {
                Some(conn) => conn,
                None => self
                    .connect(timeout, self.retry.deadline)
                    .map_err(|f| self.failure_error(f))?,
            };
            st.watch = conn.stream.try_clone().ok().map(Arc::new);
            st.conn = Some(conn);
        }
        Ok(())
    }

    /// Starts the reaper, or wakes it, after a post.
    fn wake_reaper(&self, st: &mut LaneState) {
        if !st.reaper {
            st.reaper = true;
            let lane = Arc::downgrade(&self.lane);
            let addr = self.addr.clone();
            let spawned = std::thread::Builder::new()
                .name("regions-reaper".into())
                .spawn(move || reap(lane, addr));
            if let Err(e) = spawned {
                // Owed replies are still read by the next request on this transport.
                tracing::warn!(error = %e, "cannot start the reply reaper");
                st.reaper = false;
            }
        }
        if st.reaper_parked {
            self.lane.owed_changed.notify_one();
        }
    }

    /// Sends a write of `owner`'s without waiting for its replies; see the module docs.
    /// `false`: not sent (the daemon failed recently, or the lane cannot connect): the caller
    /// writes the usual way.
    pub(super) fn post_write_on_lane(&self, owner: u64, spans: &[Span], src: &[u8]) -> bool {
        if self.is_down() {
            return false;
        }
        let mut st = self.lane.lock();
        self.rewrite_lost(&mut st);
        if st.failed.contains_key(&owner) {
            // A write of its was lost: its later writes go the usual way (which refreshes a
            // stale map), so that only the lost one is lost.
            return false;
        }
        if st.owed.is_empty() && st.last_used.is_some_and(|at| at.elapsed() > LANE_IDLE_MAX) {
            st.conn = None;
            st.watch = None;
        }
        if let Err(e) = self.open_lane(&mut st, LANE_CONNECT) {
            // The caller's write goes the usual way, with the usual retries.
            tracing::debug!(addr = %self.addr, error = %e, "cannot connect the lane");
            return false;
        }
        let write = Arc::new(PostedWrite {
            owner,
            spans: spans.to_vec(),
            data: src.to_vec(),
        });
        st.last_used = Some(Instant::now());
        for r in plan_requests(&write.spans, Some(&write.data)) {
            let mut header = r.header;
            header.request_id = self.id();
            header.capability = self.cap_id;
            let payload: Vec<&[u8]> = r.payload.iter().map(|p| &p[..]).collect();
            let bytes = header.payload_len as usize;
            let sent = match st.conn.as_mut() {
                Some(conn) => send(&mut conn.stream, &header, &payload),
                None => Err(std::io::Error::other("the lane has no connection")),
            };
            if let Err(e) = sent {
                // This write and every write owed go again on other connections, now.
                st.fail(&self.addr, &e.to_string());
                st.keep_for_rewrite(Arc::clone(&write));
                self.rewrite_lost(&mut st);
                return true;
            }
            TransportStats::add(&self.stats.remote_requests, 1);
            st.owed_write_bytes += bytes;
            st.owed_writes += 1;
            st.owed.push_back(Owed {
                id: header.request_id,
                then: Then::Write {
                    write: Arc::clone(&write),
                    bytes,
                },
            });
        }
        TransportStats::add(&self.stats.remote_bytes_written, src.len() as u64);
        // Flow control: at most a window of bytes and of replies owed.
        while st.owed_write_bytes > WRITE_WINDOW || st.owed_writes > MAX_OWED_WRITES {
            if let Err(reason) = st.reap_one(&self.addr) {
                st.fail(&self.addr, &reason);
                self.rewrite_lost(&mut st);
                break;
            }
        }
        self.wake_reaper(&mut st);
        true
    }

    /// Writes again, in order, the posted writes a broken lane lost (on other connections,
    /// with the usual retries); one that still fails is recorded for its owner. Runs under
    /// the lane lock, which every request of this transport takes first, so nothing sent
    /// later overtakes them.
    fn rewrite_lost(&self, st: &mut LaneState) {
        while let Some(w) = st.rewrite.pop_front() {
            if let Err(e) = self.write_spans(&w.spans, &w.data) {
                tracing::warn!(addr = %self.addr, owner = w.owner, error = %e, "a posted write was lost and writing it again failed");
                st.note_failed(&w, e.to_string());
            }
        }
    }

    /// Waits until every posted write has its reply, or was written again (so that what
    /// follows is applied after them).
    pub(super) fn wait_posted_writes(&self) {
        let mut st = self.lane.lock();
        if st.owed_writes == 0 && st.rewrite.is_empty() {
            return;
        }
        if st.owed_writes > 0 && st.reap_all(&self.addr).is_err() {
            // `reap_all` failed the lane: its owed writes are queued to be written again.
        }
        self.rewrite_lost(&mut st);
    }

    /// Waits for the posted writes ([`Self::wait_posted_writes`]) and returns the first of
    /// `owner`'s that did not land, until [`Self::forget_posted_failure`].
    pub(super) fn settle_posted_writes(&self, owner: u64) -> Option<RegionsError> {
        self.wait_posted_writes();
        self.lane.lock().failed.get(&owner).map(Lost::error)
    }

    /// Forgets the failed posted write of `owner`'s (its last writer closed).
    pub(super) fn forget_posted_failure(&self, owner: u64) {
        self.lane.lock().failed.remove(&owner);
    }

    /// Runs an atomic behind the posted ones when replies are owed (`None`: none are; use
    /// any connection).
    pub(super) fn atomic_on_lane(
        &self,
        op: Op,
        at: &Span,
        operands: &[u64],
    ) -> Option<Result<u64>> {
        let mut st = self.lane.lock();
        if st.owed.is_empty() {
            return None;
        }
        let (header, payload) = atomic_header(self, op, at, operands);
        let sent = match st.conn.as_mut() {
            Some(conn) => send(&mut conn.stream, &header, &[&payload]),
            None => return None,
        };
        if let Err(e) = sent {
            // Nothing of this request went out: it may take another connection.
            st.fail(&self.addr, &e.to_string());
            return None;
        }
        TransportStats::add(&self.stats.remote_requests, 1);
        while !st.owed.is_empty() {
            if let Err(reason) = st.reap_one(&self.addr) {
                st.fail(&self.addr, &reason);
                return Some(Err(RegionsError::DaemonUnreachable {
                    addr: self.addr.clone(),
                    attempts: 1,
                    elapsed_ms: 0,
                    reason: format!("{reason} (not retried: the operation is not idempotent)"),
                }));
            }
        }
        let conn = st.conn.as_mut()?;
        match read_atomic_reply(&mut conn.stream, header.request_id, &self.addr) {
            Ok(v) => Some(Ok(v)),
            Err(Failure::Final(e)) => Some(Err(e)),
            Err(Failure::Retry(reason)) => {
                st.fail(&self.addr, &reason);
                Some(Err(RegionsError::DaemonUnreachable {
                    addr: self.addr.clone(),
                    attempts: 1,
                    elapsed_ms: 0,
                    reason: format!("{reason} (not retried: the operation is not idempotent)"),
                }))
            }
        }
    }
}

/// The reaper: reads owed replies that nobody else reads; ends with its transport.
///
/// It looks at the lane every [`REAP_TICK`] while replies are owed and reads one only when
/// the same reply was already owed a tick earlier, so a caller issuing atomics back to back
/// (unlock, lock, ...) reads them itself and is not slowed by a second reader waking up. An
/// idle reaper parks until the next post.
fn reap(lane: Weak<Lane>, addr: String) {
    let mut oldest_seen: Option<u64> = None;
    let mut idle_ticks = 0u32;
    loop {
        let Some(lane) = lane.upgrade() else { return };
        let mut st = lane.lock();
        let Some(oldest) = st.owed.front().map(|o| o.id) else {
            oldest_seen = None;
            idle_ticks += 1;
            if idle_ticks >= PARK_AFTER_TICKS {
                idle_ticks = 0;
                st.reaper_parked = true;
                let (mut guard, _) = lane
                    .owed_changed
                    .wait_timeout(st, REAP_IDLE)
                    .unwrap_or_else(|p| p.into_inner());
                guard.reaper_parked = false;
            } else {
                drop(st);
                std::thread::sleep(REAP_TICK);
            }
            continue;
        };
        idle_ticks = 0;
        if oldest_seen != Some(oldest) {
            // Newly owed: leave it to the caller's next atomic for a tick.
            oldest_seen = Some(oldest);
            drop(st);
            std::thread::sleep(REAP_TICK);
            continue;
        }
        let Some(watch) = st.watch.clone() else {
            // Owed replies without a connection cannot happen (`fail` clears both).
            st.fail(&addr, "the lane lost its connection");
            continue;
        };
        drop(st);
        if !readable(&watch, REAP_POLL) {
            continue;
        }
        let mut st = lane.lock();
        // Another reader may have taken the reply meanwhile; read only what is there.
        let same = st.watch.as_ref().is_some_and(|w| Arc::ptr_eq(w, &watch));
        if same && st.owed.front().map(|o| o.id) == Some(oldest) {
            // Every reply already there, not one per tick.
            while !st.owed.is_empty() && readable(&watch, Duration::ZERO) {
                if let Err(reason) = st.reap_one(&addr) {
                    st.fail(&addr, &reason);
                    break;
                }
            }
        }
    }
}

/// Whether `stream` has bytes to read (or hung up) within `timeout`.
fn readable(stream: &TcpStream, timeout: Duration) -> bool {
    let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
    let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
    matches!(poll(&mut fds, PollTimeout::from(ms)), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Transport;
    use crate::transport::tcp::RetryPolicy;
    use regions_proto::auth::Secret;
    use regions_proto::frame::{FLAG_REPLY, HEADER_LEN, Header};
    use regions_proto::handshake::ServerHello;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::mpsc;

    /// Reads one request frame (header and payload) of a fake daemon's client; `None` once
    /// the client hung up.
    fn read_request(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head).ok()?;
        let h = Header::decode(&head).unwrap();
        let mut payload = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut payload).unwrap();
        Some((h, payload))
    }

    /// Answers request `h` with `payload`.
    fn write_reply(s: &mut TcpStream, h: &Header, payload: &[u8]) {
        let mut reply = Header::new(h.op, h.request_id);
        reply.flags |= FLAG_REPLY;
        reply.payload_len = payload.len().try_into().unwrap();
        let mut out = bytes::BytesMut::new();
        reply.encode(&mut out);
        out.extend_from_slice(payload);
        s.write_all(&out).unwrap();
    }

    /// The daemon's side of the cluster-secret HELLO with the secret `s`.
    fn serve_hello(s: &mut TcpStream) {
        let secret = secret();
        let (open, payload) = read_request(s).unwrap();
        let (hello, challenge) = ServerHello::challenge(&secret, &payload).unwrap();
        write_reply(s, &open, &challenge);
        let (proof, payload) = read_request(s).unwrap();
        hello.verify(&secret, &payload).unwrap();
        write_reply(s, &proof, &[]);
    }

    fn secret() -> Secret {
        Secret::new("s").unwrap()
    }

    /// A daemon stand-in: answers HELLO, then applies CAS requests to one word in order,
    /// after `delay` each.
    fn fake_daemon(delay: Duration) -> (String, std::thread::JoinHandle<u64>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let handle = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            serve_hello(&mut s);
            let mut word = 0u64;
            while let Some((h, payload)) = read_request(&mut s) {
                if h.op != Op::Cas {
                    write_reply(&mut s, &h, &[]);
                    continue;
                }
                std::thread::sleep(delay);
                let expected = u64::from_le_bytes(payload[..8].try_into().unwrap());
                let new = u64::from_le_bytes(payload[8..16].try_into().unwrap());
                let old = word;
                if old == expected {
                    word = new;
                }
                write_reply(&mut s, &h, &old.to_le_bytes());
            }
            word
        });
        (addr, handle)
    }

    fn word() -> Span {
        Span {
            ino: 0,
            region_offset: 0,
            pool: 0,
            pool_offset: 0,
            len: 8,
        }
    }

    /// Serves one connection of a daemon stand-in for writes: answers HELLO, then applies
    /// WRITE requests in order, refusing (ESTALE) those at pool offsets in `refuse`, and
    /// hangs up at request number `hang_up_after` (from 1) without applying it; pushes
    /// applied offsets.
    fn serve_writes(
        s: &mut TcpStream,
        refuse: &[u64],
        hang_up_after: Option<usize>,
        applied: &mut Vec<u64>,
    ) {
        serve_hello(s);
        let mut seen = 0;
        while let Some((h, payload)) = read_request(s) {
            seen += 1;
            if hang_up_after.is_some_and(|n| seen >= n) {
                return;
            }
            if h.op == Op::Write && refuse.contains(&h.offset) {
                let msg = b"stale map";
                let mut reply = Header::new(h.op, h.request_id);
                reply.flags |= FLAG_REPLY;
                reply.status = libc::ESTALE as u32;
                reply.payload_len = msg.len() as u32;
                let mut out = bytes::BytesMut::new();
                reply.encode(&mut out);
                out.extend_from_slice(msg);
                s.write_all(&out).unwrap();
                continue;
            }
            if h.op == Op::Write {
                assert_eq!(payload.len() as u64, h.length);
                applied.push(h.offset);
            }
            write_reply(s, &h, &[]);
        }
    }

    fn at(offset: u64) -> Span {
        Span {
            ino: 0,
            region_offset: offset,
            pool: 0,
            pool_offset: offset,
            len: 64 << 10,
        }
    }

    const K: u64 = 64 << 10;

    #[test]
    fn a_refused_posted_write_is_reported_to_its_owner_until_forgotten() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let daemon = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut applied = Vec::new();
            serve_writes(&mut s, &[K], None, &mut applied);
            applied
        });
        let t = TcpTransport::new(&addr, &secret(), RetryPolicy::default(), Arc::default());
        let data = vec![7u8; K as usize];
        // Owner 1: 0, K (refused), 2K; owner 2: 3K, in between.
        assert!(t.post_write(1, &[at(0)], &data));
        assert!(t.post_write(1, &[at(K)], &data));
        assert!(t.post_write(2, &[at(3 * K)], &data));
        assert!(t.post_write(1, &[at(2 * K)], &data));
        assert!(t.settle_writes(2).is_none(), "owner 2's landed");
        let lost = t
            .settle_writes(1)
            .expect("owner 1 hears of its refused write");
        assert_eq!(lost.errno(), libc::EIO, "{lost}");
        assert!(lost.to_string().contains("stale map"), "{lost}");
        assert!(t.settle_writes(1).is_some(), "reported again");
        assert!(
            !t.post_write(1, &[at(4 * K)], &data),
            "owner 1's later writes go the usual way"
        );
        assert!(
            t.post_write(2, &[at(5 * K)], &data),
            "owner 2 keeps posting"
        );
        t.forget_failed_writes(1);
        assert!(t.settle_writes(1).is_none(), "forgotten");
        assert!(t.post_write(1, &[at(4 * K)], &data), "posting again");
        assert!(t.settle_writes(1).is_none());
        drop(t);
        assert_eq!(daemon.join().unwrap(), vec![0, 3 * K, 2 * K, 5 * K, 4 * K]);
    }

    #[test]
    fn posted_writes_lost_with_the_lane_are_written_again_in_order_before_anything_else() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        // The lane's connection applies two writes and hangs up at the third without
        // applying it; the next connection applies what comes.
        let daemon = std::thread::spawn(move || {
            let mut applied = Vec::new();
            let (mut s, _) = listener.accept().unwrap();
            serve_writes(&mut s, &[], Some(3), &mut applied);
            drop(s);
            let (mut s, _) = listener.accept().unwrap();
            serve_writes(&mut s, &[], None, &mut applied);
            applied
        });
        let t = TcpTransport::new(&addr, &secret(), RetryPolicy::default(), Arc::default());
        let data = vec![1u8; K as usize];
        assert!(t.post_write(9, &[at(0)], &data));
        assert!(t.post_write(9, &[at(K)], &data));
        assert!(t.post_write(9, &[at(2 * K)], &data));
        // A plain write goes after the lost posted ones are written again.
        t.write(&[at(5 * K)], &data).unwrap();
        assert!(t.settle_writes(9).is_none(), "written again: nothing lost");
        drop(t);
        assert_eq!(daemon.join().unwrap(), vec![0, K, 2 * K, 5 * K]);
    }

    #[test]
    fn a_posted_write_that_cannot_be_written_again_is_reported() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let daemon = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            serve_writes(&mut s, &[], Some(1), &mut Vec::new());
            // The daemon is gone: no one listens any more.
        });
        let retry = RetryPolicy {
            deadline: Duration::from_millis(300),
            backoff: Duration::from_millis(20),
        };
        let t = TcpTransport::new(&addr, &secret(), retry, Arc::default());
        assert!(t.post_write(4, &[at(0)], &vec![2u8; K as usize]));
        daemon.join().unwrap();
        let lost = t.settle_writes(4).expect("the lost write is reported");
        assert_eq!(lost.errno(), libc::EIO, "{lost}");
    }

    #[test]
    fn posted_requests_are_applied_before_later_atomics_and_completed_in_order() {
        let (addr, daemon) = fake_daemon(Duration::from_millis(5));
        let t = TcpTransport::new(&addr, &secret(), RetryPolicy::default(), Arc::default());
        let (tx, rx) = mpsc::channel();
        for i in 0..3u64 {
            let tx = tx.clone();
            t.post_atomic(
                Op::Cas,
                &word(),
                &[i, i + 1],
                Box::new(move |r| tx.send((i, r.unwrap())).unwrap()),
            )
            .unwrap();
        }
        // Applied after the three posted swaps: 3 -> 10.
        assert_eq!(t.compare_and_swap(&word(), 3, 10).unwrap(), 3);
        let done: Vec<_> = rx.try_iter().collect();
        assert_eq!(done, vec![(0, 0), (1, 1), (2, 2)]);
        drop(t);
        assert_eq!(daemon.join().unwrap(), 10);
    }

    #[test]
    fn the_reaper_completes_a_posted_request_nobody_waits_for() {
        let (addr, _daemon) = fake_daemon(Duration::ZERO);
        let t = TcpTransport::new(&addr, &secret(), RetryPolicy::default(), Arc::default());
        let (tx, rx) = mpsc::channel();
        t.post_atomic(
            Op::Cas,
            &word(),
            &[0, 7],
            Box::new(move |r| tx.send(r.unwrap()).unwrap()),
        )
        .unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 0);
    }

    #[test]
    fn a_lost_connection_fails_the_owed_completions() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        // Answers HELLO, then reads one request and hangs up without replying.
        let daemon = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            serve_hello(&mut s);
            read_request(&mut s).unwrap();
        });
        let t = TcpTransport::new(&addr, &secret(), RetryPolicy::default(), Arc::default());
        let (tx, rx) = mpsc::channel();
        t.post_atomic(
            Op::Cas,
            &word(),
            &[0, 1],
            Box::new(move |r| tx.send(r.map_err(|e| e.errno())).unwrap()),
        )
        .unwrap();
        daemon.join().unwrap();
        let outcome = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(outcome, Err(libc::EIO));
    }
}
