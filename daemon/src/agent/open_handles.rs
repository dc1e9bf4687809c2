//! Open handles the host agent obtained for local processes (application sessions open regions
//! through it), so that a process that exits without closing them does not keep its regions
//! alive: the pid watch of [`crate::agent::owners`] reports the exit and [`OpenHandles::close_all`]
//! closes what is left at the manager. Without this, an unlinked region opened by a program
//! that was killed would hold its memory until its host's lease ended.

use std::collections::HashMap;
use std::sync::Mutex;

use regions_proto::v1::Caller;

use crate::manager_client::Authority;

/// The handles of each local process, by pid.
#[derive(Debug, Default)]
pub struct OpenHandles {
    by_pid: Mutex<HashMap<u32, Vec<Held>>>,
}

/// A handle and the process that opened it.
#[derive(Debug, Clone)]
struct Held {
    handle: u64,
    opener: Caller,
    /// The opener's start time ([`regions_proto::pid_watch::start_time`]): a later process
    /// that got the same pid is not the opener.
    start_time: u64,
}

impl OpenHandles {
    /// `caller`, which started at `start_time`, got `handle` through the agent.
    pub fn opened(&self, caller: &Caller, start_time: u64, handle: u64) {
        if handle == 0 {
            return;
        }
        if let Ok(mut m) = self.by_pid.lock() {
            m.entry(caller.pid).or_default().push(Held {
                handle,
                opener: caller.clone(),
                start_time,
            });
        }
    }

    /// Process `pid` closed `handle` itself.
    pub fn closed(&self, pid: u32, handle: u64) {
        if let Ok(mut m) = self.by_pid.lock()
            && let Some(handles) = m.get_mut(&pid)
        {
            handles.retain(|h| h.handle != handle);
            if handles.is_empty() {
                m.remove(&pid);
            }
        }
    }

    /// Whether `handle` was opened through this agent by another process or user than
    /// `caller` (which started at `start_time`): another pid, another uid, or the same pid
    /// reused by a later process. A handle the agent does not know (opened before the daemon
    /// restarted) is left to the manager, which checks the opener's pid.
    pub fn opened_by_other(&self, caller: &Caller, start_time: u64, handle: u64) -> bool {
        self.by_pid.lock().is_ok_and(|m| {
            m.iter().any(|(pid, hs)| {
                hs.iter().any(|h| {
                    h.handle == handle
                        && (*pid != caller.pid
                            || h.opener.uid != caller.uid
                            || h.start_time != start_time)
                })
            })
        })
    }

    /// How many handles process `pid` holds through the agent.
    pub fn count(&self, pid: u32) -> usize {
        self.by_pid
            .lock()
            .map_or(0, |m| m.get(&pid).map_or(0, Vec::len))
    }

    /// Process `pid` exited: closes its handles at the manager. Handles whose close failed in
    /// a way that may pass (manager unreachable) are kept for the next try; returns whether
    /// none is left. Handles of a later process that got the same pid (one running now, not
    /// the exited one's zombie) are its own and stay.
    pub fn close_all(&self, pid: u32, authority: &dyn Authority) -> bool {
        self.close_all_but(
            pid,
            regions_proto::pid_watch::live_start_time(pid),
            authority,
        )
    }

