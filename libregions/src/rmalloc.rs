//! rmalloc: an allocator whose whole state lives in the memory it manages
//! (paper 003 §5.7), so that any process that maps a region continues the
//! allocations of the processes before it.
//!
//! # Layout
//!
//! The managed memory is a sequence of 4 KiB pages. Page 0 holds the
//! [`Header`]: a magic number and version, a lock word, the managed length, the
//! root pointer slot (rsetroot/rgetroot), the heads of the per-size-class slab
//! lists and of the free-page bins. A *page map* (one `u32` per page, at
//! `map_off`) says what every page is: allocator metadata, the head or tail of
//! a free run, the first page of a large block, an interior page, or a page of
//! a slab (with its size class and its index in the slab).
//!
//! - Small blocks (1..=2048 bytes) come from slabs of 1-8 pages, one size
//!   class per slab (24 classes, 16-byte granularity up to 128 bytes, then
//!   four per power of two). A slab keeps a free list threaded through its
//!   free blocks, a bump index for never-used blocks, and at its end one
//!   state byte per block, set while the block is handed out (so a double
//!   free or a pointer into the middle of a block is refused with
//!   `EINVAL`). Slabs with free blocks are on their
//!   class's partial list; an empty slab goes back to the page allocator
//!   unless it is the class's last one.
//! - Large blocks are runs of whole pages, page aligned. Free runs carry their
//!   length in the page map at both ends (boundary tags, so a freed run merges
//!   with its neighbours in O(1)) and sit in 64 bins: exact bins for 1-32
//!   pages, then one bin per power of two.
//!
//! - Thread caches: every thread keeps, per heap, a small stack of free
//!   blocks per size class (about a page's worth, 4 to 32 blocks) so that
//!   most small allocations and frees take no lock. The cache is a *record*
//!   in the heap itself (one page, listed from the header): owner (host boot
//!   id + pid namespace, thread id, pid), a count and the block offsets per
//!   class. An empty cache is refilled with half its capacity under the
//!   lock, a full one gives its older half back; a thread's records go back
//!   to the heap when it exits (a TLS destructor), when it calls
//!   [`Heap::flush_cache`], and for the caller of [`unmapping`].
//!
//! Everything stored in the region is an *offset*
//!
//! Everything stored in the region is an *offset* from the start of the
//! region, never a pointer, so the heap works wherever the region is mapped
//! (a FIXVADDR region maps at the same address on every host, which keeps the
//! application's own pointers valid too).
//!
//! # Concurrency
//!
//! Every operation but the thread-cache fast paths holds the lock word in the
//! header: a futex on the mapped
//! memory (not `FUTEX_PRIVATE`), so threads and processes of one host that
//! map the region exclude each other. The word holds the holder's thread id;
//! a waiter that finds the holder's thread gone (same pid namespace) takes the
//! lock over instead of hanging. Concurrent allocation from *different hosts*
//! is not supported: each host works on its own cached copy of remote pages.
//! Hand the heap over instead (the writer `rmsync`s, the next host
//! `rclearcache`s or maps afresh).
//!
//! The fast paths take no lock: a free checks the block against the page map
//! and its slab, checks that its state byte says "handed out" and clears it
//! (a plain load and store: only the block's current holder writes its
//! byte, so no atomic read-modify-write is needed) and pushes it on the
//! cache; an allocation pops a block and sets its byte. The byte is set
//! exactly while the block is handed out, so a double free is refused
//! (`EINVAL`) wherever the block sits: on its slab, in this thread's cache,
//! or in another thread's or process's cache. The one case no longer caught:
//! two frees of the same block that run at the same instant on two threads
//! (both can read "handed out" before either clears it); before, the lock
//! serialised them and refused the second. Only the owner touches a record's slots; other threads
//! read its counts (statistics) and take a record over, with the blocks in
//! it, only when the owner thread no longer exists (same host and pid
//! namespace, `kill(tid, 0)` says `ESRCH`, or it is the caller's own thread
//! id and the caller has no entry for it) — the next thread that opens a
//! cache in the heap does that, and empties up to 8 other dead records.
//!
//! Crash semantics: a process that dies (or exits while other threads are
//! running, whose destructors never run) leaves its records in the heap.
//! Their blocks are not lost: they stay recorded, counted as cached (not
//! live) in [`HeapStats`], and come back as above. A thread killed between
//! the two steps of a fast path can lose at most one block (its state byte
//! and its slot disagree: a cached block whose byte is set is treated as
//! live). Records of
//! processes on other hosts or in other pid namespaces are never taken over
//! from here. A forked child starts with no caches (a `pthread_atfork`
//! handler), so it never uses its parent's blocks.
//!
//! What a cache gives up: the header is validated only when the lock is
//! taken (refills, flushes, large blocks), and a block freed into a cache is
//! not handed to another thread or process until the cache gives it back
//! (at most about one page per class per thread; a heap that is full
//! except for other threads' caches reports `Full`, the caller's own
//! caches are emptied first). [`HeapStats::allocated`] and `blocks` count
//! the blocks handed out, not those cached. Memory that heap views used
//! must be announced with [`unmapping`] before it is unmapped (so that
//! thread exit never touches unmapped memory and a new heap mapped at the
//! same address never meets an old cache).
//!
//! # Errors
//!
//! [`HeapError::Full`] when no free run is large enough (the caller grows the
//! region and calls [`Heap::extend`]), [`HeapError::Corrupt`] when the header
//! or a structure fails validation and [`HeapError::BadPointer`] for a pointer
//! that is not a live block; see [`HeapError::errno`].

use std::cell::{Cell, RefCell};
use std::ptr;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

/// Page size of the heap (also its unit of growth).
pub const PAGE: usize = 4096;
const PAGE_SHIFT: u32 = 12;
/// `b"RGNALLOC"` little-endian: marks memory that holds a heap.
pub const MAGIC: u64 = u64::from_le_bytes(*b"RGNALLOC");
/// Stored in `magic` while one process initialises the heap.
const MAGIC_INIT: u64 = u64::from_le_bytes(*b"RGNINIT.");
/// Layout version.
pub const VERSION: u32 = 2;
/// Smallest memory a heap can be created in.
pub const MIN_HEAP: usize = 16 * PAGE;
/// Largest block served from slabs.
pub const MAX_SMALL: usize = 2048;
/// Blocks are aligned to this many bytes (large blocks to a page).
pub const ALIGN: usize = 16;

const CLASS_SIZES: [u32; NCLASSES] = [
    16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
    1280, 1536, 1792, 2048,
];
const NCLASSES: usize = 24;
const NBINS: usize = 64;
const EXACT_BINS: usize = 32;
/// Offset of the first block in a slab (after [`Slab`]).
const SLAB_HDR: usize = 128;
const SLAB_MAGIC: u32 = 0x5342_4c53; // "SLBS"
const MAX_SLAB_BLOCKS: usize = 256;
const RUN_MAGIC: u64 = u64::from_le_bytes(*b"FREERUN.");

// Page map entries: kind in the top 4 bits, a value in the low 28.
const K_META: u32 = 1; // header or page map
const K_FREE: u32 = 2; // head or tail of a free run; value = run length
const K_FREE_IN: u32 = 3; // interior of a free run
const K_LARGE: u32 = 4; // first page of a large block; value = pages
const K_CONT: u32 = 5; // interior page of a large block
const K_SLAB: u32 = 6; // slab page; value = class << 8 | index in slab
const K_CACHE: u32 = 7; // a thread cache record
const VALUE_MASK: u32 = (1 << 28) - 1;
/// Longest run the page map can describe (1 TiB).
const MAX_RUN: u64 = VALUE_MASK as u64;

const LOCK_WAITERS: u32 = 1 << 31;
/// State byte of a block handed out to the application.
const LIVE: u8 = 1;

/// The heap header at offset 0 of the managed memory.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: u32,
    page_size: u32,
    lock: AtomicU32,
    _pad0: u32,
    /// pid namespace (inode of /proc/self/ns/pid) of the lock holder.
    lock_ns: AtomicU64,
    /// Checksum of the layout fields below.
    checksum: u64,
    len: u64,
    npages: u64,
    map_off: u64,
    map_cap: u64,
    /// Offset + 1 of the root block, 0 for none.
    root: AtomicU64,
    /// Bit b set when bin b is not empty.
    bin_mask: u64,
    /// Bytes in live blocks (requested sizes rounded to their class or pages).
    allocated: u64,
    /// Live blocks.
    nblocks: u64,
    partial: [u64; NCLASSES],
    bins: [u64; NBINS],
    /// Offset of the first thread cache record, 0 for none.
    caches: u64,
}

const _: () = assert!(std::mem::size_of::<Header>() <= PAGE / 2);

/// A slab's header, at the start of its first page.
#[repr(C)]
struct Slab {
    magic: AtomicU32,
    class: u16,
    pages: u16,
    nblocks: u16,
    used: u16,
    bump: u16,
    _pad: u16,
    /// Offset of the first free block (0 for none); each free block starts
    /// with the offset of the next.
    free: u64,
    next: u64,
    prev: u64,
}

const _: () = assert!(std::mem::size_of::<Slab>() <= SLAB_HDR);

