//! `reward`: the stage's reward of every response — an episode's is its environment's —, with
//! DAPO's overlong shaping; a Python reward's failed calls are counted in `reward/failed`.

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::{Write, score};
use learner::rl::dapo::overlong_penalty;
use rollout::reward::Item;

pub(crate) struct Reward;

impl Compute for Reward {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        // Every response of the step at once (a Python reward spreads them over its workers).
        let items: Vec<Item<'_>> = board
            .groups
            .iter()
            .flat_map(|g| g.texts.iter().map(|t| Item::new(t, &g.problem)))
            .collect();
        let completions = board.groups.iter().flat_map(|g| &g.completions);
        let scored = score(cx.stage, completions, &items)?;
        let mut flat = scored.scores.into_iter();
        let scores = board
            .groups
            .iter()
            .map(|g| {
                g.completions
                    .iter()
                    .map(|c| {
                        let mut s = flat.next().unwrap_or(0.0);
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
        let mut update = Update::write(Write::Scores(scores));
        if !cx.stage.scores_episodes
            && matches!(
                cx.stage.reward.reward(),
                rollout::reward::Reward::Python { .. }
            )
        {
            update
                .metrics
                .insert("reward/failed".into(), scored.failed as f64);
        }
        Ok(update)
    }
}
