//! The mount's cache-lease session (see `crate::cache_leases`): one thread keeps it with the
//! manager and answers each recall once the kernel has forgotten what it cached under the
//! lease; another renews it every quarter term.

use std::sync::Weak;

use regions::manager_client::cluster::{CacheLeaseStream, LeaseStreamNext};

use super::*;
use crate::cache_leases::Covered;

/// How long a recall of a directory's names waits for the kernel to drop the entries before
/// it answers anyway: the kernel holds a directory's lock while this mount's own change in
/// it waits at the manager (possibly for this very answer), and the drop needs that lock. It
/// completes once the change is answered.
const NAMES_DROP_WAIT: Duration = Duration::from_millis(100);

/// Entries handed to the kernel under a names lease, kept by inode (see
/// [`RegionFs::leased_entry`]) at most.
const LEASED_ENTRIES_KEPT: usize = 1 << 16;

/// Pause before a new session after one ended.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// Renewals per term.
const RENEWALS_PER_TERM: u32 = 4;

/// How often the renewing thread looks for a session while there is none.
const RENEW_IDLE: Duration = Duration::from_millis(200);

/// How long the stream is read before checking whether the session is over.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// What the kernel may cache of an entry handed to it (see [`RegionFs::entry_cache`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryCache {
    /// Nothing: the entry is looked up (and checked) every time.
    No,
    /// The default TTL (the entry is not recorded, so a recall could not reach it).
    Default,
    /// As long as this mount's lease on the directory's names holds, if it has one.
    Leased,
}

impl RegionFs {
    /// Starts the threads that keep this mount's cache-lease session: one reads its stream
    /// (recalls) and opens a new session when one ends, the other renews it.
    pub fn start_cache_leases(self: &Arc<Self>) -> std::io::Result<()> {
        let fs = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("regionfs-leases".into())
            .spawn(move || {
                loop {
                    let Some(this) = fs.upgrade() else { return };
                    let asked = Instant::now();
                    let stream = this
                        .client
                        .manager()
                        .watch_cache_leases(this.identity.host_id());
                    drop(this);
                    match stream {
                        Ok(mut stream) => run_session(&fs, &mut stream, asked),
                        Err(e) => {
                            tracing::debug!(error = %e, "cannot open a cache-lease session")
                        }
                    }
                    let Some(this) = fs.upgrade() else { return };
                    let held = this.cache_leases.end();
                    if !held.is_empty() {
                        tracing::info!(
                            leases = held.len(),
                            "the cache-lease session ended; the kernel forgets what it cached under its leases"
                        );
                    }
                    this.forget_leased(&held);
                    // Nothing recalls what the manager may change from now on.
                    this.placements.forget_all();
                    this.pin_all_leased();
                    drop(this);
                    std::thread::sleep(RECONNECT_AFTER);
                }
            })?;
        let fs = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("regionfs-renew".into())
            .spawn(move || {
                loop {
                    let every = {
                        let Some(this) = fs.upgrade() else { return };
                        let Some((session, term)) = this.cache_leases.current() else {
                            drop(this);
                            std::thread::sleep(RENEW_IDLE);
                            continue;
                        };
                        let asked = Instant::now();
                        match this.client.manager().renew_cache_leases(session) {
                            Ok(()) => this.cache_leases.renewed(session, asked),
                            Err(e) if e.errno() == libc::ENOENT => {
                                tracing::info!(
                                    session,
                                    "the manager ended this mount's cache-lease session"
                                );
                                this.cache_leases.over(session);
                            }
                            // A recall unanswered, or the manager out of reach: the leases
                            // run out unless a later renewal goes through.
                            Err(e) => {
                                tracing::debug!(session, error = %e, "cache leases not renewed")
                            }
                        }
                        (term / RENEWALS_PER_TERM).max(Duration::from_millis(10))
                    };
                    std::thread::sleep(every);
                }
            })
            .map(drop)
    }

    /// How long the kernel may cache what a reply brought under grant `grant` on `covered`,
    /// beyond the default.
    pub fn lease_ttl(&self, covered: Covered, grant: u64) -> Option<Duration> {
        self.cache_leases.ttl(covered, grant)
    }

    /// Takes the leases a manager reply to `caller`'s request, sent at `asked`, granted.
    pub(super) fn note_leases(
        &self,
        caller: &v1::Caller,
        asked: Instant,
        parent: Option<u64>,
        attr: &v1::Attr,
    ) {
        self.cache_leases
            .note(caller.lease_session, asked, parent, attr);
    }

