//! `WeightSnapshot`: a learner's weights at one version, as handed to rollout engines.
//! In-process it is an `Arc` (no copy on the way); transports serialise it elsewhere.

use crate::params::Params;
use std::sync::Arc;

/// Named tensors plus the version that produced them.
#[derive(Clone, Debug)]
pub struct WeightSnapshot {
    /// Monotonic weight version: every generated token records the version that produced it.
    pub version: u64,
    /// The weights, in the model's layout and Hugging Face names.
    pub params: Arc<Params>,
}
