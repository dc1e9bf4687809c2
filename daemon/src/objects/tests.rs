use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::*;

const OWNER: Owner = Owner {
    ino: 42,
    generation: 3,
};

fn owner(i: usize) -> Owner {
    Owner {
        ino: 1000 + i as u64,
        generation: 1,
    }
}

#[test]
fn objects_read_back_what_was_written_and_zeros_elsewhere() {
    let store = ObjectStore::new(4 << 20).unwrap();
    let a = store.alloc(OWNER, 100).unwrap();
    let b = store.alloc(OWNER, 100).unwrap();
    assert_eq!(a.address, b.address, "one block for the class");
    assert_ne!(a.id, b.id);
    assert_eq!(store.write(OWNER, a, 10, b"hello").unwrap(), None);
    let mut buf = [9u8; 20];
    store.read(OWNER, a, 0, &mut buf).unwrap();
    assert_eq!(&buf[..10], &[0; 10]);
    assert_eq!(&buf[10..15], b"hello");
    assert_eq!(&buf[15..], &[0; 5]);
    store.read(OWNER, b, 0, &mut buf).unwrap();
    assert_eq!(buf, [0; 20], "the neighbour is untouched");
    // Writes may reach the end of the slot, not past it.
    let cap = slot_size(class_for(100).unwrap()) - HEADER as u32;
    store.write(OWNER, a, cap - 1, b"x").unwrap();
    let e = store.write(OWNER, a, cap, b"x").unwrap_err();
    assert_eq!(e.errno(), libc::EFBIG);
    let e = store.alloc(OWNER, classes::max_object() + 1).unwrap_err();
    assert_eq!(e.errno(), libc::EFBIG);
    // A read past the slot is a bad request, not a full object.
    let mut big = vec![0u8; cap as usize + 1];
    assert_eq!(
        store.read(OWNER, a, 0, &mut big).unwrap_err().errno(),
        libc::EINVAL
    );
    let stats = store.stats();
    let c = class_for(100).unwrap();
    assert_eq!(stats[c].objects, 2);
    assert_eq!(stats[c].blocks, 1);
    assert_eq!(stats[c].live_bytes, 2 * HEADER + u64::from(cap) + 100);
}

#[test]
fn another_region_and_freed_objects_are_refused() {
    let store = ObjectStore::new(4 << 20).unwrap();
    let a = store.alloc(OWNER, 64).unwrap();
    let other = Owner {
        ino: 42,
        generation: 4,
    };
    let mut buf = [0u8; 8];
    assert_eq!(
        store.read(other, a, 0, &mut buf).unwrap_err().errno(),
        libc::ESTALE
    );
    assert_eq!(
        store.write(owner(1), a, 0, b"x").unwrap_err().errno(),
        libc::ESTALE
    );
    assert_eq!(store.free(other, a).unwrap_err().errno(), libc::ESTALE);
    store.free(OWNER, a).unwrap();
    assert_eq!(
        store.read(OWNER, a, 0, &mut buf).unwrap_err().errno(),
        libc::ESTALE
    );
    // The block was emptied: its memory and address went back.
    assert_eq!(store.addresses_in_use(), 0);
    assert_eq!(store.allocated_bytes(), 0);
    // A new object in the freed slot has another id: the old pointer stays refused.
    let b = store.alloc(OWNER, 64).unwrap();
    let stale = ObjectRef { id: a.id, ..b };
    assert!(b.id != a.id);
    assert!(store.read(OWNER, stale, 0, &mut buf).is_err());
}

