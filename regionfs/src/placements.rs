//! What this mount knows of regions under its cache leases, for leased opens
//! (docs/SEMANTICS.md, "Leased opens"; the opens themselves are `fs/leased_opens.rs`): each
//! region's *placement* (size and map, as a map reply) and attributes, learned under a lease
//! chain (`crate::cache_leases`), and this mount's own changes that make them void.
//!
//! While the lease on a region's attributes holds without a gap, no other mount or process
//! changed the region: every change recalls the lease first. This mount's own changes keep
//! its leases, so they void what it learned instead. Each is counted, and anything learned
//! by a request (a *ticket* taken before it) is kept only if no change of the region began
//! since the ticket and none is under way. Writers of the region count as a change from
//! their open until the last of them is released; changes of attributes alone (times,
//! extended attributes, link counts) void attributes only.
//!
//! Removals (this mount's unlink or rename over a name) are counted too: a leased open that
//! began before one ended takes a handle at the manager before it is answered.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use regions_proto::v1;

/// Placements kept at most (a mount reading more regions than this within a term opens
/// the others at the manager).
const PLACEMENTS_KEPT: usize = 1 << 14;

/// Map entries kept in all placements at most (8 bytes each): a placement of a large region
/// is a large map, and its open costs little next to reading it.
const ENTRIES_KEPT: usize = 1 << 20;

/// Own changes remembered by inode before they are forgotten wholesale (raising the floor
/// under which every ticket is void).
const CHANGES_KEPT: usize = 1 << 12;

/// What this mount knows of regions under its leases, and its own changes of them.
#[derive(Default)]
pub struct Placements {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Inode → its placement, learned under lease chain `.1`.
    placements: HashMap<u64, (Arc<v1::RegionInfo>, u64)>,
    /// Map entries in `placements`.
    entries: usize,
    /// Inode → its attributes, learned under lease chain `.1` (answers getattrs).
    attrs: HashMap<u64, (v1::Attr, u64)>,
    /// Counts this mount's own changes.
    count: u64,
    /// Inode → the count when this mount's last change of it began or ended.
    changed: HashMap<u64, u64>,
    /// Inode → the count when this mount's last change of its attributes alone began or
    /// ended.
    attrs_changed: HashMap<u64, u64>,
    /// Tickets taken before this count are void (changes were forgotten).
    floor: u64,
    /// Tickets taken before this count bring no attributes (link counts changed).
    attrs_floor: u64,
    /// Inode → this mount's changes of it under way (writers open, requests sent).
    changing: HashMap<u64, u32>,
    /// Inode → this mount's changes of its attributes alone under way.
    attrs_changing: HashMap<u64, u32>,
    /// Removals under way, and their count (bumped when each begins and ends).
    removing: u32,
    removals: u64,
    /// The manager says this host lost its lease: no leased opens until it says otherwise.
    fenced: bool,
}

/// Taken before a request whose reply may bring a placement or attributes.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    ino: u64,
    /// The change count then.
    at: u64,
    /// The chain of the lease held on the region's attributes then.
    chain: Option<(u64, u64)>,
}

/// A placement to open a region from, and what [`Placements::outdated`] checks once the
/// open is registered.
pub struct Leased {
    /// The placement (a map reply without handle or capability).
    pub placement: Arc<v1::RegionInfo>,
    /// What to check once the open is registered.
    pub check: LeasedCheck,
}

/// See [`Leased`].
#[derive(Clone, Copy, Debug)]
pub struct LeasedCheck {
    ticket: Ticket,
    removals: u64,
}

impl LeasedCheck {
    /// The region the open is of.
    pub fn ino(&self) -> u64 {
        self.ticket.ino
    }
}

impl Inner {
    /// Whether the ticket's region changed here since the ticket, or changes now.
    fn changed_since(&self, t: &Ticket) -> bool {
        t.at < self.floor
            || self.changing.contains_key(&t.ino)
            || self.changed.get(&t.ino).is_some_and(|c| *c > t.at)
    }

    /// Whether the ticket's region, or its attributes alone, changed here since the
    /// ticket, or change now.
    fn attrs_changed_since(&self, t: &Ticket) -> bool {
        self.changed_since(t)
            || t.at < self.attrs_floor
            || self.attrs_changing.contains_key(&t.ino)
            || self.attrs_changed.get(&t.ino).is_some_and(|c| *c > t.at)
    }

