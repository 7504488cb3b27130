//! `trellis generate` as a user runs it.

use serde_json::Value;
use std::path::PathBuf;
use trellis_tests::{run_ok, trellis};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-qwen2")
}

#[test]
fn greedy_json_output_matches_transformers() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    let out = run_ok(
        trellis()
            .args([
                "generate",
                "--json",
                "--temperature",
                "0",
                "--max-tokens",
                "16",
                "-n",
                "2",
                "--prompt",
            ])
            .arg(reference["texts"][1].as_str().unwrap())
            .arg("--model")
            .arg(fixture().join("checkpoint")),
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "one JSON object per sample");
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["index"], i);
        assert_eq!(l["token_ids"], reference["greedy"][1]);
        assert_eq!(l["finish_reason"], "length");
        assert_eq!(l["logprobs"].as_array().unwrap().len(), 16);
        assert!(l["text"].is_string());
    }
}

#[test]
fn zero_max_tokens_is_refused_clearly() {
    let out = trellis()
        .args(["generate", "--max-tokens", "0", "--prompt", "hi", "--model"])
        .arg(fixture().join("checkpoint"))
        .output()
        .expect("run trellis generate");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_tokens must be at least 1"), "{err}");
}

/// `trellis bench generate` as a user runs it, on a small checkpoint with bf16 weights and KV
/// cache: every figure it reports is there and positive, each decode batch's MFU is against
/// the f32 FMA peak and — where the CPU has `vdpbf16ps` — against the bf16 peak measured in
/// the same run.
#[test]
fn bench_generate_reports_decode_against_both_peaks() {
    let out = run_ok(
        trellis()
            .args([
                "--log",
                "warn",
                "bench",
                "generate",
                "--weights-dtype",
                "bf16",
                "--kv-cache-dtype",
                "bf16",
                "--json",
            ])
            .arg("--model")
            .arg(fixture().join("checkpoint")),
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["weights_dtype"], "bf16", "{r}");
    assert_eq!(r["kv_cache_dtype"], "bf16", "{r}");
    for key in [
        "prefill_tokens_per_second",
        "prefill_16x64_tokens_per_second",
        "memory_bandwidth_gbps",
        "batch1_bandwidth_bound_tokens_per_second",
        "peak_fma_gflops",
    ] {
        assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {r}");
    }
    let batches: Vec<u64> = r["decode"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(batches, [1, 16, 64]);
    let bf16_peak = r["peak_bf16_gflops"].as_f64();
    for d in r["decode"].as_array().unwrap() {
        let (gflops, mfu) = (
            d["achieved_gflops"].as_f64().unwrap(),
            d["mfu"].as_f64().unwrap(),
        );
        assert!(
            d["tokens_per_second"].as_f64().unwrap() > 0.0 && gflops > 0.0,
            "{d}"
        );
        let f32_peak = r["peak_fma_gflops"].as_f64().unwrap();
        assert!((mfu - gflops / f32_peak).abs() < 1e-9, "{d}");
        match bf16_peak {
            Some(p) => assert!((d["mfu_bf16"].as_f64().unwrap() - gflops / p).abs() < 1e-9),
            None => assert!(d["mfu_bf16"].is_null(), "{d}"),
        }
    }
}