/// Objects of one class over several blocks, most of them freed without compaction, then
/// compacted: fewer blocks and less memory, every survivor readable through its old pointer
/// (moved ones reported corrected), and the merged blocks' addresses released once every
/// pointer is corrected.
#[test]
fn compaction_merges_sparse_blocks_and_keeps_every_object() {
    let store = ObjectStore::new(64 << 20).unwrap();
    store.set_auto_compaction(false);
    store.set_correction_grace(std::time::Duration::ZERO);
    let class = class_for(1000).unwrap();
    let per_block = slots_per_block(class) as usize;
    let n = per_block * 10;
    let mut objects: Vec<(Owner, ObjectRef)> = (0..n)
        .map(|i| {
            let o = owner(i);
            let p = store.alloc(o, 1000).unwrap();
            store.write(o, p, 0, &vec![(i % 251) as u8; 1000]).unwrap();
            (o, p)
        })
        .collect();
    assert_eq!(store.stats()[class].blocks, 10);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    objects.shuffle(&mut rng);
    for (o, p) in objects.drain(..n * 3 / 4) {
        store.free(o, p).unwrap();
    }
    let before = store.allocated_bytes();
    let frag = store.stats()[class].fragmentation;
    assert!(frag > 0.7, "fragmentation {frag}");
    let done = store.compact(None).unwrap();
    let stats = &store.stats()[class];
    let ideal = (n / 4).div_ceil(per_block) as u32;
    assert_eq!(stats.blocks, ideal, "{done:?}");
    assert_eq!(done.blocks_freed, 10 - ideal);
    assert_eq!(done.objects_moved, stats.moved_objects);
    assert!(store.allocated_bytes() < before);
    assert_eq!(done.bytes_freed, before - store.allocated_bytes());
    // Every survivor through its old pointer; the moved ones are corrected.
    let mut corrected = 0;
    let mut buf = vec![0u8; 1000];
    for (o, p) in &mut objects {
        let i = (o.ino - 1000) as usize;
        if let Some(fixed) = store.read(*o, *p, 0, &mut buf).unwrap() {
            assert_eq!(fixed.id, p.id);
            corrected += 1;
        }
        assert!(buf.iter().all(|b| *b == (i % 251) as u8), "object {i}");
        *p = store.correct(*o, *p).unwrap();
        assert_eq!(store.read(*o, *p, 0, &mut buf).unwrap(), None, "direct now");
    }
    assert!(corrected > 0 && corrected as u64 <= done.objects_moved);
    assert_eq!(
        store.addresses_in_use(),
        ideal as usize,
        "every merged block's address is released once no pointer names it"
    );
    // Writes through corrected pointers land; freeing everything frees everything.
    for (o, p) in &objects {
        store.write(*o, *p, 0, b"after").unwrap();
    }
    for (o, p) in objects {
        store.free(o, p).unwrap();
    }
    assert_eq!(store.allocated_bytes(), 0);
    assert_eq!(store.addresses_in_use(), 0);
}

