//! Who a transport connection speaks for (docs/ARCHITECTURE.md, "Capabilities"): a node
//! component that presented the cluster secret may touch any pool range; an application that presented
//! capabilities may touch only chunks of the regions they name, with their rights, until they
//! expire.
//!
//! HELLOs with `capability = 0` in their header are the two steps of the cluster-secret
//! challenge–response ([`regions_proto::handshake`]: the secret itself never crosses the
//! network); one with a nonzero `capability` carries a token, stored under that id for the
//! connection (a later HELLO with the same id renews it). Every other request names in its
//! header the capability id it uses. A token is refused (`EKEYREVOKED`) once the manager
//! revoked its region's tokens issued before a change ([`Revocations`]), when presented and
//! on every request after.

use std::collections::HashMap;

use regions_proto::auth::Secret;
use regions_proto::capability::{Capability, CapabilityKey, now_ms};
use regions_proto::frame::{Header, Op};

use crate::error::DaemonError;
use crate::pools::Pinned;
use crate::transport::revocations::Revocations;
use regions_proto::capability::{fenced_message, revoked_message};
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
    /// Only bytes of the capability's region within its offset range.
    Capability(Capability),
    /// Only chunks backing the region the request names (cluster secret): a chunk that backs
    /// something else now means the caller's map is stale.
    Named(u64),
}

