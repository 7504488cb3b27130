//! The rollout pool: `pools.rollout.count` rollout actors (kind `rollout`, each owning an engine
//! with its share of the KV-cache budget), spawned through the actor runtime with supervision —
//! in this process or on agents placed by the pool's real device — or external engine servers
//! at `pools.rollout.endpoints`. A call's requests are spread over the engines by prompt (the
//! `n` samples of one prompt stay on one engine, where they share the prompt's prefill),
//! least-loaded first; every weight update goes to every engine before the next generation
//! starts; an actor that dies is restarted and given the current weights before it takes
//! another call; an external engine that stops answering is out of service until it answers
//! again and serves the current weights.
//!
//! Owns: placing and routing, weight fan-out, and engine health. Never: samples, trains or
//! scores.

use super::actor_pool::{ActorPool, PoolShape};
use super::external::{Down, ExternalPool};
use super::{Cluster, PoolError, lock, retry};
use crate::kinds::rollout::{
    EngineSpec, RolloutActor, RolloutConfig, RolloutRequest, RolloutResponse,
};
use crate::plan::{Placement, RolloutEngine, RolloutPlan};
use actors::ActorRef;
use kernels::tensor::WeightSnapshot;
use learner::ModelConfig;
use learner::params::WeightDtype;
use rollout::episode::{Agent, AgentSetup};
use rollout::external::{Api, ExternalConfig, ExternalEngine, Load, WeightFolders};
use rollout::router::{Router, Weights};
use rollout::{Completion, EngineError, GenerateRequest};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One engine of a pool: an actor (in-process or on an agent), or an external server.
#[derive(Clone)]
enum Member {
    Actor(ActorRef<RolloutActor>),
    /// A server, and the agent that plays episodes beside its client.
    External(Arc<dyn ExternalEngine>, Option<Arc<Agent>>),
}

impl Member {
    fn location(&self) -> String {
        match self {
            Self::Actor(a) => a.location(),
            Self::External(e, _) => e.url().to_string(),
        }
    }

    async fn generate(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>, PoolError> {
        match self {
            // Generation is a pure function of the weights and the requests' seeds, so a call
            // lost with its actor is simply made again on the restarted one.
            Self::Actor(a) => {
                match retry(a, || a.call(RolloutRequest::Generate(reqs.clone()))).await? {
                    RolloutResponse::Completions(c) => Ok(c),
                    RolloutResponse::Pulled | RolloutResponse::Beside => Err(PoolError::Runtime(
                        format!("{} answered a generation with no completions", a.name()),
                    )),
                }
            }
            // An episode's turns run here, beside the server's client.
            Self::External(e, agent) => {
                let engine: &dyn rollout::InferenceEngine = e.as_ref();
                Ok(rollout::episode::generate(engine, agent.as_deref(), reqs).await?)
            }
        }
    }
}

/// How a rollout pool starts.
pub struct PoolStart<'a> {
    /// The pool's plan.
    pub plan: &'a RolloutPlan,
    /// The model the engines serve.
    pub config: &'a ModelConfig,
    /// The weights they start with.
    pub weights: WeightSnapshot,
    /// Where agents register, for a pool placed on them.
    pub cluster: Option<&'a Cluster>,
    /// Whether the job was asked to stop (ends a wait for agents).
    pub stop: &'a (dyn Fn() -> bool + Sync),
    /// The run directory (external engines' weight folders default to a folder in it).
    pub run_dir: &'a Path,
    /// The job trains on the engines' own log-probs (`async` mode).
    pub needs_processed: bool,
    /// Told what people must know while the pool starts (where agents register).
    pub note: &'a mut dyn FnMut(&str),
    /// How the engines' side plays episodes, when a stage has an environment.
    pub agent: Option<AgentSetup>,
    /// On agents: the agent (its id) each engine starts on, by index (`placement: colocate`:
    /// the agents of the engine–rank pairs); `None`: wherever the placement puts them.
    pub beside: Option<Vec<String>>,
}

