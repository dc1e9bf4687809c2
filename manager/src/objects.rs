//! Small regions stored as objects in a daemon's object store (docs/ARCHITECTURE.md, "Small
//! regions as objects"), with `--small-regions` set.
//!
//! - *Placing.* A region with no memory yet that grows to at most `--small-regions` bytes
//!   (and at most the largest object, [`MAX_OBJECT_BYTES`]) gets an object instead of chunks,
//!   on the host its chunks would go to, if that host's daemon keeps an object store. The
//!   manager allocates it over the daemon's transport before the change that records it; a
//!   change that no longer wants it (another caller placed the region meanwhile) frees it.
//! - *Recording.* Where the object is ([`ObjectPlacement`]) is kept in the inode's attribute
//!   map under [`OBJECT_KEY`], a key outside the `user.` namespace that no client can name, so
//!   stores written before objects still load (as the lost mark is).
//! - *Growing within the object* changes the size only. Shrinking (a truncate, or the last
//!   writer leaving bytes past the size) zeroes the object past the size; a region its last
//!   writer leaves empty gives its object back ([`State::drop_empty_object`]).
//! - *Growing into a larger object.* A write that outgrows its object within the limit gets an
//!   object of the limit holding its bytes, as a fit does ([`Manager::grow_object`]).
//! - *Moving to chunks.* A region that outgrows the limit, or that something needs as memory
//!   (`ExtendRequest.chunks`: a mapping, a segment, words for atomics), gets chunks in the same
//!   change that marks its object *moving* (durably). The manager then freezes the object
//!   (the daemon refuses writes to it from then on: writers refresh their map), copies its
//!   bytes into the first chunk, and records that the region has no object any more; then it
//!   frees the object. A manager that restarts finishes the moves it finds marked. This copy
//!   of at most [`MAX_OBJECT_BYTES`] is the only region data the manager ever moves.
//! - *Freeing.* Freeing the region frees its object (after the change; a manager crash in
//!   between leaves the object behind, which nothing names, until the next manager settles
//!   it).
//! - *Settling.* Every object request that allocates, fits or freezes names the manager's
//!   incarnation (random per run). A store that sees a new one takes every object it holds
//!   as *inherited*; about once a second the manager lists them
//!   ([`regions_proto::frame::Op::ObjInherited`]), keeps those its regions name (ending the
//!   freezes its predecessor left on objects whose region does not move) and frees the
//!   others: objects allocated, fitted or moved by a manager that crashed before recording
//!   or freeing them. A freeze lasts until a manager ends it, so a writer holding an old map
//!   never writes to an object its region gave up.
//! - *Correcting pointers.* A daemon's compaction moves objects between blocks; it keeps
//!   finding each by the pointer the manager recorded, and lists those pointers as indirect.
//!   About once a second the manager asks each object store for them, records each region's
//!   pointer at its object's own block in one change (not while the region moves or has
//!   object work under way: those wait for the next round), and then tells the daemon, which
//!   lets the old address go after a grace period (CoRM §3.2-3.3).
//! - *Losing.* An object on a host whose daemon restarted is gone: its region is marked lost.

use std::collections::HashMap;
use std::sync::Arc;

use regions_proto::frame::{
    HELD_OBJECT_LEN, HeldObject, INDIRECT_OBJECT_LEN, IndirectObject, MAX_INDIRECT, OBJECT_REF_LEN,
    ObjectRef, Request, Settle, SettleObject,
};
use regions_proto::layout::MapEntry;
use regions_proto::v1;
use serde::{Deserialize, Serialize};

use crate::access::Caller;
use crate::error::Result;
use crate::manager::Manager;
use crate::model::{Inode, decode, encode};
use crate::state::State;
use crate::word_client::WordClient;

/// Regions up to this many bytes are stored as objects unless configured otherwise
/// (`--small-regions`; 0 stores none).
pub const DEFAULT_SMALL_REGIONS: u64 = 4096;

/// Attribute-map key of a region's object placement.
pub const OBJECT_KEY: &str = "regions.object";

/// The largest object a daemon's store holds (its largest slot less the object's header).
pub const MAX_OBJECT_BYTES: u64 = 8192 - 32;

/// Where a small region's object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectPlacement {
    pub host: u32,
    pub address: u32,
    pub slot: u32,
    pub id: u32,
    /// Bytes the object holds.
    pub capacity: u32,
    /// The region is moving to chunks.
    pub moving: bool,
    /// While moving: the bytes of the object the move copies (all it holds, unpublished
    /// writes included, but what a shrink during the move cut off).
    pub keep: u32,
    /// Sized to its region (placed for a known size, or fitted when its size was published):
    /// not fitted again.
    pub fitted: bool,
}

/// A move to chunks: the object, its daemon, and where its bytes go (the first chunk and
/// its daemon; none when nothing is kept).
struct MovePlan {
    object: ObjectPlacement,
    object_addr: String,
    copy: Option<(MapEntry, String)>,
}

/// A region's object and the one fitted to its published size.
#[derive(Clone, Copy, Debug)]
pub struct Fit {
    pub old: ObjectPlacement,
    pub new: ObjectPlacement,
}

/// What [`State::resize_object`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectResize {
    /// The change fits in the object and is made.
    Done,
    /// The region must move from this object to chunks.
    Move(ObjectPlacement),
    /// The region's memory is chunks (no object, or one already moving).
    Chunks,
}

impl ObjectPlacement {
    /// The pointer object requests name.
    pub fn at(&self) -> ObjectRef {
        ObjectRef {
            address: self.address,
            slot: self.slot,
            id: self.id,
        }
    }
}

/// Work on daemons' objects, done after the change that decided it is durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectJob {
    /// Free a region's object.
    Free { host: u32, ino: u64, at: ObjectRef },
    /// Zero bytes `from..to` of a region's object.
    Zero {
        host: u32,
        ino: u64,
        at: ObjectRef,
        from: u32,
        to: u32,
    },
    /// Finish moving a region from its object to its chunks.
    Move { ino: u64 },
    /// Let a region's object take writes again (a fit given up whose thaw did not reach the
    /// daemon: a freeze lasts until it is ended).
    Thaw { host: u32, ino: u64, at: ObjectRef },
}

