//! The critic of PPO: a copy of the policy's decoder stack with a scalar value head
//! (`score.weight` `[1, hidden]` and `score.bias` `[1]`, the layout of Hugging Face's
//! `*ForTokenClassification` with one label, which is what VeRL's critic loads).
//!
//! Owns: values per position, their backward, and the critic's files. Never: computes returns or
//! the value loss (`rl::advantage`, `rl::loss` do).

use crate::error::{Error, Result};
use crate::model::{Batch, Model, Tape};
use crate::optim::{Optimizer, StepReport};
use crate::params::Params;
use crate::params::ParamsIo;
use std::path::Path;

/// A value model.
#[derive(Clone, Debug)]
pub struct Critic {
    /// The decoder stack (its LM head, if any, is unused).
    pub model: Model,
    /// `score.weight` and `score.bias`.
    pub head: Params,
}

/// What [`Critic::forward`] keeps for the backward.
pub struct CriticTape {
    trunk: Tape,
    /// The final hidden states at the positions valued.
    hidden: Vec<f32>,
    /// Those positions, when not all ([`Batch::scored`]).
    scored: Option<Vec<usize>>,
}

const HEAD_FILE: &str = "value_head.safetensors";

fn head_specs(hidden: usize) -> Vec<(String, Vec<usize>)> {
    vec![
        ("score.weight".into(), vec![1, hidden]),
        ("score.bias".into(), vec![1]),
    ]
}

impl Critic {
    /// A critic initialised from `policy`'s weights with a zero value head (values start at 0).
    pub fn from_policy(policy: &Model) -> Self {
        Self {
            model: policy.clone(),
            head: Params::zeros(&head_specs(policy.config.hidden_size)),
        }
    }

    fn values_of(&self, hidden: &[f32]) -> Vec<f32> {
        let w = &self.head.tensors[0].data;
        let bias = self.head.tensors[1].data[0];
        hidden
            .chunks_exact(w.len())
            .map(|h| h.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() + bias)
            .collect()
    }

    /// The value at every position of `b` (`[rows·seq]`; 0 at those [`Batch::scored`] leaves
    /// out), without a tape.
    pub fn values(&self, b: &Batch) -> Result<Vec<f32>> {
        Ok(self.forward(b)?.0)
    }

    /// Values at every position (as [`Critic::values`]), keeping what the backward needs.
    pub fn forward(&self, b: &Batch) -> Result<(Vec<f32>, CriticTape)> {
        let (hidden, trunk) = self.model.forward_hidden_tape(b)?;
        let v = self.values_of(&hidden);
        let values = match &b.scored {
            None => v,
            Some(at) => {
                let mut all = vec![0.0; b.len()];
                at.iter().zip(v).for_each(|(&i, v)| all[i] = v);
                all
            }
        };
        let scored = b.scored.clone();
        Ok((
            values,
            CriticTape {
                trunk,
                hidden,
                scored,
            },
        ))
    }

    /// Gradient buffers: the trunk's tensors followed by the head's.
    pub fn zeros_grads(&self) -> Params {
        let mut g = self.model.params.zeros_like();
        g.tensors.extend(self.head.zeros_like().tensors);
        g
    }

    /// Backward from d(loss)/d(value) per position (0 where the batch valued nothing);
    /// accumulates into `grads` (from [`Critic::zeros_grads`]).
    pub fn backward(&self, tape: CriticTape, d_values: &[f32], grads: &mut Params) {
        let w = &self.head.tensors[0].data;
        let h = w.len();
        let picked: Vec<f32>;
        let d_values = match &tape.scored {
            None => d_values,
            Some(at) => {
                let mut valued = vec![false; d_values.len()];
                at.iter().for_each(|&i| valued[i] = true);
                assert!(
                    valued.iter().zip(d_values).all(|(&v, &d)| v || d == 0.0),
                    "critic: a gradient at a position the batch does not value"
                );
                picked = at.iter().map(|&i| d_values[i]).collect();
                &picked
            }
        };
        assert_eq!(
            d_values.len() * h,
            tape.hidden.len(),
            "critic: gradient length"
        );
        let nt = self.model.params.tensors.len();
        let mut dh = vec![0.0f32; tape.hidden.len()];
        {
            let (dw, db) = grads.tensors[nt..].split_at_mut(1);
            let (dw, db) = (&mut dw[0].data, &mut db[0].data);
            for ((dv, hrow), dhrow) in d_values
                .iter()
                .zip(tape.hidden.chunks_exact(h))
                .zip(dh.chunks_exact_mut(h))
            {
                if *dv == 0.0 {
                    continue;
                }
                db[0] += dv;
                for i in 0..h {
                    dw[i] += dv * hrow[i];
                    dhrow[i] = dv * w[i];
                }
            }
        }
        self.model.backward_hidden(tape.trunk, &dh, grads);
    }

