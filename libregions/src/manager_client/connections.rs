//! Connections for [`super::ManagerClient`]'s blocking calls. Each is a gRPC channel of its
//! own on a current-thread runtime that only the thread holding it runs: a call is written,
//! waited for and read on the calling thread (a hand-off to a runtime thread costs two thread
//! wake-ups a call, most of a call on an idle virtual machine), and never waits behind another
//! thread's call. Idle connections wait in a list. Nothing reads an idle connection's socket,
//! so one whose manager closed it meanwhile (a restart) still looks usable to its channel: its
//! socket tells ([`Connection::peer_gone`]), and it is replaced before a call is written into
//! it. (A manager that goes away during a call, or vanishes without closing the connection, as
//! behind a cut cable, still fails that call: within the call's deadline.)

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use regions_proto::MAX_GRPC_MESSAGE as MAX_MESSAGE;
use regions_proto::auth::{AttachSecret, Secret};
use regions_proto::v1::{
    cluster_client::ClusterClient, namespace_client::NamespaceClient, regions_client::RegionsClient,
};
use tonic::codegen::http::Uri;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::error::{RegionsError, Result};

/// A gRPC service stack that attaches the cluster secret.
pub type Authed = InterceptedService<Channel, AttachSecret>;

/// Deadline of every call.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Idle connections kept for later calls; more are opened while more threads call at once,
/// and those beyond this many are closed when they come back.
const IDLE_CONNECTIONS: usize = 64;

/// The clients of one connection's services (cheap to clone).
#[derive(Clone)]
pub(super) struct Services {
    pub(super) namespace: NamespaceClient<Authed>,
    pub(super) regions: RegionsClient<Authed>,
    pub(super) cluster: ClusterClient<Authed>,
}

/// One connection to the manager and the runtime that drives it.
pub(super) struct Connection {
    runtime: tokio::runtime::Runtime,
    services: Services,
    /// A duplicate of the channel's current socket (replaced when the channel reconnects).
    socket: Arc<Mutex<Option<OwnedFd>>>,
}

impl Connection {
    /// Runs the call `rpc` makes of this connection's services, on the calling thread.
    pub(super) fn run<F, Fut>(&self, rpc: F) -> Fut::Output
    where
        F: FnOnce(Services) -> Fut,
        Fut: std::future::Future,
    {
        self.runtime.block_on(rpc(self.services.clone()))
    }

    /// Runs `future` (a stream's next message, say) on this connection's runtime.
    pub(super) fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// Whether the manager closed or reset this connection's socket (it restarted, say)
    /// while nobody ran the connection.
    fn peer_gone(&self) -> bool {
        match self.socket.lock() {
            // Not connected yet: the channel connects at the first call.
            Ok(socket) => socket.as_ref().is_some_and(|fd| peer_gone(fd.as_fd())),
            Err(_) => true,
        }
    }
}

/// Whether the peer of connected socket `fd` shut it down (its FIN), reset it, or it failed.
/// Bytes waiting to be read (a window update) alone do not count.
fn peer_gone(fd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `p` is one initialised pollfd that lives through the call, and the count says
    // one; a zero timeout never blocks. (nix's poll wrapper reports no events at all when
    // POLLRDHUP, a flag it does not know, is among them, hence libc.)
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n < 0
        || (n > 0
            && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0)
}

/// Opens connections to one manager, and keeps the idle ones.
pub(super) struct Connections {
    addr: String,
    /// Built once (TLS settings and CA included) for every connection.
    endpoint: Endpoint,
    auth: AttachSecret,
    idle: Mutex<Vec<Connection>>,
}

impl Connections {
    /// Connections to the manager at `addr` (`http://host:port`, or `https://host:port` for
    /// TLS, trusting `tls_ca` (PEM) if given, else the system's roots), each connected
    /// within `timeout`. The first is opened now: an unreachable manager is reported here.
    pub(super) fn open(
        addr: &str,
        secret: &Secret,
        tls_ca: Option<&Path>,
        timeout: Duration,
    ) -> Result<Connections> {
        let endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(|e| unreachable(addr, &e))?
            .connect_timeout(timeout)
            .timeout(CALL_TIMEOUT);
        let endpoint = regions_proto::tls::client_endpoint(endpoint, addr, tls_ca)
            .map_err(|e| RegionsError::Invalid(e.to_string()))?;
        let connections = Connections {
            addr: addr.to_owned(),
            endpoint,
            auth: AttachSecret::new(secret),
            idle: Mutex::new(Vec::new()),
        };
        let first = connections.connect()?;
        connections.put_back(first);
        Ok(connections)
    }

