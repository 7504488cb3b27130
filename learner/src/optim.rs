//! The optimiser around the AdamW kernel: learning-rate schedules with warmup, global-norm
//! gradient clipping, skipping steps whose gradient norm is not finite, and its state on disk.

use crate::error::{Error, Result};
use crate::params::Params;
use crate::params::ParamsIo;
use kernels::optim::{AdamW, clip_factor, global_norm, scale};
use std::path::Path;

/// Shape of the learning-rate curve after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ScheduleKind {
    /// Flat at the base rate.
    Constant,
    /// Cosine decay from the base rate to `min_lr_ratio · base` at `total_steps`.
    Cosine,
}

/// Learning rate per optimiser call, as `transformers`' schedules with warmup define it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub base_lr: f32,
    /// Linear warmup from 0 over this many calls.
    pub warmup_steps: u64,
    /// Length of the whole run (cosine only).
    pub total_steps: u64,
    /// Constant or cosine.
    pub kind: ScheduleKind,
    /// Floor of the cosine, as a fraction of `base_lr`.
    pub min_lr_ratio: f32,
}

impl LrSchedule {
    /// A constant rate without warmup.
    pub fn constant(lr: f32) -> Self {
        Self {
            base_lr: lr,
            warmup_steps: 0,
            total_steps: 0,
            kind: ScheduleKind::Constant,
            min_lr_ratio: 0.0,
        }
    }

    /// The rate at call `step` (counting from 0).
    pub fn lr(&self, step: u64) -> f32 {
        if step < self.warmup_steps {
            return self.base_lr * step as f32 / self.warmup_steps.max(1) as f32;
        }
        match self.kind {
            ScheduleKind::Constant => self.base_lr,
            ScheduleKind::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
                let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                self.base_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos as f32)
            }
        }
    }
}

/// What one optimiser call did.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepReport {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f32,
    /// True when the norm was not finite and the update was skipped.
    pub skipped: bool,
}

/// One update to apply, as [`Optimizer::plan`] decided it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// AdamW at this call's learning rate.
    pub hparams: AdamW,
    /// Updates applied so far, this one included (bias correction).
    pub step: u64,
    /// Factor the gradient is scaled by (1: not clipped).
    pub clip: f32,
}

/// AdamW with its moments, schedule and clipping.
#[derive(Clone, Debug)]
pub struct Optimizer {
    /// β₁, β₂, ε and weight decay (the `lr` field is overwritten by the schedule).
    pub hparams: AdamW,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Clip the global gradient norm to this (None: no clipping).
    pub grad_clip: Option<f64>,
    /// Optimiser calls so far (indexes the schedule).
    pub calls: u64,
    /// Updates actually applied (AdamW's bias correction counts these).
    pub applied: u64,
    m: Params,
    v: Params,
}

impl Optimizer {
    /// Fresh state for parameters shaped like `params`.
    pub fn new(
        params: &Params,
        hparams: AdamW,
        schedule: LrSchedule,
        grad_clip: Option<f64>,
    ) -> Self {
        Self {
            hparams,
            schedule,
            grad_clip,
            calls: 0,
            applied: 0,
            m: params.zeros_like(),
            v: params.zeros_like(),
        }
    }

    /// Applies `grads` to `params`: clip, skip if not finite, AdamW at the scheduled rate.
    /// Leaves `grads` clipped; the caller zeroes them for the next step.
    pub fn step(&mut self, params: &mut Params, grads: &mut Params) -> StepReport {
        let norm = global_norm(grads.tensors.iter().map(|t| t.data.as_slice()));
        let (report, plan) = self.plan(norm);
        let Some(plan) = plan else { return report };
        if plan.clip < 1.0 {
            grads
                .tensors
                .iter_mut()
                .for_each(|t| scale(&mut t.data, plan.clip));
        }
        for (((p, g), m), v) in params
            .tensors
            .iter_mut()
            .zip(&grads.tensors)
            .zip(&mut self.m.tensors)
            .zip(&mut self.v.tensors)
        {
            plan.hparams
                .update(plan.step, &mut p.data, &g.data, &mut m.data, &mut v.data);
        }
        report
    }

