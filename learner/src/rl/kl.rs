//! KL estimators between the policy and a reference (`kl_loss_type`), with their gradients,
//! and the fixed and adaptive KL controllers for the in-reward penalty.

use super::{Result, RlError, names};
use std::str::FromStr;

/// A KL estimator of `d = logp − logp_ref`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KlType {
    /// k1 (`kl`): d.
    K1,
    /// `abs`: |d|.
    Abs,
    /// k2 (`mse`): ½d².
    K2,
    /// k3 (`low_var_kl`): clamp(eˣ − x − 1, −10, 10), x = clamp(−d, −20, 20).
    K3,
}

/// An estimator, optionally straight-through (`+`: its value, k2's gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Kl {
    /// The estimator whose value is used.
    pub kind: KlType,
    /// Straight-through: gradient of k2.
    pub straight_through: bool,
}

const KL_NAMES: &[&str] = &[
    "k1",
    "kl",
    "abs",
    "k2",
    "mse",
    "k3",
    "low_var_kl",
    "(any of these)+",
];

impl FromStr for Kl {
    type Err = RlError;
    fn from_str(s: &str) -> Result<Self> {
        let (base, st) = match s.strip_suffix('+') {
            Some(b) => (b, true),
            None => (s, false),
        };
        let kind = match base {
            "k1" | "kl" => KlType::K1,
            "abs" => KlType::Abs,
            "k2" | "mse" => KlType::K2,
            "k3" | "low_var_kl" => KlType::K3,
            _ => {
                return Err(RlError::UnknownName {
                    what: "kl_loss_type",
                    name: s.into(),
                    valid: names(KL_NAMES),
                });
            }
        };
        Ok(Kl {
            kind,
            straight_through: st,
        })
    }
}

impl Kl {
    /// Value and d/d(logp) for one token.
    pub fn eval(self, logp: f64, logp_ref: f64) -> (f64, f64) {
        let d = logp - logp_ref;
        let (v, g) = match self.kind {
            KlType::K1 => (d, 1.0),
            KlType::Abs => (
                d.abs(),
                if d > 0.0 {
                    1.0
                } else if d < 0.0 {
                    -1.0
                } else {
                    0.0
                },
            ),
            KlType::K2 => (0.5 * d * d, d),
            KlType::K3 => {
                let x = (-d).clamp(-20.0, 20.0);
                let raw = x.exp() - x - 1.0;
                let v = raw.clamp(-10.0, 10.0);
                let x_live = (-20.0..=20.0).contains(&-d);
                let v_live = (-10.0..=10.0).contains(&raw);
                (v, if x_live && v_live { 1.0 - x.exp() } else { 0.0 })
            }
        };
        if self.straight_through {
            (v, d)
        } else {
            (v, g)
        }
    }
}

/// How β for the in-reward KL penalty evolves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KlController {
    /// β stays at its value.
    Fixed {
        /// β.
        value: f64,
    },
    /// β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon).
    Adaptive {
        /// Current β.
        value: f64,
        /// Target KL.
        target: f64,
        /// Horizon in sequences.
        horizon: f64,
    },
}

impl KlController {
    /// VeRL's defaults: fixed β = 0.001; adaptive target 0.1, horizon 10000.
    pub fn new(kind: &str, coef: f64, target: f64, horizon: f64) -> Result<Self> {
        if coef < 0.0 {
            return Err(RlError::InvalidParam {
                param: "kl_coef",
                value: coef.to_string(),
                why: "must not be negative",
            });
        }
        match kind {
            "fixed" => Ok(Self::Fixed { value: coef }),
            "adaptive" => {
                if !(target > 0.0 && horizon > 0.0) {
                    return Err(RlError::InvalidParam {
                        param: "target_kl/horizon",
                        value: format!("{target}/{horizon}"),
                        why: "both must be positive",
                    });
                }
                Ok(Self::Adaptive {
                    value: coef,
                    target,
                    horizon,
                })
            }
            _ => Err(RlError::UnknownName {
                what: "kl_ctrl.type",
                name: kind.into(),
                valid: names(&["fixed", "adaptive"]),
            }),
        }
    }

    /// Current β.
    pub fn value(&self) -> f64 {
        match *self {
            Self::Fixed { value } | Self::Adaptive { value, .. } => value,
        }
    }

    /// Updates β from the batch's measured KL over `n` sequences.
    pub fn update(&mut self, current_kl: f64, n: usize) {
        if let Self::Adaptive {
            value,
            target,
            horizon,
        } = self
        {
            let e = (current_kl / *target - 1.0).clamp(-0.2, 0.2);
            *value *= 1.0 + e * n as f64 / *horizon;
        }
    }
}