/// Readers and writers of many objects while others are freed and allocated and blocks are
/// compacted: a read never returns a torn mix or another object's bytes, and no write is lost.
#[test]
fn reads_and_writes_during_compaction_are_consistent() {
    let store = Arc::new(ObjectStore::new(64 << 20).unwrap());
    let class_len = 500u32;
    // Kept objects between fillers, which are then freed: the kept objects' blocks are sparse,
    // so they are merged (and some kept objects moved) while the workers use them.
    let mut keep = Vec::new();
    let mut fillers = Vec::new();
    for i in 0..1600 {
        let o = owner(i);
        let p = store.alloc(o, class_len).unwrap();
        if i % 4 == 0 {
            keep.push((o, p));
        } else {
            fillers.push((o, p));
        }
    }
    store.set_auto_compaction(false);
    for (o, p) in fillers {
        store.free(o, p).unwrap();
    }
    store.set_auto_compaction(true);
    let stop = Arc::new(AtomicBool::new(false));
    // Churn rounds and worker operations so far (the wait below needs enough of both).
    let progress = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    // Churn: allocate and free around the kept objects so their blocks get merged.
    let churn = {
        let (store, stop, progress) =
            (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&progress));
        std::thread::spawn(move || {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
            let mut live: Vec<(Owner, ObjectRef)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for k in 0..200 {
                    let o = owner(100_000 + k);
                    live.push((o, store.alloc(o, class_len).unwrap()));
                }
                live.shuffle(&mut rng);
                // Now and then everything goes, so that blocks keep turning sparse (and get
                // merged) for as long as the workers run, not only in the first rounds.
                let round = progress.0.load(Ordering::Relaxed);
                let freed = if round % 8 == 7 { live.len() } else { 190 };
                for (o, p) in live.drain(..freed) {
                    store.free(o, p).unwrap();
                }
                store.compact(None).unwrap();
                progress.0.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let workers: Vec<_> = keep
        .chunks(100)
        .map(|mine| {
            let mine = mine.to_vec();
            let (store, stop, progress) =
                (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&progress));
            std::thread::spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(mine[0].0.ino);
                let mut last = vec![0u8; mine.len()];
                let mut buf = vec![0u8; class_len as usize];
                while !stop.load(Ordering::Relaxed) {
                    let k = rng.random_range(0..mine.len());
                    let (o, p) = mine[k];
                    if rng.random_bool(0.5) {
                        let v = last[k].wrapping_add(1).max(1);
                        store.write(o, p, 0, &vec![v; class_len as usize]).unwrap();
                        last[k] = v;
                    } else {
                        store.read(o, p, 0, &mut buf).unwrap();
                        assert!(
                            buf.iter().all(|b| *b == last[k]),
                            "object of region {} read torn or stale bytes",
                            o.ino
                        );
                    }
                    progress.1.fetch_add(1, Ordering::Relaxed);
                }
                (mine, last)
            })
        })
        .collect();
    let class = class_for(class_len).unwrap();
    // The workers are under way (bounded wait) before merges are counted.
    let begun = std::time::Instant::now();
    while progress.1.load(Ordering::Relaxed) < 100 && begun.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let early = store.stats()[class].compactions;
    // Workers run until blocks were merged under them, over enough churn rounds and worker
    // operations, and at least 1.3 s (bounded: a loaded machine may starve threads a while).
    let started = std::time::Instant::now();
    let mut late = early;
    let enough = |late: u64| {
        late > early
            && progress.0.load(Ordering::Relaxed) > 3
            && progress.1.load(Ordering::Relaxed) > 1000
            && started.elapsed() >= std::time::Duration::from_millis(1300)
    };
    while started.elapsed() < std::time::Duration::from_secs(30) && !enough(late) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        late = store.stats()[class].compactions;
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    let mut buf = vec![0u8; class_len as usize];
    for w in workers {
        let (mine, last) = w.join().unwrap();
        for ((o, p), v) in mine.iter().zip(last) {
            store.read(*o, *p, 0, &mut buf).unwrap();
            assert!(
                buf.iter().all(|b| *b == v),
                "a write to region {} was lost",
                o.ino
            );
        }
    }
    let (rounds, total) = (
        progress.0.load(Ordering::Relaxed),
        progress.1.load(Ordering::Relaxed),
    );
    let stats = &store.stats()[class];
    assert!(rounds > 3 && total > 1000, "rounds {rounds}, ops {total}");
    assert!(stats.moved_objects > 0, "{stats:?}");
    assert!(
        late > early,
        "blocks were merged while the workers ran ({early} then {late})"
    );
}

