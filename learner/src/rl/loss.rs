//! Policy losses (`actor.policy_loss`) with the entropy bonus and KL loss, the clipped value
//! loss, and truncated importance weights for rollout/training mismatch. Each returns its
//! value, VeRL-named metrics and its per-token gradient.

use super::agg::{AggNorm, LossAgg, apply};
use super::kl::Kl;
use super::{Metrics, Result, RlError, Shape, masked_mean, names};
use std::str::FromStr;

/// Which policy loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PolicyLoss {
    /// PPO clip with dual-clip and clip-higher.
    Vanilla,
    /// Sequence-level ratio (always `seq-mean-token-mean`).
    Gspo,
    /// Clipped-ratio-weighted REINFORCE.
    Cispo,
    /// Plain −A·logp.
    Gpg,
}

const LOSS_NAMES: &[&str] = &["vanilla", "gspo", "cispo", "gpg"];

impl FromStr for PolicyLoss {
    type Err = RlError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "vanilla" => Self::Vanilla,
            "gspo" => Self::Gspo,
            "cispo" => Self::Cispo,
            "gpg" => Self::Gpg,
            _ => {
                return Err(RlError::UnknownName {
                    what: "policy_loss",
                    name: s.into(),
                    valid: names(LOSS_NAMES),
                });
            }
        })
    }
}

/// Settings of the actor loss.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicyLossConfig {
    /// The loss.
    pub loss: PolicyLoss,
    /// ε_low (`clip_ratio_low`, default `clip_ratio` = 0.2).
    pub clip_low: f64,
    /// ε_high (`clip_ratio_high`, default `clip_ratio`).
    pub clip_high: f64,
    /// Dual-clip bound c (`clip_ratio_c`, default 3).
    pub clip_c: f64,
    /// Entropy bonus coefficient.
    pub entropy_coeff: f64,
    /// KL loss against the reference policy: estimator and coefficient.
    pub kl: Option<(Kl, f64)>,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            loss: PolicyLoss::Vanilla,
            clip_low: 0.2,
            clip_high: 0.2,
            clip_c: 3.0,
            entropy_coeff: 0.0,
            kl: None,
        }
    }
}

impl PolicyLossConfig {
    /// Refuses parameters outside their domain.
    pub fn validate(&self) -> Result<()> {
        let bad = |param, v: f64, why| {
            Err(RlError::InvalidParam {
                param,
                value: v.to_string(),
                why,
            })
        };
        if !(self.clip_c > 1.0) {
            return bad("clip_ratio_c", self.clip_c, "must be greater than 1");
        }
        if !(0.0..1.0).contains(&self.clip_low) {
            return bad("clip_ratio_low", self.clip_low, "must lie in [0, 1)");
        }
        if !(self.clip_high >= 0.0) {
            return bad("clip_ratio_high", self.clip_high, "must not be negative");
        }
        if !(self.entropy_coeff >= 0.0) {
            return bad("entropy_coeff", self.entropy_coeff, "must not be negative");
        }
        if let Some((_, c)) = self.kl
            && !(c >= 0.0)
        {
            return bad("kl_loss_coef", c, "must not be negative");
        }
        Ok(())
    }
}

/// Per-token inputs of the actor loss for one micro-batch.
#[derive(Clone, Copy, Debug)]
pub struct ActorInput<'a> {
    /// `[rows, cols]`.
    pub shape: Shape,
    /// Current log-probs.
    pub logp: &'a [f32],
    /// Log-probs when the batch was generated (the trainer's recomputation).
    pub old_logp: &'a [f32],
    /// Advantages.
    pub advantages: &'a [f32],
    /// Response mask.
    pub mask: &'a [f32],
    /// Entropy per token (needed when `entropy_coeff > 0`, reported when given).
    pub entropy: Option<&'a [f32]>,
    /// Reference log-probs (needed for the KL loss).
    pub ref_logp: Option<&'a [f32]>,
    /// Constant per-token weights (truncated importance sampling), multiplied into the loss.
    pub is_weights: Option<&'a [f32]>,
}

