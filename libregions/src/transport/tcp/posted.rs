//! Atomics whose callers do not wait for the reply ("posted"): a mutex unlock costs one send
//! instead of a round trip.
//!
//! Posted requests go out on one connection, the *lane*, and their replies are owed in order.
//! While any reply is owed, every atomic of the transport goes out on the lane too, so it is
//! applied after the posted ones (one connection, one daemon thread, in order); its sender
//! reads the owed replies before its own. A reaper thread reads owed replies when nobody else
//! does within about a millisecond, so a reply that asks for follow-up work (a lock with
//! waiters) is handled promptly.
//!
//! Completions run on whatever thread reads the reply, with the lane locked: they must be
//! short and must not call back into the transport.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use regions_proto::frame::Op;

use super::{Conn, Failure, TcpTransport, atomic_header, read_atomic_reply, send};
use crate::error::{RegionsError, Result};
use crate::transport::{Completion, Span, TransportStats};

/// How often the reaper looks at the lane while replies are owed.
const REAP_TICK: Duration = Duration::from_micros(500);
/// Ticks without owed replies before the reaper parks until the next post.
const PARK_AFTER_TICKS: u32 = 100;
/// How long the reaper waits for a reply before looking at the lane again.
const REAP_POLL: Duration = Duration::from_millis(50);
/// How long an idle reaper waits before checking that its transport still exists.
const REAP_IDLE: Duration = Duration::from_secs(1);

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
    reaper: bool,
    /// The reaper waits for a post (else it looks every tick).
    reaper_parked: bool,
}

/// A posted request's reply, not read yet.
struct Owed {
    id: u64,
    done: Completion,
}

impl LaneState {
    /// The lane connection broke: every owed reply is lost.
    fn fail(&mut self, addr: &str, reason: &str) {
        self.conn = None;
        self.watch = None;
        for owed in self.owed.drain(..) {
            (owed.done)(Err(RegionsError::DaemonUnreachable {
                addr: addr.to_owned(),
                attempts: 1,
                elapsed_ms: 0,
                reason: format!("{reason} (before the reply to a posted request)"),
            }));
        }
    }

    /// Reads the oldest owed reply and completes it.
    fn reap_one(&mut self, transport_addr: &str) -> std::result::Result<(), String> {
        let (Some(conn), Some(owed)) = (self.conn.as_mut(), self.owed.pop_front()) else {
            return Ok(());
        };
        match read_atomic_reply(&mut conn.stream, owed.id, transport_addr) {
            Ok(v) => {
                (owed.done)(Ok(v));
                Ok(())
            }
            Err(Failure::Final(e)) => {
                (owed.done)(Err(e));
                Ok(())
            }
            Err(Failure::Retry(reason)) => {
                // The owed request's outcome is unknown: its completion says so.
                (owed.done)(Err(RegionsError::DaemonUnreachable {
                    addr: transport_addr.to_owned(),
                    attempts: 1,
                    elapsed_ms: 0,
                    reason: reason.clone(),
                }));
                Err(reason)
            }
        }
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
        if st.conn.is_none() {
            let conn = match self.idle.lock().ok().and_then(|mut idle| idle.pop()) {
                Some(conn) => conn,
                None => self
                    .connect(self.retry.deadline, self.retry.deadline)
                    .map_err(|f| self.failure_error(f))?,
            };
            st.watch = conn.stream.try_clone().ok().map(Arc::new);
            st.conn = Some(conn);
        }
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
            done,
        });
        if !st.reaper {
            st.reaper = true;
            let lane = Arc::downgrade(&self.lane);
            let addr = self.addr.clone();
            let spawned = std::thread::Builder::new()
                .name("regions-reaper".into())
                .spawn(move || reap(lane, addr));
            if let Err(e) = spawned {
                // Owed replies are still read by the next atomic on this transport.
                tracing::warn!(error = %e, "cannot start the reply reaper");
                st.reaper = false;
            }
        }
        if st.reaper_parked {
            self.lane.owed_changed.notify_one();
        }
        Ok(())
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
            st.owed.clear();
            continue;
        };
        drop(st);
        if !readable(&watch, REAP_POLL) {
            continue;
        }
        let mut st = lane.lock();
        // Another reader may have taken the reply meanwhile; read only what is there.
        let same = st.watch.as_ref().is_some_and(|w| Arc::ptr_eq(w, &watch));
        if same
            && st.owed.front().map(|o| o.id) == Some(oldest)
            && readable(&watch, Duration::ZERO)
            && let Err(reason) = st.reap_one(&addr)
        {
            st.fail(&addr, &reason);
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
