//! Owner-bound lifetime of regions created through the host agent (docs/SEMANTICS.md,
//! "Lifetime"; Remote Regions paper §5.1, §5.5).
//!
//! An application that creates a region through the agent ([`create`]) is its owner: the
//! manager records its pid (from `SO_PEERCRED`) and this host, and the agent watches the
//! process with a pidfd. When it exits, the agent asks the manager to release the owner
//! (`Cluster.ReleaseOwner`), which deletes the owner's regions that are not PERSISTENT at that
//! moment (so `setfattr persistent=0` after the create is honoured). A release the manager
//! cannot take now is retried every second until it can. If the whole host goes away, the
//! manager does the same for every owner of the host when its lease expires.
//!
//! The watch list lives in the daemon's memory: regions created before a restart of the
//! daemon are no longer watched (they are released with the host's lease if the host dies).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use regions_proto::pid_watch::{ExitHandler, PidWatch, Watch};
use regions_proto::v1::{self, Caller, OwnerCreate};

use crate::error::Result;
use crate::manager_client::Authority;

/// Called on the watcher thread when an owner exited; `true` once the release is done, `false`
/// to be called again later.
pub type OnExit = Arc<dyn Fn(u32) -> bool + Send + Sync>;

/// How long the watcher waits before it looks at new watches (exits wake it at once).
const TICK: Duration = Duration::from_millis(50);
/// Pause before a failed release is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Releases owners that exited, and retries those that failed.
struct Releases {
    on_exit: OnExit,
    /// Releases that failed, and when to try them again.
    retry: Mutex<Vec<(u32, Instant)>>,
}

/// Watches owner processes on a thread of its own.
pub struct OwnerWatch {
    pids: PidWatch,
    releases: Arc<Releases>,
}

impl std::fmt::Debug for OwnerWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerWatch")
            .field("watched", &self.watched())
            .finish_non_exhaustive()
    }
}

impl OwnerWatch {
    /// Starts the watcher; `on_exit` releases an owner that exited.
    pub fn start(on_exit: OnExit) -> std::io::Result<OwnerWatch> {
        let releases = Arc::new(Releases {
            on_exit,
            retry: Mutex::new(Vec::new()),
        });
        let handler: Arc<dyn ExitHandler> = Arc::clone(&releases) as _;
        Ok(OwnerWatch {
            pids: PidWatch::start("agent-owners", TICK, handler)?,
            releases,
        })
    }

    /// Watches `pid` (watching it twice is watching it once). An owner that is already gone is
    /// released at once, on this thread.
    pub fn watch(&self, pid: u32) {
        match self.pids.watch(pid) {
            Ok(Watch::Added | Watch::AlreadyWatched) => {}
            Ok(Watch::Gone) => {
                tracing::info!(pid, "owner already exited; releasing its regions");
                self.releases.release(pid);
            }
            Err(e) => tracing::warn!(
                pid,
                error = %e,
                "cannot watch a region owner (pidfd_open); its non-persistent regions will outlive it"
            ),
        }
    }

    /// The pids watched now.
    pub fn watched(&self) -> Vec<u32> {
        self.pids.watched()
    }
}

impl Releases {
    /// Releases `pid` now, or retries later.
    fn release(&self, pid: u32) {
        if !(self.on_exit)(pid) {
            self.retry_later(pid);
        }
    }

    fn retry_later(&self, pid: u32) {
        tracing::warn!(
            pid,
            "cannot release a region owner that exited now; retrying every {RETRY:?}"
        );
        if let Ok(mut r) = self.retry.lock() {
            r.push((pid, Instant::now() + RETRY));
        }
    }
}

impl ExitHandler for Releases {
    fn exited(&self, pid: u32) {
        tracing::debug!(pid, "region owner exited");
        self.release(pid);
    }

