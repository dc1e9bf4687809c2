//! A block's bookkeeping: which object (by id) sits in which slot, and which slots are free.
//! The ids are random per block (CoRM §3.1.2): two blocks can be merged when no id is in both,
//! and a pointer whose slot no longer holds its id finds the object by id.

use std::collections::{BTreeSet, HashMap};

use rand::Rng;

use super::classes::{slot_size, slots_per_block};

/// Bytes of a page: memory goes back to the kernel a page at a time.
const PAGE: u32 = 4096;

/// One block of a size class.
#[derive(Clone)]
pub(super) struct Block {
    /// Its size class.
    pub class: usize,
    /// Its own address in the window (kept for the block's whole life).
    pub address: u32,
    /// Addresses of blocks merged into it, now mapping its bytes too.
    pub aliases: Vec<u32>,
    /// The object id in each slot (0: free).
    slots: Vec<u32>,
    /// The slot of each object id.
    ids: HashMap<u32, u32>,
    /// The address each object's pointer names (its key is that address and its id), for the
    /// objects whose pointer names another block's address (moved in by compaction); every
    /// other object's names this block's own.
    keys: HashMap<u32, u32>,
    /// Free slots, lowest first.
    free: BTreeSet<u32>,
}

impl Block {
    /// An empty block of `class`, mapped at `address`.
    pub fn new(class: usize, address: u32) -> Block {
        let n = slots_per_block(class);
        Block {
            class,
            address,
            aliases: Vec::new(),
            slots: vec![0; n as usize],
            ids: HashMap::new(),
            keys: HashMap::new(),
            free: (0..n).collect(),
        }
    }

    /// Objects in the block.
    pub fn live(&self) -> u32 {
        self.ids.len() as u32
    }

    /// Bytes `[from, to)` around `slot`, page aligned, on which no object lies (their memory
    /// can go back to the kernel); empty when every page the slot touches has an object.
    pub fn free_pages_around(&self, slot: u32) -> (u32, u32) {
        let size = slot_size(self.class) as u64;
        let page = PAGE as u64;
        let taken = |p: u64| {
            // The slots overlapping page `p`.
            let first = (p * page / size) as usize;
            let last = (((p + 1) * page - 1) / size) as usize;
            (first..=last).any(|s| self.slots.get(s).is_some_and(|id| *id != 0))
        };
        let start = u64::from(slot) * size;
        let (mut a, mut b) = (start / page, (start + size).div_ceil(page));
        while a < b && taken(a) {
            a += 1;
        }
        while b > a && taken(b - 1) {
            b -= 1;
        }
        // Pages in between are inside the slot itself: free.
        ((a * page) as u32, (b * page) as u32)
    }

    /// Whether every slot is taken.
    pub fn is_full(&self) -> bool {
        self.free.is_empty()
    }

    /// The slot holding object `id`.
    pub fn slot_of(&self, id: u32) -> Option<u32> {
        self.ids.get(&id).copied()
    }

    /// The id of the object in `slot` (0: free or no such slot).
    pub fn id_at(&self, slot: u32) -> u32 {
        self.slots.get(slot as usize).copied().unwrap_or(0)
    }

    /// A random non-zero id no object of this block has.
    pub fn fresh_id(&self, rng: &mut impl Rng) -> u32 {
        loop {
            let id: u32 = rng.random();
            if id != 0 && !self.ids.contains_key(&id) {
                return id;
            }
        }
    }

    /// Takes a slot for object `id`, whose pointer names `key_address`: `preferred` if it is
    /// free, else the lowest free one; `None` when the block is full.
    pub fn take(&mut self, preferred: Option<u32>, id: u32, key_address: u32) -> Option<u32> {
        let slot = match preferred {
            Some(p) if self.free.remove(&p) => p,
            _ => self.free.pop_first()?,
        };
        self.put(slot, id, key_address);
        Some(slot)
    }

    /// Takes `slot` for object `id` (pointer naming `key_address`) if it is free; whether it
    /// was.
    pub fn take_exactly(&mut self, slot: u32, id: u32, key_address: u32) -> bool {
        if !self.free.remove(&slot) {
            return false;
        }
        self.put(slot, id, key_address);
        true
    }

    fn put(&mut self, slot: u32, id: u32, key_address: u32) {
        self.slots[slot as usize] = id;
        self.ids.insert(id, slot);
        self.set_key_address(id, key_address);
    }

    /// The address object `id`'s pointer names (`None`: no such object).
    pub fn key_address(&self, id: u32) -> Option<u32> {
        if !self.ids.contains_key(&id) {
            return None;
        }
        Some(self.keys.get(&id).copied().unwrap_or(self.address))
    }

    /// Records that object `id`'s pointer names `address` (it was corrected, or moved in).
    pub fn set_key_address(&mut self, id: u32, address: u32) {
        if address == self.address {
            self.keys.remove(&id);
        } else {
            self.keys.insert(id, address);
        }
    }

    /// Free slots.
    pub fn free_slots(&self) -> u32 {
        self.free.len() as u32
    }

    /// Moves the object in slot `from` to the free slot `to` of this block (its key stays: the
    /// block is the same); whether it did.
    pub fn relocate(&mut self, from: u32, to: u32) -> bool {
        let id = self.id_at(from);
        if id == 0 || !self.free.remove(&to) {
            return false;
        }
        self.slots[from as usize] = 0;
        self.free.insert(from);
        self.slots[to as usize] = id;
        self.ids.insert(id, to);
        true
    }

