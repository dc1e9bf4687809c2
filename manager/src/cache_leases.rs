//! Cache leases (docs/SEMANTICS.md, "Cache leases"): a mount holding a lease lets its kernel
//! cache, for up to a term instead of the default second, either a directory's names
//! ([`Lease::Names`]) or an inode's attributes ([`Lease::Attrs`]). Nobody changes what a
//! lease covers without first recalling the leases of every other mount and waiting for
//! their answers; a mount that does not answer within a term (plus a margin) loses its
//! session, and by then what its kernel cached has expired.
//!
//! A session is a mount's `WatchCacheLeases` stream. It carries heartbeats (a mount counts
//! its leases valid for one term after the last heartbeat it received) and recalls, which
//! the mount answers with `CacheLeaseRecalled` once its kernel has forgotten what it cached.
//!
//! A manager that starts after a run that granted leases (a marker file in its data
//! directory says so) changes nothing leased for a term and a margin after that run ended:
//! its mounts may not have seen it end yet. A run that shut down cleanly wrote down when (its
//! sessions' streams closed then); after a crash the wait is counted from the start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use regions_proto::v1;
use tokio::sync::{mpsc, oneshot};

/// How long a lease holds after the last heartbeat its mount received.
pub const DEFAULT_TERM: Duration = Duration::from_secs(4);

/// What a recall waits beyond the term for a mount that does not answer (delays in the
/// network, a mount's clock read late).
const MARGIN: Duration = Duration::from_secs(1);

/// Heartbeats per term.
const HEARTBEATS_PER_TERM: u32 = 4;

/// Events a session's stream may hold before the mount is counted as not keeping up.
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
    /// Directory changes wait until then (mounts of an earlier run may hold leases).
    grace_until: Instant,
    marker: PathBuf,
    marker_written: AtomicBool,
}

struct Inner {
    next_session: u64,
    next_grant: u64,
    next_recall: u64,
    /// Numbers the start of each change; a grant is good only for a state read after the
    /// last change of what it covers began.
    next_change: u64,
    /// The newest change of anything no longer tracked (see [`Covered::last_change`]).
    pruned_floor: u64,
    sessions: HashMap<u64, EventSender>,
    covered: HashMap<Lease, Covered>,
    /// Recalls waiting for their answer.
    waiting: HashMap<u64, oneshot::Sender<()>>,
}

/// What one lease covers, and who holds it.
#[derive(Default)]
struct Covered {
    /// Session → its newest grant.
    holders: HashMap<u64, u64>,
    /// Changes under way: no grant meanwhile.
    breaking: u32,
    /// The number of the newest change that began.
    last_change: u64,
}

