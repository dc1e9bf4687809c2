//! Barriers, mutexes and doorbells (Remote Regions paper §5.9; docs/SEMANTICS.md, "Barriers,
//! mutexes and doorbells"): named
//! objects whose definitions are durable in the store and whose waiting callers live in
//! memory, served as the `Sync` gRPC service.
//!
//! - **Barrier** `n`: the `n`-th caller of a round releases the round; rounds are numbered
//!   (generations, from 1) and the barrier is reused round after round. A barrier has an
//!   8-byte arrival word in the lock region (below) counting arrivals, never reset: clients
//!   arrive with a transport fetch-add and wait by reading the word; `BarrierSleep` blocks
//!   here until the word reaches a round's count (this service reads the word when called,
//!   when a completing client calls `BarrierWake` because [`SLEEPERS`] was set, and on a
//!   short tick). Barriers stored before arrival words existed (`SyncDef::Barrier`) count
//!   arrivals here in memory (`BarrierWait`).
//! - **Doorbell**: a ring count. `BellWait` returns once the count is above what this caller
//!   (host id, pid) saw at its previous wait (0 before its first), and returns the count.
//! - **Mutex**: an 8-byte lock word in a hidden region the manager allocates (one persistent
//!   region with no name, root's, mode 0600, slots 64 bytes apart; a client's capability
//!   reaches its object's slot only). The word is 0 when free, else the holding
//!   thread's tag (host id, pid, tid: `regions_proto::lock_word::tag`), with [`WAITERS`] set while
//!   callers queue here. Clients lock
//!   with a transport compare-and-swap `0 -> tag` and unlock with `tag -> 0`; only when that
//!   fails do they call `MutexLock` / `MutexUnlock`, and the manager (which changes the word
//!   over the transport with the cluster secret, one operation at a time per mutex) queues
//!   them in FIFO order and hands the word straight to the next waiter. A holder loses the
//!   lock when its process exits (its host agent watches it and calls `ReleaseDead`) or when
//!   its host's lease ends.
//!
//! Deleting a mutex or barrier sets [`DELETED`] in its word, so a client still holding the old
//! location finds out instead of touching another object. The slot is reused only after one
//! capability lifetime and a margin ([`SLOT_REUSE_MARGIN_SECS`]): every token for it has
//! expired and every client has located its words again by then; its word is cleared first.
//!
//! Waiting calls end when the caller goes away: tonic drops the call's future and the guards
//! here take the waiter out of its queue.

mod model;
mod objects;
mod runtime;
mod service;

pub use model::{load_record, record_of};
pub use objects::*;
pub use runtime::SyncService;
