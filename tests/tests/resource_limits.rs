//! A host run out of open files on purpose (one descriptor per region segment): new regions
//! there fail with `EMFILE` and a message naming the limit, while the daemon and its host
//! agent keep serving everything else, and deleting regions makes room again. Its own test
//! binary: it lowers this process's open-file limit, which the daemon inherits.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use regions::agent::AgentClient;
use regions_tests::Cluster;

fn limits(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("an open-files line");
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (nums[0], nums[1])
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd directory")
        .count() as u64
}

fn set_limit(pid: u32, soft: u64, hard: u64) {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: prlimit reads one rlimit we own and changes the limit of process `pid` (a daemon
    // this test started); the old value is not asked for.
    let r = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &lim,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
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
    let cluster = Cluster::start(1, "1G").expect("cluster");
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
    let mut made = 0;
    let refusal = loop {
        assert!(
            made < 400,
            "{made} regions made under a limit of {limit} descriptors"
        );
        let path = mount.path(&format!("f{made}"));
        match create(&path, &content(made)) {
            Ok(()) => made += 1,
            Err(e) => break e,
        }
    };
    let _ = std::fs::remove_file(mount.path(&format!("f{made}")));
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
        "only {made} regions before the refusal ({refusal})"
    );
    assert_eq!(
        refusal.raw_os_error(),
        Some(libc::ENOSPC),
        "a region over the limit fails with ENOSPC, not {refusal}"
    );
    let log = cluster.daemon(1).unwrap().log();
    assert!(
        log.contains("open-file limit (RLIMIT_NOFILE) is") && log.contains("delete regions"),
        "the daemon's log names the limit and what to do:\n{}",
        &log[log.len().saturating_sub(3000)..]
    );

    // Everything else still works: new host-agent connections, the regions already there.
    for _ in 0..20 {
        let stats = AgentClient::connect(&cluster.daemon(1).unwrap().socket)
            .and_then(|mut a| a.stats())
            .expect("a new host-agent connection is served");
        assert!(stats.segments >= made as u64);
    }
    for i in (0..made).step_by(7) {
        let mut got = Vec::new();
        File::open(mount.path(&format!("f{i}")))
            .and_then(|mut f| f.read_to_end(&mut got))
            .expect("an existing region reads");
        assert_eq!(got, content(i), "region f{i}");
    }

    // Deleting regions makes room (a segment closes a moment after its region is deleted,
    // when the manager's release reaches the daemon): the refused region gets its memory, and
    // new regions work again.
    for i in 0..10 {
        std::fs::remove_file(mount.path(&format!("f{i}"))).expect("delete");
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
