//! The subcommands, one file each, and what they share: the async runtime, where the server is
//! and how to reach it, where a run meets agents, signals, and exit statuses.

pub mod agent;
pub mod bench;
pub mod config;
pub mod doctor;
pub mod engine;
pub mod jobs;
pub mod model;
pub mod serve;
pub mod train;
pub mod user;
pub mod worker;

use anyhow::{Context, Result};
use orchestrator::jobs::{JobError, StopReason};
use std::path::PathBuf;

/// Logs to stderr (above any progress bars) at `filter` (`tracing` syntax), and to the run's
/// `train.log` once a run opens it.
pub fn init_logging(filter: &str) -> Result<()> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::try_new(filter)?)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(crate::progress::Stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(crate::logfile::Writer)
                .with_ansi(false),
        )
        .init();
    Ok(())
}

/// A multi-threaded tokio runtime.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The exit status of an error: 2 for bad input, 130 for a job stopped by the user, 75 for one
/// stopped because its process was asked to (resumable both), 1 otherwise.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<orchestrator::plan::PlanError>().is_some()
        || e.downcast_ref::<clap::Error>().is_some()
    {
        return 2;
    }
    match e.downcast_ref::<JobError>() {
        Some(JobError::Plan(_)) => 2,
        Some(j) if j.is_stop() => match orchestrator::jobs::stop_requested() {
            Some(StopReason::Preempt) => 75,
            _ => 130,
        },
        _ => 1,
    }
}

/// Ctrl-C or SIGTERM during `train`/`resume`: the first asks the job to stop after its current
/// step (with a checkpoint): Ctrl-C as a cancel, SIGTERM as a preemption. A second stops at
/// once.
pub fn stop_on_signals() {
    extern "C" fn on_signal(sig: libc::c_int) {
        if orchestrator::jobs::stop_requested().is_some() {
            // SAFETY: `_exit` is async-signal-safe.
            unsafe { libc::_exit(130) };
        }
        orchestrator::jobs::request_stop(if sig == libc::SIGTERM {
            StopReason::Preempt
        } else {
            StopReason::Cancel
        });
    }
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only touches an atomic and calls `_exit`.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// Training allocates and frees hundreds of MB of activations every step. By default glibc hands
/// freed memory back to the OS, so each step pays page faults, zeroing and TLB shootdowns on
/// fresh pages (measured with `perf`: about a fifth of a training step). Keep it in the heap.
///
/// The trim threshold keeps the main arena's memory. The kernel pool's threads allocate from
/// their own arenas, whose 64 MiB heaps glibc (2.36) unmaps whenever one falls empty unless the
/// top pad exceeds what the heap would free: without `M_TOP_PAD` an RL step of
/// `recipes/grpo-arith.yaml` mapped about 25 heaps afresh and took 3,850 page faults, with it
/// none (`perf stat -e page-faults` over 4 and 12 steps). The pad is address space, not memory:
/// pages count once touched.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune_allocator() {
    // SAFETY: mallopt only adjusts allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 256 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune_allocator() {}

/// Where a run meets `trellis agent`s, for pools placed on them (`placement: pack | spread`).
#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// Listen for agents on this address (port 0: any free port; the address is printed).
    #[arg(long)]
    pub listen: Option<std::net::SocketAddr>,
    /// With --listen: the cluster token agents must present (created, mode 0600, when the file
    /// is missing). For `trellis resume JOB`: the server's token (its DATA_DIR/token).
    #[arg(long, env = "TRELLIS_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Seconds to wait for agents that can take the pool.
    #[arg(long, default_value_t = 120.0)]
    pub agent_wait: f64,
}

impl ClusterArgs {
    /// Where the run meets agents, if it listens for them.
    pub fn cluster(&self) -> Result<Option<orchestrator::pools::Cluster>> {
        let Some(listen) = self.listen else {
            return Ok(None);
        };
        let path = self.token_file.as_ref().ok_or_else(|| {
            anyhow::anyhow!("--listen needs --token-file FILE (the cluster token agents present)")
        })?;
        let token = if path.exists() {
            actors::Token::read(path)?
        } else {
            let t = actors::Token::generate()?;
            t.write(path)?;
            eprintln!("wrote a new cluster token to {}", path.display());
            t
        };
        Ok(Some(orchestrator::pools::Cluster {
            head: orchestrator::pools::ClusterHead::Listen { listen, token },
            wait: std::time::Duration::from_secs_f64(self.agent_wait.max(0.0)),
        }))
    }
}

/// Where the job API is.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// The server's URL (https:// for a server with TLS).
    #[arg(long, env = "TRELLIS_SERVER", default_value = "http://127.0.0.1:7070")]
    pub server: String,
    /// PEM certificate to trust for https:// (a self-signed server's own certificate).
    #[arg(long, env = "TRELLIS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

/// The server's token.
#[derive(Debug, clap::Args)]
pub struct TokenArg {
    /// File holding the server's token (its DATA_DIR/token); needed unless it listens on loopback.
    #[arg(long, env = "TRELLIS_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

/// A connected job API client.
pub type Client = crate::client::Client;

impl ServerArgs {
    /// A runtime and a client connected to the server.
    pub fn client(
        &self,
        token_file: Option<&PathBuf>,
    ) -> Result<(tokio::runtime::Runtime, Client)> {
        let token = token_file.map(|p| actors::Token::read(p)).transpose()?;
        let tls_ca = read_tls_ca(self.tls_ca.as_ref())?;
        let opts = crate::client::ClientOptions {
            server: self.server.clone(),
            token,
            tls_ca,
        };
        let rt = runtime()?;
        let client = rt.block_on(crate::client::connect(&opts))?;
        Ok((rt, client))
    }
}

/// The PEM certificate(s) of `--tls-ca`, when given.
pub fn read_tls_ca(path: Option<&PathBuf>) -> Result<Option<Vec<u8>>> {
    path.map(|p| std::fs::read(p).with_context(|| format!("--tls-ca {}", p.display())))
        .transpose()
}

/// A failed call, with the server's message (the status code only when the message is empty),
/// and the transport's causes when the call never reached the server.
pub fn call_error(s: tonic::Status) -> anyhow::Error {
    let mut msg = if s.message().is_empty() {
        format!("the server answered {:?}", s.code())
    } else {
        s.message().to_string()
    };
    let mut source = std::error::Error::source(&s);
    let transport = source.is_some();
    while let Some(e) = source {
        let text = e.to_string();
        if !msg.contains(&text) {
            msg = format!("{msg}: {text}");
        }
        source = e.source();
    }
    if transport {
        msg.push_str(" (is the URL's scheme, http:// or https://, the one the server serves?)");
    }
    anyhow::anyhow!("{msg}")
}

/// A server's job id, or why `target` is neither a run directory nor one.
pub fn job_id(target: &str) -> Result<u64> {
    target.parse().map_err(|_| {
        anyhow::anyhow!("`{target}` is neither a run directory nor a job id of the server")
    })
}
