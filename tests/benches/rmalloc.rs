//! rmalloc against glibc malloc in the same process: 64-byte allocate+free
//! pairs per second (targets: the core >= 0.7x glibc; from C, `rmalloc(fd)` >= 0.3x).
//!
//! ```sh
//! cargo build --release --bins
//! cargo bench -p regions-tests --bench rmalloc
//! ```
//!
//! Two patterns, each against `malloc`/`free` of glibc measured in the same
//! run, interleaved, median of 5 runs:
//!
//! - *pair*: allocate 64 bytes, write a byte, free it, repeated;
//! - *batch*: allocate 1,000 blocks of 64 bytes, then free them all.
//!
//! And three places for rmalloc:
//!
//! 1. the allocator core ([`regions::rmalloc::Heap`]) over anonymous shared
//!    memory (what the allocator itself costs);
//! 2. the same core over a region mapped with `regions::mapping` (a real
//!    cluster: manager, daemon, regionfs mount; the region is on this host,
//!    so the mapping is its segment memfd);
//! 3. the C functions `rmalloc(fd, 64)` / `rfree(p)` on that region, which
//!    also check on every call that the descriptor still names the region (two
//!    words of the mount's page of descriptor epochs, no system call while the
//!    mount saw no open or close: the bench prints how many `kcmp` checks the
//!    rows made; see `regions::capi::alloc`) and find the pointer's mapping (a
//!    per-thread last-mapping check, no system call); and `rmalloc_at(base, 64)`,
//!    which names the mapping by address.
//!
//! Small blocks come from a per-thread cache kept in the region
//! (`regions::rmalloc`), so the pair patterns measure its lock-free paths,
//! and the batch pattern its refills and flushes under the heap lock.
//!
//! `BENCH_QUICK=1`, or running without `--bench` (as `cargo test --benches`
//! does), runs a tiny version as a smoke test.

use std::hint::black_box;
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::time::Instant;

use regions::capi::alloc::{descriptor_checks, rfree, rmalloc, rmalloc_at};
use regions::rmalloc::Heap;
use regions_tests::Cluster;

const BATCH: usize = 1000;

/// A measurement: pairs per second of `n` allocations and frees.
type Pattern = fn(usize, &mut dyn FnMut() -> *mut u8, &mut dyn FnMut(*mut u8)) -> f64;

fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some() || !std::env::args().any(|a| a == "--bench")
}

/// Pairs per second of `alloc`+`free`.
fn pairs(n: usize, alloc: &mut dyn FnMut() -> *mut u8, free: &mut dyn FnMut(*mut u8)) -> f64 {
    let t = Instant::now();
    for i in 0..n {
        let p = alloc();
        assert!(!p.is_null());
        // SAFETY: a live 64-byte block.
        unsafe { p.write(i as u8) };
        free(black_box(p));
    }
    n as f64 / t.elapsed().as_secs_f64()
}

/// Pairs per second, allocating BATCH blocks then freeing them.
fn batches(n: usize, alloc: &mut dyn FnMut() -> *mut u8, free: &mut dyn FnMut(*mut u8)) -> f64 {
    let mut live = Vec::with_capacity(BATCH);
    let rounds = (n / BATCH).max(1);
    let t = Instant::now();
    for _ in 0..rounds {
        for i in 0..BATCH {
            let p = alloc();
            assert!(!p.is_null());
            // SAFETY: a live 64-byte block.
            unsafe { p.write(i as u8) };
            live.push(p);
        }
        for p in live.drain(..) {
            free(black_box(p));
        }
    }
    (rounds * BATCH) as f64 / t.elapsed().as_secs_f64()
}

fn glibc_alloc() -> *mut u8 {
    // SAFETY: plain malloc.
    unsafe { libc::malloc(black_box(64)) as *mut u8 }
}

