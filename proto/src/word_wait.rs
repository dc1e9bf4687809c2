//! Waiting on a word of region memory, shared by every process that maps the memory (the
//! daemon serving `WaitChange`, programs with the segment mapped, rmalloc's heap lock).
//!
//! - An 8-byte word ([`wait`], [`wait_at`], [`wake`]): a futex on the word's low 32 bits (its
//!   first 4 bytes, little endian). Whoever changes a word with an atomic that waiters may
//!   watch calls [`wake`], which wakes every waiter.
//! - A 4-byte word ([`wait_u32`], [`wake_one_u32`]): a futex on the word itself; a wake wakes
//!   one waiter (a lock hands itself to one waiter at a time).
//!
//! A wait returns on a wake, when the watched 32 bits no longer equal the expected value, or
//! at the timeout, so callers always re-read the word.
//!
//! The futexes are shared (not process-private, no `FUTEX_PRIVATE_FLAG`): processes mapping
//! the same memfd meet on the same page.

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

/// Sleeps while the low 32 bits of `word` equal those of `expected`, at most `timeout` (a
/// wake, a signal or a changed word ends it sooner).
pub fn wait(word: &AtomicU64, expected: u64, timeout: Duration) {
    wait_at(word.as_ptr() as usize, expected, timeout);
}

/// [`wait`] on the word at address `addr`, which need not be mapped any more: the kernel
/// reads it (`EFAULT` ends the wait at once), this process never does.
pub fn wait_at(addr: usize, expected: u64, timeout: Duration) {
    futex_wait(addr, expected as u32, timeout);
}

/// Wakes every waiter of `word` (in any process mapping it).
pub fn wake(word: &AtomicU64) {
    futex_wake(word.as_ptr() as usize, i32::MAX);
}

/// Sleeps while `word` equals `expected`, at most `timeout` (a wake, a signal or a changed
/// word ends it sooner).
pub fn wait_u32(word: &AtomicU32, expected: u32, timeout: Duration) {
    futex_wait(word.as_ptr() as usize, expected, timeout);
}

/// Wakes one waiter of `word` (in any process mapping it), if there is one.
pub fn wake_one_u32(word: &AtomicU32) {
    futex_wake(word.as_ptr() as usize, 1);
}

/// `FUTEX_WAIT` (shared) on the 4 bytes at `addr`.
fn futex_wait(addr: usize, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: FUTEX_WAIT reads the 4 bytes at `addr` in the kernel, which checks the address
    // (EFAULT when it is not readable); nothing in this process dereferences it. The
    // timespec outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            addr as *const u32,
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// `FUTEX_WAKE` (shared) of at most `waiters` waiters of the 4 bytes at `addr`.
fn futex_wake(addr: usize, waiters: i32) {
    // SAFETY: FUTEX_WAKE reads and writes nothing at `addr`; the kernel only uses the address
    // as a key (and checks it, EFAULT when it is not mapped).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            addr as *const u32,
            libc::FUTEX_WAKE,
            waiters,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn a_waiter_wakes_on_a_change_and_times_out_without_one() {
        let word = Arc::new(AtomicU64::new(5));
        let start = Instant::now();
        wait(&word, 5, Duration::from_millis(30));
        assert!(start.elapsed() >= Duration::from_millis(25));
        // A value that already differs returns at once.
        let start = Instant::now();
        wait(&word, 6, Duration::from_secs(10));
        assert!(start.elapsed() < Duration::from_secs(5));
        // An address with nothing mapped ends the wait at once.
        let start = Instant::now();
        wait_at(8, 0, Duration::from_secs(10));
        assert!(start.elapsed() < Duration::from_secs(5));

        let w = Arc::clone(&word);
        let waiter = std::thread::spawn(move || {
            let start = Instant::now();
            while w.load(Ordering::SeqCst) == 5 {
                wait(&w, 5, Duration::from_secs(10));
            }
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        word.fetch_add(1, Ordering::SeqCst);
        wake(&word);
        assert!(waiter.join().unwrap() < Duration::from_secs(5));
    }

    #[test]
    fn a_u32_waiter_wakes_on_a_change_and_times_out_without_one() {
        let word = Arc::new(AtomicU32::new(5));
        let start = Instant::now();
        wait_u32(&word, 5, Duration::from_millis(30));
        assert!(start.elapsed() >= Duration::from_millis(25));
        // A value that already differs returns at once.
        let start = Instant::now();
        wait_u32(&word, 6, Duration::from_secs(10));
        assert!(start.elapsed() < Duration::from_secs(5));

        let w = Arc::clone(&word);
        let waiter = std::thread::spawn(move || {
            let start = Instant::now();
            while w.load(Ordering::SeqCst) == 5 {
                wait_u32(&w, 5, Duration::from_secs(10));
            }
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        word.fetch_add(1, Ordering::SeqCst);
        wake_one_u32(&word);
        assert!(waiter.join().unwrap() < Duration::from_secs(5));
    }
}
