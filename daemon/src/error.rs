//! The daemon's error type, and the one place errors become POSIX errnos.

use std::path::PathBuf;

use regions_proto::auth::SecretError;

/// Everything that can go wrong in the daemon library.
///
/// Transport replies and host-agent replies carry [`DaemonError::errno`]; start-up errors are
/// shown to people, so each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A request names a pool this daemon does not serve.
    #[error("pool {gid} is not served by this daemon")]
    UnknownPool {
        /// The pool global id asked for.
        gid: u32,
    },
    /// A range runs past the end of its pool.
    #[error("range {offset:#x}+{len} is outside pool {gid} of {size} bytes")]
    OutOfBounds {
        /// Pool global id.
        gid: u32,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the pool.
        size: u64,
    },
    /// A range touches a chunk that backs no region (after waiting for the manager's events).
    #[error("pool {gid} offset {offset:#x} is not assigned to any region")]
    Unassigned {
        /// Pool global id.
        gid: u32,
        /// First unassigned byte.
        offset: u64,
    },
    /// A mapping changed while a request was moving data (the region was released).
    #[error("the memory of pool {gid} changed while the request was in progress")]
    Remapped {
        /// Pool global id.
        gid: u32,
    },
    /// A request or event is malformed.
    #[error("{0}")]
    Invalid(String),
    /// Permission refused (bad transport secret, manager's access check).
    #[error("{0}")]
    Denied(String),
    /// An RDMA verbs call failed.
    #[error("RDMA: {0}")]
    Rdma(String),
    /// An atomic applied through the RDMA device was posted but its answer lost: it may or
    /// may not have been applied (`ETIMEDOUT`, which clients do not retry elsewhere).
    #[error("{0}: the atomic may or may not have been applied; read the word to see its state")]
    AtomicOutcomeUnknown(String),
    /// This daemon serves no RDMA (none configured or found, or built without it).
    #[error("{0}")]
    NoRdma(String),
    /// The object is in use in a way that forbids the change (`EBUSY`).
    #[error("{0}")]
    Busy(String),
    /// This daemon keeps no object store (`EOPNOTSUPP`).
    #[error("{0}")]
    NoObjects(String),
    /// An access through a stale map (`ESTALE`).
    #[error("{0}")]
    Stale(String),
    /// A capability revoked by a change to its region (`EKEYREVOKED`): renew it.
    #[error("{0}")]
    Revoked(String),
    /// A handle the caller did not open (`EBADF`).
    #[error("{0}")]
    BadHandle(String),
    /// Not enough memory for a pool.
    #[error("{0}")]
    NoSpace(String),
    /// A resource of this host is used up (open files, memory maps): the region that needed it
    /// has no memory here until some is freed.
    #[error("{message}")]
    Limit {
        /// `ENOSPC`: this host has no room for the region's memory.
        errno: i32,
        /// Which limit, its value, and what to do.
        message: String,
    },
    /// A write past what a small region's object can hold: the region must move to a segment
    /// of its own first.
    #[error(
        "{len} bytes do not fit in this small region's slot of {max} bytes; the region must be \
         given a larger slot or a segment of its own"
    )]
    ObjectTooLarge {
        /// Bytes the access needed.
        len: u64,
        /// Bytes the object can hold.
        max: u64,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// What the daemon was doing.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The manager refused a request or could not be reached.
    #[error("manager: {message}")]
    Manager {
        /// The errno the manager's status maps to.
        errno: i32,
        /// The status message.
        message: String,
    },
    /// The cluster secret could not be loaded.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The transport address cannot be bound.
    #[error(
        "cannot listen on {addr}: {source}; another daemon may be running there: stop it or \
         pick another --listen (port 0 picks a free port)"
    )]
    Bind {
        /// The address asked for.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The directory of the host-agent socket does not exist.
    #[error(
        "the directory {dir} of --socket does not exist: create it (mkdir -p {dir}) or pick \
         another --socket"
    )]
    SocketDir {
        /// The missing directory.
        dir: PathBuf,
    },
    /// Another process serves the host-agent socket.
    #[error(
        "another daemon is serving the host-agent socket {path}: stop it or pick another --socket"
    )]
    SocketInUse {
        /// The socket path.
        path: PathBuf,
    },
    /// Bad configuration.
    #[error("{0}")]
    Config(String),
    /// The manager stayed unreachable during start-up.
    #[error(
        "cannot register with the manager at {url} after {attempts} attempts in {secs} s \
         (last error: {last}); start regions-manager or fix --manager"
    )]
    ManagerUnreachable {
        /// The manager's URL.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// Seconds spent.
        secs: u64,
        /// The last error.
        last: String,
    },
}

