//! An open region (Remote Regions paper §4, §5; docs/ARCHITECTURE.md, "libregions"): its
//! cached map, and reads, writes and atomics at any offset, split by chunk and host and issued
//! to each host in parallel, through this host's mapped segment where the bytes are here.
//!
//! One type for every opener: a node component with the cluster secret opens regions through
//! a [`crate::Client`], an application through the file it opened under a regions mount
//! ([`Region::open_fd`], [`Region::open_path`]); [`authority`] is the only difference.
//!
//! ```no_run
//! use std::os::fd::AsFd;
//! let file = std::fs::File::open("/regions/data")?;
//! let region = regions::Region::open_fd(file.as_fd())?;
//! let mut buf = [0u8; 16];
//! region.read_at(0, &mut buf)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub(crate) mod authority;
mod from_file;
mod object_io;
mod placement;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1;

use crate::agent::Segment;
use crate::connection::Connection;
use crate::error::{RegionsError, Result};
use crate::transport::local::LocalSegment;
use crate::transport::{Span, StatsSnapshot, Transport};
use authority::Authority;
pub use from_file::{device_of, file_id};
pub use placement::ChunkLoc;
use placement::{Access, MapState, Run, Target};

/// Reads and writes smaller than this stay on the calling thread even when
/// they span hosts (a thread costs more than it saves).
const PARALLEL_MIN: usize = 256 << 10;

/// The first space a writer reserves past a region's allocated chunks; each
/// later reservation doubles what the region holds, up to [`RESERVE_MAX`]
/// at a time (growth in steps: one manager request per step, not per write).
const RESERVE_MIN: u64 = CHUNK_SIZE;
/// The largest single reservation step.
const RESERVE_MAX: u64 = 1 << 30;
/// The most a small region's object can grow to (a daemon's largest slot; the manager's
/// small-region limit decides below it).
const MAX_OBJECT_BYTES: u64 = regions_proto::frame::MAX_OBJECT as u64;

/// When a writer's growth of the size reaches the manager.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SizePolicy {
    /// With every write that grows the region (each such write is a
    /// durable manager request).
    #[default]
    Eager,
    /// At [`Region::publish`], [`Region::close`] or drop: writes past the
    /// size land in space reserved ahead in steps, and other hosts see the
    /// new size once it is published (close-to-open).
    Lazy,
}

/// An open region.
pub struct Region {
    /// Whose authority its manager requests and transports carry.
    authority: Authority,
    ino: u64,
    handle: u64,
    write: bool,
    state: RwLock<MapState>,
    closed: AtomicBool,
    /// A write past the size failed: some of its bytes may lie past the size it publishes.
    tail_unsure: AtomicBool,
    policy: SizePolicy,
    /// The attributes the manager gave with the open.
    opened: v1::Attr,
    /// Serialises reservations (concurrent writers reserve once).
    reserving: std::sync::Mutex<()>,
    /// Set by [`Region::with_posted_writes`]: whose posted writes this region's are.
    posting: Option<u64>,
    /// A posted write of this region's owner did not land: no size is published any more
    /// (it could cover the lost bytes), and the close does not vouch for the tail.
    lost_write: AtomicBool,
}

/// Writes up to this size (per transport and call) are posted; larger ones take long enough
/// on the wire that the round trip matters less than keeping a copy of their bytes (and a
/// daemon may hold a larger one waiting for buffer space).
const POST_MAX: usize = 64 << 10;

impl Region {
    /// A region a [`crate::Client`] opened as `caller` (the manager's open reply `info`).
    pub(crate) fn new(
        conn: Arc<Connection>,
        caller: v1::Caller,
        info: v1::RegionInfo,
        write: bool,
    ) -> Result<Region> {
        Self::with_authority(Authority::Cluster { conn, caller }, info, write)
    }

