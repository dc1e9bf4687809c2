//! Leased opens (docs/SEMANTICS.md, "Cache leases"): a read-only open of a region whose
//! attributes this mount holds a cache lease on, answered without asking the manager.
//!
//! While the lease on a region's attributes holds without a gap (one chain, see
//! `crate::cache_leases`), no other mount or process changed the region: every change
//! recalls the lease first. So a placement (size, map) this mount learned under that chain
//! is still the region's, unless this mount changed the region itself (its own changes keep
//! its leases), and an open needs only the permission check, made here on the attributes
//! the lease covers. The placement comes from the manager's reply to a read open, or from
//! this mount's last writer when it releases.
//!
//! Such an open holds no handle at the manager, so nothing would keep the region's memory
//! if its last name went: before anything that can remove the region goes ahead (a recall
//! of its attributes, which every unlink, rename over it and owner exit elsewhere sends;
//! this mount's own unlink or rename; the end of the session) the leased opens of the
//! region take a handle of their own ([`RegionFs::pin_leased`]).

use super::*;
use crate::cache_leases::Covered;

/// Placements kept at most (a mount reading more regions than this within a term opens
/// the others at the manager).
const PLACEMENTS_KEPT: usize = 1 << 14;

/// This mount's own changes remembered by inode before they are forgotten wholesale (see
/// [`LeasedOpens::changed`]).
const CHANGES_KEPT: usize = 1 << 12;

/// The placements leased opens are made from, and this mount's own changes that outdate
/// them.
#[derive(Default)]
pub(super) struct LeasedOpens {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Inode → its placement, learned under lease chain `chain`.
    placements: HashMap<u64, (v1::RegionInfo, u64)>,
    /// Counts this mount's own changes of regions.
    count: u64,
    /// Inode → the count at this mount's last change of it.
    changed: HashMap<u64, u64>,
    /// Inode → this mount's writers of it (opening or open): no placement is kept meanwhile.
    writing: HashMap<u64, u32>,
    /// Inode → its attributes, learned under lease chain `chain`, answering the kernel's
    /// getattrs.
    attrs: HashMap<u64, (v1::Attr, u64)>,
    /// Inode → the count at this mount's last change of its attributes alone (times,
    /// extended attributes, links): attributes learned before are void, placements not.
    attrs_changed: HashMap<u64, u64>,
    /// Attribute changes at or below this count were forgotten.
    attrs_floor: u64,
    /// Changes at or below this count were forgotten: a ticket from before it is void.
    floor: u64,
}

/// Taken before a request whose reply, or a writer's handle whose release, may leave a
/// placement (see [`LeasedOpens::keep`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Ticket {
    ino: u64,
    /// The change count then.
    at: u64,
    /// The chain of the lease held on the region's attributes then.
    chain: Option<(u64, u64)>,
}

impl LeasedOpens {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ticket for a placement of `ino` learned from now on, while the lease chain
    /// `chain` holds.
    pub(super) fn ticket(&self, ino: u64, chain: Option<(u64, u64)>) -> Ticket {
        Ticket {
            ino,
            at: self.lock().count,
            chain,
        }
    }

    /// This mount changes region `ino` (opens it for writing, sets its size or mode,
    /// removes a name of it): its placement is void, and so is every ticket taken before.
    pub(super) fn changed(&self, ino: u64) {
        let mut s = self.lock();
        s.count += 1;
        let count = s.count;
        if s.changed.len() >= CHANGES_KEPT {
            s.changed.clear();
            s.floor = count;
        }
        s.changed.insert(ino, count);
        s.placements.remove(&ino);
        s.attrs.remove(&ino);
    }

    /// Whether this mount changed the region of `ticket` since the ticket was taken, or
    /// writes it now.
    fn changed_since(s: &Inner, ticket: &Ticket) -> bool {
        ticket.at < s.floor
            || s.changed.get(&ticket.ino).is_some_and(|c| *c > ticket.at)
            || s.writing.contains_key(&ticket.ino)
    }

    /// A writer of `ino` opens here (a change, see [`LeasedOpens::changed`]): until
    /// [`Writer::released`] (or its drop), no placement of the region is kept. `chain`: the
    /// lease chain held on the region's attributes now.
    pub(super) fn writer(self: &Arc<Self>, ino: u64, chain: Option<(u64, u64)>) -> Writer {
        self.changed(ino);
        let mut s = self.lock();
        *s.writing.entry(ino).or_default() += 1;
        Writer {
            opens: Arc::clone(self),
            ticket: Ticket {
                ino,
                at: s.count,
                chain,
            },
            done: AtomicBool::new(false),
        }
    }

