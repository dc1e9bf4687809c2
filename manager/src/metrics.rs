//! The manager's Prometheus metrics (served when the binary runs with `--metrics-listen`,
//! see `regions_proto::metrics`).
//!
//! - [`GrpcMetricsLayer`]: every gRPC call, whichever service answers it, counted and timed
//!   per method, failures counted per gRPC code:
//!   `regions_manager_grpc_requests_total{service, method}`,
//!   `regions_manager_grpc_request_duration_seconds{service, method}`,
//!   `regions_manager_grpc_errors_total{service, method, code}`.
//! - [`run_gauges`]: what the Stats RPC reports, refreshed every second:
//!   `regions_manager_hosts`, `_live_hosts`, `_pools`, `_pool_bytes`, `_free_bytes`,
//!   `_regions`, `_directories`, `_open_handles`, and per host `regions_manager_host_live`
//!   (1 while its lease holds, 0 once expired), `_host_pool_bytes`, `_host_free_bytes`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};
use regions_proto::errno::ERRNO_KEY;
use regions_proto::metrics::{GAUGE_PERIOD, enabled};
use tonic::Code;
use tonic::codegen::{Service, http};

use crate::manager::Manager;

/// Wraps the gRPC server's routes in [`GrpcMetrics`].
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcMetricsLayer;

impl<S> tower_layer::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> GrpcMetrics<S> {
        GrpcMetrics { inner }
    }
}

/// Counts and times the calls `inner` answers (only while metrics are served).
#[derive(Clone, Debug)]
pub struct GrpcMetrics<S> {
    inner: S,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, R> Service<http::Request<B>> for GrpcMetrics<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if !enabled() {
            return Box::pin(self.inner.call(request));
        }
        let path = request.uri().path().to_owned();
        let started = Instant::now();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let result = answer.await;
            let headers = result.as_ref().ok().map(http::Response::headers);
            record_call(&path, headers, started.elapsed());
            result
        })
    }
}

/// How a call ended, from its response headers (`None`: no response at all).
fn outcome(headers: Option<&http::HeaderMap>) -> Result<(), Code> {
    let Some(headers) = headers else {
        return Err(Code::Unavailable);
    };
    // Unary successes carry grpc-status in trailers; failures answer with headers only.
    match headers.get("grpc-status") {
        None => Ok(()),
        Some(v) => match Code::from_bytes(v.as_bytes()) {
            Code::Ok => Ok(()),
            code => Err(code),
        },
    }
}

/// `(service, method)` of a gRPC path (`/regions.v1.Namespace/Lookup`).
fn split_path(path: &str) -> (&str, &str) {
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .unwrap_or(("", path));
    (service.rsplit('.').next().unwrap_or(service), method)
}

fn record_call(path: &str, headers: Option<&http::HeaderMap>, took: Duration) {
    let result = outcome(headers);
    // A path no service knows is answered Unimplemented without an errno: one series for all
    // of them, so that callers cannot create series at will.
    let unknown =
        result == Err(Code::Unimplemented) && headers.is_some_and(|h| h.get(ERRNO_KEY).is_none());
    let (service, method) = if unknown {
        ("unknown", "unknown")
    } else {
        split_path(path)
    };
    let (service, method) = (service.to_owned(), method.to_owned());
    counter!("regions_manager_grpc_requests_total",
        "service" => service.clone(), "method" => method.clone())
    .increment(1);
    histogram!("regions_manager_grpc_request_duration_seconds",
        "service" => service.clone(), "method" => method.clone())
    .record(took);
    if let Err(code) = result {
        counter!("regions_manager_grpc_errors_total",
            "service" => service, "method" => method, "code" => format!("{code:?}"))
        .increment(1);
    }
}

/// Refreshes the cluster gauges every [`GAUGE_PERIOD`] until shutdown begins; returns at once
/// when this process serves no metrics.
pub async fn run_gauges(manager: Arc<Manager>) {
    if !enabled() {
        return;
    }
    let mut closing = manager.closing();
    loop {
        record_gauges(&manager).await;
        tokio::select! {
            () = tokio::time::sleep(GAUGE_PERIOD) => {}
            _ = closing.wait_for(|c| *c) => return,
        }
    }
}

async fn record_gauges(manager: &Manager) {
    match manager.stats().await {
        Ok(s) => {
            gauge!("regions_manager_hosts").set(s.hosts as f64);
            gauge!("regions_manager_live_hosts").set(s.live_hosts as f64);
            gauge!("regions_manager_pools").set(s.pools as f64);
            gauge!("regions_manager_pool_bytes").set(s.total_bytes as f64);
            gauge!("regions_manager_free_bytes").set(s.free_bytes as f64);
            gauge!("regions_manager_regions").set(s.regions as f64);
            gauge!("regions_manager_directories").set(s.directories as f64);
            gauge!("regions_manager_open_handles").set(s.open_handles as f64);
        }
        Err(e) => tracing::debug!(error = %e, "cannot read the stats for metrics"),
    }
    match manager.list_hosts().await {
        Ok(hosts) => {
            for h in hosts {
                let host = h.host_id.to_string();
                gauge!("regions_manager_host_live", "host" => host.clone()).set(if h.live {
                    1.0
                } else {
                    0.0
                });
                gauge!("regions_manager_host_pool_bytes", "host" => host.clone())
                    .set(h.pool_bytes as f64);
                gauge!("regions_manager_host_free_bytes", "host" => host).set(h.free_bytes as f64);
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot list the hosts for metrics"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_service_and_method() {
        assert_eq!(
            split_path("/regions.v1.Namespace/Lookup"),
            ("Namespace", "Lookup")
        );
        assert_eq!(split_path("/Plain/Call"), ("Plain", "Call"));
        assert_eq!(split_path("nonsense"), ("", "nonsense"));
    }

    #[test]
    fn outcomes_come_from_grpc_status() {
        let mut h = http::HeaderMap::new();
        assert_eq!(outcome(Some(&h)), Ok(()), "status in trailers: success");
        h.insert("grpc-status", http::HeaderValue::from_static("0"));
        assert_eq!(outcome(Some(&h)), Ok(()));
        h.insert("grpc-status", http::HeaderValue::from_static("5"));
        assert_eq!(outcome(Some(&h)), Err(Code::NotFound));
        assert_eq!(outcome(None), Err(Code::Unavailable));
    }
}
