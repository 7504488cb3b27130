//! The learner pool: the policy as `count` data-parallel ranks ([`LearnerActor`]s), in this
//! process or on agents, behind the same `roles::Policy` role as a local engine. Each optimiser step
//! is computed by every rank on its share of the mini-batch
//! ([`learner::algo::policy::update_ranks`]); the ranks sum their gradients in rank order and
//! each applies the sum — one decision everywhere, checked: ranks whose reports differ fail the
//! step. The sum is the ranks' own (`allreduce: ranks`, the default): they form a group
//! ([`actors::exchange`]) when the pool starts, and the pool only starts each phase — reduce-
//! scatter, all-gather — on every rank and waits for all, so no gradient byte passes through
//! this process. With `allreduce: driver` the pool reads every rank's gradient, slice by slice,
//! sums it and hands the sum back. Log-probs are scored by every rank on its share of the rows.
//! With ZeRO-1 each rank keeps and updates the optimiser state of its shard of the model, and
//! every rank then reads the others' updated shards (or the pool hands them out). Weights are
//! read from all ranks at once (they hold the same ones) for snapshots and checkpoints, the
//! optimiser's state from the ranks that keep it, and both are written back when a stage
//! resumes from a checkpoint.
//!
//! Owns: the ranks, the gradient reduction and the count of steps every rank must have taken.
//! Never: decides what to train on (the executor does) or how a loss is computed (the
//! learner's algorithms do, inside the ranks).

use super::actor_pool::{ActorPool, PoolShape};
use super::{Cluster, PoolError, lock};
use crate::kinds::learner::{
    LearnerActor, LearnerConfig, LearnerOp, LearnerRequest, LearnerResponse, RankRole, Slot,
};
use crate::plan::{AllReduce, Device, Placement};
use actors::exchange::{Member, Reach, Reader, Source};
use kernels::tensor::WeightSnapshot;
use learner::algo::TokenRows;
use learner::algo::dp::{Outcome, Ranks, Work, split};
use learner::algo::policy::{PolicyBatch, PolicyUpdate};
use learner::algo::sft::SftStep;
use learner::algo::value::ValueUpdate;
use learner::optim::{LrSchedule, Optimizer, StepReport};
use learner::params::WeightDtype;
use learner::rl::Metrics;
use learner::{Model, ModelConfig, Params, wire};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Result with [`PoolError`].
type Result<T, E = PoolError> = std::result::Result<T, E>;

/// Values per read or write of a rank's tensors: 8 MB of f32, a third more as base64, within
/// one actor message (`actors::Wire::max_message_bytes`, 17 MiB by default).
const SLICE: usize = 2 << 20;

/// Slices of the all-reduce in flight at once.
const WINDOW: usize = 4;

/// What a learner pool is made of and where it runs.
pub struct LearnerStart<'a> {
    /// Ranks.
    pub count: usize,
    /// Where they run.
    pub placement: Placement,
    /// The device each occupies.
    pub device: Device,
    /// Where agents register, when placed on them.
    pub cluster: Option<&'a Cluster>,
    /// Whether the job was asked to stop (ends a wait for agents).
    pub stop: &'a (dyn Fn() -> bool + Sync),
    /// Told what people must know while the pool starts.
    pub note: &'a mut dyn FnMut(&str),
    /// The model's configuration.
    pub config: &'a ModelConfig,
    /// The weights every rank starts with.
    pub weights: WeightSnapshot,
    /// Side files of its checkpoints (tokenizer, chat template, generation config).
    pub assets: Vec<(String, Vec<u8>)>,
    /// ZeRO-1: each of several ranks keeps and updates the optimiser state of 1/N of the model.
    pub shard_optimizer: bool,
    /// How several ranks sum their gradients.
    pub allreduce: AllReduce,
    /// The arithmetic of the ranks' matmuls.
    pub precision: kernels::matmul::Precision,
    /// The policy, or PPO's critic (its weights: the trunk's tensors, then the value head's).
    pub role: RankRole,
    /// On agents: the agent (its id) each rank starts on — beside the rollout engine of its
    /// index (`placement: colocate`), which then takes the rank's weights without a copy.
    /// The ranks then form a group even when there is one, so that engines read from them.
    pub beside: Option<Vec<String>>,
}

