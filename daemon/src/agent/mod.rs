//! The host agent: the daemon's Unix socket, spoken by libregions and regionfs on this host
//! (docs/ARCHITECTURE.md, "Host agent"; `proto/regions/v1/agent.proto`).
//!
//! Each message is a little-endian u32 length followed by a prost `AgentRequest` /
//! `AgentReply`; a segment fd rides as `SCM_RIGHTS` on the reply's first byte. The caller is
//! identified with `SO_PEERCRED` (uid, gid, pid; groups from `/proc/PID/status`) and the
//! manager decides with that identity, so applications never need the cluster secret. The
//! socket is mode 0666: any local user may connect; permission checks are the manager's.

pub mod fdpass;
pub mod map;
pub mod open_handles;
pub mod owners;
pub mod sync;

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use prost::Message;
use regions_proto::v1::{
    AgentReply, AgentRequest, AgentSegment, Caller, SegmentReply, agent_reply::Body, agent_request,
};

use crate::error::{DaemonError, Result};
use crate::manager_client::Authority;
use crate::pools::Pools;
use crate::stats::Stats;
use crate::transport::rawio::{Ready, wait_ready};
use fdpass::PeerCred;

/// Largest request the agent reads.
pub const MAX_REQUEST: u32 = 1 << 20;
/// Largest reply a client reads (region maps can be large).
pub const MAX_REPLY: u32 = 512 << 20;
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(100);
/// How long a segment request waits for this daemon to apply the assignments its caller's
/// map already names (the manager's events reach daemons asynchronously).
const SEGMENT_WAIT: Duration = Duration::from_secs(1);
/// Connections one non-root user may hold open at once (each is a thread and up to one
/// request of [`MAX_REQUEST`] bytes): past it, new ones are closed at once.
pub const MAX_CONNECTIONS_PER_USER: usize = 128;
/// Connections open at once, all users together.
pub const MAX_CONNECTIONS: usize = 2048;

/// Writes one length-prefixed message, with `fd` riding on its first byte.
pub fn write_message(
    stream: &UnixStream,
    message: &impl Message,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<()> {
    let body = message.encode_to_vec();
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "message too large"))?;
    let mut bytes = Vec::with_capacity(4 + body.len());
    bytes.extend_from_slice(&len.to_le_bytes());
    bytes.extend_from_slice(&body);
    fdpass::send_with_fd(stream, &bytes, fd)
}

