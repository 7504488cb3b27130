//! The native engine: the learner's model run eagerly on the CPU kernels behind a worker thread
//! that does continuous batching over a paged KV cache.
//!
//! Scheduling: requests queue in arrival order; one is admitted when the pool has the blocks
//! for its prompt and for the longest possible output of every sample (so a running sequence
//! never runs out of cache and nothing is ever dropped); prompts admitted together are prefilled
//! in one forward (up to `max_prefill_tokens` tokens), each once whatever its `n`, and forked
//! into their samples; all running sequences then decode together, one token per
//! step, leaving as they finish while waiting requests join between steps. Weight swaps happen
//! between decode steps.
//!
//! Streaming: [`NativeEngine::generate_stream`] also sends each token as it is sampled, and its
//! reader can end a sample early (a stop string seen) or all of them (by dropping the stream:
//! a client gone) — the KV blocks are freed at the next step.

use crate::kv::{BlockPool, CachedStep, KvShape, SeqCache};
use crate::sampling::{Pick, SamplingParams, raw_logprob, sample};
use crate::{
    BoxFuture, Completion, EngineError, FinishReason, GenerateRequest, InferenceEngine, VersionSpan,
};
use kernels::tensor::WeightSnapshot;
use learner::params::WeightDtype;
use learner::{Model, ModelConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use tokio::sync::oneshot;

/// What in-flight sequences do when new weights arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SwapPolicy {
    /// Sequences already running finish on the weights they started with; new ones use the new.
    #[default]
    FinishOnOld,
    /// Every sequence continues on the new weights from the next token (its cached keys and
    /// values stay those of the old weights, as in vLLM).
    ContinueOnNew,
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct NativeConfig {
    /// Bytes for the KV cache pool (keys and values of all layers).
    pub kv_cache_bytes: usize,
    /// Token slots per cache block.
    pub block_size: usize,
    /// Most sequences decoded together.
    pub max_batch: usize,
    /// Most prompt tokens prefilled in one forward: prompts admitted together share one pass
    /// over the weights (a longer prompt still runs, alone).
    pub max_prefill_tokens: usize,
    /// Behaviour on weight swaps.
    pub swap: SwapPolicy,
    /// Weight version of the initial model.
    pub initial_version: u64,
    /// Report `log_softmax(logits)` of each sampled token instead of the sampled distribution's
    /// log-prob (vLLM's `--logprobs-mode raw_logprobs`; for servers that mimic it).
    pub raw_logprobs: bool,
    /// Keep finished sequences' full KV blocks for later prompts with the same prefix (an
    /// episode's next turn, a shared system prompt); forgotten at every weight swap.
    pub prefix_cache: bool,
    /// The number format of the served weights' products: `f32`, or `bf16` — the linear
    /// layers' and the head's products in bf16 as the learner's `precision: bf16` makes them
    /// (both operands rounded, f32 sums, on `vdpbf16ps`; decode steps stream half the bytes),
    /// embeddings, norms, attention and log-probs in f32.
    pub weights_dtype: WeightDtype,
    /// The number format of the KV cache: `f32`, or `bf16` — keys and values rounded to bf16
    /// as they are cached (twice the tokens in `kv_cache_bytes`, half the bytes a decode
    /// step's attention reads), widened to f32 for the attention's arithmetic.
    pub kv_cache_dtype: WeightDtype,
}

impl Default for NativeConfig {
    fn default() -> Self {
        Self {
            kv_cache_bytes: 1 << 30,
            block_size: 16,
            max_batch: 256,
            max_prefill_tokens: 2048,
            swap: SwapPolicy::default(),
            initial_version: 0,
            raw_logprobs: false,
            prefix_cache: true,
            weights_dtype: WeightDtype::F32,
            kv_cache_dtype: WeightDtype::F32,
        }
    }
}

type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

enum Cmd {
    Generate(
        Vec<GenerateRequest>,
        Option<Arc<Sink>>,
        Reply<Vec<Completion>>,
    ),
    /// New weights; `relabel` allows any version other than the served one.
    Update(WeightSnapshot, bool, Reply<()>),
    /// The model served now.
    Served(Reply<Arc<Model>>),
}

/// A token as a streaming generation sends it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Streamed {
    /// The request it belongs to (index in the generation's requests).
    pub request: usize,
    /// The sample of that request (0..n).
    pub index: usize,
    /// The token.
    pub token: u32,
    /// Its log-probability (as the completion reports it).
    pub logprob: f32,
}

