//! A model's parameters: their layout per layer in Hugging Face naming, seeded random
//! initialisation, and safetensors loading (f32/bf16/f16, single file or sharded, memory-mapped)
//! and saving ([`ParamsIo`]). The tensor types themselves are `kernels::tensor`'s, shared with
//! the engines and the actor runtime.

use crate::config::{Arch, ModelConfig};
use crate::error::{Error, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub use kernels::tensor::{Storage, Tensor};

/// Every parameter of a model (or a gradient / optimiser moment with the same layout).
pub type Params = kernels::tensor::TensorSet;

/// The number format weights are written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// 32-bit floats: exactly what trains.
    #[default]
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    /// bfloat16, rounded to nearest even: half the bytes, what serving engines load.
    #[serde(alias = "bfloat16")]
    Bf16,
}

impl WeightDtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }

    /// The name in a Hugging Face `config.json` (`torch_dtype`, `dtype`).
    pub fn hf_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }
}

/// Seeded initialisation and safetensors files of [`Params`].
pub trait ParamsIo: Sized {
    /// Seeded random init as `transformers` does it: normal(0, std) for matrices, ones for
    /// norms, zeros for biases.
    fn init(specs: &[(String, Vec<usize>)], std: f32, seed: u64) -> Self;

    /// Loads every spec'd tensor from the checkpoint folder `dir` (`model.safetensors`, or the
    /// shards listed in `model.safetensors.index.json`), converting bf16/f16 to f32.
    fn load(dir: &Path, specs: &[(String, Vec<usize>)]) -> Result<Self>;

    /// Writes all tensors as `dtype` into the checkpoint folder `dir`: `model.safetensors`, or,
    /// past `max_shard_bytes`, shards `model-0000i-of-0000n.safetensors` with the
    /// `model.safetensors.index.json` that lists them (as transformers' `save_pretrained`).
    /// Returns the files written.
    fn save_sharded(
        &self,
        dir: &Path,
        max_shard_bytes: u64,
        dtype: WeightDtype,
    ) -> Result<Vec<PathBuf>>;

    /// Writes all tensors as f32 into one safetensors file at `path`.
    fn save(&self, path: &Path) -> Result<()> {
        self.save_prefixed(path, "")
    }

    /// As [`ParamsIo::save`], with `prefix` before every name.
    fn save_prefixed(&self, path: &Path, prefix: &str) -> Result<()>;
}

/// Indices into [`Params::tensors`] for one decoder layer.
#[derive(Clone, Debug)]
pub struct LayerIds {
    pub ln1: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub q_bias: Option<usize>,
    pub k_bias: Option<usize>,
    pub v_bias: Option<usize>,
    pub o_bias: Option<usize>,
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    pub ln2: usize,
    pub gate: usize,
    pub up: usize,
    pub down: usize,
}

/// Where each role's tensor sits in [`Params::tensors`].
#[derive(Clone, Debug)]
pub struct Layout {
    pub embed: usize,
    pub layers: Vec<LayerIds>,
    pub norm: usize,
    /// `None` when the head is tied to the embedding.
    pub lm_head: Option<usize>,
}

impl Layout {
    /// The tensors used only as the right side of matrix products: every layer's projections
    /// and an untied head (a tied head is also the embedding table, which is looked up). A
    /// model served in bf16 reads these only rounded to bf16.
    pub fn products(&self) -> Vec<usize> {
        let mut ids: Vec<usize> = self
            .layers
            .iter()
            .flat_map(|l| [l.q, l.k, l.v, l.o, l.gate, l.up, l.down])
            .collect();
        ids.extend(self.lm_head);
        ids
    }

