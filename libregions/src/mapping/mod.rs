//! Mapping whole regions into the process (Remote Regions paper §5.7, §6.10, §6.13;
//! docs/ARCHITECTURE.md, "Mapping a region (rmap)"; docs/SEMANTICS.md, "Mappings through
//! libregions (rmap)"): FIXVADDR regions at their manager-assigned address inside the fixed window, which is
//! reserved (`PROT_NONE`, `MAP_NORESERVE`) on first use so that nothing else in the process lands
//! there; other regions anywhere else.
//!
//! - Chunks held on this host map the region's segment memfd `MAP_SHARED` (zero copy, no
//!   cache): processes on one host see each other's writes at once. A writable mapping does so
//!   only when the host agent hands a writable segment (root, the daemon's user, or every
//!   writer on a daemon run with `--share-writable-segments`); otherwise the host's chunks are
//!   served like remote ones, over the transport of this host's daemon.
//! - Remote chunks are anonymous memory registered with userfaultfd ([`uffd`]): a missing fault
//!   fetches the page and up to [`prefetch_pages`]` - 1` following missing pages of the chunk in
//!   one transport request; pages are installed write-protected, and the first write to one marks
//!   it dirty. [`Mapping::msync`] writes dirty pages back in vectors and protects them again,
//!   [`Mapping::clearcache`] drops pages so the next access fetches them afresh,
//!   [`Mapping::markdirty`] with `zero` installs zero pages marked dirty without fetching, and
//!   [`Mapping::prefetch`] fetches ahead.
//! - A fault that cannot be served (the transport gave up: host gone, timeout, 5 s bound) raises
//!   `SIGBUS` for that access.
//! - A forked child does not inherit remote pages (`MADV_DONTFORK`): userfaultfd registrations
//!   do not cross `fork`, so the child would read zero pages there; it gets `SIGSEGV` instead
//!   and maps the region itself. Chunks held on the host are shared memory and stay shared.

mod sys;
mod uffd;

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use regions_proto::layout::{CHUNK_SIZE, VADDR_WINDOW_END, VADDR_WINDOW_START};

use crate::error::{RegionsError, Result};
use crate::region::Region;
use crate::transport::Span;
pub use sys::PAGE;
use uffd::{Faults, Job};

/// Default prefetch window in pages (env `REGIONS_PREFETCH_PAGES`).
pub const DEFAULT_PREFETCH_PAGES: usize = 16;
/// Smallest address range reserved for a mapping (room to grow in place).
const MIN_RESERVATION: usize = 256 << 20;
/// Background read-ahead of sequential access, in prefetch windows ...
const READ_AHEAD: usize = 256;
/// ... fetched in jobs of at most this many windows, aligned to that size in the address space.
const READ_AHEAD_PIECE: usize = 16;
/// Pages per chunk.
const CHUNK_PAGES: usize = (CHUNK_SIZE as usize) / PAGE;

// Page states of remote pages.
const MISSING: u8 = 0;
const FETCHING: u8 = 1;
const CLEAN: u8 = 2;
const DIRTY: u8 = 3;
const SYNCING: u8 = 4;
const LOST: u8 = 5;
/// Being fetched, and dropped by `rclearcache` meanwhile: the fetcher drops what it installed
/// and makes the pages missing again.
const DROPPED: u8 = 6;

static PREFETCH: AtomicUsize = AtomicUsize::new(0);

/// Pages fetched per missing fault (the faulting page and those after it in its chunk).
pub fn prefetch_pages() -> usize {
    match PREFETCH.load(Ordering::Relaxed) {
        0 => {
            let n = std::env::var("REGIONS_PREFETCH_PAGES")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|n| *n >= 1)
                .unwrap_or(DEFAULT_PREFETCH_PAGES)
                .min(CHUNK_PAGES);
            PREFETCH.store(n, Ordering::Relaxed);
            n
        }
        n => n,
    }
}

/// Sets the prefetch window (1 = fetch only the faulting page; at most a chunk).
pub fn set_prefetch_pages(n: usize) {
    PREFETCH.store(n.clamp(1, CHUNK_PAGES), Ordering::Relaxed);
}

/// How one chunk of a mapping is backed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Backing {
    /// This host's segment memfd.
    Local,
    /// Fetched through the transport.
    Remote,
}

/// A region mapped into this process.
pub struct Mapping {
    region: Arc<Region>,
    base: usize,
    /// Bytes mapped (page multiple).
    len: AtomicUsize,
    /// Bytes of address space reserved at `base`.
    reserved: usize,
    /// Inside the fixed window (else a reservation of its own).
    fixed: bool,
    write: bool,
    chunks: RwLock<Vec<Backing>>,
    /// Remote page states, by page index.
    pages: RwLock<Vec<AtomicU8>>,
    /// This host's segment memfd, and whether the agent handed it writable.
    segment: Mutex<Option<(OwnedFd, bool)>>,
    /// Page after the last missing fault's window: a fault there means sequential access,
    /// which starts read-ahead of the next windows.
    next_sequential: AtomicUsize,
    /// The window of the last missing fault, which the next one starts from (0: the whole
    /// prefetch window): a run of faults far apart halves it down to one page, faults near
    /// what is here double it, and a sequential fault restores it, so that random access
    /// fetches what it touches and sequential access fetches ahead.
    random_window: AtomicUsize,
    /// Page of the last missing fault.
    last_missing: AtomicUsize,
    /// End of the pages handed to background read-ahead.
    frontier: AtomicUsize,
    /// Held while protection and page states change together: `make_dirty` marking pages and
    /// lifting their protection, `msync` marking, protecting and copying them out,
    /// `rclearcache` dropping and marking them (never across network calls).
    protect: Mutex<()>,
    /// Fault events handled so far (a handler counts one before it reads the page's state):
    /// a settle wakes the range only when some came since its install began.
    parked: AtomicU64,
    /// Serialises growth and unmapping.
    resize: Mutex<bool>,
    /// Held while dirty pages are written back: a synchronous `msync` waits for a background
    /// one still writing pages it marked, so that it returns only once they are written.
    writeback: Mutex<()>,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("ino", &self.region.ino())
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

/// Mappings of this process by base address, and by region.
#[derive(Default)]
struct Registry {
    by_base: BTreeMap<usize, Arc<Mapping>>,
    /// (device of the mount, inode) → base.
    by_ino: BTreeMap<(u64, u64), usize>,
}

fn registry() -> &'static Mutex<Registry> {
    static REG: OnceLock<Mutex<Registry>> = OnceLock::new();
    REG.get_or_init(Mutex::default)
}

fn lock_registry() -> std::sync::MutexGuard<'static, Registry> {
    registry()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Address space left free after the program's own mappings inside the window (a PIE binary
/// and its brk heap load around 0x55xx_xxxx_xxxx), so that the heap can still grow.
const HEAP_ROOM: usize = 64 << 30;

/// The parts of the fixed window this process reserved.
static WINDOW: OnceLock<std::result::Result<Vec<(usize, usize)>, String>> = OnceLock::new();