/// What the manager knows of objects (not stored but the placements in the inodes).
#[derive(Debug, Default)]
pub struct ObjectState {
    /// Bytes of each registered host's object store (0 or absent: none).
    pub hosts: HashMap<u32, u64>,
    /// Regions up to this many bytes become objects (`--small-regions`; 0: none).
    pub small_regions: u64,
    /// Work for daemons, taken by [`Manager::object_work`].
    pub jobs: Vec<ObjectJob>,
    /// Regions whose object work is under way, and how many jobs of each.
    pub in_flight: HashMap<u64, u32>,
    /// The inode number a create takes ([`State::next_ino`]): the one its object was
    /// allocated for ([`Manager::object_for_create`]).
    pub preset_ino: Option<u64>,
    /// Regions whose move to chunks the chunks' daemon refused for want of room (memory or
    /// open files), and what it said: the requests that wait for the move fail with `ENOSPC`
    /// until a retry succeeds.
    pub move_refusals: HashMap<u64, String>,
}

impl ObjectState {
    /// One job of region `ino` ended.
    fn done(&mut self, ino: u64) {
        if let Some(n) = self.in_flight.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(&ino);
            }
        }
    }
}

impl ObjectJob {
    /// The region the job is for.
    pub fn ino(&self) -> u64 {
        match *self {
            ObjectJob::Free { ino, .. }
            | ObjectJob::Zero { ino, .. }
            | ObjectJob::Move { ino }
            | ObjectJob::Thaw { ino, .. } => ino,
        }
    }
}

impl Inode {
    /// The region's object, if it is stored as one.
    pub fn object(&self) -> Option<ObjectPlacement> {
        self.xattrs
            .get(OBJECT_KEY)
            .and_then(|v| decode::<ObjectPlacement>(v).ok())
    }

    /// Records (or, with `None`, forgets) the region's object.
    pub fn set_object(&mut self, object: Option<ObjectPlacement>) {
        match object.and_then(|o| encode(&o).ok()) {
            Some(v) => drop(self.xattrs.insert(OBJECT_KEY.to_owned(), v)),
            None => drop(self.xattrs.remove(OBJECT_KEY)),
        }
    }
}

impl State {
    /// The bytes of the objects new small regions get up front (a writer's create).
    pub fn small_object_bytes(&self) -> u64 {
        self.objects.small_regions.min(MAX_OBJECT_BYTES)
    }

    /// Bytes of the live hosts' object stores, and the bytes the objects recorded in them
    /// take (each its capacity and a 32-byte header; the stores round up to size classes).
    pub fn object_space(&self) -> (u64, u64) {
        let total = self
            .objects
            .hosts
            .iter()
            .filter(|(h, _)| self.is_live(**h))
            .map(|(_, bytes)| *bytes)
            .sum();
        let used = self
            .inodes
            .values()
            .filter_map(Inode::object)
            .map(|o| u64::from(o.capacity) + 32)
            .sum();
        (total, used)
    }

    /// The host a new object of `bytes` bytes for region `ino` goes to, when the region may
    /// become one: no memory yet, small enough, neither MULTIHOSTED nor FIXVADDR, and a host
    /// with an object store where its chunks would go.
    pub fn object_host(&self, ino: u64, bytes: u64) -> Option<u32> {
        let limit = self.small_object_bytes();
        let inode = self.region(ino).ok()?;
        if bytes == 0
            || bytes > limit
            || inode.object().is_some()
            || self.maps.get(&ino).is_some_and(|m| !m.is_empty())
            || inode.attrs.multihosted
            || inode.attrs.fixvaddr
            || self.lost_reason(ino).is_some()
        {
            return None;
        }
        match self.placement(inode).ok()? {
            crate::allocator::Placement::Single(host)
                if self.objects.hosts.get(&host).is_some_and(|b| *b > 0) =>
            {
                Some(host)
            }
            _ => None,
        }
    }

    /// Records `object` (just allocated for `bytes` bytes) as region `ino`'s, if the region
    /// may still become one; `false`: it may not, and the caller frees the object.
    pub fn place_object(&mut self, ino: u64, object: ObjectPlacement, bytes: u64) -> bool {
        if self.object_host(ino, bytes) != Some(object.host) {
            return false;
        }
        match self.inode_mut(ino) {
            Ok(inode) => {
                inode.set_object(Some(object));
                inode.map_version += 1;
                true
            }
            Err(_) => false,
        }
    }

    /// The object part of [`State::resize`] (`shrink`: a truncate). [`ObjectResize::Done`]
    /// when the region is an object and the change fits in it (the size only, and zeroing
    /// what a shrink or a growing truncate exposes); [`ObjectResize::Move`] when it must move
    /// to chunks (the caller allocates them, then [`State::start_move`]); else
    /// [`ObjectResize::Chunks`] (no object, or one already moving).
    pub fn resize_object(
        &mut self,
        ino: u64,
        new_size: u64,
        capacity: u64,
        shrink: bool,
        to_chunks: bool,
    ) -> Result<ObjectResize> {
        let inode = self.region(ino)?;
        let Some(object) = inode.object() else {
            return Ok(ObjectResize::Chunks);
        };
        let old_size = inode.size;
        if object.moving {
            // The copy must not bring back what a shrink during the move cut off (a resize
            // that does not shrink keeps all: a writer's unpublished bytes go with it).
            if new_size < old_size && new_size < u64::from(object.keep) {
                let keep = new_size as u32;
                self.inode_mut(ino)?
                    .set_object(Some(ObjectPlacement { keep, ..object }));
            }
            return Ok(ObjectResize::Chunks);
        }
        if to_chunks || new_size.max(capacity) > u64::from(object.capacity) {
            return Ok(ObjectResize::Move(object));
        }
        let now = crate::model::Time::now();
        let inode = self.inode_mut(ino)?;
        if new_size != old_size {
            inode.size = new_size;
            inode.mtime = now;
            inode.ctime = now;
        }
        if new_size < old_size {
            self.revoke_capabilities(ino);
            self.zero_object_tail(ino);
        } else if shrink && new_size > old_size && self.writers(ino) == 0 {
            // A growing truncate with no writer: its new bytes read as zeros (a writer's own
            // bytes past the published size stay, as in a chunk).
            self.zero_object_from(ino, old_size);
        }
        Ok(ObjectResize::Done)
    }

