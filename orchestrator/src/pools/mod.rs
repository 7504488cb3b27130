//! Actor pools: the generic pool of supervised actors ([`actor_pool`]), the rollout pool over it
//! (or over external servers), where a job meets its agents ([`Cluster`]), and the retry of
//! calls that may pass.
//!
//! Owns: placing, starting and supervising a pool's actors, routing calls to them, and fanning
//! out weights. Never: samples, trains or scores.

pub mod actor_pool;
pub mod bench;
pub mod external;
pub mod learner;
pub mod rollout;

pub(crate) use crate::lock;
use actors::{ActorError, ActorRef, Device, Head, HeadConfig, PoolSpec, Strategy, Token};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Why a pool could not start or do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// An engine refused or did not answer.
    #[error(transparent)]
    Engine(#[from] ::rollout::EngineError),
    /// An actor (or its agent) failed.
    #[error(transparent)]
    Actor(#[from] ActorError),
    /// Weights left on a device could not be read back.
    #[error(transparent)]
    DeviceWeights(#[from] kernels::tensor::DeviceReadError),
    /// An external engine could not be reached when the pool started.
    #[error("pools.rollout.endpoints[{index}]: {api} engine at {url}: {source}")]
    Endpoint {
        /// Its index in the list.
        index: usize,
        /// Its URL.
        url: String,
        /// Its API.
        api: &'static str,
        /// What happened.
        source: ::rollout::EngineError,
    },
    /// Every engine is out of service and none came back in time.
    #[error(
        "every rollout engine is out of service and none came back within {wait:.0?} (pools.rollout.timeout_s): {why}"
    )]
    AllDown {
        /// How long the pool waited.
        wait: Duration,
        /// Each engine and why it is out.
        why: String,
    },
    /// Agents are needed and no place to meet them was given.
    #[error(
        "pools.{pool}.placement places actors on agents: run with --listen ADDR --token-file FILE and start agents with `trellis agent --head http://ADDR --token-file FILE`"
    )]
    NoCluster {
        /// The pool (`rollout`, `learner`).
        pool: String,
    },
    /// The head could not listen.
    #[error("cannot listen on {listen}: {message}")]
    Listen {
        /// The address.
        listen: SocketAddr,
        /// What went wrong.
        message: String,
    },
    /// A learner rank died or restarted: its weights and optimiser state are gone, and the
    /// policy continues only from a checkpoint.
    #[error("learner rank lost: {0}")]
    RankLost(String),
    /// Asked to stop while waiting for agents.
    #[error("stopped on request while waiting for agents that can take the job's pools")]
    StoppedWaiting,
    /// The pool's own runtime or tasks failed.
    #[error("rollout pool: {0}")]
    Runtime(String),
    /// The probe model of an external pool.
    #[error(transparent)]
    Learner(#[from] ::learner::Error),
    /// A file of an external pool's weight folders.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

impl PoolError {
    /// Whether trying again can succeed: an engine or agent that did not answer.
    pub fn is_retryable(&self) -> bool {
        match self {
            PoolError::Engine(e) => matches!(e, ::rollout::EngineError::Unavailable(_)),
            PoolError::Actor(e) => e.is_retryable(),
            PoolError::AllDown { .. } => true,
            _ => false,
        }
    }
}

/// Where a job meets agents, when a pool is placed on them.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// The head agents register with.
    pub head: ClusterHead,
    /// How long to wait for agents that can take the pool.
    pub wait: Duration,
}

/// The head of a [`Cluster`].
#[derive(Clone)]
pub enum ClusterHead {
    /// The job starts its own head for its life (`trellis train --listen`).
    Listen {
        /// Address to listen on (port 0: any).
        listen: SocketAddr,
        /// The cluster token agents present.
        token: Token,
    },
    /// A head that outlives the job (`trellis serve`'s): agents stay registered between jobs.
    Shared(Head),
}

impl std::fmt::Debug for ClusterHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Listen { listen, .. } => write!(f, "Listen({listen})"),
            Self::Shared(h) => write!(f, "Shared({})", h.address()),
        }
    }
}