/// Ranges of `/proc/self/maps` that intersect `[start, end)`.
fn occupied(start: usize, end: usize) -> Vec<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut out: Vec<(usize, usize)> = maps
        .lines()
        .filter_map(|l| {
            let range = l.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .filter(|&(a, b)| a < end && b > start)
        .collect();
    out.sort_unstable();
    out
}

/// The free gaps of `[start, end)` around `taken` (sorted), each taken range extended by
/// `room` at its end.
fn gaps(start: usize, end: usize, taken: &[(usize, usize)], room: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = start;
    for &(a, b) in taken {
        if a > at {
            out.push((at, a.min(end)));
        }
        at = at.max(b.saturating_add(room));
        if at >= end {
            break;
        }
    }
    if at < end {
        out.push((at, end));
    }
    out.retain(|&(a, b)| b > a);
    out
}

/// Reserves the fixed-address window, once per process: every part of it that the program
/// does not already use (its binary and heap may sit inside). Called by every mapping call;
/// call it early (e.g. at program start) so that nothing else lands in the window first.
pub fn init() -> Result<()> {
    window().map(drop)
}

fn window() -> Result<&'static [(usize, usize)]> {
    let start = VADDR_WINDOW_START as usize;
    let end = VADDR_WINDOW_END as usize;
    WINDOW
        .get_or_init(|| {
            let mut reserved = Vec::new();
            for (a, b) in gaps(start, end, &occupied(start, end), HEAP_ROOM) {
                match sys::reserve_fixed_noreplace(a, b - a) {
                    Ok(()) => reserved.push((a, b)),
                    Err(e) => tracing::warn!(
                        start = format_args!("{a:#x}"),
                        end = format_args!("{b:#x}"),
                        error = %e,
                        "cannot reserve part of the fixed-address window"
                    ),
                }
            }
            if reserved.is_empty() {
                return Err("no part of it is free".to_owned());
            }
            Ok(reserved)
        })
        .as_ref()
        .map(Vec::as_slice)
        .map_err(|e| RegionsError::Mapping {
            errno: libc::ENOMEM,
            message: format!(
                "cannot reserve the fixed-address window [{start:#x}, {end:#x}): {e}; something \
                 else in this process maps memory there (call regions::mapping::init() earlier)"
            ),
        })
}

/// Whether `[addr, addr + len)` lies inside the reserved window.
fn in_window(addr: usize, len: usize) -> Result<bool> {
    Ok(window()?
        .iter()
        .any(|&(a, b)| addr >= a && addr.saturating_add(len) <= b))
}

fn map_err(errno: i32, message: String) -> RegionsError {
    RegionsError::Mapping { errno, message }
}

fn io_err(what: &str, e: std::io::Error) -> RegionsError {
    RegionsError::Mapping {
        errno: e.raw_os_error().unwrap_or(libc::EIO),
        message: format!("{what}: {e}"),
    }
}

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

fn reservation_for(len: usize) -> usize {
    len.max(MIN_RESERVATION)
        .checked_next_power_of_two()
        .unwrap_or(len)
}

/// Maps the whole region of `fd` (a file opened under a regions mount; its open mode decides
/// the mapping's rights). FIXVADDR regions go to their fixed address. Mapping a region that is
/// already mapped in this process returns the same mapping.
pub fn map_fd(fd: BorrowedFd<'_>) -> Result<Arc<Mapping>> {
    init()?;
    if let Some(m) = by_ino(crate::region::file_id(fd)?) {
        return Ok(m);
    }
    let region = Region::open_fd(fd)?;
    map_region(region)
}

fn by_ino(ino: (u64, u64)) -> Option<Arc<Mapping>> {
    let reg = lock_registry();
    reg.by_ino
        .get(&ino)
        .and_then(|base| reg.by_base.get(base))
        .cloned()
}

/// Maps an opened region (see [`map_fd`]).
pub fn map_region(region: Arc<Region>) -> Result<Arc<Mapping>> {
    init()?;
    let key = (region.dev(), region.ino());
    if let Some(m) = by_ino(key) {
        return Ok(m);
    }
    let len = round_up(region.size(), PAGE as u64) as usize;
    let vaddr = region.vaddr();
    let (base, reserved, fixed) = if vaddr != 0 {
        let reserved = reservation_for(len);
        let end = vaddr.checked_add(reserved as u64);
        if vaddr < VADDR_WINDOW_START || end.is_none_or(|e| e > VADDR_WINDOW_END) {
            return Err(map_err(
                libc::EINVAL,
                format!(
                    "region {} has fixed address {vaddr:#x}, outside the window \
                     [{VADDR_WINDOW_START:#x}, {VADDR_WINDOW_END:#x})",
                    region.ino()
                ),
            ));
        }
        if !in_window(vaddr as usize, reserved)? {
            return Err(map_err(
                libc::ENOMEM,
                format!(
                    "the fixed address range [{vaddr:#x}, {:#x}) of region {} is not free in \
                     this process (the program's binary or heap lies there): it cannot be \
                     mapped at its fixed address here",
                    vaddr as usize + reserved,
                    region.ino()
                ),
            ));
        }
        let reg = lock_registry();
        if let Some((b, m)) = reg.by_base.range(..vaddr as usize + reserved).next_back()
            && m.fixed
            && *b + m.reserved > vaddr as usize
        {
            return Err(map_err(
                libc::EEXIST,
                format!(
                    "the fixed address {vaddr:#x} of region {} is taken in this process by \
                     region {} at {b:#x}: unmap that region first",
                    region.ino(),
                    m.region.ino()
                ),
            ));
        }
        (vaddr as usize, reserved, true)
    } else {
        let reserved = reservation_for(len);
        let base = sys::reserve_anywhere(reserved)
            .map_err(|e| io_err("cannot reserve address space for the region", e))?;
        (base as usize, reserved, false)
    };
    let write = region.writable();
    let mapping = Arc::new(Mapping {
        region,
        base,
        len: AtomicUsize::new(0),
        reserved,
        fixed,
        write,
        chunks: RwLock::new(Vec::new()),
        pages: RwLock::new(Vec::new()),
        segment: Mutex::new(None),
        next_sequential: AtomicUsize::new(usize::MAX),
        random_window: AtomicUsize::new(0),
        last_missing: AtomicUsize::new(usize::MAX),
        frontier: AtomicUsize::new(0),
        parked: AtomicU64::new(0),
        protect: Mutex::new(()),
        resize: Mutex::new(false),
        writeback: Mutex::new(()),
    });
    if let Err(e) = mapping.map_range(0, len) {
        mapping.teardown();
        return Err(e);
    }
    let mut reg = lock_registry();
    if let Some(existing) = reg
        .by_ino
        .get(&key)
        .and_then(|b| reg.by_base.get(b))
        .cloned()
    {
        // Another thread mapped it meanwhile: keep theirs.
        drop(reg);
        mapping.teardown();
        return Ok(existing);
    }
    reg.by_base.insert(base, Arc::clone(&mapping));
    reg.by_ino.insert(key, base);
    Ok(mapping)
}

/// The mapping containing `addr`.
pub fn lookup(addr: *const u8) -> Option<Arc<Mapping>> {
    lookup_addr(addr as usize)
}

fn lookup_addr(addr: usize) -> Option<Arc<Mapping>> {
    let reg = lock_registry();
    reg.by_base
        .range(..=addr)
        .next_back()
        .filter(|(b, m)| addr < **b + m.len().max(1))
        .map(|(_, m)| Arc::clone(m))
}

/// What a layer above the mapping (rmalloc's thread caches) runs when a mapping at
/// (base, length) is about to be unmapped, before its dirty pages are written back.
pub type UnmapHook = fn(*mut u8, usize);

