//! `old_logp` and `ref_logp`: the log-prob of every response token under the policy before
//! its update (several updates per batch), and under the reference policy (the KL loss). The
//! first also measures how far the engines' own log-probs of those tokens are from the
//! learner's (`rollout/logprob_diff_mean`, `_max`): what the importance ratio of an async or
//! engine-log-prob run sees, and the first thing to look at when a bf16 or external engine
//! drifts from the learner.

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::Write;

pub(crate) struct OldLogp;

impl Compute for OldLogp {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let u = &cx.rl.update;
        // The policy's log-probs where it trains, so ratios start at 1 exactly there.
        let rows = board.rows();
        let v = cx.policy.logp(&rows, u.temperature, u.rows_per_update)?;
        let mut update = Update::write(Write::OldLogp(v));
        let completions = board.groups.iter().flat_map(|g| g.completions.iter());
        if completions
            .clone()
            .all(|c| c.logprobs.len() == c.token_ids.len())
        {
            let engine = rows.scatter(completions.map(|c| c.logprobs.as_slice()));
            if let Write::OldLogp(learner) = &update.writes[0] {
                update
                    .metrics
                    .extend(logprob_diff(learner, &engine, &rows.mask));
            }
        }
        Ok(update)
    }
}

/// Mean and largest |learner − engine| log-prob over the response tokens (`mask` 1); none for
/// a batch without response tokens.
fn logprob_diff(learner: &[f32], engine: &[f32], mask: &[f32]) -> Vec<(String, f64)> {
    let (mut sum, mut max, mut n) = (0.0f64, 0.0f64, 0usize);
    for ((&a, &b), &m) in learner.iter().zip(engine).zip(mask) {
        if m > 0.0 {
            let d = (f64::from(a) - f64::from(b)).abs();
            sum += d;
            max = max.max(d);
            n += 1;
        }
    }
    if n == 0 {
        return Vec::new();
    }
    vec![
        ("rollout/logprob_diff_mean".to_string(), sum / n as f64),
        ("rollout/logprob_diff_max".to_string(), max),
    ]
}

pub(crate) struct RefLogp;

impl Compute for RefLogp {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let u = &cx.rl.update;
        let reference = cx
            .reference
            .ok_or_else(|| ExecError::Internal("ref_logp without a reference policy".into()))?;
        let v = reference.logp(&board.rows(), u.temperature, u.rows_per_update)?;
        Ok(Update::write(Write::RefLogp(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::logprob_diff;

    #[test]
    fn the_gap_is_taken_over_response_tokens_only() {
        type Case<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [(&'a str, f64)]);
        let table: [Case<'_>; 3] = [
            (
                &[-1.0, -2.0, 0.0],
                &[-1.5, -2.0, -9.0],
                &[1.0, 1.0, 0.0],
                &[
                    ("rollout/logprob_diff_mean", 0.25),
                    ("rollout/logprob_diff_max", 0.5),
                ],
            ),
            (
                &[-1.0],
                &[-1.0],
                &[1.0],
                &[
                    ("rollout/logprob_diff_mean", 0.0),
                    ("rollout/logprob_diff_max", 0.0),
                ],
            ),
            (&[-1.0], &[-3.0], &[0.0], &[]),
        ];
        for (learner, engine, mask, want) in table {
            let got = logprob_diff(learner, engine, mask);
            let want: Vec<(String, f64)> = want.iter().map(|(k, v)| (k.to_string(), *v)).collect();
            assert_eq!(got, want, "{learner:?} {engine:?} {mask:?}");
        }
    }
}
