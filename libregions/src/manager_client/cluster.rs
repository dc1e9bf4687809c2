//! The manager's cluster service as blocking calls of [`ManagerClient`]: hosts, pools,
//! counters, and the release of an exited owner's regions.

use regions_proto::v1;

use super::ManagerClient;
use super::connections::Connection;
use crate::error::{RegionsError, Result};

/// A mount's cache-lease session (`WatchCacheLeases`): its events, read on a connection of
/// its own.
pub struct CacheLeaseStream {
    connection: Connection,
    stream: tonic::Streaming<v1::CacheLeaseEvent>,
}

/// What [`CacheLeaseStream::next_event`] found.
pub enum LeaseStreamNext {
    Event(v1::CacheLeaseEvent),
    /// The manager ended the session (or went away).
    Ended,
    /// Nothing within the wait.
    Idle,
}

impl CacheLeaseStream {
    /// The next event, waiting at most `wait`.
    pub fn next_event(&mut self, wait: std::time::Duration) -> Result<LeaseStreamNext> {
        let next = self
            .connection
            .block_on(async { tokio::time::timeout(wait, self.stream.message()).await });
        match next {
            Err(_) => Ok(LeaseStreamNext::Idle),
            Ok(Ok(Some(e))) => Ok(LeaseStreamNext::Event(e)),
            Ok(Ok(None)) => Ok(LeaseStreamNext::Ended),
            Ok(Err(status)) => Err(RegionsError::from_status(status)),
        }
    }
}

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

    /// Opens a cache-lease session for a mount on `host_id` (its first event names it).
    pub fn watch_cache_leases(&self, host_id: u32) -> Result<CacheLeaseStream> {
        let connection = self.connections.connect()?;
        let stream = connection
            .run(|mut s| async move {
                s.cluster
                    .watch_cache_leases(v1::WatchCacheLeasesRequest { host_id })
                    .await
            })
            .map_err(RegionsError::from_status)?
            .into_inner();
        Ok(CacheLeaseStream { connection, stream })
    }

    /// Renews cache-lease session `session` (its leases hold a term from now).
    pub fn renew_cache_leases(&self, session: u64) -> Result<()> {
        self.call(|mut s| async move {
            s.cluster
                .renew_cache_leases(v1::RenewCacheLeasesRequest { session })
                .await
        })
        .map(|_| ())
    }

    /// Session `session` dropped what recall `recall` named.
    pub fn cache_lease_recalled(&self, session: u64, recall: u64) -> Result<()> {
        self.call(|mut s| async move {
            s.cluster
                .cache_lease_recalled(v1::CacheLeaseRecalledRequest { session, recall })
                .await
        })
        .map(|_| ())
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
