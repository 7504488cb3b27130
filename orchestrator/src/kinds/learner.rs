//! The `learner` actor kind: one data-parallel rank of the policy — a training engine with its
//! optimiser — in this process or on an agent. It computes the gradient of its share of each
//! mini-batch ([`learner::algo::dp::gradient`]), the ranks sum their gradients, and each applies
//! the sum with its optimiser; the driver's learner pool (`pools::learner`) makes the ranks one
//! policy.
//!
//! The ranks sum among themselves ([`actors::exchange`]): each publishes its gradient in its
//! outbox, sums its shard of everyone's (reduce-scatter) and reads the others' summed shards
//! (all-gather) — the driver only says when each phase begins. (Or, with `allreduce: driver`,
//! the driver reads and writes the ranks' slots in slices that fit one message.)
//!
//! With ZeRO-1 a rank keeps the optimiser's moments of one contiguous shard of the model's flat
//! values and updates only those (given the whole gradient's norm); then each reads the others'
//! updated shards from their outboxes (or the driver hands them out). After every step a rank in
//! a group publishes its shard of the new weights in its outbox, where the driver reads them.
//!
//! A rank counts the optimiser steps it has applied, and every request says how many the
//! driver expects: a rank that restarted (its weights back to the pool's first ones, its
//! optimiser gone) refuses instead of training from the wrong weights.
//!
//! A policy rank in a group is findable in its process by the group's key
//! ([`weights_beside`]): a rollout engine in the same agent process (`placement: colocate`)
//! takes its new weights from there — shared, neither read nor copied.

use crate::lock;
use actors::exchange::{Group, Member, Outbox, OutboxAddress, Reach};
use actors::{Actor, CallError, Token};
use kernels::tensor::WeightSnapshot;
use learner::algo::TokenRows;
use learner::algo::dp::{Outcome, Work};
use learner::critic::Critic;
use learner::engine::{Backend, TrainEngine};
use learner::error::Result;
use learner::optim::{LrSchedule, Optimizer, StepReport};
use learner::{Model, ModelConfig, Params, wire};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

/// A rank's state (taken out while a call runs), where a rollout engine in its process can
/// find it between calls.
type RankState = Mutex<Option<Rank>>;
type RankCell = Arc<RankState>;

/// The policy ranks of this process by their group's key.
static BESIDE: Mutex<Vec<(String, Weak<RankState>)>> = Mutex::new(Vec::new());

/// The weights of a policy rank of the group `key` in this process, sharing its memory (no
/// copy; the rank's next step writes to memory of its own while they are held). `None` when no
/// such rank lives here, or it is busy with a call (the driver asks only between steps).
pub(crate) fn weights_beside(key: &str) -> Option<Params> {
    let ranks: Vec<RankCell> = {
        let mut all = lock(&BESIDE);
        all.retain(|(_, rank)| rank.strong_count() > 0);
        all.iter()
            .filter(|(k, _)| k == key)
            .filter_map(|(_, rank)| rank.upgrade())
            .collect()
    };
    ranks.iter().find_map(|rank| match lock(rank).as_mut() {
        Some(Rank {
            trainee: Trainee::Policy(engine),
            ..
        }) => engine.share_weights().ok(),
        _ => None,
    })
}

/// How a learner rank starts: the model's shape and what it trains (its weights arrive by
/// `load_weights`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LearnerConfig {
    /// The model's Hugging Face `config.json` fields.
    pub model: serde_json::Value,
    /// The policy, or PPO's critic (the trunk with a value head).
    #[serde(default)]
    pub role: RankRole,
    /// The arithmetic of the rank's matmuls.
    #[serde(default)]
    pub precision: kernels::matmul::Precision,
}

/// What a learner rank trains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RankRole {
    /// The policy, on a training engine.
    #[default]
    Policy,
    /// PPO's value model.
    Critic,
}

/// A request, with the optimiser steps the driver expects the rank to have applied.
#[derive(Debug, Serialize, Deserialize)]
pub struct LearnerRequest {
    /// Steps applied so far (by every rank of the pool).
    pub steps: u64,
    /// What to do.
    pub op: LearnerOp,
}

/// The tensors of a rank that the driver reads and writes in slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Slot {
    /// The weights.
    Weights,
    /// The summed gradients.
    Gradient,
    /// The optimiser's first moments.
    FirstMoment,
    /// The optimiser's second moments.
    SecondMoment,
}

