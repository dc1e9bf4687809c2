//! What the manager's unit tests share: a fresh namespace and callers.

use std::time::Duration;

use crate::access::Caller;
use crate::error::Result;
use crate::state::State;

/// A namespace with only its root (mode 1777, persistent).
pub fn state() -> State {
    State::new(Duration::from_secs(10), 0o1777)
}

/// Root on host 1.
pub fn root() -> Caller {
    Caller::root(1)
}

/// User `uid` (group `uid`, pid `100 + uid`) on host 1, through the mount.
pub fn user(uid: u32) -> Caller {
    Caller {
        uid,
        gid: uid,
        groups: vec![],
        pid: 100 + uid,
        host_id: 1,
        by_inode: false,
        lease_session: 0,
    }
}

/// The errno of a refusal.
pub fn errno<T: std::fmt::Debug>(r: Result<T>) -> i32 {
    r.unwrap_err().errno()
}
