//! The cluster secret and how node components prove they hold it without sending it.
//!
//! - The secret lives in a file only its owner may read: [`Secret::from_file`] refuses a file
//!   with any group or other permission bit, naming the `chmod` to run.
//! - Manager calls carry a per-call proof ([`AttachSecret`] / [`RequireSecret`]): metadata
//!   [`AUTH_KEY`] holds a timestamp, a random nonce and HMAC-SHA256(secret, [`CALL_LABEL`],
//!   timestamp, nonce, gRPC method path). The manager refuses timestamps more than
//!   [`CALL_WINDOW`] away from its clock and nonces it saw within that window.
//! - Transport connections prove the secret with a challenge–response HELLO
//!   ([`crate::handshake`]).
//!
//! The secret itself never leaves the process: it is only ever used as an HMAC key.

use std::collections::{HashSet, VecDeque};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tonic::{Request, Status, metadata::MetadataValue, service::Interceptor};

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Metadata key carrying the per-call proof `v1.<unix ms>.<nonce hex>.<mac hex>`.
pub const AUTH_KEY: &str = "regions-auth";
/// Domain separation of the per-call proofs.
pub const CALL_LABEL: &[u8] = b"regions grpc call v1";
/// How far a call's timestamp may be from the manager's clock.
pub const CALL_WINDOW: Duration = Duration::from_secs(60);
/// Bytes of a call nonce.
pub const CALL_NONCE_LEN: usize = 16;
/// Most nonces remembered at once: calls beyond this rate (about 4,000 a second sustained over
/// the replay window) are refused rather than remembered partially.
pub const REPLAY_CAPACITY: usize = 1 << 19;
/// Bytes of an HMAC-SHA256.
pub const MAC_LEN: usize = 32;

/// Why a secret could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "cannot read the cluster secret file {path}: {source}; create it (e.g. `(umask 077; head -c 32 /dev/urandom | base64 > {path})`) or point --secret-file at it"
    )]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the cluster secret file {path} has mode {mode:04o}: group or others may access it, so the secret is not secret; run `chmod 600 {path}` (and keep it owned by the user the component runs as)"
    )]
    Exposed { path: String, mode: u32 },
    #[error("the cluster secret file {path} is empty; write a random token into it")]
    Empty { path: String },
    #[error("the cluster secret in {path} must be printable ASCII without spaces")]
    NotAscii { path: String },
    #[error("cannot draw random bytes for a nonce: {0}")]
    Random(String),
}

/// The cluster secret, read once from a file. It is only ever used as an HMAC key.
#[derive(Clone)]
pub struct Secret(Arc<str>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// `len` random bytes from the operating system.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], SecretError> {
    let mut out = [0u8; N];
    getrandom::fill(&mut out).map_err(|e| SecretError::Random(e.to_string()))?;
    Ok(out)
}

impl Secret {
    /// Reads the secret from `path`, trimming surrounding white space. Refuses a file that
    /// group or others may read or write ([`SecretError::Exposed`]).
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let shown = path.display().to_string();
        let read_err = |source| SecretError::Read {
            path: shown.clone(),
            source,
        };
        // The mode is checked on the opened file, so it is the file that is read.
        let mut file = std::fs::File::open(path).map_err(read_err)?;
        let mode = file.metadata().map_err(read_err)?.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Exposed { path: shown, mode });
        }
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(read_err)?;
        Secret::new(text.trim()).map_err(|e| match e {
            SecretError::Empty { .. } => SecretError::Empty { path: shown },
            _ => SecretError::NotAscii { path: shown },
        })
    }

    /// Writes the secret to `path` (created, or replaced) as [`Secret::from_file`] reads it:
    /// one line, readable and writable by its owner only (mode 0600).
    pub fn write_file(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        // A file that existed keeps its mode through the open: make it private too.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        writeln!(file, "{}", self.0)
    }

    /// A secret from a string (tests, embedded clusters).
    pub fn new(token: &str) -> Result<Secret, SecretError> {
        if token.is_empty() {
            return Err(SecretError::Empty {
                path: String::from("<memory>"),
            });
        }
        if !token.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            return Err(SecretError::NotAscii {
                path: String::from("<memory>"),
            });
        }
        Ok(Secret(Arc::from(token)))
    }

    /// A fresh HMAC-SHA256 keyed with the secret.
    pub(crate) fn hmac(&self) -> HmacSha256 {
        // HMAC takes keys of any length; this never fails.
        <HmacSha256 as Mac>::new_from_slice(self.0.as_bytes())
            .unwrap_or_else(|_| std::process::abort())
    }

    /// HMAC-SHA256 over `label` and `parts`, each part prefixed with its length (so that no
    /// two different inputs give the same message).
    pub fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
        let mut mac = self.hmac();
        feed(&mut mac, label, parts);
        mac.finalize().into_bytes().into()
    }

    /// Whether `presented` is [`Secret::mac`] of `label` and `parts` (constant time).
    pub fn verify_mac(&self, label: &[u8], parts: &[&[u8]], presented: &[u8]) -> bool {
        let mut mac = self.hmac();
        feed(&mut mac, label, parts);
        mac.verify_slice(presented).is_ok()
    }

    /// Whether two secrets are the same (constant time).
    pub fn same_as(&self, other: &Secret) -> bool {
        self.verify_mac(b"compare", &[], &other.mac(b"compare", &[]))
    }

    /// The per-call proof of a call to `path` at `unix_ms` with `nonce`, as metadata text.
    pub fn call_proof(&self, unix_ms: u64, nonce: &[u8; CALL_NONCE_LEN], path: &str) -> String {
        let mac = self.mac(
            CALL_LABEL,
            &[&unix_ms.to_le_bytes(), nonce, path.as_bytes()],
        );
        format!("v1.{unix_ms}.{}.{}", hex(nonce), hex(&mac))
    }
}

