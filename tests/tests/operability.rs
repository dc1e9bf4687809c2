//! What an operator touches: the service files and their install script, config files beneath
//! flags and environment, `regionfs status` against a live cluster, and `regionfs up` saying
//! when it is ready and where.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use regions_tests::{Cluster, NodeProcess, bin_path, repo_root, write_secret};

fn bin_dir() -> PathBuf {
    bin_path("regionfs")
        .expect("regionfs is built (cargo build --workspace)")
        .parent()
        .expect("a binary has a directory")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn install_script_puts_units_configs_and_a_private_secret_in_place_and_systemd_accepts_the_units() {
    let dir = tempfile::tempdir().expect("temp dir");
    let units = dir.path().join("units");
    let etc = dir.path().join("etc");
    let install = |extra: &[&str]| {
        let out = run(Command::new("sh")
            .arg(repo_root().join("scripts/install-services.sh"))
            .arg("--bin-dir")
            .arg(bin_dir())
            .arg("--unit-dir")
            .arg(&units)
            .arg("--config-dir")
            .arg(&etc)
            .args(extra));
        assert!(
            out.status.success(),
            "install-services.sh failed: {}",
            text(&out)
        );
    };
    install(&[]);
    for unit in [
        "regions-manager.service",
        "regions-daemon.service",
        "regionfs.service",
        "regions-up.service",
    ] {
        let body = std::fs::read_to_string(units.join(unit)).expect("unit installed");
        assert!(
            !body.contains('@'),
            "{unit} has an unexpanded placeholder:\n{body}"
        );
        assert!(body.contains("Restart=on-failure"), "{unit}");
        assert!(body.contains(&bin_dir().display().to_string()), "{unit}");
    }
    let mount_unit = std::fs::read_to_string(units.join("regionfs.service")).expect("unit");
    assert!(mount_unit.contains("Requires=regions-daemon.service"));
    assert!(mount_unit.contains("After=regions-daemon.service"));

    let secret = std::fs::metadata(etc.join("secret")).expect("secret created");
    assert_eq!(
        secret.permissions().mode() & 0o777,
        0o600,
        "the secret is private"
    );

    // An edited config survives a second install.
    std::fs::write(etc.join("daemon.toml"), "host-id = 7\n").expect("edit");
    install(&[]);
    assert_eq!(
        std::fs::read_to_string(etc.join("daemon.toml")).expect("config"),
        "host-id = 7\n"
    );

    // Every shipped config file is one its program accepts.
    for (program, args, conf) in [
        ("regions-manager", vec![], "manager.toml"),
        ("regions-daemon", vec![], "daemon.toml"),
        ("regionfs", vec!["mount"], "regionfs.toml"),
        ("regionfs", vec!["up"], "regionfs.toml"),
    ] {
        let out = run(Command::new(bin_dir().join(program))
            .args(&args)
            .arg("--config")
            .arg(repo_root().join("packaging/config").join(conf))
            .arg("--print-config")
            .env_clear());
        assert!(
            out.status.success(),
            "{program} {args:?} rejects {conf}: {}",
            text(&out)
        );
    }

    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .args(
            [
                "regions-manager.service",
                "regions-daemon.service",
                "regionfs.service",
                "regions-up.service",
            ]
            .map(|u| units.join(u)),
        )
        .output()
        .expect("systemd-analyze is installed (scripts/install-deps.sh installs systemd)");
    assert!(
        verify.status.success(),
        "systemd-analyze verify: {}",
        text(&verify)
    );
    let stderr = String::from_utf8_lossy(&verify.stderr);
    assert!(
        !stderr.contains(".service:"),
        "systemd-analyze complains about a unit: {stderr}"
    );
}

#[test]
fn flags_beat_environment_which_beats_the_config_file_which_beats_defaults() {
    let dir = tempfile::tempdir().expect("temp dir");
    let conf = dir.path().join("manager.toml");
    std::fs::write(
        &conf,
        "listen = \"127.0.0.1:7999\"\nlease-ms = 4321\ndata-dir = \"/from/file\"\n",
    )
    .expect("config");
    let out = run(Command::new(bin_dir().join("regions-manager"))
        .env_clear()
        .env("REGIONS_LEASE_MS", "1234")
        .env("REGIONS_DATA_DIR", "/from/env")
        .arg("--config")
        .arg(&conf)
        .arg("--data-dir")
        .arg("/from/flag")
        .arg("--print-config"));
    assert!(out.status.success(), "{}", text(&out));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains("data-dir = \"/from/flag\"  # flag"),
        "{printed}"
    );
    assert!(
        printed.contains("lease-ms = 1234  # environment"),
        "{printed}"
    );
    assert!(
        printed.contains("listen = \"127.0.0.1:7999\"  # config file"),
        "{printed}"
    );
    assert!(
        printed.contains("secret-file = \"/etc/regions/secret\"  # default"),
        "{printed}"
    );

    // REGIONS_CONFIG names the file too, and a typo in it stops the program with the key named.
    std::fs::write(&conf, "lease_ms = 5\nlisen = \"x\"\n").expect("config");
    let out = run(Command::new(bin_dir().join("regions-manager"))
        .env_clear()
        .env("REGIONS_CONFIG", &conf)
        .arg("--print-config"));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown key `lisen`"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_manager_configured_by_file_alone_serves() {
    let dir = tempfile::tempdir().expect("temp dir");
    let secret = dir.path().join("secret");
    write_secret(&secret).expect("secret");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    let conf = dir.path().join("manager.toml");
    std::fs::write(
        &conf,
        format!(
            "listen = \"127.0.0.1:0\"\ndata-dir = {:?}\nsecret-file = {:?}\n",
            data.display().to_string(),
            secret.display().to_string()
        ),
    )
    .expect("config");
    // NodeProcess appends --ready-file and waits for it: the manager bound and serves.
    let manager = NodeProcess::start("regions-manager", &["--config".into(), conf.into()])
        .expect("the manager starts from its config file");
    assert!(manager.ready.starts_with("127.0.0.1:"), "{}", manager.ready);
    assert!(
        std::fs::read_dir(&data).expect("data dir").next().is_some(),
        "the store is in the configured data dir"
    );
}

