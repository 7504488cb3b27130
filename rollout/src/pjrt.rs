//! The `pjrt` inference engine: generation on a PJRT device (TPU, GPU, the XLA CPU plugin) with
//! the model traced to StableHLO and its KV cache on the device ([`learner::pjrt::PjrtDecoder`]);
//! sampling on the host with the native engine's sampler, so the same seeds and logits give the
//! same tokens and log-probs.
//!
//! Scheduling is static batching per call: every sample of every request is a row; rows are
//! prefilled together, then decode one token per step until all finished (finished rows idle).
//! Weight updates apply between calls (in-flight calls finish on the weights they started
//! with). Owns: rows, seeds, stop rules, version spans. Never: compiles or traces (the
//! decoder does).

use crate::native::check_requests;
use crate::sampling::sample;
use crate::{
    BoxFuture, Completion, EngineError, FinishReason, GenerateRequest, InferenceEngine, VersionSpan,
};
use kernels::tensor::WeightSnapshot;
use learner::pjrt::{Client, DeviceParams, PjrtDecoder};
use learner::{Model, ModelConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// Most rows (samples) one device batch runs; more are run in several batches.
pub const MAX_ROWS: usize = 256;

struct Inner {
    dec: PjrtDecoder,
    version: u64,
    next_seed: u64,
}

/// An [`InferenceEngine`] on a PJRT device.
pub struct PjrtEngine {
    inner: Arc<Mutex<Inner>>,
    config: ModelConfig,
    version: Arc<AtomicU64>,
}

fn device(e: learner::Error) -> EngineError {
    EngineError::Protocol(format!("pjrt engine: {e}"))
}

struct Row {
    request: usize,
    index: usize,
    prompt_len: usize,
    rng: ChaCha8Rng,
    stops: Vec<u32>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    entropies: Vec<f32>,
    done: Option<FinishReason>,
}

impl Inner {
    fn generate(&mut self, reqs: &[GenerateRequest]) -> Result<Vec<Completion>, EngineError> {
        let eos = self.dec.config().eos_token_id;
        let mut rows = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            let p = &r.params;
            let seed = p.seed.unwrap_or_else(|| {
                self.next_seed = self.next_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
                self.next_seed
            });
            let mut stops = p.stop_token_ids.clone();
            if !p.ignore_eos
                && let Some(e) = eos
            {
                stops.push(e);
            }
            for index in 0..p.n {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(index as u64);
                rows.push(Row {
                    request: i,
                    index,
                    prompt_len: r.prompt.len(),
                    rng,
                    stops: stops.clone(),
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    entropies: Vec::new(),
                    done: None,
                });
            }
        }
        let vocab = self.dec.config().vocab_size;
        for chunk in rows.chunks_mut(MAX_ROWS) {
            let len = chunk
                .iter()
                .map(|r| r.prompt_len + reqs[r.request].params.max_tokens)
                .max()
                .unwrap_or(1);
            let mut kv = self.dec.start(chunk.len(), len).map_err(device)?;
            let prompts: Vec<&[u32]> = chunk.iter().map(|r| &reqs[r.request].prompt[..]).collect();
            let mut logits = self
                .dec
                .extend(&mut kv, &prompts, &vec![0; chunk.len()])
                .map_err(device)?;
            loop {
                for (j, row) in chunk.iter_mut().enumerate() {
                    if row.done.is_some() {
                        continue;
                    }
                    let params = &reqs[row.request].params;
                    let s = sample(&logits[j * vocab..(j + 1) * vocab], params, &mut row.rng);
                    let tok = s.token;
                    row.tokens.push(tok);
                    row.logprobs.push(s.logprob);
                    row.entropies.push(s.entropy);
                    if row.stops.contains(&tok) {
                        row.done = Some(FinishReason::Stop);
                    } else if row.tokens.len() >= params.max_tokens {
                        row.done = Some(FinishReason::Length);
                    }
                }
                if chunk.iter().all(|r| r.done.is_some()) {
                    break;
                }
                // Finished rows idle on slot 0 of their own cache.
                let next: Vec<[u32; 1]> = chunk
                    .iter()
                    .map(|r| {
                        [if r.done.is_some() {
                            0
                        } else {
                            r.tokens[r.tokens.len() - 1]
                        }]
                    })
                    .collect();
                let starts: Vec<usize> = chunk
                    .iter()
                    .map(|r| match r.done {
                        Some(_) => 0,
                        None => r.prompt_len + r.tokens.len() - 1,
                    })
                    .collect();
                let toks: Vec<&[u32]> = next.iter().map(|t| t.as_slice()).collect();
                logits = self.dec.extend(&mut kv, &toks, &starts).map_err(device)?;
            }
        }
        let version = self.version;
        Ok(rows
            .into_iter()
            .map(|r| Completion {
                request: r.request,
                index: r.index,
                weight_versions: vec![VersionSpan {
                    version,
                    start: 0,
                    end: r.tokens.len(),
                }],
                token_ids: r.tokens,
                logprobs: r.logprobs,
                entropies: r.entropies,
                finish_reason: r.done.unwrap_or(FinishReason::Length),
                observations: Vec::new(),
                prompt: None,
                cached_tokens: 0,
                episode: None,
            })
            .collect())
    }
}

impl PjrtEngine {
    /// An engine serving `model`'s weights as `version`, on `client`'s device.
    pub fn new(client: Client, model: &Model, version: u64) -> Result<Self, EngineError> {
        let dec = PjrtDecoder::new(client, model).map_err(device)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(Inner {
                dec,
                version,
                next_seed: 0x5eed,
            })),
            config: model.config.clone(),
            version: Arc::new(AtomicU64::new(version)),
        })
    }

    /// Runs `f` on the engine's state in a thread of its own (device calls block).
    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Inner) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, EngineError> {
        let inner = self.inner.clone();
        let (tx, rx) = oneshot::channel();
        std::thread::spawn(move || {
            let r = match inner.lock() {
                Ok(mut i) => f(&mut i),
                Err(_) => Err(EngineError::Closed),
            };
            let _ = tx.send(r);
        });
        rx.await.map_err(|_| EngineError::Closed)?
    }
}

impl InferenceEngine for PjrtEngine {
    fn generate(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> BoxFuture<'_, Result<Vec<Completion>, EngineError>> {
        Box::pin(async move {
            check_requests(&self.config, &reqs)?;
            self.with(move |i| i.generate(&reqs)).await
        })
    }

    fn update_weights(&self, snapshot: WeightSnapshot) -> BoxFuture<'_, Result<(), EngineError>> {
        let version = self.version.clone();
        Box::pin(self.with(move |i| {
            let bad = |e: &dyn std::fmt::Display| EngineError::BadWeights(e.to_string());
            // Weights a learner of this process left on this device are served as they are;
            // any others are uploaded from the host.
            let on_device = snapshot
                .device()
                .and_then(|d| {
                    let any: Arc<dyn std::any::Any + Send + Sync> = d.clone();
                    any.downcast::<DeviceParams>().ok()
                })
                .filter(|d| i.dec.can_take(d));
            match on_device {
                Some(d) => i.dec.set_device_params(d).map_err(|e| bad(&e))?,
                None => {
                    if snapshot.device().is_some() {
                        tracing::info!(
                            "the learner's weights are on another device: reading them to the host"
                        );
                    }
                    let params = snapshot.params().map_err(|e| bad(&e))?;
                    i.dec.set_params(params).map_err(|e| bad(&e))?;
                }
            }
            i.version = snapshot.version;
            version.store(snapshot.version, Ordering::Release);
            Ok(())
        }))
    }

    fn weight_version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }
}
