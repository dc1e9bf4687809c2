//! Unix-socket plumbing of the host agent: who is calling (`SO_PEERCRED` and the caller's
//! supplementary groups) and passing file descriptors (`SCM_RIGHTS`).

use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, getsockopt, recvmsg, sendmsg,
    sockopt::PeerCredentials,
};

/// The identity of the process at the other end of a Unix socket, as the kernel saw it when
/// the connection was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id (in the daemon's pid namespace).
    pub pid: u32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
    /// Supplementary groups (from `/proc/PID/status`; empty when the process is gone).
    pub groups: Vec<u32>,
    /// When the process started ([`regions_proto::pid_watch::start_time`]; 0 when it is
    /// gone): with the pid, it names the process even after the pid is reused.
    pub start_time: u64,
}

/// Identifies the peer of `stream` with `SO_PEERCRED`.
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    let cred = getsockopt(stream, PeerCredentials).map_err(io::Error::from)?;
    let pid = u32::try_from(cred.pid()).unwrap_or(0);
    Ok(PeerCred {
        pid,
        uid: cred.uid(),
        gid: cred.gid(),
        groups: supplementary_groups(pid),
        start_time: regions_proto::pid_watch::start_time(pid).unwrap_or(0),
    })
}

/// The supplementary groups of process `pid` (the `Groups:` line of `/proc/PID/status`).
pub fn supplementary_groups(pid: u32) -> Vec<u32> {
    if pid == 0 {
        return Vec::new();
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Vec::new();
    };
    parse_groups(&status)
}

/// Parses the `Groups:` line of a `/proc/PID/status` text.
fn parse_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|rest| {
            rest.split_whitespace()
                .filter_map(|g| g.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Writes all of `bytes` to `stream`, the descriptor `fd` (if any) riding on the first byte.
pub fn send_with_fd(
    stream: &UnixStream,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let Some(fd) = fd else {
        return (&*stream).write_all(bytes);
    };
    if bytes.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a passed descriptor needs at least one byte to ride on",
        ));
    }
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let sent = loop {
        match sendmsg::<UnixAddr>(
            stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    (&*stream).write_all(&bytes[sent..])
}

/// Reads at least one byte into `buf`, collecting a descriptor passed with it. Returns the
/// bytes read (0 at end of stream) and the descriptor, if one came.
pub fn recv_with_fd(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = loop {
        match recvmsg::<UnixAddr>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut received = Vec::new();
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            received.extend(fds);
        }
    }
    let n = msg.bytes;
    // SAFETY: the kernel just installed these descriptors in this process for us (SCM_RIGHTS);
    // nothing else owns them, so each is wrapped exactly once.
    let mut owned: Vec<OwnedFd> = received
        .into_iter()
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    // One descriptor is expected; extra ones are closed when `owned` drops.
    let first = if owned.is_empty() {
        None
    } else {
        Some(owned.swap_remove(0))
    };
    Ok((n, first))
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn peer_cred_is_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = peer_cred(&a).unwrap();
        assert_eq!(cred.pid, std::process::id());
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        assert_eq!((cred.uid, cred.gid), (uid, gid));
    }

    #[test]
    fn groups_line() {
        let status = "Name:\tx\nGid:\t0\t0\t0\t0\nGroups:\t4 24 27 \nNSpid:\t1\n";
        assert_eq!(parse_groups(status), vec![4, 24, 27]);
        assert!(parse_groups("Groups:\n").is_empty());
        assert!(parse_groups("").is_empty());
        assert!(supplementary_groups(0).is_empty());
        let _ = supplementary_groups(std::process::id());
    }

    #[test]
    fn fd_rides_on_the_first_byte() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut file, b"passed").unwrap();
        send_with_fd(&a, b"xyz", Some(file.as_fd())).unwrap();
        send_with_fd(&a, b"w", None).unwrap();
        assert!(send_with_fd(&a, b"", Some(file.as_fd())).is_err());
        let mut buf = [0u8; 2];
        let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!((n, &buf), (2, b"xy"));
        let mut got = File::from(fd.unwrap());
        got.seek(SeekFrom::Start(0)).unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "passed");
        let mut rest = Vec::new();
        while rest.len() < 2 {
            let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
            assert!(n > 0 && fd.is_none());
            rest.extend_from_slice(&buf[..n]);
        }
        assert_eq!(rest, b"zw");
        drop(a);
        assert_eq!(recv_with_fd(&b, &mut buf).unwrap().0, 0);
    }
}
