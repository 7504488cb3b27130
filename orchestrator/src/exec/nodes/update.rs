//! `update_critic` and `update_actor`: the learner's updates over the step's rollouts.

use super::{Act, Board, ExecError, StepCx, Update};
use crate::exec::board::Write;
use crate::plan::Artifact;
use learner::algo::policy::PolicyBatch;

pub(crate) struct UpdateCritic;

impl Act for UpdateCritic {
    fn act(&self, cx: &mut StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let plan = cx.rl.critic.ok_or_else(|| {
            ExecError::Internal("update_critic in a stage without a critic".into())
        })?;
        let critic = cx
            .critic
            .as_deref_mut()
            .ok_or_else(|| ExecError::Internal("update_critic without a critic".into()))?;
        let (Some(old), Some(ret)) = (&board.values, &board.returns) else {
            return Err(ExecError::Internal(
                "update_critic needs values and returns".into(),
            ));
        };
        let metrics = critic.update(&board.rows(), old, ret, &plan.update)?;
        Ok(Update {
            writes: vec![Write::Effect(&[Artifact::Critic])],
            metrics,
        })
    }
}

pub(crate) struct UpdateActor;

impl Act for UpdateActor {
    fn act(&self, cx: &mut StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let rows = board.rows();
        let advantages = board
            .advantages
            .as_deref()
            .ok_or_else(|| ExecError::Internal("update_actor needs advantages".into()))?;
        // Behaviour log-probs: recomputed (`old_logp` node), the engine's (`async` mode), or
        // none (one update per batch: the current log-probs, detached).
        let old = board.old_logp(&rows);
        // The engines' entropies spare an on-policy update the forward of rows it does not
        // train (their sampling temperature is the update's: both are the algorithm's).
        let entropy = old.is_none().then(|| board.engine_entropy(&rows)).flatten();
        let batch = PolicyBatch {
            rows: &rows,
            advantages,
            old_logp: old.as_deref(),
            ref_logp: board.ref_logp.as_deref(),
            entropy: entropy.as_deref(),
        };
        let metrics = cx.policy.update(batch, &cx.rl.update)?;
        Ok(Update {
            writes: vec![Write::Effect(&[Artifact::Actor, Artifact::NewWeights])],
            metrics,
        })
    }
}
