//! A separate OS process for the isolation tests: run as an unprivileged user, it tries to
//! reach bytes or handles that are not its own through a host agent, and prints one line per
//! attempt so the test can check each was refused.
//!
//! ```text
//! regions-attack SOCKET read-segment INO    (a read-only segment: every way to write it)
//! regions-attack SOCKET write-segment INO PATH  (a writer's segment: every way to grow, seal
//!                                            or shrink it; then writes through the library
//!                                            and through a mapping of PATH, the mounted file)
//! regions-attack SOCKET hold-segment INO BYTE  (keeps a read-only segment while root frees
//!                                            the region's memory to another region, then
//!                                            looks for that region's BYTE through it)
//! regions-attack SOCKET by-inode INO        (agent calls that name an inode by number)
//! regions-attack SOCKET create-in PARENT NAME
//! regions-attack SOCKET close HANDLE        (another process's handle)
//! regions-attack SOCKET sync NAME          (lock, ring and delete another user's sync object)
//! regions-attack SOCKET fuzz SEED CASES INO,INO…  (random and malformed agent messages)
//! regions-attack SOCKET flood N             (N connections at once; holds them until stdin ends)
//! regions-attack SOCKET sync-slot NAME      (the capability of one mutex against the others)
//! regions-attack SOCKET revoked INO         (reads with a capability, waits for a line on
//!                                            stdin while root changes the region, reads again)
//! regions-attack SOCKET epoch-page PATH     (a mount's page of descriptor epochs: every way
//!                                            to change it, or to plant another in its place)
//! ```
//!
//! Each attempt prints `NAME: refused ERRNO`, or `NAME: ALLOWED` when the attack worked. Set-up
//! steps print `NAME: ok` or `NAME: failed ERRNO` (a failed set-up means the attack was never
//! tried, which the tests treat as a failure of the test, not a success of the defence).
//! `read-segment` ends with `content: HEX`, the first 16 bytes of the segment as read back.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, bail};
use regions::RegionsError;
use regions::agent::AgentClient;

mod raw {
    //! The system calls the attacks use, each returning the errno it failed with.

    use std::os::fd::RawFd;

    fn last_errno() -> i32 {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    }

    /// Maps `len` bytes of `fd` shared with `prot`; unmaps at once. `Err(errno)` if refused.
    pub fn map_shared(fd: RawFd, len: usize, prot: i32) -> Result<(), i32> {
        // SAFETY: a fresh mapping at an address the kernel picks; nothing else refers to it
        // and it is unmapped before returning.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(last_errno());
        }
        // SAFETY: `p` is the mapping of `len` bytes made above.
        unsafe { libc::munmap(p, len) };
        Ok(())
    }

    /// Maps `len` bytes of `fd` read-only and shared, then asks for write access.
    pub fn mprotect_writable(fd: RawFd, len: usize) -> Result<(), i32> {
        // SAFETY: as in `map_shared`.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_errno());
        }
        // SAFETY: `p` is our own mapping of `len` bytes; changing its protection touches
        // nothing else.
        let r = unsafe { libc::mprotect(p, len, libc::PROT_READ | libc::PROT_WRITE) };
        let result = if r == 0 {
            // The attack worked: store through it so the test sees the changed byte.
            // SAFETY: the mapping is now writable and at least one byte long.
            unsafe { *(p as *mut u8) ^= 0xff };
            Ok(())
        } else {
            Err(last_errno())
        };
        // SAFETY: `p` is the mapping made above.
        unsafe { libc::munmap(p, len) };
        result
    }

    pub fn fallocate(fd: RawFd, offset: i64, len: i64) -> Result<(), i32> {
        // SAFETY: plain system call on a descriptor we own.
        match unsafe { libc::fallocate(fd, 0, offset, len) } {
            0 => Ok(()),
            _ => Err(last_errno()),
        }
    }

    pub fn ftruncate(fd: RawFd, len: i64) -> Result<(), i32> {
        // SAFETY: plain system call on a descriptor we own.
        match unsafe { libc::ftruncate(fd, len) } {
            0 => Ok(()),
            _ => Err(last_errno()),
        }
    }

    pub fn add_seals(fd: RawFd, seals: i32) -> Result<(), i32> {
        // SAFETY: plain system call on a descriptor we own.
        match unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } {
            -1 => Err(last_errno()),
            _ => Ok(()),
        }
    }
}

