//! The manager's cluster service as blocking calls of [`ManagerClient`]: hosts, pools,
//! counters, and the release of an exited owner's regions.

use regions_proto::v1;

use super::ManagerClient;
use crate::error::Result;

impl ManagerClient {
    /// Every host.
    pub fn list_hosts(&self) -> Result<Vec<v1::HostRecord>> {
        self.call(|mut s| async move { s.cluster.list_hosts(v1::ListHostsRequest {}).await })
            .map(|r| r.hosts)
    }

    /// Pools of `host_id` (0 = every host).
    pub fn list_pools(&self, host_id: u32) -> Result<Vec<v1::PoolRecord>> {
        self.call(
            |mut s| async move { s.cluster.list_pools(v1::ListPoolsRequest { host_id }).await },
        )
        .map(|r| r.pools)
    }

    /// Cluster counters.
    pub fn stats(&self) -> Result<v1::StatsReply> {
        self.call(|mut s| async move { s.cluster.stats(v1::StatsRequest {}).await })
    }

    /// Owner `pid` on host `host_id` exited: the manager deletes every name of its
    /// non-persistent regions; returns them.
    pub fn release_owner(&self, host_id: u32, pid: u32) -> Result<Vec<u64>> {
        self.call(|mut s| async move {
            s.cluster
                .release_owner(v1::ReleaseOwnerRequest { host_id, pid })
                .await
        })
        .map(|r| r.inos)
    }
}
