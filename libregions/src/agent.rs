//! The client side of the host agent (the daemon's Unix socket): segment
//! fds for zero-copy access to regions held on this host, and daemon stats.

use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
use prost::Message;
use regions_proto::v1::{self, agent_reply::Body, agent_request::Request};

use crate::error::{RegionsError, Result};
use crate::xattr;

/// Largest agent reply accepted.
const MAX_REPLY: usize = 256 << 20;

/// A connection to a host agent.
pub struct AgentClient {
    path: PathBuf,
    stream: UnixStream,
}

/// A segment fd handed over by the agent.
pub struct Segment {
    pub fd: OwnedFd,
    pub size: u64,
    pub writable: bool,
    /// 8-byte atomics on this memory must go through the daemon, not CPU instructions on a
    /// mapping (its daemon applies every atomic through an RDMA device).
    pub atomics_through_daemon: bool,
}

/// The mount an application uses when it names none: env `REGIONS_MOUNT`,
/// else `/regions`.
pub fn default_mount() -> PathBuf {
    std::env::var_os(MOUNT_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_MOUNT))
}

/// Environment variable naming the regions mount.
pub const MOUNT_ENV: &str = "REGIONS_MOUNT";
/// The conventional mount point.
pub const DEFAULT_MOUNT: &str = "/regions";
/// The attribute regionfs answers on every inode with its host agent socket.
pub const AGENT_XATTR: &str = "user.regions.agent";
/// The attribute regionfs answers on every inode with its host id.
pub const HOSTID_XATTR: &str = "user.regions.hostid";

/// The host agent socket of the regions mount that `path` is in (a file or
/// directory under a regionfs mount, or the mount point itself).
pub fn agent_socket_for(path: &Path) -> Result<PathBuf> {
    let value = xattr::path_value(path, AGENT_XATTR)?;
    Ok(PathBuf::from(std::ffi::OsString::from_vec(value)))
}

/// The host id of the regions mount that `path` is in.
pub fn host_id_for(path: &Path) -> Result<u32> {
    let value = xattr::path_value(path, HOSTID_XATTR)?;
    parse_host_id(&value, &path.display().to_string())
}

fn parse_host_id(value: &[u8], what: &str) -> Result<u32> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| RegionsError::Invalid(format!("{what}: {HOSTID_XATTR} is not a host id")))
}

/// Connections to one host agent kept for the next request: a file system asks for a
/// segment at the first write of every new file, and each connection costs the daemon a
/// thread, so a client keeps a few idle ones rather than one per request.
pub struct AgentPool {
    path: PathBuf,
    idle: Mutex<Vec<AgentClient>>,
}

/// Most idle connections an [`AgentPool`] keeps.
const IDLE_AGENTS: usize = 4;

