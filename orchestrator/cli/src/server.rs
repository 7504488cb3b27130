//! `trellis serve`: the long-running head. One port serves the job API (`JobService`), agent
//! registration (`Head`), the standard health service and server reflection; submitted
//! workflows queue in the durable store of the data dir and run, `max_running` at a time, with
//! their pools on the registered agents (or in this process, for `placement: local`).
//!
//! Data dir: `store.redb` (every job, its state, progress, checkpoint index, metric rows and log
//! lines), `token` (mode 0600: the admin's bearer token for the API), `agent-token` (the cluster
//! token agents present), `users/NAME.token` (users' API tokens: see [`crate::access`]), and
//! `jobs/<id>/` (each job's run directory: checkpoints, `metrics.jsonl`, `tensorboard/`,
//! `plot.png`).
//!
//! Restart safety: a job is marked running in the store before it starts; a server that finds
//! running jobs at start (it was killed) queues them again, and they continue from their last
//! checkpoint (the steps after it are run again; their earlier rows are replaced). Ctrl-C stops
//! running jobs after their current step with a checkpoint and leaves them queued for the next
//! start.
//!
//! Owns: the job queue, job control (cancel, resume), the API's wire types and authentication.
//! Never: runs a step itself (that is [`crate::train::run_job`]'s), touches tensors, or
//! deletes a job's files.

use crate::access::{ApiGuard, Caller, Users};
use actors::{Head, HeadConfig, Token};
use orchestrator::jobs::queue::{Queue, QueueError, SinkMaker};
use orchestrator::store::{Job, JobState, Store, StoreError};
use proto::v1 as pb;
use proto::v1::job_service_server::{JobService, JobServiceServer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

/// The largest request the API accepts (a workflow's YAML and overrides).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// How to run a server.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Address of the one port (API, agents, health, reflection).
    pub listen: SocketAddr,
    /// Where the store, the token and the jobs' run directories live.
    pub data_dir: PathBuf,
    /// Jobs run at once; the others wait in the queue.
    pub max_running: usize,
    /// PEM certificate chain and private key: serve TLS (and reach agents over TLS only).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// PEM certificate(s) to check agents' certificates against when serving TLS (default: the
    /// server's own certificate file, for agents that share it).
    pub agent_tls_ca: Option<PathBuf>,
    /// How long a job waits for agents that can take its pools.
    pub agent_wait: Duration,
    /// The admin's token file (default `DATA_DIR/token`); created, mode 0600, when missing.
    pub token_file: Option<PathBuf>,
    /// The agents' token file (default `DATA_DIR/agent-token`); created, mode 0600, when
    /// missing.
    pub agent_token_file: Option<PathBuf>,
    /// Run jobs whose pools are local in processes of their own (`trellis job-worker`), with
    /// this log filter and kernel thread count; `None`: every job on a thread of the server.
    pub job_processes: Option<JobProcesses>,
}

/// How a server starts a job's process.
#[derive(Clone, Debug)]
pub struct JobProcesses {
    /// The `--log` filter.
    pub log: String,
    /// The `--threads` count.
    pub threads: usize,
}

impl JobProcesses {
    /// The command for job `id` in `dir` of the store `store`: this binary's `job-worker`, in a
    /// process group of its own (a terminal's Ctrl-C reaches the server, which stops its jobs
    /// itself) that dies with the server (`PR_SET_PDEATHSIG`: a server killed with -9 takes its
    /// jobs' processes with it, and its restart continues them).
    fn command(
        &self,
        id: u64,
        dir: &Path,
        store: &Path,
        agent_wait: Duration,
    ) -> std::process::Command {
        use std::os::unix::process::CommandExt;
        // This very binary, even if its file was replaced or deleted since the server started
        // (an upgrade in place): a job's process speaks the server's version of the protocol.
        let mut cmd = std::process::Command::new("/proc/self/exe");
        cmd.args(["--log", &self.log, "--threads", &self.threads.to_string()])
            .args(["job-worker", "--job", &id.to_string(), "--run-dir"])
            .arg(dir)
            .arg("--store")
            .arg(store)
            .arg("--agent-wait")
            .arg(agent_wait.as_secs_f64().to_string());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setpgid(0, 0) != 0
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }
}

