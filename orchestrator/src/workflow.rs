//! The workflow file: schema, loading with `file:line:column` errors, `-o dotted.key=value`
//! overrides, and validation before anything runs. The schema is documented in
//! `docs/workflow.md`.

use rollout::reward::Reward;
use rollout::task::{ArithTask, Problem};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

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

/// One pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    /// `cpu`, `gpu` or `tpu`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Devices (or engines) in the pool: a native rollout pool runs this many engines, prompts
    /// spread over them; the native learner trains on one.
    #[serde(default = "one")]
    pub count: usize,
    /// `native` (this build's CPU engine); `pjrt` (the model compiled to StableHLO and run by a
    /// PJRT plugin on `device`); for rollout also an external engine server reached over HTTP:
    /// `vllm`, `sglang`, or `served` (`trellis engine serve`).
    #[serde(default = "default_engine")]
    pub engine: String,
    /// `local` (in the driver process), or on registered agents (`trellis agent`): `pack` (fewest
    /// agents) or `spread` (one per agent first). Agents need `trellis train --listen`.
    #[serde(default = "default_placement")]
    pub placement: String,
    /// Base URLs of the external engines (`http://host:port`), one engine each.
    #[serde(default)]
    pub endpoints: Vec<String>,
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
    /// Largest |log-prob difference| allowed between an engine and the learner on the probe
    /// that checks every weight push (raise it for bf16 engines).
    #[serde(default = "default_tolerance")]
    pub verify_tolerance: f64,
    /// The PJRT plugin of `engine: pjrt` (`libtpu.so`, the CUDA plugin, `xla_cpu_pjrt.so`);
    /// unset: `TRELLIS_PJRT_PLUGIN`, else the one pip installed for `device`.
    #[serde(default)]
    pub plugin: Option<PathBuf>,
}

impl Default for Pool {
    fn default() -> Self {
        Self {
            device: default_device(),
            count: 1,
            engine: default_engine(),
            placement: default_placement(),
            endpoints: Vec::new(),
            model: None,
            weights_dir: None,
            timeout_s: default_timeout(),
            verify_tolerance: default_tolerance(),
            plugin: None,
        }
    }
}

impl Pool {
    /// Whether the pool's engines are external servers reached over HTTP.
    pub fn is_external(&self) -> bool {
        EXTERNAL_ENGINES.contains(&self.engine.as_str())
    }
}

/// Engines reached over HTTP.
pub const EXTERNAL_ENGINES: &[&str] = &["vllm", "sglang", "served"];

fn default_timeout() -> f64 {
    300.0
}

fn default_tolerance() -> f64 {
    1e-3
}

fn default_placement() -> String {
    "local".into()
}

fn default_device() -> String {
    "cpu".into()
}
fn default_engine() -> String {
    "native".into()
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

/// Data of a stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Data {
    /// The task: `arith` (built in, seeded), `jsonl` (a JSON-lines file) or `parquet` (a
    /// Parquet file's flat columns).
    pub task: String,
    /// `arith` settings (flattened: `digits`, `ops`, `reverse_answer`).
    #[serde(flatten)]
    pub arith: ArithTask,
    /// Held-out problems for evaluation (a dataset without `eval_path`: the last this-many rows of
    /// a seeded shuffle).
    #[serde(default = "default_eval_size")]
    pub eval_size: usize,
    /// `jsonl`, `parquet`: the training file (relative paths start at the workflow file's folder).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// `jsonl`, `parquet`: a held-out file.
    #[serde(default)]
    pub eval_path: Option<PathBuf>,
    /// `jsonl`, `parquet`: the key (column) of the prompt.
    #[serde(default = "default_prompt_key")]
    pub prompt_key: String,
    /// `jsonl`, `parquet`: the key (column) of the answer.
    #[serde(default = "default_answer_key")]
    pub answer_key: String,
    /// `jsonl`, `parquet`: text around each prompt, `{prompt}` standing for it (e.g. VeRL's
    /// GSM8K instruction: `"{prompt} Let's think step by step and output the final answer after
    /// \"####\"."`); applied before the chat template.
    #[serde(default)]
    pub prompt_template: Option<String>,
    /// Render each prompt as a user message through the checkpoint's chat template
    /// (`tokenizer_config.json` of `model.path`).
    #[serde(default)]
    pub chat_template: bool,
}

fn default_prompt_key() -> String {
    "prompt".into()
}
fn default_answer_key() -> String {
    "answer".into()
}

