//! The manager's state in memory, and the set of records each operation
//! changed (written to the store before the reply).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1::{self, host_event::Event};

use crate::access::{Caller, S_ISGID};
use crate::allocator::{Allocator, Piece, pieces_of};
use crate::error::{ManagerError, Result};
use crate::model::{Dirent, FIRST_COOKIE, Handle, Host, Inode, Kind, ROOT_INO, RegionAttrs, Time};
use crate::vaddr::VaddrSpace;

/// Entries of one directory, by name and by readdir cookie.
#[derive(Clone, Debug, Default)]
pub struct DirIndex {
    pub by_name: BTreeMap<String, Dirent>,
    pub by_cookie: BTreeMap<u64, String>,
}

/// Records changed since the last commit.
#[derive(Debug, Default)]
pub struct Dirty {
    pub inodes: BTreeSet<u64>,
    pub dirents: BTreeSet<(u64, String)>,
    /// (region, first chunk index, end chunk index) whose map entries changed.
    pub chunks: Vec<(u64, u64, u64)>,
    pub hosts: BTreeSet<u32>,
    pub pools: BTreeSet<u32>,
    pub handles: BTreeSet<u64>,
    pub counters: bool,
    /// Sync objects (and the lock region under its empty key) changed.
    pub sync: BTreeSet<String>,
}

impl Dirty {
    /// Only open handles (and the counters that number them) changed.
    pub fn only_handles(&self) -> bool {
        self.inodes.is_empty()
            && self.dirents.is_empty()
            && self.chunks.is_empty()
            && self.hosts.is_empty()
            && self.pools.is_empty()
            && self.sync.is_empty()
    }

    pub fn is_empty(&self) -> bool {
        self.only_handles() && self.handles.is_empty() && !self.counters
    }
}

/// Counters that hand out identifiers (stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counters {
    pub next_ino: u64,
    pub next_handle: u64,
    pub next_gid: u32,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            next_ino: ROOT_INO + 1,
            next_handle: 1,
            next_gid: 1,
        }
    }
}

/// Everything the manager knows.
#[derive(Debug)]
pub struct State {
    pub inodes: HashMap<u64, Inode>,
    /// Write handle → the cache-lease session of the mount that opened it (not stored: a
    /// session ends with the manager run). Its own writes do not stop that mount's kernel
    /// from caching the region's attributes (see `crate::cache_leases`).
    pub write_sessions: HashMap<u64, u64>,
    pub dirs: HashMap<u64, DirIndex>,
    /// Region map of every region: one entry per chunk.
    pub maps: HashMap<u64, Vec<u64>>,
    pub hosts: BTreeMap<u32, Host>,
    /// When each host's lease ends (not stored: hosts re-earn it).
    pub leases: HashMap<u32, Instant>,
    /// The data transports each host said it serves when it registered (not stored: hosts
    /// register again with every manager run).
    pub host_transports: HashMap<u32, String>,
    pub alloc: Allocator,
    pub vaddrs: VaddrSpace,
    pub handles: BTreeMap<u64, Handle>,
    /// Open handles of each region.
    pub open: HashMap<u64, BTreeSet<u64>>,
    pub counters: Counters,
    pub lease: Duration,
    pub dirty: Dirty,
    /// Work for daemons, sent once the change is committed.
    pub events: Vec<(u32, Event)>,
    /// Barrier, mutex and doorbell definitions (crate::sync).
    pub sync: crate::sync::SyncState,
    /// Regions whose writers reserved chunks past the size (not stored: a
    /// restart forgets them, and the space stays allocated until the next
    /// writer closes).
    pub reserved: std::collections::HashSet<u64>,
    /// Regions a writer closed without saying that it wrote only below the size (or whose
    /// writer's handle was dropped for it): the last writer's close zeroes the tail.
    pub tail_written: std::collections::HashSet<u64>,
    /// The newest capability revocation of each region in this run (not stored: a new run
    /// revokes every earlier token, see `revocations::revoke_all`); daemons that receive a
    /// region's chunks later get it too.
    pub revoked: crate::revocations::RevokedRegions,
    /// Set when a change queued a revocation; the operation that made it takes it (`std::mem::
    /// take`) to know whether to wait for the daemons.
    pub revocation_queued: bool,
    /// Lifetime of the capabilities the manager mints (its configuration; not stored).
    pub capability_ttl: Duration,
    /// Hosts whose lease ended and that were fenced for it (`State::fence_host`); they must
    /// register again, and their heartbeats are refused until then (not stored: after a
    /// restart every host earns its lease anew).
    pub lease_lost: std::collections::HashSet<u32>,
    /// Hosts of `lease_lost` whose fence the live daemons have applied: their mutexes may go
    /// to other callers now.
    pub fence_settled: std::collections::HashSet<u32>,
    /// Handles closed because their host's lease ended (not stored: a restarted manager
    /// forgets them): a renewal or `CheckHandles` naming one learns that its open was fenced,
    /// while a handle that is merely unknown (lost with a manager crash before its commit)
    /// is not held against its opener.
    pub fenced_handles: std::collections::HashSet<u64>,
    /// Small regions stored as objects: the hosts with object stores, the size limit, and
    /// the work queued for daemons (crate::objects).
    pub objects: crate::objects::ObjectState,
}

