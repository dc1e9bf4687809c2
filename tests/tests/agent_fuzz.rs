//! Hostile callers of a real daemon's host agent: random well-formed requests (inode numbers,
//! handles, sizes, names, sync calls) mixed with malformed ones (garbage bodies, lengths over
//! the limit, messages cut short), from root and from the unprivileged user `nobody` at the
//! same time (`regions-attack … fuzz`, two processes). The daemon must answer or close each
//! connection within a bound, never crash, and still serve a well-formed caller afterwards.
//!
//! `REGIONS_FUZZ_CASES` sets the number of messages per process (default 2,000); the long run
//! is `REGIONS_FUZZ_CASES=100000 cargo test --release -p regions-tests --test agent_fuzz`.
//! `REGIONS_FUZZ_SEED` replays one run.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use regions::agent::AgentClient;
use regions_tests::{Cluster, attack_binary, fuzz_cases, fuzz_seed, output_within};

#[test]
fn hostile_agent_callers_never_hurt_the_daemon() {
    let seed = fuzz_seed();
    let mut cluster = Cluster::start(1, "256M").expect("cluster");
    std::fs::set_permissions(cluster.dir.path(), std::fs::Permissions::from_mode(0o711))
        .expect("let nobody reach the socket");
    let attack = attack_binary(cluster.dir.path()).expect("attack binary");
    let socket = cluster.daemon(1).expect("daemon").socket.clone();
    // A few real regions to aim at.
    let mut agent = AgentClient::connect(&socket).expect("agent");
    let mut inos = Vec::new();
    for i in 0..3 {
        let attr = agent
            .create_owned(1, &format!("target{i}"), 0o644, None, 256 << 10)
            .expect("create a target region");
        inos.push(attr.ino.to_string());
    }
    let inos = inos.join(",");
    let cases = fuzz_cases(2_000).to_string();
    let run = |uid: Option<u32>, seed: u64| {
        let mut cmd = Command::new(&attack);
        cmd.arg(&socket)
            .args(["fuzz", &seed.to_string(), &cases, &inos])
            .env("RUST_LOG", "off");
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        output_within(&mut cmd, Duration::from_secs(900))
    };
    let (root, nobody) = std::thread::scope(|s| {
        let nobody = s.spawn(|| run(Some(65534), seed ^ 0x5555));
        let root = run(None, seed);
        (
            root,
            nobody.join().expect("the unprivileged caller's thread"),
        )
    });
    for (who, out) in [("root", root), ("nobody", nobody)] {
        let out = out.unwrap_or_else(|e| panic!("the {who} caller: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("fuzz: done"),
            "the {who} caller failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let answered: usize = stdout
            .lines()
            .find_map(|l| l.strip_prefix("answered: "))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        eprintln!("{who}: {answered} of {cases} messages answered");
        assert!(
            answered * 2 >= cases.parse::<usize>().unwrap_or(0),
            "the {who} caller got few answers ({answered} of {cases}): the fuzzer is not \
             reaching the agent"
        );
    }

    let daemon = &mut cluster.daemons[0];
    assert!(daemon.is_running(), "the daemon died: {}", daemon.log());
    assert!(
        !daemon.log().contains("panicked"),
        "a daemon thread panicked: {}",
        daemon.log()
    );
    // A well-formed caller is still served.
    let mut agent = AgentClient::connect(&socket).expect("agent after the storm");
    let seg = agent
        .segment(
            inos.split(',')
                .next()
                .and_then(|i| i.parse().ok())
                .unwrap_or(0),
            false,
        )
        .expect("segment after the storm")
        .expect("the target region has a segment here");
    assert!(seg.size >= 256 << 10);
    agent.stats().expect("stats after the storm");
}
