//! The recipe runner: runs a workflow's stages in one process on the native engines (SFT, RL in
//! `sync` mode, eval), writes `metrics.jsonl`, checkpoints at `save_freq`, and resumes from the
//! last checkpoint.
//!
//! Run directory: `store.redb` (the job store: spec, state, progress, checkpoint index and every
//! metric row; see [`crate::store`]), `workflow.json` (the resolved workflow, for people),
//! `metrics.jsonl` (one object per step with `stage`, `step` and VeRL-named metrics, an export of
//! the store's rows), `tensorboard/`, and `checkpoints/<stage>/step_<N>/` (model in HF layout,
//! `optimizer/`, `trainer_state.json`).

use crate::pool::RolloutPool;
use crate::rl::RlState;
use crate::store::{CheckpointRecord, JobState, Progress, Store, StoreError};
use crate::workflow::{Stage, StageKind, Workflow};
use learner::checkpoint::Checkpoint;
use learner::engine::{Backend, TrainEngine};
use learner::optim::{LrSchedule, Optimizer, ScheduleKind};
use learner::rl::Metrics;
use learner::snapshot::WeightSnapshot;
use learner::tokenizer::Tokenizer;
use learner::{Model, ModelConfig};
use rollout::task::{ArithTask, Problem};
use rollout::{GenerateRequest, SamplingParams};
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What stops a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Model, checkpoint or tokenizer.
    #[error(transparent)]
    Learner(#[from] learner::Error),
    /// The inference engine.
    #[error(transparent)]
    Engine(#[from] rollout::EngineError),
    /// An RL formula's inputs or settings.
    #[error(transparent)]
    Rl(#[from] learner::rl::RlError),
    /// The job store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An actor of a pool.
    #[error(transparent)]
    Actor(#[from] actors::ActorError),
    /// Files of the run directory.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Stopped on request (Ctrl-C, SIGTERM, a cancel) after checkpointing the step it was at.
    #[error(
        "stopped on request after {stage} step {step} (checkpointed): continue with `{resume}`"
    )]
    Stopped {
        /// The command that continues the run.
        resume: String,
        /// Stage it stopped in.
        stage: String,
        /// Last step done.
        step: u64,
    },
    /// Stopped on request before its first step, while waiting for agents for its pools.
    #[error(
        "stopped on request while waiting for agents that can take the rollout pool: continue with `{resume}`"
    )]
    StoppedWaiting {
        /// The command that continues the run.
        resume: String,
    },
    /// Anything else, explained.
    #[error("{0}")]
    Other(String),
}

impl RunError {
    /// Whether the run stopped because it was asked to (it can be resumed as it is).
    pub fn is_stop(&self) -> bool {
        matches!(self, Self::Stopped { .. } | Self::StoppedWaiting { .. })
    }
}

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Asks running jobs to stop after their current step (with a checkpoint). Async-signal-safe:
/// a signal handler may call it.
pub fn request_stop() {
    STOP.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Whether a stop was requested.
pub fn stop_requested() -> bool {
    STOP.load(std::sync::atomic::Ordering::SeqCst)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        path: path.to_path_buf(),
        source,
    }
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

/// What the store of a run directory says about its run.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// The job (spec, state, progress).
    pub job: crate::store::Job,
    /// Checkpoints kept, oldest first.
    pub checkpoints: Vec<CheckpointRecord>,
    /// Metric rows recorded.
    pub metric_rows: usize,
}

/// Reads the store of the run in `dir` (refused while a process is running it: the store is
/// opened by one process at a time).
pub fn status(dir: &Path) -> Result<Status, RunError> {
    let (store, job) = open_run(dir)?;
    Ok(Status {
        checkpoints: store.checkpoints(job.id)?,
        metric_rows: store.metrics(job.id, 0)?.len(),
        job,
    })
}

