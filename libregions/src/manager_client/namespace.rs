//! The manager's namespace service as blocking calls of [`ManagerClient`]: names,
//! attributes, directories, links, extended attributes (what a file system asks).

use regions_proto::v1;

use super::ManagerClient;
use crate::error::Result;

/// A time to set (setattr).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetTime {
    /// The manager's clock.
    Now,
    /// Seconds and nanoseconds since the epoch.
    At(i64, u32),
}

impl SetTime {
    fn to_proto(self) -> v1::TimeSet {
        v1::TimeSet {
            how: Some(match self {
                SetTime::Now => v1::time_set::How::Now(true),
                SetTime::At(sec, nsec) => v1::time_set::How::Time(v1::Timespec { sec, nsec }),
            }),
        }
    }
}

/// The attribute changes of a setattr.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SetAttrIn {
    /// New permission bits.
    pub mode: Option<u32>,
    /// New owner.
    pub uid: Option<u32>,
    /// New group.
    pub gid: Option<u32>,
    /// New size (truncate or extend).
    pub size: Option<u64>,
    /// New access time.
    pub atime: Option<SetTime>,
    /// New modification time.
    pub mtime: Option<SetTime>,
    /// The change comes through a descriptor opened for writing (the
    /// manager then allows a size change without write permission now).
    pub through_write_handle: bool,
}

fn remove_request(caller: &v1::Caller, parent: u64, name: &str) -> v1::RemoveRequest {
    v1::RemoveRequest {
        caller: Some(caller.clone()),
        parent,
        name: name.to_owned(),
    }
}

impl ManagerClient {
    /// Looks up `name` in `parent`.
    pub fn lookup(&self, caller: &v1::Caller, parent: u64, name: &str) -> Result<v1::Attr> {
        self.call(|mut s| async move {
            s.namespace
                .lookup(v1::LookupRequest {
                    caller: Some(caller.clone()),
                    parent,
                    name: name.to_owned(),
                })
                .await
        })
    }

    /// The attributes of `ino`.
    pub fn getattr(&self, caller: &v1::Caller, ino: u64) -> Result<v1::Attr> {
        self.call(|mut s| async move {
            s.namespace
                .get_attr(v1::GetAttrRequest {
                    caller: Some(caller.clone()),
                    ino,
                })
                .await
        })
    }

    /// Changes attributes of `ino`.
    pub fn setattr(&self, caller: &v1::Caller, ino: u64, change: &SetAttrIn) -> Result<v1::Attr> {
        self.call(|mut s| async move {
            s.namespace
                .set_attr(v1::SetAttrRequest {
                    caller: Some(caller.clone()),
                    ino,
                    mode: change.mode,
                    uid: change.uid,
                    gid: change.gid,
                    size: change.size,
                    atime: change.atime.map(SetTime::to_proto),
                    mtime: change.mtime.map(SetTime::to_proto),
                    through_write_handle: change.through_write_handle,
                })
                .await
        })
    }

    /// Makes `name` in `parent` a symbolic link to `target`.
    pub fn symlink(
        &self,
        caller: &v1::Caller,
        parent: u64,
        name: &str,
        target: &[u8],
    ) -> Result<v1::Attr> {
        self.call(|mut s| async move {
            s.namespace
                .symlink(v1::SymlinkRequest {
                    caller: Some(caller.clone()),
                    parent,
                    name: name.to_owned(),
                    target: target.to_vec(),
                })
                .await
        })
    }

    /// The target of symbolic link `ino`.
    pub fn readlink(&self, caller: &v1::Caller, ino: u64) -> Result<Vec<u8>> {
        self.call(|mut s| async move {
            s.namespace
                .read_link(v1::GetAttrRequest {
                    caller: Some(caller.clone()),
                    ino,
                })
                .await
        })
        .map(|r| r.target)
    }

    /// Gives `ino` the further name `new_name` in `new_parent`.
    pub fn link(
        &self,
        caller: &v1::Caller,
        ino: u64,
        new_parent: u64,
        new_name: &str,
    ) -> Result<v1::Attr> {
        self.call(|mut s| async move {
            s.namespace
                .link(v1::LinkRequest {
                    caller: Some(caller.clone()),
                    ino,
                    new_parent,
                    new_name: new_name.to_owned(),
                })
                .await
        })
    }

    /// Makes a FIFO, socket or device node.
    pub fn make_node(
        &self,
        caller: &v1::Caller,
        parent: u64,
        name: &str,
        kind: v1::FileKind,
        mode: u32,
        rdev: u64,
    ) -> Result<v1::Attr> {
        self.call(|mut s| async move {
            s.namespace
                .make_node(v1::MakeNodeRequest {
                    caller: Some(caller.clone()),
                    parent,
                    name: name.to_owned(),
                    kind: kind as i32,
                    mode,
                    rdev,
                })
                .await
        })
    }

