//! Small regions stored as objects (manager `--small-regions`), through real processes: files
//! written through one mount live as objects in a daemon's object store (`.regions/pools`
//! counts them; no chunk of a pool is used), read back on another host, change size within
//! their object, move to chunks when they outgrow it or are mapped, and free their object
//! when removed. Compaction under them keeps every byte, and a restarted manager frees the
//! objects its predecessor left unnamed.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use regions::transport::tcp::{RetryPolicy, TcpTransport};
use regions::{Client, ClientConfig};
use regions_proto::frame::{ObjectRef, Op, Request};
use regions_tests::{Cluster, MountProcess};

/// Objects and the memory the object store holds on the mount's host (`.regions/pools`).
fn objects(mount: &MountProcess) -> u64 {
    let text = std::fs::read_to_string(mount.path(".regions/pools")).unwrap();
    text.lines()
        .skip_while(|l| !l.starts_with("class_slot"))
        .skip(1)
        .map(|l| l.split('\t').nth(2).unwrap().parse::<u64>().unwrap())
        .sum()
}

/// The slot sizes of the size classes holding objects on the mount's host.
fn classes(mount: &MountProcess) -> Vec<u64> {
    let text = std::fs::read_to_string(mount.path(".regions/pools")).unwrap();
    text.lines()
        .skip_while(|l| !l.starts_with("class_slot"))
        .skip(1)
        .filter(|l| l.split('\t').nth(2) != Some("0"))
        .map(|l| l.split('\t').next().unwrap().parse::<u64>().unwrap())
        .collect()
}

/// Pool bytes in use across the cluster (`.regions/pools`, the pool table).
fn pool_used(mount: &MountProcess) -> u64 {
    let text = std::fs::read_to_string(mount.path(".regions/pools")).unwrap();
    text.lines()
        .skip(1)
        .take_while(|l| !l.starts_with('#'))
        .map(|l| l.split('\t').nth(3).unwrap().parse::<u64>().unwrap())
        .sum()
}

fn content(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 7 + j * 13) as u8).collect()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_all(path: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    File::open(path).unwrap().read_to_end(&mut out).unwrap();
    out
}

