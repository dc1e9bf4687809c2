//! The object stores of small regions as an administrator sees them, through real processes:
//! `.regions/pools` shows each size class of this host's daemon (blocks, objects, live and
//! active bytes, fragmentation, compactions, moved objects), and `regionfs compact` compacts
//! one host or every live host and prints what each gave back. Small files written through a
//! mount are the objects, and every one left reads back its bytes through another host's
//! mount after the compaction. Without the secret, `regionfs compact` is refused.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use regions::transport::tcp::{RetryPolicy, TcpTransport};
use regions_proto::frame::Request;
use regions_tests::{Cluster, bin_path, output_within};

/// One size class row of `.regions/pools`.
#[derive(Debug)]
struct ClassRow {
    objects: u64,
    fragmentation: f64,
    compactions: u64,
}

/// The memory held and the class rows of `.regions/pools`.
fn object_section(text: &str) -> (u64, Vec<ClassRow>) {
    let held = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("# small regions as objects on host 1: ")
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| panic!("no object section in .regions/pools:\n{text}"));
    let rows = text
        .lines()
        .skip_while(|l| !l.starts_with("class_slot"))
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(f.len(), 9, "{l}");
            ClassRow {
                objects: f[2].parse().unwrap(),
                fragmentation: f[5].parse().unwrap(),
                compactions: f[6].parse().unwrap(),
            }
        })
        .collect();
    (held, rows)
}

/// `regionfs compact` for `cluster` with the secret in `secret_file`.
fn compact_command(cluster: &Cluster, secret_file: &std::path::Path) -> Command {
    let mut cmd = Command::new(bin_path("regionfs").unwrap());
    cmd.arg("compact")
        .arg("--manager")
        .arg(cluster.manager_url())
        .arg("--secret-file")
        .arg(secret_file);
    cmd
}

fn compact(cluster: &Cluster, args: &[&str]) -> std::process::Output {
    let mut cmd = compact_command(cluster, &cluster.secret_file);
    cmd.args(args);
    output_within(&mut cmd, Duration::from_secs(30)).unwrap()
}

fn content(file: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (file as usize * 31 + i) as u8).collect()
}

#[test]
fn pools_show_the_size_classes_and_compact_gives_memory_back() {
    let cluster =
        Cluster::start_with_daemon_args(2, "256M", &[], &["--object-auto-compaction", "false"])
            .unwrap();
    let mount = cluster.mount(1).unwrap();
    std::fs::create_dir(mount.path("small")).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(15);
    let mut files: Vec<(u64, usize)> = (0..1200u64)
        .map(|i| {
            let len = rng.random_range(64..=1024usize);
            std::fs::write(mount.path(&format!("small/{i}")), content(i, len)).unwrap();
            (i, len)
        })
        .collect();
    files.shuffle(&mut rng);
    let kept = files.split_off(files.len() * 3 / 4);
    for (i, _) in files {
        std::fs::remove_file(mount.path(&format!("small/{i}"))).unwrap();
    }
    // The manager frees the removed files' objects in the background.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(mount.path(".regions/pools")).unwrap();
        let live: u64 = object_section(&text).1.iter().map(|r| r.objects).sum();
        if live == kept.len() as u64 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{live} objects, {} files:\n{text}",
            kept.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let before = std::fs::read_to_string(mount.path(".regions/pools")).unwrap();
    let (held_before, rows) = object_section(&before);
    assert_eq!(
        rows.iter().map(|r| r.objects).sum::<u64>(),
        kept.len() as u64,
        "{before}"
    );
    assert!(rows.iter().any(|r| r.fragmentation > 0.5), "{before}");
    assert!(rows.iter().all(|r| r.compactions == 0), "{before}");

    let one = compact(&cluster, &["--host", "1"]);
    let said = String::from_utf8_lossy(&one.stdout);
    assert!(
        one.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&one.stderr)
    );
    let freed: u64 = said
        .strip_prefix("host 1: freed ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output: {said}"));
    assert!(freed > 0, "{said}");

    let after = std::fs::read_to_string(mount.path(".regions/pools")).unwrap();
    let (held_after, rows) = object_section(&after);
    assert_eq!(held_before - held_after, freed, "{before}{after}");
    assert!(
        rows.iter().map(|r| r.compactions).sum::<u64>() > 0,
        "{after}"
    );
    // Read back through the other host's mount (no page cache of its own): every byte comes
    // from the compacted store.
    let other = cluster.mount(2).unwrap();
    for (i, len) in &kept {
        let bytes = std::fs::read(other.path(&format!("small/{i}"))).unwrap();
        assert_eq!(bytes, content(*i, *len), "file {i}");
    }

    // Every live host: host 1 has nothing more to merge, host 2 holds no object.
    let all = compact(&cluster, &[]);
    let said = String::from_utf8_lossy(&all.stdout);
    assert!(
        all.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&all.stderr)
    );
    assert!(said.contains("host 1: freed 0 bytes"), "{said}");
    assert!(said.contains("host 2: freed 0 bytes"), "{said}");
    assert!(said.contains("freed 0 bytes on 2 hosts"), "{said}");
    let unknown = compact(&cluster, &["--host", "9"]);
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no host 9"));
    drop(other);
    drop(mount);
}

#[test]
fn compact_without_the_cluster_secret_is_refused() {
    use std::os::unix::process::CommandExt;
    let cluster = Cluster::start(1, "64M").unwrap();
    // As nobody: the secret file (0600, root's) cannot be read.
    let mut cmd = compact_command(&cluster, &cluster.secret_file);
    cmd.uid(65534).gid(65534);
    let out = output_within(&mut cmd, Duration::from_secs(30)).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot read the cluster secret"), "{err}");
    // With a secret of its own making: the manager refuses to list its hosts.
    let forged = cluster.dir.path().join("forged");
    regions_proto::auth::Secret::new("not-the-cluster-secret")
        .unwrap()
        .write_file(&forged)
        .unwrap();
    let mut cmd = compact_command(&cluster, &forged);
    cmd.arg("--timeout-ms").arg("3000");
    let out = output_within(&mut cmd, Duration::from_secs(30)).unwrap();
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("freed"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not list its hosts"), "{err}");
    // Straight to the daemon with the forged secret: the handshake fails, nothing compacts.
    let forged = regions_proto::auth::Secret::from_file(&forged).unwrap();
    let attacker = TcpTransport::new(
        &cluster.daemon(1).unwrap().addr,
        &forged,
        RetryPolicy::default(),
        Arc::default(),
    );
    let refused = attacker.request(&Request::ObjCompact, false).unwrap_err();
    assert_eq!(refused.errno(), libc::EACCES, "{refused}");
}
