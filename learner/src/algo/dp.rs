//! Data parallelism: one optimiser step computed by several ranks, each on its share of the
//! mini-batch. The driver's loops ([`super::policy::update_ranks`], [`super::sft::step_ranks`])
//! cut each mini-batch into [`Work`] — one share a rank, with the normalisers of the *whole*
//! mini-batch, so the shares' losses and gradients add up exactly to the undivided ones — and
//! hand it to [`Ranks`]: each rank runs [`gradient`] on its engine, the gradients are summed,
//! and every rank applies the same sum with the same optimiser decision, so their weights stay
//! equal. One engine in this process is one rank ([`OneEngine`]); the orchestrator's learner
//! actors are N.
//!
//! Owns: what a share is, what a rank computes from it, and how the shares' metrics add up.
//! Never: moves gradients between ranks (the [`Ranks`] implementation does), or knows where
//! a rank runs.

use super::PolicyUpdate;
use super::TokenRows;
use super::layout::Row;
use crate::critic::Critic;
use crate::engine::TrainEngine;
use crate::error::Result;
use crate::optim::{Optimizer, StepReport};
use crate::params::Params;
use crate::rl::Metrics;
use crate::rl::Shape;
use crate::rl::agg::{AggNorm, LossAgg};
use crate::rl::loss::{ActorInput, CriticInput, actor_loss, value_loss};
use serde::{Deserialize, Serialize};

/// One rank's share of one optimiser step.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Work {
    /// Rows of a policy-update mini-batch.
    Policy {
        /// The rows and their per-token inputs.
        shard: Box<PolicyShard>,
        /// The update's settings.
        cfg: PolicyUpdate,
    },
    /// Rows of a critic-update mini-batch.
    Value {
        /// The rows and their per-token inputs.
        shard: Box<ValueShard>,
        /// VeRL's `cliprange_value`.
        cliprange: f64,
    },
    /// (prompt, answer) pairs of an SFT batch.
    Sft {
        /// This rank's pairs.
        examples: Vec<(Vec<u32>, Vec<u32>)>,
        /// Answer tokens in the whole batch (the mean's denominator).
        tokens: usize,
    },
}

/// A rank's rows of a policy mini-batch, all `[rows, cols]` over `rows`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PolicyShard {
    /// The prompts and responses.
    pub rows: TokenRows,
    /// Per-token advantages.
    #[serde(with = "crate::wire::floats")]
    pub advantages: Vec<f32>,
    /// The behaviour policy's log-probs (`None`: the current ones).
    #[serde(with = "crate::wire::opt_floats")]
    pub old_logp: Option<Vec<f32>>,
    /// The reference policy's log-probs.
    #[serde(with = "crate::wire::opt_floats")]
    pub ref_logp: Option<Vec<f32>>,
    /// The rollout engine's entropy of each token's sampling distribution (see
    /// [`PolicyBatch::entropy`](super::policy::PolicyBatch::entropy)).
    #[serde(default, with = "crate::wire::opt_floats")]
    pub entropy: Option<Vec<f32>>,
    /// Normalisers of the whole mini-batch.
    pub norm: AggNorm,
}

/// A critic rank's rows of a value mini-batch, all `[rows, cols]` over `rows`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ValueShard {
    /// The prompts and responses.
    pub rows: TokenRows,
    /// The values the batch was generated with.
    #[serde(with = "crate::wire::floats")]
    pub old_values: Vec<f32>,
    /// The targets.
    #[serde(with = "crate::wire::floats")]
    pub returns: Vec<f32>,
    /// Normalisers of the whole mini-batch.
    pub norm: AggNorm,
}

/// What a rank reports of its share.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Its metrics (losses already weighted by the whole mini-batch's normalisers).
    #[serde(with = "crate::wire::metrics")]
    pub metrics: Metrics,
    /// Its response (or answer) tokens.
    pub tokens: f64,
    /// The tokens its model ran ([`Batch::tokens`]).
    pub positions: usize,
}

/// The ranks one optimiser step runs on.
pub trait Ranks {
    /// What a rank (or the link to it) can fail with.
    type Error: From<crate::Error>;

    /// How many there are.
    fn count(&self) -> usize;