fn report(name: &str, result: Result<(), i32>) {
    match result {
        Ok(()) => println!("{name}: ALLOWED"),
        Err(errno) => println!("{name}: refused {errno}"),
    }
}

fn errno_of(e: &RegionsError) -> i32 {
    e.errno()
}

fn report_call<T>(name: &str, result: regions::Result<T>) {
    report(name, result.map(drop).map_err(|e| errno_of(&e)));
}

fn segment(agent: &mut AgentClient, ino: u64, write: bool) -> anyhow::Result<(OwnedFd, u64)> {
    match agent.segment(ino, write) {
        Ok(Some(seg)) => {
            println!("segment: ok");
            Ok((seg.fd, seg.size))
        }
        Ok(None) => {
            println!("segment: failed 0");
            bail!("the agent has no segment of region {ino}")
        }
        Err(e) => {
            println!("segment: failed {}", e.errno());
            bail!("no segment of region {ino}: {e}")
        }
    }
}

fn read_segment(agent: &mut AgentClient, ino: u64) -> anyhow::Result<()> {
    let (fd, size) = segment(agent, ino, false)?;
    let raw = fd.as_raw_fd();
    let len = usize::try_from(size).unwrap_or(4096).clamp(4096, 1 << 20);
    let proc_path = format!("/proc/self/fd/{raw}");
    report(
        "reopen-read-write",
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&proc_path)
            .and_then(|f| f.write_all_at(b"X", 0))
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)),
    );
    let file = File::from(fd.try_clone().context("dup of the segment")?);
    report(
        "pwrite",
        file.write_all_at(b"X", 0)
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)),
    );
    report(
        "mmap-writable",
        raw::map_shared(raw, len, libc::PROT_READ | libc::PROT_WRITE),
    );
    report("mprotect-writable", raw::mprotect_writable(raw, len));
    report("fallocate", raw::fallocate(raw, 0, 1 << 20));
    report(
        "ftruncate-grow",
        raw::ftruncate(raw, (size as i64).max(4096) * 4),
    );
    report("ftruncate-shrink", raw::ftruncate(raw, 0));
    report("seal-grow", raw::add_seals(raw, libc::F_SEAL_GROW));
    report(
        "seal-future-write",
        raw::add_seals(raw, libc::F_SEAL_FUTURE_WRITE),
    );
    report_call("segment-writable", agent.segment(ino, true));
    let mut head = [0u8; 16];
    let n = file
        .read_at(&mut head, 0)
        .context("reading the segment back")?;
    let hex: String = head[..n].iter().map(|b| format!("{b:02x}")).collect();
    println!("content: {hex}");
    Ok(())
}

/// Asks for a writable segment of `ino` and tries every way to grow, fill, seal or shrink
/// it; then, as the controls, writes the region the ways a writer may: `library-write` (bytes
/// 0..8 through the library) and `mapping-write` (bytes at 128 KiB, the second chunk, through
/// a mapping of `path`, published with msync). Ends with `size-after: N`, the memfd's size.
fn write_segment(
    agent: &mut AgentClient,
    socket: &Path,
    ino: u64,
    path: &Path,
) -> anyhow::Result<()> {
    let seg = match agent.segment(ino, true) {
        Ok(Some(seg)) => seg,
        other => {
            println!(
                "segment: failed {}",
                other.map_or_else(|e| e.errno(), |_| 0)
            );
            bail!("no segment of region {ino}");
        }
    };
    println!("segment: ok");
    println!("writable: {}", seg.writable);
    let raw = seg.fd.as_raw_fd();
    let size = seg.size as i64;
    let file = File::from(seg.fd.try_clone().context("dup of the segment")?);
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(libc::EIO);
    report(
        "reopen-read-write",
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{raw}"))
            .map(drop)
            .map_err(errno),
    );
    report("ftruncate-grow", raw::ftruncate(raw, size + (64 << 20)));
    report("fallocate-past-end", raw::fallocate(raw, size, 64 << 20));
    report(
        "pwrite-past-end",
        file.write_all_at(b"X", size as u64 + (1 << 20))
            .map_err(errno),
    );
    report(
        "mmap-writable",
        raw::map_shared(raw, size as usize, libc::PROT_READ | libc::PROT_WRITE),
    );
    report("seal-grow", raw::add_seals(raw, libc::F_SEAL_GROW));
    report("seal-write", raw::add_seals(raw, libc::F_SEAL_WRITE));
    report(
        "seal-future-write",
        raw::add_seals(raw, libc::F_SEAL_FUTURE_WRITE),
    );
    report("seal-seal", raw::add_seals(raw, libc::F_SEAL_SEAL));
    report("ftruncate-shrink", raw::ftruncate(raw, size / 2));

    // The controls: a writer still writes, through the library and through a mapping.
    report_call(
        "library-write",
        regions::Region::open_ino(socket, ino, true).and_then(|r| r.write_at(0, b"library!")),
    );
    let mapped = write_through_mapping(path);
    if let Err(e) = &mapped {
        println!("mapping-write-error: {e}");
    }
    report_call("mapping-write", mapped);
    let after = file.metadata().context("fstat of the segment")?.len();
    println!("size-after: {after}");
    Ok(())
}

