//! Hosts in network namespaces, for tests that cut links.
//!
//! [`Topology::create`] makes a hub namespace holding a bridge, and one namespace per host
//! joined to the bridge by a veth pair, all on a private /24 that exists only inside these
//! namespaces (nothing is added to the caller's namespace). Names carry this process's pid and
//! a count, so concurrent runs and tests do not collide, and dropping the value deletes every
//! namespace (their veth ends and the bridge go with them). Processes are started in a namespace with
//! `nsenter --net=/run/netns/NAME` ([`Topology::wrapper`]): only the network namespace changes,
//! so FUSE mounts made there are visible to everyone.

use std::ffi::OsString;
use std::process::Command;

use anyhow::{Context, bail};

/// The subnet's first three octets (inside the namespaces only).
const SUBNET: &str = "10.77.0";

/// Runs `ip ARGS`; fails with its stderr.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run `ip` (install iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A hub namespace with a bridge and `hosts` host namespaces joined to it.
pub struct Topology {
    /// The hub namespace (holds the bridge at `SUBNET.1`).
    pub hub: String,
    /// Host namespaces; host `i` (1-based) is `hosts[i - 1]`.
    pub hosts: Vec<String>,
    /// Namespaces made so far (deleted on drop, also after a failed create).
    made: Vec<String>,
}

impl Topology {
    /// Creates the namespaces, the bridge and the veth pairs, and brings them up.
    pub fn create(hosts: u32) -> anyhow::Result<Topology> {
        // Unique per topology: tests of one binary run at once, in one process.
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("rg{}n{n}", std::process::id());
        let mut t = Topology {
            hub: format!("{tag}hub"),
            hosts: (1..=hosts).map(|h| format!("{tag}h{h}")).collect(),
            made: Vec::new(),
        };
        for ns in std::iter::once(t.hub.clone()).chain(t.hosts.clone()) {
            ip(&["netns", "add", &ns])?;
            t.made.push(ns.clone());
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        let hub = t.hub.clone();
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&[
            "-n",
            &hub,
            "addr",
            "add",
            &format!("{SUBNET}.1/24"),
            "dev",
            "br0",
        ])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for h in 1..=hosts {
            let ns = t.hosts[h as usize - 1].clone();
            let port = Topology::port(h);
            ip(&[
                "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", t.addr(h)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(t)
    }

    /// The hub's bridge port of host `h`'s link.
    fn port(h: u32) -> String {
        format!("v{h}")
    }

    /// The hub's address (for a manager started there).
    pub fn hub_addr(&self) -> String {
        format!("{SUBNET}.1")
    }

    /// Host `h`'s address.
    pub fn addr(&self, h: u32) -> String {
        format!("{SUBNET}.{}", 10 + h)
    }

    /// The command prefix that runs a program in namespace `ns`.
    pub fn wrapper(ns: &str) -> Vec<OsString> {
        vec!["nsenter".into(), format!("--net=/run/netns/{ns}").into()]
    }

    /// The prefix for the hub.
    pub fn hub_wrapper(&self) -> Vec<OsString> {
        Topology::wrapper(&self.hub)
    }

    /// The prefix for host `h`.
    pub fn host_wrapper(&self, h: u32) -> Vec<OsString> {
        Topology::wrapper(&self.hosts[h as usize - 1])
    }

    /// Cuts (`cut`) or restores the path between host `h` and the hub (where the manager
    /// runs) alone: the hub drops what it would send to the host, so the host's requests
    /// and heartbeats go unanswered, while the hosts still reach each other across the
    /// bridge. No RST reaches either side.
    pub fn cut_from_hub(&self, h: u32, cut: bool) -> anyhow::Result<()> {
        let to = format!("{}/32", self.addr(h));
        ip(&[
            "-n",
            &self.hub,
            "route",
            if cut { "add" } else { "del" },
            "blackhole",
            &to,
        ])
    }

    /// Cuts (`up == false`) or restores host `h`'s link to the bridge. A cut drops packets
    /// silently: no RST reaches either side.
    pub fn set_link(&self, h: u32, up: bool) -> anyhow::Result<()> {
        ip(&[
            "-n",
            &self.hub,
            "link",
            "set",
            &Topology::port(h),
            if up { "up" } else { "down" },
        ])
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in self.made.drain(..).rev() {
            if let Err(e) = ip(&["netns", "del", &ns]) {
                eprintln!("cannot delete network namespace {ns}: {e}");
            }
        }
    }
}