/// A loss's value, metrics and gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct LossOutput {
    /// The loss to minimise.
    pub loss: f64,
    /// d loss / d logp per token (or d loss / d value for the critic).
    pub grad: Vec<f32>,
    /// d loss / d entropy per token (zero unless the entropy bonus is on).
    pub grad_entropy: Vec<f32>,
    /// VeRL-named metrics.
    pub metrics: Metrics,
}

/// The actor loss. `norm` holds the mini-batch's aggregation normalisers (GSPO always uses
/// `seq-mean-token-mean` over the same mini-batch).
pub fn actor_loss(
    cfg: &PolicyLossConfig,
    norm: &AggNorm,
    inp: ActorInput<'_>,
) -> Result<LossOutput> {
    cfg.validate()?;
    let sh = inp.shape;
    for (n, v) in [
        ("logp", inp.logp),
        ("old_logp", inp.old_logp),
        ("advantages", inp.advantages),
        ("mask", inp.mask),
    ] {
        sh.check(n, v)?;
    }
    for (n, v) in [
        ("entropy", inp.entropy),
        ("ref_logp", inp.ref_logp),
        ("is_weights", inp.is_weights),
    ] {
        if let Some(v) = v {
            sh.check(n, v)?;
        }
    }
    let n = sh.len();
    let m = inp.mask;
    let (el, eh, c) = (cfg.clip_low, cfg.clip_high, cfg.clip_c);
    let mut per_tok = vec![0.0f64; n];
    let mut dper = vec![0.0f64; n]; // d per_tok / d logp
    let mut clipped = vec![0.0f64; n];
    let mut clipped_lower = vec![0.0f64; n];
    let mut neg_kl = vec![0.0f64; n];
    let mut metric_norm = *norm;
    match cfg.loss {
        PolicyLoss::Vanilla | PolicyLoss::Cispo | PolicyLoss::Gpg => {
            for i in 0..n {
                let (lp, a) = (inp.logp[i] as f64, inp.advantages[i] as f64);
                let raw = lp - inp.old_logp[i] as f64;
                let lr = raw.clamp(-20.0, 20.0);
                let live = (-20.0..=20.0).contains(&raw);
                let rho = lr.exp();
                let drho = if live { rho } else { 0.0 };
                neg_kl[i] = lr;
                let in_range = rho > 1.0 - el && rho < 1.0 + eh;
                let rho_c = rho.clamp(1.0 - el, 1.0 + eh);
                match cfg.loss {
                    PolicyLoss::Vanilla => {
                        let (l1, l2) = (-a * rho, -a * rho_c);
                        let (lc, dlc) = if l2 > l1 {
                            (l2, if in_range { -a * drho } else { 0.0 })
                        } else {
                            (l1, -a * drho)
                        };
                        clipped[i] = (l2 > l1) as u8 as f64;
                        let (l, dl) = if a < 0.0 && -a * c < lc {
                            (-a * c, 0.0)
                        } else {
                            (lc, dlc)
                        };
                        clipped_lower[i] = (a < 0.0 && lc > -a * c) as u8 as f64;
                        per_tok[i] = l;
                        dper[i] = dl;
                    }
                    PolicyLoss::Cispo => {
                        per_tok[i] = -rho_c * a * lp;
                        dper[i] = -rho_c * a;
                        clipped[i] = (!in_range) as u8 as f64;
                    }
                    _ => {
                        per_tok[i] = -a * lp;
                        dper[i] = -a;
                    }
                }
            }
        }
        PolicyLoss::Gspo => {
            metric_norm = AggNorm {
                mode: LossAgg::SeqMeanTokenMean,
                ..*norm
            };
            for r in 0..sh.rows {
                let row = r * sh.cols..(r + 1) * sh.cols;
                let len: f64 = m[row.clone()].iter().map(|&v| v as f64).sum();
                let s: f64 = row
                    .clone()
                    .map(|i| (inp.logp[i] as f64 - inp.old_logp[i] as f64) * m[i] as f64)
                    .sum::<f64>()
                    / len.max(1.0);
                for i in row {
                    let a = inp.advantages[i] as f64;
                    neg_kl[i] = (inp.logp[i] as f64 - inp.old_logp[i] as f64).clamp(-20.0, 20.0);
                    // ℓ = logp − sg(logp) + sg(s): value s, gradient 1 (0 above the clamp)
                    let live = s <= 10.0;
                    let ratio = s.min(10.0).exp();
                    let dr = if live { ratio } else { 0.0 };
                    let in_range = ratio > 1.0 - el && ratio < 1.0 + eh;
                    let (l1, l2) = (-a * ratio, -a * ratio.clamp(1.0 - el, 1.0 + eh));
                    if l2 > l1 {
                        per_tok[i] = l2;
                        dper[i] = if in_range { -a * dr } else { 0.0 };
                        clipped[i] = 1.0;
                    } else {
                        per_tok[i] = l1;
                        dper[i] = -a * dr;
                    }
                }
            }
        }
    }
    if let Some(w) = inp.is_weights {
        for i in 0..n {
            per_tok[i] *= w[i] as f64;
            dper[i] *= w[i] as f64;
        }
    }
    let w = metric_norm.weights(sh, m);
    let pg_loss = apply(&w, &per_tok);
    let mut grad: Vec<f64> = (0..n).map(|i| w[i] * dper[i]).collect();
    let mut grad_entropy = vec![0.0f32; n];
    let mut loss = pg_loss;
    let mut metrics = Metrics::new();
    // entropy and KL terms aggregate with the configured mode (not GSPO's override)
    let wn = norm.weights(sh, m);
    if let Some(h) = inp.entropy {
        let hv: Vec<f64> = h.iter().map(|&v| v as f64).collect();
        let ent = apply(&wn, &hv);
        metrics.insert("actor/entropy".into(), ent);
        if cfg.entropy_coeff > 0.0 {
            loss -= cfg.entropy_coeff * ent;
            for i in 0..n {
                grad_entropy[i] = (-cfg.entropy_coeff * wn[i]) as f32;
            }
        }
    } else if cfg.entropy_coeff > 0.0 {
        return Err(RlError::Input(
            "entropy_coeff > 0 needs per-token entropy".into(),
        ));
    }
    if let Some((kl, coef)) = cfg.kl {
        let r = inp.ref_logp.ok_or_else(|| {
            RlError::Input("use_kl_loss needs the reference policy's log-probs".into())
        })?;
        let mut vals = vec![0.0; n];
        for i in 0..n {
            let (v, g) = kl.eval(inp.logp[i] as f64, r[i] as f64);
            vals[i] = v;
            grad[i] += coef * wn[i] * g;
        }
        let kl_loss = apply(&wn, &vals);
        loss += coef * kl_loss;
        metrics.insert("actor/kl_loss".into(), kl_loss);
        metrics.insert("actor/kl_coef".into(), coef);
    }
    let neg: Vec<f64> = neg_kl.iter().map(|v| -v).collect();
    metrics.insert("actor/pg_loss".into(), pg_loss);
    metrics.insert("actor/pg_clipfrac".into(), masked_mean(&clipped, m));
    metrics.insert(
        "actor/pg_clipfrac_lower".into(),
        masked_mean(&clipped_lower, m),
    );
    metrics.insert("actor/ppo_kl".into(), masked_mean(&neg, m));
    Ok(LossOutput {
        loss,
        grad: grad.iter().map(|&g| g as f32).collect(),
        grad_entropy,
        metrics,
    })
}

