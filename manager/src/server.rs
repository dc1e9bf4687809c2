//! Runs the manager's gRPC services on a listener.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

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

/// How long open calls may take to finish once shutdown begins.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// Serves every manager service on `listener` until `shutdown` resolves,
/// then lets open calls finish for at most [`SHUTDOWN_GRACE`] (daemons hold
/// event streams open indefinitely; they are ended first). Every call must
/// carry the cluster secret.
pub async fn serve(
    manager: Arc<Manager>,
    listener: TcpListener,
    secret: Secret,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let services = Services {
        manager: Arc::clone(&manager),
        minter: Arc::new(crate::capability::Minter::from_env(&secret)),
    };
    // Ends by itself once shutdown begins.
    tokio::spawn(crate::lifetime::run_lease_expiry(Arc::clone(&manager)));
    // Metrics gauges (only when this process serves metrics); end once shutdown begins.
    tokio::spawn(crate::metrics::run_gauges(Arc::clone(&manager)));
    // Barriers, mutexes and doorbells; the expiry task ends once shutdown begins.
    let sync = crate::sync::SyncService::new(Arc::clone(&manager), secret.clone());
    tokio::spawn(sync.clone().run_host_expiry());
    let auth = RequireSecret(secret);
    let incoming = TcpListenerStream::new(listener).map(|stream| {
        if let Ok(s) = &stream
            && let Err(e) = s.set_nodelay(true)
        {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        stream
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = Server::builder()
        .layer(crate::metrics::GrpcMetricsLayer)
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
            regions_proto::v1::sync_server::SyncServer::new(sync)
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
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => return result,
        () = shutdown => {}
    }
    manager.begin_shutdown();
    let _ = stop_tx.send(());
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(
                "calls still open {SHUTDOWN_GRACE:?} after shutdown began; closing them"
            );
            Ok(())
        }
    }
}
