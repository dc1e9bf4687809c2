//! Region lifetime (docs/SEMANTICS.md, "Lifetime"; Remote Regions paper §5.1, §5.5): regionfs
//! learns the creating process of each region from the FUSE request and
//! watches it with a pidfd; when it exits, its non-persistent regions are
//! deleted.
//!
//! Only regions created through this mount are watched, and a watch lives
//! as long as the mount: a region created before a restart of regionfs
//! outlives its owner.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use regions_proto::pid_watch::{ExitHandler, PidWatch, Watch};

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

/// The watched regions by owner; a pid is watched while it has regions here.
struct Regions {
    by_pid: Mutex<HashMap<u32, Vec<Owned>>>,
    reaper: Reaper,
}

/// How often the watcher looks for new watches and for its stop flag.
const TICK: Duration = Duration::from_millis(100);

/// Watches owner processes on a thread of its own.
pub struct OwnerWatch {
    pids: PidWatch,
    regions: Arc<Regions>,
}

impl OwnerWatch {
    /// Starts the watcher; `reaper` deletes regions of exited owners.
    pub fn start(reaper: Reaper) -> std::io::Result<OwnerWatch> {
        let regions = Arc::new(Regions {
            by_pid: Mutex::new(HashMap::new()),
            reaper,
        });
        let handler: Arc<dyn ExitHandler> = Arc::clone(&regions) as _;
        Ok(OwnerWatch {
            pids: PidWatch::start("regionfs-owners", TICK, handler)?,
            regions,
        })
    }

    /// Watches `owned.pid` for `owned`. An owner that is already gone has
    /// its region deleted at once.
    pub fn watch(&self, owned: Owned) {
        let Ok(mut by_pid) = self.regions.by_pid.lock() else {
            return;
        };
        if let Some(regions) = by_pid.get_mut(&owned.pid) {
            regions.push(owned);
            return;
        }
        match self.pids.watch(owned.pid) {
            Ok(Watch::Added | Watch::AlreadyWatched) => {
                by_pid.insert(owned.pid, vec![owned]);
            }
            Ok(Watch::Gone) => {
                drop(by_pid);
                tracing::info!(pid = owned.pid, ino = owned.ino, name = %owned.name, "owner already exited");
                (self.regions.reaper)(&owned);
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
        if let Ok(mut by_pid) = self.regions.by_pid.lock() {
            for o in by_pid.values_mut().flatten().filter(|o| o.ino == ino) {
                o.parent = new_parent;
                new_name.clone_into(&mut o.name);
            }
        }
    }

    /// Whether a region at `name` in `parent` is watched.
    pub fn watches_name(&self, parent: u64, name: &str) -> bool {
        self.regions.by_pid.lock().is_ok_and(|by_pid| {
            by_pid
                .values()
                .flatten()
                .any(|o| o.parent == parent && o.name == name)
        })
    }

    /// Stops watching a region (it was removed).
    pub fn forget(&self, ino: u64) {
        if let Ok(mut by_pid) = self.regions.by_pid.lock() {
            by_pid.retain(|pid, regions| {
                regions.retain(|o| o.ino != ino);
                if regions.is_empty() {
                    self.pids.unwatch(*pid);
                }
                !regions.is_empty()
            });
        }
    }

    /// Every watched region (for `.regions/procs`).
    pub fn watched(&self) -> Vec<Owned> {
        self.regions
            .by_pid
            .lock()
            .map(|by_pid| by_pid.values().flatten().cloned().collect())
            .unwrap_or_default()
    }
}

impl ExitHandler for Regions {
    fn exited(&self, pid: u32) {
        let regions = match self.by_pid.lock() {
            Ok(mut by_pid) => by_pid.remove(&pid),
            Err(_) => return,
        };
        for owned in regions.unwrap_or_default() {
            tracing::info!(pid, ino = owned.ino, name = %owned.name, "owner exited: deleting its non-persistent region");
            (self.reaper)(&owned);
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
