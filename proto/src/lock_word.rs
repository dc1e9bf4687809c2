//! The lock word format (Remote Regions paper §5.9; docs/SEMANTICS.md, "Barriers, mutexes and
//! doorbells"): what the 8-byte words of mutexes and barriers in the hidden lock region hold.
//! Clients change them with transport atomics, the manager when it queues callers and hands a
//! mutex on; both read them with these definitions.
//!
//! A mutex's word is 0 when free, else the holding thread's tag ([`tag`]), with [`WAITERS`]
//! set while callers queue at the manager. A barrier's word counts arrivals ([`COUNT_MASK`]),
//! with [`SLEEPERS`] set while callers sleep at the manager. [`DELETED`] marks the word of a
//! deleted object.

/// Set in a lock word while callers queue at the manager.
pub const WAITERS: u64 = 1 << 63;
/// Set in a barrier's arrival word while callers sleep at the manager.
pub const SLEEPERS: u64 = 1 << 63;
/// Set in the word of a deleted barrier or mutex (its slot is never used again).
pub const DELETED: u64 = 1 << 62;
/// The arrival count bits of a barrier's word.
pub const COUNT_MASK: u64 = DELETED - 1;
/// Bits of a lock word tag: host id, pid, tid (low to high: tid, pid, host).
pub const TAG_HOST_BITS: u32 = 16;
pub const TAG_PID_BITS: u32 = 22;
pub const TAG_TID_BITS: u32 = 22;

/// The lock word tag of thread `tid` of process `pid` on host `host` (`tid` 0: the process
/// as a whole), or `None` when a part does not fit its bits (host ids below 65536; pids and
/// tids below 2^22, which Linux guarantees: `kernel.pid_max` is at most 4194304).
pub fn tag(host: u32, pid: u32, tid: u32) -> Option<u64> {
    if host >> TAG_HOST_BITS != 0 || pid >> TAG_PID_BITS != 0 || tid >> TAG_TID_BITS != 0 {
        return None;
    }
    Some(
        (u64::from(host) << (TAG_PID_BITS + TAG_TID_BITS))
            | (u64::from(pid) << TAG_TID_BITS)
            | u64::from(tid),
    )
}

/// Host id of a tag (flag bits ignored).
pub fn tag_host(tag: u64) -> u32 {
    ((tag >> (TAG_PID_BITS + TAG_TID_BITS)) & ((1 << TAG_HOST_BITS) - 1)) as u32
}

/// Pid of a tag.
pub fn tag_pid(tag: u64) -> u32 {
    ((tag >> TAG_TID_BITS) & ((1 << TAG_PID_BITS) - 1)) as u32
}

/// Tid of a tag (0: the process as a whole).
pub fn tag_tid(tag: u64) -> u32 {
    (tag & ((1 << TAG_TID_BITS) - 1)) as u32
}

/// Why an id does not fit a tag, for errors.
pub fn tag_overflow_hint(host: u32, pid: u32, tid: u32) -> String {
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    format!(
        "host {host}, pid {pid}, tid {tid} do not fit a lock word tag (host ids below {}, \
         pids and tids below {}; kernel.pid_max is {pid_max}): use smaller host ids or lower \
         kernel.pid_max to at most {}",
        1u64 << TAG_HOST_BITS,
        1u64 << TAG_PID_BITS,
        1u64 << TAG_PID_BITS
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_pack_host_pid_and_tid() {
        let t = tag(65535, (1 << 22) - 1, 12345).unwrap();
        assert_eq!(tag_host(t), 65535);
        assert_eq!(tag_pid(t), (1 << 22) - 1);
        assert_eq!(tag_tid(t), 12345);
        assert_eq!(t & (WAITERS | DELETED), 0, "flag bits stay free");
        assert_eq!(tag_host(t | WAITERS), 65535);
        assert!(tag(1 << 16, 1, 1).is_none());
        assert!(tag(1, 1 << 22, 1).is_none());
        assert!(tag(1, 1, 1 << 22).is_none());
        assert_ne!(tag(1, 2, 3), tag(1, 2, 4), "threads differ");
        assert!(tag_overflow_hint(1, 1 << 22, 0).contains("pid_max"));
    }
}
