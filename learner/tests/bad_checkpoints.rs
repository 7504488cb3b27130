//! Broken checkpoints are refused with a message naming the file and tensor; nothing panics.

use learner::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen2/checkpoint")
}

/// A writable copy of the fixture checkpoint in a fresh temp folder.
fn copy(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trellis-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    dir
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

fn error_of(dir: &Path) -> String {
    let e = Checkpoint::load(dir)
        .expect_err("must be refused")
        .to_string();
    std::fs::remove_dir_all(dir).unwrap();
    e
}

#[test]
fn unknown_architecture() {
    let dir = copy("arch");
    edit_config(&dir, |v| v["model_type"] = "gpt_neox".into());
    let e = error_of(&dir);
    assert!(
        e.contains("config.json") && e.contains("unknown architecture `gpt_neox`"),
        "{e}"
    );
}

#[test]
fn mismatched_shapes() {
    let dir = copy("shape");
    edit_config(&dir, |v| v["intermediate_size"] = 128.into());
    let e = error_of(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("mlp.gate_proj.weight")
            && e.contains("[160, 64]"),
        "{e}"
    );
}

#[test]
fn missing_tensors() {
    let dir = copy("missing");
    edit_config(&dir, |v| v["num_hidden_layers"] = 3.into());
    let e = error_of(&dir);
    assert!(
        e.contains("missing tensor `model.layers.2.input_layernorm.weight`"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors() {
    let dir = copy("trunc");
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = error_of(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("not a readable safetensors file"),
        "{e}"
    );
}

#[test]
fn missing_folder_and_weights() {
    let e = Checkpoint::load(Path::new("/nonexistent/trellis-ckpt"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/trellis-ckpt") && e.contains("not found"),
        "{e}"
    );
    let dir = copy("noweights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = error_of(&dir);
    assert!(e.contains("no model.safetensors"), "{e}");
}
