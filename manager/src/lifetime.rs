//! Region lifetime and host failure at the manager (docs/SEMANTICS.md, "Lifetime" and
//! "Host failure"; Remote Regions paper §5.1, §5.5):
//!
//! - Owner-bound regions: a node component (the host agent of the owner's host) reports that
//!   an owner process exited, and that owner's non-persistent regions are deleted: their
//!   names go at once, their memory at their last close, as with an unlink.
//! - A host whose lease expired takes its owners' non-persistent regions with it (the owner
//!   of a region is the process and host that created it, `Attr.owner_pid`/`owner_host`).
//! - A daemon that registers with a new incarnation lost its memory: every region with a
//!   chunk in its pools is marked lost, durably and in the same change as the registration.
//!   Opens, map reads, extends and truncates of a lost region answer `EIO` until it is
//!   unlinked, and its chunks are left out of the daemon's resync (`PoolChunks`), so the new
//!   daemon never serves them as if zeros were data.
//!
//! The lost mark is kept in the inode's attribute map under [`LOST_KEY`], a key outside the
//! `user.` namespace that no client can name, so stores written before it still load.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::access::Caller;
use crate::cache_leases::Lease;
use crate::error::{ManagerError, Result};
use crate::manager::Manager;
use crate::model::{LOST_KEY, Time};
use crate::state::{State, entry_gid};

/// Shortest and longest pause between lease checks.
const MIN_TICK: Duration = Duration::from_millis(50);
const MAX_TICK: Duration = Duration::from_millis(500);

