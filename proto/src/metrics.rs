//! Prometheus metrics: the one set-up every binary shares (`--metrics-listen ADDR`).
//!
//! Library code records through the [`metrics`] facade (`counter!`, `gauge!`, `histogram!`);
//! with no recorder installed those are no-ops, so libraries record unconditionally. A binary
//! given `--metrics-listen` calls [`serve`] once, early: it installs the process-wide
//! Prometheus recorder and serves the text format over HTTP (`GET /metrics`) from a thread of
//! its own, with its own small runtime, so it answers whatever the rest of the process runs
//! on (a current-thread runtime, FUSE threads, none).
//!
//! Names start with `regions_`; latencies are histograms in seconds (names ending in
//! `_seconds`, buckets [`LATENCY_BUCKETS`]); labels are few and bounded (`op`, `method`,
//! `result`, `host`, ...).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};

/// Bucket bounds (seconds) of every latency histogram: 10 µs to 10 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How often components refresh gauges that are computed rather than counted (hosts, pool
/// bytes, ...).
pub const GAUGE_PERIOD: Duration = Duration::from_secs(1);

/// Set once [`serve`] succeeded in this process.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Why metrics cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address cannot be bound (taken, not local, no permission).
    #[error(
        "cannot serve metrics on {addr}: {reason}; is another process using it? pick another \
         --metrics-listen"
    )]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the OS said.
        reason: String,
    },
    /// Anything else (the exporter's thread or runtime, a recorder already installed).
    #[error("cannot set up metrics on {addr}: {reason}")]
    Setup {
        /// The address asked for.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
}

/// Whether this process serves metrics (components skip periodic gauge work otherwise).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Installs the Prometheus recorder for this process and serves it on `addr` (HTTP,
/// `GET /metrics`) from a thread named `regions-metrics`. Call once per process, before the
/// work to be measured starts; a second call fails.
pub fn serve(addr: SocketAddr) -> Result<(), MetricsError> {
    // Everything happens on the exporter's thread, which owns its runtime: a runtime must not
    // be dropped (on an error) inside the caller's async context.
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("regions-metrics".into())
        .spawn(move || {
            let exporter = match install(addr) {
                Ok((runtime, exporter)) => {
                    let _ = tx.send(Ok(()));
                    runtime.block_on(exporter)
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            if let Err(e) = exporter {
                tracing::error!(%addr, error = ?e, "the metrics endpoint stopped");
            }
        })
        .map_err(|e| MetricsError::Setup {
            addr,
            reason: format!("cannot start the exporter's thread: {e}"),
        })?;
    rx.recv().unwrap_or_else(|_| {
        Err(MetricsError::Setup {
            addr,
            reason: "the exporter's thread ended while starting".into(),
        })
    })?;
    ENABLED.store(true, Ordering::Relaxed);
    tracing::info!(%addr, "serving Prometheus metrics (GET /metrics)");
    Ok(())
}

/// Builds the exporter on a runtime of its own (binding the listener), installs the recorder.
fn install(
    addr: SocketAddr,
) -> Result<
    (
        tokio::runtime::Runtime,
        metrics_exporter_prometheus::ExporterFuture,
    ),
    MetricsError,
> {
    let setup = |reason: String| MetricsError::Setup { addr, reason };
    let builder = PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(|e| setup(e.to_string()))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| setup(format!("cannot start the exporter's runtime: {e}")))?;
    // Binds the listener (and spawns the recorder's upkeep task) on this runtime.
    let (recorder, exporter) = {
        let _guard = runtime.enter();
        builder.build().map_err(|e| match e {
            BuildError::FailedToCreateHTTPListener(reason) => MetricsError::Bind { addr, reason },
            other => setup(other.to_string()),
        })?
    };
    metrics::set_global_recorder(recorder).map_err(|_| {
        setup("a metrics recorder is already installed in this process (serve once)".into())
    })?;
    Ok((runtime, exporter))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn scrape(addr: SocketAddr) -> String {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    // One test: the recorder is process-wide, and the taken-address case must run before it
    // is installed (a bind failure installs nothing).
    #[test]
    fn taken_address_is_explained_then_metrics_are_served() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = serve(addr).unwrap_err();
        assert!(matches!(err, MetricsError::Bind { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&addr.to_string()), "{text}");
        assert!(text.contains("pick another --metrics-listen"), "{text}");
        assert!(!enabled());

        drop(taken);
        // The freed port may be taken by another test's connection in between: try fresh
        // ports (a failed bind installs nothing, so trying again is clean).
        let mut addr = addr;
        let mut tries = 0;
        while let Err(e) = serve(addr) {
            tries += 1;
            assert!(tries < 20, "no free port to serve metrics on: {e}");
            addr = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap();
        }
        assert!(enabled());
        metrics::counter!("regions_test_things_total", "op" => "unit").increment(3);
        metrics::histogram!("regions_test_duration_seconds").record(0.003);
        let page = scrape(addr);
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(
            page.contains("regions_test_things_total{op=\"unit\"} 3"),
            "{page}"
        );
        assert!(
            page.contains("regions_test_duration_seconds_bucket{le=\"0.005\"} 1"),
            "latency histograms use the shared buckets: {page}"
        );
        let other = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let again = serve(other).unwrap_err();
        assert!(matches!(again, MetricsError::Setup { .. }), "{again:?}");
    }
}
