//! rmalloc on an untrusted heap: every pointer, index and count read from the
//! heap is checked before use, so a corrupted or hostile heap gives `EINVAL`
//! (or looks full), never a write outside the heap, a panic or a hang.
//!
//! `corrupted_heaps` is a property test: it builds a heap between two guard
//! areas of canary bytes, populates its lists, thread-cache records (one of a
//! dead thread) and page map, writes random bytes at offsets picked from the
//! layout (header fields, list heads, records, page-map entries, slab and
//! free-run headers, slab blocks) and anywhere, then runs random operations on
//! a thread with a deadline. `RMALLOC_FUZZ_CASES` sets the number of cases
//! (default 256), e.g. for a long run:
//!
//! ```sh
//! RMALLOC_FUZZ_CASES=100000 cargo test --release -p regions --lib rmalloc::untrusted_tests
//! ```

use std::mem::offset_of;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::lock::{current_tid, set_lock_timeout_for_tests};
use super::test_mem::Mem;
use super::thread_cache::CacheRec;
use super::*;

const GUARD: usize = 2 * PAGE;
const HEAP_LEN: usize = 64 * PAGE;
const CANARY: u8 = 0xa5;
/// How long one case (setup, corruption, operations, thread exit) may take.
const DEADLINE: Duration = Duration::from_secs(30);

/// Heap memory between two guard areas of canary bytes.
struct Guarded {
    mem: Mem,
}

impl Guarded {
    fn new() -> Guarded {
        let mem = Mem::new(2 * GUARD + HEAP_LEN);
        // SAFETY: the guard areas are ours.
        unsafe {
            mem.ptr.write_bytes(CANARY, GUARD);
            mem.ptr.add(GUARD + HEAP_LEN).write_bytes(CANARY, GUARD);
        }
        Guarded { mem }
    }

    fn base(&self) -> *mut u8 {
        // SAFETY: inside the mapping.
        unsafe { self.mem.ptr.add(GUARD) }
    }

    fn heap(&self) -> Heap {
        // SAFETY: the memory stays mapped while self lives.
        unsafe { Heap::attach(self.base(), HEAP_LEN) }.unwrap()
    }

    /// Err naming the first guard byte that changed.
    fn canaries(&self) -> Result<(), String> {
        for (start, what) in [(0, "before"), (GUARD + HEAP_LEN, "after")] {
            // SAFETY: the guard areas are mapped.
            let g = unsafe { std::slice::from_raw_parts(self.mem.ptr.add(start), GUARD) };
            if let Some(i) = g.iter().position(|&b| b != CANARY) {
                return Err(format!("a write {} bytes {what} the heap", GUARD - i));
            }
        }
        Ok(())
    }

    fn read_u64(&self, off: usize) -> u64 {
        // SAFETY: callers pass offsets inside the heap.
        unsafe { (self.base().add(off) as *const u64).read_unaligned() }
    }

    fn read_u32(&self, off: usize) -> u32 {
        // SAFETY: as above.
        unsafe { (self.base().add(off) as *const u32).read_unaligned() }
    }

    fn write(&self, off: usize, bytes: &[u8]) {
        let off = off.min(HEAP_LEN - bytes.len());
        // SAFETY: clamped inside the heap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base().add(off), bytes.len()) };
    }
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    /// Frees the block at this index of the live ones.
    Free(usize),
    /// Frees an arbitrary offset.
    FreeRaw(u64),
    BlockSize(usize),
    Stats,
    SetRoot(usize),
    Root,
    Flush,
    Extend,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1usize..2100).prop_map(Op::Alloc),
        1 => (2100usize..20_000).prop_map(Op::Alloc),
        5 => any::<usize>().prop_map(Op::Free),
        1 => (0..HEAP_LEN as u64 + PAGE as u64).prop_map(Op::FreeRaw),
        1 => any::<usize>().prop_map(Op::BlockSize),
        1 => Just(Op::Stats),
        1 => any::<usize>().prop_map(Op::SetRoot),
        1 => Just(Op::Root),
        1 => Just(Op::Flush),
        1 => Just(Op::Extend),
    ]
}

/// Where a corruption goes; the numbers pick among the candidates.
#[derive(Debug, Clone)]
enum Target {
    /// Any byte of the header.
    Header(usize),
    BinHead(usize),
    PartialHead(usize),
    /// A byte of a thread-cache record (record, byte).
    Record(usize, usize),
    /// A count of a record (record, class).
    RecordCount(usize, usize),
    /// A page-map entry.
    MapEntry(usize),
    /// A byte of a slab header (slab, byte).
    SlabHeader(usize, usize),
    /// A byte of a free run's header (run, byte).
    RunHeader(usize, usize),
    /// A byte of a slab's blocks or states (slab, byte).
    SlabBody(usize, usize),
    Anywhere(usize),
}

