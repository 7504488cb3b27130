//! The rollout pool: `pools.rollout.count` rollout actors (kind `rollout`, each owning a native
//! engine on its own worker thread with its share of the KV-cache budget), spawned through the
//! actor runtime with supervision. A call's requests are spread over the actors by prompt (the
//! `n` samples of one prompt stay on one engine, where they share the prompt's prefill),
//! least-loaded first; every weight update goes to every actor before the next generation
//! starts, and an actor that dies is restarted and given the current weights before it takes
//! another call.
//!
//! Owns: the `rollout` actor kind, routing requests to actors, and fanning out weights. Never:
//! samples, trains or scores.

use crate::train::RunError;
use crate::workflow::Pool;
use actors::{
    Actor, ActorError, ActorRef, Device, Head, HeadConfig, PoolSpec, RestartHook, SpawnOptions,
    Strategy, Token,
};
use learner::snapshot::WeightSnapshot;
use learner::{Model, ModelConfig};
use rollout::native::{NativeConfig, NativeEngine};
use rollout::{Completion, GenerateRequest, InferenceEngine};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a rollout actor starts: the model's shape (its weights arrive by `load_weights`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RolloutConfig {
    /// The model's Hugging Face `config.json` fields.
    pub model: serde_json::Value,
    /// KV-cache budget of this actor's engine, in bytes.
    pub kv_cache_bytes: usize,
}

/// What a rollout actor is asked.
#[derive(Debug, Serialize, Deserialize)]
pub enum RolloutRequest {
    /// Generate completions (ordered by request, then sample).
    Generate(Vec<GenerateRequest>),
}

/// An inference engine as an actor. Its engine starts with the first weights it is given.
pub struct RolloutActor {
    config: ModelConfig,
    kv_cache_bytes: usize,
    engine: Option<NativeEngine>,
}

impl Actor for RolloutActor {
    const KIND: &'static str = "rollout";
    type Config = RolloutConfig;
    type Request = RolloutRequest;
    type Response = Vec<Completion>;

    fn start(config: RolloutConfig) -> Result<Self, String> {
        let mc = ModelConfig::from_json(config.model, Path::new("rollout actor config"))
            .map_err(|e| e.to_string())?;
        Ok(Self {
            config: mc,
            kv_cache_bytes: config.kv_cache_bytes,
            engine: None,
        })
    }

    async fn handle(&mut self, request: RolloutRequest) -> Result<Vec<Completion>, String> {
        let engine = self
            .engine
            .as_ref()
            .ok_or("no weights yet: push a snapshot before generating")?;
        match request {
            RolloutRequest::Generate(reqs) => {
                engine.generate(reqs).await.map_err(|e| e.to_string())
            }
        }
    }

    async fn load_weights(&mut self, snapshot: WeightSnapshot) -> Result<(), String> {
        if let Some(engine) = &self.engine {
            // Pushing the version already served is a no-op (a retried push after a restart
            // whose hook delivered it first).
            if engine.weight_version() == snapshot.version {
                return Ok(());
            }
            return engine
                .update_weights(snapshot)
                .await
                .map_err(|e| e.to_string());
        }
        let params = Arc::unwrap_or_clone(snapshot.params);
        let model = Model::new(self.config.clone(), params).map_err(|e| e.to_string())?;
        self.engine = Some(NativeEngine::new(
            model,
            NativeConfig {
                kv_cache_bytes: self.kv_cache_bytes,
                initial_version: snapshot.version,
                ..Default::default()
            },
        ));
        Ok(())
    }
}

/// Where a run meets agents, when a pool is placed on them.
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
    /// The run starts its own head for the run's life (`trellis train --listen`).
    Listen {
        /// Address to listen on (port 0: any).
        listen: SocketAddr,
        /// The cluster token agents present.
        token: Token,
    },
    /// A head that outlives the run (`trellis serve`'s): agents stay registered between jobs.
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

/// The rollout actors of a run.
pub(crate) struct RolloutPool {
    rt: tokio::runtime::Runtime,
    /// The head this pool started (shut down with the pool).
    head: Option<Head>,
    actors: Vec<ActorRef<RolloutActor>>,
    /// The weights every actor serves (a restarted actor gets them back).
    current: Arc<Mutex<WeightSnapshot>>,
}