impl AgentPool {
    pub fn new(path: PathBuf) -> AgentPool {
        AgentPool {
            path,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// [`AgentClient::segment_covering`] on a kept connection (or a new one).
    pub fn segment(&self, ino: u64, write: bool, covering: u64) -> Result<Option<Segment>> {
        let idle = self.idle.lock().ok().and_then(|mut a| a.pop());
        let reused = idle.is_some();
        let mut agent = match idle {
            Some(a) => a,
            None => AgentClient::connect(&self.path)?,
        };
        let mut result = agent.segment_covering(ino, write, covering);
        if reused && result.is_err() {
            // The kept connection may have outlived the agent (a daemon restart: EPIPE,
            // ECONNRESET or end of file): once more on a new one (asking for a segment
            // changes nothing, so a refusal is only asked twice).
            agent = AgentClient::connect(&self.path)?;
            result = agent.segment_covering(ino, write, covering);
        }
        if result.is_ok()
            && let Ok(mut idle) = self.idle.lock()
            && idle.len() < IDLE_AGENTS
        {
            idle.push(agent);
        }
        result
    }
}

impl AgentClient {
    /// The agent of the regions mount at `mount` (default: [`default_mount`]).
    pub fn for_mount(mount: Option<&Path>) -> Result<AgentClient> {
        let mount = mount.map(Path::to_path_buf).unwrap_or_else(default_mount);
        AgentClient::connect(&agent_socket_for(&mount)?)
    }

    /// The agent of the mount that `fd` (an open region file) belongs to,
    /// and the region's inode number.
    pub fn for_fd(fd: BorrowedFd<'_>) -> Result<(AgentClient, u64)> {
        let socket = PathBuf::from(std::ffi::OsString::from_vec(xattr::fd_value(
            fd,
            AGENT_XATTR,
        )?));
        let ino = xattr::fd_ino(fd)?;
        Ok((AgentClient::connect(&socket)?, ino))
    }

    /// The host id of the mount that `fd` belongs to.
    pub fn host_id_of_fd(fd: BorrowedFd<'_>) -> Result<u32> {
        let value = xattr::fd_value(fd, HOSTID_XATTR)?;
        parse_host_id(&value, &format!("fd {}", fd.as_raw_fd()))
    }

    pub fn connect(path: &Path) -> Result<AgentClient> {
        let stream = UnixStream::connect(path).map_err(|e| RegionsError::Agent {
            path: path.display().to_string(),
            errno: e.raw_os_error().unwrap_or(libc::EIO),
            message: format!(
                "cannot connect: {e}; is regions-daemon running with --socket {}?",
                path.display()
            ),
        })?;
        let timeout = Some(Duration::from_secs(30));
        stream
            .set_read_timeout(timeout)
            .and_then(|()| stream.set_write_timeout(timeout))
            .map_err(|e| RegionsError::io("cannot set agent socket timeouts", e))?;
        Ok(AgentClient {
            path: path.to_owned(),
            stream,
        })
    }

    fn error(&self, errno: i32, message: impl Into<String>) -> RegionsError {
        RegionsError::Agent {
            path: self.path.display().to_string(),
            errno,
            message: message.into(),
        }
    }

    /// Sends a request; returns the reply and the fd that came with it.
    fn call(&mut self, request: Request) -> Result<(v1::AgentReply, Option<OwnedFd>)> {
        let body = v1::AgentRequest {
            request: Some(request),
        }
        .encode_to_vec();
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        self.stream
            .write_all(&frame)
            .map_err(|e| self.error(libc::EIO, format!("cannot send: {e}")))?;
        // The length prefix arrives with any fd attached.
        let mut len = [0u8; 4];
        let mut cmsg = nix::cmsg_space!([RawFd; 1]);
        let mut got = 0usize;
        let mut fd = None;
        while got < 4 {
            let mut iov = [IoSliceMut::new(&mut len[got..])];
            let msg = recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .map_err(|e| self.error(e as i32, format!("cannot receive: {e}")))?;
            for c in msg
                .cmsgs()
                .map_err(|e| self.error(libc::EIO, format!("bad control message: {e}")))?
            {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    for raw in fds {
                        // SAFETY: the kernel installed this descriptor in our
                        // table for us; we take sole ownership of it.
                        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                        fd.get_or_insert(owned);
                    }
                }
            }
            if msg.bytes == 0 {
                return Err(self.error(libc::EIO, "the agent closed the connection"));
            }
            got += msg.bytes;
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_REPLY {
            return Err(self.error(libc::EIO, format!("reply of {len} bytes is too large")));
        }
        let mut buf = vec![0u8; len];
        self.stream
            .read_exact(&mut buf)
            .map_err(|e| self.error(libc::EIO, format!("cannot receive: {e}")))?;
        let reply = v1::AgentReply::decode(&buf[..])
            .map_err(|e| self.error(libc::EIO, format!("undecodable reply: {e}")))?;
        if reply.errno != 0 {
            return Err(self.error(reply.errno, reply.message));
        }
        Ok((reply, fd))
    }

    /// The region's segment on this host, if this host holds any of it.
    pub fn segment(&mut self, ino: u64, write: bool) -> Result<Option<Segment>> {
        self.segment_covering(ino, write, 0)
    }

    /// [`AgentClient::segment`], once the segment is at least `covering` bytes long: the
    /// daemon waits a bounded time for the chunk assignments the caller's map already names
    /// (the reply may still be shorter, or have no segment, when the wait ends first).
    pub fn segment_covering(
        &mut self,
        ino: u64,
        write: bool,
        covering: u64,
    ) -> Result<Option<Segment>> {
        let (reply, fd) = self.call(Request::Segment(v1::AgentSegment {
            ino,
            write,
            covering,
        }))?;
        let Some(Body::Segment(seg)) = reply.body else {
            return Err(self.error(libc::EIO, "segment reply without a segment"));
        };
        match (seg.has_fd, fd) {
            (true, Some(fd)) => Ok(Some(Segment {
                fd,
                size: seg.size,
                writable: seg.writable,
                atomics_through_daemon: seg.atomics_through_daemon,
            })),
            (true, None) => {
                Err(self.error(libc::EIO, "segment reply promised an fd but none came"))
            }
            (false, _) => Ok(None),
        }
    }

    /// Opens a region as this process (the agent vouches for the caller).
    pub fn open(&mut self, ino: u64, write: bool) -> Result<v1::RegionInfo> {
        let (reply, _) = self.call(Request::Open(v1::AgentOpen { ino, write }))?;
        match reply.body {
            Some(Body::Region(info)) => Ok(info),
            _ => Err(self.error(libc::EIO, "open reply without region info")),
        }
    }

    /// The region's map (left out when `known_version` is current) and a
    /// fresh transport capability (writable when `write`).
    pub fn map_refresh(
        &mut self,
        ino: u64,
        known_version: u64,
        write: bool,
        handle: u64,
    ) -> Result<v1::RegionInfo> {
        let (reply, _) = self.call(Request::MapRefresh(v1::MapRefresh {
            ino,
            known_version,
            write,
            handle,
        }))?;
        match reply.body {
            Some(Body::Region(info)) => Ok(info),
            _ => Err(self.error(libc::EIO, "map reply without region info")),
        }
    }

    /// Grows region `ino` to at least `size` bytes.
    pub fn map_extend(&mut self, ino: u64, size: u64, chunks: bool) -> Result<v1::RegionInfo> {
        let (reply, _) = self.call(Request::MapExtend(v1::MapExtend { ino, size, chunks }))?;
        match reply.body {
            Some(Body::Region(info)) => Ok(info),
            _ => Err(self.error(libc::EIO, "extend reply without region info")),
        }
    }

    /// Closes a handle returned by [`AgentClient::open`].
    pub fn map_close(&mut self, handle: u64) -> Result<()> {
        self.call(Request::MapClose(v1::MapClose { handle }))
            .map(drop)
    }

    /// The daemon's counters.
    pub fn stats(&mut self) -> Result<v1::DaemonStats> {
        let (reply, _) = self.call(Request::Stats(v1::AgentStats {}))?;
        match reply.body {
            Some(Body::Stats(stats)) => Ok(stats),
            _ => Err(self.error(libc::EIO, "stats reply without stats")),
        }
    }

    /// Creates region `name` in directory `parent` as this process, which becomes its owner:
    /// unless it is PERSISTENT when this process exits, the region is deleted then (the agent
    /// watches the process). `attrs` overrides the directory's defaults.
    pub fn create_owned(
        &mut self,
        parent: u64,
        name: &str,
        mode: u32,
        attrs: Option<v1::RegionAttrOverrides>,
        preallocate: u64,
    ) -> Result<v1::Attr> {
        let (reply, _) = self.call(Request::OwnerCreate(v1::OwnerCreate {
            parent,
            name: name.to_owned(),
            mode,
            attrs,
            preallocate,
        }))?;
        match reply.body {
            Some(Body::OwnerCreated(attr)) => Ok(attr),
            _ => Err(self.error(libc::EIO, "create reply without attributes")),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A stand-in host agent: answers every request with "no segment here", counts the
    /// connections it accepted, and closes the first one after its first reply (as a
    /// restarting daemon would).
    fn stand_in_agent(path: &Path) -> Arc<AtomicUsize> {
        let listener = UnixListener::bind(path).unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let first = count.fetch_add(1, Ordering::SeqCst) == 0;
                std::thread::spawn(move || {
                    loop {
                        let mut len = [0u8; 4];
                        if stream.read_exact(&mut len).is_err() {
                            return;
                        }
                        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
                        if stream.read_exact(&mut body).is_err() {
                            return;
                        }
                        let request = v1::AgentRequest::decode(&body[..]).unwrap();
                        assert!(matches!(request.request, Some(Request::Segment(_))));
                        let reply = v1::AgentReply {
                            body: Some(Body::Segment(v1::SegmentReply::default())),
                            ..Default::default()
                        }
                        .encode_to_vec();
                        let mut frame = (reply.len() as u32).to_le_bytes().to_vec();
                        frame.extend_from_slice(&reply);
                        if stream.write_all(&frame).is_err() || first {
                            return;
                        }
                    }
                });
            }
        });
        accepted
    }

    #[test]
    fn a_pool_keeps_its_connection_and_replaces_one_the_agent_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let accepted = stand_in_agent(&path);
        let pool = AgentPool::new(path);
        for _ in 0..10 {
            assert!(pool.segment(7, true, 0).unwrap().is_none());
        }
        // The first connection was closed after one reply; its replacement served the
        // other nine.
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }
}
