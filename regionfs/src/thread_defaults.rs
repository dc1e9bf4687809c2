//! Per-thread default region attributes (`rsetdefaultattr`, Remote Regions paper §5.4).
//!
//! A thread sets a default with `setxattr` on the mount root, named
//! `user.regions.thread.<attr>` (`persistent`, `multihosted`, `fixvaddr`,
//! `onewriter`, `hostalloc`); an empty value clears it, and so does
//! `removexattr`. `getxattr` of the same name reads the calling thread's
//! value back (`ENODATA` when unset). Regions that thread then creates
//! through this mount get the defaults on top of those of the directory they
//! are created in.
//!
//! The FUSE request carries the calling *thread's* id, which keys the table.
//! An entry also records the thread's start time (`/proc/TID/stat` field 22),
//! so a thread id reused after its thread exited does not inherit the dead
//! thread's defaults: entries are dropped when their thread is gone, checked
//! at use and swept when the table grows.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;

use regions::ROOT_INO;
use regions_proto::v1;

use crate::error::{FsError, FsResult};

/// Prefix of the per-thread default attribute names.
pub const THREAD_XATTR_PREFIX: &str = "user.regions.thread.";

/// Entries beyond which dead threads are swept at the next set.
const SWEEP_AT: usize = 1024;
/// Most threads with defaults at once.
const MAX_ENTRIES: usize = 65536;

struct Entry {
    /// Start time of the thread (clock ticks since boot).
    start: u64,
    attrs: v1::RegionAttrOverrides,
}

/// The per-thread defaults of one mount.
#[derive(Default)]
pub struct ThreadDefaults {
    entries: Mutex<HashMap<u32, Entry>>,
}

/// Start time of thread `tid`, None if it does not exist.
fn thread_start(tid: u32) -> Option<u64> {
    regions_proto::pid_watch::start_time(tid)
}

fn is_empty(a: &v1::RegionAttrOverrides) -> bool {
    a.persistent.is_none()
        && a.multihosted.is_none()
        && a.fixvaddr.is_none()
        && a.onewriter.is_none()
        && a.hostalloc.is_none()
}

fn parse_bool(attr: &str, value: &[u8]) -> FsResult<bool> {
    match std::str::from_utf8(value).map(str::trim) {
        Ok("1" | "true" | "yes" | "on") => Ok(true),
        Ok("0" | "false" | "no" | "off") => Ok(false),
        _ => Err(FsError::Invalid(format!(
            "{THREAD_XATTR_PREFIX}{attr} must be 0 or 1, not {:?}",
            String::from_utf8_lossy(value)
        ))),
    }
}

fn parse_hostalloc(value: &[u8]) -> FsResult<String> {
    let text = std::str::from_utf8(value)
        .map_err(|_| FsError::Invalid("hostalloc must be comma-separated host ids".into()))?;
    let mut ids = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let id: u32 = part.parse().ok().filter(|id| *id > 0).ok_or_else(|| {
            FsError::Invalid(format!(
                "{THREAD_XATTR_PREFIX}hostalloc takes comma-separated host ids (positive integers), not {part:?}"
            ))
        })?;
        ids.push(id.to_string());
    }
    Ok(ids.join(","))
}

fn bool_text(b: bool) -> Vec<u8> {
    if b { b"1".to_vec() } else { b"0".to_vec() }
}

