//! The regions manager (docs/ARCHITECTURE.md, "Control plane"; Remote Regions paper §6.5–6.10):
//! the namespace, region maps, hosts and pools, the cluster allocator and
//! the fixed-virtual-address allocator, durable in an embedded store and
//! served over gRPC. It is never on the data path.
//!
//! [`Manager`] is the core that tests drive directly; [`service`] adapts it
//! to the gRPC services of `regions-proto`; [`server::serve`] runs them.

pub mod access;
pub mod allocator;
pub mod cache_leases;
pub mod capability;
pub mod cluster;
pub mod error;
pub mod lifetime;
pub mod links;
pub mod manager;
pub mod metrics;
pub mod model;
pub mod namespace;
pub mod objects;
pub mod regions;
pub mod revocations;
pub mod server;
pub mod service;
pub mod state;
pub mod store;
pub mod sync;
#[cfg(test)]
mod test_support;
pub mod vaddr;
pub mod wal;
pub mod word_client;
pub mod xattr;

pub use access::Caller;
pub use error::ManagerError;
pub use manager::{Config, Manager};
