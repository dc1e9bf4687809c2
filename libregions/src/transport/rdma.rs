//! The RDMA transport (feature `rdma`; docs/ARCHITECTURE.md, "RDMA"): reads and writes of
//! region bytes go one-sided to the daemon's pool memory over a reliable-connected queue
//! pair; everything else, and every refusal, goes through the tcp transport beside it.
//!
//! Set-up runs over a tcp connection of the transport's own (its *control* connection,
//! authenticated like any other): `RDMA-CONNECT` exchanges queue pair endpoints, and the
//! daemon ties its queue pair to that connection. Remote keys come per chunk from
//! `RDMA-READ-KEYS` / `RDMA-WRITE-KEYS`, which the daemon answers after the checks of a READ
//! or WRITE of the chunks (capability, rights, a stale map), and are kept until the queue pair
//! breaks.
//!
//! Where RDMA is not possible (no device here, none at the daemon, no common fabric) the
//! transport says so once in the log and uses tcp, trying RDMA again after
//! [`RETRY_UNAVAILABLE`]; with `--transport rdma` the set-up failure is the caller's error
//! instead. A request that fails on the queue pair (a key the daemon dropped when the chunk
//! moved, a link down) breaks it: the request is served by tcp at once (which gives the
//! authoritative answer: the bytes, `ESTALE`, `EIO`), and the next request sets up RDMA
//! anew.
//!
//! 8-byte atomics go one-sided too when the daemon offers them (the flags byte of its
//! `RDMA-CONNECT` reply): its device's atomics exclude the CPUs', or the daemon applies every
//! atomic through the device itself and tells processes on its host to do the same (most
//! devices, soft-RoCE included, are atomic with respect to themselves only). An atomic whose
//! outcome is unknown (a timeout, a broken link) is an error, never repeated over tcp.
//! `wait_change` stays on tcp.
//!
//! One request at a time uses a daemon's queue pair (a mutex per daemon): threads of a process
//! share it, as FaRM shares connections. Under `auto`, a request that finds it busy goes over
//! tcp rather than wait.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::counter;
use regions_proto::frame::{Header, Op, RDMA_CONNECT_ATOMICS, RdmaChunkKey, range_delta};
use regions_proto::layout::CHUNK_SIZE;
use regions_proto::transport_choice::TransportChoice;
use regions_verbs::{
    Device, Endpoint, Local, ProtectionDomain, QueuePair, RegisteredBuffer, RegisteredSlice, Remote,
};

use super::tcp::{ControlConn, TcpTransport};
use super::{Completion, Span, Transport, TransportStats};
use crate::error::{RegionsError, Result};

/// How long a transport that found RDMA impossible uses tcp before it tries again.
pub const RETRY_UNAVAILABLE: Duration = Duration::from_secs(60);
/// Bytes one round of a request moves through the bounce buffer.
const BUFFER: usize = 4 << 20;
/// Reads of at least this many bytes land straight in the caller's buffer, registered for
/// the request, instead of the bounce buffer and a copy: `regions-rdma-buffers` (run by
/// `benches/rdma-vm.sh`) measured registering and deregistering 1 MiB at 0.7x the copy and
/// 4 MiB at 0.3x, 64 KiB at par and 4 KiB at 24x.
const REGISTER_AT_LEAST: usize = 1 << 20;
/// Work requests one queue pair takes at once.
const DEPTH: u32 = 256;
/// Longest wait for one round's completion (a dead peer fails sooner: the queue pair's own
/// retries give up in about half a second).
const ROUND_TIMEOUT: Duration = Duration::from_secs(4);

/// How long a failure to find an RDMA device is kept before a transport looks again (every
/// region an application opens makes transports: without it each would probe the devices).
const PROBE_AGAIN: Duration = Duration::from_secs(10);