/// Inputs of the clipped value loss.
#[derive(Clone, Copy, Debug)]
pub struct CriticInput<'a> {
    /// `[rows, cols]`.
    pub shape: Shape,
    /// Current values.
    pub values: &'a [f32],
    /// Values when the batch was generated.
    pub old_values: &'a [f32],
    /// Return targets.
    pub returns: &'a [f32],
    /// Response mask.
    pub mask: &'a [f32],
}

/// `½·agg(max((v − R)², (v_c − R)²))`, `v_c = clamp(v, v_old ± cliprange_value)`.
pub fn value_loss(
    norm: &AggNorm,
    cliprange_value: f64,
    inp: CriticInput<'_>,
) -> Result<LossOutput> {
    if !(cliprange_value >= 0.0) {
        return Err(RlError::InvalidParam {
            param: "cliprange_value",
            value: cliprange_value.to_string(),
            why: "must not be negative",
        });
    }
    let sh = inp.shape;
    for (n, v) in [
        ("values", inp.values),
        ("old_values", inp.old_values),
        ("returns", inp.returns),
        ("mask", inp.mask),
    ] {
        sh.check(n, v)?;
    }
    let n = sh.len();
    let w = norm.weights(sh, inp.mask);
    let (mut per, mut d, mut clip) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        let (v, vo, r) = (
            inp.values[i] as f64,
            inp.old_values[i] as f64,
            inp.returns[i] as f64,
        );
        let (lo, hi) = (vo - cliprange_value, vo + cliprange_value);
        let vc = v.clamp(lo, hi);
        let (u, c) = ((v - r).powi(2), (vc - r).powi(2));
        if c > u {
            per[i] = 0.5 * c;
            d[i] = if v > lo && v < hi { vc - r } else { 0.0 };
            clip[i] = 1.0;
        } else {
            per[i] = 0.5 * u;
            d[i] = v - r;
        }
    }
    let loss = apply(&w, &per);
    let mut metrics = Metrics::new();
    metrics.insert("critic/vf_loss".into(), loss);
    metrics.insert("critic/vf_clipfrac".into(), masked_mean(&clip, inp.mask));
    Ok(LossOutput {
        loss,
        grad: (0..n).map(|i| (w[i] * d[i]) as f32).collect(),
        grad_entropy: vec![0.0; n],
        metrics,
    })
}

