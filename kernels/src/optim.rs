//! AdamW (decoupled weight decay, as `torch.optim.AdamW`), global gradient norm and clipping.

use rayon::prelude::*;

const CHUNK: usize = 8192;

/// AdamW hyper-parameters for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate of this step (after any schedule).
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamW {
    /// Updates `param` in place from `grad`, with moment buffers `m` and `v`; `step` counts
    /// from 1 (bias correction).
    pub fn update(&self, step: u64, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
        assert!(param.len() == grad.len() && m.len() == grad.len() && v.len() == grad.len());
        assert!(step >= 1, "AdamW steps count from 1");
        let bc1 = 1.0 - (self.beta1 as f64).powf(step as f64);
        let bc2 = 1.0 - (self.beta2 as f64).powf(step as f64);
        let step_size = (self.lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let decay = 1.0 - self.lr * self.weight_decay;
        let (b1, b2, eps) = (self.beta1, self.beta2, self.eps);
        param
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                for i in 0..p.len() {
                    p[i] *= decay;
                    m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                    v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                    p[i] -= step_size * m[i] / (v[i].sqrt() / bc2_sqrt + eps);
                }
            });
    }
}

/// Sum of squares of `x`, accumulated in f64 over fixed chunks added in order (reproducible
/// whatever the thread schedule).
pub fn sum_sq(x: &[f32]) -> f64 {
    let parts: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
        .collect();
    parts.iter().sum()
}

/// The global L2 norm over several gradient tensors.
pub fn global_norm<'a>(grads: impl IntoIterator<Item = &'a [f32]>) -> f64 {
    grads.into_iter().map(sum_sq).sum::<f64>().sqrt()
}

/// Multiplies `x` by `s`.
pub fn scale(x: &mut [f32], s: f32) {
    x.par_chunks_mut(CHUNK)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= s));
}

/// The factor that clips a gradient of norm `norm` to at most `max_norm` (as
/// `torch.nn.utils.clip_grad_norm_`: `max_norm / (norm + 1e-6)`, capped at 1).
pub fn clip_factor(norm: f64, max_norm: f64) -> f32 {
    (max_norm / (norm + 1e-6)).min(1.0) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_matches_a_hand_computed_step() {
        // torch.optim.AdamW(lr=0.1, weight_decay=0.5), p=1.0, g=0.5, two steps.
        let opt = AdamW {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
        };
        let (mut p, mut m, mut v) = (vec![1.0f32], vec![0.0], vec![0.0]);
        opt.update(1, &mut p, &[0.5], &mut m, &mut v);
        // step 1: p = 1·(1-0.05) - 0.1·(0.05/0.1)/(sqrt(0.00025/0.001)+1e-8) = 0.95 - 0.1
        assert!((p[0] - 0.85).abs() < 1e-6, "{}", p[0]);
        opt.update(2, &mut p, &[0.5], &mut m, &mut v);
        // second step with constant gradient: the normalised update is again 1 → p·0.95 - 0.1
        assert!((p[0] - (0.85 * 0.95 - 0.1)).abs() < 1e-5, "{}", p[0]);
    }

    #[test]
    fn global_norm_and_clipping() {
        let a = [3.0f32, 0.0];
        let b = [4.0f32];
        let n = global_norm([&a[..], &b[..]]);
        assert!((n - 5.0).abs() < 1e-12);
        assert!((clip_factor(n, 1.0) - 0.2).abs() < 1e-6);
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
    }
}
