//! Host-agent requests of application mapping sessions (`libregions/src/app.rs`): the region's
//! map with a renewed transport capability, growth, and closing the open handle. The caller is
//! the one `SO_PEERCRED` identified; the manager checks its rights.

use std::os::fd::OwnedFd;

use regions_proto::v1::{AgentReply, Caller, MapClose, MapExtend, MapRefresh, agent_reply::Body};

use crate::agent::AgentHandler;
use crate::error::DaemonError;

fn reply(result: Result<Option<Body>, DaemonError>) -> (AgentReply, Option<OwnedFd>) {
    match result {
        Ok(body) => (
            AgentReply {
                errno: 0,
                message: String::new(),
                body,
            },
            None,
        ),
        Err(e) => (
            AgentReply {
                errno: e.errno(),
                message: e.to_string(),
                body: None,
            },
            None,
        ),
    }
}

/// The map (if changed) and a fresh capability.
pub fn refresh(
    handler: &AgentHandler,
    caller: &Caller,
    r: &MapRefresh,
) -> (AgentReply, Option<OwnedFd>) {
    reply(
        handler
            .authority
            .get_map(caller, r.ino, r.known_version, true, r.write, r.handle)
            .map(|info| Some(Body::Region(info))),
    )
}

/// Grows the region.
pub fn extend(
    handler: &AgentHandler,
    caller: &Caller,
    r: &MapExtend,
) -> (AgentReply, Option<OwnedFd>) {
    reply(
        handler
            .authority
            .extend(caller, r.ino, r.size)
            .map(|info| Some(Body::Region(info))),
    )
}

/// Closes an open handle.
pub fn close(
    handler: &AgentHandler,
    caller: &Caller,
    start_time: u64,
    r: &MapClose,
) -> (AgentReply, Option<OwnedFd>) {
    // A handle is its opener's, like a descriptor: another local process (even one of the
    // same user) may not close it and so free an unlinked region or a ONEWRITER slot under it.
    // Handles this agent does not know (the daemon restarted since) go to the manager, which
    // checks the opener's pid.
    if handler
        .handles
        .opened_by_other(caller, start_time, r.handle)
    {
        return reply(Err(DaemonError::BadHandle(format!(
            "handle {} was not opened through this host agent by process {}; close only \
             handles your process opened",
            r.handle, caller.pid
        ))));
    }
    let closed = handler.authority.close(caller, r.handle);
    if closed.is_ok() {
        handler.handles.closed(caller.pid, r.handle);
    }
    reply(closed.map(|()| None))
}
