//! The descriptor epochs a mount publishes so that `rmalloc(fd, len)` can tell, without a
//! system call, that `fd` still names the region it named before.
//!
//! A descriptor number changes meaning only after a `close` (or a `dup2` over it) has
//! released it and an `open` has taken the number again. Every `close` of a file of a FUSE
//! mount reaches its server (FUSE `FLUSH`) before `close(2)` returns, and every `open` does
//! too. So each mount keeps a page of counters in a small file of its own (on tmpfs under
//! its runtime directory, owned by the mount's user and read-only to everyone else) that it
//! counts in before it answers the `FLUSH` or `OPEN`, and names it in the extended attribute
//! [`XATTR`] of every inode. The library maps the page read-only: a descriptor checked once
//! (with `kcmp`) stays checked while the word of its inode and the word of opens are
//! unchanged.
//!
//! Layout: native-endian `u64` words updated with atomic adds, [`OPENS`] counting every open
//! and create of the mount, the others counting the closes of the inodes that hash to them
//! ([`close_word`]). A word only grows; [`OPENS`] becomes [`ENDED`] when the mount ends.

/// The extended attribute whose value is the page's path.
pub const XATTR: &str = "user.regions.descriptor_epochs";
/// Prefix of the page's file name (the mount process's pid and a random number follow).
pub const FILE_PREFIX: &str = "descriptor-epochs.";
/// Bytes of the page.
pub const PAGE_LEN: usize = 4096;
/// Words of the page.
pub const WORDS: usize = PAGE_LEN / 8;
/// The word counting opens and creates.
pub const OPENS: usize = 0;
/// What [`OPENS`] holds once the mount has ended (set as it stops, or by the next mount
/// process that finds its page left behind): the page says nothing any more.
pub const ENDED: u64 = u64::MAX;

/// The word counting the closes of inode `ino`.
pub fn close_word(ino: u64) -> usize {
    1 + (ino % (WORDS as u64 - 1)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_words_stay_inside_the_page_and_off_the_opens_word() {
        for ino in [0, 1, 510, 511, 512, u64::MAX, 1 << 48] {
            let w = close_word(ino);
            assert!(w != OPENS && w < WORDS, "inode {ino} -> word {w}");
        }
        assert_ne!(close_word(1), close_word(2));
    }
}