    /// A new count, recorded for `ino` in `which`; past [`CHANGES_KEPT`] inodes, every
    /// record goes and the floor rises.
    fn bump(&mut self, ino: u64, attrs_only: bool) {
        self.count += 1;
        let count = self.count;
        if self.changed.len() + self.attrs_changed.len() >= CHANGES_KEPT {
            self.changed.clear();
            self.attrs_changed.clear();
            self.floor = count;
        }
        if attrs_only {
            self.attrs_changed.insert(ino, count);
        } else {
            self.changed.insert(ino, count);
            self.remove_placement(ino);
        }
        self.attrs.remove(&ino);
    }

    /// A change of `ino` ends: one fewer under way, and whatever a request sent before now
    /// brings is void (it may predate the change).
    fn end_change(&mut self, ino: u64, attrs_only: bool) {
        self.bump(ino, attrs_only);
        let under_way = if attrs_only {
            &mut self.attrs_changing
        } else {
            &mut self.changing
        };
        if let Some(n) = under_way.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                under_way.remove(&ino);
            }
        }
    }

    fn remove_placement(&mut self, ino: u64) {
        if let Some((p, _)) = self.placements.remove(&ino) {
            self.entries -= p.map.len();
        }
    }

    fn insert_placement(&mut self, ino: u64, placement: v1::RegionInfo, chain: u64) {
        self.remove_placement(ino);
        if placement.map.len() > ENTRIES_KEPT / 16 {
            return; // a large region: its open costs little next to reading it
        }
        if self.placements.len() >= PLACEMENTS_KEPT
            || self.entries + placement.map.len() > ENTRIES_KEPT
        {
            self.placements.clear();
            self.entries = 0;
        }
        self.entries += placement.map.len();
        self.placements.insert(ino, (Arc::new(placement), chain));
    }

    fn insert_attr(&mut self, ino: u64, attr: v1::Attr, chain: u64) {
        if self.attrs.len() >= PLACEMENTS_KEPT && !self.attrs.contains_key(&ino) {
            self.attrs.clear();
        }
        self.attrs.insert(ino, (attr, chain));
    }
}

/// The chain a reply learned under, if the lease chain of the region's attributes now
/// (`chain`) covers it: the chain held when the ticket was taken and holds still, or it
/// began with the grant `granted` the reply carried.
fn covering(ticket: &Ticket, chain: Option<(u64, u64)>, granted: u64) -> Option<u64> {
    let (now, first) = chain?;
    (ticket.chain.is_some_and(|(then, _)| then == now) || (granted != 0 && first == granted))
        .then_some(now)
}

/// Whether a reply's attributes describe a region that still has a name (an unlinked one
/// lives only as long as handles hold it, and a leased open holds none).
fn named(attr: Option<&v1::Attr>) -> bool {
    attr.is_some_and(|a| a.nlink > 0)
}

impl Placements {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ticket for what a request about `ino` sent from now on brings, while the lease
    /// chain `chain` holds.
    pub fn ticket(&self, ino: u64, chain: Option<(u64, u64)>) -> Ticket {
        Ticket {
            ino,
            at: self.lock().count,
            chain,
        }
    }

    /// Keeps `placement` of the ticket's region (a read open's reply, carrying grant
    /// `granted`), and its attributes, if the lease chain now covers the reply, the region
    /// has a name, and this mount did not change it since the ticket.
    pub fn keep(
        &self,
        ticket: &Ticket,
        placement: v1::RegionInfo,
        chain: Option<(u64, u64)>,
        granted: u64,
    ) {
        let Some(now) = covering(ticket, chain, granted) else {
            return;
        };
        if !named(placement.attr.as_ref()) {
            return;
        }
        let mut s = self.lock();
        if s.fenced || s.changed_since(ticket) {
            return;
        }
        if !s.attrs_changed_since(ticket)
            && let Some(attr) = &placement.attr
        {
            s.insert_attr(ticket.ino, attr.clone(), now);
        }
        s.insert_placement(ticket.ino, placement, now);
    }

    /// Keeps the attributes `attr` of the ticket's region (a getattr's reply) if the lease
    /// chain now covers them and this mount changed neither the region nor its attributes
    /// since the ticket.
    pub fn keep_attr(&self, ticket: &Ticket, attr: &v1::Attr, chain: Option<(u64, u64)>) {
        let Some(now) = covering(ticket, chain, attr.attr_lease) else {
            return;
        };
        let mut s = self.lock();
        if !s.attrs_changed_since(ticket) {
            s.insert_attr(ticket.ino, attr.clone(), now);
        }
    }

