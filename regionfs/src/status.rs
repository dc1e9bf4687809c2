//! `regionfs status`: the cluster at a glance, from the manager — its health, every host with
//! its lease and memory, region counts, and warnings an operator should act on.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use regions::manager_client::ManagerClient;
use regions_proto::v1;
use serde::Serialize;

/// A host is reported near full when less than this share of its pool memory is free.
pub const NEAR_FULL_FREE_FRACTION: f64 = 0.10;

/// What the manager says about the cluster.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The manager that answered.
    pub manager: ManagerStatus,
    /// `HEALTH_OK` or `HEALTH_WARN` (warnings below).
    pub health: &'static str,
    /// What an operator should act on, one sentence each.
    pub warnings: Vec<String>,
    /// Every registered host, by id.
    pub hosts: Vec<HostStatus>,
    /// Memory over all hosts.
    pub memory: MemoryStatus,
    /// The namespace's contents.
    pub regions: RegionCounts,
}

#[derive(Debug, Clone, Serialize)]
/// The manager's address and responsiveness.
pub struct ManagerStatus {
    /// The URL it was reached at.
    pub address: String,
    /// Milliseconds the manager took to answer the status requests.
    pub response_ms: f64,
    /// Namespace and region requests answered since it started.
    pub file_requests: u64,
}

#[derive(Debug, Clone, Serialize)]
/// One host: lease, transport and memory.
pub struct HostStatus {
    /// The host's id.
    pub host_id: u32,
    /// Whether its lease is current.
    pub live: bool,
    /// Milliseconds until the lease expires (0 when expired).
    pub lease_remaining_ms: u64,
    /// The data transports it serves (`tcp`, `tcp rdma:rxe0`).
    pub transport: String,
    /// Where its transport listens.
    pub transport_address: String,
    /// Its host agent's Unix socket.
    pub agent_socket: String,
    /// Bytes it offers to pools.
    pub memory_offered: u64,
    /// Bytes in its pools (pools grow on demand up to the offer).
    pub pool_bytes: u64,
    /// Bytes allocated to regions.
    pub used_bytes: u64,
    /// Bytes in pools not allocated.
    pub free_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
/// Memory over all hosts, in bytes.
pub struct MemoryStatus {
    /// Offered by the daemons.
    pub offered: u64,
    /// Bytes in its pools (pools grow on demand up to the offer).
    pub pool_bytes: u64,
    /// Bytes allocated to regions.
    pub used_bytes: u64,
    /// Bytes in pools not allocated.
    pub free_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
/// Counts of the namespace.
pub struct RegionCounts {
    /// Regions (files).
    pub regions: u64,
    /// Sum of their sizes.
    pub region_bytes: u64,
    /// Directories.
    pub directories: u64,
    /// Handles open at the manager.
    pub open_handles: u64,
    /// Regions lost with their host's memory.
    pub lost: u64,
}

impl Status {
    /// Asks the manager.
    pub fn gather(manager: &ManagerClient) -> regions::Result<Status> {
        let started = Instant::now();
        let hosts = manager.list_hosts()?;
        let stats = manager.stats()?;
        Ok(Status::from_replies(
            manager.addr(),
            started.elapsed(),
            &hosts,
            &stats,
        ))
    }

    /// The status the replies describe (separate from [`Status::gather`] for tests).
    pub fn from_replies(
        address: &str,
        response: Duration,
        hosts: &[v1::HostRecord],
        stats: &v1::StatsReply,
    ) -> Status {
        let mut hosts: Vec<HostStatus> = hosts
            .iter()
            .map(|h| HostStatus {
                host_id: h.host_id,
                live: h.live,
                lease_remaining_ms: h.lease_remaining_ms,
                transport: if h.transports.is_empty() {
                    "tcp".to_owned()
                } else {
                    h.transports.clone()
                },
                transport_address: h.transport_addr.clone(),
                agent_socket: h.agent_socket.clone(),
                memory_offered: h.memory_offered,
                pool_bytes: h.pool_bytes,
                used_bytes: h.pool_bytes.saturating_sub(h.free_bytes),
                free_bytes: h.free_bytes,
            })
            .collect();
        hosts.sort_by_key(|h| h.host_id);
        let mut warnings = Vec::new();
        if hosts.is_empty() {
            warnings.push(
                "no host has registered: start regions-daemon on each host (--manager pointing here)"
                    .to_owned(),
            );
        }
        for h in hosts.iter().filter(|h| !h.live) {
            warnings.push(format!(
                "host {} ({}) has an expired lease: its daemon is down or cut off; its regions answer EIO until it is back",
                h.host_id, h.transport_address
            ));
        }
        for h in hosts.iter().filter(|h| h.live && near_full(h)) {
            warnings.push(format!(
                "host {} is near full: {} of {} free; offer more memory (--memory) or remove regions",
                h.host_id,
                bytes(h.free_bytes),
                bytes(h.pool_bytes.max(h.memory_offered))
            ));
        }
        if stats.lost_regions > 0 {
            warnings.push(format!(
                "{} region(s) lost (their host restarted): reading them gives EIO; unlink them",
                stats.lost_regions
            ));
        }
        let memory = MemoryStatus {
            offered: hosts.iter().map(|h| h.memory_offered).sum(),
            pool_bytes: stats.total_bytes,
            used_bytes: stats.total_bytes.saturating_sub(stats.free_bytes),
            free_bytes: stats.free_bytes,
        };
        Status {
            manager: ManagerStatus {
                address: address.to_owned(),
                response_ms: response.as_secs_f64() * 1e3,
                file_requests: stats.file_requests,
            },
            health: if warnings.is_empty() {
                "HEALTH_OK"
            } else {
                "HEALTH_WARN"
            },
            warnings,
            hosts,
            memory,
            regions: RegionCounts {
                regions: stats.regions,
                region_bytes: stats.region_bytes,
                directories: stats.directories,
                open_handles: stats.open_handles,
                lost: stats.lost_regions,
            },
        }
    }

