//! A separate OS process for the mapping tests: maps a region file through `regions::mapping`
//! (userfaultfd for remote chunks, the segment memfd for local ones) and answers commands on
//! stdin, one per line, with one line on stdout each:
//!
//! ```text
//! regions-map-helper PATH ro|rw
//!   base            -> "0x…" the mapping's base address
//!   r OFFSET        -> the u64 at OFFSET (read through the mapping)
//!   w OFFSET VALUE  -> "ok" after storing the u64 VALUE at OFFSET
//!   sync            -> "ok" after rmsync of the whole mapping
//!   clear           -> "ok" after rclearcache of the whole mapping
//!   sum OFFSET LEN  -> the wrapping sum of the u64 words of [OFFSET, OFFSET + LEN)
//!   clearrange OFFSET LEN -> "ok" after rclearcache of [OFFSET, OFFSET + LEN)
//! ```
//!
//! The process starts by printing "ready". An access that cannot be served kills it with
//! SIGBUS, which is what the tests look for.

use std::io::{BufRead, Write};
use std::os::fd::AsFd;

use anyhow::{Context, bail};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(path), Some(mode)) = (args.first(), args.get(1)) else {
        bail!("usage: regions-map-helper PATH ro|rw");
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(mode == "rw")
        .open(path)
        .with_context(|| format!("cannot open {path}"))?;
    let m = regions::mapping::map_fd(file.as_fd())?;
    let base = m.base();
    let mut out = std::io::stdout();
    writeln!(out, "ready")?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let offset = |i: usize| -> anyhow::Result<usize> {
            let off: usize = words.get(i).context("missing offset")?.parse()?;
            if off + 8 > m.len() || !off.is_multiple_of(8) {
                bail!(
                    "offset {off} is not an aligned word inside {} bytes",
                    m.len()
                );
            }
            Ok(off)
        };
        let range = |words: &[&str]| -> anyhow::Result<(usize, usize)> {
            let off: usize = words.get(1).context("missing offset")?.parse()?;
            let len: usize = words.get(2).context("missing length")?.parse()?;
            if off.checked_add(len).is_none_or(|end| end > m.len())
                || !off.is_multiple_of(4096)
                || !len.is_multiple_of(8)
            {
                bail!(
                    "{off}+{len} is not a page-aligned range inside {} bytes",
                    m.len()
                );
            }
            Ok((off, len))
        };
        match words.first().copied() {
            Some("base") => writeln!(out, "{base:p}")?,
            Some("r") => {
                let off = offset(1)?;
                // SAFETY: `off` is an aligned word inside the live mapping.
                let v = unsafe { std::ptr::read_volatile(base.add(off).cast::<u64>()) };
                writeln!(out, "{v}")?;
            }
            Some("w") => {
                let off = offset(1)?;
                let v: u64 = words.get(2).context("missing value")?.parse()?;
                // SAFETY: as above; the mapping is writable in rw mode.
                unsafe { std::ptr::write_volatile(base.add(off).cast::<u64>(), v) };
                writeln!(out, "ok")?;
            }
            Some("sync") => {
                m.msync(base, m.len())?;
                writeln!(out, "ok")?;
            }
            Some("clear") => {
                m.clearcache(base, m.len())?;
                writeln!(out, "ok")?;
            }
            Some("sum") => {
                let (off, len) = range(&words)?;
                let mut sum = 0u64;
                for o in (off..off + len).step_by(8) {
                    // SAFETY: `o` is an aligned word inside the live mapping (range checked).
                    sum = sum.wrapping_add(unsafe {
                        std::ptr::read_volatile(base.add(o).cast::<u64>())
                    });
                }
                writeln!(out, "{sum}")?;
            }
            Some("clearrange") => {
                let (off, len) = range(&words)?;
                // SAFETY: `off` is inside the mapping (range checked); only an address is formed.
                m.clearcache(unsafe { base.add(off) }, len)?;
                writeln!(out, "ok")?;
            }
            Some("quit") | None => break,
            Some(other) => bail!("unknown command {other}"),
        }
        out.flush()?;
    }
    Ok(())
}
