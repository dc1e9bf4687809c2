//! Running `regions-heap-helper` (the shared-heap stress and check process) from tests and
//! benches: one process per host, each bounded by a timeout.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::{bin_path, output_within, wait_timeout};

/// A stress process running on one host.
pub struct Stress {
    child: Child,
    /// Where it lists its live blocks when it is done.
    pub live: PathBuf,
    host: u32,
}

/// Starts `regions-heap-helper stress` on the region at `path` (its mount decides the host),
/// for `seconds` on `threads` threads, listing its live blocks in `live`.
pub fn start_stress(
    path: &Path,
    host: u32,
    seconds: f64,
    threads: usize,
    live: PathBuf,
) -> anyhow::Result<Stress> {
    let child = Command::new(bin_path("regions-heap-helper")?)
        .arg("stress")
        .arg(path)
        .arg(seconds.to_string())
        .arg(threads.to_string())
        .arg(host.to_string())
        .arg(&live)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start regions-heap-helper")?;
    Ok(Stress { child, live, host })
}

impl Stress {
    /// Waits for the process (at most `timeout` past its run); returns its operation count.
    pub fn finish(mut self, timeout: Duration) -> anyhow::Result<u64> {
        use std::io::Read;
        let Some(status) = wait_timeout(&mut self.child, timeout)? else {
            let _ = self.child.kill();
            let _ = self.child.wait();
            bail!(
                "the stress process of host {} did not finish in {timeout:?}",
                self.host
            );
        };
        let (mut out, mut err) = (String::new(), String::new());
        if let Some(mut o) = self.child.stdout.take() {
            o.read_to_string(&mut out)?;
        }
        if let Some(mut e) = self.child.stderr.take() {
            e.read_to_string(&mut err)?;
        }
        if !status.success() {
            bail!(
                "the stress process of host {} failed ({status}): {out}{err}",
                self.host
            );
        }
        out.lines()
            .find_map(|l| l.strip_prefix("ops "))
            .with_context(|| format!("no ops line in {out:?}"))?
            .parse()
            .context("ops count")
    }
}

/// What `regions-heap-helper check` reported.
#[derive(Debug)]
pub struct Checked {
    pub blocks: u64,
    pub arenas: u64,
    pub pending: u64,
    pub freed: u64,
}

/// Runs `regions-heap-helper check PATH ARGS...` (at most `timeout`).
pub fn check(path: &Path, args: &[&std::ffi::OsStr], timeout: Duration) -> anyhow::Result<Checked> {
    let out = output_within(
        Command::new(bin_path("regions-heap-helper")?)
            .arg("check")
            .arg(path)
            .args(args),
        timeout,
    )?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "the heap check failed ({}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let field = |prefix: &str| -> anyhow::Result<u64> {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .with_context(|| format!("no {prefix:?} line in {text:?}"))?;
        line.split_whitespace()
            .next()
            .context("empty line")?
            .parse()
            .context("a count")
    };
    let arenas = text
        .lines()
        .find_map(|l| l.strip_prefix("checked "))
        .and_then(|l| l.split(" in ").nth(1))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no arena count in {text:?}"))?;
    Ok(Checked {
        blocks: field("checked ")?,
        arenas,
        pending: field("pending ")?,
        freed: field("freed ")?,
    })
}