#[derive(Debug, Clone)]
enum Value {
    Bytes(Vec<u8>),
    /// A little-endian word of 1, 2, 4 or 8 bytes.
    Word(u64, usize),
    /// A plausible offset: inside or just past the heap, often aligned.
    Offset(u64, u64),
    /// A page-map entry of kind and value.
    Entry(u32, u32),
}

fn target_strategy() -> impl Strategy<Value = Target> {
    let n = any::<usize>();
    prop_oneof![
        2 => (0..std::mem::size_of::<Header>()).prop_map(Target::Header),
        2 => (0..NBINS).prop_map(Target::BinHead),
        2 => (0..NCLASSES).prop_map(Target::PartialHead),
        2 => (n, 0..std::mem::size_of::<CacheRec>()).prop_map(|(r, b)| Target::Record(r, b)),
        2 => (n, 0..NCLASSES).prop_map(|(r, c)| Target::RecordCount(r, c)),
        3 => n.prop_map(Target::MapEntry),
        2 => (n, 0..SLAB_HDR).prop_map(|(s, b)| Target::SlabHeader(s, b)),
        2 => (n, 0..32usize).prop_map(|(r, b)| Target::RunHeader(r, b)),
        2 => (n, n).prop_map(|(s, b)| Target::SlabBody(s, b)),
        2 => (0..HEAP_LEN).prop_map(Target::Anywhere),
    ]
}

fn value_strategy() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 1..9).prop_map(Value::Bytes),
        2 => (any::<u64>(), prop_oneof![Just(1usize), Just(2), Just(4), Just(8)])
            .prop_map(|(w, n)| Value::Word(w, n)),
        2 => (0..300u64).prop_map(|w| Value::Word(w, 1)),
        3 => (0..2 * HEAP_LEN as u64, 0..4u64).prop_map(|(o, a)| Value::Offset(o, a)),
        2 => (0..16u32, 0..1024u32).prop_map(|(k, v)| Value::Entry(k, v)),
    ]
}

/// What the setup left in the heap, for picking corruption targets.
struct Layout {
    map_off: usize,
    records: Vec<usize>,
    slabs: Vec<usize>,
    runs: Vec<usize>,
}

fn layout(g: &Guarded, h: &Heap) -> Layout {
    let map_off = g.read_u64(offset_of!(Header, map_off)) as usize;
    let records = h
        .records()
        .unwrap_or_default()
        .into_iter()
        .map(|o| o as usize)
        .collect();
    let (mut slabs, mut runs) = (Vec::new(), Vec::new());
    for p in 0..HEAP_LEN / PAGE {
        let e = g.read_u32(map_off + 4 * p);
        match kind(e) {
            K_SLAB if value(e) & 0xff == 0 => slabs.push(p * PAGE),
            K_FREE if g.read_u64(p * PAGE) == RUN_MAGIC => runs.push(p * PAGE),
            _ => {}
        }
    }
    Layout {
        map_off,
        records,
        slabs,
        runs,
    }
}

fn pick(v: &[usize], i: usize) -> Option<usize> {
    (!v.is_empty()).then(|| v[i % v.len()])
}

/// Writes `value` at the offset `target` picks.
fn poke(g: &Guarded, l: &Layout, target: &Target, value: &Value) {
    let off = match *target {
        Target::Header(b) => Some(b),
        Target::BinHead(b) => Some(offset_of!(Header, bins) + 8 * b),
        Target::PartialHead(c) => Some(offset_of!(Header, partial) + 8 * c),
        Target::Record(r, b) => pick(&l.records, r).map(|o| o + b),
        Target::RecordCount(r, c) => {
            pick(&l.records, r).map(|o| o + offset_of!(CacheRec, count) + c)
        }
        Target::MapEntry(p) => Some(l.map_off + 4 * (p % (HEAP_LEN / PAGE))),
        Target::SlabHeader(s, b) => pick(&l.slabs, s).map(|o| o + b),
        Target::RunHeader(r, b) => pick(&l.runs, r).map(|o| o + b),
        Target::SlabBody(s, b) => pick(&l.slabs, s).map(|o| o + SLAB_HDR + b % (PAGE - SLAB_HDR)),
        Target::Anywhere(o) => Some(o),
    };
    let Some(off) = off else { return };
    match value {
        Value::Bytes(b) => g.write(off, b),
        Value::Word(w, n) => g.write(off, &w.to_le_bytes()[..*n]),
        Value::Offset(o, a) => {
            let o = match a {
                0 => o & !(PAGE as u64 - 1),
                1 => o & !(ALIGN as u64 - 1),
                _ => *o,
            };
            g.write(off, &o.to_le_bytes())
        }
        Value::Entry(k, v) => g.write(off, &((k << 28) | v).to_le_bytes()),
    }
}