/// The tokens of a [`NativeEngine::generate_stream`] as they are sampled, each sample's in
/// order, and the means to end a sample early. Dropping it ends every sample of the generation
/// at its next token.
pub struct TokenStream {
    rx: tokio::sync::mpsc::UnboundedReceiver<Streamed>,
    stops: Arc<StopFlags>,
}

impl TokenStream {
    /// The next token of any sample; `None` once every sample has finished.
    pub async fn next(&mut self) -> Option<Streamed> {
        self.rx.recv().await
    }

    /// Ends sample `index` of request `request` after the token it is decoding now (its
    /// completion finishes with `Stop`). Out-of-range pairs are ignored.
    pub fn stop(&self, request: usize, index: usize) {
        if let Some(f) = self
            .stops
            .offsets
            .get(request)
            .and_then(|o| self.stops.flags.get(o + index))
        {
            f.store(true, Ordering::Relaxed);
        }
    }
}

/// One flag per sample of a streaming generation, at its slot (`offsets[request] + index`).
struct StopFlags {
    offsets: Vec<usize>,
    flags: Vec<AtomicBool>,
}

/// Where a streaming generation's samples send their tokens.
struct Sink {
    tx: tokio::sync::mpsc::UnboundedSender<Streamed>,
    stops: Arc<StopFlags>,
}

/// A generation's completions, once every sample has finished.
pub type Completions = BoxFuture<'static, Result<Vec<Completion>, EngineError>>;

/// Counters the engine keeps (read with [`NativeEngine::stats`]).
#[derive(Debug, Default)]
pub struct Stats {
    /// Prompt tokens run through the model (once per request, whatever its `n`).
    pub prefill_tokens: AtomicU64,
    /// Prompt tokens found in the prefix cache instead.
    pub cached_tokens: AtomicU64,
    /// Forward passes over prompts (prompts admitted together share one).
    pub prefill_passes: AtomicU64,
    /// Tokens produced by decode steps.
    pub decode_tokens: AtomicU64,
    /// Decode steps run.
    pub decode_steps: AtomicU64,
    /// Sequences decoding now (a gauge).
    pub running: AtomicU64,
    /// Requests waiting for KV-cache blocks or batch room (a gauge).
    pub waiting: AtomicU64,
    /// KV-cache blocks held by sequences (a gauge).
    pub blocks_used: AtomicU64,
}

/// A point-in-time copy of [`Stats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// See [`Stats::prefill_tokens`].
    pub prefill_tokens: u64,
    /// See [`Stats::cached_tokens`].
    pub cached_tokens: u64,
    /// See [`Stats::prefill_passes`].
    pub prefill_passes: u64,
    /// See [`Stats::decode_tokens`].
    pub decode_tokens: u64,
    /// See [`Stats::decode_steps`].
    pub decode_steps: u64,
    /// See [`Stats::running`].
    pub running: u64,
    /// See [`Stats::waiting`].
    pub waiting: u64,
    /// See [`Stats::blocks_used`].
    pub blocks_used: u64,
}

impl StatsSnapshot {
    /// Share of the KV pool in use, 0..=1 (`num_blocks` from [`NativeEngine::kv_shape`]).
    pub fn kv_usage(&self, num_blocks: usize) -> f64 {
        self.blocks_used as f64 / num_blocks.max(1) as f64
    }
}

