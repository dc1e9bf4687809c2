//! Barriers, mutexes and doorbells through the host agent (`SyncCall` in agent.proto): each
//! call is forwarded to the manager's `Sync` service as the caller `SO_PEERCRED` verified.
//!
//! Waiting calls (barrier wait, mutex lock, doorbell wait) block only their own connection's
//! thread (the agent serves each connection on a thread of its own) and have no deadline; while
//! one waits, the agent watches the caller's socket and abandons the manager call as soon as
//! the caller hangs up, so the manager drops the waiter. Every process that touches a mutex is
//! watched with a pidfd; when it exits, the agent tells the manager (`Sync.ReleaseDead`), which
//! releases whatever mutex it still held.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use regions_proto::auth::AttachSecret;
use regions_proto::v1::{
    self, AgentReply, Caller, SyncCall, SyncOp, SyncResult, agent_reply::Body,
    sync_client::SyncClient,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::agent::owners::OwnerWatch;
use crate::error::DaemonError;
use crate::manager_client::{ManagerClients, request};

type Client = SyncClient<InterceptedService<Channel, AttachSecret>>;

/// The agent's side of the Sync service: a manager client and the watch on mutex users.
pub struct SyncAgent {
    client: Client,
    runtime: tokio::runtime::Handle,
    watch: OwnerWatch,
}

impl std::fmt::Debug for SyncAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncAgent").finish_non_exhaustive()
    }
}

impl SyncAgent {
    /// Starts the pid watcher; calls go to the manager of `clients` on `runtime`.
    pub fn start(
        clients: &ManagerClients,
        runtime: tokio::runtime::Handle,
        host_id: u32,
    ) -> io::Result<SyncAgent> {
        let client = clients.sync.clone();
        let on_exit = {
            let client = client.clone();
            let runtime = runtime.clone();
            Arc::new(move |pid: u32| {
                let mut client = client.clone();
                let req = v1::ReleaseDeadRequest {
                    caller: Some(Caller {
                        host_id,
                        pid,
                        ..Caller::default()
                    }),
                    pids: vec![pid],
                };
                match runtime.block_on(client.release_dead(request(req))) {
                    Ok(r) => {
                        if r.get_ref().value > 0 {
                            tracing::info!(
                                pid,
                                released = r.get_ref().value,
                                "a mutex holder exited; the manager released its mutexes"
                            );
                        }
                        true
                    }
                    Err(s) => {
                        tracing::warn!(pid, error = %s, "cannot tell the manager that a mutex user exited; retrying");
                        false
                    }
                }
            })
        };
        Ok(SyncAgent {
            client,
            runtime,
            watch: OwnerWatch::start(on_exit)?,
        })
    }
}

fn reply_of(result: Result<SyncResult, DaemonError>) -> AgentReply {
    match result {
        Ok(r) => AgentReply {
            errno: 0,
            message: String::new(),
            body: Some(Body::Sync(r)),
        },
        Err(e) => AgentReply {
            errno: e.errno(),
            message: e.to_string(),
            body: None,
        },
    }
}

/// Answers a sync call of `caller`; `peer` is its connection (watched for hang-ups while the
/// call waits).
pub fn handle(
    sync: Option<&SyncAgent>,
    caller: &Caller,
    call: SyncCall,
    peer: Option<&UnixStream>,
) -> AgentReply {
    let Some(agent) = sync else {
        return reply_of(Err(DaemonError::Invalid(
            "this host agent does not forward sync calls (no manager)".into(),
        )));
    };
    reply_of(forward(agent, caller, call, peer))
}

