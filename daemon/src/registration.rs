//! The daemon's session with the manager: register the host and its pools, bring the chunk
//! tables in step (`PoolChunks`), apply the `WatchHost` event stream, heartbeat every
//! lease/3, and when the manager restarts or the stream breaks, register again and resync
//! (bounded backoff; the daemon never stops over it).
//!
//! Events name their pool (`ChunkBacking.gid`) and apply to it directly; they may repeat what
//! a resync already applied, which the chunk table takes idempotently.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use regions_proto::layout::CHUNK_SIZE;
use regions_proto::lease_contact::LeaseContact;
use regions_proto::v1::{self, host_event::Event};
use tokio::sync::watch;
use tonic::{Code, Status, Streaming};

use crate::error::{DaemonError, Result};
use crate::manager_client::{CALL_TIMEOUT, ManagerClients, request};
use crate::pools::Pools;

/// First pause before registering again.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Longest pause between attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Shortest heartbeat interval.
const MIN_HEARTBEAT: Duration = Duration::from_millis(20);

/// What the rest of the daemon can see of the session.
#[derive(Debug, Default)]
pub struct RegistrationStatus {
    /// Sequence number of the last event applied (or of the last resync).
    pub last_sequence: AtomicU64,
    /// Successful registrations since start.
    pub registrations: AtomicU64,
    /// Events applied since start.
    pub events: AtomicU64,
}

/// A registered session: the lease and where the event stream starts.
#[derive(Clone, Copy, Debug)]
pub struct Session {
    /// The manager's lease.
    pub lease: Duration,
    /// Events after this sequence are still to be applied.
    pub sequence: u64,
}

/// Registers this host and keeps its pools in step with the manager.
#[derive(Debug)]
pub struct Registration {
    /// The data transports this daemon serves, as registration tells the manager.
    transports: String,
    /// Bytes of the object store (0: none).
    object_memory: u64,
    clients: ManagerClients,
    host_id: u32,
    transport_addr: String,
    agent_socket: String,
    /// Memory offered, whole chunks.
    memory: u64,
    incarnation: u64,
    heartbeat: Option<Duration>,
    pools: Arc<Pools>,
    status: Arc<RegistrationStatus>,
    /// Tests only: a pause before applying each chunk release or tail zeroing.
    destructive_event_delay: Duration,
    /// When the manager last answered, and the lease (for the self-fence watchdog).
    contact: Arc<LeaseContact>,
}

/// Whether a failed manager call is worth retrying (the manager is down or restarting).
fn retryable(e: &DaemonError) -> bool {
    matches!(
        e,
        DaemonError::Manager { errno, .. } if [libc::EIO, libc::ETIMEDOUT, libc::EAGAIN].contains(errno)
    )
}

/// Whether a `WatchHost` status asks for a resync.
fn needs_resync(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::FailedPrecondition | Code::InvalidArgument
    )
}

fn manager_err(status: Status) -> DaemonError {
    DaemonError::from_status(&status)
}

