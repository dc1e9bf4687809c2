//! Durable state in redb: every acknowledged change is committed (fsync)
//! before the reply, and loading rebuilds the in-memory [`State`].

use std::path::Path;
use std::time::{Duration, Instant};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::model::{Dirent, Handle, Host, Inode, Pool, ROOT_INO, decode, encode};
use crate::state::{Counters, State};

const INODES: TableDefinition<u64, &[u8]> = TableDefinition::new("inodes");
/// (parent, name) → (inode, cookie).
const DIRENTS: TableDefinition<(u64, &str), (u64, u64)> = TableDefinition::new("dirents");
/// (region, chunk index) → map entry.
const CHUNKS: TableDefinition<(u64, u64), u64> = TableDefinition::new("chunks");
const HOSTS: TableDefinition<u32, &[u8]> = TableDefinition::new("hosts");
const POOLS: TableDefinition<u32, &[u8]> = TableDefinition::new("pools");
const HANDLES: TableDefinition<u64, &[u8]> = TableDefinition::new("handles");
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");

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

/// The embedded transactional store.
pub struct Store {
    db: Database,
}

impl Store {
    /// Opens (or creates) the store in `dir` and loads the state.
    pub fn open(dir: &Path, lease: Duration, root_mode: u32) -> Result<(Store, State), StoreError> {
        let path = dir.join("manager.redb");
        let open_err = |source: redb::Error| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| open_err(redb::Error::Io(e)))?;
        let db = Database::create(&path).map_err(|e| open_err(e.into()))?;
        let store = Store { db };
        let mut state = store.load(lease)?;
        if !state.inodes.contains_key(&ROOT_INO) {
            state = State::new(lease, root_mode);
            store.commit(&mut state)?;
        }
        Ok((store, state))
    }

    fn load(&self, lease: Duration) -> Result<State, StoreError> {
        let mut state = State::empty(lease);
        let txn = self.db.begin_read()?;
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
            let inode: Inode = decode(v.value())?;
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

    /// Writes every dirty record of `state` in one transaction and waits for
    /// it to be durable. Clears the dirty set on success.
    pub fn commit(&self, state: &mut State) -> Result<(), StoreError> {
        if state.dirty.is_empty() {
            return Ok(());
        }
        let txn = self.db.begin_write()?;
        {
            let mut t = txn.open_table(INODES)?;
            for ino in &state.dirty.inodes {
                match state.inodes.get(ino) {
                    Some(inode) => {
                        t.insert(*ino, encode(inode)?.as_slice())?;
                    }
                    None => {
                        t.remove(*ino)?;
                    }
                }
            }
            let mut t = txn.open_table(DIRENTS)?;
            for (parent, name) in &state.dirty.dirents {
                match state.child(*parent, name) {
                    Some(d) => {
                        t.insert((*parent, name.as_str()), (d.ino, d.cookie))?;
                    }
                    None => {
                        t.remove((*parent, name.as_str()))?;
                    }
                }
            }
            let mut t = txn.open_table(CHUNKS)?;
            for &(ino, from, to) in &state.dirty.chunks {
                let map = state.maps.get(&ino).map_or(&[][..], Vec::as_slice);
                for index in from..to {
                    match map.get(index as usize) {
                        Some(entry) => {
                            t.insert((ino, index), *entry)?;
                        }
                        None => {
                            t.remove((ino, index))?;
                        }
                    }
                }
            }
            let mut t = txn.open_table(HOSTS)?;
            for id in &state.dirty.hosts {
                match state.hosts.get(id) {
                    Some(h) => {
                        t.insert(*id, encode(h)?.as_slice())?;
                    }
                    None => {
                        t.remove(*id)?;
                    }
                }
            }
            let mut t = txn.open_table(POOLS)?;
            for gid in &state.dirty.pools {
                match state.alloc.pool(*gid) {
                    Some(p) => {
                        t.insert(*gid, encode(&p.pool)?.as_slice())?;
                    }
                    None => {
                        t.remove(*gid)?;
                    }
                }
            }
            let mut t = txn.open_table(HANDLES)?;
            for id in &state.dirty.handles {
                match state.handles.get(id) {
                    Some(h) => {
                        t.insert(*id, encode(h)?.as_slice())?;
                    }
                    None => {
                        t.remove(*id)?;
                    }
                }
            }
            let mut t = txn.open_table(COUNTERS)?;
            if state.dirty.counters {
                t.insert("next_ino", state.counters.next_ino)?;
                t.insert("next_handle", state.counters.next_handle)?;
                t.insert("next_gid", u64::from(state.counters.next_gid))?;
            }
        }
        txn.commit()?;
        state.dirty = Default::default();
        Ok(())
    }
}
