//! Mounting and unmounting: the mountpoint is checked first (a stale mount
//! left by a crash is lazily detached, a live one is an error that says to
//! unmount it), the session runs on threads of its own, readiness is
//! checked before the ready file is written, and unmounting is bounded.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fuser::{Config, MountOption, Session, SessionACL, SessionUnmounter};
use rustix::mount::{UnmountFlags, unmount};

use crate::fs::RegionFs;
use crate::fuse::{FuseFs, Kernel};

/// `statfs.f_type` of FUSE file systems.
pub const FUSE_SUPER_MAGIC: u64 = 0x6573_5546;
/// How long a stat of a suspicious mountpoint may take.
const STAT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the new mount has to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the mount asks the manager whether it still holds the handles of its opens (a
/// host whose lease ended has them closed, and its opens answer `EIO`).
const HANDLE_CHECK_EVERY: Duration = Duration::from_secs(1);

/// Why mounting or unmounting failed; every message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// No FUSE device.
    #[error(
        "/dev/fuse is missing: load the fuse module (modprobe fuse) or run with access to /dev/fuse"
    )]
    NoFuse,
    /// A working mount is in the way.
    #[error(
        "{0} is already mounted and answering: unmount it first (umount {0}) or pick another mountpoint"
    )]
    LiveMount(String),
    /// A mount is in the way and does not answer.
    #[error(
        "a mount at {0} does not answer: if its server is gone, run `umount -l {0}` and start again"
    )]
    Hung(String),
    /// The mountpoint is a file.
    #[error("{0} is not a directory: pick a directory as mountpoint")]
    NotDir(String),
    /// The mountpoint is busy.
    #[error("{path} is busy: {cause}; stop the processes using it (fuser -vm {path}) and retry")]
    Busy {
        /// The mountpoint.
        path: String,
        /// The OS error.
        cause: io::Error,
    },
    /// A system call failed.
    #[error("{what}: {cause}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        cause: io::Error,
    },
    /// The new mount did not answer in time.
    #[error("the mount at {0} did not answer within {1:?} after mounting")]
    NotReady(String, Duration),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> MountError {
    let what = what.into();
    move |cause| MountError::Io { what, cause }
}

/// How to mount.
#[derive(Clone, Debug)]
pub struct MountOptions {
    /// Threads serving FUSE requests (at least 2: a notification may wait
    /// for a request another thread serves).
    pub threads: usize,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions { threads: 4 }
    }
}

/// Raises the kernel's read-ahead of the FUSE mount at `mountpoint` (its bdi's
/// `read_ahead_kb`) to [`crate::fuse::MAX_READAHEAD`]: the kernel starts FUSE mounts at 128 KiB
/// whatever `init` asked. Best effort (logged at debug level).
pub fn raise_readahead(mountpoint: &Path) {
    let Ok(meta) = std::fs::metadata(mountpoint) else {
        return;
    };
    let dev = meta.dev();
    let path = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        rustix::fs::major(dev),
        rustix::fs::minor(dev)
    );
    let kib = crate::fuse::MAX_READAHEAD / 1024;
    match std::fs::write(&path, kib.to_string()) {
        Ok(()) => tracing::debug!(%path, kib, "readahead raised"),
        Err(e) => tracing::debug!(%path, error = %e, "cannot raise readahead"),
    }
}

/// An absolute, lexically normalised path (no file-system access, so it
/// works on a dead mount).
pub fn absolute(path: &Path) -> io::Result<PathBuf> {
    let base = if path.is_absolute() {
        PathBuf::new()
    } else {
        std::env::current_dir()?
    };
    let mut out = PathBuf::new();
    for c in base.join(path).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    Ok(out)
}

/// Undoes the octal escapes of `/proc/self/mountinfo` (`\040` for space).
pub fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// Where it is mounted.
    pub mountpoint: String,
    /// File-system type (`fuse.regions`).
    pub fstype: String,
    /// Mount source (`regions`).
    pub source: String,
}

/// Parses `/proc/self/mountinfo` text.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mountpoint = unescape(left.split_whitespace().nth(4)?);
            let mut r = right.split_whitespace();
            let fstype = r.next()?.to_owned();
            let source = unescape(r.next().unwrap_or(""));
            Some(MountEntry {
                mountpoint,
                fstype,
                source,
            })
        })
        .collect()
}

/// Mounts at `path` now, per `/proc/self/mountinfo`.
pub fn mounts_at(path: &Path) -> Vec<MountEntry> {
    let want = path.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| parse_mountinfo(&t))
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.mountpoint == want)
        .collect()
}

/// stat(2) with a deadline (a hung FUSE server would block forever).
fn stat_bounded(path: &Path) -> Option<io::Result<std::fs::Metadata>> {
    let (tx, rx) = mpsc::channel();
    let p = path.to_owned();
    let spawned = std::thread::Builder::new()
        .name("regionfs-stat".into())
        .spawn(move || {
            let _ = tx.send(std::fs::metadata(&p));
        });
    if spawned.is_err() {
        return Some(std::fs::metadata(path));
    }
    rx.recv_timeout(STAT_TIMEOUT).ok()
}

