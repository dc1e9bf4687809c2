//! The cluster secret and TLS against real processes: components refuse a secret file others
//! may read (naming the `chmod` to run), and a manager serving TLS is reached by clients that
//! trust its CA and refused by those that do not.

use std::ffi::OsString;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use regions::manager_client::ManagerClient;
use regions_tests::{ManagerProcess, NodeProcess, ROOT_INO, bin_path, caller, write_secret};

/// Runs `cmd` to completion (killed after 30 s) and returns its output.
fn run_bounded(cmd: &mut Command) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("{cmd:?} did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn write_file(path: &Path, text: &str, mode: u32) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .expect("create");
    std::io::Write::write_all(&mut f, text.as_bytes()).expect("write");
}

#[test]
fn components_refuse_a_secret_others_may_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let secret = dir.path().join("secret");
    write_secret(&secret).expect("secret");
    let mode = std::fs::metadata(&secret)
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the harness writes secrets private");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    let hint = format!("chmod 600 {}", secret.display());

    let manager = run_bounded(
        Command::new(bin_path("regions-manager").expect("manager binary"))
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .arg("--secret-file")
            .arg(&secret)
            .env_remove("REGIONS_TLS_CERT")
            .env_remove("REGIONS_TLS_KEY"),
    );
    let daemon = run_bounded(
        Command::new(bin_path("regions-daemon").expect("daemon binary"))
            .args(["--manager", "http://127.0.0.1:1", "--host-id", "1"])
            .args(["--memory", "2M", "--listen", "127.0.0.1:0", "--socket"])
            .arg(dir.path().join("d.sock"))
            .arg("--secret-file")
            .arg(&secret),
    );
    let status = run_bounded(
        Command::new(bin_path("regionfs").expect("regionfs binary"))
            .args(["status", "--manager", "http://127.0.0.1:1", "--secret-file"])
            .arg(&secret),
    );
    for (name, out) in [
        ("regions-manager", manager),
        ("regions-daemon", daemon),
        ("regionfs status", status),
    ] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} started: {stderr}");
        assert!(stderr.contains(&hint), "{name} names the fix: {stderr}");
        assert!(stderr.contains("0644"), "{name} names the mode: {stderr}");
    }

    // Once fixed, the manager starts.
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let _manager = ManagerProcess::start(&data, &secret).expect("manager with a private secret");
}

/// A CA, and a certificate for 127.0.0.1 that it signed: (CA PEM, certificate PEM, key PEM).
fn certificates() -> (String, String, String) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "regions test CA");
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .expect("params");
    let leaf_key = rcgen::KeyPair::generate().expect("key");
    let leaf = leaf_params
        .signed_by(&leaf_key, &issuer)
        .expect("certificate");
    (ca.pem(), leaf.pem(), leaf_key.serialize_pem())
}

#[test]
fn a_manager_serving_tls_is_reached_only_by_clients_trusting_its_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let secret_file = d.join("secret");
    let secret = write_secret(&secret_file).expect("secret");
    let (ca, cert, key) = certificates();
    let (ca_file, cert_file, key_file) = (d.join("ca.pem"), d.join("cert.pem"), d.join("key.pem"));
    write_file(&ca_file, &ca, 0o644);
    write_file(&cert_file, &cert, 0o644);
    write_file(&key_file, &key, 0o600);
    let (_, other_ca, _) = certificates();
    let other_ca_file = d.join("other-ca.pem");
    write_file(&other_ca_file, &other_ca, 0o644);
    let data = d.join("data");
    std::fs::create_dir_all(&data).expect("data dir");

    let manager = ManagerProcess::start_with_args(
        &data,
        &secret_file,
        &[
            "--tls-cert",
            cert_file.to_str().expect("utf-8"),
            "--tls-key",
            key_file.to_str().expect("utf-8"),
        ],
    )
    .expect("manager with TLS");
    let port = manager.addr.port();
    let url = format!("https://127.0.0.1:{port}");
    let timeout = Duration::from_secs(5);

    // Trusting the CA: calls are served.
    let client = ManagerClient::connect(&url, &secret, Some(&ca_file), timeout)
        .expect("connect over TLS with the CA");
    let root = client
        .getattr(&caller(0, 1).expect("caller"), ROOT_INO)
        .expect("getattr over TLS");
    assert_eq!(root.ino, ROOT_INO);

    // Not trusting it (system roots, another CA) or speaking plain gRPC: refused.
    for (what, url, ca) in [
        ("system roots", url.as_str(), None),
        ("another CA", url.as_str(), Some(other_ca_file.as_path())),
    ] {
        let err = ManagerClient::connect(url, &secret, ca, timeout)
            .err()
            .unwrap_or_else(|| panic!("{what}: connected to a manager it should not trust"));
        assert!(err.to_string().contains(url), "{what}: {err}");
    }
    let plain = format!("http://127.0.0.1:{port}");
    let served = ManagerClient::connect(&plain, &secret, None, timeout)
        .and_then(|c| c.getattr(&caller(0, 1).expect("caller"), ROOT_INO));
    assert!(served.is_err(), "plain gRPC to a TLS manager was served");
    // A CA with a plain URL is a configuration error, not silently ignored.
    let err = ManagerClient::connect(&plain, &secret, Some(&ca_file), timeout)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("https://"), "{err}");

    // A daemon given the CA registers over TLS (its ready file appears once registered).
    let args: Vec<OsString> = vec![
        "--manager".into(),
        url.clone().into(),
        "--tls-ca".into(),
        ca_file.clone().into(),
        "--host-id".into(),
        "1".into(),
        "--memory".into(),
        "2M".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--socket".into(),
        d.join("agent.sock").into(),
        "--secret-file".into(),
        secret_file.clone().into(),
    ];
    let _daemon = NodeProcess::start("regions-daemon", &args).expect("daemon over TLS");

    // regionfs status with and without the CA.
    let status = |ca: Option<&Path>| {
        let mut cmd = Command::new(bin_path("regionfs").expect("regionfs binary"));
        cmd.args(["status", "--manager", &url, "--secret-file"])
            .arg(&secret_file)
            .env_remove("REGIONS_TLS_CA");
        if let Some(ca) = ca {
            cmd.arg("--tls-ca").arg(ca);
        }
        run_bounded(&mut cmd)
    };
    let ok = status(Some(&ca_file));
    assert!(
        ok.status.success(),
        "regionfs status over TLS: {}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(!status(None).status.success(), "status without the CA");
}
