//! Durable state in redb: every acknowledged change is committed (fsync)
//! before the reply, and loading rebuilds the in-memory [`State`].
//!
//! A change is durable once it is in the write-ahead log ([`crate::wal`]),
//! whose file is written out in full when created, so appends never need
//! space. Applying it to redb can fail when the file system is full: the
//! store then *stalls* ([`Store::stalled`]): redb is left alone, the log
//! keeps what it missed, and [`Store::try_resume`] reopens redb and replays
//! the log once there is space again. The manager refuses changes while the
//! store is stalled (`ENOSPC`), so that the log does not run full.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::model::{Dirent, Handle, Host, Inode, Pool, ROOT_INO, decode, encode};
use crate::state::{Counters, State};
use crate::wal::{WAL_SIZE, Wal};

/// The redb file of a data directory.
const DB_FILE: &str = "manager.redb";

const INODES: TableDefinition<u64, &[u8]> = TableDefinition::new("inodes");
/// (parent, name) → (inode, cookie).
const DIRENTS: TableDefinition<(u64, &str), (u64, u64)> = TableDefinition::new("dirents");
/// (region, chunk index) → map entry.
const CHUNKS: TableDefinition<(u64, u64), u64> = TableDefinition::new("chunks");
const HOSTS: TableDefinition<u32, &[u8]> = TableDefinition::new("hosts");
const POOLS: TableDefinition<u32, &[u8]> = TableDefinition::new("pools");
const HANDLES: TableDefinition<u64, &[u8]> = TableDefinition::new("handles");
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
/// Sync object name → definition (crate::sync); "" → the lock region.
const SYNC: TableDefinition<&str, &[u8]> = TableDefinition::new("sync");

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "cannot open the manager's store at {path}: {source}; check --data-dir (is another manager using it?)"
    )]
    Open { path: String, source: redb::Error },
    #[error("store operation failed: {0}")]
    Db(#[from] redb::Error),
    #[error("a stored record is corrupt ({0}); restore the data directory from a backup")]
    Corrupt(String),
    /// redb is closed after a failure (the store is stalled).
    #[error("the store is stalled after a failure: {0}")]
    Stalled(String),
}

impl From<redb::TransactionError> for StoreError {
    fn from(e: redb::TransactionError) -> Self {
        StoreError::Db(e.into())
    }
}
impl From<redb::TableError> for StoreError {
    fn from(e: redb::TableError) -> Self {
        StoreError::Db(e.into())
    }
}
impl From<redb::StorageError> for StoreError {
    fn from(e: redb::StorageError) -> Self {
        StoreError::Db(e.into())
    }
}
impl From<redb::CommitError> for StoreError {
    fn from(e: redb::CommitError) -> Self {
        StoreError::Db(e.into())
    }
}
impl From<postcard::Error> for StoreError {
    fn from(e: postcard::Error) -> Self {
        StoreError::Corrupt(e.to_string())
    }
}

/// The embedded transactional store: redb behind a write-ahead log.
pub struct Store {
    /// `None` while stalled (closed after a failure, reopened to resume).
    db: Option<Database>,
    /// The redb file.
    path: PathBuf,
    wal: Wal,
    /// Epoch of the log's current entries (stored in redb at checkpoints).
    epoch: u64,
    /// Why redb stopped taking the logged changes, if it did.
    stalled: Option<String>,
}

/// Counter holding the write-ahead log's epoch.
const WAL_EPOCH: &str = "wal_epoch";

impl Store {
    /// Opens (or creates) the store in `dir` and loads the state.
    pub fn open(dir: &Path, lease: Duration, root_mode: u32) -> Result<(Store, State), StoreError> {
        Store::open_with_log(dir, lease, root_mode, WAL_SIZE)
    }

