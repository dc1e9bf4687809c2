//! Segments: one sparse memfd per region on this host, whose file offsets are region offsets
//! (docs/ARCHITECTURE.md, "daemon"). Pool windows map chunks of segments; the host agent hands
//! segment fds to local processes.
//!
//! A segment only grows (it is sealed against shrinking, so no process holding its fd can make
//! the daemon's mappings fault); freed chunks are returned to the kernel by punching holes.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::MFdFlags;

use super::memfd;

use crate::error::{DaemonError, Result};

/// Largest size of a segment: file offsets are `off_t`.
const MAX_SEGMENT: u64 = i64::MAX as u64;

/// A region's memory on this host.
#[derive(Debug)]
pub struct Segment {
    ino: u64,
    fd: OwnedFd,
    /// Current file size (only [`Segment::grow_to`] changes it).
    size: AtomicU64,
}

impl Segment {
    /// Creates an empty segment for region `ino`.
    ///
    /// The memfd is mode 0600 (only the daemon's user may reopen it through
    /// `/proc/<pid>/fd`, so a reader handed a read-only descriptor cannot turn
    /// it into a writable one) and sealed against shrinking and against any
    /// further seal (no process holding a descriptor can shrink it under the
    /// daemon's mappings, forbid future writes or freeze its size).
    pub fn create(ino: u64) -> Result<Segment> {
        let fd = memfd::create(
            &format!("regions-segment-{ino}"),
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
            &format!("memory of region {ino}"),
        )?;
        nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o600)).map_err(
            |e| DaemonError::sys(format!("chmod 0600 of the segment of region {ino}"), e),
        )?;
        fcntl(
            &fd,
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL),
        )
        .map_err(|e| DaemonError::sys(format!("sealing the segment of region {ino}"), e))?;
        Ok(Segment {
            ino,
            fd,
            size: AtomicU64::new(0),
        })
    }

    /// The region this segment holds.
    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// Bytes the memfd spans.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Grows the memfd to at least `size` bytes (holes read as zeros and use no memory).
    ///
    /// A local writer holding the descriptor can grow the file itself (the kernel has no seal
    /// that stops that and still lets the daemon grow it); the file is then already long
    /// enough, and shrinking it back is what the seal forbids, so the daemon only records it.
    pub fn grow_to(&self, size: u64) -> Result<()> {
        if size <= self.size() {
            return Ok(());
        }
        if size > MAX_SEGMENT {
            return Err(DaemonError::Invalid(format!(
                "segment size {size} of region {} is too large",
                self.ino
            )));
        }
        if self.file_size()? >= size {
            self.size.store(size, Ordering::Release);
            return Ok(());
        }
        let len = i64::try_from(size)
            .ok()
            .filter(|s| (*s as u64) <= MAX_SEGMENT)
            .ok_or_else(|| {
                DaemonError::Invalid(format!(
                    "segment size {size} of region {} is too large",
                    self.ino
                ))
            })?;
        nix::unistd::ftruncate(&self.fd, len).map_err(|e| {
            DaemonError::sys(
                format!("growing the segment of region {} to {size} bytes", self.ino),
                e,
            )
        })?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// Frees the pages of `[offset, offset + len)`: they read as zeros afterwards and their
    /// memory goes back to the kernel. The size does not change.
    pub fn punch(&self, offset: u64, len: u64) -> Result<()> {
        memfd::punch(
            &self.fd,
            offset,
            len,
            &format!("the segment of region {}", self.ino),
        )
    }

    /// The memfd's length as the kernel sees it (at least [`Segment::size`]).
    fn file_size(&self) -> Result<u64> {
        let st = nix::sys::stat::fstat(&self.fd).map_err(|e| {
            DaemonError::sys(format!("fstat of the segment of region {}", self.ino), e)
        })?;
        Ok(u64::try_from(st.st_size).unwrap_or(0))
    }

    /// Bytes of memory the memfd holds (pages actually allocated).
    pub fn allocated_bytes(&self) -> u64 {
        memfd::allocated_bytes(&self.fd, &format!("the segment of region {}", self.ino))
    }

    /// A new descriptor of the memfd sharing the daemon's open file (tests and diagnostics).
    pub fn dup(&self) -> Result<OwnedFd> {
        self.fd
            .try_clone()
            .map_err(|e| DaemonError::sys(format!("dup of the segment of region {}", self.ino), e))
    }

    /// A read-only descriptor of the memfd (a fresh open through `/proc/self/fd`), for callers
    /// allowed to read only: writing, mapping it writable, `fallocate`, `ftruncate` and seals
    /// all fail on it, and the file's mode (0600) keeps them from reopening it writable.
    pub fn reopen_read_only(&self) -> Result<OwnedFd> {
        self.reopen(false)
    }

    /// A writable descriptor of the memfd with an open file of its own, for callers allowed to
    /// write: file status flags they set (`O_APPEND`, `O_NONBLOCK`) do not reach the daemon's.
    pub fn reopen_read_write(&self) -> Result<OwnedFd> {
        self.reopen(true)
    }

    fn reopen(&self, write: bool) -> Result<OwnedFd> {
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| {
                DaemonError::sys(
                    format!(
                        "reopening the segment of region {} {} ({path})",
                        self.ino,
                        if write { "read-write" } else { "read-only" }
                    ),
                    e,
                )
            })?;
        Ok(OwnedFd::from(file))
    }

    /// Reads bytes at `offset` of the memfd (tests and diagnostics; the data path uses the
    /// pool windows).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let file = File::from(self.dup()?);
        file.read_exact_at(buf, offset)
            .map_err(|e| DaemonError::sys(format!("reading the segment of region {}", self.ino), e))
    }
}

