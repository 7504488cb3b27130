//! The job API's commands: `trellis submit`, `jobs`, `logs`, `cancel` and `agents`, and how a
//! server's job prints (also for `status` and `resume` of a job id).

use super::{Client, ServerArgs, TokenArg, call_error};
use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// `trellis submit`.
#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    /// The recipe or workflow file.
    file: PathBuf,
    /// Override a field, as for `train`.
    #[arg(short = 'o', long = "override")]
    overrides: Vec<String>,
    /// Follow the job's log until it ends (as `trellis logs -f`).
    #[arg(short = 'f', long)]
    follow: bool,
    #[command(flatten)]
    server: ServerArgs,
    #[command(flatten)]
    token: TokenArg,
}

impl SubmitArgs {
    pub fn run(self) -> Result<()> {
        let Self {
            file,
            overrides,
            follow,
            server,
            token,
        } = self;
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        let abs = std::path::absolute(&file)
            .with_context(|| format!("cannot resolve {}", file.display()))?;
        let request = proto::v1::SubmitJobRequest {
            workflow_yaml: text,
            overrides,
            file_name: file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            base_dir: abs
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        };
        let (rt, mut c) = server.client(token.token_file.as_ref())?;
        let reply = rt
            .block_on(c.submit_job(request))
            .map_err(call_error)?
            .into_inner();
        let name = reply.job.map(|j| j.name).unwrap_or_default();
        eprintln!(
            "submitted `{name}` as job {id}: follow it with `trellis logs -f {id}`",
            id = reply.job_id
        );
        println!("{}", reply.job_id);
        if follow {
            return rt.block_on(logs(&mut c, reply.job_id, true, false));
        }
        Ok(())
    }
}

/// `trellis jobs`.
#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    server: ServerArgs,
    #[command(flatten)]
    token: TokenArg,
}

impl JobsArgs {
    pub fn run(self) -> Result<()> {
        let Self {
            json,
            server,
            token,
        } = self;
        let (rt, mut c) = server.client(token.token_file.as_ref())?;
        let jobs = rt
            .block_on(c.list_jobs(proto::v1::ListJobsRequest {}))
            .map_err(call_error)?
            .into_inner()
            .jobs;
        if json {
            for j in &jobs {
                println!("{}", job_json(j));
            }
            return Ok(());
        }
        println!(
            "{:>5}  {:<10}  {:<12}  {:<24}  {:<10}  {:>6}  error",
            "id", "state", "owner", "name", "stage", "step"
        );
        for j in &jobs {
            println!(
                "{:>5}  {:<10}  {:<12}  {:<24}  {:<10}  {:>6}  {}",
                j.id,
                state_name(j.state),
                if j.owner.is_empty() {
                    "admin"
                } else {
                    &j.owner
                },
                j.name,
                j.stage,
                j.step,
                j.error.lines().next().unwrap_or("")
            );
        }
        Ok(())
    }
}

/// `trellis logs`.
#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    /// The job id.
    job: u64,
    /// Follow until the job ends.
    #[arg(short = 'f', long)]
    follow: bool,
    /// Also print each step's metric row (JSON).
    #[arg(long)]
    metrics: bool,
    #[command(flatten)]
    server: ServerArgs,
    #[command(flatten)]
    token: TokenArg,
}

impl LogsArgs {
    pub fn run(self) -> Result<()> {
        let (rt, mut c) = self.server.client(self.token.token_file.as_ref())?;
        rt.block_on(logs(&mut c, self.job, self.follow, self.metrics))
    }
}

/// `trellis cancel`.
#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    /// The job id.
    job: u64,
    #[command(flatten)]
    server: ServerArgs,
    #[command(flatten)]
    token: TokenArg,
}

impl CancelArgs {
    pub fn run(self) -> Result<()> {
        let Self { job, server, token } = self;
        let (rt, mut c) = server.client(token.token_file.as_ref())?;
        let j = rt
            .block_on(c.cancel_job(proto::v1::CancelJobRequest { job_id: job }))
            .map_err(call_error)?
            .into_inner();
        match state_name(j.state) {
            "running" => println!(
                "job {job} stops after its current step (checkpointed); `trellis resume {job}` continues it"
            ),
            s => println!("job {job} {s}"),
        }
        Ok(())
    }
}

/// `trellis agents`.
#[derive(Debug, clap::Args)]
pub struct AgentsArgs {
    /// Print only how many there are.
    #[arg(long)]
    count: bool,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    server: ServerArgs,
    #[command(flatten)]
    token: TokenArg,
}

impl AgentsArgs {
    pub fn run(self) -> Result<()> {
        let Self {
            count,
            json,
            server,
            token,
        } = self;
        let (rt, mut c) = server.client(token.token_file.as_ref())?;
        let info = rt
            .block_on(c.get_cluster(proto::v1::GetClusterRequest {}))
            .map_err(call_error)?
            .into_inner();
        if count {
            println!("{}", info.agents.len());
            return Ok(());
        }
        for a in &info.agents {
            let r = a.resources.unwrap_or_default();
            let free = a.free.unwrap_or_default();
            let mut labels: Vec<String> =
                a.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            labels.sort();
            if json {
                let v = serde_json::json!({"id": a.id, "name": a.name, "address": a.address,
                    "cpu": r.cpu, "gpu": r.gpu, "tpu": r.tpu, "memory_bytes": r.memory_bytes,
                    "labels": a.labels, "kinds": a.kinds,
                    "free": {"cpu": free.cpu, "gpu": free.gpu, "tpu": free.tpu}});
                println!("{v}");
            } else {
                println!(
                    "{:<20} {:<28} cpu={} gpu={} tpu={} (free: cpu={} gpu={} tpu={})  {}",
                    a.name,
                    a.address,
                    r.cpu,
                    r.gpu,
                    r.tpu,
                    free.cpu,
                    free.gpu,
                    free.tpu,
                    labels.join(",")
                );
            }
        }
        Ok(())
    }
}

