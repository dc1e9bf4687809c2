//! Hosts, leases and pools.

use std::time::Instant;

use regions_proto::layout::{CHUNK_SIZE, MAX_POOL_GID, MapEntry};
use regions_proto::v1;

use crate::error::{ManagerError, Result};
use crate::model::{Host, Pool};
use crate::state::State;

/// What a daemon says when it registers.
#[derive(Clone, Debug)]
pub struct HostRegistration {
    pub host_id: u32,
    pub transport_addr: String,
    pub agent_socket: String,
    pub memory_offered: u64,
    pub incarnation: u64,
    /// The data transports the daemon serves ("tcp", "tcp rdma:rxe0"; empty: tcp).
    pub transports: String,
    /// Bytes of its object store for small regions (0: none).
    pub object_memory: u64,
}

impl State {
    /// Registers or re-registers a host and grants it a lease. Returns the
    /// previous incarnation when the daemon restarted (its memory is gone).
    pub fn register_host(&mut self, r: &HostRegistration) -> Result<Option<u64>> {
        if r.host_id == 0 {
            return Err(ManagerError::Invalid(
                "host id 0 is reserved; use 1 or more".into(),
            ));
        }
        if r.transport_addr.is_empty() {
            return Err(ManagerError::Invalid(format!(
                "host {} registered without a transport address",
                r.host_id
            )));
        }
        let previous = self.hosts.get(&r.host_id).map(|h| h.incarnation);
        let host = Host {
            host_id: r.host_id,
            transport_addr: r.transport_addr.clone(),
            agent_socket: r.agent_socket.clone(),
            memory_offered: r.memory_offered,
            incarnation: r.incarnation,
        };
        let transports = if r.transports.is_empty() {
            "tcp".to_owned()
        } else {
            r.transports.clone()
        };
        self.host_transports.insert(r.host_id, transports);
        self.objects.hosts.insert(r.host_id, r.object_memory);
        if self.hosts.get(&r.host_id) != Some(&host) {
            self.hosts.insert(r.host_id, host);
            self.dirty.hosts.insert(r.host_id);
        }
        self.leases.insert(r.host_id, Instant::now() + self.lease);
        // A host that lost its lease earns a new one here; its fence stays for the tokens
        // minted before it.
        self.lease_lost.remove(&r.host_id);
        self.fence_settled.remove(&r.host_id);
        Ok(previous.filter(|p| *p != r.incarnation))
    }

    /// Renews a host's lease.
    pub fn heartbeat(&mut self, host_id: u32, incarnation: u64) -> Result<()> {
        let host = self.hosts.get(&host_id).ok_or_else(|| {
            ManagerError::NotFound(format!(
                "host {host_id}; register it before sending heartbeats"
            ))
        })?;
        if host.incarnation != incarnation {
            return Err(ManagerError::Invalid(format!(
                "host {host_id} heartbeat from incarnation {incarnation}, registered as {}; register again",
                host.incarnation
            )));
        }
        if self.lease_lost.contains(&host_id) {
            return Err(ManagerError::Invalid(format!(
                "host {host_id}'s lease ended (no heartbeat within {:?}): its processes' \
                 handles were closed and their capabilities fenced; register again",
                self.lease
            )));
        }
        self.leases.insert(host_id, Instant::now() + self.lease);
        Ok(())
    }