fn feed(mac: &mut HmacSha256, label: &[u8], parts: &[&[u8]]) {
    mac.update(&(label.len() as u64).to_le_bytes());
    mac.update(label);
    for part in parts {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Now as Unix time in milliseconds (0 before 1970).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The gRPC method path (`/package.Service/Method`) of a call, when the layer in front of the
/// service recorded it ([`CallPathLayer`]) or the generated client named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallPath(pub String);

fn call_path<T>(request: &Request<T>) -> Option<String> {
    if let Some(p) = request.extensions().get::<CallPath>() {
        return Some(p.0.clone());
    }
    request
        .extensions()
        .get::<tonic::GrpcMethod>()
        .map(|m| format!("/{}/{}", m.service(), m.method()))
}

/// Nonces seen within the replay window, each with the time (Unix ms) after which its call's
/// timestamp is outside the window anyway.
#[derive(Debug, Default)]
struct ReplayCache {
    seen: HashSet<[u8; CALL_NONCE_LEN]>,
    order: VecDeque<(u64, [u8; CALL_NONCE_LEN])>,
}

impl ReplayCache {
    /// Remembers `nonce` until `forget_at`; false if it was seen already or the cache is full.
    fn insert(&mut self, nonce: [u8; CALL_NONCE_LEN], now: u64, forget_at: u64) -> Insert {
        while let Some(&(at, old)) = self.order.front() {
            if at > now {
                break;
            }
            self.order.pop_front();
            self.seen.remove(&old);
        }
        if self.seen.contains(&nonce) {
            return Insert::Replayed;
        }
        if self.seen.len() >= REPLAY_CAPACITY {
            return Insert::Full;
        }
        self.seen.insert(nonce);
        // Timestamps vary by a few ms around now; keeping insertion order is close enough
        // because an entry is only forgotten once it is surely outside the window.
        let forget_at = forget_at.max(self.order.back().map_or(0, |b| b.0));
        self.order.push_back((forget_at, nonce));
        Insert::New
    }
}

enum Insert {
    New,
    Replayed,
    Full,
}

/// Server-side interceptor that refuses calls without a valid, fresh per-call proof of the
/// cluster secret. Clones share one replay cache.
#[derive(Clone, Debug)]
pub struct RequireSecret {
    secret: Secret,
    replay: Arc<Mutex<ReplayCache>>,
}

impl RequireSecret {
    pub fn new(secret: Secret) -> RequireSecret {
        RequireSecret {
            secret,
            replay: Arc::default(),
        }
    }

    /// Checks the proof in the metadata of `request` against the clock `now_ms`.
    pub fn check_at<T>(&self, request: &Request<T>, now_ms: u64) -> Result<(), Status> {
        let Some(value) = request.metadata().get(AUTH_KEY) else {
            return Err(Status::unauthenticated(format!(
                "missing cluster-secret proof: node components must send `{AUTH_KEY}` metadata \
                 (start them with the cluster's --secret-file)"
            )));
        };
        let malformed = || {
            Status::unauthenticated(format!(
                "malformed `{AUTH_KEY}` metadata (expected v1.<unix ms>.<nonce>.<hmac>): client \
                 and manager run incompatible versions; upgrade the older side"
            ))
        };
        let text = value.to_str().map_err(|_| malformed())?;
        let mut fields = text.split('.');
        let (Some("v1"), Some(ts), Some(nonce), Some(mac), None) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            return Err(malformed());
        };
        let ts: u64 = ts.parse().map_err(|_| malformed())?;
        let nonce = unhex::<CALL_NONCE_LEN>(nonce).ok_or_else(malformed)?;
        let mac = unhex::<MAC_LEN>(mac).ok_or_else(malformed)?;
        let window = CALL_WINDOW.as_millis() as u64;
        if ts.abs_diff(now_ms) > window {
            return Err(Status::unauthenticated(format!(
                "call timestamp is {} s away from the manager's clock (at most {} s allowed): \
                 synchronise the clocks of this host and the manager (NTP)",
                ts.abs_diff(now_ms) / 1000,
                CALL_WINDOW.as_secs()
            )));
        }
        let path = call_path(request).unwrap_or_default();
        if !self.secret.verify_mac(
            CALL_LABEL,
            &[&ts.to_le_bytes(), &nonce, path.as_bytes()],
            &mac,
        ) {
            return Err(Status::unauthenticated(
                "wrong cluster secret: the call's proof does not match; use the same \
                 --secret-file as the manager",
            ));
        }
        let inserted = match self.replay.lock() {
            Ok(mut cache) => cache.insert(nonce, now_ms, ts.saturating_add(window)),
            Err(_) => Insert::Full,
        };
        match inserted {
            Insert::New => Ok(()),
            Insert::Replayed => Err(Status::unauthenticated(
                "replayed call: this proof was already used; every call needs a fresh nonce \
                 (a client bug or a captured request being resent)",
            )),
            Insert::Full => Err(Status::unavailable(
                "too many authenticated calls within the replay window; retry shortly",
            )),
        }
    }

    /// Checks the proof in the metadata of `request` against the clock.
    pub fn check<T>(&self, request: &Request<T>) -> Result<(), Status> {
        self.check_at(request, unix_ms())
    }
}

impl Interceptor for RequireSecret {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.check(&request)?;
        Ok(request)
    }
}

