//! Application sessions (docs/ARCHITECTURE.md, "Host agent"): a program that opened a region
//! file under a regions mount reaches the region without the cluster secret. The mount names its host agent
//! (the daemon's Unix socket); the agent opens the region as the verified caller and hands back
//! the map, a transport capability (region, rights, expiry) and, for extents on this host, the
//! segment memfd. Transports to daemons authenticate with the capability, which is renewed
//! through the agent before it expires.
//!
//! ```no_run
//! use std::os::fd::AsFd;
//! let file = std::fs::File::open("/regions/data")?;
//! let region = regions::app::AppRegion::open_fd(file.as_fd())?;
//! let mut buf = [0u8; 16];
//! region.read_at(0, &mut buf)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use regions_proto::capability::now_ms;
use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1;

use crate::agent::{AgentClient, Segment};
use crate::error::{RegionsError, Result};
use crate::transport::tcp::{RetryPolicy, TcpTransport};
use crate::transport::{Span, StatsSnapshot, Transport, TransportStats};

/// Where one 128 KiB chunk of a region lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkLoc {
    /// Held by this host's daemon (reachable through the segment memfd).
    pub local: bool,
    pub pool: u32,
    /// Pool offset of the chunk's first byte.
    pub pool_offset: u64,
    /// Transport address of the pool's daemon.
    pub addr: String,
}

/// What the session knows of the region's placement.
struct MapState {
    size: u64,
    version: u64,
    vaddr: u64,
    fixvaddr: bool,
    entries: Vec<u64>,
    pools: HashMap<u32, v1::PoolInfo>,
}

impl MapState {
    fn apply(&mut self, info: &v1::RegionInfo, grow_only: bool) {
        if info.map_version < self.version {
            return;
        }
        if let Some(attr) = &info.attr {
            self.size = if grow_only {
                self.size.max(attr.size)
            } else {
                attr.size
            };
            self.vaddr = attr.vaddr;
            self.fixvaddr = attr.region_attrs.as_ref().is_some_and(|a| a.fixvaddr);
        }
        if info.map_included {
            self.entries = info.map.clone();
            for p in &info.pools {
                self.pools.insert(p.gid, p.clone());
            }
        }
        self.version = info.map_version;
    }
}

/// A region opened through the host agent.
pub struct AppRegion {
    ino: u64,
    /// Device of the mount the region was opened through (0 when opened by inode).
    dev: u64,
    handle: u64,
    write: bool,
    host_id: u32,
    agent: Mutex<AgentClient>,
    state: RwLock<MapState>,
    /// Capability token id on this session's connections (random, nonzero).
    cap_id: u64,
    token: Mutex<Vec<u8>>,
    /// When to renew (Unix ms): half-way to the expiry.
    renew_at_ms: AtomicU64,
    transports: Mutex<HashMap<String, Arc<TcpTransport>>>,
    stats: Arc<TransportStats>,
    retry: RetryPolicy,
    closed: AtomicBool,
}

impl std::fmt::Debug for AppRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppRegion")
            .field("ino", &self.ino)
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

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

fn renew_at(now: u64, expires_ms: u64) -> u64 {
    now + expires_ms.saturating_sub(now) / 2
}

impl AppRegion {
    /// Opens the region of `fd`, a file opened under a regions mount, with the fd's rights
    /// (read-only fd: read-only capability).
    pub fn open_fd(fd: BorrowedFd<'_>) -> Result<Arc<AppRegion>> {
        let write = fd_writable(fd)?;
        let (agent, ino) = AgentClient::for_fd(fd)?;
        Self::open_with(agent, ino, write, device_of(fd)?)
    }

    /// Opens region `ino` through the agent at `socket`.
    pub fn open_ino(socket: &Path, ino: u64, write: bool) -> Result<Arc<AppRegion>> {
        Self::open_with(AgentClient::connect(socket)?, ino, write, 0)
    }

