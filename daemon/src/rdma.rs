//! RDMA for the transport (docs/ARCHITECTURE.md, "RDMA"): the device the daemon opened, the
//! registrations of pool chunks, and the queue pair of each transport connection that asks
//! for one.
//!
//! Clients reach pool memory one-sided, by remote keys the transport hands out after the
//! same checks as a READ or WRITE of the chunks (capability, rights, stale maps). A chunk is
//! registered the first time a client asks for its keys, not when it is assigned, so that
//! memory only tcp clients touch is neither pinned nor made resident. Its registrations are
//! dropped before the chunk is unmapped or remapped (under the chunk's write lock), after
//! which its old keys fail at the client's device (remote access error): the client then asks
//! again over tcp and meets whatever the chunk is now.
//!
//! Node components (the cluster secret) get keys of whole chunks. Applications (capability
//! connections) get memory windows instead ([`BoundWindow`]): their queue pairs live in a
//! protection domain of their own, where chunks are registered a third time with no remote
//! access at all (only windows bound to that registration grant any), and each window covers
//! the capability's bytes of one chunk with the capability's rights, is bound on the daemon's
//! queue pair of that one connection (a type 2B window works through that queue pair only),
//! and is dropped when the capability is revoked or expires, when the chunk's registrations
//! are dropped, and when the connection closes.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use regions_proto::capability::{Capability, now_ms};
use regions_verbs::{
    Access, AtomicScope, Device, Endpoint, MemoryWindow, Op, ProtectionDomain, QueuePair,
    RegisteredBuffer, Registration, Remote,
};

use crate::error::{DaemonError, Result};
use crate::pools::WordOp;
use crate::transport::revocations::Revocations;

// The frame codec checks an RDMA-CONNECT payload against its own length; the verbs layer
// decodes the same bytes: the two must agree.
const _: () = assert!(Endpoint::LEN == regions_proto::frame::RDMA_ENDPOINT_LEN);

/// Bit of the byte after the endpoint in an RDMA-CONNECT reply: clients may apply 8-byte
/// atomics one-sided (the daemon's device performs them, and every atomic the daemon applies
/// itself goes through the device too, or the device's atomics exclude the CPUs').
pub const CONNECT_ATOMICS: u8 = regions_proto::frame::RDMA_CONNECT_ATOMICS;

/// Longest wait for an atomic the daemon applies through its own device.
const LOOPBACK_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for a memory window's binding.
const BIND_TIMEOUT: Duration = Duration::from_secs(2);
/// How often windows of expired capabilities are looked for.
const EXPIRY_SWEEP: Duration = Duration::from_secs(1);

/// A memory window bound for one capability over part of one chunk, on one connection's queue
/// pair. The connection holds it; the chunk's keys and the daemon's registry know it, so that
/// dropping the chunk's registrations, a revocation or the capability's expiry take the window
/// away ([`BoundWindow::invalidate`]) whoever holds it.
#[derive(Debug)]
pub struct BoundWindow {
    cap: Capability,
    /// Bytes of the chunk it covers: `[from, to)`.
    pub from: u64,
    pub to: u64,
    pub write: bool,
    pub rkey: u32,
    /// The window, and the registration of exactly its bytes it is bound to.
    window: Mutex<Option<(MemoryWindow, Arc<Registration>)>>,
}

impl BoundWindow {
    /// Deallocates the window: its key fails at the device from now on.
    pub fn invalidate(&self) {
        let mut slot = self
            .window
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Under the lock, so that whoever else invalidates it returns only once the window
        // is gone: the window first, then (if no other window uses it) its registration.
        if let Some((window, registration)) = slot.take() {
            drop(window);
            drop(registration);
        }
    }

    /// Whether the window is still bound.
    pub fn is_live(&self) -> bool {
        self.window
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// Whether the window was bound for `cap` (the same token).
    pub fn is_for(&self, cap: &Capability) -> bool {
        self.cap == *cap
    }
}

/// Every window bound and not dropped yet, for revocations and expiry.
#[derive(Debug, Default)]
pub struct WindowRegistry {
    windows: Mutex<Vec<Weak<BoundWindow>>>,
}

impl WindowRegistry {
    fn add(&self, w: &Arc<BoundWindow>) {
        let mut all = self
            .windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Forget windows gone meanwhile once the list has doubled (amortised).
        if all.len() >= 64 && all.len().is_power_of_two() {
            all.retain(|w| w.strong_count() > 0);
        }
        all.push(Arc::downgrade(w));
    }

