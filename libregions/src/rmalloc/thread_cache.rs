//! Thread caches (see the module docs of [`super`], "Layout" and
//! "Concurrency"): every thread keeps, per heap, a small stack of free blocks
//! per size class in a *record* in the heap itself, so that most small
//! allocations and frees take no lock. This module holds the records, their
//! lock-free fast paths, their refill and flush under the lock, the take-back
//! of dead threads' records, and the per-thread bookkeeping that finds a
//! thread's record and forgets it when the memory is unmapped
//! ([`unmapping`]) or the process forks.

use std::cell::{Cell, RefCell};
use std::ptr;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, Once, OnceLock};

use super::cache_mirror;
use super::lock::{current_tid, forget_current_tid, pid_namespace, thread_alive};
use super::size_class::{
    CLASS_SIZES, GEOMETRY, NCLASSES, block_index, block_index_with, reciprocal,
};
use super::{
    ALIGN, CACHED, HResult, Heap, HeapError, K_CACHE, K_FREE_IN, K_SLAB, LIVE, PAGE, PAGE_SHIFT,
    SLAB_HDR, SLAB_MAGIC, corrupt_with, entry, kind, value,
};

/// Most blocks a thread caches per size class.
const CACHE_CAP: usize = 32;
/// Blocks cached per class: about a page's worth, 4 to 32.
const CACHE_CAPS: [u8; NCLASSES] = {
    let mut caps = [0u8; NCLASSES];
    let mut c = 0;
    while c < NCLASSES {
        let n = PAGE / CLASS_SIZES[c] as usize;
        caps[c] = if n > CACHE_CAP {
            CACHE_CAP as u8
        } else if n < 4 {
            4
        } else {
            n as u8
        };
        c += 1;
    }
    caps
};
/// Caches store offsets / 16 in a u32: heaps up to 64 GiB use them.
const CACHE_MAX_LEN: u64 = 1 << 36;
const CACHE_MAGIC: u64 = u64::from_le_bytes(*b"RGNCACHE");
/// A record that could not be created (the heap is full) is retried after
/// this many operations of the thread on that heap.
const CACHE_RETRY: u32 = 256;

/// A thread's cache of one heap, kept in the heap (one page, page map kind
/// `K_CACHE`, linked from [`Header::caches`](super::Header::caches)) so that
/// other processes see which blocks it holds and can take them back when the
/// owner is dead.
/// Only the owner changes it, without the heap lock; others read it under
/// the lock (the counts, for statistics) or take it over when the owner
/// thread no longer exists.
///
/// Read from the heap, so checked before use: `count[c]` must not exceed
/// `CACHE_CAPS[c]`, `next` must be 0 or a page whose map entry says
/// `K_CACHE` and that holds a record, and every slot must be a block of its
/// class in a valid slab whose state byte says "cached" ([`CACHED`], or 0
/// in heaps of older versions of this library).
#[repr(C)]
pub(super) struct CacheRec {
    magic: u64,
    /// Host (boot id) and pid namespace of the owner thread.
    owner_ns: AtomicU64,
    pub(super) owner_tid: AtomicU32,
    owner_pid: AtomicU32,
    /// Next record (under the heap lock).
    next: u64,
    pub(super) count: [AtomicU8; NCLASSES],
    _pad: [u8; 8],
    /// Cached blocks per class, offset / 16; the newest last.
    slots: [[u32; CACHE_CAP]; NCLASSES],
}

const _: () = assert!(std::mem::size_of::<CacheRec>() <= PAGE);
// A thread's mirror has an entry for every slot of its record.
const _: () = assert!(cache_mirror::MIRROR_CAP == CACHE_CAP);

/// The last heap this thread used, for the lock-free paths.
#[derive(Clone, Copy)]
struct FastCache {
    base: usize,
    rec: *mut CacheRec,
    epoch: u64,
}

const NO_FAST: FastCache = FastCache {
    base: 0,
    rec: ptr::null_mut(),
    epoch: 0,
};

/// This thread's record in one heap.
struct CacheEntry {
    base: usize,
    /// Longest view of the heap this thread used.
    mapped: usize,
    /// The record's offset, 0 while there is none.
    rec: u64,
    /// [`GEN`] when the entry was last known valid.
    epoch: u64,
    retry: u32,
}

/// A thread's records; flushed back to their heaps when the thread exits.
struct ThreadCaches(Vec<CacheEntry>);

thread_local! {
    static FAST: Cell<FastCache> = const { Cell::new(NO_FAST) };
    static CACHES: RefCell<ThreadCaches> = const { RefCell::new(ThreadCaches(Vec::new())) };
}

/// Bumped whenever heap memory is unmapped ([`unmapping`]); a thread's
/// entries from before are checked against [`UNMAPS`] before use.
static GEN: AtomicU64 = AtomicU64::new(1);

/// Memory unmapped since start, by generation.
struct UnmapLog {
    /// Entries older than this generation were dropped from `log`.
    floor: u64,
    log: Vec<(u64, usize, usize)>,
}

const UNMAP_LOG_MAX: usize = 4096;

static UNMAPS: Mutex<UnmapLog> = Mutex::new(UnmapLog {
    floor: 0,
    log: Vec::new(),
});

fn lock_unmaps() -> std::sync::MutexGuard<'static, UnmapLog> {
    UNMAPS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl UnmapLog {
    fn unmapped_since(&self, e: &CacheEntry) -> bool {
        e.epoch < self.floor
            || self
                .log
                .iter()
                .rev()
                .take_while(|(g, _, _)| *g > e.epoch)
                .any(|&(_, b, l)| e.base >= b && e.base < b + l)
    }
}

impl ThreadCaches {
    /// Drops the entries of heaps unmapped since they were last checked.
    fn revalidate(&mut self, cur: u64) {
        if self.0.iter().all(|e| e.epoch == cur) {
            return;
        }
        let log = lock_unmaps();
        self.0.retain_mut(|e| {
            if e.epoch == cur {
                return true;
            }
            if log.unmapped_since(e) {
                return false;
            }
            e.epoch = cur;
            true
        });
    }
}

