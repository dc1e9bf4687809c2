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

pub use regions_proto::ROOT_INO;

pub use regions_proto::MAX_GRPC_MESSAGE as MAX_MESSAGE;

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
    let secret = Secret::new(&token).context("generated secret was refused")?;
    secret
        .write_file(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(secret)
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
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
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

/// The number of cases a fuzz test runs: `REGIONS_FUZZ_CASES`, else `default` (what CI
/// runs; the README's long runs set 100,000).
pub fn fuzz_cases(default: usize) -> usize {
    std::env::var("REGIONS_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The seed of a fuzz run: `REGIONS_FUZZ_SEED` (to replay a failure), else a random one; it
/// is printed so that a failure can be replayed.
pub fn fuzz_seed() -> u64 {
    let seed = std::env::var("REGIONS_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("REGIONS_FUZZ_SEED={seed}");
    seed
}

/// `regions-attack` copied into `dir` with mode 0755, so that an unprivileged user can run it
/// whatever the permissions of the checkout (the isolation tests drop children to `nobody`).
pub fn attack_binary(dir: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let copy = dir.join("regions-attack");
    std::fs::copy(bin_path("regions-attack")?, &copy)
        .with_context(|| format!("cannot copy regions-attack to {}", copy.display()))?;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))?;
    Ok(copy)
}

/// The value of extended attribute `name` of `path` (`getxattr(2)`, at most 4 KiB).
pub fn get_xattr(path: &Path, name: &str) -> std::io::Result<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let n = std::ffi::CString::new(name)?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

/// Sets extended attribute `name` of `path` to `value` (`setxattr(2)`, no flags).
pub fn set_xattr(path: &Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let n = std::ffi::CString::new(name)?;
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Starts `cmd`, trying again for up to 2 s while the kernel says `ETXTBSY`: an executable
/// a test has just written (as [`attack_binary`] does) stays "busy" while a child that another
/// test thread forked meanwhile still holds the writing descriptor, until that child execs.
pub fn spawn_retrying(cmd: &mut Command) -> std::io::Result<Child> {
    let until = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        match cmd.spawn() {
            Err(e)
                if e.raw_os_error() == Some(libc::ETXTBSY) && std::time::Instant::now() < until =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            r => return r,
        }
    }
}

/// Runs `cmd` to completion with its output captured, killing it if it has not exited after
/// `timeout` (so a hung child fails the test instead of hanging it).
pub fn output_within(cmd: &mut Command, timeout: Duration) -> anyhow::Result<std::process::Output> {
    use std::io::Read;
    let mut child = spawn_retrying(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .with_context(|| format!("cannot start {cmd:?}"))?;
    let Some(status) = wait_timeout(&mut child, timeout)? else {
        let _ = child.kill();
        let _ = child.wait();
        bail!("{cmd:?} did not finish within {timeout:?}; killed");
    };
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    if let Some(mut out) = child.stdout.take() {
        out.read_to_end(&mut stdout)?;
    }
    if let Some(mut err) = child.stderr.take() {
        err.read_to_end(&mut stderr)?;
    }
    Ok(std::process::Output {
        status,
        stdout,
        stderr,
    })
}

/// How many lines of a node's log a failed test prints.
const LOG_TAIL_ON_FAILURE: usize = 40;

/// A running node process (`regions-manager`, `regions-daemon`) started
/// with a ready file.
///
/// Its stderr goes to a log file (see [`NodeProcess::log`]), and it runs
/// with `RUST_LOG=warn` unless the test's environment sets `RUST_LOG`.
/// Dropping the value SIGKILLs the process (by PID) and reaps it.
pub struct NodeProcess {
    name: String,
    child: Option<Child>,
    /// Process id.
    pub pid: u32,
    /// What the process wrote to its ready file.
    pub ready: String,
    log_path: PathBuf,
    /// Holds the ready file and the log; removed on drop.
    run_dir: tempfile::TempDir,
}

impl NodeProcess {
    /// Starts binary `name` with `args` followed by `--ready-file PATH` and
    /// waits (at most [`START_TIMEOUT`]) until the ready file appears.
    pub fn start(name: &str, args: &[std::ffi::OsString]) -> anyhow::Result<NodeProcess> {
        NodeProcess::start_wrapped(&[], name, args)
    }

    /// [`NodeProcess::start`] run through `wrapper` (e.g. `["nsenter", "--net=/run/netns/x"]`,
    /// which execs the binary, so the pid is still the binary's).
    pub fn start_wrapped(
        wrapper: &[std::ffi::OsString],
        name: &str,
        args: &[std::ffi::OsString],
    ) -> anyhow::Result<NodeProcess> {
        let bin = bin_path(name)?;
        let run_dir = tempfile::Builder::new()
            .prefix(&format!("{name}-run"))
            .tempdir()
            .context("cannot create a directory for the ready file")?;
        let ready = run_dir.path().join("ready");
        let log_path = run_dir.path().join(format!("{name}.log"));
        let log = File::create(&log_path)
            .with_context(|| format!("cannot create {}", log_path.display()))?;
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        cmd.args(args)
            .arg("--ready-file")
            .arg(&ready)
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
        let mut proc = NodeProcess {
            name: name.to_owned(),
            child: Some(child),
            pid,
            ready: String::new(),
            log_path,
            run_dir,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = proc.try_wait()? {
                bail!(
                    "{name} (pid {pid}) exited with {status} before serving; its log:\n{}",
                    proc.log()
                );
            }
            // Ready files are written to a temporary name and renamed, so a
            // file that exists is complete.
            if let Ok(text) = std::fs::read_to_string(&ready) {
                proc.ready = text.trim().to_owned();
                return Ok(proc);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{name} (pid {pid}) did not write its ready file within {START_TIMEOUT:?}; its log:\n{}",
                    proc.log()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// A directory that lives as long as the process value (for sockets).
    pub fn run_dir(&self) -> &Path {
        self.run_dir.path()
    }

    /// What the process wrote to stderr so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path)
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", self.log_path.display()))
    }

    /// The exit status if the process has exited (reaping it), else `None`.
    pub fn try_wait(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => child.try_wait().context("waitpid failed"),
            None => bail!("{} (pid {}) was already stopped", self.name, self.pid),
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Kills the process with SIGKILL (no chance to clean up) and reaps it.
    pub fn sigkill(&mut self) -> anyhow::Result<()> {
        let mut child = self
            .child
            .take()
            .with_context(|| format!("{} (pid {}) was already stopped", self.name, self.pid))?;
        if child.try_wait()?.is_none() {
            send_signal(self.pid, libc::SIGKILL)?;
        }
        // SIGKILL cannot be caught: the exit follows promptly, but bound the
        // wait anyway.
        match wait_timeout(&mut child, Duration::from_secs(10))? {
            Some(_) => Ok(()),
            None => bail!("{} (pid {}) survived SIGKILL for 10 s", self.name, self.pid),
        }
    }

    /// Sends SIGTERM and waits at most `timeout` for the process to exit,
    /// returning its exit status. On timeout the process is SIGKILLed and an
    /// error returned.
    pub fn sigterm_and_wait(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let mut child = self
            .child
            .take()
            .with_context(|| format!("{} (pid {}) was already stopped", self.name, self.pid))?;
        if let Some(status) = child.try_wait()? {
            bail!(
                "{} (pid {}) had already exited with {status}; its log:\n{}",
                self.name,
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
            "{} (pid {}) did not exit within {timeout:?} of SIGTERM; killed it. Its log:\n{}",
            self.name,
            self.pid,
            self.log()
        )
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The test failed: what the process logged goes with the failure (its log is
            // removed with the run directory).
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(LOG_TAIL_ON_FAILURE)..].join("\n");
            eprintln!(
                "--- last lines of {} (pid {}) ---\n{tail}",
                self.name, self.pid
            );
        }
        if let Some(mut child) = self.child.take() {
            // `Child::kill` sends SIGKILL to this child's PID; it fails only
            // when the child was already reaped, which `take` rules out.
            let _ = child.kill();
            let _ = wait_timeout(&mut child, Duration::from_secs(10));
        }
    }
}

/// A running `regions-manager` process (see [`NodeProcess`]).
pub struct ManagerProcess {
    /// Address the manager serves gRPC on.
    pub addr: SocketAddr,
    process: NodeProcess,
}

impl std::ops::Deref for ManagerProcess {
    type Target = NodeProcess;
    fn deref(&self) -> &NodeProcess {
        &self.process
    }
}

impl std::ops::DerefMut for ManagerProcess {
    fn deref_mut(&mut self) -> &mut NodeProcess {
        &mut self.process
    }
}

impl ManagerProcess {
    /// Starts the manager on `data_dir` with the secret in `secret_file`,
    /// listening on a free loopback port, and waits (at most
    /// [`START_TIMEOUT`]) until it serves.
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
        let mut args: Vec<std::ffi::OsString> = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            data_dir.into(),
            "--secret-file".into(),
            secret_file.into(),
        ];
        args.extend(extra.iter().map(Into::into));
        ManagerProcess::from_process(NodeProcess::start("regions-manager", &args)?)
    }

    /// A manager listening on `listen` (e.g. "10.0.0.1:0"), run through `wrapper` (see
    /// [`NodeProcess::start_wrapped`]).
    pub fn start_in(
        wrapper: &[std::ffi::OsString],
        listen: &str,
        data_dir: &Path,
        secret_file: &Path,
        extra: &[&str],
    ) -> anyhow::Result<ManagerProcess> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--listen".into(),
            listen.into(),
            "--data-dir".into(),
            data_dir.into(),
            "--secret-file".into(),
            secret_file.into(),
        ];
        args.extend(extra.iter().map(Into::into));
        ManagerProcess::from_process(NodeProcess::start_wrapped(
            wrapper,
            "regions-manager",
            &args,
        )?)
    }

    fn from_process(process: NodeProcess) -> anyhow::Result<ManagerProcess> {
        let addr = process.ready.parse().with_context(|| {
            format!(
                "the manager's ready file holds {:?}, not an address",
                process.ready
            )
        })?;
        Ok(ManagerProcess { addr, process })
    }
}

/// A running `regions-daemon` process (see [`NodeProcess`]).
pub struct DaemonProcess {
    pub host_id: u32,
    /// Transport address clients connect to.
    pub addr: String,
    /// The host agent's Unix socket.
    pub socket: PathBuf,
    process: NodeProcess,
}

impl std::ops::Deref for DaemonProcess {
    type Target = NodeProcess;
    fn deref(&self) -> &NodeProcess {
        &self.process
    }
}

impl std::ops::DerefMut for DaemonProcess {
    fn deref_mut(&mut self) -> &mut NodeProcess {
        &mut self.process
    }
}

impl DaemonProcess {
    /// Starts a daemon for `host_id` offering `memory` (e.g. "1G") to the
    /// manager at `manager`, with its agent socket in `socket_dir`, and
    /// waits until it is registered and serving.
    pub fn start(
        manager: SocketAddr,
        secret_file: &Path,
        host_id: u32,
        memory: &str,
        socket_dir: &Path,
    ) -> anyhow::Result<DaemonProcess> {
        DaemonProcess::start_in(
            &[],
            "127.0.0.1:0",
            manager,
            secret_file,
            host_id,
            memory,
            socket_dir,
        )
    }

    /// [`DaemonProcess::start`] with the transport on `listen` (e.g. "10.0.0.2:0"), run
    /// through `wrapper` (see [`NodeProcess::start_wrapped`]).
    pub fn start_in(
        wrapper: &[std::ffi::OsString],
        listen: &str,
        manager: SocketAddr,
        secret_file: &Path,
        host_id: u32,
        memory: &str,
        socket_dir: &Path,
    ) -> anyhow::Result<DaemonProcess> {
        let socket = socket_dir.join(format!("h{host_id}.sock"));
        let args: Vec<std::ffi::OsString> = vec![
            "--manager".into(),
            format!("http://{manager}").into(),
            "--host-id".into(),
            host_id.to_string().into(),
            "--listen".into(),
            listen.into(),
            "--memory".into(),
            memory.into(),
            "--socket".into(),
            socket.clone().into(),
            "--secret-file".into(),
            secret_file.into(),
        ];
        let process = NodeProcess::start_wrapped(wrapper, "regions-daemon", &args)?;
        Ok(DaemonProcess {
            host_id,
            addr: process.ready.clone(),
            socket,
            process,
        })
    }

    /// [`DaemonProcess::start`] with extra command-line arguments
    /// (e.g. `["--metrics-listen", "127.0.0.1:9100"]`).
    pub fn start_with_args(
        manager: SocketAddr,
        secret_file: &Path,
        host_id: u32,
        memory: &str,
        socket_dir: &Path,
        extra: &[&str],
    ) -> anyhow::Result<DaemonProcess> {
        let socket = socket_dir.join(format!("h{host_id}.sock"));
        let mut args: Vec<std::ffi::OsString> = vec![
            "--manager".into(),
            format!("http://{manager}").into(),
            "--host-id".into(),
            host_id.to_string().into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--memory".into(),
            memory.into(),
            "--socket".into(),
            socket.clone().into(),
            "--secret-file".into(),
            secret_file.into(),
        ];
        args.extend(extra.iter().map(Into::into));
        let process = NodeProcess::start("regions-daemon", &args)?;
        Ok(DaemonProcess {
            host_id,
            addr: process.ready.clone(),
            socket,
            process,
        })
    }
}

/// A running `regionfs mount` process and its mount point.
///
/// Dropping it stops the process with SIGTERM (a clean unmount), or
/// SIGKILL after a bound, and then detaches any mount left behind.
pub struct MountProcess {
    pub host_id: u32,
    pub mountpoint: PathBuf,
    process: NodeProcess,
}

impl std::ops::Deref for MountProcess {
    type Target = NodeProcess;
    fn deref(&self) -> &NodeProcess {
        &self.process
    }
}

impl std::ops::DerefMut for MountProcess {
    fn deref_mut(&mut self) -> &mut NodeProcess {
        &mut self.process
    }
}

impl MountProcess {
    /// Mounts the cluster of `manager` at `mountpoint` as host `host_id`,
    /// using that host's agent socket, and waits until the mount answers.
    pub fn start(
        manager: SocketAddr,
        secret_file: &Path,
        host_id: u32,
        agent_socket: &Path,
        mountpoint: &Path,
    ) -> anyhow::Result<MountProcess> {
        MountProcess::start_in(&[], manager, secret_file, host_id, agent_socket, mountpoint)
    }

    /// [`MountProcess::start`] run through `wrapper` (see [`NodeProcess::start_wrapped`]; a
    /// network namespace leaves the mount visible to everyone).
    pub fn start_in(
        wrapper: &[std::ffi::OsString],
        manager: SocketAddr,
        secret_file: &Path,
        host_id: u32,
        agent_socket: &Path,
        mountpoint: &Path,
    ) -> anyhow::Result<MountProcess> {
        MountProcess::start_wrapped_with_args(
            wrapper,
            manager,
            secret_file,
            host_id,
            agent_socket,
            mountpoint,
            &[],
        )
    }

    /// [`MountProcess::start`] with extra `regionfs mount` arguments
    /// (e.g. `["--metrics-listen", "127.0.0.1:9100"]`).
    pub fn start_with_args(
        manager: SocketAddr,
        secret_file: &Path,
        host_id: u32,
        agent_socket: &Path,
        mountpoint: &Path,
        extra: &[&str],
    ) -> anyhow::Result<MountProcess> {
        MountProcess::start_wrapped_with_args(
            &[],
            manager,
            secret_file,
            host_id,
            agent_socket,
            mountpoint,
            extra,
        )
    }

    /// [`MountProcess::start_in`] with extra `regionfs mount` arguments.
    pub fn start_wrapped_with_args(
        wrapper: &[std::ffi::OsString],
        manager: SocketAddr,
        secret_file: &Path,
        host_id: u32,
        agent_socket: &Path,
        mountpoint: &Path,
        extra: &[&str],
    ) -> anyhow::Result<MountProcess> {
        std::fs::create_dir_all(mountpoint)
            .with_context(|| format!("cannot create {}", mountpoint.display()))?;
        let mut args: Vec<std::ffi::OsString> = vec![
            "mount".into(),
            "--manager".into(),
            format!("http://{manager}").into(),
            "--host-id".into(),
            host_id.to_string().into(),
            "--secret-file".into(),
            secret_file.into(),
            "--agent-socket".into(),
            agent_socket.into(),
        ];
        args.extend(extra.iter().map(Into::into));
        args.push(mountpoint.into());
        let process = NodeProcess::start_wrapped(wrapper, "regionfs", &args)?;
        Ok(MountProcess {
            host_id,
            mountpoint: mountpoint.to_owned(),
            process,
        })
    }

    /// A path inside the mount.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.mountpoint.join(rel)
    }
}

impl Drop for MountProcess {
    fn drop(&mut self) {
        if self.process.is_running() {
            let _ = self.process.sigterm_and_wait(Duration::from_secs(10));
        }
        if is_mounted(&self.mountpoint) {
            let _ = detach(&self.mountpoint);
        }
    }
}

/// Whether `path` is a mount point (listed in /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .any(|m| m == want)
}