fn status(cluster: &Cluster, extra: &[&str]) -> Output {
    run(Command::new(bin_dir().join("regionfs"))
        .env_clear()
        .arg("status")
        .arg("--manager")
        .arg(cluster.manager_url())
        .arg("--secret-file")
        .arg(&cluster.secret_file)
        .args(extra))
}

#[test]
fn status_shows_hosts_memory_regions_and_warns_of_an_expired_lease() {
    let mut cluster = Cluster::start_with(2, "64M", &["--lease-ms", "1000"]).expect("cluster");
    let mount = cluster.mount(1).expect("mount");
    std::fs::write(mount.path("status-probe"), vec![7u8; 300_000]).expect("write a region");

    let out = status(&cluster, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("health:  HEALTH_OK"), "{shown}");
    assert!(shown.contains("hosts: 2 (2 live)"), "{shown}");
    assert!(shown.contains(&cluster.manager_url()), "{shown}");
    assert!(shown.contains("regions: 1 (293.0 KiB)"), "{shown}");

    let out = status(&cluster, &["--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&out)));
    assert_eq!(json["health"], "HEALTH_OK");
    assert_eq!(json["hosts"].as_array().map(Vec::len), Some(2));
    assert_eq!(json["hosts"][0]["host_id"], 1);
    assert_eq!(json["hosts"][0]["live"], true);
    assert_eq!(json["regions"]["regions"], 1);
    assert_eq!(json["regions"]["region_bytes"], 300_000);
    assert!(
        json["memory"]["used_bytes"].as_u64().unwrap_or(0) >= 300_000,
        "{json}"
    );

    // Host 2's daemon dies: within the lease (1 s) plus a margin, status warns.
    drop(mount);
    cluster.daemons[1].sigkill().expect("kill daemon 2");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let out = status(&cluster, &[]);
        let shown = String::from_utf8_lossy(&out.stdout).into_owned();
        if shown.contains("HEALTH_WARN") {
            assert!(
                shown.contains("host 2") && shown.contains("expired lease"),
                "{shown}"
            );
            assert!(shown.contains("hosts: 2 (1 live)"), "{shown}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no warning 15 s after host 2 died:\n{}",
            text(&out)
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A manager that does not answer is an error that says where it looked.
    let out = run(Command::new(bin_dir().join("regionfs"))
        .env_clear()
        .args([
            "status",
            "--manager",
            "127.0.0.1:1",
            "--timeout-ms",
            "2000",
            "--secret-file",
        ])
        .arg(&cluster.secret_file));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("cannot reach the manager at http://127.0.0.1:1"),
        "{}",
        text(&out)
    );
}

/// Kills the child (by pid) and reaps it when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        // SAFETY: kill(2) with the pid of our own child, not yet reaped (wait below reaps it).
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn regionfs_up_says_when_it_is_ready_and_where() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mnt = dir.path().join("mnt");
    let child = Command::new(bin_dir().join("regionfs"))
        .arg("up")
        .arg(&mnt)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args([
            "--memory",
            "256M",
            "--listen",
            "127.0.0.1:0",
            "--transport-listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start regionfs up");
    let mut child = Reaped(child);
    let stdout = child.0.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("regionfs up printed a line within 60 s");
    assert!(
        line.starts_with(&format!("ready: {} is mounted;", mnt.display())),
        "{line}"
    );
    assert!(line.contains("manager http://127.0.0.1:"), "{line}");
    assert!(line.contains("regionfs status --manager"), "{line}");
    // It is ready when it says so: the mount answers at once.
    std::fs::write(mnt.join("hello"), b"hi").expect("write through the mount it announced");
    assert_eq!(std::fs::read(mnt.join("hello")).expect("read back"), b"hi");
    drop(child);
    assert!(
        !regions_tests::is_mounted(&mnt),
        "regionfs up unmounted on SIGTERM"
    );
}
