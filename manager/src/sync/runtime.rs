//! The sync runtime: callers waiting on mutexes, barriers and doorbells, in memory, and the
//! manager's operations on lock words through the daemon that holds them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use regions_proto::auth::Secret;
use regions_proto::v1;
use tokio::sync::{oneshot, watch};

use super::objects::*;
use crate::access::Caller;
use crate::capability::Minter;
use crate::error::{ManagerError, Result};
use crate::manager::Manager;
use crate::word_client::{WordAt, WordClient};

/// How often a barrier sleeper rereads its word in case no wake comes.
const BARRIER_TICK: Duration = Duration::from_millis(100);

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
    pub(super) async fn check(
        &self,
        caller: &Caller,
        name: &str,
        mask: u32,
        what: &str,
    ) -> Result<()> {
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
        let issued = crate::revocations::tick();
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
        let issued = crate::revocations::tick();
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
