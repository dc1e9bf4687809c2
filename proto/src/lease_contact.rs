//! How long the manager has been silent to a component that holds (or acts under) a host's
//! lease: the daemon and the mount of a host fence themselves once the manager has not
//! answered for most of a lease, since by the time the lease ends there the manager fences
//! the host and hands what it held to others (docs/SEMANTICS.md, "Partitions and fencing").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The share of the lease after which a silent manager means "fence yourself": three quarters,
/// so that one slow answer (the manager is asked every quarter or third of a lease) is no
/// fence, and the fence is in place a quarter lease before the manager's.
pub fn fence_after(lease: Duration) -> Duration {
    lease * 3 / 4
}

/// When the manager last answered, and its lease (lock-free: read on data paths).
#[derive(Debug)]
pub struct LeaseContact {
    since: Instant,
    /// Milliseconds after `since` of the last answer.
    last_ms: AtomicU64,
    /// The manager's lease in ms (0: not heard yet).
    lease_ms: AtomicU64,
}

impl Default for LeaseContact {
    fn default() -> Self {
        LeaseContact::new()
    }
}

impl LeaseContact {
    /// Nothing heard yet.
    pub fn new() -> LeaseContact {
        LeaseContact {
            since: Instant::now(),
            last_ms: AtomicU64::new(0),
            lease_ms: AtomicU64::new(0),
        }
    }

    /// The manager answered now; its lease is `lease`.
    pub fn heard(&self, lease: Duration) {
        self.last_ms
            .store(self.since.elapsed().as_millis() as u64, Ordering::Release);
        self.lease_ms
            .store(lease.as_millis().max(1) as u64, Ordering::Release);
    }

    /// The lease, once the manager has answered.
    pub fn lease(&self) -> Option<Duration> {
        match self.lease_ms.load(Ordering::Acquire) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// How long the manager has been silent, with the lease (`None` before it answered).
    pub fn silence(&self) -> Option<(Duration, Duration)> {
        let lease = self.lease()?;
        let now = self.since.elapsed().as_millis() as u64;
        let silent = now.saturating_sub(self.last_ms.load(Ordering::Acquire));
        Some((Duration::from_millis(silent), lease))
    }

    /// `Some((silence, lease))` once the manager has been silent for [`fence_after`] the lease.
    pub fn out_of_touch(&self) -> Option<(Duration, Duration)> {
        self.silence()
            .filter(|(silent, lease)| *silent >= fence_after(*lease))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_touch_after_three_quarters_of_the_lease() {
        let c = LeaseContact::new();
        assert_eq!(c.silence(), None, "nothing heard: no lease, no fence");
        assert_eq!(c.out_of_touch(), None);
        c.heard(Duration::from_millis(80));
        assert_eq!(c.lease(), Some(Duration::from_millis(80)));
        assert_eq!(c.out_of_touch(), None);
        std::thread::sleep(Duration::from_millis(70));
        let (silent, lease) = c.out_of_touch().expect("silent for 70 of 80 ms");
        assert!(silent >= Duration::from_millis(60) && lease == Duration::from_millis(80));
        c.heard(Duration::from_millis(80));
        assert_eq!(c.out_of_touch(), None, "heard again");
    }
}
