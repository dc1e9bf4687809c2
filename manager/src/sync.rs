//! Barriers, mutexes and doorbells (Remote Regions paper §5.9; docs/SEMANTICS.md, "Barriers,
//! mutexes and doorbells"): named
//! objects whose definitions are durable in the store and whose waiting callers live in
//! memory, served as the `Sync` gRPC service.
//!
//! - **Barrier** `n`: the `n`-th caller of a round releases the round; rounds are numbered
//!   (generations, from 1) and the barrier is reused round after round. A barrier has an
//!   8-byte arrival word in the lock region (below) counting arrivals, never reset: clients
//!   arrive with a transport fetch-add and wait by reading the word; `BarrierSleep` blocks
//!   here until the word reaches a round's count (this service reads the word when called,
//!   when a completing client calls `BarrierWake` because [`SLEEPERS`] was set, and on a
//!   short tick). Barriers stored before arrival words existed (`SyncDef::Barrier`) count
//!   arrivals here in memory (`BarrierWait`).
//! - **Doorbell**: a ring count. `BellWait` returns once the count is above what this caller
//!   (host id, pid) saw at its previous wait (0 before its first), and returns the count.
//! - **Mutex**: an 8-byte lock word in a hidden region the manager allocates (one persistent
//!   region with no name, root's, mode 0600, slots 64 bytes apart; a client's capability
//!   reaches its object's slot only). The word is 0 when free, else the holding
//!   thread's tag (host id, pid, tid: `regions_proto::lock_word::tag`), with [`WAITERS`] set while
//!   callers queue here. Clients lock
//!   with a transport compare-and-swap `0 -> tag` and unlock with `tag -> 0`; only when that
//!   fails do they call `MutexLock` / `MutexUnlock`, and the manager (which changes the word
//!   over the transport with the cluster secret, one operation at a time per mutex) queues
//!   them in FIFO order and hands the word straight to the next waiter. A holder loses the
//!   lock when its process exits (its host agent watches it and calls `ReleaseDead`) or when
//!   its host's lease ends.
//!
//! Deleting a mutex or barrier sets [`DELETED`] in its word, so a client still holding the old
//! location finds out instead of touching another object. The slot is reused only after one
//! capability lifetime and a margin ([`SLOT_REUSE_MARGIN_SECS`]): every token for it has
//! expired and every client has located its words again by then; its word is cleared first.
//!
//! Waiting calls end when the caller goes away: tonic drops the call's future and the guards
//! here take the waiter out of its queue.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use regions_proto::auth::Secret;
use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1::{self, sync_server::Sync};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tonic::{Request, Response, Status};

use crate::access::{Caller, READ, WRITE};
use crate::capability::Minter;
use crate::error::{ManagerError, Result};
use crate::manager::Manager;
use crate::model::{Kind, ROOT_INO, RegionAttrs};
use crate::state::State;

use crate::word_client::{WordAt, WordClient};
pub use regions_proto::lock_word::{COUNT_MASK, DELETED, SLEEPERS, WAITERS, tag_host, tag_pid};
/// Bytes between lock words (one cache line each).
pub const SLOT_STRIDE: u64 = 64;
/// Store key of the lock region's record (no object may have an empty name).
pub const LOCK_REGION_KEY: &str = "";
/// Longest object name.
pub const MAX_NAME: usize = 255;