    /// One writer of `ino` fewer; whether none is left.
    fn writer_gone(&self, ino: u64) -> bool {
        let mut s = self.lock();
        match s.writing.get_mut(&ino) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                s.writing.remove(&ino);
                true
            }
        }
    }

    /// Whether this mount changed the attributes of the ticket's region since the ticket
    /// was taken.
    fn attrs_changed_since(s: &Inner, ticket: &Ticket) -> bool {
        Self::changed_since(s, ticket)
            || ticket.at < s.attrs_floor
            || s.attrs_changed
                .get(&ticket.ino)
                .is_some_and(|c| *c > ticket.at)
    }

    /// The chain a reply learned under, if the lease chain of the region's attributes now
    /// (`chain`) covers it: the chain held when the ticket was taken and holds still, or it
    /// began with the grant `granted` the reply carried.
    fn covering(ticket: &Ticket, chain: Option<(u64, u64)>, granted: u64) -> Option<u64> {
        let (now, first) = chain?;
        (ticket.chain.is_some_and(|(then, _)| then == now) || (granted != 0 && first == granted))
            .then_some(now)
    }

    /// Keeps `placement` of the ticket's region, learned since the ticket was taken, if the
    /// lease chain now (`chain`) covers it (see [`LeasedOpens::covering`]); its attributes
    /// too (see [`LeasedOpens::attr`]). Not when this mount changed the region since.
    pub(super) fn keep(
        &self,
        ticket: &Ticket,
        placement: v1::RegionInfo,
        chain: Option<(u64, u64)>,
        granted: u64,
    ) {
        let Some(now) = Self::covering(ticket, chain, granted) else {
            return;
        };
        let mut s = self.lock();
        if Self::changed_since(&s, ticket) {
            return;
        }
        if !Self::attrs_changed_since(&s, ticket)
            && let Some(attr) = &placement.attr
        {
            Self::insert_attr(&mut s, ticket.ino, attr.clone(), now);
        }
        if s.placements.len() >= PLACEMENTS_KEPT && !s.placements.contains_key(&ticket.ino) {
            s.placements.clear();
        }
        s.placements.insert(ticket.ino, (placement, now));
    }

    fn insert_attr(s: &mut Inner, ino: u64, attr: v1::Attr, chain: u64) {
        if s.attrs.len() >= PLACEMENTS_KEPT && !s.attrs.contains_key(&ino) {
            s.attrs.clear();
        }
        s.attrs.insert(ino, (attr, chain));
    }

    /// Keeps the attributes `attr` of the ticket's region, learned since the ticket was
    /// taken, if the lease chain now covers them and this mount changed neither the region
    /// nor its attributes since.
    pub(super) fn keep_attr(&self, ticket: &Ticket, attr: &v1::Attr, chain: Option<(u64, u64)>) {
        let Some(now) = Self::covering(ticket, chain, attr.attr_lease) else {
            return;
        };
        let mut s = self.lock();
        if !Self::attrs_changed_since(&s, ticket) {
            Self::insert_attr(&mut s, ticket.ino, attr.clone(), now);
        }
    }

    /// The attributes of `ino` if they were learned under lease chain `chain` and this
    /// mount does not write the region now.
    pub(super) fn attr(&self, ino: u64, chain: Option<(u64, u64)>) -> Option<v1::Attr> {
        let (now, _) = chain?;
        let s = self.lock();
        if s.writing.contains_key(&ino) {
            return None;
        }
        let (attr, learned) = s.attrs.get(&ino)?;
        (*learned == now).then(|| attr.clone())
    }

    /// This mount changes the attributes of `ino` alone (times, extended attributes).
    pub(super) fn attrs_changed(&self, ino: u64) {
        let mut s = self.lock();
        s.count += 1;
        let count = s.count;
        if s.attrs_changed.len() >= CHANGES_KEPT {
            s.attrs_changed.clear();
            s.attrs_floor = count;
        }
        s.attrs_changed.insert(ino, count);
        s.attrs.remove(&ino);
    }

    /// This mount changes link counts of regions it does not name (link, unlink, rename):
    /// no attributes learned before are of use.
    pub(super) fn all_attrs_changed(&self) {
        let mut s = self.lock();
        s.count += 1;
        s.attrs_floor = s.count;
        s.attrs_changed.clear();
        s.attrs.clear();
    }

    /// The placement of `ino` if it was learned under lease chain `chain`, with a ticket
    /// to check later that this mount did not change the region meanwhile.
    pub(super) fn placement(
        &self,
        ino: u64,
        chain: Option<(u64, u64)>,
    ) -> Option<(v1::RegionInfo, Ticket)> {
        let (now, _) = chain?;
        let s = self.lock();
        let (placement, learned) = s.placements.get(&ino)?;
        (*learned == now).then(|| {
            (
                placement.clone(),
                Ticket {
                    ino,
                    at: s.count,
                    chain,
                },
            )
        })
    }

    /// Whether this mount changed the ticket's region since it was taken.
    pub(super) fn outdated(&self, ticket: &Ticket) -> bool {
        Self::changed_since(&self.lock(), ticket)
    }

    /// The lease on `ino`'s attributes was recalled: its placement is of no use.
    pub(super) fn forget(&self, ino: u64) {
        let mut s = self.lock();
        s.placements.remove(&ino);
        s.attrs.remove(&ino);
    }

    /// The session ended: no placement is of use.
    pub(super) fn forget_all(&self) {
        let mut s = self.lock();
        s.placements.clear();
        s.attrs.clear();
    }
}

