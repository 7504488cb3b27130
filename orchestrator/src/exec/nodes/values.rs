//! `values`: the critic's value at every response token (GAE).

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::Write;

pub(crate) struct Values;

impl Compute for Values {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let critic = cx
            .critic
            .as_deref()
            .ok_or_else(|| ExecError::Internal("values without a critic".into()))?;
        let v = critic.values(&board.rows(), cx.rl.update.rows_per_update)?;
        Ok(Update::write(Write::Values(v)))
    }
}
