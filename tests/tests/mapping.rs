//! Mapping regions into processes (issue 5): two host ids, real manager, daemons and regionfs
//! mounts; region fds come from real files under the mounts. Remote chunks are served by
//! userfaultfd through capability-authenticated transports, local ones by the segment memfd.

use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use regions::Region;
use regions::agent::AgentClient;
use regions::mapping;
use regions_tests::{Cluster, MountProcess, bin_path};

/// Mounts first so they stop before the cluster.
struct Setup {
    m1: MountProcess,
    m2: MountProcess,
    cluster: Cluster,
}

fn setup() -> Setup {
    let cluster = Cluster::start(2, "512M").expect("cluster");
    let m1 = cluster.mount(1).expect("mount host 1");
    let m2 = cluster.mount(2).expect("mount host 2");
    Setup { m1, m2, cluster }
}

impl Setup {
    fn stats(&self, host: u32) -> regions_proto::v1::DaemonStats {
        let socket = &self.cluster.daemon(host).expect("daemon").socket;
        AgentClient::connect(socket)
            .and_then(|mut a| a.stats())
            .expect("daemon stats")
    }
}

fn word(off: usize) -> u64 {
    (off as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5eed
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len / 8)
        .flat_map(|i| word(i * 8).to_le_bytes())
        .collect()
}

/// Writes `data` as a new region file through a mount (its host holds it) and syncs it.
fn create(path: &Path, data: &[u8]) {
    let mut f = std::fs::File::create(path).expect("create region file");
    f.write_all(data).expect("write region");
    f.sync_all().expect("sync region");
}

/// Opens `path` for reading and writing and maps it; the descriptor comes back too, held as
/// long as the mapping in the tests that use it.
fn map_read_write(path: impl AsRef<Path>) -> (std::fs::File, std::sync::Arc<mapping::Mapping>) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open the region file for reading and writing");
    let m = mapping::map_fd(file.as_fd()).expect("map");
    (file, m)
}

fn getxattr(p: &Path, name: &str) -> String {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let r = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(
        r >= 0,
        "getxattr {name}: {}",
        std::io::Error::last_os_error()
    );
    buf.truncate(r as usize);
    String::from_utf8(buf).unwrap()
}

fn parse_addr(s: &str) -> u64 {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
        None => s.parse().unwrap(),
    }
}

/// A `regions-map-helper` process speaking its line protocol.
struct Helper {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Helper {
    fn spawn(path: &Path, mode: &str) -> Helper {
        let mut cmd = Command::new(bin_path("regions-map-helper").expect("helper binary"));
        cmd.arg(path).arg(mode);
        Helper::spawn_cmd(cmd)
    }

    /// Runs `cmd`, which must start the helper (possibly through a wrapper).
    fn spawn_cmd(mut cmd: Command) -> Helper {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn helper");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("helper stdout");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut h = Helper {
            child,
            stdin,
            lines: rx,
        };
        assert_eq!(h.line(), "ready");
        h
    }

