//! Leased opens (docs/SEMANTICS.md, "Leased opens"): a read-only open of a region whose
//! attributes this mount holds a cache lease on, answered from a placement learned under
//! that lease (`crate::placements`) without asking the manager, and the attributes the
//! kernel asks for again after a close, answered the same way.
//!
//! Such an open holds no handle at the manager, so nothing would keep the region's memory
//! if its last name went. Before anything that can remove the region goes ahead the leased
//! opens of the region take a handle of their own ([`RegionFs::pin_leased`]): a recall of
//! its attributes (which every unlink, rename over it, owner exit, lease expiry and freeing
//! close elsewhere sends first), this mount's own unlink or rename over it, and the end of
//! the session (again once a new one starts, for those whose handle could not be taken).

use super::*;
use crate::cache_leases::Covered;
use crate::placements::LeasedCheck;

/// Whether `caller` may open a region with attributes `attr` for reading (the manager's
/// check for a mount's callers: root always; else the owner's, the group's or the others'
/// read bit).
pub(super) fn may_read(caller: &v1::Caller, attr: &v1::Attr) -> bool {
    if caller.uid == 0 {
        return true;
    }
    let bits = if caller.uid == attr.uid {
        attr.mode >> 6
    } else if caller.gid == attr.gid || caller.groups.contains(&attr.gid) {
        attr.mode >> 3
    } else {
        attr.mode
    };
    bits & 4 != 0
}

/// `attr`'s mtime, ordered.
fn mtime(attr: &v1::Attr) -> (i64, u32) {
    attr.mtime.map_or((0, 0), |t| (t.sec, t.nsec))
}

impl RegionFs {
    /// The chain of the lease this mount holds on `ino`'s attributes now.
    pub(super) fn attr_chain(&self, ino: u64) -> Option<(u64, u64)> {
        self.cache_leases.chain(Covered::Attrs(ino))
    }

    /// The attributes of `ino` this mount holds under its lease, for the kernel's getattr
    /// (after a close in writeback mode the kernel asks again at the next `stat`).
    pub(super) fn leased_attr(&self, ino: u64) -> Option<v1::Attr> {
        self.placements.attr(ino, self.attr_chain(ino))
    }

    /// A read-only region for `caller`'s open of `ino` from a placement this mount holds
    /// under a lease, with what [`RegionFs::confirm_leased`] checks once the open is
    /// registered; `None` when the manager must be asked (no placement under the lease held
    /// now, or one the caller may not read: the manager words the refusal).
    pub(super) fn open_leased(
        &self,
        caller: &v1::Caller,
        ino: u64,
    ) -> Option<(Region, LeasedCheck)> {
        let leased = self.placements.placement(ino, self.attr_chain(ino))?;
        if !leased
            .placement
            .attr
            .as_ref()
            .is_some_and(|a| may_read(caller, a))
        {
            return None;
        }
        match self
            .client
            .open_placed(caller, v1::RegionInfo::clone(&leased.placement))
        {
            Ok(region) => Some((region.with_size_policy(SizePolicy::Lazy), leased.check)),
            Err(e) => {
                tracing::debug!(ino, error = %e, "a leased open fell back to the manager");
                None
            }
        }
    }

    /// Once the leased open `fh` (`check`) is registered as one of this mount's handles: if
    /// the lease, the placement or a removal changed meanwhile, the open takes a handle at
    /// the manager before it is answered, as the recall or this mount's own change would
    /// have made it. `Err(Stale)` when it cannot (the region went meanwhile): the kernel
    /// looks the name up again.
    pub(super) fn confirm_leased(&self, fh: u64, check: &LeasedCheck) -> FsResult<()> {
        let ino = check.ino();
        if self.placements.fenced() {
            return Err(FsError::Fenced(format!(
                "this host's lease ended while region {ino} was being opened: open it again                  once the host is back"
            )));
        }
        if !self.placements.outdated(check, self.attr_chain(ino)) {
            return Ok(());
        }
        self.pin_leased(ino);
        let pinned = self.handle(fh).is_ok_and(|h| match &h.body {
            Body::Region(r) => r.pin.lock().is_ok_and(|p| p.is_some()),
            Body::Pseudo(_) => false,
        });
        if pinned {
            Ok(())
        } else {
            Err(FsError::Stale(format!(
                "region {ino} changed on this or another host while it was opened: open it again"
            )))
        }
    }

