//! A client's connection to a cluster: its configuration ([`ClientConfig`]) and what a
//! [`crate::Client`] shares with the regions it opens (the manager connection, the caller,
//! the transports to daemons).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use regions_proto::auth::Secret;
use regions_proto::transport_choice::TransportChoice;
use regions_proto::v1;

use crate::agent::{AgentPool, Segment};
use crate::error::Result;
use crate::manager_client::ManagerClient;
use crate::transport::tcp::{RetryPolicy, TcpTransport};
use crate::transport::{Transport, TransportStats};

/// How a node component (regionfs, a test, a benchmark) reaches a cluster.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Manager address, e.g. `http://127.0.0.1:7070` (`https://` when it serves TLS).
    pub manager: String,
    pub secret: Secret,
    /// CA certificate (PEM) trusted for an `https://` manager (default: `REGIONS_TLS_CA`;
    /// without one the system's roots are trusted).
    pub tls_ca: Option<PathBuf>,
    /// This host's id.
    pub host_id: u32,
    /// Identity requests are made for (defaults to this process).
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub pid: u32,
    /// This host's agent socket, for zero-copy access to regions held here.
    pub agent_socket: Option<PathBuf>,
    /// Bound on retrying an unreachable daemon before `EIO`.
    pub retry: RetryPolicy,
    pub connect_timeout: Duration,
    /// How to reach daemons: RDMA where possible (`auto`, the default), `tcp`, or `rdma`
    /// only (default: `REGIONS_TRANSPORT`).
    pub transport: TransportChoice,
    /// The RDMA device to use (default: `REGIONS_RDMA_DEVICE`, else the first one).
    pub rdma_device: Option<String>,
}

/// Environment variable choosing the transport ([`ClientConfig::transport`]).
pub const TRANSPORT_ENV: &str = "REGIONS_TRANSPORT";
/// Environment variable naming the RDMA device ([`ClientConfig::rdma_device`]).
pub const RDMA_DEVICE_ENV: &str = "REGIONS_RDMA_DEVICE";

/// The RDMA device `REGIONS_RDMA_DEVICE` names, if any.
pub(crate) fn rdma_device_from_env() -> Option<String> {
    std::env::var(RDMA_DEVICE_ENV)
        .ok()
        .filter(|v| !v.is_empty())
}

/// The transport `REGIONS_TRANSPORT` chooses (`auto` when unset; an unknown value is said in
/// the log and taken as `auto`).
pub(crate) fn transport_from_env() -> TransportChoice {
    match std::env::var(TRANSPORT_ENV) {
        Ok(v) => v.parse().unwrap_or_else(|e: String| {
            tracing::warn!(error = %e, "{TRANSPORT_ENV}: using auto");
            TransportChoice::Auto
        }),
        Err(_) => TransportChoice::Auto,
    }
}

/// Environment variable naming the CA certificate of an `https://` manager.
pub const TLS_CA_ENV: &str = "REGIONS_TLS_CA";

impl ClientConfig {
    /// A configuration acting as the current process.
    pub fn new(manager: &str, secret: Secret, host_id: u32) -> ClientConfig {
        // SAFETY: getuid/getgid/getpid cannot fail and touch no memory.
        let (uid, gid, pid) = unsafe { (libc::getuid(), libc::getgid(), libc::getpid()) };
        ClientConfig {
            manager: manager.to_owned(),
            secret,
            tls_ca: std::env::var_os(TLS_CA_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            host_id,
            uid,
            gid,
            groups: Vec::new(),
            pid: pid as u32,
            agent_socket: None,
            retry: RetryPolicy::default(),
            connect_timeout: Duration::from_secs(5),
            transport: transport_from_env(),
            rdma_device: rdma_device_from_env(),
        }
    }
}

/// What a [`crate::Client`] and its regions share: the manager connection, who they act for,
/// the configuration and one tcp transport per daemon.
pub(crate) struct Connection {
    pub(crate) manager: ManagerClient,
    pub(crate) caller: v1::Caller,
    pub(crate) config: ClientConfig,
    pub(crate) stats: Arc<TransportStats>,
    transports: Mutex<HashMap<String, Arc<TcpTransport>>>,
    /// The RDMA transports wrapping them, when [`ClientConfig::transport`] allows RDMA.
    data: Mutex<HashMap<String, Arc<dyn Transport>>>,
    /// Connections to this host's agent, kept for the next request.
    agents: Option<AgentPool>,
}

impl Connection {
    pub(crate) fn new(manager: ManagerClient, caller: v1::Caller, config: ClientConfig) -> Self {
        Connection {
            manager,
            caller,
            stats: Arc::default(),
            transports: Mutex::new(HashMap::new()),
            data: Mutex::new(HashMap::new()),
            agents: config.agent_socket.clone().map(AgentPool::new),
            config,
        }
    }

