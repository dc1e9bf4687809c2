//! C functions of the in-region allocator ([`crate::rmalloc`]): `rmalloc`,
//! `rmalloc_at`, `rfree`, `rsetroot`, `rgetroot`, and `rsetdefaultattr`.
//!
//! `rmalloc(fd, len)` maps the region of `fd` first if needed
//! ([`mapping::map_fd`]) and creates a shared heap in it when the region is empty
//! ([`crate::rmalloc::shared`]: a directory of per-process arenas, so processes on any
//! number of hosts allocate in one region at once). An arena that is full grows, or the
//! process claims another: doubling, by at most 256 MiB a step, and at least by what the
//! block needs; `ENOMEM` when the region cannot grow. Descriptors are resolved to their
//! mapping through a small cache keyed by the region's identity (device and inode, from
//! `statx` without a FUSE round trip), so repeated calls do not reconnect to the host agent.
//! A process hands its arenas back when it unmaps the region and when it exits.
//!
//! The fast path: every thread remembers the last descriptor it passed to
//! `rmalloc` with a duplicate of it and the heap, and the last mapping it
//! allocated or freed in. A call with the same descriptor must know that the number still
//! names the same open file (the application may have closed it and opened another region
//! under the same number). It reads two words of the mount's page of descriptor epochs
//! ([`super::descriptor_epochs`]), which the mount counts every open and every close of
//! the file in before answering them: while both are as they were when the thread last
//! checked, no system call is needed. When they moved, or the mount keeps no page, one
//! `kcmp` (`KCMP_FILE`, which compares the open file descriptions in the kernel
//! and never reaches the file system) checks. An `rfree` or `rmalloc_at` inside the
//! remembered mapping uses it directly. Both hold only while no region was unmapped in the
//! process since ([`crate::rmalloc::unmap_epoch`]); otherwise, or when `kcmp` is
//! unavailable, the call takes the path above.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::descriptor_epochs::{self, EpochPage, Seen};
use super::{ffi_int, ffi_ptr, set_errno};
use crate::error::{RegionsError, Result};
use crate::mapping::{self, Mapping};
use crate::rmalloc::Heap;
use crate::rmalloc::shared::{DIR_MAGIC, RegionMemory, SharedHeap, process_owner};

/// Growth granularity (the manager's chunk).
const GROW_UNIT: u64 = regions_proto::layout::CHUNK_SIZE;
/// Largest block rmalloc serves.
const MAX_BLOCK: usize = 1 << 40;

/// `RATTR_*` of regions.h, by value.
pub const RATTR_PERSISTENT: c_int = 1;
pub const RATTR_MULTIHOSTED: c_int = 2;
pub const RATTR_FIXVADDR: c_int = 3;
pub const RATTR_ONEWRITER: c_int = 4;
pub const RATTR_HOSTALLOC: c_int = 5;

/// Prefix of the per-thread default attributes regionfs serves on the mount
/// root (see regionfs `thread_defaults`).
pub const THREAD_XATTR_PREFIX: &str = "user.regions.thread.";

fn errno_err(errno: i32, message: String) -> RegionsError {
    RegionsError::Mapping { errno, message }
}

/// (device, inode) of an open descriptor, from the kernel's inode without
/// asking the file system (`AT_STATX_DONT_SYNC`).
fn identity(fd: c_int) -> Result<(u64, u64)> {
    if fd < 0 {
        return Err(errno_err(
            libc::EBADF,
            format!("{fd} is not a file descriptor"),
        ));
    }
    let st = super::statx_fd(fd, libc::STATX_INO)
        .map_err(|e| RegionsError::io(format!("statx of fd {fd}"), e))?;
    Ok((
        libc::makedev(st.stx_dev_major, st.stx_dev_minor),
        st.stx_ino,
    ))
}

/// The last descriptor a thread allocated with: what the fast path reads ([`FastFd`], kept
/// in step with the thread's copy of it), the duplicate `kcmp` compares `fd` with, and the
/// heap.
struct LastFd {
    fast: Cell<FastFd>,
    /// A duplicate of the descriptor taken when it was resolved.
    dup: OwnedFd,
    heap: Arc<SharedHeap>,
}