/// The policy as data-parallel learner actors.
pub struct LearnerPool {
    rt: tokio::runtime::Runtime,
    pool: Option<ActorPool<LearnerActor>>,
    config: ModelConfig,
    /// The weights' names and shapes, in layout order.
    layout: Params,
    assets: Vec<(String, Vec<u8>)>,
    /// Optimiser steps every rank has applied.
    steps: u64,
    /// The current stage's schedule and clipping.
    stage: Option<(LrSchedule, f64)>,
    /// Ranks that restarted (their state is gone).
    restarted: Arc<Mutex<Vec<String>>>,
    /// Time spent summing the ranks' gradients and handing the sum back (and, with ZeRO-1,
    /// handing every rank the others' updated shards), all steps together.
    reducing: std::time::Duration,
    /// ZeRO-1: each rank's (offset, length) of the model's flat values.
    shards: Option<Vec<(usize, usize)>>,
    /// The ranks sum among themselves (they joined a group when the pool started); the pool
    /// reads their outboxes.
    group: Option<Mutex<Reader>>,
    /// The group's outboxes as a reader elsewhere reaches them (ranks on agents only: ranks in
    /// the driver serve their outboxes on its loopback).
    source: Option<Source>,
    /// What the ranks' outboxes hold now.
    outboxes: Mutex<Outboxes>,
}

/// What a group's outboxes hold (each rank its shard of it, but for gradients).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outboxes {
    /// The ranks' gradients of a step not taken yet: never to be written over.
    Gradients,
    /// The current weights (a step, or a `Publish`, wrote them).
    Weights,
    /// Something else (nothing yet, or an optimiser moment the driver read).
    Other,
}

impl LearnerPool {
    /// Starts the ranks of `start`, each with its weights.
    pub fn start(start: LearnerStart<'_>) -> Result<Self, PoolError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            // Two: the ranks' answers (tens of MB of base64 each) decode in parallel.
            .worker_threads(2)
            .thread_name("learner-pool")
            .enable_all()
            .build()
            .map_err(|e| PoolError::Runtime(format!("cannot start the actor runtime: {e}")))?;
        let layout = start.weights.params()?.zeros_like();
        // Each rank's (offset, length): the values whose sum it makes in a group, whose
        // optimiser state it keeps with ZeRO-1.
        let split: Vec<(usize, usize)> = split(0, layout.numel(), start.count)
            .into_iter()
            .map(|(a, b)| (a, b - a))
            .collect();
        let shards = (start.shard_optimizer && start.count > 1).then(|| split.clone());
        let model = start.config.to_hf_json();
        let (role, precision) = (start.role, start.precision);
        let config = move |_: usize| LearnerConfig {
            model: model.clone(),
            role,
            precision,
        };
        let restarted = Arc::new(Mutex::new(Vec::new()));
        let told = Arc::clone(&restarted);
        let pool = rt
            .block_on(ActorPool::start(
                PoolShape {
                    name: match role {
                        RankRole::Policy => "learner",
                        RankRole::Critic => "critic",
                    },
                    count: start.count,
                    config: &config,
                    placement: start.placement,
                    device: start.device,
                    cluster: start.cluster,
                    stop: start.stop,
                    note: start.note,
                    on_restart: Some(Arc::new(move |name: &str| lock(&told).push(name.into()))),
                    beside: start.beside.as_deref(),
                },
                start.weights,
            ))
            // An agent lost while the ranks start takes a rank's first state with it: the job
            // starts them again, as for a rank lost later.
            .map_err(|e| match e {
                PoolError::Actor(e) => rank_failed(e),
                e => e,
            })?;
        let mut me = Self {
            rt,
            pool: Some(pool),
            config: start.config.clone(),
            layout,
            assets: start.assets,
            steps: 0,
            stage: None,
            restarted,
            reducing: std::time::Duration::ZERO,
            shards,
            group: None,
            source: None,
            outboxes: Mutex::new(Outboxes::Other),
        };
        let reach = match start.allreduce {
            AllReduce::Ranks => Some(Reach::Auto),
            AllReduce::Streams => Some(Reach::Streams),
            AllReduce::Driver => None,
        };
        if let Some(reach) = reach.filter(|_| start.count > 1 || start.beside.is_some()) {
            me.form_group(
                split,
                reach,
                matches!(start.placement, Placement::Agents(_)),
            )?;
        }
        Ok(me)
    }