/// This process's protection domain on the RDMA device `device` (the first one when
/// `None`), opened at the first use that finds one (every daemon's transport shares it; a
/// failure is kept for [`PROBE_AGAIN`], so a device that comes later is found).
pub fn protection_domain(
    device: Option<&str>,
) -> std::result::Result<Arc<ProtectionDomain>, String> {
    struct Found {
        pd: Option<Arc<ProtectionDomain>>,
        /// The last failure: for which device, when, and why.
        failed: Option<(Option<String>, Instant, String)>,
    }
    static FOUND: Mutex<Found> = Mutex::new(Found {
        pd: None,
        failed: None,
    });
    let mut found = FOUND
        .lock()
        .map_err(|_| "RDMA device lock poisoned".to_owned())?;
    if let Some(pd) = &found.pd
        && device.is_none_or(|d| pd.device().name() == d)
    {
        return Ok(Arc::clone(pd));
    }
    if let Some((which, at, why)) = &found.failed
        && which.as_deref() == device
        && at.elapsed() < PROBE_AGAIN
    {
        return Err(why.clone());
    }
    match Device::open(device, 0).and_then(|d| d.protection_domain()) {
        Ok(opened) => {
            found.pd = Some(Arc::clone(&opened));
            found.failed = None;
            Ok(opened)
        }
        Err(e) => {
            let why = e.to_string();
            found.failed = Some((device.map(str::to_owned), Instant::now(), why.clone()));
            Err(why)
        }
    }
}

/// The remote keys of one pool chunk, and the region and chunk delta of the span they were
/// asked for: a span of another region, or of the same region at another offset (a stale
/// map), asks the daemon again instead of using them.
#[derive(Clone, Copy, Debug, Default)]
struct ChunkKeys {
    /// The chunk's address in the daemon.
    addr: u64,
    ino: u64,
    delta: Option<u32>,
    read: Option<KeyRange>,
    write: Option<KeyRange>,
}

/// A remote key and the bytes of the chunk it reaches (the whole chunk for node components;
/// a capability's bytes for applications, whose keys are memory windows).
#[derive(Clone, Copy, Debug)]
struct KeyRange {
    rkey: u32,
    from: u64,
    to: u64,
}

impl KeyRange {
    fn covers(&self, within: u64, len: u64) -> bool {
        self.from <= within && within + len <= self.to
    }
}

impl ChunkKeys {
    /// The key for `len` bytes at `within` (`write`: one that allows writes and atomics; a
    /// read may use that one too).
    fn key(&self, within: u64, len: u64, write: bool) -> Option<u32> {
        let write_key = self.write.filter(|k| k.covers(within, len));
        let key = if write {
            write_key
        } else {
            self.read.filter(|k| k.covers(within, len)).or(write_key)
        };
        key.map(|k| k.rkey)
    }
}

/// A queue pair connected to the daemon's, what it needs, and the keys it learnt.
struct Live {
    pd: Arc<ProtectionDomain>,
    qp: QueuePair,
    buf: RegisteredBuffer,
    control: ControlConn,
    keys: HashMap<(u32, u64), ChunkKeys>,
    /// Breaks in a row before this set-up (0 once a request succeeds on it).
    breaks: u32,
    /// The daemon accepts one-sided atomics.
    atomics: bool,
    /// The tcp transport's token generation the control connection presented: a renewed
    /// capability sets RDMA up anew (the daemon's windows belong to the old one).
    generation: u64,
}

enum Session {
    /// Not set up yet: set up at the next request.
    Idle,
    /// A thread is setting it up (without the lock); others use tcp meanwhile.
    Connecting,
    Live(Box<Live>),
    /// Set-up failed (`why`); tcp until `retry_at` (with `rdma` only, an error).
    Unavailable {
        why: String,
        retry_at: Instant,
    },
    /// The queue pair broke; tcp until `retry_at`, then set up again.
    Backoff {
        retry_at: Instant,
        breaks: u32,
    },
}

/// How long after the `n`th break in a row a transport waits before it sets RDMA up again.
fn backoff(breaks: u32) -> Duration {
    Duration::from_millis(100u64 << breaks.min(9)).min(RETRY_UNAVAILABLE)
}

/// Why an RDMA attempt did not serve a request.
enum Miss {
    /// The daemon refused the keys: tcp gives the authoritative answer.
    Refused(RegionsError),
    /// The queue pair or the control connection broke.
    Broken(String),
    /// The daemon takes this request over tcp only (atomics it does not accept one-sided).
    TcpOnly,
    /// An atomic may or may not have been applied: the queue pair broke after posting it.
    Unknown(String),
}

/// The transport to one daemon that moves bytes over RDMA where it can.
pub struct RdmaTransport {
    tcp: Arc<TcpTransport>,
    choice: TransportChoice,
    device: Option<String>,
    session: Mutex<Session>,
    stats: Arc<TransportStats>,
}