    /// The leased opens of `ino` that hold no handle at the manager take one (one for those
    /// it finds, kept until the last of them is released): the region may lose its last
    /// name next, and its memory must stay while they read it. Opened as this mount itself,
    /// which checked their permission when they were opened. When the region is gone
    /// already, those opens are fenced (`EIO`): their memory may be another region's now.
    pub(super) fn pin_leased(&self, ino: u64) {
        let unpinned: Vec<Arc<Handle>> = self
            .handles_of(ino)
            .into_iter()
            .filter(|h| match &h.body {
                Body::Region(r) => r.needs_pin(),
                Body::Pseudo(_) => false,
            })
            .collect();
        if unpinned.is_empty() {
            return;
        }
        let pin = match self.client.open_as(self.client.caller(), ino, false) {
            Ok(region) => Arc::new(region),
            Err(e) => {
                // Only the manager's word that the region is gone fences them (not a manager
                // out of reach: the next session takes the handle, in time).
                let gone = matches!(e.errno(), libc::ENOENT | libc::ESTALE);
                if gone {
                    for h in &unpinned {
                        if let Body::Region(r) = &h.body {
                            r.fenced.store(true, Ordering::Relaxed);
                        }
                    }
                }
                tracing::warn!(ino, opens = unpinned.len(), error = %e, fenced = gone, "cannot take a handle for leased opens of a region");
                return;
            }
        };
        for h in unpinned {
            if let Body::Region(r) = &h.body
                && let Ok(mut p) = r.pin.lock()
                && p.is_none()
            {
                *p = Some(Arc::clone(&pin));
            }
        }
        // A handle none took (they went, or took another meanwhile) is closed off this
        // thread: the recall thread must not wait on a close that may recall this mount.
        self.closer.close(pin);
    }

    /// [`RegionFs::pin_leased`] for every region with leased opens that hold no handle (the
    /// session ended, or a new one began after one whose end could not reach the manager).
    pub(super) fn pin_all_leased(&self) {
        for ino in self.leased_unpinned() {
            self.pin_leased(ino);
        }
    }

    /// Regions with leased opens that hold no handle.
    fn leased_unpinned(&self) -> HashSet<u64> {
        self.handles
            .read()
            .map(|h| {
                h.values()
                    .filter(|x| matches!(&x.body, Body::Region(r) if r.needs_pin()))
                    .map(|x| x.ino)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Before this mount removes name `name` of `parent` (unlink, or a rename over it),
    /// within its [`crate::placements::Removal`]: the leased opens of the region it names
    /// take a handle (the manager is asked which region that is only when some leased open
    /// holds none; when it cannot say, every such open takes one).
    pub(super) fn pin_before_removal(&self, caller: &v1::Caller, parent: u64, name: &str) {
        if self.leased_unpinned().is_empty() {
            return;
        }
        match self.manager().lookup(caller, parent, name) {
            Ok(a) => self.pin_leased(a.ino),
            Err(e) if e.errno() == libc::ENOENT => {}
            Err(_) => self.pin_all_leased(),
        }
    }

    /// A writer's handle of `ino` is released, having published what it wrote: when it was
    /// this mount's last writer and nothing else of this mount changed the region since it
    /// opened, what it knew of the placement is kept for leased opens, if the manager's size
    /// is the size it knew (another handle of this mount may have published more).
    pub(super) fn writer_released(
        &self,
        ino: u64,
        writer: &crate::placements::Writer,
        region: &Region,
    ) {
        let published = self
            .lock_inodes()
            .get(&ino)
            .and_then(|st| st.attr.clone())
            .map(|(a, _)| a)
            .filter(|a| a.ino == ino);
        let mut placement = region.placement();
        match (placement.as_mut().and_then(|p| p.attr.as_mut()), published) {
            (Some(attr), Some(published)) if published.size == attr.size => {
                // The attributes the last publication left (its mtime is past the open's).
                if mtime(&published) >= mtime(attr) {
                    *attr = published;
                }
            }
            // None recorded (a link count changed since): the writer's own view.
            (Some(_), None) => {}
            _ => placement = None,
        }
        writer.released(placement, self.attr_chain(ino));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_permission_is_the_managers() {
        let attr = v1::Attr {
            uid: 10,
            gid: 20,
            mode: 0o640,
            ..v1::Attr::default()
        };
        let caller = |uid, gid, groups: Vec<u32>| v1::Caller {
            uid,
            gid,
            groups,
            ..v1::Caller::default()
        };
        assert!(may_read(&caller(0, 0, vec![]), &attr));
        assert!(may_read(&caller(10, 99, vec![]), &attr));
        assert!(may_read(&caller(11, 20, vec![]), &attr));
        assert!(may_read(&caller(11, 1, vec![20]), &attr));
        assert!(!may_read(&caller(11, 1, vec![]), &attr));
        let owner_denied = v1::Attr {
            mode: 0o044,
            ..attr
        };
        assert!(
            !may_read(&caller(10, 20, vec![]), &owner_denied),
            "the owner's bits decide for the owner"
        );
    }
}
