//! regionfs: the regions file system (docs/ARCHITECTURE.md, "regionfs"; Remote Regions paper
//! §5, §6.2, §6.6). Every region is a file of the mount; processes read,
//! write and `mmap` regions with ordinary file calls, and the kernel page
//! cache is the paper's write-back cache.
//!
//! Modules:
//!
//! - [`fs`]: the file-system core over a [`regions::Client`], testable
//!   without FUSE.
//! - [`fuse`]: the thin `fuser::Filesystem` adapter over the core.
//! - [`mount`]: mounting, stale-mount clean-up, unmounting, the ready file.
//! - [`identity`]: request identity (uid, gid, pid, groups) → caller.
//! - [`names`]: file names (any bytes) ↔ manager names (UTF-8).
//! - [`owners`]: deletes non-persistent regions when their creator exits.
//! - [`thread_defaults`]: per-thread default region attributes
//!   (rsetdefaultattr).
//! - [`pseudo`]: the `.regions/` metadata files (Remote Regions paper §5.12).
//! - [`ioctl`]: ioctl numbers and argument layouts
//!   (`include/regions_ioctl.h`).
//! - [`descriptor_epochs`]: the page of open and close counts that lets `rmalloc(fd)`
//!   skip its system call.
//! - [`error`]: [`FsError`] and its errno.

#![warn(missing_docs)]

pub mod cache_leases;
pub mod descriptor_epochs;
pub mod error;
pub mod fs;
pub mod fuse;
pub mod identity;
pub mod ioctl;
pub mod lookup_counts;
pub mod mount;
pub mod names;
pub mod owners;
pub mod placements;
pub mod pseudo;
pub mod status;
pub mod thread_defaults;

pub use error::{FsError, FsResult};
pub use fs::{CacheMode, FsOptions, RegionFs};
pub use identity::RequestCtx;
