//! What the next opener on another host sees, through two real mounts: the
//! exact size and bytes after growth, shrink, overwrite and `mmap` writes
//! (close-to-open), the manager kept off the write path (growth in steps,
//! the size made durable at fsync and close), and a writer that dies before
//! making its size durable.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

use rand::{Rng, SeedableRng, rngs::StdRng};
use regions_tests::{Cluster, MountProcess};

struct Two {
    a: MountProcess,
    b: MountProcess,
    cluster: Cluster,
}

fn two_mounts() -> Two {
    let cluster = Cluster::start(2, "512M").unwrap();
    let a = cluster.mount(1).unwrap();
    let b = cluster.mount(2).unwrap();
    Two { a, b, cluster }
}

/// Namespace and region requests the manager has answered so far.
fn file_requests(cluster: &Cluster) -> u64 {
    cluster.stats().unwrap().file_requests
}

/// Opens `path`, checks its size and every byte against `want`, closes.
fn check_exact(path: &Path, want: &[u8], what: &str) {
    let mut f = File::open(path).unwrap();
    let size = f.metadata().unwrap().len();
    assert_eq!(size, want.len() as u64, "{what}: fstat size");
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: bytes read");
    if let Some(i) = got.iter().zip(want).position(|(x, y)| x != y) {
        panic!("{what}: first wrong byte at {i}");
    }
}

/// Writes `data` at `offset` through a shared mapping of `f` (which must be
/// at least that long), then unmaps it.
fn mmap_write(f: &File, offset: usize, data: &[u8]) {
    let len = offset + data.len();
    // SAFETY: a fresh shared mapping of `len` bytes of an open file that is
    // at least that long; nothing else in this process truncates it while
    // mapped, and it is unmapped before returning.
    let mut map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(f) }.expect("mmap failed");
    map[offset..].copy_from_slice(data);
    drop(map);
}

#[test]
fn the_next_opener_on_another_host_sees_exactly_the_new_size_and_bytes() {
    let t = two_mounts();
    let (pa, pb) = (t.a.path("r"), t.b.path("r"));
    let mut rng = StdRng::seed_from_u64(7);
    let mut model: Vec<u8> = (0..1_000_000).map(|_| rng.random()).collect();
    std::fs::write(&pa, &model).unwrap();
    // Host 2 reads it: its kernel now caches the size and the pages.
    check_exact(&pb, &model, "first read on host 2");

    // Shrink and overwrite on host 2, then open on host 1.
    {
        let f = OpenOptions::new().write(true).open(&pb).unwrap();
        f.set_len(100_000).unwrap();
        f.write_all_at(b"shrunk", 50_000).unwrap();
    }
    model.truncate(100_000);
    model[50_000..50_006].copy_from_slice(b"shrunk");
    check_exact(&pa, &model, "host 1 after a shrink on host 2");
    check_exact(&pb, &model, "host 2 after its own shrink");

    // Growth on host 1 (past a hole), seen on host 2.
    {
        let f = OpenOptions::new().write(true).open(&pa).unwrap();
        f.write_all_at(&[0xab; 5000], 3_000_000).unwrap();
    }
    model.resize(3_005_000, 0);
    model[3_000_000..].fill(0xab);
    check_exact(&pb, &model, "host 2 after growth on host 1");

    // mmap writes on host 2, seen on host 1.
    {
        let f = OpenOptions::new().read(true).write(true).open(&pb).unwrap();
        mmap_write(&f, 123_457, b"mapped bytes");
    }
    model[123_457..123_469].copy_from_slice(b"mapped bytes");
    check_exact(&pa, &model, "host 1 after mmap writes on host 2");

    hand_over_random_operations(&pa, &pb, &mut model, &mut rng, 16);
}