/// A change under way: holds grants off what it changes until dropped.
pub struct BreakGuard {
    leases: Arc<CacheLeases>,
    /// (what changes, number of this change).
    changes: Mutex<Vec<(Lease, u64)>>,
}

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
        let grace_until = now + wait;
        // Session and grant numbers from the clock: numbers of an earlier run are never
        // taken for this run's.
        let base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        CacheLeases {
            inner: Mutex::new(Inner {
                next_session: base,
                next_grant: base,
                next_recall: 1,
                next_change: 1,
                pruned_floor: 0,
                sessions: HashMap::new(),
                covered: HashMap::new(),
                waiting: HashMap::new(),
            }),
            term,
            grace_until,
            marker,
            marker_written: AtomicBool::new(false),
        }
    }

    pub fn term(&self) -> Duration {
        self.term
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves maps that are still consistent enough to
        // recall from: every update is a single insert or remove.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a session for a mount; returns its number and the stream's receiving end (its
    /// first event names the session). Heartbeats go out until the stream ends.
    pub fn open_session(self: &Arc<Self>) -> (u64, EventReceiver) {
        let (tx, rx) = mpsc::channel(STREAM_BACKLOG);
        let session = {
            let mut i = self.lock();
            let session = i.next_session;
            i.next_session += 1;
            i.sessions.insert(session, tx.clone());
            session
        };
        let first = v1::CacheLeaseEvent {
            session,
            term_ms: self.term.as_millis().min(u32::MAX as u128) as u32,
            ..Default::default()
        };
        let _ = tx.try_send(Ok(first));
        let leases = Arc::clone(self);
        let every = (self.term / HEARTBEATS_PER_TERM).max(Duration::from_millis(10));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = tx.closed() => break,
                }
                if !leases.lock().sessions.contains_key(&session) {
                    break; // expired: dropping `tx` ends the stream
                }
                if tx.try_send(Ok(v1::CacheLeaseEvent::default())).is_err() {
                    tracing::info!(
                        session,
                        "a mount's name-lease stream is not read; ending its session"
                    );
                    break;
                }
            }
            leases.end_session(session);
        });
        (session, rx)
    }

    /// The manager is shutting down: every session ends (their streams close, and their
    /// mounts drop every lease), and the marker says when, so that the next run waits only
    /// for what is left of a term.
    pub fn shut_down(&self) {
        {
            let mut i = self.lock();
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

    /// Ends `session`: its leases are gone (its mount drops them when its stream ends).
    pub fn end_session(&self, session: u64) {
        let mut i = self.lock();
        i.end_session(session);
    }

    /// The number directory grants are checked against: take it before reading the state
    /// a grant will cover.
    pub fn snapshot(&self) -> u64 {
        self.lock().next_change
    }

    /// Grants `session` `lease` for a state read after `snapshot`, unless a change of what
    /// it covers began since (or is under way). Returns the grant, 0 for none.
    pub fn grant(&self, lease: Lease, session: u64, snapshot: u64) -> u64 {
        if session == 0 || self.term.is_zero() {
            return 0;
        }
        let mut i = self.lock();
        if !i.sessions.contains_key(&session) {
            return 0;
        }
        let (breaking, last) = i
            .covered
            .get(&lease)
            .map_or((0, i.pruned_floor), |c| (c.breaking, c.last_change));
        if breaking > 0 || last >= snapshot {
            return 0;
        }
        i.grant(lease, session, self)
    }

    /// Recalls every one of `leases` except `except`'s (the session making the change, whose
    /// kernel learns of it from the reply), waiting for the answers; a session that does not
    /// answer within a term and a margin is ended. None of `leases` is granted until the
    /// guard is dropped.
    pub async fn recall(self: &Arc<Self>, leases: &[Lease], except: u64) -> BreakGuard {
        if Instant::now() < self.grace_until {
            tokio::time::sleep_until(self.grace_until.into()).await;
        }
        let (guard, waits) = self.begin_break(leases, except);
        self.wait_answers(waits).await;
        guard
    }

    /// Waits for the answers to recalls; a session that does not answer within a term and a
    /// margin is ended.
    async fn wait_answers(&self, waits: Vec<(u64, u64, oneshot::Receiver<()>)>) {
        if waits.is_empty() {
            return;
        }
        let deadline = tokio::time::Instant::now() + self.term + MARGIN;
        for (session, recall, answered) in waits {
            if !matches!(
                tokio::time::timeout_at(deadline, answered).await,
                Ok(Ok(()))
            ) {
                tracing::warn!(
                    session,
                    "a mount did not answer a cache-lease recall within its term; ending its session"
                );
                let mut i = self.lock();
                i.waiting.remove(&recall);
                i.end_session(session);
            }
        }
    }

    /// What changed without a [`CacheLeases::recall`] first (an owner's exit, a host's
    /// expiry, a path this module was not told of): held leases on it are recalled now, in
    /// the background.
    pub fn changed_unrecalled(self: &Arc<Self>, changed: impl IntoIterator<Item = Lease>) {
        let held: Vec<Lease> = {
            let mut i = self.lock();
            let mut held = Vec::new();
            let mut untracked = false;
            for lease in changed {
                match i.covered.get(&lease) {
                    Some(c) if c.breaking > 0 => {} // its change recalled it
                    Some(c) if !c.holders.is_empty() => held.push(lease),
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
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let leases = Arc::clone(self);
        runtime.spawn(async move {
            drop(leases.recall(&held, 0).await);
        });
    }

    /// Marks `leases` as changing and sends the recalls; returns the guard and what to wait
    /// for.
    #[allow(clippy::type_complexity)]
    fn begin_break(
        self: &Arc<Self>,
        leases: &[Lease],
        except: u64,
    ) -> (BreakGuard, Vec<(u64, u64, oneshot::Receiver<()>)>) {
        let mut waits = Vec::new();
        let mut changes = Vec::new();
        let mut i = self.lock();
        for &lease in leases {
            if changes.iter().any(|(l, _)| *l == lease) {
                continue;
            }
            let change = i.next_change;
            i.next_change += 1;
            let d = i.covered.entry(lease).or_default();
            d.breaking += 1;
            d.last_change = change;
            changes.push((lease, change));
            let recalled: Vec<(u64, u64)> = d
                .holders
                .iter()
                .filter(|(s, _)| **s != except)
                .map(|(s, g)| (*s, *g))
                .collect();
            for (session, _) in &recalled {
                d.holders.remove(session);
            }
            for (session, grant) in recalled {
                let recall = i.next_recall;
                i.next_recall += 1;
                let event = lease.event(recall, grant);
                let sent = i
                    .sessions
                    .get(&session)
                    .is_some_and(|tx| tx.try_send(Ok(event)).is_ok());
                if sent {
                    let (tx, rx) = oneshot::channel();
                    i.waiting.insert(recall, tx);
                    waits.push((session, recall, rx));
                } else {
                    // Gone, or not reading its stream: its session ends (and its stream with
                    // it, so the mount drops every lease).
                    i.end_session(session);
                }
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
        if let Some(tx) = i.waiting.remove(&recall) {
            let _ = tx.send(());
        } else {
            tracing::debug!(
                session,
                recall,
                "a cache-lease recall answered late or twice"
            );
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
            .map(|d| d.holders.keys().copied().collect())
            .unwrap_or_default();
        h.sort_unstable();
        h
    }
}

/// Milliseconds since the epoch.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Inner {
    fn grant(&mut self, lease: Lease, session: u64, leases: &CacheLeases) -> u64 {
        leases.mark_granted();
        let grant = self.next_grant;
        self.next_grant += 1;
        self.covered
            .entry(lease)
            .or_default()
            .holders
            .insert(session, grant);
        grant
    }

    fn end_session(&mut self, session: u64) {
        if self.sessions.remove(&session).is_none() {
            return;
        }
        let mut emptied = Vec::new();
        for (lease, c) in &mut self.covered {
            if c.holders.remove(&session).is_some() && c.holders.is_empty() && c.breaking == 0 {
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
    /// leaves, unless another change of what it covers began meanwhile. Returns 0 for none.
    pub fn grant(&self, lease: Lease, session: u64) -> u64 {
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
        if !i.sessions.contains_key(&session) {
            return 0;
        }
        let alone = i
            .covered
            .get(&lease)
            .is_some_and(|c| c.breaking == 1 && c.last_change == change);
        if !alone {
            return 0;
        }
        i.grant(lease, session, &self.leases)
    }
}

impl BreakGuard {
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
            if let Some(c) = i.covered.get_mut(lease) {
                c.breaking = c.breaking.saturating_sub(1);
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
        let (a, mut rx_a) = l.open_session();
        let (b, _rx_b) = l.open_session();
        let first = rx_a.recv().await.unwrap().unwrap();
        assert_eq!(first.session, a);
        let snap = l.snapshot();
        let ga = l.grant(D7, a, snap);
        let gb = l.grant(D7, b, snap);
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
        l.recalled(a, recall.recall);
        let guard = change.await.unwrap();
        assert_eq!(l.holders(D7), vec![b]);
        // No grant while the change is under way, nor for a state read before it.
        assert_eq!(l.grant(D7, a, l.snapshot()), 0);
        drop(guard);
        assert_eq!(l.grant(D7, a, snap), 0, "read before the change");
        assert_ne!(l.grant(D7, a, l.snapshot()), 0);
    }

    #[tokio::test]
    async fn a_session_that_does_not_answer_is_ended_after_its_term() {
        let tmp = tempfile::tempdir().unwrap();
        let l = leases(tmp.path());
        let (a, mut rx_a) = l.open_session();
        let g = l.grant(Lease::Attrs(3), a, l.snapshot());
        assert_ne!(g, 0);
        let started = Instant::now();
        let guard = l.recall(&[Lease::Attrs(3)], 0).await;
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(400) && waited < Duration::from_secs(5),
            "waited {waited:?}"
        );
        drop(guard);
        // The session is over: no grant, and its stream ends.
        assert_eq!(l.grant(Lease::Attrs(3), a, l.snapshot()), 0);
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(e) = rx_a.recv().await {
                drop(e);
            }
        })
        .await;
        assert!(ended.is_ok(), "the stream of an ended session closes");
    }

    #[tokio::test]
    async fn a_change_by_the_holder_grants_it_the_new_state() {
        let tmp = tempfile::tempdir().unwrap();
        let l = leases(tmp.path());
        let (a, _rx) = l.open_session();
        let guard = l.recall(&[Lease::Names(9)], a).await;
        assert_ne!(guard.grant(Lease::Names(9), a), 0);
        // Another change of the directory meanwhile takes the grant away.
        let (guard2, waits) = l.begin_break(&[Lease::Names(9)], 0);
        assert_eq!(
            waits.len(),
            1,
            "a's own grant is recalled by the second change"
        );
        assert_eq!(guard.grant(Lease::Names(9), a), 0);
        drop((guard, guard2));
    }

    #[tokio::test]
    async fn after_a_clean_shutdown_only_the_rest_of_the_term_is_waited() {
        let tmp = tempfile::tempdir().unwrap();
        {
            let l = leases(tmp.path());
            let (a, mut rx) = l.open_session();
            assert_ne!(l.grant(Lease::Names(1), a, l.snapshot()), 0);
            l.shut_down();
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
            let (a, _rx) = l.open_session();
            assert_ne!(l.grant(Lease::Names(1), a, l.snapshot()), 0);
        }
        let l = leases(tmp.path());
        let started = Instant::now();
        drop(l.recall(&[Lease::Names(1)], 0).await);
        assert!(started.elapsed() >= Duration::from_millis(400));
    }
}
