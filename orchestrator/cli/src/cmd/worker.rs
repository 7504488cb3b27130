//! `trellis job-worker` (hidden): one job of a server in a process of its own
//! ([`orchestrator::jobs::worker`]). The server starts it with pipes on stdin and stdout, which
//! carry the job's calls to the server's store and, for a job with pools on agents, to the
//! server's head, whose agents this process borrows; it stops on SIGUSR1 (cancel) or SIGTERM
//! (stop, staying pending), each after the current step with a checkpoint.

use crate::progress::PlotSink;
use actors::{Head, Lender};
use anyhow::{Context, Result};
use orchestrator::jobs::run::{self, RunOptions};
use orchestrator::jobs::worker::Remote;
use orchestrator::jobs::{StopReason, request_stop};
use orchestrator::plan::Placement;
use orchestrator::pools::{Cluster, ClusterHead};
use orchestrator::store::{JobState, JobStore};
use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// `trellis job-worker`'s arguments (given by the server).
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// The job's id in the server's store.
    #[arg(long)]
    job: u64,
    /// The job's run directory.
    #[arg(long)]
    run_dir: PathBuf,
    /// The server's store file (for messages).
    #[arg(long)]
    store: PathBuf,
    /// Seconds to wait for agents with room (the server's `--agent-wait`).
    #[arg(long, default_value_t = 0.0)]
    agent_wait: f64,
}

impl WorkerArgs {
    pub fn run(self) -> Result<()> {
        let (from, to) = take_stdio()?;
        stop_on_server_signals();
        let id = self.job;
        let remote = Arc::new(Remote::new(self.store, std::io::BufReader::new(from), to));
        let job = remote.job(id)?;
        let plan = match run::replan(&*remote, &job) {
            Ok(plan) => plan,
            Err(e) => {
                let why = e.to_string();
                remote.append_log(id, &format!("job {id} failed: {why}"))?;
                remote.set_state(id, JobState::Failed, Some(why))?;
                return Ok(());
            }
        };
        // Pools on agents: the server's agents, borrowed by a head in this process (its tasks on
        // a runtime of their own that lives as long as the job).
        let on_agents = plan.rollout.placement != Placement::Local
            || plan.learner.placement != Placement::Local;
        let borrowed = if on_agents {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("job-head")
                .enable_all()
                .build()
                .context("cannot start the head's runtime")?;
            let loan = remote.loan()?;
            let lender: Arc<dyn Lender> = remote.clone();
            let head = rt
                .block_on(Head::borrow(&loan, lender))
                .map_err(|e| anyhow::anyhow!("cannot borrow the server's agents: {e}"))?;
            Some((rt, head))
        } else {
            None
        };
        let opts = RunOptions {
            cluster: borrowed.as_ref().map(|(_, head)| Cluster {
                head: ClusterHead::Shared(head.clone()),
                wait: Duration::from_secs_f64(self.agent_wait.max(0.0)),
            }),
            stop: None,
            log_to_store: true,
            resume_hint: Some(format!("trellis resume {id}")),
            sinks: vec![Box::new(PlotSink::new(self.run_dir.clone()))],
        };
        // The lifecycle records the ending in the server's store; nothing more to say here.
        let _ = run::execute(&plan, &self.run_dir, &*remote, id, None, opts);
        if let Some((rt, head)) = borrowed {
            rt.block_on(head.shutdown(false));
        }
        Ok(())
    }
}

/// Takes the pipes the server gave on stdin and stdout for the protocol, then points stdin at
/// `/dev/null` and stdout at stderr, so nothing the job starts (reward workers, programs) can
/// read or write the protocol.
fn take_stdio() -> Result<(File, File)> {
    // SAFETY: plain descriptor calls on this process's own descriptors; the two new ones are
    // owned by the returned files alone.
    unsafe {
        let from = libc::fcntl(0, libc::F_DUPFD_CLOEXEC, 3);
        let to = libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3);
        if from < 0 || to < 0 {
            return Err(std::io::Error::last_os_error()).context("cannot take the server's pipes");
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null < 0 || libc::dup2(null, 0) < 0 || libc::dup2(2, 1) < 0 {
            return Err(std::io::Error::last_os_error()).context("cannot move stdin and stdout");
        }
        libc::close(null);
        Ok((File::from_raw_fd(from), File::from_raw_fd(to)))
    }
}

/// SIGUSR1 cancels the job, SIGTERM stops it to continue later (the server's two requests);
/// SIGINT is the server's to handle (it asks its jobs to stop), not this process's.
fn stop_on_server_signals() {
    extern "C" fn on_signal(sig: libc::c_int) {
        request_stop(if sig == libc::SIGUSR1 {
            StopReason::Cancel
        } else {
            StopReason::Preempt
        });
    }
    // SAFETY: the handler only touches an atomic.
    unsafe {
        for sig in [libc::SIGUSR1, libc::SIGTERM] {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
}