    /// Drops the windows of capabilities revoked or expired now.
    pub fn invalidate_revoked(&self, revocations: &Revocations) {
        self.invalidate_where(|cap| revocations.revoked(cap));
    }

    /// Drops the windows of capabilities expired now.
    pub fn invalidate_expired(&self) {
        self.invalidate_where(|_| false);
    }

    fn invalidate_where(&self, revoked: impl Fn(&Capability) -> bool) {
        let now = now_ms();
        let mut all = self
            .windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.retain(|w| match w.upgrade() {
            Some(w) if revoked(&w.cap) || w.cap.expires_ms <= now => {
                tracing::debug!(
                    ino = w.cap.ino,
                    "memory window dropped: capability revoked or expired"
                );
                w.invalidate();
                false
            }
            Some(w) => w.is_live(),
            None => false,
        });
    }

    /// Windows bound now (for tests and stats).
    pub fn live(&self) -> usize {
        self.windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|w| w.upgrade().is_some_and(|w| w.is_live()))
            .count()
    }
}

/// Two queue pairs of the daemon's device connected to each other: the daemon applies the
/// atomics of tcp clients (and its own) through the device with them, where the device's
/// atomics are atomic only with respect to one another.
#[derive(Debug)]
struct Loopback {
    qp: QueuePair,
    _peer: QueuePair,
    buf: RegisteredBuffer,
}

impl Loopback {
    fn new(pd: &Arc<ProtectionDomain>) -> regions_verbs::Result<Loopback> {
        let mut qp = QueuePair::create(pd, 1)?;
        let mut peer = QueuePair::create(pd, 1)?;
        let (a, b) = (qp.endpoint(), peer.endpoint());
        qp.connect(&b)?;
        peer.connect(&a)?;
        Ok(Loopback {
            qp,
            _peer: peer,
            buf: RegisteredBuffer::new(pd, 8)?,
        })
    }
}

/// The device and protection domain every registration and queue pair of this daemon uses.
#[derive(Debug)]
pub struct Rdma {
    pd: Arc<ProtectionDomain>,
    /// Where capability connections' queue pairs and the registrations their windows bind
    /// to live (`None`: the device binds no type 2B windows, and applications use tcp).
    window_pd: Option<Arc<ProtectionDomain>>,
    windows: Arc<WindowRegistry>,
    scope: AtomicScope,
    /// With [`AtomicScope::Device`]: the queue pairs the daemon's own atomics go through
    /// (re-created when one breaks).
    loopback: Option<Mutex<Option<Loopback>>>,
}

impl Rdma {
    /// Opens device `name` (the first one when `None`), using GID `gid_index`.
    pub fn open(name: Option<&str>, gid_index: u8) -> Result<Rdma> {
        let device = Device::open(name, gid_index).map_err(|e| DaemonError::Rdma(e.to_string()))?;
        let pd = device
            .protection_domain()
            .map_err(|e| DaemonError::Rdma(e.to_string()))?;
        let scope = pd.device().atomic_scope();
        let loopback = match scope {
            AtomicScope::Device => {
                let lb = Loopback::new(&pd).map_err(|e| {
                    DaemonError::Rdma(format!(
                        "cannot connect the device to itself to apply atomics through it: {e}"
                    ))
                })?;
                Some(Mutex::new(Some(lb)))
            }
            AtomicScope::None | AtomicScope::Global => None,
        };
        let window_pd = if pd.device().has_windows() {
            Some(
                pd.device()
                    .protection_domain()
                    .map_err(|e| DaemonError::Rdma(e.to_string()))?,
            )
        } else {
            None
        };
        let windows = Arc::new(WindowRegistry::default());
        Ok(Rdma {
            pd,
            window_pd,
            windows,
            scope,
            loopback,
        })
    }

    /// Whether applications (capability connections) get RDMA: the device binds memory
    /// windows.
    pub fn serves_capabilities(&self) -> bool {
        self.window_pd.is_some()
    }

