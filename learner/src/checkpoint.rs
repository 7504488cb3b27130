//! Checkpoint folders in Hugging Face layout: `config.json`, `model.safetensors` (or shards),
//! the tokenizer files, and, for training, the optimiser state under `optimizer/` (kept out of
//! the top level because inference servers load every top-level `*.safetensors`).
//!
//! Saving is atomic: everything is written to a sibling temporary folder that is renamed into
//! place, so a crash mid-save never leaves a half-written checkpoint under the final name.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::optim::Optimizer;
use crate::params::{ParamsIo, WeightDtype};
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// Files copied through unchanged from a loaded checkpoint to a saved one.
pub const ASSET_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
];

/// A checkpoint in memory: the model and the side files that travel with it.
#[derive(Debug)]
pub struct Checkpoint {
    /// Config and weights.
    pub model: Model,
    /// (file name, bytes) of tokenizer and generation files, written back on save.
    pub assets: Vec<(String, Vec<u8>)>,
}

impl Checkpoint {
    /// Loads a checkpoint folder.
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "checkpoint folder not found"),
            ));
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let mut model = Model::load_weights(config, dir)?;
        // A checkpoint written in bf16 keeps the f32 weights that train beside its optimiser
        // state: resuming continues from them, not from their rounding.
        let master = dir.join(MASTER);
        if master.is_file() {
            let (_, specs) = crate::params::Layout::new(&model.config);
            let params = crate::params::load_file(&master, &specs)?;
            model = Model::new(model.config, params)?;
        }
        let mut assets = Vec::new();
        for name in ASSET_FILES {
            let p = dir.join(name);
            if p.is_file() {
                assets.push((
                    name.to_string(),
                    std::fs::read(&p).map_err(|e| Error::io(&p, e))?,
                ));
            }
        }
        Ok(Self { model, assets })
    }

    /// The tokenizer shipped with the checkpoint, if it has `tokenizer.json`.
    pub fn tokenizer(&self) -> Option<Result<Tokenizer>> {
        self.assets
            .iter()
            .find(|(n, _)| n == "tokenizer.json")
            .map(|(n, bytes)| {
                let text = std::str::from_utf8(bytes).map_err(|e| Error::Tokenizer {
                    path: n.into(),
                    msg: e.to_string(),
                })?;
                Tokenizer::from_json(text, Path::new(n))
            })
    }

    /// Writes the checkpoint (and `optimizer`'s state, when given) to `dir`, atomically, in f32.
    pub fn save(&self, dir: &Path, optimizer: Option<&Optimizer>) -> Result<()> {
        save(&self.model, &self.assets, dir, optimizer, WeightDtype::F32)
    }
}

/// Shards above this size, as transformers' `save_pretrained(max_shard_size="5GB")`.
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Where a checkpoint written in another dtype than f32 keeps the f32 weights it resumes from.
const MASTER: &str = "optimizer/master.safetensors";

/// Writes `model` with its side files `assets` (and `optimizer`'s state, when given) to `dir`
/// as a checkpoint folder, atomically, its weights in `dtype` (`config.json` says which);
/// weights past [`MAX_SHARD_BYTES`] are sharded. In bf16 with the optimiser, the f32 weights
/// are kept too (`optimizer/master.safetensors`), so resuming is exact.
pub fn save(
    model: &Model,
    assets: &[(String, Vec<u8>)],
    dir: &Path,
    optimizer: Option<&Optimizer>,
    dtype: WeightDtype,
) -> Result<()> {
    save_with(model, assets, dir, optimizer, MAX_SHARD_BYTES, dtype)
}

