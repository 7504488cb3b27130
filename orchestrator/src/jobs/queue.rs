//! A server's job queue: jobs submitted as workflows wait in the store, and run `max_running` at
//! a time through the one lifecycle ([`super::run::execute`]): each in a process of its own when
//! the server gives a [`WorkerCommand`] ([`super::worker`]: a job that aborts or is killed fails
//! alone; one with pools on the server's agents borrows them from the server's head), else on a
//! thread of the server. Cancel, resume and shutdown move jobs between
//! states only while holding the queue's one table of running jobs, so a job never runs twice.
//!
//! Restart safety: a job is marked running in the store before it starts; a queue that finds
//! running jobs at start (its server was killed) queues them again, and they continue from
//! their last checkpoint.
//!
//! Owns: the queue, job control and the job threads. Never: speaks a wire protocol (the
//! server does), or deletes a job's files.

use super::run::{self, RunOptions, StopFlag, StopReason};
use crate::plan::{Plan, PlanError};
use crate::pools::{Cluster, ClusterHead, lock};
use crate::record::Recorder;
use crate::store::{Job, JobState, Store, StoreError};
use actors::Head;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// What the queue refuses.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A workflow that cannot run (nothing was queued).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The server is stopping: nothing new is taken.
    #[error("the server is stopping")]
    Stopping,
    /// A job in a state the call does not apply to.
    #[error("{0}")]
    State(String),
}

/// Extra sinks of each job's record (the server's plot), by job id and run directory, for jobs
/// on the server's threads (a job's own process makes its own).
pub type SinkMaker = Box<dyn Fn(u64, &Path) -> Vec<Box<dyn Recorder>> + Send + Sync>;

/// The command that runs job `id` (run directory `dir`, server store file `store`) in a process
/// of its own, speaking [`super::worker`]'s protocol on its stdin and stdout.
pub type WorkerCommand = Box<dyn Fn(u64, &Path, &Path) -> std::process::Command + Send + Sync>;

/// How a running job is stopped.
#[derive(Default)]
struct Control {
    stop: Arc<StopFlag>,
}

/// The job queue and what runs it.
pub struct Queue {
    store: Arc<Store>,
    data_dir: PathBuf,
    head: Head,
    agent_wait: Duration,
    max_running: usize,
    /// Jobs running now. Held while a job moves between pending, running and cancelled, so the
    /// scheduler and the API never both move one.
    running: Mutex<HashMap<u64, Arc<Control>>>,
    wake: Notify,
    stopping: AtomicBool,
    sinks: SinkMaker,
    worker: Option<WorkerCommand>,
}

