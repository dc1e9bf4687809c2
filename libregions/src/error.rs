//! Errors of the client core, each with the errno an application sees.

use regions_proto::errno;

/// Everything a client operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RegionsError {
    /// The manager refused or failed the request.
    #[error("manager: {message}")]
    Manager { errno: i32, message: String },
    /// The manager could not be reached.
    #[error("cannot reach the manager at {addr}: {reason}; is regions-manager running there?")]
    ManagerUnreachable { addr: String, reason: String },
    /// A daemon answered a transport request with an error.
    #[error("daemon {addr}: {message}")]
    Daemon {
        addr: String,
        errno: i32,
        message: String,
    },
    /// A daemon could not be reached within the retry bound.
    #[error("daemon {addr} unreachable after {attempts} attempts over {elapsed_ms} ms: {reason}")]
    DaemonUnreachable {
        addr: String,
        attempts: u32,
        elapsed_ms: u64,
        reason: String,
    },
    /// An 8-byte atomic was sent but its answer lost: it may or may not have been applied,
    /// so it is not repeated anywhere.
    #[error(
        "daemon {addr}: an atomic was sent but its answer was lost ({reason}); it may or may \
         not have been applied: read the word to see its state"
    )]
    AtomicOutcomeUnknown { addr: String, reason: String },
    /// The host agent (daemon Unix socket) failed.
    #[error("host agent {path}: {message}")]
    Agent {
        path: String,
        errno: i32,
        message: String,
    },
    /// The data a daemon sent back does not fit the request.
    #[error("protocol error with {peer}: {reason}")]
    Protocol { peer: String, reason: String },
    /// Bad arguments from the caller.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Resolving a path met more symbolic links than a kernel follows (40).
    #[error(
        "too many symbolic links resolving {0:?}: a link loops, or the chain is longer than 40"
    )]
    SymlinkLoop(String),
    /// Out of memory: a region is full and cannot grow (rmalloc).
    #[error("out of memory: {0}")]
    NoMemory(String),
    /// Mapping a region into the process failed, or a mapping call was misused.
    #[error("mapping: {message}")]
    Mapping { errno: i32, message: String },
    /// Bytes a write returned for (posted to a daemon) did not reach the region's memory.
    #[error(
        "{len} bytes written at offset {offset} of region {ino} did not reach its memory: {reason}; \
         write them again once the daemon holding them answers"
    )]
    WriteLost {
        ino: u64,
        offset: u64,
        len: u64,
        errno: i32,
        reason: String,
    },
    /// A local system call failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl RegionsError {
    /// The POSIX errno for this error.
    pub fn errno(&self) -> i32 {
        match self {
            RegionsError::Manager { errno, .. }
            | RegionsError::Mapping { errno, .. }
            | RegionsError::Daemon { errno, .. }
            | RegionsError::Agent { errno, .. }
            | RegionsError::WriteLost { errno, .. } => *errno,
            RegionsError::ManagerUnreachable { .. }
            | RegionsError::DaemonUnreachable { .. }
            | RegionsError::AtomicOutcomeUnknown { .. }
            | RegionsError::Protocol { .. } => libc::EIO,
            RegionsError::Invalid(_) => libc::EINVAL,
            RegionsError::SymlinkLoop(_) => libc::ELOOP,
            RegionsError::NoMemory(_) => libc::ENOMEM,
            RegionsError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    /// Whether an atomic may or may not have been applied (its answer was lost after it was
    /// sent): it must not be tried again elsewhere (through the manager, say).
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            RegionsError::AtomicOutcomeUnknown { .. }
                | RegionsError::Daemon {
                    errno: libc::ETIMEDOUT,
                    ..
                }
        )
    }

    /// Whether a daemon refused the access because what the caller holds may be out of date:
    /// the range is not allocated yet or backs another region now (`EFAULT`, `ESTALE`: a stale
    /// map), the capability was revoked by a change to the region (`EKEYREVOKED`), or the
    /// chunk has no memory on that host for lack of room (`ENOSPC`: it may be another region's
    /// chunk by now). Fetching the map and the capability again (which checks permission
    /// again) and retrying once is the cure; an `ENOSPC` that stays is the caller's.
    pub fn calls_for_refresh(&self) -> bool {
        matches!(
            self,
            RegionsError::Daemon { errno, .. }
                if matches!(*errno, libc::EFAULT | libc::ESTALE | libc::EKEYREVOKED | libc::ENOSPC)
        )
    }

    pub(crate) fn from_status(status: tonic::Status) -> RegionsError {
        RegionsError::Manager {
            errno: errno::errno_of(&status),
            message: status.message().to_owned(),
        }
    }

    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> RegionsError {
        RegionsError::Io {
            what: what.into(),
            source,
        }
    }
}

/// Result of client operations.
pub type Result<T, E = RegionsError> = std::result::Result<T, E>;
