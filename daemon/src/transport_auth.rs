//! Who a transport connection speaks for (docs/ARCHITECTURE.md, "Capabilities"): a node
//! component that presented the cluster secret may touch any pool range; an application that presented
//! capabilities may touch only chunks of the regions they name, with their rights, until they
//! expire.
//!
//! HELLOs with `capability = 0` in their header are the two steps of the cluster-secret
//! challenge–response ([`regions_proto::handshake`]: the secret itself never crosses the
//! network); one with a nonzero `capability` carries a token, stored under that id for the
//! connection (a later HELLO with the same id renews it). Every other request names in its
//! header the capability id it uses.

use std::collections::HashMap;

use regions_proto::auth::Secret;
use regions_proto::capability::{Capability, CapabilityKey, now_ms};
use regions_proto::frame::{Header, Op};

use crate::error::DaemonError;
use regions_proto::handshake::ServerHello;

/// Most capabilities one connection may hold.
pub const MAX_CAPABILITIES: usize = 256;

/// The authentication state of one connection.
#[derive(Debug, Default)]
pub struct ConnAuth {
    secret: bool,
    /// The cluster-secret handshake waiting for the client's proof.
    pending: Option<ServerHello>,
    caps: HashMap<u64, Capability>,
}

/// What a request may touch once authorized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Any range (cluster secret, no region named).
    Any,
    /// Only chunks backing this region (a capability's).
    Region(u64),
    /// Only chunks backing the region the request names (cluster secret): a chunk that backs
    /// something else now means the caller's map is stale.
    Named(u64),
}

impl Reach {
    /// Whether pinned chunks are within reach (`backed_by(ino)` tells whether all back `ino`).
    pub fn allows(self, backed_by: impl FnOnce(u64) -> bool) -> bool {
        match self {
            Reach::Any => true,
            Reach::Region(ino) | Reach::Named(ino) => backed_by(ino),
        }
    }

    /// The error for a request whose chunks are out of reach: `EACCES` for a capability,
    /// `ESTALE` for a named region (refresh the map and retry).
    pub fn refusal(self) -> DaemonError {
        match self {
            Reach::Named(ino) => DaemonError::Stale(format!(
                "the range no longer backs region {ino} (its map changed): refresh the map and \
                 retry"
            )),
            Reach::Any | Reach::Region(_) => DaemonError::Denied(OUT_OF_REACH.into()),
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

    /// Takes in a HELLO: a step of the cluster-secret handshake (`id` 0) or a capability
    /// token stored as `id`. Returns the payload of the reply.
    pub fn present(
        &mut self,
        secret: &Secret,
        key: &CapabilityKey,
        id: u64,
        token: &[u8],
    ) -> Result<Vec<u8>, String> {
        if id == 0 {
            return match self.pending.take() {
                None => {
                    let (pending, reply) =
                        ServerHello::challenge(secret, token).map_err(|e| e.to_string())?;
                    self.pending = Some(pending);
                    Ok(reply)
                }
                Some(pending) => {
                    pending.verify(secret, token).map_err(|e| e.to_string())?;
                    self.secret = true;
                    Ok(Vec::new())
                }
            };
        }
        if self.pending.is_some() {
            return Err("expected the cluster-secret proof to finish the HELLO in progress".into());
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
        Ok(Vec::new())
    }

    /// Decides a request (not HELLO): what it may touch, or why it is refused (`EACCES`).
    pub fn authorize(&self, h: &Header) -> Result<Reach, String> {
        if self.secret {
            return Ok(match h.object_id {
                0 => Reach::Any,
                ino => Reach::Named(ino),
            });
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
    use regions_proto::handshake::ClientHello;

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

    /// Runs the client's side of the handshake against `a` with `client_secret`.
    fn handshake(
        a: &mut ConnAuth,
        s: &Secret,
        k: &CapabilityKey,
        client: &Secret,
    ) -> Result<(), String> {
        let (hello, open) = ClientHello::start().unwrap();
        let reply = a.present(s, k, 0, &open)?;
        let answer = hello.answer(client, &reply).map_err(|e| e.to_string())?;
        a.present(s, k, 0, &answer).map(|_| ())
    }

    #[test]
    fn secret_reaches_everything() {
        let (s, k) = setup();
        let mut a = ConnAuth::default();
        assert!(!a.is_authenticated());
        assert!(
            a.present(&s, &k, 0, b"cluster").is_err(),
            "the raw secret is no HELLO"
        );
        // A client with another secret cannot verify the daemon, nor prove itself.
        let wrong = Secret::new("wrong").unwrap();
        assert!(
            handshake(&mut ConnAuth::default(), &s, &k, &wrong)
                .unwrap_err()
                .contains("daemon could not prove")
        );
        let (_, open) = ClientHello::start().unwrap();
        let mut b = ConnAuth::default();
        b.present(&s, &k, 0, &open).unwrap();
        let forged = [&[regions_proto::handshake::STEP_PROOF][..], &[0u8; 32]].concat();
        assert!(
            b.present(&s, &k, 0, &forged)
                .unwrap_err()
                .contains("wrong cluster secret")
        );
        assert!(!b.is_authenticated());
        handshake(&mut a, &s, &k, &s).unwrap();
        assert!(a.is_authenticated());
        assert_eq!(a.authorize(&req(Op::Write, 0)), Ok(Reach::Any));
        // A request that names its region reaches only that region's chunks, and a chunk of
        // another region is a stale map (ESTALE), not a refusal of the secret.
        let mut named = req(Op::Write, 0);
        named.object_id = 42;
        assert_eq!(a.authorize(&named), Ok(Reach::Named(42)));
        assert!(Reach::Named(42).allows(|ino| ino == 42));
        assert!(!Reach::Named(42).allows(|ino| ino == 43));
        assert_eq!(Reach::Named(42).refusal().errno(), libc::ESTALE);
        assert_eq!(Reach::Region(42).refusal().errno(), libc::EACCES);
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
