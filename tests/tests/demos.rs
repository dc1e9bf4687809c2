//! The demos of `examples/` (README "Demos") at CI size, through
//! `examples/run-demo.sh NAME --small`: each starts its own cluster of real
//! processes on loopback, runs the demo, which checks its own results, and
//! stops everything it started. These tests check that each demo ran to its
//! end and reported equal results.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// How long one demo may take at CI size (they take seconds).
const DEMO_TIMEOUT: Duration = Duration::from_secs(240);

/// Runs `examples/run-demo.sh name --small` with this build's binaries;
/// returns its stdout.
fn run_demo(name: &str, bins: &[&str]) -> anyhow::Result<String> {
    let mut dir: Option<PathBuf> = None;
    for b in bins {
        let path = regions_tests::bin_path(b)?;
        dir = path.parent().map(Path::to_path_buf);
    }
    let dir = dir.context("no binaries named")?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/run-demo.sh");
    let out_dir = tempfile::tempdir()?;
    let (out_path, err_path) = (out_dir.path().join("out"), out_dir.path().join("err"));
    let mut child = Command::new("bash")
        .arg(&script)
        .args([name, "--small"])
        .env("REGIONS_BIN_DIR", &dir)
        .env_remove("REGIONS_DEMO_SMALL")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        // Its own process group, so that a timeout stops the whole demo.
        .process_group(0)
        .spawn()
        .with_context(|| format!("cannot run {}", script.display()))?;
    let pid = child.id() as libc::pid_t;
    let deadline = Instant::now() + DEMO_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            // SIGTERM to the demo's group: the mounts unmount, the script's
            // trap removes its directory; SIGKILL after a grace period.
            // SAFETY: kill(2) on the process group this test created.
            unsafe { libc::kill(-pid, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(10));
            // SAFETY: as above.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let _ = child.wait();
            bail!(
                "{name} demo did not finish within {DEMO_TIMEOUT:?}; its stderr:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::fs::read_to_string(&out_path)?;
    let err = std::fs::read_to_string(&err_path)?;
    if !status.success() {
        bail!("{name} demo failed with {status}\n--- stdout\n{out}\n--- stderr\n{err}");
    }
    Ok(out)
}

#[test]
fn shell_walkthrough_on_two_hosts() -> anyhow::Result<()> {
    let out = run_demo("shell", &["regions-manager", "regions-daemon", "regionfs"])?;
    assert!(out.contains("Hello from host 1"), "{out}");
    assert!(out.contains("walkthrough: all steps passed"), "{out}");
    assert!(!out.contains("FAILED"), "{out}");
    Ok(())
}

#[test]
fn r_with_ff_on_regions_equals_tmpfs() -> anyhow::Result<()> {
    let have_r = Command::new("Rscript")
        .args(["-e", "suppressPackageStartupMessages(library(ff))"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        have_r,
        "Rscript with the ff package is missing: this test needs it (scripts/install-deps.sh \
         installs r-cran-ff; CI runs that script)"
    );
    let out = run_demo("r", &["regions-manager", "regions-daemon", "regionfs"])?;
    assert!(out.contains("results equal to tmpfs: yes"), "{out}");
    for workload in ["R-Agg-cold", "R-LR-cold", "R-Agg-warm", "R-LR-warm"] {
        assert!(out.contains(&format!("summary {workload} ")), "{out}");
    }
    Ok(())
}

#[test]
fn mapreduce_histogram_across_three_hosts_equals_one_process() -> anyhow::Result<()> {
    let out = run_demo(
        "mapreduce",
        &[
            "regions-manager",
            "regions-daemon",
            "regionfs",
            "regions-mapreduce",
        ],
    )?;
    assert!(
        out.contains("histogram equal to the single-process one: yes"),
        "{out}"
    );
    for host in 1..=3 {
        assert!(out.contains(&format!("on host {host}: start ")), "{out}");
    }
    // Every map task was counted by exactly one worker.
    let tasks: u32 = out
        .lines()
        .filter_map(|l| l.split_once(" own tasks, ")?.1.split_once(" taken over"))
        .map(|(taken, _)| taken.trim().parse::<u32>().unwrap_or(0))
        .sum::<u32>()
        + out
            .lines()
            .filter_map(|l| {
                let before = l.split_once(" own tasks, ")?.0;
                before.rsplit_once(' ')?.1.parse::<u32>().ok()
            })
            .sum::<u32>();
    assert_eq!(tasks, 24, "{out}");
    Ok(())
}