    fn with_authority(authority: Authority, info: v1::RegionInfo, write: bool) -> Result<Region> {
        let ino = info
            .attr
            .as_ref()
            .map(|a| a.ino)
            .ok_or_else(|| RegionsError::Protocol {
                peer: authority.peer().to_owned(),
                reason: "open reply without attributes".into(),
            })?;
        let handle = info.handle;
        let opened = info.attr.clone().unwrap_or_default();
        Ok(Region {
            authority,
            ino,
            handle,
            write,
            state: RwLock::new(MapState::from_info(info)),
            closed: AtomicBool::new(false),
            tail_unsure: AtomicBool::new(false),
            policy: SizePolicy::Eager,
            opened,
            reserving: std::sync::Mutex::new(()),
            posting: None,
            lost_write: AtomicBool::new(false),
        })
    }

    /// A region read with no open handle at the manager, from a map this client holds
    /// (regionfs's leased opens, docs/SEMANTICS.md "Cache leases"): nothing is closed when
    /// it is dropped, and nothing keeps the region's memory from being freed meanwhile; its
    /// holder keeps a handle of its own for that when it must.
    pub(crate) fn without_handle(
        conn: Arc<Connection>,
        caller: v1::Caller,
        mut info: v1::RegionInfo,
    ) -> Result<Region> {
        info.handle = 0;
        let region = Self::new(conn, caller, info, false)?;
        region.closed.store(true, Ordering::Relaxed);
        Ok(region)
    }

    /// What this handle knows of the region's placement, as a map reply (no handle, no
    /// capability): the attributes it was opened with at its size now, and the map entries
    /// the size covers. `None` while it holds growth it has not published, or after a
    /// write through it was lost.
    pub fn placement(&self) -> Option<v1::RegionInfo> {
        if self.lost_write.load(Ordering::Relaxed) || self.tail_unsure.load(Ordering::Relaxed) {
            return None;
        }
        let s = self.state.read().ok()?;
        if s.unpublished || s.object.as_ref().is_some_and(|o| o.moving) {
            return None;
        }
        if let Some(o) = &s.object {
            // A small region stored as an object: its object is its placement.
            return Some(v1::RegionInfo {
                attr: Some(v1::Attr {
                    size: s.size,
                    ..self.opened.clone()
                }),
                map_version: s.version,
                map_included: true,
                object: Some(o.clone()),
                ..v1::RegionInfo::default()
            });
        }
        let chunks = usize::try_from(s.size.div_ceil(CHUNK_SIZE)).ok()?;
        let map: Vec<u64> = s.entries.iter().take(chunks).copied().collect();
        if map.len() < chunks {
            return None;
        }
        Some(v1::RegionInfo {
            attr: Some(v1::Attr {
                size: s.size,
                ..self.opened.clone()
            }),
            map,
            map_version: s.version,
            pools: s.pools.values().cloned().collect(),
            map_included: true,
            ..v1::RegionInfo::default()
        })
    }

    /// The region's attributes when it was opened.
    pub fn opened_attr(&self) -> &v1::Attr {
        &self.opened
    }

    /// Sets when this handle's growth of the size reaches the manager. A region opened
    /// through the host agent publishes every growth at once ([`SizePolicy::Eager`]).
    pub fn with_size_policy(mut self, policy: SizePolicy) -> Region {
        if matches!(self.authority, Authority::Cluster { .. }) {
            self.policy = policy;
        }
        self
    }

    /// Lets small writes to a region held wholly on other hosts return once they are sent,
    /// before the daemon applied them (regionfs: a `write(2)` then costs no network round
    /// trip). Everything later asked of the same daemons through this client is applied
    /// after them, and a posted write lost with its connection is written again first.
    /// `owner` names what is written (the inode, for regionfs: every handle of a file
    /// reports every handle's lost writes): [`Region::flush_posted`], which
    /// [`Region::publish`] and [`Region::close`] call, reports a posted write that did not
    /// land (as NFS reports a failed write-behind at `fsync` or `close`), every time until
    /// [`crate::Client::forget_lost_writes`], and a region that reported one publishes no
    /// size.
    pub fn with_posted_writes(mut self, owner: u64) -> Region {
        self.posting = Some(owner);
        self
    }

