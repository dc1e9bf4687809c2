//! The C library end to end: libregions installed into a temporary prefix by
//! `scripts/install-libregions.sh`, C programs compiled with
//! `cc ... $(pkg-config --cflags --libs regions)` against it, and run on two
//! hosts (two daemons, two regionfs mounts with different host ids).
//!
//! Needs a C compiler and pkg-config. The library comes from this build's
//! `target/<profile>/deps` (cargo builds libregions' cdylib and staticlib
//! whenever it builds this package), so it is never stale.

use std::path::{Path, PathBuf};
use std::process::Command;

use regions_tests::{Cluster, MountProcess, install_libregions as install, repo_root};

/// How long one C program may run.
const RUN_TIMEOUT_S: &str = "120";

/// Compiles `sources` into `out` with the flags pkg-config gives for the
/// installed library.
fn compile(prefix: &Path, sources: &[PathBuf], out: &Path, extra: &str) {
    let srcs: Vec<String> = sources.iter().map(|s| s.display().to_string()).collect();
    let script = format!(
        "cc -O1 -g -Wall -Werror -I{inc} {srcs} -o {out} $(pkg-config --cflags --libs regions) {extra}",
        inc = repo_root().join("examples/c").display(),
        srcs = srcs.join(" "),
        out = out.display(),
    );
    let o = Command::new("sh")
        .arg("-c")
        .arg(&script)
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{script} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Runs a compiled program against `mount`; returns stdout, or panics with
/// its stderr and the mount's log.
fn run(prefix: &Path, mount: &MountProcess, prog: &Path, args: &[&Path], words: &[&str]) -> String {
    let out = Command::new("timeout")
        .arg(RUN_TIMEOUT_S)
        .arg(prog)
        .args(args)
        .args(words)
        .env("LD_LIBRARY_PATH", prefix.join("lib"))
        .env("REGIONS_MOUNT", &mount.mountpoint)
        .env("REGIONS_DEBUG", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} {args:?} {words:?} on host {} failed with {}:\nstdout: {stdout}\nstderr: {}\nmount log:\n{}",
        prog.display(),
        mount.host_id,
        out.status,
        String::from_utf8_lossy(&out.stderr),
        mount.log()
    );
    stdout
}

fn checksum(out: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix("checksum "))
        .unwrap_or_else(|| panic!("no checksum in {out:?}"))
        .to_owned()
}

struct Setup {
    prefix: tempfile::TempDir,
    bin: tempfile::TempDir,
    a: MountProcess,
    b: MountProcess,
    _cluster: Cluster,
}

fn setup(programs: &[(&str, &[&str])]) -> Setup {
    let prefix = install();
    let bin = tempfile::Builder::new()
        .prefix("c-abi-bin")
        .tempdir()
        .unwrap();
    for (name, sources) in programs {
        let srcs: Vec<PathBuf> = sources.iter().map(|s| repo_root().join(s)).collect();
        compile(prefix.path(), &srcs, &bin.path().join(name), "-lpthread");
    }
    let cluster = Cluster::start(2, "512M").unwrap();
    let a = cluster.mount(1).unwrap();
    let b = cluster.mount(2).unwrap();
    Setup {
        prefix,
        bin,
        a,
        b,
        _cluster: cluster,
    }
}

#[test]
fn static_library_links_too() {
    let prefix = install();
    let bin = tempfile::Builder::new()
        .prefix("c-abi-bin")
        .tempdir()
        .unwrap();
    let src = bin.path().join("t.c");
    std::fs::write(
        &src,
        "#include <regions.h>\n#include <errno.h>\n#include <stdio.h>\n\
         int main(void) { errno = 0; void *p = rmalloc(-1, 8);\n\
         printf(\"%p %d\\n\", p, errno); return p == NULL && errno == EBADF ? 0 : 1; }\n",
    )
    .unwrap();
    let out = bin.path().join("t");
    let script = format!(
        "cc {} -o {} $(pkg-config --static --cflags regions) {}/lib/libregions.a $(pkg-config --static --libs-only-l regions | sed 's/-lregions//')",
        src.display(),
        out.display(),
        prefix.path().display()
    );
    let o = Command::new("sh")
        .arg("-c")
        .arg(&script)
        .env("PKG_CONFIG_PATH", prefix.path().join("lib/pkgconfig"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r = Command::new(&out).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stdout));
}

