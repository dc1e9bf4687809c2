//! A thread's private mirror of its cache record in the heap it used last, so that an
//! allocation from the thread cache need not check the cached block again.
//!
//! The record ([`super::thread_cache`]) lives in the heap, which other processes can write,
//! so a block taken from it is checked before its state byte is written: the page map, the
//! slab header and the block's index, about half of what an allocation costs. The mirror
//! keeps, beside each slot of the record, where that block's state byte is, found when the
//! block was checked on its way into the cache (by `rfree`, a refill, or a check of the whole
//! class). An allocation then takes the mirror's top entry when the record still agrees with
//! it: the same count and the same offset in the top slot, the same record and no unmapping
//! since (the unmap epoch). Everything else (a refill, a flush, another record, an unmapping,
//! a record written by someone else) makes them disagree, and the allocation takes the
//! checked path, which checks the class again and fills the mirror anew.
//!
//! The thread also remembers the last slab it checked a freed block in (the memo): a free
//! of another block of that slab finds the block's index and state byte from it, without
//! reading the page map and the slab header again, while no slab of the heap has been
//! released since (the heap header counts releases) and the record and epoch are the same.
//! A slab holding a live block cannot be released, so a free of a live block of the slab
//! finds the slab as it was; a free of anything else is refused by the block's state byte.
//!
//! The mirror also names the heap (its base) and the thread's record there, so that the
//! lock-free paths find the record without the thread's list of caches. It is dropped
//! whenever a record is flushed (a record closed, a thread's cache handed back), in a forked
//! child, and by every unmapping (the epoch).
//!
//! A double free of a block whose slab another thread released meanwhile reads, as its state
//! byte, whatever the memory there holds now; the checked path reads the page map of that
//! instant and has the same window (two frees racing a release), so the state byte remains the
//! guard it was.
//!
//! Only the owning thread reads or writes its mirror, and never from inside another use of
//! it: every function here takes and drops the thread's mirror within one call.

use std::cell::UnsafeCell;

use super::size_class::NCLASSES;

/// Most blocks a thread caches per size class (the record's `CACHE_CAP`).
pub(super) const MIRROR_CAP: usize = 32;

/// One mirrored slot: the block's offset / 16 as the record holds it, and where its state
/// byte is, in bytes from the block's start (within its slab: a few pages either way).
#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) slot: u32,
    pub(super) state: i32,
}

const NO_ENTRY: Entry = Entry { slot: 0, state: 0 };

impl Entry {
    /// The entry of the block at offset `off` whose state byte is at offset `state` (None
    /// when they are too far apart for an entry, which a slab never makes them).
    #[inline(always)]
    pub(super) fn of(off: u64, state: u64) -> Option<Entry> {
        Some(Entry {
            slot: (off >> 4) as u32,
            state: i32::try_from(state as i64 - off as i64).ok()?,
        })
    }
}

/// The last slab a freed block was checked in.
#[derive(Clone, Copy)]
pub(super) struct SlabMemo {
    /// Offset of the slab's first block.
    pub(super) first: u64,
    /// Bytes of its blocks.
    pub(super) span: u64,
    /// Offset of its first block's state byte.
    pub(super) states: u64,
    /// Offset of the slab's end.
    pub(super) end: u64,
    pub(super) class: usize,
    /// The class's block size, its reciprocal (`size_class::block_index`) and how many
    /// blocks a thread caches of it.
    pub(super) size: u64,
    pub(super) reciprocal: u64,
    pub(super) cap: usize,
}

pub(super) struct Mirror {
    /// Base of the heap and address of this thread's record there (0: none).
    base: usize,
    rec: usize,
    /// Unmap epoch the entries were checked in.
    epoch: u64,
    /// Entries per class.
    n: [u8; NCLASSES],
    entries: [[Entry; MIRROR_CAP]; NCLASSES],
    /// The heap's release count when the slab memo was taken; `memo.span` 0: none.
    releases: u32,
    memo: SlabMemo,
}

const NO_MEMO: SlabMemo = SlabMemo {
    first: 0,
    span: 0,
    states: 0,
    end: 0,
    class: 0,
    size: 16,
    reciprocal: 0,
    cap: 0,
};

thread_local! {
    static MIRROR: UnsafeCell<Mirror> = const {
        UnsafeCell::new(Mirror {
            base: 0,
            rec: 0,
            epoch: 0,
            n: [0; NCLASSES],
            entries: [[NO_ENTRY; MIRROR_CAP]; NCLASSES],
            releases: 0,
            memo: NO_MEMO,
        })
    };
}

