//! Open file handles: the table, the background closer (a release costs no manager round
//! trip), and the watch that fences handles the manager closed while this host was away.

use super::*;

/// What the closer drops.
type Closing = Box<dyn Send>;

/// A thread that drops released handles (closing them at the manager), so
/// that a release costs the application no manager round trip.
pub(super) struct Closer {
    queue: Option<std::sync::mpsc::Sender<Closing>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Closer {
    pub(super) fn start() -> Closer {
        let (tx, rx) = std::sync::mpsc::channel::<Closing>();
        let thread = std::thread::Builder::new()
            .name("regionfs-close".into())
            .spawn(move || {
                for handle in rx {
                    drop(handle);
                }
            });
        match thread {
            Ok(t) => Closer {
                queue: Some(tx),
                thread: Some(t),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the handle closer thread; closing on release");
                Closer {
                    queue: None,
                    thread: None,
                }
            }
        }
    }

    /// Drops `handle` (a handle, a region: closing it at the manager) in the background (at
    /// once when no thread runs).
    pub(super) fn close<T: Send + 'static>(&self, handle: T) {
        if let Some(tx) = &self.queue {
            // A send fails only when the thread is gone: the handle comes
            // back and is dropped (closed) here.
            let _ = tx.send(Box::new(handle));
        }
    }
}

