//! The plan: a workflow parsed once into types. [`load`] reads a workflow file (YAML, `-o`
//! overrides, paths relative to the file) into its [`schema`], then [`Plan::new`] turns the
//! schema into a [`Plan`]: every name that picks a behaviour becomes an enum, every file it
//! names (datasets, tokenizer, chat template, programs) is opened or found, every RL stage's
//! step graph is expanded and checked, and every value is checked against its domain. There is
//! no separate validation: a plan that exists can run, and an error names the file, the field
//! and what is wrong before anything else happens.
//!
//! Owns: the typed description of a job and every check that can be made before it runs.
//! Never: runs anything, creates a run directory, or opens a device.

mod build;
pub mod error;
pub mod graph;
mod load;
mod prompts;
pub mod schema;
#[cfg(test)]
mod tests;

pub use error::PlanError;
pub use graph::{Artifact, Op, StepGraph};
pub use prompts::{PromptError, Prompts};
pub use schema::{AllReduce, Device, Workflow};

use actors::Strategy;
use learner::ModelConfig;
use learner::algo::policy::PolicyUpdate;
use learner::algo::value::ValueUpdate;
use learner::chat::ChatTemplate;
use learner::optim::LrSchedule;
use learner::rl::advantage::AdvEstimator;
use learner::tokenizer::Tokenizer;
use rollout::reward::Scorer;
use rollout::task::{Problem, Source};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A job, ready to run.
pub struct Plan {
    /// The job's name (names the default run directory).
    pub name: String,
    /// Seed of every random choice.
    pub seed: u64,
    /// The policy model and how its text is tokenized.
    pub model: ModelPlan,
    /// The rollout engines.
    pub rollout: RolloutPlan,
    /// The learner.
    pub learner: LearnerPlan,
    /// Stages in the order they run.
    pub stages: Vec<StagePlan>,
    /// The MLflow server and experiment the metrics also go to.
    pub mlflow: Option<crate::record::mlflow::MlflowTarget>,
    /// The workflow it was made from, resolved (overrides applied, paths absolute, steps
    /// counted): what the job store keeps and `trellis config show` prints.
    pub spec: Workflow,
}

/// Where the policy's weights come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A Hugging Face checkpoint folder.
    Checkpoint(PathBuf),
    /// A config, initialised with the job's seed.
    Init(ModelConfig),
}

/// The policy model.
pub struct ModelPlan {
    /// Its weights.
    pub source: ModelSource,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The tokenizer's `tokenizer.json` text (written into every checkpoint).
    pub tokenizer_json: String,
    /// The checkpoint's chat template, when a stage renders prompts through it.
    pub chat: Option<Arc<ChatTemplate>>,
}

/// Where a pool's actors run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In the driver's process.
    Local,
    /// On registered agents.
    Agents(Strategy),
}

/// The rollout engines.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutPlan {
    /// Engines in the pool.
    pub count: usize,
    /// Which engine.
    pub engine: RolloutEngine,
    /// Where the engines' actors run (external engines run where their endpoints are).
    pub placement: Placement,
    /// Engine `i` runs in the agent process of learner rank `i` (`placement: colocate`), and
    /// takes each update from that rank's memory.
    pub colocated: bool,
}

/// A rollout engine.
#[derive(Clone, Debug, PartialEq)]
pub enum RolloutEngine {
    /// This build's CPU engine.
    Native {
        /// KV-cache budget of the pool (shared by its local engines).
        kv_cache_bytes: usize,
        /// The number format of the weights the engines serve.
        weights_dtype: learner::params::WeightDtype,
        /// The number format of the engines' KV caches.
        kv_cache_dtype: learner::params::WeightDtype,
    },
    /// A PJRT plugin's device.
    Pjrt {
        /// Which device.
        device: Device,
        /// The plugin (default: found for the device where the actor runs).
        plugin: Option<PathBuf>,
        /// KV-cache budget (unused by today's static batching; kept for the pool's budget).
        kv_cache_bytes: usize,
    },
    /// Servers reached over HTTP.
    External(ExternalPlan),
}

impl RolloutPlan {
    /// The device an engine's actor occupies (what placement counts).
    pub fn device(&self) -> Device {
        match &self.engine {
            RolloutEngine::Pjrt { device, .. } => *device,
            RolloutEngine::Native { .. } | RolloutEngine::External(_) => Device::Cpu,
        }
    }
}

