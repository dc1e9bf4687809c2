//! Barriers, mutexes and doorbells (Remote Regions paper §5.9): named objects at the manager, reached
//! through the host agent of a regions mount, so an application needs no cluster secret.
//!
//! ```no_run
//! regions::sync::barrier_init("start", 3)?;
//! let generation = regions::sync::barrier_wait("start")?;
//! regions::sync::mutex_init("counter")?;
//! regions::sync::mutex_lock("counter")?;
//! // ... critical section ...
//! regions::sync::mutex_unlock("counter")?;
//! # Ok::<(), regions::RegionsError>(())
//! ```
//!
//! The free functions use the agent of the mount named by `REGIONS_MOUNT` (default
//! `/regions`); [`SyncClient`] holds connections for repeated calls, to any agent.
//!
//! A mutex is held by a thread (host id, pid, tid; see [`tag`]): its lock word is 8 bytes in
//! a hidden region. Uncontended, `mutex_lock` is one compare-and-swap `0 -> tag` on that word
//! and `mutex_unlock` one `tag -> 0`, made straight from this process: through the mapped
//! segment when the word lives on this host, else over the tcp transport with a capability
//! the manager minted. Only when the word is taken (or has waiters) does the call go to the
//! manager, which queues callers in FIFO order and hands the word to the next one. Threads of
//! one process exclude each other like threads of different processes; the thread that
//! locked must unlock. The manager releases a mutex whose holder's *process* exits (the host
//! agent watches it) or whose host stops heartbeating; a thread that exits holding a mutex
//! keeps it until its process exits.
//!
//! A barrier of `n` has an arrival word in the same hidden region that counts arrivals and is
//! never reset: the caller whose fetch-add takes it from `c` to `c + 1` joins round
//! `c / n + 1`, which is complete once the word reaches `(c / n + 1) * n`. The `n`-th arrival
//! of a round returns at once; the others wait on the transport for the word to change (the
//! daemon answers a `WaitChange` when an atomic changes it; on the word's own host, the mapped
//! word is re-read for a millisecond, then waited on with a futex) and, when the round takes
//! longer, sleep at the manager
//! (`BarrierSleep`), which sets [`SLEEPERS`] in the word so that the completing arrival wakes
//! it (`BarrierWake`) and rereads the word on a short tick in case that wake never comes (the
//! completer was killed). An arrival, once made, counts; a party killed before arriving
//! leaves its round incomplete until the barrier is deleted. Deleting a barrier or mutex
//! marks its word [`DELETED`] (slots are never reused), so callers with a stale location get
//! `ENOENT` (or find the object created again under the same name).
//!
//! Waiting calls (barrier, lock, doorbell) block without a deadline; each uses a connection
//! of its own, so other threads' calls are not held up.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prost::Message;
use regions_proto::v1::{
    self, AgentReply, AgentRequest, MutexLocation, SyncCall, SyncOp, agent_reply::Body,
    agent_request::Request,
};

use crate::agent::{AgentClient, agent_socket_for, default_mount};
use crate::error::{RegionsError, Result};
use crate::transport::local::LocalSegment;
use crate::transport::tcp::{RetryPolicy, TcpTransport};
use crate::transport::{Span, Transport, TransportStats};

mod unlock;
use unlock::{Handover, InFlight};

pub use regions_proto::lock_word::{
    COUNT_MASK, DELETED, SLEEPERS, TAG_HOST_BITS, TAG_PID_BITS, TAG_TID_BITS, WAITERS, tag,
    tag_host, tag_overflow_hint, tag_pid, tag_tid,
};

/// The calling thread's Linux tid.
fn gettid() -> u32 {
    // SAFETY: gettid(2) has no preconditions and cannot fail.
    let tid = unsafe { libc::gettid() };
    u32::try_from(tid).unwrap_or(u32::MAX)
}

/// A barrier waiter whose word is mapped re-reads it this long, ...
const BARRIER_SPIN: Duration = Duration::from_millis(1);
/// ... waits for it to change on the transport until this long, then sleeps at the manager.
const BARRIER_WAIT: Duration = Duration::from_millis(200);
/// Largest agent reply accepted.
const MAX_REPLY: usize = 1 << 20;
/// Idle agent connections kept.
const MAX_IDLE: usize = 4;
/// Renew a capability this long before it expires (ms).
const RENEW_MS: u64 = 10_000;
/// Longest wait for this process's posted unlocks of a mutex before locking it (they take
/// at most a transport deadline plus a manager call).
const UNLOCK_WAIT: Duration = Duration::from_secs(15);