/// Random writes, truncates, `mmap` writes and reads on one host, then a check of the exact
/// size and bytes on the other, `rounds` times, alternating hosts.
fn hand_over_random_operations(
    pa: &Path,
    pb: &Path,
    model: &mut Vec<u8>,
    rng: &mut StdRng,
    rounds: usize,
) {
    let paths = [pa, pb];
    for round in 0..rounds {
        let here = paths[round % 2];
        {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(here)
                .unwrap();
            for _ in 0..6 {
                match rng.random_range(0..4) {
                    0 => {
                        let at = rng.random_range(0..model.len() + 200_000);
                        let len = rng.random_range(1..70_000);
                        let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                        f.write_all_at(&bytes, at as u64).unwrap();
                        if model.len() < at + len {
                            model.resize(at + len, 0);
                        }
                        model[at..at + len].copy_from_slice(&bytes);
                    }
                    1 => {
                        let size = rng.random_range(0..model.len() + 300_000);
                        f.set_len(size as u64).unwrap();
                        model.resize(size, 0);
                    }
                    2 if model.len() > 16 => {
                        let at = rng.random_range(0..model.len() - 16);
                        let bytes: [u8; 16] = rng.random();
                        mmap_write(&f, at, &bytes);
                        model[at..at + 16].copy_from_slice(&bytes);
                    }
                    _ => {
                        let at = rng.random_range(0..model.len().max(1)) as u64;
                        let mut buf = vec![0u8; 4096];
                        let n = f.read_at(&mut buf, at).unwrap();
                        let end = (at as usize + 4096).min(model.len());
                        assert_eq!(&buf[..n], &model[at as usize..end], "read on the writer");
                    }
                }
            }
        }
        let there = paths[(round + 1) % 2];
        check_exact(there, model, &format!("hand-over {round}"));
    }
}

/// Daemons that apply chunk releases and tail zeroing late (a loaded host): a truncate
/// followed by a write on the same host, and another host's next open, must still see every
/// byte written after the truncate. Before the manager's replies waited for those events, the
/// late zeroing destroyed such writes (found as a rare failure of the test above under load).
#[test]
fn writes_after_a_truncate_survive_a_daemon_that_applies_it_late() {
    let cluster = Cluster::start_with_daemon_args(
        2,
        "512M",
        &[],
        &["--test-destructive-event-delay-ms", "300"],
    )
    .unwrap();
    let t = Two {
        a: cluster.mount(1).unwrap(),
        b: cluster.mount(2).unwrap(),
        cluster,
    };
    let (pa, pb) = (t.a.path("late"), t.b.path("late"));
    let mut rng = StdRng::seed_from_u64(11);
    let mut model: Vec<u8> = (0..400_000).map(|_| rng.random()).collect();
    std::fs::write(&pa, &model).unwrap();
    // Shrink into the first chunk, then write just past the new end, on one host.
    {
        let f = OpenOptions::new().write(true).open(&pa).unwrap();
        f.set_len(19_000).unwrap();
        f.write_all_at(&[0x5a; 4000], 19_377).unwrap();
    }
    model.truncate(19_000);
    model.resize(19_377, 0);
    model.extend_from_slice(&[0x5a; 4000]);
    check_exact(&pb, &model, "host 2 after a truncate and a write on host 1");
    check_exact(&pa, &model, "host 1 after its own truncate and write");
    hand_over_random_operations(&pa, &pb, &mut model, &mut rng, 6);
}

