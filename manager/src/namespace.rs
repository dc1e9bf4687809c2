//! Namespace operations: lookup, attributes, directories, regions' names,
//! rename, readdir and extended attributes, with POSIX permission checks.
//!
//! Every operation checks everything before it changes anything, so a
//! refused request leaves the state (and the store) untouched.

use regions_proto::v1;

use crate::access::{self, Caller, EXEC, READ, S_ISGID, S_ISUID, WRITE};
use crate::error::{ManagerError, Result};
use crate::model::{Inode, Kind, MAX_NAME_LEN, ROOT_INO, Time};
use crate::state::State;
use crate::xattr::{self, AttrName, RegionAttr, XATTR_CREATE, XATTR_REPLACE};

/// renameat2 flag: fail if the target exists.
pub const RENAME_NOREPLACE: u32 = 1;
/// renameat2 flag: swap source and target.
pub const RENAME_EXCHANGE: u32 = 2;

/// Drops one link (a subdirectory left); never wraps.
fn dec_nlink(dir: &mut Inode) {
    dir.nlink = dir.nlink.saturating_sub(1).max(2);
}

/// Checks a directory entry name.
pub fn check_name(name: &str) -> Result<()> {
    if name.len() > MAX_NAME_LEN {
        return Err(ManagerError::NameTooLong(name.len()));
    }
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(ManagerError::InvalidName(name.to_owned()));
    }
    Ok(())
}

/// A timestamp change requested by setattr.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeChange {
    Now,
    At(Time),
}

impl TimeChange {
    pub fn from_proto(t: Option<&v1::TimeSet>) -> Option<TimeChange> {
        match t?.how.as_ref()? {
            v1::time_set::How::Now(true) => Some(TimeChange::Now),
            v1::time_set::How::Now(false) => None,
            v1::time_set::How::Time(ts) => Some(TimeChange::At(Time::from_proto(ts))),
        }
    }
}

/// One entry listed by readdir.
#[derive(Debug)]
pub struct Listed<'a> {
    pub name: String,
    /// Cookie to resume after this entry.
    pub cookie: u64,
    pub inode: &'a Inode,
}

/// What setattr may change (size is handled by the region operations).
#[derive(Clone, Debug, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub atime: Option<TimeChange>,
    pub mtime: Option<TimeChange>,
    /// The change comes through a descriptor opened for writing on the
    /// caller's host: a size change was allowed at open (`ftruncate`).
    pub through_write_handle: bool,
}

impl State {
    /// Finds `name` in `parent`; needs search permission on the parent.
    pub fn lookup(&self, caller: &Caller, parent: u64, name: &str) -> Result<&Inode> {
        let dir = self.dir(parent)?;
        access::check(caller, dir, EXEC, "search this directory")?;
        let ino = match name {
            "." => parent,
            ".." => dir.parent,
            _ => {
                check_name(name)?;
                self.child(parent, name)
                    .ok_or_else(|| {
                        ManagerError::NotFound(format!("{name:?} in directory {parent}"))
                    })?
                    .ino
            }
        };
        self.inode(ino)
    }

    /// Checks that `name` may be added to `parent` by `caller`.
    pub(crate) fn check_new_entry(
        &self,
        caller: &Caller,
        parent: u64,
        name: &str,
    ) -> Result<Inode> {
        check_name(name)?;
        let dir = self.dir(parent)?;
        self.check_path(caller, parent)?;
        access::check(caller, dir, WRITE | EXEC, "add entries to this directory")?;
        if dir.nlink == 0 {
            return Err(ManagerError::NotFound(format!(
                "directory {parent} was removed"
            )));
        }
        if self.child(parent, name).is_some() {
            return Err(ManagerError::Exists(format!(
                "{name:?} in directory {parent}"
            )));
        }
        Ok(dir.clone())
    }

    /// Touches a directory's mtime and ctime after its entries changed.
    pub(crate) fn touch_dir(&mut self, ino: u64, now: Time) -> Result<()> {
        let dir = self.inode_mut(ino)?;
        dir.mtime = now;
        dir.ctime = now;
        Ok(())
    }

    pub fn mkdir(&mut self, caller: &Caller, parent: u64, name: &str, mode: u32) -> Result<Inode> {
        let dir = self.check_new_entry(caller, parent, name)?;
        let inode = self.new_inode(Kind::Directory, mode, caller, &dir);
        let ino = inode.ino;
        let now = inode.ctime;
        self.put_inode(inode);
        self.dirs.entry(ino).or_default();
        self.add_entry(parent, name, ino)?;
        let p = self.inode_mut(parent)?;
        p.nlink += 1;
        self.touch_dir(parent, now)?;
        Ok(self.inodes[&ino].clone())
    }

    /// Creates a region entry (allocation is the caller's next step).
    pub fn create_entry(
        &mut self,
        caller: &Caller,
        parent: u64,
        name: &str,
        mode: u32,
        overrides: Option<&v1::RegionAttrOverrides>,
    ) -> Result<Inode> {
        let dir = self.check_new_entry(caller, parent, name)?;
        let mut attrs = dir.attrs.clone();
        if let Some(o) = overrides {
            attrs.persistent = o.persistent.unwrap_or(attrs.persistent);
            attrs.multihosted = o.multihosted.unwrap_or(attrs.multihosted);
            attrs.fixvaddr = o.fixvaddr.unwrap_or(attrs.fixvaddr);
            attrs.onewriter = o.onewriter.unwrap_or(attrs.onewriter);
            if let Some(h) = &o.hostalloc {
                attrs.hostalloc = xattr::parse_hostalloc(h.as_bytes())?;
            }
        }
        let mut inode = self.new_inode(Kind::Region, mode, caller, &dir);
        inode.attrs = attrs;
        let ino = inode.ino;
        let now = inode.ctime;
        self.put_inode(inode);
        self.maps.insert(ino, Vec::new());
        self.add_entry(parent, name, ino)?;
        self.touch_dir(parent, now)?;
        Ok(self.inodes[&ino].clone())
    }