    /// Rank `i` computes `work[i]`'s gradient (every rank at once, where they can), keeping it
    /// for the next [`Ranks::step`].
    fn gradients(&mut self, work: Vec<Work>) -> Result<Vec<Outcome>, Self::Error>;

    /// Sums the ranks' gradients and applies the sum on every rank with its optimiser (one
    /// decision everywhere: the same norm, clip and skip); clears the gradients.
    fn step(&mut self) -> Result<StepReport, Self::Error>;
}

/// What a policy rank computes: the gradient of its share, added to `engine`'s summed
/// gradients.
pub fn gradient(engine: &mut dyn TrainEngine, work: &Work) -> Result<Outcome> {
    match work {
        Work::Policy { shard, cfg } => policy_gradient(engine, shard, cfg),
        Work::Sft { examples, tokens } => sft_gradient(engine, examples, *tokens),
        Work::Value { .. } => Err(crate::Error::Ranks(
            "a value model's share sent to a policy rank".into(),
        )),
    }
}

/// What a critic rank computes: the gradient of its share of a value update, added to `grads`
/// (laid out as [`Critic::zeros_grads`]).
pub fn value_gradient(critic: &Critic, grads: &mut Params, work: &Work) -> Result<Outcome> {
    let Work::Value { shard, cliprange } = work else {
        return Err(crate::Error::Ranks(
            "a policy's share sent to a critic rank".into(),
        ));
    };
    let rows = &shard.rows;
    let Some(c) = rows.chunks(rows.shape.rows).next() else {
        return Ok(Outcome::default());
    };
    let (v, tape) = critic.forward(&c.batch)?;
    let values = c.gather(&v);
    let out = value_loss(
        &shard.norm,
        *cliprange,
        CriticInput {
            shape: c.shape(),
            values: &values,
            old_values: &shard.old_values,
            returns: &shard.returns,
            mask: &rows.mask,
        },
    )?;
    critic.backward(tape, &c.scatter(&out.grad), grads);
    Ok(Outcome {
        metrics: out.metrics,
        tokens: rows.response_tokens(),
        positions: c.batch.tokens(),
    })
}

fn policy_gradient(
    engine: &mut dyn TrainEngine,
    shard: &PolicyShard,
    cfg: &PolicyUpdate,
) -> Result<Outcome> {
    let rows = &shard.rows;
    let (n, cols) = (rows.shape.rows, rows.shape.cols);
    if n == 0 {
        // More ranks than rows: this one adds nothing.
        return Ok(Outcome::default());
    }
    // Every policy loss's gradient at a token is proportional to its advantage, so a row whose
    // advantages are all zero (a GRPO group that all passed or all failed) adds nothing to the
    // gradient unless an entropy bonus or a KL loss is on: it is scored for the metrics, not
    // trained (its forward keeps nothing and it has no backward). One row is always trained,
    // so every share has a backward.
    let idle = |r: usize| {
        cfg.loss.entropy_coeff == 0.0
            && cfg.loss.kl.is_none()
            && (r * cols..(r + 1) * cols).all(|i| rows.mask[i] == 0.0 || shard.advantages[i] == 0.0)
    };
    let mut skip: Vec<bool> = (0..n).map(idle).collect();
    if skip.iter().all(|&s| s) {
        skip[0] = false;
    }
    let trained = rows.select(|r| !skip[r]);
    let sc = engine.forward(&trained.batch, cfg.temperature)?;
    let mut logp = trained.gather(&sc.logp);
    let mut ent = trained.gather(&sc.entropy);
    let mut positions = trained.batch.tokens();
    // On policy (no behaviour log-probs) an untrained row's ratio is 1 whatever its log-probs
    // (they are their own `old_logp`), so of its forward the metrics read only the entropy:
    // where the engine that sampled the row reported it, the row is not scored at all (its
    // log-probs stay 0, its ratio exp(0)).
    let engine_entropy = shard.entropy.as_ref().filter(|_| shard.old_logp.is_none());
    if let Some(e) = engine_entropy {
        if e.len() != rows.shape.len() {
            return Err(crate::Error::Batch(format!(
                "{} engine entropies for {} rows of {} tokens",
                e.len(),
                n,
                cols
            )));
        }
        for r in (0..n).filter(|&r| skip[r]) {
            ent[r * cols..(r + 1) * cols].copy_from_slice(&e[r * cols..(r + 1) * cols]);
        }
    } else if skip.iter().any(|&s| s) {
        let scored = rows.select(|r| skip[r]);
        let s = engine.score(&scored.batch, cfg.temperature)?;
        scored.gather_into(&s.logp, &mut logp);
        scored.gather_into(&s.entropy, &mut ent);
        positions += scored.batch.tokens();
    }
    let old = shard.old_logp.as_ref().unwrap_or(&logp);
    let out = actor_loss(
        &cfg.loss,
        &shard.norm,
        ActorInput {
            shape: rows.shape,
            logp: &logp,
            old_logp: old,
            advantages: &shard.advantages,
            mask: &rows.mask,
            entropy: Some(&ent),
            ref_logp: shard.ref_logp.as_deref(),
            is_weights: None,
        },
    )?;
    let stray = (0..n)
        .filter(|&r| skip[r])
        .flat_map(|r| r * cols..(r + 1) * cols)
        .any(|i| out.grad[i] != 0.0 || out.grad_entropy[i] != 0.0);
    if stray {
        return Err(crate::Error::Batch(
            "a row with zero advantages got a gradient from the policy loss: it cannot be left out of the backward".into(),
        ));
    }
    engine.backward(
        &trained.scatter(&out.grad),
        &trained.scatter(&out.grad_entropy),
    )?;
    Ok(Outcome {
        metrics: out.metrics,
        tokens: rows.response_tokens(),
        positions,
    })
}

