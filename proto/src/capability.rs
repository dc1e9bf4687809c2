//! Transport capabilities (docs/ARCHITECTURE.md, "Capabilities"): a token bound to (region,
//! offset range, rights, expiry) that the manager mints when a caller opens a region and daemons
//! verify on the transport, so an application can reach the pool memory of the regions it opened
//! and nothing else, without ever holding the cluster secret.
//!
//! A token is 80 bytes, little-endian:
//!
//! | off | field     | type | notes                                                 |
//! |-----|-----------|------|-------------------------------------------------------|
//! | 0   | version   | u8   | [`TOKEN_VERSION`]                                     |
//! | 1   | rights    | u8   | [`RIGHT_READ`] \| [`RIGHT_WRITE`]                     |
//! | 2   | reserved  | 2 B  | must be 0                                             |
//! | 4   | host      | u32  | the caller's host (0: none); fences revoke per host   |
//! | 8   | ino       | u64  | the region                                            |
//! | 16  | expires   | u64  | Unix time in milliseconds                             |
//! | 24  | issued    | u64  | the manager's capability clock when minted (unique)   |
//! | 32  | offset    | u64  | first region byte reached                             |
//! | 40  | len       | u64  | bytes reached from `offset` ([`WHOLE_REGION`]: all)   |
//! | 48  | mac       | 32 B | HMAC-SHA256 of bytes 0..48 under the capability key    |
//!
//! The capability key is derived from the cluster secret, which the manager and the daemons
//! share; a token cannot be forged or altered without it. Tokens expire (minutes), and renewal
//! asks the manager again, which re-checks permissions. They are also revoked: a `chmod`,
//! `chown`, unlink or shrinking truncate of a region makes the manager tell the daemons holding
//! it to refuse that region's tokens issued before the change (an epoch on the `issued` clock;
//! `RegionRevoked` events in `cluster.proto`). When a host's lease ends, the manager fences it
//! the same way: every token minted for a caller on that host before the lease ended is refused
//! (a `RegionRevoked` naming the host), so a process behind a partition cannot act on the
//! cluster's memory any more (docs/SEMANTICS.md, "Partitions and fencing").

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::auth::Secret;

/// Encoded size of a token.
pub const TOKEN_LEN: usize = 80;
/// The token format this build speaks (3: with the caller's host).
pub const TOKEN_VERSION: u8 = 3;
/// `len` of a token that reaches every byte of its region, however large it grows.
pub const WHOLE_REGION: u64 = u64::MAX;
/// The holder may read the region's memory.
pub const RIGHT_READ: u8 = 1;
/// The holder may write the region's memory (write, vector write, CAS, fetch-add).
pub const RIGHT_WRITE: u8 = 2;
/// Bytes covered by the MAC.
const BODY_LEN: usize = 48;
/// Domain separation of the key derivation.
const KEY_LABEL: &[u8] = b"regions transport capability key v1";

type HmacSha256 = Hmac<Sha256>;

/// Why a presented token is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CapabilityError {
    /// The token is not 64 bytes or has unknown version / reserved bits.
    #[error("malformed capability token: {0}")]
    Malformed(String),
    /// The MAC does not match: forged, altered, or minted with another cluster secret.
    #[error(
        "capability token was not minted by this cluster (bad MAC): open the region again \
         through the host agent"
    )]
    BadMac,
    /// The token's expiry has passed.
    #[error("capability for region {ino} expired {ago_ms} ms ago: renew it through the host agent")]
    Expired {
        /// The region.
        ino: u64,
        /// How long ago it expired.
        ago_ms: u64,
    },
}

/// What a token grants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capability {
    /// The region.
    pub ino: u64,
    /// [`RIGHT_READ`] | [`RIGHT_WRITE`] bits.
    pub rights: u8,
    /// Expiry, Unix time in milliseconds.
    pub expires_ms: u64,
    /// The manager's capability clock when the token was minted: unique per token, and
    /// compared with revocation epochs.
    pub issued: u64,
    /// First region byte the token reaches.
    pub offset: u64,
    /// Bytes it reaches from `offset` ([`WHOLE_REGION`]: every byte).
    pub len: u64,
    /// The host of the caller it was minted for (0: none, e.g. the manager's own).
    pub host: u32,
}

