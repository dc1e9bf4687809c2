//! gRPC clients of the manager, presenting the cluster secret, and the [`Authority`] the host
//! agent asks about callers' rights.

use std::path::Path;
use std::time::Duration;

use regions_proto::auth::{AttachSecret, Secret};
use regions_proto::v1::{
    self, Caller, cluster_client::ClusterClient, namespace_client::NamespaceClient,
    regions_client::RegionsClient,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::error::{DaemonError, Result};

use regions_proto::MAX_GRPC_MESSAGE as MAX_MESSAGE;
/// Deadline of each unary call to the manager.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline of a TCP connection to the manager.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

type Svc = InterceptedService<Channel, AttachSecret>;

/// Clients of the manager's services over one lazily (re)connecting channel.
#[derive(Clone, Debug)]
pub struct ManagerClients {
    /// The manager's URL.
    pub url: String,
    /// Cluster service (hosts, pools, events).
    pub cluster: ClusterClient<Svc>,
    /// Namespace service (access checks).
    pub namespace: NamespaceClient<Svc>,
    /// Regions service (open).
    pub regions: RegionsClient<Svc>,
    /// Sync service (barriers, mutexes, doorbells; [`crate::agent::sync`]).
    pub sync: regions_proto::v1::sync_client::SyncClient<Svc>,
}

/// `url` with `http://` in front when it names no scheme.
pub fn normalize_url(url: &str) -> String {
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

impl ManagerClients {
    /// Clients for the manager at `url` (TLS when it is `https://`, trusting `tls_ca` if
    /// given); nothing is connected until the first call.
    pub fn new(url: &str, secret: &Secret, tls_ca: Option<&Path>) -> Result<ManagerClients> {
        let url = normalize_url(url);
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| DaemonError::Config(format!("bad --manager URL {url}: {e}")))?;
        let endpoint = regions_proto::tls::client_endpoint(endpoint, &url, tls_ca)
            .map_err(|e| DaemonError::Config(e.to_string()))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        let channel = endpoint.connect_lazy();
        let auth = AttachSecret::new(secret);
        Ok(ManagerClients {
            cluster: ClusterClient::with_interceptor(channel.clone(), auth.clone())
                .max_decoding_message_size(MAX_MESSAGE),
            namespace: NamespaceClient::with_interceptor(channel.clone(), auth.clone())
                .max_decoding_message_size(MAX_MESSAGE),
            sync: regions_proto::v1::sync_client::SyncClient::with_interceptor(
                channel.clone(),
                auth.clone(),
            )
            .max_decoding_message_size(MAX_MESSAGE),
            regions: RegionsClient::with_interceptor(channel, auth)
                .max_decoding_message_size(MAX_MESSAGE),
            url,
        })
    }
}

/// A unary request with the standard deadline.
pub fn request<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(CALL_TIMEOUT);
    r
}

/// Who decides what a local caller may do: the manager, or a stand-in in tests.
pub trait Authority: Send + Sync {
    /// Opens region `ino` for `caller` (`Regions.Open`).
    fn open(&self, caller: &Caller, ino: u64, write: bool) -> Result<v1::RegionInfo>;
    /// Checks access(2)-style `mask` bits of region `ino` for `caller` (`Namespace.Access`).
    fn access(&self, caller: &Caller, ino: u64, mask: u32) -> Result<()>;
    /// Creates a region as `request.caller`, its owner (`Namespace.Create`).
    fn create(&self, _request: v1::CreateRequest) -> Result<v1::Attr> {
        Err(DaemonError::Invalid(
            "this authority cannot create regions".into(),
        ))
    }
    /// Owner `pid` of this host exited: its non-persistent regions go (`Cluster.ReleaseOwner`).
    fn release_owner(&self, _host_id: u32, _pid: u32) -> Result<Vec<u64>> {
        Err(DaemonError::Invalid(
            "this authority cannot release owners".into(),
        ))
    }
    /// The region's map (left out when `known_version` is current), with a fresh transport
    /// capability when `want_capability` (`Regions.GetMap`); with a `handle`, only while that
    /// handle is still open (a renewal for it).
    fn get_map(
        &self,
        _caller: &Caller,
        _ino: u64,
        _known_version: u64,
        _want_capability: bool,
        _write: bool,
        _handle: u64,
    ) -> Result<v1::RegionInfo> {
        Err(DaemonError::Invalid(
            "this authority serves no region maps".into(),
        ))
    }
    /// Grows region `ino` to at least `size` bytes (`Regions.Extend`); with `chunks`, a small
    /// region stored as an object moves to chunks.
    fn extend(
        &self,
        _caller: &Caller,
        _ino: u64,
        _size: u64,
        _chunks: bool,
    ) -> Result<v1::RegionInfo> {
        Err(DaemonError::Invalid(
            "this authority cannot grow regions".into(),
        ))
    }
    /// Closes an open handle (`Regions.Close`).
    fn close(&self, _caller: &Caller, _handle: u64) -> Result<()> {
        Err(DaemonError::Invalid(
            "this authority cannot close handles".into(),
        ))
    }
}