impl RdmaTransport {
    /// RDMA to the daemon `tcp` reaches (`choice` is `auto` or `rdma`), on `device` (the first
    /// one when `None`).
    pub fn new(
        tcp: Arc<TcpTransport>,
        choice: TransportChoice,
        device: Option<String>,
        stats: Arc<TransportStats>,
    ) -> RdmaTransport {
        RdmaTransport {
            tcp,
            choice,
            device,
            session: Mutex::new(Session::Idle),
            stats,
        }
    }

    /// Whether atomics go one-sided now (without waiting for the session's lock).
    fn atomics_live(&self) -> bool {
        matches!(self.session.try_lock().as_deref(), Ok(Session::Live(l)) if l.atomics)
    }

    /// Whether requests go over RDMA now (set up, not broken).
    pub fn is_live(&self) -> bool {
        matches!(self.session.lock().as_deref(), Ok(Session::Live(_)))
    }

    /// Sets up the queue pair: ours, the daemon's over the control connection, connected.
    fn set_up(&self) -> std::result::Result<Live, String> {
        let pd = protection_domain(self.device.as_deref())?;
        let generation = self.tcp.generation();
        let mut qp = QueuePair::create(&pd, DEPTH).map_err(|e| e.to_string())?;
        let buf = RegisteredBuffer::new(&pd, BUFFER).map_err(|e| e.to_string())?;
        let mut control = self.tcp.open_control().map_err(|e| e.to_string())?;
        let mine = qp.endpoint().to_bytes();
        let theirs = self
            .tcp
            .control_request(&mut control, Header::new(Op::RdmaConnect, 0), &mine)
            .map_err(|e| format!("the daemon refused RDMA: {e}"))?;
        // The endpoint, then (from daemons that send it) a flags byte.
        let (endpoint, flags) = theirs.split_at(theirs.len().min(Endpoint::LEN));
        let theirs = Endpoint::from_bytes(endpoint).map_err(|e| e.to_string())?;
        qp.connect(&theirs).map_err(|e| e.to_string())?;
        Ok(Live {
            pd,
            qp,
            buf,
            control,
            keys: HashMap::new(),
            breaks: 0,
            atomics: flags.first().is_some_and(|f| f & RDMA_CONNECT_ATOMICS != 0),
            generation,
        })
    }

    /// Runs `op` on the live queue pair, setting it up first if needed. `None`: serve the
    /// request over tcp (RDMA unavailable, being set up by another thread, refused or
    /// broken; said in the log and metrics).
    fn attempt<T>(
        &self,
        op: impl FnOnce(&TcpTransport, &mut Live) -> std::result::Result<T, Miss>,
    ) -> Option<Result<T>> {
        // Under `auto` a request never waits behind another thread's RDMA request (which may
        // be waiting for the network): it goes over tcp meanwhile. Under `rdma` it waits.
        let mut session = match self.choice {
            TransportChoice::Rdma => self.session.lock().ok()?,
            _ => self.session.try_lock().ok()?,
        };
        let mut breaks = 0;
        match &*session {
            Session::Unavailable { why, retry_at } if Instant::now() < *retry_at => {
                return self.unavailable(why);
            }
            Session::Backoff { retry_at, .. } if Instant::now() < *retry_at => return None,
            Session::Connecting => return None,
            Session::Backoff { breaks: b, .. } => {
                breaks = *b;
                *session = Session::Idle;
            }
            Session::Unavailable { .. } => *session = Session::Idle,
            // A renewed capability: its windows are bound for the old token.
            Session::Live(live) if live.generation != self.tcp.generation() => {
                *session = Session::Idle;
            }
            Session::Idle | Session::Live(_) => {}
        }
        if matches!(*session, Session::Idle) {
            // A daemon tcp found down is not waited for again here.
            if self.tcp.is_down() {
                return None;
            }
            // Set up without the lock: it may wait for the network.
            *session = Session::Connecting;
            drop(session);
            let made = self.set_up();
            session = self.session.lock().ok()?;
            match made {
                Ok(mut live) => {
                    tracing::info!(daemon = %self.tcp.addr(), "RDMA set up");
                    live.breaks = breaks;
                    *session = Session::Live(Box::new(live));
                }
                Err(why) => {
                    tracing::info!(daemon = %self.tcp.addr(), reason = %why, "RDMA unavailable: using tcp");
                    counter!("regions_client_rdma_unavailable_total").increment(1);
                    let out = self.unavailable(&why);
                    *session = Session::Unavailable {
                        why,
                        retry_at: Instant::now() + RETRY_UNAVAILABLE,
                    };
                    return out;
                }
            }
        }
        let Session::Live(live) = &mut *session else {
            return None;
        };
        let breaks = live.breaks;
        match op(&self.tcp, live) {
            Ok(v) => {
                live.breaks = 0;
                Some(Ok(v))
            }
            Err(Miss::Refused(e)) => {
                tracing::debug!(daemon = %self.tcp.addr(), error = %e, "RDMA keys refused; the request goes over tcp");
                None
            }
            Err(Miss::TcpOnly) => None,
            Err(Miss::Unknown(why)) => {
                self.back_off(&mut session, breaks, &why);
                Some(Err(RegionsError::AtomicOutcomeUnknown {
                    addr: self.tcp.addr().to_owned(),
                    reason: format!("the RDMA queue pair broke during it: {why}"),
                }))
            }
            Err(Miss::Broken(why)) => {
                self.back_off(&mut session, breaks, &why);
                None
            }
        }
    }

