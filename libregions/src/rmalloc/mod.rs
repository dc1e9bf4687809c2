//! rmalloc: an allocator whose whole state lives in the memory it manages
//! (Remote Regions paper §5.7), so that any process that maps a region continues the
//! allocations of the processes before it.
//!
//! # Layout
//!
//! The managed memory is a sequence of 4 KiB pages. Page 0 holds the
//! `Header`: a magic number and version, a lock word, the managed length, the
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
//!   state byte per block, set while the block is handed out and (to
//!   another value) while it sits in a thread cache (so a double free or a
//!   pointer into the middle of a block is refused with `EINVAL`, and a
//!   corrupt free list that leads to a block in use is noticed). Slabs
//!   with free blocks are on their class's partial list; an empty slab goes
//!   back to the page allocator unless it is the class's last one.
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
//! map the region's shared memory exclude each other (a process the host agent
//! gives no writable segment maps a private copy of its host's chunks, and so
//! allocates like another host). The word holds the holder's thread id;
//! a waiter that finds the holder's thread gone (same pid namespace) takes the
//! lock over instead of hanging. Processes that do not share the memory (on
//! different hosts, each with its own cached copy of remote pages) must not
//! allocate in one [`Heap`]: [`shared`] gives each process heaps of its own
//! (arenas) inside one region, which is how the C functions use it.
//!
//! The fast paths take no lock: a free checks the block against the page map
//! and its slab (or finds it in the slab the thread last checked a freed block
//! in, while no slab of the heap was released since: `cache_mirror`), checks
//! that its state byte says "handed out" and sets it to
//! "cached" (a plain load and store: only the block's current holder writes
//! its byte, so no atomic read-modify-write is needed) and pushes it on the
//! cache; an allocation pops a block and sets its byte to "handed out". The
//! byte says "handed out" exactly while the block is handed out, so a
//! double free is refused
//! (`EINVAL`) wherever the block sits: on its slab, in this thread's cache,
//! or in another thread's or process's cache. The one case no longer caught:
//! two frees of the same block that run at the same instant on two threads
//! (both can read "handed out" before either changes it); before, the lock
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
//! # Untrusted heaps
//!
//! Any process that maps the region can write the heap, so nothing read from
//! it is trusted: every offset, index, count, link, size, page-map entry,
//! thread-cache record field and the lock word is checked before it is used
//! as an address, an index or a loop bound. Offsets must lie inside the heap
//! (and inside this process's view of it) with the alignment the layout
//! gives them, indices below their tables' lengths, counts below their
//! capacities, list links must point at structures of the right kind whose
//! back links agree, list walks stop after as many steps as the heap has
//! pages (a cycle is an error, not a hang), and sums saturate. A heap that
//! fails a check gives [`HeapError::Corrupt`] (`EINVAL`) naming the field
//! and its value; it never makes the allocator write outside the heap, panic
//! or hang. Waiting for the lock is bounded too: a lock word that names no
//! possible thread fails at once, one that names a live thread that holds it
//! for more than [`LOCK_TIMEOUT`] fails then (see `lock`). Corruption that
//! passes every check (a list head zeroed, a forged structure that looks
//! valid) can still lose memory (the heap looks `Full`) or hand memory out
//! twice, but only memory inside the heap. The fast paths check a block's
//! state byte, and find where it is either from the page map and its slab or
//! from what the thread itself found there when it checked the block going
//! into its cache (or last checked a block of that slab): the addresses they
//! write come from the thread's own memory, found inside the mapping in the
//! current unmap epoch, never from heap memory unchecked.
//!
//! # Errors
//!
//! [`HeapError::Full`] when no free run is large enough (the caller grows the
//! region and calls [`Heap::extend`]), [`HeapError::Corrupt`] when the header
//! or a structure fails validation and [`HeapError::BadPointer`] for a pointer
//! that is not a live block; see [`HeapError::errno`].
//!
//! # Modules
//!
//! `size_class` has the size classes and slab geometry, `lock` the heap lock,
//! `thread_cache` the thread caches; this module has the layout, the page
//! allocator (free runs), the slabs and the public operations.

mod cache_mirror;
mod lock;
pub mod shared;
mod size_class;
#[cfg(test)]
mod test_mem;
mod thread_cache;
#[cfg(test)]
mod untrusted_tests;

pub use lock::LOCK_TIMEOUT;
pub use thread_cache::{unmap_epoch, unmap_epoch_registered, unmapping};

use std::ptr;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use size_class::{CLASS_SIZES, GEOMETRY, NCLASSES, block_index, class_of, slab_geometry};