/// `attr`'s mtime, ordered.
fn mtime(attr: &v1::Attr) -> (i64, u32) {
    attr.mtime.map_or((0, 0), |t| (t.sec, t.nsec))
}

/// One writer of a region in this mount (see [`LeasedOpens::writer`]).
pub(super) struct Writer {
    opens: Arc<LeasedOpens>,
    ticket: Ticket,
    done: AtomicBool,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("ticket", &self.ticket)
            .finish()
    }
}

impl Writer {
    /// The writer's handle is released: when it was this mount's last writer of the region
    /// and nothing else of this mount changed it since the writer opened, `placement` (what
    /// the writer knew, `None`: nothing sure) is kept under the lease chain held now
    /// (`chain`).
    pub(super) fn released(&self, placement: Option<v1::RegionInfo>, chain: Option<(u64, u64)>) {
        if self.done.swap(true, Ordering::Relaxed) {
            return;
        }
        if self.opens.writer_gone(self.ticket.ino)
            && let Some(placement) = placement
        {
            self.opens.keep(&self.ticket, placement, chain, 0);
        }
    }
}

impl Drop for Writer {
    /// A writer that never got a handle (its open failed) is gone too.
    fn drop(&mut self) {
        if !self.done.swap(true, Ordering::Relaxed) {
            self.opens.writer_gone(self.ticket.ino);
        }
    }
}

/// Whether `caller` may open a region with attributes `attr` for reading (the manager's
/// check: root always; else the owner's, the group's or the others' read bit).
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

impl RegionFs {
    /// The chain of the lease this mount holds on `ino`'s attributes now.
    pub(super) fn attr_chain(&self, ino: u64) -> Option<(u64, u64)> {
        self.cache_leases.chain(Covered::Attrs(ino))
    }

    /// The attributes of `ino` this mount holds under its lease, for the kernel's getattr
    /// (after a close in writeback mode the kernel asks again at the next `stat`).
    pub(super) fn leased_attr(&self, ino: u64) -> Option<v1::Attr> {
        self.leased_opens.attr(ino, self.attr_chain(ino))
    }

    /// A read-only region for `caller`'s open of `ino` from a placement this mount holds
    /// under a lease, with the ticket [`RegionFs::confirm_leased`] checks once the open is
    /// registered; `None` when the manager must be asked (no placement under the lease held
    /// now, or one the caller may not read: the manager words the refusal).
    pub(super) fn open_leased(
        &self,
        caller: &v1::Caller,
        ino: u64,
    ) -> FsResult<Option<(Region, Ticket)>> {
        let Some((placement, ticket)) = self.leased_opens.placement(ino, self.attr_chain(ino))
        else {
            return Ok(None);
        };
        if !placement.attr.as_ref().is_some_and(|a| may_read(caller, a)) {
            // The manager words the refusal (and it is as rare as a denied open).
            return Ok(None);
        }
        match self.client.open_placed(caller, placement) {
            Ok(region) => Ok(Some((region.with_size_policy(SizePolicy::Lazy), ticket))),
            Err(e) => {
                tracing::debug!(ino, error = %e, "a leased open fell back to the manager");
                Ok(None)
            }
        }
    }

    /// Once a leased open (`ticket`) of `ino` is registered as one of this mount's
    /// handles: if the lease or the placement went meanwhile, the open takes a handle at
    /// the manager now, as the recall or this mount's own change would have made it.
    pub(super) fn confirm_leased(&self, ticket: &Ticket) {
        if self.leased_opens.outdated(ticket) || self.attr_chain(ticket.ino) != ticket.chain {
            self.pin_leased(ticket.ino);
        }
    }

