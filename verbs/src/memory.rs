//! Memory the device may touch: registrations of memory someone else maps (the daemon's pool
//! chunks) and buffers of this crate's own (the client's bounce buffers).

use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::device::ProtectionDomain;
use crate::error::{Result, VerbsError};

/// What peers holding a registration's remote key may do to its memory (the local device may
/// always read and write it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub remote_read: bool,
    pub remote_write: bool,
    pub remote_atomic: bool,
    /// Memory windows may be bound to the registration (which grant remote access of
    /// their own, whatever the fields above say).
    pub bind_windows: bool,
}

impl Access {
    /// Local use only (bounce buffers).
    pub const LOCAL: Access = Access {
        remote_read: false,
        remote_write: false,
        remote_atomic: false,
        bind_windows: false,
    };
    /// Remote READ, WRITE and atomics (memory that peers access one-sided).
    pub const REMOTE: Access = Access {
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
        bind_windows: false,
    };
    /// No remote access of its own: only through the memory windows bound to it.
    pub const WINDOWS_ONLY: Access = Access {
        remote_read: false,
        remote_write: false,
        remote_atomic: false,
        bind_windows: true,
    };
    /// Reads only.
    pub const READ: Access = Access {
        remote_read: true,
        remote_write: false,
        remote_atomic: false,
        bind_windows: false,
    };