/// Lazily unmounts `path` (MNT_DETACH), for cleanup after a crash.
pub fn detach(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).context("path has a NUL")?;
    // SAFETY: umount2 reads a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        let err = std::io::Error::last_os_error();
        bail!("umount2({}) failed: {err}", path.display());
    }
    Ok(())
}

/// A manager and daemons on loopback: hosts `1..=n`, each a real process.
pub struct Cluster {
    pub manager: ManagerProcess,
    pub daemons: Vec<DaemonProcess>,
    pub secret: Secret,
    pub secret_file: PathBuf,
    /// Holds the data directory, the secret and the agent sockets.
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts a manager and `hosts` daemons offering `memory` each.
    pub fn start(hosts: u32, memory: &str) -> anyhow::Result<Cluster> {
        Cluster::start_with(hosts, memory, &[])
    }

    /// [`Cluster::start`] with extra manager arguments (e.g. `["--lease-ms", "1000"]`).
    pub fn start_with(hosts: u32, memory: &str, manager_args: &[&str]) -> anyhow::Result<Cluster> {
        Cluster::start_with_daemon_args(hosts, memory, manager_args, &[])
    }

    /// [`Cluster::start_with`] with extra arguments for every daemon.
    pub fn start_with_daemon_args(
        hosts: u32,
        memory: &str,
        manager_args: &[&str],
        daemon_args: &[&str],
    ) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new()
            .prefix("regions-cluster")
            .tempdir()
            .context("cannot create the cluster directory")?;
        let secret_file = dir.path().join("secret");
        let secret = write_secret(&secret_file)?;
        let data = dir.path().join("manager");
        std::fs::create_dir_all(&data)?;
        let manager = ManagerProcess::start_with_args(&data, &secret_file, manager_args)?;
        let mut daemons = Vec::new();
        for host in 1..=hosts {
            daemons.push(DaemonProcess::start_with_args(
                manager.addr,
                &secret_file,
                host,
                memory,
                dir.path(),
                daemon_args,
            )?);
        }
        Ok(Cluster {
            manager,
            daemons,
            secret,
            secret_file,
            dir,
        })
    }

    /// The manager's address as a URL.
    pub fn manager_url(&self) -> String {
        format!("http://{}", self.manager.addr)
    }

    /// The manager's counters (`Cluster.Stats`), from a plain thread.
    pub fn stats(&self) -> anyhow::Result<v1::StatsReply> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut c = connect(self.manager.addr, &self.secret).await?;
            Ok(c.cluster.stats(v1::StatsRequest {}).await?.into_inner())
        })
    }

    /// Namespace and region requests the manager has answered so far.
    pub fn file_requests(&self) -> anyhow::Result<u64> {
        Ok(self.stats()?.file_requests)
    }

    /// Mounts the cluster as host `host` at a fresh directory.
    pub fn mount(&self, host: u32) -> anyhow::Result<MountProcess> {
        let daemon = self.daemon(host)?;
        let mountpoint = self.dir.path().join(format!("mnt{host}"));
        MountProcess::start(
            self.manager.addr,
            &self.secret_file,
            host,
            &daemon.socket,
            &mountpoint,
        )
    }

    /// The daemon of `host`.
    pub fn daemon(&self, host: u32) -> anyhow::Result<&DaemonProcess> {
        self.daemons
            .iter()
            .find(|d| d.host_id == host)
            .with_context(|| format!("no daemon for host {host}"))
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
        by_inode: false,
        lease_session: 0,
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

pub mod bench_transport;
pub mod heap_runs;
pub mod many_regions;
pub mod memory_cgroup;
pub mod metrics_page;
pub mod netns;
pub mod soft_roce;

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// The directory holding this build's libregions.so and libregions.a: the calling test
/// binary's own directory, `target/<profile>/deps`.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .expect("the test binary is in target/<profile>/deps")
        .to_path_buf()
}

