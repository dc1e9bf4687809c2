//! Harness of the mount tests: real `regionfs` processes (and, for
//! multi-host tests, the workspace's `regions-manager` and `regions-daemon`
//! binaries), every wait bounded, everything started killed and unmounted
//! by Drop guards.

#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a process has to become ready.
pub const START: Duration = Duration::from_secs(30);
/// How long a process has to exit after SIGTERM.
pub const STOP: Duration = Duration::from_secs(15);

/// The regionfs binary of this build.
pub fn regionfs_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_regionfs"))
}

/// A workspace binary next to this test's profile directory
/// (`target/debug/NAME`); it must have been built with `cargo build --bins`.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executables live in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} not found: run `cargo build --bins` in the workspace first",
        path.display()
    );
    path
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether `path` is a mount point now, and its file-system type.
pub fn mount_type(path: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = path.to_string_lossy();
    info.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        (left.split_whitespace().nth(4)? == want)
            .then(|| right.split_whitespace().next().unwrap_or("").to_owned())
    })
}

/// A process started with `--ready-file`; killed and reaped on drop.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub pid: u32,
    pub ready: String,
    log: PathBuf,
}

impl Proc {
    /// Starts `bin args... --ready-file DIR/NAME.ready`, logging to
    /// `DIR/NAME.log`, and waits for the ready file.
    pub fn start(bin: &Path, args: &[&std::ffi::OsStr], dir: &Path, name: &str) -> Proc {
        let ready = dir.join(format!("{name}.ready"));
        let _ = std::fs::remove_file(&ready);
        let log = dir.join(format!("{name}.log"));
        let file = File::create(&log).expect("log file");
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(file));
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info,fuser=warn");
        }
        let child = cmd.spawn().expect("spawn");
        let mut p = Proc {
            name: name.to_owned(),
            pid: child.id(),
            child: Some(child),
            ready: String::new(),
            log,
        };
        let deadline = Instant::now() + START;
        loop {
            if let Some(status) = p.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("{name} exited with {status} before ready:\n{}", p.log());
            }
            if let Ok(t) = std::fs::read_to_string(&ready) {
                p.ready = t.trim().to_owned();
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "{name} not ready within {START:?}:\n{}",
                p.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status (SIGKILL and panic after [`STOP`]).
    pub fn sigterm(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        signal(self.pid, rustix::process::Signal::TERM);
        match wait_timeout(&mut child, STOP) {
            Some(s) => s,
            None => {
                let _ = child.kill();
                let _ = wait_timeout(&mut child, STOP);
                panic!("{} ignored SIGTERM:\n{}", self.name, self.log());
            }
        }
    }

    /// SIGKILL (no clean-up) and reap.
    pub fn sigkill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = wait_timeout(&mut child, STOP);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(self.pid, rustix::process::Signal::TERM);
            if wait_timeout(&mut child, STOP).is_none() {
                let _ = child.kill();
                let _ = wait_timeout(&mut child, STOP);
            }
        }
    }
}

/// A mount (by `regionfs up` or `regionfs mount`); detached on drop if the
/// process left it behind.
pub struct Mount {
    pub proc: Proc,
    pub mountpoint: PathBuf,
}

