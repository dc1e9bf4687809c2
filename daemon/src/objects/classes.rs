//! Size classes of objects: the slot sizes blocks are cut into.
//!
//! Sixteen classes per doubling from 256 bytes (8 bytes apart below) up to [`MAX_SLOT`], so
//! rounding a size up to its class wastes at most an eighth of it and about 2% on average;
//! every block is [`BLOCK_SIZE`] bytes, so the largest class still holds four objects a block,
//! and the blocks of a class left partly filled after compaction hold little memory.
//! (Measured with `cargo bench -p regions-tests --bench objects`: 64 KiB blocks and eight
//! classes per doubling left 1.20x the ideal memory after compaction, these 1.14x.)

use super::HEADER;

/// Bytes of every block (and of every block address in the window).
pub const BLOCK_SIZE: u64 = 32 << 10;
/// The largest slot: a header and its object (a region of at most this less the header is a
/// small region).
pub const MAX_SLOT: u32 = 8 << 10;
/// The smallest slot.
const MIN_SLOT: u32 = 64;

/// The slot sizes, smallest first.
pub fn slot_sizes() -> &'static [u32] {
    static SIZES: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    SIZES.get_or_init(|| {
        let mut sizes = Vec::new();
        let mut base = MIN_SLOT;
        while base < MAX_SLOT {
            let step = (base / 16).max(8);
            let mut size = base;
            while size < base * 2 {
                if size <= MAX_SLOT {
                    sizes.push(size);
                }
                size += step;
            }
            base *= 2;
        }
        sizes.push(MAX_SLOT);
        sizes.dedup();
        sizes
    })
}

/// The class whose slots hold an object of `len` bytes and its header, if any does.
pub fn class_for(len: u32) -> Option<usize> {
    let need = len.checked_add(HEADER as u32)?;
    let sizes = slot_sizes();
    let i = sizes.partition_point(|s| *s < need);
    (i < sizes.len()).then_some(i)
}

/// Bytes of one slot of class `class`.
pub fn slot_size(class: usize) -> u32 {
    slot_sizes()[class]
}

/// Slots in one block of class `class`.
pub fn slots_per_block(class: usize) -> u32 {
    (BLOCK_SIZE / u64::from(slot_size(class))) as u32
}

/// The largest object a small region may be (its slot's size less the header).
pub fn max_object() -> u32 {
    MAX_SLOT - HEADER as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_grow_by_sixteenths_and_round_up() {
        let sizes = slot_sizes();
        assert_eq!(sizes[..4], [64, 72, 80, 88]);
        assert_eq!(sizes[24..27], [256, 272, 288]);
        assert_eq!(*sizes.last().unwrap(), MAX_SLOT);
        assert!(
            sizes
                .windows(2)
                .all(|w| w[0] < w[1] && w[1] <= w[0] * 9 / 8)
        );
        assert!(sizes.iter().all(|s| s % 8 == 0));
        // A 1-byte object takes the smallest slot; one that needs a byte more takes the next.
        assert_eq!(class_for(1), Some(0));
        assert_eq!(class_for(64 - HEADER as u32), Some(0));
        assert_eq!(class_for(65 - HEADER as u32), Some(1));
        assert_eq!(class_for(73 - HEADER as u32), Some(2));
        assert_eq!(class_for(max_object()), Some(sizes.len() - 1));
        assert_eq!(class_for(max_object() + 1), None);
        assert_eq!(slots_per_block(sizes.len() - 1), 4);
    }
}