    /// Checks that `caller` may remove entry `name` of `parent`; returns it.
    fn check_remove(&self, caller: &Caller, parent: u64, name: &str) -> Result<Inode> {
        check_name(name)?;
        let dir = self.dir(parent)?;
        access::check(
            caller,
            dir,
            WRITE | EXEC,
            "remove entries from this directory",
        )?;
        let dirent = self
            .child(parent, name)
            .ok_or_else(|| ManagerError::NotFound(format!("{name:?} in directory {parent}")))?;
        let victim = self.inode(dirent.ino)?;
        access::check_sticky(caller, dir, victim)?;
        Ok(victim.clone())
    }

    pub fn rmdir(&mut self, caller: &Caller, parent: u64, name: &str) -> Result<()> {
        let victim = self.check_remove(caller, parent, name)?;
        if !victim.is_dir() {
            return Err(ManagerError::NotDir(format!("{name:?}")));
        }
        if !self.is_empty_dir(victim.ino) {
            return Err(ManagerError::NotEmpty(format!("{name:?}")));
        }
        self.remove_entry(parent, name);
        self.delete_dir(victim.ino);
        let now = Time::now();
        dec_nlink(self.inode_mut(parent)?);
        self.touch_dir(parent, now)
    }

    fn delete_dir(&mut self, ino: u64) {
        self.inodes.remove(&ino);
        self.dirs.remove(&ino);
        self.dirty.inodes.insert(ino);
    }

    /// Removes a region's name; its memory goes when the last handle closes. Returns the
    /// inode and the names it has left.
    pub fn unlink(&mut self, caller: &Caller, parent: u64, name: &str) -> Result<(u64, u32)> {
        let victim = self.check_remove(caller, parent, name)?;
        if victim.is_dir() {
            return Err(ManagerError::IsDir(format!("{name:?}; use rmdir")));
        }
        self.remove_entry(parent, name);
        let now = Time::now();
        self.drop_name(victim.ino, parent, now)?;
        self.touch_dir(parent, now)?;
        let left = self.inodes.get(&victim.ino).map_or(0, |i| i.nlink);
        Ok((victim.ino, left))
    }

    /// Whether `ino` is `ancestor` or lies below it.
    fn is_within(&self, mut ino: u64, ancestor: u64) -> bool {
        loop {
            if ino == ancestor {
                return true;
            }
            if ino == ROOT_INO {
                return false;
            }
            match self.inodes.get(&ino) {
                Some(i) if i.parent != ino && i.parent != 0 => ino = i.parent,
                _ => return false,
            }
        }
    }

    pub fn rename(
        &mut self,
        caller: &Caller,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        flags: u32,
    ) -> Result<()> {
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0
            || flags == RENAME_NOREPLACE | RENAME_EXCHANGE
        {
            return Err(ManagerError::Invalid(format!(
                "unsupported rename flags {flags:#x}"
            )));
        }
        check_name(new_name)?;
        let src = self.check_remove(caller, parent, name)?;
        let new_dir = self.dir(new_parent)?.clone();
        access::check(
            caller,
            &new_dir,
            WRITE | EXEC,
            "add entries to the target directory",
        )?;
        let target = self.child(new_parent, new_name).map(|d| d.ino);
        if target.is_some() && flags & RENAME_NOREPLACE != 0 {
            return Err(ManagerError::Exists(format!(
                "{new_name:?} in directory {new_parent}"
            )));
        }
        if target == Some(src.ino) {
            return Ok(()); // the same inode (one entry, or two hard links): nothing to do
        }
        if src.is_dir() && self.is_within(new_parent, src.ino) {
            return Err(ManagerError::Invalid(format!(
                "cannot move directory {name:?} into itself"
            )));
        }
        if src.is_dir() && parent != new_parent {
            access::check(
                caller,
                &src,
                WRITE,
                "move this directory (its \"..\" changes)",
            )?;
        }
        let target = match target {
            Some(ino) => Some(self.inode(ino)?.clone()),
            None => None,
        };
        if flags & RENAME_EXCHANGE != 0 {
            let target = target
                .ok_or_else(|| ManagerError::NotFound(format!("{new_name:?} to exchange with")))?;
            access::check_sticky(caller, &new_dir, &target)?;
            if target.is_dir() && self.is_within(parent, target.ino) {
                return Err(ManagerError::Invalid(
                    "cannot exchange a directory with its ancestor".into(),
                ));
            }
            if target.is_dir() && parent != new_parent {
                access::check(
                    caller,
                    &target,
                    WRITE,
                    "move this directory (its \"..\" changes)",
                )?;
            }
            return self.exchange(parent, name, &src, new_parent, new_name, &target);
        }
        if let Some(target) = &target {
            access::check_sticky(caller, &new_dir, target)?;
            match (src.is_dir(), target.is_dir()) {
                (true, false) => return Err(ManagerError::NotDir(format!("{new_name:?}"))),
                (false, true) => return Err(ManagerError::IsDir(format!("{new_name:?}"))),
                (true, true) if !self.is_empty_dir(target.ino) => {
                    return Err(ManagerError::NotEmpty(format!("{new_name:?}")));
                }
                _ => {}
            }
        }
        // All checks passed: change.
        let now = Time::now();
        if let Some(target) = target {
            self.remove_entry(new_parent, new_name);
            if target.is_dir() {
                self.delete_dir(target.ino);
                dec_nlink(self.inode_mut(new_parent)?);
            } else {
                self.drop_name(target.ino, new_parent, now)?;
            }
        }
        self.remove_entry(parent, name);
        self.add_entry(new_parent, new_name, src.ino)?;
        let moved = self.inode_mut(src.ino)?;
        if moved.parent == parent {
            moved.parent = new_parent;
        }
        moved.ctime = now;
        if src.is_dir() && parent != new_parent {
            dec_nlink(self.inode_mut(parent)?);
            self.inode_mut(new_parent)?.nlink += 1;
        }
        self.touch_dir(parent, now)?;
        self.touch_dir(new_parent, now)
    }