    /// The lowest free slot, and the highest taken one.
    pub fn ends(&self) -> (Option<u32>, Option<u32>) {
        let last = self.slots.iter().rposition(|id| *id != 0).map(|s| s as u32);
        (self.free.first().copied(), last)
    }

    /// Whether object `id` is in the block.
    pub fn holds(&self, id: u32) -> bool {
        self.ids.contains_key(&id)
    }

    /// Frees `slot`; returns the id that was there (0 if it was free).
    pub fn release(&mut self, slot: u32) -> u32 {
        let Some(id) = self.slots.get(slot as usize).copied().filter(|id| *id != 0) else {
            return 0;
        };
        self.slots[slot as usize] = 0;
        self.ids.remove(&id);
        self.keys.remove(&id);
        self.free.insert(slot);
        id
    }

    /// (slot, id) of every object, by slot.
    pub fn objects(&self) -> Vec<(u32, u32)> {
        let mut v: Vec<_> = self.ids.iter().map(|(id, s)| (*s, *id)).collect();
        v.sort_unstable();
        v
    }

    /// (slot, key) of every object, by slot: its key is the address its pointer names and
    /// its id.
    pub fn keyed_objects(&self) -> Vec<(u32, (u32, u32))> {
        let mut v: Vec<_> = self
            .ids
            .iter()
            .map(|(id, s)| {
                (
                    *s,
                    (self.keys.get(id).copied().unwrap_or(self.address), *id),
                )
            })
            .collect();
        v.sort_unstable();
        v
    }

    /// Whether the objects of `other` fit in this block's free slots and no id is in both.
    pub fn can_absorb(&self, other: &Block) -> bool {
        other.live() <= self.free.len() as u32
            && other.ids.keys().all(|id| !self.ids.contains_key(id))
    }

    /// Every address that shows this block: its own and its aliases.
    pub fn addresses(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.address).chain(self.aliases.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_free_only_where_no_object_lies() {
        // 64-byte slots: 64 to a page.
        let mut b = Block::new(0, 0);
        for id in 1..=130 {
            b.take(None, id, 0).unwrap();
        }
        b.release(70);
        let (from, to) = b.free_pages_around(70);
        assert!(from >= to, "page 1 still holds objects");
        for s in 64..128 {
            b.release(s);
        }
        assert_eq!(b.free_pages_around(100), (4096, 8192));
        // Slots straddling pages (3 KiB): a page is free only if both slots on it are.
        let c = super::super::classes::class_for(3072 - 32).unwrap();
        let mut b = Block::new(c, 0);
        for id in 1..=4 {
            b.take(None, id, 0).unwrap();
        }
        b.release(1); // bytes 3072..6144: page 0 and 1 hold slots 0 and 2
        let (from, to) = b.free_pages_around(1);
        assert!(from >= to);
        b.release(2); // 6144..9216: page 1 (4096..8192) is now free
        assert_eq!(b.free_pages_around(2), (4096, 8192));
    }

    #[test]
    fn slots_ids_and_absorbing() {
        let mut rng = rand::rng();
        // 4 KiB slots: 8 a block.
        let last = super::super::classes::class_for(4096 - 32).unwrap();
        let mut a = Block::new(last, 0);
        assert_eq!(a.objects().len(), 0);
        let id = a.fresh_id(&mut rng);
        assert_eq!(a.take(Some(3), id, 0), Some(3));
        assert_eq!(a.slot_of(id), Some(3));
        assert_eq!(a.id_at(3), id);
        // The preferred slot is taken: the lowest free one instead.
        let id2 = a.fresh_id(&mut rng);
        assert_ne!(id2, id);
        assert_eq!(a.take(Some(3), id2, 0), Some(0));
        assert!(!a.take_exactly(0, 77, 0), "slot 0 is taken");
        assert!(!a.take_exactly(99, 77, 0), "no slot 99");
        assert_eq!(a.live(), 2);
        let mut b = Block::new(last, 1);
        b.take(Some(3), 999, 1).unwrap();
        assert!(a.can_absorb(&b));
        // The same id in both: not mergeable.
        b.take(None, id, 1).unwrap();
        assert!(!a.can_absorb(&b));
        assert_eq!(a.release(3), id);
        assert_eq!(a.release(3), 0);
        assert!(a.can_absorb(&b));
        assert_eq!(a.objects(), vec![(0, id2)]);
        for n in 0..7 {
            a.take(None, 5000 + n, 0).unwrap();
        }
        assert!(a.is_full());
        assert_eq!(a.take(None, 7000, 0), None);
        // A free slot's page can go.
        assert_eq!(a.release(2), 5001);
        assert_eq!(a.free_pages_around(2), (8192, 12288));
        assert!(!a.can_absorb(&b), "no room");
        // Relocating within the block: the id follows, the old slot is free.
        assert_eq!(a.ends(), (Some(2), Some(7)));
        let id7 = a.id_at(7);
        assert!(a.relocate(7, 2));
        assert_eq!(a.slot_of(id7), Some(2));
        assert_eq!(a.id_at(7), 0);
        assert_eq!(a.ends(), (Some(7), Some(6)));
        assert!(!a.relocate(7, 0), "slot 7 is free now");
        assert!(!a.relocate(6, 0), "slot 0 is taken");
    }
}