    /// The leased opens of `ino` that hold no handle at the manager take one (one for them
    /// all, kept until the last of them is released): the region may lose its last name
    /// next, and its memory must stay while they read it. Opened as this mount itself,
    /// which vouched for their permission when they were opened.
    pub(super) fn pin_leased(&self, ino: u64) {
        let unpinned: Vec<Arc<Handle>> = self
            .handles_of(ino)
            .into_iter()
            .filter(|h| match &h.body {
                Body::Region(r) => r.leased && r.pin.lock().is_ok_and(|p| p.is_none()),
                Body::Pseudo(_) => false,
            })
            .collect();
        if unpinned.is_empty() {
            return;
        }
        let pin = match self.client.open_as(self.client.caller(), ino, false) {
            Ok(region) => Arc::new(region),
            Err(e) => {
                tracing::warn!(ino, opens = unpinned.len(), error = %e, "cannot take a handle for leased opens of a region: if it is deleted now, their reads fail");
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
    }

    /// [`RegionFs::pin_leased`] for every region with leased opens (the session ended).
    pub(super) fn pin_all_leased(&self) {
        let inos: HashSet<u64> = self
            .handles
            .read()
            .map(|h| {
                h.values()
                    .filter(|x| matches!(&x.body, Body::Region(r) if r.leased))
                    .map(|x| x.ino)
                    .collect()
            })
            .unwrap_or_default();
        for ino in inos {
            self.pin_leased(ino);
        }
    }

    /// Before this mount removes name `name` of `parent` (unlink, or a rename over it):
    /// the region it names is changed here, and its leased opens take a handle (asks the
    /// manager which inode the name names only when some open of this mount is leased).
    pub(super) fn removing_name(&self, caller: &v1::Caller, parent: u64, name: &str) {
        let any_leased = self.handles.read().is_ok_and(|h| {
            h.values()
                .any(|x| matches!(&x.body, Body::Region(r) if r.leased))
        });
        let ino = if any_leased {
            self.manager()
                .lookup(caller, parent, name)
                .ok()
                .map(|a| a.ino)
        } else {
            None
        };
        if let Some(ino) = ino {
            self.leased_opens.changed(ino);
            self.pin_leased(ino);
        }
    }

    /// A writer's handle of `ino` is released: when it was this mount's last writer and
    /// nothing else of this mount changed the region since it opened, what it knew of the
    /// placement is kept for leased opens.
    pub(super) fn writer_released(&self, ino: u64, writer: &Writer, region: &Region) {
        let mut placement = region.placement();
        // The attributes the last publication left (its mtime is past the open's).
        if let Some(attr) = placement.as_mut().and_then(|p| p.attr.as_mut())
            && let Some((published, _)) =
                self.lock_inodes().get(&ino).and_then(|st| st.attr.clone())
            && published.ino == ino
            && published.size == attr.size
            && mtime(&published) >= mtime(attr)
        {
            *attr = published;
        }
        writer.released(placement, self.attr_chain(ino));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(size: u64) -> v1::RegionInfo {
        v1::RegionInfo {
            attr: Some(v1::Attr {
                ino: 9,
                size,
                ..v1::Attr::default()
            }),
            ..v1::RegionInfo::default()
        }
    }

    #[test]
    fn a_placement_serves_only_its_chain_and_not_past_this_mounts_own_change() {
        let l = LeasedOpens::default();
        // Learned under chain 1 (held before the request and after the reply).
        let t = l.ticket(9, Some((1, 5)));
        l.keep(&t, info(10), Some((1, 5)), 0);
        assert!(l.placement(9, Some((1, 5))).is_some());
        assert!(l.placement(9, Some((2, 7))).is_none(), "another chain");
        assert!(l.placement(9, None).is_none(), "no lease");
        // A chain that began after the ticket covers only the reply whose grant began it.
        let t = l.ticket(8, None);
        l.keep(&t, info(10), Some((3, 11)), 12);
        assert!(l.placement(8, Some((3, 11))).is_none());
        l.keep(&t, info(10), Some((3, 11)), 11);
        assert!(l.placement(8, Some((3, 11))).is_some());
        // This mount's own change voids the placement and the tickets taken before it.
        let (_, open) = l.placement(9, Some((1, 5))).expect("kept");
        let t = l.ticket(9, Some((1, 5)));
        l.changed(9);
        assert!(l.outdated(&open));
        assert!(l.placement(9, Some((1, 5))).is_none());
        l.keep(&t, info(20), Some((1, 5)), 0);
        assert!(
            l.placement(9, Some((1, 5))).is_none(),
            "learned before the change"
        );
        let t = l.ticket(9, Some((1, 5)));
        l.keep(&t, info(20), Some((1, 5)), 0);
        assert!(!l.outdated(&t));
        assert_eq!(
            l.placement(9, Some((1, 5)))
                .map(|(p, _)| p.attr.map(|a| a.size)),
            Some(Some(20))
        );
        l.forget(9);
        assert!(l.placement(9, Some((1, 5))).is_none());
    }

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
