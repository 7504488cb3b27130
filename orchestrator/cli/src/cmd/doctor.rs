//! `trellis doctor`: checks this host before it joins a cluster.

use super::{read_tls_ca, runtime};
use anyhow::{Result, bail};
use std::path::PathBuf;

/// `trellis doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// The head to check (its URL); without it the head is not checked.
    #[arg(long)]
    head: Option<String>,
    /// File holding the head's token.
    #[arg(long, env = "TRELLIS_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// PEM certificate to trust for an https:// head.
    #[arg(long, env = "TRELLIS_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// A PJRT plugin to probe, besides those found where pip installs them (repeatable).
    #[arg(long)]
    pjrt: Vec<PathBuf>,
    /// What the agent will announce (as `trellis agent --resources`), checked against the
    /// devices visible.
    #[arg(long)]
    resources: Option<String>,
    /// One JSON object per check.
    #[arg(long)]
    json: bool,
}

impl DoctorArgs {
    pub fn run(self) -> Result<()> {
        use crate::doctor::Level;
        let a = self;
        let head = match a.head {
            Some(server) => Some(crate::client::ClientOptions {
                server,
                token: a
                    .token_file
                    .as_deref()
                    .map(actors::Token::read)
                    .transpose()?,
                tls_ca: read_tls_ca(a.tls_ca.as_ref())?,
            }),
            None => None,
        };
        let resources = match &a.resources {
            Some(r) => Some(
                actors::Resources::parse(r).map_err(|e| anyhow::anyhow!("--resources {r}: {e}"))?,
            ),
            None => None,
        };
        let opts = crate::doctor::DoctorOptions {
            head,
            pjrt: a.pjrt,
            resources,
        };
        let checks = runtime()?.block_on(crate::doctor::run(&opts));
        for c in &checks {
            if a.json {
                println!("{}", serde_json::to_string(c)?);
                continue;
            }
            let tag = match c.level {
                Level::Ok => "ok",
                Level::Info => "info",
                Level::Warn => "WARN",
                Level::Fail => "FAIL",
            };
            println!("{tag:<5} {:<14} {}", c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("{:<20} fix: {fix}", "");
            }
        }
        let failed = checks.iter().filter(|c| c.level == Level::Fail).count();
        if failed > 0 {
            bail!("{failed} check(s) failed");
        }
        Ok(())
    }
}
