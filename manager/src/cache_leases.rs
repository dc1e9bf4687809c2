//! Cache leases (docs/SEMANTICS.md, "Cache leases"): a mount holding a lease lets its kernel
//! cache, for up to a term instead of the default second, either a directory's names
//! ([`Lease::Names`]) or an inode's attributes ([`Lease::Attrs`]). Nobody changes what a
//! lease covers without first recalling the leases of every other mount and waiting for
//! their answers, or for their leases to run out.
//!
//! A session is a mount's `WatchCacheLeases` stream, which carries recalls; the mount
//! answers each with `CacheLeaseRecalled` once its kernel has forgotten what it cached, and
//! renews the session every quarter term (`RenewCacheLeases`). Its leases hold for one term
//! after it *sent* the last renewal the manager accepted, so the manager, counting from when
//! it accepted it, never ends a lease earlier than the mount does. A session with a recall
//! unanswered is not renewed: a mount that cannot answer (stopped, cut off, its recall thread
//! stuck) loses its leases within a term, and the change waits for that at most. One grant
//! also lasts at most a term: the kernel asks again once what it cached expires.
//!
//! A manager that starts after a run that granted leases (a marker file in its data
//! directory says so) changes nothing leased until a term and a margin after that run ended:
//! its mounts may not have seen it end. A run that shut down cleanly wrote down when (its
//! sessions' streams closed then); after a crash the wait is counted from the start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use regions_proto::v1;
use tokio::sync::{mpsc, oneshot};

use crate::error::{ManagerError, Result};

/// How long a lease holds after the renewal the mount sent last.
pub const DEFAULT_TERM: Duration = Duration::from_secs(4);

/// What the manager waits beyond a term (delays between a mount sending a renewal and the
/// manager accepting it, a clock read late).
const MARGIN: Duration = Duration::from_secs(1);

/// Events a session's stream may hold before the mount is counted as not reading it.
const STREAM_BACKLOG: usize = 1024;

/// The file in the data directory that says a run granted leases.
const MARKER: &str = "cache-leases-granted";

pub type EventSender = mpsc::Sender<Result<v1::CacheLeaseEvent, tonic::Status>>;
pub type EventReceiver = mpsc::Receiver<Result<v1::CacheLeaseEvent, tonic::Status>>;

/// What a lease covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lease {
    /// The names of directory `ino` (and who may look them up: its permissions).
    Names(u64),
    /// The attributes of inode `ino`.
    Attrs(u64),
}

impl Lease {
    fn event(self, recall: u64, grant: u64) -> v1::CacheLeaseEvent {
        let (ino, attrs) = match self {
            Lease::Names(ino) => (ino, false),
            Lease::Attrs(ino) => (ino, true),
        };
        v1::CacheLeaseEvent {
            recall,
            ino,
            grant,
            attrs,
            ..Default::default()
        }
    }
}

/// Every mount's leases.
pub struct CacheLeases {
    inner: Mutex<Inner>,
    term: Duration,
    /// Changes wait until then (mounts of an earlier run may hold leases).
    grace_until: Instant,
    marker: PathBuf,
    marker_written: AtomicBool,
}

struct Inner {
    next_session: u64,
    next_grant: u64,
    next_recall: u64,
    /// Numbers the start and the end of each change; a grant is good only for a state read
    /// after the last change of what it covers ended.
    next_change: u64,
    /// The newest change of anything no longer tracked (see [`Covered::last_change`]).
    pruned_floor: u64,
    sessions: HashMap<u64, Session>,
    covered: HashMap<Lease, Covered>,
    /// Recalls waiting for their answer: recall → (session, waiter).
    waiting: HashMap<u64, (u64, oneshot::Sender<()>)>,
    /// When expired grants were last swept.
    swept: Instant,
    /// Shutting down: no new session.
    closed: bool,
}

struct Session {
    /// The only sender of the session's stream: the stream ends when the session does.
    tx: EventSender,
    /// When the manager accepted the session's last renewal (or opened it).
    renewed: Instant,
    /// Recalls sent and not answered: no renewal meanwhile.
    unanswered: u32,
}

