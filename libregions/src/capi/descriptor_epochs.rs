//! A mount's page of descriptor epochs, mapped read-only
//! ([`regions_proto::descriptor_epochs`]): how `rmalloc(fd, len)` knows, without a system
//! call, that `fd` still names the region it named when the thread last checked it.
//!
//! Pages are found once per mount and kept for the life of the process (4 KiB each), by the
//! mount's unique id (`STATX_MNT_ID_UNIQUE`, Linux 6.8; on older kernels, whose mount ids
//! come back after an unmount, there is no fast path). A page is used only if it is a
//! regular file of one page that root or this user owns and nobody else may write, and
//! only while it has not ended (its mount stopped); otherwise, or when the mount names
//! none, the caller checks every call with `kcmp`.

use std::collections::HashMap;
use std::ffi::{CString, c_int};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use regions_proto::descriptor_epochs::{ENDED, OPENS, PAGE_LEN, XATTR, close_word};

/// `STATX_MNT_ID_UNIQUE` of linux/stat.h (Linux 6.8).
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// A mapped page of counters.
pub(super) struct EpochPage {
    words: *const AtomicU64,
}

// SAFETY: the page is read only through atomics and stays mapped for the process's life.
unsafe impl Send for EpochPage {}
// SAFETY: as above.
unsafe impl Sync for EpochPage {}

/// What a thread saw in the page when it last checked a descriptor.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Seen {
    opens: u64,
    closes: u64,
}

impl EpochPage {
    fn word(&self, i: usize) -> u64 {
        // SAFETY: OPENS and close_word are below WORDS: inside the mapped, aligned page.
        unsafe { &*self.words.add(i) }.load(Ordering::Acquire)
    }

    /// The counts that matter to a descriptor of inode `ino`: read before the descriptor is
    /// checked, and compared on later calls.
    #[inline]
    pub(super) fn seen(&self, ino: u64) -> Seen {
        Seen {
            opens: self.word(OPENS),
            closes: self.word(close_word(ino)),
        }
    }
}

impl Seen {
    /// Whether the page had ended (its mount stopped): it tells nothing.
    pub(super) fn ended(&self) -> bool {
        self.opens == ENDED
    }
}

/// A mount, by the unique id statx gives it (never reused while the system runs).
type MountKey = u64;

fn mount_key(fd: c_int) -> Option<MountKey> {
    let st = super::statx_fd(fd, STATX_MNT_ID_UNIQUE).ok()?;
    (st.stx_mask & STATX_MNT_ID_UNIQUE != 0).then_some(st.stx_mnt_id)
}

/// The page of the mount `fd` lies on, if it keeps one we may trust.
pub(super) fn page_for(fd: c_int) -> Option<&'static EpochPage> {
    type Pages = Mutex<HashMap<MountKey, Option<&'static EpochPage>>>;
    static PAGES: OnceLock<Pages> = OnceLock::new();
    let key = mount_key(fd)?;
    let pages = PAGES.get_or_init(Mutex::default);
    if let Some(p) = pages
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
    {
        return *p;
    }
    let found = map_page(fd);
    if let Err(e) = &found {
        tracing::debug!(error = %e, "no descriptor-epoch page: rmalloc(fd) checks with kcmp");
    }
    let page = found.ok().map(|p| &*Box::leak(Box::new(p)));
    *pages
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry(key)
        .or_insert(page)
}

fn map_page(fd: c_int) -> Result<EpochPage, String> {
    // SAFETY: `fd` is the caller's open descriptor, borrowed for this call only.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let path = crate::xattr::fd_value(borrowed, XATTR).map_err(|e| e.to_string())?;
    let c_path =
        CString::new(path.clone()).map_err(|_| "the page's path holds a NUL".to_owned())?;
    let shown = String::from_utf8_lossy(&path).into_owned();
    // SAFETY: a NUL-terminated path; the descriptor returned is owned below.
    let raw = unsafe {
        libc::open(
            c_path.as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW,
        )
    };
    if raw < 0 {
        return Err(format!("open {shown}: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor that we own.
    let file = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: fstat writes into `st`, a properly sized out parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
        return Err(format!(
            "fstat {shown}: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG
        || st.st_size != PAGE_LEN as libc::off_t
        || (st.st_uid != 0 && st.st_uid != me)
        || st.st_mode & 0o022 != 0
    {
        return Err(format!(
            "{shown} is not a page root or this user owns alone (mode {:o}, owner {}, {} bytes)",
            st.st_mode, st.st_uid, st.st_size
        ));
    }
    // SAFETY: a shared read-only mapping of the file's one page; never unmapped (the page
    // lives as long as the process), and tmpfs or page-cache memory, which a reader never
    // loses while it is mapped.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE_LEN,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(format!("mmap {shown}: {}", std::io::Error::last_os_error()));
    }
    Ok(EpochPage {
        words: map.cast_const().cast(),
    })
}