/// How often a barrier sleeper rereads its word in case no wake comes.
const BARRIER_TICK: Duration = Duration::from_millis(100);

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
    fn has_word(&self) -> bool {
        !matches!(self, SyncDef::Bell)
    }

    /// The offset of the object's word in the lock region.
    fn word_offset(&self) -> Option<u64> {
        match self {
            SyncDef::Mutex { offset } | SyncDef::BarrierWord { offset, .. } => Some(*offset),
            SyncDef::Barrier { .. } | SyncDef::Bell => None,
        }
    }

    fn kind(&self) -> &'static str {
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
struct SyncRecord {
    def: SyncDef,
    owner: SyncOwner,
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

fn unix_secs() -> u32 {
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

impl State {
    /// Gives a lock region made by an earlier version (mode 0666) the mode
    /// [`LOCK_REGION_MODE`]; returns whether it changed.
    pub fn restrict_lock_region(&mut self) -> bool {
        let Some(ino) = self.sync.lock_region.as_ref().map(|r| r.ino) else {
            return false;
        };
        let Ok(inode) = self.inode(ino) else {
            return false;
        };
        if inode.mode & 0o7777 == LOCK_REGION_MODE && inode.uid == 0 {
            return false;
        }
        let mut inode = inode.clone();
        inode.mode = (inode.mode & !0o7777) | LOCK_REGION_MODE;
        inode.uid = 0;
        self.put_inode(inode);
        true
    }
}

/// Loads one stored sync record.
pub fn load_record(state: &mut State, key: &str, bytes: &[u8]) -> Result<(), postcard::Error> {
    if key == LOCK_REGION_KEY {
        state.sync.lock_region = Some(postcard::from_bytes(bytes)?);
    } else {
        // Records written before objects had owners hold the definition alone.
        let record = match postcard::from_bytes::<SyncRecord>(bytes) {
            Ok(r) => r,
            Err(_) => SyncRecord {
                def: postcard::from_bytes(bytes)?,
                owner: SyncOwner::LEGACY,
            },
        };
        state.sync.defs.insert(key.to_owned(), record.def);
        state.sync.owners.insert(key.to_owned(), record.owner);
    }
    Ok(())
}

/// The stored form of sync record `key` (`None`: deleted).
pub fn record_of(state: &State, key: &str) -> Result<Option<Vec<u8>>, postcard::Error> {
    if key == LOCK_REGION_KEY {
        state
            .sync
            .lock_region
            .as_ref()
            .map(postcard::to_allocvec)
            .transpose()
    } else {
        state
            .sync
            .defs
            .get(key)
            .map(|def| {
                postcard::to_allocvec(&SyncRecord {
                    def: def.clone(),
                    owner: state.sync_owner(key),
                })
            })
            .transpose()
    }
}

fn check_name(name: &str) -> Result<()> {
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

impl State {
    /// The definition of `name`.
    pub fn sync_def(&self, name: &str) -> Result<SyncDef> {
        check_name(name)?;
        self.sync.defs.get(name).cloned().ok_or_else(|| {
            ManagerError::NotFound(format!(
                "sync object {name:?} (create it first with the matching init call)"
            ))
        })
    }

    /// The owner and mode of `name` ([`SyncOwner::LEGACY`] for objects stored without one).
    fn sync_owner(&self, name: &str) -> SyncOwner {
        self.sync
            .owners
            .get(name)
            .copied()
            .unwrap_or(SyncOwner::LEGACY)
    }

    /// Checks that `caller` may use `name` with `mask` (READ, WRITE) permission.
    pub fn sync_check(&self, caller: &Caller, name: &str, mask: u32, what: &str) -> Result<()> {
        self.sync_def(name)?;
        let owner = self.sync_owner(name);
        if crate::access::allows_bits(caller, owner.uid, owner.gid, owner.mode, false, mask) {
            Ok(())
        } else {
            Err(ManagerError::Access(format!(
                "uid {} may not {what} sync object {name:?} (mode {:o}, owner {}:{})",
                caller.uid, owner.mode, owner.uid, owner.gid
            )))
        }
    }

    /// Creates `name` as `def` owned by the caller with permission bits `mode` (default
    /// [`DEFAULT_SYNC_MODE`]); a mutex's or barrier's slot is allocated here (the offset in
    /// `def` is ignored). An existing object with the same kind and parameters is left as it
    /// is, if the caller may use it; anything else is `EEXIST`.
    pub fn sync_init(
        &mut self,
        caller: &Caller,
        name: &str,
        def: SyncDef,
        mode: Option<u32>,
    ) -> Result<SyncDef> {
        self.sync_init_in(caller, name, def, mode, None)
    }

    /// [`State::sync_init`], giving a new mutex or barrier the word at `slot` when one is
    /// given (a reused slot whose word the caller cleared, see [`State::take_reusable_slot`]).
    pub fn sync_init_in(
        &mut self,
        caller: &Caller,
        name: &str,
        def: SyncDef,
        mode: Option<u32>,
        slot: Option<u64>,
    ) -> Result<SyncDef> {
        check_name(name)?;
        if let SyncDef::Barrier { n: 0 } | SyncDef::BarrierWord { n: 0, .. } = def {
            return Err(ManagerError::Invalid(format!(
                "barrier {name:?} with 0 parties; use 1 or more"
            )));
        }
        if let Some(existing) = self.sync.defs.get(name) {
            let same = match (existing, &def) {
                (SyncDef::Mutex { .. }, SyncDef::Mutex { .. }) => true,
                (
                    SyncDef::Barrier { n: a } | SyncDef::BarrierWord { n: a, .. },
                    SyncDef::Barrier { n: b } | SyncDef::BarrierWord { n: b, .. },
                ) => a == b,
                (a, b) => a == b,
            };
            if same {
                let existing = existing.clone();
                self.sync_check(caller, name, READ | WRITE, "use")?;
                return Ok(existing);
            }
            return Err(ManagerError::Exists(format!(
                "sync object {name:?} as a {} with other parameters ({existing:?}); delete it first",
                existing.kind()
            )));
        }
        let mut word = || match slot {
            Some(offset) => Ok(offset),
            None => self.alloc_lock_slot(caller.host_id),
        };
        let def = match def {
            SyncDef::Mutex { .. } => SyncDef::Mutex { offset: word()? },
            SyncDef::Barrier { n } | SyncDef::BarrierWord { n, .. } => {
                SyncDef::BarrierWord { n, offset: word()? }
            }
            other => other,
        };
        self.sync.defs.insert(name.to_owned(), def.clone());
        self.sync.owners.insert(
            name.to_owned(),
            SyncOwner {
                uid: caller.uid,
                gid: caller.gid,
                mode: mode.unwrap_or(DEFAULT_SYNC_MODE) & 0o777,
            },
        );
        self.dirty.sync.insert(name.to_owned());
        Ok(def)
    }

    /// Deletes `name` as `caller`, its owner or root (the service marks a word [`DELETED`];
    /// its slot is not reused).
    pub fn sync_delete(&mut self, caller: &Caller, name: &str) -> Result<SyncDef> {
        let def = self.sync_def(name)?;
        let owner = self.sync_owner(name);
        if !caller.is_root() && caller.uid != owner.uid {
            return Err(ManagerError::Perm(format!(
                "only its owner (uid {}) or root may delete sync object {name:?}",
                owner.uid
            )));
        }
        self.sync.defs.remove(name);
        self.sync.owners.remove(name);
        self.dirty.sync.insert(name.to_owned());
        if let Some(offset) = def.word_offset() {
            // Tokens for the slot live at most one capability lifetime (and cached locations
            // are located again by then): after that, nobody but a new object reaches it. The
            // margin covers a locate that read the definition just before the delete and
            // mints its token a little later, and daemon clocks a little behind.
            let ttl = u32::try_from(self.capability_ttl.as_secs()).unwrap_or(u32::MAX);
            let after = unix_secs()
                .saturating_add(ttl)
                .saturating_add(SLOT_REUSE_MARGIN_SECS.min(ttl));
            self.free_lock_slot(offset, after);
        }
        Ok(def)
    }

    /// Puts the slot at `offset` on the free list, reusable from Unix second `after_secs`.
    pub fn free_lock_slot(&mut self, offset: u64, after_secs: u32) {
        let Some(region) = self.sync.lock_region.as_mut() else {
            return;
        };
        let Ok(index) = u32::try_from(offset / SLOT_STRIDE) else {
            return;
        };
        region.free.push(FreeSlot { index, after_secs }.pack());
        self.dirty.sync.insert(LOCK_REGION_KEY.to_owned());
    }

    /// Takes a freed slot whose capabilities have all expired, if any (its word still holds
    /// what the deleted object left: clear it before use). `None`: allocate a new slot.
    pub fn take_reusable_slot(&mut self) -> Option<u64> {
        let now = unix_secs();
        let region = self.sync.lock_region.as_mut()?;
        let at = region
            .free
            .iter()
            .position(|raw| FreeSlot::unpack(*raw).after_secs <= now)?;
        let slot = FreeSlot::unpack(region.free.swap_remove(at));
        self.dirty.sync.insert(LOCK_REGION_KEY.to_owned());
        Some(u64::from(slot.index) * SLOT_STRIDE)
    }

    /// A new lock-word slot (one never used before), creating or growing the lock region as
    /// needed (placed on `host` when it is the first, like a region created there).
    fn alloc_lock_slot(&mut self, host: u32) -> Result<u64> {
        let created = match &self.sync.lock_region {
            Some(r) => {
                if self.region(r.ino).is_err() {
                    return Err(ManagerError::Store(format!(
                        "the lock region {} of the sync service is missing",
                        r.ino
                    )));
                }
                None
            }
            None => {
                let root = self.inode(ROOT_INO)?.clone();
                let mut inode =
                    self.new_inode(Kind::Region, LOCK_REGION_MODE, &Caller::root(host), &root);
                // No name: nobody can open or unlink it through the namespace.
                inode.nlink = 1;
                inode.attrs = RegionAttrs {
                    persistent: true,
                    ..RegionAttrs::default()
                };
                let ino = inode.ino;
                self.put_inode(inode);
                self.sync.lock_region = Some(LockRegion {
                    ino,
                    next: 0,
                    free: Vec::new(),
                });
                Some(ino)
            }
        };
        let (ino, next) = match &self.sync.lock_region {
            Some(r) => (r.ino, r.next),
            None => return Err(ManagerError::Store("lock region vanished".into())),
        };
        let offset = next * SLOT_STRIDE;
        let size = self.region(ino)?.size;
        if offset + SLOT_STRIDE > size {
            let grown = (offset + SLOT_STRIDE).div_ceil(CHUNK_SIZE) * CHUNK_SIZE;
            if let Err(e) = self.resize(ino, Some(grown), grown, false) {
                if let Some(ino) = created {
                    // Undo: no half-made lock region.
                    self.maps.remove(&ino);
                    self.inodes.remove(&ino);
                    self.sync.lock_region = None;
                }
                return Err(e);
            }
        }
        if let Some(r) = self.sync.lock_region.as_mut() {
            r.next += 1;
        }
        self.dirty.sync.insert(LOCK_REGION_KEY.to_owned());
        Ok(offset)
    }

    /// Where the lock word at `offset` of the lock region lives.
    pub fn lock_word(&self, offset: u64) -> Result<WordPlace> {
        let region =
            self.sync.lock_region.as_ref().ok_or_else(|| {
                ManagerError::NotFound("the lock region (no mutex exists)".into())
            })?;
        self.check_not_lost(region.ino)?;
        let map = self.maps.get(&region.ino).map_or(&[][..], Vec::as_slice);
        let entry = map
            .get((offset / CHUNK_SIZE) as usize)
            .and_then(|raw| MapEntry::decode(*raw))
            .ok_or_else(|| {
                ManagerError::Store(format!("lock word at {offset} has no memory behind it"))
            })?;
        let host_id = self.pool_host(entry.gid).unwrap_or(0);
        let transport_addr = self
            .hosts
            .get(&host_id)
            .map(|h| h.transport_addr.clone())
            .unwrap_or_default();
        Ok(WordPlace {
            ino: region.ino,
            region_offset: offset,
            pool: entry.gid,
            pool_offset: entry.pool_offset + offset % CHUNK_SIZE,
            host_id,
            transport_addr,
        })
    }
}

/// A caller queued for a mutex.
struct Waiter {
    id: u64,
    tag: u64,
    grant: oneshot::Sender<()>,
}

struct MutexRt {
    offset: u64,
    /// One word operation sequence at a time.
    ops: tokio::sync::Mutex<()>,
    queue: StdMutex<VecDeque<Waiter>>,
}

struct BarrierRt {
    n: u32,
    /// Callers arrived in the current round.
    arrived: StdMutex<u32>,
    /// (completed rounds, deleted).
    done: watch::Sender<(u64, bool)>,
}

/// A barrier with an arrival word: its sleepers.
struct WordBarrierRt {
    offset: u64,
    /// One change of the word's SLEEPERS bit at a time.
    ops: tokio::sync::Mutex<()>,
    /// Arrival counts sleepers wait for, with how many wait for each.
    targets: StdMutex<BTreeMap<u64, usize>>,
    /// (arrivals last read from the word, deleted).
    seen: watch::Sender<(u64, bool)>,
}

/// Takes a sleeper's target out when its call ends.
struct SleeperGuard {
    rt: Arc<WordBarrierRt>,
    target: u64,
}

impl Drop for SleeperGuard {
    fn drop(&mut self) {
        if let Ok(mut targets) = self.rt.targets.lock()
            && let Some(k) = targets.get_mut(&self.target)
        {
            *k -= 1;
            if *k == 0 {
                targets.remove(&self.target);
            }
        }
    }
}

struct BellRt {
    /// (rings, deleted).
    rings: watch::Sender<(u64, bool)>,
    /// Ring count each caller saw at its last wait.
    seen: StdMutex<HashMap<(u32, u32), u64>>,
}

#[derive(Default)]
struct Runtime {
    mutexes: HashMap<String, Arc<MutexRt>>,
    barriers: HashMap<String, Arc<BarrierRt>>,
    word_barriers: HashMap<String, Arc<WordBarrierRt>>,
    bells: HashMap<String, Arc<BellRt>>,
}

/// The `Sync` service: definitions in the manager's state, waiters here.
#[derive(Clone)]
pub struct SyncService {
    inner: Arc<Inner>,
}

struct Inner {
    manager: Arc<Manager>,
    minter: Minter,
    runtime: StdMutex<Runtime>,
    words: WordClient,
    next_waiter: AtomicU64,
}

/// Takes a queued waiter out when its call ends without a grant.
struct QueueGuard {
    rt: Arc<MutexRt>,
    id: u64,
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if let Ok(mut q) = self.rt.queue.lock() {
            q.retain(|w| w.id != self.id);
        }
    }
}

/// Takes an arrival back when a barrier call ends before its round completes.
struct ArrivalGuard {
    rt: Arc<BarrierRt>,
    round: u64,
    armed: bool,
}

impl Drop for ArrivalGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(mut arrived) = self.rt.arrived.lock()
            && self.rt.done.borrow().0 == self.round
        {
            *arrived = arrived.saturating_sub(1);
        }
    }
}