    /// [`Store::open`] with a write-ahead log of `wal_size` bytes.
    pub fn open_with_log(
        dir: &Path,
        lease: Duration,
        root_mode: u32,
        wal_size: u64,
    ) -> Result<(Store, State), StoreError> {
        let path = dir.join(DB_FILE);
        let open_err = |source: redb::Error| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| open_err(redb::Error::Io(e)))?;
        let db = Database::create(&path).map_err(|e| open_err(e.into()))?;
        let wal_path = dir.join("manager.wal");
        let wal = Wal::open_sized(&wal_path, wal_size).map_err(|e| StoreError::Open {
            path: wal_path.display().to_string(),
            source: redb::Error::Io(e),
        })?;
        let mut store = Store {
            db: Some(db),
            path,
            wal,
            epoch: 0,
            stalled: None,
        };
        store.create_tables()?;
        store.recover()?;
        let mut state = store.load(lease)?;
        if !state.inodes.contains_key(&ROOT_INO) {
            state = State::new(lease, root_mode);
            store.commit(&mut state)?;
        }
        Ok((store, state))
    }

    /// Applies the log's entries of the stored epoch to redb, then
    /// checkpoints so the log starts empty.
    fn recover(&mut self) -> Result<(), StoreError> {
        let txn = self.db()?.begin_read()?;
        let stored = txn
            .open_table(COUNTERS)?
            .get(WAL_EPOCH)?
            .map_or(0, |v| v.value());
        drop(txn);
        self.replay(stored)
    }

    /// Applies the log's entries of `epoch` to redb, then checkpoints.
    fn replay(&mut self, epoch: u64) -> Result<(), StoreError> {
        self.epoch = epoch;
        let entries = self
            .wal
            .replay(self.epoch)
            .map_err(|e| StoreError::Db(redb::Error::Io(e)))?;
        if !entries.is_empty() {
            tracing::info!(entries = entries.len(), "replaying the write-ahead log");
        }
        for entry in entries {
            let records: Vec<Record> = decode(&entry)?;
            self.apply(&records, Durability::None)?;
        }
        self.checkpoint()
    }

    fn db(&self) -> Result<&Database, StoreError> {
        self.db.as_ref().ok_or_else(|| {
            StoreError::Stalled(
                self.stalled
                    .clone()
                    .unwrap_or_else(|| "the database is closed".into()),
            )
        })
    }

    /// Why the store stopped applying changes to redb (`None`: it did not).
    pub fn stalled(&self) -> Option<&str> {
        self.stalled.as_deref()
    }

    /// Stalls after `e`: redb is closed (it may hold a half-done
    /// transaction), the log keeps every change since the last checkpoint.
    fn stall(&mut self, e: &StoreError) {
        let reason = e.to_string();
        tracing::error!(
            error = %reason,
            dir = %self.path.parent().unwrap_or(&self.path).display(),
            "the manager's store cannot take changes (is its file system full?); \
             changes are refused until it can"
        );
        self.db = None;
        self.stalled = Some(reason);
    }

    /// Whether less than `eighths`/8 of the log is free.
    pub fn log_room_below(&self, eighths: u64) -> bool {
        self.wal.used() > self.wal.size() / 8 * (8 - eighths)
    }

    /// Leaves the stalled state if redb can be reopened and the log
    /// replayed into it and checkpointed (there is space again). Returns
    /// whether the store is running.
    pub fn try_resume(&mut self) -> bool {
        if self.stalled.is_none() {
            return true;
        }
        self.db = None;
        // The entries since the last checkpoint carry this run's epoch, whatever redb kept of
        // a commit that failed.
        let epoch = self.epoch;
        let attempt = (|| {
            self.db = Some(Database::create(&self.path).map_err(redb::Error::from)?);
            self.create_tables()?;
            self.replay(epoch)
        })();
        match attempt {
            Ok(()) => {
                tracing::info!("the manager's store takes changes again");
                self.stalled = None;
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "the store cannot resume yet");
                self.db = None;
                false
            }
        }
    }

    /// Makes everything applied to redb durable there and starts the log
    /// over under a new epoch.
    pub fn checkpoint(&mut self) -> Result<(), StoreError> {
        let next = self.epoch + 1;
        self.apply(
            &[Record::Counter(WAL_EPOCH.to_owned(), next)],
            Durability::Immediate,
        )?;
        self.epoch = next;
        self.wal.restart(next);
        Ok(())
    }

    /// Makes sure every table exists (a new store has none).
    fn create_tables(&self) -> Result<(), StoreError> {
        let txn = self.db()?.begin_write()?;
        txn.open_table(INODES)?;
        txn.open_table(DIRENTS)?;
        txn.open_table(CHUNKS)?;
        txn.open_table(HOSTS)?;
        txn.open_table(POOLS)?;
        txn.open_table(HANDLES)?;
        txn.open_table(COUNTERS)?;
        txn.open_table(SYNC)?;
        txn.commit()?;
        Ok(())
    }

    fn load(&self, lease: Duration) -> Result<State, StoreError> {
        let mut state = State::empty(lease);
        let txn = self.db()?.begin_read()?;
        let Ok(counters) = txn.open_table(COUNTERS) else {
            return Ok(state); // a new store
        };
        let get = |k: &str| -> Result<Option<u64>, StoreError> {
            Ok(counters.get(k)?.map(|v| v.value()))
        };
        let defaults = Counters::default();
        state.counters = Counters {
            next_ino: get("next_ino")?.unwrap_or(defaults.next_ino),
            next_handle: get("next_handle")?.unwrap_or(defaults.next_handle),
            next_gid: get("next_gid")?.unwrap_or(u64::from(defaults.next_gid)) as u32,
        };
        for row in txn.open_table(INODES)?.iter()? {
            let (_, v) = row?;
            let inode = Inode::decode_stored(v.value())?;
            state.inodes.insert(inode.ino, inode);
        }
        for row in txn.open_table(DIRENTS)?.iter()? {
            let (k, v) = row?;
            let (parent, name) = k.value();
            let (ino, cookie) = v.value();
            state.load_entry(parent, name.to_owned(), Dirent { ino, cookie });
        }
        for ino in state
            .inodes
            .values()
            .filter(|i| i.is_dir())
            .map(|i| i.ino)
            .collect::<Vec<_>>()
        {
            state.dirs.entry(ino).or_default();
        }
        for row in txn.open_table(HOSTS)?.iter()? {
            let (_, v) = row?;
            let host: Host = decode(v.value())?;
            // Hosts get one lease to re-register after a manager restart.
            state.leases.insert(host.host_id, Instant::now() + lease);
            state.hosts.insert(host.host_id, host);
        }
        for row in txn.open_table(POOLS)?.iter()? {
            let (_, v) = row?;
            let pool: Pool = decode(v.value())?;
            state.alloc.add_pool(pool);
        }
        for row in txn.open_table(CHUNKS)?.iter()? {
            let (k, v) = row?;
            let (ino, index) = k.value();
            let map = state.maps.entry(ino).or_default();
            if index != map.len() as u64 {
                return Err(StoreError::Corrupt(format!(
                    "region {ino} map has a gap at chunk {index}"
                )));
            }
            map.push(v.value());
            if !state.alloc.mark_used(v.value()) {
                return Err(StoreError::Corrupt(format!(
                    "region {ino} chunk {index} names a missing or doubly used pool chunk"
                )));
            }
        }
        for row in txn.open_table(HANDLES)?.iter()? {
            let (_, v) = row?;
            let handle: Handle = decode(v.value())?;
            state.open.entry(handle.ino).or_default().insert(handle.id);
            state.handles.insert(handle.id, handle);
        }
        for row in txn.open_table(SYNC)?.iter()? {
            let (k, v) = row?;
            crate::sync::load_record(&mut state, k.value(), v.value())?;
        }
        for inode in state.inodes.values() {
            if inode.vaddr != 0 && !state.vaddrs.mark(inode.vaddr, inode.vaddr_len) {
                return Err(StoreError::Corrupt(format!(
                    "region {} has an overlapping vaddr",
                    inode.ino
                )));
            }
        }
        Ok(state)
    }

    /// Writes every dirty record of `state` now (start-up, tests).
    pub fn commit(&mut self, state: &mut State) -> Result<(), StoreError> {
        let records = collect(state)?;
        self.write(&records)
    }

    /// Makes records durable and applies them to redb.
    pub fn write(&mut self, records: &[Record]) -> Result<(), StoreError> {
        if self.log(records)? {
            self.apply_logged(records)?;
        }
        Ok(())
    }

    /// Makes records durable: appended to the log with one flush (returns
    /// true: [`Store::apply_logged`] must follow), or, for a group too
    /// large for the log, written to redb durably (returns false).
    pub fn log(&mut self, records: &[Record]) -> Result<bool, StoreError> {
        if records.is_empty() {
            return Ok(false);
        }
        let payload = encode(&records.to_vec())?;
        if !self.wal.fits(payload.len()) && !self.try_resume() {
            // Stalled with a full log: the change cannot be made durable.
            return Err(StoreError::Stalled(format!(
                "the write-ahead log is full and the store cannot take its changes ({})",
                self.stalled.as_deref().unwrap_or("stalled")
            )));
        }
        if !self.wal.fits(payload.len()) {
            self.checkpoint()?;
        }
        if self.wal.fits(payload.len()) {
            self.wal
                .append(&payload)
                .map_err(|e| StoreError::Db(redb::Error::Io(e)))?;
            Ok(true)
        } else {
            self.apply(records, Durability::Immediate)?;
            Ok(false)
        }
    }

    /// Applies logged records to redb (not waiting for the disk: the log
    /// has them), checkpointing when the log runs full.
    /// A failure stalls the store (the log has the records) and is
    /// returned; while stalled, records are left to the replay at resume.
    pub fn apply_logged(&mut self, records: &[Record]) -> Result<(), StoreError> {
        if self.stalled.is_some() {
            return Ok(());
        }
        let applied = self.apply(records, Durability::None).and_then(|()| {
            if self.wal.used() > self.wal.size() / 4 * 3 {
                self.checkpoint()
            } else {
                Ok(())
            }
        });
        if let Err(e) = &applied {
            self.stall(e);
        }
        applied
    }

    /// Writes records to redb in one transaction.
    fn apply(&self, records: &[Record], durability: Durability) -> Result<(), StoreError> {
        let mut txn = self.db()?.begin_write()?;
        txn.set_durability(durability)
            .map_err(|e| StoreError::Corrupt(format!("cannot set durability: {e}")))?;
        // One pass per table, each opened only when a record needs it;
        // records of one table keep their order.
        let any = |f: fn(&Record) -> bool| records.iter().any(f);
        if any(|r| matches!(r, Record::Inode(..))) {
            let mut t = txn.open_table(INODES)?;
            for r in records {
                if let Record::Inode(k, v) = r {
                    match v {
                        Some(v) => drop(t.insert(*k, v.as_slice())?),
                        None => drop(t.remove(*k)?),
                    }
                }
            }
        }
        if any(|r| matches!(r, Record::Dirent(..))) {
            let mut t = txn.open_table(DIRENTS)?;
            for r in records {
                if let Record::Dirent(parent, name, v) = r {
                    match v {
                        Some(v) => drop(t.insert((*parent, name.as_str()), *v)?),
                        None => drop(t.remove((*parent, name.as_str()))?),
                    }
                }
            }
        }
        if any(|r| matches!(r, Record::Chunk(..))) {
            let mut t = txn.open_table(CHUNKS)?;
            for r in records {
                if let Record::Chunk(ino, index, v) = r {
                    match v {
                        Some(v) => drop(t.insert((*ino, *index), *v)?),
                        None => drop(t.remove((*ino, *index))?),
                    }
                }
            }
        }
        for (table, pick) in [
            (
                HOSTS,
                (|r: &Record| match r {
                    Record::Host(k, v) => Some((*k, v.as_deref())),
                    _ => None,
                }) as fn(&Record) -> Option<(u32, Option<&[u8]>)>,
            ),
            (POOLS, |r: &Record| match r {
                Record::Pool(k, v) => Some((*k, v.as_deref())),
                _ => None,
            }),
        ] {
            if records.iter().any(|r| pick(r).is_some()) {
                let mut t = txn.open_table(table)?;
                for (k, v) in records.iter().filter_map(pick) {
                    match v {
                        Some(v) => drop(t.insert(k, v)?),
                        None => drop(t.remove(k)?),
                    }
                }
            }
        }
        if any(|r| matches!(r, Record::Handle(..))) {
            let mut t = txn.open_table(HANDLES)?;
            for r in records {
                if let Record::Handle(k, v) = r {
                    match v {
                        Some(v) => drop(t.insert(*k, v.as_slice())?),
                        None => drop(t.remove(*k)?),
                    }
                }
            }
        }
        if any(|r| matches!(r, Record::Sync(..))) {
            let mut t = txn.open_table(SYNC)?;
            for r in records {
                if let Record::Sync(k, v) = r {
                    match v {
                        Some(v) => drop(t.insert(k.as_str(), v.as_slice())?),
                        None => drop(t.remove(k.as_str())?),
                    }
                }
            }
        }
        if any(|r| matches!(r, Record::Counter(..))) {
            let mut t = txn.open_table(COUNTERS)?;
            for r in records {
                if let Record::Counter(name, v) = r {
                    t.insert(name.as_str(), *v)?;
                }
            }
        }
        txn.commit()?;
        Ok(())
    }
}

