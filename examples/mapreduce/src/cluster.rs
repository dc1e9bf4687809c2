//! Everything this demo does with regions, and nothing else: this file is
//! the "regions-specific code" whose size the README reports (count it with
//! `examples/mapreduce/loc.sh`). The rest of the job (`hist.rs`, `main.rs`)
//! is an ordinary single-host program.
//!
//! Regions are files under a mount: the input is `mmap`ed from the mount,
//! histograms are written and read with file calls, placement is an xattr,
//! and the phases meet at a cluster-wide barrier (`regions::sync`).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{IsTerminal as _, Write as _};
use std::ops::Range;
use std::os::fd::AsRawFd as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use anyhow::{Context as _, Result, bail};

/// The host id of the regions mount `mount`.
pub fn host_id(mount: &Path) -> Result<u32> {
    regions::agent::host_id_for(mount)
        .with_context(|| format!("{} is not a regionfs mount", mount.display()))
}

/// Creates directory `dir` whose regions are held in `host`'s memory.
pub fn mkdir_on_host(dir: &Path, host: u32) -> Result<()> {
    std::fs::create_dir(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    set_xattr(dir, "user.regions.hostalloc", host.to_string().as_bytes())
}

/// Claims the name `path` for this process, cluster-wide: true when this
/// call made the directory, false when some process (on any host) had.
pub fn claim(path: &Path) -> Result<bool> {
    match std::fs::create_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot claim {}", path.display())),
    }
}

/// The hosts holding the region at `path` (`user.regions.hosts`).
pub fn hosts_of(path: &Path) -> Result<String> {
    let c_path = c_path(path)?;
    let mut buf = [0u8; 256];
    // SAFETY: both strings are NUL-terminated; `buf` is writable for its length.
    let n = unsafe {
        libc::getxattr(
            c_path.as_ptr(),
            c"user.regions.hosts".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        let err = std::io::Error::last_os_error();
        bail!(
            "cannot read user.regions.hosts of {}: {err}",
            path.display()
        );
    }
    Ok(String::from_utf8_lossy(&buf[..n as usize]).into_owned())
}

/// Writes a whole region at `path` and flushes it to the cluster (close-to-
/// open: a host that opens it afterwards reads these bytes). A long write
/// shows its progress when stderr is a terminal.
pub fn publish(path: &Path, bytes: &[u8]) -> Result<()> {
    const PIECE: usize = 64 << 20;
    let mut f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let progress = bytes.len() > PIECE && std::io::stderr().is_terminal();
    for (i, piece) in bytes.chunks(PIECE).enumerate() {
        f.write_all(piece)
            .with_context(|| format!("cannot write {}", path.display()))?;
        if progress {
            let done = (i * PIECE + piece.len()) as u64;
            eprint!(
                "\r  writing {}: {} / {} MiB ({}%)",
                path.display(),
                done >> 20,
                bytes.len() >> 20,
                done * 100 / bytes.len() as u64
            );
        }
    }
    if progress {
        eprintln!();
    }
    f.sync_all()
        .with_context(|| format!("cannot flush {}", path.display()))
}

/// Bytes `range` of the region at `path`.
pub fn read_range(path: &Path, range: Range<u64>) -> Result<Vec<u8>> {
    let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut buf = vec![0u8; (range.end - range.start) as usize];
    f.read_exact_at(&mut buf, range.start)
        .with_context(|| format!("cannot read {:?} of {}", range, path.display()))?;
    Ok(buf)
}

/// Drops this mount's cached pages of `path`, so the next reader on this
/// host fetches the bytes from the region's host (a cold start).
pub fn drop_cached(path: &Path) -> Result<()> {
    let f = OpenOptions::new().read(true).open(path)?;
    // SAFETY: fadvise on an open fd only changes cache state.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise({}): errno {rc}", path.display());
    }
    Ok(())
}

/// A read-only `mmap` of part of a region file.
pub struct Mapped {
    /// None for an empty range (mmap cannot map 0 bytes).
    map: Option<memmap2::Mmap>,
}

impl Mapped {
    /// Maps bytes `range` of the region at `path` (`range.start` page-aligned).
    pub fn new(path: &Path, range: Range<u64>) -> Result<Mapped> {
        let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let len = usize::try_from(range.end.saturating_sub(range.start))
            .with_context(|| format!("{range:?} of {} is too long to map", path.display()))?;
        if len == 0 {
            return Ok(Mapped { map: None });
        }
        // SAFETY: a shared read-only mapping of an open region file; the
        // region is not truncated nor written while the job reads it.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(range.start)
                .len(len)
                .map(&f)
        }
        .with_context(|| format!("cannot mmap {:?} of {}", range, path.display()))?;
        Ok(Mapped { map: Some(map) })
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// Defines barrier `name` for `n` processes, through the agent of `mount`.
pub fn barrier_init(mount: &Path, name: &str, n: u32) -> Result<()> {
    let sync = regions::sync::SyncClient::for_mount(Some(mount))?;
    sync.barrier_init(name, n)
        .with_context(|| format!("barrier_init({name}, {n})"))
}

/// Waits at barrier `name` until all its processes have arrived (the
/// agent of `mount` forwards the wait to the manager).
pub fn barrier_wait(mount: &Path, name: &str) -> Result<u64> {
    let sync = regions::sync::SyncClient::for_mount(Some(mount))?;
    sync.barrier_wait(name)
        .with_context(|| format!("barrier_wait({name})"))
}

/// Removes barrier `name`.
pub fn barrier_delete(mount: &Path, name: &str) -> Result<()> {
    let sync = regions::sync::SyncClient::for_mount(Some(mount))?;
    sync.delete(name)
        .with_context(|| format!("deleting barrier {name}"))
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) -> Result<()> {
    let (c_path, c_name) = (c_path(path)?, CString::new(name)?);
    // SAFETY: NUL-terminated strings and a readable value buffer.
    let rc = unsafe {
        libc::setxattr(
            c_path.as_ptr(),
            c_name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        bail!("cannot set {name} on {}: {err}", path.display());
    }
    Ok(())
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{} has a NUL", path.display()))
}