/// Where a stage's problems come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// The built-in arithmetic task.
    Arith(ArithTask),
    /// A JSON-lines or Parquet dataset, read once.
    Jsonl(std::sync::Arc<rollout::task::Dataset>),
}

impl Data {
    /// Reads the stage's problems (errors name the file, line and key).
    pub fn source(&self, seed: u64) -> Result<Source, String> {
        match self.task.as_str() {
            "arith" => Ok(Source::Arith(self.arith.clone())),
            task @ ("jsonl" | "parquet") => {
                let read = if task == "jsonl" {
                    rollout::task::read_jsonl
                } else {
                    rollout::task::read_parquet
                };
                let path = self
                    .path
                    .as_ref()
                    .ok_or_else(|| format!("data.path is required with task: {task}"))?;
                let read = |p: &Path| -> Result<Vec<Problem>, String> {
                    let mut rows = read(p, &self.prompt_key, &self.answer_key)?;
                    if let Some(t) = &self.prompt_template {
                        for r in &mut rows {
                            r.prompt = t.replace("{prompt}", &r.prompt);
                        }
                    }
                    Ok(rows)
                };
                let train = read(path)?;
                let eval = match &self.eval_path {
                    Some(p) => Some(read(p)?),
                    None => None,
                };
                Ok(Source::Jsonl(std::sync::Arc::new(
                    rollout::task::Dataset::split(train, eval, self.eval_size, seed),
                )))
            }
            other => Err(format!(
                "data.task `{other}`: expected arith, jsonl or parquet"
            )),
        }
    }
}

impl Source {
    /// The held-out problems.
    pub fn eval_set(&self, seed: u64, size: usize) -> Vec<Problem> {
        match self {
            Source::Arith(a) => a.eval_set(seed, size),
            Source::Jsonl(d) => d.eval.clone(),
        }
    }

    /// Training problems `start..start+count` (never one of `exclude`, for `arith`; a dataset's
    /// split keeps its eval rows out by construction).
    pub fn train_batch(
        &self,
        seed: u64,
        start: u64,
        count: usize,
        exclude: &std::collections::HashSet<Problem>,
    ) -> Vec<Problem> {
        match self {
            Source::Arith(a) => a.train_batch(seed, start, count, exclude),
            Source::Jsonl(d) => d.train_batch(seed, start, count),
        }
    }

    /// Whether answers are short arithmetic results (eval then needs only a few tokens).
    pub fn is_arith(&self) -> bool {
        matches!(self, Source::Arith(_))
    }
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
    pub lr_schedule: String,
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
            policy_loss: "vanilla".into(),
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            loss_agg_mode: "token-mean".into(),
            entropy_coeff: 0.0,
            lr: 1e-4,
            lr_warmup_steps: 0,
            lr_schedule: "constant".into(),
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
    /// Checkpoint every this many steps (0: only at the end).
    pub save_freq: u64,
    /// `sync` (generate, then train, each step) or `async` (generation of later steps overlaps
    /// training; samples carry their weight version).
    pub mode: String,
    /// `async`: generation runs up to this many steps ahead, and a sample whose oldest token is
    /// more than this many weight versions behind the learner is stale.
    pub max_staleness: u64,
    /// `async`: what happens to stale samples: `drop` (train on the rest) or `wait` (generate
    /// their prompts again on the current weights).
    pub stale_samples: String,
    /// Checkpoints kept on disk (older ones are deleted once a newer one is recorded).
    pub max_ckpt_to_keep: usize,
}

