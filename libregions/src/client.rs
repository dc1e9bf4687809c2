//! The client of node components: path walks, creation and opening of regions over its
//! [`Connection`] (who it acts for, its manager connection, its transports).

use std::sync::Arc;

use regions_proto::v1;

use crate::connection::{ClientConfig, Connection};
use crate::error::{RegionsError, Result};
use crate::manager_client::ManagerClient;
use crate::region::Region;
use crate::transport::{StatsSnapshot, Transport};

pub use regions_proto::ROOT_INO;

/// The non-empty components of a path ("." kept: the manager's lookup
/// knows it, as it knows "..").
fn components(path: &str) -> impl DoubleEndedIterator<Item = &str> {
    path.split('/').filter(|n| !n.is_empty())
}

/// The kernel's `protected_symlinks` rule: a symbolic link in a sticky,
/// world-writable directory is followed only by its owner, or when the
/// directory's owner owns it.
fn check_followable(
    caller: &v1::Caller,
    dir: &v1::Attr,
    link: &v1::Attr,
    name: &str,
) -> Result<()> {
    let shared_sticky = dir.mode & 0o1002 == 0o1002;
    if shared_sticky && link.uid != caller.uid && link.uid != dir.uid {
        return Err(RegionsError::Manager {
            errno: libc::EACCES,
            message: format!(
                "symbolic link {name:?} belongs to uid {} in a sticky world-writable directory; only its owner follows it (protected_symlinks)",
                link.uid
            ),
        });
    }
    Ok(())
}

/// An absolute symlink target as a path inside the namespace: the part
/// after `mount`, or `None` when it points elsewhere.
fn namespace_relative(target: &str, mount: &std::path::Path) -> Option<String> {
    let mount = mount.to_str()?.trim_end_matches('/');
    let rest = target.strip_prefix(mount)?;
    (rest.is_empty() || rest.starts_with('/')).then(|| rest.to_owned())
}

/// A connection to a regions cluster.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Connection>,
}

impl Client {
    pub fn connect(config: ClientConfig) -> Result<Client> {
        let manager = ManagerClient::connect(
            &config.manager,
            &config.secret,
            config.tls_ca.as_deref(),
            config.connect_timeout,
        )?;
        let caller = v1::Caller {
            uid: config.uid,
            gid: config.gid,
            groups: config.groups.clone(),
            pid: config.pid,
            host_id: config.host_id,
            by_inode: false,
            lease_session: 0,
        };
        Ok(Client {
            shared: Arc::new(Connection::new(manager, caller, config)),
        })
    }

    pub fn manager(&self) -> &ManagerClient {
        &self.shared.manager
    }

    pub fn caller(&self) -> &v1::Caller {
        &self.shared.caller
    }

    /// Traffic counters of this client's transports.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Resolves a path relative to the root ("a/b/c"), following symbolic
    /// links as `open(2)` does (see [`Client::resolve`]).
    pub fn lookup_path(&self, path: &str) -> Result<v1::Attr> {
        self.resolve(path, true)
    }

    /// Resolves `path` from the namespace root. Symbolic links in the middle
    /// are followed, and the last one too when `follow_last`: a relative
    /// target from the link's directory, an absolute one from the root once
    /// the mount point (`REGIONS_MOUNT`, default `/regions`) is taken off its
    /// front. A target that leads out of the namespace (absolute elsewhere,
    /// or `..` above the root) is `EINVAL`: open it through the file system.
    /// As the kernel's `protected_symlinks`, a link in a sticky world-writable
    /// directory is followed only if the caller or the directory's owner owns
    /// it (`EACCES`). More than 40 links give [`RegionsError::SymlinkLoop`].
    pub fn resolve(&self, path: &str, follow_last: bool) -> Result<v1::Attr> {
        const MAX_FOLLOWED: usize = 40;
        let manager = &self.shared.manager;
        let caller = &self.shared.caller;
        let root = manager.getattr(caller, ROOT_INO)?;
        // The directories walked so far, the root first: ".." pops one.
        let mut dirs = vec![root.clone()];
        let mut attr = root.clone();
        // Components still to walk, the next one last, each with whether it came
        // from a link target.
        let mut pending: Vec<(String, bool)> = components(path)
            .rev()
            .map(|c| (c.to_owned(), false))
            .collect();
        let mut followed = 0;
        while let Some((name, from_link)) = pending.pop() {
            let dir = dirs.last().cloned().unwrap_or_else(|| root.clone());
            match name.as_str() {
                "." => {
                    attr = dir;
                    continue;
                }
                ".." => {
                    // Search permission on the directory left, as the kernel checks.
                    manager.lookup(caller, dir.ino, "..")?;
                    if dirs.len() == 1 {
                        if from_link {
                            return Err(RegionsError::Invalid(format!(
                                "a symbolic link in {path:?} leads above the regions root; open it through the file system"
                            )));
                        }
                    } else {
                        dirs.pop();
                    }
                    attr = dirs.last().cloned().unwrap_or_else(|| root.clone());
                    continue;
                }
                _ => {}
            }
            attr = manager.lookup(caller, dir.ino, &name)?;
            let is_link = attr.kind() == v1::FileKind::Symlink;
            if !is_link || (pending.is_empty() && !follow_last) {
                if !pending.is_empty() {
                    dirs.push(attr.clone());
                }
                continue;
            }
            followed += 1;
            if followed > MAX_FOLLOWED {
                return Err(RegionsError::SymlinkLoop(path.to_owned()));
            }
            check_followable(caller, &dir, &attr, &name)?;
            let target = manager.readlink(caller, attr.ino)?;
            let target = String::from_utf8(target).map_err(|_| {
                RegionsError::Invalid(format!(
                    "symbolic link {name:?} in {path:?} has a target that is not UTF-8"
                ))
            })?;
            let inside = if target.starts_with('/') {
                dirs.truncate(1);
                namespace_relative(&target, &crate::agent::default_mount()).ok_or_else(|| {
                    RegionsError::Invalid(format!(
                        "symbolic link {name:?} in {path:?} points to {target:?}, outside the regions mount; open it through the file system"
                    ))
                })?
            } else {
                target
            };
            pending.extend(components(&inside).rev().map(|c| (c.to_owned(), true)));
            if pending.is_empty() {
                attr = dirs.last().cloned().unwrap_or_else(|| root.clone()); // a link to the root
            }
        }
        Ok(attr)
    }

