//! One RL step, walked through its step graph: level by level, the nodes of a level that only
//! read the step's artifacts run concurrently on scoped threads, the ones that change models or
//! engines one at a time. A node's writes go to the [`Board`] by [`Artifact`], the vocabulary
//! the graph was checked in, and a node may write only what the graph says it writes.

use super::board::{Board, Pending, StepCx};
use super::data_metrics::data_metrics;
use super::eval::write_step_lines;
use super::nodes::{self, Runnable};
use super::{ExecError, Executor};
use crate::plan::{Artifact, RlPlan, StagePlan};
use crate::roles::{Critic, Reference};
use learner::rl::Metrics;
use rollout::FinishReason;
use std::collections::VecDeque;
use std::time::Instant;

/// What an RL stage keeps from step to step.
pub(crate) struct RlStage<'a> {
    nodes: Vec<Runnable>,
    pub reference: Option<Box<dyn Reference>>,
    pub critic: Option<Box<dyn Critic>>,
    pub queue: VecDeque<Pending>,
    plan: &'a RlPlan,
}

impl<'a> RlStage<'a> {
    pub fn new(
        plan: &'a RlPlan,
        reference: Option<Box<dyn Reference>>,
        critic: Option<Box<dyn Critic>>,
    ) -> Self {
        let nodes = plan
            .graph
            .graph
            .node_indices()
            .map(|n| nodes::build(&plan.graph.graph[n].op))
            .collect();
        Self {
            nodes,
            reference,
            critic,
            queue: VecDeque::new(),
            plan,
        }
    }
}

/// VeRL's timer name of a node.
fn timer(name: &str) -> String {
    let verl = match name {
        "generate" => "gen",
        "old_logp" => "old_log_prob",
        "ref_logp" => "ref",
        "advantage" => "adv",
        "sync_weights" => "update_weights",
        other => other,
    };
    format!("timing_s/{verl}")
}

impl<'a> Executor<'a> {
    /// Runs RL step `step` of `stage` through its graph; returns the step's metrics.
    pub(super) fn rl_step(
        &mut self,
        stage: &'a StagePlan,
        plan: &'a RlPlan,
        st: &mut RlStage<'a>,
        step: u64,
    ) -> Result<Metrics, ExecError> {
        let t0 = Instant::now();
        let mut board = Board::default();
        let graph = &st.plan.graph;
        let mut version = self.version;
        let seed = self.job.plan.seed;
        let mut cx = StepCx {
            seed,
            stage,
            rl: plan,
            step,
            prompts: &self.prompts,
            policy: &mut *self.roles.policy,
            rollouts: &self.roles.rollouts,
            reference: st.reference.as_deref(),
            critic: st.critic.as_deref_mut(),
            queue: &mut st.queue,
            version: &mut version,
        };
        for level in &graph.levels {
            // Read-only nodes of the level run concurrently.
            let pure: Vec<_> = level
                .iter()
                .filter(|&&n| matches!(st.nodes[n.index()], Runnable::Compute(_)))
                .copied()
                .collect();
            if !pure.is_empty() && !board.groups.is_empty() {
                let (shared, bref) = (&cx, &board);
                let results: Vec<_> = std::thread::scope(|s| {
                    let handles: Vec<_> = pure
                        .iter()
                        .map(|&n| {
                            let Runnable::Compute(node) = &st.nodes[n.index()] else {
                                unreachable!("filtered to compute nodes")
                            };
                            s.spawn(move || {
                                let t = Instant::now();
                                let r = node.compute(shared, bref);
                                (n, r, t.elapsed().as_secs_f64())
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| {
                            h.join()
                                .map_err(|_| ExecError::Internal("a step node panicked".into()))
                        })
                        .collect::<Vec<_>>()
                });
                for r in results {
                    let (n, update, secs) = r?;
                    let node = &graph.graph[n];
                    board.apply(node, update?)?;
                    board.metrics.insert(timer(&node.name), secs);
                }
            }
            for &n in level {
                let Runnable::Act(node) = &st.nodes[n.index()] else {
                    continue;
                };
                let spec = &graph.graph[n];
                if board.groups.is_empty() && !spec.writes.contains(&Artifact::Rollouts) {
                    continue;
                }
                let t = Instant::now();
                let update = node.act(&mut cx, &board)?;
                board.apply(spec, update)?;
                board
                    .metrics
                    .insert(timer(&spec.name), t.elapsed().as_secs_f64());
            }
        }
        self.version = version;
        let rows = board.rows();
        let mut m = board.metrics;
        if board.groups.is_empty() {
            // No group carried signal (or all were dropped): nothing to learn from this step.
            m.insert("actor/skipped_update".into(), 1.0);
            return Ok(m);
        }
        let n = rows.shape.rows as f64;
        let scores: Vec<f32> = board
            .groups
            .iter()
            .flat_map(|g| g.scores.iter().copied())
            .collect();
        let total = t0.elapsed().as_secs_f64();
        m.extend(data_metrics(
            &rows,
            &scores,
            board.advantages.as_deref(),
            board.returns.as_deref(),
            board.values.as_deref(),
        ));
        let clipped = board
            .groups
            .iter()
            .flat_map(|g| &g.completions)
            .filter(|c| c.finish_reason == FinishReason::Length)
            .count();
        m.insert("response_length/clip_ratio".into(), clipped as f64 / n);
        m.insert("timing_s/step".into(), total);
        // VeRL's meaning: every token of the batch (prompts and responses) a second, per
        // training device (one here).
        let all_tokens: f64 = rows.seqs.iter().map(|(_, s)| s.len() as f64).sum();
        m.insert("perf/total_num_tokens".into(), all_tokens);
        m.insert("perf/time_per_step".into(), total);
        m.insert("perf/throughput".into(), all_tokens / total);
        m.insert("weight_version".into(), self.version as f64);
        let locations = self.roles.rollouts.locations();
        m.insert("rollout/engines".into(), locations.len() as f64);
        m.insert(
            "rollout/engines_down".into(),
            self.roles.rollouts.down_count() as f64,
        );
        if stage.log_rollouts {
            let samples: Vec<RolloutSample<'_>> = board
                .groups
                .iter()
                .flat_map(|g| {
                    g.completions.iter().zip(&g.texts).zip(&g.scores).map(
                        move |((c, text), &score)| RolloutSample {
                            step,
                            index: g.index,
                            prompt: g.problem.prompt.display(),
                            response: text,
                            answer: &g.problem.answer,
                            score,
                            weight_version: c.weight_versions.iter().map(|s| s.version).min(),
                        },
                    )
                })
                .collect();
            write_step_lines(self.job.dir, "rollouts", &stage.id, step, &samples)?;
        }
        Ok(m)
    }
}

/// One trained sample, as `rollouts/<stage>/step_<N>.jsonl` holds it (VeRL's
/// `trainer.rollout_data_dir`).
#[derive(serde::Serialize)]
struct RolloutSample<'a> {
    step: u64,
    /// The prompt's position in the stage's stream of prompts.
    index: u64,
    prompt: &'a str,
    response: &'a str,
    answer: &'a str,
    score: f32,
    /// The oldest weight version among its tokens.
    weight_version: Option<u64>,
}
