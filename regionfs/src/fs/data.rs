//! The data path of the file system core: open, read, write, size publication (close-to-open
//! consistency), flush, fsync and release.

use super::*;

impl RegionFs {
    /// Opens `ino` with open(2) `flags`.
    pub fn open(&self, ctx: &RequestCtx, ino: u64, flags: i32) -> FsResult<Opened> {
        if let Some(node) = Node::from_ino(ino) {
            return self.pseudo_open(ctx, node, flags);
        }
        self.count_open();
        let caller = self.caller(ctx);
        let write = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if flags & FMODE_EXEC != 0 {
            // execve: the kernel checks only that some execute bit is set.
            self.manager().access(&caller, ino, libc::X_OK as u32)?;
        }
        if write {
            self.wait_for_passthrough_readers(ino)?;
        }
        let (region, how, leased) = self.open_region_as_leases_allow(&caller, ino, write, flags)?;
        let attr = self.with_local_size(region.opened_attr().clone());
        if is_dir(&attr) {
            return Err(FsError::IsDir(format!("inode {ino}")));
        }
        if self.kernel_size_stale(&attr) {
            return Err(FsError::Stale(format!(
                "region {ino} shrank to {} bytes on another host; the kernel looks it up again",
                attr.size
            )));
        }
        let now = stamp(&attr);
        // A fill of the bytes from before a change must not store after the pages are dropped.
        let filling = self
            .lock_inodes()
            .get(&ino)
            .filter(|st| st.seen != Some(now))
            .and_then(|st| st.fill.clone());
        if let Some(f) = filling {
            f.wait_stopped(ino)?;
        }
        // Close-to-open: keep the cached pages only if nothing changed.
        let (keep, grown_from, known) = {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(ino).or_insert_with(|| InodeState {
                kernel_size: attr.size,
                ..InodeState::default()
            });
            // A leased open's placement is what the kernel's cache holds: nothing changed
            // the region since (but this mount, whose writes are in that cache).
            let keep = st.seen == Some(now) || leased.is_some();
            let known = st.kernel_size;
            st.seen = Some(now);
            let grown = if self.writeback() && attr.size > st.kernel_size {
                let old = st.kernel_size;
                st.kernel_size = attr.size;
                Some(old)
            } else {
                None
            };
            (keep, grown, known)
        };
        if !keep && let Some(k) = self.kernel.get() {
            // Attributes only: the open without keep_cache drops the pages.
            let _ = k.invalidate(ino, -1, 0);
        }
        // A writer holds background fills off from before it can write until its release.
        let hold = if write {
            Some(self.hold_fills(ino)?)
        } else {
            None
        };
        if let Some(old) = grown_from {
            self.push_size(ino, old, attr.size, Some(&region));
        }
        let (io, fd) = self.choose_io(ino, write, &region, &attr)?;
        let fh = self.add_region_handle(ino, caller, region, (write, how), io);
        if let Some(hold) = hold {
            hold.keep();
        }
        if let Some(check) = &leased
            && let Err(e) = self.confirm_leased(fh, check)
        {
            let _ = self.release(fh);
            return Err(e);
        }
        tracing::trace!(
            ino,
            fh,
            write,
            keep,
            size = attr.size,
            kernel_size = known,
            io = io.name(),
            "open"
        );
        Ok(Opened {
            fh,
            keep_cache: keep && io == IoMode::Cached,
            direct_io: io == IoMode::Direct,
            passthrough: io == IoMode::Passthrough,
            backing: fd,
        })
    }

    /// Opens region `ino` for `caller` (for writing when `write`) with open(2) `flags`:
    /// read-only under a cache lease without asking the manager when this mount holds a
    /// placement the lease covers (`fs/leased_opens.rs`; what to confirm once the handle is
    /// registered), else at the manager, keeping the placement a read-only open brings for
    /// the next one.
    fn open_region_as_leases_allow(
        &self,
        caller: &v1::Caller,
        ino: u64,
        write: bool,
        flags: i32,
    ) -> FsResult<(Region, Opening, Option<LeasedCheck>)> {
        if write {
            // This mount changes the region: no leased open is made from what it knew.
            let writer = self.placements.writer(ino, self.attr_chain(ino), true);
            let region = self.open_region(caller, ino, true)?;
            return Ok((region, Opening::Writer(writer), None));
        }
        if flags & (FMODE_EXEC | libc::O_TRUNC) == 0
            && let Some((region, check)) = self.open_leased(caller, ino)
        {
            return Ok((region, Opening::Leased, Some(check)));
        }
        let ticket = self.placements.ticket(ino, self.attr_chain(ino));
        let asked = Instant::now();
        let region = self.open_region(caller, ino, false)?;
        let attr = region.opened_attr();
        self.note_leases(caller, asked, None, attr);
        if let Some(placement) = region.placement() {
            self.placements
                .keep(&ticket, placement, self.attr_chain(ino), attr.attr_lease);
        }
        Ok((region, Opening::Plain, None))
    }

