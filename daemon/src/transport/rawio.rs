//! Socket I/O to and from raw memory (pool windows): `sendmsg`/`recvmsg` with iovecs that
//! point into mapped pool memory, so READ replies and WRITE payloads move between the socket
//! and the pool without an intermediate copy.
//!
//! Every call is non-blocking (`MSG_DONTWAIT`): the transport holds the chunk table's locks
//! while calling these, and must never block on a slow peer while holding them. When the socket
//! is not ready it drops the locks and waits with [`wait_ready`].

use std::io;
use std::os::fd::{AsFd, RawFd};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// Most iovecs in one system call (`IOV_MAX` on Linux).
const IOV_MAX: usize = 1024;

/// A span of memory given to the kernel: a buffer of this process or pinned pool memory.
#[derive(Clone, Copy, Debug)]
pub struct RawSpan {
    /// First byte.
    pub ptr: *mut u8,
    /// Bytes.
    pub len: usize,
}

impl RawSpan {
    /// A span over a byte slice (sends only read from it).
    pub fn of(bytes: &[u8]) -> RawSpan {
        RawSpan {
            ptr: bytes.as_ptr().cast_mut(),
            len: bytes.len(),
        }
    }
}

/// Total bytes of `spans`.
pub fn total_len(spans: &[RawSpan]) -> usize {
    spans.iter().map(|s| s.len).sum()
}

/// iovecs for `spans` after skipping their first `skip` bytes, at most [`IOV_MAX`].
fn iovecs(spans: &[RawSpan], mut skip: usize) -> Vec<libc::iovec> {
    let mut out = Vec::with_capacity(spans.len().min(IOV_MAX));
    for s in spans {
        if out.len() == IOV_MAX {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        out.push(libc::iovec {
            // SAFETY (pointer arithmetic): `skip < s.len`, so this stays inside the span.
            iov_base: s.ptr.wrapping_add(skip).cast(),
            iov_len: s.len - skip,
        });
        skip = 0;
    }
    out
}

/// Sends what the socket accepts now of `spans` after their first `skip` bytes. Returns the
/// bytes sent; `WouldBlock` when the socket buffer is full.
///
/// # Safety
///
/// Every span must be readable memory for the duration of the call (slices of this process,
/// or pool chunks whose table locks the caller holds).
pub unsafe fn send_nonblocking(fd: RawFd, spans: &[RawSpan], skip: usize) -> io::Result<usize> {
    let mut iov = iovecs(spans, skip);
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: an all-zero msghdr is a valid "no address, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    loop {
        // SAFETY: `msg` points at `iov`, alive for the call; each iovec is readable memory by
        // the caller's contract; the kernel reports unreadable memory as EFAULT, never a signal.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Receives what the socket holds now into `spans` after their first `skip` bytes. Returns the
/// bytes received (0: the peer closed); `WouldBlock` when nothing is there.
///
/// # Safety
///
/// Every span must be writable memory for the duration of the call that nothing else reads or
/// writes through a Rust reference (pool chunks whose table locks the caller holds).
pub unsafe fn recv_nonblocking(fd: RawFd, spans: &[RawSpan], skip: usize) -> io::Result<usize> {
    let mut iov = iovecs(spans, skip);
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: an all-zero msghdr is a valid "no address, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    loop {
        // SAFETY: `msg` points at `iov`, alive for the call; each iovec is writable memory by
        // the caller's contract.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Which readiness to wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ready {
    /// Bytes to read.
    Read,
    /// Room to write.
    Write,
}

/// Waits until `fd` is ready or `timeout` passes (`TimedOut`).
pub fn wait_ready(fd: impl AsFd, ready: Ready, timeout: Duration) -> io::Result<()> {
    let events = match ready {
        Ready::Read => PollFlags::POLLIN,
        Ready::Write => PollFlags::POLLOUT,
    };
    let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    loop {
        let mut fds = [PollFd::new(fd.as_fd(), events)];
        match poll(&mut fds, timeout) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the peer did not become ready ({ready:?}) in time"),
                ));
            }
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn iovecs_skip_and_cap() {
        let a = [1u8; 10];
        let b = [2u8; 5];
        let spans = [RawSpan::of(&a), RawSpan::of(&b)];
        assert_eq!(total_len(&spans), 15);
        let iov = iovecs(&spans, 0);
        assert_eq!((iov.len(), iov[0].iov_len, iov[1].iov_len), (2, 10, 5));
        let iov = iovecs(&spans, 12);
        assert_eq!((iov.len(), iov[0].iov_len), (1, 3));
        assert!(iovecs(&spans, 15).is_empty());
        let many = vec![RawSpan::of(&a); 3000];
        assert_eq!(iovecs(&many, 0).len(), IOV_MAX);
    }

    #[test]
    fn send_and_recv_raw_spans() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let head = *b"head";
        let body = vec![9u8; 100];
        let spans = [RawSpan::of(&head), RawSpan::of(&body)];
        // SAFETY: both spans are live local buffers.
        let n = unsafe { send_nonblocking(a.as_raw_fd(), &spans, 2) }.unwrap();
        assert_eq!(n, 102);
        let mut got = vec![0u8; 102];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got[..2], b"ad");
        assert!(got[2..].iter().all(|x| *x == 9));

        let mut x = [0u8; 3];
        let mut y = [0u8; 3];
        let dst = [
            RawSpan {
                ptr: x.as_mut_ptr(),
                len: 3,
            },
            RawSpan {
                ptr: y.as_mut_ptr(),
                len: 3,
            },
        ];
        // SAFETY: both spans are live local buffers not otherwise borrowed during the call.
        let err = unsafe { recv_nonblocking(a.as_raw_fd(), &dst, 0) }.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        b.write_all(b"abcdef").unwrap();
        wait_ready(&a, Ready::Read, Duration::from_secs(5)).unwrap();
        // SAFETY: as above.
        let n = unsafe { recv_nonblocking(a.as_raw_fd(), &dst, 1) }.unwrap();
        assert_eq!(n, 5);
        assert_eq!((&x, &y), (&[0, b'a', b'b'], b"cde"));
        let timeout = wait_ready(&b, Ready::Read, Duration::from_millis(10)).unwrap_err();
        assert_eq!(timeout.kind(), io::ErrorKind::TimedOut);
    }
}