/// Two writers of one object never interleave: every read sees one writer's bytes whole.
#[test]
fn concurrent_writers_of_one_object_do_not_tear_it() {
    let store = Arc::new(ObjectStore::new(4 << 20).unwrap());
    let len = classes::max_object() as usize;
    let p = store.alloc(OWNER, len as u32).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = [1u8, 2u8]
        .into_iter()
        .map(|v| {
            let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
            std::thread::spawn(move || {
                // Every write changes every byte: a read that overlaps one sees a mix.
                let bytes = [vec![v; len], vec![v + 10; len]];
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    store.write(OWNER, p, 0, &bytes[k % 2]).unwrap();
                    k += 1;
                }
            })
        })
        .collect();
    let mut buf = vec![0u8; len];
    let start = std::time::Instant::now();
    let mut torn = 0;
    while start.elapsed() < std::time::Duration::from_millis(700) {
        store.read(OWNER, p, 0, &mut buf).unwrap();
        if !buf.iter().all(|b| *b == buf[0]) {
            torn += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    assert_eq!(torn, 0, "torn reads");
    for w in writers {
        w.join().unwrap();
    }
}

/// A full store compacts before it refuses, and then refuses with ENOSPC.
#[test]
fn a_full_store_compacts_then_refuses() {
    let store = ObjectStore::new(2 * BLOCK_SIZE).unwrap();
    store.set_auto_compaction(false);
    let class = class_for(8000).unwrap();
    let per = slots_per_block(class) as usize;
    let all: Vec<_> = (0..2 * per)
        .map(|i| store.alloc(owner(i), 8000).unwrap())
        .collect();
    assert_eq!(
        store.alloc(owner(99), 8000).unwrap_err().errno(),
        libc::ENOSPC
    );
    // Half of each block freed: the next allocation of another class merges them.
    for (i, p) in all.iter().enumerate() {
        if i % 2 == 0 {
            store.free(owner(i), *p).unwrap();
        }
    }
    store.alloc(owner(100), 10).unwrap();
    assert_eq!(store.stats()[class].blocks, 1);
    let mut buf = [0u8; 4];
    for (i, p) in all.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        store.read(owner(i), *p, 0, &mut buf).unwrap();
    }
}

/// Pointers through a merged block's address: freeing through it, correcting it twice, and
/// freeing through the old pointer after a correction all keep the books right, and the
/// address is released once no object's pointer names it.
#[test]
fn pointers_through_merged_addresses_stay_counted() {
    let store = ObjectStore::new(16 << 20).unwrap();
    store.set_auto_compaction(false);
    store.set_correction_grace(std::time::Duration::ZERO);
    let class = class_for(4000).unwrap();
    let per = slots_per_block(class) as usize;
    // Two blocks, each left with two objects: mergeable.
    let all: Vec<_> = (0..2 * per)
        .map(|i| (owner(i), store.alloc(owner(i), 4000).unwrap()))
        .collect();
    for (i, (o, p)) in all.iter().enumerate() {
        if i % per >= 2 {
            store.free(*o, *p).unwrap();
        }
    }
    let kept: Vec<_> = all
        .iter()
        .enumerate()
        .filter(|(i, _)| i % per < 2)
        .map(|(_, x)| *x)
        .collect();
    assert_eq!(store.compact(Some(class)).unwrap().blocks_freed, 1);
    assert_eq!(
        store.addresses_in_use(),
        2,
        "the merged block's address is still named"
    );
    // The merged block's two objects are adjacent in `kept`: the first is corrected twice
    // while the second still names the merged address, the second is freed through it.
    let mut fixed = Vec::new();
    let mut alias = None;
    let mut freed_through_alias = false;
    for (o, p) in kept {
        if alias == Some(p.address) {
            store.free(o, p).unwrap();
            freed_through_alias = true;
            continue;
        }
        let f = store.correct(o, p).unwrap();
        if f.address != p.address && alias.is_none() {
            assert_eq!(
                store.correct(o, f).unwrap(),
                f,
                "a second correction changes nothing"
            );
            assert_eq!(
                store.addresses_in_use(),
                2,
                "the other object still names it"
            );
            alias = Some(p.address);
        }
        fixed.push((o, f));
    }
    assert!(freed_through_alias);
    assert_eq!(
        store.addresses_in_use(),
        1,
        "no pointer names the merged address now"
    );
    let mut buf = [0u8; 8];
    for (o, p) in &fixed {
        assert_eq!(store.read(*o, *p, 0, &mut buf).unwrap(), None);
    }
    for (o, p) in fixed {
        store.free(o, p).unwrap();
    }
    assert_eq!(store.addresses_in_use(), 0);
    assert_eq!(store.allocated_bytes(), 0);
}