/// Handle to a native engine; dropping it stops the worker once its work is done.
pub struct NativeEngine {
    tx: Option<mpsc::Sender<Cmd>>,
    version: Arc<AtomicU64>,
    stats: Arc<Stats>,
    config: ModelConfig,
    kv: KvShape,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl NativeEngine {
    /// Starts an engine serving `model`.
    pub fn new(mut model: Model, cfg: NativeConfig) -> Self {
        if cfg.weights_dtype == WeightDtype::Bf16 {
            model.serve_bf16();
        }
        let c = &model.config;
        let per_block = 2
            * c.num_layers
            * cfg.block_size.max(1)
            * c.num_kv_heads
            * c.head_dim
            * cfg.kv_cache_dtype.bytes() as usize;
        let kv = KvShape {
            layers: c.num_layers,
            block_size: cfg.block_size.max(1),
            num_blocks: (cfg.kv_cache_bytes / per_block).max(1),
            kv_heads: c.num_kv_heads,
            heads: c.num_heads,
            head_dim: c.head_dim,
            dtype: cfg.kv_cache_dtype,
        };
        let version = Arc::new(AtomicU64::new(cfg.initial_version));
        let stats = Arc::new(Stats::default());
        let (tx, rx) = mpsc::channel();
        let config = model.config.clone();
        let mut worker = Worker {
            model: Arc::new(model),
            version: cfg.initial_version,
            shared_version: version.clone(),
            stats: stats.clone(),
            pool: BlockPool::new(kv),
            waiting: VecDeque::new(),
            running: Vec::new(),
            jobs: HashMap::new(),
            next_job: 0,
            cfg,
            next_seed: 0x5eed,
        };
        let handle = std::thread::Builder::new()
            .name("trellis-native-engine".into())
            .spawn(move || worker.run(&rx))
            .expect("spawn the engine thread");
        Self {
            tx: Some(tx),
            version,
            stats,
            config,
            kv,
            worker: Some(handle),
        }
    }

    /// The engine's counters.
    pub fn stats(&self) -> StatsSnapshot {
        StatsSnapshot {
            prefill_tokens: self.stats.prefill_tokens.load(Ordering::Relaxed),
            cached_tokens: self.stats.cached_tokens.load(Ordering::Relaxed),
            prefill_passes: self.stats.prefill_passes.load(Ordering::Relaxed),
            decode_tokens: self.stats.decode_tokens.load(Ordering::Relaxed),
            decode_steps: self.stats.decode_steps.load(Ordering::Relaxed),
            running: self.stats.running.load(Ordering::Relaxed),
            waiting: self.stats.waiting.load(Ordering::Relaxed),
            blocks_used: self.stats.blocks_used.load(Ordering::Relaxed),
        }
    }

    /// The KV pool's geometry.
    pub fn kv_shape(&self) -> KvShape {
        self.kv
    }

    /// The served model's config.
    pub fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    /// Refuses requests this engine cannot serve (bad tokens or settings, too long for the
    /// context, more KV-cache blocks than the pool has), naming the request: what
    /// [`InferenceEngine::generate`] checks first.
    pub fn check(&self, reqs: &[GenerateRequest]) -> Result<(), EngineError> {
        check_requests(&self.config, reqs)?;
        for (i, r) in reqs.iter().enumerate() {
            let bad = |msg: String| Err(EngineError::InvalidRequest { request: i, msg });
            let (p, k) = (r.prompt.len(), r.params.max_tokens);
            let need = blocks_needed(self.kv, p, k, r.params.n);
            if need > self.kv.num_blocks {
                return bad(format!(
                    "needs {need} KV-cache blocks but the pool has {}; raise kv_cache_bytes or lower n / max_tokens",
                    self.kv.num_blocks
                ));
            }
        }
        Ok(())
    }

    fn send<T>(
        &self,
        make: impl FnOnce(Reply<T>) -> Cmd,
    ) -> Result<oneshot::Receiver<Result<T, EngineError>>, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .as_ref()
            .ok_or(EngineError::Closed)?
            .send(make(tx))
            .map_err(|_| EngineError::Closed)?;
        Ok(rx)
    }