    /// Leaves RDMA after the `breaks + 1`th break in a row (`why`): requests go over tcp
    /// until [`backoff`] passes.
    fn back_off(&self, session: &mut Session, breaks: u32, why: &str) {
        let wait = backoff(breaks);
        tracing::info!(daemon = %self.tcp.addr(), reason = %why, retry_in_ms = wait.as_millis() as u64, "RDMA queue pair broken; requests go over tcp until RDMA is set up again");
        counter!("regions_client_rdma_broken_total").increment(1);
        *session = Session::Backoff {
            retry_at: Instant::now() + wait,
            breaks: breaks + 1,
        };
    }

    /// `None` (use tcp) under `auto`; the set-up failure under `rdma`.
    fn unavailable<T>(&self, why: &str) -> Option<Result<T>> {
        match self.choice {
            TransportChoice::Rdma => Some(Err(RegionsError::DaemonUnreachable {
                addr: self.tcp.addr().to_owned(),
                attempts: 1,
                elapsed_ms: 0,
                reason: format!(
                    "RDMA is not available ({why}) and the transport is rdma only: use \
                     --transport auto (REGIONS_TRANSPORT=auto) to fall back to tcp"
                ),
            })),
            _ => None,
        }
    }
}

/// One piece of a request: `len` bytes at `within` of pool chunk (`pool`, `chunk`), and
/// which span (region, offset) it belongs to, for the keys request.
#[derive(Clone, Copy)]
struct Piece {
    span: Span,
    chunk: u64,
    within: u64,
    len: u64,
}

/// The spans cut at chunk boundaries, in order.
fn pieces(spans: &[Span]) -> Vec<Piece> {
    let mut out = Vec::new();
    for s in spans {
        let mut at = 0;
        while at < s.len {
            let pool_offset = s.pool_offset + at;
            let within = pool_offset % CHUNK_SIZE;
            let len = (CHUNK_SIZE - within).min(s.len - at);
            out.push(Piece {
                span: Span {
                    region_offset: s.region_offset + at,
                    pool_offset,
                    len,
                    ..*s
                },
                chunk: pool_offset / CHUNK_SIZE,
                within,
                len,
            });
            at += len;
        }
    }
    out
}

