//! One RL step, walked through its step graph: level by level, the nodes of a level that only
//! read the step's artifacts run concurrently on scoped threads, the ones that change models or
//! engines one at a time. A node's writes go to the [`Board`] by [`Artifact`], the vocabulary
//! the graph was checked in, and a node may write only what the graph says it writes.

use super::nodes::{self, Runnable};
use super::stage::Executor;
use super::{ExecError, Prompts};
use crate::plan::{Artifact, RlPlan, StagePlan};
use crate::roles::{Critic, Policy, Reference, Rollouts};
use learner::algo::TokenRows;
use learner::algo::layout::Row;
use learner::rl::Metrics;
use rollout::task::Problem;
use rollout::{Completion, FinishReason};
use std::collections::VecDeque;
use std::time::Instant;

/// One prompt and its sampled responses.
#[derive(Clone, Debug)]
pub(crate) struct Group {
    pub problem: Problem,
    pub prompt: Vec<u32>,
    pub completions: Vec<Completion>,
    /// Decoded responses.
    pub texts: Vec<String>,
    /// One score per response (after `reward`).
    pub scores: Vec<f32>,
}

/// The behaviour policy's log-probs.
#[derive(Clone, Debug)]
pub(crate) enum OldLogp {
    /// Recomputed by the `old_logp` node (`[rows, cols]`).
    Recomputed(Vec<f32>),
    /// The engines' own, carried by the rollouts (`async` mode).
    FromRollouts,
}

/// A step's artifacts.
#[derive(Default)]
pub(crate) struct Board {
    pub groups: Vec<Group>,
    pub old_logp: Option<OldLogp>,
    pub ref_logp: Option<Vec<f32>>,
    pub values: Option<Vec<f32>>,
    pub advantages: Option<Vec<f32>>,
    pub returns: Option<Vec<f32>>,
    pub metrics: Metrics,
}

/// What a node writes.
pub(crate) enum Write {
    /// New rollouts (and the engines' log-probs with them, in `async` mode).
    Rollouts(Vec<Group>, Option<OldLogp>),
    /// Which groups stay.
    Keep(Vec<bool>),
    /// New scores per group.
    Scores(Vec<Vec<f32>>),
    OldLogp(Vec<f32>),
    RefLogp(Vec<f32>),
    Values(Vec<f32>),
    Advantages {
        advantages: Vec<f32>,
        returns: Vec<f32>,
    },
    /// Effects on models and engines: nothing on the board changes.
    Effect(&'static [Artifact]),
}

impl Write {
    fn artifacts(&self) -> &'static [Artifact] {
        use Artifact::*;
        match self {
            Write::Rollouts(_, None) => &[Rollouts],
            Write::Rollouts(_, Some(_)) => &[Rollouts, OldLogp],
            Write::Keep(_) => &[Rollouts, Scores],
            Write::Scores(_) => &[Scores],
            Write::OldLogp(_) => &[OldLogp],
            Write::RefLogp(_) => &[RefLogp],
            Write::Values(_) => &[Values],
            Write::Advantages { .. } => &[Advantages, Returns],
            Write::Effect(a) => a,
        }
    }
}

/// What a node did: its writes and its metrics.
#[derive(Default)]
pub(crate) struct Update {
    pub writes: Vec<Write>,
    pub metrics: Metrics,
}

impl Update {
    pub fn write(w: Write) -> Self {
        Self {
            writes: vec![w],
            metrics: Metrics::new(),
        }
    }
}

impl Board {
    /// The `[rows, cols]` layout of the groups' responses.
    pub fn rows(&self) -> TokenRows {
        TokenRows::new(self.groups.iter().enumerate().flat_map(|(g, grp)| {
            grp.completions.iter().map(move |c| Row {
                prompt: &grp.prompt,
                response: &c.token_ids,
                group: g as u64,
            })
        }))
    }

    /// The behaviour log-probs in the `[rows, cols]` layout of `rows`, if the step has them.
    pub fn old_logp(&self, rows: &TokenRows) -> Option<Vec<f32>> {
        match &self.old_logp {
            Some(OldLogp::Recomputed(v)) => Some(v.clone()),
            Some(OldLogp::FromRollouts) => Some(
                rows.scatter(
                    self.groups
                        .iter()
                        .flat_map(|g| g.completions.iter().map(|c| c.logprobs.as_slice())),
                ),
            ),
            None => None,
        }
    }

