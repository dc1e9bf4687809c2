//! Who a request is for: the kernel's uid, gid and pid of the calling
//! thread, completed with the process id (thread group) and supplementary
//! groups from `/proc/PID/status`, cached briefly.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use regions_proto::v1;

/// The identity the kernel gives with a FUSE request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestCtx {
    /// The caller's user.
    pub uid: u32,
    /// The caller's primary group.
    pub gid: u32,
    /// The calling thread (0 for requests the kernel makes itself, e.g.
    /// writeback).
    pub pid: u32,
}

impl RequestCtx {
    /// A request from `uid`/`gid` by thread `pid`.
    pub fn new(uid: u32, gid: u32, pid: u32) -> RequestCtx {
        RequestCtx { uid, gid, pid }
    }

    /// Whether the caller is the superuser.
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }
}

/// What `/proc/PID/status` says about a thread.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcStatus {
    /// The process (thread group) the thread belongs to.
    pub tgid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

/// Parses the `Tgid:` and `Groups:` lines of a `/proc/PID/status` text.
pub fn parse_status(text: &str) -> ProcStatus {
    let mut status = ProcStatus::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Tgid:") {
            status.tgid = rest.trim().parse().unwrap_or(0);
        } else if let Some(rest) = line.strip_prefix("Groups:") {
            status.groups = rest
                .split_whitespace()
                .filter_map(|g| g.parse().ok())
                .collect();
        }
    }
    status
}

/// How long a thread's groups are trusted before `/proc` is read again.
const TTL: Duration = Duration::from_secs(2);
/// Entries kept before expired ones are swept.
const SWEEP_AT: usize = 4096;

struct Cached {
    at: Instant,
    uid: u32,
    gid: u32,
    status: ProcStatus,
}

/// Builds [`v1::Caller`]s for this mount's host, caching `/proc` reads.
pub struct Identity {
    host_id: u32,
    cache: Mutex<HashMap<u32, Cached>>,
}

impl Identity {
    /// Callers on host `host_id`.
    pub fn new(host_id: u32) -> Identity {
        Identity {
            host_id,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// This mount's host.
    pub fn host_id(&self) -> u32 {
        self.host_id
    }

    /// The caller of a request: its process id is the thread group of the
    /// calling thread (so `OWNERPID` names the process, not a thread).
    pub fn caller(&self, ctx: &RequestCtx) -> v1::Caller {
        let status = self.status(ctx);
        v1::Caller {
            uid: ctx.uid,
            gid: ctx.gid,
            groups: status.groups,
            pid: if status.tgid != 0 {
                status.tgid
            } else {
                ctx.pid
            },
            host_id: self.host_id,
            by_inode: false,
            lease_session: 0,
        }
    }

    /// The superuser acting for regionfs itself (lifetime clean-up).
    pub fn internal(&self) -> v1::Caller {
        v1::Caller {
            uid: 0,
            gid: 0,
            groups: Vec::new(),
            pid: std::process::id(),
            host_id: self.host_id,
            by_inode: false,
            lease_session: 0,
        }
    }

    fn status(&self, ctx: &RequestCtx) -> ProcStatus {
        if ctx.pid == 0 {
            return ProcStatus::default();
        }
        let now = Instant::now();
        if let Ok(cache) = self.cache.lock()
            && let Some(c) = cache.get(&ctx.pid)
            && now.duration_since(c.at) < TTL
            && c.uid == ctx.uid
            && c.gid == ctx.gid
        {
            return c.status.clone();
        }
        let status = match std::fs::read_to_string(format!("/proc/{}/status", ctx.pid)) {
            Ok(text) => parse_status(&text),
            Err(e) => {
                tracing::debug!(pid = ctx.pid, error = %e, "cannot read /proc/PID/status; no supplementary groups");
                ProcStatus::default()
            }
        };
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= SWEEP_AT {
                cache.retain(|_, c| now.duration_since(c.at) < TTL);
            }
            cache.insert(
                ctx.pid,
                Cached {
                    at: now,
                    uid: ctx.uid,
                    gid: ctx.gid,
                    status: status.clone(),
                },
            );
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_status() {
        let text =
            "Name:\tsh\nTgid:\t812\nPid:\t815\nUid:\t1000\t1000\t1000\t1000\nGroups:\t4 24 1000 \n";
        assert_eq!(
            parse_status(text),
            ProcStatus {
                tgid: 812,
                groups: vec![4, 24, 1000]
            }
        );
        assert_eq!(parse_status("Groups:\n"), ProcStatus::default());
    }

    #[test]
    fn caller_of_this_thread() {
        let id = Identity::new(7);
        let me = std::process::id();
        let ctx = RequestCtx::new(0, 0, me);
        let c = id.caller(&ctx);
        assert_eq!((c.pid, c.host_id, c.uid), (me, 7, 0));
        // Cached the second time, same answer.
        assert_eq!(id.caller(&ctx), c);
        // A thread's id (test threads are not the main thread) maps to its
        // process.
        let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
        assert_eq!(id.caller(&RequestCtx::new(0, 0, tid)).pid, me);
        // Kernel-internal requests have no process.
        assert_eq!(id.caller(&RequestCtx::new(0, 0, 0)).pid, 0);
        assert_eq!(id.internal().uid, 0);
    }
}