    fn exchange(
        &mut self,
        parent: u64,
        name: &str,
        src: &Inode,
        new_parent: u64,
        new_name: &str,
        target: &Inode,
    ) -> Result<()> {
        let now = Time::now();
        self.remove_entry(parent, name);
        self.remove_entry(new_parent, new_name);
        self.add_entry(new_parent, new_name, src.ino)?;
        self.add_entry(parent, name, target.ino)?;
        for (ino, from, to) in [
            (src.ino, parent, new_parent),
            (target.ino, new_parent, parent),
        ] {
            let i = self.inode_mut(ino)?;
            if i.parent == from {
                i.parent = to;
            }
            i.ctime = now;
        }
        if parent != new_parent && src.is_dir() != target.is_dir() {
            let (gains, loses) = if src.is_dir() {
                (new_parent, parent)
            } else {
                (parent, new_parent)
            };
            self.inode_mut(gains)?.nlink += 1;
            dec_nlink(self.inode_mut(loses)?);
        }
        self.touch_dir(parent, now)?;
        self.touch_dir(new_parent, now)
    }

    /// Entries of a directory after cookie `offset`, at most `limit`.
    pub fn readdir(
        &self,
        caller: &Caller,
        ino: u64,
        offset: u64,
        limit: usize,
    ) -> Result<(Vec<Listed<'_>>, bool)> {
        let dir = self.dir(ino)?;
        access::check(caller, dir, READ, "list this directory")?;
        let Some(index) = self.dirs.get(&ino) else {
            return Ok((Vec::new(), true));
        };
        let mut out = Vec::new();
        let mut rest = index.by_cookie.range(offset.saturating_add(1)..);
        for (&cookie, name) in rest.by_ref() {
            let Some(dirent) = index.by_name.get(name) else {
                continue;
            };
            if let Some(inode) = self.inodes.get(&dirent.ino) {
                out.push(Listed {
                    name: name.clone(),
                    cookie,
                    inode,
                });
            }
            if out.len() >= limit {
                break;
            }
        }
        let end = rest.next().is_none();
        Ok((out, end))
    }

    /// chmod, chown, utimens (size is [`State::resize`]'s).
    pub fn setattr(&mut self, caller: &Caller, ino: u64, change: &SetAttr) -> Result<Inode> {
        let inode = self.inode(ino)?.clone();
        let mut next = inode.clone();
        if let Some(mode) = change.mode {
            access::check_owner(caller, &inode, "change the mode of")?;
            let mut mode = mode & access::MODE_MASK;
            let gid = change.gid.unwrap_or(inode.gid);
            if !caller.is_root() && !inode.is_dir() && !caller.in_group(gid) {
                mode &= !S_ISGID;
            }
            next.mode = mode;
        }
        if let Some(uid) = change.uid
            && uid != inode.uid
            && !caller.is_root()
        {
            return Err(ManagerError::Perm(format!(
                "only root may give inode {ino} to another user"
            )));
        }
        if let Some(gid) = change.gid
            && gid != inode.gid
            && !caller.is_root()
            && !(caller.owns(&inode) && caller.in_group(gid))
        {
            return Err(ManagerError::Perm(format!(
                "only root, or the owner for a group it belongs to, may change the group of inode {ino}"
            )));
        }
        if change.uid.is_some() || change.gid.is_some() {
            next.uid = change.uid.unwrap_or(inode.uid);
            next.gid = change.gid.unwrap_or(inode.gid);
            if !caller.is_root() && !inode.is_dir() {
                next.mode &= !(S_ISUID | S_ISGID);
            }
        }
        let now = Time::now();
        for (requested, slot) in [
            (change.atime, &mut next.atime),
            (change.mtime, &mut next.mtime),
        ] {
            match requested {
                None => {}
                Some(TimeChange::Now) => {
                    if !caller.is_root()
                        && !caller.owns(&inode)
                        && !access::allows(caller, &inode, WRITE)
                    {
                        return Err(ManagerError::Access(format!(
                            "setting times of inode {ino} to now needs ownership or write permission"
                        )));
                    }
                    *slot = now;
                }
                Some(TimeChange::At(t)) => {
                    access::check_owner(caller, &inode, "set explicit times of")?;
                    *slot = t;
                }
            }
        }
        next.ctime = now;
        if (next.mode, next.uid, next.gid) != (inode.mode, inode.uid, inode.gid) {
            // Access granted under the old mode or owner ends (holders renew, and are checked
            // against the new ones).
            self.revoke_capabilities(ino);
        }
        self.put_inode(next.clone());
        Ok(next)
    }

    /// access(2).
    pub fn access(&self, caller: &Caller, ino: u64, mask: u32) -> Result<()> {
        let inode = self.inode(ino)?;
        self.check_path(caller, ino)?;
        access::check(caller, inode, mask & 7, "access this inode as asked")
    }

    pub fn getxattr(&self, caller: &Caller, ino: u64, name: &str) -> Result<Vec<u8>> {
        let inode = self.inode(ino)?;
        let parsed = xattr::parse_name(name)?;
        access::check(
            caller,
            inode,
            READ,
            "read extended attributes of this inode",
        )?;
        let bool_text = |b: bool| if b { b"1".to_vec() } else { b"0".to_vec() };
        let missing = || Err(ManagerError::NoAttr(name.to_owned()));
        match parsed {
            AttrName::Foreign(_) => missing(),
            AttrName::User(n) => inode.xattrs.get(&n).cloned().map_or_else(missing, Ok),
            AttrName::Region(attr) => {
                if inode.kind.is_special() || (inode.is_dir() && attr.is_read_only()) {
                    return missing();
                }
                Ok(match attr {
                    RegionAttr::Persistent => bool_text(inode.attrs.persistent),
                    RegionAttr::Multihosted => bool_text(inode.attrs.multihosted),
                    RegionAttr::Fixvaddr => bool_text(inode.attrs.fixvaddr),
                    RegionAttr::Onewriter => bool_text(inode.attrs.onewriter),
                    RegionAttr::Hostalloc => {
                        xattr::format_hosts(&inode.attrs.hostalloc).into_bytes()
                    }
                    RegionAttr::OwnerPid => inode.owner_pid.to_string().into_bytes(),
                    RegionAttr::Vaddr => format!("{:#x}", inode.vaddr).into_bytes(),
                    RegionAttr::Hosts => xattr::format_hosts(&self.region_hosts(ino)).into_bytes(),
                })
            }
        }
    }

