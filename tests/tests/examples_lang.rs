//! The examples in other languages, run through the real path: libregions
//! installed into a temporary prefix by `scripts/install-libregions.sh`
//! (this build's library), a cluster of real processes on loopback with two
//! hosts (two daemons, two regionfs mounts), and
//!
//! - `examples/c` built with its own Makefile (`make`, pkg-config and the
//!   installed `regions.pc`), its programs run on both hosts;
//! - `examples/python/numpy_memmap.py` on one host's mount, its array checked
//!   from the other host's mount (numpy there, and plain reads);
//! - `examples/python/regions_ctypes.py` (the ctypes binding) and
//!   `examples/python/notes.py` (its example) on both hosts.
//!
//! Every tool these need (cc, make, pkg-config, python3, numpy) must be
//! installed: a missing one fails the test, naming the Debian package.
//! `REGIONS_TEST_PYTHON` picks the Python interpreter (default: `python3`,
//! and for numpy the first of `python3`, `/usr/bin/python3` that has it).

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use regions_tests::{
    Cluster, MountProcess, PYTHON_ENV, install_libregions as install, python_with_numpy, repo_root,
};

/// How long one example program may run.
const RUN_TIMEOUT_S: &str = "120";

/// Fails the test unless `cmd args` runs and exits 0.
fn require(cmd: &str, args: &[&str], package: &str) {
    let ok = Command::new(cmd)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "`{cmd} {}` failed: this test needs {cmd}; install it (apt-get install -y {package}; \
         scripts/install-deps.sh installs everything the tests need)",
        args.join(" ")
    );
}

/// The Python interpreter: `$REGIONS_TEST_PYTHON`, else `python3`.
fn python() -> OsString {
    let py = std::env::var_os(PYTHON_ENV).unwrap_or_else(|| "python3".into());
    let ok = Command::new(&py)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "{} does not run: this test needs Python 3 (apt-get install -y python3, or set \
         {PYTHON_ENV} to an interpreter)",
        py.to_string_lossy()
    );
    py
}

/// Runs `cmd` (with a timeout) against `mount`: `REGIONS_MOUNT` names it, so
/// the C ABI finds its host agent. Returns stdout, or panics with stderr and
/// the mount's log.
fn run(what: &str, cmd: &mut Command, mount: &MountProcess) -> String {
    let mut timed = Command::new("timeout");
    timed
        .arg(RUN_TIMEOUT_S)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => timed.env(k, v),
            None => timed.env_remove(k),
        };
    }
    let out = timed
        .env("REGIONS_MOUNT", &mount.mountpoint)
        .env("REGIONS_DEBUG", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} on host {} failed with {}:\nstdout: {stdout}\nstderr: {}\nmount log:\n{}",
        mount.host_id,
        out.status,
        String::from_utf8_lossy(&out.stderr),
        mount.log()
    );
    stdout
}

struct TwoHosts {
    a: MountProcess,
    b: MountProcess,
    _cluster: Cluster,
}

fn two_hosts() -> TwoHosts {
    let cluster = Cluster::start(2, "512M").expect("a cluster of two hosts");
    let a = cluster.mount(1).expect("host 1's mount");
    let b = cluster.mount(2).expect("host 2's mount");
    TwoHosts {
        a,
        b,
        _cluster: cluster,
    }
}

fn checksum(out: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix("checksum "))
        .unwrap_or_else(|| panic!("no checksum in {out:?}"))
        .to_owned()
}