impl State {
    /// Why region `ino` is lost, if it is.
    pub fn lost_reason(&self, ino: u64) -> Option<String> {
        let inode = self.inodes.get(&ino)?;
        inode
            .xattrs
            .get(LOST_KEY)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// `EIO` when region `ino` is lost.
    pub fn check_not_lost(&self, ino: u64) -> Result<()> {
        match self.lost_reason(ino) {
            Some(reason) => Err(ManagerError::Lost { ino, reason }),
            None => Ok(()),
        }
    }

    /// Marks every region with a chunk in `host`'s pools lost (its daemon restarted and its
    /// memory is gone); returns them.
    pub fn mark_lost_on(&mut self, host: u32, reason: &str) -> Vec<u64> {
        let gids: HashSet<u32> = self.alloc.host_pools(host).map(|p| p.pool.gid).collect();
        let mut hit: Vec<u64> = self
            .maps
            .iter()
            .filter(|(_, map)| {
                map.iter()
                    .any(|e| entry_gid(*e).is_some_and(|g| gids.contains(&g)))
            })
            .map(|(ino, _)| *ino)
            .chain(self.objects_on(host))
            .filter(|ino| self.inodes.contains_key(ino) && self.lost_reason(*ino).is_none())
            .collect();
        hit.sort_unstable();
        hit.dedup();
        for ino in &hit {
            if let Ok(inode) = self.inode_mut(*ino) {
                inode
                    .xattrs
                    .insert(LOST_KEY.to_owned(), reason.as_bytes().to_vec());
            }
        }
        hit
    }

    /// Whether the chunks of region `ino` are to be left out of a daemon's resync.
    pub fn skip_in_resync(&self, ino: u64) -> bool {
        self.inodes
            .get(&ino)
            .is_some_and(|i| i.xattrs.contains_key(LOST_KEY))
    }

    /// Removes every name of region `ino` as the system (no permission check), as unlinks
    /// do: its memory goes now, or at its last close. A region with no name is left alone.
    pub fn delete_region(&mut self, ino: u64) -> Result<()> {
        let inode = self.region(ino)?;
        if inode.nlink == 0 {
            return Ok(());
        }
        let names = self.names_of(ino);
        if names.is_empty() {
            let parent = inode.parent;
            return Err(ManagerError::NotFound(format!(
                "the name of region {ino} in directory {parent}"
            )));
        }
        let now = Time::now();
        for (parent, name) in names {
            self.remove_entry(parent, &name);
            self.drop_name(ino, parent, now)?;
            self.touch_dir(parent, now)?;
        }
        Ok(())
    }

    /// Named non-persistent regions created on `host` (by process `pid`, when given).
    pub fn owned_regions(&self, host: u32, pid: Option<u32>) -> Vec<u64> {
        let mut inos: Vec<u64> = self
            .inodes
            .values()
            .filter(|i| {
                i.is_region()
                    && i.nlink > 0
                    && !i.attrs.persistent
                    && i.owner_host == host
                    && pid.is_none_or(|p| i.owner_pid == p)
            })
            .map(|i| i.ino)
            .collect();
        inos.sort_unstable();
        inos
    }

    /// Deletes the non-persistent regions of owner `pid` on `host` (every owner of `host` when
    /// `pid` is `None`); returns them.
    pub fn release_owner(&mut self, host: u32, pid: Option<u32>) -> Vec<u64> {
        let mut deleted = Vec::new();
        for ino in self.owned_regions(host, pid) {
            match self.delete_region(ino) {
                Ok(()) => deleted.push(ino),
                Err(e) => tracing::warn!(host, ino, error = %e, "cannot delete an owner's region"),
            }
        }
        deleted
    }

    /// Drops every open handle of processes on `host` (its lease ended: they cannot close
    /// them any more). A ONEWRITER region they held open for writing takes writers again, and
    /// an unlinked region they kept alive is freed. Returns how many handles were dropped.
    pub fn release_host_handles(&mut self, host: u32) -> usize {
        let ids: Vec<u64> = self
            .handles
            .values()
            .filter(|h| h.host_id == host)
            .map(|h| h.id)
            .collect();
        for id in &ids {
            self.release_handle(*id);
            self.fenced_handles.insert(*id);
        }
        ids.len()
    }

    /// `Err(Fenced)` while `host` has lost its lease and not registered again: nothing is
    /// handed to its processes (maps with capabilities, opens) until its daemon is back.
    pub fn check_lease(&self, host: u32) -> Result<()> {
        if self.lease_lost.contains(&host) {
            return Err(ManagerError::Fenced(format!(
                "host {host}'s lease ended, so its processes' handles were closed and their \
                 capabilities fenced; its daemon registers again by itself once it reaches the \
                 manager, then open the region again"
            )));
        }
        Ok(())
    }

    /// `Err(Fenced)` when `handle` was closed because its host's lease ended, or is open on
    /// another region or from another host (a renewal names the handle it renews for: a
    /// fenced open renews nothing).
    pub fn check_open_handle(&self, caller: &Caller, ino: u64, handle: u64) -> Result<()> {
        let fenced = self.fenced_handles.contains(&handle);
        let foreign = self
            .handles
            .get(&handle)
            .is_some_and(|h| h.ino != ino || h.host_id != caller.host_id);
        if fenced || foreign {
            return Err(ManagerError::Fenced(format!(
                "handle {handle} of region {ino} is no longer open for this process (it was \
                 closed when host {}'s lease ended): open the region again",
                caller.host_id
            )));
        }
        Ok(())
    }

    /// The handles among `ids` that were closed because their host's lease ended, or that are
    /// open from another host than `host`.
    pub fn gone_handles(&self, host: u32, ids: &[u64]) -> Vec<u64> {
        ids.iter()
            .copied()
            .filter(|id| {
                self.fenced_handles.contains(id)
                    || self.handles.get(id).is_some_and(|h| h.host_id != host)
            })
            .collect()
    }

    /// Hosts whose lease ended. A host not heard from since this manager started has no
    /// lease to end; it counts only once `grace_over` (one lease after the start).
    pub fn expired_hosts(&self, grace_over: bool) -> Vec<u32> {
        self.hosts
            .keys()
            .copied()
            .filter(|h| !self.is_live(*h) && (grace_over || self.leases.contains_key(h)))
            .collect()
    }
}

impl Manager {
    /// Owner `pid` on `host` exited: deletes its non-persistent regions; returns them.
    pub async fn release_owner(&self, host: u32, pid: u32) -> Result<Vec<u64>> {
        if host == 0 || pid == 0 {
            return Err(ManagerError::Invalid(format!(
                "release of owner pid {pid} on host {host}: both must be non-zero"
            )));
        }
        // Mounts reading these regions under a lease hold handles of their own before they
        // go (docs/SEMANTICS.md, "Cache leases"): recalled first, like an unlink.
        let owned: Vec<Lease> = self
            .peek(|s| s.owned_regions(host, Some(pid)))
            .unwrap_or_default()
            .into_iter()
            .map(Lease::Attrs)
            .collect();
        let _guard = self.recall(&Caller::root(host), &owned).await;
        let deleted = self
            .write_for_liveness(|s| Ok(s.release_owner(host, Some(pid))))
            .await?;
        if !deleted.is_empty() {
            tracing::info!(host, pid, regions = ?deleted, "owner exited: deleted its non-persistent regions");
        }
        Ok(deleted)
    }

