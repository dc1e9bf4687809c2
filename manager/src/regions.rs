//! Region placement and lifetime: sizes and maps, open handles, ONEWRITER,
//! fixed virtual addresses, freeing.

use regions_proto::layout::{CHUNK_SIZE, chunks_for};
use regions_proto::v1::{self, host_event::Event};

use crate::access::{self, Caller, READ, WRITE};
use crate::allocator::{self, Placement};
use crate::error::{ManagerError, Result};
use crate::model::{Handle, Inode, Time};
use crate::state::State;
use crate::vaddr;

/// Largest region size accepted (a 17-bit pool id and 128 KiB chunks address
/// far more; this bounds a single map to 2^31 entries).
pub const MAX_REGION_SIZE: u64 = (1 << 31) * CHUNK_SIZE;

impl State {
    /// Where new chunks of `inode` go (Remote Regions paper §6.9): MULTIHOSTED regions
    /// round robin over HOSTALLOC (or every live host); others on the first
    /// live HOSTALLOC host, else the owner's host if it offers memory, else
    /// the live host with the most free memory.
    pub fn placement(&self, inode: &Inode) -> Result<Placement> {
        let live = self.live_pool_hosts();
        let wanted: Vec<u32> = if inode.attrs.hostalloc.is_empty() {
            Vec::new()
        } else {
            let w: Vec<u32> = inode
                .attrs
                .hostalloc
                .iter()
                .copied()
                .filter(|h| live.contains(h))
                .collect();
            if w.is_empty() {
                return Err(ManagerError::NoSpace(format!(
                    "none of the HOSTALLOC hosts {:?} of region {} is live with pool memory",
                    inode.attrs.hostalloc, inode.ino
                )));
            }
            w
        };
        if inode.attrs.multihosted {
            return Ok(Placement::Spread(if wanted.is_empty() {
                live
            } else {
                wanted
            }));
        }
        if let Some(&host) = wanted.first() {
            return Ok(Placement::Single(host));
        }
        // A region that already has data stays where its data is.
        if let Some(&host) = self.region_hosts(inode.ino).first()
            && live.contains(&host)
        {
            return Ok(Placement::Single(host));
        }
        if live.contains(&inode.owner_host) {
            return Ok(Placement::Single(inode.owner_host));
        }
        live.iter()
            .copied()
            .max_by_key(|h| (self.alloc.host_free(*h), std::cmp::Reverse(*h)))
            .map(Placement::Single)
            .ok_or_else(|| {
                ManagerError::NoSpace("no live host offers pool memory; start a daemon".into())
            })
    }

    /// Bytes of pool memory `host`'s daemon could still add.
    pub fn headroom(&self, host: u32) -> u64 {
        let offered = self.hosts.get(&host).map_or(0, |h| h.memory_offered);
        offered.saturating_sub(self.alloc.host_total(host))
    }

    /// Sets the size of a region (when given) and makes its allocated
    /// chunks cover both the size and `capacity` bytes. With `shrink` (a
    /// truncate), chunks past that are freed; without it nothing is freed.
    /// Growing allocates all or nothing.
    pub fn resize(
        &mut self,
        ino: u64,
        size: Option<u64>,
        capacity: u64,
        shrink: bool,
    ) -> Result<()> {
        if shrink && size.is_some_and(|s| s > self.region(ino).map_or(0, |i| i.size)) {
            // A truncate that grows: its new bytes read as zeros, so the
            // space writers reserved past the old size (which may hold bytes
            // that never became part of it) is freed and allocated afresh.
            self.trim_reserved(ino, true);
        }
        let new_size = size.unwrap_or(self.region(ino)?.size);
        self.resize_to(ino, new_size, capacity, shrink, false)
    }