impl ServeOptions {
    /// The admin's token file.
    pub fn token_path(&self) -> PathBuf {
        self.token_file
            .clone()
            .unwrap_or_else(|| self.data_dir.join("token"))
    }

    /// The agents' token file.
    pub fn agent_token_path(&self) -> PathBuf {
        self.agent_token_file
            .clone()
            .unwrap_or_else(|| self.data_dir.join("agent-token"))
    }
}

/// Why a server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The data dir, the token or a TLS file.
    #[error("{path}: {message}")]
    File {
        /// The file or folder.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The listening socket or the server.
    #[error("cannot serve on {listen}: {message}")]
    Listen {
        /// The address.
        listen: SocketAddr,
        /// What went wrong.
        message: String,
    },
}

/// Whether the API must be called with a token: always, unless only this host can reach it (and
/// it has no users: [`crate::access`]).
pub fn token_required(listen: &SocketAddr) -> bool {
    !listen.ip().is_loopback()
}

/// Reads the token file at `path`, creating it (mode 0600) when absent.
pub fn token_at(path: &Path) -> Result<Token, ServeError> {
    let path = path.to_path_buf();
    let file = |e: actors::TokenError| ServeError::File {
        path: path.clone(),
        message: e.to_string(),
    };
    if path.exists() {
        return Token::read(&path).map_err(file);
    }
    let token = Token::generate().map_err(file)?;
    token.write(&path).map_err(file)?;
    Ok(token)
}

/// Serves until `shutdown` resolves, then stops running jobs after their current step (they
/// stay queued for the next start) and returns. `ready` gets the bound address once listening;
/// `sinks` makes each job's extra record sinks.
pub async fn serve(
    opts: ServeOptions,
    sinks: SinkMaker,
    ready: impl FnOnce(SocketAddr),
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let dir = &opts.data_dir;
    let file = |path: &Path, e: std::io::Error| ServeError::File {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir.join("jobs")).map_err(|e| file(dir, e))?;
    let token = token_at(&opts.token_path())?;
    let agent_token = token_at(&opts.agent_token_path())?;
    if token.matches_token(&agent_token) {
        return Err(ServeError::File {
            path: opts.agent_token_path(),
            message: format!(
                "the agents' token is the admin's ({}): an agent could then run jobs; give agents a token of their own",
                opts.token_path().display()
            ),
        });
    }
    let store = Arc::new(Store::open(&dir.join("store.redb"))?);
    let tls = match &opts.tls {
        Some((cert, key)) => {
            let cert_pem = std::fs::read(cert).map_err(|e| file(cert, e))?;
            let key_pem = std::fs::read(key).map_err(|e| file(key, e))?;
            Some(
                tonic::transport::ServerTlsConfig::new()
                    .identity(tonic::transport::Identity::from_pem(cert_pem, key_pem)),
            )
        }
        None => None,
    };
    let listen_err = |message: String| ServeError::Listen {
        listen: opts.listen,
        message,
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| listen_err(e.to_string()))?;
    let address = listener
        .local_addr()
        .map_err(|e| listen_err(e.to_string()))?;
    // A head that serves TLS reaches its agents over TLS too.
    let agent_tls_ca = match (&opts.tls, &opts.agent_tls_ca) {
        (Some(_), Some(ca)) => Some(std::fs::read(ca).map_err(|e| file(ca, e))?),
        (Some((cert, _)), None) => Some(std::fs::read(cert).map_err(|e| file(cert, e))?),
        (None, Some(ca)) => {
            return Err(ServeError::File {
                path: ca.clone(),
                message: "--agent-tls-ca is for a server with --tls-cert and --tls-key".into(),
            });
        }
        (None, None) => None,
    };
    let config = HeadConfig {
        agent_tls_ca,
        ..HeadConfig::default()
    };
    let (head, routes) = Head::new(address, agent_token.clone(), config);
    let agent_wait = opts.agent_wait;
    let worker = opts.job_processes.clone().map(|p| {
        Box::new(move |id: u64, dir: &Path, store: &Path| p.command(id, dir, store, agent_wait))
            as orchestrator::jobs::queue::WorkerCommand
    });
    let jobs = Queue::new(
        store,
        dir,
        head.clone(),
        opts.agent_wait,
        opts.max_running,
        sinks,
        worker,
    )?;
    let guard = ApiGuard::new(
        token,
        agent_token,
        Users::at(dir),
        !token_required(&opts.listen),
    );
    let api = InterceptedService::new(
        JobServiceServer::new(Api(jobs.clone())).max_decoding_message_size(MAX_REQUEST_BYTES),
        guard,
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<JobServiceServer<Api>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| listen_err(format!("reflection: {e}")))?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| listen_err(format!("reflection: {e}")))?;
    let routes = routes
        .add_service(api)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| listen_err(format!("TLS: {e}")))?;
    }
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(builder.add_routes(routes).serve_with_incoming_shutdown(
        incoming,
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        },
    ));
    let scheduler = tokio::spawn(jobs.clone().schedule());
    tracing::info!(%address, data_dir = %dir.display(), "serving");
    ready(address);
    shutdown.await;
    tracing::info!("stopping: running jobs finish their current step and checkpoint");
    jobs.stop().await;
    let _ = scheduler.await;
    health.set_not_serving::<JobServiceServer<Api>>().await;
    // Agents stay up: they register again with the next server.
    head.shutdown(false).await;
    stop_tx.send_replace(true);
    match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(Ok(Err(e))) => Err(listen_err(e.to_string())),
        _ => Ok(()),
    }
}