/// The last mapping a thread allocated or freed in.
struct LastMap {
    base: usize,
    mapping: Arc<Mapping>,
    heap: Arc<SharedHeap>,
    epoch: u64,
}

/// The arena a thread last allocated in, for `rmalloc_at` and `rfree` without a lookup: the
/// mapping's range, the arena's, and the unmap epoch they are valid for (an arena is handed
/// back only at unmap, which changes the epoch, or at exit).
#[derive(Clone, Copy)]
struct FastArena {
    map_base: usize,
    map_len: usize,
    arena_base: usize,
    arena_len: usize,
    epoch: u64,
    /// Allocations left before one takes the path through the shared heap (which looks for
    /// remote frees now and then).
    left: u32,
}

const NO_ARENA: FastArena = FastArena {
    map_base: 0,
    map_len: 0,
    arena_base: 0,
    arena_len: 0,
    epoch: 0,
    left: 0,
};

/// Allocations served from [`FastArena`] between two through the shared heap.
const FAST_ARENA_RUN: u32 = 256;

/// The last descriptor a thread allocated with, as the fast path reads it: a copy, without
/// reference counts or borrows.
#[derive(Clone, Copy)]
struct FastFd {
    fd: c_int,
    /// The inode `fd` is open on (as `statx` gives it, which is the FUSE node id).
    ino: u64,
    /// The mount's page of descriptor epochs, and what it said before `fd` was last checked.
    page: Option<&'static EpochPage>,
    seen: Option<Seen>,
    /// Base of the mapping of the heap.
    map_base: usize,
    /// The unmap epoch the heap and mapping are valid for.
    epoch: u64,
}

const NO_FD: FastFd = FastFd {
    fd: -1,
    ino: 0,
    page: None,
    seen: None,
    map_base: 0,
    epoch: 0,
};

thread_local! {
    static LAST_FD: RefCell<Option<LastFd>> = const { RefCell::new(None) };
    static FAST_FD: Cell<FastFd> = const { Cell::new(NO_FD) };
    static LAST_MAP: RefCell<Option<LastMap>> = const { RefCell::new(None) };
    static ARENA: Cell<FastArena> = const { Cell::new(NO_ARENA) };
}

/// Remembers the arena `heap` allocates in now as the thread's [`FastArena`].
fn remember_arena(m: &Mapping, heap: &SharedHeap, epoch: u64) {
    let Some(c) = heap.current() else { return };
    let _ = ARENA.try_with(|a| {
        a.set(FastArena {
            map_base: m.base() as usize,
            map_len: m.len(),
            arena_base: c.base() as usize,
            arena_len: c.len(),
            epoch,
            left: FAST_ARENA_RUN,
        })
    });
}

/// `rmalloc_at` from the thread's [`FastArena`]: None to take the path through the heap.
#[inline(always)]
fn alloc_arena(at: *const u8, len: usize) -> Option<Result<*mut u8>> {
    let mut f = ARENA.try_with(Cell::get).ok()?;
    if (at as usize).wrapping_sub(f.map_base) >= f.map_len
        || f.left == 0
        || f.epoch != crate::rmalloc::unmap_epoch_registered()
    {
        return None;
    }
    f.left -= 1;
    let _ = ARENA.try_with(|a| a.set(f));
    // SAFETY: the arena is this process's, mapped (no unmap since the epoch) and holds a heap.
    let heap = unsafe { Heap::view(f.arena_base as *mut u8, f.arena_len) };
    match heap.alloc(len) {
        // SAFETY: the block lies inside the arena.
        Ok(off) => Some(Ok(unsafe { heap.base().add(off as usize) })),
        Err(_) => None,
    }
}

/// `rfree` into the thread's [`FastArena`]: None to take the path through the heap (also
/// when the free fails, which changes nothing: that path says why, naming the region).
#[inline(always)]
fn free_arena(ptr: *const u8) -> Option<Result<()>> {
    let f = ARENA.try_with(Cell::get).ok()?;
    let off = (ptr as usize).wrapping_sub(f.arena_base);
    if off >= f.arena_len || f.epoch != crate::rmalloc::unmap_epoch_registered() {
        return None;
    }
    // SAFETY: as in alloc_arena.
    let heap = unsafe { Heap::view(f.arena_base as *mut u8, f.arena_len) };
    heap.free(off as u64).ok().map(Ok)
}

