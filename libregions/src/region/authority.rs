//! Whose authority a [`super::Region`] acts with (docs/ARCHITECTURE.md, "libregions"): the
//! two ways a client reaches the manager and the daemons for one open region.
//!
//! - [`Authority::Cluster`]: a node component holding the cluster secret (regionfs, tests,
//!   benches) asks the manager itself, as the caller it vouches for, and authenticates its
//!   transports with the secret (one transport per daemon, shared by every region of its
//!   [`Connection`]).
//! - [`Authority::Agent`]: an application that opened a file under a regions mount asks its
//!   host agent, which opens the region as the verified caller and hands back a capability
//!   (region, rights, expiry); the region's transports authenticate with it, and it is
//!   renewed through the agent half-way to its expiry.
//!
//! Everything else about a region (its map, where each byte lives, the local segment, the
//! retry when a daemon says the map or the capability is stale) is the region's own and the
//! same for both.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use regions_proto::capability::now_ms;
use regions_proto::transport_choice::TransportChoice;
use regions_proto::v1;

use crate::agent::{AgentClient, Segment};
use crate::connection::Connection;
use crate::error::{RegionsError, Result};
use crate::transport::tcp::{RetryPolicy, TcpTransport};
use crate::transport::{Transport, TransportStats};

/// Who a region acts as.
pub(crate) enum Authority {
    /// The cluster secret: manager calls as `caller`, secret-authenticated transports.
    Cluster {
        conn: Arc<Connection>,
        caller: v1::Caller,
    },
    /// A capability obtained through this host's agent.
    Agent(Box<AgentSession>),
}

/// A region opened through the host agent: the agent connection and the capability.
pub(crate) struct AgentSession {
    agent: Mutex<AgentClient>,
    host_id: u32,
    /// Device of the mount the region was opened through (0 when opened by inode).
    dev: u64,
    /// Capability token id on this session's connections (random, nonzero).
    cap_id: u64,
    token: Mutex<Vec<u8>>,
    /// When to renew (Unix ms): half-way to the expiry.
    renew_at_ms: AtomicU64,
    transports: Mutex<HashMap<String, Arc<TcpTransport>>>,
    /// The RDMA transports wrapping them (`REGIONS_TRANSPORT` allowing).
    data: Mutex<HashMap<String, Arc<dyn Transport>>>,
    choice: TransportChoice,
    rdma_device: Option<String>,
    stats: Arc<TransportStats>,
    retry: RetryPolicy,
}

/// When a capability expiring at `expires_ms` is renewed: half-way there.
fn renew_at(now: u64, expires_ms: u64) -> u64 {
    now + expires_ms.saturating_sub(now) / 2
}

fn poisoned() -> RegionsError {
    RegionsError::Invalid("region authority lock poisoned by a panic in another thread".into())
}

impl AgentSession {
    /// A session from the agent's open reply `info` (which must carry a capability).
    pub(crate) fn new(
        agent: AgentClient,
        host_id: u32,
        dev: u64,
        info: &v1::RegionInfo,
    ) -> Result<AgentSession> {
        if info.capability.is_empty() {
            return Err(RegionsError::Protocol {
                peer: "host agent".into(),
                reason: "open reply without a transport capability (manager too old?)".into(),
            });
        }
        Ok(AgentSession {
            agent: Mutex::new(agent),
            host_id,
            dev,
            cap_id: rand::random::<u64>() | 1,
            token: Mutex::new(info.capability.clone()),
            renew_at_ms: AtomicU64::new(renew_at(now_ms(), info.capability_expires_ms)),
            transports: Mutex::new(HashMap::new()),
            data: Mutex::new(HashMap::new()),
            // Daemons whose device binds memory windows give capability connections like
            // this session's RDMA through windows over the capability's bytes
            // (docs/SECURITY.md); the others refuse it and the session uses tcp.
            choice: crate::connection::transport_from_env(),
            rdma_device: crate::connection::rdma_device_from_env(),
            stats: Arc::default(),
            retry: RetryPolicy::default(),
        })
    }

