//! The open-file limit (`RLIMIT_NOFILE`) of the daemon and the mount: both raise the soft limit
//! to the hard one at start (a daemon holds one descriptor per region segment on its host, a
//! mount one per open local file), and the daemon keeps a reserve of descriptors for
//! connections when it decides whether it can hold another region.

use std::io;

/// The soft and hard open-file limits of this process.
pub fn open_file_limits() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives through the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// The soft open-file limit (the one `open` and `accept` run into); `u64::MAX` when unlimited
/// or unknown.
pub fn open_file_limit() -> u64 {
    open_file_limits().map_or(u64::MAX, |(soft, _)| soft)
}

/// Raises the soft open-file limit to the hard one; returns (before, after).
pub fn raise_open_file_limit() -> io::Result<(u64, u64)> {
    let (soft, hard) = open_file_limits()?;
    if soft >= hard {
        return Ok((soft, soft));
    }
    let lim = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads one rlimit from `lim`, which lives through the call; it changes
    // only this process's limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((soft, hard))
}

/// Raises the limit (see [`raise_open_file_limit`]) and says so in the log: `what` names the
/// component and what one descriptor stands for in it.
pub fn raise_and_report(what: &str) {
    match raise_open_file_limit() {
        Ok((before, after)) if after > before => tracing::info!(
            before,
            after,
            "raised the open-file limit (RLIMIT_NOFILE) to its hard limit: {what}"
        ),
        Ok((_, limit)) => tracing::info!(
            limit,
            "open-file limit (RLIMIT_NOFILE): {what}; raise the hard limit (LimitNOFILE=, \
             ulimit -Hn) for more"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open-file limit"),
    }
}

/// Descriptors the daemon keeps free for connections (host agent, transport, manager) when
/// the open-file limit is `limit`: a sixteenth of it, at least 64.
pub fn reserve(limit: u64) -> u64 {
    (limit / 16).max(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_a_sixteenth_and_at_least_64() {
        assert_eq!(reserve(256), 64);
        assert_eq!(reserve(1 << 20), 1 << 16);
    }

    #[test]
    fn raising_reaches_the_hard_limit() {
        // Tests share the process: raising is what every daemon does anyway.
        let (_, after) = raise_open_file_limit().unwrap();
        let (soft, hard) = open_file_limits().unwrap();
        assert_eq!(soft, hard);
        assert_eq!(after, soft);
        assert_eq!(open_file_limit(), soft);
    }
}