/// Lazily detaches the mount at `path`.
pub fn detach(path: &Path) -> io::Result<()> {
    unmount(path, UnmountFlags::DETACH).map_err(io::Error::from)
}

/// Makes `path` ready to mount on: checks that FUSE is available,
/// detaches stale mounts left by a crash, refuses live ones, creates the
/// directory when missing. Returns the absolute mountpoint.
pub fn prepare_mountpoint(path: &Path) -> Result<PathBuf, MountError> {
    if !Path::new("/dev/fuse").exists() {
        return Err(MountError::NoFuse);
    }
    let abs = absolute(path).map_err(io_err("cannot resolve the mountpoint"))?;
    let shown = abs.display().to_string();
    for _ in 0..8 {
        match stat_bounded(&abs) {
            None => return Err(MountError::Hung(shown)),
            Some(Ok(meta)) => {
                if !meta.is_dir() {
                    return Err(MountError::NotDir(shown));
                }
                if mounts_at(&abs).iter().any(|m| m.fstype.starts_with("fuse")) {
                    return Err(MountError::LiveMount(shown));
                }
                return Ok(abs);
            }
            Some(Err(e)) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                tracing::warn!(mountpoint = %shown, "found a stale mount left by a regionfs that died; detaching it");
                detach(&abs)
                    .map_err(io_err(format!("cannot detach the stale mount at {shown}")))?;
            }
            Some(Err(e)) if e.kind() == io::ErrorKind::NotFound => {
                std::fs::create_dir_all(&abs)
                    .map_err(io_err(format!("cannot create the mountpoint {shown}")))?;
                tracing::info!(mountpoint = %shown, "created the mountpoint");
            }
            Some(Err(e)) => {
                return Err(MountError::Io {
                    what: format!("cannot stat the mountpoint {shown}"),
                    cause: e,
                });
            }
        }
    }
    Err(MountError::LiveMount(shown))
}

/// Writes `content` to `path` atomically (temporary file, then rename).
pub fn write_ready_file(path: &Path, content: &str) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, path)
}

/// A mounted file system.
pub struct Mounted {
    mountpoint: PathBuf,
    unmounter: SessionUnmounter,
    done: mpsc::Receiver<io::Result<()>>,
    thread: Option<JoinHandle<()>>,
    /// FUSE connection number (the superblock's minor device number).
    connection: Option<u32>,
    finished: bool,
}

impl Mounted {
    /// Mounts `core` at `mountpoint` (already prepared).
    pub fn mount(
        core: Arc<RegionFs>,
        mountpoint: &Path,
        options: &MountOptions,
    ) -> Result<Mounted, MountError> {
        if !Path::new("/dev/fuse").exists() {
            return Err(MountError::NoFuse);
        }
        let shown = mountpoint.display().to_string();
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("regions".into()),
            // The kernel takes the subtype as a mount option ("fuse.regions").
            MountOption::CUSTOM("subtype=regions".into()),
            MountOption::NoAtime,
            // Device nodes and setuid files on the mount are entries only (docs/SECURITY.md).
            MountOption::NoDev,
            MountOption::NoSuid,
        ];
        config.acl = SessionACL::All;
        config.n_threads = Some(options.threads.max(2));
        config.clone_fd = true;
        let fs = FuseFs::new(Arc::clone(&core));
        let mut session =
            Session::new(fs, mountpoint, &config).map_err(|e| match e.raw_os_error() {
                Some(libc::EBUSY) => MountError::Busy {
                    path: shown.clone(),
                    cause: e,
                },
                Some(libc::ENODEV) | Some(libc::ENXIO) => MountError::NoFuse,
                _ => MountError::Io {
                    what: format!("cannot mount at {shown}"),
                    cause: e,
                },
            })?;
        core.set_kernel(Arc::new(Kernel(session.notifier())));
        core.start_handle_watch(HANDLE_CHECK_EVERY)
            .map_err(io_err("cannot start the handle watch thread"))?;
        core.start_cache_leases()
            .map_err(io_err("cannot start the cache-lease thread"))?;
        let unmounter = session.unmount_callable();
        let (tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("regionfs-session".into())
            .spawn(move || {
                let r = session.run();
                let _ = tx.send(r);
            })
            .map_err(io_err("cannot start the FUSE session thread"))?;
        let mut mounted = Mounted {
            mountpoint: mountpoint.to_owned(),
            unmounter,
            done,
            thread: Some(thread),
            connection: None,
            finished: false,
        };
        mounted.wait_ready()?;
        mounted.tune_readahead();
        tracing::info!(mountpoint = %shown, threads = options.threads.max(2), "mounted");
        Ok(mounted)
    }