impl Live {
    /// The keys of every piece's chunk, asking the daemon for those not known yet (one
    /// request per span piece lacking them; the reply covers its chunks).
    fn keys_for(
        &mut self,
        tcp: &TcpTransport,
        pieces: &[Piece],
        write: bool,
    ) -> std::result::Result<Vec<Remote>, Miss> {
        let mut out = Vec::with_capacity(pieces.len());
        for p in pieces {
            let delta = range_delta(p.span.ino, p.span.region_offset, p.span.pool_offset);
            let have = self
                .keys
                .get(&(p.span.pool, p.chunk))
                .filter(|k| k.ino == p.span.ino && k.delta == delta)
                .and_then(|k| k.key(p.within, p.len, write).map(|rkey| (k.addr, rkey)));
            let (addr, rkey) = match have {
                Some(k) => k,
                None => {
                    let op = if write {
                        Op::RdmaWriteKeys
                    } else {
                        Op::RdmaReadKeys
                    };
                    let mut h = Header::new(op, 0);
                    h.pool = p.span.pool;
                    h.offset = p.span.pool_offset;
                    h.length = p.span.len;
                    h.name_region(p.span.ino, p.span.region_offset, p.span.pool_offset);
                    let reply = match tcp.control_request(&mut self.control, h, &[]) {
                        Ok(r) => r,
                        Err(e @ RegionsError::Daemon { .. }) => return Err(Miss::Refused(e)),
                        Err(e) => return Err(Miss::Broken(e.to_string())),
                    };
                    let keys = RdmaChunkKey::decode_all(&reply)
                        .map_err(|e| Miss::Broken(format!("bad keys reply: {e}")))?;
                    for k in keys {
                        let from = k.pool_offset % CHUNK_SIZE;
                        let entry = self
                            .keys
                            .entry((p.span.pool, k.pool_offset / CHUNK_SIZE))
                            .or_default();
                        if (entry.ino, entry.delta) != (p.span.ino, delta) {
                            // Keys asked for another region (or place) before: not ours.
                            *entry = ChunkKeys::default();
                        }
                        entry.ino = p.span.ino;
                        entry.delta = delta;
                        entry.addr = k.addr - from;
                        let range = Some(KeyRange {
                            rkey: k.rkey,
                            from,
                            to: from + k.len,
                        });
                        if write {
                            entry.write = range;
                        } else {
                            entry.read = range;
                        }
                    }
                    let k = self
                        .keys
                        .get(&(p.span.pool, p.chunk))
                        .copied()
                        .unwrap_or_default();
                    match k.key(p.within, p.len, write) {
                        Some(rkey) => (k.addr, rkey),
                        None => {
                            return Err(Miss::Broken(format!(
                                "the daemon's keys reply does not cover {} bytes at {} of \
                                 chunk {} of pool {}",
                                p.len, p.within, p.chunk, p.span.pool
                            )));
                        }
                    }
                }
            };
            out.push(Remote {
                addr: addr + p.within,
                rkey,
            });
        }
        Ok(out)
    }

    /// Reads `spans` into `dst` (write: `None`) or writes `src` to them, in rounds of at most
    /// the bounce buffer.
    fn transfer(
        &mut self,
        tcp: &TcpTransport,
        spans: &[Span],
        mut dst: Option<&mut [u8]>,
        src: Option<&[u8]>,
    ) -> std::result::Result<(), Miss> {
        let write = src.is_some();
        let pieces = pieces(spans);
        let remotes = self.keys_for(tcp, &pieces, write)?;
        if let Some(dst) = dst.as_deref_mut()
            && dst.len() >= REGISTER_AT_LEAST
        {
            match RegisteredSlice::new(&self.pd, dst) {
                Ok(mut direct) => {
                    let mut at = 0usize;
                    let ops: Vec<regions_verbs::Op> = pieces
                        .iter()
                        .zip(&remotes)
                        .map(|(p, &remote)| {
                            let len = p.len as usize;
                            let local = Local { offset: at, len };
                            at += len;
                            regions_verbs::Op::Read { local, remote }
                        })
                        .collect();
                    return self
                        .qp
                        .execute(&mut direct, &ops, ROUND_TIMEOUT)
                        .map_err(|e| Miss::Broken(e.to_string()));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot register the caller's buffer; reading through the bounce buffer");
                }
            }
        }
        let mut done = 0usize; // bytes of the request finished
        let mut i = 0;
        while i < pieces.len() {
            // One round: as many whole pieces as fit the buffer (a piece is at most a chunk).
            let mut ops = Vec::new();
            let mut used = 0usize;
            while i < pieces.len() && used + pieces[i].len as usize <= self.buf.len() {
                let len = pieces[i].len as usize;
                let local = Local { offset: used, len };
                ops.push(if write {
                    regions_verbs::Op::Write {
                        local,
                        remote: remotes[i],
                    }
                } else {
                    regions_verbs::Op::Read {
                        local,
                        remote: remotes[i],
                    }
                });
                used += len;
                i += 1;
            }
            if let Some(src) = src {
                self.buf.bytes_mut()[..used].copy_from_slice(&src[done..done + used]);
            }
            self.qp
                .execute(&mut self.buf, &ops, ROUND_TIMEOUT)
                .map_err(|e| Miss::Broken(e.to_string()))?;
            if let Some(dst) = dst.as_deref_mut() {
                dst[done..done + used].copy_from_slice(&self.buf.bytes()[..used]);
            }
            done += used;
        }
        Ok(())
    }
}