#[test]
fn small_files_live_as_objects_and_move_to_chunks_when_they_grow() {
    let cluster = Cluster::start_with(2, "256M", &["--small-regions", "4K"]).unwrap();
    let one = cluster.mount(1).unwrap();
    let two = cluster.mount(2).unwrap();
    let dir = one.path("small");
    std::fs::create_dir(&dir).unwrap();

    let sizes = [1usize, 100, 1000, 4000];
    for (i, len) in sizes.iter().enumerate() {
        std::fs::write(dir.join(format!("f{i}")), content(i, *len)).unwrap();
    }
    assert_eq!(
        objects(&one),
        sizes.len() as u64,
        "every small file is an object"
    );
    assert_eq!(pool_used(&one), 0, "and no chunk of any pool holds one");
    // Each took an object of the limit at its create, fitted to its size at its close.
    let slots = classes(&one);
    assert_eq!(slots.len(), sizes.len(), "one size class each: {slots:?}");
    assert!(slots.iter().min() < Some(&100), "{slots:?}");
    // Read on the other host (its daemon holds no object: requests go to host 1's).
    for (i, len) in sizes.iter().enumerate() {
        let path = two.path(&format!("small/f{i}"));
        assert_eq!(read_all(&path), content(i, *len), "f{i} on host 2");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), *len as u64);
    }

    // Overwrite and shrink on host 2, then a regrowth reads zeros past the old end.
    let f0 = two.path("small/f2");
    {
        let f = OpenOptions::new().write(true).open(&f0).unwrap();
        f.write_all_at(b"HOST2", 10).unwrap();
        f.set_len(50).unwrap();
    }
    let mut want = content(2, 50);
    want[10..15].copy_from_slice(b"HOST2");
    assert_eq!(read_all(&dir.join("f2")), want);
    {
        let f = OpenOptions::new().write(true).open(dir.join("f2")).unwrap();
        f.set_len(300).unwrap();
    }
    want.resize(300, 0);
    assert_eq!(
        read_all(&two.path("small/f2")),
        want,
        "zeros past the old end"
    );
    assert_eq!(objects(&one), sizes.len() as u64);

    // Growing past its fitted object within the limit: appended on host 2 from 100 bytes to
    // 3,000, it takes a larger object (and is fitted again at its close), holding no chunk.
    std::fs::write(dir.join("g"), content(7, 100)).unwrap();
    let small_slot = *classes(&one).iter().min().unwrap();
    {
        let mut f = OpenOptions::new()
            .append(true)
            .open(two.path("small/g"))
            .unwrap();
        for k in 0..29 {
            f.write_all(&content(70 + k, 100)).unwrap();
        }
    }
    let mut long: Vec<u8> = content(7, 100);
    (0..29).for_each(|k| long.extend_from_slice(&content(70 + k, 100)));
    assert_eq!(read_all(&dir.join("g")), long);
    assert_eq!(objects(&one), sizes.len() as u64 + 1, "still an object");
    assert_eq!(pool_used(&one), 0, "no chunk for a small region that grew");
    assert!(
        classes(&one).iter().any(|c| *c > 3000 && *c <= 3200),
        "fitted to its 3,000 bytes at its close: {:?} (it began in {small_slot})",
        classes(&one)
    );
    std::fs::remove_file(dir.join("g")).unwrap();
    wait_for("the grown file's object to be freed", || {
        objects(&one) == sizes.len() as u64
    });

    // A file created and closed empty holds no object (nor memory); written later, it takes
    // one again.
    File::create(dir.join("empty")).unwrap();
    wait_for("the empty file's object to be freed", || {
        objects(&one) == sizes.len() as u64
    });
    assert_eq!(std::fs::metadata(two.path("small/empty")).unwrap().len(), 0);
    std::fs::write(dir.join("empty"), b"now").unwrap();
    assert_eq!(read_all(&two.path("small/empty")), b"now");
    assert_eq!(objects(&one), sizes.len() as u64 + 1);
    assert_eq!(pool_used(&one), 0);
    std::fs::remove_file(dir.join("empty")).unwrap();
    wait_for("the removed file's object to be freed", || {
        objects(&one) == sizes.len() as u64
    });

    // Outgrowing the object: appended on host 2 past 4 KiB, it moves to chunks.
    {
        let mut f = OpenOptions::new()
            .append(true)
            .open(two.path("small/f3"))
            .unwrap();
        f.write_all(&content(9, 20_000)).unwrap();
    }
    let mut grown = content(3, 4000);
    grown.extend_from_slice(&content(9, 20_000));
    assert_eq!(read_all(&dir.join("f3")), grown);
    wait_for("the grown file's object to be freed", || {
        objects(&one) == sizes.len() as u64 - 1
    });
    assert!(pool_used(&one) > 0, "the grown file holds chunks now");

    // A shared mapping through the mount (the page cache: the object stays an object) sees
    // its bytes and writes through.
    {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("f1"))
            .unwrap();
        // SAFETY: the file is this test's own and nothing else changes its length while the
        // mapping lives (dropped at the end of this block).
        let mut map = unsafe { memmap2::MmapMut::map_mut(&f) }.unwrap();
        assert_eq!(&map[..], &content(1, 100)[..]);
        map[0..4].copy_from_slice(b"MMAP");
        map.flush().unwrap();
    }
    let mut mapped = content(1, 100);
    mapped[0..4].copy_from_slice(b"MMAP");
    assert_eq!(read_all(&two.path("small/f1")), mapped);

    // Through the library: reads and writes of an object; asking for a chunk (what a
    // mapping, a segment or an atomic does) moves it to chunks first, keeping its bytes.
    let lib = Client::connect(ClientConfig::new(
        &cluster.manager_url(),
        cluster.secret.clone(),
        2,
    ))
    .unwrap();
    let region = lib.open_path("/small/f2", true).unwrap();
    assert!(region.is_object());
    region.write_at(0, b"LIB").unwrap();
    let mut head = [0u8; 3];
    assert_eq!(region.read_at(0, &mut head).unwrap(), 3);
    assert_eq!(&head, b"LIB");
    let held = objects(&one);
    region.chunk(0).unwrap();
    assert!(!region.is_object(), "asking for a chunk moved it");
    wait_for("the mapped file's object to be freed", || {
        objects(&one) == held - 1
    });
    let mut moved = want.clone();
    moved[..3].copy_from_slice(b"LIB");
    let mut back = vec![0u8; moved.len()];
    assert_eq!(region.read_at(0, &mut back).unwrap(), moved.len());
    assert_eq!(back, moved);
    region.close().unwrap();
    assert_eq!(read_all(&two.path("small/f2")), moved);

    // Bytes written lazily (their size not published yet) move with the object when a
    // later write outgrows it.
    File::create(dir.join("lazy")).unwrap();
    let lazy = lib
        .open_path("/small/lazy", true)
        .unwrap()
        .with_size_policy(regions::SizePolicy::Lazy);
    assert!(!lazy.is_object(), "created empty: no object yet");
    lazy.write_at(0, &content(5, 3000)).unwrap();
    assert!(lazy.is_object());
    lazy.write_at(3000, &content(6, 3000)).unwrap();
    assert!(!lazy.is_object(), "outgrown");
    lazy.close().unwrap();
    let mut both = content(5, 3000);
    both.extend_from_slice(&content(6, 3000));
    assert!(
        read_all(&two.path("small/lazy")) == both,
        "bytes written before the move were lost"
    );

    // Removed: its object is freed.
    let before = objects(&one);
    std::fs::remove_file(dir.join("f0")).unwrap();
    wait_for("a removed file's object to be freed", || {
        objects(&one) == before - 1
    });

    // A file written in pieces that stays small remains an object.
    {
        let mut f = File::create(dir.join("pieces")).unwrap();
        for k in 0..4 {
            f.write_all(&content(k, 256)).unwrap();
        }
        f.seek(SeekFrom::Start(0)).unwrap();
    }
    let pieces: Vec<u8> = (0..4).flat_map(|k| content(k, 256)).collect();
    assert_eq!(read_all(&two.path("small/pieces")), pieces);
}

