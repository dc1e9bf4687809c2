//! A separate OS process for the shared-heap tests and bench: allocates in a region from
//! several threads through libregions' `rmalloc`/`rfree`, or checks a region's heap from
//! outside.
//!
//! ```text
//! regions-heap-helper stress PATH SECONDS THREADS TAG OUT
//!     allocates and frees blocks of 16 B to 32 KiB for SECONDS on THREADS threads, each block
//!     filled with a tag byte and checked before it is freed; then writes the mapping back
//!     (rmsync) and lists the live blocks in OUT ("offset length tag" per line). Prints
//!     "ops N" (allocations plus frees).
//! regions-heap-helper check PATH [--live FILE]... [--freed FILE]... [--free-every N --freed-out FILE]
//!     drops its cached pages, then checks every listed live block (its bytes, that it lies in
//!     an arena, that no two overlap) and every arena's heap (a copy of it, so nothing here is
//!     written back): its layout validates and each listed block is live in it; each block of
//!     a --freed list is free again unless a live list names it or it still waits in the
//!     remote-free ring. With --free-every N it then
//!     frees every Nth listed block (remote frees: it owns no arena) and lists them in the
//!     --freed-out file. Prints "checked B blocks in A arenas", "pending R" (remote frees
//!     waiting for their owners) and "freed F".
//! ```
//!
//! The path's mount decides the host the process runs as (its host agent).

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use regions::capi::alloc::{alloc_in, free_ptr, heap_at};
use regions::rmalloc::Heap;

/// One live block: region offset, length, fill byte.
type Block = (u64, usize, u8);

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("stress") if args.len() == 6 => stress(
            &args[1],
            args[2].parse()?,
            args[3].parse()?,
            args[4].parse()?,
            &args[5],
        ),
        Some("check") => check(&args[1..]),
        _ => bail!(
            "usage: regions-heap-helper stress PATH SECONDS THREADS TAG OUT | check PATH \
             [--live FILE]... [--freed FILE]... [--free-every N --freed-out FILE]"
        ),
    }
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn block_len(r: u64) -> usize {
    match r % 100 {
        0..75 => 16 + (r >> 8) as usize % 496,
        75..95 => 512 + (r >> 8) as usize % 3584,
        _ => 4096 + (r >> 8) as usize % 28672,
    }
}

fn stress(path: &str, seconds: f64, threads: usize, tag: u8, out: &str) -> anyhow::Result<()> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open {path}"))?;
    let fd = file.as_raw_fd();
    // The first allocation maps the region (and creates the heap in an empty one).
    let first = alloc_in(fd, 16)?;
    free_ptr(first)?;
    let m = regions::mapping::lookup(first).context("no mapping after rmalloc")?;
    let base = m.base() as usize;
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            std::thread::spawn(move || -> anyhow::Result<(u64, Vec<Block>)> {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((tag as u64) << 32 | t as u64);
                let mut live: Vec<(usize, usize, u8)> = Vec::new();
                let mut ops = 0u64;
                loop {
                    if ops.is_multiple_of(256) && Instant::now() >= until {
                        break;
                    }
                    let r = xorshift(&mut x);
                    if live.len() < 512 && (live.is_empty() || !r.is_multiple_of(3)) {
                        let len = block_len(r >> 4);
                        let p = alloc_in(fd, len)?;
                        let fill = (r >> 40) as u8 | 1;
                        // SAFETY: a fresh block of `len` bytes.
                        unsafe { std::ptr::write_bytes(p, fill, len) };
                        live.push((p as usize, len, fill));
                    } else {
                        let (p, len, fill) = live.swap_remove((r >> 8) as usize % live.len());
                        // SAFETY: a live block of ours.
                        let s = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
                        if let Some(i) = s.iter().position(|&b| b != fill) {
                            bail!(
                                "block at offset {:#x} ({len} bytes, fill {fill:#x}) was \
                                 overwritten at byte {i} with {:#x}",
                                p - base,
                                s[i]
                            );
                        }
                        free_ptr(p as *const u8)?;
                    }
                    ops += 1;
                }
                let live = live
                    .into_iter()
                    .map(|(p, len, fill)| ((p - base) as u64, len, fill))
                    .collect();
                Ok((ops, live))
            })
        })
        .collect();
    let mut ops = 0;
    let mut live = Vec::new();
    for w in workers {
        let (n, l) = w
            .join()
            .map_err(|_| anyhow::anyhow!("a worker panicked"))??;
        ops += n;
        live.extend(l);
    }
    m.msync(m.base(), m.len())?;
    let mut f = std::fs::File::create(out)?;
    for (off, len, fill) in &live {
        writeln!(f, "{off} {len} {fill}")?;
    }
    println!("ops {ops}");
    println!("live {}", live.len());
    Ok(())
}

fn read_list(path: &str) -> anyhow::Result<Vec<Block>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
    text.lines()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            ensure!(w.len() == 3, "bad line {l:?} in {path}");
            Ok((w[0].parse()?, w[1].parse()?, w[2].parse()?))
        })
        .collect()
}

/// Anonymous memory holding a copy of an arena.
struct Copy {
    ptr: *mut u8,
    len: usize,
}

