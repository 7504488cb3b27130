//! `trellis config show`: a workflow as it resolves (defaults filled in, overrides applied,
//! paths absolute, steps counted), or its RL stages' step graphs.

use anyhow::Result;
use orchestrator::plan::Work;
use std::path::PathBuf;

#[derive(Debug, clap::Subcommand)]
pub enum ConfigCommand {
    /// Print the resolved workflow (defaults filled in, overrides applied).
    Show {
        /// The recipe or workflow file.
        file: PathBuf,
        /// Overrides, as for `train`.
        #[arg(short = 'o', long = "override")]
        overrides: Vec<String>,
        /// Print each RL stage's step graph (its nodes by level; nodes of one level run
        /// concurrently) instead of the workflow.
        #[arg(long)]
        graph: bool,
    },
}

impl ConfigCommand {
    pub fn run(self) -> Result<()> {
        let ConfigCommand::Show {
            file,
            overrides,
            graph,
        } = self;
        let plan = orchestrator::plan::load(&file, &overrides)?;
        if !graph {
            println!("{}", serde_json::to_string_pretty(&plan.spec)?);
            return Ok(());
        }
        for stage in &plan.stages {
            let Work::Rl(rl) = &stage.work else { continue };
            println!("stage {}:", stage.id);
            for (i, level) in rl.graph.describe().iter().enumerate() {
                println!("  {i}: {}", level.join(", "));
            }
        }
        Ok(())
    }
}
