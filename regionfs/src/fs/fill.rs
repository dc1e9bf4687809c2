//! Background fill of the page cache (COMEX-style prefetch): a region held on other hosts
//! that this mount reads at random is streamed into the kernel's page cache behind the
//! reader, so that its later reads are memory hits instead of network round trips.
//!
//! - *When.* A handle's reads reach regionfs only for pages the kernel does not hold; after
//!   [`SCATTERED_READS`] such reads in a row that do not continue the previous one (the
//!   kernel's read-ahead serves sequential readers already; a read within [`NEAR`] of where
//!   the previous one ended continues it), a fill of the inode starts, once
//!   per state of the region (its mtime and size), when no handle of this mount writes it, the
//!   region is not held wholly on this host (those reads are a `memcpy`), and fewer than
//!   [`MAX_FILLS`] fills run on this mount.
//! - *How much.* From the start of the region to its end, at most the budget
//!   (`--fill-budget`, default a quarter of this host's memory), stopping as soon as the
//!   host's available memory falls under an eighth of its memory: page cache is reclaimable,
//!   but a fill must not push out what running programs need.
//! - *Never a lost write, never bytes from before a change seen here.* A fill stores pieces
//!   it has just read, and never past the size the kernel knows. Whatever changes the region
//!   or its size through this mount, or drops the inode's cached pages (an open for writing,
//!   a truncate, `rclearcache`, `rmarkdirty`, a fenced open, an open that finds the region
//!   changed elsewhere, the kernel's size raised after growth elsewhere), first stops the
//!   fill and waits for its store in flight ([`RegionFs::hold_fills`]); a stopped fill stays
//!   recorded until it has ended, so the next of these waits for it too. So no store of
//!   bytes read before the change lands after it: a store can neither undo a write in the
//!   page cache nor bring back bytes another host replaced before this mount's open saw the
//!   change. Write opens hold fills off until they close. (Within one open, as without
//!   fills, another host's writes are seen in no particular order: a fill may store a piece
//!   it read just before such a write over a page a read fetched just after it.)
//! - *Tested with a pause.* `REGIONFS_FILL_TEST_PAUSE_MS` makes every fill wait that long
//!   between reading a step and storing it, so that tests can put a change in that window
//!   every time (`tests/tests/background_fill.rs`); unset, there is no pause.

use std::io::BufRead as _;
use std::sync::atomic::AtomicUsize;

use super::*;

/// Reads in a row that did not continue the previous one before a fill starts.
pub(super) const SCATTERED_READS: u32 = 4;
/// A read this close to where the previous one ended continues it: the kernel's read-ahead
/// (8 MiB) sends its 1 MiB pieces together, and this mount's threads serve them in any order.
const NEAR: u64 = 8 << 20;
/// Fills running at once on one mount.
const MAX_FILLS: usize = 2;
/// Bytes read from the region per step of a fill (stored in pieces of [`STEP`]).
const FILL_READ: usize = 4 << 20;
/// How long a change waits for a fill's store in flight to end.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// The fill of one inode.
#[derive(Debug)]
pub(super) struct Fill {
    /// Set to end the fill before its next store.
    stop: AtomicBool,
    /// The fill thread has ended.
    finished: AtomicBool,
    /// Held while a piece is stored: a stopper that takes it knows no store is in flight.
    gate: Mutex<()>,
    /// The file handle it reads through (its release ends the fill).
    pub(super) fh: u64,
}

impl Fill {
    fn new(fh: u64) -> Fill {
        Fill {
            stop: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            gate: Mutex::new(()),
            fh,
        }
    }

    fn running(&self) -> bool {
        !self.finished.load(Ordering::Acquire)
    }

    /// Ends the fill before its next store (a store in flight may still land).
    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Ends the fill and waits (bounded) until no store of it is in flight.
    pub(super) fn wait_stopped(&self, ino: u64) -> FsResult<()> {
        self.stop();
        let deadline = Instant::now() + STOP_WAIT;
        loop {
            match self.gate.try_lock() {
                Ok(_) | Err(std::sync::TryLockError::Poisoned(_)) => return Ok(()),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(FsError::Busy(format!(
                        "region {ino}: the background fill of its page cache did not stop \
                         within {} s (the kernel holds its store); try again",
                        STOP_WAIT.as_secs()
                    )));
                }
            }
        }
    }
}