impl Registration {
    /// A session for this host; nothing is sent until [`Registration::register`].
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        clients: ManagerClients,
        host_id: u32,
        transport_addr: String,
        agent_socket: String,
        memory: u64,
        heartbeat: Option<Duration>,
        pools: Arc<Pools>,
        status: Arc<RegistrationStatus>,
    ) -> Registration {
        let incarnation = loop {
            let n: u64 = rand::random();
            if n != 0 {
                break n;
            }
        };
        Registration {
            transports: "tcp".into(),
            object_memory: 0,
            clients,
            host_id,
            transport_addr,
            agent_socket,
            memory: memory - memory % CHUNK_SIZE,
            incarnation,
            heartbeat,
            pools,
            status,
            destructive_event_delay: Duration::ZERO,
            contact: Arc::new(LeaseContact::new()),
        }
    }

    /// Tests only: pauses before applying each chunk release or tail zeroing.
    pub fn with_destructive_event_delay(mut self, delay: Duration) -> Registration {
        self.destructive_event_delay = delay;
        self
    }

    /// This start's incarnation number.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    async fn register_pool(&mut self, gid: u32, size: u64) -> Result<v1::PoolRecord> {
        let req = v1::RegisterPoolRequest {
            host_id: self.host_id,
            gid,
            size,
        };
        self.clients
            .cluster
            .register_pool(request(req))
            .await
            .map(tonic::Response::into_inner)
            .map_err(manager_err)
    }

    /// Tells the manager at every registration that this daemon serves `transports` ("tcp",
    /// "tcp rdma:rxe0").
    pub fn with_transports(mut self, transports: String) -> Registration {
        self.transports = transports;
        self
    }

    /// Says how much memory the object store of small regions has (registered with the host).
    pub fn with_object_memory(mut self, bytes: u64) -> Registration {
        self.object_memory = bytes;
        self
    }

    /// Registers the host and its pools and resyncs every pool.
    pub async fn register(&mut self) -> Result<Session> {
        let req = v1::RegisterHostRequest {
            host_id: self.host_id,
            transport_addr: self.transport_addr.clone(),
            agent_socket: self.agent_socket.clone(),
            memory_offered: self.memory,
            incarnation: self.incarnation,
            transports: self.transports.clone(),
            object_memory: self.object_memory,
        };
        let reply = self
            .clients
            .cluster
            .register_host(request(req))
            .await
            .map_err(manager_err)?
            .into_inner();
        let lease = Duration::from_millis(reply.lease_ms.max(100));
        if let Some(r) = reply.revoke_all {
            // Tokens of an earlier manager run: their holders renew them with this run.
            self.pools.revocations().revoke(0, r.before, r.until_ms);
        }
        if self.pools.list().is_empty() {
            self.first_pools(&reply.pools).await?;
        } else {
            self.known_pools().await?;
        }
        let sequence = self.resync_all().await?;
        // Registered with the manager's fences applied: they refuse the old tokens now.
        self.manager_answered(lease);
        self.status.registrations.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            host = self.host_id,
            incarnation = self.incarnation,
            pools = ?self.pools.list(),
            sequence,
            lease_ms = lease.as_millis() as u64,
            "registered with the manager"
        );
        Ok(Session { lease, sequence })
    }

    /// First registration of this process: adopt the pools the manager knows for this host
    /// (left by an earlier daemon; their data is gone), then add one pool for the rest of the
    /// memory offered.
    async fn first_pools(&mut self, known: &[v1::PoolRecord]) -> Result<()> {
        let mut adopted = 0;
        let host = self.host_id;
        for rec in known.iter().filter(|p| p.host_id == host) {
            match self.register_pool(rec.gid, rec.size).await {
                Ok(r) => {
                    self.pools.add_pool(r.gid, r.size)?;
                    adopted += 1;
                }
                Err(e) => tracing::error!(
                    gid = rec.gid,
                    size = rec.size,
                    error = %e,
                    "cannot take over a pool of this host's previous daemon; regions placed in \
                     it are unreachable (offer at least as much --memory as before)"
                ),
            }
        }
        if adopted > 0 {
            tracing::warn!(
                adopted,
                "took over the pools of this host's previous daemon: the data they held died \
                 with it; the manager marks its regions lost (EIO until unlinked)"
            );
        }
        let have = self.pools.pool_bytes();
        if have < self.memory {
            let r = self.register_pool(0, self.memory - have).await?;
            self.pools.add_pool(r.gid, r.size)?;
        }
        Ok(())
    }

    /// Re-registration (manager restart, broken session): the same gids and sizes.
    async fn known_pools(&mut self) -> Result<()> {
        for (gid, size) in self.pools.list() {
            match self.register_pool(gid, size).await {
                Ok(_) => {}
                Err(e) if e.errno() == libc::ENOENT => {
                    tracing::warn!(gid, error = %e, "the manager no longer knows this pool; registering a new one");
                    self.pools.remove_pool(gid);
                    let r = self.register_pool(0, size).await?;
                    self.pools.add_pool(r.gid, r.size)?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Brings every pool's table in step with `PoolChunks`; returns the sequence the stream
    /// continues from.
    pub async fn resync_all(&mut self) -> Result<u64> {
        let mut sequence = u64::MAX;
        for (gid, _) in self.pools.list() {
            let reply = self
                .clients
                .cluster
                .pool_chunks(request(v1::PoolChunksRequest { gid }))
                .await
                .map_err(manager_err)?
                .into_inner();
            // Revocations whose events this daemon may have missed while away.
            for r in &reply.revoked {
                self.pools.revocations().apply(r);
            }
            let list: Vec<(u64, u64, u64, u64)> = reply
                .chunks
                .iter()
                .map(|c| (c.pool_offset, c.ino, c.region_offset, c.len))
                .collect();
            let pools = Arc::clone(&self.pools);
            let applied = tokio::task::spawn_blocking(move || pools.resync(gid, &list))
                .await
                .map_err(|e| DaemonError::Invalid(format!("resync task failed: {e}")))?;
            if let Err(e) = applied {
                tracing::warn!(gid, error = %e, "resync left some chunks unbacked");
            }
            tracing::debug!(
                gid,
                chunks = reply.chunks.len(),
                sequence = reply.sequence,
                "pool resynced"
            );
            sequence = sequence.min(reply.sequence);
        }
        let sequence = if sequence == u64::MAX { 0 } else { sequence };
        self.status.last_sequence.store(sequence, Ordering::Relaxed);
        self.report_applied(sequence).await;
        Ok(sequence)
    }

    /// Tells the manager that every event up to `sequence` is applied here: its replies that
    /// hand out region maps wait for chunk releases and tail zeroing to land first. A failed
    /// report only delays those replies (the manager waits a bounded time).
    async fn report_applied(&mut self, sequence: u64) {
        let req = v1::EventsAppliedRequest {
            host_id: self.host_id,
            sequence,
        };
        if let Err(s) = self.clients.cluster.events_applied(request(req)).await {
            tracing::warn!(sequence, error = %s.message(), "cannot report applied events to the manager; its replies may wait");
        }
    }

    /// Keeps trying to register while the manager is unreachable, up to `timeout`.
    pub async fn register_at_startup(&mut self, timeout: Duration) -> Result<Session> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(200);
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.register().await {
                Ok(session) => return Ok(session),
                Err(e) if retryable(&e) && start.elapsed() + backoff < timeout => {
                    tracing::warn!(
                        manager = %self.clients.url,
                        attempt = attempts,
                        error = %e,
                        retry_in_ms = backoff.as_millis() as u64,
                        "manager unreachable; retrying (is regions-manager running at --manager?)"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(e) if retryable(&e) => {
                    return Err(DaemonError::ManagerUnreachable {
                        url: self.clients.url.clone(),
                        attempts,
                        secs: start.elapsed().as_secs(),
                        last: e.to_string(),
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Serves `first`, then registers again whenever the session ends, until `shutdown` turns
    /// true (or its sender goes away).
    pub async fn run(mut self, first: Session, mut shutdown: watch::Receiver<bool>) {
        tokio::spawn(Self::watch_silence(
            Arc::clone(&self.contact),
            Arc::clone(&self.pools),
            self.host_id,
            shutdown.clone(),
        ));
        let mut next = Some(first);
        let mut backoff = MIN_BACKOFF;
        loop {
            if *shutdown.borrow() {
                return;
            }
            let session = match next.take() {
                Some(s) => s,
                None => {
                    let attempt = tokio::select! {
                        r = self.register() => r,
                        _ = shutdown.changed() => return,
                    };
                    match attempt {
                        Ok(s) => {
                            backoff = MIN_BACKOFF;
                            s
                        }
                        Err(e) => {
                            tracing::warn!(
                                manager = %self.clients.url,
                                error = %e,
                                retry_in_ms = backoff.as_millis() as u64,
                                "cannot register with the manager; retrying"
                            );
                            if sleep_or_stop(backoff, &mut shutdown).await {
                                return;
                            }
                            backoff = (backoff * 2).min(MAX_BACKOFF);
                            continue;
                        }
                    }
                }
            };
            match self.serve(session, &mut shutdown).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "manager session ended; registering again");
                    if sleep_or_stop(backoff, &mut shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    async fn watch(&mut self, after: &mut u64) -> Result<Streaming<v1::HostEvent>> {
        for _ in 0..3 {
            let req = v1::WatchHostRequest {
                host_id: self.host_id,
                after_sequence: *after,
            };
            // No deadline: the stream lives as long as the session.
            match self
                .clients
                .cluster
                .watch_host(tonic::Request::new(req))
                .await
            {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if needs_resync(&s) => {
                    tracing::info!(after = *after, reason = %s.message(), "manager asks for a resync");
                    *after = self.resync_all().await?;
                }
                Err(s) => return Err(manager_err(s)),
            }
        }
        Err(DaemonError::Invalid(
            "the manager keeps refusing the event stream after resyncs".into(),
        ))
    }

    /// One session: events and heartbeats until the stream breaks (`Err`) or shutdown (`Ok`).
    async fn serve(
        &mut self,
        session: Session,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<()> {
        let every = self
            .heartbeat
            .unwrap_or(session.lease / 3)
            .max(MIN_HEARTBEAT);
        let mut after = session.sequence;
        let mut stream = self.watch(&mut after).await?;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = shutdown.changed() => {
                    if changed.is_err() || *shutdown.borrow() {
                        return Ok(());
                    }
                }
                _ = tick.tick() => {
                    self.pools.retry_refused();
                    self.heartbeat().await?
                }
                message = stream.message() => match message {
                    Ok(Some(event)) => self.apply(event, &mut after).await,
                    Ok(None) => {
                        return Err(DaemonError::Invalid("the manager ended the event stream".into()));
                    }
                    Err(s) if needs_resync(&s) => {
                        tracing::info!(reason = %s.message(), "event stream needs a resync");
                        after = self.resync_all().await?;
                        stream = self.watch(&mut after).await?;
                    }
                    Err(s) => return Err(manager_err(s)),
                },
            }
        }
    }

    /// Renews the lease; `Err` only when the manager no longer knows this incarnation.
    async fn heartbeat(&mut self) -> Result<()> {
        let req = v1::HeartbeatRequest {
            host_id: self.host_id,
            incarnation: self.incarnation,
        };
        let mut req = request(req);
        if let Some((_, lease)) = self.contact.silence() {
            // A heartbeat answered later than the next is due is no use: do not wait longer.
            req.set_timeout((lease / 3).clamp(Duration::from_millis(100), CALL_TIMEOUT));
        }
        match self.clients.cluster.heartbeat(req).await {
            Ok(_) => {
                // The manager still holds this host's lease (else it refuses the heartbeat).
                if let Some(lease) = self.contact.lease() {
                    self.manager_answered(lease);
                }
                Ok(())
            }
            Err(s) if matches!(s.code(), Code::NotFound | Code::InvalidArgument) => {
                metrics::counter!("regions_daemon_heartbeat_failures_total").increment(1);
                Err(manager_err(s))
            }
            Err(s) => {
                metrics::counter!("regions_daemon_heartbeat_failures_total").increment(1);
                tracing::warn!(error = %s.message(), code = ?s.code(), "heartbeat failed; is the manager up?");
                Ok(())
            }
        }
    }

    /// The manager answered a registration or a heartbeat, so this host holds its `lease`: a
    /// fence this daemon put on itself while the manager was silent ends.
    fn manager_answered(&self, lease: Duration) {
        self.contact.heard(lease);
        if self.pools.revocations().self_fenced() {
            tracing::info!(
                host = self.host_id,
                "the manager answers again: this host's own fence ends"
            );
            self.pools.revocations().unfence_self();
        }
    }

    /// Watches the manager's silence until shutdown: once it has not answered for three
    /// quarters of a lease (two heartbeats in a row unanswered), this host's own tokens are
    /// refused here (see [`Revocations::fence_self`]), so
    /// that by the time the lease ends at the manager (which then hands this host's mutexes to
    /// others) this daemon no longer serves its processes' old capabilities either.
    async fn watch_silence(
        contact: Arc<LeaseContact>,
        pools: Arc<Pools>,
        host: u32,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            let step = contact
                .silence()
                .map_or(MIN_HEARTBEAT * 5, |(_, lease)| lease / 8)
                .max(MIN_HEARTBEAT);
            if sleep_or_stop(step, &mut shutdown).await {
                return;
            }
            let Some((silent, _)) = contact.out_of_touch() else {
                continue;
            };
            if !pools.revocations().self_fenced() {
                tracing::warn!(
                    host,
                    silent_ms = silent.as_millis() as u64,
                    "the manager has not answered for most of a lease: refusing this host's \
                     capabilities until it answers again"
                );
                pools.revocations().fence_self(host);
            }
        }
    }

    /// Applies one event (errors are logged: a bad event never stops the daemon).
    async fn apply(&mut self, event: v1::HostEvent, after: &mut u64) {
        let sequence = event.sequence;
        let destructive = matches!(
            event.event,
            Some(Event::Released(_) | Event::Truncated(_) | Event::Revoked(_))
        );
        if destructive && !self.destructive_event_delay.is_zero() {
            tokio::time::sleep(self.destructive_event_delay).await;
        }
        let result = match event.event {
            Some(Event::Assigned(b)) => {
                self.pools
                    .assign(b.gid, b.pool_offset, b.ino, b.region_offset, b.len)
            }
            Some(Event::Released(b)) => {
                self.pools
                    .release(b.gid, b.pool_offset, b.ino, b.region_offset, b.len)
            }
            Some(Event::Truncated(t)) => self.pools.truncate(t.ino, t.size),
            Some(Event::Revoked(r)) => {
                self.pools.revocations().apply(&r);
                Ok(())
            }
            Some(Event::GrowPool(bytes)) => self.grow(bytes).await,
            None => Ok(()),
        };
        if let Err(e) = result {
            tracing::warn!(sequence, error = %e, "cannot apply a manager event");
        }
        *after = sequence;
        self.status.last_sequence.store(sequence, Ordering::Relaxed);
        self.status.events.fetch_add(1, Ordering::Relaxed);
        if destructive {
            self.report_applied(sequence).await;
        }
    }

    /// `GrowPool`: add a pool of `bytes` (whole chunks) if the memory offered allows.
    async fn grow(&mut self, bytes: u64) -> Result<()> {
        let want = bytes.div_ceil(CHUNK_SIZE).saturating_mul(CHUNK_SIZE);
        let have = self.pools.pool_bytes();
        if want == 0 || have.saturating_add(want) > self.memory {
            tracing::info!(
                asked = bytes,
                pools = have,
                memory = self.memory,
                "the manager asked for another pool, but the memory offered is used up"
            );
            return Ok(());
        }
        let r = self.register_pool(0, want).await?;
        self.pools.add_pool(r.gid, r.size)?;
        tracing::info!(
            gid = r.gid,
            size = r.size,
            "pool added at the manager's request"
        );
        Ok(())
    }
}

/// Sleeps `d`; `true` when shutdown came first.
async fn sleep_or_stop(d: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(d) => *shutdown.borrow(),
        changed = shutdown.changed() => changed.is_err() || *shutdown.borrow(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_and_resync_rules() {
        let down = DaemonError::from_status(&Status::unavailable("down"));
        assert!(retryable(&down));
        let denied = DaemonError::from_status(&Status::unauthenticated("wrong secret"));
        assert!(!retryable(&denied));
        assert!(!retryable(&DaemonError::Invalid("x".into())));
        assert!(needs_resync(&Status::failed_precondition("x")));
        assert!(needs_resync(&Status::invalid_argument("x")));
        assert!(!needs_resync(&Status::unavailable("x")));
    }

    #[tokio::test]
    async fn startup_gives_up_on_an_unreachable_manager() {
        let secret = regions_proto::auth::Secret::new("s").unwrap();
        // A port nobody listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let clients = ManagerClients::new(&format!("127.0.0.1:{port}"), &secret, None).unwrap();
        let mut reg = Registration::new(
            clients,
            1,
            "127.0.0.1:1".into(),
            String::new(),
            1 << 20,
            None,
            Arc::new(Pools::new()),
            Arc::default(),
        );
        assert_ne!(reg.incarnation(), 0);
        let err = reg
            .register_at_startup(Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(
            matches!(err, DaemonError::ManagerUnreachable { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("start regions-manager"), "{err}");
    }
}
