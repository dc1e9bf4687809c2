//! Where a region's bytes live (Remote Regions paper §4; docs/ARCHITECTURE.md, "libregions"):
//! what a client knows of a region's map, and the one lookup from a byte range of the region
//! to pool spans on daemons, split into runs per target (this host's mapped segment, or a
//! daemon's transport address).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1;

use crate::error::{RegionsError, Result};
use crate::transport::Span;
use crate::transport::local::LocalSegment;

/// What a client knows of a region's placement.
pub(crate) struct MapState {
    pub(crate) size: u64,
    /// `size` includes writes not yet made durable at the manager.
    pub(crate) unpublished: bool,
    pub(crate) version: u64,
    /// The region's fixed virtual address and whether it is one (FIXVADDR).
    pub(crate) vaddr: u64,
    pub(crate) fixvaddr: bool,
    pub(crate) entries: Vec<u64>,
    pub(crate) pools: HashMap<u32, v1::PoolInfo>,
    /// The object of a small region stored as one (docs/ARCHITECTURE.md, "Small regions as
    /// objects"): read and written with object requests, never through a segment.
    pub(crate) object: Option<v1::ObjectPlacement>,
    /// This host's segment, mapped (same-host access).
    pub(crate) local: Option<Arc<LocalSegment>>,
    /// Map version at which the agent was last asked for the segment (or at which the map put
    /// nothing on this host).
    pub(crate) local_checked: Option<u64>,
    /// When the agent had no segment yet although the map puts chunks on this host (its
    /// daemon has not applied their assignment yet): ask again after this instant.
    pub(crate) local_retry_at: Option<Instant>,
    /// How long to wait before asking again, doubled by every answer that still fell short
    /// (a daemon that cannot apply an assignment must not stall each access by its wait).
    pub(crate) local_backoff: Duration,
}

/// How long a region waits before asking the host agent again for a segment it did not have
/// yet (the daemon was still applying the manager's assignment events), doubled up to
/// [`LOCAL_RETRY_MAX`] while the answers keep falling short.
const LOCAL_RETRY: Duration = Duration::from_millis(50);
const LOCAL_RETRY_MAX: Duration = Duration::from_secs(5);

/// Where one 128 KiB chunk of a region lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkLoc {
    /// Held by this host's daemon (reachable through the segment memfd).
    pub local: bool,
    pub pool: u32,
    /// Pool offset of the chunk's first byte.
    pub pool_offset: u64,
    /// Transport address of the pool's daemon.
    pub addr: String,
}

/// What an access does, for where it may go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    /// A write that may go to this host's segment when it is writable.
    Write,
    /// A write that goes to the daemons only, this host's included: the daemon checks it
    /// against the region's current chunks and the capability's revocation.
    WriteThroughDaemon,
    /// An 8-byte atomic: to this host's segment when it is writable and its daemon lets
    /// processes apply CPU atomics to it (not when the daemon applies every atomic through an
    /// RDMA device), else to the daemon.
    Atomic,
}

/// Where a run of spans is served from. A remote target borrows the daemon address from the
/// map state the run was located in (no copy of the address per chunk and per call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target<'s> {
    Local,
    Remote(&'s str),
}

/// Consecutive spans (consecutive in the caller's buffer) on one target.
#[derive(Debug)]
pub(crate) struct Run<'s> {
    pub(crate) target: Target<'s>,
    pub(crate) spans: Vec<Span>,
    pub(crate) len: usize,
}

impl MapState {
    pub(crate) fn from_info(info: v1::RegionInfo) -> MapState {
        let mut s = MapState {
            size: 0,
            unpublished: false,
            version: 0,
            vaddr: 0,
            fixvaddr: false,
            entries: Vec::new(),
            pools: HashMap::new(),
            object: None,
            local: None,
            local_checked: None,
            local_retry_at: None,
            local_backoff: Duration::ZERO,
        };
        s.apply(info, false);
        s
    }

    /// Takes in a map reply. Replies may arrive out of order (concurrent extends): one with
    /// an older map version is ignored, and with `grow_only` (an extend) or while this client
    /// has unpublished growth the size never goes down.
    pub(crate) fn apply(&mut self, info: v1::RegionInfo, grow_only: bool) {
        if info.map_version < self.version {
            return;
        }
        if let Some(attr) = &info.attr {
            self.size = if grow_only || self.unpublished {
                self.size.max(attr.size)
            } else {
                attr.size
            };
            self.vaddr = attr.vaddr;
            self.fixvaddr = attr.region_attrs.as_ref().is_some_and(|a| a.fixvaddr);
        }
        if info.map_included {
            self.object = info.object;
            self.entries = info.map;
            for p in info.pools {
                self.pools.insert(p.gid, p);
            }
        }
        self.version = info.map_version;
    }

