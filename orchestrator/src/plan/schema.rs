//! The workflow file as people write it: the YAML schema, with its defaults. Choices the
//! orchestrator makes (device, engine, placement, mode, stale policy, schedule, program mode)
//! are enums here already, so a misspelt one is refused at parse with the valid names; the
//! learner's own names (estimator, loss, aggregation, KL type) stay text until the plan parses
//! them with the learner's parsers. This is also what the job store keeps and `trellis config
//! show` prints (resolved: overrides applied, paths absolute, steps counted). The schema is
//! documented in `docs/workflow.md`.
//!
//! Owns: field names, defaults and their docs. Never: opens a file or checks a value (the plan
//! does both, once).

pub use actors::Device;
use rollout::reward::Reward;
use rollout::task::ArithTask;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A workflow: a model, pools, and stages run in dependency order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workflow {
    /// Job name (names the default run directory).
    pub name: String,
    /// Seed of every random choice (init, data, sampling).
    #[serde(default)]
    pub seed: u64,
    /// The policy model.
    pub model: ModelSpec,
    /// Where rollout and learner actors run.
    #[serde(default)]
    pub pools: Pools,
    /// Stages, chained with `after`.
    pub stages: Vec<Stage>,
    /// Experiment trackers the metrics also go to (besides `metrics.jsonl` and TensorBoard,
    /// which every run writes).
    #[serde(default)]
    pub tracking: Tracking,
}

/// Experiment trackers (VeRL's `trainer.logger`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Tracking {
    /// An MLflow tracking server.
    #[serde(default)]
    pub mlflow: Option<Mlflow>,
}

/// An MLflow tracking server and experiment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Mlflow {
    /// The server (`http[s]://host:port`); default: `MLFLOW_TRACKING_URI`.
    #[serde(default)]
    pub uri: Option<String>,
    /// The experiment (made when it does not exist); default: the workflow's `name`.
    #[serde(default)]
    pub experiment: Option<String>,
}

/// The model: a checkpoint folder, or a config to initialise randomly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Hugging Face checkpoint folder.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Hugging Face config fields (`arch` or `model_type`, `hidden_size`, ...) for random init.
    #[serde(default)]
    pub init: Option<serde_json::Value>,
    /// `builtin:arith`, or a `tokenizer.json` path (default: the checkpoint's).
    #[serde(default)]
    pub tokenizer: Option<String>,
}

/// Rollout and learner pools.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Pools {
    /// Inference engines.
    #[serde(default)]
    pub rollout: Pool,
    /// Training engines.
    #[serde(default)]
    pub learner: Pool,
}

/// An engine: this build's, a PJRT plugin's, or an external server's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// This build's CPU engine.
    Native,
    /// The model compiled to StableHLO and run by a PJRT plugin on the pool's device.
    Pjrt,
    /// A vLLM server.
    Vllm,
    /// An SGLang server.
    Sglang,
    /// `trellis engine serve`.
    Served,
}

impl Engine {
    /// Whether the engine is a server reached over HTTP.
    pub fn is_external(self) -> bool {
        matches!(self, Engine::Vllm | Engine::Sglang | Engine::Served)
    }
}

/// How a learner pool's ranks sum their gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllReduce {
    /// Among themselves: through shared memory between ranks on one host, over TCP streams
    /// (authenticated by a key per pool, not encrypted — as NCCL's and gloo's) between hosts.
    #[default]
    Ranks,
    /// Among themselves, over TCP streams always (ranks on one host that do not share its
    /// `/dev/shm`, as containers).
    Streams,
    /// Through the driver, as actor calls (over TLS when the cluster's agents serve it): for
    /// networks where gradients must not travel unencrypted; several times slower.
    Driver,
}

/// Where a pool's actors run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// In the driver's process.
    Local,
    /// On registered agents, fewest agents first.
    Pack,
    /// On registered agents, one per agent first.
    Spread,
    /// On registered agents, rollout engine `i` in the agent process of learner rank `i`
    /// (placed by the other pool's `pack` or `spread`; `spread` when both say `colocate`):
    /// the engine then takes each update from the rank's memory, no copy.
    Colocate,
}