    fn agent(&self) -> Result<MutexGuard<'_, AgentClient>> {
        self.agent.lock().map_err(|_| poisoned())
    }

    /// Takes the capability of a map reply, if it carries one, for every transport.
    fn take_capability(&self, info: &v1::RegionInfo) {
        if info.capability.is_empty() {
            return;
        }
        if let Ok(mut token) = self.token.lock() {
            token.clone_from(&info.capability);
        }
        self.renew_at_ms.store(
            renew_at(now_ms(), info.capability_expires_ms),
            Ordering::Relaxed,
        );
        if let Ok(transports) = self.transports.lock() {
            for t in transports.values() {
                t.set_token(&info.capability);
            }
        }
    }

    /// The transport to the daemon at `addr` as the configuration chooses (see
    /// [`crate::connection::wrap_for_rdma`]).
    fn data_transport(&self, addr: &str) -> Result<Arc<dyn Transport>> {
        crate::connection::wrap_for_rdma(
            &self.data,
            addr,
            || self.transport(addr),
            self.choice,
            self.rdma_device.as_deref(),
            &self.stats,
        )
    }

    fn transport(&self, addr: &str) -> Result<Arc<TcpTransport>> {
        let token = self.token.lock().map_err(|_| poisoned())?.clone();
        let mut map = self.transports.lock().map_err(|_| poisoned())?;
        if let Some(t) = map.get(addr) {
            return Ok(Arc::clone(t));
        }
        let t = Arc::new(TcpTransport::with_capability(
            addr,
            self.cap_id,
            &token,
            self.retry,
            Arc::clone(&self.stats),
        ));
        map.insert(addr.to_owned(), Arc::clone(&t));
        Ok(t)
    }
}

impl Authority {
    /// This host's id.
    pub(crate) fn host_id(&self) -> u32 {
        match self {
            Authority::Cluster { conn, .. } => conn.caller.host_id,
            Authority::Agent(s) => s.host_id,
        }
    }

    /// Whether there is a host agent to ask for this host's segment.
    pub(crate) fn has_agent(&self) -> bool {
        match self {
            Authority::Cluster { conn, .. } => conn.config.agent_socket.is_some(),
            Authority::Agent(_) => true,
        }
    }

    /// Device of the mount an agent session was opened through (0 otherwise).
    pub(crate) fn dev(&self) -> u64 {
        match self {
            Authority::Cluster { .. } => 0,
            Authority::Agent(s) => s.dev,
        }
    }

    /// Traffic counters of the transports this region uses.
    pub(crate) fn stats(&self) -> &Arc<TransportStats> {
        match self {
            Authority::Cluster { conn, .. } => &conn.stats,
            Authority::Agent(s) => &s.stats,
        }
    }

    /// Who answered, for protocol errors.
    pub(crate) fn peer(&self) -> &str {
        match self {
            Authority::Cluster { conn, .. } => conn.manager.addr(),
            Authority::Agent(_) => "host agent",
        }
    }

    /// Whether the agent session's capability is past half its life.
    pub(crate) fn renewal_due(&self) -> bool {
        match self {
            Authority::Cluster { .. } => false,
            Authority::Agent(s) => now_ms() >= s.renew_at_ms.load(Ordering::Relaxed),
        }
    }

    /// The region's map if newer than `known` (with a renewed capability through the agent,
    /// which checks permission again and names the open's `handle`: once the manager closed
    /// it, nothing is renewed and the region's chunks on other hosts answer `EIO`).
    pub(crate) fn map(
        &self,
        ino: u64,
        known: u64,
        write: bool,
        handle: u64,
    ) -> Result<v1::RegionInfo> {
        match self {
            Authority::Cluster { conn, caller } => conn.manager.get_map(caller, ino, known),
            Authority::Agent(s) => {
                let info = s.agent()?.map_refresh(ino, known, write, handle)?;
                s.take_capability(&info);
                Ok(info)
            }
        }
    }

