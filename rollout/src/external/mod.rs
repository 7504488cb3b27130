//! External engines: servers reached over HTTP, one [`ExternalEngine`] per server, made by
//! [`connect`]. The adapters (`vllm`, `sglang`) speak each server's routes over `http`; what
//! they share is in `common` and `folders`.
//!
//! Owns: the interface a pool needs of a server (generate, reload a folder as a version,
//! health, load) and the one place an adapter is chosen. Never: decides when to push or
//! route (the pool does).

pub mod common;
pub mod folders;
pub mod http;
pub mod sglang;
pub mod vllm;

pub use common::{ExternalConfig, Load, prometheus_sum};
pub use folders::WeightFolders;

use crate::{BoxFuture, EngineError, InferenceEngine};
use std::path::Path;

/// A server's API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// vLLM's (also `trellis engine serve`'s).
    Vllm,
    /// SGLang's.
    Sglang,
}

/// An engine server: an [`InferenceEngine`] that also reloads weight folders and reports its
/// health and load.
pub trait ExternalEngine: InferenceEngine {
    /// Its base URL.
    fn url(&self) -> &str;
    /// Makes the engine serve the weights in `dir` as `version`.
    fn reload<'a>(&'a self, dir: &'a Path, version: u64) -> BoxFuture<'a, Result<(), EngineError>>;
    /// `Ok` when the engine answers its health route.
    fn health(&self) -> BoxFuture<'_, Result<(), EngineError>>;
    /// Its queue and KV-cache use from its Prometheus metrics (zeros where it exports none).
    fn load(&self) -> BoxFuture<'_, Result<Load, EngineError>>;
}

/// Connects to a server of `api`: checks that it answers and serves the expected model.
pub async fn connect(
    api: Api,
    cfg: ExternalConfig,
) -> Result<Box<dyn ExternalEngine>, EngineError> {
    Ok(match api {
        Api::Vllm => Box::new(vllm::VllmEngine::connect(cfg).await?),
        Api::Sglang => Box::new(sglang::SglangEngine::connect(cfg).await?),
    })
}
