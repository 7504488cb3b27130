//! Loss aggregation (`loss_agg_mode`). Every mode is linear in the per-token loss, so it is
//! expressed as per-token weights `w` with `loss = Σ w·L`; the weights' normalisers come from
//! the whole mini-batch ([`AggNorm`]), which makes micro-batch splitting exact.

use super::{Result, RlError, Shape, names};
use std::str::FromStr;

/// How per-token losses become one number.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum LossAgg {
    /// Σ L·m / Σ m over the mini-batch.
    TokenMean,
    /// Σ L·m.
    TokenSum,
    /// Mean over sequences with Σm > 0 of Σ_t L·m.
    SeqMeanTokenSum,
    /// Mean over sequences of Σ_t L·m / (Σ_t m + 1e-8).
    SeqMeanTokenMean,
    /// (Σ L·m) / S / B; S is `loss_scale_factor`, or the padded length when `None`.
    SeqMeanTokenSumNorm {
        /// `loss_scale_factor`.
        scale: Option<f64>,
    },
}

const AGG_NAMES: &[&str] = &[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
];

impl FromStr for LossAgg {
    type Err = RlError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "token-mean" => LossAgg::TokenMean,
            "token-sum" => LossAgg::TokenSum,
            "seq-mean-token-sum" => LossAgg::SeqMeanTokenSum,
            "seq-mean-token-mean" => LossAgg::SeqMeanTokenMean,
            "seq-mean-token-sum-norm" => LossAgg::SeqMeanTokenSumNorm { scale: None },
            _ => {
                return Err(RlError::UnknownName {
                    what: "loss_agg_mode",
                    name: s.into(),
                    valid: names(AGG_NAMES),
                });
            }
        })
    }
}

/// Normalisers of one mini-batch, computed once and shared by its micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AggNorm {
    /// The mode.
    pub mode: LossAgg,
    /// Σ m over the mini-batch.
    pub tokens: f64,
    /// Sequences in the mini-batch.
    pub seqs: f64,
    /// Sequences with at least one unmasked token.
    pub nonempty_seqs: f64,
    /// Padded length (S for seq-mean-token-sum-norm when no scale is set).
    pub cols: f64,
}

impl AggNorm {
    /// Normalisers of the mini-batch whose mask is `mask`.
    pub fn new(mode: LossAgg, shape: Shape, mask: &[f32]) -> Result<Self> {
        shape.check("mask", mask)?;
        if let LossAgg::SeqMeanTokenSumNorm { scale: Some(s) } = mode
            && !(s > 0.0)
        {
            return Err(RlError::InvalidParam {
                param: "loss_scale_factor",
                value: s.to_string(),
                why: "must be positive",
            });
        }
        let mut tokens = 0.0;
        let mut nonempty = 0.0;
        for r in 0..shape.rows {
            let n: f64 = mask[r * shape.cols..(r + 1) * shape.cols]
                .iter()
                .map(|&v| v as f64)
                .sum();
            tokens += n;
            if n > 0.0 {
                nonempty += 1.0;
            }
        }
        Ok(Self {
            mode,
            tokens,
            seqs: shape.rows as f64,
            nonempty_seqs: nonempty,
            cols: shape.cols as f64,
        })
    }

    /// Per-token weights for a micro-batch (`shape`, `mask`) of this mini-batch.
    pub fn weights(&self, shape: Shape, mask: &[f32]) -> Vec<f64> {
        let mut w = vec![0.0; shape.len()];
        for r in 0..shape.rows {
            let row = &mask[r * shape.cols..(r + 1) * shape.cols];
            let row_tokens: f64 = row.iter().map(|&v| v as f64).sum();
            let per = match self.mode {
                LossAgg::TokenMean => 1.0 / (self.tokens + 1e-8),
                LossAgg::TokenSum => 1.0,
                LossAgg::SeqMeanTokenSum => 1.0 / self.nonempty_seqs.max(1.0),
                LossAgg::SeqMeanTokenMean => 1.0 / ((row_tokens + 1e-8) * self.seqs.max(1.0)),
                LossAgg::SeqMeanTokenSumNorm { scale } => {
                    1.0 / (scale.unwrap_or(self.cols) * self.seqs.max(1.0))
                }
            };
            for (c, &m) in row.iter().enumerate() {
                w[r * shape.cols + c] = per * m as f64;
            }
        }
        w
    }
}

/// `Σ w·L`.
pub fn apply(w: &[f64], loss: &[f64]) -> f64 {
    w.iter().zip(loss).map(|(a, b)| a * b).sum()
}