    /// Drops windows as `revocations` change, and those of expired capabilities every
    /// [`EXPIRY_SWEEP`] (a thread that ends with the registry).
    pub fn watch(&self, revocations: &Revocations) {
        let on_change = Arc::downgrade(&self.windows);
        revocations.on_change(Box::new(move |r| {
            if let Some(w) = on_change.upgrade() {
                w.invalidate_revoked(r);
            }
        }));
        let windows = Arc::downgrade(&self.windows);
        let spawned = std::thread::Builder::new()
            .name("rdma-window-expiry".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(EXPIRY_SWEEP);
                    match windows.upgrade() {
                        Some(w) => w.invalidate_expired(),
                        None => return,
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the memory window expiry thread: windows of expired capabilities last until a revocation or their connection's end");
        }
    }

    /// Windows bound now.
    pub fn live_windows(&self) -> usize {
        self.windows.live()
    }

    /// Binds a window over bytes `[from, to)` of the chunk `keys` registers, for `cap` and
    /// with its rights (`write`: reads, writes and atomics; else reads), on `qp` (the queue
    /// pair of the capability's connection, made by [`Rdma::accept`] in the windows'
    /// protection domain).
    pub fn bind_window(
        &self,
        qp: &mut QueuePair,
        keys: &ChunkKeys,
        cap: Capability,
        (from, to): (u64, u64),
        write: bool,
    ) -> Result<Arc<BoundWindow>> {
        let rdma = |e: regions_verbs::VerbsError| {
            DaemonError::Rdma(format!("binding a memory window: {e}"))
        };
        let pd = self
            .window_pd
            .as_ref()
            .ok_or_else(|| DaemonError::NoRdma(NO_WINDOWS.into()))?;
        let registration = keys.bindable(pd, (from, to))?;
        let mut mw = MemoryWindow::alloc(pd).map_err(rdma)?;
        let access = if write { Access::REMOTE } else { Access::READ };
        let rkey = qp
            .bind_window(
                &mut mw,
                &registration,
                registration.addr(),
                registration.len() as u64,
                access,
                BIND_TIMEOUT,
            )
            .map_err(rdma)?;
        let bound = Arc::new(BoundWindow {
            cap,
            from,
            to,
            write,
            rkey,
            window: Mutex::new(Some((mw, registration))),
        });
        {
            let mut on_chunk = keys
                .windows
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            on_chunk.retain(|w| w.is_live());
            on_chunk.push(Arc::clone(&bound));
        }
        self.windows.add(&bound);
        Ok(bound)
    }

    /// What the device's atomics exclude (see [`AtomicScope`]).
    pub fn atomic_scope(&self) -> AtomicScope {
        self.scope
    }

    /// Whether every atomic this daemon applies goes through the device (its atomics exclude
    /// only one another): then processes on this host must not apply CPU atomics to pool
    /// memory either (the host agent tells them so with their segments).
    pub fn routes_atomics(&self) -> bool {
        self.loopback.is_some()
    }

    /// The byte after the endpoint in an RDMA-CONNECT reply ([`CONNECT_ATOMICS`]).
    pub fn connect_flags(&self) -> u8 {
        match self.scope {
            AtomicScope::None => 0,
            AtomicScope::Device | AtomicScope::Global => CONNECT_ATOMICS,
        }
    }

    /// Applies `op` to the word at `remote` (a registration of this daemon's) through the
    /// device, as a client's one-sided atomic would; returns the old value.
    pub fn device_atomic(&self, remote: Remote, op: WordOp) -> Result<u64> {
        let rdma = |e: regions_verbs::VerbsError| {
            DaemonError::Rdma(format!("atomic through the RDMA device: {e}"))
        };
        let Some(loopback) = &self.loopback else {
            return Err(DaemonError::Rdma(
                "atomics through the device are off: its atomics exclude the CPUs'".into(),
            ));
        };
        let mut slot = loopback
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.as_ref().is_none_or(|lb| lb.qp.is_broken()) {
            *slot = None;
            *slot = Some(Loopback::new(&self.pd).map_err(rdma)?);
        }
        let Some(lb) = slot.as_mut() else {
            return Err(DaemonError::Rdma("loopback queue pair missing".into()));
        };
        let op = match op {
            WordOp::CompareSwap { expected, new } => Op::CompareSwap {
                local: 0,
                remote,
                expected,
                new,
            },
            WordOp::FetchAdd(add) => Op::FetchAdd {
                local: 0,
                remote,
                add,
            },
        };
        lb.qp
            .execute(&mut lb.buf, &[op], LOOPBACK_TIMEOUT)
            .map_err(|e| {
                if e.surely_not_executed() {
                    rdma(e)
                } else {
                    DaemonError::AtomicOutcomeUnknown(format!(
                        "atomic through the RDMA device: {e}"
                    ))
                }
            })?;
        let mut old = [0u8; 8];
        old.copy_from_slice(&lb.buf.bytes()[..8]);
        Ok(u64::from_ne_bytes(old))
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.pd.device().name()
    }

    /// A queue pair for a transport connection, connected to the client's `endpoint`
    /// (encoded), and its own endpoint to send back.
    /// `for_capabilities`: a capability connection's, in the windows' protection domain.
    pub fn accept(&self, endpoint: &[u8], for_capabilities: bool) -> Result<(QueuePair, Vec<u8>)> {
        let rdma = |e: regions_verbs::VerbsError| DaemonError::Rdma(e.to_string());
        let client = Endpoint::from_bytes(endpoint).map_err(rdma)?;
        let pd = if for_capabilities {
            self.window_pd
                .as_ref()
                .ok_or_else(|| DaemonError::NoRdma(NO_WINDOWS.into()))?
        } else {
            &self.pd
        };
        // The daemon posts only window bindings on it: its peer reads, writes and updates
        // pool memory.
        let mut qp = QueuePair::create(pd, 1).map_err(rdma)?;
        let mine = qp.endpoint().to_bytes().to_vec();
        qp.connect(&client).map_err(rdma)?;
        Ok((qp, mine))
    }

    /// Registers one pool chunk of `len` bytes at `addr` twice: for remote reads only, and
    /// for remote reads, writes and atomics.
    ///
    /// # Safety
    /// The range must stay mapped to the same pages until the keys are dropped (the chunk
    /// table drops them under the chunk's write lock before it unmaps or remaps the chunk).
    pub unsafe fn register_chunk(&self, addr: *mut u8, len: usize) -> Result<ChunkKeys> {
        let rdma = |e: regions_verbs::VerbsError| DaemonError::Rdma(e.to_string());
        let read_only = Access::READ;
        // SAFETY: the caller keeps the range mapped until the keys are dropped.
        let read =
            unsafe { Registration::register(&self.pd, addr, len, read_only) }.map_err(rdma)?;
        // SAFETY: as above.
        let write =
            unsafe { Registration::register(&self.pd, addr, len, Access::REMOTE) }.map_err(rdma)?;
        Ok(ChunkKeys {
            windows: Mutex::new(Vec::new()),
            bindable: Mutex::new(std::collections::HashMap::new()),
            read,
            write,
            ptr: addr as usize,
            len,
        })
    }
}

/// The bytes `[from, to)` of a chunk backing region bytes from `region_offset` that `cap`
/// reaches (`None`: none of them).
pub fn capability_bytes_of_chunk(cap: &Capability, region_offset: u64) -> Option<(u64, u64)> {
    use regions_proto::capability::WHOLE_REGION;
    use regions_proto::layout::CHUNK_SIZE;
    let cap_end = if cap.len == WHOLE_REGION {
        u64::MAX
    } else {
        cap.offset.saturating_add(cap.len)
    };
    let chunk_end = region_offset.saturating_add(CHUNK_SIZE);
    let from = cap.offset.max(region_offset) - region_offset;
    let to = cap_end.min(chunk_end).checked_sub(region_offset)?;
    (from < to).then_some((from, to))
}

/// Why a capability connection gets no RDMA.
pub const NO_WINDOWS: &str = "this daemon's RDMA device binds no memory windows, so \
     applications (capability connections) cannot be given keys that reach only their \
     capability's bytes: use the tcp transport";

/// The registrations of one mapped pool chunk, and the windows bound to it.
#[derive(Debug)]
pub struct ChunkKeys {
    // Windows go first (see Drop), then the registration they are bound to. Held strongly:
    // a window its connection dropped meanwhile is still found and invalidated here.
    windows: Mutex<Vec<Arc<BoundWindow>>>,
    /// Ranges `[from, to)` of the chunk registered in the windows' protection domain, without
    /// remote access of their own, for windows over exactly those bytes: soft-RoCE checks an
    /// access through a window against its registration's range, not the window's, so a
    /// window over part of a registration would reach all of it there.
    bindable: Mutex<std::collections::HashMap<(u64, u64), Arc<Registration>>>,
    read: Registration,
    write: Registration,
    ptr: usize,
    len: usize,
}

impl Drop for ChunkKeys {
    fn drop(&mut self) {
        // A registration with windows bound to it cannot be deregistered.
        self.invalidate_windows();
    }
}

impl ChunkKeys {
    /// Drops every window bound to this chunk (before its registrations go).
    pub fn invalidate_windows(&self) {
        let windows = std::mem::take(
            &mut *self
                .windows
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for w in &windows {
            w.invalidate();
        }
    }

    /// The registration in `pd` of bytes `[from, to)` of the chunk that windows over them
    /// bind to, made now if there is none (ranges no window uses any more are dropped first).
    fn bindable(
        &self,
        pd: &Arc<ProtectionDomain>,
        (from, to): (u64, u64),
    ) -> Result<Arc<Registration>> {
        if from >= to || to > self.len as u64 {
            return Err(DaemonError::Invalid(format!(
                "a window over bytes {from}..{to} of a {}-byte chunk",
                self.len
            )));
        }
        let mut ranges = self
            .bindable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(r) = ranges.get(&(from, to)) {
            return Ok(Arc::clone(r));
        }
        ranges.retain(|_, r| Arc::strong_count(r) > 1);
        // SAFETY: inside the range of `read` and `write` (checked above), which the chunk
        // table keeps mapped until these keys are dropped (`register_chunk`'s contract);
        // every window's registration is dropped with them or before (`invalidate_windows`).
        let r = unsafe {
            Registration::register(
                pd,
                (self.ptr + from as usize) as *mut u8,
                (to - from) as usize,
                Access::WINDOWS_ONLY,
            )
        }
        .map_err(|e| DaemonError::Rdma(format!("registering chunk bytes for a window: {e}")))?;
        let r = Arc::new(r);
        ranges.insert((from, to), Arc::clone(&r));
        Ok(r)
    }

    /// The remote address and read-write key of the byte `within` the chunk.
    pub fn remote(&self, within: u64) -> Remote {
        Remote {
            addr: self.addr() + within,
            rkey: self.rkey(true),
        }
    }

    /// The chunk's address in this daemon.
    pub fn addr(&self) -> u64 {
        self.read.addr()
    }

    /// The remote key for reading (`write`: for reading, writing and atomics).
    pub fn rkey(&self, write: bool) -> u32 {
        if write {
            self.write.rkey()
        } else {
            self.read.rkey()
        }
    }
}

#[cfg(test)]
mod tests {
    use regions_proto::capability::{Capability, RIGHT_READ, WHOLE_REGION};
    use regions_proto::layout::CHUNK_SIZE;

