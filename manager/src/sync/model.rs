//! Sync operations on the manager's state: creating, checking and deleting named objects,
//! allocating lock-word slots in the lock region, and the stored form of sync records.

use regions_proto::layout::{CHUNK_SIZE, MapEntry};

use super::objects::*;
use crate::access::{Caller, READ, WRITE};
use crate::error::{ManagerError, Result};
use crate::model::{Kind, ROOT_INO, RegionAttrs};
use crate::state::State;

impl State {
    /// Gives a lock region made by an earlier version (mode 0666) the mode
    /// [`LOCK_REGION_MODE`]; returns whether it changed.
    pub fn restrict_lock_region(&mut self) -> bool {
        let Some(ino) = self.sync.lock_region.as_ref().map(|r| r.ino) else {
            return false;
        };
        let Ok(inode) = self.inode(ino) else {
            return false;
        };
        if inode.mode & 0o7777 == LOCK_REGION_MODE && inode.uid == 0 {
            return false;
        }
        let mut inode = inode.clone();
        inode.mode = (inode.mode & !0o7777) | LOCK_REGION_MODE;
        inode.uid = 0;
        self.put_inode(inode);
        true
    }
}

/// Loads one stored sync record.
pub fn load_record(state: &mut State, key: &str, bytes: &[u8]) -> Result<(), postcard::Error> {
    if key == LOCK_REGION_KEY {
        state.sync.lock_region = Some(postcard::from_bytes(bytes)?);
    } else {
        // Records written before objects had owners hold the definition alone.
        let record = match postcard::from_bytes::<SyncRecord>(bytes) {
            Ok(r) => r,
            Err(_) => SyncRecord {
                def: postcard::from_bytes(bytes)?,
                owner: SyncOwner::LEGACY,
            },
        };
        state.sync.defs.insert(key.to_owned(), record.def);
        state.sync.owners.insert(key.to_owned(), record.owner);
    }
    Ok(())
}

/// The stored form of sync record `key` (`None`: deleted).
pub fn record_of(state: &State, key: &str) -> Result<Option<Vec<u8>>, postcard::Error> {
    if key == LOCK_REGION_KEY {
        state
            .sync
            .lock_region
            .as_ref()
            .map(postcard::to_allocvec)
            .transpose()
    } else {
        state
            .sync
            .defs
            .get(key)
            .map(|def| {
                postcard::to_allocvec(&SyncRecord {
                    def: def.clone(),
                    owner: state.sync_owner(key),
                })
            })
            .transpose()
    }
}

impl State {
    /// The definition of `name`.
    pub fn sync_def(&self, name: &str) -> Result<SyncDef> {
        check_name(name)?;
        self.sync.defs.get(name).cloned().ok_or_else(|| {
            ManagerError::NotFound(format!(
                "sync object {name:?} (create it first with the matching init call)"
            ))
        })
    }

    /// The owner and mode of `name` ([`SyncOwner::LEGACY`] for objects stored without one).
    fn sync_owner(&self, name: &str) -> SyncOwner {
        self.sync
            .owners
            .get(name)
            .copied()
            .unwrap_or(SyncOwner::LEGACY)
    }

    /// Checks that `caller` may use `name` with `mask` (READ, WRITE) permission.
    pub fn sync_check(&self, caller: &Caller, name: &str, mask: u32, what: &str) -> Result<()> {
        self.sync_def(name)?;
        let owner = self.sync_owner(name);
        if crate::access::allows_bits(caller, owner.uid, owner.gid, owner.mode, false, mask) {
            Ok(())
        } else {
            Err(ManagerError::Access(format!(
                "uid {} may not {what} sync object {name:?} (mode {:o}, owner {}:{})",
                caller.uid, owner.mode, owner.uid, owner.gid
            )))
        }
    }

    /// Creates `name` as `def` owned by the caller with permission bits `mode` (default
    /// [`DEFAULT_SYNC_MODE`]); a mutex's or barrier's slot is allocated here (the offset in
    /// `def` is ignored). An existing object with the same kind and parameters is left as it
    /// is, if the caller may use it; anything else is `EEXIST`.
    pub fn sync_init(
        &mut self,
        caller: &Caller,
        name: &str,
        def: SyncDef,
        mode: Option<u32>,
    ) -> Result<SyncDef> {
        self.sync_init_in(caller, name, def, mode, None)
    }

