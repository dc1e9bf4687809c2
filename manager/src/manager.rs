//! The manager core. Operations change the state under one short lock, and
//! their changed records are committed to the store by a committer thread
//! that batches everything pending into one transaction (group commit).
//! Nobody hears of an operation, nor of anything it observed, before the
//! change is durable; daemon events are published only after that too. The
//! gRPC layer ([`crate::service`]) is a thin adapter over this.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use regions_proto::v1::{self, host_event::Event};
use tokio::sync::{Notify, watch};

use crate::access::Caller;
use crate::cache_leases::{BreakGuard, CacheLeases, Lease, attr_digest};
use crate::cluster::HostRegistration;
use crate::error::{ManagerError, Result};
use crate::model::{Inode, Kind};
use crate::namespace::SetAttr;
use crate::state::State;
use crate::store::{self, Record, Store, StoreError};

/// How far handle numbers jump at each start (see [`Manager::open`]).
const HANDLE_ID_GAP: u64 = 1 << 32;

/// What an extend asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extend {
    /// The size becomes at least this.
    pub size: u64,
    /// Chunks cover at least this many bytes.
    pub capacity: u64,
    /// Set mtime and ctime to now.
    pub touch: bool,
    /// A small region stored as an object moves to chunks (`ExtendRequest.chunks`).
    pub chunks: bool,
}

/// Settings of a manager.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long a host stays live without a heartbeat.
    pub lease: Duration,
    /// Mode of a new store's root directory.
    pub root_mode: u32,
    /// How long to wait for a daemon to add a pool when asked.
    pub grow_timeout: Duration,
    /// Daemon events kept per host for streams that reconnect.
    pub event_backlog: usize,
    /// Bytes of the write-ahead log (`--wal-size`).
    pub wal_size: u64,
    /// Lifetime of transport capabilities; holders renew at half of it.
    pub capability_ttl: Duration,
    /// Longest wait of a change nobody waits for (handles opened or closed) for the next
    /// change to share its `fdatasync` ([`DEFERRED_COMMIT`]).
    pub deferred_commit: Duration,
    /// Term of the cache leases mounts hold (`--cache-lease-term-ms`; zero grants none).
    pub cache_lease_term: Duration,
    /// Regions up to this many bytes are stored as objects (`--small-regions`; 0: none).
    pub small_regions: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            lease: Duration::from_secs(10),
            root_mode: 0o1777,
            grow_timeout: Duration::from_secs(3),
            event_backlog: 1 << 16,
            wal_size: crate::wal::WAL_SIZE,
            capability_ttl: crate::revocations::DEFAULT_TTL,
            deferred_commit: DEFERRED_COMMIT,
            cache_lease_term: crate::cache_leases::DEFAULT_TERM,
            small_regions: crate::objects::DEFAULT_SMALL_REGIONS,
        }
    }
}

struct Inner {
    state: State,
    /// Sequence number of the last change applied to `state`.
    applied: u64,
    /// Sequence number of the last change other than open handles: what
    /// reads wait for (see [`Manager::write_handles`]).
    observable: u64,
    /// Set when a commit failed: the state in memory is ahead of the store,
    /// so nothing more is served until a restart reloads it.
    failed: Option<String>,
}

/// Changes waiting for the committer.
struct Batch {
    seq: u64,
    records: Vec<Record>,
    events: Vec<(u32, Event)>,
    /// Only open handles changed and nobody waits for it: it may wait (at most
    /// [`DEFERRED_COMMIT`]) to share the next batch's `fdatasync`.
    deferrable: bool,
}

/// Longest time a batch nobody waits for (handles opened or closed) waits for company
/// before it is stored on its own: a file system's close must not cost the next file's
/// create a `fdatasync` of its own to wait behind.
const DEFERRED_COMMIT: Duration = Duration::from_millis(10);

/// What the committer has made durable.
#[derive(Clone, Debug, Default)]
pub struct Durable {
    pub seq: u64,
    pub failed: Option<String>,
    /// Set while the store cannot take changes (a full file system): changes are refused with
    /// `ENOSPC`, reads and heartbeats go on (see `store::Store::stalled`).
    pub stalled: Option<String>,
    /// While stalled: the write-ahead log is nearly full, so even the changes that liveness
    /// needs (registrations, lease expiry, handles) are refused.
    pub log_nearly_full: bool,
}

/// How often a stalled store tries to resume.
const RESUME_EVERY: Duration = Duration::from_millis(500);

/// Which changes a stalled store still takes (see [`Manager::refuse_if_stalled`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    /// A change of the namespace or a region: refused while stalled.
    Change,
    /// What keeps hosts, leases and open files going: taken while the log has room.
    Liveness,
}

/// The queue between operations and the committer thread.
struct CommitQueue {
    batches: Mutex<(VecDeque<Batch>, bool)>,
    wake: Condvar,
}

/// Events for daemons, numbered.
struct EventLog {
    /// Sequence number of the first event of this manager run.
    base: u64,
    next: u64,
    /// Per host, the newest sequence number dropped from the backlog.
    dropped: HashMap<u32, u64>,
    per_host: HashMap<u32, VecDeque<v1::HostEvent>>,
    backlog: usize,
    /// Per host and region, the newest event that destroys bytes (`Released`, `Truncated`)
    /// or revokes capabilities (`Revoked`), until its daemon reports it applied; region 0
    /// stands for every region (a host fenced), as in `RegionRevoked`.
    destructive: HashMap<(u32, u64), u64>,
    /// Per host, the newest event its daemon reported applied.
    applied: HashMap<u32, u64>,
}

/// How long a reply that hands out a map waits for daemons to apply earlier destructive
/// events before it goes out anyway (with a warning): a daemon that slow is failing, and its
/// lease decides its fate.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The manager.
pub struct Manager {
    inner: Mutex<Inner>,
    queue: Arc<CommitQueue>,
    durable: watch::Sender<Durable>,
    committer: Mutex<Option<JoinHandle<()>>>,
    events: Arc<Mutex<EventLog>>,
    /// The sequence number of the newest event.
    event_seq: watch::Sender<u64>,
    /// Wakes callers waiting for a daemon to add a pool.
    pool_added: Notify,
    /// Bumped whenever a daemon reports events applied.
    events_applied: watch::Sender<u64>,
    /// Becomes true when the server begins shutting down.
    closing: watch::Sender<bool>,
    /// Namespace and region requests answered (see `StatsReply::file_requests`).
    file_requests: std::sync::atomic::AtomicU64,
    /// The capability clock when this run began: earlier tokens are revoked.
    run_began: u64,
    /// The data directory (named in errors).
    data_dir: std::path::PathBuf,
    /// Mounts' leases on what their kernels cache.
    cache_leases: Arc<CacheLeases>,
    /// Object requests to daemons (small regions), once the server gave the secret.
    objects_client: std::sync::OnceLock<Arc<crate::word_client::WordClient>>,
    /// This run's incarnation, random: object stores take every object allocated before a
    /// new one asks them as inherited, until this manager settles it
    /// (`Manager::settle_inherited_objects`).
    incarnation: u64,
    config: Config,
}

