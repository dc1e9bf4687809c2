//! The C `rmalloc(fd, len)` fast path remembers the descriptor a thread last
//! allocated with; these tests drive it through a real mount and check that
//! it follows the open file, not the descriptor number, and that `runmap`
//! and other threads are handled; and `rmalloc_at`, which names the region by an address
//! of its mapping.

use std::os::fd::{AsRawFd, IntoRawFd};

use regions::capi::alloc::{descriptor_checks, rfree, rmalloc, rmalloc_at};
use regions::capi::map::{rmap, runmap};
use regions_tests::Cluster;

fn open(path: std::path::PathBuf) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// The tests of this file one at a time: an `runmap` in one changes the process's unmap
/// epoch, and a close moves the descriptor epochs, under the others' fast paths.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn ino_of(p: *mut libc::c_void) -> u64 {
    assert!(
        !p.is_null(),
        "rmalloc failed: {}",
        std::io::Error::last_os_error()
    );
    regions::mapping::lookup(p as *const u8)
        .expect("the block lies in a mapped region")
        .ino()
}

#[test]
fn rmalloc_follows_the_open_file_not_the_descriptor_number() {
    let _alone = serial();
    let cluster = Cluster::start(1, "1G").unwrap();
    let mount = cluster.mount(1).unwrap();
    let a = open(mount.path("a"));
    let b = open(mount.path("b"));
    let fd = a.as_raw_fd();

    let pa = rmalloc(fd, 64);
    let ino_a = ino_of(pa);
    // The second call takes the fast path: same region.
    let pa2 = rmalloc(fd, 64);
    assert_eq!(ino_of(pa2), ino_a);
    assert_ne!(pa, pa2);

    // The same number now names region b (dup2 closes a's description).
    // SAFETY: both are our open descriptors.
    assert_eq!(unsafe { libc::dup2(b.as_raw_fd(), fd) }, fd);
    let pb = rmalloc(fd, 64);
    let ino_b = ino_of(pb);
    assert_ne!(ino_b, ino_a, "rmalloc trusted the descriptor number");
    let pb2 = rmalloc(fd, 64);
    assert_eq!(ino_of(pb2), ino_b);

    // Frees into both regions, from this thread and from another one.
    assert_eq!(rfree(pa), 0);
    assert_eq!(rfree(pb), 0);
    let (pa2u, pb2u, pbu) = (pa2 as usize, pb2 as usize, pb as usize);
    std::thread::spawn(move || {
        assert_eq!(rfree(pa2u as *mut libc::c_void), 0);
        assert_eq!(rfree(pb2u as *mut libc::c_void), 0);
        // Double frees are refused, also for blocks in another thread's
        // cache.
        assert_eq!(rfree(pa2u as *mut libc::c_void), -1);
        assert_eq!(rfree(pbu as *mut libc::c_void), -1);
    })
    .join()
    .unwrap();
    assert_eq!(rfree(pb2), -1);
    assert_eq!(rfree(pa), -1);

    // After runmap the next rmalloc maps the region again.
    assert_eq!(runmap(pb), 0);
    let pb3 = rmalloc(fd, 64);
    assert_eq!(ino_of(pb3), ino_b);
    assert_eq!(rfree(pb3), 0);
    drop(a);
    drop(b);
}

/// `rmalloc_at(where, len)` allocates in the mapping containing `where`, any address of it;
/// after `runmap` the address names nothing (`EINVAL`) even though the thread remembered the
/// mapping, and a new `rmap` of the region serves it again with the same heap.
#[test]
fn rmalloc_at_follows_the_mapping_of_the_address() {
    let _alone = serial();
    let cluster = Cluster::start(1, "1G").unwrap();
    let mount = cluster.mount(1).unwrap();
    let a = open(mount.path("a"));
    let b = open(mount.path("b"));
    let base_a = rmap(a.as_raw_fd());
    let base_b = rmap(b.as_raw_fd());
    assert!(!base_a.is_null() && !base_b.is_null(), "rmap failed");

    let pa = rmalloc_at(base_a, 64);
    let ino_a = ino_of(pa);
    // Any address inside the mapping names it; the fast path serves the second call.
    let pa2 = rmalloc_at(pa, 100);
    assert_eq!(ino_of(pa2), ino_a);
    assert_ne!(pa, pa2);
    let pb = rmalloc_at(base_b, 64);
    assert_ne!(
        ino_of(pb),
        ino_a,
        "the address, not the last mapping, names the region"
    );
    // The heap is the one rmalloc(fd) uses.
    let pa3 = rmalloc(a.as_raw_fd(), 64);
    assert_eq!(ino_of(pa3), ino_a);
    for p in [pa, pa2, pa3, pb] {
        assert_eq!(rfree(p), 0);
    }

    let mut x = 0u8;
    assert!(rmalloc_at((&mut x as *mut u8).cast(), 64).is_null());
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EINVAL)
    );
    let remembered = rmalloc_at(base_a, 64);
    assert_eq!(rfree(remembered), 0);
    assert_eq!(runmap(base_a), 0);
    assert!(
        rmalloc_at(base_a, 64).is_null(),
        "an unmapped address must not reach the remembered heap"
    );
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EINVAL)
    );
    let again = rmap(a.as_raw_fd());
    assert!(!again.is_null());
    let p = rmalloc_at(again, 64);
    assert_eq!(ino_of(p), ino_a);
    assert_eq!(rfree(p), 0);
    assert_eq!(runmap(again), 0);
    assert_eq!(runmap(base_b), 0);
    drop(a);
    drop(b);
}