impl Drop for ThreadCaches {
    fn drop(&mut self) {
        let _ = FAST.try_with(|f| f.set(NO_FAST));
        if self.0.iter().all(|e| e.rec == 0) {
            return;
        }
        // Held while flushing: memory cannot be unmapped meanwhile.
        let log = lock_unmaps();
        for e in self.0.drain(..) {
            if e.rec == 0 || log.unmapped_since(&e) {
                continue;
            }
            let heap = Heap {
                base: e.base as *mut u8,
                mapped: e.mapped,
            };
            if let Err(err) = heap.record_close(e.rec) {
                tracing::debug!(error = %err, "rmalloc: a thread cache stays in its heap");
            }
        }
    }
}

/// Tells the allocator that the `len` bytes at `base`, which may hold a
/// heap, are about to be unmapped: the calling thread's cache of that heap
/// goes back to the heap now, and other threads of this process forget
/// theirs (their records stay in the heap with the blocks they hold, and
/// are taken back by the next thread that opens a cache there once the
/// owner has exited). Call it before unmapping memory that [`Heap`] views
/// used; [`crate::mapping::unmap`] does, through the hook this module registers with
/// [`crate::mapping::on_unmap`] when a thread first opens a cache.
pub fn unmapping(base: *mut u8, len: usize) {
    let mut log = lock_unmaps();
    let b = base as usize;
    let _ = FAST.try_with(|f| f.set(NO_FAST));
    let mine: Vec<CacheEntry> = CACHES
        .try_with(|c| {
            c.try_borrow_mut()
                .map(|mut c| {
                    let (gone, keep) = std::mem::take(&mut c.0)
                        .into_iter()
                        .partition(|e| e.base >= b && e.base < b + len);
                    c.0 = keep;
                    gone
                })
                .unwrap_or_default()
        })
        .unwrap_or_default();
    for e in mine {
        if e.rec != 0 && !log.unmapped_since(&e) {
            let heap = Heap {
                base: e.base as *mut u8,
                mapped: e.mapped,
            };
            if let Err(err) = heap.record_close(e.rec) {
                tracing::debug!(error = %err, "rmalloc: a thread cache stays in its heap");
            }
        }
    }
    let g = GEN.fetch_add(1, Ordering::AcqRel) + 1;
    if log.log.len() >= UNMAP_LOG_MAX {
        let drop_n = UNMAP_LOG_MAX / 2;
        log.floor = log.log[drop_n].0;
        log.log.drain(..drop_n);
    }
    log.log.push((g, b, len));
}

/// Changes whenever heap memory of this process is unmapped (see
/// [`unmapping`]): a cached view of a mapping taken at the same epoch is
/// still mapped.
pub fn unmap_epoch() -> u64 {
    // A caller that keeps a view of a mapping with this epoch must hear of its unmapping.
    register_process_hooks();
    GEN.load(Ordering::Acquire)
}

/// [`unmap_epoch`] for a caller that called it once before (the hooks are registered).
#[inline]
pub fn unmap_epoch_registered() -> u64 {
    GEN.load(Ordering::Acquire)
}

extern "C" fn after_fork_child() {
    // The child's only thread has a new id, and the records it copied
    // belong to the parent's threads.
    forget_current_tid();
    let _ = FAST.try_with(|f| f.set(NO_FAST));
    cache_mirror::forget();
    let _ = CACHES.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            c.0.clear();
        }
    });
}

/// Registers, once per process, what thread caches need to hear of: a fork (the child
/// starts without caches) and the unmapping of a region (see [`unmapping`]).
fn register_process_hooks() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain function without preconditions.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
        crate::mapping::on_unmap(unmapping);
    });
}

/// Identity of this host's pid namespace: the boot id and the namespace's
/// inode (the same inode numbers recur on other machines).
pub(super) fn host_ns() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let mut x = 0xcbf2_9ce4_8422_2325u64;
        for b in boot.iter().chain(&pid_namespace().to_le_bytes()) {
            x ^= *b as u64;
            x = x.wrapping_mul(0x0100_0000_01b3);
        }
        x.max(1)
    })
}

/// The error for a record whose count of `class` is `n`, over the cap.
#[cold]
fn bad_count(rec: u64, class: usize, n: usize) -> HeapError {
    corrupt_with(move || {
        format!(
            "thread cache record {rec:#x}: the count of class {class} is {n}, more than the \
             {} blocks a cache of that class holds",
            CACHE_CAPS[class]
        )
    })
}

/// Puts the block at `off`, whose state byte `state` says [`LIVE`], on top of `class` in
/// record `rec`, which holds `n` blocks of that class, and sets the byte to [`CACHED`].
///
/// # Safety
///
/// `rec` is the calling thread's record, inside the mapped heap, and `n` is below
/// `CACHE_CAPS[class]`.
#[inline(always)]
unsafe fn push_cached(rec: *mut CacheRec, class: usize, n: usize, off: u64, state: &AtomicU8) {
    state.store(CACHED, Ordering::Relaxed);
    // SAFETY: per the contract; only this thread changes its record.
    unsafe {
        (*rec).slots[class][n] = (off >> 4) as u32;
        (*rec).count[class].store(n as u8 + 1, Ordering::Relaxed);
    }
}

impl Heap {
    /// The offset from the heap's base of the state byte `state` (inside the heap).
    fn offset_of(&self, state: &AtomicU8) -> u64 {
        (state as *const AtomicU8 as usize).wrapping_sub(self.base as usize) as u64
    }

    /// Takes the top block of `class` from the calling thread's cache of this heap, without
    /// the lock and without checking the block again, when the thread's mirror holds it
    /// (see `cache_mirror`). This is the part that inlines into callers; None sends them to
    /// [`Heap::alloc_from_cache`].
    #[inline(always)]
    pub(super) fn alloc_mirrored(&self, class: usize) -> Option<u64> {
        let epoch = GEN.load(Ordering::Relaxed);
        // The block the mirror says is on top, where it found its state byte, when the
        // record still says so (see `cache_mirror`).
        cache_mirror::with_record(self.base as usize, epoch, |m, rec| {
            let rec = rec as *mut CacheRec;
            let mut off = 0u64;
            // SAFETY: rec is this thread's record in this heap (the mirror follows it), mapped
            // in this epoch; only this thread changes it.
            let n = unsafe { (*rec).count[class].load(Ordering::Relaxed) } as usize;
            m.pop(class, n, |e| {
                // SAFETY: as above; n is the mirror's count of the class, at most CACHE_CAP.
                unsafe {
                    if (*rec).slots[class][n - 1] != e.slot {
                        return false;
                    }
                    let o = (e.slot as u64) << 4;
                    if o as usize + CLASS_SIZES[class] as usize > self.mapped {
                        return false;
                    }
                    // SAFETY: the state byte of this block, found inside the heap's mapping
                    // when the block was checked, in this unmap epoch (still mapped).
                    let state = &*((self.base as usize + o as usize)
                        .wrapping_add_signed(e.state as isize)
                        as *const AtomicU8);
                    // Cached: CACHED, or 0 in heaps of older versions.
                    if state.load(Ordering::Relaxed) & !CACHED != 0 {
                        return false;
                    }
                    state.store(LIVE, Ordering::Relaxed);
                    (*rec).count[class].store(n as u8 - 1, Ordering::Relaxed);
                    off = o;
                }
                true
            })
            .then_some(off)
        })
    }

