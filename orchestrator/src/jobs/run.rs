//! A job's lifecycle, the same for `trellis train`/`resume` and for every job of a server: set
//! up its record, model, engines and roles from the job's plan and the store's progress, run
//! the executor, and record how it ended. [`Outcome::state`] is the one place that decides the
//! state an ending leaves a job in: succeeded; failed (resumable from its last checkpoint);
//! cancelled by someone (resumable); or stopped because its process was asked to stop or
//! preempted, which leaves it pending, to continue where it stopped.
//!
//! Run directory: `store.redb` (the job store: spec, state, progress, checkpoint index and every
//! metric row), `workflow.json` (the resolved workflow, for people), `metrics.jsonl` (one object
//! per step, an export of the store's rows), `tensorboard/`, and `checkpoints/<stage>/step_<N>/`.

use crate::exec::{ExecError, Executor, Prompts, Roles, Summary};
use crate::kinds::learner::{LearnerActor, RankRole};
use crate::kinds::rollout::RolloutActor;
use crate::plan::Placement;
use crate::plan::{LearnerEngine, ModelSource, Plan, PlanError, RolloutEngine};
use crate::pools::learner::{LearnerPool, LearnerStart};
use crate::pools::rollout::{PoolStart, RolloutPool};
use crate::pools::{Cluster, ClusterHead, Meeting, PoolError, agent_spec};
use crate::record::mlflow::Mlflow;
use crate::record::tensorboard::TensorBoard;
use crate::record::{Event, JsonlSink, LiveStatus, RecordError, Recorder, Records, StoreSink};
use crate::roles::{LocalPolicy, LocalRoles, Policy, RankRoles, RoleError};
use crate::store::{Job, JobState, JobStatus, JobStore, Progress, Store, StoreError};
use actors::Actor as _;
use kernels::tensor::WeightSnapshot;
use learner::Model;
use learner::checkpoint::Checkpoint;
use learner::engine::Backend;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// Why a job was asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// Someone cancelled it (Ctrl-C, `trellis cancel`): it ends cancelled, resumable.
    Cancel,
    /// Its process is going away (SIGTERM, a server shutting down, a preemption): it stays
    /// pending, to continue where it stopped.
    Preempt,
}

/// A stop request, set once and read after every step.
#[derive(Debug, Default)]
pub struct StopFlag(AtomicU8);

impl StopFlag {
    /// A flag with no request.
    pub const fn new() -> Self {
        Self(AtomicU8::new(0))
    }

    /// Asks the job to stop after its current step (the first reason given stays).
    /// Async-signal-safe: a signal handler may call it.
    pub fn request(&self, reason: StopReason) {
        let v = match reason {
            StopReason::Cancel => 1,
            StopReason::Preempt => 2,
        };
        let _ = self
            .0
            .compare_exchange(0, v, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The request, if any.
    pub fn reason(&self) -> Option<StopReason> {
        match self.0.load(Ordering::SeqCst) {
            1 => Some(StopReason::Cancel),
            2 => Some(StopReason::Preempt),
            _ => None,
        }
    }
}

static PROCESS: StopFlag = StopFlag::new();

/// Asks every job of this process to stop after its current step (with a checkpoint).
/// Async-signal-safe.
pub fn request_stop(reason: StopReason) {
    PROCESS.request(reason);
}

/// Whether this process was asked to stop, and why.
pub fn stop_requested() -> Option<StopReason> {
    PROCESS.reason()
}

/// Why a job could not start or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The workflow (a job's stored one, when it is re-planned).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The work itself.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The rollout engines could not start.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The job store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The model or its checkpoint.
    #[error(transparent)]
    Learner(#[from] learner::Error),
    /// A sink of the run's record.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The learner's PJRT device.
    #[error("pools.learner: {0}")]
    Device(#[from] libtpu_sys::locate::LocateError),
    /// The rollout pool's PJRT device.
    #[error("pools.rollout: {0}")]
    RolloutDevice(libtpu_sys::locate::LocateError),
    /// A file of the run directory.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A run directory that holds no run, or another one.
    #[error("{0}")]
    RunDir(String),
    /// Stopped on request after a step (checkpointed).
    #[error("{source}: continue with `{resume}`")]
    Stopped {
        /// Why.
        source: ExecError,
        /// The command that continues the job.
        resume: String,
    },
    /// Stopped on request before its first step, while waiting for agents for its pools.
    #[error(
        "stopped on request while waiting for agents that can take the job's pools: continue with `{resume}`"
    )]
    StoppedWaiting {
        /// The command that continues the job.
        resume: String,
    },
    /// The job's thread panicked (a bug, with its message).
    #[error("the job panicked: {0}")]
    Panicked(String),
}

impl JobError {
    /// Whether the job stopped because it was asked to (it can be resumed as it is).
    pub fn is_stop(&self) -> bool {
        matches!(self, Self::Stopped { .. } | Self::StoppedWaiting { .. })
    }