    pub(super) fn addr(&self) -> &str {
        &self.addr
    }

    /// An idle connection whose manager is still there, or a new one.
    pub(super) fn take(&self) -> Result<Connection> {
        loop {
            let idle = self.idle.lock().ok().and_then(|mut i| i.pop());
            match idle {
                Some(c) if c.peer_gone() => {
                    tracing::debug!(addr = %self.addr, "the manager closed an idle connection; dropping it");
                }
                Some(c) => return Ok(c),
                None => return self.connect(),
            }
        }
    }

    /// Keeps `connection` for a later call.
    pub(super) fn put_back(&self, connection: Connection) {
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < IDLE_CONNECTIONS
        {
            idle.push(connection);
        }
    }

    /// A new connection of its own (for a stream that holds it).
    pub(super) fn connect(&self) -> Result<Connection> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| RegionsError::io("cannot start a runtime for a manager connection", e))?;
        let socket = Arc::new(Mutex::new(None));
        let dialer = {
            let socket = Arc::clone(&socket);
            tower::service_fn(move |uri: Uri| dial(uri, Arc::clone(&socket)))
        };
        let channel = runtime
            .block_on(self.endpoint.connect_with_connector(dialer))
            .map_err(|e| unreachable(&self.addr, &e))?;
        let service = || InterceptedService::new(channel.clone(), self.auth.clone());
        let services = Services {
            namespace: NamespaceClient::new(service())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            regions: RegionsClient::new(service())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            cluster: ClusterClient::new(service())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        };
        Ok(Connection {
            runtime,
            services,
            socket,
        })
    }
}

/// Connects the channel's TCP socket (TLS, if any, goes on top of it) and keeps a duplicate of
/// it in `socket` for [`Connection::peer_gone`].
async fn dial(
    uri: Uri,
    socket: Arc<Mutex<Option<OwnedFd>>>,
) -> std::io::Result<hyper_util::rt::TokioIo<tokio::net::TcpStream>> {
    let host = match uri.host().unwrap_or_default() {
        h if h.contains(':') && !h.starts_with('[') => format!("[{h}]"),
        h => h.to_owned(),
    };
    let https = uri.scheme_str() == Some("https");
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let stream = tokio::net::TcpStream::connect(format!("{host}:{port}")).await?;
    stream.set_nodelay(true)?;
    let copy = stream.as_fd().try_clone_to_owned()?;
    if let Ok(mut s) = socket.lock() {
        *s = Some(copy);
    }
    Ok(hyper_util::rt::TokioIo::new(stream))
}

/// The manager at `addr` cannot be reached, with every cause `e` gives (a transport error
/// alone says only "transport error").
fn unreachable(addr: &str, e: &dyn std::error::Error) -> RegionsError {
    let mut reason = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        // An I/O error's source often repeats it.
        if !reason.ends_with(&text) {
            reason.push_str(": ");
            reason.push_str(&text);
        }
        cause = c.source();
    }
    RegionsError::ManagerUnreachable {
        addr: addr.to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_socket_whose_peer_closed_or_reset_is_gone_and_pending_bytes_are_not() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut theirs, _) = listener.accept().unwrap();
        assert!(!peer_gone(ours.as_fd()), "a quiet live connection");
        theirs.write_all(b"window update").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !peer_gone(ours.as_fd()),
            "bytes waiting on a live connection"
        );
        drop(theirs);
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            peer_gone(ours.as_fd()),
            "the peer closed (bytes still waiting)"
        );

        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (theirs, _) = listener.accept().unwrap();
        // A close with SO_LINGER 0 resets the connection.
        socket_linger_zero(&theirs);
        drop(theirs);
        std::thread::sleep(Duration::from_millis(20));
        assert!(peer_gone(ours.as_fd()), "the peer reset the connection");
    }

    fn socket_linger_zero(s: &TcpStream) {
        nix::sys::socket::setsockopt(
            s,
            nix::sys::socket::sockopt::Linger,
            &libc::linger {
                l_onoff: 1,
                l_linger: 0,
            },
        )
        .unwrap();
    }
}
