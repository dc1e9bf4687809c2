//! The cluster allocator: free space of every pool, in chunks, and the
//! placement policy of Remote Regions paper §6.9 (single-host regions on one host,
//! MULTIHOSTED regions round robin by extent).

use std::collections::BTreeMap;

use regions_proto::layout::{CHUNK_SIZE, CHUNKS_PER_EXTENT, MapEntry};

use crate::error::{ManagerError, Result};
use crate::model::Pool;

/// Consecutive chunks of one pool given to a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub gid: u32,
    /// First chunk (pool offset / CHUNK_SIZE).
    pub chunk: u64,
    pub len: u64,
}

impl Piece {
    /// The map entries of this piece, in order.
    pub fn entries(self) -> impl Iterator<Item = u64> {
        (self.chunk..self.chunk + self.len).map(move |c| {
            MapEntry {
                gid: self.gid,
                pool_offset: c * CHUNK_SIZE,
            }
            .encode()
            .unwrap_or(0)
        })
    }
}

/// Free space of one pool, as runs of free chunks.
#[derive(Clone, Debug)]
pub struct PoolSpace {
    pub pool: Pool,
    /// Start chunk → length of each free run; runs never touch.
    free: BTreeMap<u64, u64>,
    free_chunks: u64,
}

impl PoolSpace {
    pub fn new(pool: Pool) -> PoolSpace {
        let chunks = pool.size / CHUNK_SIZE;
        let mut free = BTreeMap::new();
        if chunks > 0 {
            free.insert(0, chunks);
        }
        PoolSpace {
            pool,
            free,
            free_chunks: chunks,
        }
    }

    pub fn total_chunks(&self) -> u64 {
        self.pool.size / CHUNK_SIZE
    }

    pub fn free_chunks(&self) -> u64 {
        self.free_chunks
    }

    /// Takes up to `max` chunks starting exactly at `chunk`, if it is free.
    fn take_at(&mut self, chunk: u64, max: u64) -> u64 {
        let Some((&start, &len)) = self.free.range(..=chunk).next_back() else {
            return 0;
        };
        if chunk >= start + len {
            return 0;
        }
        let taken = max.min(start + len - chunk);
        self.remove_from_run(start, len, chunk, taken);
        taken
    }

    /// Takes up to `max` chunks from the first run that holds them all, or
    /// else from the largest run.
    fn take_any(&mut self, max: u64) -> Option<(u64, u64)> {
        let (&start, &len) = self
            .free
            .iter()
            .find(|(_, len)| **len >= max)
            .or_else(|| self.free.iter().max_by_key(|(_, len)| **len))?;
        let taken = max.min(len);
        self.remove_from_run(start, len, start, taken);
        Some((start, taken))
    }

    fn remove_from_run(&mut self, start: u64, len: u64, at: u64, taken: u64) {
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let end = start + len;
        if at + taken < end {
            self.free.insert(at + taken, end - (at + taken));
        }
        self.free_chunks -= taken;
    }

    /// Marks chunks as used (loading stored maps). False if any is not free.
    pub fn mark_used(&mut self, chunk: u64, len: u64) -> bool {
        let Some((&start, &run)) = self.free.range(..=chunk).next_back() else {
            return false;
        };
        if chunk + len > start + run {
            return false;
        }
        self.remove_from_run(start, run, chunk, len);
        true
    }

    /// Returns chunks to the free space, merging with neighbouring runs.
    /// The chunks must be in use.
    pub fn release(&mut self, chunk: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.free_chunks += len;
        let mut start = chunk;
        let mut end = chunk + len;
        if let Some((&prev, &plen)) = self.free.range(..chunk).next_back()
            && prev + plen == chunk
        {
            self.free.remove(&prev);
            start = prev;
        }
        if let Some(next_len) = self.free.remove(&end) {
            end += next_len;
        }
        self.free.insert(start, end - start);
    }

    /// Grows the pool to `size` bytes (never shrinks).
    pub fn grow(&mut self, size: u64) {
        let old = self.total_chunks();
        let new = size / CHUNK_SIZE;
        if new > old {
            self.pool.size = new * CHUNK_SIZE;
            self.release(old, new - old);
        }
    }
}

/// Every pool's free space.
#[derive(Clone, Debug, Default)]
pub struct Allocator {
    pools: BTreeMap<u32, PoolSpace>,
}

