//! `trellis serve`: the head, serving the job API and agent registration on one port.

use super::{runtime, terminated};
use crate::progress::PlotSink;
use anyhow::Result;
use std::path::PathBuf;

/// `trellis serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on; a non-loopback address requires a token on every call.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: std::net::SocketAddr,
    /// Where the job store, the tokens, the users and the jobs' run directories live.
    #[arg(long, default_value = "trellis-data")]
    data_dir: PathBuf,
    /// Jobs run at once; the others wait in the queue.
    #[arg(long, default_value_t = 1)]
    max_running: usize,
    /// Serve TLS with this PEM certificate chain (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// With TLS, the PEM certificate(s) agents' certificates are checked against (agents serve
    /// TLS with --tls-cert/--tls-key); default: this server's --tls-cert, for agents sharing it.
    #[arg(long, requires = "tls_cert")]
    agent_tls_ca: Option<PathBuf>,
    /// Seconds a job waits for agents that can take its pools.
    #[arg(long, default_value_t = 120.0)]
    agent_wait: f64,
    /// The admin's token for the job API (default DATA_DIR/token); created, mode 0600, when
    /// missing. Users get their own with `trellis user add`.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// The token agents present (default DATA_DIR/agent-token); created, mode 0600, when
    /// missing. It cannot call the job API.
    #[arg(long)]
    agent_token_file: Option<PathBuf>,
    /// Run every job on a thread of the server instead of jobs with local pools in processes
    /// of their own (where a job that aborts or is killed fails alone).
    #[arg(long)]
    jobs_in_server: bool,
}

impl ServeArgs {
    /// Prints where it listens, serves until Ctrl-C or SIGTERM (a second one exits at once).
    pub fn run(self, log: &str, threads: usize) -> Result<()> {
        let opts = crate::server::ServeOptions {
            listen: self.listen,
            data_dir: self.data_dir,
            max_running: self.max_running,
            tls: self.tls_cert.zip(self.tls_key),
            agent_tls_ca: self.agent_tls_ca,
            agent_wait: std::time::Duration::from_secs_f64(self.agent_wait.max(0.0)),
            token_file: self.token_file,
            agent_token_file: self.agent_token_file,
            job_processes: (!self.jobs_in_server).then(|| crate::server::JobProcesses {
                log: log.to_string(),
                threads,
            }),
        };
        let rt = runtime()?;
        let required = crate::server::token_required(&opts.listen);
        let token_path = opts.token_path();
        let agent_token_path = opts.agent_token_path();
        let tls = opts.tls.is_some();
        let scheme = if tls { "https" } else { "http" };
        // Each job's run directory gets its plot when the job finishes.
        let sinks: orchestrator::jobs::queue::SinkMaker = Box::new(|_, dir| {
            vec![Box::new(PlotSink::new(dir.to_path_buf()))
                as Box<dyn orchestrator::record::Recorder>]
        });
        rt.block_on(crate::server::serve(
            opts,
            sinks,
            |address| {
                // One line a script can read, then how to use it.
                println!("listening on {scheme}://{address}");
                eprintln!(
                    "agents: trellis agent --head {scheme}://{address} --token-file {}{}",
                    agent_token_path.display(),
                    if tls {
                        " --tls-ca CA --tls-cert CERT --tls-key KEY (this server reaches agents over TLS)"
                    } else {
                        ""
                    }
                );
                if required {
                    eprintln!(
                        "clients must pass --token-file {} (the admin's) or a user's (`trellis user add NAME`): the listener is not loopback",
                        token_path.display()
                    );
                }
            },
            async {
                terminated().await;
                eprintln!(
                    "stopping: running jobs checkpoint after their current step (Ctrl-C again to exit now)"
                );
                tokio::spawn(async {
                    terminated().await;
                    std::process::exit(130);
                });
            },
        ))?;
        Ok(())
    }
}