/// A class of a thousand blocks a quarter full packs into about a quarter as many, and every
/// survivor reads back through its old pointer (the sorted list of blocks with room is kept
/// in order across merges).
#[test]
fn a_large_class_compacts_fully() {
    let store = ObjectStore::new(64 << 20).unwrap();
    store.set_auto_compaction(false);
    let len = 4000u32;
    let class = class_for(len).unwrap();
    let per = slots_per_block(class) as usize;
    let n = per * 1000;
    let mut kept = Vec::new();
    for i in 0..n {
        let o = owner(i);
        let p = store.alloc(o, len).unwrap();
        if i % 4 == 1 {
            store.write(o, p, 0, &(i as u64).to_le_bytes()).unwrap();
            kept.push((o, p, i as u64));
        } else {
            kept.push((o, p, u64::MAX));
        }
    }
    for (o, p, v) in &kept {
        if *v == u64::MAX {
            store.free(*o, *p).unwrap();
        }
    }
    kept.retain(|(_, _, v)| *v != u64::MAX);
    let done = store.compact(Some(class)).unwrap();
    let blocks = store.stats()[class].blocks as usize;
    assert!(
        blocks <= kept.len().div_ceil(per) + 5,
        "{blocks} blocks for {} objects of {per} a block ({done:?})",
        kept.len()
    );
    let mut buf = [0u8; 8];
    for (o, p, v) in kept {
        store.read(o, p, 0, &mut buf).unwrap();
        assert_eq!(u64::from_le_bytes(buf), v);
    }
}

/// Blocks three quarters full cannot merge (no two fit in one), so compaction empties the
/// sparsest into the free slots of several others: the class ends with as many blocks as its
/// objects need, every object reads back through the pointer it had, the manager's view of
/// the moved ones (`indirect`) lists exactly them, and correcting them makes them direct.
#[test]
fn blocks_more_than_half_full_are_emptied_into_several() {
    let store = ObjectStore::new(16 << 20).unwrap();
    store.set_auto_compaction(false);
    store.set_correction_grace(std::time::Duration::ZERO);
    // Slots of about 1 KiB: a freed one leaves its pages in use by its neighbours.
    let len = 1000;
    let class = class_for(len).unwrap();
    let per = slots_per_block(class) as usize;
    let blocks = 4;
    let mut all: Vec<(Owner, ObjectRef, u8)> = (0..per * blocks)
        .map(|i| {
            let o = owner(i);
            let p = store.alloc(o, len).unwrap();
            store.write(o, p, 0, &vec![i as u8; len as usize]).unwrap();
            (o, p, i as u8)
        })
        .collect();
    // Every fourth object freed: each block is three quarters full.
    let mut kept = Vec::new();
    for (i, x) in all.drain(..).enumerate() {
        if i % 4 == 0 {
            store.free(x.0, x.1).unwrap();
        } else {
            kept.push(x);
        }
    }
    assert_eq!(store.stats()[class].blocks, blocks as u32);
    let before = store.allocated_bytes();
    let done = store.compact(Some(class)).unwrap();
    let need = kept.len().div_ceil(per);
    let stats = store.stats()[class].clone();
    assert_eq!(stats.blocks as usize, need, "{done:?}");
    assert_eq!(done.blocks_freed as usize, blocks - need);
    assert!(store.allocated_bytes() < before);
    // The emptied block's objects are indirect: listed for the manager, with their owners.
    let indirect = store.indirect(usize::MAX);
    assert_eq!(indirect.len() as u64, stats.indirect);
    assert!(indirect.len() as u64 <= done.objects_moved, "{done:?}");
    assert!(!indirect.is_empty());
    for x in &indirect {
        let (o, p, _) = kept.iter().find(|k| k.1.id == x.old.id).unwrap();
        assert_eq!(*o, x.owner);
        assert_eq!(p.address, x.old.address);
        assert_ne!(x.new.address, x.old.address);
        // The pointer at its own block reaches it before the correction (the manager records
        // the new pointer first): its reply names that address.
        let mut b = [0u8; 1];
        let now = store.read(x.owner, x.new, 0, &mut b).unwrap();
        assert!(now.is_none_or(|n| n.address == x.new.address));
    }
    // Correcting through the new pointer works as through the old.
    let first = indirect[0];
    assert_eq!(store.correct(first.owner, first.new).unwrap(), first.new);
    let (_, p, _) = kept.iter_mut().find(|k| k.1.id == first.old.id).unwrap();
    *p = first.new;
    let mut buf = vec![0u8; len as usize];
    for (o, p, v) in &mut kept {
        store.read(*o, *p, 0, &mut buf).unwrap();
        assert!(buf.iter().all(|b| b == v), "object {v} after emptying");
        // Writes through the old pointer land in the moved object.
        store.write(*o, *p, 0, &[*v ^ 0xff]).unwrap();
        *p = store.correct(*o, *p).unwrap();
        assert_eq!(store.read(*o, *p, 0, &mut buf).unwrap(), None, "direct now");
        assert_eq!(buf[0], *v ^ 0xff);
        assert!(buf[1..].iter().all(|b| b == v));
    }
    assert!(store.indirect(usize::MAX).is_empty());
    assert_eq!(store.stats()[class].indirect, 0);
    assert_eq!(
        store.addresses_in_use(),
        need,
        "the emptied block's address is released once corrected"
    );
    for (o, p, _) in kept {
        store.free(o, p).unwrap();
    }
    assert_eq!(store.allocated_bytes(), 0);
}

