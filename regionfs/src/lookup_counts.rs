//! How many times the kernel was handed each inode (its `nlookup`): every reply that gives it
//! an entry (lookup, create, mkdir, mknod, symlink, link, and each entry of a readdirplus but
//! `.` and `..`) counts one, and a `FORGET` takes back as many as it names.
//!
//! A `FORGET` does not always mean the kernel dropped the inode it holds now: forgets are
//! queued and sent late, so one for an inode the kernel evicted can arrive after a new lookup
//! of the same number gave it a fresh inode. What this mount keeps about the kernel's inode
//! (the size it believes the kernel holds, cached entries) goes only when the count is back
//! to zero.

use std::collections::HashMap;
use std::sync::Mutex;

/// The kernel's lookup count of each inode number it holds.
#[derive(Default)]
pub struct LookupCounts {
    counts: Mutex<HashMap<u64, u64>>,
}

impl LookupCounts {
    /// A reply handed `ino` to the kernel once more. Called before the reply is sent, so that
    /// a forget that follows it finds it counted.
    pub fn handed(&self, ino: u64) {
        *self.lock().entry(ino).or_insert(0) += 1;
    }

    /// The kernel forgot `nlookup` of its lookups of `ino`: whether it holds none now (also
    /// when this mount counted none, as after its counts were lost).
    pub fn forgot(&self, ino: u64, nlookup: u64) -> bool {
        let mut counts = self.lock();
        match counts.get_mut(&ino) {
            Some(n) if *n > nlookup => {
                *n -= nlookup;
                false
            }
            _ => {
                counts.remove(&ino);
                true
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u64>> {
        self.counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_forget_of_an_evicted_inode_leaves_the_new_one_counted() {
        let c = LookupCounts::default();
        c.handed(3);
        c.handed(3);
        // Evicted (forget of 2 queued); a new lookup hands the number out again first.
        c.handed(3);
        assert!(!c.forgot(3, 2), "the new inode's lookup is still held");
        assert!(c.forgot(3, 1));
        assert!(c.forgot(3, 1), "nothing counted: held by none");
    }

    #[test]
    fn a_forget_of_more_than_counted_clears_the_count() {
        let c = LookupCounts::default();
        c.handed(7);
        assert!(c.forgot(7, 5));
        c.handed(7);
        assert!(!c.forgot(7, 0));
        assert!(c.forgot(7, 1));
    }
}