    /// What the kernel may cache of entry `name` of `parent`, recording it when it may (see
    /// [`RegionFs::entry_cacheable_noting`]).
    pub fn entry_cache(&self, parent: u64, name: &OsStr, default_ttl: Duration) -> EntryCache {
        let keep = default_ttl.max(self.cache_leases.term());
        match self.note_cached_entry(parent, name, keep) {
            None => EntryCache::No,
            Some(false) => EntryCache::Default,
            Some(true) => EntryCache::Leased,
        }
    }

    /// Whether entry `name` of `parent`, naming `ino`, may be handed to the kernel for as
    /// long as the lease on the directory's names holds; if so it is kept by inode, so that
    /// a recall of `ino`'s attributes also drops the entry (in writeback mode the kernel
    /// takes no smaller size from attributes: the entry must be looked up again, see
    /// [`RegionFs::kernel_size_stale`]).
    pub fn leased_entry(&self, parent: u64, name: &OsStr, ino: u64) -> bool {
        let Ok(mut by_ino) = self.leased_entries.lock() else {
            return false;
        };
        if !by_ino.contains_key(&ino) && by_ino.len() >= LEASED_ENTRIES_KEPT {
            return false;
        }
        let names = by_ino.entry(ino).or_default();
        if !names.iter().any(|(d, n)| *d == parent && n == name) {
            names.push((parent, name.to_os_string()));
        }
        true
    }

    /// Makes the kernel forget what it cached under `covered`: attributes at once; a
    /// directory's recorded entries (and the entries naming an inode whose attributes are
    /// recalled) on a thread of its own, waited for a moment (see [`NAMES_DROP_WAIT`]).
    fn forget_leased(&self, covered: &[Covered]) {
        let Some(kernel) = self.kernel.get().cloned() else {
            return;
        };
        let mut names = Vec::new();
        for c in covered {
            match *c {
                Covered::Attrs(ino) => {
                    let _ = kernel.invalidate(ino, -1, 0);
                    let entries = self
                        .leased_entries
                        .lock()
                        .ok()
                        .and_then(|mut e| e.remove(&ino))
                        .unwrap_or_default();
                    for (dir, name) in entries {
                        names.push((dir, vec![name]));
                    }
                }
                Covered::Names(dir) => {
                    let taken = self.take_recorded_entries(dir);
                    if !taken.is_empty() {
                        names.push((dir, taken));
                    }
                }
            }
        }
        if names.is_empty() {
            return;
        }
        let (done, wait) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("regionfs-forget".into())
            .spawn(move || {
                for (dir, taken) in &names {
                    for name in taken {
                        let _ = kernel.invalidate_entry(*dir, name);
                    }
                }
                let _ = done.send(());
            });
        if spawned.is_ok() && wait.recv_timeout(NAMES_DROP_WAIT).is_err() {
            tracing::debug!("a directory's entries are dropped once its lock is free");
        }
    }
}

/// Serves one session until it ends (or the manager says it is over).
fn run_session(fs: &Weak<RegionFs>, stream: &mut CacheLeaseStream, asked: Instant) {
    let mut session = 0;
    loop {
        let event = match stream.next_event(IDLE_CHECK) {
            Ok(LeaseStreamNext::Event(e)) => e,
            Ok(LeaseStreamNext::Ended) => return,
            Ok(LeaseStreamNext::Idle) => {
                // A session the manager ended behind a connection that never closed.
                match fs.upgrade() {
                    Some(this) if session != 0 && this.cache_leases.is_over() => return,
                    Some(_) => continue,
                    None => return,
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "the cache-lease session broke");
                return;
            }
        };
        let Some(this) = fs.upgrade() else { return };
        if event.session != 0 {
            session = event.session;
            let term = Duration::from_millis(event.term_ms.into());
            this.cache_leases.started(session, term, asked);
            tracing::info!(session, ?term, "cache-lease session started");
            // Leased opens whose handle the last session's end could not take (the manager
            // was out of reach): a restarted manager changes nothing before the old leases
            // have run out, so this is in time.
            this.pin_all_leased();
            continue;
        }
        if event.recall == 0 {
            continue;
        }
        let covered = Covered::of_recall(&event);
        this.cache_leases.recall(covered, event.grant);
        this.forget_leased(&[covered]);
        if let Covered::Attrs(ino) = covered {
            // The change may remove the region: its leased opens hold a handle first.
            this.placements.forget(ino);
            this.pin_leased(ino);
        }
        if let Err(e) = this
            .client
            .manager()
            .cache_lease_recalled(session, event.recall)
        {
            // The manager waits the leases out when no answer comes.
            tracing::debug!(error = %e, "cannot answer a cache-lease recall");
        }
    }
}