    use super::capability_bytes_of_chunk;

    fn cap(offset: u64, len: u64) -> Capability {
        Capability {
            ino: 7,
            rights: RIGHT_READ,
            expires_ms: u64::MAX,
            issued: 1,
            offset,
            len,
            host: 0,
        }
    }

    #[test]
    fn a_window_covers_the_capabilitys_bytes_of_the_chunk_only() {
        // The whole region: whole chunks.
        assert_eq!(
            capability_bytes_of_chunk(&cap(0, WHOLE_REGION), 3 * CHUNK_SIZE),
            Some((0, CHUNK_SIZE))
        );
        // A mutex's 64-byte slot in the chunk backing region bytes from 128 KiB.
        assert_eq!(
            capability_bytes_of_chunk(&cap(CHUNK_SIZE + 4096, 64), CHUNK_SIZE),
            Some((4096, 4160))
        );
        // Across a chunk boundary: each chunk gets its part.
        let c = cap(CHUNK_SIZE - 100, 300);
        assert_eq!(
            capability_bytes_of_chunk(&c, 0),
            Some((CHUNK_SIZE - 100, CHUNK_SIZE))
        );
        assert_eq!(capability_bytes_of_chunk(&c, CHUNK_SIZE), Some((0, 200)));
        // Chunks the capability does not reach.
        assert_eq!(capability_bytes_of_chunk(&c, 2 * CHUNK_SIZE), None);
        assert_eq!(capability_bytes_of_chunk(&cap(5 * CHUNK_SIZE, 10), 0), None);
        // A chunk at the end of the address space does not overflow.
        assert_eq!(
            capability_bytes_of_chunk(&cap(0, WHOLE_REGION), u64::MAX - CHUNK_SIZE + 1),
            Some((0, CHUNK_SIZE - 1))
        );
    }
}