    /// One optimiser step over trunk and head together (one global gradient norm).
    pub fn step(&mut self, opt: &mut Optimizer, grads: &mut Params) -> StepReport {
        self.with_all(|all| opt.step(all, grads))
    }

    /// Runs `f` on every tensor of the critic as one set — the trunk's, then the head's: the
    /// layout of its gradients and optimiser — and puts them back.
    pub fn with_all<R>(&mut self, f: impl FnOnce(&mut Params) -> R) -> R {
        let nt = self.model.params.tensors.len();
        let mut all = Params {
            tensors: std::mem::take(&mut self.model.params.tensors),
        };
        all.tensors.append(&mut self.head.tensors);
        let r = f(&mut all);
        self.head.tensors = all.tensors.split_off(nt);
        self.model.params.tensors = all.tensors;
        r
    }

    /// Every tensor as one set, trunk then head (what [`Critic::with_all`] lends).
    pub fn into_all(self) -> Params {
        let mut all = self.model.params;
        all.tensors.extend(self.head.tensors);
        all
    }

    /// A critic of `config` from its tensors as one set (as [`Critic::into_all`] gives them).
    pub fn from_all(config: &crate::ModelConfig, mut all: Params) -> Result<Self> {
        if all.tensors.len() < 2 {
            return Err(Error::Batch("a critic has a trunk and a value head".into()));
        }
        let head = Params {
            tensors: all.tensors.split_off(all.tensors.len() - 2),
        };
        let model = Model::new(config.clone(), all)?;
        Ok(Self { model, head })
    }

    /// A fresh optimiser shaped like this critic's parameters.
    pub fn optimizer(
        &self,
        hparams: kernels::optim::AdamW,
        schedule: crate::optim::LrSchedule,
        grad_clip: Option<f64>,
    ) -> Optimizer {
        Optimizer::new(&self.zeros_grads(), hparams, schedule, grad_clip)
    }

