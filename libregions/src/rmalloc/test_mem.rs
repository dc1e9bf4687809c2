//! Test support: anonymous shared memory holding a heap, unmapped (and announced with
//! [`unmapping`]) on drop.

use std::ptr;

use super::{Heap, unmapping};

/// Anonymous shared memory for a heap.
pub(super) struct Mem {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: plain memory, used through a Heap.
unsafe impl Send for Mem {}
// SAFETY: as above.
unsafe impl Sync for Mem {}

impl Mem {
    pub(super) fn new(len: usize) -> Mem {
        // Raw mmap, not memmap2: MAP_SHARED anonymous memory (a forked child's writes must
        // reach the parent, thread_cache's fork test) with MAP_NORESERVE; memmap2's anonymous
        // maps are MAP_PRIVATE.
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
    pub(super) fn heap(&self, len: usize) -> Heap {
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
