//! The metadata pseudo files of Remote Regions paper §5.12 under the hidden
//! `.regions/` directory at the mount root, readable by root only:
//!
//! | file | content |
//! |---|---|
//! | `hosts` | every host: id, transport address, liveness, lease, memory, free |
//! | `memusage` | memory of regions held on this host |
//! | `pools` | every pool: gid, host, size, used, free |
//! | `daemon` | this host's daemon: pid and counters (through the host agent) |
//! | `procs` | open handles of this mount (pid, inode, mode) and watched owners |
//! | `files/<path>` | per region: vaddr, size, map, pools, attributes |
//!
//! Pseudo inodes live at the top of the 64-bit inode space, which the
//! manager (numbering from 1 upwards) never reaches: fixed files at
//! [`FIXED_BASE`]`+n`, and the `files/` mirror at [`FILES_BASE`]` | ino` for
//! manager inode `ino` (below 2^48). Content is generated at open and read
//! with direct I/O, like `/proc`.

use std::fmt::Write as _;

use regions_proto::layout::{CHUNK_SIZE, MapEntry};
use regions_proto::v1;

use crate::owners::Owned;

/// Name of the hidden directory at the mount root.
pub const DIR_NAME: &str = ".regions";
/// First inode of the fixed pseudo nodes.
pub const FIXED_BASE: u64 = 0xFFFF_0000_0000_0000;
/// Inodes of the `files/` mirror: `FILES_BASE | manager inode`.
pub const FILES_BASE: u64 = 0xFFFE_0000_0000_0000;
/// Manager inodes the mirror can represent.
pub const MAX_MIRRORED: u64 = 1 << 48;

/// A node of the `.regions` tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    /// `.regions/` itself.
    Root,
    /// `hosts`.
    Hosts,
    /// `memusage`.
    MemUsage,
    /// `pools`.
    Pools,
    /// `daemon`.
    Daemon,
    /// `procs`.
    Procs,
    /// `files/...`: the mirror of manager inode `ino` (1 = `files/`).
    Files(u64),
}

/// The fixed files, in listing order.
pub const FIXED: [(&str, Node); 5] = [
    ("hosts", Node::Hosts),
    ("memusage", Node::MemUsage),
    ("pools", Node::Pools),
    ("daemon", Node::Daemon),
    ("procs", Node::Procs),
];

impl Node {
    /// The node's inode number.
    pub fn ino(self) -> u64 {
        match self {
            Node::Root => FIXED_BASE + 1,
            Node::Hosts => FIXED_BASE + 2,
            Node::MemUsage => FIXED_BASE + 3,
            Node::Pools => FIXED_BASE + 4,
            Node::Daemon => FIXED_BASE + 5,
            Node::Procs => FIXED_BASE + 6,
            Node::Files(ino) => FILES_BASE | ino,
        }
    }

    /// The node an inode number names, if it is a pseudo inode.
    pub fn from_ino(ino: u64) -> Option<Node> {
        match ino {
            i if i == FIXED_BASE + 1 => Some(Node::Root),
            i if i == FIXED_BASE + 2 => Some(Node::Hosts),
            i if i == FIXED_BASE + 3 => Some(Node::MemUsage),
            i if i == FIXED_BASE + 4 => Some(Node::Pools),
            i if i == FIXED_BASE + 5 => Some(Node::Daemon),
            i if i == FIXED_BASE + 6 => Some(Node::Procs),
            i if i & FIXED_BASE == FILES_BASE && i & !FIXED_BASE != 0 => {
                Some(Node::Files(i & !FIXED_BASE))
            }
            _ => None,
        }
    }

    /// The mirror node of manager inode `ino`, if representable.
    pub fn mirror(ino: u64) -> Option<Node> {
        (ino != 0 && ino < MAX_MIRRORED).then_some(Node::Files(ino))
    }
}

/// Whether `ino` belongs to the pseudo tree.
pub fn is_pseudo(ino: u64) -> bool {
    ino >= FILES_BASE
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// `hosts`.
pub fn render_hosts(hosts: &[v1::HostRecord]) -> String {
    let mut out = String::from(
        "host\taddress\tlive\tlease_ms\tmemory\tpool_bytes\tfree_bytes\tagent\ttransports\n",
    );
    for h in hosts {
        let _ = writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            h.host_id,
            h.transport_addr,
            yes(h.live),
            h.lease_remaining_ms,
            h.memory_offered,
            h.pool_bytes,
            h.free_bytes,
            h.agent_socket,
            if h.transports.is_empty() {
                "tcp"
            } else {
                &h.transports
            }
        );
    }
    out
}

