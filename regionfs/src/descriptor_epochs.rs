//! The page of descriptor epochs this mount keeps for the library's `rmalloc(fd, len)`
//! ([`regions_proto::descriptor_epochs`]): a 4 KiB file of counters, counted in with atomic
//! adds before the mount answers an `OPEN`, `CREATE` or `FLUSH`, and named to processes by
//! the extended attribute [`XATTR`].
//!
//! The file lies in a directory only its owner writes (`/run/regions` by default, else the
//! temporary directory), is created exclusively with mode 0444, and is removed when the
//! mount ends; files left by a mount process that died are removed by the next one that
//! starts there.

use std::ffi::OsString;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub use regions_proto::descriptor_epochs::XATTR;
use regions_proto::descriptor_epochs::{ENDED, FILE_PREFIX, OPENS, PAGE_LEN, WORDS, close_word};

/// The mapped page of counters and the file that holds it.
pub struct DescriptorEpochs {
    path: PathBuf,
    words: *mut AtomicU64,
}

// SAFETY: the page is only reached through atomics, and the mapping lives as long as the
// value (unmapped in Drop).
unsafe impl Send for DescriptorEpochs {}
// SAFETY: as above.
unsafe impl Sync for DescriptorEpochs {}

impl DescriptorEpochs {
    /// A fresh page in the first of `/run/regions` and `<temporary directory>/regions-<uid>`
    /// that this process can use; `None` (logged) when neither works: `rmalloc(fd)` then
    /// checks its descriptor with one system call per call.
    pub fn start() -> Option<DescriptorEpochs> {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let dirs = [
            PathBuf::from("/run/regions"),
            std::env::temp_dir().join(format!("regions-{uid}")),
        ];
        let mut failures = Vec::new();
        for dir in dirs {
            match Self::create(&dir) {
                Ok(p) => return Some(p),
                Err(e) => failures.push(format!("{}: {e}", dir.display())),
            }
        }
        tracing::info!(
            failures = failures.join("; "),
            "no descriptor-epoch page: rmalloc(fd) checks its descriptor with a system call per call"
        );
        None
    }

    /// A fresh page in `dir` (made, mode 0755, if missing; refused unless this user owns it
    /// and nobody else may write in it).
    pub fn create(dir: &Path) -> std::io::Result<DescriptorEpochs> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)?;
        let meta = std::fs::symlink_metadata(dir)?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.is_dir()
            || std::os::unix::fs::MetadataExt::uid(&meta) != me
            || meta.permissions().mode() & 0o022 != 0
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the directory is not this user's alone (owner, or group or other write permission)",
            ));
        }
        remove_stale(dir);
        // A name never used before, so that an attribute naming a page names only that one.
        let name = format!("{FILE_PREFIX}{}.{:016x}", std::process::id(), nonce()?);
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o444)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        // A umask may have taken bits away; it cannot have added any.
        file.set_permissions(std::fs::Permissions::from_mode(0o444))?;
        // Blocks, not a hole: a store into the mapping must not find the disk full.
        (&file).write_all(&[0u8; PAGE_LEN])?;
        // SAFETY: a shared read-write mapping of the page the file now holds; the mapping
        // outlives the descriptor and is unmapped in Drop.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(DescriptorEpochs {
            path,
            words: map.cast(),
        })
    }

    /// Where the page is (the value of [`XATTR`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < WORDS);
        // SAFETY: `i` is below WORDS (close_word and OPENS are), so the word lies in the
        // mapped page, which is 8-byte aligned and lives as long as `self`.
        unsafe { &*self.words.add(i) }
    }

    /// Counts an open or create: call before answering it.
    pub fn opened(&self) {
        self.word(OPENS).fetch_add(1, Ordering::Release);
    }

    /// Counts a close of a descriptor of inode `ino` (a FUSE `FLUSH`): call before
    /// answering it.
    pub fn closed(&self, ino: u64) {
        self.word(close_word(ino)).fetch_add(1, Ordering::Release);
    }

    /// The current value of word `i` (tests).
    pub fn value(&self, i: usize) -> u64 {
        self.word(i).load(Ordering::Acquire)
    }
}

impl Drop for DescriptorEpochs {
    fn drop(&mut self) {
        // Processes that mapped the page stop trusting it.
        self.word(OPENS).store(ENDED, Ordering::Release);
        // SAFETY: the mapping made in `create`, not used after this.
        unsafe { libc::munmap(self.words.cast(), PAGE_LEN) };
        let _ = std::fs::remove_file(&self.path);
    }
}

/// 64 random bits.
fn nonce() -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return Err(std::io::Error::other("getrandom gave no random bytes"));
    }
    Ok(u64::from_ne_bytes(b))
}

/// Marks the page of a mount that died as ended, for the processes that still map it.
fn end_page(path: &Path) {
    let ended = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .and_then(|f| f.write_all_at(&ENDED.to_ne_bytes(), (OPENS * 8) as u64));
    if let Err(e) = ended {
        tracing::debug!(path = %path.display(), error = %e, "cannot mark a left-behind descriptor-epoch page ended");
    }
}

/// Removes pages in `dir` whose mount process is gone, marking them ended first.
fn remove_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name: OsString = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(FILE_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest
            .split('.')
            .next()
            .and_then(|p| p.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let gone = pid > 0
            && unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            end_page(&e.path());
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_in_the_file_and_the_file_goes_with_the_page() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let page = DescriptorEpochs::create(dir.path()).expect("a page");
        let path = page.path().to_owned();
        let meta = std::fs::metadata(&path).expect("the page's file");
        assert_eq!(meta.len(), PAGE_LEN as u64);
        assert_eq!(meta.permissions().mode() & 0o777, 0o444);
        page.opened();
        page.closed(7);
        page.closed(7);
        let word = |bytes: &[u8], i: usize| {
            u64::from_ne_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap())
        };
        let bytes = std::fs::read(&path).expect("read the page");
        assert_eq!(word(&bytes, OPENS), 1);
        assert_eq!(word(&bytes, close_word(7)), 2);
        assert_eq!(word(&bytes, close_word(8)), 0);
        // A reader that keeps the page sees it end.
        let kept = std::fs::File::open(&path).unwrap();
        drop(page);
        assert!(!path.exists(), "the page's file outlived it");
        let mut bytes = vec![0u8; PAGE_LEN];
        kept.read_exact_at(&mut bytes, 0).unwrap();
        assert_eq!(word(&bytes, OPENS), ENDED);
    }

    #[test]
    fn pages_of_dead_mount_processes_are_ended_and_removed() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        // No process has pid 2^22 + 1 (above the kernel's pid limit).
        let stale = dir.path().join(format!("{FILE_PREFIX}4194305.0"));
        let mine = dir
            .path()
            .join(format!("{FILE_PREFIX}{}.99", std::process::id()));
        std::fs::write(&stale, [0u8; PAGE_LEN]).unwrap();
        std::fs::write(&mine, b"x").unwrap();
        // A process that still maps the dead mount's page sees it end.
        let kept = std::fs::File::open(&stale).unwrap();
        let page = DescriptorEpochs::create(dir.path()).expect("a page");
        assert!(!stale.exists(), "a dead mount's page was kept");
        let mut opens = [0u8; 8];
        kept.read_exact_at(&mut opens, (OPENS * 8) as u64).unwrap();
        assert_eq!(
            u64::from_ne_bytes(opens),
            ENDED,
            "a dead mount's page was not marked ended"
        );
        assert!(mine.exists(), "a live mount's page was removed");
        drop(page);
    }
}
