//! [`Daemon`]: the transport server, the host agent and the manager session started together,
//! in-process (the `regions-daemon` binary, `regionfs up`, tests).

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use regions_proto::v1::DaemonStats;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::{AgentHandler, AgentServer};
use crate::config::Config;
use crate::error::{DaemonError, Result};
use crate::manager_client::{ManagerAuthority, ManagerClients, normalize_url};
use crate::pools::Pools;
use crate::registration::{Registration, RegistrationStatus};
use crate::stats::Stats;
use crate::transport::TransportServer;

/// A running daemon.
///
/// [`Daemon::start`] returns once the host and its pool are registered, the chunk tables are in
/// step with the manager, both servers are serving and the ready file (if any) is written.
/// [`Daemon::shutdown`] (or dropping it) stops everything and removes the agent socket.
#[derive(Debug)]
pub struct Daemon {
    host_id: u32,
    memory: u64,
    advertised: String,
    socket: PathBuf,
    pools: Arc<Pools>,
    objects: Option<Arc<crate::objects::ObjectStore>>,
    stats: Arc<Stats>,
    status: Arc<RegistrationStatus>,
    incarnation: u64,
    transport: Option<TransportServer>,
    agent: Option<AgentServer>,
    stop: watch::Sender<bool>,
    session: Option<JoinHandle<()>>,
}

impl Daemon {
    /// Starts a daemon. Needs a multi-threaded tokio runtime (the host agent's threads call the
    /// manager through it).
    pub async fn start(config: Config) -> Result<Daemon> {
        config.validate()?;
        if tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::CurrentThread
        {
            return Err(DaemonError::Config(
                "the daemon needs a multi-threaded tokio runtime".into(),
            ));
        }
        if let Some(addr) = config.metrics_listen {
            regions_proto::metrics::serve(addr).map_err(|e| DaemonError::Config(e.to_string()))?;
        }
        let clients =
            ManagerClients::new(&config.manager, &config.secret, config.tls_ca.as_deref())?;
        let listener = TransportServer::bind(config.listen)?;
        let bound = listener
            .local_addr()
            .map_err(|e| DaemonError::sys("transport listener address", e))?;
        let advertised = advertise(&config, bound)?;
        let agent_listener = AgentServer::bind(&config.socket)?;

        let pools = Arc::new(Pools::new());
        let objects = match config.object_memory {
            0 => None,
            bytes => {
                let store = crate::objects::ObjectStore::new(bytes)?;
                store.set_auto_compaction(config.object_auto_compaction);
                store.set_correction_grace(config.object_correction_grace);
                Some(Arc::new(store))
            }
        };
        let stats = Arc::new(Stats::default());
        let status = Arc::new(RegistrationStatus::default());
        let authority: Arc<dyn crate::manager_client::Authority> = Arc::new(ManagerAuthority::new(
            clients.clone(),
            tokio::runtime::Handle::current(),
        ));
        let handles = Arc::new(crate::agent::open_handles::OpenHandles::default());
        let release = crate::agent::owners::releaser(Arc::clone(&authority), config.host_id);
        let on_exit: crate::agent::owners::OnExit = {
            let (handles, authority) = (Arc::clone(&handles), Arc::clone(&authority));
            // Handles first: an unlinked region the process held goes with its last handle.
            Arc::new(move |pid| {
                let closed = handles.close_all(pid, authority.as_ref());
                release(pid) && closed
            })
        };
        let owners = crate::agent::owners::OwnerWatch::start(on_exit)
            .map_err(|e| DaemonError::sys("starting the region-owner watcher thread", e))?;
        let handler = AgentHandler {
            host_id: config.host_id,
            pools: Arc::clone(&pools),
            stats: Arc::clone(&stats),
            memory_limit: config.pool_memory(),
            objects: objects.clone(),
            authority,
            owners: Some(Arc::new(owners)),
            handles,
            segment_writers: config.segment_writers,
            sync: Some(Arc::new(
                crate::agent::sync::SyncAgent::start(
                    &clients,
                    tokio::runtime::Handle::current(),
                    config.host_id,
                )
                .map_err(|e| DaemonError::sys("starting the sync pid watcher thread", e))?,
            )),
        };
        // RDMA opens before the agent serves: a daemon applying atomics through its device
        // says so with every segment the agent hands out.
        let rdma = open_rdma(&config.rdma)?;
        if rdma.routes_atomics() {
            pools.route_atomics_through_device();
        }
        rdma.watch(&pools);
        let agent = match AgentServer::start(agent_listener, &config.socket, handler) {
            Ok(a) => a,
            Err(e) => {
                let _ = std::fs::remove_file(&config.socket);
                return Err(e);
            }
        };
        let transport = TransportServer::start(
            listener,
            Arc::clone(&pools),
            config.secret.clone(),
            Arc::clone(&stats),
            config.transport,
        )?;
        if let Some(store) = &objects {
            transport.serve_objects(Arc::clone(store));
        }
        let transports = rdma.serve(&transport);
        let mut registration = Registration::new(
            clients,
            config.host_id,
            advertised.clone(),
            config.socket.display().to_string(),
            config.pool_memory(),
            config.heartbeat,
            Arc::clone(&pools),
            Arc::clone(&status),
        )
        .with_destructive_event_delay(config.destructive_event_delay)
        .with_transports(transports)
        .with_object_memory(objects.as_ref().map_or(0, |s| s.capacity()));
        let incarnation = registration.incarnation();
        // On error the servers drop here: threads stop and the socket file goes.
        let first = registration
            .register_at_startup(config.startup_timeout)
            .await?;
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(crate::stats::run_gauges(
            Arc::clone(&pools),
            Arc::clone(&stats),
            config.pool_memory(),
            stop_rx.clone(),
        ));
        let session = tokio::spawn(registration.run(first, stop_rx));
        if let Some(path) = &config.ready_file {
            write_ready_file(path, &advertised)?;
        }
        tracing::info!(
            host = config.host_id,
            transport = %advertised,
            socket = %config.socket.display(),
            memory = config.pool_memory(),
            "daemon ready"
        );
        Ok(Daemon {
            host_id: config.host_id,
            memory: config.pool_memory(),
            advertised,
            socket: config.socket.clone(),
            pools,
            objects,
            stats,
            status,
            incarnation,
            transport: Some(transport),
            agent: Some(agent),
            stop,
            session: Some(session),
        })
    }