    /// Waits until every posted write of this region's owner landed; returns the first that
    /// did not (every time: see [`Region::with_posted_writes`]).
    pub fn flush_posted(&self) -> Result<()> {
        let Some(owner) = self.posting else {
            return Ok(());
        };
        if let Some(e) = crate::transport::first_lost_write(self.authority.transports(), owner) {
            self.lost_write.store(true, Ordering::Relaxed);
            self.tail_unsure.store(true, Ordering::Relaxed);
            return Err(e);
        }
        if self.lost_write.load(Ordering::Relaxed) {
            return Err(RegionsError::WriteLost {
                ino: self.ino,
                offset: 0,
                len: 0,
                errno: libc::EIO,
                reason: "a write posted through this handle earlier was lost (reported then); \
                         its size is not published"
                    .into(),
            });
        }
        Ok(())
    }

    /// Waits until every posted write to the daemons this region's client reaches landed
    /// (or failed for good), whoever posted it, keeping failures for
    /// [`Region::flush_posted`].
    pub fn wait_posted(&self) {
        for t in self.authority.transports() {
            t.wait_writes();
        }
    }

    /// Whether this handle has grown the size past what the manager holds.
    pub fn has_unpublished_size(&self) -> bool {
        self.state.read().is_ok_and(|s| s.unpublished)
    }

    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// Size in bytes as last seen.
    pub fn size(&self) -> u64 {
        self.state.read().map_or(0, |s| s.size)
    }

    pub fn map_version(&self) -> u64 {
        self.state.read().map_or(0, |s| s.version)
    }

    /// The handle the manager gave this open.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Whether every chunk of the region is held by this host's daemon.
    pub fn is_wholly_local(&self) -> bool {
        self.state.read().is_ok_and(|s| {
            s.object.is_none()
                && s.entries.iter().all(|e| {
                    MapEntry::decode(*e)
                        .and_then(|m| s.pools.get(&m.gid))
                        .is_some_and(|p| p.host_id == self.authority.host_id())
                })
        })
    }

    /// Hosts holding the region's object or chunks, in order of first appearance.
    pub fn hosts(&self) -> Vec<u32> {
        let mut hosts = Vec::new();
        if let Ok(s) = self.state.read() {
            hosts.extend(s.object.as_ref().map(|o| o.host_id));
            for e in &s.entries {
                if let Some(h) = MapEntry::decode(*e)
                    .and_then(|m| s.pools.get(&m.gid))
                    .map(|p| p.host_id)
                    && !hosts.contains(&h)
                {
                    hosts.push(h);
                }
            }
        }
        hosts
    }

    /// The cached map entries (one per 128 KiB chunk).
    pub fn map(&self) -> Vec<u64> {
        self.state
            .read()
            .map(|s| s.entries.clone())
            .unwrap_or_default()
    }

    /// Records a truncate to `size` made through another handle: the size
    /// is `size` from now on (growth this handle had not published is
    /// dropped with it), and the map is fetched again.
    pub fn note_truncated(&self, size: u64) -> Result<()> {
        {
            let mut s = self.state.write().map_err(|_| Self::poisoned())?;
            s.size = size;
            s.unpublished = false;
        }
        self.refresh()
    }

    /// Records a size learned elsewhere (e.g. a truncate through another path).
    pub fn note_size(&self, size: u64) {
        if let Ok(mut s) = self.state.write() {
            s.size = size;
        }
    }

    /// Whether same-host access goes through a mapped segment.
    pub fn has_local_segment(&self) -> bool {
        self.state.read().is_ok_and(|s| s.local.is_some())
    }

    fn poisoned() -> RegionsError {
        RegionsError::Invalid("region state lock poisoned by a panic in another thread".into())
    }

