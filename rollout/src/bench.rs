//! `trellis bench generate`: prefill and decode throughput of the native engine, the cost of
//! `n` samples against one, and batch-1 decode against the memory-bandwidth bound measured in
//! the same run; with f32 weights or bf16 ones (half the bytes a decode step streams).

use crate::native::{NativeConfig, NativeEngine};
use crate::{GenerateRequest, SamplingParams};
use learner::Model;
use learner::params::WeightDtype;
use serde::Serialize;
use std::time::Instant;

/// Results.
#[derive(Clone, Debug, Serialize)]
pub struct GenerateBenchReport {
    pub threads: usize,
    /// The served weights' number format.
    pub weights_dtype: WeightDtype,
    /// The KV cache's number format.
    pub kv_cache_dtype: WeightDtype,
    pub params: usize,
    pub prefill_tokens_per_second: f64,
    /// Length of that prompt.
    pub prefill_prompt_tokens: usize,
    /// Prefill of 16 prompts of 64 tokens submitted together (one pass over the weights).
    pub prefill_16x64_tokens_per_second: f64,
    /// The same 16 prompts with a prefill budget of one prompt (one pass each).
    pub prefill_16x64_apart_tokens_per_second: f64,
    /// (batch, decode tokens/s, MFU) for each batch size.
    pub decode: Vec<DecodePoint>,
    /// Weight bytes a decode step streams (all but an untied embedding table).
    pub weight_bytes_per_token: f64,
    pub memory_bandwidth_gbps: f64,
    /// Tokens/s that batch 1 could reach if it only streamed the weights once per token (at
    /// [`memory_bandwidth_gbps`] over the weights themselves).
    pub batch1_bandwidth_bound_tokens_per_second: f64,
    pub batch1_fraction_of_bandwidth_bound: f64,
    /// Time of one request with n = 8 over the same request with n = 1 (16 new tokens,
    /// 256-token prompt).
    pub n8_over_n1_time: f64,
    /// Prefill tokens the engine ran for the n = 8 request (equal to the prompt: one prefill).
    pub n8_prefill_tokens: u64,
    pub peak_fma_gflops: f64,
    /// The bf16 dot-product peak measured in the same run (`vdpbf16ps`), where the CPU has it:
    /// the ceiling of bf16 weights' products.
    pub peak_bf16_gflops: Option<f64>,
}

/// One decode measurement.
#[derive(Clone, Debug, Serialize)]
pub struct DecodePoint {
    pub batch: usize,
    pub tokens_per_second: f64,
    pub achieved_gflops: f64,
    /// Of the f32 FMA peak.
    pub mfu: f64,
    /// Of the bf16 dot-product peak, for bf16 weights on a CPU that has it.
    pub mfu_bf16: Option<f64>,
}

