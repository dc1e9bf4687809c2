//! The local transport: a region's segment memfd, received from the host
//! agent, mapped into this process. Reads and writes are memory copies;
//! atomics are CPU atomics on the shared pages.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use regions_proto::word_wait;

use super::{Span, Transport, TransportStats};
use crate::error::{RegionsError, Result};

/// Reads of at least this many bytes use `pread(2)` on the memfd rather than the mapping.
const PREAD_AT_LEAST: usize = 64 * 1024;
/// Writes of at least this many bytes use `pwrite(2)` on the memfd rather than the mapping
/// (a write fault costs as much as a system call per page of a mapping not written yet).
const PWRITE_AT_LEAST: usize = 16 * 1024;

/// A segment memfd mapped `MAP_SHARED`; region offset = offset in the map.
///
/// The mapping is plain shared memory owned by this value (unmapped when it
/// drops); concurrent access through `&self` only copies bytes or uses
/// atomics, like any other shared-memory window (callers coordinate their own
/// data races, exactly as with a `MAP_SHARED` file).
pub struct LocalSegment {
    map: memmap2::MmapRaw,
    len: usize,
    writable: bool,
    /// Whether atomics may be CPU instructions on the mapping (not when the daemon applies
    /// every atomic through an RDMA device: see [`LocalSegment::with_cpu_atomics`]).
    cpu_atomics: bool,
    _fd: OwnedFd,
    stats: Arc<TransportStats>,
}

impl LocalSegment {
    /// Maps `len` bytes of `fd` (read-only unless `writable`).
    pub fn map(
        fd: OwnedFd,
        len: u64,
        writable: bool,
        stats: Arc<TransportStats>,
    ) -> Result<LocalSegment> {
        let len = usize::try_from(len)
            .map_err(|_| RegionsError::Invalid(format!("segment of {len} bytes")))?;
        if len == 0 {
            return Err(RegionsError::Invalid("cannot map an empty segment".into()));
        }
        // A shared mapping of `len` bytes of the memfd (PROT_READ, plus
        // PROT_WRITE when writable) at an address the kernel picks.
        let mut options = memmap2::MmapOptions::new();
        options.len(len);
        let map = if writable {
            options.map_raw(&fd)
        } else {
            options.map_raw_read_only(&fd)
        }
        .map_err(|e| RegionsError::io("cannot map the region's segment", e))?;
        Ok(LocalSegment {
            map,
            len,
            writable,
            cpu_atomics: true,
            _fd: fd,
            stats,
        })
    }

    /// This segment, applying atomics with CPU instructions only if `allowed`. A daemon whose
    /// RDMA device's atomics exclude only one another applies every atomic through the
    /// device; a CPU atomic here could interleave with one and lose an update, so atomics
    /// then fail here and callers go to the daemon.
    pub fn with_cpu_atomics(mut self, allowed: bool) -> LocalSegment {
        self.cpu_atomics = allowed;
        self
    }

