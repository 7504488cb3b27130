//! `trellis score` on the transformers-made fixture, as a user runs it.

use serde_json::Value;
use std::path::PathBuf;
use trellis_tests::{run_ok, trellis};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-qwen2")
}

#[test]
fn score_json_matches_the_reference_logprobs() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    let text = reference["texts"][0].as_str().unwrap();
    let out = run_ok(
        trellis()
            .args(["score", "--json", "--text", text, "--model"])
            .arg(fixture().join("checkpoint")),
    );
    let got: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(got["token_ids"], reference["input_ids"][0]);
    let lps = got["logprobs"].as_array().unwrap();
    let want = reference["token_logprobs"][0].as_array().unwrap();
    assert_eq!(lps.len(), want.len(), "one log-prob fewer than tokens");
    for (a, b) in lps.iter().zip(want) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4);
    }
    let nll: f64 = -want.iter().map(|v| v.as_f64().unwrap()).sum::<f64>();
    assert!((got["nll"].as_f64().unwrap() - nll).abs() < 1e-3);
}

#[test]
fn score_refuses_a_missing_checkpoint_naming_it() {
    let out = trellis()
        .args(["score", "--text", "hi", "--model", "/nonexistent/ckpt"])
        .output()
        .expect("run trellis score");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/ckpt"), "{err}");
}
