//! The process's userfaultfd: a bounded pool of fault threads each reads fault events off it and
//! serves them in place (no hand-off on the fault path), and background threads take
//! read-ahead work from a bounded queue. Each fault thread waits in an epoll instance of its
//! own that holds the (non-blocking) userfaultfd with `EPOLLEXCLUSIVE`, so a fault wakes one
//! idle fault thread and nothing else: no thread hands a turn to another on the fault path.
//! (Threads that took turns at a blocking read, under a mutex, woke the next one on every
//! fault: on a 2-CPU virtual machine that wake-up, to a CPU gone idle, tripled the median
//! cold fault, 85 µs against 28 µs. Polling for the next fault before blocking was measured
//! slower on 2 cores: the poller takes the CPU the daemon needs.) Fault threads fetch pages
//! through the transport and install them (`UFFDIO_COPY`, write-protected so that the first
//! write is seen), mark pages dirty on write-protect faults, and make a fault that cannot be
//! served raise `SIGBUS` in the faulting thread (the page is replaced by a mapping of an empty
//! memfd, then the thread is woken: its retried access lies past the end of that file).

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, OnceLock};

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use userfaultfd::{Event, FaultKind, FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use super::sys::{self, PAGE};

/// Background jobs queued before more are dropped.
const QUEUE: usize = 256;
/// Default number of fault-serving threads (env `REGIONS_FAULT_THREADS`).
const DEFAULT_WORKERS: usize = 4;
/// Default number of threads serving background read-ahead (env `REGIONS_READ_AHEAD_THREADS`).
const DEFAULT_PREFETCHERS: usize = 4;

/// Work for the fault threads.
pub(crate) enum Job {
    /// A missing-page fault at `addr`.
    Missing(usize),
    /// A write to a write-protected page at `addr`.
    WriteProtect(usize),
    /// Fetch pages ahead (asynchronous `rprefetch`).
    Prefetch { addr: usize, len: usize },
    /// Write dirty pages back (`rmsync(MS_ASYNC)`).
    Sync { addr: usize, len: usize },
}

/// The process-wide userfaultfd and its threads.
pub(crate) struct Faults {
    uffd: Uffd,
    /// An empty memfd: mapped over a lost page, any access raises SIGBUS.
    lost: OwnedFd,
    queue: SyncSender<Job>,
}

static FAULTS: OnceLock<std::result::Result<Arc<Faults>, String>> = OnceLock::new();

/// The process's fault handling, started on first use.
pub(crate) fn faults() -> io::Result<Arc<Faults>> {
    FAULTS
        .get_or_init(|| start().map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| {
            io::Error::other(format!(
                "userfaultfd is not available ({e}): remote regions cannot be mapped; check \
                 /dev/userfaultfd permissions or vm.unprivileged_userfaultfd"
            ))
        })
}

fn start() -> io::Result<Arc<Faults>> {
    let uffd = match UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(true)
        .require_features(FeatureFlags::PAGEFAULT_FLAG_WP)
        .create()
    {
        Ok(uffd) => uffd,
        // /dev/userfaultfd is root's: an unprivileged process makes one with the system call.
        Err(dev @ userfaultfd::Error::OpenDevUserfaultfd(_)) => {
            match sys::userfaultfd_user_mode(FeatureFlags::PAGEFAULT_FLAG_WP.bits()) {
                // SAFETY: a userfaultfd this process just made and owns alone.
                Ok(fd) => unsafe { Uffd::from_raw_fd(fd.into_raw_fd()) },
                Err(call) => {
                    return Err(io::Error::other(format!(
                        "creating the userfaultfd: {dev}; and by the system call: {call}"
                    )));
                }
            }
        }
        Err(e) => return Err(io::Error::other(format!("creating the userfaultfd: {e}"))),
    };
    let lost = sys::empty_memfd()?;
    let (tx, rx) = sync_channel::<Job>(QUEUE);
    let faults = Arc::new(Faults {
        uffd,
        lost,
        queue: tx,
    });
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..threads_from_env("REGIONS_READ_AHEAD_THREADS", DEFAULT_PREFETCHERS) {
        let rx = Arc::clone(&rx);
        std::thread::Builder::new()
            .name(format!("regions-ahead-{i}"))
            .spawn(move || worker(&rx))?;
    }
    // Every fault thread's epoll instance first, so that a failure starts none of them.
    let waits = (0..threads_from_env("REGIONS_FAULT_THREADS", DEFAULT_WORKERS))
        .map(|_| {
            let e = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
            e.add(
                &faults.uffd,
                EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLEXCLUSIVE, 0),
            )?;
            Ok(e)
        })
        .collect::<nix::Result<Vec<Epoll>>>()
        .map_err(|e| io::Error::other(format!("an epoll instance for a fault thread: {e}")))?;
    for (i, waits) in waits.into_iter().enumerate() {
        let reader = Arc::clone(&faults);
        std::thread::Builder::new()
            .name(format!("regions-fault-{i}"))
            .spawn(move || read_loop(&reader, &waits))?;
    }
    Ok(faults)
}