    /// Whether atomics may be applied here (see [`LocalSegment::with_cpu_atomics`]).
    pub fn cpu_atomics(&self) -> bool {
        self.cpu_atomics
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Whether `[offset, offset + len)` lies inside the mapping.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.len as u64)
    }

    fn check(&self, offset: u64, len: u64) -> Result<usize> {
        if self.covers(offset, len) {
            Ok(offset as usize)
        } else {
            Err(RegionsError::Invalid(format!(
                "range {offset}+{len} is outside the local segment of {} bytes",
                self.len
            )))
        }
    }

    /// Reads `dst.len()` bytes at `offset` with `pread(2)` on the memfd (no page of the
    /// mapping touched).
    fn pread(&self, dst: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0usize;
        while done < dst.len() {
            match nix::sys::uio::pread(&self._fd, &mut dst[done..], (offset + done as u64) as i64) {
                Ok(0) => {
                    dst[done..].fill(0);
                    break;
                }
                Ok(n) => done += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(RegionsError::io(
                        "cannot read the region's segment",
                        std::io::Error::from(e),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Writes `src` at `offset` with `pwrite(2)` on the memfd.
    fn pwrite(&self, src: &[u8], offset: u64) -> Result<()> {
        let mut done = 0usize;
        while done < src.len() {
            match nix::sys::uio::pwrite(&self._fd, &src[done..], (offset + done as u64) as i64) {
                Ok(0) => {
                    return Err(RegionsError::Invalid(format!(
                        "the region's segment took no bytes at {}",
                        offset + done as u64
                    )));
                }
                Ok(n) => done += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(RegionsError::io(
                        "cannot write the region's segment",
                        std::io::Error::from(e),
                    ));
                }
            }
        }
        Ok(())
    }

    fn word(&self, offset: u64) -> Result<&AtomicU64> {
        if !offset.is_multiple_of(8) {
            return Err(RegionsError::Invalid(format!(
                "atomic at unaligned offset {offset}"
            )));
        }
        if !self.writable {
            return Err(RegionsError::Agent {
                path: String::from("local segment"),
                errno: libc::EACCES,
                message: "segment mapped read-only".into(),
            });
        }
        let at = self.check(offset, 8)?;
        // SAFETY: in bounds (checked), 8-byte aligned (mapping is page
        // aligned and offset % 8 == 0), and the memory lives as long as self.
        Ok(unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(at).cast::<u64>()) })
    }

    /// The word at `offset` for an atomic that changes it (`EOPNOTSUPP` where the daemon
    /// applies atomics through its RDMA device).
    fn atomic_word(&self, offset: u64) -> Result<&AtomicU64> {
        if !self.cpu_atomics {
            return Err(RegionsError::Agent {
                path: String::from("local segment"),
                errno: libc::EOPNOTSUPP,
                message: "the daemon applies every atomic on this memory through its RDMA \
                          device: send atomics to the daemon, not CPU instructions on the \
                          mapping"
                    .into(),
            });
        }
        self.word(offset)
    }
}

impl Transport for LocalSegment {
    fn read(&self, spans: &[Span], dst: &mut [u8]) -> Result<()> {
        let mut at = 0usize;
        for s in spans {
            let from = self.check(s.region_offset, s.len)?;
            let n = s.len as usize;
            if n >= PREAD_AT_LEAST {
                self.pread(&mut dst[at..at + n], s.region_offset)?;
                at += n;
                continue;
            }
            // SAFETY: the source range is inside the mapping (checked), the
            // destination is a distinct caller buffer of at least `n` bytes
            // from `at` (spans sum to dst.len()).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.map.as_ptr().add(from),
                    dst[at..at + n].as_mut_ptr(),
                    n,
                );
            }
            at += n;
        }
        TransportStats::add(&self.stats.local_bytes_read, at as u64);
        metrics::counter!("regions_client_bytes_total", "op" => "read", "transport" => "local")
            .increment(at as u64);
        Ok(())
    }

    fn write(&self, spans: &[Span], src: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(RegionsError::Agent {
                path: String::from("local segment"),
                errno: libc::EACCES,
                message: "segment mapped read-only".into(),
            });
        }
        let mut at = 0usize;
        for s in spans {
            let to = self.check(s.region_offset, s.len)?;
            let n = s.len as usize;
            if n >= PWRITE_AT_LEAST {
                self.pwrite(&src[at..at + n], s.region_offset)?;
                at += n;
                continue;
            }
            // SAFETY: the destination range is inside the writable mapping
            // (checked); the source is the caller's buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src[at..at + n].as_ptr(),
                    self.map.as_mut_ptr().add(to),
                    n,
                );
            }
            at += n;
        }
        TransportStats::add(&self.stats.local_bytes_written, at as u64);
        metrics::counter!("regions_client_bytes_total", "op" => "write", "transport" => "local")
            .increment(at as u64);
        Ok(())
    }

    fn compare_and_swap(&self, at: &Span, expected: u64, new: u64) -> Result<u64> {
        let word = self.atomic_word(at.region_offset)?;
        match word.compare_exchange(expected, new, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(old) => {
                if new != old {
                    word_wait::wake(word);
                }
                Ok(old)
            }
            Err(old) => Ok(old),
        }
    }

    fn fetch_add(&self, at: &Span, addend: u64) -> Result<u64> {
        let word = self.atomic_word(at.region_offset)?;
        let old = word.fetch_add(addend, Ordering::SeqCst);
        if addend != 0 {
            word_wait::wake(word);
        }
        Ok(old)
    }

    fn wait_change(&self, at: &Span, expected: u64, timeout: Duration) -> Result<u64> {
        let word = self.word(at.region_offset)?;
        let seen = word.load(Ordering::SeqCst);
        if seen != expected || timeout.is_zero() {
            return Ok(seen);
        }
        word_wait::wait(word, expected, timeout);
        Ok(word.load(Ordering::SeqCst))
    }

    fn describe(&self) -> String {
        String::from("local")
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd};

    use super::*;

    fn memfd(len: u64) -> OwnedFd {
        // SAFETY: memfd_create with a valid C string; the fd is checked and
        // then owned by the OwnedFd.
        let fd = unsafe { libc::memfd_create(c"test-segment".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on an owned memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) }, 0);
        fd
    }

    fn span(off: u64, len: u64) -> Span {
        Span {
            ino: 0,
            region_offset: off,
            pool: 0,
            pool_offset: 0,
            len,
        }
    }

    #[test]
    fn two_mappings_of_one_memfd_share_bytes() {
        let fd = memfd(1 << 20);
        let dup = fd.try_clone().unwrap();
        let stats = Arc::new(TransportStats::default());
        let a = LocalSegment::map(fd, 1 << 20, true, stats.clone()).unwrap();
        let b = LocalSegment::map(dup, 1 << 20, false, stats.clone()).unwrap();
        a.write(&[span(4096, 5), span(100, 3)], b"helloabc")
            .unwrap();
        let mut out = [0u8; 8];
        b.read(&[span(4096, 5), span(100, 3)], &mut out).unwrap();
        assert_eq!(&out, b"helloabc");
        assert_eq!(stats.snapshot().local_bytes_read, 8);
        assert!(
            b.write(&[span(0, 1)], b"x").is_err(),
            "read-only mapping refuses writes"
        );
        assert!(
            a.read(&[span((1 << 20) - 2, 4)], &mut out[..4]).is_err(),
            "bounds checked"
        );
    }

    #[test]
    fn atomics_are_exact_under_threads() {
        let seg = Arc::new(LocalSegment::map(memfd(4096), 4096, true, Arc::default()).unwrap());
        std::thread::scope(|s| {
            for _ in 0..4 {
                let seg = Arc::clone(&seg);
                s.spawn(move || {
                    for _ in 0..10_000 {
                        seg.fetch_add(&span(8, 8), 1).unwrap();
                    }
                });
            }
        });
        assert_eq!(seg.fetch_add(&span(8, 8), 0).unwrap(), 40_000);
        assert_eq!(
            seg.compare_and_swap(&span(8, 8), 40_000, 7).unwrap(),
            40_000
        );
        assert_eq!(seg.compare_and_swap(&span(8, 8), 1, 9).unwrap(), 7);
        assert!(seg.fetch_add(&span(3, 8), 1).is_err(), "unaligned");
    }
}
