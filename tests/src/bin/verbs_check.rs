//! `regions-verbs-check [DEVICE]`: drives `regions-verbs` between two processes on a real RDMA
//! device (soft-RoCE in the test VM of `tests/tests/rdma.rs`): a server process registers a
//! memfd mapping as a pool does, and this process reads, writes and updates it one-sided.
//!
//! The server (this binary with `serve`) talks over its stdin/stdout, one line each way:
//! `ep HEX ADDR RKEY LEN` (its queue pair and memory) → the client answers `ep HEX`; the
//! server connects and says `ok`; `again HEX` makes it a new queue pair for the client's new
//! one; `check` makes it compare its memory with what the client wrote (`verified` or
//! `mismatch: ...`); `quit` ends it.
//!
//! Prints `regions-verbs-check: all passed` and exits 0 when every check held; else says which
//! failed and exits 1.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use regions_verbs::{
    Access, Device, Endpoint, Local, Op, ProtectionDomain, QueuePair, RegisteredBuffer,
    Registration, Remote, VerbsError,
};

/// Size of the server's memory.
const POOL: usize = 1 << 20;
/// Where the client writes its pattern, and how much.
const PATTERN_AT: u64 = 4096;
const PATTERN_LEN: usize = 64 << 10;
const TIMEOUT: Duration = Duration::from_secs(10);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    ensure!(s.len().is_multiple_of(2), "odd hex {s}");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).context("hex"))
        .collect()
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 8)) as u8
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => serve(args.get(1).map(String::as_str)),
        device => client(device),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("regions-verbs-check: FAILED: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The server's memory: a memfd mapped shared, as a daemon maps its pool chunks.
struct Pool {
    base: *mut u8,
}

impl Pool {
    fn new() -> anyhow::Result<Pool> {
        // SAFETY: memfd_create with a static NUL-terminated name; the fd is checked.
        let fd = unsafe { libc::memfd_create(c"verbs-check".as_ptr(), libc::MFD_CLOEXEC) };
        ensure!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: sizing the memfd just made.
        let sized = unsafe { libc::ftruncate(fd, POOL as i64) };
        ensure!(sized == 0, "ftruncate");
        // SAFETY: a new shared mapping of the whole memfd at an address the kernel picks.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                POOL,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: the mapping holds its own reference to the memfd.
        unsafe { libc::close(fd) };
        ensure!(base != libc::MAP_FAILED, "mmap of the memfd");
        Ok(Pool { base: base.cast() })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: POOL mapped bytes, never unmapped (the process ends with it); the device
        // writes them only while the client's requests run, which `check` comes after.
        unsafe { std::slice::from_raw_parts(self.base, POOL) }
    }
}

fn serve(device: Option<&str>) -> anyhow::Result<()> {
    let dev = Device::open(device, 0)?;
    let pd = dev.protection_domain()?;
    let pool = Pool::new()?;
    // SAFETY: the pool stays mapped for the life of the process.
    let reg = unsafe { Registration::register(&pd, pool.base, POOL, Access::REMOTE)? };
    // The same memory, registered for remote reads only (what a read-only opener is given).
    let read_only = Access::READ;
    // SAFETY: as above.
    let ro = unsafe { Registration::register(&pd, pool.base, POOL, read_only)? };
    let mut qp = QueuePair::create(&pd, 64)?;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    writeln!(
        out,
        "ep {} {} {} {} {}",
        hex(&qp.endpoint().to_bytes()),
        reg.addr(),
        reg.rkey(),
        reg.len(),
        ro.rkey()
    )?;
    out.flush()?;
    for line in stdin.lock().lines() {
        let line = line?;
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("ep"), Some(h)) => {
                qp.connect(&Endpoint::from_bytes(&unhex(h)?)?)?;
                writeln!(out, "ok")?;
            }
            (Some("again"), Some(h)) => {
                qp = QueuePair::create(&pd, 64)?;
                let mine = qp.endpoint();
                qp.connect(&Endpoint::from_bytes(&unhex(h)?)?)?;
                writeln!(out, "ep {}", hex(&mine.to_bytes()))?;
            }
            (Some("check"), _) => {
                let b = pool.bytes();
                let word = u64::from_ne_bytes(b[0..8].try_into()?);
                let at = PATTERN_AT as usize;
                let bad = (0..PATTERN_LEN).find(|&i| b[at + i] != pattern(i));
                match (word, bad) {
                    (15, None) => writeln!(out, "verified")?,
                    (w, bad) => writeln!(out, "mismatch: word {w}, first bad byte {bad:?}")?,
                }
            }
            (Some("quit"), _) => break,
            _ => bail!("server: unknown line {line:?}"),
        }
        out.flush()?;
    }
    drop((reg, ro));
    Ok(())
}