    /// Creates a directory.
    pub fn mkdir(
        &self,
        caller: &v1::Caller,
        parent: u64,
        name: &str,
        mode: u32,
    ) -> Result<v1::Attr> {
        self.call(|mut s| async move {
            s.namespace
                .mkdir(v1::MkdirRequest {
                    caller: Some(caller.clone()),
                    parent,
                    name: name.to_owned(),
                    mode,
                })
                .await
        })
    }

    /// Creates a region (not opened; [`ManagerClient::create_open`] also opens it).
    pub fn create(&self, request: v1::CreateRequest) -> Result<v1::Attr> {
        self.call(|mut s| async move { s.namespace.create(request).await })
    }

    /// Removes a region's name.
    /// Removes a name; says which inode it named and how many names that has left.
    pub fn unlink(&self, caller: &v1::Caller, parent: u64, name: &str) -> Result<v1::Unlinked> {
        self.call(|mut s| async move {
            s.namespace
                .unlink(remove_request(caller, parent, name))
                .await
        })
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, caller: &v1::Caller, parent: u64, name: &str) -> Result<()> {
        self.call(|mut s| async move {
            s.namespace
                .rmdir(remove_request(caller, parent, name))
                .await
        })
        .map(|_| ())
    }

    /// Renames (renameat2 flags).
    pub fn rename(
        &self,
        caller: &v1::Caller,
        (parent, name): (u64, &str),
        (new_parent, new_name): (u64, &str),
        flags: u32,
    ) -> Result<()> {
        self.call(|mut s| async move {
            s.namespace
                .rename(v1::RenameRequest {
                    caller: Some(caller.clone()),
                    parent,
                    name: name.to_owned(),
                    new_parent,
                    new_name: new_name.to_owned(),
                    flags,
                })
                .await
        })
        .map(|_| ())
    }

    /// Up to `limit` entries after cookie `offset` (0 = from the start).
    pub fn readdir(
        &self,
        caller: &v1::Caller,
        ino: u64,
        offset: u64,
        limit: u32,
    ) -> Result<v1::ReadDirReply> {
        self.call(|mut s| async move {
            s.namespace
                .read_dir(v1::ReadDirRequest {
                    caller: Some(caller.clone()),
                    ino,
                    offset,
                    limit,
                })
                .await
        })
    }

    /// An extended attribute's value.
    pub fn getxattr(&self, caller: &v1::Caller, ino: u64, name: &str) -> Result<Vec<u8>> {
        self.call(|mut s| async move {
            s.namespace
                .get_xattr(v1::GetXattrRequest {
                    caller: Some(caller.clone()),
                    ino,
                    name: name.to_owned(),
                })
                .await
        })
        .map(|r| r.value)
    }

    /// Sets an extended attribute (`flags`: `XATTR_CREATE`, `XATTR_REPLACE` or 0).
    pub fn setxattr(
        &self,
        caller: &v1::Caller,
        ino: u64,
        name: &str,
        value: &[u8],
        flags: u32,
    ) -> Result<()> {
        self.call(|mut s| async move {
            s.namespace
                .set_xattr(v1::SetXattrRequest {
                    caller: Some(caller.clone()),
                    ino,
                    name: name.to_owned(),
                    value: value.to_vec(),
                    flags,
                })
                .await
        })
        .map(|_| ())
    }

    /// Extended attribute names.
    pub fn listxattr(&self, caller: &v1::Caller, ino: u64) -> Result<Vec<String>> {
        self.call(|mut s| async move {
            s.namespace
                .list_xattr(v1::ListXattrRequest {
                    caller: Some(caller.clone()),
                    ino,
                })
                .await
        })
        .map(|r| r.names)
    }

    /// Removes an extended attribute.
    pub fn removexattr(&self, caller: &v1::Caller, ino: u64, name: &str) -> Result<()> {
        self.call(|mut s| async move {
            s.namespace
                .remove_xattr(v1::RemoveXattrRequest {
                    caller: Some(caller.clone()),
                    ino,
                    name: name.to_owned(),
                })
                .await
        })
        .map(|_| ())
    }

    /// Cluster capacity as the caller sees it.
    pub fn statfs(&self, caller: &v1::Caller) -> Result<v1::StatFsReply> {
        self.call(|mut s| async move {
            s.namespace
                .stat_fs(v1::StatFsRequest {
                    caller: Some(caller.clone()),
                })
                .await
        })
    }

    /// access(2) check.
    pub fn access(&self, caller: &v1::Caller, ino: u64, mask: u32) -> Result<()> {
        self.call(|mut s| async move {
            s.namespace
                .access(v1::AccessRequest {
                    caller: Some(caller.clone()),
                    ino,
                    mask,
                })
                .await
        })
        .map(|_| ())
    }
}
