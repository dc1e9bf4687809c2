//! gRPC clients of the manager, presenting the cluster secret, and the [`Authority`] the host
//! agent asks about callers' rights.

use std::time::Duration;

use regions_proto::auth::{AttachSecret, Secret};
use regions_proto::v1::{
    self, Caller, cluster_client::ClusterClient, namespace_client::NamespaceClient,
    regions_client::RegionsClient,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::error::{DaemonError, Result};

/// Largest gRPC message accepted from the manager (region maps can be large).
pub const MAX_MESSAGE: usize = 256 << 20;
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
    /// Clients for the manager at `url`; nothing is connected until the first call.
    pub fn new(url: &str, secret: &Secret) -> Result<ManagerClients> {
        let url = normalize_url(url);
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| DaemonError::Config(format!("bad --manager URL {url}: {e}")))?
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
        assert!(ManagerClients::new("http://127.0.0.1:1", &secret).is_ok());
        let err = ManagerClients::new("http://bad host:1", &secret).unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
    }
}
