//! FUSE passthrough: which opens the kernel serves straight from a region's segment memfd,
//! and keeping writers and passthrough readers of one inode apart.

use super::*;

impl RegionFs {
    /// Picks how an open's data moves and counts it. The kernel wants
    /// every open of an inode that has passthrough opens to be passthrough
    /// too (with the same backing file), so readers join them and writers
    /// are refused until they close ([`FsError::Busy`]).
    pub(super) fn choose_io(
        &self,
        ino: u64,
        write: bool,
        region: &Region,
        attr: &v1::Attr,
    ) -> FsResult<(IoMode, Option<OwnedFd>)> {
        let candidate = self.options.cache == CacheMode::Passthrough
            && self.passthrough.load(Ordering::Relaxed)
            && !write
            && attr.size > 0
            && region.is_wholly_local();
        let segment = if candidate {
            match self.client.local_segment(ino, false) {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(ino, error = %e, "no segment for passthrough");
                    None
                }
            }
        } else {
            None
        };
        let mut inodes = self.lock_inodes();
        let st = inodes.entry(ino).or_default();
        if st.passthrough_opens > 0 {
            if write {
                return Err(Self::passthrough_busy(ino));
            }
            st.passthrough_opens += 1;
            return Ok((IoMode::Passthrough, segment.map(|s| s.fd)));
        }
        // The segment spans whole chunks and passthrough reads to its end,
        // so only a region that fills it exactly qualifies.
        if let Some(seg) = segment
            && seg.size == attr.size
            && st.cached_opens == 0
        {
            st.passthrough_opens += 1;
            return Ok((IoMode::Passthrough, Some(seg.fd)));
        }
        st.cached_opens += 1;
        Ok((IoMode::Cached, None))
    }

    pub(super) fn passthrough_busy(ino: u64) -> FsError {
        FsError::Busy(format!(
            "region {ino} is being read at memory speed (FUSE passthrough) on this host; it can be opened for writing once those readers close (or mount with --cache writeback)"
        ))
    }

    /// In passthrough mode, waits a moment for passthrough readers of `ino`
    /// to go before a writer opens it (FUSE releases asynchronously).
    pub(super) fn wait_for_passthrough_readers(&self, ino: u64) -> FsResult<()> {
        if self.options.cache != CacheMode::Passthrough {
            return Ok(());
        }
        let deadline = Instant::now() + self.options.busy_retry;
        loop {
            let busy = self
                .lock_inodes()
                .get(&ino)
                .is_some_and(|st| st.passthrough_opens > 0);
            if !busy {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Self::passthrough_busy(ino));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The kernel would not take the passthrough descriptor: serve `fh`
    /// with direct I/O instead.
    pub fn passthrough_failed(&self, fh: u64) {
        let Ok(h) = self.handle(fh) else { return };
        if let Body::Region(r) = &h.body
            && let Ok(mut io) = r.io.lock()
            && *io == IoMode::Passthrough
        {
            *io = IoMode::Direct;
            let mut inodes = self.lock_inodes();
            if let Some(st) = inodes.get_mut(&h.ino) {
                st.passthrough_opens = st.passthrough_opens.saturating_sub(1);
            }
        }
    }
}
