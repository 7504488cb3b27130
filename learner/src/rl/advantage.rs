//! Advantage estimators (`algorithm.adv_estimator`). Outcome estimators read each response's
//! score `s_i = Σ_t r[i,t]`; groups are the responses sampled for one prompt (`group[i]`).

use super::{Result, RlError, Shape, masked_whiten, names};
use std::collections::HashMap;
use std::str::FromStr;

/// Which estimator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AdvEstimator {
    /// Group-normalised outcome; `norm_adv_by_std: false` gives Dr.GRPO's s − μ.
    Grpo {
        /// Divide by the group's standard deviation.
        norm_by_std: bool,
    },
    /// Leave-one-out baseline.
    Rloo,
    /// Discounted token returns, whitened over the batch.
    ReinforcePlusPlus {
        /// Discount γ.
        gamma: f64,
    },
    /// Group-mean baseline, whitened over the batch.
    ReinforcePlusPlusBaseline,
    /// Returns minus the greedy response's score.
    Remax,
    /// Length-weighted group baseline.
    Opo,
    /// Generalised advantage estimation over a value function.
    Gae {
        /// Discount γ.
        gamma: f64,
        /// λ.
        lambda: f64,
    },
}

const ADV_NAMES: &[&str] = &[
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gae",
];

impl FromStr for AdvEstimator {
    type Err = RlError;
    /// Parses a name with default parameters (γ = λ = 1, std normalisation on).
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "grpo" => Self::Grpo { norm_by_std: true },
            "rloo" => Self::Rloo,
            "reinforce_plus_plus" => Self::ReinforcePlusPlus { gamma: 1.0 },
            "reinforce_plus_plus_baseline" => Self::ReinforcePlusPlusBaseline,
            "remax" => Self::Remax,
            "opo" => Self::Opo,
            "gae" => Self::Gae {
                gamma: 1.0,
                lambda: 1.0,
            },
            _ => {
                return Err(RlError::UnknownName {
                    what: "adv_estimator",
                    name: s.into(),
                    valid: names(ADV_NAMES),
                });
            }
        })
    }
}

impl AdvEstimator {
    /// Whether the estimator needs a critic's values.
    pub fn needs_values(self) -> bool {
        matches!(self, Self::Gae { .. })
    }
    fn check(self) -> Result<()> {
        let bad = |param, v: f64| RlError::InvalidParam {
            param,
            value: v.to_string(),
            why: "must lie in [0, 1]",
        };
        match self {
            Self::ReinforcePlusPlus { gamma } if !(0.0..=1.0).contains(&gamma) => {
                Err(bad("gamma", gamma))
            }
            Self::Gae { gamma, .. } if !(0.0..=1.0).contains(&gamma) => Err(bad("gamma", gamma)),
            Self::Gae { lambda, .. } if !(0.0..=1.0).contains(&lambda) => Err(bad("lam", lambda)),
            _ => Ok(()),
        }
    }
}

/// What an estimator reads.
#[derive(Clone, Copy, Debug)]
pub struct AdvInput<'a> {
    /// `[rows, cols]`.
    pub shape: Shape,
    /// Per-token rewards (outcome rewards sit on the last valid token).
    pub token_rewards: &'a [f32],
    /// Response mask.
    pub mask: &'a [f32],
    /// Group (prompt) id of each row.
    pub group: &'a [u64],
    /// Critic values per token (gae).
    pub values: Option<&'a [f32]>,
    /// Score of the greedy response to each row's prompt (remax).
    pub baseline_scores: Option<&'a [f32]>,
}

/// Advantages and returns, both `[rows, cols]`, zero on masked tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct AdvOutput {
    /// Advantage per token.
    pub advantages: Vec<f32>,
    /// Return per token (the critic's target in PPO).
    pub returns: Vec<f32>,
}

fn groups(group: &[u64]) -> HashMap<u64, Vec<usize>> {
    let mut g: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, &id) in group.iter().enumerate() {
        g.entry(id).or_default().push(i);
    }
    g
}