/// Maps the mounted file `path` for writing, stores `mapped!` at 128 KiB and publishes it.
fn write_through_mapping(path: &Path) -> regions::Result<()> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| RegionsError::Io {
            what: format!("cannot open {}", path.display()),
            source,
        })?;
    let m = regions::mapping::map_fd(std::os::fd::AsFd::as_fd(&file))?;
    let at = 128 << 10;
    if m.len() < at + 8 {
        return Err(RegionsError::Invalid(format!(
            "the mapping is {} bytes, too short for the test",
            m.len()
        )));
    }
    // SAFETY: `at + 8` bytes lie inside the writable mapping (checked above), which lives
    // until `m` drops.
    unsafe { std::ptr::copy_nonoverlapping(b"mapped!!".as_ptr(), m.base().add(at), 8) };
    m.msync(m.base(), m.len())
}

/// Takes a read-only segment of `ino`, prints `ready`, waits for a line on stdin (root
/// truncates the region and hands its memory to another region meanwhile), then reads the
/// whole memfd and counts the bytes equal to `marker` (the other region's contents):
/// `size: N`, `marker-bytes: N`.
fn hold_segment(agent: &mut AgentClient, ino: u64, marker: u8) -> anyhow::Result<()> {
    let (fd, _) = segment(agent, ino, false)?;
    println!("ready");
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("waiting for the change")?;
    let file = File::from(fd);
    let size = file.metadata().context("fstat of the segment")?.len();
    let mut found = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < size {
        let n = file.read_at(&mut buf, at).context("reading the segment")?;
        if n == 0 {
            break;
        }
        found += buf[..n].iter().filter(|&&b| b == marker).count() as u64;
        at += n as u64;
    }
    println!("size: {size}");
    println!("marker-bytes: {found}");
    Ok(())
}

fn by_inode(agent: &mut AgentClient, ino: u64) {
    report_call("open", agent.open(ino, false));
    report_call("open-write", agent.open(ino, true));
    report_call("segment", agent.segment(ino, false));
    report_call("map-refresh", agent.map_refresh(ino, 0, false, 0));
    report_call("map-extend", agent.map_extend(ino, 1 << 20, false));
}

mod fuzz {
    //! `fuzz`: random well-formed and malformed agent messages (see tests/tests/agent_fuzz.rs).

    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::path::Path;
    use std::time::Duration;

    use prost::Message;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use regions_proto::v1::{self, agent_request::Request};

    /// How long a caller waits for an answer before it hangs up (a blocking sync call, say).
    const PATIENCE: Duration = Duration::from_millis(300);

