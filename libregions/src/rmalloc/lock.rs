//! The heap lock: a futex word in the heap [`Header`](super::Header) (shared, not
//! `FUTEX_PRIVATE`, so threads and processes of one host that map the heap exclude each
//! other) that holds the holder's thread id, and the thread identities it relies on. A
//! waiter that finds the holder's thread gone (same pid namespace) takes the lock over.
//!
//! The word is heap memory, so it is not trusted either: a word that names no possible
//! thread (id 0 or at least `PID_MAX_LIMIT`) fails at once, and a wait for a holder that
//! lives on but does not let go ends after [`LOCK_TIMEOUT`], both with
//! [`HeapError::Corrupt`](super::HeapError::Corrupt) (`EINVAL`). A word naming the caller
//! itself, which holds no heap lock while it asks for one, is stale and taken over like a
//! dead thread's.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use regions_proto::word_wait;

use super::{HResult, Heap, corrupt_with};

/// Set in the lock word while threads may be waiting for it.
const LOCK_WAITERS: u32 = 1 << 31;
/// Thread ids are below this (`PID_MAX_LIMIT` of linux/threads.h on 64-bit).
const PID_MAX_LIMIT: u32 = 1 << 22;
/// Longest wait for the heap lock. No allocator operation holds it for long (they touch a
/// few pages of metadata, or copy the page map when the heap grows), so a holder that
/// keeps it this long is stuck or the word is corrupt.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a waiter checks whether the holder still exists.
const HOLDER_CHECK: Duration = Duration::from_millis(500);

#[cfg(test)]
thread_local! {
    static TEST_TIMEOUT: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Makes the calling thread give up waiting for a heap lock after `d` (zero: after
/// [`LOCK_TIMEOUT`]).
#[cfg(test)]
pub(super) fn set_lock_timeout_for_tests(d: Duration) {
    TEST_TIMEOUT.with(|t| t.set(d));
}

fn lock_timeout() -> Duration {
    #[cfg(test)]
    if let Ok(d) = TEST_TIMEOUT.try_with(Cell::get)
        && !d.is_zero()
    {
        return d;
    }
    LOCK_TIMEOUT
}

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
    /// Takes the heap lock (see the module docs); fails on a corrupt lock word.
    pub(super) fn lock(&self) -> HResult<Guard<'_>> {
        // SAFETY: the header is mapped.
        let word = unsafe { &(*self.header()).lock };
        // SAFETY: as above.
        let ns_slot = unsafe { &(*self.header()).lock_ns };
        let me = current_tid();
        if word
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_slow(word, me)?;
        }
        let ns = pid_namespace();
        if ns_slot.load(Ordering::Relaxed) != ns {
            ns_slot.store(ns, Ordering::Relaxed);
        }
        Ok(Guard { word })
    }

    #[cold]
    fn lock_slow(&self, word: &AtomicU32, me: u32) -> HResult<()> {
        for _ in 0..100 {
            std::hint::spin_loop();
            if word
                .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return Ok(());
            }
        }
        let timeout = lock_timeout();
        let check_every = HOLDER_CHECK.min(timeout / 4);
        let started = Instant::now();
        let mut since = started;
        loop {
            let v = word.load(Ordering::Relaxed);
            if v == 0 {
                if word
                    .compare_exchange(0, me | LOCK_WAITERS, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(());
                }
                continue;
            }
            let tid = v & !LOCK_WAITERS;
            if tid == 0 || tid >= PID_MAX_LIMIT {
                return Err(corrupt_with(move || {
                    format!(
                        "the heap lock word is {v:#x}, which names no thread (thread ids are 1 to \
                         {})",
                        PID_MAX_LIMIT - 1
                    )
                }));
            }
            if v & LOCK_WAITERS == 0
                && word
                    .compare_exchange(v, v | LOCK_WAITERS, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            word_wait::wait_u32(
                word,
                v | LOCK_WAITERS,
                check_every.min(Duration::from_millis(100)),
            );
            if since.elapsed() > check_every {
                since = Instant::now();
                // SAFETY: the header is mapped.
                let ns = unsafe { &(*self.header()).lock_ns }.load(Ordering::Relaxed);
                let holder = word.load(Ordering::Relaxed);
                let tid = holder & !LOCK_WAITERS;
                // The caller holds no heap lock while it asks for one: a word
                // naming it is stale.
                if tid != 0
                    && ns != 0
                    && ns == pid_namespace()
                    && (tid == me || !thread_alive(tid))
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
                    return Ok(());
                }
            }
            if started.elapsed() > timeout {
                return Err(corrupt_with(move || {
                    format!(
                        "the heap lock word is {v:#x}: held by thread {tid} for more than \
                         {timeout:?}, longer than any allocator operation takes (the holder is \
                         stuck, or the word was overwritten)"
                    )
                }));
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
        std::thread::spawn(move || std::mem::forget(h2.lock().unwrap()))
            .join()
            .unwrap();
        let started = Instant::now();
        h.alloc(10).unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