    /// The attributes of `ino` if they were learned under lease chain `chain` and nothing
    /// of this mount changes them now.
    pub fn attr(&self, ino: u64, chain: Option<(u64, u64)>) -> Option<v1::Attr> {
        let (now, _) = chain?;
        let s = self.lock();
        if s.changing.contains_key(&ino) || s.attrs_changing.contains_key(&ino) {
            return None;
        }
        let (attr, learned) = s.attrs.get(&ino)?;
        (*learned == now).then(|| attr.clone())
    }

    /// The placement of `ino` if it was learned under lease chain `chain`, nothing of this
    /// mount changes or removes anything now, and the host is not fenced.
    pub fn placement(&self, ino: u64, chain: Option<(u64, u64)>) -> Option<Leased> {
        let (now, _) = chain?;
        let s = self.lock();
        if s.fenced || s.removing > 0 || s.changing.contains_key(&ino) {
            return None;
        }
        let (placement, learned) = s.placements.get(&ino)?;
        (*learned == now).then(|| Leased {
            placement: Arc::clone(placement),
            check: LeasedCheck {
                ticket: Ticket {
                    ino,
                    at: s.count,
                    chain,
                },
                removals: s.removals,
            },
        })
    }

    /// Whether a leased open (`check`) must take a handle before it is answered: this
    /// mount changed the region, or began or ended a removal, since its placement was
    /// taken, or the lease chain is not the one it was taken under (`chain`: now).
    pub fn outdated(&self, check: &LeasedCheck, chain: Option<(u64, u64)>) -> bool {
        let s = self.lock();
        s.fenced
            || s.changed_since(&check.ticket)
            || s.removals != check.removals
            || chain != check.ticket.chain
    }

    /// Whether the manager said this host lost its lease (see [`Placements::set_fenced`]).
    pub fn fenced(&self) -> bool {
        self.lock().fenced
    }

    /// This mount begins a change of region `ino` (`attrs_only`: of its attributes alone:
    /// times, extended attributes other than the region's own): what it knew is void until
    /// the change ends, and so is whatever a request sent before the end brings.
    pub fn change(self: &Arc<Self>, ino: u64, attrs_only: bool) -> Change {
        let mut s = self.lock();
        s.bump(ino, attrs_only);
        let under_way = if attrs_only {
            &mut s.attrs_changing
        } else {
            &mut s.changing
        };
        *under_way.entry(ino).or_default() += 1;
        Change {
            placements: Arc::clone(self),
            ino,
            attrs_only,
        }
    }

    /// This mount changed the attributes of regions it cannot name (link counts, by a link,
    /// unlink or rename): every attribute learned before is void.
    pub fn all_attrs_changed(&self) {
        let mut s = self.lock();
        s.count += 1;
        s.attrs_floor = s.count;
        s.attrs.clear();
    }

    /// This mount begins removing a name (unlink, rename over it): no leased open is made
    /// until it ends, and one made before that takes a handle.
    pub fn removal(self: &Arc<Self>) -> Removal {
        let mut s = self.lock();
        s.removing += 1;
        s.removals += 1;
        Removal {
            placements: Arc::clone(self),
        }
    }

    /// A writer of `ino` opens here: a change (see [`Placements::change`]) until
    /// [`Writer::released`] (or its drop). At its release the placement it knows is kept
    /// when `keep` and it was the last writer.
    pub fn writer(self: &Arc<Self>, ino: u64, chain: Option<(u64, u64)>, keep: bool) -> Writer {
        let mut s = self.lock();
        s.bump(ino, false);
        *s.changing.entry(ino).or_default() += 1;
        Writer {
            placements: Arc::clone(self),
            ticket: Ticket {
                ino,
                at: s.count,
                chain,
            },
            keep,
            done: AtomicBool::new(false),
        }
    }

    /// The lease on `ino`'s attributes was recalled: what was learned under it is void.
    pub fn forget(&self, ino: u64) {
        let mut s = self.lock();
        s.remove_placement(ino);
        s.attrs.remove(&ino);
    }

    /// The session ended: nothing learned is of use.
    pub fn forget_all(&self) {
        let mut s = self.lock();
        s.placements.clear();
        s.entries = 0;
        s.attrs.clear();
    }

    /// Whether the manager says this host lost its lease (no leased opens meanwhile).
    pub fn set_fenced(&self, fenced: bool) {
        let mut s = self.lock();
        s.fenced = fenced;
        if fenced {
            s.placements.clear();
            s.entries = 0;
        }
    }
}

/// A change of one region by this mount under way (see [`Placements::change`]); it ends
/// when dropped.
pub struct Change {
    placements: Arc<Placements>,
    ino: u64,
    attrs_only: bool,
}

