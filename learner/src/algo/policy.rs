//! The policy update: `epochs` passes over a batch of rows, one optimiser step per mini-batch
//! of `rows_per_update` rows, each step the gradient of the actor loss (PPO-clip and its
//! variants, entropy bonus, KL to a reference) aggregated over its mini-batch.

pub use super::PolicyUpdate;
use super::TokenRows;
use super::dp::{OneEngine, PolicyShard, Ranks, Work, merge, mini_batches, split};
use crate::engine::TrainEngine;
use crate::error::Result;
use crate::optim::{Optimizer, StepReport};
use crate::rl::Metrics;

/// What one update trains on, all `[rows, cols]` over `rows`.
#[derive(Clone, Copy, Debug)]
pub struct PolicyBatch<'a> {
    /// The prompts and responses.
    pub rows: &'a TokenRows,
    /// Per-token advantages.
    pub advantages: &'a [f32],
    /// The behaviour policy's log-probs (`None`: one update per batch, so the current ones).
    pub old_logp: Option<&'a [f32]>,
    /// The reference policy's log-probs (the KL loss).
    pub ref_logp: Option<&'a [f32]>,
    /// The rollout engine's entropy of each token's sampling distribution, at the update's
    /// temperature (`None`: not reported). On policy, a row the update does not train (its
    /// advantages all zero) then needs no forward: its ratio is 1 and its `actor/entropy` is
    /// this (which differs from the learner's by the engines' rounding gap, as the log-probs do:
    /// `rollout/logprob_diff_mean`).
    pub entropy: Option<&'a [f32]>,
}

/// Runs the update on one engine; returns the loss metrics averaged over the optimiser steps,
/// and the last step's gradient norm and learning rate (`actor/grad_norm`, `actor/lr`).
pub fn update(
    engine: &mut dyn TrainEngine,
    opt: &mut Optimizer,
    batch: PolicyBatch<'_>,
    cfg: &PolicyUpdate,
) -> Result<Metrics> {
    update_ranks(&mut OneEngine { engine, opt }, batch, cfg)
}

/// Runs the update on data-parallel `ranks`: each mini-batch's rows cut into one share a rank
/// (its normalisers computed over the whole mini-batch), one optimiser step for the sum.
/// Returns what [`update`] does.
pub fn update_ranks<R: Ranks>(
    ranks: &mut R,
    batch: PolicyBatch<'_>,
    cfg: &PolicyUpdate,
) -> Result<Metrics, R::Error> {
    let rows = batch.rows;
    let mut losses: Vec<Metrics> = Vec::new();
    let mut report: Option<StepReport> = None;
    for _epoch in 0..cfg.epochs {
        for mini_batch in mini_batches(rows, cfg.rows_per_update, cfg.agg) {
            let (r0, r1, norm) = mini_batch?;
            let work = split(r0, r1, ranks.count())
                .into_iter()
                .map(|(a, b)| Work::Policy {
                    shard: Box::new(PolicyShard {
                        rows: rows.rows(a, b),
                        advantages: rows.slice(batch.advantages, a, b).to_vec(),
                        old_logp: batch.old_logp.map(|o| rows.slice(o, a, b).to_vec()),
                        ref_logp: batch.ref_logp.map(|r| rows.slice(r, a, b).to_vec()),
                        entropy: batch.entropy.map(|e| rows.slice(e, a, b).to_vec()),
                        norm,
                    }),
                    cfg: *cfg,
                })
                .collect();
            let outcomes = ranks.gradients(work)?;
            report = Some(ranks.step()?);
            losses.push(merge(&outcomes));
        }
    }
    let mut m = Metrics::new();
    for l in &losses {
        for (k, v) in l {
            *m.entry(k.clone()).or_insert(0.0) += v / losses.len() as f64;
        }
    }
    if let Some(r) = report {
        m.insert("actor/grad_norm".into(), r.grad_norm);
        m.insert("actor/lr".into(), r.lr as f64);
    }
    Ok(m)
}

/// Optimiser calls one update makes: one per mini-batch per epoch (what a learning-rate
/// schedule over a stage counts).
pub fn optimizer_calls(rows: usize, cfg: &PolicyUpdate) -> u64 {
    (cfg.epochs * rows.div_ceil(cfg.rows_per_update.max(1)).max(1)) as u64
}
