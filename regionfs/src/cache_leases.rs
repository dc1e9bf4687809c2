//! This mount's cache leases (docs/SEMANTICS.md, "Cache leases"): which directories' names
//! and which inodes' attributes its kernel may cache for longer than the default second,
//! and until when. The manager grants them in replies; the mount's lease threads
//! (`RegionFs::start_cache_leases`) keep the session, renew it and answer recalls.
//!
//! Leases hold for one term after this mount *sent* the last renewal the manager accepted
//! (the manager counts from when it accepted it, never earlier), and one grant for a term
//! after the request that brought it was sent: a mount cut off from the manager stops
//! handing out long TTLs within a term, and what it handed out expires by then.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use regions_proto::v1;

/// Recall records kept (grants at or below a recalled one are refused) before old ones go.
const RECALLED_KEPT: usize = 4096;

/// Grants kept before those older than a term go.
const HELD_KEPT: usize = 1 << 16;

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
    /// When this mount sent the request the manager last renewed the session with (or
    /// opened it with): its leases hold for a term after that.
    valid_from: Option<Instant>,
    /// The session is over at the manager (a new one is due).
    over: bool,
    /// Covered → the newest grant, and when the request that brought it was sent (a grant
    /// lasts a term from then at most).
    held: HashMap<Covered, (u64, Instant)>,
    /// Covered → the newest grant recalled, and when (a reply granting an older one may
    /// still be on its way).
    recalled: HashMap<Covered, (u64, Instant)>,
}

impl State {
    /// Until when the session's leases hold (none when there is no session).
    fn valid_until(&self) -> Option<Instant> {
        if self.session == 0 || self.over {
            return None;
        }
        Some(self.valid_from? + self.term)
    }
}

impl CacheLeases {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session to name in requests: 0 unless its leases hold.
    pub fn session(&self) -> u64 {
        let s = self.lock();
        match s.valid_until() {
            Some(until) if Instant::now() < until => s.session,
            _ => 0,
        }
    }

    /// The session number, live or not (for renewals and answers), and its term.
    pub fn current(&self) -> Option<(u64, Duration)> {
        let s = self.lock();
        (s.session != 0 && !s.over).then_some((s.session, s.term))
    }

    /// A new session began (its first event) with leases lasting `term`, asked for at
    /// `asked`.
    pub fn started(&self, session: u64, term: Duration, asked: Instant) {
        let mut s = self.lock();
        *s = State {
            session,
            term,
            valid_from: Some(asked),
            ..State::default()
        };
    }

    /// The manager renewed `session` on a request sent at `asked`.
    pub fn renewed(&self, session: u64, asked: Instant) {
        let mut s = self.lock();
        if s.session == session {
            s.valid_from = Some(s.valid_from.map_or(asked, |v| v.max(asked)));
        }
    }

    /// The manager says `session` is over.
    pub fn over(&self, session: u64) {
        let mut s = self.lock();
        if s.session == session {
            s.over = true;
        }
    }

    /// Whether the session is over at the manager (or there is none).
    pub fn is_over(&self) -> bool {
        let s = self.lock();
        s.session == 0 || s.over
    }

    /// Takes the grants of a reply to a request sent at `asked` under `session`: on
    /// `parent`'s names (`attr.dir_lease`) and on `attr`'s attributes (`attr.attr_lease`).
    pub fn note(&self, session: u64, asked: Instant, parent: Option<u64>, attr: &v1::Attr) {
        if session == 0 || (attr.dir_lease == 0 && attr.attr_lease == 0) {
            return;
        }
        let mut s = self.lock();
        if s.session != session {
            return; // granted in a session that has ended
        }
        if s.held.len() >= HELD_KEPT {
            // A grant lasts a term at most: older ones are of no use.
            let term = s.term;
            s.held.retain(|_, (_, at)| at.elapsed() < term);
        }
        let mut take = |covered: Covered, grant: u64| {
            if grant == 0 || s.recalled.get(&covered).is_some_and(|(r, _)| grant <= *r) {
                return;
            }
            let newest = s.held.entry(covered).or_insert((grant, asked));
            if grant >= newest.0 {
                *newest = (grant, asked);
            }
        };
        if let Some(parent) = parent {
            take(Covered::Names(parent), attr.dir_lease);
        }
        take(Covered::Attrs(attr.ino), attr.attr_lease);
    }