    /// [`InferenceEngine::generate`] for callers without an async runtime.
    pub fn generate_blocking(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Completion>, EngineError> {
        self.check(&reqs)?;
        self.send(|r| Cmd::Generate(reqs, None, r))?
            .blocking_recv()
            .map_err(|_| EngineError::Closed)?
    }

    /// Generates as [`InferenceEngine::generate`] does, also sending every token as it is
    /// sampled: the stream, and the completions once all samples have finished (those a reader
    /// stopped, or whose stream was dropped, finish with `Stop` and the tokens they had).
    pub fn generate_stream(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<(TokenStream, Completions), EngineError> {
        self.check(&reqs)?;
        let mut offsets = Vec::with_capacity(reqs.len());
        let mut total = 0;
        for r in &reqs {
            offsets.push(total);
            total += r.params.n;
        }
        let stops = Arc::new(StopFlags {
            offsets,
            flags: (0..total).map(|_| AtomicBool::new(false)).collect(),
        });
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let sink = Arc::new(Sink {
            tx,
            stops: Arc::clone(&stops),
        });
        let done = self.send(|r| Cmd::Generate(reqs, Some(sink), r))?;
        let done: Completions =
            Box::pin(async move { done.await.map_err(|_| EngineError::Closed)? });
        Ok((TokenStream { rx, stops }, done))
    }

    /// [`InferenceEngine::update_weights`] for callers without an async runtime.
    pub fn update_weights_blocking(&self, snapshot: WeightSnapshot) -> Result<(), EngineError> {
        self.send(|r| Cmd::Update(snapshot, false, r))?
            .blocking_recv()
            .map_err(|_| EngineError::Closed)?
    }

    /// The model the engine serves now (its weights are those of the last update, shared with
    /// the snapshot it came in when that was in this process: a swap copies nothing).
    pub fn served_blocking(&self) -> Result<Arc<Model>, EngineError> {
        self.send(Cmd::Served)?
            .blocking_recv()
            .map_err(|_| EngineError::Closed)?
    }

    /// As [`InferenceEngine::update_weights`], but with any version: for servers whose clients
    /// own the version labels (vLLM's `update_weight_version` sets any label; a trainer that
    /// restarts pushes its checkpoint's version again).
    pub async fn replace_weights(&self, snapshot: WeightSnapshot) -> Result<(), EngineError> {
        self.send(|r| Cmd::Update(snapshot, true, r))?
            .await
            .map_err(|_| EngineError::Closed)?
    }
}

impl Drop for NativeEngine {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.worker.take() {
            let _ = h.join();
        }
    }
}

impl InferenceEngine for NativeEngine {
    fn generate(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> BoxFuture<'_, Result<Vec<Completion>, EngineError>> {
        Box::pin(async move {
            self.check(&reqs)?;
            self.send(|r| Cmd::Generate(reqs, None, r))?
                .await
                .map_err(|_| EngineError::Closed)?
        })
    }

    fn update_weights(&self, snapshot: WeightSnapshot) -> BoxFuture<'_, Result<(), EngineError>> {
        Box::pin(async move {
            self.send(|r| Cmd::Update(snapshot, false, r))?
                .await
                .map_err(|_| EngineError::Closed)?
        })
    }

    fn weight_version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }
}

/// Refuses requests no engine of `c`'s model can serve (empty prompt, token ids past the
/// vocabulary, invalid sampling parameters, longer than the context, an episode), naming the
/// request.
pub(crate) fn check_requests(c: &ModelConfig, reqs: &[GenerateRequest]) -> Result<(), EngineError> {
    for (i, r) in reqs.iter().enumerate() {
        let bad = |msg: String| Err(EngineError::InvalidRequest { request: i, msg });
        if r.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if r.episode.is_some() {
            return bad("an episode runs through rollout::episode::generate, not an engine".into());
        }
        if let Some(t) = r.prompt.iter().find(|&&t| t as usize >= c.vocab_size) {
            return bad(format!(
                "token id {t} is not below the vocabulary size {}",
                c.vocab_size
            ));
        }
        if let Err(e) = r.params.validate() {
            return bad(e);
        }
        let (p, k) = (r.prompt.len(), r.params.max_tokens);
        if p + k > c.max_position_embeddings {
            return bad(format!(
                "prompt of {p} tokens + max_tokens {k} exceeds the model's context of {} tokens",
                c.max_position_embeddings
            ));
        }
    }
    Ok(())
}

