//! The map-reduce job itself, with nothing of regions in it: the input (an
//! "image" of RGB pixel triples, as Metis' histogram job reads), the map
//! kernel (a per-channel byte histogram), how the input and the bins are
//! split among workers, and the single-process in-memory baseline.

use std::ops::Range;

/// Colour channels per pixel.
pub const CHANNELS: usize = 3;
/// Histogram bins: one per channel and byte value.
pub const BINS: usize = CHANNELS * 256;
/// Slice boundaries and the input size are multiples of this: whole pixels
/// and whole 128 KiB blocks (lcm(3, 128 Ki)), so every slice can be
/// `mmap`ed at its offset and the input fills whole allocation blocks of
/// the store it lives in (for regions, 128 KiB chunks).
pub const UNIT: u64 = 3 * 128 * 1024;

/// The input size for at least `min_bytes`: rounded up to a [`UNIT`].
pub fn input_size(min_bytes: u64) -> u64 {
    min_bytes.div_ceil(UNIT).max(1) * UNIT
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `buf`, the input bytes at `offset` (a multiple of 8), from `seed`:
/// every byte is the mean of two uniform bytes (a triangular distribution,
/// so the histogram is not flat), a pure function of seed and position.
pub fn generate(buf: &mut [u8], offset: u64, seed: u64) {
    assert_eq!(offset % 8, 0, "generate: offset must be a multiple of 8");
    let first = offset / 8;
    for (w, out) in buf.chunks_mut(8).enumerate() {
        let word = first + w as u64;
        let a = splitmix64(seed ^ word.wrapping_mul(2)).to_le_bytes();
        let b = splitmix64(seed ^ word.wrapping_mul(2).wrapping_add(1)).to_le_bytes();
        for (k, o) in out.iter_mut().enumerate() {
            *o = ((u16::from(a[k]) + u16::from(b[k])) >> 1) as u8;
        }
    }
}

/// The whole input of `size` bytes, generated on `threads` threads.
pub fn generate_all(size: u64, seed: u64, threads: usize) -> Vec<u8> {
    let len = usize::try_from(size).expect("input size fits in memory");
    let mut data = vec![0u8; len];
    let per = len.div_ceil(threads.max(1)).next_multiple_of(8).max(8);
    std::thread::scope(|s| {
        for (i, part) in data.chunks_mut(per).enumerate() {
            s.spawn(move || generate(part, (i * per) as u64, seed));
        }
    });
    data
}

/// The map kernel: adds the pixels of `data` (which starts at a pixel
/// boundary) to `hist`.
pub fn count(data: &[u8], hist: &mut [u64; BINS]) {
    let (r, rest) = hist.split_at_mut(256);
    let (g, b) = rest.split_at_mut(256);
    let mut pixels = data.chunks_exact(CHANNELS);
    for p in &mut pixels {
        r[usize::from(p[0])] += 1;
        g[usize::from(p[1])] += 1;
        b[usize::from(p[2])] += 1;
    }
    for (c, &v) in pixels.remainder().iter().enumerate() {
        hist[c * 256 + usize::from(v)] += 1;
    }
}

/// The histogram of `data` counted by `threads` threads of this process
/// (the single-process in-memory baseline).
pub fn histogram(data: &[u8], threads: usize) -> Vec<u64> {
    let threads = threads.max(1);
    let parts: Vec<[u64; BINS]> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let r = slice(data.len() as u64, threads, i);
                let part = &data[r.start as usize..r.end as usize];
                s.spawn(move || {
                    let mut h = [0u64; BINS];
                    count(part, &mut h);
                    h
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a counting thread panicked"))
            .collect()
    });
    let mut total = vec![0u64; BINS];
    for p in &parts {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

/// Bytes `[start, end)` of an input of `total` bytes that worker `i` of `n`
/// maps: [`UNIT`]-aligned, as even as possible, covering the input.
pub fn slice(total: u64, n: usize, i: usize) -> Range<u64> {
    let units = total.div_ceil(UNIT);
    let (n, i) = (n as u64, i as u64);
    let start = (units * i / n * UNIT).min(total);
    let end = (units * (i + 1) / n * UNIT).min(total);
    start..end
}

/// The map tasks (each [`slice`]`(total, tasks, t)`) that are worker `i`
/// of `n`'s own: a contiguous run.
pub fn own_tasks(tasks: usize, n: usize, i: usize) -> Range<usize> {
    tasks * i / n..tasks * (i + 1) / n
}

/// The order in which worker `i` of `n` tries to claim the map tasks: its
/// own from the first, then the others' from the last (which their owners
/// reach last), as in a work-stealing queue.
pub fn task_order(tasks: usize, n: usize, i: usize) -> impl Iterator<Item = usize> {
    let own = own_tasks(tasks, n, i);
    let rest = (0..tasks)
        .rev()
        .filter(move |t| !own_tasks(tasks, n, i).contains(t));
    own.chain(rest)
}

/// The bins that reducer `i` of `n` sums: disjoint, covering all bins.
pub fn bins(n: usize, i: usize) -> Range<usize> {
    BINS * i / n..BINS * (i + 1) / n
}

/// `values` as little-endian bytes (the layout of the histogram regions).
pub fn to_bytes(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The inverse of [`to_bytes`]; `None` when the length is not a multiple of 8.
pub fn from_bytes(bytes: &[u8]) -> Option<Vec<u64>> {
    bytes.len().is_multiple_of(8).then(|| {
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_input_on_unit_boundaries() {
        for total in [UNIT, 5 * UNIT, input_size(1 << 30), 7 * UNIT + 3] {
            for n in 1..=5 {
                let mut next = 0;
                for i in 0..n {
                    let r = slice(total, n, i);
                    assert_eq!(r.start, next);
                    assert_eq!(r.start % UNIT, 0);
                    next = r.end;
                }
                assert_eq!(next, total);
            }
        }
    }

    #[test]
    fn every_worker_tries_every_task_once_its_own_first() {
        for tasks in [1, 3, 7, 24] {
            for n in 1..=5 {
                for i in 0..n {
                    let order: Vec<usize> = task_order(tasks, n, i).collect();
                    let own: Vec<usize> = own_tasks(tasks, n, i).collect();
                    assert_eq!(&order[..own.len()], &own[..]);
                    let mut sorted = order.clone();
                    sorted.sort_unstable();
                    assert_eq!(sorted, (0..tasks).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn bins_are_disjoint_and_cover() {
        for n in 1..=7 {
            let all: Vec<usize> = (0..n).flat_map(|i| bins(n, i)).collect();
            assert_eq!(all, (0..BINS).collect::<Vec<_>>());
        }
    }

    #[test]
    fn generation_is_positional_and_not_flat() {
        let whole = generate_all(4 * UNIT, 7, 3);
        let mut part = vec![0u8; UNIT as usize];
        generate(&mut part, 2 * UNIT, 7);
        assert_eq!(&whole[2 * UNIT as usize..3 * UNIT as usize], &part[..]);
        assert_ne!(generate_all(UNIT, 8, 1), generate_all(UNIT, 7, 1));
        let h = histogram(&whole, 1);
        // Triangular: the middle byte values are far more common than 0.
        assert!(h[128] > 10 * h[0].max(1));
    }

    #[test]
    fn histogram_counts_every_pixel_whatever_the_threads() {
        let data = generate_all(3 * UNIT, 1, 2);
        let one = histogram(&data, 1);
        assert_eq!(one.iter().sum::<u64>(), data.len() as u64);
        for c in 0..CHANNELS {
            let per: u64 = one[c * 256..(c + 1) * 256].iter().sum();
            assert_eq!(per, data.len() as u64 / 3);
        }
        assert_eq!(histogram(&data, 3), one);
        assert_eq!(histogram(&data, 5), one);
        let mut by_hand = vec![0u64; BINS];
        for (i, &v) in data.iter().enumerate() {
            by_hand[(i % 3) * 256 + usize::from(v)] += 1;
        }
        assert_eq!(by_hand, one);
    }

    #[test]
    fn bytes_round_trip() {
        let v = vec![0, 1, u64::MAX, 1 << 40];
        assert_eq!(from_bytes(&to_bytes(&v)), Some(v));
        assert_eq!(from_bytes(&[1, 2, 3]), None);
    }
}