impl Copy {
    fn of(src: *const u8, len: usize) -> anyhow::Result<Copy> {
        // SAFETY: a fresh anonymous private mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        ensure!(p != libc::MAP_FAILED, "mmap of {len} bytes failed");
        // SAFETY: `src` is `len` mapped bytes (the arena), `p` a fresh mapping of `len`.
        unsafe { std::ptr::copy_nonoverlapping(src, p as *mut u8, len) };
        Ok(Copy {
            ptr: p as *mut u8,
            len,
        })
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        regions::rmalloc::unmapping(self.ptr, self.len);
        // SAFETY: our mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn check(args: &[String]) -> anyhow::Result<()> {
    let path = args.first().context("check needs a PATH")?;
    let (mut live_files, mut freed_files) = (Vec::new(), Vec::new());
    let (mut free_every, mut freed_out) = (0usize, None);
    let mut i = 1;
    while i < args.len() {
        let v = args.get(i + 1).context("an option needs a value")?;
        match args[i].as_str() {
            "--live" => live_files.push(v.clone()),
            "--freed" => freed_files.push(v.clone()),
            "--free-every" => free_every = v.parse()?,
            "--freed-out" => freed_out = Some(v.clone()),
            o => bail!("unknown option {o}"),
        }
        i += 2;
    }
    let mut live: Vec<Block> = Vec::new();
    for f in &live_files {
        live.extend(read_list(f)?);
    }
    let mut freed: Vec<Block> = Vec::new();
    for f in &freed_files {
        freed.extend(read_list(f)?);
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open {path}"))?;
    let m = regions::mapping::map_fd(std::os::fd::AsFd::as_fd(&file))?;
    // What every other host wrote back, not what this process cached.
    m.clearcache(m.base(), m.len())?;
    let heap = heap_at(m.base())?;
    let arenas = heap.arenas()?;
    let end = arenas.iter().map(|a| a.0 + a.1).max().unwrap_or(0);
    if (m.len() as u64) < end {
        m.grow(end as usize)?;
    }
    // Blocks: inside an arena, their bytes intact, no two overlapping.
    let mut by_arena: BTreeMap<usize, Vec<Block>> = BTreeMap::new();
    for &(off, len, fill) in &live {
        let a = arenas
            .iter()
            .position(|&(ao, al, _)| off >= ao && off + len as u64 <= ao + al)
            .with_context(|| format!("block at {off:#x} ({len} bytes) is in no arena"))?;
        // SAFETY: inside an arena, inside the mapping (grown above).
        let s = unsafe { std::slice::from_raw_parts(m.base().add(off as usize), len) };
        if let Some(i) = s.iter().position(|&b| b != fill) {
            bail!(
                "block at {off:#x} ({len} bytes, fill {fill:#x}) holds {:#x} at byte {i}",
                s[i]
            );
        }
        by_arena.entry(a).or_default().push((off, len, fill));
    }
    let mut sorted: Vec<(u64, usize)> = live.iter().map(|&(o, l, _)| (o, l)).collect();
    sorted.sort();
    for w in sorted.windows(2) {
        ensure!(
            w[0].0 + w[0].1 as u64 <= w[1].0,
            "blocks overlap: {:#x}+{} and {:#x}",
            w[0].0,
            w[0].1,
            w[1].0
        );
    }
    // Each arena's heap, on a copy.
    let live_offs: HashSet<u64> = live.iter().map(|b| b.0).collect();
    let pending: HashSet<u64> = heap.pending_remote_frees()?.into_iter().collect();
    for (a, &(ao, al, _)) in arenas.iter().enumerate() {
        // SAFETY: the arena lies inside the mapping (grown above).
        let copy = Copy::of(unsafe { m.base().add(ao as usize) }, al as usize)?;
        // SAFETY: the copy stays mapped while `h` is used.
        let h = unsafe { Heap::attach(copy.ptr, copy.len) }
            .with_context(|| format!("arena {a} at {ao:#x}"))?;
        let stats = h
            .stats()
            .with_context(|| format!("arena {a} at {ao:#x} fails validation"))?;
        for &(off, len, _) in by_arena.get(&a).map(Vec::as_slice).unwrap_or(&[]) {
            ensure!(
                h.is_live(off - ao)?,
                "listed block {off:#x} is not live in arena {a}"
            );
            let size = h.block_size(off - ao)?;
            ensure!(
                size >= len,
                "block {off:#x} is {size} bytes in its heap, {len} listed"
            );
        }
        for &(off, _, _) in &freed {
            if off >= ao && off < ao + al && !live_offs.contains(&off) && !pending.contains(&off) {
                ensure!(
                    !h.is_live(off - ao)?,
                    "block {off:#x}, freed by another process, is still live in arena {a}"
                );
            }
        }
        ensure!(
            stats.blocks >= by_arena.get(&a).map_or(0, Vec::len) as u64,
            "arena {a} counts {} live blocks, fewer than listed",
            stats.blocks
        );
    }
    println!("checked {} blocks in {} arenas", live.len(), arenas.len());
    println!("pending {}", pending.len());
    let mut n = 0;
    if free_every > 0 {
        let out = freed_out.context("--free-every needs --freed-out")?;
        let mut f = std::fs::File::create(&out)?;
        for b in live.iter().step_by(free_every) {
            // SAFETY: the block lies inside the mapping (grown above to cover every arena).
            free_ptr(unsafe { m.base().add(b.0 as usize) })?;
            writeln!(f, "{} {} {}", b.0, b.1, b.2)?;
            n += 1;
        }
    }
    println!("freed {n}");
    Ok(())
}
