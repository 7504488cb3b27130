//! The critic update (PPO's value model): `epochs` passes, one optimiser step per mini-batch,
//! each the gradient of the clipped value loss.

use super::TokenRows;
use super::dp::{Ranks, ValueShard, Work, merge, mini_batches, split};
use crate::critic::Critic;
use crate::error::Result;
use crate::optim::Optimizer;
use crate::params::Params;
use crate::rl::Metrics;
use crate::rl::agg::{AggNorm, LossAgg};
use crate::rl::loss::{CriticInput, value_loss};

/// A critic with its optimiser and gradient buffers.
pub struct CriticTrainer {
    /// The value model.
    pub critic: Critic,
    /// Its optimiser.
    pub opt: Optimizer,
    grads: Params,
}

/// How the critic is updated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValueUpdate {
    /// VeRL's `cliprange_value`.
    pub cliprange_value: f64,
    /// How token losses add up over a mini-batch.
    pub agg: LossAgg,
    /// Passes over the batch.
    pub epochs: usize,
    /// Rows per optimiser step.
    pub rows_per_update: usize,
}

/// The critic update on data-parallel `ranks` (critic ranks): each mini-batch's rows cut into
/// one share a rank with the whole mini-batch's normalisers, one optimiser step for the sum.
/// Returns what [`CriticTrainer::update`] does.
pub fn update_ranks<R: Ranks>(
    ranks: &mut R,
    rows: &TokenRows,
    old_values: &[f32],
    returns: &[f32],
    cfg: &ValueUpdate,
) -> Result<Metrics, R::Error> {
    let mut sums = Metrics::new();
    let mut n = 0.0;
    for _ in 0..cfg.epochs {
        for mini_batch in mini_batches(rows, cfg.rows_per_update, cfg.agg) {
            let (r0, r1, norm) = mini_batch?;
            let work = split(r0, r1, ranks.count())
                .into_iter()
                .map(|(a, b)| Work::Value {
                    shard: Box::new(ValueShard {
                        rows: rows.rows(a, b),
                        old_values: rows.slice(old_values, a, b).to_vec(),
                        returns: rows.slice(returns, a, b).to_vec(),
                        norm,
                    }),
                    cliprange: cfg.cliprange_value,
                })
                .collect();
            let outcomes = ranks.gradients(work)?;
            let rep = ranks.step()?;
            for (k, v) in merge(&outcomes) {
                *sums.entry(k).or_insert(0.0) += v;
            }
            *sums.entry("critic/grad_norm".into()).or_insert(0.0) += rep.grad_norm;
            n += 1.0;
        }
    }
    Ok(sums.into_iter().map(|(k, v)| (k, v / n)).collect())
}

impl CriticTrainer {
    /// Trains `critic` with `opt`.
    pub fn new(critic: Critic, opt: Optimizer) -> Self {
        Self {
            grads: critic.zeros_grads(),
            critic,
            opt,
        }
    }

    /// The value of every response token, `per` rows a batch.
    pub fn values(&self, rows: &TokenRows, per: usize) -> Result<Vec<f32>> {
        rows.per_response_token(per, |b| self.critic.values(b))
    }

    /// Runs the update towards `returns` from the values the batch was generated with;
    /// returns the loss metrics and `critic/grad_norm`, averaged over the optimiser steps.
    pub fn update(
        &mut self,
        rows: &TokenRows,
        old_values: &[f32],
        returns: &[f32],
        cfg: &ValueUpdate,
    ) -> Result<Metrics> {
        let mut sums = Metrics::new();
        let mut n = 0.0;
        for _ in 0..cfg.epochs {
            for c in rows.chunks(cfg.rows_per_update) {
                let (v, tape) = self.critic.forward(&c.batch)?;
                let values = c.gather(&v);
                let mask = rows.slice(&rows.mask, c.r0, c.r1);
                let norm = AggNorm::new(cfg.agg, c.shape(), mask)?;
                let out = value_loss(
                    &norm,
                    cfg.cliprange_value,
                    CriticInput {
                        shape: c.shape(),
                        values: &values,
                        old_values: rows.slice(old_values, c.r0, c.r1),
                        returns: rows.slice(returns, c.r0, c.r1),
                        mask,
                    },
                )?;
                self.critic
                    .backward(tape, &c.scatter(&out.grad), &mut self.grads);
                let rep = self.critic.step(&mut self.opt, &mut self.grads);
                self.grads.fill_zero();
                for (k, v) in out.metrics {
                    *sums.entry(k).or_insert(0.0) += v;
                }
                *sums.entry("critic/grad_norm".into()).or_insert(0.0) += rep.grad_norm;
                n += 1.0;
            }
        }
        Ok(sums.into_iter().map(|(k, v)| (k, v / n)).collect())
    }
}