/// Client-side interceptor that attaches a fresh proof of the cluster secret to every call.
#[derive(Clone, Debug)]
pub struct AttachSecret {
    secret: Secret,
}

impl AttachSecret {
    pub fn new(secret: &Secret) -> AttachSecret {
        AttachSecret {
            secret: secret.clone(),
        }
    }

    /// Attaches a proof for a call at `unix_ms`.
    pub fn attach_at<T>(&self, request: &mut Request<T>, unix_ms: u64) -> Result<(), Status> {
        let nonce = random_bytes::<CALL_NONCE_LEN>()
            .map_err(|e| Status::internal(format!("cannot authenticate the call: {e}")))?;
        let path = call_path(request).unwrap_or_default();
        let proof = self.secret.call_proof(unix_ms, &nonce, &path);
        let value: MetadataValue<tonic::metadata::Ascii> = proof
            .parse()
            .map_err(|_| Status::internal("cannot encode the call's proof as metadata"))?;
        request.metadata_mut().insert(AUTH_KEY, value);
        Ok(())
    }
}

impl Interceptor for AttachSecret {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        self.attach_at(&mut request, unix_ms())?;
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn call(path: &str) -> Request<()> {
        let mut req = Request::new(());
        req.extensions_mut().insert(CallPath(path.to_owned()));
        req
    }

    fn attached(secret: &Secret, path: &str, at: u64) -> Request<()> {
        let mut req = call(path);
        AttachSecret::new(secret).attach_at(&mut req, at).unwrap();
        req
    }

    #[test]
    fn attach_then_check() {
        let secret = Secret::new("s3cret").unwrap();
        let now = unix_ms();
        let req = attached(&secret, "/regions.v1.Cluster/Heartbeat", now);
        let proof = req.metadata().get(AUTH_KEY).unwrap().to_str().unwrap();
        assert!(!proof.contains("s3cret"), "the secret itself is never sent");
        let server = RequireSecret::new(secret.clone());
        assert!(server.check_at(&req, now).is_ok());
        // The same proof again is a replay.
        let again = server.check_at(&req, now).unwrap_err();
        assert_eq!(again.code(), tonic::Code::Unauthenticated);
        assert!(again.message().contains("replayed"), "{}", again.message());
        // Another secret, no proof, another method, a stale or future timestamp: refused.
        let other = RequireSecret::new(Secret::new("other").unwrap());
        let req = attached(&secret, "/a/b", now);
        let e = other.check_at(&req, now).unwrap_err();
        assert!(e.message().contains("--secret-file"), "{}", e.message());
        let e = server.check_at(&call("/a/b"), now).unwrap_err();
        assert!(e.message().contains("missing"), "{}", e.message());
        let mut moved = attached(&secret, "/a/b", now);
        moved
            .extensions_mut()
            .insert(CallPath("/a/other".to_owned()));
        assert!(server.check_at(&moved, now).is_err(), "bound to the method");
        for skew in [-61_000i64, 61_000] {
            let req = attached(&secret, "/a/b", (now as i64 + skew) as u64);
            let e = server.check_at(&req, now).unwrap_err();
            assert!(e.message().contains("clock"), "{}", e.message());
        }
        let req = attached(&secret, "/a/b", now - 59_000);
        assert!(server.check_at(&req, now).is_ok(), "within the window");
        let mut bad = call("/a/b");
        bad.metadata_mut()
            .insert(AUTH_KEY, "Bearer s3cret".parse().unwrap());
        let e = server.check_at(&bad, now).unwrap_err();
        assert!(e.message().contains("malformed"), "{}", e.message());
    }