#[test]
fn writes_ask_the_manager_once_per_step_not_once_per_write() {
    let t = two_mounts();
    // 256 MiB written sequentially into a new region on host 1's mount.
    let before = file_requests(&t.cluster);
    {
        let mut f = File::create(t.a.path("seq")).unwrap();
        let block = vec![0x5au8; 1 << 20];
        for _ in 0..256 {
            f.write_all(&block).unwrap();
        }
        f.sync_all().unwrap();
    }
    let sequential = file_requests(&t.cluster) - before;
    eprintln!("manager requests for 256 MiB written sequentially: {sequential}");
    if std::env::var_os("REGIONS_TEST_SHOW_REQUESTS").is_some() {
        let log = t.cluster.manager.log();
        let mut ops = std::collections::BTreeMap::new();
        for l in log.lines().filter(|l| l.contains("file request")) {
            let op = l.rsplit('"').nth(1).unwrap_or("?").to_owned();
            *ops.entry(op).or_insert(0) += 1;
        }
        eprintln!("{ops:?}");
    }
    assert!(
        sequential <= 64,
        "{sequential} manager requests to write 256 MiB (growth should take steps)"
    );
    assert_eq!(
        std::fs::metadata(t.b.path("seq")).unwrap().len(),
        256 << 20,
        "the size is durable and visible on host 2"
    );

    // 2,000 16 KiB O_DIRECT writes into an existing region.
    let before = file_requests(&t.cluster);
    {
        let f = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(t.a.path("seq"))
            .unwrap();
        let block = AlignedBlock::new(16 << 10, 0x33);
        for i in 0..2000u64 {
            f.write_all_at(block.bytes(), i * (16 << 10)).unwrap();
        }
    }
    let direct = file_requests(&t.cluster) - before;
    eprintln!("manager requests for 2,000 O_DIRECT writes: {direct}");
    assert!(
        direct <= 10,
        "{direct} manager requests for 2,000 O_DIRECT writes into an existing region"
    );
    // Small files: create, write and close, then open, read and close.
    let dir = t.a.path("small");
    std::fs::create_dir(&dir).unwrap();
    let before = file_requests(&t.cluster);
    for i in 0..50 {
        std::fs::write(dir.join(format!("f{i}")), [i as u8; 1024]).unwrap();
    }
    let created = file_requests(&t.cluster) - before;
    let before = file_requests(&t.cluster);
    for i in 0..50 {
        assert_eq!(
            std::fs::read(dir.join(format!("f{i}"))).unwrap(),
            [i as u8; 1024]
        );
    }
    let read = file_requests(&t.cluster) - before;
    eprintln!("manager requests for 50 small files: {created} to create, {read} to read");
    assert!(
        created <= 50 * 4 + 10,
        "{created} manager requests to create 50 files (lookup, create+open, publish, close each)"
    );
    assert!(
        read <= 50 * 3 + 10,
        "{read} manager requests to read 50 files (lookup, open, close each)"
    );
    let before = file_requests(&t.cluster);
    for i in 0..50 {
        std::fs::remove_file(dir.join(format!("f{i}"))).unwrap();
    }
    let removed = file_requests(&t.cluster) - before;
    eprintln!("manager requests to unlink 50 small files: {removed}");
    // One unlink each, plus a lookup for a name whose entry timed out; the kernel's ctime
    // flush of a removed file is answered by regionfs (else it would be 2 per file at least).
    assert!(
        removed < 50 * 2,
        "{removed} manager requests to unlink 50 files"
    );
    let mut back = vec![0u8; 16 << 10];
    File::open(t.b.path("seq"))
        .unwrap()
        .read_exact_at(&mut back, 1999 * (16 << 10))
        .unwrap();
    assert!(
        back.iter().all(|b| *b == 0x33),
        "host 2 reads the direct writes"
    );
}

/// A page-aligned buffer for O_DIRECT.
struct AlignedBlock {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBlock {
    fn new(len: usize, fill: u8) -> AlignedBlock {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: a non-zero size and a valid alignment.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null());
        // SAFETY: `ptr` points at `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, fill, len) };
        AlignedBlock { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBlock {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 4096).unwrap();
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

#[test]
fn a_writer_that_dies_before_its_size_is_durable_exposes_nothing_past_it() {
    let mut t = two_mounts();
    let pb = t.b.path("crash");
    let mut rng = StdRng::seed_from_u64(11);
    let durable: Vec<u8> = (0..(1 << 20)).map(|_| rng.random()).collect();
    // Host 2's mount: 1 MiB made durable by fsync, then 3 MiB more written
    // with O_DIRECT (they reach the region, the new size does not reach
    // the manager), and the mount dies with the file still open.
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&pb)
        .unwrap();
    let mut block = AlignedBlock::new(1 << 20, 0);
    // SAFETY: the block owns 1 MiB; nothing else refers to it.
    unsafe { std::ptr::copy_nonoverlapping(durable.as_ptr(), block.ptr, 1 << 20) };
    f.write_all_at(block.bytes(), 0).unwrap();
    f.sync_all().unwrap();
    drop(block);
    block = AlignedBlock::new(1 << 20, 0xee);
    for i in 1..4u64 {
        f.write_all_at(block.bytes(), i << 20).unwrap();
    }
    t.b.sigkill().unwrap();
    drop(f);

    let pa = t.a.path("crash");
    check_exact(&pa, &durable, "host 1 after host 2's mount died");
    // Growing it now shows zeros past the durable size, never the bytes
    // the dead writer had not made part of the region.
    let f = OpenOptions::new().write(true).open(&pa).unwrap();
    f.set_len(5 << 20).unwrap();
    drop(f);
    // Daemons apply placement changes from the manager's event stream.
    std::thread::sleep(Duration::from_millis(200));
    let mut want = durable.clone();
    want.resize(5 << 20, 0);
    check_exact(&pa, &want, "host 1 after growing past the durable size");
    let mut f = File::open(&pa).unwrap();
    f.seek(SeekFrom::Start(2 << 20)).unwrap();
    let mut tail = vec![0u8; 4096];
    f.read_exact(&mut tail).unwrap();
    assert!(tail.iter().all(|b| *b == 0), "zeros past the durable size");
}