    /// [`State::resize`] with the size decided; `to_chunks`: a small region stored as an
    /// object moves to chunks even if the change fits in it.
    pub fn resize_to(
        &mut self,
        ino: u64,
        new_size: u64,
        capacity: u64,
        shrink: bool,
        to_chunks: bool,
    ) -> Result<()> {
        self.check_not_lost(ino)?;
        if new_size > MAX_REGION_SIZE || capacity > MAX_REGION_SIZE {
            return Err(ManagerError::TooBig(format!(
                "{} bytes is over the region limit of {MAX_REGION_SIZE} bytes",
                new_size.max(capacity)
            )));
        }
        // A small region's object takes what fits in it; past that it moves to chunks.
        let moving = match self.resize_object(ino, new_size, capacity, shrink, to_chunks)? {
            crate::objects::ObjectResize::Done => return Ok(()),
            crate::objects::ObjectResize::Move(object) => Some(object),
            crate::objects::ObjectResize::Chunks => None,
        };
        let inode = self.region(ino)?.clone();
        let map = self.maps.get(&ino).cloned().unwrap_or_default();
        let have = map.len() as u64;
        let mut target = chunks_for(new_size).max(chunks_for(capacity));
        if moving.is_some() {
            // The object's bytes go to the first chunk.
            target = target.max(1);
        }
        if !shrink {
            target = target.max(have);
        }
        let mut next = inode.clone();
        next.size = new_size;
        if next.attrs.fixvaddr {
            self.fit_vaddr(&mut next, target * CHUNK_SIZE)?;
        }
        let added = if target > have {
            let placement = self.placement(&inode)?;
            let headroom: Vec<(u32, u64)> =
                self.hosts.keys().map(|h| (*h, self.headroom(*h))).collect();
            allocator::grow_map(&mut self.alloc, &placement, &map, target, |h| {
                headroom
                    .iter()
                    .find(|(id, _)| *id == h)
                    .map_or(0, |(_, b)| *b)
            })?
        } else {
            Vec::new()
        };
        // Checks are done; change.
        let now = Time::now();
        if new_size < inode.size {
            // Tokens granted before a shrink end with it (before its chunks are released).
            self.revoke_capabilities(ino);
        }
        if target > have {
            self.queue_backing(ino, have, &added, true);
            self.maps.entry(ino).or_default().extend_from_slice(&added);
            self.mark_chunks(ino, have, target);
        } else if target < have {
            let freed: Vec<u64> = self
                .maps
                .get_mut(&ino)
                .map(|m| m.split_off(target as usize))
                .unwrap_or_default();
            self.queue_backing(ino, target, &freed, false);
            self.alloc.release_entries(&freed);
            self.mark_chunks(ino, target, have);
        }
        if new_size < inode.size && !new_size.is_multiple_of(CHUNK_SIZE) && target > 0 {
            for host in self.region_hosts(ino) {
                self.events.push((
                    host,
                    Event::Truncated(v1::RegionTruncated {
                        ino,
                        size: new_size,
                    }),
                ));
            }
        }
        if target != have {
            next.map_version += 1;
        }
        if new_size != inode.size {
            next.mtime = now;
            next.ctime = now;
        }
        self.put_inode(next);
        if let Some(object) = moving {
            self.start_move(ino, object, new_size);
        }
        Ok(())
    }

    /// Sets a region's mtime and ctime to now (a writer published writes).
    pub fn touch(&mut self, ino: u64) -> Result<()> {
        let mut inode = self.region(ino)?.clone();
        let now = Time::now();
        inode.mtime = now;
        inode.ctime = now;
        self.put_inode(inode);
        Ok(())
    }

    /// Notes that writers of `ino` reserved space past its size.
    pub fn note_reserved(&mut self, ino: u64) {
        self.reserved.insert(ino);
    }