/// `rmalloc(fd, len)` makes no system call to check its descriptor while the mount has seen
/// no open and no close of the file (its page of descriptor epochs): one check after a
/// close of another descriptor of the file, or after any open on the mount. A number that
/// another thread closes and then points at another region with `dup2` (no open: only the
/// close is counted) is noticed: the next `rmalloc` with it allocates in the new region
/// (with closes not counted, the fast path would serve the old one).
#[test]
fn rmalloc_fd_checks_its_descriptor_only_after_an_open_or_a_close() {
    let _alone = serial();
    let cluster = Cluster::start(1, "1G").unwrap();
    let mount = cluster.mount(1).unwrap();
    let a = open(mount.path("a"));
    let other = open(mount.path("other"));
    let b = open(mount.path("b"));
    let fd = a.as_raw_fd();
    let ino_a = ino_of(rmalloc(fd, 64));
    let ino_b = ino_of(rmalloc(b.as_raw_fd(), 64));
    assert_ne!(ino_a, ino_b);
    assert_eq!(ino_of(rmalloc(fd, 64)), ino_a);

    let before = descriptor_checks();
    for _ in 0..1000 {
        let p = rmalloc(fd, 64);
        assert_eq!(ino_of(p), ino_a);
        assert_eq!(rfree(p), 0);
    }
    assert_eq!(
        descriptor_checks(),
        before,
        "rmalloc(fd) checked its descriptor with a system call on the fast path"
    );

    // A close of another descriptor of the same file: one check, then none.
    drop(a.try_clone().unwrap());
    for _ in 0..3 {
        assert_eq!(ino_of(rmalloc(fd, 64)), ino_a);
    }
    assert_eq!(descriptor_checks(), before + 1, "after a close of the file");
    // A close of another file (the next inode: another word) needs none.
    drop(other);
    assert_eq!(ino_of(rmalloc(fd, 64)), ino_a);
    assert_eq!(
        descriptor_checks(),
        before + 1,
        "after a close of another file"
    );
    // Any open on the mount: one check.
    let reader = std::fs::File::open(mount.path("a")).unwrap();
    assert_eq!(ino_of(rmalloc(fd, 64)), ino_a);
    assert_eq!(
        descriptor_checks(),
        before + 2,
        "after an open on the mount"
    );
    drop(reader);
    assert_eq!(ino_of(rmalloc(fd, 64)), ino_a);

    // Another thread closes the number and makes it name region b (dup2 onto a free
    // number: neither an open nor another close).
    let number = a.into_raw_fd();
    let b_fd = b.as_raw_fd();
    std::thread::spawn(move || {
        // SAFETY: `number` is ours (taken out of `a`), closed once here, then made a
        // duplicate of `b`'s descriptor, which stays open.
        unsafe {
            assert_eq!(libc::close(number), 0);
            assert_eq!(libc::dup2(b_fd, number), number);
        }
    })
    .join()
    .unwrap();
    let pb = rmalloc(number, 64);
    assert_eq!(
        ino_of(pb),
        ino_b,
        "rmalloc served a closed descriptor's region to the region now under its number"
    );
    assert_eq!(rfree(pb), 0);
    // SAFETY: our duplicate of b, closed once.
    assert_eq!(unsafe { libc::close(number) }, 0);
    drop(b);
}