/// One pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    /// `cpu`, `gpu` or `tpu`.
    #[serde(default = "default_device")]
    pub device: Device,
    /// Devices (or engines) in the pool: a native rollout pool runs this many engines, prompts
    /// spread over them; the learner trains data-parallel on this many ranks (native: learner
    /// actors; pjrt: devices of one plugin client in the driver, gradients summed by an
    /// all-reduce compiled into the program).
    #[serde(default = "one")]
    pub count: usize,
    /// `native` (this build's CPU engine); `pjrt` (the model compiled to StableHLO and run by a
    /// PJRT plugin on `device`); for rollout also an external engine server reached over HTTP:
    /// `vllm`, `sglang`, or `served` (`trellis engine serve`).
    #[serde(default = "default_engine")]
    pub engine: Engine,
    /// `local` (in the driver process), or on registered agents (`trellis agent`): `pack` (fewest
    /// agents), `spread` (one per agent first) or `colocate` (the rollout and learner pools'
    /// actors in pairs, engine `i` in the process of learner rank `i`). Agents need `trellis
    /// train --listen`.
    #[serde(default = "default_placement")]
    pub placement: Placement,
    /// Base URLs of the external engines (`http://host:port` or `https://host:port`), one
    /// engine each. `https://` endpoints are checked against the system's CA certificates
    /// (or `SSL_CERT_FILE`).
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// The environment variable holding the API key the endpoints want (sent as `Authorization:
    /// Bearer KEY`); the key itself never goes in a workflow.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The model the endpoints must serve (vLLM's model id, SGLang's model path); unset:
    /// whatever they serve.
    #[serde(default)]
    pub model: Option<String>,
    /// A folder every endpoint can read, where each pushed weight version is written as a new
    /// checkpoint folder (default: RUN_DIR/engine-weights; on a cluster, a shared filesystem).
    #[serde(default)]
    pub weights_dir: Option<PathBuf>,
    /// Seconds one HTTP call to an engine may take (a generation included).
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
    /// Seconds one engine's weight push may take — pause, reload, version, resume and the probe
    /// together (default 120); past it the engine is out of service, and gets the weights when
    /// it answers again. Pushes to the engines run at once.
    #[serde(default)]
    pub push_timeout_s: Option<f64>,
    /// Seconds after which a call still waiting on an engine (a generation, a reload) checks
    /// that the engine is alive: `GET /health`, answered within as many seconds, again every
    /// as many while the call waits (default 10). An engine that does not answer — a frozen
    /// process, a host gone — is out of service at once instead of at `timeout_s`. 0: never.
    #[serde(default)]
    pub health_check_s: Option<f64>,
    /// The number format of the weights the engines serve: `f32` (default) or `bf16`. For
    /// external engines, the pushed weight folders (half the bytes to write and reload; the
    /// push's probe expects the rounded weights, so it stays exact); for the native engine, its
    /// products (the learner's `precision: bf16` rule on `vdpbf16ps`, attention's products
    /// included; decode steps stream bf16 matrices, half the bytes), with embeddings, norms,
    /// softmaxes and log-probs in f32.
    #[serde(default)]
    pub weights_dtype: Option<learner::params::WeightDtype>,
    /// The number format of a native engine's KV cache: `f32` or `bf16` (keys and values
    /// rounded as they are cached: twice the tokens in `kv_cache_mib`, half the bytes a decode
    /// step's attention reads; sums stay f32); by default `weights_dtype`'s.
    #[serde(default)]
    pub kv_cache_dtype: Option<learner::params::WeightDtype>,
    /// Largest |log-prob difference| allowed between an engine and the learner on the probe
    /// that checks every weight push (raise it for bf16 engines).
    #[serde(default = "default_tolerance")]
    pub verify_tolerance: f64,
    /// The PJRT plugin of `engine: pjrt` (`libtpu.so`, the CUDA plugin, `xla_cpu_pjrt.so`);
    /// unset: `TRELLIS_PJRT_PLUGIN`, else the one pip installed for `device`.
    #[serde(default)]
    pub plugin: Option<PathBuf>,
    /// KV-cache budget of a native rollout pool, in MiB (shared by its engines when local;
    /// each agent's engine gets all of it).
    #[serde(default = "default_kv_cache_mib")]
    pub kv_cache_mib: usize,
    /// Learner pools of several ranks: ZeRO-1 — each rank keeps and updates the optimiser's
    /// moments of 1/N of the model, and the ranks exchange their updated shards (default
    /// true; false: every rank keeps all of them).
    #[serde(default)]
    pub shard_optimizer: Option<bool>,
    /// Learner pools of several ranks: how the ranks sum their gradients — `ranks` (default:
    /// among themselves, shared memory on a host and TCP streams across), `streams` (among
    /// themselves over TCP always) or `driver` (through the driver's actor calls, TLS when the
    /// cluster has it).
    #[serde(default)]
    pub allreduce: Option<AllReduce>,
    /// The arithmetic of the learner's matmuls (policy, critic and reference alike; native or
    /// pjrt):
    /// `f32` (default), or `bf16` — operands rounded to bf16 and products summed in f32, as
    /// `torch.autocast(dtype=bfloat16)` runs a linear layer, with f32 master weights, optimiser
    /// moments, norms, softmax and loss; twice the f32 rate on CPUs with AVX512-BF16.
    #[serde(default)]
    pub precision: Option<kernels::matmul::Precision>,
}