/// A corrected pointer keeps reaching its object for the grace period, so requests under way
/// with it finish; after it, the old pointer is refused as stale and its address reused.
/// Objects an earlier manager allocated stay listed as inherited (under the pointer they are
/// reached by) through compaction and pointer correction, until the new manager keeps or
/// frees them; freeing them all gives every block back.
#[test]
fn inherited_objects_are_listed_until_settled_through_compaction() {
    let store = ObjectStore::new(16 << 20).unwrap();
    store.set_auto_compaction(false);
    let class = class_for(4000).unwrap();
    let per = slots_per_block(class) as usize;
    store.serve_manager(1);
    let all: Vec<_> = (0..4 * per)
        .map(|i| (owner(i), store.alloc(owner(i), 4000).unwrap()))
        .collect();
    for (i, (o, p)) in all.iter().enumerate() {
        if i % per < per / 4 {
            store.free(*o, *p).unwrap();
        }
    }
    let live = all.len() - 4 * (per / 4);
    store.compact(Some(class)).unwrap();
    let moved = store.indirect(usize::MAX);
    assert!(!moved.is_empty());
    // Manager 2 takes over; one moved object is corrected (its key changes) first.
    assert!(store.inherited(2, usize::MAX).len() == live);
    let x = moved[0];
    let fresh = store.correct(x.owner, x.old).unwrap();
    let mine = store.alloc(owner(9999), 100).unwrap();
    let listed = store.inherited(2, usize::MAX);
    assert_eq!(
        listed.len(),
        live,
        "the new manager's own object is not listed"
    );
    let corrected = listed
        .iter()
        .find(|h| h.object.owner == x.owner)
        .expect("the corrected object is still listed");
    assert_eq!(corrected.object.old, fresh, "under its corrected pointer");
    assert!(listed.iter().all(|h| !h.frozen));
    // Paged: a few at a time, each page starting where the last ended, cover them all.
    let mut seen = HashSet::new();
    for _ in 0..live.div_ceil(7) + 1 {
        seen.extend(store.inherited(2, 7).iter().map(|h| h.object.old));
    }
    assert_eq!(seen.len(), live);
    for h in &listed {
        assert!(
            store
                .settle(2, h.object.owner, h.object.old, Settle::Free)
                .unwrap()
        );
    }
    assert!(store.inherited(2, usize::MAX).is_empty());
    assert!(
        !store.settle(2, owner(9999), mine, Settle::Free).unwrap(),
        "not inherited: left alone"
    );
    store.free(owner(9999), mine).unwrap();
    store.compact(None).unwrap();
    assert_eq!(store.allocated_bytes(), 0);
}