/// Cleared when `kcmp` fails (not built into the kernel, or refused by a
/// seccomp filter): the fast path is then off.
static KCMP_WORKS: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// `kcmp` checks made by this thread's `rmalloc(fd)` fast path so far.
    static DESCRIPTOR_CHECKS: Cell<u64> = const { Cell::new(0) };
}

/// How many times `rmalloc(fd, …)` on this thread has checked with a system call (`kcmp`)
/// that a descriptor still names the file it named (tests and benches: it should not on the
/// fast path).
pub fn descriptor_checks() -> u64 {
    DESCRIPTOR_CHECKS.try_with(Cell::get).unwrap_or(0)
}

/// Whether descriptors `a` and `b` of this process name the same open file
/// description (one `kcmp`; it never reaches the file system).
fn same_file(a: c_int, b: c_int) -> bool {
    let _ = DESCRIPTOR_CHECKS.try_with(|c| c.set(c.get() + 1));
    let pid = my_pid();
    // SAFETY: kcmp takes plain integers and only compares kernel objects.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid,
            pid,
            KCMP_FILE,
            a as libc::c_ulong,
            b as libc::c_ulong,
        )
    };
    if r < 0
        && matches!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENOSYS | libc::EPERM | libc::EACCES)
        )
    {
        KCMP_WORKS.store(false, Ordering::Relaxed);
    }
    r == 0
}

/// This process's id, cached (glibc's getpid is a system call); reset in a
/// forked child.
fn my_pid() -> libc::pid_t {
    static PID: AtomicI32 = AtomicI32::new(0);
    static ONCE: std::sync::Once = std::sync::Once::new();
    extern "C" fn forked() {
        PID.store(0, Ordering::Relaxed);
    }
    ONCE.call_once(|| {
        // SAFETY: registers a plain function without preconditions.
        unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    });
    match PID.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: getpid has no preconditions.
            let p = unsafe { libc::getpid() };
            PID.store(p, Ordering::Relaxed);
            p
        }
        p => p,
    }
}

/// `KCMP_FILE` of linux/kcmp.h.
const KCMP_FILE: libc::c_int = 0;

/// Remembers `fd` → `heap` (of mapping `m`, region `key`) for this thread's next `rmalloc`.
fn remember_fd(fd: c_int, key: (u64, u64), m: &Mapping, heap: &Arc<SharedHeap>, epoch: u64) {
    if !KCMP_WORKS.load(Ordering::Relaxed) {
        return;
    }
    let mut page = descriptor_epochs::page_for(fd);
    // Read before the duplicate is taken: a close or open after it moves the words.
    let seen = page.map(|p| p.seen(key.1));
    if seen.is_some_and(|s| s.ended()) {
        page = None;
    }
    // SAFETY: F_DUPFD_CLOEXEC duplicates the caller's open descriptor.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if dup < 0 {
        return;
    }
    // SAFETY: a fresh descriptor that we own.
    let dup = unsafe { OwnedFd::from_raw_fd(dup) };
    // The number may name another file by now (closed and reopened by another thread).
    if identity(dup.as_raw_fd()).ok() != Some(key) {
        return;
    }
    let _ = LAST_FD.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            let fast = FastFd {
                fd,
                ino: key.1,
                page,
                seen,
                map_base: m.base() as usize,
                epoch,
            };
            *l = Some(LastFd {
                fast: Cell::new(fast),
                dup,
                heap: Arc::clone(heap),
            });
            let _ = FAST_FD.try_with(|c| c.set(fast));
        }
    });
}