impl State {
    /// An empty namespace with only the root directory.
    pub fn new(lease: Duration, root_mode: u32) -> State {
        let mut s = State::empty(lease);
        let now = Time::now();
        let root = Inode {
            ino: ROOT_INO,
            kind: Kind::Directory,
            mode: root_mode,
            nlink: 2,
            uid: 0,
            gid: 0,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            parent: ROOT_INO,
            attrs: RegionAttrs {
                persistent: true,
                ..RegionAttrs::default()
            },
            owner_pid: 0,
            owner_host: 0,
            vaddr: 0,
            vaddr_len: 0,
            xattrs: BTreeMap::new(),
            next_cookie: FIRST_COOKIE,
            map_version: 0,
            rdev: 0,
            target: Vec::new(),
        };
        s.put_inode(root);
        s.dirs.insert(ROOT_INO, DirIndex::default());
        s.dirty.counters = true;
        s
    }

    /// A state with nothing in it (loading fills it).
    pub fn empty(lease: Duration) -> State {
        State {
            inodes: HashMap::new(),
            write_sessions: HashMap::new(),
            dirs: HashMap::new(),
            maps: HashMap::new(),
            hosts: BTreeMap::new(),
            leases: HashMap::new(),
            host_transports: HashMap::new(),
            alloc: Allocator::default(),
            vaddrs: VaddrSpace::default(),
            handles: BTreeMap::new(),
            open: HashMap::new(),
            counters: Counters::default(),
            lease,
            dirty: Dirty::default(),
            events: Vec::new(),
            sync: crate::sync::SyncState::default(),
            reserved: Default::default(),
            tail_written: Default::default(),
            revoked: Default::default(),
            revocation_queued: false,
            capability_ttl: crate::revocations::DEFAULT_TTL,
            lease_lost: Default::default(),
            fence_settled: Default::default(),
            fenced_handles: Default::default(),
            objects: crate::objects::ObjectState::default(),
        }
    }

    pub fn inode(&self, ino: u64) -> Result<&Inode> {
        self.inodes
            .get(&ino)
            .filter(|i| i.nlink > 0 || self.open.contains_key(&ino))
            .ok_or_else(|| ManagerError::NotFound(format!("inode {ino}")))
    }