#[test]
fn a_corrected_pointer_works_until_its_grace_ends() {
    let store = ObjectStore::new(16 << 20).unwrap();
    store.set_auto_compaction(false);
    store.set_correction_grace(std::time::Duration::from_millis(300));
    let class = class_for(4000).unwrap();
    let per = slots_per_block(class) as usize;
    let all: Vec<_> = (0..4 * per)
        .map(|i| (owner(i), store.alloc(owner(i), 4000).unwrap()))
        .collect();
    let mut kept = Vec::new();
    for (i, (o, p)) in all.into_iter().enumerate() {
        if i % per < per / 4 {
            store.free(o, p).unwrap();
        } else {
            kept.push((o, p));
        }
    }
    store.compact(Some(class)).unwrap();
    let moved = store.indirect(usize::MAX);
    assert!(!moved.is_empty());
    let x = moved[0];
    let new = store.correct(x.owner, x.old).unwrap();
    assert_eq!(new, x.new);
    assert_eq!(
        store.correct(x.owner, x.old).unwrap(),
        new,
        "again: the same"
    );
    store.write(x.owner, x.old, 0, b"old").unwrap();
    let mut buf = [0u8; 3];
    // The old pointer's reply names the new one.
    assert_eq!(store.read(x.owner, x.old, 0, &mut buf).unwrap(), Some(new));
    assert_eq!(&buf, b"old");
    std::thread::sleep(std::time::Duration::from_millis(350));
    store.compact(None).unwrap();
    let e = store.read(x.owner, x.old, 0, &mut buf).unwrap_err();
    assert_eq!(e.errno(), libc::ESTALE);
    assert_eq!(store.read(x.owner, new, 0, &mut buf).unwrap(), None);
    assert_eq!(&buf, b"old");
    // Freeing through the new pointer frees it; the rest are freed through their old ones.
    store.free(x.owner, new).unwrap();
    for (o, p) in kept {
        if p.id != x.old.id {
            store.free(o, p).unwrap();
        }
    }
    assert_eq!(store.allocated_bytes(), 0);
    assert_eq!(store.addresses_in_use(), 0);
}

/// One step of [`the_store_matches_a_model`].
#[derive(Clone, Debug)]
enum Step {
    Alloc { len: u32 },
    Write { pick: usize, offset: u32, len: u32 },
    Refit { pick: usize },
    Free { pick: usize },
    Compact,
    Correct,
}