    /// Has the ranks form a group that sums among itself: each opens its outbox, then joins
    /// with everyone's addresses (and the host its agent is reached at), rank `i` owning
    /// `shards[i]`.
    fn form_group(
        &mut self,
        shards: Vec<(usize, usize)>,
        reach: Reach,
        on_agents: bool,
    ) -> Result<()> {
        let key = actors::Token::generate().map_err(|e| PoolError::Runtime(e.to_string()))?;
        let secret = key.secret().to_string();
        let hosts: Vec<String> = self
            .ranks()
            .iter()
            .map(|r| r.agent_host().unwrap_or_else(|| "127.0.0.1".into()))
            .collect();
        let opened = self.on_ranks(
            hosts
                .iter()
                .map(|host| LearnerOp::Open {
                    key: secret.clone(),
                    host: host.clone(),
                })
                .collect(),
        )?;
        let members = opened
            .into_iter()
            .zip(hosts)
            .map(|(o, reach)| match o {
                LearnerResponse::Opened(outbox) => Ok(Member { outbox, reach }),
                _ => Err(out_of_turn()),
            })
            .collect::<Result<Vec<_>>>()?;
        self.on_ranks(
            (0..members.len())
                .map(|rank| LearnerOp::Join {
                    key: secret.clone(),
                    rank,
                    shards: shards.clone(),
                    members: members.clone(),
                    reach,
                })
                .collect(),
        )?;
        let values = self.layout.numel();
        let reader = Reader::connect(&members, shards.clone(), values, &key, reach)?;
        self.group = Some(Mutex::new(reader));
        self.source = on_agents.then_some(Source {
            members,
            shards,
            values,
            key: secret,
            reach,
        });
        Ok(())
    }

    /// Where readers on agents can read the weights now in the ranks' outboxes, each rank
    /// serving its shard (after [`LearnerPool::snapshot`] read them there); `None` for ranks
    /// in the driver, without a group, or whose outboxes hold something else.
    pub fn weight_source(&self) -> Option<Source> {
        let held = *lock(&self.outboxes);
        self.source.clone().filter(|_| held == Outboxes::Weights)
    }

    /// Seconds spent so far summing the ranks' gradients and handing every rank the sum (the
    /// all-reduce of every step).
    pub fn reduce_seconds(&self) -> f64 {
        self.reducing.as_secs_f64()
    }

    /// Where each rank runs.
    pub fn locations(&self) -> Vec<String> {
        self.ranks().iter().map(|a| a.location()).collect()
    }

    fn ranks(&self) -> &[actors::ActorRef<LearnerActor>] {
        self.pool.as_ref().map_or(&[], |p| p.actors())
    }

    /// A rank that restarted since the pool started: its weights and optimiser are gone.
    fn check_ranks(&self) -> Result<()> {
        let restarted = lock(&self.restarted);
        if restarted.is_empty() {
            return Ok(());
        }
        Err(PoolError::RankLost(format!(
            "{} restarted after {} optimiser steps",
            restarted.join(", "),
            self.steps
        )))
    }

    /// A failed call: a rank that died in it, or answered from a new incarnation, is lost.
    fn failed(&self, e: actors::ActorError) -> PoolError {
        self.check_ranks().err().unwrap_or_else(|| rank_failed(e))
    }

