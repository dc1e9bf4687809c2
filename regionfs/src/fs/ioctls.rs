//! The ioctls of an open region file (`include/regions_ioctl.h`): clear
//! cache, prefetch, region info, mark dirty.

use super::*;

impl RegionFs {
    /// An ioctl on open file `fh` (see `include/regions_ioctl.h`).
    pub fn ioctl(&self, fh: u64, cmd: u32, input: &[u8]) -> FsResult<Vec<u8>> {
        let h = self.handle(fh)?;
        let Body::Region(r) = &h.body else {
            return Err(FsError::UnknownIoctl(cmd));
        };
        // RCLEARCACHE drops cached pages: no background fill stores across it. (RMARKDIRTY
        // needs a descriptor open for writing, whose open holds fills off until its release.)
        let _hold = match cmd {
            ioctl::RCLEARCACHE => Some(self.hold_fills(h.ino)?),
            _ => None,
        };
        match cmd {
            ioctl::RCLEARCACHE => {
                let range = ioctl::Range::parse(input)?;
                r.region.refresh()?;
                if let Some(k) = self.kernel.get() {
                    k.invalidate(
                        h.ino,
                        range.offset.min(i64::MAX as u64) as i64,
                        range.len.min(i64::MAX as u64) as i64,
                    )
                    .map_err(|source| FsError::Io {
                        what: "cannot drop cached pages".into(),
                        source,
                    })?;
                }
                // A consumer clearing its cache also wants a grown size.
                let grown = {
                    let mut inodes = self.lock_inodes();
                    let st = inodes.entry(h.ino).or_default();
                    st.seen = None;
                    let size = r.region.size();
                    (self.writeback() && size > st.kernel_size).then(|| {
                        let old = st.kernel_size;
                        st.kernel_size = size;
                        (old, size)
                    })
                };
                if let Some((old, size)) = grown {
                    self.push_size(h.ino, old, size, Some(&r.region));
                }
                Ok(Vec::new())
            }
            ioctl::RPREFETCH => {
                let range = ioctl::Range::parse(input)?;
                self.prefetch(&h, r, range)?;
                Ok(Vec::new())
            }
            ioctl::RINFO => {
                r.region.refresh()?;
                let attr = self.manager().getattr(&r.caller, h.ino)?;
                let ra = attr.region_attrs.clone().unwrap_or_default();
                let io = r.io.lock().map(|i| *i).unwrap_or(IoMode::Cached);
                let mut flags = 0;
                for (on, bit) in [
                    (ra.persistent, ioctl::INFO_PERSISTENT),
                    (ra.multihosted, ioctl::INFO_MULTIHOSTED),
                    (ra.fixvaddr, ioctl::INFO_FIXVADDR),
                    (ra.onewriter, ioctl::INFO_ONEWRITER),
                    (r.region.is_wholly_local(), ioctl::INFO_LOCAL),
                    (io == IoMode::Passthrough, ioctl::INFO_PASSTHROUGH),
                    (r.write, ioctl::INFO_WRITABLE),
                ] {
                    if on {
                        flags |= bit;
                    }
                }
                Ok(ioctl::Info {
                    ino: h.ino,
                    size: r.region.size(),
                    vaddr: attr.vaddr,
                    map_version: r.region.map_version(),
                    allocated: attr.allocated,
                    owner_pid: attr.owner_pid,
                    owner_host: attr.owner_host,
                    flags,
                    hosts: r.region.hosts(),
                }
                .encode())
            }
            ioctl::RMARKDIRTY => {
                let m = ioctl::MarkDirty::parse(input)?;
                if !r.write {
                    return Err(FsError::BadHandle(
                        "RMARKDIRTY needs a descriptor open for writing".into(),
                    ));
                }
                if m.zero {
                    self.zero_range(&h, r, m.range)?;
                }
                Ok(Vec::new())
            }
            other => Err(FsError::UnknownIoctl(other)),
        }
    }

    /// rprefetch: reads the range and stores it in the page cache.
    fn prefetch(&self, h: &Handle, r: &RegionHandle, range: ioctl::Range) -> FsResult<()> {
        r.region.refresh()?;
        let (start, len) = range.clip(r.region.size());
        let io = r.io.lock().map(|i| *i).unwrap_or(IoMode::Direct);
        let Some(kernel) = self.kernel.get().filter(|_| io == IoMode::Cached) else {
            // Passthrough and direct opens have no page cache to fill.
            return Ok(());
        };
        if len == 0 {
            return Ok(());
        }
        // Dirty pages are written back first, so the store cannot undo them.
        kernel
            .invalidate(h.ino, start as i64, len as i64)
            .map_err(|source| FsError::Io {
                what: "cannot prepare the page cache for prefetch".into(),
                source,
            })?;
        let mut at = start;
        let end = start + len;
        let mut buf = vec![0u8; STEP as usize];
        while at < end {
            let n = (end - at).min(STEP) as usize;
            let got = r.region.read_at(at, &mut buf[..n])?;
            if got == 0 {
                break;
            }
            if let Err(e) = kernel.store(h.ino, at, &buf[..got]) {
                tracing::debug!(ino = h.ino, error = %e, "prefetch store refused; the range will be read on demand");
                break;
            }
            at += got as u64;
        }
        Ok(())
    }

    /// rmarkdirty(zero): zeroes the range in the region without reading it.
    fn zero_range(&self, h: &Handle, r: &RegionHandle, range: ioctl::Range) -> FsResult<()> {
        r.region.refresh()?;
        let (start, len) = range.clip(r.region.size());
        if len == 0 {
            return Ok(());
        }
        if let Some(k) = self.kernel.get() {
            // Dirty pages go to the region first, then the zeros overwrite them.
            k.invalidate(h.ino, start as i64, len as i64)
                .map_err(|source| FsError::Io {
                    what: "cannot drop cached pages before zeroing".into(),
                    source,
                })?;
        }
        let zeros = vec![0u8; STEP.min(len) as usize];
        let mut at = start;
        while at < start + len {
            let n = (start + len - at).min(STEP) as usize;
            r.region.write_at(at, &zeros[..n])?;
            at += n as u64;
        }
        self.lock_inodes().entry(h.ino).or_default().dirty = true;
        if let Some(k) = self.kernel.get() {
            let _ = k.invalidate(h.ino, start as i64, len as i64);
        }
        Ok(())
    }
}