impl DaemonError {
    /// The POSIX errno a reply carries for this error.
    pub fn errno(&self) -> i32 {
        match self {
            DaemonError::UnknownPool { .. } => libc::ENOENT,
            DaemonError::OutOfBounds { .. }
            | DaemonError::Unassigned { .. }
            | DaemonError::Remapped { .. } => libc::EFAULT,
            DaemonError::Invalid(_) | DaemonError::Config(_) => libc::EINVAL,
            DaemonError::Denied(_) => libc::EACCES,
            DaemonError::BadHandle(_) => libc::EBADF,
            DaemonError::Stale(_) => libc::ESTALE,
            DaemonError::Revoked(_) => libc::EKEYREVOKED,
            DaemonError::NoSpace(_) => libc::ENOSPC,
            DaemonError::ObjectTooLarge { .. } => libc::EFBIG,
            DaemonError::Sys { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            DaemonError::Manager { errno, .. } | DaemonError::Limit { errno, .. } => *errno,
            DaemonError::Secret(_) => libc::EACCES,
            DaemonError::Bind { .. } => libc::EADDRINUSE,
            DaemonError::SocketDir { .. } => libc::ENOENT,
            DaemonError::SocketInUse { .. } => libc::EADDRINUSE,
            DaemonError::ManagerUnreachable { .. } => libc::EIO,
            DaemonError::Rdma(_) => libc::EIO,
            DaemonError::AtomicOutcomeUnknown(_) => libc::ETIMEDOUT,
            DaemonError::NoRdma(_) | DaemonError::NoObjects(_) => libc::EOPNOTSUPP,
            DaemonError::Busy(_) => libc::EBUSY,
        }
    }

    /// A [`DaemonError::Sys`] for `what`.
    pub fn sys(what: impl Into<String>, source: impl Into<std::io::Error>) -> DaemonError {
        DaemonError::Sys {
            what: what.into(),
            source: source.into(),
        }
    }

    /// The error a failed manager call becomes.
    pub fn from_status(status: &tonic::Status) -> DaemonError {
        DaemonError::Manager {
            errno: regions_proto::errno::errno_of(status),
            message: status.message().to_owned(),
        }
    }
}

/// Results of the daemon library.
pub type Result<T, E = DaemonError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos() {
        assert_eq!(DaemonError::UnknownPool { gid: 1 }.errno(), libc::ENOENT);
        let unassigned = DaemonError::Unassigned { gid: 1, offset: 0 };
        assert_eq!(unassigned.errno(), libc::EFAULT);
        assert_eq!(DaemonError::Invalid("x".into()).errno(), libc::EINVAL);
        let too_large = DaemonError::ObjectTooLarge {
            len: 9000,
            max: 8160,
        };
        assert_eq!(too_large.errno(), libc::EFBIG);
        let sys = DaemonError::sys("mmap", std::io::Error::from_raw_os_error(libc::ENOMEM));
        assert_eq!(sys.errno(), libc::ENOMEM);
        let status = regions_proto::errno::status(libc::EACCES, "no");
        assert_eq!(DaemonError::from_status(&status).errno(), libc::EACCES);
    }
}