    /// The optimiser of one ZeRO-1 shard: the values `offset..offset + len` of a model laid out
    /// flat in layout order ([`crate::wire::flatten`]); its moments cover that range only.
    pub fn for_range(
        len: usize,
        hparams: AdamW,
        schedule: LrSchedule,
        grad_clip: Option<f64>,
    ) -> Self {
        let shard = Params::zeros(&[("shard".to_string(), vec![len])]);
        Self::new(&shard, hparams, schedule, grad_clip)
    }

    /// Values each moment holds (the model's, or a shard's).
    pub fn moment_len(&self) -> usize {
        self.m.numel()
    }

    /// [`Optimizer::step`] on the values `offset..offset + self.moment_len()` of `params` and
    /// `grads` only (an optimiser of [`Optimizer::for_range`]), given the global norm `norm` of
    /// the whole gradient (which no one rank of a ZeRO-1 group holds): the same clip, rate and
    /// skip as the whole step, and the same new values in that range.
    pub fn step_range(
        &mut self,
        params: &mut Params,
        grads: &mut Params,
        offset: usize,
        norm: f64,
    ) -> Result<StepReport> {
        let len = self.moment_len();
        if offset + len > params.numel() || params.numel() != grads.numel() {
            return Err(Error::Ranks(format!(
                "a shard of values {offset}..{} of a model of {}",
                offset + len,
                params.numel()
            )));
        }
        let (report, plan) = self.plan(norm);
        let Some(plan) = plan else { return Ok(report) };
        let (m, v) = (&mut self.m.tensors[0].data, &mut self.v.tensors[0].data);
        let mut at = 0;
        for (p, g) in params.tensors.iter_mut().zip(&mut grads.tensors) {
            let n = p.data.len();
            let (lo, hi) = (offset.max(at), (offset + len).min(at + n));
            if lo < hi {
                let g = &mut g.data[lo - at..hi - at];
                if plan.clip < 1.0 {
                    scale(g, plan.clip);
                }
                plan.hparams.update(
                    plan.step,
                    &mut p.data[lo - at..hi - at],
                    g,
                    &mut m[lo - offset..hi - offset],
                    &mut v[lo - offset..hi - offset],
                );
            }
            at += n;
        }
        Ok(report)
    }

    /// The decision of one optimiser call for a gradient of global norm `norm`, for engines
    /// that apply the update themselves (the `pjrt` engine, on the device): advances the
    /// counters and returns what to apply, or `None` when the update is skipped.
    pub fn plan(&mut self, norm: f64) -> (StepReport, Option<Plan>) {
        let lr = self.schedule.lr(self.calls);
        self.calls += 1;
        let mut report = StepReport {
            grad_norm: norm,
            lr,
            skipped: !norm.is_finite(),
        };
        if report.skipped {
            return (report, None);
        }
        let clip = self.grad_clip.map_or(1.0, |max| clip_factor(norm, max));
        self.applied += 1;
        report.skipped = false;
        let plan = Plan {
            hparams: AdamW { lr, ..self.hparams },
            step: self.applied,
            clip,
        };
        (report, Some(plan))
    }

    /// The first and second moments (same layout as the parameters), for engines that keep
    /// them elsewhere between saves.
    pub fn moments_mut(&mut self) -> (&mut Params, &mut Params) {
        (&mut self.m, &mut self.v)
    }

