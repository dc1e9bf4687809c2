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
//!   writer leaving bytes past the size) zeroes the object past the size.
//! - *Moving to chunks.* A region that outgrows its object, or that something needs as memory
//!   (`ExtendRequest.chunks`: a mapping, a segment, words for atomics), gets chunks in the same
//!   change that marks its object *moving* (durably). The manager then freezes the object
//!   (the daemon refuses writes to it from then on: writers refresh their map), copies its
//!   bytes into the first chunk, and records that the region has no object any more; then it
//!   frees the object. A manager that restarts finishes the moves it finds marked. This copy
//!   of at most [`MAX_OBJECT_BYTES`] is the only region data the manager ever moves.
//! - *Freeing.* Freeing the region frees its object (after the change; a manager crash in
//!   between leaves the object behind, which nothing names: the daemon keeps it until it
//!   restarts).
//! - *Losing.* An object on a host whose daemon restarted is gone: its region is marked lost.

use std::collections::HashMap;
use std::sync::Arc;

use regions_proto::frame::{OBJECT_REF_LEN, ObjectRef, Request};
use regions_proto::layout::MapEntry;
use regions_proto::v1;
use serde::{Deserialize, Serialize};

use crate::access::Caller;
use crate::error::Result;
use crate::manager::Manager;
use crate::model::{Inode, decode, encode};
use crate::state::State;
use crate::word_client::WordClient;

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

    /// The object part of [`State::resize`]: `Ok(true)` when the region is an object and the
    /// change fits in it (done: the size only); `Ok(false)` for a region without one, or one
    /// that is moving or must move (then marked moving, its move queued, and the caller
    /// allocates its chunks).
    pub fn resize_object(
        &mut self,
        ino: u64,
        new_size: u64,
        capacity: u64,
        to_chunks: bool,
    ) -> Result<bool> {
        let inode = self.region(ino)?;
        let Some(object) = inode.object().filter(|o| !o.moving) else {
            return Ok(false);
        };
        let old_size = inode.size;
        if to_chunks || new_size.max(capacity) > u64::from(object.capacity) {
            let inode = self.inode_mut(ino)?;
            inode.set_object(Some(ObjectPlacement {
                moving: true,
                ..object
            }));
            self.objects.jobs.push(ObjectJob::Move { ino });
            return Ok(false);
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
        }
        Ok(true)
    }

    /// Queues the zeroing of region `ino`'s object past its size (a shrink, or a writer that
    /// may have written there without making it part of the size).
    pub fn zero_object_tail(&mut self, ino: u64) {
        let Ok(inode) = self.region(ino) else {
            return;
        };
        if let Some(o) = inode.object().filter(|o| !o.moving) {
            let from = u32::try_from(inode.size).unwrap_or(u32::MAX);
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

    /// What moving region `ino` needs: its object, the bytes to copy, and where the first
    /// chunk is (pool, pool offset, its daemon's address) and the object's daemon's address.
    fn move_plan(&self, ino: u64) -> Option<(ObjectPlacement, u32, MapEntry, String, String)> {
        let inode = self.region(ino).ok()?;
        let object = inode.object().filter(|o| o.moving)?;
        let entry = MapEntry::decode(*self.maps.get(&ino)?.first()?)?;
        let chunk_host = self.pool_host(entry.gid)?;
        let addr = |h: u32| self.hosts.get(&h).map(|h| h.transport_addr.clone());
        let len = inode.size.min(u64::from(object.capacity)) as u32;
        Some((object, len, entry, addr(chunk_host)?, addr(object.host)?))
    }

    /// Records that region `ino` moved from `object` to its chunks.
    fn finish_move(&mut self, ino: u64, object: ObjectPlacement) -> bool {
        match self.inode_mut(ino) {
            Ok(inode) if inode.object() == Some(object) => {
                inode.set_object(None);
                inode.map_version += 1;
                true
            }
            _ => false,
        }
    }
}

/// How often queued object work is looked for (frees after unlinks, moves to retry).
const WORK_TICK: std::time::Duration = std::time::Duration::from_millis(200);

/// Does queued object work until the manager closes (work that requests did not do
/// themselves: frees of regions removed by unlinks, owner exits and lease expiry, and moves
/// that failed).
pub async fn run_object_work(manager: Arc<Manager>) {
    let mut closing = manager.closing();
    loop {
        tokio::select! {
            () = tokio::time::sleep(WORK_TICK) => {}
            _ = closing.wait_for(|c| *c) => return,
        }
        manager.object_work().await;
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
        self.place_small_object(caller, ino, size.max(capacity), true)
            .await;
        Ok(())
    }

    /// Allocates an object of `bytes` bytes for region `ino` and records it, if the region may
    /// be one; `durable`: returns once that is durable, else it is stored with the next batch
    /// (a new region's: nothing depends on it until its size is published). An object that
    /// cannot be had leaves the region to chunks.
    pub(crate) async fn place_small_object(
        &self,
        caller: &Caller,
        ino: u64,
        bytes: u64,
        durable: bool,
    ) {
        let Some(client) = self.object_client() else {
            return;
        };
        let wanted = self.peek(|s| {
            s.check_write_or_handle(caller, ino, "extend this region")
                .ok()
                .and_then(|()| s.object_host(ino, bytes))
                .and_then(|h| s.hosts.get(&h).map(|r| (h, r.transport_addr.clone())))
        });
        let Some(Some((host, addr))) = wanted else {
            return;
        };
        let len = u32::try_from(bytes).unwrap_or(u32::MAX);
        let reply = match client
            .call(&addr, &Request::ObjAlloc { ino, len }, OBJECT_REF_LEN + 4)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(ino, host, error = %e, "no object for a small region");
                return;
            }
        };
        let Ok((at, rest)) = ObjectRef::decode(regions_proto::frame::Op::ObjAlloc, &reply) else {
            return;
        };
        let capacity = rest
            .try_into()
            .map(u32::from_le_bytes)
            .unwrap_or(len)
            .max(len);
        let object = ObjectPlacement {
            host,
            address: at.address,
            slot: at.slot,
            id: at.id,
            capacity,
            moving: false,
        };
        let place = move |s: &mut State| Ok(s.place_object(ino, object, bytes));
        let placed = if durable {
            self.write(place).await
        } else {
            self.write_unwaited(place)
        };
        if !placed.unwrap_or(false) {
            let free = Request::ObjFree { ino, at };
            if let Err(e) = client.call(&addr, &free, 0).await {
                tracing::warn!(ino, host, error = %e, "cannot free an object no region took");
            }
        }
    }

    /// Does the object work changes queued (frees, zeroing, moves to chunks). Called after
    /// changes that may queue some, and from the lease loop; a move that fails is tried again
    /// there.
    pub async fn object_work(&self) {
        let Some(client) = self.object_client() else {
            return;
        };
        let jobs = self
            .in_memory(|s| std::mem::take(&mut s.objects.jobs))
            .unwrap_or_default();
        for job in jobs {
            let outcome = match job {
                ObjectJob::Free { host, ino, at } => match self.host_addr(host) {
                    Some(addr) => client
                        .call(&addr, &Request::ObjFree { ino, at }, 0)
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string()),
                    None => Ok(()),
                },
                ObjectJob::Zero {
                    host,
                    ino,
                    at,
                    from,
                    to,
                } => match self.host_addr(host) {
                    Some(addr) => {
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
                    None => Ok(()),
                },
                ObjectJob::Move { ino } => {
                    let moved = self.move_to_chunks(&client, ino).await;
                    if moved.is_err() {
                        self.in_memory(|s| s.objects.jobs.push(job));
                    }
                    moved
                }
            };
            if let Err(e) = outcome {
                tracing::warn!(?job, error = %e, "object work on a daemon failed");
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
        let Some(Some((object, len, entry, chunk_addr, object_addr))) =
            self.peek(|s| s.move_plan(ino))
        else {
            return Ok(()); // gone, or moved already
        };
        let at = object.at();
        let freeze = Request::ObjFreeze { ino, at };
        client
            .call(&object_addr, &freeze, 0)
            .await
            .map_err(|e| format!("freezing region {ino}'s object: {e}"))?;
        if len > 0 {
            let read = Request::ObjRead {
                ino,
                at,
                offset: 0,
                len,
            };
            let reply = client
                .call(&object_addr, &read, OBJECT_REF_LEN + len as usize)
                .await
                .map_err(|e| format!("reading region {ino}'s object: {e}"))?;
            let bytes = reply.get(OBJECT_REF_LEN..).unwrap_or_default().to_vec();
            client
                .write_region(&chunk_addr, ino, entry, &bytes)
                .await
                .map_err(|e| format!("copying region {ino}'s object to its chunk: {e}"))?;
        }
        let recorded = self
            .write(move |s| Ok(s.finish_move(ino, object)))
            .await
            .map_err(|e| format!("recording region {ino}'s move to chunks: {e}"))?;
        if recorded
            && let Err(e) = client
                .call(&object_addr, &Request::ObjFree { ino, at }, 0)
                .await
        {
            tracing::warn!(ino, error = %e, "cannot free the object of a region that moved");
        }
        tracing::debug!(
            ino,
            bytes = len,
            "small region moved from its object to chunks"
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
        };
        inode.set_object(Some(o));
        assert_eq!(inode.object(), Some(o));
        assert!(!inode.xattrs.keys().any(|k| k.starts_with("user.")));
        inode.set_object(None);
        assert_eq!(inode.object(), None);
        assert!(inode.xattrs.is_empty());
    }
}