#[test]
fn small_regions_survive_a_manager_restart_and_a_move_after_it() {
    let mut cluster = Cluster::start_with(2, "256M", &["--small-regions", "4K"]).unwrap();
    let one = cluster.mount(1).unwrap();
    let two = cluster.mount(2).unwrap();
    for i in 0..20 {
        std::fs::write(one.path(&format!("r{i}")), content(i, 100 + i * 50)).unwrap();
    }
    assert_eq!(objects(&one), 20);

    // Every acknowledged create and closed write is durable: after a SIGKILL and a restart,
    // each file reads back from its object.
    let addr = cluster.manager.addr.to_string();
    cluster.manager.sigkill().unwrap();
    // What a manager killed between allocating objects and recording them leaves: objects
    // no region names (allocated here over the daemon's transport with the cluster secret, as
    // that manager did, under an incarnation of its own).
    let node = TcpTransport::new(
        &cluster.daemon(1).unwrap().addr,
        &cluster.secret,
        RetryPolicy::default(),
        std::sync::Arc::default(),
    );
    for ino in 900_001..900_004u64 {
        let reply = node
            .request(
                &Request::ObjAlloc {
                    ino,
                    len: 300,
                    manager: 0xdead,
                },
                false,
            )
            .unwrap();
        let (at, _) = ObjectRef::decode(Op::ObjAlloc, &reply).unwrap();
        let write = Request::ObjWrite {
            ino,
            at,
            offset: 0,
            data: vec![7u8; 300].into(),
        };
        node.request(&write, false).unwrap();
    }
    let data_dir = cluster.dir.path().join("manager");
    cluster.manager = regions_tests::ManagerProcess::start_in(
        &[],
        &addr,
        &data_dir,
        &cluster.secret_file,
        &["--small-regions", "4K"],
    )
    .unwrap();
    for i in 0..20 {
        let path = two.path(&format!("r{i}"));
        let mut back = None;
        // The mount reconnects to the restarted manager.
        wait_for("a file read back after the restart", || {
            back = std::fs::read(&path).ok();
            back.is_some()
        });
        assert!(
            back.unwrap() == content(i, 100 + i * 50),
            "r{i} after the restart"
        );
    }
    // The restarted manager keeps the objects its files name and frees the others.
    wait_for("the orphaned objects to be freed", || objects(&one) == 20);
    for i in 0..20 {
        let back = std::fs::read(one.path(&format!("r{i}"))).unwrap();
        assert!(back == content(i, 100 + i * 50), "r{i} after settling");
    }

    // A move after the restart, and the files that stay objects.
    {
        let mut f = OpenOptions::new()
            .append(true)
            .open(two.path("r3"))
            .unwrap();
        f.write_all(&content(77, 10_000)).unwrap();
    }
    let mut grown = content(3, 250);
    grown.extend_from_slice(&content(77, 10_000));
    assert!(read_all(&one.path("r3")) == grown, "r3 after its move");
    wait_for("the moved file's object to be freed", || {
        objects(&one) == 19
    });
}