    /// The open handles of region `ino`.
    pub fn handles_of(&self, ino: u64) -> impl Iterator<Item = &Handle> + '_ {
        self.open
            .get(&ino)
            .into_iter()
            .flatten()
            .filter_map(|id| self.handles.get(id))
    }

    /// For a caller that named `ino` by number ([`Caller::by_inode`]), search
    /// permission on every directory above it, as `open(2)` needs for a path:
    /// guessing an inode number inside another user's 0700 directory gives
    /// `EACCES`. Callers whose path the kernel walked (the mount) and root pass,
    /// and so does a process that holds an open handle of `ino` (like a
    /// descriptor, it keeps the access it was granted at open). An unlinked
    /// inode has no path: only its owner reaches it by number.
    pub fn check_path(&self, caller: &Caller, ino: u64) -> Result<()> {
        if !caller.by_inode || caller.is_root() {
            return Ok(());
        }
        let holds_handle = self
            .handles_of(ino)
            .any(|h| h.host_id == caller.host_id && h.pid == caller.pid);
        if holds_handle || ino == ROOT_INO {
            return Ok(());
        }
        let inode = self.inode(ino)?;
        if inode.parent == 0 {
            // Unlinked but still open: no path leads to it any more, so only its owner (and
            // processes holding a handle, above) may reach it by number.
            return if caller.uid == inode.uid {
                Ok(())
            } else {
                Err(ManagerError::Access(format!(
                    "inode {ino} was unlinked: uid {} may not reach it by its number",
                    caller.uid
                )))
            };
        }
        let through_parent = self.check_search_above(caller, ino, inode.parent);
        if through_parent.is_ok() || inode.nlink <= 1 || inode.is_dir() {
            return through_parent;
        }
        // A hard-linked inode is reachable when any of its names is (the scan runs only when
        // the directory of its first name is out of reach).
        let mut parents: Vec<u64> = self.names_of(ino).into_iter().map(|(d, _)| d).collect();
        parents.dedup();
        for parent in parents {
            if self.check_search_above(caller, ino, parent).is_ok() {
                return Ok(());
            }
        }
        through_parent
    }

    /// Search permission on `parent` and every directory above it.
    fn check_search_above(&self, caller: &Caller, ino: u64, mut parent: u64) -> Result<()> {
        // A directory tree is acyclic; the bound only guards a corrupt store.
        for _ in 0..=self.inodes.len() {
            if parent == 0 {
                return Ok(());
            }
            let dir = self.inode(parent)?;
            crate::access::check(
                caller,
                dir,
                crate::access::EXEC,
                &format!("search directory {parent}, which is above inode {ino}"),
            )?;
            if parent == ROOT_INO {
                return Ok(());
            }
            parent = dir.parent;
        }
        Err(ManagerError::Invalid(format!(
            "the directories above inode {ino} form a loop; the namespace is corrupt"
        )))
    }

    /// The inode, for changing; marks it dirty.
    pub fn inode_mut(&mut self, ino: u64) -> Result<&mut Inode> {
        let inode = self
            .inodes
            .get_mut(&ino)
            .ok_or_else(|| ManagerError::NotFound(format!("inode {ino}")))?;
        self.dirty.inodes.insert(ino);
        Ok(inode)
    }

    pub fn dir(&self, ino: u64) -> Result<&Inode> {
        let inode = self.inode(ino)?;
        if inode.is_dir() {
            Ok(inode)
        } else {
            Err(ManagerError::NotDir(format!("inode {ino}")))
        }
    }

    pub fn region(&self, ino: u64) -> Result<&Inode> {
        let inode = self.inode(ino)?;
        match inode.kind {
            Kind::Region => Ok(inode),
            Kind::Directory => Err(ManagerError::IsDir(format!("inode {ino}"))),
            other => Err(ManagerError::Invalid(format!(
                "inode {ino} is a {other:?}, not a region: it holds no memory to open, map or size"
            ))),
        }
    }

    pub fn put_inode(&mut self, inode: Inode) {
        self.dirty.inodes.insert(inode.ino);
        self.inodes.insert(inode.ino, inode);
    }

    pub fn child(&self, parent: u64, name: &str) -> Option<Dirent> {
        self.dirs.get(&parent)?.by_name.get(name).copied()
    }

    pub fn is_empty_dir(&self, ino: u64) -> bool {
        self.dirs.get(&ino).is_none_or(|d| d.by_name.is_empty())
    }

    /// Adds `name` → `ino` to `parent` with the parent's next cookie.
    pub fn add_entry(&mut self, parent: u64, name: &str, ino: u64) -> Result<()> {
        let dir = self.inode_mut(parent)?;
        let cookie = dir.next_cookie;
        dir.next_cookie += 1;
        let index = self.dirs.entry(parent).or_default();
        index
            .by_name
            .insert(name.to_owned(), Dirent { ino, cookie });
        index.by_cookie.insert(cookie, name.to_owned());
        self.dirty.dirents.insert((parent, name.to_owned()));
        Ok(())
    }

    /// Loads a stored entry (no dirty marking).
    pub fn load_entry(&mut self, parent: u64, name: String, dirent: Dirent) {
        let index = self.dirs.entry(parent).or_default();
        index.by_cookie.insert(dirent.cookie, name.clone());
        index.by_name.insert(name, dirent);
    }

    pub fn remove_entry(&mut self, parent: u64, name: &str) -> Option<Dirent> {
        let index = self.dirs.get_mut(&parent)?;
        let dirent = index.by_name.remove(name)?;
        index.by_cookie.remove(&dirent.cookie);
        self.dirty.dirents.insert((parent, name.to_owned()));
        Some(dirent)
    }

    /// Allocates an inode number.
    pub fn next_ino(&mut self) -> u64 {
        if let Some(ino) = self.objects.preset_ino.take() {
            // Taken already for the object a create allocated first (crate::objects).
            return ino;
        }
        let ino = self.counters.next_ino;
        self.counters.next_ino += 1;
        self.dirty.counters = true;
        ino
    }

    /// A new inode made by `caller` in directory `parent`: group from a
    /// setgid parent, region attributes inherited from the parent.
    pub fn new_inode(&mut self, kind: Kind, mode: u32, caller: &Caller, parent: &Inode) -> Inode {
        let now = Time::now();
        let setgid_parent = parent.mode & S_ISGID != 0;
        let gid = if setgid_parent {
            parent.gid
        } else {
            caller.gid
        };
        let mut mode = mode & 0o7777;
        if kind == Kind::Directory && setgid_parent {
            mode |= S_ISGID;
        }
        if kind == Kind::Region && mode & S_ISGID != 0 && !caller.is_root() && !caller.in_group(gid)
        {
            mode &= !S_ISGID;
        }
        let (owner_pid, owner_host) = match kind {
            Kind::Region => (caller.pid, caller.host_id),
            _ => (0, 0),
        };
        Inode {
            ino: self.next_ino(),
            kind,
            mode,
            nlink: if kind == Kind::Directory { 2 } else { 1 },
            uid: caller.uid,
            gid,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            parent: parent.ino,
            attrs: parent.attrs.clone(),
            owner_pid,
            owner_host,
            vaddr: 0,
            vaddr_len: 0,
            xattrs: BTreeMap::new(),
            next_cookie: FIRST_COOKIE,
            map_version: 0,
            rdev: 0,
            target: Vec::new(),
        }
    }

    /// Records that map entries `[from, to)` of `ino` changed.
    pub fn mark_chunks(&mut self, ino: u64, from: u64, to: u64) {
        if from < to {
            self.dirty.chunks.push((ino, from, to));
        }
    }

    pub fn is_live(&self, host: u32) -> bool {
        self.leases.get(&host).is_some_and(|t| *t > Instant::now())
    }

    /// Live hosts that have pool memory, in id order.
    pub fn live_pool_hosts(&self) -> Vec<u32> {
        self.hosts
            .keys()
            .copied()
            .filter(|h| self.is_live(*h) && self.alloc.host_total(*h) > 0)
            .collect()
    }

    /// Host of a pool.
    pub fn pool_host(&self, gid: u32) -> Option<u32> {
        self.alloc.pool(gid).map(|p| p.pool.host_id)
    }

    /// Hosts holding data of a region, in order of first use.
    pub fn region_hosts(&self, ino: u64) -> Vec<u32> {
        let mut hosts: Vec<u32> = self
            .inodes
            .get(&ino)
            .and_then(Inode::object)
            .map(|o| o.host)
            .into_iter()
            .collect();
        for piece in pieces_of(self.maps.get(&ino).map_or(&[][..], Vec::as_slice)) {
            if let Some(h) = self.pool_host(piece.gid)
                && !hosts.contains(&h)
            {
                hosts.push(h);
            }
        }
        hosts
    }

    /// Queues daemon events for pieces assigned to or released from a region;
    /// `first_chunk` is the region chunk index of the first piece.
    pub fn queue_backing(&mut self, ino: u64, first_chunk: u64, entries: &[u64], assigned: bool) {
        let mut chunk = first_chunk;
        for piece in pieces_of(entries) {
            let backing = backing_of(ino, chunk, piece);
            chunk += piece.len;
            let Some(host) = self.pool_host(piece.gid) else {
                continue;
            };
            if assigned && let Some(revoked) = self.revoked.get(ino) {
                // Before the daemon can serve the new chunk, it knows which tokens are revoked.
                self.events.push((host, Event::Revoked(*revoked)));
            }
            let event = if assigned {
                Event::Assigned(backing)
            } else {
                Event::Released(backing)
            };
            self.events.push((host, event));
        }
    }

    /// The public view of an inode.
    pub fn attr(&self, inode: &Inode) -> v1::Attr {
        let allocated = self
            .maps
            .get(&inode.ino)
            .map_or(0, |m| m.len() as u64 * CHUNK_SIZE)
            + inode.object().map_or(0, |o| u64::from(o.capacity));
        v1::Attr {
            ino: inode.ino,
            kind: inode.kind.to_proto() as i32,
            mode: inode.mode,
            nlink: inode.nlink,
            uid: inode.uid,
            gid: inode.gid,
            size: inode.size,
            atime: Some(inode.atime.to_proto()),
            mtime: Some(inode.mtime.to_proto()),
            ctime: Some(inode.ctime.to_proto()),
            crtime: Some(inode.crtime.to_proto()),
            region_attrs: Some(inode.attrs.to_proto()),
            owner_pid: inode.owner_pid,
            owner_host: inode.owner_host,
            vaddr: inode.vaddr,
            allocated,
            rdev: inode.rdev,
            dir_lease: 0,
            attr_lease: 0,
        }
    }
}

/// The backing of `piece`, which holds region chunks from `chunk` on.
pub fn backing_of(ino: u64, chunk: u64, piece: Piece) -> v1::ChunkBacking {
    v1::ChunkBacking {
        pool_offset: piece.chunk * CHUNK_SIZE,
        ino,
        region_offset: chunk * CHUNK_SIZE,
        len: piece.len * CHUNK_SIZE,
        gid: piece.gid,
    }
}

/// Decodes a map entry's pool, for callers that only need the gid.
pub fn entry_gid(entry: u64) -> Option<u32> {
    MapEntry::decode(entry).map(|e| e.gid)
}