/// What a learner rank is asked.
#[derive(Debug, Serialize, Deserialize)]
pub enum LearnerOp {
    /// Starts a stage's optimiser; `counters` (calls, applied) restore a checkpoint's, whose
    /// moments then arrive by [`LearnerOp::Write`].
    BeginStage {
        /// The learning-rate schedule.
        schedule: LrSchedule,
        /// Global-norm clipping.
        grad_clip: f64,
        /// Optimiser calls and applied updates of the checkpoint resumed from.
        counters: Option<(u64, u64)>,
        /// ZeRO-1: the (offset, length) of the flat values whose optimiser state this rank
        /// keeps and updates; `None`: all of them.
        shard: Option<(usize, usize)>,
    },
    /// A critic rank's value at every response token of `rows`, `per` rows at a time.
    Values {
        /// The rows.
        rows: TokenRows,
        /// Rows per forward.
        per: usize,
    },
    /// The log-prob of every response token of `rows`, `per` rows at a time.
    Logp {
        /// The rows.
        rows: TokenRows,
        /// Sampling temperature.
        temperature: f32,
        /// Rows per forward.
        per: usize,
    },
    /// The gradient of this rank's share of a step, added to its summed gradients.
    Gradient(Work),
    /// Values `offset..offset + len` of a slot.
    Read {
        /// Which tensors.
        slot: Slot,
        /// First value.
        offset: usize,
        /// How many.
        len: usize,
    },
    /// Overwrites values of a slot from `offset`.
    Write {
        /// Which tensors.
        slot: Slot,
        /// First value.
        offset: usize,
        /// The values.
        #[serde(with = "learner::wire::floats")]
        values: Vec<f32>,
    },
    /// Applies the summed gradients (as written by the driver) and clears them: all of them,
    /// or, with `norm` (the whole gradient's global norm), the rank's shard only.
    Step {
        /// The global norm, for a ZeRO-1 rank.
        norm: Option<f64>,
    },
    /// The optimiser's calls and applied updates.
    Counters,
    /// Opens the rank's outbox for a group whose members present `key`, served on `host`.
    Open {
        /// The group's key.
        key: String,
        /// The address other hosts reach this rank's at.
        host: String,
    },
    /// Joins the group whose outboxes `members` are (this rank's at `rank`), owning
    /// `shards[rank]` of the model's flat values.
    Join {
        /// The group's key.
        key: String,
        /// This rank's place.
        rank: usize,
        /// Every rank's (offset, length).
        shards: Vec<(usize, usize)>,
        /// Every rank's outbox.
        members: Vec<Member>,
        /// How ranks reach each other's outboxes.
        reach: Reach,
    },
    /// Reduce-scatter of the gradients (published by the last [`LearnerOp::Gradient`]): sums
    /// this rank's shard of every rank's into its summed gradients; answers
    /// [`LearnerResponse::Reduced`].
    Reduce,
    /// All-gather: the other ranks' shards of `slot` from their outboxes — the summed
    /// gradients after a [`LearnerOp::Reduce`], or (ZeRO-1) the weights after a step.
    Gather {
        /// [`Slot::Gradient`] or [`Slot::Weights`].
        slot: Slot,
    },
    /// Copies the rank's group shard of `slot` — the weights or a moment — into its outbox,
    /// for the driver to read (the weights are published by every step too).
    Publish {
        /// Which tensors.
        slot: Slot,
    },
}