fn unmap_hooks() -> std::sync::MutexGuard<'static, Vec<UnmapHook>> {
    static HOOKS: Mutex<Vec<UnmapHook>> = Mutex::new(Vec::new());
    HOOKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Registers `hook` to run at every [`unmap`] (once, however often it is registered).
pub fn on_unmap(hook: UnmapHook) {
    let mut hooks = unmap_hooks();
    if !hooks.iter().any(|h| std::ptr::fn_addr_eq(*h, hook)) {
        hooks.push(hook);
    }
}

/// Unmaps the mapping containing `addr`, writing dirty pages back first.
pub fn unmap(addr: *const u8) -> Result<()> {
    let m = lookup(addr).ok_or_else(|| {
        map_err(
            libc::EINVAL,
            format!("{addr:p} is not inside a mapped region"),
        )
    })?;
    // Layers above (rmalloc's thread caches of a heap in this region) let go first.
    let hooks = unmap_hooks().clone();
    for hook in hooks {
        hook(m.base(), m.len().max(1));
    }
    let synced = m.msync(m.base as *const u8, m.len());
    {
        let mut reg = lock_registry();
        reg.by_base.remove(&m.base);
        reg.by_ino.remove(&(m.region.dev(), m.region.ino()));
    }
    m.teardown();
    synced
}

impl Mapping {
    pub fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ino(&self) -> u64 {
        self.region.ino()
    }

    /// The region behind the mapping.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Whether the mapping is writable.
    pub fn writable(&self) -> bool {
        self.write
    }

    /// Extends the region to `new_len` bytes and the mapping with it, in place; `ENOMEM` when
    /// the address space after the mapping is not free.
    pub fn grow(&self, new_len: usize) -> Result<()> {
        let _guard = self.resize.lock().map_err(|_| poisoned())?;
        let old = self.len();
        if new_len <= old {
            return Ok(());
        }
        let new_len = round_up(new_len as u64, PAGE as u64) as usize;
        if new_len > self.reserved {
            return Err(map_err(
                libc::ENOMEM,
                format!(
                    "region {} cannot grow to {new_len} bytes in place: {} bytes of address \
                     space are reserved at {:#x}",
                    self.ino(),
                    self.reserved,
                    self.base
                ),
            ));
        }
        if !self.write {
            return Err(map_err(
                libc::EACCES,
                format!("region {} is mapped read-only; it cannot grow", self.ino()),
            ));
        }
        self.region.extend(new_len as u64)?;
        self.region.refresh()?;
        let fixed_now = self.region.vaddr();
        if self.fixed && fixed_now != self.base as u64 {
            return Err(map_err(
                libc::ENOMEM,
                format!(
                    "region {} moved to fixed address {fixed_now:#x} when it grew; map it again",
                    self.ino()
                ),
            ));
        }
        self.map_range(old, new_len)
    }