/// The size classes' objects, moved objects and indirect pointers on the mount's host
/// (`.regions/pools`).
fn moved_and_indirect(mount: &MountProcess) -> (u64, u64) {
    let text = std::fs::read_to_string(mount.path(".regions/pools")).unwrap();
    text.lines()
        .skip_while(|l| !l.starts_with("class_slot"))
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f[7].parse::<u64>().unwrap(), f[8].parse::<u64>().unwrap())
        })
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// Blocks three quarters full cannot be merged, so compaction empties some into the free
/// slots of several others, moving small files' objects to other blocks. Every file reads
/// back its bytes on another host, through the library's handles opened before the
/// compaction too; the manager records each moved object's pointer at its new block (the
/// daemon shows no indirect pointer within seconds); and once the old pointers' grace period
/// is over, new files reuse their addresses while every old file still reads right.
#[test]
fn objects_moved_by_compaction_have_their_pointers_corrected() {
    let cluster = Cluster::start_with_daemon_args(
        2,
        "256M",
        &["--small-regions", "4K"],
        &[
            "--object-auto-compaction",
            "false",
            "--object-correction-grace-ms",
            "500",
        ],
    )
    .unwrap();
    let one = cluster.mount(1).unwrap();
    let two = cluster.mount(2).unwrap();
    let dir = one.path("moved");
    std::fs::create_dir(&dir).unwrap();
    // 300 files of one size class (960-byte slots, 34 a block): 9 blocks.
    let len = |i: usize| 900 + i % 8;
    for i in 0..300 {
        std::fs::write(dir.join(format!("f{i}")), content(i, len(i))).unwrap();
    }
    // Every fourth removed: each block is left three quarters full.
    for i in (0..300).step_by(4) {
        std::fs::remove_file(dir.join(format!("f{i}"))).unwrap();
    }
    let kept: Vec<usize> = (0..300).filter(|i| i % 4 != 0).collect();
    wait_for("the removed files' objects to be freed", || {
        objects(&one) == kept.len() as u64
    });
    // Handles opened (and read) on host 2 before the compaction keep the old pointers.
    let lib = Client::connect(ClientConfig::new(
        &cluster.manager_url(),
        cluster.secret.clone(),
        2,
    ))
    .unwrap();
    let early: Vec<(usize, regions::Region)> = kept
        .iter()
        .take(60)
        .map(|&i| {
            let r = lib.open_path(&format!("/moved/f{i}"), false).unwrap();
            assert!(r.is_object());
            let mut buf = vec![0u8; len(i)];
            assert_eq!(r.read_at(0, &mut buf).unwrap(), len(i));
            (i, r)
        })
        .collect();

    let out = Command::new(regions_tests::bin_path("regionfs").unwrap())
        .args([
            "compact",
            "--host",
            "1",
            "--manager",
            &cluster.manager_url(),
        ])
        .arg("--secret-file")
        .arg(&cluster.secret_file)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (moved, _) = moved_and_indirect(&one);
    assert!(moved > 0, "compaction moved no object: {said}");
    wait_for(
        "the manager to correct every moved object's pointer",
        || moved_and_indirect(&one).1 == 0,
    );
    // Past the grace period: the old pointers no longer reach anything.
    std::thread::sleep(Duration::from_millis(1500));
    for i in 300..400 {
        std::fs::write(dir.join(format!("f{i}")), content(i, len(i))).unwrap();
    }
    for &i in kept.iter().chain(&(300..400).collect::<Vec<_>>()) {
        assert_eq!(
            read_all(&two.path(&format!("moved/f{i}"))),
            content(i, len(i)),
            "file {i} on host 2"
        );
    }
    for (i, r) in &early {
        let mut buf = vec![0u8; len(*i)];
        assert_eq!(r.read_at(0, &mut buf).unwrap(), len(*i));
        assert_eq!(
            buf,
            content(*i, len(*i)),
            "file {i} through a handle opened before"
        );
    }
    drop(early);
    drop((one, two));
}

/// An unprivileged user's creates in a directory it may not write (regionfs mounts without
/// `default_permissions`, so each reaches the manager) are refused before an object is
/// allocated for them: spamming them costs
/// the daemon nothing (its count of object allocations does not move), while a create that
/// may succeed takes its object as before.
#[test]
fn refused_creates_allocate_no_object() {
    use regions_tests::metrics_page::{free_addr, sample, scrape};
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let addr = free_addr();
    let cluster = Cluster::start_with_daemon_args(
        1,
        "64M",
        &["--small-regions", "4K"],
        &["--metrics-listen", &addr],
    )
    .unwrap();
    let mount = cluster.mount(1).unwrap();
    let allocs = || {
        let page = scrape(&addr).unwrap();
        sample(
            &page,
            "regions_daemon_transport_requests_total",
            &[("op", "object-alloc")],
        )
    };
    let locked = mount.path("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
    let open = mount.path("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(mount.path("roots"), b"root's").unwrap();
    let before = allocs();
    assert!(before >= 1.0, "root's create took an object");
    // As nobody: 50 creates in the locked directory, then one that succeeds.
    let script = format!(
        "for i in $(seq 1 50); do echo x > {l}/f$i; done 2>/dev/null; \
         ls {l}/f1 2>/dev/null && exit 3; echo mine > {o}/nobodys",
        l = locked.display(),
        o = open.display()
    );
    let status = regions_tests::output_within(
        Command::new("sh")
            .arg("-c")
            .arg(&script)
            .uid(65534)
            .gid(65534),
        Duration::from_secs(60),
    )
    .unwrap()
    .status;
    assert!(status.success(), "{status:?}");
    assert_eq!(std::fs::read(open.join("nobodys")).unwrap(), b"mine\n");
    let after = allocs();
    assert_eq!(
        after,
        before + 1.0,
        "only the create that succeeded allocated an object"
    );
}