    /// Whether a learner rank died or restarted — in a step, or while the ranks started (the
    /// job continues from its last checkpoint).
    pub fn is_rank_loss(&self) -> bool {
        matches!(
            self,
            Self::Exec(ExecError::Role(RoleError::Pool(PoolError::RankLost(_))))
                | Self::Pool(PoolError::RankLost(_))
        )
    }
}

/// How many times one run of a job continues from its checkpoint after losing a learner rank
/// before it fails (resumable as any failure).
pub const RECOVERIES: u32 = 3;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JobError + '_ {
    move |source| JobError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How a job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every stage ran.
    Succeeded(Summary),
    /// Asked to stop (checkpointed where it stood).
    Stopped(StopReason, JobError),
    /// An error (the job can continue from its last checkpoint).
    Failed(JobError),
}

impl Outcome {
    /// The state this ending leaves the job in.
    pub fn state(&self) -> JobState {
        match self {
            Outcome::Succeeded(_) => JobState::Succeeded,
            Outcome::Stopped(StopReason::Cancel, _) => JobState::Cancelled,
            Outcome::Stopped(StopReason::Preempt, _) => JobState::Pending,
            Outcome::Failed(_) => JobState::Failed,
        }
    }

    /// The error a job's record keeps (`None` when it succeeded or waits to continue).
    pub fn error(&self) -> Option<String> {
        match self {
            Outcome::Succeeded(_) | Outcome::Stopped(StopReason::Preempt, _) => None,
            Outcome::Stopped(StopReason::Cancel, e) => Some(format!("cancelled: {e}")),
            Outcome::Failed(e) => Some(e.to_string()),
        }
    }

    /// As a result: the summary, or the error.
    pub fn into_result(self) -> Result<Summary, JobError> {
        match self {
            Outcome::Succeeded(s) => Ok(s),
            Outcome::Stopped(_, e) | Outcome::Failed(e) => Err(e),
        }
    }
}

/// How a job is run.
#[derive(Default)]
pub struct RunOptions {
    /// Where to meet agents, for pools placed on them.
    pub cluster: Option<Cluster>,
    /// This job's stop request (besides [`request_stop`], which stops every job of the
    /// process).
    pub stop: Option<Arc<StopFlag>>,
    /// Also record progress lines in the store, as the job's log (server jobs).
    pub log_to_store: bool,
    /// The command that continues this job, for messages (default `trellis resume RUN_DIR`).
    pub resume_hint: Option<String>,
    /// More sinks of the job's record (a progress bar, a plot), after the library's.
    pub sinks: Vec<Box<dyn Recorder>>,
}

impl RunOptions {
    fn resume_command(&self, dir: &Path) -> String {
        self.resume_hint
            .clone()
            .unwrap_or_else(|| format!("trellis resume {}", dir.display()))
    }
}

/// The job store of a run directory.
pub fn store_path(dir: &Path) -> PathBuf {
    dir.join("store.redb")
}

/// What the store of a run directory says about its job.
pub type Status = JobStatus;

/// The file a running job keeps its [`Status`] in while it holds the store.
pub fn live_status_path(dir: &Path) -> PathBuf {
    dir.join("status.json")
}

/// What the store of the run in `dir` says; while a process runs the job (and holds the store),
/// what it keeps in `status.json` (`live`).
pub fn status(dir: &Path) -> Result<Status, JobError> {
    match open_run(dir) {
        Ok((store, job)) => Ok(Status {
            checkpoints: store.checkpoints(job.id)?,
            metric_rows: store.metrics(job.id, 0)?.len(),
            job,
            live: false,
        }),
        Err(JobError::Store(StoreError::Busy { path })) => {
            let live = live_status_path(dir);
            let text = std::fs::read(&live).map_err(|_| StoreError::Busy { path })?;
            serde_json::from_slice(&text)
                .map_err(|e| JobError::RunDir(format!("{}: {e}", live.display())))
        }
        Err(e) => Err(e),
    }
}