#[derive(Default)]
struct Covered {
    /// Session → (its newest grant, when it was granted, what it covered then: see
    /// [`attr_digest`]; 0 for names).
    holders: HashMap<u64, (u64, Instant, u64)>,
    /// Changes under way: no grant meanwhile.
    breaking: u32,
    /// The number of the newest start or end of a change.
    last_change: u64,
}

/// A change under way: holds grants off what it changes until dropped.
pub struct BreakGuard {
    leases: Arc<CacheLeases>,
    /// (what changes, number of this change's start).
    changes: Mutex<Vec<(Lease, u64)>>,
}

/// A recall sent: (session, recall, answer, wait at most until).
type Wait = (u64, u64, oneshot::Receiver<()>, Instant);

impl CacheLeases {
    /// Leases of a manager keeping its state in `data_dir`, each lasting `term`.
    pub fn new(data_dir: &Path, term: Duration) -> CacheLeases {
        let marker = data_dir.join(MARKER);
        let now = Instant::now();
        let wait = match std::fs::read_to_string(&marker) {
            Err(_) => Duration::ZERO,
            Ok(text) => {
                let grace = term + MARGIN;
                match text
                    .trim()
                    .strip_prefix("clean ")
                    .and_then(|t| t.parse::<u64>().ok())
                {
                    // Shut down cleanly at `ended` (ms since the epoch): wait out the rest.
                    Some(ended) => {
                        let since = unix_ms().saturating_sub(ended);
                        grace.saturating_sub(Duration::from_millis(since))
                    }
                    None => grace,
                }
            }
        };
        if !wait.is_zero() {
            tracing::info!(
                ?wait,
                "an earlier run granted cache leases: changes wait until its mounts' leases have run out"
            );
        }
        // Session, grant and recall numbers from the clock: numbers of an earlier run are
        // never taken for this run's.
        let base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        CacheLeases {
            inner: Mutex::new(Inner {
                next_session: base,
                next_grant: base,
                next_recall: base,
                next_change: 1,
                pruned_floor: 0,
                sessions: HashMap::new(),
                covered: HashMap::new(),
                waiting: HashMap::new(),
                swept: now,
                closed: false,
            }),
            term,
            grace_until: now + wait,
            marker,
            marker_written: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update is a single insert or remove: the maps stay consistent after a panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a session for a mount; returns its number and the stream's receiving end (its
    /// first event names the session and the term).
    pub fn open_session(&self) -> Result<(u64, EventReceiver)> {
        let (tx, rx) = mpsc::channel(STREAM_BACKLOG);
        let mut i = self.lock();
        if i.closed {
            return Err(ManagerError::Unavailable(
                "the manager is shutting down; open a cache-lease session with its next run".into(),
            ));
        }
        let session = i.next_session;
        i.next_session += 1;
        let first = v1::CacheLeaseEvent {
            session,
            term_ms: self.term.as_millis().min(u32::MAX as u128) as u32,
            ..Default::default()
        };
        let _ = tx.try_send(Ok(first));
        i.sessions.insert(
            session,
            Session {
                tx,
                renewed: Instant::now(),
                unanswered: 0,
            },
        );
        Ok((session, rx))
    }

    /// Renews `session`'s leases for a term from now. Refused while a recall to it is
    /// unanswered, and for a session that is over (the mount opens a new one).
    pub fn renew(&self, session: u64) -> Result<()> {
        let now = Instant::now();
        let mut i = self.lock();
        i.sweep(now, self.term);
        let Some(s) = i.sessions.get_mut(&session) else {
            return Err(ManagerError::NotFound(format!(
                "cache-lease session {session} is over; open a new one"
            )));
        };
        if s.unanswered > 0 {
            return Err(ManagerError::Unavailable(format!(
                "cache-lease session {session} has a recall unanswered; answer it first"
            )));
        }
        s.renewed = now;
        Ok(())
    }

    /// Sessions renewed within a term.
    pub fn live_sessions(&self) -> u64 {
        let i = self.lock();
        i.sessions.keys().filter(|s| i.live(**s, self.term)).count() as u64
    }

    /// The number grants are checked against: take it before reading the state a grant
    /// will cover.
    pub fn snapshot(&self) -> u64 {
        self.lock().next_change
    }

    /// Grants `session` `lease` for a state read after `snapshot`, unless a change of what
    /// it covers ended since (or is under way). `digest` is what it covers ([`attr_digest`]
    /// of the attributes granted; 0 for names). Returns the grant, 0 for none.
    pub fn grant(&self, lease: Lease, session: u64, snapshot: u64, digest: u64) -> u64 {
        if session == 0 || self.term.is_zero() {
            return 0;
        }
        let mut i = self.lock();
        if !i.live(session, self.term) {
            return 0;
        }
        let (breaking, last) = i
            .covered
            .get(&lease)
            .map_or((0, i.pruned_floor), |c| (c.breaking, c.last_change));
        if breaking > 0 || last >= snapshot {
            return 0;
        }
        i.grant(lease, session, digest, self)
    }

    /// Which of `inos` have attribute leases that may be in use.
    pub fn held_attrs(&self, inos: impl IntoIterator<Item = u64>) -> Vec<u64> {
        let now = Instant::now();
        let i = self.lock();
        inos.into_iter()
            .filter(|ino| {
                i.covered.get(&Lease::Attrs(*ino)).is_some_and(|c| {
                    c.holders
                        .values()
                        .any(|(_, at, _)| fresh(*at, now, self.term))
                })
            })
            .collect()
    }

    /// Recalls every one of `leases` except `except`'s (the session making the change, whose
    /// kernel learns of it from the reply), waiting for the answers, or for an unanswering
    /// session's leases to run out (its session then ends). None of `leases` is granted
    /// until the guard is dropped.
    pub async fn recall(self: &Arc<Self>, leases: &[Lease], except: u64) -> BreakGuard {
        if Instant::now() < self.grace_until {
            tokio::time::sleep_until(self.grace_until.into()).await;
        }
        let (guard, waits) = self.begin_break(leases, except);
        self.wait_answers(waits).await;
        guard
    }

    /// Waits for the answers to recalls; a session that does not answer by the time its
    /// leases ran out is ended.
    async fn wait_answers(&self, waits: Vec<Wait>) {
        for (session, recall, answered, until) in waits {
            if matches!(
                tokio::time::timeout_at(until.into(), answered).await,
                Ok(Ok(()))
            ) {
                continue;
            }
            let mut i = self.lock();
            if i.waiting.remove(&recall).is_some() {
                tracing::warn!(
                    session,
                    "a mount did not answer a cache-lease recall while its leases held; ending its session"
                );
                i.end_session(session);
            }
        }
    }

    /// What may have changed without a [`CacheLeases::recall`] first (an owner's exit, a
    /// host's expiry, a path this module was not told of), with what it covers now
    /// ([`attr_digest`]; `None`: gone or names): no grant for a state read before now, and
    /// leases held on something that did change are recalled at once, their answers waited
    /// for in the background. (The manager marks an inode changed for internal bookkeeping
    /// too, which changes none of its attributes: a lease on those is kept.)
    pub fn changed_unrecalled(
        self: &Arc<Self>,
        changed: impl IntoIterator<Item = (Lease, Option<u64>)>,
    ) {
        let now = Instant::now();
        let held: Vec<Lease> = {
            let mut i = self.lock();
            let mut held = Vec::new();
            let mut untracked = false;
            for (lease, digest) in changed {
                match i.covered.get(&lease) {
                    Some(c) if c.breaking > 0 => {} // its change recalled it
                    Some(c)
                        if c.holders
                            .values()
                            .any(|(_, at, d)| fresh(*at, now, self.term) && digest != Some(*d)) =>
                    {
                        held.push(lease)
                    }
                    _ => untracked = true,
                }
            }
            if untracked {
                // No grant for a state read before this change (of something untracked).
                let change = i.next_change;
                i.next_change += 1;
                i.pruned_floor = i.pruned_floor.max(change);
            }
            held
        };
        if held.is_empty() {
            return;
        }
        tracing::debug!(?held, "recalling leases after an unannounced change");
        let (guard, waits) = self.begin_break(&held, 0);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let leases = Arc::clone(self);
        runtime.spawn(async move {
            leases.wait_answers(waits).await;
            drop(guard);
        });
    }

    /// Marks `leases` as changing and sends the recalls; returns the guard and what to wait
    /// for.
    fn begin_break(self: &Arc<Self>, leases: &[Lease], except: u64) -> (BreakGuard, Vec<Wait>) {
        let now = Instant::now();
        let term = self.term;
        let mut waits = Vec::new();
        let mut changes = Vec::new();
        let mut i = self.lock();
        for &lease in leases {
            if changes.iter().any(|(l, _)| *l == lease) {
                continue;
            }
            let change = i.next_change;
            i.next_change += 1;
            let c = i.covered.entry(lease).or_default();
            c.breaking += 1;
            c.last_change = change;
            changes.push((lease, change));
            let recalled: Vec<(u64, u64)> = c
                .holders
                .iter()
                .filter(|(s, (_, at, _))| **s != except && fresh(*at, now, term))
                .map(|(s, (g, _, _))| (*s, *g))
                .collect();
            c.holders.retain(|s, _| *s == except);
            for (session, grant) in recalled {
                let recall = i.next_recall;
                i.next_recall += 1;
                let Some(s) = i.sessions.get_mut(&session) else {
                    continue; // over, and its leases ran out with it
                };
                // Its leases hold until a term after the last renewal it sent, which the
                // manager accepted at `renewed` or later; none is accepted from now on.
                let until = s.renewed + term + MARGIN;
                s.unanswered += 1;
                if s.tx.try_send(Ok(lease.event(recall, grant))).is_err() {
                    tracing::info!(
                        session,
                        "a mount's cache-lease stream is not read; its leases are waited out"
                    );
                }
                let (tx, rx) = oneshot::channel();
                i.waiting.insert(recall, (session, tx));
                waits.push((session, recall, rx, until));
            }
        }
        drop(i);
        let guard = BreakGuard {
            leases: Arc::clone(self),
            changes: Mutex::new(changes),
        };
        (guard, waits)
    }

    /// `session` answered recall `recall`.
    pub fn recalled(&self, session: u64, recall: u64) {
        let mut i = self.lock();
        match i.waiting.get(&recall) {
            Some((s, _)) if *s == session => {
                if let Some((_, tx)) = i.waiting.remove(&recall) {
                    let _ = tx.send(());
                }
                if let Some(s) = i.sessions.get_mut(&session) {
                    s.unanswered = s.unanswered.saturating_sub(1);
                }
            }
            _ => tracing::debug!(
                session,
                recall,
                "a cache-lease recall answered late, twice, or by another session"
            ),
        }
    }

    /// The manager is shutting down: no new session, every session ends (their streams
    /// close, and their mounts drop every lease), and the marker says when, so that the next
    /// run waits only for what is left of a term.
    pub fn shut_down(&self) {
        {
            let mut i = self.lock();
            i.closed = true;
            let sessions: Vec<u64> = i.sessions.keys().copied().collect();
            for session in sessions {
                i.end_session(session);
            }
        }
        if self.marker_written.load(Ordering::Acquire) {
            let written = std::fs::write(&self.marker, format!("clean {}\n", unix_ms()))
                .and_then(|()| std::fs::File::open(&self.marker)?.sync_all());
            if let Err(e) = written {
                tracing::warn!(path = %self.marker.display(), error = %e, "cannot record a clean end of the cache leases; the next run waits a whole term");
            }
        } else if Instant::now() >= self.grace_until {
            // An earlier run's leases are over and this run granted none.
            let _ = std::fs::remove_file(&self.marker);
        }
    }

    /// Writes the marker (once per run) before the first grant goes out.
    fn mark_granted(&self) {
        if self.marker_written.swap(true, Ordering::AcqRel) {
            return;
        }
        // Empty: a run that granted and has not ended cleanly (a crash, for the next run).
        let written = std::fs::File::create(&self.marker).and_then(|f| f.sync_all());
        let dir_synced = self.marker.parent().map_or(Ok(()), |d| {
            std::fs::File::open(d).and_then(|d| d.sync_all())
        });
        if let Err(e) = written.and(dir_synced) {
            tracing::warn!(path = %self.marker.display(), error = %e, "cannot record that cache leases were granted; a restart within a term of a crash may let mounts serve stale names and attributes");
        }
    }

    #[cfg(test)]
    fn holders(&self, lease: Lease) -> Vec<u64> {
        let i = self.lock();
        let mut h: Vec<u64> = i
            .covered
            .get(&lease)
            .map(|c| c.holders.keys().copied().collect())
            .unwrap_or_default();
        h.sort_unstable();
        h
    }
}

/// What a lease on attributes `attr` covers: a hash of everything in them but the grants.
pub fn attr_digest(attr: &v1::Attr) -> u64 {
    use prost::Message;
    use std::hash::{Hash, Hasher};
    let mut bare = attr.clone();
    bare.dir_lease = 0;
    bare.attr_lease = 0;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bare.encode_to_vec().hash(&mut h);
    h.finish()
}

/// Whether a grant made at `at` may still be in use (the kernel asks again after a term).
fn fresh(at: Instant, now: Instant, term: Duration) -> bool {
    now.saturating_duration_since(at) < term + MARGIN
}

/// Milliseconds since the epoch.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Inner {
    /// Whether `session` is open and renewed within a term.
    fn live(&self, session: u64, term: Duration) -> bool {
        self.sessions
            .get(&session)
            .is_some_and(|s| s.renewed.elapsed() < term)
    }

    fn grant(&mut self, lease: Lease, session: u64, digest: u64, leases: &CacheLeases) -> u64 {
        leases.mark_granted();
        let grant = self.next_grant;
        self.next_grant += 1;
        self.covered
            .entry(lease)
            .or_default()
            .holders
            .insert(session, (grant, Instant::now(), digest));
        grant
    }

    /// Ends `session`: its stream closes. Its recalls still wait for its leases to run out
    /// (its mount may not have seen the end yet).
    fn end_session(&mut self, session: u64) {
        self.sessions.remove(&session);
    }

    /// Drops grants that ran out and sessions that stopped renewing, at most once a term.
    fn sweep(&mut self, now: Instant, term: Duration) {
        if now.saturating_duration_since(self.swept) < term {
            return;
        }
        self.swept = now;
        self.sessions.retain(|_, s| {
            s.unanswered > 0 || now.saturating_duration_since(s.renewed) < term + MARGIN
        });
        let mut emptied = Vec::new();
        for (lease, c) in &mut self.covered {
            c.holders.retain(|_, (_, at, _)| fresh(*at, now, term));
            if c.holders.is_empty() && c.breaking == 0 {
                emptied.push(*lease);
            }
        }
        for lease in emptied {
            self.prune(lease);
        }
    }

    /// Stops tracking `lease` once nothing holds or changes it.
    fn prune(&mut self, lease: Lease) {
        if let Some(c) = self.covered.get(&lease)
            && c.holders.is_empty()
            && c.breaking == 0
        {
            self.pruned_floor = self.pruned_floor.max(c.last_change);
            self.covered.remove(&lease);
        }
    }
}

impl BreakGuard {
    /// Grants `session` (the one making this change) `lease` for the state this change
    /// leaves (`digest` as for [`CacheLeases::grant`]), unless another change of what it
    /// covers began meanwhile. Returns 0 for none.
    pub fn grant(&self, lease: Lease, session: u64, digest: u64) -> u64 {
        let change = self
            .changes
            .lock()
            .ok()
            .and_then(|c| c.iter().find(|(l, _)| *l == lease).map(|(_, n)| *n));
        let Some(change) = change else {
            return 0;
        };
        if session == 0 || self.leases.term.is_zero() {
            return 0;
        }
        let mut i = self.leases.lock();
        if !i.live(session, self.leases.term) {
            return 0;
        }
        let alone = i
            .covered
            .get(&lease)
            .is_some_and(|c| c.breaking == 1 && c.last_change == change);
        if !alone {
            return 0;
        }
        i.grant(lease, session, digest, &self.leases)
    }

