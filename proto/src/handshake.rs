//! The transport's HELLO with the cluster secret (capability id 0): a mutual
//! challenge–response in which the secret is only used as an HMAC key and never sent.
//!
//! 1. The client sends HELLO with payload `[STEP_CHALLENGE, client nonce (32)]`.
//! 2. The daemon replies (status 0) with `[server nonce (32), server proof (32)]`, where the
//!    server proof is HMAC-SHA256(secret, [`SERVER_LABEL`], server nonce, client nonce).
//! 3. The client checks the server proof (so it knows it talks to a member of the cluster),
//!    then sends HELLO with `[STEP_PROOF, client proof (32)]`, the client proof being
//!    HMAC-SHA256(secret, [`CLIENT_LABEL`], server nonce, client nonce).
//! 4. The daemon checks it in constant time and replies with status 0 and no payload, or
//!    refuses with `EACCES` and closes the connection.
//!
//! The two proofs carry different labels, so neither side's answer can be replayed as the
//! other's, and fresh nonces on both sides make every proof good for one connection only.

use crate::auth::{MAC_LEN, Secret, random_bytes};

/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// First byte of the opening HELLO payload.
pub const STEP_CHALLENGE: u8 = 1;
/// First byte of the answering HELLO payload.
pub const STEP_PROOF: u8 = 2;
/// Domain separation of the client's proof.
pub const CLIENT_LABEL: &[u8] = b"regions transport hello v2 client";
/// Domain separation of the daemon's proof.
pub const SERVER_LABEL: &[u8] = b"regions transport hello v2 server";

/// Payload of the opening HELLO.
pub const CHALLENGE_LEN: usize = 1 + NONCE_LEN;
/// Payload of the daemon's reply to the opening HELLO.
pub const CHALLENGE_REPLY_LEN: usize = NONCE_LEN + MAC_LEN;
/// Payload of the answering HELLO.
pub const PROOF_LEN: usize = 1 + MAC_LEN;

/// Why a handshake failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HelloError {
    #[error(
        "malformed HELLO: {0} (client and daemon run incompatible versions; upgrade the older side)"
    )]
    Malformed(&'static str),
    #[error(
        "wrong cluster secret: the client's proof does not match; use the same --secret-file as the manager"
    )]
    WrongSecret,
    #[error(
        "the daemon could not prove it holds the cluster secret: it runs with another --secret-file, or something else answers at this address"
    )]
    DaemonNotProven,
    #[error("cannot draw random bytes for a nonce: {0}")]
    Random(String),
}

fn nonce() -> Result<[u8; NONCE_LEN], HelloError> {
    random_bytes::<NONCE_LEN>().map_err(|e| HelloError::Random(e.to_string()))
}

/// The client's side of a handshake in progress.
#[derive(Debug)]
pub struct ClientHello {
    client_nonce: [u8; NONCE_LEN],
}

impl ClientHello {
    /// Starts a handshake: the state and the payload of the opening HELLO.
    pub fn start() -> Result<(ClientHello, Vec<u8>), HelloError> {
        let client_nonce = nonce()?;
        let mut payload = Vec::with_capacity(CHALLENGE_LEN);
        payload.push(STEP_CHALLENGE);
        payload.extend_from_slice(&client_nonce);
        Ok((ClientHello { client_nonce }, payload))
    }

    /// Checks the daemon's reply to the opening HELLO and returns the payload of the answer.
    pub fn answer(&self, secret: &Secret, reply: &[u8]) -> Result<Vec<u8>, HelloError> {
        let (server_nonce, server_proof) = reply
            .split_at_checked(NONCE_LEN)
            .filter(|(_, proof)| proof.len() == MAC_LEN)
            .ok_or(HelloError::Malformed(
                "the daemon's challenge has the wrong length",
            ))?;
        let parts: [&[u8]; 2] = [server_nonce, &self.client_nonce];
        if !secret.verify_mac(SERVER_LABEL, &parts, server_proof) {
            return Err(HelloError::DaemonNotProven);
        }
        let mut payload = Vec::with_capacity(PROOF_LEN);
        payload.push(STEP_PROOF);
        payload.extend_from_slice(&secret.mac(CLIENT_LABEL, &parts));
        Ok(payload)
    }
}

/// The daemon's side of a handshake waiting for the client's proof.
#[derive(Debug)]
pub struct ServerHello {
    server_nonce: [u8; NONCE_LEN],
    client_nonce: [u8; NONCE_LEN],
}

