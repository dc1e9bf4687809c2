//! Memory of small regions packed as objects in size-class blocks (the daemon's object store,
//! CoRM compaction) against the ideal and against one segment per region, measured in one run.
//!
//! ```sh
//! cargo bench -p regions-tests --bench objects
//! ```
//!
//! Creates 100,000 objects of random sizes from 64 B to 4 KiB (each written whole), deletes a
//! random 75%, and prints the memory the block memfd actually holds (allocated pages):
//! - without compaction (frees never compact);
//! - after one compaction of every class;
//! - with the default policy (a free compacts a class more than a fifth free);
//!
//! beside the ideal (the survivors' bytes plus their headers) and the pages the same survivors
//! take as one segment each (today's layout for every region: at least one page per region).
//! Target: after compaction <= 1.15x the ideal. Also prints the time a compaction took and the
//! rates of allocation and freeing. Without `--bench` (as `cargo test --benches` runs it) a
//! version of 5,000 objects runs as a smoke test.

use std::time::Instant;

use anyhow::ensure;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use regions_daemon::objects::{HEADER, ObjectRef, ObjectStore, Owner};

const PAGE: u64 = 4096;

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// An object the bench keeps: its owner, pointer and length.
type Survivor = (Owner, ObjectRef, u32);

/// Creates `n` objects, deletes 75% with `compact_on_free`; returns the store, the survivors
/// and the rates of allocation and freeing.
fn populate(
    n: usize,
    compact_on_free: bool,
    seed: u64,
) -> anyhow::Result<(ObjectStore, Vec<Survivor>, f64, f64)> {
    let store = ObjectStore::new(2 << 30)?;
    store.set_auto_compaction(compact_on_free);
    let mut rng = SmallRng::seed_from_u64(seed);
    let start = Instant::now();
    let mut all = Vec::with_capacity(n);
    for i in 0..n {
        let len = rng.random_range(64..=4096u32);
        let owner = Owner {
            ino: i as u64 + 1,
            generation: 1,
        };
        let p = store.alloc(owner, len)?;
        store.write(owner, p, 0, &vec![(i % 251) as u8; len as usize])?;
        all.push((owner, p, len));
    }
    let alloc_rate = n as f64 / start.elapsed().as_secs_f64();
    all.shuffle(&mut rng);
    let start = Instant::now();
    let gone = n * 3 / 4;
    for (owner, p, _) in all.drain(..gone) {
        store.free(owner, p)?;
    }
    let free_rate = gone as f64 / start.elapsed().as_secs_f64();
    Ok((store, all, alloc_rate, free_rate))
}

/// Every survivor reads back its own bytes (through its old pointer).
fn check(store: &ObjectStore, survivors: &[Survivor]) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 4096];
    for (owner, p, len) in survivors {
        let b = &mut buf[..*len as usize];
        store.read(*owner, *p, 0, b)?;
        let want = ((owner.ino - 1) % 251) as u8;
        ensure!(
            b.iter().all(|x| *x == want),
            "region {} reads wrong bytes",
            owner.ino
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let n = if full { 100_000 } else { 5_000 };
    println!("{n} objects of 64 B - 4 KiB, a random 75% deleted:");

    let (store, survivors, alloc_rate, free_rate) = populate(n, false, 7)?;
    let ideal: u64 = survivors
        .iter()
        .map(|(_, _, l)| u64::from(*l) + HEADER)
        .sum();
    let segments: u64 = survivors
        .iter()
        .map(|(_, _, l)| u64::from(*l).div_ceil(PAGE) * PAGE)
        .sum();
    let without = store.allocated_bytes();
    let start = Instant::now();
    let done = store.compact(None)?;
    let took = start.elapsed();
    let after = store.allocated_bytes();
    check(&store, &survivors)?;
    let stats = store.stats();
    let moved: u64 = stats.iter().map(|c| c.moved_objects).sum();
    let slot_bytes: u64 = stats
        .iter()
        .map(|c| c.objects * u64::from(c.slot_size))
        .sum();
    let block_bytes: u64 = stats.iter().map(|c| c.block_bytes).sum();
    let part_full = stats.iter().filter(|c| c.blocks > 0).count();

    let (auto, auto_survivors, _, auto_free_rate) = populate(n, true, 7)?;
    check(&auto, &auto_survivors)?;
    let with_policy = auto.allocated_bytes();

    println!(
        "  ideal (live bytes + {HEADER} B headers)   {:8.1} MiB",
        mib(ideal)
    );
    println!(
        "  one segment per region (whole pages)      {:8.1} MiB  {:.2}x ideal",
        mib(segments),
        segments as f64 / ideal as f64
    );
    println!(
        "  blocks, no compaction                     {:8.1} MiB  {:.2}x ideal",
        mib(without),
        without as f64 / ideal as f64
    );
    println!(
        "  blocks, after compaction                  {:8.1} MiB  {:.2}x ideal  (target <= 1.15)",
        mib(after),
        after as f64 / ideal as f64
    );
    println!(
        "  blocks, compacting on free (default)      {:8.1} MiB  {:.2}x ideal",
        mib(with_policy),
        with_policy as f64 / ideal as f64
    );
    println!(
        "  compaction: {} blocks merged, {} objects copied, {} moved to another slot \
         ({moved} in all), {:.1} MiB freed, in {:.1} ms",
        done.blocks_freed,
        done.objects_merged,
        done.objects_moved,
        mib(done.bytes_freed),
        took.as_secs_f64() * 1e3
    );
    println!(
        "  after compaction: slots of the survivors {:.1} MiB ({:.2}x ideal: rounding up to a \
         class), blocks {:.1} MiB ({:.2}x the slots), {part_full} classes in use",
        mib(slot_bytes),
        slot_bytes as f64 / ideal as f64,
        mib(block_bytes),
        block_bytes as f64 / slot_bytes as f64
    );
    println!(
        "  rates: alloc + write {alloc_rate:.0}/s, free {free_rate:.0}/s without compaction, \
         {auto_free_rate:.0}/s compacting on free"
    );
    Ok(())
}