/// `pools`.
pub fn render_pools(
    pools: &[v1::PoolRecord],
    host_id: u32,
    daemon: Result<&v1::DaemonStats, &str>,
) -> String {
    let mut out = String::from("pool\thost\tsize\tused\tfree\n");
    for p in pools {
        let _ = writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}",
            p.gid,
            p.host_id,
            p.size,
            p.size.saturating_sub(p.free),
            p.free
        );
    }
    let host_id = daemon.map_or(host_id, |d| d.host_id);
    let d = match daemon {
        Ok(d) if d.object_memory > 0 => d,
        Ok(_) => {
            let _ = writeln!(
                out,
                "# host {host_id} keeps no object store for small regions"
            );
            return out;
        }
        Err(why) => {
            let _ = writeln!(out, "# objects of host {host_id} unknown: {why}");
            return out;
        }
    };
    let _ = writeln!(
        out,
        "# small regions as objects on host {host_id}: {} bytes of memory held, at most {}",
        d.object_bytes, d.object_memory
    );
    out.push_str(
        "class_slot\tblocks\tobjects\tlive_bytes\tblock_bytes\tfragmentation\tcompactions\tmoved_objects\tindirect\n",
    );
    for c in &d.object_classes {
        let _ = writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{:.3}\t{}\t{}\t{}",
            c.slot_size,
            c.blocks,
            c.objects,
            c.live_bytes,
            c.block_bytes,
            c.fragmentation,
            c.compactions,
            c.moved_objects,
            c.indirect
        );
    }
    out
}

/// `memusage`: memory of regions held on this host.
pub fn render_memusage(
    host_id: u32,
    host: Option<&v1::HostRecord>,
    pools: &[v1::PoolRecord],
    daemon: Option<&v1::DaemonStats>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "host\t{host_id}");
    let total: u64 = pools.iter().map(|p| p.size).sum();
    let free: u64 = pools.iter().map(|p| p.free).sum();
    let _ = writeln!(out, "pools\t{}", pools.len());
    let _ = writeln!(out, "pool_bytes\t{total}");
    let _ = writeln!(out, "allocated_bytes\t{}", total.saturating_sub(free));
    let _ = writeln!(out, "free_bytes\t{free}");
    if let Some(h) = host {
        let _ = writeln!(out, "memory_offered\t{}", h.memory_offered);
    }
    match daemon {
        Some(d) => {
            let _ = writeln!(out, "regions_held\t{}", d.segments);
            let _ = writeln!(out, "resident_bytes\t{}", d.segment_bytes);
            let _ = writeln!(out, "memory_limit\t{}", d.memory_limit);
        }
        None => out.push_str("# no host agent: resident memory unknown\n"),
    }
    out
}

/// `daemon`.
pub fn render_daemon(pid: Option<u32>, stats: Option<&v1::DaemonStats>, note: &str) -> String {
    let mut out = String::new();
    match pid {
        Some(pid) => {
            let _ = writeln!(out, "pid\t{pid}");
        }
        None => out.push_str("pid\tunknown\n"),
    }
    match stats {
        Some(s) => {
            let _ = writeln!(out, "host\t{}", s.host_id);
            let _ = writeln!(out, "transport_requests\t{}", s.transport_requests);
            let _ = writeln!(out, "transport_bytes_read\t{}", s.transport_bytes_read);
            let _ = writeln!(
                out,
                "transport_bytes_written\t{}",
                s.transport_bytes_written
            );
            let _ = writeln!(out, "transport_connections\t{}", s.transport_connections);
            let _ = writeln!(out, "segments\t{}", s.segments);
            let _ = writeln!(out, "segment_bytes\t{}", s.segment_bytes);
            let _ = writeln!(out, "pool_bytes\t{}", s.pool_bytes);
            let _ = writeln!(out, "memory_limit\t{}", s.memory_limit);
        }
        None => {
            let _ = writeln!(out, "# {note}");
        }
    }
    out
}

/// One open handle of this mount, for `procs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcLine {
    /// The process that opened it.
    pub pid: u32,
    /// Its user.
    pub uid: u32,
    /// The region.
    pub ino: u64,
    /// The file handle.
    pub fh: u64,
    /// Open for writing.
    pub writable: bool,
    /// How data moves (cached, passthrough, direct).
    pub io: &'static str,
}

