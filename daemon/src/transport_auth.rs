//! Who a transport connection speaks for (docs/ARCHITECTURE.md, "Capabilities"): a node
//! component that presented the cluster secret may touch any pool range; an application that presented
//! capabilities may touch only chunks of the regions they name, with their rights, until they
//! expire.
//!
//! A HELLO with `capability = 0` in its header carries the cluster secret; one with a nonzero
//! `capability` carries a token, stored under that id for the connection (a later HELLO with
//! the same id renews it). Every other request names in its header the capability id it uses.

use std::collections::HashMap;

use regions_proto::auth::Secret;
use regions_proto::capability::{Capability, CapabilityKey, now_ms};
use regions_proto::frame::{Header, Op};

/// Most capabilities one connection may hold.
pub const MAX_CAPABILITIES: usize = 256;

/// The authentication state of one connection.
#[derive(Debug, Default)]
pub struct ConnAuth {
    secret: bool,
    caps: HashMap<u64, Capability>,
}

/// What a request may touch once authorized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Any range (cluster secret).
    Any,
    /// Only chunks backing this region.
    Region(u64),
}

impl Reach {
    /// Whether pinned chunks are within reach (`backed_by(ino)` tells whether all back `ino`).
    pub fn allows(self, backed_by: impl FnOnce(u64) -> bool) -> bool {
        match self {
            Reach::Any => true,
            Reach::Region(ino) => backed_by(ino),
        }
    }
}

/// Text of refusals for ranges outside a capability.
pub const OUT_OF_REACH: &str =
    "the range lies outside the region of the presented capability: open that region first";

fn writes(op: Op) -> bool {
    matches!(op, Op::Write | Op::WriteV | Op::Cas | Op::FetchAdd)
}

impl ConnAuth {
    /// Whether anything valid has been presented.
    pub fn is_authenticated(&self) -> bool {
        self.secret || !self.caps.is_empty()
    }

    /// Takes in a HELLO: the cluster secret (`id` 0) or a capability token stored as `id`.
    pub fn present(
        &mut self,
        secret: &Secret,
        key: &CapabilityKey,
        id: u64,
        token: &[u8],
    ) -> Result<(), String> {
        if id == 0 {
            if !secret.matches(token) {
                return Err(
                    "wrong cluster secret: use the same --secret-file as the manager".into(),
                );
            }
            self.secret = true;
            return Ok(());
        }
        let cap = key.verify(token).map_err(|e| e.to_string())?;
        cap.check_time(now_ms()).map_err(|e| e.to_string())?;
        if !self.caps.contains_key(&id) && self.caps.len() >= MAX_CAPABILITIES {
            return Err(format!(
                "too many capabilities on one connection (at most {MAX_CAPABILITIES}): \
                 open another connection"
            ));
        }
        self.caps.insert(id, cap);
        Ok(())
    }

    /// Decides a request (not HELLO): what it may touch, or why it is refused (`EACCES`).
    pub fn authorize(&self, h: &Header) -> Result<Reach, String> {
        if self.secret {
            return Ok(Reach::Any);
        }
        if h.op == Op::Ping {
            return Ok(Reach::Any);
        }
        let cap = self.caps.get(&h.capability).ok_or_else(|| {
            format!(
                "capability {} was not presented on this connection (send HELLO with it first)",
                h.capability
            )
        })?;
        cap.check_time(now_ms()).map_err(|e| e.to_string())?;
        if writes(h.op) && !cap.can_write() {
            return Err(format!(
                "{} refused: the capability for region {} is read-only (the region was opened \
                 for reading)",
                h.op, cap.ino
            ));
        }
        if !writes(h.op) && !cap.can_read() {
            return Err(format!(
                "{} refused: the capability for region {} does not allow reading",
                h.op, cap.ino
            ));
        }
        Ok(Reach::Region(cap.ino))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regions_proto::capability::{RIGHT_READ, RIGHT_WRITE};

    fn setup() -> (Secret, CapabilityKey) {
        let s = Secret::new("cluster").unwrap();
        let k = CapabilityKey::from_secret(&s);
        (s, k)
    }

    fn token(k: &CapabilityKey, ino: u64, rights: u8, ttl_ms: i64) -> Vec<u8> {
        k.mint(&Capability {
            ino,
            rights,
            expires_ms: (now_ms() as i64 + ttl_ms) as u64,
            nonce: 1,
        })
    }

    fn req(op: Op, cap: u64) -> Header {
        let mut h = Header::new(op, 1);
        h.capability = cap;
        h
    }

    #[test]
    fn secret_reaches_everything() {
        let (s, k) = setup();
        let mut a = ConnAuth::default();
        assert!(!a.is_authenticated());
        assert!(a.present(&s, &k, 0, b"wrong").is_err());
        a.present(&s, &k, 0, b"cluster").unwrap();
        assert_eq!(a.authorize(&req(Op::Write, 0)), Ok(Reach::Any));
    }

    #[test]
    fn capabilities_bind_region_rights_and_time() {
        let (s, k) = setup();
        let mut a = ConnAuth::default();
        a.present(&s, &k, 1, &token(&k, 10, RIGHT_READ, 60_000))
            .unwrap();
        a.present(&s, &k, 2, &token(&k, 11, RIGHT_READ | RIGHT_WRITE, 60_000))
            .unwrap();
        assert_eq!(a.authorize(&req(Op::Read, 1)), Ok(Reach::Region(10)));
        assert_eq!(a.authorize(&req(Op::ReadV, 2)), Ok(Reach::Region(11)));
        for op in [Op::Write, Op::WriteV, Op::Cas, Op::FetchAdd] {
            assert!(a.authorize(&req(op, 1)).unwrap_err().contains("read-only"));
            assert_eq!(a.authorize(&req(op, 2)), Ok(Reach::Region(11)));
        }
        assert!(a.authorize(&req(Op::Read, 3)).is_err(), "unknown id");
        assert!(
            a.authorize(&req(Op::Read, 0)).is_err(),
            "id 0 without the secret"
        );
        assert!(!Reach::Region(10).allows(|ino| ino == 11));
        assert!(Reach::Region(10).allows(|ino| ino == 10));
        // Expired tokens are refused when presented, and once they expire.
        assert!(
            a.present(&s, &k, 3, &token(&k, 10, RIGHT_READ, -1))
                .unwrap_err()
                .contains("expired")
        );
        let mut b = ConnAuth::default();
        b.present(&s, &k, 1, &token(&k, 10, RIGHT_READ, 30))
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(40));
        assert!(
            b.authorize(&req(Op::Read, 1))
                .unwrap_err()
                .contains("expired")
        );
        // Renewal under the same id.
        b.present(&s, &k, 1, &token(&k, 10, RIGHT_READ, 60_000))
            .unwrap();
        assert!(b.authorize(&req(Op::Read, 1)).is_ok());
        // Forged tokens are refused.
        let mut forged = token(&k, 10, RIGHT_READ, 60_000);
        forged[8] = 11;
        assert!(b.present(&s, &k, 4, &forged).is_err());
    }
}