fn open_run(dir: &Path) -> Result<(Store, crate::store::Job), RunError> {
    let path = store_path(dir);
    if !path.exists() {
        return Err(RunError::Other(format!(
            "{} holds no run (no store.redb): start one with `trellis train RECIPE --run-dir {}`",
            dir.display(),
            dir.display()
        )));
    }
    let store = Store::open(&path)?;
    let job =
        store.jobs()?.last().cloned().ok_or_else(|| {
            RunError::Other(format!("{}: the store holds no job", path.display()))
        })?;
    Ok((store, job))
}

/// A run in progress: the models, the engine and the run's records.
pub(crate) struct Run<'a> {
    pub(crate) wf: &'a Workflow,
    pub(crate) dir: PathBuf,
    /// The policy, on the learner's engine.
    pub(crate) policy: Box<dyn TrainEngine>,
    pub(crate) tokenizer: Tokenizer,
    assets: Vec<(String, Vec<u8>)>,
    pub(crate) eos: u32,
    pub(crate) engine: Arc<RolloutPool>,
    pub(crate) version: u64,
    metrics: std::fs::File,
    events: crate::tensorboard::EventWriter,
    store: &'a Store,
    job: u64,
    state: Progress,
    /// The checkpoint's chat template, when a stage asks for one.
    chat: Option<crate::chat::ChatTemplate>,
    /// Whether the current stage renders prompts through it.
    chat_active: bool,
    opts: &'a RunOptions,
    summary: Summary,
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RunError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// The job store of a run directory.
pub fn store_path(dir: &Path) -> PathBuf {
    dir.join("store.redb")
}

/// How a run is driven.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// No progress lines on stderr.
    pub quiet: bool,
    /// Where to meet agents, for pools placed on them.
    pub cluster: Option<crate::pool::Cluster>,
    /// Stops this run after its current step (with a checkpoint) once set, like
    /// [`request_stop`] does for every run of the process.
    pub stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Also record progress lines in the store, as the job's log.
    pub log_to_store: bool,
    /// The command that continues this run, for messages (default `trellis resume RUN_DIR`).
    pub resume_hint: Option<String>,
}

impl RunOptions {
    /// The command that continues the run in `dir`.
    fn resume_command(&self, dir: &Path) -> String {
        self.resume_hint
            .clone()
            .unwrap_or_else(|| format!("trellis resume {}", dir.display()))
    }