    /// Fetches the map again if it changed (and, through the host agent, renews the
    /// capability).
    pub fn refresh(&self) -> Result<()> {
        let known = self.map_version();
        let info = self
            .authority
            .map(self.ino, known, self.write, self.handle)?;
        let mut state = self.state.write().map_err(|_| Self::poisoned())?;
        state.apply(info, false);
        Ok(())
    }

    /// Renews the capability when it is past half its life (through the host agent; a
    /// region opened with the cluster secret has none). Called before the state is locked.
    fn renew_if_due(&self) -> Result<()> {
        if !self.authority.renewal_due() {
            return Ok(());
        }
        tracing::debug!(ino = self.ino, "renewing the transport capability");
        self.refresh()
    }

    /// [`Region::renew_if_due`] for an access to `[offset, offset + len)` that reaches a
    /// daemon: chunks on this host, read through the segment descriptor, need no capability
    /// (they keep the rights the descriptor was handed with, docs/SEMANTICS.md).
    fn renew_if_due_for(&self, offset: u64, len: u64, write: bool) -> Result<()> {
        if !self.authority.renewal_due() {
            return Ok(());
        }
        let remote = {
            let state = self.state.read().map_err(|_| Self::poisoned())?;
            self.locate(&state, offset, len, write)
                .map_or(true, |runs| {
                    runs.iter().any(|r| matches!(r.target, Target::Remote(_)))
                })
        };
        if remote { self.renew_if_due() } else { Ok(()) }
    }

    /// Maps this host's segment if the host agent has one and it is stale
    /// or missing.
    fn ensure_local(&self, needed_end: u64) {
        if !self.authority.has_agent() {
            return;
        }
        let host_id = self.authority.host_id();
        let (version, mine_end) = match self.state.read() {
            Ok(s) => {
                let covered = s.local.as_ref().is_some_and(|l| l.len() >= needed_end)
                    || s.local_checked == Some(s.version)
                    || s.local_retry_at
                        .is_some_and(|at| std::time::Instant::now() < at);
                if covered {
                    return;
                }
                // Only now: it looks at every chunk of the map.
                (s.version, s.end_on(host_id))
            }
            Err(_) => return,
        };
        if mine_end == 0 {
            // Nothing here at this map version: not looked for again until the map changes.
            if let Ok(mut s) = self.state.write()
                && s.version == version
            {
                s.local_checked = Some(version);
            }
            return;
        }
        // The daemon waits (bounded) until it has applied the chunks this map puts here.
        let segment = self.authority.segment(self.ino, self.write, mine_end);
        let Ok(mut state) = self.state.write() else {
            return;
        };
        state.local_checked = Some(version);
        state.local_retry_at = None;
        match segment {
            Ok(Some(seg)) => {
                if seg.size < mine_end {
                    state.segment_short(std::time::Instant::now());
                } else {
                    state.local_backoff = std::time::Duration::ZERO;
                }
                let through_daemon = seg.atomics_through_daemon;
                match LocalSegment::map(
                    seg.fd,
                    seg.size,
                    seg.writable,
                    Arc::clone(self.authority.stats()),
                ) {
                    Ok(l) => state.local = Some(Arc::new(l.with_cpu_atomics(!through_daemon))),
                    Err(e) => {
                        tracing::debug!(ino = self.ino, error = %e, "cannot map the local segment; using tcp")
                    }
                }
            }
            Ok(None) => state.segment_short(std::time::Instant::now()),
            Err(e) => {
                tracing::debug!(ino = self.ino, error = %e, "host agent gave no segment; using tcp")
            }
        }
    }