    /// Applies `node`'s update, refusing a write the graph does not give it.
    fn apply(&mut self, node: &crate::plan::graph::Node, update: Update) -> Result<(), ExecError> {
        for w in update.writes {
            if let Some(a) = w.artifacts().iter().find(|a| !node.writes.contains(a)) {
                return Err(ExecError::Internal(format!(
                    "node `{}` wrote `{a}`, which its graph node does not write",
                    node.name
                )));
            }
            match w {
                Write::Rollouts(groups, old) => {
                    self.groups = groups;
                    self.old_logp = old;
                }
                Write::Keep(keep) => {
                    let mut it = keep.into_iter();
                    self.groups.retain(|_| it.next().unwrap_or(false));
                }
                Write::Scores(s) => {
                    for (g, s) in self.groups.iter_mut().zip(s) {
                        g.scores = s;
                    }
                }
                Write::OldLogp(v) => self.old_logp = Some(OldLogp::Recomputed(v)),
                Write::RefLogp(v) => self.ref_logp = Some(v),
                Write::Values(v) => self.values = Some(v),
                Write::Advantages {
                    advantages,
                    returns,
                } => {
                    self.advantages = Some(advantages);
                    self.returns = Some(returns);
                }
                Write::Effect(_) => {}
            }
        }
        self.metrics.extend(update.metrics);
        Ok(())
    }
}

/// A generation running ahead (`async` mode).
pub(crate) struct Pending {
    pub step: u64,
    pub problems: Vec<Problem>,
    pub reqs: Vec<rollout::GenerateRequest>,
    pub handle: std::thread::JoinHandle<Result<Vec<Completion>, crate::roles::RoleError>>,
}

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

/// What a node sees of the job.
pub(crate) struct StepCx<'s, 'a> {
    pub seed: u64,
    pub stage: &'a StagePlan,
    pub rl: &'a RlPlan,
    pub step: u64,
    pub prompts: &'s Prompts<'a>,
    pub policy: &'s mut dyn Policy,
    pub rollouts: &'s std::sync::Arc<dyn Rollouts>,
    pub reference: Option<&'s dyn Reference>,
    pub critic: Option<&'s mut (dyn Critic + 'static)>,
    pub queue: &'s mut VecDeque<Pending>,
    /// The weight version the engines serve (a weight sync advances it).
    pub version: &'s mut u64,
}

/// VeRL's timer name of a node.
fn timer(name: &str) -> String {
    let verl = match name {
        "generate" => "gen",
        "old_logp" => "old_log_prob",
        "ref_logp" => "ref",
        "advantage" => "adv",
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
        let scores: f64 = board
            .groups
            .iter()
            .flat_map(|g| &g.scores)
            .map(|&s| s as f64)
            .sum();
        let resp_tokens = rows.response_tokens();
        let total = t0.elapsed().as_secs_f64();
        m.insert("critic/score/mean".into(), scores / n);
        m.insert("response_length/mean".into(), resp_tokens / n);
        let clipped = board
            .groups
            .iter()
            .flat_map(|g| &g.completions)
            .filter(|c| c.finish_reason == FinishReason::Length)
            .count();
        m.insert("response_length/clip_ratio".into(), clipped as f64 / n);
        if let Some(v) = &board.values {
            let vs: f64 = v.iter().zip(&rows.mask).map(|(v, k)| (v * k) as f64).sum();
            m.insert("critic/values/mean".into(), vs / resp_tokens.max(1.0));
        }
        m.insert("timing_s/step".into(), total);
        m.insert("perf/throughput".into(), resp_tokens / total);
        m.insert("weight_version".into(), self.version as f64);
        let locations = self.roles.rollouts.locations();
        m.insert("rollout/engines".into(), locations.len() as f64);
        m.insert(
            "rollout/engines_down".into(),
            self.roles.rollouts.down_count() as f64,
        );
        Ok(m)
    }
}
