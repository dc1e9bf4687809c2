//! Names beyond "one region, one name": symbolic links, hard links, and the
//! special files (FIFOs, sockets, device nodes) that are namespace entries
//! without region memory.
//!
//! A symbolic link keeps its target in its inode at the manager; the kernel
//! of the host that reads it does the following. A hard link is one more
//! directory entry for an inode: `nlink` counts the names, and the region
//! (its memory, ONEWRITER, OWNERPID, PERSISTENT) belongs to the inode, so it
//! lives until the last name is gone and the last handle is closed.

use crate::access::{self, Caller};
use crate::error::{ManagerError, Result};
use crate::model::{Inode, Kind, MAX_SYMLINK_LEN, Time};
use crate::state::State;

/// Most names one inode may have (ext4's limit): `link` beyond it is `EMLINK`.
pub const MAX_LINKS: u32 = 65_000;

impl State {
    /// Makes `name` in `parent` a symbolic link to `target`.
    pub fn symlink(
        &mut self,
        caller: &Caller,
        parent: u64,
        name: &str,
        target: &[u8],
    ) -> Result<Inode> {
        if target.is_empty() {
            return Err(ManagerError::NotFound(
                "an empty symbolic link target".into(),
            ));
        }
        if target.len() > MAX_SYMLINK_LEN {
            return Err(ManagerError::TargetTooLong(target.len()));
        }
        if target.contains(&0) {
            return Err(ManagerError::Invalid(
                "a symbolic link target may not contain NUL".into(),
            ));
        }
        let dir = self.check_new_entry(caller, parent, name)?;
        let mut inode = self.new_inode(Kind::Symlink, 0o777, caller, &dir);
        inode.size = target.len() as u64;
        inode.target = target.to_vec();
        self.add_new_entry(parent, name, inode)
    }

    /// The target of symbolic link `ino` (`EINVAL` for any other kind, as
    /// `readlink(2)` gives).
    pub fn readlink(&self, caller: &Caller, ino: u64) -> Result<Vec<u8>> {
        let inode = self.inode(ino)?;
        self.check_path(caller, ino)?;
        if inode.kind != Kind::Symlink {
            return Err(ManagerError::Invalid(format!(
                "inode {ino} is not a symbolic link"
            )));
        }
        Ok(inode.target.clone())
    }

    /// Makes a FIFO, socket or device node `name` in `parent`.
    pub fn make_node(
        &mut self,
        caller: &Caller,
        parent: u64,
        name: &str,
        kind: Kind,
        mode: u32,
        rdev: u64,
    ) -> Result<Inode> {
        if !kind.is_special() || kind == Kind::Symlink {
            return Err(ManagerError::Invalid(format!(
                "mknod makes FIFOs, sockets and device nodes, not a {kind:?}"
            )));
        }
        let device = matches!(kind, Kind::CharDevice | Kind::BlockDevice);
        if device && !caller.is_root() {
            return Err(ManagerError::Perm("only root may make device nodes".into()));
        }
        let dir = self.check_new_entry(caller, parent, name)?;
        let mut inode = self.new_inode(kind, mode, caller, &dir);
        inode.rdev = if device { rdev } else { 0 };
        self.add_new_entry(parent, name, inode)
    }

    /// Enters a new non-directory inode under `name` in `parent`.
    fn add_new_entry(&mut self, parent: u64, name: &str, inode: Inode) -> Result<Inode> {
        let ino = inode.ino;
        let now = inode.ctime;
        self.put_inode(inode.clone());
        self.add_entry(parent, name, ino)?;
        self.touch_dir(parent, now)?;
        Ok(inode)
    }