    /// Marks region `ino`'s `object` moving (its chunks are allocated in the same change) and
    /// queues the move: everything it holds is copied, but what a shrink cut off.
    pub fn start_move(&mut self, ino: u64, object: ObjectPlacement, new_size: u64) {
        let size = self.region(ino).map_or(0, |i| i.size);
        let capacity = u64::from(object.capacity);
        let keep = if new_size < size {
            new_size.min(capacity)
        } else {
            capacity
        };
        if let Ok(inode) = self.inode_mut(ino) {
            inode.set_object(Some(ObjectPlacement {
                moving: true,
                keep: keep as u32,
                ..object
            }));
            inode.map_version += 1;
            self.objects.jobs.push(ObjectJob::Move { ino });
        }
    }

    /// Frees region `ino`'s object when its last writer left it empty (a file created and
    /// closed unwritten, or truncated to nothing): an empty region holds no memory, and a
    /// later write places an object again.
    pub fn drop_empty_object(&mut self, ino: u64) {
        let Some(o) = self
            .region(ino)
            .ok()
            .filter(|i| i.size == 0)
            .and_then(Inode::object)
            .filter(|o| !o.moving)
        else {
            return;
        };
        if let Ok(inode) = self.inode_mut(ino) {
            inode.set_object(None);
            inode.map_version += 1;
        }
        self.objects.jobs.push(ObjectJob::Free {
            host: o.host,
            ino,
            at: o.at(),
        });
    }

    /// Queues the zeroing of region `ino`'s object past its size (a shrink, or a writer that
    /// may have written there without making it part of the size).
    pub fn zero_object_tail(&mut self, ino: u64) {
        let size = self.region(ino).map_or(0, |i| i.size);
        self.zero_object_from(ino, size);
    }

    /// Queues the zeroing of region `ino`'s object from byte `from` to its end.
    fn zero_object_from(&mut self, ino: u64, from: u64) {
        let Ok(inode) = self.region(ino) else {
            return;
        };
        if let Some(o) = inode.object().filter(|o| !o.moving) {
            let from = u32::try_from(from).unwrap_or(u32::MAX);
            if from < o.capacity {
                self.objects.jobs.push(ObjectJob::Zero {
                    host: o.host,
                    ino,
                    at: o.at(),
                    from,
                    to: o.capacity,
                });
            }
        }
    }

    /// Queues the freeing of `inode`'s object (its region is being freed).
    pub fn free_object(&mut self, inode: &Inode) {
        if let Some(o) = inode.object() {
            self.objects.jobs.push(ObjectJob::Free {
                host: o.host,
                ino: inode.ino,
                at: o.at(),
            });
        }
    }

    /// Regions whose objects live on `host`.
    pub fn objects_on(&self, host: u32) -> Vec<u64> {
        self.inodes
            .values()
            .filter(|i| i.object().is_some_and(|o| o.host == host))
            .map(|i| i.ino)
            .collect()
    }

    /// Queues the moves a restart interrupted.
    pub fn resume_moves(&mut self) {
        let moving: Vec<u64> = self
            .inodes
            .values()
            .filter(|i| i.object().is_some_and(|o| o.moving))
            .map(|i| i.ino)
            .collect();
        for ino in moving {
            self.objects.jobs.push(ObjectJob::Move { ino });
        }
    }

    /// The object of `inode` as clients see it.
    pub fn object_info(&self, inode: &Inode) -> Option<v1::ObjectPlacement> {
        let o = inode.object()?;
        Some(v1::ObjectPlacement {
            host_id: o.host,
            transport_addr: self
                .hosts
                .get(&o.host)
                .map(|h| h.transport_addr.clone())
                .unwrap_or_default(),
            address: o.address,
            slot: o.slot,
            id: o.id,
            capacity: o.capacity,
            moving: o.moving,
        })
    }

    /// What moving region `ino` needs, or `None` when it is not moving (gone, lost, or moved
    /// already).
    fn move_plan(&self, ino: u64) -> Option<MovePlan> {
        let inode = self.region(ino).ok()?;
        let object = inode.object().filter(|o| o.moving)?;
        if self.lost_reason(ino).is_some() {
            return None;
        }
        let addr = |h: u32| self.hosts.get(&h).map(|h| h.transport_addr.clone());
        // A region cut to nothing during the move has no chunk to copy into, nor anything to
        // copy.
        let copy = match self.maps.get(&ino).and_then(|m| m.first()) {
            Some(&e) if object.keep > 0 => {
                let entry = MapEntry::decode(e)?;
                Some((entry, addr(self.pool_host(entry.gid)?)?))
            }
            _ => None,
        };
        Some(MovePlan {
            object,
            object_addr: addr(object.host)?,
            copy,
        })
    }

    /// Records `fit` (see [`Manager::fit_object`]) if the region still has its old object;
    /// whether it did.
    pub fn swap_object(&mut self, ino: u64, fit: Fit) -> bool {
        match self.inode_mut(ino) {
            Ok(inode) if inode.object() == Some(fit.old) => {
                inode.set_object(Some(fit.new));
                inode.map_version += 1;
                // The old object goes with the change that let it go.
                self.objects.jobs.push(ObjectJob::Free {
                    host: fit.old.host,
                    ino,
                    at: fit.old.at(),
                });
                true
            }
            _ => false,
        }
    }

    /// Records that region `ino` moved from `object` to its chunks (the same object, moving:
    /// its `keep` may have changed meanwhile), and queues the object's free.
    fn finish_move(&mut self, ino: u64, object: ObjectPlacement) -> bool {
        match self.inode_mut(ino) {
            Ok(inode)
                if inode
                    .object()
                    .is_some_and(|o| o.moving && o.at() == object.at()) =>
            {
                inode.set_object(None);
                inode.map_version += 1;
                self.objects.jobs.push(ObjectJob::Free {
                    host: object.host,
                    ino,
                    at: object.at(),
                });
                true
            }
            _ => false,
        }
    }
}

