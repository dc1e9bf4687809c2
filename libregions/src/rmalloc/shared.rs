//! The heap of a region that processes on any number of hosts allocate in at once: a
//! *directory* of per-process *arenas*, each an ordinary [`Heap`].
//!
//! A mapping of a remote region is a private cache of its pages, written back page by page at
//! `rmsync`; two hosts that write one page between their syncs lose one another's writes. So
//! the allocator must never have two processes write the same page. The region is therefore
//! cut into page-aligned arenas, and a process allocates only in arenas it *owns*:
//!
//! - **Directory** (the first [`DIR_BYTES`] of the region): a header, a table of arenas
//!   (offset, length, owner, one entry per arena) and a ring of *remote frees*. It is read and
//!   written only with the transport's uncached reads and 8-byte atomics, never through a
//!   mapping, so every host sees the same directory at once.
//! - **Arenas** follow it. A process claims space with a compare-and-swap on the directory's
//!   bump word, creates the arena's entry with itself as owner, and runs a [`Heap`] in it
//!   through its own mapping. It grows its last arena in place while nothing was claimed after
//!   it (a region used by one process keeps one heap), and claims another arena, doubling what
//!   it owns, when it cannot.
//! - **Ownership** is an 8-byte word: this process's host and pid namespace, its pid and its
//!   start time ([`process_owner`]). A process hands its arenas back (owner 0) when it unmaps
//!   the region or exits; a process of the same kernel takes over the arenas of one that died
//!   without doing so. A process that needs room adopts an unowned arena before it claims new
//!   space, so a heap handed over continues where the last process stopped.
//! - **Freeing** a block of an arena this process owns is an ordinary [`Heap::free`]. A block
//!   of another process's arena is posted to the remote-free ring (a fetch-and-add on the
//!   ring's tail picks a slot, a compare-and-swap fills it); the arena's owner takes the
//!   blocks of its arenas out of the ring and frees them when its heap is full, when it adopts
//!   an arena, and at most every [`DRAIN_EVERY`] while it allocates.
//!
//! The directory is untrusted memory like the heap: offsets, lengths and counts read from it
//! are checked before use (`EINVAL` naming the field).

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{Heap, HeapError, MIN_HEAP, PAGE};
use crate::error::{RegionsError, Result};

/// `b"RGNARENA"` little-endian: marks a region whose heap is a directory of arenas.
pub const DIR_MAGIC: u64 = u64::from_le_bytes(*b"RGNARENA");
/// Layout version of the directory.
const DIR_VERSION: u64 = 1;
/// Bytes of the directory at the start of the region; arenas follow.
pub const DIR_BYTES: u64 = 64 << 10;
// Header words.
const W_MAGIC: u64 = 0;
const W_VERSION: u64 = 8;
/// Bytes claimed for arenas after the directory.
const W_BUMP: u64 = 16;
/// Region offset + 1 of the root block (0: none).
const W_ROOT: u64 = 24;
/// Arena entries created (some may be half written by a creator that is still at it).
const W_COUNT: u64 = 32;
/// Remote frees posted (the ring slot of the next is this modulo [`RING_SLOTS`]).
const W_RING_TAIL: u64 = 40;
/// The arena table.
const ENTRIES: u64 = 64;
const ENTRY: u64 = 32;
// Entry words.
const E_OFF: u64 = 0;
const E_LEN: u64 = 8;
const E_OWNER: u64 = 16;
/// The owner's full host and pid-namespace id (written after the owner word).
const E_HOST: u64 = 24;
/// Most bytes the arenas of a region may claim (checked, so offsets never overflow).
const MAX_CLAIMED: u64 = 1 << 50;
/// Most arenas a region holds.
pub const MAX_ARENAS: u64 = (RING - ENTRIES) / ENTRY;
/// The remote-free ring: one region offset per slot, 0 when empty.
const RING: u64 = 16 << 10;
const RING_SLOTS: u64 = (DIR_BYTES - RING) / 8;
/// The first region length: the directory and a first arena.
pub const FIRST_REGION: u64 = 1 << 20;
/// Largest step an arena grows by, or a new arena's size (unless a block needs more).
const MAX_STEP: u64 = 256 << 20;
/// Region lengths are multiples of this (the manager's chunk).
const GROW_UNIT: u64 = regions_proto::layout::CHUNK_SIZE;
/// How often an owner looks for blocks other processes freed into its arenas while it
/// allocates.
pub const DRAIN_EVERY: Duration = Duration::from_millis(50);
/// How long a remote free waits for a slot of a full ring.
const RING_WAIT: Duration = Duration::from_secs(2);

/// The region as the shared heap reaches it: through this process's mapping for the arenas,
/// and through uncached reads and atomics that every host sees at once for the directory.
pub trait RegionMemory: Send + Sync {
    /// Start of this process's mapping of the region.
    fn base(&self) -> *mut u8;
    /// Bytes mapped.
    fn mapped(&self) -> usize;
    /// Makes the region, and the mapping, at least `len` bytes long.
    fn ensure_len(&self, len: u64) -> Result<()>;
    /// Atomic compare-and-swap of the 8-byte word at `off`; returns the value before.
    fn cas(&self, off: u64, expected: u64, new: u64) -> Result<u64>;
    /// Atomic fetch-and-add of the 8-byte word at `off`; returns the value before.
    fn fetch_add(&self, off: u64, add: u64) -> Result<u64>;
    /// Reads `buf.len()` bytes at `off` as every host sees them (not through the mapping).
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<()>;
    /// Writes this process's cached pages of `[off, off + len)` back to the region.
    fn publish(&self, off: u64, len: u64) -> Result<()>;
    /// Drops this process's cached pages of `[off, off + len)` (after writing back dirty
    /// ones), so the next access reads the region.
    fn invalidate(&self, off: u64, len: u64) -> Result<()>;
    /// The region's inode number, for messages.
    fn ino(&self) -> u64;
}

/// This process's owner word: host and pid namespace (24 bits), start time (18 low bits)
/// and pid (22 bits). Never 0. Read afresh on every call (heaps are opened rarely), so a
/// forked child gets its own.
pub fn process_owner() -> Result<u64> {
    let pid = std::process::id();
    let start = regions_proto::pid_watch::start_time(pid).ok_or_else(|| {
        RegionsError::io(
            format!("reading this process's start time from /proc/{pid}/stat for rmalloc"),
            std::io::Error::last_os_error(),
        )
    })?;
    Ok(owner_word(host_key(), pid, start))
}