    /// Writes the trunk (`model.safetensors`) and the head (`value_head.safetensors`) to `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        self.model.params.save(&dir.join("model.safetensors"))?;
        self.head.save_prefixed(&dir.join(HEAD_FILE), "")
    }

    /// Reads what [`Critic::save`] wrote, for a trunk of `config`.
    pub fn load(dir: &Path, config: &crate::ModelConfig) -> Result<Self> {
        let model = Model::load_weights(config.clone(), dir)?;
        let head = crate::params::load_file(&dir.join(HEAD_FILE), &head_specs(config.hidden_size))?;
        Ok(Self { model, head })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use serde_json::json;

    fn tiny() -> Critic {
        let cfg = json!({"model_type": "qwen2", "vocab_size": 40, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 4, "max_position_embeddings": 32});
        let config = ModelConfig::from_json(cfg, Path::new("test")).unwrap();
        let mut c = Critic::from_policy(&Model::init(config, 3));
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(9);
        for t in c.model.params.tensors.iter_mut().chain(&mut c.head.tensors) {
            let mut noise = vec![0.0; t.data.len()];
            crate::rng::fill_normal(&mut rng, &mut noise, 0.3);
            t.data.iter_mut().zip(noise).for_each(|(v, n)| *v += n);
        }
        c
    }

    /// loss = Σ cᵢ·vᵢ; the directional derivative along a random direction over every tensor
    /// (trunk and head) matches the analytic gradient.
    #[test]
    fn value_gradients_match_finite_differences() {
        let c = tiny();
        let b = Batch::padded(&[&[1u32, 5, 9, 13, 2][..], &[3, 4, 11][..]]);
        let coef: Vec<f32> = (0..b.len())
            .map(|i| ((i * 7 % 5) as f32 - 2.0) / 3.0)
            .collect();
        let loss = |c: &Critic| -> f64 {
            let v = c.values(&b).unwrap();
            v.iter().zip(&coef).map(|(a, b)| (a * b) as f64).sum()
        };
        let (_, tape) = c.forward(&b).unwrap();
        let mut g = c.zeros_grads();
        c.backward(tape, &coef, &mut g);
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(4);
        let mut dir = g.zeros_like();
        for t in &mut dir.tensors {
            crate::rng::fill_normal(&mut rng, &mut t.data, 1.0);
        }
        let analytic: f64 = g
            .tensors
            .iter()
            .zip(&dir.tensors)
            .flat_map(|(a, d)| a.data.iter().zip(&d.data))
            .map(|(a, d)| (a * d) as f64)
            .sum();
        let eps = 1e-3f32;
        let shifted = |sign: f32| {
            let mut c2 = c.clone();
            let nt = c2.model.params.tensors.len();
            for (i, d) in dir.tensors.iter().enumerate() {
                let t = if i < nt {
                    &mut c2.model.params.tensors[i]
                } else {
                    &mut c2.head.tensors[i - nt]
                };
                t.data
                    .iter_mut()
                    .zip(&d.data)
                    .for_each(|(v, d)| *v += sign * eps * d);
            }
            loss(&c2)
        };
        let numeric = (shifted(1.0) - shifted(-1.0)) / (2.0 * eps as f64);
        let rel = (numeric - analytic).abs() / analytic.abs().max(1e-3);
        assert!(rel < 2e-2, "numeric {numeric} analytic {analytic}");
    }

    #[test]
    fn valuing_some_positions_gives_their_values_and_gradients_as_the_whole_pass() {
        let c = tiny();
        let (full, _) = Batch::packed(&[&[1u32, 5, 9, 13, 2][..], &[3, 4, 11][..], &[7, 7]], 8);
        let scored = vec![2, 3, 4, 6, 7, 9];
        let part = full.clone().scoring_only(scored.clone());
        let (a, ta) = c.forward(&full).unwrap();
        let (b, tb) = c.forward(&part).unwrap();
        for i in 0..full.len() {
            let want = if scored.contains(&i) { a[i] } else { 0.0 };
            assert!(
                (b[i] - want).abs() <= 1e-5,
                "position {i}: {} vs {want}",
                b[i]
            );
        }
        let d: Vec<f32> = (0..full.len())
            .map(|i| {
                if scored.contains(&i) {
                    (i % 3) as f32 - 0.7
                } else {
                    0.0
                }
            })
            .collect();
        let (mut ga, mut gb) = (c.zeros_grads(), c.zeros_grads());
        c.backward(ta, &d, &mut ga);
        c.backward(tb, &d, &mut gb);
        for (x, y) in ga.tensors.iter().zip(&gb.tensors) {
            let scale = x.data.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let gap = x
                .data
                .iter()
                .zip(&y.data)
                .fold(0.0f32, |m, (u, v)| m.max((u - v).abs()));
            assert!(
                gap <= 1e-5 * scale.max(1e-6),
                "{}: {gap} of {scale}",
                x.name
            );
        }
    }

    #[test]
    fn steps_fit_targets_and_files_round_trip() {
        let mut c = tiny();
        let b = Batch::padded(&[&[1u32, 5, 9, 13, 2][..], &[3, 4, 11, 7, 7][..]]);
        let target: Vec<f32> = (0..b.len()).map(|i| (i % 3) as f32 - 1.0).collect();
        let mse = |c: &Critic| -> f64 {
            let v = c.values(&b).unwrap();
            v.iter()
                .zip(&target)
                .map(|(a, t)| ((a - t) as f64).powi(2))
                .sum::<f64>()
        };
        let first = mse(&c);
        let mut opt = c.optimizer(
            Default::default(),
            crate::optim::LrSchedule::constant(1e-2),
            Some(1.0),
        );
        let mut g = c.zeros_grads();
        for _ in 0..60 {
            let (v, tape) = c.forward(&b).unwrap();
            let d: Vec<f32> = v.iter().zip(&target).map(|(a, t)| 2.0 * (a - t)).collect();
            c.backward(tape, &d, &mut g);
            c.step(&mut opt, &mut g);
            g.fill_zero();
        }
        let last = mse(&c);
        assert!(last < 0.2 * first, "value MSE {first} → {last}");
        let dir = std::env::temp_dir().join(format!("trellis-critic-{}", std::process::id()));
        c.save(&dir).unwrap();
        let back = Critic::load(&dir, &c.model.config).unwrap();
        assert_eq!(back.values(&b).unwrap(), c.values(&b).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