impl State {
    /// Records, for the objects of `host` listed in `moved`, each region's pointer at its
    /// object's own block, where the region still names the object by its old pointer and
    /// neither moves nor has object work under way (queued work follows the new pointer).
    /// Returns the pointers the daemon may now correct: those recorded, and those a region
    /// already names (recorded before a restart of the manager).
    pub fn correct_objects(
        &mut self,
        host: u32,
        moved: &[IndirectObject],
    ) -> Vec<(u64, ObjectRef)> {
        let mut out = Vec::new();
        for m in moved {
            if self.objects.in_flight.contains_key(&m.ino) {
                continue;
            }
            let Some(mut o) = self.region(m.ino).ok().and_then(Inode::object) else {
                continue;
            };
            if o.host != host || o.id != m.old.id || o.moving {
                continue;
            }
            if o.address == m.new.address {
                out.push((m.ino, m.new));
                continue;
            }
            if o.address != m.old.address {
                continue;
            }
            (o.address, o.slot) = (m.new.address, m.new.slot);
            if let Ok(inode) = self.inode_mut(m.ino) {
                inode.set_object(Some(o));
                inode.map_version += 1;
            }
            let named = |at: &ObjectRef| at.address == m.old.address && at.id == m.old.id;
            for job in &mut self.objects.jobs {
                match job {
                    ObjectJob::Free { host: h, ino, at }
                    | ObjectJob::Zero {
                        host: h, ino, at, ..
                    } if *h == host && *ino == m.ino && named(at) => *at = m.new,
                    _ => {}
                }
            }
            out.push((m.ino, m.new));
        }
        out
    }

    /// What to do with the objects of `host` that an earlier manager allocated (`held`): keep
    /// those a region names (by either pointer), thawing those whose region does not move;
    /// free the others. Objects of regions with object work queued or under way wait for a
    /// later round (the work names them, or frees them itself).
    pub fn settle_inherited(&self, host: u32, held: &[HeldObject]) -> Vec<SettleObject> {
        let busy = |ino: u64| {
            self.objects.in_flight.contains_key(&ino)
                || self.objects.jobs.iter().any(|j| j.ino() == ino)
        };
        held.iter()
            .map(|h| h.object)
            .filter(|h| !busy(h.ino))
            .map(|h| {
                let names = |o: &ObjectPlacement| {
                    o.host == host
                        && [h.old, h.new]
                            .iter()
                            .any(|p| p.address == o.address && p.id == o.id)
                };
                let settle = match self.region(h.ino).ok().and_then(Inode::object) {
                    Some(o) if names(&o) && o.moving => Settle::Keep,
                    Some(o) if names(&o) => Settle::KeepAndThaw,
                    _ => Settle::Free,
                };
                SettleObject {
                    ino: h.ino,
                    at: h.old,
                    settle,
                }
            })
            .collect()
    }
}

/// Object work taken from the queue and not done yet: back to the queue when dropped (the
/// request doing it was cancelled), so that no free, zeroing or move is lost.
struct TakenWork<'a> {
    manager: &'a Manager,
    jobs: std::collections::VecDeque<ObjectJob>,
}

impl Drop for TakenWork<'_> {
    fn drop(&mut self) {
        if self.jobs.is_empty() {
            return;
        }
        let left: Vec<ObjectJob> = self.jobs.drain(..).collect();
        tracing::debug!(jobs = left.len(), "object work given back to the queue");
        self.manager.in_memory(|s| {
            for job in left {
                s.objects.done(job.ino());
                s.objects.jobs.push(job);
            }
        });
    }
}

/// How often (in work ticks) the manager asks object stores for pointers to correct.
const CORRECTION_TICKS: u32 = 5;
/// Pointers asked for from one object store per round.
const CORRECTIONS_PER_ROUND: u32 = 1024;

/// Pages of inherited objects ([`MAX_INDIRECT`] each) one store settles per round at most.
const SETTLE_PAGES_PER_ROUND: u32 = 64;

/// How long a reply waits for object work another caller is doing for its region.
const SETTLE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// How often queued object work is looked for (frees after unlinks, moves to retry).
const WORK_TICK: std::time::Duration = std::time::Duration::from_millis(200);

/// Does queued object work until the manager closes (work that requests did not do
/// themselves: frees of regions removed by unlinks, owner exits and lease expiry, and moves
/// that failed).
pub async fn run_object_work(manager: Arc<Manager>) {
    let mut closing = manager.closing();
    let mut ticks = 0u32;
    loop {
        tokio::select! {
            () = tokio::time::sleep(WORK_TICK) => {}
            _ = closing.wait_for(|c| *c) => return,
        }
        manager.object_work().await;
        ticks += 1;
        if ticks.is_multiple_of(CORRECTION_TICKS) {
            manager.settle_inherited_objects().await;
            manager.correct_object_pointers().await;
        }
    }
}

impl Manager {
    /// Gives region `ino` an object when growing it by `size`/`capacity` bytes may make it one
    /// (see [`State::object_host`]); nothing to do otherwise, or without an object client.
    pub async fn place_small(
        &self,
        caller: &Caller,
        ino: u64,
        size: u64,
        capacity: u64,
    ) -> Result<()> {
        self.place_small_object(caller, ino, size.max(capacity))
            .await;
        Ok(())
    }

    /// Allocates an object of `bytes` bytes for region `ino` and records it (durably), if
    /// the region may be one. An object that cannot be had leaves the region to chunks.
    pub(crate) async fn place_small_object(&self, caller: &Caller, ino: u64, bytes: u64) {
        let wanted = self.peek(|s| {
            s.check_write_or_handle(caller, ino, "extend this region")
                .ok()
                .and_then(|()| s.object_host(ino, bytes))
        });
        let Some(Some(host)) = wanted else {
            return;
        };
        let Some(object) = self.alloc_object(host, ino, bytes).await else {
            return;
        };
        let object = ObjectPlacement {
            fitted: true,
            ..object
        };
        let place = move |s: &mut State| Ok(s.place_object(ino, object, bytes));
        if !self.write(place).await.unwrap_or(false) {
            self.free_unplaced(ino, object).await;
        }
    }

