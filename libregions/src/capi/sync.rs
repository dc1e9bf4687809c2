//! C functions of barriers, mutexes and doorbells ([`crate::sync`]): 0 on success (the ring
//! count for `rbell_wait`), -1 with `errno` on failure. Names are NUL-terminated UTF-8.

use std::ffi::{CStr, c_char, c_int, c_long};

use super::ffi_int;
use crate::error::{RegionsError, Result};
use crate::sync;

/// The name behind `name`, or `EINVAL`.
///
/// # Safety
/// `name` is NULL or points to a NUL-terminated string that stays valid during the call.
unsafe fn name_of<'a>(name: *const c_char) -> Result<&'a str> {
    if name.is_null() {
        return Err(RegionsError::Invalid("sync object name is NULL".into()));
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| RegionsError::Invalid("sync object name is not UTF-8".into()))
}

/// Creates barrier `name` of `n` parties.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbarrier_init(name: *const c_char, n: c_int) -> c_int {
    ffi_int(|| {
        // SAFETY: forwarded contract.
        let name = unsafe { name_of(name) }?;
        let n = u32::try_from(n)
            .map_err(|_| RegionsError::Invalid(format!("barrier of {n} parties")))?;
        sync::barrier_init(name, n).map(|()| 0)
    })
}

/// Waits at barrier `name` until its round completes.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbarrier_wait(name: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    ffi_int(|| sync::barrier_wait(unsafe { name_of(name) }?).map(|_| 0))
}

/// Creates mutex `name`.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rmutex_init(name: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    ffi_int(|| sync::mutex_init(unsafe { name_of(name) }?).map(|()| 0))
}

/// Locks mutex `name` for the calling thread.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rmutex_lock(name: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    ffi_int(|| sync::mutex_lock(unsafe { name_of(name) }?).map(|()| 0))
}

/// Unlocks mutex `name` (held by the calling thread).
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rmutex_unlock(name: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    ffi_int(|| sync::mutex_unlock(unsafe { name_of(name) }?).map(|()| 0))
}

/// Creates doorbell `name`.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbell_init(name: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    ffi_int(|| sync::bell_init(unsafe { name_of(name) }?).map(|()| 0))
}

/// Rings doorbell `name`.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbell_ring(name: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    ffi_int(|| sync::bell_ring(unsafe { name_of(name) }?).map(|()| 0))
}

/// Waits for a ring of `name` since this process's last wait; returns the ring count.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbell_wait(name: *const c_char) -> c_long {
    let mut count: c_long = 0;
    let rc = ffi_int(|| {
        // SAFETY: forwarded contract.
        count = sync::bell_wait(unsafe { name_of(name) }?)? as c_long;
        Ok(0)
    });
    if rc < 0 { -1 } else { count }
}

/// Deletes barrier, mutex or doorbell `name`.
///
/// # Safety
/// `name` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdelete(name: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    ffi_int(|| sync::delete(unsafe { name_of(name) }?).map(|()| 0))
}

#[cfg(test)]
mod tests {
    use super::super::set_errno;
    use super::*;

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn bad_names_and_counts_are_einval() {
        // SAFETY: NULL and a valid literal.
        unsafe {
            assert_eq!(rmutex_lock(std::ptr::null()), -1);
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(rbarrier_init(c"b".as_ptr(), -1), -1);
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(rbell_wait(c"\xff".as_ptr()), -1);
            assert_eq!(errno(), libc::EINVAL);
        }
        set_errno(0);
    }
}