impl Default for Pool {
    fn default() -> Self {
        Self {
            device: default_device(),
            count: 1,
            engine: default_engine(),
            placement: default_placement(),
            endpoints: Vec::new(),
            api_key_env: None,
            model: None,
            weights_dir: None,
            timeout_s: default_timeout(),
            push_timeout_s: None,
            health_check_s: None,
            weights_dtype: None,
            kv_cache_dtype: None,
            verify_tolerance: default_tolerance(),
            plugin: None,
            kv_cache_mib: default_kv_cache_mib(),
            shard_optimizer: None,
            allreduce: None,
            precision: None,
        }
    }
}

fn default_kv_cache_mib() -> usize {
    256
}

fn default_timeout() -> f64 {
    300.0
}

fn default_tolerance() -> f64 {
    1e-3
}

fn default_placement() -> Placement {
    Placement::Local
}

fn default_device() -> Device {
    Device::Cpu
}
fn default_engine() -> Engine {
    Engine::Native
}
fn one() -> usize {
    1
}

/// What a stage does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StageKind {
    /// Supervised fine-tuning on the task's answers.
    Sft,
    /// Reinforcement learning with rewards.
    Rl,
    /// Evaluation only.
    Eval,
}

/// Where a stage's problems come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    /// The built-in arithmetic task, seeded.
    Arith,
    /// The built-in guessing game's secrets (`digits`; `demos` for SFT), for `env: guess`.
    Guess,
    /// A JSON-lines file.
    Jsonl,
    /// A Parquet file's flat columns.
    Parquet,
}