impl ThreadDefaults {
    /// An empty table.
    pub fn new() -> ThreadDefaults {
        ThreadDefaults::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The attribute a name refers to, if it is a thread default on the root.
    fn attr_name(ino: u64, name: &OsStr) -> Option<&str> {
        if ino != ROOT_INO {
            return None;
        }
        std::str::from_utf8(name.as_bytes())
            .ok()?
            .strip_prefix(THREAD_XATTR_PREFIX)
    }

    /// setxattr: handles `user.regions.thread.*` on the root for thread
    /// `tid` (None for any other name). An empty value clears the default.
    pub fn setxattr(&self, tid: u32, ino: u64, name: &OsStr, value: &[u8]) -> Option<FsResult<()>> {
        let attr = Self::attr_name(ino, name)?;
        Some(self.set(tid, attr, value))
    }

    /// removexattr: clears a thread default (None for any other name).
    pub fn removexattr(&self, tid: u32, ino: u64, name: &OsStr) -> Option<FsResult<()>> {
        let attr = Self::attr_name(ino, name)?;
        Some(self.set(tid, attr, b""))
    }

    /// getxattr: the thread's default (None for any other name).
    pub fn getxattr(&self, tid: u32, ino: u64, name: &OsStr) -> Option<FsResult<Vec<u8>>> {
        let attr = Self::attr_name(ino, name)?;
        let a = self.overrides(tid).unwrap_or_default();
        let v = match attr {
            "persistent" => a.persistent.map(bool_text),
            "multihosted" => a.multihosted.map(bool_text),
            "fixvaddr" => a.fixvaddr.map(bool_text),
            "onewriter" => a.onewriter.map(bool_text),
            "hostalloc" => a.hostalloc.map(String::into_bytes),
            other => return Some(Err(Self::unknown(other))),
        };
        Some(v.ok_or_else(|| {
            FsError::NoData(format!(
                "this thread has no default {THREAD_XATTR_PREFIX}{attr}"
            ))
        }))
    }

    fn unknown(attr: &str) -> FsError {
        FsError::Invalid(format!(
            "unknown thread default {THREAD_XATTR_PREFIX}{attr}: use persistent, multihosted, \
             fixvaddr, onewriter or hostalloc"
        ))
    }

    fn set(&self, tid: u32, attr: &str, value: &[u8]) -> FsResult<()> {
        let clear = value.is_empty();
        let mut parsed = v1::RegionAttrOverrides::default();
        match attr {
            "persistent" if !clear => parsed.persistent = Some(parse_bool(attr, value)?),
            "multihosted" if !clear => parsed.multihosted = Some(parse_bool(attr, value)?),
            "fixvaddr" if !clear => parsed.fixvaddr = Some(parse_bool(attr, value)?),
            "onewriter" if !clear => parsed.onewriter = Some(parse_bool(attr, value)?),
            "hostalloc" if !clear => parsed.hostalloc = Some(parse_hostalloc(value)?),
            "persistent" | "multihosted" | "fixvaddr" | "onewriter" | "hostalloc" => {}
            other => return Err(Self::unknown(other)),
        }
        let start = thread_start(tid).ok_or_else(|| {
            FsError::Invalid(format!("thread {tid} is not visible to regionfs in /proc"))
        })?;
        let mut entries = self.lock();
        if entries.len() >= SWEEP_AT {
            entries.retain(|t, e| thread_start(*t) == Some(e.start));
        }
        let fresh = entries.get(&tid).is_none_or(|e| e.start != start);
        if fresh {
            if clear {
                entries.remove(&tid);
                return Ok(());
            }
            if entries.len() >= MAX_ENTRIES {
                return Err(FsError::Full(format!(
                    "{MAX_ENTRIES} threads hold default attributes already"
                )));
            }
            entries.insert(
                tid,
                Entry {
                    start,
                    attrs: v1::RegionAttrOverrides::default(),
                },
            );
        }
        let Some(e) = entries.get_mut(&tid) else {
            return Ok(());
        };
        let a = &mut e.attrs;
        match attr {
            "persistent" => a.persistent = parsed.persistent,
            "multihosted" => a.multihosted = parsed.multihosted,
            "fixvaddr" => a.fixvaddr = parsed.fixvaddr,
            "onewriter" => a.onewriter = parsed.onewriter,
            _ => a.hostalloc = parsed.hostalloc,
        }
        if is_empty(a) {
            entries.remove(&tid);
        }
        Ok(())
    }

    /// The defaults of thread `tid` for a region it creates now; None when
    /// it has none (or the thread that set them is gone).
    pub fn overrides(&self, tid: u32) -> Option<v1::RegionAttrOverrides> {
        let mut entries = self.lock();
        let e = entries.get(&tid)?;
        if thread_start(tid) != Some(e.start) {
            entries.remove(&tid);
            return None;
        }
        Some(e.attrs.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tid() -> u32 {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() as u32 }
    }

    fn os(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    #[test]
    fn set_get_clear_per_thread() {
        let d = ThreadDefaults::new();
        let me = tid();
        assert!(
            d.setxattr(me, 5, os("user.regions.thread.persistent"), b"0")
                .is_none()
        );
        assert!(
            d.setxattr(me, ROOT_INO, os("user.regions.persistent"), b"0")
                .is_none()
        );
        d.setxattr(me, ROOT_INO, os("user.regions.thread.persistent"), b"0")
            .unwrap()
            .unwrap();
        d.setxattr(me, ROOT_INO, os("user.regions.thread.hostalloc"), b" 2, 3")
            .unwrap()
            .unwrap();
        let a = d.overrides(me).unwrap();
        assert_eq!(a.persistent, Some(false));
        assert_eq!(a.hostalloc.as_deref(), Some("2,3"));
        assert_eq!(
            d.getxattr(me, ROOT_INO, os("user.regions.thread.persistent"))
                .unwrap()
                .unwrap(),
            b"0"
        );
        // Another thread has none.
        let d = std::sync::Arc::new(d);
        let d2 = d.clone();
        let other = std::thread::spawn(move || d2.overrides(tid()))
            .join()
            .unwrap();
        assert!(other.is_none());
        // Bad values are refused.
        assert!(matches!(
            d.setxattr(me, ROOT_INO, os("user.regions.thread.fixvaddr"), b"maybe"),
            Some(Err(FsError::Invalid(_)))
        ));
        assert!(matches!(
            d.setxattr(me, ROOT_INO, os("user.regions.thread.colour"), b"1"),
            Some(Err(FsError::Invalid(_)))
        ));
        // Clearing both leaves nothing.
        d.setxattr(me, ROOT_INO, os("user.regions.thread.persistent"), b"")
            .unwrap()
            .unwrap();
        d.removexattr(me, ROOT_INO, os("user.regions.thread.hostalloc"))
            .unwrap()
            .unwrap();
        assert!(d.overrides(me).is_none());
    }

    #[test]
    fn a_dead_thread_loses_its_defaults() {
        let d = std::sync::Arc::new(ThreadDefaults::new());
        let d2 = d.clone();
        let t = std::thread::spawn(move || {
            let me = tid();
            d2.setxattr(me, ROOT_INO, os("user.regions.thread.onewriter"), b"1")
                .unwrap()
                .unwrap();
            assert!(d2.overrides(me).is_some());
            me
        })
        .join()
        .unwrap();
        // The thread has exited (joined): its entry no longer applies.
        assert!(d.overrides(t).is_none());
        assert!(d.lock().is_empty());
    }

    #[test]
    fn start_time_parses() {
        assert!(thread_start(tid()).is_some());
        assert!(thread_start(u32::MAX - 1).is_none());
    }
}