impl Queue {
    /// The queue of `store`, its jobs' files under `data_dir/jobs/<id>`, their pools on
    /// `head`'s agents (waited for up to `agent_wait`); local jobs in processes of their own
    /// when `worker` is given. Jobs a killed server left running are queued again.
    pub fn new(
        store: Arc<Store>,
        data_dir: &Path,
        head: Head,
        agent_wait: Duration,
        max_running: usize,
        sinks: SinkMaker,
        worker: Option<WorkerCommand>,
    ) -> Result<Arc<Self>, StoreError> {
        for job in store.jobs()? {
            if job.state == JobState::Running {
                store.append_log(
                    job.id,
                    "the server stopped while this job ran; continuing from its last checkpoint",
                )?;
                store.set_state(job.id, JobState::Pending, None)?;
            }
        }
        Ok(Arc::new(Self {
            store,
            data_dir: data_dir.to_path_buf(),
            head,
            agent_wait,
            max_running: max_running.max(1),
            running: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            stopping: AtomicBool::new(false),
            sinks,
            worker,
        }))
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The head agents register with.
    pub fn head(&self) -> &Head {
        &self.head
    }

    /// Job `id`'s run directory.
    pub fn run_dir(&self, id: u64) -> PathBuf {
        self.data_dir.join("jobs").join(id.to_string())
    }

    /// Whether job `id` is running and was asked to cancel.
    pub fn cancel_requested(&self, id: u64) -> bool {
        lock(&self.running)
            .get(&id)
            .is_some_and(|c| c.stop.reason() == Some(StopReason::Cancel))
    }

    /// Plans `text` (the workflow file `origin`, with `overrides`) and queues it for `owner`
    /// (a server user's name; `None` for the admin); returns the
    /// job's id. Planning reads datasets and checkpoints' config: call it off async threads.
    pub fn submit(
        &self,
        text: &str,
        origin: &str,
        overrides: &[String],
        owner: Option<&str>,
    ) -> Result<u64, QueueError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(QueueError::Stopping);
        }
        let plan = crate::plan::parse(text, origin, overrides)?;
        let spec = serde_json::to_value(&plan.spec)
            .map_err(|e| QueueError::State(format!("cannot store the workflow: {e}")))?;
        let id = self
            .store
            .create_job(&plan.name, spec, JobState::Pending, owner)?;
        self.wake.notify_one();
        tracing::info!(job = id, name = %plan.name, "job submitted");
        Ok(id)
    }

    /// Cancels job `id`: a running one stops after its current step (with a checkpoint), a
    /// pending one at once.
    pub fn cancel(&self, id: u64) -> Result<(), QueueError> {
        let running = lock(&self.running);
        let job = self.store.job(id)?;
        if let Some(control) = running.get(&id) {
            control.stop.request(StopReason::Cancel);
            drop(running);
            self.store
                .append_log(id, "cancel requested: stopping after the current step")?;
        } else if job.state == JobState::Pending {
            self.store.set_state(
                id,
                JobState::Cancelled,
                Some("cancelled before it ran".into()),
            )?;
        } else {
            return Err(QueueError::State(format!(
                "job {id} is {}: only a pending or running job can be cancelled",
                job.state.name()
            )));
        }
        Ok(())
    }

    /// Queues a failed or cancelled job `id` again, to continue from its last checkpoint.
    pub fn resume(&self, id: u64) -> Result<(), QueueError> {
        {
            let running = lock(&self.running);
            let job = self.store.job(id)?;
            match job.state {
                // Also while its thread is still winding down after recording the ending (a
                // watcher may see the ending first): the scheduler starts no job in `running`,
                // so it runs again only once that thread is gone.
                JobState::Failed | JobState::Cancelled => {
                    self.store.set_state(id, JobState::Pending, None)?;
                    self.store
                        .append_log(id, "resumed: continuing from the last checkpoint")?;
                }
                JobState::Succeeded => {
                    return Err(QueueError::State(format!(
                        "job {id} has finished: nothing to resume"
                    )));
                }
                s => {
                    return Err(QueueError::State(format!(
                        "job {id} is {}: only a failed or cancelled job can be resumed",
                        if running.contains_key(&id) {
                            "still running"
                        } else {
                            s.name()
                        }
                    )));
                }
            }
        }
        self.wake.notify_one();
        Ok(())
    }

    /// Starts pending jobs, oldest first, while slots are free.
    fn start_pending(self: &Arc<Self>) -> Result<(), StoreError> {
        let mut running = lock(&self.running);
        let free = self.max_running.saturating_sub(running.len());
        if free == 0 {
            return Ok(());
        }
        let pending: Vec<Job> = self
            .store
            .jobs()?
            .into_iter()
            .filter(|j| j.state == JobState::Pending && !running.contains_key(&j.id))
            .take(free)
            .collect();
        for job in pending {
            let id = job.id;
            self.store.set_state(id, JobState::Running, None)?;
            let control = Arc::new(Control::default());
            running.insert(id, control.clone());
            let queue = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("job-{id}"))
                .spawn(move || queue.run(job, &control));
            if let Err(e) = spawned {
                running.remove(&id);
                let why = format!("cannot start a thread for the job: {e}");
                self.store.set_state(id, JobState::Failed, Some(why))?;
            }
        }
        Ok(())
    }

    /// Runs one job from this thread (in a process of its own, or here); the lifecycle records
    /// how it ended.
    fn run(self: &Arc<Self>, job: Job, control: &Control) {
        let id = job.id;
        let dir = self.run_dir(id);
        let planned: Result<Plan, run::JobError> = run::replan(&*self.store, &job).and_then(|p| {
            std::fs::create_dir_all(&dir).map_err(|source| run::JobError::Io {
                path: dir.clone(),
                source,
            })?;
            Ok(p)
        });
        let state = match planned {
            Ok(plan) => match &self.worker {
                Some(worker) => self.run_in_process(id, &dir, worker, control),
                None => {
                    let opts = RunOptions {
                        cluster: Some(Cluster {
                            head: ClusterHead::Shared(self.head.clone()),
                            wait: self.agent_wait,
                        }),
                        stop: Some(control.stop.clone()),
                        log_to_store: true,
                        resume_hint: Some(format!("trellis resume {id}")),
                        sinks: (self.sinks)(id, &dir),
                    };
                    run::execute(&plan, &dir, &*self.store, id, None, opts).state()
                }
            },
            Err(e) => self.fail(id, e.to_string()),
        };
        tracing::info!(job = id, state = state.name(), "job ended");
        lock(&self.running).remove(&id);
        self.wake.notify_one();
    }

    /// Records that job `id` failed before or outside its lifecycle (it did not plan, or its
    /// process ended without recording an ending): the last log line, then the state.
    fn fail(&self, id: u64, why: String) -> JobState {
        let recorded = self
            .store
            .append_log(
                id,
                &format!("job {id} failed: {why}; continue it with `trellis resume {id}`"),
            )
            .and_then(|_| self.store.set_state(id, JobState::Failed, Some(why)));
        if let Err(e) = recorded {
            tracing::error!(job = id, "cannot record how the job ended: {e}");
        }
        JobState::Failed
    }

    /// Runs job `id` in a process of its own: serves its calls to the store until it ends,
    /// passes a stop request on as a signal (SIGUSR1: cancel, SIGTERM: stop and stay pending),
    /// and fails the job when the process ended without recording an ending.
    fn run_in_process(
        &self,
        id: u64,
        dir: &Path,
        worker: &WorkerCommand,
        control: &Control,
    ) -> JobState {
        let fail = |why: String| self.fail(id, why);
        let mut cmd = worker(id, dir, self.store.path());
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return fail(format!("cannot start its process: {e}")),
        };
        let pid = child.id();
        let _ = self
            .store
            .append_log(id, &format!("job {id} runs in process {pid}"));
        let (Some(to), Some(from)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return fail("its process has no pipes".into());
        };
        let ended = Arc::new(AtomicBool::new(false));
        let forward = {
            let (ended, stop) = (ended.clone(), control.stop.clone());
            std::thread::spawn(move || {
                while !ended.load(Ordering::SeqCst) {
                    if let Some(reason) = stop.reason() {
                        let sig = match reason {
                            StopReason::Cancel => libc::SIGUSR1,
                            StopReason::Preempt => libc::SIGTERM,
                        };
                        // SAFETY: signalling the job's process, which we have not reaped yet
                        // (the pid cannot have been reused).
                        unsafe { libc::kill(pid as libc::pid_t, sig) };
                        return Some((reason, sig));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                None
            })
        };
        let lending = super::worker::Lending {
            head: &self.head,
            borrower: format!("job {id}"),
        };
        let served = super::worker::serve(
            &self.store,
            Some(&lending),
            std::io::BufReader::new(from),
            to,
        );
        if let Err(e) = served {
            tracing::warn!(job = id, "the job's process: {e}");
            let _ = child.kill();
        }
        let status = child.wait();
        // Whatever the job left on agents (it was killed, or its pools never stopped) goes.
        self.head.end_loan(&lending.borrower);
        ended.store(true, Ordering::SeqCst);
        let sent = forward.join().ok().flatten();
        let state = self.store.job(id).map(|j| j.state);
        match (state, status) {
            // Killed by the stop we sent before it could take the signal itself (it was just
            // starting): it ends as that stop asks — nothing ran past its last checkpoint.
            (Ok(JobState::Running), Ok(status))
                if sent.is_some_and(|(_, sig)| {
                    std::os::unix::process::ExitStatusExt::signal(&status) == Some(sig)
                }) =>
            {
                let (state, error) = match sent.map(|(reason, _)| reason) {
                    Some(StopReason::Cancel) => (
                        JobState::Cancelled,
                        Some("cancelled: before its process started".to_string()),
                    ),
                    _ => (JobState::Pending, None),
                };
                match self.store.set_state(id, state, error) {
                    Ok(_) => state,
                    Err(e) => fail(format!("cannot record its stop: {e}")),
                }
            }
            (Ok(JobState::Running), Ok(status)) => fail(super::worker::describe_exit(status)),
            (Ok(JobState::Running), Err(e)) => fail(format!("its process was lost: {e}")),
            (Ok(state), _) => state,
            (Err(e), _) => {
                tracing::error!(job = id, "cannot read how the job ended: {e}");
                JobState::Failed
            }
        }
    }

    /// Starts queued jobs whenever something may have freed a slot or queued a job, until
    /// [`Queue::stop`].
    pub async fn schedule(self: Arc<Self>) {
        while !self.stopping.load(Ordering::SeqCst) {
            if let Err(e) = self.start_pending() {
                tracing::error!("cannot start queued jobs: {e}");
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Takes no new jobs and asks the running ones to stop after their current step (they stay
    /// queued, to continue at the next start); returns once they have.
    pub async fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.wake.notify_one();
        for control in lock(&self.running).values() {
            control.stop.request(StopReason::Preempt);
        }
        while !lock(&self.running).is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the queue stopped taking jobs.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server stopping just as a job's process starts signals it before the process could
    /// take the signal itself (it dies of it): the job waits to continue, as a job that took the
    /// stop does, instead of failing. `sleep` plays a process that never takes SIGTERM.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_process_killed_by_the_servers_own_stop_waits_to_continue() {
        let dir = std::env::temp_dir().join(format!("trellis-queue-stop-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = Arc::new(Store::open(&run::store_path(&dir)).unwrap());
        let token = actors::Token::generate().unwrap();
        let (head, _routes) = Head::new(
            "127.0.0.1:0".parse().unwrap(),
            token,
            actors::HeadConfig::default(),
        );
        let worker: WorkerCommand = Box::new(|_, _, _| {
            let mut c = std::process::Command::new("sleep");
            c.arg("30");
            c
        });
        let queue = Queue::new(
            store,
            &dir,
            head,
            Duration::from_secs(1),
            1,
            Box::new(|_, _| Vec::new()),
            Some(worker),
        )
        .unwrap();
        let workflow = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/tiny-arith.yaml");
        let text = std::fs::read_to_string(workflow).unwrap();
        let id = queue.submit(&text, workflow, &[], None).unwrap();
        tokio::spawn(queue.clone().schedule());
        let running = || queue.store().job(id).unwrap().state == JobState::Running;
        for _ in 0..200 {
            if running() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(running(), "the job started");
        queue.stop().await;
        let job = queue.store().job(id).unwrap();
        assert_eq!((job.state, job.error), (JobState::Pending, None));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
