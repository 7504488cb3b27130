//! One RL step, executed from its step graph ([`crate::graph`]): level by level, the nodes of a
//! level that only read the step's artifacts running concurrently on scoped threads, the ones
//! that change models or the engine (generate, updates, weight sync) one at a time. Also the
//! `async` mode's generation queue and the `program` reward runner.
//!
//! Owns: the step's artifacts (the board) and what each node computes. Never: decides the order
//! of nodes (the graph does) or writes run files (the runner in [`crate::train`] does).

use crate::graph::{Op, StepGraph};
use crate::train::{Run, RunError};
use crate::workflow::{FilterNode, ProgramNode, Source, Stage, UserNode};
use learner::algo::layout::{Row, TokenRows};
use learner::critic::Critic;
use learner::optim::{LrSchedule, Optimizer};
use learner::rl::Metrics;
use learner::rl::advantage::{AdvEstimator, AdvInput, compute};
use learner::rl::dapo::{keep_informative_groups, overlong_penalty};
use learner::rl::loss::{PolicyLoss, PolicyLossConfig};
use learner::{Batch, Model};
use rollout::task::Problem;
use rollout::{Completion, FinishReason, GenerateRequest, SamplingParams};
use std::collections::{HashSet, VecDeque};
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One prompt and its sampled responses.
#[derive(Clone, Debug)]
pub(crate) struct Group {
    problem: Problem,
    prompt: Vec<u32>,
    completions: Vec<Completion>,
    /// Decoded responses.
    texts: Vec<String>,
    /// One score per response (after `reward`).
    scores: Vec<f32>,
}

/// The `[rows, cols]` response layout of a step's groups.
fn rows_of(groups: &[Group]) -> TokenRows {
    TokenRows::new(groups.iter().enumerate().flat_map(|(g, grp)| {
        grp.completions.iter().map(move |c| Row {
            prompt: &grp.prompt,
            response: &c.token_ids,
            group: g as u64,
        })
    }))
}

/// `f`'s value at every response token of the groups, `per` rows a batch.
fn per_response_token(
    groups: &[Group],
    per: usize,
    f: impl Fn(&Batch) -> learner::Result<Vec<f32>>,
) -> Result<Vec<f32>, RunError> {
    Ok(rows_of(groups).per_response_token(per, f)?)
}

/// A step's artifacts.
#[derive(Default)]
struct Board {
    groups: Vec<Group>,
    old_logp: Option<Vec<f32>>,
    ref_logp: Option<Vec<f32>>,
    values: Option<Vec<f32>>,
    advantages: Option<Vec<f32>>,
    returns: Option<Vec<f32>>,
    metrics: Metrics,
}

/// What a read-only node computed, applied to the board after its level.
enum Out {
    Scores(Vec<Vec<f32>>),
    Keep(Vec<bool>),
    OldLogp(Vec<f32>),
    RefLogp(Vec<f32>),
    Values(Vec<f32>),
    Advantages(Vec<f32>, Vec<f32>),
}

/// A read-only node's name, result and seconds.
type NodeResult = (String, Result<(Out, Metrics), RunError>, f64);

/// A generation running in the background (`async` mode).
struct Pending {
    step: u64,
    problems: Vec<Problem>,
    reqs: Vec<GenerateRequest>,
    handle: JoinHandle<Result<Vec<Completion>, RunError>>,
}

/// What an RL stage keeps from step to step.
pub(crate) struct RlState {
    graph: StepGraph,
    opt: Optimizer,
    reference: Option<Model>,
    critic: Option<learner::algo::value::CriticTrainer>,
    queue: VecDeque<Pending>,
}

