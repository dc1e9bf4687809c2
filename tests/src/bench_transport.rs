//! The transport a bench runs on: `--transport tcp|rdma|auto` and `--rdma-device NAME` after
//! `cargo bench ... --` (or `BENCH_TRANSPORT`, `BENCH_RDMA_DEVICE`). Default tcp, the
//! benches' baseline; `rdma` needs a device (on this machine: the soft-RoCE VM of
//! `benches/rdma-vm.sh`, which shows correctness, not speed).
//!
//! Under `rdma` the bench's daemons serve RDMA on the device (`--transport rdma`), its
//! libregions clients use it ([`BenchTransport::apply`]), and so do the processes it starts
//! and the agent sessions and sync clients it makes (`REGIONS_TRANSPORT` and
//! `REGIONS_RDMA_DEVICE`, set by [`BenchTransport::export`]).

use anyhow::{Context, bail};
use regions::ClientConfig;
use regions_proto::transport_choice::TransportChoice;

/// The transport of one bench run.
#[derive(Clone, Debug)]
pub struct BenchTransport {
    pub choice: TransportChoice,
    pub device: Option<String>,
}

impl BenchTransport {
    /// From the command line (`--transport X`, `--rdma-device Y`), else the environment.
    pub fn from_args() -> anyhow::Result<BenchTransport> {
        let args: Vec<String> = std::env::args().collect();
        let flag = |name: &str| -> anyhow::Result<Option<String>> {
            match args.iter().position(|a| a == name) {
                Some(i) => args
                    .get(i + 1)
                    .cloned()
                    .map(Some)
                    .with_context(|| format!("{name} needs a value")),
                None => Ok(None),
            }
        };
        let choice = match flag("--transport")?.or_else(|| std::env::var("BENCH_TRANSPORT").ok()) {
            Some(c) => c.parse::<TransportChoice>().map_err(anyhow::Error::msg)?,
            None => TransportChoice::Tcp,
        };
        let device = flag("--rdma-device")?
            .or_else(|| std::env::var("BENCH_RDMA_DEVICE").ok())
            .filter(|d| !d.is_empty());
        if choice == TransportChoice::Auto {
            bail!("a bench runs on tcp or rdma, not auto (say which one is measured)");
        }
        Ok(BenchTransport { choice, device })
    }

    pub fn is_rdma(&self) -> bool {
        self.choice == TransportChoice::Rdma
    }

    /// Arguments for the bench's daemons.
    pub fn daemon_args(&self) -> Vec<&str> {
        let mut args = vec!["--transport", self.choice.name()];
        if let Some(d) = &self.device {
            args.extend(["--rdma-device", d.as_str()]);
        }
        args
    }

    /// Makes `config` use this transport.
    pub fn apply(&self, config: &mut ClientConfig) {
        config.transport = self.choice;
        config.rdma_device.clone_from(&self.device);
    }

    /// Sets `REGIONS_TRANSPORT` (and `REGIONS_RDMA_DEVICE`) for this process and those it
    /// starts. Call before any other thread runs.
    pub fn export(&self) {
        // SAFETY: called at the start of a bench's main thread, before it starts others.
        unsafe {
            std::env::set_var("REGIONS_TRANSPORT", self.choice.name());
            match &self.device {
                Some(d) => std::env::set_var("REGIONS_RDMA_DEVICE", d),
                None => std::env::remove_var("REGIONS_RDMA_DEVICE"),
            }
        }
    }

    /// "tcp", or "rdma on DEVICE".
    pub fn describe(&self) -> String {
        match (self.choice, &self.device) {
            (TransportChoice::Rdma, Some(d)) => format!("rdma on {d}"),
            (c, _) => c.name().to_owned(),
        }
    }
}