    /// The parent directory and last name of `path`.
    fn split_path<'a>(&self, path: &'a str) -> Result<(u64, &'a str)> {
        let trimmed = path.trim_end_matches('/');
        let (dir, name) = match trimmed.rsplit_once('/') {
            Some((dir, name)) => (dir, name),
            None => ("", trimmed),
        };
        if name.is_empty() {
            return Err(RegionsError::Invalid(format!(
                "path {path:?} names no entry"
            )));
        }
        Ok((self.lookup_path(dir)?.ino, name))
    }

    /// Creates a region at `path` (its directory must exist).
    pub fn create_path(
        &self,
        path: &str,
        mode: u32,
        attrs: Option<v1::RegionAttrOverrides>,
        preallocate: u64,
    ) -> Result<v1::Attr> {
        let (parent, name) = self.split_path(path)?;
        self.shared.manager.create(v1::CreateRequest {
            caller: Some(self.shared.caller.clone()),
            parent,
            name: name.to_owned(),
            mode,
            attrs,
            preallocate,
        })
    }

    /// Creates a directory at `path`.
    pub fn mkdir_path(&self, path: &str, mode: u32) -> Result<v1::Attr> {
        let (parent, name) = self.split_path(path)?;
        self.shared
            .manager
            .mkdir(&self.shared.caller, parent, name, mode)
    }

    /// Waits until every write posted through this client landed, and returns the first of
    /// `owner`'s that did not (until [`Client::forget_lost_writes`]).
    pub fn settle_posted_writes(&self, owner: u64) -> Result<()> {
        let transports = self
            .shared
            .transports()
            .into_iter()
            .map(|t| t as Arc<dyn Transport>);
        crate::transport::first_lost_write(transports, owner).map_or(Ok(()), Err)
    }

    /// Forgets a lost posted write of `owner`'s (its last descriptor closed).
    pub fn forget_lost_writes(&self, owner: u64) {
        for t in self.shared.transports() {
            t.forget_failed_writes(owner);
        }
    }

    /// Removes the region at `path`.
    pub fn unlink_path(&self, path: &str) -> Result<()> {
        let (parent, name) = self.split_path(path)?;
        self.shared
            .manager
            .unlink(&self.shared.caller, parent, name)
            .map(|_| ())
    }

    /// Opens a region by inode as this client's caller.
    pub fn open(&self, ino: u64, write: bool) -> Result<Region> {
        self.open_as(&self.shared.caller.clone(), ino, write)
    }

    /// Opens a region by inode on behalf of `caller` (a node component
    /// serving many processes, e.g. regionfs); the manager checks the
    /// permission as that caller and the region's later calls are theirs.
    pub fn open_as(&self, caller: &v1::Caller, ino: u64, write: bool) -> Result<Region> {
        let info = self.shared.manager.open(caller, ino, write)?;
        Region::new(Arc::clone(&self.shared), caller.clone(), info, write)
    }

    /// A read-only [`Region`] from a placement this client already holds (see
    /// [`Region::placement`]), opened without asking the manager and without a handle
    /// there: for a node component that knows, by a cache lease, that nothing changed the
    /// region since that placement was current (regionfs's leased opens).
    pub fn open_placed(&self, caller: &v1::Caller, placement: v1::RegionInfo) -> Result<Region> {
        Region::without_handle(Arc::clone(&self.shared), caller.clone(), placement)
    }

    /// Creates a region as `create` says and opens it, in one manager
    /// request, on behalf of `create.caller` (see [`Client::open_as`]).
    pub fn create_open_as(&self, create: v1::CreateRequest, write: bool) -> Result<Region> {
        let caller = create.caller.clone().unwrap_or_default();
        let info = self.shared.manager.create_open(create, write)?;
        Region::new(Arc::clone(&self.shared), caller, info, write)
    }

    /// This host's segment memfd of region `ino` from the host agent, if
    /// an agent is configured and this host holds part of the region.
    pub fn local_segment(&self, ino: u64, write: bool) -> Result<Option<crate::agent::Segment>> {
        self.shared.segment(ino, write, 0)
    }

    /// The configuration this client was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.shared.config
    }

    /// Opens a region by path.
    pub fn open_path(&self, path: &str, write: bool) -> Result<Region> {
        let attr = self.lookup_path(path)?;
        self.open(attr.ino, write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absolute_link_targets_are_read_inside_the_mount() {
        let mount = std::path::Path::new("/regions/");
        assert_eq!(
            namespace_relative("/regions/a/b", mount).as_deref(),
            Some("/a/b")
        );
        assert_eq!(namespace_relative("/regions", mount).as_deref(), Some(""));
        assert_eq!(namespace_relative("/regionsx/a", mount), None);
        assert_eq!(namespace_relative("/etc/passwd", mount), None);
        let parts: Vec<&str> = components("a//b/./../c/").collect();
        assert_eq!(parts, ["a", "b", ".", "..", "c"]);
    }
}
