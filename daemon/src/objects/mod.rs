//! Small regions as objects packed into size-class blocks, and the compaction that gives the
//! memory of sparse blocks back (CoRM, docs/ARCHITECTURE.md "Small regions as objects").
//!
//! Every object sits in a slot of a block of its size class, behind a header:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | version word: even when stable, odd while a write is in progress |
//! | 8..16 | the owning region's inode |
//! | 16..20 | the region's generation |
//! | 20..24 | the object id: random, unique in its block, never 0 |
//! | 24..28 | bytes in use (the largest end written) |
//! | 28..32 | zero |
//!
//! A pointer to an object ([`ObjectRef`]) is (block address, slot hint, object id); its key,
//! (address, id), names the object for its whole life, whichever block holds it. The store
//! keeps one pointer per object (the one the manager records) in an index from key to block.
//! Compaction has two steps per size class:
//! - *merging* (CoRM §3.1.2): a sparse block's objects are copied into a block with room for
//!   them all, in the same slot where it is free and in another free slot where not (keeping
//!   their ids); the source's block address is remapped onto the destination's memory and the
//!   source's memory punched out of the block file;
//! - *emptying*: while a class has a whole block's worth of free slots, its sparsest block's
//!   objects are copied into the free slots of the fullest blocks (several of them, so blocks
//!   more than half full pack too), and the emptied block's memory is freed.
//!
//! A pointer whose slot no longer holds its id is found by id; one whose address is no longer
//! its block's own is *indirect*. The manager asks for the indirect pointers
//! ([`ObjectStore::indirect`]) and records each object's pointer at its block's own address
//! ([`ObjectStore::correct`], CoRM §3.2); the old pointer keeps working for a grace period
//! (so requests already under way with it finish), then its address, once no pointer names
//! it, is unmapped and reused (CoRM §3.3).
//!
//! Consistency: allocation, freeing and compaction take the store's lock exclusively, reads and
//! writes share it, so no read or write overlaps a move. Writers of one object exclude each
//! other with the version word's odd bit, and a read copies again until the version was even
//! and unchanged around its copy, so it never returns a torn mix of two writes.

mod block;
pub mod classes;
mod memory;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use block::Block;
use classes::{BLOCK_SIZE, class_for, slot_size, slot_sizes, slots_per_block};
use memory::BlockMemory;

use crate::error::{DaemonError, Result};

/// Bytes of an object's header.
pub const HEADER: u64 = 32;
const VERSION_AT: u32 = 0;
const INO_AT: u32 = 8;
const GENERATION_AT: u32 = 16;
const LEN_AT: u32 = 24;
/// A class is compacted once more than this share of its slots is free.
const FRAGMENTATION_THRESHOLD: f64 = 0.2;
/// Blocks one compaction of a class after a free merges or empties at most (bounds how long it
/// holds the store: about 50 us a block).
const MERGES_PER_PASS: usize = 16;
/// Blocks one step of [`ObjectStore::compact`] merges or empties at most (each step sorts the
/// class's blocks again, so one block a step would cost most of its time sorting).
const BLOCKS_PER_STEP: usize = 4;
/// How many times as long as a step of [`ObjectStore::compact`] held the store it then leaves
/// it to reads and writes.
const COMPACTION_PAUSE: u32 = 6;
/// The longest such pause.
const MAX_COMPACTION_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);
/// How long a corrected pointer keeps reaching its object ([`ObjectStore::correct`]): longer
/// than any request or move under way with it takes (a move copies at most 8 KiB and is
/// recorded in one durable change).
pub const CORRECTION_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// An object's key: the block address its pointer names, and its id.
type Key = (u32, u32);

/// The keys of `set`, starting at a place that moves on by `max` each call (`cursor`), so
/// that successive calls asking for `max` see every key even when callers skip some.
fn rotated<'a>(
    set: &'a HashSet<Key>,
    cursor: &std::sync::atomic::AtomicUsize,
    max: usize,
) -> impl Iterator<Item = Key> + 'a {
    let start = match set.len() {
        0 => 0,
        n => cursor.fetch_add(max, Ordering::Relaxed) % n,
    };
    set.iter()
        .skip(start)
        .chain(set.iter().take(start))
        .copied()
}

/// Where an object is: what a small region's map entry holds (block address, slot hint, id;
/// the transport's wire type).
pub use regions_proto::frame::{ObjectRef, Settle};

/// The region an object belongs to; every access names it and is refused for another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The region's inode.
    pub ino: u64,
    /// The region's generation.
    pub generation: u32,
}

/// One size class as `.regions/pools` shows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClassStats {
    /// Bytes of one slot (header and object).
    pub slot_size: u32,
    /// Blocks of the class.
    pub blocks: u32,
    /// Objects in them.
    pub objects: u64,
    /// Header and in-use bytes of those objects.
    pub live_bytes: u64,
    /// Bytes of the blocks (an upper bound of their memory: untouched pages use none).
    pub block_bytes: u64,
    /// Share of the class's slots that are free.
    pub fragmentation: f64,
    /// Blocks merged into others.
    pub compactions: u64,
    /// Objects that changed slot or block in compactions.
    pub moved_objects: u64,
    /// Objects whose pointer names another block's address (until the manager corrects it).
    pub indirect: u64,
}

/// What a compaction did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compaction {
    /// Blocks merged into another or emptied into several (their memory freed).
    pub blocks_freed: u32,
    /// Objects copied into another block.
    pub objects_merged: u64,
    /// Of those, objects that took another slot or went to another block than their
    /// neighbours (a block emptied into several moves all of its objects).
    pub objects_moved: u64,
    /// Memory the block file held before less after.
    pub bytes_freed: u64,
    /// How long [`ObjectStore::compact`] held the store (its pauses between blocks left out).
    pub held: std::time::Duration,
}

impl std::ops::AddAssign for Compaction {
    fn add_assign(&mut self, o: Compaction) {
        self.blocks_freed += o.blocks_freed;
        self.objects_merged += o.objects_merged;
        self.objects_moved += o.objects_moved;
        self.bytes_freed += o.bytes_freed;
        self.held += o.held;
    }
}

/// An object whose pointer is indirect ([`ObjectStore::indirect`]): where its manager's record
/// points and where the object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Indirect {
    /// The region it belongs to.
    pub owner: Owner,
    /// Its pointer as handed out.
    pub old: ObjectRef,
    /// Its pointer at its block's own address.
    pub new: ObjectRef,
}

/// An object an earlier manager allocated ([`ObjectStore::inherited`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inherited {
    /// Its region, pointer as handed out (`old`) and pointer at its block (`new`).
    pub object: Indirect,
    /// An earlier manager froze it.
    pub frozen: bool,
}