/// Reads one length-prefixed message body of at most `max` bytes, collecting a descriptor
/// passed with it. `None` at a clean end of stream.
pub fn read_message(
    stream: &UnixStream,
    max: u32,
) -> io::Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
    let mut len = [0u8; 4];
    let mut have = 0;
    let mut fd = None;
    while have < 4 {
        let (n, got) = fdpass::recv_with_fd(stream, &mut len[have..])?;
        if n == 0 {
            if have == 0 {
                return Ok(None);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if got.is_some() {
            fd = got;
        }
        have += n;
    }
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("agent message of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    (&*stream).read_exact(&mut body)?;
    Ok(Some((body, fd)))
}

/// Client side: sends `request` and reads the reply and the descriptor passed with it.
pub fn call(
    stream: &UnixStream,
    request: &AgentRequest,
) -> io::Result<(AgentReply, Option<OwnedFd>)> {
    write_message(stream, request, None)?;
    let (body, fd) = read_message(stream, MAX_REPLY)?
        .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
    let reply = AgentReply::decode(body.as_slice())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((reply, fd))
}

/// Answers agent requests.
pub struct AgentHandler {
    /// This host.
    pub host_id: u32,
    /// The pools and segments.
    pub pools: Arc<Pools>,
    /// Counters.
    pub stats: Arc<Stats>,
    /// The configured memory limit (for stats).
    pub memory_limit: u64,
    /// The object store of small regions (for stats).
    pub objects: Option<Arc<crate::objects::ObjectStore>>,
    /// Who decides rights.
    pub authority: Arc<dyn Authority>,
    /// Owners of regions created through this agent, and processes holding handles it
    /// opened ([`crate::agent::owners`]).
    pub owners: Option<Arc<crate::agent::owners::OwnerWatch>>,
    /// Handles opened through this agent and not closed yet.
    pub handles: Arc<crate::agent::open_handles::OpenHandles>,
    /// Forwarding of barrier, mutex and doorbell calls ([`crate::agent::sync`]).
    pub sync: Option<Arc<crate::agent::sync::SyncAgent>>,
    /// Who may receive a writable segment descriptor ([`SegmentWriters`]).
    pub segment_writers: SegmentWriters,
}

/// Who receives a writable descriptor of a segment (the region's memfd on this host).
///
/// A writable memfd can be grown with `ftruncate`, `fallocate` or a write past its end, and
/// its holes (offsets whose chunks live on other hosts, or past the region's end) can be
/// filled through a shared mapping: memory the manager never allocated, which stays until
/// the daemon frees the region. No seal stops that and still lets the daemon grow the file,
/// so only callers trusted with the daemon's memory get one; everyone else who may write
/// gets a read-only descriptor (reads at memory speed) and writes over the transport, where
/// the daemon checks every byte against the region's chunks (docs/SECURITY.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SegmentWriters {
    /// Root and the daemon's own user (the default).
    #[default]
    Trusted,
    /// Every caller allowed to write the region (`--share-writable-segments`: for hosts whose
    /// local users are trusted with the daemon's memory).
    Anyone,
}

impl SegmentWriters {
    /// Whether `caller` may receive a writable descriptor (given it may write the region).
    pub fn admits(self, caller: &Caller) -> bool {
        self == SegmentWriters::Anyone
            || caller.uid == 0
            || caller.uid == nix::unistd::geteuid().as_raw()
    }
}

impl std::fmt::Debug for AgentHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentHandler")
            .field("host_id", &self.host_id)
            .finish_non_exhaustive()
    }
}

fn error_reply(e: &DaemonError) -> AgentReply {
    AgentReply {
        errno: e.errno(),
        message: e.to_string(),
        body: None,
    }
}

fn ok_reply(body: Body) -> AgentReply {
    AgentReply {
        errno: 0,
        message: String::new(),
        body: Some(body),
    }
}

/// A success with nothing to say.
fn ok_empty() -> AgentReply {
    AgentReply {
        errno: 0,
        message: String::new(),
        body: None,
    }
}

/// The reply to a request answered with `body` or an error; no descriptor goes with it.
fn reply(result: Result<Body>) -> (AgentReply, Option<OwnedFd>) {
    match result {
        Ok(body) => (ok_reply(body), None),
        Err(e) => (error_reply(&e), None),
    }
}

impl AgentHandler {
    /// The caller's identity as the manager expects it.
    pub fn caller(&self, cred: &PeerCred) -> Caller {
        Caller {
            uid: cred.uid,
            gid: cred.gid,
            groups: cred.groups.clone(),
            pid: cred.pid,
            host_id: self.host_id,
            // Agent calls name inodes by number: the manager checks the path above them.
            by_inode: true,
            lease_session: 0,
        }
    }