/// Data of a stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Data {
    /// The task: `arith` (built in, seeded), `guess` (the built-in guessing game's secrets),
    /// `jsonl` (a JSON-lines file) or `parquet` (a Parquet file's flat columns).
    pub task: Task,
    /// `arith` settings (flattened: `digits`, `ops`, `reverse_answer`).
    #[serde(flatten)]
    pub arith: ArithTask,
    /// Held-out problems for evaluation (a dataset without `eval_path`: the last this-many rows of
    /// a seeded shuffle).
    #[serde(default = "default_eval_size")]
    pub eval_size: usize,
    /// `jsonl`, `parquet`: the training file, or a list of files read one after the other (as
    /// VeRL's `data.train_files`; relative paths start at the workflow file's folder).
    #[serde(default, deserialize_with = "one_or_many")]
    pub path: Option<Vec<PathBuf>>,
    /// `jsonl`, `parquet`: a held-out file, or a list of them.
    #[serde(default, deserialize_with = "one_or_many")]
    pub eval_path: Option<Vec<PathBuf>>,
    /// `jsonl`, `parquet`: the key (column) of the prompt: text, or a conversation (a list of
    /// `{role, content}` messages, as VeRL's preprocessed `prompt`), which is rendered through
    /// the checkpoint's chat template.
    #[serde(default = "default_prompt_key")]
    pub prompt_key: String,
    /// `jsonl`, `parquet`: the key (column) of the answer; dots reach into a struct or object
    /// (VeRL's `reward_model.ground_truth`).
    #[serde(default = "default_answer_key")]
    pub answer_key: String,
    /// `jsonl`, `parquet`: the key (column) whose value a Python reward gets as `data_source`
    /// (VeRL's `data.reward_fn_key`); rows without it get the reward's own `data_source`. A
    /// row's `extra_info` column, when there is one, is passed as `extra_info`.
    #[serde(default = "default_reward_fn_key")]
    pub reward_fn_key: String,
    /// `jsonl`, `parquet`: text around each prompt, `{prompt}` standing for it (e.g. VeRL's
    /// GSM8K instruction: `"{prompt} Let's think step by step and output the final answer after
    /// \"####\"."`); applied before the chat template.
    #[serde(default)]
    pub prompt_template: Option<String>,
    /// Render each prompt as a user message through the checkpoint's chat template
    /// (`tokenizer_config.json` of `model.path`).
    #[serde(default)]
    pub chat_template: bool,
    /// `jsonl`, `parquet`: the longest prompt, in tokens (after the template and the chat
    /// template), as VeRL's `data.max_prompt_length`; a longer one is refused before the run
    /// starts, naming it, unless `filter_overlong_prompts`.
    #[serde(default)]
    pub max_prompt_length: Option<usize>,
    /// Drop the rows whose prompt is over `max_prompt_length` instead (VeRL's
    /// `data.filter_overlong_prompts`), train and eval rows alike.
    #[serde(default)]
    pub filter_overlong_prompts: bool,
    /// RL and eval: every sample is an episode in this environment — model turns, tool
    /// results or replies, until it is done — which scores it (docs/agents.md).
    #[serde(default)]
    pub env: Option<EnvConfig>,
}

/// An environment's settings (`data.env`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvConfig {
    /// `calculator` (tool use), `guess` (higher/lower replies), `command`: a program of one's
    /// own, started for every episode, speaking JSON lines, or `agent`: an agent program of
    /// one's own, started for every episode, that runs its own loop against an OpenAI
    /// endpoint — the agent gateway — and prints its reward (docs/agents.md).
    #[serde(rename = "type")]
    pub kind: EnvKind,
    /// `command`, `agent`: the program and its arguments (relative paths start at the workflow's
    /// folder, where it runs).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// `command`, `agent`: its name in metrics (`env/<name>/failed`).
    #[serde(default)]
    pub name: Option<String>,
    /// `command`, `agent`: the program's address-space limit, in MiB.
    #[serde(default = "default_env_memory_mb")]
    pub memory_mb: u64,
    /// Model turns at most.
    #[serde(default = "default_max_turns")]
    pub max_turns: usize,
    /// Tokens after the prompt, the model's and the environment's (default: what the model's
    /// context holds); each turn samples `max_response_length` at most.
    #[serde(default)]
    pub max_episode_tokens: Option<usize>,
    /// Seconds one environment step may take (an agent program: its own time between two
    /// calls); a slower one fails that episode only.
    #[serde(default = "default_step_timeout_s")]
    pub step_timeout_s: f64,
    /// How the model writes tool calls: `compact` (`<call>…</call>`, the `builtin:tools`
    /// tokenizer's default) or `hermes` (`<tool_call>{json}</tool_call>`, anything else's).
    #[serde(default)]
    pub tool_format: Option<rollout::env::tools::ToolFormat>,
}

/// Which environment (`data.env.type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvKind {
    /// The built-in tool-use task.
    Calculator,
    /// The built-in higher/lower task.
    Guess,
    /// A program of one's own.
    Command,
    /// An agent program of one's own, through the agent gateway.
    Agent,
}

fn default_env_memory_mb() -> u64 {
    2048
}
fn default_max_turns() -> usize {
    4
}
fn default_step_timeout_s() -> f64 {
    30.0
}

fn default_prompt_key() -> String {
    "prompt".into()
}
fn default_answer_key() -> String {
    "answer".into()
}
fn default_reward_fn_key() -> String {
    "data_source".into()
}

