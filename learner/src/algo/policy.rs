//! The policy update: `epochs` passes over a batch of rows, one optimiser step per mini-batch
//! of `rows_per_update` rows, each step the gradient of the actor loss (PPO-clip and its
//! variants, entropy bonus, KL to a reference) aggregated over its mini-batch.

use super::TokenRows;
use crate::engine::TrainEngine;
use crate::error::Result;
use crate::optim::{Optimizer, StepReport};
use crate::rl::Metrics;
use crate::rl::agg::{AggNorm, LossAgg};
use crate::rl::loss::{ActorInput, PolicyLossConfig, actor_loss};

/// How the policy is updated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyUpdate {
    /// The actor loss.
    pub loss: PolicyLossConfig,
    /// How token losses add up over a mini-batch.
    pub agg: LossAgg,
    /// The sampling temperature the log-probs are taken at.
    pub temperature: f32,
    /// Passes over the batch.
    pub epochs: usize,
    /// Rows per optimiser step.
    pub rows_per_update: usize,
}

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
}

/// Runs the update; returns the loss metrics averaged over the optimiser steps, and the last
/// step's gradient norm and learning rate (`actor/grad_norm`, `actor/lr`).
pub fn update(
    engine: &mut dyn TrainEngine,
    opt: &mut Optimizer,
    batch: PolicyBatch<'_>,
    cfg: &PolicyUpdate,
) -> Result<Metrics> {
    let rows = batch.rows;
    let mut losses: Vec<Metrics> = Vec::new();
    let mut report: Option<StepReport> = None;
    for _epoch in 0..cfg.epochs {
        for c in rows.chunks(cfg.rows_per_update) {
            let sc = engine.forward(&c.batch, cfg.temperature)?;
            let logp = c.gather(&sc.logp);
            let ent = c.gather(&sc.entropy);
            let mask = rows.slice(&rows.mask, c.r0, c.r1);
            let old = batch
                .old_logp
                .map_or(logp.clone(), |o| rows.slice(o, c.r0, c.r1).to_vec());
            let norm = AggNorm::new(cfg.agg, c.shape(), mask)?;
            let out = actor_loss(
                &cfg.loss,
                &norm,
                ActorInput {
                    shape: c.shape(),
                    logp: &logp,
                    old_logp: &old,
                    advantages: rows.slice(batch.advantages, c.r0, c.r1),
                    mask,
                    entropy: Some(&ent),
                    ref_logp: batch.ref_logp.map(|r| rows.slice(r, c.r0, c.r1)),
                    is_weights: None,
                },
            )?;
            engine.backward(&c.scatter(&out.grad), &c.scatter(&out.grad_entropy))?;
            report = Some(engine.step(opt)?);
            losses.push(out.metrics);
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