    /// Answers one request from `cred`; the descriptor (if any) goes with the reply.
    pub fn handle(&self, cred: &PeerCred, request: AgentRequest) -> (AgentReply, Option<OwnedFd>) {
        let caller = self.caller(cred);
        match request.request {
            Some(agent_request::Request::Open(open)) => {
                match self.authority.open(&caller, open.ino, open.write) {
                    Ok(info) => {
                        // Closed for it if it exits without closing.
                        self.handles.opened(&caller, cred.start_time, info.handle);
                        if let Some(owners) = &self.owners {
                            owners.watch(caller.pid);
                        }
                        (ok_reply(Body::Region(info)), None)
                    }
                    Err(e) => (error_reply(&e), None),
                }
            }
            Some(agent_request::Request::Segment(seg)) => match self.segment(&caller, &seg) {
                Ok((reply, fd)) => (ok_reply(Body::Segment(reply)), fd),
                Err(e) => (error_reply(&e), None),
            },
            Some(agent_request::Request::MapRefresh(r)) => reply(
                crate::agent::map::refresh(self.authority.as_ref(), &caller, &r).map(Body::Region),
            ),
            Some(agent_request::Request::MapExtend(r)) => reply(
                crate::agent::map::extend(self.authority.as_ref(), &caller, &r).map(Body::Region),
            ),
            Some(agent_request::Request::MapClose(r)) => {
                let closed = crate::agent::map::close(
                    self.authority.as_ref(),
                    &self.handles,
                    &caller,
                    cred.start_time,
                    &r,
                );
                match closed {
                    Ok(()) => (ok_empty(), None),
                    Err(e) => (error_reply(&e), None),
                }
            }
            Some(agent_request::Request::OwnerCreate(r)) => reply(
                crate::agent::owners::create(
                    self.authority.as_ref(),
                    self.owners.as_deref(),
                    &caller,
                    r,
                )
                .map(Body::OwnerCreated),
            ),
            Some(agent_request::Request::Sync(call)) => (
                crate::agent::sync::handle(self.sync.as_deref(), &caller, call, None),
                None,
            ),
            Some(agent_request::Request::Stats(_)) => {
                let stats = self.stats.snapshot(
                    self.host_id,
                    &self.pools,
                    self.objects.as_deref(),
                    self.memory_limit,
                );
                (ok_reply(Body::Stats(stats)), None)
            }
            None => (
                error_reply(&DaemonError::Invalid("empty agent request".into())),
                None,
            ),
        }
    }

    fn segment(
        &self,
        caller: &Caller,
        request: &AgentSegment,
    ) -> Result<(SegmentReply, Option<OwnedFd>)> {
        let (ino, write) = (request.ino, request.write);
        let mask = if write {
            (libc::R_OK | libc::W_OK) as u32
        } else {
            libc::R_OK as u32
        };
        // Root on this host is trusted (it can reach the daemon's memory
        // anyway): regionfs, which asks on every open of a local region,
        // costs no manager round trip. Everyone else is checked.
        if caller.uid != 0 {
            self.authority.access(caller, ino, mask)?;
        }
        let deadline = std::time::Instant::now() + SEGMENT_WAIT;
        let Some(segment) = self.pools.segment_covering(ino, request.covering, deadline) else {
            return Ok((
                SegmentReply {
                    size: 0,
                    has_fd: false,
                    writable: false,
                    atomics_through_daemon: false,
                },
                None,
            ));
        };
        let writable = write && self.segment_writers.admits(caller);
        let fd = if writable {
            segment.reopen_read_write()?
        } else {
            segment.reopen_read_only()?
        };
        Ok((
            SegmentReply {
                size: segment.size(),
                has_fd: true,
                writable,
                atomics_through_daemon: self.pools.atomics_through_device(),
            },
            Some(fd),
        ))
    }
}

/// What agent connections share.
struct Shared {
    handler: AgentHandler,
    stop: AtomicBool,
    /// Open connections, with the uid of their peer.
    conns: Mutex<HashMap<u64, (UnixStream, u32)>>,
    next_conn: AtomicU64,
    /// Connections closed at once because a cap was reached, since start.
    refused: AtomicU64,
}

