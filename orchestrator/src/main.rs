//! `trellis`: the command-line entry point. Subcommands are thin: they parse arguments and call
//! into the library crates; errors are reported with `anyhow` context chains.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use learner::checkpoint::Checkpoint;
use learner::{Batch, bench};
use std::path::PathBuf;

/// Trellis: an RL post-training orchestrator for language models.
#[derive(Debug, Parser)]
#[command(name = "trellis", version, arg_required_else_help = true)]
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
    /// Run a recipe (workflow YAML) in this process on the native engines.
    Train {
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
    },
    /// Draw RUN_DIR/metrics.jsonl into RUN_DIR/plot.png (train does this at the end).
    Plot {
        /// The run directory.
        run_dir: PathBuf,
    },
    /// Continue a run from its last checkpoint: the run in a directory (in this process), or a
    /// failed or cancelled job of a server (queued there again).
    Resume {
        /// A run directory, or a job id of the server.
        target: String,
        /// No progress lines.
        #[arg(long)]
        quiet: bool,
        #[command(flatten)]
        cluster: ClusterArgs,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// The state of a run (from the store of its directory) or of a server's job.
    Status {
        /// A run directory, or a job id of the server.
        target: String,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        token: TokenArg,
    },
    /// Serve the job API and agent registration on one port (the head): submitted workflows
    /// queue and run on the registered agents' pools.
    Serve {
        /// Address to listen on; a non-loopback address requires the token on every call.
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: std::net::SocketAddr,
        /// Where the job store, the token and the jobs' run directories live.
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
        /// Seconds a job waits for agents that can take its pools.
        #[arg(long, default_value_t = 120.0)]
        agent_wait: f64,
        /// The token of the API and the cluster (default DATA_DIR/token); created, mode 0600,
        /// when missing.
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
    /// List the agents registered with a server.
    Agents {
        /// Print only how many there are.
        #[arg(long)]
        count: bool,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        token: TokenArg,
    },
    /// Check this host before it joins a cluster: cores, memory, CPU features, /dev/shm, open
    /// files, PJRT plugins, TPU/GPU devices, and the head (reachable, version, clock skew).
    /// Exit status 1 when a check fails.
    Doctor {
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
    },
    /// Submit a workflow to a server; prints the job id.
    Submit {
        /// The recipe or workflow file.
        file: PathBuf,
        /// Override a field, as for `train`.
        #[arg(short = 'o', long = "override")]
        overrides: Vec<String>,
        /// Follow the job's log until it ends (as `trellis logs -f`).
        #[arg(short = 'f', long)]
        follow: bool,
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        token: TokenArg,
    },
    /// List a server's jobs.
    Jobs {
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        token: TokenArg,
    },
    /// Print a server job's log; with -f, follow it until the job ends (exit status 1 unless it
    /// succeeded).
    Logs {
        /// The job id.
        job: u64,
        /// Follow until the job ends.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Also print each step's metric row (JSON).
        #[arg(long)]
        metrics: bool,
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        token: TokenArg,
    },
    /// Cancel a server's job: a running one stops after its current step, with a checkpoint.
    Cancel {
        /// The job id.
        job: u64,
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        token: TokenArg,
    },
    /// Workflow files.
    Config {
        #[command(subcommand)]
        what: ConfigCommand,
    },
    /// Per-token log-probs and total NLL of a text under a checkpoint.
    Score {
        /// Checkpoint folder (Hugging Face layout).
        #[arg(long)]
        model: PathBuf,
        /// The text to score.
        #[arg(long)]
        text: String,
        /// Print JSON: {"token_ids": [...], "logprobs": [...], "nll": x}.
        #[arg(long)]
        json: bool,
    },
    /// Sample continuations of a prompt from a checkpoint with the native engine.
    Generate {
        /// Checkpoint folder (Hugging Face layout).
        #[arg(long)]
        model: PathBuf,
        /// The prompt text.
        #[arg(long)]
        prompt: String,
        /// Samples.
        #[arg(short, long, default_value_t = 1)]
        n: usize,
        /// Most new tokens per sample.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 1.0)]
        temperature: f32,
        /// Nucleus sampling threshold.
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Keep only the k most likely tokens (0: off).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Seed (samples of one prompt use streams 0..n of it).
        #[arg(long)]
        seed: Option<u64>,
        /// One JSON object per sample: token_ids, logprobs, finish_reason, text.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Run a node agent: host actors on this machine for the head at --head.
    Agent(AgentArgs),
    /// Inference engines as servers.
    Engine {
        #[command(subcommand)]
        what: EngineCommand,
    },
}

#[derive(Debug, Subcommand)]
enum EngineCommand {
    /// Serve a checkpoint on the native engine behind vLLM's HTTP routes (and SGLang's):
    /// completions, token-in/token-out generation, weight reload, versions, pause/resume,
    /// health, Prometheus metrics. Rollout pools reach it with `engine: served`.
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
        #[arg(long, default_value = "processed_logprobs", value_parser = ["processed_logprobs", "raw_logprobs"])]
        logprobs_mode: String,
    },
}

/// Where a run meets `trellis agent`s, for pools placed on them (`placement: pack | spread`).
#[derive(Debug, clap::Args)]
struct ClusterArgs {
    /// Listen for agents on this address (port 0: any free port; the address is printed).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// The cluster token agents must present (created, mode 0600, when the file is missing).
    #[arg(long, env = "TRELLIS_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Seconds to wait for agents that can take the pool.
    #[arg(long, default_value_t = 120.0)]
    agent_wait: f64,
}

/// Where the job API is.
#[derive(Debug, clap::Args)]
struct ServerArgs {
    /// The server's URL (https:// for a server with TLS).
    #[arg(long, env = "TRELLIS_SERVER", default_value = "http://127.0.0.1:7070")]
    server: String,
    /// PEM certificate to trust for https:// (a self-signed server's own certificate).
    #[arg(long, env = "TRELLIS_TLS_CA")]
    tls_ca: Option<PathBuf>,
}

/// The server's token.
#[derive(Debug, clap::Args)]
struct TokenArg {
    /// File holding the server's token (its DATA_DIR/token); needed unless it listens on loopback.
    #[arg(long, env = "TRELLIS_TOKEN_FILE")]
    token_file: Option<PathBuf>,
}

impl ServerArgs {
    fn client(&self, token_file: Option<&PathBuf>) -> Result<(tokio::runtime::Runtime, Client)> {
        let token = token_file.map(|p| actors::Token::read(p)).transpose()?;
        let tls_ca = read_tls_ca(self.tls_ca.as_ref())?;
        let opts = orchestrator::client::ClientOptions {
            server: self.server.clone(),
            token,
            tls_ca,
        };
        let rt = runtime()?;
        let client = rt.block_on(orchestrator::client::connect(&opts))?;
        Ok((rt, client))
    }
}

type Client = orchestrator::client::Client;

/// The PEM certificate(s) of `--tls-ca`, when given.
fn read_tls_ca(path: Option<&PathBuf>) -> Result<Option<Vec<u8>>> {
    path.map(|p| std::fs::read(p).with_context(|| format!("--tls-ca {}", p.display())))
        .transpose()
}

/// A failed call, with the server's message (the status code only when the message is empty),
/// and the transport's causes when the call never reached the server.
fn call_error(s: tonic::Status) -> anyhow::Error {
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

impl ClusterArgs {
    fn cluster(&self) -> Result<Option<orchestrator::pool::Cluster>> {
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
        Ok(Some(orchestrator::pool::Cluster {
            head: orchestrator::pool::ClusterHead::Listen { listen, token },
            wait: std::time::Duration::from_secs_f64(self.agent_wait.max(0.0)),
        }))
    }
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
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

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The actor runtime: local and remote call round trips (p50/p99), remote calls/s with many
    /// in flight, and weight snapshot GB/s in-process, through shared memory and over gRPC.
    Actors {
        /// Snapshot size in MiB.
        #[arg(long, default_value_t = 1024)]
        snapshot_mib: usize,
        /// Sequential calls timed for the percentiles.
        #[arg(long, default_value_t = 20_000)]
        calls: usize,
        /// Concurrent callers for calls/s.
        #[arg(long, default_value_t = 256)]
        in_flight: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One training step of the reference model: tokens/s, GFLOP/s, MFU, GEMM rate, peak RSS.
    Train {
        /// Rows per step.
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Tokens per row.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Timed steps (after one warm-up).
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// `native`, or `pjrt`: also the same step on a PJRT plugin, in the same run.
        #[arg(long, default_value = "native")]
        engine: String,
        /// The PJRT plugin for `--engine pjrt` (default: TRELLIS_PJRT_PLUGIN, else the XLA CPU
        /// plugin pip installed).
        #[arg(long)]
        plugin: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The native engine: prefill and decode tokens/s (batch 1, 16, 64), MFU, the bandwidth
    /// bound, and the cost of n = 8 samples against one.
    Generate {
        /// Benchmark this checkpoint instead of the reference model.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// External engines: generation through `trellis engine serve` (the vLLM adapter over
    /// loopback HTTP) against the same engine in-process, and weight pushes through folders.
    Engines {
        /// Benchmark this checkpoint instead of the reference model.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Timed repeats (the median is reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

fn score(model: &std::path::Path, text: &str, json: bool) -> Result<()> {
    let ckpt = Checkpoint::load(model)?;
    let tok = ckpt
        .tokenizer()
        .with_context(|| format!("{}: no tokenizer.json in the checkpoint", model.display()))??;
    let ids = tok.encode(text)?;
    if ids.len() < 2 {
        bail!(
            "--text must give at least two tokens to score; {text:?} gives {}",
            ids.len()
        );
    }
    let scores = ckpt.model.score(&Batch::padded(&[&ids]), 1.0)?;
    let logprobs = &scores.logp[..ids.len() - 1];
    let nll = -logprobs.iter().map(|&v| v as f64).sum::<f64>();
    if json {
        let out = serde_json::json!({"token_ids": ids, "logprobs": logprobs, "nll": nll});
        println!("{out}");
    } else {
        for (i, lp) in logprobs.iter().enumerate() {
            let piece = tok.decode(&ids[i + 1..i + 2])?;
            println!("{:>6}  {:>10.4}  {piece:?}", ids[i + 1], lp);
        }
        println!(
            "tokens {}  nll {nll:.4}  mean {:.4}",
            ids.len(),
            nll / logprobs.len() as f64
        );
    }
    Ok(())
}

fn bench_train(
    batch: usize,
    seq: usize,
    steps: usize,
    engine: &str,
    plugin: Option<PathBuf>,
    json: bool,
) -> Result<()> {
    if batch == 0 || seq < 2 || steps == 0 {
        bail!("--batch and --steps must be positive and --seq at least 2");
    }
    let client = match engine {
        "native" => None,
        "pjrt" => {
            let path = plugin
                .or_else(|| orchestrator::doctor::find_plugin("cpu"))
                .context("--engine pjrt needs a PJRT plugin: pass --plugin PATH, set TRELLIS_PJRT_PLUGIN, or `pip install xla-cpu-pjrt`")?;
            Some(
                libtpu_sys::pjrt::Client::open(&path)
                    .with_context(|| format!("--plugin {}", path.display()))?,
            )
        }
        other => bail!("--engine `{other}`: expected native or pjrt"),
    };
    let opts = bench::TrainBenchOptions {
        batch,
        seq,
        steps,
        ..Default::default()
    };
    let r = bench::train_bench(&opts, client)?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "train step, reference model ({:.1}M params), batch {batch} × seq {seq}, {} threads",
        r.params as f64 / 1e6,
        r.threads
    );
    println!(
        "  step time (median of {steps}) {:.3} s",
        r.step_seconds_median
    );
    println!("  tokens/s                   {:.0}", r.tokens_per_second);
    println!(
        "  achieved                   {:.1} GFLOP/s ({:.1} GFLOP per step)",
        r.achieved_gflops, r.model_gflops_per_step
    );
    println!(
        "  f32 FMA peak (measured)    {:.1} GFLOP/s",
        r.peak_fma_gflops
    );
    println!("  MFU                        {:.1}%", 100.0 * r.mfu);
    println!(
        "  GEMM 1024³                 {:.1} GFLOP/s ({:.1}% of peak)",
        r.gemm_1024_gflops,
        100.0 * r.gemm_fraction_of_peak
    );
    println!("  peak RSS                   {:.0} MiB", r.peak_rss_mib);
    if let Some(p) = &r.pjrt {
        println!("pjrt engine ({}), same step, same run", p.platform);
        println!("  compile (first step)       {:.1} s", p.compile_seconds);
        println!(
            "  step time (median of {steps}) {:.3} s ({:.2}× native)",
            p.step_seconds_median, p.speedup_vs_native
        );
        println!("  tokens/s                   {:.0}", p.tokens_per_second);
        println!(
            "  achieved                   {:.1} GFLOP/s ({:.1}% of the host's FMA peak)",
            p.achieved_gflops,
            100.0 * p.mfu_vs_host_peak
        );
    }
    Ok(())
}

/// Ctrl-C or SIGTERM during `train`/`resume`: the first asks the run to stop after its current
/// step (with a checkpoint); a second stops at once.
fn stop_on_signals() {
    extern "C" fn on_signal(_: libc::c_int) {
        if orchestrator::train::stop_requested() {
            // SAFETY: `_exit` is async-signal-safe.
            unsafe { libc::_exit(130) };
        }
        orchestrator::train::request_stop();
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
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    // SAFETY: mallopt only adjusts allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

struct GenerateArgs {
    model: PathBuf,
    prompt: String,
    params: rollout::SamplingParams,
    json: bool,
}

fn generate(a: GenerateArgs) -> Result<()> {
    let ckpt = Checkpoint::load(&a.model)?;
    let tok = ckpt
        .tokenizer()
        .with_context(|| format!("{}: no tokenizer.json in the checkpoint", a.model.display()))??;
    let prompt = tok.encode(&a.prompt)?;
    let engine = rollout::native::NativeEngine::new(ckpt.model, Default::default());
    let out = engine.generate_blocking(vec![rollout::GenerateRequest {
        prompt,
        params: a.params,
    }])?;
    for c in out {
        let text = tok.decode(&c.token_ids)?;
        if a.json {
            let v = serde_json::json!({"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs,
                "finish_reason": c.finish_reason, "text": text});
            println!("{v}");
        } else {
            println!("{text}");
        }
    }
    Ok(())
}

fn bench_generate(model: Option<PathBuf>, json: bool) -> Result<()> {
    let model = match model {
        Some(dir) => Checkpoint::load(&dir)?.model,
        None => learner::Model::init(bench::reference_config(), 0),
    };
    let r = rollout::bench::generate_bench(model, &[1, 16, 64]);
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "native generation, {:.1}M params, {} threads",
        r.params as f64 / 1e6,
        r.threads
    );
    println!(
        "  prefill                      {:.0} tokens/s (one {}-token prompt)",
        r.prefill_tokens_per_second, r.prefill_prompt_tokens
    );
    println!(
        "  prefill 16 × 64 together     {:.0} tokens/s ({:.0} one prompt per pass)",
        r.prefill_16x64_tokens_per_second, r.prefill_16x64_apart_tokens_per_second
    );
    for d in &r.decode {
        println!(
            "  decode batch {:<3}             {:.0} tokens/s ({:.1} GFLOP/s, MFU {:.1}%)",
            d.batch,
            d.tokens_per_second,
            d.achieved_gflops,
            100.0 * d.mfu
        );
    }
    println!(
        "  weight read bandwidth        {:.1} GB/s",
        r.memory_bandwidth_gbps
    );
    println!(
        "  batch-1 bound                {:.0} tokens/s ({:.0} MB of weights per token)",
        r.batch1_bandwidth_bound_tokens_per_second,
        r.weight_bytes_per_token / 1e6
    );
    println!(
        "  batch 1 / bound              {:.1}%",
        100.0 * r.batch1_fraction_of_bandwidth_bound
    );
    println!(
        "  n=8 time / n=1 time          {:.2} (prefill tokens for n=8: {})",
        r.n8_over_n1_time, r.n8_prefill_tokens
    );
    Ok(())
}

fn print_summary(dir: &std::path::Path, s: &orchestrator::train::Summary) {
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
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    tune_allocator();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log)?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    kernels::threads::init(cli.threads);
    match cli.command {
        Command::Train {
            recipe,
            overrides,
            run_dir,
            quiet,
            cluster,
        } => {
            let wf = orchestrator::workflow::load(&recipe, &overrides)?;
            let dir = run_dir.unwrap_or_else(|| PathBuf::from("runs").join(&wf.name));
            stop_on_signals();
            let opts = orchestrator::train::RunOptions {
                quiet,
                cluster: cluster.cluster()?,
                ..Default::default()
            };
            let summary = orchestrator::train::start(&wf, &dir, &opts)?;
            print_summary(&dir, &summary);
            Ok(())
        }
        Command::Plot { run_dir } => {
            let out = run_dir.join("plot.png");
            orchestrator::plot::plot(&run_dir, &out).map_err(anyhow::Error::msg)?;
            println!("{}", out.display());
            Ok(())
        }
        Command::Resume {
            target,
            quiet,
            cluster,
            server,
        } => {
            let run_dir = PathBuf::from(&target);
            if !run_dir.is_dir() {
                let job = job_id(&target)?;
                let (rt, mut c) = server.client(cluster.token_file.as_ref())?;
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
            let opts = orchestrator::train::RunOptions {
                quiet,
                cluster: cluster.cluster()?,
                ..Default::default()
            };
            stop_on_signals();
            let summary = orchestrator::train::resume(&run_dir, &opts)?;
            print_summary(&run_dir, &summary);
            Ok(())
        }
        Command::Status {
            target,
            json,
            server,
            token,
        } => {
            let run_dir = PathBuf::from(&target);
            if !run_dir.is_dir() {
                let job = job_id(&target)?;
                let (rt, mut c) = server.client(token.token_file.as_ref())?;
                let j = rt
                    .block_on(c.get_job(proto::v1::GetJobRequest { job_id: job }))
                    .map_err(call_error)?
                    .into_inner();
                return print_job(&j, json);
            }
            let st = orchestrator::train::status(&run_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&st)?);
                return Ok(());
            }
            let j = &st.job;
            println!(
                "job {} `{}`: {}",
                j.id,
                j.name,
                serde_json::to_value(j.state)?.as_str().unwrap_or("?")
            );
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
        Command::Serve {
            listen,
            data_dir,
            max_running,
            tls_cert,
            tls_key,
            agent_wait,
            token_file,
        } => serve(orchestrator::server::ServeOptions {
            listen,
            data_dir,
            max_running,
            tls: tls_cert.zip(tls_key),
            agent_wait: std::time::Duration::from_secs_f64(agent_wait.max(0.0)),
            token_file,
        }),
        Command::Agents {
            count,
            json,
            server,
            token,
        } => {
            let (rt, mut c) = server.client(token.token_file.as_ref())?;
            let info = rt
                .block_on(c.get_cluster(proto::v1::GetClusterRequest {}))
                .map_err(call_error)?
                .into_inner();
            if count {
                println!("{}", info.agents.len());
                return Ok(());
            }
            for a in &info.agents {
                let r = a.resources.unwrap_or_default();
                let mut labels: Vec<String> =
                    a.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                labels.sort();
                if json {
                    let v = serde_json::json!({"id": a.id, "name": a.name, "address": a.address,
                        "cpu": r.cpu, "gpu": r.gpu, "tpu": r.tpu, "memory_bytes": r.memory_bytes,
                        "labels": a.labels, "kinds": a.kinds});
                    println!("{v}");
                } else {
                    println!(
                        "{:<20} {:<28} cpu={} gpu={} tpu={}  {}",
                        a.name,
                        a.address,
                        r.cpu,
                        r.gpu,
                        r.tpu,
                        labels.join(",")
                    );
                }
            }
            Ok(())
        }
        Command::Doctor {
            head,
            token_file,
            tls_ca,
            pjrt,
            resources,
            json,
        } => doctor(DoctorArgs {
            head,
            token_file,
            tls_ca,
            pjrt,
            resources,
            json,
        }),
        Command::Submit {
            file,
            overrides,
            follow,
            server,
            token,
        } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let abs = std::path::absolute(&file)
                .with_context(|| format!("cannot resolve {}", file.display()))?;
            let request = proto::v1::SubmitJobRequest {
                workflow_yaml: text,
                overrides,
                file_name: file
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                base_dir: abs
                    .parent()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            };
            let (rt, mut c) = server.client(token.token_file.as_ref())?;
            let reply = rt
                .block_on(c.submit_job(request))
                .map_err(call_error)?
                .into_inner();
            let name = reply.job.map(|j| j.name).unwrap_or_default();
            eprintln!(
                "submitted `{name}` as job {id}: follow it with `trellis logs -f {id}`",
                id = reply.job_id
            );
            println!("{}", reply.job_id);
            if follow {
                return rt.block_on(logs(&mut c, reply.job_id, true, false));
            }
            Ok(())
        }
        Command::Jobs {
            json,
            server,
            token,
        } => {
            let (rt, mut c) = server.client(token.token_file.as_ref())?;
            let jobs = rt
                .block_on(c.list_jobs(proto::v1::ListJobsRequest {}))
                .map_err(call_error)?
                .into_inner()
                .jobs;
            if json {
                for j in &jobs {
                    println!("{}", job_json(j));
                }
                return Ok(());
            }
            println!(
                "{:>5}  {:<10}  {:<24}  {:<10}  {:>6}  error",
                "id", "state", "name", "stage", "step"
            );
            for j in &jobs {
                println!(
                    "{:>5}  {:<10}  {:<24}  {:<10}  {:>6}  {}",
                    j.id,
                    state_name(j.state),
                    j.name,
                    j.stage,
                    j.step,
                    j.error.lines().next().unwrap_or("")
                );
            }
            Ok(())
        }
        Command::Logs {
            job,
            follow,
            metrics,
            server,
            token,
        } => {
            let (rt, mut c) = server.client(token.token_file.as_ref())?;
            rt.block_on(logs(&mut c, job, follow, metrics))
        }
        Command::Cancel { job, server, token } => {
            let (rt, mut c) = server.client(token.token_file.as_ref())?;
            let j = rt
                .block_on(c.cancel_job(proto::v1::CancelJobRequest { job_id: job }))
                .map_err(call_error)?
                .into_inner();
            match state_name(j.state) {
                "running" => println!(
                    "job {job} stops after its current step (checkpointed); `trellis resume {job}` continues it"
                ),
                s => println!("job {job} {s}"),
            }
            Ok(())
        }
        Command::Config {
            what:
                ConfigCommand::Show {
                    file,
                    overrides,
                    graph,
                },
        } => {
            let wf = orchestrator::workflow::load(&file, &overrides)?;
            if !graph {
                println!("{}", serde_json::to_string_pretty(&wf)?);
                return Ok(());
            }
            for stage in wf
                .stages
                .iter()
                .filter(|s| s.kind == orchestrator::workflow::StageKind::Rl)
            {
                println!("stage {}:", stage.id);
                let g = orchestrator::graph::expand(stage)?;
                for (i, level) in g.describe().iter().enumerate() {
                    println!("  {i}: {}", level.join(", "));
                }
            }
            Ok(())
        }
        Command::Score { model, text, json } => score(&model, &text, json),
        Command::Generate {
            model,
            prompt,
            n,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            json,
        } => {
            let params = rollout::SamplingParams {
                n,
                max_tokens,
                temperature,
                top_p,
                top_k,
                seed,
                ..Default::default()
            };
            generate(GenerateArgs {
                model,
                prompt,
                params,
                json,
            })
        }
        Command::Bench {
            what:
                BenchCommand::Train {
                    batch,
                    seq,
                    steps,
                    engine,
                    plugin,
                    json,
                },
        } => bench_train(batch, seq, steps, &engine, plugin, json),
        Command::Bench {
            what: BenchCommand::Generate { model, json },
        } => bench_generate(model, json),
        Command::Bench {
            what:
                BenchCommand::Engines {
                    model,
                    repeats,
                    json,
                },
        } => bench_engines(model, repeats, json),
        Command::Engine {
            what:
                EngineCommand::Serve {
                    model,
                    recipe,
                    listen,
                    served_model_name,
                    kv_cache_mib,
                    completions_only,
                    logprobs_mode,
                },
        } => engine_serve(orchestrator::engine_server::EngineServeOptions {
            model: match (model, recipe) {
                (Some(dir), _) => orchestrator::engine_server::ModelSource::Checkpoint(dir),
                (None, Some(file)) => orchestrator::engine_server::ModelSource::Recipe(file),
                (None, None) => anyhow::bail!("give --model DIR or --recipe FILE"),
            },
            listen,
            served_model_name,
            kv_cache_bytes: kv_cache_mib << 20,
            completions_only,
            raw_logprobs: logprobs_mode == "raw_logprobs",
        }),
        Command::Bench {
            what:
                BenchCommand::Actors {
                    snapshot_mib,
                    calls,
                    in_flight,
                    json,
                },
        } => bench_actors(snapshot_mib, calls, in_flight, json),
        Command::Agent(args) => agent(args),
    }
}

/// `trellis agent`'s arguments.
#[derive(Debug, clap::Args)]
struct AgentArgs {
    /// The head's URL, e.g. http://10.0.0.1:7070.
    #[arg(long)]
    head: String,
    /// File holding the cluster token (the head refuses agents without it).
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
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Resolves on Ctrl-C or SIGTERM.
async fn terminated() {
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

fn agent(a: AgentArgs) -> Result<()> {
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
        registry: actors::builtin::registry().with::<orchestrator::pool::RolloutActor>(),
        wire: actors::Wire::default(),
    };
    runtime()?.block_on(actors::agent::run(options, terminated()))?;
    Ok(())
}

struct DoctorArgs {
    head: Option<String>,
    token_file: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    pjrt: Vec<PathBuf>,
    resources: Option<String>,
    json: bool,
}

fn doctor(a: DoctorArgs) -> Result<()> {
    use orchestrator::doctor::Level;
    let head = match a.head {
        Some(server) => Some(orchestrator::client::ClientOptions {
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
        Some(r) => {
            Some(actors::Resources::parse(r).map_err(|e| anyhow::anyhow!("--resources {r}: {e}"))?)
        }
        None => None,
    };
    let opts = orchestrator::doctor::DoctorOptions {
        head,
        pjrt: a.pjrt,
        resources,
    };
    let checks = runtime()?.block_on(orchestrator::doctor::run(&opts));
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

fn job_id(target: &str) -> Result<u64> {
    target.parse().map_err(|_| {
        anyhow::anyhow!("`{target}` is neither a run directory nor a job id of the server")
    })
}

fn state_name(state: i32) -> &'static str {
    use proto::v1::JobState;
    match JobState::try_from(state).unwrap_or(JobState::Unspecified) {
        JobState::Unspecified => "unknown",
        JobState::Pending => "pending",
        JobState::Running => "running",
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
    }
}

fn job_json(j: &proto::v1::Job) -> serde_json::Value {
    let workflow: serde_json::Value =
        serde_json::from_str(&j.workflow_json).unwrap_or(serde_json::Value::Null);
    serde_json::json!({
        "id": j.id, "name": j.name, "state": state_name(j.state), "error": j.error,
        "created_ms": j.created_ms, "updated_ms": j.updated_ms,
        "stages_completed": j.stages_completed, "stage": j.stage, "step": j.step,
        "checkpoint": j.checkpoint, "checkpoint_stage": j.checkpoint_stage,
        "checkpoint_step": j.checkpoint_step, "weight_version": j.weight_version,
        "run_dir": j.run_dir, "cancel_requested": j.cancel_requested, "workflow": workflow,
    })
}

fn print_job(j: &proto::v1::Job, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(&job_json(j))?);
        return Ok(());
    }
    println!("job {} `{}`: {}", j.id, j.name, state_name(j.state));
    if !j.error.is_empty() {
        println!("  error: {}", j.error);
    }
    if j.cancel_requested {
        println!("  cancel requested: stopping after the current step");
    }
    println!("  stages completed: {}", j.stages_completed.join(", "));
    if !j.stage.is_empty() {
        println!("  latest step: stage {} step {}", j.stage, j.step);
    }
    if !j.checkpoint.is_empty() {
        println!(
            "  last checkpoint: {} (stage {} step {}, weight version {})",
            j.checkpoint, j.checkpoint_stage, j.checkpoint_step, j.weight_version
        );
    }
    println!("  run directory (on the server): {}", j.run_dir);
    Ok(())
}

/// Prints job `id`'s log (and metric rows); with `follow`, until the job ends, failing unless
/// it succeeded.
async fn logs(c: &mut Client, id: u64, follow: bool, metrics: bool) -> Result<()> {
    use proto::v1::job_event::Event;
    if !follow {
        let mut stream = c
            .watch_job(proto::v1::WatchJobRequest {
                job_id: id,
                ..Default::default()
            })
            .await
            .map_err(call_error)?
            .into_inner();
        // Everything recorded so far arrives before the first wait: read until the first job
        // event after the backlog.
        while let Some(ev) = stream.message().await.map_err(call_error)? {
            match ev.event {
                Some(Event::Log(l)) => println!("{}", l.text),
                Some(Event::Metrics(m)) if metrics => println!("{}", metric_json(&m)),
                Some(Event::Job(_)) => return Ok(()),
                _ => {}
            }
        }
        return Ok(());
    }
    let (mut from_row, mut from_line) = (0, 0);
    loop {
        let stream = c
            .watch_job(proto::v1::WatchJobRequest {
                job_id: id,
                from_row,
                from_line,
            })
            .await;
        let mut stream = match stream {
            Ok(s) => s.into_inner(),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                eprintln!("the server is unreachable ({}); retrying", s.message());
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue;
            }
            Err(s) => return Err(call_error(s)),
        };
        let mut last = None;
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(Event::Log(l)) => {
                        from_line = l.line + 1;
                        println!("{}", l.text);
                    }
                    Some(Event::Metrics(m)) => {
                        from_row = m.row + 1;
                        if metrics {
                            println!("{}", metric_json(&m));
                        }
                    }
                    Some(Event::Job(j)) => last = Some(j),
                    None => {}
                },
                Ok(None) => break,
                Err(s) => {
                    // The server went away mid-watch (restarted?): watch again from here.
                    eprintln!("the watch broke ({}); reconnecting", s.message());
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    break;
                }
            }
        }
        let Some(j) =
            last.filter(|j| matches!(state_name(j.state), "succeeded" | "failed" | "cancelled"))
        else {
            continue;
        };
        return match state_name(j.state) {
            "succeeded" => Ok(()),
            s => bail!("job {id} {s}: {}", j.error),
        };
    }
}

fn metric_json(m: &proto::v1::MetricRow) -> serde_json::Value {
    let mut obj = serde_json::Map::new();
    obj.insert("stage".into(), m.stage.clone().into());
    obj.insert("step".into(), m.step.into());
    let mut keys: Vec<&String> = m.values.keys().collect();
    keys.sort();
    for k in keys {
        obj.insert(k.clone(), m.values[k].into());
    }
    serde_json::Value::Object(obj)
}

/// `trellis serve`: prints where it listens, serves until Ctrl-C or SIGTERM (a second one exits
/// at once).
fn serve(opts: orchestrator::server::ServeOptions) -> Result<()> {
    let rt = runtime()?;
    let required = orchestrator::server::token_required(&opts.listen);
    let token_path = opts.data_dir.join("token");
    let scheme = if opts.tls.is_some() { "https" } else { "http" };
    rt.block_on(orchestrator::server::serve(
        opts,
        |address| {
            // One line a script can read, then how to use it.
            println!("listening on {scheme}://{address}");
            eprintln!(
                "agents: trellis agent --head {scheme}://{address} --token-file {}",
                token_path.display()
            );
            if required {
                eprintln!(
                    "clients must pass --token-file {} (the listener is not loopback)",
                    token_path.display()
                );
            }
        },
        async {
            terminated().await;
            eprintln!("stopping: running jobs checkpoint after their current step (Ctrl-C again to exit now)");
            tokio::spawn(async {
                terminated().await;
                std::process::exit(130);
            });
        },
    ))?;
    Ok(())
}

fn bench_engines(model: Option<PathBuf>, repeats: usize, json: bool) -> Result<()> {
    let model = match model {
        Some(dir) => Checkpoint::load(&dir)?.model,
        None => learner::Model::init(bench::reference_config(), 0),
    };
    let r = orchestrator::engine_bench::run(model, repeats.max(1))?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "external engines, {:.1}M params; {} prompts x {} samples x {} tokens",
        r.params as f64 / 1e6,
        r.prompts,
        r.samples_per_prompt,
        r.tokens_per_sample
    );
    println!(
        "  generation in-process        {:.0} tokens/s",
        r.in_process_tokens_per_second
    );
    println!(
        "  generation over HTTP         {:.0} tokens/s ({:.2}x in-process)",
        r.http_tokens_per_second, r.http_over_in_process
    );
    println!(
        "  weight push                  {:.3} s for {:.0} MB: folder write {:.2} GB/s, reload {:.2} GB/s",
        r.push_seconds,
        r.weight_bytes as f64 / 1e6,
        r.folder_write_gbps,
        r.reload_gbps
    );
    Ok(())
}

fn engine_serve(opts: orchestrator::engine_server::EngineServeOptions) -> Result<()> {
    let rt = runtime()?;
    rt.block_on(orchestrator::engine_server::serve(
        opts,
        |address, name| {
            // One line a script can read.
            println!("listening on http://{address}");
            eprintln!("serving `{name}`: curl http://{address}/v1/models");
        },
        terminated(),
    ))?;
    Ok(())
}

fn bench_actors(snapshot_mib: usize, calls: usize, in_flight: usize, json: bool) -> Result<()> {
    let options = actors::bench::BenchOptions {
        exe: std::env::current_exe().context("cannot find the trellis executable")?,
        calls,
        in_flight,
        throughput_for: std::time::Duration::from_secs(3),
        snapshot_bytes: snapshot_mib << 20,
        snapshot_repeats: 5,
    };
    let repeats = options.snapshot_repeats;
    // Measured from a task on the runtime's workers, where the orchestrator's callers run
    // (the rollout pool spawns its calls); a call from outside the runtime adds a thread wake-up
    // each way.
    let b = runtime()?.block_on(async move {
        tokio::spawn(async move { actors::bench::run(&options).await }).await
    })??;
    if json {
        println!("{}", serde_json::to_string_pretty(&b)?);
        return Ok(());
    }
    println!(
        "local call      p50 {:8.1} µs   p99 {:8.1} µs",
        b.local_p50_us, b.local_p99_us
    );
    println!(
        "remote call     p50 {:8.1} µs   p99 {:8.1} µs",
        b.remote_p50_us, b.remote_p99_us
    );
    println!(
        "remote calls/s  {:10.0}   ({} in flight)",
        b.remote_calls_per_s, b.in_flight
    );
    let gib = b.snapshot_bytes as f64 / (1u64 << 30) as f64;
    println!("snapshot {gib:.2} GiB, GB/s   first push   later pushes (median of {repeats})");
    for (name, r) in [
        ("in-process", b.in_process_gbps),
        ("shared memory", b.shm_gbps),
        ("gRPC", b.grpc_gbps),
    ] {
        println!("  {name:<14} {:10.2}   {:10.2}", r.cold, r.warm);
    }
    Ok(())
}