/// `procs`: open handles and watched owners.
pub fn render_procs(handles: &[ProcLine], owners: &[Owned]) -> String {
    let mut out = String::from("pid\tuid\tino\tfh\tmode\tio\n");
    let mut sorted = handles.to_vec();
    sorted.sort_by_key(|h| (h.pid, h.ino, h.fh));
    for h in &sorted {
        let _ = writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{}",
            h.pid,
            h.uid,
            h.ino,
            h.fh,
            if h.writable { "rw" } else { "r" },
            h.io
        );
    }
    out.push_str(
        "# owners watched (non-persistent regions created here)\nowner_pid\tino\tparent\tname\n",
    );
    let mut owners = owners.to_vec();
    owners.sort_by_key(|o| (o.pid, o.ino));
    for o in &owners {
        let _ = writeln!(out, "{}\t{}\t{}\t{}", o.pid, o.ino, o.parent, o.name);
    }
    out
}

/// `files/<path>`: a region's metadata.
pub fn render_region(path: &str, attr: &v1::Attr, info: Option<&v1::RegionInfo>) -> String {
    let mut out = String::new();
    let ra = attr.region_attrs.clone().unwrap_or_default();
    let _ = writeln!(out, "path\t{path}");
    let _ = writeln!(out, "ino\t{}", attr.ino);
    let _ = writeln!(out, "size\t{}", attr.size);
    let _ = writeln!(out, "allocated\t{}", attr.allocated);
    let _ = writeln!(out, "vaddr\t{:#x}", attr.vaddr);
    let _ = writeln!(out, "owner_pid\t{}", attr.owner_pid);
    let _ = writeln!(out, "owner_host\t{}", attr.owner_host);
    let _ = writeln!(out, "persistent\t{}", u8::from(ra.persistent));
    let _ = writeln!(out, "multihosted\t{}", u8::from(ra.multihosted));
    let _ = writeln!(out, "fixvaddr\t{}", u8::from(ra.fixvaddr));
    let _ = writeln!(out, "onewriter\t{}", u8::from(ra.onewriter));
    let hostalloc: Vec<String> = ra.hostalloc.iter().map(u32::to_string).collect();
    let _ = writeln!(out, "hostalloc\t{}", hostalloc.join(","));
    let Some(info) = info else {
        out.push_str("# map unavailable\n");
        return out;
    };
    let _ = writeln!(out, "map_version\t{}", info.map_version);
    out.push_str("pools\n");
    let mut pools = info.pools.clone();
    pools.sort_by_key(|p| p.gid);
    for p in &pools {
        let _ = writeln!(
            out,
            "  pool {} host {} transport {} size {} free {}",
            p.gid, p.host_id, p.transport_addr, p.size, p.free
        );
    }
    out.push_str("map\t# region offset+len -> pool @ pool offset\n");
    for run in map_runs(&info.map) {
        match run.entry {
            Some(e) => {
                let _ = writeln!(
                    out,
                    "  {:#x}+{:#x} -> pool {} @ {:#x}",
                    run.offset, run.len, e.gid, e.pool_offset
                );
            }
            None => {
                let _ = writeln!(out, "  {:#x}+{:#x} -> unallocated", run.offset, run.len);
            }
        }
    }
    out
}

/// Consecutive chunks that are consecutive in one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapRun {
    /// Region offset.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Where the run starts (None: chunks without memory).
    pub entry: Option<MapEntry>,
}

