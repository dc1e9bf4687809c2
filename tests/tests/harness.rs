//! The harness itself: start-up failures are reported, and dropping a
//! [`ManagerProcess`] leaves no process behind.

use std::time::Duration;

use regions_tests::{ManagerProcess, write_secret};

/// Whether a process with this pid exists (and is not a zombie we own).
fn exists(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks for existence.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

#[test]
fn a_manager_that_cannot_start_is_reported_with_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-secret");
    let err = ManagerProcess::start(&dir.path().join("data"), &missing)
        .err()
        .expect("started without a secret file");
    let text = format!("{err:#}");
    assert!(text.contains("exited"), "{text}");
    assert!(
        text.contains("no-secret"),
        "the log is not included: {text}"
    );
}

#[test]
fn drop_kills_the_manager_and_signals_work() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    write_secret(&secret_file).unwrap();
    let data = dir.path().join("data");

    let manager = ManagerProcess::start(&data, &secret_file).unwrap();
    let pid = manager.pid;
    assert!(exists(pid));
    drop(manager);
    assert!(!exists(pid), "pid {pid} survived the drop");

    let mut manager = ManagerProcess::start(&data, &secret_file).unwrap();
    let status = manager.sigterm_and_wait(Duration::from_secs(5)).unwrap();
    assert!(status.success(), "{status}");
    assert!(
        manager.sigkill().is_err(),
        "a stopped manager cannot be killed again"
    );

    let mut manager = ManagerProcess::start(&data, &secret_file).unwrap();
    let pid = manager.pid;
    manager.sigkill().unwrap();
    assert!(!exists(pid));
}
