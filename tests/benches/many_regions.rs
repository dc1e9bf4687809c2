//! 1,000,000 small regions on one host through the library and 50,000 through a mount, then
//! the host's open files run out on purpose (`regions_tests::many_regions`; the test
//! `many_regions` runs the same with thousands). Prints the creation rates, the object store's
//! memory against the regions' bytes, the descriptors and resident memory of the daemon and
//! the manager, and what happened out of descriptors.
//!
//! `cargo build --release --bins && cargo bench -p regions-tests --bench many_regions`
//! (`-- LIBRARY MOUNT THREADS` to change the counts; about 20 minutes at the defaults).

use regions_tests::many_regions::{Scale, run};

fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let scale = Scale {
        library: args.first().copied().unwrap_or(1_000_000),
        mount: args.get(1).copied().unwrap_or(50_000),
        threads: args.get(2).copied().unwrap_or(8),
    };
    let started = std::time::Instant::now();
    let report = run(scale, |step| {
        eprintln!("[{:>6.0} s] {step}", started.elapsed().as_secs_f64())
    })?;
    println!(
        "many_regions ({:.0} s in all)",
        started.elapsed().as_secs_f64()
    );
    for line in report.lines(scale) {
        println!("  {line}");
    }
    Ok(())
}