/// A running host agent.
pub struct AgentServer {
    path: PathBuf,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for AgentServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl AgentServer {
    /// Binds the agent socket at `path` (mode 0666). A stale socket file left by a daemon that
    /// died is replaced; a live one is an error.
    pub fn bind(path: &Path) -> Result<UnixListener> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            return Err(DaemonError::SocketDir { dir });
        }
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(DaemonError::Config(format!(
                    "{} exists and is not a socket: remove it or pick another --socket",
                    path.display()
                )));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(DaemonError::SocketInUse {
                    path: path.to_path_buf(),
                });
            }
            tracing::info!(path = %path.display(), "removing a stale host-agent socket");
            std::fs::remove_file(path).map_err(|e| {
                DaemonError::sys(
                    format!("cannot remove the stale socket {}", path.display()),
                    e,
                )
            })?;
        }
        let listener = UnixListener::bind(path).map_err(|e| {
            DaemonError::sys(
                format!("cannot bind the host-agent socket {}", path.display()),
                e,
            )
        })?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(|e| {
            DaemonError::sys(
                format!("cannot make {} accessible (chmod 0666)", path.display()),
                e,
            )
        })?;
        Ok(listener)
    }

    /// Serves `listener` (bound at `path`) on background threads until shutdown.
    pub fn start(
        listener: UnixListener,
        path: &Path,
        handler: AgentHandler,
    ) -> Result<AgentServer> {
        let shared = Arc::new(Shared {
            handler,
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            refused: AtomicU64::new(0),
        });
        let for_thread = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("agent-accept".into())
            .spawn(move || accept_loop(&listener, &for_thread))
            .map_err(|e| DaemonError::sys("spawning the host-agent accept thread", e))?;
        tracing::info!(path = %path.display(), "host agent serving");
        Ok(AgentServer {
            path: path.to_path_buf(),
            shared,
            accept: Some(accept),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, closes connections, removes the socket file.
    pub fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Ok(conns) = self.shared.conns.lock() {
            for (stream, _) in conns.values() {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
        if let Some(handle) = self.accept.take() {
            // Wake the accept loop now rather than at its next poll timeout.
            let _ = UnixStream::connect(&self.path);
            let _ = handle.join();
            match std::fs::remove_file(&self.path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the host-agent socket")
                }
            }
        }
    }
}

impl Drop for AgentServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match wait_ready(listener, Ready::Read, ACCEPT_POLL) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::TimedOut => continue,
            Err(e) => {
                tracing::warn!(error = %e, "host-agent accept poll failed");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "host-agent accept failed");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let cred = match fdpass::peer_cred(&stream) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot identify a host-agent caller (SO_PEERCRED)");
                continue;
            }
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        if !admit(shared, id, &stream, cred.uid) {
            continue;
        }
        let for_thread = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("agent-{id}"))
            .spawn(move || {
                serve_connection(&stream, cred, &for_thread.handler);
                if let Ok(mut conns) = for_thread.conns.lock() {
                    conns.remove(&id);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a host-agent connection thread");
            if let Ok(mut conns) = shared.conns.lock() {
                conns.remove(&id);
            }
        }
    }
}

/// Records connection `id` of `uid`, or closes it (returns `false`) when that user already
/// holds [`MAX_CONNECTIONS_PER_USER`] (root is not limited) or the agent [`MAX_CONNECTIONS`].
fn admit(shared: &Shared, id: u64, stream: &UnixStream, uid: u32) -> bool {
    let Ok(mut conns) = shared.conns.lock() else {
        return false;
    };
    let mine = conns.values().filter(|(_, u)| *u == uid).count();
    let full = conns.len() >= MAX_CONNECTIONS;
    if full || (uid != 0 && mine >= MAX_CONNECTIONS_PER_USER) {
        drop(conns);
        let n = shared.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(
                uid,
                of_this_user = mine,
                full,
                refused_so_far = n,
                "host agent: too many connections; closing a new one"
            );
        }
        return false;
    }
    match stream.try_clone() {
        Ok(handle) => {
            conns.insert(id, (handle, uid));
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot keep a handle of a host-agent connection; closing it");
            false
        }
    }
}

/// The name of an agent call, as metrics label it.
fn call_name(request: &AgentRequest) -> &'static str {
    match &request.request {
        Some(agent_request::Request::Open(_)) => "open",
        Some(agent_request::Request::Segment(_)) => "segment",
        Some(agent_request::Request::MapRefresh(_)) => "map_refresh",
        Some(agent_request::Request::MapExtend(_)) => "map_extend",
        Some(agent_request::Request::MapClose(_)) => "map_close",
        Some(agent_request::Request::OwnerCreate(_)) => "owner_create",
        Some(agent_request::Request::Sync(_)) => "sync",
        Some(agent_request::Request::Stats(_)) => "stats",
        None => "empty",
    }
}

