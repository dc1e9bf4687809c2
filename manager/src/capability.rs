//! Minting transport capabilities (docs/ARCHITECTURE.md, "Capabilities"; the token format is
//! `regions_proto::capability`). The manager signs a token on every open, after its permission
//! check, and on a `GetMap` that asks for renewal; daemons verify it with the same key, derived
//! from the cluster secret.

use std::time::Duration;

use regions_proto::auth::Secret;
use regions_proto::capability::{
    Capability, CapabilityKey, RIGHT_READ, RIGHT_WRITE, TOKEN_LEN, now_ms,
};
use regions_proto::v1;

/// Default lifetime of a token; holders renew at half of it.
pub const DEFAULT_TTL: Duration = Duration::from_secs(600);
/// Environment variable overriding the lifetime, in seconds (tests use short ones).
pub const TTL_ENV: &str = "REGIONS_CAPABILITY_TTL_SECS";

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
            ttl: ttl.max(Duration::from_secs(1)),
        }
    }

    /// A minter whose lifetime comes from [`TTL_ENV`] (default [`DEFAULT_TTL`]).
    pub fn from_env(secret: &Secret) -> Minter {
        let ttl = std::env::var(TTL_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(DEFAULT_TTL, Duration::from_secs);
        Minter::new(secret, ttl)
    }

    /// A token for region `ino`, writable when `write`.
    pub fn mint(&self, ino: u64, write: bool) -> (Vec<u8>, u64) {
        let expires_ms = now_ms() + self.ttl.as_millis() as u64;
        let cap = Capability {
            ino,
            rights: if write {
                RIGHT_READ | RIGHT_WRITE
            } else {
                RIGHT_READ
            },
            expires_ms,
            nonce: rand::random(),
        };
        let token = self.key.mint(&cap);
        debug_assert_eq!(token.len(), TOKEN_LEN);
        (token, expires_ms)
    }

    /// Puts a fresh token for the region of `info` into it.
    pub fn stamp(&self, info: &mut v1::RegionInfo, write: bool) {
        let Some(ino) = info.attr.as_ref().map(|a| a.ino) else {
            return;
        };
        let (token, expires) = self.mint(ino, write);
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
        minter.stamp(&mut info, false);
        let cap = CapabilityKey::from_secret(&secret)
            .verify(&info.capability)
            .unwrap();
        assert_eq!(cap.ino, 9);
        assert!(!cap.can_write());
        assert_eq!(cap.expires_ms, info.capability_expires_ms);
        assert!(cap.check_time(now_ms()).is_ok());
        assert!(cap.check_time(now_ms() + 61_000).is_err());
        minter.stamp(&mut info, true);
        let cap = CapabilityKey::from_secret(&secret)
            .verify(&info.capability)
            .unwrap();
        assert!(cap.can_write());
        // Another cluster's daemons refuse it.
        let other = CapabilityKey::from_secret(&Secret::new("other").unwrap());
        assert!(other.verify(&info.capability).is_err());
    }
}