    /// For a writer's create: an inode number taken for the new region and an object of the
    /// small-region size allocated for it on the caller's host, when that host keeps an
    /// object store (the create records it if the new region may be an object, see
    /// [`State::object_host`]; else the caller frees it with [`Manager::free_unplaced`]).
    pub(crate) async fn object_for_create(
        &self,
        caller: &Caller,
    ) -> Option<(u64, ObjectPlacement)> {
        self.object_client()?;
        let (host, bytes) = self
            .peek(|s| {
                let bytes = s.small_object_bytes();
                (bytes > 0 && s.objects.hosts.get(&caller.host_id).is_some_and(|b| *b > 0))
                    .then_some((caller.host_id, bytes))
            })
            .flatten()?;
        let ino = self.in_memory(State::next_ino)?;
        let object = self.alloc_object(host, ino, bytes).await?;
        Some((ino, object))
    }

    /// An object of `bytes` bytes for region `ino` at `host`'s daemon.
    async fn alloc_object(&self, host: u32, ino: u64, bytes: u64) -> Option<ObjectPlacement> {
        let client = self.object_client()?;
        let addr = self.host_addr(host)?;
        let len = u32::try_from(bytes).unwrap_or(u32::MAX);
        let reply = match client
            .call(
                &addr,
                &Request::ObjAlloc {
                    ino,
                    len,
                    manager: self.incarnation(),
                },
                OBJECT_REF_LEN + 4,
            )
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(ino, host, error = %e, "no object for a small region");
                return None;
            }
        };
        let (at, rest) = ObjectRef::decode(regions_proto::frame::Op::ObjAlloc, &reply).ok()?;
        let capacity = rest
            .try_into()
            .map(u32::from_le_bytes)
            .unwrap_or(len)
            .max(len);
        Some(ObjectPlacement {
            host,
            address: at.address,
            slot: at.slot,
            id: at.id,
            capacity,
            moving: false,
            keep: 0,
            fitted: false,
        })
    }

    /// Frees an object allocated for region `ino` that no region took.
    pub(crate) async fn free_unplaced(&self, ino: u64, object: ObjectPlacement) {
        let (Some(client), Some(addr)) = (self.object_client(), self.host_addr(object.host)) else {
            return;
        };
        let free = Request::ObjFree {
            ino,
            at: object.at(),
        };
        if let Err(e) = client.call(&addr, &free, 0).await {
            tracing::warn!(ino, host = object.host, error = %e, "cannot free an object no region took");
        }
    }

    /// Before a writer publishes the size of a region whose object was placed for the
    /// small-region limit (a writer's create), when it is the region's only writer: an object
    /// of the published size, holding the region's bytes, with the old one frozen. The
    /// publish's change records it ([`State::swap_object`]); [`Manager::end_fit`] then frees
    /// whichever object lost. `None`: nothing to fit (or the region does not fit one).
    pub(crate) async fn fit_object(&self, caller: &Caller, ino: u64, size: u64) -> Option<Fit> {
        let client = self.object_client()?;
        let (old, size, addr) = self
            .peek(|s| {
                s.check_write_or_handle(caller, ino, "publish this region's size")
                    .ok()?;
                let inode = s.region(ino).ok()?;
                let old = inode.object().filter(|o| !o.moving && !o.fitted)?;
                let size = size.max(inode.size);
                (size > 0 && size <= u64::from(old.capacity) && s.writers(ino) <= 1)
                    .then(|| {
                        s.hosts
                            .get(&old.host)
                            .map(|h| (old, size, h.transport_addr.clone()))
                    })
                    .flatten()
            })
            .flatten()?;
        let len = u32::try_from(size).unwrap_or(u32::MAX);
        self.refit(&client, &addr, ino, old, len, true).await
    }

    /// One request to `old`'s daemon at `addr`: it allocates an object of `len` bytes for
    /// region `ino`, freezes `old` and copies it (or refuses, changing nothing, when a byte
    /// lies past the new one). The pair for the change that records it; `fitted`: the new
    /// object is sized to its region.
    async fn refit(
        &self,
        client: &WordClient,
        addr: &str,
        ino: u64,
        old: ObjectPlacement,
        len: u32,
        fitted: bool,
    ) -> Option<Fit> {
        let request = Request::ObjRefit {
            ino,
            at: old.at(),
            len,
            manager: self.incarnation(),
        };
        let reply = match client.call(addr, &request, OBJECT_REF_LEN + 4).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(ino, len, error = %e, "region's object not moved to one of another size");
                return None;
            }
        };
        let (new_at, rest) = ObjectRef::decode(regions_proto::frame::Op::ObjRefit, &reply).ok()?;
        let capacity = rest.try_into().map(u32::from_le_bytes).unwrap_or(len);
        let new = ObjectPlacement {
            address: new_at.address,
            slot: new_at.slot,
            id: new_at.id,
            capacity,
            fitted,
            ..old
        };
        Some(Fit { old, new })
    }

    /// For a write that outgrows region `ino`'s object within the small-region limit (it
    /// needs `bytes` bytes): an object of the limit holding the region's bytes, with the old
    /// one frozen, recorded by the extend's change like a fit ([`State::swap_object`]), so the
    /// region stays an object (and its writer's close fits it to its size again). `None`: the
    /// region is no object, moves, fits already, or would outgrow the limit (it moves to
    /// chunks).
    pub(crate) async fn grow_object(&self, caller: &Caller, ino: u64, bytes: u64) -> Option<Fit> {
        let client = self.object_client()?;
        let (old, limit, addr) = self
            .peek(|s| {
                s.check_write_or_handle(caller, ino, "extend this region")
                    .ok()?;
                let old = s.region(ino).ok()?.object().filter(|o| !o.moving)?;
                let limit = s.small_object_bytes();
                (bytes > u64::from(old.capacity) && bytes <= limit)
                    .then(|| {
                        s.hosts
                            .get(&old.host)
                            .map(|h| (old, limit, h.transport_addr.clone()))
                    })
                    .flatten()
            })
            .flatten()?;
        let len = u32::try_from(limit).unwrap_or(u32::MAX);
        self.refit(&client, &addr, ino, old, len, false).await
    }

    /// After the publish that recorded `fit` (`taken`) or did not: frees the object that
    /// lost (the old one off the reply's path, by the work loop), and lets the old one take
    /// writes again when it stays.
    pub(crate) async fn end_fit(&self, ino: u64, fit: Fit, taken: bool) {
        if taken {
            // Its change queued the old object's free.
            return;
        }
        self.free_unplaced(ino, fit.new).await;
        let thaw = ObjectJob::Thaw {
            host: fit.old.host,
            ino,
            at: fit.old.at(),
        };
        let done = match self.object_client() {
            Some(client) => self.do_job(&client, thaw).await,
            None => Ok(()),
        };
        if let Err(e) = done {
            // A freeze lasts until it is ended: the work loop tries again.
            tracing::debug!(ino, error = %e, "cannot thaw a region's object yet");
            self.in_memory(|s| s.objects.jobs.push(thaw));
        }
    }

    /// Does all object work queued (frees, zeroing, moves to chunks); the loop calls it, and
    /// a move or zeroing that fails is queued again.
    pub async fn object_work(&self) {
        self.object_work_of(None).await;
    }

    /// Does the object work queued for region `ino` (all with `None`), and waits (bounded)
    /// for what another caller is doing for it: a reply that hands out the region's map goes
    /// out after its object was zeroed or moved ([`Manager::settle_destructive_for`]).
    pub(crate) async fn object_work_of(&self, ino: Option<u64>) {
        let Some(client) = self.object_client() else {
            return;
        };
        let mine = |job: &ObjectJob| ino.is_none_or(|i| job.ino() == i);
        let jobs = self
            .in_memory(|s| {
                let (take, keep) = std::mem::take(&mut s.objects.jobs)
                    .into_iter()
                    .partition(|j| mine(j));
                s.objects.jobs = keep;
                for j in &take {
                    *s.objects.in_flight.entry(j.ino()).or_default() += 1;
                }
                take
            })
            .unwrap_or_default();
        if !jobs.is_empty() {
            // Only once the changes that queued them are durable: an object freed, zeroed
            // or moved must never be one a crash could give back to its region.
            if let Err(e) = self.read(|_| Ok(())).await {
                tracing::warn!(error = %e, "object work waits for the store");
                self.in_memory(|s| {
                    for job in &jobs {
                        s.objects.done(job.ino());
                    }
                    s.objects.jobs.extend(jobs.iter().copied());
                });
                return;
            }
        }
        // Taken work goes back to the queue if this future is dropped part-way (the client
        // whose request does it went away): every job is safe to do again.
        let mut taken = TakenWork {
            manager: self,
            jobs: jobs.into(),
        };
        while let Some(&job) = taken.jobs.front() {
            if let Err(e) = self.do_job(&client, job).await {
                tracing::warn!(?job, error = %e, "object work on a daemon failed");
                self.in_memory(|s| s.objects.jobs.push(job));
            }
            taken.jobs.pop_front();
            self.in_memory(|s| s.objects.done(job.ino()));
        }
        // What another caller is doing (for this region, or for any with `None`).
        let deadline = std::time::Instant::now() + SETTLE_WAIT;
        let busy = |s: &State| match ino {
            Some(ino) => s.objects.in_flight.contains_key(&ino),
            None => !s.objects.in_flight.is_empty(),
        };
        while self.peek(busy) == Some(true) && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    async fn do_job(&self, client: &WordClient, job: ObjectJob) -> std::result::Result<(), String> {
        match job {
            ObjectJob::Free { host, ino, at } => match self.host_addr(host) {
                // A daemon that refuses knows no such object (it restarted, or freed it):
                // nothing left to free. One out of reach is tried again.
                Some(addr) => match client.call(&addr, &Request::ObjFree { ino, at }, 0).await {
                    Ok(_) | Err(crate::word_client::WordError::Refused { .. }) => Ok(()),
                    Err(e) => Err(e.to_string()),
                },
                None => Ok(()),
            },
            ObjectJob::Zero {
                host,
                ino,
                at,
                from,
                to,
            } => {
                // Only while the region still has that object (it may have moved or gone).
                let current = self
                    .peek(|s| s.region(ino).ok().and_then(Inode::object))
                    .flatten()
                    .is_some_and(|o| o.at() == at && !o.moving);
                let Some(addr) = self.host_addr(host).filter(|_| current) else {
                    return Ok(());
                };
                let zeros = vec![0u8; to.saturating_sub(from) as usize];
                let write = Request::ObjWrite {
                    ino,
                    at,
                    offset: from,
                    data: zeros.into(),
                };
                client
                    .call(&addr, &write, OBJECT_REF_LEN)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
            ObjectJob::Move { ino } => {
                let moved = self.move_to_chunks(client, ino).await;
                if moved.is_ok() {
                    self.in_memory(|s| s.objects.move_refusals.remove(&ino));
                }
                moved
            }
            ObjectJob::Thaw { host, ino, at } => {
                // Only while the region still has that object and does not move.
                let current = self
                    .peek(|s| s.region(ino).ok().and_then(Inode::object))
                    .flatten()
                    .is_some_and(|o| o.host == host && o.at() == at && !o.moving);
                let Some(addr) = self.host_addr(host).filter(|_| current) else {
                    return Ok(());
                };
                match client.call(&addr, &Request::ObjThaw { ino, at }, 0).await {
                    Ok(_) | Err(crate::word_client::WordError::Refused { .. }) => Ok(()),
                    Err(e) => Err(e.to_string()),
                }
            }
        }
    }

    /// Moves region `ino` from its (moving) object to its first chunk: freeze, copy, record,
    /// free. `Err` leaves it moving, to be tried again.
    async fn move_to_chunks(
        &self,
        client: &WordClient,
        ino: u64,
    ) -> std::result::Result<(), String> {
        // Only once the moving mark is durable: a frozen object whose region does not say it
        // moves would refuse its writers for good after a crash.
        let plan = self
            .read(|s| Ok(s.move_plan(ino)))
            .await
            .map_err(|e| e.to_string())?;
        let Some(plan) = plan else {
            return Ok(()); // gone, lost, or moved already
        };
        let object = plan.object;
        let at = object.at();
        let freeze = Request::ObjFreeze {
            ino,
            at,
            manager: self.incarnation(),
        };
        client
            .call(&plan.object_addr, &freeze, 0)
            .await
            .map_err(|e| format!("freezing region {ino}'s object: {e}"))?;
        if let Some((entry, chunk_addr)) = &plan.copy {
            // Everything the object holds (writes whose size is not published yet too), but
            // what a shrink during the move cut off, read again now that it is frozen.
            let keep = self
                .peek(|s| s.region(ino).ok().and_then(Inode::object))
                .flatten()
                .map_or(object.keep, |o| o.keep.min(object.keep));
            if keep > 0 {
                let read = Request::ObjRead {
                    ino,
                    at,
                    offset: 0,
                    len: keep,
                };
                let reply = client
                    .call(&plan.object_addr, &read, OBJECT_REF_LEN + keep as usize)
                    .await
                    .map_err(|e| format!("reading region {ino}'s object: {e}"))?;
                let bytes = reply.get(OBJECT_REF_LEN..).unwrap_or_default().to_vec();
                if let Err(e) = client.write_region(chunk_addr, ino, *entry, &bytes).await {
                    let said = format!("copying region {ino}'s object to its chunk: {e}");
                    if let crate::word_client::WordError::Refused { errno, .. } = e
                        && [libc::ENOSPC, libc::EMFILE, libc::ENFILE, libc::ENOMEM]
                            .contains(&(errno as i32))
                    {
                        let kept = said.clone();
                        self.in_memory(|s| s.objects.move_refusals.insert(ino, kept));
                    }
                    return Err(said);
                }
            }
        }
        self.write(move |s| Ok(s.finish_move(ino, object)))
            .await
            .map_err(|e| format!("recording region {ino}'s move to chunks: {e}"))?;
        tracing::debug!(ino, "small region moved from its object to chunks");
        Ok(())
    }

    /// Settles, in every object store, the objects earlier managers allocated (see the
    /// module's "Settling"); a store out of reach is tried at the next round.
    pub async fn settle_inherited_objects(&self) {
        let Some(client) = self.object_client() else {
            return;
        };
        for (host, addr) in self.object_stores() {
            if let Err(e) = self.settle_inherited_on(&client, host, &addr).await {
                tracing::debug!(host, error = %e, "inherited objects not settled this round");
            }
        }
    }

    async fn settle_inherited_on(
        &self,
        client: &WordClient,
        host: u32,
        addr: &str,
    ) -> std::result::Result<(), String> {
        let manager = self.incarnation();
        for _ in 0..SETTLE_PAGES_PER_ROUND {
            let ask = Request::ObjInherited {
                manager,
                max: MAX_INDIRECT,
            };
            let reply = client
                .call(addr, &ask, MAX_INDIRECT as usize * HELD_OBJECT_LEN)
                .await
                .map_err(|e| format!("asking for inherited objects: {e}"))?;
            let held = HeldObject::decode_all(&reply).map_err(|e| e.to_string())?;
            // Decided only once the changes that placed, moved or freed objects are durable:
            // what a crash could undo must not decide what is freed.
            let objects = self
                .read(|s| Ok(s.settle_inherited(host, &held)))
                .await
                .map_err(|e| format!("deciding inherited objects: {e}"))?;
            if objects.is_empty() {
                return Ok(());
            }
            let page = objects.len();
            let settle = Request::ObjSettle { manager, objects };
            let reply = client
                .call(addr, &settle, 8)
                .await
                .map_err(|e| format!("settling inherited objects: {e}"))?;
            let count = |at: usize| {
                reply
                    .get(at..at + 4)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u32::from_le_bytes)
            };
            let (kept, freed) = (count(0), count(4));
            if freed > 0 {
                tracing::info!(
                    host,
                    kept,
                    freed,
                    "objects an earlier manager left unnamed freed"
                );
            }
            if page < MAX_INDIRECT as usize {
                return Ok(());
            }
        }
        Ok(())
    }

    /// The hosts with an object store, and their transport addresses.
    fn object_stores(&self) -> Vec<(u32, String)> {
        self.peek(|s| {
            s.objects
                .hosts
                .iter()
                .filter(|(_, bytes)| **bytes > 0)
                .filter_map(|(h, _)| s.hosts.get(h).map(|x| (*h, x.transport_addr.clone())))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
    }

    /// Corrects the pointers that compaction made indirect in every object store (see the
    /// module's "Correcting pointers"); a store out of reach is tried at the next round.
    pub async fn correct_object_pointers(&self) {
        let Some(client) = self.object_client() else {
            return;
        };
        for (host, addr) in self.object_stores() {
            if let Err(e) = self.correct_pointers_on(&client, host, &addr).await {
                tracing::debug!(host, error = %e, "object pointers not corrected this round");
            }
        }
    }

    async fn correct_pointers_on(
        &self,
        client: &WordClient,
        host: u32,
        addr: &str,
    ) -> std::result::Result<(), String> {
        let ask = Request::ObjIndirect {
            max: CORRECTIONS_PER_ROUND,
        };
        let reply = client
            .call(
                addr,
                &ask,
                CORRECTIONS_PER_ROUND as usize * INDIRECT_OBJECT_LEN,
            )
            .await
            .map_err(|e| format!("asking for moved objects: {e}"))?;
        let moved = IndirectObject::decode_all(&reply).map_err(|e| e.to_string())?;
        if moved.is_empty() {
            return Ok(());
        }
        let recorded = self
            .write(move |s| Ok(s.correct_objects(host, &moved)))
            .await
            .map_err(|e| format!("recording moved objects: {e}"))?;
        let n = recorded.len();
        for (ino, at) in recorded {
            client
                .call(addr, &Request::ObjCorrect { ino, at }, OBJECT_REF_LEN)
                .await
                .map_err(|e| format!("correcting region {ino}'s object pointer: {e}"))?;
        }
        tracing::debug!(
            host,
            corrected = n,
            "object pointers corrected after compaction"
        );
        Ok(())
    }

    fn host_addr(&self, host: u32) -> Option<String> {
        self.peek(|s| s.hosts.get(&host).map(|h| h.transport_addr.clone()))
            .flatten()
    }

    /// The client object requests go through, once the server gave the manager the secret
    /// (and only with `--small-regions`).
    fn object_client(&self) -> Option<Arc<WordClient>> {
        self.objects_client().cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Object work taken by a request that is cancelled part-way (its client went away) goes
    /// back to the queue, to be done by the work loop, and counts as under way no more.
    #[tokio::test]
    async fn work_of_a_cancelled_request_goes_back_to_the_queue() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::open(dir.path(), crate::Config::default()).unwrap();
        m.serve_objects(regions_proto::auth::Secret::new("object-work-test").unwrap());
        // A daemon that takes the connection and never answers.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap().to_string();
        m.register_host(&crate::cluster::HostRegistration {
            host_id: 1,
            transport_addr: addr,
            agent_socket: String::new(),
            memory_offered: 0,
            incarnation: 1,
            transports: String::new(),
            object_memory: 1 << 20,
        })
        .await
        .unwrap();
        let job = ObjectJob::Free {
            host: 1,
            ino: 77,
            at: ObjectRef {
                address: 1,
                slot: 2,
                id: 3,
            },
        };
        m.in_memory(|s| s.objects.jobs.push(job));
        let cut = tokio::time::timeout(
            std::time::Duration::from_millis(300),
            m.object_work_of(Some(77)),
        )
        .await;
        assert!(
            cut.is_err(),
            "the silent daemon holds the request until it is dropped"
        );
        let (queued, under_way) = m
            .peek(|s| (s.objects.jobs.clone(), s.objects.in_flight.clone()))
            .unwrap();
        assert_eq!(queued, vec![job], "the free is queued again");
        assert!(under_way.is_empty(), "{under_way:?}");
        drop(silent);
    }

    /// A restarted manager keeps the inherited objects its regions name (by the pointer it
    /// recorded or the one at the object's block), thaws those that do not move, frees the
    /// rest, and leaves those with object work queued to a later round.
    #[test]
    fn inherited_objects_are_kept_when_named_and_freed_otherwise() {
        let mut state = crate::state::State::new(std::time::Duration::from_secs(1), 0o755);
        let mut region = |ino: u64, object: Option<ObjectPlacement>| {
            let mut inode = state.inodes[&crate::model::ROOT_INO].clone();
            (inode.ino, inode.kind) = (ino, crate::model::Kind::Region);
            inode.set_object(object);
            state.inodes.insert(ino, inode);
        };
        let placed = |address: u32, id: u32, moving: bool| ObjectPlacement {
            host: 1,
            address,
            slot: 0,
            id,
            capacity: 100,
            moving,
            keep: 0,
            fitted: true,
        };
        region(10, Some(placed(1, 0xa, false)));
        region(11, Some(placed(2, 0xb, true)));
        region(12, Some(placed(7, 0xc, false)));
        region(13, None);
        region(14, Some(placed(4, 0xe, false)));
        let at = |address: u32, id: u32| ObjectRef {
            address,
            slot: 3,
            id,
        };
        let held = |ino: u64, old: ObjectRef, new: ObjectRef| HeldObject {
            object: IndirectObject { ino, old, new },
            frozen: true,
        };
        let listed = [
            held(10, at(1, 0xa), at(1, 0xa)),
            held(11, at(2, 0xb), at(2, 0xb)),
            // Recorded at its own block before the daemon heard of the correction.
            held(12, at(5, 0xc), at(7, 0xc)),
            // Its region names no object, or another one, or it is gone.
            held(13, at(3, 0xd), at(3, 0xd)),
            held(10, at(1, 0xf), at(1, 0xf)),
            held(99, at(6, 0x9), at(6, 0x9)),
            // A fit's free is queued for it: the work frees it.
            held(14, at(8, 0x8), at(8, 0x8)),
        ];
        state.objects.jobs.push(ObjectJob::Free {
            host: 1,
            ino: 14,
            at: at(8, 0x8),
        });
        let settled: Vec<(u64, u32, Settle)> = state
            .settle_inherited(1, &listed)
            .iter()
            .map(|o| (o.ino, o.at.id, o.settle))
            .collect();
        assert_eq!(
            settled,
            vec![
                (10, 0xa, Settle::KeepAndThaw),
                (11, 0xb, Settle::Keep),
                (12, 0xc, Settle::KeepAndThaw),
                (13, 0xd, Settle::Free),
                (10, 0xf, Settle::Free),
                (99, 0x9, Settle::Free),
            ]
        );
        // Another host's store: none of its objects is named.
        assert!(
            state
                .settle_inherited(2, &listed[..1])
                .iter()
                .all(|o| o.settle == Settle::Free)
        );
    }

    #[test]
    fn placements_live_in_the_attribute_map_and_round_trip() {
        let mut inode = crate::state::State::new(std::time::Duration::from_secs(1), 0o755)
            .inodes
            .remove(&crate::model::ROOT_INO)
            .unwrap();
        assert_eq!(inode.object(), None);
        let o = ObjectPlacement {
            host: 2,
            address: 7,
            slot: 3,
            id: 0xabc,
            capacity: 200,
            moving: false,
            keep: 0,
            fitted: false,
        };
        inode.set_object(Some(o));
        assert_eq!(inode.object(), Some(o));
        assert!(!inode.xattrs.keys().any(|k| k.starts_with("user.")));
        inode.set_object(None);
        assert_eq!(inode.object(), None);
        assert!(inode.xattrs.is_empty());
    }
}
