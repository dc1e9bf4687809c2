//! The ioctls of an open region file (Remote Regions paper §6.3 "ioctl stubs"):
//! numbers built with the Linux `_IOC` bits and the byte layout of their
//! arguments, exactly as `regionfs/include/regions_ioctl.h` declares them
//! for C. Arguments are native-endian C structs without padding surprises
//! (every field is naturally aligned).

use crate::error::{FsError, FsResult};

/// `_IOC_WRITE`: the caller passes the argument in (asm-generic layout, as
/// on x86-64, arm64 and riscv64).
const IOC_WRITE: u32 = 1;
/// `_IOC_READ`: the caller reads the argument back.
const IOC_READ: u32 = 2;

/// The ioctl type letter of regions.
pub const IOC_MAGIC: u32 = b'R' as u32;

/// `_IOC(dir, type, nr, size)`.
pub const fn ioc(dir: u32, ty: u32, nr: u32, size: u32) -> u32 {
    (dir << 30) | (size << 16) | (ty << 8) | nr
}

/// Size of `struct regions_range`.
pub const RANGE_SIZE: usize = 16;
/// Size of `struct regions_markdirty`.
pub const MARKDIRTY_SIZE: usize = 24;
/// Hosts listed in `struct regions_info`.
pub const INFO_MAX_HOSTS: usize = 16;
/// Size of `struct regions_info`.
pub const INFO_SIZE: usize = 5 * 8 + 4 * 4 + 4 * INFO_MAX_HOSTS;

/// Drops the cached pages of a range: the next read fetches from the region.
pub const RCLEARCACHE: u32 = ioc(IOC_WRITE, IOC_MAGIC, 1, RANGE_SIZE as u32);
/// Reads a range now and puts it in the page cache.
pub const RPREFETCH: u32 = ioc(IOC_WRITE, IOC_MAGIC, 2, RANGE_SIZE as u32);
/// Returns `struct regions_info` about the open region.
pub const RINFO: u32 = ioc(IOC_READ, IOC_MAGIC, 3, INFO_SIZE as u32);
/// Marks a range dirty; with `zero` set, zeroes it without reading it.
pub const RMARKDIRTY: u32 = ioc(IOC_WRITE, IOC_MAGIC, 4, MARKDIRTY_SIZE as u32);

/// `regions_info.flags`: the region survives its owner.
pub const INFO_PERSISTENT: u32 = 1 << 0;
/// `regions_info.flags`: allocated round-robin over many hosts.
pub const INFO_MULTIHOSTED: u32 = 1 << 1;
/// `regions_info.flags`: has a fixed virtual address.
pub const INFO_FIXVADDR: u32 = 1 << 2;
/// `regions_info.flags`: at most one writer at a time.
pub const INFO_ONEWRITER: u32 = 1 << 3;
/// `regions_info.flags`: every byte is held by this host.
pub const INFO_LOCAL: u32 = 1 << 4;
/// `regions_info.flags`: this open is served by FUSE passthrough.
pub const INFO_PASSTHROUGH: u32 = 1 << 5;
/// `regions_info.flags`: this open may write.
pub const INFO_WRITABLE: u32 = 1 << 6;

/// A byte range of the region; `len` 0 means "to the end".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Range {
    /// First byte.
    pub offset: u64,
    /// Bytes (0: to the end).
    pub len: u64,
}

impl Range {
    /// Parses `struct regions_range`.
    pub fn parse(data: &[u8]) -> FsResult<Range> {
        if data.len() < RANGE_SIZE {
            return Err(FsError::Invalid(format!(
                "ioctl argument of {} bytes; struct regions_range has {RANGE_SIZE}",
                data.len()
            )));
        }
        Ok(Range {
            offset: u64_at(data, 0),
            len: u64_at(data, 8),
        })
    }

    /// The range clipped to a region of `size` bytes, as (offset, len).
    pub fn clip(&self, size: u64) -> (u64, u64) {
        let start = self.offset.min(size);
        let end = if self.len == 0 {
            size
        } else {
            self.offset.saturating_add(self.len).min(size)
        };
        (start, end.saturating_sub(start))
    }

    /// Encodes the struct (tests and clients).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(RANGE_SIZE);
        v.extend_from_slice(&self.offset.to_ne_bytes());
        v.extend_from_slice(&self.len.to_ne_bytes());
        v
    }
}

/// `struct regions_markdirty`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MarkDirty {
    /// The bytes to mark.
    pub range: Range,
    /// Zero them without reading.
    pub zero: bool,
}

impl MarkDirty {
    /// Parses `struct regions_markdirty`.
    pub fn parse(data: &[u8]) -> FsResult<MarkDirty> {
        if data.len() < MARKDIRTY_SIZE {
            return Err(FsError::Invalid(format!(
                "ioctl argument of {} bytes; struct regions_markdirty has {MARKDIRTY_SIZE}",
                data.len()
            )));
        }
        Ok(MarkDirty {
            range: Range::parse(data)?,
            zero: u32_at(data, 16) != 0,
        })
    }

