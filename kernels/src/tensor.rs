//! Named f32 tensors in memory: [`Tensor`] (a name, a shape and values that are owned or a
//! read-only view of a memory-mapped file), [`TensorSet`] (every tensor of a model, or of its
//! gradients or optimiser moments, in one layout), and [`WeightSnapshot`] (a model's weights at
//! one version, as handed from a learner to rollout engines: in-process an `Arc`, no copy; or
//! left on an accelerator as [`DeviceWeights`], read to the host only when someone asks).
//! [`TensorSet::share`] hands out a model's values without copying them: the holder and the
//! owner then share each tensor's memory, and whichever writes first gets a copy of its own.
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

/// A tensor's values: its own memory, memory shared with other holders in this process, or a
/// read-only view of a memory-mapped file (a weight snapshot another process on this host wrote
/// into shared memory, used in place). Shared values and views are copied into memory of their
/// own the first time they are written (`DerefMut`) — shared values only while someone else
/// still holds them — so a holder never sees another's writes and a mapping is never written
/// through.
#[derive(Clone)]
pub enum Storage {
    Owned(Vec<f32>),
    /// Values held by several tensors of this process (a learner's weights and the engine
    /// serving them); cloning shares them.
    Shared(Arc<Vec<f32>>),
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
            Storage::Owned(_) | Storage::Shared(_) => None,
            Storage::Mapped { map, .. } => Some(map),
        }
    }

    /// Whether `self` and `other` are the same memory (one shared with the other, or views of
    /// the same bytes): a hand-over that copied nothing.
    pub fn same_memory(&self, other: &Storage) -> bool {
        let (a, b) = (self.as_slice(), other.as_slice());
        std::ptr::eq(a.as_ptr(), b.as_ptr()) && a.len() == b.len()
    }

    /// Values shared with the returned storage, without a copy: owned values move behind an
    /// `Arc` first; a view shares its mapping.
    pub fn share(&mut self) -> Storage {
        if let Storage::Owned(v) = self {
            *self = Storage::Shared(Arc::new(std::mem::take(v)));
        }
        self.clone()
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
            Storage::Shared(v) => Arc::unwrap_or_clone(v),
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
            Storage::Shared(v) => v,
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
        // Shared values are written in place once no one else holds them; else (and a view
        // always) copied first, into huge pages as the weights they usually are.
        let copy = match self {
            Storage::Owned(_) => false,
            Storage::Shared(v) => Arc::get_mut(v).is_none(),
            Storage::Mapped { .. } => true,
        };
        if copy {
            *self = Storage::Owned(crate::mem::huge_copy(self));
        }
        match self {
            Storage::Owned(v) => v,
            Storage::Shared(v) => Arc::get_mut(v).expect("held nowhere else").as_mut_slice(),
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

    /// The same tensors sharing `self`'s values, without a copy (see [`Storage::share`]):
    /// a snapshot of weights that keep training, the next write to each going to memory of its
    /// own while the snapshot is held.
    pub fn share(&mut self) -> TensorSet {
        let tensors = self
            .tensors
            .iter_mut()
            .map(|t| Tensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                data: t.data.share(),
            })
            .collect();
        TensorSet { tensors }
    }

    /// Total number of values.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
}

/// Weights an accelerator holds, handed from a learner to rollout engines of the same process
/// and device without passing through the host (the `pjrt` engines: a copy on the device the
/// learner's next step cannot overwrite). An engine on that device recognises its own kind
/// (through [`std::any::Any`]); anyone else reads them back with [`DeviceWeights::to_host`].
pub trait DeviceWeights: std::any::Any + Send + Sync + std::fmt::Debug {
    /// The weights, copied to the host.
    fn to_host(&self) -> Result<TensorSet, DeviceReadError>;
}

/// Reading weights back from a device failed.
#[derive(Debug, thiserror::Error)]
#[error("reading the weights back from the device: {0}")]
pub struct DeviceReadError(pub String);

/// Weights plus the version that produced them: on the host, or on a device with their host
/// copy read back the first time someone asks for it (and then shared by every clone).
#[derive(Clone, Debug)]
pub struct WeightSnapshot {
    /// Monotonic weight version: every generated token records the version that produced it.
    pub version: u64,
    /// The weights, in the model's layout and Hugging Face names (read back once when the
    /// snapshot was made on a device).
    host: Arc<std::sync::OnceLock<Arc<TensorSet>>>,
    device: Option<Arc<dyn DeviceWeights>>,
}

impl WeightSnapshot {
    /// `params` as version `version`.
    pub fn new(version: u64, params: Arc<TensorSet>) -> Self {
        Self {
            version,
            host: Arc::new(params.into()),
            device: None,
        }
    }