/// What a learner rank answers.
#[derive(Debug, Serialize, Deserialize)]
pub enum LearnerResponse {
    /// Done.
    Done,
    /// Values (log-probs, or a slot's slice).
    Values(#[serde(with = "learner::wire::floats")] Vec<f32>),
    /// A share's outcome.
    Outcome(Outcome),
    /// A step's report.
    Report(StepReport),
    /// Where the rank's outbox is.
    Opened(OutboxAddress),
    /// A reduce-scatter's result.
    Reduced {
        /// The squared norm of the rank's summed shard.
        squares: f64,
        /// Seconds the rank spent publishing its gradient in its outbox (part of the
        /// all-reduce, done at the end of the gradient's call).
        publish_s: f64,
    },
    /// The optimiser's calls and applied updates, and the values each of its moments holds.
    Counters {
        /// Optimiser calls.
        calls: u64,
        /// Applied updates.
        applied: u64,
        /// Values per moment (the model's, or the rank's shard's).
        moments: usize,
    },
}

/// One rank's training state.
struct Rank {
    trainee: Trainee,
    opt: Option<Optimizer>,
    /// ZeRO-1: the first flat value of the rank's shard.
    shard_offset: Option<usize>,
    steps: u64,
    /// The group the rank sums with: its outbox between `Open` and `Join`, then the group.
    exchange: Exchange,
    /// Seconds its last gradient's publication took.
    published_s: f64,
}

/// A rank's part in its group's exchange.
#[derive(Default)]
enum Exchange {
    /// None (one rank, or the driver sums).
    #[default]
    None,
    /// Its outbox is open; the others' are not known yet.
    Open(Outbox),
    /// Joined.
    Joined(Box<Group>),
}

/// What a rank trains.
enum Trainee {
    /// The policy on a training engine.
    Policy(Box<dyn TrainEngine>),
    /// The critic, with its gradient buffers (trunk, then head).
    Critic { critic: Box<Critic>, grads: Params },
}

impl Trainee {
    fn new_optimizer(&mut self, schedule: LrSchedule, clip: Option<f64>) -> Result<Optimizer> {
        Ok(match self {
            Trainee::Policy(e) => {
                Optimizer::new(&e.model()?.params, Default::default(), schedule, clip)
            }
            Trainee::Critic { grads, .. } => {
                Optimizer::new(grads, Default::default(), schedule, clip)
            }
        })
    }

    fn numel(&mut self) -> Result<usize> {
        Ok(match self {
            Trainee::Policy(e) => e.model()?.params.numel(),
            Trainee::Critic { grads, .. } => grads.numel(),
        })
    }

    fn reset(&mut self) {
        match self {
            Trainee::Policy(e) => e.reset_optimizer(),
            Trainee::Critic { grads, .. } => grads.fill_zero(),
        }
    }

    fn gradient(&mut self, work: &Work) -> Result<Outcome> {
        match self {
            Trainee::Policy(e) => learner::algo::dp::gradient(&mut **e, work),
            Trainee::Critic { critic, grads } => {
                learner::algo::dp::value_gradient(critic, grads, work)
            }
        }
    }

    fn read_weights(&mut self, offset: usize, len: usize) -> Result<Vec<f32>> {
        match self {
            Trainee::Policy(e) => wire::read_range(&e.model()?.params, offset, len),
            Trainee::Critic { critic, .. } => {
                critic.with_all(|all| wire::read_range(all, offset, len))
            }
        }
    }

    fn weights_into(&mut self, offset: usize, out: &mut [f32]) -> Result<()> {
        match self {
            Trainee::Policy(e) => wire::read_into(&e.model()?.params, offset, out),
            Trainee::Critic { critic, .. } => {
                critic.with_all(|all| wire::read_into(all, offset, out))
            }
        }
    }

    fn write_weights(&mut self, offset: usize, values: &[f32]) -> Result<()> {
        match self {
            Trainee::Policy(e) => wire::write_range(e.weights_mut()?, offset, values),
            Trainee::Critic { critic, .. } => {
                critic.with_all(|all| wire::write_range(all, offset, values))
            }
        }
    }

    fn gradients_mut(&mut self) -> Result<&mut Params> {
        match self {
            Trainee::Policy(e) => e.gradients_mut(),
            Trainee::Critic { grads, .. } => Ok(grads),
        }
    }

    fn step(&mut self, opt: &mut Optimizer, shard: Option<(usize, f64)>) -> Result<StepReport> {
        match (self, shard) {
            (Trainee::Policy(e), None) => e.step(opt),
            (Trainee::Policy(e), Some((offset, norm))) => e.step_range(opt, offset, norm),
            (Trainee::Critic { critic, grads }, shard) => {
                let report = match shard {
                    None => critic.step(opt, grads),
                    Some((offset, norm)) => {
                        critic.with_all(|all| opt.step_range(all, grads, offset, norm))?
                    }
                };
                grads.fill_zero();
                Ok(report)
            }
        }
    }
}

/// A policy or critic rank as an actor.
pub struct LearnerActor {
    config: ModelConfig,
    role: RankRole,
    precision: kernels::matmul::Precision,
    /// Taken out while a call runs.
    rank: RankCell,
}

impl Actor for LearnerActor {
    const KIND: &'static str = "learner";
    type Config = LearnerConfig;
    type Request = LearnerRequest;
    type Response = LearnerResponse;

