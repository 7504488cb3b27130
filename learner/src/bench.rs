//! `trellis bench train`: one full training step (forward, backward, AdamW) of a reference
//! model on random tokens, in f32 or with bf16 matmuls, reported as tokens/s, GFLOP/s and MFU
//! against the peak of that arithmetic measured in the same run (f32 FMA, or the bf16 dot
//! product), with the GEMM rate at 1024³ and peak RSS; with a PJRT client, the same step on the
//! `pjrt` engine in the same run (compile time apart).

use crate::config::ModelConfig;
use crate::model::{Batch, Model};
use crate::optim::{LrSchedule, Optimizer};
use kernels::matmul::{Op, Par, Precision, matmul};
use kernels::optim::AdamW;
use serde::Serialize;
use std::time::Instant;

/// What to measure.
#[derive(Clone, Debug)]
pub struct TrainBenchOptions {
    /// Model config (defaults to [`reference_config`]).
    pub config: ModelConfig,
    /// Rows per step.
    pub batch: usize,
    /// Tokens per row.
    pub seq: usize,
    /// Timed steps (after one warm-up step).
    pub steps: usize,
    /// Time the native engine (off: only the `pjrt` one, for a model the host would take
    /// minutes a step on).
    pub native: bool,
    /// The PJRT device's peak in TFLOP/s, for its MFU (its bf16 or f32 dense peak: say which).
    pub device_peak_tflops: Option<f64>,
    /// The native engine's matmul arithmetic.
    pub precision: Precision,
}

