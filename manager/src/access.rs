//! Who may do what: POSIX mode bits, ownership and the sticky bit, checked
//! against the caller the node component vouches for.

use regions_proto::v1;

use crate::error::{ManagerError, Result};
use crate::model::{Inode, Kind};

/// Read permission (R_OK).
pub const READ: u32 = 4;
/// Write permission (W_OK).
pub const WRITE: u32 = 2;
/// Execute / search permission (X_OK).
pub const EXEC: u32 = 1;

pub const S_ISUID: u32 = 0o4000;
pub const S_ISGID: u32 = 0o2000;
pub const S_ISVTX: u32 = 0o1000;
/// Every permission bit an inode keeps.
pub const MODE_MASK: u32 = 0o7777;

/// The process on whose behalf a request is made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub pid: u32,
    pub host_id: u32,
    /// The caller named the inode by number (a host agent's client), not by a
    /// path the kernel walked: [`crate::state::State::check_path`] applies.
    pub by_inode: bool,
    /// The cache-lease session of the mount asking (0: none; see `crate::cache_leases`).
    pub lease_session: u64,
}

impl Caller {
    /// The superuser on host `host_id` (tests, internal work).
    pub fn root(host_id: u32) -> Caller {
        Caller {
            host_id,
            ..Caller::default()
        }
    }

    /// A caller from a request; every request must name one.
    pub fn from_proto(caller: Option<&v1::Caller>) -> Result<Caller> {
        let c = caller.ok_or_else(|| {
            ManagerError::Invalid("request carries no caller (uid, gids, pid, host id)".into())
        })?;
        Ok(Caller {
            uid: c.uid,
            gid: c.gid,
            groups: c.groups.clone(),
            pid: c.pid,
            host_id: c.host_id,
            by_inode: c.by_inode,
            lease_session: c.lease_session,
        })
    }

    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    /// Whether the caller belongs to `gid` (primary or supplementary).
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }

    pub fn owns(&self, inode: &Inode) -> bool {
        self.uid == inode.uid
    }
}

/// Whether `caller` has every permission in `mask` (READ|WRITE|EXEC) on
/// `inode`. Root passes read and write checks always, and execute checks
/// on directories or when any execute bit is set, as on Linux.
pub fn allows(caller: &Caller, inode: &Inode, mask: u32) -> bool {
    allows_bits(
        caller,
        inode.uid,
        inode.gid,
        inode.mode,
        inode.kind == Kind::Directory,
        mask,
    )
}

/// [`allows`] for anything with an owner, a group and permission bits (inodes, sync
/// objects).
pub fn allows_bits(caller: &Caller, uid: u32, gid: u32, mode: u32, dir: bool, mask: u32) -> bool {
    if caller.is_root() {
        return mask & EXEC == 0 || dir || mode & 0o111 != 0;
    }
    let bits = if caller.uid == uid {
        (mode >> 6) & 7
    } else if caller.in_group(gid) {
        (mode >> 3) & 7
    } else {
        mode & 7
    };
    bits & mask == mask
}

/// [`allows`], or `EACCES` naming what was refused.
pub fn check(caller: &Caller, inode: &Inode, mask: u32, what: &str) -> Result<()> {
    if allows(caller, inode, mask) {
        Ok(())
    } else {
        Err(ManagerError::Access(format!(
            "uid {} may not {what} (inode {}, mode {:o}, owner {}:{})",
            caller.uid, inode.ino, inode.mode, inode.uid, inode.gid
        )))
    }
}

/// In a sticky directory only the owner of an entry, the owner of the
/// directory or root may remove or rename the entry.
pub fn check_sticky(caller: &Caller, dir: &Inode, victim: &Inode) -> Result<()> {
    if dir.mode & S_ISVTX == 0 || caller.is_root() || caller.owns(dir) || caller.owns(victim) {
        Ok(())
    } else {
        Err(ManagerError::Perm(format!(
            "directory {} is sticky: only the owner of inode {} (uid {}) may remove or rename it",
            dir.ino, victim.ino, victim.uid
        )))
    }
}

