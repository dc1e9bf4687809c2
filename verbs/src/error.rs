//! What can fail in a verbs call.

use std::io;

pub type Result<T> = std::result::Result<T, VerbsError>;

#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA device (or none of that name) on this host.
    #[error(
        "no RDMA device{}: load a driver (for soft-RoCE: `modprobe rdma_rxe` and \
         `rdma link add rxe0 type rxe netdev ETH`) or use the tcp transport",
        .0.as_ref().map(|n| format!(" named {n}")).unwrap_or_default()
    )]
    NoDevice(Option<String>),
    /// A verbs call failed.
    #[error("{what} failed: {cause}")]
    Call {
        what: String,
        #[source]
        cause: io::Error,
    },
    /// A work request completed with an error; the queue pair is in the error state and must
    /// be created again.
    #[error(
        "RDMA {op} completed with status {status} ({text}); the queue pair is broken and is \
         connected again"
    )]
    Completion {
        op: &'static str,
        status: u32,
        text: String,
    },
    /// No completion within the deadline.
    #[error("no RDMA completion within {0:?}: the peer or the link is down")]
    Timeout(std::time::Duration),
    /// Waiting for the completion of requests already posted failed: whether they took
    /// effect is unknown; the queue pair is broken.
    #[error("waiting for an RDMA completion failed ({0}); the queue pair is broken")]
    Lost(String),
    /// A request this crate refuses before posting it.
    #[error("invalid RDMA request: {0}")]
    Invalid(String),
}

impl VerbsError {
    /// The error of a verbs call that returned -1 (or NULL) and set `errno`.
    pub(crate) fn last(what: impl Into<String>) -> VerbsError {
        VerbsError::Call {
            what: what.into(),
            cause: io::Error::last_os_error(),
        }
    }

    /// The error of a verbs call that returned an errno value itself.
    pub(crate) fn errno(what: impl Into<String>, errno: i32) -> VerbsError {
        VerbsError::Call {
            what: what.into(),
            cause: io::Error::from_raw_os_error(errno),
        }
    }

    /// Whether a failed list of one operation surely did not take effect at the peer: it was
    /// refused before posting (`Invalid`, `NoDevice`), the post itself failed (`Call`: the
    /// errors after a post are `Lost`), or the peer answered with a NAK (a remote access or
    /// request error: the responder checks before it executes). A timeout, a lost wait or a
    /// local error (which an atomic's requester may report while writing the answer, after
    /// the responder executed) leave the outcome unknown: such an operation must not be
    /// repeated elsewhere.
    pub fn surely_not_executed(&self) -> bool {
        use ibverbs_sys::ibv_wc_status as st;
        match self {
            VerbsError::NoDevice(_) | VerbsError::Call { .. } | VerbsError::Invalid(_) => true,
            VerbsError::Completion { status, .. } => matches!(
                *status,
                st::IBV_WC_REM_INV_REQ_ERR
                    | st::IBV_WC_REM_ACCESS_ERR
                    | st::IBV_WC_REM_INV_RD_REQ_ERR
            ),
            VerbsError::Timeout(_) | VerbsError::Lost(_) => false,
        }
    }

    /// The errno a file system or transport reports for this error.
    pub fn errno_value(&self) -> i32 {
        match self {
            VerbsError::NoDevice(_) => libc::ENODEV,
            VerbsError::Call { cause, .. } => cause.raw_os_error().unwrap_or(libc::EIO),
            VerbsError::Completion { .. } | VerbsError::Timeout(_) | VerbsError::Lost(_) => {
                libc::EIO
            }
            VerbsError::Invalid(_) => libc::EINVAL,
        }
    }
}
