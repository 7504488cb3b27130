//! Greedy evaluation on a stage's held-out problems.

use super::{ExecError, Prompts};
use crate::plan::StagePlan;
use crate::roles::Rollouts;
use rollout::{GenerateRequest, SamplingParams};

/// Greedy accuracy (full marks and an answer that ended) and mean reward on `stage`'s held-out
/// problems.
pub(super) fn evaluate(
    stage: &StagePlan,
    prompts: &Prompts<'_>,
    rollouts: &dyn Rollouts,
) -> Result<(f64, f64), ExecError> {
    let set = &stage.data.eval_set;
    let mut reqs = Vec::with_capacity(set.len());
    for p in set {
        let (prompt, _) = prompts.encode(p, stage.data.chat_template)?;
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens: stage.eval_tokens,
            ..Default::default()
        };
        reqs.push(GenerateRequest { prompt, params });
    }
    let out = rollouts.generate(reqs)?;
    let mut correct = 0.0;
    let mut total = 0.0;
    for c in &out {
        let text = prompts.decode(&c.token_ids)?;
        let s = stage.reward.score(&text, &set[c.request].answer) as f64;
        total += s;
        // Correct: full marks, and the answer ended (not cut at the token budget).
        if s >= 1.0 && c.token_ids.last() == Some(&prompts.eos) {
            correct += 1.0;
        }
    }
    let n = set.len().max(1) as f64;
    Ok((correct / n, total / n))
}