    /// Registers a new pool (gid 0: the manager picks one) or grows a known one.
    pub fn register_pool(&mut self, host_id: u32, gid: u32, size: u64) -> Result<Pool> {
        let host = self.hosts.get(&host_id).ok_or_else(|| {
            ManagerError::NotFound(format!("host {host_id}; register it before its pools"))
        })?;
        let size = size - size % CHUNK_SIZE;
        if size == 0 {
            return Err(ManagerError::Invalid(format!(
                "pool size must be at least one chunk ({CHUNK_SIZE} bytes)"
            )));
        }
        let old = match gid {
            0 => 0,
            _ => match self.alloc.pool(gid) {
                Some(p) if p.pool.host_id != host_id => {
                    return Err(ManagerError::Perm(format!(
                        "pool {gid} belongs to host {}, not host {host_id}",
                        p.pool.host_id
                    )));
                }
                Some(p) if p.pool.size > size => {
                    return Err(ManagerError::Invalid(format!(
                        "pool {gid} cannot shrink from {} to {size} bytes",
                        p.pool.size
                    )));
                }
                Some(p) => p.pool.size,
                None => {
                    return Err(ManagerError::NotFound(format!(
                        "pool {gid}; register new pools with gid 0"
                    )));
                }
            },
        };
        let total = self.alloc.host_total(host_id) - old + size;
        if total > host.memory_offered {
            return Err(ManagerError::Invalid(format!(
                "host {host_id} pools would total {total} bytes, more than the {} it offers",
                host.memory_offered
            )));
        }
        let gid = if gid == 0 {
            let next = self.counters.next_gid;
            if next > MAX_POOL_GID {
                return Err(ManagerError::NoSpace(format!(
                    "all {MAX_POOL_GID} pool ids are used"
                )));
            }
            self.counters.next_gid += 1;
            self.dirty.counters = true;
            next
        } else {
            gid
        };
        let pool = Pool { gid, host_id, size };
        self.alloc.add_pool(pool);
        self.dirty.pools.insert(gid);
        Ok(pool)
    }

    pub fn pool_record(&self, gid: u32) -> Option<v1::PoolRecord> {
        self.alloc.pool(gid).map(|p| v1::PoolRecord {
            gid,
            host_id: p.pool.host_id,
            size: p.pool.size,
            free: p.free_chunks() * CHUNK_SIZE,
        })
    }

    pub fn host_record(&self, host: &Host) -> v1::HostRecord {
        let remaining = self.leases.get(&host.host_id).map_or(0, |t| {
            t.saturating_duration_since(Instant::now()).as_millis() as u64
        });
        v1::HostRecord {
            host_id: host.host_id,
            transport_addr: host.transport_addr.clone(),
            agent_socket: host.agent_socket.clone(),
            memory_offered: host.memory_offered,
            incarnation: host.incarnation,
            live: remaining > 0,
            lease_remaining_ms: remaining,
            pool_bytes: self.alloc.host_total(host.host_id),
            free_bytes: self.alloc.host_free(host.host_id),
            transports: self
                .host_transports
                .get(&host.host_id)
                .cloned()
                .unwrap_or_else(|| "tcp".to_owned()),
        }
    }

    /// Which region chunks back each allocated chunk of pool `gid`.
    pub fn pool_chunks(&self, gid: u32) -> Result<Vec<v1::ChunkBacking>> {
        if self.alloc.pool(gid).is_none() {
            return Err(ManagerError::NotFound(format!("pool {gid}")));
        }
        let mut out: Vec<v1::ChunkBacking> = Vec::new();
        let mut inos: Vec<&u64> = self.maps.keys().collect();
        inos.sort();
        for &ino in inos {
            if self.skip_in_resync(ino) {
                continue;
            }
            for (index, raw) in self.maps[&ino].iter().enumerate() {
                let Some(e) = MapEntry::decode(*raw) else {
                    continue;
                };
                if e.gid != gid {
                    continue;
                }
                let region_offset = index as u64 * CHUNK_SIZE;
                match out.last_mut() {
                    Some(last)
                        if last.ino == ino
                            && last.pool_offset + last.len == e.pool_offset
                            && last.region_offset + last.len == region_offset =>
                    {
                        last.len += CHUNK_SIZE
                    }
                    _ => out.push(v1::ChunkBacking {
                        pool_offset: e.pool_offset,
                        ino,
                        region_offset,
                        len: CHUNK_SIZE,
                        gid,
                    }),
                }
            }
        }
        Ok(out)
    }

