//! A step's artifacts and what nodes see: the [`Board`] (the groups of prompts and responses,
//! log-probs, values, advantages) keyed by the graph's [`Artifact`]s, the [`Write`]s a node
//! makes, and the [`StepCx`] of roles and settings a node runs with.

use super::ExecError;
use crate::plan::Prompts;
use crate::plan::{Artifact, RlPlan, StagePlan};
use crate::roles::{Critic, Policy, Reference, Rollouts};
use learner::algo::TokenRows;
use learner::algo::layout::Row;
use learner::rl::Metrics;
use rollout::Completion;
use rollout::task::Problem;
use std::collections::VecDeque;
use std::time::Instant;

/// One prompt and its sampled responses.
#[derive(Clone, Debug)]
pub(crate) struct Group {
    /// The problem's position in the stage's stream of prompts (the data position: step
    /// `s`'s prompts are a pure function of `s`, so a resumed run draws the same ones).
    pub index: u64,
    pub problem: Problem,
    pub prompt: Vec<u32>,
    pub completions: Vec<Completion>,
    /// Decoded responses.
    pub texts: Vec<String>,
    /// One score per response (after `reward`).
    pub scores: Vec<f32>,
}

/// The scores of `completions`, whose texts and problems `items` holds in the same order: on a
/// stage whose episodes score themselves, each episode's own; otherwise the stage's reward's
/// (an agent program's transcripts, where its stage names a reward).
pub(crate) fn score<'c>(
    stage: &StagePlan,
    completions: impl IntoIterator<Item = &'c Completion>,
    items: &[rollout::reward::Item<'_>],
) -> Result<rollout::reward::Scored, ExecError> {
    let episodes: Vec<Option<&rollout::episode::EpisodeStats>> = completions
        .into_iter()
        .map(|c| c.episode.as_ref())
        .collect();
    if stage.scores_episodes
        && let Some(scores) = episodes
            .iter()
            .map(|e| e.map(|e| e.reward))
            .collect::<Option<Vec<f32>>>()
    {
        return Ok(rollout::reward::Scored { scores, failed: 0 });
    }
    let mut scored = stage.reward.score_all(items)?;
    // A failed episode's transcript scores nothing.
    for (s, e) in scored.scores.iter_mut().zip(&episodes) {
        if e.is_some_and(|e| e.failed.is_some()) {
            *s = 0.0;
        }
    }
    Ok(scored)
}

/// `out` with only the last trajectory of every episode (an agent program that rewrote its
/// history made several; its final transcript is the last).
pub(crate) fn finals(out: Vec<Completion>) -> Vec<Completion> {
    let mut finals: Vec<Completion> = Vec::with_capacity(out.len());
    for c in out {
        match finals.last_mut() {
            Some(last) if (last.request, last.index) == (c.request, c.index) => *last = c,
            _ => finals.push(c),
        }
    }
    finals
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
                prompt: c.prompt.as_deref().unwrap_or(&grp.prompt),
                response: &c.token_ids,
                group: g as u64,
                observed: &c.observations,
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

    /// The engines' entropies of every response token's sampling distribution in the
    /// `[rows, cols]` layout of `rows`, if every completion has them.
    pub fn engine_entropy(&self, rows: &TokenRows) -> Option<Vec<f32>> {
        let completions = self.groups.iter().flat_map(|g| g.completions.iter());
        completions
            .clone()
            .all(|c| c.entropies.len() == c.token_ids.len())
            .then(|| rows.scatter(completions.map(|c| c.entropies.as_slice())))
    }

    /// Applies `node`'s update, refusing a write the graph does not give it.
    pub(super) fn apply(
        &mut self,
        node: &crate::plan::graph::Node,
        update: Update,
    ) -> Result<(), ExecError> {
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
    pub problems: Vec<(u64, Problem)>,
    pub reqs: Vec<rollout::GenerateRequest>,
    pub handle: std::thread::JoinHandle<Result<Vec<Completion>, crate::roles::RoleError>>,
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

/// The policy's weights to the rollout engines as the next version (`version` advances):
/// engines on agents read them from the learner ranks where the policy has ranks on agents.
/// Returns the seconds it took and its metrics (`perf/weight_sync_from_ranks`: engines that
/// read the weights from the ranks themselves; `perf/weight_sync_beside`: engines that took
/// them, shared, from a rank in their own process; `perf/weight_sync_on_device`: engines that
/// took them on the learner's device, the weights never read to the host).
pub(super) fn push_weights(
    policy: &mut dyn Policy,
    rollouts: &dyn Rollouts,
    version: &mut u64,
) -> Result<(f64, Metrics), ExecError> {
    let t = Instant::now();
    *version += 1;
    let snapshot = policy.snapshot(*version)?;
    // Clones share the host copy: whether anyone read it shows once the engines have them.
    let on_device = snapshot.device().is_some().then(|| snapshot.clone());
    let pulls = rollouts.update_weights(snapshot, policy.weight_source())?;
    let mut metrics = Metrics::new();
    if let Some(s) = on_device
        && !s.on_host()
    {
        let engines = rollouts.locations().len() - rollouts.down_count();
        metrics.insert("perf/weight_sync_on_device".into(), engines as f64);
    }
    if pulls.from_ranks > 0 {
        metrics.insert(
            "perf/weight_sync_from_ranks".into(),
            pulls.from_ranks as f64,
        );
    }
    if pulls.beside > 0 {
        metrics.insert("perf/weight_sync_beside".into(), pulls.beside as f64);
    }
    Ok((t.elapsed().as_secs_f64(), metrics))
}
