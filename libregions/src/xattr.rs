//! Reading extended attributes of files under a regions mount (how a
//! program finds the mount's host agent without any configuration).

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{RegionsError, Result};

/// Largest attribute value read.
const MAX_VALUE: usize = 64 << 10;

fn explain(what: &str, name: &str, err: std::io::Error) -> RegionsError {
    let hint = match err.raw_os_error() {
        Some(libc::ENODATA) | Some(libc::ENOTSUP) => {
            "; is it under a regionfs mount (set REGIONS_MOUNT), started with an agent socket?"
        }
        _ => "",
    };
    RegionsError::Io {
        what: format!("cannot read {name} of {what}{hint}"),
        source: err,
    }
}

fn read_into(mut get: impl FnMut(&mut [u8]) -> isize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        let n = get(&mut buf);
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ERANGE) && buf.len() < MAX_VALUE {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        return Err(err);
    }
}

/// The value of attribute `name` of the file at `path` (following symlinks).
pub(crate) fn path_value(path: &Path, name: &str) -> Result<Vec<u8>> {
    let what = path.display().to_string();
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| RegionsError::Invalid(format!("path {what} contains a NUL byte")))?;
    let c_name = CString::new(name)
        .map_err(|_| RegionsError::Invalid(format!("attribute {name} contains a NUL byte")))?;
    read_into(|buf| {
        // SAFETY: both strings are NUL-terminated and live across the call;
        // `buf` is writable for `buf.len()` bytes.
        unsafe {
            libc::getxattr(
                c_path.as_ptr(),
                c_name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        }
    })
    .map_err(|e| explain(&what, name, e))
}

/// The value of attribute `name` of the open file `fd`.
pub(crate) fn fd_value(fd: BorrowedFd<'_>, name: &str) -> Result<Vec<u8>> {
    let what = format!("fd {}", fd.as_raw_fd());
    let c_name = CString::new(name)
        .map_err(|_| RegionsError::Invalid(format!("attribute {name} contains a NUL byte")))?;
    read_into(|buf| {
        // SAFETY: `fd` is a live descriptor borrowed for the call, the name is
        // NUL-terminated and `buf` is writable for `buf.len()` bytes.
        unsafe {
            libc::fgetxattr(
                fd.as_raw_fd(),
                c_name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        }
    })
    .map_err(|e| explain(&what, name, e))
}

/// The inode number of the open file `fd` (a region's id under a mount).
pub(crate) fn fd_ino(fd: BorrowedFd<'_>) -> Result<u64> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `fd` is live for the call and `stat` is writable memory of the
    // right type; it is read only after fstat reports success.
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(RegionsError::io(
            format!("cannot fstat fd {}", fd.as_raw_fd()),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fstat succeeded, so it filled the whole struct.
    Ok(unsafe { stat.assume_init() }.st_ino)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_attribute_explains_the_mount() {
        let dir = std::env::temp_dir();
        let err = path_value(&dir, "user.regions.agent").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("user.regions.agent"), "{text}");
        assert!(
            matches!(err.errno(), libc::ENODATA | libc::ENOTSUP),
            "errno {}",
            err.errno()
        );
    }

    #[test]
    fn nul_in_path_is_invalid() {
        let err = path_value(Path::new("a\0b"), "user.x").unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
    }

    #[test]
    fn reads_a_real_attribute() {
        let dir = tempdir();
        let file = dir.join("f");
        std::fs::write(&file, b"x").unwrap();
        let c_path = CString::new(file.as_os_str().as_bytes()).unwrap();
        let value = vec![b'v'; 1000];
        // SAFETY: valid NUL-terminated strings and a readable value buffer.
        let rc = unsafe {
            libc::setxattr(
                c_path.as_ptr(),
                c"user.test".as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            // Some temp file systems (tmpfs without user xattrs) refuse them.
            return;
        }
        assert_eq!(path_value(&file, "user.test").unwrap(), value);
        let f = std::fs::File::open(&file).unwrap();
        use std::os::fd::AsFd;
        assert_eq!(fd_value(f.as_fd(), "user.test").unwrap(), value);
        std::fs::remove_dir_all(&dir).ok();
    }

    fn tempdir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("regions-xattr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