    /// Weights on a device as version `version`; their host copy is read when first asked for.
    pub fn on_device(version: u64, weights: Arc<dyn DeviceWeights>) -> Self {
        Self {
            version,
            host: Arc::default(),
            device: Some(weights),
        }
    }

    /// The weights on the host (read back from the device the first time, for every clone).
    pub fn params(&self) -> Result<&Arc<TensorSet>, DeviceReadError> {
        if let Some(p) = self.host.get() {
            return Ok(p);
        }
        let read = match &self.device {
            Some(d) => d.to_host()?,
            None => return Err(DeviceReadError("a snapshot with no weights".into())),
        };
        Ok(self.host.get_or_init(|| Arc::new(read)))
    }

    /// The weights on the host, taken out of the snapshot (no copy when no clone of it shares
    /// them).
    pub fn into_params(self) -> Result<Arc<TensorSet>, DeviceReadError> {
        self.params()?;
        let missing = || DeviceReadError("a snapshot with no weights".into());
        match Arc::try_unwrap(self.host) {
            Ok(cell) => cell.into_inner().ok_or_else(missing),
            Err(shared) => shared.get().cloned().ok_or_else(missing),
        }
    }

    /// The weights on a device, when the snapshot was made there.
    pub fn device(&self) -> Option<&Arc<dyn DeviceWeights>> {
        self.device.as_ref()
    }

    /// Whether the host copy exists (made on the host, or read back already).
    pub fn on_host(&self) -> bool {
        self.host.get().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(values: Vec<f32>) -> TensorSet {
        TensorSet {
            tensors: vec![Tensor {
                name: "w".into(),
                shape: vec![values.len()],
                data: values.into(),
            }],
        }
    }

    /// Weights "on a device" that count how often they are read back.
    #[derive(Debug)]
    struct Counted(std::sync::atomic::AtomicUsize, Vec<f32>);

    impl DeviceWeights for Counted {
        fn to_host(&self) -> Result<TensorSet, DeviceReadError> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(set(self.1.clone()))
        }
    }

    #[test]
    fn a_device_snapshot_is_read_to_the_host_once_for_every_clone_and_only_when_asked() {
        let device = Arc::new(Counted(Default::default(), vec![1.0, 2.0]));
        let snap = WeightSnapshot::on_device(3, device.clone());
        let (clone, other) = (snap.clone(), snap.clone());
        assert!(!snap.on_host());
        assert_eq!(device.0.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(**clone.params().unwrap(), set(vec![1.0, 2.0]));
        assert!(snap.on_host() && other.on_host());
        let first = Arc::as_ptr(snap.params().unwrap());
        assert_eq!(Arc::as_ptr(other.params().unwrap()), first);
        assert_eq!(device.0.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(snap.device().is_some() && other.version == 3);
        // The last holder takes the weights out without a copy; a host snapshot needs no read.
        drop((clone, other));
        assert_eq!(Arc::as_ptr(&snap.into_params().unwrap()), first);
        let host = WeightSnapshot::new(1, Arc::new(set(vec![5.0])));
        assert!(host.on_host() && host.device().is_none());
    }

    #[test]
    fn a_shared_set_copies_nothing_until_one_side_writes_while_the_other_holds_it() {
        let mut owner = set(vec![1.0, 2.0, 3.0]);
        let before = owner.tensors[0].data.as_ptr();
        let held = owner.share();
        assert_eq!(
            before,
            owner.tensors[0].data.as_ptr(),
            "moved behind the Arc, not copied"
        );
        assert!(held.tensors[0].data.same_memory(&owner.tensors[0].data));
        // A clone of the held set (an engine's Arc::unwrap_or_clone) still shares.
        let engine = held.clone();
        assert!(engine.tensors[0].data.same_memory(&owner.tensors[0].data));

        // The owner writes while both hold it: it gets a copy; the holders keep the old values.
        owner.tensors[0].data[0] = 10.0;
        assert!(!engine.tensors[0].data.same_memory(&owner.tensors[0].data));
        assert_eq!(&engine.tensors[0].data[..], &[1.0, 2.0, 3.0]);
        assert_eq!(&held.tensors[0].data[..], &[1.0, 2.0, 3.0]);
        assert_eq!(&owner.tensors[0].data[..], &[10.0, 2.0, 3.0]);

        // Shared again; once every holder let go, a write goes in place.
        let held = owner.share();
        let at = owner.tensors[0].data.as_ptr();
        drop(held);
        owner.tensors[0].data[1] = 20.0;
        assert_eq!(
            at,
            owner.tensors[0].data.as_ptr(),
            "no copy when no one else holds it"
        );
        assert_eq!(
            owner.tensors[0].data.clone().into_vec(),
            vec![10.0, 20.0, 3.0]
        );
    }
}