    /// Gives inode `ino` the further name `new_name` in `new_parent`.
    pub fn link(
        &mut self,
        caller: &Caller,
        ino: u64,
        new_parent: u64,
        new_name: &str,
    ) -> Result<Inode> {
        let inode = self.inode(ino)?;
        if inode.is_dir() {
            return Err(ManagerError::Perm(format!(
                "inode {ino} is a directory; directories cannot have hard links"
            )));
        }
        if inode.nlink == 0 {
            return Err(ManagerError::NotFound(format!(
                "inode {ino} was unlinked; it cannot get a name again"
            )));
        }
        if inode.nlink >= MAX_LINKS {
            return Err(ManagerError::TooManyLinks(ino));
        }
        if self.names_of(ino).is_empty() {
            // An internal region (the sync service's lock words) has no name to add to.
            return Err(ManagerError::NotFound(format!(
                "inode {ino} has no name in the namespace"
            )));
        }
        Self::check_linkable(caller, inode)?;
        self.check_path(caller, ino)?;
        self.check_new_entry(caller, new_parent, new_name)?;
        let now = Time::now();
        self.add_entry(new_parent, new_name, ino)?;
        let inode = self.inode_mut(ino)?;
        inode.nlink += 1;
        inode.ctime = now;
        let linked = inode.clone();
        self.touch_dir(new_parent, now)?;
        Ok(linked)
    }

    /// Every (directory, name) under which `ino` appears. One lookup for an
    /// inode with one name; a scan of the directories for a hard-linked one.
    pub fn names_of(&self, ino: u64) -> Vec<(u64, String)> {
        match self.inodes.get(&ino).map(|i| (i.nlink, i.parent)) {
            None | Some((0, _)) => Vec::new(),
            Some((1, parent)) => self.names_in(parent, ino),
            Some(_) => self.scan_names(ino),
        }
    }