impl Drop for Change {
    /// Whatever a request sent before now brings is void: it may predate the change.
    fn drop(&mut self) {
        self.placements.lock().end_change(self.ino, self.attrs_only);
    }
}

/// A removal by this mount under way (see [`Placements::removal`]); it ends when dropped.
pub struct Removal {
    placements: Arc<Placements>,
}

impl Drop for Removal {
    fn drop(&mut self) {
        let mut s = self.placements.lock();
        s.removing -= 1;
        s.removals += 1;
    }
}

/// One writer of a region in this mount (see [`Placements::writer`]).
pub struct Writer {
    placements: Arc<Placements>,
    ticket: Ticket,
    keep: bool,
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
    /// The writer's handle is released, having published what it wrote. When it was this
    /// mount's last writer of the region and nothing else of this mount changed the region
    /// since it opened, `placement` (what it knew; `None`: nothing sure) is kept under the
    /// lease chain held now (`chain`), if that is the chain it opened under. Its attributes
    /// are not kept: the manager's close still trims what the writer reserved ahead.
    pub fn released(&self, placement: Option<v1::RegionInfo>, chain: Option<(u64, u64)>) {
        if self.done.swap(true, Ordering::Relaxed) {
            return;
        }
        let ino = self.ticket.ino;
        let mut s = self.placements.lock();
        // The last writer, and no other change of this mount began since it opened.
        let alone = s.changing.get(&ino) == Some(&1)
            && s.changed.get(&ino) == Some(&self.ticket.at)
            && self.ticket.at >= s.floor;
        s.end_change(ino, false);
        if let (true, true, Some(now), Some(placement)) = (
            self.keep,
            alone,
            covering(&self.ticket, chain, 0),
            placement,
        ) && named(placement.attr.as_ref())
        {
            s.insert_placement(ino, placement, now);
        }
    }
}