/// `rmalloc(fd)` from the thread's [`FastFd`] and [`FastArena`], without a system call:
/// None to take [`alloc_fast`].
#[inline(always)]
fn alloc_fd_arena(fd: c_int, len: usize) -> Option<Result<*mut u8>> {
    let f = FAST_FD.try_with(Cell::get).ok()?;
    if f.fd != fd
        || f.page?.seen(f.ino) != f.seen?
        || f.epoch != crate::rmalloc::unmap_epoch_registered()
    {
        return None;
    }
    alloc_arena(f.map_base as *const u8, len)
}

/// Whether the descriptor `e` remembers still names the same open file: no system call
/// while the mount's descriptor epochs are as they were at the last check, else one `kcmp`.
#[inline]
fn still_same_file(e: &LastFd) -> bool {
    let mut f = e.fast.get();
    let Some(page) = f.page else {
        return same_file(f.fd, e.dup.as_raw_fd());
    };
    let now = page.seen(f.ino);
    if f.seen == Some(now) {
        return true;
    }
    if !same_file(f.fd, e.dup.as_raw_fd()) {
        return false;
    }
    f.seen = Some(now);
    e.fast.set(f);
    let _ = FAST_FD.try_with(|c| c.set(f));
    true
}

/// The fast path of `rmalloc`: None to take the full path.
fn alloc_fast(fd: c_int, len: usize) -> Option<Result<*mut u8>> {
    LAST_FD
        .try_with(|l| {
            let l = l.try_borrow().ok()?;
            let e = l.as_ref()?;
            let f = e.fast.get();
            if f.fd != fd || f.epoch != crate::rmalloc::unmap_epoch() || !still_same_file(e) {
                return None;
            }
            let base = f.map_base as *const u8;
            Some(
                alloc_arena(base, len)
                    .or_else(|| alloc_fast_at(base, len))
                    .unwrap_or_else(|| e.heap.alloc(len)),
            )
        })
        .ok()
        .flatten()
}

/// The fast path of `rfree`: None to take the full path.
fn free_fast(ptr: *const u8) -> Option<Result<()>> {
    if let Some(r) = free_arena(ptr) {
        return Some(r);
    }
    LAST_MAP
        .try_with(|l| {
            let l = l.try_borrow().ok()?;
            let e = l.as_ref()?;
            let p = ptr as usize;
            if p < e.base
                || p >= e.base + e.mapping.len()
                || e.epoch != crate::rmalloc::unmap_epoch()
            {
                return None;
            }
            Some(e.heap.free(ptr))
        })
        .ok()
        .flatten()
}

/// Mappings by region identity (device, inode).
type MappingCache = Mutex<HashMap<(u64, u64), Arc<Mapping>>>;

fn cache() -> &'static MappingCache {
    static CACHE: OnceLock<MappingCache> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// The mapping of the region open as `fd`, mapping it if needed.
fn mapping_of_fd(fd: c_int) -> Result<Arc<Mapping>> {
    keyed_mapping_of_fd(fd).map(|(_, m)| m)
}

/// [`mapping_of_fd`], and the region's identity (device, inode).
fn keyed_mapping_of_fd(fd: c_int) -> Result<((u64, u64), Arc<Mapping>)> {
    let key = identity(fd)?;
    let cached = cache()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
        .cloned();
    if let Some(m) = cached {
        // Still mapped (not runmap'ed since)?
        if mapping::lookup(m.base()).is_some_and(|cur| Arc::ptr_eq(&cur, &m)) {
            return Ok((key, m));
        }
    }
    // SAFETY: `fd` is the caller's open descriptor (identity() checked it),
    // borrowed for the duration of this call only.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let m = mapping::map_fd(borrowed)?;
    let mut c = cache()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Drop entries of mappings that are gone.
    c.retain(|_, v| mapping::lookup(v.base()).is_some_and(|cur| Arc::ptr_eq(&cur, v)));
    c.insert(key, Arc::clone(&m));
    Ok((key, m))
}

fn writable(m: &Mapping) -> Result<()> {
    if m.writable() {
        Ok(())
    } else {
        Err(errno_err(
            libc::EBADF,
            format!(
                "region {} is mapped read-only; rmalloc, rfree and rsetroot need a descriptor \
                 opened O_RDWR",
                m.ino()
            ),
        ))
    }
}

