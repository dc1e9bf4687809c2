//! TLS for the manager's gRPC endpoint (optional; rustls).
//!
//! - The manager serves TLS when given a certificate chain and its key (`--tls-cert`,
//!   `--tls-key`, or `REGIONS_TLS_CERT` / `REGIONS_TLS_KEY`), both PEM.
//! - Clients (daemons, regionfs, libregions) use TLS when the manager URL is `https://`: they
//!   trust the CA in `--tls-ca` / `REGIONS_TLS_CA` (PEM) if given, else the system's roots.
//!
//! TLS protects what calls carry (paths, maps, capability tokens); the cluster secret itself
//! never travels either way (see [`crate::auth`]).

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the TLS {what} {path}: {source}; check --tls-{flag}")]
    Read {
        what: &'static str,
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the TLS {what} {path} holds no PEM block (-----BEGIN ...); pass a PEM file to --tls-{flag}"
    )]
    NotPem {
        what: &'static str,
        flag: &'static str,
        path: PathBuf,
    },
    #[error("--tls-cert and --tls-key go together: give both (or neither, for plain gRPC)")]
    Half,
    #[error(
        "--tls-ca is set but the manager URL {url} is not https://: write the URL as https://host:port to use TLS"
    )]
    CaWithoutHttps { url: String },
    #[error("cannot set up TLS for {url}: {reason}")]
    Setup { url: String, reason: String },
}

fn read_pem(path: &Path, what: &'static str, flag: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        flag,
        path: path.to_owned(),
        source,
    })?;
    if !bytes.windows(10).any(|w| w == b"-----BEGIN") {
        return Err(TlsError::NotPem {
            what,
            flag,
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// The manager's TLS settings from `--tls-cert` and `--tls-key`: `None` for plain gRPC.
pub fn server_config(
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Result<Option<ServerTlsConfig>, TlsError> {
    match (cert, key) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => {
            let cert = read_pem(cert, "certificate", "cert")?;
            let key = read_pem(key, "private key", "key")?;
            Ok(Some(
                ServerTlsConfig::new().identity(Identity::from_pem(cert, key)),
            ))
        }
        _ => Err(TlsError::Half),
    }
}

/// Whether `url` asks for TLS.
pub fn is_https(url: &str) -> bool {
    url.get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
}

/// `endpoint` (to `url`) with TLS when `url` is `https://`: trusting `ca` (PEM) if given, else
/// the system's roots. A CA with a plain `http://` URL is refused rather than ignored.
pub fn client_endpoint(
    endpoint: Endpoint,
    url: &str,
    ca: Option<&Path>,
) -> Result<Endpoint, TlsError> {
    if !is_https(url) {
        return match ca {
            Some(_) => Err(TlsError::CaWithoutHttps {
                url: url.to_owned(),
            }),
            None => Ok(endpoint),
        };
    }
    let config = match ca {
        Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read_pem(
            ca,
            "CA certificate",
            "ca",
        )?)),
        None => ClientTlsConfig::new().with_native_roots(),
    };
    endpoint.tls_config(config).map_err(|e| TlsError::Setup {
        url: url.to_owned(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked() {
        assert!(server_config(None, None).unwrap().is_none());
        assert!(matches!(
            server_config(Some(Path::new("/c")), None),
            Err(TlsError::Half)
        ));
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let e = server_config(Some(&junk), Some(&junk)).unwrap_err();
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let e = server_config(Some(&dir.path().join("missing")), Some(&junk)).unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }), "{e}");

        assert!(is_https("HTTPS://h:1") && !is_https("http://h:1"));
        let plain = Endpoint::from_static("http://127.0.0.1:1");
        assert!(client_endpoint(plain.clone(), "http://127.0.0.1:1", None).is_ok());
        let e = client_endpoint(plain, "http://127.0.0.1:1", Some(&junk)).unwrap_err();
        assert!(e.to_string().contains("https://"), "{e}");
        let tls = Endpoint::from_static("https://127.0.0.1:1");
        let e = client_endpoint(tls.clone(), "https://127.0.0.1:1", Some(&junk)).unwrap_err();
        assert!(e.to_string().contains("--tls-ca"), "{e}");
        assert!(client_endpoint(tls, "https://127.0.0.1:1", None).is_ok());
    }
}