/// The links of a free run, at the start of its first page.
#[repr(C)]
struct FreeRun {
    magic: u64,
    next: u64,
    prev: u64,
    pages: u64,
}

/// What can go wrong in a heap operation.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeapError {
    /// No free run can hold `pages` more pages; grow the memory and
    /// [`Heap::extend`].
    #[error("the region is full: {pages} more pages needed")]
    Full { pages: u64 },
    /// The heap's length (set by another process that grew it), or the
    /// smallest heap, is larger than the memory this view covers; map `len`
    /// bytes and retry.
    #[error("the heap spans {len} bytes, more than this process has mapped")]
    NeedsMapping { len: u64 },
    /// The memory is not a valid heap.
    #[error("rmalloc heap corrupt: {0}")]
    Corrupt(String),
    /// A pointer that is not a live block of this heap.
    #[error("not an rmalloc block: {0}")]
    BadPointer(String),
    /// The memory holds other data, or is too small for a heap.
    #[error("{0}")]
    NotAHeap(String),
    /// Another process is initialising the heap and did not finish in time.
    #[error("another process started initialising the heap and did not finish")]
    InitTimeout,
}

impl HeapError {
    /// The errno an application sees.
    pub fn errno(&self) -> i32 {
        match self {
            HeapError::Full { .. } | HeapError::NeedsMapping { .. } => libc::ENOMEM,
            HeapError::Corrupt(_) | HeapError::BadPointer(_) | HeapError::NotAHeap(_) => {
                libc::EINVAL
            }
            HeapError::InitTimeout => libc::EAGAIN,
        }
    }
}

impl From<HeapError> for crate::RegionsError {
    fn from(e: HeapError) -> Self {
        match e {
            HeapError::Full { .. } | HeapError::NeedsMapping { .. } => {
                crate::RegionsError::NoMemory(e.to_string())
            }
            HeapError::InitTimeout => crate::RegionsError::io(
                "rmalloc",
                std::io::Error::new(std::io::ErrorKind::WouldBlock, e.to_string()),
            ),
            _ => crate::RegionsError::Invalid(e.to_string()),
        }
    }
}

type HResult<T> = std::result::Result<T, HeapError>;

/// Usage numbers of a heap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapStats {
    /// Bytes managed.
    pub len: u64,
    /// Pages in free runs.
    pub free_pages: u64,
    /// Bytes in live blocks (handed to the application, not counting blocks
    /// in thread caches).
    pub allocated: u64,
    /// Live blocks (not counting blocks in thread caches).
    pub blocks: u64,
    /// Free small blocks held in thread caches (of live threads, or of dead
    /// ones not yet taken back).
    pub cached_blocks: u64,
    /// Longest free run, in pages.
    pub largest_free_run: u64,
    /// Pages of slabs with free blocks (each class keeps its last slab even
    /// when it is empty).
    pub partial_slab_pages: u64,
}

/// A view of a heap in memory at `base`, of which `mapped` bytes are
/// accessible in this process. Cheap to create; all state is in the memory.
#[derive(Clone, Copy, Debug)]
pub struct Heap {
    base: *mut u8,
    mapped: usize,
}

// SAFETY: a Heap is an address and a length; every access to the memory goes
// through the header's lock (or atomics), which serialises threads.
unsafe impl Send for Heap {}
// SAFETY: as above.
unsafe impl Sync for Heap {}

/// Size class by size in 16-byte units.
const CLASS_OF: [u8; MAX_SMALL / ALIGN + 1] = {
    let mut t = [0u8; MAX_SMALL / ALIGN + 1];
    let mut i = 0;
    while i < t.len() {
        let mut c = 0;
        while (CLASS_SIZES[c] as usize) < i * ALIGN {
            c += 1;
        }
        t[i] = c as u8;
        i += 1;
    }
    t
};

fn class_of(size: usize) -> usize {
    CLASS_OF[size.div_ceil(ALIGN)] as usize
}

/// Pages per slab and blocks per slab of every class.
const GEOMETRY: [(usize, usize); NCLASSES] = {
    let mut g = [(0, 0); NCLASSES];
    let mut c = 0;
    while c < NCLASSES {
        g[c] = compute_geometry(c);
        c += 1;
    }
    g
};

/// ceil(2^32 / size) of every class: for x < 2^20, x / size is
/// (x * RECIPROCAL) >> 32 (no division on the hot path).
const RECIPROCAL: [u64; NCLASSES] = {
    let mut r = [0; NCLASSES];
    let mut c = 0;
    while c < NCLASSES {
        r[c] = (1u64 << 32).div_ceil(CLASS_SIZES[c] as u64);
        c += 1;
    }
    r
};

/// Pages per slab and blocks per slab of class `c`.
fn slab_geometry(c: usize) -> (usize, usize) {
    GEOMETRY[c]
}

/// The index of the block at `rel` bytes from a slab's first block, None
/// when `rel` is not the start of a block.
fn block_index(rel: u64, class: usize) -> Option<usize> {
    if rel >= 1 << 20 {
        return None;
    }
    let i = (rel * RECIPROCAL[class]) >> 32;
    (i * CLASS_SIZES[class] as u64 == rel).then_some(i as usize)
}

const fn compute_geometry(c: usize) -> (usize, usize) {
    let size = CLASS_SIZES[c] as usize;
    let mut pages = (size * 64 + SLAB_HDR).div_ceil(PAGE);
    if pages > 8 {
        pages = 8;
    }
    // Each block also has a state byte at the slab's end.
    let mut n = (pages * PAGE - SLAB_HDR) / (size + 1);
    if n > MAX_SLAB_BLOCKS {
        n = MAX_SLAB_BLOCKS;
    }
    (pages, n)
}

fn bin_of(pages: u64) -> usize {
    if pages <= EXACT_BINS as u64 {
        (pages - 1) as usize
    } else {
        (EXACT_BINS + pages.ilog2() as usize - 5).min(NBINS - 1)
    }
}

fn entry(kind: u32, value: u64) -> u32 {
    debug_assert!(value <= MAX_RUN);
    (kind << 28) | (value as u32 & VALUE_MASK)
}

fn kind(e: u32) -> u32 {
    e >> 28
}

fn value(e: u32) -> u64 {
    (e & VALUE_MASK) as u64
}

fn checksum(h: *const Header) -> u64 {
    // SAFETY: the caller passes a header inside the mapped memory.
    let fields = unsafe {
        [
            (*h).version as u64 | ((*h).page_size as u64) << 32,
            (*h).len,
            (*h).npages,
            (*h).map_off,
            (*h).map_cap,
        ]
    };
    // FNV-1a over the words, seeded with the magic.
    let mut x = 0xcbf2_9ce4_8422_2325u64 ^ MAGIC;
    for f in fields {
        x ^= f;
        x = x.wrapping_mul(0x0100_0000_01b3);
    }
    x
}

fn current_tid() -> u32 {
    TID.with(|t| {
        let v = t.get();
        if v != 0 {
            return v;
        }
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        t.set(tid);
        tid
    })
}

fn pid_namespace() -> u64 {
    static NS: OnceLock<u64> = OnceLock::new();
    *NS.get_or_init(|| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self/ns/pid")
            .map(|m| m.ino())
            .unwrap_or(0)
    })
}

fn thread_alive(tid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks that the task exists.
    let r = unsafe { libc::kill(tid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the futex word is a valid aligned u32 in mapped memory; the
    // kernel only reads it. Shared (not PRIVATE) so processes mapping the
    // same memory meet on it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in futex_wait; wakes at most one waiter.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1);
    }
}

/// Holds the heap lock; releases it on drop.
struct Guard<'a> {
    word: &'a AtomicU32,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.word.swap(0, Ordering::Release) & LOCK_WAITERS != 0 {
            futex_wake(self.word);
        }
    }
}

