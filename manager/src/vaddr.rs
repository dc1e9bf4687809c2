//! Fixed virtual addresses (Remote Regions paper §6.10): every FIXVADDR region gets a
//! cluster-unique range inside the reserved window, freed when it is deleted.

use std::collections::BTreeMap;

use regions_proto::layout::{VADDR_WINDOW_END, VADDR_WINDOW_START};

/// Ranges start on 2 MiB boundaries (huge-page friendly).
pub const VADDR_ALIGN: u64 = 2 << 20;
/// Smallest range handed out, so that a region can grow in place.
pub const MIN_RESERVATION: u64 = 256 << 20;

/// The range to reserve for a region of `size` bytes: a power of two of at
/// least [`MIN_RESERVATION`], leaving room to grow in place.
pub fn reservation_for(size: u64) -> u64 {
    size.max(MIN_RESERVATION)
        .checked_next_power_of_two()
        .unwrap_or(u64::MAX)
}

/// The allocated ranges of the window.
#[derive(Clone, Debug)]
pub struct VaddrSpace {
    /// Start → length of every allocated range.
    used: BTreeMap<u64, u64>,
    start: u64,
    end: u64,
}

impl Default for VaddrSpace {
    fn default() -> Self {
        VaddrSpace::new(VADDR_WINDOW_START, VADDR_WINDOW_END)
    }
}

impl VaddrSpace {
    pub fn new(start: u64, end: u64) -> VaddrSpace {
        VaddrSpace {
            used: BTreeMap::new(),
            start,
            end,
        }
    }

    /// Finds and takes the lowest free range of `len` bytes.
    pub fn reserve(&mut self, len: u64) -> Option<u64> {
        let len = len.checked_next_multiple_of(VADDR_ALIGN)?;
        let mut candidate = self.start;
        for (&s, &l) in &self.used {
            if candidate.checked_add(len)? <= s {
                break;
            }
            candidate = (s + l).checked_next_multiple_of(VADDR_ALIGN)?;
        }
        if candidate.checked_add(len)? > self.end {
            return None;
        }
        self.used.insert(candidate, len);
        Some(candidate)
    }

    /// Records a stored range (loading); false if it overlaps another.
    pub fn mark(&mut self, start: u64, len: u64) -> bool {
        if start < self.start || start.saturating_add(len) > self.end {
            return false;
        }
        let before_ok = self
            .used
            .range(..=start)
            .next_back()
            .is_none_or(|(&s, &l)| s + l <= start);
        let after_ok = self
            .used
            .range(start..)
            .next()
            .is_none_or(|(&s, _)| start + len <= s);
        if before_ok && after_ok {
            self.used.insert(start, len);
        }
        before_ok && after_ok
    }

    /// Grows the range at `start` to `len` bytes if the space after it is free.
    pub fn grow(&mut self, start: u64, len: u64) -> bool {
        let Some(&old) = self.used.get(&start) else {
            return false;
        };
        let Some(len) = len.checked_next_multiple_of(VADDR_ALIGN) else {
            return false;
        };
        if len <= old {
            return true;
        }
        let limit = self
            .used
            .range(start + 1..)
            .next()
            .map_or(self.end, |(&s, _)| s);
        if start.saturating_add(len) > limit {
            return false;
        }
        self.used.insert(start, len);
        true
    }

    pub fn release(&mut self, start: u64) {
        self.used.remove(&start);
    }

    pub fn used(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.used.iter().map(|(&s, &l)| (s, l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_unique_aligned_and_in_the_window() {
        let mut v = VaddrSpace::default();
        let mut got: Vec<(u64, u64)> = Vec::new();
        for i in 0..200u64 {
            let len = reservation_for(i * 7_000_000);
            let s = v.reserve(len).unwrap();
            assert_eq!(s % VADDR_ALIGN, 0);
            assert!(s >= VADDR_WINDOW_START && s + len <= VADDR_WINDOW_END);
            for &(os, ol) in &got {
                assert!(s + len <= os || os + ol <= s, "overlap");
            }
            got.push((s, len));
        }
    }

    #[test]
    fn freed_ranges_are_reused() {
        let mut v = VaddrSpace::default();
        let a = v.reserve(MIN_RESERVATION).unwrap();
        let b = v.reserve(MIN_RESERVATION).unwrap();
        v.release(a);
        assert_eq!(v.reserve(MIN_RESERVATION), Some(a));
        assert_ne!(a, b);
    }

    #[test]
    fn exhaustion_and_in_place_growth() {
        let mut v = VaddrSpace::new(0, 4 * VADDR_ALIGN);
        let a = v.reserve(VADDR_ALIGN).unwrap();
        let b = v.reserve(VADDR_ALIGN).unwrap();
        assert!(!v.grow(a, 2 * VADDR_ALIGN), "b is in the way");
        assert!(v.grow(b, 3 * VADDR_ALIGN));
        assert_eq!(v.reserve(VADDR_ALIGN), None);
        assert!(!v.mark(10 * VADDR_ALIGN, 1), "outside the window");
    }

    #[test]
    fn mark_refuses_overlaps() {
        let mut v = VaddrSpace::default();
        assert!(v.mark(VADDR_WINDOW_START, MIN_RESERVATION));
        assert!(!v.mark(VADDR_WINDOW_START + VADDR_ALIGN, MIN_RESERVATION));
        assert!(v.mark(VADDR_WINDOW_START + MIN_RESERVATION, MIN_RESERVATION));
        assert_eq!(reservation_for(0), MIN_RESERVATION);
        assert_eq!(reservation_for(MIN_RESERVATION + 1), 2 * MIN_RESERVATION);
    }
}
