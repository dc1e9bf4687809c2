//! A region owner for the lifetime tests: a separate OS process that creates regions bound
//! to itself through a host agent, then lives until its stdin ends.
//!
//! ```text
//! regions-owner-helper SOCKET NAME=PERSISTENT...
//! ```
//!
//! Each `NAME=1` (persistent) or `NAME=0` becomes a 1 MiB region under the root, created with
//! `OwnerCreate`; prints `created NAME INO` for each, then `ready`, then waits for stdin to
//! end (the test ends it, or kills the process, to end the owner).

use std::path::Path;

use anyhow::{Context, bail};
use regions::agent::AgentClient;
use regions_proto::{ROOT_INO, v1};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(socket) = args.next() else {
        bail!("usage: regions-owner-helper SOCKET NAME=PERSISTENT...");
    };
    let mut agent = AgentClient::connect(Path::new(&socket))
        .with_context(|| format!("cannot connect to the host agent at {socket}"))?;
    for spec in args {
        let (name, persistent) = spec
            .split_once('=')
            .with_context(|| format!("{spec:?} is not NAME=0 or NAME=1"))?;
        let attrs = v1::RegionAttrOverrides {
            persistent: Some(persistent == "1"),
            ..Default::default()
        };
        let attr = agent
            .create_owned(ROOT_INO, name, 0o644, Some(attrs), 1 << 20)
            .with_context(|| format!("cannot create {name}"))?;
        println!("created {name} {}", attr.ino);
    }
    println!("ready");
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
    Ok(())
}
