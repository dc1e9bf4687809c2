//! A pool's address window: virtual addresses reserved `PROT_NONE`, into which segment memfds
//! are mapped chunk by chunk (docs/ARCHITECTURE.md, "daemon").
//!
//! The window never touches memory by itself except through the `unsafe` primitives below,
//! whose callers (the chunk table in [`crate::pools`]) guarantee that the bytes are mapped and
//! stay mapped for the duration of the access. No Rust reference into the window is ever
//! created except the [`AtomicU64`] of an atomic operation; bytes are moved with raw copies or
//! by the kernel (send/recv), so concurrent accesses by other connections or by local
//! processes that map the same memfd are plain shared-memory races, as with RDMA.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use crate::error::{DaemonError, Result};

/// Size of a page: every map and unmap is page aligned.
const PAGE: u64 = 4096;

/// A reserved range of virtual addresses.
#[derive(Debug)]
pub struct Window {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the window is a range of this process's address space owned by the value; it holds
// no thread-affine state. Accesses to the memory behind it go through `unsafe` methods whose
// callers synchronise (see the module documentation).
unsafe impl Send for Window {}
// SAFETY: see `Send`; `&Window` only hands out raw addresses and performs raw accesses under
// the callers' synchronisation.
unsafe impl Sync for Window {}

impl Window {
    /// Reserves `len` bytes of address space (`PROT_NONE`, no memory behind it).
    pub fn reserve(len: u64) -> Result<Window> {
        let size = usize::try_from(len)
            .ok()
            .filter(|n| *n > 0 && len.is_multiple_of(PAGE))
            .ok_or_else(|| {
                DaemonError::Invalid(format!(
                    "a pool window of {len} bytes must be a positive multiple of {PAGE}"
                ))
            })?;
        // Raw mmap, not memmap2: a PROT_NONE + MAP_NORESERVE reservation of address space,
        // which memmap2 cannot make (its maps are always accessible), and whose pages
        // `map`/`unmap` replace with MAP_FIXED.
        // SAFETY: a new anonymous mapping at an address the kernel chooses; it overlaps no
        // existing Rust object, and the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(DaemonError::sys(
                format!("cannot reserve a pool window of {len} bytes (mmap PROT_NONE)"),
                std::io::Error::last_os_error(),
            ));
        }
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| DaemonError::Invalid("mmap returned a null window".into()))?;
        Ok(Window { base, len: size })
    }

    /// Bytes reserved.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the window is empty (never: [`Window::reserve`] refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that `[offset, offset + len)` is a page-aligned, non-empty part of the window.
    fn check_pages(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset.checked_add(len);
        if len == 0
            || !offset.is_multiple_of(PAGE)
            || !len.is_multiple_of(PAGE)
            || end.is_none_or(|end| end > self.len())
        {
            return Err(DaemonError::Invalid(format!(
                "window range {offset:#x}+{len:#x} is not page aligned inside a window of {:#x} \
                 bytes",
                self.len
            )));
        }
        Ok(())
    }

    /// The address of byte `offset` (`offset <= len`), or `None` past the end.
    pub fn addr(&self, offset: u64) -> Option<*mut u8> {
        let at = usize::try_from(offset).ok().filter(|at| *at <= self.len)?;
        // SAFETY: `at <= len`, so the result stays inside (or one past the end of) the
        // reservation made by `reserve`.
        Some(unsafe { self.base.as_ptr().add(at) })
    }

    /// Maps `len` bytes of `fd` from `file_offset` at `offset` of the window (`MAP_SHARED`,
    /// read + write), replacing whatever was mapped there.
    ///
    /// # Safety
    ///
    /// No other thread may access `[offset, offset + len)` of the window during the call (the
    /// caller holds the chunk table's write locks for those chunks).
    pub unsafe fn map(
        &self,
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
        file_offset: u64,
    ) -> Result<()> {
        self.check_pages(offset, len)?;
        let file_offset = libc::off_t::try_from(file_offset)
            .ok()
            .filter(|o| (*o as u64).is_multiple_of(PAGE))
            .ok_or_else(|| DaemonError::Invalid(format!("bad file offset {file_offset:#x}")))?;
        let addr = self.addr(offset).ok_or_else(|| {
            DaemonError::Invalid(format!("window offset {offset:#x} is out of range"))
        })?;
        // Raw mmap, not memmap2: MAP_FIXED at an address inside the reservation (memmap2 maps
        // only where the kernel chooses).
        // SAFETY: the range lies inside our reservation (checked) and, by the caller's
        // contract, nobody accesses it meanwhile; MAP_FIXED replaces only those pages.
        let ptr = unsafe {
            libc::mmap(
                addr.cast(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                file_offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(DaemonError::sys(
                format!("cannot map a segment at window offset {offset:#x} (+{len:#x})"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Puts `PROT_NONE` anonymous memory back at `[offset, offset + len)`, dropping whatever
    /// segment was mapped there.
    ///
    /// # Safety
    ///
    /// As for [`Window::map`]: no other thread may access the range during the call.
    pub unsafe fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.check_pages(offset, len)?;
        let addr = self.addr(offset).ok_or_else(|| {
            DaemonError::Invalid(format!("window offset {offset:#x} is out of range"))
        })?;
        // Raw mmap, not memmap2: PROT_NONE with MAP_FIXED over part of the reservation.
        // SAFETY: inside our reservation (checked); nobody accesses it (caller's contract).
        let ptr = unsafe {
            libc::mmap(
                addr.cast(),
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(DaemonError::sys(
                format!("cannot unmap window offset {offset:#x} (+{len:#x})"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Copies `src` into the window at `offset`.
    ///
    /// # Safety
    ///
    /// `[offset, offset + src.len())` must be inside the window and mapped read-write for the
    /// duration of the call (the caller holds the chunk table's read locks).
    pub unsafe fn copy_in(&self, offset: u64, src: &[u8]) {
        let Some(dst) = self.addr(offset) else { return };
        // SAFETY: the destination is mapped and writable (caller's contract) and cannot
        // overlap `src`, a Rust slice, which never points into the window.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }

    /// Copies bytes of the window at `offset` into `dst`.
    ///
    /// # Safety
    ///
    /// As for [`Window::copy_in`].
    pub unsafe fn copy_out(&self, offset: u64, dst: &mut [u8]) {
        let Some(src) = self.addr(offset) else { return };
        // SAFETY: the source is mapped (caller's contract); `dst` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
    }

    /// The 64-bit word at `offset`, for atomic operations; `None` when `offset` is not 8-byte
    /// aligned or not inside the window.
    ///
    /// # Safety
    ///
    /// The word must be mapped read-write for as long as the returned reference is used (the
    /// caller holds the chunk table's read lock and drops the reference before releasing it).
    pub unsafe fn word(&self, offset: u64) -> Option<&AtomicU64> {
        if !offset.is_multiple_of(8) || offset.checked_add(8)? > self.len() {
            return None;
        }
        let ptr = self.addr(offset)?;
        // SAFETY: 8-byte aligned (page-aligned base + aligned offset), inside the window,
        // mapped (caller's contract); all concurrent accesses to region words that race with
        // atomics are atomics too (other connections, local clients' CPU atomics).
        Some(unsafe { AtomicU64::from_ptr(ptr.cast::<u64>()) })
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the reservation made in `reserve`, including segment
        // mappings placed inside it; the value is being dropped, so no access remains.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
        if rc != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "munmap of a pool window failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::pools::segment::Segment;

    const CHUNK: u64 = 128 << 10;

    #[test]
    fn reserve_rejects_bad_sizes() {
        assert!(Window::reserve(0).is_err());
        assert!(Window::reserve(100).is_err());
        let w = Window::reserve(4 * CHUNK).unwrap();
        assert_eq!(w.len(), 4 * CHUNK);
        assert!(w.addr(4 * CHUNK).is_some());
        assert!(w.addr(4 * CHUNK + 1).is_none());
    }

    #[test]
    fn map_copy_unmap() {
        let w = Window::reserve(4 * CHUNK).unwrap();
        let seg = Segment::create(7).unwrap();
        seg.grow_to(2 * CHUNK).unwrap();
        // SAFETY: single-threaded test; nothing else touches the window.
        unsafe {
            w.map(CHUNK, CHUNK, seg.as_fd(), CHUNK).unwrap();
            w.copy_in(CHUNK + 10, b"hello");
            let mut out = [0u8; 5];
            w.copy_out(CHUNK + 10, &mut out);
            assert_eq!(&out, b"hello");
            let word = w.word(CHUNK + 64).unwrap();
            assert_eq!(word.fetch_add(5, Ordering::SeqCst), 0);
            assert_eq!(word.load(Ordering::SeqCst), 5);
            assert!(w.word(CHUNK + 3).is_none());
        }
        // The bytes live in the segment at the file offset.
        let mut out = [0u8; 5];
        seg.read_at(CHUNK + 10, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        // SAFETY: as above.
        unsafe {
            w.unmap(CHUNK, CHUNK).unwrap();
            // Mapping again shows the same bytes: they live in the memfd, not the window.
            w.map(3 * CHUNK, CHUNK, seg.as_fd(), CHUNK).unwrap();
            let mut again = [0u8; 5];
            w.copy_out(3 * CHUNK + 10, &mut again);
            assert_eq!(&again, b"hello");
        }
    }

    #[test]
    fn bad_ranges_are_refused() {
        let w = Window::reserve(2 * CHUNK).unwrap();
        let seg = Segment::create(1).unwrap();
        seg.grow_to(CHUNK).unwrap();
        // SAFETY: single-threaded test; nothing else touches the window.
        unsafe {
            assert!(w.map(CHUNK, 2 * CHUNK, seg.as_fd(), 0).is_err());
            assert!(w.map(100, CHUNK, seg.as_fd(), 0).is_err());
            assert!(w.map(0, CHUNK, seg.as_fd(), 100).is_err());
            assert!(w.map(0, 0, seg.as_fd(), 0).is_err());
            assert!(w.unmap(u64::MAX - 4095, 4096).is_err());
        }
    }
}
