//! POSIX errnos inside gRPC statuses.
//!
//! The manager answers every refusal with a [`tonic::Status`] whose code fits
//! the errno and whose metadata carries the errno itself under [`ERRNO_KEY`],
//! so a FUSE adapter or the C ABI returns exactly the errno a local file
//! system would.

use tonic::{Code, Status, metadata::MetadataValue};

/// Metadata key holding the decimal errno of a failed call.
pub const ERRNO_KEY: &str = "regions-errno";

/// The gRPC code that best describes `errno`.
pub fn code_for(errno: i32) -> Code {
    match errno {
        libc::ENOENT | libc::ENODATA => Code::NotFound,
        libc::EEXIST => Code::AlreadyExists,
        libc::EACCES | libc::EPERM => Code::PermissionDenied,
        libc::ENOSPC | libc::ENOMEM | libc::EFBIG => Code::ResourceExhausted,
        libc::EINVAL | libc::ENAMETOOLONG | libc::ERANGE | libc::E2BIG => Code::InvalidArgument,
        libc::ENOTEMPTY | libc::ENOTDIR | libc::EISDIR | libc::ETXTBSY | libc::EBUSY => {
            Code::FailedPrecondition
        }
        libc::EIO | libc::EAGAIN | libc::ETIMEDOUT => Code::Unavailable,
        libc::ENOTSUP | libc::ENOSYS => Code::Unimplemented,
        _ => Code::Unknown,
    }
}

/// A status for `errno` with a message for people.
pub fn status(errno: i32, message: impl Into<String>) -> Status {
    let mut status = Status::new(code_for(errno), message);
    status
        .metadata_mut()
        .insert(ERRNO_KEY, MetadataValue::from(errno));
    status
}

/// The errno a client should report for `status`: the one the manager sent,
/// or the closest match for statuses that did not come from the manager
/// (transport failures, authentication).
pub fn errno_of(status: &Status) -> i32 {
    if let Some(errno) = status
        .metadata()
        .get(ERRNO_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<i32>().ok())
    {
        return errno;
    }
    match status.code() {
        Code::NotFound => libc::ENOENT,
        Code::AlreadyExists => libc::EEXIST,
        Code::PermissionDenied | Code::Unauthenticated => libc::EACCES,
        Code::ResourceExhausted => libc::ENOSPC,
        Code::InvalidArgument | Code::OutOfRange => libc::EINVAL,
        Code::FailedPrecondition => libc::EBUSY,
        Code::Unimplemented => libc::ENOSYS,
        Code::DeadlineExceeded => libc::ETIMEDOUT,
        _ => libc::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_survives_the_status() {
        for errno in [
            libc::ENOENT,
            libc::EEXIST,
            libc::EACCES,
            libc::EPERM,
            libc::ENOTEMPTY,
            libc::ETXTBSY,
            libc::ENOSPC,
            libc::ENODATA,
        ] {
            let s = status(errno, "x");
            assert_eq!(errno_of(&s), errno);
        }
    }

    #[test]
    fn foreign_statuses_map_to_sensible_errnos() {
        assert_eq!(errno_of(&Status::unavailable("down")), libc::EIO);
        assert_eq!(errno_of(&Status::unauthenticated("no")), libc::EACCES);
        assert_eq!(code_for(libc::ENOTEMPTY), Code::FailedPrecondition);
    }
}
