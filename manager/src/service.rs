//! The gRPC services: a thin adapter from requests to [`Manager`] calls,
//! and from [`ManagerError`] to statuses (with the errno in metadata).

use std::pin::Pin;
use std::sync::Arc;

use regions_proto::v1::{
    self, cluster_server::Cluster, namespace_server::Namespace, regions_server::Regions,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::access::Caller;
use crate::cluster::HostRegistration;
use crate::error::{ManagerError, Result};
use crate::manager::Manager;
use crate::model::Kind;
use crate::namespace::{SetAttr, TimeChange};

/// Most entries one ReadDir returns.
const READDIR_MAX: usize = 1024;

/// The manager's services, sharing one [`Manager`].
#[derive(Clone)]
pub struct Services {
    pub manager: Arc<Manager>,
    /// Signs the transport capabilities handed out with opens.
    pub minter: Arc<crate::capability::Minter>,
}

impl Services {
    /// [`reply`] for a namespace or region request, counted.
    fn reply<T>(&self, op: &'static str, result: Result<T>) -> Result<Response<T>, Status> {
        self.manager.count_file_request();
        tracing::trace!(op, "file request");
        reply(op, result)
    }
}

/// Turns a manager result into a reply, logging refusals.
fn reply<T>(op: &'static str, result: Result<T>) -> Result<Response<T>, Status> {
    match result {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            match &e {
                ManagerError::Store(_) => tracing::error!(op, error = %e, "request failed"),
                _ => tracing::debug!(op, error = %e, "request refused"),
            }
            Err(e.into())
        }
    }
}

fn caller(c: Option<&v1::Caller>) -> Result<Caller, Status> {
    Caller::from_proto(c).map_err(Status::from)
}