/// A mutex's lock word or a barrier's arrival word, and the way to reach it from this
/// process.
struct Word {
    location: MutexLocation,
    span: Span,
    /// `None`: no direct path; every call goes through the manager.
    access: Option<Arc<dyn Transport>>,
    /// This process's unlocks of the word that are not finished.
    unlocks: Arc<InFlight>,
}

impl Word {
    /// Whether the location's capability is still good for a while.
    fn fresh(&self) -> bool {
        self.location.capability.is_empty()
            || self.location.capability_expires_ms > now_ms() + RENEW_MS
    }
}

/// A handle on the sync objects of a cluster, through one host agent.
pub struct SyncClient {
    socket: PathBuf,
    pid: u32,
    idle: Mutex<Vec<UnixStream>>,
    words: Mutex<HashMap<String, Arc<Word>>>,
    /// Barrier words by name (`None`: the barrier has no word; waits go to the manager).
    barriers: Mutex<HashMap<String, Option<Arc<Word>>>>,
    /// Whether words are used directly (else every call goes through the manager).
    direct: bool,
    stats: Arc<TransportStats>,
    /// Mutexes locked through this client and not unlocked yet: the tids by name (a name
    /// stays once used, so that locking and unlocking it again allocate nothing).
    held: Mutex<HashMap<String, Vec<u32>>>,
    /// The worker finishing posted unlocks (started on first use).
    handovers: Mutex<Option<std::sync::mpsc::Sender<Handover>>>,
    /// Permission bits of objects this client creates (`None`: the manager's default, 0600).
    mode: Option<u32>,
}

