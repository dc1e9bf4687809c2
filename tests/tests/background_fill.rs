//! Background fill through real mounts: a region held on another host and read at random
//! through a mount is streamed into that host's page cache behind the reader (bounded by
//! `--fill-budget`), every byte read is the region's, and nothing a fill stores survives a
//! write, a truncate or another host's change seen at the next open.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions_tests::memory_cgroup::MemoryCgroup;
use regions_tests::metrics_page::{free_addr, sample, scrape};
use regions_tests::{Cluster, MountProcess};

const MIB: usize = 1 << 20;
const BLOCK: usize = 16 << 10;
const PAGE: usize = 4096;

/// Mounts host `host` of `cluster` at a fresh directory with extra `regionfs mount` arguments,
/// run through `wrapper` (empty: none).
fn mount_with(
    cluster: &Cluster,
    host: u32,
    wrapper: &[std::ffi::OsString],
    extra: &[&str],
) -> MountProcess {
    let daemon = cluster.daemon(host).unwrap();
    MountProcess::start_wrapped_with_args(
        wrapper,
        cluster.manager.addr,
        &cluster.secret_file,
        host,
        &daemon.socket,
        &cluster.dir.path().join(format!("mnt{host}-fill")),
        extra,
    )
    .unwrap()
}

fn random_bytes(rng: &mut StdRng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

/// Pages of `f` (of `len` bytes) in this host's page cache (`mincore` of a mapping that is
/// never touched, so it brings nothing in).
fn resident_pages(f: &File, len: usize) -> usize {
    // SAFETY: a fresh read-only shared mapping of `len` bytes of an open file, never
    // dereferenced, unmapped before returning; mincore writes one byte per page into `vec`,
    // which has that many.
    unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(base, libc::MAP_FAILED, "mmap for mincore failed");
        let mut vec = vec![0u8; len.div_ceil(PAGE)];
        let rc = libc::mincore(base, len, vec.as_mut_ptr());
        libc::munmap(base, len);
        assert_eq!(rc, 0, "mincore failed: {}", std::io::Error::last_os_error());
        vec.iter().filter(|b| **b & 1 == 1).count()
    }
}

/// Reads `n` distinct random 16 KiB blocks of `f` and checks each against `model`.
fn scattered_reads(f: &File, model: &[u8], n: usize, rng: &mut StdRng) {
    let blocks = model.len() / BLOCK;
    let mut buf = vec![0u8; BLOCK];
    let mut seen = std::collections::HashSet::new();
    while seen.len() < n {
        let b = rng.random_range(0..blocks);
        if !seen.insert(b) {
            continue;
        }
        f.read_exact_at(&mut buf, (b * BLOCK) as u64).unwrap();
        assert!(
            buf == model[b * BLOCK..(b + 1) * BLOCK],
            "block {b} read at random is not the region's"
        );
    }
}

/// Reads one 16 KiB block in each 9 MiB of `f` (farther apart than the mount's read-ahead
/// window, so that each one counts as scattered), checking each against `model`.
fn spread_reads(f: &File, model: &[u8], rng: &mut StdRng) {
    let stride = 9 * MIB;
    let mut buf = vec![0u8; BLOCK];
    let mut at = 0;
    while at + stride <= model.len() {
        let b = (at + rng.random_range(0..MIB)) / BLOCK * BLOCK;
        f.read_exact_at(&mut buf, b as u64).unwrap();
        assert!(
            buf == model[b..b + BLOCK],
            "block at {b} is not the region's"
        );
        at += stride;
    }
}

/// Waits (at most 5 s) until the mount at `metrics` has counted more than `before` fills;
/// returns the count.
fn fill_started(metrics: &str, before: f64, what: &str) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = sample(&scrape(metrics).unwrap(), "regions_fuse_fills", &[]);
        if n > before {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no background fill started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Reads all of `f` in 1 MiB pieces and checks it against `model` (and its size).
fn check_all(f: &File, model: &[u8], what: &str) {
    assert_eq!(
        f.metadata().unwrap().len(),
        model.len() as u64,
        "{what}: size"
    );
    let mut buf = vec![0u8; MIB];
    let mut at = 0;
    while at < model.len() {
        let n = (model.len() - at).min(MIB);
        f.read_exact_at(&mut buf[..n], at as u64).unwrap();
        if let Some(i) = buf[..n]
            .iter()
            .zip(&model[at..at + n])
            .position(|(a, b)| a != b)
        {
            panic!("{what}: wrong byte at {}", at + i);
        }
        at += n;
    }
    let mut past = [0u8; 1];
    assert_eq!(
        f.read_at(&mut past, model.len() as u64).unwrap(),
        0,
        "{what}: a byte past the end"
    );
}

/// Waits (at most `limit`) until the resident pages of `f` stop growing for a second; returns
/// them.
fn settled_residency(f: &File, len: usize, limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    let mut last = resident_pages(f, len);
    let mut since = Instant::now();
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        let now = resident_pages(f, len);
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= Duration::from_secs(1) {
            break;
        }
    }
    last
}

