//! Region lifetime (DESIGN.md, "Lifetime"; paper 003 §5.1, §5.5): regionfs
//! learns the creating process of each region from the FUSE request and
//! watches it with a pidfd; when it exits, its non-persistent regions are
//! deleted.
//!
//! Only regions created through this mount are watched, and a watch lives
//! as long as the mount: a region created before a restart of regionfs
//! outlives its owner.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::process::{Pid, PidfdFlags, pidfd_open};

/// A region whose owner is watched, and where it is in the namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owned {
    /// The region.
    pub ino: u64,
    /// Its directory.
    pub parent: u64,
    /// Its name there.
    pub name: String,
    /// The owner process.
    pub pid: u32,
}

/// Deletes a region whose owner exited.
pub type Reaper = Arc<dyn Fn(&Owned) + Send + Sync>;

struct Watched {
    pidfd: OwnedFd,
    regions: Vec<Owned>,
}

#[derive(Default)]
struct State {
    by_pid: HashMap<u32, Watched>,
}

/// How often the watcher looks for new watches and for its stop flag.
const TICK: Duration = Duration::from_millis(100);

/// Watches owner processes on a thread of its own.
pub struct OwnerWatch {
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    reaper: Reaper,
}

impl OwnerWatch {
    /// Starts the watcher; `reaper` deletes regions of exited owners.
    pub fn start(reaper: Reaper) -> std::io::Result<OwnerWatch> {
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let state = Arc::clone(&state);
            let stop = Arc::clone(&stop);
            let reaper = Arc::clone(&reaper);
            std::thread::Builder::new()
                .name("regionfs-owners".into())
                .spawn(move || watch_loop(&state, &stop, &reaper))?
        };
        Ok(OwnerWatch {
            state,
            stop,
            thread: Some(thread),
            reaper,
        })
    }

    /// Watches `owned.pid` for `owned`. An owner that is already gone has
    /// its region deleted at once.
    pub fn watch(&self, owned: Owned) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if let Some(w) = state.by_pid.get_mut(&owned.pid) {
            w.regions.push(owned);
            return;
        }
        let pidfd = Pid::from_raw(owned.pid as i32)
            .ok_or(rustix::io::Errno::SRCH)
            .and_then(|pid| pidfd_open(pid, PidfdFlags::empty()));
        match pidfd {
            Ok(pidfd) => {
                state.by_pid.insert(
                    owned.pid,
                    Watched {
                        pidfd,
                        regions: vec![owned],
                    },
                );
            }
            Err(rustix::io::Errno::SRCH) => {
                drop(state);
                tracing::info!(pid = owned.pid, ino = owned.ino, name = %owned.name, "owner already exited");
                (self.reaper)(&owned);
            }
            Err(e) => tracing::warn!(
                pid = owned.pid,
                ino = owned.ino,
                error = %e,
                "cannot watch the owner of a non-persistent region (pidfd_open); it will outlive its owner"
            ),
        }
    }

    /// Follows a rename made through this mount.
    pub fn renamed(&self, ino: u64, new_parent: u64, new_name: &str) {
        if let Ok(mut state) = self.state.lock() {
            for w in state.by_pid.values_mut() {
                for o in w.regions.iter_mut().filter(|o| o.ino == ino) {
                    o.parent = new_parent;
                    new_name.clone_into(&mut o.name);
                }
            }
        }
    }

    /// Stops watching a region (it was removed).
    pub fn forget(&self, ino: u64) {
        if let Ok(mut state) = self.state.lock() {
            for w in state.by_pid.values_mut() {
                w.regions.retain(|o| o.ino != ino);
            }
            state.by_pid.retain(|_, w| !w.regions.is_empty());
        }
    }

    /// Every watched region (for `.regions/procs`).
    pub fn watched(&self) -> Vec<Owned> {
        self.state
            .lock()
            .map(|s| {
                s.by_pid
                    .values()
                    .flat_map(|w| w.regions.iter().cloned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for OwnerWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch_loop(state: &Mutex<State>, stop: &AtomicBool, reaper: &Reaper) {
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: TICK.as_nanos() as _,
    };
    while !stop.load(Ordering::SeqCst) {
        // Poll a copy of the descriptors so that watches can be added meanwhile.
        let fds: Vec<(u32, OwnedFd)> = match state.lock() {
            Ok(s) => s
                .by_pid
                .iter()
                .filter_map(|(pid, w)| w.pidfd.try_clone().ok().map(|fd| (*pid, fd)))
                .collect(),
            Err(_) => return,
        };
        if fds.is_empty() {
            std::thread::sleep(TICK);
            continue;
        }
        let mut polls: Vec<PollFd<'_>> = fds
            .iter()
            .map(|(_, fd)| PollFd::new(fd, PollFlags::IN))
            .collect();
        match poll(&mut polls, Some(&timeout)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "polling owner pidfds failed");
                std::thread::sleep(TICK);
                continue;
            }
        }
        let exited: Vec<u32> = polls
            .iter()
            .zip(&fds)
            .filter(|(p, _)| !p.revents().is_empty())
            .map(|(_, (pid, _))| *pid)
            .collect();
        for pid in exited {
            let regions = match state.lock() {
                Ok(mut s) => s.by_pid.remove(&pid).map(|w| w.regions),
                Err(_) => return,
            };
            for owned in regions.unwrap_or_default() {
                tracing::info!(pid, ino = owned.ino, name = %owned.name, "owner exited: deleting its non-persistent region");
                reaper(&owned);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Instant;

    #[test]
    fn reaps_when_the_owner_exits() {
        let reaped = Arc::new(Mutex::new(Vec::<Owned>::new()));
        let sink = Arc::clone(&reaped);
        let watch = OwnerWatch::start(Arc::new(move |o: &Owned| {
            sink.lock().unwrap().push(o.clone());
        }))
        .unwrap();
        let mut child = Command::new("sleep").arg("0.3").spawn().unwrap();
        let owned = Owned {
            ino: 9,
            parent: 1,
            name: "a".into(),
            pid: child.id(),
        };
        watch.watch(owned.clone());
        watch.renamed(9, 4, "b");
        assert_eq!(watch.watched().len(), 1);
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while reaped.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let got = reaped.lock().unwrap().clone();
        assert_eq!(
            got,
            vec![Owned {
                parent: 4,
                name: "b".into(),
                ..owned
            }]
        );
        assert!(watch.watched().is_empty());
        // A forgotten region is not reaped.
        let mut child = Command::new("sleep").arg("0.1").spawn().unwrap();
        watch.watch(Owned {
            ino: 10,
            parent: 1,
            name: "c".into(),
            pid: child.id(),
        });
        watch.forget(10);
        child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(reaped.lock().unwrap().len(), 1);
    }
}