/// The fills of one mount: their budget and how many run.
#[derive(Debug)]
pub(super) struct Fills {
    /// Bytes one fill stores at most (0: fills are off).
    budget: u64,
    running: Arc<AtomicUsize>,
    /// Wait between reading a step and storing it (tests only).
    pause: Duration,
}

impl Fills {
    /// `budget`: bytes one fill stores at most; `None`: a quarter of this host's memory.
    pub(super) fn new(budget: Option<u64>) -> Fills {
        let budget = budget.unwrap_or_else(|| meminfo("MemTotal").map_or(0, |total| total / 4));
        let pause = std::env::var("REGIONFS_FILL_TEST_PAUSE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        Fills {
            budget,
            running: Arc::new(AtomicUsize::new(0)),
            pause,
        }
    }
}

/// A field of `/proc/meminfo`, in bytes.
fn meminfo(field: &str) -> Option<u64> {
    let file = std::fs::File::open("/proc/meminfo").ok()?;
    std::io::BufReader::new(file).lines().find_map(|line| {
        let line = line.ok()?;
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    })
}

/// Whether the host has memory to spare for the page cache (under an eighth of its memory
/// available, a fill stops).
fn memory_allows() -> bool {
    match (meminfo("MemAvailable"), meminfo("MemTotal")) {
        (Some(available), Some(total)) => available > total / 8,
        // Without /proc/meminfo there is no way to tell: do not fill.
        _ => false,
    }
}

/// Why a fill ended (for the log).
#[derive(Debug)]
enum Ended {
    Done,
    Budget,
    Stopped,
    Memory,
    Failed,
}

impl RegionFs {
    /// Records a read of `len` bytes at `offset` that reached this mount through cached
    /// handle `h`, and starts a fill of its inode when the reads are scattered (see the
    /// module documentation).
    pub(super) fn note_read(&self, fh: u64, h: &Arc<Handle>, offset: u64, len: u64) {
        if self.fills.budget == 0 || len == 0 {
            return;
        }
        let Some(kernel) = self.kernel.get() else {
            return;
        };
        let Ok(r) = h.region() else { return };
        let (fill, kernel_size) = {
            let mut inodes = self.lock_inodes();
            let Some(st) = inodes.get_mut(&h.ino) else {
                return;
            };
            if offset.abs_diff(st.read_next) <= NEAR {
                st.scattered = 0;
            } else {
                st.scattered = st.scattered.saturating_add(1);
            }
            st.read_next = offset.saturating_add(len);
            if st.scattered < SCATTERED_READS
                || st.writers > 0
                || r.write
                || st.seen.is_none()
                || st.filled == st.seen
                || st.fill.as_ref().is_some_and(|f| f.running())
            {
                return;
            }
            if r.region.is_wholly_local() {
                // Read by a copy from this host's memory already: nothing to gain.
                st.filled = st.seen;
                return;
            }
            if self
                .fills
                .running
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < MAX_FILLS).then_some(n + 1)
                })
                .is_err()
            {
                return;
            }
            st.filled = st.seen;
            let fill = Arc::new(Fill::new(fh));
            st.fill = Some(Arc::clone(&fill));
            (fill, st.kernel_size)
        };
        // Never past the size the kernel knows: a store there would raise it.
        let size = r.region.size().min(kernel_size);
        let end = size.min(self.fills.budget);
        let pause = self.fills.pause;
        let (ino, handle, kernel) = (h.ino, Arc::clone(h), Arc::clone(kernel));
        // Given back when the thread ends, or with the closure if it cannot start.
        let place = Running {
            fill: Arc::clone(&fill),
            running: Arc::clone(&self.fills.running),
        };
        let spawned = std::thread::Builder::new()
            .name("regionfs-fill".into())
            .spawn(move || {
                let _place = place;
                let started = Instant::now();
                let (stored, ended) = run_fill(&fill, &handle, kernel.as_ref(), end, pause);
                let ended = match ended {
                    Ended::Done if end < size => Ended::Budget,
                    e => e,
                };
                tracing::debug!(
                    ino,
                    stored,
                    ms = started.elapsed().as_millis() as u64,
                    ?ended,
                    "background fill ended"
                );
            });
        match spawned {
            Ok(_) => {
                metrics::counter!("regions_fuse_fills").increment(1);
                tracing::debug!(ino, end, "background fill of a region read at random");
            }
            Err(e) => {
                tracing::debug!(ino, error = %e, "cannot start a background fill");
            }
        }
    }

    /// Keeps fills of `ino` from starting until the hold is dropped (or, for a write open,
    /// [kept](FillHold::keep) until its release), and stops a running one, waiting for its
    /// store in flight. On error (the store did not end within [`STOP_WAIT`]) nothing is held.
    pub(super) fn hold_fills(&self, ino: u64) -> FsResult<FillHold<'_>> {
        let fill = {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(ino).or_default();
            st.writers += 1;
            st.fill.clone()
        };
        let hold = FillHold {
            fs: self,
            ino,
            armed: true,
        };
        if let Some(f) = fill {
            f.wait_stopped(ino)?;
        }
        Ok(hold)
    }

    /// Ends one hold of [`RegionFs::hold_fills`] (a write handle's, at its release).
    pub(super) fn release_fills(&self, ino: u64) {
        if let Some(st) = self.lock_inodes().get_mut(&ino) {
            st.writers = st.writers.saturating_sub(1);
        }
    }
}

