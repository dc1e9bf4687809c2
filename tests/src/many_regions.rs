//! Many small regions on one host, then its open files run out on purpose: the scenario of
//! the test `many_regions` (thousands) and of `cargo bench -p regions-tests --bench
//! many_regions` (1,000,000 through the library, 50,000 through the mount).
//!
//! One manager (`--small-regions 4K`) and one daemon. Library clients on several threads
//! create, write and close small regions (objects in the daemon's object store, which take no
//! descriptor); a mount creates more, on several threads too. Every region is counted in
//! `.regions/pools`, a sample is read back through both, and the daemon holds no more
//! descriptors than before. Then the daemon's open-file limit is lowered to just above what
//! it holds: regions that need a segment (a memfd each) are refused with `ENOSPC` while small
//! regions are still created, read and written, and new host-agent connections served.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use regions::agent::AgentClient;
use regions::{Client, ClientConfig};
use regions_proto::v1;

use crate::{Cluster, MountProcess};

/// How many regions each way, and on how many threads.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    /// Regions created through the library.
    pub library: u64,
    /// Regions created through the mount.
    pub mount: u64,
    /// Threads creating through the library (and, half as many, through the mount).
    pub threads: u64,
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub library_per_s: f64,
    pub mount_per_s: f64,
    /// Objects `.regions/pools` counted with every region created.
    pub objects: u64,
    /// Bytes the object store holds then (its memfd's pages) and the regions' bytes.
    pub store_bytes: u64,
    pub region_bytes: u64,
    /// The daemon's open descriptors before and after the regions were created.
    pub daemon_fds: (u64, u64),
    /// Resident memory of the manager and the daemon, in bytes.
    pub manager_rss: u64,
    pub daemon_rss: u64,
    /// The descriptor limit set, and the segments made before the first refusal.
    pub fd_limit: u64,
    pub segments_made: u64,
    /// Small regions created, and ones read back, while the host was out of descriptors.
    pub small_while_out: u64,
}

/// Directories the regions are spread over (entries per directory at most).
const PER_DIRECTORY: u64 = 10_000;

/// The bytes of region `i` (64 to 1,024 of them).
pub fn content(i: u64) -> Vec<u8> {
    let len = 64 + (i.wrapping_mul(2_654_435_761) % 961) as usize;
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

fn path_of(top: &str, i: u64) -> String {
    format!("{top}/d{}/r{i}", i / PER_DIRECTORY)
}

/// `(soft, hard)` open-file limit of process `pid`.
pub fn open_file_limit(pid: u32) -> anyhow::Result<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open-files line in /proc/PID/limits")?;
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    match nums[..] {
        [soft, hard, ..] => Ok((soft, hard)),
        _ => bail!("cannot read the open-file limit from {line:?}"),
    }
}

/// Descriptors process `pid` holds open.
pub fn open_fds(pid: u32) -> anyhow::Result<u64> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64)
}

/// Sets process `pid`'s open-file limit.
pub fn set_open_file_limit(pid: u32, soft: u64, hard: u64) -> anyhow::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: prlimit reads one rlimit we own and changes the limit of process `pid` (one the
    // caller started); the old value is not asked for.
    let r = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &lim,
            std::ptr::null_mut(),
        )
    };
    ensure!(r == 0, "prlimit: {}", std::io::Error::last_os_error());
    Ok(())
}

fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib << 10)
}

/// Objects on the mount's host and the bytes its object store holds (`.regions/pools`).
pub fn object_store(mount: &MountProcess) -> anyhow::Result<(u64, u64)> {
    let text = std::fs::read_to_string(mount.path(".regions/pools"))?;
    let held = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("# small regions as objects on host ")
                .and_then(|rest| rest.split(": ").nth(1))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
        .context("no object store in .regions/pools")?;
    let objects = text
        .lines()
        .skip_while(|l| !l.starts_with("class_slot"))
        .skip(1)
        .filter_map(|l| l.split('\t').nth(2)?.parse::<u64>().ok())
        .sum();
    Ok((objects, held))
}

fn library_client(cluster: &Cluster) -> anyhow::Result<Client> {
    Ok(Client::connect(ClientConfig::new(
        &cluster.manager_url(),
        cluster.secret.clone(),
        1,
    ))?)
}

/// Creates, writes and closes regions `range` under `/lib` through one library client.
fn create_through_library(cluster: &Cluster, range: std::ops::Range<u64>) -> anyhow::Result<()> {
    let lib = library_client(cluster)?;
    let caller = lib.caller().clone();
    let mut parents = std::collections::HashMap::new();
    for i in range {
        let dir = i / PER_DIRECTORY;
        let parent = match parents.get(&dir) {
            Some(p) => *p,
            None => {
                let p = lib.lookup_path(&format!("/lib/d{dir}"))?.ino;
                parents.insert(dir, p);
                p
            }
        };
        let region = lib
            .create_open_as(
                v1::CreateRequest {
                    caller: Some(caller.clone()),
                    parent,
                    name: format!("r{i}"),
                    mode: 0o644,
                    attrs: None,
                    preallocate: 0,
                },
                true,
            )
            .with_context(|| format!("creating {}", path_of("/lib", i)))?;
        region
            .write_at(0, &content(i))
            .with_context(|| format!("writing {}", path_of("/lib", i)))?;
        ensure!(region.is_object(), "{} is no object", path_of("/lib", i));
        region.close()?;
    }
    Ok(())
}