/// A mapped region as the shared heap reaches it: arenas through the mapping, the directory
/// through the region's transport.
struct MappedRegion(Arc<Mapping>);

impl RegionMemory for MappedRegion {
    fn base(&self) -> *mut u8 {
        self.0.base()
    }

    fn mapped(&self) -> usize {
        self.0.len()
    }

    fn ensure_len(&self, len: u64) -> Result<()> {
        let m = &self.0;
        if m.len() as u64 >= len {
            return Ok(());
        }
        let len = len.next_multiple_of(GROW_UNIT) as usize;
        m.grow(len).map_err(|e| {
            RegionsError::NoMemory(format!(
                "region {} is full and cannot grow from {} to {len} bytes: {e}",
                m.ino(),
                m.len()
            ))
        })
    }

    fn cas(&self, off: u64, expected: u64, new: u64) -> Result<u64> {
        self.0.region().compare_and_swap(off, expected, new)
    }

    fn fetch_add(&self, off: u64, add: u64) -> Result<u64> {
        self.0.region().fetch_add(off, add)
    }

    fn read(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        let n = self.0.region().read_at(off, buf)?;
        if n < buf.len() {
            return Err(RegionsError::Invalid(format!(
                "region {}: read {n} of {} bytes at offset {off}: the region is shorter than its \
                 rmalloc directory says",
                self.0.ino(),
                buf.len()
            )));
        }
        Ok(())
    }

    fn publish(&self, off: u64, len: u64) -> Result<()> {
        // The caller passes a range inside the mapping.
        self.0
            .msync(self.0.base().wrapping_add(off as usize), len as usize)
    }

    fn invalidate(&self, off: u64, len: u64) -> Result<()> {
        self.0
            .clearcache(self.0.base().wrapping_add(off as usize), len as usize)
    }

    fn ino(&self) -> u64 {
        self.0.ino()
    }
}

/// Shared heaps of the mapped regions of this process, by mapping base.
type Heaps = HashMap<usize, (Arc<Mapping>, Arc<SharedHeap>)>;
type HeapRegistry = Mutex<Heaps>;

fn heaps() -> &'static HeapRegistry {
    static HEAPS: OnceLock<HeapRegistry> = OnceLock::new();
    HEAPS.get_or_init(|| {
        mapping::on_unmap(release_unmapped);
        // SAFETY: `release_all_at_exit` is a plain `extern "C" fn()` that never unwinds.
        if unsafe { libc::atexit(release_all_at_exit) } != 0 {
            tracing::warn!("rmalloc: cannot register the exit handler that hands arenas back");
        }
        Mutex::default()
    })
}

fn lock_heaps() -> std::sync::MutexGuard<'static, Heaps> {
    heaps()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The unmap hook: the heap of the mapping at `base` hands its arenas back.
fn release_unmapped(base: *mut u8, _len: usize) {
    let gone = lock_heaps().remove(&(base as usize));
    if let Some((m, heap)) = gone
        && let Err(e) = heap.release()
    {
        tracing::warn!(region = m.ino(), error = %e, "rmalloc: handing arenas back at unmap failed");
    }
}

extern "C" fn release_all_at_exit() {
    let all: Vec<(Arc<Mapping>, Arc<SharedHeap>)> = match heaps().try_lock() {
        Ok(mut h) => h.drain().map(|(_, v)| v).collect(),
        Err(_) => return,
    };
    for (m, heap) in all {
        if let Err(e) = heap.release() {
            tracing::warn!(region = m.ino(), error = %e, "rmalloc: handing arenas back at exit failed");
        }
    }
}

/// The shared heap of mapping `m`; with `create`, made in an empty region.
fn shared_heap(m: &Arc<Mapping>, create: bool) -> Result<Arc<SharedHeap>> {
    let base = m.base() as usize;
    if let Some((cur, h)) = lock_heaps().get(&base)
        && Arc::ptr_eq(cur, m)
    {
        return Ok(Arc::clone(h));
    }
    if create {
        writable(m)?;
    }
    let heap = Arc::new(SharedHeap::open(
        Box::new(MappedRegion(Arc::clone(m))),
        process_owner()?,
        create,
    )?);
    let mut all = lock_heaps();
    // Another thread may have opened it meanwhile: keep the first.
    match all.get(&base) {
        Some((cur, h)) if Arc::ptr_eq(cur, m) => Ok(Arc::clone(h)),
        _ => {
            all.insert(base, (Arc::clone(m), Arc::clone(&heap)));
            Ok(heap)
        }
    }
}

