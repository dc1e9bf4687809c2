//! The regions daemon (docs/ARCHITECTURE.md, "Data plane" and "Host agent"): memfd-backed pools
//! exported over the tcp transport and, to local processes, as segment fds through the host agent;
//! registration and heartbeats to the manager.
//!
//! Modules, one concept each:
//!
//! - [`config`]: command line and [`Config`].
//! - [`error`]: [`DaemonError`] and its errno.
//! - [`window`]: a pool's reserved address window (mmap).
//! - [`segment`]: a region's sparse memfd on this host.
//! - [`pools`]: the pools' chunk tables, event application, pinning ranges for requests.
//! - [`rawio`]: socket I/O straight to and from pool memory.
//! - [`revocations`]: capability epochs the transport enforces.
//! - [`transport`]: the tcp transport server.
//! - [`fdpass`]: `SCM_RIGHTS` and `SO_PEERCRED` on Unix sockets.
//! - [`agent`]: the host agent on the daemon's Unix socket.
//! - [`manager_client`]: gRPC clients of the manager and the agent's [`manager_client::Authority`].
//! - [`open_handles`]: handles the agent opened for local processes, closed when they exit.
//! - [`registration`]: the manager session (register, resync, watch, heartbeat).
//! - [`stats`]: the counters the agent reports.
//! - [`daemon`]: [`Daemon`], everything started together.

pub mod admission;
pub mod agent;
pub mod agent_map;
pub mod agent_sync;
pub mod config;
pub mod daemon;
pub mod error;
pub mod fdpass;
pub mod manager_client;
pub mod open_handles;
pub mod owners;
pub mod pools;
pub mod rawio;
pub mod registration;
pub mod revocations;
pub mod segment;
pub mod stats;
pub mod transport;
pub mod transport_auth;
pub mod window;

pub use config::Config;
pub use daemon::Daemon;
pub use error::DaemonError;
