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

use std::sync::Arc;

use regions_verbs::{Access, Device, Endpoint, ProtectionDomain, QueuePair, Registration};

use crate::error::{DaemonError, Result};

// The frame codec checks an RDMA-CONNECT payload against its own length; the verbs layer
// decodes the same bytes: the two must agree.
const _: () = assert!(Endpoint::LEN == regions_proto::frame::RDMA_ENDPOINT_LEN);

/// The device and protection domain every registration and queue pair of this daemon uses.
#[derive(Debug)]
pub struct Rdma {
    pd: Arc<ProtectionDomain>,
}

impl Rdma {
    /// Opens device `name` (the first one when `None`), using GID `gid_index`.
    pub fn open(name: Option<&str>, gid_index: u8) -> Result<Rdma> {
        let device = Device::open(name, gid_index).map_err(|e| DaemonError::Rdma(e.to_string()))?;
        let pd = device
            .protection_domain()
            .map_err(|e| DaemonError::Rdma(e.to_string()))?;
        Ok(Rdma { pd })
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