/// Installs this build's libregions (library, header, pkg-config file) into a fresh prefix
/// with `scripts/install-libregions.sh --lib-dir`.
pub fn install_libregions() -> tempfile::TempDir {
    let prefix = tempfile::Builder::new()
        .prefix("libregions-prefix")
        .tempdir()
        .expect("a temporary prefix");
    let script = repo_root().join("scripts/install-libregions.sh");
    // Another cargo build may be rewriting target/*/deps right now: retry.
    let mut attempts = 0;
    let out = loop {
        let out = Command::new(&script)
            .arg("--lib-dir")
            .arg(lib_dir())
            .arg(prefix.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        attempts += 1;
        if out.status.success() || attempts == 5 {
            break out;
        }
        std::thread::sleep(Duration::from_secs(3));
    };
    assert!(
        out.status.success(),
        "install-libregions.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    prefix
}

/// Names the Python the tests run (default: `python3` on PATH, else Debian's).
pub const PYTHON_ENV: &str = "REGIONS_TEST_PYTHON";

/// A Python with numpy: `$REGIONS_TEST_PYTHON`, else the first of `python3` (PATH) and
/// `/usr/bin/python3` (where Debian's python3-numpy goes, when PATH leads to another Python
/// first) that imports it. Fails the test when there is none: numpy must be checked.
pub fn python_with_numpy() -> std::ffi::OsString {
    let candidates: Vec<std::ffi::OsString> = match std::env::var_os(PYTHON_ENV) {
        Some(py) => vec![py],
        None => vec!["python3".into(), "/usr/bin/python3".into()],
    };
    for py in &candidates {
        let ok = Command::new(py)
            .args(["-c", "import numpy"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return py.clone();
        }
    }
    panic!(
        "none of {candidates:?} imports numpy: this test needs numpy (apt-get install -y \
         python3-numpy, or set {PYTHON_ENV} to a Python that has it)"
    );
}

/// Runs `cat path` as nobody (uid and gid 65534), 20 s at most: how the tests show a file
/// refused to an unprivileged user.
pub fn cat_as_nobody(path: &Path) -> anyhow::Result<std::process::Output> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new("cat");
    cmd.arg(path).uid(65534).gid(65534);
    output_within(&mut cmd, Duration::from_secs(20))
}

/// A two-host cluster whose manager grants cache leases of term `term_ms`, with a mount on
/// each host that has opened its lease session (tests of cache leases and leased opens).
/// The mounts go before the cluster.
pub struct LeaseMounts {
    /// Host 1's mount.
    pub a: MountProcess,
    /// Host 2's mount.
    pub b: MountProcess,
    /// The cluster.
    pub cluster: Cluster,
}

impl LeaseMounts {
    /// Starts the cluster and the mounts; waits (10 s at most) for both lease sessions.
    pub fn start(term_ms: u64) -> anyhow::Result<LeaseMounts> {
        let term = term_ms.to_string();
        let cluster = Cluster::start_with(2, "256M", &["--cache-lease-term-ms", term.as_str()])?;
        let a = cluster.mount(1)?;
        let b = cluster.mount(2)?;
        // Each mount opens its lease session right after mounting.
        let deadline = Instant::now() + Duration::from_secs(10);
        while cluster.stats()?.cache_lease_sessions < 2 {
            if Instant::now() >= deadline {
                bail!("the mounts opened no cache-lease session within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(LeaseMounts { a, b, cluster })
    }
}