    fn encode_request(r: &LearnerRequest) -> Result<Vec<u8>, String> {
        match &r.op {
            LearnerOp::Write {
                slot,
                offset,
                values,
            } => {
                let header = LearnerRequest {
                    steps: r.steps,
                    op: LearnerOp::Write {
                        slot: *slot,
                        offset: *offset,
                        values: Vec::new(),
                    },
                };
                frame(&header, values)
            }
            _ => frame(r, &[]),
        }
    }

    fn decode_request(bytes: &[u8]) -> Result<LearnerRequest, String> {
        let (header, bulk) = unframe(bytes)?;
        let mut r: LearnerRequest = serde_json::from_slice(header).map_err(|e| e.to_string())?;
        match &mut r.op {
            LearnerOp::Write { values, .. } => *values = bulk,
            _ if bulk.is_empty() => {}
            _ => return Err("values framed with a request that takes none".into()),
        }
        Ok(r)
    }

    fn encode_response(r: &LearnerResponse) -> Result<Vec<u8>, String> {
        match r {
            LearnerResponse::Values(v) => frame(&LearnerResponse::Values(Vec::new()), v),
            r => frame(r, &[]),
        }
    }

    fn decode_response(bytes: &[u8]) -> Result<LearnerResponse, String> {
        let (header, bulk) = unframe(bytes)?;
        let mut r: LearnerResponse = serde_json::from_slice(header).map_err(|e| e.to_string())?;
        match &mut r {
            LearnerResponse::Values(v) => *v = bulk,
            _ if bulk.is_empty() => {}
            _ => return Err("values framed with an answer that has none".into()),
        }
        Ok(r)
    }

    fn start(start: LearnerConfig) -> Result<Self, String> {
        let config = ModelConfig::from_json(start.model, Path::new("learner actor config"))
            .map_err(|e| e.to_string())?;
        Ok(Self {
            config,
            role: start.role,
            precision: start.precision,
            rank: RankCell::default(),
        })
    }

    async fn handle(&mut self, request: LearnerRequest) -> Result<LearnerResponse, CallError> {
        let mut rank = lock(&self.rank)
            .take()
            .ok_or("no weights yet: push a snapshot before training")?;
        // A policy rank joining a group can be found by a rollout engine beside it.
        let joins = match (&request.op, self.role) {
            (LearnerOp::Join { key, .. }, RankRole::Policy) => Some(key.clone()),
            _ => None,
        };
        // Training is long and CPU-bound: off the runtime's threads, the state moved there and
        // back (a panic kills the actor, as in a handler).
        let (rank, answer) = tokio::task::spawn_blocking(move || {
            let answer = rank.serve(request);
            (rank, answer)
        })
        .await
        .map_err(|e| match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => CallError::fatal(format!("learner rank: {e}")),
        })?;
        *lock(&self.rank) = Some(rank);
        if let (Some(key), Ok(_)) = (joins, &answer) {
            lock(&BESIDE).push((key, Arc::downgrade(&self.rank)));
        }
        answer
    }

    async fn load_weights(&mut self, snapshot: WeightSnapshot) -> Result<(), String> {
        let params = Arc::unwrap_or_clone(snapshot.into_params().map_err(|e| e.to_string())?);
        let trainee = match self.role {
            RankRole::Policy => {
                let mut model =
                    Model::new(self.config.clone(), params).map_err(|e| e.to_string())?;
                model.set_precision(self.precision);
                Trainee::Policy(
                    learner::engine::open(model, Backend::Native).map_err(|e| e.to_string())?,
                )
            }
            RankRole::Critic => {
                let mut critic =
                    Critic::from_all(&self.config, params).map_err(|e| e.to_string())?;
                critic.model.set_precision(self.precision);
                let grads = critic.zeros_grads();
                Trainee::Critic {
                    critic: Box::new(critic),
                    grads,
                }
            }
        };
        // A rank's group outlives new weights.
        let mut slot = lock(&self.rank);
        let exchange = slot.take().map(|r| r.exchange).unwrap_or_default();
        *slot = Some(Rank {
            trainee,
            opt: None,
            shard_offset: None,
            steps: 0,
            exchange,
            published_s: 0.0,
        });
        Ok(())
    }
}