/// Merges a region map into runs.
pub fn map_runs(map: &[u64]) -> Vec<MapRun> {
    let mut runs: Vec<MapRun> = Vec::new();
    for (i, raw) in map.iter().enumerate() {
        let offset = i as u64 * CHUNK_SIZE;
        let entry = MapEntry::decode(*raw);
        if let Some(last) = runs.last_mut() {
            let follows = match (last.entry, entry) {
                (Some(a), Some(b)) => a.gid == b.gid && a.pool_offset + last.len == b.pool_offset,
                (None, None) => true,
                _ => false,
            };
            if follows {
                last.len += CHUNK_SIZE;
                continue;
            }
        }
        runs.push(MapRun {
            offset,
            len: CHUNK_SIZE,
            entry,
        });
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_numbers() {
        for (_, n) in FIXED {
            assert_eq!(Node::from_ino(n.ino()), Some(n));
            assert!(is_pseudo(n.ino()));
        }
        assert_eq!(Node::from_ino(Node::Root.ino()), Some(Node::Root));
        let m = Node::mirror(42).unwrap();
        assert_eq!(Node::from_ino(m.ino()), Some(Node::Files(42)));
        assert!(is_pseudo(m.ino()));
        assert_eq!(Node::mirror(MAX_MIRRORED), None);
        assert_eq!(Node::mirror(0), None);
        assert_eq!(Node::from_ino(1), None);
        assert_eq!(Node::from_ino(1 << 40), None);
        assert!(!is_pseudo(MAX_MIRRORED));
    }

    #[test]
    fn map_runs_merge() {
        let e = |gid, off| {
            MapEntry {
                gid,
                pool_offset: off,
            }
            .encode()
            .unwrap()
        };
        let map = [
            e(3, 0),
            e(3, CHUNK_SIZE),
            e(4, 0),
            0,
            0,
            e(3, 5 * CHUNK_SIZE),
        ];
        let runs = map_runs(&map);
        assert_eq!(runs.len(), 4);
        assert_eq!(runs[0].len, 2 * CHUNK_SIZE);
        assert_eq!(runs[2].entry, None);
        assert_eq!(runs[2].len, 2 * CHUNK_SIZE);
        let info = v1::RegionInfo {
            map: map.to_vec(),
            map_version: 7,
            pools: vec![v1::PoolInfo {
                gid: 3,
                host_id: 1,
                size: 1 << 30,
                free: 1 << 29,
                transport_addr: "127.0.0.1:7171".into(),
            }],
            ..Default::default()
        };
        let attr = v1::Attr {
            ino: 12,
            size: 6 * CHUNK_SIZE,
            ..Default::default()
        };
        let text = render_region("a/b", &attr, Some(&info));
        assert!(text.contains("ino\t12\n"), "{text}");
        assert!(text.contains("map_version\t7"), "{text}");
        assert!(text.contains("0x0+0x40000 -> pool 3 @ 0x0"), "{text}");
        assert!(text.contains("unallocated"), "{text}");
    }

    #[test]
    fn tables() {
        let hosts = [v1::HostRecord {
            host_id: 1,
            transport_addr: "127.0.0.1:7171".into(),
            live: true,
            lease_remaining_ms: 900,
            memory_offered: 1 << 30,
            ..Default::default()
        }];
        let t = render_hosts(&hosts);
        assert!(
            t.lines()
                .nth(1)
                .unwrap()
                .starts_with("1\t127.0.0.1:7171\tyes\t900")
        );
        // A host that said nothing of its transports serves tcp; one that serves RDMA says so.
        assert!(t.lines().nth(1).unwrap().ends_with("\ttcp"), "{t}");
        let rdma = render_hosts(&[v1::HostRecord {
            transports: "tcp rdma:rxe0".into(),
            ..hosts[0].clone()
        }]);
        assert!(
            rdma.lines().nth(1).unwrap().ends_with("\ttcp rdma:rxe0"),
            "{rdma}"
        );
        let pool = v1::PoolRecord {
            gid: 2,
            host_id: 1,
            size: 100,
            free: 40,
        };
        let daemon = v1::DaemonStats {
            host_id: 1,
            object_memory: 1 << 20,
            object_bytes: 8192,
            object_classes: vec![v1::ObjectClassStats {
                slot_size: 96,
                blocks: 1,
                objects: 3,
                live_bytes: 200,
                block_bytes: 32768,
                fragmentation: 0.25,
                compactions: 2,
                moved_objects: 1,
                indirect: 4,
            }],
            ..v1::DaemonStats::default()
        };
        let p = render_pools(std::slice::from_ref(&pool), 1, Ok(&daemon));
        assert_eq!(p.lines().nth(1), Some("2\t1\t100\t60\t40"));
        assert!(p.contains("8192 bytes of memory held"), "{p}");
        assert_eq!(
            p.lines().last(),
            Some("96\t1\t3\t200\t32768\t0.250\t2\t1\t4")
        );
        let none = render_pools(&[pool], 1, Err("agent down"));
        assert!(none.ends_with("unknown: agent down\n"), "{none}");
        let procs = render_procs(
            &[ProcLine {
                pid: 5,
                uid: 0,
                ino: 9,
                fh: 1,
                writable: true,
                io: "cached",
            }],
            &[],
        );
        assert!(procs.contains("5\t0\t9\t1\trw\tcached"));
        assert!(render_memusage(1, None, &[], None).contains("no host agent"));
        assert!(render_daemon(Some(3), None, "agent down").contains("pid\t3"));
    }
}
