//! The binary's error paths without a cluster (the job itself runs in
//! `tests/tests/demos.rs` on a real cluster). Also makes `cargo test` build
//! the binary that the demo test starts.

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_regions-mapreduce"))
}

#[test]
fn a_directory_that_is_not_a_mount_is_refused_with_a_reason() {
    let dir = std::env::temp_dir();
    let out = bin()
        .args(["run", "--small", "--mounts"])
        .arg(&dir)
        .env_remove("REGIONS_DEMO_SMALL")
        .output()
        .expect("the binary runs");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a regionfs mount"), "{err}");
    assert!(err.contains(&*dir.to_string_lossy()), "{err}");
}

#[test]
fn bad_usage_exits_2() {
    let out = bin()
        .args(["worker", "--index", "x"])
        .output()
        .expect("the binary runs");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = bin()
        .arg("run")
        .env_remove("REGIONS_MAPREDUCE_MOUNTS")
        .output()
        .expect("the binary runs");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
