//! Named f32 tensors in memory: [`Tensor`] (a name, a shape and values that are owned or a
//! read-only view of a memory-mapped file), [`TensorSet`] (every tensor of a model, or of its
//! gradients or optimiser moments, in one layout), and [`WeightSnapshot`] (a model's weights at
//! one version, as handed from a learner to rollout engines: in-process an `Arc`, no copy).
//!
//! Owns: the types every crate that moves tensors shares (the learner, the engines, the actor
//! runtime's data plane). Never: knows a model's layout or a file format (the learner does).

use std::sync::Arc;

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

/// Every tensor of a model (or a gradient / optimiser moment with the same layout), in layout
/// order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TensorSet {
    /// In layout order.
    pub tensors: Vec<Tensor>,
}

impl TensorSet {
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

    /// Total number of values.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
}

/// Weights plus the version that produced them.
#[derive(Clone, Debug)]
pub struct WeightSnapshot {
    /// Monotonic weight version: every generated token records the version that produced it.
    pub version: u64,
    /// The weights, in the model's layout and Hugging Face names.
    pub params: Arc<TensorSet>,
}