/// Fills of one inode held off (see [`RegionFs::hold_fills`]); dropping it lets them start
/// again.
#[must_use]
pub(super) struct FillHold<'a> {
    fs: &'a RegionFs,
    ino: u64,
    armed: bool,
}

impl FillHold<'_> {
    /// Passes the hold to a write handle: it ends at the handle's release.
    pub(super) fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for FillHold<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.fs.release_fills(self.ino);
        }
    }
}

/// A fill thread's place among the running ones, given back however the thread ends.
struct Running {
    fill: Arc<Fill>,
    running: Arc<AtomicUsize>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.fill.finished.store(true, Ordering::Release);
        self.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The fill thread: reads `[0, end)` of the handle's region in steps and stores them in the
/// page cache. Returns the bytes stored and why it ended.
fn run_fill(
    fill: &Fill,
    h: &Handle,
    kernel: &dyn KernelCache,
    end: u64,
    pause: Duration,
) -> (u64, Ended) {
    let Ok(r) = h.region() else {
        return (0, Ended::Stopped);
    };
    let mut buf = vec![0u8; FILL_READ];
    let mut at = 0u64;
    let mut stored = 0u64;
    loop {
        if fill.stop.load(Ordering::Acquire) || r.fenced.load(Ordering::Relaxed) {
            return (stored, Ended::Stopped);
        }
        // A region that shrank is filled only to its new end.
        let end = end.min(r.region.size());
        if at >= end {
            return (stored, Ended::Done);
        }
        if !memory_allows() {
            return (stored, Ended::Memory);
        }
        let want = (end - at).min(FILL_READ as u64) as usize;
        let got = match r.region.read_at(at, &mut buf[..want]) {
            Ok(0) => return (stored, Ended::Done),
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(ino = h.ino, at, error = %e, "background fill cannot read the region");
                return (stored, Ended::Failed);
            }
        };
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
        for piece in buf[..got].chunks(STEP as usize) {
            let Ok(_gate) = fill.gate.lock() else {
                return (stored, Ended::Stopped);
            };
            if fill.stop.load(Ordering::Acquire) {
                return (stored, Ended::Stopped);
            }
            if let Err(e) = kernel.store(h.ino, at, piece) {
                tracing::debug!(ino = h.ino, at, error = %e, "the kernel refused a background fill's store");
                return (stored, Ended::Failed);
            }
            at += piece.len() as u64;
            stored += piece.len() as u64;
            metrics::counter!("regions_fuse_fill_bytes").increment(piece.len() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_reads_fields_in_bytes() {
        let total = meminfo("MemTotal").expect("MemTotal in /proc/meminfo");
        let available = meminfo("MemAvailable").expect("MemAvailable in /proc/meminfo");
        assert!(total > 64 << 20, "MemTotal {total}");
        assert!(
            available <= total,
            "MemAvailable {available} > MemTotal {total}"
        );
        assert_eq!(meminfo("NoSuchField"), None);
        // "MemTotal" must not match "MemTotalX" style prefixes of other fields.
        assert_eq!(meminfo("Mem"), None);
    }

    #[test]
    fn stopping_waits_for_a_store_in_flight() {
        let f = Arc::new(Fill::new(0));
        let held = f.gate.lock().unwrap();
        let g = Arc::clone(&f);
        let t = std::thread::spawn(move || {
            let started = Instant::now();
            g.wait_stopped(7).unwrap();
            started.elapsed()
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(f.stop.load(Ordering::Acquire), "stop is set before waiting");
        drop(held);
        let waited = t.join().unwrap();
        assert!(
            waited >= Duration::from_millis(90),
            "returned after {waited:?}"
        );
    }
}
