//! Runs the manager's gRPC services on a listener.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use regions_proto::auth::{CallPath, RequireSecret, Secret};
use regions_proto::v1::{
    cluster_server::ClusterServer, namespace_server::NamespaceServer, regions_server::RegionsServer,
};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::codegen::{Service, http};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Server, ServerTlsConfig};

use crate::manager::Manager;
use crate::service::Services;

/// Records each call's gRPC method path ([`CallPath`]) in the request's extensions, where
/// [`RequireSecret`] finds it: per-call proofs are bound to the method they were made for.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordCallPathLayer;

impl<S> tower_layer::Layer<S> for RecordCallPathLayer {
    type Service = RecordCallPath<S>;

    fn layer(&self, inner: S) -> RecordCallPath<S> {
        RecordCallPath { inner }
    }
}

/// See [`RecordCallPathLayer`].
#[derive(Clone, Debug)]
pub struct RecordCallPath<S> {
    inner: S,
}

impl<S, B> Service<http::Request<B>> for RecordCallPath<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> S::Future {
        let path = CallPath(request.uri().path().to_owned());
        request.extensions_mut().insert(path);
        self.inner.call(request)
    }
}

pub use regions_proto::MAX_GRPC_MESSAGE as MAX_MESSAGE;

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
    serve_with_tls(manager, listener, secret, None, shutdown).await
}

/// [`serve`], over TLS when `tls` is given ([`regions_proto::tls::server_config`]).
pub async fn serve_with_tls(
    manager: Arc<Manager>,
    listener: TcpListener,
    secret: Secret,
    tls: Option<ServerTlsConfig>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let services = Services {
        manager: Arc::clone(&manager),
        minter: Arc::new(crate::capability::Minter::new(
            &secret,
            manager.config().capability_ttl,
        )),
    };
    // Ends by itself once shutdown begins.
    tokio::spawn(crate::lifetime::run_lease_expiry(Arc::clone(&manager)));
    manager.serve_objects(secret.clone());
    tokio::spawn(crate::objects::run_object_work(Arc::clone(&manager)));
    // Metrics gauges (only when this process serves metrics); end once shutdown begins.
    tokio::spawn(crate::metrics::run_gauges(Arc::clone(&manager)));
    // Barriers, mutexes and doorbells; the expiry task ends once shutdown begins.
    let sync = crate::sync::SyncService::new(Arc::clone(&manager), secret.clone());
    tokio::spawn(sync.clone().run_host_expiry());
    let auth = RequireSecret::new(secret);
    let incoming = TcpListenerStream::new(listener).map(|stream| {
        if let Ok(s) = &stream
            && let Err(e) = s.set_nodelay(true)
        {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        stream
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut builder = Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let server = builder
        .layer(crate::metrics::GrpcMetricsLayer)
        .layer(RecordCallPathLayer)
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
