//! Opening a region as an application (docs/ARCHITECTURE.md, "Host agent"): from a file
//! opened under a regions mount, through the mount's host agent (the daemon's Unix socket,
//! named in an extended attribute of the file). The agent opens the region as the verified
//! caller and hands back the map, a transport capability (region, rights, expiry) and, for
//! extents on this host, the segment memfd. No cluster secret is involved.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;

use super::Region;
use super::authority::{AgentSession, Authority};
use crate::agent::AgentClient;
use crate::error::{RegionsError, Result};

/// Whether `fd` was opened for writing.
fn fd_writable(fd: BorrowedFd<'_>) -> Result<bool> {
    // SAFETY: F_GETFL reads the descriptor's flags; `fd` is a valid borrowed descriptor.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(RegionsError::io(
            "cannot read the open flags of the region fd",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(matches!(
        flags & libc::O_ACCMODE,
        libc::O_RDWR | libc::O_WRONLY
    ))
}

/// The device number of the file system `fd` is on.
pub fn device_of(fd: BorrowedFd<'_>) -> Result<u64> {
    file_id(fd).map(|(dev, _)| dev)
}

/// (device, inode) of `fd`; under a regions mount the inode is the region's.
pub fn file_id(fd: BorrowedFd<'_>) -> Result<(u64, u64)> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a full `struct stat` into the buffer for a valid descriptor.
    let r = unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) };
    if r != 0 {
        return Err(RegionsError::io(
            "cannot stat the region fd",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fstat succeeded, so the struct is initialised.
    let st = unsafe { st.assume_init() };
    Ok((st.st_dev, st.st_ino))
}

impl Region {
    /// Opens the region of `fd`, a file opened under a regions mount, with the fd's rights
    /// (read-only fd: read-only capability).
    pub fn open_fd(fd: BorrowedFd<'_>) -> Result<Arc<Region>> {
        let write = fd_writable(fd)?;
        let (agent, ino) = AgentClient::for_fd(fd)?;
        Self::open_through_agent(agent, ino, write, device_of(fd)?)
    }

    /// Opens region `ino` through the host agent at `socket`.
    pub fn open_ino(socket: &Path, ino: u64, write: bool) -> Result<Arc<Region>> {
        Self::open_through_agent(AgentClient::connect(socket)?, ino, write, 0)
    }

    /// Opens the region at `path` under a regions mount (read-write when `write`).
    pub fn open_path(path: &Path, write: bool) -> Result<Arc<Region>> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
            .map_err(|e| RegionsError::io(format!("cannot open {}", path.display()), e))?;
        let fd = std::os::fd::AsFd::as_fd(&file);
        let (agent, ino) = AgentClient::for_fd(fd)?;
        Self::open_through_agent(agent, ino, write, device_of(fd)?)
    }

    fn open_through_agent(
        mut agent: AgentClient,
        ino: u64,
        write: bool,
        dev: u64,
    ) -> Result<Arc<Region>> {
        let host_id = agent.stats()?.host_id;
        let info = agent.open(ino, write)?;
        if info.attr.is_none() || info.capability.is_empty() {
            // A reply this library cannot use: give the handle back before refusing it.
            let _ = agent.map_close(info.handle);
        }
        let session = AgentSession::new(agent, host_id, dev, &info)?;
        let region = Region::with_authority(Authority::Agent(Box::new(session)), info, write)?;
        Ok(Arc::new(region))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_rights() {
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(!fd_writable(std::os::fd::AsFd::as_fd(&f)).unwrap());
        let dir = std::env::temp_dir().join(format!("regions-app-{}", std::process::id()));
        let w = std::fs::File::create(&dir).unwrap();
        assert!(fd_writable(std::os::fd::AsFd::as_fd(&w)).unwrap());
        std::fs::remove_file(&dir).unwrap();
    }
}
