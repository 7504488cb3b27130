//! `trellis bench`: the actor runtime, a training step, the native engine, external engines,
//! learner ranks.

use super::runtime;
use anyhow::{Context, Result, bail};
use kernels::matmul::Precision;
use learner::bench;
use learner::checkpoint::Checkpoint;
use std::path::PathBuf;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
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
    Train(TrainBench),
    /// The native engine: prefill and decode tokens/s (batch 1, 16, 64), MFU, the bandwidth
    /// bound, and the cost of n = 8 samples against one.
    Generate {
        /// Benchmark this checkpoint instead of the reference model.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Serve the weights as f32 or bf16 (decode steps stream half the bytes).
        #[arg(long, value_enum, default_value_t = BenchPrecision::F32)]
        weights_dtype: BenchPrecision,
        /// Keep the KV cache in f32 or bf16 (half the bytes the attention reads).
        #[arg(long, value_enum, default_value_t = BenchPrecision::F32)]
        kv_cache_dtype: BenchPrecision,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Learner ranks: one policy update of the reference model on one engine, then on N
    /// data-parallel learner actors in this process and on N `trellis agent`s on this host —
    /// step time against one engine, all-reduce GB/s and its share of the step.
    Learners {
        /// Data-parallel ranks.
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Rows per update.
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Tokens per row (half prompt, half response).
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Timed updates (after one warm-up; the median is reported).
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// Hidden size instead of the reference model's 512.
        #[arg(long)]
        hidden: Option<usize>,
        /// Layers instead of 8.
        #[arg(long)]
        layers: Option<usize>,
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

impl BenchCommand {
    pub fn run(self) -> Result<()> {
        match self {
            BenchCommand::Actors {
                snapshot_mib,
                calls,
                in_flight,
                json,
            } => bench_actors(snapshot_mib, calls, in_flight, json),
            BenchCommand::Train(a) => bench_train(a),
            BenchCommand::Generate {
                model,
                weights_dtype,
                kv_cache_dtype,
                json,
            } => bench_generate(model, weights_dtype, kv_cache_dtype, json),
            BenchCommand::Engines {
                model,
                repeats,
                json,
            } => bench_engines(model, repeats, json),
            BenchCommand::Learners {
                ranks,
                batch,
                seq,
                steps,
                hidden,
                layers,
                json,
            } => bench_learners(ranks, batch, seq, steps, hidden, layers, json),
        }
    }
}

/// Which engines `trellis bench train` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchEngine {
    /// The native engine.
    Native,
    /// The native engine, and the same step on a PJRT plugin in the same run.
    Pjrt,
    /// Only the PJRT plugin (for a model the host would take minutes a step on).
    PjrtOnly,
}

/// The device of `--engine pjrt`'s plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDevice {
    Cpu,
    Gpu,
    Tpu,
}

/// A number format: the native step's matmul arithmetic, or the served weights'.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchPrecision {
    F32,
    Bf16,
}

