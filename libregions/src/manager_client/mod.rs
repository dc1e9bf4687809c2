//! The manager's gRPC services as blocking calls, for node components that hold the cluster
//! secret (regionfs, the command, tests): each thread that calls while others do uses a
//! connection of its own, which it drives itself ([`connections`]). This module holds the
//! region calls (open, maps, growth, close); [`namespace`] the file-system calls, [`cluster`]
//! the cluster's.

pub mod cluster;
pub mod namespace;

pub use namespace::{SetAttrIn, SetTime};

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use regions_proto::auth::Secret;
use regions_proto::v1;

use crate::error::{RegionsError, Result};

mod connections;

pub use connections::Authed;
use connections::{Connections, Services};

/// Blocking access to the manager. Calls must come from plain threads, not
/// from inside an async runtime. Threads that call at the same time use connections of
/// their own (see [`connections`]).
pub struct ManagerClient {
    connections: Connections,
}

impl ManagerClient {
    /// Connects to the manager at `addr` (`http://host:port`, e.g. `http://127.0.0.1:7070`,
    /// or `https://host:port` for TLS, trusting `tls_ca` (PEM) if given, else the system's
    /// roots), each connection within `timeout`.
    pub fn connect(
        addr: &str,
        secret: &Secret,
        tls_ca: Option<&Path>,
        timeout: Duration,
    ) -> Result<ManagerClient> {
        Ok(ManagerClient {
            connections: Connections::open(addr, secret, tls_ca, timeout)?,
        })
    }

    pub fn addr(&self) -> &str {
        self.connections.addr()
    }

    /// Runs the call `rpc` makes of a connection's services on the calling thread.
    fn call<T, F, Fut>(&self, rpc: F) -> Result<T>
    where
        F: FnOnce(Services) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let connection = self.connections.take()?;
        let outcome = connection.run(rpc);
        self.connections.put_back(connection);
        outcome
            .map(tonic::Response::into_inner)
            .map_err(|status| match status.code() {
                tonic::Code::Unavailable
                    if status
                        .metadata()
                        .get(regions_proto::errno::ERRNO_KEY)
                        .is_none() =>
                {
                    RegionsError::ManagerUnreachable {
                        addr: self.addr().to_owned(),
                        reason: status.message().to_owned(),
                    }
                }
                _ => RegionsError::from_status(status),
            })
    }

    pub fn open(&self, caller: &v1::Caller, ino: u64, write: bool) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .open(v1::OpenRequest {
                    caller: Some(caller.clone()),
                    ino,
                    write,
                })
                .await
        })
    }

    /// Creates a region and opens it (one durable manager change).
    pub fn create_open(&self, create: v1::CreateRequest, write: bool) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .create_open(v1::CreateOpenRequest {
                    create: Some(create),
                    write,
                })
                .await
        })
    }

    /// Grows region `ino` to at least `size` bytes (durably).
    pub fn extend(&self, caller: &v1::Caller, ino: u64, size: u64) -> Result<v1::RegionInfo> {
        self.grow(caller, ino, size, 0, false)
    }

    /// Grows region `ino`: its size to at least `size` (0: unchanged), its
    /// allocated chunks to cover at least `capacity` bytes; with `touch`,
    /// sets its mtime to now.
    pub fn grow(
        &self,
        caller: &v1::Caller,
        ino: u64,
        size: u64,
        capacity: u64,
        touch: bool,
    ) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .extend(v1::ExtendRequest {
                    caller: Some(caller.clone()),
                    ino,
                    size,
                    capacity,
                    touch,
                    chunks: false,
                })
                .await
        })
    }

    /// Moves region `ino` to chunks if it is a small region stored as an object (for what
    /// needs region memory: a mapping, a segment, words for atomics); the region's info after.
    pub fn to_chunks(&self, caller: &v1::Caller, ino: u64) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .extend(v1::ExtendRequest {
                    caller: Some(caller.clone()),
                    ino,
                    chunks: true,
                    ..Default::default()
                })
                .await
        })
    }

    pub fn truncate(&self, caller: &v1::Caller, ino: u64, size: u64) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .truncate(v1::TruncateRequest {
                    caller: Some(caller.clone()),
                    ino,
                    size,
                })
                .await
        })
    }

    pub fn get_map(
        &self,
        caller: &v1::Caller,
        ino: u64,
        known_version: u64,
    ) -> Result<v1::RegionInfo> {
        self.call(|mut s| async move {
            s.regions
                .get_map(v1::GetMapRequest {
                    caller: Some(caller.clone()),
                    ino,
                    known_version,
                    ..Default::default()
                })
                .await
        })
    }

    /// Which of `handles` the manager closed for the caller's host when its lease ended, and
    /// the manager's lease.
    pub fn check_handles(
        &self,
        caller: &v1::Caller,
        handles: &[u64],
    ) -> Result<v1::CheckHandlesReply> {
        self.call(|mut s| async move {
            s.regions
                .check_handles(v1::CheckHandlesRequest {
                    caller: Some(caller.clone()),
                    handles: handles.to_vec(),
                })
                .await
        })
    }

    /// Closes `handle`; `wrote_within_size` says every byte written through it lies below
    /// the size it made durable (the manager then need not zero the region's tail).
    pub fn close(&self, caller: &v1::Caller, handle: u64, wrote_within_size: bool) -> Result<bool> {
        self.call(|mut s| async move {
            s.regions
                .close(v1::CloseRequest {
                    caller: Some(caller.clone()),
                    handle,
                    wrote_within_size,
                })
                .await
        })
        .map(|r| r.freed)
    }
}
