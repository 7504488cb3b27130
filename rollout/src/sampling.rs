//! Token sampling: greedy, temperature, top-k, top-p, min-p, with per-sequence ChaCha streams.
//!
//! The reported log-prob is `log_softmax(logits / temperature)` of the chosen token *before*
//! top-k/top-p/min-p truncation, which is what the learner recomputes, so importance ratios start
//! at 1. Greedy (`temperature == 0`) reports `log_softmax(logits)`. The reported entropy is that
//! distribution's (what the learner's `actor/entropy` computes at the same position).

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// How to sample one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Samples of this prompt (they share one prefill).
    pub n: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1: off).
    pub top_p: f32,
    /// Keep tokens with probability at least `min_p` × the top one's (0: off).
    pub min_p: f32,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Generation stops after any of these (the stop token is kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// Seed of sample 0; sample i draws from stream i of the same ChaCha key, so results do
    /// not depend on what else is batched. `None`: the engine picks one.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Refuses out-of-range settings, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.n == 0 {
            return Err("n must be at least 1".into());
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be 0 (greedy) or positive, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must lie in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must lie in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// A sampled token, with its log-prob and the entropy of the distribution it was drawn from
/// (both before truncation: see the module's docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pick {
    /// The token.
    pub token: u32,
    /// Its log-prob.
    pub logprob: f32,
    /// The distribution's entropy (nats).
    pub entropy: f32,
}

/// Picks a token from `logits`.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut ChaCha8Rng) -> Pick {
    let greedy = p.temperature == 0.0;
    let t = if greedy { 1.0 } else { p.temperature };
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f32> = logits.iter().map(|&z| ((z - max) / t).exp()).collect();
    let sum: f32 = probs.iter().sum();
    let logp = |i: usize| (logits[i] - max) / t - sum.ln();
    // H = ln Σe^s − Σ e^s·s / Σe^s, with s = (z − max)/t.
    let weighted: f32 = probs
        .iter()
        .zip(logits)
        .map(|(&q, &z)| q * ((z - max) / t))
        .sum();
    let entropy = (sum.ln() - weighted / sum).max(0.0);
    let pick = |i: usize| Pick {
        token: i as u32,
        logprob: logp(i),
        entropy,
    };
    if greedy {
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        return pick(best);
    }
    let truncate = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0;
    let chosen = if !truncate {
        let mut u = uniform(rng) as f32 * sum;
        let mut pick = probs.len() - 1;
        for (i, &q) in probs.iter().enumerate() {
            if u < q {
                pick = i;
                break;
            }
            u -= q;
        }
        pick
    } else {
        let mut idx: Vec<usize> = (0..probs.len()).collect();
        idx.sort_unstable_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let mut keep = idx.len();
        if p.top_k > 0 {
            keep = keep.min(p.top_k);
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[idx[0]];
            keep = keep.min(
                idx.iter()
                    .take_while(|&&i| probs[i] >= floor)
                    .count()
                    .max(1),
            );
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut k = 0;
            for &i in &idx[..keep] {
                acc += probs[i] / sum;
                k += 1;
                if acc >= p.top_p {
                    break;
                }
            }
            keep = k;
        }
        let kept = &idx[..keep];
        let total: f32 = kept.iter().map(|&i| probs[i]).sum();
        let mut u = uniform(rng) as f32 * total;
        let mut pick = kept[keep - 1];
        for &i in kept {
            if u < probs[i] {
                pick = i;
                break;
            }
            u -= probs[i];
        }
        pick
    };
    pick(chosen)
}

/// `log_softmax(logits)[token]`: the log-prob before temperature and truncation (vLLM's
/// `raw_logprobs`, which a server may report instead of the sampled distribution's).
pub fn raw_logprob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&z| (z - max).exp()).sum();
    logits[token as usize] - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn greedy_picks_the_argmax_with_its_untempered_logprob() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let s = sample(&[0.0, 2.0, 1.0], &params(|p| p.temperature = 0.0), &mut rng);
        assert_eq!(s.token, 1);
        let want = 2.0 - (1.0f32 + 2f32.exp() + 1f32.exp()).ln();
        assert!((s.logprob - want).abs() < 1e-6);
    }

    #[test]
    fn truncation_limits_the_support_but_not_the_logprob() {
        let logits = [3.0, 2.9, 0.0, -1.0];
        for f in [
            (|p: &mut SamplingParams| p.top_k = 2) as fn(&mut SamplingParams),
            |p| p.top_p = 0.6,
            |p| p.min_p = 0.5,
        ] {
            let p = params(f);
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            for _ in 0..200 {
                let s = sample(&logits, &p, &mut rng);
                assert!(s.token < 2, "{p:?} sampled {}", s.token);
                let z: f32 = logits.iter().map(|v| v.exp()).sum();
                assert!((s.logprob - (logits[s.token as usize] - z.ln())).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn temperature_sharpens_and_frequencies_follow_probabilities() {
        let logits = [0.0, 1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let p = params(|p| p.temperature = 0.5);
        let ones = (0..4000)
            .filter(|_| sample(&logits, &p, &mut rng).token == 1)
            .count();
        let want = 1.0 / (1.0 + (-2.0f64).exp()); // softmax([0, 2])[1]
        assert!((ones as f64 / 4000.0 - want).abs() < 0.03, "{ones}");
    }

    /// The entropy is the untruncated distribution's at the sampling temperature (greedy: at
    /// 1), against `−Σ p·ln p` in f64.
    #[test]
    fn the_entropy_is_the_sampled_distributions() {
        let logits = [3.0f32, 2.9, 0.0, -1.0, -30.0];
        for (t, f) in [
            (
                1.0,
                (|_: &mut SamplingParams| ()) as fn(&mut SamplingParams),
            ),
            (0.7, |p| p.temperature = 0.7),
            (1.0, |p| p.temperature = 0.0),
            (1.0, |p| p.top_k = 1),
            (2.5, |p| {
                p.temperature = 2.5;
                p.top_p = 0.5;
            }),
        ] {
            let p = params(f);
            let z: Vec<f64> = logits.iter().map(|&v| f64::from(v) / t).collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            let want: f64 = z.iter().map(|v| -(v - lse).exp() * (v - lse)).sum();
            let got = sample(&logits, &p, &mut ChaCha8Rng::seed_from_u64(3)).entropy;
            assert!(
                (f64::from(got) - want).abs() < 1e-5,
                "{p:?}: {got} vs {want}"
            );
        }
        // One certain token: no uncertainty (not a rounding below 0).
        let sure = sample(
            &[0.0, -200.0],
            &params(|_| ()),
            &mut ChaCha8Rng::seed_from_u64(4),
        );
        assert_eq!(sure.entropy, 0.0);
    }

    #[test]
    fn invalid_settings_are_named() {
        assert!(
            params(|p| p.max_tokens = 0)
                .validate()
                .unwrap_err()
                .contains("max_tokens")
        );
        assert!(
            params(|p| p.n = 0)
                .validate()
                .unwrap_err()
                .contains("n must")
        );
        assert!(
            params(|p| p.top_p = 0.0)
                .validate()
                .unwrap_err()
                .contains("top_p")
        );
        assert!(
            params(|p| p.temperature = -1.0)
                .validate()
                .unwrap_err()
                .contains("temperature")
        );
    }
}
