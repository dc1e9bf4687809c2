//! Counters of the daemon, reported to the host agent's `AgentStats` as `DaemonStats`.

use std::sync::atomic::{AtomicU64, Ordering};

use regions_proto::v1::DaemonStats;

use crate::pools::Pools;

/// Transport counters, updated by every connection.
#[derive(Debug, Default)]
pub struct Stats {
    /// Transport requests served (every op; a vector op counts once).
    pub requests: AtomicU64,
    /// Bytes sent in READ and READV replies.
    pub bytes_read: AtomicU64,
    /// Bytes written by WRITE and WRITEV.
    pub bytes_written: AtomicU64,
    /// Transport connections open now.
    pub connections: AtomicU64,
    /// Transport connections accepted since start.
    pub connections_total: AtomicU64,
}

impl Stats {
    /// Adds `n` to `counter`.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Subtracts 1 from `counter`.
    pub fn dec(counter: &AtomicU64) {
        counter.fetch_sub(1, Ordering::Relaxed);
    }

    /// The counters together with the pools' usage.
    pub fn snapshot(&self, host_id: u32, pools: &Pools, memory_limit: u64) -> DaemonStats {
        let (segments, segment_bytes) = pools.segment_usage();
        DaemonStats {
            host_id,
            transport_requests: self.requests.load(Ordering::Relaxed),
            transport_bytes_read: self.bytes_read.load(Ordering::Relaxed),
            transport_bytes_written: self.bytes_written.load(Ordering::Relaxed),
            transport_connections: self.connections.load(Ordering::Relaxed),
            segments,
            segment_bytes,
            pool_bytes: pools.pool_bytes(),
            memory_limit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reports_counters_and_usage() {
        let stats = Stats::default();
        Stats::add(&stats.requests, 3);
        Stats::add(&stats.connections, 2);
        Stats::dec(&stats.connections);
        let pools = Pools::new();
        pools.add_pool(1, 1 << 20).unwrap();
        let s = stats.snapshot(4, &pools, 2 << 20);
        assert_eq!(
            (s.host_id, s.transport_requests, s.transport_connections),
            (4, 3, 1)
        );
        assert_eq!(
            (s.pool_bytes, s.memory_limit, s.segments),
            (1 << 20, 2 << 20, 0)
        );
    }
}
