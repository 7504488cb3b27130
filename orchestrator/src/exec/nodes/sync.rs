//! `sync_weights`: the policy's new weights to the rollout engines, as the next version.

use super::super::stage::push_weights;
use super::{Act, Board, ExecError, StepCx, Update};
use crate::exec::step::Write;
use crate::plan::Artifact;

pub(crate) struct SyncWeights;

impl Act for SyncWeights {
    fn act(&self, cx: &mut StepCx<'_, '_>, _board: &Board) -> Result<Update, ExecError> {
        push_weights(&mut *cx.policy, &**cx.rollouts, cx.version)?;
        Ok(Update::write(Write::Effect(&[Artifact::Engine])))
    }
}