fn state_name(state: i32) -> &'static str {
    use proto::v1::JobState;
    match JobState::try_from(state).unwrap_or(JobState::Unspecified) {
        JobState::Unspecified => "unknown",
        JobState::Pending => "pending",
        JobState::Running => "running",
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
    }
}

fn job_json(j: &proto::v1::Job) -> serde_json::Value {
    let workflow: serde_json::Value =
        serde_json::from_str(&j.workflow_json).unwrap_or(serde_json::Value::Null);
    serde_json::json!({
        "id": j.id, "name": j.name, "state": state_name(j.state), "error": j.error,
        "created_ms": j.created_ms, "updated_ms": j.updated_ms,
        "stages_completed": j.stages_completed, "stage": j.stage, "step": j.step,
        "checkpoint": j.checkpoint, "checkpoint_stage": j.checkpoint_stage,
        "checkpoint_step": j.checkpoint_step, "weight_version": j.weight_version,
        "run_dir": j.run_dir, "cancel_requested": j.cancel_requested, "workflow": workflow,
        "owner": (!j.owner.is_empty()).then_some(&j.owner),
    })
}

pub fn print_job(j: &proto::v1::Job, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(&job_json(j))?);
        return Ok(());
    }
    println!("job {} `{}`: {}", j.id, j.name, state_name(j.state));
    if !j.owner.is_empty() {
        println!("  owner: {}", j.owner);
    }
    if !j.error.is_empty() {
        println!("  error: {}", j.error);
    }
    if j.cancel_requested {
        println!("  cancel requested: stopping after the current step");
    }
    println!("  stages completed: {}", j.stages_completed.join(", "));
    if !j.stage.is_empty() {
        println!("  latest step: stage {} step {}", j.stage, j.step);
    }
    if !j.checkpoint.is_empty() {
        println!(
            "  last checkpoint: {} (stage {} step {}, weight version {})",
            j.checkpoint, j.checkpoint_stage, j.checkpoint_step, j.weight_version
        );
    }
    println!("  run directory (on the server): {}", j.run_dir);
    Ok(())
}

/// Prints job `id`'s log (and metric rows); with `follow`, until the job ends, failing unless
/// it succeeded.
async fn logs(c: &mut Client, id: u64, follow: bool, metrics: bool) -> Result<()> {
    use proto::v1::job_event::Event;
    if !follow {
        let mut stream = c
            .watch_job(proto::v1::WatchJobRequest {
                job_id: id,
                ..Default::default()
            })
            .await
            .map_err(call_error)?
            .into_inner();
        // Everything recorded so far arrives before the first wait: read until the first job
        // event after the backlog.
        while let Some(ev) = stream.message().await.map_err(call_error)? {
            match ev.event {
                Some(Event::Log(l)) => println!("{}", l.text),
                Some(Event::Metrics(m)) if metrics => println!("{}", metric_json(&m)),
                Some(Event::Job(_)) => return Ok(()),
                _ => {}
            }
        }
        return Ok(());
    }
    let (mut from_row, mut from_line) = (0, 0);
    loop {
        let stream = c
            .watch_job(proto::v1::WatchJobRequest {
                job_id: id,
                from_row,
                from_line,
            })
            .await;
        let mut stream = match stream {
            Ok(s) => s.into_inner(),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                eprintln!("the server is unreachable ({}); retrying", s.message());
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue;
            }
            Err(s) => return Err(call_error(s)),
        };
        let mut last = None;
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(Event::Log(l)) => {
                        from_line = l.line + 1;
                        println!("{}", l.text);
                    }
                    Some(Event::Metrics(m)) => {
                        from_row = m.row + 1;
                        if metrics {
                            println!("{}", metric_json(&m));
                        }
                    }
                    Some(Event::Job(j)) => last = Some(j),
                    None => {}
                },
                Ok(None) => break,
                Err(s) => {
                    // The server went away mid-watch (restarted?): watch again from here.
                    eprintln!("the watch broke ({}); reconnecting", s.message());
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    break;
                }
            }
        }
        let Some(j) =
            last.filter(|j| matches!(state_name(j.state), "succeeded" | "failed" | "cancelled"))
        else {
            continue;
        };
        return match state_name(j.state) {
            "succeeded" => Ok(()),
            s => bail!("job {id} {s}: {}", j.error),
        };
    }
}

fn metric_json(m: &proto::v1::MetricRow) -> serde_json::Value {
    let mut obj = serde_json::Map::new();
    obj.insert("stage".into(), m.stage.clone().into());
    obj.insert("step".into(), m.step.into());
    let mut keys: Vec<&String> = m.values.keys().collect();
    keys.sort();
    for k in keys {
        obj.insert(k.clone(), m.values[k].into());
    }
    serde_json::Value::Object(obj)
}