/// Page size of the heap (also its unit of growth).
pub const PAGE: usize = 4096;
const PAGE_SHIFT: u32 = 12;
/// `b"RGNALLOC"` little-endian: marks memory that holds a heap.
pub const MAGIC: u64 = u64::from_le_bytes(*b"RGNALLOC");
/// Stored in `magic` while one process initialises the heap.
const MAGIC_INIT: u64 = u64::from_le_bytes(*b"RGNINIT.");
/// Layout version (3: the header counts slab releases, which every process sharing a heap
/// must do).
pub const VERSION: u32 = 3;
/// Smallest memory a heap can be created in.
pub const MIN_HEAP: usize = 16 * PAGE;
/// Largest block served from slabs.
pub const MAX_SMALL: usize = 2048;
/// Blocks are aligned to this many bytes (large blocks to a page).
pub const ALIGN: usize = 16;

const NBINS: usize = 64;
const EXACT_BINS: usize = 32;
/// Offset of the first block in a slab (after [`Slab`]).
const SLAB_HDR: usize = 128;
const SLAB_MAGIC: u32 = 0x5342_4c53; // "SLBS"
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

/// State byte of a block handed out to the application.
const LIVE: u8 = 1;
/// State byte of a block in a thread cache (0 in heaps of older versions of
/// this library, which the caches still accept). Blocks on their slab's free
/// list are 0, so a free list that runs into a cached block is refused.
const CACHED: u8 = 2;

/// The heap header at offset 0 of the managed memory.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: u32,
    page_size: u32,
    lock: AtomicU32,
    /// Slabs released so far (wrapping), bumped under the lock: a thread's memo of a
    /// slab's geometry holds while it is unchanged (`cache_mirror`).
    slab_releases: AtomicU32,
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
    /// The memory is not a valid heap: what failed validation (which field,
    /// which value).
    #[error(
        "the rmalloc heap is corrupt: {0}; the allocator metadata in the region was \
         overwritten: recreate the region, or restore it from a copy"
    )]
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

