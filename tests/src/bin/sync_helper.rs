//! A separate OS process for the sync tests: drives `regions::sync` through a host agent.
//!
//! ```text
//! regions-sync-helper barrier SOCKET NAME ROUNDS MANAGER SECRET_FILE HOST REGION
//! regions-sync-helper counter SOCKET NAME TIMES MANAGER SECRET_FILE HOST REGION [THREADS]
//! regions-sync-helper hold SOCKET NAME          (locks, prints "locked", sleeps)
//! regions-sync-helper lock-once SOCKET NAME     (locks, prints "locked", unlocks)
//! regions-sync-helper fenced SOCKET NAME REGION GONE KEPT
//! ```
//!
//! `fenced` plays a mutex holder whose host gets partitioned: it locks NAME, opens the region
//! file REGION through the host agent (a capability, as applications do) and writes
//! `holder-1` at 0, creates GONE through the mount and keeps it open, opens KEPT, prints
//! "ready", then answers one line per command read from stdin ("ok" or "err ERRNO"): `write`
//! (`holder-2` at 0 of REGION), `unlock`, `read-gone`, `read-kept`, `write-kept` (a page at 0
//! of KEPT through the mount, `O_DIRECT`, so the mount answers at once); `exit` ends it.
//!
//! `barrier`: every round adds 1 to the 8-byte word at offset 0 of REGION (fetch-add), waits
//! at the barrier, then checks that all parties of the round had arrived (the word is at least
//! parties × round) and prints the generation. `counter`: TIMES times, under the mutex, reads
//! the word at offset 0 of REGION, adds one and writes it back (not atomic by itself); with
//! THREADS, that many threads of this process each do so TIMES times, sharing one client.
//!
//! With `SYNC_HELPER_THROUGH_MANAGER=1` every sync call goes through the manager (no
//! transport fast path).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use regions::sync::SyncClient;
use regions::{Client, ClientConfig};
use regions_proto::auth::Secret;

fn region(manager: &str, secret: &str, host: &str, path: &str) -> anyhow::Result<regions::Region> {
    let secret = Secret::from_file(Path::new(secret))?;
    let client = Client::connect(ClientConfig::new(manager, secret, host.parse()?))?;
    let attr = client.lookup_path(path)?;
    Ok(client.open(attr.ino, true)?)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| -> anyhow::Result<&str> {
        args.get(i)
            .map(String::as_str)
            .with_context(|| format!("missing argument {i}; see the source for usage"))
    };
    let mut sync = SyncClient::connect(Path::new(arg(1)?));
    if std::env::var_os("SYNC_HELPER_THROUGH_MANAGER").is_some_and(|v| v == "1") {
        sync = sync.through_manager();
    }
    let name = arg(2)?;
    let mut out = std::io::stdout();
    match arg(0)? {
        "barrier" => {
            let rounds: u64 = arg(3)?.parse()?;
            let r = region(arg(4)?, arg(5)?, arg(6)?, arg(7)?)?;
            for round in 1..=rounds {
                r.fetch_add(0, 1)?;
                let generation = sync.barrier_wait(name)?;
                let mut word = [0u8; 8];
                r.read_at(0, &mut word)?;
                let arrived = u64::from_le_bytes(word);
                writeln!(out, "{round} {generation} {arrived}")?;
            }
        }
        "counter" => {
            let times: u64 = arg(3)?.parse()?;
            let threads: usize = args.get(8).map_or(Ok(1), |t| t.parse())?;
            let sync = &sync;
            std::thread::scope(|scope| -> anyhow::Result<()> {
                let workers: Vec<_> = (0..threads)
                    .map(|_| {
                        scope.spawn(move || -> anyhow::Result<()> {
                            let r = region(arg(4)?, arg(5)?, arg(6)?, arg(7)?)?;
                            for _ in 0..times {
                                sync.mutex_lock(name)?;
                                let mut word = [0u8; 8];
                                r.read_at(0, &mut word)?;
                                let v = u64::from_le_bytes(word) + 1;
                                r.write_at(0, &v.to_le_bytes())?;
                                sync.mutex_unlock(name)?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                for w in workers {
                    w.join()
                        .map_err(|_| anyhow::anyhow!("a counter thread panicked"))??;
                }
                Ok(())
            })?;
            writeln!(out, "done {}", sync.mutex_path(name)?)?;
        }
        "hold" => {
            sync.mutex_lock(name)?;
            writeln!(out, "locked")?;
            out.flush()?;
            std::thread::sleep(std::time::Duration::from_secs(600));
        }
        "lock-once" => {
            sync.mutex_lock(name)?;
            writeln!(out, "locked")?;
            out.flush()?;
            sync.mutex_unlock(name)?;
        }
        "fenced" => fenced(&sync, name, &args[3..])?,
        other => bail!("unknown command {other}"),
    }
    Ok(())
}

/// The `fenced` command (see the module docs).
fn fenced(sync: &SyncClient, name: &str, paths: &[String]) -> anyhow::Result<()> {
    use std::io::BufRead;
    use std::os::unix::fs::FileExt;

    let [region, gone, kept] = paths else {
        bail!("fenced needs REGION GONE KEPT");
    };
    sync.mutex_lock(name)?;
    let region = regions::Region::open_path(Path::new(region), true)?;
    region.write_at(0, b"holder-1")?;
    let gone = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(gone)
        .with_context(|| format!("cannot create {gone}"))?;
    gone.write_all_at(b"gone", 0)?;
    // Flushed: the kernel holds no dirty page of it (those stay cached until written back).
    gone.sync_data()?;
    let kept_direct = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(kept)
            .with_context(|| format!("cannot open {kept} for direct writes"))?
    };
    let kept = std::fs::File::open(kept).with_context(|| format!("cannot open {kept}"))?;
    /// One page, aligned for `O_DIRECT`.
    #[repr(C, align(4096))]
    struct Page([u8; 4096]);
    let page = Page([b'L'; 4096]);
    let mut out = std::io::stdout();
    writeln!(out, "ready")?;
    out.flush()?;
    let answer = |r: Result<(), i32>| match r {
        Ok(()) => "ok".to_owned(),
        Err(errno) => format!("err {errno}"),
    };
    let io = |r: std::io::Result<usize>| r.map(drop).map_err(|e| e.raw_os_error().unwrap_or(0));
    for line in std::io::stdin().lock().lines() {
        let mut buf = [0u8; 4];
        let reply = match line?.trim() {
            "write" => answer(region.write_at(0, b"holder-2").map_err(|e| e.errno())),
            "unlock" => answer(sync.mutex_unlock(name).map_err(|e| e.errno())),
            "read-gone" => answer(io(gone.read_at(&mut buf, 0))),
            "read-kept" => answer(io(kept.read_at(&mut buf, 0))),
            "write-kept" => answer(io(kept_direct.write_at(&page.0, 0))),
            "exit" => return Ok(()),
            other => format!("unknown {other}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}