    /// This host's segment of region `ino` from the host agent (none without an agent
    /// socket), waiting for it to cover `covering` bytes ([`AgentClient::segment_covering`]).
    pub(crate) fn segment(&self, ino: u64, write: bool, covering: u64) -> Result<Option<Segment>> {
        match &self.agents {
            Some(agents) => agents.segment(ino, write, covering),
            None => Ok(None),
        }
    }

    /// Every tcp transport opened so far.
    pub(crate) fn transports(&self) -> Vec<Arc<TcpTransport>> {
        self.transports
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The transport requests to the daemon at `addr` use: RDMA over its tcp transport where
    /// the configuration allows RDMA (one per daemon, shared), else the tcp one.
    pub(crate) fn data_transport(&self, addr: &str) -> Arc<dyn Transport> {
        let made = wrap_for_rdma(
            &self.data,
            addr,
            || Ok(self.transport(addr)),
            self.config.transport,
            self.config.rdma_device.as_deref(),
            &self.stats,
        );
        // The tcp maker cannot fail here.
        made.unwrap_or_else(|_| self.transport(addr))
    }

    /// The tcp transport to the daemon at `addr` (one per daemon, shared).
    pub(crate) fn transport(&self, addr: &str) -> Arc<TcpTransport> {
        let make = || {
            Arc::new(TcpTransport::new(
                addr,
                &self.config.secret,
                self.config.retry,
                Arc::clone(&self.stats),
            ))
        };
        match self.transports.lock() {
            // Every remote read asks: look up without copying the address
            // (`entry` would allocate a key per call).
            Ok(mut map) => match map.get(addr) {
                Some(t) => Arc::clone(t),
                None => Arc::clone(map.entry(addr.to_owned()).or_insert_with(make)),
            },
            Err(_) => make(),
        }
    }
}

/// The transport for `addr` as `choice` says, kept in `cache`: under `tcp`, the tcp transport
/// `tcp` makes (or finds); else, at the first request to the daemon, an RDMA transport wrapping
/// it (feature `rdma`), or under `auto` on a host without an RDMA device the tcp transport
/// itself, so that nothing of RDMA sits on the path of every request (a device that appears
/// later is used by clients made after it).
pub(crate) fn wrap_for_rdma(
    cache: &Mutex<HashMap<String, Arc<dyn Transport>>>,
    addr: &str,
    tcp: impl FnOnce() -> Result<Arc<TcpTransport>>,
    choice: TransportChoice,
    device: Option<&str>,
    stats: &Arc<crate::transport::TransportStats>,
) -> Result<Arc<dyn Transport>> {
    if choice == TransportChoice::Tcp {
        return Ok(tcp()?);
    }
    #[cfg(feature = "rdma")]
    {
        let Ok(mut map) = cache.lock() else {
            return Ok(tcp()?);
        };
        if let Some(t) = map.get(addr) {
            return Ok(Arc::clone(t));
        }
        let chosen = rdma_or_tcp(tcp()?, choice, device, stats);
        map.insert(addr.to_owned(), Arc::clone(&chosen));
        Ok(chosen)
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (cache, addr, device, stats);
        Ok(tcp()?)
    }
}

/// `tcp` as `choice` says: itself under `tcp`, and under `auto` on a host without an RDMA
/// device; else an RDMA transport wrapping it (feature `rdma`).
pub(crate) fn rdma_or_tcp(
    tcp: Arc<TcpTransport>,
    choice: TransportChoice,
    device: Option<&str>,
    stats: &Arc<crate::transport::TransportStats>,
) -> Arc<dyn Transport> {
    #[cfg(feature = "rdma")]
    match (choice, crate::transport::rdma::protection_domain(device)) {
        (TransportChoice::Tcp, _) => tcp,
        (TransportChoice::Auto, Err(why)) => {
            tracing::debug!(daemon = %tcp.addr(), reason = %why, "no RDMA here: using tcp");
            tcp
        }
        _ => Arc::new(crate::transport::rdma::RdmaTransport::new(
            tcp,
            choice,
            device.map(str::to_owned),
            Arc::clone(stats),
        )),
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (choice, device, stats);
        tcp
    }
}
