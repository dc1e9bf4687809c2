//! The daemon's command line (every flag has an environment variable) and [`Config`], what
//! [`crate::Daemon::start`] needs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use regions_proto::auth::Secret;
use regions_proto::layout::CHUNK_SIZE;

use crate::error::{DaemonError, Result};
use crate::transport::TransportConfig;

/// The regions daemon: serves this host's memory to the cluster (tcp transport) and to local
/// processes (host-agent Unix socket), registered with the manager.
#[derive(Parser, Debug, Clone)]
#[command(version)]
pub struct Args {
    /// URL of the manager (`http://host:port`, or `https://host:port` when it serves TLS; a
    /// bare `host:port` means http).
    #[arg(long, env = "REGIONS_MANAGER", default_value = "http://127.0.0.1:7070")]
    pub manager: String,
    /// CA certificate (PEM) that signed the manager's TLS certificate (needs an https://
    /// --manager URL; without it the system's roots are trusted).
    #[arg(long, env = "REGIONS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This host's id in the cluster (1 or more, unique per host).
    #[arg(long, env = "REGIONS_HOST_ID")]
    pub host_id: u32,
    /// Address the tcp transport listens on; port 0 picks a free port.
    #[arg(long, env = "REGIONS_DAEMON_LISTEN", default_value = "127.0.0.1:7171")]
    pub listen: SocketAddr,
    /// Transport address announced to the manager (default: the bound address; when that is
    /// a wildcard, the address this host uses to reach the manager).
    #[arg(long, env = "REGIONS_DAEMON_ADVERTISE")]
    pub advertise: Option<String>,
    /// Memory this host offers to pools, with an optional K, M, G or T suffix (powers of 1024).
    #[arg(long, env = "REGIONS_MEMORY", default_value = "1G", value_parser = parse_size)]
    pub memory: u64,
    /// Memory for small regions stored as objects in blocks of their size class (K, M, G
    /// suffixes; 0: none, every region a segment of whole chunks). Pages are taken as objects
    /// are written and given back as they are freed and compacted.
    #[arg(long, env = "REGIONS_OBJECT_MEMORY", default_value = "256M", value_parser = parse_size)]
    pub object_memory: u64,
    /// Whether a size class of the object store is compacted on its own once frees leave it
    /// sparse (`false`: only when the store is full and on `regionfs compact`).
    #[arg(long, env = "REGIONS_OBJECT_AUTO_COMPACTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub object_auto_compaction: bool,
    /// How long, in milliseconds, an object's old pointer keeps reaching it after the manager
    /// recorded the pointer compaction moved it to (requests already under way with the old
    /// one finish; then its block address is reused).
    #[arg(
        long,
        env = "REGIONS_OBJECT_CORRECTION_GRACE_MS",
        default_value_t = 30_000
    )]
    pub object_correction_grace_ms: u64,
    /// Path of the host-agent Unix socket (its directory must exist).
    #[arg(
        long,
        env = "REGIONS_AGENT_SOCKET",
        default_value = "/run/regions/agent.sock"
    )]
    pub socket: PathBuf,
    /// File holding the cluster secret (the manager's --secret-file).
    #[arg(
        long,
        env = "REGIONS_SECRET_FILE",
        default_value = "/etc/regions/secret"
    )]
    pub secret_file: PathBuf,
    /// Write the transport address to this file once registered and serving.
    #[arg(long, env = "REGIONS_READY_FILE")]
    pub ready_file: Option<PathBuf>,
    /// Milliseconds between heartbeats (default: a third of the manager's lease).
    #[arg(long, env = "REGIONS_HEARTBEAT_MS")]
    pub heartbeat_ms: Option<u64>,
    /// How long to keep retrying an unreachable manager at start-up before giving up.
    #[arg(long, env = "REGIONS_STARTUP_TIMEOUT_MS", default_value_t = 60_000)]
    pub startup_timeout_ms: u64,
    /// How long a transport request for a chunk not assigned yet waits for the manager's event.
    #[arg(long, env = "REGIONS_ASSIGN_WAIT_MS", default_value_t = 2_000)]
    pub assign_wait_ms: u64,
    /// Most transport connections open at once; past it the oldest connection that has not
    /// authenticated makes room, or the new one is closed.
    #[arg(long, env = "REGIONS_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Most transport connections waiting to authenticate; past it the oldest silent one is
    /// closed to make room.
    #[arg(long, env = "REGIONS_MAX_UNAUTHENTICATED", default_value_t = 128)]
    pub max_unauthenticated: usize,
    /// Bytes of request payloads all transport connections together may hold (K, M, G
    /// suffixes); a connection past it waits for room.
    #[arg(long, env = "REGIONS_MAX_BUFFERED", default_value = "256M", value_parser = parse_size)]
    pub max_buffered: u64,
    /// Seconds an authenticated transport connection may stay silent before it is closed
    /// (clients reconnect).
    #[arg(long, env = "REGIONS_IDLE_TIMEOUT_S", default_value_t = 300)]
    pub idle_timeout_s: u64,
    /// Tests only: waits this long before applying each chunk release or tail zeroing, to
    /// show that the manager's replies wait for them.
    #[arg(
        long,
        env = "REGIONS_TEST_DESTRUCTIVE_EVENT_DELAY_MS",
        default_value_t = 0,
        hide = true
    )]
    pub test_destructive_event_delay_ms: u64,
    /// Serve Prometheus metrics over HTTP on this address (`GET /metrics`); off by default.
    #[arg(long, env = "REGIONS_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Hand every local process that may write a region a writable descriptor of its memory
    /// (shared-memory speed for its writes and mappings), not only root and the daemon's
    /// user. Such a process can then grow that memory past what the manager allocated
    /// (docs/SECURITY.md): use it only where local users are trusted with this host's memory.
    #[arg(long, env = "REGIONS_SHARE_WRITABLE_SEGMENTS")]
    pub share_writable_segments: bool,
    /// Data transports to serve: `auto` (tcp, and RDMA too when an RDMA device is found),
    /// `tcp` (tcp only), `rdma` (tcp and RDMA; fails to start without a device).
    #[arg(long, env = "REGIONS_TRANSPORT", value_enum, default_value_t = TransportChoice::Auto)]
    pub transport: TransportChoice,
    /// RDMA device to serve on (`ibv_devices` lists them); default: the first one.
    #[arg(long, env = "REGIONS_RDMA_DEVICE")]
    pub rdma_device: Option<String>,
    /// GID index of the RDMA port (RoCE: which address of the interface).
    #[arg(long, env = "REGIONS_RDMA_GID_INDEX", default_value_t = 0)]
    pub rdma_gid_index: u8,
    #[command(flatten)]
    pub config: regions_proto::config::ConfigArgs,
}

