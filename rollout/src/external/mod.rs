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
pub use http::ApiKey;

use crate::{BoxFuture, Completion, EngineError, GenerateRequest, InferenceEngine};
use kernels::tensor::WeightSnapshot;
use std::path::Path;
use std::sync::OnceLock;

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

/// The [`InferenceEngine`] and [`ExternalEngine`] faces of an adapter type whose inherent
/// methods do the work (`url`, `generate_all`, `reload`, `health`, `load`) and whose fields hold
/// its served version and weight folders (`version`, `folders`): every adapter the same way.
macro_rules! adapter {
    ($t:ty) => {
        impl $crate::InferenceEngine for $t {
            fn generate(
                &self,
                reqs: Vec<$crate::GenerateRequest>,
            ) -> $crate::BoxFuture<'_, Result<Vec<$crate::Completion>, $crate::EngineError>> {
                Box::pin(self.generate_all(reqs))
            }

            fn update_weights(
                &self,
                snapshot: kernels::tensor::WeightSnapshot,
            ) -> $crate::BoxFuture<'_, Result<(), $crate::EngineError>> {
                Box::pin(async move {
                    let dir =
                        super::folders::write_folder(self.folders.as_ref(), self.url(), &snapshot)?;
                    self.reload(&dir, snapshot.version).await
                })
            }

            fn weight_version(&self) -> u64 {
                self.version.load(std::sync::atomic::Ordering::Acquire)
            }
        }

        impl $crate::external::ExternalEngine for $t {
            fn url(&self) -> &str {
                <$t>::url(self)
            }

            fn reload<'a>(
                &'a self,
                dir: &'a std::path::Path,
                version: u64,
            ) -> $crate::BoxFuture<'a, Result<(), $crate::EngineError>> {
                Box::pin(<$t>::reload(self, dir, version))
            }

            fn health(&self) -> $crate::BoxFuture<'_, Result<(), $crate::EngineError>> {
                Box::pin(<$t>::health(self))
            }

            fn load(
                &self,
            ) -> $crate::BoxFuture<'_, Result<$crate::external::Load, $crate::EngineError>> {
                Box::pin(<$t>::load(self))
            }
        }
    };
}
use adapter;

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

/// A server that did not answer when its pool started: every call is `Unavailable` until a
/// health check reaches it, which [`connect`]s it (and checks its model) then; from there on it
/// is the connected adapter. A pool starts an engine that is down this way, out of service, so
/// one engine restarting does not stop a job from starting or resuming.
pub struct Pending {
    api: Api,
    cfg: ExternalConfig,
    engine: OnceLock<Box<dyn ExternalEngine>>,
}

impl Pending {
    /// An engine of `api` at `cfg.url`, connected at its first answered health check.
    pub fn new(api: Api, cfg: ExternalConfig) -> Self {
        Self {
            api,
            cfg,
            engine: OnceLock::new(),
        }
    }

    fn engine(&self) -> Result<&dyn ExternalEngine, EngineError> {
        self.engine
            .get()
            .map(|e| &**e)
            .ok_or_else(|| EngineError::Unavailable(format!("{}: not reached yet", self.cfg.url)))
    }
}

impl InferenceEngine for Pending {
    fn generate(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> BoxFuture<'_, Result<Vec<Completion>, EngineError>> {
        Box::pin(async move { self.engine()?.generate(reqs).await })
    }

    fn update_weights(&self, snapshot: WeightSnapshot) -> BoxFuture<'_, Result<(), EngineError>> {
        Box::pin(async move { self.engine()?.update_weights(snapshot).await })
    }

    fn weight_version(&self) -> u64 {
        self.engine().map_or(0, |e| e.weight_version())
    }
}

impl ExternalEngine for Pending {
    fn url(&self) -> &str {
        &self.cfg.url
    }

    fn reload<'a>(&'a self, dir: &'a Path, version: u64) -> BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move { self.engine()?.reload(dir, version).await })
    }

    fn health(&self) -> BoxFuture<'_, Result<(), EngineError>> {
        Box::pin(async move {
            if let Ok(e) = self.engine() {
                return e.health().await;
            }
            let e = connect(self.api, self.cfg.clone()).await?;
            // Two checks at once may both connect: either connection is as good.
            let _ = self.engine.set(e);
            Ok(())
        })
    }

    fn load(&self) -> BoxFuture<'_, Result<Load, EngineError>> {
        Box::pin(async move { self.engine()?.load().await })
    }
}