impl Heap {
    /// A view of the heap in `mapped` bytes at `base`, initialising a new
    /// heap there if the first page is all zeros.
    ///
    /// # Safety
    ///
    /// `base` must point to `mapped` bytes of readable and writable memory,
    /// page aligned, that stay mapped while the view is used, and that only
    /// rmalloc heaps use (other processes mapping the same memory included).
    pub unsafe fn attach(base: *mut u8, mapped: usize) -> HResult<Heap> {
        if base.is_null() || !(base as usize).is_multiple_of(PAGE) {
            return Err(HeapError::NotAHeap(format!(
                "heap memory at {base:p} is not page aligned"
            )));
        }
        let heap = Heap { base, mapped };
        let h = heap.header();
        if mapped < PAGE {
            return Err(HeapError::NeedsMapping {
                len: MIN_HEAP as u64,
            });
        }
        // SAFETY: the header lies in the first page, which is mapped.
        let magic = unsafe { &(*h).magic };
        let mut deadline = None;
        loop {
            match magic.load(Ordering::Acquire) {
                // The layout fields are checked under the lock by every
                // operation (another process may be growing the heap now).
                MAGIC => return Ok(heap),
                MAGIC_INIT => {
                    let until =
                        *deadline.get_or_insert_with(|| Instant::now() + Duration::from_secs(5));
                    if Instant::now() > until {
                        return Err(HeapError::InitTimeout);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                0 => {
                    // SAFETY: the first page is mapped.
                    let first = unsafe { std::slice::from_raw_parts(base as *const u8, PAGE) };
                    if first.iter().any(|&b| b != 0) {
                        return Err(HeapError::NotAHeap(
                            "the region holds data that is not an rmalloc heap (its first page \
                             is not zero); use an empty region"
                                .into(),
                        ));
                    }
                    if mapped < MIN_HEAP {
                        // Too small for a heap yet: the caller grows it.
                        return Err(HeapError::NeedsMapping {
                            len: MIN_HEAP as u64,
                        });
                    }
                    if magic
                        .compare_exchange(0, MAGIC_INIT, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        heap.init(mapped);
                        magic.store(MAGIC, Ordering::Release);
                        return Ok(heap);
                    }
                }
                other => {
                    return Err(HeapError::NotAHeap(format!(
                        "the region holds data that is not an rmalloc heap (magic {other:#x})"
                    )));
                }
            }
        }
    }

    /// Whether the memory at `base` starts with an rmalloc heap header.
    ///
    /// # Safety
    ///
    /// `base` must point to at least 8 readable bytes.
    pub unsafe fn is_heap(base: *const u8) -> bool {
        // SAFETY: per the contract.
        unsafe { (*(base as *const AtomicU64)).load(Ordering::Acquire) == MAGIC }
    }

    /// The start of the memory.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    fn header(&self) -> *mut Header {
        self.base as *mut Header
    }

    fn check_header(&self) -> HResult<()> {
        let h = self.header();
        // SAFETY: the header is in the first page, which is mapped.
        unsafe {
            if (*h).version != VERSION {
                return Err(HeapError::Corrupt(format!(
                    "heap layout version {} (this library reads version {VERSION})",
                    (*h).version
                )));
            }
            if (*h).checksum != checksum(h) {
                return Err(HeapError::Corrupt("header checksum mismatch".into()));
            }
            let len = (*h).len;
            if (*h).page_size as usize != PAGE
                || len < MIN_HEAP as u64
                || !len.is_multiple_of(PAGE as u64)
                || (*h).npages != len / PAGE as u64
                || (*h).map_cap < (*h).npages
                || !(*h).map_off.is_multiple_of(PAGE as u64)
                || (*h).map_off + (*h).map_cap * 4 > len
            {
                return Err(HeapError::Corrupt("header fields out of range".into()));
            }
            if len > self.mapped as u64 {
                return Err(HeapError::NeedsMapping { len });
            }
        }
        Ok(())
    }

    fn init(&self, mapped: usize) {
        let h = self.header();
        let npages = (mapped / PAGE) as u64;
        let map_cap = npages.next_multiple_of((PAGE / 4) as u64);
        let map_pages = (map_cap * 4).div_ceil(PAGE as u64);
        // SAFETY: the memory is at least MIN_HEAP bytes, zero in its first
        // page, and ours alone while magic is MAGIC_INIT.
        unsafe {
            (*h).version = VERSION;
            (*h).page_size = PAGE as u32;
            (*h).len = npages * PAGE as u64;
            (*h).npages = npages;
            (*h).map_off = PAGE as u64;
            (*h).map_cap = map_cap;
            (*h).checksum = checksum(h);
            for p in 0..1 + map_pages {
                self.set_map(p, entry(K_META, 0));
            }
            self.insert_run(1 + map_pages, npages - 1 - map_pages);
        }
    }

    fn lock(&self) -> Guard<'_> {
        // SAFETY: the header is mapped.
        let word = unsafe { &(*self.header()).lock };
        // SAFETY: as above.
        let ns_slot = unsafe { &(*self.header()).lock_ns };
        let me = current_tid();
        if word
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_slow(word, me);
        }
        let ns = pid_namespace();
        if ns_slot.load(Ordering::Relaxed) != ns {
            ns_slot.store(ns, Ordering::Relaxed);
        }
        Guard { word }
    }

    #[cold]
    fn lock_slow(&self, word: &AtomicU32, me: u32) {
        for _ in 0..100 {
            std::hint::spin_loop();
            if word
                .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
        let mut since = Instant::now();
        loop {
            let v = word.load(Ordering::Relaxed);
            if v == 0 {
                if word
                    .compare_exchange(0, me | LOCK_WAITERS, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return;
                }
                continue;
            }
            if v & LOCK_WAITERS == 0
                && word
                    .compare_exchange(v, v | LOCK_WAITERS, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            futex_wait(word, v | LOCK_WAITERS, Duration::from_millis(100));
            if since.elapsed() > Duration::from_millis(500) {
                since = Instant::now();
                // SAFETY: the header is mapped.
                let ns = unsafe { &(*self.header()).lock_ns }.load(Ordering::Relaxed);
                let holder = word.load(Ordering::Relaxed);
                let tid = holder & !LOCK_WAITERS;
                if tid != 0
                    && ns != 0
                    && ns == pid_namespace()
                    && !thread_alive(tid)
                    && word
                        .compare_exchange(
                            holder,
                            me | LOCK_WAITERS,
                            Ordering::Acquire,
                            Ordering::Relaxed,
                        )
                        .is_ok()
                {
                    tracing::warn!(
                        dead_tid = tid,
                        "rmalloc: took over the heap lock from a thread that died holding it"
                    );
                    return;
                }
            }
        }
    }

    // ---- raw access (all offsets are checked against the heap length) ----

    fn map_entry(&self, page: u64) -> u32 {
        // SAFETY: callers pass page < npages <= map_cap; the page map lies
        // inside the checked heap length.
        unsafe {
            let map = self.base.add((*self.header()).map_off as usize) as *const u32;
            map.add(page as usize).read()
        }
    }

    fn set_map(&self, page: u64, e: u32) {
        // SAFETY: as in map_entry.
        unsafe {
            let map = self.base.add((*self.header()).map_off as usize) as *mut u32;
            map.add(page as usize).write(e)
        }
    }

    fn npages(&self) -> u64 {
        // SAFETY: the header is mapped.
        unsafe { (*self.header()).npages }
    }

    fn run_at(&self, page: u64) -> *mut FreeRun {
        // SAFETY: page < npages, inside the mapped heap.
        unsafe { self.base.add((page as usize) << PAGE_SHIFT) as *mut FreeRun }
    }

    fn slab_at(&self, page: u64) -> *mut Slab {
        self.run_at(page) as *mut Slab
    }

    // ---- free runs ----

    /// Adds the free run [page, page+pages) to its bin and tags its ends.
    fn insert_run(&self, page: u64, pages: u64) {
        if pages == 0 {
            return;
        }
        let h = self.header();
        let bin = bin_of(pages);
        let r = self.run_at(page);
        // SAFETY: the run lies inside the heap; the header is mapped.
        unsafe {
            let head = (*h).bins[bin];
            (*r).magic = RUN_MAGIC;
            (*r).next = head;
            (*r).prev = 0;
            (*r).pages = pages;
            if head != 0 {
                (*self.run_at(head >> PAGE_SHIFT)).prev = page << PAGE_SHIFT;
            }
            (*h).bins[bin] = page << PAGE_SHIFT;
            (*h).bin_mask |= 1 << bin;
        }
        self.set_map(page, entry(K_FREE, pages));
        self.set_map(page + pages - 1, entry(K_FREE, pages));
    }

    /// Takes the free run at `page` out of its bin (its map tags stay).
    fn remove_run(&self, page: u64) -> HResult<u64> {
        let h = self.header();
        let r = self.run_at(page);
        // SAFETY: page < npages; links are checked before use.
        unsafe {
            let pages = (*r).pages;
            if (*r).magic != RUN_MAGIC
                || pages == 0
                || page + pages > (*h).npages
                || self.map_entry(page) != entry(K_FREE, pages)
            {
                return Err(HeapError::Corrupt(format!("free run at page {page}")));
            }
            let (next, prev) = ((*r).next, (*r).prev);
            self.check_run_link(next)?;
            self.check_run_link(prev)?;
            let bin = bin_of(pages);
            if prev != 0 {
                (*self.run_at(prev >> PAGE_SHIFT)).next = next;
            } else {
                if (*h).bins[bin] != page << PAGE_SHIFT {
                    return Err(HeapError::Corrupt(format!(
                        "free run at page {page} is not in its bin"
                    )));
                }
                (*h).bins[bin] = next;
                if next == 0 {
                    (*h).bin_mask &= !(1 << bin);
                }
            }
            if next != 0 {
                (*self.run_at(next >> PAGE_SHIFT)).prev = prev;
            }
            (*r).magic = 0;
            Ok(pages)
        }
    }

    fn check_run_link(&self, off: u64) -> HResult<()> {
        if off == 0 {
            return Ok(());
        }
        if !off.is_multiple_of(PAGE as u64) || off >> PAGE_SHIFT >= self.npages() {
            return Err(HeapError::Corrupt(format!("free run link {off:#x}")));
        }
        Ok(())
    }

    /// Allocates a run of `pages` pages; None when no free run is long enough.
    fn alloc_pages(&self, pages: u64) -> HResult<Option<u64>> {
        if pages == 0 || pages > MAX_RUN {
            return Ok(None);
        }
        let h = self.header();
        let first = bin_of(pages);
        // SAFETY: the header is mapped.
        let mask = unsafe { (*h).bin_mask } & (!0u64 << first);
        let mut found = None;
        let mut bits = mask;
        let mut scanned = 0u64;
        while bits != 0 {
            let bin = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            // SAFETY: the header is mapped.
            let mut off = unsafe { (*h).bins[bin] };
            while off != 0 {
                self.check_run_link(off)?;
                let r = self.run_at(off >> PAGE_SHIFT);
                // SAFETY: checked link inside the heap.
                let (len, next) = unsafe { ((*r).pages, (*r).next) };
                if len >= pages {
                    found = Some(off >> PAGE_SHIFT);
                    break;
                }
                scanned += 1;
                if scanned > self.npages() {
                    return Err(HeapError::Corrupt("free run list has a cycle".into()));
                }
                off = next;
            }
            if found.is_some() {
                break;
            }
        }
        let Some(page) = found else {
            return Ok(None);
        };
        let len = self.remove_run(page)?;
        if len > pages {
            self.insert_run(page + pages, len - pages);
        }
        if pages > 1 && len == pages {
            // The old tail tag is now inside an allocated run.
            self.set_map(page + len - 1, entry(K_FREE_IN, 0));
        }
        Ok(Some(page))
    }

    /// Returns [page, page+pages) to the free runs, merging with neighbours.
    fn free_pages(&self, page: u64, pages: u64) -> HResult<()> {
        let mut start = page;
        let mut len = pages;
        if page > 0 {
            let e = self.map_entry(page - 1);
            if kind(e) == K_FREE {
                let plen = value(e);
                if plen == 0 || plen > page {
                    return Err(HeapError::Corrupt(format!(
                        "free run tag at page {}",
                        page - 1
                    )));
                }
                let pstart = page - plen;
                self.remove_run(pstart)?;
                self.set_map(page - 1, entry(K_FREE_IN, 0));
                start = pstart;
                len += plen;
            }
        }
        let after = page + pages;
        if after < self.npages() {
            let e = self.map_entry(after);
            if kind(e) == K_FREE {
                let nlen = self.remove_run(after)?;
                self.set_map(after, entry(K_FREE_IN, 0));
                len += nlen;
            }
        }
        if start != page {
            self.set_map(page, entry(K_FREE_IN, 0));
        }
        if pages > 1 {
            self.set_map(page + pages - 1, entry(K_FREE_IN, 0));
        }
        self.insert_run(start, len);
        Ok(())
    }

    // ---- slabs ----

    fn slab_check(&self, off: u64, class: usize) -> HResult<*mut Slab> {
        let (pages, n) = slab_geometry(class);
        if !off.is_multiple_of(PAGE as u64) || (off >> PAGE_SHIFT) + pages as u64 > self.npages() {
            return Err(HeapError::Corrupt(format!("slab offset {off:#x}")));
        }
        let s = self.slab_at(off >> PAGE_SHIFT);
        // SAFETY: the slab lies inside the heap.
        unsafe {
            if (*s).magic.load(Ordering::Relaxed) != SLAB_MAGIC
                || (*s).class as usize != class
                || (*s).pages as usize != pages
                || (*s).nblocks as usize != n
                || (*s).used > (*s).nblocks
                || (*s).bump > (*s).nblocks
            {
                return Err(HeapError::Corrupt(format!("slab header at {off:#x}")));
            }
        }
        Ok(s)
    }

    fn new_slab(&self, class: usize) -> HResult<Option<u64>> {
        let (pages, n) = slab_geometry(class);
        let Some(page) = self.alloc_pages(pages as u64)? else {
            return Ok(None);
        };
        let s = self.slab_at(page);
        // SAFETY: the new run lies inside the heap and is ours.
        unsafe {
            s.write(Slab {
                magic: AtomicU32::new(SLAB_MAGIC),
                class: class as u16,
                pages: pages as u16,
                nblocks: n as u16,
                used: 0,
                bump: 0,
                _pad: 0,
                free: 0,
                next: 0,
                prev: 0,
            });
            // The block states at the slab's end: none handed out.
            self.base
                .add(((page as usize + pages) << PAGE_SHIFT) - n)
                .write_bytes(0, n);
        }
        for i in 0..pages as u64 {
            self.set_map(page + i, entry(K_SLAB, (class as u64) << 8 | i));
        }
        let off = page << PAGE_SHIFT;
        self.partial_push(class, off);
        Ok(Some(off))
    }

    fn partial_push(&self, class: usize, off: u64) {
        let h = self.header();
        let s = self.slab_at(off >> PAGE_SHIFT);
        // SAFETY: off is a checked slab; the header is mapped.
        unsafe {
            let head = (*h).partial[class];
            (*s).next = head;
            (*s).prev = 0;
            if head != 0 {
                (*self.slab_at(head >> PAGE_SHIFT)).prev = off;
            }
            (*h).partial[class] = off;
        }
    }

    fn partial_remove(&self, class: usize, off: u64) -> HResult<()> {
        let h = self.header();
        let s = self.slab_at(off >> PAGE_SHIFT);
        // SAFETY: off is a checked slab; its links are checked before use.
        unsafe {
            let (next, prev) = ((*s).next, (*s).prev);
            if next != 0 {
                self.slab_check(next, class)?;
            }
            if prev != 0 {
                self.slab_check(prev, class)?;
                (*self.slab_at(prev >> PAGE_SHIFT)).next = next;
            } else {
                if (*h).partial[class] != off {
                    return Err(HeapError::Corrupt(format!("slab {off:#x} list links")));
                }
                (*h).partial[class] = next;
            }
            if next != 0 {
                (*self.slab_at(next >> PAGE_SHIFT)).prev = prev;
            }
            (*s).next = 0;
            (*s).prev = 0;
        }
        Ok(())
    }

    /// Takes a block of `class` off a slab (free list first, then the bump
    /// index) and counts it in `used`. Its bitmap bit stays clear: the caller
    /// sets it when the block goes to the application, or keeps it clear
    /// while the block sits in a thread cache. Call with the lock held.
    fn take_small(&self, class: usize) -> HResult<Option<u64>> {
        let h = self.header();
        // SAFETY: the header is mapped.
        let mut off = unsafe { (*h).partial[class] };
        if off == 0 {
            match self.new_slab(class)? {
                Some(o) => off = o,
                None => return Ok(None),
            }
        }
        let s = self.slab_check(off, class)?;
        let size = CLASS_SIZES[class] as u64;
        // SAFETY: s is a checked slab; block offsets are checked before use.
        unsafe {
            let n = (*s).nblocks as u64;
            let first = off + SLAB_HDR as u64;
            let (block, i) = if (*s).free != 0 {
                let b = (*s).free;
                let i = match b.checked_sub(first).and_then(|rel| block_index(rel, class)) {
                    Some(i) if (i as u64) < n => i,
                    _ => return Err(HeapError::Corrupt(format!("slab {off:#x} free list"))),
                };
                (*s).free = (self.base.add(b as usize) as *const u64).read();
                (b, i)
            } else if ((*s).bump as u64) < n {
                let i = (*s).bump as usize;
                (*s).bump += 1;
                (first + i as u64 * size, i)
            } else {
                return Err(HeapError::Corrupt(format!(
                    "full slab {off:#x} on the partial list"
                )));
            };
            if self.block_state(off, class, i).load(Ordering::Relaxed) != 0 {
                return Err(HeapError::Corrupt(format!(
                    "slab {off:#x} free list holds a live block"
                )));
            }
            (*s).used += 1;
            if (*s).used as u64 == n {
                self.partial_remove(class, off)?;
            }
            Ok(Some(block))
        }
    }

    /// The slab of the small block at `off` (page map entry `e` of its
    /// page), with the block's index; a bad pointer when `off` is not the
    /// start of a block.
    fn small_block(&self, off: u64, page: u64, e: u32) -> HResult<(u64, *mut Slab, usize, usize)> {
        let class = (value(e) >> 8) as usize;
        let index = value(e) & 0xff;
        if class >= NCLASSES || index > page {
            return Err(HeapError::Corrupt(format!("page map entry of page {page}")));
        }
        let slab = (page - index) << PAGE_SHIFT;
        let s = self.slab_check(slab, class)?;
        let first = slab + SLAB_HDR as u64;
        let Some(i) = off
            .checked_sub(first)
            .and_then(|rel| block_index(rel, class))
        else {
            return Err(HeapError::BadPointer(format!(
                "offset {off:#x} is not the start of a block"
            )));
        };
        // SAFETY: s is a checked slab.
        if i >= unsafe { (*s).bump } as usize {
            return Err(HeapError::BadPointer(format!(
                "offset {off:#x} is not allocated (double free?)"
            )));
        }
        Ok((slab, s, class, i))
    }

    /// Puts block `i` (at `off`) of slab `s` back on the slab's free list;
    /// its bitmap bit is already clear. Returns the slab's pages to the page
    /// allocator when it empties (unless it is its class's last). Call with
    /// the lock held.
    fn release_small(&self, slab: u64, s: *mut Slab, class: usize, off: u64) -> HResult<()> {
        // SAFETY: s is a checked slab and off one of its blocks.
        unsafe {
            if (*s).used == 0 {
                return Err(HeapError::Corrupt(format!("slab {slab:#x} use count")));
            }
            (self.base.add(off as usize) as *mut u64).write((*s).free);
            (*s).free = off;
            let was_full = (*s).used == (*s).nblocks;
            (*s).used -= 1;
            if was_full {
                self.partial_push(class, slab);
            } else if (*s).used == 0 {
                let h = self.header();
                let only = (*h).partial[class] == slab && (*s).next == 0;
                if !only {
                    self.partial_remove(class, slab)?;
                    (*s).magic.store(0, Ordering::Relaxed);
                    let pages = (*s).pages as u64;
                    let p = slab >> PAGE_SHIFT;
                    for k in 0..pages {
                        self.set_map(p + k, entry(K_FREE_IN, 0));
                    }
                    self.free_pages(p, pages)?;
                }
            }
        }
        Ok(())
    }

    /// The state byte of block `i` of the checked slab at `slab`: [`LIVE`]
    /// while the block is handed out to the application, 0 while it is free
    /// or in a thread cache. Only the block's current holder writes it (the
    /// lock holder, the thread freeing it, or the cache owner handing it
    /// out), with plain stores.
    #[inline(always)]
    fn block_state(&self, slab: u64, class: usize, i: usize) -> &AtomicU8 {
        let (pages, n) = GEOMETRY[class];
        // SAFETY: the slab lies inside the heap; its last n bytes are the
        // states, i < n.
        unsafe {
            &*(self
                .base
                .add(slab as usize + pages * PAGE - n + i.min(n - 1))
                as *const AtomicU8)
        }
    }

    /// Frees a small block under the lock; returns its size.
    fn free_small(&self, off: u64, page: u64, e: u32) -> HResult<u64> {
        let (slab, s, class, i) = self.small_block(off, page, e)?;
        let state = self.block_state(slab, class, i);
        if state.load(Ordering::Acquire) != LIVE {
            return Err(HeapError::BadPointer(format!(
                "offset {off:#x} is not allocated (double free?)"
            )));
        }
        state.store(0, Ordering::Release);
        self.release_small(slab, s, class, off)?;
        Ok(CLASS_SIZES[class] as u64)
    }

    // ---- public operations ----

    /// Allocates `size` bytes; returns the block's offset from the base.
    /// Blocks of up to [`MAX_SMALL`] bytes are 16-byte aligned, larger ones
    /// page aligned. `size` 0 allocates a minimal block.
    ///
    /// Small blocks come from the calling thread's cache of this heap when
    /// it has one (see [the module docs](self)), without the lock.
    #[inline]
    pub fn alloc(&self, size: usize) -> HResult<u64> {
        if size <= MAX_SMALL {
            let class = class_of(size.max(1));
            if let Some(rec) = self.thread_cache(true) {
                // SAFETY: rec is this thread's record, inside the heap; only
                // this thread changes it.
                unsafe {
                    let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
                    if n > 0 {
                        let off = ((*rec).slots[class][n - 1] as u64) << 4;
                        if let Some(state) = self.cached_block_bit(off, class)
                            && state.load(Ordering::Relaxed) == 0
                        {
                            state.store(LIVE, Ordering::Relaxed);
                            (*rec).count[class].store(n as u8 - 1, Ordering::Relaxed);
                            return Ok(off);
                        }
                    }
                }
                return self.alloc_cache_miss(rec, class);
            }
        }
        self.alloc_slow(size)
    }

    #[inline(never)]
    fn alloc_slow(&self, size: usize) -> HResult<u64> {
        let _g = self.lock();
        self.check_header()?;
        self.alloc_locked(size)
    }

    /// The cache of `class` is empty (refill it) or its top slot is bad.
    #[inline(never)]
    fn alloc_cache_miss(&self, rec: *mut CacheRec, class: usize) -> HResult<u64> {
        // SAFETY: rec is this thread's record.
        let n = unsafe { (*rec).count[class].load(Ordering::Relaxed) } as usize;
        if n == 0 {
            return self.alloc_refill(rec, class);
        }
        // Outside this view, or not a free block: check the header under the
        // lock, then drop the slot.
        let _g = self.lock();
        self.check_header()?;
        // SAFETY: as above.
        let off = unsafe {
            (*rec).count[class].store(n as u8 - 1, Ordering::Relaxed);
            ((*rec).slots[class][n - 1] as u64) << 4
        };
        Err(HeapError::Corrupt(format!(
            "thread cache holds offset {off:#x}, not a free block of class {class}"
        )))
    }

    fn alloc_locked(&self, size: usize) -> HResult<u64> {
        let h = self.header();
        let (off, bytes) = if size <= MAX_SMALL {
            let class = class_of(size.max(1));
            match self.take_small(class)? {
                Some(off) => {
                    let state = self.cached_block_bit(off, class).ok_or_else(|| {
                        HeapError::Corrupt(format!("fresh block {off:#x} fails validation"))
                    })?;
                    state.store(LIVE, Ordering::Release);
                    (off, CLASS_SIZES[class] as u64)
                }
                None => {
                    return Err(HeapError::Full {
                        pages: slab_geometry(class).0 as u64,
                    });
                }
            }
        } else {
            let pages = size.div_ceil(PAGE) as u64;
            match self.alloc_pages(pages)? {
                Some(page) => {
                    self.set_map(page, entry(K_LARGE, pages));
                    for p in page + 1..page + pages {
                        self.set_map(p, entry(K_CONT, 0));
                    }
                    (page << PAGE_SHIFT, pages * PAGE as u64)
                }
                None => return Err(HeapError::Full { pages }),
            }
        };
        // SAFETY: the header is mapped and we hold the lock.
        unsafe {
            (*h).allocated += bytes;
            (*h).nblocks += 1;
        }
        Ok(off)
    }

    /// Refills the empty cache of `class` in this thread's record `rec`
    /// under the lock and hands out its first block.
    #[cold]
    fn alloc_refill(&self, rec: *mut CacheRec, class: usize) -> HResult<u64> {
        let _g = self.lock();
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
        let mut n = 0;
        while n < want {
            match self.take_small(class)? {
                Some(off) => {
                    got[n] = off;
                    n += 1;
                }
                None => break,
            }
        }
        if n == 0 {
            // Blocks of other classes in this thread's cache may hold the
            // pages: give them back and try once more.
            self.flush_record(rec, None)?;
            return self.alloc_locked(CLASS_SIZES[class] as usize);
        }
        let size = CLASS_SIZES[class] as u64;
        // SAFETY: the header is mapped, we hold the lock, rec is ours.
        unsafe {
            (*h).allocated += n as u64 * size;
            (*h).nblocks += n as u64;
            // The first block taken goes to the caller; the others are
            // stacked so that they come out in the slab's order.
            for (j, &off) in got[1..n].iter().enumerate() {
                (*rec).slots[class][n - 2 - j] = (off >> 4) as u32;
            }
            (*rec).count[class].store(n as u8 - 1, Ordering::Relaxed);
        }
        let state = self.cached_block_bit(got[0], class).ok_or_else(|| {
            HeapError::Corrupt(format!("fresh block {:#x} fails validation", got[0]))
        })?;
        state.store(LIVE, Ordering::Release);
        Ok(got[0])
    }

    /// Allocates and returns a pointer (see [`Heap::alloc`]).
    pub fn alloc_ptr(&self, size: usize) -> HResult<*mut u8> {
        let off = self.alloc(size)?;
        // SAFETY: off is inside the heap.
        Ok(unsafe { self.base.add(off as usize) })
    }

    /// Frees the block at offset `off`. A small block goes to the calling
    /// thread's cache of this heap when it has one (without the lock); its
    /// bitmap bit is cleared atomically first, so a double free is refused
    /// whether the block sits in a cache or on its slab.
    #[inline]
    pub fn free(&self, off: u64) -> HResult<()> {
        if let Some(rec) = self.thread_cache(true)
            && let Some((state, class)) = self.small_block_bit(off)
        {
            // SAFETY: rec is this thread's record; only this thread changes
            // it.
            unsafe {
                let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
                if n < CACHE_CAPS[class] as usize {
                    if state.load(Ordering::Relaxed) == LIVE {
                        state.store(0, Ordering::Relaxed);
                        (*rec).slots[class][n] = (off >> 4) as u32;
                        (*rec).count[class].store(n as u8 + 1, Ordering::Relaxed);
                        return Ok(());
                    }
                    // Not allocated: the locked path says why.
                } else {
                    return self.free_flush(rec, off, class);
                }
            }
        }
        self.free_slow(off)
    }

    #[inline(never)]
    fn free_slow(&self, off: u64) -> HResult<()> {
        let _g = self.lock();
        self.check_header()?;
        self.free_locked(off)
    }

    /// The cache of `class` is full: gives its older half back to the slabs
    /// under the lock, then caches `off`.
    #[cold]
    fn free_flush(&self, rec: *mut CacheRec, off: u64, class: usize) -> HResult<()> {
        let _g = self.lock();
        self.check_header()?;
        let half = CACHE_CAPS[class] as usize / 2;
        self.flush_class(rec, class, half)?;
        let Some((state, _)) = self.small_block_bit(off) else {
            return self.free_locked(off);
        };
        if state.load(Ordering::Relaxed) != LIVE {
            return self.free_locked(off);
        }
        state.store(0, Ordering::Relaxed);
        // SAFETY: rec is ours; the flush left room.
        unsafe {
            let n = (*rec).count[class].load(Ordering::Relaxed) as usize;
            (*rec).slots[class][n] = (off >> 4) as u32;
            (*rec).count[class].store(n as u8 + 1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn free_locked(&self, off: u64) -> HResult<()> {
        let h = self.header();
        let npages = self.npages();
        let page = off >> PAGE_SHIFT;
        if page >= npages {
            return Err(HeapError::BadPointer(format!(
                "offset {off:#x} is outside the heap"
            )));
        }
        let e = self.map_entry(page);
        let bytes = match kind(e) {
            K_SLAB => self.free_small(off, page, e)?,
            K_LARGE if off.is_multiple_of(PAGE as u64) => {
                let pages = value(e);
                if pages == 0 || page + pages > npages {
                    return Err(HeapError::Corrupt(format!("large block at page {page}")));
                }
                self.set_map(page, entry(K_FREE_IN, 0));
                self.free_pages(page, pages)?;
                pages * PAGE as u64
            }
            _ => {
                return Err(HeapError::BadPointer(format!(
                    "offset {off:#x} is not the start of a live block"
                )));
            }
        };
        // SAFETY: the header is mapped and we hold the lock.
        unsafe {
            (*h).allocated = (*h).allocated.saturating_sub(bytes);
            (*h).nblocks = (*h).nblocks.saturating_sub(1);
        }
        Ok(())
    }

    /// Frees the block at `ptr`.
    pub fn free_ptr(&self, ptr: *const u8) -> HResult<()> {
        let off = (ptr as usize).wrapping_sub(self.base as usize);
        if ptr < self.base as *const u8 || off >= self.mapped {
            return Err(HeapError::BadPointer(format!(
                "{ptr:p} is outside the heap"
            )));
        }
        self.free(off as u64)
    }

    /// Usable size of the live block at `off`.
    pub fn block_size(&self, off: u64) -> HResult<usize> {
        let _g = self.lock();
        self.check_header()?;
        let page = off >> PAGE_SHIFT;
        if page >= self.npages() {
            return Err(HeapError::BadPointer(format!("offset {off:#x}")));
        }
        let e = self.map_entry(page);
        match kind(e) {
            K_SLAB => Ok(CLASS_SIZES[((value(e) >> 8) as usize).min(NCLASSES - 1)] as usize),
            K_LARGE if off.is_multiple_of(PAGE as u64) => Ok(value(e) as usize * PAGE),
            _ => Err(HeapError::BadPointer(format!("offset {off:#x}"))),
        }
    }

    /// Adopts memory grown to `new_len` bytes (at most the mapped length).
    /// Growing needs one more page-map page per 4 MiB beyond the map's
    /// capacity; it is taken from the new memory.
    pub fn extend(&self, new_len: usize) -> HResult<()> {
        let _g = self.lock();
        self.check_header()?;
        self.extend_locked(new_len)
    }

    fn extend_locked(&self, new_len: usize) -> HResult<()> {
        let h = self.header();
        let new_len = new_len.min(self.mapped) & !(PAGE - 1);
        let old_n = self.npages();
        let new_n = (new_len / PAGE) as u64;
        if new_n <= old_n {
            return Ok(());
        }
        // SAFETY: the header is mapped; every page touched is below new_n,
        // which is mapped.
        unsafe {
            let cap = (*h).map_cap;
            let mut free_from = old_n;
            if new_n > cap {
                let new_cap = new_n.max(cap * 2).next_multiple_of((PAGE / 4) as u64);
                let map_pages = (new_cap * 4).div_ceil(PAGE as u64);
                if old_n + map_pages >= new_n {
                    return Err(HeapError::Full { pages: map_pages });
                }
                let old_off = (*h).map_off;
                let old_pages = (cap * 4).div_ceil(PAGE as u64);
                let new_off = old_n << PAGE_SHIFT;
                ptr::copy_nonoverlapping(
                    self.base.add(old_off as usize),
                    self.base.add(new_off as usize),
                    (old_n * 4) as usize,
                );
                (*h).map_off = new_off;
                (*h).map_cap = new_cap;
                (*h).len = new_n << PAGE_SHIFT;
                (*h).npages = new_n;
                (*h).checksum = checksum(h);
                for p in old_n..old_n + map_pages {
                    self.set_map(p, entry(K_META, 0));
                }
                free_from = old_n + map_pages;
                // Old map pages become free (they are below old_n).
                for p in 0..old_pages {
                    self.set_map((old_off >> PAGE_SHIFT) + p, entry(K_FREE_IN, 0));
                }
                self.free_pages(old_off >> PAGE_SHIFT, old_pages)?;
            } else {
                (*h).len = new_n << PAGE_SHIFT;
                (*h).npages = new_n;
                (*h).checksum = checksum(h);
            }
            for p in free_from..new_n {
                self.set_map(p, entry(K_FREE_IN, 0));
            }
            self.free_pages(free_from, new_n - free_from)?;
        }
        Ok(())
    }

    /// Stores the root block offset (None clears it).
    pub fn set_root(&self, off: Option<u64>) -> HResult<()> {
        let _g = self.lock();
        self.check_header()?;
        // SAFETY: the header is mapped.
        let len = unsafe { (*self.header()).len };
        let v = match off {
            None => 0,
            Some(o) if o < len => o + 1,
            Some(o) => {
                return Err(HeapError::BadPointer(format!(
                    "root offset {o:#x} is outside the heap ({len} bytes)"
                )));
            }
        };
        // SAFETY: the header is mapped.
        unsafe { &(*self.header()).root }.store(v, Ordering::Release);
        Ok(())
    }

    /// The root block offset, if one is set. Takes no lock (the slot is
    /// atomic), so it works on a read-only mapping.
    pub fn root(&self) -> HResult<Option<u64>> {
        let h = self.header();
        // SAFETY: the header is mapped.
        let (v, len) = unsafe { ((*h).root.load(Ordering::Acquire), (*h).len) };
        match v.checked_sub(1) {
            Some(off) if off >= len => Err(HeapError::Corrupt(format!(
                "root offset {off:#x} is outside the heap"
            ))),
            Some(off) if off >= self.mapped as u64 => Err(HeapError::NeedsMapping { len }),
            r => Ok(r),
        }
    }

    /// Heap usage; also walks the free runs to validate them.
    pub fn stats(&self) -> HResult<HeapStats> {
        let _g = self.lock();
        self.check_header()?;
        let h = self.header();
        let mut free_pages = 0;
        let mut largest = 0;
        for bin in 0..NBINS {
            // SAFETY: the header is mapped.
            let mut off = unsafe { (*h).bins[bin] };
            let mut n = 0u64;
            while off != 0 {
                self.check_run_link(off)?;
                let r = self.run_at(off >> PAGE_SHIFT);
                // SAFETY: checked link.
                let (pages, next, magic) = unsafe { ((*r).pages, (*r).next, (*r).magic) };
                if magic != RUN_MAGIC || bin_of(pages.max(1)) != bin {
                    return Err(HeapError::Corrupt(format!("free run at {off:#x}")));
                }
                free_pages += pages;
                largest = largest.max(pages);
                n += 1;
                if n > self.npages() {
                    return Err(HeapError::Corrupt("free run list has a cycle".into()));
                }
                off = next;
            }
        }
        let mut partial_slab_pages = 0;
        for class in 0..NCLASSES {
            // SAFETY: the header is mapped.
            let mut off = unsafe { (*h).partial[class] };
            let mut n = 0u64;
            while off != 0 {
                let s = self.slab_check(off, class)?;
                partial_slab_pages += slab_geometry(class).0 as u64;
                // SAFETY: checked slab.
                off = unsafe { (*s).next };
                n += 1;
                if n > self.npages() {
                    return Err(HeapError::Corrupt("slab list has a cycle".into()));
                }
            }
        }
        let (cached_blocks, cached_bytes) = self.cached()?;
        // SAFETY: the header is mapped.
        unsafe {
            Ok(HeapStats {
                partial_slab_pages,
                len: (*h).len,
                free_pages,
                allocated: (*h).allocated.saturating_sub(cached_bytes),
                blocks: (*h).nblocks.saturating_sub(cached_blocks),
                cached_blocks,
                largest_free_run: largest,
            })
        }
    }

    /// Pages of metadata (header and page map) of a heap of `len` bytes
    /// created fresh; for sizing.
    pub fn overhead_pages(len: usize) -> u64 {
        let npages = (len / PAGE) as u64;
        1 + (npages.next_multiple_of((PAGE / 4) as u64) * 4).div_ceil(PAGE as u64)
    }
}

// ---- thread caches ----

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
/// `K_CACHE`, linked from [`Header::caches`]) so that other processes see
/// which blocks it holds and can take them back when the owner is dead.
/// Only the owner changes it, without the heap lock; others read it under
/// the lock (the counts, for statistics) or take it over when the owner
/// thread no longer exists.
#[repr(C)]
struct CacheRec {
    magic: u64,
    /// Host (boot id) and pid namespace of the owner thread.
    owner_ns: AtomicU64,
    owner_tid: AtomicU32,
    owner_pid: AtomicU32,
    /// Next record (under the heap lock).
    next: u64,
    count: [AtomicU8; NCLASSES],
    _pad: [u8; 8],
    /// Cached blocks per class, offset / 16; the newest last.
    slots: [[u32; CACHE_CAP]; NCLASSES],
}

const _: () = assert!(std::mem::size_of::<CacheRec>() <= PAGE);

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
    static TID: Cell<u32> = const { Cell::new(0) };
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
/// used; [`crate::mapping::unmap`] does.
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
    GEN.load(Ordering::Acquire)
}

extern "C" fn after_fork_child() {
    // The child's only thread has a new id, and the records it copied
    // belong to the parent's threads.
    let _ = TID.try_with(|t| t.set(0));
    let _ = FAST.try_with(|f| f.set(NO_FAST));
    let _ = CACHES.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            c.0.clear();
        }
    });
}

