//! `reward`: the stage's reward of every response, with DAPO's overlong shaping.

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::Write;
use learner::rl::dapo::overlong_penalty;

pub(crate) struct Reward;

impl Compute for Reward {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let scores = board
            .groups
            .iter()
            .map(|g| {
                g.texts
                    .iter()
                    .zip(&g.completions)
                    .map(|(t, c)| {
                        let mut s = cx.stage.reward.score(t, &g.problem.answer);
                        if let Some(o) = cx.rl.overlong {
                            s += overlong_penalty(
                                c.token_ids.len(),
                                cx.rl.sampling.max_tokens,
                                o.buffer,
                                o.factor,
                            ) as f32;
                        }
                        s
                    })
                    .collect()
            })
            .collect();
        Ok(Update::write(Write::Scores(scores)))
    }
}