impl Manager {
    /// Opens the store in `data_dir`, loads the state and starts the
    /// committer thread.
    pub fn open(data_dir: &Path, config: Config) -> Result<Arc<Manager>, StoreError> {
        let (mut store, mut state) =
            Store::open_with_log(data_dir, config.lease, config.root_mode, config.wal_size)?;
        state.capability_ttl = config
            .capability_ttl
            .clamp(Duration::from_secs(1), crate::revocations::MAX_TTL);
        // Handle numbers handed out by an earlier run may not all have been
        // stored (see `write_handles`): never hand them out again.
        state.counters.next_handle = state.counters.next_handle.saturating_add(HANDLE_ID_GAP);
        state.dirty.counters = true;
        state.objects.small_regions = config.small_regions;
        state.resume_moves();
        state.free_orphans();
        if state.restrict_lock_region() {
            tracing::info!("the sync lock region is now mode 0600 (root only)");
        }
        store.commit(&mut state)?;
        state.events.clear();
        // Sequence numbers start from the clock so that a daemon holding a
        // number from an earlier manager run asks for a full resync.
        let base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let queue = Arc::new(CommitQueue {
            batches: Mutex::new((VecDeque::new(), false)),
            wake: Condvar::new(),
        });
        let durable = watch::channel(Durable::default()).0;
        let events = Arc::new(Mutex::new(EventLog {
            base,
            next: base,
            dropped: HashMap::new(),
            per_host: HashMap::new(),
            backlog: config.event_backlog,
            destructive: HashMap::new(),
            applied: HashMap::new(),
        }));
        let event_seq = watch::channel(base - 1).0;
        let committer = {
            let queue = Arc::clone(&queue);
            let durable = durable.clone();
            let events = Arc::clone(&events);
            let event_seq = event_seq.clone();
            let deferred = config.deferred_commit;
            std::thread::Builder::new()
                .name("regions-commit".into())
                .spawn(move || {
                    commit_loop(store, &queue, &durable, (&events, &event_seq), deferred)
                })
                .map_err(|e| StoreError::Db(redb::Error::Io(e)))?
        };
        Ok(Arc::new(Manager {
            inner: Mutex::new(Inner {
                state,
                applied: 0,
                observable: 0,
                failed: None,
            }),
            queue,
            durable,
            committer: Mutex::new(Some(committer)),
            events,
            event_seq,
            pool_added: Notify::new(),
            events_applied: watch::channel(0).0,
            closing: watch::channel(false).0,
            file_requests: Default::default(),
            run_began: crate::revocations::tick(),
            data_dir: data_dir.to_path_buf(),
            cache_leases: Arc::new(CacheLeases::new(data_dir, config.cache_lease_term)),
            objects_client: std::sync::OnceLock::new(),
            incarnation: rand::random::<u64>() | 1,
            config,
        }))
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Lets the manager place small regions as objects (with `--small-regions`), sending
    /// object requests to daemons with the cluster `secret`.
    pub fn serve_objects(&self, secret: regions_proto::auth::Secret) {
        let _ = self
            .objects_client
            .set(Arc::new(crate::word_client::WordClient::new(secret)));
    }

    /// This run's incarnation, as object requests name it.
    pub(crate) fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The client of daemons' object stores ([`Manager::serve_objects`]).
    pub(crate) fn objects_client(&self) -> Option<&Arc<crate::word_client::WordClient>> {
        self.objects_client.get()
    }

    /// Changes what the manager keeps in memory only (nothing stored, nothing waited for).
    pub(crate) fn in_memory<T>(&self, f: impl FnOnce(&mut State) -> T) -> Option<T> {
        self.lock().ok().map(|mut inner| f(&mut inner.state))
    }

    /// The capability clock when this manager run began.
    pub fn run_began(&self) -> u64 {
        self.run_began
    }

    /// Follows what is durable; `failed` is set once the store has failed.
    pub fn durability(&self) -> watch::Receiver<Durable> {
        self.durable.subscribe()
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        let inner = self
            .inner
            .lock()
            .map_err(|_| ManagerError::Store("the manager's state lock was poisoned".into()))?;
        if let Some(reason) = &inner.failed {
            return Err(ManagerError::Store(reason.clone()));
        }
        if let Some(reason) = &self.durable.borrow().failed {
            return Err(ManagerError::Store(reason.clone()));
        }
        Ok(inner)
    }

    /// Runs `f` on the state; queues what it changed for the committer.
    /// Returns its result and the sequence number that must be durable
    /// before anyone hears of it.
    /// Changes state that is never stored (leases, fences) under the state lock: no commit,
    /// no event, nothing a stalled store could refuse.
    pub(crate) fn with_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> Result<T> {
        let mut inner = self.lock()?;
        Ok(f(&mut inner.state))
    }

    fn apply<T>(&self, f: impl FnOnce(&mut State) -> Result<T>) -> Result<(Result<T>, u64)> {
        self.apply_marking(f, false)
            .map(|(result, seq, _)| (result, seq))
    }

    /// [`Manager::apply`], also returning the sequence number reads must
    /// wait for after it (its own unless it changed only open handles). With
    /// `unwaited`, nobody waits for a change of open handles only to be stored.
    fn apply_marking<T>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T>,
        unwaited: bool,
    ) -> Result<(Result<T>, u64, u64)> {
        let mut inner = self.lock()?;
        let result = f(&mut inner.state);
        if inner.state.dirty.is_empty() && inner.state.events.is_empty() {
            return Ok((result, inner.applied, inner.observable));
        }
        {
            // Names or attributes changed: a change that recalled the leases on them first is
            // under way; any other (an owner's exit, a host's expiry) recalls them now.
            let state = &inner.state;
            let mut changed: Vec<(Lease, Option<u64>)> = Vec::new();
            for (dir, _) in &state.dirty.dirents {
                if changed.last().is_none_or(|(l, _)| *l != Lease::Names(*dir)) {
                    changed.push((Lease::Names(*dir), None));
                }
            }
            // The attributes of leased inodes as they are now: their leases are recalled only
            // if they changed.
            let held = self
                .cache_leases
                .held_attrs(state.dirty.inodes.iter().copied());
            for ino in &state.dirty.inodes {
                let now = held
                    .contains(ino)
                    .then(|| state.inodes.get(ino).map(|i| attr_digest(&state.attr(i))))
                    .flatten();
                changed.push((Lease::Attrs(*ino), now));
            }
            self.cache_leases.changed_unrecalled(changed);
        }
        let handles_only = inner.state.dirty.only_handles() && inner.state.events.is_empty();
        let records = match store::collect(&mut inner.state) {
            Ok(r) => r,
            Err(e) => {
                let reason = e.to_string();
                inner.failed = Some(reason.clone());
                return Err(ManagerError::Store(reason));
            }
        };
        inner.applied += 1;
        if !handles_only {
            inner.observable = inner.applied;
        }
        let observable = inner.observable;
        let batch = Batch {
            seq: inner.applied,
            records,
            events: std::mem::take(&mut inner.state.events),
            deferrable: unwaited && handles_only,
        };
        let seq = batch.seq;
        // Queue under the state lock so batches reach the store in order.
        if let Ok(mut q) = self.queue.batches.lock() {
            q.0.push_back(batch);
            self.queue.wake.notify_one();
        }
        Ok((result, seq, observable))
    }

    /// Waits until `seq` is durable.
    async fn settle(&self, seq: u64) -> Result<()> {
        let mut rx = self.durable.subscribe();
        let d = rx
            .wait_for(|d| d.seq >= seq || d.failed.is_some())
            .await
            .map_err(|_| ManagerError::Store("the committer stopped".into()))?;
        match &d.failed {
            Some(reason) if d.seq < seq => Err(ManagerError::Store(reason.clone())),
            _ => Ok(()),
        }
    }

    /// `ENOSPC` when the store is stalled (its file system is full) and `need` is not taken
    /// now (see [`Need`]), before anything is changed.
    fn refuse_if_stalled(&self, need: Need) -> Result<()> {
        let d = self.durable.borrow();
        let Some(reason) = &d.stalled else {
            return Ok(());
        };
        if need == Need::Liveness && !d.log_nearly_full {
            return Ok(());
        }
        Err(ManagerError::StoreFull(format!(
            "the manager cannot store changes in its data directory {} ({reason}): free space \
             there; changes are refused until then, reads go on",
            self.data_dir.display()
        )))
    }

    /// Runs an operation that may change state; returns once its change
    /// (and everything it observed) is durable. Refused with `ENOSPC` while
    /// the store is stalled.
    pub async fn write<T>(&self, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        self.refuse_if_stalled(Need::Change)?;
        self.write_unchecked(f).await
    }