#[tonic::async_trait]
impl Namespace for Services {
    async fn lookup(&self, r: Request<v1::LookupRequest>) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply("lookup", self.manager.lookup(&c, r.parent, &r.name).await)
    }

    async fn get_attr(&self, r: Request<v1::GetAttrRequest>) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply("getattr", self.manager.getattr(&c, r.ino).await)
    }

    async fn set_attr(&self, r: Request<v1::SetAttrRequest>) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let change = SetAttr {
            mode: r.mode,
            uid: r.uid,
            gid: r.gid,
            atime: TimeChange::from_proto(r.atime.as_ref()),
            mtime: TimeChange::from_proto(r.mtime.as_ref()),
            through_write_handle: r.through_write_handle,
        };
        self.reply(
            "setattr",
            self.manager.setattr(c, r.ino, change, r.size).await,
        )
    }

    async fn mkdir(&self, r: Request<v1::MkdirRequest>) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "mkdir",
            self.manager.mkdir(&c, r.parent, &r.name, r.mode).await,
        )
    }

    async fn rmdir(&self, r: Request<v1::RemoveRequest>) -> Result<Response<v1::Empty>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "rmdir",
            self.manager
                .rmdir(&c, r.parent, &r.name)
                .await
                .map(|()| v1::Empty {}),
        )
    }

    async fn create(&self, r: Request<v1::CreateRequest>) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let result = self
            .manager
            .create(c, r.parent, r.name, r.mode, r.attrs, r.preallocate)
            .await;
        self.reply("create", result)
    }

    async fn symlink(&self, r: Request<v1::SymlinkRequest>) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "symlink",
            self.manager.symlink(&c, r.parent, &r.name, &r.target).await,
        )
    }

    async fn read_link(
        &self,
        r: Request<v1::GetAttrRequest>,
    ) -> Result<Response<v1::ReadLinkReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "readlink",
            self.manager
                .readlink(&c, r.ino)
                .await
                .map(|target| v1::ReadLinkReply { target }),
        )
    }

    async fn link(&self, r: Request<v1::LinkRequest>) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "link",
            self.manager
                .link(&c, r.ino, r.new_parent, &r.new_name)
                .await,
        )
    }

    async fn make_node(
        &self,
        r: Request<v1::MakeNodeRequest>,
    ) -> Result<Response<v1::Attr>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let kind = v1::FileKind::try_from(r.kind)
            .ok()
            .and_then(Kind::from_proto)
            .ok_or_else(|| {
                Status::invalid_argument(format!("mknod: unknown file kind {}", r.kind))
            })?;
        self.reply(
            "mknod",
            self.manager
                .make_node(&c, r.parent, &r.name, kind, r.mode, r.rdev)
                .await,
        )
    }

    async fn unlink(
        &self,
        r: Request<v1::RemoveRequest>,
    ) -> Result<Response<v1::Unlinked>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "unlink",
            self.manager
                .unlink(&c, r.parent, &r.name)
                .await
                .map(|(ino, nlink)| v1::Unlinked { ino, nlink }),
        )
    }

    async fn rename(&self, r: Request<v1::RenameRequest>) -> Result<Response<v1::Empty>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "rename",
            self.manager
                .rename(&c, r.parent, &r.name, r.new_parent, &r.new_name, r.flags)
                .await
                .map(|()| v1::Empty {}),
        )
    }

    async fn read_dir(
        &self,
        r: Request<v1::ReadDirRequest>,
    ) -> Result<Response<v1::ReadDirReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let limit = match r.limit as usize {
            0 => READDIR_MAX,
            n => n.min(READDIR_MAX),
        };
        self.reply(
            "readdir",
            self.manager.readdir(&c, r.ino, r.offset, limit).await,
        )
    }

    async fn get_xattr(
        &self,
        r: Request<v1::GetXattrRequest>,
    ) -> Result<Response<v1::GetXattrReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "getxattr",
            self.manager
                .getxattr(&c, r.ino, &r.name)
                .await
                .map(|value| v1::GetXattrReply { value }),
        )
    }

    async fn set_xattr(
        &self,
        r: Request<v1::SetXattrRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "setxattr",
            self.manager
                .setxattr(&c, r.ino, &r.name, &r.value, r.flags)
                .await
                .map(|()| v1::Empty {}),
        )
    }

    async fn list_xattr(
        &self,
        r: Request<v1::ListXattrRequest>,
    ) -> Result<Response<v1::ListXattrReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "listxattr",
            self.manager
                .listxattr(&c, r.ino)
                .await
                .map(|names| v1::ListXattrReply { names }),
        )
    }

    async fn remove_xattr(
        &self,
        r: Request<v1::RemoveXattrRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "removexattr",
            self.manager
                .removexattr(&c, r.ino, &r.name)
                .await
                .map(|()| v1::Empty {}),
        )
    }

    async fn stat_fs(
        &self,
        r: Request<v1::StatFsRequest>,
    ) -> Result<Response<v1::StatFsReply>, Status> {
        caller(r.get_ref().caller.as_ref())?;
        self.reply("statfs", self.manager.statfs().await)
    }

    async fn access(&self, r: Request<v1::AccessRequest>) -> Result<Response<v1::Empty>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "access",
            self.manager
                .access(&c, r.ino, r.mask)
                .await
                .map(|()| v1::Empty {}),
        )
    }
}

