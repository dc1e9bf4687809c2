//! Shared harness for the integration tests: starts real processes, bounds every wait.
//!
//! The tests in `tests/tests/` and the benchmarks in `tests/benches/` run the
//! workspace's real binaries (not in-process servers), so that durability,
//! signal handling and start-up are tested exactly as deployed:
//!
//! - [`bin_path`] finds a binary built by `cargo build --bins` (or
//!   `cargo build --release --bins` for benchmarks).
//! - [`ManagerProcess`] runs `regions-manager` on a data directory, waits
//!   (bounded) until it serves, and kills it by PID when dropped, so a failing
//!   test never leaks a process.
//! - [`connect`] builds gRPC clients that present the cluster secret.
//! - [`caller`] builds the `Caller` every request carries.
//!
//! Every wait here has a deadline; nothing blocks forever on a process or a
//! socket.

use std::fs::File;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use regions_proto::auth::{AttachSecret, Secret};
use regions_proto::v1::{
    self, cluster_client::ClusterClient, namespace_client::NamespaceClient,
    regions_client::RegionsClient,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

pub use regions_proto::errno::errno_of;

/// Inode number of the namespace root.
pub const ROOT_INO: u64 = 1;

/// Largest gRPC message a client accepts (the manager's limit too).
pub const MAX_MESSAGE: usize = 256 << 20;

/// How long [`ManagerProcess::start`] waits for the ready file.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long [`connect`] waits for a TCP connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Deadline of every gRPC request made by clients from [`connect`].
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Interval at which waits poll a process or a file.
const POLL: Duration = Duration::from_millis(5);

/// Locates the workspace binary `name`.
///
/// Looks in `$REGIONS_BIN_DIR` when that is set, else in the directory two
/// levels above the running executable: test and bench executables live in
/// `target/<profile>/deps/`, so this is `target/debug` for tests and
/// `target/release` for `cargo bench`.
///
/// Fails with instructions when the binary has not been built: integration
/// tests do not build other packages' binaries by themselves.
pub fn bin_path(name: &str) -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("REGIONS_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().context("cannot find the running executable")?;
            exe.parent()
                .and_then(Path::parent)
                .map(Path::to_path_buf)
                .with_context(|| format!("{} has no grandparent directory", exe.display()))?
        }
    };
    let path = dir.join(name);
    if !path.is_file() {
        let profile = if dir.ends_with("release") {
            "--release "
        } else {
            ""
        };
        bail!(
            "binary {name} not found at {}: run `cargo build {profile}--bins` in the workspace first \
             (or set REGIONS_BIN_DIR to the directory holding it)",
            path.display()
        );
    }
    Ok(path)
}

/// Writes a fresh random cluster secret to `path` and returns it.
pub fn write_secret(path: &Path) -> anyhow::Result<Secret> {
    let token: String = (0..32)
        .map(|_| {
            let i = rand::random_range(0..62u8);
            char::from(match i {
                0..=9 => b'0' + i,
                10..=35 => b'a' + i - 10,
                _ => b'A' + i - 36,
            })
        })
        .collect();
    let mut file =
        File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    writeln!(file, "{token}").with_context(|| format!("cannot write {}", path.display()))?;
    Secret::new(&token).context("generated secret was refused")
}

/// Sends `signal` to `pid`.
fn send_signal(pid: u32, signal: libc::c_int) -> anyhow::Result<()> {
    let pid = libc::pid_t::try_from(pid).context("pid out of range")?;
    // SAFETY: kill(2) has no memory-safety preconditions.
    if unsafe { libc::kill(pid, signal) } != 0 {
        let err = std::io::Error::last_os_error();
        bail!("kill({pid}, {signal}) failed: {err}");
    }
    Ok(())
}

/// Polls `child` until it exits or `timeout` passes; `None` on timeout.
fn wait_timeout(child: &mut Child, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().context("waitpid failed")? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(POLL);
    }
}

/// A running `regions-manager` process.
///
/// Its stderr goes to a log file (see [`ManagerProcess::log`]), and it runs
/// with `RUST_LOG=warn` unless the test's environment sets `RUST_LOG`.
/// Dropping the value SIGKILLs the process (by PID) and reaps it.
pub struct ManagerProcess {
    child: Option<Child>,
    /// Address the manager serves gRPC on.
    pub addr: SocketAddr,
    /// Process id of the manager.
    pub pid: u32,
    log_path: PathBuf,
    /// Holds the ready file and the log; removed on drop.
    _run_dir: tempfile::TempDir,
}

impl ManagerProcess {
    /// Starts the manager on `data_dir` with the secret in `secret_file`,
    /// listening on a free loopback port, and waits (at most
    /// [`START_TIMEOUT`]) until it has written its ready file.
    pub fn start(data_dir: &Path, secret_file: &Path) -> anyhow::Result<ManagerProcess> {
        ManagerProcess::start_with_args(data_dir, secret_file, &[])
    }