impl Mount {
    pub fn path(&self, rel: &str) -> PathBuf {
        self.mountpoint.join(rel)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.proc.child.is_some() {
            let _ = self.proc.sigterm();
        }
        if mount_type(&self.mountpoint).is_some() {
            let _ = rustix::mount::unmount(&self.mountpoint, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// `regionfs up` in a fresh directory.
pub struct Up {
    pub mount: Mount,
    pub dir: tempfile::TempDir,
}

impl std::ops::Deref for Up {
    type Target = Mount;
    fn deref(&self) -> &Mount {
        &self.mount
    }
}

impl std::ops::DerefMut for Up {
    fn deref_mut(&mut self) -> &mut Mount {
        &mut self.mount
    }
}

/// The arguments of `regionfs up` on `dir` (mount at `dir/mnt`).
pub fn up_args(dir: &Path, extra: &[&str]) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec![
        "up".into(),
        dir.join("mnt").into(),
        "--data-dir".into(),
        dir.join("data").into(),
        "--memory".into(),
        "512M".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--transport-listen".into(),
        "127.0.0.1:0".into(),
    ];
    args.extend(extra.iter().map(Into::into));
    args
}

/// Starts `regionfs up` in `dir`.
pub fn up_in(dir: &Path, extra: &[&str]) -> Mount {
    let args = up_args(dir, extra);
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let proc = Proc::start(&regionfs_bin(), &refs, dir, "regionfs-up");
    let mountpoint = PathBuf::from(&proc.ready);
    assert_eq!(
        mountpoint,
        dir.join("mnt"),
        "the ready file names the mountpoint"
    );
    Mount { proc, mountpoint }
}

/// Starts `regionfs up` in a fresh temporary directory.
pub fn up(extra: &[&str]) -> Up {
    let dir = tempfile::Builder::new()
        .prefix("regionfs-up")
        .tempdir()
        .expect("tempdir");
    let mount = up_in(dir.path(), extra);
    Up { mount, dir }
}

/// A manager, `hosts` daemons and a `regionfs mount` per host, all real
/// processes.
pub struct Cluster {
    pub mounts: Vec<Mount>,
    pub daemons: Vec<Proc>,
    pub manager: Proc,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    pub fn start(hosts: u32, memory: &str) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("regionfs-cluster")
            .tempdir()
            .expect("tempdir");
        let d = dir.path();
        let secret = d.join("secret");
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&secret)
                .expect("secret");
            std::io::Write::write_all(&mut f, b"regionfs-test-secret-0123456789\n")
                .expect("secret");
        }
        let data = d.join("manager");
        std::fs::create_dir_all(&data).expect("data dir");
        let manager = Proc::start(
            &workspace_bin("regions-manager"),
            &[
                "--listen".as_ref(),
                "127.0.0.1:0".as_ref(),
                "--data-dir".as_ref(),
                data.as_os_str(),
                "--secret-file".as_ref(),
                secret.as_os_str(),
            ],
            d,
            "manager",
        );
        let url = format!("http://{}", manager.ready);
        let mut daemons = Vec::new();
        let mut mounts = Vec::new();
        for host in 1..=hosts {
            let socket = d.join(format!("h{host}.sock"));
            let host_s = host.to_string();
            daemons.push(Proc::start(
                &workspace_bin("regions-daemon"),
                &[
                    "--manager".as_ref(),
                    url.as_ref(),
                    "--host-id".as_ref(),
                    host_s.as_ref(),
                    "--listen".as_ref(),
                    "127.0.0.1:0".as_ref(),
                    "--memory".as_ref(),
                    memory.as_ref(),
                    "--socket".as_ref(),
                    socket.as_os_str(),
                    "--secret-file".as_ref(),
                    secret.as_os_str(),
                ],
                d,
                &format!("daemon{host}"),
            ));
            let mountpoint = d.join(format!("mnt{host}"));
            let proc = Proc::start(
                &regionfs_bin(),
                &[
                    "mount".as_ref(),
                    "--manager".as_ref(),
                    url.as_ref(),
                    "--host-id".as_ref(),
                    host_s.as_ref(),
                    "--secret-file".as_ref(),
                    secret.as_os_str(),
                    "--agent-socket".as_ref(),
                    socket.as_os_str(),
                    mountpoint.as_os_str(),
                ],
                d,
                &format!("mount{host}"),
            );
            mounts.push(Mount { proc, mountpoint });
        }
        Cluster {
            mounts,
            daemons,
            manager,
            dir,
        }
    }
}

/// The errno of a failed std call (0 on success).
pub fn errno_of<T>(r: std::io::Result<T>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

/// Runs `sh -c script`, asserting success; returns stdout.
pub fn sh(script: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts two byte strings are equal, naming the first difference (never
/// printing megabytes).
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if got == want {
        return;
    }
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    panic!(
        "{what}: {} bytes read, {} expected, first difference at {first:?}",
        got.len(),
        want.len()
    );
}
