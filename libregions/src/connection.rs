//! A client's connection to a cluster: its configuration ([`ClientConfig`]) and what a
//! [`crate::Client`] shares with the regions it opens (the manager connection, the caller,
//! the transports to daemons).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use regions_proto::auth::Secret;
use regions_proto::v1;

use crate::agent::{AgentPool, Segment};
use crate::error::Result;
use crate::manager_client::ManagerClient;
use crate::transport::TransportStats;
use crate::transport::tcp::{RetryPolicy, TcpTransport};

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
