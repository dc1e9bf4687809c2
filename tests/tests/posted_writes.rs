//! Writes through the mount to memory on another host are posted (docs/SEMANTICS.md, "Writes
//! to another host's memory"): `write(2)` returns once the bytes are sent, later reads on the
//! same mount see them, `fsync` and `close` return only after the daemon applied them, and a
//! posted write that never landed fails `fsync` with `EIO` instead of being lost silently.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions_tests::Cluster;

const BLOCK: usize = 16 << 10;
const FILE: usize = 4 << 20;

/// A buffer of `len` bytes aligned for `O_DIRECT`, inside `storage`.
fn aligned(storage: &mut Vec<u8>, len: usize) -> &mut [u8] {
    storage.resize(len + 4096, 0);
    let skip = storage.as_ptr().align_offset(4096);
    &mut storage[skip..skip + len]
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

/// Host 2 creates `name` (so its memory is on host 2) with `contents`.
fn create_on_host_2(mount2: &regions_tests::MountProcess, name: &str, contents: &[u8]) {
    std::fs::write(mount2.path(name), contents).unwrap();
}

#[test]
fn posted_writes_to_another_host_read_back_exactly() {
    let cluster = Cluster::start(2, "128M").unwrap();
    let m1 = cluster.mount(1).unwrap();
    let m2 = cluster.mount(2).unwrap();
    let mut model = random_bytes(FILE, 1);
    create_on_host_2(&m2, "far", &model);
    let mut rng = StdRng::seed_from_u64(2);
    let mut storage = Vec::new();
    let mut back_storage = Vec::new();
    {
        // O_DIRECT: every write(2) is one FUSE write, posted to host 2's daemon.
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(m1.path("far"))
            .unwrap();
        for i in 0..600 {
            let at = rng.random_range(0..FILE / BLOCK) * BLOCK;
            let data = random_bytes(BLOCK, 100 + i);
            aligned(&mut storage, BLOCK).copy_from_slice(&data);
            f.write_all_at(aligned(&mut storage, BLOCK), at as u64)
                .unwrap();
            model[at..at + BLOCK].copy_from_slice(&data);
            if i % 7 == 0 {
                // A read of the same descriptor right after sees the write.
                let back = aligned(&mut back_storage, BLOCK);
                f.read_exact_at(back, at as u64).unwrap();
                assert!(back == &data[..], "read after posted write at {at}");
            }
        }
        f.sync_all().unwrap();
    }
    {
        // Buffered: written back by the kernel in pieces, posted.
        let f = OpenOptions::new().write(true).open(m1.path("far")).unwrap();
        for i in 0..300 {
            let at = rng.random_range(0..FILE - 5000);
            let data = random_bytes(1 + rng.random_range(0..5000), 10_000 + i);
            f.write_all_at(&data, at as u64).unwrap();
            model[at..at + data.len()].copy_from_slice(&data);
        }
    }
    // Close-to-open on the host that holds the memory.
    assert!(
        std::fs::read(m2.path("far")).unwrap() == model,
        "host 2 reads what host 1 wrote"
    );
}

#[test]
fn a_posted_write_that_never_lands_fails_fsync() {
    let mut cluster = Cluster::start(2, "128M").unwrap();
    let m1 = cluster.mount(1).unwrap();
    let m2 = cluster.mount(2).unwrap();
    create_on_host_2(&m2, "doomed", &random_bytes(FILE, 3));
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(m1.path("doomed"))
        .unwrap();
    let other = OpenOptions::new()
        .write(true)
        .open(m1.path("doomed"))
        .unwrap();
    let reader = std::fs::File::open(m1.path("doomed")).unwrap();
    let mut storage = Vec::new();
    aligned(&mut storage, BLOCK).fill(0x5a);
    // Posting works while the daemon lives (the lane connection is up).
    for i in 0..16 {
        f.write_all_at(aligned(&mut storage, BLOCK), (i * BLOCK) as u64)
            .unwrap();
    }
    f.sync_all().unwrap();

    cluster
        .daemons
        .iter_mut()
        .find(|d| d.host_id == 2)
        .unwrap()
        .sigkill()
        .unwrap();
    // Writes after the daemon died: a posted one returns before anything can tell.
    let mut succeeded = 0;
    let t0 = Instant::now();
    for i in 16..24 {
        match f.write_all_at(aligned(&mut storage, BLOCK), (i * BLOCK) as u64) {
            Ok(()) => succeeded += 1,
            Err(e) => eprintln!("write {i} after the kill: {e} {:?}", t0.elapsed()),
        }
    }
    assert!(
        succeeded > 0,
        "no write returned before its reply: nothing was posted"
    );
    // Those bytes never reached memory: fsync says so, within the retry bound, also through
    // another descriptor of the file (the kernel writes back through any of them).
    let t = Instant::now();
    let err = other
        .sync_all()
        .expect_err("fsync succeeded over posted writes that were lost");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(t.elapsed() < Duration::from_secs(9), "{:?}", t.elapsed());
    // And through the descriptor that wrote them, and a read-only one, until the file is
    // closed everywhere here.
    let err = f
        .sync_all()
        .expect_err("a second fsync succeeded over lost posted writes");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let err = reader
        .sync_all()
        .expect_err("fsync of a read-only descriptor hid the lost posted writes");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
}
