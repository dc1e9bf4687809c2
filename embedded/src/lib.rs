//! A whole single-host cluster in one process, the embedded default behind `regionfs up`
//! (docs/ARCHITECTURE.md, "Processes"): the manager (its store under `DATA_DIR/manager`), the
//! daemon (host 1, agent socket `DATA_DIR/agent.sock`) and, started by the caller, the mount.
//! The cluster secret is generated into `DATA_DIR/secret` (mode 0600) the first time.
//!
//! A crate of its own above the manager and the daemon, so that the file system
//! (`regionfs`) depends on neither; the `regionfs` binary (`cli/`) and the file system's own
//! tests use it.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regions::ClientConfig;
use regions_daemon::{Daemon, DaemonError};
use regions_manager::{Config as ManagerConfig, Manager, server};
use regions_proto::auth::Secret;
use tokio::sync::oneshot;

/// The host id of the embedded daemon and mount.
pub const HOST_ID: u32 = 1;

/// Why the embedded cluster could not start.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    /// A system call failed.
    #[error("{what}: {cause}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The manager's port is taken.
    #[error(
        "cannot listen on {addr} for the manager: {cause}; pick another --listen (port 0 picks a free one)"
    )]
    ManagerPort {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The transport's port is taken.
    #[error(
        "cannot listen on {addr} for the data transport: {cause}; pick another --transport-listen (port 0 picks a free one)"
    )]
    TransportPort {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The manager's store cannot open.
    #[error(
        "the manager's store: {0}; is another `regionfs up` or regions-manager using this --data-dir?"
    )]
    Store(String),
    /// The secret cannot be read.
    #[error("the secret: {0}")]
    Secret(String),
    /// The daemon cannot start.
    #[error("the daemon: {0}")]
    Daemon(String),
}

/// Settings of the embedded cluster.
#[derive(Clone, Debug)]
pub struct UpConfig {
    /// State directory.
    pub data_dir: PathBuf,
    /// Memory the daemon offers, in bytes.
    pub memory: u64,
    /// The manager's gRPC address.
    pub listen: SocketAddr,
    /// The daemon's transport address.
    pub transport_listen: SocketAddr,
    /// Writable segment descriptors for every local writer, not only root and the daemon's
    /// user.
    pub share_writable_segments: bool,
    /// Which transports the daemon serves and the mount uses (`--transport`,
    /// `--rdma-device`).
    pub transport: regions_proto::transport_choice::TransportChoice,
    pub rdma_device: Option<String>,
    /// Regions of at most this many bytes are stored as objects (the manager's
    /// `--small-regions`; 0: none).
    pub small_regions: u64,
}

/// Reads the secret at `path`, generating a random one (mode 0600) when
/// the file is absent.
pub fn load_or_create_secret(path: &Path) -> Result<Secret, UpError> {
    if !path.exists() {
        let mut raw = [0u8; 24];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut raw))
            .map_err(|cause| UpError::Io {
                what: "cannot read /dev/urandom for a new cluster secret".into(),
                cause,
            })?;
        let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|cause| UpError::Io {
                what: format!("cannot create the secret file {}", path.display()),
                cause,
            })?;
        writeln!(file, "{token}").map_err(|cause| UpError::Io {
            what: format!("cannot write {}", path.display()),
            cause,
        })?;
        tracing::info!(path = %path.display(), "generated a new cluster secret");
    }
    // An existing file readable by others is refused here, with the `chmod` to run.
    Secret::from_file(path).map_err(|e| UpError::Secret(e.to_string()))
}

