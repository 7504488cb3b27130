//! Where a model trains: the [`TrainEngine`] interface, with the native engine (the CPU
//! kernels, [`native`]) and the `pjrt` engine (a PJRT device, [`pjrt`]) behind it, and
//! [`open`], the one place that chooses between them.
//!
//! Owns: forward with what a backward needs, backward into summed gradients, the optimiser
//! step on those gradients, and the host copy of the weights. Never: decides what to train on,
//! how rows are laid out or how a loss is aggregated ([`crate::algo`] does), or how an update
//! is decided (schedule, clipping and skipping are [`crate::optim::Optimizer::plan`] for every
//! engine).

pub mod native;
pub mod pjrt;

use crate::error::Result;
use crate::model::{Batch, Model, Scores};
use crate::optim::{Optimizer, StepReport};

/// A model being trained. Gradients are summed over [`TrainEngine::backward`] calls until
/// [`TrainEngine::step`] applies and clears them.
pub trait TrainEngine: Send + Sync {
    /// The model's configuration.
    fn config(&self) -> &crate::ModelConfig;

    /// Log-probs of `b.targets` and entropies under logits / `temperature`, keeping nothing.
    fn score(&self, b: &Batch, temperature: f32) -> Result<Scores>;

    /// As [`TrainEngine::score`], keeping what the next [`TrainEngine::backward`] needs.
    fn forward(&mut self, b: &Batch, temperature: f32) -> Result<Scores>;

    /// Adds the gradient of `Σ d_logp·logp + d_entropy·entropy` over the positions of the last
    /// [`TrainEngine::forward`]'s batch.
    fn backward(&mut self, d_logp: &[f32], d_entropy: &[f32]) -> Result<()>;

    /// Forward and backward of a loss whose gradient does not depend on the scores (SFT's
    /// negative log-likelihood): one pass on engines that recompute their forward. Returns the
    /// forward's scores.
    fn forward_backward(
        &mut self,
        b: &Batch,
        temperature: f32,
        d_logp: &[f32],
        d_entropy: &[f32],
    ) -> Result<Scores>;

    /// The summed gradients on the host, to be added across data-parallel ranks before
    /// [`TrainEngine::step`]. The `pjrt` engine keeps them on its device and refuses: ranks of
    /// device engines reduce with the device's collectives.
    fn gradients_mut(&mut self) -> Result<&mut crate::Params>;

    /// The weights on the host, to write (a ZeRO-1 rank takes the other ranks' updated shards).
    /// The `pjrt` engine keeps them on its device and refuses.
    fn weights_mut(&mut self) -> Result<&mut crate::Params>;

    /// Applies the summed gradients of the values `offset..offset + opt.moment_len()` with `opt`
    /// (a ZeRO-1 shard's optimiser), given the whole gradient's global norm; clears the
    /// gradients. The `pjrt` engine refuses.
    fn step_range(&mut self, opt: &mut Optimizer, offset: usize, norm: f64) -> Result<StepReport>;

    /// Applies the summed gradients with `opt` (its plan decides rate, clipping and skipping)
    /// and clears them.
    fn step(&mut self, opt: &mut Optimizer) -> Result<StepReport>;

    /// The weights, on the host (a device engine copies them back when they changed).
    fn model(&mut self) -> Result<&Model>;

    /// The host weights as tensors sharing their memory, not a copy
    /// ([`kernels::tensor::TensorSet::share`]): a rollout engine in this process serves them as
    /// they are, and the engine's next step writes to memory of its own while they are held.
    fn share_weights(&mut self) -> Result<crate::Params>;

    /// A copy of the weights on the engine's device, for a rollout engine on that device to
    /// serve without the host ([`kernels::tensor::WeightSnapshot::on_device`]); `None` from an
    /// engine whose weights live on the host (use [`TrainEngine::share_weights`]).
    fn device_weights(
        &mut self,
    ) -> Result<Option<std::sync::Arc<dyn kernels::tensor::DeviceWeights>>>;

    /// Starts a new optimiser: drops summed gradients and any moments the engine keeps, so the
    /// next step starts from the host optimiser's state.
    fn reset_optimizer(&mut self);

    /// Copies moments the engine keeps elsewhere into `opt` (before it is saved).
    fn sync_optimizer(&self, opt: &mut Optimizer) -> Result<()>;

    /// Where it runs, for logs (`cpu (native)`, or the PJRT platform).
    fn describe(&self) -> String;
}

/// Which engine trains the model.
pub enum Backend {
    /// The CPU kernels of this build.
    Native,
    /// A PJRT device, through a client of its plugin.
    Pjrt(libtpu_sys::pjrt::Client),
}

/// The engine for `backend`, starting from `model`'s weights.
pub fn open(model: Model, backend: Backend) -> Result<Box<dyn TrainEngine>> {
    Ok(match backend {
        Backend::Native => Box::new(native::NativeTrainer::new(model)),
        Backend::Pjrt(client) => Box::new(pjrt::PjrtTrainer::new(client, model)?),
    })
}
