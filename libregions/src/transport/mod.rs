//! The data plane between a client and the memory of a region (docs/ARCHITECTURE.md,
//! "Data plane"): one-sided reads, writes and 8-byte atomics.
//!
//! Backends: [`tcp`] (a daemon serves the ops; the default without RDMA) and
//! [`local`] (the region's segment memfd mapped into this process). An
//! [`rdma`] backend (feature `rdma`: one-sided reads and writes over a queue pair, the rest
//! over tcp) wraps the tcp one behind the same trait.

pub mod local;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod tcp;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::Result;

/// One contiguous piece of a region: where it is in the region and where
/// its bytes live in a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The region (inode) the span belongs to, named in transport requests so
    /// that the daemon refuses (`ESTALE`) an access through a stale map to a
    /// chunk that now backs another region; 0 names none.
    pub ino: u64,
    pub region_offset: u64,
    pub pool: u32,
    pub pool_offset: u64,
    pub len: u64,
}

impl Span {
    /// Grows this span by `next` when `next` continues it both in the region and in the
    /// pool (then one request carries both); says whether it did.
    pub fn absorb(&mut self, next: &Span) -> bool {
        let continues = self.ino == next.ino
            && self.pool == next.pool
            && self.region_offset.checked_add(self.len) == Some(next.region_offset)
            && self.pool_offset.checked_add(self.len) == Some(next.pool_offset);
        match self.len.checked_add(next.len) {
            Some(len) if continues => {
                self.len = len;
                true
            }
            _ => false,
        }
    }
}

/// A write sent without waiting for its reply ([`Transport::post_write`]): its bytes, kept
/// until the daemon said it applied them.
#[derive(Debug)]
pub struct PostedWrite {
    /// Who posted it ([`Transport::post_write`]'s `owner`).
    pub owner: u64,
    pub spans: Vec<Span>,
    /// The spans' bytes, in order.
    pub data: Vec<u8>,
}

/// Settles the posted writes on every one of `transports` and returns the first of
/// `owner`'s that did not land ([`Transport::settle_writes`]).
pub(crate) fn first_lost_write(
    transports: impl IntoIterator<Item = std::sync::Arc<dyn Transport>>,
    owner: u64,
) -> Option<crate::error::RegionsError> {
    let mut first = None;
    for t in transports {
        if let Some(e) = t.settle_writes(owner) {
            first.get_or_insert(e);
        }
    }
    first
}

/// Where the outcome of a posted atomic goes. It runs on whichever thread reads the reply
/// and must be short: hand longer work to another thread.
pub type Completion = Box<dyn FnOnce(Result<u64>) + Send>;