pub use regions_proto::config::parse_size;
use regions_proto::transport_choice::TransportChoice;

/// Which RDMA the daemon serves, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RdmaConfig {
    pub choice: TransportChoice,
    pub device: Option<String>,
    pub gid_index: u8,
}

/// The object store's memory unless configured (`--object-memory`).
pub const DEFAULT_OBJECT_MEMORY: u64 = 256 << 20;

/// Everything a daemon needs to start.
#[derive(Debug, Clone)]
pub struct Config {
    /// The manager's URL.
    pub manager: String,
    /// CA certificate (PEM) for an https:// manager URL.
    pub tls_ca: Option<PathBuf>,
    /// This host's id.
    pub host_id: u32,
    /// Transport listen address (port 0 allowed).
    pub listen: SocketAddr,
    /// Transport address to announce instead of the bound one.
    pub advertise: Option<String>,
    /// Memory offered to pools, in bytes (rounded down to whole chunks).
    pub memory: u64,
    /// Memory of the object store for small regions (0: none).
    pub object_memory: u64,
    /// Whether frees that leave a size class sparse compact it.
    pub object_auto_compaction: bool,
    /// How long a corrected object pointer keeps working.
    pub object_correction_grace: Duration,
    /// Host-agent socket path.
    pub socket: PathBuf,
    /// The cluster secret.
    pub secret: Secret,
    /// Whether and where to serve RDMA.
    pub rdma: RdmaConfig,
    /// Where to write the transport address once serving.
    pub ready_file: Option<PathBuf>,
    /// Heartbeat interval (default: a third of the lease).
    pub heartbeat: Option<Duration>,
    /// How long start-up retries an unreachable manager.
    pub startup_timeout: Duration,
    /// Transport tunables.
    pub transport: TransportConfig,
    /// Where to serve Prometheus metrics (`None`: not served, or served by the embedding
    /// process).
    pub metrics_listen: Option<SocketAddr>,
    /// Tests only: a pause before applying each chunk release or tail zeroing.
    pub destructive_event_delay: Duration,
    /// Who receives writable segment descriptors from the host agent.
    pub segment_writers: crate::agent::SegmentWriters,
}

impl Config {
    /// A configuration with defaults for everything but the essentials (tests, embedding).
    pub fn new(
        manager: &str,
        host_id: u32,
        memory: u64,
        socket: PathBuf,
        secret: Secret,
    ) -> Config {
        Config {
            manager: manager.to_owned(),
            tls_ca: None,
            host_id,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            memory,
            object_memory: DEFAULT_OBJECT_MEMORY,
            object_auto_compaction: true,
            object_correction_grace: crate::objects::CORRECTION_GRACE,
            socket,
            secret,
            ready_file: None,
            heartbeat: None,
            startup_timeout: Duration::from_secs(60),
            transport: TransportConfig::default(),
            rdma: RdmaConfig::default(),
            metrics_listen: None,
            destructive_event_delay: Duration::ZERO,
            segment_writers: crate::agent::SegmentWriters::default(),
        }
    }