    /// Writes the moments (`state.safetensors`) and counters (`state.json`) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        self.m.save_prefixed(&dir.join("m.safetensors"), "")?;
        self.v.save_prefixed(&dir.join("v.safetensors"), "")?;
        let meta = serde_json::json!({"calls": self.calls, "applied": self.applied});
        let path = dir.join("state.json");
        std::fs::write(&path, meta.to_string()).map_err(|e| Error::io(&path, e))
    }

    /// Restores what [`Optimizer::save`] wrote, for parameters shaped like the current ones.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let specs: Vec<(String, Vec<usize>)> = self
            .m
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let load = |file: &str| -> Result<Params> {
            let tmp = dir.join(file);
            let st = crate::params::load_file(&tmp, &specs)?;
            Ok(st)
        };
        let (m, v) = (load("m.safetensors")?, load("v.safetensors")?);
        let path = dir.join("state.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let meta: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(&path, format!("invalid JSON: {e}")))?;
        let field = |k: &str| {
            meta.get(k)
                .and_then(|v| v.as_u64())
                .ok_or_else(|| Error::config(&path, format!("missing field `{k}`")))
        };
        self.calls = field("calls")?;
        self.applied = field("applied")?;
        self.m = m;
        self.v = v;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = LrSchedule {
            base_lr: 1.0,
            warmup_steps: 4,
            total_steps: 14,
            kind: ScheduleKind::Cosine,
            min_lr_ratio: 0.0,
        };
        assert_eq!(s.lr(0), 0.0);
        assert_eq!(s.lr(2), 0.5);
        assert_eq!(s.lr(4), 1.0);
        assert!((s.lr(9) - 0.5).abs() < 1e-6);
        assert!(s.lr(14).abs() < 1e-6);
        assert_eq!(LrSchedule::constant(0.3).lr(100), 0.3);
    }

    #[test]
    fn non_finite_gradients_skip_the_update() {
        let specs = vec![("w".to_string(), vec![2])];
        let mut p = Params::init(&specs, 1.0, 1);
        let before = p.clone();
        let mut g = p.zeros_like();
        g.tensors[0].data[0] = f32::NAN;
        let mut opt = Optimizer::new(&p, AdamW::default(), LrSchedule::constant(0.1), Some(1.0));
        let r = opt.step(&mut p, &mut g);
        assert!(r.skipped);
        assert_eq!(p, before);
        assert_eq!((opt.calls, opt.applied), (1, 0));
    }

    /// Two shards stepped with the whole gradient's norm give the whole step's values.
    #[test]
    fn shards_step_as_the_whole_does() {
        let specs = vec![("a".to_string(), vec![3]), ("b".to_string(), vec![2, 2])];
        let p0 = Params::init(&specs, 1.0, 4);
        let mut g0 = p0.zeros_like();
        crate::wire::unflatten_into(&mut g0, &[3.0, -1.0, 0.5, 2.0, 0.0, -4.0, 1.5]).unwrap();
        let (hp, sched) = (AdamW::default(), LrSchedule::constant(0.1));
        let (mut whole, mut wg) = (p0.clone(), g0.clone());
        let mut opt = Optimizer::new(&p0, hp, sched, Some(1.0));
        let mut sharded = p0.clone();
        let mut shards =
            [(0, 4), (4, 3)].map(|(o, n)| (o, Optimizer::for_range(n, hp, sched, Some(1.0))));
        for _ in 0..2 {
            let want = opt.step(&mut whole, &mut wg);
            let norm = global_norm(g0.tensors.iter().map(|t| t.data.as_slice()));
            for (offset, o) in &mut shards {
                let mut g = g0.clone();
                let mut p = sharded.clone();
                let got = o.step_range(&mut p, &mut g, *offset, norm).unwrap();
                assert_eq!(got, want);
                let n = o.moment_len();
                let mine = crate::wire::read_range(&p, *offset, n).unwrap();
                crate::wire::write_range(&mut sharded, *offset, &mine).unwrap();
            }
            wg = g0.clone();
        }
        assert_eq!(crate::wire::flatten(&sharded), crate::wire::flatten(&whole));
        assert!(
            shards[1]
                .1
                .step_range(&mut sharded, &mut g0, 5, 1.0)
                .is_err()
        );
    }

    #[test]
    fn clipping_bounds_the_norm() {
        let specs = vec![("w".to_string(), vec![2])];
        let mut p = Params::zeros(&specs);
        let mut g = p.zeros_like();
        g.tensors[0].data.copy_from_slice(&[30.0, 40.0]);
        let mut opt = Optimizer::new(&p, AdamW::default(), LrSchedule::constant(0.1), Some(1.0));
        let r = opt.step(&mut p, &mut g);
        assert!((r.grad_norm - 50.0).abs() < 1e-9);
        let clipped = global_norm([g.tensors[0].data.as_slice()]);
        assert!((clipped - 1.0).abs() < 1e-5);
    }
}
