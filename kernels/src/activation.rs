//! SwiGLU: `silu(gate) · up`, elementwise.

use rayon::prelude::*;

const CHUNK: usize = 4096;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `out = silu(gate) · up`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "swiglu: shapes"
    );
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| {
            for i in 0..o.len() {
                o[i] = g[i] * sigmoid(g[i]) * u[i];
            }
        });
}

/// Backward of [`swiglu`]: writes `d_gate` and `d_up` from `d_out`.
pub fn swiglu_backward(
    gate: &[f32],
    up: &[f32],
    d_out: &[f32],
    d_gate: &mut [f32],
    d_up: &mut [f32],
) {
    let n = gate.len();
    assert!(up.len() == n && d_out.len() == n && d_gate.len() == n && d_up.len() == n);
    d_gate
        .par_chunks_mut(CHUNK)
        .zip(d_up.par_chunks_mut(CHUNK))
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .zip(d_out.par_chunks(CHUNK))
        .for_each(|((((dg, du), g), u), d)| {
            for i in 0..dg.len() {
                let s = sigmoid(g[i]);
                du[i] = d[i] * g[i] * s;
                dg[i] = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grad, randn};

    #[test]
    fn backward_matches_finite_differences() {
        let n = 50;
        let (g, u, c) = (randn(n, 1), randn(n, 2), randn(n, 3));
        let mut dg = vec![0.0; n];
        let mut du = vec![0.0; n];
        swiglu_backward(&g, &u, &c, &mut dg, &mut du);
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let u64_: Vec<f64> = u.iter().map(|&v| v as f64).collect();
        let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
        check_grad(&g, &dg, n, 1e-4, "swiglu dgate", &|p| {
            (0..n).map(|i| silu(p[i]) * u64_[i] * c[i] as f64).sum()
        });
        check_grad(&u, &du, n, 1e-4, "swiglu dup", &|p| {
            (0..n).map(|i| silu(g64[i]) * p[i] * c[i] as f64).sum()
        });
    }
}
