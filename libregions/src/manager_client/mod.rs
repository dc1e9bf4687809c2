//! The manager's gRPC services as blocking calls, for node components that
//! hold the cluster secret (regionfs, daemons, tests): one channel and one runtime
//! ([`ManagerChannel`]) per client. This module holds the region calls (open, maps,
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
    /// runtime of one worker thread named `thread_name` that the caller keeps for its blocking
    /// calls. The one place node components build their manager channel.
    pub fn open(
        addr: &str,
        secret: &Secret,
        tls_ca: Option<&Path>,
        timeout: Duration,
        thread_name: &str,
    ) -> Result<(tokio::runtime::Runtime, ManagerChannel)> {
        let unreachable = |reason: String| RegionsError::ManagerUnreachable {
            addr: addr.to_owned(),
            reason,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(thread_name)
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

/// Blocking access to the manager. Calls must come from plain threads, not
/// from inside an async runtime.
pub struct ManagerClient {
    addr: String,
    runtime: tokio::runtime::Runtime,
    namespace: NamespaceClient<Authed>,
    regions: RegionsClient<Authed>,
    cluster: ClusterClient<Authed>,
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
        let (runtime, channel) =
            ManagerChannel::open(addr, secret, tls_ca, timeout, "regions-grpc")?;
        Ok(ManagerClient {
            addr: addr.to_owned(),
            namespace: channel.namespace(),
            regions: RegionsClient::new(channel.service())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            cluster: channel.cluster(),
            runtime,
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn call<T>(
        &self,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        self.runtime
            .block_on(fut)
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

    /// The namespace service (clone is cheap).
    pub fn namespace(&self) -> NamespaceClient<Authed> {
        self.namespace.clone()
    }

    fn cluster(&self) -> ClusterClient<Authed> {
        self.cluster.clone()
    }

    pub fn open(&self, caller: &v1::Caller, ino: u64, write: bool) -> Result<v1::RegionInfo> {
        let mut c = self.regions.clone();
        self.call(c.open(v1::OpenRequest {
            caller: Some(caller.clone()),
            ino,
            write,
        }))
    }

    /// Creates a region and opens it (one durable manager change).
    pub fn create_open(&self, create: v1::CreateRequest, write: bool) -> Result<v1::RegionInfo> {
        let mut c = self.regions.clone();
        self.call(c.create_open(v1::CreateOpenRequest {
            create: Some(create),
            write,
        }))
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
        let mut c = self.regions.clone();
        self.call(c.extend(v1::ExtendRequest {
            caller: Some(caller.clone()),
            ino,
            size,
            capacity,
            touch,
        }))
    }

    pub fn truncate(&self, caller: &v1::Caller, ino: u64, size: u64) -> Result<v1::RegionInfo> {
        let mut c = self.regions.clone();
        self.call(c.truncate(v1::TruncateRequest {
            caller: Some(caller.clone()),
            ino,
            size,
        }))
    }

    pub fn get_map(
        &self,
        caller: &v1::Caller,
        ino: u64,
        known_version: u64,
    ) -> Result<v1::RegionInfo> {
        let mut c = self.regions.clone();
        self.call(c.get_map(v1::GetMapRequest {
            caller: Some(caller.clone()),
            ino,
            known_version,
            ..Default::default()
        }))
    }

    /// Which of `handles` the manager closed for the caller's host when its lease ended, and
    /// the manager's lease.
    pub fn check_handles(
        &self,
        caller: &v1::Caller,
        handles: &[u64],
    ) -> Result<v1::CheckHandlesReply> {
        let mut c = self.regions.clone();
        self.call(c.check_handles(v1::CheckHandlesRequest {
            caller: Some(caller.clone()),
            handles: handles.to_vec(),
        }))
    }

    /// Closes `handle`; `wrote_within_size` says every byte written through it lies below
    /// the size it made durable (the manager then need not zero the region's tail).
    pub fn close(&self, caller: &v1::Caller, handle: u64, wrote_within_size: bool) -> Result<bool> {
        let mut c = self.regions.clone();
        self.call(c.close(v1::CloseRequest {
            caller: Some(caller.clone()),
            handle,
            wrote_within_size,
        }))
        .map(|r| r.freed)
    }
}
