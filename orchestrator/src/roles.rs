//! Roles: what the executor may ask of the models of a job. The policy (log-probs, its updates,
//! its weights), the reference policy and the critic of an RL stage, and the rollout engines.
//! The executor holds roles, never a model: a role is local (a model in this process, on a
//! [`TrainEngine`]) or actor-backed (the policy as data-parallel [`LearnerPool`] ranks, the
//! rollout engines as a [`RolloutPool`]), and the executor cannot tell which it talks to.
//!
//! Owns: the role interfaces, their local implementations, and [`RoleMaker`], which builds a
//! stage's reference and critic. Never: decides what to train on or when (the executor does),
//! or knows the run directory's layout beyond the folder a call names.

use crate::pools::PoolError;
use crate::pools::learner::LearnerPool;
use crate::pools::rollout::{Pulls, RolloutPool};
use kernels::matmul::Precision;
use kernels::tensor::WeightSnapshot;
use learner::algo::TokenRows;
use learner::algo::policy::{PolicyBatch, PolicyUpdate};
use learner::algo::sft::SftStep;
use learner::algo::value::{CriticTrainer, ValueUpdate};
use learner::critic::Critic as ValueModel;
use learner::engine::TrainEngine;
use learner::optim::{LrSchedule, Optimizer};
use learner::params::WeightDtype;
use learner::rl::Metrics;
use learner::{Model, ModelConfig, Params};
use rollout::{Completion, GenerateRequest};
use std::path::Path;
use std::sync::Arc;