impl Allocator {
    /// Adds a pool, or grows a known one.
    pub fn add_pool(&mut self, pool: Pool) {
        match self.pools.get_mut(&pool.gid) {
            Some(space) => space.grow(pool.size),
            None => {
                self.pools.insert(pool.gid, PoolSpace::new(pool));
            }
        }
    }

    pub fn pool(&self, gid: u32) -> Option<&PoolSpace> {
        self.pools.get(&gid)
    }

    pub fn pools(&self) -> impl Iterator<Item = &PoolSpace> {
        self.pools.values()
    }

    pub fn host_pools(&self, host: u32) -> impl Iterator<Item = &PoolSpace> {
        self.pools.values().filter(move |p| p.pool.host_id == host)
    }

    /// Pool bytes registered by `host`.
    pub fn host_total(&self, host: u32) -> u64 {
        self.host_pools(host).map(|p| p.pool.size).sum()
    }

    /// Free pool bytes at `host`.
    pub fn host_free(&self, host: u32) -> u64 {
        self.host_pools(host)
            .map(|p| p.free_chunks() * CHUNK_SIZE)
            .sum()
    }

    /// Marks a stored map entry's chunk as used; false if it was not free.
    pub fn mark_used(&mut self, entry: u64) -> bool {
        let Some(e) = MapEntry::decode(entry) else {
            return false;
        };
        self.pools
            .get_mut(&e.gid)
            .is_some_and(|p| p.mark_used(e.pool_offset / CHUNK_SIZE, 1))
    }

    /// Frees the chunks named by map entries.
    pub fn release_entries(&mut self, entries: &[u64]) {
        for piece in pieces_of(entries) {
            self.release(piece);
        }
    }

    pub fn release(&mut self, piece: Piece) {
        if let Some(p) = self.pools.get_mut(&piece.gid) {
            p.release(piece.chunk, piece.len);
        }
    }

    /// Takes `count` chunks from `host`'s pools, continuing at `hint` (the
    /// chunk after the region's last one) when that is free. All or nothing.
    pub fn take_on_host(
        &mut self,
        host: u32,
        count: u64,
        hint: Option<(u32, u64)>,
    ) -> Option<Vec<Piece>> {
        let free: u64 = self.host_pools(host).map(PoolSpace::free_chunks).sum();
        if free < count {
            return None;
        }
        let mut pieces = Vec::new();
        let mut need = count;
        if let Some((gid, chunk)) = hint
            && let Some(space) = self.pools.get_mut(&gid)
            && space.pool.host_id == host
        {
            let got = space.take_at(chunk, need);
            if got > 0 {
                pieces.push(Piece {
                    gid,
                    chunk,
                    len: got,
                });
                need -= got;
            }
        }
        let gids: Vec<u32> = self.host_pools(host).map(|p| p.pool.gid).collect();
        for gid in gids {
            while need > 0 {
                let Some(space) = self.pools.get_mut(&gid) else {
                    break;
                };
                let Some((chunk, got)) = space.take_any(need) else {
                    break;
                };
                match pieces.last_mut() {
                    Some(last) if last.gid == gid && last.chunk + last.len == chunk => {
                        last.len += got
                    }
                    _ => pieces.push(Piece {
                        gid,
                        chunk,
                        len: got,
                    }),
                }
                need -= got;
            }
        }
        Some(pieces)
    }
}

/// Groups consecutive map entries that are consecutive chunks of one pool.
pub fn pieces_of(entries: &[u64]) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = Vec::new();
    for e in entries.iter().filter_map(|&raw| MapEntry::decode(raw)) {
        let chunk = e.pool_offset / CHUNK_SIZE;
        match pieces.last_mut() {
            Some(last) if last.gid == e.gid && last.chunk + last.len == chunk => last.len += 1,
            _ => pieces.push(Piece {
                gid: e.gid,
                chunk,
                len: 1,
            }),
        }
    }
    pieces
}

/// Where new chunks of a region may go.
#[derive(Clone, Debug)]
pub enum Placement {
    /// Every chunk on this host.
    Single(u32),
    /// Round robin by extent over these hosts (in order).
    Spread(Vec<u32>),
}

/// The chunk after the last one of `map`, as an allocation hint.
fn hint_after(map: &[u64]) -> Option<(u32, u64)> {
    let last = MapEntry::decode(*map.last()?)?;
    Some((last.gid, last.pool_offset / CHUNK_SIZE + 1))
}