fn glibc_free(p: *mut u8) {
    // SAFETY: p came from malloc.
    unsafe { libc::free(p as *mut libc::c_void) }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `ours` and glibc interleaved; prints and returns the ratio.
fn compare(
    label: &str,
    n: usize,
    runs: usize,
    pattern: Pattern,
    alloc: &mut dyn FnMut() -> *mut u8,
    free: &mut dyn FnMut(*mut u8),
) -> f64 {
    // Warm-up.
    pattern(n / 10 + 1, alloc, free);
    pattern(n / 10 + 1, &mut glibc_alloc, &mut glibc_free);
    let mut ours = Vec::new();
    let mut base = Vec::new();
    for _ in 0..runs {
        ours.push(pattern(n, alloc, free));
        base.push(pattern(n, &mut glibc_alloc, &mut glibc_free));
    }
    let (o, b) = (median(ours), median(base));
    println!(
        "{label:<44} {:>7.2} M pairs/s   glibc {:>7.2} M pairs/s   ratio {:.2}",
        o / 1e6,
        b / 1e6,
        o / b
    );
    o / b
}

fn heap_fns(heap: Heap) -> (impl FnMut() -> *mut u8, impl FnMut(*mut u8)) {
    (
        move || heap.alloc_ptr(64).expect("rmalloc"),
        move |p: *mut u8| heap.free_ptr(p).expect("rfree"),
    )
}

fn main() -> ExitCode {
    let quick = quick();
    let (n, runs) = if quick { (20_000, 1) } else { (3_000_000, 5) };
    println!("rmalloc vs glibc malloc, 64-byte blocks, {n} pairs per run, median of {runs}");

    // 1. The core over anonymous memory.
    let len = 64 << 20;
    // Raw mmap, not memmap2: MAP_SHARED anonymous memory, as a region's pages are shared
    // (memmap2's anonymous maps are MAP_PRIVATE).
    // SAFETY: a fresh anonymous shared mapping.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(mem, libc::MAP_FAILED);
    // SAFETY: the mapping stays for the whole run.
    let heap = unsafe { Heap::attach(mem as *mut u8, len) }.expect("heap");
    let (mut a, mut f) = heap_fns(heap);
    let r1 = compare(
        "core, anonymous memory, pair",
        n,
        runs,
        pairs,
        &mut a,
        &mut f,
    );
    compare(
        "core, anonymous memory, batch",
        n,
        runs,
        batches,
        &mut a,
        &mut f,
    );

    // 2. and 3. A region mapped from a real mount.
    let mut c_fd = 0.0;
    let mapped = (|| -> anyhow::Result<()> {
        let cluster = Cluster::start(1, "1G")?;
        let mount = cluster.mount(1)?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(mount.path("heap"))?;
        let fd = file.as_raw_fd();
        let first = rmalloc(fd, 64);
        anyhow::ensure!(
            !first.is_null(),
            "rmalloc on the mount failed: {}",
            std::io::Error::last_os_error()
        );
        rfree(first);
        let m = regions::mapping::lookup(first as *const u8)
            .ok_or_else(|| anyhow::anyhow!("no mapping after rmalloc"))?;
        // The arena this process allocates in.
        let shared = regions::capi::alloc::heap_at(first as *const u8)?;
        let arena = shared
            .current()
            .ok_or_else(|| anyhow::anyhow!("no arena after rmalloc"))?;
        // SAFETY: the arena stays mapped while `shared` is held, and is this process's.
        let heap = unsafe { Heap::attach(arena.base(), arena.len()) }?;
        let (mut a, mut f) = heap_fns(heap);
        compare(
            "core, mapped region (local memfd), pair",
            n,
            runs,
            pairs,
            &mut a,
            &mut f,
        );
        let mut ca = || rmalloc(fd, 64) as *mut u8;
        let mut cf = |p: *mut u8| assert_eq!(rfree(p as *mut libc::c_void), 0);
        let checks = descriptor_checks();
        c_fd = compare(
            "C rmalloc(fd)/rfree, mapped region, pair",
            n,
            runs,
            pairs,
            &mut ca,
            &mut cf,
        );
        compare(
            "C rmalloc(fd)/rfree, mapped region, batch",
            n,
            runs,
            batches,
            &mut ca,
            &mut cf,
        );
        println!(
            "  descriptor checks (kcmp) in the rmalloc(fd) rows: {}",
            descriptor_checks() - checks
        );
        let base = m.base().cast::<libc::c_void>();
        let mut ca_at = || rmalloc_at(base, 64) as *mut u8;
        compare(
            "C rmalloc_at(base)/rfree, mapped region, pair",
            n,
            runs,
            pairs,
            &mut ca_at,
            &mut cf,
        );
        compare(
            "C rmalloc_at(base)/rfree, mapped region, batch",
            n,
            runs,
            batches,
            &mut ca_at,
            &mut cf,
        );
        drop(file);
        Ok(())
    })();
    println!("target: core pair ratio >= 0.7 (measured {r1:.2})");
    println!("target: C rmalloc(fd) pair ratio >= 0.3 (measured {c_fd:.2})");
    if let Err(e) = mapped {
        eprintln!("rmalloc bench: the mapped-region rows failed: {e:#}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