    /// The layout and the (name, shape) of every tensor, in order, for `c`.
    pub fn new(c: &ModelConfig) -> (Layout, Vec<(String, Vec<usize>)>) {
        let mut specs: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |name: String, shape: Vec<usize>| {
            specs.push((name, shape));
            specs.len() - 1
        };
        let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (q, kv) = (c.num_heads * d, c.num_kv_heads * d);
        let embed = add("model.embed_tokens.weight".into(), vec![c.vocab_size, h]);
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let ln1 = add(format!("{p}.input_layernorm.weight"), vec![h]);
            let qw = add(format!("{p}.self_attn.q_proj.weight"), vec![q, h]);
            let kw = add(format!("{p}.self_attn.k_proj.weight"), vec![kv, h]);
            let vw = add(format!("{p}.self_attn.v_proj.weight"), vec![kv, h]);
            let (q_bias, k_bias, v_bias) = if c.qkv_bias {
                (
                    Some(add(format!("{p}.self_attn.q_proj.bias"), vec![q])),
                    Some(add(format!("{p}.self_attn.k_proj.bias"), vec![kv])),
                    Some(add(format!("{p}.self_attn.v_proj.bias"), vec![kv])),
                )
            } else {
                (None, None, None)
            };
            let o = add(format!("{p}.self_attn.o_proj.weight"), vec![h, q]);
            let o_bias = c
                .o_bias
                .then(|| add(format!("{p}.self_attn.o_proj.bias"), vec![h]));
            let (q_norm, k_norm) = if c.arch == Arch::Qwen3 {
                (
                    Some(add(format!("{p}.self_attn.q_norm.weight"), vec![d])),
                    Some(add(format!("{p}.self_attn.k_norm.weight"), vec![d])),
                )
            } else {
                (None, None)
            };
            let ln2 = add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
            let gate = add(format!("{p}.mlp.gate_proj.weight"), vec![i, h]);
            let up = add(format!("{p}.mlp.up_proj.weight"), vec![i, h]);
            let down = add(format!("{p}.mlp.down_proj.weight"), vec![h, i]);
            layers.push(LayerIds {
                ln1,
                q: qw,
                k: kw,
                v: vw,
                o,
                q_bias,
                k_bias,
                v_bias,
                o_bias,
                q_norm,
                k_norm,
                ln2,
                gate,
                up,
                down,
            });
        }
        let norm = add("model.norm.weight".into(), vec![h]);
        let lm_head =
            (!c.tie_word_embeddings).then(|| add("lm_head.weight".into(), vec![c.vocab_size, h]));
        (
            Layout {
                embed,
                layers,
                norm,
                lm_head,
            },
            specs,
        )
    }
}

fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

impl ParamsIo for Params {
    fn init(specs: &[(String, Vec<usize>)], std: f32, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut p = Self::zeros(specs);
        for t in &mut p.tensors {
            if is_norm(&t.name) {
                t.data.fill(1.0);
            } else if !t.name.ends_with(".bias") {
                crate::rng::fill_normal(&mut rng, &mut t.data, std);
            }
        }
        p
    }

    fn load(dir: &Path, specs: &[(String, Vec<usize>)]) -> Result<Self> {
        let files = safetensors_files(dir)?;
        load_files(dir, &files, specs)
    }

    fn save_sharded(
        &self,
        dir: &Path,
        max_shard_bytes: u64,
        dtype: WeightDtype,
    ) -> Result<Vec<PathBuf>> {
        // Tensors in order, a new shard when the next one would pass the limit (a tensor
        // larger than the limit gets a shard of its own).
        let mut shards: Vec<Vec<&Tensor>> = vec![Vec::new()];
        let mut size = 0u64;
        for t in &self.tensors {
            let bytes = dtype.bytes() * t.data.len() as u64;
            let last = shards.last().map_or(0, Vec::len);
            if last > 0 && size + bytes > max_shard_bytes {
                shards.push(Vec::new());
                size = 0;
            }
            size += bytes;
            if let Some(s) = shards.last_mut() {
                s.push(t);
            }
        }
        if shards.len() == 1 {
            let path = dir.join("model.safetensors");
            write_tensors(&path, &shards[0], "", dtype)?;
            return Ok(vec![path]);
        }
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        let mut files = Vec::with_capacity(n + 1);
        for (i, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let path = dir.join(&name);
            write_tensors(&path, shard, "", dtype)?;
            for t in shard {
                weight_map.insert(t.name.clone(), name.clone().into());
            }
            files.push(path);
        }
        let total: u64 = self
            .tensors
            .iter()
            .map(|t| dtype.bytes() * t.data.len() as u64)
            .sum();
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = dir.join("model.safetensors.index.json");
        let text = serde_json::to_string_pretty(&index).unwrap_or_default();
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        files.push(path);
        Ok(files)
    }

    fn save_prefixed(&self, path: &Path, prefix: &str) -> Result<()> {
        let all: Vec<&Tensor> = self.tensors.iter().collect();
        write_tensors(path, &all, prefix, WeightDtype::F32)
    }
}

