//! Watching processes for their exit with pidfds (Remote Regions paper §5.1, §5.5: what a process owns or
//! holds is released when it exits). Shared by the host agent (region owners, mutex users) and
//! regionfs (owners of regions created through a mount); what an exit means is theirs, in an
//! [`ExitHandler`].
//!
//! A [`PidWatch`] keeps one pidfd per watched pid and polls them on a thread of its own. A pid
//! that exits is no longer watched when its handler runs; it is reported once. New watches
//! are looked at within one tick; exits wake the thread at once.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// When process (or thread) `pid` started, in clock ticks after boot (`/proc/PID/stat` field
/// 22); `None` when it does not exist. A pid and its start time name one process for good: a
/// pid reused by a later process has a later start time.
pub fn start_time(pid: u32) -> Option<u64> {
    state_and_start(pid).map(|(_, start)| start)
}

/// [`start_time`] of a process that is running: `None` also for one that exited and was not
/// reaped yet (a zombie keeps its pid and start time until its parent waits for it).
pub fn live_start_time(pid: u32) -> Option<u64> {
    match state_and_start(pid)? {
        ('Z' | 'X' | 'x', _) => None,
        (_, start) => Some(start),
    }
}

/// The state and start time of process `pid`, from `/proc/PID/stat`.
fn state_and_start(pid: u32) -> Option<(char, u64)> {
    state_and_start_of_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Fields 3 (state) and 22 (start time) of a `/proc/PID/stat` text. The command name (field
/// 2) may hold spaces and parentheses, so fields are counted from behind its last `)`.
fn state_and_start_of_stat(stat: &str) -> Option<(char, u64)> {
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was the state; the start time is 19 fields further.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Opens a pidfd for `pid`. A pid that cannot exist (0, or beyond `pid_t`) is `ESRCH`, like
/// one that exited and was reaped.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = match libc::pid_t::try_from(pid) {
        Ok(pid) if pid > 0 => pid,
        _ => return Err(io::Error::from_raw_os_error(libc::ESRCH)),
    };
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

/// Waits up to `timeout_ms` for one of `fds` to be readable (a pidfd is once its process
/// exited); the number of ready entries, whose `revents` are set.
fn poll_fds(fds: &mut [libc::pollfd], timeout_ms: libc::c_int) -> io::Result<usize> {
    let n = libc::nfds_t::try_from(fds.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors"))?;
    // SAFETY: `fds` is a valid, exclusively borrowed array of `n` pollfds for the whole call;
    // the descriptors in it are kept open by the caller.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), n, timeout_ms) };
    usize::try_from(ready).map_err(|_| io::Error::last_os_error())
}

/// What a [`PidWatch`] does, on its thread.
pub trait ExitHandler: Send + Sync {
    /// `pid` exited; it is no longer watched.
    fn exited(&self, pid: u32);
    /// Called at the start of every turn of the watcher (at least once per tick).
    fn tick(&self) {}
}

/// What [`PidWatch::watch`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watch {
    /// The pid is watched now.
    Added,
    /// The pid was watched already (watching it twice is watching it once).
    AlreadyWatched,
    /// No such process (it exited): it is not watched and its handler is not called.
    Gone,
}

struct Shared {
    pids: Mutex<HashMap<u32, Arc<OwnedFd>>>,
    stop: AtomicBool,
}

/// Watches processes on a thread of its own until dropped.
pub struct PidWatch {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PidWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PidWatch")
            .field("watched", &self.watched())
            .finish_non_exhaustive()
    }
}

impl PidWatch {
    /// Starts a watcher thread called `name` that looks at new watches every `tick` and
    /// calls `handler`.
    pub fn start(
        name: &str,
        tick: Duration,
        handler: Arc<dyn ExitHandler>,
    ) -> io::Result<PidWatch> {
        let shared = Arc::new(Shared {
            pids: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || watch_loop(&shared, handler.as_ref(), tick))?
        };
        Ok(PidWatch {
            shared,
            thread: Some(thread),
        })
    }

    /// Watches `pid`. An error other than [`Watch::Gone`] means the pid cannot be watched
    /// (`pidfd_open` failed, e.g. out of descriptors).
    pub fn watch(&self, pid: u32) -> io::Result<Watch> {
        let mut pids = self
            .shared
            .pids
            .lock()
            .map_err(|_| io::Error::other("the pid watcher's state is poisoned"))?;
        if pids.contains_key(&pid) {
            return Ok(Watch::AlreadyWatched);
        }
        match pidfd_open(pid) {
            Ok(fd) => {
                pids.insert(pid, Arc::new(fd));
                Ok(Watch::Added)
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(Watch::Gone),
            Err(e) => Err(e),
        }
    }

    /// Stops watching `pid`; `true` if it was watched. An exit already seen may still be
    /// reported.
    pub fn unwatch(&self, pid: u32) -> bool {
        self.shared
            .pids
            .lock()
            .is_ok_and(|mut p| p.remove(&pid).is_some())
    }

    /// The pids watched now, in order.
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

impl Drop for PidWatch {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch_loop(shared: &Shared, handler: &dyn ExitHandler, tick: Duration) {
    let timeout_ms = libc::c_int::try_from(tick.as_millis()).unwrap_or(libc::c_int::MAX);
    while !shared.stop.load(Ordering::SeqCst) {
        handler.tick();
        // Poll a copy of the descriptors so that watches can change meanwhile.
        let fds: Vec<(u32, Arc<OwnedFd>)> = match shared.pids.lock() {
            Ok(p) => p.iter().map(|(pid, fd)| (*pid, Arc::clone(fd))).collect(),
            Err(_) => return,
        };
        if fds.is_empty() {
            std::thread::sleep(tick);
            continue;
        }
        let mut polls: Vec<libc::pollfd> = fds
            .iter()
            .map(|(_, fd)| libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        match poll_fds(&mut polls, timeout_ms) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "polling pidfds of watched processes failed");
                std::thread::sleep(tick);
                continue;
            }
        }
        let exited: Vec<u32> = polls
            .iter()
            .zip(&fds)
            .filter(|(p, _)| p.revents != 0)
            .map(|(_, (pid, _))| *pid)
            .collect();
        if let Ok(mut p) = shared.pids.lock() {
            for pid in &exited {
                p.remove(pid);
            }
        }
        for pid in exited {
            handler.exited(pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    use super::*;

    #[test]
    fn start_times_name_processes() {
        let mine = start_time(std::process::id()).expect("this process has a start time");
        assert_eq!(start_time(std::process::id()), Some(mine));
        assert!(start_time(u32::MAX - 1).is_none());
        // A later process started no earlier.
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        let started = start_time(child.id());
        assert!(started.is_some_and(|t| t >= mine));
        assert_eq!(live_start_time(child.id()), started);
        // Killed but not reaped: a zombie, with its start time, but not running.
        child.kill().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while live_start_time(child.id()).is_some() {
            assert!(Instant::now() < deadline, "the killed child still runs");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(start_time(child.id()), started);
        child.wait().unwrap();
        // A command name with spaces and parentheses.
        let stat = "42 (a) b (c)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 20";
        assert_eq!(state_and_start_of_stat(stat), Some(('S', 777)));
    }

    #[derive(Default)]
    struct Recorder {
        exited: Mutex<Vec<u32>>,
        ticks: AtomicUsize,
    }

    impl ExitHandler for Recorder {
        fn exited(&self, pid: u32) {
            self.exited.lock().unwrap().push(pid);
        }
        fn tick(&self) {
            self.ticks.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn start() -> (Arc<Recorder>, PidWatch) {
        let rec = Arc::new(Recorder::default());
        let handler: Arc<dyn ExitHandler> = Arc::clone(&rec) as _;
        let watch = PidWatch::start("test-pid-watch", Duration::from_millis(20), handler).unwrap();
        (rec, watch)
    }

    fn wait_until(done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn pidfd_open_refuses_bad_pids() {
        assert_eq!(pidfd_open(0).unwrap_err().raw_os_error(), Some(libc::ESRCH));
        assert_eq!(
            pidfd_open(u32::MAX).unwrap_err().raw_os_error(),
            Some(libc::ESRCH)
        );
        assert!(pidfd_open(std::process::id()).is_ok());
    }

    #[test]
    fn an_exit_is_reported_once_and_the_pid_is_no_longer_watched() {
        let (rec, watch) = start();
        let mut child = Command::new("sleep").arg("0.2").spawn().unwrap();
        let pid = child.id();
        assert_eq!(watch.watch(pid).unwrap(), Watch::Added);
        assert_eq!(watch.watch(pid).unwrap(), Watch::AlreadyWatched);
        assert_eq!(watch.watched(), vec![pid]);
        child.wait().unwrap();
        wait_until(|| !rec.exited.lock().unwrap().is_empty());
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(*rec.exited.lock().unwrap(), vec![pid]);
        assert!(watch.watched().is_empty());
    }

    #[test]
    fn a_reaped_pid_is_gone_and_not_reported() {
        let (rec, watch) = start();
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(watch.watch(pid).unwrap(), Watch::Gone);
        assert!(watch.watched().is_empty());
        std::thread::sleep(Duration::from_millis(100));
        assert!(rec.exited.lock().unwrap().is_empty());
    }

    #[test]
    fn an_unwatched_pid_is_not_reported() {
        let (rec, watch) = start();
        let mut child = Command::new("sleep").arg("0.1").spawn().unwrap();
        let pid = child.id();
        assert_eq!(watch.watch(pid).unwrap(), Watch::Added);
        assert!(watch.unwatch(pid));
        assert!(!watch.unwatch(pid));
        child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(rec.exited.lock().unwrap().is_empty());
    }

    #[test]
    fn ticks_run_and_drop_stops_the_thread() {
        let (rec, watch) = start();
        wait_until(|| rec.ticks.load(Ordering::SeqCst) >= 3);
        assert!(rec.ticks.load(Ordering::SeqCst) >= 3);
        drop(watch);
        // The thread ended and let go of its handler.
        assert_eq!(Arc::strong_count(&rec), 1);
    }
}