    pub fn listxattr(&self, caller: &Caller, ino: u64) -> Result<Vec<String>> {
        let inode = self.inode(ino)?;
        access::check(
            caller,
            inode,
            READ,
            "list extended attributes of this inode",
        )?;
        let mut names: Vec<String> = if inode.kind.is_special() {
            Vec::new()
        } else {
            RegionAttr::SETTABLE.iter().map(|a| a.name()).collect()
        };
        if inode.is_region() {
            names.extend(RegionAttr::READ_ONLY.iter().map(|a| a.name()));
        }
        names.extend(
            inode
                .xattrs
                .keys()
                .filter(|k| k.starts_with("user."))
                .cloned(),
        );
        Ok(names)
    }

    /// Sets an attribute. Region attributes are validated; changing
    /// FIXVADDR of a region reserves or frees its address range.
    pub fn setxattr(
        &mut self,
        caller: &Caller,
        ino: u64,
        name: &str,
        value: &[u8],
        flags: u32,
    ) -> Result<()> {
        let inode = self.inode(ino)?.clone();
        let parsed = xattr::parse_name(name)?;
        xattr::check_value_len(value.len())?;
        if flags & !(XATTR_CREATE | XATTR_REPLACE) != 0 || flags == XATTR_CREATE | XATTR_REPLACE {
            return Err(ManagerError::Invalid(format!(
                "unsupported setxattr flags {flags:#x}"
            )));
        }
        let mut next = inode.clone();
        match parsed {
            AttrName::Foreign(n) => {
                return Err(ManagerError::NotSupported(format!(
                    "extended attribute {n} (only user.* attributes are kept)"
                )));
            }
            AttrName::User(n) => {
                Self::check_user_xattrs_allowed(&inode)?;
                access::check(
                    caller,
                    &inode,
                    WRITE,
                    "write extended attributes of this inode",
                )?;
                let exists = inode.xattrs.contains_key(&n);
                if flags & XATTR_CREATE != 0 && exists {
                    return Err(ManagerError::Exists(format!("extended attribute {n}")));
                }
                if flags & XATTR_REPLACE != 0 && !exists {
                    return Err(ManagerError::NoAttr(n));
                }
                let total: usize = inode
                    .xattrs
                    .iter()
                    .filter(|(k, _)| **k != n)
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>()
                    + n.len()
                    + value.len();
                if total > xattr::MAX_TOTAL_LEN {
                    return Err(ManagerError::NoSpace(format!(
                        "inode {ino} would hold {total} bytes of extended attributes, over the limit of {}",
                        xattr::MAX_TOTAL_LEN
                    )));
                }
                next.xattrs.insert(n, value.to_vec());
            }
            AttrName::Region(attr) => {
                if attr.is_read_only() {
                    return Err(ManagerError::Perm(format!("{} is read-only", attr.name())));
                }
                if inode.kind.is_special() {
                    return Err(ManagerError::NotSupported(format!(
                        "{} on a {:?} (region attributes belong to regions and directories)",
                        attr.name(),
                        inode.kind
                    )));
                }
                if flags & XATTR_CREATE != 0 {
                    return Err(ManagerError::Exists(attr.name()));
                }
                access::check_owner(caller, &inode, "change region attributes of")?;
                match attr {
                    RegionAttr::Persistent => {
                        next.attrs.persistent = xattr::parse_bool(attr, value)?
                    }
                    RegionAttr::Multihosted => {
                        next.attrs.multihosted = xattr::parse_bool(attr, value)?
                    }
                    RegionAttr::Onewriter => next.attrs.onewriter = xattr::parse_bool(attr, value)?,
                    RegionAttr::Hostalloc => next.attrs.hostalloc = xattr::parse_hostalloc(value)?,
                    RegionAttr::Fixvaddr => {
                        next.attrs.fixvaddr = xattr::parse_bool(attr, value)?;
                        if inode.is_region() {
                            self.set_fixvaddr(&mut next)?;
                        }
                    }
                    RegionAttr::OwnerPid | RegionAttr::Vaddr | RegionAttr::Hosts => {}
                }
            }
        }
        next.ctime = Time::now();
        self.put_inode(next);
        Ok(())
    }

    /// `user.*` attributes belong to regions and directories only, as Linux allows them on
    /// regular files and directories only (`EPERM` otherwise).
    fn check_user_xattrs_allowed(inode: &Inode) -> Result<()> {
        if inode.kind.is_special() {
            return Err(ManagerError::Perm(format!(
                "inode {} is a {:?}: user.* extended attributes belong to regular files and directories",
                inode.ino, inode.kind
            )));
        }
        Ok(())
    }