    /// Each `(rank, op)` at once (several to one rank queue at its mailbox); the answers in
    /// the order given.
    fn on_many(&self, ops: Vec<(usize, LearnerOp)>) -> Result<Vec<LearnerResponse>> {
        self.check_ranks()?;
        let ranks = self.ranks();
        let mut calls = Vec::with_capacity(ops.len());
        for (r, op) in ops {
            let rank = ranks
                .get(r)
                .ok_or_else(|| PoolError::Runtime(format!("no learner rank {r}")))?
                .clone();
            let steps = self.steps;
            let call = self
                .rt
                .spawn(async move { rank.call(LearnerRequest { steps, op }).await });
            calls.push((r, call));
        }
        self.rt.block_on(async {
            let mut out = Vec::with_capacity(calls.len());
            for (r, c) in calls {
                let answer = c
                    .await
                    .map_err(|e| {
                        PoolError::Runtime(format!("a call to learner {r} was lost: {e}"))
                    })?
                    .map_err(|e| self.failed(e))?;
                out.push(answer);
            }
            Ok::<_, PoolError>(out)
        })
    }

    /// `ops[i]` on rank `i`, every rank at once; the answers in rank order.
    fn on_ranks(&self, ops: Vec<LearnerOp>) -> Result<Vec<LearnerResponse>> {
        self.on_many(ops.into_iter().enumerate().collect())
    }

    /// `op` on rank `r` alone.
    fn on_rank(&self, r: usize, op: LearnerOp) -> Result<LearnerResponse> {
        self.on_many(vec![(r, op)])?
            .pop()
            .ok_or_else(|| PoolError::Runtime(format!("learner rank {r} did not answer")))
    }

    /// The same `op` on every rank.
    fn on_all(&self, op: impl Fn() -> LearnerOp) -> Result<Vec<LearnerResponse>> {
        self.on_ranks((0..self.ranks().len()).map(|_| op()).collect())
    }

    /// `slot` (the weights or a moment) of every rank's group shard into `out` at the model's
    /// flat offsets, through the ranks' outboxes (published there first unless a step already
    /// did); `false` where the ranks form no group, or their outboxes hold a step's gradients.
    fn read_group(&self, slot: Slot, out: &mut Params) -> Result<bool> {
        let Some(group) = &self.group else {
            return Ok(false);
        };
        let mut held = lock(&self.outboxes);
        match *held {
            Outboxes::Gradients => return Ok(false),
            Outboxes::Weights if slot == Slot::Weights => {}
            _ => {
                *held = Outboxes::Other;
                self.on_all(|| LearnerOp::Publish { slot })?;
                if slot == Slot::Weights {
                    *held = Outboxes::Weights;
                }
            }
        }
        lock(group).read_shards(|at, v| wire::write_range(out, at, v).map_err(PoolError::from))?;
        Ok(true)
    }

    /// The weights, whole: from the ranks' outboxes, else read from the ranks — every rank
    /// holds the same ones, so the slices come from all of them at once, round robin.
    fn weights(&self) -> Result<Params> {
        let mut out = self.layout.clone();
        if self.read_group(Slot::Weights, &mut out)? {
            return Ok(out);
        }
        let n = out.numel();
        let ranks = self.count().max(1);
        for window in slices(0, n).chunks(WINDOW * ranks) {
            let reads = window.iter().enumerate().map(|(i, &(offset, len))| {
                let slot = Slot::Weights;
                (i % ranks, LearnerOp::Read { slot, offset, len })
            });
            let got = self.on_many(reads.collect())?;
            for (&(offset, _), v) in window.iter().zip(got) {
                wire::write_range(&mut out, offset, &values(v)?)?;
            }
        }
        Ok(out)
    }

    /// Values `a..a + len` of `slot` of rank `r` (its own offsets: a ZeRO-1 rank's moments
    /// count from its shard's start) into `out` at `to`.
    fn read_into(
        &self,
        r: usize,
        slot: Slot,
        (a, len): (usize, usize),
        out: &mut Params,
        to: usize,
    ) -> Result<()> {
        for (at, n) in slices(0, len) {
            let op = LearnerOp::Read {
                slot,
                offset: a + at,
                len: n,
            };
            wire::write_range(out, to + at, &values(self.on_rank(r, op)?)?)?;
        }
        Ok(())
    }

