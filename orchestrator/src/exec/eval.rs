//! Evaluation on a stage's held-out problems — greedy, or sampled at `eval_temperature` —
//! (episodes where the stage has an environment), and the samples it writes out
//! (`trainer.log_generations`); the writer of per-step JSON-lines files (these, and the rollouts
//! of `trainer.log_rollouts`).

use super::{ExecError, Prompts};
use crate::plan::StagePlan;
use crate::roles::Rollouts;
use rollout::SamplingParams;
use rollout::reward::Item;
use serde::Serialize;
use std::path::Path;

/// One evaluated sample, as `generations/<stage>/step_<N>.jsonl` holds it.
#[derive(Debug, Serialize)]
pub(super) struct Sample {
    pub prompt: String,
    pub response: String,
    pub answer: String,
    pub score: f64,
}

/// What an evaluation measured.
pub(super) struct Evaluation {
    /// Full marks with an answer that ended, over the held-out problems.
    pub accuracy: f64,
    /// The mean reward.
    pub reward_mean: f64,
    /// The first `stage.log_generations` samples.
    pub samples: Vec<Sample>,
}

impl Evaluation {
    /// Writes the samples (when there are some) to `run/generations/<stage>/step_<step>.jsonl`.
    pub fn write_samples(&self, run: &Path, stage: &str, step: u64) -> Result<(), ExecError> {
        if self.samples.is_empty() {
            return Ok(());
        }
        write_step_lines(run, "generations", stage, step, &self.samples)
    }
}

/// Writes `rows` as JSON lines to `run/<folder>/<stage>/step_<step>.jsonl`, whole or not at all
/// (a temporary file renamed into place; a step run again replaces its file).
pub(super) fn write_step_lines<T: Serialize>(
    run: &Path,
    folder: &str,
    stage: &str,
    step: u64,
    rows: &[T],
) -> Result<(), ExecError> {
    let dir = run.join(folder).join(stage);
    let mut text = String::new();
    for r in rows {
        text.push_str(&serde_json::to_string(r).unwrap_or_default());
        text.push('\n');
    }
    let file = dir.join(format!("step_{step:06}.jsonl"));
    let tmp = dir.join(format!(".step_{step:06}.jsonl.tmp"));
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&tmp, text))
        .and_then(|()| std::fs::rename(&tmp, &file))
        .map_err(|source| ExecError::Io { path: file, source })
}

/// Accuracy (full marks and an answer that ended; greedy, or sampled at the stage's
/// `eval_temperature`), mean reward and the first samples on
/// `stage`'s held-out problems.
pub(super) fn evaluate(
    stage: &StagePlan,
    prompts: &Prompts<'_>,
    rollouts: &dyn Rollouts,
) -> Result<Evaluation, ExecError> {
    let set = &stage.data.eval_set;
    let mut reqs = Vec::with_capacity(set.len());
    for (i, p) in set.iter().enumerate() {
        let params = SamplingParams {
            temperature: stage.eval_temperature,
            max_tokens: stage.eval_tokens,
            // The same draws at every evaluation: its changes are the policy's.
            seed: Some(0xE7A1_5EED ^ i as u64),
            ..Default::default()
        };
        reqs.push(stage.request(prompts, p, params)?);
    }
    let out = super::board::finals(rollouts.generate(reqs)?);
    let texts = out
        .iter()
        .map(|c| prompts.decode(&c.token_ids))
        .collect::<Result<Vec<_>, _>>()?;
    let items: Vec<Item<'_>> = out
        .iter()
        .zip(&texts)
        .map(|(c, t)| Item::new(t, &set[c.request]))
        .collect();
    let scored = super::board::score(stage, &out, &items)?;
    let mut correct = 0.0;
    let mut total = 0.0;
    let mut samples = Vec::new();
    for ((c, text), s) in out.iter().zip(texts).zip(scored.scores) {
        let problem = &set[c.request];
        let s = f64::from(s);
        total += s;
        // Correct: full marks, and the answer ended (not cut at the token budget); an
        // episode's environment decides when it is over.
        if s >= 1.0 && (c.episode.is_some() || c.token_ids.last() == Some(&prompts.eos)) {
            correct += 1.0;
        }
        if samples.len() < stage.log_generations {
            samples.push(Sample {
                prompt: problem.prompt.display().to_string(),
                response: text,
                answer: problem.answer.clone(),
                score: s,
            });
        }
    }
    let n = set.len().max(1) as f64;
    Ok(Evaluation {
        accuracy: correct / n,
        reward_mean: total / n,
        samples,
    })
}
