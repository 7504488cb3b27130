//! `old_logp` and `ref_logp`: the log-prob of every response token under the policy before
//! its update (several updates per batch), and under the reference policy (the KL loss).

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::Write;

pub(crate) struct OldLogp;

impl Compute for OldLogp {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let u = &cx.rl.update;
        // The policy's log-probs where it trains, so ratios start at 1 exactly there.
        let v = cx
            .policy
            .logp(&board.rows(), u.temperature, u.rows_per_update)?;
        Ok(Update::write(Write::OldLogp(v)))
    }
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