    /// Whether the kernel's inode of `attr`'s region holds a larger size
    /// than the region has (it shrank on another host). In writeback mode
    /// the kernel never takes a file's size from the file system again, so
    /// when no descriptor of this mount has the region open the inode gets
    /// a new generation: the kernel's next lookup of the name replaces the
    /// inode (with the right size) instead of reusing it. Its caller makes
    /// the kernel look up again (a lookup reply, or `ESTALE` from open,
    /// which the kernel retries once after looking the path up afresh).
    pub(super) fn kernel_size_stale(&self, attr: &v1::Attr) -> bool {
        if !self.writeback() || !is_region(attr) {
            return false;
        }
        let busy = !self.handles_of(attr.ino).is_empty();
        let fill = {
            let mut inodes = self.lock_inodes();
            let Some(st) = inodes.get_mut(&attr.ino) else {
                return false;
            };
            if attr.size >= st.kernel_size || busy {
                return false;
            }
            st.kernel_size = attr.size;
            st.seen = None;
            st.attr = None;
            st.fill.clone()
        };
        // A fill its last reader left running must not store into the new inode.
        if let Some(f) = fill
            && let Err(e) = f.wait_stopped(attr.ino)
        {
            tracing::warn!(ino = attr.ino, error = %e, "a background fill did not stop");
        }
        if let Ok(mut g) = self.generations.lock() {
            *g.entry(attr.ino).or_insert(0) += 1;
        }
        tracing::debug!(
            ino = attr.ino,
            size = attr.size,
            "region shrank elsewhere; new inode generation for the kernel"
        );
        true
    }

    /// The generation of inode `ino` for the kernel.
    pub fn generation(&self, ino: u64) -> u64 {
        self.generations
            .lock()
            .ok()
            .and_then(|g| g.get(&ino).copied())
            .unwrap_or(0)
    }