/// Peak blocks one request holds: its prompt, then per sample the shared full prompt blocks plus
/// its own blocks for the rest (the last sampled token is never cached).
fn blocks_needed(kv: KvShape, prompt: usize, max_tokens: usize, n: usize) -> usize {
    let full = prompt / kv.block_size;
    kv.blocks_for(prompt) + n * (kv.blocks_for(prompt + max_tokens - 1) - full)
}

struct Job {
    results: Vec<Option<Completion>>,
    remaining: usize,
    reply: Option<Reply<Vec<Completion>>>,
    sink: Option<Arc<Sink>>,
}

struct Pending {
    job: u64,
    request: usize,
    /// Where this request's samples go in the job's results.
    slot: usize,
    req: GenerateRequest,
}

struct Seq {
    job: u64,
    slot: usize,
    request: usize,
    index: usize,
    params: Arc<crate::SamplingParams>,
    stops: Vec<u32>,
    rng: ChaCha8Rng,
    model: Arc<Model>,
    version: u64,
    /// Its prompt (the prefix cache keeps blocks under the tokens they hold).
    prompt: Arc<Vec<u32>>,
    /// Prompt tokens the prefix cache held.
    cached: usize,
    cache: SeqCache,
    /// Sampled but not yet run through the model.
    pending: u32,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    entropies: Vec<f32>,
    spans: Vec<VersionSpan>,
    sink: Option<Arc<Sink>>,
}

/// A token sampled from `logits`, its log-prob the raw one when the engine reports those.
fn pick(logits: &[f32], params: &SamplingParams, rng: &mut ChaCha8Rng, raw: bool) -> Pick {
    let p = sample(logits, params, rng);
    if raw {
        Pick {
            logprob: raw_logprob(logits, p.token),
            ..p
        }
    } else {
        p
    }
}

impl Seq {
    /// Records a sampled token; returns the finish reason if the sequence is done.
    fn push(&mut self, token: u32, logprob: f32, entropy: f32) -> Option<FinishReason> {
        let i = self.tokens.len();
        match self.spans.last_mut() {
            Some(s) if s.version == self.version => s.end = i + 1,
            _ => self.spans.push(VersionSpan {
                version: self.version,
                start: i,
                end: i + 1,
            }),
        }
        self.tokens.push(token);
        self.logprobs.push(logprob);
        self.entropies.push(entropy);
        self.pending = token;
        if let Some(sink) = &self.sink {
            let sent = sink.tx.send(Streamed {
                request: self.request,
                index: self.index,
                token,
                logprob,
            });
            // The reader is gone, or wants no more of this sample.
            if sent.is_err() || sink.stops.flags[self.slot].load(Ordering::Relaxed) {
                return Some(FinishReason::Stop);
            }
        }
        if self.stops.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.tokens.len() >= self.params.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

struct Worker {
    model: Arc<Model>,
    version: u64,
    shared_version: Arc<AtomicU64>,
    stats: Arc<Stats>,
    pool: BlockPool,
    waiting: VecDeque<Pending>,
    running: Vec<Seq>,
    jobs: HashMap<u64, Job>,
    next_job: u64,
    cfg: NativeConfig,
    next_seed: u64,
}

impl Worker {
    fn run(&mut self, rx: &mpsc::Receiver<Cmd>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            // The step runs on a kernel-pool thread: its many small parallel loops then fork
            // and join inside the pool, instead of each one waking a pool thread from here and
            // sleeping until it is done (batch 1: +12 %, batch 16: +25 % tokens/s).
            rayon::scope(|_| {
                self.admit();
                self.publish_gauges();
                if !self.running.is_empty() {
                    self.decode_step();
                }
            });
            self.publish_gauges();
        }
    }

    fn publish_gauges(&self) {
        let s = &self.stats;
        s.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        s.waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        let used = self.pool.shape().num_blocks - self.pool.free_blocks();
        s.blocks_used.store(used as u64, Ordering::Relaxed);
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Generate(reqs, sink, reply) => {
                let job = self.next_job;
                self.next_job += 1;
                let total: usize = reqs.iter().map(|r| r.params.n).sum();
                self.jobs.insert(
                    job,
                    Job {
                        results: vec![None; total],
                        remaining: total,
                        reply: Some(reply),
                        sink,
                    },
                );
                let mut slot = 0;
                for (request, req) in reqs.into_iter().enumerate() {
                    let n = req.params.n;
                    self.waiting.push_back(Pending {
                        job,
                        request,
                        slot,
                        req,
                    });
                    slot += n;
                }
            }
            Cmd::Update(snap, relabel, reply) => {
                let res = self.swap(snap, relabel);
                let _ = reply.send(res);
            }
            Cmd::Served(reply) => {
                let _ = reply.send(Ok(Arc::clone(&self.model)));
            }
        }
    }