    /// Whether this run was asked to stop.
    pub fn stop_requested(&self) -> bool {
        stop_requested()
            || self
                .stop
                .as_ref()
                .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// A client on the PJRT plugin of a pool on `device` (`cpu`, `gpu`, `tpu`): `plugin`, else
/// `TRELLIS_PJRT_PLUGIN`, else the one pip installed for the device; loaded, and checked to run
/// on that device. Errors name `pools.ROLE`.
pub(crate) fn pjrt_client(
    role: &str,
    device: &str,
    plugin: Option<&Path>,
) -> Result<libtpu_sys::pjrt::Client, String> {
    let path = match plugin {
        Some(x) => x.to_path_buf(),
        None => crate::doctor::find_plugin(device).ok_or_else(|| {
            let wheel = match device {
                "tpu" => "libtpu",
                "gpu" => "jax-cuda12-pjrt",
                _ => "xla-cpu-pjrt",
            };
            format!(
                "pools.{role}: engine pjrt on {device} needs a PJRT plugin and none was found: set pools.{role}.plugin or TRELLIS_PJRT_PLUGIN to its .so, or `pip install {wheel}`"
            )
        })?,
    };
    let fail = |e: libtpu_sys::pjrt::PjrtError| format!("pools.{role}.plugin: {e}");
    libtpu_sys::probe(&path).map_err(|e| fail(e.into()))?;
    let client = libtpu_sys::pjrt::Client::open(&path).map_err(fail)?;
    let platform = client.platform().to_string();
    let fits = match device {
        "gpu" => ["cuda", "rocm", "gpu"].contains(&platform.as_str()),
        d => platform == d,
    };
    if !fits {
        return Err(format!(
            "pools.{role}: device is {device} but the plugin {} runs on `{platform}`",
            path.display()
        ));
    }
    tracing::debug!(role, plugin = %path.display(), %platform, "opened a PJRT client");
    Ok(client)
}

/// A client for the learner when `pools.learner.engine` is `pjrt`; for a local `pjrt` rollout
/// pool, checks that its plugin can be had too (before anything runs).
fn learner_client(wf: &Workflow) -> Result<Option<libtpu_sys::pjrt::Client>, RunError> {
    let r = &wf.pools.rollout;
    if r.engine == "pjrt" && r.placement == "local" {
        pjrt_client("rollout", &r.device, r.plugin.as_deref()).map_err(RunError::Other)?;
    }
    let p = &wf.pools.learner;
    if p.engine != "pjrt" {
        return Ok(None);
    }
    pjrt_client("learner", &p.device, p.plugin.as_deref())
        .map(Some)
        .map_err(RunError::Other)
}

/// Starts a run of `wf` in `dir` (which must not hold another run).
pub fn start(wf: &Workflow, dir: &Path, opts: &RunOptions) -> Result<Summary, RunError> {
    // A learner device that cannot be had fails before the run exists.
    learner_client(wf)?;
    if store_path(dir).exists() {
        return Err(RunError::Other(format!(
            "{} already holds a run: continue it with `trellis resume {}`, or pick another --run-dir",
            dir.display(),
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let spec = serde_json::to_value(wf).map_err(|e| RunError::Other(e.to_string()))?;
    let text = serde_json::to_string_pretty(&spec).map_err(|e| RunError::Other(e.to_string()))?;
    write_atomic(&dir.join("workflow.json"), text.as_bytes())?;
    let _ = std::fs::remove_file(dir.join("metrics.jsonl"));
    let store = Store::open(&store_path(dir))?;
    let job = store.create_job(&wf.name, spec, JobState::Running)?;
    execute(wf, dir, &store, job, opts)
}

/// Continues the run in `dir` from its last checkpoint.
pub fn resume(dir: &Path, opts: &RunOptions) -> Result<Summary, RunError> {
    let (store, job) = open_run(dir)?;
    if job.state == JobState::Succeeded {
        return Ok(Summary {
            finished_before: true,
            ..Summary::default()
        });
    }
    let wf: Workflow = serde_json::from_value(job.spec.clone())
        .map_err(|e| RunError::Other(format!("{}: job {}: {e}", store.path().display(), job.id)))?;
    store.set_state(job.id, JobState::Running, None)?;
    execute(&wf, dir, &store, job.id, opts)
}

/// Runs the job and records how it ended: `Succeeded`, or `Failed` with the error (resumable).
fn execute(
    wf: &Workflow,
    dir: &Path,
    store: &Store,
    job: u64,
    opts: &RunOptions,
) -> Result<Summary, RunError> {
    let out = run_job(wf, dir, store, job, opts);
    let end = match &out {
        Ok(_) => store.set_state(job, JobState::Succeeded, None),
        Err(e) if e.is_stop() => store.set_state(job, JobState::Cancelled, Some(e.to_string())),
        Err(e) => store.set_state(job, JobState::Failed, Some(e.to_string())),
    };
    let summary = out?;
    end?;
    Ok(summary)
}

fn tokenizer_for(wf: &Workflow) -> Result<(Tokenizer, String), RunError> {
    let json = match (&wf.model.tokenizer, &wf.model.path) {
        (Some(t), _) if t == "builtin:arith" => rollout::task::arith_tokenizer_json(),
        (Some(t), _) => std::fs::read_to_string(t).map_err(io(Path::new(t)))?,
        (None, Some(p)) => {
            let f = p.join("tokenizer.json");
            std::fs::read_to_string(&f).map_err(io(&f))?
        }
        (None, None) => {
            return Err(RunError::Other(
                "model.tokenizer is required with model.init".into(),
            ));
        }
    };
    let tok = Tokenizer::from_json(
        &json,
        Path::new(wf.model.tokenizer.as_deref().unwrap_or("tokenizer.json")),
    )?;
    Ok((tok, json))
}

/// A stage's learning-rate schedule: linear warmup, then constant or cosine decay to
/// `min_ratio · lr` at optimiser call `total`.
pub(crate) fn lr_schedule(
    lr: f32,
    warmup: u64,
    kind: &str,
    min_ratio: f32,
    total: u64,
) -> LrSchedule {
    LrSchedule {
        warmup_steps: warmup,
        total_steps: total,
        kind: if kind == "cosine" {
            ScheduleKind::Cosine
        } else {
            ScheduleKind::Constant
        },
        min_lr_ratio: min_ratio,
        ..LrSchedule::constant(lr)
    }
}

/// The model a run of `wf` starts from (its checkpoint, or its `init` config with seeded
/// weights) and its tokenizer: what `trellis engine serve --recipe` serves until the run pushes
/// its weights.
pub fn recipe_model(wf: &Workflow) -> Result<(Model, Tokenizer), RunError> {
    let (tokenizer, _) = tokenizer_for(wf)?;
    let ckpt = initial_model(wf, &tokenizer)?;
    Ok((ckpt.model, tokenizer))
}

fn initial_model(wf: &Workflow, tok: &Tokenizer) -> Result<Checkpoint, RunError> {
    if let Some(p) = &wf.model.path {
        return Ok(Checkpoint::load(p)?);
    }
    let mut init = wf.model.init.clone().unwrap_or_default();
    let obj = init
        .as_object_mut()
        .ok_or_else(|| RunError::Other("model.init must be a map of config fields".into()))?;
    obj.entry("vocab_size").or_insert(tok.vocab_size().into());
    obj.entry("max_position_embeddings").or_insert(256.into());
    obj.entry("tie_word_embeddings").or_insert(true.into());
    let heads = obj.get("num_attention_heads").cloned().unwrap_or(1.into());
    obj.entry("num_key_value_heads").or_insert(heads);
    if let Some(eos) = tok.token_id("<eos>") {
        obj.entry("eos_token_id").or_insert(eos.into());
    }
    if !obj.contains_key("intermediate_size")
        && let Some(h) = obj.get("hidden_size").and_then(|v| v.as_u64())
    {
        obj.insert(
            "intermediate_size".into(),
            (h * 8 / 3).next_multiple_of(16).into(),
        );
    }
    let config = ModelConfig::from_json(init, Path::new("model.init"))?;
    Ok(Checkpoint {
        model: Model::init(config, wf.seed),
        assets: Vec::new(),
    })
}

/// Runs job `job` of `store` (its workflow `wf`) with its files in `dir`, from its last
/// checkpoint when it has one; leaves recording how it ended to the caller.
pub fn run_job(
    wf: &Workflow,
    dir: &Path,
    store: &Store,
    job: u64,
    opts: &RunOptions,
) -> Result<Summary, RunError> {
    let state = store.job(job)?.progress;
    let (tokenizer, tokenizer_json) = tokenizer_for(wf)?;
    let Checkpoint {
        mut model,
        mut assets,
    } = initial_model(wf, &tokenizer)?;
    let mut version = 0;
    if let Some(ck) = &state.checkpoint {
        let c = Checkpoint::load(&dir.join(ck))?;
        model = c.model;
        assets = c.assets;
        version = state.weight_version;
    }
    if !assets.iter().any(|(n, _)| n == "tokenizer.json") {
        assets.push(("tokenizer.json".into(), tokenizer_json.into_bytes()));
    }
    let eos = model
        .config
        .eos_token_id
        .or_else(|| tokenizer.token_id("<eos>"))
        .ok_or_else(|| {
            RunError::Other(
                "the model config has no eos_token_id and the tokenizer no <eos>".into(),
            )
        })?;
    let engine = Arc::new(
        RolloutPool::new(
            &model,
            &wf.pools.rollout,
            256 << 20,
            version,
            opts.cluster.as_ref(),
            &|| opts.stop_requested(),
            dir,
            wf.stages.iter().any(|s| s.trainer.mode == "async"),
        )
        .map_err(|e| match e {
            RunError::StoppedWaiting { .. } => RunError::StoppedWaiting {
                resume: opts.resume_command(dir),
            },
            e => e,
        })?,
    );
    if wf.pools.rollout.placement != "local" {
        // Always said: where the engines run is the first thing to check on a cluster.
        let line = format!("rollout pool: {}", engine.locations().join(", "));
        if opts.log_to_store {
            store.append_log(job, &line)?;
        } else {
            eprintln!("{line}");
        }
    }
    let wants_chat = wf
        .stages
        .iter()
        .any(|s| s.data.as_ref().is_some_and(|d| d.chat_template));
    let chat = match (&wf.model.path, wants_chat) {
        (Some(p), true) => Some(
            crate::chat::ChatTemplate::from_tokenizer_config(&p.join("tokenizer_config.json"))
                .map_err(RunError::Other)?,
        ),
        _ => None,
    };
    let metrics_path = dir.join("metrics.jsonl");
    rewind_metrics(store, job, &state, &metrics_path)?;
    let metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .map_err(io(&metrics_path))?;
    let tb = dir.join("tensorboard");
    let events = crate::tensorboard::EventWriter::create(&tb).map_err(io(&tb))?;
    let backend = match learner_client(wf)? {
        Some(client) => Backend::Pjrt(client),
        None => Backend::Native,
    };
    let policy = learner::engine::open(model, backend)?;
    tracing::info!(engine = policy.describe(), "learner");
    let mut run = Run {
        wf,
        dir: dir.to_path_buf(),
        policy,
        tokenizer,
        assets,
        eos,
        engine,
        version,
        metrics,
        events,
        store,
        job,
        state,
        chat,
        chat_active: false,
        opts,
        summary: Summary::default(),
    };
    let order = crate::workflow::order(wf).map_err(RunError::Other)?;
    let mut last_data = None;
    for i in order {
        let stage = &wf.stages[i];
        let data = stage.data.clone().or(last_data.clone());
        last_data = data.clone();
        if run.state.completed.contains(&stage.id) {
            continue;
        }
        let data = data.ok_or_else(|| {
            RunError::Other(format!("stage `{}` has no data to evaluate on", stage.id))
        })?;
        run.stage(stage, &data)?;
    }
    crate::plot::plot(dir, &dir.join("plot.png")).map_err(RunError::Other)?;
    Ok(run.summary)
}

/// Drops the metric rows written after the checkpoint being resumed from (those steps run
/// again), then rewrites `metrics.jsonl` from the store's rows.
fn rewind_metrics(store: &Store, job: u64, state: &Progress, path: &Path) -> Result<(), RunError> {
    store.retain_metrics(job, |v| {
        let stage = v.get("stage").and_then(|s| s.as_str()).unwrap_or("");
        let step = v.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        state.completed.iter().any(|c| c == stage)
            || (Some(stage) == state.stage.as_deref() && step <= state.step)
    })?;
    let mut out = String::new();
    for (_, row) in store.metrics(job, 0)? {
        out.push_str(&row.to_string());
        out.push('\n');
    }
    write_atomic(path, out.as_bytes())
}

impl Run<'_> {
    /// Token ids of a problem's prompt (through the chat template when the current stage asks
    /// for it), and of its answer followed by end-of-sequence.
    pub(crate) fn encode(&self, p: &Problem) -> Result<(Vec<u32>, Vec<u32>), RunError> {
        let prompt = match (&self.chat, self.chat_active) {
            (Some(t), true) => self
                .tokenizer
                .encode(&t.render_user(&p.prompt).map_err(RunError::Other)?)?,
            _ => self.tokenizer.encode(&p.prompt)?,
        };
        let mut answer = self.tokenizer.encode(&p.answer)?;
        answer.push(self.eos);
        Ok((prompt, answer))
    }

    fn log(&mut self, stage: &str, step: u64, m: &Metrics) -> Result<(), RunError> {
        let mut obj = serde_json::Map::new();
        obj.insert("stage".into(), stage.into());
        obj.insert("step".into(), step.into());
        for (k, v) in m {
            if v.is_finite() {
                obj.insert(k.clone(), (*v).into());
            }
        }
        let row = serde_json::Value::Object(obj);
        self.store.append_metrics(self.job, &row)?;
        let path = self.dir.join("metrics.jsonl");
        writeln!(self.metrics, "{row}").map_err(io(&path))?;
        self.metrics.flush().map_err(io(&path))?;
        let scalars = m
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (format!("{stage}/{k}"), *v));
        let tb = self.events.path().to_path_buf();
        self.events.scalars(step, scalars).map_err(io(&tb))
    }

    /// A progress line: on a terminal, one bar redrawn in place (kept when `done`); otherwise
    /// one line per call.
    fn progress(&self, line: String, done: bool) -> Result<(), RunError> {
        use std::io::IsTerminal;
        if self.opts.log_to_store {
            self.store.append_log(self.job, &line)?;
        }
        if self.opts.quiet {
            return Ok(());
        }
        let mut err = std::io::stderr().lock();
        let _ = if !err.is_terminal() {
            writeln!(err, "{line}")
        } else if done {
            writeln!(err, "\r\x1b[2K{line}")
        } else {
            write!(err, "\r\x1b[2K{line}").and_then(|_| err.flush())
        };
        Ok(())
    }

    fn checkpoint(
        &mut self,
        stage: &str,
        step: u64,
        sft_opt: Option<&Optimizer>,
        rl: Option<&RlState>,
        keep: usize,
    ) -> Result<(), RunError> {
        let opt = sft_opt.or(rl.map(RlState::optimizer));
        let rel = format!("checkpoints/{stage}/step_{step:06}");
        let ck = Checkpoint {
            model: self.policy.model()?.clone(),
            assets: self.assets.clone(),
        };
        let abs = self.dir.join(&rel);
        ck.save(&abs, opt)?;
        if let Some(rl) = rl {
            rl.save(&abs)?;
        }
        // What resuming needs besides weights and optimiser: data and sampling are pure
        // functions of (seed, stage, step), so the step is the data position and the RNG state.
        let trainer_state = serde_json::json!({
            "stage": stage,
            "step": step,
            "weight_version": self.version,
            "seed": self.wf.seed,
            "data_position": {"stage": stage, "step": step},
            "rng": {"kind": "chacha8", "seeded_by": ["seed", "stage", "step", "round", "prompt"]},
        });
        let path = abs.join("trainer_state.json");
        write_atomic(&path, trainer_state.to_string().as_bytes())?;
        self.state.checkpoint = Some(rel.clone());
        self.state.stage = Some(stage.to_string());
        self.state.step = step;
        self.state.weight_version = self.version;
        let record = CheckpointRecord {
            stage: stage.to_string(),
            step,
            path: rel.clone(),
            weight_version: self.version,
        };
        // Folders are deleted only once the store no longer points at them.
        for old in self
            .store
            .checkpoint(self.job, &self.state, &record, keep)?
        {
            if old.path != rel {
                let _ = std::fs::remove_dir_all(self.dir.join(old.path));
            }
        }
        Ok(())
    }

    pub(crate) fn sync_weights(&mut self) -> Result<f64, RunError> {
        let t = Instant::now();
        self.version += 1;
        let snap = WeightSnapshot {
            version: self.version,
            params: Arc::new(self.policy.model()?.params.clone()),
        };
        self.engine
            .update_weights_blocking(snap, self.policy.model()?)?;
        Ok(t.elapsed().as_secs_f64())
    }

    fn stage(&mut self, stage: &Stage, data: &crate::workflow::Data) -> Result<(), RunError> {
        let source = data.source(self.wf.seed).map_err(RunError::Other)?;
        self.chat_active = data.chat_template;
        let eval_set = source.eval_set(self.wf.seed, data.eval_size);
        // Greedy answers: a few tokens past the longest arithmetic answer, or the stage's
        // response budget for a dataset.
        let eval_tokens = if source.is_arith() {
            eval_set.iter().map(|p| p.answer.len()).max().unwrap_or(1) + 2
        } else {
            stage.algorithm.max_response_length
        };
        let exclude: HashSet<Problem> = eval_set.iter().cloned().collect();
        let resume_step = if self.state.stage.as_deref() == Some(&stage.id) {
            self.state.step
        } else {
            0
        };
        // An eval stage has no steps; it is recorded as step 0.
        let total = match stage.kind {
            StageKind::Eval => 0,
            _ => stage.trainer.steps,
        };
        // Resuming inside this stage: the optimiser (and critic) come from its checkpoint.
        let ck_dir = match (&self.state.checkpoint, resume_step > 0) {
            (Some(ck), true) => Some(self.dir.join(ck)),
            _ => None,
        };
        let mut sft_opt = None;
        if stage.kind == StageKind::Sft {
            let mut o = Optimizer::new(
                &self.policy.model()?.params,
                Default::default(),
                lr_schedule(
                    stage.sft.lr,
                    stage.sft.lr_warmup_steps,
                    &stage.sft.lr_schedule,
                    stage.sft.min_lr_ratio,
                    stage.trainer.steps,
                ),
                Some(1.0),
            );
            if let Some(ck) = &ck_dir {
                o.load(&ck.join("optimizer"))?;
            }
            sft_opt = Some(o);
        }
        let mut rl = match stage.kind {
            StageKind::Rl => Some(RlState::new(self, stage, ck_dir.as_deref())?),
            _ => None,
        };
        // A stage's optimiser is new (or restored from its checkpoint): the device's moments
        // start from it.
        self.policy.reset_optimizer();
        if stage.kind == StageKind::Eval {
            let (acc, reward) = self.evaluate(&eval_set, &stage.reward, eval_tokens)?;
            let m: Metrics = [
                ("eval/accuracy".to_string(), acc),
                ("eval/reward_mean".to_string(), reward),
            ]
            .into();
            self.log(&stage.id, 0, &m)?;
            self.summary.eval_accuracy.insert(stage.id.clone(), acc);
            self.progress(format!("[{}] eval accuracy {:.3}", stage.id, acc), true)?;
        } else {
            let started = Instant::now();
            for step in resume_step + 1..=total {
                let mut m = match (&mut sft_opt, &mut rl) {
                    (Some(opt), _) => self.sft_step(stage, &source, step, opt, &exclude)?,
                    (None, Some(rl)) => self.rl_step(stage, &source, step, rl, &exclude)?,
                    (None, None) => unreachable!("sft and rl stages have their state"),
                };
                let freq = stage.trainer.eval_freq;
                if (freq > 0 && step % freq == 0) || step == total {
                    let (acc, reward) = self.evaluate(&eval_set, &stage.reward, eval_tokens)?;
                    m.insert("eval/accuracy".into(), acc);
                    m.insert("eval/reward_mean".into(), reward);
                    self.summary.eval_accuracy.insert(stage.id.clone(), acc);
                }
                self.log(&stage.id, step, &m)?;
                self.summary.steps_run += 1;
                let done = step - resume_step;
                let eta = started.elapsed().as_secs_f64() / done as f64 * (total - step) as f64;
                let show = |k: &str, label: &str, digits: usize| {
                    m.get(k)
                        .map(|v| format!(" {label} {v:.digits$}"))
                        .unwrap_or_default()
                };
                let width = 20;
                let filled = (step as usize * width) / total.max(1) as usize;
                let bar = format!("{}{}", "#".repeat(filled), "-".repeat(width - filled));
                // Evaluations and the last step stay on screen; other steps redraw the bar.
                let keep = step == total || m.contains_key("eval/accuracy");
                self.progress(
                    format!(
                        "[{}] [{bar}] step {step}/{total}{}{}{}{} eta {eta:.0}s",
                        stage.id,
                        show("sft/loss", "loss", 3),
                        show("critic/score/mean", "reward", 3),
                        show("eval/accuracy", "accuracy", 3),
                        show("perf/throughput", "tokens/s", 0),
                    ),
                    keep,
                )?;
                let save = stage.trainer.save_freq;
                let stop = self.opts.stop_requested() && step < total;
                if stop || (save > 0 && step % save == 0 && step < total) {
                    if let Some(o) = sft_opt.as_mut() {
                        self.policy.sync_optimizer(o)?;
                    }
                    if let Some(r) = rl.as_mut() {
                        self.policy.sync_optimizer(r.optimizer_mut())?;
                    }
                    self.checkpoint(
                        &stage.id,
                        step,
                        sft_opt.as_ref(),
                        rl.as_ref(),
                        stage.trainer.max_ckpt_to_keep,
                    )?;
                }
                if stop {
                    return Err(RunError::Stopped {
                        resume: self.opts.resume_command(&self.dir),
                        stage: stage.id.clone(),
                        step,
                    });
                }
            }
        }
        self.state.completed.push(stage.id.clone());
        self.checkpoint(&stage.id, total, None, None, stage.trainer.max_ckpt_to_keep)?;
        Ok(())
    }

    fn sft_step(
        &mut self,
        stage: &Stage,
        data: &crate::workflow::Source,
        step: u64,
        opt: &mut Optimizer,
        exclude: &HashSet<Problem>,
    ) -> Result<Metrics, RunError> {
        let t = Instant::now();
        let bs = stage.sft.batch_size;
        let problems = data.train_batch(self.wf.seed, (step - 1) * bs as u64, bs, exclude);
        let examples = problems
            .iter()
            .map(|p| self.encode(p))
            .collect::<Result<Vec<_>, RunError>>()?;
        let out = learner::algo::sft::step(&mut *self.policy, opt, &examples)?;
        let sync = self.sync_weights()?;
        let secs = t.elapsed().as_secs_f64();
        Ok([
            ("sft/loss".to_string(), out.loss),
            ("actor/grad_norm".into(), out.report.grad_norm),
            ("actor/lr".into(), out.report.lr as f64),
            ("timing_s/step".into(), secs),
            ("timing_s/sync".into(), sync),
            ("perf/throughput".into(), out.positions as f64 / secs),
        ]
        .into())
    }

    /// Greedy accuracy and mean reward on the eval set.
    fn evaluate(
        &mut self,
        set: &[Problem],
        reward: &rollout::reward::Reward,
        max_answer: usize,
    ) -> Result<(f64, f64), RunError> {
        let mut reqs = Vec::with_capacity(set.len());
        for p in set {
            let (prompt, _) = self.encode(p)?;
            let params = SamplingParams {
                temperature: 0.0,
                max_tokens: max_answer,
                ..Default::default()
            };
            reqs.push(GenerateRequest { prompt, params });
        }
        let out = self.engine.generate_blocking(reqs)?;
        let mut correct = 0.0;
        let mut total = 0.0;
        for c in &out {
            let text = self.tokenizer.decode(&c.token_ids)?;
            let s = reward.score(&text, &set[c.request].answer) as f64;
            total += s;
            // Correct: full marks, and the answer ended (not cut at the token budget).
            if s >= 1.0 && c.token_ids.last() == Some(&self.eos) {
                correct += 1.0;
            }
        }
        let n = set.len().max(1) as f64;
        Ok((correct / n, total / n))
    }
}

/// Parameters of the task, re-exported for the CLI's `config show`.
pub type Task = ArithTask;