    /// Takes a block of `class` from the calling thread's cache of this heap
    /// without the lock (refilling an empty cache under it), checking the block;
    /// None when the thread has no cache here (the caller takes the locked path).
    pub(super) fn alloc_from_cache(&self, class: usize) -> Option<HResult<u64>> {
        let rec = self.thread_cache(true)?;
        // SAFETY: rec is this thread's record, inside the heap; only
        // this thread changes it.
        unsafe {
            let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
            // The count is heap memory: a slot index only when below the cap.
            if n > 0 && n <= CACHE_CAPS[class] as usize {
                let off = ((*rec).slots[class][n - 1] as u64) << 4;
                // Cached: CACHED, or 0 in heaps of older versions.
                if let Some(state) = self.cached_block_bit(off, class)
                    && state.load(Ordering::Relaxed) & !CACHED == 0
                {
                    state.store(LIVE, Ordering::Relaxed);
                    (*rec).count[class].store(n as u8 - 1, Ordering::Relaxed);
                    self.mirror_fill(rec, class);
                    return Some(Ok(off));
                }
            }
        }
        Some(self.alloc_cache_miss(rec, class))
    }

    /// Fills this thread's mirror of `class` from its record `rec`, checking every slot;
    /// empties it when a slot is not a cached block of the class (the checked path then
    /// says why).
    #[cold]
    fn mirror_fill(&self, rec: *mut CacheRec, class: usize) {
        let epoch = GEN.load(Ordering::Acquire);
        let mut entries = [cache_mirror::Entry { slot: 0, state: 0 }; CACHE_CAP];
        // SAFETY: rec is this thread's record; only this thread changes it.
        let n = unsafe { (*rec).count[class].load(Ordering::Relaxed) } as usize;
        let mut good = n <= CACHE_CAPS[class] as usize;
        if good {
            for (i, e) in entries[..n].iter_mut().enumerate() {
                // SAFETY: as above; i < n <= CACHE_CAPS[class] <= CACHE_CAP.
                let slot = unsafe { (*rec).slots[class][i] };
                let off = (slot as u64) << 4;
                let entry = self.cached_block_bit(off, class).and_then(|state| {
                    (state.load(Ordering::Relaxed) & !CACHED == 0)
                        .then(|| cache_mirror::Entry::of(off, self.offset_of(state)))
                        .flatten()
                });
                match entry {
                    Some(entry) => *e = entry,
                    None => {
                        good = false;
                        break;
                    }
                }
            }
        }
        let k = if good { n } else { 0 };
        cache_mirror::fill(
            self.base as usize,
            rec as usize,
            epoch,
            class,
            &entries[..k],
        );
    }

    /// The cache of `class` is empty (refill it), or its count or top slot
    /// is bad.
    #[inline(never)]
    fn alloc_cache_miss(&self, rec: *mut CacheRec, class: usize) -> HResult<u64> {
        // SAFETY: rec is this thread's record.
        let n = unsafe { (*rec).count[class].load(Ordering::Relaxed) } as usize;
        if n == 0 {
            return self.alloc_refill(rec, class);
        }
        // Outside this view, or not a free block: check the header under the
        // lock, then drop the slot (or, for a bad count, the class's slots).
        let _g = self.lock()?;
        self.check_header()?;
        if n > CACHE_CAPS[class] as usize {
            // SAFETY: as above.
            unsafe { (*rec).count[class].store(0, Ordering::Relaxed) };
            return Err(bad_count(self.rec_off(rec), class, n));
        }
        // SAFETY: as above; n - 1 < CACHE_CAPS[class] <= CACHE_CAP.
        let off = unsafe {
            (*rec).count[class].store(n as u8 - 1, Ordering::Relaxed);
            ((*rec).slots[class][n - 1] as u64) << 4
        };
        Err(corrupt_with(move || {
            format!(
                "thread cache record {:#x} holds offset {off:#x} in slot {} of class {class}, \
                 which is not a free block of that class",
                self.rec_off(rec),
                n - 1
            )
        }))
    }

    /// The offset of the record at `rec` (for messages).
    fn rec_off(&self, rec: *mut CacheRec) -> u64 {
        (rec as usize).wrapping_sub(self.base as usize) as u64
    }

    /// Refills the empty cache of `class` in this thread's record `rec`
    /// under the lock and hands out its first block.
    #[cold]
    fn alloc_refill(&self, rec: *mut CacheRec, class: usize) -> HResult<u64> {
        let _g = self.lock()?;
        self.check_header()?;
        let h = self.header();
        // SAFETY: the header is mapped.
        let want = if unsafe { (*h).len } > CACHE_MAX_LEN {
            // Offsets past 64 GiB do not fit a slot: hand out one block only.
            1
        } else {
            (CACHE_CAPS[class] as usize / 2).max(1)
        };
        let mut got = [0u64; CACHE_CAP];
        // The first block goes to the caller (LIVE), the others to the cache.
        let n = self.take_small_n(class, LIVE, &mut got[..want])?;
        if n == 0 {
            // Blocks of other classes in this thread's cache may hold the
            // pages: give them back and try once more.
            self.flush_record(rec, None)?;
            return self.alloc_locked(CLASS_SIZES[class] as usize);
        }
        let size = CLASS_SIZES[class] as u64;
        // SAFETY: the header is mapped, we hold the lock, rec is ours.
        unsafe {
            (*h).allocated = (*h).allocated.saturating_add(n as u64 * size);
            (*h).nblocks = (*h).nblocks.saturating_add(n as u64);
            // The first block taken goes to the caller; the others are
            // stacked so that they come out in the slab's order.
            for (j, &off) in got[1..n].iter().enumerate() {
                (*rec).slots[class][n - 2 - j] = (off >> 4) as u32;
            }
            (*rec).count[class].store(n as u8 - 1, Ordering::Relaxed);
        }
        self.mirror_fill(rec, class);
        Ok(got[0])
    }