    /// This host's id.
    pub fn host_id(&self) -> u32 {
        self.host_id
    }

    /// This start's incarnation (as registered).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The address the transport listens on.
    pub fn transport_addr(&self) -> Option<SocketAddr> {
        self.transport.as_ref().map(TransportServer::local_addr)
    }

    /// The transport address announced to the manager (and written to the ready file).
    pub fn advertised_addr(&self) -> &str {
        &self.advertised
    }

    /// The host-agent socket.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The object store of small regions (`None` with `--object-memory 0`).
    pub fn objects(&self) -> Option<&Arc<crate::objects::ObjectStore>> {
        self.objects.as_ref()
    }

    /// The pools and their chunk tables.
    pub fn pools(&self) -> &Arc<Pools> {
        &self.pools
    }

    /// Sequence number of the last manager event applied.
    pub fn last_sequence(&self) -> u64 {
        self.status.last_sequence.load(Ordering::Relaxed)
    }

    /// Successful registrations with the manager since start.
    pub fn registrations(&self) -> u64 {
        self.status.registrations.load(Ordering::Relaxed)
    }

    /// Manager events applied since start.
    pub fn events_applied(&self) -> u64 {
        self.status.events.load(Ordering::Relaxed)
    }

    /// The daemon's counters (as the host agent's `AgentStats` reports them).
    pub fn stats(&self) -> DaemonStats {
        self.stats.snapshot(
            self.host_id,
            &self.pools,
            self.objects.as_deref(),
            self.memory,
        )
    }

    /// Stops the manager session and both servers, removes the agent socket.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(session) = self.session.take()
            && tokio::time::timeout(Duration::from_secs(5), session)
                .await
                .is_err()
        {
            tracing::warn!("the manager session did not stop in time");
        }
        self.stop_servers();
        tracing::info!(host = self.host_id, "daemon stopped");
    }

    fn stop_servers(&mut self) {
        if let Some(mut t) = self.transport.take() {
            t.shutdown();
        }
        if let Some(mut a) = self.agent.take() {
            a.shutdown();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(session) = self.session.take() {
            session.abort();
        }
        self.stop_servers();
    }
}

/// The transport address to announce: `--advertise`, else the bound address; a wildcard bound
/// address is replaced by the local address that reaches the manager.
fn advertise(config: &Config, bound: SocketAddr) -> Result<String> {
    if let Some(a) = &config.advertise {
        return Ok(a.clone());
    }
    if !bound.ip().is_unspecified() {
        return Ok(bound.to_string());
    }
    let url = normalize_url(&config.manager);
    let authority = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_owned();
    let local = authority
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .and_then(|manager| {
            let any: SocketAddr = if manager.is_ipv4() {
                SocketAddr::from(([0, 0, 0, 0], 0))
            } else {
                SocketAddr::from(([0u16; 8], 0))
            };
            let socket = UdpSocket::bind(any).ok()?;
            socket.connect(manager).ok()?;
            socket.local_addr().ok()
        });
    match local {
        Some(local) => Ok(SocketAddr::new(local.ip(), bound.port()).to_string()),
        None => Err(DaemonError::Config(format!(
            "the transport listens on the wildcard address {bound} and the address that \
             reaches the manager ({authority}) cannot be found: set --advertise host:port"
        ))),
    }
}

/// Writes `contents` to `path` atomically (temporary file + rename).
fn write_ready_file(path: &Path, contents: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| DaemonError::sys(format!("cannot write the ready file {}", path.display()), e))
}