/// Creates and writes regions `range` under `top` of the mount.
fn create_through_mount(
    mount: &MountProcess,
    top: &str,
    range: std::ops::Range<u64>,
) -> anyhow::Result<()> {
    for i in range {
        let path = mount.path(&path_of(top, i));
        std::fs::write(&path, content(i)).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Runs `work(part)` for parts `0..n` of `total`, each on its own thread: the first error.
fn in_parallel(
    total: u64,
    n: u64,
    work: impl Fn(std::ops::Range<u64>) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<()> {
    let n = n.max(1);
    let per = total.div_ceil(n);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|t| {
                let work = &work;
                s.spawn(move || work(t * per..((t + 1) * per).min(total)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a thread panicked")))
            })
            .collect::<anyhow::Result<Vec<()>>>()
            .map(drop)
    })
}

fn make_directories(root: &Path, top: &str, count: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(root.join(top))?;
    for d in 0..count.div_ceil(PER_DIRECTORY) {
        std::fs::create_dir_all(root.join(format!("{top}/d{d}")))?;
    }
    Ok(())
}

/// Runs the scenario at `scale` (see the module): `Err` says which step failed.
pub fn run(scale: Scale, progress: impl Fn(&str)) -> anyhow::Result<Report> {
    // Objects of up to 1 KiB and their headers: a quarter of a KiB on average, and room.
    let object_memory = format!(
        "{}M",
        (((scale.library + scale.mount + 10_000) * 2048) >> 20).max(64)
    );
    let cluster = Cluster::start_with_daemon_args(
        1,
        "1G",
        &["--small-regions", "4K"],
        &["--object-memory", &object_memory],
    )?;
    let mount = cluster.mount(1)?;
    let root = mount.path("");
    make_directories(&root, "lib", scale.library)?;
    make_directories(&root, "fs", scale.mount)?;
    let daemon = cluster.daemon(1)?.pid;
    let manager = cluster.manager.pid;
    let mut report = Report {
        daemon_fds: (open_fds(daemon)?, 0),
        ..Report::default()
    };

    progress(&format!(
        "creating {} regions through the library",
        scale.library
    ));
    let t = Instant::now();
    in_parallel(scale.library, scale.threads, |range| {
        create_through_library(&cluster, range)
    })?;
    report.library_per_s = scale.library as f64 / t.elapsed().as_secs_f64();
    progress(&format!(
        "creating {} regions through the mount",
        scale.mount
    ));
    let t = Instant::now();
    in_parallel(scale.mount, scale.threads.div_ceil(2), |range| {
        create_through_mount(&mount, "fs", range)
    })?;
    report.mount_per_s = scale.mount as f64 / t.elapsed().as_secs_f64();

    (report.objects, report.store_bytes) = object_store(&mount)?;
    ensure!(
        report.objects == scale.library + scale.mount,
        "{} objects for {} regions",
        report.objects,
        scale.library + scale.mount
    );
    report.region_bytes = (0..scale.library)
        .chain(0..scale.mount)
        .map(|i| content(i).len() as u64)
        .sum();
    report.daemon_fds.1 = open_fds(daemon)?;
    ensure!(
        report.daemon_fds.1 < report.daemon_fds.0 + 64,
        "the daemon holds {} descriptors with the regions, {} before",
        report.daemon_fds.1,
        report.daemon_fds.0
    );
    report.manager_rss = rss(manager);
    report.daemon_rss = rss(daemon);

    progress("reading a sample back through the library and the mount");
    let lib = library_client(&cluster)?;
    let step = |n: u64| (n / 500).max(1) as usize;
    for i in (0..scale.library).step_by(step(scale.library)) {
        let region = lib.open_path(&path_of("/lib", i), false)?;
        let want = content(i);
        let mut got = vec![0u8; want.len()];
        ensure!(
            region.read_at(0, &mut got)? == want.len(),
            "{} short",
            path_of("/lib", i)
        );
        ensure!(
            got == want,
            "{} read back wrong through the library",
            path_of("/lib", i)
        );
        let through_mount = std::fs::read(mount.path(&path_of("lib", i)))?;
        ensure!(
            through_mount == want,
            "{} read back wrong through the mount",
            path_of("lib", i)
        );
    }
    for i in (0..scale.mount).step_by(step(scale.mount)) {
        let got = std::fs::read(mount.path(&path_of("fs", i)))?;
        ensure!(got == content(i), "{} read back wrong", path_of("fs", i));
    }

    progress("running the daemon out of open files");
    run_out_of_files(&cluster, &mount, &lib, scale, &mut report)?;
    Ok(report)
}

/// Lowers the daemon's open-file limit to a little above what it holds, makes segments until
/// one is refused, and checks that small regions and the host agent keep working.
fn run_out_of_files(
    cluster: &Cluster,
    mount: &MountProcess,
    lib: &Client,
    scale: Scale,
    report: &mut Report,
) -> anyhow::Result<()> {
    let daemon = cluster.daemon(1)?;
    let before = open_file_limit(daemon.pid)?;
    // The daemon keeps 64 descriptors in reserve for connections: room for about 30 segments.
    report.fd_limit = open_fds(daemon.pid)? + 64 + 30;
    // The soft limit only: the hard one stays, so that the old limit can be given back.
    set_open_file_limit(daemon.pid, report.fd_limit, before.1)?;
    std::fs::create_dir_all(mount.path("big"))?;
    let big = vec![0x5au8; 200 << 10];
    let refusal = loop {
        let path = mount.path(&format!("big/s{}", report.segments_made));
        let made = File::create(&path)
            .map_err(|e| ("create", e))
            .and_then(|mut f| {
                f.write_all(&big).map_err(|e| ("write", e))?;
                f.sync_all().map_err(|e| ("fsync", e))
            });
        match made {
            Ok(()) => report.segments_made += 1,
            Err(e) => break e,
        }
        ensure!(
            report.segments_made < 400,
            "400 segments under a limit of {} descriptors",
            report.fd_limit
        );
    };
    ensure!(
        refusal.1.raw_os_error() == Some(libc::ENOSPC),
        "a segment over the limit failed with {} at {}, not ENOSPC",
        refusal.1,
        refusal.0
    );
    ensure!(
        report.segments_made >= 10,
        "only {} segments before the refusal",
        report.segments_made
    );
    // Small regions take no descriptor: created, written and read as before.
    let extra = 200u64;
    for k in 0..extra {
        let i = scale.mount + k;
        let path = mount.path(&format!("big/small{i}"));
        std::fs::write(&path, content(i)).with_context(|| {
            format!(
                "a small region while out of descriptors: {}",
                path.display()
            )
        })?;
        ensure!(
            std::fs::read(&path)? == content(i),
            "{} read back wrong",
            path.display()
        );
        report.small_while_out += 1;
    }
    for i in (0..scale.library).step_by((scale.library / 50).max(1) as usize) {
        let region = lib.open_path(&path_of("/lib", i), true)?;
        let want = content(i);
        region.write_at(0, &want[..8])?;
        let mut got = vec![0u8; want.len()];
        region.read_at(0, &mut got)?;
        ensure!(
            got == want,
            "{} while out of descriptors",
            path_of("/lib", i)
        );
        region.close()?;
    }
    for _ in 0..10 {
        AgentClient::connect(&daemon.socket)
            .and_then(|mut a| a.stats())
            .context("a new host-agent connection while out of descriptors")?;
    }
    // Deleting segments makes room again.
    for s in 0..report.segments_made {
        std::fs::remove_file(mount.path(&format!("big/s{s}")))?;
    }
    set_open_file_limit(daemon.pid, before.0, before.1)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let again = File::create(mount.path("big/again")).and_then(|mut f| {
            f.write_all(&big)?;
            f.sync_all()
        });
        match again {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => bail!("no segment 10 s after the limit was restored: {e}"),
        }
    }
    Ok(())
}

impl Report {
    /// The report as lines of text.
    pub fn lines(&self, scale: Scale) -> Vec<String> {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        vec![
            format!(
                "created: {} through the library at {:.0}/s ({} threads), {} through the mount at {:.0}/s",
                scale.library, self.library_per_s, scale.threads, scale.mount, self.mount_per_s
            ),
            format!(
                "object store: {} objects, {:.1} MiB held for {:.1} MiB of bytes ({:.2}x; headers and size classes)",
                self.objects,
                mib(self.store_bytes),
                mib(self.region_bytes),
                self.store_bytes as f64 / self.region_bytes.max(1) as f64
            ),
            format!(
                "daemon: {} descriptors before, {} with every region; RSS {:.0} MiB, {:.0} bytes an object beyond the store's memory; manager RSS {:.0} MiB ({:.0} bytes a region)",
                self.daemon_fds.0,
                self.daemon_fds.1,
                mib(self.daemon_rss),
                self.daemon_rss.saturating_sub(self.store_bytes) as f64
                    / self.objects.max(1) as f64,
                mib(self.manager_rss),
                self.manager_rss as f64 / (scale.library + scale.mount).max(1) as f64
            ),
            format!(
                "out of descriptors (limit {}): {} segments, then ENOSPC; {} small regions made and read meanwhile",
                self.fd_limit, self.segments_made, self.small_while_out
            ),
        ]
    }
}