/// The SFT loss's name in an [`Outcome`].
pub(crate) const SFT_LOSS: &str = "sft/loss";

fn sft_gradient(
    engine: &mut dyn TrainEngine,
    examples: &[(Vec<u32>, Vec<u32>)],
    tokens: usize,
) -> Result<Outcome> {
    // Each example a row, its answer the response, packed as an RL batch is: examples with the
    // same prompt share it, and only the answers' scores are computed in the last layer.
    let mut prompts = std::collections::HashMap::new();
    let rows = TokenRows::new(examples.iter().map(|(p, a)| {
        let next = prompts.len() as u64;
        Row {
            prompt: p,
            response: a,
            group: *prompts.entry(p.as_slice()).or_insert(next),
            observed: &[],
        }
    }));
    let Some(c) = rows.chunks(rows.shape.rows).next() else {
        return Ok(Outcome::default());
    };
    let per_token: Vec<f32> = rows.mask.iter().map(|m| -m / tokens as f32).collect();
    let d_logp = c.scatter(&per_token);
    let zeros = vec![0.0; c.batch.len()];
    let scores = engine.forward_backward(&c.batch, 1.0, &d_logp, &zeros)?;
    let loss: f64 = d_logp
        .iter()
        .zip(&scores.logp)
        .map(|(g, l)| (g * l) as f64)
        .sum();
    Ok(Outcome {
        metrics: [(SFT_LOSS.to_string(), loss)].into(),
        tokens: rows.response_tokens(),
        positions: c.batch.tokens(),
    })
}

/// Metrics that are sums over tokens weighted by the whole mini-batch's normalisers: the
/// shares' values add up.
const SUMMED: &[&str] = &[
    "actor/pg_loss",
    "actor/entropy",
    "actor/kl_loss",
    "critic/vf_loss",
    SFT_LOSS,
];

/// Metrics that are means over a share's tokens: weighted by its tokens.
const TOKEN_MEANS: &[&str] = &[
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "critic/vf_clipfrac",
];

/// The mini-batch's metrics from its shares' (any other metric, a coefficient, is the same on
/// every share). One share's are returned as they are.
pub fn merge(outcomes: &[Outcome]) -> Metrics {
    if let [one] = outcomes {
        return one.metrics.clone();
    }
    let tokens: f64 = outcomes.iter().map(|o| o.tokens).sum();
    let mut m = Metrics::new();
    for o in outcomes {
        for (k, &v) in &o.metrics {
            let add = if SUMMED.contains(&k.as_str()) {
                v
            } else if TOKEN_MEANS.contains(&k.as_str()) {
                if tokens > 0.0 {
                    v * o.tokens / tokens
                } else {
                    0.0
                }
            } else {
                m.entry(k.clone()).or_insert(v);
                continue;
            };
            *m.entry(k.clone()).or_insert(0.0) += add;
        }
    }
    m
}