/// Serves RDMA on the transport as `rdma` says: `tcp` never; `auto` when a device opens
/// (else tcp only, said once in the log); `rdma` or fail. Returns the transports served, as
/// registration reports them ("tcp", "tcp rdma:rxe0").
/// What [`open_rdma`] opened: the device (feature `rdma`), and the transports this daemon
/// offers ("tcp", or "tcp rdma:DEVICE").
struct RdmaStart {
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<crate::rdma::Rdma>>,
    offered: String,
}

impl RdmaStart {
    /// Whether every atomic on pool memory goes through the device.
    fn routes_atomics(&self) -> bool {
        #[cfg(feature = "rdma")]
        {
            self.rdma.as_ref().is_some_and(|r| r.routes_atomics())
        }
        #[cfg(not(feature = "rdma"))]
        {
            false
        }
    }

    /// Drops applications' memory windows as `pools`' revocations change and as their
    /// capabilities expire.
    fn watch(&self, pools: &Pools) {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            r.watch(pools.revocations());
        }
        #[cfg(not(feature = "rdma"))]
        let _ = pools;
    }

    /// Serves RDMA beside `transport` (when a device was opened); returns the transports
    /// offered.
    fn serve(self, transport: &TransportServer) -> String {
        #[cfg(feature = "rdma")]
        if let Some(r) = self.rdma {
            transport.serve_rdma(r);
        }
        #[cfg(not(feature = "rdma"))]
        let _ = transport;
        self.offered
    }
}

/// Opens the RDMA device `rdma` asks for: none under `tcp`; under `auto` the one found, or
/// none; under `rdma` the one found or the error.
fn open_rdma(rdma: &crate::config::RdmaConfig) -> Result<RdmaStart> {
    use regions_proto::transport_choice::TransportChoice;
    let tcp_only = || RdmaStart {
        #[cfg(feature = "rdma")]
        rdma: None,
        offered: "tcp".into(),
    };
    if rdma.choice == TransportChoice::Tcp {
        return Ok(tcp_only());
    }
    #[cfg(feature = "rdma")]
    match crate::rdma::Rdma::open(rdma.device.as_deref(), rdma.gid_index) {
        Ok(r) => {
            tracing::info!(
                device = r.device_name(),
                atomics = ?r.atomic_scope(),
                atomics_through_device = r.routes_atomics(),
                applications = r.serves_capabilities(),
                "serving RDMA beside tcp"
            );
            let offered = format!("tcp rdma:{}", r.device_name());
            Ok(RdmaStart {
                rdma: Some(Arc::new(r)),
                offered,
            })
        }
        Err(e) if rdma.choice == TransportChoice::Auto => {
            tracing::info!(reason = %e, "no RDMA: serving tcp only");
            Ok(tcp_only())
        }
        Err(e) => Err(e),
    }
    #[cfg(not(feature = "rdma"))]
    {
        if rdma.choice == TransportChoice::Rdma {
            return Err(crate::error::DaemonError::NoRdma(
                "--transport rdma: this daemon was built without the rdma feature".into(),
            ));
        }
        Ok(tcp_only())
    }
}

#[cfg(test)]
mod tests {
    use regions_proto::auth::Secret;

    use super::*;

    fn config() -> Config {
        Config::new(
            "http://127.0.0.1:7070",
            1,
            1 << 20,
            PathBuf::from("/tmp/x.sock"),
            Secret::new("s").unwrap(),
        )
    }

    #[test]
    fn advertised_addresses() {
        let mut c = config();
        let bound: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(advertise(&c, bound).unwrap(), "127.0.0.1:4000");
        let wild: SocketAddr = "0.0.0.0:4000".parse().unwrap();
        assert_eq!(advertise(&c, wild).unwrap(), "127.0.0.1:4000");
        c.advertise = Some("h:1".into());
        assert_eq!(advertise(&c, wild).unwrap(), "h:1");
    }

    #[test]
    fn ready_file_is_replaced_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ready");
        write_ready_file(&path, "127.0.0.1:1").unwrap();
        write_ready_file(&path, "127.0.0.1:2").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "127.0.0.1:2");
        assert!(write_ready_file(&dir.path().join("no/such/dir"), "x").is_err());
    }

    #[tokio::test]
    async fn needs_a_multi_threaded_runtime() {
        let err = Daemon::start(config()).await.unwrap_err();
        assert!(err.to_string().contains("multi-threaded"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn startup_errors_say_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config();
        c.socket = dir.path().join("missing-dir").join("d.sock");
        let err = Daemon::start(c.clone()).await.unwrap_err();
        assert!(err.to_string().contains("mkdir -p"), "{err}");
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        c.listen = taken.local_addr().unwrap();
        c.socket = dir.path().join("d.sock");
        let err = Daemon::start(c).await.unwrap_err();
        assert!(err.to_string().contains("pick another --listen"), "{err}");
        assert!(!dir.path().join("d.sock").exists());
    }
}