fn forward(
    agent: &SyncAgent,
    caller: &Caller,
    call: SyncCall,
    peer: Option<&UnixStream>,
) -> Result<SyncResult, DaemonError> {
    let op = SyncOp::try_from(call.op).unwrap_or(SyncOp::Unspecified);
    if matches!(
        op,
        SyncOp::MutexLocate | SyncOp::MutexLock | SyncOp::MutexUnlock
    ) {
        agent.watch.watch(caller.pid);
    }
    let name = v1::SyncNameRequest {
        caller: Some(caller.clone()),
        name: call.name.clone(),
        tid: call.tid,
        generation: call.generation,
        mode: call.mode,
    };
    let mut c = agent.client.clone();
    let value = |r: Result<tonic::Response<v1::SyncReply>, tonic::Status>| {
        r.map(|r| SyncResult {
            value: r.into_inner().value,
            location: None,
        })
    };
    // Waits have no deadline: they end when they complete or the caller hangs up.
    let wait = tonic::Request::new;
    let call_fut = async move {
        match op {
            SyncOp::BarrierInit => value(
                c.barrier_init(request(v1::BarrierInitRequest {
                    caller: name.caller,
                    name: name.name,
                    n: call.n,
                    mode: call.mode,
                }))
                .await,
            ),
            SyncOp::BarrierWait => value(c.barrier_wait(wait(name)).await),
            SyncOp::MutexInit => value(c.mutex_init(request(name)).await),
            SyncOp::MutexLock => value(c.mutex_lock(wait(name)).await),
            SyncOp::MutexUnlock => value(c.mutex_unlock(request(name)).await),
            SyncOp::BellInit => value(c.bell_init(request(name)).await),
            SyncOp::BellRing => value(c.bell_ring(request(name)).await),
            SyncOp::BellWait => value(c.bell_wait(wait(name)).await),
            SyncOp::Delete => value(c.delete(request(name)).await),
            SyncOp::MutexLocate => c.mutex_locate(request(name)).await.map(|r| SyncResult {
                value: 0,
                location: Some(r.into_inner()),
            }),
            SyncOp::BarrierLocate => c.barrier_locate(request(name)).await.map(|r| SyncResult {
                value: 0,
                location: Some(r.into_inner()),
            }),
            SyncOp::BarrierSleep => value(c.barrier_sleep(wait(name)).await),
            SyncOp::BarrierWake => value(c.barrier_wake(request(name)).await),
            SyncOp::Unspecified => Err(tonic::Status::invalid_argument(
                "sync call without an operation",
            )),
        }
    };
    let hangup = match peer.map(UnixStream::try_clone).transpose() {
        Ok(p) => p,
        Err(e) => return Err(DaemonError::sys("cannot watch the caller's socket", e)),
    };
    let outcome = agent.runtime.block_on(async move {
        tokio::select! {
            r = call_fut => Some(r),
            () = caller_gone(hangup) => None,
        }
    });
    match outcome {
        Some(r) => r.map_err(|s| DaemonError::from_status(&s)),
        None => {
            tracing::debug!(
                pid = caller.pid,
                name = %call.name,
                "caller hung up during a sync call; abandoned it"
            );
            Err(DaemonError::Invalid("the caller hung up".into()))
        }
    }
}

/// Resolves when the peer of `stream` has hung up (never, without a stream, or when the
/// peer sends more data: it is then not gone).
async fn caller_gone(stream: Option<UnixStream>) {
    let Some(stream) = stream else {
        return std::future::pending().await;
    };
    let fd: OwnedFd = stream.into();
    // SAFETY: `fd` is an open descriptor owned by the AsyncFd for its whole life, and an
    // OwnedFd always returns that same descriptor.
    let Ok(afd) = (unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }) else {
        return std::future::pending().await;
    };
    loop {
        let Ok(mut ready) = afd.readable().await else {
            return;
        };
        let mut byte = 0u8;
        // SAFETY: recv(2) into one valid byte of our stack; the fd is open (owned by afd).
        let n = unsafe {
            libc::recv(
                afd.get_ref().as_raw_fd(),
                (&raw mut byte).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return,
            n if n > 0 => return std::future::pending().await,
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::WouldBlock {
                    ready.clear_ready();
                } else {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hang_up_is_noticed_and_data_is_not_a_hang_up() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let gone = rt.spawn(caller_gone(Some(a.try_clone().unwrap())));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!gone.is_finished());
        drop(b);
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(5), gone)
                .await
                .expect("hang-up noticed")
                .unwrap()
        });
        let (a, b) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut &b, b"x").unwrap();
        let pending = rt.spawn(caller_gone(Some(a)));
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!pending.is_finished(), "pending data is not a hang-up");
        pending.abort();
    }
}