/// Applies the in-reward penalty `r −= β·kl(old, ref)·m` to `token_rewards` and returns the
/// batch's KL (mean over sequences of each sequence's masked mean), VeRL's
/// `actor/reward_kl_penalty`.
pub fn apply_kl_penalty(
    shape: super::Shape,
    token_rewards: &mut [f32],
    old_logp: &[f32],
    ref_logp: &[f32],
    mask: &[f32],
    kl: Kl,
    beta: f64,
) -> Result<f64> {
    for (n, v) in [
        ("token_rewards", &*token_rewards),
        ("old_logp", old_logp),
        ("ref_logp", ref_logp),
        ("mask", mask),
    ] {
        shape.check(n, v)?;
    }
    let mut total = 0.0;
    for r in 0..shape.rows {
        let row = r * shape.cols..(r + 1) * shape.cols;
        let kls: Vec<f64> = row
            .clone()
            .map(|i| kl.eval(old_logp[i] as f64, ref_logp[i] as f64).0 * mask[i] as f64)
            .collect();
        for (j, i) in row.clone().enumerate() {
            token_rewards[i] -= (beta * kls[j]) as f32;
        }
        total += super::masked_mean(&kls, &mask[row]);
    }
    Ok(total / shape.rows.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_values() {
        let k3: Kl = "low_var_kl".parse().unwrap();
        assert!((k3.eval(-1.0, -1.5).0 - 0.1065307).abs() < 1e-7);
        // by hand: d = 0.5 → k1 0.5, abs 0.5, k2 0.125; k3 = e^-0.5 + 0.5 - 1
        assert_eq!("k1".parse::<Kl>().unwrap().eval(-1.0, -1.5), (0.5, 1.0));
        assert_eq!("abs".parse::<Kl>().unwrap().eval(-1.5, -1.0), (0.5, -1.0));
        assert_eq!("mse".parse::<Kl>().unwrap().eval(-1.0, -1.5), (0.125, 0.5));
        let st: Kl = "k3+".parse().unwrap();
        assert_eq!(st.eval(-1.0, -1.5), (k3.eval(-1.0, -1.5).0, 0.5));
        let e = "k4".parse::<Kl>().unwrap_err().to_string();
        assert!(
            e.contains("unknown kl_loss_type `k4`") && e.contains("low_var_kl"),
            "{e}"
        );
    }

    #[test]
    fn gradients_match_finite_differences() {
        for name in ["k1", "abs", "k2", "k3"] {
            let kl: Kl = name.parse().unwrap();
            for (lp, rf) in [(-1.0, -1.5), (-2.0, -0.3), (-0.1, -4.0)] {
                let h = 1e-6;
                let num = (kl.eval(lp + h, rf).0 - kl.eval(lp - h, rf).0) / (2.0 * h);
                assert!(
                    (num - kl.eval(lp, rf).1).abs() < 1e-5,
                    "{name} at {lp},{rf}"
                );
            }
        }
    }

    #[test]
    fn controllers() {
        let mut f = KlController::new("fixed", 0.001, 0.1, 10000.0).unwrap();
        f.update(5.0, 64);
        assert_eq!(f.value(), 0.001);
        let mut a = KlController::new("adaptive", 0.001, 0.1, 10000.0).unwrap();
        a.update(0.3, 100); // e = clip(2, ±0.2) = 0.2 → β·(1 + 0.2·100/10000)
        assert!((a.value() - 0.001 * 1.002).abs() < 1e-15);
        a.update(0.05, 100); // e = -0.5 → -0.2
        assert!((a.value() - 0.001 * 1.002 * 0.998).abs() < 1e-15);
        assert!(KlController::new("fixed", -1.0, 0.1, 1.0).is_err());
        assert!(
            KlController::new("pid", 0.1, 0.1, 1.0)
                .unwrap_err()
                .to_string()
                .contains("fixed, adaptive")
        );
    }

    #[test]
    fn in_reward_penalty() {
        let shape = super::super::Shape { rows: 1, cols: 3 };
        let mut r = vec![0.0, 0.0, 1.0];
        let kl = apply_kl_penalty(
            shape,
            &mut r,
            &[-1.0, -1.0, -2.0],
            &[-1.5, -1.0, -1.0],
            &[1.0, 1.0, 0.0],
            "k1".parse().unwrap(),
            0.1,
        )
        .unwrap();
        assert_eq!(r, vec![-0.05, 0.0, 1.0]);
        assert!((kl - 0.25).abs() < 1e-7);
    }
}
