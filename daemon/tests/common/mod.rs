//! Helpers of the daemon's integration tests: a blocking transport client, a transport server
//! over pools built directly (no manager), and a real `regions-manager` process.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use regions_daemon::pools::Pools;
use regions_daemon::stats::Stats;
use regions_daemon::transport::{TransportConfig, TransportServer};
use regions_proto::auth::Secret;
use regions_proto::frame::{Frame, Limits, Request, decode_frame};
use regions_proto::handshake::ClientHello;

/// Writes the secret `token` to `path`, readable by its owner only (as secrets must be).
pub fn write_secret(path: &Path, token: &str) {
    Secret::new(token).unwrap().write_file(path).unwrap();
}

/// The secret of test servers.
pub const TOKEN: &str = "test-secret-token";

/// A transport server over `pools` with `config`.
pub fn server_with(pools: Arc<Pools>, config: TransportConfig) -> TransportServer {
    let listener = TransportServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    TransportServer::start(
        listener,
        pools,
        Secret::new(TOKEN).unwrap(),
        Arc::new(Stats::default()),
        config,
    )
    .unwrap()
}

/// A transport server over `pools`.
pub fn server(pools: Arc<Pools>, assign_wait: Duration) -> (TransportServer, Arc<Stats>) {
    let listener = TransportServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let stats = Arc::new(Stats::default());
    let config = TransportConfig {
        assign_wait,
        io_timeout: Duration::from_secs(10),
        ..TransportConfig::default()
    };
    let server = TransportServer::start(
        listener,
        pools,
        Secret::new(TOKEN).unwrap(),
        Arc::clone(&stats),
        config,
    )
    .unwrap();
    (server, stats)
}

/// A blocking transport client.
pub struct Client {
    pub stream: TcpStream,
    buf: BytesMut,
    chunk: Vec<u8>,
    next_id: u64,
}

impl Client {
    /// Connects without authenticating.
    pub fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        Client {
            stream,
            buf: BytesMut::new(),
            chunk: vec![0u8; 1 << 20],
            next_id: 1,
        }
    }

    /// Connects and authenticates with the cluster secret `token` (the challenge–response
    /// HELLO).
    pub fn authenticated(addr: SocketAddr, token: &str) -> Client {
        let mut c = Client::connect(addr);
        let reply = c.handshake(token);
        assert_eq!(
            reply.header.status,
            0,
            "hello refused: {:?}",
            reply.error_message()
        );
        c
    }

    /// Runs the cluster-secret handshake with `token`; returns the last reply (the daemon's
    /// challenge when it refused that, else the answer to the proof).
    pub fn handshake(&mut self, token: &str) -> Frame {
        let secret = Secret::new(token).unwrap();
        let (hello, open) = ClientHello::start().unwrap();
        let challenge = self.call(&Request::Hello { token: open.into() });
        if challenge.header.status != 0 {
            return challenge;
        }
        let answer = hello.answer(&secret, &challenge.payload).unwrap();
        self.call(&Request::Hello {
            token: answer.into(),
        })
    }

    /// Sends `req`; returns its request id.
    pub fn send(&mut self, req: &Request) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let mut out = BytesMut::new();
        req.to_frame(id, 0).encode(&mut out);
        self.stream.write_all(&out).unwrap();
        id
    }

    /// Sends raw bytes.
    pub fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// The next reply; `None` when the server closed the connection.
    pub fn recv(&mut self) -> Option<Frame> {
        let limits = Limits {
            max_payload: u32::MAX,
            max_ranges: u32::MAX,
        };
        loop {
            if let Some(frame) = decode_frame(&mut self.buf, &limits).unwrap() {
                return Some(frame);
            }
            let n = match self.stream.read(&mut self.chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
                Err(e) => panic!("reading a reply: {e}"),
            };
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&self.chunk[..n]);
        }
    }

    /// Sends `req` and returns its reply.
    pub fn call(&mut self, req: &Request) -> Frame {
        let id = self.send(req);
        let reply = self.recv().expect("the server closed the connection");
        assert_eq!(reply.header.request_id, id);
        reply
    }

    /// Reads until the server closes; the replies received meanwhile.
    pub fn drain(&mut self) -> Vec<Frame> {
        let mut out = Vec::new();
        while let Some(f) = self.recv() {
            out.push(f);
        }
        out
    }
}

/// The errno of a reply (0 = ok).
pub fn status(f: &Frame) -> i32 {
    f.header.status as i32
}

/// A `regions-manager` process on a temporary data directory; killed on drop.
pub struct ManagerProcess {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    pub secret_file: PathBuf,
    pub secret: Secret,
    log: PathBuf,
}

/// `target/debug/NAME`, next to the test executable's parent directory.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: build it first with `cargo build -p regions-manager`",
        path.display()
    );
    path
}

impl ManagerProcess {
    /// Starts a manager in `dir` (data, secret and logs live there) on `listen`.
    pub fn start(dir: &Path, listen: &str, lease_ms: u64) -> ManagerProcess {
        let secret_file = dir.join("secret");
        if !secret_file.exists() {
            write_secret(&secret_file, TOKEN);
        }
        let ready = dir.join("manager.ready");
        let _ = std::fs::remove_file(&ready);
        let log = dir.join("manager.log");
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(bin_path("regions-manager"))
            .arg("--listen")
            .arg(listen)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--secret-file")
            .arg(&secret_file)
            .arg("--ready-file")
            .arg(&ready)
            .arg("--lease-ms")
            .arg(lease_ms.to_string())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        let addr = loop {
            if let Ok(text) = std::fs::read_to_string(&ready)
                && let Ok(addr) = text.trim().parse()
            {
                break addr;
            }
            assert!(
                Instant::now() < deadline,
                "the manager did not start; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        ManagerProcess {
            child: Some(child),
            addr,
            dir: dir.to_path_buf(),
            secret_file,
            secret: Secret::new(TOKEN).unwrap(),
            log,
        }
    }

    /// The manager's URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The manager's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ManagerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
