//! `regionfs sync ...`: barriers, mutexes and doorbells from shell scripts on any host, through
//! the host agent of a regions mount (no cluster secret needed).
//!
//! ```sh
//! regionfs sync barrier start 3            # creates the barrier of 3 if needed, waits, prints the generation
//! regionfs sync lock --init job -- make    # runs `make` holding mutex `job`; exits with its status
//! regionfs sync init-bell done; regionfs sync ring done
//! regionfs sync wait done                  # prints the ring count
//! ```

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use regions::sync::SyncClient;

/// Options of `regionfs sync`.
#[derive(Args, Debug)]
pub struct SyncArgs {
    /// The regions mount whose host agent to use.
    #[arg(long, env = "REGIONS_MOUNT", default_value = "/regions")]
    mount: PathBuf,
    /// The host agent socket to use instead of asking the mount.
    #[arg(long, env = "REGIONS_AGENT_SOCKET")]
    agent_socket: Option<PathBuf>,
    /// Permission bits (octal) of objects this command creates, e.g. 0660 to share them with
    /// the group; default 0600 (yours only). An existing object keeps its mode.
    #[arg(long, value_parser = parse_mode)]
    mode: Option<u32>,
    #[command(subcommand)]
    command: SyncCommand,
}

#[derive(Subcommand, Debug)]
enum SyncCommand {
    /// Create barrier NAME of N parties (fine if it exists with the same N).
    InitBarrier { name: String, n: u32 },
    /// Create mutex NAME (fine if it exists).
    InitMutex { name: String },
    /// Create doorbell NAME (fine if it exists).
    InitBell { name: String },
    /// Wait at barrier NAME of N parties (created on first use); prints the generation.
    Barrier { name: String, n: u32 },
    /// Run CMD holding mutex NAME; exits with CMD's status.
    Lock {
        /// Create the mutex first if it does not exist.
        #[arg(long)]
        init: bool,
        name: String,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Ring doorbell NAME.
    Ring { name: String },
    /// Wait for a ring of doorbell NAME; prints the ring count. Each run is a new caller, so
    /// this returns at once if the bell ever rang: pass the count printed last time as
    /// --after to wait for a newer ring.
    Wait {
        name: String,
        #[arg(long, default_value_t = 0)]
        after: i64,
    },
    /// Delete barrier, mutex or doorbell NAME (its waiters fail).
    Delete { name: String },
}

fn parse_mode(text: &str) -> Result<u32, String> {
    u32::from_str_radix(text.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{text:?} is not an octal mode between 0 and 0777 (e.g. 0660)"))
}

fn hint(e: regions::RegionsError, what: &str, create: &str) -> anyhow::Error {
    let errno = e.errno();
    let advice = match errno {
        libc::ENOENT => format!(": no such object; create it first with `regionfs sync {create}`"),
        libc::EEXIST => ": the name is taken by another kind of object or other parameters; pick another name or `regionfs sync delete` it".to_owned(),
        _ => String::new(),
    };
    anyhow::anyhow!("{what} failed: {e}{advice}")
}

/// Runs a `regionfs sync` command; returns the process exit status.
pub fn run(args: SyncArgs) -> anyhow::Result<i32> {
    let client = match &args.agent_socket {
        Some(socket) => SyncClient::connect(socket),
        None => SyncClient::for_mount(Some(&args.mount)).with_context(|| {
            format!(
                "cannot find the host agent of {} (is it a regions mount? else pass --agent-socket)",
                args.mount.display()
            )
        })?,
    };
    let client = match args.mode {
        Some(mode) => client.with_mode(mode),
        None => client,
    };
    match args.command {
        SyncCommand::InitBarrier { name, n } => client
            .barrier_init(&name, n)
            .map_err(|e| hint(e, "init-barrier", "delete NAME"))?,
        SyncCommand::InitMutex { name } => client
            .mutex_init(&name)
            .map_err(|e| hint(e, "init-mutex", "delete NAME"))?,
        SyncCommand::InitBell { name } => client
            .bell_init(&name)
            .map_err(|e| hint(e, "init-bell", "delete NAME"))?,
        SyncCommand::Barrier { name, n } => {
            client
                .barrier_init(&name, n)
                .map_err(|e| hint(e, "barrier", "init-barrier NAME N"))?;
            let generation = client
                .barrier_wait(&name)
                .map_err(|e| hint(e, "barrier", "init-barrier NAME N"))?;
            println!("{generation}");
        }
        SyncCommand::Lock {
            init,
            name,
            command,
        } => {
            if init {
                client
                    .mutex_init(&name)
                    .map_err(|e| hint(e, "lock --init", "init-mutex NAME"))?;
            }
            client
                .mutex_lock(&name)
                .map_err(|e| hint(e, "lock", "init-mutex NAME"))?;
            let (program, rest) = command
                .split_first()
                .context("lock needs a command after --")?;
            let status = std::process::Command::new(program).args(rest).status();
            let unlocked = client.mutex_unlock(&name);
            let status = status.with_context(|| format!("cannot run {program}"))?;
            unlocked.map_err(|e| hint(e, "unlock", "init-mutex NAME"))?;
            use std::os::unix::process::ExitStatusExt;
            return Ok(status
                .code()
                .or_else(|| status.signal().map(|s| 128 + s))
                .unwrap_or(1));
        }
        SyncCommand::Ring { name } => client
            .bell_ring(&name)
            .map_err(|e| hint(e, "ring", "init-bell NAME"))?,
        SyncCommand::Wait { name, after } => {
            let mut count;
            loop {
                count = client
                    .bell_wait(&name)
                    .map_err(|e| hint(e, "wait", "init-bell NAME"))?;
                if count > after {
                    break;
                }
            }
            println!("{count}");
        }
        SyncCommand::Delete { name } => client
            .delete(&name)
            .map_err(|e| hint(e, "delete", "init-... NAME"))?,
    }
    Ok(0)
}