impl Rank {
    fn serve(&mut self, request: LearnerRequest) -> Result<LearnerResponse, CallError> {
        if request.steps != self.steps {
            return Err(CallError::fatal(format!(
                "this rank has applied {} optimiser steps and the policy {}: it restarted and lost its state (the job continues from its last checkpoint)",
                self.steps, request.steps
            )));
        }
        let fatal = |e: learner::Error| CallError::fatal(e.to_string());
        Ok(match request.op {
            LearnerOp::BeginStage {
                schedule,
                grad_clip,
                counters,
                shard,
            } => {
                let numel = self.trainee.numel().map_err(fatal)?;
                let clip = Some(grad_clip);
                let mut opt = match shard {
                    Some((offset, len)) if offset + len <= numel => {
                        Optimizer::for_range(len, Default::default(), schedule, clip)
                    }
                    Some((offset, len)) => {
                        return Err(CallError::fatal(format!(
                            "a shard of values {offset}..{} of a model of {numel}",
                            offset + len,
                        )));
                    }
                    None => self.trainee.new_optimizer(schedule, clip).map_err(fatal)?,
                };
                self.shard_offset = shard.map(|(offset, _)| offset);
                if let Some((calls, applied)) = counters {
                    opt.calls = calls;
                    opt.applied = applied;
                }
                self.opt = Some(opt);
                self.trainee.reset();
                LearnerResponse::Done
            }
            LearnerOp::Logp {
                rows,
                temperature,
                per,
            } => {
                let Trainee::Policy(engine) = &self.trainee else {
                    return Err(CallError::fatal("a critic rank has no log-probs"));
                };
                LearnerResponse::Values(
                    rows.per_response_token(per, |b| Ok(engine.score(b, temperature)?.logp))
                        .map_err(fatal)?,
                )
            }
            LearnerOp::Values { rows, per } => {
                let Trainee::Critic { critic, .. } = &self.trainee else {
                    return Err(CallError::fatal("a policy rank has no values"));
                };
                LearnerResponse::Values(
                    rows.per_response_token(per, |b| critic.values(b))
                        .map_err(fatal)?,
                )
            }
            LearnerOp::Gradient(work) => {
                self.optimizer()?;
                let outcome = self.trainee.gradient(&work).map_err(fatal)?;
                // Published for the group's reduce-scatter.
                if let Exchange::Joined(group) = &mut self.exchange {
                    let started = std::time::Instant::now();
                    let grads = self.trainee.gradients_mut().map_err(fatal)?;
                    wire::read_into(grads, 0, group.outbox_mut()).map_err(fatal)?;
                    self.published_s = started.elapsed().as_secs_f64();
                }
                LearnerResponse::Outcome(outcome)
            }
            LearnerOp::Read { slot, offset, len } => {
                let values = match slot {
                    Slot::Weights => self.trainee.read_weights(offset, len),
                    slot => wire::read_range(self.slot_mut(slot)?, offset, len),
                };
                LearnerResponse::Values(values.map_err(fatal)?)
            }
            LearnerOp::Write {
                slot: Slot::Weights,
                offset,
                values,
            } => {
                if self.shard_offset.is_none() {
                    return Err(CallError::fatal(
                        "a rank that updates all its weights takes them only by its steps or a snapshot",
                    ));
                }
                self.trainee.write_weights(offset, &values).map_err(fatal)?;
                LearnerResponse::Done
            }
            LearnerOp::Write {
                slot,
                offset,
                values,
            } => {
                wire::write_range(self.slot_mut(slot)?, offset, &values).map_err(fatal)?;
                LearnerResponse::Done
            }
            LearnerOp::Step { norm } => {
                let opt = self.opt.as_mut().ok_or_else(no_stage)?;
                let shard = match (norm, self.shard_offset) {
                    (None, None) => None,
                    (Some(norm), Some(offset)) => Some((offset, norm)),
                    _ => {
                        return Err(CallError::fatal(
                            "a ZeRO-1 rank steps with the global norm, and only it does",
                        ));
                    }
                };
                let report = self.trainee.step(opt, shard).map_err(fatal)?;
                self.steps += 1;
                // In a group: the rank's shard of the new weights, published for the others'
                // all-gather (ZeRO-1) and the driver's reads.
                if let Exchange::Joined(_) = self.exchange {
                    self.publish(Slot::Weights)?;
                }
                LearnerResponse::Report(report)
            }
            LearnerOp::Counters => {
                let opt = self.optimizer()?;
                LearnerResponse::Counters {
                    calls: opt.calls,
                    applied: opt.applied,
                    moments: opt.moment_len(),
                }
            }
            LearnerOp::Open { key, host } => {
                let key = Token::new(&key).map_err(|e| CallError::fatal(e.to_string()))?;
                let values = self.trainee.numel().map_err(fatal)?;
                let outbox = Outbox::open(values, &key, &host).map_err(CallError::from)?;
                let address = outbox.address().clone();
                self.exchange = Exchange::Open(outbox);
                LearnerResponse::Opened(address)
            }
            LearnerOp::Join {
                key,
                rank,
                shards,
                members,
                reach,
            } => {
                let Exchange::Open(outbox) = std::mem::take(&mut self.exchange) else {
                    return Err(CallError::fatal(
                        "a rank joins a group after opening its outbox",
                    ));
                };
                let key = Token::new(&key).map_err(|e| CallError::fatal(e.to_string()))?;
                let group = Group::join(outbox, rank, shards, &members, &key, reach)?;
                self.exchange = Exchange::Joined(Box::new(group));
                LearnerResponse::Done
            }
            LearnerOp::Reduce => {
                let Exchange::Joined(group) = &mut self.exchange else {
                    return Err(no_group());
                };
                let grads = self.trainee.gradients_mut().map_err(fatal)?;
                let mut squares = 0.0f64;
                group.reduce_scatter(|at, sum| {
                    squares += kernels::optim::global_norm([sum]).powi(2);
                    wire::write_range(grads, at, sum).map_err(fatal)
                })?;
                LearnerResponse::Reduced {
                    squares,
                    publish_s: self.published_s,
                }
            }
            LearnerOp::Publish { slot } => {
                self.publish(slot)?;
                LearnerResponse::Done
            }
            LearnerOp::Gather { slot } => {
                let Exchange::Joined(group) = &mut self.exchange else {
                    return Err(no_group());
                };
                match slot {
                    Slot::Gradient => {
                        let grads = self.trainee.gradients_mut().map_err(fatal)?;
                        group.all_gather(|at, v| wire::write_range(grads, at, v).map_err(fatal))?;
                    }
                    Slot::Weights if self.shard_offset.is_some() => {
                        let trainee = &mut self.trainee;
                        group.all_gather(|at, v| trainee.write_weights(at, v).map_err(fatal))?;
                    }
                    slot => {
                        return Err(CallError::fatal(format!(
                            "a group gathers the summed gradients, or a ZeRO-1 rank's weights, not {slot:?}"
                        )));
                    }
                }
                LearnerResponse::Done
            }
        })
    }

