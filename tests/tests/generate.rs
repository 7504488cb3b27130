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
