//! `trellis`: the command line. Each subcommand is a type in [`cmd`] that parses its arguments
//! and calls into the library crates; this file parses, sets up logging and threads, and
//! dispatches. Errors are reported with their causes, and the exit status says how a job ended:
//! 0 succeeded, 1 failed, 2 bad input (the workflow or the arguments), 130 stopped by the user
//! (Ctrl-C: resumable), 75 stopped because the process was asked to (SIGTERM, a preemption:
//! resumable).

// The binary is what prints: its subcommands' output and messages.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod access;
mod client;
mod cmd;
mod doctor;
mod engine_bench;
mod logfile;
mod plot;
mod progress;
mod server;

use clap::{Parser, Subcommand};

/// Trellis: an RL post-training orchestrator for language models.
#[derive(Debug, Parser)]
#[command(
    name = "trellis",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TRELLIS_GIT_COMMIT"), ")"),
    arg_required_else_help = true
)]
struct Cli {
    /// Log filter in `tracing` syntax (also read from TRELLIS_LOG).
    #[arg(long, global = true, env = "TRELLIS_LOG", default_value = "info")]
    log: String,
    /// Kernel threads (0 = all cores).
    #[arg(long, global = true, default_value_t = 0)]
    threads: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a recipe (workflow YAML) in this process.
    Train(cmd::train::TrainArgs),
    /// Continue a run from its last checkpoint: the run in a directory (in this process), or a
    /// failed or cancelled job of a server (queued there again).
    Resume(cmd::train::ResumeArgs),
    /// The state of a run (from the store of its directory) or of a server's job.
    Status(cmd::train::StatusArgs),
    /// Draw RUN_DIR/metrics.jsonl into RUN_DIR/plot.png (train does this at the end).
    Plot(cmd::train::PlotArgs),
    /// Serve the job API and agent registration on one port (the head): submitted workflows
    /// queue and run on the registered agents' pools.
    Serve(cmd::serve::ServeArgs),
    /// Submit a workflow to a server; prints the job id.
    Submit(cmd::jobs::SubmitArgs),
    /// List a server's jobs.
    Jobs(cmd::jobs::JobsArgs),
    /// Print a server job's log; with -f, follow it until the job ends (exit status 1 unless it
    /// succeeded).
    Logs(cmd::jobs::LogsArgs),
    /// Cancel a server's job: a running one stops after its current step, with a checkpoint.
    Cancel(cmd::jobs::CancelArgs),
    /// List the agents registered with a server.
    Agents(cmd::jobs::AgentsArgs),
    /// A server's users: each has a token of their own and sees and changes only their own
    /// jobs.
    User {
        #[command(subcommand)]
        what: cmd::user::UserCommand,
    },
    /// Run a node agent: host actors on this machine for the head at --head.
    Agent(cmd::agent::AgentArgs),
    /// Check this host before it joins a cluster: cores, memory, CPU features, /dev/shm, open
    /// files, PJRT plugins, TPU/GPU devices, and the head (reachable, version, clock skew).
    /// Exit status 1 when a check fails.
    Doctor(cmd::doctor::DoctorArgs),
    /// Workflow files.
    Config {
        #[command(subcommand)]
        what: cmd::config::ConfigCommand,
    },
    /// Per-token log-probs and total NLL of a text under a checkpoint.
    Score(cmd::model::ScoreArgs),
    /// Sample continuations of a prompt from a checkpoint with the native engine.
    Generate(cmd::model::GenerateArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: cmd::bench::BenchCommand,
    },
    /// Inference engines as servers.
    Engine {
        #[command(subcommand)]
        what: cmd::engine::EngineCommand,
    },
    /// One job of a server, in a process of its own (started by `trellis serve`).
    #[command(hide = true)]
    JobWorker(cmd::worker::WorkerArgs),
    /// Print a shell's completions for `trellis` (e.g. `trellis completions bash >
    /// ~/.local/share/bash-completion/completions/trellis`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The chain, skipping causes that their parent's message already quotes.
            let mut msg = e.to_string();
            for cause in e.chain().skip(1) {
                let c = cause.to_string();
                if !msg.contains(&c) {
                    msg = format!("{msg}: {c}");
                }
            }
            eprintln!("error: {msg}");
            std::process::ExitCode::from(cmd::exit_code(&e))
        }
    }
}

fn run() -> anyhow::Result<()> {
    cmd::tune_allocator();
    let cli = Cli::parse();
    cmd::init_logging(&cli.log)?;
    kernels::threads::init(cli.threads);
    match cli.command {
        Command::Train(a) => a.run(),
        Command::Resume(a) => a.run(),
        Command::Status(a) => a.run(),
        Command::Plot(a) => a.run(),
        Command::Serve(a) => a.run(&cli.log, cli.threads),
        Command::Submit(a) => a.run(),
        Command::Jobs(a) => a.run(),
        Command::Logs(a) => a.run(),
        Command::Cancel(a) => a.run(),
        Command::Agents(a) => a.run(),
        Command::Agent(a) => a.run(),
        Command::User { what } => what.run(),
        Command::JobWorker(a) => a.run(),
        Command::Doctor(a) => a.run(),
        Command::Config { what } => what.run(),
        Command::Score(a) => a.run(),
        Command::Generate(a) => a.run(),
        Command::Bench { what } => what.run(),
        Command::Engine { what } => what.run(),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "trellis",
                &mut std::io::stdout(),
            );
            Ok(())
        }
    }
}
