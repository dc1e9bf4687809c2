//! regionfs's own blocking calls to the manager's namespace and cluster
//! services (the ones `regions::ManagerClient` does not wrap: rename,
//! rmdir, readdir, setattr, xattr listing and removal, statfs, access,
//! pools), over a connection and runtime of its own.
//!
//! Calls must come from plain threads (FUSE workers), never from inside an
//! async runtime.

use std::future::Future;
use std::time::Duration;

use regions::RegionsError;
use regions::manager_client::{Authed, ManagerChannel};
use regions_proto::auth::Secret;
use regions_proto::v1::{self, cluster_client::ClusterClient, namespace_client::NamespaceClient};

use crate::error::{FsError, FsResult};

/// Blocking namespace and cluster calls.
pub struct Rpc {
    addr: String,
    runtime: tokio::runtime::Runtime,
    namespace: NamespaceClient<Authed>,
    cluster: ClusterClient<Authed>,
}

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

impl Rpc {
    /// Connects to the manager at `addr` (`http://host:port`, or `https://` trusting `tls_ca`).
    pub fn connect(
        addr: &str,
        secret: &Secret,
        tls_ca: Option<&std::path::Path>,
        timeout: Duration,
    ) -> FsResult<Rpc> {
        let (runtime, channel) =
            ManagerChannel::open(addr, secret, tls_ca, timeout, "regionfs-grpc").map_err(|e| {
                match e {
                    RegionsError::ManagerUnreachable { addr, reason } => {
                        FsError::ManagerUnreachable { addr, reason }
                    }
                    other => FsError::ManagerUnreachable {
                        addr: addr.to_owned(),
                        reason: other.to_string(),
                    },
                }
            })?;
        Ok(Rpc {
            addr: addr.to_owned(),
            namespace: channel.namespace(),
            cluster: channel.cluster(),
            runtime,
        })
    }

    /// The manager's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn call<T>(
        &self,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> FsResult<T> {
        self.runtime
            .block_on(fut)
            .map(tonic::Response::into_inner)
            .map_err(|status| FsError::from_status(&self.addr, status))
    }

    fn ns(&self) -> NamespaceClient<Authed> {
        self.namespace.clone()
    }