    /// The last writer of a region that reserved space closed: frees the
    /// chunks past its size and, with `zero_tail`, zeroes what its last chunk
    /// holds past the size, so that bytes a writer wrote but never made part
    /// of the size (it crashed first) never show up when the region grows
    /// later. Without chunks to free or a tail to zero it changes nothing
    /// stored (the close stays a handle-only change, which nobody waits for).
    fn trim_reserved(&mut self, ino: u64, zero_tail: bool) {
        if !self.reserved.remove(&ino) {
            return;
        }
        let Ok(inode) = self.region(ino) else {
            return;
        };
        let size = inode.size;
        let allocated = self.maps.get(&ino).map_or(0, |m| m.len() as u64);
        if allocated > chunks_for(size)
            && let Err(e) = self.resize(ino, None, 0, true)
        {
            tracing::debug!(ino, error = %e, "cannot free the space reserved past a region's size");
            return;
        }
        if zero_tail && !size.is_multiple_of(CHUNK_SIZE) {
            for host in self.region_hosts(ino) {
                self.events
                    .push((host, Event::Truncated(v1::RegionTruncated { ino, size })));
            }
        }
    }

    /// Makes the fixed address range of `inode` cover `bytes`: reserves one
    /// if it has none, grows it in place if it can, else `EFBIG`.
    fn fit_vaddr(&mut self, inode: &mut Inode, bytes: u64) -> Result<()> {
        let want = vaddr::reservation_for(bytes);
        if inode.vaddr == 0 {
            let start = self.vaddrs.reserve(want).ok_or_else(|| {
                ManagerError::NoSpace(format!(
                    "no free fixed virtual address range of {want} bytes is left"
                ))
            })?;
            inode.vaddr = start;
            inode.vaddr_len = want;
        } else if bytes > inode.vaddr_len {
            if !self.vaddrs.grow(inode.vaddr, want) {
                return Err(ManagerError::TooBig(format!(
                    "region {} cannot grow past {} bytes at its fixed address {:#x}: the next range is taken",
                    inode.ino, inode.vaddr_len, inode.vaddr
                )));
            }
            inode.vaddr_len = want;
        }
        Ok(())
    }

    /// Applies a FIXVADDR change of a region (xattr).
    pub fn set_fixvaddr(&mut self, inode: &mut Inode) -> Result<()> {
        if inode.attrs.fixvaddr {
            let bytes = self
                .maps
                .get(&inode.ino)
                .map_or(0, |m| m.len() as u64 * CHUNK_SIZE);
            self.fit_vaddr(inode, bytes.max(inode.size))
        } else {
            if inode.vaddr != 0 {
                self.vaddrs.release(inode.vaddr);
            }
            inode.vaddr = 0;
            inode.vaddr_len = 0;
            Ok(())
        }
    }

    /// Frees a region: its chunks, address range, map and inode.
    pub fn free_region(&mut self, ino: u64) {
        self.reserved.remove(&ino);
        if let Some(inode) = self.inodes.get(&ino).cloned() {
            self.free_object(&inode);
        }
        if let Some(map) = self.maps.remove(&ino) {
            self.queue_backing(ino, 0, &map, false);
            self.alloc.release_entries(&map);
            self.mark_chunks(ino, 0, map.len() as u64);
        }
        if let Some(inode) = self.inodes.remove(&ino)
            && inode.vaddr != 0
        {
            self.vaddrs.release(inode.vaddr);
        }
        self.dirty.inodes.insert(ino);
    }

    /// Opens a region; `ETXTBSY` for a second writer of a ONEWRITER region.
    pub fn open_region(&mut self, caller: &Caller, ino: u64, write: bool) -> Result<Handle> {
        let inode = self.region(ino)?;
        self.check_path(caller, ino)?;
        self.check_not_lost(ino)?;
        let mask = if write { READ | WRITE } else { READ };
        access::check(
            caller,
            inode,
            mask,
            if write {
                "open this region for writing"
            } else {
                "open this region for reading"
            },
        )?;
        if write && inode.attrs.onewriter && self.writers(ino) > 0 {
            return Err(ManagerError::WriterBusy(ino));
        }
        let handle = Handle {
            id: self.counters.next_handle,
            ino,
            write,
            pid: caller.pid,
            host_id: caller.host_id,
        };
        self.counters.next_handle += 1;
        self.dirty.counters = true;
        if write && caller.lease_session != 0 {
            self.write_sessions.insert(handle.id, caller.lease_session);
        }
        self.handles.insert(handle.id, handle);
        self.open.entry(ino).or_default().insert(handle.id);
        self.dirty.handles.insert(handle.id);
        Ok(handle)
    }

