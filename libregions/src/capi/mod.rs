//! The C ABI of libregions (`libregions.so`, `libregions.a`, header
//! `libregions/include/regions.h`).
//!
//! Return convention (issue 5): 0 or a pointer on success, -1 or NULL with
//! `errno` set on failure. Every exported function runs its body through
//! [`ffi_int`] or [`ffi_ptr`], which turn a [`crate::RegionsError`] into its
//! errno and a Rust panic into `EIO` (a panic must never unwind into C).
//!
//! Submodules, one per owner: `alloc` (rmalloc, rmalloc_at, rfree, rsetroot, rgetroot,
//! rsetdefaultattr), `map` (rmap, runmap, rprefetch, rmarkdirty, rclearcache,
//! rmsync) and `sync` (barriers, mutexes, doorbells).

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::Result;

pub mod alloc;
mod descriptor_epochs;
pub mod map;
pub mod sync;

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: i32) {
    // SAFETY: `__errno_location` returns a valid pointer to the calling
    // thread's errno for the lifetime of the thread.
    unsafe { *libc::__errno_location() = e };
}

/// `statx` of open descriptor `fd` itself for `mask`, from the kernel's inode without asking
/// the file system (`AT_STATX_DONT_SYNC`).
pub(crate) fn statx_fd(fd: c_int, mask: u32) -> std::io::Result<libc::statx> {
    // SAFETY: statx writes into `st`, a properly sized out parameter; the empty path with
    // AT_EMPTY_PATH names `fd` itself.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            mask,
            &mut st,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// Environment variable that makes every failing C call print its error
/// (what failed and why) to stderr; C callers otherwise see only `errno`.
pub const DEBUG_ENV: &str = "REGIONS_DEBUG";

fn report(e: &crate::RegionsError) {
    static VERBOSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let verbose = *VERBOSE
        .get_or_init(|| std::env::var_os(DEBUG_ENV).is_some_and(|v| !v.is_empty() && v != "0"));
    if verbose {
        eprintln!("libregions: {e} (errno {})", e.errno());
    }
    tracing::debug!(error = %e, errno = e.errno(), "libregions C call failed");
}

/// Runs `f` for a C function returning `int`: its value on success, -1 with
/// `errno` set on an error or a panic.
pub(crate) fn ffi_int(f: impl FnOnce() -> Result<i32>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            report(&e);
            set_errno(e.errno());
            -1
        }
        Err(_) => {
            set_errno(libc::EIO);
            -1
        }
    }
}

/// Runs `f` for a C function returning a pointer: the pointer on success,
/// NULL with `errno` set on an error or a panic.
pub(crate) fn ffi_ptr(f: impl FnOnce() -> Result<*mut c_void>) -> *mut c_void {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            report(&e);
            set_errno(e.errno());
            std::ptr::null_mut()
        }
        Err(_) => {
            set_errno(libc::EIO);
            std::ptr::null_mut()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RegionsError;

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn ffi_int_passes_values_and_sets_errno() {
        assert_eq!(ffi_int(|| Ok(7)), 7);
        assert_eq!(ffi_int(|| Err(RegionsError::Invalid("x".into()))), -1);
        assert_eq!(errno(), libc::EINVAL);
    }

    #[test]
    fn ffi_ptr_catches_panics() {
        let mut x = 1u8;
        let p = &mut x as *mut u8 as *mut c_void;
        assert_eq!(ffi_ptr(|| Ok(p)), p);
        let r = ffi_ptr(|| panic!("boom"));
        assert!(r.is_null());
        assert_eq!(errno(), libc::EIO);
    }
}