    /// Looks up `name` in `parent`.
    pub fn lookup(&self, caller: &v1::Caller, parent: u64, name: &str) -> FsResult<v1::Attr> {
        self.call(self.ns().lookup(v1::LookupRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
        }))
    }

    /// The attributes of `ino`.
    pub fn getattr(&self, caller: &v1::Caller, ino: u64) -> FsResult<v1::Attr> {
        self.call(self.ns().get_attr(v1::GetAttrRequest {
            caller: Some(caller.clone()),
            ino,
        }))
    }

    /// Changes attributes of `ino`.
    pub fn setattr(&self, caller: &v1::Caller, ino: u64, change: &SetAttrIn) -> FsResult<v1::Attr> {
        self.call(self.ns().set_attr(v1::SetAttrRequest {
            caller: Some(caller.clone()),
            ino,
            mode: change.mode,
            uid: change.uid,
            gid: change.gid,
            size: change.size,
            atime: change.atime.map(SetTime::to_proto),
            mtime: change.mtime.map(SetTime::to_proto),
            through_write_handle: change.through_write_handle,
        }))
    }

    /// Makes `name` in `parent` a symbolic link to `target`.
    pub fn symlink(
        &self,
        caller: &v1::Caller,
        parent: u64,
        name: &str,
        target: &[u8],
    ) -> FsResult<v1::Attr> {
        self.call(self.ns().symlink(v1::SymlinkRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            target: target.to_vec(),
        }))
    }

    /// The target of symbolic link `ino`.
    pub fn readlink(&self, caller: &v1::Caller, ino: u64) -> FsResult<Vec<u8>> {
        self.call(self.ns().read_link(v1::GetAttrRequest {
            caller: Some(caller.clone()),
            ino,
        }))
        .map(|r| r.target)
    }

    /// Gives `ino` the further name `new_name` in `new_parent`.
    pub fn link(
        &self,
        caller: &v1::Caller,
        ino: u64,
        new_parent: u64,
        new_name: &str,
    ) -> FsResult<v1::Attr> {
        self.call(self.ns().link(v1::LinkRequest {
            caller: Some(caller.clone()),
            ino,
            new_parent,
            new_name: new_name.to_owned(),
        }))
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
    ) -> FsResult<v1::Attr> {
        self.call(self.ns().make_node(v1::MakeNodeRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            kind: kind as i32,
            mode,
            rdev,
        }))
    }

    /// Creates a directory.
    pub fn mkdir(
        &self,
        caller: &v1::Caller,
        parent: u64,
        name: &str,
        mode: u32,
    ) -> FsResult<v1::Attr> {
        self.call(self.ns().mkdir(v1::MkdirRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            mode,
        }))
    }

    /// Creates a region (attributes inherited from `parent`).
    pub fn create(
        &self,
        caller: &v1::Caller,
        parent: u64,
        name: &str,
        mode: u32,
    ) -> FsResult<v1::Attr> {
        self.create_with(caller, parent, name, mode, None)
    }

    /// Creates a region with `attrs` on top of those inherited from `parent`.
    pub fn create_with(
        &self,
        caller: &v1::Caller,
        parent: u64,
        name: &str,
        mode: u32,
        attrs: Option<v1::RegionAttrOverrides>,
    ) -> FsResult<v1::Attr> {
        self.call(self.ns().create(v1::CreateRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            mode,
            attrs,
            preallocate: 0,
        }))
    }

    fn remove_request(caller: &v1::Caller, parent: u64, name: &str) -> v1::RemoveRequest {
        v1::RemoveRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
        }
    }

    /// Removes a region.
    pub fn unlink(&self, caller: &v1::Caller, parent: u64, name: &str) -> FsResult<()> {
        self.call(self.ns().unlink(Self::remove_request(caller, parent, name)))
            .map(|_| ())
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, caller: &v1::Caller, parent: u64, name: &str) -> FsResult<()> {
        self.call(self.ns().rmdir(Self::remove_request(caller, parent, name)))
            .map(|_| ())
    }

    /// Renames (renameat2 flags).
    pub fn rename(
        &self,
        caller: &v1::Caller,
        (parent, name): (u64, &str),
        (new_parent, new_name): (u64, &str),
        flags: u32,
    ) -> FsResult<()> {
        self.call(self.ns().rename(v1::RenameRequest {
            caller: Some(caller.clone()),
            parent,
            name: name.to_owned(),
            new_parent,
            new_name: new_name.to_owned(),
            flags,
        }))
        .map(|_| ())
    }

    /// Up to `limit` entries after cookie `offset` (0 = from the start).
    pub fn readdir(
        &self,
        caller: &v1::Caller,
        ino: u64,
        offset: u64,
        limit: u32,
    ) -> FsResult<v1::ReadDirReply> {
        self.call(self.ns().read_dir(v1::ReadDirRequest {
            caller: Some(caller.clone()),
            ino,
            offset,
            limit,
        }))
    }

    /// An extended attribute's value.
    pub fn getxattr(&self, caller: &v1::Caller, ino: u64, name: &str) -> FsResult<Vec<u8>> {
        self.call(self.ns().get_xattr(v1::GetXattrRequest {
            caller: Some(caller.clone()),
            ino,
            name: name.to_owned(),
        }))
        .map(|r| r.value)
    }

    /// Sets an extended attribute.
    pub fn setxattr(
        &self,
        caller: &v1::Caller,
        ino: u64,
        name: &str,
        value: &[u8],
        flags: u32,
    ) -> FsResult<()> {
        self.call(self.ns().set_xattr(v1::SetXattrRequest {
            caller: Some(caller.clone()),
            ino,
            name: name.to_owned(),
            value: value.to_vec(),
            flags,
        }))
        .map(|_| ())
    }

    /// Extended attribute names.
    pub fn listxattr(&self, caller: &v1::Caller, ino: u64) -> FsResult<Vec<String>> {
        self.call(self.ns().list_xattr(v1::ListXattrRequest {
            caller: Some(caller.clone()),
            ino,
        }))
        .map(|r| r.names)
    }

    /// Removes an extended attribute.
    pub fn removexattr(&self, caller: &v1::Caller, ino: u64, name: &str) -> FsResult<()> {
        self.call(self.ns().remove_xattr(v1::RemoveXattrRequest {
            caller: Some(caller.clone()),
            ino,
            name: name.to_owned(),
        }))
        .map(|_| ())
    }

    /// Cluster capacity.
    pub fn statfs(&self, caller: &v1::Caller) -> FsResult<v1::StatFsReply> {
        self.call(self.ns().stat_fs(v1::StatFsRequest {
            caller: Some(caller.clone()),
        }))
    }

    /// access(2) check.
    pub fn access(&self, caller: &v1::Caller, ino: u64, mask: u32) -> FsResult<()> {
        self.call(self.ns().access(v1::AccessRequest {
            caller: Some(caller.clone()),
            ino,
            mask,
        }))
        .map(|_| ())
    }

    /// Every host.
    pub fn list_hosts(&self) -> FsResult<Vec<v1::HostRecord>> {
        self.call(self.cluster.clone().list_hosts(v1::ListHostsRequest {}))
            .map(|r| r.hosts)
    }

    /// Pools of `host_id` (0 = every host).
    pub fn list_pools(&self, host_id: u32) -> FsResult<Vec<v1::PoolRecord>> {
        self.call(
            self.cluster
                .clone()
                .list_pools(v1::ListPoolsRequest { host_id }),
        )
        .map(|r| r.pools)
    }

    /// Cluster counters.
    pub fn stats(&self) -> FsResult<v1::StatsReply> {
        self.call(self.cluster.clone().stats(v1::StatsRequest {}))
    }

    /// Owner `pid` on host `host_id` exited: the manager deletes every name of
    /// its non-persistent regions; returns them.
    pub fn release_owner(&self, host_id: u32, pid: u32) -> FsResult<Vec<u64>> {
        self.call(
            self.cluster
                .clone()
                .release_owner(v1::ReleaseOwnerRequest { host_id, pid }),
        )
        .map(|r| r.inos)
    }
}