fn poisoned() -> ManagerError {
    ManagerError::Store("a sync lock was poisoned".into())
}

impl SyncService {
    /// The service for `manager`; lock words are changed over the transport with `secret`.
    pub fn new(manager: Arc<Manager>, secret: Secret) -> SyncService {
        SyncService {
            inner: Arc::new(Inner {
                minter: Minter::new(&secret, manager.config().capability_ttl),
                manager,
                runtime: StdMutex::new(Runtime::default()),
                words: WordClient::new(secret),
                next_waiter: AtomicU64::new(1),
            }),
        }
    }

    fn manager(&self) -> &Manager {
        &self.inner.manager
    }

    async fn def(&self, name: &str) -> Result<SyncDef> {
        let name = name.to_owned();
        self.manager().read(move |s| s.sync_def(&name)).await
    }

    pub async fn init(
        &self,
        caller: &Caller,
        name: &str,
        def: SyncDef,
        mode: Option<u32>,
    ) -> Result<SyncDef> {
        let caller = caller.clone();
        let name = name.to_owned();
        let exists = {
            let name = name.clone();
            self.manager()
                .read(move |s| Ok(s.sync.defs.contains_key(&name)))
                .await?
        };
        // An init of an existing object (the common, idempotent case) needs no slot.
        let slot = if def.has_word() && !exists {
            self.reusable_slot().await
        } else {
            None
        };
        let made = self
            .manager()
            .write_allocating(move |s| s.sync_init_in(&caller, &name, def.clone(), mode, slot))
            .await;
        if let Some(offset) = slot
            && !matches!(&made, Ok(d) if d.word_offset() == Some(offset))
        {
            // Not used (the object existed, or the init failed): the slot is clear and no
            // token reaches it, so it is reusable at once.
            let returned = self
                .manager()
                .write(move |s| {
                    s.free_lock_slot(offset, 0);
                    Ok(())
                })
                .await;
            if let Err(e) = returned {
                tracing::warn!(offset, error = %e, "cannot return an unused lock slot");
            }
        }
        made
    }

    /// A deleted object's slot that may be reused, its word cleared; `None` when there is
    /// none (or it cannot be cleared now: it is put back for later).
    async fn reusable_slot(&self) -> Option<u64> {
        let offset = self
            .manager()
            .write(|s| Ok(s.take_reusable_slot()))
            .await
            .ok()??;
        match self.clear_word(offset).await {
            Ok(()) => Some(offset),
            Err(e) => {
                tracing::warn!(offset, error = %e, "cannot clear a freed lock slot; keeping it aside");
                let later = unix_secs().saturating_add(60);
                let _ = self
                    .manager()
                    .write(move |s| {
                        s.free_lock_slot(offset, later);
                        Ok(())
                    })
                    .await;
                None
            }
        }
    }

    /// Sets the word at `offset` to 0 (whatever a deleted object left there).
    async fn clear_word(&self, offset: u64) -> Result<()> {
        let place = self.word_place(offset).await?;
        let mut seen = self.read_word(&place).await?;
        for _ in 0..64 {
            if seen == 0 {
                return Ok(());
            }
            let got = self.cas(&place, seen, 0).await?;
            if got == seen {
                return Ok(());
            }
            seen = got;
        }
        Err(ManagerError::Unavailable(format!(
            "the word at {offset} of the lock region keeps changing; is a stale client using it?"
        )))
    }

