//! Capability revocations this daemon enforces (docs/SECURITY.md, "Capabilities"): per region,
//! the epoch before which its tokens are refused, and one epoch for every region (the start
//! of the manager's run). The manager sends them as `Revoked` events after a `chmod`, `chown`,
//! the loss of an open region's last name or a shrinking truncate, and in its registration reply; it waits for the
//! daemon to apply them before the change returns.
//!
//! An entry is dropped once every token it revokes has expired (`until_ms`; expired entries go
//! whenever the table has doubled since the last sweep), so the table holds about the regions
//! changed within one token lifetime.

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU32, Ordering};

use regions_proto::capability::{Capability, now_ms};

/// Most entries kept; past it, expired ones are dropped first, then the oldest revocations
/// widen to a revocation of every region (stricter, never looser).
const MAX_ENTRIES: usize = 1 << 20;

#[derive(Clone, Copy, Debug)]
struct Epoch {
    before: u64,
    until_ms: u64,
}

#[derive(Debug, Default)]
struct Table {
    per_region: HashMap<u64, Epoch>,
    all: Option<Epoch>,
    /// Fences: per host whose lease ended, the epoch before which tokens minted for callers on
    /// it are refused (a handful of entries: one per host).
    per_host: HashMap<u32, Epoch>,
    /// Size at which expired entries are dropped next (amortised: doubles).
    prune_at: usize,
}

/// Least `Table::prune_at`.
const PRUNE_MIN: usize = 1024;

/// Called after every change to the revocations in force (see [`Revocations::on_change`]).
pub type Listener = Box<dyn Fn(&Revocations) + Send + Sync>;

/// The revocations in force.
#[derive(Default)]
pub struct Revocations {
    /// Told of every change, after it is in force (the RDMA memory windows bound for
    /// capabilities are dropped there).
    listener: std::sync::OnceLock<Listener>,
    table: RwLock<Table>,
    /// This daemon's own host while it has gone a lease without reaching the manager (0: not
    /// fenced): the manager may have fenced it by now, so the tokens minted for it are refused
    /// here too until it has registered again and applied the manager's fences.
    fenced_self: AtomicU32,
}

impl std::fmt::Debug for Revocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Revocations")
            .field("table", &self.table)
            .field("fenced_self", &self.fenced_self)
            .field("listener", &self.listener.get().is_some())
            .finish()
    }
}

impl Revocations {
    /// No revocation yet.
    pub fn new() -> Revocations {
        Revocations::default()
    }

    /// Calls `listener` after every change from now on, before the change's caller goes on
    /// (the manager waits for a revocation to be applied). One listener; a second is ignored
    /// (returns false).
    pub fn on_change(&self, listener: Listener) -> bool {
        self.listener.set(listener).is_ok()
    }

    fn changed(&self) {
        if let Some(l) = self.listener.get() {
            l(self);
        }
    }

    /// Refuses every token minted for `host` (this daemon's own) until [`Self::unfence_self`]:
    /// the daemon has not reached the manager for most of a lease.
    pub fn fence_self(&self, host: u32) {
        self.fenced_self.store(host, Ordering::Release);
        self.changed();
    }

    /// Ends [`Self::fence_self`]: the daemon registered again (and applied the manager's
    /// fences, which now refuse the old tokens), or the manager answered a heartbeat (so it
    /// never took the lease).
    pub fn unfence_self(&self) {
        self.fenced_self.store(0, Ordering::Release);
    }

    /// Whether [`Self::fence_self`] is in force.
    pub fn self_fenced(&self) -> bool {
        self.fenced_self.load(Ordering::Acquire) != 0
    }

    /// Applies a `RegionRevoked` from the manager: a host's fence when it names a host, else
    /// a region's revocation (of every region for region 0).
    pub fn apply(&self, r: &regions_proto::v1::RegionRevoked) {
        if r.host != 0 {
            self.fence_host(r.host, r.before, r.until_ms);
        } else {
            self.revoke(r.ino, r.before, r.until_ms);
        }
    }

    /// Refuses tokens minted for callers on `host` (of any region) issued before `before`,
    /// until `until_ms`: the host's lease ended, and its processes are fenced.
    pub fn fence_host(&self, host: u32, before: u64, until_ms: u64) {
        let mut t = self
            .table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let new = Epoch { before, until_ms };
        let now = now_ms();
        t.per_host.retain(|_, e| e.until_ms > now);
        let e = t.per_host.entry(host).or_insert(new);
        *e = merge(*e, new);
        drop(t);
        self.changed();
    }

    /// Refuses tokens of `ino` (0: of every region) issued before `before`, until `until_ms`.
    /// Epochs only move forward.
    pub fn revoke(&self, ino: u64, before: u64, until_ms: u64) {
        self.revoke_in_table(ino, before, until_ms);
        self.changed();
    }

    fn revoke_in_table(&self, ino: u64, before: u64, until_ms: u64) {
        let mut t = self
            .table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let new = Epoch { before, until_ms };
        let slot = if ino == 0 {
            &mut t.all
        } else {
            if t.per_region.len() >= t.prune_at.max(PRUNE_MIN) {
                let now = now_ms();
                t.per_region.retain(|_, e| e.until_ms > now);
                t.prune_at = (2 * t.per_region.len()).max(PRUNE_MIN);
            }
            if t.per_region.len() >= MAX_ENTRIES && !t.per_region.contains_key(&ino) {
                Self::make_room(&mut t);
            }
            let e = t.per_region.entry(ino).or_insert(new);
            *e = merge(*e, new);
            return;
        };
        *slot = Some(slot.map_or(new, |old| merge(old, new)));
    }