    /// Maps `[from, to)` of the region (page aligned) and publishes the new length.
    fn map_range(&self, from: usize, to: usize) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        let chunks_needed = to.div_ceil(CHUNK_SIZE as usize);
        let mut kinds = Vec::with_capacity(chunks_needed);
        let mut any_local = false;
        for c in 0..chunks_needed {
            let loc = self.region.chunk(c as u64)?;
            any_local |= loc.local;
            kinds.push(if loc.local {
                Backing::Local
            } else {
                Backing::Remote
            });
        }
        if any_local && !self.ensure_segment()? {
            // A writable mapping over a read-only segment: the host's chunks go through the
            // transport like remote ones (the agent keeps writable memfds from untrusted
            // writers, docs/SECURITY.md).
            for kind in kinds.iter_mut() {
                *kind = Backing::Remote;
            }
        }
        // Page table first, so faults on new pages find their state.
        {
            let mut pages = self.pages.write().map_err(|_| poisoned())?;
            let want = to / PAGE;
            while pages.len() < want {
                pages.push(AtomicU8::new(MISSING));
            }
        }
        let mut at = from;
        while at < to {
            let c = at / CHUNK_SIZE as usize;
            let kind = kinds[c].clone();
            let mut end = ((c + 1) * CHUNK_SIZE as usize).min(to);
            while end < to && kinds[end / CHUNK_SIZE as usize] == kind {
                end = ((end / CHUNK_SIZE as usize + 1) * CHUNK_SIZE as usize).min(to);
            }
            let addr = (self.base + at) as *mut u8;
            match kind {
                Backing::Local => {
                    let seg = self.segment.lock().map_err(|_| poisoned())?;
                    let (fd, _) = seg.as_ref().ok_or_else(|| {
                        map_err(libc::EIO, "the host agent gave no segment".into())
                    })?;
                    sys::map_fd_fixed(addr, end - at, fd.as_fd(), at as u64, self.write)
                        .map_err(|e| io_err("cannot map the region's local segment", e))?;
                }
                Backing::Remote => {
                    let faults = uffd::faults().map_err(|e| io_err("remote mapping", e))?;
                    sys::map_anon_fixed(addr, end - at, self.write)
                        .map_err(|e| io_err("cannot map memory for remote pages", e))?;
                    faults
                        .register(addr as usize, end - at, self.write)
                        .map_err(|e| io_err("remote mapping", e))?;
                }
            }
            at = end;
        }
        *self.chunks.write().map_err(|_| poisoned())? = kinds;
        self.len.store(to, Ordering::Release);
        Ok(())
    }

    /// Asks the host agent for the region's segment, every time pages of this host are
    /// mapped: a region whose chunks here were all freed (truncated to nothing) and allocated
    /// again lives in a new memfd, and new pages must map that one, not the orphan the old
    /// descriptor names. Returns whether this mapping may map it (a writable mapping needs a
    /// writable segment).
    fn ensure_segment(&self) -> Result<bool> {
        let Some(fresh) = self.region.segment()? else {
            return Err(map_err(
                libc::EIO,
                format!(
                    "the host agent has no segment of region {} although the map puts chunks \
                     on this host",
                    self.ino()
                ),
            ));
        };
        let usable = fresh.writable || !self.write;
        *self.segment.lock().map_err(|_| poisoned())? = Some((fresh.fd, fresh.writable));
        Ok(usable)
    }

    /// Unmaps everything and gives the address range back.
    fn teardown(&self) {
        let Ok(mut gone) = self.resize.lock() else {
            return;
        };
        if *gone {
            return;
        }
        *gone = true;
        let base = self.base as *mut u8;
        let result = if self.fixed {
            sys::re_reserve(base, self.reserved)
        } else {
            sys::release(base, self.reserved)
        };
        if let Err(e) = result {
            tracing::warn!(ino = self.ino(), error = %e, "cannot release a region mapping");
        }
        self.len.store(0, Ordering::Release);
        if let Err(e) = self.region.close() {
            tracing::debug!(ino = self.ino(), error = %e, "closing the region failed");
        }
    }

    fn is_remote(&self, page: usize) -> bool {
        self.chunks.read().is_ok_and(|c| {
            c.get(page / CHUNK_PAGES)
                .is_some_and(|k| *k == Backing::Remote)
        })
    }

    /// Pages `[first, last)` covered by `[addr, addr + len)`, clipped to the mapping.
    fn page_range(&self, addr: *const u8, len: usize) -> Result<(usize, usize)> {
        let a = addr as usize;
        let mapped = self.len();
        if a < self.base || a > self.base + mapped {
            return Err(map_err(
                libc::EINVAL,
                format!(
                    "{addr:p} is outside region {} mapped at {:#x}",
                    self.ino(),
                    self.base
                ),
            ));
        }
        let start = a - self.base;
        let end = start.saturating_add(len).min(mapped);
        Ok((start / PAGE, end.div_ceil(PAGE)))
    }

    /// Claims the missing pages of `[first, last)` for fetching; returns the claimed runs.
    fn claim(pages: &[AtomicU8], first: usize, last: usize) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (p, state) in pages.iter().enumerate().take(last).skip(first) {
            if state
                .compare_exchange(MISSING, FETCHING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                match runs.last_mut() {
                    Some((_, end)) if *end == p => *end = p + 1,
                    _ => runs.push((p, p + 1)),
                }
            }
        }
        runs
    }

    /// Spans of page runs inside chunk `c`, and its daemon address.
    fn spans_of(&self, c: usize, runs: &[(usize, usize)]) -> Result<(String, Vec<Span>)> {
        let loc = self.region.chunk(c as u64)?;
        let chunk_start = c * CHUNK_SIZE as usize;
        let spans = runs
            .iter()
            .map(|&(a, b)| Span {
                ino: self.ino(),
                region_offset: (a * PAGE) as u64,
                pool: loc.pool,
                pool_offset: loc.pool_offset + (a * PAGE - chunk_start) as u64,
                len: ((b - a) * PAGE) as u64,
            })
            .collect();
        Ok((loc.addr, spans))
    }

    /// Spans of page runs that may cross chunks, all on one daemon (else `Invalid`): the
    /// daemon's address and the spans, in run order.
    fn spans_across(&self, runs: &[(usize, usize)]) -> Result<(String, Vec<Span>)> {
        let mut groups = self.spans_by_daemon(runs)?;
        if groups.len() > 1 {
            return Err(RegionsError::Invalid("runs span daemons".into()));
        }
        Ok(groups
            .pop()
            .map(|(addr, spans, _)| (addr, spans))
            .unwrap_or_default())
    }

    /// Spans of page runs that may cross chunks, grouped by daemon in run order: each group's
    /// daemon address, its spans and their bytes. Chunks that lie one after another in a pool
    /// go as one span, so as one request (the daemon answers each request with system calls
    /// of its own).
    fn spans_by_daemon(&self, runs: &[(usize, usize)]) -> Result<Vec<(String, Vec<Span>, usize)>> {
        let mut groups: Vec<(String, Vec<Span>, usize)> = Vec::new();
        for &(a, b) in runs {
            let mut x = a;
            while x < b {
                let c = x / CHUNK_PAGES;
                let y = b.min((c + 1) * CHUNK_PAGES);
                let (at, piece) = self.spans_of(c, &[(x, y)])?;
                if groups.last().is_none_or(|g| g.0 != at) {
                    groups.push((at, Vec::new(), 0));
                }
                let Some(group) = groups.last_mut() else {
                    break;
                };
                for span in piece {
                    group.2 += span.len as usize;
                    if !group.1.last_mut().is_some_and(|last| last.absorb(&span)) {
                        group.1.push(span);
                    }
                }
                x = y;
            }
        }
        Ok(groups)
    }

    /// Fetches the claimed `runs` (all on one daemon; they may cross chunks) in one transport
    /// call and installs them. On failure the claims are given back (pages missing again, their
    /// waiters woken) and the error returned.
    fn fetch_runs(&self, faults: &Faults, runs: &[(usize, usize)]) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let total: usize = runs.iter().map(|(a, b)| (b - a) * PAGE).sum();
        with_fetch_buffer(total, |buf| self.fetch_into(faults, runs, buf))
    }

    /// [`Self::fetch_runs`] through `buf` (exactly the runs' length).
    fn fetch_into(&self, faults: &Faults, runs: &[(usize, usize)], buf: &mut [u8]) -> Result<()> {
        // A stale map or a revoked capability: fetch both again and retry once.
        let fetched = self.region.with_fresh_map(|| {
            let (addr, spans) = self.spans_across(runs)?;
            self.region.transport(&addr)?.read(&spans, buf)
        });
        let pages = self.pages.read().map_err(|_| poisoned())?;
        if let Err(e) = fetched {
            // Threads that faulted on these pages while they were claimed wait for this
            // fetch: they fault again and get served (or SIGBUS).
            self.release_claims(faults, &pages, runs);
            return Err(e);
        }
        let mut at = 0usize;
        for (k, &(a, b)) in runs.iter().enumerate() {
            let n = (b - a) * PAGE;
            // The pages stay FETCHING through the install: a thread that faults on one of
            // them meanwhile waits for the install's wake-up instead of faulting again and
            // again. They become CLEAN once they are there.
            let parked = self.parked.load(Ordering::SeqCst);
            let installed = faults.install(self.base + a * PAGE, &buf[at..at + n], self.write);
            let upto = match &installed {
                Ok(()) => b,
                Err((done, _)) => a + done / PAGE,
            };
            self.settle_install(faults, &pages, a, upto, CLEAN, parked);
            if let Err((_, e)) = installed {
                tracing::warn!(ino = self.ino(), error = %e, "cannot install fetched pages");
                // The pages not installed, in this run and the ones after it, are missing
                // again, and their waiters fault again.
                let mut rest = vec![(upto, b)];
                rest.extend_from_slice(&runs[k + 1..]);
                self.release_claims(faults, &pages, &rest);
                return Err(io_err("installing fetched pages", e));
            }
            at += n;
        }
        Ok(())
    }

    /// Gives back claimed pages that were not installed (FETCHING, or DROPPED by `rclearcache`):
    /// missing again, and the threads waiting there fault again.
    fn release_claims(&self, faults: &Faults, pages: &[AtomicU8], runs: &[(usize, usize)]) {
        for &(a, b) in runs {
            for s in &pages[a..b] {
                give_back(s);
            }
            faults.wake(self.base + a * PAGE, (b - a) * PAGE);
        }
    }

    /// Ends the claim on pages `[a, upto)` that were just installed: FETCHING pages become
    /// `to`; pages `rclearcache` dropped meanwhile (DROPPED) are dropped again (some may have
    /// been installed after its drop, from bytes fetched before it) and become missing. Then
    /// wakes the threads waiting there (which find the pages there or fault again), when there
    /// can be any: the install woke every thread that faulted before it ended, so only one
    /// parked by a fault handler since `parked` (the count read before the install) waits.
    fn settle_install(
        &self,
        faults: &Faults,
        pages: &[AtomicU8],
        a: usize,
        upto: usize,
        to: u8,
        parked: u64,
    ) {
        let mut dropped = false;
        let mut p = a;
        while p < upto {
            if pages[p]
                .compare_exchange(FETCHING, to, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
                || pages[p].load(Ordering::Acquire) != DROPPED
            {
                p += 1;
                continue;
            }
            let mut end = p + 1;
            while end < upto && pages[end].load(Ordering::Acquire) == DROPPED {
                end += 1;
            }
            // Nobody else touches DROPPED pages: drop first, then give them back, so that an
            // install after they are missing again is never dropped.
            if let Err(e) = sys::drop_pages((self.base + p * PAGE) as *mut u8, (end - p) * PAGE) {
                tracing::warn!(ino = self.ino(), error = %e, "cannot drop pages rclearcache dropped under an install");
            }
            for s in &pages[p..end] {
                let _ = s.compare_exchange(DROPPED, MISSING, Ordering::AcqRel, Ordering::Acquire);
            }
            dropped = true;
            p = end;
        }
        // A handler parks its thread after counting it (SeqCst, before it reads the state):
        // one that saw FETCHING or DROPPED before the marks above is counted by now.
        if dropped || self.parked.load(Ordering::SeqCst) != parked {
            faults.wake(self.base + a * PAGE, upto.saturating_sub(a) * PAGE);
        }
    }

    /// Pages a missing fault fetches: the whole window when access is `sequential`; twice the
    /// last (up to the whole window) when it is `local` (next to a page that is here, or a
    /// little ahead of the last missing fault); else half the last, down to one page (see
    /// `random_window`).
    fn fault_window(&self, sequential: bool, local: bool, max: usize) -> usize {
        let last = match self.random_window.load(Ordering::Relaxed) {
            0 => max,
            w => w.min(max),
        };
        let w = if sequential {
            max
        } else if local {
            (last * 2).min(max)
        } else {
            last
        };
        let next = if sequential || local {
            w
        } else {
            (w / 2).max(1)
        };
        self.random_window
            .store(if next == max { 0 } else { next }, Ordering::Relaxed);
        w
    }

    /// Serves a missing fault at page `p`.
    fn fault_missing(&self, faults: &Faults, p: usize) {
        let pages = match self.pages.read() {
            Ok(p) => p,
            Err(_) => return faults.lose(self.base + p * PAGE, PAGE),
        };
        let max_window = prefetch_pages();
        let total = pages.len();
        // Counted before the state is read: a settle that marks the page after this read
        // sees the count and wakes the thread parked below.
        self.parked.fetch_add(1, Ordering::SeqCst);
        let state = pages.get(p).map_or(LOST, |s| s.load(Ordering::SeqCst));
        let c = p / CHUNK_PAGES;
        let chunk_end = ((c + 1) * CHUNK_PAGES).min(total);
        // Sequential access (a fault where the last window ended, at the read-ahead frontier,
        // or inside read-ahead still in flight): fetch the next windows in the background.
        let frontier = self.frontier.load(Ordering::Relaxed);
        let sequential = p == self.next_sequential.load(Ordering::Relaxed)
            || p == frontier
            || (state == FETCHING && p < frontier && p + READ_AHEAD * max_window >= frontier);
        // The page before is here or coming: access near what was touched (another thread's
        // stream, say), which fetches whole windows too.
        let near = p
            .checked_sub(1)
            .and_then(|q| pages.get(q))
            .is_some_and(|s| {
                matches!(
                    s.load(Ordering::Relaxed),
                    FETCHING | CLEAN | DIRTY | SYNCING
                )
            });
        // A little ahead of the last missing fault: a forward walk with gaps (a stride).
        let last = self.last_missing.load(Ordering::Relaxed);
        let forward = p > last && p - last <= max_window;
        let window = if state == MISSING {
            self.last_missing.store(p, Ordering::Relaxed);
            self.fault_window(sequential, near || forward, max_window)
        } else {
            max_window
        };
        let window_end = (p + window).min(chunk_end);
        if sequential && max_window > 1 {
            let start = frontier.max(window_end);
            // In pieces, so that the read-ahead threads fetch in parallel, each aligned to its
            // size in the address space: threads installing into one page table contend for
            // its lock, and aligned pieces of 1 MiB put at most two there.
            let piece = max_window * READ_AHEAD_PIECE;
            let abs = self.base / PAGE;
            // Up to READ_AHEAD windows ahead of this fault, not of the frontier: a reader
            // that keeps catching up with installs in flight must not push read-ahead on
            // without bound (each such fault would add as much again).
            let end =
                ((abs + p + max_window * READ_AHEAD).div_ceil(piece) * piece - abs).min(total);
            // One fault takes the frontier forward (another one at the same time, or an
            // `rclearcache` pulling it back, wins instead).
            if end > start
                && self
                    .frontier
                    .compare_exchange(frontier, end, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                let mut at = start;
                while at < end {
                    let next = (((abs + at) / piece + 1) * piece - abs).min(end);
                    faults.submit(Job::Prefetch {
                        addr: self.base + at * PAGE,
                        len: (next - at) * PAGE,
                    });
                    at = next;
                }
            }
        }
        match state {
            MISSING => {}
            // Another thread is fetching it: its install (or its end) wakes this one.
            FETCHING | DROPPED => return,
            // There (a stale event), or dropped by `rclearcache`, which marks it missing before
            // it lets anything else use the page.
            _ => return faults.wake(self.base + p * PAGE, PAGE),
        }
        // After a small window, a fault on the next page is near, not the next window of a
        // stream: read-ahead waits for a fault a whole window on.
        let next = if window < max_window {
            p + max_window
        } else {
            window_end
        };
        self.next_sequential.store(next, Ordering::Relaxed);
        let runs = Self::claim(&pages, p, window_end);
        drop(pages);
        if runs.first().is_none_or(|r| r.0 != p) {
            // Lost the race for the faulting page; whoever won wakes the thread.
            if let Err(e) = self.fetch_runs(faults, &runs) {
                tracing::debug!(error = %e, "prefetch on fault failed");
            }
            return;
        }
        if let Err(e) = self.fetch_runs(faults, &runs) {
            tracing::warn!(
                ino = self.ino(),
                offset = p * PAGE,
                error = %e,
                "cannot fetch a page of a mapped region; the access gets SIGBUS"
            );
            // Lost only if nobody claimed it again since the failed fetch gave it back (that
            // claimant serves the thread, or fails the same way), under `protect`: no page
            // that someone made dirty meanwhile is wiped.
            if let Ok(pages) = self.pages.read()
                && let Some(s) = pages.get(p)
            {
                let _one = self.lock_protect();
                if s.compare_exchange(MISSING, LOST, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    faults.lose(self.base + p * PAGE, PAGE);
                }
            }
        }
    }

    /// Serves a write to a write-protected page `p`: it becomes dirty.
    fn fault_write(&self, faults: &Faults, p: usize) {
        let at = self.base + p * PAGE;
        let Ok(pages) = self.pages.read() else {
            // Poisoned by a panic elsewhere: let the store land (it is not tracked).
            if let Err(e) = faults.unprotect(at, PAGE) {
                tracing::warn!(error = %e, "cannot lift write protection");
                faults.wake(at, PAGE);
            }
            return;
        };
        let Some(s) = pages.get(p) else {
            return faults.wake(at, PAGE);
        };
        // Counted before the state is read (see `fault_missing`).
        self.parked.fetch_add(1, Ordering::SeqCst);
        match s.load(Ordering::SeqCst) {
            CLEAN | SYNCING | DIRTY => {
                // (It wakes the writer whatever happens.)
                if let Err(e) = self.make_dirty(faults, &pages, p, p + 1) {
                    tracing::warn!(ino = self.ino(), error = %e, "cannot lift write protection");
                }
            }
            // Claimed by a fetch (installed and not yet settled, or a stale event): the settle
            // wakes the store, which then finds the page CLEAN (or missing, if `rclearcache`
            // dropped it: letting the store land now would lose it to that drop).
            FETCHING | DROPPED => {}
            // Dropped meanwhile (the event is stale: the retried store faults as missing), or
            // there with bytes an install brought in while `rclearcache` ran: drop it, so the
            // retried store fetches it afresh.
            MISSING => {
                if s.compare_exchange(MISSING, FETCHING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    if let Err(e) = sys::drop_pages(at as *mut u8, PAGE) {
                        tracing::warn!(ino = self.ino(), error = %e, "cannot drop a stale page");
                    }
                    give_back(s);
                }
                faults.wake(at, PAGE);
            }
            // LOST: its mapping raises SIGBUS.
            _ => faults.wake(at, PAGE),
        }
    }

    /// Lets stores to pages `[a, b)` that are CLEAN, SYNCING or DIRTY land, and records them
    /// dirty: under `protect`, each is marked DIRTY and only those have their protection lifted
    /// (no `msync` can protect and copy a page in between, and no `rclearcache` can drop one:
    /// both take `protect` too, so a page in these states is there); then the waiting writers
    /// are woken, so every store they make is seen by the next `msync`.
    fn make_dirty(
        &self,
        faults: &Faults,
        pages: &[AtomicU8],
        a: usize,
        b: usize,
    ) -> std::io::Result<()> {
        let mut result = Ok(());
        {
            let _one = self.lock_protect();
            let mut p = a;
            while p < b {
                let mut end = p;
                while end < b && mark_dirty(&pages[end]) {
                    end += 1;
                }
                if end > p
                    && let Err(e) = faults.unprotect_quietly(self.base + p * PAGE, (end - p) * PAGE)
                {
                    result = Err(e);
                }
                p = end + 1;
            }
        }
        faults.wake(self.base + a * PAGE, (b - a) * PAGE);
        result
    }

    fn lock_protect(&self) -> std::sync::MutexGuard<'_, ()> {
        self.protect
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Fetches the missing remote pages of `[addr, addr + len)`; with `sync` before returning,
    /// else in the background.
    pub fn prefetch(&self, addr: *const u8, len: usize, sync: bool) -> Result<()> {
        let (first, last) = self.page_range(addr, len)?;
        if !sync {
            if let Ok(f) = uffd::faults() {
                f.submit(Job::Prefetch {
                    addr: self.base + first * PAGE,
                    len: (last - first) * PAGE,
                });
            }
            return Ok(());
        }
        self.fetch_range(first, last)
    }

    fn fetch_range(&self, first: usize, last: usize) -> Result<()> {
        let faults = match uffd::faults() {
            Ok(f) => f,
            Err(_) => return Ok(()), // nothing remote can be mapped then
        };
        // Consecutive remote chunks on one daemon go in one (pipelined) transport call.
        let mut batch: Vec<(usize, usize)> = Vec::new();
        let mut batch_addr: Option<String> = None;
        let mut c = first / CHUNK_PAGES;
        while c * CHUNK_PAGES < last {
            let a = (c * CHUNK_PAGES).max(first);
            let b = ((c + 1) * CHUNK_PAGES).min(last);
            c += 1;
            if !self.is_remote(a) {
                continue;
            }
            let addr = match self.region.chunk((a / CHUNK_PAGES) as u64) {
                Ok(loc) => loc.addr,
                Err(e) => {
                    let pages = self.pages.read().map_err(|_| poisoned())?;
                    self.release_claims(&faults, &pages, &batch);
                    return Err(e);
                }
            };
            if batch_addr.as_ref().is_some_and(|x| *x != addr) {
                self.fetch_runs(&faults, &std::mem::take(&mut batch))?;
            }
            batch_addr = Some(addr);
            let pages = self.pages.read().map_err(|_| poisoned())?;
            batch.extend(Self::claim(&pages, a, b.min(pages.len())));
        }
        self.fetch_runs(&faults, &batch)
    }

    /// Marks `[addr, addr + len)` dirty so that [`Mapping::msync`] writes it back. With `zero`,
    /// missing pages become zero pages without being fetched (the caller overwrites them);
    /// without, they are fetched first.
    pub fn markdirty(&self, addr: *const u8, len: usize, zero: bool) -> Result<()> {
        if !self.write {
            return Err(map_err(
                libc::EACCES,
                format!("region {} is mapped read-only", self.ino()),
            ));
        }
        let (first, last) = self.page_range(addr, len)?;
        let Ok(faults) = uffd::faults() else {
            return Ok(());
        };
        if !zero {
            self.fetch_range(first, last)?;
        }
        let zeros = vec![0u8; CHUNK_SIZE as usize];
        let mut pages = self.pages.read().map_err(|_| poisoned())?;
        let mut last = last.min(pages.len());
        let mut p = first;
        while p < last {
            if !self.is_remote(p) {
                p += 1;
                continue;
            }
            let state = &pages[p];
            if zero
                && state
                    .compare_exchange(MISSING, FETCHING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                // A run of missing pages inside this chunk: zero pages, dirty and writable.
                let chunk_end = ((p / CHUNK_PAGES + 1) * CHUNK_PAGES).min(last);
                let mut end = p + 1;
                while end < chunk_end
                    && pages[end]
                        .compare_exchange(MISSING, FETCHING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    end += 1;
                }
                // Installed write-protected, FETCHING through the install (threads faulting
                // there wait for it), then DIRTY, and then writable (like any page made dirty:
                // a page `rclearcache` dropped meanwhile is never left writable and untracked);
                // the pages not installed are missing again, and their waiters fault again.
                let parked = self.parked.load(Ordering::SeqCst);
                let installed =
                    faults.install(self.base + p * PAGE, &zeros[..(end - p) * PAGE], true);
                let upto = match &installed {
                    Ok(()) => end,
                    Err((done, _)) => p + done / PAGE,
                };
                self.settle_install(&faults, &pages, p, upto, DIRTY, parked);
                for s in &pages[upto..end] {
                    give_back(s);
                }
                if upto > p {
                    self.make_dirty(&faults, &pages, p, upto)
                        .map_err(|e| io_err("making zero pages writable", e))?;
                }
                if let Err((_, e)) = installed {
                    faults.wake(self.base + p * PAGE, (end - p) * PAGE);
                    return Err(io_err("installing zero pages", e));
                }
                p = end;
                continue;
            }
            match state.load(Ordering::Acquire) {
                CLEAN | SYNCING => {
                    self.make_dirty(&faults, &pages, p, p + 1)
                        .map_err(|e| io_err("marking a page dirty", e))?;
                    p += 1;
                }
                // Wait for its fetcher, without the state lock (the fetcher needs it, and a
                // growth waiting for it would keep the fetcher from it).
                FETCHING | DROPPED => {
                    drop(pages);
                    std::thread::yield_now();
                    pages = self.pages.read().map_err(|_| poisoned())?;
                    last = last.min(pages.len());
                }
                _ => p += 1,
            }
        }
        Ok(())
    }

    /// Writes the dirty remote pages of `[addr, addr + len)` back (see [`Self::write_back`])
    /// and write-protects them again so that later writes are seen. Local chunks are
    /// the region's memory itself and need nothing.
    pub fn msync(&self, addr: *const u8, len: usize) -> Result<()> {
        let (first, last) = self.page_range(addr, len)?;
        let Ok(faults) = uffd::faults() else {
            return Ok(());
        };
        let _one = self.writeback.lock().map_err(|_| poisoned())?;
        self.write_back(&faults, first, last)
    }

    /// [`Mapping::msync`] of pages `[first, last)`, with `writeback` held. Chunk by chunk, the
    /// dirty pages are marked SYNCING, protected and copied out (under `protect`); the copies
    /// of consecutive chunks held by one daemon go out together, up to [`WRITE_BACK_BATCH`]
    /// bytes, so that chunks lying one after another in its pool take one request.
    fn write_back(&self, faults: &Faults, first: usize, last: usize) -> Result<()> {
        let pages = self.pages.read().map_err(|_| poisoned())?;
        let last = last.min(pages.len());
        let mut c = first / CHUNK_PAGES;
        let mut result = Ok(());
        let mut batch = WriteBatch::default();
        while c * CHUNK_PAGES < last {
            let a = (c * CHUNK_PAGES).max(first);
            let b = ((c + 1) * CHUNK_PAGES).min(last);
            let chunk = c as u64;
            c += 1;
            if !self.is_remote(a) {
                continue;
            }
            let daemon = self.region.chunk(chunk).ok().map(|loc| loc.addr);
            if !batch.runs.is_empty()
                && (batch.daemon != daemon || batch.buf.len() + (b - a) * PAGE > WRITE_BACK_BATCH)
            {
                self.write_batch(&pages, &mut batch, &mut result);
            }
            // Marked, protected and copied out under `protect`: no `make_dirty` lifts the
            // protection between the protect and the copy.
            let one = self.lock_protect();
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (p, s) in pages.iter().enumerate().take(b).skip(a) {
                if s.compare_exchange(DIRTY, SYNCING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    match runs.last_mut() {
                        Some((_, end)) if *end == p => *end = p + 1,
                        _ => runs.push((p, p + 1)),
                    }
                }
            }
            // Protect first: a write from now on faults and marks the page dirty again. Runs
            // that cannot be protected stay DIRTY (still writable) and are not written now.
            runs.retain(
                |&(a, b)| match faults.protect(self.base + a * PAGE, (b - a) * PAGE) {
                    Ok(()) => true,
                    Err(e) => {
                        for s in &pages[a..b] {
                            let _ = s.compare_exchange(
                                SYNCING,
                                DIRTY,
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            );
                        }
                        result = Err(io_err("write-protecting pages for msync", e));
                        false
                    }
                },
            );
            for &(a, b) in &runs {
                let at = batch.buf.len();
                let n = (b - a) * PAGE;
                batch.buf.resize(at + n, 0);
                // SAFETY: the pages are present and mapped readable: a page is marked CLEAN,
                // SYNCING or DIRTY only while it is there as long as `protect` is held (every
                // path that drops such pages holds it), and it is held here; writers are held
                // off by the protection just set.
                unsafe {
                    sys::copy_out(
                        (self.base + a * PAGE) as *const u8,
                        &mut batch.buf[at..at + n],
                    )
                };
                // A run that continues the last one (across a chunk's end) joins it.
                match batch.runs.last_mut() {
                    Some((_, end)) if *end == a => *end = b,
                    _ => batch.runs.push((a, b)),
                }
            }
            drop(one);
            if !runs.is_empty() {
                batch.daemon = daemon;
            }
        }
        self.write_batch(&pages, &mut batch, &mut result);
        result
    }

    /// Writes a [`WriteBatch`] (runs copied out by [`Self::write_back`], all on one daemon) in
    /// one transport call, then marks its pages CLEAN, or DIRTY again if the write failed (a
    /// store meanwhile made them DIRTY already: that stays). Leaves the batch empty.
    fn write_batch(&self, pages: &[AtomicU8], batch: &mut WriteBatch, result: &mut Result<()>) {
        if batch.runs.is_empty() {
            return;
        }
        // A stale map or a revoked capability: fetch both again and retry once. The batch was
        // one daemon's when it was made; after a refresh its chunks may be on several.
        let written = self.region.with_fresh_map(|| {
            let mut at = 0;
            for (addr, spans, len) in self.spans_by_daemon(&batch.runs)? {
                self.region
                    .transport(&addr)?
                    .write(&spans, &batch.buf[at..at + len])?;
                at += len;
            }
            Ok(())
        });
        for &(a, b) in &batch.runs {
            for s in &pages[a..b] {
                let to = if written.is_ok() { CLEAN } else { DIRTY };
                let _ = s.compare_exchange(SYNCING, to, Ordering::AcqRel, Ordering::Acquire);
            }
        }
        if let Err(e) = written {
            *result = Err(e);
        }
        batch.runs.clear();
        batch.buf.clear();
        batch.daemon = None;
    }

    /// [`Mapping::msync`] in the background (`rmsync(MS_ASYNC)`): returns at once; a later
    /// synchronous `msync` of the range returns once this one has written. A write-back that
    /// fails leaves its pages dirty for the next `msync`, which reports the error. When the
    /// background queue is full the write-back is done now.
    pub fn msync_async(&self, addr: *const u8, len: usize) -> Result<()> {
        self.page_range(addr, len)?;
        let faults = uffd::faults().map_err(|e| io_err("the fault threads", e))?;
        if faults.try_submit(Job::Sync {
            addr: addr as usize,
            len,
        }) {
            return Ok(());
        }
        self.msync(addr, len)
    }

    /// Drops pages `[a, b)` (none DIRTY) and marks them, under `writeback` and `protect`.
    fn drop_run(&self, faults: &Faults, pages: &[AtomicU8], a: usize, b: usize) -> Result<()> {
        let at = (self.base + a * PAGE) as *mut u8;
        let n = (b - a) * PAGE;
        let any_lost = pages[a..b]
            .iter()
            .any(|s| s.load(Ordering::Acquire) == LOST);
        // A failed re-mapping or drop changes nothing; a failed registration after the
        // re-mapping leaves memory that would read as zeros: every access raises SIGBUS
        // instead, as for lost pages, and the pages are marked lost.
        let mut registered = Ok(());
        if any_lost {
            sys::map_anon_fixed(at, n, self.write)
                .map_err(|e| io_err("re-mapping lost pages", e))?;
            registered = faults.register(at as usize, n, self.write);
            if registered.is_err() {
                faults.lose(at as usize, n);
            }
        } else {
            sys::drop_pages(at, n).map_err(|e| io_err("dropping cached pages", e))?;
        }
        let gone = if registered.is_ok() { MISSING } else { LOST };
        // Cached pages are missing now; pages being fetched are DROPPED, and their fetcher
        // drops what it installed and marks them missing.
        for s in &pages[a..b] {
            loop {
                let v = s.load(Ordering::Acquire);
                let to = match v {
                    CLEAN | LOST | DIRTY => gone,
                    FETCHING => DROPPED,
                    _ => break,
                };
                if s.compare_exchange(v, to, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    break;
                }
            }
        }
        registered.map_err(|e| io_err("re-registering lost pages", e))
    }

    /// Drops the cached remote pages of `[addr, addr + len)` (dirty ones are written back
    /// first), so the next access fetches them afresh; pages lost to an earlier failure become
    /// fetchable again.
    pub fn clearcache(&self, addr: *const u8, len: usize) -> Result<()> {
        let (first, last) = self.page_range(addr, len)?;
        let Ok(faults) = uffd::faults() else {
            return Ok(());
        };
        // Held until the dropped pages are marked: no write-back reads a page while it is
        // dropped and not yet missing.
        let _one = self.writeback.lock().map_err(|_| poisoned())?;
        self.write_back(&faults, first, last)?;
        // Read-ahead of a sequential reader starts again from the first dropped page.
        self.frontier.fetch_min(first, Ordering::Relaxed);
        let pages = self.pages.read().map_err(|_| poisoned())?;
        let last = last.min(pages.len());
        let mut p = first;
        while p < last {
            if !self.is_remote(p) {
                p += 1;
                continue;
            }
            let mut end = p;
            while end < last && self.is_remote(end) {
                end += 1;
            }
            // Dropped and marked under `protect`: a page marked CLEAN, SYNCING or DIRTY is
            // there for whoever holds it. Pages being fetched are DROPPED before the drop
            // (their fetcher may finish between the drop and the marking below), and again
            // after it (for fetches claimed meanwhile). A page stored to since the write-back
            // above (DIRTY again) is kept, dirty, for the next msync.
            let one = self.lock_protect();
            for s in &pages[p..end] {
                let _ = s.compare_exchange(FETCHING, DROPPED, Ordering::AcqRel, Ordering::Acquire);
            }
            let mut q = p;
            while q < end {
                if pages[q].load(Ordering::Acquire) == DIRTY {
                    q += 1;
                    continue;
                }
                let mut e = q;
                while e < end && pages[e].load(Ordering::Acquire) != DIRTY {
                    e += 1;
                }
                self.drop_run(&faults, &pages, q, e)?;
                q = e;
            }
            drop(one);
            p = end;
        }
        Ok(())
    }
}