    /// Checks that `caller` may use `name` with `mask` permission.
    async fn check(&self, caller: &Caller, name: &str, mask: u32, what: &str) -> Result<()> {
        self.manager()
            .read(|s| s.sync_check(caller, name, mask, what))
            .await
    }

    fn mutex_rt(&self, name: &str, offset: u64) -> Result<Arc<MutexRt>> {
        let mut rt = self.inner.runtime.lock().map_err(|_| poisoned())?;
        let entry = rt
            .mutexes
            .entry(name.to_owned())
            .or_insert_with(|| Self::new_mutex(offset));
        if entry.offset != offset {
            *entry = Self::new_mutex(offset);
        }
        Ok(Arc::clone(entry))
    }

    fn new_mutex(offset: u64) -> Arc<MutexRt> {
        Arc::new(MutexRt {
            offset,
            ops: tokio::sync::Mutex::new(()),
            queue: StdMutex::new(VecDeque::new()),
        })
    }

    fn barrier_rt(&self, name: &str, n: u32) -> Result<Arc<BarrierRt>> {
        let mut rt = self.inner.runtime.lock().map_err(|_| poisoned())?;
        let new = || {
            Arc::new(BarrierRt {
                n,
                arrived: StdMutex::new(0),
                done: watch::channel((0, false)).0,
            })
        };
        let entry = rt.barriers.entry(name.to_owned()).or_insert_with(new);
        if entry.n != n {
            entry.done.send_modify(|d| d.1 = true);
            *entry = new();
        }
        Ok(Arc::clone(entry))
    }

    fn bell_rt(&self, name: &str) -> Result<Arc<BellRt>> {
        let mut rt = self.inner.runtime.lock().map_err(|_| poisoned())?;
        Ok(Arc::clone(rt.bells.entry(name.to_owned()).or_insert_with(
            || {
                Arc::new(BellRt {
                    rings: watch::channel((0, false)).0,
                    seen: StdMutex::new(HashMap::new()),
                })
            },
        )))
    }

    // ---- barriers ----

    /// Waits until the round this caller joins completes; returns its generation (from 1).
    pub async fn barrier_wait(&self, name: &str) -> Result<u64> {
        let n = match self.def(name).await? {
            SyncDef::Barrier { n } => n,
            SyncDef::BarrierWord { n, offset } => {
                let rt = self.word_barrier_rt(name, offset)?;
                let place = self.word_place(offset).await?;
                return self.barrier_arrive(name, n, &rt, &place).await;
            }
            _ => return Err(ManagerError::Invalid(format!("{name:?} is not a barrier"))),
        };
        let rt = self.barrier_rt(name, n)?;
        let (round, mut rx) = {
            let mut arrived = rt.arrived.lock().map_err(|_| poisoned())?;
            let round = rt.done.borrow().0;
            *arrived += 1;
            if *arrived >= rt.n {
                *arrived = 0;
                rt.done.send_modify(|d| d.0 += 1);
                return Ok(round + 1);
            }
            (round, rt.done.subscribe())
        };
        let mut guard = ArrivalGuard {
            rt: Arc::clone(&rt),
            round,
            armed: true,
        };
        let seen = *rx
            .wait_for(|(done, deleted)| *done > round || *deleted)
            .await
            .map_err(|_| ManagerError::NotFound(format!("barrier {name:?} (deleted)")))?;
        guard.armed = false;
        if seen.0 > round {
            Ok(round + 1)
        } else {
            Err(ManagerError::NotFound(format!(
                "barrier {name:?} (deleted while waiting)"
            )))
        }
    }

    fn word_barrier_rt(&self, name: &str, offset: u64) -> Result<Arc<WordBarrierRt>> {
        let mut rt = self.inner.runtime.lock().map_err(|_| poisoned())?;
        let new = || {
            Arc::new(WordBarrierRt {
                offset,
                ops: tokio::sync::Mutex::new(()),
                targets: StdMutex::new(BTreeMap::new()),
                seen: watch::channel((0, false)).0,
            })
        };
        let entry = rt.word_barriers.entry(name.to_owned()).or_insert_with(new);
        if entry.offset != offset {
            entry.seen.send_modify(|s| s.1 = true);
            *entry = new();
        }
        Ok(Arc::clone(entry))
    }

    /// Barrier `name`'s parties, sleepers and arrival word (`ENOTSUP` without a word).
    async fn word_barrier(&self, name: &str) -> Result<(u32, Arc<WordBarrierRt>, WordPlace)> {
        match self.def(name).await? {
            SyncDef::BarrierWord { n, offset } => {
                let rt = self.word_barrier_rt(name, offset)?;
                let place = self.word_place(offset).await?;
                Ok((n, rt, place))
            }
            SyncDef::Barrier { .. } => Err(ManagerError::NotSupported(format!(
                "barrier {name:?} has no arrival word (made by an older manager); wait with \
                 BarrierWait, or delete and create it again"
            ))),
            _ => Err(ManagerError::Invalid(format!("{name:?} is not a barrier"))),
        }
    }

    /// Where barrier `name`'s arrival word is, with a capability for its region.
    pub async fn barrier_locate(&self, caller: &Caller, name: &str) -> Result<v1::MutexLocation> {
        // Issued before the lease check: a fence that comes after the check revokes it.
        let issued = crate::capability::tick();
        self.manager()
            .read(|s| s.check_lease(caller.host_id))
            .await?;
        let (n, _, place) = self.word_barrier(name).await?;
        let mut location = self.location(caller, place, issued)?;
        location.n = n;
        Ok(location)
    }

    /// Tells the sleepers of `rt` what the word holds.
    fn publish(rt: &WordBarrierRt, word: u64) {
        rt.seen.send_if_modified(|s| {
            let mut changed = false;
            if word & DELETED != 0 && !s.1 {
                s.1 = true;
                changed = true;
            }
            if word & COUNT_MASK > s.0 {
                s.0 = word & COUNT_MASK;
                changed = true;
            }
            changed
        });
    }

    /// Arrives at a barrier with a word for a caller without direct access to it.
    async fn barrier_arrive(
        &self,
        name: &str,
        n: u32,
        rt: &Arc<WordBarrierRt>,
        place: &WordPlace,
    ) -> Result<u64> {
        let old = self.fetch_add(place, 1).await?;
        if old & DELETED != 0 {
            return Err(ManagerError::NotFound(format!(
                "barrier {name:?} (deleted)"
            )));
        }
        let n = u64::from(n.max(1));
        let arrived = old & COUNT_MASK;
        let generation = arrived / n + 1;
        let target = generation * n;
        if arrived + 1 == target {
            Self::publish(rt, arrived + 1);
            if old & SLEEPERS != 0
                && let Err(e) = self.barrier_wake(name).await
            {
                tracing::debug!(barrier = name, error = %e, "cannot clear a barrier's sleepers bit");
            }
            return Ok(generation);
        }
        self.barrier_sleep_rt(name, rt, place, generation, target)
            .await
    }

    /// Waits until round `generation` of barrier `name` is complete.
    pub async fn barrier_sleep(&self, name: &str, generation: u64) -> Result<u64> {
        let (n, rt, place) = self.word_barrier(name).await?;
        let target = generation
            .checked_mul(u64::from(n))
            .filter(|t| *t > 0 && *t <= COUNT_MASK)
            .ok_or_else(|| {
                ManagerError::Invalid(format!(
                    "round {generation} of barrier {name:?}: rounds count from 1"
                ))
            })?;
        self.barrier_sleep_rt(name, &rt, &place, generation, target)
            .await
    }