    /// Adds `lease` to this change, from inside it (an inode it creates): no grant of it
    /// until the guard is dropped; a holder (there is none for a new inode) is recalled in
    /// the background.
    pub fn also(&self, lease: Lease) {
        let Ok(mut changes) = self.changes.lock() else {
            return;
        };
        if changes.iter().any(|(l, _)| *l == lease) {
            return;
        }
        let (extra, waits) = self.leases.begin_break(&[lease], 0);
        let moved = extra.changes.lock().map(|mut c| std::mem::take(&mut *c));
        if let Ok(moved) = moved {
            changes.extend(moved);
        }
        if !waits.is_empty() {
            let leases = Arc::clone(&self.leases);
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move { leases.wait_answers(waits).await });
            }
        }
    }
}

impl Drop for BreakGuard {
    fn drop(&mut self) {
        let changes = match self.changes.get_mut() {
            Ok(c) => std::mem::take(c),
            Err(p) => std::mem::take(p.into_inner()),
        };
        let mut i = self.leases.lock();
        for (lease, _) in &changes {
            // The change ends: no grant for a state read while it was under way.
            let end = i.next_change;
            i.next_change += 1;
            if let Some(c) = i.covered.get_mut(lease) {
                c.breaking = c.breaking.saturating_sub(1);
                c.last_change = end;
            }
            i.prune(*lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D7: Lease = Lease::Names(7);

    fn leases(dir: &Path) -> Arc<CacheLeases> {
        Arc::new(CacheLeases::new(dir, Duration::from_millis(400)))
    }

    async fn next_recall(rx: &mut EventReceiver) -> v1::CacheLeaseEvent {
        loop {
            let e = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("an event within 5 s")
                .expect("the stream is open")
                .expect("no error");
            if e.recall != 0 {
                return e;
            }
        }
    }

    #[tokio::test]
    async fn a_change_recalls_other_sessions_and_waits_for_their_answer() {
        let tmp = tempfile::tempdir().unwrap();
        let l = leases(tmp.path());
        let (a, mut rx_a) = l.open_session().unwrap();
        let (b, _rx_b) = l.open_session().unwrap();
        let first = rx_a.recv().await.unwrap().unwrap();
        assert_eq!(first.session, a);
        let snap = l.snapshot();
        let ga = l.grant(D7, a, snap, 0);
        let gb = l.grant(D7, b, snap, 0);
        assert!(ga != 0 && gb != 0);
        assert_eq!(l.holders(D7), {
            let mut v = vec![a, b];
            v.sort_unstable();
            v
        });
        // b changes the directory: a is recalled, b keeps its lease.
        let l2 = Arc::clone(&l);
        let change = tokio::spawn(async move { l2.recall(&[D7], b).await });
        let recall = next_recall(&mut rx_a).await;
        assert_eq!((recall.ino, recall.grant, recall.attrs), (7, ga, false));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !change.is_finished(),
            "the change waits for the recall's answer"
        );
        assert!(l.renew(a).is_err(), "no renewal with a recall unanswered");
        l.recalled(b, recall.recall);
        assert!(
            !change.is_finished(),
            "an answer from another session does not count"
        );
        l.recalled(a, recall.recall);
        let guard = change.await.unwrap();
        assert_eq!(l.holders(D7), vec![b]);
        l.renew(a).unwrap();
        // No grant while the change is under way, nor for a state read before it ended.
        let during = l.snapshot();
        assert_eq!(l.grant(D7, a, during, 0), 0);
        drop(guard);
        assert_eq!(l.grant(D7, a, snap, 0), 0, "read before the change");
        assert_eq!(
            l.grant(D7, a, during, 0),
            0,
            "read while the change was under way"
        );
        assert_ne!(l.grant(D7, a, l.snapshot(), 0), 0);
    }

    #[tokio::test]
    async fn a_session_that_does_not_answer_is_waited_out_then_ended() {
        let tmp = tempfile::tempdir().unwrap();
        let l = leases(tmp.path());
        let (a, mut rx_a) = l.open_session().unwrap();
        let g = l.grant(Lease::Attrs(3), a, l.snapshot(), 0);
        assert_ne!(g, 0);
        let started = Instant::now();
        let guard = l.recall(&[Lease::Attrs(3)], 0).await;
        let waited = started.elapsed();
        // Its leases hold a term (400 ms) from its last renewal (its opening), plus the
        // margin (1 s).
        assert!(
            waited >= Duration::from_millis(1300) && waited < Duration::from_secs(5),
            "waited {waited:?}"
        );
        drop(guard);
        // The session is over: no grant, no renewal, and its stream ends.
        assert_eq!(l.grant(Lease::Attrs(3), a, l.snapshot(), 0), 0);
        assert!(l.renew(a).is_err());
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while rx_a.recv().await.is_some() {}
        })
        .await;
        assert!(ended.is_ok(), "the stream of an ended session closes");
    }

