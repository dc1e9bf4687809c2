//! `regionfs compact [--host N]`: compacts the object stores of small regions now (every size
//! class of each daemon; docs/ARCHITECTURE.md, "Small regions as objects") and prints what
//! each host gave back. Daemons also compact on their own as frees leave a class sparse; this
//! is for an administrator who wants the memory back at once. It speaks to each daemon over
//! its transport with the cluster secret, so it needs that secret (root, usually).

use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use regions::RegionsError;
use regions::transport::tcp::{RetryPolicy, TcpTransport};
use regions_proto::frame::{ObjectCompaction, Request};

/// How long one host's compaction is waited for.
const COMPACTION_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// `regionfs compact`.
#[derive(Args, Debug)]
pub struct CompactArgs {
    #[command(flatten)]
    cluster: crate::cluster_access::ClusterAccess,
    /// Only this host (default: every live host).
    #[arg(long)]
    host: Option<u32>,
    #[command(flatten)]
    config: regions_proto::config::ConfigArgs,
}

/// One host's answer, as printed.
fn describe(host: u32, done: &ObjectCompaction) -> String {
    format!(
        "host {host}: freed {} bytes ({} blocks merged or emptied into others; {} objects \
         copied, {} of them to another slot or block)",
        done.bytes_freed, done.blocks_freed, done.objects_merged, done.objects_moved
    )
}

pub fn run(args: &CompactArgs) -> anyhow::Result<()> {
    let (manager, secret, url) = args.cluster.connect()?;
    let hosts = manager
        .list_hosts()
        .with_context(|| format!("the manager at {url} did not list its hosts"))?;
    let chosen: Vec<_> = hosts
        .iter()
        .filter(|h| args.host.is_none_or(|n| h.host_id == n))
        .filter(|h| h.live || args.host.is_some())
        .collect();
    if chosen.is_empty() {
        match args.host {
            Some(n) => anyhow::bail!(
                "the manager at {url} knows no host {n}: `regionfs status` lists the hosts"
            ),
            None => anyhow::bail!("the manager at {url} has no live host to compact"),
        }
    }
    let mut failed = 0;
    let mut compacted = 0;
    let mut total = 0u64;
    for h in &chosen {
        // A compaction of a large store can take a while: wait for it rather than report a
        // compaction that went on as failed.
        let patient = RetryPolicy {
            deadline: COMPACTION_WAIT,
            ..RetryPolicy::default()
        };
        let transport = TcpTransport::new(&h.transport_addr, &secret, patient, Arc::default());
        let answer = transport
            .request(&Request::ObjCompact, false)
            .and_then(|payload| {
                ObjectCompaction::decode(&payload)
                    .map_err(|e| RegionsError::Invalid(format!("host {}'s reply: {e}", h.host_id)))
            });
        match answer {
            Ok(done) => {
                compacted += 1;
                total += done.bytes_freed;
                println!("{}", describe(h.host_id, &done));
            }
            Err(e) if e.errno() == libc::EOPNOTSUPP => {
                println!(
                    "host {}: keeps no object store (its daemon runs with --object-memory 0)",
                    h.host_id
                );
            }
            Err(e) => {
                failed += 1;
                eprintln!(
                    "host {}: compaction failed at {}: {e}",
                    h.host_id, h.transport_addr
                );
            }
        }
    }
    if chosen.len() > 1 {
        println!("freed {total} bytes on {compacted} hosts");
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {} hosts could not be compacted", chosen.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hosts_answer_says_what_it_gave_back() {
        let done = ObjectCompaction {
            blocks_freed: 3,
            objects_merged: 40,
            objects_moved: 2,
            bytes_freed: 98_304,
        };
        assert_eq!(
            describe(7, &done),
            "host 7: freed 98304 bytes (3 blocks merged or emptied into others; 40 objects \
             copied, 2 of them to another slot or block)"
        );
    }
}