    /// [`State::sync_init`], giving a new mutex or barrier the word at `slot` when one is
    /// given (a reused slot whose word the caller cleared, see [`State::take_reusable_slot`]).
    pub fn sync_init_in(
        &mut self,
        caller: &Caller,
        name: &str,
        def: SyncDef,
        mode: Option<u32>,
        slot: Option<u64>,
    ) -> Result<SyncDef> {
        check_name(name)?;
        if let SyncDef::Barrier { n: 0 } | SyncDef::BarrierWord { n: 0, .. } = def {
            return Err(ManagerError::Invalid(format!(
                "barrier {name:?} with 0 parties; use 1 or more"
            )));
        }
        if let Some(existing) = self.sync.defs.get(name) {
            let same = match (existing, &def) {
                (SyncDef::Mutex { .. }, SyncDef::Mutex { .. }) => true,
                (
                    SyncDef::Barrier { n: a } | SyncDef::BarrierWord { n: a, .. },
                    SyncDef::Barrier { n: b } | SyncDef::BarrierWord { n: b, .. },
                ) => a == b,
                (a, b) => a == b,
            };
            if same {
                let existing = existing.clone();
                self.sync_check(caller, name, READ | WRITE, "use")?;
                return Ok(existing);
            }
            return Err(ManagerError::Exists(format!(
                "sync object {name:?} as a {} with other parameters ({existing:?}); delete it first",
                existing.kind()
            )));
        }
        let mut word = || match slot {
            Some(offset) => Ok(offset),
            None => self.alloc_lock_slot(caller.host_id),
        };
        let def = match def {
            SyncDef::Mutex { .. } => SyncDef::Mutex { offset: word()? },
            SyncDef::Barrier { n } | SyncDef::BarrierWord { n, .. } => {
                SyncDef::BarrierWord { n, offset: word()? }
            }
            other => other,
        };
        self.sync.defs.insert(name.to_owned(), def.clone());
        self.sync.owners.insert(
            name.to_owned(),
            SyncOwner {
                uid: caller.uid,
                gid: caller.gid,
                mode: mode.unwrap_or(DEFAULT_SYNC_MODE) & 0o777,
            },
        );
        self.dirty.sync.insert(name.to_owned());
        Ok(def)
    }

    /// Deletes `name` as `caller`, its owner or root (the service marks a word [`DELETED`];
    /// its slot is not reused).
    pub fn sync_delete(&mut self, caller: &Caller, name: &str) -> Result<SyncDef> {
        let def = self.sync_def(name)?;
        let owner = self.sync_owner(name);
        if !caller.is_root() && caller.uid != owner.uid {
            return Err(ManagerError::Perm(format!(
                "only its owner (uid {}) or root may delete sync object {name:?}",
                owner.uid
            )));
        }
        self.sync.defs.remove(name);
        self.sync.owners.remove(name);
        self.dirty.sync.insert(name.to_owned());
        if let Some(offset) = def.word_offset() {
            // Tokens for the slot live at most one capability lifetime (and cached locations
            // are located again by then): after that, nobody but a new object reaches it. The
            // margin covers a locate that read the definition just before the delete and
            // mints its token a little later, and daemon clocks a little behind.
            let ttl = u32::try_from(self.capability_ttl.as_secs()).unwrap_or(u32::MAX);
            let after = unix_secs()
                .saturating_add(ttl)
                .saturating_add(SLOT_REUSE_MARGIN_SECS.min(ttl));
            self.free_lock_slot(offset, after);
        }
        Ok(def)
    }

    /// Puts the slot at `offset` on the free list, reusable from Unix second `after_secs`.
    pub fn free_lock_slot(&mut self, offset: u64, after_secs: u32) {
        let Some(region) = self.sync.lock_region.as_mut() else {
            return;
        };
        let Ok(index) = u32::try_from(offset / SLOT_STRIDE) else {
            return;
        };
        region.free.push(FreeSlot { index, after_secs }.pack());
        self.dirty.sync.insert(LOCK_REGION_KEY.to_owned());
    }