/// The manager as [`Authority`], called from the host agent's threads.
#[derive(Debug)]
pub struct ManagerAuthority {
    clients: ManagerClients,
    runtime: tokio::runtime::Handle,
}

impl ManagerAuthority {
    /// Calls the manager through `clients` on `runtime` (the agent's threads are not tokio
    /// threads, so they block on the runtime).
    pub fn new(clients: ManagerClients, runtime: tokio::runtime::Handle) -> ManagerAuthority {
        ManagerAuthority { clients, runtime }
    }
}

impl Authority for ManagerAuthority {
    fn create(&self, req: v1::CreateRequest) -> Result<v1::Attr> {
        let mut client = self.clients.namespace.clone();
        self.runtime
            .block_on(client.create(request(req)))
            .map(tonic::Response::into_inner)
            .map_err(|s| DaemonError::from_status(&s))
    }

    fn release_owner(&self, host_id: u32, pid: u32) -> Result<Vec<u64>> {
        let mut client = self.clients.cluster.clone();
        self.runtime
            .block_on(client.release_owner(request(v1::ReleaseOwnerRequest { host_id, pid })))
            .map(|r| r.into_inner().inos)
            .map_err(|s| DaemonError::from_status(&s))
    }

    fn open(&self, caller: &Caller, ino: u64, write: bool) -> Result<v1::RegionInfo> {
        let mut client = self.clients.regions.clone();
        let req = v1::OpenRequest {
            caller: Some(caller.clone()),
            ino,
            write,
        };
        self.runtime
            .block_on(client.open(request(req)))
            .map(tonic::Response::into_inner)
            .map_err(|s| DaemonError::from_status(&s))
    }

    fn get_map(
        &self,
        caller: &Caller,
        ino: u64,
        known_version: u64,
        want_capability: bool,
        write: bool,
        handle: u64,
    ) -> Result<v1::RegionInfo> {
        let mut client = self.clients.regions.clone();
        let req = v1::GetMapRequest {
            caller: Some(caller.clone()),
            ino,
            known_version,
            want_capability,
            write,
            handle,
        };
        self.runtime
            .block_on(client.get_map(request(req)))
            .map(tonic::Response::into_inner)
            .map_err(|s| DaemonError::from_status(&s))
    }

    fn extend(&self, caller: &Caller, ino: u64, size: u64, chunks: bool) -> Result<v1::RegionInfo> {
        let mut client = self.clients.regions.clone();
        let req = v1::ExtendRequest {
            caller: Some(caller.clone()),
            ino,
            size,
            chunks,
            ..Default::default()
        };
        self.runtime
            .block_on(client.extend(request(req)))
            .map(tonic::Response::into_inner)
            .map_err(|s| DaemonError::from_status(&s))
    }

    fn close(&self, caller: &Caller, handle: u64) -> Result<()> {
        let mut client = self.clients.regions.clone();
        let req = v1::CloseRequest {
            caller: Some(caller.clone()),
            handle,
            // An application's writes went through the daemon and may have run past the
            // size it published: the last writer's close zeroes the tail.
            wrote_within_size: false,
        };
        self.runtime
            .block_on(client.close(request(req)))
            .map(drop)
            .map_err(|s| DaemonError::from_status(&s))
    }

    fn access(&self, caller: &Caller, ino: u64, mask: u32) -> Result<()> {
        let mut client = self.clients.namespace.clone();
        let req = v1::AccessRequest {
            caller: Some(caller.clone()),
            ino,
            mask,
        };
        self.runtime
            .block_on(client.access(request(req)))
            .map(drop)
            .map_err(|s| DaemonError::from_status(&s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_get_a_scheme() {
        assert_eq!(normalize_url("127.0.0.1:7070"), "http://127.0.0.1:7070");
        assert_eq!(normalize_url("https://m:1"), "https://m:1");
    }

    #[tokio::test]
    async fn bad_urls_are_config_errors() {
        let secret = Secret::new("s").unwrap();
        assert!(ManagerClients::new("http://127.0.0.1:1", &secret, None).is_ok());
        let err = ManagerClients::new("http://bad host:1", &secret, None).unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
    }
}
