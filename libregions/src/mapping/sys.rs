//! The system calls of the mapping layer, each wrapped once with its safety argument. Every
//! function here works on address ranges that the mapping layer owns: the fixed-address window
//! it reserved, or ranges it reserved itself with [`reserve_anywhere`].
//!
//! The `mmap` calls here stay raw rather than going through `memmap2`: each is a `PROT_NONE`
//! reservation, or a `MAP_FIXED` (or `MAP_FIXED_NOREPLACE`) map at an address inside one (the
//! cluster-wide fixed address of a FIXVADDR region, or the pages a userfaultfd serves), none of
//! which memmap2 can make: it maps only accessible memory at an address the kernel picks.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The page size the mapping layer works in.
pub const PAGE: usize = 4096;

fn check_map(ret: *mut libc::c_void, what: &str) -> io::Result<*mut u8> {
    if ret == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(ret.cast())
}

/// Reserves `[start, start + len)` `PROT_NONE` + `MAP_NORESERVE`, failing (rather than
/// replacing anything) when part of it is already mapped.
pub fn reserve_fixed_noreplace(start: usize, len: usize) -> io::Result<()> {
    // Raw: PROT_NONE, MAP_NORESERVE and MAP_FIXED_NOREPLACE at the region's fixed address.
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the new one is
    // inaccessible memory that nothing references yet.
    let ret = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE
                | libc::MAP_ANONYMOUS
                | libc::MAP_NORESERVE
                | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    let got = check_map(ret, "reserving an address range")?;
    if got as usize != start {
        // Old kernels ignore the flag and treat the address as a hint.
        // SAFETY: `got` is the mapping just created, of `len` bytes, not used by anything.
        unsafe { libc::munmap(got.cast(), len) };
        return Err(io::Error::from_raw_os_error(libc::EEXIST));
    }
    Ok(())
}

/// Reserves `len` bytes anywhere (outside the fixed window, which is taken).
pub fn reserve_anywhere(len: usize) -> io::Result<*mut u8> {
    // Raw: a PROT_NONE + MAP_NORESERVE reservation (memmap2 maps only accessible memory).
    // SAFETY: a fresh inaccessible mapping at an address the kernel picks; nothing is replaced.
    let ret = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    check_map(ret, "reserving address space for a mapping")
}

/// Puts `[addr, addr + len)` back to reserved (`PROT_NONE`), dropping what was mapped there.
/// The range must lie inside a reservation of the mapping layer.
pub fn re_reserve(addr: *mut u8, len: usize) -> io::Result<()> {
    // Raw: PROT_NONE with MAP_FIXED inside a reservation.
    // SAFETY: the caller passes a range inside its own reservation; MAP_FIXED replaces only that
    // range, whose memory the mapping layer no longer hands out.
    let ret = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    check_map(ret, "returning a range to the reservation").map(drop)
}

