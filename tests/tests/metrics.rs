//! Prometheus metrics end to end: a manager, two daemons and a mount, each started with
//! `--metrics-listen`, a known amount of file I/O through the mount (one file held on the
//! mount's own host, one on the other host), and then each endpoint scraped with a plain
//! HTTP GET to check that the counters of exactly that work moved.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use regions_tests::metrics_page::{free_addr, sample, scrape};
use regions_tests::{DaemonProcess, ManagerProcess, MountProcess, write_secret};

/// Bound on waiting for a value to show (gauges refresh every second).
const WAIT: Duration = Duration::from_secs(20);
const MIB: f64 = (1 << 20) as f64;

/// Scrapes `addr` until `ok` holds for the page (at most [`WAIT`]); fails with the last page.
fn wait_for(what: &str, addr: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let page = scrape(addr);
        match &page {
            Ok(p) if ok(p) => return p.clone(),
            _ if Instant::now() >= deadline => {
                panic!("{what}: not seen at {addr} within {WAIT:?}; last scrape: {page:?}")
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Reads `path` through the mount, not from the page cache (whose pages the write left).
fn read_uncached(path: &Path) -> Vec<u8> {
    let mut file = std::fs::File::open(path).unwrap();
    // SAFETY: fadvise on an open descriptor; clean cached pages are dropped.
    let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise failed: {r}");
    let mut out = Vec::new();
    file.read_to_end(&mut out).unwrap();
    out
}

#[test]
fn every_process_serves_the_counters_of_its_work() {
    let dir = tempfile::Builder::new()
        .prefix("regions-metrics")
        .tempdir()
        .unwrap();
    let secret_file = dir.path().join("secret");
    write_secret(&secret_file).unwrap();
    let data = dir.path().join("manager");
    std::fs::create_dir_all(&data).unwrap();
    let (m_addr, d1_addr, d2_addr, f_addr) = (free_addr(), free_addr(), free_addr(), free_addr());

    let manager =
        ManagerProcess::start_with_args(&data, &secret_file, &["--metrics-listen", &m_addr])
            .unwrap();
    let daemon = |host, addr: &str| {
        DaemonProcess::start_with_args(
            manager.addr,
            &secret_file,
            host,
            "256M",
            dir.path(),
            &["--metrics-listen", addr],
        )
        .unwrap()
    };
    let d1 = daemon(1, &d1_addr);
    let _d2 = daemon(2, &d2_addr);
    let mount = MountProcess::start_with_args(
        manager.addr,
        &secret_file,
        1,
        &d1.socket,
        &dir.path().join("mnt"),
        &["--metrics-listen", &f_addr],
    )
    .unwrap();

    // Before any file work: every endpoint answers, the mount has no file open.
    let before = scrape(&f_addr).unwrap();
    assert_eq!(
        sample(&before, "regions_fuse_bytes_total", &[("op", "write")]),
        0.0
    );
    scrape(&m_addr).unwrap();
    scrape(&d2_addr).unwrap();

    // One MiB into a region on this host (local segment), one MiB into a region on host 2
    // (tcp transport to daemon 2).
    let block: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    std::fs::create_dir(mount.path("far")).unwrap();
    regions_tests::set_xattr(&mount.path("far"), "user.regions.hostalloc", b"2")
        .expect("setxattr hostalloc");
    for name in ["near", "far/blob"] {
        let mut f = std::fs::File::create(mount.path(name)).unwrap();
        f.write_all(&block).unwrap();
        f.sync_all().unwrap();
    }
    assert!(std::fs::metadata(mount.path("missing")).is_err());
    let held = std::fs::File::open(mount.path("near")).unwrap();
    // (A read-only open of a file this mount just wrote asks the manager nothing, under the
    // mount's lease: an open for writing does.)
    drop(
        std::fs::OpenOptions::new()
            .append(true)
            .open(mount.path("far/blob"))
            .unwrap(),
    );

    // The mount: FUSE requests, bytes, open files, and the client's split local / tcp.
    let page = wait_for("the mount's open file", &f_addr, |p| {
        sample(p, "regions_fuse_open_handles", &[]) >= 1.0
    });
    assert!(sample(&page, "regions_fuse_requests_total", &[("op", "create")]) >= 2.0);
    assert!(sample(&page, "regions_fuse_requests_total", &[("op", "write")]) >= 2.0);
    assert!(
        sample(
            &page,
            "regions_fuse_request_duration_seconds_count",
            &[("op", "write")]
        ) >= 2.0
    );
    assert!(
        sample(
            &page,
            "regions_fuse_request_duration_seconds_bucket",
            &[("op", "write"), ("le", "+Inf")]
        ) >= 2.0,
        "latencies are histograms: {page}"
    );
    assert!(sample(&page, "regions_fuse_bytes_total", &[("op", "write")]) >= 2.0 * MIB);
    // The near file's first chunk is written through the mapped segment; chunks it grows by
    // may go over tcp to daemon 1 until the mount maps them, so only the far file's MiB is
    // surely tcp, and the two together are both files.
    let local = sample(
        &page,
        "regions_client_bytes_total",
        &[("op", "write"), ("transport", "local")],
    );
    let tcp = sample(
        &page,
        "regions_client_bytes_total",
        &[("op", "write"), ("transport", "tcp")],
    );
    assert!(
        local > 0.0 && tcp >= MIB && local + tcp >= 2.0 * MIB,
        "{page}"
    );
    assert!(
        sample(
            &page,
            "regions_fuse_errors_total",
            &[("op", "lookup"), ("errno", "2")]
        ) >= 1.0,
        "the lookup of a missing name: {page}"
    );

    // Reading the remote file back goes through FUSE and the tcp transport again.
    assert!(
        read_uncached(&mount.path("far/blob")) == block,
        "data read back differs"
    );
    let page = scrape(&f_addr).unwrap();
    assert!(
        sample(&page, "regions_fuse_bytes_total", &[("op", "read")]) >= MIB,
        "{page}"
    );
    assert!(
        sample(
            &page,
            "regions_client_bytes_total",
            &[("op", "read"), ("transport", "tcp")]
        ) >= MIB,
        "{page}"
    );

    // Closed files leave the open-handle gauge (the kernel releases them asynchronously).
    drop(held);
    wait_for("no file open on the mount", &f_addr, |p| {
        sample(p, "regions_fuse_open_handles", &[]) == 0.0
    });

    // Daemon 2 served the remote file over its transport.
    let page = wait_for("daemon 2's pool usage", &d2_addr, |p| {
        sample(p, "regions_daemon_pool_allocated_bytes", &[]) >= MIB
    });
    let writes = sample(
        &page,
        "regions_daemon_transport_requests_total",
        &[("op", "write")],
    ) + sample(
        &page,
        "regions_daemon_transport_requests_total",
        &[("op", "writev")],
    );
    assert!(writes >= 1.0, "{page}");
    assert!(
        sample(
            &page,
            "regions_daemon_transport_bytes_total",
            &[("direction", "in")]
        ) >= MIB,
        "{page}"
    );
    assert!(
        sample(
            &page,
            "regions_daemon_transport_bytes_total",
            &[("direction", "out")]
        ) >= MIB,
        "{page}"
    );
    assert_eq!(
        sample(&page, "regions_daemon_pool_capacity_bytes", &[]),
        256.0 * MIB
    );
    assert!(sample(&page, "regions_daemon_pool_free_bytes", &[]) <= 255.0 * MIB);

    // Daemon 1 handed the mount the near file's segment through its host agent.
    let page = scrape(&d1_addr).unwrap();
    assert!(
        sample(
            &page,
            "regions_daemon_agent_requests_total",
            &[("call", "segment"), ("result", "ok")]
        ) >= 1.0,
        "{page}"
    );

    // The manager: the requests the mount made, per method, and the cluster's gauges.
    let page = wait_for("the manager's cluster gauges", &m_addr, |p| {
        sample(p, "regions_manager_live_hosts", &[]) == 2.0
            && sample(p, "regions_manager_regions", &[]) >= 2.0
    });
    let created = sample(
        &page,
        "regions_manager_grpc_requests_total",
        &[("service", "Regions"), ("method", "CreateOpen")],
    );
    assert!(created >= 2.0, "{page}");
    assert!(
        sample(
            &page,
            "regions_manager_grpc_request_duration_seconds_count",
            &[("service", "Regions"), ("method", "CreateOpen")]
        ) == created
    );
    assert!(
        sample(
            &page,
            "regions_manager_grpc_requests_total",
            &[("method", "Open")]
        ) >= 1.0,
        "{page}"
    );
    assert!(
        sample(
            &page,
            "regions_manager_grpc_errors_total",
            &[("method", "Lookup"), ("code", "NotFound")]
        ) >= 1.0,
        "{page}"
    );
    assert_eq!(sample(&page, "regions_manager_hosts", &[]), 2.0);
    assert_eq!(
        sample(&page, "regions_manager_host_live", &[("host", "2")]),
        1.0
    );
    assert_eq!(
        sample(&page, "regions_manager_pool_bytes", &[]),
        512.0 * MIB
    );
    assert!(
        sample(&page, "regions_manager_directories", &[]) >= 2.0,
        "root and far/"
    );
}

#[test]
fn a_taken_metrics_address_stops_the_start_with_advice() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    write_secret(&secret_file).unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let started =
        ManagerProcess::start_with_args(dir.path(), &secret_file, &["--metrics-listen", &addr]);
    let err = match started {
        Ok(_) => panic!("the manager started although {addr} is taken"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains(&format!("cannot serve metrics on {addr}"))
            && err.contains("pick another --metrics-listen"),
        "{err}"
    );
}
