//! The rollout pool of an in-process run: `pools.rollout.count` native engines, each on its own
//! worker thread with its share of the KV-cache budget. A call's requests are spread over the
//! engines by prompt (the `n` samples of one prompt stay on one engine, where they share the
//! prompt's prefill), least-loaded first; every weight update goes to every engine before the
//! next generation starts.
//!
//! Owns: routing requests to engines and fanning out weights. Never: samples, trains or scores.

use learner::Model;
use learner::snapshot::WeightSnapshot;
use rollout::native::{NativeConfig, NativeEngine};
use rollout::{Completion, EngineError, GenerateRequest};

/// Native engines serving one rollout pool.
pub(crate) struct RolloutPool {
    engines: Vec<NativeEngine>,
}

impl RolloutPool {
    /// `count` engines of `model` splitting `kv_cache_bytes`, serving weight `version`.
    pub(crate) fn new(model: &Model, count: usize, kv_cache_bytes: usize, version: u64) -> Self {
        let count = count.max(1);
        let engines = (0..count)
            .map(|_| {
                NativeEngine::new(
                    model.clone(),
                    NativeConfig {
                        kv_cache_bytes: kv_cache_bytes / count,
                        initial_version: version,
                        ..Default::default()
                    },
                )
            })
            .collect();
        Self { engines }
    }

    /// Engines in the pool.
    pub(crate) fn len(&self) -> usize {
        self.engines.len()
    }

    /// Generates `reqs` across the engines; completions come back ordered by request, then
    /// sample, as from one engine. A request goes whole to the engine with the fewest sampled
    /// sequences assigned so far (ties: the lowest index), so the split is deterministic.
    pub(crate) fn generate_blocking(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Completion>, EngineError> {
        if self.engines.len() == 1 {
            return self.engines[0].generate_blocking(reqs);
        }
        let mut load = vec![0usize; self.engines.len()];
        let mut shares: Vec<Vec<(usize, GenerateRequest)>> = vec![Vec::new(); self.engines.len()];
        for (i, r) in reqs.into_iter().enumerate() {
            let e = (0..load.len()).min_by_key(|&e| (load[e], e)).unwrap_or(0);
            load[e] += r.params.n.max(1);
            shares[e].push((i, r));
        }
        let results: Vec<Result<Vec<Completion>, EngineError>> = std::thread::scope(|s| {
            let handles: Vec<_> = shares
                .iter()
                .zip(&self.engines)
                .filter(|(share, _)| !share.is_empty())
                .map(|(share, engine)| {
                    let reqs: Vec<GenerateRequest> = share.iter().map(|(_, r)| r.clone()).collect();
                    let index: Vec<usize> = share.iter().map(|(i, _)| *i).collect();
                    s.spawn(move || {
                        engine.generate_blocking(reqs).map(|mut out| {
                            for c in &mut out {
                                c.request = index[c.request];
                            }
                            out
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err(EngineError::Closed)))
                .collect()
        });
        let mut all = Vec::new();
        for r in results {
            all.extend(r?);
        }
        all.sort_by_key(|c| (c.request, c.index));
        Ok(all)
    }

    /// Swaps `snapshot` into every engine (each between its decode steps).
    pub(crate) fn update_weights_blocking(
        &self,
        snapshot: WeightSnapshot,
    ) -> Result<(), EngineError> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .engines
                .iter()
                .map(|e| {
                    let snap = snapshot.clone();
                    s.spawn(move || e.update_weights_blocking(snap))
                })
                .collect();
            handles
                .into_iter()
                .try_for_each(|h| h.join().unwrap_or(Err(EngineError::Closed)))
        })
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
        let one = RolloutPool::new(&model, 1, 8 << 20, 0);
        let three = RolloutPool::new(&model, 3, 8 << 20, 0);
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
        three.update_weights_blocking(snap).unwrap();
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
}
