//! The records the manager keeps, as stored (postcard) and held in memory.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use regions_proto::v1;
use serde::{Deserialize, Serialize};

pub use regions_proto::ROOT_INO;
/// Longest name of a directory entry, in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// Longest symbolic link target, in bytes (`PATH_MAX` less the NUL).
pub const MAX_SYMLINK_LEN: usize = 4095;

/// Kind of an inode. New kinds are added at the end: records store the
/// variant's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    Directory,
    Region,
    /// A symbolic link; its target is [`Inode::target`].
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl Kind {
    /// Kinds that are namespace entries only: no region memory, never opened
    /// through the manager (the client's kernel opens FIFOs, sockets and
    /// devices itself, and follows symbolic links).
    pub fn is_special(self) -> bool {
        !matches!(self, Kind::Directory | Kind::Region)
    }

    pub fn to_proto(self) -> v1::FileKind {
        match self {
            Kind::Directory => v1::FileKind::Directory,
            Kind::Region => v1::FileKind::Region,
            Kind::Symlink => v1::FileKind::Symlink,
            Kind::Fifo => v1::FileKind::Fifo,
            Kind::Socket => v1::FileKind::Socket,
            Kind::CharDevice => v1::FileKind::CharDevice,
            Kind::BlockDevice => v1::FileKind::BlockDevice,
        }
    }

    pub fn from_proto(kind: v1::FileKind) -> Option<Kind> {
        Some(match kind {
            v1::FileKind::Unspecified => return None,
            v1::FileKind::Directory => Kind::Directory,
            v1::FileKind::Region => Kind::Region,
            v1::FileKind::Symlink => Kind::Symlink,
            v1::FileKind::Fifo => Kind::Fifo,
            v1::FileKind::Socket => Kind::Socket,
            v1::FileKind::CharDevice => Kind::CharDevice,
            v1::FileKind::BlockDevice => Kind::BlockDevice,
        })
    }
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

/// Region attributes (Remote Regions paper §5.4); on directories, the inherited defaults.
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

/// A directory, a region or a special file.
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
    /// Directory holding this inode's first name (0 once unlinked). A region
    /// or special file with hard links (`nlink > 1`) has names in other
    /// directories too; a directory has exactly one name.
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
    /// Device number of a device node, else 0.
    pub rdev: u64,
    /// Target of a symbolic link, else empty.
    pub target: Vec<u8>,
}

impl Inode {
    pub fn is_dir(&self) -> bool {
        self.kind == Kind::Directory
    }

    pub fn is_region(&self) -> bool {
        self.kind == Kind::Region
    }

    /// Reads a stored inode, also in the layout written before special files
    /// existed (no `rdev` or `target`).
    pub fn decode_stored(bytes: &[u8]) -> Result<Inode, postcard::Error> {
        match decode::<Inode>(bytes) {
            Ok(inode) => Ok(inode),
            Err(e) => decode::<InodeBeforeSpecialFiles>(bytes)
                .map(Inode::from)
                .map_err(|_| e),
        }
    }
}

/// An inode as stored before special files: [`Inode`] without its last two
/// fields (postcard records carry no field names, so the old layout is read
/// with its own type).
#[derive(Deserialize)]
struct InodeBeforeSpecialFiles {
    ino: u64,
    kind: Kind,
    mode: u32,
    nlink: u32,
    uid: u32,
    gid: u32,
    size: u64,
    atime: Time,
    mtime: Time,
    ctime: Time,
    crtime: Time,
    parent: u64,
    attrs: RegionAttrs,
    owner_pid: u32,
    owner_host: u32,
    vaddr: u64,
    vaddr_len: u64,
    xattrs: BTreeMap<String, Vec<u8>>,
    next_cookie: u64,
    map_version: u64,
}

impl From<InodeBeforeSpecialFiles> for Inode {
    fn from(o: InodeBeforeSpecialFiles) -> Inode {
        Inode {
            ino: o.ino,
            kind: o.kind,
            mode: o.mode,
            nlink: o.nlink,
            uid: o.uid,
            gid: o.gid,
            size: o.size,
            atime: o.atime,
            mtime: o.mtime,
            ctime: o.ctime,
            crtime: o.crtime,
            parent: o.parent,
            attrs: o.attrs,
            owner_pid: o.owner_pid,
            owner_host: o.owner_host,
            vaddr: o.vaddr,
            vaddr_len: o.vaddr_len,
            xattrs: o.xattrs,
            next_cookie: o.next_cookie,
            map_version: o.map_version,
            rdev: 0,
            target: Vec::new(),
        }
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

/// Attribute-map key of the lost mark; its value says why, for people.
pub const LOST_KEY: &str = "regions.lost";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inodes_stored_before_special_files_still_load() {
        let inode = Inode {
            ino: 42,
            kind: Kind::Region,
            mode: 0o640,
            nlink: 1,
            uid: 1000,
            gid: 100,
            size: 12345,
            atime: Time { sec: 1, nsec: 2 },
            mtime: Time { sec: 3, nsec: 4 },
            ctime: Time { sec: 5, nsec: 6 },
            crtime: Time { sec: 7, nsec: 8 },
            parent: 1,
            attrs: RegionAttrs {
                persistent: true,
                hostalloc: vec![2, 3],
                ..RegionAttrs::default()
            },
            owner_pid: 77,
            owner_host: 2,
            vaddr: 0x7000_0000_0000,
            vaddr_len: 1 << 20,
            xattrs: [("user.a".to_owned(), b"b".to_vec())].into(),
            next_cookie: 3,
            map_version: 9,
            rdev: 0,
            target: Vec::new(),
        };
        let new = encode(&inode).unwrap();
        // The old layout is the new one without the last two fields, each one
        // byte here (a zero varint and an empty byte string).
        let old = &new[..new.len() - 2];
        assert_eq!(Inode::decode_stored(old).unwrap(), inode);
        assert_eq!(Inode::decode_stored(&new).unwrap(), inode);
        let link = Inode {
            kind: Kind::Symlink,
            target: b"../x".to_vec(),
            ..inode
        };
        assert_eq!(Inode::decode_stored(&encode(&link).unwrap()).unwrap(), link);
        assert!(Inode::decode_stored(&new[..10]).is_err());
    }
}