    /// Optimiser state each rank keeps, in bytes (rank 0's: with ZeRO-1 the first shard, which
    /// is the largest).
    pub fn optimizer_bytes_per_rank(&self) -> Result<usize> {
        match self.on_rank(0, LearnerOp::Counters)? {
            LearnerResponse::Counters { moments, .. } => Ok(2 * 4 * moments),
            _ => Err(out_of_turn()),
        }
    }

    /// Writes all of `p` into `slot` of every rank.
    fn write_all(&self, slot: Slot, p: &Params) -> Result<()> {
        for (offset, len) in slices(0, p.numel()) {
            let values = wire::read_range(p, offset, len)?;
            self.on_all(|| LearnerOp::Write {
                slot,
                offset,
                values: values.clone(),
            })?;
        }
        Ok(())
    }
}

/// The values `from..to` of a model's flat layout as message-sized (offset, length) slices.
fn slices(from: usize, to: usize) -> Vec<(usize, usize)> {
    (from..to)
        .step_by(SLICE)
        .map(|o| (o, SLICE.min(to - o)))
        .collect()
}

/// A rank's call that failed: a retryable failure is the rank (or its agent) lost, for the job
/// to recover from; any other is the call's own error.
fn rank_failed(e: actors::ActorError) -> PoolError {
    if e.is_retryable() {
        PoolError::RankLost(e.to_string())
    } else {
        PoolError::Actor(e)
    }
}

/// A group's exchange that failed: a rank, or the link to it, was lost.
impl From<actors::exchange::ExchangeError> for PoolError {
    fn from(e: actors::exchange::ExchangeError) -> Self {
        PoolError::RankLost(e.to_string())
    }
}

fn out_of_turn() -> PoolError {
    PoolError::Runtime("a learner rank answered out of turn".into())
}

fn values(r: LearnerResponse) -> Result<Vec<f32>> {
    match r {
        LearnerResponse::Values(v) => Ok(v),
        _ => Err(out_of_turn()),
    }
}

impl Ranks for LearnerPool {
    type Error = PoolError;

    fn count(&self) -> usize {
        self.ranks().len()
    }

    fn gradients(&mut self, work: Vec<Work>) -> Result<Vec<Outcome>> {
        // The ranks publish their gradients over what the outboxes held.
        *lock(&self.outboxes) = Outboxes::Gradients;
        self.on_ranks(work.into_iter().map(LearnerOp::Gradient).collect())?
            .into_iter()
            .map(|r| match r {
                LearnerResponse::Outcome(o) => Ok(o),
                _ => Err(out_of_turn()),
            })
            .collect()
    }