    /// Copies the rank's group shard of `slot` (the weights or a moment) into its outbox. A
    /// ZeRO-1 rank's optimiser shard must be its group shard (its moments count from there).
    fn publish(&mut self, slot: Slot) -> Result<(), CallError> {
        let fatal = |e: learner::Error| CallError::fatal(e.to_string());
        let Exchange::Joined(group) = &mut self.exchange else {
            return Err(no_group());
        };
        let (a, l) = group.shard();
        if let Some(offset) = self.shard_offset.filter(|&o| o != a) {
            return Err(CallError::fatal(format!(
                "this rank's optimiser shard starts at {offset} and its group shard at {a}"
            )));
        }
        let out = &mut group.outbox_mut()[a..a + l];
        match slot {
            Slot::Weights => self.trainee.weights_into(a, out).map_err(fatal),
            Slot::FirstMoment | Slot::SecondMoment => {
                let from = if self.shard_offset.is_some() { 0 } else { a };
                let (m, v) = self.opt.as_mut().ok_or_else(no_stage)?.moments_mut();
                let moment = if slot == Slot::FirstMoment { m } else { v };
                wire::read_into(moment, from, out).map_err(fatal)
            }
            Slot::Gradient => Err(CallError::fatal(
                "a rank publishes its gradient with every Gradient call",
            )),
        }
    }

    fn optimizer(&mut self) -> Result<&mut Optimizer, CallError> {
        self.opt.as_mut().ok_or_else(no_stage)
    }

