//! `trellis bench engines`: what the HTTP path to an engine costs, measured against the same
//! engine in-process in the same run — generation tokens/s through `trellis engine serve` (the
//! vLLM adapter over loopback) versus the native engine called directly, and weight pushes
//! through versioned folders (write, then pause → reload → version → resume) in GB/s.
//!
//! Owns: the workload and the report. Never: asserts a time (figures are for the note).

use engine_serve::{EngineServeOptions, ModelSource, serve};
use kernels::tensor::WeightSnapshot;
use learner::Model;
use learner::checkpoint::Checkpoint;
use rollout::external::vllm::VllmEngine;
use rollout::external::{ExternalConfig, WeightFolders};
use rollout::native::{NativeConfig, NativeEngine};
use rollout::{GenerateRequest, SamplingParams};
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Results (medians of `repeats`).
#[derive(Clone, Debug, Serialize)]
pub struct EngineBenchReport {
    pub params: usize,
    pub weight_bytes: usize,
    pub prompts: usize,
    pub samples_per_prompt: usize,
    pub tokens_per_sample: usize,
    pub in_process_tokens_per_second: f64,
    pub http_tokens_per_second: f64,
    /// HTTP over in-process throughput.
    pub http_over_in_process: f64,
    /// Writing one version's folder (config.json + model.safetensors, f32).
    pub folder_write_gbps: f64,
    /// The server's pause → reload → version → resume of that folder.
    pub reload_gbps: f64,
    pub push_seconds: f64,
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BenchError(String);

fn fail(e: impl std::fmt::Display) -> BenchError {
    BenchError(e.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the bench on `model` (saved to a scratch folder that a server in this process
/// serves over loopback HTTP).
pub fn run(model: Model, repeats: usize) -> Result<EngineBenchReport, BenchError> {
    let scratch =
        std::env::temp_dir().join(format!("trellis-bench-engines-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let served = scratch.join("model");
    let config = model.config.clone();
    let params = Arc::new(model.params.clone());
    Checkpoint {
        model: Model::new(config.clone(), (*params).clone()).map_err(fail)?,
        assets: Vec::new(),
    }
    .save(&served, None)
    .map_err(fail)?;
    let (prompts, n, tokens) = (16usize, 4usize, 32usize);
    let reqs: Vec<GenerateRequest> = (0..prompts)
        .map(|i| GenerateRequest {
            prompt: (0..64)
                .map(|t| ((i * 131 + t * 7) % config.vocab_size) as u32)
                .collect(),
            params: SamplingParams {
                n,
                max_tokens: tokens,
                ignore_eos: true,
                seed: Some(i as u64),
                ..Default::default()
            },
            episode: None,
        })
        .collect();
    let generated = (prompts * n * tokens) as f64;
    let engine_cfg = NativeConfig {
        kv_cache_bytes: 256 << 20,
        ..Default::default()
    };
    // In-process.
    let local = NativeEngine::new(model, engine_cfg.clone());
    local.generate_blocking(reqs.clone()).map_err(fail)?;
    let mut local_tps = Vec::new();
    for _ in 0..repeats {
        let t = Instant::now();
        local.generate_blocking(reqs.clone()).map_err(fail)?;
        local_tps.push(generated / t.elapsed().as_secs_f64());
    }
    drop(local);

    // Through the server.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(fail)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(serve(
        EngineServeOptions {
            kv_cache_bytes: engine_cfg.kv_cache_bytes,
            ..EngineServeOptions::new(ModelSource::Checkpoint(served.clone()))
        },
        move |addr, _| {
            let _ = tx.send(addr);
        },
        async {
            let _ = stop_rx.await;
        },
    ));
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .map_err(|_| fail("the engine server did not start"))?;
    let remote = rt
        .block_on(VllmEngine::connect(ExternalConfig::new(format!(
            "http://{addr}"
        ))))
        .map_err(fail)?;
    rt.block_on(remote.generate_all(reqs.clone()))
        .map_err(fail)?;
    let mut http_tps = Vec::new();
    for _ in 0..repeats {
        let t = Instant::now();
        rt.block_on(remote.generate_all(reqs.clone()))
            .map_err(fail)?;
        http_tps.push(generated / t.elapsed().as_secs_f64());
    }

    // Pushes.
    let folders = WeightFolders::new(scratch.join("weights"));
    let bytes = params.numel() * 4;
    let (mut write, mut reload, mut total) = (Vec::new(), Vec::new(), Vec::new());
    for v in 1..=repeats as u64 {
        let snap = WeightSnapshot::new(v, Arc::clone(&params));
        let t = Instant::now();
        let dir = folders.write(&snap, &config).map_err(fail)?;
        let w = t.elapsed().as_secs_f64();
        let t2 = Instant::now();
        rt.block_on(remote.reload(&dir, v)).map_err(fail)?;
        let r = t2.elapsed().as_secs_f64();
        write.push(bytes as f64 / w / 1e9);
        reload.push(bytes as f64 / r / 1e9);
        total.push(w + r);
    }
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
    let _ = std::fs::remove_dir_all(&scratch);
    let (local_tps, http_tps) = (median(local_tps), median(http_tps));
    Ok(EngineBenchReport {
        params: params.numel(),
        weight_bytes: bytes,
        prompts,
        samples_per_prompt: n,
        tokens_per_sample: tokens,
        in_process_tokens_per_second: local_tps,
        http_tokens_per_second: http_tps,
        http_over_in_process: http_tps / local_tps,
        folder_write_gbps: median(write),
        reload_gbps: median(reload),
        push_seconds: median(total),
    })
}