    /// Splits `[offset, offset + len)` into runs of spans per target (see
    /// [`MapState::locate`]).
    fn locate<'s>(
        &self,
        state: &'s MapState,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<Vec<Run<'s>>> {
        let access = match (write, &self.authority) {
            (false, _) => Access::Read,
            (true, Authority::Cluster { .. }) => Access::Write,
            // An application's writes go through the daemon even on this host: the daemon
            // refuses a revoked capability (a shrinking truncate through another handle),
            // and the region then learns its new size before the retry.
            (true, Authority::Agent(_)) => Access::WriteThroughDaemon,
        };
        self.locate_for(state, offset, len, access)
    }

    /// [`Region::locate`] for an access of kind `access`.
    fn locate_for<'s>(
        &self,
        state: &'s MapState,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<Vec<Run<'s>>> {
        state.locate(
            self.ino,
            self.authority.host_id(),
            (offset, len),
            access,
            self.authority.peer(),
        )
    }

    fn target_transport(
        &self,
        state: &MapState,
        target: &Target<'_>,
    ) -> Result<Arc<dyn Transport>> {
        match target {
            Target::Local => state
                .local
                .clone()
                .map(|l| l as Arc<dyn Transport>)
                .ok_or_else(|| RegionsError::Invalid("local segment vanished".into())),
            Target::Remote(addr) => self.authority.transport(addr),
        }
    }