/// The mini-batches of `per` rows of `rows` (the last one may be shorter), each as its first
/// row, one past its last, and the normalisers of the whole of it (what every share of it uses).
pub fn mini_batches(
    rows: &TokenRows,
    per: usize,
    agg: LossAgg,
) -> impl Iterator<Item = Result<(usize, usize, AggNorm)>> + '_ {
    let per = per.max(1);
    (0..rows.shape.rows).step_by(per).map(move |r0| {
        let r1 = (r0 + per).min(rows.shape.rows);
        let shape = Shape {
            rows: r1 - r0,
            cols: rows.shape.cols,
        };
        Ok((
            r0,
            r1,
            AggNorm::new(agg, shape, rows.slice(&rows.mask, r0, r1))?,
        ))
    })
}

/// Rows `r0..r1` cut into `n` consecutive shares, as even as they can be (the first ones one
/// row longer).
pub fn split(r0: usize, r1: usize, n: usize) -> Vec<(usize, usize)> {
    let n = n.max(1);
    let (len, extra) = ((r1 - r0) / n, (r1 - r0) % n);
    let mut at = r0;
    (0..n)
        .map(|i| {
            let end = at + len + usize::from(i < extra);
            let s = (at, end);
            at = end;
            s
        })
        .collect()
}

/// One engine in this process with its optimiser: one rank.
pub struct OneEngine<'a> {
    /// The engine.
    pub engine: &'a mut dyn TrainEngine,
    /// Its optimiser.
    pub opt: &'a mut Optimizer,
}