    /// Grows the region's size to at least `size` and its chunks to at least `capacity`
    /// (`touch`: sets its mtime now). Through the agent only the size grows (the agent
    /// reserves nothing ahead).
    pub(crate) fn grow(
        &self,
        ino: u64,
        size: u64,
        capacity: u64,
        touch: bool,
    ) -> Result<v1::RegionInfo> {
        match self {
            Authority::Cluster { conn, caller } => {
                conn.manager.grow(caller, ino, size, capacity, touch)
            }
            Authority::Agent(_) if touch => Err(RegionsError::Invalid(
                "a region opened through the host agent cannot set its mtime; write through \
                 the mounted file instead"
                    .into(),
            )),
            Authority::Agent(s) => s.agent()?.map_extend(ino, size, false),
        }
    }

    /// Moves a small region stored as an object to chunks (for what needs region memory).
    pub(crate) fn to_chunks(&self, ino: u64) -> Result<v1::RegionInfo> {
        match self {
            Authority::Cluster { conn, caller } => conn.manager.to_chunks(caller, ino),
            Authority::Agent(s) => s.agent()?.map_extend(ino, 0, true),
        }
    }

    /// Whether this authority's data may go over tcp (not with `--transport rdma`, which
    /// asks for RDMA only).
    pub(crate) fn tcp_allowed(&self) -> bool {
        let choice = match self {
            Authority::Cluster { conn, .. } => conn.config.transport,
            Authority::Agent(s) => s.choice,
        };
        choice != TransportChoice::Rdma
    }

    /// The tcp transport to the daemon at `addr` (object requests go over tcp).
    pub(crate) fn tcp_transport(&self, addr: &str) -> Result<Arc<TcpTransport>> {
        match self {
            Authority::Cluster { conn, .. } => Ok(conn.transport(addr)),
            Authority::Agent(s) => s.transport(addr),
        }
    }

    /// Sets the region's size.
    pub(crate) fn truncate(&self, ino: u64, size: u64) -> Result<v1::RegionInfo> {
        match self {
            Authority::Cluster { conn, caller } => conn.manager.truncate(caller, ino, size),
            Authority::Agent(_) => Err(RegionsError::Invalid(format!(
                "a region opened through the host agent cannot be truncated to {size} bytes: \
                 truncate the mounted file (ftruncate) instead"
            ))),
        }
    }

    /// Closes the open `handle`; `wrote_within_size` as for
    /// [`crate::manager_client::ManagerClient::close`] (the
    /// host agent closes an application's handle as one that may have written past it).
    pub(crate) fn close(&self, handle: u64, wrote_within_size: bool) -> Result<()> {
        match self {
            Authority::Cluster { conn, caller } => conn
                .manager
                .close(caller, handle, wrote_within_size)
                .map(drop),
            Authority::Agent(s) => s.agent()?.map_close(handle),
        }
    }

    /// This host's segment memfd of region `ino`, if this host holds part of it and there is
    /// a host agent to ask; once it is `covering` bytes long if the daemon gets there within
    /// its bounded wait ([`AgentClient::segment_covering`]).
    pub(crate) fn segment(&self, ino: u64, write: bool, covering: u64) -> Result<Option<Segment>> {
        match self {
            Authority::Cluster { conn, .. } => conn.segment(ino, write, covering),
            Authority::Agent(s) => s.agent()?.segment_covering(ino, write, covering),
        }
    }

    /// The transport to the daemon at `addr`.
    pub(crate) fn transport(&self, addr: &str) -> Result<Arc<dyn Transport>> {
        match self {
            Authority::Cluster { conn, .. } => Ok(conn.data_transport(addr)),
            Authority::Agent(s) => s.data_transport(addr),
        }
    }

    /// Every tcp transport opened so far for regions of this authority (a client's
    /// transports are shared by all its regions).
    pub(crate) fn transports(&self) -> Vec<Arc<dyn Transport>> {
        let map = match self {
            Authority::Cluster { conn, .. } => conn.transports(),
            Authority::Agent(s) => s
                .transports
                .lock()
                .map(|m| m.values().cloned().collect())
                .unwrap_or_default(),
        };
        map.into_iter().map(|t| t as Arc<dyn Transport>).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_is_due_half_way() {
        assert_eq!(renew_at(1000, 3000), 2000);
        assert_eq!(renew_at(5000, 3000), 5000);
    }
}