/// [`save`] with another shard size.
pub fn save_with(
    model: &Model,
    assets: &[(String, Vec<u8>)],
    dir: &Path,
    optimizer: Option<&Optimizer>,
    max_shard_bytes: u64,
    dtype: WeightDtype,
) -> Result<()> {
    let tmp = sibling(dir, ".tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let cfg = tmp.join("config.json");
    let mut hf = model.config.to_hf_json();
    if let Some(obj) = hf.as_object_mut() {
        for key in ["torch_dtype", "dtype"] {
            obj.insert(key.into(), dtype.hf_name().into());
        }
    }
    let text = serde_json::to_string_pretty(&hf).expect("JSON value serialises");
    std::fs::write(&cfg, text).map_err(|e| Error::io(&cfg, e))?;
    model.params.save_sharded(&tmp, max_shard_bytes, dtype)?;
    for (name, bytes) in assets {
        let p = tmp.join(name);
        std::fs::write(&p, bytes).map_err(|e| Error::io(&p, e))?;
    }
    if let Some(opt) = optimizer {
        opt.save(&tmp.join("optimizer"))?;
        if dtype != WeightDtype::F32 {
            model.params.save(&tmp.join(MASTER))?;
        }
    }
    if dir.exists() {
        let old = sibling(dir, ".old");
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    } else {
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(suffix);
    dir.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{Params, ParamsIo};

    #[test]
    fn weights_past_the_shard_size_are_sharded_with_an_index_and_load_back() {
        let config = ModelConfig::from_json(
            serde_json::json!({"arch": "qwen2", "vocab_size": 64, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 32}),
            Path::new("config.json"),
        )
        .unwrap();
        let (_, specs) = crate::params::Layout::new(&config);
        let model = Model::new(config, Params::init(&specs, 0.02, 7)).unwrap();
        let dir = std::env::temp_dir().join(format!("trellis-shards-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // 40 KB a shard: a few shards for this model.
        save_with(&model, &[], &dir, None, 40_000, WeightDtype::F32).unwrap();
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let files: std::collections::BTreeSet<&str> = index["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(files.len() > 1, "{files:?}");
        let n = files.len();
        for (i, f) in files.iter().enumerate() {
            assert_eq!(*f, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
            assert!(dir.join(f).is_file());
        }
        let total: u64 = model
            .params
            .tensors
            .iter()
            .map(|t| 4 * t.data.len() as u64)
            .sum();
        assert_eq!(index["metadata"]["total_size"], total);
        assert!(!dir.join("model.safetensors").exists());
        let back = Checkpoint::load(&dir).unwrap();
        assert_eq!(back.model.params, model.params);
        // Below the limit: one file, no index.
        save(&model, &[], &dir, None, WeightDtype::F32).unwrap();
        assert!(dir.join("model.safetensors").is_file());
        assert!(!dir.join("model.safetensors.index.json").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bf16_checkpoints_serve_in_bf16_and_resume_from_the_f32_weights() {
        use crate::optim::LrSchedule;
        use kernels::optim::AdamW;
        let config = ModelConfig::from_json(
            serde_json::json!({"arch": "qwen2", "vocab_size": 64, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 32}),
            Path::new("config.json"),
        )
        .unwrap();
        let (_, specs) = crate::params::Layout::new(&config);
        let model = Model::new(config, Params::init(&specs, 0.02, 7)).unwrap();
        let opt = Optimizer::new(
            &model.params,
            AdamW::default(),
            LrSchedule::constant(0.1),
            None,
        );
        let dir = std::env::temp_dir().join(format!("trellis-bf16-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        save(&model, &[], &dir, Some(&opt), WeightDtype::Bf16).unwrap();
        // What an engine loads: bf16 tensors, and a config that says so.
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(
            (&cfg["torch_dtype"], &cfg["dtype"]),
            (&"bfloat16".into(), &"bfloat16".into())
        );
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert!(
            st.tensors()
                .iter()
                .all(|(_, t)| t.dtype() == safetensors::Dtype::BF16)
        );
        let served = dir.join("model.safetensors").metadata().unwrap().len();
        // Resuming: the f32 weights, bit for bit.
        assert_eq!(Checkpoint::load(&dir).unwrap().model.params, model.params);
        // Without them (the folder copied for serving), the bf16 rounding of each weight.
        std::fs::remove_file(dir.join(MASTER)).unwrap();
        let rounded = Checkpoint::load(&dir).unwrap().model.params;
        for (a, b) in rounded.tensors.iter().zip(&model.params.tensors) {
            for (x, y) in a.data.iter().zip(&b.data) {
                assert_eq!(*x, half::bf16::from_f32(*y).to_f32());
            }
        }
        // Half the bytes of f32, and no master copy without the optimiser.
        save(&model, &[], &dir, None, WeightDtype::F32).unwrap();
        let full = dir.join("model.safetensors").metadata().unwrap().len();
        assert!(served * 2 < full + 4096, "{served} vs {full}");
        assert!(!dir.join(MASTER).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
