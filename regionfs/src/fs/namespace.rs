//! The namespace operations of the file system core: lookups and attributes, directories,
//! creation, links, renames, removal, listings, statfs and access.

use super::*;

impl RegionFs {
    /// Looks up `name` in directory `parent`.
    pub fn lookup(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<v1::Attr> {
        if parent == ROOT_INO && name == pseudo::DIR_NAME {
            Self::root_only(ctx)?;
            return self.pseudo_attr(Node::Root);
        }
        if let Some(node) = Node::from_ino(parent) {
            return self.pseudo_lookup(ctx, node, name);
        }
        let name = wire(name)?;
        let name: &str = &name;
        let caller = self.caller(ctx);
        let asked = Instant::now();
        let attr = self.manager().lookup(&caller, parent, name)?;
        self.note_leases(&caller, asked, Some(parent), &attr);
        let attr = self.with_local_size(attr);
        if is_dir(&attr) {
            self.note_dir(&attr, Some(parent));
        } else {
            self.kernel_size_stale(&attr);
            self.note_reply(&attr);
        }
        Ok(attr)
    }

    /// The attributes of `ino`.
    pub fn getattr(&self, ctx: &RequestCtx, ino: u64) -> FsResult<v1::Attr> {
        if let Some(node) = Node::from_ino(ino) {
            return self.pseudo_attr(node);
        }
        if let Some(attr) = self.recent_attr_while_writing(ino) {
            return Ok(attr);
        }
        if let Some(attr) = self.leased_attr(ino) {
            return Ok(self.with_local_size(attr));
        }
        let caller = self.caller(ctx);
        let ticket = self.placements.ticket(ino, self.attr_chain(ino));
        let asked = Instant::now();
        let attr = match self.manager().getattr(&caller, ino) {
            Ok(a) => {
                self.note_leases(&caller, asked, None, &a);
                if is_region(&a) {
                    self.placements.keep_attr(&ticket, &a, self.attr_chain(ino));
                }
                self.with_local_size(a)
            }
            Err(e) if e.errno() == libc::ENOENT => {
                // fstat of a directory removed while open: st_nlink 0.
                return self
                    .removed_dirs
                    .lock()
                    .ok()
                    .and_then(|r| r.get(&ino).cloned())
                    .ok_or(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        if is_dir(&attr) {
            self.note_dir(&attr, None);
        } else {
            self.note_reply(&attr);
        }
        Ok(attr)
    }

    /// The attributes this mount gave the kernel within the attribute TTL,
    /// while it has the region open for writing: the kernel re-reads them
    /// after each direct write, and they can only have changed through
    /// this mount's own writes (another host's changes show at open).
    pub(super) fn recent_attr_while_writing(&self, ino: u64) -> Option<v1::Attr> {
        let writing = self
            .handles_of(ino)
            .iter()
            .any(|h| matches!(&h.body, Body::Region(r) if r.write));
        if !writing {
            return None;
        }
        let cached = {
            let inodes = self.lock_inodes();
            let (attr, at) = inodes.get(&ino)?.attr.as_ref()?;
            (at.elapsed() < ATTR_REUSE).then(|| attr.clone())?
        };
        Some(self.with_local_size(cached))
    }

    pub(super) fn note_dir(&self, attr: &v1::Attr, parent: Option<u64>) {
        if let Ok(mut d) = self.dirs.lock() {
            let info = d.entry(attr.ino).or_default();
            info.mode = attr.mode;
            if parent.is_some() {
                info.parent = parent;
            }
        }
    }

    /// Whether the kernel may cache the entry `name` of `parent`. Without
    /// `default_permissions` the kernel checks no search permission on the
    /// way through cached entries, so the entries of directories that not
    /// everyone may search are looked up (and checked by the manager) every
    /// time, as are those of the `.regions` tree.
    pub fn entry_cacheable(&self, parent: u64, name: &OsStr) -> bool {
        let dirs = self.dirs.lock();
        cacheable_in(
            parent,
            name,
            dirs.as_ref().ok().and_then(|d| d.get(&parent)),
        )
    }

    /// Whether the kernel may cache entry `name` of `parent` (as
    /// [`RegionFs::entry_cacheable`]), recording it if so, under one lock (a chmod of
    /// `parent` either comes before, and the entry is not cacheable, or after, and takes the
    /// record): a chmod that takes away search permission makes the kernel forget the recorded
    /// entries at once (see `forget_entries_later`). Records older than `ttl` are useless
    /// (the kernel looks those entries up again): once the mount holds many, they are swept,
    /// at most once per `ttl`, and none is recorded past the bound meanwhile (the manager's
    /// listing covers the rest). Only directories this mount knows (by their mode) record.
    pub fn entry_cacheable_noting(&self, parent: u64, name: &OsStr, ttl: Duration) -> bool {
        self.note_cached_entry(parent, name, ttl).is_some()
    }

    /// [`RegionFs::entry_cacheable_noting`], saying also whether the entry is recorded:
    /// `None` when it may not be cached, `Some(recorded)` when it may.
    pub(super) fn note_cached_entry(
        &self,
        parent: u64,
        name: &OsStr,
        ttl: Duration,
    ) -> Option<bool> {
        /// Records kept before a sweep (a sweep keeps only those younger than the TTL), and at
        /// most.
        const SWEEP_AT: usize = 1 << 16;
        let Ok(mut dirs) = self.dirs.lock() else {
            return cacheable_in(parent, name, None).then_some(false);
        };
        let now = Instant::now();
        if self.cached_names.load(Ordering::Relaxed) >= SWEEP_AT
            && let Ok(mut swept) = self.cached_swept.lock()
            && now.duration_since(*swept) >= ttl
        {
            *swept = now;
            let mut left = 0;
            for info in dirs.values_mut() {
                info.cached.retain(|_, at| now.duration_since(*at) < ttl);
                left += info.cached.len();
            }
            self.cached_names.store(left, Ordering::Relaxed);
        }
        let known = dirs.get_mut(&parent);
        if !cacheable_in(parent, name, known.as_deref()) {
            return None;
        }
        let Some(info) = known else {
            return Some(false);
        };
        if self.cached_names.load(Ordering::Relaxed) >= SWEEP_AT {
            return Some(info.cached.contains_key(name));
        }
        if info.cached.insert(name.to_os_string(), now).is_none() {
            self.cached_names.fetch_add(1, Ordering::Relaxed);
        }
        Some(true)
    }

    /// Takes the entries of `dir` recorded as handed to the kernel (for it to forget them).
    pub(super) fn take_recorded_entries(&self, dir: u64) -> Vec<std::ffi::OsString> {
        let taken = self
            .dirs
            .lock()
            .ok()
            .and_then(|mut d| d.get_mut(&dir).map(|i| std::mem::take(&mut i.cached)));
        match taken {
            Some(c) => {
                self.uncount_cached(c.len());
                c.into_keys().collect()
            }
            None => Vec::new(),
        }
    }

    /// Takes `n` records (dropped with their directory's) off the count.
    fn uncount_cached(&self, n: usize) {
        let _ = self
            .cached_names
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_sub(n))
            });
    }

    /// chmod, chown, truncate, utimens. `fh` is the open file the change
    /// came through, if any.
    pub fn setattr(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        change: SetAttrIn,
        ctime: bool,
        fh: Option<u64>,
    ) -> FsResult<v1::Attr> {
        if pseudo::is_pseudo(ino) {
            return Err(FsError::Denied(
                "region metadata files cannot be changed".into(),
            ));
        }
        // No background fill stores across a size change (it could bring back bytes past a
        // new end, or the old end itself).
        let _hold = match change.size {
            Some(_) => Some(self.hold_fills(ino)?),
            None => None,
        };
        let mut change = change;
        let handle = fh.and_then(|fh| self.handle(fh).ok());
        // In writeback mode the kernel keeps mtime itself and sends it as an
        // explicit time with truncations and when it flushes (with ctime, and
        // the open file). Those are bookkeeping, not utimensat: setting
        // "now" needs only write permission where an explicit time needs
        // ownership.
        let bookkeeping = matches!(change.mtime, Some(SetTime::At(..)))
            && ctime
            && (change.size.is_some()
                || (fh.is_some() && change.atime.is_none())
                || change.atime == Some(SetTime::Now));
        if bookkeeping {
            change.mtime = Some(SetTime::Now);
        }
        let only_times = change.mode.is_none()
            && change.uid.is_none()
            && change.gid.is_none()
            && change.size.is_none();
        // Until the change is answered, and for replies to requests sent before, leased opens
        // and getattrs of the region are not answered from what this mount knew (an older
        // size or mode); a change of times voids only attributes.
        let _change = self.placements.change(ino, only_times);
        if only_times
            && ctime
            && fh.is_none()
            && self.unlinked.lock().is_ok_and(|u| u.contains(&ino))
        {
            // The kernel records the ctime of the unlink (writeback mode) on an inode whose
            // last name this mount removed and that nobody here has open: the manager would
            // answer the same, at the cost of a round trip per unlink.
            return Err(FsError::NotFound(format!(
                "region {ino} was removed; its times are not kept"
            )));
        }
        let caller = match &handle {
            Some(h) if bookkeeping && only_times => match &h.body {
                Body::Region(r) => r.caller.clone(),
                Body::Pseudo(_) => self.caller(ctx),
            },
            _ => self.caller(ctx),
        };
        let writer = handle
            .as_ref()
            .is_some_and(|h| matches!(&h.body, Body::Region(r) if r.write));
        // ftruncate: the descriptor was opened for writing, which is the
        // permission a size change needs (a later chmod does not take it).
        change.through_write_handle = writer && change.size.is_some();
        if bookkeeping && only_times && writer {
            // The kernel flushing the mtime of a file written through this
            // handle: the next publish (flush, fsync or release) sets it at
            // the manager together with the size, in one request.
            let cached = {
                let mut inodes = self.lock_inodes();
                let st = inodes.entry(ino).or_default();
                st.dirty = true;
                st.attr.as_ref().map(|(a, _)| a.clone())
            };
            if let Some(mut attr) = cached {
                let now = now_ts();
                attr.mtime = Some(now);
                attr.ctime = Some(now);
                return Ok(self.with_local_size(attr));
            }
        }
        if let Some(size) = change.size {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(ino).or_default();
            st.kernel_size = size;
        }
        if change.size.is_some() {
            // Writes posted before the truncate land before it (a late one would land past
            // the new size, or be refused once its chunk is gone); if one of the file's was
            // lost, no size covers it.
            self.client.settle_posted_writes(ino)?;
        }
        let attr = match self.manager().setattr(&caller, ino, &change) {
            Ok(a) => a,
            Err(e) if bookkeeping && only_times && fh.is_some() && e.errno() != libc::EIO => {
                // The kernel flushing its mtime must not fail a close.
                tracing::debug!(ino, error = %e, "mtime update refused; keeping the manager's");
                return Ok(self.manager().getattr(&caller, ino)?);
            }
            Err(e) => return Err(e.into()),
        };
        if !is_dir(&attr)
            && let Some(st) = self.lock_inodes().get_mut(&ino)
        {
            st.attr = Some((attr.clone(), Instant::now()));
        }
        if is_dir(&attr) {
            self.note_dir(&attr, None);
            if change.mode.is_some() && attr.mode & 0o111 != 0o111 {
                self.forget_entries_later(ino);
            }
        }
        if let Some(size) = change.size {
            for h in self.handles_of(ino) {
                if let Body::Region(r) = &h.body
                    && let Err(e) = r.region.note_truncated(size)
                {
                    tracing::debug!(ino, error = %e, "cannot refresh an open handle after a truncate");
                }
            }
        }
        if change.size.is_some() || bookkeeping {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(ino).or_default();
            st.seen = Some(stamp(&attr));
            if bookkeeping {
                st.dirty = false;
            }
        }
        Ok(attr)
    }

    /// A directory stopped being searchable by everyone: the kernel must
    /// look its entries up again (so that the manager checks each caller).
    /// Done on a thread of its own, since the kernel holds the directory's
    /// lock until this setattr is answered: the entries this mount gave the
    /// kernel to cache are dropped first, as soon as the lock is free (the
    /// window in which another user may still pass through a cached entry is
    /// the wake-up of that thread), then every entry the manager lists.
    pub(super) fn forget_entries_later(&self, dir: u64) {
        let Some(kernel) = self.kernel.get().cloned() else {
            return;
        };
        let known = self.take_recorded_entries(dir);
        let client = self.client.clone();
        let caller = self.identity.internal();
        let spawned = std::thread::Builder::new()
            .name("regionfs-inval".into())
            .spawn(move || {
                for name in &known {
                    let _ = kernel.invalidate_entry(dir, name);
                }
                let mut offset = 0;
                loop {
                    let reply = match client.manager().readdir(&caller, dir, offset, READDIR_BATCH) {
                        Ok(r) => r,
                        Err(e) => {
                            tracing::debug!(dir, error = %e, "cannot list a directory to drop its cached entries");
                            return;
                        }
                    };
                    for e in &reply.entries {
                        let name = names::from_wire(&e.name);
                        let _ = kernel.invalidate_entry(dir, &name);
                        offset = e.offset;
                    }
                    if reply.end || reply.entries.is_empty() {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(dir, error = %e, "cannot start a thread to drop cached entries");
        }
    }

    /// Creates directory `name`.
    pub fn mkdir(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
    ) -> FsResult<v1::Attr> {
        self.check_creatable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let asked = Instant::now();
        let attr = self
            .manager()
            .mkdir(&caller, parent, &wire(name)?, mode & !umask & 0o7777)?;
        self.note_leases(&caller, asked, Some(parent), &attr);
        self.note_dir(&attr, Some(parent));
        Ok(attr)
    }

    pub(super) fn check_creatable(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
    ) -> FsResult<()> {
        if pseudo::is_pseudo(parent) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied(
                "nothing can be created under .regions (read-only metadata)".into(),
            ));
        }
        if parent == ROOT_INO && name == pseudo::DIR_NAME {
            return Err(FsError::Exists(format!(
                "{} is reserved for region metadata",
                pseudo::DIR_NAME
            )));
        }
        Ok(())
    }

    /// Creates a region (a regular file), or a FIFO, socket or device node
    /// (a namespace entry without region memory: the kernel of the host that
    /// opens it serves it, so a FIFO connects processes of one host).
    pub fn mknod(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
    ) -> FsResult<v1::Attr> {
        self.check_creatable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let asked = Instant::now();
        let name = wire(name)?;
        let name: &str = &name;
        let bits = mode & !umask & 0o7777;
        if let Some(kind) = node_kind(mode) {
            let attr =
                self.manager()
                    .make_node(&caller, parent, name, kind, bits, u64::from(rdev))?;
            self.note_leases(&caller, asked, Some(parent), &attr);
            return Ok(attr);
        }
        if mode & libc::S_IFMT != libc::S_IFREG && mode & libc::S_IFMT != 0 {
            return Err(FsError::Invalid(format!(
                "mknod of file type {:o}: regions makes regular files, FIFOs, sockets and device nodes",
                mode & libc::S_IFMT
            )));
        }
        let defaults = self.thread_defaults.overrides(ctx.pid);
        let attr = self.manager().create(v1::CreateRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            mode: bits,
            attrs: defaults,
            preallocate: 0,
        })?;
        self.note_leases(&caller, asked, Some(parent), &attr);
        self.created(&caller, parent, name, &attr);
        Ok(attr)
    }

    /// Bookkeeping of a new region: the kernel learns it with size 0, and a
    /// non-persistent one is watched for its owner's exit.
    pub(super) fn created(&self, caller: &v1::Caller, parent: u64, name: &str, attr: &v1::Attr) {
        {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(attr.ino).or_default();
            st.kernel_size = attr.size;
            st.seen = Some(stamp(attr));
            st.attr = Some((attr.clone(), Instant::now()));
            st.created_here = Some(Instant::now());
        }
        if let Ok(mut u) = self.unlinked.lock() {
            u.remove(&attr.ino);
        }
        let persistent = attr.region_attrs.as_ref().is_some_and(|a| a.persistent);
        if let Some(w) = &self.owners
            && !persistent
            && caller.pid != 0
        {
            w.watch(Owned {
                ino: attr.ino,
                parent,
                name: name.to_owned(),
                pid: caller.pid,
            });
        }
    }

    /// Creates and opens a region.
    pub fn create(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
    ) -> FsResult<(v1::Attr, Opened)> {
        self.check_creatable(ctx, parent, name)?;
        self.count_open();
        let caller = self.caller(ctx);
        let asked = Instant::now();
        let name = wire(name)?;
        let name: &str = &name;
        let mode = mode & !umask & 0o7777;
        let acc = flags & libc::O_ACCMODE;
        let write = acc != libc::O_RDONLY;
        // A new file may be opened as asked even if its mode forbids it
        // (open(O_CREAT|O_WRONLY, 0444)): create it usable, then set the mode.
        let needed = (if write { 2 } else { 0 }) | (if acc != libc::O_WRONLY { 4 } else { 0 });
        let create_mode = if caller.uid != 0 && (mode >> 6) & needed != needed {
            mode | (needed << 6)
        } else {
            mode
        };
        let defaults = self.thread_defaults.overrides(ctx.pid);
        // One manager request creates and opens it; a writer gets its first
        // chunk with it (freed at close if nothing was written).
        let create = v1::CreateRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            mode: create_mode,
            attrs: defaults,
            preallocate: if write { CHUNK_SIZE } else { 0 },
        };
        let region = self
            .client
            .create_open_as(create, write)?
            .with_size_policy(SizePolicy::Lazy);
        let region = if write {
            let ino = region.ino();
            region.with_posted_writes(ino)
        } else {
            region
        };
        let mut attr = region.opened_attr().clone();
        self.note_leases(&caller, asked, Some(parent), &attr);
        self.created(&caller, parent, name, &attr);
        if create_mode != mode {
            // The open write handle keeps its rights after the chmod.
            let change = SetAttrIn {
                mode: Some(mode),
                ..SetAttrIn::default()
            };
            match self.manager().setattr(&caller, attr.ino, &change) {
                Ok(a) => attr = a,
                Err(e) => {
                    tracing::warn!(ino = attr.ino, error = %e, "cannot set the mode of a new region")
                }
            }
        }
        {
            let mut inodes = self.lock_inodes();
            let st = inodes.entry(attr.ino).or_default();
            st.cached_opens += 1;
            if write {
                // Released with the handle (a new region has no fill to stop).
                st.writers += 1;
            }
        }
        // A writer's release keeps what it knows of the new region for leased opens, unless
        // the mode was set after the open (its placement has the mode it was created with).
        let how = if write {
            Opening::Writer(self.placements.writer(
                attr.ino,
                self.attr_chain(attr.ino),
                create_mode == mode,
            ))
        } else {
            Opening::Plain
        };
        let fh = self.add_region_handle(attr.ino, caller, region, (write, how), IoMode::Cached);
        Ok((
            attr,
            Opened {
                fh,
                keep_cache: false,
                direct_io: false,
                passthrough: false,
                backing: None,
            },
        ))
    }