    /// Reads up to `size` bytes at `offset`.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        self.read_with(fh, offset, size, <[u8]>::to_vec)
    }

    /// Reads up to `size` bytes at `offset` and hands them to `reply`
    /// without allocating: region bytes land in a buffer kept per thread
    /// (a fresh zeroed megabyte per read costs page faults and a memset
    /// that show up next to the transfer itself).
    pub fn read_with<T>(
        &self,
        fh: u64,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[u8]) -> T,
    ) -> FsResult<T> {
        thread_local! {
            static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let h = self.handle(fh)?;
        match &h.body {
            Body::Pseudo(data) => {
                let start = (offset as usize).min(data.len());
                let end = start.saturating_add(size as usize).min(data.len());
                Ok(reply(&data[start..end]))
            }
            Body::Region(_) => {
                let r = h.region()?;
                let end = offset.saturating_add(u64::from(size));
                let kernel_size = self
                    .lock_inodes()
                    .get(&h.ino)
                    .map_or(u64::MAX, |st| st.kernel_size);
                if end > r.region.size() && kernel_size > r.region.size() {
                    // Grown through another handle since this open (the
                    // kernel, which asks only below the size it knows,
                    // believes it larger; a read of the page holding the
                    // end needs no refresh).
                    r.region.refresh()?;
                    let local = self.unpublished_size(h.ino);
                    if local > r.region.size() {
                        // A writer of this mount has not published yet.
                        r.region.note_size(local);
                    }
                }
                READ_BUF
                    .with(|cell| {
                        let mut guard = cell.try_borrow_mut();
                        let mut own = Vec::new();
                        // Re-entrance cannot happen here, but fall back to a
                        // fresh buffer rather than panic if it ever does.
                        let buf = match guard.as_mut() {
                            Ok(b) => &mut **b,
                            Err(_) => &mut own,
                        };
                        if buf.len() < size as usize {
                            buf.resize(size as usize, 0);
                        }
                        let n = r.region.read_at(offset, &mut buf[..size as usize])?;
                        Ok::<_, FsError>(reply(&buf[..n]))
                    })
                    .inspect(|_| {
                        if r.io.lock().is_ok_and(|io| *io == IoMode::Cached) {
                            self.note_read(fh, &h, offset, u64::from(size));
                        }
                    })
            }
        }
    }

    /// Writes `data` at `offset` through to the region. Growth past the
    /// size lands in space the region reserves ahead in steps; the new size
    /// reaches the manager at flush, fsync or release ([`Self::publish`]).
    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let h = self.handle(fh)?;
        let r = h.region()?;
        // A host out of touch with the manager for most of a lease may be fenced soon.
        check_contact(&self.contact)?;
        if !r.write {
            return Err(FsError::BadHandle(format!(
                "file handle {fh} of inode {} is not open for writing",
                h.ino
            )));
        }
        let end = offset.saturating_add(data.len() as u64);
        {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(h.ino).or_default();
            st.kernel_size = st.kernel_size.max(end);
            st.dirty = true;
        }
        r.region.write_at(offset, data)?;
        u32::try_from(data.len()).map_err(|_| FsError::Invalid("write too large".into()))
    }

    /// Clears the setuid bit of region `ino`, and its setgid bit when the
    /// group may execute it or the writer is not in its group (the kernel's
    /// rule since Linux 6.2), before a write by someone the kernel says must
    /// not keep them: it asks only when the writer lacks `CAP_FSETID` (the
    /// file system handles this: `FUSE_HANDLE_KILLPRIV_V2`).
    pub fn kill_suidgid(&self, ctx: &RequestCtx, ino: u64) {
        let writer = self.caller(ctx);
        let internal = self.identity.internal();
        let Ok(attr) = self.manager().getattr(&internal, ino) else {
            return;
        };
        let in_group = writer.gid == attr.gid || writer.groups.contains(&attr.gid);
        let mut mode = attr.mode & !libc::S_ISUID;
        if attr.mode & libc::S_IXGRP != 0 || !in_group {
            mode &= !libc::S_ISGID;
        }
        if mode == attr.mode {
            return;
        }
        let change = SetAttrIn {
            mode: Some(mode & 0o7777),
            ..SetAttrIn::default()
        };
        match self.manager().setattr(&internal, ino, &change) {
            Ok(_) => {
                if let Some(k) = self.kernel.get() {
                    let _ = k.invalidate(ino, -1, 0);
                }
            }
            Err(e) => {
                tracing::warn!(ino, error = %e, "cannot clear setuid/setgid before a write")
            }
        }
    }

    /// Write handles of `ino` open through this mount whose growth of the
    /// size has not reached the manager, largest size first.
    pub(super) fn unpublished(&self, ino: u64) -> Vec<Arc<Handle>> {
        let mut open: Vec<(u64, Arc<Handle>)> = self
            .handles_of(ino)
            .into_iter()
            .filter_map(|h| match &h.body {
                Body::Region(r) if r.write && r.region.has_unpublished_size() => {
                    Some((r.region.size(), Arc::clone(&h)))
                }
                _ => None,
            })
            .collect();
        open.sort_by_key(|(size, _)| std::cmp::Reverse(*size));
        open.into_iter().map(|(_, h)| h).collect()
    }

    /// The size of `attr` as this mount knows it: the manager's, or what
    /// this mount's writers grew it to and have not published yet.
    pub(super) fn with_local_size(&self, mut attr: v1::Attr) -> v1::Attr {
        if is_region(&attr) {
            attr.size = attr.size.max(self.unpublished_size(attr.ino));
        }
        attr
    }

    /// The largest size a writer of this mount grew `ino` to and has not
    /// published (0: none).
    pub(super) fn unpublished_size(&self, ino: u64) -> u64 {
        match self.unpublished(ino).first().map(|h| &h.body) {
            Some(Body::Region(r)) => r.region.size(),
            _ => 0,
        }
    }

    /// Makes what this mount wrote to the region durable and visible to
    /// the next opener on any host: the size its writers grew it to and a
    /// new mtime (so that other mounts drop their cached pages at their
    /// next open), in one manager request. The kernel writes back through
    /// any writable handle of the inode, so the growth may sit on another
    /// handle of this mount than the one flushed.
    pub(super) fn publish(&self, h: &Handle) -> FsResult<()> {
        let r = match &h.body {
            Body::Region(_) => h.region()?,
            Body::Pseudo(_) => return Ok(()),
        };
        if !r.write {
            // A lost posted write of the file is reported through any descriptor.
            return Ok(self.client.settle_posted_writes(h.ino)?);
        }
        // This handle's posted writes land (or fail) before any size covers them.
        r.region.flush_posted()?;
        let dirty = {
            let mut inodes = self.lock_inodes();
            inodes
                .get_mut(&h.ino)
                .map(|st| std::mem::replace(&mut st.dirty, false))
                .unwrap_or(false)
        };
        let holders = self.unpublished(h.ino);
        let region = match holders.first().map(|x| &x.body) {
            Some(Body::Region(x)) => &x.region,
            _ if dirty => &r.region,
            _ => return Ok(()),
        };
        match region.publish(dirty) {
            Ok(attr) => {
                if let Some(attr) = attr {
                    for other in &holders {
                        if let Body::Region(x) = &other.body {
                            x.region.note_published(attr.size);
                        }
                    }
                    let mut inodes = self.lock_inodes();
                    if let Some(st) = inodes.get_mut(&h.ino) {
                        st.seen = Some(stamp(&attr));
                        st.attr = Some((attr, Instant::now()));
                    }
                }
                Ok(())
            }
            Err(e) => {
                if dirty {
                    let mut inodes = self.lock_inodes();
                    if let Some(st) = inodes.get_mut(&h.ino) {
                        st.dirty = true;
                    }
                }
                Err(e.into())
            }
        }
    }

    /// close(2) of a descriptor of `fh`, open on inode `ino` (the kernel has written back).
    pub fn flush(&self, ino: u64, fh: u64) -> FsResult<()> {
        // The descriptor is gone whatever happens next.
        if let Some(d) = &self.descriptor_epochs {
            d.closed(ino);
        }
        let h = self.handle(fh)?;
        self.publish(&h)
    }

    /// fsync(2) / msync(2): written data is in the region already.
    pub fn fsync(&self, fh: u64) -> FsResult<()> {
        let h = self.handle(fh)?;
        self.publish(&h)
    }

    /// The last reference to an open file went away.
    pub fn release(&self, fh: u64) -> FsResult<Released> {
        let h = self.handle(fh)?;
        if matches!(h.body, Body::Region(_))
            && let Err(e) = self.publish(&h)
        {
            tracing::warn!(ino = h.ino, error = %e, "cannot record the new mtime of a written region at release; other hosts may keep stale cached pages");
        }
        // Published (or refused) while still listed, so that a concurrent release of the
        // file's other handle does not take it for the last one before this one reported a
        // lost posted write.
        {
            let mut m = self
                .handles
                .write()
                .map_err(|_| FsError::BadHandle(format!("file handle {fh}: lock poisoned")))?;
            if m.remove(&fh).is_none() {
                return Err(FsError::BadHandle(format!("file handle {fh} is not open")));
            }
            metrics::gauge!("regions_fuse_open_handles").set(m.len() as f64);
            if matches!(h.body, Body::Region(_)) && !m.values().any(|x| x.ino == h.ino) {
                // Its last descriptor here closed, and each writer's release reported a lost
                // posted write, if any (which also keeps it from publishing a size): a later
                // open starts afresh. Under the lock: no open of the file comes between.
                self.client.forget_lost_writes(h.ino);
            }
        }
        let mut passthrough = false;
        if let Body::Region(r) = &h.body {
            if let Opening::Writer(writer) = &r.opening {
                self.writer_released(h.ino, writer, &r.region);
            }
            let io = r.io.lock().map(|i| *i).unwrap_or(IoMode::Direct);
            passthrough = io == IoMode::Passthrough;
            let last = self.handles_of(h.ino).is_empty();
            let mut inodes = self.lock_inodes();
            if let Some(st) = inodes.get_mut(&h.ino) {
                if r.write {
                    st.writers = st.writers.saturating_sub(1);
                }
                if let Some(f) = &st.fill
                    && (last || f.fh == fh)
                {
                    // Nobody here reads it any more, or its handle is gone: the fill ends
                    // after its store in flight (and stays recorded until it has ended).
                    f.stop();
                }
                match io {
                    IoMode::Cached => st.cached_opens = st.cached_opens.saturating_sub(1),
                    IoMode::Passthrough => {
                        st.passthrough_opens = st.passthrough_opens.saturating_sub(1)
                    }
                    IoMode::Direct => {}
                }
            }
        }
        let ino = h.ino;
        // The region handle closes at the manager when the last reference
        // (this one, unless a read is still running) goes.
        self.closer.close(h);
        Ok(Released { ino, passthrough })
    }
}