/// One-sided access to region memory.
pub trait Transport: Send + Sync {
    /// Fills `dst` (whose length is the sum of the spans' lengths) with the
    /// spans' bytes, in order.
    fn read(&self, spans: &[Span], dst: &mut [u8]) -> Result<()>;
    /// Writes `src` (the spans' bytes, in order).
    fn write(&self, spans: &[Span], src: &[u8]) -> Result<()>;
    /// Compares the 8-byte word at `at` with `expected` and, if equal,
    /// replaces it with `new`; returns the old value.
    fn compare_and_swap(&self, at: &Span, expected: u64, new: u64) -> Result<u64>;
    /// Adds `addend` to the 8-byte word at `at`; returns the old value.
    fn fetch_add(&self, at: &Span, addend: u64) -> Result<u64>;
    /// Waits until the 8-byte word at `at` differs from `expected` (changed by an atomic of
    /// any transport) or `timeout` passed, and returns its value then. Transports may return
    /// sooner (the caller checks and asks again); the default polls.
    fn wait_change(&self, at: &Span, expected: u64, timeout: Duration) -> Result<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.fetch_add(at, 0)?;
            if seen != expected || Instant::now() >= deadline {
                return Ok(seen);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    /// Whether [`Transport::post_compare_and_swap`] returns before the swap is done (else
    /// posting gains nothing).
    fn posts_atomics(&self) -> bool {
        false
    }
    /// Compare-and-swap whose caller does not wait for the old value: `done` gets it (or
    /// the error), on some thread, later. Atomics this transport is asked for afterwards are
    /// applied after it. `Err` here: nothing was sent, `done` is dropped uncalled. The
    /// default does it at once.
    fn post_compare_and_swap(
        &self,
        at: &Span,
        expected: u64,
        new: u64,
        done: Completion,
    ) -> Result<()> {
        done(self.compare_and_swap(at, expected, new));
        Ok(())
    }
    /// Whether [`Transport::post_write`] can return before the write is applied (else
    /// posting gains nothing).
    /// Tells the daemon's waiters of the word at `at` (`wait_change`) that it changed, after
    /// an atomic this transport applied where the daemon does not see it (one-sided over
    /// RDMA); nothing to do for the others. Posted where the transport can: the call does not
    /// wait for the daemon.
    fn wake_waiters(&self, at: &Span) {
        let _ = at;
    }

    fn posts_writes(&self) -> bool {
        false
    }
    /// Writes `src` (the spans' bytes) without waiting for the daemon to apply it, on behalf
    /// of `owner` (a number naming what is written, such as a region's inode). Reads,
    /// writes and atomics asked of this transport afterwards are applied after it; if it
    /// does not land, [`Transport::settle_writes`] says so. `false`: not sent (this
    /// transport does not post now): the caller writes the usual way.
    fn post_write(&self, owner: u64, spans: &[Span], src: &[u8]) -> bool {
        let _ = (owner, spans, src);
        false
    }
    /// Waits until every posted write landed (or failed for good).
    fn wait_writes(&self) {}
    /// [`Transport::wait_writes`], then returns the first posted write of `owner`'s that
    /// did not land, every time until [`Transport::forget_failed_writes`].
    fn settle_writes(&self, owner: u64) -> Option<crate::error::RegionsError> {
        let _ = owner;
        None
    }
    /// Forgets `owner`'s failed posted write (no one writes for it any more).
    fn forget_failed_writes(&self, owner: u64) {
        let _ = owner;
    }
    /// Short name for logs ("tcp 127.0.0.1:7101", "local").
    fn describe(&self) -> String;
}

/// Counters of traffic through transports.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Requests sent to daemons (vector ops count once).
    pub remote_requests: AtomicU64,
    pub remote_bytes_read: AtomicU64,
    pub remote_bytes_written: AtomicU64,
    /// Bytes moved through locally mapped segments.
    pub local_bytes_read: AtomicU64,
    pub local_bytes_written: AtomicU64,
    /// Connections opened to daemons.
    pub connections: AtomicU64,
    /// Reads and writes served one-sided over RDMA, and their bytes.
    pub rdma_requests: AtomicU64,
    pub rdma_bytes_read: AtomicU64,
    pub rdma_bytes_written: AtomicU64,
    /// 8-byte atomics applied one-sided over RDMA.
    pub rdma_atomics: AtomicU64,
}

/// A copy of [`TransportStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub remote_requests: u64,
    pub remote_bytes_read: u64,
    pub remote_bytes_written: u64,
    pub local_bytes_read: u64,
    pub local_bytes_written: u64,
    pub connections: u64,
    pub rdma_requests: u64,
    pub rdma_bytes_read: u64,
    pub rdma_bytes_written: u64,
    pub rdma_atomics: u64,
}

impl TransportStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            remote_requests: get(&self.remote_requests),
            remote_bytes_read: get(&self.remote_bytes_read),
            remote_bytes_written: get(&self.remote_bytes_written),
            local_bytes_read: get(&self.local_bytes_read),
            local_bytes_written: get(&self.local_bytes_written),
            connections: get(&self.connections),
            rdma_requests: get(&self.rdma_requests),
            rdma_bytes_read: get(&self.rdma_bytes_read),
            rdma_bytes_written: get(&self.rdma_bytes_written),
            rdma_atomics: get(&self.rdma_atomics),
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::Span;

    fn span(ino: u64, region_offset: u64, pool: u32, pool_offset: u64, len: u64) -> Span {
        Span {
            ino,
            region_offset,
            pool,
            pool_offset,
            len,
        }
    }

    #[test]
    fn a_span_absorbs_only_what_continues_it_in_region_and_pool() {
        let mut a = span(7, 0, 1, 4096, 100);
        assert!(a.absorb(&span(7, 100, 1, 4196, 50)));
        assert_eq!(a, span(7, 0, 1, 4096, 150));
        // A gap in the region, a gap in the pool, another pool, another region: kept apart.
        for next in [
            span(7, 151, 1, 4246, 10),
            span(7, 150, 1, 4247, 10),
            span(7, 150, 2, 4246, 10),
            span(8, 150, 1, 4246, 10),
        ] {
            assert!(!a.absorb(&next), "{next:?}");
            assert_eq!(a.len, 150);
        }
        // Offsets at the top of the range never wrap into a match.
        let mut top = span(7, u64::MAX - 1, 1, 0, 2);
        assert!(!top.absorb(&span(7, 0, 1, 2, 1)));
    }
}
