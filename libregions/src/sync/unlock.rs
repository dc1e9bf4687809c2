//! Posted unlocks: `mutex_unlock` sends its compare-and-swap `tag -> 0` and returns; the
//! reply is looked at later. When it shows waiters (or never came), a worker thread finishes
//! the unlock at the manager, which hands the mutex to the next waiter. Meanwhile a lock by
//! the same process waits for its unlocks to finish before it trusts a taken word or queues
//! at the manager, so nobody sees their own earlier hold. A process that exits normally
//! (`exit`, return from `main`) first waits, briefly, for its unlocks to finish, so waiters on
//! other hosts are not left to the manager's dead-holder cleanup.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

use regions_proto::v1::{SyncCall, SyncOp};

use super::{DELETED, SyncClient, WAITERS, tag_tid};
use crate::error::Result;
use crate::transport::Completion;

/// Unlocks of one lock word posted by this process and not finished yet.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    count: Mutex<u32>,
    finished: Condvar,
    /// The mutex's name.
    name: String,
    /// The worker finishing its unlocks that need the manager (set on the first posted
    /// unlock, so that posting takes no lock and no clone).
    handovers: OnceLock<Sender<Handover>>,
}

impl InFlight {
    fn new(name: &str) -> InFlight {
        InFlight {
            name: name.to_owned(),
            ..InFlight::default()
        }
    }

    /// The worker finishing this word's unlocks, from `start` the first time (`None` while
    /// there is none).
    pub(super) fn handovers(
        &self,
        start: impl FnOnce() -> Option<Sender<Handover>>,
    ) -> Option<&Sender<Handover>> {
        if self.handovers.get().is_none() {
            let _ = self.handovers.set(start()?);
        }
        self.handovers.get()
    }

    pub(super) fn begin(&self) {
        if let Ok(mut n) = self.count.lock() {
            *n += 1;
        }
    }

    pub(super) fn end(&self) {
        if let Ok(mut n) = self.count.lock() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.finished.notify_all();
            }
        }
    }

    /// Whether any is in flight.
    pub(super) fn any(&self) -> bool {
        self.count.lock().is_ok_and(|n| *n > 0)
    }

    /// Waits (at most `max`) until none is in flight; whether there were any.
    pub(super) fn wait(&self, max: Duration) -> bool {
        let Ok(mut n) = self.count.lock() else {
            return false;
        };
        if *n == 0 {
            return false;
        }
        let deadline = Instant::now() + max;
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    "a posted unlock did not finish within {} ms; going on",
                    max.as_millis()
                );
                break;
            }
            n = match self.finished.wait_timeout(n, left) {
                Ok((n, _)) => n,
                Err(_) => return true,
            };
        }
        true
    }
}

/// Longest wait at exit for unlocks still in flight.
const EXIT_WAIT: Duration = Duration::from_secs(5);

/// Every [`InFlight`] of the process, for the wait at exit.
static ALL: Mutex<Vec<Weak<InFlight>>> = Mutex::new(Vec::new());

impl InFlight {
    /// A new counter for mutex `name`, waited for when the process exits.
    pub(super) fn tracked(name: &str) -> Arc<InFlight> {
        static AT_EXIT: Once = Once::new();
        AT_EXIT.call_once(|| {
            // SAFETY: `finish_at_exit` is a plain `extern "C" fn()` that never unwinds (it
            // catches panics) and only touches state that outlives `main`.
            if unsafe { libc::atexit(finish_at_exit) } != 0 {
                tracing::debug!("cannot register the unlock wait at exit");
            }
        });
        let f = Arc::new(InFlight::new(name));
        if let Ok(mut all) = ALL.lock() {
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&f));
        }
        f
    }
}

/// Waits for posted unlocks before the process goes away.
extern "C" fn finish_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let all: Vec<Arc<InFlight>> = ALL
            .lock()
            .map(|all| all.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default();
        let deadline = Instant::now() + EXIT_WAIT;
        for f in all {
            f.wait(deadline.saturating_duration_since(Instant::now()));
        }
    });
}

/// An unlock whose reply needs the manager.
#[derive(Debug)]
pub(super) struct Handover {
    tag: u64,
    outcome: Result<u64>,
    unlocks: Arc<InFlight>,
}