    /// The names of `ino` in directory `dir`.
    fn names_in(&self, dir: u64, ino: u64) -> Vec<(u64, String)> {
        self.dirs
            .get(&dir)
            .map(|d| {
                d.by_name
                    .iter()
                    .filter(|(_, e)| e.ino == ino)
                    .map(|(n, _)| (dir, n.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The names of `ino` in every directory, in directory order.
    fn scan_names(&self, ino: u64) -> Vec<(u64, String)> {
        let mut dirs: Vec<u64> = self.dirs.keys().copied().collect();
        dirs.sort_unstable();
        dirs.into_iter()
            .flat_map(|d| self.names_in(d, ino))
            .collect()
    }

    /// The directory entry `name` of `parent`, which named `ino`, is gone:
    /// one link less. The last name frees the region now, or at its last
    /// close; otherwise `parent` of the inode moves to a directory that still
    /// holds a name.
    pub(crate) fn drop_name(&mut self, ino: u64, parent: u64, now: Time) -> Result<()> {
        let inode = self.inode_mut(ino)?;
        inode.nlink = inode.nlink.saturating_sub(1);
        inode.ctime = now;
        if inode.nlink > 0 {
            if inode.parent == parent
                && let Some((dir, _)) = self.scan_names(ino).into_iter().next()
            {
                self.inode_mut(ino)?.parent = dir;
            }
            return Ok(());
        }
        inode.parent = 0;
        if self.open.contains_key(&ino) {
            // Access granted through the name ends with it; holders of open handles renew.
            // (A region freed now needs no revocation: its chunks are released before they
            // can back anything else.)
            self.revoke_capabilities(ino);
        } else {
            self.free_region(ino);
        }
        Ok(())
    }

    /// Whether `caller` may give `ino` another name: the owner, root, or (as
    /// the kernel's `protected_hardlinks` rule) a user who may read and
    /// write a regular, non-setuid file. The mount's kernel applies this rule
    /// before asking; the manager applies it again for every client.
    pub(crate) fn check_linkable(caller: &Caller, inode: &Inode) -> Result<()> {
        if caller.is_root() || caller.owns(inode) {
            return Ok(());
        }
        let setid = inode.mode & access::S_ISUID != 0
            || inode.mode & (access::S_ISGID | 0o010) == (access::S_ISGID | 0o010);
        if inode.kind == Kind::Region
            && !setid
            && access::allows(caller, inode, access::READ | access::WRITE)
        {
            return Ok(());
        }
        Err(ManagerError::Perm(format!(
            "uid {} may not link inode {}: it is not the owner and cannot read and write it",
            caller.uid, inode.ino
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ROOT_INO;
    use crate::test_support::{errno, root, state, user};

    #[test]
    fn symlinks_keep_their_target_and_refuse_bad_ones() {
        let mut s = state();
        let l = s
            .symlink(&user(1000), ROOT_INO, "l", b"some/where")
            .unwrap();
        assert_eq!(
            (l.kind, l.size, l.mode, l.uid),
            (Kind::Symlink, 10, 0o777, 1000)
        );
        assert_eq!(s.readlink(&root(), l.ino).unwrap(), b"some/where");
        assert_eq!(s.lookup(&root(), ROOT_INO, "l").unwrap().ino, l.ino);
        assert_eq!(errno(s.symlink(&root(), ROOT_INO, "e", b"")), libc::ENOENT);
        let long = vec![b'x'; MAX_SYMLINK_LEN + 1];
        assert_eq!(
            errno(s.symlink(&root(), ROOT_INO, "e", &long)),
            libc::ENAMETOOLONG
        );
        assert!(s.symlink(&root(), ROOT_INO, "max", &long[1..]).is_ok());
        assert_eq!(errno(s.symlink(&root(), ROOT_INO, "l", b"x")), libc::EEXIST);
        let f = s.create_entry(&root(), ROOT_INO, "f", 0o644, None).unwrap();
        assert_eq!(errno(s.readlink(&root(), f.ino)), libc::EINVAL);
        assert_eq!(errno(s.open_region(&root(), l.ino, false)), libc::EINVAL);
        s.unlink(&user(1000), ROOT_INO, "l").unwrap();
        assert_eq!(errno(s.inode(l.ino)), libc::ENOENT);
    }

    #[test]
    fn a_region_lives_until_its_last_name_goes() {
        let mut s = state();
        let a = s.mkdir(&root(), ROOT_INO, "a", 0o755).unwrap();
        let b = s.mkdir(&root(), ROOT_INO, "b", 0o755).unwrap();
        let f = s.create_entry(&root(), a.ino, "f", 0o644, None).unwrap();
        let linked = s.link(&root(), f.ino, b.ino, "g").unwrap();
        assert_eq!(linked.nlink, 2);
        assert_eq!(s.lookup(&root(), b.ino, "g").unwrap().ino, f.ino);
        assert_eq!(
            s.names_of(f.ino),
            [(a.ino, "f".into()), (b.ino, "g".into())]
        );
        // The first name goes: the region stays, and its parent is the other name's.
        s.unlink(&root(), a.ino, "f").unwrap();
        let left = s.inode(f.ino).unwrap();
        assert_eq!((left.nlink, left.parent), (1, b.ino));
        // Rename over another name of the same inode changes nothing.
        s.link(&root(), f.ino, b.ino, "h").unwrap();
        s.rename(&root(), b.ino, "g", b.ino, "h", 0).unwrap();
        assert_eq!(s.inode(f.ino).unwrap().nlink, 2);
        assert!(s.child(b.ino, "g").is_some() && s.child(b.ino, "h").is_some());
        // Rename of another file over one name drops only that name.
        s.create_entry(&root(), b.ino, "x", 0o644, None).unwrap();
        s.rename(&root(), b.ino, "x", b.ino, "g", 0).unwrap();
        assert_eq!(s.inode(f.ino).unwrap().nlink, 1);
        s.unlink(&root(), b.ino, "h").unwrap();
        assert_eq!(
            errno(s.inode(f.ino)),
            libc::ENOENT,
            "freed with its last name"
        );
    }

    #[test]
    fn link_refuses_directories_missing_inodes_and_strangers() {
        let mut s = state();
        let d = s.mkdir(&root(), ROOT_INO, "d", 0o777).unwrap();
        assert_eq!(errno(s.link(&root(), d.ino, ROOT_INO, "d2")), libc::EPERM);
        assert_eq!(errno(s.link(&root(), 4242, ROOT_INO, "x")), libc::ENOENT);
        let f = s
            .create_entry(&user(1000), d.ino, "f", 0o600, None)
            .unwrap();
        assert_eq!(errno(s.link(&root(), f.ino, d.ino, "f")), libc::EEXIST);
        assert_eq!(
            errno(s.link(&user(2000), f.ino, d.ino, "mine")),
            libc::EPERM
        );
        assert!(s.link(&user(1000), f.ino, d.ino, "again").is_ok());
        assert!(
            s.child(d.ino, "mine").is_none(),
            "a refused link changes nothing"
        );
    }

    #[test]
    fn noreplace_over_a_link_nameless_inodes_and_xattrs_of_links() {
        let mut s = state();
        // RENAME_NOREPLACE over another name of the same inode: EEXIST, as for any name.
        let f = s.create_entry(&root(), ROOT_INO, "f", 0o644, None).unwrap();
        s.link(&root(), f.ino, ROOT_INO, "g").unwrap();
        assert_eq!(
            errno(s.rename(
                &root(),
                ROOT_INO,
                "f",
                ROOT_INO,
                "g",
                crate::namespace::RENAME_NOREPLACE
            )),
            libc::EEXIST
        );
        // An inode with no name (an internal region) gets none.
        let hidden = s
            .create_entry(&root(), ROOT_INO, "hidden", 0o666, None)
            .unwrap();
        s.remove_entry(ROOT_INO, "hidden");
        assert_eq!(
            errno(s.link(&root(), hidden.ino, ROOT_INO, "found")),
            libc::ENOENT
        );
        // user.* attributes stay off symbolic links and special files.
        let l = s.symlink(&root(), ROOT_INO, "l", b"f").unwrap();
        assert_eq!(
            errno(s.setxattr(&root(), l.ino, "user.a", b"1", 0)),
            libc::EPERM
        );
        assert_eq!(errno(s.getxattr(&root(), l.ino, "user.a")), libc::ENODATA);
        assert_eq!(errno(s.removexattr(&root(), l.ino, "user.a")), libc::EPERM);
    }

    #[test]
    fn a_hard_linked_inode_is_reachable_through_any_name() {
        let mut s = state();
        let owner = user(1000);
        let private = s.mkdir(&owner, ROOT_INO, "private", 0o700).unwrap();
        let public = s.mkdir(&owner, ROOT_INO, "public", 0o755).unwrap();
        let f = s
            .create_entry(&owner, private.ino, "f", 0o644, None)
            .unwrap();
        let other = Caller {
            by_inode: true,
            ..user(1001)
        };
        assert_eq!(errno(s.check_path(&other, f.ino)), libc::EACCES);
        s.link(&owner, f.ino, public.ino, "f").unwrap();
        assert!(
            s.check_path(&other, f.ino).is_ok(),
            "through the public name"
        );
        s.unlink(&owner, public.ino, "f").unwrap();
        assert_eq!(errno(s.check_path(&other, f.ino)), libc::EACCES);
    }

    #[test]
    fn special_files_hold_no_memory_and_devices_need_root() {
        let mut s = state();
        let fifo = s
            .make_node(&user(1000), ROOT_INO, "p", Kind::Fifo, 0o640, 7)
            .unwrap();
        assert_eq!((fifo.kind, fifo.rdev, fifo.mode), (Kind::Fifo, 0, 0o640));
        assert!(!s.maps.contains_key(&fifo.ino));
        assert_eq!(
            errno(s.make_node(&user(1000), ROOT_INO, "c", Kind::CharDevice, 0o600, 0x103)),
            libc::EPERM
        );
        let c = s
            .make_node(&root(), ROOT_INO, "c", Kind::CharDevice, 0o600, 0x103)
            .unwrap();
        assert_eq!(s.attr(&c).rdev, 0x103);
        assert_eq!(
            errno(s.make_node(&root(), ROOT_INO, "r", Kind::Region, 0o600, 0)),
            libc::EINVAL
        );
        assert_eq!(errno(s.open_region(&root(), fifo.ino, false)), libc::EINVAL);
        assert_eq!(errno(s.resize(fifo.ino, Some(10), 0, true)), libc::EINVAL);
    }
}