    fn wait_ready(&mut self) -> Result<(), MountError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(st) = rustix::fs::statfs(&self.mountpoint)
                && st.f_type as u64 == FUSE_SUPER_MAGIC
                && let Ok(meta) = std::fs::metadata(&self.mountpoint)
            {
                self.connection = Some(rustix::fs::minor(meta.dev()));
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(MountError::NotReady(
                    self.mountpoint.display().to_string(),
                    READY_TIMEOUT,
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Large sequential reads: raise the mount's readahead window (the
    /// FUSE handshake caps it at the device default).
    fn tune_readahead(&self) {
        raise_readahead(&self.mountpoint);
    }

    /// The mountpoint.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Waits until the session ends by itself (someone unmounted it), up
    /// to `timeout`; true when it ended.
    pub fn wait_ended(&mut self, timeout: Duration) -> bool {
        if self.finished {
            return true;
        }
        match self.done.recv_timeout(timeout) {
            Ok(r) => {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "the FUSE session ended with an error");
                }
                self.finished = true;
                if let Some(t) = self.thread.take() {
                    let _ = t.join();
                }
                true
            }
            Err(mpsc::RecvTimeoutError::Timeout) => false,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.finished = true;
                true
            }
        }
    }

    /// Unmounts: a clean unmount, or when busy a lazy detach and, after
    /// `grace`, an abort of the FUSE connection so that nothing hangs.
    pub fn unmount(mut self, grace: Duration) -> Result<(), MountError> {
        self.unmount_inner(grace)
    }

    fn unmount_inner(&mut self, grace: Duration) -> Result<(), MountError> {
        if self.finished {
            return Ok(());
        }
        let shown = self.mountpoint.display().to_string();
        match self.unmounter.unmount() {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(mountpoint = %shown, error = %e, "unmount failed (busy?); detaching lazily: processes still inside keep working until they leave");
                if let Err(e) = detach(&self.mountpoint)
                    && e.raw_os_error() != Some(libc::EINVAL)
                {
                    tracing::warn!(mountpoint = %shown, error = %e, "lazy detach failed");
                }
            }
        }
        if self.wait_ended(grace) {
            tracing::info!(mountpoint = %shown, "unmounted");
            return Ok(());
        }
        if let Some(conn) = self.connection {
            ensure_fusectl(conn);
            let abort = format!("/sys/fs/fuse/connections/{conn}/abort");
            match std::fs::write(&abort, "1") {
                Ok(()) => {
                    tracing::warn!(mountpoint = %shown, "aborted the FUSE connection: files still open there now fail with ENOTCONN")
                }
                Err(e) => tracing::warn!(%abort, error = %e, "cannot abort the FUSE connection"),
            }
        }
        if self.wait_ended(grace) {
            return Ok(());
        }
        // Give up waiting: the connection ends when this process exits and
        // its /dev/fuse descriptors close.
        self.finished = true;
        tracing::warn!(mountpoint = %shown, "the FUSE session is still in use; it ends when this process exits");
        Ok(())
    }
}

/// Mounts the FUSE control file system (where connections are aborted)
/// when it is not mounted yet, as systemd does at boot.
fn ensure_fusectl(conn: u32) {
    let dir = Path::new("/sys/fs/fuse/connections");
    if dir.join(conn.to_string()).exists() || !dir.is_dir() {
        return;
    }
    match rustix::mount::mount(
        "fusectl",
        dir,
        "fusectl",
        rustix::mount::MountFlags::empty(),
        None,
    ) {
        Ok(()) => tracing::info!("mounted fusectl at /sys/fs/fuse/connections"),
        Err(e) => tracing::debug!(error = %e, "cannot mount fusectl"),
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if !self.finished
            && let Err(e) = self.unmount_inner(Duration::from_secs(5))
        {
            tracing::warn!(error = %e, "unmount at drop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(
            absolute(Path::new("/a/./b/../c")).unwrap(),
            PathBuf::from("/a/c")
        );
        let rel = absolute(Path::new("x")).unwrap();
        assert!(rel.is_absolute() && rel.ends_with("x"));
        assert_eq!(unescape(r"/mnt/a\040b"), "/mnt/a b");
        assert_eq!(unescape(r"/x\\"), r"/x\\");
        assert_eq!(unescape(r"\011"), "\t");
    }

    #[test]
    fn mountinfo() {
        let text = "36 35 98:0 / /mnt/with\\040space rw,noatime shared:1 - fuse.regions regions rw,user_id=0\n\
                    22 1 0:21 / /proc rw,nosuid - proc proc rw\n\
                    bad line\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 2);
        assert_eq!(
            m[0],
            MountEntry {
                mountpoint: "/mnt/with space".into(),
                fstype: "fuse.regions".into(),
                source: "regions".into()
            }
        );
        assert!(
            mounts_at(Path::new("/proc"))
                .iter()
                .any(|e| e.fstype == "proc")
        );
    }

    #[test]
    fn prepare_creates_and_ready_file_is_atomic() {
        let dir = tempfile::tempdir().unwrap();
        let mp = dir.path().join("a/b/mnt");
        assert_eq!(prepare_mountpoint(&mp).unwrap(), mp);
        assert!(mp.is_dir());
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            prepare_mountpoint(&file),
            Err(MountError::NotDir(_))
        ));
        let ready = dir.path().join("ready");
        write_ready_file(&ready, "/mnt\n").unwrap();
        assert_eq!(std::fs::read_to_string(&ready).unwrap(), "/mnt\n");
        assert!(!dir.path().join("ready.tmp").exists());
    }
}
