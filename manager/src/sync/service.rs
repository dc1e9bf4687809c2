//! The `Sync` gRPC service: a thin adapter from requests to [`SyncService`] calls, and from
//! their results to replies and statuses.

use regions_proto::v1::{self, sync_server::Sync};
use tonic::{Request, Response, Status};

use super::objects::SyncDef;
use super::runtime::SyncService;
use crate::access::{Caller, READ, WRITE};
use crate::error::Result;

/// Turns a manager result into a reply, logging refusals.
fn reply<T>(op: &'static str, result: Result<T>) -> Result<Response<T>, Status> {
    match result {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            tracing::debug!(op, error = %e, "sync request refused");
            Err(e.into())
        }
    }
}

fn value(v: u64) -> v1::SyncReply {
    v1::SyncReply {
        value: i64::try_from(v).unwrap_or(i64::MAX),
    }
}

fn caller(c: Option<&v1::Caller>) -> Result<Caller, Status> {
    Caller::from_proto(c).map_err(Status::from)
}

#[tonic::async_trait]
impl Sync for SyncService {
    async fn barrier_init(
        &self,
        r: Request<v1::BarrierInitRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let def = SyncDef::BarrierWord { n: r.n, offset: 0 };
        let result = self.init(&c, &r.name, def, r.mode).await;
        reply("barrier_init", result.map(|_| value(0)))
    }

    async fn barrier_wait(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_wait", Err(e));
        }
        reply("barrier_wait", self.barrier_wait(&r.name).await.map(value))
    }

    async fn mutex_init(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let result = self
            .init(&c, &r.name, SyncDef::Mutex { offset: 0 }, r.mode)
            .await;
        reply("mutex_init", result.map(|_| value(0)))
    }

    async fn mutex_lock(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "lock").await {
            return reply("mutex_lock", Err(e));
        }
        reply(
            "mutex_lock",
            self.mutex_lock(&c, r.tid, &r.name).await.map(value),
        )
    }

    async fn mutex_unlock(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "unlock").await {
            return reply("mutex_unlock", Err(e));
        }
        let result = self.mutex_unlock(&c, r.tid, &r.name).await;
        reply("mutex_unlock", result.map(|()| value(0)))
    }

    async fn bell_init(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let result = self.init(&c, &r.name, SyncDef::Bell, r.mode).await;
        reply("bell_init", result.map(|_| value(0)))
    }

    async fn bell_ring(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, WRITE, "ring").await {
            return reply("bell_ring", Err(e));
        }
        reply("bell_ring", self.bell_ring(&r.name).await.map(value))
    }

    async fn bell_wait(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ, "wait on").await {
            return reply("bell_wait", Err(e));
        }
        reply("bell_wait", self.bell_wait(&c, &r.name).await.map(value))
    }

    async fn delete(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        reply("delete", self.delete(&c, &r.name).await.map(|()| value(0)))
    }

    async fn mutex_locate(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::MutexLocation>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "lock").await {
            return reply("mutex_locate", Err(e));
        }
        reply("mutex_locate", self.mutex_locate(&c, &r.name).await)
    }

    async fn barrier_locate(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::MutexLocation>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_locate", Err(e));
        }
        reply("barrier_locate", self.barrier_locate(&c, &r.name).await)
    }

    async fn barrier_sleep(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_sleep", Err(e));
        }
        let result = self.barrier_sleep(&r.name, r.generation).await;
        reply("barrier_sleep", result.map(value))
    }

    async fn barrier_wake(
        &self,
        r: Request<v1::SyncNameRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        if let Err(e) = self.check(&c, &r.name, READ | WRITE, "wait at").await {
            return reply("barrier_wake", Err(e));
        }
        reply("barrier_wake", self.barrier_wake(&r.name).await.map(value))
    }

    async fn release_dead(
        &self,
        r: Request<v1::ReleaseDeadRequest>,
    ) -> Result<Response<v1::SyncReply>, Status> {
        let r = r.into_inner();
        let c = caller(r.caller.as_ref())?;
        let result = self.release_dead(c.host_id, &r.pids).await;
        reply("release_dead", result.map(|n| value(n as u64)))
    }
}