/// Allocates `len` bytes in the region of `fd` (see regions.h).
pub fn alloc_in(fd: c_int, len: usize) -> Result<*mut u8> {
    check_block(len)?;
    if let Some(r) = alloc_fd_arena(fd, len) {
        return r;
    }
    if let Some(r) = alloc_fast(fd, len) {
        return r;
    }
    let epoch = crate::rmalloc::unmap_epoch();
    let (key, m) = keyed_mapping_of_fd(fd)?;
    writable(&m)?;
    let heap = shared_heap(&m, true)?;
    let p = heap.alloc(len)?;
    remember_fd(fd, key, &m, &heap, epoch);
    remember_map(&m, &heap, epoch);
    remember_arena(&m, &heap, epoch);
    Ok(p)
}

/// Allocates `len` bytes in the mapped region that contains `at` (the address `rmap`
/// returned, or any address inside that mapping). Unlike [`alloc_in`] it needs no system
/// call on its fast path: the thread's last mapping is checked by address and unmap epoch.
pub fn alloc_at(at: *const u8, len: usize) -> Result<*mut u8> {
    check_block(len)?;
    if let Some(r) = alloc_arena(at, len) {
        return r;
    }
    if let Some(r) = alloc_fast_at(at, len) {
        return r;
    }
    let epoch = crate::rmalloc::unmap_epoch();
    let m = mapping::lookup(at).ok_or_else(|| {
        errno_err(
            libc::EINVAL,
            format!("{at:p} is not inside a mapped region: pass what rmap returned"),
        )
    })?;
    writable(&m)?;
    let heap = shared_heap(&m, true)?;
    let p = heap.alloc(len)?;
    remember_map(&m, &heap, epoch);
    remember_arena(&m, &heap, epoch);
    Ok(p)
}

fn check_block(len: usize) -> Result<()> {
    if len > MAX_BLOCK {
        return Err(RegionsError::NoMemory(format!(
            "{len} bytes is over rmalloc's block limit of {MAX_BLOCK} bytes"
        )));
    }
    Ok(())
}

/// The fast path of `rmalloc_at` after [`alloc_arena`] missed: None to take the full path.
fn alloc_fast_at(at: *const u8, len: usize) -> Option<Result<*mut u8>> {
    LAST_MAP
        .try_with(|l| {
            let l = l.try_borrow().ok()?;
            let e = l.as_ref()?;
            let a = at as usize;
            if a < e.base
                || a >= e.base + e.mapping.len()
                || e.epoch != crate::rmalloc::unmap_epoch()
                || !e.mapping.writable()
            {
                return None;
            }
            // The fast arena's run ended (or missed): look for remote frees now and then.
            e.heap.maybe_drain();
            let r = e.heap.alloc(len);
            if r.is_ok() {
                remember_arena(&e.mapping, &e.heap, e.epoch);
            }
            Some(r)
        })
        .ok()
        .flatten()
}

/// Remembers the heap of `m` as the thread's last (for `rfree` and `rmalloc_at`), valid while
/// no region is unmapped after `epoch`.
fn remember_map(m: &Arc<Mapping>, heap: &Arc<SharedHeap>, epoch: u64) {
    let _ = LAST_MAP.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = Some(LastMap {
                base: m.base() as usize,
                mapping: Arc::clone(m),
                heap: Arc::clone(heap),
                epoch,
            });
        }
    });
}

/// Frees a block returned by rmalloc.
pub fn free_ptr(ptr: *const u8) -> Result<()> {
    if let Some(r) = free_fast(ptr) {
        return r;
    }
    let epoch = crate::rmalloc::unmap_epoch();
    let m = mapping::lookup(ptr).ok_or_else(|| {
        RegionsError::Invalid(format!(
            "{ptr:p} is not inside a mapped region (not an rmalloc block)"
        ))
    })?;
    writable(&m)?;
    let heap = shared_heap(&m, false)?;
    heap.free(ptr)?;
    remember_map(&m, &heap, epoch);
    remember_arena(&m, &heap, epoch);
    Ok(())
}