    /// Permission to grow or truncate a region: write permission now, or a
    /// write handle (as with POSIX, where access is checked at open and an fd
    /// keeps it after a chmod). The handle must be the caller's own when the
    /// caller came through a host agent ([`Caller::by_inode`]); a mount (which
    /// the kernel tells which descriptor a request is for) may use any write
    /// handle opened from its host.
    pub fn check_write_or_handle(&self, caller: &Caller, ino: u64, what: &str) -> Result<()> {
        let inode = self.region(ino)?;
        self.check_path(caller, ino)?;
        let has_handle = self.handles_of(ino).any(|h| {
            h.write && h.host_id == caller.host_id && (!caller.by_inode || h.pid == caller.pid)
        });
        if has_handle {
            Ok(())
        } else {
            access::check(caller, inode, WRITE, what)
        }
    }

    pub(crate) fn writers(&self, ino: u64) -> usize {
        self.handles_of(ino).filter(|h| h.write).count()
    }

    /// Closes handle `id` for `caller`; frees the region if it was unlinked and this was its
    /// last handle, and returns whether it was freed. `wrote_within_size` says that every
    /// byte written through it lies below the size it made durable (else the last writer's
    /// close zeroes the region's tail, see [`State::release_handle`]).
    pub fn close_handle(
        &mut self,
        caller: &Caller,
        id: u64,
        wrote_within_size: bool,
    ) -> Result<bool> {
        let handle = *self
            .handles
            .get(&id)
            .ok_or_else(|| ManagerError::NotFound(format!("open handle {id}")))?;
        if handle.host_id != caller.host_id && !caller.is_root() {
            return Err(ManagerError::Perm(format!(
                "handle {id} belongs to host {}, not host {}",
                handle.host_id, caller.host_id
            )));
        }
        if caller.by_inode && !caller.is_root() && handle.pid != caller.pid {
            return Err(ManagerError::Perm(format!(
                "handle {id} belongs to process {}, not {}: close only handles your process opened",
                handle.pid, caller.pid
            )));
        }
        Ok(self.release_handle_of(id, wrote_within_size))
    }

    /// Drops a handle without checks (host loss, owner exit): its writes may lie past the
    /// size, so the last writer's close zeroes the region's tail.
    pub fn release_handle(&mut self, id: u64) -> bool {
        self.release_handle_of(id, false)
    }

    fn release_handle_of(&mut self, id: u64, wrote_within_size: bool) -> bool {
        let Some(handle) = self.handles.remove(&id) else {
            return false;
        };
        self.write_sessions.remove(&id);
        self.dirty.handles.insert(id);
        if handle.write {
            if !wrote_within_size {
                self.tail_written.insert(handle.ino);
            }
            if self.writers(handle.ino) == 0 {
                let zero_tail = self.tail_written.remove(&handle.ino);
                self.trim_reserved(handle.ino, zero_tail);
                if zero_tail {
                    self.zero_object_tail(handle.ino);
                }
                self.drop_empty_object(handle.ino);
            }
        }
        let last = match self.open.get_mut(&handle.ino) {
            Some(ids) => {
                ids.remove(&id);
                ids.is_empty()
            }
            None => true,
        };
        if last {
            self.open.remove(&handle.ino);
            if self.inodes.get(&handle.ino).is_some_and(|i| i.nlink == 0) {
                self.free_region(handle.ino);
                return true;
            }
        }
        false
    }

    /// Frees regions left unlinked with no handles (after a restart).
    pub fn free_orphans(&mut self) {
        let orphans: Vec<u64> = self
            .inodes
            .values()
            .filter(|i| i.nlink == 0 && !self.open.contains_key(&i.ino))
            .map(|i| i.ino)
            .collect();
        for ino in orphans {
            self.free_region(ino);
        }
    }