/// The rollout engines of a job, and the router that spreads prompts over them.
pub struct RolloutPool {
    rt: tokio::runtime::Runtime,
    /// The engines as actors (none for external engines).
    actors: Option<ActorPool<RolloutActor>>,
    members: Vec<Member>,
    /// `Some` for an engine taken out of service.
    down: Mutex<Vec<Option<Down>>>,
    router: Mutex<Router>,
    external: Option<ExternalPool>,
    /// Native engines serving bf16: the tensors they read only rounded (sent as bf16 where a
    /// push is streamed to another host).
    bf16: Option<Arc<[bool]>>,
}

/// How the rollout actors took a weight update other than by being sent it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pulls {
    /// Read from the learner ranks' outboxes.
    pub from_ranks: usize,
    /// Taken from a learner rank in the actor's own process, shared (`placement: colocate`).
    pub beside: usize,
}

impl RolloutPool {
    /// Starts the pool of `start.plan`.
    pub fn new(start: PoolStart<'_>) -> Result<Self, PoolError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rollout-pool")
            .enable_all()
            .build()
            .map_err(|e| PoolError::Runtime(format!("cannot start the actor runtime: {e}")))?;
        let plan = start.plan;
        let (engine, kv_cache_bytes) = match &plan.engine {
            RolloutEngine::External(x) => {
                // Every endpoint at once. One that does not answer starts out of service (it
                // is connected when it answers, as an engine that went down later is), so an
                // engine restarting does not stop a job from starting or resuming; one that
                // answers wrongly, or none answering, stops the job before it starts.
                let (api, name) = api(x.api);
                let configs: Vec<ExternalConfig> = x
                    .endpoints
                    .iter()
                    .map(|url| ExternalConfig {
                        url: url.clone(),
                        model: x.model.clone(),
                        timeout: x.timeout,
                        health_check: x.health_check,
                        api_key: x.api_key.clone(),
                    })
                    .collect();
                let connected = rt.block_on(futures_util::future::join_all(
                    configs
                        .iter()
                        .map(|cfg| rollout::external::connect(api, cfg.clone())),
                ));
                let endpoint_error = |index: usize, source| PoolError::Endpoint {
                    index,
                    url: x.endpoints[index].clone(),
                    api: name,
                    source,
                };
                let agent = match &start.agent {
                    Some(a) => Some(Arc::new(Agent::new(a).map_err(PoolError::Runtime)?)),
                    None => None,
                };
                let mut engines = Vec::new();
                let mut down = Vec::new();
                let mut first_down = None;
                for (index, (result, cfg)) in connected.into_iter().zip(configs).enumerate() {
                    match result {
                        Ok(e) => engines.push(Member::External(Arc::from(e), agent.clone())),
                        Err(EngineError::Unavailable(msg)) => {
                            down.push((index, msg.clone()));
                            first_down.get_or_insert((index, msg));
                            engines.push(Member::External(
                                Arc::new(rollout::external::Pending::new(api, cfg)),
                                agent.clone(),
                            ));
                        }
                        Err(source) => return Err(endpoint_error(index, source)),
                    }
                }
                if let Some((index, msg)) = first_down.filter(|_| down.len() == engines.len()) {
                    return Err(endpoint_error(index, EngineError::Unavailable(msg)));
                }
                let root = x
                    .weights_dir
                    .clone()
                    .unwrap_or_else(|| start.run_dir.join("engine-weights"));
                let root = std::path::absolute(&root).map_err(|source| PoolError::Io {
                    path: root.clone(),
                    source,
                })?;
                let this = Self {
                    rt,
                    actors: None,
                    down: Mutex::new(engines.iter().map(|_| None).collect()),
                    router: Mutex::new(Router::new(engines.len(), Weights::default())),
                    members: engines,
                    bf16: None,
                    external: Some(ExternalPool {
                        folders: WeightFolders::new(root).with_dtype(x.weights_dtype),
                        config: start.config.clone(),
                        tolerance: x.tolerance,
                        needs_processed: start.needs_processed,
                        wait: x.timeout,
                        push_timeout: x.push_timeout,
                        probe: Mutex::new(None),
                        raw_warned: Default::default(),
                    }),
                };
                for (index, msg) in down {
                    this.take_out(index, msg);
                }
                // Whatever they served before, every engine starts on the job's weights.
                this.update_weights(start.weights)?;
                return Ok(this);
            }
            RolloutEngine::Native {
                kv_cache_bytes,
                weights_dtype,
                kv_cache_dtype,
            } => (
                EngineSpec::Native {
                    weights_dtype: *weights_dtype,
                    kv_cache_dtype: *kv_cache_dtype,
                },
                *kv_cache_bytes,
            ),
            RolloutEngine::Pjrt {
                device,
                plugin,
                kv_cache_bytes,
            } => (
                EngineSpec::Pjrt {
                    device: *device,
                    plugin: plugin.clone(),
                },
                *kv_cache_bytes,
            ),
        };
        let bf16 = match &engine {
            EngineSpec::Native {
                weights_dtype: WeightDtype::Bf16,
                ..
            } => {
                let (layout, specs) = learner::params::Layout::new(start.config);
                let mut marks = vec![false; specs.len()];
                layout.products().into_iter().for_each(|i| marks[i] = true);
                Some(Arc::from(marks))
            }
            _ => None,
        };
        let count = plan.count.max(1);
        let local = plan.placement == Placement::Local;
        let config = RolloutConfig {
            model: start.config.to_hf_json(),
            kv_cache_bytes: if local {
                kv_cache_bytes / count
            } else {
                kv_cache_bytes
            },
            engine,
            agent: start.agent,
        };
        let pool = rt.block_on(ActorPool::start(
            PoolShape {
                name: "rollout",
                count,
                config: &|_| config.clone(),
                placement: plan.placement,
                // Placed by the device the engine really uses: a pjrt pool on TPU counts TPU
                // chips.
                device: plan.device(),
                cluster: start.cluster,
                stop: start.stop,
                note: start.note,
                on_restart: None,
                beside: start.beside.as_deref(),
            },
            start.weights,
        ))?;
        let members: Vec<Member> = pool.actors().iter().cloned().map(Member::Actor).collect();
        let n = members.len();
        Ok(Self {
            rt,
            actors: Some(pool),
            members,
            down: Mutex::new((0..n).map(|_| None).collect()),
            router: Mutex::new(Router::new(n, Weights::default())),
            external: None,
            bf16,
        })
    }

