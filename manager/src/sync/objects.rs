//! The sync objects as the manager stores them: definitions, owners, the lock region and its
//! slots, and where a lock word lives. Plain data; the operations on them are in
//! [`super::model`] (on the manager's state) and [`super::runtime`] (waiters).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{ManagerError, Result};

pub use regions_proto::lock_word::{COUNT_MASK, DELETED, SLEEPERS, WAITERS, tag_host, tag_pid};
/// Bytes between lock words (one cache line each).
pub const SLOT_STRIDE: u64 = 64;
/// Store key of the lock region's record (no object may have an empty name).
pub const LOCK_REGION_KEY: &str = "";
/// Longest object name.
pub const MAX_NAME: usize = 255;

/// The lock word tag of thread `tid` (0: the whole process) of `pid` on host `host`.
pub fn tag(host: u32, pid: u32, tid: u32) -> Result<u64> {
    regions_proto::lock_word::tag(host, pid, tid).ok_or_else(|| {
        ManagerError::Invalid(regions_proto::lock_word::tag_overflow_hint(host, pid, tid))
    })
}

/// A named object's definition (stored).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyncDef {
    /// A barrier counted in memory here (stored before barriers had words; still loaded).
    Barrier {
        n: u32,
    },
    /// The lock word's offset in the lock region.
    Mutex {
        offset: u64,
    },
    Bell,
    /// A barrier of `n` with its arrival word at `offset` in the lock region.
    BarrierWord {
        n: u32,
        offset: u64,
    },
}

impl SyncDef {
    /// Whether the object has (or, when created, gets) a word in the lock region.
    pub(crate) fn has_word(&self) -> bool {
        !matches!(self, SyncDef::Bell)
    }

    /// The offset of the object's word in the lock region.
    pub(crate) fn word_offset(&self) -> Option<u64> {
        match self {
            SyncDef::Mutex { offset } | SyncDef::BarrierWord { offset, .. } => Some(*offset),
            SyncDef::Barrier { .. } | SyncDef::Bell => None,
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            SyncDef::Barrier { .. } | SyncDef::BarrierWord { .. } => "barrier",
            SyncDef::Mutex { .. } => "mutex",
            SyncDef::Bell => "doorbell",
        }
    }
}

/// Who owns a sync object and who may use it, as for a file: using a mutex or a barrier
/// (lock, unlock, locate, arrive, wait) needs read and write permission, ringing a doorbell
/// write, waiting on one read; only the owner or root may delete it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncOwner {
    pub uid: u32,
    pub gid: u32,
    /// Permission bits (0o777).
    pub mode: u32,
}

impl SyncOwner {
    /// Objects stored before sync objects had owners: root's, usable by everyone (as they
    /// were).
    pub const LEGACY: SyncOwner = SyncOwner {
        uid: 0,
        gid: 0,
        mode: 0o666,
    };
}

/// Mode of a new sync object when the caller names none: its owner's only.
pub const DEFAULT_SYNC_MODE: u32 = 0o600;

/// The stored form of a named object: its definition and its owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SyncRecord {
    pub(crate) def: SyncDef,
    pub(crate) owner: SyncOwner,
}

/// The hidden region holding lock words (stored).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockRegion {
    pub ino: u64,
    /// Slots handed out so far (the next new slot's index).
    pub next: u64,
    /// Slots of deleted objects, each [`FreeSlot::pack`]ed: reused once every capability
    /// for them has expired.
    pub free: Vec<u64>,
}

/// A slot of a deleted object, waiting to be reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreeSlot {
    /// The slot's index (offset / [`SLOT_STRIDE`]).
    pub index: u32,
    /// Unix second from which it may be reused.
    pub after_secs: u32,
}

impl FreeSlot {
    /// Stored form: the index in the high 32 bits, the second in the low 32.
    pub fn pack(self) -> u64 {
        (u64::from(self.index) << 32) | u64::from(self.after_secs)
    }

    pub fn unpack(raw: u64) -> FreeSlot {
        FreeSlot {
            index: (raw >> 32) as u32,
            after_secs: raw as u32,
        }
    }
}

pub(crate) fn unix_secs() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs().min(u64::from(u32::MAX)) as u32)
}

/// Sync definitions in the manager's state.
#[derive(Clone, Debug, Default)]
pub struct SyncState {
    pub defs: BTreeMap<String, SyncDef>,
    /// Owner and mode of each object in `defs`.
    pub owners: BTreeMap<String, SyncOwner>,
    pub lock_region: Option<LockRegion>,
}

/// Seconds past a capability lifetime before a deleted object's slot is reused (at most one
/// more lifetime).
pub const SLOT_REUSE_MARGIN_SECS: u32 = 30;

/// Mode of the lock region: root's alone. Other users reach their objects' words through
/// the manager or with a capability for one slot, never by mapping the region.
pub const LOCK_REGION_MODE: u32 = 0o600;

pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains('\0') {
        return Err(ManagerError::Invalid(format!(
            "sync object name {name:?}: names must be non-empty and contain no NUL"
        )));
    }
    if name.len() > MAX_NAME {
        return Err(ManagerError::NameTooLong(name.len()));
    }
    Ok(())
}

/// Where a lock word is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WordPlace {
    pub ino: u64,
    pub region_offset: u64,
    pub pool: u32,
    pub pool_offset: u64,
    pub host_id: u32,
    pub transport_addr: String,
}
