//! RMSNorm over the last dimension: `y = x / sqrt(mean(x²) + eps) · w`.

use rayon::prelude::*;

/// Forward over `rows × dim` values. Writes `y` and each row's inverse RMS (kept for the
/// backward, one value per row).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32], inv_rms: &mut [f32]) {
    let dim = w.len();
    assert_eq!(
        x.len() % dim,
        0,
        "rmsnorm: x is not a multiple of dim {dim}"
    );
    assert_eq!(x.len(), y.len(), "rmsnorm: y shape");
    assert_eq!(inv_rms.len(), x.len() / dim, "rmsnorm: inv_rms shape");
    y.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .zip(inv_rms.par_iter_mut())
        .for_each(|((yr, xr), r)| {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            *r = 1.0 / (ms + eps).sqrt();
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                *o = v * *r * g;
            }
        });
}

/// Backward: `dx` (overwritten) and `dw` (accumulated) from `dy`, the forward's input `x` and
/// its `inv_rms`.
pub fn rmsnorm_backward(
    x: &[f32],
    w: &[f32],
    inv_rms: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let dim = w.len();
    assert_eq!(x.len(), dy.len(), "rmsnorm_backward: dy shape");
    assert_eq!(x.len(), dx.len(), "rmsnorm_backward: dx shape");
    assert_eq!(dw.len(), dim, "rmsnorm_backward: dw shape");
    // dx rows in parallel; dw as partial sums over fixed blocks of rows, added in block order,
    // so the result does not depend on how rayon schedules the work (runs are reproducible).
    const ROWS: usize = 64;
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(dim * ROWS)
        .zip(x.par_chunks(dim * ROWS))
        .zip(dy.par_chunks(dim * ROWS))
        .zip(inv_rms.par_chunks(ROWS))
        .map(|(((dxb, xb), dyb), rb)| {
            let mut acc = vec![0.0f32; dim];
            for (((dxr, xr), dyr), &r) in dxb
                .chunks_mut(dim)
                .zip(xb.chunks(dim))
                .zip(dyb.chunks(dim))
                .zip(rb)
            {
                let mut dot = 0.0f32;
                for i in 0..dim {
                    let xhat = xr[i] * r;
                    acc[i] += dyr[i] * xhat;
                    dot += dyr[i] * w[i] * xhat;
                }
                let mean = dot / dim as f32;
                for i in 0..dim {
                    dxr[i] = r * (dyr[i] * w[i] - xr[i] * r * mean);
                }
            }
            acc
        })
        .collect();
    for partial in &partials {
        dw.iter_mut().zip(partial).for_each(|(a, b)| *a += b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grad, randn};

    fn reference(x: &[f64], w: &[f64], eps: f64, coef: &[f32]) -> f64 {
        let dim = w.len();
        let mut loss = 0.0;
        for (r, xr) in x.chunks(dim).enumerate() {
            let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            for i in 0..dim {
                loss += xr[i] * inv * w[i] * coef[r * dim + i] as f64;
            }
        }
        loss
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (rows, dim, eps) = (5, 12, 1e-6);
        let x = randn(rows * dim, 3);
        let w = randn(dim, 4);
        let coef = randn(rows * dim, 5);
        let mut y = vec![0.0; rows * dim];
        let mut inv = vec![0.0; rows];
        rmsnorm(&x, &w, eps, &mut y, &mut inv);
        let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let fwd: f64 = y.iter().zip(&coef).map(|(a, b)| (*a * *b) as f64).sum();
        assert!((fwd - reference(&x64, &w64, eps as f64, &coef)).abs() < 1e-4);
        let mut dx = vec![0.0; rows * dim];
        let mut dw = vec![0.0; dim];
        rmsnorm_backward(&x, &w, &inv, &coef, &mut dx, &mut dw);
        check_grad(&x, &dx, 60, 1e-3, "rmsnorm dx", &|p| {
            reference(p, &w64, eps as f64, &coef)
        });
        check_grad(&w, &dw, 12, 1e-3, "rmsnorm dw", &|p| {
            reference(&x64, p, eps as f64, &coef)
        });
    }
}
