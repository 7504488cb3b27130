//! A workflow's `filter` node: drops whole prompt groups before the advantages (scores that
//! carry no group-relative signal, or a response cut at the budget).

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::Write;
use crate::plan::FilterPlan;
use rollout::FinishReason;
use std::sync::Arc;

pub(crate) struct Filter(pub Arc<FilterPlan>);

impl Compute for Filter {
    fn compute(&self, _cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let f = &self.0;
        let keep: Vec<bool> = board
            .groups
            .iter()
            .map(|g| {
                let n = g.scores.len().max(1) as f64;
                let mean = g.scores.iter().map(|&s| s as f64).sum::<f64>() / n;
                let var = g
                    .scores
                    .iter()
                    .map(|&s| (s as f64 - mean).powi(2))
                    .sum::<f64>()
                    / n;
                let truncated = g
                    .completions
                    .iter()
                    .any(|c| c.finish_reason == FinishReason::Length);
                var.sqrt() >= f.min_group_std && !(f.drop_truncated && truncated)
            })
            .collect();
        let dropped = keep.iter().filter(|k| !**k).count();
        let mut u = Update::write(Write::Keep(keep));
        u.metrics
            .insert(format!("filter/{}/dropped_groups", f.name), dropped as f64);
        Ok(u)
    }
}