impl Capability {
    /// Whether the token allows writes.
    pub fn can_write(&self) -> bool {
        self.rights & RIGHT_WRITE != 0
    }

    /// Whether the token allows reads.
    pub fn can_read(&self) -> bool {
        self.rights & RIGHT_READ != 0
    }

    /// `Err(Expired)` once `now_ms` has reached the expiry.
    pub fn check_time(&self, now_ms: u64) -> Result<(), CapabilityError> {
        if now_ms >= self.expires_ms {
            return Err(CapabilityError::Expired {
                ino: self.ino,
                ago_ms: now_ms - self.expires_ms,
            });
        }
        Ok(())
    }

    /// Whether the region bytes `[offset, offset + len)` lie within the token's range.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        if self.len == WHOLE_REGION {
            return offset >= self.offset;
        }
        let Some(end) = offset.checked_add(len) else {
            return false;
        };
        offset >= self.offset && end <= self.offset.saturating_add(self.len)
    }

    fn body(&self) -> [u8; BODY_LEN] {
        let mut b = [0u8; BODY_LEN];
        b[0] = TOKEN_VERSION;
        b[1] = self.rights;
        b[4..8].copy_from_slice(&self.host.to_le_bytes());
        b[8..16].copy_from_slice(&self.ino.to_le_bytes());
        b[16..24].copy_from_slice(&self.expires_ms.to_le_bytes());
        b[24..32].copy_from_slice(&self.issued.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads a token's fields without checking its MAC (clients use it to learn the expiry of
    /// a token they were handed; only the key holder can tell whether it is genuine).
    pub fn decode_unverified(token: &[u8]) -> Result<Capability, CapabilityError> {
        if token.len() != TOKEN_LEN {
            return Err(CapabilityError::Malformed(format!(
                "{} bytes, expected {TOKEN_LEN}",
                token.len()
            )));
        }
        if token[0] != TOKEN_VERSION {
            return Err(CapabilityError::Malformed(format!(
                "version {}, this build speaks {TOKEN_VERSION}",
                token[0]
            )));
        }
        if token[2..4].iter().any(|&b| b != 0) {
            return Err(CapabilityError::Malformed(
                "reserved bytes are not 0".into(),
            ));
        }
        let rights = token[1];
        if rights & !(RIGHT_READ | RIGHT_WRITE) != 0 {
            return Err(CapabilityError::Malformed(format!(
                "unknown rights {rights:#x}"
            )));
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&token[at..at + 8]);
            u64::from_le_bytes(w)
        };
        Ok(Capability {
            ino: word(8),
            rights,
            expires_ms: word(16),
            issued: word(24),
            offset: word(32),
            len: word(40),
            host: u32::from_le_bytes([token[4], token[5], token[6], token[7]]),
        })
    }
}

/// Why a token is refused although genuine: revoked by a change to its region.
pub fn revoked_message(cap: &Capability) -> String {
    format!(
        "the capability for region {} was revoked (its mode, owner, names or size changed, or \
         the manager restarted): open the region again (the regions library renews it by \
         itself), which checks permission again",
        cap.ino
    )
}

/// Why a token is refused although genuine: its host's lease ended (the host is fenced).
pub fn fenced_message(cap: &Capability) -> String {
    format!(
        "the capability for region {} is refused: the lease of host {}, which it was minted \
         for, ended (the host lost the manager), so the manager may have given this host's \
         locks and handles to others; open the region again once the host is back",
        cap.ino, cap.host
    )
}

/// The key that mints and verifies tokens (derived from the cluster secret).
#[derive(Clone)]
pub struct CapabilityKey([u8; 32]);

impl std::fmt::Debug for CapabilityKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CapabilityKey(..)")
    }
}

impl CapabilityKey {
    /// The key of the cluster whose secret is `secret`.
    pub fn from_secret(secret: &Secret) -> CapabilityKey {
        let mut mac = secret.hmac();
        mac.update(KEY_LABEL);
        CapabilityKey(mac.finalize().into_bytes().into())
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).unwrap_or_else(|_| unreachable_hmac())
    }

    /// Encodes and signs `cap`.
    pub fn mint(&self, cap: &Capability) -> Vec<u8> {
        let body = cap.body();
        let mut mac = self.mac();
        mac.update(&body);
        let tag = mac.finalize().into_bytes();
        let mut token = Vec::with_capacity(TOKEN_LEN);
        token.extend_from_slice(&body);
        token.extend_from_slice(&tag);
        token
    }

    /// Checks the token's form and MAC (constant time) and returns what it grants. The expiry
    /// is not checked here: see [`Capability::check_time`].
    pub fn verify(&self, token: &[u8]) -> Result<Capability, CapabilityError> {
        let cap = Capability::decode_unverified(token)?;
        let mut mac = self.mac();
        mac.update(&token[..BODY_LEN]);
        mac.verify_slice(&token[BODY_LEN..])
            .map_err(|_| CapabilityError::BadMac)?;
        Ok(cap)
    }
}