    /// Puts the small block at `off` in the calling thread's cache of this heap without the
    /// lock when it lies in the slab the thread last checked a freed block in (see
    /// `cache_mirror`) and the cache has room; its state byte must say [`LIVE`] and is set
    /// to [`CACHED`] first. This is the part that inlines into callers; false sends them to
    /// [`Heap::free_to_cache`].
    #[inline(always)]
    pub(super) fn free_mirrored(&self, off: u64) -> bool {
        // (A memo is taken only of slabs below 64 GiB, which cache slots can hold.)
        let epoch = GEN.load(Ordering::Relaxed);
        // SAFETY: the header is mapped.
        let releases = unsafe { (*self.header()).slab_releases.load(Ordering::Acquire) };
        // A block of the slab the thread last checked a freed block in, while no slab was
        // released (see `cache_mirror`).
        cache_mirror::with_record(self.base as usize, epoch, |m, rec| {
            let memo = m.memo(releases, off)?;
            if memo.end as usize > self.mapped {
                return None;
            }
            // off - first < span (a few pages): i is below the slab's block count.
            let i = block_index_with(off - memo.first, memo.reciprocal, memo.size)?;
            let class = memo.class;
            let rec = rec as *mut CacheRec;
            let state_off = memo.states + i as u64;
            // SAFETY: rec is this thread's record in this heap (the mirror follows it), mapped
            // in this epoch, changed only by this thread; the state byte of block i of a slab
            // checked (inside this mapping, in this epoch) when the memo was taken, and not
            // released since.
            unsafe {
                let state = &*(self.base.add(state_off as usize) as *const AtomicU8);
                let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
                if n >= memo.cap || state.load(Ordering::Relaxed) != LIVE {
                    // Full, or not allocated: the checked path flushes, or says why.
                    return None;
                }
                push_cached(rec, class, n, off, state);
                if let Some(entry) = cache_mirror::Entry::of(off, state_off) {
                    m.push(class, n, entry);
                }
            }
            Some(())
        })
        .is_some()
    }

    /// Puts the small block at `off` in the calling thread's cache of this
    /// heap without the lock (giving the cache's older half back under it
    /// when full), checking the block in full (and remembering its slab); its
    /// state byte is set to [`CACHED`] first, so a double free is
    /// refused whether the block sits in a cache or on its slab. None when
    /// the thread has no cache here or `off` is not a live small block in
    /// this view (the caller takes the locked path, which says why).
    pub(super) fn free_to_cache(&self, off: u64) -> Option<HResult<()>> {
        if off >= CACHE_MAX_LEN {
            // A cache slot holds offsets below 64 GiB only.
            return None;
        }
        let epoch = GEN.load(Ordering::Relaxed);
        // SAFETY: the header is mapped.
        let releases = unsafe { (*self.header()).slab_releases.load(Ordering::Acquire) };
        let rec = self.thread_cache(true)?;
        let (state, class) = self.check_freed_block(rec, off, epoch, releases)?;
        // SAFETY: rec is this thread's record; only this thread changes
        // it.
        unsafe {
            let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
            if n < CACHE_CAPS[class] as usize {
                if state.load(Ordering::Relaxed) == LIVE {
                    push_cached(rec, class, n, off, state);
                    if let Some(entry) = cache_mirror::Entry::of(off, self.offset_of(state)) {
                        cache_mirror::push(
                            self.base as usize,
                            rec as usize,
                            epoch,
                            class,
                            n,
                            entry,
                        );
                    }
                    return Some(Ok(()));
                }
                // Not allocated: the locked path says why.
                None
            } else {
                Some(self.free_flush(rec, off, class))
            }
        }
    }

    /// The cache of `class` is full: gives its older half back to the slabs
    /// under the lock, then caches `off`.
    #[cold]
    fn free_flush(&self, rec: *mut CacheRec, off: u64, class: usize) -> HResult<()> {
        let _g = self.lock()?;
        self.check_header()?;
        let half = CACHE_CAPS[class] as usize / 2;
        self.flush_class(rec, class, half)?;
        let Some((state, _)) = self.small_block_bit(off) else {
            return self.free_locked(off);
        };
        if state.load(Ordering::Relaxed) != LIVE {
            return self.free_locked(off);
        }
        // SAFETY: rec is ours; the flush left room (the count is checked
        // again: it is heap memory).
        unsafe {
            let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
            if n >= CACHE_CAPS[class] as usize {
                return Err(bad_count(self.rec_off(rec), class, n));
            }
            push_cached(rec, class, n, off, state);
        }
        self.mirror_fill(rec, class);
        Ok(())
    }

    /// The calling thread's cache record of this heap, opening one if
    /// `create` (None when the heap has no room for one, or the thread is
    /// exiting).
    #[inline(always)]
    fn thread_cache(&self, create: bool) -> Option<*mut CacheRec> {
        let f = FAST.try_with(|f| f.get()).unwrap_or(NO_FAST);
        if f.base == self.base as usize && f.epoch == GEN.load(Ordering::Relaxed) {
            return Some(f.rec);
        }
        self.thread_cache_slow(create)
    }

    #[cold]
    fn thread_cache_slow(&self, create: bool) -> Option<*mut CacheRec> {
        CACHES
            .try_with(|c| {
                let mut c = c.try_borrow_mut().ok()?;
                let cur = GEN.load(Ordering::Acquire);
                c.revalidate(cur);
                let base = self.base as usize;
                let idx = match c.0.iter().position(|e| e.base == base) {
                    Some(i) => i,
                    None if create => {
                        register_process_hooks();
                        c.0.push(CacheEntry {
                            base,
                            mapped: self.mapped,
                            rec: 0,
                            epoch: cur,
                            retry: 0,
                        });
                        c.0.len() - 1
                    }
                    None => return None,
                };
                if c.0[idx].rec == 0 {
                    if !create {
                        return None;
                    }
                    if c.0[idx].retry > 0 {
                        c.0[idx].retry -= 1;
                        return None;
                    }
                    let others: Vec<u64> = c.0.iter().map(|e| e.rec).collect();
                    match self.record_open(&others) {
                        Ok(Some(off)) => c.0[idx].rec = off,
                        Ok(None) => {
                            c.0[idx].retry = CACHE_RETRY;
                            return None;
                        }
                        Err(e) => {
                            // A corrupt heap: the locked paths report it.
                            tracing::debug!(error = %e, "rmalloc: no thread cache");
                            c.0[idx].retry = CACHE_RETRY;
                            return None;
                        }
                    }
                }
                let e = &mut c.0[idx];
                e.mapped = e.mapped.max(self.mapped);
                if e.rec as usize + PAGE > self.mapped {
                    return None;
                }
                // SAFETY: the record lies inside this view.
                let rec = unsafe { self.base.add(e.rec as usize) } as *mut CacheRec;
                let _ = FAST.try_with(|f| {
                    f.set(FastCache {
                        base,
                        rec,
                        epoch: cur,
                    })
                });
                Some(rec)
            })
            .ok()
            .flatten()
    }