fn broadcast(shape: Shape, per_row: &[f64], mask: &[f32]) -> Vec<f64> {
    (0..shape.len())
        .map(|i| per_row[i / shape.cols] * mask[i] as f64)
        .collect()
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Computes advantages and returns.
pub fn compute(est: AdvEstimator, inp: AdvInput<'_>) -> Result<AdvOutput> {
    est.check()?;
    let sh = inp.shape;
    sh.check("token_rewards", inp.token_rewards)?;
    sh.check("mask", inp.mask)?;
    if inp.group.len() != sh.rows {
        return Err(RlError::Input(format!(
            "`group` has {} ids for {} rows",
            inp.group.len(),
            sh.rows
        )));
    }
    if sh.rows == 0 {
        return Err(RlError::Input(
            "no responses to estimate advantages for".into(),
        ));
    }
    let scores: Vec<f64> = (0..sh.rows)
        .map(|r| {
            inp.token_rewards[r * sh.cols..(r + 1) * sh.cols]
                .iter()
                .map(|&v| v as f64)
                .sum()
        })
        .collect();
    let m = inp.mask;
    let outcome = |a: Vec<f64>| {
        let t = broadcast(sh, &a, m);
        let v = to_f32(&t);
        AdvOutput {
            advantages: v.clone(),
            returns: v,
        }
    };
    Ok(match est {
        AdvEstimator::Grpo { norm_by_std } => {
            let mut a = vec![0.0; sh.rows];
            for rows in groups(inp.group).values() {
                let n = rows.len() as f64;
                let (mu, sd) = if rows.len() == 1 {
                    (0.0, 1.0)
                } else {
                    let mu = rows.iter().map(|&i| scores[i]).sum::<f64>() / n;
                    let var =
                        rows.iter().map(|&i| (scores[i] - mu).powi(2)).sum::<f64>() / (n - 1.0);
                    (mu, var.sqrt())
                };
                for &i in rows {
                    a[i] = if norm_by_std {
                        (scores[i] - mu) / (sd + 1e-6)
                    } else {
                        scores[i] - mu
                    };
                }
            }
            outcome(a)
        }
        AdvEstimator::Rloo => {
            let mut a = vec![0.0; sh.rows];
            for rows in groups(inp.group).values() {
                let n = rows.len() as f64;
                let mu = rows.iter().map(|&i| scores[i]).sum::<f64>() / n;
                for &i in rows {
                    a[i] = if rows.len() > 1 {
                        n / (n - 1.0) * (scores[i] - mu)
                    } else {
                        scores[i]
                    };
                }
            }
            outcome(a)
        }
        AdvEstimator::Opo => {
            let mut a = vec![0.0; sh.rows];
            for rows in groups(inp.group).values() {
                let len = |i: usize| {
                    m[i * sh.cols..(i + 1) * sh.cols]
                        .iter()
                        .map(|&v| v as f64)
                        .sum::<f64>()
                };
                let total: f64 = rows.iter().map(|&i| len(i)).sum();
                let b = if total > 0.0 {
                    rows.iter().map(|&i| len(i) * scores[i]).sum::<f64>() / total
                } else {
                    0.0
                };
                for &i in rows {
                    a[i] = scores[i] - b;
                }
            }
            outcome(a)
        }
        AdvEstimator::ReinforcePlusPlusBaseline => {
            let mut a = vec![0.0; sh.rows];
            for rows in groups(inp.group).values() {
                let mu = if rows.len() > 1 {
                    rows.iter().map(|&i| scores[i]).sum::<f64>() / rows.len() as f64
                } else {
                    0.0
                };
                for &i in rows {
                    a[i] = scores[i] - mu;
                }
            }
            let t = broadcast(sh, &a, m);
            let w: Vec<f64> = masked_whiten(&t, m)?
                .iter()
                .zip(m)
                .map(|(v, &k)| v * k as f64)
                .collect();
            let v = to_f32(&w);
            AdvOutput {
                advantages: v.clone(),
                returns: v,
            }
        }
        AdvEstimator::ReinforcePlusPlus { gamma } => {
            let mut ret = vec![0.0f64; sh.len()];
            for r in 0..sh.rows {
                let mut g = 0.0;
                for t in (0..sh.cols).rev() {
                    let i = r * sh.cols + t;
                    g = inp.token_rewards[i] as f64 + gamma * g;
                    ret[i] = g;
                    // masked tokens carry no return forward
                    g *= m[i] as f64;
                }
            }
            let adv: Vec<f64> = masked_whiten(&ret, m)?
                .iter()
                .zip(m)
                .map(|(v, &k)| v * k as f64)
                .collect();
            AdvOutput {
                advantages: to_f32(&adv),
                returns: to_f32(&ret),
            }
        }
        AdvEstimator::Remax => {
            let base = inp.baseline_scores.ok_or_else(|| {
                RlError::Input("remax needs the greedy responses' scores (baseline_scores)".into())
            })?;
            if base.len() != sh.rows {
                return Err(RlError::Input(format!(
                    "`baseline_scores` has {} entries for {} rows",
                    base.len(),
                    sh.rows
                )));
            }
            let mut ret = vec![0.0f64; sh.len()];
            let mut adv = vec![0.0f64; sh.len()];
            for r in 0..sh.rows {
                let mut acc = 0.0;
                for t in (0..sh.cols).rev() {
                    let i = r * sh.cols + t;
                    acc += inp.token_rewards[i] as f64 * m[i] as f64;
                    ret[i] = acc;
                    adv[i] = acc - base[r] as f64 * m[i] as f64;
                }
            }
            AdvOutput {
                advantages: to_f32(&adv),
                returns: to_f32(&ret),
            }
        }
        AdvEstimator::Gae { gamma, lambda } => {
            let values = inp
                .values
                .ok_or_else(|| RlError::Input("gae needs the critic's values".into()))?;
            sh.check("values", values)?;
            let mut gae = vec![0.0f64; sh.len()];
            let mut ret = vec![0.0f64; sh.len()];
            for r in 0..sh.rows {
                let (mut next_v, mut next_g) = (0.0f64, 0.0f64);
                for t in (0..sh.cols).rev() {
                    let i = r * sh.cols + t;
                    let (rw, v, mk) = (inp.token_rewards[i] as f64, values[i] as f64, m[i] as f64);
                    let delta = rw + gamma * next_v - v;
                    let g = delta + gamma * lambda * next_g;
                    // masked tokens pass next values through unchanged
                    next_v = v * mk + (1.0 - mk) * next_v;
                    next_g = g * mk + (1.0 - mk) * next_g;
                    gae[i] = g;
                    ret[i] = g + v;
                }
            }
            let adv: Vec<f64> = masked_whiten(&gae, m)?
                .iter()
                .zip(m)
                .map(|(v, &k)| v * k as f64)
                .collect();
            AdvOutput {
                advantages: to_f32(&adv),
                returns: to_f32(&ret),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outcome rewards on the last valid token of each row.
    fn outcome_rewards(shape: Shape, mask: &[f32], scores: &[f32]) -> Vec<f32> {
        let mut r = vec![0.0; shape.len()];
        for row in 0..shape.rows {
            let last = (0..shape.cols)
                .rev()
                .find(|&c| mask[row * shape.cols + c] > 0.0);
            if let Some(c) = last {
                r[row * shape.cols + c] = scores[row];
            }
        }
        r
    }

    fn run(est: &str, scores: &[f32], group: &[u64], mask: &[f32], cols: usize) -> AdvOutput {
        let shape = Shape {
            rows: scores.len(),
            cols,
        };
        let r = outcome_rewards(shape, mask, scores);
        compute(
            est.parse().unwrap(),
            AdvInput {
                shape,
                token_rewards: &r,
                mask,
                group,
                values: None,
                baseline_scores: None,
            },
        )
        .unwrap()
    }

    fn first_of_rows(o: &AdvOutput, cols: usize) -> Vec<f32> {
        o.advantages.chunks(cols).map(|r| r[0]).collect()
    }

    #[test]
    fn grpo_reference_and_edge_cases() {
        let o = run("grpo", &[1.0, 0.0, 0.0, 1.0], &[0; 4], &[1.0; 8], 2);
        for (a, b) in first_of_rows(&o, 2)
            .iter()
            .zip([0.866024, -0.866024, -0.866024, 0.866024])
        {
            assert!((a - b).abs() < 1e-5);
        }
        // all equal → 0; a singleton keeps its score (μ = 0, σ = 1)
        let o = run("grpo", &[0.7, 0.7, 0.7, 2.0], &[0, 0, 0, 1], &[1.0; 4], 1);
        assert_eq!(&o.advantages[..3], &[0.0, 0.0, 0.0]);
        assert!((o.advantages[3] - 2.0 / (1.0 + 1e-6)).abs() < 1e-6);
        // Dr.GRPO: no std normalisation
        let shape = Shape { rows: 3, cols: 1 };
        let dr = compute(
            AdvEstimator::Grpo { norm_by_std: false },
            AdvInput {
                shape,
                token_rewards: &[3.0, 0.0, 0.0],
                mask: &[1.0; 3],
                group: &[5; 3],
                values: None,
                baseline_scores: None,
            },
        )
        .unwrap();
        assert_eq!(dr.advantages, vec![2.0, -1.0, -1.0]);
        // masked tokens get exactly zero
        let o = run("grpo", &[1.0, 0.0], &[0, 0], &[1.0, 0.0, 1.0, 1.0], 2);
        assert_eq!(o.advantages[1], 0.0);
    }

    #[test]
    fn rloo_is_the_score_minus_the_mean_of_the_others() {
        let o = run("rloo", &[1.0, 0.0, 0.0, 3.0], &[0; 4], &[1.0; 4], 1);
        // others' means: 1, 4/3, 4/3, 1/3
        for (a, b) in o
            .advantages
            .iter()
            .zip([0.0, -4.0 / 3.0, -4.0 / 3.0, 3.0 - 1.0 / 3.0])
        {
            assert!((a - b).abs() < 1e-6);
        }
        assert_eq!(run("rloo", &[0.5], &[0], &[1.0], 1).advantages, vec![0.5]);
    }

    #[test]
    fn opo_uses_a_length_weighted_baseline() {
        // lengths 1 and 3, scores 1 and 0: b = (1·1 + 3·0)/4 = 0.25
        let mask = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let o = run("opo", &[1.0, 0.0], &[0, 0], &mask, 3);
        assert_eq!(o.advantages, vec![0.75, 0.0, 0.0, -0.25, -0.25, -0.25]);
    }

    #[test]
    fn reinforce_pp_baseline_whitens_group_centred_scores() {
        let o = run(
            "reinforce_plus_plus_baseline",
            &[1.0, 0.0, 2.0, 2.0],
            &[0, 0, 1, 1],
            &[1.0; 4],
            1,
        );
        // centred: [0.5, -0.5, 0, 0] → mean 0, unbiased var 1/6
        let sd = (1.0f64 / 6.0 + 1e-8).sqrt();
        for (a, b) in o.advantages.iter().zip([0.5 / sd, -0.5 / sd, 0.0, 0.0]) {
            assert!((*a as f64 - b).abs() < 1e-5);
        }
    }

    #[test]
    fn reinforce_pp_discounts_and_whitens() {
        let shape = Shape { rows: 1, cols: 3 };
        let r = [0.0, 1.0, 2.0];
        let o = compute(
            AdvEstimator::ReinforcePlusPlus { gamma: 0.5 },
            AdvInput {
                shape,
                token_rewards: &r,
                mask: &[1.0; 3],
                group: &[0],
                values: None,
                baseline_scores: None,
            },
        )
        .unwrap();
        // G = [0 + 0.5·2, 1 + 0.5·2, 2] = [1, 2, 2]
        assert_eq!(o.returns, vec![1.0, 2.0, 2.0]);
        let w = masked_whiten(&[1.0, 2.0, 2.0], &[1.0; 3]).unwrap();
        for (a, b) in o.advantages.iter().zip(w) {
            assert!((*a as f64 - b).abs() < 1e-6);
        }
    }

    #[test]
    fn remax_subtracts_the_greedy_score() {
        let shape = Shape { rows: 2, cols: 2 };
        let r = [0.0, 1.0, 0.0, 0.0];
        let o = compute(
            "remax".parse().unwrap(),
            AdvInput {
                shape,
                token_rewards: &r,
                mask: &[1.0, 1.0, 1.0, 0.0],
                group: &[0, 1],
                values: None,
                baseline_scores: Some(&[0.25, 0.5]),
            },
        )
        .unwrap();
        assert_eq!(o.returns, vec![1.0, 1.0, 0.0, 0.0]);
        assert_eq!(o.advantages, vec![0.75, 0.75, -0.5, 0.0]);
        let e = compute(
            "remax".parse().unwrap(),
            AdvInput {
                shape,
                token_rewards: &r,
                mask: &[1.0; 4],
                group: &[0, 1],
                values: None,
                baseline_scores: None,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("baseline_scores"));
    }

    #[test]
    fn gae_by_hand() {
        // one row, tokens [v=0.5, v=0.25, masked, v=0.0], reward 1 on the last valid token.
        let shape = Shape { rows: 1, cols: 4 };
        let mask = [1.0, 1.0, 0.0, 1.0];
        let r = [0.0, 0.0, 0.0, 1.0];
        let v = [0.5, 0.25, 9.0, 0.0];
        let o = compute(
            AdvEstimator::Gae {
                gamma: 1.0,
                lambda: 1.0,
            },
            AdvInput {
                shape,
                token_rewards: &r,
                mask: &mask,
                group: &[0],
                values: Some(&v),
                baseline_scores: None,
            },
        )
        .unwrap();
        // t3: δ = 1 - 0 = 1, g = 1; t2 masked (carries v=0, g=1); t1: δ = 0 + 0 - 0.25, g = -0.25 + 1 = 0.75;
        // t0: δ = 0 + 0.25 - 0.5 = -0.25, g = 0.5. returns = g + V on valid tokens.
        assert_eq!([o.returns[0], o.returns[1], o.returns[3]], [1.0, 1.0, 1.0]);
        let w = masked_whiten(&[0.5, 0.75, 0.0, 1.0], &mask).unwrap();
        for i in [0, 1, 3] {
            assert!((o.advantages[i] as f64 - w[i]).abs() < 1e-6);
        }
        assert_eq!(o.advantages[2], 0.0);
    }

    #[test]
    fn bad_names_and_inputs_are_refused() {
        let e = "ppo".parse::<AdvEstimator>().unwrap_err().to_string();
        assert!(
            e.contains("unknown adv_estimator `ppo`") && e.contains("grpo, rloo"),
            "{e}"
        );
        let shape = Shape { rows: 0, cols: 1 };
        assert!(
            compute(
                "grpo".parse().unwrap(),
                AdvInput {
                    shape,
                    token_rewards: &[],
                    mask: &[],
                    group: &[],
                    values: None,
                    baseline_scores: None
                }
            )
            .is_err()
        );
        let shape = Shape { rows: 1, cols: 1 };
        let e = compute(
            AdvEstimator::Gae {
                gamma: 1.5,
                lambda: 1.0,
            },
            AdvInput {
                shape,
                token_rewards: &[0.0],
                mask: &[1.0],
                group: &[0],
                values: Some(&[0.0]),
                baseline_scores: None,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("gamma = 1.5"));
    }
}