/// A job on the wire.
fn proto_job(jobs: &Queue, job: &Job, with_workflow: bool) -> Result<pb::Job, StoreError> {
    let last = jobs.store().last_metrics(job.id)?;
    Ok(pb::Job {
        id: job.id,
        name: job.name.clone(),
        state: proto_state(job.state) as i32,
        error: job.error.clone().unwrap_or_default(),
        created_ms: job.created_ms,
        updated_ms: job.updated_ms,
        stages_completed: job.progress.completed.clone(),
        checkpoint_stage: job.progress.stage.clone().unwrap_or_default(),
        checkpoint_step: job.progress.step,
        checkpoint: job.progress.checkpoint.clone().unwrap_or_default(),
        weight_version: job.progress.weight_version,
        stage: last
            .as_ref()
            .and_then(|r| r.get("stage")?.as_str().map(str::to_string))
            .unwrap_or_default(),
        step: last
            .as_ref()
            .and_then(|r| r.get("step")?.as_u64())
            .unwrap_or(0),
        run_dir: jobs.run_dir(job.id).display().to_string(),
        workflow_json: if with_workflow {
            job.spec.to_string()
        } else {
            String::new()
        },
        cancel_requested: jobs.cancel_requested(job.id),
        owner: job.owner.clone().unwrap_or_default(),
    })
}

fn proto_state(s: JobState) -> pb::JobState {
    match s {
        JobState::Pending => pb::JobState::Pending,
        JobState::Running => pb::JobState::Running,
        JobState::Succeeded => pb::JobState::Succeeded,
        JobState::Failed => pb::JobState::Failed,
        JobState::Cancelled => pb::JobState::Cancelled,
    }
}

fn status(e: StoreError) -> Status {
    match e {
        StoreError::NoJob { id, .. } => Status::not_found(format!("no job {id}")),
        e => Status::internal(e.to_string()),
    }
}

fn queue_status(e: QueueError) -> Status {
    match e {
        QueueError::Store(e) => status(e),
        QueueError::Plan(e) => Status::invalid_argument(e.to_string()),
        QueueError::Stopping => Status::unavailable("the server is stopping"),
        QueueError::State(m) => Status::failed_precondition(m),
    }
}

impl Api {
    fn job(&self, id: u64) -> Result<Job, Status> {
        self.0.store().job(id).map_err(status)
    }

    /// Job `id`, if `caller` may see and change it.
    fn job_for(&self, caller: &Caller, id: u64) -> Result<Job, Status> {
        let job = self.job(id)?;
        caller.check(&job)?;
        Ok(job)
    }

