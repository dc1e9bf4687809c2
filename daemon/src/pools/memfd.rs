//! The memfd operations segments and the small-region block file share: making one (out of
//! descriptors is a limit of this host, not a failure), punching pages out of it, and counting
//! the memory it holds.

use std::os::fd::{AsFd, OwnedFd};

use nix::fcntl::{FallocateFlags, fallocate};
use nix::sys::memfd::{MFdFlags, memfd_create};

use crate::error::{DaemonError, Result};

/// A new memfd named `name`, holding `what` (for messages: "memory of region 7"). Out of
/// descriptors (`EMFILE`, `ENFILE`) is [`DaemonError::Limit`] with `ENOSPC` and a message
/// naming the limit and what to do.
pub fn create(name: &str, flags: MFdFlags, what: &str) -> Result<OwnedFd> {
    memfd_create(name, flags).map_err(|e| match e {
        nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE => DaemonError::Limit {
            errno: libc::ENOSPC,
            message: format!(
                "this host cannot hold {what}: the daemon is out of file descriptors ({e}; \
                 RLIMIT_NOFILE {}, or the system's fs.file-max); raise the limit or delete \
                 regions",
                regions_proto::fd_limit::open_file_limit()
            ),
        },
        e => DaemonError::sys(format!("memfd_create for {what}"), e),
    })
}

/// Frees the pages of `[offset, offset + len)` of `fd` (they read as zeros afterwards and their
/// memory goes back to the kernel), keeping the size; `what` names the file in messages.
pub fn punch(fd: impl AsFd, offset: u64, len: u64, what: &str) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let bad = || DaemonError::Invalid(format!("cannot punch {offset:#x}+{len:#x} in {what}"));
    let off = i64::try_from(offset).map_err(|_| bad())?;
    let n = i64::try_from(len).map_err(|_| bad())?;
    off.checked_add(n).ok_or_else(bad)?;
    fallocate(
        fd,
        FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
        off,
        n,
    )
    .map_err(|e| DaemonError::sys(format!("punching {offset:#x}+{len:#x} in {what}"), e))
}

/// Bytes of memory `fd` holds (pages actually allocated); 0, logged, if `fstat` fails.
pub fn allocated_bytes(fd: impl AsFd, what: &str) -> u64 {
    match nix::sys::stat::fstat(fd) {
        Ok(st) => u64::try_from(st.st_blocks).unwrap_or(0) * 512,
        Err(e) => {
            tracing::warn!(error = %e, "fstat of {what} failed");
            0
        }
    }
}