fn open_run(dir: &Path) -> Result<(Store, Job), JobError> {
    let path = store_path(dir);
    if !path.exists() {
        return Err(JobError::RunDir(format!(
            "{} holds no run (no store.redb): start one with `trellis train RECIPE --run-dir {}`",
            dir.display(),
            dir.display()
        )));
    }
    let store = Store::open(&path)?;
    let job =
        store.jobs()?.last().cloned().ok_or_else(|| {
            JobError::RunDir(format!("{}: the store holds no job", path.display()))
        })?;
    Ok((store, job))
}

/// The learner's engine: the native one, or a client of the learner's PJRT device. A local
/// pjrt rollout pool's device is checked too, so that neither fails after the job started.
pub fn open_backend(plan: &Plan) -> Result<Backend, JobError> {
    if let (RolloutEngine::Pjrt { device, plugin, .. }, crate::plan::Placement::Local) =
        (&plan.rollout.engine, plan.rollout.placement)
    {
        libtpu_sys::locate::open(
            crate::kinds::rollout::pjrt_device(*device),
            plugin.as_deref(),
        )
        .map_err(JobError::RolloutDevice)?;
    }
    Ok(match &plan.learner.engine {
        LearnerEngine::Native => Backend::Native,
        LearnerEngine::Pjrt { device, plugin } => Backend::Pjrt(libtpu_sys::locate::open_devices(
            crate::kinds::rollout::pjrt_device(*device),
            plugin.as_deref(),
            plan.learner.count,
        )?),
    })
}

/// Everything a new job of `plan` in `dir` needs checked before anything is made: its devices
/// (the learner's engine is opened and returned) and a run directory that holds no other run.
pub fn prepare(plan: &Plan, dir: &Path) -> Result<Backend, JobError> {
    let backend = open_backend(plan)?;
    if store_path(dir).exists() {
        return Err(JobError::RunDir(format!(
            "{} already holds a run: continue it with `trellis resume {}`, or pick another --run-dir",
            dir.display(),
            dir.display()
        )));
    }
    Ok(backend)
}

/// Starts a job of `plan` in `dir` and runs it here; `backend` from [`prepare`].
pub fn start(
    plan: &Plan,
    dir: &Path,
    backend: Backend,
    opts: RunOptions,
) -> Result<Summary, JobError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let spec = serde_json::to_value(&plan.spec).map_err(|e| JobError::RunDir(e.to_string()))?;
    let text = serde_json::to_string_pretty(&spec).map_err(|e| JobError::RunDir(e.to_string()))?;
    write_atomic(&dir.join("workflow.json"), text.as_bytes())?;
    let _ = std::fs::remove_file(dir.join("metrics.jsonl"));
    let store = Store::open(&store_path(dir))?;
    let job = store.create_job(&plan.name, spec, JobState::Running, None)?;
    execute(plan, dir, &store, job, Some(backend), opts).into_result()
}

/// Continues the job in `dir` from its last checkpoint, here.
pub fn resume(dir: &Path, opts: RunOptions) -> Result<Summary, JobError> {
    let (store, job) = open_run(dir)?;
    if job.state == JobState::Succeeded {
        return Ok(Summary {
            finished_before: true,
            ..Summary::default()
        });
    }
    let plan = replan(&store, &job)?;
    store.set_state(job.id, JobState::Running, None)?;
    execute(&plan, dir, &store, job.id, None, opts).into_result()
}

/// The plan of a stored job (its workflow, checked again: the files it names may have changed).
pub fn replan(store: &dyn JobStore, job: &Job) -> Result<Plan, JobError> {
    let origin = format!("{} (job {})", store.path().display(), job.id);
    let spec = serde_json::from_value(job.spec.clone())
        .map_err(|e| PlanError::new(&origin, e.to_string()))?;
    Ok(Plan::new(spec, &origin)?)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), JobError> {
    crate::store::write_atomic(path, bytes).map_err(|(path, source)| JobError::Io { path, source })
}

