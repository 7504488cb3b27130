//! [`ActorPool`]: `count` actors of one kind, supervised, in this process or placed on the
//! agents of a head by the device they really use, each given the pool's current weights when
//! it starts and again whenever it is restarted. The rollout pool holds one; a learner pool
//! holds another of its own kind.
//!
//! Owns: placing, spawning, the restart hook and weight fan-out of one pool of actors. Never:
//! routes calls (the role over the pool does) or knows what its actors compute.

use super::{Cluster, ClusterHead, PoolError, lock, retry};
use crate::plan::{Device, Placement};
use actors::{Actor, ActorRef, Head, HeadConfig, RestartHook, SpawnOptions};
use kernels::tensor::WeightSnapshot;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Told the name of an actor that restarted.
pub type OnRestart = Arc<dyn Fn(&str) + Send + Sync>;

/// What a pool is made of and where it runs.
pub struct PoolShape<'a, A: Actor> {
    /// The pool's name (its actors are `<name>-<i>`).
    pub name: &'a str,
    /// Actors in the pool.
    pub count: usize,
    /// How each one starts (`i`: its index).
    pub config: &'a (dyn Fn(usize) -> A::Config + Sync),
    /// Where they run.
    pub placement: Placement,
    /// The device each occupies (what placement counts).
    pub device: Device,
    /// Where agents register, when placed on them.
    pub cluster: Option<&'a Cluster>,
    /// Whether the job was asked to stop (ends a wait for agents).
    pub stop: &'a (dyn Fn() -> bool + Sync),
    /// Told what people must know while the pool starts (where agents register).
    pub note: &'a mut dyn FnMut(&str),
    /// Told the name of every actor that restarts, before it gets the pool's weights back.
    pub on_restart: Option<OnRestart>,
    /// On agents: the agent (its id) each actor starts on, by index — beside another pool's
    /// actors (`placement: colocate`); `None`: wherever the placement's strategy puts them.
    /// A restart goes wherever there is room.
    pub beside: Option<&'a [String]>,
}

/// A pool of supervised actors of kind `A` that take weights.
pub struct ActorPool<A: Actor> {
    actors: Vec<ActorRef<A>>,
    /// The head this pool started (shut down with the pool).
    head: Option<Head>,
    /// The weights every actor serves (a restarted actor gets them back).
    current: Arc<Mutex<WeightSnapshot>>,
}