/// One change to a stored record (`None`: delete it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    Inode(u64, Option<Vec<u8>>),
    Dirent(u64, String, Option<(u64, u64)>),
    Chunk(u64, u64, Option<u64>),
    Host(u32, Option<Vec<u8>>),
    Pool(u32, Option<Vec<u8>>),
    Handle(u64, Option<Vec<u8>>),
    Counter(String, u64),
    /// A sync object's definition, or the lock region under "" (crate::sync).
    Sync(String, Option<Vec<u8>>),
}

/// Serialises every dirty record of `state` and clears the dirty set.
pub fn collect(state: &mut State) -> Result<Vec<Record>, StoreError> {
    let dirty = std::mem::take(&mut state.dirty);
    let mut out = Vec::new();
    for ino in &dirty.inodes {
        let v = match state.inodes.get(ino) {
            Some(inode) => Some(encode(inode)?),
            None => None,
        };
        out.push(Record::Inode(*ino, v));
    }
    for (parent, name) in dirty.dirents {
        let v = state.child(parent, &name).map(|d| (d.ino, d.cookie));
        out.push(Record::Dirent(parent, name, v));
    }
    for &(ino, from, to) in &dirty.chunks {
        let map = state.maps.get(&ino).map_or(&[][..], Vec::as_slice);
        for index in from..to {
            out.push(Record::Chunk(ino, index, map.get(index as usize).copied()));
        }
    }
    for id in &dirty.hosts {
        let v = match state.hosts.get(id) {
            Some(h) => Some(encode(h)?),
            None => None,
        };
        out.push(Record::Host(*id, v));
    }
    for gid in &dirty.pools {
        let v = match state.alloc.pool(*gid) {
            Some(p) => Some(encode(&p.pool)?),
            None => None,
        };
        out.push(Record::Pool(*gid, v));
    }
    for id in &dirty.handles {
        let v = match state.handles.get(id) {
            Some(h) => Some(encode(h)?),
            None => None,
        };
        out.push(Record::Handle(*id, v));
    }
    for key in &dirty.sync {
        out.push(Record::Sync(
            key.clone(),
            crate::sync::record_of(state, key)?,
        ));
    }
    if dirty.counters {
        out.push(Record::Counter("next_ino".into(), state.counters.next_ino));
        out.push(Record::Counter(
            "next_handle".into(),
            state.counters.next_handle,
        ));
        out.push(Record::Counter(
            "next_gid".into(),
            u64::from(state.counters.next_gid),
        ));
    }
    Ok(out)
}

