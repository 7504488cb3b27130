//! Rollout: the [`InferenceEngine`] trait, its request and completion types, the native CPU
//! engine (`native`: paged KV cache, continuous batching, shared prefill for `n` samples,
//! sampling, versioned weight swaps), the adapters for external engines (`vllm`, `sglang`, over
//! `http`, with weight folders from `external`) and the prefix-aware `router` that picks an
//! engine for each prompt.
//!
//! Owns: turning token ids into sampled continuations with log-probs and weight versions.
//! Never: trains, computes rewards, or serves HTTP (the engine server is the binary's); the
//! native engine never opens a socket.

pub mod bench;
pub mod external;
pub mod http;
pub mod kv;
pub mod native;
pub mod parquet;
pub mod pjrt;
pub mod reward;
pub mod router;
pub mod sampling;
pub mod sglang;
pub mod task;
pub mod vllm;

use kernels::tensor::WeightSnapshot;
pub use sampling::SamplingParams;
use serde::{Deserialize, Serialize};
use std::future::Future;

/// One prompt (token ids) and how to sample it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling settings; `n` completions come back for this request.
    pub params: SamplingParams,
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
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Which weights produced which tokens.
    pub weight_versions: Vec<VersionSpan>,
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
}

/// An inference engine that rollout actors own (native, PJRT, or an external server).
pub trait InferenceEngine: Send + Sync {
    /// Generates `n` completions for each request; completions come back ordered by request,
    /// then sample index.
    fn generate(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> impl Future<Output = Result<Vec<Completion>, EngineError>> + Send;
    /// Swaps in new weights between decode steps and takes their version.
    fn update_weights(
        &self,
        snapshot: WeightSnapshot,
    ) -> impl Future<Output = Result<(), EngineError>> + Send;
    /// The version currently served.
    fn weight_version(&self) -> u64;
}
