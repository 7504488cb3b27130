//! `advantage`: per-token advantages (and the critic's returns) from the scores — placed on each
//! response's last token, an episode's turn rewards on the turns they answered —, and the
//! values when the estimator has a critic.

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::{Group, Write};
use learner::rl::Shape;
use learner::rl::advantage::{AdvInput, compute};

pub(crate) struct Advantage;

impl Compute for Advantage {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let rows = board.rows();
        let token_rewards = token_rewards(rows.shape, &board.groups);
        let adv = compute(
            cx.rl.estimator,
            AdvInput {
                shape: rows.shape,
                token_rewards: &token_rewards,
                mask: &rows.mask,
                group: &rows.group,
                values: board.values.as_deref(),
                baseline_scores: None,
            },
        )?;
        Ok(Update::write(Write::Advantages {
            advantages: adv.advantages,
            returns: adv.returns,
        }))
    }
}

/// The `[rows, cols]` rewards of `groups`' responses: an episode's turn rewards on the last
/// token of the turn each answered, and the rest of each score (all of it, for a response that
/// is no episode) on its last token; every row sums to its score.
fn token_rewards(shape: Shape, groups: &[Group]) -> Vec<f32> {
    let cols = shape.cols;
    let mut out = vec![0.0f32; shape.len()];
    let mut r = 0;
    for g in groups {
        for (c, &s) in g.completions.iter().zip(&g.scores) {
            let row = &mut out[r * cols..(r + 1) * cols];
            let last = c.token_ids.len().saturating_sub(1);
            let mut placed = 0.0;
            for &(i, w) in c.episode.iter().flat_map(|e| &e.turn_rewards) {
                if i < last {
                    row[i] += w;
                    placed += w;
                }
            }
            row[last] += s - placed;
            r += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollout::episode::EpisodeStats;
    use rollout::task::Problem;
    use rollout::{Completion, FinishReason};

    fn completion(tokens: usize, turn_rewards: Option<Vec<(usize, f32)>>) -> Completion {
        Completion {
            request: 0,
            index: 0,
            token_ids: vec![3; tokens],
            logprobs: vec![0.0; tokens],
            entropies: Vec::new(),
            finish_reason: FinishReason::Stop,
            weight_versions: Vec::new(),
            observations: Vec::new(),
            prompt: None,
            cached_tokens: 0,
            episode: turn_rewards.map(|turn_rewards| EpisodeStats {
                turn_rewards,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn turn_rewards_sit_on_their_turns_and_rows_sum_to_their_scores() {
        let group = Group {
            index: 0,
            problem: Problem::new("q", "a"),
            prompt: vec![1],
            // A plain response; an episode rewarded 0.5 after its first turn (tokens 0..2) and
            // 1 at its end, scored 1.5 - 0.25 (an overlong penalty); an episode whose only
            // reward is its last turn's.
            completions: vec![
                completion(2, None),
                completion(5, Some(vec![(1, 0.5), (4, 1.0)])),
                completion(3, Some(vec![(2, 1.0)])),
            ],
            texts: Vec::new(),
            scores: vec![1.0, 1.25, 1.0],
        };
        let shape = Shape { rows: 3, cols: 5 };
        let got = token_rewards(shape, &[group]);
        #[rustfmt::skip]
        assert_eq!(got, [
            0.0, 1.0, 0.0, 0.0, 0.0,
            0.0, 0.5, 0.0, 0.0, 0.75,
            0.0, 0.0, 1.0, 0.0, 0.0,
        ]);
    }
}