    /// [`Manager::write`] for changes that keep hosts and leases going (registration, lease
    /// expiry, owner exit): taken while the store is stalled, as long as its log has room.
    pub async fn write_for_liveness<T>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T>,
    ) -> Result<T> {
        self.refuse_if_stalled(Need::Liveness)?;
        self.write_unchecked(f).await
    }

    async fn write_unchecked<T>(&self, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        let (result, seq) = self.apply(f)?;
        self.settle(seq).await?;
        result
    }

    /// Runs an operation whose change, if it only opens or closes handles,
    /// need not be durable before the reply: it returns once what it saw is
    /// durable, and its own change is stored with the next batch. Batches
    /// are stored in order, so any later durable change (an unlink that
    /// would free the region but for this handle, say) stores it too; a
    /// crash before that loses only a handle no stored change depends on.
    /// A change to anything else is waited for as by [`Manager::write`].
    pub async fn write_handles<T>(&self, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        self.refuse_if_stalled(Need::Liveness)?;
        let (result, _, observable) = self.apply_marking(f, true)?;
        self.settle(observable).await?;
        result
    }

    /// Runs a read-only operation; returns once what it saw is durable
    /// (open handles excepted, see [`Manager::write_handles`]).
    pub async fn read<T>(&self, f: impl FnOnce(&State) -> Result<T>) -> Result<T> {
        let (result, seq) = {
            let inner = self.lock()?;
            (f(&inner.state), inner.observable)
        };
        self.settle(seq).await?;
        result
    }

    /// [`Manager::write`] for operations that allocate: when a host is short
    /// of pool memory but offers more, asks its daemon for a pool, waits for
    /// it (bounded by `grow_timeout`) and tries again; else `ENOSPC`.
    pub async fn write_allocating<T>(&self, f: impl Fn(&mut State) -> Result<T>) -> Result<T> {
        for attempt in 0..3 {
            let added = self.pool_added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            match self.write(&f).await {
                Err(ManagerError::NeedPool { host, bytes }) if attempt < 2 => {
                    tracing::info!(host, bytes, "asking the daemon for another pool");
                    publish(
                        &self.events,
                        &self.event_seq,
                        vec![(host, Event::GrowPool(bytes))],
                    );
                    if tokio::time::timeout(self.config.grow_timeout, added)
                        .await
                        .is_err()
                    {
                        return Err(ManagerError::NoSpace(format!(
                            "host {host} did not add a pool of {bytes} bytes within {:?}",
                            self.config.grow_timeout
                        )));
                    }
                }
                Err(ManagerError::NeedPool { host, bytes }) => {
                    return Err(ManagerError::NoSpace(format!(
                        "host {host} is still {bytes} bytes short after adding pools"
                    )));
                }
                other => return other,
            }
        }
        Err(ManagerError::NoSpace("allocation did not succeed".into()))
    }

    /// Events for `host` after `after`; `Err` when some of them are no
    /// longer kept (dropped from the backlog, or from an earlier manager
    /// run): the daemon must resync with `PoolChunks`. Events may repeat
    /// what `PoolChunks` returned; daemons apply them idempotently.
    pub fn events_after(&self, host: u32, after: u64) -> Result<Vec<v1::HostEvent>> {
        let log = self
            .events
            .lock()
            .map_err(|_| ManagerError::Store("the event log lock was poisoned".into()))?;
        let lost = log.dropped.get(&host).copied().unwrap_or(0);
        if after.saturating_add(1) < log.base || after < lost {
            return Err(ManagerError::Invalid(format!(
                "events after {after} for host {host} are no longer kept; call PoolChunks and watch again"
            )));
        }
        Ok(log
            .per_host
            .get(&host)
            .map(|q| q.iter().filter(|e| e.sequence > after).cloned().collect())
            .unwrap_or_default())
    }

    /// Host `host`'s daemon applied its events up to `sequence`.
    pub fn events_applied(&self, host: u32, sequence: u64) -> Result<()> {
        let mut log = self
            .events
            .lock()
            .map_err(|_| ManagerError::Store("the event log lock was poisoned".into()))?;
        let applied = log.applied.entry(host).or_insert(0);
        *applied = (*applied).max(sequence);
        let applied = *applied;
        log.destructive
            .retain(|(h, _), seq| *h != host || *seq > applied);
        drop(log);
        self.events_applied.send_modify(|n| *n = n.wrapping_add(1));
        Ok(())
    }

    /// Live hosts whose daemons have not yet applied a destructive event (chunk release, tail
    /// zeroing, revocation) published so far, of region `ino` (and those for every region) or
    /// of any region, with the sequence number each must reach.
    fn unsettled(&self, ino: Option<u64>) -> Vec<(u32, u64)> {
        let pending: Vec<(u32, u64)> = match self.events.lock() {
            Ok(log) => log
                .destructive
                .iter()
                .filter(|((_, region), _)| *region == 0 || ino.is_none_or(|i| i == *region))
                .filter(|((host, _), seq)| log.applied.get(host).copied().unwrap_or(0) < **seq)
                .map(|((host, _), seq)| (*host, *seq))
                .collect(),
            Err(_) => return Vec::new(),
        };
        if pending.is_empty() {
            return pending;
        }
        match self.lock() {
            Ok(inner) => pending
                .into_iter()
                .filter(|(host, _)| inner.state.is_live(*host))
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Waits until every live daemon has applied the destructive events published so far
    /// (bounded by [`SETTLE_TIMEOUT`]). Replies that hand out a region's map call it after
    /// their change: a write the reply authorises must never land before a punch or a zeroing
    /// that an earlier change decided, which would destroy it (a truncate then a write, a
    /// region's tail zeroed after another host already wrote there).
    pub(crate) async fn settle_destructive(&self) {
        self.settle_destructive_of(None).await
    }

    /// [`Manager::settle_destructive`] for the events of region `ino` only (and those for
    /// every region): its bytes live in its own chunks and segment memfds, so no other
    /// region's punch or zeroing can reach them (a pool chunk released by one region and
    /// assigned to another is released first: a daemon applies its events in order).
    pub(crate) async fn settle_destructive_for(&self, ino: u64) {
        self.settle_destructive_of(Some(ino)).await
    }

    async fn settle_destructive_of(&self, ino: Option<u64>) {
        // Small regions' objects: zeroed and moved before too.
        self.object_work_of(ino).await;
        let mut applied = self.events_applied.subscribe();
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            let pending = self.unsettled(ino);
            if pending.is_empty() {
                return;
            }
            if tokio::time::timeout_at(deadline, applied.changed())
                .await
                .is_err()
            {
                tracing::warn!(
                    ?pending,
                    "daemons did not confirm applying chunk releases or tail zeroing within {SETTLE_TIMEOUT:?}; answering anyway"
                );
                return;
            }
        }
    }

    /// The sequence number of the newest event.
    pub fn current_sequence(&self) -> u64 {
        *self.event_seq.borrow()
    }

    /// Ends long-lived calls (daemon event streams): the server is stopping.
    pub fn begin_shutdown(&self) {
        self.closing.send_replace(true);
        self.cache_leases.shut_down();
    }

    /// Resolves to true once shutdown has begun.
    pub fn closing(&self) -> watch::Receiver<bool> {
        self.closing.subscribe()
    }

    /// Wakes when new events are published.
    pub fn subscribe_events(&self) -> watch::Receiver<u64> {
        self.event_seq.subscribe()
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        if let Ok(mut q) = self.queue.batches.lock() {
            q.1 = true;
            self.queue.wake.notify_one();
        }
        if let Some(handle) = self.committer.lock().ok().and_then(|mut h| h.take()) {
            let _ = handle.join();
        }
    }
}

/// The committer: writes every queued batch in one transaction, then marks
/// them durable and publishes their events. Stops when asked and drained,
/// or at the first store failure (which stops the manager).
fn commit_loop(
    mut store: Store,
    queue: &CommitQueue,
    durable: &watch::Sender<Durable>,
    (events, event_seq): (&Mutex<EventLog>, &watch::Sender<u64>),
    deferred: Duration,
) {
    loop {
        let batches: Vec<Batch> = {
            let Ok(mut q) = queue.batches.lock() else {
                return;
            };
            while q.0.is_empty() && !q.1 {
                if store.stalled().is_none() {
                    q = match queue.wake.wait(q) {
                        Ok(q) => q,
                        Err(_) => return,
                    };
                    continue;
                }
                // Stalled: try to resume now and then (space may have come back).
                q = match queue.wake.wait_timeout(q, RESUME_EVERY) {
                    Ok((q, _)) => q,
                    Err(_) => return,
                };
                if q.0.is_empty() && store.try_resume() {
                    durable.send_modify(|d| {
                        d.stalled = None;
                        d.log_nearly_full = false;
                    });
                }
            }
            if q.0.is_empty() {
                return; // closing and drained
            }
            // Handles opened or closed that nobody waits for: give the next change a moment
            // to come and share the flush.
            let until = std::time::Instant::now() + deferred;
            while !q.1 && q.0.iter().all(|b| b.deferrable) {
                let now = std::time::Instant::now();
                if now >= until {
                    break;
                }
                q = match queue.wake.wait_timeout(q, until - now) {
                    Ok((q, _)) => q,
                    Err(_) => return,
                };
            }
            q.0.drain(..).collect()
        };
        let records: Vec<Record> = batches
            .iter()
            .flat_map(|b| b.records.iter().cloned())
            .collect();
        let last = batches.last().map_or(0, |b| b.seq);
        let fail = |e: StoreError| {
            let reason = e.to_string();
            tracing::error!(error = %reason, "commit to the store failed; refusing further requests until restart");
            durable.send_modify(|d| d.failed = Some(reason));
        };
        let logged = match store.log(&records) {
            Ok(logged) => logged,
            Err(e) => return fail(e),
        };
        // Durable now. Events first, so a caller that hears its change is
        // durable also finds the change's events.
        let evs: Vec<(u32, Event)> = batches.into_iter().flat_map(|b| b.events).collect();
        if !evs.is_empty() {
            publish(events, event_seq, evs);
        }
        durable.send_modify(|d| d.seq = last);
        if logged {
            // A failure is not fatal: the store stalls, the log has the records, and redb gets
            // them when it resumes.
            let _ = store.apply_logged(&records);
        }
        if let Some(reason) = store.stalled() {
            let nearly_full = store.log_room_below(1);
            let reason = reason.to_owned();
            durable.send_if_modified(|d| {
                let changed = d.stalled.as_deref() != Some(reason.as_str())
                    || d.log_nearly_full != nearly_full;
                d.stalled = Some(reason);
                d.log_nearly_full = nearly_full;
                changed
            });
        }
    }
}

/// Numbers events and appends them to their hosts' logs.
fn publish(events: &Mutex<EventLog>, event_seq: &watch::Sender<u64>, batch: Vec<(u32, Event)>) {
    let Ok(mut log) = events.lock() else {
        return;
    };
    let backlog = log.backlog;
    let mut last = 0;
    for (host, event) in batch {
        let sequence = log.next;
        log.next += 1;
        last = sequence;
        let region = match &event {
            Event::Released(b) => Some(b.ino),
            Event::Truncated(t) => Some(t.ino),
            Event::Revoked(r) => Some(r.ino),
            _ => None,
        };
        if let Some(region) = region {
            log.destructive.insert((host, region), sequence);
        }
        let queue = log.per_host.entry(host).or_default();
        queue.push_back(v1::HostEvent {
            sequence,
            event: Some(event),
        });
        let mut dropped = None;
        while queue.len() > backlog {
            dropped = queue.pop_front().map(|e| e.sequence);
        }
        if let Some(seq) = dropped {
            log.dropped.insert(host, seq);
        }
    }
    drop(log);
    event_seq.send_replace(last);
}

impl Manager {
    // ---- namespace ----

    /// Looks a name up; for a mount's lease session, with a lease on `parent`'s names when
    /// everyone may search it (only such directories' entries are cached by mounts), and one
    /// on the entry's attributes when no other mount or process has it open for writing.
    pub async fn lookup(&self, caller: &Caller, parent: u64, name: &str) -> Result<v1::Attr> {
        let snapshot = self.cache_leases.snapshot();
        let (mut attr, searchable, writers) = self
            .read(|s| {
                let attr = s.lookup(caller, parent, name).map(|i| s.attr(i))?;
                let writers = others_write(s, attr.ino, caller.lease_session);
                Ok((attr, s.inode(parent).is_ok_and(searchable_by_all), writers))
            })
            .await?;
        let session = caller.lease_session;
        self.grant_attrs(&mut attr, session, snapshot, writers);
        if searchable {
            attr.dir_lease = self
                .cache_leases
                .grant(Lease::Names(parent), session, snapshot, 0);
        }
        Ok(attr)
    }

    /// The mounts' cache leases.
    pub fn cache_leases(&self) -> &Arc<CacheLeases> {
        &self.cache_leases
    }