/// The reference config of the model issue: hidden 512, 8 layers, 8 heads, intermediate 1408,
/// vocab 8192.
pub fn reference_config() -> ModelConfig {
    let v = serde_json::json!({"model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512,
        "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8, "max_position_embeddings": 4096});
    ModelConfig::from_json(v, std::path::Path::new("<reference>"))
        .expect("reference config is valid")
}

impl Default for TrainBenchOptions {
    fn default() -> Self {
        Self {
            config: reference_config(),
            batch: 8,
            seq: 256,
            steps: 5,
            native: true,
            device_peak_tflops: None,
            precision: Precision::F32,
        }
    }
}

/// [`reference_config`] with `overrides` (Hugging Face config fields, e.g. `hidden_size`,
/// `num_hidden_layers`); errors name the field.
pub fn reference_config_with(
    overrides: &serde_json::Map<String, serde_json::Value>,
) -> crate::Result<ModelConfig> {
    let mut v = reference_config().to_hf_json();
    if let Some(obj) = v.as_object_mut() {
        for (k, x) in overrides {
            obj.insert(k.clone(), x.clone());
        }
        if overrides.contains_key("num_attention_heads")
            && !overrides.contains_key("num_key_value_heads")
        {
            obj.insert(
                "num_key_value_heads".into(),
                overrides["num_attention_heads"].clone(),
            );
        }
        if overrides.contains_key("hidden_size") && !overrides.contains_key("intermediate_size") {
            let h = overrides["hidden_size"].as_u64().unwrap_or(512);
            obj.insert(
                "intermediate_size".into(),
                (h * 11 / 4).next_multiple_of(64).into(),
            );
        }
        obj.remove("head_dim");
    }
    ModelConfig::from_json(v, std::path::Path::new("bench train"))
}

/// Results (all rates are medians over the timed steps).
#[derive(Clone, Debug, Serialize)]
pub struct TrainBenchReport {
    pub threads: usize,
    /// The native step's matmul arithmetic (`f32` or `bf16`).
    pub precision: &'static str,
    pub params: usize,
    pub tokens_per_step: usize,
    pub step_seconds_median: f64,
    pub step_seconds_all: Vec<f64>,
    pub tokens_per_second: f64,
    pub model_gflops_per_step: f64,
    pub achieved_gflops: f64,
    pub peak_fma_gflops: f64,
    /// The bf16 dot-product peak (`vdpbf16ps`), where the CPU has one.
    pub peak_bf16_gflops: Option<f64>,
    /// Against the peak of the step's arithmetic: for a bf16 step the higher of the bf16
    /// dot-product and f32 FMA peaks (bf16 products run on the faster of the two).
    pub mfu: f64,
    /// The kernel a bf16 step's products run on (`vdpbf16ps`, `rounded f32 FMA` or
    /// `emulated`); `None` for an f32 step.
    pub bf16_kernel: Option<&'static str>,
    /// An n³ GEMM in the step's arithmetic.
    pub gemm_1024_gflops: f64,
    pub gemm_fraction_of_peak: f64,
    pub peak_rss_mib: f64,
    /// The same step on the `pjrt` engine, when asked for.
    pub pjrt: Option<PjrtBenchReport>,
}

/// The `pjrt` engine's step in the same run.
#[derive(Clone, Debug, Serialize)]
pub struct PjrtBenchReport {
    /// The plugin's platform.
    pub platform: String,
    /// Devices the step is data-parallel over (rows split, gradients all-reduced on them).
    pub devices: usize,
    /// With several devices: the same step on one device of the plugin, same run.
    pub one_device_step_seconds: Option<f64>,
    /// Seconds spent compiling (the first step's programs).
    pub compile_seconds: f64,
    pub step_seconds_median: f64,
    pub step_seconds_all: Vec<f64>,
    pub tokens_per_second: f64,
    pub achieved_gflops: f64,
    /// Against the host CPU's FMA peak (meaningful for the CPU plugin only).
    pub mfu_vs_host_peak: f64,
    /// Against the device peak given in the options.
    pub mfu_vs_device_peak: Option<f64>,
    /// Native step time ÷ pjrt step time (above 1: pjrt is faster).
    pub speedup_vs_native: f64,
    /// The trained weights to a rollout engine's decoder on the same device as a push did
    /// before they stayed there: read to the host, uploaded again (median seconds).
    pub handover_via_host_seconds: f64,
    /// The same hand-over on the device: a copy there the decoder serves as it is (median
    /// seconds; what `trellis train` does when both engines are pjrt on one device).
    pub handover_on_device_seconds: f64,
}

/// Model FLOPs of one forward+backward over `tokens` tokens in rows of `seq`: 6 per
/// matmul parameter per token (the embedding gather has none) plus attention's
/// 12·layers·hidden·seq per token (PaLM's accounting).
pub fn train_flops(c: &ModelConfig, tokens: usize, seq: usize) -> f64 {
    let embed = if c.tie_word_embeddings {
        0
    } else {
        c.vocab_size * c.hidden_size
    };
    let matmul_params = (c.num_params() - embed) as f64;
    let attn = 12.0 * (c.num_layers * c.num_heads * c.head_dim * seq) as f64;
    (6.0 * matmul_params + attn) * tokens as f64
}

/// Median seconds of handing `dev`'s weights to a decoder on `client` (the same device) through
/// the host and on the device, `times` each after one untimed round (which compiles the copy).
fn handovers(
    dev: &mut crate::pjrt::PjrtModel,
    client: libtpu_sys::pjrt::Client,
    model: &Model,
    times: usize,
) -> crate::Result<(f64, f64)> {
    let mut decoder = crate::pjrt::PjrtDecoder::new(client, model)?;
    let mut host = model.params.clone();
    let (mut via_host, mut on_device) = (Vec::new(), Vec::new());
    for i in 0..=times.max(1) {
        let t = Instant::now();
        dev.read_params(&mut host)?;
        decoder.set_params(&host)?;
        let a = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let copy = std::sync::Arc::new(dev.copy_params()?);
        decoder.set_device_params(copy)?;
        let b = t.elapsed().as_secs_f64();
        if i > 0 {
            via_host.push(a);
            on_device.push(b);
        }
    }
    Ok((median(&via_host), median(&on_device)))
}

/// The median of timings (NaN for none: not timed).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Peak resident set size of this process, in MiB (Linux; 0 elsewhere).
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// GFLOP/s of an n³ matmul in `precision` on the kernel pool (best of 20, after a warm-up).
pub fn gemm_gflops(n: usize, precision: Precision) -> f64 {
    let a = vec![0.5f32; n * n];
    let b = vec![0.25f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..21 {
        let t = Instant::now();
        matmul(
            n,
            n,
            n,
            &a,
            Op::N,
            &b,
            Op::N,
            &mut c,
            false,
            Par::Pool,
            precision,
        );
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e9
}

/// Runs the benchmark; with `pjrt`, also on that client's device.
pub fn train_bench(
    opts: &TrainBenchOptions,
    pjrt: Option<libtpu_sys::pjrt::Client>,
) -> crate::Result<TrainBenchReport> {
    let threads = kernels::threads::current();
    let peak = kernels::peak::fma_peak_gflops(threads);
    let peak_bf16 = kernels::peak::bf16_peak_gflops(threads);
    // bf16 products run on the faster of `vdpbf16ps` and f32 FMA on rounded operands
    // (`Bf16Kernel::fastest`): its peak is the higher of the two.
    let ceiling = match opts.precision {
        Precision::Bf16 => peak_bf16.map_or(peak, |b| b.max(peak)),
        Precision::F32 => peak,
    };
    let gemm = gemm_gflops(1024, opts.precision);
    let c = opts.config.clone();
    let vocab = c.vocab_size as u32;
    let rows: Vec<Vec<u32>> = (0..opts.batch)
        .map(|r| {
            (0..opts.seq)
                .map(|t| ((r * 7919 + t * 104_729) as u32) % vocab)
                .collect()
        })
        .collect();
    let refs: Vec<&[u32]> = rows.iter().map(|r| r.as_slice()).collect();
    let batch = Batch::padded(&refs);
    let n = batch.len();
    let d_logp = vec![-1.0 / n as f32; n];
    let d_ent = vec![0.0; n];
    let mut times = Vec::new();
    if opts.native {
        let mut model = Model::init(c.clone(), 0);
        model.set_precision(opts.precision);
        let mut grads = model.params.zeros_like();
        let mut opt = Optimizer::new(
            &model.params,
            AdamW::default(),
            LrSchedule::constant(1e-4),
            Some(1.0),
        );
        for i in 0..=opts.steps {
            let t = Instant::now();
            let (_, tape) = model.forward(&batch, 1.0).expect("valid synthetic batch");
            model.backward(tape, &d_logp, &d_ent, &mut grads);
            opt.step(&mut model.params, &mut grads);
            grads.fill_zero();
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    // Not timed: NaN (JSON null).
    let step = if opts.native {
        median(&times)
    } else {
        f64::NAN
    };
    let flops = train_flops(&c, n, opts.seq);
    let achieved = flops / step / 1e9;
    let pjrt = match pjrt {
        None => None,
        Some(client) => {
            let model = Model::init(c.clone(), 0);
            let steps = |client: libtpu_sys::pjrt::Client| -> crate::Result<_> {
                let mut dev = crate::pjrt::PjrtModel::new(client, &model)?;
                let mut opt = Optimizer::new(
                    &model.params,
                    AdamW::default(),
                    LrSchedule::constant(1e-4),
                    Some(1.0),
                );
                let mut ptimes = Vec::new();
                for i in 0..=opts.steps {
                    let t = Instant::now();
                    dev.backward(&batch, 1.0, &d_logp, &d_ent)?;
                    dev.step(&mut opt)?;
                    if i > 0 {
                        ptimes.push(t.elapsed().as_secs_f64());
                    }
                }
                Ok((dev, ptimes))
            };
            let devices = client.device_count();
            let one = if devices > 1 {
                let single = client
                    .with_device_count(1)
                    .map_err(|e| crate::Error::Device(e.to_string()))?;
                Some(median(&steps(single)?.1))
            } else {
                None
            };
            let decoder = client
                .with_device_count(1)
                .map_err(|e| crate::Error::Device(e.to_string()))?;
            let (mut dev, ptimes) = steps(client)?;
            let (via_host, on_device) = handovers(&mut dev, decoder, &model, opts.steps)?;
            let ps = median(&ptimes);
            let pa = flops / ps / 1e9;
            Some(PjrtBenchReport {
                platform: dev.platform().to_string(),
                devices,
                one_device_step_seconds: one,
                compile_seconds: dev.stats().compile_s,
                step_seconds_median: ps,
                step_seconds_all: ptimes,
                tokens_per_second: n as f64 / ps,
                achieved_gflops: pa,
                mfu_vs_host_peak: pa / peak,
                mfu_vs_device_peak: opts.device_peak_tflops.map(|t| pa / (t * 1e3)),
                speedup_vs_native: step / ps,
                handover_via_host_seconds: via_host,
                handover_on_device_seconds: on_device,
            })
        }
    };
    Ok(TrainBenchReport {
        threads,
        precision: match opts.precision {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        },
        params: c.num_params(),
        tokens_per_step: n,
        step_seconds_median: step,
        step_seconds_all: times,
        tokens_per_second: n as f64 / step,
        model_gflops_per_step: flops / 1e9,
        achieved_gflops: achieved,
        peak_fma_gflops: peak,
        peak_bf16_gflops: peak_bf16,
        mfu: achieved / ceiling,
        bf16_kernel: (opts.precision == Precision::Bf16)
            .then(|| kernels::matmul::Bf16Kernel::fastest().name()),
        gemm_1024_gflops: gemm,
        gemm_fraction_of_peak: gemm / ceiling,
        peak_rss_mib: peak_rss_mib(),
        pjrt,
    })
}