impl Drop for Closer {
    /// Waits for the handles still queued to close.
    fn drop(&mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How a region handle was opened.
#[derive(Debug)]
pub(super) enum Opening {
    /// At the manager; nothing is kept at its release.
    Plain,
    /// At the manager, for writing: its release keeps what it knows of the placement
    /// (`fs/leased_opens.rs`).
    Writer(crate::placements::Writer),
    /// Under a cache lease, without asking the manager.
    Leased,
}

impl RegionHandle {
    /// A leased open that holds no handle at the manager and is not fenced.
    pub(super) fn needs_pin(&self) -> bool {
        matches!(self.opening, Opening::Leased)
            && !self.fenced.load(Ordering::Relaxed)
            && self.pin.lock().is_ok_and(|p| p.is_none())
    }

    /// The handle the manager holds for this open: its own, or for a leased open the one
    /// it took (0: none).
    fn manager_handle(&self) -> u64 {
        match self.region.handle() {
            0 => self
                .pin
                .lock()
                .ok()
                .and_then(|p| p.as_ref().map(|r| r.handle()))
                .unwrap_or(0),
            h => h,
        }
    }
}

impl RegionFs {
    pub(super) fn handle(&self, fh: u64) -> FsResult<Arc<Handle>> {
        self.handles
            .read()
            .ok()
            .and_then(|h| h.get(&fh).cloned())
            .ok_or_else(|| FsError::BadHandle(format!("file handle {fh} is not open")))
    }

    /// Adds the open of region `ino` by `caller` (for writing when `write`), its data moving
    /// by `io`, opened as `how` says; returns its handle number.
    pub(super) fn add_region_handle(
        &self,
        ino: u64,
        caller: v1::Caller,
        region: Region,
        (write, how): (bool, Opening),
        io: IoMode,
    ) -> u64 {
        self.add_handle(Handle {
            ino,
            pid: caller.pid,
            uid: caller.uid,
            body: Body::Region(Box::new(RegionHandle {
                region,
                caller,
                write,
                opening: how,
                pin: Mutex::new(None),
                io: Mutex::new(io),
                fenced: AtomicBool::new(false),
            })),
        })
    }

    pub(super) fn add_handle(&self, handle: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut h) = self.handles.write() {
            h.insert(fh, Arc::new(handle));
            metrics::gauge!("regions_fuse_open_handles").set(h.len() as f64);
        }
        fh
    }

    /// Asks the manager which of this mount's open region handles it still holds, and fences
    /// the opens whose handles it closed (this host's lease ended while they were open, behind
    /// a partition or a stalled daemon): they answer `EIO` from now on, and their cached pages
    /// are dropped so that no read is served from the page cache either. Returns how many
    /// opens were fenced now.
    pub fn check_handles(&self) -> FsResult<usize> {
        // Ids only: holding the handles across the call would hold up their close.
        let ids: Vec<u64> = self
            .handles
            .read()
            .map(|h| {
                h.values()
                    .filter_map(|x| match &x.body {
                        Body::Region(r) if !r.fenced.load(Ordering::Relaxed) => {
                            Some(r.manager_handle()).filter(|h| *h != 0)
                        }
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        // Asked even with nothing open: the answer is also this mount's sign of life.
        let reply = self
            .client
            .manager()
            .check_handles(self.client.caller(), &ids)?;
        self.contact.heard(Duration::from_millis(reply.lease_ms));
        // Opens made under a lease hold no handle the manager could name as gone.
        self.placements.set_fenced(reply.host_fenced);
        if reply.host_fenced {
            self.fence_unpinned_leased();
        }
        if reply.gone.is_empty() {
            return Ok(0);
        }
        let gone: HashSet<u64> = reply.gone.into_iter().collect();
        // (inode, handle, opener) of the opens fenced now.
        let fenced: Vec<(u64, u64, u32)> = self
            .handles
            .read()
            .map(|h| {
                h.values()
                    .filter_map(|x| match &x.body {
                        Body::Region(r)
                            if gone.contains(&r.manager_handle())
                                && !r.fenced.swap(true, Ordering::Relaxed) =>
                        {
                            Some((x.ino, r.manager_handle(), x.pid))
                        }
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        for &(ino, handle, pid) in &fenced {
            tracing::warn!(
                ino,
                handle,
                pid,
                "the manager closed this open when the host's lease ended: it answers EIO now"
            );
            let _hold = self
                .hold_fills(ino)
                .inspect_err(|e| tracing::warn!(ino, error = %e, "a background fill of a fenced open did not stop"));
            if let Some(kernel) = self.kernel.get()
                && let Err(e) = kernel.invalidate(ino, 0, 0)
            {
                tracing::debug!(ino, error = %e, "cannot drop the cached pages of a fenced open");
            }
        }
        Ok(fenced.len())
    }

    /// This host lost its lease: the leased opens that hold no handle answer `EIO` from
    /// now on, as its opens whose handles the manager closed do.
    fn fence_unpinned_leased(&self) {
        let Ok(handles) = self.handles.read() else {
            return;
        };
        for h in handles.values() {
            if let Body::Region(r) = &h.body
                && r.needs_pin()
                && !r.fenced.swap(true, Ordering::Relaxed)
            {
                tracing::warn!(
                    ino = h.ino,
                    pid = h.pid,
                    "this host's lease ended while a region was open here under a cache lease: it answers EIO now"
                );
            }
        }
    }

    /// Checks the open handles with the manager every `every` (see
    /// [`RegionFs::check_handles`]), or every quarter lease when that is shorter, on a thread
    /// of its own, until the file system is dropped.
    pub fn start_handle_watch(self: &Arc<Self>, every: Duration) -> std::io::Result<()> {
        let fs = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("regionfs-handle-watch".into())
            .spawn(move || {
                let mut step = every;
                loop {
                    std::thread::sleep(step);
                    let Some(fs) = fs.upgrade() else { return };
                    if let Some(lease) = fs.contact.lease() {
                        step = every.min(lease / 4).max(Duration::from_millis(20));
                    }
                    if let Err(e) = fs.check_handles() {
                        // The manager is out of reach (a partition, a restart): try again.
                        tracing::debug!(error = %e, "cannot check open handles with the manager");
                    }
                }
            })
            .map(drop)
    }

    /// Open region handles of `ino`.
    pub(super) fn handles_of(&self, ino: u64) -> Vec<Arc<Handle>> {
        self.handles
            .read()
            .map(|h| h.values().filter(|x| x.ino == ino).cloned().collect())
            .unwrap_or_default()
    }
}
