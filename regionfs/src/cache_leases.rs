//! This mount's cache leases (docs/SEMANTICS.md, "Cache leases"): which directories' names
//! and which inodes' attributes its kernel may cache for longer than the default second,
//! and until when. The manager grants them in replies; the mount's lease thread
//! (`RegionFs::start_cache_leases`) keeps the session, counts heartbeats and answers recalls.
//!
//! A lease holds for one term after the last heartbeat this mount received: a mount cut off
//! from the manager stops handing out long TTLs within a term, and the manager waits a term
//! and a margin before it changes what such a mount leased.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use regions_proto::v1;

/// Recall records kept (grants at or below a recalled one are refused) before old ones go.
const RECALLED_KEPT: usize = 4096;

/// What a lease covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Covered {
    /// A directory's names.
    Names(u64),
    /// An inode's attributes.
    Attrs(u64),
}

impl Covered {
    /// What a recall event names.
    pub fn of_recall(e: &v1::CacheLeaseEvent) -> Covered {
        if e.attrs {
            Covered::Attrs(e.ino)
        } else {
            Covered::Names(e.ino)
        }
    }
}

/// The leases this mount holds.
#[derive(Default)]
pub struct CacheLeases {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The session (0: none).
    session: u64,
    term: Duration,
    last_heartbeat: Option<Instant>,
    /// Covered → grant.
    held: HashMap<Covered, u64>,
    /// Covered → the newest grant recalled, and when (a reply granting an older one may
    /// still be on its way).
    recalled: HashMap<Covered, (u64, Instant)>,
}

impl State {
    /// How long leases still hold (none when the session is over or silent).
    fn remaining(&self) -> Option<Duration> {
        if self.session == 0 {
            return None;
        }
        let left = (self.last_heartbeat? + self.term).checked_duration_since(Instant::now())?;
        (!left.is_zero()).then_some(left)
    }
}

impl CacheLeases {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session to name in requests: 0 unless it is live.
    pub fn session(&self) -> u64 {
        let s = self.lock();
        if s.remaining().is_some() {
            s.session
        } else {
            0
        }
    }

    /// A new session began (its first event), with leases lasting `term`.
    pub fn started(&self, session: u64, term: Duration) {
        let mut s = self.lock();
        *s = State {
            session,
            term,
            last_heartbeat: Some(Instant::now()),
            ..State::default()
        };
    }

    /// A heartbeat of the session arrived.
    pub fn heartbeat(&self) {
        self.lock().last_heartbeat = Some(Instant::now());
    }

    /// Takes the grants of a reply to a request made under `session`: on `parent`'s names
    /// (`attr.dir_lease`) and on `attr`'s attributes (`attr.attr_lease`).
    pub fn note(&self, session: u64, parent: Option<u64>, attr: &v1::Attr) {
        if session == 0 || (attr.dir_lease == 0 && attr.attr_lease == 0) {
            return;
        }
        let mut s = self.lock();
        if s.session != session {
            return; // granted in a session that has ended
        }
        let mut take = |covered: Covered, grant: u64| {
            if grant == 0 || s.recalled.get(&covered).is_some_and(|(r, _)| grant <= *r) {
                return;
            }
            let newest = s.held.entry(covered).or_insert(grant);
            *newest = (*newest).max(grant);
        };
        if let Some(parent) = parent {
            take(Covered::Names(parent), attr.dir_lease);
        }
        take(Covered::Attrs(attr.ino), attr.attr_lease);
    }

    /// How long the kernel may cache what `covered` covers under a lease (`None`: no lease).
    pub fn ttl(&self, covered: Covered) -> Option<Duration> {
        let s = self.lock();
        if !s.held.contains_key(&covered) {
            return None;
        }
        s.remaining()
    }

    /// The longest a lease can hold (for how long records of cached entries must be kept).
    pub fn term(&self) -> Duration {
        self.lock().term
    }

    /// A recall of grants up to `grant` on `covered`: the lease is dropped (the caller
    /// makes the kernel forget what it cached, then answers).
    pub fn recall(&self, covered: Covered, grant: u64) {
        let mut s = self.lock();
        if s.held.get(&covered).is_some_and(|g| *g <= grant) {
            s.held.remove(&covered);
        }
        if s.recalled.len() >= RECALLED_KEPT {
            // Replies older than a few terms are not on their way any more.
            let horizon = s.term * 4;
            s.recalled.retain(|_, (_, at)| at.elapsed() < horizon);
        }
        let entry = s.recalled.entry(covered).or_insert((grant, Instant::now()));
        *entry = (entry.0.max(grant), Instant::now());
    }

    /// The session ended: every lease is gone; returns what they covered (for the kernel to
    /// forget).
    pub fn end(&self) -> Vec<Covered> {
        let mut s = self.lock();
        let held = s.held.keys().copied().collect();
        *s = State::default();
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(ino: u64, dir_lease: u64, attr_lease: u64) -> v1::Attr {
        v1::Attr {
            ino,
            dir_lease,
            attr_lease,
            ..Default::default()
        }
    }

    #[test]
    fn grants_hold_for_a_term_after_the_last_heartbeat_and_not_past_a_recall() {
        let l = CacheLeases::default();
        assert_eq!(l.session(), 0, "no session yet");
        l.note(7, Some(1), &attr(5, 10, 11));
        assert_eq!(l.ttl(Covered::Names(1)), None, "granted outside a session");
        l.started(7, Duration::from_millis(300));
        assert_eq!(l.session(), 7);
        l.note(7, Some(1), &attr(5, 10, 11));
        let ttl = l.ttl(Covered::Names(1)).expect("leased");
        assert!(ttl <= Duration::from_millis(300));
        assert!(l.ttl(Covered::Attrs(5)).is_some());
        // A recall of grant 10 drops the names lease; a reply with grant 9 arriving late is
        // not taken, a newer one is.
        l.recall(Covered::Names(1), 10);
        assert_eq!(l.ttl(Covered::Names(1)), None);
        l.note(7, Some(1), &attr(5, 9, 0));
        assert_eq!(l.ttl(Covered::Names(1)), None);
        l.note(7, Some(1), &attr(5, 12, 0));
        assert!(l.ttl(Covered::Names(1)).is_some());
        // Grants from another session are not taken.
        l.note(8, Some(2), &attr(6, 20, 21));
        assert_eq!(l.ttl(Covered::Names(2)), None);
        // Without heartbeats, everything lapses after the term.
        std::thread::sleep(Duration::from_millis(350));
        assert_eq!(l.session(), 0);
        assert_eq!(l.ttl(Covered::Attrs(5)), None);
        l.heartbeat();
        assert!(l.ttl(Covered::Attrs(5)).is_some());
        let ended = l.end();
        assert_eq!(ended.len(), 2);
        assert_eq!(l.ttl(Covered::Attrs(5)), None);
    }
}