/// Runs `f` on this thread's mirror; None when the thread is exiting.
#[inline(always)]
fn with<T>(f: impl FnOnce(&mut Mirror) -> T) -> Option<T> {
    MIRROR
        .try_with(|m| {
            // SAFETY: the mirror is this thread's alone, and no function of this module calls
            // another while it holds the reference, so it is the only one (rmalloc is not
            // async-signal-safe: a signal handler must not allocate, as with malloc).
            f(unsafe { &mut *m.get() })
        })
        .ok()
}

/// Runs `f` on the mirror and the address of this thread's record in the heap at `base`,
/// when the mirror holds them for unmap epoch `epoch`. `f` must not use the mirror otherwise.
#[inline(always)]
pub(super) fn with_record<T>(
    base: usize,
    epoch: u64,
    f: impl FnOnce(&mut Mirror, usize) -> Option<T>,
) -> Option<T> {
    with(|m| {
        if m.base != base || m.epoch != epoch || m.rec == 0 {
            return None;
        }
        let rec = m.rec;
        f(m, rec)
    })
    .flatten()
}

impl Mirror {
    /// Points the mirror at record `rec` of the heap at `base` in `epoch`, dropping what it
    /// held of another.
    fn follow(&mut self, base: usize, rec: usize, epoch: u64) {
        if self.base != base || self.rec != rec || self.epoch != epoch {
            self.base = base;
            self.rec = rec;
            self.epoch = epoch;
            self.n = [0; NCLASSES];
            self.memo = NO_MEMO;
        }
    }

    /// Offers the top entry of `class` to `take` when the mirror holds `count` entries of
    /// that class (the record's count), and pops it when `take` took the block. When it did
    /// not (the block is not as mirrored), the class is dropped, to be filled again from the
    /// record.
    #[inline(always)]
    pub(super) fn pop(
        &mut self,
        class: usize,
        count: usize,
        take: impl FnOnce(Entry) -> bool,
    ) -> bool {
        if count == 0 || self.n[class] as usize != count {
            return false;
        }
        if take(self.entries[class][count - 1]) {
            self.n[class] = (count - 1) as u8;
            true
        } else {
            self.n[class] = 0;
            false
        }
    }

    /// Pushes `entry` as slot `count` of `class` (the record's count before the push), when
    /// the mirror holds the record's `count` entries of that class.
    #[inline(always)]
    pub(super) fn push(&mut self, class: usize, count: usize, entry: Entry) {
        if self.n[class] as usize == count && count < MIRROR_CAP {
            self.entries[class][count] = entry;
            self.n[class] = count as u8 + 1;
        }
    }

    /// The slab memo when `off` lies in its blocks and the heap has released `releases`
    /// slabs, as when it was taken.
    #[inline(always)]
    pub(super) fn memo(&self, releases: u32, off: u64) -> Option<SlabMemo> {
        (self.releases == releases && off.wrapping_sub(self.memo.first) < self.memo.span)
            .then_some(self.memo)
    }
}

/// Pushes `entry` as slot `count` of `class` of record `rec` of the heap at `base`, when the
/// mirror follows that record in `epoch` and holds its `count` entries of the class.
pub(super) fn push(base: usize, rec: usize, epoch: u64, class: usize, count: usize, entry: Entry) {
    with(|m| {
        if m.base == base && m.rec == rec && m.epoch == epoch {
            m.push(class, count, entry);
        }
    });
}

/// Replaces the entries of `class` with `entries` (the whole class, checked) of record `rec`
/// of the heap at `base` in `epoch`.
pub(super) fn fill(base: usize, rec: usize, epoch: u64, class: usize, entries: &[Entry]) {
    with(|m| {
        m.follow(base, rec, epoch);
        let k = entries.len().min(MIRROR_CAP);
        m.entries[class][..k].copy_from_slice(&entries[..k]);
        m.n[class] = k as u8;
    });
}

/// Remembers `memo`, taken at release count `releases`, for record `rec` of the heap at
/// `base` in `epoch`.
pub(super) fn set_memo(base: usize, rec: usize, epoch: u64, releases: u32, memo: SlabMemo) {
    with(|m| {
        m.follow(base, rec, epoch);
        m.releases = releases;
        m.memo = memo;
    });
}

/// Forgets everything mirrored (a record was flushed: its slots moved, or it was closed).
pub(super) fn forget() {
    with(|m| {
        m.base = 0;
        m.rec = 0;
        m.n = [0; NCLASSES];
        m.memo = NO_MEMO;
    });
}
