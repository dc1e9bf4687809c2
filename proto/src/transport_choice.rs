//! Which data transport a component uses to reach daemons (`--transport`, env
//! `REGIONS_TRANSPORT`), shared by the daemon, regionfs and libregions.

use std::fmt;
use std::str::FromStr;

/// `auto`: RDMA where this host and the daemon both have a device on a common fabric, else
/// tcp; `tcp`: tcp only; `rdma`: RDMA only (an error where it cannot be set up).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportChoice {
    #[default]
    Auto,
    Tcp,
    Rdma,
}

impl TransportChoice {
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Rdma => "rdma",
        }
    }
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "rdma" => Ok(TransportChoice::Rdma),
            other => Err(format!(
                "unknown transport {other:?}: choose auto, tcp or rdma"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TransportChoice;

    #[test]
    fn choices_parse_and_print_alike() {
        for c in [
            TransportChoice::Auto,
            TransportChoice::Tcp,
            TransportChoice::Rdma,
        ] {
            assert_eq!(c.name().parse::<TransportChoice>(), Ok(c));
        }
        assert_eq!(
            " RDMA ".parse::<TransportChoice>(),
            Ok(TransportChoice::Rdma)
        );
        assert!("udp".parse::<TransportChoice>().is_err());
    }
}
