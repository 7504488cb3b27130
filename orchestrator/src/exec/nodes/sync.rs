//! `sync_weights`: the policy's new weights to the rollout engines, as the next version.

use super::{Act, Board, ExecError, StepCx, Update};
use crate::exec::board::Write;
use crate::exec::board::push_weights;
use crate::plan::Artifact;

pub(crate) struct SyncWeights;

impl Act for SyncWeights {
    fn act(&self, cx: &mut StepCx<'_, '_>, _board: &Board) -> Result<Update, ExecError> {
        let (_, metrics) = push_weights(&mut *cx.policy, &**cx.rollouts, cx.version)?;
        let mut update = Update::write(Write::Effect(&[Artifact::Engine]));
        update.metrics = metrics;
        Ok(update)
    }
}