    /// Drops expired entries, and if that is not enough, folds every entry into the
    /// all-regions epoch.
    fn make_room(t: &mut Table) {
        let now = now_ms();
        t.per_region.retain(|_, e| e.until_ms > now);
        if t.per_region.len() < MAX_ENTRIES {
            return;
        }
        tracing::warn!(
            entries = t.per_region.len(),
            "too many capability revocations at once: revoking every region's tokens"
        );
        let folded = t.per_region.drain().map(|(_, e)| e).reduce(merge);
        if let Some(e) = folded {
            t.all = Some(t.all.map_or(e, |old| merge(old, e)));
        }
    }

    /// Whether `cap` was revoked (and has not expired since; the caller checks expiry).
    pub fn revoked(&self, cap: &Capability) -> bool {
        let t = self
            .table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = |e: Option<&Epoch>| e.is_some_and(|e| cap.issued < e.before);
        before(t.all.as_ref()) || before(t.per_region.get(&cap.ino)) || self.host_fenced(&t, cap)
    }

    /// Whether `cap` was refused by its host's fence (rather than by a change to its region).
    pub fn fenced(&self, cap: &Capability) -> bool {
        let t = self
            .table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.host_fenced(&t, cap)
    }

    /// Whether the host `cap` was minted for is fenced: by the manager before `cap` was
    /// issued, or by this daemon itself (it is this daemon's host, out of touch).
    fn host_fenced(&self, t: &Table, cap: &Capability) -> bool {
        cap.host != 0
            && (t
                .per_host
                .get(&cap.host)
                .is_some_and(|e| cap.issued < e.before)
                || cap.host == self.fenced_self.load(Ordering::Acquire))
    }

    /// Revocations held for single regions.
    pub fn len(&self) -> usize {
        self.table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .per_region
            .len()
    }

    /// Whether no single region has a revocation.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn merge(a: Epoch, b: Epoch) -> Epoch {
    Epoch {
        before: a.before.max(b.before),
        until_ms: a.until_ms.max(b.until_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regions_proto::capability::{RIGHT_READ, WHOLE_REGION};

    fn cap(ino: u64, issued: u64) -> Capability {
        Capability {
            ino,
            rights: RIGHT_READ,
            expires_ms: u64::MAX,
            issued,
            offset: 0,
            len: WHOLE_REGION,
            host: 0,
        }
    }

    #[test]
    fn a_fenced_host_loses_the_tokens_minted_for_it_before_the_fence() {
        let r = Revocations::new();
        let on = |host, issued| Capability {
            host,
            ..cap(5, issued)
        };
        r.apply(&regions_proto::v1::RegionRevoked {
            ino: 0,
            before: 100,
            until_ms: u64::MAX,
            host: 3,
        });
        assert!(r.revoked(&on(3, 99)) && r.fenced(&on(3, 99)));
        // Tokens minted after the fence (the host registered again), for other hosts, or for
        // no host stay good; the fence is no region's revocation.
        assert!(!r.revoked(&on(3, 100)) && !r.fenced(&on(3, 100)));
        assert!(!r.revoked(&on(2, 99)) && !r.revoked(&on(0, 99)));
        assert!(r.is_empty());
        // Fences only move forward.
        r.fence_host(3, 50, u64::MAX);
        assert!(r.revoked(&on(3, 99)));
        // A daemon out of touch with the manager refuses its own host's tokens until it
        // registers again.
        r.fence_self(2);
        assert!(r.revoked(&on(2, u64::MAX)) && r.fenced(&on(2, u64::MAX)) && r.self_fenced());
        assert!(!r.revoked(&on(4, 1)) && !r.revoked(&on(0, 1)));
        r.unfence_self();
        assert!(!r.revoked(&on(2, 1)) && !r.self_fenced());
        // An expired fence goes at the next one.
        r.fence_host(4, 10, 1);
        r.fence_host(5, 10, u64::MAX);
        assert!(!r.revoked(&on(4, 5)));
    }

    #[test]
    fn tokens_issued_before_the_epoch_are_refused() {
        let r = Revocations::new();
        assert!(!r.revoked(&cap(5, 10)));
        r.revoke(5, 20, u64::MAX);
        assert!(r.revoked(&cap(5, 10)) && r.revoked(&cap(5, 19)));
        assert!(!r.revoked(&cap(5, 20)) && !r.revoked(&cap(6, 10)));
        // Epochs never move back.
        r.revoke(5, 15, u64::MAX);
        assert!(r.revoked(&cap(5, 19)));
        // Every region.
        r.revoke(0, 12, u64::MAX);
        assert!(r.revoked(&cap(6, 11)) && !r.revoked(&cap(6, 12)));
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn a_full_table_drops_expired_entries_then_widens() {
        let r = Revocations::new();
        // Fills the table to the cap with epoch 100, each entry expiring as `until` says.
        let fill = |until: fn(u64) -> u64| {
            let mut t = r.table.write().unwrap();
            for ino in 1..=MAX_ENTRIES as u64 {
                let until_ms = until(ino);
                t.per_region.insert(
                    ino,
                    Epoch {
                        before: 100,
                        until_ms,
                    },
                );
            }
        };
        fill(|ino| if ino % 2 == 0 { 0 } else { u64::MAX });
        r.revoke(u64::MAX, 50, u64::MAX);
        // The expired half went; the rest stayed exact.
        assert_eq!(r.len(), MAX_ENTRIES / 2 + 1);
        assert!(r.revoked(&cap(1, 99)) && !r.revoked(&cap(2, 99)));
        fill(|_| u64::MAX);
        r.revoke(u64::MAX - 1, 50, u64::MAX);
        // Nothing expired: folded into one epoch for all, which refuses at least as much.
        assert!(r.len() <= 1);
        assert!(r.revoked(&cap(2, 99)) && r.revoked(&cap(777, 99)));
    }
}