impl Default for Trainer {
    fn default() -> Self {
        Self {
            steps: 100,
            total_epochs: None,
            eval_freq: 0,
            save_freq: 0,
            mode: "sync".into(),
            max_staleness: 1,
            stale_samples: "drop".into(),
            max_ckpt_to_keep: 1,
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
    pub lr_schedule: String,
    /// Floor of the cosine schedule, as a fraction of `lr`.
    pub min_lr_ratio: f32,
}

impl Default for Sft {
    fn default() -> Self {
        Self {
            batch_size: 64,
            lr: 1e-3,
            lr_warmup_steps: 10,
            lr_schedule: "constant".into(),
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
    /// RL reward.
    #[serde(default = "default_reward")]
    pub reward: Reward,
    /// Steps and cadences.
    #[serde(default)]
    pub trainer: Trainer,
    /// Extra nodes in each RL step (see [`crate::graph`]).
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
    pub mode: String,
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
fn default_program_mode() -> String {
    "add".into()
}

fn default_reward() -> Reward {
    Reward::ExactMatch
}

/// A workflow error, naming where.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct WorkflowError(pub String);

fn err(msg: impl Into<String>) -> WorkflowError {
    WorkflowError(msg.into())
}

/// Reads `path`, applies `overrides` (`dotted.key=value`, value in YAML syntax) and validates.
pub fn load(path: &Path, overrides: &[String]) -> Result<Workflow, WorkflowError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    parse(&text, &path.display().to_string(), overrides)
}

/// As [`load`], from text (`origin` names it in errors).
pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Workflow, WorkflowError> {
    let located = |e: serde_saphyr::Error| {
        let text = e.to_string();
        // serde-saphyr's message is `error: line L column C: MSG` then a source snippet.
        let mut lines = text.lines();
        let first = lines.next().unwrap_or_default();
        let msg = first
            .split_once(": ")
            .map_or(first, |(_, rest)| rest)
            .split_once(": ")
            .filter(|(head, _)| head.starts_with("line "))
            .map_or(first, |(_, m)| m);
        let snippet: Vec<String> = lines
            .map(|l| match l.find("^ ") {
                // The caret line repeats the message: keep the caret.
                Some(i) => l[..=i].to_string(),
                None => l.replace("<input>", origin),
            })
            .collect();
        let at = e
            .location()
            .map_or(String::new(), |l| format!("{}:{}:", l.line(), l.column()));
        let mut out = format!("{origin}:{at} {}", did_you_mean(msg));
        if !snippet.is_empty() {
            out.push('\n');
            out.push_str(&snippet.join("\n"));
        }
        err(out)
    };
    let mut wf: Workflow = serde_saphyr::from_str(text).map_err(located)?;
    if !overrides.is_empty() {
        let mut tree = serde_json::to_value(&wf).map_err(|e| err(e.to_string()))?;
        for o in overrides {
            let (key, value) = o
                .split_once('=')
                .ok_or_else(|| err(format!("override `{o}`: expected dotted.key=value")))?;
            let value: serde_json::Value =
                serde_saphyr::from_str(value).map_err(|e| err(format!("override `{o}`: {e}")))?;
            set_path(&mut tree, key, value).map_err(|m| err(format!("override `{o}`: {m}")))?;
        }
        wf = serde_json::from_value(tree).map_err(|e| {
            err(format!(
                "{origin} (after overrides): {}",
                did_you_mean(&e.to_string())
            ))
        })?;
    }
    // Model, weight-folder and dataset paths are relative to the workflow file.
    if let Some(base) = Path::new(origin).parent() {
        for p in [&mut wf.model.path, &mut wf.pools.rollout.weights_dir]
            .into_iter()
            .flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        for s in &mut wf.stages {
            if let Some(d) = &mut s.data {
                for p in [&mut d.path, &mut d.eval_path].into_iter().flatten() {
                    if p.is_relative() {
                        *p = base.join(&*p);
                    }
                }
            }
        }
    }
    if let Some(p) = &wf.model.path
        && !p.join("config.json").is_file()
    {
        return Err(err(format!(
            "{origin}: model.path `{}` is not a Hugging Face checkpoint folder (no config.json there)",
            p.display()
        )));
    }
    epochs_to_steps(&mut wf).map_err(|m| err(format!("{origin}: {m}")))?;
    validate(&wf, origin)?;
    Ok(wf)
}

/// Turns each stage's `total_epochs` into its `steps`.
fn epochs_to_steps(wf: &mut Workflow) -> Result<(), String> {
    let seed = wf.seed;
    for (i, s) in wf.stages.iter_mut().enumerate() {
        let Some(epochs) = s.trainer.total_epochs else {
            continue;
        };
        if !(epochs > 0.0 && epochs.is_finite()) {
            return Err(format!(
                "stages[{i}].trainer.total_epochs must be positive, got {epochs}"
            ));
        }
        let rows = match s.data.as_ref().map(|d| d.source(seed)) {
            Some(Ok(Source::Jsonl(d))) => d.train.len(),
            Some(Ok(Source::Arith(_))) => {
                return Err(format!(
                    "stages[{i}].trainer.total_epochs: the arith task is an endless stream of problems; count steps instead"
                ));
            }
            Some(Err(m)) => return Err(format!("stages[{i}].data: {m}")),
            None => {
                return Err(format!(
                    "stages[{i}].trainer.total_epochs needs the stage's own data"
                ));
            }
        };
        let per_step = match s.kind {
            StageKind::Sft => s.sft.batch_size,
            _ => s.algorithm.train_batch_size,
        }
        .max(1);
        s.trainer.steps = ((epochs * rows as f64) / per_step as f64).ceil().max(1.0) as u64;
    }
    Ok(())
}

/// Rewrites serde's `unknown field `x`, expected one of a, b, ...` (or `unknown variant`) with
/// the closest valid name first: `unknown field `x` (did you mean `a`?); expected one of ...`.
fn did_you_mean(msg: &str) -> String {
    let Some((head, list)) = msg.split_once(", expected one of ") else {
        return msg.to_string();
    };
    let Some(bad) = head.rsplit('`').nth(1) else {
        return msg.to_string();
    };
    let valid: Vec<&str> = list
        .split(", ")
        .map(|v| v.trim_matches('`').trim_end_matches(['.', ' ']))
        .collect();
    let best = valid
        .iter()
        .map(|v| (edit_distance(bad, v), *v))
        .min()
        .filter(|(d, v)| *d <= (v.len().max(bad.len()) / 3).max(2));
    match best {
        Some((_, v)) => format!("{head} (did you mean `{v}`?); expected one of {list}"),
        None => msg.to_string(),
    }
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// Sets `key` (dots separate fields; a number selects a list item; a stage may also be named by
/// its id, as in `stages.rl.trainer.steps`).
fn set_path(
    tree: &mut serde_json::Value,
    key: &str,
    value: serde_json::Value,
) -> Result<(), String> {
    let mut node = tree;
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        node = match node {
            serde_json::Value::Array(items) => {
                let idx = match part.parse::<usize>() {
                    Ok(n) => n,
                    Err(_) => items
                        .iter()
                        .position(|s| s.get("id").and_then(|v| v.as_str()) == Some(part))
                        .ok_or_else(|| format!("no item `{part}` in `{}`", parts[..i].join(".")))?,
                };
                let len = items.len();
                items
                    .get_mut(idx)
                    .ok_or_else(|| format!("index {idx} out of range ({len} items)"))?
            }
            serde_json::Value::Object(map) => {
                if last {
                    map.insert(part.to_string(), value);
                    return Ok(());
                }
                map.entry(part.to_string())
                    .or_insert_with(|| serde_json::json!({}))
            }
            _ => return Err(format!("`{}` is not a map or list", parts[..i].join("."))),
        };
        if last {
            *node = value;
            return Ok(());
        }
    }
    Ok(())
}

/// Checks everything that can be checked before running: stage graph, names, units.
pub fn validate(wf: &Workflow, origin: &str) -> Result<(), WorkflowError> {
    let bad = |msg: String| Err(err(format!("{origin}: {msg}")));
    if wf.stages.is_empty() {
        return bad("`stages` is empty: nothing to run".into());
    }
    match (&wf.model.path, &wf.model.init) {
        (None, None) => {
            return bad("`model` needs `path` (a checkpoint folder) or `init` (a config)".into());
        }
        (Some(_), Some(_)) => return bad("`model` has both `path` and `init`: choose one".into()),
        _ => {}
    }
    for (role, p) in [
        ("rollout", &wf.pools.rollout),
        ("learner", &wf.pools.learner),
    ] {
        if !["cpu", "gpu", "tpu"].contains(&p.device.as_str()) {
            return bad(format!(
                "pools.{role}.device `{}`: expected cpu, gpu or tpu",
                p.device
            ));
        }
        if !["local", "pack", "spread"].contains(&p.placement.as_str()) {
            return bad(format!(
                "pools.{role}.placement `{}`: expected local, pack or spread",
                p.placement
            ));
        }
        if role == "learner" && p.placement != "local" {
            return bad(format!(
                "pools.learner.placement `{}` cannot be placed: this build trains in the driver process (placement: local)",
                p.placement
            ));
        }
        if p.count == 0 {
            return bad(format!(
                "pools.{role}.count is 0: a pool needs at least one engine"
            ));
        }
        if role == "rollout" && p.is_external() {
            if p.endpoints.is_empty() {
                return bad(format!(
                    "pools.rollout.endpoints is empty: engine `{}` needs the URLs of its servers (e.g. [http://10.0.0.5:8000])",
                    p.engine
                ));
            }
            if let Some(e) = p.endpoints.iter().find(|e| {
                !e.starts_with("http://") || e.trim_end_matches('/').len() <= "http://".len()
            }) {
                return bad(format!(
                    "pools.rollout.endpoints: `{e}` is not a URL like http://10.0.0.5:8000"
                ));
            }
            if p.placement != "local" {
                return bad(format!(
                    "pools.rollout.placement `{}`: engine `{}` runs where its endpoints are; leave placement out",
                    p.placement, p.engine
                ));
            }
            if p.count > 1 && p.count != p.endpoints.len() {
                return bad(format!(
                    "pools.rollout.count is {} but {} endpoints are listed: an external pool has one engine per endpoint",
                    p.count,
                    p.endpoints.len()
                ));
            }
            if !(p.timeout_s > 0.0 && p.verify_tolerance > 0.0) {
                return bad("pools.rollout.timeout_s and verify_tolerance must be positive".into());
            }
            continue;
        }
        if !p.endpoints.is_empty() {
            return bad(format!(
                "pools.{role}.endpoints are for external engines (engine: vllm, sglang or served), not `{}`",
                p.engine
            ));
        }
        if p.plugin.is_some() && p.engine != "pjrt" {
            return bad(format!(
                "pools.{role}.plugin is for engine: pjrt, not `{}`",
                p.engine
            ));
        }
        if role == "rollout" && p.engine == "pjrt" {
            continue;
        }
        if role == "learner" && p.engine == "pjrt" {
            if p.count != 1 {
                return bad(format!(
                    "pools.learner.count is {}: the pjrt learner trains on one device (data parallelism over several is not built yet)",
                    p.count
                ));
            }
            continue;
        }
        if p.engine != "native" || p.device != "cpu" {
            let also = if role == "rollout" {
                "; rollout pools also take pjrt on cpu, gpu or tpu, or vllm, sglang or served with endpoints"
            } else {
                "; the learner also takes engine: pjrt on cpu, gpu or tpu"
            };
            return bad(format!(
                "pools.{role}: engine `{}` on `{}` cannot be placed: this build runs the native engine on cpu{also}",
                p.engine, p.device
            ));
        }
    }
    let mut seen: Vec<&str> = Vec::new();
    for (i, s) in wf.stages.iter().enumerate() {
        if seen.contains(&s.id.as_str()) {
            return bad(format!("stages[{i}]: duplicate stage id `{}`", s.id));
        }
        for a in &s.after {
            if !wf.stages.iter().any(|t| &t.id == a) {
                return bad(format!(
                    "stages[{i}] (`{}`): `after` names unknown stage `{a}`",
                    s.id
                ));
            }
        }
        seen.push(&s.id);
        if let Some(d) = &s.data {
            if d.task == "arith" {
                d.arith
                    .validate()
                    .or_else(|m| bad(format!("stages[{i}].data: {m}")))?;
            }
            for (what, v) in [
                ("sft", &s.sft.lr_schedule),
                ("algorithm", &s.algorithm.lr_schedule),
            ] {
                if !["constant", "cosine"].contains(&v.as_str()) {
                    return bad(format!(
                        "stages[{i}].{what}.lr_schedule `{v}`: expected constant or cosine"
                    ));
                }
            }
            if let Some(t) = &d.prompt_template
                && !t.contains("{prompt}")
            {
                return bad(format!(
                    "stages[{i}].data.prompt_template `{t}` has no `{{prompt}}` where the prompt goes"
                ));
            }
            if d.chat_template {
                let Some(p) = &wf.model.path else {
                    return bad(format!(
                        "stages[{i}].data.chat_template needs model.path (a checkpoint whose tokenizer_config.json has a chat_template)"
                    ));
                };
                if let Err(m) = crate::chat::ChatTemplate::from_tokenizer_config(
                    &p.join("tokenizer_config.json"),
                ) {
                    return bad(format!("stages[{i}].data: {m}"));
                }
            }
            // Reads a dataset once now, so that a bad file stops the run before it starts.
            if let Err(m) = d.source(wf.seed) {
                return bad(format!("stages[{i}].data: {m}"));
            }
        }
        if s.kind != StageKind::Eval && s.data.is_none() {
            return bad(format!(
                "stages[{i}] (`{}`): a {:?} stage needs `data`",
                s.id, s.kind
            ));
        }
        let a = &s.algorithm;
        if s.kind == StageKind::Rl {
            if a.rollout_n == 0
                || a.train_batch_size == 0
                || a.ppo_epochs == 0
                || a.max_response_length == 0
            {
                return bad(format!(
                    "stages[{i}].algorithm: rollout_n, train_batch_size, ppo_epochs and max_response_length must be positive"
                ));
            }
            if a.ppo_mini_batch_size == 0 || a.train_batch_size % a.ppo_mini_batch_size != 0 {
                return bad(format!(
                    "stages[{i}].algorithm: ppo_mini_batch_size ({}) must divide train_batch_size ({}); both are counted in prompts",
                    a.ppo_mini_batch_size, a.train_batch_size
                ));
            }
            a.adv_estimator
                .parse::<learner::rl::advantage::AdvEstimator>()
                .map_err(|e| err(format!("{origin}: stages[{i}].algorithm: {e}")))?;
            a.policy_loss
                .parse::<learner::rl::loss::PolicyLoss>()
                .map_err(|e| err(format!("{origin}: stages[{i}].algorithm: {e}")))?;
            a.loss_agg_mode
                .parse::<learner::rl::agg::LossAgg>()
                .map_err(|e| err(format!("{origin}: stages[{i}].algorithm: {e}")))?;
        }
        s.reward
            .validate()
            .or_else(|m| bad(format!("stages[{i}].reward: {m}")))?;
        if s.trainer.max_ckpt_to_keep == 0 {
            return bad(format!(
                "stages[{i}].trainer.max_ckpt_to_keep is 0: at least the latest checkpoint is kept (resuming needs it)"
            ));
        }
        if !["sync", "async"].contains(&s.trainer.mode.as_str()) {
            return bad(format!(
                "stages[{i}].trainer.mode `{}`: expected sync or async",
                s.trainer.mode
            ));
        }
        if !["drop", "wait"].contains(&s.trainer.stale_samples.as_str()) {
            return bad(format!(
                "stages[{i}].trainer.stale_samples `{}`: expected drop or wait",
                s.trainer.stale_samples
            ));
        }
        if s.trainer.mode == "async" && s.algorithm.filter_groups {
            return bad(format!(
                "stages[{i}]: algorithm.filter_groups (DAPO dynamic sampling) needs trainer.mode sync; in async mode, drop uninformative groups with a `filter` node (min_group_std)"
            ));
        }
        if s.trainer.mode == "async" && s.trainer.max_staleness == 0 {
            return bad(format!(
                "stages[{i}].trainer.max_staleness is 0 in async mode: generation could never run ahead (use mode: sync), counted in weight versions"
            ));
        }
        if s.kind == StageKind::Rl {
            if a.use_kl_loss {
                a.kl_loss_type
                    .parse::<learner::rl::kl::Kl>()
                    .map_err(|e| err(format!("{origin}: stages[{i}].algorithm: {e}")))?;
            }
            for (j, n) in s.nodes.iter().enumerate() {
                if let UserNode::Program(p) = n {
                    if p.command.is_empty() {
                        return bad(format!(
                            "stages[{i}].nodes[{j}] (`{}`): `command` is empty",
                            p.name
                        ));
                    }
                    if !(p.timeout_s > 0.0) || p.memory_mb == 0 {
                        return bad(format!(
                            "stages[{i}].nodes[{j}] (`{}`): timeout_s (seconds) and memory_mb (MiB) must be positive",
                            p.name
                        ));
                    }
                    if !["add", "replace"].contains(&p.mode.as_str()) {
                        return bad(format!(
                            "stages[{i}].nodes[{j}] (`{}`): mode `{}`: expected add or replace",
                            p.name, p.mode
                        ));
                    }
                }
            }
            crate::graph::expand(s).map_err(|e| err(format!("{origin}: {e}")))?;
        } else if !s.nodes.is_empty() {
            return bad(format!(
                "stages[{i}] (`{}`): `nodes` apply to rl stages only",
                s.id
            ));
        }
    }
    order(wf).map_err(|m| err(format!("{origin}: {m}")))?;
    Ok(())
}

/// Stage indices in an order that respects `after` (stable: file order among ready stages).
pub fn order(wf: &Workflow) -> Result<Vec<usize>, String> {
    let mut done: Vec<usize> = Vec::new();
    while done.len() < wf.stages.len() {
        let ready = (0..wf.stages.len()).find(|&i| {
            !done.contains(&i)
                && wf.stages[i]
                    .after
                    .iter()
                    .all(|a| done.iter().any(|&d| &wf.stages[d].id == a))
        });
        match ready {
            Some(i) => done.push(i),
            None => {
                let stuck: Vec<&str> = (0..wf.stages.len())
                    .filter(|i| !done.contains(i))
                    .map(|i| wf.stages[i].id.as_str())
                    .collect();
                return Err(format!(
                    "the stages' `after` form a cycle among: {}",
                    stuck.join(", ")
                ));
            }
        }
    }
    Ok(done)
}