    /// Checks the configuration, reading the secret file.
    pub fn from_args(args: &Args) -> Result<Config> {
        let secret = Secret::from_file(&args.secret_file)?;
        let config = Config {
            manager: args.manager.clone(),
            tls_ca: args.tls_ca.clone(),
            host_id: args.host_id,
            listen: args.listen,
            advertise: args.advertise.clone(),
            memory: args.memory,
            object_memory: args.object_memory,
            object_auto_compaction: args.object_auto_compaction,
            object_correction_grace: Duration::from_millis(args.object_correction_grace_ms),
            socket: args.socket.clone(),
            secret,
            ready_file: args.ready_file.clone(),
            heartbeat: args.heartbeat_ms.map(Duration::from_millis),
            startup_timeout: Duration::from_millis(args.startup_timeout_ms),
            transport: TransportConfig {
                assign_wait: Duration::from_millis(args.assign_wait_ms),
                idle_timeout: Duration::from_secs(args.idle_timeout_s),
                admission: crate::transport::admission::Limits {
                    max_connections: args.max_connections,
                    max_unauthenticated: args.max_unauthenticated,
                },
                max_buffered: args.max_buffered,
                ..TransportConfig::default()
            },
            rdma: RdmaConfig {
                choice: args.transport,
                device: args.rdma_device.clone(),
                gid_index: args.rdma_gid_index,
            },
            metrics_listen: args.metrics_listen,
            destructive_event_delay: Duration::from_millis(args.test_destructive_event_delay_ms),
            segment_writers: if args.share_writable_segments {
                crate::agent::SegmentWriters::Anyone
            } else {
                crate::agent::SegmentWriters::Trusted
            },
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks values that cannot work.
    pub fn validate(&self) -> Result<()> {
        if self.host_id == 0 {
            return Err(DaemonError::Config(
                "--host-id 0 is reserved: use 1 or more, unique per host".into(),
            ));
        }
        if self.memory < CHUNK_SIZE {
            return Err(DaemonError::Config(format!(
                "--memory {} is less than one chunk ({CHUNK_SIZE} bytes): offer at least 128K",
                self.memory
            )));
        }
        let block = crate::objects::classes::BLOCK_SIZE;
        if self.object_memory != 0 && self.object_memory < block {
            return Err(DaemonError::Config(format!(
                "--object-memory {} is less than one block of the object store ({block} \
                 bytes): give at least 32K, or 0 for no object store",
                self.object_memory
            )));
        }
        if self.heartbeat.is_some_and(|d| d.is_zero()) {
            return Err(DaemonError::Config(
                "--heartbeat-ms must be positive".into(),
            ));
        }
        let t = &self.transport;
        if t.admission.max_unauthenticated == 0
            || t.admission.max_connections < t.admission.max_unauthenticated
        {
            return Err(DaemonError::Config(format!(
                "--max-unauthenticated {} must be at least 1 and at most --max-connections {}",
                t.admission.max_unauthenticated, t.admission.max_connections
            )));
        }
        if t.idle_timeout < t.io_timeout {
            return Err(DaemonError::Config(format!(
                "--idle-timeout-s {} must be at least the I/O timeout ({} s)",
                t.idle_timeout.as_secs(),
                t.io_timeout.as_secs()
            )));
        }
        Ok(())
    }

    /// The memory offered, rounded down to whole chunks.
    pub fn pool_memory(&self) -> u64 {
        self.memory - self.memory % CHUNK_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_and_validation() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        Secret::new("tok").unwrap().write_file(&secret).unwrap();
        let args = Args::try_parse_from([
            "regions-daemon",
            "--host-id",
            "2",
            "--memory",
            "1M",
            "--listen",
            "127.0.0.1:0",
            "--secret-file",
            secret.to_str().unwrap(),
            "--heartbeat-ms",
            "250",
        ])
        .unwrap();
        let config = Config::from_args(&args).unwrap();
        assert_eq!((config.host_id, config.memory), (2, 1 << 20));
        assert_eq!(config.heartbeat, Some(Duration::from_millis(250)));
        assert_eq!(config.pool_memory(), 1 << 20);
        let mut bad = config.clone();
        bad.host_id = 0;
        assert!(bad.validate().is_err());
        bad = config.clone();
        bad.memory = 1000;
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("one chunk")
        );
        bad = config;
        bad.memory = CHUNK_SIZE * 3 + 5;
        assert_eq!(bad.pool_memory(), CHUNK_SIZE * 3);
        let missing = Args {
            secret_file: dir.path().join("missing"),
            ..args
        };
        assert!(Config::from_args(&missing).is_err());
    }
}