    /// [`OpenHandles::close_all`], keeping the handles of the process of `pid` that started
    /// at `running` (if any).
    fn close_all_but(&self, pid: u32, running: Option<u64>, authority: &dyn Authority) -> bool {
        let handles = self
            .by_pid
            .lock()
            .ok()
            .and_then(|mut m| {
                let all = m.remove(&pid)?;
                let (live, gone): (Vec<Held>, Vec<Held>) =
                    all.into_iter().partition(|h| Some(h.start_time) == running);
                if !live.is_empty() {
                    m.insert(pid, live);
                }
                Some(gone)
            })
            .unwrap_or_default();
        let mut retry = Vec::new();
        for held in handles {
            let handle = held.handle;
            match authority.close(&held.opener, handle) {
                Ok(()) => tracing::debug!(pid, handle, "closed a handle its process left open"),
                Err(e)
                    if [libc::EIO, libc::ETIMEDOUT, libc::EAGAIN, libc::ECONNREFUSED]
                        .contains(&e.errno()) =>
                {
                    retry.push(held);
                }
                // Already closed (or the region is gone): nothing to do.
                Err(e) => tracing::debug!(pid, handle, error = %e, "handle of an exited process"),
            }
        }
        if retry.is_empty() {
            return true;
        }
        if let Ok(mut m) = self.by_pid.lock() {
            m.entry(pid).or_default().extend(retry);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{DaemonError, Result};
    use regions_proto::v1;

    /// Records closes; fails the first `transient` of them with EIO.
    #[derive(Default)]
    struct Closer {
        closed: Mutex<Vec<u64>>,
        transient: Mutex<u32>,
    }

    impl Authority for Closer {
        fn open(&self, _: &Caller, _: u64, _: bool) -> Result<v1::RegionInfo> {
            Err(DaemonError::Invalid("unused".into()))
        }
        fn access(&self, _: &Caller, _: u64, _: u32) -> Result<()> {
            Ok(())
        }
        fn close(&self, _: &Caller, handle: u64) -> Result<()> {
            let mut t = self.transient.lock().unwrap();
            if *t > 0 {
                *t -= 1;
                return Err(DaemonError::ManagerUnreachable {
                    url: "http://manager".into(),
                    attempts: 1,
                    secs: 0,
                    last: "down".into(),
                });
            }
            self.closed.lock().unwrap().push(handle);
            Ok(())
        }
    }

    fn caller(pid: u32) -> Caller {
        Caller {
            pid,
            ..Default::default()
        }
    }

    #[test]
    fn handles_left_open_are_closed_when_their_process_exits() {
        let h = OpenHandles::default();
        h.opened(&caller(10), 5, 1);
        h.opened(&caller(10), 5, 2);
        h.opened(&caller(10), 5, 3);
        h.opened(&caller(11), 5, 4);
        h.closed(10, 2);
        assert_eq!(h.count(10), 2);
        let a = Closer {
            transient: Mutex::new(1),
            ..Default::default()
        };
        // The first close fails for a while: that handle is kept and closed on the retry.
        // (Pid 10 of this test is no process; a real pid 10 may be running.)
        assert!(!h.close_all_but(10, None, &a));
        assert_eq!(h.count(10), 1);
        assert!(h.close_all_but(10, None, &a));
        let mut closed = a.closed.lock().unwrap().clone();
        closed.sort_unstable();
        assert_eq!(closed, vec![1, 3]);
        assert_eq!(h.count(10), 0);
        assert_eq!(h.count(11), 1);
    }

    #[test]
    fn a_handle_belongs_to_the_process_and_user_that_opened_it() {
        let h = OpenHandles::default();
        h.opened(&caller(10), 5, 7);
        assert!(!h.opened_by_other(&caller(10), 5, 7), "its opener");
        assert!(h.opened_by_other(&caller(11), 5, 7), "another process");
        assert!(
            !h.opened_by_other(&caller(11), 5, 8),
            "unknown here: the manager decides"
        );
        let other_user = Caller {
            uid: 1000,
            ..caller(10)
        };
        assert!(
            h.opened_by_other(&other_user, 5, 7),
            "a reused pid of another user"
        );
        assert!(
            h.opened_by_other(&caller(10), 9, 7),
            "a reused pid of the same user: a later process"
        );
        h.closed(10, 7);
        assert!(!h.opened_by_other(&caller(11), 5, 7));
    }

    #[test]
    fn an_exit_closes_the_exited_process_handles_not_those_of_its_pids_next_owner() {
        let h = OpenHandles::default();
        h.opened(&caller(10), 5, 1);
        // Pid 10 exited and a later process (started at 9) got it and opened a handle
        // before the exit was handled.
        h.opened(&caller(10), 9, 2);
        let a = Closer::default();
        assert!(h.close_all_but(10, Some(9), &a));
        assert_eq!(*a.closed.lock().unwrap(), vec![1]);
        assert_eq!(h.count(10), 1);
        assert!(!h.opened_by_other(&caller(10), 9, 2));
    }
}
