//! Waiting on an 8-byte word of region memory, shared by every process that maps the memory
//! (the daemon serving `WaitChange`, programs with the segment mapped): a futex on the word's
//! low 32 bits (its first 4 bytes, little endian). Whoever changes a word with an atomic that
//! waiters may watch calls [`wake`]; [`wait`] returns on a wake, when the low half no longer
//! equals the expected value, or at the timeout, so callers always re-read the whole word.
//!
//! The futexes are shared (not process-private): processes mapping the same memfd meet on the
//! same page.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Sleeps while the low 32 bits of `word` equal those of `expected`, at most `timeout` (a
/// wake, a signal or a changed word ends it sooner).
pub fn wait(word: &AtomicU64, expected: u64, timeout: Duration) {
    wait_at(word.as_ptr() as usize, expected, timeout);
}

/// [`wait`] on the word at address `addr`, which need not be mapped any more: the kernel
/// reads it (`EFAULT` ends the wait at once), this process never does.
pub fn wait_at(addr: usize, expected: u64, timeout: Duration) {
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
            expected as u32,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every waiter of `word` (in any process mapping it).
pub fn wake(word: &AtomicU64) {
    // SAFETY: as in `wait`; FUTEX_WAKE reads nothing and only uses the address as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr().cast::<u32>(),
            libc::FUTEX_WAKE,
            i32::MAX,
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
}
