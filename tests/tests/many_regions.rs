//! Thousands of small regions on one host through the library and through a mount, then the
//! host's open files run out on purpose (`regions_tests::many_regions`): every region is an
//! object counted in `.regions/pools` and reads back, the daemon holds no more descriptors
//! for them, and out of descriptors, regions that need a segment get `ENOSPC` while small
//! regions and the host agent keep working. `cargo bench -p regions-tests --bench
//! many_regions` runs the same with 1,000,000 regions through the library.

use regions_tests::many_regions::{Scale, run};

#[test]
fn many_small_regions_take_no_descriptor_and_outlive_the_fd_limit() {
    let scale = Scale {
        library: 10_000,
        mount: 2_000,
        threads: 4,
    };
    let report = run(scale, |step| eprintln!("{step}")).unwrap();
    for line in report.lines(scale) {
        eprintln!("{line}");
    }
}