/// The objects of one daemon: blocks in one memfd, shown through a window of block addresses.
pub struct ObjectStore {
    memory: BlockMemory,
    inner: RwLock<Inner>,
    /// Whether a free that leaves its class fragmented compacts it.
    auto_compact: std::sync::atomic::AtomicBool,
    /// Where the next [`ObjectStore::indirect`] starts, so that pointers the manager cannot
    /// correct (of objects no region names) never hide the others.
    indirect_cursor: std::sync::atomic::AtomicUsize,
    /// Where the next [`ObjectStore::inherited`] starts.
    inherited_cursor: std::sync::atomic::AtomicUsize,
}

#[derive(Default)]
struct ClassState {
    /// Blocks of the class with a free slot, by file block.
    open: BTreeSet<u32>,
    /// The block the class allocates in first.
    current: Option<u32>,
    blocks: u32,
    objects: u64,
    compactions: u64,
    moved: u64,
    /// Frees since the class was last compacted.
    frees_since_compaction: u32,
}

/// An object a pointer reaches ([`Inner::resolve`]).
struct Found {
    file_block: u32,
    slot: u32,
    /// The object's key (the pointer handed out for it).
    key: Key,
    /// The address the caller should name it by.
    named: u32,
}

struct Inner {
    /// Blocks by file block.
    blocks: HashMap<u32, Block>,
    /// The file block each mapped address shows.
    by_address: HashMap<u32, u32>,
    /// The one pointer handed out for each object, by key, and the file block holding it.
    handed: HashMap<Key, u32>,
    /// Keys corrected to another, which they still reach until their grace period ends.
    retired: HashMap<Key, (Key, std::time::Instant)>,
    /// How long a corrected key keeps reaching its object.
    grace: std::time::Duration,
    /// When allocations and frees next end grace periods that are over.
    next_purge: std::time::Instant,
    /// Keys of `handed` whose address is not their block's own.
    indirect: HashSet<Key>,
    /// Keys (handed or retired) that name each address.
    pointers: HashMap<u32, u64>,
    /// Addresses of blocks gone that keys still name: unmapped, not reused until no key does.
    reserved: HashSet<u32>,
    free_addresses: Vec<u32>,
    next_address: u32,
    free_file_blocks: Vec<u32>,
    next_file_block: u32,
    /// File blocks the memory budget allows.
    max_blocks: u32,
    /// Regions whose object is moving (to chunks or to another object), and the incarnation
    /// of the manager that froze it: writes to it are refused meanwhile. Only a thaw, a free
    /// or a later manager ([`ObjectStore::settle`]) ends a freeze: a freeze that lapsed by
    /// itself after its manager died would let a writer with an old map write to an object
    /// its region no longer names. Keyed by region and object id (an object keeps its id
    /// when compaction moves it).
    frozen: HashMap<(u64, u32), u64>,
    /// The incarnation of the manager the store serves (the last one that allocated, fitted,
    /// froze or asked for [`ObjectStore::inherited`]).
    manager: u64,
    /// Keys of objects that earlier managers allocated and the one served has not settled
    /// yet: after a manager restarts, objects its predecessor may have left unnamed.
    inherited: HashSet<Key>,
    classes: Vec<ClassState>,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStore")
            .field("allocated_bytes", &self.allocated_bytes())
            .finish_non_exhaustive()
    }
}