/// Runs job `id` of `store` (its plan `plan`, its files in `dir`) from its last checkpoint, and
/// records how it ended: the one lifecycle of every job. `backend`: the learner's engine when
/// the caller opened it already.
pub fn execute(
    plan: &Plan,
    dir: &Path,
    store: &dyn JobStore,
    id: u64,
    backend: Option<Backend>,
    opts: RunOptions,
) -> Outcome {
    let log = opts.log_to_store;
    let resume = opts.resume_command(dir);
    let stop = opts.stop.clone();
    let (mut opts, mut backend, mut recoveries) = (opts, backend, 0);
    let result = loop {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run(plan, dir, store, id, backend.take(), &mut opts)
        }))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(JobError::Panicked(what))
        });
        let stopping =
            stop_requested().is_some() || stop.as_ref().is_some_and(|s| s.reason().is_some());
        match result {
            // A learner rank's state is gone with its process: the job continues from its last
            // checkpoint here, with new ranks, redoing the steps since (they give the same
            // results: a run is a function of its seed and its checkpoint).
            Err(e) if e.is_rank_loss() && recoveries < RECOVERIES && !stopping => {
                recoveries += 1;
                let line = format!(
                    "job {id}: {e}; it continues from its last checkpoint (recovery {recoveries} of {RECOVERIES})"
                );
                tracing::warn!("{line}");
                if log {
                    let _ = store.append_log(id, &line);
                }
            }
            result => break result,
        }
    };
    // The store is the record again once this process lets it go.
    let _ = std::fs::remove_file(live_status_path(dir));
    let reason = stop_requested().or_else(|| stop.as_ref().and_then(|s| s.reason()));
    let outcome = match result {
        Ok(summary) => Outcome::Succeeded(summary),
        Err(JobError::Exec(e @ ExecError::Stopped { .. })) => Outcome::Stopped(
            reason.unwrap_or(StopReason::Cancel),
            JobError::Stopped { source: e, resume },
        ),
        Err(JobError::Pool(PoolError::StoppedWaiting)) => Outcome::Stopped(
            reason.unwrap_or(StopReason::Cancel),
            JobError::StoppedWaiting { resume },
        ),
        // Cancelled while failing: cancelled, whatever the job ended with.
        Err(e) if reason == Some(StopReason::Cancel) => Outcome::Stopped(StopReason::Cancel, e),
        Err(e) => Outcome::Failed(e),
    };
    let line = match outcome.state() {
        JobState::Succeeded => format!("job {id} succeeded"),
        JobState::Pending => {
            format!("job {id} stopped with its process; it continues from its last checkpoint")
        }
        s => format!(
            "job {id} {}: {}",
            s.name(),
            outcome.error().unwrap_or_default()
        ),
    };
    // The last line goes in before the final state: a watcher that sees the state has every
    // line.
    let recorded = (if log {
        store.append_log(id, &line).map(|_| ())
    } else {
        Ok(())
    })
    .and_then(|_| {
        store
            .set_state(id, outcome.state(), outcome.error())
            .map(|_| ())
    });
    match recorded {
        Ok(()) => outcome,
        Err(e) => {
            tracing::error!(job = id, "cannot record how the job ended: {e}");
            match outcome {
                Outcome::Succeeded(_) => Outcome::Failed(e.into()),
                other => other,
            }
        }
    }
}

