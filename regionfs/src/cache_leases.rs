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
    /// Covered → the newest grant held on it.
    held: HashMap<Covered, Held>,
    /// The last chain number handed out (see [`Held::chain`]).
    chains: u64,
    /// Covered → the newest grant recalled, and when (a reply granting an older one may
    /// still be on its way).
    recalled: HashMap<Covered, (u64, Instant)>,
}

/// A grant this mount holds.
#[derive(Clone, Copy, Debug)]
struct Held {
    grant: u64,
    /// When the request that brought it was sent (a grant lasts a term from then at most).
    asked: Instant,
    /// Its chain: grants on one thing held without a gap (each taken while the one before
    /// still held, no recall and no lapse of the session between) share a chain number,
    /// so nothing but this mount changed what they cover since the chain began.
    chain: u64,
    /// The grant that began the chain.
    first: u64,
}

impl State {
    /// Whether `h` holds now: the session's leases hold and it is within a term of its
    /// request.
    fn holds(&self, h: &Held, now: Instant) -> bool {
        self.valid_until()
            .is_some_and(|until| now < until.min(h.asked + self.term))
    }

    /// A new chain number.
    fn new_chain(&mut self) -> u64 {
        self.chains += 1;
        self.chains
    }

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
            // Chain numbers never repeat, across sessions too.
            chains: s.chains,
            ..State::default()
        };
    }

    /// The manager renewed `session` on a request sent at `asked`.
    pub fn renewed(&self, session: u64, asked: Instant) {
        let mut s = self.lock();
        if s.session == session {
            if s.valid_until().is_some_and(|until| asked > until) {
                // The leases lapsed before this renewal was sent: whatever the manager did
                // meanwhile was not recalled here, so no grant taken before continues.
                s.held.clear();
            }
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
        let now = Instant::now();
        if s.held.len() >= HELD_KEPT {
            // A grant lasts a term at most: older ones are of no use.
            let term = s.term;
            s.held.retain(|_, h| h.asked.elapsed() < term);
        }
        let mut take = |covered: Covered, grant: u64| {
            if grant == 0 || s.recalled.get(&covered).is_some_and(|(r, _)| grant <= *r) {
                return;
            }
            let before = s.held.get(&covered).copied();
            if before.is_some_and(|b| grant < b.grant) {
                return; // a late reply: a newer grant is held
            }
            let (chain, first) = match before {
                Some(b) if s.holds(&b, now) => (b.chain, b.first),
                _ => (s.new_chain(), grant),
            };
            s.held.insert(
                covered,
                Held {
                    grant,
                    asked,
                    chain,
                    first,
                },
            );
        };
        if let Some(parent) = parent {
            take(Covered::Names(parent), attr.dir_lease);
        }
        take(Covered::Attrs(attr.ino), attr.attr_lease);
    }

    /// The chain of the lease held on `covered` now (see [`Held::chain`]), and the grant
    /// that began it; `None` when none holds.
    pub fn chain(&self, covered: Covered) -> Option<(u64, u64)> {
        let s = self.lock();
        let h = s.held.get(&covered)?;
        s.holds(h, Instant::now()).then_some((h.chain, h.first))
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
        let h = s.held.get(&covered)?;
        if h.grant != grant {
            return None;
        }
        let until = s.valid_until()?.min(h.asked + s.term);
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
        match s.held.get(&covered).copied() {
            Some(h) if h.grant <= grant => {
                s.held.remove(&covered);
            }
            Some(h) => {
                // A grant newer than the recall's was given after the change began, for a
                // state after it ended: it holds on, but begins a chain of its own.
                let chain = s.new_chain();
                s.held.insert(
                    covered,
                    Held {
                        chain,
                        first: h.grant,
                        ..h
                    },
                );
            }
            None => {}
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
        *s = State {
            chains: s.chains,
            ..State::default()
        };
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

    #[test]
    fn a_chain_lasts_while_grants_follow_each_other_without_a_gap_or_a_recall() {
        let l = CacheLeases::default();
        let term = Duration::from_millis(300);
        l.started(7, term, Instant::now());
        let a = Covered::Attrs(5);
        assert_eq!(l.chain(a), None);
        l.note(7, Instant::now(), None, &attr(5, 0, 10));
        let (chain, first) = l.chain(a).expect("held");
        assert_eq!(first, 10);
        // A newer grant while the last holds continues the chain; an older one is not taken.
        l.note(7, Instant::now(), None, &attr(5, 0, 12));
        l.note(7, Instant::now(), None, &attr(5, 0, 11));
        assert_eq!(l.chain(a), Some((chain, 10)));
        assert!(l.ttl(a, 12).is_some());
        // A recall of an older grant than the one held keeps the lease but breaks the chain.
        l.recall(a, 11);
        let (after, first) = l.chain(a).expect("still held");
        assert_ne!(after, chain);
        assert_eq!(first, 12);
        // A recall of the grant held ends it; the next grant begins a new chain.
        l.recall(a, 12);
        assert_eq!(l.chain(a), None);
        l.note(7, Instant::now(), None, &attr(5, 0, 13));
        let (next, first) = l.chain(a).expect("held again");
        assert!(next != after && first == 13);
        // A grant that ran out (the session renewed all along) is a gap: the next one
        // begins a new chain.
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(90));
            l.renewed(7, Instant::now());
        }
        assert_eq!(l.chain(a), None, "ran out");
        l.note(7, Instant::now(), None, &attr(5, 0, 14));
        assert_eq!(l.chain(a).map(|(_, f)| f), Some(14));
        assert_ne!(l.chain(a).map(|(c, _)| c), Some(next));
        // A lapse of the session is a gap for every chain, and chains never repeat across
        // sessions.
        let held = l.chain(a).expect("held");
        std::thread::sleep(Duration::from_millis(320));
        l.renewed(7, Instant::now());
        assert_eq!(l.chain(a), None, "the session lapsed");
        l.end();
        l.started(8, term, Instant::now());
        l.note(8, Instant::now(), None, &attr(5, 0, 1));
        assert!(l.chain(a).is_some_and(|(c, _)| c > held.0));
    }
}