/// Why a role could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// A model, checkpoint or RL formula refused.
    #[error(transparent)]
    Learner(#[from] learner::Error),
    /// The rollout engines.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A call made out of order (an update before the stage's optimiser exists).
    #[error("{0}")]
    Protocol(&'static str),
}

impl RoleError {
    /// Whether trying again can succeed (an engine or agent that did not answer), as opposed to
    /// a call that will fail the same way every time.
    pub fn is_retryable(&self) -> bool {
        match self {
            RoleError::Pool(p) => p.is_retryable(),
            RoleError::Learner(_) | RoleError::Protocol(_) => false,
        }
    }
}

/// Result with [`RoleError`].
pub type Result<T, E = RoleError> = std::result::Result<T, E>;

/// The model being trained.
pub trait Policy: Send + Sync {
    /// Its configuration.
    fn config(&self) -> &ModelConfig;

    /// The log-prob of every response token of `rows` at `temperature`, `per` rows at a time
    /// (`[rows, cols]`).
    fn logp(&self, rows: &TokenRows, temperature: f32, per: usize) -> Result<Vec<f32>>;

    /// Starts a stage's optimiser on `schedule`, restored from the checkpoint folder `resume`
    /// when the stage continues from one.
    fn begin_stage(
        &mut self,
        schedule: LrSchedule,
        grad_clip: f64,
        resume: Option<&Path>,
    ) -> Result<()>;

    /// One SFT step on (prompt, answer) pairs.
    fn sft_step(&mut self, examples: &[(Vec<u32>, Vec<u32>)]) -> Result<SftStep>;

    /// One RL update over a batch (every epoch and mini-batch).
    fn update(&mut self, batch: PolicyBatch<'_>, cfg: &PolicyUpdate) -> Result<Metrics>;

    /// Its weights, as `version`.
    fn snapshot(&mut self, version: u64) -> Result<WeightSnapshot>;

    /// Where rollout engines on agents can read the weights of the last
    /// [`Policy::snapshot`] themselves, from the learner ranks that hold them (each rank
    /// serving its shard) rather than from the driver; `None`: only from the snapshot.
    fn weight_source(&self) -> Option<actors::exchange::Source> {
        None
    }

    /// Writes a checkpoint folder: the model in Hugging Face layout with its side files, and
    /// the optimiser's state when `with_optimizer`.
    fn save(&mut self, dir: &Path, with_optimizer: bool, dtype: WeightDtype) -> Result<()>;
}

/// A frozen policy the KL loss compares against.
pub trait Reference: Send + Sync {
    /// As [`Policy::logp`].
    fn logp(&self, rows: &TokenRows, temperature: f32, per: usize) -> Result<Vec<f32>>;
}

/// PPO's value model.
pub trait Critic: Send + Sync {
    /// The value at every response token of `rows`, `per` rows at a time.
    fn values(&self, rows: &TokenRows, per: usize) -> Result<Vec<f32>>;

    /// One update towards `returns` from the values the batch was generated with.
    fn update(
        &mut self,
        rows: &TokenRows,
        old_values: &[f32],
        returns: &[f32],
        cfg: &ValueUpdate,
    ) -> Result<Metrics>;

    /// Writes itself and its optimiser under `dir/critic`.
    fn save(&self, dir: &Path) -> Result<()>;
}

/// The rollout engines.
pub trait Rollouts: Send + Sync {
    /// Completions of `reqs`, ordered by request, then sample.
    fn generate(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>>;

    /// Swaps in new weights before returning: no generation sees two versions. Engines on
    /// agents take them from `source` (the learner ranks) when given; returns how many did.
    fn update_weights(
        &self,
        snapshot: WeightSnapshot,
        source: Option<actors::exchange::Source>,
    ) -> Result<Pulls>;

    /// Where each engine runs.
    fn locations(&self) -> Vec<String>;

    /// Engines out of service now.
    fn down_count(&self) -> usize;
}

impl Rollouts for RolloutPool {
    fn generate(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>> {
        Ok(RolloutPool::generate(self, reqs)?)
    }

    fn update_weights(
        &self,
        snapshot: WeightSnapshot,
        source: Option<actors::exchange::Source>,
    ) -> Result<Pulls> {
        Ok(RolloutPool::update_weights_from(self, snapshot, source)?)
    }

    fn locations(&self) -> Vec<String> {
        RolloutPool::locations(self)
    }

    fn down_count(&self) -> usize {
        RolloutPool::down_count(self)
    }
}

impl Policy for LearnerPool {
    fn config(&self) -> &ModelConfig {
        LearnerPool::config(self)
    }

    fn logp(&self, rows: &TokenRows, temperature: f32, per: usize) -> Result<Vec<f32>> {
        Ok(LearnerPool::logp(self, rows, temperature, per)?)
    }

    fn begin_stage(
        &mut self,
        schedule: LrSchedule,
        grad_clip: f64,
        resume: Option<&Path>,
    ) -> Result<()> {
        Ok(LearnerPool::begin_stage(self, schedule, grad_clip, resume)?)
    }

    fn sft_step(&mut self, examples: &[(Vec<u32>, Vec<u32>)]) -> Result<SftStep> {
        Ok(LearnerPool::sft_step(self, examples)?)
    }

    fn update(&mut self, batch: PolicyBatch<'_>, cfg: &PolicyUpdate) -> Result<Metrics> {
        Ok(LearnerPool::update(self, batch, cfg)?)
    }

    fn snapshot(&mut self, version: u64) -> Result<WeightSnapshot> {
        Ok(LearnerPool::snapshot(self, version)?)
    }

    fn weight_source(&self) -> Option<actors::exchange::Source> {
        LearnerPool::weight_source(self)
    }

    fn save(&mut self, dir: &Path, with_optimizer: bool, dtype: WeightDtype) -> Result<()> {
        Ok(LearnerPool::save(self, dir, with_optimizer, dtype)?)
    }
}

impl Critic for LearnerPool {
    fn values(&self, rows: &TokenRows, per: usize) -> Result<Vec<f32>> {
        Ok(LearnerPool::values(self, rows, per)?)
    }

    fn update(
        &mut self,
        rows: &TokenRows,
        old_values: &[f32],
        returns: &[f32],
        cfg: &ValueUpdate,
    ) -> Result<Metrics> {
        Ok(self.value_update(rows, old_values, returns, cfg)?)
    }

    fn save(&self, dir: &Path) -> Result<()> {
        Ok(self.save_critic(dir)?)
    }
}

/// Builds a stage's reference policy and critic.
pub trait RoleMaker: Send + Sync {
    /// A reference policy with `weights`.
    fn reference(&self, config: &ModelConfig, weights: Arc<Params>) -> Result<Box<dyn Reference>>;

    /// A critic: the one saved under `resume` (with its optimiser), or a new one whose trunk
    /// starts from the policy's `weights` with a zero value head.
    fn critic(
        &self,
        config: &ModelConfig,
        weights: Arc<Params>,
        resume: Option<&Path>,
        lr: f32,
        grad_clip: f64,
    ) -> Result<Box<dyn Critic>>;
}

/// The policy in this process, on a training engine.
pub struct LocalPolicy {
    engine: Box<dyn TrainEngine>,
    /// The current stage's optimiser.
    opt: Option<Optimizer>,
    /// Side files of its checkpoints (tokenizer, chat template, generation config).
    assets: Vec<(String, Vec<u8>)>,
    /// Snapshots leave the weights on the engine's device (for rollout engines on it).
    on_device: bool,
}

impl LocalPolicy {
    /// The policy on `engine`, its checkpoints carrying `assets`.
    pub fn new(engine: Box<dyn TrainEngine>, assets: Vec<(String, Vec<u8>)>) -> Self {
        Self {
            engine,
            opt: None,
            assets,
            on_device: false,
        }
    }

    /// Whether its snapshots leave the weights on the engine's device (a copy there, read to
    /// the host only when someone asks): for rollout engines on the same device and client.
    /// Engines whose weights live on the host hand them shared as always.
    pub fn weights_on_device(self, on_device: bool) -> Self {
        Self { on_device, ..self }
    }
}

impl Policy for LocalPolicy {
    fn config(&self) -> &ModelConfig {
        self.engine.config()
    }

    fn logp(&self, rows: &TokenRows, temperature: f32, per: usize) -> Result<Vec<f32>> {
        Ok(rows.per_response_token(per, |b| Ok(self.engine.score(b, temperature)?.logp))?)
    }

    fn begin_stage(
        &mut self,
        schedule: LrSchedule,
        grad_clip: f64,
        resume: Option<&Path>,
    ) -> Result<()> {
        let params = &self.engine.model()?.params;
        let mut opt = Optimizer::new(params, Default::default(), schedule, Some(grad_clip));
        if let Some(dir) = resume {
            opt.load(&dir.join("optimizer"))?;
        }
        self.opt = Some(opt);
        // A stage's optimiser is new (or restored from its checkpoint): an engine that keeps
        // moments of its own starts from it.
        self.engine.reset_optimizer();
        Ok(())
    }

    fn sft_step(&mut self, examples: &[(Vec<u32>, Vec<u32>)]) -> Result<SftStep> {
        let opt = self
            .opt
            .as_mut()
            .ok_or(RoleError::Protocol("an SFT step before the stage began"))?;
        Ok(learner::algo::sft::step(&mut *self.engine, opt, examples)?)
    }

    fn update(&mut self, batch: PolicyBatch<'_>, cfg: &PolicyUpdate) -> Result<Metrics> {
        let opt = self
            .opt
            .as_mut()
            .ok_or(RoleError::Protocol("an update before the stage began"))?;
        Ok(learner::algo::policy::update(
            &mut *self.engine,
            opt,
            batch,
            cfg,
        )?)
    }

    fn snapshot(&mut self, version: u64) -> Result<WeightSnapshot> {
        if self.on_device
            && let Some(weights) = self.engine.device_weights()?
        {
            return Ok(WeightSnapshot::on_device(version, weights));
        }
        // Shared, not copied: engines in this process serve these very values.
        Ok(WeightSnapshot::new(
            version,
            Arc::new(self.engine.share_weights()?),
        ))
    }

    fn save(&mut self, dir: &Path, with_optimizer: bool, dtype: WeightDtype) -> Result<()> {
        let opt = match (with_optimizer, self.opt.as_mut()) {
            (false, _) => None,
            (true, None) => {
                return Err(RoleError::Protocol(
                    "a save with the optimiser before the stage began",
                ));
            }
            (true, Some(opt)) => {
                // An engine that keeps its moments elsewhere copies them in first.
                self.engine.sync_optimizer(opt)?;
                Some(&*opt)
            }
        };
        let model = self.engine.model()?;
        learner::checkpoint::save(model, &self.assets, dir, opt, dtype)?;
        Ok(())
    }
}

/// A reference policy in this process.
pub struct LocalReference(Model);

impl Reference for LocalReference {
    fn logp(&self, rows: &TokenRows, temperature: f32, per: usize) -> Result<Vec<f32>> {
        Ok(rows.per_response_token(per, |b| Ok(self.0.score(b, temperature)?.logp))?)
    }
}

/// A critic in this process.
pub struct LocalCritic(CriticTrainer);

impl Critic for LocalCritic {
    fn values(&self, rows: &TokenRows, per: usize) -> Result<Vec<f32>> {
        Ok(self.0.values(rows, per)?)
    }

    fn update(
        &mut self,
        rows: &TokenRows,
        old_values: &[f32],
        returns: &[f32],
        cfg: &ValueUpdate,
    ) -> Result<Metrics> {
        Ok(self.0.update(rows, old_values, returns, cfg)?)
    }

    fn save(&self, dir: &Path) -> Result<()> {
        self.0.critic.save(&dir.join("critic"))?;
        self.0.opt.save(&dir.join("critic").join("optimizer"))?;
        Ok(())
    }
}

/// The critic a stage starts with: the one saved under `resume/critic`, or a new one whose
/// trunk is the policy's `weights` with a zero value head; and whether it was saved.
fn initial_critic(
    config: &ModelConfig,
    weights: Arc<Params>,
    resume: Option<&Path>,
) -> Result<(ValueModel, Option<std::path::PathBuf>)> {
    let saved = resume.map(|d| d.join("critic")).filter(|d| d.exists());
    let critic = match &saved {
        Some(d) => ValueModel::load(d, config)?,
        None => {
            let trunk = Model::new(config.clone(), Arc::unwrap_or_clone(weights))?;
            ValueModel::from_policy(&trunk)
        }
    };
    Ok((critic, saved))
}

/// Makes the roles of a job whose policy trains on learner ranks: the critic on as many ranks,
/// placed alike (the reference, which never trains, stays in this process).
pub struct RankRoles {
    /// Where the ranks' agents register, when placed on them.
    pub cluster: Option<crate::pools::Cluster>,
    /// Ranks.
    pub count: usize,
    /// Where they run.
    pub placement: crate::plan::Placement,
    /// The device each occupies.
    pub device: crate::plan::Device,
    /// ZeRO-1.
    pub shard_optimizer: bool,
    /// How the ranks sum their gradients.
    pub allreduce: crate::plan::AllReduce,
    /// The arithmetic of the ranks' matmuls.
    pub precision: Precision,
}

impl RoleMaker for RankRoles {
    fn reference(&self, config: &ModelConfig, weights: Arc<Params>) -> Result<Box<dyn Reference>> {
        LocalRoles {
            precision: self.precision,
        }
        .reference(config, weights)
    }

    fn critic(
        &self,
        config: &ModelConfig,
        weights: Arc<Params>,
        resume: Option<&Path>,
        lr: f32,
        grad_clip: f64,
    ) -> Result<Box<dyn Critic>> {
        let (critic, saved) = initial_critic(config, weights, resume)?;
        let mut note = |_: &str| {};
        let mut pool = LearnerPool::start(crate::pools::learner::LearnerStart {
            count: self.count,
            placement: self.placement,
            device: self.device,
            cluster: self.cluster.as_ref(),
            stop: &|| false,
            note: &mut note,
            config,
            weights: WeightSnapshot::new(0, Arc::new(critic.into_all())),
            assets: Vec::new(),
            shard_optimizer: self.shard_optimizer,
            allreduce: self.allreduce,
            precision: self.precision,
            role: crate::kinds::learner::RankRole::Critic,
            beside: None,
        })?;
        pool.begin_stage(LrSchedule::constant(lr), grad_clip, saved.as_deref())?;
        Ok(Box::new(pool))
    }
}

/// Makes local roles.
pub struct LocalRoles {
    /// The arithmetic of their matmuls.
    pub precision: Precision,
}

impl RoleMaker for LocalRoles {
    fn reference(&self, config: &ModelConfig, weights: Arc<Params>) -> Result<Box<dyn Reference>> {
        let mut model = Model::new(config.clone(), Arc::unwrap_or_clone(weights))?;
        model.set_precision(self.precision);
        Ok(Box::new(LocalReference(model)))
    }

    fn critic(
        &self,
        config: &ModelConfig,
        weights: Arc<Params>,
        resume: Option<&Path>,
        lr: f32,
        grad_clip: f64,
    ) -> Result<Box<dyn Critic>> {
        let (mut critic, saved) = initial_critic(config, weights, resume)?;
        critic.model.set_precision(self.precision);
        let mut opt = critic.optimizer(
            Default::default(),
            LrSchedule::constant(lr),
            Some(grad_clip),
        );
        if let Some(d) = saved {
            opt.load(&d.join("optimizer"))?;
        }
        Ok(Box::new(LocalCritic(CriticTrainer::new(critic, opt))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use learner::engine::Backend;

    /// The policy hands its weights to engines in this process without a copy, and its next
    /// step never changes what it handed over.
    #[test]
    fn a_snapshot_shares_the_engines_weights_and_keeps_its_values_through_the_next_step() {
        let model = crate::kinds::rollout::tests::tiny(1);
        let engine = learner::engine::open(model.clone(), Backend::Native).unwrap();
        let mut policy = LocalPolicy::new(engine, Vec::new());
        policy
            .begin_stage(LrSchedule::constant(1e-2), 1.0, None)
            .unwrap();
        let snap = policy.snapshot(1).unwrap();
        let trained = &policy.engine.model().unwrap().params;
        for (s, w) in snap.params().unwrap().tensors.iter().zip(&trained.tensors) {
            assert!(s.data.same_memory(&w.data), "{} was copied", s.name);
        }
        policy.sft_step(&[(vec![1, 2, 3], vec![4, 5, 6])]).unwrap();
        assert_eq!(
            **snap.params().unwrap(),
            model.params,
            "the step wrote into the snapshot"
        );
        assert_ne!(policy.engine.model().unwrap().params, model.params);
    }
}