    /// The gradient sum or the optimiser's moments (the weights go through the trainee).
    fn slot_mut(&mut self, slot: Slot) -> Result<&mut Params, CallError> {
        Ok(match slot {
            Slot::Weights => {
                return Err(CallError::fatal(
                    "the weights are read and written whole-model",
                ));
            }
            Slot::Gradient => self
                .trainee
                .gradients_mut()
                .map_err(|e| CallError::fatal(e.to_string()))?,
            Slot::FirstMoment => self.optimizer()?.moments_mut().0,
            Slot::SecondMoment => self.optimizer()?.moments_mut().1,
        })
    }
}

/// A message across processes: `[header length: u32 LE][header: JSON][values: f32 LE]` — the
/// values of a `Write` or a `Values` answer travel raw (a copy each way), not as base64 in the
/// JSON.
fn frame(header: &impl Serialize, values: &[f32]) -> Result<Vec<u8>, String> {
    let h = serde_json::to_vec(header).map_err(|e| e.to_string())?;
    let len = u32::try_from(h.len()).map_err(|_| "a header over 4 GiB".to_string())?;
    let mut out = Vec::with_capacity(4 + h.len() + 4 * values.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&h);
    wire::push_le(&mut out, values);
    Ok(out)
}

/// The header and values of [`frame`]'s bytes.
fn unframe(bytes: &[u8]) -> Result<(&[u8], Vec<f32>), String> {
    let bad = || format!("a learner message of {} bytes is not framed", bytes.len());
    let len: [u8; 4] = bytes
        .get(..4)
        .ok_or_else(bad)?
        .try_into()
        .map_err(|_| bad())?;
    let end = 4 + u32::from_le_bytes(len) as usize;
    let header = bytes.get(4..end).ok_or_else(bad)?;
    let values = wire::from_le(&bytes[end..]).ok_or_else(bad)?;
    Ok((header, values))
}

fn no_group() -> CallError {
    CallError::fatal("this rank has joined no group (Open and Join first)")
}

fn no_stage() -> CallError {
    CallError::fatal("no stage has begun on this rank (BeginStage first)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_values_travel_raw_and_come_back_bit_for_bit() {
        let values = vec![0.1f32, -0.0, f32::NAN, 1e-45, f32::MAX];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let write = LearnerRequest {
            steps: 7,
            op: LearnerOp::Write {
                slot: Slot::Gradient,
                offset: 3,
                values: values.clone(),
            },
        };
        let bytes = LearnerActor::encode_request(&write).unwrap();
        // The values are the last 20 bytes, as they are in memory (little-endian).
        assert_eq!(&bytes[bytes.len() - 4..], &f32::MAX.to_le_bytes());
        let back = LearnerActor::decode_request(&bytes).unwrap();
        assert_eq!(back.steps, 7);
        let LearnerOp::Write {
            slot,
            offset,
            values: v,
        } = back.op
        else {
            panic!("{back:?}")
        };
        assert_eq!((slot, offset, bits(&v)), (Slot::Gradient, 3, bits(&values)));
        let answer = LearnerResponse::Values(values.clone());
        let bytes = LearnerActor::encode_response(&answer).unwrap();
        let LearnerResponse::Values(v) = LearnerActor::decode_response(&bytes).unwrap() else {
            panic!()
        };
        assert_eq!(bits(&v), bits(&values));
        let step = LearnerRequest {
            steps: 1,
            op: LearnerOp::Step { norm: Some(2.5) },
        };
        let back = LearnerActor::decode_request(&LearnerActor::encode_request(&step).unwrap());
        assert!(matches!(
            back.unwrap().op,
            LearnerOp::Step { norm: Some(2.5) }
        ));
        // Truncated or misframed bytes are refused, naming what is wrong.
        for bad in [
            &b"\x05\x00"[..],
            &b"\x09\x00\x00\x00{}"[..],
            &b"\x02\x00\x00\x00{}\x01"[..],
        ] {
            let e = LearnerActor::decode_request(bad).unwrap_err();
            assert!(e.contains("not framed"), "{e}");
        }
        let mut extra = LearnerActor::encode_request(&step).unwrap();
        extra.extend_from_slice(&1.0f32.to_le_bytes());
        assert!(
            LearnerActor::decode_request(&extra)
                .unwrap_err()
                .contains("takes none")
        );
    }
}
