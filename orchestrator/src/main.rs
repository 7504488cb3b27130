//! `trellis`: the command-line entry point. Subcommands are thin: they parse arguments and call
//! into the library crates; errors are reported with `anyhow` context chains.

use clap::Parser;

/// Trellis: an RL post-training orchestrator for language models.
#[derive(Debug, Parser)]
#[command(name = "trellis", version)]
struct Cli {
    /// Log filter in `tracing` syntax (also read from TRELLIS_LOG).
    #[arg(long, global = true, env = "TRELLIS_LOG", default_value = "info")]
    log: String,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log)?)
        .with_writer(std::io::stderr)
        .init();
    Ok(())
}