impl Reach {
    /// `Ok` when the pinned bytes are within reach and where the request believes them in
    /// their region; else the refusal: `ESTALE` for a map from before a chunk moved (refresh
    /// it and retry), [`Reach::refusal`] for bytes out of reach.
    pub fn check(self, pinned: &Pinned<'_>) -> Result<(), DaemonError> {
        if !self.allows(pinned) {
            return Err(self.refusal());
        }
        if !pinned.deltas_match() {
            return Err(DaemonError::Stale(
                "a chunk of the range backs another offset of its region now (the region \
                 shrank and grew again since the map was read): refresh the map and retry"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Whether the pinned bytes are within reach.
    pub fn allows(self, pinned: &Pinned<'_>) -> bool {
        match self {
            Reach::Any => true,
            Reach::Capability(cap) => pinned.all_covered_by(&cap),
            Reach::Named(ino) => pinned.all_backed_by(ino),
        }
    }

    /// Whether a request authorised as `self` may go on: false once its capability was
    /// revoked (checked again when a long transfer resumes after waiting for the socket).
    pub fn still_valid(self, revocations: &Revocations) -> bool {
        match self {
            Reach::Capability(cap) => !revocations.revoked(&cap),
            Reach::Any | Reach::Named(_) => true,
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
            Reach::Any | Reach::Capability(_) => DaemonError::Denied(OUT_OF_REACH.into()),
        }
    }
}

/// Text of refusals for ranges outside a capability.
pub const OUT_OF_REACH: &str = "the range lies outside the region or the byte range of the \
     presented capability (a mutex's or barrier's reaches its own 64-byte slot only): open the \
     region you mean first";

fn writes(op: Op) -> bool {
    matches!(
        op,
        Op::Write
            | Op::WriteV
            | Op::Cas
            | Op::FetchAdd
            | Op::RdmaWriteKeys
            | Op::Wake
            | Op::ObjAlloc
            | Op::ObjFree
            | Op::ObjWrite
            | Op::ObjFreeze
            | Op::ObjThaw
            | Op::ObjRefit
            | Op::ObjCorrect
    )
}

impl ConnAuth {
    /// Whether the connection proved the cluster secret (a node component), not only
    /// presented capabilities.
    pub fn proved_secret(&self) -> bool {
        self.secret
    }

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
        revocations: &Revocations,
        id: u64,
        token: &[u8],
    ) -> Result<Vec<u8>, DaemonError> {
        let denied = |e: &dyn std::fmt::Display| DaemonError::Denied(e.to_string());
        if id == 0 {
            return match self.pending.take() {
                None => {
                    let (pending, reply) =
                        ServerHello::challenge(secret, token).map_err(|e| denied(&e))?;
                    self.pending = Some(pending);
                    Ok(reply)
                }
                Some(pending) => {
                    pending.verify(secret, token).map_err(|e| denied(&e))?;
                    self.secret = true;
                    Ok(Vec::new())
                }
            };
        }
        if self.pending.is_some() {
            return Err(denied(
                &"expected the cluster-secret proof to finish the HELLO in progress",
            ));
        }
        let cap = key.verify(token).map_err(|e| denied(&e))?;
        cap.check_time(now_ms()).map_err(|e| denied(&e))?;
        if revocations.revoked(&cap) {
            return Err(DaemonError::Revoked(refused_message(revocations, &cap)));
        }
        if !self.caps.contains_key(&id) && self.caps.len() >= MAX_CAPABILITIES {
            return Err(DaemonError::Denied(format!(
                "too many capabilities on one connection (at most {MAX_CAPABILITIES}): \
                 open another connection"
            )));
        }
        self.caps.insert(id, cap);
        Ok(Vec::new())
    }

    /// Decides a request (not HELLO): what it may touch, or why it is refused (`EACCES`,
    /// `EKEYREVOKED`).
    pub fn authorize(&self, h: &Header, revocations: &Revocations) -> Result<Reach, DaemonError> {
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
            DaemonError::Denied(format!(
                "capability {} was not presented on this connection (send HELLO with it first)",
                h.capability
            ))
        })?;
        cap.check_time(now_ms())
            .map_err(|e| DaemonError::Denied(e.to_string()))?;
        if revocations.revoked(cap) {
            return Err(DaemonError::Revoked(refused_message(revocations, cap)));
        }
        if writes(h.op) && !cap.can_write() {
            return Err(DaemonError::Denied(format!(
                "{} refused: the capability for region {} is read-only (the region was opened \
                 for reading)",
                h.op, cap.ino
            )));
        }
        if !writes(h.op) && !cap.can_read() {
            return Err(DaemonError::Denied(format!(
                "{} refused: the capability for region {} does not allow reading",
                h.op, cap.ino
            )));
        }
        Ok(Reach::Capability(*cap))
    }
}

/// Why a genuine token is refused: its host's fence, or a change to its region.
fn refused_message(revocations: &Revocations, cap: &Capability) -> String {
    if revocations.fenced(cap) {
        fenced_message(cap)
    } else {
        revoked_message(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regions_proto::capability::{RIGHT_READ, RIGHT_WRITE, WHOLE_REGION};
    use regions_proto::handshake::ClientHello;

    fn setup() -> (Secret, CapabilityKey) {
        let s = Secret::new("cluster").unwrap();
        let k = CapabilityKey::from_secret(&s);
        (s, k)
    }

    fn cap(ino: u64, rights: u8, ttl_ms: i64, issued: u64) -> Capability {
        Capability {
            ino,
            rights,
            expires_ms: (now_ms() as i64 + ttl_ms) as u64,
            issued,
            offset: 0,
            len: WHOLE_REGION,
            host: 0,
        }
    }

    fn token(k: &CapabilityKey, ino: u64, rights: u8, ttl_ms: i64) -> Vec<u8> {
        k.mint(&cap(ino, rights, ttl_ms, 1))
    }

    fn req(op: Op, cap: u64) -> Header {
        let mut h = Header::new(op, 1);
        h.capability = cap;
        h
    }

    /// `present` with no revocation, its refusal as text.
    fn present(
        a: &mut ConnAuth,
        s: &Secret,
        k: &CapabilityKey,
        id: u64,
        token: &[u8],
    ) -> Result<Vec<u8>, String> {
        a.present(s, k, &Revocations::new(), id, token)
            .map_err(|e| e.to_string())
    }

    /// `authorize` with no revocation, its refusal as text.
    fn authorize(a: &ConnAuth, h: &Header) -> Result<Reach, String> {
        a.authorize(h, &Revocations::new())
            .map_err(|e| e.to_string())
    }

    /// Runs the client's side of the handshake against `a` with `client_secret`.
    fn handshake(
        a: &mut ConnAuth,
        s: &Secret,
        k: &CapabilityKey,
        client: &Secret,
    ) -> Result<(), String> {
        let (hello, open) = ClientHello::start().unwrap();
        let reply = present(a, s, k, 0, &open)?;
        let answer = hello.answer(client, &reply).map_err(|e| e.to_string())?;
        present(a, s, k, 0, &answer).map(|_| ())
    }

    #[test]
    fn secret_reaches_everything() {
        let (s, k) = setup();
        let mut a = ConnAuth::default();
        assert!(!a.is_authenticated());
        assert!(
            present(&mut a, &s, &k, 0, b"cluster").is_err(),
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
        present(&mut b, &s, &k, 0, &open).unwrap();
        let forged = [&[regions_proto::handshake::STEP_PROOF][..], &[0u8; 32]].concat();
        assert!(
            present(&mut b, &s, &k, 0, &forged)
                .unwrap_err()
                .contains("wrong cluster secret")
        );
        assert!(!b.is_authenticated());
        handshake(&mut a, &s, &k, &s).unwrap();
        assert!(a.is_authenticated());
        assert_eq!(authorize(&a, &req(Op::Write, 0)), Ok(Reach::Any));
        // A request that names its region reaches only that region's chunks, and a chunk of
        // another region is a stale map (ESTALE), not a refusal of the secret.
        let mut named = req(Op::Write, 0);
        named.object_id = 42;
        assert_eq!(authorize(&a, &named), Ok(Reach::Named(42)));
        assert_eq!(Reach::Named(42).refusal().errno(), libc::ESTALE);
        let c = cap(42, RIGHT_READ, 1000, 1);
        assert_eq!(Reach::Capability(c).refusal().errno(), libc::EACCES);
    }

    #[test]
    fn capabilities_bind_region_rights_and_time() {
        let (s, k) = setup();
        let mut a = ConnAuth::default();
        present(&mut a, &s, &k, 1, &token(&k, 10, RIGHT_READ, 60_000)).unwrap();
        present(
            &mut a,
            &s,
            &k,
            2,
            &token(&k, 11, RIGHT_READ | RIGHT_WRITE, 60_000),
        )
        .unwrap();
        let reach_ino = |r: Result<Reach, String>| match r {
            Ok(Reach::Capability(c)) => Some(c.ino),
            _ => None,
        };
        assert_eq!(reach_ino(authorize(&a, &req(Op::Read, 1))), Some(10));
        assert_eq!(reach_ino(authorize(&a, &req(Op::ReadV, 2))), Some(11));
        for op in [Op::Write, Op::WriteV, Op::Cas, Op::FetchAdd] {
            assert!(
                authorize(&a, &req(op, 1))
                    .unwrap_err()
                    .contains("read-only")
            );
            assert_eq!(reach_ino(authorize(&a, &req(op, 2))), Some(11));
        }
        assert!(authorize(&a, &req(Op::Read, 3)).is_err(), "unknown id");
        assert!(
            authorize(&a, &req(Op::Read, 0)).is_err(),
            "id 0 without the secret"
        );
        // Expired tokens are refused when presented, and once they expire.
        assert!(
            present(&mut a, &s, &k, 3, &token(&k, 10, RIGHT_READ, -1))
                .unwrap_err()
                .contains("expired")
        );
        let mut b = ConnAuth::default();
        present(&mut b, &s, &k, 1, &token(&k, 10, RIGHT_READ, 30)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(40));
        assert!(
            authorize(&b, &req(Op::Read, 1))
                .unwrap_err()
                .contains("expired")
        );
        // Renewal under the same id.
        present(&mut b, &s, &k, 1, &token(&k, 10, RIGHT_READ, 60_000)).unwrap();
        assert!(authorize(&b, &req(Op::Read, 1)).is_ok());
        // Forged tokens are refused.
        let mut forged = token(&k, 10, RIGHT_READ, 60_000);
        forged[8] = 11;
        assert!(present(&mut b, &s, &k, 4, &forged).is_err());
    }

    #[test]
    fn revoked_tokens_are_refused_when_presented_and_when_used() {
        let (s, k) = setup();
        let revocations = Revocations::new();
        let mut a = ConnAuth::default();
        a.present(
            &s,
            &k,
            &revocations,
            1,
            &k.mint(&cap(10, RIGHT_READ, 60_000, 100)),
        )
        .unwrap();
        assert!(a.authorize(&req(Op::Read, 1), &revocations).is_ok());
        // The region's mode changed: tokens issued before epoch 200 end.
        revocations.revoke(10, 200, u64::MAX);
        let used = a.authorize(&req(Op::Read, 1), &revocations).unwrap_err();
        assert_eq!(used.errno(), libc::EKEYREVOKED);
        assert!(used.to_string().contains("renew"));
        let again = a
            .present(
                &s,
                &k,
                &revocations,
                2,
                &k.mint(&cap(10, RIGHT_READ, 60_000, 150)),
            )
            .unwrap_err();
        assert_eq!(again.errno(), libc::EKEYREVOKED);
        // A renewed token (issued after the epoch) works; other regions are untouched.
        a.present(
            &s,
            &k,
            &revocations,
            1,
            &k.mint(&cap(10, RIGHT_READ, 60_000, 201)),
        )
        .unwrap();
        assert!(a.authorize(&req(Op::Read, 1), &revocations).is_ok());
        a.present(
            &s,
            &k,
            &revocations,
            3,
            &k.mint(&cap(11, RIGHT_READ, 60_000, 5)),
        )
        .unwrap();
        assert!(a.authorize(&req(Op::Read, 3), &revocations).is_ok());
    }
}
