//! The regions daemon (docs/ARCHITECTURE.md, "Data plane" and "Host agent"): memfd-backed pools
//! exported over the tcp transport and, to local processes, as segment fds through the host agent;
//! registration and heartbeats to the manager.
//!
//! Modules, one concept each:
//!
//! - [`config`]: command line and [`Config`].
//! - [`error`]: [`DaemonError`] and its errno.
//! - [`pools`]: the pools' chunk tables, event application, pinning ranges for requests;
//!   [`pools::window`] (a pool's reserved address window) and [`pools::segment`] (a region's
//!   sparse memfd on this host).
//! - [`transport`]: the tcp transport server; [`transport::auth`] (HELLO and capabilities),
//!   [`transport::revocations`] (capability epochs it enforces), [`transport::admission`]
//!   (connection caps and the payload budget), [`transport::rawio`] (socket I/O straight to
//!   and from pool memory).
//! - [`agent`]: the host agent on the daemon's Unix socket; [`agent::map`] (maps with renewed
//!   capabilities, growth and closing for applications' regions), [`agent::sync`] (sync
//!   calls), [`agent::owners`] (region owners' lifetimes), [`agent::open_handles`] (handles
//!   it opened for local processes, closed when they exit), [`agent::fdpass`] (`SCM_RIGHTS`
//!   and `SO_PEERCRED`).
//! - [`manager_client`]: gRPC clients of the manager and the agent's [`manager_client::Authority`].
//! - [`rdma`] (feature `rdma`): the RDMA device, chunk registrations and per-connection queue
//!   pairs.
//! - [`registration`]: the manager session (register, resync, watch, heartbeat).
//! - [`stats`]: the counters the agent reports.
//! - [`daemon`]: [`Daemon`], everything started together.

pub mod agent;
pub mod config;
pub mod daemon;
pub mod error;
pub mod manager_client;
pub mod objects;
pub mod pools;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod registration;
pub mod stats;
pub mod transport;

pub use config::Config;
pub use daemon::Daemon;
pub use error::DaemonError;