impl AsFd for Segment {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    const CHUNK: u64 = 128 << 10;

    #[test]
    fn grow_write_punch_releases_pages() {
        let seg = Segment::create(9).unwrap();
        assert_eq!((seg.ino(), seg.size()), (9, 0));
        seg.grow_to(4 * CHUNK).unwrap();
        seg.grow_to(CHUNK).unwrap();
        assert_eq!(seg.size(), 4 * CHUNK, "segments never shrink");
        assert_eq!(seg.allocated_bytes(), 0, "a grown memfd is sparse");
        let file = File::from(seg.dup().unwrap());
        file.write_all_at(&vec![7u8; 2 * CHUNK as usize], CHUNK)
            .unwrap();
        assert_eq!(seg.allocated_bytes(), 2 * CHUNK);
        seg.punch(CHUNK, CHUNK).unwrap();
        assert_eq!(
            seg.allocated_bytes(),
            CHUNK,
            "punched pages return to the kernel"
        );
        let mut b = [1u8; 4];
        seg.read_at(CHUNK, &mut b).unwrap();
        assert_eq!(b, [0; 4], "punched bytes read as zeros");
        seg.read_at(2 * CHUNK, &mut b).unwrap();
        assert_eq!(b, [7; 4]);
        assert_eq!(seg.size(), 4 * CHUNK, "punching keeps the size");
        assert!(seg.punch(u64::MAX, 1).is_err());
        seg.punch(0, 0).unwrap();
    }

    #[test]
    fn sealed_against_shrinking() {
        let seg = Segment::create(1).unwrap();
        seg.grow_to(CHUNK).unwrap();
        let fd = seg.dup().unwrap();
        assert!(
            nix::unistd::ftruncate(&fd, 0).is_err(),
            "F_SEAL_SHRINK holds"
        );
        nix::unistd::ftruncate(&fd, 2 * CHUNK as i64).unwrap();
    }

    #[test]
    fn no_descriptor_can_seal_and_only_the_owner_can_reopen() {
        let seg = Segment::create(4).unwrap();
        seg.grow_to(CHUNK).unwrap();
        let st = nix::sys::stat::fstat(&seg).unwrap();
        assert_eq!(
            st.st_mode & 0o777,
            0o600,
            "the memfd is private to the daemon's user"
        );
        for fd in [
            seg.reopen_read_write().unwrap(),
            seg.reopen_read_only().unwrap(),
        ] {
            for seal in [
                SealFlag::F_SEAL_GROW,
                SealFlag::F_SEAL_WRITE,
                SealFlag::F_SEAL_FUTURE_WRITE,
            ] {
                assert!(
                    fcntl(&fd, FcntlArg::F_ADD_SEALS(seal)).is_err(),
                    "{seal:?} refused"
                );
            }
        }
        let rw = seg.reopen_read_write().unwrap();
        let flags = fcntl(&rw, FcntlArg::F_GETFL).unwrap();
        assert_eq!(flags & libc::O_ACCMODE, libc::O_RDWR);
        fcntl(&rw, FcntlArg::F_SETFL(nix::fcntl::OFlag::O_APPEND)).unwrap();
        let own = fcntl(&seg, FcntlArg::F_GETFL).unwrap();
        assert_eq!(
            own & libc::O_APPEND,
            0,
            "a caller's flags stay on its own open file"
        );
    }

    #[test]
    fn a_segment_grown_by_a_writer_still_grows_for_the_daemon() {
        let seg = Segment::create(5).unwrap();
        seg.grow_to(CHUNK).unwrap();
        let rw = seg.reopen_read_write().unwrap();
        nix::unistd::ftruncate(&rw, 8 * CHUNK as i64).unwrap();
        seg.grow_to(2 * CHUNK).unwrap();
        assert_eq!(seg.size(), 2 * CHUNK);
        seg.grow_to(16 * CHUNK).unwrap();
        assert_eq!(seg.size(), 16 * CHUNK);
    }

    #[test]
    fn read_only_reopen_refuses_writes() {
        let seg = Segment::create(3).unwrap();
        seg.grow_to(CHUNK).unwrap();
        File::from(seg.dup().unwrap())
            .write_all_at(b"abc", 0)
            .unwrap();
        let ro = File::from(seg.reopen_read_only().unwrap());
        let mut b = [0u8; 3];
        ro.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"abc");
        assert!(ro.write_all_at(b"x", 0).is_err());
        let flags = fcntl(&ro, FcntlArg::F_GETFL).unwrap();
        assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY);
    }
}
