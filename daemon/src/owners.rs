//! Owner-bound lifetime of regions created through the host agent (DESIGN.md, "Lifetime";
//! paper 003 §5.1, §5.5).
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

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use regions_proto::v1::{self, AgentReply, Caller, OwnerCreate, agent_reply::Body};

use crate::agent::AgentHandler;
use crate::error::DaemonError;
use crate::manager_client::Authority;

/// Called on the watcher thread when an owner exited; `true` once the release is done, `false`
/// to be called again later.
pub type OnExit = Arc<dyn Fn(u32) -> bool + Send + Sync>;

/// How long the watcher waits before it looks at new watches (exits wake it at once).
const TICK: Duration = Duration::from_millis(50);
/// Pause before a failed release is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Opens a pidfd for `pid`.
fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    if pid <= 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    // SAFETY: pidfd_open(2) takes a pid and flags, touches no memory of ours, and returns a
    // new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::other("pidfd out of range"))?;
    // SAFETY: `fd` is a descriptor just returned by the kernel that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

struct Shared {
    pids: Mutex<HashMap<u32, Arc<OwnedFd>>>,
    /// Releases that failed, and when to try them again.
    retry: Mutex<Vec<(u32, Instant)>>,
    stop: AtomicBool,
}

/// Watches owner processes on a thread of its own.
pub struct OwnerWatch {
    shared: Arc<Shared>,
    on_exit: OnExit,
    thread: Option<JoinHandle<()>>,
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
    pub fn start(on_exit: OnExit) -> io::Result<OwnerWatch> {
        let shared = Arc::new(Shared {
            pids: Mutex::new(HashMap::new()),
            retry: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            let on_exit = Arc::clone(&on_exit);
            std::thread::Builder::new()
                .name("agent-owners".into())
                .spawn(move || watch_loop(&shared, &on_exit))?
        };
        Ok(OwnerWatch {
            shared,
            on_exit,
            thread: Some(thread),
        })
    }

    /// Watches `pid` (watching it twice is watching it once). An owner that is already gone is
    /// released at once, on this thread.
    pub fn watch(&self, pid: u32) {
        let Ok(mut pids) = self.shared.pids.lock() else {
            return;
        };
        if pids.contains_key(&pid) {
            return;
        }
        match pidfd_open(pid) {
            Ok(fd) => {
                pids.insert(pid, Arc::new(fd));
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                drop(pids);
                tracing::info!(pid, "owner already exited; releasing its regions");
                if !(self.on_exit)(pid) {
                    self.shared.retry_later(pid);
                }
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
        let mut pids: Vec<u32> = self
            .shared
            .pids
            .lock()
            .map(|p| p.keys().copied().collect())
            .unwrap_or_default();
        pids.sort_unstable();
        pids
    }
}

impl Drop for OwnerWatch {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn retry_later(&self, pid: u32) {
        tracing::warn!(
            pid,
            "cannot release a region owner that exited now; retrying every {RETRY:?}"
        );
        if let Ok(mut r) = self.retry.lock() {
            r.push((pid, Instant::now() + RETRY));
        }
    }

    /// Tries the releases that are due again.
    fn retry_due(&self, on_exit: &OnExit) {
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
            if on_exit(pid) {
                tracing::info!(pid, "released a region owner that exited, after retrying");
            } else if let Ok(mut r) = self.retry.lock() {
                r.push((pid, Instant::now() + RETRY));
            }
        }
    }
}

fn watch_loop(shared: &Shared, on_exit: &OnExit) {
    while !shared.stop.load(Ordering::SeqCst) {
        shared.retry_due(on_exit);
        let fds: Vec<(u32, Arc<OwnedFd>)> = match shared.pids.lock() {
            Ok(p) => p.iter().map(|(pid, fd)| (*pid, Arc::clone(fd))).collect(),
            Err(_) => return,
        };
        if fds.is_empty() {
            std::thread::sleep(TICK);
            continue;
        }
        let mut polls: Vec<PollFd<'_>> = fds
            .iter()
            .map(|(_, fd)| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        match poll(&mut polls, PollTimeout::from(TICK.as_millis() as u16)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "polling owner pidfds failed");
                std::thread::sleep(TICK);
                continue;
            }
        }
        let exited: Vec<u32> = polls
            .iter()
            .zip(&fds)
            .filter(|(p, _)| p.revents().is_some_and(|r| !r.is_empty()))
            .map(|(_, (pid, _))| *pid)
            .collect();
        drop(polls);
        if let Ok(mut p) = shared.pids.lock() {
            for pid in &exited {
                p.remove(pid);
            }
        }
        for pid in exited {
            tracing::debug!(pid, "region owner exited");
            if !on_exit(pid) {
                shared.retry_later(pid);
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

/// `OwnerCreate`: creates the region as `caller` through the manager and watches the caller.
pub fn create(
    handler: &AgentHandler,
    caller: &Caller,
    req: OwnerCreate,
) -> (AgentReply, Option<OwnedFd>) {
    let request = v1::CreateRequest {
        caller: Some(caller.clone()),
        parent: req.parent,
        name: req.name,
        mode: req.mode & 0o7777,
        attrs: req.attrs,
        preallocate: req.preallocate,
    };
    match handler.authority.create(request) {
        Ok(attr) => {
            // Watched whatever the region's attributes: the manager decides at the exit which
            // of the owner's regions are not persistent.
            if let Some(owners) = &handler.owners {
                owners.watch(caller.pid);
            }
            (
                AgentReply {
                    errno: 0,
                    message: String::new(),
                    body: Some(Body::OwnerCreated(attr)),
                },
                None,
            )
        }
        Err(e) => (error_reply(&e), None),
    }
}

fn error_reply(e: &DaemonError) -> AgentReply {
    AgentReply {
        errno: e.errno(),
        message: e.to_string(),
        body: None,
    }
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

    #[test]
    fn pidfd_open_refuses_bad_pids() {
        assert_eq!(pidfd_open(0).unwrap_err().raw_os_error(), Some(libc::ESRCH));
        assert!(pidfd_open(u32::MAX).is_err());
        assert!(pidfd_open(std::process::id()).is_ok());
    }
}