    /// Deletes the non-persistent regions of the owners on every host whose lease expired
    /// and drops the handles its processes held open; returns (host, regions) for those that
    /// had any regions to delete.
    pub async fn expire_leases(&self, grace_over: bool) -> Result<Vec<(u32, Vec<u64>)>> {
        // Most checks find nothing to do: no write then (which a stalled store may refuse).
        if self
            .read(|s| Ok(s.expired_hosts(grace_over).is_empty()))
            .await?
        {
            return Ok(Vec::new());
        }
        // Mounts reading the regions about to go under a lease take handles first (as for
        // an unlink; the expired host's own mount has stopped renewing, so is not waited for
        // past its leases).
        // Hosts that expire during the recall are taken up at the next check.
        let (hosts, doomed): (Vec<u32>, Vec<Lease>) = self
            .peek(|s| {
                let hosts = s.expired_hosts(grace_over);
                let doomed = hosts
                    .iter()
                    .flat_map(|h| s.owned_regions(*h, None))
                    .map(Lease::Attrs)
                    .collect();
                (hosts, doomed)
            })
            .unwrap_or_default();
        let _guard = self.recall(&Caller::root(0), &doomed).await;
        let (out, fenced) = self
            .write_for_liveness(|s| {
                let mut out = Vec::new();
                let mut fenced = Vec::new();
                let expired = s.expired_hosts(grace_over);
                for host in hosts.iter().copied().filter(|h| expired.contains(h)) {
                    if s.lease_lost.insert(host) {
                        s.fence_host(host);
                        fenced.push(host);
                    }
                    let deleted = s.release_owner(host, None);
                    let closed = s.release_host_handles(host);
                    if closed > 0 {
                        tracing::warn!(
                            host,
                            handles = closed,
                            "host lease expired: closed the handles its processes held open"
                        );
                    }
                    if !deleted.is_empty() {
                        out.push((host, deleted));
                    }
                }
                Ok((out, fenced))
            })
            .await?;
        if !fenced.is_empty() {
            tracing::warn!(
                hosts = ?fenced,
                "host lease expired: fencing its processes' capabilities at every daemon"
            );
        }
        // The fence is in force at the live daemons before anything the host held (its
        // mutexes) goes to someone else. Hosts fenced on an earlier tick whose settling did
        // not finish are taken up again here.
        let unsettled: Vec<u32> = self
            .read(|s| Ok(s.lease_lost.difference(&s.fence_settled).copied().collect()))
            .await?;
        if !unsettled.is_empty() {
            self.settle_destructive().await;
            // In memory only, like `lease_lost`: no store write that a stalled store refuses.
            // A host that registered again meanwhile is no longer lost.
            self.with_state(|s| {
                for host in unsettled {
                    if s.lease_lost.contains(&host) {
                        s.fence_settled.insert(host);
                    }
                }
            })?;
        }
        Ok(out)
    }