    /// Runs `io` for every run, hosts in parallel when worth it. `buf` is
    /// split into the runs' disjoint pieces.
    fn each_run<B: SplitBuf>(
        &self,
        state: &MapState,
        mut runs: Vec<Run<'_>>,
        buf: B,
        io: impl Fn(&dyn Transport, &[Span], B) -> Result<()> + Sync,
    ) -> Result<()> {
        // The common small access (one chunk, or chunks of one host that
        // merged into one run): straight to its transport, without the
        // grouping below (its allocations show in a 4 KiB read's latency).
        if runs.len() == 1
            && let Some(run) = runs.pop()
        {
            let (piece, _) = buf.split(run.len);
            let t = self.target_transport(state, &run.target)?;
            return io(t.as_ref(), &run.spans, piece);
        }
        let total: usize = runs.iter().map(|r| r.len).sum();
        // One group per target (`targets[i]` is `groups[i]`'s), in order of
        // first appearance; a region spans few hosts: a linear search.
        let mut targets: Vec<Target<'_>> = Vec::new();
        let mut groups: Vec<Group<B>> = Vec::new();
        let mut rest = buf;
        for run in runs {
            let (piece, tail) = rest.split(run.len);
            rest = tail;
            let slot = match targets.iter().position(|t| *t == run.target) {
                Some(i) => i,
                None => {
                    groups.push((self.target_transport(state, &run.target)?, Vec::new()));
                    targets.push(run.target);
                    groups.len() - 1
                }
            };
            groups[slot].1.push((run.spans, piece));
        }
        let serve = |(t, runs): Group<B>| -> Result<()> {
            for (spans, piece) in runs {
                io(t.as_ref(), &spans, piece)?;
            }
            Ok(())
        };
        if groups.len() == 1 || total < PARALLEL_MIN {
            return groups.into_iter().try_for_each(serve);
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| scope.spawn(|| serve(g)))
                .collect();
            handles.into_iter().try_for_each(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(RegionsError::Invalid("a transfer thread panicked".into()))
                })
            })
        })
    }

    /// Runs `op` and, if a daemon says the map or the capability is out of date
    /// ([`RegionsError::calls_for_refresh`]), refreshes both and tries once more.
    pub(crate) fn with_fresh_map<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        match op() {
            Err(e) if e.calls_for_refresh() => {
                self.refresh()?;
                op()
            }
            other => other,
        }
    }

    /// Reads up to `buf.len()` bytes at `offset`; returns how many (short at
    /// the end of the region, 0 past it).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.with_fresh_map(|| {
            // Again on a retry: the refresh may have brought a smaller size (a truncate).
            let size = self.size();
            if offset >= size {
                return Ok(0);
            }
            let n = (size - offset).min(buf.len() as u64) as usize;
            if let Some(o) = self.object()? {
                if !o.moving || offset + n as u64 <= u64::from(o.capacity) {
                    self.object_read(&o, offset, &mut buf[..n])?;
                    return Ok(n);
                }
                // Grown past the object while it moves: the bytes will be in the chunks.
                self.wait_moved()?;
            }
            self.ensure_local(offset + n as u64);
            self.renew_if_due_for(offset, n as u64, false)?;
            let state = self.state.read().map_err(|_| Self::poisoned())?;
            let runs = self.locate(&state, offset, n as u64, false)?;
            self.each_run(&state, runs, &mut buf[..n], |t, spans, piece: &mut [u8]| {
                t.read(spans, piece)
            })?;
            Ok(n)
        })
    }

    /// Writes `data` at `offset`, growing the region first when needed
    /// (see [`SizePolicy`]).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| RegionsError::Invalid(format!("write at {offset} overflows")))?;
        // Size and capacity are read on every attempt: a stale map or a revoked capability
        // (the region was truncated through another handle) is refreshed, and the region may
        // then be smaller and need space.
        let written = self.with_fresh_map(|| {
            self.wait_moved()?;
            let (size, capacity) = {
                let s = self.state.read().map_err(|_| Self::poisoned())?;
                (s.size, s.capacity())
            };
            if end > capacity || (end > size && self.policy == SizePolicy::Eager) {
                self.reserve(end)?;
                self.wait_moved()?;
            }
            if let Some(o) = self.object()? {
                return self.object_write(&o, offset, data);
            }
            self.ensure_local(end);
            self.renew_if_due_for(offset, data.len() as u64, true)?;
            let state = self.state.read().map_err(|_| Self::poisoned())?;
            // Only where no byte of it is on this host (which is also read through the
            // segment, without the transport).
            let posting = self
                .posting
                .filter(|_| !state.has_chunks_on(self.authority.host_id()));
            let runs = self.locate(&state, offset, data.len() as u64, true)?;
            self.each_run(&state, runs, data, |t, spans, piece: &[u8]| {
                if let Some(owner) = posting
                    && piece.len() <= POST_MAX
                    && t.posts_writes()
                    && t.post_write(owner, spans, piece)
                {
                    return Ok(());
                }
                t.write(spans, piece)
            })
        });
        if written.is_err() && end > self.size() {
            // Some of it may have landed past the size, which will not cover it.
            self.tail_unsure.store(true, Ordering::Relaxed);
        }
        written?;
        let mut s = self.state.write().map_err(|_| Self::poisoned())?;
        if end > s.size {
            s.size = end;
            s.unpublished = self.policy == SizePolicy::Lazy;
        }
        Ok(())
    }

    /// Makes the region's chunks cover `end`: eagerly also its size; lazily
    /// only the chunks, reserved ahead by doubling (at least `end`).
    fn reserve(&self, end: u64) -> Result<()> {
        let _one = self.reserving.lock().map_err(|_| Self::poisoned())?;
        let (size, capacity, object) = {
            let s = self.state.read().map_err(|_| Self::poisoned())?;
            (
                s.size,
                s.capacity(),
                s.object.as_ref().is_some_and(|o| !o.moving),
            )
        };
        let eager = self.policy == SizePolicy::Eager;
        if end <= capacity && (!eager || end <= size) {
            return Ok(());
        }
        let ahead = if end <= capacity
            || (capacity == 0 && end <= CHUNK_SIZE)
            || (object && end <= MAX_OBJECT_BYTES)
        {
            // A new region's first chunk is asked for as what it needs: a small one may be
            // stored as an object (the manager's choice), a larger one gets the chunk anyway.
            // A small region outgrowing its object asks for what it needs too: the manager
            // gives it a larger object while it stays under the small-region limit.
            end
        } else {
            let step = capacity.clamp(RESERVE_MIN, RESERVE_MAX);
            end.max(capacity.saturating_add(step)).div_ceil(CHUNK_SIZE) * CHUNK_SIZE
        };
        let grown = if eager { end } else { 0 };
        let info = match self.authority.grow(self.ino, grown, ahead, false) {
            Err(e) if e.errno() == libc::ENOSPC && ahead > end => {
                // Not enough for the step: exactly what this write needs.
                self.authority.grow(self.ino, grown, end, false)?
            }
            other => other?,
        };
        self.state
            .write()
            .map_err(|_| Self::poisoned())?
            .apply(info, true);
        Ok(())
    }

    /// Records that the manager holds a size of at least `size` (another
    /// handle of the same writer published it).
    pub fn note_published(&self, size: u64) {
        if let Ok(mut s) = self.state.write()
            && s.size <= size
        {
            s.unpublished = false;
        }
    }

    /// Makes this handle's growth of the size durable at the manager (and,
    /// with `touch`, the region's mtime now, so that other hosts drop
    /// cached copies at their next open). Returns the attributes the
    /// manager then holds, or `None` when there was nothing to do.
    pub fn publish(&self, touch: bool) -> Result<Option<v1::Attr>> {
        let (size, unpublished) = {
            let s = self.state.read().map_err(|_| Self::poisoned())?;
            (s.size, s.unpublished)
        };
        // The bytes first: the size must not cover posted writes that did not land.
        self.flush_posted()?;
        if !unpublished && !touch {
            return Ok(None);
        }
        let grown = if unpublished { size } else { 0 };
        let info = self.authority.grow(self.ino, grown, 0, touch)?;
        let attr = info.attr.clone();
        let mut s = self.state.write().map_err(|_| Self::poisoned())?;
        if s.size <= size {
            // Nothing grew it further meanwhile.
            s.unpublished = false;
        }
        s.apply(info, true);
        Ok(attr)
    }

    /// Sets the region's size (holes read as zeros).
    pub fn set_len(&self, size: u64) -> Result<()> {
        self.wait_posted();
        let info = self.authority.truncate(self.ino, size)?;
        let mut s = self.state.write().map_err(|_| Self::poisoned())?;
        s.unpublished = false;
        s.apply(info, false);
        Ok(())
    }

    fn word_span(&self, offset: u64) -> Result<(Arc<dyn Transport>, Span)> {
        if !offset.is_multiple_of(8) {
            return Err(RegionsError::Invalid(format!(
                "atomic at offset {offset} is not 8-byte aligned"
            )));
        }
        if offset.checked_add(8).is_none_or(|end| end > self.size()) {
            return Err(RegionsError::Invalid(format!(
                "atomic at offset {offset} is past the end of the region ({} bytes)",
                self.size()
            )));
        }
        self.ensure_chunks()?;
        self.ensure_local(offset + 8);
        self.renew_if_due_for(offset, 8, true)?;
        let state = self.state.read().map_err(|_| Self::poisoned())?;
        let access = match &self.authority {
            Authority::Cluster { .. } => Access::Atomic,
            Authority::Agent(_) => Access::WriteThroughDaemon,
        };
        let mut runs = self.locate_for(&state, offset, 8, access)?;
        let run = runs
            .pop()
            .ok_or_else(|| RegionsError::Invalid("empty atomic range".into()))?;
        let span = run.spans[0];
        Ok((self.target_transport(&state, &run.target)?, span))
    }

    /// Atomic compare-and-swap of the 8-byte word at `offset`; returns the
    /// value before.
    pub fn compare_and_swap(&self, offset: u64, expected: u64, new: u64) -> Result<u64> {
        self.with_fresh_map(|| {
            let (t, span) = self.word_span(offset)?;
            t.compare_and_swap(&span, expected, new)
        })
    }

    /// Atomic fetch-and-add of the 8-byte word at `offset`; returns the
    /// value before.
    pub fn fetch_add(&self, offset: u64, addend: u64) -> Result<u64> {
        self.with_fresh_map(|| {
            let (t, span) = self.word_span(offset)?;
            t.fetch_add(&span, addend)
        })
    }

    /// Publishes the size (see [`Region::publish`]) and closes the handle
    /// at the manager (also done on drop; a second close does nothing).
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        let published = self.publish(false);
        // Published: every byte this handle wrote lies below the durable size, unless a
        // write past the size failed half way. Closed at the manager either way.
        let within_size = published.is_ok() && !self.tail_unsure.load(Ordering::Relaxed);
        let closed = self.authority.close(self.handle, within_size);
        published?;
        closed
    }

    // ---- what an application's mapping asks of its region ----

    /// Device number of the mount it was opened through (0 when opened by inode or by a
    /// [`crate::Client`]): with the inode, it names the region among several clusters.
    pub fn dev(&self) -> u64 {
        self.authority.dev()
    }

    /// Whether the region was opened for writing.
    pub fn writable(&self) -> bool {
        self.write
    }

    /// This host's id.
    pub fn host_id(&self) -> u32 {
        self.authority.host_id()
    }

    /// The region's fixed virtual address (FIXVADDR regions), else 0.
    pub fn vaddr(&self) -> u64 {
        self.state
            .read()
            .map_or(0, |s| if s.fixvaddr { s.vaddr } else { 0 })
    }

    /// Traffic counters of the transports this region uses (opened by a [`crate::Client`]:
    /// shared with the client's other regions).
    pub fn stats(&self) -> StatsSnapshot {
        self.authority.stats().snapshot()
    }

    /// This host's segment memfd of the region, if this host holds part of it.
    pub fn segment(&self) -> Result<Option<Segment>> {
        self.ensure_chunks()?;
        let covering = self
            .state
            .read()
            .map_or(0, |s| s.end_on(self.authority.host_id()));
        self.authority.segment(self.ino, self.write, covering)
    }

    /// Whether any chunk is held on this host.
    pub fn has_local_chunks(&self) -> bool {
        let host_id = self.authority.host_id();
        self.state.read().is_ok_and(|s| s.has_chunks_on(host_id))
    }

    /// Where chunk `index` lives.
    pub fn chunk(&self, index: u64) -> Result<ChunkLoc> {
        self.ensure_chunks()?;
        let state = self.state.read().map_err(|_| Self::poisoned())?;
        state.chunk(
            self.ino,
            index,
            self.authority.host_id(),
            self.authority.peer(),
        )
    }

    /// Grows the region to at least `size` bytes (published at once).
    pub fn extend(&self, size: u64) -> Result<()> {
        let info = self.authority.grow(self.ino, size, 0, false)?;
        self.state
            .write()
            .map_err(|_| Self::poisoned())?
            .apply(info, true);
        Ok(())
    }

    /// The transport to the daemon at `addr` (renewing the capability first when due).
    pub fn transport(&self, addr: &str) -> Result<Arc<dyn Transport>> {
        self.renew_if_due()?;
        self.authority.transport(addr)
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("ino", &self.ino)
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.closed.swap(true, Ordering::Relaxed) {
            return;
        }
        let published = match self.publish(false) {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(ino = self.ino, error = %e, "cannot make the size of a written region durable at close");
                false
            }
        };
        let within_size = published && !self.tail_unsure.load(Ordering::Relaxed);
        if let Err(e) = self.authority.close(self.handle, within_size) {
            tracing::debug!(ino = self.ino, error = %e, "closing region handle failed");
        }
    }
}

/// One transport and the runs (spans and their piece of the buffer) it serves.
type Group<B> = (Arc<dyn Transport>, Vec<(Vec<Span>, B)>);

/// A buffer that can be cut into consecutive disjoint pieces.
trait SplitBuf: Send + Sized {
    fn split(self, at: usize) -> (Self, Self);
}

impl SplitBuf for &mut [u8] {
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at_mut(at)
    }
}

impl SplitBuf for &[u8] {
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at(at)
    }
}