/// Sets the job up and runs its executor.
fn run(
    plan: &Plan,
    dir: &Path,
    store: &dyn JobStore,
    id: u64,
    backend: Option<Backend>,
    opts: &mut RunOptions,
) -> Result<Summary, JobError> {
    let state = store.job(id)?.progress;
    let Checkpoint {
        mut model,
        mut assets,
    } = initial_model(plan)?;
    let mut version = 0;
    if let Some(ck) = &state.checkpoint {
        let c = Checkpoint::load(&dir.join(ck))?;
        model = c.model;
        assets = c.assets;
        version = state.weight_version;
    }
    if !assets.iter().any(|(n, _)| n == "tokenizer.json") {
        assets.push((
            "tokenizer.json".into(),
            plan.model.tokenizer_json.clone().into_bytes(),
        ));
    }
    let tokenizer = &plan.model.tokenizer;
    let eos = model
        .config
        .eos_token_id
        .or_else(|| tokenizer.token_id("<eos>"))
        .ok_or_else(|| {
            JobError::RunDir(
                "the model config has no eos_token_id and the tokenizer no <eos>".into(),
            )
        })?;
    let backend = match backend {
        Some(b) => b,
        None => open_backend(plan)?,
    };
    let mut records = Records::default();
    records.push(Box::new(StoreSink::new(store, id, opts.log_to_store)));
    let metrics_path = dir.join("metrics.jsonl");
    rewind_metrics(store, id, &state, &metrics_path)?;
    records.push(Box::new(JsonlSink::open(&metrics_path)?));
    let tb = dir.join("tensorboard");
    records.push(Box::new(TensorBoard::new(&tb)));
    if let Some(target) = &plan.mlflow {
        let mut params = Vec::new();
        let spec = serde_json::to_value(&plan.spec).unwrap_or_default();
        crate::record::mlflow::flatten("", &spec, &mut params);
        let name = dir
            .file_name()
            .map_or_else(|| plan.name.clone(), |n| n.to_string_lossy().into_owned());
        records.push(Box::new(Mlflow::open(target.clone(), dir, &name, &params)?));
    }
    records.push(Box::new(LiveStatus::new(
        live_status_path(dir),
        JobStatus {
            job: store.job(id)?,
            checkpoints: store.checkpoints(id)?,
            metric_rows: store.metrics(id, 0)?.len(),
            live: true,
        },
    )?));
    let resume = opts.resume_command(dir);
    let RunOptions {
        cluster,
        stop: flag,
        log_to_store: _,
        resume_hint: _,
        sinks,
    } = opts;
    let stop = || stop_requested().is_some() || flag.as_ref().is_some_and(|f| f.reason().is_some());
    for s in sinks.iter_mut() {
        records.push(Box::new(&mut **s));
    }
    // Shared with the learner that trains `model` below: engines in this process start on
    // these values without a copy.
    let weights = WeightSnapshot::new(version, Arc::new(model.params.share()));
    let stopped = |e: PoolError| match e {
        PoolError::StoppedWaiting => JobError::StoppedWaiting {
            resume: resume.clone(),
        },
        e => e.into(),
    };
    // Every pool on agents meets them through one head, and all must fit at once before any
    // starts: a placement that cannot be met is refused naming what is missing, with nothing
    // started.
    let mut specs = Vec::new();
    // Colocated engines and ranks are placed in pairs, each pair on one agent.
    let pair = |mut spec: actors::PoolSpec| {
        if plan.rollout.colocated {
            spec.colocate = Some("policy".into());
        }
        spec
    };
    if let Placement::Agents(s) = plan.rollout.placement {
        let device = plan.rollout.device();
        let count = plan.rollout.count;
        specs.push(pair(agent_spec(
            "rollout",
            RolloutActor::KIND,
            count,
            device,
            s,
        )));
    }
    if let Placement::Agents(s) = plan.learner.placement {
        let (count, device) = (plan.learner.count, plan.learner.device);
        specs.push(pair(agent_spec(
            "learner",
            LearnerActor::KIND,
            count,
            device,
            s,
        )));
        // PPO's critic trains on as many ranks, beside the policy's.
        let ppo = plan
            .stages
            .iter()
            .any(|st| matches!(&st.work, crate::plan::Work::Rl(r) if r.critic.is_some()));
        if ppo {
            specs.push(agent_spec("critic", LearnerActor::KIND, count, device, s));
        }
    }
    let meeting = match (&cluster, specs.is_empty()) {
        (Some(c), false) => {
            let mut note = |text: &str| {
                let _ = records.event(Event::Note { text, always: true });
            };
            let m = Meeting::open(c, &mut note)?;
            m.wait_for_room(&specs, &stop).map_err(stopped)?;
            Some(m)
        }
        _ => None,
    };
    // A job that continues in this process (after losing a learner rank, even while its pools
    // start) listens where its agents already know it, though it was started on any free port.
    if let (
        Some(m),
        Some(Cluster {
            head: ClusterHead::Listen { listen, .. },
            ..
        }),
    ) = (&meeting, cluster.as_mut())
    {
        *listen = m.address();
    }
    let pools_cluster = meeting.as_ref().map(Meeting::cluster);
    // Colocated engines and ranks start in pairs on the agents the placement gives each pair.
    let pairs = match (&meeting, plan.rollout.colocated) {
        (Some(m), true) => Some(m.pairs(&specs)?),
        _ => None,
    };
    let pool = {
        let mut note = |text: &str| {
            let _ = records.event(Event::Note { text, always: true });
        };
        RolloutPool::new(PoolStart {
            plan: &plan.rollout,
            config: &model.config,
            weights: weights.clone(),
            cluster: pools_cluster.as_ref(),
            stop: &stop,
            run_dir: dir,
            needs_processed: plan.trains_on_engine_logprobs(),
            note: &mut note,
            agent: plan.agent_setup(model.config.max_position_embeddings),
            beside: pairs.clone(),
        })
        .map_err(stopped)?
    };
    let mut learner_ranks = None;
    let policy: Box<dyn Policy> = if plan.learner.on_actors() {
        let mut note = |text: &str| {
            let _ = records.event(Event::Note { text, always: true });
        };
        let ranks = LearnerPool::start(LearnerStart {
            count: plan.learner.count,
            placement: plan.learner.placement,
            device: plan.learner.device,
            cluster: pools_cluster.as_ref(),
            stop: &stop,
            note: &mut note,
            config: &model.config,
            weights,
            assets,
            shard_optimizer: plan.learner.shard_optimizer,
            allreduce: plan.learner.allreduce,
            precision: plan.learner.precision,
            role: RankRole::Policy,
            // Colocated: rank i in the process of engine i.
            beside: pairs,
        })
        .map_err(stopped)?;
        tracing::info!(
            ranks = plan.learner.count,
            "learner on data-parallel ranks of the native engine"
        );
        learner_ranks = Some(ranks.locations());
        Box::new(ranks)
    } else {
        drop(weights);
        model.set_precision(plan.learner.precision);
        let engine = learner::engine::open(model, backend)?;
        tracing::info!(
            on = engine.describe(),
            "learner on the {} engine",
            policy_engine(&plan.learner.engine)
        );
        Box::new(LocalPolicy::new(engine, assets).weights_on_device(plan.weights_stay_on_device()))
    };
    let roles = Roles {
        policy,
        rollouts: Arc::new(pool),
        maker: if plan.learner.on_actors() {
            Box::new(RankRoles {
                cluster: pools_cluster.clone(),
                count: plan.learner.count,
                placement: plan.learner.placement,
                device: plan.learner.device,
                shard_optimizer: plan.learner.shard_optimizer,
                allreduce: plan.learner.allreduce,
                precision: plan.learner.precision,
            })
        } else {
            Box::new(LocalRoles {
                precision: plan.learner.precision,
            })
        },
    };
    let job = crate::exec::Job {
        plan,
        dir,
        store,
        id,
        records,
        stop: &stop,
    };
    let prompts = Prompts {
        tokenizer,
        chat: plan.model.chat.as_deref(),
        eos,
    };
    let mut executor = Executor::new(job, roles, prompts, state, version);
    if plan.rollout.placement != crate::plan::Placement::Local {
        // Always said: where the engines run is the first thing to check on a cluster.
        let line = format!("rollout pool: {}", executor.rollout_locations().join(", "));
        executor.note(&line, true)?;
    }
    if let Some(ranks) = learner_ranks {
        executor.note(&format!("learner ranks: {}", ranks.join(", ")), true)?;
    }
    Ok(executor.run()?)
}