    /// Recalls `leases` (but `caller`'s own), for a change of what they cover.
    pub(crate) async fn recall(&self, caller: &Caller, leases: &[Lease]) -> BreakGuard {
        self.cache_leases.recall(leases, caller.lease_session).await
    }

    /// A lease on the attributes `attr` for `session`, for a state read after `snapshot`
    /// (none for a directory's, nor while someone else has the inode open for writing).
    fn grant_attrs(&self, attr: &mut v1::Attr, session: u64, snapshot: u64, writers: bool) {
        if !writers && !is_dir_attr(attr) {
            let digest = attr_digest(attr);
            attr.attr_lease =
                self.cache_leases
                    .grant(Lease::Attrs(attr.ino), session, snapshot, digest);
        }
    }

    /// Leases for `caller` on what its own change (under `guard`) left: the names of
    /// `parent` (when everyone may search it) and the attributes of the entry `attr`.
    fn grant_own(&self, guard: &BreakGuard, caller: &Caller, parent: u64, attr: &mut v1::Attr) {
        if !is_dir_attr(attr) {
            let digest = attr_digest(attr);
            attr.attr_lease = guard.grant(Lease::Attrs(attr.ino), caller.lease_session, digest);
        }
        let searchable = self
            .peek(|s| s.inode(parent).is_ok_and(searchable_by_all))
            .unwrap_or(false);
        if searchable {
            attr.dir_lease = guard.grant(Lease::Names(parent), caller.lease_session, 0);
        }
    }

    /// The leases a change of `ino`'s attributes recalls: its attributes, and for a
    /// directory whose permissions change, its names (who may look them up).
    fn attr_leases(&self, ino: u64, permissions: bool) -> Vec<Lease> {
        let is_dir = self
            .peek(|s| s.inode(ino).is_ok_and(|i| i.kind == Kind::Directory))
            .unwrap_or(false);
        if is_dir && permissions {
            vec![Lease::Attrs(ino), Lease::Names(ino)]
        } else {
            vec![Lease::Attrs(ino)]
        }
    }

    /// Recalls `fixed` and the leases `child` makes of the inodes the `children` names name,
    /// as they are once the recall is done: a name that meanwhile came to name another inode
    /// is recalled again (three times at most; past that, the change recalls after itself,
    /// see `apply_marking`). The caller changes them right after, with no wait between.
    async fn recall_with_children(
        &self,
        caller: &Caller,
        fixed: &[Lease],
        children: &[(u64, &str)],
        child: fn(u64) -> Lease,
    ) -> BreakGuard {
        let resolve = || -> Vec<Option<u64>> {
            children
                .iter()
                .map(|(parent, name)| self.child_ino(*parent, name))
                .collect()
        };
        let mut inos = resolve();
        let mut attempt = 0;
        loop {
            let mut leases = fixed.to_vec();
            leases.extend(inos.iter().flatten().map(|i| child(*i)));
            let guard = self.recall(caller, &leases).await;
            let now = resolve();
            attempt += 1;
            if now == inos || attempt == 3 {
                return guard;
            }
            inos = now;
        }
    }

    /// The inode `name` names in `parent`, if any.
    fn child_ino(&self, parent: u64, name: &str) -> Option<u64> {
        self.peek(|s| s.child(parent, name).map(|d| d.ino))
            .flatten()
    }

    /// Runs `f` on the state as it is now, durable or not (for choosing which leases to
    /// recall: a change that is not durable yet was recalled for by its own request).
    pub(crate) fn peek<T>(&self, f: impl FnOnce(&State) -> T) -> Option<T> {
        self.lock().ok().map(|inner| f(&inner.state))
    }

    /// The attributes of `ino`; for a mount's lease session, with a lease on them when no
    /// other mount or process has it open for writing.
    pub async fn getattr(&self, caller: &Caller, ino: u64) -> Result<v1::Attr> {
        let snapshot = self.cache_leases.snapshot();
        let (mut attr, writers) = self
            .read(|s| {
                let attr = s.inode(ino).map(|i| s.attr(i))?;
                Ok((attr, others_write(s, ino, caller.lease_session)))
            })
            .await?;
        self.grant_attrs(&mut attr, caller.lease_session, snapshot, writers);
        Ok(attr)
    }

    pub async fn mkdir(
        &self,
        caller: &Caller,
        parent: u64,
        name: &str,
        mode: u32,
    ) -> Result<v1::Attr> {
        let guard = self.recall(caller, &[Lease::Names(parent)]).await;
        let mut attr = self
            .write(|s| s.mkdir(caller, parent, name, mode).map(|i| s.attr(&i)))
            .await?;
        self.grant_own(&guard, caller, parent, &mut attr);
        Ok(attr)
    }

    pub async fn symlink(
        &self,
        caller: &Caller,
        parent: u64,
        name: &str,
        target: &[u8],
    ) -> Result<v1::Attr> {
        let guard = self.recall(caller, &[Lease::Names(parent)]).await;
        let mut attr = self
            .write(|s| {
                let i = s.symlink(caller, parent, name, target)?;
                guard.also(Lease::Attrs(i.ino));
                Ok(s.attr(&i))
            })
            .await?;
        self.grant_own(&guard, caller, parent, &mut attr);
        Ok(attr)
    }

    pub async fn readlink(&self, caller: &Caller, ino: u64) -> Result<Vec<u8>> {
        self.read(|s| s.readlink(caller, ino)).await
    }

    pub async fn link(
        &self,
        caller: &Caller,
        ino: u64,
        new_parent: u64,
        new_name: &str,
    ) -> Result<v1::Attr> {
        let guard = self
            .recall(caller, &[Lease::Names(new_parent), Lease::Attrs(ino)])
            .await;
        let mut attr = self
            .write(|s| {
                s.link(caller, ino, new_parent, new_name)
                    .map(|i| s.attr(&i))
            })
            .await?;
        self.grant_own(&guard, caller, new_parent, &mut attr);
        Ok(attr)
    }

    pub async fn make_node(
        &self,
        caller: &Caller,
        parent: u64,
        name: &str,
        kind: Kind,
        mode: u32,
        rdev: u64,
    ) -> Result<v1::Attr> {
        let guard = self.recall(caller, &[Lease::Names(parent)]).await;
        let mut attr = self
            .write(|s| {
                let i = s.make_node(caller, parent, name, kind, mode, rdev)?;
                guard.also(Lease::Attrs(i.ino));
                Ok(s.attr(&i))
            })
            .await?;
        self.grant_own(&guard, caller, parent, &mut attr);
        Ok(attr)
    }

    pub async fn rmdir(&self, caller: &Caller, parent: u64, name: &str) -> Result<()> {
        let _guard = self
            .recall_with_children(
                caller,
                &[Lease::Names(parent)],
                &[(parent, name)],
                Lease::Names,
            )
            .await;
        self.write(|s| s.rmdir(caller, parent, name)).await
    }

    /// Unlinks a name. Returns once the daemons no longer serve tokens granted through it
    /// (like every change that revokes capabilities, see `State::revoke_capabilities`).
    /// Removes a name; returns the inode and the names it has left.
    pub async fn unlink(&self, caller: &Caller, parent: u64, name: &str) -> Result<(u64, u32)> {
        let _guard = self
            .recall_with_children(
                caller,
                &[Lease::Names(parent)],
                &[(parent, name)],
                Lease::Attrs,
            )
            .await;
        let (removed, revoked) = self
            .write(|s| {
                s.revocation_queued = false;
                let removed = s.unlink(caller, parent, name)?;
                Ok((removed, std::mem::take(&mut s.revocation_queued)))
            })
            .await?;
        if revoked {
            self.settle_destructive().await;
        }
        Ok(removed)
    }

    pub async fn rename(
        &self,
        caller: &Caller,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        flags: u32,
    ) -> Result<()> {
        let _guard = self
            .recall_with_children(
                caller,
                &[Lease::Names(parent), Lease::Names(new_parent)],
                &[(parent, name), (new_parent, new_name)],
                Lease::Attrs,
            )
            .await;
        let revoked = self
            .write(|s| {
                s.revocation_queued = false;
                s.rename(caller, parent, name, new_parent, new_name, flags)?;
                Ok(std::mem::take(&mut s.revocation_queued))
            })
            .await?;
        // A name replaced may have ended an open region's last name (and its tokens).
        if revoked {
            self.settle_destructive().await;
        }
        Ok(())
    }

    pub async fn readdir(
        &self,
        caller: &Caller,
        ino: u64,
        offset: u64,
        limit: usize,
    ) -> Result<v1::ReadDirReply> {
        self.read(|s| {
            let (entries, end) = s.readdir(caller, ino, offset, limit)?;
            Ok(v1::ReadDirReply {
                entries: entries
                    .into_iter()
                    .map(|e| v1::DirEntry {
                        attr: Some(s.attr(e.inode)),
                        name: e.name,
                        offset: e.cookie,
                    })
                    .collect(),
                end,
            })
        })
        .await
    }

    pub async fn getxattr(&self, caller: &Caller, ino: u64, name: &str) -> Result<Vec<u8>> {
        self.read(|s| s.getxattr(caller, ino, name)).await
    }

    pub async fn listxattr(&self, caller: &Caller, ino: u64) -> Result<Vec<String>> {
        self.read(|s| s.listxattr(caller, ino)).await
    }

    pub async fn setxattr(
        &self,
        caller: &Caller,
        ino: u64,
        name: &str,
        value: &[u8],
        flags: u32,
    ) -> Result<()> {
        let leases = self.attr_leases(ino, true);
        let _guard = self.recall(caller, &leases).await;
        self.write(|s| s.setxattr(caller, ino, name, value, flags))
            .await
    }

