//! The regions client core (docs/ARCHITECTURE.md, "libregions"), used by regionfs and
//! by applications: the manager client, open regions with cached maps, and
//! the transports that move region bytes.
//!
//! ```no_run
//! use regions::{Client, ClientConfig};
//! use regions_proto::auth::Secret;
//!
//! let secret = Secret::from_file("/etc/regions/secret".as_ref())?;
//! let client = Client::connect(ClientConfig::new("http://127.0.0.1:7070", secret, 1))?;
//! let attr = client.create_path("data", 0o644, None, 0)?;
//! let region = client.open(attr.ino, true)?;
//! region.write_at(0, b"hello")?;
//! let mut buf = [0u8; 5];
//! region.read_at(0, &mut buf)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Calls are blocking; make them from ordinary threads.

pub mod agent;
pub mod capi;
pub mod client;
pub mod connection;
pub mod error;
pub mod manager_client;
pub mod mapping;
pub mod region;
pub mod rmalloc;
pub mod sync;
pub mod transport;
mod xattr;

pub use client::{Client, ROOT_INO};
pub use connection::ClientConfig;
pub use error::{RegionsError, Result};
pub use region::{ChunkLoc, Region, SizePolicy};
pub use transport::{StatsSnapshot, Transport};