impl std::fmt::Debug for SyncClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncClient")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl SyncClient {
    /// The agent of the regions mount at `mount` (default: `REGIONS_MOUNT`, else `/regions`).
    pub fn for_mount(mount: Option<&Path>) -> Result<SyncClient> {
        let mount = mount.map(Path::to_path_buf).unwrap_or_else(default_mount);
        Ok(SyncClient::connect(&agent_socket_for(&mount)?))
    }

    /// The host agent listening on `socket` (connections are made on first use).
    pub fn connect(socket: &Path) -> SyncClient {
        SyncClient {
            socket: socket.to_path_buf(),
            pid: std::process::id(),
            idle: Mutex::new(Vec::new()),
            words: Mutex::new(HashMap::new()),
            barriers: Mutex::new(HashMap::new()),
            direct: true,
            stats: Arc::default(),
            held: Mutex::new(HashMap::new()),
            handovers: Mutex::new(None),
            mode: None,
        }
    }

    /// This client creating objects with permission bits `mode` (like a file's: other users
    /// need read and write permission to use a mutex or barrier, write to ring a doorbell,
    /// read to wait on one). Without it new objects are 0600, their creator's only. An
    /// existing object keeps its mode.
    pub fn with_mode(mut self, mode: u32) -> SyncClient {
        self.mode = Some(mode & 0o777);
        self
    }

    /// This client with every call going through the manager (no transport fast path):
    /// for comparison and tests; it interoperates with clients that use the fast path.
    pub fn through_manager(mut self) -> SyncClient {
        self.direct = false;
        self
    }

    /// The agent socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn agent_error(&self, errno: i32, message: impl Into<String>) -> RegionsError {
        RegionsError::Agent {
            path: self.socket.display().to_string(),
            errno,
            message: message.into(),
        }
    }

    fn stream(&self) -> Result<UnixStream> {
        if let Some(s) = self.idle.lock().ok().and_then(|mut idle| idle.pop()) {
            return Ok(s);
        }
        UnixStream::connect(&self.socket).map_err(|e| {
            self.agent_error(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!(
                    "cannot connect: {e}; is regions-daemon running with --socket {}?",
                    self.socket.display()
                ),
            )
        })
    }

    /// One sync call through the agent; blocks until the manager answers.
    fn call(&self, op: SyncOp, name: &str, n: u32) -> Result<v1::SyncResult> {
        self.call_with(SyncCall {
            op: op as i32,
            name: name.to_owned(),
            n,
            tid: gettid(),
            generation: 0,
            mode: self.mode,
        })
    }

    /// One sync call through the agent; blocks until the manager answers.
    fn call_with(&self, call: SyncCall) -> Result<v1::SyncResult> {
        let name = call.name.clone();
        let request = AgentRequest {
            request: Some(Request::Sync(call)),
        };
        let body = request.encode_to_vec();
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        let mut stream = self.stream()?;
        let io = |what: &str, e: std::io::Error| {
            self.agent_error(libc::EIO, format!("cannot {what} (sync {name:?}): {e}"))
        };
        stream.write_all(&frame).map_err(|e| io("send", e))?;
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).map_err(|e| io("receive", e))?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_REPLY {
            return Err(self.agent_error(libc::EIO, format!("reply of {len} bytes is too large")));
        }
        let mut buf = vec![0u8; len];
        stream.read_exact(&mut buf).map_err(|e| io("receive", e))?;
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < MAX_IDLE
        {
            idle.push(stream);
        }
        let reply = AgentReply::decode(&buf[..])
            .map_err(|e| self.agent_error(libc::EIO, format!("undecodable reply: {e}")))?;
        if reply.errno != 0 {
            return Err(self.agent_error(reply.errno, reply.message));
        }
        match reply.body {
            Some(Body::Sync(r)) => Ok(r),
            _ => Err(self.agent_error(libc::EIO, "sync reply without a result")),
        }
    }

    /// Creates barrier `name` of `n` parties (an existing one with the same `n` is fine).
    pub fn barrier_init(&self, name: &str, n: u32) -> Result<()> {
        self.forget_barrier(name);
        self.call(SyncOp::BarrierInit, name, n).map(drop)
    }

    /// Waits until `n` callers reached the barrier in this round; returns the round's
    /// generation (1 for the first round).
    pub fn barrier_wait(&self, name: &str) -> Result<u64> {
        // A second try only after finding the cached word deleted (the name may be new) or its
        // capability revoked.
        for _ in 0..2 {
            let Some(word) = self.barrier_word(name)? else {
                return self
                    .call(SyncOp::BarrierWait, name, 0)
                    .map(|r| r.value as u64);
            };
            let Some(t) = &word.access else {
                return self
                    .call(SyncOp::BarrierWait, name, 0)
                    .map(|r| r.value as u64);
            };
            let n = u64::from(word.location.n.max(1));
            let old = match t.fetch_add(&word.span, 1) {
                // Refused before the word was touched (the capability was revoked, as after a
                // manager restart): locate the word again and arrive with a new one.
                Err(e) if e.errno() == libc::EKEYREVOKED => {
                    self.forget_barrier(name);
                    continue;
                }
                other => other.inspect_err(|_| {
                    // Whether the arrival counted is unknown: do not arrive again elsewhere.
                    self.forget_barrier(name);
                })?,
            };
            if old & DELETED != 0 {
                self.forget_barrier(name);
                continue;
            }
            let arrived = old & COUNT_MASK;
            let generation = arrived / n + 1;
            let target = generation * n;
            if arrived + 1 == target {
                // Waiters at the daemon see an arrival made one-sided only when told.
                t.wake_waiters(&word.span);
                if old & SLEEPERS != 0 {
                    // Best effort: the sleepers' manager also rereads the word on a tick.
                    if let Err(e) = self.call(SyncOp::BarrierWake, name, 0) {
                        tracing::debug!(error = %e, barrier = name, "cannot wake barrier sleepers");
                    }
                }
                return Ok(generation);
            }
            // The word is at least our arrival now.
            let seen = old.wrapping_add(1);
            return self.barrier_poll(name, &word, t.as_ref(), seen, generation, target);
        }
        Err(RegionsError::Manager {
            errno: libc::ENOENT,
            message: format!("barrier {name:?} was deleted"),
        })
    }

    /// Waits for the word (last seen at `seen`) to reach `target` arrivals: on the
    /// transport (the daemon, or a futex on the mapped word, answers when it changes), then,
    /// once the round took [`BARRIER_WAIT`], asleep at the manager.
    fn barrier_poll(
        &self,
        name: &str,
        word: &Word,
        t: &dyn Transport,
        mut seen: u64,
        generation: u64,
        target: u64,
    ) -> Result<u64> {
        let start = Instant::now();
        let local = t.describe() == "local";
        loop {
            if seen & DELETED != 0 {
                self.forget_barrier(name);
                return Err(RegionsError::Manager {
                    errno: libc::ENOENT,
                    message: format!("barrier {name:?} was deleted while waiting"),
                });
            }
            if seen & COUNT_MASK >= target {
                return Ok(generation);
            }
            let waited = start.elapsed();
            let left = BARRIER_WAIT.saturating_sub(waited);
            if left.is_zero() {
                break;
            }
            // A mapped word is first re-read in place for a while (a quick round is seen
            // soonest); then the futex, or for a remote word the daemon, answers when it
            // changes. Remote waiters do not poll: round trips back to back keep the daemon
            // busy and slowed rounds down on a loaded machine (measured).
            let next = if waited < BARRIER_SPIN && local {
                if local {
                    std::thread::yield_now();
                }
                t.fetch_add(&word.span, 0)
            } else {
                t.wait_change(&word.span, seen, left)
            };
            seen = match next {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(error = %e, barrier = name, "cannot read the barrier word; asking the manager");
                    break;
                }
            };
        }
        self.call_with(SyncCall {
            op: SyncOp::BarrierSleep as i32,
            name: name.to_owned(),
            n: 0,
            tid: gettid(),
            generation,
            mode: None,
        })
        .map(|r| r.value as u64)
    }

    /// How this process reaches barrier `name`'s word ("local", "tcp ...", or "manager").
    pub fn barrier_path(&self, name: &str) -> Result<String> {
        Ok(self
            .barrier_word(name)?
            .and_then(|w| w.access.as_ref().map(|t| t.describe()))
            .unwrap_or_else(|| "manager".to_owned()))
    }

    /// How many parties arrived at barrier `name` since it was created (all rounds), read
    /// from its word (`ENOTSUP` for a barrier without a word or out of this process's reach).
    pub fn barrier_arrivals(&self, name: &str) -> Result<u64> {
        let unsupported = || RegionsError::Manager {
            errno: libc::ENOTSUP,
            message: format!("barrier {name:?} has no arrival word this process can read"),
        };
        let word = self.barrier_word(name)?.ok_or_else(unsupported)?;
        let t = word.access.as_ref().ok_or_else(unsupported)?;
        let v = t.fetch_add(&word.span, 0)?;
        if v & DELETED != 0 {
            self.forget_barrier(name);
            return Err(RegionsError::Manager {
                errno: libc::ENOENT,
                message: format!("barrier {name:?} was deleted"),
            });
        }
        Ok(v & COUNT_MASK)
    }

    /// The arrival word of barrier `name`, located once (and again when its capability is
    /// due); `None` for a barrier without one.
    fn barrier_word(&self, name: &str) -> Result<Option<Arc<Word>>> {
        if let Some(w) = self.barriers.lock().ok().and_then(|b| b.get(name).cloned())
            && w.as_ref().is_none_or(|w| w.fresh())
        {
            return Ok(w);
        }
        let word = match self.call(SyncOp::BarrierLocate, name, 0) {
            Ok(r) => {
                let location = r.location.ok_or_else(|| {
                    self.agent_error(libc::EIO, "locate reply without a location")
                })?;
                Some(self.word_at(name, location))
            }
            Err(e) if e.errno() == libc::ENOTSUP => None,
            Err(e) => return Err(e),
        };
        if let Ok(mut b) = self.barriers.lock() {
            b.insert(name.to_owned(), word.clone());
        }
        Ok(word)
    }

    fn forget_barrier(&self, name: &str) {
        if let Ok(mut b) = self.barriers.lock() {
            b.remove(name);
        }
    }

    fn word_at(&self, name: &str, location: MutexLocation) -> Arc<Word> {
        let span = Span {
            ino: location.ino,
            region_offset: location.region_offset,
            pool: location.pool,
            pool_offset: location.pool_offset,
            len: 8,
        };
        let access = self.access(&location);
        Arc::new(Word {
            location,
            span,
            access,
            unlocks: InFlight::tracked(name),
        })
    }

    /// Creates mutex `name` (an existing mutex is fine).
    pub fn mutex_init(&self, name: &str) -> Result<()> {
        self.forget(name);
        self.call(SyncOp::MutexInit, name, 0).map(drop)
    }

    /// Creates doorbell `name` (an existing doorbell is fine).
    pub fn bell_init(&self, name: &str) -> Result<()> {
        self.call(SyncOp::BellInit, name, 0).map(drop)
    }

    /// Rings doorbell `name`.
    pub fn bell_ring(&self, name: &str) -> Result<()> {
        self.call(SyncOp::BellRing, name, 0).map(drop)
    }

    /// Waits for a ring of `name` since this process's last wait (any ring, before the
    /// first); returns the ring count.
    pub fn bell_wait(&self, name: &str) -> Result<i64> {
        self.call(SyncOp::BellWait, name, 0).map(|r| r.value)
    }

    /// Deletes `name`; its waiters fail with `ENOENT`.
    pub fn delete(&self, name: &str) -> Result<()> {
        self.forget(name);
        self.forget_barrier(name);
        self.call(SyncOp::Delete, name, 0).map(drop)
    }

    fn forget(&self, name: &str) {
        if let Ok(mut words) = self.words.lock() {
            words.remove(name);
        }
    }

    /// The lock word of `name`, located once (and again when its capability is due).
    fn word(&self, name: &str) -> Result<Arc<Word>> {
        if let Some(w) = self.words.lock().ok().and_then(|w| w.get(name).cloned())
            && w.fresh()
        {
            return Ok(w);
        }
        let location = self
            .call(SyncOp::MutexLocate, name, 0)?
            .location
            .ok_or_else(|| self.agent_error(libc::EIO, "locate reply without a location"))?;
        let word = self.word_at(name, location);
        if let Ok(mut words) = self.words.lock() {
            words.insert(name.to_owned(), Arc::clone(&word));
        }
        Ok(word)
    }

    /// The direct path to a lock word: its segment mapped when it is on this host, else the
    /// tcp transport with the location's capability.
    fn access(&self, location: &MutexLocation) -> Option<Arc<dyn Transport>> {
        if !self.direct {
            return None;
        }
        let my_host = tag_host(location.tag);
        if my_host == location.host_id {
            let segment = AgentClient::connect(&self.socket)
                .and_then(|mut agent| agent.segment(location.ino, true));
            match segment {
                // Atomics need a writable mapping: a read-only segment goes to tcp below.
                // ... and so does a daemon applying every atomic through its RDMA device.
                Ok(Some(seg))
                    if seg.writable
                        && !seg.atomics_through_daemon
                        && seg.size >= location.region_offset + 8 =>
                {
                    match LocalSegment::map(seg.fd, seg.size, true, Arc::clone(&self.stats)) {
                        Ok(local) => return Some(Arc::new(local)),
                        Err(e) => tracing::debug!(error = %e, "cannot map the lock region"),
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "no local segment of the lock region"),
            }
        }
        if location.capability.is_empty() || location.transport_addr.is_empty() {
            return None;
        }
        // One-sided where the daemon and this host have RDMA (REGIONS_TRANSPORT), through a
        // memory window over the word's slot.
        let tcp = Arc::new(TcpTransport::with_capability(
            &location.transport_addr,
            1,
            &location.capability,
            RetryPolicy::default(),
            Arc::clone(&self.stats),
        ));
        Some(crate::connection::rdma_or_tcp(
            tcp,
            crate::connection::transport_from_env(),
            crate::connection::rdma_device_from_env().as_deref(),
            &self.stats,
        ))
    }

    /// This thread's tag for `word` (the location's tag names the process).
    fn my_tag(&self, word: &Word) -> Result<u64> {
        let host = tag_host(word.location.tag);
        let pid = tag_pid(word.location.tag);
        let tid = gettid();
        tag(host, pid, tid).ok_or_else(|| RegionsError::Manager {
            errno: libc::EOVERFLOW,
            message: tag_overflow_hint(host, pid, tid),
        })
    }

    /// Records that thread `tid` holds `name` (or no longer does); whether that changed
    /// anything.
    fn set_held(&self, name: &str, tid: u32, held: bool) -> bool {
        let Ok(mut by_name) = self.held.lock() else {
            return false;
        };
        let Some(tids) = by_name.get_mut(name) else {
            if held {
                by_name.insert(name.to_owned(), vec![tid]);
            }
            return held;
        };
        match (tids.iter().position(|t| *t == tid), held) {
            (None, true) => tids.push(tid),
            (Some(i), false) => {
                tids.swap_remove(i);
            }
            _ => return false,
        }
        true
    }

    /// The sender to the worker finishing posted unlocks (each word keeps a clone once it
    /// posted an unlock).
    fn handovers(&self) -> Option<std::sync::mpsc::Sender<Handover>> {
        let mut h = self.handovers.lock().ok()?;
        if h.is_none() {
            match unlock::start_worker(self.socket.clone()) {
                Ok(tx) => *h = Some(tx),
                Err(e) => tracing::debug!(error = %e, "cannot start the unlock worker"),
            }
        }
        h.clone()
    }

    /// Where mutex `name`'s lock word is, with a capability that reaches that word's slot
    /// and nothing else of the lock region (for tools that operate on the word themselves).
    pub fn mutex_locate(&self, name: &str) -> Result<MutexLocation> {
        self.call(SyncOp::MutexLocate, name, 0)?
            .location
            .ok_or_else(|| self.agent_error(libc::EIO, "locate reply without a location"))
    }

    /// Locks mutex `name` for this thread: a compare-and-swap on its word when free, else
    /// queued in FIFO order at the manager.
    pub fn mutex_lock(&self, name: &str) -> Result<()> {
        let word = self.word(name)?;
        let tag = self.my_tag(&word)?;
        if let Some(t) = &word.access {
            let mut looked_again = false;
            loop {
                // Whether an unlock of this process may not have reached the word yet (one
                // finishing after the swap below still leaves its reply stale).
                let unlocking = word.unlocks.any();
                match t.compare_and_swap(&word.span, 0, tag) {
                    Ok(0) => {
                        self.set_held(name, tag_tid(tag), true);
                        return Ok(());
                    }
                    // This process's unlocks were finishing: look again now they are done.
                    Ok(_) if unlocking && !looked_again => {
                        word.unlocks.wait(UNLOCK_WAIT);
                        looked_again = true;
                    }
                    Ok(old) if old & DELETED != 0 => {
                        self.forget(name);
                        break;
                    }
                    Ok(old) if old & !WAITERS == tag => {
                        return Err(RegionsError::Manager {
                            errno: libc::EDEADLK,
                            message: format!("mutex {name:?} is already held by this thread"),
                        });
                    }
                    Ok(_) => break,
                    // The swap may have taken the lock: asking the manager would queue this
                    // thread behind itself.
                    Err(e) if e.outcome_unknown() => {
                        self.forget(name);
                        return Err(e);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "lock word unreachable directly; asking the manager");
                        self.forget(name);
                        break;
                    }
                }
            }
        }
        word.unlocks.wait(UNLOCK_WAIT);
        self.call(SyncOp::MutexLock, name, 0)?;
        self.set_held(name, tag_tid(tag), true);
        Ok(())
    }

    /// Unlocks mutex `name` held by this thread (`EPERM` if it does not hold it).
    ///
    /// When this client locked it and reaches the word over the network, the swap is posted
    /// (see [`unlock`]): the call returns once it is sent, and a later lock from this process
    /// is applied after it.
    pub fn mutex_unlock(&self, name: &str) -> Result<()> {
        let word = self.word(name)?;
        let tag = self.my_tag(&word)?;
        let held_here = self.set_held(name, tag_tid(tag), false);
        if let Some(t) = &word.access {
            if held_here
                && t.posts_atomics()
                && word.unlocks.handovers(|| self.handovers()).is_some()
            {
                word.unlocks.begin();
                let done = unlock::completion(tag, Arc::clone(&word.unlocks));
                match t.post_compare_and_swap(&word.span, tag, 0, done) {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        word.unlocks.end();
                        tracing::debug!(error = %e, "cannot post the unlock; unlocking here");
                    }
                }
            }
            match t.compare_and_swap(&word.span, tag, 0) {
                Ok(old) if old == tag => return Ok(()),
                Ok(old) if old & !WAITERS == tag => {} // waiters: the manager hands it on
                Ok(old) if old & DELETED != 0 => self.forget(name), // the manager says ENOENT
                Ok(old) => {
                    return Err(RegionsError::Manager {
                        errno: libc::EPERM,
                        message: format!(
                            "mutex {name:?} is not held by this thread (lock word {old:#x})"
                        ),
                    });
                }
                // The unlock may have landed: the manager would answer EPERM.
                Err(e) if e.outcome_unknown() => {
                    self.forget(name);
                    return Err(e);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "lock word unreachable directly; asking the manager");
                    self.forget(name);
                }
            }
        }
        self.call(SyncOp::MutexUnlock, name, 0).map(drop)
    }

    /// Where mutex `name`'s word is and whether this process reaches it directly
    /// ("local", "tcp ...", or "manager").
    pub fn mutex_path(&self, name: &str) -> Result<String> {
        let word = self.word(name)?;
        Ok(word
            .access
            .as_ref()
            .map_or_else(|| "manager".to_owned(), |t| t.describe()))
    }
}