#[tonic::async_trait]
impl Regions for Services {
    async fn open(&self, r: Request<v1::OpenRequest>) -> Result<Response<v1::RegionInfo>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let issued = crate::revocations::tick();
        let opened = match self.manager.read(|s| s.check_lease(c.host_id)).await {
            Ok(()) => self.manager.open_region(&c, r.ino, r.write).await,
            Err(e) => Err(e),
        };
        self.reply(
            "open",
            opened.map(|mut info| {
                self.minter.stamp(&mut info, r.write, issued, c.host_id);
                info
            }),
        )
    }

    async fn create_open(
        &self,
        r: Request<v1::CreateOpenRequest>,
    ) -> Result<Response<v1::RegionInfo>, Status> {
        let r = r.into_inner();
        let create = r.create.unwrap_or_default();
        let c = caller(create.caller.as_ref())?;
        let host = c.host_id;
        // Issued before the lease check: a fence that comes after the check revokes it.
        let issued = crate::revocations::tick();
        if let Err(e) = self.manager.read(|s| s.check_lease(host)).await {
            return self.reply("create_open", Err(e));
        }
        let created = self
            .manager
            .create_open(
                c,
                create.parent,
                create.name,
                create.mode,
                create.attrs,
                create.preallocate,
                r.write,
            )
            .await;
        self.reply(
            "create_open",
            created.map(|mut info| {
                self.minter.stamp(&mut info, r.write, issued, host);
                info
            }),
        )
    }

    async fn extend(
        &self,
        r: Request<v1::ExtendRequest>,
    ) -> Result<Response<v1::RegionInfo>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let grow = crate::manager::Extend {
            size: r.size,
            capacity: r.capacity,
            touch: r.touch,
            chunks: r.chunks,
        };
        self.reply("extend", self.manager.extend(c, r.ino, grow).await)
    }

    async fn truncate(
        &self,
        r: Request<v1::TruncateRequest>,
    ) -> Result<Response<v1::RegionInfo>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply("truncate", self.manager.truncate(c, r.ino, r.size).await)
    }

    async fn get_map(
        &self,
        r: Request<v1::GetMapRequest>,
    ) -> Result<Response<v1::RegionInfo>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let issued = crate::revocations::tick();
        // A renewal for a handle needs the handle still open, and a host with its lease.
        let fenced = self
            .manager
            .read(|s| {
                if r.handle != 0 {
                    s.check_open_handle(&c, r.ino, r.handle)?;
                }
                if r.want_capability {
                    s.check_lease(c.host_id)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = fenced {
            return self.reply("getmap", Err(e));
        }
        let mut result = self.manager.get_map(&c, r.ino, r.known_version).await;
        if r.want_capability && result.is_ok() {
            // A writable token needs write permission now (the map needs only read).
            let allowed = if r.write {
                let mask = (libc::R_OK | libc::W_OK) as u32;
                self.manager.access(&c, r.ino, mask).await
            } else {
                Ok(())
            };
            result = match (result, allowed) {
                (Ok(mut info), Ok(())) => {
                    self.minter.stamp(&mut info, r.write, issued, c.host_id);
                    Ok(info)
                }
                (_, Err(e)) | (Err(e), _) => Err(e),
            };
        }
        self.reply("getmap", result)
    }

    async fn check_handles(
        &self,
        r: Request<v1::CheckHandlesRequest>,
    ) -> Result<Response<v1::CheckHandlesReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        // A liveness question, not a file request (not counted as one).
        reply(
            "check_handles",
            self.manager
                .read(|s| {
                    Ok(v1::CheckHandlesReply {
                        gone: s.gone_handles(c.host_id, &r.handles),
                        lease_ms: s.lease.as_millis() as u64,
                        host_fenced: s.lease_lost.contains(&c.host_id),
                    })
                })
                .await,
        )
    }

    async fn close(
        &self,
        r: Request<v1::CloseRequest>,
    ) -> Result<Response<v1::CloseReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        self.reply(
            "close",
            self.manager
                .close(&c, r.handle, r.wrote_within_size)
                .await
                .map(|freed| v1::CloseReply { freed }),
        )
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<v1::HostEvent, Status>> + Send>>;
type CacheLeaseStream = Pin<Box<dyn Stream<Item = Result<v1::CacheLeaseEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Cluster for Services {
    async fn register_host(
        &self,
        r: Request<v1::RegisterHostRequest>,
    ) -> Result<Response<v1::RegisterHostReply>, Status> {
        let r = r.into_inner();
        let reg = HostRegistration {
            host_id: r.host_id,
            transport_addr: r.transport_addr,
            agent_socket: r.agent_socket,
            memory_offered: r.memory_offered,
            incarnation: r.incarnation,
            transports: r.transports,
            object_memory: r.object_memory,
        };
        reply(
            "register_host",
            (async {
                let (lease_ms, pools) = self.manager.register_host(&reg).await?;
                tracing::info!(host = reg.host_id, addr = %reg.transport_addr, "host registered");
                Ok(v1::RegisterHostReply {
                    lease_ms,
                    pools,
                    revoke_all: Some(crate::revocations::revoke_all(
                        self.manager.run_began(),
                        self.manager.config().capability_ttl,
                    )),
                })
            })
            .await,
        )
    }

    async fn heartbeat(
        &self,
        r: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatReply>, Status> {
        let r = r.into_inner();
        reply(
            "heartbeat",
            (async {
                self.manager
                    .heartbeat(r.host_id, r.incarnation)
                    .await
                    .map(|lease_ms| v1::HeartbeatReply { lease_ms })
            })
            .await,
        )
    }

    async fn events_applied(
        &self,
        r: Request<v1::EventsAppliedRequest>,
    ) -> Result<Response<v1::EventsAppliedReply>, Status> {
        let r = r.into_inner();
        reply(
            "events_applied",
            self.manager
                .events_applied(r.host_id, r.sequence)
                .map(|()| v1::EventsAppliedReply {}),
        )
    }

    async fn register_pool(
        &self,
        r: Request<v1::RegisterPoolRequest>,
    ) -> Result<Response<v1::PoolRecord>, Status> {
        let r = r.into_inner();
        reply(
            "register_pool",
            self.manager.register_pool(r.host_id, r.gid, r.size).await,
        )
    }

    async fn list_hosts(
        &self,
        _: Request<v1::ListHostsRequest>,
    ) -> Result<Response<v1::ListHostsReply>, Status> {
        reply(
            "list_hosts",
            self.manager
                .list_hosts()
                .await
                .map(|hosts| v1::ListHostsReply { hosts }),
        )
    }

    async fn list_pools(
        &self,
        r: Request<v1::ListPoolsRequest>,
    ) -> Result<Response<v1::ListPoolsReply>, Status> {
        let host = r.into_inner().host_id;
        reply(
            "list_pools",
            self.manager
                .list_pools(host)
                .await
                .map(|pools| v1::ListPoolsReply { pools }),
        )
    }

    async fn pool_chunks(
        &self,
        r: Request<v1::PoolChunksRequest>,
    ) -> Result<Response<v1::PoolChunksReply>, Status> {
        let gid = r.into_inner().gid;
        reply("pool_chunks", self.manager.pool_chunks(gid).await)
    }

    async fn stats(
        &self,
        _: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsReply>, Status> {
        reply("stats", self.manager.stats().await)
    }

    async fn release_owner(
        &self,
        r: Request<v1::ReleaseOwnerRequest>,
    ) -> Result<Response<v1::ReleaseOwnerReply>, Status> {
        let r = r.into_inner();
        reply(
            "release_owner",
            self.manager
                .release_owner(r.host_id, r.pid)
                .await
                .map(|inos| v1::ReleaseOwnerReply { inos }),
        )
    }

    type WatchCacheLeasesStream = CacheLeaseStream;

    async fn watch_cache_leases(
        &self,
        r: Request<v1::WatchCacheLeasesRequest>,
    ) -> Result<Response<CacheLeaseStream>, Status> {
        let host = r.into_inner().host_id;
        let (session, rx) = self
            .manager
            .cache_leases()
            .open_session()
            .map_err(Status::from)?;
        tracing::debug!(session, host, "a mount opened a cache-lease session");
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn renew_cache_leases(
        &self,
        r: Request<v1::RenewCacheLeasesRequest>,
    ) -> Result<Response<v1::RenewCacheLeasesReply>, Status> {
        let session = r.into_inner().session;
        reply(
            "renew_cache_leases",
            self.manager
                .cache_leases()
                .renew(session)
                .map(|()| v1::RenewCacheLeasesReply {}),
        )
    }

    async fn cache_lease_recalled(
        &self,
        r: Request<v1::CacheLeaseRecalledRequest>,
    ) -> Result<Response<v1::CacheLeaseRecalledReply>, Status> {
        let r = r.into_inner();
        self.manager.cache_leases().recalled(r.session, r.recall);
        Ok(Response::new(v1::CacheLeaseRecalledReply {}))
    }

    type WatchHostStream = EventStream;

    async fn watch_host(
        &self,
        r: Request<v1::WatchHostRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let r = r.into_inner();
        let manager = Arc::clone(&self.manager);
        // Refuse at once when the daemon must resync.
        manager
            .events_after(r.host_id, r.after_sequence)
            .map_err(Status::from)?;
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            let mut wake = manager.subscribe_events();
            let mut closing = manager.closing();
            let mut cursor = r.after_sequence;
            loop {
                let events = match manager.events_after(r.host_id, cursor) {
                    Ok(events) => events,
                    Err(e) => {
                        let _ = tx.send(Err(Status::from(e))).await;
                        return;
                    }
                };
                for event in events {
                    cursor = event.sequence;
                    if tx.send(Ok(event)).await.is_err() {
                        return; // the daemon went away
                    }
                }
                tokio::select! {
                    changed = wake.changed() => if changed.is_err() { return },
                    _ = closing.wait_for(|c| *c) => return,
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}