fn host_key() -> u64 {
    (super::thread_cache::host_ns() & 0x7f_ffff) | 0x80_0000
}

fn owner_word(host: u64, pid: u32, start: u64) -> u64 {
    (host << 40) | ((start & 0x3_ffff) << 22) | (pid as u64 & 0x3f_ffff)
}

/// Whether the process an owner word names is known to be gone: it ran on this kernel and
/// pid namespace (`host`, the entry's full host word, is this one's), and its pid is free
/// (`kill` says `ESRCH`) or now names a process that started at another time. Anything less
/// certain (its `/proc` entry unreadable, say) counts as alive.
fn owner_gone(owner: u64, host: u64) -> bool {
    if owner >> 40 != host_key() || host != super::thread_cache::host_ns() {
        return false;
    }
    let pid = (owner & 0x3f_ffff) as u32;
    // SAFETY: kill with signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    match regions_proto::pid_watch::live_start_time(pid) {
        Some(start) => owner_word(host_key(), pid, start) != owner,
        None => false,
    }
}

/// One arena as this process last read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Arena {
    off: u64,
    len: u64,
    /// The owner word as last read, and the owner's host word.
    owner: u64,
    host: u64,
    /// Owned by this heap (this process).
    mine: bool,
    /// Failed validation: never used here again.
    bad: bool,
}

/// The arena this process allocates in first (read without a lock by the fast paths).
#[derive(Debug)]
pub struct Current {
    /// Address of the arena in the mapping, and its length.
    base: usize,
    len: usize,
}

impl Current {
    /// Address of the arena in the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }

    /// Bytes in the arena.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Default)]
struct Known {
    /// By entry index.
    arenas: Vec<Option<Arena>>,
    current: Option<usize>,
    /// The ring's tail at the last two drains: a drain is skipped only when neither saw a
    /// post (a post counted in the tail may fill its slot just after a drain read the ring).
    drained_tails: [u64; 2],
}

/// The shared heap of one mapped region (see the module docs).
pub struct SharedHeap {
    mem: Box<dyn RegionMemory>,
    owner: u64,
    /// The process that opened the heap: a forked child, which inherits the heap, does not
    /// hand back its parent's arenas.
    pid: u32,
    known: Mutex<Known>,
    /// The arena to allocate in first; views are kept until the heap is dropped.
    current: AtomicPtr<Current>,
    views: Mutex<Vec<std::sync::Arc<Current>>>,
    /// Nanoseconds after [`epoch`] of the last drain of the remote-free ring.
    last_drain: AtomicU64,
}

// SAFETY: the raw pointers are addresses in the mapping, which stays mapped while the heap
// is used; all shared state is behind the mutexes or atomics.
unsafe impl Send for SharedHeap {}
// SAFETY: as above.
unsafe impl Sync for SharedHeap {}

thread_local! {
    /// Allocations of this thread: every 256th looks at the clock for [`DRAIN_EVERY`].
    static DRAIN_TICK: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

fn corrupt(ino: u64, what: String) -> RegionsError {
    RegionsError::Invalid(format!(
        "region {ino}: the rmalloc directory is corrupt: {what}; the region's first {DIR_BYTES} \
         bytes were overwritten: recreate the region"
    ))
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl SharedHeap {
    /// The shared heap of the region `mem` maps, as owner `owner` ([`process_owner`]); with
    /// `create`, a directory is made in an empty region. `EINVAL` when the region holds other
    /// data, or (without `create`) no heap.
    pub fn open(mem: Box<dyn RegionMemory>, owner: u64, create: bool) -> Result<SharedHeap> {
        let ino = mem.ino();
        let no_heap = || RegionsError::Invalid(format!("region {ino} holds no rmalloc heap"));
        // Read through the region, not the mapping, which may be older than the heap.
        let mut w = [0u8; 8];
        let mut magic = match mem.read(W_MAGIC, &mut w) {
            Ok(()) => u64::from_le_bytes(w),
            // A region shorter than the directory holds no heap yet.
            Err(_) if (mem.mapped() as u64) < DIR_BYTES => 0,
            Err(e) => return Err(e),
        };
        if magic == 0 {
            if !create {
                return Err(no_heap());
            }
            mem.ensure_len(FIRST_REGION)?;
            let mut first = vec![0u8; DIR_BYTES as usize];
            mem.read(0, &mut first)?;
            let mut w = [0u8; 8];
            w.copy_from_slice(&first[..8]);
            magic = u64::from_le_bytes(w);
            if magic == 0 {
                // Another process may be creating the directory now; otherwise the region
                // must be empty.
                if first.iter().any(|&b| b != 0) {
                    return Err(RegionsError::Invalid(format!(
                        "region {ino} holds data that is not an rmalloc heap (its first \
                         {DIR_BYTES} bytes are not zero); use an empty region"
                    )));
                }
                magic = mem.cas(W_MAGIC, 0, DIR_MAGIC)?;
                if magic == 0 {
                    mem.cas(W_VERSION, 0, DIR_VERSION)?;
                    magic = DIR_MAGIC;
                }
            }
        }
        match magic {
            DIR_MAGIC => {}
            super::MAGIC => {
                return Err(RegionsError::Invalid(format!(
                    "region {ino} holds an rmalloc heap of the single-host layout of an older \
                     libregions; copy its data into a new region"
                )));
            }
            other => {
                return Err(RegionsError::Invalid(format!(
                    "region {ino} holds data that is not an rmalloc heap (first word {other:#x})"
                )));
            }
        }
        let heap = SharedHeap {
            mem,
            owner,
            pid: std::process::id(),
            known: Mutex::default(),
            current: AtomicPtr::new(std::ptr::null_mut()),
            views: Mutex::default(),
            last_drain: AtomicU64::new(now_ns()),
        };
        let mut k = heap.lock_known();
        heap.refresh(&mut k)?;
        drop(k);
        Ok(heap)
    }

    fn lock_known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn ino(&self) -> u64 {
        self.mem.ino()
    }

    fn word(&self, off: u64) -> Result<u64> {
        let mut w = [0u8; 8];
        self.mem.read(off, &mut w)?;
        Ok(u64::from_le_bytes(w))
    }

    /// The bump word: bytes claimed for arenas after the directory, checked.
    fn bump(&self) -> Result<u64> {
        let bump = self.word(W_BUMP)?;
        if bump > MAX_CLAIMED || !bump.is_multiple_of(PAGE as u64) {
            return Err(corrupt(
                self.ino(),
                format!("the claimed length is {bump:#x}"),
            ));
        }
        Ok(bump)
    }

    /// Reads the arena table again.
    fn refresh(&self, k: &mut Known) -> Result<()> {
        let count = self.word(W_COUNT)?.min(MAX_ARENAS);
        let mut table = vec![0u8; (count * ENTRY) as usize];
        self.mem.read(ENTRIES, &mut table)?;
        let bump = self.bump()?;
        let mut ranges = Vec::new();
        for i in 0..count as usize {
            let w = |j: usize| {
                let at = i * ENTRY as usize + j * 8;
                let mut b = [0u8; 8];
                b.copy_from_slice(&table[at..at + 8]);
                u64::from_le_bytes(b)
            };
            let (off, len, owner, host) = (w(0), w(1), w(2), w(3));
            if k.arenas.len() <= i {
                k.arenas.resize(i + 1, None);
            }
            if off == 0 || len == 0 {
                // Being created.
                continue;
            }
            if !off.is_multiple_of(PAGE as u64)
                || !len.is_multiple_of(PAGE as u64)
                || off < DIR_BYTES
                || off
                    .checked_add(len)
                    .is_none_or(|end| end > DIR_BYTES + bump)
            {
                return Err(corrupt(
                    self.ino(),
                    format!("arena {i} at offset {off:#x}, {len} bytes, past the claimed {bump}"),
                ));
            }
            ranges.push((off, len, i));
            let bad = k.arenas[i].is_some_and(|a| a.bad);
            k.arenas[i] = Some(Arena {
                off,
                len,
                owner,
                host,
                mine: owner == self.owner,
                bad,
            });
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(corrupt(
                    self.ino(),
                    format!("arenas {} and {} overlap", w[0].2, w[1].2),
                ));
            }
        }
        Ok(())
    }

    fn entry(i: usize, word: u64) -> u64 {
        ENTRIES + i as u64 * ENTRY + word
    }

    /// The heap view of an arena; maps it first if the region grew past this mapping.
    fn arena_heap(&self, a: &Arena) -> Result<Heap> {
        let end = a.off + a.len;
        if self.mem.mapped() < end as usize {
            self.mem.ensure_len(end)?;
        }
        // SAFETY: the arena lies inside the mapping (checked above), page aligned, and only
        // this process allocates in it while it owns it.
        unsafe { Heap::attach(self.mem.base().add(a.off as usize), a.len as usize) }
            .map_err(|e| self.heap_error(e))
    }

    fn heap_error(&self, e: HeapError) -> RegionsError {
        match e {
            HeapError::Corrupt(_) => RegionsError::Invalid(format!("region {}: {e}", self.ino())),
            e => e.into(),
        }
    }

    fn set_current(&self, k: &mut Known, i: usize) {
        let Some(a) = k.arenas[i] else { return };
        k.current = Some(i);
        let (base, len) = (self.mem.base() as usize + a.off as usize, a.len as usize);
        let mut views = self.views.lock().unwrap_or_else(|p| p.into_inner());
        // One view per arena and length: switching back and forth reuses them.
        let p = match views.iter().find(|v| v.base == base && v.len == len) {
            Some(v) => std::sync::Arc::as_ptr(v),
            None => {
                let v = std::sync::Arc::new(Current { base, len });
                let p = std::sync::Arc::as_ptr(&v);
                views.push(v);
                p
            }
        };
        self.current.store(p as *mut Current, Ordering::Release);
    }

    /// The arena to allocate in first, if this process owns one yet.
    pub fn current(&self) -> Option<&Current> {
        let p = self.current.load(Ordering::Acquire);
        // SAFETY: views live as long as the heap (kept in `views`).
        unsafe { p.as_ref() }
    }

    /// Allocates `len` bytes; returns the block's address in the mapping.
    pub fn alloc(&self, len: usize) -> Result<*mut u8> {
        if let Some(c) = self.current() {
            // SAFETY: the current arena is owned by this process and mapped.
            let heap = unsafe { Heap::attach(c.base(), c.len) }.map_err(|e| self.heap_error(e))?;
            match heap.alloc(len) {
                Ok(off) => {
                    if DRAIN_TICK
                        .try_with(|t| {
                            let n = t.get().wrapping_add(1);
                            t.set(n);
                            n % 256 == 0
                        })
                        .unwrap_or(false)
                    {
                        self.maybe_drain();
                    }
                    // SAFETY: the block lies inside the arena.
                    return Ok(unsafe { c.base().add(off as usize) });
                }
                // Full, or grown by another thread past this view of it: the locked path.
                Err(HeapError::Full { .. } | HeapError::NeedsMapping { .. }) => {}
                Err(e) => return Err(self.heap_error(e)),
            }
        }
        self.alloc_slow(len)
    }

    /// Drains the remote-free ring when [`DRAIN_EVERY`] passed since the last drain.
    pub fn maybe_drain(&self) {
        let last = self.last_drain.load(Ordering::Relaxed);
        let now = now_ns();
        if now.saturating_sub(last) < DRAIN_EVERY.as_nanos() as u64
            || self
                .last_drain
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let mut k = self.lock_known();
        if let Err(e) = self.drain(&mut k, false) {
            tracing::debug!(error = %e, "rmalloc: draining remote frees failed");
        }
    }

    #[cold]
    fn alloc_slow(&self, len: usize) -> Result<*mut u8> {
        let mut k = self.lock_known();
        let mut drained = false;
        // Rounds that grew or claimed space (adopting an arena is bounded by the table).
        let mut rounds = 0;
        while rounds < 16 {
            // Every arena this process owns, the current one first.
            let mut order: Vec<usize> = k
                .arenas
                .iter()
                .enumerate()
                .filter(|(_, a)| a.is_some_and(|a| a.mine && !a.bad))
                .map(|(i, _)| i)
                .collect();
            if let Some(c) = k.current {
                order.sort_by_key(|&i| i != c);
            }
            for i in order {
                let Some(a) = k.arenas[i] else { continue };
                let heap = match self.arena_heap(&a) {
                    Ok(h) => h,
                    Err(e) => {
                        tracing::warn!(arena = i, error = %e, "rmalloc: an arena of region {} is unusable; leaving it", self.ino());
                        self.give_up(&mut k, i);
                        continue;
                    }
                };
                match heap.alloc(len) {
                    Ok(off) => {
                        if k.current != Some(i) {
                            self.set_current(&mut k, i);
                        }
                        // SAFETY: the block lies inside the arena, inside the mapping.
                        return Ok(unsafe { heap.base().add(off as usize) });
                    }
                    Err(HeapError::Full { .. }) => {}
                    Err(e) => return Err(self.heap_error(e)),
                }
            }
            if !drained {
                drained = true;
                if self.drain(&mut k, true)? > 0 {
                    continue;
                }
            }
            if self.grow_current(&mut k, len)? {
                rounds += 1;
                continue;
            }
            if !self.claim(&mut k, len)? {
                rounds += 1;
            }
        }
        Err(RegionsError::NoMemory(format!(
            "rmalloc of {len} bytes in region {}: the region keeps filling up while it grows",
            self.ino()
        )))
    }

    /// Stops using arena `i` (it failed validation). It stays this process's (handing a heap
    /// that fails validation to another process helps nobody); it is never used again here.
    fn give_up(&self, k: &mut Known, i: usize) {
        if let Some(a) = k.arenas[i].as_mut() {
            a.bad = true;
        }
        if k.current == Some(i) {
            k.current = None;
            self.current.store(std::ptr::null_mut(), Ordering::Release);
        }
        // Fast paths that remember the arena (rmalloc_at) stop using it.
        if let Some(a) = k.arenas[i] {
            super::unmapping(self.mem.base().wrapping_add(a.off as usize), a.len as usize);
        }
    }

    /// Bytes a heap needs to serve a block of `len` bytes (the block, a page map, slack).
    fn need(len: usize) -> u64 {
        let pages = (len as u64).div_ceil(PAGE as u64) + 2;
        let bytes = pages * PAGE as u64;
        bytes + Heap::overhead_pages(bytes as usize * 2) * PAGE as u64 + MIN_HEAP as u64
    }

    /// Grows the current arena in place when it is the last in the region: true when it grew.
    fn grow_current(&self, k: &mut Known, len: usize) -> Result<bool> {
        let Some(i) = k.current else { return Ok(false) };
        let Some(a) = k.arenas[i] else {
            return Ok(false);
        };
        let bump = self.bump()?;
        if a.off + a.len != DIR_BYTES + bump {
            return Ok(false);
        }
        let region_end = DIR_BYTES + bump;
        let target = round_up(
            region_end + Self::need(len).max(a.len.min(MAX_STEP)),
            GROW_UNIT,
        );
        let new_bump = target - DIR_BYTES;
        if self.mem.cas(W_BUMP, bump, new_bump)? != bump {
            return Ok(false);
        }
        if let Err(e) = self.mem.ensure_len(target) {
            // Give the space back if nobody claimed after it.
            let _ = self.mem.cas(W_BUMP, new_bump, bump);
            return Err(RegionsError::NoMemory(format!(
                "region {} is full and cannot grow to {target} bytes: {e}",
                self.ino()
            )));
        }
        let new_len = target - a.off;
        let was = self.mem.cas(Self::entry(i, E_LEN), a.len, new_len)?;
        if was != a.len {
            return Err(corrupt(
                self.ino(),
                format!("the length of arena {i}, this process's, changed to {was}"),
            ));
        }
        let grown = Arena { len: new_len, ..a };
        k.arenas[i] = Some(grown);
        self.set_current(k, i);
        let heap = self.arena_heap(&grown)?;
        match heap.extend(new_len as usize) {
            // Not enough room for the page map to move: the next round grows further.
            Ok(()) | Err(HeapError::Full { .. }) => Ok(true),
            Err(e) => Err(self.heap_error(e)),
        }
    }

    /// Adopts an unowned arena (or one whose owner died on this kernel), or claims space for
    /// a new one; it becomes current. True when it adopted.
    fn claim(&self, k: &mut Known, len: usize) -> Result<bool> {
        self.refresh(k)?;
        for i in 0..k.arenas.len() {
            let Some(a) = k.arenas[i] else { continue };
            if a.mine || a.bad || (a.len as usize) < len {
                continue;
            }
            let owner = a.owner;
            if (owner == 0 || owner_gone(owner, a.host))
                && self.mem.cas(Self::entry(i, E_OWNER), owner, self.owner)? == owner
            {
                self.mem.cas(
                    Self::entry(i, E_HOST),
                    a.host,
                    super::thread_cache::host_ns(),
                )?;
                let adopted = Arena {
                    mine: true,
                    owner: self.owner,
                    ..a
                };
                k.arenas[i] = Some(adopted);
                // What this process cached of the arena while another owned it is stale.
                if (self.mem.mapped() as u64) >= a.off + a.len {
                    self.mem.invalidate(a.off, a.len)?;
                }
                match self.arena_heap(&adopted) {
                    Ok(_) => {
                        tracing::debug!(
                            arena = i,
                            off = a.off,
                            len = a.len,
                            previous = owner,
                            "rmalloc: adopted an arena"
                        );
                        self.set_current(k, i);
                        self.drain(k, true)?;
                        return Ok(true);
                    }
                    Err(e) => {
                        tracing::warn!(arena = i, error = %e, "rmalloc: an arena of region {} is unusable; leaving it", self.ino());
                        self.give_up(k, i);
                    }
                }
            }
        }
        // A new arena: its entry first (so a full table claims no space), then the space,
        // doubling what this process owns and at least what the block needs.
        let i = self.mem.fetch_add(W_COUNT, 1)?;
        if i >= MAX_ARENAS {
            return Err(RegionsError::NoMemory(format!(
                "region {} has {MAX_ARENAS} arenas, as many as its directory holds: fewer \
                 processes should allocate in it, or larger blocks",
                self.ino()
            )));
        }
        let i = i as usize;
        let entry_err = |what: &str, was: u64| {
            corrupt(
                self.ino(),
                format!("the {what} of new arena {i} was {was:#x}, not 0"),
            )
        };
        match self.mem.cas(Self::entry(i, E_OWNER), 0, self.owner)? {
            0 => {}
            was => return Err(entry_err("owner", was)),
        }
        self.mem
            .cas(Self::entry(i, E_HOST), 0, super::thread_cache::host_ns())?;
        let owned: u64 = k
            .arenas
            .iter()
            .flatten()
            .filter(|a| a.mine)
            .map(|a| a.len)
            .sum();
        let size = Self::need(len).max(owned.min(MAX_STEP));
        let mut bump = self.bump()?;
        let (off, end) = loop {
            let off = DIR_BYTES + bump;
            // The region ends on a chunk boundary; a first arena fills the first megabyte.
            let end = round_up(off + size, GROW_UNIT).max(FIRST_REGION);
            if end - DIR_BYTES > MAX_CLAIMED {
                return Err(RegionsError::NoMemory(format!(
                    "region {}: its arenas would pass {MAX_CLAIMED} bytes",
                    self.ino()
                )));
            }
            match self.mem.cas(W_BUMP, bump, end - DIR_BYTES)? {
                b if b == bump => break (off, end),
                _ => bump = self.bump()?,
            }
        };
        if let Err(e) = self.mem.ensure_len(end) {
            let _ = self.mem.cas(W_BUMP, end - DIR_BYTES, bump);
            return Err(RegionsError::NoMemory(format!(
                "region {} is full and cannot grow to {end} bytes: {e}",
                self.ino()
            )));
        }
        match self.mem.cas(Self::entry(i, E_LEN), 0, end - off)? {
            0 => {}
            was => return Err(entry_err("length", was)),
        }
        match self.mem.cas(Self::entry(i, E_OFF), 0, off)? {
            0 => {}
            was => return Err(entry_err("offset", was)),
        }
        if k.arenas.len() <= i {
            k.arenas.resize(i + 1, None);
        }
        let a = Arena {
            off,
            len: end - off,
            owner: self.owner,
            host: super::thread_cache::host_ns(),
            mine: true,
            bad: false,
        };
        k.arenas[i] = Some(a);
        self.arena_heap(&a)?;
        self.set_current(k, i);
        Ok(false)
    }

    /// Frees the block at `ptr`: in place when this process owns its arena, else posted to the
    /// arena's owner through the remote-free ring.
    pub fn free(&self, ptr: *const u8) -> Result<()> {
        let base = self.mem.base() as usize;
        let p = ptr as usize;
        let not_block = || {
            RegionsError::Invalid(format!(
                "not an rmalloc block: {ptr:p} is not inside an arena of region {}",
                self.ino()
            ))
        };
        if p < base + DIR_BYTES as usize {
            return Err(not_block());
        }
        let off = (p - base) as u64;
        if let Some(c) = self.current() {
            let cb = c.base;
            if p >= cb && p < cb + c.len {
                // SAFETY: the current arena is owned here and mapped.
                let heap =
                    unsafe { Heap::attach(c.base(), c.len) }.map_err(|e| self.heap_error(e))?;
                match heap.free((p - cb) as u64) {
                    // Grown by another thread past this view: the locked path.
                    Err(HeapError::NeedsMapping { .. }) => {}
                    r => return r.map_err(|e| self.heap_error(e)),
                }
            }
        }
        let mut k = self.lock_known();
        let mut found = Self::arena_of(&k, off);
        if found.is_none() {
            self.refresh(&mut k)?;
            found = Self::arena_of(&k, off);
        }
        let (i, a) = found.ok_or_else(not_block)?;
        if a.mine {
            let heap = self.arena_heap(&a)?;
            return heap.free(off - a.off).map_err(|e| self.heap_error(e));
        }
        drop(k);
        if !(off - a.off).is_multiple_of(super::ALIGN as u64) || off - a.off < PAGE as u64 {
            return Err(RegionsError::Invalid(format!(
                "not an rmalloc block: {ptr:p} (offset {off:#x} in arena {i} of region {})",
                self.ino()
            )));
        }
        self.post_remote_free(off)
    }

    fn arena_of(k: &Known, off: u64) -> Option<(usize, Arena)> {
        k.arenas.iter().enumerate().find_map(|(i, a)| {
            a.filter(|a| off >= a.off && off < a.off + a.len)
                .map(|a| (i, a))
        })
    }

    /// Posts the block at region offset `off` to the remote-free ring.
    fn post_remote_free(&self, off: u64) -> Result<()> {
        let until = Instant::now() + RING_WAIT;
        let mut pause = Duration::from_micros(100);
        loop {
            for _ in 0..RING_SLOTS.min(64) {
                let t = self.mem.fetch_add(W_RING_TAIL, 1)?;
                let slot = RING + (t % RING_SLOTS) * 8;
                if self.mem.cas(slot, 0, off)? == 0 {
                    return Ok(());
                }
            }
            if Instant::now() > until {
                return Err(RegionsError::Io {
                    what: format!(
                        "freeing offset {off:#x} of region {}: the remote-free ring is full (the \
                         processes owning its arenas are not allocating, so they do not take \
                         their blocks back)",
                        self.ino()
                    ),
                    source: std::io::Error::from_raw_os_error(libc::EAGAIN),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Takes the blocks of this process's arenas out of the remote-free ring and frees them;
    /// returns how many. Without `force`, does nothing when no free was posted since the last
    /// drain.
    fn drain(&self, k: &mut Known, force: bool) -> Result<usize> {
        self.last_drain.store(now_ns(), Ordering::Relaxed);
        let tail = self.word(W_RING_TAIL)?;
        if !force && tail == k.drained_tails[0] && tail == k.drained_tails[1] {
            return Ok(0);
        }
        k.drained_tails = [k.drained_tails[1], tail];
        if !k.arenas.iter().flatten().any(|a| a.mine) {
            return Ok(0);
        }
        let mut ring = vec![0u8; (RING_SLOTS * 8) as usize];
        self.mem.read(RING, &mut ring)?;
        let mut freed = 0;
        for (s, w) in ring.chunks_exact(8).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            let off = u64::from_le_bytes(b);
            if off == 0 {
                continue;
            }
            let Some((i, a)) = Self::arena_of(k, off).filter(|(_, a)| a.mine) else {
                continue;
            };
            let slot = RING + s as u64 * 8;
            if self.mem.cas(slot, off, 0)? != off {
                continue;
            }
            let heap = match self.arena_heap(&a) {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(arena = i, error = %e, "rmalloc: a block freed by another process is lost");
                    continue;
                }
            };
            match heap.free(off - a.off) {
                Ok(()) => freed += 1,
                Err(e) => tracing::warn!(
                    offset = off,
                    error = %e,
                    "rmalloc: another process freed something that is not a live block of region {}",
                    self.ino()
                ),
            }
        }
        Ok(freed)
    }

    /// Takes back the blocks other processes freed into this process's arenas now.
    pub fn drain_remote_frees(&self) -> Result<usize> {
        let mut k = self.lock_known();
        self.drain(&mut k, true)
    }

    /// Hands this process's arenas back: their thread caches go back to their heaps, their
    /// pages are written back, and the owner word is cleared, so another process adopts them.
    /// Does nothing in a forked child: the arenas stay its parent's.
    pub fn release(&self) -> Result<()> {
        if std::process::id() != self.pid {
            return Ok(());
        }
        let mut k = self.lock_known();
        let _ = self.drain(&mut k, true);
        self.current.store(std::ptr::null_mut(), Ordering::Release);
        k.current = None;
        let mut result = Ok(());
        for i in 0..k.arenas.len() {
            let Some(a) = k.arenas[i].filter(|a| a.mine) else {
                continue;
            };
            if (self.mem.mapped() as u64) >= a.off + a.len {
                let base = self.mem.base().wrapping_add(a.off as usize);
                // Thread caches go back, and fast paths stop using the arena ...
                super::unmapping(base, a.len as usize);
                // ... and an operation under the heap lock now finishes before the pages are
                // written back (threads of this process still allocating at exit, say).
                if !a.bad {
                    // SAFETY: the arena lies inside the mapping and holds a heap.
                    let heap = unsafe { Heap::view(base, a.len as usize) };
                    if let Ok(g) = heap.lock() {
                        drop(g);
                    }
                }
                if let Err(e) = self.mem.publish(a.off, a.len) {
                    // Not written back: another process must not continue from older pages.
                    result = Err(e);
                    continue;
                }
            }
            if let Err(e) = self.mem.cas(Self::entry(i, E_OWNER), self.owner, 0) {
                result = Err(e);
                continue;
            }
            k.arenas[i] = Some(Arena {
                mine: false,
                owner: 0,
                ..a
            });
        }
        result
    }

    /// The root block (rsetroot), as a region offset.
    pub fn root(&self) -> Result<Option<u64>> {
        match self.word(W_ROOT)?.checked_sub(1) {
            None => Ok(None),
            Some(off) if off < DIR_BYTES || off >= DIR_BYTES + self.bump()? => Err(corrupt(
                self.ino(),
                format!("the root slot holds offset {off:#x}, outside every arena"),
            )),
            Some(off) => Ok(Some(off)),
        }
    }

    /// Stores the root block's region offset (None clears it).
    pub fn set_root(&self, off: Option<u64>) -> Result<()> {
        let v = match off {
            None => 0,
            Some(o) if o >= DIR_BYTES => o + 1,
            Some(o) => {
                return Err(RegionsError::Invalid(format!(
                    "root offset {o:#x} is inside the rmalloc directory of region {}",
                    self.ino()
                )));
            }
        };
        let mut cur = self.word(W_ROOT)?;
        for _ in 0..1000 {
            match self.mem.cas(W_ROOT, cur, v)? {
                b if b == cur => return Ok(()),
                b => cur = b,
            }
        }
        Err(RegionsError::Invalid(format!(
            "region {}: the root slot keeps changing",
            self.ino()
        )))
    }

    /// Every arena of the region: (region offset, length, owned by this process), as the
    /// directory says now.
    pub fn arenas(&self) -> Result<Vec<(u64, u64, bool)>> {
        let mut k = self.lock_known();
        self.refresh(&mut k)?;
        Ok(k.arenas
            .iter()
            .flatten()
            .map(|a| (a.off, a.len, a.mine))
            .collect())
    }

    /// Blocks (region offsets) other processes freed that wait in the remote-free ring for
    /// their arenas' owners.
    pub fn pending_remote_frees(&self) -> Result<Vec<u64>> {
        let mut ring = vec![0u8; (RING_SLOTS * 8) as usize];
        self.mem.read(RING, &mut ring)?;
        Ok(ring
            .chunks_exact(8)
            .filter_map(|w| {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                Some(u64::from_le_bytes(b)).filter(|&o| o != 0)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_mem::Mem;
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    /// Coherent memory standing in for a region: every "process" sees the same bytes.
    struct TestRegion {
        mem: Arc<Mem>,
        len: Arc<AtomicUsize>,
        /// Ranges the heap dropped from its (here nonexistent) cache.
        invalidated: Arc<Mutex<Vec<(u64, u64)>>>,
    }

    impl TestRegion {
        fn word(&self, off: u64) -> &AtomicU64 {
            assert!(
                off as usize + 8 <= self.len.load(Ordering::SeqCst),
                "word past the end"
            );
            // SAFETY: inside the test memory, 8-byte aligned.
            unsafe { &*(self.mem.ptr.add(off as usize) as *const AtomicU64) }
        }
    }

    impl RegionMemory for TestRegion {
        fn base(&self) -> *mut u8 {
            self.mem.ptr
        }
        fn mapped(&self) -> usize {
            self.len.load(Ordering::SeqCst)
        }
        fn ensure_len(&self, len: u64) -> Result<()> {
            if len as usize > self.mem.len {
                return Err(RegionsError::NoMemory("test memory".into()));
            }
            self.len.fetch_max(len as usize, Ordering::SeqCst);
            Ok(())
        }
        fn cas(&self, off: u64, expected: u64, new: u64) -> Result<u64> {
            Ok(
                match self.word(off).compare_exchange(
                    expected,
                    new,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(v) | Err(v) => v,
                },
            )
        }
        fn fetch_add(&self, off: u64, add: u64) -> Result<u64> {
            Ok(self.word(off).fetch_add(add, Ordering::SeqCst))
        }
        fn read(&self, off: u64, buf: &mut [u8]) -> Result<()> {
            if off as usize + buf.len() > self.mapped() {
                return Err(RegionsError::Invalid("read past the test region".into()));
            }
            // Word by word, atomically, as the transport reads words another host changes.
            assert!(off.is_multiple_of(8) && buf.len().is_multiple_of(8));
            for (i, b) in buf.chunks_exact_mut(8).enumerate() {
                b.copy_from_slice(
                    &self
                        .word(off + i as u64 * 8)
                        .load(Ordering::SeqCst)
                        .to_le_bytes(),
                );
            }
            Ok(())
        }
        fn publish(&self, _off: u64, _len: u64) -> Result<()> {
            Ok(())
        }
        fn invalidate(&self, off: u64, len: u64) -> Result<()> {
            self.invalidated.lock().unwrap().push((off, len));
            Ok(())
        }
        fn ino(&self) -> u64 {
            7
        }
    }

    fn region(len: usize) -> (Arc<Mem>, Arc<AtomicUsize>) {
        (Arc::new(Mem::new(len)), Arc::new(AtomicUsize::new(0)))
    }

    fn process(r: &(Arc<Mem>, Arc<AtomicUsize>), owner: u64) -> SharedHeap {
        process_noting(r, owner, Arc::default())
    }

    fn process_noting(
        r: &(Arc<Mem>, Arc<AtomicUsize>),
        owner: u64,
        invalidated: Arc<Mutex<Vec<(u64, u64)>>>,
    ) -> SharedHeap {
        let mem = TestRegion {
            mem: Arc::clone(&r.0),
            len: Arc::clone(&r.1),
            invalidated,
        };
        SharedHeap::open(Box::new(mem), owner, true).unwrap()
    }

    #[test]
    fn one_process_keeps_one_arena_that_grows_in_place() {
        let r = region(64 << 20);
        let h = process(&r, 11);
        let mut blocks = Vec::new();
        for i in 0..2000 {
            let p = h.alloc(if i % 10 == 0 { 9000 } else { 100 }).unwrap();
            blocks.push(p);
        }
        let arenas = h.arenas().unwrap();
        assert_eq!(arenas.len(), 1, "{arenas:?}");
        assert_eq!(arenas[0].0, DIR_BYTES);
        assert!(arenas[0].1 > FIRST_REGION, "{arenas:?}");
        for p in blocks {
            h.free(p).unwrap();
        }
    }

    #[test]
    fn threads_allocate_while_another_grows_their_arena() {
        let r = region(512 << 20);
        let h = Arc::new(process(&r, 12));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let h = Arc::clone(&h);
                std::thread::spawn(move || {
                    let mut blocks = Vec::new();
                    for i in 0..300 {
                        let len = if (i + t) % 3 == 0 { 24 << 10 } else { 200 };
                        blocks.push(h.alloc(len).unwrap() as usize);
                        if i % 4 == 0 {
                            h.free(blocks.swap_remove(0) as *const u8).unwrap();
                        }
                    }
                    blocks
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(h.arenas().unwrap().len(), 1);
    }

    #[test]
    fn processes_allocate_in_disjoint_arenas_and_free_each_others_blocks() {
        let r = region(256 << 20);
        let a = process(&r, 21);
        let b = process(&r, 22);
        let pa: Vec<usize> = (0..500).map(|_| a.alloc(64).unwrap() as usize).collect();
        let pb: Vec<usize> = (0..500).map(|_| b.alloc(64).unwrap() as usize).collect();
        let arenas = a.arenas().unwrap();
        assert_eq!(arenas.len(), 2, "{arenas:?}");
        let in_arena = |p: usize, (off, len, _): (u64, u64, bool)| {
            let o = (p - r.0.ptr as usize) as u64;
            o >= off && o < off + len
        };
        let (mine_a, mine_b) = (arenas[0], arenas[1]);
        assert!(pa.iter().all(|&p| in_arena(p, mine_a)));
        assert!(pb.iter().all(|&p| in_arena(p, mine_b)));
        // b frees a's blocks: they wait in the ring until a takes them back.
        for &p in &pa[..100] {
            b.free(p as *const u8).unwrap();
        }
        assert_eq!(b.pending_remote_frees().unwrap().len(), 100);
        assert_eq!(a.drain_remote_frees().unwrap(), 100);
        assert_eq!(a.pending_remote_frees().unwrap().len(), 0);
        // Freed by a now, they are free: a second free of one is refused.
        let err = a.free(pa[0] as *const u8).unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL, "{err}");
        // Outside every arena, and inside the directory.
        assert_eq!(b.free(r.0.ptr).unwrap_err().errno(), libc::EINVAL);
    }

    #[test]
    fn a_released_arena_is_adopted_with_its_blocks_and_remote_frees() {
        let r = region(64 << 20);
        let a = process(&r, 31);
        let p = a.alloc(64).unwrap();
        let q = a.alloc(64).unwrap();
        a.set_root(Some((q as usize - r.0.ptr as usize) as u64))
            .unwrap();
        a.release().unwrap();
        drop(a);
        let dropped = Arc::new(Mutex::new(Vec::new()));
        let b = process_noting(&r, 32, Arc::clone(&dropped));
        // b frees p before it owns anything: posted to the ring.
        b.free(p).unwrap();
        assert_eq!(b.pending_remote_frees().unwrap().len(), 1);
        // b's first allocation adopts a's arena and takes p back; q stays live.
        let n = b.alloc(64).unwrap();
        let arenas = b.arenas().unwrap();
        assert_eq!(arenas.len(), 1);
        // What b may have cached of the arena before it adopted it was dropped first.
        assert_eq!(*dropped.lock().unwrap(), vec![(arenas[0].0, arenas[0].1)]);
        assert_eq!(b.pending_remote_frees().unwrap().len(), 0);
        assert_eq!(n, p, "the block freed remotely is reused");
        assert_eq!(
            b.root().unwrap(),
            Some((q as usize - r.0.ptr as usize) as u64)
        );
        b.free(q).unwrap();
        assert!(b.free(q).is_err());
    }

    #[test]
    fn a_corrupt_directory_is_refused_not_followed() {
        let r = region(64 << 20);
        let a = process(&r, 61);
        let p = a.alloc(64).unwrap();
        a.set_root(Some((p as usize - r.0.ptr as usize) as u64))
            .unwrap();
        let mem = TestRegion {
            mem: Arc::clone(&r.0),
            len: Arc::clone(&r.1),
            invalidated: Arc::default(),
        };
        let word = |off: u64| mem.word(off);
        // Another process opening the heap is refused (EINVAL naming the directory), and so
        // is the owner's next look at the table.
        let expect_einval = |what: &str| {
            let other = TestRegion {
                mem: Arc::clone(&r.0),
                len: Arc::clone(&r.1),
                invalidated: Arc::default(),
            };
            let e = SharedHeap::open(Box::new(other), 62, true)
                .err()
                .unwrap_or_else(|| panic!("{what}: a corrupt directory was opened"));
            assert_eq!(e.errno(), libc::EINVAL, "{what}: {e}");
            assert!(
                e.to_string().contains("directory is corrupt"),
                "{what}: {e}"
            );
            let e = a.arenas().unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL, "{what}: {e}");
        };
        // A claimed length past any region.
        let bump = word(W_BUMP).load(Ordering::SeqCst);
        word(W_BUMP).store(u64::MAX - 4095, Ordering::SeqCst);
        expect_einval("bump");
        word(W_BUMP).store(bump, Ordering::SeqCst);
        // A second entry over the first arena.
        let e1 = |w: u64| word(SharedHeap::entry(1, w));
        word(W_COUNT).store(2, Ordering::SeqCst);
        e1(E_OFF).store(DIR_BYTES + PAGE as u64, Ordering::SeqCst);
        e1(E_LEN).store(PAGE as u64, Ordering::SeqCst);
        expect_einval("overlap");
        e1(E_OFF).store(0, Ordering::SeqCst);
        e1(E_LEN).store(0, Ordering::SeqCst);
        // A root outside every arena.
        word(W_ROOT).store(DIR_BYTES + bump + 1, Ordering::SeqCst);
        assert_eq!(a.root().unwrap_err().errno(), libc::EINVAL);
        word(W_ROOT).store(16, Ordering::SeqCst);
        assert_eq!(a.root().unwrap_err().errno(), libc::EINVAL);
        // Repaired, the heap works again.
        word(W_ROOT).store(0, Ordering::SeqCst);
        a.free(p).unwrap();
        assert!(a.arenas().is_ok());
    }

    #[test]
    fn a_forked_child_does_not_hand_back_its_parents_arenas() {
        let r = region(64 << 20);
        let h = process(&r, 51);
        h.alloc(64).unwrap();
        // SAFETY: the child only calls release (no locks held by other threads of this
        // test are needed: the heap's mutex is free) and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = if h.release().is_ok() { 0 } else { 1 };
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(status, 0);
        let arenas = h.arenas().unwrap();
        assert!(arenas.iter().all(|a| a.2), "{arenas:?}");
        h.release().unwrap();
        assert!(h.arenas().unwrap().iter().all(|a| !a.2));
    }

    #[test]
    fn an_arena_of_a_dead_process_of_this_kernel_is_taken_over() {
        let r = region(64 << 20);
        let me = process_owner().unwrap();
        let host = super::super::thread_cache::host_ns();
        // This process's pid with another start time: a process that used the pid before.
        let dead = me ^ (1 << 22);
        assert!(owner_gone(dead, host));
        assert!(!owner_gone(me, host));
        // Another kernel's process is never thought gone.
        assert!(!owner_gone(dead, host ^ 1));
        assert!(!owner_gone(dead ^ (1 << 40), host));
        let a = process(&r, dead);
        a.alloc(64).unwrap();
        drop(a);
        let b = process(&r, me);
        b.alloc(64).unwrap();
        assert_eq!(
            b.arenas().unwrap().len(),
            1,
            "the dead owner's arena was adopted"
        );
    }

    #[test]
    fn threads_of_several_processes_allocate_at_once_without_overlap() {
        let r = region(512 << 20);
        let heaps: Vec<Arc<SharedHeap>> = (0..3).map(|i| Arc::new(process(&r, 40 + i))).collect();
        let mut threads = Vec::new();
        for (hi, h) in heaps.iter().enumerate() {
            for t in 0..2 {
                let h = Arc::clone(h);
                let other = Arc::clone(&heaps[(hi + 1) % 3]);
                threads.push(std::thread::spawn(move || {
                    let mut live: Vec<(usize, usize, u8)> = Vec::new();
                    let mut x = (hi * 2 + t) as u64 * 7919 + 1;
                    for i in 0..20_000 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if live.len() < 200 && !x.is_multiple_of(3) {
                            let len = 16 + (x as usize % 3000);
                            let p = h.alloc(len).unwrap();
                            let tag = (i % 251) as u8;
                            // SAFETY: a fresh block of len bytes.
                            unsafe { std::ptr::write_bytes(p, tag, len) };
                            live.push((p as usize, len, tag));
                        } else if !live.is_empty() {
                            let (p, len, tag) = live.swap_remove(x as usize % live.len());
                            // SAFETY: a live block of ours.
                            let s = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
                            assert!(s.iter().all(|&b| b == tag), "a block was overwritten");
                            // Every twentieth free goes through the next process's heap.
                            if i % 20 == 0 {
                                other.free(p as *const u8).unwrap();
                            } else {
                                h.free(p as *const u8).unwrap();
                            }
                        }
                    }
                    live
                }));
            }
        }
        let mut all: Vec<(usize, usize)> = Vec::new();
        for t in threads {
            for (p, len, tag) in t.join().unwrap() {
                // SAFETY: a live block.
                let s = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
                assert!(s.iter().all(|&b| b == tag));
                all.push((p, len));
            }
        }
        all.sort();
        for w in all.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "blocks overlap: {w:?}");
        }
        for h in &heaps {
            h.drain_remote_frees().unwrap();
        }
        assert_eq!(heaps[0].pending_remote_frees().unwrap().len(), 0);
    }
}