    fn step(&mut self) -> Result<StepReport> {
        if self.group.is_some() {
            let report = self.step_in_group()?;
            *lock(&self.outboxes) = Outboxes::Weights;
            return Ok(report);
        }
        // The all-reduce, slice by slice: every rank's slice, summed in rank order (the same
        // sum whatever order the answers came in), written back to every rank — with ZeRO-1
        // only to the rank whose shard it is, and its square added to the global norm's.
        let started = std::time::Instant::now();
        let mut sum_sq = 0.0f64;
        let ranks = self.count();
        if ranks > 1 {
            // A window of slices in flight at once: the calls' latency overlaps.
            for window in slices(0, self.layout.numel()).chunks(WINDOW) {
                let reads = window.iter().flat_map(|&(offset, len)| {
                    (0..ranks).map(move |r| {
                        let slot = Slot::Gradient;
                        (r, LearnerOp::Read { slot, offset, len })
                    })
                });
                let mut parts = self.on_many(reads.collect())?.into_iter().map(values);
                let mut writes = Vec::new();
                for &(offset, len) in window {
                    let mut sum = parts.next().transpose()?.unwrap_or_default();
                    for _ in 1..ranks {
                        let p = parts.next().transpose()?.unwrap_or_default();
                        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
                    }
                    match &self.shards {
                        None => writes.extend((0..ranks).map(|r| {
                            let values = sum.clone();
                            let slot = Slot::Gradient;
                            (
                                r,
                                LearnerOp::Write {
                                    slot,
                                    offset,
                                    values,
                                },
                            )
                        })),
                        Some(shards) => {
                            sum_sq += kernels::optim::global_norm([&sum[..]]).powi(2);
                            for (r, &(a, l)) in shards.iter().enumerate() {
                                let (lo, hi) = (a.max(offset), (a + l).min(offset + len));
                                if lo < hi {
                                    let values = sum[lo - offset..hi - offset].to_vec();
                                    let slot = Slot::Gradient;
                                    writes.push((
                                        r,
                                        LearnerOp::Write {
                                            slot,
                                            offset: lo,
                                            values,
                                        },
                                    ));
                                }
                            }
                        }
                    }
                }
                self.on_many(writes)?;
            }
        }
        self.reducing += started.elapsed();
        let norm = self.shards.as_ref().map(|_| sum_sq.sqrt());
        let first = self.apply(norm)?;
        // ZeRO-1's all-gather: every rank's updated shard to the others.
        if let Some(shards) = self.shards.clone() {
            let started = std::time::Instant::now();
            for (r, &(a, l)) in shards.iter().enumerate() {
                for window in slices(a, a + l).chunks(WINDOW) {
                    let reads = window.iter().map(|&(offset, len)| {
                        let slot = Slot::Weights;
                        (r, LearnerOp::Read { slot, offset, len })
                    });
                    let mut writes = Vec::new();
                    let mine = self.on_many(reads.collect())?;
                    for (&(offset, _), got) in window.iter().zip(mine) {
                        let got = values(got)?;
                        writes.extend((0..shards.len()).filter(|&o| o != r).map(|o| {
                            let (slot, values) = (Slot::Weights, got.clone());
                            (
                                o,
                                LearnerOp::Write {
                                    slot,
                                    offset,
                                    values,
                                },
                            )
                        }));
                    }
                    self.on_many(writes)?;
                }
            }
            self.reducing += started.elapsed();
        }
        Ok(first)
    }
}

impl LearnerPool {
    /// A step whose sum the ranks make among themselves: reduce-scatter; then the summed
    /// shards to every rank and a whole step each, or (ZeRO-1) a step of each rank's shard
    /// with the global norm and every rank's updated shard to the others. Each phase runs on
    /// every rank at once and ends when all have answered: a rank reads another's outbox only
    /// in a phase after the one that wrote it.
    fn step_in_group(&mut self) -> Result<StepReport> {
        let started = std::time::Instant::now();
        let (mut squares, mut publish) = (Vec::new(), 0.0f64);
        for r in self.on_all(|| LearnerOp::Reduce)? {
            match r {
                LearnerResponse::Reduced {
                    squares: s,
                    publish_s,
                } => {
                    squares.push(s);
                    publish = publish.max(publish_s);
                }
                _ => return Err(out_of_turn()),
            }
        }
        // The ranks' publications (at the end of their gradients' calls) count too.
        self.reducing += std::time::Duration::from_secs_f64(publish);
        let norm = match self.shards {
            None => {
                self.on_all(|| LearnerOp::Gather {
                    slot: Slot::Gradient,
                })?;
                None
            }
            // The shards' squares added in rank order, as every rank would.
            Some(_) => Some(squares.iter().sum::<f64>().sqrt()),
        };
        self.reducing += started.elapsed();
        let report = self.apply(norm)?;
        if self.shards.is_some() {
            let started = std::time::Instant::now();
            self.on_all(|| LearnerOp::Gather {
                slot: Slot::Weights,
            })?;
            self.reducing += started.elapsed();
        }
        Ok(report)
    }

    /// Every rank applies its summed gradients (with `norm`: its ZeRO-1 shard); their reports
    /// must agree.
    fn apply(&mut self, norm: Option<f64>) -> Result<StepReport> {
        let reports = self.on_all(|| LearnerOp::Step { norm })?;
        self.steps += 1;
        let mut reports = reports.into_iter().map(|r| match r {
            LearnerResponse::Report(r) => Ok(r),
            _ => Err(out_of_turn()),
        });
        let first = reports
            .next()
            .ok_or(PoolError::Runtime("a learner pool without ranks".into()))??;
        for (i, r) in reports.enumerate() {
            let r = r?;
            if r.grad_norm.to_bits() != first.grad_norm.to_bits()
                || r.lr != first.lr
                || r.skipped != first.skipped
            {
                return Err(learner::Error::Ranks(format!(
                    "rank {} stepped with {r:?} and rank 0 with {first:?}: their weights no longer agree",
                    i + 1
                ))
                .into());
            }
        }
        Ok(first)
    }
}

