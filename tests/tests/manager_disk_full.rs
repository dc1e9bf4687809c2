//! The manager with its data directory on a file system that fills up.
//!
//! Runs the real `regions-manager` binary on a small tmpfs (with a small
//! write-ahead log, so that it checkpoints into its store soon), fills the
//! tmpfs with a ballast file and creates entries until the manager answers
//! `ENOSPC`. While full: creates and mkdirs are refused with `ENOSPC` and a
//! message naming the data directory; lookups, getattr, readdir and host
//! heartbeats still answer, and no refused entry is visible. Then the
//! ballast is deleted and creates succeed again without a restart. Finally
//! the manager is SIGKILLed and restarted on the same directory: every
//! acknowledged entry is there and no refused one is.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use regions_proto::auth::Secret;
use regions_proto::v1;
use regions_tests::{Clients, ManagerProcess, ROOT_INO, caller, connect, errno_of, write_secret};

const UID: u32 = 1000;
const HOST: u32 = 7;
const INCARNATION: u64 = 0x5eed;
/// Size of the tmpfs holding the data directory.
const TMPFS_SIZE: &str = "8m";
/// The manager's write-ahead log (small: it checkpoints at 3/4 of it).
const WAL_SIZE: &str = "262144";
/// Creates tried before the manager must have refused one.
const MAX_CREATES: usize = 20_000;

