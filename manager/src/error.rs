//! The manager's errors, each with the errno a local file system would give.
//! Mapped to `tonic::Status` once, in [`From<ManagerError> for Status`].

use regions_proto::errno;

/// Everything a manager operation can refuse or fail with.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("{0} does not exist")]
    NotFound(String),
    #[error("{0} already exists")]
    Exists(String),
    #[error("{0} is not a directory")]
    NotDir(String),
    #[error("{0} is a directory")]
    IsDir(String),
    #[error("directory {0} is not empty; remove its entries first")]
    NotEmpty(String),
    #[error("permission denied: {0}")]
    Access(String),
    #[error("operation not permitted: {0}")]
    Perm(String),
    #[error("invalid name {0:?}: names may not be empty, \".\", \"..\", or contain '/' or NUL")]
    InvalidName(String),
    #[error("name of {0} bytes is longer than the limit of 255 bytes")]
    NameTooLong(usize),
    #[error("symbolic link target of {0} bytes is longer than the limit of 4095 bytes")]
    TargetTooLong(usize),
    #[error("inode {0} has the most hard links it may have; remove one first")]
    TooManyLinks(u64),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("out of memory in the cluster: {0}")]
    NoSpace(String),
    /// The manager's own disk is full: changes are refused (`ENOSPC`).
    #[error("{0}")]
    StoreFull(String),
    #[error("region too large: {0}")]
    TooBig(String),
    #[error("region {0} is already open for writing elsewhere and has ONEWRITER set")]
    WriterBusy(u64),
    #[error("no extended attribute {0}")]
    NoAttr(String),
    #[error("extended attribute {0}")]
    AttrRange(String),
    #[error("extended attribute value of {0} bytes is over the limit of {1} bytes")]
    AttrTooBig(usize, usize),
    #[error("{0} is not supported")]
    NotSupported(String),
    #[error("host {host} needs {bytes} more bytes of pool memory")]
    NeedPool { host: u32, bytes: u64 },
    #[error("the manager's store failed ({0}); the manager must be restarted")]
    Store(String),
    #[error("region {ino} is lost: {reason}; its data cannot be recovered, unlink it")]
    Lost { ino: u64, reason: String },
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The caller's host lost its lease (or the handle it names was closed for that): `EIO`.
    #[error("{0}")]
    Fenced(String),
}

impl ManagerError {
    /// The POSIX errno for this error.
    pub fn errno(&self) -> i32 {
        match self {
            ManagerError::NotFound(_) => libc::ENOENT,
            ManagerError::Exists(_) => libc::EEXIST,
            ManagerError::NotDir(_) => libc::ENOTDIR,
            ManagerError::IsDir(_) => libc::EISDIR,
            ManagerError::NotEmpty(_) => libc::ENOTEMPTY,
            ManagerError::Access(_) => libc::EACCES,
            ManagerError::Perm(_) => libc::EPERM,
            ManagerError::InvalidName(_) | ManagerError::Invalid(_) => libc::EINVAL,
            ManagerError::NameTooLong(_) | ManagerError::TargetTooLong(_) => libc::ENAMETOOLONG,
            ManagerError::TooManyLinks(_) => libc::EMLINK,
            ManagerError::NoSpace(_)
            | ManagerError::StoreFull(_)
            | ManagerError::NeedPool { .. } => libc::ENOSPC,
            ManagerError::TooBig(_) => libc::EFBIG,
            ManagerError::WriterBusy(_) => libc::ETXTBSY,
            ManagerError::NoAttr(_) => libc::ENODATA,
            ManagerError::AttrRange(_) => libc::ERANGE,
            ManagerError::AttrTooBig(..) => libc::E2BIG,
            ManagerError::NotSupported(_) => libc::ENOTSUP,
            ManagerError::Store(_) | ManagerError::Lost { .. } => libc::EIO,
            ManagerError::Unavailable(_) | ManagerError::Fenced(_) => libc::EIO,
        }
    }
}

impl From<ManagerError> for tonic::Status {
    fn from(e: ManagerError) -> tonic::Status {
        errno::status(e.errno(), e.to_string())
    }
}

/// Result of manager operations.
pub type Result<T, E = ManagerError> = std::result::Result<T, E>;
