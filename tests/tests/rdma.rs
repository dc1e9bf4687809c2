//! RDMA on soft-RoCE, in a VM (`regions_tests::soft_roce`): this machine's kernel has no RDMA
//! device, so this test boots Debian's kernel under qemu with `rdma_rxe` and runs this build's
//! binaries inside it, once for both checks (a boot under software emulation takes about
//! 25 s):
//!
//! - `regions-verbs-check`: the verbs layer between two processes. One registers a memfd
//!   mapping as a pool does (for reading and writing, and for reading only); the other WRITEs
//!   and READs it one-sided (one request, and three in one list), runs compare-and-swap and
//!   fetch-and-add on a word, and sees a wrong key, a WRITE and an atomic with the read-only
//!   key and a range past the registration refused, each breaking its queue pair, and a new
//!   one working.
//! - `regions-rdma-check`: the RDMA transport end to end (manager, daemons serving RDMA and
//!   one serving tcp only, libregions clients): see that binary.

use std::time::Duration;

use regions_tests::{bin_path, soft_roce};

#[test]
fn rdma_transport_on_soft_roce() {
    let verbs = bin_path("regions-verbs-check").expect("cargo build --bins first");
    let cluster = bin_path("regions-rdma-check").expect("cargo build --bins first");
    let bins = cluster
        .parent()
        .expect("the binaries' directory")
        .to_path_buf();
    let out = soft_roce::run(
        &format!(
            "{verbs} {dev} && REGIONS_BIN_DIR={bins} {cluster} {dev}",
            verbs = verbs.display(),
            cluster = cluster.display(),
            bins = bins.display(),
            dev = soft_roce::DEVICE,
        ),
        Duration::from_secs(400),
    )
    .expect("the soft-RoCE VM");
    assert!(out.contains("soft-roce: script exit 0"), "{out}");
    for step in [
        "regions-verbs-check: all passed",
        "write then read of 65536 bytes: ok",
        "vector READ of 3 pieces in one list: ok",
        "compare-and-swap and fetch-and-add: ok",
        "wrong rkey: refused",
        "WRITE with a read-only key: refused",
        "fetch-and-add with a read-only key: refused",
        "past the registration: refused",
        "write and read back over RDMA, a tcp client sees the same bytes: ok",
        "after a truncate and rewrite elsewhere the RDMA client reads the new bytes: ok",
        "auto: a tcp-only daemon is read over tcp: ok",
        "rdma only: a tcp-only daemon is refused",
        "regions-rdma-check: all passed",
    ] {
        assert!(out.contains(step), "missing {step:?} in:\n{out}");
    }
}
