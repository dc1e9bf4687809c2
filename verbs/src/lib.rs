//! The ibverbs operations the RDMA transport of regions uses (docs/ARCHITECTURE.md, "RDMA"):
//! the `unsafe` calls into libibverbs, kept in this one small crate, each with its `// SAFETY:`
//! reasoning, behind types whose methods are safe to call.
//!
//! - [`device`]: [`Device`] (an opened RDMA device and the port and GID it uses) and
//!   [`ProtectionDomain`].
//! - [`memory`]: [`Registration`] (a memory region the device may read, write and update, by
//!   its keys) and [`RegisteredBuffer`] (memory of its own, registered: bounce buffers).
//! - [`queue_pair`]: [`QueuePair`] (a reliable-connected queue pair and its completion queue),
//!   [`Endpoint`] (what a peer needs to connect to one) and [`Op`] (one-sided READ, WRITE,
//!   compare-and-swap and fetch-and-add, posted as one linked list with one signalled
//!   completion).
//! - [`window`]: [`MemoryWindow`] (remote access to part of a registration, through one queue
//!   pair, revoked by dropping it).
//!
//! Nothing here knows regions, pools or capabilities: the daemon registers its pool memory
//! and the client transport moves region bytes with these.

pub mod device;
pub mod error;
pub mod memory;
pub mod queue_pair;
pub mod window;

pub use device::{AtomicScope, Device, ProtectionDomain, device_names};
pub use error::{Result, VerbsError};
pub use memory::{Access, LocalMemory, RegisteredBuffer, RegisteredSlice, Registration};
pub use queue_pair::{Endpoint, Local, Op, QueuePair, Remote};
pub use window::MemoryWindow;