impl RlState {
    /// The stage's state: a fresh optimiser (restored from `checkpoint` when resuming inside the
    /// stage), the reference policy and critic when the algorithm has them.
    pub(crate) fn new(
        run: &mut Run<'_>,
        stage: &Stage,
        checkpoint: Option<&Path>,
    ) -> Result<Self, RunError> {
        let a = &stage.algorithm;
        let dir = run.dir.clone();
        let model = run.policy.model()?;
        let graph = crate::graph::expand(stage).map_err(|e| RunError::Other(e.to_string()))?;
        let mut opt = Optimizer::new(
            &model.params,
            Default::default(),
            crate::train::lr_schedule(
                a.lr,
                a.lr_warmup_steps,
                &a.lr_schedule,
                a.min_lr_ratio,
                stage.trainer.steps * optimiser_calls_per_step(stage),
            ),
            Some(a.grad_clip),
        );
        if let Some(ck) = checkpoint {
            opt.load(&ck.join("optimizer"))?;
        }
        // The reference policy is the weights the stage started from, kept beside its
        // checkpoints so that a resumed stage has the same one.
        let reference = if a.use_kl_loss {
            let dir = dir.join("checkpoints").join(&stage.id).join("reference");
            if checkpoint.is_some() && dir.exists() {
                Some(Model::load_weights(model.config.clone(), &dir)?)
            } else {
                std::fs::create_dir_all(&dir).map_err(|source| RunError::Io {
                    path: dir.clone(),
                    source,
                })?;
                model.params.save(&dir.join("model.safetensors"))?;
                Some(model.clone())
            }
        } else {
            None
        };
        let critic = if crate::graph::uses_critic(stage) {
            let (critic, ck_dir) = match checkpoint.map(|c| c.join("critic")) {
                Some(d) if d.exists() => (Critic::load(&d, model)?, Some(d)),
                _ => (Critic::from_policy(model), None),
            };
            let mut copt = critic.optimizer(
                Default::default(),
                LrSchedule::constant(a.critic_lr),
                Some(a.grad_clip),
            );
            if let Some(d) = ck_dir {
                copt.load(&d.join("optimizer"))?;
            }
            Some(learner::algo::value::CriticTrainer::new(critic, copt))
        } else {
            None
        };
        Ok(Self {
            graph,
            opt,
            reference,
            critic,
            queue: VecDeque::new(),
        })
    }

    /// The optimiser, for checkpoints.
    pub(crate) fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// The optimiser, to copy a device's moments into before a checkpoint.
    pub(crate) fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.opt
    }

    /// Writes the critic and its optimiser into checkpoint folder `dir`.
    pub(crate) fn save(&self, dir: &Path) -> Result<(), RunError> {
        if let Some(c) = &self.critic {
            c.critic.save(&dir.join("critic"))?;
            c.opt.save(&dir.join("critic").join("optimizer"))?;
        }
        Ok(())
    }
}