    /// For people, like `ceph -s`.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "cluster:");
        let _ = writeln!(out, "  health:  {}", self.health);
        for w in &self.warnings {
            let _ = writeln!(out, "           {w}");
        }
        let _ = writeln!(
            out,
            "  manager: {} (answered in {:.1} ms, {} file requests served)",
            self.manager.address, self.manager.response_ms, self.manager.file_requests
        );
        let live = self.hosts.iter().filter(|h| h.live).count();
        let _ = writeln!(out, "\nhosts: {} ({live} live)", self.hosts.len());
        for h in &self.hosts {
            let lease = if h.live {
                format!("live, lease {:.1} s", h.lease_remaining_ms as f64 / 1e3)
            } else {
                "EXPIRED".to_owned()
            };
            let _ = writeln!(
                out,
                "  host {:<4} {:<22} {:<20} {} {}  offered {}, used {}, free {}",
                h.host_id,
                h.transport_address,
                lease,
                h.transport,
                h.agent_socket,
                bytes(h.memory_offered),
                bytes(h.used_bytes),
                bytes(h.free_bytes)
            );
        }
        let m = &self.memory;
        let used_pct = if m.pool_bytes > 0 {
            m.used_bytes as f64 * 100.0 / m.pool_bytes as f64
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "\nmemory: {} offered, {} in pools, {} used ({used_pct:.0}%), {} free",
            bytes(m.offered),
            bytes(m.pool_bytes),
            bytes(m.used_bytes),
            bytes(m.free_bytes)
        );
        let r = &self.regions;
        let _ = writeln!(
            out,
            "regions: {} ({}), {} directories, {} open handles, {} lost",
            r.regions,
            bytes(r.region_bytes),
            r.directories,
            r.open_handles,
            r.lost
        );
        out
    }

    /// For scripts.
    pub fn render_json(&self) -> String {
        // Serialising plain structs of numbers and strings cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

fn near_full(h: &HostStatus) -> bool {
    // Pools grow on demand up to what the host offers: measure against the offer.
    let capacity = h.pool_bytes.max(h.memory_offered);
    let free = capacity.saturating_sub(h.used_bytes);
    capacity > 0 && (free as f64) < capacity as f64 * NEAR_FULL_FREE_FRACTION
}

/// Bytes with a binary unit.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(id: u32, live: bool, pool: u64, free: u64) -> v1::HostRecord {
        v1::HostRecord {
            host_id: id,
            transport_addr: format!("10.0.0.{id}:7171"),
            agent_socket: "/run/regions/agent.sock".into(),
            memory_offered: 1 << 30,
            incarnation: 1,
            live,
            lease_remaining_ms: if live { 9_000 } else { 0 },
            pool_bytes: pool,
            free_bytes: free,
            transports: if id == 2 {
                "tcp rdma:mlx5_0".into()
            } else {
                String::new()
            },
        }
    }

    #[test]
    fn a_healthy_cluster_has_no_warnings() {
        let stats = v1::StatsReply {
            hosts: 2,
            live_hosts: 2,
            total_bytes: 2 << 30,
            free_bytes: 1 << 30,
            regions: 3,
            region_bytes: 5 << 20,
            ..Default::default()
        };
        let s = Status::from_replies(
            "http://m:7070",
            Duration::from_millis(2),
            &[
                host(2, true, 1 << 30, 1 << 29),
                host(1, true, 1 << 30, 1 << 29),
            ],
            &stats,
        );
        assert_eq!(s.health, "HEALTH_OK");
        assert_eq!(s.hosts[0].host_id, 1, "sorted by host id");
        assert_eq!(s.hosts[0].used_bytes, 1 << 29);
        let text = s.render_text();
        assert!(text.contains("hosts: 2 (2 live)"), "{text}");
        assert!(text.contains("regions: 3 (5.0 MiB)"), "{text}");
        let json: serde_json::Value = serde_json::from_str(&s.render_json()).expect("valid JSON");
        assert_eq!(json["health"], "HEALTH_OK");
        assert_eq!(json["hosts"][1]["free_bytes"], 1u64 << 29);
    }

    #[test]
    fn expired_leases_full_hosts_and_lost_regions_are_warnings() {
        let stats = v1::StatsReply {
            lost_regions: 2,
            ..Default::default()
        };
        let s = Status::from_replies(
            "http://m:7070",
            Duration::ZERO,
            &[host(1, false, 0, 0), host(2, true, 1 << 30, 1 << 20)],
            &stats,
        );
        assert_eq!(s.health, "HEALTH_WARN");
        assert_eq!(s.warnings.len(), 3, "{:?}", s.warnings);
        assert!(s.warnings[0].contains("host 1") && s.warnings[0].contains("expired"));
        assert!(s.warnings[1].contains("host 2 is near full"));
        assert!(s.warnings[2].contains("2 region(s) lost"));
        assert!(s.render_text().contains("EXPIRED"));
    }

    #[test]
    fn byte_counts_read_as_people_write_them() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }
}