/// External engines.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalPlan {
    /// Their API: `vllm`, `sglang` or `served`.
    pub api: schema::Engine,
    /// One base URL per engine.
    pub endpoints: Vec<String>,
    /// The model they must serve (unset: whatever they serve).
    pub model: Option<String>,
    /// Where pushed weights are written (default: RUN_DIR/engine-weights).
    pub weights_dir: Option<PathBuf>,
    /// How long one call may take.
    pub timeout: Duration,
    /// How long one engine's weight push (reload, version, probe) may take.
    pub push_timeout: Duration,
    /// A call waiting longer than this checks the engine's `/health` (`None`: never).
    pub health_check: Option<Duration>,
    /// The number format of the pushed weight folders.
    pub weights_dtype: learner::params::WeightDtype,
    /// Largest log-prob difference the push probe allows.
    pub tolerance: f64,
    /// The key the endpoints want (read from `api_key_env` when the plan is built).
    pub api_key: Option<rollout::external::ApiKey>,
}

/// The learner.
#[derive(Clone, Debug, PartialEq)]
pub struct LearnerPlan {
    /// Which engine trains the policy.
    pub engine: LearnerEngine,
    /// Data-parallel ranks (1: the policy trains on one engine): native learner actors, or
    /// the devices of the pjrt engine's one client (replicas of its programs, in the driver).
    pub count: usize,
    /// Where the ranks run. One native rank in the driver process (`count: 1`, `local`), or a
    /// pjrt engine on any number of devices, is the policy on an engine of this process;
    /// anything else is learner actors.
    pub placement: Placement,
    /// The device each rank occupies.
    pub device: Device,
    /// ZeRO-1 over several ranks: each keeps and updates the optimiser state of 1/N of the
    /// model.
    pub shard_optimizer: bool,
    /// How several ranks sum their gradients.
    pub allreduce: AllReduce,
    /// The arithmetic of the native learner's matmuls (policy, critic, reference).
    pub precision: kernels::matmul::Precision,
}

impl LearnerPlan {
    /// Whether the policy trains on learner actors (several ranks, or ranks on agents) rather
    /// than on one engine in the driver process.
    pub fn on_actors(&self) -> bool {
        self.engine == LearnerEngine::Native
            && (self.count > 1 || self.placement != Placement::Local)
    }
}

/// A training engine.
#[derive(Clone, Debug, PartialEq)]
pub enum LearnerEngine {
    /// This build's CPU kernels.
    Native,
    /// A PJRT plugin's device.
    Pjrt {
        /// Which device.
        device: Device,
        /// The plugin (default: found for the device).
        plugin: Option<PathBuf>,
    },
}

/// One stage.
pub struct StagePlan {
    /// Its id.
    pub id: String,
    /// What it does.
    pub work: Work,
    /// Its problems (an eval stage without data of its own shares the previous stage's).
    pub data: Arc<DataPlan>,
    /// The reward (RL) and the eval's scorer (a Python reward's workers start on first use).
    pub reward: Scorer,
    /// Episodes score themselves (a stage with `data.env`), not `reward` — but for an agent
    /// program's stage that names a `reward`, which scores the transcripts.
    pub scores_episodes: bool,
    /// Steps (0 for an eval stage).
    pub steps: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_freq: u64,
    /// The stage ends at the first evaluation at or above this held-out accuracy.
    pub stop_at_accuracy: Option<f64>,
    /// Checkpoint every this many steps (0: only at the end).
    pub save_freq: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// The number format of checkpoints' weights.
    pub save_dtype: learner::params::WeightDtype,
    /// Tokens a greedy eval answer may take.
    pub eval_tokens: usize,
    /// Eval samples written out at each evaluation.
    pub log_generations: usize,
    /// The temperature evaluations sample at (0: greedy).
    pub eval_temperature: f32,
    /// Trained samples written out at every step.
    pub log_rollouts: bool,
}

/// What a stage does.
pub enum Work {
    /// Supervised fine-tuning.
    Sft(SftPlan),
    /// Reinforcement learning.
    Rl(Box<RlPlan>),
    /// Evaluation only.
    Eval,
}