impl<A: Actor> ActorPool<A> {
    /// Starts the pool of `shape`, every actor with `weights`.
    pub async fn start(
        shape: PoolShape<'_, A>,
        weights: WeightSnapshot,
    ) -> Result<Self, PoolError> {
        let current = Arc::new(Mutex::new(weights.clone()));
        let for_hook = Arc::clone(&current);
        let told = shape.on_restart.clone();
        let hook: RestartHook<A> = Arc::new(move |actor| {
            if let Some(tell) = &told {
                tell(actor.name());
            }
            let snap = lock(&for_hook).clone();
            Box::pin(async move { actor.load_weights(snap).await })
        });
        let mut options = SpawnOptions {
            on_restart: Some(Arc::clone(&hook)),
            ..Default::default()
        };
        // A restart on agents waits for room as long as the job waits for agents at its start.
        if let Some(cluster) = shape.cluster {
            options.restart.place_wait = cluster.wait;
        }
        let count = shape.count.max(1);
        let (head, actors) = match shape.placement {
            Placement::Local => {
                let mut actors = Vec::with_capacity(count);
                for i in 0..count {
                    let name = format!("{}-{i}", shape.name);
                    let a =
                        actors::spawn_local::<A>(&name, (shape.config)(i), options.clone()).await?;
                    actors.push(a);
                }
                (None, actors)
            }
            Placement::Agents(strategy) => {
                let cluster = shape.cluster.ok_or_else(|| PoolError::NoCluster {
                    pool: shape.name.into(),
                })?;
                let spec = super::agent_spec(shape.name, A::KIND, count, shape.device, strategy);
                let (head, owned) = match &cluster.head {
                    ClusterHead::Listen { listen, token } => {
                        let head = Head::serve(*listen, token.clone(), HeadConfig::default())
                            .await
                            .map_err(|e| PoolError::Listen {
                                listen: *listen,
                                message: e.to_string(),
                            })?;
                        (shape.note)(&format!(
                            "{} pool: waiting up to {:.0?} for agents to register at http://{}",
                            shape.name,
                            cluster.wait,
                            head.address()
                        ));
                        (head.clone(), Some(head))
                    }
                    ClusterHead::Shared(head) => (head.clone(), None),
                };
                if let Some(agents) = shape.beside {
                    // Where the pairs were placed (their room checked then): no waiting here.
                    let mut actors = Vec::with_capacity(count);
                    for (i, agent) in agents.iter().enumerate().take(count) {
                        let demand = actors::Demand::new(A::KIND, shape.device, 1);
                        let name = format!("{}-{i}", shape.name);
                        let config = (shape.config)(i);
                        let (agent, options) = (Some(agent.clone()), options.clone());
                        actors.push(head.spawn_at(&name, config, demand, agent, options).await?);
                    }
                    (owned, actors)
                } else {
                    let deadline = Instant::now() + cluster.wait;
                    loop {
                        match head.place(std::slice::from_ref(&spec)) {
                            Ok(_) => break,
                            Err(e) if Instant::now() >= deadline => {
                                return Err(PoolError::Actor(e));
                            }
                            // Waiting can be long (agents still starting): a stop ends it.
                            Err(_) if (shape.stop)() => return Err(PoolError::StoppedWaiting),
                            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                        }
                    }
                    let config = shape.config;
                    let actors = head
                        .spawn_pool::<A>(&spec, |i| config(i as usize), options.clone())
                        .await?;
                    (owned, actors)
                }
            }
        };
        // Every actor starts with the current weights — again when its agent was lost
        // meanwhile (it restarted elsewhere), as for any push.
        for a in &actors {
            retry(a, || a.load_weights(weights.clone())).await?;
        }
        Ok(Self {
            actors,
            head,
            current,
        })
    }

    /// The actors.
    pub fn actors(&self) -> &[ActorRef<A>] {
        &self.actors
    }

    /// Hands `snapshot` to every actor, concurrently, before returning, each by
    /// `give(actor, snapshot)` (`ActorRef::load_weights`, or a way to fetch the same weights
    /// from elsewhere); an actor that dies meanwhile gets `snapshot` from the restart hook.
    /// `rt`: where the pushes run.
    pub async fn push_with<F, Fut>(
        &self,
        rt: &tokio::runtime::Handle,
        snapshot: WeightSnapshot,
        give: F,
    ) -> Result<(), PoolError>
    where
        F: Fn(ActorRef<A>, WeightSnapshot) -> Fut + Clone + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), actors::ActorError>> + Send,
    {
        *lock(&self.current) = snapshot.clone();
        let pushes: Vec<_> = self
            .actors
            .iter()
            .map(|a| {
                let (a, s, give) = (a.clone(), snapshot.clone(), give.clone());
                rt.spawn(async move { retry(&a, || give(a.clone(), s.clone())).await })
            })
            .collect();
        for p in pushes {
            p.await
                .map_err(|e| PoolError::Runtime(format!("a weight push was lost: {e}")))??;
        }
        Ok(())
    }

    /// Stops every actor (waiting up to 5 s for them to be down) and the head the pool
    /// started; a shared head's agents get their resources back for the next job.
    pub async fn shutdown(&mut self) {
        let all = async {
            for a in &self.actors {
                a.stop_and_wait().await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(5), all)
            .await
            .is_err()
        {
            tracing::warn!("actors did not stop within 5 s");
        }
        // Agents stay up for the next job; they only lose this job's actors.
        if let Some(head) = self.head.take() {
            head.shutdown(false).await;
        }
    }
}