/// The model a job of `plan` starts from (its checkpoint with the checkpoint's side files, or
/// its `init` config with seeded weights): what `trellis engine serve --recipe` serves until
/// the job pushes its weights.
pub fn initial_model(plan: &Plan) -> Result<Checkpoint, learner::Error> {
    Ok(match &plan.model.source {
        ModelSource::Checkpoint(p) => Checkpoint::load(p)?,
        ModelSource::Init(config) => Checkpoint {
            model: Model::init(config.clone(), plan.seed),
            assets: Vec::new(),
        },
    })
}

fn policy_engine(e: &LearnerEngine) -> &'static str {
    match e {
        LearnerEngine::Native => "native",
        LearnerEngine::Pjrt { .. } => "pjrt",
    }
}

/// Drops the metric rows written after the checkpoint being resumed from (those steps run
/// again), then rewrites `metrics.jsonl` from the store's rows.
fn rewind_metrics(
    store: &dyn JobStore,
    job: u64,
    state: &Progress,
    path: &Path,
) -> Result<(), JobError> {
    store.rewind(job, state)?;
    let mut out = String::new();
    for (_, row) in store.metrics(job, 0)? {
        out.push_str(&row.to_string());
        out.push('\n');
    }
    write_atomic(path, out.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_lost_in_a_step_or_while_the_ranks_start_is_recovered_and_nothing_else() {
        let lost = || PoolError::RankLost("actor `learner-0` died".into());
        for (e, recovered) in [
            (
                JobError::Exec(ExecError::Role(RoleError::Pool(lost()))),
                true,
            ),
            (JobError::Pool(lost()), true),
            (JobError::Pool(PoolError::StoppedWaiting), false),
            (JobError::Panicked("boom".into()), false),
        ] {
            assert_eq!(e.is_rank_loss(), recovered, "{e}");
        }
    }
}
