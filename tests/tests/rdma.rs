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

use regions::{Client, ClientConfig};
use regions_proto::transport_choice::TransportChoice;
use regions_proto::v1;
use regions_tests::{Cluster, bin_path, soft_roce};

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
    // What passed, in the test's output (`--nocapture`) and CI's log.
    eprintln!("{out}");
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
        "hosts report their transports",
        "write and read back over RDMA, a tcp client sees the same bytes: ok",
        "after a truncate and rewrite elsewhere the RDMA client reads the new bytes: ok",
        "after a truncate inside a chunk, RDMA reads zeros past the end: ok",
        "a region over two hosts over RDMA, and atomics see its bytes: ok",
        "fetch-adds over RDMA and 300 over tcp at once, none lost;",
        "auto: a tcp-only daemon is read over tcp: ok",
        "rdma only: a tcp-only daemon is refused",
        "applications read, write and apply atomics over RDMA (memory windows): ok",
        "fast paths over RDMA: ok",
        "a read-only capability's window reads its 8192 bytes: ok",
        "the byte before the window: refused",
        "bytes past the window: refused",
        "a read across its end: refused",
        "a WRITE through a read-only window: refused",
        "keys outside the capability: refused",
        "keys write keys with a read-only capability: refused",
        "a window used through another connection's queue pair: refused",
        "a read-write capability's window takes a WRITE: ok",
        "a window after its capability expired: refused",
        "a window after its capability was revoked: refused",
        "a dead daemon fails a read in",
        "regions-rdma-check: all passed",
    ] {
        assert!(out.contains(step), "missing {step:?} in:\n{out}");
    }
}

/// On this machine (no RDMA device, daemons on their default `auto`): a client on `auto` reads
/// and writes over tcp as if RDMA did not exist, and one on `rdma` only fails each request with
/// an error that says RDMA is not available and how to fall back, instead of using tcp.
#[test]
fn without_a_device_auto_uses_tcp_and_rdma_only_says_why() {
    let cluster = Cluster::start(2, "64M").unwrap();
    let with = |choice| {
        let mut config = ClientConfig::new(&cluster.manager_url(), cluster.secret.clone(), 1);
        config.transport = choice;
        Client::connect(config).unwrap()
    };
    let auto = with(TransportChoice::Auto);
    let attr = auto
        .create_path(
            "r",
            0o644,
            Some(v1::RegionAttrOverrides {
                hostalloc: Some("2".into()),
                ..Default::default()
            }),
            0,
        )
        .unwrap();
    let region = auto.open(attr.ino, true).unwrap();
    region.write_at(0, b"over tcp").unwrap();
    let mut back = [0u8; 8];
    region.read_at(0, &mut back).unwrap();
    assert_eq!(&back, b"over tcp");
    let stats = auto.stats();
    assert_eq!(stats.rdma_requests, 0, "{stats:?}");
    assert!(stats.remote_bytes_read >= 8 && stats.remote_bytes_written >= 8);
    let strict = with(TransportChoice::Rdma);
    let r = strict.open(attr.ino, false).unwrap();
    let e = r.read_at(0, &mut back).unwrap_err();
    assert!(
        e.to_string().contains("RDMA is not available") && e.to_string().contains("auto"),
        "{e}"
    );
    assert_eq!(e.errno(), libc::EIO);
}