/// What the policy role asks (`roles::Policy` for the pool forwards here).
impl LearnerPool {
    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Log-probs of every response token of `rows`, each rank scoring its share of them.
    pub fn logp(&self, rows: &TokenRows, temperature: f32, per: usize) -> Result<Vec<f32>> {
        self.per_token(rows, |rows| LearnerOp::Logp {
            rows,
            temperature,
            per,
        })
    }

    /// `[rows, cols]` values of `rows`, each rank answering `op` for its share of them.
    fn per_token(&self, rows: &TokenRows, op: impl Fn(TokenRows) -> LearnerOp) -> Result<Vec<f32>> {
        let ops = split(0, rows.shape.rows, self.ranks().len())
            .into_iter()
            .map(|(a, b)| op(rows.rows(a, b)))
            .collect();
        let mut all = Vec::with_capacity(rows.shape.len());
        for r in self.on_ranks(ops)? {
            all.extend(values(r)?);
        }
        Ok(all)
    }

    /// Starts a stage's optimiser on every rank, restored from the checkpoint folder `resume`.
    pub fn begin_stage(
        &mut self,
        schedule: LrSchedule,
        grad_clip: f64,
        resume: Option<&Path>,
    ) -> Result<()> {
        let restored = match resume {
            Some(dir) => {
                let mut opt =
                    Optimizer::new(&self.layout, Default::default(), schedule, Some(grad_clip));
                opt.load(&dir.join("optimizer"))?;
                Some(opt)
            }
            None => None,
        };
        let counters = restored.as_ref().map(|o| (o.calls, o.applied));
        let ops = (0..self.count())
            .map(|r| LearnerOp::BeginStage {
                schedule,
                grad_clip,
                counters,
                shard: self.shards.as_ref().map(|s| s[r]),
            })
            .collect();
        self.on_ranks(ops)?;
        if let Some(mut opt) = restored {
            let (m, v) = opt.moments_mut();
            match self.shards.clone() {
                None => {
                    self.write_all(Slot::FirstMoment, m)?;
                    self.write_all(Slot::SecondMoment, v)?;
                }
                // Each rank its shard of the moments, at its own offsets.
                Some(shards) => {
                    for (r, (a, l)) in shards.into_iter().enumerate() {
                        for (slot, p) in [(Slot::FirstMoment, &*m), (Slot::SecondMoment, &*v)] {
                            for (at, len) in slices(0, l) {
                                let values = wire::read_range(p, a + at, len)?;
                                let op = LearnerOp::Write {
                                    slot,
                                    offset: at,
                                    values,
                                };
                                self.on_rank(r, op)?;
                            }
                        }
                    }
                }
            }
        }
        self.stage = Some((schedule, grad_clip));
        Ok(())
    }

    /// One SFT step over the ranks.
    pub fn sft_step(&mut self, examples: &[(Vec<u32>, Vec<u32>)]) -> Result<SftStep> {
        learner::algo::sft::step_ranks(self, examples)
    }

    /// One RL update over the ranks.
    /// Its metrics add `timing_s/allreduce`: the seconds its steps spent summing and handing
    /// out gradients (and ZeRO-1's shards).
    pub fn update(&mut self, batch: PolicyBatch<'_>, cfg: &PolicyUpdate) -> Result<Metrics> {
        let before = self.reducing;
        let mut m = learner::algo::policy::update_ranks(self, batch, cfg)?;
        let spent = (self.reducing - before).as_secs_f64();
        m.insert("timing_s/allreduce".into(), spent);
        Ok(m)
    }