#[cold]
fn outside_heap(ptr: *const u8) -> HeapError {
    HeapError::BadPointer(format!("{ptr:p} is outside the heap"))
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

/// A [`HeapError::Corrupt`] with the message `what` builds (out of line:
/// only corrupt heaps get here, and the checks stay a few compares on the
/// hot paths).
#[cold]
#[inline(never)]
fn corrupt_with(what: impl FnOnce() -> String) -> HeapError {
    HeapError::Corrupt(what())
}

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

    /// A view of a heap that [`Heap::attach`] already accepted at `base` (no check here).
    ///
    /// # Safety
    ///
    /// As for [`Heap::attach`], and the memory must hold an initialised heap.
    #[inline]
    pub unsafe fn view(base: *mut u8, mapped: usize) -> Heap {
        Heap { base, mapped }
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
            let magic = (*h).magic.load(Ordering::Relaxed);
            if magic != MAGIC {
                return Err(corrupt_with(move || format!("header magic is {magic:#x}")));
            }
            if (*h).version == 2 && (*h).checksum == checksum(h) {
                // Version 3 counts slab releases in what was zero padding: a sound version 2
                // heap is a version 3 heap that has released none. Callers hold the lock, so
                // no process of this library releases a slab meanwhile; processes of older
                // versions refuse the heap from now on.
                (*h).version = VERSION;
                (*h).checksum = checksum(h);
            }
            if (*h).version != VERSION {
                return Err(corrupt_with(move || {
                    format!(
                        "heap layout version {} (this library reads version {VERSION})",
                        (*h).version
                    )
                }));
            }
            if (*h).checksum != checksum(h) {
                return Err(corrupt_with(move || {
                    format!(
                        "header checksum {:#x} does not match the layout fields (len {}, npages \
                         {}, map_off {:#x}, map_cap {})",
                        (*h).checksum,
                        (*h).len,
                        (*h).npages,
                        (*h).map_off,
                        (*h).map_cap
                    )
                }));
            }
            let (len, npages, map_off, map_cap) =
                ((*h).len, (*h).npages, (*h).map_off, (*h).map_cap);
            let map_end = map_cap.checked_mul(4).and_then(|b| b.checked_add(map_off));
            if (*h).page_size as usize != PAGE
                || len < MIN_HEAP as u64
                || !len.is_multiple_of(PAGE as u64)
                || npages != len / PAGE as u64
                || map_cap < npages
                || map_off < PAGE as u64
                || !map_off.is_multiple_of(PAGE as u64)
                || map_end.is_none_or(|end| end > len)
            {
                return Err(corrupt_with(move || {
                    format!(
                        "header fields out of range: page size {}, len {len}, npages {npages}, \
                         page map at {map_off:#x} for {map_cap} pages",
                        (*h).page_size
                    )
                }));
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
            // A fresh heap: its bins are empty.
            let _ = self.insert_run(1 + map_pages, npages - 1 - map_pages);
        }
    }

    // ---- raw access ----
    //
    // Callers check offsets against `npages()`, which never exceeds this
    // view; the page map accessors check against the view themselves (the
    // header was checked under the lock, but its memory is shared), so no
    // value read from the heap can move an access outside it.

    /// Offset of page `page`'s map entry, None when it is not inside the view.
    #[inline(always)]
    fn map_slot(&self, page: u64) -> Option<usize> {
        // SAFETY: the header is mapped.
        let map_off = unsafe { (*self.header()).map_off };
        let slot = page.checked_mul(4)?.checked_add(map_off)?;
        (slot.checked_add(4)? <= self.mapped as u64).then_some(slot as usize)
    }

    /// The page map entry of `page`; 0 (no kind, which every caller refuses)
    /// when the entry would lie outside the view.
    fn map_entry(&self, page: u64) -> u32 {
        match self.map_slot(page) {
            // SAFETY: the entry lies inside the view.
            Some(slot) => unsafe { (self.base.add(slot) as *const u32).read() },
            None => 0,
        }
    }

    /// Sets the page map entry of `page` (nothing when it would lie outside
    /// the view: the header checked under the lock rules that out).
    fn set_map(&self, page: u64, e: u32) {
        if let Some(slot) = self.map_slot(page) {
            // SAFETY: the entry lies inside the view.
            unsafe { (self.base.add(slot) as *mut u32).write(e) }
        }
    }

    /// Pages of the heap, at most the pages of this view.
    #[inline(always)]
    fn npages(&self) -> u64 {
        // SAFETY: the header is mapped.
        let n = unsafe { (*self.header()).npages };
        n.min((self.mapped >> PAGE_SHIFT) as u64)
    }

    /// Error unless `off` is a page of the heap: `what` names the field that
    /// held it.
    #[inline(always)]
    fn check_page_off(&self, off: u64, what: &dyn Fn() -> String) -> HResult<u64> {
        if !off.is_multiple_of(PAGE as u64) {
            return Err(corrupt_with(move || {
                format!("{} is {off:#x}, not page aligned", what())
            }));
        }
        let page = off >> PAGE_SHIFT;
        if page == 0 || page >= self.npages() {
            return Err(corrupt_with(move || {
                format!(
                    "{} is {off:#x}, outside the heap's pages 1..{}",
                    what(),
                    self.npages()
                )
            }));
        }
        Ok(page)
    }

    fn run_at(&self, page: u64) -> *mut FreeRun {
        debug_assert!(page < self.npages());
        // SAFETY: callers pass page < npages, inside the mapped heap.
        unsafe { self.base.add((page as usize) << PAGE_SHIFT) as *mut FreeRun }
    }

    fn slab_at(&self, page: u64) -> *mut Slab {
        self.run_at(page) as *mut Slab
    }

    // ---- free runs ----

    /// The free run at offset `off`, which field `what` links to: a page of
    /// the heap holding a free run's header whose length fits the heap.
    /// Returns the run and its first page.
    #[inline(always)]
    fn run_link(&self, off: u64, what: &dyn Fn() -> String) -> HResult<(*mut FreeRun, u64)> {
        let page = self.check_page_off(off, what)?;
        let r = self.run_at(page);
        // SAFETY: a page of the heap.
        let (magic, pages) = unsafe { ((*r).magic, (*r).pages) };
        if magic != RUN_MAGIC {
            return Err(corrupt_with(move || {
                format!(
                    "{} is {off:#x}, which holds no free run (magic {magic:#x})",
                    what()
                )
            }));
        }
        if pages == 0 || pages > self.npages() - page {
            return Err(corrupt_with(move || {
                format!(
                    "the free run at {off:#x} ({}) is {pages} pages long, past the heap's {} pages",
                    what(),
                    self.npages()
                )
            }));
        }
        Ok((r, page))
    }

    /// Adds the free run [page, page+pages) to its bin and tags its ends.
    fn insert_run(&self, page: u64, pages: u64) -> HResult<()> {
        if pages == 0 {
            return Ok(());
        }
        let h = self.header();
        let bin = bin_of(pages);
        // SAFETY: the header is mapped.
        let head = unsafe { (*h).bins[bin] };
        let head_run = if head != 0 {
            Some(
                self.run_link(head, &move || format!("the head of free-run bin {bin}"))?
                    .0,
            )
        } else {
            None
        };
        let r = self.run_at(page);
        // SAFETY: the run lies inside the heap (callers pass a run they
        // checked), head_run is a checked run; the header is mapped.
        unsafe {
            (*r).magic = RUN_MAGIC;
            (*r).next = head;
            (*r).prev = 0;
            (*r).pages = pages;
            if let Some(hr) = head_run {
                (*hr).prev = page << PAGE_SHIFT;
            }
            (*h).bins[bin] = page << PAGE_SHIFT;
            (*h).bin_mask |= 1 << bin;
        }
        self.set_map(page, entry(K_FREE, pages));
        self.set_map(page + pages - 1, entry(K_FREE, pages));
        Ok(())
    }

    /// Takes the free run at `page` out of its bin (its map tags stay).
    fn remove_run(&self, page: u64) -> HResult<u64> {
        let h = self.header();
        let off = page << PAGE_SHIFT;
        let (r, _) = self.run_link(off, &move || format!("the free run at page {page}"))?;
        // SAFETY: r is a checked run; its links are checked before use.
        unsafe {
            let pages = (*r).pages;
            let tag = self.map_entry(page);
            if tag != entry(K_FREE, pages) {
                return Err(corrupt_with(move || {
                    format!(
                        "page-map entry of page {page} is {tag:#x}, not the tag of the free run of \
                         {pages} pages there"
                    )
                }));
            }
            let (next, prev) = ((*r).next, (*r).prev);
            let bin = bin_of(pages);
            let next_run = if next != 0 {
                let (n, _) =
                    self.run_link(next, &move || format!("the next link of free run {off:#x}"))?;
                if (*n).prev != off {
                    return Err(corrupt_with(move || {
                        format!(
                            "free run {next:#x} links back to {:#x}, not to {off:#x}",
                            (*n).prev
                        )
                    }));
                }
                Some(n)
            } else {
                None
            };
            if prev != 0 {
                let (p, _) =
                    self.run_link(prev, &move || format!("the prev link of free run {off:#x}"))?;
                if (*p).next != off {
                    return Err(corrupt_with(move || {
                        format!(
                            "free run {prev:#x} links on to {:#x}, not to {off:#x}",
                            (*p).next
                        )
                    }));
                }
                (*p).next = next;
            } else {
                if (*h).bins[bin] != off {
                    return Err(corrupt_with(move || {
                        format!(
                            "free run {off:#x} of {pages} pages has no prev link but is not the \
                             head of bin {bin} (the head is {:#x})",
                            (*h).bins[bin]
                        )
                    }));
                }
                (*h).bins[bin] = next;
                if next == 0 {
                    (*h).bin_mask &= !(1 << bin);
                }
            }
            if let Some(n) = next_run {
                (*n).prev = prev;
            }
            (*r).magic = 0;
            Ok(pages)
        }
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
            let mut from = None;
            while off != 0 {
                let (r, page) = self.run_link(off, &move || match from {
                    None => format!("the head of free-run bin {bin}"),
                    Some(f) => format!("the next link of free run {f:#x} (bin {bin})"),
                })?;
                // SAFETY: a checked run.
                let (len, next) = unsafe { ((*r).pages, (*r).next) };
                if len >= pages {
                    found = Some(page);
                    break;
                }
                scanned += 1;
                if scanned > self.npages() {
                    return Err(corrupt_with(move || {
                        format!("the free-run list of bin {bin} has a cycle (through {off:#x})")
                    }));
                }
                from = Some(off);
                off = next;
            }
            if found.is_some() {
                break;
            }
        }
        let Some(page) = found else {
            // A bin whose mask bit is clear must be empty: a head there would
            // make a heap with free runs look full.
            // SAFETY: the header is mapped.
            let (mask, bins) = unsafe { ((*h).bin_mask, &(*h).bins) };
            if let Some(bin) = (first..NBINS).find(|&b| mask & (1 << b) == 0 && bins[b] != 0) {
                return Err(corrupt_with(move || {
                    format!(
                        "free-run bin {bin} has head {:#x} but bin_mask {mask:#x} says it is empty",
                        bins[bin]
                    )
                }));
            }
            return Ok(None);
        };
        let len = self.remove_run(page)?;
        if len > pages {
            self.insert_run(page + pages, len - pages)?;
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
                if plen == 0 || plen >= page {
                    return Err(corrupt_with(move || {
                        format!(
                            "page-map entry of page {} is the tail tag of a free run of {plen} \
                             pages, which would start before page 1",
                            page - 1
                        )
                    }));
                }
                let pstart = page - plen;
                let got = self.remove_run(pstart)?;
                if got != plen {
                    return Err(corrupt_with(move || {
                        format!(
                            "page-map entry of page {} is the tail tag of a free run of {plen} \
                             pages, but the run at page {pstart} has {got} pages",
                            page - 1
                        )
                    }));
                }
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
        self.insert_run(start, len)
    }

    // ---- slabs ----

    /// The slab of `class` at offset `off`, which field `what` links to:
    /// page aligned, inside the heap, with a header that matches the class.
    #[inline(always)]
    fn slab_check(&self, off: u64, class: usize, what: &dyn Fn() -> String) -> HResult<*mut Slab> {
        let (pages, n) = slab_geometry(class);
        let page = self.check_page_off(off, what)?;
        if page + pages as u64 > self.npages() {
            return Err(corrupt_with(move || {
                format!(
                    "{} is {off:#x}, but a slab of class {class} ({pages} pages) there would end \
                     past the heap's {} pages",
                    what(),
                    self.npages()
                )
            }));
        }
        let s = self.slab_at(page);
        // SAFETY: the slab lies inside the heap.
        unsafe {
            let magic = (*s).magic.load(Ordering::Relaxed);
            if magic != SLAB_MAGIC
                || (*s).class as usize != class
                || (*s).pages as usize != pages
                || (*s).nblocks as usize != n
                || (*s).used > (*s).nblocks
                || (*s).bump > (*s).nblocks
            {
                return Err(corrupt_with(move || {
                    format!(
                        "{} is {off:#x}, which holds no valid slab of class {class}: magic \
                         {magic:#x}, class {}, {} pages, {} blocks, {} used, bump {} (want class \
                         {class}, {pages} pages, {n} blocks, used and bump at most {n})",
                        what(),
                        (*s).class,
                        (*s).pages,
                        (*s).nblocks,
                        (*s).used,
                        (*s).bump
                    )
                }));
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
        self.partial_push(class, off)?;
        Ok(Some(off))
    }

    /// Puts the checked slab at `off` at the head of its class's partial list.
    fn partial_push(&self, class: usize, off: u64) -> HResult<()> {
        let h = self.header();
        // SAFETY: the header is mapped.
        let head = unsafe { (*h).partial[class] };
        if head == off {
            return Err(corrupt_with(move || {
                format!(
                    "slab {off:#x} of class {class} is not on its partial list (it was full) but \
                     is the list's head"
                )
            }));
        }
        let head_slab = if head != 0 {
            Some(self.slab_check(head, class, &move || {
                format!("the partial-list head of class {class}")
            })?)
        } else {
            None
        };
        let s = self.slab_at(off >> PAGE_SHIFT);
        // SAFETY: off is a checked slab, head_slab a checked slab; the header
        // is mapped.
        unsafe {
            (*s).next = head;
            (*s).prev = 0;
            if let Some(hs) = head_slab {
                (*hs).prev = off;
            }
            (*h).partial[class] = off;
        }
        Ok(())
    }

    fn partial_remove(&self, class: usize, off: u64) -> HResult<()> {
        let h = self.header();
        let s = self.slab_at(off >> PAGE_SHIFT);
        // SAFETY: off is a checked slab; its links are checked before use.
        unsafe {
            let (next, prev) = ((*s).next, (*s).prev);
            let next_slab = if next != 0 {
                let n = self.slab_check(next, class, &move || {
                    format!("the next link of slab {off:#x} (class {class})")
                })?;
                if (*n).prev != off {
                    return Err(corrupt_with(move || {
                        format!(
                            "slab {next:#x} links back to {:#x}, not to {off:#x} (class {class})",
                            (*n).prev
                        )
                    }));
                }
                Some(n)
            } else {
                None
            };
            if prev != 0 {
                let p = self.slab_check(prev, class, &move || {
                    format!("the prev link of slab {off:#x} (class {class})")
                })?;
                if (*p).next != off {
                    return Err(corrupt_with(move || {
                        format!(
                            "slab {prev:#x} links on to {:#x}, not to {off:#x} (class {class})",
                            (*p).next
                        )
                    }));
                }
                (*p).next = next;
            } else {
                let head = (*h).partial[class];
                if head != off {
                    return Err(corrupt_with(move || {
                        format!(
                            "slab {off:#x} has no prev link but is not the partial-list head of \
                             class {class} (the head is {head:#x})"
                        )
                    }));
                }
                (*h).partial[class] = next;
            }
            if let Some(n) = next_slab {
                (*n).prev = prev;
            }
            (*s).next = 0;
            (*s).prev = 0;
        }
        Ok(())
    }

    /// Takes a block of `class` off a slab (see [`Heap::take_small_n`]) and
    /// sets its state byte to `mark`. Call with the lock held.
    fn take_small(&self, class: usize, mark: u8) -> HResult<Option<u64>> {
        let mut out = [0u64; 1];
        Ok((self.take_small_n(class, mark, &mut out)? == 1).then_some(out[0]))
    }

    /// Takes up to `out.len()` blocks of `class` off slabs (free list first,
    /// then the bump index), counts them in `used` and sets the state byte
    /// of the first to `mark` ([`LIVE`] for the application, [`CACHED`] for
    /// a thread cache) and of the others to [`CACHED`]. Returns how many it
    /// took: fewer when the heap has no room for another slab. Each slab is
    /// checked once, its free blocks one by one. Call with the lock held.
    fn take_small_n(&self, class: usize, mark: u8, out: &mut [u64]) -> HResult<usize> {
        let h = self.header();
        let size = CLASS_SIZES[class] as u64;
        let mut got = 0;
        while got < out.len() {
            // SAFETY: the header is mapped.
            let mut off = unsafe { (*h).partial[class] };
            if off == 0 {
                match self.new_slab(class)? {
                    Some(o) => off = o,
                    None => break,
                }
            }
            let s = self.slab_check(off, class, &move || {
                format!("the partial-list head of class {class}")
            })?;
            // SAFETY: s is a checked slab; block offsets are checked before
            // use.
            unsafe {
                let n = (*s).nblocks as u64;
                let first = off + SLAB_HDR as u64;
                while got < out.len() {
                    let (used, bump, b) = ((*s).used as u64, (*s).bump, (*s).free);
                    if used >= n {
                        return Err(corrupt_with(move || {
                            format!(
                                "slab {off:#x} of class {class} is on the partial list with all \
                                 {n} blocks used"
                            )
                        }));
                    }
                    let (block, i) = if b != 0 {
                        let i = match b.checked_sub(first).and_then(|rel| block_index(rel, class)) {
                            Some(i) if i < bump as usize => i,
                            _ => {
                                return Err(corrupt_with(move || {
                                    format!(
                                        "the free list of slab {off:#x} (class {class}) holds \
                                         {b:#x}, not a block of that slab that was handed out \
                                         (bump index {bump})"
                                    )
                                }));
                            }
                        };
                        (b, i)
                    } else if (bump as u64) < n {
                        let i = bump as usize;
                        (first + i as u64 * size, i)
                    } else {
                        return Err(corrupt_with(move || {
                            format!(
                                "slab {off:#x} of class {class} is on the partial list with no \
                                 free block ({used} of {n} used)"
                            )
                        }));
                    };
                    let state = self.block_state(off, class, i);
                    let st = state.load(Ordering::Relaxed);
                    if st != 0 {
                        return Err(corrupt_with(move || {
                            format!(
                                "the free list of slab {off:#x} (class {class}) holds block \
                                 {block:#x}, which is not free (state {st}: a cycle in the list, \
                                 or a block in use)"
                            )
                        }));
                    }
                    if b != 0 {
                        // The next link sits in the block: inside the slab.
                        (*s).free = (self.base.add(block as usize) as *const u64).read();
                    } else {
                        (*s).bump = bump + 1;
                    }
                    state.store(if got == 0 { mark } else { CACHED }, Ordering::Release);
                    (*s).used = used as u16 + 1;
                    out[got] = block;
                    got += 1;
                    if used + 1 == n {
                        self.partial_remove(class, off)?;
                        break;
                    }
                }
            }
        }
        Ok(got)
    }

    /// The slab offset and class that page `page`'s map entry `e` (of kind
    /// [`K_SLAB`]) names, checked against the class table and the page.
    #[inline(always)]
    fn slab_of_entry(&self, page: u64, e: u32) -> HResult<(u64, usize)> {
        let class = (value(e) >> 8) as usize;
        let index = value(e) & 0xff;
        if class >= NCLASSES {
            return Err(corrupt_with(move || {
                format!(
                    "page-map entry of page {page} is a slab page of class {class} (entry {e:#x}); \
                     there are {NCLASSES} classes"
                )
            }));
        }
        if index >= slab_geometry(class).0 as u64 || index >= page {
            return Err(corrupt_with(move || {
                format!(
                    "page-map entry of page {page} is page {index} of a slab of class {class} \
                     (entry {e:#x}); its slabs have {} pages",
                    slab_geometry(class).0
                )
            }));
        }
        Ok(((page - index) << PAGE_SHIFT, class))
    }

    /// The slab of the small block at `off` (page map entry `e` of its
    /// page), with the block's index; a bad pointer when `off` is not the
    /// start of a block.
    fn small_block(&self, off: u64, page: u64, e: u32) -> HResult<(u64, *mut Slab, usize, usize)> {
        let (slab, class) = self.slab_of_entry(page, e)?;
        let s = self.slab_check(slab, class, &move || {
            format!("the slab of page {page} (page-map entry {e:#x})")
        })?;
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
    /// its state byte is already 0. Returns the slab's pages to the page
    /// allocator when it empties (unless it is its class's last). Call with
    /// the lock held.
    fn release_small(&self, slab: u64, s: *mut Slab, class: usize, off: u64) -> HResult<()> {
        // SAFETY: s is a checked slab and off one of its blocks.
        unsafe {
            if (*s).used == 0 {
                return Err(corrupt_with(move || {
                    format!(
                        "slab {slab:#x} (class {class}) has a block to take back but its use \
                         count is 0"
                    )
                }));
            }
            (self.base.add(off as usize) as *mut u64).write((*s).free);
            (*s).free = off;
            let was_full = (*s).used == (*s).nblocks;
            (*s).used -= 1;
            if was_full {
                self.partial_push(class, slab)?;
            } else if (*s).used == 0 {
                let h = self.header();
                let only = (*h).partial[class] == slab && (*s).next == 0;
                if !only {
                    self.partial_remove(class, slab)?;
                    (*s).magic.store(0, Ordering::Relaxed);
                    (*h).slab_releases.fetch_add(1, Ordering::Release);
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
    /// while the block is handed out to the application, [`CACHED`] while it
    /// is in a thread cache (0 in heaps of older versions of this library),
    /// 0 while it is on its slab. Only the block's current holder writes it (the
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
        if size <= MAX_SMALL
            && let Some(off) = self.alloc_mirrored(class_of(size.max(1)))
        {
            return Ok(off);
        }
        self.alloc_unmirrored(size)
    }

    #[inline(never)]
    fn alloc_unmirrored(&self, size: usize) -> HResult<u64> {
        if size <= MAX_SMALL
            && let Some(r) = self.alloc_from_cache(class_of(size.max(1)))
        {
            return r;
        }
        self.alloc_slow(size)
    }

    #[inline(never)]
    fn alloc_slow(&self, size: usize) -> HResult<u64> {
        let _g = self.lock()?;
        self.check_header()?;
        self.alloc_locked(size)
    }

    fn alloc_locked(&self, size: usize) -> HResult<u64> {
        let h = self.header();
        let (off, bytes) = if size <= MAX_SMALL {
            let class = class_of(size.max(1));
            match self.take_small(class, LIVE)? {
                Some(off) => (off, CLASS_SIZES[class] as u64),
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
            (*h).allocated = (*h).allocated.saturating_add(bytes);
            (*h).nblocks = (*h).nblocks.saturating_add(1);
        }
        Ok(off)
    }

    /// Allocates and returns a pointer (see [`Heap::alloc`]).
    #[inline]
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
        if self.free_mirrored(off) {
            return Ok(());
        }
        self.free_unmirrored(off)
    }

    #[inline(never)]
    fn free_unmirrored(&self, off: u64) -> HResult<()> {
        if let Some(r) = self.free_to_cache(off) {
            return r;
        }
        self.free_slow(off)
    }

    #[inline(never)]
    fn free_slow(&self, off: u64) -> HResult<()> {
        let _g = self.lock()?;
        self.check_header()?;
        self.free_locked(off)
    }

    fn free_locked(&self, off: u64) -> HResult<()> {
        let h = self.header();
        let npages = self.npages();
        let page = off >> PAGE_SHIFT;
        if page == 0 || page >= npages {
            return Err(HeapError::BadPointer(format!(
                "offset {off:#x} is outside the heap's blocks"
            )));
        }
        let e = self.map_entry(page);
        let bytes = match kind(e) {
            K_SLAB => self.free_small(off, page, e)?,
            K_LARGE if off.is_multiple_of(PAGE as u64) => {
                let pages = value(e);
                if pages == 0 || page + pages > npages {
                    return Err(corrupt_with(move || {
                        format!(
                            "page-map entry of page {page} is a large block of {pages} pages \
                             (entry {e:#x}), past the heap's {npages} pages"
                        )
                    }));
                }
                // The block's last page continues it and the page after it
                // does not (its length is right, as far as O(1) checks go).
                let last = page + pages - 1;
                let (le, ne) = (self.map_entry(last), self.map_entry(page + pages));
                if (pages > 1 && kind(le) != K_CONT)
                    || (page + pages < npages && kind(ne) == K_CONT)
                {
                    return Err(corrupt_with(move || {
                        format!(
                            "page-map entry of page {page} is a large block of {pages} pages \
                             (entry {e:#x}), but the entries of its last page {last} and of the \
                             page after it are {le:#x} and {ne:#x}"
                        )
                    }));
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
    #[inline]
    pub fn free_ptr(&self, ptr: *const u8) -> HResult<()> {
        let off = (ptr as usize).wrapping_sub(self.base as usize);
        if ptr < self.base as *const u8 || off >= self.mapped {
            return Err(outside_heap(ptr));
        }
        self.free(off as u64)
    }

    /// Usable size of the live block at `off`.
    pub fn block_size(&self, off: u64) -> HResult<usize> {
        let _g = self.lock()?;
        self.check_header()?;
        let page = off >> PAGE_SHIFT;
        if page >= self.npages() {
            return Err(HeapError::BadPointer(format!("offset {off:#x}")));
        }
        let e = self.map_entry(page);
        match kind(e) {
            K_SLAB => {
                let (_, _, class, _) = self.small_block(off, page, e)?;
                Ok(CLASS_SIZES[class] as usize)
            }
            K_LARGE if off.is_multiple_of(PAGE as u64) => {
                let pages = value(e);
                if pages == 0 || page + pages > self.npages() {
                    return Err(corrupt_with(move || {
                        format!(
                            "page-map entry of page {page} is a large block of {pages} pages \
                             (entry {e:#x}), past the heap's {} pages",
                            self.npages()
                        )
                    }));
                }
                Ok(pages as usize * PAGE)
            }
            _ => Err(HeapError::BadPointer(format!("offset {off:#x}"))),
        }
    }

    /// Whether `off` is a block handed out to the application now (a block that is free, or
    /// waits in a thread cache, is not).
    pub fn is_live(&self, off: u64) -> HResult<bool> {
        let _g = self.lock()?;
        self.check_header()?;
        let page = off >> PAGE_SHIFT;
        if page >= self.npages() {
            return Ok(false);
        }
        let e = self.map_entry(page);
        Ok(match kind(e) {
            K_SLAB => match self.small_block(off, page, e) {
                Ok((slab, _, class, i)) => {
                    self.block_state(slab, class, i).load(Ordering::Acquire) == LIVE
                }
                Err(HeapError::Corrupt(m)) => return Err(HeapError::Corrupt(m)),
                Err(_) => false,
            },
            K_LARGE => off.is_multiple_of(PAGE as u64),
            _ => false,
        })
    }

    /// Adopts memory grown to `new_len` bytes (at most the mapped length).
    /// Growing needs one more page-map page per 4 MiB beyond the map's
    /// capacity; it is taken from the new memory.
    pub fn extend(&self, new_len: usize) -> HResult<()> {
        let _g = self.lock()?;
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
        let _g = self.lock()?;
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
            Some(off) if off >= len => Err(corrupt_with(move || {
                format!("the root slot holds offset {off:#x}, outside the heap ({len} bytes)")
            })),
            Some(off) if off >= self.mapped as u64 => {
                // Another process grew the heap (its header says so), or
                // the header is corrupt.
                // SAFETY: the header is mapped.
                if unsafe { (*h).checksum } != checksum(h) {
                    return Err(corrupt_with(move || {
                        format!(
                            "the root slot holds offset {off:#x}, past this view of {} bytes, and \
                             the header checksum does not match its length {len}",
                            self.mapped
                        )
                    }));
                }
                Err(HeapError::NeedsMapping { len })
            }
            r => Ok(r),
        }
    }

    /// Heap usage; also walks the free runs to validate them.
    pub fn stats(&self) -> HResult<HeapStats> {
        let _g = self.lock()?;
        self.check_header()?;
        let h = self.header();
        let mut free_pages = 0;
        let mut largest = 0;
        for bin in 0..NBINS {
            // SAFETY: the header is mapped.
            let mut off = unsafe { (*h).bins[bin] };
            let mut from = None;
            let mut n = 0u64;
            while off != 0 {
                let (r, _) = self.run_link(off, &move || match from {
                    None => format!("the head of free-run bin {bin}"),
                    Some(f) => format!("the next link of free run {f:#x} (bin {bin})"),
                })?;
                // SAFETY: a checked run.
                let (pages, next) = unsafe { ((*r).pages, (*r).next) };
                if bin_of(pages) != bin {
                    return Err(corrupt_with(move || {
                        format!(
                            "the free run at {off:#x} has {pages} pages but is in bin {bin} (runs \
                             of {pages} pages go to bin {})",
                            bin_of(pages)
                        )
                    }));
                }
                free_pages = pages.saturating_add(free_pages);
                largest = largest.max(pages);
                n += 1;
                if n > self.npages() {
                    return Err(corrupt_with(move || {
                        format!("the free-run list of bin {bin} has a cycle (through {off:#x})")
                    }));
                }
                from = Some(off);
                off = next;
            }
        }
        let mut partial_slab_pages = 0;
        for class in 0..NCLASSES {
            // SAFETY: the header is mapped.
            let mut off = unsafe { (*h).partial[class] };
            let mut from = None;
            let mut n = 0u64;
            while off != 0 {
                let s = self.slab_check(off, class, &move || match from {
                    None => format!("the partial-list head of class {class}"),
                    Some(f) => format!("the next link of slab {f:#x} (class {class})"),
                })?;
                partial_slab_pages += slab_geometry(class).0 as u64;
                n += 1;
                if n > self.npages() {
                    return Err(corrupt_with(move || {
                        format!("the partial list of class {class} has a cycle (through {off:#x})")
                    }));
                }
                from = Some(off);
                // SAFETY: checked slab.
                off = unsafe { (*s).next };
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

#[cfg(test)]
mod tests {
    use super::test_mem::Mem;
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    #[test]
    fn free_run_bins() {
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

    /// A heap of layout version 2 (no count of slab releases; the field was zero padding)
    /// becomes version 3 under the lock and keeps its blocks; a version this library does
    /// not know is refused.
    #[test]
    fn a_version_2_heap_is_taken_up_in_place() {
        let m = Mem::new(1 << 20);
        let h = m.heap(1 << 20);
        let a = h.alloc(3000).unwrap();
        let hd = m.ptr as *mut Header;
        // SAFETY: the test rewrites its own heap's header as version 2 wrote it.
        unsafe {
            (*hd).version = 2;
            (*hd).slab_releases.store(0, Ordering::Relaxed);
            (*hd).checksum = checksum(hd);
        }
        assert!(h.is_live(a).unwrap(), "the version 2 heap keeps its block");
        // SAFETY: reads the header.
        assert_eq!(unsafe { (*hd).version }, VERSION);
        h.free(a).unwrap();
        // SAFETY: as above, a version from the future.
        unsafe {
            (*hd).version = 9;
            (*hd).checksum = checksum(hd);
        }
        assert!(matches!(h.alloc(3000), Err(HeapError::Corrupt(_))));
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
        // SAFETY: `m2` maps 1 MiB that stays mapped while the heap is looked at.
        let attached = unsafe { Heap::attach(m2.ptr, 1 << 20) };
        assert!(matches!(attached, Err(HeapError::NotAHeap(_))));
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