impl Drop for Writer {
    /// A writer whose open failed, or whose release never came, ends its change.
    fn drop(&mut self) {
        if !self.done.swap(true, Ordering::Relaxed) {
            self.placements.lock().end_change(self.ticket.ino, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(ino: u64, size: u64) -> v1::RegionInfo {
        v1::RegionInfo {
            attr: Some(v1::Attr {
                ino,
                size,
                nlink: 1,
                ..v1::Attr::default()
            }),
            ..v1::RegionInfo::default()
        }
    }

    fn size_of(p: &Placements, ino: u64, chain: Option<(u64, u64)>) -> Option<u64> {
        p.placement(ino, chain)
            .and_then(|l| l.placement.attr.as_ref().map(|a| a.size))
    }

    const C1: Option<(u64, u64)> = Some((1, 5));

    #[test]
    fn a_placement_serves_only_the_chain_it_was_learned_under() {
        let p = Placements::default();
        let t = p.ticket(9, C1);
        p.keep(&t, info(9, 10), C1, 0);
        assert_eq!(size_of(&p, 9, C1), Some(10));
        assert_eq!(size_of(&p, 9, Some((2, 7))), None, "another chain");
        assert_eq!(size_of(&p, 9, None), None, "no lease");
        // A chain that began after the ticket covers only the reply whose grant began it.
        let t = p.ticket(8, None);
        p.keep(&t, info(8, 10), Some((3, 11)), 12);
        assert_eq!(size_of(&p, 8, Some((3, 11))), None);
        p.keep(&t, info(8, 10), Some((3, 11)), 11);
        assert_eq!(size_of(&p, 8, Some((3, 11))), Some(10));
        // A region without a name is not kept.
        let t = p.ticket(7, C1);
        let mut unlinked = info(7, 10);
        unlinked.attr.as_mut().unwrap().nlink = 0;
        p.keep(&t, unlinked, C1, 0);
        assert_eq!(size_of(&p, 7, C1), None);
        p.forget(9);
        assert_eq!(size_of(&p, 9, C1), None);
    }

    #[test]
    fn a_change_here_voids_what_was_known_and_what_replies_sent_before_its_end_bring() {
        let p = Arc::new(Placements::default());
        let t = p.ticket(9, C1);
        p.keep(&t, info(9, 10), C1, 0);
        let (open, attr_ticket) = (p.placement(9, C1).expect("kept").check, p.ticket(9, C1));
        p.keep_attr(&attr_ticket, &info(9, 10).attr.unwrap(), C1);
        assert!(p.attr(9, C1).is_some());
        let change = p.change(9, false);
        assert!(p.outdated(&open, C1), "an open from before the change");
        assert_eq!(size_of(&p, 9, C1), None);
        assert!(p.attr(9, C1).is_none());
        // A reply to a request sent during the change (it may have been answered before the
        // change reached the manager) is not kept, during the change or after it.
        let during = p.ticket(9, C1);
        p.keep(&during, info(9, 10), C1, 0);
        assert_eq!(size_of(&p, 9, C1), None);
        drop(change);
        p.keep(&during, info(9, 10), C1, 0);
        assert_eq!(size_of(&p, 9, C1), None, "a reply from during the change");
        let after = p.ticket(9, C1);
        p.keep(&after, info(9, 20), C1, 0);
        assert_eq!(size_of(&p, 9, C1), Some(20));
        // A change of times voids attributes, not placements.
        let t = p.ticket(9, C1);
        p.keep_attr(&t, &info(9, 20).attr.unwrap(), C1);
        drop(p.change(9, true));
        assert!(p.attr(9, C1).is_none());
        assert_eq!(size_of(&p, 9, C1), Some(20));
        p.keep_attr(&t, &info(9, 20).attr.unwrap(), C1);
        assert!(
            p.attr(9, C1).is_none(),
            "attributes from before the change of times"
        );
        // Link counts: every attribute learned before is void, placements stay.
        let t = p.ticket(9, C1);
        p.all_attrs_changed();
        p.keep_attr(&t, &info(9, 20).attr.unwrap(), C1);
        assert!(p.attr(9, C1).is_none());
        assert_eq!(size_of(&p, 9, C1), Some(20));
    }

    #[test]
    fn the_last_writer_alone_leaves_its_placement() {
        let p = Arc::new(Placements::default());
        // One writer: its release keeps what it knew; a reply to a request sent while it
        // wrote does not overwrite that.
        let w = p.writer(9, C1, true);
        let during = p.ticket(9, C1);
        w.released(Some(info(9, 30)), C1);
        assert_eq!(size_of(&p, 9, C1), Some(30));
        p.keep(&during, info(9, 10), C1, 0);
        assert_eq!(size_of(&p, 9, C1), Some(30), "an older reply replaced it");
        drop(w);
        assert_eq!(
            size_of(&p, 9, C1),
            Some(30),
            "the release ended the change once"
        );
        // Two writers: the first to go leaves nothing, and nor does the last, which did not
        // see the first's writes.
        let a = p.writer(9, C1, true);
        let b = p.writer(9, C1, true);
        a.released(Some(info(9, 40)), C1);
        assert_eq!(size_of(&p, 9, C1), None);
        b.released(Some(info(9, 35)), C1);
        assert_eq!(size_of(&p, 9, C1), None);
        // A writer that is told not to keep (its mode was set after it opened), one that
        // changed chain, and one whose open failed (dropped) leave nothing, and end.
        p.writer(9, C1, false).released(Some(info(9, 50)), C1);
        assert_eq!(size_of(&p, 9, C1), None);
        p.writer(9, C1, true)
            .released(Some(info(9, 50)), Some((2, 6)));
        assert_eq!(size_of(&p, 9, C1), None);
        drop(p.writer(9, C1, true));
        let t = p.ticket(9, C1);
        p.keep(&t, info(9, 60), C1, 0);
        assert_eq!(
            size_of(&p, 9, C1),
            Some(60),
            "a writer's change did not end"
        );
    }

    #[test]
    fn removals_and_fencing_hold_leased_opens_off() {
        let p = Arc::new(Placements::default());
        let t = p.ticket(9, C1);
        p.keep(&t, info(9, 10), C1, 0);
        let open = p.placement(9, C1).expect("kept").check;
        let removal = p.removal();
        assert!(
            p.placement(9, C1).is_none(),
            "a leased open during a removal"
        );
        assert!(p.outdated(&open, C1), "an open that began before a removal");
        drop(removal);
        let open = p.placement(9, C1).expect("kept").check;
        assert!(!p.outdated(&open, C1));
        assert!(p.outdated(&open, Some((2, 6))), "the chain went meanwhile");
        p.set_fenced(true);
        assert!(p.placement(9, C1).is_none());
        assert!(
            p.outdated(&open, C1),
            "an open that began before the host was fenced"
        );
        let t = p.ticket(9, C1);
        p.keep(&t, info(9, 10), C1, 0);
        p.set_fenced(false);
        let t = p.ticket(9, C1);
        p.keep(&t, info(9, 10), C1, 0);
        assert!(p.placement(9, C1).is_some());
    }
}
