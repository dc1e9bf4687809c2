//! The heap lock: a futex word in the heap [`Header`](super::Header) (shared, not
//! `FUTEX_PRIVATE`, so threads and processes of one host that map the heap exclude each
//! other) that holds the holder's thread id, and the thread identities it relies on. A
//! waiter that finds the holder's thread gone (same pid namespace) takes the lock over.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use regions_proto::word_wait;

use super::Heap;

/// Set in the lock word while threads may be waiting for it.
const LOCK_WAITERS: u32 = 1 << 31;

thread_local! {
    static TID: Cell<u32> = const { Cell::new(0) };
}

/// The calling thread's id (cached per thread).
pub(super) fn current_tid() -> u32 {
    TID.with(|t| {
        let v = t.get();
        if v != 0 {
            return v;
        }
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        t.set(tid);
        tid
    })
}

/// Inode of this process's pid namespace (0 when unknown).
pub(super) fn pid_namespace() -> u64 {
    static NS: OnceLock<u64> = OnceLock::new();
    *NS.get_or_init(|| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self/ns/pid")
            .map(|m| m.ino())
            .unwrap_or(0)
    })
}

/// Whether thread `tid` of this pid namespace may still exist (only `ESRCH` says it is
/// gone).
pub(super) fn thread_alive(tid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks that the task exists.
    let r = unsafe { libc::kill(tid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Forgets the cached thread id (a forked child's only thread has a new one).
pub(super) fn forget_current_tid() {
    let _ = TID.try_with(|t| t.set(0));
}

/// Holds the heap lock; releases it on drop.
pub(super) struct Guard<'a> {
    word: &'a AtomicU32,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.word.swap(0, Ordering::Release) & LOCK_WAITERS != 0 {
            word_wait::wake_one_u32(self.word);
        }
    }
}

impl Heap {
    /// Takes the heap lock (see the module docs).
    pub(super) fn lock(&self) -> Guard<'_> {
        // SAFETY: the header is mapped.
        let word = unsafe { &(*self.header()).lock };
        // SAFETY: as above.
        let ns_slot = unsafe { &(*self.header()).lock_ns };
        let me = current_tid();
        if word
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_slow(word, me);
        }
        let ns = pid_namespace();
        if ns_slot.load(Ordering::Relaxed) != ns {
            ns_slot.store(ns, Ordering::Relaxed);
        }
        Guard { word }
    }

    #[cold]
    fn lock_slow(&self, word: &AtomicU32, me: u32) {
        for _ in 0..100 {
            std::hint::spin_loop();
            if word
                .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
        let mut since = Instant::now();
        loop {
            let v = word.load(Ordering::Relaxed);
            if v == 0 {
                if word
                    .compare_exchange(0, me | LOCK_WAITERS, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return;
                }
                continue;
            }
            if v & LOCK_WAITERS == 0
                && word
                    .compare_exchange(v, v | LOCK_WAITERS, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            word_wait::wait_u32(word, v | LOCK_WAITERS, Duration::from_millis(100));
            if since.elapsed() > Duration::from_millis(500) {
                since = Instant::now();
                // SAFETY: the header is mapped.
                let ns = unsafe { &(*self.header()).lock_ns }.load(Ordering::Relaxed);
                let holder = word.load(Ordering::Relaxed);
                let tid = holder & !LOCK_WAITERS;
                if tid != 0
                    && ns != 0
                    && ns == pid_namespace()
                    && !thread_alive(tid)
                    && word
                        .compare_exchange(
                            holder,
                            me | LOCK_WAITERS,
                            Ordering::Acquire,
                            Ordering::Relaxed,
                        )
                        .is_ok()
                {
                    tracing::warn!(
                        dead_tid = tid,
                        "rmalloc: took over the heap lock from a thread that died holding it"
                    );
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_mem::Mem;
    use std::time::{Duration, Instant};

    #[test]
    fn lock_taken_over_from_dead_thread() {
        let m = Mem::new(1 << 20);
        let h = m.heap(1 << 20);
        // A thread takes the lock and exits without releasing it.
        let h2 = h;
        std::thread::spawn(move || std::mem::forget(h2.lock()))
            .join()
            .unwrap();
        let started = Instant::now();
        h.alloc(10).unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