fn register_fork_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain function without preconditions.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
    });
}

/// Identity of this host's pid namespace: the boot id and the namespace's
/// inode (the same inode numbers recur on other machines).
fn host_ns() -> u64 {
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

impl Heap {
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
                        Err(_) => return None,
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
    fn small_block_bit(&self, off: u64) -> Option<(&AtomicU8, usize)> {
        if off >= CACHE_MAX_LEN || off & (ALIGN as u64 - 1) != 0 || off as usize >= self.mapped {
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
        Some((self.block_state(slab, class, i), class))
    }

    /// [`Heap::small_block_bit`] of a block of `class` that fits the view.
    #[inline(always)]
    fn cached_block_bit(&self, off: u64, class: usize) -> Option<&AtomicU8> {
        let (state, c) = self.small_block_bit(off)?;
        (c == class && off as usize + CLASS_SIZES[class] as usize <= self.mapped).then_some(state)
    }

    /// Gives the `k` oldest blocks of `class` in record `rec` back to their
    /// slabs. Call with the lock held.
    fn flush_class(&self, rec: *mut CacheRec, class: usize, k: usize) -> HResult<()> {
        let h = self.header();
        let size = CLASS_SIZES[class] as u64;
        // SAFETY: rec is a checked record inside the heap whose owner does
        // not use it meanwhile (it is the caller, or dead); the header is
        // mapped and we hold the lock.
        unsafe {
            let n = ((*rec).count[class].load(Ordering::Relaxed) as usize).min(CACHE_CAP);
            let k = k.min(n);
            let mut bad = None;
            for j in 0..k {
                let off = ((*rec).slots[class][j] as u64) << 4;
                let page = off >> PAGE_SHIFT;
                let r = if page < self.npages() && kind(self.map_entry(page)) == K_SLAB {
                    self.small_block(off, page, self.map_entry(page))
                } else {
                    Err(HeapError::Corrupt(format!("cached offset {off:#x}")))
                };
                match r {
                    Ok((slab, s, c, i)) if c == class => {
                        // A set bit: the owner died between handing the block
                        // out and dropping it from its cache; it is live.
                        if self.block_state(slab, class, i).load(Ordering::Acquire) != 0 {
                            continue;
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
    fn record_at(&self, off: u64) -> HResult<*mut CacheRec> {
        if !off.is_multiple_of(PAGE as u64)
            || off >> PAGE_SHIFT >= self.npages()
            || kind(self.map_entry(off >> PAGE_SHIFT)) != K_CACHE
        {
            return Err(HeapError::Corrupt(format!("thread cache link {off:#x}")));
        }
        let rec = self.run_at(off >> PAGE_SHIFT) as *mut CacheRec;
        // SAFETY: a page of the heap.
        if unsafe { (*rec).magic } != CACHE_MAGIC {
            return Err(HeapError::Corrupt(format!("thread cache at {off:#x}")));
        }
        Ok(rec)
    }

    /// Offsets of all records. Call with the lock held.
    fn records(&self) -> HResult<Vec<u64>> {
        let mut out = Vec::new();
        // SAFETY: the header is mapped.
        let mut off = unsafe { (*self.header()).caches };
        while off != 0 {
            let rec = self.record_at(off)?;
            out.push(off);
            if out.len() as u64 > self.npages() {
                return Err(HeapError::Corrupt("thread cache list has a cycle".into()));
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
        let _g = self.lock();
        self.check_header()?;
        let h = self.header();
        // SAFETY: the header is mapped.
        if unsafe { (*h).len } > CACHE_MAX_LEN {
            return Ok(None);
        }
        register_fork_handler();
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
                loop {
                    if prev == 0 {
                        return Err(HeapError::Corrupt(format!(
                            "thread cache {off:#x} is not in the list"
                        )));
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
        let _g = self.lock();
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
            return Err(HeapError::Corrupt(format!(
                "thread cache {off:#x} changed owner"
            )));
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
    fn cached(&self) -> HResult<(u64, u64)> {
        let (mut blocks, mut bytes) = (0, 0);
        for off in self.records()? {
            let rec = self.record_at(off)?;
            for (c, &size) in CLASS_SIZES.iter().enumerate() {
                // SAFETY: checked record; the count is atomic.
                let n = unsafe { (*rec).count[c].load(Ordering::Relaxed) } as u64;
                blocks += n;
                bytes += n * size as u64;
            }
        }
        Ok((blocks, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    /// Anonymous shared memory for a heap.
    struct Mem {
        ptr: *mut u8,
        len: usize,
    }

    // SAFETY: plain memory, used through a Heap.
    unsafe impl Send for Mem {}
    // SAFETY: as above.
    unsafe impl Sync for Mem {}

    impl Mem {
        fn new(len: usize) -> Mem {
            // SAFETY: anonymous mapping with no address hint.
            let p = unsafe {
                libc::mmap(
                    ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Mem {
                ptr: p as *mut u8,
                len,
            }
        }
        fn heap(&self, len: usize) -> Heap {
            // SAFETY: the memory stays mapped for the test.
            unsafe { Heap::attach(self.ptr, len) }.unwrap()
        }
    }

    impl Drop for Mem {
        fn drop(&mut self) {
            unmapping(self.ptr, self.len);
            // SAFETY: our mapping.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }

    #[test]
    fn class_table_rounds_up() {
        assert_eq!(CLASS_SIZES[class_of(1)], 16);
        assert_eq!(CLASS_SIZES[class_of(16)], 16);
        assert_eq!(CLASS_SIZES[class_of(17)], 32);
        assert_eq!(CLASS_SIZES[class_of(129)], 160);
        assert_eq!(CLASS_SIZES[class_of(2048)], 2048);
        for (c, &size) in CLASS_SIZES.iter().enumerate() {
            let (pages, n) = slab_geometry(c);
            assert!((1..=8).contains(&pages) && (15..=MAX_SLAB_BLOCKS).contains(&n));
            assert!(SLAB_HDR + n * (size as usize + 1) <= pages * PAGE);
        }
        assert_eq!(bin_of(1), 0);
        assert_eq!(bin_of(32), 31);
        assert_eq!(bin_of(33), 32);
        assert_eq!(bin_of(64), 33);
    }

    #[test]
    fn alloc_free_reuse_and_root() {
        let m = Mem::new(1 << 20);
        let h = m.heap(1 << 20);
        let a = h.alloc(64).unwrap();
        let b = h.alloc(64).unwrap();
        assert_ne!(a, b);
        assert_eq!(a % 16, 0);
        h.free(a).unwrap();
        assert_eq!(h.alloc(64).unwrap(), a, "a freed block is reused");
        let big = h.alloc(10_000).unwrap();
        assert_eq!(big % PAGE as u64, 0);
        assert_eq!(h.block_size(big).unwrap(), 3 * PAGE);
        h.free(big).unwrap();
        assert_eq!(h.alloc(9000).unwrap(), big, "freed pages are reused");
        assert_eq!(h.root().unwrap(), None);
        h.set_root(Some(b)).unwrap();
        // A second view (another process) sees the same heap and root.
        let h2 = m.heap(1 << 20);
        assert_eq!(h2.root().unwrap(), Some(b));
        h2.free(b).unwrap();
        assert_eq!(
            h.free(b),
            Err(HeapError::BadPointer(format!(
                "offset {b:#x} is not allocated (double free?)"
            )))
        );
        assert!(matches!(h.free(b + 8), Err(HeapError::BadPointer(_))));
        assert!(matches!(h.free(1 << 30), Err(HeapError::BadPointer(_))));
        assert!(matches!(h.free(0), Err(HeapError::BadPointer(_))));
    }

    #[test]
    fn full_then_extend() {
        let m = Mem::new(64 << 20);
        let h = m.heap(MIN_HEAP);
        let mut blocks = Vec::new();
        let err = loop {
            match h.alloc(PAGE) {
                Ok(o) => blocks.push(o),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, HeapError::Full { pages: 1 }));
        assert_eq!(err.errno(), libc::ENOMEM);
        assert_eq!(blocks.len() as u64, 16 - Heap::overhead_pages(MIN_HEAP));
        // Grow past the page map's capacity (4 MiB) so the map moves.
        let h = m.heap(64 << 20);
        h.extend(64 << 20).unwrap();
        let s = h.stats().unwrap();
        assert_eq!(s.len, 64 << 20);
        let big = h.alloc(32 << 20).unwrap();
        for &b in &blocks {
            h.free(b).unwrap();
        }
        h.free(big).unwrap();
        h.flush_cache().unwrap();
        let s = h.stats().unwrap();
        assert_eq!(s.blocks, 0);
        assert_eq!(s.allocated, 0);
        // Everything but header and map coalesced into at most two runs
        // (the old map's pages sit before the new map).
        // All but the header and the new map (16 pages at page 16, after the
        // first heap) is free: pages 1..16 and 32.. .
        assert_eq!(s.free_pages, (64 << 20) / PAGE as u64 - 17, "{s:?}");
        assert_eq!(s.largest_free_run, (64 << 20) / PAGE as u64 - 32, "{s:?}");
    }

    #[test]
    fn small_memory_asks_for_more() {
        let m = Mem::new(1 << 20);
        let want = HeapError::NeedsMapping {
            len: MIN_HEAP as u64,
        };
        // SAFETY: the memory stays mapped.
        assert_eq!(unsafe { Heap::attach(m.ptr, 0) }.unwrap_err(), want);
        // SAFETY: as above.
        assert_eq!(unsafe { Heap::attach(m.ptr, PAGE) }.unwrap_err(), want);
        let h = m.heap(MIN_HEAP);
        assert_eq!(h.stats().unwrap().len, MIN_HEAP as u64);
        // A view mapping less than the heap is told to map more.
        // SAFETY: as above.
        let small = unsafe { Heap::attach(m.ptr, PAGE) }.unwrap();
        assert_eq!(
            small.alloc(8).unwrap_err(),
            HeapError::NeedsMapping {
                len: MIN_HEAP as u64
            }
        );
    }

    #[test]
    fn header_corruption_is_einval() {
        let m = Mem::new(1 << 20);
        let h = m.heap(1 << 20);
        let a = h.alloc(100).unwrap();
        // SAFETY: test pokes the header's len field.
        unsafe { (*(m.ptr as *mut Header)).len += PAGE as u64 };
        let e = h.alloc(10).unwrap_err();
        assert!(matches!(e, HeapError::Corrupt(_)), "{e}");
        assert_eq!(e.errno(), libc::EINVAL);
        // SAFETY: restore.
        unsafe { (*(m.ptr as *mut Header)).len -= PAGE as u64 };
        h.free(a).unwrap();
        // A wrong magic is not a heap.
        // SAFETY: test pokes the magic.
        unsafe { (*(m.ptr as *mut Header)).magic.store(7, Ordering::Relaxed) };
        // SAFETY: memory stays mapped.
        let e = unsafe { Heap::attach(m.ptr, 1 << 20) }.unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        // Memory with data in it is not turned into a heap.
        let m2 = Mem::new(1 << 20);
        // SAFETY: test writes into its own memory.
        unsafe { m2.ptr.add(100).write(1) };
        // SAFETY: memory stays mapped.
        assert!(matches!(
            unsafe { Heap::attach(m2.ptr, 1 << 20) },
            Err(HeapError::NotAHeap(_))
        ));
        // A smashed slab header is detected.
        let m3 = Mem::new(1 << 20);
        let h3 = m3.heap(1 << 20);
        let b = h3.alloc(64).unwrap();
        // SAFETY: the slab header is at the start of the block's page.
        unsafe { m3.ptr.add((b as usize) & !(PAGE - 1)).write_bytes(0xff, 16) };
        assert!(matches!(h3.free(b), Err(HeapError::Corrupt(_))));
    }

    #[test]
    fn fragmentation_coalesces() {
        let m = Mem::new(8 << 20);
        let h = m.heap(8 << 20);
        let before = h.stats().unwrap();
        let mut small = Vec::new();
        let mut large = Vec::new();
        for i in 0..2000 {
            small.push(h.alloc(16 + (i % 100) * 20).unwrap());
            if i % 10 == 0 {
                large.push(h.alloc(PAGE * (1 + i % 7) + 5).unwrap());
            }
        }
        // Free every other one, then the rest.
        for (i, o) in small.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
            h.free(*o).unwrap_or_else(|e| panic!("{i}: {e}"));
        }
        for o in large.iter().step_by(2) {
            h.free(*o).unwrap();
        }
        for o in small.iter().skip(1).step_by(2) {
            h.free(*o).unwrap();
        }
        for o in large.iter().skip(1).step_by(2) {
            h.free(*o).unwrap();
        }
        let cached = h.stats().unwrap();
        assert_eq!(cached.blocks, 0);
        assert!(cached.cached_blocks > 0);
        h.flush_cache().unwrap();
        let after = h.stats().unwrap();
        assert_eq!(after.blocks, 0);
        assert_eq!(after.cached_blocks, 0);
        // Every page is free again but the last slab of each class used.
        assert_eq!(
            after.free_pages + after.partial_slab_pages,
            before.free_pages,
            "{before:?} {after:?}"
        );
        assert!(after.partial_slab_pages <= NCLASSES as u64 * 8);
        // A block of almost everything fits again.
        let big = h.alloc((after.largest_free_run as usize) * PAGE).unwrap();
        h.free(big).unwrap();
    }

    #[test]
    fn threads_share_a_heap() {
        let m = Arc::new(Mem::new(64 << 20));
        let h = m.heap(64 << 20);
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    let h = m.heap(64 << 20);
                    let mut live: Vec<(u64, usize)> = Vec::new();
                    for i in 0..20_000usize {
                        let size = [8, 64, 200, 1500, 5000][(i * 7 + t as usize) % 5];
                        let off = h.alloc(size).unwrap();
                        // SAFETY: the block is ours.
                        unsafe { m.ptr.add(off as usize).write_bytes(t, size) };
                        live.push((off, size));
                        if i % 3 != 0 {
                            let (o, s) = live.swap_remove((i * 13) % live.len());
                            // SAFETY: the block is ours.
                            let data =
                                unsafe { std::slice::from_raw_parts(m.ptr.add(o as usize), s) };
                            assert!(
                                data.iter().all(|&b| b == t),
                                "block overwritten by another thread"
                            );
                            h.free(o).unwrap();
                        }
                    }
                    for (o, _) in live {
                        h.free(o).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = h.stats().unwrap();
        assert_eq!(s.blocks, 0);
        assert_eq!(s.allocated, 0);
    }

    #[test]
    fn lock_taken_over_from_dead_thread() {
        let m = Mem::new(1 << 20);
        let h = m.heap(1 << 20);
        // A thread takes the lock and exits without releasing it.
        let h2 = h;
        std::thread::spawn(move || std::mem::forget(h2.lock()))
            .join()
            .unwrap();
        let started = Instant::now();
        h.alloc(10).unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
    }

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

    /// A model check: random allocs and frees never overlap, keep their
    /// contents, and return the heap to its initial free space.
    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Free(usize),
    }

    fn op_strategy() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            3 => (1usize..3000).prop_map(Op::Alloc),
            1 => (3000usize..40_000).prop_map(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn model(ops in proptest::collection::vec(op_strategy(), 1..400), grow in proptest::bool::ANY) {
            let len = 2 << 20;
            let m = Mem::new(8 << 20);
            let mut h = m.heap(len);
            let initial = h.stats().unwrap();
            let mut live: BTreeMap<u64, (usize, u8)> = BTreeMap::new();
            let mut tag = 0u8;
            for op in ops {
                match op {
                    Op::Alloc(size) => {
                        let off = match h.alloc(size) {
                            Ok(o) => o,
                            Err(HeapError::Full { .. }) => {
                                if grow {
                                    h = m.heap(8 << 20);
                                    h.extend(8 << 20).unwrap();
                                }
                                continue;
                            }
                            Err(e) => panic!("{e}"),
                        };
                        let align = if size <= MAX_SMALL { ALIGN } else { PAGE };
                        assert_eq!(off as usize % align, 0);
                        // No overlap with the neighbours.
                        if let Some((&o, &(s, _))) = live.range(..off).next_back() {
                            assert!(o + s as u64 <= off, "overlap");
                        }
                        if let Some((&o, _)) = live.range(off..).next() {
                            assert!(off + size as u64 <= o, "overlap");
                        }
                        assert!(h.block_size(off).unwrap() >= size);
                        tag = tag.wrapping_add(1);
                        // SAFETY: the block is ours.
                        unsafe { m.ptr.add(off as usize).write_bytes(tag, size) };
                        live.insert(off, (size, tag));
                    }
                    Op::Free(i) => {
                        if live.is_empty() { continue; }
                        let off = *live.keys().nth(i % live.len()).unwrap();
                        let (size, t) = live.remove(&off).unwrap();
                        // SAFETY: the block is ours.
                        let data = unsafe { std::slice::from_raw_parts(m.ptr.add(off as usize), size) };
                        assert!(data.iter().all(|&b| b == t), "contents changed");
                        h.free(off).unwrap();
                        assert!(h.free(off).is_err(), "double free accepted");
                    }
                }
            }
            let h = m.heap(8 << 20);
            for &off in live.keys() {
                h.free(off).unwrap();
            }
            h.flush_cache().unwrap();
            let s = h.stats().unwrap();
            assert_eq!(s.blocks, 0);
            assert_eq!(s.allocated, 0);
            if s.len == initial.len {
                assert_eq!(s.free_pages + s.partial_slab_pages, initial.free_pages);
            }
        }
    }
}