struct Server {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Server {
    fn line(&mut self) -> anyhow::Result<String> {
        let mut s = String::new();
        self.output.read_line(&mut s)?;
        ensure!(!s.is_empty(), "the server process ended early");
        Ok(s.trim_end().to_owned())
    }

    fn say(&mut self, s: &str) -> anyhow::Result<String> {
        writeln!(self.input, "{s}")?;
        self.input.flush()?;
        self.line()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "quit");
        let _ = self.input.flush();
        let _ = self.child.wait();
    }
}

/// Reads the 8-byte word at `at` over `qp` into `buf` at `slot` and returns it.
fn read_word(
    qp: &mut QueuePair,
    buf: &mut RegisteredBuffer,
    slot: usize,
    at: Remote,
) -> anyhow::Result<u64> {
    let local = Local {
        offset: slot,
        len: 8,
    };
    qp.execute(buf, &[Op::Read { local, remote: at }], TIMEOUT)?;
    Ok(u64::from_ne_bytes(buf.bytes()[slot..slot + 8].try_into()?))
}

/// A new queue pair, connected to a new one of the server's (after a refusal broke the old).
fn reconnect(pd: &Arc<ProtectionDomain>, server: &mut Server) -> anyhow::Result<QueuePair> {
    let mut qp = QueuePair::create(pd, 64)?;
    let reply = server.say(&format!("again {}", hex(&qp.endpoint().to_bytes())))?;
    let h = reply
        .strip_prefix("ep ")
        .with_context(|| format!("server said {reply:?}"))?;
    qp.connect(&Endpoint::from_bytes(&unhex(h)?)?)?;
    Ok(qp)
}