    /// Waits until the word counts `target` arrivals: sets SLEEPERS so the completing
    /// arrival wakes us, and rereads the word on a tick in case it never does.
    async fn barrier_sleep_rt(
        &self,
        name: &str,
        rt: &Arc<WordBarrierRt>,
        place: &WordPlace,
        generation: u64,
        target: u64,
    ) -> Result<u64> {
        let deleted =
            || ManagerError::NotFound(format!("barrier {name:?} (deleted while waiting)"));
        let mut rx = rt.seen.subscribe();
        let _guard = {
            let _ops = rt.ops.lock().await;
            let mut v = self.read_word(place).await?;
            loop {
                Self::publish(rt, v);
                if v & DELETED != 0 {
                    return Err(deleted());
                }
                if v & COUNT_MASK >= target {
                    return Ok(generation);
                }
                if v & SLEEPERS != 0 {
                    break;
                }
                let got = self.cas(place, v, v | SLEEPERS).await?;
                if got == v {
                    break;
                }
                v = got;
            }
            *rt.targets
                .lock()
                .map_err(|_| poisoned())?
                .entry(target)
                .or_insert(0) += 1;
            SleeperGuard {
                rt: Arc::clone(rt),
                target,
            }
        };
        loop {
            let (count, gone) = *rx.borrow_and_update();
            if count >= target {
                return Ok(generation);
            }
            if gone {
                return Err(deleted());
            }
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return Err(deleted());
                    }
                }
                () = tokio::time::sleep(BARRIER_TICK) => match self.read_word(place).await {
                    Ok(v) => Self::publish(rt, v),
                    Err(e) => tracing::debug!(barrier = name, error = %e, "cannot reread a barrier word"),
                },
            }
        }
    }

    /// A caller completed a round of `name` and saw SLEEPERS: wakes the sleepers and clears
    /// the bit unless some sleeper waits for a later round. Returns the arrivals.
    pub async fn barrier_wake(&self, name: &str) -> Result<u64> {
        let (_, rt, place) = self.word_barrier(name).await?;
        let _ops = rt.ops.lock().await;
        let mut v = self.read_word(&place).await?;
        loop {
            Self::publish(&rt, v);
            let count = v & COUNT_MASK;
            if v & SLEEPERS == 0 || v & DELETED != 0 {
                return Ok(count);
            }
            let later = rt
                .targets
                .lock()
                .map_err(|_| poisoned())?
                .range(count + 1..)
                .next()
                .is_some();
            if later {
                return Ok(count);
            }
            let got = self.cas(&place, v, v & !SLEEPERS).await?;
            if got == v {
                return Ok(count);
            }
            v = got;
        }
    }

    // ---- doorbells ----

    pub async fn bell_ring(&self, name: &str) -> Result<u64> {
        let SyncDef::Bell = self.def(name).await? else {
            return Err(ManagerError::Invalid(format!("{name:?} is not a doorbell")));
        };
        let rt = self.bell_rt(name)?;
        let mut count = 0;
        rt.rings.send_modify(|r| {
            r.0 += 1;
            count = r.0;
        });
        Ok(count)
    }

    pub async fn bell_wait(&self, caller: &Caller, name: &str) -> Result<u64> {
        let SyncDef::Bell = self.def(name).await? else {
            return Err(ManagerError::Invalid(format!("{name:?} is not a doorbell")));
        };
        let rt = self.bell_rt(name)?;
        let key = (caller.host_id, caller.pid);
        let last = rt
            .seen
            .lock()
            .map_err(|_| poisoned())?
            .get(&key)
            .copied()
            .unwrap_or(0);
        let mut rx = rt.rings.subscribe();
        let (count, deleted) = *rx
            .wait_for(|(count, deleted)| *count > last || *deleted)
            .await
            .map_err(|_| ManagerError::NotFound(format!("doorbell {name:?} (deleted)")))?;
        if count <= last && deleted {
            return Err(ManagerError::NotFound(format!(
                "doorbell {name:?} (deleted while waiting)"
            )));
        }
        rt.seen.lock().map_err(|_| poisoned())?.insert(key, count);
        Ok(count)
    }

    // ---- mutexes ----

    async fn word_place(&self, offset: u64) -> Result<WordPlace> {
        self.manager().read(move |s| s.lock_word(offset)).await
    }

    /// Compare-and-swap on a lock word; returns the old value.
    async fn cas(&self, place: &WordPlace, expected: u64, new: u64) -> Result<u64> {
        let addr = Self::word_host(place)?;
        let at = Self::word_at(place);
        self.inner
            .words
            .compare_and_swap(addr, &at, expected, new)
            .await
            .map_err(|e| Self::unreachable_word(place, e))
    }

    /// Fetch-add on a word; returns the old value.
    async fn fetch_add(&self, place: &WordPlace, addend: u64) -> Result<u64> {
        let addr = Self::word_host(place)?;
        let at = Self::word_at(place);
        self.inner
            .words
            .fetch_add(addr, &at, addend)
            .await
            .map_err(|e| Self::unreachable_word(place, e))
    }

    /// The value of a word.
    async fn read_word(&self, place: &WordPlace) -> Result<u64> {
        self.fetch_add(place, 0).await
    }

    /// The transport address of the daemon holding the word.
    fn word_host(place: &WordPlace) -> Result<&str> {
        if place.transport_addr.is_empty() {
            return Err(ManagerError::Store(format!(
                "host {} holding the lock region is unknown",
                place.host_id
            )));
        }
        Ok(&place.transport_addr)
    }

    fn word_at(place: &WordPlace) -> WordAt {
        WordAt {
            ino: place.ino,
            region_offset: place.region_offset,
            pool: place.pool,
            pool_offset: place.pool_offset,
        }
    }

    fn unreachable_word(place: &WordPlace, e: crate::word_client::WordError) -> ManagerError {
        ManagerError::Unavailable(format!(
            "cannot reach the lock word at host {}: {e}",
            place.host_id
        ))
    }

    async fn mutex(&self, name: &str) -> Result<(Arc<MutexRt>, WordPlace)> {
        let SyncDef::Mutex { offset } = self.def(name).await? else {
            return Err(ManagerError::Invalid(format!("{name:?} is not a mutex")));
        };
        let rt = self.mutex_rt(name, offset)?;
        let place = self.word_place(offset).await?;
        Ok((rt, place))
    }

    /// Where the lock word of `name` is, with a capability for its region.
    pub async fn mutex_locate(&self, caller: &Caller, name: &str) -> Result<v1::MutexLocation> {
        // A host that lost its lease gets no new capability for a word (it is fenced); the
        // token's issue time comes first, so a fence after the check revokes it.
        let issued = crate::capability::tick();
        self.manager()
            .read(|s| s.check_lease(caller.host_id))
            .await?;
        let (_, place) = self.mutex(name).await?;
        self.location(caller, place, issued)
    }

    /// The location of a word for `caller` (its tag names the process: tid 0).
    fn location(
        &self,
        caller: &Caller,
        place: WordPlace,
        issued: u64,
    ) -> Result<v1::MutexLocation> {
        // The token reaches this object's slot only, not the other words of the lock region.
        let slot = place.region_offset - place.region_offset % SLOT_STRIDE;
        let (capability, capability_expires_ms) = self.inner.minter.mint_range(
            place.ino,
            true,
            slot,
            SLOT_STRIDE,
            issued,
            caller.host_id,
        );
        Ok(v1::MutexLocation {
            ino: place.ino,
            region_offset: place.region_offset,
            pool: place.pool,
            pool_offset: place.pool_offset,
            host_id: place.host_id,
            transport_addr: place.transport_addr,
            tag: tag(caller.host_id, caller.pid, 0)?,
            lease_ms: self.manager().config().lease.as_millis() as u64,
            capability,
            capability_expires_ms,
            n: 0,
        })
    }

    /// Locks `name` for thread `tid` of `caller`, queueing in FIFO order behind other
    /// waiters.
    pub async fn mutex_lock(&self, caller: &Caller, tid: u32, name: &str) -> Result<u64> {
        self.manager()
            .read(|s| s.check_lease(caller.host_id))
            .await?;
        let (rt, place) = self.mutex(name).await?;
        let me = tag(caller.host_id, caller.pid, tid)?;
        let lease = self.manager().config().lease.as_millis() as u64;
        let deleted = || ManagerError::NotFound(format!("mutex {name:?} (deleted while waiting)"));
        let (id, mut granted) = {
            let _ops = rt.ops.lock().await;
            let mut seen = self.cas(&place, 0, me).await?;
            loop {
                if seen == 0 {
                    return Ok(lease);
                }
                if seen & DELETED != 0 {
                    return Err(deleted());
                }
                if seen & WAITERS != 0 {
                    break;
                }
                let got = self.cas(&place, seen, seen | WAITERS).await?;
                if got == seen {
                    break;
                }
                seen = if got == 0 {
                    self.cas(&place, 0, me).await?
                } else {
                    got
                };
            }
            let (tx, rx) = oneshot::channel();
            let id = self.inner.next_waiter.fetch_add(1, Ordering::Relaxed);
            rt.queue.lock().map_err(|_| poisoned())?.push_back(Waiter {
                id,
                tag: me,
                grant: tx,
            });
            (id, rx)
        };
        let _guard = QueueGuard {
            rt: Arc::clone(&rt),
            id,
        };
        loop {
            tokio::select! {
                got = &mut granted => return got.map(|()| lease).map_err(|_| deleted()),
                // A delete that raced with this call may have missed our queue entry.
                () = tokio::time::sleep(BARRIER_TICK * 10) => {
                    if let Ok(word) = self.read_word(&place).await && word & DELETED != 0 {
                        return Err(deleted());
                    }
                }
            }
        }
    }

    /// Unlocks `name` held by thread `tid` of `caller`, handing it to the next waiter.
    pub async fn mutex_unlock(&self, caller: &Caller, tid: u32, name: &str) -> Result<()> {
        let (rt, place) = self.mutex(name).await?;
        let me = tag(caller.host_id, caller.pid, tid)?;
        let _ops = rt.ops.lock().await;
        let word = self.read_word(&place).await?;
        if word & DELETED != 0 {
            return Err(ManagerError::NotFound(format!("mutex {name:?} (deleted)")));
        }
        if word & !WAITERS != me {
            return Err(ManagerError::Perm(format!(
                "mutex {name:?} is not held by thread {tid} of process {} on host {} (lock word {word:#x})",
                caller.pid, caller.host_id
            )));
        }
        self.hand_off(&rt, &place, word).await
    }

    /// Gives the word (holding `word`) to the next live waiter, or frees it. Holds `rt.ops`.
    async fn hand_off(&self, rt: &MutexRt, place: &WordPlace, mut word: u64) -> Result<()> {
        loop {
            if word & DELETED != 0 {
                return Ok(());
            }
            let (next, more) = {
                let mut q = rt.queue.lock().map_err(|_| poisoned())?;
                let mut next = None;
                while let Some(w) = q.pop_front() {
                    if !w.grant.is_closed() {
                        next = Some(w);
                        break;
                    }
                }
                (next, !q.is_empty())
            };
            let Some(waiter) = next else {
                let got = self.cas(place, word, 0).await?;
                if got == word || got == 0 {
                    return Ok(());
                }
                word = got;
                continue;
            };
            let new = waiter.tag | if more { WAITERS } else { 0 };
            let got = self.cas(place, word, new).await?;
            if got != word {
                // Changed under us (cannot happen while we hold `ops`, but stay correct).
                if let Ok(mut q) = rt.queue.lock() {
                    q.push_front(waiter);
                }
                word = got;
                continue;
            }
            match waiter.grant.send(()) {
                Ok(()) => return Ok(()),
                // The waiter left after all: pass the word on.
                Err(()) => word = new,
            }
        }
    }

    /// Releases every mutex whose holder matches `dead`, and drops queued waiters matching it.
    async fn release_matching(&self, what: &str, dead: impl Fn(u64) -> bool) -> Result<usize> {
        let mutexes: Vec<(String, u64)> = self
            .manager()
            .read(|s| {
                Ok(s.sync
                    .defs
                    .iter()
                    .filter_map(|(name, d)| match d {
                        SyncDef::Mutex { offset } => Some((name.clone(), *offset)),
                        _ => None,
                    })
                    .collect())
            })
            .await?;
        let mut released = 0;
        for (name, offset) in mutexes {
            let rt = self.mutex_rt(&name, offset)?;
            if let Ok(mut q) = rt.queue.lock() {
                q.retain(|w| !dead(w.tag));
            }
            let place = match self.word_place(offset).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(mutex = %name, error = %e, "cannot find a lock word to release");
                    continue;
                }
            };
            let _ops = rt.ops.lock().await;
            let word = match self.cas(&place, 0, 0).await {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(mutex = %name, error = %e, "cannot read a lock word to release");
                    continue;
                }
            };
            if word != 0 && word & DELETED == 0 && dead(word & !WAITERS) {
                tracing::warn!(mutex = %name, holder = format!("{:#x}", word & !WAITERS), "{what}: releasing the mutex it held");
                self.hand_off(&rt, &place, word).await?;
                released += 1;
            }
        }
        Ok(released)
    }

    /// Processes `pids` of `host` exited: any thread of theirs loses its mutexes.
    pub async fn release_dead(&self, host: u32, pids: &[u32]) -> Result<usize> {
        let pid_set: HashSet<u32> = pids.iter().copied().collect();
        if let Ok(rt) = self.inner.runtime.lock() {
            for bell in rt.bells.values() {
                if let Ok(mut seen) = bell.seen.lock() {
                    seen.retain(|(h, p), _| !(*h == host && pids.contains(p)));
                }
            }
        }
        self.release_matching("holder process exited", |t| {
            tag_host(t) == host && pid_set.contains(&tag_pid(t))
        })
        .await
    }

    /// Deletes `name`; its waiters get `ENOENT`, a mutex's or barrier's word is marked
    /// [`DELETED`].
    pub async fn delete(&self, caller: &Caller, name: &str) -> Result<()> {
        let owned = name.to_owned();
        let who = caller.clone();
        let def = self
            .manager()
            .write(move |s| s.sync_delete(&who, &owned))
            .await?;
        let (mutex, barrier) = {
            let mut rt = self.inner.runtime.lock().map_err(|_| poisoned())?;
            if let Some(b) = rt.barriers.remove(name) {
                b.done.send_modify(|d| d.1 = true);
            }
            if let Some(b) = rt.bells.remove(name) {
                b.rings.send_modify(|r| r.1 = true);
            }
            (rt.mutexes.remove(name), rt.word_barriers.remove(name))
        };
        match def {
            SyncDef::Mutex { offset } => {
                let _ops = match &mutex {
                    Some(rt) => Some(rt.ops.lock().await),
                    None => None,
                };
                self.poison(name, offset).await;
                if let Some(rt) = &mutex
                    && let Ok(mut q) = rt.queue.lock()
                {
                    q.clear(); // waiters see their grant dropped: ENOENT
                }
            }
            SyncDef::BarrierWord { offset, .. } => {
                let _ops = match &barrier {
                    Some(rt) => Some(rt.ops.lock().await),
                    None => None,
                };
                self.poison(name, offset).await;
                if let Some(rt) = &barrier {
                    rt.seen.send_modify(|s| s.1 = true);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Sets [`DELETED`] in the word at `offset` (best effort: logged on failure).
    async fn poison(&self, name: &str, offset: u64) {
        let place = match self.word_place(offset).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(name, error = %e, "cannot find a deleted object's word");
                return;
            }
        };
        let mut v = 0;
        loop {
            match self.cas(&place, v, v | DELETED).await {
                Ok(got) if got == v || got & DELETED != 0 => return,
                Ok(got) => v = got,
                Err(e) => {
                    tracing::warn!(name, error = %e, "cannot mark a deleted object's word");
                    return;
                }
            }
        }
    }

    /// Releases the mutexes held on hosts whose lease ended, checking every quarter lease
    /// until the manager shuts down.
    pub async fn run_host_expiry(self) {
        let lease = self.manager().config().lease;
        let tick = (lease / 4).clamp(Duration::from_millis(50), Duration::from_millis(500));
        let started = tokio::time::Instant::now();
        let mut closing = self.manager().closing();
        let mut handled: HashSet<u32> = HashSet::new();
        loop {
            tokio::select! {
                () = tokio::time::sleep(tick) => {}
                _ = closing.wait_for(|c| *c) => return,
            }
            let grace_over = started.elapsed() >= lease;
            // Only once the host is fenced at the live daemons: its holders cannot touch the
            // words (or any memory) with their old capabilities any more.
            let expired = match self
                .manager()
                .read(|s| {
                    Ok(s.expired_hosts(grace_over)
                        .into_iter()
                        .filter(|h| s.fence_settled.contains(h))
                        .collect::<Vec<u32>>())
                })
                .await
            {
                Ok(e) => e,
                Err(_) => continue,
            };
            handled.retain(|h| expired.contains(h));
            for host in expired {
                if handled.contains(&host) {
                    continue;
                }
                match self
                    .release_matching("host lease expired", |t| tag_host(t) == host)
                    .await
                {
                    Ok(_) => {
                        handled.insert(host);
                    }
                    Err(e) => {
                        tracing::warn!(host, error = %e, "cannot release a dead host's mutexes")
                    }
                }
            }
        }
    }
}

/// Turns a manager result into a reply, logging refusals.
fn reply<T>(op: &'static str, result: Result<T>) -> Result<Response<T>, Status> {
    match result {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            tracing::debug!(op, error = %e, "sync request refused");
            Err(e.into())
        }
    }
}