    fn request(rng: &mut StdRng, inos: &[u64]) -> v1::AgentRequest {
        let ino = match rng.random_range(0..6) {
            0 => 0,
            1 => rng.random(),
            2 => 1,
            _ => inos[rng.random_range(0..inos.len())],
        };
        let size = match rng.random_range(0..4) {
            0 => u64::MAX,
            1 => rng.random(),
            _ => rng.random_range(0..(1 << 20)),
        };
        let name: String = match rng.random_range(0..5) {
            0 => String::new(),
            1 => "x".repeat(300),
            2 => "a/b".into(),
            _ => format!("f{}", rng.random_range(0..8)),
        };
        let request = match rng.random_range(0..10) {
            0 => Request::Open(v1::AgentOpen {
                ino,
                write: rng.random(),
            }),
            1 => Request::Segment(v1::AgentSegment {
                ino,
                write: rng.random(),
                // A length to wait for holds the connection up to the daemon's bound: rarely.
                covering: if rng.random_ratio(1, 16) {
                    rng.random_range(1..1 << 20)
                } else {
                    0
                },
            }),
            2 => Request::Stats(v1::AgentStats {}),
            3 => Request::MapRefresh(v1::MapRefresh {
                ino,
                known_version: rng.random(),
                write: rng.random(),
                handle: if rng.random() {
                    0
                } else {
                    rng.random_range(0..64)
                },
            }),
            4 => Request::MapExtend(v1::MapExtend {
                ino,
                size,
                chunks: size % 2 == 0,
            }),
            5 => Request::MapClose(v1::MapClose {
                handle: rng.random_range(0..64),
            }),
            6 => Request::OwnerCreate(v1::OwnerCreate {
                parent: if rng.random_bool(0.7) { 1 } else { ino },
                name,
                mode: rng.random(),
                attrs: None,
                preallocate: if rng.random_bool(0.8) { 0 } else { size },
            }),
            _ => Request::Sync(v1::SyncCall {
                op: rng.random_range(0..16),
                name,
                n: rng.random_range(0..4),
                tid: rng.random(),
                generation: rng.random(),
                mode: rng.random_bool(0.5).then(|| rng.random()),
            }),
        };
        v1::AgentRequest {
            request: Some(request),
        }
    }