/// Allocates the chunks that grow `map` to `target` chunks under `placement`
/// and returns their entries. All or nothing: on failure nothing is taken.
/// `headroom(host)` says how many more pool bytes a host's daemon could add;
/// when that would make the difference the error is [`ManagerError::NeedPool`].
pub fn grow_map(
    alloc: &mut Allocator,
    placement: &Placement,
    map: &[u64],
    target: u64,
    headroom: impl Fn(u32) -> u64,
) -> Result<Vec<u64>> {
    let have = map.len() as u64;
    if target <= have {
        return Ok(Vec::new());
    }
    let mut taken: Vec<Piece> = Vec::new();
    let mut entries: Vec<u64> = Vec::with_capacity((target - have) as usize);
    let fail = |alloc: &mut Allocator, taken: &[Piece], err: ManagerError| {
        for p in taken {
            alloc.release(*p);
        }
        Err(err)
    };
    match placement {
        Placement::Single(host) => {
            let count = target - have;
            match alloc.take_on_host(*host, count, hint_after(map)) {
                Some(pieces) => {
                    for p in pieces {
                        entries.extend(p.entries());
                    }
                }
                None => {
                    let short = (count - alloc.host_free(*host) / CHUNK_SIZE) * CHUNK_SIZE;
                    let err = if headroom(*host) >= short {
                        ManagerError::NeedPool {
                            host: *host,
                            bytes: short,
                        }
                    } else {
                        ManagerError::NoSpace(format!(
                            "host {host} has {} bytes free and cannot hold {} more; free memory, add hosts, or set user.regions.multihosted=1",
                            alloc.host_free(*host),
                            count * CHUNK_SIZE
                        ))
                    };
                    return fail(alloc, &taken, err);
                }
            }
        }
        Placement::Spread(hosts) => {
            if hosts.is_empty() {
                return Err(ManagerError::NoSpace(
                    "no live host with pool memory to place a multi-hosted region on".into(),
                ));
            }
            let mut chunk = have;
            while chunk < target {
                let extent = chunk / CHUNKS_PER_EXTENT;
                let end = ((extent + 1) * CHUNKS_PER_EXTENT).min(target);
                let count = end - chunk;
                let first = (extent % hosts.len() as u64) as usize;
                let mut placed = false;
                for i in 0..hosts.len() {
                    let host = hosts[(first + i) % hosts.len()];
                    let prev = entries.last().or(map.last()).copied();
                    let hint = prev.and_then(|e| hint_after(&[e]));
                    if let Some(pieces) = alloc.take_on_host(host, count, hint) {
                        for p in pieces {
                            entries.extend(p.entries());
                            taken.push(p);
                        }
                        placed = true;
                        break;
                    }
                }
                if !placed {
                    let needed = count * CHUNK_SIZE;
                    let err = match hosts.iter().find(|h| headroom(**h) >= needed) {
                        Some(&host) => ManagerError::NeedPool {
                            host,
                            bytes: needed,
                        },
                        None => ManagerError::NoSpace(format!(
                            "none of hosts {hosts:?} has {needed} bytes free for the next extent; free memory or add hosts"
                        )),
                    };
                    return fail(alloc, &taken, err);
                }
                chunk = end;
            }
        }
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(gid: u32, host: u32, chunks: u64) -> Pool {
        Pool {
            gid,
            host_id: host,
            size: chunks * CHUNK_SIZE,
        }
    }

    fn host_of(alloc: &Allocator, entry: u64) -> u32 {
        let e = MapEntry::decode(entry).unwrap();
        alloc.pool(e.gid).unwrap().pool.host_id
    }

    fn no_headroom(_: u32) -> u64 {
        0
    }

    #[test]
    fn pool_space_takes_and_merges_runs() {
        let mut s = PoolSpace::new(pool(1, 1, 10));
        assert_eq!(s.take_any(3), Some((0, 3)));
        assert_eq!(s.take_at(5, 2), 2);
        assert_eq!(s.free_chunks(), 5);
        s.release(0, 3);
        s.release(5, 2);
        assert_eq!(s.free_chunks(), 10);
        assert_eq!(s.free.len(), 1, "runs merge back into one: {:?}", s.free);
        assert!(s.mark_used(9, 1));
        assert!(!s.mark_used(9, 1), "a used chunk is not free twice");
        s.grow(12 * CHUNK_SIZE);
        assert_eq!(s.free_chunks(), 11);
    }

    #[test]
    fn single_host_allocation_stays_on_the_host_and_is_contiguous() {
        let mut a = Allocator::default();
        a.add_pool(pool(1, 1, 64));
        a.add_pool(pool(2, 2, 64));
        let e = grow_map(&mut a, &Placement::Single(2), &[], 10, no_headroom).unwrap();
        assert_eq!(e.len(), 10);
        assert!(e.iter().all(|&x| host_of(&a, x) == 2));
        assert_eq!(pieces_of(&e).len(), 1, "one contiguous piece");
        // Growing continues right after the last chunk.
        let more = grow_map(&mut a, &Placement::Single(2), &e, 14, no_headroom).unwrap();
        let all: Vec<u64> = e.iter().chain(more.iter()).copied().collect();
        assert_eq!(pieces_of(&all).len(), 1);
        assert_eq!(a.host_free(2), 50 * CHUNK_SIZE);
        assert_eq!(a.host_free(1), 64 * CHUNK_SIZE);
    }

    #[test]
    fn multihosted_round_robin_by_extent() {
        let mut a = Allocator::default();
        for h in 1..=3 {
            a.add_pool(pool(h, h, 1024));
        }
        let hosts = Placement::Spread(vec![1, 2, 3]);
        let target = 7 * CHUNKS_PER_EXTENT + 5;
        let e = grow_map(&mut a, &hosts, &[], target, no_headroom).unwrap();
        assert_eq!(e.len() as u64, target);
        for (i, &x) in e.iter().enumerate() {
            let extent = i as u64 / CHUNKS_PER_EXTENT;
            assert_eq!(
                host_of(&a, x),
                [1, 2, 3][(extent % 3) as usize],
                "chunk {i}"
            );
        }
        // Growing within the last extent keeps to that extent's host.
        let more = grow_map(&mut a, &hosts, &e, target + 3, no_headroom).unwrap();
        assert!(more.iter().all(|&x| host_of(&a, x) == [1, 2, 3][7 % 3]));
    }

    #[test]
    fn multihosted_skips_full_hosts() {
        let mut a = Allocator::default();
        a.add_pool(pool(1, 1, CHUNKS_PER_EXTENT));
        a.add_pool(pool(2, 2, 1024));
        let e = grow_map(
            &mut a,
            &Placement::Spread(vec![1, 2]),
            &[],
            4 * CHUNKS_PER_EXTENT,
            no_headroom,
        )
        .unwrap();
        let on1 = e.iter().filter(|&&x| host_of(&a, x) == 1).count() as u64;
        assert_eq!(on1, CHUNKS_PER_EXTENT);
        assert_eq!(a.host_free(1), 0);
    }

    #[test]
    fn enospc_takes_nothing() {
        let mut a = Allocator::default();
        a.add_pool(pool(1, 1, 16));
        a.add_pool(pool(2, 2, 16));
        let before = (a.host_free(1), a.host_free(2));
        let err = grow_map(&mut a, &Placement::Single(1), &[], 17, no_headroom).unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC);
        let err =
            grow_map(&mut a, &Placement::Spread(vec![1, 2]), &[], 33, no_headroom).unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC);
        assert_eq!(
            (a.host_free(1), a.host_free(2)),
            before,
            "no leak after ENOSPC"
        );
        // Exactly full works.
        let e = grow_map(&mut a, &Placement::Spread(vec![1, 2]), &[], 32, no_headroom).unwrap();
        a.release_entries(&e);
        assert_eq!((a.host_free(1), a.host_free(2)), before);
    }

    #[test]
    fn short_host_with_headroom_asks_for_a_pool() {
        let mut a = Allocator::default();
        a.add_pool(pool(1, 1, 4));
        let err = grow_map(&mut a, &Placement::Single(1), &[], 10, |_| 1 << 30).unwrap_err();
        match err {
            ManagerError::NeedPool { host, bytes } => {
                assert_eq!(host, 1);
                assert_eq!(bytes, 6 * CHUNK_SIZE);
            }
            other => panic!("expected NeedPool, got {other:?}"),
        }
        assert_eq!(a.host_free(1), 4 * CHUNK_SIZE);
    }
}
