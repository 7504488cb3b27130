//! Named parameter tensors in Hugging Face naming, their layout per layer, seeded random
//! initialisation, and safetensors loading (f32/bf16/f16, single file or sharded, memory-mapped)
//! and saving.

use crate::config::{Arch, ModelConfig};
use crate::error::{Error, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// One named f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Hugging Face parameter name.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Storage,
}

/// A tensor's values: its own memory, or a read-only view of a memory-mapped file (a weight
/// snapshot another process on this host wrote into shared memory, used in place). A view is
/// copied into memory of its own the first time it is written (`DerefMut`), so a mapping is
/// never written through.
#[derive(Clone)]
pub enum Storage {
    Owned(Vec<f32>),
    Mapped {
        map: std::sync::Arc<memmap2::Mmap>,
        /// Byte offset of the first value in `map` (a multiple of 4).
        offset: usize,
        /// Number of values.
        len: usize,
    },
}

impl Storage {
    /// A view of `len` f32 values at byte `offset` of `map`; `None` when they do not fit or are
    /// not 4-byte aligned.
    pub fn mapped(map: std::sync::Arc<memmap2::Mmap>, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len.checked_mul(4)?)?;
        let aligned = (map.as_ptr() as usize + offset).is_multiple_of(std::mem::align_of::<f32>());
        (end <= map.len() && aligned).then_some(Storage::Mapped { map, offset, len })
    }

    /// The mapping this storage views, if it is a view.
    pub fn mapping(&self) -> Option<&std::sync::Arc<memmap2::Mmap>> {
        match self {
            Storage::Owned(_) => None,
            Storage::Mapped { map, .. } => Some(map),
        }
    }

    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        self
    }

    /// The values, writable (a view is copied out first).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self
    }

    /// The values as a vector of their own (copied out of a mapping).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Storage::Owned(v) => v,
            mapped => mapped.to_vec(),
        }
    }
}

impl Default for Storage {
    fn default() -> Self {
        Storage::Owned(Vec::new())
    }
}

impl From<Vec<f32>> for Storage {
    fn from(v: Vec<f32>) -> Self {
        Storage::Owned(v)
    }
}

impl std::ops::Deref for Storage {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Storage::Owned(v) => v,
            Storage::Mapped { map, offset, len } => {
                let bytes = &map[*offset..*offset + *len * 4];
                // SAFETY: `Storage::mapped` checked that the range lies in the mapping and is
                // 4-byte aligned; every bit pattern is a valid f32; the mapping is read-only
                // and kept alive by the Arc for as long as this borrow.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), *len) }
            }
        }
    }
}

impl std::ops::DerefMut for Storage {
    fn deref_mut(&mut self) -> &mut [f32] {
        if let Storage::Mapped { .. } = self {
            *self = Storage::Owned(self.to_vec());
        }
        match self {
            Storage::Owned(v) => v,
            Storage::Mapped { .. } => unreachable!("copied out just above"),
        }
    }
}

impl FromIterator<f32> for Storage {
    fn from_iter<I: IntoIterator<Item = f32>>(iter: I) -> Self {
        Storage::Owned(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a Storage {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl PartialEq for Storage {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
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

/// Every parameter of a model (or a gradient / optimiser moment with the same layout).
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// In layout order.
    pub tensors: Vec<Tensor>,
}

impl Layout {
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

impl Params {
    /// Zeros with the given specs.
    pub fn zeros(specs: &[(String, Vec<usize>)]) -> Self {
        let tensors = specs
            .iter()
            .map(|(name, shape)| Tensor {
                name: name.clone(),
                shape: shape.clone(),
                data: vec![0.0; shape.iter().product()].into(),
            })
            .collect();
        Self { tensors }
    }

    /// Zeros shaped like `self`.
    pub fn zeros_like(&self) -> Self {
        let tensors = self
            .tensors
            .iter()
            .map(|t| Tensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                data: vec![0.0; t.data.len()].into(),
            })
            .collect();
        Self { tensors }
    }

    /// Sets every value to zero.
    pub fn fill_zero(&mut self) {
        self.tensors.iter_mut().for_each(|t| t.data.fill(0.0));
    }

    /// Seeded random init as `transformers` does it: normal(0, std) for matrices, ones for
    /// norms, zeros for biases.
    pub fn init(specs: &[(String, Vec<usize>)], std: f32, seed: u64) -> Self {
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

    /// Total number of values.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }

    /// Loads every spec'd tensor from the checkpoint folder `dir` (`model.safetensors`, or the
    /// shards listed in `model.safetensors.index.json`), converting bf16/f16 to f32.
    pub fn load(dir: &Path, specs: &[(String, Vec<usize>)]) -> Result<Self> {
        let files = safetensors_files(dir)?;
        load_files(dir, &files, specs)
    }
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

impl Params {
    /// Writes all tensors as f32 into one safetensors file at `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.save_prefixed(path, "")
    }

    /// As [`Params::save`], with `prefix` before every name (optimiser moments use `m.`/`v.`).
    pub fn save_prefixed(&self, path: &Path, prefix: &str) -> Result<()> {
        let bytes: Vec<Vec<u8>> = self
            .tensors
            .iter()
            .map(|t| t.data.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let mut views = BTreeMap::new();
        for (t, b) in self.tensors.iter().zip(&bytes) {
            let view =
                TensorView::new(Dtype::F32, t.shape.clone(), b).map_err(|e| Error::BadTensor {
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