    /// Tries the releases that are due again.
    fn tick(&self) {
        let now = Instant::now();
        let due: Vec<u32> = match self.retry.lock() {
            Ok(mut r) => {
                let due = r.iter().filter(|e| e.1 <= now).map(|e| e.0).collect();
                r.retain(|e| e.1 > now);
                due
            }
            Err(_) => return,
        };
        for pid in due {
            if (self.on_exit)(pid) {
                tracing::info!(pid, "released a region owner that exited, after retrying");
            } else if let Ok(mut r) = self.retry.lock() {
                r.push((pid, Instant::now() + RETRY));
            }
        }
    }
}

/// The [`OnExit`] of a daemon: asks `authority` to release owners of host `host_id`. Failures
/// that may pass (the manager unreachable or restarting) are retried; others are logged.
pub fn releaser(authority: Arc<dyn Authority>, host_id: u32) -> OnExit {
    Arc::new(move |pid| match authority.release_owner(host_id, pid) {
        Ok(inos) => {
            if !inos.is_empty() {
                tracing::info!(pid, regions = ?inos, "owner exited: its non-persistent regions were deleted");
            }
            true
        }
        Err(e)
            if [libc::EIO, libc::ETIMEDOUT, libc::EAGAIN, libc::ECONNREFUSED]
                .contains(&e.errno()) =>
        {
            tracing::debug!(pid, error = %e, "cannot reach the manager to release an owner");
            false
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "the manager refused to release an owner that exited");
            true
        }
    })
}

/// `OwnerCreate`: creates the region as `caller` through the manager and has `owners` watch
/// the caller.
pub fn create(
    authority: &dyn Authority,
    owners: Option<&OwnerWatch>,
    caller: &Caller,
    req: OwnerCreate,
) -> Result<v1::Attr> {
    let request = v1::CreateRequest {
        caller: Some(caller.clone()),
        parent: req.parent,
        name: req.name,
        mode: req.mode & 0o7777,
        attrs: req.attrs,
        preallocate: req.preallocate,
    };
    let attr = authority.create(request)?;
    // Watched whatever the region's attributes: the manager decides at the exit which of the
    // owner's regions are not persistent.
    if let Some(owners) = owners {
        owners.watch(caller.pid);
    }
    Ok(attr)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    fn recorder() -> (Arc<Mutex<Vec<u32>>>, OnExit) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        (
            seen,
            Arc::new(move |pid| {
                sink.lock().unwrap().push(pid);
                true
            }),
        )
    }

    fn wait_for(seen: &Mutex<Vec<u32>>, n: usize) -> Duration {
        let start = Instant::now();
        while seen.lock().unwrap().len() < n && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        start.elapsed()
    }

    #[test]
    fn exits_are_reported_once_per_pid() {
        let (seen, on_exit) = recorder();
        let watch = OwnerWatch::start(on_exit).unwrap();
        let mut child = Command::new("sleep").arg("0.2").spawn().unwrap();
        let pid = child.id();
        watch.watch(pid);
        watch.watch(pid);
        assert_eq!(watch.watched(), vec![pid]);
        child.wait().unwrap();
        wait_for(&seen, 1);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(*seen.lock().unwrap(), vec![pid]);
        assert!(watch.watched().is_empty());
    }

    #[test]
    fn a_gone_owner_is_released_at_once_and_failures_are_retried() {
        let attempts = Arc::new(Mutex::new(0u32));
        let count = Arc::clone(&attempts);
        let watch = OwnerWatch::start(Arc::new(move |_| {
            let mut n = count.lock().unwrap();
            *n += 1;
            *n >= 3
        }))
        .unwrap();
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        // Reaped: the pid no longer exists. Released at once (attempt 1, fails), then
        // retried every second until it succeeds.
        watch.watch(pid);
        assert_eq!(*attempts.lock().unwrap(), 1);
        assert!(watch.watched().is_empty());
        let start = Instant::now();
        while *attempts.lock().unwrap() < 3 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(*attempts.lock().unwrap(), 3);
        std::thread::sleep(Duration::from_millis(1200));
        assert_eq!(
            *attempts.lock().unwrap(),
            3,
            "no more attempts after success"
        );
    }
}