    /// Renews every host's lease by one lease from now: the expiry loop itself ran late (the
    /// manager was stopped or starved), so silence in that time says nothing of the hosts.
    pub fn renew_all_leases(&self) -> Result<()> {
        self.with_state(|s| {
            let until = Instant::now() + s.lease;
            let live: Vec<u32> = s
                .hosts
                .keys()
                .copied()
                .filter(|h| !s.lease_lost.contains(h))
                .collect();
            for h in live {
                s.leases.insert(h, until);
            }
        })
    }
}

/// Checks leases every quarter lease (50–500 ms) until the manager shuts down; see
/// [`Manager::expire_leases`].
pub async fn run_lease_expiry(manager: Arc<Manager>) {
    let started = Instant::now();
    let lease = manager.config().lease;
    let tick = (lease / 4).clamp(MIN_TICK, MAX_TICK);
    let mut closing = manager.closing();
    let mut last = Instant::now();
    loop {
        tokio::select! {
            () = tokio::time::sleep(tick) => {}
            _ = closing.wait_for(|c| *c) => return,
        }
        // A loop that woke far too late (the process was stopped, or starved) cannot tell
        // silent hosts from its own absence: give every host one more lease.
        let late = last.elapsed() > tick + lease / 2;
        last = Instant::now();
        if late {
            tracing::warn!(
                lease_ms = lease.as_millis() as u64,
                "the lease check ran late; renewing every lease once instead of expiring hosts"
            );
            if let Err(e) = manager.renew_all_leases() {
                tracing::warn!(error = %e, "cannot renew the leases");
            }
            continue;
        }
        let grace_over = started.elapsed() >= lease;
        match manager.expire_leases(grace_over).await {
            Ok(expired) => {
                for (host, regions) in expired {
                    tracing::warn!(
                        host,
                        ?regions,
                        "host lease expired: deleted the non-persistent regions its processes owned"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "lease check failed");
                if matches!(e, ManagerError::Store(_)) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::Caller;
    use crate::cluster::HostRegistration;
    use crate::model::ROOT_INO;

    const MIB: u64 = 1 << 20;

    fn reg(host: u32, incarnation: u64) -> HostRegistration {
        HostRegistration {
            host_id: host,
            transport_addr: format!("127.0.0.1:{}", 7200 + host),
            agent_socket: String::new(),
            memory_offered: 64 * MIB,
            incarnation,
            transports: String::new(),
            object_memory: 0,
        }
    }

    fn state(lease: Duration) -> State {
        let mut s = State::new(lease, 0o1777);
        for h in 1..=3 {
            s.register_host(&reg(h, 1)).unwrap();
            s.register_pool(h, 0, 64 * MIB).unwrap();
        }
        s
    }

    fn who(host: u32, pid: u32) -> Caller {
        Caller {
            uid: 1000,
            gid: 1000,
            groups: vec![],
            pid,
            host_id: host,
            by_inode: false,
            lease_session: 0,
        }
    }

    fn region(s: &mut State, c: &Caller, name: &str, persistent: bool, bytes: u64) -> u64 {
        let o = regions_proto::v1::RegionAttrOverrides {
            persistent: Some(persistent),
            ..Default::default()
        };
        let ino = s
            .create_entry(c, ROOT_INO, name, 0o644, Some(&o))
            .unwrap()
            .ino;
        s.resize(ino, Some(bytes), bytes, false).unwrap();
        ino
    }

    #[test]
    fn an_expired_host_leaves_no_handles_behind() {
        let mut s = state(Duration::from_secs(60));
        let one = region(&mut s, &who(2, 10), "one", true, MIB);
        s.setxattr(&who(2, 10), one, "user.regions.onewriter", b"1", 0)
            .unwrap();
        let doomed = region(&mut s, &who(2, 10), "doomed", true, MIB);
        // Host 1 writes `one` and keeps `doomed` open after it is unlinked.
        s.open_region(&who(1, 7), one, true).unwrap();
        s.open_region(&who(1, 7), doomed, false).unwrap();
        let kept = s.open_region(&who(3, 9), doomed, false).unwrap();
        s.unlink(&who(2, 10), ROOT_INO, "doomed").unwrap();
        assert_eq!(
            s.open_region(&who(2, 11), one, true).unwrap_err().errno(),
            libc::ETXTBSY
        );
        assert_eq!(s.release_host_handles(1), 2);
        assert!(
            s.open_region(&who(2, 11), one, true).is_ok(),
            "ONEWRITER takes a writer again"
        );
        assert!(s.inodes.contains_key(&doomed), "host 3 still has it open");
        assert!(s.release_handle(kept.id));
        assert!(!s.inodes.contains_key(&doomed), "freed at its last close");
        assert_eq!(s.release_host_handles(1), 0);
    }

    #[test]
    fn a_fenced_host_renews_nothing_until_it_registers_again() {
        let mut s = state(Duration::from_secs(60));
        let r = region(&mut s, &who(2, 10), "r", true, MIB);
        let h1 = s.open_region(&who(1, 7), r, true).unwrap();
        let h2 = s.open_region(&who(2, 8), r, false).unwrap();
        s.check_open_handle(&who(1, 7), r, h1.id).unwrap();
        // A handle the manager does not know (lost with a crash before its commit) is not
        // held against its opener; one of another host is.
        s.check_open_handle(&who(1, 7), r, 999_999).unwrap();
        assert_eq!(
            s.check_open_handle(&who(1, 7), r, h2.id)
                .unwrap_err()
                .errno(),
            libc::EIO
        );
        // Host 1's lease ends: its handle is closed and fenced, its heartbeats and everything
        // minted for it are refused until it registers again.
        s.lease_lost.insert(1);
        s.fence_host(1);
        assert_eq!(s.release_host_handles(1), 1);
        assert_eq!(
            s.check_open_handle(&who(1, 7), r, h1.id)
                .unwrap_err()
                .errno(),
            libc::EIO
        );
        assert_eq!(s.gone_handles(1, &[h1.id, 999_999]), vec![h1.id]);
        assert_eq!(s.gone_handles(1, &[h2.id]), vec![h2.id], "host 2's handle");
        assert!(s.gone_handles(2, &[h2.id]).is_empty());
        assert_eq!(s.check_lease(1).unwrap_err().errno(), libc::EIO);
        assert_eq!(s.heartbeat(1, 1).unwrap_err().errno(), libc::EINVAL);
        assert!(s.check_lease(2).is_ok() && s.heartbeat(2, 1).is_ok());
        // The fence went to every daemon and stays for resyncs.
        assert!(
            s.revoked
                .current()
                .iter()
                .any(|f| f.host == 1 && f.ino == 0)
        );
        s.register_host(&reg(1, 1)).unwrap();
        assert!(s.check_lease(1).is_ok() && s.heartbeat(1, 1).is_ok());
        // The open it lost stays lost; a new open works.
        assert!(s.check_open_handle(&who(1, 7), r, h1.id).is_err());
        let again = s.open_region(&who(1, 7), r, true).unwrap();
        s.check_open_handle(&who(1, 7), r, again.id).unwrap();
    }

    #[test]
    fn owner_release_deletes_only_its_non_persistent_regions() {
        let mut s = state(Duration::from_secs(60));
        let a = region(&mut s, &who(1, 10), "a", false, MIB);
        let keep = region(&mut s, &who(1, 10), "keep", true, MIB);
        let other_pid = region(&mut s, &who(1, 11), "b", false, MIB);
        let other_host = region(&mut s, &who(2, 10), "c", false, MIB);
        let free_before = s.alloc.host_free(1);
        assert_eq!(s.release_owner(1, Some(10)), vec![a]);
        assert!(s.child(ROOT_INO, "a").is_none());
        assert!(!s.inodes.contains_key(&a), "no handle: freed at once");
        assert_eq!(s.alloc.host_free(1), free_before + MIB);
        for ino in [keep, other_pid, other_host] {
            assert!(s.inode(ino).is_ok());
        }
        // An open region loses its name now and its memory at the last close.
        let h = s.open_region(&who(3, 5), other_pid, false).unwrap();
        assert_eq!(s.release_owner(1, Some(11)), vec![other_pid]);
        assert!(s.child(ROOT_INO, "b").is_none());
        assert!(s.inodes.contains_key(&other_pid));
        assert!(s.release_handle(h.id));
        assert!(!s.inodes.contains_key(&other_pid));
        // Renamed regions are found by inode.
        s.rename(&who(2, 10), ROOT_INO, "c", ROOT_INO, "c2", 0)
            .unwrap();
        assert_eq!(s.release_owner(2, None), vec![other_host]);
        assert!(s.child(ROOT_INO, "c2").is_none());
    }

    #[test]
    fn expired_hosts_need_a_lease_that_ended_or_the_grace() {
        let mut s = state(Duration::from_millis(30));
        s.leases.remove(&3); // known from the store, not heard from since the start
        std::thread::sleep(Duration::from_millis(50));
        s.heartbeat(2, 1).unwrap();
        assert_eq!(s.expired_hosts(false), vec![1]);
        assert_eq!(s.expired_hosts(true), vec![1, 3]);
    }

    #[test]
    fn a_restarted_host_loses_the_regions_it_held() {
        let mut s = state(Duration::from_secs(60));
        let c = who(1, 10);
        let mut spread = regions_proto::v1::RegionAttrOverrides {
            persistent: Some(true),
            multihosted: Some(true),
            ..Default::default()
        };
        let on2 = {
            let o = regions_proto::v1::RegionAttrOverrides {
                persistent: Some(true),
                hostalloc: Some("2".into()),
                ..Default::default()
            };
            let ino = s
                .create_entry(&c, ROOT_INO, "on2", 0o644, Some(&o))
                .unwrap()
                .ino;
            s.resize(ino, Some(MIB), MIB, false).unwrap();
            ino
        };
        let wide = {
            let ino = s
                .create_entry(&c, ROOT_INO, "wide", 0o644, Some(&spread))
                .unwrap()
                .ino;
            s.resize(ino, Some(8 * MIB), 8 * MIB, false).unwrap();
            ino
        };
        spread.hostalloc = Some("1,3".into());
        let elsewhere = s
            .create_entry(&c, ROOT_INO, "elsewhere", 0o644, Some(&spread))
            .unwrap()
            .ino;
        s.resize(elsewhere, Some(8 * MIB), 8 * MIB, false).unwrap();
        assert_eq!(s.register_host(&reg(2, 2)).unwrap(), Some(1));
        let lost = s.mark_lost_on(2, "host 2 restarted");
        assert_eq!(lost, vec![on2, wide]);
        assert!(s.mark_lost_on(2, "again").is_empty(), "marked once");
        for ino in [on2, wide] {
            let e = s.open_region(&c, ino, false).unwrap_err();
            assert_eq!(e.errno(), libc::EIO);
            assert!(e.to_string().contains("host 2 restarted"), "{e}");
            assert_eq!(s.region_info(ino, None).unwrap_err().errno(), libc::EIO);
            assert_eq!(
                s.resize(ino, Some(0), 0, true).unwrap_err().errno(),
                libc::EIO
            );
            assert!(s.inode(ino).is_ok(), "stat still works");
        }
        assert!(s.open_region(&c, elsewhere, true).is_ok());
        // The restarted daemon's resync leaves the lost chunks out.
        for p in s
            .alloc
            .host_pools(2)
            .map(|p| p.pool.gid)
            .collect::<Vec<_>>()
        {
            assert!(s.pool_chunks(p).unwrap().is_empty());
        }
        // Unlink works and frees the memory.
        let free = s.alloc.host_free(2);
        s.unlink(&c, ROOT_INO, "on2").unwrap();
        assert_eq!(s.alloc.host_free(2), free + MIB);
        assert!(s.listxattr(&c, wide).unwrap().iter().all(|n| n != LOST_KEY));
    }
}
