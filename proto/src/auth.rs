//! The cluster secret: node components present it in the metadata of every
//! manager call, and daemons check it on transport connections.

use std::path::Path;

use subtle::ConstantTimeEq;
use tonic::{Request, Status, metadata::MetadataValue, service::Interceptor};

/// Metadata key carrying `Bearer <secret>`.
pub const AUTH_KEY: &str = "authorization";

/// Why a secret could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "cannot read the cluster secret file {path}: {source}; create it (e.g. `head -c 32 /dev/urandom | base64 > {path}`) or point --secret-file at it"
    )]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the cluster secret file {path} is empty; write a random token into it")]
    Empty { path: String },
    #[error("the cluster secret in {path} must be printable ASCII (it travels in gRPC metadata)")]
    NotAscii { path: String },
}

/// The cluster secret, read once from a file.
#[derive(Clone)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Reads the secret from `path`, trimming surrounding white space.
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
            path: shown.clone(),
            source,
        })?;
        Secret::new(text.trim()).map_err(|e| match e {
            SecretError::Empty { .. } => SecretError::Empty { path: shown },
            _ => SecretError::NotAscii { path: shown },
        })
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
        Ok(Secret(token.to_owned()))
    }

    /// The raw token (for the transport's HELLO frame).
    pub fn token(&self) -> &str {
        &self.0
    }

    /// Constant-time comparison with a presented token.
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0.as_bytes().ct_eq(presented).into()
    }

    /// Checks the metadata of an incoming request.
    pub fn check<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let Some(value) = request.metadata().get(AUTH_KEY) else {
            return Err(Status::unauthenticated(
                "missing cluster secret: node components must send `authorization: Bearer <secret>` (see --secret-file)",
            ));
        };
        let presented = value.as_bytes().strip_prefix(b"Bearer ").unwrap_or(b"");
        if self.matches(presented) {
            Ok(())
        } else {
            Err(Status::unauthenticated(
                "wrong cluster secret: use the same --secret-file as the manager",
            ))
        }
    }
}

/// Server-side interceptor that refuses calls without the cluster secret.
#[derive(Clone, Debug)]
pub struct RequireSecret(pub Secret);

impl Interceptor for RequireSecret {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.0.check(&request)?;
        Ok(request)
    }
}

/// Client-side interceptor that attaches the cluster secret to every call.
#[derive(Clone, Debug)]
pub struct AttachSecret {
    header: MetadataValue<tonic::metadata::Ascii>,
}

impl AttachSecret {
    pub fn new(secret: &Secret) -> AttachSecret {
        // The secret was checked to be printable ASCII, so this cannot fail;
        // fall back to an empty value (refused by the server) rather than panic.
        let header = format!("Bearer {}", secret.token())
            .parse()
            .unwrap_or_else(|_| MetadataValue::from_static(""));
        AttachSecret { header }
    }
}

impl Interceptor for AttachSecret {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request.metadata_mut().insert(AUTH_KEY, self.header.clone());
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_then_check() {
        let secret = Secret::new("s3cret").unwrap();
        let req = AttachSecret::new(&secret).call(Request::new(())).unwrap();
        assert!(secret.check(&req).is_ok());
        let other = Secret::new("other").unwrap();
        assert_eq!(
            other.check(&req).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            secret.check(&Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }

    #[test]
    fn bad_secrets_are_refused() {
        assert!(Secret::new("").is_err());
        assert!(Secret::new("has space").is_err());
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("secret");
        std::fs::write(&path, "  tok\n").unwrap();
        assert_eq!(Secret::from_file(&path).unwrap().token(), "tok");
        std::fs::write(&path, "\n").unwrap();
        assert!(matches!(
            Secret::from_file(&path),
            Err(SecretError::Empty { .. })
        ));
        assert!(matches!(
            Secret::from_file(&dir.join("missing")),
            Err(SecretError::Read { .. })
        ));
    }
}
