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

use std::sync::{Arc, Mutex};
use std::time::Duration;

use regions_verbs::{
    Access, AtomicScope, Device, Endpoint, Op, ProtectionDomain, QueuePair, RegisteredBuffer,
    Registration, Remote,
};

use crate::error::{DaemonError, Result};
use crate::pools::WordOp;

// The frame codec checks an RDMA-CONNECT payload against its own length; the verbs layer
// decodes the same bytes: the two must agree.
const _: () = assert!(Endpoint::LEN == regions_proto::frame::RDMA_ENDPOINT_LEN);

/// Bit of the byte after the endpoint in an RDMA-CONNECT reply: clients may apply 8-byte
/// atomics one-sided (the daemon's device performs them, and every atomic the daemon applies
/// itself goes through the device too, or the device's atomics exclude the CPUs').
pub const CONNECT_ATOMICS: u8 = regions_proto::frame::RDMA_CONNECT_ATOMICS;

/// Longest wait for an atomic the daemon applies through its own device.
const LOOPBACK_TIMEOUT: Duration = Duration::from_secs(2);

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
        Ok(Rdma {
            pd,
            scope,
            loopback,
        })
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
            .map_err(rdma)?;
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
    pub fn accept(&self, endpoint: &[u8]) -> Result<(QueuePair, Vec<u8>)> {
        let rdma = |e: regions_verbs::VerbsError| DaemonError::Rdma(e.to_string());
        let client = Endpoint::from_bytes(endpoint).map_err(rdma)?;
        // The daemon posts nothing on it: its peer reads, writes and updates pool memory.
        let mut qp = QueuePair::create(&self.pd, 1).map_err(rdma)?;
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
        let read_only = Access {
            remote_read: true,
            remote_write: false,
            remote_atomic: false,
        };
        // SAFETY: the caller keeps the range mapped until the keys are dropped.
        let read =
            unsafe { Registration::register(&self.pd, addr, len, read_only) }.map_err(rdma)?;
        // SAFETY: as above.
        let write =
            unsafe { Registration::register(&self.pd, addr, len, Access::REMOTE) }.map_err(rdma)?;
        Ok(ChunkKeys { read, write })
    }
}

/// The registrations of one mapped pool chunk.
#[derive(Debug)]
pub struct ChunkKeys {
    read: Registration,
    write: Registration,
}

impl ChunkKeys {
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