/// A pool's demand on agents as the head places it: `count` actors of `kind`, one `device` each.
pub fn agent_spec(
    name: &str,
    kind: &str,
    count: usize,
    device: Device,
    strategy: Strategy,
) -> PoolSpec {
    PoolSpec {
        name: name.into(),
        kind: kind.into(),
        actors: count.max(1) as u32,
        device,
        per_actor: 1,
        strategy,
        labels: Default::default(),
        colocate: None,
    }
}

/// The agent (its id) of each pair of `specs`' colocated pools, by index, as `head` places
/// them now.
pub fn pairs(head: &Head, specs: &[PoolSpec]) -> Result<Vec<String>, PoolError> {
    let first = specs.iter().find(|s| s.colocate.is_some()).map(|s| &s.name);
    let mut placed = head.place(specs)?;
    placed.retain(|a| Some(&a.pool) == first);
    placed.sort_by_key(|a| a.index);
    Ok(placed.into_iter().map(|a| a.agent).collect())
}

/// Where every pool of one job meets its agents, for the job's life: the server's head, or —
/// for a job that listens (`trellis train --listen`) — a head started here, so that the job's
/// pools share one port and the room they need together is known before any of them starts.
pub struct Meeting {
    rt: tokio::runtime::Runtime,
    head: Head,
    /// The head was started here (shut down with the meeting).
    owned: bool,
    wait: Duration,
}

impl Meeting {
    /// The meeting of `cluster`; `note` is told where agents register when a head starts here.
    pub fn open(cluster: &Cluster, note: &mut dyn FnMut(&str)) -> Result<Self, PoolError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("job-head")
            .enable_all()
            .build()
            .map_err(|e| PoolError::Runtime(format!("cannot start the head's runtime: {e}")))?;
        let (head, owned) = match &cluster.head {
            ClusterHead::Listen { listen, token } => {
                let head = rt
                    .block_on(Head::serve(*listen, token.clone(), HeadConfig::default()))
                    .map_err(|e| PoolError::Listen {
                        listen: *listen,
                        message: e.to_string(),
                    })?;
                note(&format!(
                    "waiting up to {:.0?} for agents to register at http://{}",
                    cluster.wait,
                    head.address()
                ));
                (head, true)
            }
            ClusterHead::Shared(head) => (head.clone(), false),
        };
        Ok(Self {
            rt,
            head,
            owned,
            wait: cluster.wait,
        })
    }

    /// The cluster the job's pools start on: this meeting's head, shared by them.
    pub fn cluster(&self) -> Cluster {
        Cluster {
            head: ClusterHead::Shared(self.head.clone()),
            wait: self.wait,
        }
    }

    /// The agent (its id) of each pair of `specs`' colocated pools (`placement: colocate`), by
    /// index, as the placement puts them now: where both pools then start their actors.
    pub fn pairs(&self, specs: &[PoolSpec]) -> Result<Vec<String>, PoolError> {
        pairs(&self.head, specs)
    }

    /// Where agents register.
    pub fn address(&self) -> SocketAddr {
        self.head.address()
    }

    /// Waits (up to the cluster's wait) until every pool of `specs` fits on the live agents at
    /// once; otherwise the placement's error, naming what is missing, before any pool started.
    pub fn wait_for_room(
        &self,
        specs: &[PoolSpec],
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), PoolError> {
        if specs.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + self.wait;
        loop {
            match self.head.place(specs) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(PoolError::Actor(e)),
                Err(_) if stop() => return Err(PoolError::StoppedWaiting),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for Meeting {
    fn drop(&mut self) {
        if self.owned {
            // Agents stay up; a head started for the job goes with it.
            self.rt.block_on(self.head.shutdown(false));
        }
    }
}

/// Runs `op` against `actor`, again (up to 5 times, backing off) when the failure may pass: the
/// actor died or its agent was lost meanwhile (the supervisor restarts it elsewhere and gives it
/// the current weights), or its handler said the call may succeed later.
pub(crate) async fn retry<A, T, F, Fut>(actor: &ActorRef<A>, mut op: F) -> Result<T, ActorError>
where
    A: actors::Actor,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ActorError>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if e.is_retryable() && attempt < 5 => {
                attempt += 1;
                tracing::warn!(actor = actor.name(), "{e}; retrying (attempt {attempt})");
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                actor.ready().await?;
            }
            other => return other,
        }
    }
}