    pub fn removexattr(&mut self, caller: &Caller, ino: u64, name: &str) -> Result<()> {
        let inode = self.inode(ino)?.clone();
        match xattr::parse_name(name)? {
            AttrName::User(n) => {
                Self::check_user_xattrs_allowed(&inode)?;
                access::check(
                    caller,
                    &inode,
                    WRITE,
                    "remove extended attributes of this inode",
                )?;
                if !inode.xattrs.contains_key(&n) {
                    return Err(ManagerError::NoAttr(n));
                }
                let mut next = inode;
                next.xattrs.remove(&n);
                next.ctime = Time::now();
                self.put_inode(next);
                Ok(())
            }
            AttrName::Region(attr) => Err(ManagerError::Perm(format!(
                "{} cannot be removed; set it to 0 or an empty list instead",
                attr.name()
            ))),
            AttrName::Foreign(n) => Err(ManagerError::NoAttr(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{errno, root, state, user};

    fn create(s: &mut State, c: &Caller, parent: u64, name: &str) -> Inode {
        s.create_entry(c, parent, name, 0o644, None).unwrap()
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("a").is_ok());
        assert!(check_name(&"x".repeat(255)).is_ok());
        assert_eq!(
            check_name(&"x".repeat(256)).unwrap_err().errno(),
            libc::ENAMETOOLONG
        );
        for bad in ["", ".", "..", "a/b", "a\0b", "/"] {
            assert_eq!(
                check_name(bad).unwrap_err().errno(),
                libc::EINVAL,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn callers_naming_an_inode_need_search_permission_above_it() {
        let mut s = state();
        // /private (0700, uid 1000) / open (0755) / f (0644): only uid 1000 may reach f.
        let owner = user(1000);
        let private = s.mkdir(&owner, ROOT_INO, "private", 0o700).unwrap();
        let inner = s.mkdir(&owner, private.ino, "open", 0o755).unwrap();
        let f = create(&mut s, &owner, inner.ino, "f");
        let by_inode = |c: Caller| Caller {
            by_inode: true,
            ..c
        };
        let other = by_inode(user(1001));
        assert_eq!(errno(s.access(&other, f.ino, READ)), libc::EACCES);
        assert_eq!(errno(s.open_region(&other, f.ino, false)), libc::EACCES);
        assert_eq!(
            errno(s.create_entry(&other, inner.ino, "g", 0o644, None)),
            libc::EACCES,
            "creating below a directory it cannot reach"
        );
        // The same checks without by_inode are the mount's (the kernel walked the path).
        assert!(s.access(&user(1001), f.ino, READ).is_ok());
        // The owner, root, and a process holding a handle pass.
        assert!(s.access(&by_inode(owner.clone()), f.ino, READ).is_ok());
        let root_by_inode = by_inode(root());
        assert!(s.open_region(&root_by_inode, f.ino, false).is_ok());
        s.setattr(
            &owner,
            private.ino,
            &SetAttr {
                mode: Some(0o755),
                ..SetAttr::default()
            },
        )
        .unwrap();
        let h = s.open_region(&other, f.ino, false).unwrap();
        s.setattr(
            &owner,
            private.ino,
            &SetAttr {
                mode: Some(0o700),
                ..SetAttr::default()
            },
        )
        .unwrap();
        assert!(
            s.check_path(&other, f.ino).is_ok(),
            "an open handle keeps its access"
        );
        assert!(s.close_handle(&other, h.id, false).is_ok());
        assert_eq!(errno(s.check_path(&other, f.ino)), libc::EACCES);

        // Unlinked but kept open by root: no path leads to it, so only its owner reaches it.
        let g = create(&mut s, &owner, ROOT_INO, "g");
        s.open_region(&root(), g.ino, false).unwrap();
        s.unlink(&owner, ROOT_INO, "g").unwrap();
        assert_eq!(errno(s.check_path(&other, g.ino)), libc::EACCES);
        assert!(s.check_path(&by_inode(owner.clone()), g.ino).is_ok());
        assert!(s.check_path(&other, ROOT_INO).is_ok());
    }

    #[test]
    fn lookup_finds_and_misses() {
        let mut s = state();
        let d = s.mkdir(&root(), ROOT_INO, "d", 0o755).unwrap();
        let f = create(&mut s, &root(), d.ino, "f");
        assert_eq!(s.lookup(&root(), d.ino, "f").unwrap().ino, f.ino);
        assert_eq!(s.lookup(&root(), d.ino, ".").unwrap().ino, d.ino);
        assert_eq!(s.lookup(&root(), d.ino, "..").unwrap().ino, ROOT_INO);
        assert_eq!(errno(s.lookup(&root(), d.ino, "g")), libc::ENOENT);
        assert_eq!(errno(s.lookup(&root(), f.ino, "x")), libc::ENOTDIR);
        assert_eq!(errno(s.lookup(&root(), 999, "x")), libc::ENOENT);
        assert_eq!(errno(s.lookup(&root(), d.ino, "a/b")), libc::EINVAL);
    }

    #[test]
    fn lookup_needs_search_permission() {
        let mut s = state();
        let d = s.mkdir(&user(1000), ROOT_INO, "private", 0o700).unwrap();
        create(&mut s, &user(1000), d.ino, "f");
        assert!(s.lookup(&user(1000), d.ino, "f").is_ok());
        assert_eq!(errno(s.lookup(&user(2000), d.ino, "f")), libc::EACCES);
        assert!(s.lookup(&root(), d.ino, "f").is_ok());
    }

    #[test]
    fn create_and_mkdir_errors() {
        let mut s = state();
        create(&mut s, &root(), ROOT_INO, "f");
        assert_eq!(
            errno(s.create_entry(&root(), ROOT_INO, "f", 0o644, None)),
            libc::EEXIST
        );
        assert_eq!(errno(s.mkdir(&root(), ROOT_INO, "f", 0o755)), libc::EEXIST);
        let f = s.lookup(&root(), ROOT_INO, "f").unwrap().ino;
        assert_eq!(
            errno(s.create_entry(&root(), f, "x", 0o644, None)),
            libc::ENOTDIR
        );
        assert_eq!(errno(s.mkdir(&root(), 4242, "x", 0o755)), libc::ENOENT);
        let locked = s.mkdir(&root(), ROOT_INO, "locked", 0o755).unwrap();
        assert_eq!(
            errno(s.create_entry(&user(1000), locked.ino, "x", 0o644, None)),
            libc::EACCES
        );
        assert_eq!(
            errno(s.mkdir(&user(1000), locked.ino, "x", 0o755)),
            libc::EACCES
        );
        // Refused operations change nothing.
        assert!(s.dirs[&locked.ino].by_name.is_empty());
    }

    #[test]
    fn new_inodes_take_caller_ids_and_inherit() {
        let mut s = state();
        let f = create(&mut s, &user(1000), ROOT_INO, "f");
        assert_eq!(
            (f.uid, f.gid, f.owner_pid, f.owner_host),
            (1000, 1000, 1100, 1)
        );
        assert!(f.attrs.persistent, "the root's persistent=1 is inherited");
        let d = s.mkdir(&root(), ROOT_INO, "shared", 0o2777).unwrap();
        s.inode_mut(d.ino).unwrap().gid = 50;
        let g = create(&mut s, &user(1000), d.ino, "g");
        assert_eq!(g.gid, 50, "setgid directory gives its group");
        let sub = s.mkdir(&user(1000), d.ino, "sub", 0o755).unwrap();
        assert_eq!(sub.mode & S_ISGID, S_ISGID, "and setgid to new directories");
    }

    #[test]
    fn rmdir_rules() {
        let mut s = state();
        let d = s.mkdir(&root(), ROOT_INO, "d", 0o755).unwrap();
        create(&mut s, &root(), d.ino, "f");
        assert_eq!(errno(s.rmdir(&root(), ROOT_INO, "d")), libc::ENOTEMPTY);
        assert_eq!(errno(s.rmdir(&root(), d.ino, "f")), libc::ENOTDIR);
        assert_eq!(errno(s.rmdir(&root(), ROOT_INO, "nope")), libc::ENOENT);
        assert_eq!(s.inode(ROOT_INO).unwrap().nlink, 3);
        s.unlink(&root(), d.ino, "f").unwrap();
        s.rmdir(&root(), ROOT_INO, "d").unwrap();
        assert_eq!(s.inode(ROOT_INO).unwrap().nlink, 2);
        assert_eq!(errno(s.inode(d.ino)), libc::ENOENT);
    }

    #[test]
    fn unlink_rules() {
        let mut s = state();
        let d = s.mkdir(&root(), ROOT_INO, "d", 0o755).unwrap();
        assert_eq!(errno(s.unlink(&root(), ROOT_INO, "d")), libc::EISDIR);
        let f = create(&mut s, &root(), ROOT_INO, "f");
        assert_eq!(errno(s.unlink(&root(), d.ino, "f")), libc::ENOENT);
        assert_eq!(errno(s.unlink(&user(1000), d.ino, "f")), libc::EACCES);
        s.unlink(&root(), ROOT_INO, "f").unwrap();
        assert_eq!(errno(s.inode(f.ino)), libc::ENOENT);
        assert_eq!(errno(s.unlink(&root(), ROOT_INO, "f")), libc::ENOENT);
    }

    #[test]
    fn sticky_root_protects_other_users_regions() {
        let mut s = state();
        create(&mut s, &user(1000), ROOT_INO, "mine");
        assert_eq!(errno(s.unlink(&user(2000), ROOT_INO, "mine")), libc::EPERM);
        assert_eq!(
            errno(s.rename(&user(2000), ROOT_INO, "mine", ROOT_INO, "stolen", 0)),
            libc::EPERM
        );
        s.unlink(&user(1000), ROOT_INO, "mine").unwrap();
    }

    #[test]
    fn rename_moves_replaces_and_refuses() {
        let mut s = state();
        let a = s.mkdir(&root(), ROOT_INO, "a", 0o755).unwrap();
        let b = s.mkdir(&root(), ROOT_INO, "b", 0o755).unwrap();
        let f = create(&mut s, &root(), a.ino, "f");
        let g = create(&mut s, &root(), b.ino, "g");
        // Cross-directory move.
        s.rename(&root(), a.ino, "f", b.ino, "f2", 0).unwrap();
        assert_eq!(s.lookup(&root(), b.ino, "f2").unwrap().ino, f.ino);
        assert_eq!(errno(s.lookup(&root(), a.ino, "f")), libc::ENOENT);
        // Replace an existing region: the old one is gone.
        s.rename(&root(), b.ino, "f2", b.ino, "g", 0).unwrap();
        assert_eq!(s.lookup(&root(), b.ino, "g").unwrap().ino, f.ino);
        assert_eq!(errno(s.inode(g.ino)), libc::ENOENT);
        // NOREPLACE.
        create(&mut s, &root(), b.ino, "h");
        assert_eq!(
            errno(s.rename(&root(), b.ino, "g", b.ino, "h", RENAME_NOREPLACE)),
            libc::EEXIST
        );
        s.rename(&root(), b.ino, "g", b.ino, "new", RENAME_NOREPLACE)
            .unwrap();
        // Kind mismatches.
        let sub = s.mkdir(&root(), b.ino, "sub", 0o755).unwrap();
        assert_eq!(
            errno(s.rename(&root(), b.ino, "sub", b.ino, "h", 0)),
            libc::ENOTDIR
        );
        assert_eq!(
            errno(s.rename(&root(), b.ino, "h", b.ino, "sub", 0)),
            libc::EISDIR
        );
        // Directory over a non-empty directory.
        let full = s.mkdir(&root(), ROOT_INO, "full", 0o755).unwrap();
        create(&mut s, &root(), full.ino, "x");
        assert_eq!(
            errno(s.rename(&root(), b.ino, "sub", ROOT_INO, "full", 0)),
            libc::ENOTEMPTY
        );
        // Directory over an empty directory works; nlinks follow.
        let empty = s.mkdir(&root(), ROOT_INO, "empty", 0o755).unwrap();
        s.rename(&root(), b.ino, "sub", ROOT_INO, "empty", 0)
            .unwrap();
        assert_eq!(s.lookup(&root(), ROOT_INO, "empty").unwrap().ino, sub.ino);
        assert_eq!(errno(s.inode(empty.ino)), libc::ENOENT);
        assert_eq!(s.inode(b.ino).unwrap().nlink, 2);
        assert_eq!(s.inode(sub.ino).unwrap().parent, ROOT_INO);
        // Into itself.
        let inner = s.mkdir(&root(), sub.ino, "inner", 0o755).unwrap();
        assert_eq!(
            errno(s.rename(&root(), ROOT_INO, "empty", inner.ino, "loop", 0)),
            libc::EINVAL
        );
        assert_eq!(
            errno(s.rename(&root(), ROOT_INO, "missing", ROOT_INO, "x", 0)),
            libc::ENOENT
        );
        assert_eq!(
            errno(s.rename(&root(), ROOT_INO, "a", ROOT_INO, "x", 8)),
            libc::EINVAL
        );
        // Same name: no-op.
        s.rename(&root(), ROOT_INO, "a", ROOT_INO, "a", 0).unwrap();
    }

    #[test]
    fn rename_exchange_swaps() {
        let mut s = state();
        let d = s.mkdir(&root(), ROOT_INO, "d", 0o755).unwrap();
        let f = create(&mut s, &root(), ROOT_INO, "f");
        s.rename(&root(), ROOT_INO, "f", ROOT_INO, "d", RENAME_EXCHANGE)
            .unwrap();
        assert_eq!(s.lookup(&root(), ROOT_INO, "d").unwrap().ino, f.ino);
        assert_eq!(s.lookup(&root(), ROOT_INO, "f").unwrap().ino, d.ino);
        assert_eq!(
            errno(s.rename(&root(), ROOT_INO, "f", ROOT_INO, "none", RENAME_EXCHANGE)),
            libc::ENOENT
        );
    }

    #[test]
    fn rename_needs_write_on_both_directories() {
        let mut s = state();
        let mine = s.mkdir(&user(1000), ROOT_INO, "mine", 0o755).unwrap();
        let theirs = s.mkdir(&user(2000), ROOT_INO, "theirs", 0o755).unwrap();
        create(&mut s, &user(1000), mine.ino, "f");
        assert_eq!(
            errno(s.rename(&user(1000), mine.ino, "f", theirs.ino, "f", 0)),
            libc::EACCES
        );
        assert_eq!(
            errno(s.rename(&user(2000), mine.ino, "f", theirs.ino, "f", 0)),
            libc::EACCES
        );
        s.rename(&root(), mine.ino, "f", theirs.ino, "f", 0)
            .unwrap();
    }

    #[test]
    fn readdir_resumes_across_changes() {
        let mut s = state();
        let d = s.mkdir(&root(), ROOT_INO, "d", 0o755).unwrap();
        for i in 0..10 {
            create(&mut s, &root(), d.ino, &format!("f{i}"));
        }
        let (first, end) = s.readdir(&root(), d.ino, 0, 4).unwrap();
        assert!(!end);
        let names: Vec<String> = first.iter().map(|e| e.name.clone()).collect();
        assert_eq!(names, ["f0", "f1", "f2", "f3"]);
        assert!(first.iter().all(|e| e.cookie >= crate::model::FIRST_COOKIE));
        let cursor = first.last().unwrap().cookie;
        // Entries removed before the cursor do not shift what follows.
        s.unlink(&root(), d.ino, "f0").unwrap();
        s.unlink(&root(), d.ino, "f5").unwrap();
        let (rest, end) = s.readdir(&root(), d.ino, cursor, 100).unwrap();
        assert!(end);
        let names: Vec<String> = rest.iter().map(|e| e.name.clone()).collect();
        assert_eq!(names, ["f4", "f6", "f7", "f8", "f9"]);
        let (none, end) = s.readdir(&root(), d.ino, u64::MAX, 10).unwrap();
        assert!(none.is_empty() && end);
        let private = s.mkdir(&user(1000), ROOT_INO, "p", 0o300).unwrap();
        assert_eq!(
            errno(s.readdir(&user(1000), private.ino, 0, 10)),
            libc::EACCES
        );
        let f = s.lookup(&root(), d.ino, "f1").unwrap().ino;
        assert_eq!(errno(s.readdir(&root(), f, 0, 10)), libc::ENOTDIR);
    }

    #[test]
    fn setattr_ownership_rules() {
        let mut s = state();
        let f = create(&mut s, &user(1000), ROOT_INO, "f");
        let chmod = |m| SetAttr {
            mode: Some(m),
            ..SetAttr::default()
        };
        assert_eq!(
            s.setattr(&user(1000), f.ino, &chmod(0o600)).unwrap().mode,
            0o600
        );
        assert_eq!(
            errno(s.setattr(&user(2000), f.ino, &chmod(0o777))),
            libc::EPERM
        );
        assert_eq!(
            s.setattr(&root(), f.ino, &chmod(0o640)).unwrap().mode,
            0o640
        );
        // chown: only root gives away; owner may change group to its own groups.
        let to = |uid: Option<u32>, gid: Option<u32>| SetAttr {
            uid,
            gid,
            ..SetAttr::default()
        };
        assert_eq!(
            errno(s.setattr(&user(1000), f.ino, &to(Some(2000), None))),
            libc::EPERM
        );
        assert_eq!(
            errno(s.setattr(&user(1000), f.ino, &to(None, Some(7)))),
            libc::EPERM
        );
        let member = Caller {
            groups: vec![7],
            ..user(1000)
        };
        assert_eq!(
            s.setattr(&member, f.ino, &to(None, Some(7))).unwrap().gid,
            7
        );
        let given = s
            .setattr(&root(), f.ino, &to(Some(2000), Some(2000)))
            .unwrap();
        assert_eq!((given.uid, given.gid), (2000, 2000));
        // setuid/setgid cleared when a non-root owner chowns.
        s.setattr(&root(), f.ino, &chmod(0o6755)).unwrap();
        let member2 = Caller {
            groups: vec![9],
            ..user(2000)
        };
        assert_eq!(
            s.setattr(&member2, f.ino, &to(None, Some(9))).unwrap().mode,
            0o755
        );
    }

    #[test]
    fn setattr_times() {
        let mut s = state();
        let f = create(&mut s, &user(1000), ROOT_INO, "f");
        let t = Time {
            sec: 1_000_000,
            nsec: 5,
        };
        let at = SetAttr {
            atime: Some(TimeChange::At(t)),
            mtime: Some(TimeChange::At(t)),
            ..SetAttr::default()
        };
        let changed = s.setattr(&user(1000), f.ino, &at).unwrap();
        assert_eq!((changed.atime, changed.mtime), (t, t));
        assert!(changed.ctime > t);
        assert_eq!(errno(s.setattr(&user(2000), f.ino, &at)), libc::EPERM);
        let now = SetAttr {
            mtime: Some(TimeChange::Now),
            ..SetAttr::default()
        };
        assert_eq!(errno(s.setattr(&user(2000), f.ino, &now)), libc::EACCES);
        s.setattr(
            &user(1000),
            f.ino,
            &SetAttr {
                mode: Some(0o666),
                ..SetAttr::default()
            },
        )
        .unwrap();
        assert!(
            s.setattr(&user(2000), f.ino, &now).unwrap().mtime > t,
            "write permission suffices for now"
        );
    }

    #[test]
    fn user_xattrs_round_trip_with_flags_and_limits() {
        let mut s = state();
        let f = create(&mut s, &user(1000), ROOT_INO, "f");
        let u = user(1000);
        s.setxattr(&u, f.ino, "user.note", b"hello", 0).unwrap();
        assert_eq!(s.getxattr(&u, f.ino, "user.note").unwrap(), b"hello");
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.note", b"x", XATTR_CREATE)),
            libc::EEXIST
        );
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.other", b"x", XATTR_REPLACE)),
            libc::ENODATA
        );
        s.setxattr(&u, f.ino, "user.note", b"bye", XATTR_REPLACE)
            .unwrap();
        assert!(
            s.listxattr(&u, f.ino)
                .unwrap()
                .contains(&"user.note".to_string())
        );
        s.removexattr(&u, f.ino, "user.note").unwrap();
        assert_eq!(errno(s.getxattr(&u, f.ino, "user.note")), libc::ENODATA);
        assert_eq!(errno(s.removexattr(&u, f.ino, "user.note")), libc::ENODATA);
        assert_eq!(
            errno(s.getxattr(&u, f.ino, "security.capability")),
            libc::ENODATA
        );
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "trusted.x", b"1", 0)),
            libc::ENOTSUP
        );
        let big = vec![0u8; xattr::MAX_VALUE_LEN + 1];
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.big", &big, 0)),
            libc::E2BIG
        );
        // Total per inode.
        let chunk = vec![1u8; xattr::MAX_VALUE_LEN];
        for i in 0..3 {
            s.setxattr(&u, f.ino, &format!("user.c{i}"), &chunk, 0)
                .unwrap();
        }
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.c3", &chunk, 0)),
            libc::ENOSPC
        );
        // Permissions: others cannot write, and cannot read a 0600 file's attributes.
        assert_eq!(
            errno(s.setxattr(&user(2000), f.ino, "user.x", b"1", 0)),
            libc::EACCES
        );
        s.setattr(
            &u,
            f.ino,
            &SetAttr {
                mode: Some(0o600),
                ..SetAttr::default()
            },
        )
        .unwrap();
        assert_eq!(
            errno(s.getxattr(&user(2000), f.ino, "user.c0")),
            libc::EACCES
        );
    }

    #[test]
    fn region_xattrs_validate_and_directories_pass_them_on() {
        let mut s = state();
        let u = user(1000);
        let d = s.mkdir(&u, ROOT_INO, "d", 0o755).unwrap();
        s.setxattr(&u, d.ino, "user.regions.persistent", b"0", 0)
            .unwrap();
        s.setxattr(&u, d.ino, "user.regions.multihosted", b"1\n", 0)
            .unwrap();
        s.setxattr(&u, d.ino, "user.regions.hostalloc", b"2,3", 0)
            .unwrap();
        s.setxattr(&u, d.ino, "user.regions.onewriter", b"1", 0)
            .unwrap();
        let f = create(&mut s, &u, d.ino, "f");
        assert!(!f.attrs.persistent && f.attrs.multihosted && f.attrs.onewriter);
        assert_eq!(f.attrs.hostalloc, vec![2, 3]);
        let sub = s.mkdir(&u, d.ino, "sub", 0o755).unwrap();
        assert_eq!(
            sub.attrs, f.attrs,
            "subdirectories inherit the defaults too"
        );
        assert_eq!(
            s.getxattr(&u, f.ino, "user.regions.multihosted").unwrap(),
            b"1"
        );
        assert_eq!(
            s.getxattr(&u, f.ino, "user.regions.hostalloc").unwrap(),
            b"2,3"
        );
        assert_eq!(
            s.getxattr(&u, f.ino, "user.regions.ownerpid").unwrap(),
            b"1100"
        );
        assert_eq!(s.getxattr(&u, f.ino, "user.regions.vaddr").unwrap(), b"0x0");
        assert_eq!(
            errno(s.getxattr(&u, d.ino, "user.regions.ownerpid")),
            libc::ENODATA
        );
        // Bad values and read-only names.
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.regions.persistent", b"2", 0)),
            libc::EINVAL
        );
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.regions.hostalloc", b"a,b", 0)),
            libc::EINVAL
        );
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.regions.nonsense", b"1", 0)),
            libc::EINVAL
        );
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.regions.vaddr", b"1", 0)),
            libc::EPERM
        );
        assert_eq!(
            errno(s.setxattr(&u, f.ino, "user.regions.ownerpid", b"1", 0)),
            libc::EPERM
        );
        assert_eq!(
            errno(s.removexattr(&u, f.ino, "user.regions.persistent")),
            libc::EPERM
        );
        // Only the owner changes region attributes.
        assert_eq!(
            errno(s.setxattr(&user(2000), f.ino, "user.regions.persistent", b"1", 0)),
            libc::EPERM
        );
        let names = s.listxattr(&u, f.ino).unwrap();
        for a in [
            "persistent",
            "multihosted",
            "fixvaddr",
            "onewriter",
            "hostalloc",
            "ownerpid",
            "vaddr",
            "hosts",
        ] {
            assert!(names.contains(&format!("user.regions.{a}")), "{a}");
        }
        // Create-time overrides (rsetdefaultattr) beat directory defaults.
        let o = v1::RegionAttrOverrides {
            persistent: Some(true),
            hostalloc: Some("4".into()),
            ..Default::default()
        };
        let g = s.create_entry(&u, d.ino, "g", 0o644, Some(&o)).unwrap();
        assert!(g.attrs.persistent && g.attrs.multihosted);
        assert_eq!(g.attrs.hostalloc, vec![4]);
        let bad = v1::RegionAttrOverrides {
            hostalloc: Some("zero".into()),
            ..Default::default()
        };
        assert_eq!(
            errno(s.create_entry(&u, d.ino, "h", 0o644, Some(&bad))),
            libc::EINVAL
        );
        assert_eq!(
            errno(s.lookup(&u, d.ino, "h")),
            libc::ENOENT,
            "refused create leaves nothing"
        );
    }

    #[test]
    fn access_checks_mode_bits() {
        let mut s = state();
        let f = create(&mut s, &user(1000), ROOT_INO, "f");
        assert!(s.access(&user(1000), f.ino, READ | WRITE).is_ok());
        assert_eq!(errno(s.access(&user(1000), f.ino, EXEC)), libc::EACCES);
        assert_eq!(errno(s.access(&user(2000), f.ino, WRITE)), libc::EACCES);
        assert!(s.access(&user(2000), f.ino, READ).is_ok());
        assert!(s.access(&user(2000), f.ino, 0).is_ok());
    }
}