/// Generation rounds a step may take: DAPO's dynamic sampling draws up to
/// `max_num_gen_batches` batches of prompts, otherwise one.
fn gen_rounds(a: &crate::workflow::Algorithm) -> usize {
    if a.filter_groups {
        a.max_num_gen_batches.max(1)
    } else {
        1
    }
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

impl Run<'_> {
    /// The problems and requests of `step` (round `round` of dynamic sampling).
    fn draw(
        &self,
        stage: &Stage,
        data: &Source,
        step: u64,
        round: usize,
        exclude: &HashSet<Problem>,
    ) -> Result<(Vec<Problem>, Vec<GenerateRequest>), RunError> {
        let a = &stage.algorithm;
        let b = a.train_batch_size;
        let rounds = gen_rounds(a);
        let start = ((step - 1) * rounds as u64 + round as u64) * b as u64;
        let problems = data.train_batch(self.wf.seed ^ 0xA11CE, start, b, exclude);
        let mut reqs = Vec::with_capacity(problems.len());
        for (i, p) in problems.iter().enumerate() {
            let (prompt, _) = self.encode(p)?;
            let seed = self.wf.seed.wrapping_mul(1_000_003)
                ^ (step << 20)
                ^ ((round as u64) << 40)
                ^ i as u64;
            let params = SamplingParams {
                n: a.rollout_n,
                temperature: a.temperature,
                top_p: a.top_p,
                max_tokens: a.max_response_length,
                seed: Some(seed),
                ..Default::default()
            };
            reqs.push(GenerateRequest { prompt, params });
        }
        Ok((problems, reqs))
    }

    fn groups_of(
        &self,
        problems: Vec<Problem>,
        reqs: &[GenerateRequest],
        out: Vec<Completion>,
    ) -> Result<Vec<Group>, RunError> {
        let mut groups: Vec<Group> = problems
            .into_iter()
            .zip(reqs)
            .map(|(problem, r)| Group {
                problem,
                prompt: r.prompt.clone(),
                completions: Vec::new(),
                texts: Vec::new(),
                scores: Vec::new(),
            })
            .collect();
        for c in out {
            let g = &mut groups[c.request];
            g.texts.push(self.tokenizer.decode(&c.token_ids)?);
            g.completions.push(c);
        }
        Ok(groups)
    }

    fn launch(
        &self,
        stage: &Stage,
        data: &Source,
        step: u64,
        exclude: &HashSet<Problem>,
    ) -> Result<Pending, RunError> {
        let (problems, reqs) = self.draw(stage, data, step, 0, exclude)?;
        let engine = Arc::clone(&self.engine);
        let r = reqs.clone();
        let handle = std::thread::Builder::new()
            .name(format!("generate-{step}"))
            .spawn(move || engine.generate_blocking(r))
            .map_err(|e| RunError::Other(format!("cannot start a generation thread: {e}")))?;
        Ok(Pending {
            step,
            problems,
            reqs,
            handle,
        })
    }

    /// The `generate` node.
    fn generate(
        &mut self,
        stage: &Stage,
        data: &Source,
        step: u64,
        st: &mut RlState,
        exclude: &HashSet<Problem>,
        m: &mut Metrics,
    ) -> Result<Vec<Group>, RunError> {
        let a = &stage.algorithm;
        let b = a.train_batch_size;
        if stage.trainer.mode == "async" {
            // Keep generation `max_staleness` steps ahead of training.
            let last = (step + stage.trainer.max_staleness).min(stage.trainer.steps);
            let mut next = st.queue.back().map_or(step, |p| p.step + 1);
            while next <= last {
                st.queue.push_back(self.launch(stage, data, next, exclude)?);
                next += 1;
            }
            let p = st
                .queue
                .pop_front()
                .filter(|p| p.step == step)
                .ok_or_else(|| RunError::Other(format!("async queue lost step {step}")))?;
            let out = p
                .handle
                .join()
                .map_err(|_| RunError::Other("a generation thread panicked".into()))??;
            let mut groups = self.groups_of(p.problems, &p.reqs, out)?;
            // Staleness: weight versions between the oldest token of a group and the learner.
            let mut stale = Vec::new();
            let mut lag_sum = 0u64;
            let mut lag_max = 0u64;
            for (i, g) in groups.iter().enumerate() {
                let oldest = g
                    .completions
                    .iter()
                    .flat_map(|c| c.weight_versions.iter().map(|s| s.version))
                    .min()
                    .unwrap_or(self.version);
                let lag = self.version.saturating_sub(oldest);
                lag_sum += lag;
                lag_max = lag_max.max(lag);
                if lag > stage.trainer.max_staleness {
                    stale.push(i);
                }
            }
            m.insert(
                "async/staleness_mean".into(),
                lag_sum as f64 / groups.len().max(1) as f64,
            );
            m.insert("async/staleness_max".into(), lag_max as f64);
            m.insert("async/stale_groups".into(), stale.len() as f64);
            if !stale.is_empty() {
                if stage.trainer.stale_samples == "wait" {
                    // Generate those prompts again, on the current weights.
                    let reqs: Vec<GenerateRequest> =
                        stale.iter().map(|&i| p.reqs[i].clone()).collect();
                    let probs: Vec<Problem> =
                        stale.iter().map(|&i| groups[i].problem.clone()).collect();
                    let out = self.engine.generate_blocking(reqs.clone())?;
                    for (k, g) in self.groups_of(probs, &reqs, out)?.into_iter().enumerate() {
                        groups[stale[k]] = g;
                    }
                } else {
                    let drop: HashSet<usize> = stale.into_iter().collect();
                    groups = groups
                        .into_iter()
                        .enumerate()
                        .filter(|(i, _)| !drop.contains(i))
                        .map(|(_, g)| g)
                        .collect();
                }
            }
            groups.truncate(groups.len() / a.ppo_mini_batch_size * a.ppo_mini_batch_size);
            return Ok(groups);
        }
        // Dynamic sampling (DAPO): keep drawing prompts until `b` groups carry signal (scores
        // not all equal) or `max_num_gen_batches` rounds are spent. Without it: one round.
        let rounds = gen_rounds(a);
        let mut kept = Vec::new();
        let mut generated = 0usize;
        let mut rounds_run = 0usize;
        for round in 0..rounds {
            rounds_run += 1;
            let (problems, reqs) = self.draw(stage, data, step, round, exclude)?;
            let out = self.engine.generate_blocking(reqs.clone())?;
            for g in self.groups_of(problems, &reqs, out)? {
                generated += 1;
                let keep = !a.filter_groups || {
                    let s: Vec<f32> = g
                        .texts
                        .iter()
                        .map(|t| stage.reward.score(t, &g.problem.answer))
                        .collect();
                    keep_informative_groups(&vec![0; s.len()], &s)[0]
                };
                if keep {
                    kept.push(g);
                }
            }
            if kept.len() >= b {
                break;
            }
        }
        kept.truncate(b);
        // Whole mini-batches only (batch sizes are counted in prompts).
        kept.truncate(kept.len() / a.ppo_mini_batch_size * a.ppo_mini_batch_size);
        if a.filter_groups {
            m.insert("dapo/kept_groups".into(), kept.len() as f64);
            m.insert("dapo/generated_groups".into(), generated as f64);
            m.insert("dapo/gen_rounds".into(), rounds_run as f64);
        }
        Ok(kept)
    }

    /// The read-only nodes.
    fn compute(
        &self,
        stage: &Stage,
        st: &RlState,
        op: &Op,
        name: &str,
        board: &Board,
    ) -> Result<(Out, Metrics), RunError> {
        let a = &stage.algorithm;
        let mut m = Metrics::new();
        let out = match op {
            Op::Reward => Out::Scores(
                board
                    .groups
                    .iter()
                    .map(|g| {
                        g.texts
                            .iter()
                            .zip(&g.completions)
                            .map(|(t, c)| {
                                let mut s = stage.reward.score(t, &g.problem.answer);
                                if a.overlong_buffer_len > 0 {
                                    s += overlong_penalty(
                                        c.token_ids.len(),
                                        a.max_response_length,
                                        a.overlong_buffer_len,
                                        a.overlong_penalty_factor,
                                    ) as f32;
                                }
                                s
                            })
                            .collect()
                    })
                    .collect(),
            ),
            Op::User(UserNode::Program(p)) => Out::Scores(program_scores(p, &board.groups, &mut m)),
            Op::User(UserNode::Filter(f)) => Out::Keep(filter_keep(f, &board.groups, &mut m)),
            // The policy's log-probs where it trains, so ratios start at 1 exactly there.
            Op::OldLogp => {
                let per = a.ppo_mini_batch_size * a.rollout_n;
                Out::OldLogp(per_response_token(&board.groups, per, |b| {
                    Ok(self.policy.score(b, a.temperature.max(1e-6))?.logp)
                })?)
            }
            Op::RefLogp => {
                let r = st
                    .reference
                    .as_ref()
                    .ok_or_else(|| RunError::Other("no reference policy".into()))?;
                Out::RefLogp(self.logp_of(r, a, &board.groups)?)
            }
            Op::Values => {
                let critic = st
                    .critic
                    .as_ref()
                    .ok_or_else(|| RunError::Other("no critic".into()))?;
                let per = a.ppo_mini_batch_size * a.rollout_n;
                let all = per_response_token(&board.groups, per, |b| critic.critic.values(b))?;
                Out::Values(all)
            }
            Op::Advantage => {
                let rows = rows_of(&board.groups);
                let cols = rows.shape.cols;
                let mut token_rewards = vec![0.0f32; rows.shape.len()];
                let mut r = 0;
                for g in &board.groups {
                    for (c, &s) in g.completions.iter().zip(&g.scores) {
                        token_rewards[r * cols + c.token_ids.len() - 1] = s;
                        r += 1;
                    }
                }
                let est = match a.adv_estimator.parse::<AdvEstimator>()? {
                    AdvEstimator::Grpo { .. } => AdvEstimator::Grpo {
                        norm_by_std: a.norm_adv_by_std_in_grpo,
                    },
                    AdvEstimator::Gae { .. } => AdvEstimator::Gae {
                        gamma: a.gamma,
                        lambda: a.lam,
                    },
                    e => e,
                };
                let adv = compute(
                    est,
                    AdvInput {
                        shape: rows.shape,
                        token_rewards: &token_rewards,
                        mask: &rows.mask,
                        group: &rows.group,
                        values: board.values.as_deref(),
                        baseline_scores: None,
                    },
                )?;
                Out::Advantages(adv.advantages, adv.returns)
            }
            other => {
                return Err(RunError::Other(format!(
                    "node `{name}` ({other:?}) is not a read-only node"
                )));
            }
        };
        Ok((out, m))
    }

    /// Log-probs of every response token under `model`, in the `[rows, cols]` layout.
    fn logp_of(
        &self,
        model: &Model,
        a: &crate::workflow::Algorithm,
        groups: &[Group],
    ) -> Result<Vec<f32>, RunError> {
        let per = a.ppo_mini_batch_size * a.rollout_n;
        per_response_token(groups, per, |b| {
            Ok(model.score(b, a.temperature.max(1e-6))?.logp)
        })
    }

    fn update_critic(
        &mut self,
        stage: &Stage,
        st: &mut RlState,
        board: &Board,
        m: &mut Metrics,
    ) -> Result<(), RunError> {
        let a = &stage.algorithm;
        let critic = st
            .critic
            .as_mut()
            .ok_or_else(|| RunError::Other("no critic".into()))?;
        let rows = rows_of(&board.groups);
        let (old, ret) = match (&board.values, &board.returns) {
            (Some(v), Some(r)) => (v, r),
            _ => {
                return Err(RunError::Other(
                    "update_critic needs values and returns".into(),
                ));
            }
        };
        let token_rows = rows;
        let cfg = learner::algo::value::ValueUpdate {
            cliprange_value: a.cliprange_value,
            agg: a.loss_agg_mode.parse()?,
            epochs: a.ppo_epochs,
            rows_per_update: a.ppo_mini_batch_size * a.rollout_n,
        };
        m.extend(critic.update(&token_rows, old, ret, &cfg)?);
        Ok(())
    }

    fn update_actor(
        &mut self,
        stage: &Stage,
        st: &mut RlState,
        board: &Board,
        m: &mut Metrics,
    ) -> Result<(), RunError> {
        let a = &stage.algorithm;
        let rows = rows_of(&board.groups);
        let cols = rows.shape.cols;
        let adv = board
            .advantages
            .as_ref()
            .ok_or_else(|| RunError::Other("update_actor needs advantages".into()))?;
        // Behaviour log-probs: recomputed (`old_logp` node), the engine's (`async` mode), or
        // none (one update per batch: the current log-probs, detached).
        let behaviour: Option<Vec<f32>> = if stage.trainer.mode == "async" {
            let mut v = vec![0.0f32; rows.shape.len()];
            let mut r = 0;
            for g in &board.groups {
                for c in &g.completions {
                    v[r * cols..r * cols + c.logprobs.len()].copy_from_slice(&c.logprobs);
                    r += 1;
                }
            }
            Some(v)
        } else {
            board.old_logp.clone()
        };
        let kl = if a.use_kl_loss {
            Some((a.kl_loss_type.parse()?, a.kl_loss_coef))
        } else {
            None
        };
        let cfg = PolicyLossConfig {
            loss: a.policy_loss.parse::<PolicyLoss>()?,
            clip_low: a.clip_ratio_low.unwrap_or(a.clip_ratio),
            clip_high: a.clip_ratio_high.unwrap_or(a.clip_ratio),
            entropy_coeff: a.entropy_coeff,
            kl,
            ..Default::default()
        };
        let update = learner::algo::policy::PolicyUpdate {
            loss: cfg,
            agg: a.loss_agg_mode.parse()?,
            temperature: a.temperature.max(1e-6),
            epochs: a.ppo_epochs,
            rows_per_update: a.ppo_mini_batch_size * a.rollout_n,
        };
        let token_rows = rows;
        let out = learner::algo::policy::update(
            &mut *self.policy,
            &mut st.opt,
            learner::algo::policy::PolicyBatch {
                rows: &token_rows,
                advantages: adv,
                old_logp: behaviour.as_deref(),
                ref_logp: board.ref_logp.as_deref(),
            },
            &update,
        )?;
        m.extend(out);
        Ok(())
    }

    /// Runs RL step `step` of `stage` through its graph; returns the step's metrics.
    pub(crate) fn rl_step(
        &mut self,
        stage: &Stage,
        data: &Source,
        step: u64,
        st: &mut RlState,
        exclude: &HashSet<Problem>,
    ) -> Result<Metrics, RunError> {
        let t0 = Instant::now();
        let mut board = Board::default();
        let levels = st.graph.levels.clone();
        for level in &levels {
            // Read-only nodes of the level run concurrently.
            let pure: Vec<_> = level
                .iter()
                .filter(|&&n| !st.graph.graph[n].op.mutates())
                .copied()
                .collect();
            if !pure.is_empty() && !board.groups.is_empty() {
                let this = &*self;
                let (stref, bref) = (&*st, &board);
                let results: Vec<NodeResult> = std::thread::scope(|s| {
                    let handles: Vec<_> = pure
                        .iter()
                        .map(|&n| {
                            let node = &stref.graph.graph[n];
                            s.spawn(move || {
                                let t = Instant::now();
                                let r = this.compute(stage, stref, &node.op, &node.name, bref);
                                (node.name.clone(), r, t.elapsed().as_secs_f64())
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("a step node panicked"))
                        .collect()
                });
                for (name, r, secs) in results {
                    let (out, m) = r?;
                    board.metrics.extend(m);
                    board.metrics.insert(timer(&name), secs);
                    match out {
                        Out::Scores(s) => {
                            for (g, s) in board.groups.iter_mut().zip(s) {
                                g.scores = s;
                            }
                        }
                        Out::Keep(keep) => {
                            let mut it = keep.into_iter();
                            board.groups.retain(|_| it.next().unwrap_or(false));
                        }
                        Out::OldLogp(v) => board.old_logp = Some(v),
                        Out::RefLogp(v) => board.ref_logp = Some(v),
                        Out::Values(v) => board.values = Some(v),
                        Out::Advantages(adv, ret) => {
                            board.advantages = Some(adv);
                            board.returns = Some(ret);
                        }
                    }
                }
            }
            let mutating: Vec<(Op, String)> = level
                .iter()
                .map(|&n| &st.graph.graph[n])
                .filter(|node| node.op.mutates())
                .map(|node| (node.op.clone(), node.name.clone()))
                .collect();
            for (op, name) in mutating {
                let t = Instant::now();
                let mut m = Metrics::new();
                match op {
                    Op::Generate => {
                        board.groups = self.generate(stage, data, step, st, exclude, &mut m)?;
                    }
                    _ if board.groups.is_empty() => continue,
                    Op::UpdateCritic => self.update_critic(stage, st, &board, &mut m)?,
                    Op::UpdateActor => self.update_actor(stage, st, &board, &mut m)?,
                    Op::SyncWeights => {
                        self.sync_weights()?;
                    }
                    _ => unreachable!("only mutating nodes here"),
                }
                board.metrics.extend(m);
                board
                    .metrics
                    .insert(timer(&name), t.elapsed().as_secs_f64());
            }
        }
        let mut m = board.metrics;
        if board.groups.is_empty() {
            // No group carried signal (or all were dropped): nothing to learn from this step.
            m.insert("actor/skipped_update".into(), 1.0);
            return Ok(m);
        }
        let rows = rows_of(&board.groups);
        let n = rows.shape.rows as f64;
        let scores: f64 = board
            .groups
            .iter()
            .flat_map(|g| &g.scores)
            .map(|&s| s as f64)
            .sum();
        let resp_tokens: f64 = rows.mask.iter().map(|&v| v as f64).sum();
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
        m.insert("rollout/engines".into(), self.engine.len() as f64);
        m.insert(
            "rollout/engines_down".into(),
            self.engine.down_count() as f64,
        );
        Ok(m)
    }
}

/// A `filter` node's decision per group, and its metrics.
fn filter_keep(f: &FilterNode, groups: &[Group], m: &mut Metrics) -> Vec<bool> {
    let keep: Vec<bool> = groups
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
    m.insert(format!("filter/{}/dropped_groups", f.name), dropped as f64);
    keep
}

/// A `program` node's new scores: the program's score per response (a failed run or an
/// unreadable line scores 0 and is counted and logged), added to the reward times `weight` or
/// replacing it.
fn program_scores(p: &ProgramNode, groups: &[Group], m: &mut Metrics) -> Vec<Vec<f32>> {
    let mut input = String::new();
    for g in groups {
        for t in &g.texts {
            let line = serde_json::json!({"prompt": g.problem.prompt, "response": t, "answer": g.problem.answer});
            input.push_str(&line.to_string());
            input.push('\n');
        }
    }
    let total: usize = groups.iter().map(|g| g.texts.len()).sum();
    let (got, failed) = match run_program(p, input.into_bytes(), total) {
        Ok(scores) => {
            let failed = scores.iter().filter(|s| s.is_none()).count();
            (scores, failed)
        }
        Err(e) => {
            tracing::warn!(node = %p.name, "reward program failed: {e}; its {total} responses score 0");
            (vec![None; total], total)
        }
    };
    m.insert(format!("reward/{}/failed", p.name), failed as f64);
    let mut it = got.into_iter();
    let mut sum = 0.0;
    let out = groups
        .iter()
        .map(|g| {
            g.scores
                .iter()
                .map(|&base| {
                    let s = it.next().flatten().unwrap_or(0.0);
                    sum += s;
                    let w = (p.weight * s) as f32;
                    if p.mode == "replace" { w } else { base + w }
                })
                .collect()
        })
        .collect();
    m.insert(format!("reward/{}/mean", p.name), sum / total.max(1) as f64);
    out
}

/// Runs the program with `input` on stdin, under its timeout and memory limit; one score per
/// line expected (`None` for a line that is not a finite number).
fn run_program(p: &ProgramNode, input: Vec<u8>, expect: usize) -> Result<Vec<Option<f64>>, String> {
    let mut cmd = Command::new(&p.command[0]);
    cmd.args(&p.command[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let limit = p.memory_mb.saturating_mul(1 << 20);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec only async-signal-safe calls (setrlimit) are made.
        unsafe {
            cmd.pre_exec(move || {
                let r = libc::rlimit {
                    rlim_cur: limit as libc::rlim_t,
                    rlim_max: limit as libc::rlim_t,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start `{}`: {e}", p.command[0]))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let writer = std::thread::spawn(move || {
        // A program that exits without reading all of its input is not an error by itself.
        let _ = stdin.write_all(&input);
    });
    let mut stdout = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).map(|_| s)
    });
    let mut stderr = child.stderr.take().expect("piped stderr");
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs_f64(p.timeout_s);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {} s", p.timeout_s));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    };
    let _ = writer.join();
    let out = reader
        .join()
        .map_err(|_| "its output reader panicked".to_string())?
        .map_err(|e| format!("reading its output: {e}"))?;
    let err = err_reader.join().unwrap_or_default();
    if !status.success() {
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        return Err(format!("exited with {status}: {tail}"));
    }
    let lines: Vec<&str> = out.lines().collect();
    if lines.len() != expect {
        return Err(format!(
            "wrote {} lines for {expect} responses (one score per line expected)",
            lines.len()
        ));
    }
    Ok(lines
        .iter()
        .map(|l| l.trim().parse::<f64>().ok().filter(|v| v.is_finite()))
        .collect())
}

/// Optimiser calls an RL step makes: one per mini-batch per PPO epoch (the length a cosine
/// schedule spans is the stage's steps times this).
fn optimiser_calls_per_step(stage: &Stage) -> u64 {
    let a = &stage.algorithm;
    (a.ppo_epochs * (a.train_batch_size / a.ppo_mini_batch_size.max(1)).max(1)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prog(cmd: &[&str], timeout_s: f64) -> ProgramNode {
        ProgramNode {
            name: "p".into(),
            command: cmd.iter().map(|s| s.to_string()).collect(),
            timeout_s,
            memory_mb: 512,
            weight: 1.0,
            mode: "add".into(),
            after: vec![],
            before: vec![],
        }
    }

    #[test]
    fn programs_score_time_out_and_fail_cleanly() {
        let input = b"{\"response\":\"1\"}\n{\"response\":\"2\"}\n".to_vec();
        // One score per input line: the length of each line.
        let ok = run_program(
            &prog(&["sh", "-c", "while read l; do echo ${#l}; done"], 10.0),
            input.clone(),
            2,
        )
        .unwrap();
        assert_eq!(ok, vec![Some(16.0), Some(16.0)]);
        let bad_line = run_program(
            &prog(&["sh", "-c", "cat >/dev/null; echo 1; echo x"], 10.0),
            input.clone(),
            2,
        )
        .unwrap();
        assert_eq!(bad_line, vec![Some(1.0), None]);
        let t = Instant::now();
        let e = run_program(&prog(&["sleep", "30"], 0.3), input.clone(), 2).unwrap_err();
        assert!(e.contains("timed out"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        let e = run_program(
            &prog(&["sh", "-c", "echo boom >&2; exit 3"], 10.0),
            input.clone(),
            2,
        )
        .unwrap_err();
        assert!(e.contains("boom"), "{e}");
        let e = run_program(
            &prog(&["sh", "-c", "cat >/dev/null; echo 1"], 10.0),
            input.clone(),
            2,
        )
        .unwrap_err();
        assert!(e.contains("1 lines for 2"), "{e}");
        let e = run_program(&prog(&["/nonexistent/scorer"], 10.0), input, 2).unwrap_err();
        assert!(e.contains("cannot start"), "{e}");
    }

    #[test]
    fn the_memory_limit_applies_to_the_program() {
        // Allocating 1 GiB under a 64 MiB limit fails inside the program.
        let mut p = prog(&["python3", "-c", "x = bytearray(1 << 30); print(1)"], 20.0);
        p.memory_mb = 64;
        if Command::new("python3").arg("-c").arg("0").status().is_err() {
            eprintln!("python3 not found: memory-limit test skipped");
            return;
        }
        let e = run_program(&p, Vec::new(), 1).unwrap_err();
        assert!(e.contains("MemoryError") || e.contains("exited"), "{e}");
    }
}
