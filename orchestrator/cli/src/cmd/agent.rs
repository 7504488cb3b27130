//! `trellis agent`: hosts actors on this machine for a head.

use super::{read_tls_ca, runtime, terminated};
use anyhow::{Context, Result};
use std::path::PathBuf;

/// `trellis agent`'s arguments.
#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// The head's URL, e.g. http://10.0.0.1:7070.
    #[arg(long)]
    head: String,
    /// File holding the cluster token: a `trellis serve` head's DATA_DIR/agent-token (the head
    /// refuses agents without it).
    #[arg(long, env = "TRELLIS_TOKEN_FILE")]
    token_file: PathBuf,
    /// What this machine offers, e.g. cpu=2,gpu=0,tpu=4,memory=64G.
    #[arg(long, default_value = "cpu=1")]
    resources: String,
    /// Labels placement can select on: k=v (repeat or comma-separate).
    #[arg(long = "labels", value_delimiter = ',')]
    labels: Vec<String>,
    /// Where to serve the agent protocol (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
    /// The URL the head reaches this agent at (default: http://<listen>).
    #[arg(long)]
    advertise: Option<String>,
    /// Agent name (default: <hostname>-<pid>).
    #[arg(long)]
    name: Option<String>,
    /// PEM certificate to trust when the head serves TLS (an https:// --head).
    #[arg(long, env = "TRELLIS_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Serve the agent protocol over TLS with this PEM certificate chain (with --tls-key), as a
    /// head that serves TLS requires; the agent then advertises https://.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl AgentArgs {
    pub fn run(self) -> Result<()> {
        let a = self;
        let token = actors::Token::read(&a.token_file)?;
        let resources = actors::Resources::parse(&a.resources)
            .map_err(|e| anyhow::anyhow!("--resources {}: {e}", a.resources))?;
        let mut labels = std::collections::BTreeMap::new();
        for l in &a.labels {
            let (k, v) = l
                .split_once('=')
                .with_context(|| format!("--labels {l}: not key=value"))?;
            labels.insert(k.trim().to_string(), v.trim().to_string());
        }
        let name = a.name.unwrap_or_else(|| {
            let host = actors::head::host_id();
            let host = host.rsplit('/').next().unwrap_or("agent");
            format!("{host}-{}", std::process::id())
        });
        let options = actors::AgentOptions {
            head: a.head,
            listen: a.listen,
            advertise: a.advertise,
            name,
            resources,
            labels,
            token,
            tls_ca: read_tls_ca(a.tls_ca.as_ref())?,
            tls_identity: match (&a.tls_cert, &a.tls_key) {
                (Some(cert), Some(key)) => Some((
                    std::fs::read(cert)
                        .with_context(|| format!("--tls-cert {}", cert.display()))?,
                    std::fs::read(key).with_context(|| format!("--tls-key {}", key.display()))?,
                )),
                _ => None,
            },
            registry: orchestrator::kinds::registry(),
            wire: actors::Wire::default(),
        };
        let token_file = a.token_file.display().to_string();
        runtime()?
            .block_on(actors::agent::run(options, terminated()))
            .map_err(|e| {
                let hint = matches!(&e, actors::AgentError::Refused { message, .. } if message.contains("token"));
                let e = anyhow::Error::from(e);
                if hint {
                    e.context(format!(
                        "--token-file {token_file}: agents present the head's agents' token (`trellis serve` keeps it in DATA_DIR/agent-token; the admin's and users' tokens only call the job API)"
                    ))
                } else {
                    e
                }
            })?;
        Ok(())
    }
}
