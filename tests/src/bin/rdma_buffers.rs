//! `regions-rdma-buffers [DEVICE]`: which way the RDMA transport should move bytes between the
//! application's buffer and the network, measured on a real device (run by
//! `benches/rdma-vm.sh` in the soft-RoCE VM). The transport posts every READ and WRITE through
//! a registered bounce buffer and copies to or from the caller's buffer; the alternative is to
//! register the caller's buffer for each request. Both pay the transfer; the bounce buffer
//! adds a `memcpy` of the bytes, registration adds `ibv_reg_mr` + `ibv_dereg_mr` of the
//! caller's pages. For each size this prints the median of each, and of the one-sided READ
//! itself (two queue pairs of this process connected to each other), so the three can be
//! compared in one run.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use regions_verbs::{Access, Device, Local, Op, QueuePair, RegisteredBuffer, Registration, Remote};

const SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 4 << 20];

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn main() -> ExitCode {
    let device = std::env::args().nth(1).unwrap_or_else(|| "rxe0".into());
    match run(&device) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("regions-rdma-buffers: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(device: &str) -> anyhow::Result<()> {
    let pd = Device::open(Some(device), 0)?.protection_domain()?;
    let max = *SIZES.iter().max().context("sizes")?;
    // The "remote" memory: a registration other queue pairs read, as a daemon's chunk.
    let mut remote_mem = vec![7u8; max];
    // SAFETY: `remote_mem` outlives the registration (dropped at the end of this function,
    // after it) and is not moved or resized meanwhile.
    let remote =
        unsafe { Registration::register(&pd, remote_mem.as_mut_ptr(), max, Access::REMOTE) }?;
    let mut bounce = RegisteredBuffer::new(&pd, max)?;
    let mut a = QueuePair::create(&pd, 16)?;
    let mut b = QueuePair::create(&pd, 16)?;
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb)?;
    b.connect(&ea)?;
    let src = vec![1u8; max];
    let mut app = vec![0u8; max];
    println!("device {device}: medians in microseconds");
    println!(
        "{:>8}  {:>10}  {:>10}  {:>14}  {:>22}",
        "bytes", "READ", "memcpy", "reg + dereg", "reg+dereg / memcpy"
    );
    for &n in &SIZES {
        let iters = if n >= 1 << 20 { 40 } else { 200 };
        let mut read = Vec::with_capacity(iters);
        let mut copy = Vec::with_capacity(iters);
        let mut reg = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            a.execute(
                &mut bounce,
                &[Op::Read {
                    local: Local { offset: 0, len: n },
                    remote: Remote {
                        addr: remote.addr(),
                        rkey: remote.rkey(),
                    },
                }],
                Duration::from_secs(10),
            )?;
            read.push(t.elapsed());
            let t = Instant::now();
            app[..n].copy_from_slice(&src[..n]);
            std::hint::black_box(&app);
            copy.push(t.elapsed());
            let t = Instant::now();
            // SAFETY: `app` outlives the registration, dropped at the end of this statement.
            let r = unsafe { Registration::register(&pd, app.as_mut_ptr(), n, Access::LOCAL) }?;
            drop(r);
            reg.push(t.elapsed());
        }
        let (read, copy, reg) = (median(read), median(copy), median(reg));
        println!(
            "{n:>8}  {:>10}  {:>10}  {:>14}  {:>22.1}",
            us(read),
            us(copy),
            us(reg),
            reg.as_secs_f64() / copy.as_secs_f64().max(1e-9)
        );
    }
    println!(
        "the transport keeps the bounce buffer where registering costs more than copying \
         (ratio > 1)"
    );
    drop(remote);
    drop(remote_mem);
    Ok(())
}
