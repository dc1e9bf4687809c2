//! The pools of this daemon and their chunk table: which region chunk backs each 128 KiB chunk
//! of each pool window, kept in step with the manager's events.
//!
//! Concurrency: every chunk of every pool has its own read-write lock around its
//! [`Backing`]. Transport requests *pin* the chunks they touch (read locks, taken in ascending
//! (pool, chunk) order, each at most once) for as long as they move bytes; event application
//! takes the write locks of the chunks it changes (ascending too, one event at a time, under
//! [`Pools`]' apply mutex), so a chunk is never remapped under a request, and a request never
//! touches a `PROT_NONE` page. Transport requests never block on the network while holding
//! pins (see [`crate::transport::rawio`]), so a slow client cannot hold up the manager's events.
//!
//! Segments are reference counted per region chunk: a region chunk's pages are punched (given
//! back to the kernel) only when no pool chunk maps it any more, and a segment with no chunk left
//! is closed.

pub mod memfd;
pub mod segment;
pub mod window;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use regions_proto::capability::{Capability, WHOLE_REGION};
use regions_proto::frame::Range;
use regions_proto::layout::{CHUNK_SIZE, chunk_delta};
use regions_proto::word_wait;

use crate::error::{DaemonError, Result};
use crate::pools::segment::Segment;
use crate::pools::window::Window;
use crate::transport::rawio::{self, RawSpan};
use crate::transport::revocations::Revocations;

/// What backs one pool chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backing {
    /// The region.
    pub ino: u64,
    /// Chunk-aligned offset in the region (= offset in its segment).
    pub region_offset: u64,
    /// Changes every time the chunk is (re)assigned: lets a request that dropped its pins
    /// detect that the memory changed meanwhile.
    epoch: u64,
}

/// One pool: a window and its chunk table.
#[derive(Debug)]
pub struct Pool {
    gid: u32,
    /// Per chunk, its RDMA registrations once a client asked for them ([`crate::rdma`]):
    /// made under the chunk's read lock (a pin), dropped under its write lock before the
    /// chunk is unmapped, remapped or has pages punched. Declared before `window` so that a
    /// dropped pool deregisters before it unmaps.
    #[cfg(feature = "rdma")]
    keys: Box<[Mutex<Option<Arc<crate::rdma::ChunkKeys>>>]>,
    /// Whether any chunk of the pool was ever registered (else a truncate need not look).
    #[cfg(feature = "rdma")]
    keyed: std::sync::atomic::AtomicBool,
    window: Window,
    chunks: Box<[RwLock<Option<Backing>>]>,
}

impl Pool {
    /// The pool's global id.
    pub fn gid(&self) -> u32 {
        self.gid
    }

    /// Bytes in the pool.
    pub fn size(&self) -> u64 {
        self.window.len()
    }

    fn read_slot(&self, chunk: usize) -> RwLockReadGuard<'_, Option<Backing>> {
        self.chunks[chunk]
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write_slot(&self, chunk: usize) -> RwLockWriteGuard<'_, Option<Backing>> {
        self.chunks[chunk]
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drops chunk `chunk`'s RDMA registrations (the caller holds its write lock and is
    /// about to unmap or remap it): from now on its old remote keys fail.
    fn drop_keys(&self, chunk: usize) {
        #[cfg(feature = "rdma")]
        if let Some(slot) = self.keys.get(chunk) {
            slot.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
        }
        #[cfg(not(feature = "rdma"))]
        let _ = chunk;
    }
}