    /// Takes a freed slot whose capabilities have all expired, if any (its word still holds
    /// what the deleted object left: clear it before use). `None`: allocate a new slot.
    pub fn take_reusable_slot(&mut self) -> Option<u64> {
        let now = unix_secs();
        let region = self.sync.lock_region.as_mut()?;
        let at = region
            .free
            .iter()
            .position(|raw| FreeSlot::unpack(*raw).after_secs <= now)?;
        let slot = FreeSlot::unpack(region.free.swap_remove(at));
        self.dirty.sync.insert(LOCK_REGION_KEY.to_owned());
        Some(u64::from(slot.index) * SLOT_STRIDE)
    }

    /// A new lock-word slot (one never used before), creating or growing the lock region as
    /// needed (placed on `host` when it is the first, like a region created there).
    fn alloc_lock_slot(&mut self, host: u32) -> Result<u64> {
        let created = match &self.sync.lock_region {
            Some(r) => {
                if self.region(r.ino).is_err() {
                    return Err(ManagerError::Store(format!(
                        "the lock region {} of the sync service is missing",
                        r.ino
                    )));
                }
                None
            }
            None => {
                let root = self.inode(ROOT_INO)?.clone();
                let mut inode =
                    self.new_inode(Kind::Region, LOCK_REGION_MODE, &Caller::root(host), &root);
                // No name: nobody can open or unlink it through the namespace.
                inode.nlink = 1;
                inode.attrs = RegionAttrs {
                    persistent: true,
                    ..RegionAttrs::default()
                };
                let ino = inode.ino;
                self.put_inode(inode);
                self.sync.lock_region = Some(LockRegion {
                    ino,
                    next: 0,
                    free: Vec::new(),
                });
                Some(ino)
            }
        };
        let (ino, next) = match &self.sync.lock_region {
            Some(r) => (r.ino, r.next),
            None => return Err(ManagerError::Store("lock region vanished".into())),
        };
        let offset = next * SLOT_STRIDE;
        let size = self.region(ino)?.size;
        if offset + SLOT_STRIDE > size {
            let grown = (offset + SLOT_STRIDE).div_ceil(CHUNK_SIZE) * CHUNK_SIZE;
            if let Err(e) = self.resize(ino, Some(grown), grown, false) {
                if let Some(ino) = created {
                    // Undo: no half-made lock region.
                    self.maps.remove(&ino);
                    self.inodes.remove(&ino);
                    self.sync.lock_region = None;
                }
                return Err(e);
            }
        }
        if let Some(r) = self.sync.lock_region.as_mut() {
            r.next += 1;
        }
        self.dirty.sync.insert(LOCK_REGION_KEY.to_owned());
        Ok(offset)
    }