/// Whether the region of `m` holds a shared heap (its directory's magic).
fn has_heap(m: &Arc<Mapping>) -> Result<bool> {
    // Through the region: the mapping may be older than the heap.
    let mut w = [0u8; 8];
    match MappedRegion(Arc::clone(m)).read(0, &mut w) {
        Ok(()) => Ok(u64::from_le_bytes(w) == DIR_MAGIC),
        // Shorter than a word: no heap.
        Err(_) if m.region().size() < 8 => Ok(false),
        Err(e) => Err(e),
    }
}

/// The shared heap of the mapped region that contains `at`, for inspection (tests, tools).
pub fn heap_at(at: *const u8) -> Result<Arc<SharedHeap>> {
    let m = mapping::lookup(at).ok_or_else(|| {
        errno_err(
            libc::EINVAL,
            format!("{at:p} is not inside a mapped region"),
        )
    })?;
    shared_heap(&m, false)
}

/// `void *rmalloc(int regionfd, size_t len)`.
#[unsafe(no_mangle)]
pub extern "C" fn rmalloc(regionfd: c_int, len: usize) -> *mut c_void {
    ffi_ptr(|| alloc_in(regionfd, len).map(|p| p.cast()))
}

/// `void *rmalloc_at(void *where, size_t len)`: `rmalloc` in the mapping containing `where`.
#[unsafe(no_mangle)]
pub extern "C" fn rmalloc_at(at: *mut c_void, len: usize) -> *mut c_void {
    ffi_ptr(|| alloc_at(at.cast(), len).map(|p| p.cast()))
}

/// `int rfree(void *ptr)`; `rfree(NULL)` does nothing.
#[unsafe(no_mangle)]
pub extern "C" fn rfree(ptr: *mut c_void) -> c_int {
    if ptr.is_null() {
        return 0;
    }
    ffi_int(|| free_ptr(ptr.cast()).map(|()| 0))
}

/// `int rsetroot(int regionfd, void *ptr)`: NULL clears the root.
#[unsafe(no_mangle)]
pub extern "C" fn rsetroot(regionfd: c_int, ptr: *mut c_void) -> c_int {
    ffi_int(|| {
        let m = mapping_of_fd(regionfd)?;
        writable(&m)?;
        let heap = shared_heap(&m, true)?;
        let off = if ptr.is_null() {
            None
        } else {
            let p = ptr as usize;
            let base = m.base() as usize;
            if p < base || p >= base + m.len() {
                return Err(RegionsError::Invalid(format!(
                    "root {ptr:p} is outside region {} mapped at {base:#x} ({} bytes)",
                    m.ino(),
                    m.len()
                )));
            }
            Some((p - base) as u64)
        };
        heap.set_root(off)?;
        Ok(0)
    })
}

/// `void *rgetroot(int regionfd)`: NULL with errno 0 when no root is set.
#[unsafe(no_mangle)]
pub extern "C" fn rgetroot(regionfd: c_int) -> *mut c_void {
    ffi_ptr(|| {
        let m = mapping_of_fd(regionfd)?;
        if !has_heap(&m)? {
            set_errno(0);
            return Ok(std::ptr::null_mut());
        }
        match shared_heap(&m, false)?.root()? {
            Some(off) => {
                if off >= m.len() as u64 {
                    // Another process grew the region past this mapping.
                    MappedRegion(Arc::clone(&m)).ensure_len(off + 1)?;
                }
                // SAFETY: the mapping covers `off` (checked, grown above).
                Ok(unsafe { m.base().add(off as usize) }.cast())
            }
            None => {
                set_errno(0);
                Ok(std::ptr::null_mut())
            }
        }
    })
}

