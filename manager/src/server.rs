//! Runs the manager's gRPC services on a listener.

use std::future::Future;
use std::sync::Arc;

use regions_proto::auth::{RequireSecret, Secret};
use regions_proto::v1::{
    cluster_server::ClusterServer, namespace_server::NamespaceServer, regions_server::RegionsServer,
};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;

use crate::manager::Manager;
use crate::service::Services;

/// Largest gRPC message (a region map of 1 TiB is 64 MiB of entries).
pub const MAX_MESSAGE: usize = 256 << 20;

/// Serves every manager service on `listener` until `shutdown` resolves.
/// Every call must carry the cluster secret.
pub async fn serve(
    manager: Arc<Manager>,
    listener: TcpListener,
    secret: Secret,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let services = Services { manager };
    let auth = RequireSecret(secret);
    let incoming = TcpListenerStream::new(listener).map(|stream| {
        if let Ok(s) = &stream
            && let Err(e) = s.set_nodelay(true)
        {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        stream
    });
    Server::builder()
        .add_service(InterceptedService::new(
            NamespaceServer::new(services.clone())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            auth.clone(),
        ))
        .add_service(InterceptedService::new(
            RegionsServer::new(services.clone())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            auth.clone(),
        ))
        .add_service(InterceptedService::new(
            ClusterServer::new(services)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            auth,
        ))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