/// A thread count from environment variable `name` (1 to 64), else `default`.
fn threads_from_env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| (1..=64).contains(n))
        .unwrap_or(default)
}

impl Faults {
    /// The next fault event, once `waits` (this thread's epoll instance) says there may be one;
    /// `None` when another fault thread took it first.
    fn next_event(&self, waits: &Epoll) -> Result<Option<Event>, String> {
        let mut ready = [EpollEvent::empty()];
        match waits.wait(&mut ready, EpollTimeout::NONE) {
            Ok(n)
                if n > 0
                    && ready[0]
                        .events()
                        .intersects(EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP) =>
            {
                return Err("the userfaultfd reports an error".into());
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(format!("waiting for faults: {e}")),
        }
        self.uffd.read_event().map_err(|e| e.to_string())
    }
}

fn read_loop(faults: &Faults, waits: &Epoll) {
    let mut errors = 0u32;
    loop {
        match faults.next_event(waits) {
            Ok(Some(Event::Pagefault { kind, addr, .. })) => {
                errors = 0;
                let addr = addr as usize & !(PAGE - 1);
                let (job, label) = match kind {
                    FaultKind::WriteProtected => (Job::WriteProtect(addr), "write_protect"),
                    _ => (Job::Missing(addr), "missing"),
                };
                let started = std::time::Instant::now();
                super::serve(job);
                metrics::counter!("regions_client_mapping_faults_total", "kind" => label)
                    .increment(1);
                metrics::histogram!("regions_client_mapping_fault_duration_seconds", "kind" => label)
                    .record(started.elapsed());
            }
            Ok(Some(other)) => tracing::debug!(event = ?other, "ignoring a userfaultfd event"),
            Ok(None) => {}
            // Interrupted reads come back; a broken descriptor keeps failing.
            Err(e) if errors < 100 => {
                errors += 1;
                tracing::debug!(error = %e, "reading the userfaultfd failed; retrying");
            }
            Err(e) => {
                tracing::error!(error = %e, "reading the userfaultfd keeps failing; remote mappings stop being served");
                return;
            }
        }
    }
}

fn worker(rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = match rx.lock() {
            Ok(rx) => match rx.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
            Err(_) => return,
        };
        super::serve(job);
    }
}

impl Faults {
    /// Queues background work; dropped (with a log line) when the queue is full.
    pub(crate) fn submit(&self, job: Job) {
        if !self.try_submit(job) {
            tracing::debug!("fault queue full; dropping a background prefetch")
        }
    }

