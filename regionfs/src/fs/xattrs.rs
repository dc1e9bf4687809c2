//! Extended attributes: the manager's, the mount's own (`user.regions.agent`,
//! `user.regions.hostid`, `user.regions.descriptor_epochs`) and the per-thread defaults (`rsetdefaultattr`).

use super::*;

impl RegionFs {
    pub(super) fn xattr_out(value: Vec<u8>, size: u32) -> FsResult<XattrOut> {
        if size == 0 {
            return Ok(XattrOut::Size(
                u32::try_from(value.len())
                    .map_err(|_| FsError::Invalid("attribute too large".into()))?,
            ));
        }
        if value.len() > size as usize {
            return Err(FsError::Range {
                needed: value.len(),
                given: size as usize,
            });
        }
        Ok(XattrOut::Data(value))
    }

    /// getxattr; `size` 0 asks for the size only.
    pub fn getxattr(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        name: &OsStr,
        size: u32,
    ) -> FsResult<XattrOut> {
        if pseudo::is_pseudo(ino) {
            return Err(FsError::NoData(
                "metadata files have no extended attributes".into(),
            ));
        }
        if let Some(value) = self.mount_xattr(name) {
            return Self::xattr_out(value?, size);
        }
        if let Some(value) = self.thread_defaults.getxattr(ctx.pid, ino, name) {
            return Self::xattr_out(value?, size);
        }
        if name == SECURITY_CAPABILITY && self.created_here_recently(ino) {
            // The kernel asks before the first write to every file; a
            // region this mount just created has no extended attributes.
            return Err(FsError::NoData(format!(
                "region {ino} has no {SECURITY_CAPABILITY}"
            )));
        }
        let value = self
            .manager()
            .getxattr(&self.caller(ctx), ino, utf8(name)?)?;
        Self::xattr_out(value, size)
    }

    /// Whether `ino` was created through this mount within the attribute
    /// TTL, with no extended attribute set through it since.
    pub(super) fn created_here_recently(&self, ino: u64) -> bool {
        self.lock_inodes()
            .get(&ino)
            .and_then(|st| st.created_here)
            .is_some_and(|at| at.elapsed() < ATTR_REUSE)
    }

    /// Attributes this mount answers itself, on every inode: how a program
    /// holding a region fd (or the mount's path) finds this host's agent
    /// (`user.regions.agent`) and host id (`user.regions.hostid`).
    pub(super) fn mount_xattr(&self, name: &OsStr) -> Option<FsResult<Vec<u8>>> {
        let config = self.client.config();
        if name == MOUNT_XATTR_AGENT {
            return Some(match &config.agent_socket {
                Some(path) => Ok(path.as_os_str().as_bytes().to_vec()),
                None => Err(FsError::NoData(
                    "this mount has no host agent (start it with --agent-socket)".into(),
                )),
            });
        }
        if name == crate::descriptor_epochs::XATTR {
            return Some(match &self.descriptor_epochs {
                Some(d) => Ok(d.path().as_os_str().as_bytes().to_vec()),
                None => Err(FsError::NoData(
                    "this mount keeps no descriptor-epoch page (see its log at start)".into(),
                )),
            });
        }
        if name == MOUNT_XATTR_HOSTID {
            return Some(Ok(config.host_id.to_string().into_bytes()));
        }
        None
    }

    /// setxattr (flags: XATTR_CREATE, XATTR_REPLACE).
    pub fn setxattr(
        &self,
        ctx: &RequestCtx,
        ino: u64,
        name: &OsStr,
        value: &[u8],
        flags: i32,
    ) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied("region metadata is read-only".into()));
        }
        if let Some(r) = self.thread_defaults.setxattr(ctx.pid, ino, name, value) {
            return r;
        }
        self.not_created_here(ino);
        // Region attributes (`user.regions.*`) are part of what a placement holds.
        let _change = self.placements.change(ino, false);
        Ok(self
            .manager()
            .setxattr(&self.caller(ctx), ino, utf8(name)?, value, flags as u32)?)
    }

    /// Forgets that this mount just created `ino` (its attributes changed).
    pub(super) fn not_created_here(&self, ino: u64) {
        if let Some(st) = self.lock_inodes().get_mut(&ino) {
            st.created_here = None;
        }
    }

    /// listxattr; `size` 0 asks for the size only.
    pub fn listxattr(&self, ctx: &RequestCtx, ino: u64, size: u32) -> FsResult<XattrOut> {
        if pseudo::is_pseudo(ino) {
            return Self::xattr_out(Vec::new(), size);
        }
        let names = self.manager().listxattr(&self.caller(ctx), ino)?;
        let mut list = Vec::new();
        // Region attributes are read and set by name but not listed (like
        // ceph.* attributes): tools that copy every listed attribute would
        // otherwise try to copy read-only ones (ownerpid, vaddr, hosts).
        for n in names
            .into_iter()
            .filter(|n| !n.starts_with(REGION_XATTR_PREFIX))
        {
            list.extend_from_slice(n.as_bytes());
            list.push(0);
        }
        Self::xattr_out(list, size)
    }

    /// removexattr.
    pub fn removexattr(&self, ctx: &RequestCtx, ino: u64, name: &OsStr) -> FsResult<()> {
        if pseudo::is_pseudo(ino) {
            Self::root_only(ctx)?;
            return Err(FsError::Denied("region metadata is read-only".into()));
        }
        if let Some(r) = self.thread_defaults.removexattr(ctx.pid, ino, name) {
            return r;
        }
        self.not_created_here(ino);
        // Region attributes (`user.regions.*`) are part of what a placement holds.
        let _change = self.placements.change(ino, false);
        Ok(self
            .manager()
            .removexattr(&self.caller(ctx), ino, utf8(name)?)?)
    }
}
