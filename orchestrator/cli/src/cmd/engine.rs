//! `trellis engine serve`: a checkpoint (or the model a recipe starts from) on the native engine
//! behind vLLM's and SGLang's HTTP routes.

use super::{runtime, terminated};
use anyhow::Result;
use engine_serve::{EngineServeOptions, ModelSource};
use std::path::PathBuf;

#[derive(Debug, clap::Subcommand)]
pub enum EngineCommand {
    /// Serve a checkpoint on the native engine behind the OpenAI API as vLLM serves it (and
    /// SGLang's routes): completions and chat completions (streamed with `stream: true`),
    /// token-in/token-out generation, weight reload, versions, pause/resume, health, Prometheus
    /// metrics. Rollout pools reach it with `engine: served`.
    Serve {
        /// Checkpoint folder (config.json, model.safetensors, tokenizer.json).
        #[arg(long, required_unless_present = "recipe", conflicts_with = "recipe")]
        model: Option<PathBuf>,
        /// Serve the model a workflow starts from (its model.path, or model.init with seeded
        /// weights), for a run of it to push its weights into (`engine: served`).
        #[arg(long)]
        recipe: Option<PathBuf>,
        /// Address to listen on (port 0: any free port; the address is printed).
        #[arg(long, default_value = "127.0.0.1:8000")]
        listen: std::net::SocketAddr,
        /// The model id clients name (default: --model as given).
        #[arg(long)]
        served_model_name: Option<String>,
        /// KV-cache budget in MiB.
        #[arg(long, default_value_t = 512)]
        kv_cache_mib: usize,
        /// Answer /inference/v1/generate with 403, as vLLM 0.32 started without
        /// --enable-scale-out (clients fall back to /v1/completions with token ids).
        #[arg(long)]
        completions_only: bool,
        /// Log-probs reported for sampled tokens: of the distribution sampled from
        /// (`processed_logprobs`, what the learner recomputes) or `log_softmax(logits)`
        /// (`raw_logprobs`, vLLM's default).
        #[arg(long, value_enum, default_value_t = LogprobsMode::ProcessedLogprobs)]
        logprobs_mode: LogprobsMode,
        /// Require `Authorization: Bearer KEY` on every route but /health, /version and
        /// /metrics (401 otherwise), as vLLM's --api-key. Also read from TRELLIS_API_KEY.
        #[arg(long, env = "TRELLIS_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// A Jinja chat template for /v1/chat/completions, instead of the checkpoint's
        /// tokenizer_config.json chat_template (as vLLM's --chat-template).
        #[arg(long)]
        chat_template: Option<PathBuf>,
        /// Serve HTTPS with this PEM certificate chain (needs --ssl-keyfile), as vLLM's flag.
        #[arg(long, requires = "ssl_keyfile")]
        ssl_certfile: Option<PathBuf>,
        /// The PEM private key of --ssl-certfile.
        #[arg(long, requires = "ssl_certfile")]
        ssl_keyfile: Option<PathBuf>,
    },
}

/// What log-prob a served token reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum LogprobsMode {
    /// Of the distribution sampled from (after temperature, top-k, top-p).
    ProcessedLogprobs,
    /// `log_softmax(logits)`.
    RawLogprobs,
}

impl EngineCommand {
    pub fn run(self) -> Result<()> {
        let EngineCommand::Serve {
            model,
            recipe,
            listen,
            served_model_name,
            kv_cache_mib,
            completions_only,
            logprobs_mode,
            api_key,
            chat_template,
            ssl_certfile,
            ssl_keyfile,
        } = self;
        let tls = match (ssl_certfile, ssl_keyfile) {
            (Some(cert), Some(key)) => Some(engine_serve::TlsFiles { cert, key }),
            _ => None,
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let model = match (model, recipe) {
            (Some(dir), _) => ModelSource::Checkpoint(dir),
            (None, Some(file)) => {
                // The model a run of the recipe starts from, and its tokenizer.
                let plan = orchestrator::plan::load(&file, &[])?;
                let model = orchestrator::jobs::run::initial_model(&plan)?.model;
                // The checkpoint's chat template, when the workflow starts from one.
                let chat = match (&plan.model.chat, &plan.spec.model.path) {
                    (Some(t), _) => Some(t.clone()),
                    (None, Some(dir)) => {
                        learner::chat::ChatTemplate::find(dir, None)?.map(std::sync::Arc::new)
                    }
                    (None, None) => None,
                };
                ModelSource::Loaded(Box::new(engine_serve::Loaded {
                    model,
                    tokenizer: Some(plan.model.tokenizer.clone()),
                    chat,
                    name: plan.name.clone(),
                }))
            }
            (None, None) => anyhow::bail!("give --model DIR or --recipe FILE"),
        };
        let opts = EngineServeOptions {
            model,
            listen,
            served_model_name,
            kv_cache_bytes: kv_cache_mib << 20,
            completions_only,
            raw_logprobs: logprobs_mode == LogprobsMode::RawLogprobs,
            api_key,
            chat_template,
            tls,
        };
        let rt = runtime()?;
        rt.block_on(engine_serve::serve(
            opts,
            |address, name| {
                // One line a script can read.
                println!("listening on {scheme}://{address}");
                eprintln!("serving `{name}`: curl {scheme}://{address}/v1/models");
            },
            terminated(),
        ))?;
        Ok(())
    }
}