/// Paper Fig. 14: a linked list and a hash table built with rmalloc in a
/// FIXVADDR region on host 1, traversed by pointer chasing on host 2.
#[test]
fn linked_list_built_on_one_host_traversed_on_another() {
    let s = setup(&[
        ("list_build", &["examples/c/list_build.c"]),
        ("list_traverse", &["examples/c/list_traverse.c"]),
    ]);
    let region = s.a.path("list");
    let built = run(
        s.prefix.path(),
        &s.a,
        &s.bin.path().join("list_build"),
        &[&region],
        &["100000"],
    );
    let traversed = run(
        s.prefix.path(),
        &s.b,
        &s.bin.path().join("list_traverse"),
        &[&s.b.path("list")],
        &[],
    );
    assert_eq!(
        checksum(&built),
        checksum(&traversed),
        "{built}\n{traversed}"
    );
    assert!(traversed.contains("traversed 100000 nodes, found 100000 of 100000 keys"));
    // And on the building host too (local mapping of the segment memfd).
    let again = run(
        s.prefix.path(),
        &s.a,
        &s.bin.path().join("list_traverse"),
        &[&region],
        &[],
    );
    assert_eq!(checksum(&built), checksum(&again));
}

/// rfree'd blocks are reused, in the process and by another process on
/// another host that continues the heap; the first host sees its result.
#[test]
fn rfree_rmalloc_reuse_across_processes_and_hosts() {
    let s = setup(&[("reuse", &["tests/c/reuse.c"])]);
    let prog = s.bin.path().join("reuse");
    let out = run(
        s.prefix.path(),
        &s.a,
        &prog,
        &[&s.a.path("heap")],
        &["first"],
    );
    assert_eq!(out.trim(), "ok first");
    let out = run(
        s.prefix.path(),
        &s.b,
        &prog,
        &[&s.b.path("heap")],
        &["second"],
    );
    assert_eq!(out.trim(), "ok second");
    let out = run(
        s.prefix.path(),
        &s.a,
        &prog,
        &[&s.a.path("heap")],
        &["check"],
    );
    assert_eq!(out.trim(), "ok check");
}

/// rsetdefaultattr applies to the calling thread's creations only.
#[test]
fn default_attributes_are_per_thread() {
    let s = setup(&[("thread_attr", &["tests/c/thread_attr.c"])]);
    let dir = s.a.path("attrs");
    std::fs::create_dir(&dir).unwrap();
    let out = run(
        s.prefix.path(),
        &s.a,
        &s.bin.path().join("thread_attr"),
        &[&dir],
        &[],
    );
    assert_eq!(out.trim(), "a=0 b=1 c=1");
    // b and c (persistent) outlive the program.
    assert!(dir.join("b").exists() && dir.join("c").exists());
}

/// examples/python/cache_control.py: ctypes calls rmap, rprefetch,
/// rclearcache and rmsync on a region held by another host.
#[test]
fn python_ctypes_cache_control() {
    let s = setup(&[]);
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(s.a.path("py"), &data).unwrap();
    let out = Command::new("timeout")
        .arg(RUN_TIMEOUT_S)
        .arg("python3")
        .arg(repo_root().join("examples/python/cache_control.py"))
        .arg(s.b.path("py"))
        .arg("--write")
        .env("REGIONS_LIB", s.prefix.path().join("lib/libregions.so"))
        .env("REGIONS_MOUNT", &s.b.mountpoint)
        .env("REGIONS_DEBUG", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cache_control.py failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("mapped 1048576 bytes"), "{stdout}");
    assert!(
        stdout.contains("first bytes: b'written by cache_control"),
        "{stdout}"
    );
    // The write went back to the region (read through host 2's mount, which
    // has cached nothing of it).
    let back = std::fs::read(s.b.path("py")).unwrap();
    assert!(back.starts_with(b"written by cache_control"));
    assert_eq!(back[4096..], data[4096..]);
}