    /// Opens the region at `path` under a regions mount (read-write when `write`).
    pub fn open_path(path: &Path, write: bool) -> Result<Arc<AppRegion>> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
            .map_err(|e| RegionsError::io(format!("cannot open {}", path.display()), e))?;
        let fd = std::os::fd::AsFd::as_fd(&file);
        let (agent, ino) = AgentClient::for_fd(fd)?;
        Self::open_with(agent, ino, write, device_of(fd)?)
    }

    fn open_with(
        mut agent: AgentClient,
        ino: u64,
        write: bool,
        dev: u64,
    ) -> Result<Arc<AppRegion>> {
        let host_id = agent.stats()?.host_id;
        let info = agent.open(ino, write)?;
        if info.capability.is_empty() {
            return Err(RegionsError::Protocol {
                peer: "host agent".into(),
                reason: "open reply without a transport capability (manager too old?)".into(),
            });
        }
        let mut state = MapState {
            size: 0,
            version: 0,
            vaddr: 0,
            fixvaddr: false,
            entries: Vec::new(),
            pools: HashMap::new(),
        };
        state.apply(&info, false);
        let cap_id = rand::random::<u64>() | 1;
        Ok(Arc::new(AppRegion {
            ino,
            dev,
            handle: info.handle,
            write,
            host_id,
            agent: Mutex::new(agent),
            state: RwLock::new(state),
            cap_id,
            token: Mutex::new(info.capability.clone()),
            renew_at_ms: AtomicU64::new(renew_at(now_ms(), info.capability_expires_ms)),
            transports: Mutex::new(HashMap::new()),
            stats: Arc::default(),
            retry: RetryPolicy::default(),
            closed: AtomicBool::new(false),
        }))
    }

    fn poisoned() -> RegionsError {
        RegionsError::Invalid("region state lock poisoned by a panic in another thread".into())
    }

    fn agent(&self) -> Result<std::sync::MutexGuard<'_, AgentClient>> {
        self.agent.lock().map_err(|_| Self::poisoned())
    }

    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// Device number of the mount it was opened through (0 when opened by inode): with the
    /// inode, it names the region among several clusters.
    pub fn dev(&self) -> u64 {
        self.dev
    }

    /// Whether the region was opened for writing.
    pub fn writable(&self) -> bool {
        self.write
    }

    /// This host's id.
    pub fn host_id(&self) -> u32 {
        self.host_id
    }

    /// Size in bytes as last seen.
    pub fn size(&self) -> u64 {
        self.state.read().map_or(0, |s| s.size)
    }

    /// The region's fixed virtual address (FIXVADDR regions), else 0.
    pub fn vaddr(&self) -> u64 {
        self.state
            .read()
            .map_or(0, |s| if s.fixvaddr { s.vaddr } else { 0 })
    }

    /// Traffic counters of this session's transports.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// This host's segment memfd of the region, if this host holds part of it.
    pub fn segment(&self) -> Result<Option<Segment>> {
        self.agent()?.segment(self.ino, self.write)
    }

    /// Whether any chunk is held on this host.
    pub fn has_local_chunks(&self) -> bool {
        self.state
            .read()
            .is_ok_and(|s| s.pools.values().any(|p| p.host_id == self.host_id))
    }

    /// Where chunk `index` lives.
    pub fn chunk(&self, index: u64) -> Result<ChunkLoc> {
        let state = self.state.read().map_err(|_| Self::poisoned())?;
        let entry = state
            .entries
            .get(index as usize)
            .and_then(|e| MapEntry::decode(*e))
            .ok_or_else(|| RegionsError::Protocol {
                peer: "host agent".into(),
                reason: format!("region {} has no chunk {index} in its map", self.ino),
            })?;
        let pool = state
            .pools
            .get(&entry.gid)
            .ok_or_else(|| RegionsError::Protocol {
                peer: "host agent".into(),
                reason: format!("region {} names unknown pool {}", self.ino, entry.gid),
            })?;
        Ok(ChunkLoc {
            local: pool.host_id == self.host_id,
            pool: entry.gid,
            pool_offset: entry.pool_offset,
            addr: pool.transport_addr.clone(),
        })
    }

    /// Fetches the map again (if changed) and renews the capability.
    pub fn refresh(&self) -> Result<()> {
        let known = self.state.read().map_or(0, |s| s.version);
        // Renewal names this open's handle: once the manager closed it (this host's lease
        // ended), nothing is renewed and the region answers EIO (the process is fenced).
        let info = self
            .agent()?
            .map_refresh(self.ino, known, self.write, self.handle)?;
        self.take_capability(&info);
        self.state
            .write()
            .map_err(|_| Self::poisoned())?
            .apply(&info, false);
        Ok(())
    }

    fn take_capability(&self, info: &v1::RegionInfo) {
        if info.capability.is_empty() {
            return;
        }
        if let Ok(mut token) = self.token.lock() {
            token.clone_from(&info.capability);
        }
        self.renew_at_ms.store(
            renew_at(now_ms(), info.capability_expires_ms),
            Ordering::Relaxed,
        );
        if let Ok(transports) = self.transports.lock() {
            for t in transports.values() {
                t.set_token(&info.capability);
            }
        }
    }

    /// Renews the capability when it is past half its life.
    fn renew_if_due(&self) -> Result<()> {
        if now_ms() < self.renew_at_ms.load(Ordering::Relaxed) {
            return Ok(());
        }
        tracing::debug!(ino = self.ino, "renewing the transport capability");
        self.refresh()
    }

    /// Grows the region to at least `size` bytes.
    pub fn extend(&self, size: u64) -> Result<()> {
        let info = self.agent()?.map_extend(self.ino, size)?;
        self.state
            .write()
            .map_err(|_| Self::poisoned())?
            .apply(&info, true);
        Ok(())
    }

    /// The capability-authenticated transport to the daemon at `addr`.
    pub fn transport(&self, addr: &str) -> Result<Arc<TcpTransport>> {
        self.renew_if_due()?;
        let token = self.token.lock().map_err(|_| Self::poisoned())?.clone();
        let mut map = self.transports.lock().map_err(|_| Self::poisoned())?;
        Ok(Arc::clone(map.entry(addr.to_owned()).or_insert_with(
            || {
                Arc::new(TcpTransport::with_capability(
                    addr,
                    self.cap_id,
                    &token,
                    self.retry,
                    Arc::clone(&self.stats),
                ))
            },
        )))
    }

    /// Splits `[offset, offset + len)` into spans per daemon address.
    fn spans(&self, offset: u64, len: u64) -> Result<Vec<(String, Span)>> {
        let mut out: Vec<(String, Span)> = Vec::new();
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let index = at / CHUNK_SIZE;
            let within = at % CHUNK_SIZE;
            let n = (CHUNK_SIZE - within).min(end - at);
            let loc = self.chunk(index)?;
            let span = Span {
                ino: self.ino,
                region_offset: at,
                pool: loc.pool,
                pool_offset: loc.pool_offset + within,
                len: n,
            };
            match out.last_mut() {
                Some((addr, last))
                    if *addr == loc.addr
                        && last.pool == span.pool
                        && last.pool_offset + last.len == span.pool_offset =>
                {
                    last.len += n;
                }
                _ => out.push((loc.addr, span)),
            }
            at += n;
        }
        Ok(out)
    }

    /// Reads up to `buf.len()` bytes at `offset` over the transports; returns how many.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let size = self.size();
        if offset >= size || buf.is_empty() {
            return Ok(0);
        }
        self.with_fresh_capability(|| {
            // Again on a retry: the refresh may have brought a smaller size (a truncate).
            let size = self.size();
            if offset >= size {
                return Ok(0);
            }
            let n = (size - offset).min(buf.len() as u64) as usize;
            let mut done = 0usize;
            for (addr, span) in self.spans(offset, n as u64)? {
                let len = span.len as usize;
                self.transport(&addr)?
                    .read(&[span], &mut buf[done..done + len])?;
                done += len;
            }
            Ok(n)
        })
    }

    /// Runs `op` and, if a daemon says the map or the capability is out of date (a stale map,
    /// or a token revoked by a `chmod`, `chown`, unlink or truncate), fetches both again
    /// (permission is checked again) and tries once more.
    fn with_fresh_capability<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        match op() {
            Err(e) if e.calls_for_refresh() => {
                tracing::debug!(ino = self.ino, error = %e, "renewing the map and capability");
                self.refresh()?;
                op()
            }
            other => other,
        }
    }

    /// Writes `data` at `offset` over the transports, growing the region first when needed.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let end = offset + data.len() as u64;
        if end > self.size() {
            self.extend(end)?;
        }
        // Writing the same bytes again is harmless, so a retry may cover spans already done.
        self.with_fresh_capability(|| {
            // Again on a retry: the refresh may have brought a smaller size (a truncate).
            if end > self.size() {
                self.extend(end)?;
            }
            let mut done = 0usize;
            for (addr, span) in self.spans(offset, data.len() as u64)? {
                let len = span.len as usize;
                self.transport(&addr)?
                    .write(&[span], &data[done..done + len])?;
                done += len;
            }
            Ok(())
        })
    }

    /// Closes the open handle at the manager (also done on drop).
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        self.agent()?.map_close(self.handle)
    }
}

impl Drop for AppRegion {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::debug!(ino = self.ino, error = %e, "closing the region handle failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_is_due_half_way() {
        assert_eq!(renew_at(1000, 3000), 2000);
        assert_eq!(renew_at(5000, 3000), 5000);
    }

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