/// A tmpfs mounted for the test, unmounted on drop.
struct Tmpfs {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fs");
        std::fs::create_dir(&path).unwrap();
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(&path)
            .status()
            .expect("cannot run mount (the test runs as root)");
        assert!(status.success(), "mount -t tmpfs failed: {status}");
        Tmpfs { path, _dir: dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

/// Fills the file system of `path` with a ballast file (as much as fits).
fn fill(path: &Path) -> u64 {
    let mut f = std::fs::File::create(path).unwrap();
    let mut written = 0u64;
    for chunk in [1 << 20, 64 << 10, 4 << 10] {
        let buf = vec![0xa5u8; chunk];
        while f.write_all(&buf).is_ok() {
            written += chunk as u64;
        }
    }
    let _ = f.sync_all();
    written
}

fn start(data_dir: &Path, secret_file: &Path) -> ManagerProcess {
    ManagerProcess::start_with_args(
        data_dir,
        secret_file,
        &["--wal-size", WAL_SIZE, "--lease-ms", "3000"],
    )
    .unwrap()
}

async fn clients(addr: SocketAddr, secret: &Secret) -> Clients {
    connect(addr, secret).await.unwrap()
}

async fn create(c: &mut Clients, dir: u64, name: &str) -> Result<u64, tonic::Status> {
    c.namespace
        .create(v1::CreateRequest {
            caller: caller(UID, HOST),
            parent: dir,
            name: name.into(),
            mode: 0o644,
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().ino)
}

/// Every name in directory `dir`, read in small pages.
async fn names(c: &mut Clients, dir: u64) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut offset = 0;
    loop {
        let reply = c
            .namespace
            .read_dir(v1::ReadDirRequest {
                caller: caller(UID, HOST),
                ino: dir,
                offset,
                limit: 500,
            })
            .await
            .unwrap_or_else(|s| panic!("readdir {dir} at {offset}: {s:?}"))
            .into_inner();
        for e in &reply.entries {
            out.insert(e.name.clone());
            offset = e.offset;
        }
        if reply.end || reply.entries.is_empty() {
            return out;
        }
    }
}

async fn lookup(c: &mut Clients, dir: u64, name: &str) -> Result<u64, tonic::Status> {
    c.namespace
        .lookup(v1::LookupRequest {
            caller: caller(UID, HOST),
            parent: dir,
            name: name.into(),
        })
        .await
        .map(|r| r.into_inner().ino)
}

async fn heartbeat(c: &mut Clients) {
    let lease = c
        .cluster
        .heartbeat(v1::HeartbeatRequest {
            host_id: HOST,
            incarnation: INCARNATION,
        })
        .await
        .unwrap_or_else(|s| panic!("heartbeat while the disk is full: {s:?}"))
        .into_inner()
        .lease_ms;
    assert_eq!(lease, 3000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_data_dir_refuses_changes_and_recovers() {
    let started = Instant::now();
    let fs = Tmpfs::mount(TMPFS_SIZE);
    let data_dir = fs.path.join("manager");
    let ballast = fs.path.join("ballast");
    let secret_dir = tempfile::tempdir().unwrap();
    let secret_file = secret_dir.path().join("secret");
    let secret = write_secret(&secret_file).unwrap();

    let mut manager = start(&data_dir, &secret_file);
    let mut c = clients(manager.addr, &secret).await;
    c.cluster
        .register_host(v1::RegisterHostRequest {
            host_id: HOST,
            transport_addr: "127.0.0.1:1".into(),
            agent_socket: "/nonexistent".into(),
            memory_offered: 1 << 30,
            incarnation: INCARNATION,
            ..Default::default()
        })
        .await
        .unwrap();
    let dir = c
        .namespace
        .mkdir(v1::MkdirRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "d".into(),
            mode: 0o777,
        })
        .await
        .unwrap()
        .into_inner()
        .ino;

    // Fill the file system, then create until the manager refuses.
    let ballast_bytes = fill(&ballast);
    assert!(ballast_bytes > 0, "the ballast file got no space at all");
    let mut acked = BTreeSet::new();
    let mut refused = BTreeSet::new();
    let mut first_refusal = None;
    for i in 0..MAX_CREATES {
        let name = format!("full-{i:05}-with-a-longer-name-to-fill-the-log");
        match create(&mut c, dir, &name).await {
            Ok(_) => {
                acked.insert(name);
            }
            Err(s) => {
                assert_eq!(errno_of(&s), libc::ENOSPC, "create {name}: {s:?}");
                refused.insert(name);
                first_refusal = Some(s);
                break;
            }
        }
    }
    let status = first_refusal.unwrap_or_else(|| {
        panic!(
            "{MAX_CREATES} creates succeeded on a full file system:\n{}",
            manager.log()
        )
    });
    assert!(
        status.message().contains(&data_dir.display().to_string())
            && status.message().contains("free space"),
        "the refusal should name the data directory and say what to do: {:?}",
        status.message()
    );

    // While full: changes are refused, reads and heartbeats answer.
    for i in 0..3 {
        let name = format!("refused-{i}");
        let s = create(&mut c, dir, &name).await.unwrap_err();
        assert_eq!(errno_of(&s), libc::ENOSPC, "create {name}: {s:?}");
        refused.insert(name);
    }
    let s = c
        .namespace
        .mkdir(v1::MkdirRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "refused-dir".into(),
            mode: 0o755,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&s), libc::ENOSPC, "mkdir: {s:?}");
    for name in acked.iter().take(5).chain(acked.iter().last()) {
        lookup(&mut c, dir, name)
            .await
            .unwrap_or_else(|s| panic!("lookup {name} while full: {s:?}"));
    }
    for name in &refused {
        let s = lookup(&mut c, dir, name).await.unwrap_err();
        assert_eq!(
            errno_of(&s),
            libc::ENOENT,
            "refused {name} is visible: {s:?}"
        );
    }
    let s = lookup(&mut c, ROOT_INO, "refused-dir").await.unwrap_err();
    assert_eq!(
        errno_of(&s),
        libc::ENOENT,
        "refused mkdir is visible: {s:?}"
    );
    c.namespace
        .get_attr(v1::GetAttrRequest {
            caller: caller(UID, HOST),
            ino: dir,
        })
        .await
        .unwrap_or_else(|s| panic!("getattr while full: {s:?}"));
    assert_eq!(names(&mut c, dir).await, acked, "readdir while full");
    // Heartbeats keep the host live past its lease.
    let full_until = Instant::now() + Duration::from_millis(4000);
    while Instant::now() < full_until {
        heartbeat(&mut c).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let hosts = c
        .cluster
        .list_hosts(v1::ListHostsRequest {})
        .await
        .unwrap()
        .into_inner()
        .hosts;
    assert!(
        hosts.iter().any(|h| h.host_id == HOST && h.live),
        "host not live after heartbeats while full: {hosts:?}"
    );
    assert!(
        manager.is_running(),
        "the manager exited:\n{}",
        manager.log()
    );

    // Space returns: creates succeed again, without a restart.
    std::fs::remove_file(&ballast).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    while acked.iter().filter(|n| n.starts_with("after-")).count() < 20 {
        let name = format!("after-{n}");
        n += 1;
        match create(&mut c, dir, &name).await {
            Ok(_) => {
                acked.insert(name);
            }
            Err(s) if errno_of(&s) == libc::ENOSPC && Instant::now() < deadline => {
                refused.insert(name);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(s) => panic!(
                "create {name} after freeing space: {s:?}\n{}",
                manager.log()
            ),
        }
    }
    assert_eq!(names(&mut c, dir).await, acked, "readdir after recovery");

    // Every acknowledged entry survives a SIGKILL; no refused one appears.
    manager.sigkill().unwrap();
    drop(c);
    let manager = start(&data_dir, &secret_file);
    let mut c = clients(manager.addr, &secret).await;
    assert_eq!(names(&mut c, dir).await, acked, "readdir after restart");
    for name in &refused {
        let s = lookup(&mut c, dir, name).await.unwrap_err();
        assert_eq!(
            errno_of(&s),
            libc::ENOENT,
            "refused {name} after restart: {s:?}"
        );
    }
    create(&mut c, dir, "after-restart").await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "took {:?}",
        started.elapsed()
    );
    drop(manager);
    drop(fs);
}
