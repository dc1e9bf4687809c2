//! `regions-soft-roce [--timeout SECS] COMMAND`: runs the shell command COMMAND in the
//! soft-RoCE VM ([`regions_tests::soft_roce`]: Debian's kernel under qemu with `rdma_rxe`, the
//! device `rxe0`, this machine's files read-only and `/tmp` writable), prints what it printed,
//! and exits with its status. `benches/rdma-vm.sh` runs the benches with it.

use std::process::ExitCode;
use std::time::Duration;

use regions_tests::soft_roce;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut timeout = Duration::from_secs(1800);
    if args.first().map(String::as_str) == Some("--timeout") {
        match args.get(1).and_then(|s| s.parse::<u64>().ok()) {
            Some(secs) => timeout = Duration::from_secs(secs),
            None => {
                eprintln!("regions-soft-roce: --timeout takes a number of seconds");
                return ExitCode::from(2);
            }
        }
        args.drain(..2);
    }
    if args.is_empty() {
        eprintln!("usage: regions-soft-roce [--timeout SECS] COMMAND");
        return ExitCode::from(2);
    }
    match soft_roce::run(&args.join(" "), timeout) {
        Ok(out) => {
            print!("{out}");
            let status = out
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix("soft-roce: script exit "))
                .and_then(|s| s.trim().parse::<u8>().ok())
                .unwrap_or(1);
            ExitCode::from(status)
        }
        Err(e) => {
            eprintln!("regions-soft-roce: {e:#}");
            ExitCode::FAILURE
        }
    }
}