/// A manager and a daemon running in this process.
pub struct Cluster {
    runtime: tokio::runtime::Runtime,
    manager_url: String,
    secret: Secret,
    transport: regions_proto::transport_choice::TransportChoice,
    rdma_device: Option<String>,
    agent_socket: PathBuf,
    daemon: Option<Daemon>,
    stop_manager: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Cluster {
    /// Starts the manager and the daemon; returns once both serve.
    pub fn start(config: &UpConfig) -> Result<Cluster, UpError> {
        let dir = &config.data_dir;
        std::fs::create_dir_all(dir.join("manager")).map_err(|cause| UpError::Io {
            what: format!("cannot create the data directory {}", dir.display()),
            cause,
        })?;
        let secret = load_or_create_secret(&dir.join("secret"))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("regions-up")
            .enable_all()
            .build()
            .map_err(|cause| UpError::Io {
                what: "cannot start the async runtime".into(),
                cause,
            })?;
        let manager_config = ManagerConfig {
            small_regions: config.small_regions,
            ..ManagerConfig::default()
        };
        let manager = Manager::open(&dir.join("manager"), manager_config)
            .map_err(|e| UpError::Store(e.to_string()))?;
        let std_listener =
            std::net::TcpListener::bind(config.listen).map_err(|cause| UpError::ManagerPort {
                addr: config.listen,
                cause,
            })?;
        let addr = std_listener.local_addr().map_err(|cause| UpError::Io {
            what: "manager listener address".into(),
            cause,
        })?;
        std_listener
            .set_nonblocking(true)
            .map_err(|cause| UpError::Io {
                what: "manager listener".into(),
                cause,
            })?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(std_listener).map_err(|cause| UpError::Io {
                what: "manager listener".into(),
                cause,
            })?
        };
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let server = runtime.spawn({
            let secret = secret.clone();
            async move {
                let shutdown = async {
                    let _ = stop_rx.await;
                };
                if let Err(e) = server::serve(manager, listener, secret, shutdown).await {
                    tracing::error!(error = %e, "the embedded manager stopped");
                }
            }
        });
        let manager_url = format!("http://{addr}");
        tracing::info!(%addr, data_dir = %dir.display(), "embedded manager serving");
        let agent_socket = dir.join("agent.sock");
        let mut dconfig = regions_daemon::Config::new(
            &manager_url,
            HOST_ID,
            config.memory,
            agent_socket.clone(),
            secret.clone(),
        );
        dconfig.listen = config.transport_listen;
        dconfig.rdma.choice = config.transport;
        dconfig.rdma.device.clone_from(&config.rdma_device);
        if config.share_writable_segments {
            dconfig.segment_writers = regions_daemon::agent::SegmentWriters::Anyone;
        }
        dconfig.startup_timeout = Duration::from_secs(15);
        let mut cluster = Cluster {
            runtime,
            manager_url,
            secret,
            transport: config.transport,
            rdma_device: config.rdma_device.clone(),
            agent_socket,
            daemon: None,
            stop_manager: Some(stop_tx),
            server: Some(server),
        };
        let daemon = cluster
            .runtime
            .block_on(Daemon::start(dconfig))
            .map_err(|e| match e {
                DaemonError::Bind { source: cause, .. } => UpError::TransportPort {
                    addr: config.transport_listen,
                    cause,
                },
                other => UpError::Daemon(other.to_string()),
            })?;
        cluster.daemon = Some(daemon);
        Ok(cluster)
    }

    /// The manager's URL.
    pub fn manager_url(&self) -> &str {
        &self.manager_url
    }

    /// The daemon's host agent socket.
    pub fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    /// The configuration a client (the mount) of this cluster uses.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new(&self.manager_url, self.secret.clone(), HOST_ID);
        c.agent_socket = Some(self.agent_socket.clone());
        // The embedded manager serves plain gRPC on loopback.
        c.tls_ca = None;
        c.transport = self.transport;
        c.rdma_device.clone_from(&self.rdma_device);
        c
    }

    /// The runtime the cluster runs on (for waiting on signals).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }

    /// Stops the daemon, then the manager (bounded).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(d) = self.daemon.take() {
            self.runtime.block_on(d.shutdown());
        }
        if let Some(tx) = self.stop_manager.take() {
            let _ = tx.send(());
        }
        if let Some(server) = self.server.take() {
            let finished = self
                .runtime
                .block_on(async { tokio::time::timeout(Duration::from_secs(10), server).await });
            if finished.is_err() {
                tracing::warn!("the embedded manager did not stop within 10 s");
            } else {
                tracing::info!("embedded manager stopped");
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn secret_is_generated_private_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let a = load_or_create_secret(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read_to_string(&path).unwrap().trim().len(), 48);
        let b = load_or_create_secret(&path).unwrap();
        assert!(a.same_as(&b));
        // A secret others may read is refused, naming the fix.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_or_create_secret(&path).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
    }
}