    fn swap(&mut self, snap: WeightSnapshot, relabel: bool) -> Result<(), EngineError> {
        if snap.version <= self.version && !relabel {
            return Err(EngineError::BadWeights(format!(
                "version {} is not newer than the served version {}",
                snap.version, self.version
            )));
        }
        let version = snap.version;
        let params = Arc::unwrap_or_clone(
            snap.into_params()
                .map_err(|e| EngineError::BadWeights(e.to_string()))?,
        );
        let mut model = Model::new(self.model.config.clone(), params)
            .map_err(|e| EngineError::BadWeights(e.to_string()))?;
        if self.cfg.weights_dtype == WeightDtype::Bf16 {
            model.serve_bf16();
        }
        self.model = Arc::new(model);
        self.version = version;
        // Keys and values of the old weights are no prefix of anything the new ones compute.
        self.pool.forget();
        self.shared_version.store(version, Ordering::Release);
        if self.cfg.swap == SwapPolicy::ContinueOnNew {
            for s in &mut self.running {
                s.model = self.model.clone();
                s.version = self.version;
            }
        }
        Ok(())
    }

    /// Admits waiting requests in arrival order while there is room, prefilling them in
    /// batches of at most `max_prefill_tokens` prompt tokens.
    fn admit(&mut self) {
        loop {
            let mut batch = Vec::new();
            let (mut running, mut free, mut tokens) =
                (self.running.len(), self.pool.free_blocks(), 0);
            while let Some(p) = self.waiting.front() {
                let (plen, k, n) = (p.req.prompt.len(), p.req.params.max_tokens, p.req.params.n);
                let room = running == 0 || running + n <= self.cfg.max_batch;
                let need = blocks_needed(self.pool.shape(), plen, k, n);
                let fits = batch.is_empty() || tokens + plen <= self.cfg.max_prefill_tokens;
                if !room || free < need || !fits {
                    break;
                }
                (running, free, tokens) = (running + n, free - need, tokens + plen);
                batch.push(self.waiting.pop_front().expect("front exists"));
            }
            if batch.is_empty() {
                return;
            }
            self.prefill(batch);
        }
    }