    /// A critic pool's value at every response token of `rows`, each rank on its share.
    pub fn values(&self, rows: &TokenRows, per: usize) -> Result<Vec<f32>> {
        self.per_token(rows, |rows| LearnerOp::Values { rows, per })
    }

    /// A critic pool's update towards `returns`; its metrics add `timing_s/allreduce_critic`.
    pub fn value_update(
        &mut self,
        rows: &TokenRows,
        old_values: &[f32],
        returns: &[f32],
        cfg: &ValueUpdate,
    ) -> Result<Metrics> {
        let before = self.reducing;
        let mut m = learner::algo::value::update_ranks(self, rows, old_values, returns, cfg)?;
        let spent = (self.reducing - before).as_secs_f64();
        m.insert("timing_s/allreduce_critic".into(), spent);
        Ok(m)
    }

    /// The optimiser as the ranks hold it, whole: counters from rank 0, moments from the ranks
    /// that keep them.
    fn optimizer(&self, schedule: LrSchedule, grad_clip: f64) -> Result<Optimizer> {
        let mut opt = Optimizer::new(&self.layout, Default::default(), schedule, Some(grad_clip));
        let LearnerResponse::Counters { calls, applied, .. } =
            self.on_rank(0, LearnerOp::Counters)?
        else {
            return Err(out_of_turn());
        };
        (opt.calls, opt.applied) = (calls, applied);
        let (mut m, mut v) = (self.layout.clone(), self.layout.clone());
        let through_outboxes = self.read_group(Slot::FirstMoment, &mut m)?
            && self.read_group(Slot::SecondMoment, &mut v)?;
        if !through_outboxes {
            // With ZeRO-1 every rank holds its shard of the moments, at its own offsets.
            let shards = self.shards.clone().unwrap_or_else(|| vec![(0, m.numel())]);
            for (r, (a, l)) in shards.into_iter().enumerate() {
                self.read_into(r, Slot::FirstMoment, (0, l), &mut m, a)?;
                self.read_into(r, Slot::SecondMoment, (0, l), &mut v, a)?;
            }
        }
        let (om, ov) = opt.moments_mut();
        (*om, *ov) = (m, v);
        Ok(opt)
    }

    /// A critic pool's checkpoint: `dir/critic` (trunk, value head) and its optimiser.
    pub fn save_critic(&self, dir: &Path) -> Result<()> {
        let (schedule, grad_clip) = self
            .stage
            .ok_or_else(|| PoolError::Runtime("a critic saved before its stage began".into()))?;
        let critic = learner::critic::Critic::from_all(&self.config, self.weights()?)?;
        let dir = dir.join("critic");
        critic.save(&dir)?;
        self.optimizer(schedule, grad_clip)?
            .save(&dir.join("optimizer"))?;
        Ok(())
    }

    /// The weights, as `version` (each tensor shared: engines in this process take them as
    /// they are while the pool keeps the snapshot for restarts).
    pub fn snapshot(&mut self, version: u64) -> Result<WeightSnapshot> {
        Ok(WeightSnapshot::new(
            version,
            Arc::new(self.weights()?.share()),
        ))
    }

    /// Writes a checkpoint folder from the ranks' weights and optimiser state.
    pub fn save(&mut self, dir: &Path, with_optimizer: bool, dtype: WeightDtype) -> Result<()> {
        let model = Model::new(self.config.clone(), self.weights()?)?;
        let opt = match (with_optimizer, self.stage) {
            (false, _) => None,
            (true, None) => {
                return Err(PoolError::Runtime(
                    "a save with the optimiser before the stage began".into(),
                ));
            }
            (true, Some((schedule, grad_clip))) => Some(self.optimizer(schedule, grad_clip)?),
        };
        learner::checkpoint::save(&model, &self.assets, dir, opt.as_ref(), dtype)?;
        Ok(())
    }
}

impl Drop for LearnerPool {
    fn drop(&mut self) {
        // Waited for: a shared head's agents get their resources back for the next job.
        if let Some(mut pool) = self.pool.take() {
            self.rt.block_on(pool.shutdown());
        }
    }
}