    /// The bitmap word and bit of the small block at `off`, with its class,
    /// validated without the lock; None when `off` is not the start of a
    /// slab block inside this view (the locked path then decides).
    #[inline(always)]
    pub(super) fn small_block_bit(&self, off: u64) -> Option<(&AtomicU8, usize)> {
        let (slab, class, i) = self.small_block_at(off)?;
        Some((self.block_state(slab, class, i), class))
    }

    /// The slab, class and index of the small block at `off`, validated as
    /// [`Heap::small_block_bit`] says.
    #[inline(always)]
    fn small_block_at(&self, off: u64) -> Option<(u64, usize, usize)> {
        if off & (ALIGN as u64 - 1) != 0 || off as usize >= self.mapped {
            return None;
        }
        let h = self.header();
        // SAFETY: the header is mapped. These fields change (under the lock)
        // only when the heap grows; whatever is read is checked against the
        // view below.
        let (map_off, npages) = unsafe {
            (
                ptr::read_volatile(&raw const (*h).map_off),
                ptr::read_volatile(&raw const (*h).npages),
            )
        };
        let page = off >> PAGE_SHIFT;
        if page >= npages
            || (map_off as usize)
                .checked_add((page as usize + 1) * 4)
                .is_none_or(|end| end > self.mapped)
        {
            return None;
        }
        // SAFETY: the entry lies inside the view; read atomically since the
        // lock holder may change entries of other pages.
        let e = unsafe {
            (*(self.base.add(map_off as usize + page as usize * 4) as *const AtomicU32))
                .load(Ordering::Acquire)
        };
        if kind(e) != K_SLAB {
            return None;
        }
        let class = (value(e) >> 8) as usize;
        let index = value(e) & 0xff;
        if class >= NCLASSES || index > page {
            return None;
        }
        let slab = (page - index) << PAGE_SHIFT;
        if slab as usize + GEOMETRY[class].0 * PAGE > self.mapped {
            return None;
        }
        let s = self.slab_at(slab >> PAGE_SHIFT);
        // SAFETY: the slab lies inside the view. A
        // live or cached block keeps its slab (it counts in `used`).
        unsafe {
            if (*s).magic.load(Ordering::Acquire) != SLAB_MAGIC
                || ptr::read_volatile(&raw const (*s).class) as usize != class
            {
                return None;
            }
        }
        let i = block_index(off.checked_sub(slab + SLAB_HDR as u64)?, class)?;
        if i >= GEOMETRY[class].1 {
            return None;
        }
        Some((slab, class, i))
    }

    /// [`Heap::small_block_bit`] for a block being freed into record `rec`, remembering its
    /// slab in this thread's memo (taken at release count `releases`, in `epoch`).
    fn check_freed_block(
        &self,
        rec: *mut CacheRec,
        off: u64,
        epoch: u64,
        releases: u32,
    ) -> Option<(&AtomicU8, usize)> {
        let (slab, class, i) = self.small_block_at(off)?;
        let (pages, n) = GEOMETRY[class];
        let end = slab + (pages * PAGE) as u64;
        if end > CACHE_MAX_LEN {
            // Cache slots hold offsets below 64 GiB only.
            return Some((self.block_state(slab, class, i), class));
        }
        cache_mirror::set_memo(
            self.base as usize,
            rec as usize,
            epoch,
            releases,
            cache_mirror::SlabMemo {
                first: slab + SLAB_HDR as u64,
                span: (n * CLASS_SIZES[class] as usize) as u64,
                states: end - n as u64,
                end,
                class,
                size: CLASS_SIZES[class] as u64,
                reciprocal: reciprocal(class),
                cap: CACHE_CAPS[class] as usize,
            },
        );
        Some((self.block_state(slab, class, i), class))
    }

    /// [`Heap::small_block_bit`] of a block of `class` that fits the view.
    #[inline(always)]
    pub(super) fn cached_block_bit(&self, off: u64, class: usize) -> Option<&AtomicU8> {
        let (state, c) = self.small_block_bit(off)?;
        (c == class && off as usize + CLASS_SIZES[class] as usize <= self.mapped).then_some(state)
    }

    /// Gives the `k` oldest blocks of `class` in record `rec` back to their
    /// slabs. Call with the lock held.
    fn flush_class(&self, rec: *mut CacheRec, class: usize, k: usize) -> HResult<()> {
        // The record's slots move: this thread's mirror no longer matches them.
        cache_mirror::forget();
        let h = self.header();
        let size = CLASS_SIZES[class] as u64;
        // SAFETY: rec is a checked record inside the heap whose owner does
        // not use it meanwhile (it is the caller, or dead); the header is
        // mapped and we hold the lock.
        unsafe {
            let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
            if n > CACHE_CAPS[class] as usize {
                (*rec).count[class].store(0, Ordering::Relaxed);
                return Err(bad_count(self.rec_off(rec), class, n));
            }
            let k = k.min(n);
            let mut bad = None;
            for j in 0..k {
                let off = ((*rec).slots[class][j] as u64) << 4;
                let page = off >> PAGE_SHIFT;
                let r = if page < self.npages() && kind(self.map_entry(page)) == K_SLAB {
                    self.small_block(off, page, self.map_entry(page))
                } else {
                    Err(HeapError::BadPointer(format!("cached offset {off:#x}")))
                };
                match r {
                    Ok((slab, s, c, i)) if c == class => {
                        // LIVE: the owner died between handing the block out
                        // and dropping it from its cache; it is live.
                        let state = self.block_state(slab, class, i);
                        match state.load(Ordering::Acquire) {
                            LIVE => continue,
                            0 | CACHED => state.store(0, Ordering::Release),
                            _ => {
                                bad = Some(off);
                                continue;
                            }
                        }
                        self.release_small(slab, s, class, off)?;
                        (*h).allocated = (*h).allocated.saturating_sub(size);
                        (*h).nblocks = (*h).nblocks.saturating_sub(1);
                    }
                    Ok(_) => bad = Some(off),
                    Err(_) => bad = Some(off),
                }
            }
            (*rec).slots[class].copy_within(k..n, 0);
            (*rec).count[class].store((n - k) as u8, Ordering::Relaxed);
            if let Some(off) = bad {
                tracing::warn!(
                    offset = off,
                    class,
                    "rmalloc: a thread cache held a block that is not free; dropped it"
                );
            }
        }
        Ok(())
    }