/// Allocations and frees that fill the lists, the thread caches and the
/// page map; returns the live blocks.
fn populate(h: &Heap, sizes: &[usize]) -> Vec<(u64, usize)> {
    let mut live = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        if let Ok(off) = h.alloc(size) {
            live.push((off, size));
        }
        if i % 3 == 2 && !live.is_empty() {
            let (off, _) = live.swap_remove((i * 7) % live.len());
            h.free(off).unwrap();
        }
    }
    live
}

/// Runs `op`; Err says what went wrong (a panic, an error that is not
/// `EINVAL`, a block outside the heap).
fn run_op(g: &Guarded, h: &Heap, live: &mut Vec<(u64, usize)>, op: &Op) -> Result<(), String> {
    let check = |r: HResult<()>| match r {
        Ok(()) | Err(HeapError::Full { .. }) => Ok(()),
        Err(e) if e.errno() == libc::EINVAL => Ok(()),
        Err(e) => Err(format!("{op:?}: error {e:?} is not EINVAL")),
    };
    let n = live.len();
    let pick = |i: usize| (n > 0).then(|| i % n);
    match *op {
        Op::Alloc(size) => match h.alloc(size) {
            Ok(off) => {
                if off as usize + size > HEAP_LEN {
                    return Err(format!(
                        "alloc({size}) returned {off:#x}, a block outside the heap"
                    ));
                }
                // The application writes its block.
                g.write(off as usize, &vec![0x5a; size]);
                live.push((off, size));
                Ok(())
            }
            Err(e) => check(Err(e)),
        },
        Op::Free(i) => match pick(i) {
            Some(i) => check(h.free(live.swap_remove(i).0)),
            None => Ok(()),
        },
        Op::FreeRaw(off) => check(h.free(off)),
        Op::BlockSize(i) => match pick(i) {
            Some(i) => check(h.block_size(live[i].0).map(drop)),
            None => Ok(()),
        },
        Op::Stats => check(h.stats().map(drop)),
        Op::SetRoot(i) => check(h.set_root(pick(i).map(|i| live[i].0))),
        Op::Root => check(h.root().map(drop)),
        Op::Flush => check(h.flush_cache()),
        Op::Extend => check(h.extend(HEAP_LEN)),
    }
}