    /// Job `id` as an answer (without its workflow).
    fn reply(&self, id: u64) -> Result<Response<pb::Job>, Status> {
        let job = self.job(id)?;
        Ok(Response::new(
            proto_job(&self.0, &job, false).map_err(status)?,
        ))
    }
}

/// A stored metric row on the wire: `stage`, `step`, and the numeric values.
pub fn metric_row(row: u64, v: &serde_json::Value) -> pb::MetricRow {
    let mut out = pb::MetricRow {
        row,
        ..Default::default()
    };
    if let Some(obj) = v.as_object() {
        for (k, v) in obj {
            match (k.as_str(), v) {
                ("stage", v) => out.stage = v.as_str().unwrap_or_default().to_string(),
                ("step", v) => out.step = v.as_u64().unwrap_or(0),
                (k, v) => {
                    if let Some(x) = v.as_f64() {
                        out.values.insert(k.to_string(), x);
                    }
                }
            }
        }
    }
    out
}

/// The `JobService` implementation.
struct Api(Arc<Queue>);

type Watch = ReceiverStream<Result<pb::JobEvent, Status>>;

#[tonic::async_trait]
impl JobService for Api {
    async fn submit_job(
        &self,
        request: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobReply>, Status> {
        let caller = Caller::of(&request);
        let owner = caller.owner()?.map(str::to_string);
        let r = request.into_inner();
        if self.0.is_stopping() {
            return Err(Status::unavailable("the server is stopping"));
        }
        let name = if r.file_name.is_empty() {
            "workflow.yaml".to_string()
        } else {
            r.file_name
        };
        let origin = if r.base_dir.is_empty() {
            PathBuf::from(name)
        } else {
            Path::new(&r.base_dir).join(name)
        };
        // Planning may read datasets and checkpoints' config.json: off the async threads.
        let queue = self.0.clone();
        let id = tokio::task::spawn_blocking(move || {
            queue.submit(
                &r.workflow_yaml,
                &origin.display().to_string(),
                &r.overrides,
                owner.as_deref(),
            )
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(queue_status)?;
        let job = self.job(id)?;
        Ok(Response::new(pb::SubmitJobReply {
            job_id: id,
            job: Some(proto_job(&self.0, &job, true).map_err(status)?),
        }))
    }

    async fn get_job(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        let caller = Caller::of(&request);
        let job = self.job_for(&caller, request.into_inner().job_id)?;
        Ok(Response::new(
            proto_job(&self.0, &job, true).map_err(status)?,
        ))
    }

    async fn list_jobs(
        &self,
        request: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsReply>, Status> {
        let caller = Caller::of(&request);
        caller.owner()?;
        let jobs = self.0.store().jobs().map_err(status)?;
        let jobs = jobs
            .iter()
            .filter(|j| caller.may_use(j.owner.as_deref()))
            .map(|j| proto_job(&self.0, j, false))
            .collect::<Result<_, _>>()
            .map_err(status)?;
        Ok(Response::new(pb::ListJobsReply { jobs }))
    }

    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        let caller = Caller::of(&request);
        let id = request.into_inner().job_id;
        self.job_for(&caller, id)?;
        self.0.cancel(id).map_err(queue_status)?;
        self.reply(id)
    }

    async fn resume_job(
        &self,
        request: Request<pb::ResumeJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        let caller = Caller::of(&request);
        let id = request.into_inner().job_id;
        self.job_for(&caller, id)?;
        self.0.resume(id).map_err(queue_status)?;
        self.reply(id)
    }

    type WatchJobStream = Watch;

    async fn watch_job(
        &self,
        request: Request<pb::WatchJobRequest>,
    ) -> Result<Response<Watch>, Status> {
        let caller = Caller::of(&request);
        let r = request.into_inner();
        self.job_for(&caller, r.job_id)?;
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(watch(self.0.clone(), r, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_metrics(
        &self,
        request: Request<pb::GetMetricsRequest>,
    ) -> Result<Response<pb::GetMetricsReply>, Status> {
        let caller = Caller::of(&request);
        let r = request.into_inner();
        self.job_for(&caller, r.job_id)?;
        let rows = self
            .0
            .store()
            .metrics(r.job_id, r.from_row)
            .map_err(status)?;
        Ok(Response::new(pb::GetMetricsReply {
            rows: rows.iter().map(|(i, v)| metric_row(*i, v)).collect(),
        }))
    }

    async fn get_cluster(
        &self,
        _: Request<pb::GetClusterRequest>,
    ) -> Result<Response<pb::ClusterInfo>, Status> {
        let time_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Ok(Response::new(pb::ClusterInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            time_ms,
            protocol_version: actors::head::PROTOCOL_VERSION,
            agents: self
                .0
                .head()
                .rooms()
                .into_iter()
                .map(cluster_agent)
                .collect(),
        }))
    }
}

fn cluster_agent(room: actors::AgentRoom) -> pb::ClusterAgent {
    let a = room.info;
    pb::ClusterAgent {
        id: a.id,
        name: a.name,
        address: a.address,
        resources: Some(a.resources.into()),
        labels: a.labels.into_iter().collect(),
        kinds: a.kinds,
        free: Some(room.free.into()),
    }
}

/// Sends job `r.job_id`'s events to `tx` until the job ends or the watcher goes away.
async fn watch(
    jobs: Arc<Queue>,
    r: pb::WatchJobRequest,
    tx: mpsc::Sender<Result<pb::JobEvent, Status>>,
) {
    use pb::job_event::Event;
    let (id, mut row, mut line) = (r.job_id, r.from_row, r.from_line);
    let mut changes = jobs.store().subscribe();
    let mut last_sent = None;
    loop {
        changes.borrow_and_update();
        // The state is read first: once it is final, every row and line was written before it.
        let round = (|| {
            let job = jobs.store().job(id)?;
            // A job's last write is its final state, after its last row and line.
            let done = matches!(
                job.state,
                JobState::Succeeded | JobState::Failed | JobState::Cancelled
            );
            let mut events = Vec::new();
            for (i, v) in jobs.store().metrics(id, row)? {
                row = i + 1;
                events.push(Event::Metrics(metric_row(i, &v)));
            }
            for (i, l) in jobs.store().logs(id, line)? {
                line = i + 1;
                events.push(Event::Log(pb::LogLine {
                    line: i,
                    time_ms: l.time_ms,
                    text: l.text,
                }));
            }
            let p = proto_job(&jobs, &job, false)?;
            let key = (
                p.state,
                p.error.clone(),
                p.checkpoint.clone(),
                p.cancel_requested,
            );
            if last_sent.as_ref() != Some(&key) {
                last_sent = Some(key);
                events.push(Event::Job(p));
            }
            Ok::<_, StoreError>((events, done))
        })();
        let (events, done) = match round {
            Ok(x) => x,
            Err(e) => {
                let _ = tx.send(Err(status(e))).await;
                return;
            }
        };
        for e in events {
            if tx.send(Ok(pb::JobEvent { event: Some(e) })).await.is_err() {
                return;
            }
        }
        if done {
            return;
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn metric_rows_keep_stage_step_and_numbers() {
        let v = serde_json::json!({"stage": "rl", "step": 3, "critic/score/mean": 0.5,
            "eval/accuracy": 1, "note": "text"});
        let m = metric_row(7, &v);
        assert_eq!((m.row, m.stage.as_str(), m.step), (7, "rl", 3));
        assert_eq!(m.values.len(), 2, "{m:?}");
        assert_eq!(m.values["eval/accuracy"], 1.0);
    }

    #[test]
    fn only_loopback_listeners_may_skip_the_token() {
        for (addr, required) in [
            ("127.0.0.1:7070", false),
            ("[::1]:7070", false),
            ("0.0.0.0:7070", true),
            ("10.1.2.3:7070", true),
        ] {
            let a: SocketAddr = addr.parse().unwrap();
            assert_eq!(token_required(&a), required, "{addr}");
        }
    }

    #[test]
    fn the_data_dir_token_is_made_once_for_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("trellis-token-dd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = token_at(&dir.join("token")).unwrap();
        let b = token_at(&dir.join("token")).unwrap();
        // The second read is the same token: b's bearer passes a's guard.
        let signed = b.bearer().call(Request::new(())).unwrap();
        assert!(a.guard().call(signed).is_ok());
        let mode = std::fs::metadata(dir.join("token"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