    /// Where the lock word at `offset` of the lock region lives.
    pub fn lock_word(&self, offset: u64) -> Result<WordPlace> {
        let region =
            self.sync.lock_region.as_ref().ok_or_else(|| {
                ManagerError::NotFound("the lock region (no mutex exists)".into())
            })?;
        self.check_not_lost(region.ino)?;
        let map = self.maps.get(&region.ino).map_or(&[][..], Vec::as_slice);
        let entry = map
            .get((offset / CHUNK_SIZE) as usize)
            .and_then(|raw| MapEntry::decode(*raw))
            .ok_or_else(|| {
                ManagerError::Store(format!("lock word at {offset} has no memory behind it"))
            })?;
        let host_id = self.pool_host(entry.gid).unwrap_or(0);
        let transport_addr = self
            .hosts
            .get(&host_id)
            .map(|h| h.transport_addr.clone())
            .unwrap_or_default();
        Ok(WordPlace {
            ino: region.ino,
            region_offset: offset,
            pool: entry.gid,
            pool_offset: entry.pool_offset + offset % CHUNK_SIZE,
            host_id,
            transport_addr,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::cluster::HostRegistration;

    use super::*;

    fn state() -> State {
        let mut s = State::new(Duration::from_secs(10), 0o1777);
        s.register_host(&HostRegistration {
            host_id: 1,
            transport_addr: "127.0.0.1:1".into(),
            agent_socket: String::new(),
            memory_offered: 8 * CHUNK_SIZE,
            incarnation: 1,
            transports: String::new(),
            object_memory: 0,
        })
        .unwrap();
        s.register_pool(1, 0, 8 * CHUNK_SIZE).unwrap();
        s
    }

    #[test]
    fn sync_objects_belong_to_their_creator() {
        let mut s = state();
        let user = |uid: u32| Caller {
            uid,
            gid: uid,
            host_id: 1,
            ..Caller::default()
        };
        s.sync_init(&user(1000), "mine", SyncDef::Bell, None)
            .unwrap();
        s.sync_init(&user(1000), "ours", SyncDef::Bell, Some(0o662))
            .unwrap();
        assert_eq!(
            s.sync.owners["mine"],
            SyncOwner {
                uid: 1000,
                gid: 1000,
                mode: DEFAULT_SYNC_MODE
            }
        );
        let other = user(1001);
        for (name, mask, errno) in [
            ("mine", READ, Some(libc::EACCES)),
            ("mine", WRITE, Some(libc::EACCES)),
            ("ours", WRITE, None),
            ("ours", READ, Some(libc::EACCES)),
        ] {
            let r = s.sync_check(&other, name, mask, "use");
            assert_eq!(r.err().map(|e| e.errno()), errno, "{name} mask {mask}");
        }
        assert_eq!(
            s.sync_init(&other, "mine", SyncDef::Bell, None)
                .unwrap_err()
                .errno(),
            libc::EACCES,
            "init of an existing object is a use"
        );
        assert!(
            s.sync_check(&Caller::root(1), "mine", READ | WRITE, "use")
                .is_ok()
        );
        assert_eq!(
            s.sync_delete(&other, "ours").unwrap_err().errno(),
            libc::EPERM
        );
        // Owners survive the store; records from before owners load as root's, mode 0666.
        let bytes = record_of(&s, "ours").unwrap().unwrap();
        let legacy = postcard::to_allocvec(&SyncDef::Bell).unwrap();
        let mut t = state();
        load_record(&mut t, "ours", &bytes).unwrap();
        load_record(&mut t, "legacy", &legacy).unwrap();
        assert_eq!(t.sync.owners["ours"], s.sync.owners["ours"]);
        assert_eq!(t.sync.owners["legacy"], SyncOwner::LEGACY);
        assert!(t.sync_check(&other, "legacy", READ | WRITE, "use").is_ok());
        s.sync_delete(&user(1000), "ours").unwrap();
        assert!(!s.sync.owners.contains_key("ours"));
    }

    #[test]
    fn deleted_slots_are_reused_after_a_capability_lifetime() {
        let mut s = state();
        let c = Caller::root(1);
        let barrier = |n| SyncDef::BarrierWord { n, offset: 0 };
        let mutex = SyncDef::Mutex { offset: 0 };
        assert_eq!(
            s.sync_init(&c, "b", barrier(0), None).unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(
            s.sync_init(&c, "b", barrier(2), None).unwrap(),
            SyncDef::BarrierWord { n: 2, offset: 0 }
        );
        assert_eq!(
            s.sync_init(&c, "b", barrier(2), None).unwrap(),
            SyncDef::BarrierWord { n: 2, offset: 0 },
            "same parameters: the existing barrier"
        );
        assert_eq!(
            s.sync_init(&c, "b", barrier(3), None).unwrap_err().errno(),
            libc::EEXIST
        );
        assert_eq!(
            s.sync_init(&c, "b", mutex.clone(), None)
                .unwrap_err()
                .errno(),
            libc::EEXIST
        );
        assert_eq!(
            s.sync_init(&c, "m", mutex.clone(), None).unwrap(),
            SyncDef::Mutex {
                offset: SLOT_STRIDE
            }
        );
        s.sync_delete(&c, "m").unwrap();
        s.sync_delete(&c, "b").unwrap();
        assert_eq!(s.sync_def("m").unwrap_err().errno(), libc::ENOENT);
        assert_eq!(
            s.sync_init(&c, "m", mutex.clone(), None).unwrap(),
            SyncDef::Mutex {
                offset: 2 * SLOT_STRIDE
            },
            "a deleted object's slot is not reused while tokens for it may live"
        );
        let place = s.lock_word(2 * SLOT_STRIDE).unwrap();
        assert_eq!((place.host_id, place.region_offset), (1, 2 * SLOT_STRIDE));
        // The freed slots wait one capability lifetime, and the free list is stored.
        let free: Vec<FreeSlot> = s
            .sync
            .lock_region
            .as_ref()
            .unwrap()
            .free
            .iter()
            .map(|r| FreeSlot::unpack(*r))
            .collect();
        assert_eq!(free.iter().map(|f| f.index).collect::<Vec<_>>(), vec![1, 0]);
        assert!(free.iter().all(|f| f.after_secs > unix_secs() + 500));
        assert_eq!(s.take_reusable_slot(), None);
        let stored = record_of(&s, LOCK_REGION_KEY).unwrap().unwrap();
        let mut t = state();
        load_record(&mut t, LOCK_REGION_KEY, &stored).unwrap();
        assert_eq!(t.sync.lock_region, s.sync.lock_region);
        // Once they are due, they are handed out (and used by init) before new ones.
        s.sync.lock_region.as_mut().unwrap().free = free
            .iter()
            .map(|f| {
                FreeSlot {
                    after_secs: 0,
                    ..*f
                }
                .pack()
            })
            .collect();
        let slot = s.take_reusable_slot().unwrap();
        assert_eq!(slot, SLOT_STRIDE);
        assert_eq!(
            s.sync_init_in(&c, "reused", mutex, None, Some(slot))
                .unwrap(),
            SyncDef::Mutex {
                offset: SLOT_STRIDE
            }
        );
        assert_eq!(s.take_reusable_slot(), Some(0));
        assert_eq!(s.take_reusable_slot(), None);
        assert_eq!(
            FreeSlot::unpack(
                FreeSlot {
                    index: 7,
                    after_secs: 9
                }
                .pack()
            )
            .index,
            7
        );
    }

    #[test]
    fn stored_barriers_without_words_still_load_and_match() {
        let mut s = state();
        // A record written before barriers had words.
        let legacy = postcard::to_allocvec(&SyncDef::Barrier { n: 2 }).unwrap();
        load_record(&mut s, "old", &legacy).unwrap();
        assert_eq!(s.sync_def("old").unwrap(), SyncDef::Barrier { n: 2 });
        let c = Caller::root(1);
        assert_eq!(
            s.sync_init(&c, "old", SyncDef::BarrierWord { n: 2, offset: 0 }, None)
                .unwrap(),
            SyncDef::Barrier { n: 2 }
        );
        assert_eq!(
            s.sync_init(&c, "old", SyncDef::BarrierWord { n: 3, offset: 0 }, None)
                .unwrap_err()
                .errno(),
            libc::EEXIST
        );
        // New definitions and the lock region round-trip through their records.
        s.sync_init(&c, "new", SyncDef::BarrierWord { n: 4, offset: 0 }, None)
            .unwrap();
        let mut t = state();
        for key in ["new", LOCK_REGION_KEY] {
            let bytes = record_of(&s, key).unwrap().unwrap();
            load_record(&mut t, key, &bytes).unwrap();
        }
        assert_eq!(t.sync.defs["new"], s.sync.defs["new"]);
        assert_eq!(t.sync.lock_region, s.sync.lock_region);
    }

    #[test]
    fn tags_out_of_range_are_refused_clearly() {
        assert_eq!(tag(1 << 16, 1, 1).unwrap_err().errno(), libc::EINVAL);
        let err = tag(1, 1 << 22, 0).unwrap_err();
        assert!(err.to_string().contains("pid_max"), "{err}");
        let t = tag(3, 4, 5).unwrap();
        assert_eq!((tag_host(t | WAITERS), tag_pid(t)), (3, 4));
    }
}
