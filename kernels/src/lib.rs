//! Numerical kernels for the native CPU engines: forward and backward of every op the model
//! uses, on row-major f32 slices, threaded with rayon.
//!
//! Owns: GEMM (f32 on AVX-512 register tiles in [`sgemm`], elsewhere through the `gemm` crate;
//! bf16 on `vdpbf16ps` in [`bf16`] or rounded into [`sgemm`]), RMSNorm, RoPE, causal grouped-query
//! attention, SwiGLU, embedding gather/scatter-add, the fused log-softmax/log-prob/entropy head,
//! AdamW and gradient-norm utilities, and the thread-count setting; and [`hlo`], the same ops
//! traced into StableHLO (with their gradients) for the `pjrt` engines.
//!
//! Never: knows about models, checkpoints, configs, or anything asynchronous. Kernels take
//! slices and shapes and write into caller-provided outputs; allocation policy is the caller's.
//! Shapes are checked with `assert!` at each kernel's entry: a mismatch is a bug in the caller
//! (the learner validates user input before it reaches here), never a user-facing error.

pub mod activation;
pub mod attention;
pub mod bf16;
pub mod embedding;
pub mod head;
pub mod hlo;
pub mod matmul;
pub mod mem;
pub mod norm;
pub mod optim;
pub mod peak;
pub mod rope;
pub mod sgemm;
pub mod skinny;
pub mod tensor;
pub mod threads;
pub mod vmath;

#[cfg(test)]
pub(crate) mod testutil;

/// `Σ a·b` in 16 independent lanes, so that it vectorises (a plain iterator sum is a serial
/// dependency chain the compiler must keep in order).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0.0f32; 16];
    let (ac, bc) = (a[..n].chunks_exact(16), b[..n].chunks_exact(16));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}
