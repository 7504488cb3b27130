//! `trellis train`, `resume`, `status` and `plot`: jobs in this process, and their run
//! directories (`resume` and `status` also take a server's job id).

use super::{ClusterArgs, ServerArgs, TokenArg, call_error, job_id, stop_on_signals};
use crate::progress::{PlotSink, Progress};
use anyhow::{Context, Result};
use orchestrator::exec::Summary;
use orchestrator::jobs::RunOptions;
use std::path::{Path, PathBuf};

/// `trellis train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// The recipe or workflow file.
    recipe: PathBuf,
    /// Override a field: `-o stages.rl.trainer.steps=50` (value in YAML syntax).
    #[arg(short = 'o', long = "override")]
    overrides: Vec<String>,
    /// Run directory (default: runs/<name>).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// The sinks the command line adds to a run's record.
fn options(quiet: bool, dir: &Path, cluster: &ClusterArgs) -> Result<RunOptions> {
    Ok(RunOptions {
        cluster: cluster.cluster()?,
        sinks: vec![
            Box::new(Progress::new(quiet)),
            Box::new(PlotSink::new(dir.to_path_buf())),
        ],
        ..Default::default()
    })
}

impl TrainArgs {
    pub fn run(self) -> Result<()> {
        let plan = orchestrator::plan::load(&self.recipe, &self.overrides)?;
        let dir = self
            .run_dir
            .unwrap_or_else(|| PathBuf::from("runs").join(&plan.name));
        stop_on_signals();
        let opts = options(self.quiet, &dir, &self.cluster)?;
        // Devices and the run directory are checked before anything is made.
        let backend = orchestrator::jobs::run::prepare(&plan, &dir)?;
        crate::logfile::open(&dir)
            .with_context(|| format!("{}: cannot write train.log", dir.display()))?;
        let summary = orchestrator::jobs::run::start(&plan, &dir, backend, opts)?;
        print_summary(&dir, &summary);
        Ok(())
    }
}

/// `trellis resume`.
#[derive(Debug, clap::Args)]
pub struct ResumeArgs {
    /// A run directory, or a job id of the server.
    target: String,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    server: ServerArgs,
}

impl ResumeArgs {
    pub fn run(self) -> Result<()> {
        let run_dir = PathBuf::from(&self.target);
        if !run_dir.is_dir() {
            let job = job_id(&self.target)?;
            let (rt, mut c) = self.server.client(self.cluster.token_file.as_ref())?;
            let j = rt
                .block_on(c.resume_job(proto::v1::ResumeJobRequest { job_id: job }))
                .map_err(call_error)?
                .into_inner();
            println!(
                "job {} `{}` queued again: it continues from {}",
                j.id,
                j.name,
                if j.checkpoint.is_empty() {
                    "the start".to_string()
                } else {
                    format!("{} step {}", j.checkpoint_stage, j.checkpoint_step)
                }
            );
            return Ok(());
        }
        stop_on_signals();
        let opts = options(self.quiet, &run_dir, &self.cluster)?;
        crate::logfile::open(&run_dir)
            .with_context(|| format!("{}: cannot write train.log", run_dir.display()))?;
        let summary = orchestrator::jobs::run::resume(&run_dir, opts)?;
        print_summary(&run_dir, &summary);
        Ok(())
    }
}

/// `trellis status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// A run directory, or a job id of the server.
    target: String,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    server: ServerArgs,
    #[command(flatten)]
    token: TokenArg,
}

impl StatusArgs {
    pub fn run(self) -> Result<()> {
        let run_dir = PathBuf::from(&self.target);
        if !run_dir.is_dir() {
            let job = job_id(&self.target)?;
            let (rt, mut c) = self.server.client(self.token.token_file.as_ref())?;
            let j = rt
                .block_on(c.get_job(proto::v1::GetJobRequest { job_id: job }))
                .map_err(call_error)?
                .into_inner();
            return super::jobs::print_job(&j, self.json);
        }
        let st = orchestrator::jobs::status(&run_dir)?;
        if self.json {
            println!("{}", serde_json::to_string(&st)?);
            return Ok(());
        }
        let j = &st.job;
        println!("job {} `{}`: {}", j.id, j.name, j.state.name());
        if st.live {
            println!("  (the run is going: read from its status.json while it holds the store)");
        }
        if let Some(e) = &j.error {
            println!("  error: {e}");
        }
        println!("  stages completed: {}", j.progress.completed.join(", "));
        if let Some(stage) = &j.progress.stage {
            println!("  last checkpoint: stage {stage} step {}", j.progress.step);
        }
        for c in &st.checkpoints {
            println!(
                "  checkpoint {} (weight version {})",
                c.path, c.weight_version
            );
        }
        println!("  metric rows: {}", st.metric_rows);
        Ok(())
    }
}

/// `trellis plot`.
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The run directory.
    run_dir: PathBuf,
}

impl PlotArgs {
    pub fn run(self) -> Result<()> {
        let out = self.run_dir.join("plot.png");
        crate::plot::plot(&self.run_dir, &out).map_err(anyhow::Error::msg)?;
        println!("{}", out.display());
        Ok(())
    }
}

fn print_summary(dir: &Path, s: &Summary) {
    if s.finished_before {
        println!(
            "the run in {} had already finished: nothing to do",
            dir.display()
        );
    }
    for (stage, acc) in &s.eval_accuracy {
        println!("{stage}: eval accuracy {acc:.3}");
    }
    println!(
        "run directory: {} ({} steps run)",
        dir.display(),
        s.steps_run
    );
}