impl Drop for Store {
    fn drop(&mut self) {
        if !self.try_resume() {
            tracing::warn!(
                "the store is stalled at close; the log will be replayed at the next start"
            );
            return;
        }
        if let Err(e) = self.checkpoint() {
            tracing::warn!(error = %e, "checkpoint at close failed; the log will be replayed at the next start");
        }
    }
}

#[cfg(test)]
mod tests {
    //! Replay of damaged and hostile logs. `REGIONS_FUZZ_CASES` sets the number of cases of
    //! each test (default 24; the long run is `REGIONS_FUZZ_CASES=100000 cargo test --release
    //! -p regions-manager --lib store::tests`).

    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::access::Caller;
    use crate::wal::Wal;

    fn cases() -> u64 {
        std::env::var("REGIONS_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(24)
    }

    /// xorshift64*: enough randomness for corrupting bytes, reproducible from the case number.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    const LEASE: Duration = Duration::from_secs(10);
    const GROUPS: usize = 8;

    /// A crash image of a store that made `GROUPS` groups durable in its log only (each
    /// creates one region `f<i>`), and how many log bytes they use.
    fn crash_image(dir: &Path) -> u64 {
        let live = dir.join("live");
        let (mut store, mut state) = Store::open(&live, LEASE, 0o1777).unwrap();
        for i in 0..GROUPS {
            state
                .create_entry(&Caller::root(1), ROOT_INO, &format!("f{i}"), 0o644, None)
                .unwrap();
            let records = collect(&mut state).unwrap();
            assert!(store.log(&records).unwrap(), "group {i} went to the log");
        }
        let used = store.wal.used();
        // The files as a crash would leave them: the log has the groups, redb does not.
        let image = dir.join("image");
        std::fs::create_dir_all(&image).unwrap();
        for name in ["manager.redb", "manager.wal"] {
            std::fs::copy(live.join(name), image.join(name)).unwrap();
        }
        drop(store);
        used
    }

    /// Opens the image at `dir/image`, which must not panic; returns the names it holds.
    fn reopen(dir: &Path, case: u64) -> Result<Vec<String>, StoreError> {
        let image = dir.join("image");
        let opened = std::panic::catch_unwind(|| Store::open(&image, LEASE, 0o1777));
        let (_store, state) = opened.unwrap_or_else(|_| panic!("replay panicked (case {case})"))?;
        let mut names: Vec<String> = (0..GROUPS)
            .map(|i| format!("f{i}"))
            .filter(|n| state.child(ROOT_INO, n).is_some())
            .collect();
        names.sort_by_key(|n| n[1..].parse::<usize>().unwrap_or(0));
        Ok(names)
    }

    #[test]
    fn a_clean_crash_image_replays_every_logged_group() {
        let dir = tempfile::tempdir().unwrap();
        crash_image(dir.path());
        assert_eq!(reopen(dir.path(), 0).unwrap().len(), GROUPS);
    }

    #[test]
    fn corrupted_log_bytes_replay_a_prefix_of_the_groups_and_never_panic() {
        for case in 0..cases() {
            let mut rng = Rng(case.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let dir = tempfile::tempdir().unwrap();
            let used = crash_image(dir.path());
            let wal = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.path().join("image/manager.wal"))
                .unwrap();
            for _ in 0..=rng.below(4) {
                let at = rng.below(used + 64);
                let byte = [rng.next() as u8];
                wal.write_all_at(&byte, at).unwrap();
            }
            drop(wal);
            // A damaged entry ends the log: what is replayed is the groups before it, in order
            // (f0..fk), never a later group without an earlier one.
            let names = reopen(dir.path(), case)
                .unwrap_or_else(|e| panic!("case {case}: a damaged log must replay, got {e}"));
            let expected: Vec<String> = (0..names.len()).map(|i| format!("f{i}")).collect();
            assert_eq!(names, expected, "case {case}: not a prefix");
        }
    }

    #[test]
    fn hostile_log_entries_with_valid_checksums_are_refused_not_trusted() {
        for case in 0..cases() {
            let mut rng = Rng(case.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
            let dir = tempfile::tempdir().unwrap();
            crash_image(dir.path());
            // Entries whose checksums are right but whose payloads are random bytes, or a real
            // payload with bytes changed, appended under the stored epoch.
            let path = dir.path().join("image/manager.wal");
            let mut wal = Wal::open(&path).unwrap();
            let epoch = (0..64u64)
                .find(|e| !wal.replay(*e).unwrap().is_empty())
                .expect("the image's log has entries");
            let mut entries = wal.replay(epoch).unwrap();
            let mut payload = entries.swap_remove(rng.below(entries.len() as u64) as usize);
            if rng.below(2) == 0 {
                payload = (0..rng.below(300)).map(|_| rng.next() as u8).collect();
            } else {
                for _ in 0..=rng.below(6) {
                    let at = rng.below(payload.len() as u64) as usize;
                    payload[at] = rng.next() as u8;
                }
            }
            wal.append(&payload).unwrap();
            drop(wal);
            // Opening either refuses the store with an error that says so, or applies a
            // payload that happened to decode; it never panics.
            if let Err(e) = reopen(dir.path(), case) {
                assert!(!e.to_string().is_empty());
            }
        }
    }
}