/// The process-wide clients of the free functions, by agent socket.
fn shared() -> Result<Arc<SyncClient>> {
    static CLIENTS: OnceLock<Mutex<HashMap<PathBuf, Arc<SyncClient>>>> = OnceLock::new();
    let mount = default_mount();
    let clients = CLIENTS.get_or_init(Mutex::default);
    let mut map = clients
        .lock()
        .map_err(|_| RegionsError::Invalid("sync client table poisoned".into()))?;
    let pid = std::process::id();
    if let Some(c) = map.get(&mount)
        && c.pid == pid
    {
        return Ok(Arc::clone(c));
    }
    // First use, or a forked child: the agent knows callers by their connections' pid.
    let client = Arc::new(SyncClient::for_mount(Some(&mount))?);
    map.insert(mount, Arc::clone(&client));
    Ok(client)
}

/// Creates barrier `name` of `n` parties (`EINVAL` for 0, `EEXIST` if it exists otherwise).
pub fn barrier_init(name: &str, n: u32) -> Result<()> {
    shared()?.barrier_init(name, n)
}

/// Waits for the barrier's round; returns its generation (from 1).
pub fn barrier_wait(name: &str) -> Result<u64> {
    shared()?.barrier_wait(name)
}

/// Creates mutex `name`.
pub fn mutex_init(name: &str) -> Result<()> {
    shared()?.mutex_init(name)
}