    pub async fn removexattr(&self, caller: &Caller, ino: u64, name: &str) -> Result<()> {
        let leases = self.attr_leases(ino, true);
        let _guard = self.recall(caller, &leases).await;
        self.write(|s| s.removexattr(caller, ino, name)).await
    }

    pub async fn access(&self, caller: &Caller, ino: u64, mask: u32) -> Result<()> {
        self.read(|s| s.access(caller, ino, mask)).await
    }

    pub async fn statfs(&self) -> Result<v1::StatFsReply> {
        self.read(|s| {
            let stats = s.stats();
            // The object stores of small regions count too: their memory, less what the
            // regions stored there take.
            let (objects_total, objects_used) = s.object_space();
            Ok(v1::StatFsReply {
                total_bytes: stats.total_bytes + objects_total,
                free_bytes: stats.free_bytes + objects_total.saturating_sub(objects_used),
                inodes: s.inodes.len() as u64,
                free_inodes: u64::from(u32::MAX).saturating_sub(s.inodes.len() as u64),
                block_size: regions_proto::layout::CHUNK_SIZE as u32,
                max_name_len: crate::model::MAX_NAME_LEN as u32,
            })
        })
        .await
    }

    /// setattr: mode, owner, times, and size (which allocates or frees).
    pub async fn setattr(
        &self,
        caller: Caller,
        ino: u64,
        change: SetAttr,
        size: Option<u64>,
    ) -> Result<v1::Attr> {
        let permissions = change.mode.is_some() || change.uid.is_some() || change.gid.is_some();
        let leases = self.attr_leases(ino, permissions);
        let _guard = self.recall(&caller, &leases).await;
        let attr = self
            .write_allocating(move |s| {
                s.revocation_queued = false;
                if size.is_some() {
                    let inode = s.inode(ino)?;
                    if inode.kind == Kind::Directory {
                        return Err(ManagerError::IsDir(format!(
                            "inode {ino}; directories have no size to set"
                        )));
                    }
                    if change.through_write_handle {
                        s.check_write_or_handle(&caller, ino, "truncate this region")?;
                    } else {
                        crate::access::check(
                            &caller,
                            inode,
                            crate::access::WRITE,
                            "truncate this region",
                        )?;
                    }
                }
                // Validate the attribute change on a copy before resizing.
                let before = s.inode(ino)?.clone();
                let after = s.setattr(&caller, ino, &change)?;
                if let Some(size) = size
                    && let Err(e) = s.resize(ino, Some(size), 0, true)
                {
                    restore_inode(s, before);
                    return Err(e);
                }
                let _ = after;
                let revoked = std::mem::take(&mut s.revocation_queued);
                s.inode(ino).map(|i| (s.attr(i), revoked || size.is_some()))
            })
            .await?;
        let (attr, destructive) = attr;
        if destructive {
            // Chunks released, a tail zeroed, or tokens revoked (mode, owner, size): the
            // daemons apply it before the caller hears of it.
            self.settle_destructive().await;
        }
        Ok(attr)
    }

    /// Creates a region, allocating `preallocate` bytes (and a fixed address
    /// when FIXVADDR is inherited or asked for). All or nothing.
    pub async fn create(
        &self,
        caller: Caller,
        parent: u64,
        name: String,
        mode: u32,
        overrides: Option<v1::RegionAttrOverrides>,
        preallocate: u64,
    ) -> Result<v1::Attr> {
        let guard = self.recall(&caller, &[Lease::Names(parent)]).await;
        let mut attr = self
            .write_allocating(|s| {
                let parent_before = s.inode(parent)?.clone();
                let inode = s.create_entry(&caller, parent, &name, mode, overrides.as_ref())?;
                guard.also(Lease::Attrs(inode.ino));
                if (preallocate > 0 || inode.attrs.fixvaddr)
                    && let Err(e) = s.resize(inode.ino, None, preallocate, false)
                {
                    undo_create(s, parent_before, &name, inode.ino);
                    return Err(e);
                }
                s.inode(inode.ino).map(|i| s.attr(i))
            })
            .await?;
        self.grant_own(&guard, &caller, parent, &mut attr);
        Ok(attr)
    }

    /// Creates a region and opens it in one durable change (see
    /// [`Manager::create`] and [`Manager::open_region`]). Space allocated
    /// up front counts as reserved by the opener: it is freed at the last
    /// writer's close unless the size grew into it.
    #[allow(clippy::too_many_arguments)]
    pub async fn create_open(
        &self,
        caller: Caller,
        parent: u64,
        name: String,
        mode: u32,
        overrides: Option<v1::RegionAttrOverrides>,
        preallocate: u64,
        write: bool,
    ) -> Result<v1::RegionInfo> {
        let guard = self.recall(&caller, &[Lease::Names(parent)]).await;
        // A writer's space up front may be an object, allocated for the inode number the
        // create will take and recorded in the create's own change.
        // Only for a create that may succeed: a refused one (no right to the directory, the
        // name taken) costs the daemon no object.
        let may_create = || {
            self.peek(|s| s.check_new_entry(&caller, parent, &name).is_ok())
                .unwrap_or(false)
        };
        let object = if write && preallocate > 0 && may_create() {
            self.object_for_create(&caller).await
        } else {
            None
        };
        let created = self
            .write_allocating(|s| {
                let parent_before = s.inode(parent)?.clone();
                s.objects.preset_ino = object.map(|(ino, _)| ino);
                let inode = s.create_entry(&caller, parent, &name, mode, overrides.as_ref());
                s.objects.preset_ino = None;
                let inode = inode?;
                guard.also(Lease::Attrs(inode.ino));
                let ino = inode.ino;
                let small = s.small_object_bytes();
                let as_object = object.is_some_and(|(preset, placement)| {
                    preset == ino && s.place_object(ino, placement, small)
                });
                let preallocate = if as_object { 0 } else { preallocate };
                let opened = if preallocate > 0 || inode.attrs.fixvaddr {
                    s.resize(ino, None, preallocate, false)
                } else {
                    Ok(())
                }
                .and_then(|()| s.open_region(&caller, ino, write));
                let handle = match opened {
                    Ok(h) => h,
                    Err(e) => {
                        undo_create(s, parent_before, &name, ino);
                        return Err(e);
                    }
                };
                if preallocate > 0 {
                    s.note_reserved(ino);
                }
                let mut info = s.region_info(ino, None)?;
                info.handle = handle.id;
                Ok(info)
            })
            .await;
        if let Some((ino, placement)) = object {
            let taken = created
                .as_ref()
                .is_ok_and(|i| i.object.is_some() && i.attr.as_ref().is_some_and(|a| a.ino == ino));
            if !taken {
                self.free_unplaced(ino, placement).await;
            }
        }
        let mut info = created?;
        if let Some(attr) = info.attr.as_mut() {
            self.grant_own(&guard, &caller, parent, attr);
        }
        // A new region: only events for every region can concern it.
        self.settle_destructive_for(info.attr.as_ref().map_or(0, |a| a.ino))
            .await;
        Ok(info)
    }

    // ---- regions ----

    pub async fn open_region(
        &self,
        caller: &Caller,
        ino: u64,
        write: bool,
    ) -> Result<v1::RegionInfo> {
        // A writer changes the attributes others cache (size, times) from now until its close.
        let _guard = if write {
            Some(self.recall(caller, &[Lease::Attrs(ino)]).await)
        } else {
            None
        };
        let snapshot = self.cache_leases.snapshot();
        let (mut info, writers) = self
            .write_handles(|s| {
                let handle = s.open_region(caller, ino, write)?;
                let mut info = s.region_info(ino, None)?;
                info.handle = handle.id;
                Ok((info, others_write(s, ino, caller.lease_session)))
            })
            .await?;
        // A reader's mount may open the region again without asking while this lease holds
        // (docs/SEMANTICS.md, "Cache leases").
        if !write && let Some(attr) = info.attr.as_mut() {
            self.grant_attrs(attr, caller.lease_session, snapshot, writers);
        }
        self.settle_destructive_for(ino).await;
        Ok(info)
    }

    /// Grows a region to at least `size` bytes, with chunks allocated for
    /// at least `capacity` bytes; with `touch`, sets mtime and ctime to now.
    pub async fn extend(&self, caller: Caller, ino: u64, grow: Extend) -> Result<v1::RegionInfo> {
        let _guard = self.recall(&caller, &[Lease::Attrs(ino)]).await;
        if !grow.chunks {
            self.place_small(&caller, ino, grow.size, grow.capacity)
                .await?;
        }
        // A writer publishing its size: its object (placed for the limit) fitted to it; a
        // write that outgrows its object within the limit: an object of the limit.
        let fit = if grow.chunks {
            None
        } else if grow.capacity == 0 {
            self.fit_object(&caller, ino, grow.size).await
        } else {
            self.grow_object(&caller, ino, grow.size.max(grow.capacity))
                .await
        };
        let fitted = std::sync::atomic::AtomicBool::new(false);
        let info = self
            .write_allocating(|s| {
                let only_move = grow.chunks && grow.size == 0 && grow.capacity == 0 && !grow.touch;
                if only_move {
                    // Moving a small region to chunks changes no byte: a reader may ask (to
                    // map it).
                    s.check_path(&caller, ino)?;
                    crate::access::check(
                        &caller,
                        s.region(ino)?,
                        crate::access::READ,
                        "move this region to chunks",
                    )?;
                } else {
                    s.check_write_or_handle(&caller, ino, "extend this region")?;
                }
                if let Some(fit) = fit {
                    let swapped = s.swap_object(ino, fit);
                    fitted.fetch_or(swapped, std::sync::atomic::Ordering::Relaxed);
                }
                let size = grow.size.max(s.region(ino)?.size);
                s.resize_to(ino, size, size.max(grow.capacity), false, grow.chunks)?;
                if grow.capacity > size {
                    s.note_reserved(ino);
                }
                if grow.touch {
                    s.touch(ino)?;
                }
                s.region_info(ino, None)
            })
            .await;
        if let Some(fit) = fit {
            let taken = fitted.load(std::sync::atomic::Ordering::Relaxed);
            self.end_fit(ino, fit, taken).await;
        }
        let info = self.after_object_change(ino, info?).await?;
        self.settle_destructive_for(ino).await;
        Ok(info)
    }

