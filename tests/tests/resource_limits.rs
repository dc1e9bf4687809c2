//! A host run out of open files on purpose (one descriptor per region segment), as an attack
//! by an unprivileged user (`nobody` creating files through the mount): new regions there fail
//! with `ENOSPC` and a message naming the limit, while the daemon and its host agent keep
//! serving everyone else, and deleting regions makes room again. Its own test binary: it
//! lowers this process's open-file limit, which the daemon inherits.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use regions::agent::AgentClient;
use regions_tests::Cluster;
use regions_tests::many_regions::{self, open_file_limit, set_open_file_limit};

fn limits(pid: u32) -> (u64, u64) {
    open_file_limit(pid).expect("the open-file limit")
}

fn open_fds(pid: u32) -> u64 {
    many_regions::open_fds(pid).expect("the open descriptors")
}

fn set_limit(pid: u32, soft: u64, hard: u64) {
    set_open_file_limit(pid, soft, hard).expect("prlimit");
}

/// Creates `path` with `data`: the error of the first call that fails.
fn create(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(data)?;
    f.sync_all()?;
    Ok(())
}

/// Writes `data` at the start of the existing `path` (no truncation: the region keeps the
/// memory it was given, or refused).
fn overwrite(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.write_all(data)?;
    f.sync_all()?;
    Ok(())
}

type WriteFn = fn(&Path, &[u8]) -> std::io::Result<()>;

/// The unprivileged user the attack runs as.
const NOBODY: u32 = 65534;