/// `examples/c` builds with its Makefile against the installed pkg-config
/// file (no LD_LIBRARY_PATH: the Makefile sets the run path), and its two
/// programs share a list across hosts. Without regions.pc, make says what to
/// do.
#[test]
fn c_examples_build_with_make_and_the_installed_pkg_config_file() {
    require("cc", &["--version"], "gcc");
    require("make", &["--version"], "make");
    require("pkg-config", &["--version"], "pkg-config");
    let prefix = install();
    // A copy of examples/c, so that the build leaves the work tree alone.
    let build = tempfile::Builder::new()
        .prefix("examples-c")
        .tempdir()
        .expect("a build directory");
    let src = repo_root().join("examples/c");
    for entry in std::fs::read_dir(&src).expect("examples/c") {
        let entry = entry.expect("an entry of examples/c");
        let name = entry.file_name();
        let keep = name == "Makefile"
            || Path::new(&name)
                .extension()
                .is_some_and(|e| e == "c" || e == "h");
        if keep {
            std::fs::copy(entry.path(), build.path().join(&name)).expect("copy an example");
        }
    }

    // Without the pkg-config file: a clear error, not a compiler's.
    let empty = tempfile::tempdir().expect("an empty directory");
    let out = Command::new("make")
        .arg("-C")
        .arg(build.path())
        .env("PKG_CONFIG_PATH", empty.path())
        .env("PKG_CONFIG_LIBDIR", empty.path())
        .output()
        .expect("make runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "make without regions.pc succeeded");
    assert!(
        err.contains("install-libregions.sh") && err.contains("PKG_CONFIG_PATH"),
        "{err}"
    );

    let out = Command::new("make")
        .arg("-C")
        .arg(build.path())
        .arg("CFLAGS=-O2 -g -Wall -Wextra -Werror")
        .env("PKG_CONFIG_PATH", prefix.path().join("lib/pkgconfig"))
        .output()
        .expect("make runs");
    assert!(
        out.status.success(),
        "make -C examples/c failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let (build_prog, traverse_prog) = (
        build.path().join("list_build"),
        build.path().join("list_traverse"),
    );
    assert!(build_prog.is_file() && traverse_prog.is_file());

    let h = two_hosts();
    let built = run(
        "list_build",
        Command::new(&build_prog)
            .arg(h.a.path("list"))
            .arg("20000")
            .env_remove("LD_LIBRARY_PATH"),
        &h.a,
    );
    let traversed = run(
        "list_traverse",
        Command::new(&traverse_prog)
            .arg(h.b.path("list"))
            .env_remove("LD_LIBRARY_PATH"),
        &h.b,
    );
    assert_eq!(
        checksum(&built),
        checksum(&traversed),
        "{built}\n{traversed}"
    );
    assert!(
        traversed.contains("traversed 20000 nodes, found 20000 of 20000 keys"),
        "{traversed}"
    );
}

/// examples/python/numpy_memmap.py writes an array through numpy.memmap on
/// host 1's mount; host 2 sees every element, through numpy and through
/// plain reads of its mount.
#[test]
fn numpy_memmap_example_is_seen_from_another_host() {
    let py = python_with_numpy();
    let script = repo_root().join("examples/python/numpy_memmap.py");
    let h = two_hosts();
    let rows = 64usize;
    let out = run(
        "numpy_memmap.py",
        Command::new(&py)
            .arg(&script)
            .arg(h.a.path("array.f64"))
            .args(["--rows", &rows.to_string()]),
        &h.a,
    );
    assert!(out.contains("wrote 64x1024 float64"), "{out}");
    assert!(out.contains("all equal"), "{out}");
    let out = run(
        "numpy_memmap.py --check",
        Command::new(&py)
            .arg(&script)
            .arg(h.b.path("array.f64"))
            .args(["--rows", &rows.to_string(), "--check"]),
        &h.b,
    );
    assert!(out.contains("all equal"), "{out}");
    // The bytes, without numpy: little-endian float64 i * 1024 + j.
    let bytes = std::fs::read(h.b.path("array.f64")).expect("read the array on host 2");
    assert_eq!(bytes.len(), rows * 1024 * 8);
    for (k, word) in bytes.chunks_exact(8).enumerate() {
        let v = f64::from_le_bytes(word.try_into().expect("8 bytes"));
        assert_eq!(v, k as f64, "element {k}");
    }
}

/// examples/python/notes.py, through the ctypes binding: notes added on both
/// hosts into one FIXVADDR region (rmalloc, rsetroot, the mutex), listed by
/// pointer chasing on both, freed with rfree and the space reused.
#[test]
fn ctypes_notes_example_across_hosts() {
    let py = python();
    let prefix = install();
    let h = two_hosts();
    let script = repo_root().join("examples/python/notes.py");
    let lib = prefix.path().join("lib/libregions.so");
    let notes = |m: &MountProcess, args: &[&str]| {
        run(
            &format!("notes.py {args:?}"),
            Command::new(&py)
                .arg(&script)
                .arg(m.path("notes"))
                .args(args)
                .env("REGIONS_LIB", &lib),
            m,
        )
    };
    assert_eq!(notes(&h.a, &["add", "alpha", "beta"]), "2 notes\n");
    assert_eq!(notes(&h.b, &["add", "gamma"]), "3 notes\n");
    for m in [&h.a, &h.b] {
        assert_eq!(notes(m, &["list"]), "alpha\nbeta\ngamma\n3 notes\n");
    }
    assert_eq!(notes(&h.b, &["clear"]), "0 notes\n");
    assert_eq!(notes(&h.a, &["list"]), "0 notes\n");
    assert_eq!(notes(&h.a, &["add", "delta"]), "1 notes\n");
    assert_eq!(notes(&h.b, &["list"]), "delta\n1 notes\n");
}

/// The ctypes binding itself: errno as OSError, Region's buffer and msync
/// (seen through the other host's mount), and the sync calls.
#[test]
fn ctypes_binding_errors_region_buffer_and_sync() {
    let py = python();
    let prefix = install();
    let h = two_hosts();
    let program = r#"
import errno, os, sys
sys.path.insert(0, sys.argv[1])
import regions_ctypes as rc

lib = rc.load()
def fails(e, fn, *args):
    try:
        fn(*args)
    except OSError as err:
        assert err.errno == e, (fn, err)
    else:
        raise AssertionError(f"{fn} did not fail")

fails(errno.EBADF, lib.rmalloc, -1, 8)
fails(errno.EBADF, lib.rmap, -1)
fails(errno.EINVAL, lib.rmsync, 4096, 4096)
fails(errno.EINVAL, lib.runmap, 4096)

pattern = bytes(i % 251 for i in range(8192))
with rc.Region(lib, sys.argv[2], size=1 << 20) as r:
    assert r.size == 1 << 20 and len(r.buffer) == r.size
    r.buffer[:8192] = pattern
    r.msync(0, 8192)
    assert lib.rgetroot(r.fd) is None
with rc.Region(lib, sys.argv[2], write=False) as r:
    assert r.buffer.readonly and bytes(r.buffer[:8192]) == pattern

lib.bell_init("py-bell")
lib.bell_ring("py-bell")
assert lib.bell_wait("py-bell") == 1
lib.barrier_init("py-barrier", 1)
lib.barrier_wait("py-barrier")
with lib.mutex("py-mutex"):
    fails(errno.EDEADLK, lib.mutex_lock, "py-mutex")
fails(errno.EPERM, lib.mutex_unlock, "py-mutex")
for name in ("py-bell", "py-barrier", "py-mutex"):
    lib.delete(name)
fails(errno.ENOENT, lib.bell_ring, "py-bell")
print("ok")
"#;
    let out = run(
        "the ctypes binding check",
        Command::new(&py)
            .arg("-c")
            .arg(program)
            .arg(repo_root().join("examples/python"))
            .arg(h.a.path("buffer"))
            .env("REGIONS_LIB", prefix.path().join("lib/libregions.so")),
        &h.a,
    );
    assert_eq!(out, "ok\n");
    let back = std::fs::read(h.b.path("buffer")).expect("read the region on host 2");
    assert_eq!(back.len(), 1 << 20);
    let want: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(&back[..8192], &want[..]);
    assert!(back[8192..].iter().all(|b| *b == 0));
}
