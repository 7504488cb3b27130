//! The `rollout` actor kind: an inference engine (native, or pjrt on the host's plugin) as an
//! actor. Its engine starts with the first weights it is given.

use crate::plan::Device;
use actors::{Actor, CallError};
use kernels::tensor::WeightSnapshot;
use learner::{Model, ModelConfig};
use rollout::episode::{self, Agent, AgentSetup};
use rollout::native::NativeConfig;
use rollout::{Completion, EngineError, GenerateRequest, InferenceEngine};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which engine a rollout actor runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum EngineSpec {
    /// The native engine.
    Native {
        /// The number format of the weights it serves.
        #[serde(default)]
        weights_dtype: learner::params::WeightDtype,
        /// The number format of its KV cache.
        #[serde(default)]
        kv_cache_dtype: learner::params::WeightDtype,
    },
    /// A PJRT plugin's device on the host that runs the actor.
    Pjrt {
        /// Which device.
        device: Device,
        /// The plugin (default: the one found for the device there).
        #[serde(default)]
        plugin: Option<PathBuf>,
    },
}

/// How a rollout actor starts: the model's shape (its weights arrive by `load_weights`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RolloutConfig {
    /// The model's Hugging Face `config.json` fields.
    pub model: serde_json::Value,
    /// KV-cache budget of this actor's engine, in bytes.
    pub kv_cache_bytes: usize,
    /// Its engine.
    pub engine: EngineSpec,
    /// How it plays episodes (a job with an environment only).
    #[serde(default)]
    pub agent: Option<AgentSetup>,
}

/// What a rollout actor is asked.
#[derive(Debug, Serialize, Deserialize)]
pub enum RolloutRequest {
    /// Generate completions (ordered by request, then sample); a request with an episode is
    /// played here, every turn beside the engine.
    Generate(Vec<GenerateRequest>),
    /// Serve weights `version`: a learner rank's of the group in this process, shared; else
    /// read from the learner ranks' outboxes (each rank's shard from its rank: mapped on this
    /// host, streamed with CRC-32C checks from others), in the layout of the weights served
    /// now. `content_crc` ([`actors::snapshot::content_crc`]) must match what was found, or
    /// nothing is swapped in.
    Pull {
        version: u64,
        source: actors::exchange::Source,
        content_crc: u32,
    },
}

/// What a rollout actor answers.
#[derive(Debug, Serialize, Deserialize)]
pub enum RolloutResponse {
    /// The completions of a `Generate`.
    Completions(Vec<Completion>),
    /// A `Pull`'s weights are served.
    Pulled,
    /// A `Pull`'s weights are served, taken from a learner rank in this process: the engine
    /// serves the rank's very memory (no copy, nothing read).
    Beside,
}

/// An inference engine as an actor.
pub struct RolloutActor {
    config: ModelConfig,
    start: RolloutConfig,
    engine: Option<Box<dyn InferenceEngine>>,
    agent: Option<Agent>,
}

/// The PJRT plugin's device kind for a pool's device.
pub(crate) fn pjrt_device(d: Device) -> libtpu_sys::locate::Device {
    match d {
        Device::Cpu => libtpu_sys::locate::Device::Cpu,
        Device::Gpu => libtpu_sys::locate::Device::Gpu,
        Device::Tpu => libtpu_sys::locate::Device::Tpu,
    }
}

impl Actor for RolloutActor {
    const KIND: &'static str = "rollout";
    type Config = RolloutConfig;
    type Request = RolloutRequest;
    type Response = RolloutResponse;

    fn start(config: RolloutConfig) -> Result<Self, String> {
        let mc = ModelConfig::from_json(config.model.clone(), Path::new("rollout actor config"))
            .map_err(|e| e.to_string())?;
        let agent = config.agent.as_ref().map(Agent::new).transpose()?;
        Ok(Self {
            config: mc,
            start: config,
            engine: None,
            agent,
        })
    }