    /// The region info clients need: attributes, map and the pools it names.
    pub fn region_info(&self, ino: u64, known_version: Option<u64>) -> Result<v1::RegionInfo> {
        let inode = self.region(ino)?;
        self.check_not_lost(ino)?;
        let include = known_version != Some(inode.map_version);
        let map = self.maps.get(&ino).map_or(&[][..], Vec::as_slice);
        let mut pools = Vec::new();
        if include {
            for piece in allocator::pieces_of(map) {
                if pools.iter().any(|p: &v1::PoolInfo| p.gid == piece.gid) {
                    continue;
                }
                if let Some(space) = self.alloc.pool(piece.gid) {
                    let host = self.hosts.get(&space.pool.host_id);
                    pools.push(v1::PoolInfo {
                        gid: piece.gid,
                        host_id: space.pool.host_id,
                        size: space.pool.size,
                        free: space.free_chunks() * CHUNK_SIZE,
                        transport_addr: host.map(|h| h.transport_addr.clone()).unwrap_or_default(),
                    });
                }
            }
        }
        Ok(v1::RegionInfo {
            attr: Some(self.attr(inode)),
            map: if include { map.to_vec() } else { Vec::new() },
            map_version: inode.map_version,
            pools,
            handle: 0,
            map_included: include,
            object: self.object_info(inode),
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use regions_proto::layout::{CHUNKS_PER_EXTENT, EXTENT_SIZE, MapEntry};

    use super::*;
    use crate::cluster::HostRegistration;
    use crate::model::ROOT_INO;

    const MIB: u64 = 1 << 20;

    /// A state with `hosts` live hosts, each with one pool of `pool` bytes.
    fn cluster(hosts: u32, pool: u64) -> State {
        let mut s = State::new(Duration::from_secs(60), 0o1777);
        for h in 1..=hosts {
            s.register_host(&HostRegistration {
                host_id: h,
                transport_addr: format!("127.0.0.1:{}", 7100 + h),
                agent_socket: String::new(),
                memory_offered: pool,
                incarnation: 1,
                transports: String::new(),
                object_memory: 0,
            })
            .unwrap();
            s.register_pool(h, 0, pool).unwrap();
        }
        s
    }

    fn on_host(host: u32) -> Caller {
        Caller {
            uid: 1000,
            gid: 1000,
            groups: vec![],
            pid: 77,
            host_id: host,
            by_inode: false,
            lease_session: 0,
        }
    }

    fn new_region(s: &mut State, c: &Caller, name: &str) -> u64 {
        s.create_entry(c, ROOT_INO, name, 0o644, None).unwrap().ino
    }

    fn hosts_of_chunks(s: &State, ino: u64) -> Vec<u32> {
        s.maps[&ino]
            .iter()
            .map(|e| s.pool_host(MapEntry::decode(*e).unwrap().gid).unwrap())
            .collect()
    }

    #[test]
    fn single_host_regions_live_on_the_owners_host() {
        let mut s = cluster(3, 64 * MIB);
        let ino = new_region(&mut s, &on_host(2), "r");
        s.resize(ino, Some(10 * MIB), 10 * MIB, false).unwrap();
        assert_eq!(s.maps[&ino].len() as u64, 10 * MIB / CHUNK_SIZE);
        assert!(hosts_of_chunks(&s, ino).iter().all(|h| *h == 2));
        assert_eq!(s.region_hosts(ino), vec![2]);
        assert_eq!(s.inode(ino).unwrap().size, 10 * MIB);
        // HOSTALLOC picks the host of a single-host region.
        let other = new_region(&mut s, &on_host(2), "r2");
        s.inode_mut(other).unwrap().attrs.hostalloc = vec![3];
        s.resize(other, Some(MIB), MIB, false).unwrap();
        assert_eq!(s.region_hosts(other), vec![3]);
        // A caller whose host has no daemon lands on the emptiest live host.
        let stray = new_region(&mut s, &on_host(9), "stray");
        s.resize(stray, Some(MIB), MIB, false).unwrap();
        assert_eq!(s.region_hosts(stray), vec![1]);
    }

    #[test]
    fn multihosted_regions_round_robin_by_extent() {
        let mut s = cluster(3, 64 * MIB);
        let ino = new_region(&mut s, &on_host(1), "spread");
        s.inode_mut(ino).unwrap().attrs.multihosted = true;
        s.resize(ino, Some(12 * EXTENT_SIZE), 0, true).unwrap();
        let hosts = hosts_of_chunks(&s, ino);
        for (i, h) in hosts.iter().enumerate() {
            assert_eq!(*h, [1, 2, 3][(i as u64 / CHUNKS_PER_EXTENT % 3) as usize]);
        }
        let info = s.region_info(ino, None).unwrap();
        assert_eq!(info.pools.len(), 3);
        assert!(info.pools.iter().all(|p| !p.transport_addr.is_empty()));
        // HOSTALLOC limits the hosts.
        let two = new_region(&mut s, &on_host(1), "two");
        {
            let i = s.inode_mut(two).unwrap();
            i.attrs.multihosted = true;
            i.attrs.hostalloc = vec![3, 1];
        }
        s.resize(two, Some(4 * EXTENT_SIZE), 0, true).unwrap();
        let mut used = s.region_hosts(two);
        used.sort();
        assert_eq!(used, vec![1, 3]);
    }

    #[test]
    fn enospc_is_clean() {
        let mut s = cluster(2, 4 * MIB);
        let before: Vec<u64> = (1..=2).map(|h| s.alloc.host_free(h)).collect();
        let ino = new_region(&mut s, &on_host(1), "big");
        assert_eq!(
            s.resize(ino, Some(5 * MIB), 0, true).unwrap_err().errno(),
            libc::ENOSPC
        );
        assert!(s.maps[&ino].is_empty(), "no partial region");
        assert_eq!(s.inode(ino).unwrap().size, 0);
        s.inode_mut(ino).unwrap().attrs.multihosted = true;
        assert_eq!(
            s.resize(ino, Some(9 * MIB), 0, true).unwrap_err().errno(),
            libc::ENOSPC
        );
        let after: Vec<u64> = (1..=2).map(|h| s.alloc.host_free(h)).collect();
        assert_eq!(before, after, "nothing leaked");
        s.resize(ino, Some(8 * MIB), 0, true).unwrap();
        assert_eq!(s.alloc.host_free(1) + s.alloc.host_free(2), 0);
        // Deleting gives everything back.
        s.unlink(&on_host(1), ROOT_INO, "big").unwrap();
        let after: Vec<u64> = (1..=2).map(|h| s.alloc.host_free(h)).collect();
        assert_eq!(before, after);
    }

    #[test]
    fn shrinking_frees_chunks_and_tells_daemons() {
        let mut s = cluster(1, 16 * MIB);
        let ino = new_region(&mut s, &on_host(1), "r");
        s.resize(ino, Some(4 * MIB), 0, true).unwrap();
        assert!(
            s.events
                .iter()
                .any(|(h, e)| *h == 1 && matches!(e, Event::Assigned(_)))
        );
        s.events.clear();
        let v = s.inode(ino).unwrap().map_version;
        s.resize(ino, Some(CHUNK_SIZE + 10), 0, true).unwrap();
        assert_eq!(s.maps[&ino].len(), 2);
        assert_eq!(s.alloc.host_free(1), 16 * MIB - 2 * CHUNK_SIZE);
        assert!(s.inode(ino).unwrap().map_version > v);
        assert!(
            s.events
                .iter()
                .any(|(_, e)| matches!(e, Event::Released(b) if b.region_offset == 2 * CHUNK_SIZE))
        );
        assert!(
            s.events
                .iter()
                .any(|(_, e)| matches!(e, Event::Truncated(t) if t.size == CHUNK_SIZE + 10))
        );
        // Growing the size again allocates fresh chunks.
        s.resize(ino, Some(3 * MIB), 0, true).unwrap();
        assert_eq!(s.maps[&ino].len() as u64, 3 * MIB / CHUNK_SIZE);
    }

    #[test]
    fn the_last_writer_zeroes_the_tail_unless_every_writer_wrote_within_the_size() {
        let mut s = cluster(1, 16 * MIB);
        let c = on_host(1);
        // A new file of 1000 bytes in a reserved chunk, as a mount writes one.
        let write_file = |s: &mut State, name: &str| {
            let ino = new_region(s, &c, name);
            s.resize(ino, None, CHUNK_SIZE, false).unwrap();
            s.note_reserved(ino);
            let h = s.open_region(&c, ino, true).unwrap();
            s.resize(ino, Some(1000), 0, false).unwrap();
            s.events.clear();
            s.dirty = crate::state::Dirty::default();
            (ino, h.id)
        };
        let zeroed = |s: &State, ino: u64| {
            s.events
                .iter()
                .any(|(_, e)| matches!(e, Event::Truncated(t) if t.ino == ino && t.size == 1000))
        };

        // Its writer says it wrote within the size: nothing to zero, nothing but the
        // handle stored (a change nobody waits for).
        let (a, ha) = write_file(&mut s, "a");
        s.close_handle(&c, ha, true).unwrap();
        assert!(!zeroed(&s, a));
        assert!(s.dirty.only_handles(), "{:?}", s.dirty);

        // One that does not say so has the tail zeroed.
        let (b, hb) = write_file(&mut s, "b");
        s.close_handle(&c, hb, false).unwrap();
        assert!(zeroed(&s, b));

        // Nor does a second writer that closed first without saying so.
        let (d, hd) = write_file(&mut s, "d");
        let other = s.open_region(&c, d, true).unwrap();
        s.close_handle(&c, other.id, false).unwrap();
        assert!(!zeroed(&s, d), "a writer is still open");
        s.close_handle(&c, hd, true).unwrap();
        assert!(zeroed(&s, d));

        // A writer whose handle is dropped for it (host lost, owner gone) may have written
        // anything past the size.
        let (e, he) = write_file(&mut s, "e");
        s.release_handle(he);
        assert!(zeroed(&s, e));
        assert!(s.tail_written.is_empty());
    }

    #[test]
    fn fixed_vaddrs_are_unique_and_reused() {
        let mut s = cluster(1, 64 * MIB);
        let mut seen = Vec::new();
        for i in 0..20 {
            let ino = new_region(&mut s, &on_host(1), &format!("v{i}"));
            let mut inode = s.inode(ino).unwrap().clone();
            inode.attrs.fixvaddr = true;
            s.set_fixvaddr(&mut inode).unwrap();
            s.put_inode(inode);
            s.resize(ino, Some(MIB), 0, true).unwrap();
            let i = s.inode(ino).unwrap();
            assert!(i.vaddr >= regions_proto::layout::VADDR_WINDOW_START);
            for (start, len) in &seen {
                assert!(i.vaddr + i.vaddr_len <= *start || start + len <= i.vaddr);
            }
            seen.push((i.vaddr, i.vaddr_len));
        }
        let first = seen[0].0;
        s.unlink(&on_host(1), ROOT_INO, "v0").unwrap();
        let ino = new_region(&mut s, &on_host(1), "again");
        let mut inode = s.inode(ino).unwrap().clone();
        inode.attrs.fixvaddr = true;
        s.set_fixvaddr(&mut inode).unwrap();
        assert_eq!(inode.vaddr, first, "a freed range is handed out again");
    }

    #[test]
    fn onewriter_refuses_a_second_writer() {
        let mut s = cluster(2, 16 * MIB);
        let ino = new_region(&mut s, &on_host(1), "ow");
        s.inode_mut(ino).unwrap().attrs.onewriter = true;
        let w = s.open_region(&on_host(1), ino, true).unwrap();
        assert!(
            s.open_region(&on_host(2), ino, false).is_ok(),
            "readers are fine"
        );
        assert_eq!(
            s.open_region(&on_host(2), ino, true).unwrap_err().errno(),
            libc::ETXTBSY
        );
        assert_eq!(
            s.close_handle(&on_host(2), w.id, false)
                .unwrap_err()
                .errno(),
            libc::EPERM
        );
        s.close_handle(&on_host(1), w.id, false).unwrap();
        assert!(s.open_region(&on_host(2), ino, true).is_ok());
        assert_eq!(
            s.close_handle(&on_host(1), 4242, false)
                .unwrap_err()
                .errno(),
            libc::ENOENT
        );
    }

    #[test]
    fn open_checks_permissions() {
        let mut s = cluster(1, 16 * MIB);
        let ino = new_region(&mut s, &on_host(1), "p");
        s.inode_mut(ino).unwrap().mode = 0o600;
        let other = Caller {
            uid: 2000,
            ..on_host(1)
        };
        assert_eq!(
            s.open_region(&other, ino, false).unwrap_err().errno(),
            libc::EACCES
        );
        assert!(s.open_region(&Caller::root(1), ino, true).is_ok());
    }

    #[test]
    fn an_open_write_handle_keeps_the_right_to_grow_after_chmod() {
        let mut s = cluster(1, 16 * MIB);
        let ino = new_region(&mut s, &on_host(1), "r");
        let h = s.open_region(&on_host(1), ino, true).unwrap();
        s.inode_mut(ino).unwrap().mode = 0o400;
        assert!(s.check_write_or_handle(&on_host(1), ino, "grow").is_ok());
        let elsewhere = on_host(2);
        assert_eq!(
            s.check_write_or_handle(&elsewhere, ino, "grow")
                .unwrap_err()
                .errno(),
            libc::EACCES
        );
        // Through a host agent, only the process that holds the handle keeps the right.
        let same_process = Caller {
            by_inode: true,
            ..on_host(1)
        };
        assert!(s.check_write_or_handle(&same_process, ino, "grow").is_ok());
        let neighbour = Caller {
            pid: same_process.pid + 1,
            ..same_process.clone()
        };
        assert_eq!(
            s.check_write_or_handle(&neighbour, ino, "grow")
                .unwrap_err()
                .errno(),
            libc::EACCES
        );
        s.close_handle(&on_host(1), h.id, false).unwrap();
        assert_eq!(
            s.check_write_or_handle(&on_host(1), ino, "grow")
                .unwrap_err()
                .errno(),
            libc::EACCES
        );
    }

    #[test]
    fn unlinked_open_regions_live_until_the_last_close() {
        let mut s = cluster(1, 16 * MIB);
        let ino = new_region(&mut s, &on_host(1), "r");
        s.resize(ino, Some(MIB), 0, true).unwrap();
        let h = s.open_region(&on_host(1), ino, true).unwrap();
        s.unlink(&on_host(1), ROOT_INO, "r").unwrap();
        assert!(s.inode(ino).is_ok(), "still reachable through the handle");
        assert_eq!(s.alloc.host_free(1), 15 * MIB);
        assert!(s.close_handle(&on_host(1), h.id, false).unwrap());
        assert!(s.inode(ino).is_err());
        assert_eq!(s.alloc.host_free(1), 16 * MIB);
    }

    #[test]
    fn pool_chunks_describe_backing() {
        let mut s = cluster(1, 16 * MIB);
        let a = new_region(&mut s, &on_host(1), "a");
        let b = new_region(&mut s, &on_host(1), "b");
        s.resize(a, Some(MIB), 0, true).unwrap();
        s.resize(b, Some(MIB), 0, true).unwrap();
        let gid = s.alloc.pools().next().unwrap().pool.gid;
        let chunks = s.pool_chunks(gid).unwrap();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks.iter().map(|c| c.len).sum::<u64>(), 2 * MIB);
        assert!(chunks.iter().all(|c| c.region_offset == 0));
        assert_eq!(s.pool_chunks(999).unwrap_err().errno(), libc::ENOENT);
    }
}