    /// One forward over the prompts of `batch` (each into its own cache), then each request
    /// forks into its samples, which draw their first token from the prompt's last logits.
    fn prefill(&mut self, batch: Vec<Pending>) {
        let kv = self.pool.shape();
        // The prefix cache's blocks first (held, so allocating the rest cannot evict them),
        // then fresh blocks for the rest of each prompt.
        let hits: Vec<Vec<u32>> = batch
            .iter()
            .map(|p| match self.cfg.prefix_cache {
                true => self.pool.lookup(&p.req.prompt, self.version),
                false => Vec::new(),
            })
            .collect();
        let mut parents: Vec<SeqCache> = batch
            .iter()
            .zip(hits)
            .map(|(p, mut blocks)| {
                let len = blocks.len() * kv.block_size;
                let rest = kv.blocks_for(p.req.prompt.len()) - blocks.len();
                blocks.extend(self.pool.alloc(rest).expect("admission checked the pool"));
                SeqCache { blocks, len }
            })
            .collect();
        let lens: Vec<usize> = batch
            .iter()
            .zip(&parents)
            .map(|(p, c)| p.req.prompt.len() - c.len)
            .collect();
        let tokens: Vec<u32> = batch
            .iter()
            .zip(&parents)
            .flat_map(|(p, c)| p.req.prompt[c.len..].iter().copied())
            .collect();
        let positions: Vec<u32> = parents
            .iter()
            .zip(&lens)
            .flat_map(|(c, &l)| c.len as u32..(c.len + l) as u32)
            .collect();
        let cached: Vec<usize> = parents.iter().map(|c| c.len).collect();
        self.stats
            .cached_tokens
            .fetch_add(cached.iter().sum::<usize>() as u64, Ordering::Relaxed);
        let hidden = {
            let mut step = CachedStep {
                pool: &mut self.pool,
                seqs: parents.iter().collect(),
                counts: lens.clone(),
                bf16: self.model.is_bf16(),
            };
            self.model.forward_hidden(&tokens, &positions, &mut step)
        };
        self.stats
            .prefill_tokens
            .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        self.stats.prefill_passes.fetch_add(1, Ordering::Relaxed);
        let h = self.model.config.hidden_size;
        let mut last = Vec::with_capacity(batch.len() * h);
        let mut end = 0;
        for &l in &lens {
            end += l;
            last.extend_from_slice(&hidden[(end - 1) * h..end * h]);
        }
        let logits = self.model.logits_of_hidden(&last);
        let vocab = self.model.config.vocab_size;
        for (((p, parent), row), cached) in batch
            .into_iter()
            .zip(&mut parents)
            .zip(logits.chunks(vocab))
            .zip(cached)
        {
            parent.len = p.req.prompt.len();
            if self.cfg.prefix_cache {
                self.pool.remember(parent, &p.req.prompt, self.version);
            }
            self.start(p, parent, row, cached);
            self.pool.release(parent);
        }
    }

    /// Forks a prefilled request into its `n` samples and draws each one's first token.
    fn start(&mut self, p: Pending, parent: &SeqCache, logits: &[f32], cached: usize) {
        let kv = self.pool.shape();
        let plen = parent.len;
        let params = Arc::new(p.req.params);
        let prompt = Arc::new(p.req.prompt);
        let mut stops = params.stop_token_ids.clone();
        if !params.ignore_eos
            && let Some(eos) = self.model.config.eos_token_id
        {
            stops.push(eos);
        }
        let seed = params.seed.unwrap_or_else(|| {
            self.next_seed = self.next_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            self.next_seed
        });
        let sink = self.jobs.get(&p.job).and_then(|j| j.sink.clone());
        let full = plen / kv.block_size;
        let partial = usize::from(!plen.is_multiple_of(kv.block_size));
        let extra = kv.blocks_for(plen + params.max_tokens - 1) - full - partial;
        for index in 0..params.n {
            let cache = self
                .pool
                .fork(parent, extra)
                .expect("admission reserved the blocks");
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(index as u64);
            let mut seq = Seq {
                job: p.job,
                slot: p.slot + index,
                request: p.request,
                index,
                params: params.clone(),
                stops: stops.clone(),
                rng,
                model: self.model.clone(),
                version: self.version,
                prompt: prompt.clone(),
                cached,
                cache,
                pending: 0,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                entropies: Vec::new(),
                spans: Vec::new(),
                sink: sink.clone(),
            };
            let s = pick(logits, &seq.params, &mut seq.rng, self.cfg.raw_logprobs);
            match seq.push(s.token, s.logprob, s.entropy) {
                Some(reason) => self.finish(seq, reason),
                None => self.running.push(seq),
            }
        }
    }

