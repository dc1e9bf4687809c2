//! Minting and revoking transport capabilities (docs/ARCHITECTURE.md, "Capabilities"; the
//! token format is `regions_proto::capability`). The manager signs a token on every open, after
//! its permission check, and on a `GetMap` that asks for renewal; daemons verify it with the same
//! key, derived from the cluster secret.
//!
//! Every token carries its `issued` time on one clock ([`tick`]): strictly increasing within a
//! manager run and starting past the wall clock in nanoseconds, so a later run's tokens are
//! issued after an earlier run's. A change that must end access already granted (`chmod`,
//! `chown`, the loss of an open region's last name, a shrinking truncate) takes a new tick as the region's
//! revocation epoch and sends it to the daemons holding the region ([`State::revoke_capabilities`]):
//! they refuse the region's tokens issued before it, and the holders renew, which checks
//! permission again.

use std::time::Duration;

use regions_proto::auth::Secret;
use regions_proto::capability::{
    Capability, CapabilityKey, RIGHT_READ, RIGHT_WRITE, TOKEN_LEN, WHOLE_REGION, now_ms,
};
use regions_proto::v1;
use regions_proto::v1::host_event::Event;

use crate::model::Kind;
use crate::revocations::{MAX_TTL, tick};
use crate::state::State;

impl State {
    /// Ends access granted to region `ino` before now: the daemons holding its chunks (and
    /// any that receive chunks later in this run) refuse its tokens issued before this call.
    /// Nothing happens for inodes that are not regions.
    pub fn revoke_capabilities(&mut self, ino: u64) {
        if self.inodes.get(&ino).is_none_or(|i| i.kind != Kind::Region) {
            return;
        }
        let revoked = v1::RegionRevoked {
            ino,
            before: tick(),
            until_ms: now_ms().saturating_add(self.capability_ttl.as_millis() as u64),
            host: 0,
        };
        self.revoked.insert(revoked);
        self.revocation_queued = true;
        for host in self.region_hosts(ino) {
            self.events.push((host, Event::Revoked(revoked)));
        }
    }

    /// Fences `host`, whose lease ended: every daemon refuses the tokens minted for callers on
    /// it before this call, so its processes cannot act on the cluster's memory any more (a
    /// mutex holder behind a partition included). Sent to every registered host; daemons that
    /// register later get it with their resync.
    pub fn fence_host(&mut self, host: u32) {
        let fence = v1::RegionRevoked {
            ino: 0,
            before: tick(),
            until_ms: now_ms().saturating_add(self.capability_ttl.as_millis() as u64),
            host,
        };
        self.revoked.insert(fence);
        self.revocation_queued = true;
        let hosts: Vec<u32> = self.hosts.keys().copied().collect();
        for h in hosts {
            self.events.push((h, Event::Revoked(fence)));
        }
    }
}

/// Signs capabilities.
#[derive(Clone, Debug)]
pub struct Minter {
    key: CapabilityKey,
    ttl: Duration,
}

impl Minter {
    /// A minter for the cluster of `secret`, tokens living `ttl`.
    pub fn new(secret: &Secret, ttl: Duration) -> Minter {
        Minter {
            key: CapabilityKey::from_secret(secret),
            ttl: ttl.clamp(Duration::from_secs(1), MAX_TTL),
        }
    }

    /// A token for every byte of region `ino`, writable when `write`, issued at `issued`: a
    /// [`tick`] taken *before* the permission check it rests on, so that a change that
    /// revokes (its epoch taken under the state lock) either precedes the check, which then
    /// sees it, or revokes this token.
    pub fn mint(&self, ino: u64, write: bool, issued: u64, host: u32) -> (Vec<u8>, u64) {
        self.mint_range(ino, write, 0, WHOLE_REGION, issued, host)
    }

    /// A token for region `ino`'s bytes `[offset, offset + len)`, writable when `write`,
    /// issued at `issued` for a caller on `host` (see [`Minter::mint`]).
    pub fn mint_range(
        &self,
        ino: u64,
        write: bool,
        offset: u64,
        len: u64,
        issued: u64,
        host: u32,
    ) -> (Vec<u8>, u64) {
        let expires_ms = now_ms().saturating_add(self.ttl.as_millis() as u64);
        let cap = Capability {
            ino,
            rights: if write {
                RIGHT_READ | RIGHT_WRITE
            } else {
                RIGHT_READ
            },
            expires_ms,
            issued,
            offset,
            len,
            host,
        };
        let token = self.key.mint(&cap);
        debug_assert_eq!(token.len(), TOKEN_LEN);
        (token, expires_ms)
    }

    /// Puts a fresh token for the region of `info` into it, issued at `issued` (a [`tick`]
    /// taken before the permission check) for a caller on `host`.
    pub fn stamp(&self, info: &mut v1::RegionInfo, write: bool, issued: u64, host: u32) {
        let Some(ino) = info.attr.as_ref().map(|a| a.ino) else {
            return;
        };
        let (token, expires) = self.mint(ino, write, issued, host);
        info.capability = token;
        info.capability_expires_ms = expires;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamped_tokens_verify_with_the_daemons_key() {
        let secret = Secret::new("cluster").unwrap();
        let minter = Minter::new(&secret, Duration::from_secs(60));
        let mut info = v1::RegionInfo {
            attr: Some(v1::Attr {
                ino: 9,
                ..Default::default()
            }),
            ..Default::default()
        };
        minter.stamp(&mut info, false, tick(), 2);
        let cap = CapabilityKey::from_secret(&secret)
            .verify(&info.capability)
            .unwrap();
        assert_eq!(cap.ino, 9);
        assert!(!cap.can_write());
        assert_eq!(cap.expires_ms, info.capability_expires_ms);
        assert!(cap.check_time(now_ms()).is_ok());
        assert!(cap.check_time(now_ms() + 61_000).is_err());
        minter.stamp(&mut info, true, tick(), 2);
        let cap = CapabilityKey::from_secret(&secret)
            .verify(&info.capability)
            .unwrap();
        assert!(cap.can_write());
        assert!(cap.covers(0, u64::MAX));
        // Another cluster's daemons refuse it.
        let other = CapabilityKey::from_secret(&Secret::new("other").unwrap());
        assert!(other.verify(&info.capability).is_err());
        // A range token reaches its range only.
        let (token, _) = minter.mint_range(9, true, 128, 64, tick(), 2);
        let cap = CapabilityKey::from_secret(&secret).verify(&token).unwrap();
        assert!(cap.covers(128, 64) && !cap.covers(120, 16) && !cap.covers(190, 8));
    }

    #[test]
    fn the_clock_only_moves_forward() {
        let mut last = tick();
        for _ in 0..10_000 {
            let t = tick();
            assert!(t > last);
            last = t;
        }
    }
}
