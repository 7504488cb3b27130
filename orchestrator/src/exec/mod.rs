//! The executor: runs a [`Plan`]'s stages against roles. SFT steps, evaluations, RL steps walked
//! through their step graph ([`step`]: the nodes of a level that only read the step's
//! artifacts run concurrently, the ones that change models or engines one at a time; each node
//! kind in its own file under [`nodes`]), checkpoints at their cadence, and stops on request
//! after a step with a checkpoint. It holds no model: it asks the policy, reference, critic and
//! rollout roles, and cannot tell a local one from an actor.
//!
//! Owns: the order of work within a job, the cadence (eval, checkpoint, stop), weight versions,
//! and the step's artifacts. Never: computes a gradient or a loss (the learner does), samples
//! (the engines do), or prints (it tells its [`Records`]).

mod board;
mod data_metrics;
mod eval;
mod nodes;
mod stage;
mod step;

pub use crate::plan::Prompts;

use crate::plan::Plan;
use crate::record::{RecordError, Records};
use crate::roles::{RoleError, Rollouts};
use crate::store::{Progress, StoreError};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// What stops a job's work.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// A model, tokenizer or checkpoint.
    #[error(transparent)]
    Learner(#[from] learner::Error),
    /// An RL formula's inputs.
    #[error(transparent)]
    Rl(#[from] learner::rl::RlError),
    /// Weights left on a device could not be read back.
    #[error(transparent)]
    DeviceWeights(#[from] kernels::tensor::DeviceReadError),
    /// A role (the policy, its reference or critic, the rollout engines).
    #[error(transparent)]
    Role(#[from] RoleError),
    /// The job store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A sink of the run's record.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// A file of the run directory.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A prompt the chat template cannot render.
    #[error(transparent)]
    Chat(#[from] learner::chat::ChatError),
    /// A problem that cannot become tokens.
    #[error(transparent)]
    Prompt(#[from] crate::plan::PromptError),
    /// The reward could not score (a Python reward that fails on every sample).
    #[error(transparent)]
    Reward(#[from] rollout::reward::RewardError),
    /// Stopped on request after a step, with a checkpoint of it.
    #[error("stopped on request after {stage} step {step} (checkpointed)")]
    Stopped {
        /// The stage it stopped in.
        stage: String,
        /// The last step done.
        step: u64,
    },
    /// Something the executor itself got wrong (a bug, named).
    #[error("internal error: {0}")]
    Internal(String),
}

impl ExecError {
    fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ExecError {
        let path = path.into();
        move |source| ExecError::Io { path, source }
    }
}

/// The roles a job's executor talks to for its whole run.
pub struct Roles {
    /// The model being trained.
    pub policy: Box<dyn crate::roles::Policy>,
    /// The rollout engines (shared with generations running ahead in `async` mode).
    pub rollouts: Arc<dyn Rollouts>,
    /// Makes each RL stage's reference and critic.
    pub maker: Box<dyn crate::roles::RoleMaker>,
}

/// Everything an executor needs besides its roles.
pub struct Job<'a> {
    /// What to run.
    pub plan: &'a Plan,
    /// The run directory (checkpoints).
    pub dir: &'a std::path::Path,
    /// The job store and the job's id in it.
    pub store: &'a dyn crate::store::JobStore,
    /// The job's id.
    pub id: u64,
    /// Where rows and progress go.
    pub records: Records<'a>,
    /// Whether the job was asked to stop (checked after each step).
    pub stop: &'a (dyn Fn() -> bool + Sync),
}

/// What a finished run reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Eval accuracy after each stage that evaluated, by stage id.
    pub eval_accuracy: BTreeMap<String, f64>,
    /// Steps run in this invocation (not counting those resumed over).
    pub steps_run: u64,
    /// `resume` found the run finished already.
    pub finished_before: bool,
}

/// Runs a job's stages.
pub struct Executor<'a> {
    pub(crate) job: Job<'a>,
    pub(crate) roles: Roles,
    pub(crate) prompts: Prompts<'a>,
    /// Where the job stands (from the store: completed stages, the last checkpoint).
    pub(crate) state: Progress,
    /// The weight version the rollout engines serve.
    pub(crate) version: u64,
    summary: Summary,
}