    #[tokio::test]
    async fn grants_run_out_after_a_term_and_are_not_recalled() {
        let tmp = tempfile::tempdir().unwrap();
        let l = leases(tmp.path());
        let (a, _rx) = l.open_session().unwrap();
        assert_ne!(l.grant(Lease::Names(5), a, l.snapshot(), 0), 0);
        // The mount renews its session every quarter term; the grant alone runs out.
        for _ in 0..15 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            l.renew(a).unwrap();
        }
        let started = Instant::now();
        drop(l.recall(&[Lease::Names(5)], 0).await);
        assert!(started.elapsed() < Duration::from_millis(200));
    }

    #[tokio::test]
    async fn a_change_by_the_holder_grants_it_the_new_state() {
        let tmp = tempfile::tempdir().unwrap();
        let l = leases(tmp.path());
        let (a, _rx) = l.open_session().unwrap();
        let guard = l.recall(&[Lease::Names(9)], a).await;
        assert_ne!(guard.grant(Lease::Names(9), a, 0), 0);
        // Another change of the directory meanwhile takes the grant away.
        let (guard2, waits) = l.begin_break(&[Lease::Names(9)], 0);
        assert_eq!(
            waits.len(),
            1,
            "a's own grant is recalled by the second change"
        );
        assert_eq!(guard.grant(Lease::Names(9), a, 0), 0);
        drop((guard, guard2));
    }

    #[tokio::test]
    async fn after_a_clean_shutdown_only_the_rest_of_the_term_is_waited() {
        let tmp = tempfile::tempdir().unwrap();
        {
            let l = leases(tmp.path());
            let (a, mut rx) = l.open_session().unwrap();
            assert_ne!(l.grant(Lease::Names(1), a, l.snapshot(), 0), 0);
            l.shut_down();
            assert!(l.open_session().is_err(), "no session after the shutdown");
            // The session's stream ends with the shutdown.
            let ended = tokio::time::timeout(Duration::from_secs(5), async {
                while rx.recv().await.is_some() {}
            })
            .await;
            assert!(ended.is_ok());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let l = leases(tmp.path());
        let started = Instant::now();
        drop(l.recall(&[Lease::Names(1)], 0).await);
        let waited = started.elapsed();
        // term 400 ms + margin 1 s, of which 500 ms passed.
        assert!(
            waited >= Duration::from_millis(700) && waited < Duration::from_millis(1200),
            "waited {waited:?}"
        );
    }

    #[tokio::test]
    async fn after_a_run_that_granted_changes_wait_for_the_term() {
        let tmp = tempfile::tempdir().unwrap();
        {
            let l = leases(tmp.path());
            let (a, _rx) = l.open_session().unwrap();
            assert_ne!(l.grant(Lease::Names(1), a, l.snapshot(), 0), 0);
        }
        let l = leases(tmp.path());
        let started = Instant::now();
        drop(l.recall(&[Lease::Names(1)], 0).await);
        assert!(started.elapsed() >= Duration::from_millis(1400));
    }
}