    /// Does the object work a change queued; when it moved region `ino` to chunks, the
    /// region's info after the move instead of `info`.
    /// A move its chunks' daemon refused for want of room fails the request with `ENOSPC`
    /// (the move is tried again, and the region's writers wait for it meanwhile).
    async fn after_object_change(&self, ino: u64, info: v1::RegionInfo) -> Result<v1::RegionInfo> {
        self.object_work_of(Some(ino)).await;
        if info.object.as_ref().is_some_and(|o| o.moving) {
            let info = self.read(|s| s.region_info(ino, None)).await?;
            if info.object.as_ref().is_some_and(|o| o.moving)
                && let Some(Some(why)) = self.peek(|s| s.objects.move_refusals.get(&ino).cloned())
            {
                return Err(ManagerError::NoSpace(format!(
                    "region {ino} must move from its object to chunks, and the host refused \
                     them ({why}): free memory or open files there, or delete regions"
                )));
            }
            return Ok(info);
        }
        Ok(info)
    }

    /// Counts one namespace or region request.
    pub fn count_file_request(&self) {
        self.file_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets a region's size.
    pub async fn truncate(&self, caller: Caller, ino: u64, size: u64) -> Result<v1::RegionInfo> {
        let _guard = self.recall(&caller, &[Lease::Attrs(ino)]).await;
        let info = self
            .write_allocating(move |s| {
                s.check_write_or_handle(&caller, ino, "truncate this region")?;
                s.resize(ino, Some(size), 0, true)?;
                s.region_info(ino, None)
            })
            .await?;
        let info = self.after_object_change(ino, info).await?;
        self.settle_destructive_for(ino).await;
        Ok(info)
    }

    pub async fn get_map(
        &self,
        caller: &Caller,
        ino: u64,
        known_version: u64,
    ) -> Result<v1::RegionInfo> {
        let info = self
            .read(|s| {
                let inode = s.region(ino)?;
                s.check_path(caller, ino)?;
                crate::access::check(
                    caller,
                    inode,
                    crate::access::READ,
                    "read the map of this region",
                )?;
                s.region_info(ino, Some(known_version))
            })
            .await?;
        self.settle_destructive_for(ino).await;
        Ok(info)
    }

    /// Closes a handle; see [`State::close_handle`] for `wrote_within_size`.
    pub async fn close(
        &self,
        caller: &Caller,
        handle: u64,
        wrote_within_size: bool,
    ) -> Result<bool> {
        // A reader's close changes nothing others cache, unless it frees an unlinked region
        // (mounts reading it under a lease take handles first); a writer's may (the size, the
        // times).
        let written = self
            .peek(|s| {
                s.handles
                    .get(&handle)
                    .filter(|h| h.write || s.inode(h.ino).is_ok_and(|i| i.nlink == 0))
                    .map(|h| h.ino)
            })
            .flatten();
        let _guard = match written {
            Some(ino) => Some(self.recall(caller, &[Lease::Attrs(ino)]).await),
            None => None,
        };
        let freed = self
            .write_handles(|s| s.close_handle(caller, handle, wrote_within_size))
            .await;
        if let Some(ino) = written {
            self.object_work_of(Some(ino)).await;
        }
        freed
    }

    // ---- cluster ----

    pub async fn register_host(&self, r: &HostRegistration) -> Result<(u64, Vec<v1::PoolRecord>)> {
        // A new incarnation lost its memory: its regions are marked lost in the same change,
        // before its daemon can ask which chunks to back (crate::lifetime).
        let (restarted, lost) = self
            .write_for_liveness(|s| {
                let restarted = s.register_host(r)?;
                let lost = match restarted {
                    Some(previous) => s.mark_lost_on(
                        r.host_id,
                        &format!(
                            "its data was at host {}, whose daemon restarted (incarnation {previous:#x} -> {:#x}) and lost its memory",
                            r.host_id, r.incarnation
                        ),
                    ),
                    None => Vec::new(),
                };
                Ok((restarted, lost))
            })
            .await?;
        if let Some(previous) = restarted {
            tracing::warn!(
                host = r.host_id,
                previous,
                incarnation = r.incarnation,
                lost = ?lost,
                "daemon restarted: memory of its previous incarnation is gone; its regions are marked lost (EIO until unlinked)"
            );
        }
        self.read(|s| {
            let pools = s
                .alloc
                .host_pools(r.host_id)
                .filter_map(|p| s.pool_record(p.pool.gid))
                .collect();
            Ok((s.lease.as_millis() as u64, pools))
        })
        .await
    }

    pub async fn heartbeat(&self, host: u32, incarnation: u64) -> Result<u64> {
        // Leases are not stored: no commit needed (so also while the store is stalled), but
        // use a write for the lock.
        self.write_unchecked(|s| {
            s.heartbeat(host, incarnation)
                .map(|()| s.lease.as_millis() as u64)
        })
        .await
    }

    pub async fn register_pool(&self, host: u32, gid: u32, size: u64) -> Result<v1::PoolRecord> {
        let record = self
            .write_for_liveness(|s| {
                let pool = s.register_pool(host, gid, size)?;
                s.pool_record(pool.gid)
                    .ok_or_else(|| ManagerError::NotFound(format!("pool {}", pool.gid)))
            })
            .await?;
        tracing::info!(
            host,
            gid = record.gid,
            size = record.size,
            "pool registered"
        );
        self.pool_added.notify_waiters();
        Ok(record)
    }

    pub async fn list_hosts(&self) -> Result<Vec<v1::HostRecord>> {
        self.read(|s| Ok(s.hosts.values().map(|h| s.host_record(h)).collect()))
            .await
    }

    pub async fn list_pools(&self, host: u32) -> Result<Vec<v1::PoolRecord>> {
        self.read(|s| {
            Ok(s.alloc
                .pools()
                .filter(|p| host == 0 || p.pool.host_id == host)
                .filter_map(|p| s.pool_record(p.pool.gid))
                .collect())
        })
        .await
    }

    pub async fn pool_chunks(&self, gid: u32) -> Result<v1::PoolChunksReply> {
        // The sequence is read under the state lock, so every event up to it
        // is reflected in the chunks (events are published after commit).
        self.read(|s| {
            Ok(v1::PoolChunksReply {
                chunks: s.pool_chunks(gid)?,
                sequence: self.current_sequence(),
                revoked: s.revoked.current(),
            })
        })
        .await
    }

    pub async fn stats(&self) -> Result<v1::StatsReply> {
        let mut stats = self.read(|s| Ok(s.stats())).await?;
        stats.file_requests = self
            .file_requests
            .load(std::sync::atomic::Ordering::Relaxed);
        stats.cache_lease_sessions = self.cache_leases.live_sessions();
        Ok(stats)
    }
}

/// Whether everyone may search directory `inode` (mounts cache only such directories'
/// entries).
fn searchable_by_all(inode: &Inode) -> bool {
    inode.kind == Kind::Directory && inode.mode & 0o111 == 0o111
}

/// Whether anyone but mount session `session` (whose kernel knows its own writes) has `ino`
/// open for writing: its attributes may change under a lease then.
fn others_write(s: &State, ino: u64, session: u64) -> bool {
    s.handles_of(ino)
        .any(|h| h.write && (session == 0 || s.write_sessions.get(&h.id) != Some(&session)))
}

/// Whether `attr` is a directory's (whose attributes mounts cache for the default second).
fn is_dir_attr(attr: &v1::Attr) -> bool {
    attr.kind == v1::FileKind::Directory as i32
}

/// Undoes the creation of region `ino` as `name` in the directory that
/// was `parent_before`: a region must not exist half made.
fn undo_create(s: &mut State, parent_before: Inode, name: &str, ino: u64) {
    s.remove_entry(parent_before.ino, name);
    s.maps.remove(&ino);
    s.inodes.remove(&ino);
    restore_inode(s, parent_before);
}

/// Puts back an inode as it was before a refused change.
fn restore_inode(s: &mut State, inode: Inode) {
    s.put_inode(inode);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use regions_proto::layout::CHUNK_SIZE;

    use super::*;
    use crate::model::ROOT_INO;

    const MIB: u64 = 1 << 20;

    fn config() -> Config {
        Config {
            lease: Duration::from_secs(60),
            grow_timeout: Duration::from_secs(2),
            ..Config::default()
        }
    }

    fn user(host: u32) -> Caller {
        Caller {
            uid: 1000,
            gid: 1000,
            groups: vec![],
            pid: 42,
            host_id: host,
            by_inode: false,
            lease_session: 0,
        }
    }

    async fn add_host(m: &Manager, host: u32, offered: u64, pool: u64) {
        m.register_host(&HostRegistration {
            host_id: host,
            transport_addr: format!("127.0.0.1:{}", 7000 + host),
            agent_socket: String::new(),
            memory_offered: offered,
            incarnation: 1,
            transports: String::new(),
            object_memory: 0,
        })
        .await
        .unwrap();
        if pool > 0 {
            m.register_pool(host, 0, pool).await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_reply_waits_for_the_destructive_events_of_its_own_region_only() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::open(dir.path(), config()).unwrap();
        add_host(&m, 1, 16 * MIB, 16 * MIB).await;
        let a = m
            .create(user(1), ROOT_INO, "a".into(), 0o644, None, 4 * CHUNK_SIZE)
            .await
            .unwrap();
        let b = m
            .create(user(1), ROOT_INO, "b".into(), 0o644, None, CHUNK_SIZE)
            .await
            .unwrap();
        // Shrink a: chunks released and its tail zeroed, by a daemon that has not said so yet.
        m.write(|s| s.resize(a.ino, Some(CHUNK_SIZE + 100), 0, true))
            .await
            .unwrap();
        let pending = m.unsettled(Some(a.ino));
        assert!(!pending.is_empty(), "a's events are pending");
        assert_eq!(m.unsettled(None), pending);
        assert!(m.unsettled(Some(b.ino)).is_empty(), "none of them is b's");
        // b's replies do not wait for them (the wait would be SETTLE_TIMEOUT).
        let info = tokio::time::timeout(SETTLE_TIMEOUT / 2, m.open_region(&user(1), b.ino, true))
            .await
            .expect("b's open waits for no event of a")
            .unwrap();
        assert_eq!(info.attr.unwrap().ino, b.ino);
        let newest = pending.iter().map(|(_, seq)| *seq).max().unwrap();
        m.events_applied(1, newest).unwrap();
        assert!(m.unsettled(Some(a.ino)).is_empty() && m.unsettled(None).is_empty());
        assert!(
            m.events.lock().unwrap().destructive.is_empty(),
            "applied events are forgotten"
        );
    }

    #[tokio::test]
    async fn a_handle_change_nobody_waits_for_shares_the_next_commit() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            deferred_commit: Duration::from_secs(3600),
            ..config()
        };
        let (r, kept) = {
            let m = Manager::open(dir.path(), cfg.clone()).unwrap();
            add_host(&m, 1, 16 * MIB, 16 * MIB).await;
            let r = m
                .create(user(1), ROOT_INO, "r".into(), 0o644, None, MIB)
                .await
                .unwrap();
            let durable = m.durable.borrow().seq;
            let opened = m.open_region(&user(1), r.ino, false).await.unwrap();
            // (Stored on its own, it would be durable well within this.)
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(
                m.durable.borrow().seq,
                durable,
                "the open answered and waits for company"
            );
            // The next change is stored with it, at once.
            let again = m.open_region(&user(1), r.ino, false).await.unwrap();
            m.mkdir(&user(1), ROOT_INO, "d", 0o755).await.unwrap();
            assert!(m.durable.borrow().seq >= durable + 3);
            m.close(&user(1), again.handle, false).await.unwrap();
            // Dropped (a clean stop): the close waiting for company is stored too.
            (r.ino, opened.handle)
        };
        let m = Manager::open(dir.path(), cfg).unwrap();
        assert_eq!(m.stats().await.unwrap().open_handles, 1);
        assert!(!m.close(&user(1), kept, false).await.unwrap());
        assert_eq!(m.lookup(&user(1), ROOT_INO, "r").await.unwrap().ino, r);
    }