/// Truncated importance weights `min(exp(clamp(old − rollout, ±20)), threshold)` correcting
/// for the rollout engine's log-probs differing from the trainer's; constants in the loss.
pub fn tis_weights(
    old_logp: &[f32],
    rollout_logp: &[f32],
    mask: &[f32],
    threshold: f64,
) -> Result<Vec<f32>> {
    if old_logp.len() != rollout_logp.len() || mask.len() != old_logp.len() {
        return Err(RlError::Input(
            "old_logp, rollout_logp and mask must have one entry per token".into(),
        ));
    }
    if !(threshold > 0.0) {
        return Err(RlError::InvalidParam {
            param: "tis_threshold",
            value: threshold.to_string(),
            why: "must be positive",
        });
    }
    Ok(old_logp
        .iter()
        .zip(rollout_logp)
        .zip(mask)
        .map(|((&o, &r), &m)| {
            ((o as f64 - r as f64)
                .clamp(-20.0, 20.0)
                .exp()
                .min(threshold)
                * m as f64) as f32
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::uniform;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    const MODES: [&str; 5] = [
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ];

    fn one(cfg: &PolicyLossConfig, a: f32, rho: f64) -> f64 {
        let shape = Shape { rows: 1, cols: 1 };
        let norm = AggNorm::new(LossAgg::TokenMean, shape, &[1.0]).unwrap();
        let logp = [(rho.ln() - 1.0) as f32];
        let inp = ActorInput {
            shape,
            logp: &logp,
            old_logp: &[-1.0],
            advantages: &[a],
            mask: &[1.0],
            entropy: None,
            ref_logp: None,
            is_weights: None,
        };
        actor_loss(cfg, &norm, inp).unwrap().loss
    }

    #[test]
    fn vanilla_reference_values() {
        let cfg = PolicyLossConfig::default();
        assert!((one(&cfg, 1.0, 1.5) + 1.2).abs() < 1e-6);
        assert!((one(&cfg, -1.0, 0.5) - 0.8).abs() < 1e-6);
        assert!((one(&cfg, -1.0, 5.0) - 3.0).abs() < 1e-6);
        // derived: inside the trust region the loss is −A·ρ; clip-higher widens the upper bound
        assert!((one(&cfg, 2.0, 1.1) + 2.2).abs() < 1e-6);
        let dapo = PolicyLossConfig {
            clip_high: 0.28,
            ..cfg
        };
        assert!((one(&dapo, 1.0, 1.5) + 1.28).abs() < 1e-6);
        // GPG and CISPO on one token: −A·logp and −clip(ρ)·A·logp
        let gpg = PolicyLossConfig {
            loss: PolicyLoss::Gpg,
            ..cfg
        };
        assert!((one(&gpg, 2.0, 1.0) - 2.0).abs() < 1e-6);
        let cispo = PolicyLossConfig {
            loss: PolicyLoss::Cispo,
            ..cfg
        };
        assert!((one(&cispo, 1.0, 2.0) - (-1.2 * (2f64.ln() - 1.0))).abs() < 1e-6);
    }

    #[test]
    fn gspo_uses_the_sequence_ratio() {
        // one sequence of two tokens: log-ratios 0.1 and 0.3 → s = 0.2, ratio e^0.2 ≈ 1.2214 > 1.2
        let shape = Shape { rows: 1, cols: 2 };
        let cfg = PolicyLossConfig {
            loss: PolicyLoss::Gspo,
            ..Default::default()
        };
        let norm = AggNorm::new(LossAgg::TokenSum, shape, &[1.0; 2]).unwrap();
        let inp = ActorInput {
            shape,
            logp: &[-0.9, -0.7],
            old_logp: &[-1.0, -1.0],
            advantages: &[1.0, 1.0],
            mask: &[1.0; 2],
            entropy: None,
            ref_logp: None,
            is_weights: None,
        };
        let out = actor_loss(&cfg, &norm, inp).unwrap();
        // A > 0 and ratio above 1+ε: clipped to −1.2, no gradient; seq-mean-token-mean despite token-sum
        assert!((out.loss + 1.2).abs() < 1e-6, "{}", out.loss);
        assert_eq!(out.grad, vec![0.0, 0.0]);
        assert!((out.metrics["actor/pg_clipfrac"] - 1.0).abs() < 1e-7);
    }

    /// GSPO and CISPO define their gradients through stop-gradients, so they are not the
    /// derivative of the loss value: check them against their definitions.
    #[test]
    fn stop_gradient_losses_follow_their_definition() {
        let shape = Shape { rows: 1, cols: 2 };
        let mask = [1.0; 2];
        let norm = AggNorm::new(LossAgg::TokenMean, shape, &mask).unwrap();
        let (logp, old, adv) = ([-1.0f32, -2.0], [-1.05f32, -1.9], [0.5f32, 0.5]);
        let inp = ActorInput {
            shape,
            logp: &logp,
            old_logp: &old,
            advantages: &adv,
            mask: &mask,
            entropy: None,
            ref_logp: None,
            is_weights: None,
        };
        // GSPO: s = (0.05 − 0.1)/2 = −0.025; ratio e^s inside the region; seq-mean-token-mean
        // weights 1/2 per token; d/dlogp_t = −A·ratio·w.
        let g = actor_loss(
            &PolicyLossConfig {
                loss: PolicyLoss::Gspo,
                ..Default::default()
            },
            &norm,
            inp,
        )
        .unwrap();
        let ratio = (-0.025f64).exp();
        for t in 0..2 {
            assert!(
                (g.grad[t] as f64 + 0.5 * ratio * 0.5).abs() < 1e-6,
                "{:?}",
                g.grad
            );
        }
        assert!((g.loss + 0.5 * ratio).abs() < 1e-6);
        // CISPO: d/dlogp_t = −clip(ρ_t)·A·w
        let c = actor_loss(
            &PolicyLossConfig {
                loss: PolicyLoss::Cispo,
                ..Default::default()
            },
            &norm,
            inp,
        )
        .unwrap();
        for t in 0..2 {
            let rho = ((logp[t] - old[t]) as f64).exp().clamp(0.8, 1.2);
            assert!((c.grad[t] as f64 + rho * 0.5 * 0.5).abs() < 1e-6);
        }
    }

    #[allow(clippy::type_complexity)]
    fn random_case(
        rng: &mut ChaCha8Rng,
        rows: usize,
        cols: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let n = rows * cols;
        let mut u = |lo: f64, hi: f64| (lo + (hi - lo) * uniform(rng)) as f32;
        let logp: Vec<f32> = (0..n).map(|_| u(-3.0, -0.1)).collect();
        let old: Vec<f32> = logp.iter().map(|&l| l + u(-0.4, 0.4)).collect();
        let adv: Vec<f32> = (0..n).map(|_| u(-2.0, 2.0)).collect();
        // masks: each row a valid prefix, sometimes empty
        let mut mask = vec![0.0f32; n];
        for r in 0..rows {
            let len = (u(0.0, cols as f64 + 0.99) as usize).min(cols);
            mask[r * cols..r * cols + len].fill(1.0);
        }
        let ent: Vec<f32> = (0..n).map(|_| u(0.1, 3.0)).collect();
        let rf: Vec<f32> = logp.iter().map(|&l| l + u(-0.5, 0.5)).collect();
        (logp, old, adv, mask, ent, rf)
    }

    fn configs() -> Vec<PolicyLossConfig> {
        let base = PolicyLossConfig {
            entropy_coeff: 0.01,
            kl: Some(("low_var_kl".parse().unwrap(), 0.1)),
            ..Default::default()
        };
        [
            PolicyLoss::Vanilla,
            PolicyLoss::Gspo,
            PolicyLoss::Cispo,
            PolicyLoss::Gpg,
        ]
        .into_iter()
        .map(|loss| PolicyLossConfig {
            loss,
            clip_high: 0.28,
            ..base
        })
        .collect()
    }

    #[test]
    fn gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (rows, cols) = (3, 5);
        let shape = Shape { rows, cols };
        let (logp, old, adv, mask, ent, rf) = random_case(&mut rng, rows, cols);
        // GSPO and CISPO use stop-gradients: see `stop_gradient_losses_follow_their_definition`.
        for cfg in configs()
            .into_iter()
            .filter(|c| matches!(c.loss, PolicyLoss::Vanilla | PolicyLoss::Gpg))
        {
            for mode in MODES {
                let norm = AggNorm::new(mode.parse().unwrap(), shape, &mask).unwrap();
                let eval = |lp: &[f32], en: &[f32]| {
                    let inp = ActorInput {
                        shape,
                        logp: lp,
                        old_logp: &old,
                        advantages: &adv,
                        mask: &mask,
                        entropy: Some(en),
                        ref_logp: Some(&rf),
                        is_weights: None,
                    };
                    actor_loss(&cfg, &norm, inp).unwrap()
                };
                let out = eval(&logp, &ent);
                for i in 0..shape.len() {
                    let h = 1e-3f32;
                    let (mut p, mut q) = (logp.clone(), logp.clone());
                    p[i] += h;
                    q[i] -= h;
                    let num = (eval(&p, &ent).loss - eval(&q, &ent).loss) / (2.0 * h as f64);
                    assert!(
                        (num - out.grad[i] as f64).abs() < 2e-3 * (1.0 + num.abs()),
                        "{:?} {mode} d/dlogp[{i}]: {num} vs {}",
                        cfg.loss,
                        out.grad[i]
                    );
                    let (mut p, mut q) = (ent.clone(), ent.clone());
                    p[i] += h;
                    q[i] -= h;
                    let num = (eval(&logp, &p).loss - eval(&logp, &q).loss) / (2.0 * h as f64);
                    assert!(
                        (num - out.grad_entropy[i] as f64).abs() < 1e-4,
                        "{mode} d/dH[{i}]"
                    );
                }
            }
        }
    }

    #[test]
    fn micro_batches_give_the_same_loss_and_gradient_in_every_mode() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for trial in 0..20 {
            let rows = 2 + trial % 5;
            let cols = 1 + (trial * 7) % 6;
            let shape = Shape { rows, cols };
            let (logp, old, adv, mask, ent, rf) = random_case(&mut rng, rows, cols);
            for cfg in configs() {
                for mode in MODES {
                    let norm = AggNorm::new(mode.parse().unwrap(), shape, &mask).unwrap();
                    let whole = actor_loss(
                        &cfg,
                        &norm,
                        ActorInput {
                            shape,
                            logp: &logp,
                            old_logp: &old,
                            advantages: &adv,
                            mask: &mask,
                            entropy: Some(&ent),
                            ref_logp: Some(&rf),
                            is_weights: None,
                        },
                    )
                    .unwrap();
                    let split = rows / 2;
                    let (mut loss, mut grad) = (0.0, Vec::new());
                    for (r0, r1) in [(0, split), (split, rows)] {
                        let s = Shape {
                            rows: r1 - r0,
                            cols,
                        };
                        let sl = |v: &[f32]| v[r0 * cols..r1 * cols].to_vec();
                        let part = actor_loss(
                            &cfg,
                            &norm,
                            ActorInput {
                                shape: s,
                                logp: &sl(&logp),
                                old_logp: &sl(&old),
                                advantages: &sl(&adv),
                                mask: &sl(&mask),
                                entropy: Some(&sl(&ent)),
                                ref_logp: Some(&sl(&rf)),
                                is_weights: None,
                            },
                        )
                        .unwrap();
                        loss += part.loss;
                        grad.extend(part.grad);
                    }
                    assert!(
                        (loss - whole.loss).abs() < 1e-9 * (1.0 + whole.loss.abs()),
                        "{:?} {mode}: {loss} vs {}",
                        cfg.loss,
                        whole.loss
                    );
                    assert_eq!(grad, whole.grad, "{:?} {mode}", cfg.loss);
                }
            }
        }
    }

    /// What lets the policy update leave such rows out of its backward: without an entropy
    /// bonus or a KL loss, a row whose advantages are all zero gets exactly zero gradient from
    /// every loss in every aggregation, while the others' is unchanged.
    #[test]
    fn a_row_of_zero_advantages_gets_no_gradient() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let shape = Shape { rows: 4, cols: 6 };
        let (logp, old, adv, _, ent, _) = random_case(&mut rng, 4, 6);
        let mask = vec![1.0f32; shape.len()];
        let mut zeroed = adv.clone();
        zeroed[6..12].fill(0.0);
        for loss in [
            PolicyLoss::Vanilla,
            PolicyLoss::Gspo,
            PolicyLoss::Cispo,
            PolicyLoss::Gpg,
        ] {
            let cfg = PolicyLossConfig {
                loss,
                ..Default::default()
            };
            for mode in MODES {
                let norm = AggNorm::new(mode.parse().unwrap(), shape, &mask).unwrap();
                let out = actor_loss(
                    &cfg,
                    &norm,
                    ActorInput {
                        shape,
                        logp: &logp,
                        old_logp: &old,
                        advantages: &zeroed,
                        mask: &mask,
                        entropy: Some(&ent),
                        ref_logp: None,
                        is_weights: None,
                    },
                )
                .unwrap();
                assert!(out.grad[6..12].iter().all(|&g| g == 0.0), "{loss:?} {mode}");
                assert!(
                    out.grad_entropy.iter().all(|&g| g == 0.0),
                    "{loss:?} {mode}"
                );
                assert!(out.grad[..6].iter().any(|&g| g != 0.0), "{loss:?} {mode}");
            }
        }
    }

    #[test]
    fn masked_tokens_contribute_exactly_nothing() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let shape = Shape { rows: 4, cols: 6 };
        let (logp, old, adv, mask, ent, rf) = random_case(&mut rng, 4, 6);
        for cfg in configs() {
            for mode in MODES {
                let norm = AggNorm::new(mode.parse().unwrap(), shape, &mask).unwrap();
                let run = |lp: &[f32], a: &[f32]| {
                    actor_loss(
                        &cfg,
                        &norm,
                        ActorInput {
                            shape,
                            logp: lp,
                            old_logp: &old,
                            advantages: a,
                            mask: &mask,
                            entropy: Some(&ent),
                            ref_logp: Some(&rf),
                            is_weights: None,
                        },
                    )
                    .unwrap()
                };
                let base = run(&logp, &adv);
                let (mut lp2, mut a2) = (logp.clone(), adv.clone());
                for i in 0..shape.len() {
                    if mask[i] == 0.0 {
                        lp2[i] -= 7.0;
                        a2[i] = 100.0;
                        assert_eq!(base.grad[i], 0.0);
                        assert_eq!(base.grad_entropy[i], 0.0);
                    }
                }
                assert_eq!(run(&lp2, &a2).loss, base.loss, "{:?} {mode}", cfg.loss);
            }
        }
    }

    #[test]
    fn value_loss_by_hand_and_by_finite_differences() {
        let shape = Shape { rows: 1, cols: 3 };
        let mask = [1.0, 1.0, 0.0];
        let norm = AggNorm::new(LossAgg::TokenMean, shape, &mask).unwrap();
        // token 0: v=1, old=0, R=2: clipped v_c=0.5, (0.5-2)²=2.25 > (1-2)²=1 → 0.5·2.25, no grad
        // token 1: v=0.2, old=0, R=0: unclipped (0.04) vs clipped (0.04): 0.5·0.04, grad v−R
        let out = value_loss(
            &norm,
            0.5,
            CriticInput {
                shape,
                values: &[1.0, 0.2, 5.0],
                old_values: &[0.0, 0.0, 0.0],
                returns: &[2.0, 0.0, 0.0],
                mask: &mask,
            },
        )
        .unwrap();
        assert!((out.loss - (0.5 * 2.25 + 0.5 * 0.04) / 2.0).abs() < 1e-7);
        assert!(
            (out.grad[0]).abs() < 1e-12 && (out.grad[1] - 0.1).abs() < 1e-7 && out.grad[2] == 0.0
        );
        assert!((out.metrics["critic/vf_clipfrac"] - 0.5).abs() < 1e-7);
    }

    #[test]
    fn tis_truncates_and_invalid_parameters_are_refused() {
        let w = tis_weights(
            &[-1.0, -1.0, -2.0],
            &[-1.5, -0.5, -1.0],
            &[1.0, 1.0, 0.0],
            1.5,
        )
        .unwrap();
        assert!(
            (w[0] - 1.5).abs() < 1e-7
                && (w[1] - (-0.5f64).exp() as f32).abs() < 1e-7
                && w[2] == 0.0
        );
        let e = PolicyLossConfig {
            clip_c: 1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("clip_ratio_c = 1") && e.contains("greater than 1"),
            "{e}"
        );
        assert!(
            PolicyLossConfig {
                entropy_coeff: -0.1,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            PolicyLossConfig {
                kl: Some(("k1".parse().unwrap(), -1.0)),
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        let e = "ppo2".parse::<PolicyLoss>().unwrap_err().to_string();
        assert!(e.contains("vanilla, gspo, cispo, gpg"), "{e}");
        assert!(
            "mean"
                .parse::<LossAgg>()
                .unwrap_err()
                .to_string()
                .contains("token-mean")
        );
    }

    #[test]
    fn all_equal_groups_give_zero_advantage_and_zero_policy_gradient() {
        use crate::rl::advantage::{AdvInput, compute};
        let shape = Shape { rows: 4, cols: 2 };
        let mask = [1.0; 8];
        let r = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0];
        for est in ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"] {
            let out = compute(
                est.parse().unwrap(),
                AdvInput {
                    shape,
                    token_rewards: &r,
                    mask: &mask,
                    group: &[3; 4],
                    values: None,
                    baseline_scores: None,
                },
            );
            let o = out.unwrap();
            assert!(
                o.advantages.iter().all(|&a| a == 0.0),
                "{est}: {:?}",
                o.advantages
            );
            // zero advantage → zero policy gradient
            let norm = AggNorm::new(LossAgg::TokenMean, shape, &mask).unwrap();
            let lp = [-1.0f32; 8];
            let old = [-1.1f32; 8];
            let g = actor_loss(
                &PolicyLossConfig::default(),
                &norm,
                ActorInput {
                    shape,
                    logp: &lp,
                    old_logp: &old,
                    advantages: &o.advantages,
                    mask: &mask,
                    entropy: None,
                    ref_logp: None,
                    is_weights: None,
                },
            )
            .unwrap();
            assert!(g.grad.iter().all(|&x| x == 0.0));
        }
    }
}
