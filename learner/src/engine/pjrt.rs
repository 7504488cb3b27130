//! The `pjrt` training engine: [`crate::pjrt::PjrtModel`] (forward, backward with gradients
//! summed on the device — across the client's devices when it has several — AdamW with
//! donated weights and moments) plus a host copy of the weights, refreshed from the device
//! when someone reads it after an update.

use super::TrainEngine;
use crate::error::{Error, Result};
use crate::model::{Batch, Model, Scores};
use crate::optim::{Optimizer, StepReport};
use crate::pjrt::PjrtModel;

/// A model trained on a PJRT device.
pub struct PjrtTrainer {
    device: PjrtModel,
    host: Model,
    /// The device's weights changed since `host` was read back.
    stale: bool,
    /// The batch and temperature of the last forward (the backward recomputes it).
    pending: Option<(Batch, f32)>,
}

impl PjrtTrainer {
    /// Copies `model`'s weights to the client's device.
    pub fn new(client: libtpu_sys::pjrt::Client, model: Model) -> Result<Self> {
        Ok(Self {
            device: PjrtModel::new(client, &model)?,
            host: model,
            stale: false,
            pending: None,
        })
    }
}

impl TrainEngine for PjrtTrainer {
    fn config(&self) -> &crate::ModelConfig {
        &self.host.config
    }

    fn score(&self, b: &Batch, temperature: f32) -> Result<Scores> {
        self.device.score(b, temperature)
    }

    fn forward(&mut self, b: &Batch, temperature: f32) -> Result<Scores> {
        let scores = self.device.score(b, temperature)?;
        self.pending = Some((b.clone(), temperature));
        Ok(scores)
    }

    fn backward(&mut self, d_logp: &[f32], d_entropy: &[f32]) -> Result<()> {
        let (b, temperature) = self
            .pending
            .take()
            .ok_or_else(|| Error::Batch("backward without a forward".into()))?;
        // The device recomputes the forward it needs for the backward.
        self.device.backward(&b, temperature, d_logp, d_entropy)?;
        Ok(())
    }

    fn forward_backward(
        &mut self,
        b: &Batch,
        temperature: f32,
        d_logp: &[f32],
        d_entropy: &[f32],
    ) -> Result<Scores> {
        self.pending = None;
        self.device.backward(b, temperature, d_logp, d_entropy)
    }

    fn gradients_mut(&mut self) -> Result<&mut crate::Params> {
        Err(Error::Device(
            "the pjrt engine keeps its gradients on the device: its data parallelism is over the devices of its client (pools.learner.count), summed there, not over ranks".into(),
        ))
    }

    fn weights_mut(&mut self) -> Result<&mut crate::Params> {
        Err(Error::Device(
            "the pjrt engine keeps its weights on the device: ZeRO-1 over pjrt ranks is not built"
                .into(),
        ))
    }

    fn step_range(&mut self, _: &mut Optimizer, _: usize, _: f64) -> Result<StepReport> {
        Err(Error::Device(
            "the pjrt engine steps its whole model on the device: ZeRO-1 over pjrt ranks is not built".into(),
        ))
    }

    fn step(&mut self, opt: &mut Optimizer) -> Result<StepReport> {
        let report = self.device.step(opt)?;
        self.stale = true;
        Ok(report)
    }

    fn model(&mut self) -> Result<&Model> {
        if self.stale {
            self.device.read_params(&mut self.host.params)?;
            self.stale = false;
        }
        Ok(&self.host)
    }

    fn share_weights(&mut self) -> Result<crate::Params> {
        self.model()?;
        Ok(self.host.params.share())
    }

    fn device_weights(
        &mut self,
    ) -> Result<Option<std::sync::Arc<dyn kernels::tensor::DeviceWeights>>> {
        // The host copy stays stale: read only when a checkpoint or a host reader asks.
        Ok(Some(std::sync::Arc::new(self.device.copy_params()?)))
    }

    fn reset_optimizer(&mut self) {
        self.pending = None;
        self.device.reset_optimizer();
        self.device.zero_grads();
    }

    fn sync_optimizer(&self, opt: &mut Optimizer) -> Result<()> {
        self.device.sync_optimizer(opt)
    }

    fn describe(&self) -> String {
        let (platform, client) = (self.device.platform(), self.device.client_serial());
        match self.device.devices() {
            1 => format!("{platform} (pjrt client {client})"),
            n => format!("{platform} (pjrt client {client}), data-parallel on {n} devices"),
        }
    }
}