/// Most bytes one write-back request carries: four chunks. The pages are copied out first and
/// sent after, so a batch should still be in the CPU's cache when it is sent (rmsync of
/// 16 MiB: 12-19 ms in batches of 512 KiB, 18-50 ms one chunk at a time, 18-31 ms in batches
/// of 4 MiB, interleaved runs).
const WRITE_BACK_BATCH: usize = 512 << 10;

/// Pages copied out for write-back and not written yet: runs of pages in order, their bytes in
/// the same order, and the daemon that holds them (as the region's map said).
#[derive(Default)]
struct WriteBatch {
    runs: Vec<(usize, usize)>,
    buf: Vec<u8>,
    daemon: Option<String>,
}

/// Largest fetch buffer a thread keeps between fetches: a read-ahead job at the largest
/// window. Larger fetches (a synchronous `rprefetch` of a long range, on an application
/// thread) get a buffer of their own, so application threads keep no more than this.
const KEPT_BUFFER: usize = READ_AHEAD_PIECE * CHUNK_PAGES * PAGE;

/// Runs `f` on a buffer of `len` bytes: the calling thread's kept buffer (fault and read-ahead
/// threads fetch over and over; a fresh buffer would be zeroed and faulted in every time).
/// Its contents are whatever the last fetch left: `f` overwrites all of it.
fn with_fetch_buffer<T>(len: usize, f: impl FnOnce(&mut [u8]) -> T) -> T {
    thread_local! {
        static BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if len > KEPT_BUFFER {
        return f(&mut vec![0u8; len]);
    }
    BUFFER.with(|b| match b.try_borrow_mut() {
        Ok(mut kept) => {
            if kept.len() < len {
                kept.resize(len, 0);
            }
            f(&mut kept[..len])
        }
        // Re-entered (cannot happen on the fetch paths; be safe anyway).
        Err(_) => f(&mut vec![0u8; len]),
    })
}

/// Marks a CLEAN, SYNCING or DIRTY page DIRTY; `false` for any other state (left alone).
fn mark_dirty(s: &AtomicU8) -> bool {
    loop {
        let v = s.load(Ordering::Acquire);
        match v {
            DIRTY => return true,
            CLEAN | SYNCING => {
                if s.compare_exchange(v, DIRTY, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return true;
                }
            }
            _ => return false,
        }
    }
}

/// Gives back a claim on a page that was not installed: FETCHING (or DROPPED, if
/// `rclearcache` ran meanwhile) becomes MISSING. Only the claimant calls it, once.
fn give_back(s: &AtomicU8) {
    if s.compare_exchange(FETCHING, MISSING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        let _ = s.compare_exchange(DROPPED, MISSING, Ordering::AcqRel, Ordering::Acquire);
    }
}

fn poisoned() -> RegionsError {
    map_err(
        libc::EIO,
        "mapping state lock poisoned by a panic in another thread".into(),
    )
}

/// Runs one job of the fault threads.
fn serve(job: Job) {
    let Ok(faults) = uffd::faults() else {
        return;
    };
    match job {
        Job::Missing(addr) | Job::WriteProtect(addr) => {
            let Some(m) = lookup_addr(addr) else {
                // Not ours (unmapped meanwhile): make the access fail rather than hang.
                faults.lose(addr, PAGE);
                return;
            };
            let p = (addr - m.base) / PAGE;
            if matches!(job, Job::WriteProtect(_)) {
                m.fault_write(&faults, p);
            } else {
                m.fault_missing(&faults, p);
            }
        }
        Job::Sync { addr, len } => {
            // Unmapped meanwhile: the unmap wrote everything back.
            if let Some(m) = lookup_addr(addr)
                && let Err(e) = m.msync(addr as *const u8, len)
            {
                tracing::warn!(error = %e, "background rmsync failed; the pages stay dirty for the next rmsync");
            }
        }
        Job::Prefetch { addr, len } => {
            if let Some(m) = lookup_addr(addr)
                && let Ok((first, last)) = m.page_range(addr as *const u8, len)
                && let Err(e) = m.fetch_range(first, last)
            {
                tracing::debug!(error = %e, "background prefetch failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_leave_room_to_grow() {
        assert_eq!(reservation_for(0), MIN_RESERVATION);
        assert_eq!(reservation_for(MIN_RESERVATION + 1), 2 * MIN_RESERVATION);
        assert_eq!(round_up(1, PAGE as u64), PAGE as u64);
    }

    #[test]
    fn claims_only_missing_pages() {
        let pages: Vec<AtomicU8> = (0..8).map(|_| AtomicU8::new(MISSING)).collect();
        pages[2].store(CLEAN, Ordering::Relaxed);
        pages[5].store(FETCHING, Ordering::Relaxed);
        let runs = Mapping::claim(&pages, 0, 8);
        assert_eq!(runs, vec![(0, 2), (3, 5), (6, 8)]);
        assert!(Mapping::claim(&pages, 0, 8).is_empty());
    }

    #[test]
    fn window_is_reserved_once() {
        init().unwrap();
        init().unwrap();
        // The window is taken: nothing else can land in it.
        assert!(sys::reserve_fixed_noreplace(VADDR_WINDOW_START as usize, PAGE).is_err());
        assert!(in_window(VADDR_WINDOW_START as usize, 1 << 30).unwrap());
        assert!(!in_window(VADDR_WINDOW_END as usize - PAGE, 2 * PAGE).unwrap());
    }

    #[test]
    fn gaps_skip_taken_ranges_and_leave_heap_room() {
        assert_eq!(gaps(0, 100, &[], 0), vec![(0, 100)]);
        assert_eq!(
            gaps(0, 100, &[(10, 20), (30, 40)], 5),
            vec![(0, 10), (25, 30), (45, 100)]
        );
        assert_eq!(gaps(0, 100, &[(0, 20), (90, 120)], 0), vec![(20, 90)]);
        assert!(gaps(0, 100, &[(0, 100)], 0).is_empty());
    }

    #[test]
    fn prefetch_window_is_clamped() {
        set_prefetch_pages(0);
        assert_eq!(prefetch_pages(), 1);
        set_prefetch_pages(1000);
        assert_eq!(prefetch_pages(), CHUNK_PAGES);
        set_prefetch_pages(DEFAULT_PREFETCH_PAGES);
    }
}
