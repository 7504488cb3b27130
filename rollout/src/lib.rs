//! Rollout: the [`InferenceEngine`] interface, its request and completion types, and [`open`],
//! the one place that makes an in-process engine. The engine room: the native CPU engine
//! (`native`: paged KV cache in `kv`, continuous batching, shared prefill for `n` samples,
//! `sampling`, versioned weight swaps) and the `pjrt` engine. The clients of external engines
//! (`external`: vLLM and SGLang over HTTP, weight folders) and the prefix-aware `router` that
//! picks an engine for each prompt. The environment wing: tasks and datasets (`task`,
//! `parquet`) and the rewards that score responses (`reward`).
//!
//! Owns: turning token ids into sampled continuations with log-probs and weight versions, and
//! scoring them against a task's answers. Never: trains, or serves HTTP (the engine server is
//! `rollout/serve`'s); the native engine never opens a socket.

pub mod bench;
pub mod env;
pub mod episode;
pub mod external;
pub mod kv;
pub mod native;
pub mod parquet;
pub mod pjrt;
pub mod reward;
pub mod router;
pub mod sampling;
pub mod task;

use kernels::tensor::WeightSnapshot;
use learner::Model;
pub use sampling::SamplingParams;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;

/// One prompt (token ids) and how to sample it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling settings; `n` completions come back for this request.
    pub params: SamplingParams,
    /// Run each sample as an episode in an environment ([`episode::generate`] does; engines
    /// themselves refuse such a request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode: Option<episode::EpisodeSpec>,
}

impl GenerateRequest {
    /// One prompt and its sampling, no episode.
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            prompt,
            params,
            episode: None,
        }
    }
}

/// Why a completion ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token (or the end-of-sequence token) was generated; it ends the output.
    Stop,
    /// `max_tokens` were generated.
    Length,
}

/// Tokens `start..end` of a completion were produced by weight `version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionSpan {
    /// Weight version.
    pub version: u64,
    /// First token index (in the completion).
    pub start: usize,
    /// One past the last.
    pub end: usize,
}

/// One sample of one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Index of the request in the call.
    pub request: usize,
    /// Sample index within the request (`0..n`).
    pub index: usize,
    /// Generated token ids.
    pub token_ids: Vec<u32>,
    /// Log-prob of each generated token (see [`sampling`] for the exact definition).
    pub logprobs: Vec<f32>,
    /// Entropy of the distribution each token was drawn from (the one its log-prob is of), or
    /// empty where the engine does not report it (external servers, raw log-probs, episodes):
    /// the learner reads it instead of scoring a row it does not train.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entropies: Vec<f32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Which weights produced which tokens.
    pub weight_versions: Vec<VersionSpan>,
    /// Token ranges of `token_ids` an environment wrote (an episode's observations, whose
    /// log-probs are 0): they are context, never trained on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub observations: Vec<std::ops::Range<usize>>,
    /// Prompt tokens whose keys and values the engine found in its prefix cache instead of
    /// computing them (the native engine; 0 elsewhere).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_tokens: usize,
    /// An episode's outcome (a request with an episode only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode: Option<episode::EpisodeStats>,
    /// The prompt `token_ids` follow when it is not the request's: an agent program's own
    /// conversation (see [`episode::gateway`]), rendered from the messages of its first call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Vec<u32>>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// What can go wrong in an engine.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EngineError {
    /// A request that can never be served, with the reason (names the request and field).
    #[error("request {request}: {msg}")]
    InvalidRequest {
        /// Index of the request in the call.
        request: usize,
        /// What is wrong.
        msg: String,
    },
    /// Weights that do not fit the engine's model.
    #[error("weight update refused: {0}")]
    BadWeights(String),
    /// The engine stopped.
    #[error("the engine has shut down")]
    Closed,
    /// An external engine that does not answer (refused, reset, timed out, or a 5xx): a router
    /// takes it out of service and retries it later. The message names its URL.
    #[error("{0}")]
    Unavailable(String),
    /// An external engine that answers, but not as the adapter needs (a malformed body, missing
    /// routes, another model): a configuration error, not retried. The message names its URL.
    #[error("{0}")]
    Protocol(String),
    /// The agent gateway cannot serve (no loopback port to listen on).
    #[error("the agent gateway: {0}")]
    Gateway(String),
}

/// A boxed future, as the engine interface returns them (so `dyn InferenceEngine` works).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An inference engine that rollout actors own (native, PJRT, or an external server).
pub trait InferenceEngine: Send + Sync {
    /// Generates `n` completions for each request; completions come back ordered by request,
    /// then sample index.
    fn generate(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> BoxFuture<'_, Result<Vec<Completion>, EngineError>>;
    /// Swaps in new weights between decode steps and takes their version.
    fn update_weights(&self, snapshot: WeightSnapshot) -> BoxFuture<'_, Result<(), EngineError>>;
    /// The version currently served.
    fn weight_version(&self) -> u64;
}

/// An in-process engine to make.
pub enum EngineSpec {
    /// The native CPU engine.
    Native(native::NativeConfig),
    /// A PJRT device, through a client of its plugin.
    Pjrt(learner::pjrt::Client),
}

/// The engine `spec` names, serving `model`'s weights as `version`: the one place an engine is
/// chosen.
pub fn open(
    spec: EngineSpec,
    model: Model,
    version: u64,
) -> Result<Box<dyn InferenceEngine>, EngineError> {
    Ok(match spec {
        EngineSpec::Native(config) => Box::new(native::NativeEngine::new(
            model,
            native::NativeConfig {
                initial_version: version,
                ..config
            },
        )),
        EngineSpec::Pjrt(client) => Box::new(pjrt::PjrtEngine::new(client, &model, version)?),
    })
}
