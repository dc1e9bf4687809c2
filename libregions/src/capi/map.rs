//! `rmap`, `runmap`, `rprefetch`, `rmarkdirty`, `rclearcache`, `rmsync` over
//! [`crate::mapping`].

use std::ffi::{c_int, c_void};
use std::os::fd::BorrowedFd;

use super::{ffi_int, ffi_ptr};
use crate::error::{RegionsError, Result};
use crate::mapping::{self, Mapping};

fn borrow_fd(fd: c_int) -> Result<BorrowedFd<'static>> {
    if fd < 0 {
        return Err(RegionsError::Mapping {
            errno: libc::EBADF,
            message: format!("{fd} is not a file descriptor"),
        });
    }
    // SAFETY: the descriptor is the caller's open region fd, used only for the duration of
    // the call (the C contract of rmap); a closed one makes the calls fail with EBADF.
    Ok(unsafe { BorrowedFd::borrow_raw(fd) })
}

fn mapping_of(addr: *const c_void) -> Result<std::sync::Arc<Mapping>> {
    mapping::lookup(addr.cast()).ok_or_else(|| RegionsError::Mapping {
        errno: libc::EINVAL,
        message: format!("{addr:p} is not inside a mapped region (rmap it first)"),
    })
}

/// Maps the whole region of `regionfd`; at its fixed address if FIXVADDR.
#[unsafe(no_mangle)]
pub extern "C" fn rmap(regionfd: c_int) -> *mut c_void {
    ffi_ptr(|| {
        let m = mapping::map_fd(borrow_fd(regionfd)?)?;
        Ok(m.base().cast())
    })
}

/// Unmaps the mapping containing `addr` (dirty pages are written back first).
#[unsafe(no_mangle)]
pub extern "C" fn runmap(addr: *mut c_void) -> c_int {
    ffi_int(|| mapping::unmap(addr.cast()).map(|()| 0))
}

/// Fetches `[addr, addr + len)`; waits when `sync`.
#[unsafe(no_mangle)]
pub extern "C" fn rprefetch(addr: *mut c_void, len: usize, sync: bool) -> c_int {
    ffi_int(|| {
        mapping_of(addr)?
            .prefetch(addr.cast(), len, sync)
            .map(|()| 0)
    })
}

/// Marks `[addr, addr + len)` dirty; with `zero`, missing pages become zeros unfetched.
#[unsafe(no_mangle)]
pub extern "C" fn rmarkdirty(addr: *mut c_void, len: usize, zero: bool) -> c_int {
    ffi_int(|| {
        mapping_of(addr)?
            .markdirty(addr.cast(), len, zero)
            .map(|()| 0)
    })
}

/// Drops the cached pages of `[addr, addr + len)` (dirty ones written back first).
#[unsafe(no_mangle)]
pub extern "C" fn rclearcache(addr: *mut c_void, len: usize) -> c_int {
    ffi_int(|| mapping_of(addr)?.clearcache(addr.cast(), len).map(|()| 0))
}

/// Writes the dirty pages of `[addr, addr + len)` back. `flags` as for msync(2): `MS_SYNC`
/// returns once they are written (and once a background write-back of the range has
/// finished); `MS_ASYNC` alone queues the write-back and returns at once.
#[unsafe(no_mangle)]
pub extern "C" fn rmsync(addr: *mut c_void, len: usize, flags: c_int) -> c_int {
    ffi_int(|| {
        let known = libc::MS_SYNC | libc::MS_ASYNC | libc::MS_INVALIDATE;
        if flags & !known != 0 {
            return Err(RegionsError::Mapping {
                errno: libc::EINVAL,
                message: format!("unknown rmsync flags {flags:#x}"),
            });
        }
        if flags & libc::MS_SYNC != 0 && flags & libc::MS_ASYNC != 0 {
            return Err(RegionsError::Mapping {
                errno: libc::EINVAL,
                message: "rmsync with both MS_SYNC and MS_ASYNC: choose one".into(),
            });
        }
        let m = mapping_of(addr)?;
        if flags & libc::MS_ASYNC != 0 {
            m.msync_async(addr.cast(), len).map(|()| 0)
        } else {
            m.msync(addr.cast(), len).map(|()| 0)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn calls_on_unmapped_addresses_fail_with_einval() {
        let mut x = 0u8;
        let p = (&mut x as *mut u8).cast::<c_void>();
        assert_eq!(rprefetch(p, 1, true), -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(rmsync(p, 1, libc::MS_SYNC), -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(rclearcache(p, 1), -1);
        assert_eq!(rmarkdirty(p, 1, true), -1);
        assert_eq!(runmap(p), -1);
        assert_eq!(errno(), libc::EINVAL);
        assert!(rmap(-1).is_null());
        assert_eq!(errno(), libc::EBADF);
    }
}
