//! The `.regions/` metadata tree (Remote Regions paper §5.12): lookups, listings
//! and the content of its files, for root only.

use super::*;

impl RegionFs {
    pub(super) fn pseudo_lookup(
        &self,
        ctx: &RequestCtx,
        node: Node,
        name: &OsStr,
    ) -> FsResult<v1::Attr> {
        Self::root_only(ctx)?;
        let name = wire(name)?;
        let name: &str = &name;
        match node {
            Node::Root => {
                if name == "files" {
                    return self.pseudo_attr(Node::Files(ROOT_INO));
                }
                pseudo::FIXED
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, node)| self.pseudo_attr(*node))
                    .unwrap_or_else(|| Err(FsError::NotFound(format!(".regions/{name}"))))
            }
            Node::Files(dir) => {
                let a = self
                    .manager()
                    .lookup(&self.identity.internal(), dir, name)?;
                let node = Node::mirror(a.ino).ok_or_else(|| {
                    FsError::Invalid(format!("inode {} is too large to mirror", a.ino))
                })?;
                let parent_path = self
                    .pseudo_paths
                    .lock()
                    .ok()
                    .and_then(|p| p.get(&dir).cloned())
                    .unwrap_or_default();
                if let Ok(mut p) = self.pseudo_paths.lock() {
                    p.insert(a.ino, format!("{parent_path}/{name}"));
                }
                self.pseudo_attr(node)
            }
            _ => Err(FsError::NotDir(format!(".regions node {:#x}", node.ino()))),
        }
    }

    pub(super) fn pseudo_readdir(&self, node: Node, offset: u64) -> FsResult<Vec<DirEntryOut>> {
        match node {
            Node::Root => {
                let mut out = self.dots(node.ino(), ROOT_INO, offset);
                let names = pseudo::FIXED
                    .iter()
                    .map(|(n, node)| (*n, *node, false))
                    .chain(std::iter::once(("files", Node::Files(ROOT_INO), true)));
                for (i, (name, node, dir)) in names.enumerate() {
                    let cookie = 3 + i as u64;
                    if cookie > offset {
                        out.push(DirEntryOut {
                            ino: node.ino(),
                            cookie,
                            name: name.into(),
                            kind: if dir {
                                FileKind::Directory
                            } else {
                                FileKind::Region
                            },
                            attr: Some(self.pseudo_attr(node)?),
                        });
                    }
                }
                Ok(out)
            }
            Node::Files(dir) => {
                let mut out = self.dots(node.ino(), Node::Root.ino(), offset);
                let dir_path = self
                    .pseudo_paths
                    .lock()
                    .ok()
                    .and_then(|p| p.get(&dir).cloned())
                    .unwrap_or_default();
                let reply = self.manager().readdir(
                    &self.identity.internal(),
                    dir,
                    if offset < 3 { 0 } else { offset },
                    READDIR_BATCH,
                )?;
                for e in reply.entries {
                    let Some(a) = e.attr else { continue };
                    // Metadata is about regions and the directories that hold them.
                    if !matches!(a.kind(), FileKind::Region | FileKind::Directory) {
                        continue;
                    }
                    let Some(m) = Node::mirror(a.ino) else {
                        continue;
                    };
                    let mut attr = self.pseudo_attr_from(m, &a);
                    attr.ino = m.ino();
                    if let Ok(mut p) = self.pseudo_paths.lock() {
                        p.insert(a.ino, format!("{dir_path}/{}", e.name));
                    }
                    out.push(DirEntryOut {
                        ino: m.ino(),
                        cookie: e.offset,
                        name: names::from_wire(&e.name),
                        kind: a.kind(),
                        attr: Some(attr),
                    });
                }
                Ok(out)
            }
            _ => Err(FsError::NotDir(format!(".regions node {:#x}", node.ino()))),
        }
    }

    fn pseudo_attr_from(&self, node: Node, a: &v1::Attr) -> v1::Attr {
        let dir = is_dir(a);
        let t = a.mtime.unwrap_or(self.started);
        v1::Attr {
            ino: node.ino(),
            kind: a.kind,
            mode: if dir { 0o500 } else { 0o400 },
            nlink: if dir { 2 } else { 1 },
            atime: Some(t),
            mtime: Some(t),
            ctime: Some(t),
            crtime: Some(t),
            ..Default::default()
        }
    }

    pub(super) fn pseudo_open(&self, ctx: &RequestCtx, node: Node, flags: i32) -> FsResult<Opened> {
        Self::root_only(ctx)?;
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            return Err(FsError::Denied("region metadata is read-only".into()));
        }
        let text = self.render(node)?;
        let fh = self.add_handle(Handle {
            ino: node.ino(),
            pid: ctx.pid,
            uid: ctx.uid,
            body: Body::Pseudo(text.into_bytes()),
        });
        Ok(Opened {
            fh,
            keep_cache: false,
            direct_io: true,
            passthrough: false,
            backing: None,
        })
    }

    /// Generates a pseudo file's content.
    fn render(&self, node: Node) -> FsResult<String> {
        let host_id = self.identity.host_id();
        match node {
            Node::Root => Err(FsError::IsDir(".regions".into())),
            Node::Hosts => Ok(pseudo::render_hosts(&self.manager().list_hosts()?)),
            Node::Pools => {
                let pools = self.manager().list_pools(0)?;
                let daemon = self.daemon_stats().map_err(|e| e.to_string());
                Ok(pseudo::render_pools(
                    &pools,
                    host_id,
                    daemon.as_ref().map_err(String::as_str),
                ))
            }
            Node::MemUsage => {
                let hosts = self.manager().list_hosts()?;
                let pools = self.manager().list_pools(host_id)?;
                let daemon = self.daemon_stats().ok();
                Ok(pseudo::render_memusage(
                    host_id,
                    hosts.iter().find(|h| h.host_id == host_id),
                    &pools,
                    daemon.as_ref(),
                ))
            }
            Node::Daemon => {
                let pid = self.daemon_pid();
                match self.daemon_stats() {
                    Ok(s) => Ok(pseudo::render_daemon(pid, Some(&s), "")),
                    Err(e) => Ok(pseudo::render_daemon(pid, None, &e.to_string())),
                }
            }
            Node::Procs => {
                let lines: Vec<pseudo::ProcLine> = self
                    .handles
                    .read()
                    .map(|m| {
                        m.iter()
                            .filter_map(|(fh, h)| match &h.body {
                                Body::Region(r) => Some(pseudo::ProcLine {
                                    pid: h.pid,
                                    uid: h.uid,
                                    ino: h.ino,
                                    fh: *fh,
                                    writable: r.write,
                                    io: r.io.lock().map(|i| i.name()).unwrap_or("?"),
                                }),
                                Body::Pseudo(_) => None,
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let owners = self
                    .owners
                    .as_ref()
                    .map(OwnerWatch::watched)
                    .unwrap_or_default();
                Ok(pseudo::render_procs(&lines, &owners))
            }
            Node::Files(ino) => {
                let internal = self.identity.internal();
                let attr = self.manager().getattr(&internal, ino)?;
                if is_dir(&attr) {
                    return Err(FsError::IsDir(format!(".regions/files inode {ino}")));
                }
                let info = match self.client.manager().get_map(&internal, ino, 0) {
                    Ok(i) => Some(i),
                    Err(e) => {
                        tracing::debug!(ino, error = %e, "no map for .regions/files");
                        None
                    }
                };
                let path = self
                    .pseudo_paths
                    .lock()
                    .ok()
                    .and_then(|p| p.get(&ino).cloned())
                    .unwrap_or_else(|| format!("<inode {ino}>"));
                Ok(pseudo::render_region(&path, &attr, info.as_ref()))
            }
        }
    }

    fn daemon_stats(&self) -> FsResult<v1::DaemonStats> {
        let path = self
            .client
            .config()
            .agent_socket
            .clone()
            .ok_or_else(|| FsError::NotFound("no --agent-socket configured".into()))?;
        Ok(regions::agent::AgentClient::connect(&path)?.stats()?)
    }

    /// The daemon's pid: the peer of a connection to its agent socket.
    fn daemon_pid(&self) -> Option<u32> {
        let path = self.client.config().agent_socket.clone()?;
        let stream = std::os::unix::net::UnixStream::connect(path).ok()?;
        let cred = rustix::net::sockopt::socket_peercred(&stream).ok()?;
        Some(cred.pid.as_raw_nonzero().get() as u32)
    }
}
