//! The head: the registry of node agents, their liveness, and remote actors placed on them.
//!
//! Agents register over gRPC (`Head` service) and send heartbeats; the head connects back to
//! each agent's `Agent` service. An agent is declared lost when its heartbeats stop for
//! `heartbeat_timeout` or its call stream breaks, and every actor on it is reported dead to its
//! supervisor, which restarts it on an agent that can take it.
//!
//! A head can also *borrow* another process's agents ([`lend`]): a server's job in a process of
//! its own reaches the server's agents directly while the server keeps the accounts.
//!
//! Owns: agent membership, resource accounting, death notices, remote spawning. Does not own:
//! what actors compute, job state (the orchestrator's), or the job API (served beside this one).

pub mod lend;

use crate::actor::{
    Actor, ActorRef, Incarnation, Link, SpawnOptions, Starter, stop_requested, supervise,
    wait_for_stop,
};
use crate::auth::Token;
use crate::error::ActorError;
use crate::lock;
use crate::placement::{self, Assignment, Demand, Offer, PoolSpec, Resources};
use crate::remote::{AgentConn, RemoteActor, Wire};
use bytes::Bytes;
use proto::v1::head_server::{Head as HeadRpc, HeadServer};
use proto::v1::{HeartbeatReply, HeartbeatRequest, RegisterReply, RegisterRequest, SpawnRequest};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};
use tonic::service::Routes;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

/// Bumped when the head ↔ agent protocol changes incompatibly.
pub const PROTOCOL_VERSION: u32 = 2;

/// Liveness and transport settings of a head.
#[derive(Clone, Debug)]
pub struct HeadConfig {
    /// How often agents send heartbeats.
    pub heartbeat_interval: Duration,
    /// Silence after which an agent is declared lost.
    pub heartbeat_timeout: Duration,
    pub wire: Wire,
    /// PEM certificate(s) to check agents' TLS certificates against. `Some`: the head reaches
    /// agents only over TLS (an agent advertising `http://` is refused at registration);
    /// `None`: plain HTTP/2.
    pub agent_tls_ca: Option<Vec<u8>>,
}

impl Default for HeadConfig {
    fn default() -> Self {
        HeadConfig {
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(3),
            wire: Wire::default(),
            agent_tls_ca: None,
        }
    }
}

/// How long a start may wait for room, and the actor's stop, which ends the wait.
pub(crate) struct RoomWait {
    pub wait: Duration,
    pub stopping: watch::Receiver<bool>,
}

impl RoomWait {
    fn stopped(&self) -> bool {
        stop_requested(&self.stopping)
    }
}

/// A registered agent.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AgentInfo {
    pub id: String,
    pub name: String,
    pub address: String,
    pub resources: Resources,
    pub labels: BTreeMap<String, String>,
    pub kinds: Vec<String>,
    pub host_id: String,
}

struct AgentEntry {
    info: AgentInfo,
    last_seen: Instant,
    conn: Arc<AgentConn>,
    free: Resources,
    actors: HashMap<String, Demand>,
}

impl AgentEntry {
    /// What no actor holds: the agent's resources less every actor's demand, never below
    /// zero (a head's own spawns may hold more than there is for a moment — a pool started
    /// while stopped actors still hold their room — and a count kept by taking and giving
    /// would then drift).
    fn recount(&mut self) {
        let mut free = self.info.resources;
        for held in self.actors.values() {
            for (&d, &n) in &held.devices {
                free.take(d, n);
            }
        }
        self.free = free;
    }
}

struct Inner {
    config: HeadConfig,
    token: Token,
    host_id: String,
    agents: Mutex<HashMap<String, AgentEntry>>,
    membership: watch::Sender<u64>,
    deaths: Mutex<HashMap<String, oneshot::Sender<String>>>,
    next_agent: AtomicU64,
    next_actor: AtomicU64,
    stop: watch::Sender<bool>,
    /// Tells this head's actor ids from those of an earlier head the same agents served (a
    /// restarted server).
    epoch: String,
    /// Actors that borrowing heads placed on this head's agents, and their deaths not yet told.
    lent: Mutex<lend::Ledger>,
    /// Where a borrowing head gets its agents and room (`None`: agents register with this head).
    lender: Option<Arc<dyn lend::Lender>>,
    /// The runtime the head's tasks run on (for work started from threads outside it).
    runtime: tokio::runtime::Handle,
}

/// The head's handle; cheap to clone.
#[derive(Clone)]
pub struct Head {
    inner: Arc<Inner>,
    address: SocketAddr,
}

/// This host's identity: boot id and hostname. Agents with the same id as the head get weight
/// snapshots through shared memory.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut name = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and we stop at the first NUL.
    let ok = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
    let host = if ok {
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        String::from_utf8_lossy(&name[..end]).into_owned()
    } else {
        String::new()
    };
    format!("{}/{host}", boot.trim())
}

