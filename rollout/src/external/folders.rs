//! Weight folders: a weight push to an external engine is a **new folder per version**
//! (`ROOT/v00000012/`: `config.json` + one `model.safetensors`), written once and reloaded by
//! every engine that can see `ROOT`: reusing a folder can serve stale weights. A tied model's
//! folder still holds `lm_head.weight` (a copy of the embedding), because a real vLLM given a
//! tied folder serves a model that is neither the old nor the new one (see
//! `docs/engines.md`).
//!
//! Owns: the folder layout and its cleanup. Never: decides when to push (the pool does).

use crate::EngineError;
use kernels::tensor::WeightSnapshot;
use learner::ModelConfig;
use learner::ParamsIo;
use learner::params::{Params, Tensor, WeightDtype};
use std::path::{Path, PathBuf};

/// Versioned weight folders under one root that the engines can read.
#[derive(Clone, Debug)]
pub struct WeightFolders {
    root: PathBuf,
    dtype: WeightDtype,
}

impl WeightFolders {
    /// Folders under `root` (made on first write), weights in f32.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            dtype: WeightDtype::F32,
        }
    }

    /// The same folders with weights written as `dtype` (bf16: half the bytes to write and
    /// reload; `config.json` says which).
    pub fn with_dtype(mut self, dtype: WeightDtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// The number format the weights are written in.
    pub fn dtype(&self) -> WeightDtype {
        self.dtype
    }

    /// The folder of `version`.
    pub fn dir(&self, version: u64) -> PathBuf {
        self.root.join(format!("v{version:08}"))
    }

    /// Writes `snapshot` as a checkpoint folder of `config` (atomically: a temporary folder
    /// renamed into place) and removes the folders of versions before the previous one, which
    /// no engine reloads any more. Returns the folder.
    pub fn write(
        &self,
        snapshot: &WeightSnapshot,
        config: &ModelConfig,
    ) -> Result<PathBuf, EngineError> {
        let io = |p: &Path, e: std::io::Error| {
            EngineError::BadWeights(format!("cannot write {}: {e}", p.display()))
        };
        let dir = self.dir(snapshot.version);
        if dir.is_dir() {
            return Ok(dir);
        }
        let tmp = self.root.join(format!(".v{:08}.tmp", snapshot.version));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
        let cfg = tmp.join("config.json");
        let mut hf = config.to_hf_json();
        if let Some(obj) = hf.as_object_mut() {
            for key in ["torch_dtype", "dtype"] {
                obj.insert(key.into(), self.dtype.hf_name().into());
            }
        }
        let text = serde_json::to_string_pretty(&hf).expect("JSON serialises");
        std::fs::write(&cfg, text).map_err(|e| io(&cfg, e))?;
        let params = snapshot
            .params()
            .map_err(|e| EngineError::BadWeights(e.to_string()))?;
        let saved = if config.tie_word_embeddings {
            with_explicit_head(params)
        } else {
            None
        };
        saved
            .as_ref()
            .unwrap_or(params)
            .save_sharded(&tmp, u64::MAX, self.dtype)
            .map_err(|e| EngineError::BadWeights(e.to_string()))?;
        std::fs::rename(&tmp, &dir).map_err(|e| io(&dir, e))?;
        self.prune(snapshot.version);
        Ok(dir)
    }

    fn prune(&self, version: u64) {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(v) = name
                .to_str()
                .and_then(|n| n.strip_prefix('v'))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            if v + 1 < version {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Writes `snapshot`'s folder for an adapter's own `InferenceEngine::update_weights` (the pool
/// writes once for all its engines instead); an adapter without folders set says so.
pub(crate) fn write_folder(
    folders: Option<&(WeightFolders, ModelConfig)>,
    url: &str,
    snapshot: &WeightSnapshot,
) -> Result<PathBuf, EngineError> {
    let (folders, config) = folders.ok_or_else(|| {
        EngineError::BadWeights(format!(
            "{url}: no weight folder root set (with_weight_folders)"
        ))
    })?;
    folders.write(snapshot, config)
}

/// The parameters plus `lm_head.weight` = the embedding, for a tied model.
fn with_explicit_head(params: &Params) -> Option<Params> {
    if params.tensors.iter().any(|t| t.name == "lm_head.weight") {
        return None;
    }
    let embed = params
        .tensors
        .iter()
        .find(|t| t.name == "model.embed_tokens.weight")?;
    let mut out = params.clone();
    out.tensors.push(Tensor {
        name: "lm_head.weight".into(),
        ..embed.clone()
    });
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_new_per_version_hold_an_explicit_head_and_old_ones_go() {
        let cfg = serde_json::json!({"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 32, "tie_word_embeddings": true});
        let cfg = ModelConfig::from_json(cfg, Path::new("t")).unwrap();
        let model = learner::Model::init(cfg.clone(), 1);
        let root = std::env::temp_dir().join(format!("trellis-folders-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let folders = WeightFolders::new(&root);
        for v in 1..=4u64 {
            let snap = WeightSnapshot::new(v, std::sync::Arc::new(model.params.clone()));
            let dir = folders.write(&snap, &cfg).unwrap();
            assert_eq!(dir, root.join(format!("v{v:08}")));
        }
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["v00000003", "v00000004"]);
        let head = learner::params::load_file(
            &root.join("v00000004/model.safetensors"),
            &[("lm_head.weight".into(), vec![16, 8])],
        )
        .unwrap();
        assert_eq!(head.tensors[0].data, model.params.tensors[0].data);
        // The folder opens as a checkpoint of the same model.
        let back = learner::checkpoint::Checkpoint::load(&root.join("v00000004")).unwrap();
        assert_eq!(back.model.params, model.params);
        let _ = std::fs::remove_dir_all(&root);
    }
}
