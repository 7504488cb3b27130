//! The native training engine: the model's eager forward with its tape, backward into host
//! gradient buffers, AdamW on the host.

use super::TrainEngine;
use crate::error::{Error, Result};
use crate::model::{Batch, Model, Scores, Tape};
use crate::optim::{Optimizer, StepReport};
use crate::params::Params;

/// A model trained on the CPU kernels.
pub struct NativeTrainer {
    model: Model,
    grads: Params,
    tape: Option<Tape>,
}

impl NativeTrainer {
    /// Trains `model` in place.
    pub fn new(model: Model) -> Self {
        Self {
            grads: model.params.zeros_like(),
            model,
            tape: None,
        }
    }
}

impl TrainEngine for NativeTrainer {
    fn config(&self) -> &crate::ModelConfig {
        &self.model.config
    }

    fn score(&self, b: &Batch, temperature: f32) -> Result<Scores> {
        kernels::threads::inside(|| self.model.score(b, temperature))
    }

    fn forward(&mut self, b: &Batch, temperature: f32) -> Result<Scores> {
        let model = &self.model;
        let (scores, tape) = kernels::threads::inside(|| model.forward(b, temperature))?;
        self.tape = Some(tape);
        Ok(scores)
    }

    fn backward(&mut self, d_logp: &[f32], d_entropy: &[f32]) -> Result<()> {
        let tape = self
            .tape
            .take()
            .ok_or_else(|| Error::Batch("backward without a forward".into()))?;
        let (model, grads) = (&self.model, &mut self.grads);
        kernels::threads::inside(|| model.backward(tape, d_logp, d_entropy, grads));
        Ok(())
    }

    fn forward_backward(
        &mut self,
        b: &Batch,
        temperature: f32,
        d_logp: &[f32],
        d_entropy: &[f32],
    ) -> Result<Scores> {
        let scores = self.forward(b, temperature)?;
        self.backward(d_logp, d_entropy)?;
        Ok(scores)
    }

    fn gradients_mut(&mut self) -> Result<&mut Params> {
        Ok(&mut self.grads)
    }

    fn weights_mut(&mut self) -> Result<&mut Params> {
        Ok(&mut self.model.params)
    }

    fn step_range(&mut self, opt: &mut Optimizer, offset: usize, norm: f64) -> Result<StepReport> {
        let report = opt.step_range(&mut self.model.params, &mut self.grads, offset, norm)?;
        self.grads.fill_zero();
        Ok(report)
    }

    fn step(&mut self, opt: &mut Optimizer) -> Result<StepReport> {
        let (params, grads) = (&mut self.model.params, &mut self.grads);
        let report = kernels::threads::inside(|| {
            let report = opt.step(params, grads);
            grads.fill_zero();
            report
        });
        Ok(report)
    }

    fn model(&mut self) -> Result<&Model> {
        Ok(&self.model)
    }

    fn share_weights(&mut self) -> Result<Params> {
        Ok(self.model.params.share())
    }

    fn device_weights(
        &mut self,
    ) -> Result<Option<std::sync::Arc<dyn kernels::tensor::DeviceWeights>>> {
        Ok(None)
    }

    fn reset_optimizer(&mut self) {
        self.tape = None;
        self.grads.fill_zero();
    }

    fn sync_optimizer(&self, _opt: &mut Optimizer) -> Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        "cpu (native)".into()
    }
}