/// A path or a list of them (null: none).
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<PathBuf>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged, expecting = "a path or a list of paths")]
    enum Files {
        One(PathBuf),
        Many(Vec<PathBuf>),
    }
    Ok(match Option::<Files>::deserialize(d)? {
        None => None,
        Some(Files::One(p)) => Some(vec![p]),
        Some(Files::Many(v)) => Some(v),
    })
}

fn default_eval_size() -> usize {
    200
}

/// RL algorithm settings, with VeRL's names. Batch sizes are counted in prompts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Algorithm {
    /// `grpo`, `rloo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `opo`.
    pub adv_estimator: String,
    /// GRPO: divide by the group's std.
    pub norm_adv_by_std_in_grpo: bool,
    /// Samples per prompt.
    pub rollout_n: usize,
    /// Prompts per RL step.
    pub train_batch_size: usize,
    /// Prompts per optimiser update.
    pub ppo_mini_batch_size: usize,
    /// Passes over each batch.
    pub ppo_epochs: usize,
    /// Where several updates a step (mini-batches, epochs) in `sync` mode take the behaviour
    /// policy's log-probs from: `recompute` (VeRL's: a learner forward over the batch before
    /// the first update, which also reports `rollout/logprob_diff_mean|max`) or `engine` (the
    /// log-probs the rollout engines sampled with: no forward; where the engines compute as the
    /// learner does, as the native ones do, they differ by f32 noise). `async` mode always
    /// takes the engines'.
    pub old_logp: OldLogpSource,
    /// `vanilla`, `gspo`, `cispo`, `gpg`.
    pub policy_loss: String,
    /// PPO clip ε.
    pub clip_ratio: f64,
    /// ε_low (defaults to clip_ratio).
    pub clip_ratio_low: Option<f64>,
    /// ε_high (defaults to clip_ratio).
    pub clip_ratio_high: Option<f64>,
    /// Loss aggregation.
    pub loss_agg_mode: String,
    /// Entropy bonus.
    pub entropy_coeff: f64,
    /// Learning rate.
    pub lr: f32,
    /// Warmup steps.
    pub lr_warmup_steps: u64,
    /// `constant`, or `cosine` decay to `min_lr_ratio · lr` at the stage's last step (VeRL's
    /// `warmup_style`).
    pub lr_schedule: Schedule,
    /// Floor of the cosine schedule, as a fraction of `lr`.
    pub min_lr_ratio: f32,
    /// Global gradient-norm clip.
    pub grad_clip: f64,
    /// Sampling temperature.
    pub temperature: f32,
    /// Nucleus sampling.
    pub top_p: f32,
    /// Most response tokens.
    pub max_response_length: usize,
    /// DAPO dynamic sampling: drop groups whose scores are all equal and draw more prompts.
    pub filter_groups: bool,
    /// Most generation rounds per step under `filter_groups`.
    pub max_num_gen_batches: usize,
    /// DAPO overlong shaping: the last this-many tokens before `max_response_length` are
    /// penalised linearly (0: off).
    pub overlong_buffer_len: usize,
    /// Penalty at `max_response_length`.
    pub overlong_penalty_factor: f64,
    /// Add a KL loss against the reference policy (the weights at the start of the stage).
    pub use_kl_loss: bool,
    /// Its coefficient.
    pub kl_loss_coef: f64,
    /// Its estimator: `k1`, `k2`/`mse`, `k3`/`low_var_kl`, `abs` (a `+` suffix: straight-through).
    pub kl_loss_type: String,
    /// GAE discount (`adv_estimator: gae`).
    pub gamma: f64,
    /// GAE λ.
    pub lam: f64,
    /// Critic learning rate (`adv_estimator: gae`).
    pub critic_lr: f32,
    /// Critic value clip (VeRL's `cliprange_value`).
    pub cliprange_value: f64,
}