    fn flags(self) -> libc::c_int {
        let mut f = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.remote_read {
            f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        if self.remote_write {
            f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.remote_atomic {
            f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        }
        if self.bind_windows {
            f |= ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0;
        }
        libc::c_int::try_from(f).unwrap_or(libc::c_int::MAX)
    }

    /// The remote rights as memory window access flags.
    pub(crate) fn window_flags(self) -> libc::c_uint {
        let mut f = 0;
        if self.remote_read {
            f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        if self.remote_write {
            f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.remote_atomic {
            f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        }
        f
    }
}

/// A registered range of memory: the device reaches it by its keys until the value is dropped
/// (`ibv_dereg_mr`, after which the device no longer touches it).
#[derive(Debug)]
pub struct Registration {
    mr: *mut ffi::ibv_mr,
    addr: u64,
    len: usize,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: an MR handle may be used and deregistered from any thread (libibverbs is thread
// safe); the struct only reads fields copied at construction.
unsafe impl Send for Registration {}
// SAFETY: see `Send`.
unsafe impl Sync for Registration {}

impl Registration {
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// The range must stay mapped, to the same pages, until the registration is dropped, and
    /// whoever else uses the memory must accept that the device (and peers with the remote key,
    /// as `access` allows) reads and writes it at any time in between, as with any shared
    /// memory.
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Registration> {
        if len == 0 {
            return Err(VerbsError::Invalid("a registration of 0 bytes".into()));
        }
        // SAFETY: a live PD; the caller guarantees the range stays mapped while registered.
        let mr = unsafe { ffi::ibv_reg_mr(pd.raw(), addr.cast(), len, access.flags()) };
        if mr.is_null() {
            return Err(VerbsError::last(format!(
                "ibv_reg_mr of {len} bytes at {addr:p}"
            )));
        }
        Ok(Registration {
            mr,
            addr: addr as u64,
            len,
            _pd: Arc::clone(pd),
        })
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_mr {
        self.mr
    }

    /// The key local work requests name this memory by.
    pub fn lkey(&self) -> u32 {
        // SAFETY: `mr` is live until Drop; the key is a plain field.
        unsafe { (*self.mr).lkey }
    }

    /// The key peers name this memory by in one-sided operations.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as `lkey`.
        unsafe { (*self.mr).rkey }
    }

    /// The address of the first registered byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once; afterwards the device no longer
        // touches the memory (and its keys are refused).
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            // Deregistration fails while memory windows are still bound to the region (their
            // owners drop them first). The MR (and its pinned pages) is then leaked, not
            // freed.
            eprintln!("regions-verbs: ibv_dereg_mr failed with errno {rc}; leaking the MR");
        }
    }
}

/// Memory of this crate's own (anonymous pages), registered for local use: the source of
/// WRITEs and the destination of READs and atomics' old values.
#[derive(Debug)]
pub struct RegisteredBuffer {
    // Dropped before the pages are unmapped (field order is drop order, and Drop unmaps).
    registration: Option<Registration>,
    base: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned memory; access to its bytes goes through `&self`/`&mut self`
// (shared or exclusive borrows), and the device writes to it only during
// `QueuePair::execute`, which holds `&mut self`.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: see `Send`.
unsafe impl Sync for RegisteredBuffer {}

impl RegisteredBuffer {
    /// `len` bytes (rounded up to whole pages), registered with `pd`.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<RegisteredBuffer> {
        let len = len.max(1).next_multiple_of(4096);
        // SAFETY: a fresh private anonymous mapping at an address the kernel picks; it
        // overlaps nothing, and the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(VerbsError::last(format!(
                "mmap of a {len}-byte RDMA buffer"
            )));
        }
        let base = base.cast::<u8>();
        let mut buffer = RegisteredBuffer {
            registration: None,
            base,
            len,
        };
        // SAFETY: the mapping is owned by `buffer` and unmapped only after the registration
        // is dropped (Drop below).
        buffer.registration =
            Some(unsafe { Registration::register(pd, base, len, Access::LOCAL)? });
        Ok(buffer)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` mapped bytes owned by self; the device writes them only while
        // `execute` holds `&mut self`, so no write overlaps this shared borrow.
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, with an exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.registration.as_ref().map_or(0, Registration::lkey)
    }

    pub(crate) fn addr(&self) -> u64 {
        self.base as u64
    }
}

/// Local memory work requests may name: a [`RegisteredBuffer`], or a caller's buffer
/// registered for the time of a request ([`RegisteredSlice`]). Only this crate implements it.
pub trait LocalMemory: private::Sealed {
    /// Address of the first byte.
    fn base(&self) -> u64;
    /// Bytes from [`LocalMemory::base`] requests may use.
    fn size(&self) -> usize;
    /// The local key of its registration.
    fn local_key(&self) -> u32;
}

mod private {
    pub trait Sealed {}
    impl Sealed for super::RegisteredBuffer {}
    impl Sealed for super::RegisteredSlice<'_> {}
}

impl LocalMemory for RegisteredBuffer {
    fn base(&self) -> u64 {
        self.addr()
    }

    fn size(&self) -> usize {
        self.len
    }

    fn local_key(&self) -> u32 {
        self.lkey()
    }
}

/// A caller's buffer registered for as long as this value lives (it holds the exclusive
/// borrow, so the memory stays put and nothing else touches it meanwhile; dropping it
/// deregisters, after which the device no longer writes it). Large transfers read straight
/// into the caller's buffer this way instead of through a bounce buffer and a copy.
#[derive(Debug)]
pub struct RegisteredSlice<'a> {
    registration: Registration,
    _buf: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> RegisteredSlice<'a> {
    /// Registers `buf` (not empty) with `pd` for local reads and writes.
    pub fn new(pd: &Arc<ProtectionDomain>, buf: &'a mut [u8]) -> Result<RegisteredSlice<'a>> {
        // SAFETY: `buf` is borrowed exclusively for 'a, which this value does not outlive, and
        // the registration is dropped with it: the range stays mapped while registered, and
        // the device writes it only during requests that hold `&mut self`.
        let registration =
            unsafe { Registration::register(pd, buf.as_mut_ptr(), buf.len(), Access::LOCAL)? };
        Ok(RegisteredSlice {
            registration,
            _buf: std::marker::PhantomData,
        })
    }
}

impl LocalMemory for RegisteredSlice<'_> {
    fn base(&self) -> u64 {
        self.registration.addr()
    }

    fn size(&self) -> usize {
        self.registration.len()
    }

    fn local_key(&self) -> u32 {
        self.registration.lkey()
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        // Deregister first: after that the device no longer writes the pages.
        drop(self.registration.take());
        // SAFETY: unmapping the mapping made in `new`, once, after its registration is gone.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
