//! How the administrative subcommands (`status`, `compact`) reach a cluster: the manager's URL
//! and the cluster secret, found where the daemon and `regionfs up` keep it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use regions::manager_client::ManagerClient;
use regions_proto::auth::Secret;

/// Where the cluster secret is looked for when `--secret-file` is not given.
const SECRET_FILES: [&str; 2] = ["/etc/regions/secret", "/var/lib/regions/secret"];

/// The manager and the secret an administrative subcommand uses.
#[derive(Args, Debug)]
pub struct ClusterAccess {
    /// URL of the manager (`http://host:port`, `https://host:port` when it serves TLS; a bare
    /// `host:port` means http).
    #[arg(long, env = "REGIONS_MANAGER", default_value = "http://127.0.0.1:7070")]
    pub manager: String,
    /// CA certificate (PEM) that signed the manager's TLS certificate (https:// URLs; default:
    /// the system's roots).
    #[arg(long, env = "REGIONS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// File holding the cluster secret (default: /etc/regions/secret, else the one
    /// `regionfs up` keeps in /var/lib/regions).
    #[arg(long, env = "REGIONS_SECRET_FILE")]
    pub secret_file: Option<PathBuf>,
    /// How long to wait for the manager.
    #[arg(long, env = "REGIONS_STATUS_TIMEOUT_MS", default_value_t = 5_000)]
    pub timeout_ms: u64,
}

impl ClusterAccess {
    /// The cluster secret.
    pub fn secret(&self) -> anyhow::Result<Secret> {
        let path = match &self.secret_file {
            Some(path) => path.clone(),
            None => SECRET_FILES
                .iter()
                .map(PathBuf::from)
                .find(|p| p.exists())
                .with_context(|| {
                    format!(
                        "no cluster secret in {}: name it with --secret-file",
                        SECRET_FILES.join(" or ")
                    )
                })?,
        };
        Secret::from_file(&path)
            .with_context(|| format!("cannot read the cluster secret in {}", path.display()))
    }

    /// A client of the manager, the secret, and the manager's URL.
    pub fn connect(&self) -> anyhow::Result<(ManagerClient, Secret, String)> {
        let secret = self.secret()?;
        let url = crate::manager_url(&self.manager);
        let manager = ManagerClient::connect(
            &url,
            &secret,
            self.tls_ca.as_deref(),
            Duration::from_millis(self.timeout_ms),
        )
        .with_context(|| format!("cannot reach the manager at {url}: is it running?"))?;
        Ok((manager, secret, url))
    }
}