/// Unmaps a whole reservation made with [`reserve_anywhere`].
pub fn release(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the range is a reservation this layer made and no longer uses.
    if unsafe { libc::munmap(addr.cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn prot(write: bool) -> i32 {
    if write {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    }
}

/// Maps anonymous private memory over `[addr, addr + len)` (inside a reservation).
pub fn map_anon_fixed(addr: *mut u8, len: usize, write: bool) -> io::Result<()> {
    // Raw: MAP_FIXED inside a reservation, for pages a userfaultfd serves.
    // SAFETY: the range lies in a reservation of the mapping layer (PROT_NONE until now, or
    // pages it drops on purpose); MAP_FIXED replaces only that range.
    let ret = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            prot(write),
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    check_map(ret, "mapping anonymous memory for remote pages")?;
    // A forked child inherits no userfaultfd registration: its faults there would silently
    // read zero pages. Leave the range out of children, so that an access there is a SIGSEGV.
    // SAFETY: advice on the range just mapped; it changes only what fork copies.
    if unsafe { libc::madvise(addr.cast(), len, libc::MADV_DONTFORK) } != 0 {
        return Err(io::Error::other(format!(
            "keeping remote pages out of forked children (madvise MADV_DONTFORK): {}",
            io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Maps `fd` at file offset `offset` shared over `[addr, addr + len)` (inside a reservation).
pub fn map_fd_fixed(
    addr: *mut u8,
    len: usize,
    fd: BorrowedFd<'_>,
    offset: u64,
    write: bool,
) -> io::Result<()> {
    // Raw: MAP_FIXED at the region's place inside a reservation (memmap2 cannot map at an
    // address).
    // SAFETY: as for `map_anon_fixed`; the memfd stays valid for the mapping's life (the kernel
    // holds its own reference).
    let ret = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            prot(write),
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    check_map(ret, "mapping the local segment").map(drop)
}

/// Drops the pages of `[addr, addr + len)` (private anonymous memory reads as missing again).
pub fn drop_pages(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the range is mapped by this layer; MADV_DONTNEED only discards page contents, which
    // the caller has written back or does not want.
    if unsafe { libc::madvise(addr.cast(), len, libc::MADV_DONTNEED) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An empty memfd: mapped, every access to it raises `SIGBUS` (past the end of the file).
pub fn empty_memfd() -> io::Result<OwnedFd> {
    // SAFETY: memfd_create with a static NUL-terminated name; the returned descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"regions-lost-page".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `UFFD_USER_MODE_ONLY` (linux/userfaultfd.h): faults from user space only, which the kernel
/// lets any process ask for whatever `vm.unprivileged_userfaultfd` says.
const UFFD_USER_MODE_ONLY: libc::c_int = 1;

/// A non-blocking userfaultfd from the `userfaultfd(2)` system call, user-mode faults only,
/// with the API handshake done for `features`: for processes that may not open `/dev/userfaultfd` (mode
/// 0600, root's), which the `userfaultfd` crate tries first and does not fall back from.
pub fn userfaultfd_user_mode(features: u64) -> io::Result<OwnedFd> {
    // SAFETY: a system call with flags only; it returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_userfaultfd,
            libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("userfaultfd returned a bad fd"))?;
    // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let got = uffd_api_handshake(fd.as_fd(), features)?;
    // Kernels since 6.10 leave out features they do not know instead of refusing them.
    if got & features != features {
        return Err(io::Error::other(format!(
            "the kernel's userfaultfd lacks features {:#x}",
            features & !got
        )));
    }
    Ok(fd)
}

/// `UFFDIO_API` on userfaultfd `fd` asking for `features`; returns the features the kernel
/// granted.
fn uffd_api_handshake(fd: BorrowedFd<'_>, features: u64) -> io::Result<u64> {
    let mut api = userfaultfd_sys::uffdio_api {
        api: userfaultfd_sys::UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API on a userfaultfd the caller holds, with a valid, exclusively
    // borrowed `uffdio_api` that the kernel fills in.
    let r = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            userfaultfd_sys::UFFDIO_API as _,
            &mut api as *mut userfaultfd_sys::uffdio_api,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(api.features)
}

/// Copies `len` bytes of mapped memory at `src` into `dst`.
///
/// # Safety
/// `[src, src + len)` must be mapped readable and present (no fault may be served by the
/// caller's own thread), and not written concurrently in a way the caller cares about.
pub unsafe fn copy_out(src: *const u8, dst: &mut [u8]) {
    // SAFETY: per the function's contract; `dst` is a distinct Rust buffer.
    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_mode_userfaultfd_from_the_system_call() {
        let fd = userfaultfd_user_mode(0).unwrap();
        // The handshake is done once: a second UFFDIO_API is refused.
        let again = uffd_api_handshake(fd.as_fd(), 0).unwrap_err();
        assert_eq!(again.raw_os_error(), Some(libc::EINVAL));
        // A feature the kernel has not got is an error, not a silent omission.
        assert!(userfaultfd_user_mode(1 << 63).is_err());
    }

    #[test]
    fn reserve_map_drop_release() {
        let len = 16 * PAGE;
        let base = reserve_anywhere(len).unwrap();
        // The range is taken: a no-replace reservation over it fails.
        assert!(reserve_fixed_noreplace(base as usize, PAGE).is_err());
        map_anon_fixed(base, 4 * PAGE, true).unwrap();
        // SAFETY: the first four pages were just mapped read-write.
        unsafe {
            base.write(7);
            assert_eq!(base.read(), 7);
        }
        drop_pages(base, PAGE).unwrap();
        // SAFETY: still mapped; dropped private pages read as zero.
        assert_eq!(unsafe { base.read() }, 0);
        let fd = empty_memfd().unwrap();
        map_fd_fixed(base, PAGE, fd.as_fd(), 0, true).unwrap();
        re_reserve(base, 4 * PAGE).unwrap();
        release(base, len).unwrap();
    }

    #[test]
    fn anonymous_pages_are_left_out_of_forked_children() {
        let base = reserve_anywhere(PAGE).unwrap();
        map_anon_fixed(base, PAGE, true).unwrap();
        // SAFETY: the page was just mapped read-write.
        unsafe { base.write(7) };
        // SAFETY: the child only reads memory and exits (async-signal-safe).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: in the child the page is gone: this read is the SIGSEGV under test.
            let v = unsafe { std::ptr::read_volatile(base) };
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(i32::from(v)) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
            "the child read the page (status {status:#x}) instead of faulting"
        );
        release(base, PAGE).unwrap();
    }

    use std::os::fd::AsFd;
}
