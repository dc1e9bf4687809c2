//! The `regions-daemon` binary: start-up against a real manager (build it first:
//! `cargo build -p regions-manager`), the ready file, SIGTERM, and start-up errors that say
//! what to do.

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{ManagerProcess, wait_until, write_secret};

fn daemon_command(manager: &str, secret: &Path, socket: &Path) -> Command {
    daemon_with_memory(manager, secret, socket, "2M")
}

fn daemon_with_memory(manager: &str, secret: &Path, socket: &Path, memory: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_regions-daemon"));
    cmd.arg("--manager")
        .arg(manager)
        .arg("--host-id")
        .arg("3")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--memory")
        .arg(memory)
        .arg("--socket")
        .arg(socket)
        .arg("--secret-file")
        .arg(secret)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

/// Waits (bounded) for `child` to exit.
fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs a command that must fail quickly; its output.
fn run_failing(mut cmd: Command) -> Output {
    let child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    out
}

#[test]
fn starts_registers_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let manager = ManagerProcess::start(dir.path(), "127.0.0.1:0", 5_000);
    let socket = dir.path().join("d3.sock");
    let ready = dir.path().join("d3.ready");
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let mut child = daemon_command(&manager.url(), &manager.secret_file, &socket)
        .arg("--ready-file")
        .arg(&ready)
        .arg("--heartbeat-ms")
        .arg("200")
        .stderr(log)
        .spawn()
        .unwrap();
    let started = wait_until(Duration::from_secs(20), || ready.exists());
    let log_text = || std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default();
    assert!(started, "no ready file; daemon log:\n{}", log_text());
    let addr: std::net::SocketAddr = std::fs::read_to_string(&ready).unwrap().parse().unwrap();
    assert_ne!(addr.port(), 0, "port 0 is replaced by the bound port");
    assert!(socket.exists());
    // The transport answers with the cluster secret.
    let mut c = common::Client::authenticated(addr, common::TOKEN);
    assert_eq!(
        common::status(&c.call(&regions_proto::frame::Request::Ping)),
        0
    );

    // SIGTERM: a clean stop that removes the socket.
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = wait_exit(&mut child, Duration::from_secs(10)).expect("no exit after SIGTERM");
    assert!(status.success(), "exit {status}; log:\n{}", log_text());
    assert!(!socket.exists(), "socket left behind");
    let text = log_text();
    assert!(text.contains("daemon ready"), "{text}");
    assert!(text.contains("SIGTERM"), "{text}");
}

#[test]
fn startup_errors_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    write_secret(&secret, "tok");
    // Socket directory missing.
    let out = run_failing(daemon_command(
        "http://127.0.0.1:1",
        &secret,
        &dir.path().join("missing/d.sock"),
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mkdir -p"), "{err}");
    // Manager unreachable: bounded retries with log lines, then a clear error.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = daemon_command(
        &format!("127.0.0.1:{port}"),
        &secret,
        &dir.path().join("d.sock"),
    );
    cmd.arg("--startup-timeout-ms").arg("1500");
    let out = run_failing(cmd);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("retrying"), "{err}");
    assert!(err.contains("start regions-manager"), "{err}");
    assert!(!dir.path().join("d.sock").exists());
    // Bad memory size and missing secret file.
    let cmd = daemon_with_memory(
        "http://127.0.0.1:1",
        &secret,
        &dir.path().join("e.sock"),
        "lots",
    );
    let err = String::from_utf8_lossy(&run_failing(cmd).stderr).into_owned();
    assert!(err.contains("not a size"), "{err}");
    let cmd = daemon_command(
        "http://127.0.0.1:1",
        &dir.path().join("nosecret"),
        &dir.path().join("f.sock"),
    );
    let err = String::from_utf8_lossy(&run_failing(cmd).stderr).into_owned();
    assert!(err.contains("secret"), "{err}");
}