/// `trellis bench train`.
#[derive(Debug, clap::Args)]
pub struct TrainBench {
    /// Rows per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per row.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Timed steps (after one warm-up).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// The engines to time.
    #[arg(long, value_enum, default_value_t = BenchEngine::Native)]
    engine: BenchEngine,
    /// The device whose plugin `pjrt` uses (found as for a pool; `--plugin` overrides).
    #[arg(long, value_enum, default_value_t = BenchDevice::Cpu)]
    device: BenchDevice,
    /// The PJRT plugin (default: TRELLIS_PJRT_PLUGIN, else the one pip installed for
    /// `--device`).
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// `pjrt`: the step data-parallel over this many devices of the plugin (rows split,
    /// gradients all-reduced in the program), timed against one device in the same run.
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// Hidden size instead of the reference model's 512 (the MLP scales with it).
    #[arg(long)]
    hidden: Option<usize>,
    /// Layers instead of 8.
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads instead of 8.
    #[arg(long)]
    heads: Option<usize>,
    /// Vocabulary instead of 8192.
    #[arg(long)]
    vocab: Option<usize>,
    /// The device's peak TFLOP/s, for its MFU (e.g. an H200's dense bf16 or f32 peak).
    #[arg(long)]
    device_peak_tflops: Option<f64>,
    /// The native step's matmuls: f32, or bf16 operands with f32 sums (MFU then against the
    /// bf16 dot-product peak).
    #[arg(long, value_enum, default_value_t = BenchPrecision::F32)]
    precision: BenchPrecision,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench_train(a: TrainBench) -> Result<()> {
    let TrainBench {
        batch,
        seq,
        steps,
        engine,
        device,
        plugin,
        json,
        ..
    } = a;
    if batch == 0 || seq < 2 || steps == 0 {
        bail!("--batch and --steps must be positive and --seq at least 2");
    }
    let client = match engine {
        BenchEngine::Native => None,
        BenchEngine::Pjrt | BenchEngine::PjrtOnly => {
            use libtpu_sys::locate::Device;
            let device = match device {
                BenchDevice::Cpu => Device::Cpu,
                BenchDevice::Gpu => Device::Gpu,
                BenchDevice::Tpu => Device::Tpu,
            };
            Some(
                libtpu_sys::locate::open_devices(device, plugin.as_deref(), a.devices)
                    .context("--engine pjrt")?,
            )
        }
    };
    let mut shape = serde_json::Map::new();
    for (key, v) in [
        ("hidden_size", a.hidden),
        ("num_hidden_layers", a.layers),
        ("num_attention_heads", a.heads),
        ("vocab_size", a.vocab),
    ] {
        if let Some(v) = v {
            shape.insert(key.into(), v.into());
        }
    }
    let opts = bench::TrainBenchOptions {
        config: bench::reference_config_with(&shape)?,
        batch,
        seq,
        steps,
        native: engine != BenchEngine::PjrtOnly,
        device_peak_tflops: a.device_peak_tflops,
        precision: match a.precision {
            BenchPrecision::F32 => Precision::F32,
            BenchPrecision::Bf16 => Precision::Bf16,
        },
    };
    let r = bench::train_bench(&opts, client)?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "train step, reference model ({:.1}M params), batch {batch} × seq {seq}, {} threads, {} matmuls",
        r.params as f64 / 1e6,
        r.threads,
        r.precision
    );
    if r.step_seconds_median.is_nan() {
        println!("  native engine not timed (--engine pjrt-only)");
    }
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
    if let Some(p) = r.peak_bf16_gflops {
        println!("  bf16 dot peak (measured)   {p:.1} GFLOP/s");
    }
    match r.bf16_kernel {
        Some(kernel) => println!(
            "  MFU                        {:.1}% (bf16 products on {kernel}; of the {} peak)",
            100.0 * r.mfu,
            if r.peak_bf16_gflops.is_some() {
                "higher bf16 dot or f32 FMA"
            } else {
                "f32 FMA"
            }
        ),
        None => println!(
            "  MFU                        {:.1}% (of the f32 FMA peak)",
            100.0 * r.mfu
        ),
    }
    println!(
        "  GEMM 1024³                 {:.1} GFLOP/s ({:.1}% of peak)",
        r.gemm_1024_gflops,
        100.0 * r.gemm_fraction_of_peak
    );
    println!("  peak RSS                   {:.0} MiB", r.peak_rss_mib);
    if let Some(p) = &r.pjrt {
        println!(
            "pjrt engine ({}, {} device{}), same step, same run",
            p.platform,
            p.devices,
            if p.devices == 1 { "" } else { "s" }
        );
        println!("  compile (first step)       {:.1} s", p.compile_seconds);
        println!(
            "  step time (median of {steps}) {:.3} s ({:.2}× native)",
            p.step_seconds_median, p.speedup_vs_native
        );
        if let Some(one) = p.one_device_step_seconds {
            println!(
                "  one device, same run       {one:.3} s ({:.2}× faster on {})",
                one / p.step_seconds_median,
                p.devices
            );
        }
        println!("  tokens/s                   {:.0}", p.tokens_per_second);
        println!(
            "  achieved                   {:.1} GFLOP/s ({:.1}% of the host's FMA peak)",
            p.achieved_gflops,
            100.0 * p.mfu_vs_host_peak
        );
        if let Some(m) = p.mfu_vs_device_peak {
            println!("  MFU (device peak given)    {:.1}%", 100.0 * m);
        }
        println!(
            "  weights to an engine on the device: {:.1} ms on the device, {:.1} ms through the host ({:.1}×)",
            1e3 * p.handover_on_device_seconds,
            1e3 * p.handover_via_host_seconds,
            p.handover_via_host_seconds / p.handover_on_device_seconds
        );
    }
    Ok(())
}