impl Live {
    /// Applies `op` to the 8-byte word at `at` one-sided; returns the old value.
    fn atomic(
        &mut self,
        tcp: &TcpTransport,
        at: &Span,
        op: Atomic,
    ) -> std::result::Result<u64, Miss> {
        if !self.atomics {
            return Err(Miss::TcpOnly);
        }
        if at.len != 8 || !at.pool_offset.is_multiple_of(8) {
            // The daemon's answer (EINVAL) over tcp.
            return Err(Miss::TcpOnly);
        }
        let pieces = pieces(std::slice::from_ref(at));
        let remote = self.keys_for(tcp, &pieces, true)?[0];
        let op = match op {
            Atomic::CompareSwap { expected, new } => regions_verbs::Op::CompareSwap {
                local: 0,
                remote,
                expected,
                new,
            },
            Atomic::FetchAdd(add) => regions_verbs::Op::FetchAdd {
                local: 0,
                remote,
                add,
            },
        };
        match self.qp.execute(&mut self.buf, &[op], ROUND_TIMEOUT) {
            Ok(()) => {
                let mut old = [0u8; 8];
                old.copy_from_slice(&self.buf.bytes()[..8]);
                Ok(u64::from_ne_bytes(old))
            }
            // Not applied (a key the daemon dropped, say): tcp gives the answer.
            Err(e) if e.surely_not_executed() => Err(Miss::Broken(e.to_string())),
            Err(e) => Err(Miss::Unknown(e.to_string())),
        }
    }
}

/// An 8-byte atomic the transport applies.
#[derive(Clone, Copy)]
enum Atomic {
    CompareSwap { expected: u64, new: u64 },
    FetchAdd(u64),
}

impl RdmaTransport {
    /// `op` on the word at `at`, one-sided where the daemon accepts it, else over tcp.
    fn atomic(&self, at: &Span, op: Atomic) -> Result<u64> {
        // After the writes posted over tcp, as a tcp atomic would be.
        self.tcp.wait_writes();
        match self.attempt(|tcp, live| live.atomic(tcp, at, op)) {
            Some(Ok(old)) => {
                TransportStats::add(&self.stats.rdma_atomics, 1);
                counter!("regions_client_atomics_total", "transport" => "rdma").increment(1);
                Ok(old)
            }
            Some(Err(e)) => Err(e),
            None => match op {
                Atomic::CompareSwap { expected, new } => {
                    self.tcp.compare_and_swap(at, expected, new)
                }
                Atomic::FetchAdd(add) => self.tcp.fetch_add(at, add),
            },
        }
    }
}

