//! The step graph's node kinds, one file each, and [`build`], the one place that maps a
//! graph node's [`Op`] to the code that runs it. A [`Compute`] node only reads the board and the
//! roles (it runs concurrently with the rest of its level); an [`Act`] node changes a model or
//! the engines (it runs alone).

mod advantage;
mod filter;
mod generate;
mod logp;
mod program;
mod reward;
mod sync;
mod update;
mod values;

use super::ExecError;
use super::board::{Board, StepCx, Update};
use crate::plan::Op;

/// A node that reads the board and the roles, and writes only the board.
pub(crate) trait Compute: Send + Sync {
    fn compute(&self, cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError>;
}

/// A node that changes a model or the engines.
pub(crate) trait Act: Send + Sync {
    fn act(&self, cx: &mut StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError>;
}

/// A node ready to run.
pub(crate) enum Runnable {
    Compute(Box<dyn Compute>),
    Act(Box<dyn Act>),
}

/// The code of `op`.
pub(crate) fn build(op: &Op) -> Runnable {
    match op {
        Op::Generate => Runnable::Act(Box::new(generate::Generate)),
        Op::Reward => Runnable::Compute(Box::new(reward::Reward)),
        Op::Program(p) => Runnable::Compute(Box::new(program::Program(p.clone()))),
        Op::Filter(f) => Runnable::Compute(Box::new(filter::Filter(f.clone()))),
        Op::OldLogp => Runnable::Compute(Box::new(logp::OldLogp)),
        Op::RefLogp => Runnable::Compute(Box::new(logp::RefLogp)),
        Op::Values => Runnable::Compute(Box::new(values::Values)),
        Op::Advantage => Runnable::Compute(Box::new(advantage::Advantage)),
        Op::UpdateCritic => Runnable::Act(Box::new(update::UpdateCritic)),
        Op::UpdateActor => Runnable::Act(Box::new(update::UpdateActor)),
        Op::SyncWeights => Runnable::Act(Box::new(sync::SyncWeights)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_that_the_graph_runs_alone_are_the_ones_that_act() {
        for op in [
            Op::Generate,
            Op::Reward,
            Op::OldLogp,
            Op::RefLogp,
            Op::Values,
            Op::Advantage,
            Op::UpdateCritic,
            Op::UpdateActor,
            Op::SyncWeights,
        ] {
            let acts = matches!(build(&op), Runnable::Act(_));
            assert_eq!(acts, op.mutates(), "{op:?}");
        }
    }
}