fn bench_generate(
    model: Option<PathBuf>,
    dtype: BenchPrecision,
    kv_dtype: BenchPrecision,
    json: bool,
) -> Result<()> {
    let model = match model {
        Some(dir) => Checkpoint::load(&dir)?.model,
        None => learner::Model::init(bench::reference_config(), 0),
    };
    let format = |p| match p {
        BenchPrecision::F32 => learner::params::WeightDtype::F32,
        BenchPrecision::Bf16 => learner::params::WeightDtype::Bf16,
    };
    let (dtype, kv_dtype) = (format(dtype), format(kv_dtype));
    let r = rollout::bench::generate_bench(model, &[1, 16, 64], dtype, kv_dtype);
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "native generation, {:.1}M params ({} weights, {} KV cache), {} threads",
        r.params as f64 / 1e6,
        dtype.hf_name(),
        kv_dtype.hf_name(),
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
        let bf16 = d
            .mfu_bf16
            .map(|m| format!(", {:.1}% of bf16", 100.0 * m))
            .unwrap_or_default();
        println!(
            "  decode batch {:<3}             {:.0} tokens/s ({:.1} GFLOP/s, MFU {:.1}% of f32{bf16})",
            d.batch,
            d.tokens_per_second,
            d.achieved_gflops,
            100.0 * d.mfu
        );
    }
    println!(
        "  f32 FMA peak (measured)      {:.1} GFLOP/s",
        r.peak_fma_gflops
    );
    if let Some(p) = r.peak_bf16_gflops {
        println!("  bf16 dot peak (measured)     {p:.1} GFLOP/s");
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

fn bench_engines(model: Option<PathBuf>, repeats: usize, json: bool) -> Result<()> {
    let model = match model {
        Some(dir) => Checkpoint::load(&dir)?.model,
        None => learner::Model::init(bench::reference_config(), 0),
    };
    let r = crate::engine_bench::run(model, repeats.max(1))?;
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

fn bench_learners(
    ranks: usize,
    batch: usize,
    seq: usize,
    steps: usize,
    hidden: Option<usize>,
    layers: Option<usize>,
    json: bool,
) -> Result<()> {
    if ranks < 2 || batch < ranks || seq < 2 || steps == 0 {
        bail!(
            "--ranks needs at least 2, --batch at least one row a rank, --seq at least 2, --steps at least 1"
        );
    }
    let mut shape = serde_json::Map::new();
    for (key, v) in [("hidden_size", hidden), ("num_hidden_layers", layers)] {
        if let Some(v) = v {
            shape.insert(key.into(), v.into());
        }
    }
    let o = orchestrator::pools::bench::LearnerBenchOptions {
        exe: std::env::current_exe().context("cannot find the trellis executable")?,
        config: bench::reference_config_with(&shape)?,
        ranks,
        batch,
        seq,
        steps,
    };
    let b = orchestrator::pools::bench::run(&o)?;
    if json {
        println!("{}", serde_json::to_string(&b)?);
        return Ok(());
    }
    println!(
        "policy update, reference model ({:.1}M params, {:.0} MB gradient), batch {batch} × seq {seq}, {ranks} ranks",
        b.params as f64 / 1e6,
        b.gradient_bytes as f64 / 1e6
    );
    println!(
        "  one engine in this process     step {:.3} s (median of {steps})",
        b.one_engine_step_s
    );
    println!(
        "  weights to a rollout engine in this process: shared {:.4} s ({}), copied twice as before {:.4} s; the next update while it serves them {:.3} s (copy on write), after a copy {:.3} s",
        b.handover_shared_s,
        if b.handover_shares_memory {
            "same memory"
        } else {
            "COPIED"
        },
        b.handover_copied_s,
        b.step_while_served_s,
        b.step_in_place_s
    );
    for p in &b.pushes {
        println!(
            "  weights from the {ranks} ranks to {ranks} rollout engines {:<23} push {:.4} s ({} from a rank beside, {} read from the ranks)",
            p.engines, p.push_s, p.beside, p.from_ranks
        );
    }
    for r in &b.runs {
        let sum = match r.allreduce {
            orchestrator::plan::AllReduce::Ranks => "ranks sum",
            orchestrator::plan::AllReduce::Streams => "streams",
            orchestrator::plan::AllReduce::Driver => "driver sums",
        };
        println!(
            "  {ranks} ranks, {:<23} {:<8} {sum:<11} step {:.3} s ({:.2}× one engine), all-reduce {:.3} s = {:.2} GB/s, {:.0}% of the step; weights read {:.3} s; optimiser state {:.0} MB a rank",
            r.placement,
            if r.sharded { "ZeRO-1" } else { "replicas" },
            r.step_s,
            r.vs_one_engine,
            r.allreduce_s,
            r.allreduce_gbps,
            100.0 * r.comm_share,
            r.weights_read_s,
            r.optimizer_bytes_per_rank as f64 / 1e6
        );
    }
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
        println!("{}", serde_json::to_string(&b)?);
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
        ("gRPC, bf16", b.grpc_bf16_gbps),
    ] {
        println!("  {name:<14} {:10.2}   {:10.2}", r.cold, r.warm);
    }
    Ok(())
}