impl Transport for RdmaTransport {
    fn read(&self, spans: &[Span], dst: &mut [u8]) -> Result<()> {
        // After the writes posted over tcp.
        self.tcp.wait_writes();
        let len = dst.len() as u64;
        match self.attempt(|tcp, live| live.transfer(tcp, spans, Some(&mut *dst), None)) {
            Some(Ok(())) => {
                TransportStats::add(&self.stats.rdma_requests, 1);
                TransportStats::add(&self.stats.rdma_bytes_read, len);
                counter!("regions_client_bytes_total", "op" => "read", "transport" => "rdma")
                    .increment(len);
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => self.tcp.read(spans, dst),
        }
    }

    fn write(&self, spans: &[Span], src: &[u8]) -> Result<()> {
        self.tcp.wait_writes();
        let len = src.len() as u64;
        match self.attempt(|tcp, live| live.transfer(tcp, spans, None, Some(src))) {
            Some(Ok(())) => {
                TransportStats::add(&self.stats.rdma_requests, 1);
                TransportStats::add(&self.stats.rdma_bytes_written, len);
                counter!("regions_client_bytes_total", "op" => "write", "transport" => "rdma")
                    .increment(len);
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => self.tcp.write(spans, src),
        }
    }

    fn compare_and_swap(&self, at: &Span, expected: u64, new: u64) -> Result<u64> {
        self.atomic(at, Atomic::CompareSwap { expected, new })
    }

    fn fetch_add(&self, at: &Span, addend: u64) -> Result<u64> {
        self.atomic(at, Atomic::FetchAdd(addend))
    }

    fn wait_change(&self, at: &Span, expected: u64, timeout: Duration) -> Result<u64> {
        self.tcp.wait_change(at, expected, timeout)
    }

    fn posts_atomics(&self) -> bool {
        // One-sided, an unlock takes one round trip and no daemon; posted over tcp, the next
        // lock would wait for the daemon to apply it.
        !self.atomics_live() && self.tcp.posts_atomics()
    }

    fn wake_waiters(&self, at: &Span) {
        if self.atomics_live() {
            self.tcp.post_wake(at);
        }
    }

    fn post_compare_and_swap(
        &self,
        at: &Span,
        expected: u64,
        new: u64,
        done: Completion,
    ) -> Result<()> {
        self.tcp.post_compare_and_swap(at, expected, new, done)
    }

    fn posts_writes(&self) -> bool {
        self.tcp.posts_writes()
    }

    fn post_write(&self, owner: u64, spans: &[Span], src: &[u8]) -> bool {
        // Posted over tcp; reads and writes over RDMA wait for them first.
        self.tcp.post_write(owner, spans, src)
    }

    fn wait_writes(&self) {
        self.tcp.wait_writes();
    }

    fn settle_writes(&self, owner: u64) -> Option<RegionsError> {
        self.tcp.settle_writes(owner)
    }

    fn forget_failed_writes(&self, owner: u64) {
        self.tcp.forget_failed_writes(owner);
    }

    fn describe(&self) -> String {
        if self.is_live() {
            format!("rdma {}", self.tcp.addr())
        } else {
            self.tcp.describe()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaks_in_a_row_back_off_longer_up_to_the_retry_bound() {
        assert_eq!(backoff(0), Duration::from_millis(100));
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(5), Duration::from_millis(3200));
        assert_eq!(backoff(9), Duration::from_millis(51_200));
        assert_eq!(backoff(40), Duration::from_millis(51_200));
        assert!(backoff(u32::MAX) <= RETRY_UNAVAILABLE);
    }

    #[test]
    fn keys_serve_only_the_bytes_they_reach() {
        let k = ChunkKeys {
            addr: 0x1000,
            ino: 9,
            delta: None,
            read: Some(KeyRange {
                rkey: 1,
                from: 4096,
                to: 8192,
            }),
            write: None,
        };
        assert_eq!(k.key(4096, 4096, false), Some(1));
        assert_eq!(k.key(5000, 100, false), Some(1));
        assert_eq!(k.key(4095, 10, false), None, "starts before the window");
        assert_eq!(k.key(8000, 200, false), None, "ends past it");
        assert_eq!(k.key(4096, 8, true), None, "a read key does not write");
        let rw = ChunkKeys {
            write: Some(KeyRange {
                rkey: 2,
                from: 0,
                to: CHUNK_SIZE,
            }),
            ..k
        };
        assert_eq!(rw.key(0, 64, false), Some(2), "a write key also reads");
        assert_eq!(rw.key(4096, 64, false), Some(1), "the read key first");
        assert_eq!(rw.key(CHUNK_SIZE - 8, 8, true), Some(2));
    }

    #[test]
    fn spans_are_cut_at_chunk_boundaries() {
        let s = Span {
            ino: 9,
            region_offset: 1000,
            pool: 3,
            pool_offset: CHUNK_SIZE - 100,
            len: CHUNK_SIZE + 300,
        };
        let p = pieces(&[s]);
        let shape: Vec<(u64, u64, u64, u64)> = p
            .iter()
            .map(|p| (p.chunk, p.within, p.len, p.span.region_offset))
            .collect();
        assert_eq!(
            shape,
            vec![
                (0, CHUNK_SIZE - 100, 100, 1000),
                (1, 0, CHUNK_SIZE, 1100),
                (2, 0, 200, 1100 + CHUNK_SIZE),
            ]
        );
        assert_eq!(p.iter().map(|p| p.len).sum::<u64>(), s.len);
        assert!(pieces(&[Span { len: 0, ..s }]).is_empty());
    }
}
