//! Size classes of small blocks: 24 classes from 16 to [`MAX_SMALL`] bytes (16-byte
//! granularity up to 128 bytes, then four per power of two), the class of a size, and the
//! geometry of a class's slabs (pages per slab, blocks per slab).

use super::{ALIGN, MAX_SMALL, PAGE, SLAB_HDR};

/// Block size of every class.
pub(super) const CLASS_SIZES: [u32; NCLASSES] = [
    16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
    1280, 1536, 1792, 2048,
];
/// Number of size classes.
pub(super) const NCLASSES: usize = 24;
/// Most blocks in one slab.
const MAX_SLAB_BLOCKS: usize = 256;

/// Size class by size in 16-byte units.
const CLASS_OF: [u8; MAX_SMALL / ALIGN + 1] = {
    let mut t = [0u8; MAX_SMALL / ALIGN + 1];
    let mut i = 0;
    while i < t.len() {
        let mut c = 0;
        while (CLASS_SIZES[c] as usize) < i * ALIGN {
            c += 1;
        }
        t[i] = c as u8;
        i += 1;
    }
    t
};

pub(super) fn class_of(size: usize) -> usize {
    CLASS_OF[size.div_ceil(ALIGN)] as usize
}

/// Pages per slab and blocks per slab of every class.
pub(super) const GEOMETRY: [(usize, usize); NCLASSES] = {
    let mut g = [(0, 0); NCLASSES];
    let mut c = 0;
    while c < NCLASSES {
        g[c] = compute_geometry(c);
        c += 1;
    }
    g
};

/// ceil(2^32 / size) of every class: for x < 2^20, x / size is
/// (x * RECIPROCAL) >> 32 (no division on the hot path).
const RECIPROCAL: [u64; NCLASSES] = {
    let mut r = [0; NCLASSES];
    let mut c = 0;
    while c < NCLASSES {
        r[c] = (1u64 << 32).div_ceil(CLASS_SIZES[c] as u64);
        c += 1;
    }
    r
};

/// Pages per slab and blocks per slab of class `c`.
pub(super) fn slab_geometry(c: usize) -> (usize, usize) {
    GEOMETRY[c]
}

/// The index of the block at `rel` bytes from a slab's first block, None
/// when `rel` is not the start of a block.
pub(super) fn block_index(rel: u64, class: usize) -> Option<usize> {
    if rel >= 1 << 20 {
        return None;
    }
    block_index_with(rel, RECIPROCAL[class], CLASS_SIZES[class] as u64)
}

/// [`block_index`] with the class's reciprocal and size at hand; `rel` < 2^20.
#[inline(always)]
pub(super) fn block_index_with(rel: u64, reciprocal: u64, size: u64) -> Option<usize> {
    let i = (rel * reciprocal) >> 32;
    (i * size == rel).then_some(i as usize)
}

/// The reciprocal [`block_index`] uses for `class`.
pub(super) fn reciprocal(class: usize) -> u64 {
    RECIPROCAL[class]
}

const fn compute_geometry(c: usize) -> (usize, usize) {
    let size = CLASS_SIZES[c] as usize;
    let mut pages = (size * 64 + SLAB_HDR).div_ceil(PAGE);
    if pages > 8 {
        pages = 8;
    }
    // Each block also has a state byte at the slab's end.
    let mut n = (pages * PAGE - SLAB_HDR) / (size + 1);
    if n > MAX_SLAB_BLOCKS {
        n = MAX_SLAB_BLOCKS;
    }
    (pages, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_table_rounds_up() {
        assert_eq!(CLASS_SIZES[class_of(1)], 16);
        assert_eq!(CLASS_SIZES[class_of(16)], 16);
        assert_eq!(CLASS_SIZES[class_of(17)], 32);
        assert_eq!(CLASS_SIZES[class_of(129)], 160);
        assert_eq!(CLASS_SIZES[class_of(2048)], 2048);
        for (c, &size) in CLASS_SIZES.iter().enumerate() {
            let (pages, n) = slab_geometry(c);
            assert!((1..=8).contains(&pages) && (15..=MAX_SLAB_BLOCKS).contains(&n));
            assert!(SLAB_HDR + n * (size as usize + 1) <= pages * PAGE);
        }
    }
}
