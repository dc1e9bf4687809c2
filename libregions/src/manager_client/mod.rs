//! The manager's gRPC services as blocking calls, for node components that
//! hold the cluster secret (regionfs, daemons, tests): each thread that calls while others do
//! uses a connection of its own ([`ManagerChannel`]), which its runtime drives on the calling
//! thread. This module holds the region calls (open, maps,
//! growth, close); [`namespace`] the file-system calls, [`cluster`] the cluster's.

pub mod cluster;
pub mod namespace;

pub use namespace::{SetAttrIn, SetTime};

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use regions_proto::auth::{AttachSecret, Secret};
use regions_proto::v1::{
    self, cluster_client::ClusterClient, namespace_client::NamespaceClient,
    regions_client::RegionsClient,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::error::{RegionsError, Result};

/// A gRPC service stack that attaches the cluster secret.
pub type Authed = InterceptedService<Channel, AttachSecret>;

use regions_proto::MAX_GRPC_MESSAGE as MAX_MESSAGE;

/// Deadline of every call.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// An authenticated gRPC channel to the manager (the cluster secret on every call), for the
/// node components' clients.
#[derive(Clone)]
pub struct ManagerChannel {
    channel: Channel,
    auth: AttachSecret,
}

impl ManagerChannel {
    /// Connects to the manager at `addr` (`http://host:port`, or `https://host:port` for TLS,
    /// trusting `tls_ca` (PEM) if given, else the system's roots) within `timeout`, on a
    /// current-thread runtime that the caller keeps for its blocking calls: the thread that
    /// blocks on it writes the request and reads the reply itself (a hand-off to a runtime
    /// thread costs two thread wake-ups a call). The one place node components build their
    /// manager channel.
    pub fn open(
        addr: &str,
        secret: &Secret,
        tls_ca: Option<&Path>,
        timeout: Duration,
    ) -> Result<(tokio::runtime::Runtime, ManagerChannel)> {
        let unreachable = |reason: String| RegionsError::ManagerUnreachable {
            addr: addr.to_owned(),
            reason,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| RegionsError::io("cannot start the gRPC runtime", e))?;
        let endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(|e| unreachable(e.to_string()))?
            .connect_timeout(timeout)
            .timeout(CALL_TIMEOUT)
            .tcp_nodelay(true);
        let endpoint = regions_proto::tls::client_endpoint(endpoint, addr, tls_ca)
            .map_err(|e| RegionsError::Invalid(e.to_string()))?;
        let channel = runtime
            .block_on(endpoint.connect())
            .map_err(|e| unreachable(e.to_string()))?;
        let auth = AttachSecret::new(secret);
        Ok((runtime, ManagerChannel { channel, auth }))
    }

    fn service(&self) -> Authed {
        InterceptedService::new(self.channel.clone(), self.auth.clone())
    }

    /// A client of the namespace service on this channel.
    pub fn namespace(&self) -> NamespaceClient<Authed> {
        NamespaceClient::new(self.service())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }

    /// A client of the cluster service on this channel.
    pub fn cluster(&self) -> ClusterClient<Authed> {
        ClusterClient::new(self.service())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }
}

/// The clients of one connection's services (cheap to clone).
#[derive(Clone)]
struct Services {
    namespace: NamespaceClient<Authed>,
    regions: RegionsClient<Authed>,
    cluster: ClusterClient<Authed>,
}

/// One connection to the manager and the runtime that drives it. Only the thread that
/// holds it (taken from [`ManagerClient`]'s idle list) runs its runtime: a call is
/// written, waited for and read on the calling thread, with no hand-off to a runtime
/// thread and no wait behind another thread's call.
struct Connection {
    runtime: tokio::runtime::Runtime,
    services: Services,
}

/// Idle connections kept for later calls; more are opened while more threads call at once,
/// and those beyond this many are closed when they come back.
const IDLE_CONNECTIONS: usize = 16;

/// Blocking access to the manager. Calls must come from plain threads, not
/// from inside an async runtime. Threads that call at the same time use connections of
/// their own.
pub struct ManagerClient {
    addr: String,
    secret: Secret,
    tls_ca: Option<std::path::PathBuf>,
    timeout: Duration,
    idle: std::sync::Mutex<Vec<Connection>>,
}

impl ManagerClient {
    /// Connects to the manager at `addr` (e.g. `http://127.0.0.1:7070`; see
    /// [`ManagerChannel::open`] for `https://` and `tls_ca`).
    pub fn connect(
        addr: &str,
        secret: &Secret,
        tls_ca: Option<&Path>,
        timeout: Duration,
    ) -> Result<ManagerClient> {
        let client = ManagerClient {
            addr: addr.to_owned(),
            secret: secret.clone(),
            tls_ca: tls_ca.map(Path::to_path_buf),
            timeout,
            idle: std::sync::Mutex::new(Vec::new()),
        };
        // The first connection now: an unreachable manager or a bad address is told here.
        let first = client.open_connection()?;
        client.put_back(first);
        Ok(client)
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn open_connection(&self) -> Result<Connection> {
        let (runtime, channel) = ManagerChannel::open(
            &self.addr,
            &self.secret,
            self.tls_ca.as_deref(),
            self.timeout,
        )?;
        Ok(Connection {
            runtime,
            services: Services {
                namespace: channel.namespace(),
                regions: RegionsClient::new(channel.service())
                    .max_decoding_message_size(MAX_MESSAGE)
                    .max_encoding_message_size(MAX_MESSAGE),
                cluster: channel.cluster(),
            },
        })
    }

    fn take_connection(&self) -> Result<Connection> {
        let idle = self.idle.lock().ok().and_then(|mut i| i.pop());
        match idle {
            Some(c) => Ok(c),
            None => self.open_connection(),
        }
    }

    fn put_back(&self, connection: Connection) {
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < IDLE_CONNECTIONS
        {
            idle.push(connection);
        }
    }

    /// Runs the call `rpc` makes of a connection's services on the calling thread.
    fn call<T, F, Fut>(&self, rpc: F) -> Result<T>
    where
        F: FnOnce(Services) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let connection = self.take_connection()?;
        let outcome = connection
            .runtime
            .block_on(rpc(connection.services.clone()));
        self.put_back(connection);
        outcome
            .map(tonic::Response::into_inner)
            .map_err(|status| match status.code() {
                tonic::Code::Unavailable
                    if status
                        .metadata()
                        .get(regions_proto::errno::ERRNO_KEY)
                        .is_none() =>
                {
                    RegionsError::ManagerUnreachable {
                        addr: self.addr.clone(),
                        reason: status.message().to_owned(),
                    }
                }
                _ => RegionsError::from_status(status),
            })
    }

    pub fn open(&self, caller: &v1::Caller, ino: u64, write: bool) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .open(v1::OpenRequest {
                    caller: Some(caller.clone()),
                    ino,
                    write,
                })
                .await
        })
    }

    /// Creates a region and opens it (one durable manager change).
    pub fn create_open(&self, create: v1::CreateRequest, write: bool) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .create_open(v1::CreateOpenRequest {
                    create: Some(create),
                    write,
                })
                .await
        })
    }

    /// Grows region `ino` to at least `size` bytes (durably).
    pub fn extend(&self, caller: &v1::Caller, ino: u64, size: u64) -> Result<v1::RegionInfo> {
        self.grow(caller, ino, size, 0, false)
    }

    /// Grows region `ino`: its size to at least `size` (0: unchanged), its
    /// allocated chunks to cover at least `capacity` bytes; with `touch`,
    /// sets its mtime to now.
    pub fn grow(
        &self,
        caller: &v1::Caller,
        ino: u64,
        size: u64,
        capacity: u64,
        touch: bool,
    ) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .extend(v1::ExtendRequest {
                    caller: Some(caller.clone()),
                    ino,
                    size,
                    capacity,
                    touch,
                })
                .await
        })
    }

    pub fn truncate(&self, caller: &v1::Caller, ino: u64, size: u64) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .truncate(v1::TruncateRequest {
                    caller: Some(caller.clone()),
                    ino,
                    size,
                })
                .await
        })
    }

    pub fn get_map(
        &self,
        caller: &v1::Caller,
        ino: u64,
        known_version: u64,
    ) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .get_map(v1::GetMapRequest {
                    caller: Some(caller.clone()),
                    ino,
                    known_version,
                    ..Default::default()
                })
                .await
        })
    }

    /// Which of `handles` the manager closed for the caller's host when its lease ended, and
    /// the manager's lease.
    pub fn check_handles(
        &self,
        caller: &v1::Caller,
        handles: &[u64],
    ) -> Result<v1::CheckHandlesReply> {
        self.call(|mut s| async move {
            s.regions
                .check_handles(v1::CheckHandlesRequest {
                    caller: Some(caller.clone()),
                    handles: handles.to_vec(),
                })
                .await
        })
    }

    /// Closes `handle`; `wrote_within_size` says every byte written through it lies below
    /// the size it made durable (the manager then need not zero the region's tail).
    pub fn close(&self, caller: &v1::Caller, handle: u64, wrote_within_size: bool) -> Result<bool> {
        self.call(|mut s| async move {
            s.regions
                .close(v1::CloseRequest {
                    caller: Some(caller.clone()),
                    handle,
                    wrote_within_size,
                })
                .await
        })
        .map(|r| r.freed)
    }
}
