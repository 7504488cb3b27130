//! RL formulas with VeRL's semantics: advantage estimators, policy losses, KL estimators and
//! controllers, the value loss, loss aggregation, DAPO's shaping and filtering, and
//! rollout/training mismatch weights.
//!
//! Everything works on `[rows, cols]` row-major slices (`rows` responses, `cols` response
//! tokens) with a 0/1 mask, computes in f64, and every loss returns its value, its metrics under
//! VeRL's names and its gradient with respect to each token's log-prob (and entropy, value):
//! what the model's backward consumes.
//!
//! Never: touches the model or tensors beyond these slices.

pub mod advantage;
pub mod agg;
pub mod dapo;
pub mod kl;
pub mod loss;

use std::collections::BTreeMap;

/// Errors in RL configuration or inputs: unknown names list the valid ones.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RlError {
    /// A name (estimator, loss, aggregation, KL type) that does not exist.
    #[error("unknown {what} `{name}`; valid: {valid}")]
    UnknownName {
        /// What kind of name.
        what: &'static str,
        /// The name given.
        name: String,
        /// The valid names, comma-separated.
        valid: String,
    },
    /// A parameter outside its domain.
    #[error("invalid {param} = {value}: {why}")]
    InvalidParam {
        /// The parameter's config name.
        param: &'static str,
        /// The value given.
        value: String,
        /// The constraint.
        why: &'static str,
    },
    /// Inputs that do not fit together or cannot be used.
    #[error("{0}")]
    Input(String),
}

/// Result with [`RlError`].
pub type Result<T> = std::result::Result<T, RlError>;

/// Metrics by VeRL name.
pub type Metrics = BTreeMap<String, f64>;

/// The shape of per-token arrays: `rows` responses × `cols` tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    /// Responses.
    pub rows: usize,
    /// Response tokens per row (padded).
    pub cols: usize,
}

impl Shape {
    /// Total entries.
    pub fn len(self) -> usize {
        self.rows * self.cols
    }
    /// Whether there are no entries.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }
    pub(crate) fn check(self, what: &str, v: &[f32]) -> Result<()> {
        if v.len() != self.len() {
            return Err(RlError::Input(format!(
                "`{what}` has {} entries, rows × cols is {}",
                v.len(),
                self.len()
            )));
        }
        Ok(())
    }
}

/// `Σ x·m / (Σ m + 1e-8)`.
pub fn masked_mean(x: &[f64], m: &[f32]) -> f64 {
    let (s, n) = x.iter().zip(m).fold((0.0, 0.0), |(s, n), (x, &m)| {
        (s + x * m as f64, n + m as f64)
    });
    s / (n + 1e-8)
}

/// Unbiased masked variance; needs more than one unmasked entry.
pub fn masked_var(x: &[f64], m: &[f32]) -> Result<f64> {
    let n: f64 = m.iter().map(|&v| v as f64).sum();
    if n <= 1.0 {
        return Err(RlError::Input(format!(
            "masked variance needs at least 2 unmasked values, got {n}"
        )));
    }
    let mu = masked_mean(x, m);
    let sq: Vec<f64> = x.iter().map(|v| (v - mu) * (v - mu)).collect();
    Ok(masked_mean(&sq, m) * n / (n - 1.0))
}

/// `(x − μ) / sqrt(var + 1e-8)` over the whole batch.
pub fn masked_whiten(x: &[f64], m: &[f32]) -> Result<Vec<f64>> {
    let mu = masked_mean(x, m);
    let var = masked_var(x, m)?;
    let inv = 1.0 / (var + 1e-8).sqrt();
    Ok(x.iter().map(|v| (v - mu) * inv).collect())
}

pub(crate) fn names(list: &[&str]) -> String {
    list.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_whiten_reference_values() {
        let w = masked_whiten(&[1.0, 2.0, 3.0, 4.0], &[1.0; 4]).unwrap();
        for (a, b) in w.iter().zip([-1.161895, -0.387298, 0.387298, 1.161895]) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // masked entries neither count nor matter
        let w2 = masked_whiten(&[1.0, 99.0, 2.0, 3.0, 4.0], &[1.0, 0.0, 1.0, 1.0, 1.0]).unwrap();
        assert!((w2[0] - w[0]).abs() < 1e-12 && (w2[4] - w[3]).abs() < 1e-12);
        assert!(masked_var(&[1.0], &[1.0]).is_err());
    }
}