    /// Gives every block of record `rec` (of `class` only, if given) back.
    fn flush_record(&self, rec: *mut CacheRec, class: Option<usize>) -> HResult<()> {
        for c in 0..NCLASSES {
            if class.is_none_or(|k| k == c) {
                self.flush_class(rec, c, CACHE_CAP)?;
            }
        }
        Ok(())
    }

    /// The record at `off`, checked.
    pub(super) fn record_at(&self, off: u64) -> HResult<*mut CacheRec> {
        self.record_link(off, &|| "a thread cache record".to_string())
    }

    /// The record at `off`, which field `what` links to, checked: a page of
    /// the heap that the page map says is a record and that holds one.
    fn record_link(&self, off: u64, what: &dyn Fn() -> String) -> HResult<*mut CacheRec> {
        let page = self.check_page_off(off, what)?;
        let e = self.map_entry(page);
        if kind(e) != K_CACHE {
            return Err(corrupt_with(move || {
                format!(
                    "{} is {off:#x}, but the page-map entry of page {page} is {e:#x}, not a thread \
                     cache record's",
                    what()
                )
            }));
        }
        let rec = self.run_at(page) as *mut CacheRec;
        // SAFETY: a page of the heap.
        let magic = unsafe { (*rec).magic };
        if magic != CACHE_MAGIC {
            return Err(corrupt_with(move || {
                format!(
                    "{} is {off:#x}, which holds no thread cache record (magic {magic:#x})",
                    what()
                )
            }));
        }
        Ok(rec)
    }

    /// Offsets of all records. Call with the lock held.
    pub(super) fn records(&self) -> HResult<Vec<u64>> {
        let mut out = Vec::new();
        // SAFETY: the header is mapped.
        let mut off = unsafe { (*self.header()).caches };
        while off != 0 {
            let rec = self.record_link(off, &|| match out.last() {
                None => "the head of the thread cache list".to_string(),
                Some(p) => format!("the next link of thread cache record {p:#x}"),
            })?;
            out.push(off);
            if out.len() as u64 > self.npages() {
                return Err(corrupt_with(move || {
                    format!("the thread cache list has a cycle (through {off:#x})")
                }));
            }
            // SAFETY: checked record.
            off = unsafe { (*rec).next };
        }
        Ok(out)
    }