    async fn handle(&mut self, request: RolloutRequest) -> Result<RolloutResponse, CallError> {
        let engine = self
            .engine
            .as_ref()
            .ok_or("no weights yet: push a snapshot before generating")?;
        match request {
            RolloutRequest::Generate(reqs) => {
                episode::generate(engine.as_ref(), self.agent.as_ref(), reqs)
                    .await
                    .map(RolloutResponse::Completions)
                    .map_err(|e| match e {
                        // An engine that did not answer may answer the same call later.
                        EngineError::Unavailable(m) => CallError::retryable(m),
                        e => CallError::fatal(e.to_string()),
                    })
            }
            RolloutRequest::Pull {
                version,
                source,
                content_crc,
            } => {
                // A retried pull whose version a restart hook already delivered.
                if engine.weight_version() == version {
                    return Ok(RolloutResponse::Pulled);
                }
                // A rank of the group in this process (`placement: colocate`): its weights as
                // they are, when they are the learner's.
                if let Some(params) = crate::kinds::learner::weights_beside(&source.key) {
                    let crc = actors::snapshot::content_crc(&params);
                    if crc == content_crc {
                        self.load_weights(WeightSnapshot::new(version, Arc::new(params)))
                            .await?;
                        return Ok(RolloutResponse::Beside);
                    }
                    tracing::warn!(
                        "the learner rank beside this engine holds weights of CRC-32C {crc:#010x}, the learner's are {content_crc:#010x}: reading them from the ranks"
                    );
                }
                // The model's tensors in layout order, as the learner's flat values are laid.
                let (_, specs) = learner::params::Layout::new(&self.config);
                let mut params = kernels::tensor::TensorSet::zeros(&specs);
                let read = tokio::task::spawn_blocking(move || {
                    source
                        .read(|at, v| {
                            learner::wire::write_range(&mut params, at, v)
                                .map_err(|e| CallError::fatal(e.to_string()))
                        })
                        .map(|()| params)
                })
                .await
                .map_err(|e| CallError::fatal(format!("reading the ranks' weights: {e}")))?;
                let params = read?;
                let crc = actors::snapshot::content_crc(&params);
                if crc != content_crc {
                    return Err(CallError::fatal(format!(
                        "weights {version} read from the learner ranks have CRC-32C {crc:#010x}, the learner's {content_crc:#010x}"
                    )));
                }
                self.load_weights(WeightSnapshot::new(version, Arc::new(params)))
                    .await?;
                Ok(RolloutResponse::Pulled)
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
        let version = snapshot.version;
        let params = Arc::unwrap_or_clone(snapshot.into_params().map_err(|e| e.to_string())?);
        let model = Model::new(self.config.clone(), params).map_err(|e| e.to_string())?;
        let spec = match &self.start.engine {
            EngineSpec::Pjrt { device, plugin } => {
                let client = libtpu_sys::locate::open(pjrt_device(*device), plugin.as_deref())
                    .map_err(|e| format!("pools.rollout: {e}"))?;
                tracing::info!(
                    platform = client.platform(),
                    client = client.serial(),
                    "rollout engine on pjrt"
                );
                rollout::EngineSpec::Pjrt(client)
            }
            EngineSpec::Native {
                weights_dtype,
                kv_cache_dtype,
            } => rollout::EngineSpec::Native(NativeConfig {
                kv_cache_bytes: self.start.kv_cache_bytes,
                weights_dtype: *weights_dtype,
                kv_cache_dtype: *kv_cache_dtype,
                ..Default::default()
            }),
        };
        let engine = rollout::open(spec, model, version).map_err(|e| e.to_string())?;
        self.engine = Some(engine);
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use actors::exchange::{Member, Outbox, Reach, Source};

    /// A one-layer model of random weights (`seed`), for the pools' tests too.
    pub(crate) fn tiny(seed: u64) -> Model {
        let cfg = serde_json::json!({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 64});
        Model::init(ModelConfig::from_json(cfg, Path::new("t")).unwrap(), seed)
    }

    /// A pull reads the ranks' shards from their outboxes (two here, each holding its half),
    /// swaps in exactly what the learner has, and refuses — serving the old weights still —
    /// what does not match the learner's content CRC.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pull_reads_every_ranks_shard_and_refuses_a_wrong_checksum() {
        let (first, next) = (tiny(1), tiny(2));
        let mut actor = RolloutActor::start(RolloutConfig {
            model: first.config.to_hf_json(),
            kv_cache_bytes: 1 << 20,
            engine: EngineSpec::Native {
                weights_dtype: Default::default(),
                kv_cache_dtype: Default::default(),
            },
            agent: None,
        })
        .unwrap();
        actor
            .load_weights(WeightSnapshot::new(1, Arc::new(first.params.clone())))
            .await
            .unwrap();
        let flat = learner::wire::read_range(&next.params, 0, next.params.numel()).unwrap();
        let key = actors::Token::generate().unwrap();
        let half = flat.len() / 2;
        let shards = vec![(0, half), (half, flat.len() - half)];
        let mut outboxes: Vec<Outbox> = shards
            .iter()
            .map(|_| Outbox::open(flat.len(), &key, "127.0.0.1").unwrap())
            .collect();
        for (o, &(a, l)) in outboxes.iter_mut().zip(&shards) {
            o.values_mut()[a..a + l].copy_from_slice(&flat[a..a + l]);
        }
        for (version, reach) in [(2, Reach::Auto), (3, Reach::Streams)] {
            let source = Source {
                members: outboxes
                    .iter()
                    .map(|o| Member {
                        outbox: o.address().clone(),
                        reach: "127.0.0.1".into(),
                    })
                    .collect(),
                shards: shards.clone(),
                values: flat.len(),
                key: key.secret().into(),
                reach,
            };
            let crc = actors::snapshot::content_crc(&next.params);
            let e = actor
                .handle(RolloutRequest::Pull {
                    version,
                    source: source.clone(),
                    content_crc: crc ^ 1,
                })
                .await
                .unwrap_err();
            assert!(e.message.contains("CRC-32C"), "{}", e.message);
            let engine = actor.engine.as_ref().unwrap();
            assert_eq!(engine.weight_version(), version - 1, "nothing swapped in");
            let r = actor
                .handle(RolloutRequest::Pull {
                    version,
                    source,
                    content_crc: crc,
                })
                .await
                .unwrap();
            assert!(matches!(r, RolloutResponse::Pulled), "{reach:?}");
            assert_eq!(actor.engine.as_ref().unwrap().weight_version(), version);
        }
    }
}