/// Only the owner or root may change mode, times explicitly, or attributes.
pub fn check_owner(caller: &Caller, inode: &Inode, what: &str) -> Result<()> {
    if caller.is_root() || caller.owns(inode) {
        Ok(())
    } else {
        Err(ManagerError::Perm(format!(
            "only the owner (uid {}) or root may {what} inode {}",
            inode.uid, inode.ino
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RegionAttrs, Time};

    fn inode(kind: Kind, mode: u32, uid: u32, gid: u32) -> Inode {
        Inode {
            ino: 9,
            kind,
            mode,
            nlink: 1,
            uid,
            gid,
            size: 0,
            atime: Time::default(),
            mtime: Time::default(),
            ctime: Time::default(),
            crtime: Time::default(),
            parent: 1,
            attrs: RegionAttrs::default(),
            owner_pid: 0,
            owner_host: 0,
            vaddr: 0,
            vaddr_len: 0,
            xattrs: Default::default(),
            next_cookie: 3,
            map_version: 0,
            rdev: 0,
            target: Vec::new(),
        }
    }

    fn user(uid: u32, gid: u32, groups: &[u32]) -> Caller {
        Caller {
            uid,
            gid,
            groups: groups.to_vec(),
            pid: 1,
            host_id: 1,
            by_inode: false,
            lease_session: 0,
        }
    }

    /// Owner, group and other each see only their own triple, for every
    /// combination of bits and requested access.
    #[test]
    fn permission_matrix() {
        let owner = user(1000, 1000, &[]);
        let group_member = user(2000, 3000, &[1000]);
        let other = user(3000, 3000, &[]);
        for bits in 0..8u32 {
            for mask in 1..8u32 {
                let expect = bits & mask == mask;
                // Owner triple only.
                let f = inode(Kind::Region, bits << 6, 1000, 1000);
                assert_eq!(allows(&owner, &f, mask), expect, "owner {bits:o} {mask}");
                assert!(!allows(&group_member, &f, mask));
                assert!(!allows(&other, &f, mask));
                // Group triple only.
                let f = inode(Kind::Region, bits << 3, 1000, 1000);
                assert!(!allows(&owner, &f, mask), "owner must not use group bits");
                assert_eq!(allows(&group_member, &f, mask), expect, "group {bits:o}");
                assert!(!allows(&other, &f, mask));
                // Other triple only.
                let f = inode(Kind::Region, bits, 1000, 1000);
                assert!(!allows(&owner, &f, mask));
                assert!(!allows(&group_member, &f, mask));
                assert_eq!(allows(&other, &f, mask), expect, "other {bits:o}");
            }
        }
    }

    #[test]
    fn root_bypasses_read_write_but_not_exec_on_plain_files() {
        let root = Caller::root(1);
        let f = inode(Kind::Region, 0o000, 1000, 1000);
        assert!(allows(&root, &f, READ | WRITE));
        assert!(!allows(&root, &f, EXEC));
        let f = inode(Kind::Region, 0o001, 1000, 1000);
        assert!(allows(&root, &f, EXEC));
        let d = inode(Kind::Directory, 0o000, 1000, 1000);
        assert!(allows(&root, &d, READ | WRITE | EXEC));
    }

    #[test]
    fn sticky_directories_protect_other_users_entries() {
        let dir = inode(Kind::Directory, 0o1777, 0, 0);
        let victim = inode(Kind::Region, 0o666, 1000, 1000);
        assert!(check_sticky(&user(1000, 1, &[]), &dir, &victim).is_ok());
        assert!(check_sticky(&Caller::root(1), &dir, &victim).is_ok());
        let err = check_sticky(&user(2000, 1, &[]), &dir, &victim).unwrap_err();
        assert_eq!(err.errno(), libc::EPERM);
        let plain = inode(Kind::Directory, 0o777, 0, 0);
        assert!(check_sticky(&user(2000, 1, &[]), &plain, &victim).is_ok());
        let owned = inode(Kind::Directory, 0o1777, 2000, 0);
        assert!(check_sticky(&user(2000, 1, &[]), &owned, &victim).is_ok());
    }

    #[test]
    fn only_owner_or_root_changes_ownership_things() {
        let f = inode(Kind::Region, 0o777, 1000, 1000);
        assert!(check_owner(&user(1000, 1, &[]), &f, "chmod").is_ok());
        assert!(check_owner(&Caller::root(1), &f, "chmod").is_ok());
        assert_eq!(
            check_owner(&user(1001, 1000, &[]), &f, "chmod")
                .unwrap_err()
                .errno(),
            libc::EPERM
        );
    }
}