fn client(device: Option<&str>) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve");
    if let Some(d) = device {
        cmd.arg(d);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("start the server process")?;
    let input = child.stdin.take().context("server stdin")?;
    let output = BufReader::new(child.stdout.take().context("server stdout")?);
    let mut server = Server {
        child,
        input,
        output,
    };
    let first = server.line()?;
    let w: Vec<&str> = first.split_whitespace().collect();
    ensure!(w.len() == 6 && w[0] == "ep", "server said {first:?}");
    let ro_rkey: u32 = w[5].parse()?;
    let server_ep = Endpoint::from_bytes(&unhex(w[1])?)?;
    let (addr, rkey, len): (u64, u32, u64) = (w[2].parse()?, w[3].parse()?, w[4].parse()?);
    ensure!(len == POOL as u64, "server registered {len} bytes");
    let remote = |off: u64| Remote {
        addr: addr + off,
        rkey,
    };

    let dev = Device::open(device, 0)?;
    println!("device {} (atomics: {:?})", dev.name(), dev.atomic_scope());
    let pd = dev.protection_domain()?;
    let mut buf = RegisteredBuffer::new(&pd, 4 * PATTERN_LEN)?;
    let mut qp = QueuePair::create(&pd, 64)?;
    qp.connect(&server_ep)?;
    let ok = server.say(&format!("ep {}", hex(&qp.endpoint().to_bytes())))?;
    ensure!(ok == "ok", "server said {ok:?}");

    // WRITE a pattern, READ it back elsewhere in the buffer.
    for (i, b) in buf.bytes_mut()[..PATTERN_LEN].iter_mut().enumerate() {
        *b = pattern(i);
    }
    let whole = Local {
        offset: 0,
        len: PATTERN_LEN,
    };
    qp.execute(
        &mut buf,
        &[Op::Write {
            local: whole,
            remote: remote(PATTERN_AT),
        }],
        TIMEOUT,
    )?;
    qp.execute(
        &mut buf,
        &[Op::Read {
            local: Local {
                offset: PATTERN_LEN,
                len: PATTERN_LEN,
            },
            remote: remote(PATTERN_AT),
        }],
        TIMEOUT,
    )?;
    ensure!(
        buf.bytes()[PATTERN_LEN..2 * PATTERN_LEN] == buf.bytes()[..PATTERN_LEN],
        "READ after WRITE returned other bytes"
    );
    println!("write then read of {PATTERN_LEN} bytes: ok");

    // Three READs posted as one list with one completion.
    let pieces = [(100u64, 3000usize), (9000, 5000), (40_000, 1)];
    let mut ops = Vec::new();
    let mut at = 2 * PATTERN_LEN;
    for &(off, n) in &pieces {
        ops.push(Op::Read {
            local: Local { offset: at, len: n },
            remote: remote(PATTERN_AT + off),
        });
        at += n;
    }
    qp.execute(&mut buf, &ops, TIMEOUT)?;
    let mut at = 2 * PATTERN_LEN;
    for &(off, n) in &pieces {
        let got = &buf.bytes()[at..at + n];
        let want: Vec<u8> = (0..n).map(|i| pattern(off as usize + i)).collect();
        ensure!(got == &want[..], "vector READ piece at {off} differs");
        at += n;
    }
    println!("vector READ of {} pieces in one list: ok", pieces.len());

    // Atomics on word 0: CAS 0→5 (wins), CAS 0→7 (loses, sees 5), FAA +10 (sees 5).
    let slot = 3 * PATTERN_LEN;
    let old = |buf: &RegisteredBuffer| {
        u64::from_ne_bytes(buf.bytes()[slot..slot + 8].try_into().unwrap_or([0; 8]))
    };
    let steps = [
        (
            Op::CompareSwap {
                local: slot,
                remote: remote(0),
                expected: 0,
                new: 5,
            },
            0u64,
        ),
        (
            Op::CompareSwap {
                local: slot,
                remote: remote(0),
                expected: 0,
                new: 7,
            },
            5,
        ),
        (
            Op::FetchAdd {
                local: slot,
                remote: remote(0),
                add: 10,
            },
            5,
        ),
    ];
    for (op, want) in steps {
        qp.execute(&mut buf, &[op], TIMEOUT)?;
        ensure!(
            old(&buf) == want,
            "{op:?} returned {} not {want}",
            old(&buf)
        );
    }
    let word = read_word(&mut qp, &mut buf, slot, remote(0))?;
    ensure!(word == 15, "word 0 is {word} after the atomics");
    println!("compare-and-swap and fetch-and-add: ok");
    let verdict = server.say("check")?;
    ensure!(verdict == "verified", "server memory: {verdict}");
    println!("the server's memory holds what was written: ok");

    // Refused: a wrong key, and a range past the registration. Each breaks the queue pair,
    // and a new one works.
    let refused: [(&str, Op); 4] = [
        (
            "wrong rkey",
            Op::Read {
                local: Local { offset: 0, len: 64 },
                remote: Remote {
                    addr,
                    rkey: rkey.wrapping_add(1),
                },
            },
        ),
        (
            "WRITE with a read-only key",
            Op::Write {
                local: Local { offset: 0, len: 64 },
                remote: Remote {
                    addr,
                    rkey: ro_rkey,
                },
            },
        ),
        (
            "fetch-and-add with a read-only key",
            Op::FetchAdd {
                local: slot,
                remote: Remote {
                    addr,
                    rkey: ro_rkey,
                },
                add: 1,
            },
        ),
        (
            "past the registration",
            Op::Read {
                local: Local {
                    offset: 0,
                    len: 4096,
                },
                remote: remote(POOL as u64 - 100),
            },
        ),
    ];
    for (what, op) in refused {
        match qp.execute(&mut buf, &[op], TIMEOUT) {
            Err(VerbsError::Completion { status, text, .. }) => {
                println!("{what}: refused ({text}, status {status})");
            }
            other => bail!("{what}: expected a failed completion, got {other:?}"),
        }
        ensure!(qp.is_broken(), "{what}: the queue pair should be broken");
        qp = reconnect(&pd, &mut server)?;
        let word = read_word(&mut qp, &mut buf, slot, remote(0))?;
        ensure!(word == 15, "after reconnecting, word 0 reads {word}");
        // Reading with the read-only key works.
        let word = read_word(
            &mut qp,
            &mut buf,
            slot,
            Remote {
                addr,
                rkey: ro_rkey,
            },
        )?;
        ensure!(word == 15, "a read with the read-only key gives {word}");
    }
    println!("a new queue pair after each refusal: ok");
    println!("regions-verbs-check: all passed");
    Ok(())
}