/// A stage's problems, read once.
pub struct DataPlan {
    /// Where training problems come from.
    pub source: Source,
    /// The held-out problems.
    pub eval_set: Vec<Problem>,
    /// What training never draws (the held-out problems).
    pub exclude: HashSet<Problem>,
    /// Prompts are rendered through the chat template.
    pub chat_template: bool,
    /// Every sample is an episode in this environment (RL and eval).
    pub env: Option<EnvPlan>,
}

impl StagePlan {
    /// The request for problem `p` sampled with `params`: its prompt (through the chat template
    /// when the data asks for it, given the environment's tools), and its episode when the
    /// data has an environment (an agent program owes a reward unless the stage's reward
    /// scores its transcripts).
    pub fn request(
        &self,
        prompts: &Prompts<'_>,
        p: &Problem,
        params: rollout::SamplingParams,
    ) -> Result<rollout::GenerateRequest, PromptError> {
        let data = &self.data;
        let env = data.env.as_ref();
        let tools = env.and_then(|e| e.spec.tools());
        let (prompt, _) = prompts.encode_with_tools(p, data.chat_template, tools.as_ref())?;
        let episode = env.map(|e| {
            let mut episode = e.episode(p, data.chat_template);
            if let rollout::env::EnvSpec::Agent(a) = &mut episode.env {
                a.printed_reward = self.scores_episodes;
            }
            episode
        });
        Ok(rollout::GenerateRequest {
            prompt,
            params,
            episode,
        })
    }
}

/// A stage's environment.
#[derive(Clone, Debug, PartialEq)]
pub struct EnvPlan {
    /// Which.
    pub spec: rollout::env::EnvSpec,
    /// How the model writes tool calls.
    pub format: rollout::env::tools::ToolFormat,
    /// Model turns at most.
    pub max_turns: usize,
    /// Tokens after the prompt at most (`None`: as many as the model's context holds).
    pub max_episode_tokens: Option<usize>,
    /// Seconds one step may take.
    pub step_timeout_s: f64,
}

impl EnvPlan {
    /// The episode of `problem`, whose prompt `chat` rendered (each turn samples as many
    /// tokens as its request's `max_tokens` at most).
    pub fn episode(&self, problem: &Problem, chat: bool) -> rollout::episode::EpisodeSpec {
        rollout::episode::EpisodeSpec {
            env: self.spec.clone(),
            format: self.format,
            chat,
            prompt: problem.prompt.display().to_string(),
            answer: problem.answer.clone(),
            limits: rollout::episode::Limits {
                max_turns: self.max_turns,
                max_tokens: self.max_episode_tokens.unwrap_or(usize::MAX),
                step_timeout_s: self.step_timeout_s,
            },
        }
    }
}

/// SFT settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SftPlan {
    /// Problems per step.
    pub batch_size: usize,
    /// The learning rate per optimiser step, over the stage.
    pub schedule: LrSchedule,
}

/// RL settings.
#[derive(Clone, Debug)]
pub struct RlPlan {
    /// How advantages are estimated.
    pub estimator: AdvEstimator,
    /// How the policy is updated (loss, aggregation, epochs, mini-batch rows).
    pub update: PolicyUpdate,
    /// How responses are sampled.
    pub sampling: Sampling,
    /// Prompts per step.
    pub prompts_per_step: usize,
    /// Prompts per optimiser step.
    pub prompts_per_update: usize,
    /// The learning rate per optimiser step, over the stage.
    pub schedule: LrSchedule,
    /// Global gradient-norm clip.
    pub grad_clip: f64,
    /// How generation and training take turns.
    pub mode: Mode,
    /// The update's behaviour log-probs are the rollout engines' own, sent with the samples
    /// (`async` mode, or several updates a step with `algorithm.old_logp: engine`).
    pub engine_logp: bool,
    /// DAPO's dynamic sampling: most generation rounds per step.
    pub dynamic_sampling: Option<usize>,
    /// DAPO's overlong shaping.
    pub overlong: Option<Overlong>,
    /// PPO's critic.
    pub critic: Option<CriticPlan>,
    /// The step graph.
    pub graph: StepGraph,
}

impl RlPlan {
    /// Rows (responses) per optimiser step.
    pub fn rows_per_update(&self) -> usize {
        self.update.rows_per_update
    }

    /// Whether the actor loss has a KL term (so the stage keeps a reference policy).
    pub fn uses_reference(&self) -> bool {
        self.update.loss.kl.is_some()
    }
}

