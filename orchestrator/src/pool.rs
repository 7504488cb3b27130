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
use rollout::external::{External, ExternalConfig, Load, WeightFolders};
use rollout::native::{NativeConfig, NativeEngine};
use rollout::router::{Router, Weights};
use rollout::{Completion, EngineError, GenerateRequest, InferenceEngine};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a rollout actor starts: the model's shape (its weights arrive by `load_weights`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RolloutConfig {
    /// The model's Hugging Face `config.json` fields.
    pub model: serde_json::Value,
    /// KV-cache budget of this actor's engine, in bytes.
    pub kv_cache_bytes: usize,
    /// `native`, or `pjrt` (on `device`, through `plugin` or the one found on the host that runs
    /// the actor).
    #[serde(default = "native_engine")]
    pub engine: String,
    /// `cpu`, `gpu` or `tpu`: where a `pjrt` engine runs.
    #[serde(default = "cpu_device")]
    pub device: String,
    /// The PJRT plugin of a `pjrt` engine.
    #[serde(default)]
    pub plugin: Option<PathBuf>,
}

fn native_engine() -> String {
    "native".into()
}

fn cpu_device() -> String {
    "cpu".into()
}

/// The engine a rollout actor owns.
enum Engine {
    Native(NativeEngine),
    Pjrt(rollout::pjrt::PjrtEngine),
}

impl Engine {
    fn weight_version(&self) -> u64 {
        match self {
            Self::Native(e) => e.weight_version(),
            Self::Pjrt(e) => e.weight_version(),
        }
    }

    async fn generate(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>, EngineError> {
        match self {
            Self::Native(e) => e.generate(reqs).await,
            Self::Pjrt(e) => e.generate(reqs).await,
        }
    }

    async fn update_weights(&self, snapshot: WeightSnapshot) -> Result<(), EngineError> {
        match self {
            Self::Native(e) => e.update_weights(snapshot).await,
            Self::Pjrt(e) => e.update_weights(snapshot).await,
        }
    }
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
    start: RolloutConfig,
    engine: Option<Engine>,
}

impl Actor for RolloutActor {
    const KIND: &'static str = "rollout";
    type Config = RolloutConfig;
    type Request = RolloutRequest;
    type Response = Vec<Completion>;

