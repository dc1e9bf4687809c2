//! The memory behind the blocks: one memfd holding every block (file block `f` at byte
//! `f * BLOCK_SIZE`), and a window of block addresses (address `v` at window offset
//! `v * BLOCK_SIZE`) into which file blocks are mapped. After a compaction two addresses map
//! the same file block, which is how pointers to a merged block keep working (CoRM §3.1.2).
//!
//! Every access to the window is `unsafe`: the store's lock discipline guarantees that an
//! address is mapped while it is read or written, and that no address is remapped while
//! anyone accesses it (compaction holds the store's lock exclusively).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::memfd::MFdFlags;

use super::classes::BLOCK_SIZE;
use crate::error::{DaemonError, Result};
use crate::pools::memfd;
use crate::pools::window::Window;

/// The block memfd and the window of block addresses.
pub(super) struct BlockMemory {
    file: OwnedFd,
    /// Bytes the memfd spans.
    file_len: AtomicU64,
    window: Window,
    /// Block addresses the window holds.
    addresses: u32,
}

impl BlockMemory {
    /// A memfd (empty) and a window of `addresses` block addresses (nothing mapped).
    pub(super) fn new(addresses: u32) -> Result<BlockMemory> {
        let file = memfd::create(
            "regions-blocks",
            MFdFlags::MFD_CLOEXEC,
            "the block memory for small regions",
        )?;
        let window = Window::reserve(u64::from(addresses) * BLOCK_SIZE)?;
        Ok(BlockMemory {
            file,
            file_len: AtomicU64::new(0),
            window,
            addresses,
        })
    }

    /// Block addresses the window holds.
    pub(super) fn addresses(&self) -> u32 {
        self.addresses
    }

    /// Maps file block `file_block` at block address `address`, growing the memfd to cover it
    /// (new bytes are holes: zeros that use no memory until written).
    ///
    /// # Safety
    ///
    /// Nobody may access block address `address` during the call.
    pub(super) unsafe fn map(&self, address: u32, file_block: u32) -> Result<()> {
        let end = (u64::from(file_block) + 1) * BLOCK_SIZE;
        if end > self.file_len.load(Ordering::Acquire) {
            let len = i64::try_from(end)
                .map_err(|_| DaemonError::Invalid(format!("block file of {end} bytes")))?;
            nix::unistd::ftruncate(&self.file, len).map_err(|e| {
                DaemonError::sys(
                    format!("growing the small-region block file to {end} bytes"),
                    e,
                )
            })?;
            self.file_len.fetch_max(end, Ordering::AcqRel);
        }
        // SAFETY: nobody accesses the address meanwhile (caller's contract); the window checks
        // that the range is inside it.
        unsafe {
            self.window.map(
                u64::from(address) * BLOCK_SIZE,
                BLOCK_SIZE,
                self.file.as_fd(),
                u64::from(file_block) * BLOCK_SIZE,
            )
        }
    }

    /// Unmaps block address `address` (it becomes inaccessible).
    ///
    /// # Safety
    ///
    /// Nobody may access block address `address` during the call or after it.
    pub(super) unsafe fn unmap(&self, address: u32) -> Result<()> {
        // SAFETY: as the caller guarantees.
        unsafe {
            self.window
                .unmap(u64::from(address) * BLOCK_SIZE, BLOCK_SIZE)
        }
    }

    /// Gives the memory of file block `file_block` back to the kernel (it reads as zeros).
    pub(super) fn punch(&self, file_block: u32) -> Result<()> {
        self.punch_range(file_block, 0, BLOCK_SIZE as u32)
    }

    /// Gives the memory of bytes `[from, to)` of file block `file_block` back to the kernel
    /// (whole pages: the caller passes page-aligned bounds).
    pub(super) fn punch_range(&self, file_block: u32, from: u32, to: u32) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        memfd::punch(
            &self.file,
            u64::from(file_block) * BLOCK_SIZE + u64::from(from),
            u64::from(to - from),
            &format!("small-region block {file_block}"),
        )
    }

    /// Copies `src` to byte `offset` of block address `address`.
    ///
    /// # Safety
    ///
    /// The address must be mapped and not remapped during the call, and the range must lie
    /// inside the block.
    pub(super) unsafe fn write(&self, address: u32, offset: u32, src: &[u8]) {
        debug_assert!(u64::from(offset) + src.len() as u64 <= BLOCK_SIZE);
        // SAFETY: mapped and stable (caller's contract); inside the block, so inside the window.
        unsafe {
            self.window
                .copy_in(u64::from(address) * BLOCK_SIZE + u64::from(offset), src)
        }
    }

    /// Copies bytes at `offset` of block address `address` into `dst`.
    ///
    /// # Safety
    ///
    /// As for [`BlockMemory::write`].
    pub(super) unsafe fn read(&self, address: u32, offset: u32, dst: &mut [u8]) {
        debug_assert!(u64::from(offset) + dst.len() as u64 <= BLOCK_SIZE);
        // SAFETY: as for `write`.
        unsafe {
            self.window
                .copy_out(u64::from(address) * BLOCK_SIZE + u64::from(offset), dst)
        }
    }

    /// The 64-bit word at `offset` of block address `address` (8-byte aligned).
    ///
    /// # Safety
    ///
    /// As for [`BlockMemory::write`], for as long as the reference is used.
    pub(super) unsafe fn word(&self, address: u32, offset: u32) -> Option<&AtomicU64> {
        // SAFETY: as the caller guarantees.
        unsafe {
            self.window
                .word(u64::from(address) * BLOCK_SIZE + u64::from(offset))
        }
    }

    /// Bytes of memory the block file holds (pages actually allocated).
    pub(super) fn allocated_bytes(&self) -> u64 {
        memfd::allocated_bytes(&self.file, "the small-region block file")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_addresses_of_one_block_share_its_bytes_and_punching_frees_it() {
        let m = BlockMemory::new(4).unwrap();
        // SAFETY: single-threaded test; nothing else touches the window.
        unsafe {
            m.map(0, 0).unwrap();
            m.map(1, 1).unwrap();
            m.write(0, 100, b"first");
            m.write(1, 100, b"second");
            assert!(m.allocated_bytes() >= 8192);
            // Address 1 now shows file block 0, as compaction remaps a merged block.
            m.map(1, 0).unwrap();
            let mut buf = [0u8; 5];
            m.read(1, 100, &mut buf);
            assert_eq!(&buf, b"first");
            m.write(1, 200, b"both");
            let mut buf = [0u8; 4];
            m.read(0, 200, &mut buf);
            assert_eq!(&buf, b"both");
            m.word(0, 8).unwrap().store(7, Ordering::SeqCst);
            assert_eq!(m.word(1, 8).unwrap().load(Ordering::SeqCst), 7);
            let before = m.allocated_bytes();
            m.punch(1).unwrap();
            assert!(
                m.allocated_bytes() < before,
                "the punched block's page is freed"
            );
            m.unmap(1).unwrap();
        }
    }
}