fn serve_connection(stream: &UnixStream, cred: fdpass::PeerCred, handler: &AgentHandler) {
    tracing::debug!(pid = cred.pid, uid = cred.uid, "host-agent connection");
    loop {
        let body = match read_message(stream, MAX_REQUEST) {
            Ok(Some((body, _))) => body,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(pid = cred.pid, error = %e, "bad host-agent request; closing the connection");
                return;
            }
        };
        let started = std::time::Instant::now();
        let decoded = AgentRequest::decode(body.as_slice());
        let call = decoded.as_ref().map_or("undecodable", call_name);
        let (reply, fd) = match decoded {
            Ok(AgentRequest {
                request: Some(agent_request::Request::Sync(call)),
            }) => {
                let caller = handler.caller(&cred);
                (
                    crate::agent::sync::handle(
                        handler.sync.as_deref(),
                        &caller,
                        call,
                        Some(stream),
                    ),
                    None,
                )
            }
            Ok(request) => handler.handle(&cred, request),
            Err(e) => (
                error_reply(&DaemonError::Invalid(format!(
                    "cannot decode the agent request: {e}"
                ))),
                None,
            ),
        };
        let result = if reply.errno == 0 { "ok" } else { "error" };
        metrics::counter!("regions_daemon_agent_requests_total", "call" => call, "result" => result)
            .increment(1);
        metrics::histogram!("regions_daemon_agent_request_duration_seconds", "call" => call)
            .record(started.elapsed());
        if reply.errno != 0 {
            tracing::debug!(pid = cred.pid, errno = reply.errno, message = %reply.message, "host-agent request refused");
        }
        if let Err(e) = write_message(stream, &reply, fd.as_ref().map(AsFd::as_fd)) {
            tracing::debug!(pid = cred.pid, error = %e, "host-agent caller went away");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use regions_proto::layout::CHUNK_SIZE;
    use regions_proto::v1::{self, AgentOpen, AgentSegment, AgentStats};

    use super::*;

    /// Allows everything for uid 0, reading only for others; region 404 does not exist.
    struct Fake;

    impl Authority for Fake {
        fn open(&self, caller: &Caller, ino: u64, _write: bool) -> Result<v1::RegionInfo> {
            if ino == 404 {
                return Err(DaemonError::Manager {
                    errno: libc::ENOENT,
                    message: "no such region".into(),
                });
            }
            Ok(v1::RegionInfo {
                attr: Some(v1::Attr {
                    ino,
                    uid: caller.uid,
                    owner_pid: caller.pid,
                    owner_host: caller.host_id,
                    ..Default::default()
                }),
                ..Default::default()
            })
        }

        fn access(&self, caller: &Caller, _ino: u64, mask: u32) -> Result<()> {
            if caller.uid == 0 || caller.uid == writer_uid() || mask & libc::W_OK as u32 == 0 {
                Ok(())
            } else {
                Err(DaemonError::Denied("read only".into()))
            }
        }
    }

    /// An unprivileged user the fake authority lets write: not the user running the tests
    /// (whom the agent trusts as the daemon's own).
    fn writer_uid() -> u32 {
        let me = nix::unistd::geteuid().as_raw();
        if me == 4242 { 4243 } else { 4242 }
    }

    fn handler(pools: Arc<Pools>) -> AgentHandler {
        AgentHandler {
            host_id: 3,
            pools,
            stats: Arc::default(),
            memory_limit: 1 << 30,
            objects: None,
            authority: Arc::new(Fake),
            owners: None,
            handles: Arc::default(),
            sync: None,
            segment_writers: SegmentWriters::default(),
        }
    }

    fn segment_request(ino: u64, write: bool) -> AgentRequest {
        AgentRequest {
            request: Some(agent_request::Request::Segment(AgentSegment {
                ino,
                write,
                covering: 0,
            })),
        }
    }

    #[test]
    fn scm_rights_round_trip_maps_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let pools = Arc::new(Pools::new());
        pools.add_pool(1, 4 * CHUNK_SIZE).unwrap();
        pools.assign(1, CHUNK_SIZE, 77, 0, 2 * CHUNK_SIZE).unwrap();
        {
            let resolved = pools
                .resolve(&[regions_proto::frame::Range {
                    pool: 1,
                    offset: CHUNK_SIZE + 5,
                    len: 5,
                    delta: None,
                }])
                .unwrap();
            let pinned = resolved
                .pin(std::time::Instant::now() + Duration::from_secs(1))
                .unwrap();
            pinned.copy_in_at(0, b"hello");
        }
        let listener = AgentServer::bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o666);
        assert!(matches!(
            AgentServer::bind(&path),
            Err(DaemonError::SocketInUse { .. })
        ));
        let mut server = AgentServer::start(listener, &path, handler(Arc::clone(&pools))).unwrap();

        let stream = UnixStream::connect(&path).unwrap();
        // Segment fd: maps the very bytes the pool window holds.
        let (reply, fd) = call(&stream, &segment_request(77, true)).unwrap();
        assert_eq!(reply.errno, 0, "{}", reply.message);
        let Some(Body::Segment(seg)) = reply.body else {
            panic!("no segment body")
        };
        assert!(seg.has_fd && seg.writable);
        assert_eq!(seg.size, 2 * CHUNK_SIZE);
        let fd = fd.unwrap();
        let file = std::fs::File::from(fd);
        let mut got = [0u8; 5];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut got, 5).unwrap();
        assert_eq!(&got, b"hello");
        // A write through the passed fd shows in the pool window.
        std::os::unix::fs::FileExt::write_all_at(&file, b"HELLO", 5).unwrap();
        let resolved = pools
            .resolve(&[regions_proto::frame::Range {
                pool: 1,
                offset: CHUNK_SIZE + 5,
                len: 5,
                delta: None,
            }])
            .unwrap();
        let mut seen = [0u8; 5];
        resolved
            .pin(std::time::Instant::now() + Duration::from_secs(1))
            .unwrap()
            .copy_out(&mut seen);
        assert_eq!(&seen, b"HELLO");

        // Read-only request: a read-only descriptor.
        let (reply, fd) = call(&stream, &segment_request(77, false)).unwrap();
        let Some(Body::Segment(seg)) = reply.body else {
            panic!("no segment body")
        };
        assert!(seg.has_fd && !seg.writable);
        let flags = nix::fcntl::fcntl(fd.as_ref().unwrap(), nix::fcntl::FcntlArg::F_GETFL).unwrap();
        assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY);

        // No segment here: no fd. Open is forwarded with the caller's identity.
        let (reply, fd) = call(&stream, &segment_request(78, false)).unwrap();
        assert!(fd.is_none());
        assert!(matches!(
            reply.body,
            Some(Body::Segment(SegmentReply { has_fd: false, .. }))
        ));
        let open = AgentRequest {
            request: Some(agent_request::Request::Open(AgentOpen {
                ino: 5,
                write: false,
            })),
        };
        let (reply, _) = call(&stream, &open).unwrap();
        let Some(Body::Region(info)) = reply.body else {
            panic!("no region body")
        };
        let attr = info.attr.unwrap();
        assert_eq!((attr.owner_pid, attr.owner_host), (std::process::id(), 3));
        let missing = AgentRequest {
            request: Some(agent_request::Request::Open(AgentOpen {
                ino: 404,
                write: false,
            })),
        };
        assert_eq!(call(&stream, &missing).unwrap().0.errno, libc::ENOENT);
        let stats = AgentRequest {
            request: Some(agent_request::Request::Stats(AgentStats {})),
        };
        let (reply, _) = call(&stream, &stats).unwrap();
        let Some(Body::Stats(s)) = reply.body else {
            panic!("no stats body")
        };
        assert_eq!(
            (s.host_id, s.segments, s.pool_bytes),
            (3, 1, 4 * CHUNK_SIZE)
        );
        let (reply, _) = call(&stream, &AgentRequest { request: None }).unwrap();
        assert_eq!(reply.errno, libc::EINVAL);
        // Garbage keeps the framing: an EINVAL reply, and the connection still works.
        write_raw(&stream, &[0xff, 0xff, 0xff]);
        let (body, _) = read_message(&stream, MAX_REPLY).unwrap().unwrap();
        assert_eq!(
            AgentReply::decode(body.as_slice()).unwrap().errno,
            libc::EINVAL
        );
        assert_eq!(call(&stream, &stats).unwrap().0.errno, 0);

        server.shutdown();
        assert!(!path.exists(), "the socket file is removed at shutdown");
    }

    fn write_raw(stream: &UnixStream, body: &[u8]) {
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(body);
        std::io::Write::write_all(&mut &*stream, &bytes).unwrap();
    }

    #[test]
    fn denied_and_oversized_requests() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let pools = Arc::new(Pools::new());
        let h = handler(pools);
        let nobody = PeerCred {
            pid: 1,
            uid: 65534,
            gid: 65534,
            groups: vec![],
            start_time: 0,
        };
        let (reply, fd) = h.handle(&nobody, segment_request(1, true));
        assert_eq!((reply.errno, fd.is_none()), (libc::EACCES, true));
        let mut server = AgentServer::start(AgentServer::bind(&path).unwrap(), &path, h).unwrap();
        let stream = UnixStream::connect(&path).unwrap();
        std::io::Write::write_all(&mut &stream, &u32::MAX.to_le_bytes()).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(
            std::io::Read::read(&mut &stream, &mut buf).unwrap(),
            0,
            "closed"
        );
        server.shutdown();
    }

    #[test]
    fn only_trusted_writers_get_a_writable_segment_unless_shared() {
        let pools = Arc::new(Pools::new());
        pools.add_pool(1, 4 * CHUNK_SIZE).unwrap();
        pools.assign(1, 0, 77, 0, CHUNK_SIZE).unwrap();
        let writer = PeerCred {
            pid: 1,
            uid: writer_uid(),
            gid: writer_uid(),
            groups: vec![],
            start_time: 0,
        };
        let root = PeerCred {
            uid: 0,
            gid: 0,
            ..writer.clone()
        };
        let access_mode = |fd: &Option<OwnedFd>| {
            nix::fcntl::fcntl(fd.as_ref().unwrap(), nix::fcntl::FcntlArg::F_GETFL).unwrap()
                & libc::O_ACCMODE
        };
        let writable = |reply: &AgentReply| match &reply.body {
            Some(Body::Segment(seg)) => seg.has_fd && seg.writable,
            other => panic!("no segment: {other:?} {}", reply.message),
        };
        let mut h = handler(Arc::clone(&pools));
        // The default: a writer that is not root gets the memory to read only.
        let (reply, fd) = h.handle(&writer, segment_request(77, true));
        assert!(!writable(&reply));
        assert_eq!(access_mode(&fd), libc::O_RDONLY);
        let (reply, fd) = h.handle(&root, segment_request(77, true));
        assert!(writable(&reply));
        assert_eq!(access_mode(&fd), libc::O_RDWR);
        // --share-writable-segments: every writer.
        h.segment_writers = SegmentWriters::Anyone;
        let (reply, fd) = h.handle(&writer, segment_request(77, true));
        assert!(writable(&reply));
        assert_eq!(access_mode(&fd), libc::O_RDWR);
        // Never to someone who may not write.
        let reader = PeerCred {
            uid: 65534,
            gid: 65534,
            ..writer
        };
        let (reply, fd) = h.handle(&reader, segment_request(77, true));
        assert_eq!((reply.errno, fd.is_none()), (libc::EACCES, true));
    }

    #[test]
    fn bind_explains_a_missing_directory_and_replaces_stale_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope").join("a.sock");
        let err = AgentServer::bind(&missing).unwrap_err();
        assert!(err.to_string().contains("mkdir -p"), "{err}");
        let path = dir.path().join("stale.sock");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        AgentServer::bind(&path).unwrap();
        let file = dir.path().join("precious");
        std::fs::write(&file, "data").unwrap();
        let err = AgentServer::bind(&file).unwrap_err();
        assert!(err.to_string().contains("not a socket"), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "data");
    }
}
