//! The records the manager keeps, as stored (postcard) and held in memory.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use regions_proto::v1;
use serde::{Deserialize, Serialize};

/// Inode number of the mount root.
pub const ROOT_INO: u64 = 1;
/// Longest name of a directory entry, in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// Kind of an inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    Directory,
    Region,
}

/// A timestamp (seconds and nanoseconds since the Unix epoch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Time {
    pub sec: i64,
    pub nsec: u32,
}

impl Time {
    /// The manager's clock now.
    pub fn now() -> Time {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => Time {
                sec: d.as_secs() as i64,
                nsec: d.subsec_nanos(),
            },
            Err(_) => Time::default(),
        }
    }

    pub fn to_proto(self) -> v1::Timespec {
        v1::Timespec {
            sec: self.sec,
            nsec: self.nsec,
        }
    }

    pub fn from_proto(t: &v1::Timespec) -> Time {
        Time {
            sec: t.sec,
            nsec: t.nsec.min(999_999_999),
        }
    }
}

/// Region attributes (paper 003 §5.4); on directories, the inherited defaults.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionAttrs {
    pub persistent: bool,
    pub multihosted: bool,
    pub fixvaddr: bool,
    pub onewriter: bool,
    pub hostalloc: Vec<u32>,
}

impl RegionAttrs {
    pub fn to_proto(&self) -> v1::RegionAttrs {
        v1::RegionAttrs {
            persistent: self.persistent,
            multihosted: self.multihosted,
            fixvaddr: self.fixvaddr,
            onewriter: self.onewriter,
            hostalloc: self.hostalloc.clone(),
        }
    }
}

/// A directory or a region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inode {
    pub ino: u64,
    pub kind: Kind,
    /// Permission bits with setuid/setgid/sticky (07777).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// Logical size in bytes (regions; 0 for directories).
    pub size: u64,
    pub atime: Time,
    pub mtime: Time,
    pub ctime: Time,
    pub crtime: Time,
    /// Directory holding this inode's only name (0 once unlinked).
    pub parent: u64,
    pub attrs: RegionAttrs,
    pub owner_pid: u32,
    pub owner_host: u32,
    /// Start and length of the fixed virtual address range (FIXVADDR), else 0.
    pub vaddr: u64,
    pub vaddr_len: u64,
    /// `user.*` extended attributes other than `user.regions.*`.
    pub xattrs: BTreeMap<String, Vec<u8>>,
    /// Directories: cookie of the next entry added.
    pub next_cookie: u64,
    /// Regions: bumped on every change of the map.
    pub map_version: u64,
}

impl Inode {
    pub fn is_dir(&self) -> bool {
        self.kind == Kind::Directory
    }
}

/// A directory entry's value: the inode and its readdir cookie.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dirent {
    pub ino: u64,
    pub cookie: u64,
}

/// First cookie handed to a real entry (1 and 2 are "." and ".." in FUSE).
pub const FIRST_COOKIE: u64 = 3;

/// A host that registered (its daemon).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    pub host_id: u32,
    pub transport_addr: String,
    pub agent_socket: String,
    pub memory_offered: u64,
    pub incarnation: u64,
}

/// A pool: an address window at a host's daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    pub gid: u32,
    pub host_id: u32,
    /// Bytes, a multiple of the chunk size.
    pub size: u64,
}

/// An open region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handle {
    pub id: u64,
    pub ino: u64,
    pub write: bool,
    pub pid: u32,
    pub host_id: u32,
}

/// Serialises a record for the store.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_allocvec(value)
}

/// Reads a stored record.
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(bytes)
}