    /// Opens the calling thread's record: takes over one whose owner thread
    /// is gone (with the blocks it holds), or makes a new one. Records of
    /// other dead owners are emptied and freed on the way. `mine` are the
    /// records this thread uses for other views.
    fn record_open(&self, mine: &[u64]) -> HResult<Option<u64>> {
        let _g = self.lock()?;
        self.check_header()?;
        let h = self.header();
        // SAFETY: the header is mapped.
        if unsafe { (*h).len } > CACHE_MAX_LEN {
            return Ok(None);
        }
        register_process_hooks();
        let me = current_tid();
        let ns = host_ns();
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() } as u32;
        let mut adopted = None;
        let mut dead = Vec::new();
        for off in self.records()? {
            let rec = self.record_at(off)?;
            // SAFETY: checked record.
            let (ons, otid) = unsafe {
                (
                    (*rec).owner_ns.load(Ordering::Relaxed),
                    (*rec).owner_tid.load(Ordering::Relaxed),
                )
            };
            let gone = ons == ns
                && otid != 0
                && if otid == me {
                    !mine.contains(&off)
                } else {
                    !thread_alive(otid)
                };
            if gone {
                if adopted.is_none() {
                    adopted = Some(off);
                } else if dead.len() < 8 {
                    dead.push(off);
                }
            }
        }
        for off in dead {
            let rec = self.record_at(off)?;
            self.flush_record(rec, None)?;
            self.record_release(off)?;
        }
        let off = match adopted {
            Some(off) => off,
            None => {
                let Some(page) = self.alloc_pages(1)? else {
                    return Ok(None);
                };
                self.set_map(page, entry(K_CACHE, 0));
                let off = page << PAGE_SHIFT;
                let rec = self.run_at(page) as *mut CacheRec;
                // SAFETY: a fresh page of the heap, ours under the lock.
                unsafe {
                    ptr::write_bytes(rec as *mut u8, 0, std::mem::size_of::<CacheRec>());
                    (*rec).magic = CACHE_MAGIC;
                    (*rec).next = (*h).caches;
                    (*h).caches = off;
                }
                off
            }
        };
        let rec = self.record_at(off)?;
        // SAFETY: checked record.
        unsafe {
            (*rec).owner_ns.store(ns, Ordering::Relaxed);
            (*rec).owner_tid.store(me, Ordering::Relaxed);
            (*rec).owner_pid.store(pid, Ordering::Relaxed);
        }
        Ok(Some(off))
    }

    /// Unlinks and frees the (empty) record at `off`. Call with the lock held.
    fn record_release(&self, off: u64) -> HResult<()> {
        let h = self.header();
        let rec = self.record_at(off)?;
        // SAFETY: checked records; the header is mapped.
        unsafe {
            if (*h).caches == off {
                (*h).caches = (*rec).next;
            } else {
                let mut prev = (*h).caches;
                let mut steps = 0u64;
                loop {
                    if prev == 0 {
                        return Err(corrupt_with(move || {
                            format!("thread cache record {off:#x} is not in the list of records")
                        }));
                    }
                    steps += 1;
                    if steps > self.npages() {
                        return Err(corrupt_with(move || {
                            format!("the thread cache list has a cycle (through {prev:#x})")
                        }));
                    }
                    let p = self.record_at(prev)?;
                    if (*p).next == off {
                        (*p).next = (*rec).next;
                        break;
                    }
                    prev = (*p).next;
                }
            }
            (*rec).magic = 0;
        }
        self.set_map(off >> PAGE_SHIFT, entry(K_FREE_IN, 0));
        self.free_pages(off >> PAGE_SHIFT, 1)
    }

    /// Empties and frees the calling thread's record at `off`.
    fn record_close(&self, off: u64) -> HResult<()> {
        let _g = self.lock()?;
        self.check_header()?;
        let rec = self.record_at(off)?;
        // SAFETY: checked record.
        let (ons, otid) = unsafe {
            (
                (*rec).owner_ns.load(Ordering::Relaxed),
                (*rec).owner_tid.load(Ordering::Relaxed),
            )
        };
        if ons != host_ns() || otid != current_tid() {
            return Err(corrupt_with(move || {
                format!(
                    "this thread's cache record {off:#x} now names owner {otid} (host and \
                     namespace {ons:#x})"
                )
            }));
        }
        self.flush_record(rec, None)?;
        self.record_release(off)
    }

    /// Gives the calling thread's cached blocks of this heap back to the
    /// heap and frees its record (threads do this when they exit, and
    /// [`unmapping`] for the caller).
    pub fn flush_cache(&self) -> HResult<()> {
        let _ = FAST.try_with(|f| f.set(NO_FAST));
        let base = self.base as usize;
        let e = CACHES
            .try_with(|c| {
                let mut c = c.try_borrow_mut().ok()?;
                let i = c.0.iter().position(|e| e.base == base)?;
                Some(c.0.swap_remove(i))
            })
            .ok()
            .flatten();
        match e {
            Some(e) if e.rec != 0 => self.record_close(e.rec),
            _ => Ok(()),
        }
    }

    /// Blocks and bytes held in thread caches. Call with the lock held.
    pub(super) fn cached(&self) -> HResult<(u64, u64)> {
        let (mut blocks, mut bytes) = (0, 0);
        for off in self.records()? {
            let rec = self.record_at(off)?;
            for (c, &size) in CLASS_SIZES.iter().enumerate() {
                // SAFETY: checked record; the count is atomic.
                let n = unsafe { (*rec).count[c].load(Ordering::Relaxed) } as u64;
                if n > CACHE_CAPS[c] as u64 {
                    return Err(bad_count(off, c, n as usize));
                }
                blocks += n;
                bytes += n * size as u64;
            }
        }
        Ok((blocks, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_mem::Mem;
    use super::*;

    /// A block freed by another thread, and a double free of a block that
    /// sits in another thread's cache, are handled; the stats count cached
    /// blocks apart.
    #[test]
    fn thread_caches_cross_thread_free_and_double_free() {
        let m = Mem::new(4 << 20);
        let h = m.heap(4 << 20);
        let blocks: Vec<u64> = (0..100).map(|_| h.alloc(64).unwrap()).collect();
        let s = h.stats().unwrap();
        assert_eq!(s.blocks, 100);
        assert_eq!(s.allocated, 6400);
        assert!(s.cached_blocks > 0, "{s:?}");
        // Another thread frees them all (into its cache, then in batches
        // back to the slabs) and exits.
        let (h2, b2) = (h, blocks.clone());
        std::thread::spawn(move || {
            for &b in &b2 {
                h2.free(b).unwrap();
            }
            // A double free of a block in this thread's cache.
            assert!(matches!(h2.free(b2[99]), Err(HeapError::BadPointer(_))));
        })
        .join()
        .unwrap();
        // ... and of blocks the exiting thread gave back.
        for &b in &blocks {
            assert!(matches!(h.free(b), Err(HeapError::BadPointer(_))));
        }
        let s = h.stats().unwrap();
        assert_eq!((s.blocks, s.allocated), (0, 0), "{s:?}");
        // A block in this thread's cache cannot be freed by another thread.
        let a = h.alloc(64).unwrap();
        h.free(a).unwrap();
        let h3 = h;
        let r = std::thread::spawn(move || h3.free(a)).join().unwrap();
        assert!(matches!(r, Err(HeapError::BadPointer(_))), "{r:?}");
        // The cache hands out its newest block first.
        assert_eq!(h.alloc(64).unwrap(), a);
        h.free(a).unwrap();
        h.flush_cache().unwrap();
        assert_eq!(h.stats().unwrap().cached_blocks, 0);
    }

    /// A process that dies without flushing leaves its cache record in the
    /// heap; a forked child does not use its parent's cache; the next
    /// thread that opens a cache takes the dead record over.
    #[test]
    fn dead_process_cache_is_taken_back() {
        let m = Mem::new(4 << 20);
        let h = m.heap(4 << 20);
        let shared = Mem::new(PAGE);
        let out = shared.ptr as *mut u64;
        let a = h.alloc(64).unwrap();
        let x = h.alloc(64).unwrap();
        h.free(a).unwrap();
        let parent_cached = h.stats().unwrap().cached_blocks;
        assert!(parent_cached > 0);
        // SAFETY: the child only allocates in the shared heap, writes the
        // shared page and leaves with _exit (no destructors, no flush).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let b = h.alloc(64).unwrap_or(0);
            let r = h.free(x).is_ok() as u64;
            let c = h.alloc(128).unwrap_or(0);
            let r2 = h.free(c).is_ok() as u64;
            // SAFETY: the shared page.
            unsafe {
                out.write(b);
                out.add(1).write(r + r2);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        // SAFETY: the child wrote the page.
        let (b, ok) = unsafe { (out.read(), out.add(1).read()) };
        assert_ne!(b, 0);
        assert_ne!(b, a, "the child took a block from its parent's cache");
        assert_eq!(ok, 2, "the child's frees failed");
        // x sits in the dead child's cache: freeing it again is refused.
        assert!(matches!(h.free(x), Err(HeapError::BadPointer(_))));
        let s = h.stats().unwrap();
        assert!(s.cached_blocks > parent_cached, "{s:?}");
        // b is live (the child never freed it): a, x and b were allocated.
        assert_eq!(s.blocks, 1, "{s:?}");
        // A new thread takes the dead record over, and flushes it on exit.
        let h2 = h;
        std::thread::spawn(move || {
            h2.alloc(64).map(|o| h2.free(o)).unwrap().unwrap();
        })
        .join()
        .unwrap();
        let s = h.stats().unwrap();
        assert_eq!(s.cached_blocks, parent_cached, "{s:?}");
        h.free(b).unwrap();
        h.flush_cache().unwrap();
        let s = h.stats().unwrap();
        assert_eq!((s.blocks, s.cached_blocks, s.allocated), (0, 0, 0), "{s:?}");
    }

    /// Unmapping forgets the caches of a heap: a new heap at the same address
    /// does not get blocks of the old one.
    #[test]
    fn unmapping_forgets_caches() {
        let m = Mem::new(1 << 20);
        let h = m.heap(1 << 20);
        let a = h.alloc(64).unwrap();
        h.free(a).unwrap();
        // Zero the memory as if another, empty region were mapped there.
        unmapping(m.ptr, m.len);
        // SAFETY: our memory.
        unsafe { m.ptr.write_bytes(0, m.len) };
        let h = m.heap(1 << 20);
        let s = h.stats().unwrap();
        assert_eq!((s.blocks, s.cached_blocks), (0, 0));
        let b = h.alloc(64).unwrap();
        assert_eq!(h.stats().unwrap().blocks, 1);
        h.free(b).unwrap();
    }

    /// A thread remembers the slab it last checked a freed block in; once another thread
    /// has released that slab and its pages hold a slab of another class, a free of a block
    /// there is checked afresh (the heap counts releases), not read through the memory the
    /// old slab's state bytes had; and a thread's mirror of its cache never hands a block out
    /// twice across refills and flushes.
    #[test]
    fn a_released_slab_is_not_read_through_a_stale_memo() {
        // Other tests of this process unmap memory (a new unmap epoch drops every memo, and
        // the free would be checked afresh whatever the release count said): run the case
        // again until one run saw no unmapping.
        let m = Mem::new(4 << 20);
        let h = m.heap(4 << 20);
        for attempt in 0.. {
            assert!(
                attempt < 20,
                "other tests unmapped memory during every attempt"
            );
            let before = GEN.load(Ordering::Acquire);
            let freed_once = stale_memo_case(h);
            if GEN.load(Ordering::Acquire) == before {
                assert!(
                    freed_once,
                    "a free through a stale slab memo was not checked afresh"
                );
                break;
            }
        }
        // The mirror across refills and flushes: every block handed out once at a time.
        let mut live = std::collections::HashSet::new();
        let mut order = Vec::new();
        for round in 0..50u64 {
            for _ in 0..(round % 7) * 9 + 1 {
                let b = h.alloc(48).unwrap();
                assert!(live.insert(b), "block {b:#x} handed out twice");
                order.push(b);
            }
            for _ in 0..(round % 5) * 11 {
                if let Some(b) = order.pop() {
                    live.remove(&b);
                    h.free(b).unwrap();
                }
            }
        }
        let s = h.stats().unwrap();
        assert_eq!(s.blocks as usize, live.len(), "{s:?}");
    }

    /// One run of the case above in heap `h` (which it leaves as it found it): whether thread
    /// A's free of a block where a released slab was freed it once.
    fn stale_memo_case(h: Heap) -> bool {
        use super::super::size_class::class_of;
        use std::sync::mpsc::channel;
        const WAIT: std::time::Duration = std::time::Duration::from_secs(20);
        let per_slab = GEOMETRY[class_of(64)].1;
        // Thread B: more than three slabs of 64-byte blocks.
        let blocks: Vec<u64> = std::thread::spawn(move || {
            (0..3 * per_slab + 1)
                .map(|_| h.alloc(64).unwrap())
                .collect()
        })
        .join()
        .unwrap();
        let x = *blocks.iter().min().unwrap();
        let last = *blocks.iter().max().unwrap();
        let (slab, class, _) = h.small_block_at(x).unwrap();
        assert_eq!(class, class_of(64));
        let (first, end) = (
            slab + SLAB_HDR as u64,
            slab + (GEOMETRY[class].0 * PAGE) as u64,
        );
        // Thread A frees one of the first slab's blocks (A remembers that slab) and takes it
        // back from its cache; later it frees what C hands it.
        let (ready, go, done) = (channel::<()>(), channel::<u64>(), channel::<bool>());
        let thread_a = std::thread::spawn(move || {
            h.free(x).unwrap();
            assert_eq!(
                h.alloc(64).unwrap(),
                x,
                "A's cache hands back the block it freed"
            );
            ready.0.send(()).unwrap();
            let Ok(y) = go.1.recv_timeout(WAIT) else {
                return;
            };
            h.free(y).unwrap();
            let freed = !h.is_live(y).unwrap();
            // Freed once: a second free is refused.
            let twice = matches!(h.free(y), Err(HeapError::BadPointer(_)));
            let _ = done.0.send(freed && twice);
            h.flush_cache().unwrap();
        });
        ready
            .1
            .recv_timeout(WAIT)
            .expect("thread A did not get ready");
        // Thread B frees every block but the last slab's last (that slab stays partial) and
        // exits: the first slab empties and is released.
        let b2 = blocks.clone();
        std::thread::spawn(move || {
            for &b in b2.iter().filter(|&&b| b != last) {
                h.free(b).unwrap();
            }
        })
        .join()
        .unwrap();
        assert!(
            !h.is_live(x).unwrap()
                && h.small_block_at(x)
                    .is_none_or(|(s, c, _)| s != slab || c != class),
            "the first slab of 64-byte blocks was not released"
        );
        // Thread C: 256-byte blocks, filled with 1s (LIVE, as a state byte), until one starts
        // inside the old slab's blocks at a multiple of 64 bytes from its first.
        let (y, mine) = std::thread::spawn(move || {
            let mut mine = Vec::new();
            for _ in 0..400 {
                let b = h.alloc(256).unwrap();
                // SAFETY: a live 256-byte block of the heap.
                unsafe { h.base.add(b as usize).write_bytes(1, 256) };
                mine.push(b);
            }
            let y = mine.iter().copied().find(|&b| {
                b >= first && b < end && (b - first) % 64 == 0 && h.small_block_at(b).is_some()
            });
            h.flush_cache().unwrap();
            (y, mine)
        })
        .join()
        .unwrap();
        let y = y.expect("no 256-byte block landed where the released slab of 64-byte blocks was");
        go.0.send(y).unwrap();
        let freed_once = done.1.recv_timeout(WAIT).expect("thread A did not answer");
        thread_a.join().unwrap();
        // Clean up for the next run: C's other blocks and B's last.
        for b in mine.into_iter().filter(|&b| b != y).chain([last]) {
            h.free(b).unwrap();
        }
        h.flush_cache().unwrap();
        freed_once
    }
}