/// Creates `dir/f0`, `dir/f1`, … with [`content`] as `nobody` (each written and fsynced) until
/// one fails or `most` exist; returns how many were made and the errno of the failure (0: none).
fn create_as_nobody(dir: &Path, most: usize) -> (usize, i32) {
    let script = r#"
import os, sys
d, most = sys.argv[1], int(sys.argv[2])
made, err = 0, 0
while made < most:
    try:
        fd = os.open(os.path.join(d, "f%d" % made), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, (("region %d " % made) * 20).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        err = e.errno
        break
    made += 1
print(made, err)
"#;
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(script)
        .arg(dir)
        .arg(most.to_string())
        .uid(NOBODY)
        .gid(NOBODY);
    let out = regions_tests::output_within(&mut cmd, Duration::from_secs(120))
        .expect("run python3 as nobody (CI installs python3)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the attack as nobody failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut words = stdout.split_whitespace().map(|w| w.parse::<i64>());
    match (words.next(), words.next()) {
        (Some(Ok(made)), Some(Ok(err))) => (made as usize, err as i32),
        _ => panic!("the attack printed {stdout:?}"),
    }
}

/// Size of the region made with `set_len` (two chunks).
const SIZED: u64 = 256 << 10;

fn content(i: usize) -> Vec<u8> {
    format!("region {i} ").repeat(20).into_bytes()
}

#[test]
fn a_host_out_of_open_files_refuses_new_regions_and_keeps_serving() {
    // The daemon starts below its hard limit and raises itself to it.
    let (_, hard) = limits(std::process::id());
    let low = 1024.min(hard);
    set_limit(std::process::id(), low, hard);
    // SAFETY: the only test of this binary, before it starts any thread or process: nothing
    // reads the environment concurrently. (Its processes log at info, to show the raise.)
    unsafe { std::env::set_var("RUST_LOG", "info") };
    // Small regions stored as objects take no descriptor: this attack is on regions that
    // are segments (one memfd each).
    let cluster = Cluster::start_with(1, "1G", &["--small-regions", "0"]).expect("cluster");
    // nobody reaches the mount below the cluster directory (without listing it).
    std::fs::set_permissions(cluster.dir.path(), std::fs::Permissions::from_mode(0o711))
        .expect("chmod the cluster directory");
    let pid = cluster.daemon(1).expect("daemon").pid;
    assert_eq!(
        limits(pid),
        (hard, hard),
        "the daemon raised its soft open-file limit to the hard one"
    );
    if hard > low {
        assert!(
            cluster
                .daemon(1)
                .unwrap()
                .log()
                .contains("raised the open-file limit"),
            "the daemon says it raised the limit"
        );
    }
    let mount = cluster.mount(1).expect("mount");
    for i in 0..5 {
        create(&mount.path(&format!("before{i}")), &content(i)).expect("a region before");
    }

    // Now room for a few dozen more segments: the limit less the reserve (64 here).
    let limit = open_fds(pid) + 64 + 30;
    set_limit(pid, limit, limit);
    // The attack: nobody creates regions in a directory anyone may write to until the host
    // refuses one.
    let shared = mount.path("tmp");
    std::fs::create_dir(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let (made, refusal) = create_as_nobody(&shared, 400);
    assert!(
        made < 400,
        "{made} regions made under a limit of {limit} descriptors"
    );
    let _ = std::fs::remove_file(shared.join(format!("f{made}")));
    // A region given its size at once keeps the chunks the manager assigned it, refused here:
    // its writes fail until the host has room again.
    let sized = mount.path("sized");
    File::create(&sized)
        .and_then(|f| f.set_len(SIZED))
        .expect("a region sized at once (the refusal comes with its first access)");
    let early = overwrite(&sized, &content(made)).expect_err("no room for the sized region");
    assert_eq!(early.raw_os_error(), Some(libc::ENOSPC), "{early}");
    assert!(
        made >= 10,
        "only {made} regions before the refusal (errno {refusal})"
    );
    assert_eq!(
        refusal,
        libc::ENOSPC,
        "a region over the limit fails with ENOSPC, not errno {refusal}"
    );
    let log = cluster.daemon(1).unwrap().log();
    assert!(
        log.contains("open-file limit (RLIMIT_NOFILE) is") && log.contains("delete regions"),
        "the daemon's log names the limit and what to do:\n{}",
        &log[log.len().saturating_sub(3000)..]
    );

    // Everything else still works for everyone: new host-agent connections, the regions
    // already there (root's and the attacker's).
    for _ in 0..20 {
        let stats = AgentClient::connect(&cluster.daemon(1).unwrap().socket)
            .and_then(|mut a| a.stats())
            .expect("a new host-agent connection is served");
        assert!(stats.segments >= made as u64);
    }
    for i in 0..5 {
        let mut got = Vec::new();
        File::open(mount.path(&format!("before{i}")))
            .and_then(|mut f| f.read_to_end(&mut got))
            .expect("a region from before reads");
        assert_eq!(got, content(i), "region before{i}");
    }
    for i in (0..made).step_by(7) {
        let mut got = Vec::new();
        File::open(shared.join(format!("f{i}")))
            .and_then(|mut f| f.read_to_end(&mut got))
            .expect("an existing region reads");
        assert_eq!(got, content(i), "region f{i}");
    }

    // Deleting regions makes room (a segment closes a moment after its region is deleted,
    // when the manager's release reaches the daemon): the refused region gets its memory, and
    // new regions work again.
    for i in 0..10 {
        std::fs::remove_file(shared.join(format!("f{i}"))).expect("delete");
    }
    // The sized region, whose chunks were refused, is backed by the daemon's own retry.
    let mut want_sized = content(made);
    want_sized.resize(SIZED as usize, 0);
    let cases: [(PathBuf, Vec<u8>, Vec<u8>, WriteFn); 2] = [
        (sized, content(made), want_sized, overwrite),
        (mount.path("again"), content(999), content(999), create),
    ];
    for (path, data, want, write) in cases {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match write(&path, &data) {
                Ok(()) => break,
                Err(e) => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "no room for {} 10 s after deleting regions: {e}",
                        path.display()
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        let mut got = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut got))
            .expect("read the region back");
        assert_eq!(got, want, "{}", path.display());
    }
}