/// HMAC-SHA256 accepts keys of any length, so key setup cannot fail.
#[cold]
fn unreachable_hmac() -> HmacSha256 {
    // A zero-length key is valid for HMAC; this path is never taken.
    HmacSha256::new_from_slice(&[0u8; 32]).unwrap_or_else(|_| std::process::abort())
}

/// Now as Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> CapabilityKey {
        CapabilityKey::from_secret(&Secret::new(s).unwrap())
    }

    fn cap() -> Capability {
        Capability {
            ino: 42,
            rights: RIGHT_READ | RIGHT_WRITE,
            expires_ms: 1_000_000,
            issued: 7,
            offset: 0,
            len: WHOLE_REGION,
            host: 3,
        }
    }

    #[test]
    fn mint_verify_round_trip() {
        let k = key("secret");
        let token = k.mint(&cap());
        assert_eq!(token.len(), TOKEN_LEN);
        assert_eq!(k.verify(&token), Ok(cap()));
        assert_eq!(Capability::decode_unverified(&token), Ok(cap()));
        assert!(cap().can_write() && cap().can_read());
    }

    #[test]
    fn altered_or_foreign_tokens_are_refused() {
        let k = key("secret");
        let token = k.mint(&cap());
        assert_eq!(key("other").verify(&token), Err(CapabilityError::BadMac));
        // Flip each body and MAC byte in turn (rights, host, ino, expiry, issued, range, tag).
        for i in [1usize, 4, 7, 8, 16, 23, 24, 32, 40, 47, 48, 79] {
            let mut bad = token.clone();
            bad[i] ^= 1;
            assert!(k.verify(&bad).is_err(), "byte {i}");
        }
        // Upgrading a read-only token to write is caught by the MAC.
        let ro = Capability {
            rights: RIGHT_READ,
            ..cap()
        };
        let mut t = k.mint(&ro);
        t[1] = RIGHT_READ | RIGHT_WRITE;
        assert_eq!(k.verify(&t), Err(CapabilityError::BadMac));
    }

    #[test]
    fn malformed_tokens_are_refused() {
        let k = key("secret");
        assert!(matches!(
            k.verify(&[0u8; 10]),
            Err(CapabilityError::Malformed(_))
        ));
        let mut t = k.mint(&cap());
        t[0] = 9;
        assert!(matches!(k.verify(&t), Err(CapabilityError::Malformed(_))));
        let mut t = k.mint(&cap());
        t[3] = 1;
        assert!(matches!(k.verify(&t), Err(CapabilityError::Malformed(_))));
        let mut t = k.mint(&cap());
        t[1] = 0x80;
        assert!(matches!(k.verify(&t), Err(CapabilityError::Malformed(_))));
    }

    #[test]
    fn ranges() {
        let whole = cap();
        assert!(whole.covers(0, 1) && whole.covers(u64::MAX - 8, 8));
        let word = Capability {
            offset: 64,
            len: 8,
            ..cap()
        };
        assert!(word.covers(64, 8) && word.covers(68, 4));
        assert!(!word.covers(60, 8) && !word.covers(64, 9) && !word.covers(72, 1));
        assert!(!word.covers(u64::MAX, 2));
        // The range is part of what the MAC covers.
        let k = key("secret");
        let mut t = k.mint(&word);
        t[40] = 0xff;
        assert_eq!(k.verify(&t), Err(CapabilityError::BadMac));
    }

    #[test]
    fn expiry() {
        let c = cap();
        assert!(c.check_time(999_999).is_ok());
        assert_eq!(
            c.check_time(1_000_005),
            Err(CapabilityError::Expired { ino: 42, ago_ms: 5 })
        );
        assert!(now_ms() > 1_600_000_000_000);
    }
}