fn value(v: u64) -> v1::SyncReply {
    v1::SyncReply {
        value: i64::try_from(v).unwrap_or(i64::MAX),
    }
}

fn caller(c: Option<&v1::Caller>) -> Result<Caller, Status> {
    Caller::from_proto(c).map_err(Status::from)
}

#[tonic::async_trait]
impl Sync for SyncService {
    async fn barrier_init(
        &self,
        r: Request<v1::BarrierInitRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let def = SyncDef::BarrierWord { n: r.n, offset: 0 };
        let result = self.init(&c, &r.name, def, r.mode).await;
        reply("barrier_init", result.map(|_| value(0)))
    }

    async fn barrier_wait(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_wait", Err(e));
        }
        reply("barrier_wait", self.barrier_wait(&r.name).await.map(value))
    }

    async fn mutex_init(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let result = self
            .init(&c, &r.name, SyncDef::Mutex { offset: 0 }, r.mode)
            .await;
        reply("mutex_init", result.map(|_| value(0)))
    }

    async fn mutex_lock(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "lock").await {
            return reply("mutex_lock", Err(e));
        }
        reply(
            "mutex_lock",
            self.mutex_lock(&c, r.tid, &r.name).await.map(value),
        )
    }

    async fn mutex_unlock(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "unlock").await {
            return reply("mutex_unlock", Err(e));
        }
        let result = self.mutex_unlock(&c, r.tid, &r.name).await;
        reply("mutex_unlock", result.map(|()| value(0)))
    }

    async fn bell_init(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let result = self.init(&c, &r.name, SyncDef::Bell, r.mode).await;
        reply("bell_init", result.map(|_| value(0)))
    }

    async fn bell_ring(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, WRITE, "ring").await {
            return reply("bell_ring", Err(e));
        }
        reply("bell_ring", self.bell_ring(&r.name).await.map(value))
    }

    async fn bell_wait(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ, "wait on").await {
            return reply("bell_wait", Err(e));
        }
        reply("bell_wait", self.bell_wait(&c, &r.name).await.map(value))
    }

    async fn delete(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        reply("delete", self.delete(&c, &r.name).await.map(|()| value(0)))
    }

    async fn mutex_locate(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::MutexLocation>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "lock").await {
            return reply("mutex_locate", Err(e));
        }
        reply("mutex_locate", self.mutex_locate(&c, &r.name).await)
    }

    async fn barrier_locate(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::MutexLocation>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_locate", Err(e));
        }
        reply("barrier_locate", self.barrier_locate(&c, &r.name).await)
    }

    async fn barrier_sleep(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_sleep", Err(e));
        }
        let result = self.barrier_sleep(&r.name, r.generation).await;
        reply("barrier_sleep", result.map(value))
    }

    async fn barrier_wake(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_wake", Err(e));
        }
        reply("barrier_wake", self.barrier_wake(&r.name).await.map(value))
    }

    async fn release_dead(
        &self,
        r: Request<v1::ReleaseDeadRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let result = self.release_dead(c.host_id, &r.pids).await;
        reply("release_dead", result.map(|n| value(n as u64)))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::cluster::HostRegistration;

    use super::*;

    fn state() -> State {
        let mut s = State::new(Duration::from_secs(10), 0o1777);
        s.register_host(&HostRegistration {
            host_id: 1,
            transport_addr: "127.0.0.1:1".into(),
            agent_socket: String::new(),
            memory_offered: 8 * CHUNK_SIZE,
            incarnation: 1,
        })
        .unwrap();
        s.register_pool(1, 0, 8 * CHUNK_SIZE).unwrap();
        s
    }

    #[test]
    fn sync_objects_belong_to_their_creator() {
        let mut s = state();
        let user = |uid: u32| Caller {
            uid,
            gid: uid,
            host_id: 1,
            ..Caller::default()
        };
        s.sync_init(&user(1000), "mine", SyncDef::Bell, None)
            .unwrap();
        s.sync_init(&user(1000), "ours", SyncDef::Bell, Some(0o662))
            .unwrap();
        assert_eq!(
            s.sync.owners["mine"],
            SyncOwner {
                uid: 1000,
                gid: 1000,
                mode: DEFAULT_SYNC_MODE
            }
        );
        let other = user(1001);
        for (name, mask, errno) in [
            ("mine", READ, Some(libc::EACCES)),
            ("mine", WRITE, Some(libc::EACCES)),
            ("ours", WRITE, None),
            ("ours", READ, Some(libc::EACCES)),
        ] {
            let r = s.sync_check(&other, name, mask, "use");
            assert_eq!(r.err().map(|e| e.errno()), errno, "{name} mask {mask}");
        }
        assert_eq!(
            s.sync_init(&other, "mine", SyncDef::Bell, None)
                .unwrap_err()
                .errno(),
            libc::EACCES,
            "init of an existing object is a use"
        );
        assert!(
            s.sync_check(&Caller::root(1), "mine", READ | WRITE, "use")
                .is_ok()
        );
        assert_eq!(
            s.sync_delete(&other, "ours").unwrap_err().errno(),
            libc::EPERM
        );
        // Owners survive the store; records from before owners load as root's, mode 0666.
        let bytes = record_of(&s, "ours").unwrap().unwrap();
        let legacy = postcard::to_allocvec(&SyncDef::Bell).unwrap();
        let mut t = state();
        load_record(&mut t, "ours", &bytes).unwrap();
        load_record(&mut t, "legacy", &legacy).unwrap();
        assert_eq!(t.sync.owners["ours"], s.sync.owners["ours"]);
        assert_eq!(t.sync.owners["legacy"], SyncOwner::LEGACY);
        assert!(t.sync_check(&other, "legacy", READ | WRITE, "use").is_ok());
        s.sync_delete(&user(1000), "ours").unwrap();
        assert!(!s.sync.owners.contains_key("ours"));
    }

    #[test]
    fn deleted_slots_are_reused_after_a_capability_lifetime() {
        let mut s = state();
        let c = Caller::root(1);
        let barrier = |n| SyncDef::BarrierWord { n, offset: 0 };
        let mutex = SyncDef::Mutex { offset: 0 };
        assert_eq!(
            s.sync_init(&c, "b", barrier(0), None).unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(
            s.sync_init(&c, "b", barrier(2), None).unwrap(),
            SyncDef::BarrierWord { n: 2, offset: 0 }
        );
        assert_eq!(
            s.sync_init(&c, "b", barrier(2), None).unwrap(),
            SyncDef::BarrierWord { n: 2, offset: 0 },
            "same parameters: the existing barrier"
        );
        assert_eq!(
            s.sync_init(&c, "b", barrier(3), None).unwrap_err().errno(),
            libc::EEXIST
        );
        assert_eq!(
            s.sync_init(&c, "b", mutex.clone(), None)
                .unwrap_err()
                .errno(),
            libc::EEXIST
        );
        assert_eq!(
            s.sync_init(&c, "m", mutex.clone(), None).unwrap(),
            SyncDef::Mutex {
                offset: SLOT_STRIDE
            }
        );
        s.sync_delete(&c, "m").unwrap();
        s.sync_delete(&c, "b").unwrap();
        assert_eq!(s.sync_def("m").unwrap_err().errno(), libc::ENOENT);
        assert_eq!(
            s.sync_init(&c, "m", mutex.clone(), None).unwrap(),
            SyncDef::Mutex {
                offset: 2 * SLOT_STRIDE
            },
            "a deleted object's slot is not reused while tokens for it may live"
        );
        let place = s.lock_word(2 * SLOT_STRIDE).unwrap();
        assert_eq!((place.host_id, place.region_offset), (1, 2 * SLOT_STRIDE));
        // The freed slots wait one capability lifetime, and the free list is stored.
        let free: Vec<FreeSlot> = s
            .sync
            .lock_region
            .as_ref()
            .unwrap()
            .free
            .iter()
            .map(|r| FreeSlot::unpack(*r))
            .collect();
        assert_eq!(free.iter().map(|f| f.index).collect::<Vec<_>>(), vec![1, 0]);
        assert!(free.iter().all(|f| f.after_secs > unix_secs() + 500));
        assert_eq!(s.take_reusable_slot(), None);
        let stored = record_of(&s, LOCK_REGION_KEY).unwrap().unwrap();
        let mut t = state();
        load_record(&mut t, LOCK_REGION_KEY, &stored).unwrap();
        assert_eq!(t.sync.lock_region, s.sync.lock_region);
        // Once they are due, they are handed out (and used by init) before new ones.
        s.sync.lock_region.as_mut().unwrap().free = free
            .iter()
            .map(|f| {
                FreeSlot {
                    after_secs: 0,
                    ..*f
                }
                .pack()
            })
            .collect();
        let slot = s.take_reusable_slot().unwrap();
        assert_eq!(slot, SLOT_STRIDE);
        assert_eq!(
            s.sync_init_in(&c, "reused", mutex, None, Some(slot))
                .unwrap(),
            SyncDef::Mutex {
                offset: SLOT_STRIDE
            }
        );
        assert_eq!(s.take_reusable_slot(), Some(0));
        assert_eq!(s.take_reusable_slot(), None);
        assert_eq!(
            FreeSlot::unpack(
                FreeSlot {
                    index: 7,
                    after_secs: 9
                }
                .pack()
            )
            .index,
            7
        );
    }

    #[test]
    fn stored_barriers_without_words_still_load_and_match() {
        let mut s = state();
        // A record written before barriers had words.
        let legacy = postcard::to_allocvec(&SyncDef::Barrier { n: 2 }).unwrap();
        load_record(&mut s, "old", &legacy).unwrap();
        assert_eq!(s.sync_def("old").unwrap(), SyncDef::Barrier { n: 2 });
        let c = Caller::root(1);
        assert_eq!(
            s.sync_init(&c, "old", SyncDef::BarrierWord { n: 2, offset: 0 }, None)
                .unwrap(),
            SyncDef::Barrier { n: 2 }
        );
        assert_eq!(
            s.sync_init(&c, "old", SyncDef::BarrierWord { n: 3, offset: 0 }, None)
                .unwrap_err()
                .errno(),
            libc::EEXIST
        );
        // New definitions and the lock region round-trip through their records.
        s.sync_init(&c, "new", SyncDef::BarrierWord { n: 4, offset: 0 }, None)
            .unwrap();
        let mut t = state();
        for key in ["new", LOCK_REGION_KEY] {
            let bytes = record_of(&s, key).unwrap().unwrap();
            load_record(&mut t, key, &bytes).unwrap();
        }
        assert_eq!(t.sync.defs["new"], s.sync.defs["new"]);
        assert_eq!(t.sync.lock_region, s.sync.lock_region);
    }

    #[test]
    fn tags_out_of_range_are_refused_clearly() {
        assert_eq!(tag(1 << 16, 1, 1).unwrap_err().errno(), libc::EINVAL);
        let err = tag(1, 1 << 22, 0).unwrap_err();
        assert!(err.to_string().contains("pid_max"), "{err}");
        let t = tag(3, 4, 5).unwrap();
        assert_eq!((tag_host(t | WAITERS), tag_pid(t)), (3, 4));
    }
}