    #[tokio::test]
    async fn acknowledged_changes_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (region, vaddr, map) = {
            let m = Manager::open(dir.path(), config()).unwrap();
            add_host(&m, 1, 64 * MIB, 64 * MIB).await;
            let d = m.mkdir(&user(1), ROOT_INO, "dir", 0o750).await.unwrap();
            m.setxattr(&user(1), d.ino, "user.regions.fixvaddr", b"1", 0)
                .await
                .unwrap();
            m.setxattr(&user(1), d.ino, "user.colour", b"blue", 0)
                .await
                .unwrap();
            let r = m
                .create(user(1), d.ino, "r".into(), 0o640, None, 3 * MIB)
                .await
                .unwrap();
            let grow = Extend {
                size: 5 * MIB + 1,
                ..Extend::default()
            };
            let info = m.extend(user(1), r.ino, grow).await.unwrap();
            m.open_region(&user(1), r.ino, true).await.unwrap();
            m.mkdir(&user(1), ROOT_INO, "gone", 0o755).await.unwrap();
            m.rmdir(&user(1), ROOT_INO, "gone").await.unwrap();
            (r.ino, info.attr.unwrap().vaddr, info.map)
        };
        let m = Manager::open(dir.path(), config()).unwrap();
        let d = m.lookup(&user(1), ROOT_INO, "dir").await.unwrap();
        assert_eq!(d.mode, 0o750);
        assert_eq!(
            m.getxattr(&user(1), d.ino, "user.colour").await.unwrap(),
            b"blue"
        );
        let r = m.lookup(&user(1), d.ino, "r").await.unwrap();
        assert_eq!(r.ino, region);
        assert_eq!(r.size, 5 * MIB + 1);
        assert_eq!(r.vaddr, vaddr);
        assert!(r.region_attrs.unwrap().fixvaddr);
        let info = m.get_map(&user(1), region, 0).await.unwrap();
        assert_eq!(info.map, map);
        assert_eq!(
            m.lookup(&user(1), ROOT_INO, "gone")
                .await
                .unwrap_err()
                .errno(),
            libc::ENOENT
        );
        assert_eq!(m.stats().await.unwrap().open_handles, 1);
        // Pool free space was rebuilt from the stored maps.
        let pools = m.list_pools(1).await.unwrap();
        assert_eq!(pools[0].free, 64 * MIB - map.len() as u64 * CHUNK_SIZE);
        // New inode numbers do not reuse old ones.
        let n = m.mkdir(&user(1), ROOT_INO, "new", 0o755).await.unwrap();
        assert!(n.ino > region);
    }

    #[tokio::test]
    async fn links_and_special_files_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (region, fifo) = {
            let m = Manager::open(dir.path(), config()).unwrap();
            add_host(&m, 1, 16 * MIB, 16 * MIB).await;
            let d = m.mkdir(&user(1), ROOT_INO, "d", 0o755).await.unwrap();
            let r = m
                .create(user(1), d.ino, "r".into(), 0o640, None, MIB)
                .await
                .unwrap();
            m.link(&user(1), r.ino, ROOT_INO, "r2").await.unwrap();
            m.link(&user(1), r.ino, ROOT_INO, "r3").await.unwrap();
            m.unlink(&user(1), d.ino, "r").await.unwrap();
            m.symlink(&user(1), ROOT_INO, "l", b"d/../r2")
                .await
                .unwrap();
            let p = m
                .make_node(&user(1), d.ino, "p", Kind::Fifo, 0o600, 0)
                .await
                .unwrap();
            m.make_node(
                &Caller::root(1),
                d.ino,
                "null",
                Kind::CharDevice,
                0o666,
                0x103,
            )
            .await
            .unwrap();
            (r.ino, p.ino)
        };
        let m = Manager::open(dir.path(), config()).unwrap();
        let r2 = m.lookup(&user(1), ROOT_INO, "r2").await.unwrap();
        let r3 = m.lookup(&user(1), ROOT_INO, "r3").await.unwrap();
        assert_eq!((r2.ino, r3.ino, r2.nlink), (region, region, 2));
        assert_eq!(r2.allocated, MIB, "the region kept its memory");
        let l = m.lookup(&user(1), ROOT_INO, "l").await.unwrap();
        assert_eq!(l.kind(), v1::FileKind::Symlink);
        assert_eq!(m.readlink(&user(1), l.ino).await.unwrap(), b"d/../r2");
        let d = m.lookup(&user(1), ROOT_INO, "d").await.unwrap();
        let p = m.lookup(&user(1), d.ino, "p").await.unwrap();
        assert_eq!((p.ino, p.kind(), p.mode), (fifo, v1::FileKind::Fifo, 0o600));
        let null = m.lookup(&user(1), d.ino, "null").await.unwrap();
        assert_eq!((null.kind(), null.rdev), (v1::FileKind::CharDevice, 0x103));
        m.unlink(&user(1), ROOT_INO, "r2").await.unwrap();
        m.unlink(&user(1), ROOT_INO, "r3").await.unwrap();
        assert_eq!(
            m.getattr(&Caller::root(1), region)
                .await
                .unwrap_err()
                .errno(),
            libc::ENOENT,
            "freed with its last name after the restart"
        );
    }

    #[tokio::test]
    async fn unlinked_open_regions_are_freed_after_a_restart_without_handles() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = Manager::open(dir.path(), config()).unwrap();
            add_host(&m, 1, 16 * MIB, 16 * MIB).await;
            let r = m
                .create(user(1), ROOT_INO, "r".into(), 0o644, None, 4 * MIB)
                .await
                .unwrap();
            let info = m.open_region(&user(1), r.ino, false).await.unwrap();
            m.unlink(&user(1), ROOT_INO, "r").await.unwrap();
            // Closing the handle would free it; pretend the client vanished
            // and the handle was dropped by hand while the manager was down.
            m.write(|s| {
                s.handles.remove(&info.handle);
                s.open.remove(&r.ino);
                s.dirty.handles.insert(info.handle);
                Ok(())
            })
            .await
            .unwrap();
        }
        let m = Manager::open(dir.path(), config()).unwrap();
        assert_eq!(m.list_pools(1).await.unwrap()[0].free, 16 * MIB);
    }

    #[tokio::test]
    async fn a_handle_stored_with_a_later_change_keeps_an_unlinked_region_and_numbers_never_repeat()
    {
        let dir = tempfile::tempdir().unwrap();
        let (ino, first) = {
            let m = Manager::open(dir.path(), config()).unwrap();
            add_host(&m, 1, 16 * MIB, 16 * MIB).await;
            let r = m
                .create(user(1), ROOT_INO, "r".into(), 0o644, None, 4 * MIB)
                .await
                .unwrap();
            // The open answers without waiting for its own commit; the
            // unlink, which waits, stores it too.
            let info = m.open_region(&user(1), r.ino, false).await.unwrap();
            m.unlink(&user(1), ROOT_INO, "r").await.unwrap();
            (r.ino, info.handle)
        };
        let m = Manager::open(dir.path(), config()).unwrap();
        assert_eq!(
            m.list_pools(1).await.unwrap()[0].free,
            12 * MIB,
            "the unlinked region lives on: its open handle was stored"
        );
        assert_eq!(m.stats().await.unwrap().open_handles, 1);
        // A handle number from before the restart is never handed out again.
        let r2 = m
            .create(user(1), ROOT_INO, "r2".into(), 0o644, None, 0)
            .await
            .unwrap();
        let again = m.open_region(&user(1), r2.ino, false).await.unwrap();
        assert!(
            again.handle > first + HANDLE_ID_GAP - 1,
            "{} vs {first}",
            again.handle
        );
        assert!(
            m.close(&user(1), first, false).await.unwrap(),
            "closing frees {ino}"
        );
        assert_eq!(m.list_pools(1).await.unwrap()[0].free, 16 * MIB);
    }

    #[tokio::test]
    async fn create_is_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::open(dir.path(), config()).unwrap();
        add_host(&m, 1, 4 * MIB, 4 * MIB).await;
        let err = m
            .create(user(1), ROOT_INO, "big".into(), 0o644, None, 5 * MIB)
            .await
            .unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC);
        assert_eq!(
            m.lookup(&user(1), ROOT_INO, "big")
                .await
                .unwrap_err()
                .errno(),
            libc::ENOENT
        );
        assert_eq!(m.list_pools(1).await.unwrap()[0].free, 4 * MIB);
        drop(m);
        let m = Manager::open(dir.path(), config()).unwrap();
        assert_eq!(
            m.lookup(&user(1), ROOT_INO, "big")
                .await
                .unwrap_err()
                .errno(),
            libc::ENOENT
        );
        assert_eq!(
            m.readdir(&user(1), ROOT_INO, 0, 10)
                .await
                .unwrap()
                .entries
                .len(),
            0
        );
    }

    #[tokio::test]
    async fn create_open_is_one_change_and_its_reservation_goes_at_close() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::open(dir.path(), config()).unwrap();
        add_host(&m, 1, 4 * MIB, 4 * MIB).await;
        // Out of memory: no entry, no handle, nothing allocated.
        let err = m
            .create_open(user(1), ROOT_INO, "big".into(), 0o644, None, 5 * MIB, true)
            .await
            .unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC);
        assert_eq!(
            m.lookup(&user(1), ROOT_INO, "big")
                .await
                .unwrap_err()
                .errno(),
            libc::ENOENT
        );
        assert_eq!(m.stats().await.unwrap().open_handles, 0);
        // A writer's first chunk comes with the open and goes at its close
        // when nothing was written.
        let info = m
            .create_open(user(1), ROOT_INO, "r".into(), 0o644, None, CHUNK_SIZE, true)
            .await
            .unwrap();
        assert_eq!(info.map.len(), 1);
        assert_eq!(info.attr.as_ref().unwrap().size, 0);
        assert_eq!(m.list_pools(1).await.unwrap()[0].free, 4 * MIB - CHUNK_SIZE);
        m.close(&user(1), info.handle, false).await.unwrap();
        assert_eq!(m.list_pools(1).await.unwrap()[0].free, 4 * MIB);
        // Reserved space a writer published into stays.
        let ino = info.attr.unwrap().ino;
        let opened = m.open_region(&user(1), ino, true).await.unwrap();
        let grow = Extend {
            size: 0,
            capacity: 2 * MIB,
            touch: false,
            chunks: false,
        };
        m.extend(user(1), ino, grow).await.unwrap();
        let publish = Extend {
            size: MIB + 1,
            capacity: 0,
            touch: true,
            chunks: false,
        };
        let after = m.extend(user(1), ino, publish).await.unwrap();
        assert_eq!(after.attr.unwrap().size, MIB + 1);
        m.close(&user(1), opened.handle, false).await.unwrap();
        let chunks = (MIB + 1).div_ceil(CHUNK_SIZE);
        assert_eq!(
            m.list_pools(1).await.unwrap()[0].free,
            4 * MIB - chunks * CHUNK_SIZE,
            "chunks past the published size are freed at the last writer's close"
        );
    }

    #[tokio::test]
    async fn truncate_through_setattr_needs_write_and_fails_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::open(dir.path(), config()).unwrap();
        add_host(&m, 1, 4 * MIB, 4 * MIB).await;
        let r = m
            .create(user(1), ROOT_INO, "r".into(), 0o644, None, 0)
            .await
            .unwrap();
        let other = Caller {
            uid: 2000,
            ..user(1)
        };
        let err = m
            .setattr(other, r.ino, SetAttr::default(), Some(MIB))
            .await
            .unwrap_err();
        assert_eq!(err.errno(), libc::EACCES);
        let chmod = SetAttr {
            mode: Some(0o600),
            ..SetAttr::default()
        };
        let err = m
            .setattr(user(1), r.ino, chmod.clone(), Some(64 * MIB))
            .await
            .unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC);
        assert_eq!(
            m.getattr(&Caller::root(1), r.ino).await.unwrap().mode,
            0o644,
            "mode change rolled back with the size"
        );
        let a = m.setattr(user(1), r.ino, chmod, Some(MIB)).await.unwrap();
        assert_eq!((a.mode, a.size, a.allocated), (0o600, MIB, MIB));
    }

    #[tokio::test]
    async fn a_short_host_is_asked_for_a_pool() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::open(dir.path(), config()).unwrap();
        add_host(&m, 1, 64 * MIB, 2 * MIB).await;
        let start = m.current_sequence();
        // A stand-in daemon: adds a pool when asked.
        let daemon = {
            let m = Arc::clone(&m);
            let mut wake = m.subscribe_events();
            tokio::spawn(async move {
                let mut cursor = start;
                loop {
                    for e in m.events_after(1, cursor).unwrap() {
                        cursor = e.sequence;
                        if let Some(Event::GrowPool(bytes)) = e.event {
                            m.register_pool(1, 0, bytes.max(8 * MIB)).await.unwrap();
                            return bytes;
                        }
                    }
                    if wake.changed().await.is_err() {
                        return 0;
                    }
                }
            })
        };
        let r = m
            .create(user(1), ROOT_INO, "r".into(), 0o644, None, 6 * MIB)
            .await
            .unwrap();
        assert_eq!(r.allocated, 6 * MIB);
        assert_eq!(daemon.await.unwrap(), 4 * MIB);
        assert_eq!(m.list_pools(1).await.unwrap().len(), 2);
        // Beyond what the host offers: a clean ENOSPC, without asking.
        let err = m
            .create(user(1), ROOT_INO, "huge".into(), 0o644, None, 128 * MIB)
            .await
            .unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC);
    }

    #[tokio::test]
    async fn a_daemon_that_never_adds_a_pool_gives_enospc_in_bounded_time() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            grow_timeout: Duration::from_millis(200),
            ..config()
        };
        let m = Manager::open(dir.path(), cfg).unwrap();
        add_host(&m, 1, 64 * MIB, 2 * MIB).await;
        let t = std::time::Instant::now();
        let err = m
            .create(user(1), ROOT_INO, "r".into(), 0o644, None, 6 * MIB)
            .await
            .unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC);
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(
            m.lookup(&user(1), ROOT_INO, "r").await.unwrap_err().errno(),
            libc::ENOENT
        );
    }

    #[tokio::test]
    async fn daemons_see_their_events_in_order_and_resync_when_needed() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::open(dir.path(), config()).unwrap();
        add_host(&m, 1, 16 * MIB, 16 * MIB).await;
        add_host(&m, 2, 16 * MIB, 16 * MIB).await;
        let start = m.current_sequence();
        let r = m
            .create(user(1), ROOT_INO, "r".into(), 0o644, None, MIB)
            .await
            .unwrap();
        m.truncate(user(1), r.ino, 0).await.unwrap();
        let events = m.events_after(1, start).unwrap();
        assert_eq!(events.len(), 2);
        assert!(events[0].sequence < events[1].sequence);
        assert!(
            matches!(events[0].event, Some(Event::Assigned(ref b)) if b.ino == r.ino && b.len == MIB)
        );
        assert!(matches!(events[1].event, Some(Event::Released(_))));
        assert!(m.events_after(2, start).unwrap().is_empty());
        assert!(m.events_after(1, events[1].sequence).unwrap().is_empty());
        // A sequence from an earlier manager run must resync.
        assert_eq!(m.events_after(1, 5).unwrap_err().errno(), libc::EINVAL);
        // PoolChunks reflects state at its sequence.
        let r2 = m
            .create(user(1), ROOT_INO, "r2".into(), 0o644, None, MIB)
            .await
            .unwrap();
        let gid = m.list_pools(1).await.unwrap()[0].gid;
        let chunks = m.pool_chunks(gid).await.unwrap();
        assert_eq!(chunks.chunks.len(), 1);
        assert_eq!(chunks.chunks[0].ino, r2.ino);
        assert!(m.events_after(1, chunks.sequence).unwrap().is_empty());
    }
}