impl ObjectStore {
    /// A store of at most `capacity` bytes of blocks (rounded down to whole blocks).
    pub fn new(capacity: u64) -> Result<ObjectStore> {
        let max_blocks = u32::try_from(capacity / BLOCK_SIZE)
            .map_err(|_| DaemonError::Invalid(format!("object store of {capacity} bytes")))?;
        // Four times the blocks: merged and emptied blocks keep their addresses while pointers
        // name them (until the manager corrects those pointers).
        let addresses = max_blocks.saturating_mul(4).max(4);
        Ok(ObjectStore {
            memory: BlockMemory::new(addresses)?,
            inner: RwLock::new(Inner {
                blocks: HashMap::new(),
                by_address: HashMap::new(),
                handed: HashMap::new(),
                retired: HashMap::new(),
                grace: CORRECTION_GRACE,
                next_purge: std::time::Instant::now(),
                indirect: HashSet::new(),
                pointers: HashMap::new(),
                reserved: HashSet::new(),
                free_addresses: Vec::new(),
                next_address: 0,
                free_file_blocks: Vec::new(),
                next_file_block: 0,
                max_blocks,
                frozen: HashMap::new(),
                manager: 0,
                inherited: HashSet::new(),
                classes: slot_sizes().iter().map(|_| ClassState::default()).collect(),
            }),
            auto_compact: std::sync::atomic::AtomicBool::new(true),
            indirect_cursor: std::sync::atomic::AtomicUsize::new(0),
            inherited_cursor: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Whether frees compact a class they leave fragmented (on by default; off, only
    /// [`ObjectStore::compact`] and a full store compact).
    pub fn set_auto_compaction(&self, on: bool) {
        self.auto_compact.store(on, Ordering::Relaxed);
    }

    /// How long a corrected pointer keeps reaching its object ([`CORRECTION_GRACE`] unless
    /// set; tests shorten it).
    pub fn set_correction_grace(&self, grace: std::time::Duration) {
        self.write_inner().grace = grace;
    }

    fn read_inner(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write_inner(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new object of `len` bytes (zeros) for `owner`, and the bytes its slot can hold.
    pub fn alloc_with_capacity(&self, owner: Owner, len: u32) -> Result<(ObjectRef, u32)> {
        let at = self.alloc(owner, len)?;
        let capacity = class_for(len).map_or(len, |c| slot_size(c) - HEADER as u32);
        Ok((at, capacity))
    }

    /// A new object of `len` bytes (zeros) for `owner`.
    pub fn alloc(&self, owner: Owner, len: u32) -> Result<ObjectRef> {
        let class = class_for(len).ok_or(DaemonError::ObjectTooLarge {
            len: u64::from(len),
            max: u64::from(classes::max_object()),
        })?;
        let mut inner = self.write_inner();
        inner.purge_retired_now_and_then(&self.memory);
        let file_block = match inner.open_block(class) {
            Some(b) => b,
            None => {
                if inner.blocks.len() as u32 >= inner.max_blocks {
                    // Out of blocks: compact every class, then try again.
                    for c in 0..inner.classes.len() {
                        inner.compact_class(&self.memory, c, usize::MAX)?;
                    }
                }
                match inner.open_block(class) {
                    Some(b) => b,
                    None => inner.new_block(&self.memory, class)?,
                }
            }
        };
        let vanished = || DaemonError::Invalid("open block vanished".into());
        let (address, id) = {
            let block = inner.blocks.get(&file_block).ok_or_else(vanished)?;
            let mut rng = rand::rng();
            // Unique in the block, and no other object's key (a retired one included).
            let id = loop {
                let id = block.fresh_id(&mut rng);
                let key = (block.address, id);
                if !inner.handed.contains_key(&key) && !inner.retired.contains_key(&key) {
                    break id;
                }
            };
            (block.address, id)
        };
        let block = inner.blocks.get_mut(&file_block).ok_or_else(vanished)?;
        let slot = block
            .take(None, id, address)
            .ok_or_else(|| DaemonError::Invalid("open block is full".into()))?;
        let full = block.is_full();
        let state = &mut inner.classes[class];
        state.objects += 1;
        if full {
            state.open.remove(&file_block);
        }
        inner.hand_out((address, id), file_block);
        let size = slot_size(class);
        let at = slot * size;
        let mut head = [0u8; HEADER as usize];
        head[INO_AT as usize..][..8].copy_from_slice(&owner.ino.to_le_bytes());
        head[GENERATION_AT as usize..][..4].copy_from_slice(&owner.generation.to_le_bytes());
        head[20..24].copy_from_slice(&id.to_le_bytes());
        head[LEN_AT as usize..][..4].copy_from_slice(&len.to_le_bytes());
        // SAFETY: the address is mapped (its block is live) and cannot be remapped while this
        // thread holds the store exclusively; the slot lies inside the block. The version word
        // is left as it was (even: a freed slot's writers have finished), so a reader that
        // kept a stale pointer sees it change.
        unsafe {
            let version = self
                .version(address, at)
                .map_or(0, |v| v.load(Ordering::Acquire));
            self.memory.write(address, at, &head);
            self.memory.write(
                address,
                at + HEADER as u32,
                &vec![0u8; (size - HEADER as u32) as usize],
            );
            if let Some(v) = self.version(address, at) {
                v.store((version | 1) + 1, Ordering::Release);
            }
        }
        Ok(ObjectRef { address, slot, id })
    }

    /// The version word of the slot at byte `at` of block address `address`.
    ///
    /// # Safety
    ///
    /// The address must be mapped and stable while the reference is used.
    unsafe fn version(&self, address: u32, at: u32) -> Option<&AtomicU64> {
        // SAFETY: as the caller guarantees.
        unsafe { self.memory.word(address, at + VERSION_AT) }
    }

    /// Frees the object `ptr` of `owner`. Gives back the pages no object lies on any more,
    /// and compacts its class when that leaves it fragmented (both best effort: the object is
    /// freed whatever they do).
    pub fn free(&self, owner: Owner, ptr: ObjectRef) -> Result<()> {
        let mut inner = self.write_inner();
        self.free_in(&mut inner, owner, ptr)
    }

    /// [`ObjectStore::free`], with the store held.
    fn free_in(&self, inner: &mut Inner, owner: Owner, ptr: ObjectRef) -> Result<()> {
        inner.purge_retired_now_and_then(&self.memory);
        let Found {
            file_block,
            slot,
            key,
            ..
        } = inner.resolve(ptr)?;
        let (address, class) = {
            let b = &inner.blocks[&file_block];
            (b.address, b.class)
        };
        let at = slot * slot_size(class);
        self.check_owner(address, at, owner)?;
        // SAFETY: mapped and stable under the exclusive lock; the slot is inside the block.
        unsafe {
            self.memory
                .write(address, at + 8, &[0u8; HEADER as usize - 8])
        };
        inner.forget_pointer(&self.memory, key);
        inner.frozen.remove(&(owner.ino, ptr.id));
        inner.inherited.remove(&key);
        let block = inner
            .blocks
            .get_mut(&file_block)
            .ok_or_else(|| DaemonError::Invalid("resolved block vanished".into()))?;
        block.release(slot);
        let empty = block.live() == 0;
        let (from, to) = block.free_pages_around(slot);
        let state = &mut inner.classes[class];
        state.objects -= 1;
        state.open.insert(file_block);
        if empty {
            inner.free_block(&self.memory, file_block);
            return Ok(());
        }
        // Pages no object lies on any more go back to the kernel (they read as zeros).
        if let Err(e) = self.memory.punch_range(file_block, from, to) {
            tracing::warn!(error = %e, "cannot give back the pages of a freed object");
        }
        let state = &mut inner.classes[class];
        state.frees_since_compaction += 1;
        // Compacted again once the class is fragmented and has freed half a block's slots
        // since its last compaction (which may have found nothing to merge).
        if self.auto_compact.load(Ordering::Relaxed)
            && state.frees_since_compaction >= slots_per_block(class).div_ceil(2)
            && inner.fragmentation(class) > FRAGMENTATION_THRESHOLD
            && let Err(e) = inner.compact_class(&self.memory, class, MERGES_PER_PASS)
        {
            tracing::warn!(class, error = %e, "compaction after a free failed");
        }
        Ok(())
    }

    /// Checks that the object at byte `at` of `address` belongs to `owner`.
    fn check_owner(&self, address: u32, at: u32, owner: Owner) -> Result<()> {
        let mut head = [0u8; 12];
        // SAFETY: the caller holds the store (shared or exclusive), so the address is mapped and
        // stable; the header lies inside the block.
        unsafe { self.memory.read(address, at + INO_AT, &mut head) };
        let ino = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
        let generation = u32::from_le_bytes(head[8..].try_into().unwrap_or_default());
        if ino != owner.ino || generation != owner.generation {
            return Err(DaemonError::Stale(format!(
                "the object holds region {ino} generation {generation}, not region {} \
                 generation {}: refresh the region's map",
                owner.ino, owner.generation
            )));
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes of `owner`'s object `ptr` from `offset` (bytes never written
    /// read as zeros). Returns the corrected pointer when `ptr` was indirect.
    pub fn read(
        &self,
        owner: Owner,
        ptr: ObjectRef,
        offset: u32,
        dst: &mut [u8],
    ) -> Result<Option<ObjectRef>> {
        let inner = self.read_inner();
        let (address, at, corrected) = self.locate(&inner, owner, ptr, offset, dst.len(), false)?;
        // SAFETY: the address is mapped and cannot be remapped while this thread holds the
        // store shared (`inner` lives to the end of the function); the word is the slot's own.
        let Some(word) = (unsafe { self.version(address, at) }) else {
            return Err(DaemonError::Invalid("misaligned object header".into()));
        };
        loop {
            let before = word.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::thread::yield_now();
                continue;
            }
            // SAFETY: as above; `locate` checked that the range lies inside the slot.
            unsafe { self.memory.read(address, at + HEADER as u32 + offset, dst) };
            std::sync::atomic::fence(Ordering::Acquire);
            if word.load(Ordering::Acquire) == before {
                return Ok(corrected);
            }
        }
    }

    /// Copies `src` into `owner`'s object `ptr` at `offset`. Returns the corrected pointer when
    /// `ptr` was indirect. A write past the object's slot fails with `EFBIG`: the region must
    /// move to a segment of its own first.
    pub fn write(
        &self,
        owner: Owner,
        ptr: ObjectRef,
        offset: u32,
        src: &[u8],
    ) -> Result<Option<ObjectRef>> {
        let inner = self.read_inner();
        let (address, at, corrected) = self.locate(&inner, owner, ptr, offset, src.len(), true)?;
        if inner.frozen.contains_key(&(owner.ino, ptr.id)) {
            return Err(DaemonError::Stale(format!(
                "region {} is moving from its object to chunks: refresh its map and write there",
                owner.ino
            )));
        }
        // SAFETY: as in `read`: mapped and stable while `inner` is held; the slot's own word.
        let Some(word) = (unsafe { self.version(address, at) }) else {
            return Err(DaemonError::Invalid("misaligned object header".into()));
        };
        // SAFETY: as above, for the slot's in-use length word.
        let Some(len) = (unsafe { self.memory.word(address, at + LEN_AT) }) else {
            return Err(DaemonError::Invalid("misaligned object header".into()));
        };
        // Take the odd bit: other writers of the object wait, readers copy again.
        let mut v = word.load(Ordering::Acquire);
        loop {
            if v & 1 == 1 {
                std::thread::yield_now();
                v = word.load(Ordering::Acquire);
                continue;
            }
            match word.compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => v = now,
            }
        }
        // The odd version must be visible before any byte of the write (a reader that sees a
        // new byte then sees the version changed).
        std::sync::atomic::fence(Ordering::Release);
        // SAFETY: as above; `locate` checked that the range lies inside the slot.
        unsafe { self.memory.write(address, at + HEADER as u32 + offset, src) };
        // The in-use length and the zero word after it are one little-endian u64.
        len.fetch_max(u64::from(offset) + src.len() as u64, Ordering::AcqRel);
        word.store(v + 2, Ordering::Release);
        Ok(corrected)
    }

    /// The address and slot byte of `owner`'s object `ptr` for an access of `n` bytes at
    /// `offset`, and the corrected pointer if `ptr` was indirect.
    fn locate(
        &self,
        inner: &Inner,
        owner: Owner,
        ptr: ObjectRef,
        offset: u32,
        n: usize,
        writing: bool,
    ) -> Result<(u32, u32, Option<ObjectRef>)> {
        let Found {
            file_block,
            slot,
            named,
            ..
        } = inner.resolve(ptr)?;
        let block = &inner.blocks[&file_block];
        let size = slot_size(block.class);
        // Through the block's own address (the pointer's may show another block now, or
        // nothing).
        let address = block.address;
        let at = slot * size;
        self.check_owner(address, at, owner)?;
        let capacity = u64::from(size) - HEADER;
        let end = u64::from(offset) + n as u64;
        if end > capacity {
            if !writing {
                return Err(DaemonError::Invalid(format!(
                    "a read of {n} bytes at {offset} runs past the {capacity} bytes of region \
                     {}'s object",
                    owner.ino
                )));
            }
            return Err(DaemonError::ObjectTooLarge {
                len: end,
                max: capacity,
            });
        }
        let corrected = (slot != ptr.slot || named != ptr.address).then_some(ObjectRef {
            address: named,
            slot,
            id: ptr.id,
        });
        Ok((address, at, corrected))
    }

    /// Refuses writes to `owner`'s object `ptr` from now on (its region moves to chunks);
    /// reads go on. Takes the store exclusively, so no write is under way when it returns.
    pub fn freeze(&self, owner: Owner, ptr: ObjectRef) -> Result<()> {
        let mut inner = self.write_inner();
        let Found {
            file_block, slot, ..
        } = inner.resolve(ptr)?;
        let block = &inner.blocks[&file_block];
        self.check_owner(block.address, slot * slot_size(block.class), owner)?;
        let manager = inner.manager;
        inner.frozen.insert((owner.ino, ptr.id), manager);
        Ok(())
    }

    /// A new object of `len` bytes for `owner` holding the bytes of its object `ptr`, which
    /// is frozen from then on (its region is fitted to a smaller size class). Refused with
    /// `EBUSY` (and nothing changed) when a byte past `len`'s object is in use.
    pub fn refit(&self, owner: Owner, ptr: ObjectRef, len: u32) -> Result<(ObjectRef, u32)> {
        let old_capacity = {
            let inner = self.read_inner();
            let file_block = inner.resolve(ptr)?.file_block;
            slot_size(inner.blocks[&file_block].class) - HEADER as u32
        };
        let (new, capacity) = self.alloc_with_capacity(owner, len)?;
        self.freeze(owner, ptr)?;
        let mut bytes = vec![0u8; old_capacity as usize];
        let copied = self.read(owner, ptr, 0, &mut bytes).and_then(|_| {
            let (kept, past) = bytes.split_at(bytes.len().min(capacity as usize));
            if past.iter().any(|b| *b != 0) {
                return Err(DaemonError::Busy(format!(
                    "region {}'s object holds bytes past {capacity}: not fitted",
                    owner.ino
                )));
            }
            self.write(owner, new, 0, kept)
        });
        if let Err(e) = copied {
            let _ = self.free(owner, new);
            let _ = self.thaw(owner, ptr);
            return Err(e);
        }
        Ok((new, capacity))
    }

    /// Takes writes to `owner`'s object `ptr` again (a move that was given up).
    pub fn thaw(&self, owner: Owner, ptr: ObjectRef) -> Result<()> {
        let mut inner = self.write_inner();
        let Found {
            file_block, slot, ..
        } = inner.resolve(ptr)?;
        let block = &inner.blocks[&file_block];
        self.check_owner(block.address, slot * slot_size(block.class), owner)?;
        inner.frozen.remove(&(owner.ino, ptr.id));
        Ok(())
    }

    /// The pointer to `owner`'s object `ptr` at its block's own address and slot (the pointer
    /// correction of CoRM §3.2), which becomes the object's one pointer. The old one keeps
    /// reaching the object for the grace period ([`CORRECTION_GRACE`]), then its address is
    /// released once no pointer names it. Correcting again (with either) changes nothing.
    pub fn correct(&self, owner: Owner, ptr: ObjectRef) -> Result<ObjectRef> {
        let mut inner = self.write_inner();
        inner.purge_retired(&self.memory);
        let Found {
            file_block,
            slot,
            key,
            ..
        } = inner.resolve(ptr)?;
        let block = &inner.blocks[&file_block];
        let address = block.address;
        self.check_owner(address, slot * slot_size(block.class), owner)?;
        let fresh = ObjectRef {
            address,
            slot,
            id: ptr.id,
        };
        if key.0 != address {
            let until = std::time::Instant::now() + inner.grace;
            // The old key stays named (it reaches the object until `until`).
            inner.handed.remove(&key);
            inner.indirect.remove(&key);
            inner.retired.insert(key, ((address, ptr.id), until));
            inner.hand_out((address, ptr.id), file_block);
            if inner.inherited.remove(&key) {
                inner.inherited.insert((address, ptr.id));
            }
            if let Some(b) = inner.blocks.get_mut(&file_block) {
                b.set_key_address(ptr.id, address);
            }
            if inner.grace.is_zero() {
                inner.purge_retired(&self.memory);
            }
        }
        Ok(fresh)
    }

    /// At most `max` objects whose pointers are indirect (their address is not their block's
    /// own), for the manager to correct; successive calls start where the last one ended.
    pub fn indirect(&self, max: usize) -> Vec<Indirect> {
        let inner = self.read_inner();
        let keys = rotated(&inner.indirect, &self.indirect_cursor, max);
        keys.filter_map(|key| self.pointers_of(&inner, key))
            .take(max)
            .collect()
    }

    /// Starts serving the manager of incarnation `manager`: when it is a new one, every
    /// object the store holds becomes inherited ([`ObjectStore::inherited`]) until that
    /// manager settles it. Objects it allocates from then on are its own.
    pub fn serve_manager(&self, manager: u64) {
        if self.read_inner().manager == manager {
            return;
        }
        let mut inner = self.write_inner();
        if inner.manager != manager {
            inner.manager = manager;
            inner.inherited = inner.handed.keys().copied().collect();
            tracing::info!(
                manager,
                objects = inner.inherited.len(),
                "a new manager: the objects held wait for it to settle them"
            );
        }
    }

    /// At most `max` objects earlier managers allocated that the one served (incarnation
    /// `manager`, served from now on) has not settled: it keeps those its regions name and
    /// frees the others ([`ObjectStore::settle`]). Successive calls start where the last one
    /// ended.
    pub fn inherited(&self, manager: u64, max: usize) -> Vec<Inherited> {
        self.serve_manager(manager);
        let inner = self.read_inner();
        let keys = rotated(&inner.inherited, &self.inherited_cursor, max);
        keys.filter_map(|key| {
            let object = self.pointers_of(&inner, key)?;
            let frozen = inner
                .frozen
                .get(&(object.owner.ino, key.1))
                .is_some_and(|by| *by != inner.manager);
            Some(Inherited { object, frozen })
        })
        .take(max)
        .collect()
    }

    /// Settles `owner`'s inherited object `ptr` for the manager of incarnation `manager`:
    /// keeps it ([`Settle::KeepAndThaw`]: and ends a freeze an earlier manager left), or
    /// frees it. `false` (and nothing done) when it is no longer inherited.
    pub fn settle(
        &self,
        manager: u64,
        owner: Owner,
        ptr: ObjectRef,
        settle: Settle,
    ) -> Result<bool> {
        self.serve_manager(manager);
        let mut inner = self.write_inner();
        let Found {
            file_block,
            slot,
            key,
            ..
        } = inner.resolve(ptr)?;
        if !inner.inherited.contains(&key) {
            return Ok(false);
        }
        let block = &inner.blocks[&file_block];
        self.check_owner(block.address, slot * slot_size(block.class), owner)?;
        match settle {
            Settle::Free => self.free_in(&mut inner, owner, ptr)?,
            Settle::Keep | Settle::KeepAndThaw => {
                inner.inherited.remove(&key);
                let frozen = (owner.ino, ptr.id);
                if settle == Settle::KeepAndThaw
                    && inner.frozen.get(&frozen).is_some_and(|by| *by != manager)
                {
                    inner.frozen.remove(&frozen);
                }
            }
        }
        Ok(true)
    }

    /// The object of `key`: its region and its pointers (as handed out, and at its block).
    fn pointers_of(&self, inner: &Inner, key: Key) -> Option<Indirect> {
        let (address, id) = key;
        let block = inner.handed.get(&key).and_then(|b| inner.blocks.get(b))?;
        let slot = block.slot_of(id)?;
        let mut head = [0u8; 12];
        // SAFETY: the block's own address is mapped and stable while the caller holds the
        // store (`inner`); the header lies inside the block.
        unsafe {
            self.memory.read(
                block.address,
                slot * slot_size(block.class) + INO_AT,
                &mut head,
            )
        };
        let owner = Owner {
            ino: u64::from_le_bytes(head[..8].try_into().unwrap_or_default()),
            generation: u32::from_le_bytes(head[8..].try_into().unwrap_or_default()),
        };
        Some(Indirect {
            owner,
            old: ObjectRef { address, slot, id },
            new: ObjectRef {
                address: block.address,
                slot,
                id,
            },
        })
    }

    /// Compacts every class (or `class`): merges sparse blocks while any two fit in one, then
    /// empties blocks into the others while a class has a whole block's worth free.
    pub fn compact(&self, class: Option<usize>) -> Result<Compaction> {
        let before = self.memory.allocated_bytes();
        let classes = {
            let mut inner = self.write_inner();
            inner.purge_retired(&self.memory);
            match class {
                Some(c) if c < inner.classes.len() => c..c + 1,
                Some(c) => return Err(DaemonError::Invalid(format!("no size class {c}"))),
                None => 0..inner.classes.len(),
            }
        };
        let mut done = Compaction::default();
        for c in classes {
            // A few blocks at a time, each step under the store's lock on its own, so that
            // reads and writes go on between them (a pass over a class would hold them off
            // throughout).
            loop {
                let started = std::time::Instant::now();
                let step = self
                    .write_inner()
                    .compact_class(&self.memory, c, BLOCKS_PER_STEP)?;
                let held = started.elapsed();
                done += step;
                done.held += held;
                if step.blocks_freed == 0 {
                    break;
                }
                // A pause six times as long as the step held the store: the lock is not fair,
                // so without it this thread takes it back before a waiting reader runs; with
                // it reads and writes keep more than four fifths of their rate meanwhile.
                std::thread::sleep((held * COMPACTION_PAUSE).min(MAX_COMPACTION_PAUSE));
            }
        }
        done.bytes_freed = before.saturating_sub(self.memory.allocated_bytes());
        Ok(done)
    }

    /// Per size class: blocks, objects, live bytes, fragmentation, compactions.
    pub fn stats(&self) -> Vec<ClassStats> {
        let inner = self.read_inner();
        let mut out: Vec<ClassStats> = inner
            .classes
            .iter()
            .enumerate()
            .map(|(c, s)| ClassStats {
                slot_size: slot_size(c),
                blocks: s.blocks,
                objects: s.objects,
                block_bytes: u64::from(s.blocks) * BLOCK_SIZE,
                fragmentation: inner.fragmentation(c),
                compactions: s.compactions,
                moved_objects: s.moved,
                ..ClassStats::default()
            })
            .collect();
        for block in inner.blocks.values() {
            let size = slot_size(block.class);
            for (slot, _) in block.objects() {
                // SAFETY: the block's address is mapped and stable under the shared lock; the
                // word is inside the slot.
                let len = unsafe { self.memory.word(block.address, slot * size + LEN_AT) }
                    .map_or(0, |w| w.load(Ordering::Acquire));
                out[block.class].live_bytes += HEADER + len;
            }
        }
        for key in &inner.indirect {
            if let Some(b) = inner.handed.get(key).and_then(|b| inner.blocks.get(b)) {
                out[b.class].indirect += 1;
            }
        }
        out
    }

    /// The most memory the blocks may hold.
    pub fn capacity(&self) -> u64 {
        u64::from(self.read_inner().max_blocks) * BLOCK_SIZE
    }

    /// Bytes of memory the blocks hold (pages actually allocated).
    pub fn allocated_bytes(&self) -> u64 {
        self.memory.allocated_bytes()
    }

    /// Block addresses mapped: every block's own and the merged blocks' still named by a
    /// pointer.
    pub fn addresses_in_use(&self) -> usize {
        self.read_inner().by_address.len()
    }
}

impl Inner {
    /// A block of `class` with a free slot: the one the class allocated in last, else the
    /// fullest (so sparse blocks empty out and can be merged or freed).
    fn open_block(&mut self, class: usize) -> Option<u32> {
        let state = &self.classes[class];
        if let Some(b) = state.current.filter(|b| state.open.contains(b)) {
            return Some(b);
        }
        let best = state
            .open
            .iter()
            .copied()
            .max_by_key(|b| self.blocks.get(b).map_or(0, Block::live))?;
        self.classes[class].current = Some(best);
        Some(best)
    }

    /// A new empty block of `class`, mapped at a free address.
    fn new_block(&mut self, memory: &BlockMemory, class: usize) -> Result<u32> {
        if self.blocks.len() as u32 >= self.max_blocks {
            return Err(DaemonError::NoSpace(format!(
                "this host's memory for small regions is full ({} blocks of {} KiB, all live \
                 after compaction): delete regions or give the daemon more --memory",
                self.max_blocks,
                BLOCK_SIZE >> 10
            )));
        }
        let address = self.take_address(memory)?;
        let file_block = self.free_file_blocks.pop().unwrap_or_else(|| {
            self.next_file_block += 1;
            self.next_file_block - 1
        });
        // SAFETY: the address is free (nobody holds a pointer naming it) and this thread
        // holds the store exclusively.
        if let Err(e) = unsafe { memory.map(address, file_block) } {
            self.free_addresses.push(address);
            self.free_file_blocks.push(file_block);
            return Err(e);
        }
        self.by_address.insert(address, file_block);
        self.blocks.insert(file_block, Block::new(class, address));
        let state = &mut self.classes[class];
        state.blocks += 1;
        state.open.insert(file_block);
        state.current = Some(file_block);
        Ok(file_block)
    }

    fn take_address(&mut self, memory: &BlockMemory) -> Result<u32> {
        if let Some(a) = self.free_addresses.pop() {
            return Ok(a);
        }
        if self.next_address >= memory.addresses() {
            return Err(DaemonError::NoSpace(format!(
                "all {} block addresses for small regions are in use (merged blocks keep \
                 theirs while pointers name them): correct the pointers of small regions \
                 (their maps name merged blocks) or delete regions",
                memory.addresses()
            )));
        }
        self.next_address += 1;
        Ok(self.next_address - 1)
    }

    /// The object `ptr` names: its file block, its slot, its key (the pointer handed out for
    /// it), and the address a caller should name it by from now on. `ptr` reaches it when it
    /// is the object's key (its slot a hint), a key corrected to another within its grace
    /// period (the address is the new key's), or the pointer at the object's own block
    /// (recorded by the manager before the daemon heard of the correction).
    fn resolve(&self, ptr: ObjectRef) -> Result<Found> {
        let gone = || {
            DaemonError::Stale(format!(
                "no object {:#x} at block address {}: it was freed or moved; refresh the \
                 region's map",
                ptr.id, ptr.address
            ))
        };
        if ptr.id == 0 {
            return Err(gone());
        }
        let mut key = (ptr.address, ptr.id);
        let mut named = ptr.address;
        if !self.handed.contains_key(&key) {
            if let Some((now, until)) = self.retired.get(&key)
                && std::time::Instant::now() < *until
            {
                key = *now;
                named = now.0;
            } else if let Some(block) = self
                .by_address
                .get(&ptr.address)
                .and_then(|b| self.blocks.get(b))
                .filter(|b| b.address == ptr.address)
                && let Some(k) = block.key_address(ptr.id)
            {
                key = (k, ptr.id);
            } else {
                return Err(gone());
            }
        }
        let file_block = *self.handed.get(&key).ok_or_else(gone)?;
        let block = self.blocks.get(&file_block).ok_or_else(gone)?;
        let slot = if block.id_at(ptr.slot) == ptr.id {
            ptr.slot
        } else {
            block.slot_of(ptr.id).ok_or_else(gone)?
        };
        Ok(Found {
            file_block,
            slot,
            key,
            named,
        })
    }

    /// Records the pointer handed out for an object: its key, held in `file_block`.
    fn hand_out(&mut self, key: Key, file_block: u32) {
        if self.handed.insert(key, file_block).is_none() {
            *self.pointers.entry(key.0).or_default() += 1;
        }
    }

    /// Records that the object of `key` is in `file_block` now, and whether its pointer is
    /// indirect there.
    fn moved_to(&mut self, key: Key, file_block: u32) {
        self.handed.insert(key, file_block);
        if self
            .blocks
            .get(&file_block)
            .is_some_and(|b| b.address != key.0)
        {
            self.indirect.insert(key);
        } else {
            self.indirect.remove(&key);
        }
    }

    /// Forgets the pointer handed out for an object (it was freed); releases its address if
    /// no pointer names it any more.
    fn forget_pointer(&mut self, memory: &BlockMemory, key: Key) {
        if self.handed.remove(&key).is_some() {
            self.indirect.remove(&key);
            self.unname(memory, key.0);
        }
    }

    /// One key fewer names `address`.
    fn unname(&mut self, memory: &BlockMemory, address: u32) {
        let left = match self.pointers.get_mut(&address) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => 0,
        };
        if left == 0 {
            self.pointers.remove(&address);
            self.release_address(memory, address);
        }
    }

    /// [`Inner::purge_retired`], at most once a second (allocations and frees call it, so
    /// that addresses of corrected pointers are reused without a compaction).
    fn purge_retired_now_and_then(&mut self, memory: &BlockMemory) {
        let now = std::time::Instant::now();
        if !self.retired.is_empty() && now >= self.next_purge {
            self.next_purge = now + std::time::Duration::from_secs(1);
            self.purge_retired(memory);
        }
    }

    /// Ends the grace period of corrected keys whose time is up.
    fn purge_retired(&mut self, memory: &BlockMemory) {
        if self.retired.is_empty() {
            return;
        }
        let now = std::time::Instant::now();
        let ended: Vec<Key> = self
            .retired
            .iter()
            .filter(|(_, (_, until))| *until <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in ended {
            self.retired.remove(&key);
            self.unname(memory, key.0);
        }
    }

    /// Lets `address` be reused if no key names it and it is not a live block's own: an
    /// alias is unmapped, a gone block's kept address freed. (An unmap that fails leaves the
    /// address showing the block until a new block is mapped over it: harmless.)
    fn release_address(&mut self, memory: &BlockMemory, address: u32) {
        if self.pointers.get(&address).is_some_and(|n| *n > 0) {
            return;
        }
        if self.reserved.remove(&address) {
            self.free_addresses.push(address);
            return;
        }
        let Some(file_block) = self.by_address.get(&address).copied() else {
            return;
        };
        let Some(block) = self.blocks.get_mut(&file_block) else {
            return;
        };
        if block.address == address {
            return;
        }
        block.aliases.retain(|a| *a != address);
        self.by_address.remove(&address);
        // SAFETY: no pointer names the address, and this thread holds the store exclusively.
        if let Err(e) = unsafe { memory.unmap(address) } {
            tracing::warn!(address, error = %e, "cannot unmap a released block address");
        }
        self.free_addresses.push(address);
    }

    /// Frees an empty block: its memory, its addresses (kept, unmapped, while keys name
    /// them) and its file block. (An unmap or punch that fails is logged: the address or
    /// file block is reused all the same, as a new map replaces whatever was there.)
    fn free_block(&mut self, memory: &BlockMemory, file_block: u32) {
        let Some(block) = self.blocks.remove(&file_block) else {
            return;
        };
        let state = &mut self.classes[block.class];
        state.blocks -= 1;
        state.open.remove(&file_block);
        if state.current == Some(file_block) {
            state.current = None;
        }
        for address in block.addresses() {
            self.by_address.remove(&address);
            // SAFETY: the block is empty, so no access reaches its addresses, and this thread
            // holds the store exclusively.
            if let Err(e) = unsafe { memory.unmap(address) } {
                tracing::warn!(address, error = %e, "cannot unmap a freed block's address");
            }
            if self.pointers.get(&address).is_some_and(|n| *n > 0) {
                self.reserved.insert(address);
            } else {
                self.free_addresses.push(address);
            }
        }
        if let Err(e) = memory.punch(file_block) {
            tracing::warn!(file_block, error = %e, "cannot free an empty block's memory");
        }
        self.free_file_blocks.push(file_block);
    }

    /// Share of `class`'s slots that are free.
    fn fragmentation(&self, class: usize) -> f64 {
        let s = &self.classes[class];
        let slots = u64::from(s.blocks) * u64::from(slots_per_block(class));
        if slots == 0 {
            0.0
        } else {
            1.0 - s.objects as f64 / slots as f64
        }
    }

    /// Merges blocks of `class`, sparsest first into the fullest that can take them, until no
    /// two fit in one; then empties the sparsest into the others while the class has a whole
    /// block's worth of free slots; at most `limit` blocks freed in all.
    fn compact_class(
        &mut self,
        memory: &BlockMemory,
        class: usize,
        limit: usize,
    ) -> Result<Compaction> {
        let mut done = Compaction::default();
        self.classes[class].frees_since_compaction = 0;
        // The class's blocks with room, by objects held: sorted once, then kept sorted as
        // merges change them (a merge removes its source and fills its destination).
        let mut open: Vec<(u32, u32)> = self.classes[class]
            .open
            .iter()
            .filter_map(|b| self.blocks.get(b).map(|x| (x.live(), *b)))
            .collect();
        open.sort_unstable();
        let slots = slots_per_block(class);
        while (done.blocks_freed as usize) < limit && open.len() >= 2 {
            // Sparsest source first; its destination the fullest block with room for it (the
            // last with at most `slots - live` objects) that shares no id with it. When the
            // sparsest fits nowhere, no other block does.
            let mut pair = None;
            for (i, &(live, src)) in open.iter().enumerate() {
                let fits = open.partition_point(|&(l, _)| l <= slots - live);
                pair = open[i + 1..fits.max(i + 1)]
                    .iter()
                    .rposition(|&(_, dst)| self.blocks[&dst].can_absorb(&self.blocks[&src]))
                    .map(|k| (i, i + 1 + k));
                if pair.is_some() || fits <= i + 1 {
                    break;
                }
            }
            let Some((i, j)) = pair else { break };
            let ((_, src), (_, dst)) = (open[i], open[j]);

            done += self.merge(memory, src, dst)?;
            // Both leave their places (i < j); the destination comes back with its new count
            // if it still has room.
            open.remove(j);
            open.remove(i);
            if let Some(b) = self.blocks.get(&dst)
                && !b.is_full()
            {
                let at = (b.live(), dst);
                let k = open.partition_point(|x| *x < at);
                open.insert(k, at);
            }
        }
        // Then, while the class has a whole block's worth of free slots, its sparsest block
        // is emptied into the others.
        while (done.blocks_freed as usize) < limit {
            let state = &self.classes[class];
            let free = u64::from(state.blocks) * u64::from(slots) - state.objects;
            if free < u64::from(slots) {
                break;
            }
            let Some(src) = state
                .open
                .iter()
                .copied()
                .min_by_key(|b| self.blocks.get(b).map_or(u32::MAX, Block::live))
            else {
                break;
            };
            match self.empty_block(memory, src)? {
                Some(d) => done += d,
                None => break,
            }
        }
        // Nothing more to free in whole blocks: each block left with room gets its objects
        // packed into its lowest slots, so that the pages after them go back to the kernel.
        if (done.blocks_freed as usize) < limit {
            let open: Vec<u32> = self.classes[class].open.iter().copied().collect();
            for b in open {
                let moved = self.pack(memory, b);
                done.objects_moved += moved;
                self.classes[class].moved += moved;
            }
        }
        Ok(done)
    }

    /// Moves the objects of block `file_block` into its lowest free slots (keeping their keys:
    /// the block is the same) and gives back the pages after the last one; the objects moved.
    fn pack(&mut self, memory: &BlockMemory, file_block: u32) -> u64 {
        let Some(block) = self.blocks.get(&file_block) else {
            return 0;
        };
        let (address, size) = (block.address, slot_size(block.class));
        let mut buf = vec![0u8; size as usize];
        let mut moved = 0;
        let last = loop {
            let Some(block) = self.blocks.get_mut(&file_block) else {
                return moved;
            };
            match block.ends() {
                (Some(low), Some(high)) if low < high => {
                    if !block.relocate(high, low) {
                        return moved;
                    }
                    // SAFETY: the block's own address is mapped and, under the exclusive
                    // lock, nobody else accesses it; both slots lie inside the block, and the
                    // destination was free.
                    unsafe {
                        memory.read(address, high * size, &mut buf);
                        memory.write(address, low * size, &buf);
                    }
                    moved += 1;
                }
                (_, high) => break high,
            }
        };
        let end = last.map_or(0, |s| (s + 1) * size);
        let from = end.div_ceil(4096) * 4096;
        if let Err(e) = memory.punch_range(file_block, from, BLOCK_SIZE as u32) {
            tracing::warn!(file_block, error = %e, "cannot give back a packed block's free pages");
        }
        moved
    }

    /// Copies the objects of block `src` into block `dst` (same slot where free, else another,
    /// ids kept), maps every address of `src` onto `dst`'s memory and frees `src`'s memory.
    /// Nothing changes in the books until every address is remapped: if a map fails, the
    /// addresses already moved are mapped back and the error returned with both blocks as
    /// they were.
    fn merge(&mut self, memory: &BlockMemory, src: u32, dst: u32) -> Result<Compaction> {
        let missing = || DaemonError::Invalid("compaction of a missing block".into());
        let from = self.blocks.get(&src).ok_or_else(missing)?;
        let mut into = self.blocks.get(&dst).ok_or_else(missing)?.clone();
        let class = from.class;
        let size = slot_size(class);
        let mut done = Compaction {
            blocks_freed: 1,
            ..Compaction::default()
        };
        let mut buf = vec![0u8; size as usize];
        // Objects whose slot is free in the destination keep it; then the others take what
        // is left (so none takes a slot another could have kept).
        let objects = from.keyed_objects();
        let mut placed: Vec<(u32, u32)> = Vec::with_capacity(objects.len());
        let mut moving = Vec::new();
        for &(slot, (key_address, id)) in &objects {
            if into.take_exactly(slot, id, key_address) {
                placed.push((slot, slot));
            } else {
                moving.push((slot, key_address, id));
            }
        }
        for (slot, key_address, id) in moving {
            let Some(to) = into.take(None, id, key_address) else {
                return Err(DaemonError::Invalid(
                    "compaction chose a destination without room".into(),
                ));
            };
            placed.push((slot, to));
        }
        for (slot, to) in placed {
            // SAFETY: both addresses are mapped and, under the exclusive lock, nobody else
            // accesses them; both slots lie inside their blocks, and the destination slot is
            // free in the books (an abandoned merge leaves bytes only in free slots).
            unsafe {
                memory.read(from.address, slot * size, &mut buf);
                memory.write(into.address, to * size, &buf);
            }
            done.objects_merged += 1;
            if to != slot {
                done.objects_moved += 1;
            }
        }
        let addresses: Vec<u32> = from.addresses().collect();
        for (k, &address) in addresses.iter().enumerate() {
            // SAFETY: under the exclusive lock nobody accesses the address while it changes
            // from the source's memory to the destination's, which now holds every object the
            // source held.
            if let Err(e) = unsafe { memory.map(address, dst) } {
                // Back to the source's memory, the failed one too (a failed MAP_FIXED may
                // have removed the old mapping); an address that cannot be mapped back is
                // taken out of the books, so that pointers naming it get ESTALE, never a hole.
                for &back in &addresses[..=k] {
                    // SAFETY: as above; the address goes back to the source's memory.
                    if let Err(e) = unsafe { memory.map(back, src) } {
                        tracing::error!(address = back, error = %e, "cannot map a block address back after a failed compaction; its pointers are refused");
                        self.by_address.remove(&back);
                    }
                }
                return Err(e);
            }
        }
        // Every address shows the destination: the books follow.
        let keys: Vec<Key> = objects.iter().map(|&(_, key)| key).collect();
        let full = into.is_full();
        into.aliases.extend_from_slice(&addresses);
        self.blocks.insert(dst, into);
        self.blocks.remove(&src);
        for &address in &addresses {
            self.by_address.insert(address, dst);
        }
        for key in keys {
            self.moved_to(key, dst);
        }
        if let Err(e) = memory.punch(src) {
            tracing::warn!(file_block = src, error = %e, "cannot free a merged block's memory");
        }
        self.free_file_blocks.push(src);
        let state = &mut self.classes[class];
        state.blocks -= 1;
        state.open.remove(&src);
        if full {
            state.open.remove(&dst);
        }
        if state.current == Some(src) {
            state.current = Some(dst);
        }
        state.compactions += 1;
        state.moved += done.objects_moved;
        // Addresses of the source that no pointer names are released at once.
        for address in addresses {
            self.release_address(memory, address);
        }
        Ok(done)
    }

    /// Empties block `src` into the free slots of the other blocks of its class, fullest
    /// first, and frees it; `None` (nothing changed) when they have no room for all of its
    /// objects (or only blocks that hold one of its ids).
    fn empty_block(&mut self, memory: &BlockMemory, src: u32) -> Result<Option<Compaction>> {
        let missing = || DaemonError::Invalid("compaction of a missing block".into());
        let from = self.blocks.get(&src).ok_or_else(missing)?;
        let (class, from_address) = (from.class, from.address);
        let size = slot_size(class);
        let objects = from.keyed_objects();
        let mut into: Vec<(u32, u32)> = self.classes[class]
            .open
            .iter()
            .filter(|b| **b != src)
            .filter_map(|b| self.blocks.get(b).map(|x| (x.free_slots(), *b)))
            .collect();
        into.sort_unstable();
        // Each object's destination: the fullest block with room that lacks its id.
        let mut plan = Vec::with_capacity(objects.len());
        let mut first = 0;
        for &(slot, key) in &objects {
            let Some(j) = (first..into.len())
                .find(|&j| into[j].0 > 0 && !self.blocks[&into[j].1].holds(key.1))
            else {
                return Ok(None);
            };
            into[j].0 -= 1;
            while first < into.len() && into[first].0 == 0 {
                first += 1;
            }
            plan.push((slot, key, into[j].1));
        }
        let mut buf = vec![0u8; size as usize];
        let mut done = Compaction::default();
        for (slot, key, dst) in plan {
            let to = self
                .blocks
                .get_mut(&dst)
                .and_then(|b| b.take(None, key.1, key.0))
                .ok_or_else(|| {
                    DaemonError::Invalid("compaction chose a destination without room".into())
                })?;
            let dst_address = self.blocks[&dst].address;
            // SAFETY: both blocks' own addresses are mapped and, under the exclusive lock,
            // nobody else accesses them; both slots lie inside their blocks, and the
            // destination slot was free.
            unsafe {
                memory.read(from_address, slot * size, &mut buf);
                memory.write(dst_address, to * size, &buf);
            }
            // The object is in `dst` from now on (so a failure later leaves the books right).
            if let Some(b) = self.blocks.get_mut(&src) {
                b.release(slot);
            }
            self.moved_to(key, dst);
            if self.blocks[&dst].is_full() {
                self.classes[class].open.remove(&dst);
            }
            done.objects_merged += 1;
            done.objects_moved += 1;
        }
        self.free_block(memory, src);
        done.blocks_freed = 1;
        let state = &mut self.classes[class];
        state.compactions += 1;
        state.moved += done.objects_moved;
        Ok(Some(done))
    }
}

#[cfg(test)]
mod tests;