fn arb_step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        // Two narrow ranges of sizes, so that classes fill several blocks in a short run.
        4 => prop_oneof![900u32..940, 3000u32..3040].prop_map(|len| Step::Alloc { len }),
        3 => (any::<usize>(), 0u32..2000, 1u32..300)
            .prop_map(|(pick, offset, len)| Step::Write { pick, offset, len }),
        1 => any::<usize>().prop_map(|pick| Step::Refit { pick }),
        3 => any::<usize>().prop_map(|pick| Step::Free { pick }),
        1 => Just(Step::Compact),
        1 => Just(Step::Correct),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Random allocations, writes (growing an object's bytes in use), refits to a smaller
    /// class, frees, compactions (auto on as well) and corrections against a model of every
    /// object's bytes: every live object reads back exactly its bytes (so no two overlap),
    /// a compacted class holds no more blocks than its objects need plus one for an id clash
    /// and no more memory than its objects' slots and a page a block, and freeing everything
    /// gives every page and address back.
    #[test]
    fn the_store_matches_a_model(steps in proptest::collection::vec(arb_step(), 1..400)) {
        let store = ObjectStore::new(8 << 20).unwrap();
        store.set_correction_grace(std::time::Duration::ZERO);
        // (owner, pointer, bytes as written, capacity)
        let mut live: Vec<(Owner, ObjectRef, Vec<u8>, u32)> = Vec::new();
        let mut next = 0usize;
        let mut fill = 1u8;
        for step in steps {
            match step {
                Step::Alloc { len } => {
                    let o = owner(next);
                    next += 1;
                    let (p, capacity) = store.alloc_with_capacity(o, len).unwrap();
                    live.push((o, p, vec![0; len as usize], capacity));
                }
                Step::Write { pick, offset, len } if !live.is_empty() => {
                    let n = live.len();
                    let (o, p, bytes, capacity) = &mut live[pick % n];
                    let offset = offset % *capacity;
                    let len = len.min(*capacity - offset);
                    fill = fill.wrapping_add(1).max(1);
                    let data = vec![fill; len as usize];
                    if let Some(now) = store.write(*o, *p, offset, &data).unwrap() {
                        *p = now;
                    }
                    let end = (offset + len) as usize;
                    if bytes.len() < end {
                        bytes.resize(end, 0);
                    }
                    bytes[offset as usize..end].copy_from_slice(&data);
                }
                Step::Refit { pick } if !live.is_empty() => {
                    let i = pick % live.len();
                    let (o, p, bytes, _) = live[i].clone();
                    let len = (bytes.len() as u32).max(1);
                    let (new, capacity) = store.refit(o, p, len).unwrap();
                    proptest::prop_assert!(capacity >= len);
                    store.free(o, p).unwrap();
                    live[i] = (o, new, bytes, capacity);
                }
                Step::Free { pick } if !live.is_empty() => {
                    let (o, p, _, _) = live.swap_remove(pick % live.len());
                    store.free(o, p).unwrap();
                }
                Step::Compact => {
                    store.compact(None).unwrap();
                    // Packed: each block holds its objects' slots and at most a page more.
                    let bound: u64 = store
                        .stats()
                        .iter()
                        .map(|s| s.objects * u64::from(s.slot_size) + u64::from(s.blocks) * 4096)
                        .sum();
                    proptest::prop_assert!(
                        store.allocated_bytes() <= bound,
                        "{} bytes held, at most {bound} expected", store.allocated_bytes()
                    );
                    for (c, s) in store.stats().iter().enumerate() {
                        let need = s.objects.div_ceil(u64::from(slots_per_block(c)));
                        proptest::prop_assert!(
                            u64::from(s.blocks) <= need + 1,
                            "class {c}: {} blocks for {} objects", s.blocks, s.objects
                        );
                    }
                }
                Step::Correct => {
                    for x in store.indirect(usize::MAX) {
                        let fixed = store.correct(x.owner, x.old).unwrap();
                        if let Some(l) = live.iter_mut().find(|l| l.0 == x.owner) {
                            l.1 = fixed;
                        }
                    }
                }
                _ => {}
            }
            for (o, p, bytes, capacity) in &live {
                let mut buf = vec![0xeeu8; *capacity as usize];
                store.read(*o, *p, 0, &mut buf).unwrap();
                proptest::prop_assert_eq!(&buf[..bytes.len()], &bytes[..]);
                proptest::prop_assert!(buf[bytes.len()..].iter().all(|b| *b == 0));
            }
        }
        for (o, p, _, _) in live {
            store.free(o, p).unwrap();
        }
        proptest::prop_assert_eq!(store.allocated_bytes(), 0);
        proptest::prop_assert_eq!(store.addresses_in_use(), 0);
        proptest::prop_assert!(store.indirect(usize::MAX).is_empty());
    }
}