/// Wakes requests that wait for chunks to be assigned.
#[derive(Debug, Default)]
struct Changes {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Changes {
    fn current(&self) -> u64 {
        *self
            .generation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bump(&self) {
        let mut g = self
            .generation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *g = g.wrapping_add(1);
        self.changed.notify_all();
    }

    /// Waits until the generation differs from `seen` or `deadline` passes.
    fn wait(&self, seen: u64, deadline: Instant) {
        let mut g = self
            .generation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while *g == seen {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            g = match self.changed.wait_timeout(g, deadline - now) {
                Ok((g, _)) => g,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}

/// A region's segment and which of its chunks are mapped by how many pool chunks.
#[derive(Debug)]
struct SegmentEntry {
    segment: Arc<Segment>,
    /// Region chunk index → number of pool chunks mapping it.
    refs: BTreeMap<u64, u32>,
}

/// All pools of this daemon, their chunk tables and the segments behind them.
#[derive(Debug, Default)]
pub struct Pools {
    pools: RwLock<HashMap<u32, Arc<Pool>>>,
    segments: Mutex<HashMap<u64, SegmentEntry>>,
    /// Serialises event application.
    apply: Mutex<()>,
    changes: Changes,
    next_epoch: AtomicU64,
    /// Capability revocations the transport enforces (they arrive with the chunk events).
    revocations: Revocations,
    /// Pool chunks the manager assigned that this host could not back because a resource ran
    /// out (open files, memory maps), by (gid, chunk): requests there fail at once with that
    /// error instead of waiting for an assignment that will not come, and the assignment is
    /// tried again when room may have come (a release, and every heartbeat). Cleared when the
    /// chunk is backed, released, resynced or its pool removed.
    refused: Mutex<HashMap<(u32, usize), Refusal>>,
    /// Every atomic on pool memory goes through the RDMA device (whose atomics exclude only
    /// one another): processes on this host get no CPU atomics on their segments.
    atomics_through_device: AtomicBool,
}

/// A pool chunk with no backing: what the manager assigned it to, and the errno and message of
/// the [`DaemonError::Limit`] that stopped it.
#[derive(Clone, Debug)]
struct Refusal {
    ino: u64,
    region_offset: u64,
    errno: i32,
    message: Arc<str>,
}

/// Checks that an event's numbers are chunk aligned and non-empty.
fn check_event_range(what: &str, pool_offset: u64, region_offset: u64, len: u64) -> Result<()> {
    let end = region_offset.checked_add(len);
    if len == 0
        || !len.is_multiple_of(CHUNK_SIZE)
        || !pool_offset.is_multiple_of(CHUNK_SIZE)
        || !region_offset.is_multiple_of(CHUNK_SIZE)
        || end.is_none_or(|e| e > i64::MAX as u64)
    {
        return Err(DaemonError::Invalid(format!(
            "{what}: pool offset {pool_offset:#x}, region offset {region_offset:#x}, length \
             {len:#x} are not whole chunks"
        )));
    }
    Ok(())
}

impl Pools {
    /// No pools yet.
    pub fn new() -> Pools {
        Pools::default()
    }

    /// Says that every atomic on pool memory goes through the RDMA device from now on (set
    /// before the host agent hands out any segment).
    pub fn route_atomics_through_device(&self) {
        self.atomics_through_device.store(true, Ordering::SeqCst);
    }

    /// Whether atomics on pool memory must go through the daemon (see
    /// [`Pools::route_atomics_through_device`]).
    pub fn atomics_through_device(&self) -> bool {
        self.atomics_through_device.load(Ordering::SeqCst)
    }

    /// The capability revocations in force on this daemon.
    pub fn revocations(&self) -> &Revocations {
        &self.revocations
    }

    fn lock_apply(&self) -> MutexGuard<'_, ()> {
        self.apply
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether this host may keep a new segment (descriptor `number`) while it holds `held`
    /// others: the open-file limit less a reserve for connections (the host agent and the
    /// transport keep accepting). Descriptors are handed out lowest first, so `number` counts
    /// the daemon's open descriptors, and `held` counts them when lower ones were closed.
    fn check_open_file_room(held: u64, number: u64) -> Result<()> {
        let limit = regions_proto::fd_limit::open_file_limit();
        let reserve = regions_proto::fd_limit::reserve(limit);
        let open = held.max(number);
        if open.saturating_add(reserve) < limit {
            return Ok(());
        }
        Err(DaemonError::Limit {
            errno: libc::ENOSPC,
            message: format!(
                "this host cannot hold memory of another region: its daemon has {open} \
                 descriptors open (one per region it holds), its open-file limit \
                 (RLIMIT_NOFILE) is {limit} and it keeps {reserve} for connections; raise the \
                 daemon's limit (LimitNOFILE=, ulimit -n) or delete regions"
            ),
        })
    }

    fn lock_refused(&self) -> MutexGuard<'_, HashMap<(u32, usize), Refusal>> {
        self.refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_segments(&self) -> MutexGuard<'_, HashMap<u64, SegmentEntry>> {
        self.segments
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn epoch(&self) -> u64 {
        self.next_epoch.fetch_add(1, Ordering::Relaxed)
    }

    /// The pool `gid`.
    pub fn pool(&self, gid: u32) -> Option<Arc<Pool>> {
        self.pools
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&gid)
            .cloned()
    }

    /// Global ids and sizes of the pools, by gid.
    pub fn list(&self) -> Vec<(u32, u64)> {
        let mut out: Vec<(u32, u64)> = self
            .pools
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .map(|p| (p.gid, p.size()))
            .collect();
        out.sort_unstable();
        out
    }

    /// Bytes in all pools.
    pub fn pool_bytes(&self) -> u64 {
        self.list().iter().map(|(_, size)| size).sum()
    }

    /// Bytes of the pools' chunks that back a region now (for metrics: a chunk being assigned
    /// or released at this moment counts as assigned; nothing waits for it).
    pub fn assigned_bytes(&self) -> u64 {
        let pools: Vec<Arc<Pool>> = self
            .pools
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        let assigned = |chunk: &RwLock<Option<Backing>>| match chunk.try_read() {
            Ok(backing) => backing.is_some(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().is_some(),
            Err(std::sync::TryLockError::WouldBlock) => true,
        };
        pools
            .iter()
            .map(|p| p.chunks.iter().filter(|c| assigned(c)).count() as u64 * CHUNK_SIZE)
            .sum()
    }

    /// Adds pool `gid` of `size` bytes (whole chunks), with nothing assigned. Adding a pool
    /// that exists with the same size does nothing.
    pub fn add_pool(&self, gid: u32, size: u64) -> Result<()> {
        let _serial = self.lock_apply();
        if let Some(p) = self.pool(gid) {
            if p.size() == size {
                return Ok(());
            }
            return Err(DaemonError::Invalid(format!(
                "pool {gid} already exists with {} bytes, not {size}",
                p.size()
            )));
        }
        if gid == 0 || size == 0 || !size.is_multiple_of(CHUNK_SIZE) {
            return Err(DaemonError::Invalid(format!(
                "pool {gid} of {size} bytes: gids start at 1 and sizes are whole chunks of \
                 {CHUNK_SIZE} bytes"
            )));
        }
        let chunks = usize::try_from(size / CHUNK_SIZE)
            .map_err(|_| DaemonError::Invalid(format!("pool of {size} bytes is too large")))?;
        let window = Window::reserve(size)?;
        let pool = Pool {
            gid,
            #[cfg(feature = "rdma")]
            keys: (0..chunks).map(|_| Mutex::new(None)).collect(),
            #[cfg(feature = "rdma")]
            keyed: std::sync::atomic::AtomicBool::new(false),
            window,
            chunks: (0..chunks).map(|_| RwLock::new(None)).collect(),
        };
        self.pools
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(gid, Arc::new(pool));
        tracing::info!(gid, size, "pool window reserved");
        self.changes.bump();
        Ok(())
    }

    /// Removes pool `gid`, releasing every chunk it held. Requests for it fail with `ENOENT`
    /// from now on; the window goes away when the last request using it ends.
    pub fn remove_pool(&self, gid: u32) {
        let _serial = self.lock_apply();
        self.lock_refused().retain(|&(g, _), _| g != gid);
        let removed = self
            .pools
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&gid);
        if let Some(pool) = removed {
            for chunk in 0..pool.chunks.len() {
                self.release_chunk(&pool, chunk, None);
            }
            tracing::info!(gid, "pool removed");
            self.changes.bump();
        }
    }

    /// Backs `[pool_offset, pool_offset + len)` of pool `gid` with region `ino` from
    /// `region_offset` (the manager's `Assigned` event). Idempotent.
    pub fn assign(
        &self,
        gid: u32,
        pool_offset: u64,
        ino: u64,
        region_offset: u64,
        len: u64,
    ) -> Result<()> {
        let _serial = self.lock_apply();
        let pool = self.pool(gid).ok_or(DaemonError::UnknownPool { gid })?;
        check_event_range("assigned", pool_offset, region_offset, len)?;
        if pool_offset
            .checked_add(len)
            .is_none_or(|end| end > pool.size())
        {
            return Err(DaemonError::OutOfBounds {
                gid,
                offset: pool_offset,
                len,
                size: pool.size(),
            });
        }
        let result = self.assign_recorded(&pool, pool_offset, ino, region_offset, len);
        self.changes.bump();
        result
    }

    /// [`Self::assign_locked`], then the chunks a limit left unbacked answer requests with it
    /// (and are tried again later); the others forget any earlier refusal. Under `apply`.
    fn assign_recorded(
        &self,
        pool: &Pool,
        pool_offset: u64,
        ino: u64,
        region_offset: u64,
        len: u64,
    ) -> Result<()> {
        let result = self.assign_locked(pool, pool_offset, ino, region_offset, len);
        let first = (pool_offset / CHUNK_SIZE) as usize;
        let mut refused = self.lock_refused();
        for (i, chunk) in (first..first + (len / CHUNK_SIZE) as usize).enumerate() {
            match &result {
                Err(DaemonError::Limit { errno, message }) if pool.read_slot(chunk).is_none() => {
                    refused.insert(
                        (pool.gid, chunk),
                        Refusal {
                            ino,
                            region_offset: region_offset + i as u64 * CHUNK_SIZE,
                            errno: *errno,
                            message: message.as_str().into(),
                        },
                    );
                }
                _ => {
                    refused.remove(&(pool.gid, chunk));
                }
            }
        }
        result
    }

    /// Tries again to back the chunks a limit left unbacked (room may have come: regions
    /// deleted, the limit raised). Cheap when there are none.
    pub fn retry_refused(&self) {
        if self.lock_refused().is_empty() {
            return;
        }
        let _serial = self.lock_apply();
        self.retry_refused_locked();
    }

    /// [`Self::retry_refused`] under `apply`.
    fn retry_refused_locked(&self) {
        let mut waiting: Vec<((u32, usize), Refusal)> = self
            .lock_refused()
            .iter()
            .map(|(k, r)| (*k, r.clone()))
            .collect();
        if waiting.is_empty() {
            return;
        }
        waiting.sort_unstable_by_key(|(k, _)| *k);
        let mut backed = 0;
        for ((gid, chunk), r) in waiting {
            let Some(pool) = self.pool(gid) else {
                self.lock_refused().remove(&(gid, chunk));
                continue;
            };
            let at = chunk as u64 * CHUNK_SIZE;
            match self.assign_recorded(&pool, at, r.ino, r.region_offset, CHUNK_SIZE) {
                Ok(()) => backed += 1,
                // Still no room: the rest would fail the same way.
                Err(DaemonError::Limit { .. }) => break,
                Err(e) => {
                    tracing::warn!(gid, chunk, ino = r.ino, error = %e, "cannot back a refused chunk");
                    self.lock_refused().remove(&(gid, chunk));
                }
            }
        }
        if backed > 0 {
            tracing::info!(
                backed,
                "backed chunks refused earlier for lack of resources"
            );
            self.changes.bump();
        }
    }

    fn assign_locked(
        &self,
        pool: &Pool,
        pool_offset: u64,
        ino: u64,
        region_offset: u64,
        len: u64,
    ) -> Result<()> {
        let first = (pool_offset / CHUNK_SIZE) as usize;
        let count = (len / CHUNK_SIZE) as usize;
        let want = |i: usize| region_offset + i as u64 * CHUNK_SIZE;
        let mut slots: Vec<_> = (first..first + count).map(|c| pool.write_slot(c)).collect();
        let needs: Vec<bool> = slots
            .iter()
            .enumerate()
            .map(|(i, s)| s.is_none_or(|b| (b.ino, b.region_offset) != (ino, want(i))))
            .collect();
        if !needs.contains(&true) {
            return Ok(());
        }
        let mut segments = self.lock_segments();
        let segment = match segments.get(&ino) {
            Some(entry) => Arc::clone(&entry.segment),
            None => {
                let segment = Segment::create(ino)?;
                Self::check_open_file_room(
                    segments.len() as u64,
                    segment.as_fd().as_raw_fd() as u64,
                )?;
                let segment = Arc::new(segment);
                segments.insert(
                    ino,
                    SegmentEntry {
                        segment: Arc::clone(&segment),
                        refs: BTreeMap::new(),
                    },
                );
                segment
            }
        };
        let grown = segment.grow_to(region_offset + len);
        let mut i = 0;
        let mut failure = grown.err();
        while failure.is_none() && i < count {
            if !needs[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < count && needs[i] {
                i += 1;
            }
            let run_offset = pool_offset + start as u64 * CHUNK_SIZE;
            let run_len = (i - start) as u64 * CHUNK_SIZE;
            for c in first + start..first + i {
                pool.drop_keys(c);
            }
            // SAFETY: we hold the write locks of every chunk in the run, so no request reads
            // or writes these pages during the call (and their RDMA registrations are gone).
            let mapped = unsafe {
                pool.window
                    .map(run_offset, run_len, segment.as_fd(), want(start))
            };
            match mapped {
                Ok(()) => {
                    for (j, slot) in slots.iter_mut().enumerate().take(i).skip(start) {
                        // Count the new reference before dropping the old one, so that
                        // moving a chunk within one region never closes its segment.
                        if let Some(entry) = segments.get_mut(&ino) {
                            *entry.refs.entry(want(j) / CHUNK_SIZE).or_insert(0) += 1;
                        }
                        let new = Backing {
                            ino,
                            region_offset: want(j),
                            epoch: self.epoch(),
                        };
                        if let Some(old) = slot.replace(new) {
                            Self::unref(&mut segments, old);
                        }
                    }
                }
                Err(e) => {
                    // A failed MAP_FIXED may have left the old mappings gone: make the run
                    // unassigned so that no request touches it.
                    for slot in slots.iter_mut().take(i).skip(start) {
                        if let Some(old) = slot.take() {
                            Self::unref(&mut segments, old);
                        }
                    }
                    // SAFETY: write locks of the run are held, as above.
                    if let Err(e2) = unsafe { pool.window.unmap(run_offset, run_len) } {
                        tracing::error!(gid = pool.gid, error = %e2, "cannot restore PROT_NONE after a failed map");
                    }
                    failure = Some(match e.errno() {
                        libc::ENOMEM => DaemonError::Limit {
                            errno: libc::ENOSPC,
                            message: format!(
                                "this host cannot map more region memory ({e}): its memory \
                                 maps (vm.max_map_count, one or more per region) or its memory \
                                 are used up; raise vm.max_map_count or delete regions"
                            ),
                        },
                        _ => e,
                    });
                }
            }
        }
        if segments.get(&ino).is_some_and(|e| e.refs.is_empty()) {
            segments.remove(&ino);
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Drops the backing of `[pool_offset, pool_offset + len)` of pool `gid` where it is still
    /// region `ino` from `region_offset` (the manager's `Released` event), and returns the pages
    /// to the kernel. Idempotent; chunks now backed by something else are left alone.
    pub fn release(
        &self,
        gid: u32,
        pool_offset: u64,
        ino: u64,
        region_offset: u64,
        len: u64,
    ) -> Result<()> {
        let _serial = self.lock_apply();
        let pool = self.pool(gid).ok_or(DaemonError::UnknownPool { gid })?;
        check_event_range("released", pool_offset, region_offset, len)?;
        if pool_offset
            .checked_add(len)
            .is_none_or(|end| end > pool.size())
        {
            return Err(DaemonError::OutOfBounds {
                gid,
                offset: pool_offset,
                len,
                size: pool.size(),
            });
        }
        let first = (pool_offset / CHUNK_SIZE) as usize;
        for i in 0..(len / CHUNK_SIZE) as usize {
            let expect = (ino, region_offset + i as u64 * CHUNK_SIZE);
            self.release_chunk(&pool, first + i, Some(expect));
            self.lock_refused().remove(&(gid, first + i));
        }
        // What this release freed may be the room a refused chunk waits for.
        self.retry_refused_locked();
        self.changes.bump();
        Ok(())
    }

    /// Unassigns one chunk (if it is backed by `expect`, or by anything when `None`).
    fn release_chunk(&self, pool: &Pool, chunk: usize, expect: Option<(u64, u64)>) {
        let mut slot = pool.write_slot(chunk);
        let Some(backing) = *slot else { return };
        if expect.is_some_and(|e| e != (backing.ino, backing.region_offset)) {
            return;
        }
        *slot = None;
        pool.drop_keys(chunk);
        // SAFETY: we hold the chunk's write lock, so no request accesses its pages (and its
        // RDMA registrations are gone).
        if let Err(e) = unsafe { pool.window.unmap(chunk as u64 * CHUNK_SIZE, CHUNK_SIZE) } {
            // The chunk is unassigned, so no request touches it; only the mapping lingers.
            tracing::error!(gid = pool.gid, chunk, error = %e, "cannot unmap a released chunk");
        }
        drop(slot);
        Self::unref(&mut self.lock_segments(), backing);
    }

    /// One pool chunk stopped mapping `backing`: punch the region chunk when nothing maps it,
    /// close the segment when it holds no chunk.
    fn unref(segments: &mut HashMap<u64, SegmentEntry>, backing: Backing) {
        let Some(entry) = segments.get_mut(&backing.ino) else {
            return;
        };
        let rchunk = backing.region_offset / CHUNK_SIZE;
        if let Some(n) = entry.refs.get_mut(&rchunk) {
            *n -= 1;
            if *n > 0 {
                return;
            }
            entry.refs.remove(&rchunk);
        }
        if let Err(e) = entry.segment.punch(backing.region_offset, CHUNK_SIZE) {
            tracing::warn!(ino = backing.ino, error = %e, "cannot return a released chunk's pages");
        }
        if entry.refs.is_empty() {
            segments.remove(&backing.ino);
            tracing::debug!(
                ino = backing.ino,
                "segment closed: no chunk left on this host"
            );
        }
    }

    /// Zeroes region `ino` from `size` to the end of that chunk (the manager's `Truncated`
    /// event; whole chunks past the end come as `Released` events).
    pub fn truncate(&self, ino: u64, size: u64) -> Result<()> {
        let _serial = self.lock_apply();
        let tail = size % CHUNK_SIZE;
        if tail == 0 {
            return Ok(());
        }
        // RDMA registrations of the pool chunks that map the region chunk being punched pin
        // the pages the punch frees (the device would go on reading and writing them, apart
        // from the memfd): they go first, and those chunks stay write-locked (no request
        // registers them again) until the punch is done.
        #[cfg(feature = "rdma")]
        let pools: Vec<Arc<Pool>> = {
            let mut keyed: Vec<Arc<Pool>> = self
                .pools
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .values()
                .filter(|p| p.keyed.load(Ordering::Relaxed))
                .cloned()
                .collect();
            keyed.sort_by_key(|p| p.gid);
            keyed
        };
        #[cfg(feature = "rdma")]
        let _held: Vec<RwLockWriteGuard<'_, Option<Backing>>> = {
            let punched = (ino, size - tail);
            let mut held = Vec::new();
            for pool in &pools {
                for chunk in 0..pool.chunks.len() {
                    // Assignments change only under the apply lock, which this holds.
                    let maps = pool
                        .read_slot(chunk)
                        .is_some_and(|b| (b.ino, b.region_offset) == punched);
                    if maps {
                        held.push(pool.write_slot(chunk));
                        pool.drop_keys(chunk);
                    }
                }
            }
            held
        };
        let segments = self.lock_segments();
        if let Some(entry) = segments.get(&ino)
            && entry.refs.contains_key(&(size / CHUNK_SIZE))
        {
            entry.segment.punch(size, CHUNK_SIZE - tail)?;
        }
        Ok(())
    }

    /// Makes pool `gid`'s table exactly `chunks` (the manager's `PoolChunks` list of
    /// `(pool_offset, ino, region_offset, len)`): releases what is not listed, assigns what is.
    /// Bad entries are logged and skipped.
    pub fn resync(&self, gid: u32, chunks: &[(u64, u64, u64, u64)]) -> Result<()> {
        let pool = self.pool(gid).ok_or(DaemonError::UnknownPool { gid })?;
        let mut wanted: HashMap<usize, (u64, u64)> = HashMap::new();
        let mut good = Vec::with_capacity(chunks.len());
        for &(pool_offset, ino, region_offset, len) in chunks {
            if pool_offset.checked_add(len).is_none_or(|e| e > pool.size()) {
                tracing::warn!(
                    gid,
                    pool_offset,
                    len,
                    "skipping a chunk past the end of the pool"
                );
                continue;
            }
            if let Err(e) = check_event_range("pool chunk", pool_offset, region_offset, len) {
                tracing::warn!(gid, error = %e, "skipping a bad chunk from the manager");
                continue;
            }
            for i in 0..len / CHUNK_SIZE {
                let chunk = ((pool_offset / CHUNK_SIZE) + i) as usize;
                wanted.insert(chunk, (ino, region_offset + i * CHUNK_SIZE));
            }
            good.push((pool_offset, ino, region_offset, len));
        }
        {
            let _serial = self.lock_apply();
            // The manager's table is the truth now: refusals come back with its assignments.
            self.lock_refused().retain(|&(g, _), _| g != gid);
            for chunk in 0..pool.chunks.len() {
                let current = *pool.read_slot(chunk);
                if let Some(b) = current
                    && wanted.get(&chunk) != Some(&(b.ino, b.region_offset))
                {
                    self.release_chunk(&pool, chunk, Some((b.ino, b.region_offset)));
                }
            }
            self.changes.bump();
        }
        let mut first_error = None;
        for (pool_offset, ino, region_offset, len) in good {
            if let Err(e) = self.assign(gid, pool_offset, ino, region_offset, len) {
                tracing::warn!(gid, pool_offset, ino, error = %e, "cannot back a chunk during resync");
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What backs the chunk holding `pool_offset` of pool `gid`.
    pub fn backing(&self, gid: u32, pool_offset: u64) -> Option<Backing> {
        let pool = self.pool(gid)?;
        let chunk = usize::try_from(pool_offset / CHUNK_SIZE).ok()?;
        if chunk >= pool.chunks.len() {
            return None;
        }
        *pool.read_slot(chunk)
    }

    /// Region `ino`'s segment on this host.
    pub fn segment(&self, ino: u64) -> Option<Arc<Segment>> {
        self.lock_segments()
            .get(&ino)
            .map(|e| Arc::clone(&e.segment))
    }

    /// Region `ino`'s segment on this host once it is at least `covering` bytes long (the
    /// manager's assignment events may still be on their way), or as it is at `deadline`;
    /// with `covering` 0, as it is now.
    pub fn segment_covering(
        &self,
        ino: u64,
        covering: u64,
        deadline: Instant,
    ) -> Option<Arc<Segment>> {
        loop {
            let seen = self.changes.current();
            let segment = self.segment(ino);
            if covering == 0
                || segment.as_ref().is_some_and(|s| s.size() >= covering)
                || Instant::now() >= deadline
            {
                return segment;
            }
            self.changes.wait(seen, deadline);
        }
    }

    /// Regions with a segment here, and the bytes of memory their segments hold.
    pub fn segment_usage(&self) -> (u64, u64) {
        let segments: Vec<Arc<Segment>> = self
            .lock_segments()
            .values()
            .map(|e| Arc::clone(&e.segment))
            .collect();
        let bytes = segments.iter().map(|s| s.allocated_bytes()).sum();
        (segments.len() as u64, bytes)
    }

    /// Looks up the pools of `ranges` and checks them against the pools' bounds.
    pub fn resolve(&self, ranges: &[Range]) -> Result<Resolved<'_>> {
        let mut pools: Vec<Arc<Pool>> = Vec::new();
        let mut spans = Vec::with_capacity(ranges.len());
        let mut chunks = Vec::new();
        for r in ranges {
            let index = match pools.iter().position(|p| p.gid == r.pool) {
                Some(i) => i,
                None => {
                    let pool = self
                        .pool(r.pool)
                        .ok_or(DaemonError::UnknownPool { gid: r.pool })?;
                    pools.push(pool);
                    pools.len() - 1
                }
            };
            let pool = &pools[index];
            let end = r.offset.checked_add(r.len);
            if end.is_none_or(|end| end > pool.size()) {
                return Err(DaemonError::OutOfBounds {
                    gid: r.pool,
                    offset: r.offset,
                    len: r.len,
                    size: pool.size(),
                });
            }
            spans.push((index, r.offset, r.len, r.delta));
            if r.len > 0 {
                let first = r.offset / CHUNK_SIZE;
                let last = (r.offset + r.len - 1) / CHUNK_SIZE;
                chunks.extend((first..=last).map(|c| (r.pool, index, c as usize)));
            }
        }
        // Ascending (gid, chunk) and each chunk once: the lock order that keeps pins
        // deadlock-free, and no chunk read-locked twice by one request.
        chunks.sort_unstable();
        chunks.dedup();
        Ok(Resolved {
            changes: &self.changes,
            refused: &self.refused,
            pools,
            spans,
            chunks: chunks.into_iter().map(|(_, i, c)| (i, c)).collect(),
        })
    }
}

/// The pools and chunks a request touches, checked against the pools' bounds.
#[derive(Debug)]
pub struct Resolved<'a> {
    changes: &'a Changes,
    refused: &'a Mutex<HashMap<(u32, usize), Refusal>>,
    pools: Vec<Arc<Pool>>,
    /// Per range: (index in `pools`, offset, len, the chunk delta the request states).
    spans: Vec<(usize, u64, u64, Option<u32>)>,
    /// (index in `pools`, chunk), in lock order.
    chunks: Vec<(usize, usize)>,
}

impl Resolved<'_> {
    /// Total bytes of the ranges.
    pub fn len(&self) -> u64 {
        self.spans.iter().map(|s| s.2).sum()
    }

    /// Whether the ranges hold no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pins every chunk of the ranges. A chunk that is not assigned yet (the manager's event
    /// may be on its way) is waited for until `deadline`, then refused with `EFAULT`.
    pub fn pin(&self, deadline: Instant) -> Result<Pinned<'_>> {
        loop {
            let seen = self.changes.current();
            let mut guards = Vec::with_capacity(self.chunks.len());
            let mut missing = None;
            for &(index, chunk) in &self.chunks {
                let guard = self.pools[index].read_slot(chunk);
                if guard.is_none() {
                    missing = Some((index, chunk));
                    break;
                }
                guards.push(guard);
            }
            let Some((index, chunk)) = missing else {
                let fingerprint = guards.iter().filter_map(|g| g.map(|b| b.epoch)).collect();
                return Ok(Pinned {
                    resolved: self,
                    _guards: guards,
                    fingerprint,
                });
            };
            drop(guards);
            let gid = self.pools[index].gid;
            if let Some(r) = self
                .refused
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(&(gid, chunk))
            {
                return Err(DaemonError::Limit {
                    errno: r.errno,
                    message: r.message.to_string(),
                });
            }
            if Instant::now() >= deadline {
                return Err(DaemonError::Unassigned {
                    gid: self.pools[index].gid,
                    offset: chunk as u64 * CHUNK_SIZE,
                });
            }
            self.changes.wait(seen, deadline);
        }
    }
}

/// An 8-byte atomic operation on a pool word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WordOp {
    CompareSwap { expected: u64, new: u64 },
    FetchAdd(u64),
}

impl WordOp {
    /// Whether the operation, finding `old`, changed the word.
    pub fn changed(self, old: u64) -> bool {
        match self {
            WordOp::CompareSwap { expected, new } => old == expected && new != old,
            WordOp::FetchAdd(addend) => addend != 0,
        }
    }
}

/// Chunks pinned for one request: their pages stay mapped to the same region memory until this
/// is dropped.
#[derive(Debug)]
pub struct Pinned<'a> {
    resolved: &'a Resolved<'a>,
    _guards: Vec<RwLockReadGuard<'a, Option<Backing>>>,
    fingerprint: Vec<u64>,
}

impl Pinned<'_> {
    /// Identifies the mappings pinned: equal fingerprints of two pins of the same [`Resolved`]
    /// mean the same memory.
    pub fn fingerprint(&self) -> &[u64] {
        &self.fingerprint
    }

    /// Whether every pinned chunk backs region `ino` (a capability's reach); the pins keep the
    /// answer true until they are dropped.
    pub fn all_backed_by(&self, ino: u64) -> bool {
        self._guards.iter().all(|g| g.is_some_and(|b| b.ino == ino))
    }

    /// Whether every range that states where in its region it lies (its chunk delta) lies
    /// there: false when a chunk was given to another region offset since the client read its
    /// map (a stale map, `ESTALE`). The pins keep the answer true until they are dropped.
    pub fn deltas_match(&self) -> bool {
        self.resolved
            .spans
            .iter()
            .all(|&(index, offset, len, delta)| {
                let Some(delta) = delta else { return true };
                if len == 0 {
                    return true;
                }
                let first = offset / CHUNK_SIZE;
                let last = (offset + len - 1) / CHUNK_SIZE;
                (first..=last).all(|chunk| {
                    self.backing_of(index, chunk as usize)
                        .is_some_and(|b| chunk_delta(b.region_offset, chunk * CHUNK_SIZE) == delta)
                })
            })
    }

    /// The backing of pinned chunk `chunk` of pool `index` (the chunks are in lock order:
    /// ascending pool id, then chunk, so a binary search finds it).
    fn backing_of(&self, index: usize, chunk: usize) -> Option<Backing> {
        let gid = |i: usize| self.resolved.pools[i].gid;
        let key = (gid(index), chunk);
        self.resolved
            .chunks
            .binary_search_by_key(&key, |&(i, c)| (gid(i), c))
            .ok()
            .and_then(|at| *self._guards[at])
    }

    /// Whether every pinned byte is a byte of region `ino` that `cap` covers (its offset
    /// range); the pins keep the answer true until they are dropped.
    pub fn all_covered_by(&self, cap: &Capability) -> bool {
        if !self.all_backed_by(cap.ino) {
            return false;
        }
        if cap.len == WHOLE_REGION && cap.offset == 0 {
            return true;
        }
        let backing = |index: usize, chunk: usize| self.backing_of(index, chunk);
        self.resolved.spans.iter().all(|&(index, offset, len, _)| {
            let end = offset + len;
            let mut at = offset;
            while at < end {
                let chunk = at / CHUNK_SIZE;
                let within = at % CHUNK_SIZE;
                let n = (CHUNK_SIZE - within).min(end - at);
                let Some(b) = backing(index, chunk as usize) else {
                    return false;
                };
                if !cap.covers(b.region_offset + within, n) {
                    return false;
                }
                at += n;
            }
            true
        })
    }

    /// The RDMA keys of every pinned chunk, ascending, registering those that have none yet
    /// (`write`: the keys for reading, writing and atomics, else for reading only).
    #[cfg(feature = "rdma")]
    pub fn chunk_keys(
        &self,
        rdma: &crate::rdma::Rdma,
        write: bool,
    ) -> Result<Vec<regions_proto::frame::RdmaChunkKey>> {
        let mut out = Vec::with_capacity(self.resolved.chunks.len());
        for &(index, chunk) in &self.resolved.chunks {
            let keys = self.chunk_keys_of(rdma, index, chunk)?;
            out.push(regions_proto::frame::RdmaChunkKey {
                pool_offset: chunk as u64 * CHUNK_SIZE,
                addr: keys.addr(),
                rkey: keys.rkey(write),
                len: CHUNK_SIZE,
            });
        }
        Ok(out)
    }

    /// Every pinned chunk: its pool's index here, the chunk, the pool's gid and the region
    /// offset the chunk backs (chunks without a backing are left out).
    #[cfg(feature = "rdma")]
    pub fn chunk_backings(&self) -> Vec<(usize, usize, u32, u64)> {
        self.resolved
            .chunks
            .iter()
            .filter_map(|&(index, chunk)| {
                let b = self.backing_of(index, chunk)?;
                Some((
                    index,
                    chunk,
                    self.resolved.pools[index].gid,
                    b.region_offset,
                ))
            })
            .collect()
    }

    /// The registrations of pinned chunk `chunk` of pool `index`, made now if it has none.
    #[cfg(feature = "rdma")]
    pub fn chunk_keys_of(
        &self,
        rdma: &crate::rdma::Rdma,
        index: usize,
        chunk: usize,
    ) -> Result<Arc<crate::rdma::ChunkKeys>> {
        let pool = &self.resolved.pools[index];
        let pool_offset = chunk as u64 * CHUNK_SIZE;
        let mut slot = pool
            .keys
            .get(chunk)
            .ok_or(DaemonError::OutOfBounds {
                gid: pool.gid,
                offset: pool_offset,
                len: CHUNK_SIZE,
                size: pool.size(),
            })?
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(k) = &*slot {
            return Ok(Arc::clone(k));
        }
        let addr = pool
            .window
            .addr(pool_offset)
            .ok_or(DaemonError::OutOfBounds {
                gid: pool.gid,
                offset: pool_offset,
                len: CHUNK_SIZE,
                size: pool.size(),
            })?;
        // SAFETY: the chunk is pinned (its read lock is held), so it is mapped; the
        // registration is dropped under its write lock before any unmap or remap
        // (`Pool::drop_keys`).
        let k = Arc::new(unsafe { rdma.register_chunk(addr, CHUNK_SIZE as usize)? });
        pool.keyed.store(true, Ordering::Relaxed);
        *slot = Some(Arc::clone(&k));
        Ok(k)
    }

    /// The pinned ranges as raw spans, in request order.
    fn raw_spans(&self) -> Vec<RawSpan> {
        self.resolved
            .spans
            .iter()
            .filter(|s| s.2 > 0)
            .filter_map(|&(index, offset, len, _)| {
                let ptr = self.resolved.pools[index].window.addr(offset)?;
                Some(RawSpan {
                    ptr,
                    len: len as usize,
                })
            })
            .collect()
    }

    /// Copies `src` into the ranges (concatenated), starting `at` bytes into them; bytes past
    /// the ranges' end are ignored.
    pub fn copy_in_at(&self, at: u64, mut src: &[u8]) {
        let mut skip = at;
        for &(index, offset, len, _) in &self.resolved.spans {
            if src.is_empty() {
                return;
            }
            if skip >= len {
                skip -= len;
                continue;
            }
            let n = (len - skip).min(src.len() as u64) as usize;
            let (head, rest) = src.split_at(n);
            // SAFETY: the range was bounds-checked by `resolve` and its chunks are pinned.
            unsafe {
                self.resolved.pools[index]
                    .window
                    .copy_in(offset + skip, head)
            };
            src = rest;
            skip = 0;
        }
    }

    /// Copies the ranges (concatenated) into `dst`, up to `dst.len()` bytes.
    pub fn copy_out(&self, mut dst: &mut [u8]) {
        for &(index, offset, len, _) in &self.resolved.spans {
            if dst.is_empty() {
                return;
            }
            let n = len.min(dst.len() as u64) as usize;
            let (head, rest) = dst.split_at_mut(n);
            // SAFETY: the range was bounds-checked by `resolve` and its chunks are pinned.
            unsafe { self.resolved.pools[index].window.copy_out(offset, head) };
            dst = rest;
        }
    }

    /// The pool index and offset of the 8-byte word of the first range (8-byte aligned).
    fn word_at(&self) -> Result<(usize, u64)> {
        let Some(&(index, offset, _, _)) = self.resolved.spans.first() else {
            return Err(DaemonError::Invalid(
                "atomic operation without a range".into(),
            ));
        };
        if !offset.is_multiple_of(8) {
            return Err(DaemonError::Invalid(format!(
                "atomic operation at pool offset {offset:#x} is not 8-byte aligned"
            )));
        }
        Ok((index, offset))
    }

    fn with_word<T>(&self, f: impl FnOnce(&AtomicU64) -> T) -> Result<T> {
        let (index, offset) = self.word_at()?;
        let pool = &self.resolved.pools[index];
        // SAFETY: the word's chunk is pinned for as long as `self` lives, and the reference
        // does not escape `f`.
        let word = unsafe { pool.window.word(offset) };
        match word {
            Some(word) => Ok(f(word)),
            None => Err(DaemonError::Invalid(format!(
                "atomic operation at pool offset {offset:#x} is not 8-byte aligned"
            ))),
        }
    }

    /// Applies `op` to the 8-byte word of the first range with a CPU atomic; returns the old
    /// value.
    pub fn word_op(&self, op: WordOp) -> Result<u64> {
        match op {
            WordOp::CompareSwap { expected, new } => self.compare_and_swap(expected, new),
            WordOp::FetchAdd(addend) => self.fetch_add(addend),
        }
    }

    /// Applies `op` to the 8-byte word of the first range through the RDMA device (which
    /// then excludes clients' one-sided atomics on it); returns the old value. Waiters of
    /// the word are woken when it changed.
    #[cfg(feature = "rdma")]
    pub fn device_word_op(&self, rdma: &crate::rdma::Rdma, op: WordOp) -> Result<u64> {
        let (index, offset) = self.word_at()?;
        let chunk = usize::try_from(offset / CHUNK_SIZE).unwrap_or(usize::MAX);
        let keys = self.chunk_keys_of(rdma, index, chunk)?;
        let old = rdma.device_atomic(keys.remote(offset % CHUNK_SIZE), op)?;
        if op.changed(old) {
            // Applied already: the wake's only failure (no such word) leaves nobody to wake.
            let _ = self.with_word(word_wait::wake);
        }
        Ok(old)
    }

    /// Wakes the waiters of the 8-byte word of the first range ([`word_wait`]); returns its
    /// value.
    pub fn wake(&self) -> Result<u64> {
        self.with_word(|w| {
            word_wait::wake(w);
            w.load(Ordering::SeqCst)
        })
    }

    /// 8-byte compare-and-swap on the first range; returns the old value. Waiters of the
    /// word ([`word_wait`]) are woken when it changes.
    pub fn compare_and_swap(&self, expected: u64, new: u64) -> Result<u64> {
        self.with_word(|w| {
            match w.compare_exchange(expected, new, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(old) => {
                    if new != old {
                        word_wait::wake(w);
                    }
                    old
                }
                Err(old) => old,
            }
        })
    }

    /// 8-byte wrapping fetch-add on the first range; returns the old value. Waiters of the
    /// word are woken.
    pub fn fetch_add(&self, addend: u64) -> Result<u64> {
        self.with_word(|w| {
            let old = w.fetch_add(addend, Ordering::SeqCst);
            if addend != 0 {
                word_wait::wake(w);
            }
            old
        })
    }

    /// Waits (at most `timeout`) for the 8-byte word of the first range to differ from
    /// `expected`, without the pin: `self` is consumed so that remapping and release are not
    /// held up by a sleeping request. Returns the value seen last.
    pub fn wait_change(self, expected: u64, timeout: Duration) -> Result<u64> {
        let (seen, word) = self.with_word(|w| (w.load(Ordering::SeqCst), w.as_ptr() as usize))?;
        if seen != expected || timeout.is_zero() {
            return Ok(seen);
        }
        drop(self);
        // Unpinned, the word may be remapped or released meanwhile: the futex only reads it
        // in the kernel, and the caller reads it again, pinned.
        word_wait::wait_at(word, expected, timeout);
        Ok(expected)
    }

    /// Sends `prefix` followed by the ranges' bytes, skipping the first `skip` bytes of the
    /// whole, as far as the socket takes them now (never blocks).
    pub fn send(&self, socket: &impl AsRawFd, prefix: &[u8], skip: usize) -> io::Result<usize> {
        let mut spans = Vec::with_capacity(self.resolved.spans.len() + 1);
        spans.push(RawSpan::of(prefix));
        spans.extend(self.raw_spans());
        // SAFETY: `prefix` is a live slice; the other spans are pinned pool ranges.
        unsafe { rawio::send_nonblocking(socket.as_raw_fd(), &spans, skip) }
    }

    /// Receives into the ranges from `at` bytes on, as much as the socket holds now (never
    /// blocks; `Ok(0)` when the peer closed).
    pub fn recv(&self, socket: &impl AsRawFd, at: usize) -> io::Result<usize> {
        let spans = self.raw_spans();
        // SAFETY: the spans are pinned pool ranges, writable, never borrowed as Rust references.
        unsafe { rawio::recv_nonblocking(socket.as_raw_fd(), &spans, at) }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const C: u64 = CHUNK_SIZE;

    fn rg(pool: u32, offset: u64, len: u64) -> Range {
        Range {
            pool,
            offset,
            len,
            delta: None,
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(20)
    }

    fn write(pools: &Pools, pool: u32, offset: u64, data: &[u8]) -> Result<()> {
        let resolved = pools.resolve(&[rg(pool, offset, data.len() as u64)])?;
        resolved.pin(soon())?.copy_in_at(0, data);
        Ok(())
    }

    fn read(pools: &Pools, ranges: &[Range]) -> Result<Vec<u8>> {
        let resolved = pools.resolve(ranges)?;
        let mut out = vec![0; resolved.len() as usize];
        resolved.pin(soon())?.copy_out(&mut out);
        Ok(out)
    }

    #[test]
    fn bounds_and_assignment_checks() {
        let pools = Pools::new();
        pools.add_pool(1, 8 * C).unwrap();
        pools.assign(1, 2 * C, 10, 0, 2 * C).unwrap();
        pools.assign(1, 4 * C, 11, 0, C).unwrap();
        assert_eq!(pools.assigned_bytes(), 3 * C);
        let errno = |r: Result<Vec<u8>>| r.unwrap_err().errno();
        // Unknown pool, past the end, overflow.
        assert_eq!(errno(read(&pools, &[rg(2, 0, 1)])), libc::ENOENT);
        assert_eq!(errno(read(&pools, &[rg(1, 8 * C - 1, 2)])), libc::EFAULT);
        assert_eq!(errno(read(&pools, &[rg(1, u64::MAX, 2)])), libc::EFAULT);
        assert_eq!(errno(read(&pools, &[rg(1, 8 * C + 1, 0)])), libc::EFAULT);
        // Unassigned chunk 0, and a range running from assigned chunk 4 into unassigned 5.
        assert_eq!(errno(read(&pools, &[rg(1, 0, 1)])), libc::EFAULT);
        assert_eq!(errno(read(&pools, &[rg(1, 5 * C - 4, 8)])), libc::EFAULT);
        // A range spanning the consecutive assigned chunks 2, 3 and 4 (two regions).
        let data: Vec<u8> = (0..(C + 20) as usize).map(|i| i as u8).collect();
        write(&pools, 1, 3 * C - 10, &data).unwrap();
        assert_eq!(read(&pools, &[rg(1, 3 * C - 10, C + 20)]).unwrap(), data);
        // Zero-length ranges need no assignment; repeated chunks are pinned once.
        assert!(read(&pools, &[rg(1, 0, 0)]).unwrap().is_empty());
        let twice = read(&pools, &[rg(1, 3 * C, 4), rg(1, 3 * C, 4)]).unwrap();
        assert_eq!(twice.len(), 8);
        assert_eq!(twice[..4], twice[4..]);
        // The bytes landed in the segments at region offsets.
        let mut b = [0u8; 2];
        pools
            .segment(10)
            .unwrap()
            .read_at(2 * C - 10, &mut b)
            .unwrap();
        assert_eq!(b, [0, 1]);
        pools.segment(11).unwrap().read_at(0, &mut b).unwrap();
        assert_eq!(b, [10, 11]);
    }

    #[test]
    fn atomics_on_pinned_words() {
        let pools = Pools::new();
        pools.add_pool(3, C).unwrap();
        pools.assign(3, 0, 1, 0, C).unwrap();
        let resolved = pools.resolve(&[rg(3, 64, 8)]).unwrap();
        let pinned = resolved.pin(soon()).unwrap();
        assert_eq!(pinned.fetch_add(5).unwrap(), 0);
        assert_eq!(pinned.compare_and_swap(5, 9).unwrap(), 5);
        assert_eq!(pinned.compare_and_swap(5, 1).unwrap(), 9);
        drop(pinned);
        let resolved = pools.resolve(&[rg(3, 4, 8)]).unwrap();
        assert!(resolved.pin(soon()).unwrap().fetch_add(1).is_err());
    }

    #[test]
    fn events_are_validated() {
        let pools = Pools::new();
        assert!(pools.add_pool(0, C).is_err());
        assert!(pools.add_pool(1, C + 1).is_err());
        pools.add_pool(1, 4 * C).unwrap();
        pools.add_pool(1, 4 * C).unwrap();
        assert!(pools.add_pool(1, 8 * C).is_err());
        assert_eq!(
            pools.assign(9, 0, 1, 0, C).unwrap_err().errno(),
            libc::ENOENT
        );
        assert!(pools.assign(1, 1, 1, 0, C).is_err());
        assert!(pools.assign(1, 0, 1, 0, 0).is_err());
        assert!(pools.assign(1, 3 * C, 1, 0, 2 * C).is_err());
        assert!(pools.assign(1, 0, 1, u64::MAX - C + 1, C).is_err());
        assert!(pools.release(1, 0, 1, 0, 5 * C).is_err());
        assert_eq!(pools.list(), vec![(1, 4 * C)]);
    }

    #[test]
    fn release_punches_and_closes_segments() {
        let pools = Pools::new();
        pools.add_pool(1, 4 * C).unwrap();
        pools.assign(1, 0, 5, 0, 2 * C).unwrap();
        pools.assign(1, 0, 5, 0, 2 * C).unwrap(); // idempotent
        write(&pools, 1, 0, &vec![1u8; 2 * C as usize]).unwrap();
        let seg = pools.segment(5).unwrap();
        assert_eq!(seg.allocated_bytes(), 2 * C);
        assert_eq!(pools.segment_usage(), (1, 2 * C));
        // A release naming another region changes nothing.
        pools.release(1, 0, 6, 0, C).unwrap();
        assert_eq!(seg.allocated_bytes(), 2 * C);
        pools.release(1, 0, 5, 0, C).unwrap();
        assert_eq!(
            seg.allocated_bytes(),
            C,
            "the released chunk's pages are punched"
        );
        assert!(pools.backing(1, 0).is_none());
        assert_eq!(
            read(&pools, &[rg(1, 0, 1)]).unwrap_err().errno(),
            libc::EFAULT
        );
        pools.release(1, C, 5, C, C).unwrap();
        assert!(pools.segment(5).is_none(), "no chunk left: segment closed");
        assert_eq!(seg.allocated_bytes(), 0);
        assert_eq!(pools.segment_usage(), (0, 0));
    }

    #[test]
    fn a_segment_request_waits_for_the_assignments_it_names() {
        let pools = Arc::new(Pools::new());
        pools.add_pool(1, 4 * C).unwrap();
        pools.assign(1, 0, 5, 0, C).unwrap();
        let later = Arc::clone(&pools);
        let assigner = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            later.assign(1, C, 5, C, 2 * C).unwrap();
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let seg = pools.segment_covering(5, 3 * C, deadline).unwrap();
        assert_eq!(
            seg.size(),
            3 * C,
            "returned once the late chunks were applied"
        );
        assigner.join().unwrap();
        // Past the deadline the segment comes as it is; no segment at all gives none.
        let start = Instant::now();
        let short = pools.segment_covering(5, 8 * C, start + Duration::from_millis(50));
        assert_eq!(short.map(|s| s.size()), Some(3 * C));
        assert!(
            pools
                .segment_covering(6, C, start + Duration::from_millis(50))
                .is_none()
        );
        assert!(
            start.elapsed() >= Duration::from_millis(50),
            "they waited to the deadline"
        );
        // Asking for no length waits for nothing, even for a region with no segment here.
        let start = Instant::now();
        assert!(
            pools
                .segment_covering(6, 0, start + Duration::from_secs(60))
                .is_none()
        );
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no wait without a length"
        );
    }

    #[test]
    fn reassignment_keeps_data_mapped_elsewhere() {
        let pools = Pools::new();
        pools.add_pool(1, 4 * C).unwrap();
        // Two pool chunks map region 7's chunk 0 (a replayed event over a newer snapshot).
        pools.assign(1, 0, 7, 0, C).unwrap();
        pools.assign(1, C, 7, 0, C).unwrap();
        write(&pools, 1, 10, b"kept").unwrap();
        assert_eq!(read(&pools, &[rg(1, C + 10, 4)]).unwrap(), b"kept");
        pools.release(1, 0, 7, 0, C).unwrap();
        assert_eq!(read(&pools, &[rg(1, C + 10, 4)]).unwrap(), b"kept");
        // Reassigning chunk 1 to another region unrefs region 7's chunk.
        pools.assign(1, C, 8, C, C).unwrap();
        assert!(pools.segment(7).is_none());
        assert_eq!(
            pools.backing(1, C).map(|b| (b.ino, b.region_offset)),
            Some((8, C))
        );
    }

    #[test]
    fn truncate_zeroes_the_tail_of_the_last_chunk() {
        let pools = Pools::new();
        pools.add_pool(1, 2 * C).unwrap();
        pools.assign(1, 0, 4, 0, C).unwrap();
        write(&pools, 1, 0, &vec![9u8; C as usize]).unwrap();
        pools.truncate(4, 100).unwrap();
        pools.truncate(4, 5 * C + 1).unwrap(); // no such chunk here: nothing to do
        pools.truncate(99, 1).unwrap();
        let bytes = read(&pools, &[rg(1, 0, C)]).unwrap();
        assert!(bytes[..100].iter().all(|b| *b == 9));
        assert!(bytes[100..].iter().all(|b| *b == 0));
    }

    #[test]
    fn resync_releases_and_assigns() {
        let pools = Pools::new();
        pools.add_pool(2, 4 * C).unwrap();
        pools.assign(2, 0, 1, 0, 2 * C).unwrap();
        pools.assign(2, 3 * C, 3, 0, C).unwrap();
        write(&pools, 2, 0, b"one").unwrap();
        let list = [
            (0, 1, 0, C),     // kept
            (2 * C, 2, 0, C), // new
            (3 * C, 3, C, C), // moved to another region chunk
            (C + 1, 9, 0, C), // bad: skipped
            (4 * C, 9, 0, C), // past the end: skipped
        ];
        pools.resync(2, &list).unwrap();
        let b = |off| pools.backing(2, off).map(|b| (b.ino, b.region_offset));
        assert_eq!(b(0), Some((1, 0)));
        assert_eq!(b(C), None);
        assert_eq!(b(2 * C), Some((2, 0)));
        assert_eq!(b(3 * C), Some((3, C)));
        assert_eq!(read(&pools, &[rg(2, 0, 3)]).unwrap(), b"one");
        assert_eq!(pools.resync(7, &[]).unwrap_err().errno(), libc::ENOENT);
        pools.remove_pool(2);
        assert!(pools.pool(2).is_none());
        assert_eq!(pools.segment_usage().0, 0);
    }

    #[test]
    fn pin_waits_for_a_late_assignment() {
        let pools = Arc::new(Pools::new());
        pools.add_pool(1, 2 * C).unwrap();
        let p = Arc::clone(&pools);
        let assigner = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            p.assign(1, 0, 3, 0, C).unwrap();
        });
        let resolved = pools.resolve(&[rg(1, 0, 8)]).unwrap();
        let start = Instant::now();
        let pinned = resolved.pin(Instant::now() + Duration::from_secs(5));
        assert!(pinned.is_ok());
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "woken by the event"
        );
        drop(pinned);
        assigner.join().unwrap();
        let start = Instant::now();
        let late = pools.resolve(&[rg(1, C, 8)]).unwrap();
        let err = late
            .pin(Instant::now() + Duration::from_millis(100))
            .unwrap_err();
        assert_eq!(err.errno(), libc::EFAULT);
        assert!(start.elapsed() >= Duration::from_millis(100));
    }

    #[test]
    fn fingerprint_changes_with_the_mapping() {
        let pools = Pools::new();
        pools.add_pool(1, C).unwrap();
        pools.assign(1, 0, 3, 0, C).unwrap();
        let resolved = pools.resolve(&[rg(1, 0, 8)]).unwrap();
        let before = resolved.pin(soon()).unwrap().fingerprint().to_vec();
        assert_eq!(resolved.pin(soon()).unwrap().fingerprint(), before);
        pools.release(1, 0, 3, 0, C).unwrap();
        pools.assign(1, 0, 3, 0, C).unwrap();
        assert_ne!(resolved.pin(soon()).unwrap().fingerprint(), before);
    }
}