    fn decode_step(&mut self) {
        // Sequences on different weights (after a swap with FinishOnOld) decode in separate groups.
        let mut groups: Vec<(Arc<Model>, Vec<usize>)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            match groups.iter_mut().find(|(m, _)| Arc::ptr_eq(m, &s.model)) {
                Some((_, v)) => v.push(i),
                None => groups.push((s.model.clone(), vec![i])),
            }
        }
        let mut done = Vec::new();
        self.stats.decode_steps.fetch_add(1, Ordering::Relaxed);
        self.stats
            .decode_tokens
            .fetch_add(self.running.len() as u64, Ordering::Relaxed);
        for (model, idx) in groups {
            let tokens: Vec<u32> = idx.iter().map(|&i| self.running[i].pending).collect();
            let positions: Vec<u32> = idx
                .iter()
                .map(|&i| self.running[i].cache.len as u32)
                .collect();
            let hidden = {
                let seqs = idx.iter().map(|&i| &self.running[i].cache).collect();
                let mut step = CachedStep {
                    pool: &mut self.pool,
                    seqs,
                    counts: vec![1; idx.len()],
                    bf16: model.is_bf16(),
                };
                model.forward_hidden(&tokens, &positions, &mut step)
            };
            let logits = model.logits_of_hidden(&hidden);
            let vocab = model.config.vocab_size;
            let raw = self.cfg.raw_logprobs;
            // `idx` is increasing: pick the group's sequences out of `running` in one walk
            let mut members: Vec<&mut Seq> = Vec::with_capacity(idx.len());
            let mut want = idx.iter().peekable();
            for (i, s) in self.running.iter_mut().enumerate() {
                if want.next_if_eq(&&i).is_some() {
                    members.push(s);
                }
            }
            // each row draws from its own stream, so rows sample in parallel
            let picks: Vec<Pick> = members
                .par_iter_mut()
                .zip(logits.par_chunks(vocab))
                .map(|(s, row)| pick(row, &s.params, &mut s.rng, raw))
                .collect();
            for ((s, p), &i) in members.into_iter().zip(picks).zip(&idx) {
                s.cache.len += 1;
                if let Some(reason) = s.push(p.token, p.logprob, p.entropy) {
                    done.push((i, reason));
                }
            }
        }
        done.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, reason) in done {
            let s = self.running.swap_remove(i);
            self.finish(s, reason);
        }
    }

    fn finish(&mut self, s: Seq, reason: FinishReason) {
        // Blocks computed wholly by the served weights are kept for a prompt that continues
        // this sequence: its prompt was prefilled with the weights of its first token (the same
        // step), so every token on the served version means every block is theirs.
        if self.cfg.prefix_cache
            && Arc::ptr_eq(&s.model, &self.model)
            && s.spans.iter().all(|sp| sp.version == self.version)
        {
            let mut tokens = Vec::with_capacity(s.prompt.len() + s.tokens.len());
            tokens.extend_from_slice(&s.prompt);
            tokens.extend_from_slice(&s.tokens);
            self.pool.remember(&s.cache, &tokens, self.version);
        }
        self.pool.release(&s.cache);
        let Some(job) = self.jobs.get_mut(&s.job) else {
            return;
        };
        job.results[s.slot] = Some(Completion {
            request: s.request,
            index: s.index,
            token_ids: s.tokens,
            logprobs: s.logprobs,
            // Raw log-probs are not of the sampled distribution: neither would its entropies be
            // what they go with.
            entropies: if self.cfg.raw_logprobs {
                Vec::new()
            } else {
                s.entropies
            },
            finish_reason: reason,
            weight_versions: s.spans,
            observations: Vec::new(),
            cached_tokens: s.cached,
            episode: None,
            prompt: None,
        });
        job.remaining -= 1;
        if job.remaining == 0 {
            let job = self.jobs.remove(&s.job).expect("present");
            let results = job
                .results
                .into_iter()
                .map(|c| c.expect("every sample finished"))
                .collect();
            if let Some(reply) = job.reply {
                let _ = reply.send(Ok(results));
            }
        }
    }
}