/// The completion of a posted unlock by `tag` of the word of `unlocks`: done when the word
/// was swapped, else handed to the word's worker ([`InFlight::handovers`]).
pub(super) fn completion(tag: u64, unlocks: Arc<InFlight>) -> Completion {
    Box::new(move |outcome| {
        if matches!(outcome, Ok(old) if old == tag) {
            unlocks.end();
            return;
        }
        let job = Handover {
            tag,
            outcome,
            unlocks: Arc::clone(&unlocks),
        };
        if unlocks.handovers.get().is_none_or(|h| h.send(job).is_err()) {
            tracing::warn!(mutex = %unlocks.name, "no unlock worker; the manager releases the mutex when this process exits");
            unlocks.end();
        }
    })
}

/// Starts the worker finishing unlocks through the agent at `socket`.
pub(super) fn start_worker(socket: PathBuf) -> std::io::Result<Sender<Handover>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("regions-unlock".into())
        .spawn(move || worker(SyncClient::connect(&socket), rx))?;
    Ok(tx)
}

fn worker(client: SyncClient, jobs: Receiver<Handover>) {
    for job in jobs {
        finish(&client, &job);
        job.unlocks.end();
    }
}

/// Finishes one unlock whose compare-and-swap did not simply succeed.
fn finish(client: &SyncClient, job: &Handover) {
    let Handover {
        tag,
        outcome,
        unlocks,
    } = job;
    let name = &unlocks.name;
    let unknown = match outcome {
        Ok(old) if old & DELETED != 0 => return, // deleted: nothing to unlock
        Ok(old) if old & !WAITERS == *tag => false, // waiters: the manager hands it on
        Ok(old) => {
            tracing::warn!(
                mutex = %name,
                "unlock found the lock word at {old:#x}: the mutex had already been released \
                 from this thread (its process or host lease ended)"
            );
            return;
        }
        Err(e) => {
            tracing::debug!(mutex = %name, error = %e, "posted unlock got no reply; unlocking at the manager");
            true
        }
    };
    let call = SyncCall {
        op: SyncOp::MutexUnlock as i32,
        name: name.clone(),
        n: 0,
        tid: tag_tid(*tag),
        generation: 0,
        mode: None,
    };
    match client.call_with(call) {
        Ok(_) => {}
        // The swap did go through before its reply was lost.
        Err(e) if unknown && e.errno() == libc::EPERM => {}
        Err(e) => {
            tracing::warn!(mutex = %name, error = %e, "cannot finish an unlock at the manager")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_for_in_flight_unlocks_returns_once_they_end() {
        let f = Arc::new(InFlight::default());
        assert!(!f.wait(Duration::from_secs(1)));
        f.begin();
        f.begin();
        let g = Arc::clone(&f);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            g.end();
            g.end();
        });
        let start = Instant::now();
        assert!(f.wait(Duration::from_secs(10)));
        assert!(start.elapsed() >= Duration::from_millis(15));
        t.join().unwrap();
        assert!(!f.wait(Duration::from_secs(1)));
    }

    #[test]
    fn a_successful_swap_ends_the_unlock_without_the_worker() {
        let f = Arc::new(InFlight::new("m"));
        let (tx, rx) = std::sync::mpsc::channel();
        assert!(f.handovers(|| None).is_none());
        assert!(f.handovers(|| Some(tx)).is_some());
        // Set once: later calls do not start another worker.
        assert!(f.handovers(|| unreachable!()).is_some());
        f.begin();
        completion(5, Arc::clone(&f))(Ok(5));
        assert!(!f.wait(Duration::ZERO));
        assert!(rx.try_recv().is_err());
        f.begin();
        completion(5, Arc::clone(&f))(Ok(5 | WAITERS));
        let job = rx.try_recv().unwrap();
        assert_eq!(job.unlocks.name, "m");
        assert!(matches!(job.outcome, Ok(v) if v == 5 | WAITERS));
        assert!(f.any(), "in flight until the worker finishes it");
    }

    #[test]
    fn without_a_worker_a_failed_swap_ends_the_unlock() {
        let f = Arc::new(InFlight::new("m"));
        f.begin();
        completion(5, Arc::clone(&f))(Ok(5 | WAITERS));
        assert!(!f.any());
        let (tx, rx) = std::sync::mpsc::channel();
        f.handovers(|| Some(tx));
        drop(rx);
        f.begin();
        completion(5, Arc::clone(&f))(Err(crate::error::RegionsError::Invalid("lost".into())));
        assert!(!f.any());
    }
}