    /// Queues background work; whether it was queued (not when the queue is full).
    pub(crate) fn try_submit(&self, job: Job) -> bool {
        match self.queue.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        }
    }

    /// Registers `[addr, addr + len)` for missing faults, and write-protect faults if `wp`.
    pub(crate) fn register(&self, addr: usize, len: usize, wp: bool) -> io::Result<()> {
        let mode = if wp {
            RegisterMode::MISSING | RegisterMode::WRITE_PROTECT
        } else {
            RegisterMode::MISSING
        };
        self.uffd
            .register_with_mode(addr as *mut libc::c_void, len, mode)
            .map(drop)
            .map_err(|e| {
                io::Error::other(format!("registering remote pages with userfaultfd: {e}"))
            })
    }

    /// Installs `src` at `dst` (page aligned, whole pages), write-protected if `wp`, and wakes
    /// the threads waiting there. Pages someone installed meanwhile are left alone. On failure,
    /// says how many bytes from `dst` on were installed (or were there) before it; the caller
    /// wakes the threads waiting on the rest.
    pub(crate) fn install(
        &self,
        dst: usize,
        src: &[u8],
        wp: bool,
    ) -> Result<(), (usize, io::Error)> {
        let mut done = 0usize;
        // A successful UFFDIO_COPY wakes the threads waiting on what it copied; only the
        // page-by-page path below needs a wake of its own.
        let mut wake = false;
        while done < src.len() {
            let mut copy = userfaultfd_sys::uffdio_copy {
                dst: (dst + done) as u64,
                src: src[done..].as_ptr() as u64,
                len: (src.len() - done) as u64,
                mode: if wp {
                    userfaultfd_sys::UFFDIO_COPY_MODE_WP
                } else {
                    0
                },
                copy: 0,
            };
            // SAFETY: UFFDIO_COPY reads `len` bytes from `src` (a live Rust buffer of that
            // length) and writes into pages of a range registered with this userfaultfd; the
            // struct is a valid uffdio_copy the kernel updates in place.
            let ret = unsafe {
                libc::ioctl(
                    self.uffd.as_raw_fd(),
                    userfaultfd_sys::UFFDIO_COPY as _,
                    &mut copy as *mut userfaultfd_sys::uffdio_copy,
                )
            };
            if ret == 0 {
                done = src.len();
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) if copy.copy > 0 => done += copy.copy as usize,
                Some(libc::EAGAIN) => std::thread::yield_now(),
                Some(libc::EEXIST) => {
                    wake = true;
                    // Some page is there already: install the rest one page at a time.
                    let first = if copy.copy > 0 { copy.copy as usize } else { 0 };
                    done += first;
                    if done < src.len() {
                        let page = &src[done..done + PAGE];
                        match self.install_one(dst + done, page, wp) {
                            Ok(()) => {}
                            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                            Err(e) => return Err((done, e)),
                        }
                        done += PAGE;
                    }
                }
                // Pages the failed call installed before failing count as installed.
                _ => return Err((done + (copy.copy.max(0) as usize) / PAGE * PAGE, e)),
            }
        }
        if wake {
            self.wake(dst, src.len());
        }
        Ok(())
    }

    fn install_one(&self, dst: usize, page: &[u8], wp: bool) -> io::Result<()> {
        let mut copy = userfaultfd_sys::uffdio_copy {
            dst: dst as u64,
            src: page.as_ptr() as u64,
            len: page.len() as u64,
            mode: if wp {
                userfaultfd_sys::UFFDIO_COPY_MODE_WP
            } else {
                0
            },
            copy: 0,
        };
        // SAFETY: as in `install`, for one page.
        let ret = unsafe {
            libc::ioctl(
                self.uffd.as_raw_fd(),
                userfaultfd_sys::UFFDIO_COPY as _,
                &mut copy as *mut userfaultfd_sys::uffdio_copy,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Wakes threads waiting on faults in `[addr, addr + len)`.
    pub(crate) fn wake(&self, addr: usize, len: usize) {
        if len == 0 {
            return;
        }
        if let Err(e) = self.uffd.wake(addr as *mut libc::c_void, len) {
            tracing::debug!(addr, len, error = %e, "userfaultfd wake failed");
        }
    }

    /// Write-protects present pages of `[addr, addr + len)`.
    pub(crate) fn protect(&self, addr: usize, len: usize) -> io::Result<()> {
        self.uffd
            .write_protect(addr as *mut libc::c_void, len)
            .map_err(|e| io::Error::other(format!("write-protecting pages: {e}")))
    }

    /// Lifts write protection on `[addr, addr + len)` and wakes the waiting writers.
    pub(crate) fn unprotect(&self, addr: usize, len: usize) -> io::Result<()> {
        self.uffd
            .remove_write_protection(addr as *mut libc::c_void, len, true)
            .map_err(|e| io::Error::other(format!("lifting write protection: {e}")))
    }

    /// Lifts write protection on `[addr, addr + len)` without waking the waiting writers (the
    /// caller wakes them once it has recorded the pages dirty).
    pub(crate) fn unprotect_quietly(&self, addr: usize, len: usize) -> io::Result<()> {
        self.uffd
            .remove_write_protection(addr as *mut libc::c_void, len, false)
            .map_err(|e| io::Error::other(format!("lifting write protection: {e}")))
    }

    /// Makes accesses to `[addr, addr + len)` raise SIGBUS, and wakes the threads waiting
    /// there so that they do.
    pub(crate) fn lose(&self, addr: usize, len: usize) {
        if let Err(e) = sys::map_fd_fixed(addr as *mut u8, len, self.lost.as_fd(), 0, false) {
            tracing::error!(addr, len, error = %e, "cannot poison a lost page");
        }
        self.wake(addr, len);
    }
}