    /// Encodes the struct (tests and clients).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = self.range.encode();
        v.extend_from_slice(&u32::from(self.zero).to_ne_bytes());
        v.extend_from_slice(&0u32.to_ne_bytes());
        v
    }
}

/// `struct regions_info`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Info {
    /// Region id (inode number).
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Fixed virtual address (0 without FIXVADDR).
    pub vaddr: u64,
    /// Version of the region map.
    pub map_version: u64,
    /// Bytes of pool memory allocated.
    pub allocated: u64,
    /// The creating process.
    pub owner_pid: u32,
    /// The creating process's host.
    pub owner_host: u32,
    /// `INFO_*` bits.
    pub flags: u32,
    /// Every host holding data (the struct carries the first
    /// [`INFO_MAX_HOSTS`]; `nhosts` counts them all).
    pub hosts: Vec<u32>,
}

impl Info {
    /// Encodes `struct regions_info`.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(INFO_SIZE);
        for x in [
            self.ino,
            self.size,
            self.vaddr,
            self.map_version,
            self.allocated,
        ] {
            v.extend_from_slice(&x.to_ne_bytes());
        }
        let nhosts = u32::try_from(self.hosts.len()).unwrap_or(u32::MAX);
        for x in [self.owner_pid, self.owner_host, self.flags, nhosts] {
            v.extend_from_slice(&x.to_ne_bytes());
        }
        for i in 0..INFO_MAX_HOSTS {
            let h = self.hosts.get(i).copied().unwrap_or(0);
            v.extend_from_slice(&h.to_ne_bytes());
        }
        v
    }

    /// Parses `struct regions_info` (tests and clients).
    pub fn parse(data: &[u8]) -> FsResult<Info> {
        if data.len() < INFO_SIZE {
            return Err(FsError::Invalid(format!(
                "{} bytes; struct regions_info has {INFO_SIZE}",
                data.len()
            )));
        }
        let nhosts = u32_at(data, 52) as usize;
        Ok(Info {
            ino: u64_at(data, 0),
            size: u64_at(data, 8),
            vaddr: u64_at(data, 16),
            map_version: u64_at(data, 24),
            allocated: u64_at(data, 32),
            owner_pid: u32_at(data, 40),
            owner_host: u32_at(data, 44),
            flags: u32_at(data, 48),
            hosts: (0..nhosts.min(INFO_MAX_HOSTS))
                .map(|i| u32_at(data, 56 + 4 * i))
                .collect(),
        })
    }
}

fn u64_at(data: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&data[at..at + 8]);
    u64::from_ne_bytes(b)
}

fn u32_at(data: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&data[at..at + 4]);
    u32::from_ne_bytes(b)
}

/// The size the `_IOC` bits of `cmd` give its argument.
pub fn arg_size(cmd: u32) -> usize {
    ((cmd >> 16) & 0x3fff) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_match_the_header() {
        // The values regions_ioctl.h documents (asm-generic _IOC layout).
        assert_eq!(RCLEARCACHE, 0x4010_5201);
        assert_eq!(RPREFETCH, 0x4010_5202);
        assert_eq!(RINFO, 0x8078_5203);
        assert_eq!(RMARKDIRTY, 0x4018_5204);
        assert_eq!(arg_size(RINFO), INFO_SIZE);
        assert_eq!(INFO_SIZE, 120);
        let header = include_str!("../include/regions_ioctl.h");
        for (name, value) in [
            ("RCLEARCACHE", RCLEARCACHE),
            ("RPREFETCH", RPREFETCH),
            ("RINFO", RINFO),
            ("RMARKDIRTY", RMARKDIRTY),
        ] {
            let line = header
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} missing from the header"));
            assert!(
                line.contains(&format!("{value:#010x}")),
                "{name}: header line {line:?} lacks {value:#010x}"
            );
        }
    }

    #[test]
    fn structs_round_trip() {
        let r = Range {
            offset: 4096,
            len: 0,
        };
        assert_eq!(Range::parse(&r.encode()).unwrap(), r);
        assert!(Range::parse(&[0u8; 8]).is_err());
        assert_eq!(r.clip(10_000), (4096, 10_000 - 4096));
        assert_eq!(r.clip(100), (100, 0));
        assert_eq!(
            Range {
                offset: 10,
                len: u64::MAX
            }
            .clip(50),
            (10, 40)
        );
        let m = MarkDirty {
            range: Range { offset: 1, len: 2 },
            zero: true,
        };
        assert_eq!(MarkDirty::parse(&m.encode()).unwrap(), m);
        let info = Info {
            ino: 5,
            size: 6,
            vaddr: 0x4000_0000_0000,
            map_version: 3,
            allocated: 1 << 17,
            owner_pid: 77,
            owner_host: 2,
            flags: INFO_LOCAL | INFO_WRITABLE,
            hosts: vec![2, 3],
        };
        let bytes = info.encode();
        assert_eq!(bytes.len(), INFO_SIZE);
        assert_eq!(Info::parse(&bytes).unwrap(), info);
    }
}