impl ServerHello {
    /// Answers an opening HELLO: the state and the reply payload (nonce and the daemon's proof).
    pub fn challenge(
        secret: &Secret,
        payload: &[u8],
    ) -> Result<(ServerHello, Vec<u8>), HelloError> {
        let client_nonce: [u8; NONCE_LEN] = match payload.split_first() {
            Some((&STEP_CHALLENGE, rest)) => rest
                .try_into()
                .map_err(|_| HelloError::Malformed("the client nonce must be 32 bytes"))?,
            Some((&STEP_PROOF, _)) => {
                return Err(HelloError::Malformed("a proof came before the challenge"));
            }
            _ => return Err(HelloError::Malformed("unknown HELLO step")),
        };
        let server_nonce = nonce()?;
        let mut reply = Vec::with_capacity(CHALLENGE_REPLY_LEN);
        reply.extend_from_slice(&server_nonce);
        reply.extend_from_slice(&secret.mac(SERVER_LABEL, &[&server_nonce, &client_nonce]));
        Ok((
            ServerHello {
                server_nonce,
                client_nonce,
            },
            reply,
        ))
    }

    /// Checks the client's answer (constant time).
    pub fn verify(&self, secret: &Secret, payload: &[u8]) -> Result<(), HelloError> {
        let proof = match payload.split_first() {
            Some((&STEP_PROOF, proof)) if proof.len() == MAC_LEN => proof,
            Some((&STEP_PROOF, _)) => {
                return Err(HelloError::Malformed("the proof must be 32 bytes"));
            }
            _ => {
                return Err(HelloError::Malformed(
                    "expected the proof after the challenge",
                ));
            }
        };
        let parts: [&[u8]; 2] = [&self.server_nonce, &self.client_nonce];
        if secret.verify_mac(CLIENT_LABEL, &parts, proof) {
            Ok(())
        } else {
            Err(HelloError::WrongSecret)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> Secret {
        Secret::new(s).unwrap()
    }

    #[test]
    fn both_sides_prove_the_secret() {
        let s = secret("cluster-secret");
        let (client, open) = ClientHello::start().unwrap();
        assert_eq!(open.len(), CHALLENGE_LEN);
        let (server, reply) = ServerHello::challenge(&s, &open).unwrap();
        assert_eq!(reply.len(), CHALLENGE_REPLY_LEN);
        let answer = client.answer(&s, &reply).unwrap();
        assert_eq!(answer.len(), PROOF_LEN);
        server.verify(&s, &answer).unwrap();
        for bytes in [&open[..], &reply[..], &answer[..]] {
            assert!(
                !bytes.windows(14).any(|w| w == b"cluster-secret"),
                "the secret is never sent"
            );
        }
    }

    #[test]
    fn wrong_secrets_fail_on_either_side() {
        let (client, open) = ClientHello::start().unwrap();
        // A daemon with another secret cannot prove itself.
        let (_, reply) = ServerHello::challenge(&secret("other"), &open).unwrap();
        assert_eq!(
            client.answer(&secret("right"), &reply),
            Err(HelloError::DaemonNotProven)
        );
        // A client with another secret is refused by the daemon.
        let (server, reply) = ServerHello::challenge(&secret("right"), &open).unwrap();
        let mut forged = vec![STEP_PROOF];
        forged.extend_from_slice(&secret("other").mac(CLIENT_LABEL, &[&reply[..32], &open[1..]]));
        assert_eq!(
            server.verify(&secret("right"), &forged),
            Err(HelloError::WrongSecret)
        );
        // The daemon's proof is no client proof (labels differ).
        let mut reflected = vec![STEP_PROOF];
        reflected.extend_from_slice(&reply[32..]);
        assert_eq!(
            server.verify(&secret("right"), &reflected),
            Err(HelloError::WrongSecret)
        );
    }

    #[test]
    fn proofs_are_good_for_one_connection() {
        let s = secret("k");
        let (client, open) = ClientHello::start().unwrap();
        let (first, reply) = ServerHello::challenge(&s, &open).unwrap();
        let answer = client.answer(&s, &reply).unwrap();
        first.verify(&s, &answer).unwrap();
        // Replaying the same opening and answer on a new connection: a new server nonce.
        let (second, _) = ServerHello::challenge(&s, &open).unwrap();
        assert_eq!(second.verify(&s, &answer), Err(HelloError::WrongSecret));
    }

    #[test]
    fn malformed_payloads_are_refused() {
        let s = secret("k");
        for bad in [
            &b""[..],
            &[STEP_CHALLENGE; 5][..],
            &[9u8; 33][..],
            &[STEP_PROOF; 33][..],
        ] {
            assert!(matches!(
                ServerHello::challenge(&s, bad),
                Err(HelloError::Malformed(_))
            ));
        }
        let (client, open) = ClientHello::start().unwrap();
        let (server, _) = ServerHello::challenge(&s, &open).unwrap();
        assert!(matches!(
            server.verify(&s, &open),
            Err(HelloError::Malformed(_))
        ));
        assert!(matches!(
            server.verify(&s, &[STEP_PROOF, 1, 2]),
            Err(HelloError::Malformed(_))
        ));
        assert!(matches!(
            client.answer(&s, &[0; 10]),
            Err(HelloError::Malformed(_))
        ));
    }
}