    /// One message on `stream`: a valid request, garbage, a length over the limit, or a message
    /// cut short. Returns false when the connection is done (closed by either side).
    fn send_one(stream: &mut UnixStream, rng: &mut StdRng, inos: &[u64]) -> bool {
        let body = match rng.random_range(0..10) {
            0 => (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect(),
            1 => {
                // A length far over the limit, then a few bytes.
                let mut b = rng
                    .random_range(2u32 << 20..u32::MAX)
                    .to_le_bytes()
                    .to_vec();
                b.extend_from_slice(b"junk");
                let _ = stream.write_all(&b);
                return read_reply(stream);
            }
            2 => {
                // A message cut short, then the caller leaves.
                let body = request(rng, inos).encode_to_vec();
                let mut b = ((body.len() + 10) as u32).to_le_bytes().to_vec();
                b.extend_from_slice(&body);
                let _ = stream.write_all(&b);
                return false;
            }
            _ => request(rng, inos).encode_to_vec(),
        };
        let mut framed = (body.len() as u32).to_le_bytes().to_vec();
        framed.extend_from_slice(&body);
        if stream.write_all(&framed).is_err() {
            return false;
        }
        read_reply(stream)
    }

    /// Reads one reply (and drops any descriptor); false when the connection ended or the reply
    /// did not come within [`PATIENCE`].
    fn read_reply(stream: &mut UnixStream) -> bool {
        let mut len = [0u8; 4];
        if stream.read_exact(&mut len).is_err() {
            return false;
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > 64 << 20 {
            return false;
        }
        let mut body = vec![0u8; len];
        if stream.read_exact(&mut body).is_err() {
            return false;
        }
        v1::AgentReply::decode(body.as_slice()).is_ok()
    }

    fn connect(socket: &Path) -> std::io::Result<UnixStream> {
        let s = UnixStream::connect(socket)?;
        s.set_read_timeout(Some(PATIENCE))?;
        s.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(s)
    }

    /// Opens `n` connections and asks each for the agent's stats; returns how many answered.
    /// The connections stay open (returned) so that the caller can hold them.
    pub fn flood(socket: &Path, n: usize) -> (usize, Vec<UnixStream>) {
        let body = v1::AgentRequest {
            request: Some(Request::Stats(v1::AgentStats {})),
        }
        .encode_to_vec();
        let mut framed = (body.len() as u32).to_le_bytes().to_vec();
        framed.extend_from_slice(&body);
        let mut streams = Vec::new();
        for _ in 0..n {
            if let Ok(s) = connect(socket) {
                streams.push(s);
            }
        }
        let mut answered = 0;
        for s in &mut streams {
            if s.write_all(&framed).is_ok() && read_reply(s) {
                answered += 1;
            }
        }
        (answered, streams)
    }

    /// Plays `cases` messages on connections of the current user.
    /// Returns how many messages were answered.
    pub fn play(socket: &Path, seed: u64, cases: usize, inos: &[u64]) -> std::io::Result<usize> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut stream = connect(socket)?;
        let mut answered = 0;
        for _ in 0..cases {
            if send_one(&mut stream, &mut rng, inos) {
                answered += 1;
            } else {
                stream = connect(socket)?;
            }
        }
        Ok(answered)
    }
}

/// Locates mutex `name` (which the user may use) and turns its capability against the rest of
/// the lock region: the slots either side (other objects' words), and the whole region
/// through the host agent. `own-word` is the control.
fn sync_slot(agent: &mut AgentClient, socket: &Path, name: &str) -> anyhow::Result<()> {
    use regions::transport::tcp::{RetryPolicy, TcpTransport};
    use regions::transport::{Span, Transport};
    let sync = regions::sync::SyncClient::connect(socket);
    let loc = match sync.mutex_locate(name) {
        Ok(l) => l,
        Err(e) => {
            println!("locate: failed {}", e.errno());
            bail!("cannot locate {name}: {e}");
        }
    };
    let t = TcpTransport::with_capability(
        &loc.transport_addr,
        3,
        &loc.capability,
        RetryPolicy::default(),
        Default::default(),
    );
    let word = |delta: i64| Span {
        ino: loc.ino,
        region_offset: loc.region_offset.wrapping_add_signed(delta),
        pool: loc.pool,
        pool_offset: loc.pool_offset.wrapping_add_signed(delta),
        len: 8,
    };
    report_call("own-word", t.fetch_add(&word(0), 0));
    report_call("next-slot", t.compare_and_swap(&word(64), 0, 1));
    if loc.region_offset >= 64 {
        report_call("previous-slot", t.compare_and_swap(&word(-64), 0, 1));
    }
    report_call("whole-region-segment", agent.segment(loc.ino, true));
    report_call("whole-region-open", agent.open(loc.ino, true));
    Ok(())
}

/// Opens region `ino` for reading through the library and, separately, takes a capability
/// token for it and reads with it on a raw transport connection; prints `ready`, waits for a
/// line on stdin (root changes the region meanwhile), then reads both ways again:
/// `old-token` with the token taken before the change, `library-read` through the library,
/// which renews its capability when the daemon says it was revoked.
fn revoked(agent: &mut AgentClient, socket: &Path, ino: u64) -> anyhow::Result<()> {
    use regions::transport::tcp::{RetryPolicy, TcpTransport};
    use regions::transport::{Span, Transport};
    let region = match regions::Region::open_ino(socket, ino, false) {
        Ok(r) => r,
        Err(e) => {
            println!("open: failed {}", e.errno());
            bail!("cannot open region {ino}: {e}");
        }
    };
    let mut buf = [0u8; 4];
    report_call("library-read-before", region.read_at(0, &mut buf));
    let loc = region.chunk(0).context("where chunk 0 is")?;
    println!("chunk-local: {}", loc.local);
    let info = agent
        .open(ino, false)
        .context("a second open for its token")?;
    let raw = TcpTransport::with_capability(
        &loc.addr,
        9,
        &info.capability,
        RetryPolicy::default(),
        Default::default(),
    );
    let span = Span {
        ino,
        region_offset: 0,
        pool: loc.pool,
        pool_offset: loc.pool_offset,
        len: 4,
    };
    report_call("old-token-before", raw.read(&[span], &mut buf));
    println!("ready");
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("waiting for the change")?;
    // A new connection, as a client would make after the old one broke.
    let fresh = TcpTransport::with_capability(
        &loc.addr,
        9,
        &info.capability,
        RetryPolicy::default(),
        Default::default(),
    );
    report_call("old-token", raw.read(&[span], &mut buf));
    report_call("old-token-new-connection", fresh.read(&[span], &mut buf));
    report_call("library-read", region.read_at(0, &mut buf));
    println!("content: {}", String::from_utf8_lossy(&buf));
    Ok(())
}

/// Every way to change a mount's page of descriptor epochs at `path` (so that `rmalloc(fd)` in
/// another user's process would skip its check), or to put a page of one's own beside it.
fn epoch_page(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let io = |r: std::io::Result<()>| r.map_err(|e| e.raw_os_error().unwrap_or(libc::EIO));
    report(
        "open-write",
        io(std::fs::OpenOptions::new().write(true).open(path).map(drop)),
    );
    match File::open(path) {
        Ok(f) => {
            println!("read: ok");
            report(
                "mmap-writable",
                raw::map_shared(f.as_raw_fd(), 4096, libc::PROT_READ | libc::PROT_WRITE),
            );
            report(
                "mprotect-writable",
                raw::mprotect_writable(f.as_raw_fd(), 4096),
            );
        }
        Err(e) => println!("read: failed {}", e.raw_os_error().unwrap_or(libc::EIO)),
    }
    report(
        "chmod",
        io(std::fs::set_permissions(
            path,
            std::fs::Permissions::from_mode(0o666),
        )),
    );
    report("unlink", io(std::fs::remove_file(path)));
    let dir = path.parent().unwrap_or(Path::new("/"));
    report(
        "plant",
        io(std::fs::write(
            dir.join("descriptor-epochs.1.planted"),
            [0u8; 4096],
        )),
    );
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(socket), Some(command), Some(first)) = (args.first(), args.get(1), args.get(2))
    else {
        bail!(
            "usage: regions-attack SOCKET read-segment|write-segment|by-inode|create-in|close|fuzz ARG…"
        );
    };
    let number = || -> anyhow::Result<u64> {
        first
            .parse()
            .with_context(|| format!("{first:?} is not a number"))
    };
    let mut agent = AgentClient::connect(Path::new(socket))
        .with_context(|| format!("cannot connect to the host agent at {socket}"))?;
    match command.as_str() {
        "read-segment" => read_segment(&mut agent, number()?)?,
        "write-segment" => {
            let path = args.get(3).context("write-segment needs INO PATH")?;
            write_segment(&mut agent, Path::new(socket), number()?, Path::new(path))?
        }
        "by-inode" => by_inode(&mut agent, number()?),
        "hold-segment" => {
            let marker = args.get(3).context("hold-segment needs INO BYTE")?;
            hold_segment(&mut agent, number()?, marker.parse()?)?
        }
        "create-in" => {
            let name = args.get(3).context("create-in needs PARENT NAME")?;
            report_call(
                "create",
                agent.create_owned(number()?, name, 0o644, None, 0),
            );
        }
        "close" => report_call("close", agent.map_close(number()?)),
        "epoch-page" => epoch_page(Path::new(first)),
        "sync" => {
            // FIRST is the object's name here.
            let sync = regions::sync::SyncClient::connect(Path::new(socket));
            let locked = sync.mutex_lock(first);
            let held = locked.is_ok();
            report_call("lock", locked);
            if held {
                report_call("unlock", sync.mutex_unlock(first));
            }
            report_call("ring", sync.bell_ring(first));
            report_call("delete", sync.delete(first));
        }
        "fuzz" => {
            let cases = args.get(3).context("fuzz needs SEED CASES INOS")?;
            let inos: Vec<u64> = args
                .get(4)
                .context("fuzz needs SEED CASES INOS")?
                .split(',')
                .filter_map(|s| s.parse().ok())
                .collect();
            if inos.is_empty() {
                bail!("fuzz needs at least one inode number to aim at");
            }
            let answered = fuzz::play(Path::new(socket), number()?, cases.parse()?, &inos)
                .context("the host agent stopped accepting connections")?;
            println!("answered: {answered}");
            println!("fuzz: done");
        }
        "sync-slot" => sync_slot(&mut agent, Path::new(socket), first)?,
        "revoked" => revoked(&mut agent, Path::new(socket), number()?)?,
        "flood" => {
            drop(agent);
            let (answered, held) = fuzz::flood(Path::new(socket), number()? as usize);
            println!("answered: {answered}");
            println!("holding: {}", held.len());
            // Hold them until the test closes our stdin.
            let mut rest = String::new();
            let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
            drop(held);
        }
        other => bail!("unknown command {other:?}"),
    }
    Ok(())
}
