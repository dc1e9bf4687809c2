//! Counters of the daemon, reported to the host agent's `AgentStats` as `DaemonStats`, and
//! its Prometheus metrics (served with `--metrics-listen`, see `regions_proto::metrics`):
//!
//! - `regions_daemon_transport_requests_total{op}`, `regions_daemon_transport_errors_total{op}`
//!   and `regions_daemon_transport_request_duration_seconds{op}` (op: read, write, readv,
//!   writev, cas, fetch-add, wait-change, ping, hello);
//!   `regions_daemon_transport_bytes_total{direction}` (`out`: sent in read replies, `in`:
//!   written into region memory); `regions_daemon_transport_connections`.
//! - `regions_daemon_agent_requests_total{call, result}` and
//!   `regions_daemon_agent_request_duration_seconds{call}` (the host agent).
//! - `regions_daemon_pool_capacity_bytes`, `_pool_allocated_bytes` (chunks assigned to
//!   regions), `_pool_free_bytes`, `_memory_limit_bytes`, `_segments`, `_segment_bytes`
//!   (memory the segments hold), refreshed every second.
//! - `regions_daemon_heartbeat_failures_total`.
//! - `regions_daemon_device_atomics_total`: atomics of tcp clients the daemon applied through
//!   its RDMA device (where the device's atomics exclude only one another).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{counter, gauge};
use regions_proto::metrics::{GAUGE_PERIOD, enabled};
use regions_proto::v1::{DaemonStats, ObjectClassStats};
use tokio::sync::watch;

use crate::objects::ObjectStore;
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
    /// 8-byte atomics the daemon applied through its RDMA device (see
    /// `Rdma::routes_atomics`).
    pub device_atomics: AtomicU64,
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

    /// `n` bytes sent in a READ or READV reply.
    pub fn bytes_out(&self, n: u64) {
        Stats::add(&self.bytes_read, n);
        counter!("regions_daemon_transport_bytes_total", "direction" => "out").increment(n);
    }

    /// `n` bytes written into region memory by WRITE or WRITEV.
    pub fn bytes_in(&self, n: u64) {
        Stats::add(&self.bytes_written, n);
        counter!("regions_daemon_transport_bytes_total", "direction" => "in").increment(n);
    }

    /// The counters together with the pools' usage.
    pub fn snapshot(
        &self,
        host_id: u32,
        pools: &Pools,
        objects: Option<&ObjectStore>,
        memory_limit: u64,
    ) -> DaemonStats {
        let (segments, segment_bytes) = pools.segment_usage();
        let object_classes = objects.map_or_else(Vec::new, |store| {
            store
                .stats()
                .into_iter()
                .filter(|c| c.blocks > 0 || c.compactions > 0)
                .map(|c| ObjectClassStats {
                    slot_size: c.slot_size,
                    blocks: c.blocks,
                    objects: c.objects,
                    live_bytes: c.live_bytes,
                    block_bytes: c.block_bytes,
                    fragmentation: c.fragmentation,
                    compactions: c.compactions,
                    moved_objects: c.moved_objects,
                    indirect: c.indirect,
                })
                .collect()
        });
        DaemonStats {
            object_classes,
            object_bytes: objects.map_or(0, ObjectStore::allocated_bytes),
            object_memory: objects.map_or(0, ObjectStore::capacity),
            host_id,
            transport_requests: self.requests.load(Ordering::Relaxed),
            transport_bytes_read: self.bytes_read.load(Ordering::Relaxed),
            transport_bytes_written: self.bytes_written.load(Ordering::Relaxed),
            transport_connections: self.connections.load(Ordering::Relaxed),
            segments,
            segment_bytes,
            pool_bytes: pools.pool_bytes(),
            memory_limit,
            device_atomics: self.device_atomics.load(Ordering::Relaxed),
        }
    }
}

/// Refreshes the pool gauges every [`GAUGE_PERIOD`] until `stop` turns true; returns at once
/// when this process serves no metrics.
pub async fn run_gauges(
    pools: Arc<Pools>,
    stats: Arc<Stats>,
    memory_limit: u64,
    mut stop: watch::Receiver<bool>,
) {
    if !enabled() {
        return;
    }
    loop {
        let capacity = pools.pool_bytes();
        let allocated = pools.assigned_bytes();
        let (segments, segment_bytes) = pools.segment_usage();
        gauge!("regions_daemon_pool_capacity_bytes").set(capacity as f64);
        gauge!("regions_daemon_pool_allocated_bytes").set(allocated as f64);
        gauge!("regions_daemon_pool_free_bytes").set(capacity.saturating_sub(allocated) as f64);
        gauge!("regions_daemon_memory_limit_bytes").set(memory_limit as f64);
        gauge!("regions_daemon_segments").set(segments as f64);
        gauge!("regions_daemon_segment_bytes").set(segment_bytes as f64);
        gauge!("regions_daemon_transport_connections")
            .set(stats.connections.load(Ordering::Relaxed) as f64);
        tokio::select! {
            () = tokio::time::sleep(GAUGE_PERIOD) => {}
            _ = stop.wait_for(|s| *s) => return,
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
        let s = stats.snapshot(4, &pools, None, 2 << 20);
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
