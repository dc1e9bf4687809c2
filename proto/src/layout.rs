//! Sizes and encodings every component agrees on: chunks, extents, region-map
//! entries and the fixed-virtual-address window (docs/ARCHITECTURE.md, "Terms").

/// log2 of [`CHUNK_SIZE`].
pub const CHUNK_SHIFT: u32 = 17;
/// The grain of the region map and of large-region allocation: 128 KiB.
pub const CHUNK_SIZE: u64 = 1 << CHUNK_SHIFT;

/// Where a pool byte lies in its region, as a transport request states it (`FLAG_DELTAS`):
/// the low 32 bits of (region offset − pool offset) in chunks. Equal for every byte of a run
/// that is contiguous in both; a chunk given to another region offset since has another delta
/// (unless the offsets differ by a multiple of 2^49 bytes).
pub fn chunk_delta(region_offset: u64, pool_offset: u64) -> u32 {
    (region_offset.wrapping_sub(pool_offset) >> CHUNK_SHIFT) as u32
}
/// `ALLOC_SIZE`: consecutive chunks handed out round robin for MULTIHOSTED regions.
pub const EXTENT_SIZE: u64 = 2 << 20;
/// Chunks in one extent.
pub const CHUNKS_PER_EXTENT: u64 = EXTENT_SIZE / CHUNK_SIZE;

/// Bits of a map entry that name the pool (global id).
pub const POOL_GID_BITS: u32 = 17;
/// Largest pool global id; 0 is never assigned.
pub const MAX_POOL_GID: u32 = (1 << POOL_GID_BITS) - 1;
/// Bits of a map entry that hold the pool offset in chunks (offset >> 17), so
/// a map entry can name any chunk-aligned offset of a 64-bit address space.
pub const POOL_CHUNK_BITS: u32 = 64 - POOL_GID_BITS;

/// Start of the window of fixed virtual addresses reserved for FIXVADDR regions.
pub const VADDR_WINDOW_START: u64 = 0x4000_0000_0000;
/// End (exclusive) of the fixed virtual address window.
pub const VADDR_WINDOW_END: u64 = 0x6000_0000_0000;

/// One region-map entry: where a 128 KiB chunk of a region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MapEntry {
    /// Pool global id (1..=[`MAX_POOL_GID`]).
    pub gid: u32,
    /// Chunk-aligned byte offset in the pool.
    pub pool_offset: u64,
}

impl MapEntry {
    /// Packs the entry as `gid << 47 | pool_offset >> 17`. Returns `None` when
    /// the gid is 0 or does not fit in 17 bits, or the offset is not chunk
    /// aligned.
    pub fn encode(self) -> Option<u64> {
        if self.gid == 0 || self.gid > MAX_POOL_GID || !self.pool_offset.is_multiple_of(CHUNK_SIZE)
        {
            return None;
        }
        Some((u64::from(self.gid) << POOL_CHUNK_BITS) | (self.pool_offset >> CHUNK_SHIFT))
    }

    /// Unpacks an entry; `None` for the zero entry (no pool has gid 0).
    pub fn decode(raw: u64) -> Option<MapEntry> {
        let gid = (raw >> POOL_CHUNK_BITS) as u32;
        if gid == 0 {
            return None;
        }
        let chunk = raw & ((1 << POOL_CHUNK_BITS) - 1);
        Some(MapEntry {
            gid,
            pool_offset: chunk << CHUNK_SHIFT,
        })
    }
}

/// Chunks needed to hold `bytes`.
pub fn chunks_for(bytes: u64) -> u64 {
    bytes.div_ceil(CHUNK_SIZE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_entry_round_trips_at_the_edges() {
        for (gid, off) in [
            (1, 0),
            (MAX_POOL_GID, 0),
            (7, CHUNK_SIZE),
            (MAX_POOL_GID, u64::MAX - (CHUNK_SIZE - 1)),
        ] {
            let e = MapEntry {
                gid,
                pool_offset: off,
            };
            let raw = e.encode().unwrap();
            assert_eq!(MapEntry::decode(raw), Some(e));
        }
    }

    #[test]
    fn map_entry_rejects_what_does_not_fit() {
        let bad = [(0, 0), (MAX_POOL_GID + 1, 0), (1, 4096)];
        for (gid, off) in bad {
            let e = MapEntry {
                gid,
                pool_offset: off,
            };
            assert_eq!(e.encode(), None, "{gid} {off}");
        }
        assert_eq!(MapEntry::decode(0), None);
    }

    #[test]
    fn chunk_arithmetic() {
        assert_eq!(chunks_for(0), 0);
        assert_eq!(chunks_for(1), 1);
        assert_eq!(chunks_for(CHUNK_SIZE), 1);
        assert_eq!(chunks_for(CHUNK_SIZE + 1), 2);
        assert_eq!(CHUNKS_PER_EXTENT, 16);
    }
}