    fn start(config: RolloutConfig) -> Result<Self, String> {
        let mc = ModelConfig::from_json(config.model.clone(), Path::new("rollout actor config"))
            .map_err(|e| e.to_string())?;
        if !["native", "pjrt"].contains(&config.engine.as_str()) {
            return Err(format!(
                "rollout actor: engine `{}`: expected native or pjrt",
                config.engine
            ));
        }
        Ok(Self {
            config: mc,
            start: config,
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
        let s = &self.start;
        self.engine = Some(if s.engine == "pjrt" {
            let client = crate::train::pjrt_client("rollout", &s.device, s.plugin.as_deref())?;
            tracing::info!(platform = client.platform(), "rollout engine on pjrt");
            Engine::Pjrt(
                rollout::pjrt::PjrtEngine::new(client, &model, snapshot.version)
                    .map_err(|e| e.to_string())?,
            )
        } else {
            Engine::Native(NativeEngine::new(
                model,
                NativeConfig {
                    kv_cache_bytes: s.kv_cache_bytes,
                    initial_version: snapshot.version,
                    ..Default::default()
                },
            ))
        });
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

/// One engine of a pool: an actor (native engine, in-process or on an agent), or an external
/// server reached over HTTP.
#[derive(Clone)]
enum Member {
    Actor(ActorRef<RolloutActor>),
    External(Arc<External>),
}

impl Member {
    fn location(&self) -> String {
        match self {
            Self::Actor(a) => a.location(),
            Self::External(e) => e.url().to_string(),
        }
    }

    async fn generate(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>, RunError> {
        match self {
            // Generation is a pure function of the weights and the requests' seeds, so a call
            // lost with its actor is simply made again on the restarted one.
            Self::Actor(a) => {
                Ok(retry(a, || a.call(RolloutRequest::Generate(reqs.clone()))).await?)
            }
            Self::External(e) => Ok(e.generate(reqs).await?),
        }
    }
}

/// The temperature of the probe that checks a push (not 1, so that log-probs taken before and
/// after temperature differ).
const PROBE_TEMPERATURE: f32 = 0.7;

/// What the learner expects an engine to answer after a push: one token sampled at
/// [`PROBE_TEMPERATURE`] after a fixed prompt, whose log-prob must match the learner's.
#[derive(Clone, Debug)]
struct Probe {
    version: u64,
    /// The version's weight folder.
    dir: PathBuf,
    prompt: Vec<u32>,
    /// The learner's `log_softmax(logits / T)` over the vocabulary at the prompt's end.
    processed: Vec<f32>,
    /// `log_softmax(logits)`: what an engine reporting raw log-probs answers.
    raw: Vec<f32>,
}

impl Probe {
    fn of(model: &Model, version: u64, dir: PathBuf) -> Result<Self, RunError> {
        let vocab = model.config.vocab_size;
        let prompt: Vec<u32> = (0..8).map(|i| ((3 + 7 * i) % vocab) as u32).collect();
        let logits = model.logits(&learner::Batch::padded(&[&prompt]))?;
        let last = &logits[(prompt.len() - 1) * vocab..prompt.len() * vocab];
        let log_softmax = |t: f32| -> Vec<f32> {
            let z: Vec<f64> = last.iter().map(|&x| f64::from(x) / f64::from(t)).collect();
            let m = z.iter().copied().fold(f64::MIN, f64::max);
            let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            z.iter().map(|x| (x - lse) as f32).collect()
        };
        Ok(Self {
            version,
            dir,
            processed: log_softmax(PROBE_TEMPERATURE),
            raw: log_softmax(1.0),
            prompt,
        })
    }

    fn request(&self) -> GenerateRequest {
        GenerateRequest {
            prompt: self.prompt.clone(),
            params: rollout::SamplingParams {
                temperature: PROBE_TEMPERATURE,
                max_tokens: 1,
                ignore_eos: true,
                seed: Some(0x7e11),
                ..Default::default()
            },
        }
    }
}

/// The settings and state of a pool of external engines.
struct ExternalPool {
    engine: String,
    folders: WeightFolders,
    config: ModelConfig,
    tolerance: f64,
    /// The run trains on the engine's own log-probs (async mode): raw ones are refused.
    needs_processed: bool,
    /// How long a generation waits for an engine when every engine is out of service.
    wait: Duration,
    /// The check of the weights every engine must serve (`None` before the first push).
    probe: Mutex<Option<Probe>>,
    raw_warned: std::sync::atomic::AtomicBool,
}

impl ExternalPool {
    /// Pushes the probe's version to `e` and checks its answer against the learner's.
    async fn reload_and_verify(&self, e: &External, p: &Probe) -> Result<(), EngineError> {
        e.reload(&p.dir, p.version).await?;
        let c = e.generate(vec![p.request()]).await?;
        let (Some(c), url) = (c.first(), e.url()) else {
            return Err(EngineError::Protocol(format!(
                "{}: no completion for the probe",
                e.url()
            )));
        };
        let (Some(&t), Some(&lp)) = (c.token_ids.first(), c.logprobs.first()) else {
            return Err(EngineError::Protocol(format!(
                "{url}: an empty completion for the probe (max_tokens 1, ignore_eos)"
            )));
        };
        let Some(&want) = self.processed_at(p, t) else {
            return Err(EngineError::Protocol(format!(
                "{url}: token id {t} is outside the vocabulary ({})",
                p.processed.len()
            )));
        };
        if let Some(s) = c.weight_versions.iter().find(|s| s.version != p.version) {
            return Err(EngineError::BadWeights(format!(
                "{url}: serves version {} after the push of version {}",
                s.version, p.version
            )));
        }
        let (tol, dp, dr) = (
            self.tolerance,
            f64::from((lp - want).abs()),
            f64::from((lp - p.raw[t as usize]).abs()),
        );
        if dp <= tol {
            return Ok(());
        }
        if dr <= tol {
            if self.needs_processed {
                return Err(EngineError::Protocol(format!(
                    "{url} reports raw log-probs (before temperature), and this run trains on the engine's log-probs (trainer.mode: async): start vLLM with --logprobs-mode processed_logprobs"
                )));
            }
            if !self
                .raw_warned
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!(
                    url,
                    "the engine reports raw log-probs (before temperature); fine here (behaviour log-probs are recomputed by the learner)"
                );
            }
            return Ok(());
        }
        Err(EngineError::BadWeights(format!(
            "{url}: after the push of version {}, its log-prob of token {t} on the probe is {lp:.6}, the learner's {want:.6} (difference {dp:.1e} > pools.rollout.verify_tolerance {tol:.0e}): it does not serve the pushed weights",
            p.version
        )))
    }

    fn processed_at<'a>(&self, p: &'a Probe, t: u32) -> Option<&'a f32> {
        p.processed.get(t as usize)
    }
}

/// An engine out of service: why, and when to try it again.
struct Down {
    error: String,
    next_try: Instant,
    backoff: Duration,
}

/// The rollout engines of a run, and the router that spreads prompts over them.
pub(crate) struct RolloutPool {
    rt: tokio::runtime::Runtime,
    /// The head this pool started (shut down with the pool).
    head: Option<Head>,
    members: Vec<Member>,
    /// `Some` for an engine taken out of service.
    down: Mutex<Vec<Option<Down>>>,
    router: Mutex<Router>,
    /// The weights every actor serves (a restarted actor gets them back).
    current: Arc<Mutex<WeightSnapshot>>,
    external: Option<ExternalPool>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RolloutPool {
    /// `pool.count` rollout actors of `model`, each with `kv_cache_bytes`, serving its weights
    /// as `version`: in this process (`placement: local`), or on the agents that register with
    /// a head started on `cluster`; or, for an external engine, the servers at
    /// `pool.endpoints`, given the weights through folders under `pool.weights_dir` (default
    /// `run_dir/engine-weights`). `needs_processed`: the run trains on the engine's log-probs.
    pub(crate) fn new(
        model: &Model,
        pool: &Pool,
        kv_cache_bytes: usize,
        version: u64,
        cluster: Option<&Cluster>,
        stop: &(dyn Fn() -> bool + Sync),
        run_dir: &Path,
        needs_processed: bool,
    ) -> Result<Self, RunError> {
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
        if pool.is_external() {
            let timeout = Duration::from_secs_f64(pool.timeout_s);
            let engines = rt.block_on(async {
                let mut out = Vec::new();
                for (i, url) in pool.endpoints.iter().enumerate() {
                    let cfg = ExternalConfig {
                        url: url.clone(),
                        model: pool.model.clone(),
                        timeout,
                    };
                    let e = External::connect(&pool.engine, cfg).await.map_err(|e| {
                        RunError::Other(format!(
                            "pools.rollout.endpoints[{i}]: {} engine at {url}: {e}",
                            pool.engine
                        ))
                    })?;
                    out.push(Member::External(Arc::new(e)));
                }
                Ok::<_, RunError>(out)
            })?;
            let root = pool
                .weights_dir
                .clone()
                .unwrap_or_else(|| run_dir.join("engine-weights"));
            let root = std::path::absolute(&root).map_err(|e| RunError::Io {
                path: root.clone(),
                source: e,
            })?;
            let this = Self {
                rt,
                head: None,
                down: Mutex::new(engines.iter().map(|_| None).collect()),
                router: Mutex::new(Router::new(engines.len(), Weights::default())),
                members: engines,
                current,
                external: Some(ExternalPool {
                    engine: pool.engine.clone(),
                    folders: WeightFolders::new(root),
                    config: model.config.clone(),
                    tolerance: pool.verify_tolerance,
                    needs_processed,
                    wait: timeout,
                    probe: Mutex::new(None),
                    raw_warned: Default::default(),
                }),
            };
            // Whatever they served before, every engine starts on the run's weights.
            this.update_weights_blocking(snapshot, model)?;
            return Ok(this);
        }
        let count = pool.count.max(1);
        let for_hook = Arc::clone(&current);
        let hook: RestartHook<RolloutActor> = Arc::new(move |actor| {
            let snap = lock(&for_hook).clone();
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
            engine: pool.engine.clone(),
            device: pool.device.clone(),
            plugin: pool.plugin.clone(),
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
        let n = actors.len();
        Ok(Self {
            rt,
            head,
            members: actors.into_iter().map(Member::Actor).collect(),
            down: Mutex::new((0..n).map(|_| None).collect()),
            router: Mutex::new(Router::new(n, Weights::default())),
            current,
            external: None,
        })
    }

    /// Where each engine runs (`local`, its agent, or its URL).
    pub(crate) fn locations(&self) -> Vec<String> {
        self.members.iter().map(Member::location).collect()
    }

    /// Engines in the pool.
    pub(crate) fn len(&self) -> usize {
        self.members.len()
    }

    /// Engines out of service now.
    pub(crate) fn down_count(&self) -> usize {
        lock(&self.down).iter().filter(|d| d.is_some()).count()
    }

    /// Generates `reqs` across the engines; completions come back ordered by request, then
    /// sample, as from one engine. The router gives each request (all its samples) to one
    /// engine; the requests of an engine that stops answering go to the others, and it is
    /// taken out of service until it answers again and serves the current weights.
    pub(crate) fn generate_blocking(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Completion>, RunError> {
        self.rt.block_on(self.generate(reqs))
    }

    async fn generate(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>, RunError> {
        let mut todo: Vec<usize> = (0..reqs.len()).collect();
        let mut all = Vec::with_capacity(reqs.iter().map(|r| r.params.n).sum());
        let mut waiting_since: Option<Instant> = None;
        while !todo.is_empty() {
            self.revive().await?;
            let loads = self.loads().await;
            let batch: Vec<GenerateRequest> = todo.iter().map(|&i| reqs[i].clone()).collect();
            let route = lock(&self.router).route(&batch, &loads);
            let Some(route) = route else {
                // Every engine is out of service: wait for one to come back.
                let since = *waiting_since.get_or_insert_with(Instant::now);
                let wait = self.external.as_ref().map_or(Duration::ZERO, |x| x.wait);
                if since.elapsed() >= wait {
                    return Err(RunError::Other(self.all_down_message(wait)));
                }
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
            todo.clear();
            for (e, index, call) in calls {
                let out = call
                    .await
                    .map_err(|err| RunError::Other(format!("a rollout call was lost: {err}")))?;
                match out {
                    Ok(cs) => all.extend(cs.into_iter().map(|mut c| {
                        c.request = index[c.request];
                        c
                    })),
                    Err(RunError::Engine(EngineError::Unavailable(msg))) => {
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
                (true, Member::External(e)) => Some(e.load().await.unwrap_or_default()),
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

    fn all_down_message(&self, wait: Duration) -> String {
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
        format!(
            "every rollout engine is out of service and none came back within {wait:.0?} (pools.rollout.timeout_s): {}",
            why.join("; ")
        )
    }

    /// Tries the engines out of service whose backoff is over: one that answers its health
    /// route gets the current weights, is checked, and is back in service.
    async fn revive(&self) -> Result<(), RunError> {
        let Some(x) = &self.external else {
            return Ok(());
        };
        let due: Vec<usize> = lock(&self.down)
            .iter()
            .enumerate()
            .filter(|(_, d)| d.as_ref().is_some_and(|d| d.next_try <= Instant::now()))
            .map(|(i, _)| i)
            .collect();
        for i in due {
            let Member::External(e) = &self.members[i] else {
                continue;
            };
            let probe = lock(&x.probe).clone();
            let result = match e.health().await {
                Ok(()) => match &probe {
                    Some(p) => x.reload_and_verify(e, p).await,
                    None => Ok(()),
                },
                Err(err) => Err(err),
            };
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

    /// Swaps `snapshot` (the weights of the learner's `model`) into every engine in service
    /// before returning: actors between their decode steps; external engines by reloading a new
    /// folder, then checked with the probe. An engine that does not answer is taken out of
    /// service (it gets these weights when it returns).
    pub(crate) fn update_weights_blocking(
        &self,
        snapshot: WeightSnapshot,
        model: &Model,
    ) -> Result<(), RunError> {
        *lock(&self.current) = snapshot.clone();
        if let Some(x) = &self.external {
            let dir = x.folders.write(&snapshot, &x.config)?;
            let probe = Probe::of(model, snapshot.version, dir)?;
            *lock(&x.probe) = Some(probe.clone());
            let up: Vec<bool> = lock(&self.down).iter().map(Option::is_none).collect();
            let results = self.rt.block_on(async {
                let mut out = Vec::new();
                for (i, m) in self.members.iter().enumerate() {
                    if let (true, Member::External(e)) = (up[i], m) {
                        out.push((i, x.reload_and_verify(e, &probe).await));
                    }
                }
                out
            });
            for (i, r) in results {
                match r {
                    Ok(()) => {}
                    Err(EngineError::Unavailable(msg)) => self.take_out(i, msg),
                    Err(e) => return Err(e.into()),
                }
            }
            tracing::debug!(engine = %x.engine, version = snapshot.version, "weights pushed");
            return Ok(());
        }
        let pushes: Vec<_> = self
            .members
            .iter()
            .filter_map(|m| match m {
                Member::Actor(a) => Some(a.clone()),
                Member::External(_) => None,
            })
            .map(|a| {
                let s = snapshot.clone();
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
            let stops = self.members.iter().filter_map(|m| match m {
                Member::Actor(a) => Some(a.stop_and_wait()),
                Member::External(_) => None,
            });
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
        let make = |n| {
            RolloutPool::new(
                &model,
                &pool(n),
                8 << 20,
                0,
                None,
                &|| false,
                Path::new("."),
                false,
            )
            .unwrap()
        };
        let (one, three) = (make(1), make(3));
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
        three.update_weights_blocking(snap, &model).unwrap();
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

    #[test]
    fn a_push_the_engine_did_not_take_is_caught_by_the_probe() {
        let cfg = serde_json::json!({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 64});
        let cfg = ModelConfig::from_json(cfg, Path::new("t")).unwrap();
        let (a, b) = (Model::init(cfg.clone(), 5), Model::init(cfg.clone(), 6));
        let root = std::env::temp_dir().join(format!("trellis-probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        learner::checkpoint::Checkpoint {
            model: Model::new(cfg.clone(), b.params.clone()).unwrap(),
            assets: Vec::new(),
        }
        .save(&root.join("served"), None)
        .unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(crate::engine_server::serve(
            crate::engine_server::EngineServeOptions {
                model: crate::engine_server::ModelSource::Checkpoint(root.join("served")),
                listen: "127.0.0.1:0".parse().unwrap(),
                served_model_name: None,
                kv_cache_bytes: 8 << 20,
                completions_only: false,
                raw_logprobs: false,
            },
            move |addr, _| tx.send(addr).unwrap(),
            std::future::pending(),
        ));
        let addr = rx.recv().unwrap();
        let config = ExternalConfig {
            url: format!("http://{addr}"),
            model: None,
            timeout: Duration::from_secs(30),
        };
        let engine = rt.block_on(External::connect("served", config)).unwrap();
        let folders = WeightFolders::new(root.join("weights"));
        let x = ExternalPool {
            engine: "served".into(),
            folders: folders.clone(),
            config: cfg.clone(),
            tolerance: 1e-4,
            needs_processed: true,
            wait: Duration::from_secs(1),
            probe: Mutex::new(None),
            raw_warned: Default::default(),
        };
        let snap = WeightSnapshot {
            version: 1,
            params: Arc::new(a.params.clone()),
        };
        let dir = folders.write(&snap, &cfg).unwrap();
        // The engine serves what the folder holds, as the learner says: accepted.
        let probe = Probe::of(&a, 1, dir.clone()).unwrap();
        rt.block_on(x.reload_and_verify(&engine, &probe)).unwrap();
        // A learner whose weights are not the folder's (a push that did not take): refused.
        let stale = Probe::of(&b, 2, dir).unwrap();
        let e = rt
            .block_on(x.reload_and_verify(&engine, &stale))
            .unwrap_err();
        assert!(matches!(e, EngineError::BadWeights(_)), "{e}");
        assert!(
            e.to_string().contains("does not serve the pushed weights"),
            "{e}"
        );
        drop(rt);
        let _ = std::fs::remove_dir_all(&root);
    }
}