    /// Bytes the allocated chunks cover.
    pub(crate) fn capacity(&self) -> u64 {
        match &self.object {
            Some(o) if !o.moving => u64::from(o.capacity),
            _ => self.entries.len() as u64 * CHUNK_SIZE,
        }
    }

    /// The map entry of chunk `index` and the pool it names.
    fn chunk_entry(&self, ino: u64, index: u64, peer: &str) -> Result<(MapEntry, &v1::PoolInfo)> {
        let entry = usize::try_from(index)
            .ok()
            .and_then(|i| self.entries.get(i))
            .and_then(|e| MapEntry::decode(*e))
            .ok_or_else(|| RegionsError::Protocol {
                peer: peer.to_owned(),
                reason: format!("region {ino} has no chunk {index} in its map"),
            })?;
        let pool = self
            .pools
            .get(&entry.gid)
            .ok_or_else(|| RegionsError::Protocol {
                peer: peer.to_owned(),
                reason: format!("region {ino} names unknown pool {}", entry.gid),
            })?;
        Ok((entry, pool))
    }

    /// Where chunk `index` lives, seen from host `host_id`.
    pub(crate) fn chunk(&self, ino: u64, index: u64, host_id: u32, peer: &str) -> Result<ChunkLoc> {
        let (entry, pool) = self.chunk_entry(ino, index, peer)?;
        Ok(ChunkLoc {
            local: pool.host_id == host_id,
            pool: entry.gid,
            pool_offset: entry.pool_offset,
            addr: pool.transport_addr.clone(),
        })
    }

    /// The host agent had no segment, or a shorter one than this map puts on this host: its
    /// daemon is behind on the manager's events. Ask again shortly rather than reaching this
    /// host's memory over tcp until the map changes, and later each time it still falls
    /// short (a daemon that cannot apply an assignment must not stall every access by its
    /// bounded wait).
    pub(crate) fn segment_short(&mut self, now: Instant) {
        let wait = (self.local_backoff * 2).clamp(LOCAL_RETRY, LOCAL_RETRY_MAX);
        self.local_backoff = wait;
        self.local_checked = None;
        self.local_retry_at = Some(now + wait);
    }

    /// Whether any chunk is held by host `host_id`.
    pub(crate) fn has_chunks_on(&self, host_id: u32) -> bool {
        self.pools.values().any(|p| p.host_id == host_id)
    }

    /// The region offset where the last chunk held by host `host_id` ends (0 when it holds
    /// none): how long that host's segment is once its daemon has applied the map.
    pub(crate) fn end_on(&self, host_id: u32) -> u64 {
        self.entries
            .iter()
            .rposition(|e| {
                MapEntry::decode(*e)
                    .and_then(|entry| self.pools.get(&entry.gid))
                    .is_some_and(|p| p.host_id == host_id)
            })
            .map_or(0, |i| (i as u64 + 1) * CHUNK_SIZE)
    }

    /// Splits `[offset, offset + len)` of region `ino` into runs of spans per target. Host
    /// `host_id`'s chunks go through the mapped segment, unless the access writes and the
    /// segment is read-only or `access` keeps writes off it (then through the host's
    /// transport).
    pub(crate) fn locate(
        &self,
        ino: u64,
        host_id: u32,
        (offset, len): (u64, u64),
        access: Access,
        peer: &str,
    ) -> Result<Vec<Run<'_>>> {
        let end = offset.checked_add(len).ok_or_else(|| {
            RegionsError::Invalid(format!("{len} bytes at offset {offset} overflow"))
        })?;
        let mut runs: Vec<Run> = Vec::new();
        let mut at = offset;
        while at < end {
            let index = at / CHUNK_SIZE;
            let within = at % CHUNK_SIZE;
            let n = (CHUNK_SIZE - within).min(end - at);
            let (entry, pool) = self.chunk_entry(ino, index, peer)?;
            let span = Span {
                ino,
                region_offset: at,
                pool: entry.gid,
                pool_offset: entry.pool_offset + within,
                len: n,
            };
            let target = match &self.local {
                Some(l)
                    if pool.host_id == host_id
                        && l.covers(at, n)
                        && match access {
                            Access::Read => true,
                            Access::Write => l.writable(),
                            Access::WriteThroughDaemon => false,
                            Access::Atomic => l.writable() && l.cpu_atomics(),
                        } =>
                {
                    Target::Local
                }
                _ => Target::Remote(&pool.transport_addr),
            };
            match runs.last_mut() {
                Some(run) if run.target == target => {
                    if !run.spans.last_mut().is_some_and(|last| last.absorb(&span)) {
                        run.spans.push(span);
                    }
                    run.len += n as usize;
                }
                _ => runs.push(Run {
                    target,
                    spans: vec![span],
                    len: n as usize,
                }),
            }
            at += n;
        }
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(gid: u32, host_id: u32, addr: &str) -> v1::PoolInfo {
        v1::PoolInfo {
            gid,
            host_id,
            transport_addr: addr.into(),
            ..Default::default()
        }
    }