    #[test]
    fn generated_clients_name_the_method() {
        let secret = Secret::new("s3cret").unwrap();
        let now = unix_ms();
        let mut req = Request::new(());
        req.extensions_mut()
            .insert(tonic::GrpcMethod::new("regions.v1.Cluster", "Heartbeat"));
        AttachSecret::new(&secret).attach_at(&mut req, now).unwrap();
        // The server learns the path from the URI (CallPath), the client from GrpcMethod.
        let mut server_side = Request::new(());
        *server_side.metadata_mut() = req.metadata().clone();
        server_side
            .extensions_mut()
            .insert(CallPath("/regions.v1.Cluster/Heartbeat".to_owned()));
        assert!(
            RequireSecret::new(secret)
                .check_at(&server_side, now)
                .is_ok()
        );
    }

    #[test]
    fn replay_cache_forgets_after_the_window() {
        let mut cache = ReplayCache::default();
        assert!(matches!(cache.insert([1; 16], 0, 100), Insert::New));
        assert!(matches!(cache.insert([1; 16], 50, 150), Insert::Replayed));
        assert!(matches!(cache.insert([1; 16], 101, 201), Insert::New));
        assert_eq!(cache.seen.len(), 1);
    }

    #[test]
    fn macs_separate_labels_and_parts() {
        let s = Secret::new("k").unwrap();
        let a = s.mac(b"l", &[b"ab", b"c"]);
        assert_ne!(a, s.mac(b"l", &[b"a", b"bc"]));
        assert_ne!(a, s.mac(b"m", &[b"ab", b"c"]));
        assert!(s.verify_mac(b"l", &[b"ab", b"c"], &a));
        assert!(
            !Secret::new("j")
                .unwrap()
                .verify_mac(b"l", &[b"ab", b"c"], &a)
        );
        assert!(s.same_as(&Secret::new("k").unwrap()));
        assert!(!s.same_as(&Secret::new("j").unwrap()));
    }

    fn write_mode(path: &Path, text: &str, mode: u32) {
        let _ = std::fs::remove_file(path);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        // The umask may have cleared bits; set exactly what the test asks for.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn bad_secrets_are_refused() {
        assert!(Secret::new("").is_err());
        assert!(Secret::new("has space").is_err());
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("secret");
        write_mode(&path, "  tok\n", 0o600);
        assert!(
            Secret::from_file(&path)
                .unwrap()
                .same_as(&Secret::new("tok").unwrap())
        );
        write_mode(&path, "\n", 0o400);
        assert!(matches!(
            Secret::from_file(&path),
            Err(SecretError::Empty { .. })
        ));
        assert!(matches!(
            Secret::from_file(&dir.join("missing")),
            Err(SecretError::Read { .. })
        ));
    }

    #[test]
    fn secrets_readable_by_others_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("secret");
        for mode in [0o644, 0o640, 0o604, 0o660, 0o606, 0o610] {
            write_mode(&path, "tok\n", mode);
            let err = Secret::from_file(&path).unwrap_err();
            assert!(
                matches!(err, SecretError::Exposed { mode: m, .. } if m == mode),
                "{mode:o}: {err}"
            );
            let text = err.to_string();
            assert!(
                text.contains(&format!("chmod 600 {}", path.display())),
                "{text}"
            );
            assert!(text.contains(&format!("{mode:04o}")), "{text}");
        }
        write_mode(&path, "tok\n", 0o600);
        assert!(Secret::from_file(&path).is_ok());
        // write_file makes even an exposed file private, and from_file reads it back.
        write_mode(&path, "old\n", 0o644);
        let written = Secret::new("fresh-token").unwrap();
        written.write_file(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600);
        let read = Secret::from_file(&path).unwrap();
        assert_eq!(read.mac(b"t", &[]), written.mac(b"t", &[]));
    }
}