impl Default for Algorithm {
    fn default() -> Self {
        Self {
            adv_estimator: "grpo".into(),
            norm_adv_by_std_in_grpo: true,
            rollout_n: 8,
            train_batch_size: 64,
            ppo_mini_batch_size: 64,
            ppo_epochs: 1,
            old_logp: OldLogpSource::Recompute,
            policy_loss: "vanilla".into(),
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            loss_agg_mode: "token-mean".into(),
            entropy_coeff: 0.0,
            lr: 1e-4,
            lr_warmup_steps: 0,
            lr_schedule: Schedule::Constant,
            min_lr_ratio: 0.0,
            grad_clip: 1.0,
            temperature: 1.0,
            top_p: 1.0,
            max_response_length: 16,
            filter_groups: false,
            max_num_gen_batches: 4,
            overlong_buffer_len: 0,
            overlong_penalty_factor: 1.0,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: "low_var_kl".into(),
            gamma: 1.0,
            lam: 1.0,
            critic_lr: 1e-4,
            cliprange_value: 0.5,
        }
    }
}

/// Where the behaviour policy's log-probs come from ([`Algorithm::old_logp`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OldLogpSource {
    /// A learner forward over the batch before its first update.
    Recompute,
    /// The rollout engines' own, sent with the samples.
    Engine,
}

/// The shape of a learning-rate schedule after its warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Flat.
    Constant,
    /// Cosine decay to `min_lr_ratio · lr` at the stage's last step.
    Cosine,
}

/// How generation and training take turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Generate, then train, each step.
    Sync,
    /// Generation of later steps overlaps training.
    Async,
}

/// What `async` mode does with samples too many versions behind the learner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stale {
    /// Train on the rest.
    Drop,
    /// Generate their prompts again on the current weights.
    Wait,
}

/// Step counts and cadences.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Trainer {
    /// Steps of the stage.
    pub steps: u64,
    /// Passes over a dataset's training rows; when set, it decides `steps` (rounded up; a step
    /// takes `train_batch_size` prompts, or SFT's `batch_size` problems).
    pub total_epochs: Option<f64>,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_freq: u64,
    /// End the stage at the first evaluation whose held-out accuracy reaches this (`steps`
    /// stays the most it runs): a warm start handed over at a level, not after a step count
    /// whose level moves with the machine.
    pub stop_at_accuracy: Option<f64>,
    /// Checkpoint every this many steps (0: only at the end).
    pub save_freq: u64,
    /// `sync` (generate, then train, each step) or `async` (generation of later steps overlaps
    /// training; samples carry their weight version).
    pub mode: Mode,
    /// `async`: generation runs up to this many steps ahead, and a sample whose oldest token is
    /// more than this many weight versions behind the learner is stale.
    pub max_staleness: u64,
    /// `async`: what happens to stale samples: `drop` (train on the rest) or `wait` (generate
    /// their prompts again on the current weights).
    pub stale_samples: Stale,
    /// Checkpoints kept on disk (older ones are deleted once a newer one is recorded).
    pub max_ckpt_to_keep: usize,
    /// The number format of checkpoints' weights: `f32` (what trains), or `bf16` (half the
    /// bytes, what vLLM and SGLang load with `--dtype auto`; the f32 weights are kept beside
    /// the optimiser state, so resuming stays exact).
    pub save_dtype: learner::params::WeightDtype,
    /// At every evaluation, write this many of its samples (prompt, response, answer, score) to
    /// `RUN_DIR/generations/<stage>/step_<N>.jsonl` (VeRL's `log_val_generations`); 0: none.
    pub log_generations: usize,
    /// Sample evaluations at this temperature (a seed per held-out problem, the same at every
    /// evaluation) instead of greedily (0): the success rate of the policy as it samples, for
    /// tasks where greedy decoding is not what RL improves (VeRL's `val_kwargs.temperature`).
    pub eval_temperature: f32,
    /// RL: write every trained sample of every step (its prompt's position in the stage's
    /// stream, prompt, response, answer, score, weight version) to
    /// `RUN_DIR/rollouts/<stage>/step_<N>.jsonl` (VeRL's `trainer.rollout_data_dir`).
    pub log_rollouts: bool,
}

impl Default for Trainer {
    fn default() -> Self {
        Self {
            steps: 100,
            total_epochs: None,
            eval_freq: 0,
            stop_at_accuracy: None,
            save_freq: 0,
            mode: Mode::Sync,
            max_staleness: 1,
            stale_samples: Stale::Drop,
            max_ckpt_to_keep: 1,
            save_dtype: learner::params::WeightDtype::F32,
            log_generations: 0,
            eval_temperature: 0.0,
            log_rollouts: false,
        }
    }
}