    /// How long the kernel may cache what a reply brought under grant `grant` on
    /// `covered`: while the session's leases hold, at most a term from when the reply was
    /// asked for, and only if `grant` is the newest held and not recalled (`None`: no
    /// lease).
    pub fn ttl(&self, covered: Covered, grant: u64) -> Option<Duration> {
        if grant == 0 {
            return None;
        }
        let s = self.lock();
        let &(held, asked) = s.held.get(&covered)?;
        if held != grant {
            return None;
        }
        let until = s.valid_until()?.min(asked + s.term);
        let left = until.checked_duration_since(Instant::now())?;
        (!left.is_zero()).then_some(left)
    }

    /// The longest a lease can hold (for how long records of cached entries must be kept).
    pub fn term(&self) -> Duration {
        self.lock().term
    }

    /// A recall of grants up to `grant` on `covered`: the lease is dropped (the caller
    /// makes the kernel forget what it cached, then answers).
    pub fn recall(&self, covered: Covered, grant: u64) {
        let mut s = self.lock();
        if s.held.get(&covered).is_some_and(|(g, _)| *g <= grant) {
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
    fn grants_hold_while_renewed_for_a_term_from_their_request_and_not_past_a_recall() {
        let l = CacheLeases::default();
        let now = Instant::now();
        assert_eq!(l.session(), 0, "no session yet");
        l.note(7, now, Some(1), &attr(5, 10, 11));
        assert_eq!(
            l.ttl(Covered::Names(1), 10),
            None,
            "granted outside a session"
        );
        l.started(7, Duration::from_millis(300), Instant::now());
        assert_eq!(l.session(), 7);
        l.note(7, Instant::now(), Some(1), &attr(5, 10, 11));
        let ttl = l.ttl(Covered::Names(1), 10).expect("leased");
        assert!(ttl <= Duration::from_millis(300));
        assert!(l.ttl(Covered::Attrs(5), 11).is_some());
        assert_eq!(l.ttl(Covered::Attrs(5), 0), None, "a reply without a grant");
        // A recall of grant 10 drops the names lease; a reply with grant 9 arriving late is
        // not taken, a newer one is, and only the newest grant counts.
        l.recall(Covered::Names(1), 10);
        assert_eq!(l.ttl(Covered::Names(1), 10), None);
        l.note(7, Instant::now(), Some(1), &attr(5, 9, 0));
        assert_eq!(l.ttl(Covered::Names(1), 9), None);
        l.note(7, Instant::now(), Some(1), &attr(5, 12, 0));
        assert!(l.ttl(Covered::Names(1), 12).is_some());
        l.note(7, Instant::now(), Some(1), &attr(5, 13, 0));
        assert_eq!(l.ttl(Covered::Names(1), 12), None, "not the newest grant");
        // Grants from another session are not taken.
        l.note(8, Instant::now(), Some(2), &attr(6, 20, 21));
        assert_eq!(l.ttl(Covered::Names(2), 20), None);
        // Renewed, the session holds on, but a grant lasts a term from its request.
        std::thread::sleep(Duration::from_millis(200));
        l.renewed(7, Instant::now());
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(l.session(), 7);
        assert_eq!(
            l.ttl(Covered::Attrs(5), 11),
            None,
            "a grant older than a term"
        );
        // Without renewals, everything lapses after the term.
        l.note(7, Instant::now(), Some(1), &attr(5, 14, 15));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(l.session(), 0);
        assert_eq!(l.ttl(Covered::Attrs(5), 15), None);
        l.over(7);
        assert!(l.is_over());
        assert!(!l.end().is_empty());
        assert_eq!(l.current(), None);
    }
}