/// Locks mutex `name` for this thread.
pub fn mutex_lock(name: &str) -> Result<()> {
    shared()?.mutex_lock(name)
}

/// Unlocks mutex `name`.
pub fn mutex_unlock(name: &str) -> Result<()> {
    shared()?.mutex_unlock(name)
}

/// Creates doorbell `name`.
pub fn bell_init(name: &str) -> Result<()> {
    shared()?.bell_init(name)
}

/// Rings doorbell `name`.
pub fn bell_ring(name: &str) -> Result<()> {
    shared()?.bell_ring(name)
}

/// Waits for a ring since this process's last wait; returns the ring count.
pub fn bell_wait(name: &str) -> Result<i64> {
    shared()?.bell_wait(name)
}

/// Deletes barrier, mutex or doorbell `name`.
pub fn delete(name: &str) -> Result<()> {
    shared()?.delete(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ids_fit_a_tag_and_differ_per_thread() {
        let me = gettid();
        assert!(me > 0 && me >> TAG_TID_BITS == 0);
        let other = std::thread::spawn(gettid).join().unwrap();
        assert_ne!(me, other);
    }

    #[test]
    fn held_mutexes_are_recorded_per_name_and_thread() {
        let c = SyncClient::connect(Path::new("/nonexistent/agent.sock"));
        assert!(!c.set_held("m", 1, false), "not held yet");
        assert!(c.set_held("m", 1, true));
        assert!(!c.set_held("m", 1, true), "held once");
        assert!(c.set_held("m", 2, true));
        assert!(c.set_held("n", 1, true));
        assert!(c.set_held("m", 1, false));
        assert!(!c.set_held("m", 1, false), "released once");
        assert!(c.set_held("m", 2, false));
        assert!(c.set_held("n", 1, false));
        assert!(!c.set_held("n", 1, false));
        assert!(c.set_held("m", 1, true), "held again after a release");
    }

    #[test]
    fn a_missing_agent_is_a_clear_error() {
        let c = SyncClient::connect(Path::new("/nonexistent/agent.sock"));
        let err = c.bell_ring("x").unwrap_err();
        assert_eq!(err.errno(), libc::ENOENT);
        assert!(err.to_string().contains("regions-daemon"), "{err}");
    }
}