/// SFT settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sft {
    /// Problems per step.
    pub batch_size: usize,
    /// Learning rate.
    pub lr: f32,
    /// Warmup steps.
    pub lr_warmup_steps: u64,
    /// `constant`, or `cosine` decay to `min_lr_ratio · lr` at the stage's last step.
    pub lr_schedule: Schedule,
    /// Floor of the cosine schedule, as a fraction of `lr`.
    pub min_lr_ratio: f32,
}

impl Default for Sft {
    fn default() -> Self {
        Self {
            batch_size: 64,
            lr: 1e-3,
            lr_warmup_steps: 10,
            lr_schedule: Schedule::Constant,
            min_lr_ratio: 0.0,
        }
    }
}

/// One stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// Unique id.
    pub id: String,
    /// What it does.
    pub kind: StageKind,
    /// Stages that must finish first.
    #[serde(default)]
    pub after: Vec<String>,
    /// Its data (eval stages default to the previous stage's).
    #[serde(default)]
    pub data: Option<Data>,
    /// SFT settings.
    #[serde(default)]
    pub sft: Sft,
    /// RL settings.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// RL reward (default `exact_match`; none with `data.env`, whose environment scores).
    #[serde(default)]
    pub reward: Option<Reward>,
    /// Steps and cadences.
    #[serde(default)]
    pub trainer: Trainer,
    /// Extra nodes in each RL step (see [`super::graph`]).
    #[serde(default)]
    pub nodes: Vec<UserNode>,
}

/// A node a workflow adds to the RL step graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UserNode {
    /// An external reward program.
    Program(ProgramNode),
    /// Drops prompt groups.
    Filter(FilterNode),
}

impl UserNode {
    /// Its name.
    pub fn name(&self) -> &str {
        match self {
            Self::Program(p) => &p.name,
            Self::Filter(f) => &f.name,
        }
    }

    /// Its `after` and `before` lists.
    pub fn order(&self) -> (&[String], &[String]) {
        match self {
            Self::Program(p) => (&p.after, &p.before),
            Self::Filter(f) => (&f.after, &f.before),
        }
    }
}

/// An external command scoring responses: it reads one JSON object per line (`prompt`,
/// `response`, `answer`) on stdin and writes one number per line on stdout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgramNode {
    /// Node name.
    pub name: String,
    /// Program and arguments (no shell).
    pub command: Vec<String>,
    /// Seconds before the program is killed and the batch scored as failed.
    #[serde(default = "default_program_timeout")]
    pub timeout_s: f64,
    /// Address-space limit of the program, in MiB.
    #[serde(default = "default_program_memory")]
    pub memory_mb: u64,
    /// Its score is multiplied by this and added to the reward (`mode: add`) or replaces it
    /// (`mode: replace`).
    #[serde(default = "one_f64")]
    pub weight: f64,
    /// `add` or `replace`.
    #[serde(default = "default_program_mode")]
    pub mode: ScoreMode,
    /// Nodes that run first (default: `reward`).
    #[serde(default)]
    pub after: Vec<String>,
    /// Nodes that run after it (default: every built-in node reading what it writes).
    #[serde(default)]
    pub before: Vec<String>,
}

/// Drops whole prompt groups before the advantages are computed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterNode {
    /// Node name.
    pub name: String,
    /// Drop groups whose scores' standard deviation is below this (they carry no GRPO signal).
    #[serde(default)]
    pub min_group_std: f64,
    /// Drop groups with a response cut at `max_response_length`.
    #[serde(default)]
    pub drop_truncated: bool,
    /// Nodes that run first (default: `reward`).
    #[serde(default)]
    pub after: Vec<String>,
    /// Nodes that run after it (default: every built-in node reading what it writes).
    #[serde(default)]
    pub before: Vec<String>,
}

fn default_program_timeout() -> f64 {
    60.0
}
fn default_program_memory() -> u64 {
    2048
}
fn one_f64() -> f64 {
    1.0
}
fn default_program_mode() -> ScoreMode {
    ScoreMode::Add
}

/// How a program's score meets the reward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoreMode {
    /// Added to the reward (times `weight`).
    Add,
    /// Replaces it (times `weight`).
    Replace,
}