    /// [`ManagerProcess::start`] with extra command-line arguments
    /// (e.g. `["--lease-ms", "500"]`).
    pub fn start_with_args(
        data_dir: &Path,
        secret_file: &Path,
        extra: &[&str],
    ) -> anyhow::Result<ManagerProcess> {
        let bin = bin_path("regions-manager")?;
        let run_dir = tempfile::Builder::new()
            .prefix("regions-manager-run")
            .tempdir()
            .context("cannot create a directory for the ready file")?;
        let ready = run_dir.path().join("ready");
        let log_path = run_dir.path().join("manager.log");
        let log = File::create(&log_path)
            .with_context(|| format!("cannot create {}", log_path.display()))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--secret-file")
            .arg(secret_file)
            .arg("--ready-file")
            .arg(&ready)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let pid = child.id();
        // From here on the process is owned by `proc`, whose Drop kills it
        // whatever happens below.
        let mut proc = ManagerProcess {
            child: Some(child),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            pid,
            log_path,
            _run_dir: run_dir,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = proc.try_wait()? {
                bail!(
                    "regions-manager (pid {pid}) exited with {status} before serving; its log:\n{}",
                    proc.log()
                );
            }
            // The manager writes a temporary file and renames it, so a file
            // that exists is complete.
            if let Ok(text) = std::fs::read_to_string(&ready) {
                proc.addr = text.trim().parse().with_context(|| {
                    format!(
                        "ready file {} holds {text:?}, not an address",
                        ready.display()
                    )
                })?;
                return Ok(proc);
            }
            if Instant::now() >= deadline {
                bail!(
                    "regions-manager (pid {pid}) did not write its ready file within {START_TIMEOUT:?}; its log:\n{}",
                    proc.log()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// What the manager wrote to stderr so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path)
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", self.log_path.display()))
    }

    /// The exit status if the process has exited (reaping it), else `None`.
    pub fn try_wait(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => child.try_wait().context("waitpid failed"),
            None => bail!("regions-manager (pid {}) was already stopped", self.pid),
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Kills the manager with SIGKILL (no chance to clean up) and reaps it.
    pub fn sigkill(&mut self) -> anyhow::Result<()> {
        let mut child = self
            .child
            .take()
            .with_context(|| format!("regions-manager (pid {}) was already stopped", self.pid))?;
        if child.try_wait()?.is_none() {
            send_signal(self.pid, libc::SIGKILL)?;
        }
        // SIGKILL cannot be caught: the exit follows promptly, but bound the
        // wait anyway.
        match wait_timeout(&mut child, Duration::from_secs(10))? {
            Some(_) => Ok(()),
            None => bail!(
                "regions-manager (pid {}) survived SIGKILL for 10 s",
                self.pid
            ),
        }
    }

    /// Sends SIGTERM and waits at most `timeout` for the process to exit,
    /// returning its exit status. On timeout the process is SIGKILLed and an
    /// error returned.
    pub fn sigterm_and_wait(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let mut child = self
            .child
            .take()
            .with_context(|| format!("regions-manager (pid {}) was already stopped", self.pid))?;
        if let Some(status) = child.try_wait()? {
            bail!(
                "regions-manager (pid {}) had already exited with {status}; its log:\n{}",
                self.pid,
                self.log()
            );
        }
        send_signal(self.pid, libc::SIGTERM)?;
        if let Some(status) = wait_timeout(&mut child, timeout)? {
            return Ok(status);
        }
        // It ignored SIGTERM: do not leave it running.
        let _ = child.kill();
        let _ = wait_timeout(&mut child, Duration::from_secs(10));
        bail!(
            "regions-manager (pid {}) did not exit within {timeout:?} of SIGTERM; killed it. Its log:\n{}",
            self.pid,
            self.log()
        )
    }
}

impl Drop for ManagerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // `Child::kill` sends SIGKILL to this child's PID; it fails only
            // when the child was already reaped, which `take` rules out.
            let _ = child.kill();
            let _ = wait_timeout(&mut child, Duration::from_secs(10));
        }
    }
}

/// A gRPC channel whose calls carry the cluster secret.
pub type AuthChannel = InterceptedService<Channel, AttachSecret>;

/// Clients of every manager service over one connection.
#[derive(Clone)]
pub struct Clients {
    pub namespace: NamespaceClient<AuthChannel>,
    pub regions: RegionsClient<AuthChannel>,
    pub cluster: ClusterClient<AuthChannel>,
}

/// A channel to `addr` with bounded connect and request times, and no secret.
pub async fn channel(addr: SocketAddr) -> anyhow::Result<Channel> {
    Endpoint::from_shared(format!("http://{addr}"))
        .context("bad manager address")?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("cannot connect to the manager at {addr}"))
}

/// Connects to the manager at `addr`; every call presents `secret`.
pub async fn connect(addr: SocketAddr, secret: &Secret) -> anyhow::Result<Clients> {
    let channel = channel(addr).await?;
    let auth = AttachSecret::new(secret);
    Ok(Clients {
        namespace: NamespaceClient::with_interceptor(channel.clone(), auth.clone())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE),
        regions: RegionsClient::with_interceptor(channel.clone(), auth.clone())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE),
        cluster: ClusterClient::with_interceptor(channel, auth)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE),
    })
}

/// The `Caller` of a request from user `uid` (primary group = uid, no
/// supplementary groups) on host `host`, with this process's pid.
pub fn caller(uid: u32, host: u32) -> Option<v1::Caller> {
    Some(v1::Caller {
        uid,
        gid: uid,
        groups: Vec::new(),
        pid: std::process::id(),
        host_id: host,
    })
}

/// Whether `status` came from the manager (carries an errno) rather than
/// from the transport (connection refused or reset, deadline).
pub fn has_errno(status: &tonic::Status) -> bool {
    status
        .metadata()
        .get(regions_proto::errno::ERRNO_KEY)
        .is_some()
}