    pub fn stats(&self) -> v1::StatsReply {
        let (mut regions, mut region_bytes, mut lost_regions) = (0u64, 0u64, 0u64);
        for inode in self.inodes.values().filter(|i| i.is_region()) {
            regions += 1;
            region_bytes += inode.size;
            lost_regions += u64::from(inode.xattrs.contains_key(crate::model::LOST_KEY));
        }
        v1::StatsReply {
            hosts: self.hosts.len() as u64,
            live_hosts: self.hosts.keys().filter(|h| self.is_live(**h)).count() as u64,
            pools: self.alloc.pools().count() as u64,
            total_bytes: self.alloc.pools().map(|p| p.pool.size).sum(),
            free_bytes: self
                .alloc
                .pools()
                .map(|p| p.free_chunks() * CHUNK_SIZE)
                .sum(),
            regions,
            directories: self.inodes.len() as u64 - regions,
            open_handles: self.handles.len() as u64,
            file_requests: 0,
            lost_regions,
            region_bytes,
            cache_lease_sessions: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn reg(host_id: u32, memory: u64, incarnation: u64) -> HostRegistration {
        HostRegistration {
            host_id,
            transport_addr: "127.0.0.1:1".into(),
            agent_socket: "/run/regions/h.sock".into(),
            memory_offered: memory,
            incarnation,
            transports: String::new(),
            object_memory: 0,
        }
    }

    #[test]
    fn hosts_register_heartbeat_and_expire() {
        let mut s = State::new(Duration::from_millis(50), 0o1777);
        assert_eq!(
            s.register_host(&reg(0, 1 << 20, 1)).unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(s.heartbeat(1, 1).unwrap_err().errno(), libc::ENOENT);
        assert_eq!(s.register_host(&reg(1, 1 << 20, 1)).unwrap(), None);
        assert!(s.is_live(1));
        s.heartbeat(1, 1).unwrap();
        assert_eq!(s.heartbeat(1, 2).unwrap_err().errno(), libc::EINVAL);
        assert_eq!(
            s.register_host(&reg(1, 1 << 20, 2)).unwrap(),
            Some(1),
            "restart noticed"
        );
        std::thread::sleep(Duration::from_millis(80));
        assert!(!s.is_live(1));
        assert!(!s.host_record(&s.hosts[&1]).live);
    }

    #[test]
    fn pools_register_within_offered_memory() {
        let mut s = State::new(Duration::from_secs(10), 0o1777);
        assert_eq!(
            s.register_pool(1, 0, CHUNK_SIZE).unwrap_err().errno(),
            libc::ENOENT
        );
        s.register_host(&reg(1, 8 * CHUNK_SIZE, 1)).unwrap();
        s.register_host(&reg(2, 8 * CHUNK_SIZE, 1)).unwrap();
        let p = s.register_pool(1, 0, 4 * CHUNK_SIZE + 5).unwrap();
        assert_eq!(p.size, 4 * CHUNK_SIZE, "rounded down to chunks");
        assert_eq!(
            s.register_pool(1, 0, 5 * CHUNK_SIZE).unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(s.register_pool(1, 0, 10).unwrap_err().errno(), libc::EINVAL);
        let grown = s.register_pool(1, p.gid, 8 * CHUNK_SIZE).unwrap();
        assert_eq!((grown.gid, grown.size), (p.gid, 8 * CHUNK_SIZE));
        assert_eq!(
            s.register_pool(1, p.gid, CHUNK_SIZE).unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(
            s.register_pool(2, p.gid, 8 * CHUNK_SIZE)
                .unwrap_err()
                .errno(),
            libc::EPERM
        );
        assert_eq!(
            s.register_pool(2, 77, CHUNK_SIZE).unwrap_err().errno(),
            libc::ENOENT
        );
        let q = s.register_pool(2, 0, CHUNK_SIZE).unwrap();
        assert_ne!(q.gid, p.gid);
        assert_eq!(s.stats().total_bytes, 9 * CHUNK_SIZE);
    }
}