/// Writes `tensors` as `dtype`, each named `prefix` + its name, into the safetensors file `path`.
fn write_tensors(path: &Path, tensors: &[&Tensor], prefix: &str, dtype: WeightDtype) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| match dtype {
            WeightDtype::F32 => t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            WeightDtype::Bf16 => t
                .data
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
        })
        .collect();
    let st = match dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::Bf16 => Dtype::BF16,
    };
    let mut views = BTreeMap::new();
    for (t, b) in tensors.iter().zip(&bytes) {
        let view = TensorView::new(st, t.shape.clone(), b).map_err(|e| Error::BadTensor {
            path: path.to_path_buf(),
            name: t.name.clone(),
            msg: e.to_string(),
        })?;
        views.insert(format!("{prefix}{}", t.name), view);
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::serialize_to_file(views, Some(meta), path).map_err(|e| Error::Safetensors {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

/// Loads `specs` from one safetensors file.
pub fn load_file(path: &Path, specs: &[(String, Vec<usize>)]) -> Result<Params> {
    load_files(path, &[path.to_path_buf()], specs)
}

fn load_files(origin: &Path, files: &[PathBuf], specs: &[(String, Vec<usize>)]) -> Result<Params> {
    let mut maps = Vec::with_capacity(files.len());
    for f in files {
        let file = std::fs::File::open(f).map_err(|e| Error::io(f, e))?;
        // SAFETY: the file is opened read-only; a concurrent writer truncating it is the
        // user's error and surfaces as a parse failure or SIGBUS, as with any mmap reader.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(f, e))?;
        maps.push(mmap);
    }
    let mut parsed = Vec::with_capacity(files.len());
    let mut owner: HashMap<String, usize> = HashMap::new();
    for (i, (f, m)) in files.iter().zip(&maps).enumerate() {
        let st = SafeTensors::deserialize(m).map_err(|e| Error::Safetensors {
            path: f.clone(),
            msg: e.to_string(),
        })?;
        for name in st.names() {
            owner.insert(name.to_string(), i);
        }
        parsed.push(st);
    }
    let mut tensors = Vec::with_capacity(specs.len());
    for (name, shape) in specs {
        let i = *owner.get(name).ok_or_else(|| Error::MissingTensor {
            path: origin.to_path_buf(),
            name: name.clone(),
        })?;
        let path = &files[i];
        let view = parsed[i].tensor(name).map_err(|e| Error::BadTensor {
            path: path.clone(),
            name: name.clone(),
            msg: e.to_string(),
        })?;
        if view.shape() != shape.as_slice() {
            return Err(Error::BadTensor {
                path: path.clone(),
                name: name.clone(),
                msg: format!(
                    "shape {:?} on disk, the config needs {:?}",
                    view.shape(),
                    shape
                ),
            });
        }
        let data = to_f32(view.dtype(), view.data()).ok_or_else(|| Error::BadTensor {
            path: path.clone(),
            name: name.clone(),
            msg: format!(
                "dtype {:?} is not supported (f32, bf16, f16 are)",
                view.dtype()
            ),
        })?;
        tensors.push(Tensor {
            name: name.clone(),
            shape: shape.clone(),
            data: data.into(),
        });
    }
    Ok(Params { tensors })
}

/// The safetensors files of a checkpoint folder.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Safetensors {
            path: index.clone(),
            msg: format!("invalid JSON: {e}"),
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Safetensors {
                path: index.clone(),
                msg: "missing `weight_map` object".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::io(
        &single,
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no model.safetensors or model.safetensors.index.json in the folder",
        ),
    ))
}

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_view_reads_in_place_and_copies_out_before_a_write() {
        let path = std::env::temp_dir().join(format!("trellis-storage-{}", std::process::id()));
        let values: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the test owns the file and never writes it while mapped.
        let map = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&file) }.unwrap());
        let mut view = Storage::mapped(map.clone(), 8, 4).expect("in range and aligned");
        assert_eq!(&*view, &values[2..6]);
        assert!(view.mapping().is_some());
        let shared = view.clone();
        view[0] = 7.0;
        assert!(view.mapping().is_none(), "written: now a copy of its own");
        assert_eq!(&*view, &[7.0, 1.5, 2.0, 2.5]);
        assert_eq!(
            &*shared,
            &values[2..6],
            "the mapping is never written through"
        );
        assert_eq!(shared.clone().into_vec(), values[2..6].to_vec());
        assert!(Storage::mapped(map.clone(), 8, 7).is_none(), "past the end");
        assert!(Storage::mapped(map.clone(), 2, 1).is_none(), "misaligned");
        assert_eq!(
            Storage::from(values.clone()),
            Storage::mapped(map, 0, 8).unwrap()
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn bf16_and_f16_convert() {
        let v = half::bf16::from_f32(1.5).to_le_bytes();
        assert_eq!(to_f32(Dtype::BF16, &v), Some(vec![1.5]));
        let v = half::f16::from_f32(-0.25).to_le_bytes();
        assert_eq!(to_f32(Dtype::F16, &v), Some(vec![-0.25]));
        assert_eq!(to_f32(Dtype::I8, &[1]), None);
    }
}