    /// Opens a region, retrying a moment on `ETXTBSY` (see
    /// [`FsOptions::busy_retry`]).
    pub(super) fn open_region(
        &self,
        caller: &v1::Caller,
        ino: u64,
        write: bool,
    ) -> FsResult<Region> {
        let deadline = Instant::now() + self.options.busy_retry;
        loop {
            match self.client.open_as(caller, ino, write) {
                Ok(r) if write => {
                    return Ok(r.with_size_policy(SizePolicy::Lazy).with_posted_writes(ino));
                }
                Ok(r) => return Ok(r.with_size_policy(SizePolicy::Lazy)),
                Err(e) if e.errno() == libc::ETXTBSY && write && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Removes region `name`.
    pub fn unlink(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<()> {
        self.check_removable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let name = wire(name)?;
        let name: &str = &name;
        // A watched region (its owner lives) stops being watched with its
        // last name; one that has other names stays watched, by inode: its
        // lifetime is the region's, not this name's.
        let watched = match &self.owners {
            Some(w) if w.watches_name(parent, name) => {
                self.manager().lookup(&caller, parent, name).ok()
            }
            _ => None,
        };
        let removal = self.placements.removal();
        self.pin_before_removal(&caller, parent, name);
        let removed = self.manager().unlink(&caller, parent, name)?;
        // Nothing this mount knew of the region serves a leased open any more.
        drop(self.placements.change(removed.ino, false));
        drop(removal);
        self.forget_cached_attrs();
        if removed.nlink == 0
            && self.handles_of(removed.ino).is_empty()
            && let Ok(mut u) = self.unlinked.lock()
        {
            u.insert(removed.ino);
        }
        if let (Some(w), Some(a)) = (&self.owners, watched)
            && a.nlink <= 1
        {
            w.forget(a.ino);
        }
        Ok(())
    }

    pub(super) fn check_removable(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
    ) -> FsResult<()> {
        if pseudo::is_pseudo(parent) || (parent == ROOT_INO && name == pseudo::DIR_NAME) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied(
                ".regions is read-only region metadata".into(),
            ));
        }
        Ok(())
    }

    /// Drops the attributes kept for answering the kernel while writing: a
    /// name went away or moved, so link counts and times changed.
    pub(super) fn forget_cached_attrs(&self) {
        self.placements.all_attrs_changed();
        for st in self.lock_inodes().values_mut() {
            st.attr = None;
        }
    }

    /// Removes directory `name` (ENOTEMPTY unless empty).
    pub fn rmdir(&self, ctx: &RequestCtx, parent: u64, name: &OsStr) -> FsResult<()> {
        self.check_removable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let name = wire(name)?;
        let before = self.manager().lookup(&caller, parent, &name).ok();
        self.manager().rmdir(&caller, parent, &name)?;
        if let Some(mut a) = before
            && let Ok(mut r) = self.removed_dirs.lock()
        {
            a.nlink = 0;
            r.insert(a.ino, a);
        }
        Ok(())
    }

    /// Renames (renameat2 flags: RENAME_NOREPLACE, RENAME_EXCHANGE).
    pub fn rename(
        &self,
        ctx: &RequestCtx,
        (parent, name): (u64, &OsStr),
        (new_parent, new_name): (u64, &OsStr),
        flags: u32,
    ) -> FsResult<()> {
        self.check_removable(ctx, parent, name)?;
        self.check_removable(ctx, new_parent, new_name)?;
        const KNOWN: u32 = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE;
        if flags & !KNOWN != 0 {
            return Err(FsError::Invalid(format!(
                "rename flags {flags:#x}: regions supports RENAME_NOREPLACE and RENAME_EXCHANGE only"
            )));
        }
        let caller = self.caller(ctx);
        let (name, new_name) = (wire(name)?, wire(new_name)?);
        let (name, new_name) = (&*name, &*new_name);
        let moved = if self.owners.is_some() {
            self.manager().lookup(&caller, parent, name).ok()
        } else {
            None
        };
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        // The name it lands on may be a region's last: what this mount knows of that region
        // is void after the rename, and its leased opens take a handle before.
        let removal = (!exchange).then(|| self.placements.removal());
        let replaced = if self.owners.is_some() || !exchange {
            match self.manager().lookup(&caller, new_parent, new_name) {
                Ok(b) => Some(b),
                Err(e) if e.errno() == libc::ENOENT => None,
                Err(_) => {
                    // Which region the name names is unknown: every leased open holds on, and
                    // nothing known of any region serves another.
                    if !exchange {
                        self.pin_all_leased();
                        self.placements.forget_all();
                    }
                    None
                }
            }
        } else {
            None
        };
        if !exchange && let Some(b) = &replaced {
            self.pin_leased(b.ino);
        }
        self.manager()
            .rename(&caller, (parent, name), (new_parent, new_name), flags)?;
        if !exchange && let Some(b) = &replaced {
            drop(self.placements.change(b.ino, false));
        }
        drop(removal);
        self.forget_cached_attrs();
        if let Some(w) = &self.owners {
            if let Some(a) = &moved {
                w.renamed(a.ino, new_parent, new_name);
            }
            if let Some(b) = &replaced {
                if flags & libc::RENAME_EXCHANGE != 0 {
                    w.renamed(b.ino, parent, name);
                } else if b.nlink <= 1 {
                    w.forget(b.ino);
                }
            }
        }
        if let Some(a) = moved.filter(is_dir) {
            self.note_dir(&a, Some(new_parent));
        }
        Ok(())
    }

    /// Makes `name` in `parent` a symbolic link to `target` (kept at the
    /// manager: every host follows it).
    pub fn symlink(
        &self,
        ctx: &RequestCtx,
        parent: u64,
        name: &OsStr,
        target: &Path,
    ) -> FsResult<v1::Attr> {
        self.check_creatable(ctx, parent, name)?;
        let caller = self.caller(ctx);
        let asked = Instant::now();
        let name = wire(name)?;
        let attr = self
            .manager()
            .symlink(&caller, parent, &name, target.as_os_str().as_bytes())?;
        self.note_leases(&caller, asked, Some(parent), &attr);
        Ok(attr)
    }

    /// The target of symbolic link `ino`.
    pub fn readlink(&self, ctx: &RequestCtx, ino: u64) -> FsResult<Vec<u8>> {
        if pseudo::is_pseudo(ino) {
            return Err(FsError::Invalid(format!(
                "inode {ino} is region metadata, not a symbolic link"
            )));
        }
        Ok(self.manager().readlink(&self.caller(ctx), ino)?)
    }

    /// Gives `ino` the further name `new_name` in `new_parent`.
    pub fn link(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        new_parent: u64,
        new_name: &OsStr,
    ) -> FsResult<v1::Attr> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied(
                "region metadata files cannot be linked".into(),
            ));
        }
        self.check_creatable(ctx, new_parent, new_name)?;
        let caller = self.caller(ctx);
        let asked = Instant::now();
        let new_name = wire(new_name)?;
        let attr = self.manager().link(&caller, ino, new_parent, &new_name)?;
        self.note_leases(&caller, asked, Some(new_parent), &attr);
        // The link count changed: answers kept for the kernel are stale.
        self.forget_cached_attrs();
        Ok(self.with_local_size(attr))
    }

    /// Checks that a directory may be opened (pseudo directories: root only).
    pub fn opendir(&self, ctx: &RequestCtx, ino: u64) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
        }
        Ok(())
    }

    /// Entries of directory `ino` after cookie `offset`; `plus` when the
    /// kernel will remember the attributes (readdirplus).
    pub fn readdir(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        offset: u64,
        plus: bool,
    ) -> FsResult<Vec<DirEntryOut>> {
        if let Some(node) = Node::from_ino(ino) {
            Self::root_only(ctx)?;
            return self.pseudo_readdir(node, offset);
        }
        let parent = self
            .dirs
            .lock()
            .ok()
            .and_then(|d| d.get(&ino).and_then(|i| i.parent))
            .unwrap_or(ino);
        let mut out = self.dots(ino, parent, offset);
        let reply = self.manager().readdir(
            &self.caller(ctx),
            ino,
            if offset < 3 { 0 } else { offset },
            READDIR_BATCH,
        )?;
        for e in reply.entries {
            let Some(attr) = e.attr else { continue };
            if ino == ROOT_INO && e.name == pseudo::DIR_NAME {
                continue;
            }
            if plus {
                if is_dir(&attr) {
                    self.note_dir(&attr, Some(ino));
                } else {
                    self.note_reply(&attr);
                }
            }
            out.push(DirEntryOut {
                ino: attr.ino,
                cookie: e.offset,
                name: names::from_wire(&e.name),
                kind: attr.kind(),
                attr: Some(attr),
            });
        }
        Ok(out)
    }

    pub(super) fn dots(&self, ino: u64, parent: u64, offset: u64) -> Vec<DirEntryOut> {
        let mut out = Vec::new();
        for (cookie, name, i) in [(1, ".", ino), (2, "..", parent)] {
            if offset < cookie {
                out.push(DirEntryOut {
                    ino: i,
                    cookie,
                    name: name.into(),
                    kind: FileKind::Directory,
                    attr: None,
                });
            }
        }
        out
    }

    /// File-system statistics (cluster capacity and free memory).
    pub fn statfs(&self, ctx: &RequestCtx) -> FsResult<StatFs> {
        let r = self.manager().statfs(&self.caller(ctx))?;
        let bsize = r.block_size.max(512);
        Ok(StatFs {
            blocks: r.total_bytes / u64::from(bsize),
            bfree: r.free_bytes / u64::from(bsize),
            bavail: r.free_bytes / u64::from(bsize),
            files: r.inodes + r.free_inodes,
            ffree: r.free_inodes,
            bsize,
            namelen: r.max_name_len.max(1),
        })
    }

    /// access(2): the manager decides.
    pub fn access(&self, ctx: &RequestCtx, ino: u64, mask: u32) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            if mask & libc::W_OK as u32 != 0 {
                return Err(FsError::Denied("region metadata is read-only".into()));
            }
            return Ok(());
        }
        Ok(self.manager().access(&self.caller(ctx), ino, mask)?)
    }

    /// A reply is about to hand inode `ino` to the kernel (an entry of a lookup, create,
    /// mkdir, mknod, symlink, link or readdirplus): one more lookup it will forget.
    pub fn handing(&self, ino: u64) {
        if !pseudo::is_pseudo(ino) {
            self.lookups.handed(ino);
        }
    }

    /// The kernel forgot `nlookup` of its lookups of `ino` (`crate::lookup_counts`).
    pub fn forget(&self, ino: u64, nlookup: u64) {
        if pseudo::is_pseudo(ino) {
            return;
        }
        if !self.lookups.forgot(ino, nlookup) {
            // A late forget of an inode the kernel evicted: the one it holds now was handed
            // out since, and what is kept about it stays.
            return;
        }
        // The kernel dropped the inode, and every entry naming it with it.
        if let Ok(mut e) = self.leased_entries.lock() {
            e.remove(&ino);
        }
        let open = !self.handles_of(ino).is_empty();
        if !open {
            let state = self.lock_inodes().remove(&ino);
            // A fill its last reader stopped may still have a store in flight: it must not
            // land in an inode the kernel makes anew for this number.
            if let Some(f) = state.and_then(|st| st.fill)
                && let Err(e) = f.wait_stopped(ino)
            {
                tracing::warn!(ino, error = %e, "a background fill did not stop");
            }
        }
        if let Ok(mut d) = self.dirs.lock()
            && let Some(info) = d.remove(&ino)
        {
            self.uncount_cached(info.cached.len());
        }
        if let Ok(mut r) = self.removed_dirs.lock() {
            r.remove(&ino);
        }
        if let Ok(mut u) = self.unlinked.lock() {
            u.remove(&ino);
        }
    }
}

/// Whether the kernel may cache entry `name` of `parent`, given what the mount knows of
/// `parent` (`None`: nothing, so its entries are cached): not in the `.regions` tree, and only
/// in directories everyone may search.
fn cacheable_in(parent: u64, name: &OsStr, dir: Option<&DirInfo>) -> bool {
    if pseudo::is_pseudo(parent) || (parent == ROOT_INO && name == pseudo::DIR_NAME) {
        return false;
    }
    dir.is_none_or(|i| i.mode & 0o111 == 0o111)
}
