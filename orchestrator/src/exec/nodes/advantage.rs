//! `advantage`: per-token advantages (and the critic's returns) from the scores, placed on each
//! response's last token, and the values when the estimator has a critic.

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::Write;
use learner::rl::advantage::{AdvInput, compute};

pub(crate) struct Advantage;

impl Compute for Advantage {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let rows = board.rows();
        let cols = rows.shape.cols;
        let mut token_rewards = vec![0.0f32; rows.shape.len()];
        let mut r = 0;
        for g in &board.groups {
            for (c, &s) in g.completions.iter().zip(&g.scores) {
                token_rewards[r * cols + c.token_ids.len() - 1] = s;
                r += 1;
            }
        }
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