    /// Engines in the pool.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the pool has no engine (never, once started).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Generates `reqs` across the engines; completions come back ordered by request, then
    /// sample, as from one engine. The router gives each request (all its samples) to one
    /// engine; the requests of an engine that stops answering go to the others, and it is
    /// taken out of service until it answers again and serves the current weights.
    pub fn generate(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>, PoolError> {
        self.rt.block_on(self.route(reqs))
    }

    /// Where each engine runs (`local`, its agent, or its URL).
    pub fn locations(&self) -> Vec<String> {
        self.members.iter().map(Member::location).collect()
    }

    /// Engines out of service now.
    pub fn down_count(&self) -> usize {
        lock(&self.down).iter().filter(|d| d.is_some()).count()
    }

    async fn route(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>, PoolError> {
        let mut todo: Vec<usize> = (0..reqs.len()).collect();
        let mut all = Vec::with_capacity(reqs.iter().map(|r| r.params.n).sum());
        let mut waiting_since: Option<Instant> = None;
        while !todo.is_empty() {
            let loads = self.loads().await;
            let batch: Vec<GenerateRequest> = todo.iter().map(|&i| reqs[i].clone()).collect();
            let route = lock(&self.router).route(&batch, &loads);
            let Some(route) = route else {
                // Every engine is out of service: wait for one to come back.
                let since = *waiting_since.get_or_insert_with(Instant::now);
                let wait = self.external.as_ref().map_or(Duration::ZERO, |x| x.wait);
                if since.elapsed() >= wait {
                    return Err(self.all_down(wait));
                }
                self.revive().await?;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            waiting_since = None;
            let mut shares: Vec<Vec<usize>> = vec![Vec::new(); self.members.len()];
            for (k, &e) in route.iter().enumerate() {
                shares[e].push(todo[k]);
            }
            let calls: Vec<_> = shares
                .into_iter()
                .enumerate()
                .filter(|(_, index)| !index.is_empty())
                .map(|(e, index)| {
                    let member = self.members[e].clone();
                    let share: Vec<GenerateRequest> =
                        index.iter().map(|&i| reqs[i].clone()).collect();
                    let call = self.rt.spawn(async move { member.generate(share).await });
                    (e, index, call)
                })
                .collect();
            // Engines out of service are tried while the others generate: a frozen one costs
            // its health check's time in parallel, not on the step's path. One that is back
            // takes prompts from the next round on.
            self.revive().await?;
            todo.clear();
            for (e, index, call) in calls {
                let out = call
                    .await
                    .map_err(|err| PoolError::Runtime(format!("a rollout call was lost: {err}")))?;
                match out {
                    Ok(cs) => all.extend(cs.into_iter().map(|mut c| {
                        c.request = index[c.request];
                        c
                    })),
                    Err(PoolError::Engine(EngineError::Unavailable(msg))) => {
                        self.take_out(e, msg);
                        todo.extend(index);
                    }
                    Err(err) => return Err(err),
                }
            }
            todo.sort_unstable();
        }
        all.sort_by_key(|c| (c.request, c.index));
        Ok(all)
    }

    /// The load of each engine in service (`None`: out of service). Actors report none.
    async fn loads(&self) -> Vec<Option<Load>> {
        let up: Vec<bool> = lock(&self.down).iter().map(Option::is_none).collect();
        let mut out = Vec::with_capacity(up.len());
        for (m, up) in self.members.iter().zip(up) {
            out.push(match (up, m) {
                (false, _) => None,
                (true, Member::Actor(_)) => Some(Load::default()),
                (true, Member::External(e, _)) => Some(e.load().await.unwrap_or_default()),
            });
        }
        out
    }

    fn take_out(&self, e: usize, error: String) {
        let backoff = Duration::from_millis(500);
        tracing::warn!(
            engine = %self.members[e].location(),
            "{error}; out of service, retried in {backoff:?}"
        );
        lock(&self.down)[e] = Some(Down {
            error,
            next_try: Instant::now() + backoff,
            backoff,
        });
    }

    fn all_down(&self, wait: Duration) -> PoolError {
        let down = lock(&self.down);
        let why: Vec<String> = self
            .members
            .iter()
            .zip(down.iter())
            .map(|(m, d)| {
                format!(
                    "{}: {}",
                    m.location(),
                    d.as_ref().map_or("in service", |d| d.error.as_str())
                )
            })
            .collect();
        PoolError::AllDown {
            wait,
            why: why.join("; "),
        }
    }

    /// Tries the engines out of service whose backoff is over: one that answers its health
    /// route gets the current weights, is checked, and is back in service.
    async fn revive(&self) -> Result<(), PoolError> {
        let Some(x) = &self.external else {
            return Ok(());
        };
        let due: Vec<usize> = lock(&self.down)
            .iter()
            .enumerate()
            .filter(|(_, d)| d.as_ref().is_some_and(|d| d.next_try <= Instant::now()))
            .map(|(i, _)| i)
            .collect();
        let probe = lock(&x.probe).clone();
        // Every engine due at once: each costs at most its health check's deadline.
        let attempts = due.into_iter().filter_map(|i| match &self.members[i] {
            Member::External(e, _) => Some((i, e)),
            Member::Actor(_) => None,
        });
        let attempts = attempts.map(|(i, e)| {
            let probe = &probe;
            async move {
                let result = match e.health().await {
                    Ok(()) => match probe {
                        Some(p) => x.reload_and_verify(&**e, p).await,
                        None => Ok(()),
                    },
                    Err(err) => Err(err),
                };
                (i, e, result)
            }
        });
        for (i, e, result) in futures_util::future::join_all(attempts).await {
            let mut down = lock(&self.down);
            match result {
                Ok(()) => {
                    tracing::info!(engine = e.url(), "back in service");
                    down[i] = None;
                }
                Err(EngineError::Unavailable(msg)) => {
                    if let Some(d) = &mut down[i] {
                        d.backoff = (d.backoff * 2).min(Duration::from_secs(30));
                        d.next_try = Instant::now() + d.backoff;
                        d.error = msg;
                    }
                }
                Err(err) => return Err(err.into()),
            }
        }
        Ok(())
    }

    /// Swaps `snapshot` into every engine in service before returning: actors between their
    /// decode steps; external engines by reloading a new folder, then checked with the probe.
    /// An engine that does not answer is taken out of service (it gets these weights when it
    /// returns).
    pub fn update_weights(&self, snapshot: WeightSnapshot) -> Result<(), PoolError> {
        self.update_weights_from(snapshot, None).map(|_| ())
    }

    /// [`RolloutPool::update_weights`], but actors on agents read the weights from `source`
    /// (the learner ranks' outboxes, each rank serving its shard) instead of being sent
    /// `snapshot` — which stays what a restarted actor gets, and what the others are handed.
    /// Returns how many actors took them from `source`.
    pub fn update_weights_from(
        &self,
        snapshot: WeightSnapshot,
        source: Option<actors::exchange::Source>,
    ) -> Result<Pulls, PoolError> {
        if let Some(pool) = &self.actors {
            let remote = |a: &ActorRef<RolloutActor>| a.agent_host().is_some();
            // What a pull needs (its source and the content CRC the read must match), when some
            // actor is on an agent to pull.
            let pull = match source.filter(|_| pool.actors().iter().any(remote)) {
                Some(s) => Some((s, actors::snapshot::content_crc(snapshot.params()?))),
                None => None,
            };
            let version = snapshot.version;
            let pulled: Arc<[AtomicUsize; 2]> = Arc::default();
            let counted = Arc::clone(&pulled);
            let bf16 = self.bf16.clone();
            self.rt.block_on(pool.push_with(
                self.rt.handle(),
                snapshot,
                move |a: ActorRef<RolloutActor>, s: WeightSnapshot| {
                    let (pull, counted, bf16) = (pull.clone(), Arc::clone(&counted), bf16.clone());
                    async move {
                        let Some((source, crc)) = pull.filter(|_| remote(&a)) else {
                            return a.load_weights_as(s, bf16.as_deref()).await;
                        };
                        let pull = RolloutRequest::Pull {
                            version,
                            source,
                            content_crc: crc,
                        };
                        match a.call(pull).await {
                            Ok(answer) => {
                                let beside = matches!(answer, RolloutResponse::Beside);
                                counted[usize::from(beside)].fetch_add(1, Ordering::Relaxed);
                                Ok(())
                            }
                            // A rank lost meanwhile (its agent killed), a link that broke: the
                            // driver holds the same weights, so it hands them over itself (the
                            // lost rank is found at the learner's next call).
                            Err(e) => {
                                tracing::warn!(
                                    actor = a.name(),
                                    "reading the weights from the learner ranks failed ({e}); sending them"
                                );
                                a.load_weights_as(s, bf16.as_deref()).await
                            }
                        }
                    }
                },
            ))?;
            return Ok(Pulls {
                from_ranks: pulled[0].load(Ordering::Relaxed),
                beside: pulled[1].load(Ordering::Relaxed),
            });
        }
        let Some(x) = &self.external else {
            return Ok(Pulls::default());
        };
        let probe = x.publish(&snapshot)?;
        let up: Vec<bool> = lock(&self.down).iter().map(Option::is_none).collect();
        // Every engine at once: a push costs the slowest engine's time, not their sum, and one
        // that stalls is cut off by the push deadline.
        let pushes = self
            .members
            .iter()
            .enumerate()
            .filter_map(|(i, m)| match (up[i], m) {
                (true, Member::External(e, _)) => Some((i, e)),
                _ => None,
            })
            .map(|(i, e)| {
                let probe = &probe;
                async move { (i, x.reload_and_verify(&**e, probe).await) }
            });
        let results = self.rt.block_on(futures_util::future::join_all(pushes));
        for (i, r) in results {
            match r {
                Ok(()) => {}
                Err(EngineError::Unavailable(msg)) => self.take_out(i, msg),
                Err(e) => return Err(e.into()),
            }
        }
        tracing::debug!(version = snapshot.version, "weights pushed");
        Ok(Pulls::default())
    }
}

/// The API of an external engine, and its name in messages.
fn api(engine: crate::plan::schema::Engine) -> (Api, &'static str) {
    use crate::plan::schema::Engine;
    match engine {
        Engine::Sglang => (Api::Sglang, "sglang"),
        Engine::Vllm => (Api::Vllm, "vllm"),
        Engine::Served | Engine::Native | Engine::Pjrt => (Api::Vllm, "served"),
    }
}

impl Drop for RolloutPool {
    fn drop(&mut self) {
        // Waited for: the runtime (and the supervisors' stop calls to agents) ends with the
        // pool, and a shared head's agents must get their resources back for the next job.
        if let Some(mut pool) = self.actors.take() {
            self.rt.block_on(pool.shutdown());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Placement;
    use learner::Model;
    use learner::params::WeightDtype;
    use rollout::SamplingParams;

    use crate::kinds::rollout::tests::tiny;

    fn start<'a>(
        plan: &'a RolloutPlan,
        model: &'a Model,
        note: &'a mut dyn FnMut(&str),
    ) -> PoolStart<'a> {
        PoolStart {
            plan,
            config: &model.config,
            weights: WeightSnapshot::new(0, Arc::new(model.params.clone())),
            cluster: None,
            stop: &|| false,
            run_dir: Path::new("."),
            needs_processed: false,
            note,
            agent: None,
            beside: None,
        }
    }

    #[test]
    fn a_pool_of_engines_gives_the_tokens_of_one_engine() {
        let model = tiny(5);
        let reqs: Vec<GenerateRequest> = (0..5u32)
            .map(|i| GenerateRequest {
                prompt: vec![1 + i, 2, 3],
                params: SamplingParams {
                    n: 1 + i as usize % 3,
                    max_tokens: 6,
                    seed: Some(i as u64),
                    ..Default::default()
                },
                episode: None,
            })
            .collect();
        let plan = |count| RolloutPlan {
            count,
            engine: RolloutEngine::Native {
                kv_cache_bytes: 8 << 20,
                weights_dtype: Default::default(),
                kv_cache_dtype: Default::default(),
            },
            placement: Placement::Local,
            colocated: false,
        };
        let (p1, p3) = (plan(1), plan(3));
        let mut note = |_: &str| {};
        let one = RolloutPool::new(start(&p1, &model, &mut note)).unwrap();
        let three = RolloutPool::new(start(&p3, &model, &mut note)).unwrap();
        assert_eq!(three.len(), 3);
        let a = one.generate(reqs.clone()).unwrap();
        let b = three.generate(reqs).unwrap();
        let tokens = |v: &[Completion]| -> Vec<(usize, usize, Vec<u32>)> {
            v.iter()
                .map(|c| (c.request, c.index, c.token_ids.clone()))
                .collect()
        };
        assert_eq!(tokens(&a), tokens(&b));
        let snap = WeightSnapshot::new(4, Arc::new(model.params.clone()));
        three.update_weights(snap).unwrap();
        let c = three
            .generate(vec![GenerateRequest {
                prompt: vec![1, 2],
                params: SamplingParams {
                    max_tokens: 2,
                    ..Default::default()
                },
                episode: None,
            }])
            .unwrap();
        assert!(c[0].weight_versions.iter().all(|s| s.version == 4));
    }

    #[test]
    fn a_push_the_engine_did_not_take_is_caught_by_the_probe() {
        let (a, b) = (tiny(5), tiny(6));
        let cfg = a.config.clone();
        let root = std::env::temp_dir().join(format!("trellis-probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        learner::checkpoint::save(
            &b,
            &[],
            &root.join("served"),
            None,
            learner::params::WeightDtype::F32,
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(engine_serve::serve(
            engine_serve::EngineServeOptions {
                kv_cache_bytes: 8 << 20,
                ..engine_serve::EngineServeOptions::new(engine_serve::ModelSource::Checkpoint(
                    root.join("served"),
                ))
            },
            move |addr, _| tx.send(addr).unwrap(),
            std::future::pending(),
        ));
        let addr = rx.recv().unwrap();
        let config = ExternalConfig {
            timeout: Duration::from_secs(30),
            ..ExternalConfig::new(format!("http://{addr}"))
        };
        let engine = rt
            .block_on(rollout::external::connect(Api::Vllm, config))
            .unwrap();
        let x = ExternalPool {
            folders: WeightFolders::new(root.join("weights")),
            config: cfg.clone(),
            tolerance: 1e-4,
            needs_processed: true,
            wait: Duration::from_secs(1),
            push_timeout: Duration::from_secs(30),
            probe: Mutex::new(None),
            raw_warned: Default::default(),
        };
        let snap = |m: &Model, version| WeightSnapshot::new(version, Arc::new(m.params.clone()));
        // The engine serves what the folder holds, as the learner says: accepted.
        let probe = x.publish(&snap(&a, 1)).unwrap();
        rt.block_on(x.reload_and_verify(&*engine, &probe)).unwrap();
        // A learner whose weights are not the folder's (a push that did not take): refused.
        let stale = super::super::external::Probe::of(
            &cfg,
            &snap(&b, 2),
            probe.dir.clone(),
            WeightDtype::F32,
        )
        .unwrap();
        let e = rt
            .block_on(x.reload_and_verify(&*engine, &stale))
            .unwrap_err();
        assert!(matches!(e, EngineError::BadWeights(_)), "{e}");
        assert!(
            e.to_string().contains("does not serve the pushed weights"),
            "{e}"
        );
        // Folders in bf16: half the bytes, a config that says so, and a probe that expects the
        // rounded weights — exact at a tolerance no rounding would pass.
        let x16 = ExternalPool {
            folders: WeightFolders::new(root.join("weights16")).with_dtype(WeightDtype::Bf16),
            tolerance: 1e-6,
            ..x
        };
        let probe = x16.publish(&snap(&a, 3)).unwrap();
        rt.block_on(x16.reload_and_verify(&*engine, &probe))
            .unwrap();
        let cfg_json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(probe.dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg_json["torch_dtype"], "bfloat16");
        let size = |d: &std::path::Path| d.join("model.safetensors").metadata().unwrap().len();
        assert!(
            2 * size(&probe.dir) < size(&root.join("weights/v00000001")) + 4096,
            "bf16 folder not half the f32 one"
        );
        let unrounded = super::super::external::Probe::of(
            &cfg,
            &snap(&a, 3),
            probe.dir.clone(),
            WeightDtype::F32,
        )
        .unwrap();
        let e = rt
            .block_on(x16.reload_and_verify(&*engine, &unrounded))
            .unwrap_err();
        assert!(matches!(e, EngineError::BadWeights(_)), "{e}");
        drop(rt);
        let _ = std::fs::remove_dir_all(&root);
    }
}