    /// Chunks 0 and 1 consecutive in pool 1 (host 1), chunk 2 in pool 2 (host 2), chunk 3
    /// back in pool 1 but not next to chunk 1.
    fn state() -> MapState {
        let entries = [(1, 0), (1, CHUNK_SIZE), (2, 0), (1, 8 * CHUNK_SIZE)]
            .into_iter()
            .map(|(gid, pool_offset)| MapEntry { gid, pool_offset }.encode().unwrap())
            .collect();
        MapState::from_info(v1::RegionInfo {
            attr: Some(v1::Attr {
                size: 4 * CHUNK_SIZE,
                ..Default::default()
            }),
            map_included: true,
            map: entries,
            pools: vec![pool(1, 1, "a:1"), pool(2, 2, "b:2")],
            map_version: 1,
            ..Default::default()
        })
    }

    #[test]
    fn ranges_split_by_daemon_and_merge_consecutive_chunks() {
        let s = state();
        let runs = s
            .locate(9, 1, (100, 4 * CHUNK_SIZE - 200), Access::Read, "m")
            .unwrap();
        let got: Vec<_> = runs
            .iter()
            .map(|r| {
                (
                    r.target,
                    r.spans
                        .iter()
                        .map(|s| (s.pool, s.pool_offset, s.len))
                        .collect::<Vec<_>>(),
                    r.len,
                )
            })
            .collect();
        let c = CHUNK_SIZE;
        assert_eq!(
            got,
            vec![
                (
                    Target::Remote("a:1"),
                    vec![(1, 100, 2 * c - 100)],
                    (2 * c - 100) as usize
                ),
                (Target::Remote("b:2"), vec![(2, 0, c)], c as usize),
                (
                    Target::Remote("a:1"),
                    vec![(1, 8 * c, c - 100)],
                    (c - 100) as usize
                ),
            ]
        );
        assert!(runs.iter().all(|r| r.spans.iter().all(|s| s.ino == 9)));
        assert_eq!(runs[1].spans[0].region_offset, 2 * c);
    }

    #[test]
    fn ranges_past_the_map_or_overflowing_are_refused() {
        let s = state();
        let err = s
            .locate(9, 1, (4 * CHUNK_SIZE, 1), Access::Read, "m")
            .unwrap_err();
        assert!(err.to_string().contains("no chunk 4"), "{err}");
        let err = s
            .locate(9, 1, (u64::MAX - 2, 8), Access::Read, "m")
            .unwrap_err();
        assert!(err.to_string().contains("overflow"), "{err}");
        assert!(
            s.locate(9, 1, (5, 0), Access::Write, "m")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_segment_that_keeps_falling_short_is_asked_for_less_often() {
        let mut s = state();
        let now = Instant::now();
        let waits: Vec<Duration> = (0..10)
            .map(|_| {
                s.segment_short(now);
                s.local_retry_at.unwrap() - now
            })
            .collect();
        assert_eq!(waits[0], LOCAL_RETRY);
        assert_eq!(waits[1], 2 * LOCAL_RETRY);
        assert_eq!(waits[9], LOCAL_RETRY_MAX);
        assert_eq!(s.local_checked, None, "asked again once the wait is over");
    }

    #[test]
    fn chunks_know_their_host_and_older_maps_are_ignored() {
        let mut s = state();
        let loc = s.chunk(9, 2, 1, "m").unwrap();
        assert_eq!(
            loc,
            ChunkLoc {
                local: false,
                pool: 2,
                pool_offset: 0,
                addr: "b:2".into()
            }
        );
        assert!(s.chunk(9, 0, 1, "m").unwrap().local);
        assert!(s.has_chunks_on(2) && !s.has_chunks_on(3));
        assert_eq!(
            (s.end_on(1), s.end_on(2), s.end_on(3)),
            (4 * CHUNK_SIZE, 3 * CHUNK_SIZE, 0)
        );
        s.apply(
            v1::RegionInfo {
                map_version: 0,
                map_included: true,
                ..Default::default()
            },
            false,
        );
        assert_eq!(
            s.entries.len(),
            4,
            "an older map does not replace a newer one"
        );
        s.unpublished = true;
        s.apply(
            v1::RegionInfo {
                attr: Some(v1::Attr {
                    size: 1,
                    ..Default::default()
                }),
                map_version: 2,
                ..Default::default()
            },
            false,
        );
        assert_eq!(s.size, 4 * CHUNK_SIZE, "unpublished growth is kept");
    }
}