/// How responses are sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Responses per prompt.
    pub n: usize,
    /// Temperature (positive).
    pub temperature: f32,
    /// Nucleus threshold in (0, 1].
    pub top_p: f32,
    /// Most response tokens.
    pub max_tokens: usize,
}

/// How generation and training take turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Generate, then train, each step.
    Sync,
    /// Generation runs up to `max_staleness` steps ahead.
    Async {
        /// Steps ahead, and the weight versions a sample may lag.
        max_staleness: u64,
        /// What happens to samples that lag more.
        stale: schema::Stale,
    },
}

/// DAPO's overlong shaping.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overlong {
    /// The last this-many tokens before the budget are penalised linearly.
    pub buffer: usize,
    /// The penalty at the budget.
    pub factor: f64,
}

/// PPO's critic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CriticPlan {
    /// Its learning rate.
    pub lr: f32,
    /// How it is updated.
    pub update: ValueUpdate,
}

/// A reward program.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgramPlan {
    /// Node name.
    pub name: String,
    /// The program, found.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Where it runs: the workflow file's folder (so `[python3, score.py]` finds a `score.py`
    /// beside the workflow); `None`: the current directory (a workflow given as text).
    pub dir: Option<PathBuf>,
    /// How long it may run.
    pub timeout: Duration,
    /// Its address-space limit in bytes.
    pub memory_bytes: u64,
    /// Its score's weight.
    pub weight: f64,
    /// Added to the reward, or replacing it.
    pub mode: schema::ScoreMode,
}

/// A filter of prompt groups.
#[derive(Clone, Debug, PartialEq)]
pub struct FilterPlan {
    /// Node name.
    pub name: String,
    /// Groups whose scores' standard deviation is below this are dropped.
    pub min_group_std: f64,
    /// Groups with a response cut at the budget are dropped.
    pub drop_truncated: bool,
}

/// Reads the workflow file at `path`, applies `overrides` (`dotted.key=value`, the value in YAML
/// syntax) and makes its plan.
pub fn load(path: &Path, overrides: &[String]) -> Result<Plan, PlanError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| PlanError::new(&origin, e.to_string()))?;
    parse(&text, &origin, overrides)
}

/// As [`load`], from text (`origin` names it in errors; relative paths start at its folder).
pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Plan, PlanError> {
    Plan::new(load::resolve(text, origin, overrides)?, origin)
}

impl Plan {
    /// The plan of a resolved workflow (`origin` names it in errors).
    pub fn new(spec: Workflow, origin: &str) -> Result<Self, PlanError> {
        build::plan(spec, origin)
    }

    /// The stage called `id`.
    pub fn stage(&self, id: &str) -> Option<&StagePlan> {
        self.stages.iter().find(|s| s.id == id)
    }

    /// Whether the learner hands its new weights to the rollout engines on its device: a pjrt
    /// learner in this process and pjrt engines in this process on the same device and plugin
    /// (one PJRT client), so the weights never pass through the host.
    pub fn weights_stay_on_device(&self) -> bool {
        match (&self.learner.engine, &self.rollout.engine) {
            (
                LearnerEngine::Pjrt { device, plugin },
                RolloutEngine::Pjrt {
                    device: d,
                    plugin: p,
                    ..
                },
            ) => {
                !self.learner.on_actors()
                    && self.rollout.placement == Placement::Local
                    && device == d
                    && plugin == p
            }
            _ => false,
        }
    }

    /// Whether some stage trains on the engines' own log-probs (`async` mode, or
    /// `algorithm.old_logp: engine`).
    pub fn trains_on_engine_logprobs(&self) -> bool {
        self.stages.iter().any(|s| match &s.work {
            Work::Rl(rl) => rl.engine_logp,
            _ => false,
        })
    }

    /// How the rollout engines' side plays episodes for a model of `max_context` tokens, when
    /// some stage has an environment.
    pub fn agent_setup(&self, max_context: usize) -> Option<rollout::episode::AgentSetup> {
        self.stages
            .iter()
            .any(|s| s.data.env.is_some())
            .then(|| rollout::episode::AgentSetup {
                tokenizer_json: self.model.tokenizer_json.clone(),
                chat: self.model.chat.as_ref().map(|t| {
                    let (source, bos, eos) = t.parts();
                    (source.to_string(), bos.to_string(), eos.to_string())
                }),
                max_context,
            })
    }
}