impl Head {
    /// Binds `listen` (port 0 picks one) and serves agents until [`Head::shutdown`].
    pub async fn serve(
        listen: SocketAddr,
        token: Token,
        config: HeadConfig,
    ) -> std::io::Result<Head> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let address = listener.local_addr()?;
        let (head, routes) = Head::new(address, token, config);
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut signal = head.inner.stop.subscribe();
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = signal.wait_for(|s| *s).await;
            };
            if let Err(e) = tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
            {
                tracing::error!("head server ended: {e}");
            }
        });
        tracing::info!(%address, "head listening for agents");
        Ok(head)
    }

    /// A head whose `Head` service the caller serves, beside its own services on its own port
    /// (`trellis serve`): returns the head, which agents reach at `address`, and the service's
    /// routes (calls without the cluster token are refused). Must be called inside a tokio
    /// runtime: it starts the heartbeat-expiry task.
    pub fn new(address: SocketAddr, token: Token, config: HeadConfig) -> (Head, Routes) {
        let head = Head::start(address, token, config, None);
        let service = InterceptedService::new(
            HeadServer::new(Service(Arc::downgrade(&head.inner))),
            head.inner.token.guard(),
        );
        (head, Routes::new(service))
    }

    /// A head without a service of its own: agents come from registrations (a service the
    /// caller serves) or, with `lender`, from another process's head. Starts the task that
    /// declares silent agents lost.
    fn start(
        address: SocketAddr,
        token: Token,
        config: HeadConfig,
        lender: Option<Arc<dyn lend::Lender>>,
    ) -> Head {
        let (stop, mut stopped) = watch::channel(false);
        let inner = Arc::new(Inner {
            config,
            token,
            host_id: host_id(),
            agents: Mutex::new(HashMap::new()),
            membership: watch::channel(0).0,
            deaths: Mutex::new(HashMap::new()),
            next_agent: AtomicU64::new(1),
            next_actor: AtomicU64::new(1),
            stop,
            epoch: {
                let ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis());
                format!("{:x}.{:x}", std::process::id(), ms)
            },
            lent: Mutex::default(),
            lender,
            runtime: tokio::runtime::Handle::current(),
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let period = inner.config.heartbeat_interval / 2;
                inner.expire();
                drop(inner);
                tokio::select! {
                    _ = tokio::time::sleep(period) => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
            }
        });
        Head { inner, address }
    }

    /// Where agents reach this head.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The live agents, by name.
    pub fn agents(&self) -> Vec<AgentInfo> {
        self.rooms().into_iter().map(|r| r.info).collect()
    }

    /// The live agents, by name, each with what no actor holds.
    pub fn rooms(&self) -> Vec<lend::AgentRoom> {
        let mut v: Vec<lend::AgentRoom> = lock(&self.inner.agents)
            .values()
            .map(|e| lend::AgentRoom {
                info: e.info.clone(),
                free: e.free,
            })
            .collect();
        v.sort_by(|a, b| a.info.name.cmp(&b.info.name));
        v
    }

    /// Waits until at least `n` agents are live.
    pub async fn wait_for_agents(
        &self,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<AgentInfo>, ActorError> {
        let mut changes = self.inner.membership.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let agents = self.agents();
            if agents.len() >= n {
                return Ok(agents);
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(ActorError::Agent {
                    agent: "*".into(),
                    message: format!(
                        "{} of {n} agents registered within {:.0?}: {}",
                        agents.len(),
                        timeout,
                        agents
                            .iter()
                            .map(|a| a.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
        }
    }

    fn offers(&self) -> Vec<Offer> {
        let mut v: Vec<Offer> = lock(&self.inner.agents)
            .values()
            .map(|e| Offer {
                id: e.info.id.clone(),
                name: e.info.name.clone(),
                free: e.free,
                actors: e.actors.len() as u32,
                labels: e.info.labels.clone(),
                kinds: e.info.kinds.clone(),
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// An agent with room for `demand`, waiting up to `wait` for one (agents registering, actors
    /// releasing what they held).
    async fn pick_waiting(
        &self,
        name: &str,
        demand: &Demand,
        wait: Duration,
        mut stopping: watch::Receiver<bool>,
    ) -> Result<String, ActorError> {
        let what = format!("actor `{name}`");
        let mut changes = self.inner.membership.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        let mut waited = false;
        loop {
            match placement::pick(&what, demand, &self.offers()) {
                Ok(agent) => {
                    if waited {
                        tracing::info!(actor = %name, %agent, "room found for the restart");
                    }
                    return Ok(agent);
                }
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e.into()),
                Err(e) => {
                    if !waited {
                        tracing::warn!(actor = %name, "restart waits up to {wait:.0?} for room: {e}");
                        waited = true;
                    }
                    // Registrations wake it at once; released capacity within a poll.
                    let nap = Duration::from_millis(100)
                        .min(deadline.saturating_duration_since(tokio::time::Instant::now()));
                    tokio::select! {
                        changed = changes.changed() => {
                            if changed.is_err() {
                                tokio::time::sleep(nap).await;
                            }
                        }
                        _ = tokio::time::sleep(nap) => {}
                        _ = wait_for_stop(&mut stopping) => {
                            return Err(ActorError::Stopped { actor: name.to_string() });
                        }
                    }
                }
            }
        }
    }

    /// Places `pools` on the live agents without starting anything.
    pub fn place(&self, pools: &[PoolSpec]) -> Result<Vec<Assignment>, ActorError> {
        Ok(placement::place(pools, &self.offers())?)
    }

    /// Spawns one supervised actor on any agent that can take `demand`; restarts go wherever
    /// `demand` fits then.
    pub async fn spawn<A: Actor>(
        &self,
        name: &str,
        config: A::Config,
        demand: Demand,
        options: SpawnOptions<A>,
    ) -> Result<ActorRef<A>, ActorError> {
        self.spawn_at(name, config, demand, None, options).await
    }

    /// Places a pool and spawns its actors (`name-0`, `name-1`, …), actor `i` configured by
    /// `config(i)`.
    pub async fn spawn_pool<A: Actor>(
        &self,
        pool: &PoolSpec,
        config: impl Fn(u32) -> A::Config,
        options: SpawnOptions<A>,
    ) -> Result<Vec<ActorRef<A>>, ActorError> {
        let mut pool = pool.clone();
        pool.kind = A::KIND.to_string();
        let assignments = self.place(std::slice::from_ref(&pool))?;
        let mut refs = Vec::with_capacity(assignments.len());
        for a in assignments {
            let demand = Demand {
                kind: pool.kind.clone(),
                devices: BTreeMap::from([(pool.device, pool.per_actor)]),
                labels: pool.labels.clone(),
            };
            let name = format!("{}-{}", pool.name, a.index);
            refs.push(
                self.spawn_at(
                    &name,
                    config(a.index),
                    demand,
                    Some(a.agent),
                    options.clone(),
                )
                .await?,
            );
        }
        Ok(refs)
    }

    /// Spawns on agent `agent` (an id from [`Head::place`]) or, with `None`, wherever `demand`
    /// fits.
    pub async fn spawn_at<A: Actor>(
        &self,
        name: &str,
        config: A::Config,
        mut demand: Demand,
        agent: Option<String>,
        options: SpawnOptions<A>,
    ) -> Result<ActorRef<A>, ActorError> {
        demand.kind = A::KIND.to_string();
        let config: Bytes = serde_json::to_vec(&config)
            .map_err(|e| ActorError::Start {
                actor: name.to_string(),
                kind: A::KIND.to_string(),
                message: format!("config does not encode: {e}"),
            })?
            .into();
        let head = self.clone();
        let actor_name = name.to_string();
        let mailbox = options.mailbox as u32;
        // Ids name one incarnation of one spawn of one head: a late death notice of an actor of
        // an earlier job (same name) or an earlier head never names this one.
        let serial = self.inner.next_actor.fetch_add(1, Ordering::Relaxed);
        let place_wait = options.restart.place_wait;
        let starter: Starter<A> = Arc::new(move |n, stopping| {
            let (head, demand, config, name) = (
                head.clone(),
                demand.clone(),
                config.clone(),
                actor_name.clone(),
            );
            let first = if n == 0 { agent.clone() } else { None };
            Box::pin(async move {
                let agent = match first {
                    Some(a) => a,
                    None if n == 0 => {
                        placement::pick(&format!("actor `{name}`"), &demand, &head.offers())?
                    }
                    // A restart waits for room: the agent that died may be coming back, or
                    // another joining; only a start that fails counts as a death.
                    None => {
                        head.pick_waiting(&name, &demand, place_wait, stopping.clone())
                            .await?
                    }
                };
                let request = SpawnRequest {
                    actor_id: format!("{name}#{n}@{}.{serial}", head.inner.epoch),
                    kind: demand.kind.clone(),
                    config,
                    mailbox,
                };
                let waiting = RoomWait {
                    wait: place_wait,
                    stopping,
                };
                let (remote, death) = head.start_remote(&agent, request, demand, &waiting).await?;
                Ok(Incarnation {
                    link: Link::Remote(remote),
                    death,
                })
            })
        });
        supervise(name, starter, options).await
    }

    async fn start_remote(
        &self,
        agent: &str,
        request: SpawnRequest,
        demand: Demand,
        waiting: &RoomWait,
    ) -> Result<(RemoteActor, oneshot::Receiver<String>), ActorError> {
        let actor_id = request.actor_id.clone();
        let conn = {
            let mut agents = lock(&self.inner.agents);
            let entry = agents.get_mut(agent).ok_or_else(|| ActorError::Agent {
                agent: agent.to_string(),
                message: "is no longer registered".into(),
            })?;
            entry.actors.insert(actor_id.clone(), demand.clone());
            match self.inner.lender {
                None => entry.recount(),
                Some(_) => {
                    for (&d, &n) in &demand.devices {
                        entry.free.take(d, n);
                    }
                }
            }
            entry.conn.clone()
        };
        // A borrowed agent's room is the lender's to give: other jobs use the same agents.
        if let Err(message) = self.inner.reserve(agent, &actor_id, &demand, waiting).await {
            self.inner.release(agent, &actor_id);
            return Err(ActorError::Agent {
                agent: conn.name.clone(),
                message,
            });
        }
        let (tx, death) = oneshot::channel();
        lock(&self.inner.deaths).insert(actor_id.clone(), tx);
        match conn.spawn(request).await {
            Ok(()) => {
                tracing::info!(actor = %actor_id, agent = %conn.name, "spawned");
                Ok((RemoteActor { conn, actor_id }, death))
            }
            Err(e) => {
                self.inner.release(agent, &actor_id);
                self.inner.unreserve(agent, &actor_id);
                lock(&self.inner.deaths).remove(&actor_id);
                Err(e)
            }
        }
    }

    /// Stops serving; with `agents`, also tells every agent to stop its actors and exit (never
    /// a borrowed head's: they are the lender's).
    pub async fn shutdown(&self, agents: bool) {
        if agents && self.inner.lender.is_none() {
            let conns: Vec<Arc<AgentConn>> = lock(&self.inner.agents)
                .values()
                .map(|e| e.conn.clone())
                .collect();
            for c in conns {
                if let Err(e) = c.shutdown().await {
                    tracing::warn!("{e}");
                }
            }
        }
        self.inner.stop.send_replace(true);
        // Forget the agents: their connections (and call streams) close now.
        lock(&self.inner.agents).clear();
    }
}

impl Inner {
    /// Opens this head's connection to agent `id` (its call stream): the agent is declared lost
    /// when the stream ends, and an actor a call found dead is released and reported.
    async fn connect(
        self: &Arc<Self>,
        id: &str,
        name: &str,
        address: &str,
        same_host: bool,
    ) -> Result<Arc<AgentConn>, String> {
        let (weak, weak_too) = (Arc::downgrade(self), Arc::downgrade(self));
        let (lost_id, agent_id) = (id.to_string(), id.to_string());
        let lost = move |reason: String| {
            if let Some(inner) = weak.upgrade() {
                inner.declare_lost(&lost_id, &reason);
            }
        };
        let actor_died = move |actor: &str, reason: String| {
            if let Some(inner) = weak_too.upgrade() {
                inner.release(&agent_id, actor);
                inner.notify_death(actor, reason);
            }
        };
        AgentConn::connect(
            name,
            address,
            &self.token,
            self.config.agent_tls_ca.as_deref(),
            same_host,
            self.config.wire.clone(),
            lost,
            actor_died,
        )
        .await
    }

    fn release(&self, agent: &str, actor_id: &str) {
        if let Some(entry) = lock(&self.agents).get_mut(agent)
            && let Some(demand) = entry.actors.remove(actor_id)
        {
            match self.lender {
                None => entry.recount(),
                // A borrower's room is the lender's count, polled, less what it took since.
                Some(_) => {
                    for (&d, &n) in &demand.devices {
                        entry.free.give(d, n);
                    }
                }
            }
        }
    }

    fn notify_death(&self, actor_id: &str, reason: String) {
        match lock(&self.deaths).remove(actor_id) {
            Some(tx) => {
                let _ = tx.send(reason);
            }
            // Not this head's: perhaps a borrower's, told at its next poll.
            None => lock(&self.lent).died(actor_id, reason),
        }
    }

    fn declare_lost(&self, agent: &str, reason: &str) {
        let Some(entry) = lock(&self.agents).remove(agent) else {
            return;
        };
        tracing::warn!(agent = %entry.info.name, reason, "agent lost");
        entry.conn.abandon(&format!(
            "its agent `{}` was lost: {reason}",
            entry.info.name
        ));
        for actor in entry.actors.keys() {
            self.notify_death(
                actor,
                format!("its agent `{}` was lost: {reason}", entry.info.name),
            );
        }
        self.membership.send_modify(|n| *n += 1);
    }

    fn expire(&self) {
        let timeout = self.config.heartbeat_timeout;
        let late: Vec<(String, Duration)> = lock(&self.agents)
            .values()
            .filter(|e| e.last_seen.elapsed() > timeout)
            .map(|e| (e.info.id.clone(), e.last_seen.elapsed()))
            .collect();
        for (id, silent) in late {
            self.declare_lost(
                &id,
                &format!("no heartbeat for {:.1} s", silent.as_secs_f64()),
            );
        }
    }
}

struct Service(Weak<Inner>);

impl Service {
    fn inner(&self) -> Result<Arc<Inner>, Status> {
        self.0
            .upgrade()
            .ok_or_else(|| Status::unavailable("the head is shutting down"))
    }
}

#[tonic::async_trait]
impl HeadRpc for Service {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterReply>, Status> {
        let inner = self.inner()?;
        let r = request.into_inner();
        if r.protocol_version != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "agent speaks protocol {}, this head speaks {PROTOCOL_VERSION}: run the same trellis version on both",
                r.protocol_version
            )));
        }
        if r.name.is_empty() || r.address.is_empty() {
            return Err(Status::invalid_argument(
                "an agent must give its name and address",
            ));
        }
        if inner.config.agent_tls_ca.is_some() && !r.address.starts_with("https://") {
            return Err(Status::failed_precondition(format!(
                "this head reaches its agents over TLS, and agent `{}` advertises {}: start it with --tls-cert and --tls-key (it then serves and advertises https://)",
                r.name, r.address
            )));
        }
        let n = inner.next_agent.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}#{n}", r.name);
        let same_host = r.host_id == inner.host_id;
        let conn = inner
            .connect(&id, &r.name, &r.address, same_host)
            .await
            .map_err(|e| {
                Status::unavailable(format!(
                    "the head cannot reach agent `{}` back: {e}",
                    r.name
                ))
            })?;
        let previous: Vec<String> = lock(&inner.agents)
            .values()
            .filter(|e| e.info.name == r.name)
            .map(|e| e.info.id.clone())
            .collect();
        for old in previous {
            inner.declare_lost(&old, "a new agent registered under its name");
        }
        let resources = Resources::from(r.resources.unwrap_or_default());
        let info = AgentInfo {
            id: id.clone(),
            name: r.name,
            address: r.address,
            resources,
            labels: r.labels.into_iter().collect(),
            kinds: r.kinds,
            host_id: r.host_id,
        };
        tracing::info!(agent = %info.name, address = %info.address, same_host, "agent registered");
        lock(&inner.agents).insert(
            id.clone(),
            AgentEntry {
                info,
                last_seen: Instant::now(),
                conn,
                free: resources,
                actors: HashMap::new(),
            },
        );
        inner.membership.send_modify(|n| *n += 1);
        Ok(Response::new(RegisterReply {
            agent_id: id,
            heartbeat_interval_ms: inner.config.heartbeat_interval.as_millis() as u64,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let inner = self.inner()?;
        let r = request.into_inner();
        let known = match lock(&inner.agents).get_mut(&r.agent_id) {
            Some(entry) => {
                entry.last_seen = Instant::now();
                true
            }
            None => false,
        };
        if known {
            for dead in r.died {
                inner.release(&r.agent_id, &dead.actor_id);
                inner.notify_death(&dead.actor_id, dead.reason);
            }
        }
        Ok(Response::new(HeartbeatReply { known }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::RestartPolicy;
    use crate::agent::{self, AgentOptions};
    use crate::builtin::{self, Ping, PingRequest, PingResponse};
    use crate::placement::{Device, Strategy};
    use kernels::tensor::WeightSnapshot;

    fn config() -> HeadConfig {
        HeadConfig {
            heartbeat_interval: Duration::from_millis(50),
            heartbeat_timeout: Duration::from_millis(500),
            wire: Wire {
                bucket_bytes: 1000,
                max_message_bytes: 1 << 20,
                shared_memory: true,
            },
            agent_tls_ca: None,
        }
    }

    /// Starts an in-process agent; dropping the sender stops it.
    fn agent(
        head: &Head,
        name: &str,
        token: &Token,
    ) -> (
        oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<(), agent::AgentError>>,
    ) {
        let options = AgentOptions {
            head: format!("http://{}", head.address()),
            listen: "127.0.0.1:0".parse().expect("addr"),
            advertise: None,
            name: name.into(),
            resources: Resources::parse("cpu=2").expect("valid"),
            labels: BTreeMap::new(),
            token: token.clone(),
            tls_ca: None,
            tls_identity: None,
            registry: builtin::registry(),
            wire: config().wire,
        };
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(agent::run(options, async move {
            let _ = rx.await;
        }));
        (tx, task)
    }

    /// A head on a free loopback port with a fresh token.
    /// Stops agent `a` and returns the actor of `refs` that was on it.
    async fn lose_a(
        refs: &[crate::ActorRef<Ping>],
        stop_a: oneshot::Sender<()>,
        task_a: tokio::task::JoinHandle<Result<(), agent::AgentError>>,
    ) -> crate::ActorRef<Ping> {
        let on_a = refs
            .iter()
            .find(|r| r.location() == "a")
            .expect("one on a")
            .clone();
        drop(stop_a);
        task_a.await.expect("joins").expect("agent a stops cleanly");
        on_a
    }

    /// Two ping actors, one per agent.
    fn ping_pool() -> PoolSpec {
        PoolSpec {
            name: "ping".into(),
            kind: "ping".into(),
            actors: 2,
            device: Device::Cpu,
            per_actor: 1,
            strategy: Strategy::Spread,
            labels: BTreeMap::new(),
            colocate: None,
        }
    }

    async fn loopback_head() -> (Head, Token) {
        let token = Token::generate().expect("urandom");
        let head = Head::serve(
            "127.0.0.1:0".parse().expect("addr"),
            token.clone(),
            config(),
        )
        .await
        .expect("binds");
        (head, token)
    }

    /// Calls until the answer is not `Died` (a death that the supervisor has not seen yet).
    async fn until_up(
        actor: &crate::ActorRef<Ping>,
        request: PingRequest,
    ) -> Result<PingResponse, ActorError> {
        loop {
            match actor.call(request.clone()).await {
                Err(ActorError::Died { .. }) => tokio::time::sleep(Duration::from_millis(5)).await,
                other => return other,
            }
        }
    }

    fn snapshot(version: u64, n: usize) -> WeightSnapshot {
        WeightSnapshot::new(
            version,
            Arc::new(kernels::tensor::TensorSet {
                tensors: vec![
                    kernels::tensor::Tensor {
                        name: "a".into(),
                        shape: vec![n],
                        data: (0..n).map(|i| i as f32).collect(),
                    },
                    kernels::tensor::Tensor {
                        name: "b".into(),
                        shape: vec![3],
                        data: vec![-1.0, 0.5, 2.0].into(),
                    },
                ],
            }),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn agents_host_actors_that_restart_elsewhere_when_their_agent_goes() {
        let (head, token) = loopback_head().await;
        let (stop_a, task_a) = agent(&head, "a", &token);
        let (_stop_b, _task_b) = agent(&head, "b", &token);
        let agents = head
            .wait_for_agents(2, Duration::from_secs(10))
            .await
            .expect("both register");
        assert_eq!(
            agents.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(agents[0].kinds, ["ping"]);

        let pool = ping_pool();
        let restart = RestartPolicy {
            max_restarts: 2,
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            ..Default::default()
        };
        let weights = snapshot(7, 2500);
        let pushed = weights.clone();
        let hook: crate::RestartHook<Ping> = Arc::new(move |actor| {
            let w = pushed.clone();
            Box::pin(async move { actor.load_weights(w).await })
        });
        let options = SpawnOptions {
            restart,
            on_restart: Some(hook),
            ..SpawnOptions::default()
        };
        let refs = head
            .spawn_pool::<Ping>(&pool, |_| (), options)
            .await
            .expect("placed");
        let mut places: Vec<String> = refs.iter().map(|r| r.location()).collect();
        places.sort();
        assert_eq!(places, ["a", "b"], "spread puts one on each agent");
        for r in &refs {
            let answer = r
                .call(PingRequest::Echo(r.name().into()))
                .await
                .expect("answers");
            assert_eq!(answer, PingResponse::Echo(r.name().into()));
            r.load_weights(weights.clone())
                .await
                .expect("shared memory push");
        }
        let e = refs[0]
            .call(PingRequest::Fail("no".into()))
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), "actor `ping-0` failed: no");
        assert!(!e.is_retryable());
        // Whether a failure may pass crosses the wire.
        let e = refs[0]
            .call(PingRequest::Unavailable("busy".into()))
            .await
            .unwrap_err();
        assert!(e.is_retryable(), "{e:?}");
        // Both cpus of each agent: one taken by a ping actor.
        let e = head
            .place(&[PoolSpec {
                actors: 3,
                ..pool.clone()
            }])
            .unwrap_err();
        assert!(e.to_string().contains("2 of 3 placed"), "{e}");

        // Lose agent `a`: its actor comes back on `b` with the weights re-pushed by the hook.
        let on_a = lose_a(&refs, stop_a, task_a).await;
        let t0 = Instant::now();
        let answer = until_up(&on_a, PingRequest::Weights)
            .await
            .expect("restarted on b");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "restart took {:?}",
            t0.elapsed()
        );
        assert_eq!(on_a.location(), "b");
        let expect = crate::snapshot::content_crc(weights.params().unwrap());
        assert!(
            matches!(answer, PingResponse::Weights { version: Some(7), crc32c, .. } if crc32c == expect),
            "{answer:?}"
        );
        assert_eq!(head.agents().len(), 1);

        // A panic is noticed and restarted in place; then the restarts run out.
        let _ = on_a.call(PingRequest::Panic("drill".into())).await;
        let back = until_up(&on_a, PingRequest::Echo("back".into())).await;
        assert_eq!(
            back.expect("restarted after a panic"),
            PingResponse::Echo("back".into())
        );
        let _ = on_a.call(PingRequest::Panic("drill".into())).await;
        let e = until_up(&on_a, PingRequest::Echo("x".into()))
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("died 3 times") && e.to_string().contains("panicked: drill"),
            "{e}"
        );
        head.shutdown(true).await;
    }

    /// A borrower in this process whose lender is the head itself (in a server, the job's pipes
    /// carry the same calls).
    struct Direct(Head, &'static str);

    impl lend::Lender for Direct {
        fn poll(&self) -> Result<lend::Lent, String> {
            Ok(self.0.lend(self.1))
        }
        fn reserve(&self, agent: &str, actor_id: &str, demand: &Demand) -> Result<(), String> {
            self.0.lend_room(self.1, agent, actor_id, demand)
        }
        fn release(&self, agent: &str, actor_id: &str) -> Result<(), String> {
            self.0.lend_release(agent, actor_id);
            Ok(())
        }
    }

    fn free_cpus(head: &Head) -> Vec<(String, u32)> {
        head.rooms()
            .into_iter()
            .map(|a| (a.info.name, a.free.get(Device::Cpu)))
            .collect()
    }

    /// Waits (up to 10 s) until the lender's agents have `want` CPUs free.
    async fn until_free(head: &Head, want: &[(&str, u32)]) {
        let want: Vec<(String, u32)> = want.iter().map(|&(a, n)| (a.to_string(), n)).collect();
        let t0 = Instant::now();
        while free_cpus(head) != want {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{:?}",
                free_cpus(head)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_borrowing_head_spawns_on_the_lenders_agents_within_their_room_and_its_end_frees_it()
    {
        let (head, token) = loopback_head().await;
        let (stop_a, task_a) = agent(&head, "a", &token);
        let (_stop_b, _task_b) = agent(&head, "b", &token);
        head.wait_for_agents(2, Duration::from_secs(10))
            .await
            .expect("both register");
        let job = Head::borrow(&head.loan(), Arc::new(Direct(head.clone(), "job-1")))
            .await
            .expect("borrows");
        assert_eq!(
            job.agents(),
            head.agents(),
            "the lender's agents, as they are"
        );
        assert_eq!(job.address(), head.address());

        let pool = ping_pool();
        let options = SpawnOptions {
            restart: RestartPolicy {
                max_restarts: 2,
                backoff: Duration::from_millis(10),
                ..Default::default()
            },
            ..SpawnOptions::default()
        };
        let refs = job
            .spawn_pool::<Ping>(&pool, |_| (), options.clone())
            .await
            .expect("placed on borrowed agents");
        for r in &refs {
            let answer = r
                .call(PingRequest::Echo("hi".into()))
                .await
                .expect("answers");
            assert_eq!(answer, PingResponse::Echo("hi".into()));
            r.load_weights(snapshot(3, 100)).await.expect("pushed");
        }
        // The lender accounts for the borrower's actors, so another job cannot take their room.
        assert_eq!(free_cpus(&head), [("a".into(), 1), ("b".into(), 1)]);
        let other = Head::borrow(&head.loan(), Arc::new(Direct(head.clone(), "job-2")))
            .await
            .expect("borrows");
        let e = other
            .spawn_pool::<Ping>(
                &PoolSpec {
                    actors: 3,
                    ..pool.clone()
                },
                |_| (),
                options.clone(),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("2 of 3 placed"), "{e}");
        // At the lender, whatever a borrower's view: room another job holds is refused; room
        // the asking job's own actors hold is that job's to judge.
        let a = head.agents()[0].id.clone();
        let both = Demand::new("ping", Device::Cpu, 2);
        let e = head.lend_room("job-2", &a, "x", &both).unwrap_err();
        assert!(e.contains("cpu 1 free, 2 wanted"), "{e}");
        head.lend_room("job-1", &a, "y", &both)
            .expect("its own actor's room");
        head.lend_release(&a, "y");
        assert_eq!(free_cpus(&head), [("a".into(), 1), ("b".into(), 1)]);

        // The lender loses agent `a`: the borrower's actor there comes back on `b`.
        let on_a = lose_a(&refs, stop_a, task_a).await;
        let answer = until_up(&on_a, PingRequest::Echo("back".into()))
            .await
            .expect("restarted on b");
        assert_eq!(answer, PingResponse::Echo("back".into()));
        assert_eq!(on_a.location(), "b");
        until_free(&head, &[("b", 0)]).await;

        // The borrower's process ends without a word (here: its head simply goes quiet): the
        // lender stops what it left and frees the room.
        job.shutdown(false).await;
        assert_eq!(head.end_loan("job-1"), 2);
        until_free(&head, &[("b", 2)]).await;
        assert_eq!(head.end_loan("job-1"), 0, "nothing left to stop");
        drop(refs);
        head.shutdown(true).await;
    }

    /// Found by a chaos run: an agent killed while it was the only one with room had its actor's
    /// restarts all spent in under a second on "cannot place", and the job failed. A restart now
    /// waits for room, and waiting is not dying.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restart_waits_for_an_agent_with_room_without_spending_its_budget() {
        let (head, token) = loopback_head().await;
        let (stop_a, task_a) = agent(&head, "a", &token);
        head.wait_for_agents(1, Duration::from_secs(10))
            .await
            .expect("registers");
        let options = SpawnOptions {
            restart: RestartPolicy {
                max_restarts: 1,
                backoff: Duration::from_millis(10),
                place_wait: Duration::from_secs(20),
                ..Default::default()
            },
            ..SpawnOptions::default()
        };
        let demand = Demand {
            kind: String::new(),
            devices: BTreeMap::from([(Device::Cpu, 1)]),
            labels: BTreeMap::new(),
        };
        let ping = head
            .spawn::<Ping>("ping", (), demand, options)
            .await
            .expect("starts on a");
        assert_eq!(ping.location(), "a");
        drop(stop_a);
        task_a.await.expect("joins").expect("agent a stops cleanly");
        // The head notices the loss; then nobody has room for a while (the restart waits, it
        // does not fail); then an agent joins.
        let t0 = Instant::now();
        while ping.location() != "restarting" {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the loss went unnoticed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(ping.location(), "restarting");
        let (_stop_b, _task_b) = agent(&head, "b", &token);
        let answer = until_up(&ping, PingRequest::Echo("back".into()))
            .await
            .expect("restarted on b once it joined");
        assert_eq!(answer, PingResponse::Echo("back".into()));
        assert_eq!(ping.location(), "b");
        // One real death in the budget still allows none more: the next one is final.
        let _ = ping.call(PingRequest::Panic("drill".into())).await;
        let e = until_up(&ping, PingRequest::Echo("x".into()))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("died 2 times"), "{e}");
        head.shutdown(true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn snapshots_cross_by_grpc_with_a_matching_digest() {
        let token = Token::generate().expect("urandom");
        let mut cfg = config();
        cfg.wire.shared_memory = false;
        let head = Head::serve("127.0.0.1:0".parse().expect("addr"), token.clone(), cfg)
            .await
            .expect("binds");
        let (_stop, _task) = agent(&head, "a", &token);
        head.wait_for_agents(1, Duration::from_secs(10))
            .await
            .expect("registers");
        let ping = head
            .spawn::<Ping>(
                "p",
                (),
                Demand::new("ping", Device::Cpu, 1),
                SpawnOptions::default(),
            )
            .await
            .expect("spawns");
        let weights = snapshot(3, 10_000);
        ping.load_weights(weights.clone()).await.expect("gRPC push");
        let r = ping.call(PingRequest::Weights).await.expect("answers");
        let expect = crate::snapshot::content_crc(weights.params().unwrap());
        assert!(
            matches!(r, PingResponse::Weights { version: Some(3), tensors: 2, crc32c, .. } if crc32c == expect),
            "{r:?}"
        );
        // Tensor `a` as bf16 on the wire: it arrives rounded (its integers above 256 are not
        // all bf16 values), `b` exactly.
        let first = snapshot(4, 10_000);
        let next = WeightSnapshot::new(
            4,
            Arc::new(kernels::tensor::TensorSet {
                tensors: first
                    .params()
                    .unwrap()
                    .tensors
                    .iter()
                    .map(|t| kernels::tensor::Tensor {
                        data: t.data.iter().map(|v| v * 1.001).collect(),
                        ..t.clone()
                    })
                    .collect(),
            }),
        );
        ping.load_weights_as(next.clone(), Some(&[true, false]))
            .await
            .expect("gRPC push in bf16");
        let mut rounded = (**next.params().unwrap()).clone();
        rounded.tensors[0].data = kernels::bf16::rounded(&rounded.tensors[0].data).into();
        let (exact, expect) = (
            crate::snapshot::content_crc(next.params().unwrap()),
            crate::snapshot::content_crc(&rounded),
        );
        assert_ne!(exact, expect, "the test's values are not all bf16 already");
        let r = ping.call(PingRequest::Weights).await.expect("answers");
        assert!(
            matches!(r, PingResponse::Weights { version: Some(4), crc32c, .. } if crc32c == expect),
            "{r:?}"
        );
        head.shutdown(true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_with_the_wrong_token_is_refused() {
        let token = Token::generate().expect("urandom");
        let head = Head::serve("127.0.0.1:0".parse().expect("addr"), token, config())
            .await
            .expect("binds");
        let wrong = Token::generate().expect("urandom");
        let (_stop, task) = agent(&head, "intruder", &wrong);
        let e = task.await.expect("joins").unwrap_err().to_string();
        assert!(e.contains("refused this agent: wrong cluster token"), "{e}");
        assert!(head.agents().is_empty());
        head.shutdown(false).await;
    }
}
