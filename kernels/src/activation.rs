//! SwiGLU: `silu(gate) · up`, elementwise.
//!
//! The gate's sigmoid follows the precision: under [`Precision::Bf16`] it is
//! [`crate::vmath::sigmoid`] (sixteen lanes at a time on AVX-512, within 4 ulp of libm's — far
//! under the bf16 rounding of the product that reads it; libm one value at a time was a tenth of
//! a small model's bf16 step); under f32 it is libm's, so an f32 run keeps the values it was
//! measured with (the README's main command ends at 0.91 or at 0.835 on a 4-ulp difference).

use crate::matmul::Precision;
use rayon::prelude::*;

const CHUNK: usize = 4096;

/// `s = 1 / (1 + e^(−g))` the way `p` takes it.
fn sigmoid(g: &[f32], s: &mut [f32], p: Precision) {
    match p {
        Precision::Bf16 => crate::vmath::sigmoid(g, s),
        Precision::F32 => {
            for (s, &x) in s.iter_mut().zip(g) {
                *s = 1.0 / (1.0 + (-x).exp());
            }
        }
    }
}

/// `out = silu(gate) · up`, the sigmoid as `p` takes it.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32], p: Precision) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "swiglu: shapes"
    );
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| {
            // The sigmoid goes through `o` first.
            sigmoid(g, o, p);
            for i in 0..o.len() {
                o[i] = g[i] * o[i] * u[i];
            }
        });
}

/// Backward of [`swiglu`] (the same sigmoid): writes `d_gate` and `d_up` from `d_out`.
pub fn swiglu_backward(
    gate: &[f32],
    up: &[f32],
    d_out: &[f32],
    d_gate: &mut [f32],
    d_up: &mut [f32],
    p: Precision,
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
            // The sigmoid goes through `dg` first.
            sigmoid(g, dg, p);
            for i in 0..dg.len() {
                let s = dg[i];
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
    fn backward_matches_finite_differences_in_both_precisions() {
        let n = 50;
        let (g, u, c) = (randn(n, 1), randn(n, 2), randn(n, 3));
        for p in [Precision::F32, Precision::Bf16] {
            let mut dg = vec![0.0; n];
            let mut du = vec![0.0; n];
            swiglu_backward(&g, &u, &c, &mut dg, &mut du, p);
            let silu = |x: f64| x / (1.0 + (-x).exp());
            let u64_: Vec<f64> = u.iter().map(|&v| v as f64).collect();
            let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
            check_grad(&g, &dg, n, 1e-4, &format!("swiglu dgate {p:?}"), &|q| {
                (0..n).map(|i| silu(q[i]) * u64_[i] * c[i] as f64).sum()
            });
            check_grad(&u, &du, n, 1e-4, &format!("swiglu dup {p:?}"), &|q| {
                (0..n).map(|i| silu(g64[i]) * q[i] * c[i] as f64).sum()
            });
        }
    }

    /// f32 keeps libm's values bit for bit (what f32 runs were measured with); bf16's lanes stay
    /// within a few ulp of them.
    #[test]
    fn f32_keeps_libms_values_and_bf16_stays_within_a_few_ulp() {
        let n = 10_000;
        let (g, u) = (randn(n, 4), randn(n, 5));
        let libm: Vec<f32> = (0..n)
            .map(|i| g[i] * (1.0 / (1.0 + (-g[i]).exp())) * u[i])
            .collect();
        let mut f32_ = vec![0.0; n];
        swiglu(&g, &u, &mut f32_, Precision::F32);
        assert_eq!(f32_, libm);
        let mut bf16 = vec![0.0; n];
        swiglu(&g, &u, &mut bf16, Precision::Bf16);
        for (i, (&a, &b)) in bf16.iter().zip(&libm).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                "at {i}: {a} vs {b}"
            );
        }
    }
}
