//! Host-agent requests of regions applications opened through the agent
//! (`libregions/src/region/from_file.rs`): the region's
//! map with a renewed transport capability, growth, and closing the open handle. The caller is
//! the one `SO_PEERCRED` identified; the manager checks its rights.

use regions_proto::v1::{Caller, MapClose, MapExtend, MapRefresh, RegionInfo};

use crate::agent::open_handles::OpenHandles;
use crate::error::{DaemonError, Result};
use crate::manager_client::Authority;

/// The map (if changed) and a fresh capability.
pub fn refresh(authority: &dyn Authority, caller: &Caller, r: &MapRefresh) -> Result<RegionInfo> {
    authority.get_map(caller, r.ino, r.known_version, true, r.write, r.handle)
}

/// Grows the region.
pub fn extend(authority: &dyn Authority, caller: &Caller, r: &MapExtend) -> Result<RegionInfo> {
    authority.extend(caller, r.ino, r.size, r.chunks)
}

/// Closes an open handle of `caller`, the process that started at `start_time`.
pub fn close(
    authority: &dyn Authority,
    handles: &OpenHandles,
    caller: &Caller,
    start_time: u64,
    r: &MapClose,
) -> Result<()> {
    // A handle is its opener's, like a descriptor: another local process (even one of the
    // same user) may not close it and so free an unlinked region or a ONEWRITER slot under it.
    // Handles this agent does not know (the daemon restarted since) go to the manager, which
    // checks the opener's pid.
    if handles.opened_by_other(caller, start_time, r.handle) {
        return Err(DaemonError::BadHandle(format!(
            "handle {} was not opened through this host agent by process {}; close only \
             handles your process opened",
            r.handle, caller.pid
        )));
    }
    authority.close(caller, r.handle)?;
    handles.closed(caller.pid, r.handle);
    Ok(())
}