/// truncate(2) of `path` to `len` bytes.
fn truncate(path: &std::path::Path, len: usize) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that lives across the call.
    let rc = unsafe { libc::truncate(c.as_ptr(), len as libc::off_t) };
    assert_eq!(
        rc,
        0,
        "truncate {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

fn drop_caches() {
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

#[test]
fn a_region_read_at_random_is_streamed_in_up_to_the_budget() {
    let cluster = Cluster::start(2, "512M").unwrap();
    let b = cluster.mount(2).unwrap();
    let metrics = free_addr();
    let a = mount_with(
        &cluster,
        1,
        &[],
        &["--fill-budget", "48M", "--metrics-listen", &metrics],
    );
    let mut rng = StdRng::seed_from_u64(11);
    let small = random_bytes(&mut rng, 40 * MIB);
    let big = random_bytes(&mut rng, 96 * MIB);
    std::fs::write(b.path("small"), &small).unwrap();
    std::fs::write(b.path("big"), &big).unwrap();
    drop_caches();

    // Within the budget: all of it arrives, and every byte is the region's.
    let f = File::open(a.path("small")).unwrap();
    scattered_reads(&f, &small, 64, &mut rng);
    let pages = small.len() / PAGE;
    let resident = settled_residency(&f, small.len(), Duration::from_secs(30));
    assert!(
        resident * 100 >= pages * 99,
        "a region of {pages} pages read at random: only {resident} came into the page cache"
    );
    check_all(&f, &small, "small region after its fill");

    // Past the budget: the fill stops at it.
    let f = File::open(a.path("big")).unwrap();
    scattered_reads(&f, &big, 16, &mut rng);
    let resident = settled_residency(&f, big.len(), Duration::from_secs(30)) * PAGE;
    assert!(
        (47 * MIB..=56 * MIB).contains(&resident),
        "a 96 MiB region with a 48 MiB fill budget: {} KiB cached",
        resident >> 10
    );
    check_all(&f, &big, "large region after its fill");

    // A region read in order (1 MiB reads, as cp and cat do) gets no fill: the kernel's
    // read-ahead serves it, even though this mount's threads answer its pieces out of order.
    let fills = || sample(&scrape(&metrics).unwrap(), "regions_fuse_fills", &[]);
    let before = fills();
    assert!(
        before >= 2.0,
        "{before} fills counted for the two regions read at random"
    );
    let order = random_bytes(&mut rng, 96 * MIB);
    std::fs::write(b.path("order"), &order).unwrap();
    drop_caches();
    let f = File::open(a.path("order")).unwrap();
    check_all(&f, &order, "a region read in order");
    assert_eq!(
        fills(),
        before,
        "a region read in order got a background fill"
    );
}

#[test]
fn a_fill_never_undoes_a_write_a_truncate_or_a_change_elsewhere() {
    let cluster = Cluster::start(2, "1G").unwrap();
    let b = cluster.mount(2).unwrap();
    // Every fill waits 150 ms between reading a step (the first 4 MiB first) and storing it:
    // each change below lands in that window.
    let wrapper: Vec<std::ffi::OsString> =
        vec!["env".into(), "REGIONFS_FILL_TEST_PAUSE_MS=150".into()];
    let metrics = free_addr();
    let a = mount_with(&cluster, 1, &wrapper, &["--metrics-listen", &metrics]);
    let mut fills = 0.0;
    let mut rng = StdRng::seed_from_u64(12);
    let len = 64 * MIB;
    let first_step = 4 * MIB;
    let mut model = random_bytes(&mut rng, len);
    std::fs::write(b.path("r"), &model).unwrap();
    for round in 0..2 {
        // A writer on the filling host: its writes land in the page cache the fill would
        // store the old bytes into.
        drop_caches();
        let reader = File::open(a.path("r")).unwrap();
        spread_reads(&reader, &model, &mut rng);
        fills = fill_started(&metrics, fills, &format!("round {round}, before a write"));
        let w = OpenOptions::new()
            .read(true)
            .write(true)
            .open(a.path("r"))
            .unwrap();
        for _ in 0..32 {
            let at = rng.random_range(0..first_step - 3 * PAGE);
            let n = rng.random_range(1..3 * PAGE);
            let bytes = random_bytes(&mut rng, n);
            w.write_all_at(&bytes, at as u64).unwrap();
            model[at..at + n].copy_from_slice(&bytes);
        }
        drop(w);
        std::thread::sleep(Duration::from_millis(300));
        check_all(
            &reader,
            &model,
            &format!("round {round}: after a write on the filling host"),
        );
        drop(reader);

        // Another host's change, seen at the next open here while a fill of the old bytes
        // is between its read and its store.
        drop_caches();
        let reader = File::open(a.path("r")).unwrap();
        spread_reads(&reader, &model, &mut rng);
        fills = fill_started(
            &metrics,
            fills,
            &format!("round {round}, before a change elsewhere"),
        );
        let wb = OpenOptions::new().write(true).open(b.path("r")).unwrap();
        for _ in 0..32 {
            let at = rng.random_range(0..first_step - PAGE);
            let bytes = random_bytes(&mut rng, PAGE);
            wb.write_all_at(&bytes, at as u64).unwrap();
            model[at..at + PAGE].copy_from_slice(&bytes);
        }
        drop(wb);
        // The reader stays open (its release would end the fill anyway).
        let again = File::open(a.path("r")).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        check_all(
            &again,
            &model,
            &format!("round {round}: after a change on the other host"),
        );
        drop(again);
        drop(reader);
    }

    // A truncate by path on the filling host while a fill holds the old first step: nothing
    // past the new end comes back, and growing again shows zeros.
    drop_caches();
    let reader = File::open(a.path("r")).unwrap();
    spread_reads(&reader, &model, &mut rng);
    fill_started(&metrics, fills, "before a truncate");
    let short = MIB;
    truncate(&a.path("r"), short);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        reader.metadata().unwrap().len(),
        short as u64,
        "size after the truncate"
    );
    model.truncate(short);
    check_all(&reader, &model, "after a truncate during a fill");
    truncate(&a.path("r"), len);
    model.resize(len, 0);
    check_all(&reader, &model, "grown again after the truncate");
    drop(reader);
    let other = File::open(b.path("r")).unwrap();
    check_all(
        &other,
        &model,
        "the other host after the truncate and growth",
    );
}

#[test]
fn a_fill_under_memory_pressure_keeps_the_mount_serving_the_right_bytes() {
    let cluster = Cluster::start(2, "512M").unwrap();
    let b = cluster.mount(2).unwrap();
    let limit = 64 * MIB as u64;
    let cg = MemoryCgroup::create("regions-fill-pressure", limit).unwrap();
    let join = format!("echo $$ > {} && exec \"$0\" \"$@\"", cg.procs().display());
    let wrapper: Vec<std::ffi::OsString> = vec!["sh".into(), "-c".into(), join.into()];
    let metrics = free_addr();
    let mut a = mount_with(&cluster, 1, &wrapper, &["--metrics-listen", &metrics]);
    let mut rng = StdRng::seed_from_u64(13);
    let model = random_bytes(&mut rng, 192 * MIB);
    std::fs::write(b.path("r"), &model).unwrap();
    drop_caches();
    let f = File::open(a.path("r")).unwrap();
    // The fill stores three times the mount's memory limit; the kernel reclaims its pages as
    // it goes, and every read is checked.
    scattered_reads(&f, &model, 64, &mut rng);
    std::thread::sleep(Duration::from_secs(2));
    scattered_reads(&f, &model, 256, &mut rng);
    check_all(&f, &model, "under a memory limit");
    // The fill goes on under the limit (the kernel reclaims what it stored as it goes).
    let deadline = Instant::now() + Duration::from_secs(30);
    let stored = loop {
        let stored = sample(&scrape(&metrics).unwrap(), "regions_fuse_fill_bytes", &[]);
        if stored >= (2 * limit) as f64 || Instant::now() > deadline {
            break stored;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        stored >= (2 * limit) as f64,
        "the fill stored {stored} bytes under a memory limit of {limit}: it should have gone on"
    );
    scattered_reads(&f, &model, 64, &mut rng);
    drop(f);
    assert!(
        a.is_running(),
        "the mount died under its memory limit:\n{}",
        a.log()
    );
    assert_eq!(cg.oom_kills(), 0, "the mount's cgroup saw an OOM kill");
    if let Some(peak) = cg.peak() {
        assert!(peak <= limit, "peak {peak} over the limit {limit}");
    }
    a.sigterm_and_wait(Duration::from_secs(10)).unwrap();
}