    fn line(&mut self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(30))
            .expect("helper answered within 30 s")
    }

    fn send(&mut self, cmd: &str) {
        let stdin = self.stdin.as_mut().expect("helper stdin");
        writeln!(stdin, "{cmd}").expect("write to helper");
        stdin.flush().expect("flush helper stdin");
    }

    fn cmd(&mut self, cmd: &str) -> String {
        self.send(cmd);
        self.line()
    }

    /// Waits at most `bound` for the process to end.
    fn wait(&mut self, bound: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < bound {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if self.wait(Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Reads the u64 at `off` of a mapping.
fn read_word(m: &mapping::Mapping, off: usize) -> u64 {
    assert!(off + 8 <= m.len());
    // SAFETY: an aligned word inside the live mapping.
    unsafe { std::ptr::read_volatile(m.base().add(off).cast::<u64>()) }
}

#[test]
fn remote_region_maps_at_its_fixed_address_on_both_hosts() {
    let s = setup();
    let dir = s.m2.path("fix");
    std::fs::create_dir(&dir).unwrap();
    regions_tests::set_xattr(&dir, "user.regions.fixvaddr", b"1").expect("setxattr fixvaddr");
    let len = 1 << 20;
    let data = pattern(len);
    create(&s.m2.path("fix/data"), &data);
    let vaddr = parse_addr(&getxattr(&s.m2.path("fix/data"), "user.regions.vaddr"));
    assert_ne!(vaddr, 0, "FIXVADDR region has an address");

    // Host 1: the region is on host 2, so every page comes through userfaultfd + transport.
    let before = s.stats(2);
    let file = std::fs::File::open(s.m1.path("fix/data")).unwrap();
    let m = mapping::map_fd(file.as_fd()).expect("map on host 1");
    assert_eq!(m.base() as u64, vaddr, "mapped at the fixed address");
    assert!(m.len() >= len);
    // SAFETY: the mapping holds at least `len` readable bytes.
    let seen = unsafe { std::slice::from_raw_parts(m.base(), len) };
    assert!(
        seen == &data[..],
        "bytes read through the mapping match the writer's"
    );
    let after = s.stats(2);
    assert!(
        after.transport_bytes_read - before.transport_bytes_read >= len as u64,
        "pages were fetched from host 2's daemon"
    );
    // Mapping it again returns the same mapping.
    let again = mapping::map_fd(file.as_fd()).unwrap();
    assert_eq!(again.base(), m.base());
    assert!(mapping::lookup(m.base().wrapping_add(100)).is_some());

    // Host 2 (another process; the region is local there): the same address.
    let mut h = Helper::spawn(&s.m2.path("fix/data"), "ro");
    assert_eq!(parse_addr(&h.cmd("base")), vaddr);
    assert_eq!(h.cmd("r 8192").parse::<u64>().unwrap(), word(8192));
    mapping::unmap(m.base()).unwrap();
    assert!(mapping::lookup(m.base()).is_none());
}

/// Sequential first touch reads ahead in jobs that cross chunks: each goes to the daemon as
/// one request per run of chunks that lie one after another in its pool, not one per chunk
/// (which cost the daemon a reply, and system calls, per 128 KiB).
#[test]
fn sequential_touch_asks_the_daemon_once_per_run_of_chunks() {
    let s = setup();
    let len = 16 << 20;
    let data = pattern(len);
    create(&s.m2.path("stream"), &data);
    let expected = data
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
        .fold(0u64, u64::wrapping_add);
    let before = s.stats(2);
    // In a process of its own: the read-ahead queue is per process, and the other tests of this
    // file fill this one's.
    let mut h = Helper::spawn(&s.m1.path("stream"), "ro");
    let sum: u64 = h.cmd(&format!("sum 0 {len}")).parse().expect("a sum");
    assert_eq!(sum, expected, "every page reads what host 2 wrote");
    drop(h);
    let after = s.stats(2);
    let requests = after.transport_requests - before.transport_requests;
    let chunks = (len / (128 << 10)) as u64;
    assert!(
        requests < chunks / 2,
        "{requests} transport requests for {chunks} chunks read in order (one per chunk would \
         be {chunks})"
    );
}

/// Random faults fetch what they touch: with the default prefetch window, faults on pages far
/// apart halve the window down to one page, so 100 of them read about 100 pages from the
/// holder, not 100 windows; and faults walking forward from there double it again.
#[test]
fn random_faults_fetch_small_windows() {
    let s = setup();
    let len = 32 << 20;
    let data = pattern(len);
    create(&s.m2.path("random"), &data);
    let before = s.stats(2);
    let mut h = Helper::spawn(&s.m1.path("random"), "ro");
    let page = 4096;
    for i in 0..100 {
        let off = (i * 61 + 7) * page;
        let v: u64 = h.cmd(&format!("r {off}")).parse().expect("a word");
        assert_eq!(v, word(off), "page {}", off / page);
    }
    let random = s.stats(2).transport_bytes_read - before.transport_bytes_read;
    assert!(
        random < 200 * page as u64,
        "100 random faults read {} pages (16-page windows would be 1,600)",
        random / page as u64
    );
    // Then a walk forward from a page far away, page by page: each fault near the last one
    // doubles the window (1, 2, 4, 8, 16 pages), so 16 pages take 5 requests, not 16.
    let before = s.stats(2);
    let far = 8000;
    for q in far..far + 16 {
        let off = q * page;
        let v: u64 = h.cmd(&format!("r {off}")).parse().expect("a word");
        assert_eq!(v, word(off), "page {q}");
    }
    let requests = s.stats(2).transport_requests - before.transport_requests;
    assert!(
        requests <= 8,
        "16 pages walked in order after random faults took {requests} requests (the \
         random window kept at one page would take 16)"
    );
    drop(h);
}

/// An rmsync of many dirty chunks writes them back in requests that each carry a run of
/// chunks lying one after another in the daemon's pool, not one request per chunk, and a
/// fresh reader on the holder sees every store.
#[test]
fn rmsync_writes_runs_of_chunks_in_few_requests() {
    let s = setup();
    let len = 16 << 20;
    create(&s.m2.path("synced"), &pattern(len));
    let (_file, m) = map_read_write(s.m1.path("synced"));
    let mut expected = pattern(len);
    // Every page of the first half; in the second, every other page and the pages on either
    // side of each chunk's end (runs that meet across a chunk boundary, and gaps).
    let chunk = 128 << 10;
    let dirty = |page: usize| {
        page < len / 2
            || (page / 4096).is_multiple_of(2)
            || page % chunk == chunk - 4096
            || page.is_multiple_of(chunk)
    };
    for page in (0..len).step_by(4096).filter(|&p| dirty(p)) {
        let v = word(page) ^ 0xffff;
        // SAFETY: the mapping holds at least `len` writable bytes.
        unsafe { std::ptr::write_volatile(m.base().add(page).cast::<u64>(), v) };
        expected[page..page + 8].copy_from_slice(&v.to_le_bytes());
    }
    let before = s.stats(2);
    m.msync(m.base(), len).expect("rmsync");
    let after = s.stats(2);
    let requests = after.transport_requests - before.transport_requests;
    let chunks = (len / (128 << 10)) as u64;
    assert!(
        requests < chunks / 2,
        "{requests} transport requests to write back {chunks} dirty chunks (one per chunk would \
         be {chunks})"
    );
    mapping::unmap(m.base()).unwrap();
    let reader = Region::open_path(&s.m2.path("synced"), false).expect("fresh reader");
    let mut back = vec![0u8; len];
    assert_eq!(reader.read_at(0, &mut back).unwrap(), len);
    assert!(
        back == expected,
        "a fresh reader on the holder sees every store after rmsync"
    );
}

#[test]
fn markdirty_zero_never_fetches_and_msync_publishes() {
    let s = setup();
    let len = 1 << 20;
    create(&s.m2.path("dz"), &vec![0xABu8; len]);
    let (_file, m) = map_read_write(s.m1.path("dz"));
    let dirty = 256 << 10;
    let before = s.stats(2);
    m.markdirty(m.base(), dirty, true).expect("markdirty zero");
    assert_eq!(read_word(&m, 0), 0, "zero pages, not the remote bytes");
    let data = pattern(dirty);
    // SAFETY: the first `dirty` bytes are mapped writable.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), m.base(), dirty) };
    let after = s.stats(2);
    assert_eq!(
        after.transport_bytes_read, before.transport_bytes_read,
        "markdirty(zero) and writes to those pages fetch nothing"
    );
    m.msync(m.base(), m.len()).expect("msync");
    let synced = s.stats(2);
    assert!(synced.transport_bytes_written - after.transport_bytes_written >= dirty as u64);
    assert_eq!(synced.transport_bytes_read, before.transport_bytes_read);

    // A fresh reader on host 2 sees the written pages and the untouched rest.
    let reader = Region::open_path(&s.m2.path("dz"), false).expect("fresh reader");
    let mut got = vec![0u8; dirty + 4096];
    assert_eq!(reader.read_at(0, &mut got).unwrap(), got.len());
    assert!(got[..dirty] == data[..], "msync published the writes");
    assert!(got[dirty..].iter().all(|&b| b == 0xAB));
    mapping::unmap(m.base()).unwrap();
}

/// `rclearcache` over a region that a sequential reader streams through (read-ahead installs
/// ahead of it all the time): every page still reads right, the reader never gets stuck on a
/// page dropped while it was being installed, and once the clearing stops a last pass over the
/// region finishes (a page left marked present but dropped would fault forever, since no later
/// `rclearcache` resets it).
#[test]
fn clearcache_during_read_ahead_never_strands_a_reader() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let s = setup();
    let len = 48 << 20;
    // Cycles of passes: while rclearcache runs every millisecond (at least three calls), on
    // until part of the way through a pass, then the rest of it and a whole pass with no
    // clearing.
    const CYCLES: usize = 20;
    create(&s.m2.path("ra"), &pattern(len));
    let file = std::fs::File::open(s.m1.path("ra")).unwrap();
    let m = mapping::map_fd(file.as_fd()).expect("map");
    // Odd: clear; even: the reader asks for quiet, and the clearer acknowledges it in `quiet`
    // between two calls.
    let phase = Arc::new(AtomicUsize::new(0));
    let quiet = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let clears = Arc::new(AtomicUsize::new(0));
    let progress = Arc::new(AtomicUsize::new(0));
    let (done_tx, done_rx) = channel::<Result<(), String>>();
    let reader = {
        let (m, progress, phase, quiet, clears) = (
            Arc::clone(&m),
            Arc::clone(&progress),
            Arc::clone(&phase),
            Arc::clone(&quiet),
            Arc::clone(&clears),
        );
        std::thread::spawn(move || {
            let pass = |n: usize, from: usize, to: usize| -> Result<(), String> {
                for off in (from..to).step_by(4096) {
                    progress.store(n * len + off, Relaxed);
                    let got = read_word(&m, off);
                    if got != word(off) {
                        return Err(format!(
                            "pass {n}: word at {off:#x} reads {got:#x}, not {:#x}",
                            word(off)
                        ));
                    }
                }
                Ok(())
            };
            let cycles = || -> Result<(), String> {
                for cycle in 0..CYCLES {
                    // Passes while the clearer runs (at least three of its calls), on until
                    // part of the way through one more.
                    let mid = (len / 4 + (cycle * 7 % 16) * (len / 32)) & !4095;
                    phase.store(2 * cycle + 1, Relaxed);
                    let before = clears.load(Relaxed);
                    while clears.load(Relaxed) < before + 3 {
                        pass(2 * cycle, 0, len)?;
                    }
                    pass(2 * cycle, 0, mid)?;
                    phase.store(2 * cycle + 2, Relaxed);
                    let asked = Instant::now();
                    while quiet.load(Relaxed) != 2 * cycle + 2 {
                        if asked.elapsed() > Duration::from_secs(20) {
                            return Err("the clearer never went quiet".into());
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    // The last drops, by the reader itself, with no later rclearcache to mend
                    // what they leave: the rest of the region (so that reading on faults and
                    // starts read-ahead), then a few times the range just ahead of the reader,
                    // where read-ahead is installing right then. Then the rest of the pass, and
                    // a whole pass.
                    m.clearcache(m.base().wrapping_add(mid), len - mid)
                        .map_err(|e| format!("rclearcache: {e}"))?;
                    let mut at = mid;
                    for _ in 0..3 {
                        let next = (at + (2 << 20)).min(len);
                        pass(2 * cycle, at, next)?;
                        let (from, to) =
                            ((next + (2 << 20)).min(len), (next + (18 << 20)).min(len));
                        if to > from {
                            m.clearcache(m.base().wrapping_add(from), to - from)
                                .map_err(|e| format!("rclearcache: {e}"))?;
                        }
                        at = next;
                    }
                    pass(2 * cycle, at, len)?;
                    pass(2 * cycle + 1, 0, len)?;
                }
                Ok(())
            };
            let _ = done_tx.send(cycles());
        })
    };
    let clearer = {
        let (m, stop, clears, phase, quiet, progress) = (
            Arc::clone(&m),
            Arc::clone(&stop),
            Arc::clone(&clears),
            Arc::clone(&phase),
            Arc::clone(&quiet),
            Arc::clone(&progress),
        );
        std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let now = phase.load(Relaxed);
                if now % 2 == 1 {
                    // The whole mapping, or the few MiB just ahead of the reader (where
                    // read-ahead installs right now: a short drop lands inside an install).
                    let n = clears.fetch_add(1, Relaxed);
                    let (from, to) = if n % 2 == 0 {
                        (0, len)
                    } else {
                        let at = (progress.load(Relaxed) % len) & !4095;
                        ((at + (4 << 20)).min(len), (at + (20 << 20)).min(len))
                    };
                    m.clearcache(m.base().wrapping_add(from), to - from)
                        .expect("clearcache");
                } else {
                    quiet.store(now, Relaxed);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let result = done_rx.recv_timeout(Duration::from_secs(60));
    stop.store(true, Relaxed);
    clearer.join().expect("clearer thread");
    let n = clears.load(Relaxed);
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!(
            "the reader did not finish its passes in 60 s: stuck on a fault at byte {} of the \
             passes ({n} rclearcache calls)",
            progress.load(Relaxed)
        ),
    }
    reader.join().expect("reader thread");
    assert!(n >= 3 * CYCLES, "only {n} rclearcache calls ran");
    mapping::unmap(m.base()).unwrap();
}

/// Pages `rclearcache` drops while read-ahead installs them can be marked dirty, written and
/// written back right after: `rmarkdirty` of a range, a write to every page and `rmsync`
/// finish, and a fresh reader on the holder sees exactly those writes.
#[test]
fn markdirty_and_msync_after_clearcache_under_read_ahead() {
    let s = setup();
    let len = 24 << 20;
    const CYCLES: u64 = 10;
    create(&s.m2.path("rw"), &pattern(len));
    let (_file, m) = map_read_write(s.m1.path("rw"));
    let (done_tx, done_rx) = channel::<Result<(), String>>();
    let writer = {
        let m = std::sync::Arc::clone(&m);
        std::thread::spawn(move || {
            let run = || -> Result<(), String> {
                for cycle in 1..=CYCLES {
                    // Read and write on, dropping the range just ahead (where read-ahead
                    // installs) every MiB, while read-ahead runs.
                    m.clearcache(m.base(), len)
                        .map_err(|e| format!("rclearcache: {e}"))?;
                    for at in (0..len).step_by(1 << 20) {
                        for off in (at..at + (1 << 20)).step_by(4096) {
                            read_word(&m, off);
                            // SAFETY: an aligned word inside the live read-write mapping.
                            unsafe {
                                std::ptr::write_volatile(
                                    m.base().add(off).cast::<u64>(),
                                    cycle + 1000,
                                )
                            };
                        }
                        let (from, to) = ((at + (2 << 20)).min(len), (at + (14 << 20)).min(len));
                        if to > from {
                            m.clearcache(m.base().wrapping_add(from), to - from)
                                .map_err(|e| format!("rclearcache: {e}"))?;
                        }
                    }
                    m.markdirty(m.base(), len, false)
                        .map_err(|e| format!("rmarkdirty: {e}"))?;
                    for off in (0..len).step_by(4096) {
                        // SAFETY: an aligned word inside the live read-write mapping.
                        unsafe { std::ptr::write_volatile(m.base().add(off).cast::<u64>(), cycle) };
                    }
                    m.msync(m.base(), len).map_err(|e| format!("rmsync: {e}"))?;
                }
                Ok(())
            };
            let _ = done_tx.send(run());
        })
    };
    match done_rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!("read, rclearcache, rmarkdirty, writes and rmsync did not finish in 60 s"),
    }
    writer.join().expect("writer thread");
    let reader = Region::open_path(&s.m2.path("rw"), false).expect("fresh reader");
    let mut got = vec![0u8; len];
    assert_eq!(reader.read_at(0, &mut got).unwrap(), len);
    for off in (0..len).step_by(4096) {
        let first = u64::from_le_bytes(got[off..off + 8].try_into().unwrap());
        assert_eq!(first, CYCLES, "the last write to the page at {off:#x}");
        for w in (off + 8..off + 4096).step_by(8) {
            let v = u64::from_le_bytes(got[w..w + 8].try_into().unwrap());
            assert_eq!(v, word(w), "untouched word at {w:#x}");
        }
    }
    mapping::unmap(m.base()).unwrap();
}

#[test]
fn clearcache_then_reread_sees_the_writers_newer_data() {
    let s = setup();
    create(&s.m2.path("cc"), &1u64.to_le_bytes().repeat(8192));
    let file = std::fs::File::open(s.m1.path("cc")).unwrap();
    let m = mapping::map_fd(file.as_fd()).expect("map");
    assert_eq!(read_word(&m, 0), 1);
    let writer = Region::open_path(&s.m2.path("cc"), true).expect("writer");
    writer.write_at(0, &2u64.to_le_bytes()).unwrap();
    assert_eq!(read_word(&m, 0), 1, "the page stays cached until cleared");
    m.clearcache(m.base(), m.len()).expect("clearcache");
    assert_eq!(
        read_word(&m, 0),
        2,
        "re-read after clearcache fetches the new data"
    );
    mapping::unmap(m.base()).unwrap();
}

#[test]
fn sigbus_within_the_bound_when_the_regions_host_is_gone() {
    let mut s = setup();
    create(&s.m2.path("gone"), &pattern(1 << 20));
    let mut h = Helper::spawn(&s.m1.path("gone"), "ro");
    s.cluster.daemons[1]
        .sigkill()
        .expect("kill host 2's daemon");
    let start = Instant::now();
    h.send("r 65536");
    let status = h
        .wait(Duration::from_secs(15))
        .expect("the faulting process ended instead of hanging");
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "died of SIGBUS: {status:?}"
    );
    let took = start.elapsed();
    eprintln!("SIGBUS after {took:?}");
}

#[test]
fn two_processes_on_one_host_see_each_others_writes_at_once() {
    let s = setup();
    create(&s.m1.path("shared"), &[0u8; 64 << 10]);
    let before = s.stats(1);
    let mut a = Helper::spawn(&s.m1.path("shared"), "rw");
    let mut b = Helper::spawn(&s.m1.path("shared"), "rw");
    assert_eq!(a.cmd("w 0 42"), "ok");
    assert_eq!(b.cmd("r 0"), "42");
    assert_eq!(b.cmd("w 4096 7"), "ok");
    assert_eq!(a.cmd("r 4096"), "7");
    let after = s.stats(1);
    assert_eq!(
        after.transport_bytes_read, before.transport_bytes_read,
        "same-host mappings share the segment memfd, no transport"
    );
}

#[test]
fn read_only_capability_refuses_writes() {
    let s = setup();
    create(&s.m2.path("ro"), &[5u8; 64 << 10]);
    let ro = Region::open_path(&s.m1.path("ro"), false).expect("read-only open");
    let mut buf = [0u8; 16];
    assert_eq!(ro.read_at(0, &mut buf).unwrap(), 16);
    assert_eq!(buf, [5u8; 16]);
    let err = ro
        .write_at(0, b"nope")
        .expect_err("write with a read-only capability");
    assert_eq!(err.errno(), libc::EACCES, "{err}");
    // The mapping of a read-only fd refuses to mark pages dirty.
    let file = std::fs::File::open(s.m1.path("ro")).unwrap();
    let m = mapping::map_fd(file.as_fd()).unwrap();
    assert_eq!(
        m.markdirty(m.base(), 4096, true).unwrap_err().errno(),
        libc::EACCES
    );
    mapping::unmap(m.base()).unwrap();
    // A writable open gets a writable capability.
    let rw = Region::open_path(&s.m1.path("ro"), true).expect("read-write open");
    rw.write_at(0, b"yes!").unwrap();
    assert_eq!(ro.read_at(0, &mut buf).unwrap(), 16);
    assert_eq!(&buf[..4], b"yes!");
}

#[test]
fn a_killed_mapper_does_not_keep_an_unlinked_region_alive() {
    let s = setup();
    let path = s.m1.path("orphan");
    create(&path, &pattern(4 << 20));
    let mut h = Helper::spawn(&path, "ro");
    assert_eq!(h.cmd("r 8"), word(8).to_string());
    std::fs::remove_file(&path).expect("unlink the mapped region");
    // The mapper's open handle keeps it (and its memory) alive ...
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.stats(1).segments, 1, "an open region was freed");
    // ... until the mapper dies without closing it.
    h.child.kill().expect("SIGKILL the mapper");
    let _ = h.child.wait();
    let start = Instant::now();
    while s.stats(1).segments != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the unlinked region outlived its last (killed) opener"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("freed {:?} after the kill", start.elapsed());
}

#[test]
fn a_forked_child_faults_on_remote_pages_instead_of_reading_zeros() {
    let s = setup();
    let len = 1 << 20;
    create(&s.m2.path("forked"), &pattern(len));
    let file = std::fs::File::open(s.m1.path("forked")).unwrap();
    let m = mapping::map_fd(file.as_fd()).expect("map on host 1");
    assert_eq!(
        read_word(&m, 0),
        word(0),
        "the parent reads through the mapping"
    );
    // A page the parent has not fetched: in a child without the parent's userfaultfd it would
    // read as zeros.
    let addr = m.base().wrapping_add(len / 2).cast::<u64>();
    // SAFETY: the child only reads memory and exits (async-signal-safe).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: the read under test; in the child the remote pages are not mapped.
        let v = unsafe { std::ptr::read_volatile(addr) };
        // SAFETY: leaving the child at once.
        unsafe { libc::_exit(if v == 0 { 3 } else { 4 }) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut status = 0;
    loop {
        // SAFETY: polling the child just forked.
        let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if got == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: killing and reaping our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the forked child hung on a remote page");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
        "the child did not fault on a remote page (status {status:#x}; exit 3 = read zeros)"
    );
    // The parent's mapping is untouched.
    assert_eq!(read_word(&m, len / 2), word(len / 2));
    mapping::unmap(m.base()).unwrap();
}

#[test]
fn a_mapping_grown_after_its_region_was_emptied_maps_the_new_memory() {
    const LEN: usize = 128 << 10;
    let s = setup();
    let path = s.m1.path("regrown");
    create(&path, &[3u8; LEN]);
    let (_file, m) = map_read_write(&path);
    assert_eq!(m.len(), LEN);
    let segments = s.stats(1).segments;
    // Another open empties the region: its chunks on this host are freed, and the daemon
    // drops the segment memfd the mapping was given.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let start = Instant::now();
    while s.stats(1).segments >= segments {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the daemon kept the emptied region's segment"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Growing the mapping allocates the region again, in a new memfd: the new pages must map
    // it, or their stores land in the orphan and are lost.
    m.grow(2 * LEN).unwrap();
    // SAFETY: [LEN, LEN + 8) lies inside the grown, writable mapping, alive until `unmap`.
    unsafe { std::ptr::copy_nonoverlapping(b"regrown!".as_ptr(), m.base().add(LEN), 8) };
    m.msync(m.base(), m.len()).unwrap();
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    let back = std::fs::read(&path).unwrap();
    assert_eq!(back.len(), 2 * LEN);
    assert_eq!(
        &back[LEN..LEN + 8],
        b"regrown!",
        "a store in the grown mapping was lost"
    );
    mapping::unmap(m.base()).unwrap();
}

/// An application's region (opened through the host agent) that another handle shrinks: its
/// next write past the new end, on this host's own chunks, grows the region again to cover
/// it, as `pwrite(2)` after a `truncate(2)` does, and a fresh opener on another host sees the
/// size, the bytes and the zeros between. Reads of this host's chunks go through the segment.
#[test]
fn an_application_write_after_a_shrink_through_another_handle_grows_the_region() {
    let s = setup();
    let path = s.m1.path("shrunk");
    create(&path, &[1u8; 1 << 20]);
    let w = Region::open_path(&path, true).expect("open through the agent");
    assert_eq!(w.size(), 1 << 20);
    assert!(w.chunk(1).expect("chunk 1").local, "held on this host");
    let mut buf = [0u8; 4];
    let before = w.stats().local_bytes_read;
    assert_eq!(w.read_at(150_000, &mut buf).unwrap(), 4);
    assert_eq!(buf, [1u8; 4]);
    assert!(
        w.stats().local_bytes_read > before,
        "this host's chunks are read through the segment"
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(200_000))
        .expect("shrink through the mount");
    w.write_at(210_000, b"after the shrink")
        .expect("write past the new end");
    assert_eq!(w.size(), 210_016);
    let seen = std::fs::read(s.m2.path("shrunk")).expect("read on host 2");
    assert_eq!(seen.len(), 210_016, "the region grew to cover the write");
    assert!(seen[..200_000].iter().all(|b| *b == 1));
    assert!(
        seen[200_000..210_000].iter().all(|b| *b == 0),
        "the shrink's tail reads as zeros"
    );
    assert_eq!(&seen[210_000..], b"after the shrink");
}

/// `rmsync(MS_ASYNC)` returns before the write-back and publishes in the background; an
/// `rmsync(MS_SYNC)` after it returns only once everything is written; both flags together
/// are `EINVAL`, as for msync(2).
#[test]
fn asynchronous_rmsync_publishes_in_the_background() {
    use regions::capi::map::rmsync;
    let s = setup();
    let len = 4 << 20;
    create(&s.m2.path("async"), &vec![0u8; len]);
    let (_file, m) = map_read_write(s.m1.path("async"));
    let data = pattern(len);
    // SAFETY: `len` bytes are mapped writable at the base.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), m.base(), len) };
    let base = m.base().cast::<libc::c_void>();
    assert_eq!(rmsync(base, len, libc::MS_SYNC | libc::MS_ASYNC), -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EINVAL)
    );
    assert_eq!(rmsync(base, len, libc::MS_ASYNC), 0);
    let reader = Region::open_path(&s.m2.path("async"), false).expect("reader on host 2");
    let mut got = vec![0u8; len];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(reader.read_at(0, &mut got).is_ok() && got == data) {
        assert!(
            Instant::now() < deadline,
            "the background write-back never reached host 2"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Again, then synchronously: the second call returns once the bytes are written.
    let again = pattern(len).into_iter().map(|b| !b).collect::<Vec<u8>>();
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(again.as_ptr(), m.base(), len) };
    assert_eq!(rmsync(base, len, libc::MS_ASYNC), 0);
    assert_eq!(rmsync(base, len, libc::MS_SYNC), 0);
    assert_eq!(reader.read_at(0, &mut got).unwrap(), len);
    assert!(
        got == again,
        "MS_SYNC returned before the bytes were written"
    );
    mapping::unmap(m.base()).unwrap();
}

/// Remote faults under memory pressure: a process limited (memory cgroup) to 96 MiB streams a
/// 256 MiB region held on the other host through its mapping, window by window, dropping each
/// window with `rclearcache`; every word reads right and the process stays within its limit.
/// Touching the whole region without dropping anything then gets it killed by the kernel
/// (out of memory in its cgroup) within the bound, rather than hanging its fault handling.
#[test]
fn remote_faults_under_a_memory_limit_stream_a_region_larger_than_it() {
    let s = setup();
    let len = 256 << 20;
    let data = pattern(len);
    create(&s.m1.path("pressure"), &data);
    let limit: u64 = 96 << 20;
    let cg = regions_tests::memory_cgroup::MemoryCgroup::create("regions-fault-pressure", limit)
        .expect("a memory cgroup");
    let helper = bin_path("regions-map-helper").expect("helper binary");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("echo $$ > \"$0\" && exec \"$1\" \"$2\" ro")
        .arg(cg.procs())
        .arg(&helper)
        .arg(s.m2.path("pressure"));
    let mut h = Helper::spawn_cmd(cmd);
    let window = 16 << 20;
    for off in (0..len).step_by(window) {
        let want = data[off..off + window].chunks_exact(8).fold(0u64, |a, w| {
            a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()))
        });
        let got = h.cmd(&format!("sum {off} {window}"));
        assert_eq!(got, want.to_string(), "window at {off}");
        assert_eq!(h.cmd(&format!("clearrange {off} {window}")), "ok");
    }
    if let Some(peak) = cg.peak() {
        assert!(peak <= limit, "peak {peak} over the limit {limit}");
    }
    assert_eq!(cg.oom_kills(), 0, "killed while streaming");
    // All of it at once does not fit: the kernel kills the process, within the bound.
    h.send(&format!("sum 0 {len}"));
    let status = h
        .wait(Duration::from_secs(60))
        .expect("the helper ended within 60 s");
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "killed for memory, not {status:?}"
    );
    assert!(cg.oom_kills() >= 1, "the cgroup saw no out-of-memory kill");
}