/// The xattr name of a `RATTR_*`.
pub fn attr_name(attr: c_int) -> Option<&'static str> {
    Some(match attr {
        RATTR_PERSISTENT => "persistent",
        RATTR_MULTIHOSTED => "multihosted",
        RATTR_FIXVADDR => "fixvaddr",
        RATTR_ONEWRITER => "onewriter",
        RATTR_HOSTALLOC => "hostalloc",
        _ => return None,
    })
}

/// Sets (or with an empty value clears) the calling thread's default
/// attribute `attr` for regions it creates through the mount (env
/// `REGIONS_MOUNT`, default `/regions`).
pub fn set_default_attr(attr: c_int, value: &[u8]) -> Result<()> {
    let name = attr_name(attr).ok_or_else(|| {
        RegionsError::Invalid(format!(
            "unknown attribute {attr}: use RATTR_PERSISTENT, RATTR_MULTIHOSTED, RATTR_FIXVADDR, \
             RATTR_ONEWRITER or RATTR_HOSTALLOC"
        ))
    })?;
    let mount = crate::agent::default_mount();
    let path = CString::new(mount.as_os_str().as_bytes())
        .map_err(|_| RegionsError::Invalid("REGIONS_MOUNT contains a NUL byte".into()))?;
    let xname = CString::new(format!("{THREAD_XATTR_PREFIX}{name}"))
        .map_err(|_| RegionsError::Invalid("attribute name".into()))?;
    // SAFETY: path and name are NUL-terminated; value is a valid slice. The
    // call is made by this thread, whose id the FUSE request carries.
    let r = unsafe {
        libc::setxattr(
            path.as_ptr(),
            xname.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(RegionsError::io(
            format!(
                "setting {} on the regions mount {} (is regionfs mounted there? set REGIONS_MOUNT)",
                xname.to_string_lossy(),
                mount.display()
            ),
            e,
        ));
    }
    Ok(())
}

/// `int rsetdefaultattr(int attr, const char *val, int len)`.
#[unsafe(no_mangle)]
pub extern "C" fn rsetdefaultattr(attr: c_int, val: *const c_char, len: c_int) -> c_int {
    ffi_int(|| {
        let value: &[u8] = match len {
            0 => &[],
            n if n < 0 => {
                return Err(RegionsError::Invalid(format!("negative length {n}")));
            }
            _ if val.is_null() => {
                return Err(RegionsError::Invalid(
                    "NULL value with a non-zero length".into(),
                ));
            }
            // SAFETY: the caller passes `len` readable bytes at `val`.
            n => unsafe { std::slice::from_raw_parts(val.cast::<u8>(), n as usize) },
        };
        set_default_attr(attr, value).map(|()| 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn bad_arguments() {
        assert!(rmalloc(-1, 10).is_null());
        assert_eq!(errno(), libc::EBADF);
        assert_eq!(rfree(std::ptr::null_mut()), 0);
        let mut x = 0u64;
        assert_eq!(rfree((&mut x as *mut u64).cast()), -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(rsetdefaultattr(99, c"1".as_ptr(), 1), -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(rsetdefaultattr(RATTR_PERSISTENT, std::ptr::null(), 1), -1);
        assert_eq!(errno(), libc::EINVAL);
        assert!(rgetroot(-5).is_null());
        assert_eq!(errno(), libc::EBADF);
    }

    #[test]
    fn same_file_compares_open_files_not_numbers() {
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let g = std::fs::File::open("/proc/self/exe").unwrap();
        let d = f.try_clone().unwrap();
        assert!(same_file(f.as_raw_fd(), d.as_raw_fd()));
        assert!(!same_file(f.as_raw_fd(), g.as_raw_fd()));
        let stale = g.as_raw_fd();
        drop(g);
        assert!(!same_file(f.as_raw_fd(), stale));
        assert!(
            KCMP_WORKS.load(Ordering::Relaxed),
            "kcmp is unavailable here"
        );
    }

    #[test]
    fn identity_of_a_file() {
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        use std::os::fd::AsRawFd;
        let (dev, ino) = identity(f.as_raw_fd()).unwrap();
        let md = std::fs::metadata("/proc/self/exe").unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!((dev, ino), (md.dev(), md.ino()));
    }
}