/// One case on its own threads; Err says what failed.
fn run_case(
    setup: Vec<usize>,
    helper_setup: Vec<usize>,
    corruptions: Vec<(Target, Value)>,
    ops: Vec<Op>,
) -> Result<(), String> {
    let g = Arc::new(Guarded::new());
    let g2 = Arc::clone(&g);
    let worker = std::thread::spawn(move || -> Result<(), String> {
        let g = g2;
        // A corrupt lock word held by a live thread fails fast here.
        set_lock_timeout_for_tests(Duration::from_millis(200));
        let h = g.heap();
        let mut live = populate(&h, &setup);
        // A helper leaves its record in the heap as a dead thread's: the
        // memory is announced as unmapped while it runs, so it exits
        // without flushing (this thread forgets its record too, and opens
        // a new one, taking dead ones over, after the corruption).
        let (ready_tx, ready_rx) = mpsc::channel();
        let (exit_tx, exit_rx) = mpsc::channel::<()>();
        let helper = std::thread::spawn(move || {
            let h = h;
            let live = populate(&h, &helper_setup);
            ready_tx.send(live).unwrap();
            let _ = exit_rx.recv();
        });
        live.extend(ready_rx.recv().map_err(|e| e.to_string())?);
        let (base, len) = (g.base() as usize, HEAP_LEN);
        std::thread::spawn(move || unmapping(base as *mut u8, len))
            .join()
            .unwrap();
        exit_tx.send(()).unwrap();
        helper.join().unwrap();
        g.canaries()?;
        let l = layout(&g, &h);
        for (t, v) in &corruptions {
            poke(&g, &l, t, v);
        }
        for op in &ops {
            let r =
                catch_unwind(AssertUnwindSafe(|| run_op(&g, &h, &mut live, op))).map_err(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    format!("{op:?} panicked: {msg}")
                })?;
            r?;
            g.canaries().map_err(|e| format!("after {op:?}: {e}"))?;
        }
        Ok(())
        // The thread's cache records go back to the corrupt heap on exit.
    });
    let started = Instant::now();
    while !worker.is_finished() {
        if started.elapsed() > DEADLINE {
            // Leak the hung thread and its memory.
            return Err(format!("the case did not finish within {DEADLINE:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let r = worker
        .join()
        .map_err(|_| "the worker thread panicked outside an operation".to_string())?;
    r?;
    g.canaries()
        .map_err(|e| format!("after the thread's exit: {e}"))
}

fn cases() -> u32 {
    std::env::var("RMALLOC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn sizes() -> impl Strategy<Value = Vec<usize>> {
    proptest::collection::vec(
        prop_oneof![4 => 1usize..2100, 1 => 2100usize..16_000],
        0..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]
    #[test]
    fn corrupted_heaps(
        setup in sizes(),
        helper_setup in sizes(),
        corruptions in proptest::collection::vec((target_strategy(), value_strategy()), 1..6),
        ops in proptest::collection::vec(op_strategy(), 1..60),
    ) {
        if let Err(e) = run_case(setup, helper_setup, corruptions, ops) {
            prop_assert!(false, "{}", e);
        }
    }
}

// ---- specific corruptions ----

fn is_corrupt<T: std::fmt::Debug>(r: HResult<T>, what: &str) -> String {
    match r {
        Err(e @ HeapError::Corrupt(_)) => {
            assert_eq!(e.errno(), libc::EINVAL);
            let msg = e.to_string();
            assert!(msg.contains(what), "{msg:?} does not mention {what:?}");
            assert!(msg.contains("recreate the region"), "{msg}");
            msg
        }
        other => panic!("expected a corrupt heap ({what}), got {other:?}"),
    }
}

fn header(m: &Mem) -> *mut Header {
    m.ptr as *mut Header
}

#[test]
fn list_head_outside_the_heap() {
    let m = Mem::new(1 << 20);
    let h = m.heap(1 << 20);
    h.alloc(100).unwrap();
    h.flush_cache().unwrap();
    let class = class_of(100);
    // SAFETY: the test pokes the header.
    unsafe { (*header(&m)).partial[class] = 1 << 40 };
    let msg = is_corrupt(
        h.alloc(100),
        &format!("partial-list head of class {class} is 0x10000000000"),
    );
    assert!(msg.contains("outside the heap"), "{msg}");
    // Bin heads outside the heap.
    // SAFETY: as above.
    unsafe {
        let hd = header(&m);
        for bin in 0..NBINS {
            if (*hd).bin_mask & (1 << bin) != 0 {
                (*hd).bins[bin] = 0xdead_0000_0000;
            }
        }
    }
    is_corrupt(h.alloc(3 * PAGE), "head of free-run bin");
    is_corrupt(h.stats(), "head of free-run bin");

    // A free that puts a full slab back on the list checks the head too.
    let m = Mem::new(1 << 20);
    let h = m.heap(1 << 20);
    let held = {
        let _g = h.lock().unwrap();
        let mut held = Vec::new();
        loop {
            held.push(h.alloc_locked(100).unwrap());
            // SAFETY: the test reads the header.
            if unsafe { (*header(&m)).partial[class] } == 0 {
                break;
            }
        }
        held
    };
    // SAFETY: the test pokes the header.
    unsafe { (*header(&m)).partial[class] = (1 << 20) + PAGE as u64 };
    let _g = h.lock().unwrap();
    is_corrupt(
        h.free_locked(held[0]),
        &format!("partial-list head of class {class} is 0x101000, outside the heap"),
    );
}

#[test]
fn free_list_cycles() {
    // A cycle in a bin's list of free runs: walks end with EINVAL.
    let m = Mem::new(1 << 20);
    let h = m.heap(1 << 20);
    let blocks: Vec<u64> = (0..6).map(|_| h.alloc(2 * PAGE).unwrap()).collect();
    for &b in blocks.iter().step_by(2) {
        h.free(b).unwrap();
    }
    // Three runs of two pages in bin 1; point the last one back at the first.
    // SAFETY: the test pokes free-run headers.
    unsafe {
        let first = (*header(&m)).bins[1];
        let mut off = first;
        loop {
            let r = m.ptr.add(off as usize) as *mut FreeRun;
            if (*r).next == 0 {
                (*r).next = first;
                break;
            }
            off = (*r).next;
        }
    }
    let started = Instant::now();
    is_corrupt(h.stats(), "free-run list of bin 1 has a cycle");
    assert!(started.elapsed() < Duration::from_secs(5));

    // A cycle in a slab's free list: the block is handed out once, then
    // EINVAL.
    let m = Mem::new(1 << 20);
    let h = m.heap(1 << 20);
    let a = h.alloc(64).unwrap();
    let b = h.alloc(64).unwrap();
    h.flush_cache().unwrap();
    h.free(b).unwrap();
    h.free(a).unwrap();
    h.flush_cache().unwrap();
    // Now a is the head of its slab's free list, then b; make b point to a.
    // SAFETY: the test pokes a free block's link.
    unsafe { (m.ptr.add(b as usize) as *mut u64).write(a) };
    let mut got = Vec::new();
    let r = loop {
        match h.alloc(64) {
            Ok(o) => {
                assert!(!got.contains(&o), "block {o:#x} handed out twice");
                got.push(o);
            }
            Err(e) => break Err::<(), _>(e),
        }
    };
    is_corrupt(r, "free list");
}

#[test]
fn page_map_class_out_of_range() {
    let m = Mem::new(1 << 20);
    let h = m.heap(1 << 20);
    let a = h.alloc(64).unwrap();
    let page = a >> PAGE_SHIFT;
    // SAFETY: the test pokes a page-map entry.
    unsafe {
        let map = m.ptr.add((*header(&m)).map_off as usize) as *mut u32;
        map.add(page as usize).write(entry(K_SLAB, 30 << 8));
    }
    is_corrupt(
        h.free(a),
        &format!("page-map entry of page {page} is a slab page of class 30"),
    );
    is_corrupt(h.block_size(a), &format!("page-map entry of page {page}"));
}

#[test]
fn record_with_bogus_count() {
    let m = Mem::new(1 << 20);
    let h = m.heap(1 << 20);
    let a = h.alloc(64).unwrap();
    h.free(a).unwrap();
    let me = current_tid();
    let rec = {
        let _g = h.lock().unwrap();
        h.records()
            .unwrap()
            .into_iter()
            .find(|&o| {
                let r = h.record_at(o).unwrap();
                // SAFETY: a checked record.
                unsafe { (*r).owner_tid.load(Ordering::Relaxed) == me }
            })
            .unwrap()
    };
    let class = class_of(64);
    // SAFETY: the test pokes the record's count.
    unsafe {
        let r = m.ptr.add(rec as usize) as *mut CacheRec;
        (*r).count[class].store(200, Ordering::Relaxed);
    }
    is_corrupt(h.stats(), &format!("count of class {class} is 200"));
    is_corrupt(h.alloc(64), &format!("count of class {class} is 200"));
}

#[test]
fn lock_word_of_no_thread_fails_fast() {
    let m = Mem::new(1 << 20);
    let h = m.heap(1 << 20);
    // Records this pid namespace as the lock holder's.
    h.stats().unwrap();
    // SAFETY: the test pokes the lock word (no tid is this large).
    unsafe { (*header(&m)).lock.store(0x7654_3210, Ordering::Relaxed) };
    let started = Instant::now();
    is_corrupt(h.stats(), "lock word");
    assert!(started.elapsed() < Duration::from_secs(1));
    // Held by a live thread that never lets go: bounded too.
    let (tx, rx) = mpsc::channel::<()>();
    let (tid_tx, tid_rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        tid_tx.send(current_tid()).unwrap();
        let _ = rx.recv();
    });
    let tid = tid_rx.recv().unwrap();
    // SAFETY: as above.
    unsafe { (*header(&m)).lock.store(tid, Ordering::Relaxed) };
    set_lock_timeout_for_tests(Duration::from_millis(300));
    let started = Instant::now();
    is_corrupt(h.stats(), &format!("held by thread {tid}"));
    assert!(started.elapsed() < Duration::from_secs(5));
    set_lock_timeout_for_tests(Duration::ZERO);
    tx.send(()).unwrap();
    t.join().unwrap();
    // A word naming the caller itself (which holds no lock) is stale.
    // SAFETY: as above.
    unsafe { (*header(&m)).lock.store(current_tid(), Ordering::Relaxed) };
    h.stats().unwrap();
}
