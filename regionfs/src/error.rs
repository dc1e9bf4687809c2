//! Errors of the file-system core, each with the one errno the kernel is
//! given for it ([`FsError::errno`] is the single mapping).

use regions::RegionsError;

/// Everything a file-system operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The client core failed: a manager refusal (with the manager's errno), an
    /// unreachable manager or daemon, ...
    #[error(transparent)]
    Regions(#[from] RegionsError),
    /// An operation regions does not offer (symlinks, hard links, device
    /// nodes).
    #[error("not supported by regions: {0}")]
    NotSupported(String),
    /// Only root may do this (the `.regions` metadata tree).
    #[error("permission denied: {0}")]
    Denied(String),
    /// Nothing by that name or number.
    #[error("not found: {0}")]
    NotFound(String),
    /// The name exists already.
    #[error("exists: {0}")]
    Exists(String),
    /// Bad arguments.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The open's handle was closed at the manager when this host's lease ended (the host was
    /// fenced): the open answers `EIO` until it is closed.
    #[error("{0}")]
    Fenced(String),
    /// A file handle the kernel gave is unknown, or not open for this.
    #[error("bad file handle: {0}")]
    BadHandle(String),
    /// A reply does not fit the caller's buffer (xattr size probes).
    #[error("result of {needed} bytes does not fit a buffer of {given}")]
    Range {
        /// Bytes the answer has.
        needed: usize,
        /// Bytes the caller's buffer has.
        given: usize,
    },
    /// An ioctl number regions does not know.
    #[error("unknown ioctl {0:#x}; see regionfs/include/regions_ioctl.h")]
    UnknownIoctl(u32),
    /// The file is in use in a way that excludes this open.
    #[error("busy: {0}")]
    Busy(String),
    /// The operation needs a directory.
    #[error("not a directory: {0}")]
    NotDir(String),
    /// The operation needs a file.
    #[error("is a directory: {0}")]
    IsDir(String),
    /// No such extended attribute (or per-thread default).
    #[error("no such attribute: {0}")]
    NoData(String),
    /// A table of this mount is full.
    #[error("no room: {0}")]
    Full(String),
    /// The kernel's inode is out of date (the region shrank on another
    /// host); the kernel looks the path up again and retries the open.
    #[error("stale inode: {0}")]
    Stale(String),
    /// A local system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl FsError {
    /// The errno the kernel returns to the application.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::Regions(e) => e.errno(),
            FsError::NotSupported(_) => libc::EPERM,
            FsError::Denied(_) => libc::EACCES,
            FsError::NotFound(_) => libc::ENOENT,
            FsError::Exists(_) => libc::EEXIST,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::BadHandle(_) => libc::EBADF,
            FsError::Fenced(_) => libc::EIO,
            FsError::Range { .. } => libc::ERANGE,
            FsError::UnknownIoctl(_) => libc::ENOTTY,
            FsError::Busy(_) => libc::ETXTBSY,
            FsError::NotDir(_) => libc::ENOTDIR,
            FsError::IsDir(_) => libc::EISDIR,
            FsError::Stale(_) => libc::ESTALE,
            FsError::NoData(_) => libc::ENODATA,
            FsError::Full(_) => libc::ENOSPC,
            FsError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    /// How loudly a failure is logged: expected answers (no such name, no
    /// such attribute) are routine; lost daemons are not.
    pub fn is_routine(&self) -> bool {
        matches!(
            self.errno(),
            libc::ENOENT | libc::ENODATA | libc::EEXIST | libc::ENOTEMPTY | libc::ERANGE
        ) || matches!(self, FsError::UnknownIoctl(_))
    }

    /// Whether the failure means the cluster is unhealthy (EIO).
    pub fn is_fault(&self) -> bool {
        self.errno() == libc::EIO
    }
}

/// Result of file-system operations.
pub type FsResult<T> = Result<T, FsError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos() {
        assert_eq!(FsError::NotSupported("symlink".into()).errno(), libc::EPERM);
        assert_eq!(FsError::Denied(".regions".into()).errno(), libc::EACCES);
        assert_eq!(
            FsError::Range {
                needed: 5,
                given: 1
            }
            .errno(),
            libc::ERANGE
        );
        assert_eq!(FsError::UnknownIoctl(7).errno(), libc::ENOTTY);
        assert_eq!(
            FsError::Regions(RegionsError::Invalid("x".into())).errno(),
            libc::EINVAL
        );
        let refused = FsError::from(RegionsError::Manager {
            errno: libc::ENOTEMPTY,
            message: "dir not empty".into(),
        });
        assert_eq!(refused.errno(), libc::ENOTEMPTY);
        let down = FsError::from(RegionsError::ManagerUnreachable {
            addr: "127.0.0.1:1".into(),
            reason: "connection refused".into(),
        });
        assert_eq!(down.errno(), libc::EIO);
        assert!(down.to_string().contains("127.0.0.1:1"));
        assert!(FsError::NotFound("x".into()).is_routine());
        assert!(!FsError::Denied("x".into()).is_routine());
    }
}