impl RolloutPool {
    /// `pool.count` rollout actors of `model`, each with `kv_cache_bytes`, serving its weights
    /// as `version`: in this process (`placement: local`), or on the agents that register with
    /// a head started on `cluster`.
    pub(crate) fn new(
        model: &Model,
        pool: &Pool,
        kv_cache_bytes: usize,
        version: u64,
        cluster: Option<&Cluster>,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Result<Self, RunError> {
        let count = pool.count.max(1);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rollout-pool")
            .enable_all()
            .build()
            .map_err(|e| RunError::Other(format!("cannot start the actor runtime: {e}")))?;
        let snapshot = WeightSnapshot {
            version,
            params: Arc::new(model.params.clone()),
        };
        let current = Arc::new(Mutex::new(snapshot.clone()));
        let for_hook = Arc::clone(&current);
        let hook: RestartHook<RolloutActor> = Arc::new(move |actor| {
            let snap = for_hook.lock().unwrap_or_else(|p| p.into_inner()).clone();
            Box::pin(async move { actor.load_weights(snap).await })
        });
        let options = SpawnOptions {
            on_restart: Some(Arc::clone(&hook)),
            ..Default::default()
        };
        let local = pool.placement == "local";
        let config = RolloutConfig {
            model: model.config.to_hf_json(),
            kv_cache_bytes: if local {
                kv_cache_bytes / count
            } else {
                kv_cache_bytes
            },
        };
        let (head, actors) = if local {
            let actors = rt.block_on(async {
                let mut actors = Vec::with_capacity(count);
                for i in 0..count {
                    let a = actors::spawn_local::<RolloutActor>(
                        &format!("rollout-{i}"),
                        config.clone(),
                        options.clone(),
                    )
                    .await?;
                    actors.push(a);
                }
                Ok::<_, actors::ActorError>(actors)
            })?;
            (None, actors)
        } else {
            let cluster = cluster.ok_or_else(|| {
                RunError::Other(format!(
                    "pools.rollout.placement `{}` places engines on agents: run with --listen ADDR --token-file FILE and start agents with `trellis agent --head http://ADDR --token-file FILE`",
                    pool.placement
                ))
            })?;
            let spec = PoolSpec {
                name: "rollout".into(),
                kind: RolloutActor::KIND.into(),
                actors: count as u32,
                device: Device::Cpu,
                per_actor: 1,
                strategy: if pool.placement == "spread" {
                    Strategy::Spread
                } else {
                    Strategy::Pack
                },
                labels: Default::default(),
                colocate: None,
            };
            let (head, actors) = rt.block_on(async {
                let (head, owned) = match &cluster.head {
                    ClusterHead::Listen { listen, token } => {
                        let head = Head::serve(*listen, token.clone(), HeadConfig::default())
                            .await
                            .map_err(|e| {
                                RunError::Other(format!("cannot listen on {listen}: {e}"))
                            })?;
                        // Always said, even with --quiet: agents need this address.
                        eprintln!(
                            "rollout pool: waiting up to {:.0?} for agents to register at http://{}",
                            cluster.wait,
                            head.address()
                        );
                        (head.clone(), Some(head))
                    }
                    ClusterHead::Shared(head) => (head.clone(), None),
                };
                let deadline = Instant::now() + cluster.wait;
                loop {
                    match head.place(std::slice::from_ref(&spec)) {
                        Ok(_) => break,
                        Err(e) if Instant::now() >= deadline => return Err(RunError::Actor(e)),
                        // Waiting can be long (agents still starting): a stop ends it.
                        Err(_) if stop() => {
                            return Err(RunError::StoppedWaiting {
                                resume: String::new(),
                            });
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
                let actors = head
                    .spawn_pool::<RolloutActor>(&spec, |_| config.clone(), options.clone())
                    .await?;
                Ok((owned, actors))
            })?;
            (head, actors)
        };
        // Every actor starts with the current weights.
        rt.block_on(async {
            for a in &actors {
                a.load_weights(snapshot.clone()).await?;
            }
            Ok::<_, actors::ActorError>(())
        })?;
        Ok(Self {
            rt,
            head,
            actors,
            current,
        })
    }

    /// Where each actor runs (`local`, or its agent).
    pub(crate) fn locations(&self) -> Vec<String> {
        self.actors.iter().map(|a| a.location()).collect()
    }

    /// Actors in the pool.
    pub(crate) fn len(&self) -> usize {
        self.actors.len()
    }

    /// Generates `reqs` across the actors; completions come back ordered by request, then
    /// sample, as from one engine. A request goes whole to the actor with the fewest sampled
    /// sequences assigned so far (ties: the lowest index), so the split is deterministic.
    pub(crate) fn generate_blocking(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Completion>, RunError> {
        let mut load = vec![0usize; self.actors.len()];
        let mut shares: Vec<(Vec<usize>, Vec<GenerateRequest>)> =
            vec![(Vec::new(), Vec::new()); self.actors.len()];
        for (i, r) in reqs.into_iter().enumerate() {
            let e = (0..load.len()).min_by_key(|&e| (load[e], e)).unwrap_or(0);
            load[e] += r.params.n.max(1);
            shares[e].0.push(i);
            shares[e].1.push(r);
        }
        let calls: Vec<_> = shares
            .into_iter()
            .zip(&self.actors)
            .filter(|((index, _), _)| !index.is_empty())
            .map(|((index, reqs), actor)| {
                let actor = actor.clone();
                // Generation is a pure function of the weights and the requests' seeds, so a
                // call lost with its actor is simply made again on the restarted one.
                let call = self.rt.spawn(async move {
                    retry(&actor, || {
                        actor.call(RolloutRequest::Generate(reqs.clone()))
                    })
                    .await
                });
                (index, call)
            })
            .collect();
        let mut all = Vec::new();
        for (index, call) in calls {
            let out = self
                .rt
                .handle()
                .block_on(call)
                .map_err(|e| RunError::Other(format!("a rollout call was lost: {e}")))??;
            all.extend(out.into_iter().map(|mut c| {
                c.request = index[c.request];
                c
            }));
        }
        all.sort_by_key(|c| (c.request, c.index));
        Ok(all)
    }

    /// Swaps `snapshot` into every actor (each engine between its decode steps).
    pub(crate) fn update_weights_blocking(&self, snapshot: WeightSnapshot) -> Result<(), RunError> {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = snapshot.clone();
        let pushes: Vec<_> = self
            .actors
            .iter()
            .map(|a| {
                let (a, s) = (a.clone(), snapshot.clone());
                self.rt
                    .spawn(async move { retry(&a, || a.load_weights(s.clone())).await })
            })
            .collect();
        for p in pushes {
            self.rt
                .handle()
                .block_on(p)
                .map_err(|e| RunError::Other(format!("a weight push was lost: {e}")))??;
        }
        Ok(())
    }
}

/// Runs `op` against `actor`, again (up to 5 times) when the actor died or its agent was lost
/// meanwhile: the supervisor restarts it elsewhere and gives it the current weights.
async fn retry<T, F, Fut>(actor: &ActorRef<RolloutActor>, mut op: F) -> Result<T, ActorError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ActorError>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e @ (ActorError::Died { .. } | ActorError::Agent { .. })) if attempt < 5 => {
                attempt += 1;
                tracing::warn!(actor = actor.name(), "{e}; retrying (attempt {attempt})");
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                actor.ready().await?;
            }
            other => return other,
        }
    }
}

impl Drop for RolloutPool {
    fn drop(&mut self) {
        // Waited for: the runtime (and the supervisors' stop calls to agents) ends with the
        // pool, and a shared head's agents must get their resources back for the next job.
        self.rt.block_on(async {
            let stops = self.actors.iter().map(|a| a.stop_and_wait());
            let all = async {
                for s in stops {
                    s.await;
                }
            };
            if tokio::time::timeout(Duration::from_secs(5), all)
                .await
                .is_err()
            {
                tracing::warn!("rollout actors did not stop within 5 s");
            }
        });
        // Agents stay up for the next run; they only lose this run's actors.
        if let Some(head) = self.head.take() {
            self.rt.block_on(head.shutdown(false));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use learner::ModelConfig;
    use rollout::SamplingParams;
    use std::path::Path;

    #[test]
    fn a_pool_of_engines_gives_the_tokens_of_one_engine() {
        let cfg = serde_json::json!({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 64});
        let model = Model::init(ModelConfig::from_json(cfg, Path::new("t")).unwrap(), 5);
        let reqs: Vec<GenerateRequest> = (0..5u32)
            .map(|i| GenerateRequest {
                prompt: vec![1 + i, 2, 3],
                params: SamplingParams {
                    n: 1 + i as usize % 3,
                    max_tokens: 6,
                    seed: Some(i as u64),
                    ..Default::default()
                },
            })
            .collect();
        let pool = |count| crate::workflow::Pool {
            count,
            ..Default::default()
        };
        let one = RolloutPool::new(&model, &pool(1), 8 << 20, 0, None, &|| false).unwrap();
        let three = RolloutPool::new(&model, &pool(3), 8 << 20, 0, None, &|| false).unwrap();
        assert_eq!(three.len(), 3);
        let a = one.generate_blocking(reqs.clone()).unwrap();
        let b = three.generate_blocking(reqs).unwrap();
        let tokens = |v: &[Completion]| -> Vec<(usize, usize, Vec<u32>)> {
            v.iter()
                .map(|c| (c.request, c.index, c.token_ids.clone()))
                .collect()
        };
        assert_eq!(tokens(&a), tokens(&b));
        let snap = WeightSnapshot {
            version: 4,
            params: std::sync::Arc::new(model.params.clone()),
        };
        three.update_weights_blocking(snap).unwrap();
        let c = three
            .generate_blocking(vec![GenerateRequest {
                prompt: vec![1, 2],
                params: SamplingParams {
                    max_tokens: 2,
                    ..Default::default()
                },
            }])
            .unwrap();
        assert!(c[0].weight_versions.iter().all(|s| s.version == 4));
    }
}
