//! The capability clock and the revocations in force (docs/ARCHITECTURE.md,
//! "Capabilities"): token lifetimes, the strictly increasing tick every token's issue time and
//! every revocation epoch is taken from, and the newest revocation of each region (and fence
//! of each host) kept until the tokens it ends have expired. Plain data below the manager's
//! state; [`crate::capability`] revokes and mints.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use regions_proto::capability::now_ms;
use regions_proto::v1;

/// Default lifetime of a token (the manager's `--capability-ttl-secs`); holders renew at half
/// of it.
pub const DEFAULT_TTL: Duration = Duration::from_secs(600);
/// The longest lifetime accepted (a day).
pub const MAX_TTL: Duration = Duration::from_secs(86_400);

/// The capability clock: the wall clock in nanoseconds, made strictly increasing.
pub fn tick() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = wall.max(last + 1);
        match LAST.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// The revocation of every region's tokens issued before `before` (a tick taken when this
/// manager run began): sent to each daemon that registers, so that tokens of an earlier run
/// (whose per-region epochs this run does not know) are renewed against this run's
/// permissions.
pub fn revoke_all(before: u64, ttl: Duration) -> v1::RegionRevoked {
    v1::RegionRevoked {
        ino: 0,
        before,
        until_ms: now_ms() + ttl.as_millis() as u64,
        host: 0,
    }
}

/// The newest revocation of each region in this manager run, kept until its tokens have
/// expired.
#[derive(Clone, Debug, Default)]
pub struct RevokedRegions {
    /// By (region, host): a region's revocations name no host (0), a host's fence no region.
    by_region: HashMap<(u64, u32), v1::RegionRevoked>,
    /// Size at which expired entries are dropped next (amortised: doubles).
    prune_at: usize,
}

impl RevokedRegions {
    /// Least `prune_at`.
    const PRUNE_MIN: usize = 1024;

    /// The revocation in force for `ino`, if any.
    pub fn get(&self, ino: u64) -> Option<&v1::RegionRevoked> {
        self.by_region
            .get(&(ino, 0))
            .filter(|r| r.until_ms > now_ms())
    }

    /// Records `r`, dropping expired entries now and then.
    pub fn insert(&mut self, r: v1::RegionRevoked) {
        if self.by_region.len() >= self.prune_at.max(Self::PRUNE_MIN) {
            let now = now_ms();
            self.by_region.retain(|_, e| e.until_ms > now);
            self.prune_at = (2 * self.by_region.len()).max(Self::PRUNE_MIN);
        }
        self.by_region.insert((r.ino, r.host), r);
    }

    /// Every revocation still in force.
    pub fn current(&self) -> Vec<v1::RegionRevoked> {
        let now = now_ms();
        self.by_region
            .values()
            .filter(|r| r.until_ms > now)
            .copied()
            .collect()
    }

    /// Entries held (expired ones included until the next prune).
    pub fn len(&self) -> usize {
        self.by_region.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.by_region.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revocations_are_kept_until_their_tokens_expire() {
        let mut r = RevokedRegions::default();
        let live = |ino, until_ms| v1::RegionRevoked {
            ino,
            before: tick(),
            until_ms,
            host: 0,
        };
        r.insert(live(1, now_ms() + 60_000));
        r.insert(live(2, 1));
        assert!(r.get(1).is_some() && r.get(2).is_none());
        assert_eq!(r.current().len(), 1);
        for ino in 10..10 + RevokedRegions::PRUNE_MIN as u64 {
            r.insert(live(ino, 1));
        }
        // The expired ones went at the prune; the live one stayed.
        assert!(r.len() < RevokedRegions::PRUNE_MIN);
        assert!(r.get(1).is_some());
    }
}
