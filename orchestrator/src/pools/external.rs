//! External engines in a pool: the probe that checks every weight push (one token sampled at a
//! fixed temperature after a fixed prompt, whose log-prob must equal the learner's), and the
//! bookkeeping of engines taken out of service.
//!
//! Owns: what "serves the pushed weights" means for a server. Never: speaks a server's API (the
//! `rollout` adapters do).

use super::{PoolError, lock};
use kernels::tensor::WeightSnapshot;
use learner::params::WeightDtype;
use learner::{Model, ModelConfig};
use rollout::external::{ExternalEngine, WeightFolders};
use rollout::{EngineError, GenerateRequest};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The temperature of the probe that checks a push (not 1, so that log-probs taken before and
/// after temperature differ).
const PROBE_TEMPERATURE: f32 = 0.7;

/// What the learner expects an engine to answer after a push: one token sampled at
/// [`PROBE_TEMPERATURE`] after a fixed prompt, whose log-prob must match the learner's.
#[derive(Clone, Debug)]
pub(crate) struct Probe {
    pub version: u64,
    /// The version's weight folder.
    pub dir: PathBuf,
    prompt: Vec<u32>,
    /// The learner's `log_softmax(logits / T)` over the vocabulary at the prompt's end.
    processed: Vec<f32>,
    /// `log_softmax(logits)`: what an engine reporting raw log-probs answers.
    raw: Vec<f32>,
}

impl Probe {
    /// The probe of `snapshot` (weights of a model of `config`), whose folder is `dir` and holds
    /// them as `dtype` (bf16: the learner's expectation is computed from the rounded weights the
    /// engine loads, so the check stays exact).
    pub fn of(
        config: &ModelConfig,
        snapshot: &WeightSnapshot,
        dir: PathBuf,
        dtype: WeightDtype,
    ) -> Result<Self, PoolError> {
        let mut params = (**snapshot.params()?).clone();
        if dtype == WeightDtype::Bf16 {
            for t in &mut params.tensors {
                for x in t.data.iter_mut() {
                    *x = half::bf16::from_f32(*x).to_f32();
                }
            }
        }
        let model = Model::new(config.clone(), params)?;
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
            version: snapshot.version,
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
            episode: None,
        }
    }
}

/// The settings and state of a pool of external engines.
pub(crate) struct ExternalPool {
    pub folders: WeightFolders,
    pub config: ModelConfig,
    pub tolerance: f64,
    /// The run trains on the engine's own log-probs (async mode): raw ones are refused.
    pub needs_processed: bool,
    /// How long a generation waits for an engine when every engine is out of service.
    pub wait: Duration,
    /// How long one engine's whole weight push (reload, version, probe) may take.
    pub push_timeout: Duration,
    /// The check of the weights every engine must serve (`None` before the first push).
    pub probe: Mutex<Option<Probe>>,
    pub raw_warned: std::sync::atomic::AtomicBool,
}

impl ExternalPool {
    /// Writes `snapshot` as a new folder and makes the probe of it the one engines must pass.
    pub fn publish(&self, snapshot: &WeightSnapshot) -> Result<Probe, PoolError> {
        let dir = self.folders.write(snapshot, &self.config)?;
        let probe = Probe::of(&self.config, snapshot, dir, self.folders.dtype())?;
        *lock(&self.probe) = Some(probe.clone());
        Ok(probe)
    }

    /// Pushes the probe's version to `e` and checks its answer against the learner's, within
    /// the push deadline: an engine that accepts the calls and never answers is `Unavailable`
    /// when it passes, whatever the calls' own timeouts.
    pub async fn reload_and_verify(
        &self,
        e: &dyn ExternalEngine,
        p: &Probe,
    ) -> Result<(), EngineError> {
        tokio::time::timeout(self.push_timeout, self.push(e, p))
            .await
            .unwrap_or_else(|_| {
                Err(EngineError::Unavailable(format!(
                    "{}: the push of version {} did not finish within {:.0?} (pools.rollout.push_timeout_s)",
                    e.url(),
                    p.version,
                    self.push_timeout
                )))
            })
    }

    async fn push(&self, e: &dyn ExternalEngine, p: &Probe) -> Result<(), EngineError> {
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
        let Some(&want) = p.processed.get(t as usize) else {
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
                    "{url} reports raw log-probs (before temperature), and this run trains on the engine's log-probs (trainer.mode: async, or algorithm.old_logp: engine): start vLLM with --logprobs-mode processed_logprobs"
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
}

/// An engine out of service: why, and when to try it again.
pub(crate) struct Down {
    pub error: String,
    pub next_try: Instant,
    pub backoff: Duration,
}