/// Read bandwidth in GB/s over `buffers` (the model's weights: the very bytes, and pages, a
/// batch-1 decode step streams), every kernel thread reading its share, best of a few passes.
pub fn memory_bandwidth_gbps(buffers: &[&[f32]]) -> f64 {
    use rayon::prelude::*;
    let bytes: usize = buffers.iter().map(|b| b.len() * 4).sum();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let s: f32 = buffers
            .par_iter()
            .flat_map(|b| b.par_chunks(1 << 16))
            .map(|c| {
                // 16 independent lanes, so the loop vectorises and memory is the limit
                let mut acc = [0.0f32; 16];
                for v in c.chunks_exact(16) {
                    acc.iter_mut().zip(v).for_each(|(a, b)| *a += b);
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

fn requests(
    count: usize,
    prompt: usize,
    max_tokens: usize,
    n: usize,
    vocab: usize,
) -> Vec<GenerateRequest> {
    (0..count)
        .map(|r| GenerateRequest {
            prompt: (0..prompt)
                .map(|t| ((r * 131 + t * 7919) % vocab) as u32)
                .collect(),
            params: SamplingParams {
                n,
                max_tokens,
                ignore_eos: true,
                seed: Some(r as u64),
                ..Default::default()
            },
            episode: None,
        })
        .collect()
}

fn timed(engine: &NativeEngine, reqs: Vec<GenerateRequest>) -> f64 {
    let t = Instant::now();
    engine
        .generate_blocking(reqs)
        .expect("benchmark requests are valid");
    t.elapsed().as_secs_f64()
}

/// Runs the benchmark on `model` served in `weights_dtype` with a KV cache in
/// `kv_cache_dtype` (decode at each of `batches`).
pub fn generate_bench(
    model: Model,
    batches: &[usize],
    weights_dtype: WeightDtype,
    kv_cache_dtype: WeightDtype,
) -> GenerateBenchReport {
    let threads = kernels::threads::current();
    let peak = kernels::peak::fma_peak_gflops(threads);
    let peak_bf16 = (weights_dtype == WeightDtype::Bf16)
        .then(|| kernels::peak::bf16_peak_gflops(threads))
        .flatten();
    let bw = {
        let weights: Vec<&[f32]> = model.params.tensors.iter().map(|t| &t.data[..]).collect();
        memory_bandwidth_gbps(&weights)
    };
    let c = model.config.clone();
    let vocab = c.vocab_size;
    let apart = NativeEngine::new(
        model.clone(),
        NativeConfig {
            max_prefill_tokens: 64,
            kv_cache_bytes: 64 << 20,
            weights_dtype,
            kv_cache_dtype,
            ..Default::default()
        },
    );
    timed(&apart, requests(1, 16, 4, 1, vocab));
    let prefill_apart_tps = (16 * 64) as f64 / timed(&apart, requests(16, 64, 1, 1, vocab));
    drop(apart);
    let engine = NativeEngine::new(
        model,
        NativeConfig {
            weights_dtype,
            kv_cache_dtype,
            ..Default::default()
        },
    );
    // warm-up
    timed(&engine, requests(1, 16, 4, 1, vocab));
    let prompt = 256.min(c.max_position_embeddings / 2);
    let prefill = timed(&engine, requests(1, prompt, 1, 1, vocab));
    let prefill_tps = prompt as f64 / prefill;
    let many = timed(&engine, requests(16, 64, 1, 1, vocab));
    let prefill_many_tps = (16 * 64) as f64 / many;
    let (ctx, new) = (16usize, 64usize);
    let matmul_params = c.num_params()
        - if c.tie_word_embeddings {
            0
        } else {
            c.vocab_size * c.hidden_size
        };
    let mut decode = Vec::new();
    for &b in batches {
        // the median of three passes: the first may also fault in fresh cache blocks
        let mut runs: Vec<f64> = (0..3)
            .map(|_| {
                let only_prefill = timed(&engine, requests(b, ctx, 1, 1, vocab));
                let total = timed(&engine, requests(b, ctx, new, 1, vocab));
                (total - only_prefill).max(1e-9)
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        let secs = runs[1];
        let tokens = (b * (new - 1)) as f64;
        let avg_ctx = (ctx + new / 2) as f64;
        let flops_per_token = 2.0 * matmul_params as f64
            + 4.0 * (c.num_layers * c.num_heads * c.head_dim) as f64 * avg_ctx;
        let gflops = tokens * flops_per_token / secs / 1e9;
        decode.push(DecodePoint {
            batch: b,
            tokens_per_second: tokens / secs,
            achieved_gflops: gflops,
            mfu: gflops / peak,
            mfu_bf16: peak_bf16.map(|p| gflops / p),
        });
    }
    let n1 = timed(&engine, requests(1, prompt, 16, 1, vocab));
    let before = engine.stats().prefill_tokens;
    let n8 = timed(&engine, requests(1, prompt, 16, 8, vocab));
    let n8_prefill = engine.stats().prefill_tokens - before;
    // every weight a decode step reads: all but an untied embedding table (one row of it)
    let weight_bytes = (matmul_params as u64 * weights_dtype.bytes()) as f64;
    let bound = bw * 1e9 / weight_bytes;
    let b1 = decode
        .iter()
        .find(|d| d.batch == 1)
        .map_or(0.0, |d| d.tokens_per_second);
    GenerateBenchReport {
        threads,
        weights_dtype,
        kv_cache_dtype,
        params: c.num_params(),
        prefill_tokens_per_second: prefill_tps,
        prefill_prompt_tokens: prompt,
        prefill_16x64_tokens_per_second: prefill_many_tps,
        prefill_16x64_apart_tokens_per_second: prefill_apart_tps,
        decode,
        weight_bytes_per_token: weight_bytes,
        memory_bandwidth_gbps: bw,
        batch1_bandwidth_bound_tokens_per_second: bound,
        batch1_fraction_of_bandwidth_bound: b1 / bound,
        n8_over_n1_time: n8 / n1,
        n8_prefill_tokens: n8_prefill,
        peak_fma_gflops: peak,
        peak_bf16_gflops: peak_bf16,
    }
}