impl Ranks for OneEngine<'_> {
    type Error = crate::Error;

    fn count(&self) -> usize {
        1
    }

    fn gradients(&mut self, work: Vec<Work>) -> Result<Vec<Outcome>> {
        work.iter().map(|w| gradient(self.engine, w)).collect()
    }

    fn step(&mut self) -> Result<StepReport> {
        self.engine.step(self.opt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::policy::{PolicyBatch, update, update_ranks};
    use crate::engine::{Backend, open};
    use crate::optim::LrSchedule;
    use crate::rl::agg::LossAgg;
    use crate::rl::kl::Kl;
    use crate::rl::loss::PolicyLossConfig;
    use crate::{Model, ModelConfig};

    /// Ranks as several engines in this process, their gradients summed in rank order.
    struct InProcess {
        engines: Vec<Box<dyn TrainEngine>>,
        opts: Vec<Optimizer>,
    }

    impl Ranks for InProcess {
        type Error = crate::Error;
        fn count(&self) -> usize {
            self.engines.len()
        }
        fn gradients(&mut self, work: Vec<Work>) -> Result<Vec<Outcome>> {
            (self.engines.iter_mut().zip(&work))
                .map(|(e, w)| gradient(&mut **e, w))
                .collect()
        }
        fn step(&mut self) -> Result<StepReport> {
            let mut sum = crate::wire::flatten(self.engines[0].gradients_mut()?);
            for e in &mut self.engines[1..] {
                let g = crate::wire::flatten(e.gradients_mut()?);
                sum.iter_mut().zip(g).for_each(|(s, g)| *s += g);
            }
            let mut reports = Vec::new();
            for (e, o) in self.engines.iter_mut().zip(&mut self.opts) {
                crate::wire::unflatten_into(e.gradients_mut()?, &sum)?;
                reports.push(e.step(o)?);
            }
            assert!(reports.windows(2).all(|w| w[0] == w[1]), "{reports:?}");
            Ok(reports[0])
        }
    }

    fn model() -> Model {
        let cfg = serde_json::json!({"model_type": "qwen2", "vocab_size": 40, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 32});
        Model::init(
            ModelConfig::from_json(cfg, std::path::Path::new("t")).unwrap(),
            5,
        )
    }

    /// One token-mean PPO epoch at temperature 0.9 with an entropy bonus of `entropy_coeff`.
    fn token_mean(entropy_coeff: f64, rows_per_update: usize) -> PolicyUpdate {
        PolicyUpdate {
            loss: PolicyLossConfig {
                entropy_coeff,
                ..Default::default()
            },
            agg: LossAgg::TokenMean,
            temperature: 0.9,
            epochs: 1,
            rows_per_update,
        }
    }

    /// The mean absolute difference between two sets of weights.
    fn mean_diff(a: &Params, b: &Params) -> f32 {
        let (a, b) = (crate::wire::flatten(a), crate::wire::flatten(b));
        let sum: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from((x - y).abs()))
            .sum();
        (sum / a.len().max(1) as f64) as f32
    }

    /// The largest difference between two sets of weights.
    fn max_diff(a: &Params, b: &Params) -> f32 {
        (crate::wire::flatten(a).iter().zip(crate::wire::flatten(b)))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    }

    /// Six rows in three groups of two; group 0 (rows 0 and 1) got one reward, so its
    /// advantages are zero, and the others' are not.
    fn one_group_untrained() -> (TokenRows, Vec<f32>) {
        let rows = TokenRows::new((0..6).map(|i| Row {
            prompt: [&[1u32, 2, 3][..], &[4, 5], &[6, 7, 8, 9]][i % 3],
            response: [&[11u32, 12][..], &[13, 14, 15], &[16, 17, 18, 19]][i / 2],
            group: (i / 2) as u64,
            observed: &[],
        }));
        let adv = (0..rows.shape.len())
            .map(|i| match i / rows.shape.cols {
                0 | 1 => 0.0,
                r => (r as f32 - 3.5) * (1.0 + (i % 3) as f32 * 0.2),
            })
            .collect();
        (rows, adv)
    }

    /// Rows whose advantages are all zero (a GRPO group with one reward) are scored, not
    /// trained: the update's metrics and weights equal a forward and backward over every row,
    /// computed here by hand; with an entropy bonus every row is trained (the same again).
    #[test]
    fn rows_with_zero_advantages_are_scored_not_trained() {
        let (rows, adv) = one_group_untrained();
        for entropy_coeff in [0.0, 0.01] {
            let cfg = token_mean(entropy_coeff, 6);
            let batch = PolicyBatch {
                rows: &rows,
                advantages: &adv,
                old_logp: None,
                ref_logp: None,
                entropy: None,
            };
            let m = model();
            let opt = Optimizer::new(
                &m.params,
                Default::default(),
                LrSchedule::constant(1e-2),
                Some(1.0),
            );
            let (mut e, mut o) = (open(m.clone(), Backend::Native).unwrap(), opt.clone());
            let got = update(&mut *e, &mut o, batch, &cfg).unwrap();
            // By hand: every row forward and backward.
            let (mut r, mut ro) = (open(m, Backend::Native).unwrap(), opt);
            let (_, _, norm) = mini_batches(&rows, 6, cfg.agg).next().unwrap().unwrap();
            let c = rows.chunks(6).next().unwrap();
            let sc = r.forward(&c.batch, cfg.temperature).unwrap();
            let logp = c.gather(&sc.logp);
            let out = actor_loss(
                &cfg.loss,
                &norm,
                ActorInput {
                    shape: rows.shape,
                    logp: &logp,
                    old_logp: &logp,
                    advantages: &adv,
                    mask: &rows.mask,
                    entropy: Some(&c.gather(&sc.entropy)),
                    ref_logp: None,
                    is_weights: None,
                },
            )
            .unwrap();
            r.backward(&c.scatter(&out.grad), &c.scatter(&out.grad_entropy))
                .unwrap();
            r.step(&mut ro).unwrap();
            for (k, v) in &out.metrics {
                assert!(
                    (got[k] - v).abs() <= 1e-6 * v.abs().max(1.0),
                    "entropy {entropy_coeff}: {k} {} vs {v}",
                    got[k]
                );
            }
            let worst = max_diff(&e.model().unwrap().params, &r.model().unwrap().params);
            assert!(
                worst <= 1e-5,
                "entropy {entropy_coeff}: weights differ by {worst}"
            );
        }
    }

    /// A group's prompt is run once for all its responses (they attend to one copy of it):
    /// the gradient, the metrics and the behaviour log-probs equal those of running every row
    /// on its own, to the rounding of a different summation order, on fewer positions.
    #[test]
    fn a_groups_shared_prompt_changes_the_positions_not_the_gradient() {
        let prompts = [&[1u32, 2, 3, 4, 5, 6][..], &[7, 8, 9, 10]];
        let responses = [&[11u32, 12, 13][..], &[14, 15], &[16], &[17, 18, 19, 20]];
        // Each group's last response is an episode: its tokens 1..3 are an environment's.
        let observed = [std::ops::Range { start: 1, end: 3 }];
        let rows = |grouped: bool| {
            TokenRows::new((0..8).map(|i| Row {
                prompt: prompts[i / 4],
                response: responses[i % 4],
                group: if grouped {
                    (i / 4) as u64
                } else {
                    10 + i as u64
                },
                observed: if i % 4 == 3 { &observed[..] } else { &[] },
            }))
        };
        let (shared, alone) = (rows(true), rows(false));
        let cols = shared.shape.cols;
        let adv: Vec<f32> = (0..shared.shape.len())
            .map(|i| ((i / cols) as f32 - 3.5) * 0.3)
            .collect();
        let (_, _, norm) = mini_batches(&shared, 8, LossAgg::TokenMean)
            .next()
            .unwrap()
            .unwrap();
        let m = model();
        let run = |rows: &TokenRows, entropy_coeff: f64| {
            let mut e = open(m.clone(), Backend::Native).unwrap();
            let cfg = token_mean(entropy_coeff, 8);
            let work = Work::Policy {
                shard: Box::new(PolicyShard {
                    rows: rows.clone(),
                    advantages: adv.clone(),
                    old_logp: None,
                    ref_logp: None,
                    entropy: None,
                    norm,
                }),
                cfg,
            };
            let out = gradient(&mut *e, &work).unwrap();
            (out, crate::wire::flatten(e.gradients_mut().unwrap()))
        };
        for entropy_coeff in [0.0, 0.01] {
            let ((s, gs), (a, ga)) = (run(&shared, entropy_coeff), run(&alone, entropy_coeff));
            // Each group's prompt but its last token (5 and 3 positions) is run once, not 4
            // times.
            assert_eq!(a.positions - s.positions, 3 * (5 + 3));
            let scale = ga.iter().fold(0.0f32, |m, g| m.max(g.abs()));
            let worst = gs
                .iter()
                .zip(&ga)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(
                scale > 1e-3 && worst <= 1e-5 * scale,
                "gradients differ by {worst} (largest {scale})"
            );
            for (k, v) in &a.metrics {
                assert!(
                    (s.metrics[k] - v).abs() <= 1e-5 * v.abs().max(1.0),
                    "{k}: {} vs {v}",
                    s.metrics[k]
                );
            }
        }
        let e = open(m, Backend::Native).unwrap();
        let logp = |rows: &TokenRows| {
            rows.per_response_token(8, |b| Ok(e.score(b, 0.9)?.logp))
                .unwrap()
        };
        let (ls, la) = (logp(&shared), logp(&alone));
        assert!(
            ls.iter().zip(&la).all(|(x, y)| (x - y).abs() <= 1e-5),
            "{ls:?}\n{la:?}"
        );
    }

    /// On policy, an untrained row's entropies come from the engine that sampled it when it
    /// reported them, and the row is not run at all: the gradient and every other metric are
    /// those of scoring it, `actor/entropy` moves by exactly what the engine's values differ
    /// by; with behaviour log-probs (ratios not 1) the row is scored as before.
    #[test]
    fn an_engines_entropies_spare_untrained_rows_their_forward() {
        let (rows, adv) = one_group_untrained();
        let cols = rows.shape.cols;
        let cfg = token_mean(0.0, 6);
        let (_, _, norm) = mini_batches(&rows, 6, cfg.agg).next().unwrap().unwrap();
        let m = model();
        let c = rows.chunks(6).next().unwrap();
        let whole = open(m.clone(), Backend::Native)
            .unwrap()
            .score(&c.batch, cfg.temperature)
            .unwrap();
        // What the engine reported: the learner's own values, 0.25 higher on the untrained rows
        // (so that reading them shows).
        let shift = 0.25f32;
        let mut reported = c.gather(&whole.entropy);
        reported[..2 * cols].iter_mut().for_each(|v| *v += shift);
        let old = c.gather(&whole.logp);
        let run = |entropy: Option<Vec<f32>>, old_logp: Option<Vec<f32>>| {
            let mut e = open(m.clone(), Backend::Native).unwrap();
            let work = Work::Policy {
                shard: Box::new(PolicyShard {
                    rows: rows.clone(),
                    advantages: adv.clone(),
                    old_logp,
                    ref_logp: None,
                    entropy,
                    norm,
                }),
                cfg,
            };
            let out = gradient(&mut *e, &work).unwrap();
            (out, crate::wire::flatten(e.gradients_mut().unwrap()))
        };
        let (scored, g_scored) = run(None, None);
        let (spared, g_spared) = run(Some(reported.clone()), None);
        let trained = rows.select(|r| r >= 2).batch.tokens();
        assert_eq!(spared.positions, trained, "the untrained rows were run");
        assert!(scored.positions > trained);
        assert_eq!(g_spared, g_scored, "the same gradient");
        let idle_tokens = rows.mask[..2 * cols].iter().sum::<f32>() as f64;
        for (k, v) in &scored.metrics {
            let want = match k.as_str() {
                "actor/entropy" => v + f64::from(shift) * idle_tokens / rows.response_tokens(),
                _ => *v,
            };
            assert!(
                (spared.metrics[k] - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{k}: {} vs {want}",
                spared.metrics[k]
            );
        }
        // Behaviour log-probs: the untrained rows' ratios are not 1 in general, so they are
        // scored and the engine's entropies are not read.
        let (with_old, _) = run(Some(reported), Some(old.clone()));
        let (want, _) = run(None, Some(old));
        assert_eq!(with_old.positions, want.positions);
        assert_eq!(with_old.metrics, want.metrics);
        // Entropies that do not fit the rows are refused, naming the counts.
        let short = Work::Policy {
            shard: Box::new(PolicyShard {
                rows: rows.clone(),
                advantages: adv.clone(),
                old_logp: None,
                ref_logp: None,
                entropy: Some(vec![0.0; 3]),
                norm,
            }),
            cfg,
        };
        let err = gradient(&mut *open(m.clone(), Backend::Native).unwrap(), &short).unwrap_err();
        assert!(
            err.to_string().contains("3 engine entropies for 6 rows"),
            "{err}"
        );
    }

    /// Data parallelism changes where the arithmetic runs, not what it computes: every loss and
    /// aggregation on 2 and 3 ranks gives the metrics and weights of one engine (to the
    /// rounding of a different summation order).
    #[test]
    fn ranks_train_as_one_engine_does() {
        let prompts: [&[u32]; 5] = [&[1, 2, 3], &[4, 5], &[6, 7, 8, 9], &[10], &[3, 3]];
        let responses: [&[u32]; 5] = [&[11, 12], &[13, 14, 15], &[16], &[17, 18, 19, 20], &[]];
        // Row 3 is an episode: its tokens 1..3 are an environment's, masked on every rank.
        let observed = [std::ops::Range { start: 1, end: 3 }];
        let rows = TokenRows::new((0..5).map(|i| Row {
            prompt: prompts[i],
            response: responses[i],
            group: (i / 2) as u64,
            observed: if i == 3 { &observed[..] } else { &[] },
        }));
        let adv: Vec<f32> = (0..rows.shape.len())
            .map(|i| ((i * 5 % 7) as f32 - 3.0) * 0.4)
            .collect();
        let old: Vec<f32> = (0..rows.shape.len())
            .map(|i| -2.0 - (i % 3) as f32 * 0.1)
            .collect();
        let reference: Vec<f32> = old.iter().map(|v| v - 0.05).collect();
        let kl = Some(("low_var_kl".parse::<Kl>().unwrap(), 0.1));
        for (agg, entropy_coeff, kl, rows_per_update, with_old) in [
            (LossAgg::TokenMean, 0.01, None, 2, false),
            (LossAgg::SeqMeanTokenMean, 0.0, kl, 3, true),
            (
                LossAgg::SeqMeanTokenSumNorm { scale: None },
                0.0,
                None,
                5,
                true,
            ),
            (LossAgg::TokenSum, 0.02, kl, 1, false),
        ] {
            let cfg = PolicyUpdate {
                loss: PolicyLossConfig {
                    entropy_coeff,
                    kl,
                    ..Default::default()
                },
                agg,
                temperature: 0.8,
                epochs: 2,
                rows_per_update,
            };
            let batch = PolicyBatch {
                rows: &rows,
                advantages: &adv,
                old_logp: with_old.then_some(&old[..]),
                ref_logp: kl.map(|_| &reference[..]),
                entropy: None,
            };
            let m = model();
            let opt = Optimizer::new(
                &m.params,
                Default::default(),
                LrSchedule::constant(1e-2),
                Some(1.0),
            );
            let mut one = open(m.clone(), Backend::Native).unwrap();
            let mut one_opt = opt.clone();
            let want = update(&mut *one, &mut one_opt, batch, &cfg).unwrap();
            let sft = [
                (vec![1u32, 2], vec![3u32, 4]),
                (vec![5], vec![6, 7, 8]),
                (vec![9], vec![1]),
            ];
            let want_sft = crate::algo::sft::step(&mut *one, &mut one_opt, &sft).unwrap();
            for n in [2, 3] {
                let mut ranks = InProcess {
                    engines: (0..n)
                        .map(|_| open(m.clone(), Backend::Native).unwrap())
                        .collect(),
                    opts: vec![opt.clone(); n],
                };
                let got = update_ranks(&mut ranks, batch, &cfg).unwrap();
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    want.keys().collect::<Vec<_>>()
                );
                for (k, v) in &want {
                    assert!(
                        close(got[k], *v),
                        "{agg:?} on {n} ranks: {k} {} vs {v}",
                        got[k]
                    );
                }
                let got_sft = crate::algo::sft::step_ranks(&mut ranks, &sft).unwrap();
                assert!(
                    close(got_sft.loss, want_sft.loss),
                    "{} vs {}",
                    got_sft.loss,
                    want_sft.loss
                );
                // Adam divides by √v: on weights whose gradient is near zero a rounding
                // difference moves them by a part of a step (lr 1e-2): 1.9e-4 at
                // worst on an AVX-512 Xeon, whose GEMM tiles sum in another order than AVX2's.
                // A tenth of a step bounds each weight, and the mean difference stays at
                // rounding level (a rank's rows lost or counted twice moves most weights).
                for e in &mut ranks.engines {
                    let (got, want) = (&e.model().unwrap().params, &one.model().unwrap().params);
                    let worst = max_diff(got, want);
                    assert!(
                        worst <= 1e-3,
                        "{agg:?} on {n} ranks: weights differ by {worst}"
                    );
                    let mean = mean_diff(got, want);
                    assert!(
                        mean <= 1e-5,
                        "{agg:?} on {n} ranks: weights differ by {mean} on average"
                    );
                }
            }
        }
    }

    #[test]
    fn shares_are_consecutive_and_even() {
        for (r0, r1, n, want) in [
            (0, 4, 2, vec![(0, 2), (2, 4)]),
            (3, 8, 2, vec![(3, 6), (6, 8)]),
            (0, 1, 3, vec![(0, 1), (1, 1), (1, 1)]),
            (2, 9, 1, vec![(2, 9)]),
        ] {
            assert_eq!(split(r0, r1, n), want, "{r0}..{r1} over {n}");
        }
    }

    #[test]
    fn shares_metrics_add_up_by_kind() {
        let out = |pg: f64, clip: f64, tokens: f64| Outcome {
            metrics: [
                ("actor/pg_loss".to_string(), pg),
                ("actor/pg_clipfrac".into(), clip),
                ("actor/kl_coef".into(), 0.1),
            ]
            .into(),
            tokens,
            positions: 0,
        };
        let m = merge(&[out(1.0, 0.5, 2.0), out(2.0, 0.0, 6.0), Outcome::default()]);
        assert_eq!(m["actor/pg_loss"], 3.0);
        assert_eq!(m["actor/pg_clipfrac"], 0.125);
        assert_eq!(m["actor/kl_coef"], 0.1);
    }
}
