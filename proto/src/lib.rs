//! Every wire format of regions.
//!
//! - [`v1`]: the manager's gRPC services (namespace, regions, cluster, sync),
//!   generated from `proto/regions/v1/*.proto`.
//! - [`errno`]: how POSIX errnos travel inside gRPC statuses.
//! - [`auth`]: the cluster secret, and the per-call proofs of it in request metadata.
//! - [`handshake`]: the transport's challenge–response HELLO with the cluster secret.
//! - [`frame`]: the binary frame codec of the tcp data transport.
//! - [`lock_word`]: what the words of mutexes and barriers hold (tags and flag bits).
//! - [`word_wait`]: how processes sharing region memory wait for a word to change.
//! - [`pid_watch`]: watching processes for their exit with pidfds.
//! - [`lease_contact`]: how long the manager has been silent (a host's self-fence).
//! - [`metrics`]: the Prometheus endpoint every binary serves with `--metrics-listen`.
//! - [`tls`]: optional TLS for the manager's gRPC endpoint.
//! - [`config`]: settings from a TOML file beneath flags and environment variables.
//! - [`descriptor_epochs`]: the page of open and close counters a mount publishes for
//!   `rmalloc(fd)`.
//! - [`transport_choice`]: `--transport auto|tcp|rdma`, shared by every component.

pub mod auth;
pub mod capability;
pub mod config;
pub mod descriptor_epochs;
pub mod errno;
pub mod fd_limit;
pub mod frame;
pub mod handshake;
pub mod layout;
pub mod lease_contact;
pub mod lock_word;
#[cfg(feature = "exporter")]
pub mod metrics;
pub mod pid_watch;
pub mod tls;
pub mod transport_choice;
pub mod word_wait;

/// Inode number of the namespace's root directory.
pub const ROOT_INO: u64 = 1;

/// Largest gRPC message either side of the manager's services accepts (a region map of
/// 1 TiB is 64 MiB of entries).
pub const MAX_GRPC_MESSAGE: usize = 256 << 20;

/// Generated messages, clients and servers of the manager's services.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("regions.v1");
}
