//! The `regions-manager` command line: help, refusing to start without a
//! secret, and a clean exit on SIGTERM.
//!
//! Besides testing the binary, this file makes `cargo test --workspace` build
//! `regions-manager`, which the `regions-tests` integration tests run.

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_regions-manager");

/// Runs the manager to completion, killing it after `timeout`.
fn run(args: &[&str], timeout: Duration) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove("REGIONS_SECRET_FILE")
        .env_remove("REGIONS_DATA_DIR")
        .env_remove("REGIONS_MANAGER_LISTEN")
        .env_remove("REGIONS_READY_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start regions-manager");
    if wait_timeout(&mut child, timeout).is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("regions-manager {args:?} did not exit within {timeout:?}");
    }
    child.wait_with_output().expect("cannot collect the output")
}

/// Polls `child` until it exits or `timeout` passes.
fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("waitpid failed") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Kills the child on drop, so that a failing test leaks no process.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn write_secret(path: &Path) {
    regions_proto::auth::Secret::new("cli-test-secret")
        .unwrap()
        .write_file(path)
        .unwrap();
}

#[test]
fn help_describes_the_options() {
    let out = run(&["--help"], Duration::from_secs(10));
    assert!(out.status.success(), "--help failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for option in [
        "--listen",
        "--data-dir",
        "--secret-file",
        "--lease-ms",
        "--ready-file",
    ] {
        assert!(
            text.contains(option),
            "--help does not mention {option}:\n{text}"
        );
    }
    let out = run(&["--version"], Duration::from_secs(10));
    assert!(out.status.success(), "--version failed: {out:?}");
}

#[test]
fn unknown_options_are_refused() {
    let out = run(&["--no-such-option"], Duration::from_secs(10));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-option"));
}

#[test]
fn a_missing_secret_file_stops_start_up_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-secret");
    let data = dir.path().join("data");
    let out = run(
        &[
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
            "--secret-file",
            missing.to_str().unwrap(),
        ],
        Duration::from_secs(10),
    );
    assert!(!out.status.success(), "started without a secret: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(missing.to_str().unwrap()),
        "the error does not name the secret file:\n{stderr}"
    );

    // An empty secret file is refused too, by name.
    let empty = dir.path().join("empty-secret");
    std::fs::write(&empty, "\n").unwrap();
    let out = run(
        &[
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
            "--secret-file",
            empty.to_str().unwrap(),
        ],
        Duration::from_secs(10),
    );
    assert!(
        !out.status.success(),
        "started with an empty secret: {out:?}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(empty.to_str().unwrap()),
        "the error does not name the secret file:\n{stderr}"
    );
}

#[test]
fn sigterm_stops_a_running_manager_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    write_secret(&secret);
    let ready = dir.path().join("ready");
    let child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--secret-file")
        .arg(&secret)
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("cannot start regions-manager");
    let mut running = Running(child);

    // Serving: the ready file names a port that accepts connections.
    let deadline = Instant::now() + Duration::from_secs(10);
    let addr = loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            break text
                .trim()
                .parse::<std::net::SocketAddr>()
                .expect("ready file holds an address");
        }
        if let Some(status) = running.0.try_wait().unwrap() {
            panic!("regions-manager exited with {status} before serving");
        }
        assert!(Instant::now() < deadline, "no ready file within 10 s");
        std::thread::sleep(Duration::from_millis(5));
    };
    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .expect("the manager does not accept connections");

    let pid = libc::pid_t::try_from(running.0.id()).unwrap();
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = wait_timeout(&mut running.0, Duration::from_secs(5))
        .expect("no exit within 5 s of SIGTERM");
    assert!(status.success(), "exit status after SIGTERM: {status}");
}
