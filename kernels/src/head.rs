//! The fused output head: `logits = x · Wᵀ / temperature` → log-softmax → log-prob of each
//! row's target token and the distribution's entropy, with its backward.
//!
//! Rows are processed in chunks, so the full `[rows × vocab]` logits matrix never exists; the
//! backward recomputes each chunk's logits from `x` and the saved log-sum-exp.

use crate::matmul::{Op, Par, Precision, matmul};
use rayon::prelude::*;

/// The weight as the right operand of the chunks' products: as stored for f32, or rounded and
/// packed once for all of them for bf16.
enum Weight<'a> {
    F32(&'a [f32], Op),
    Bf16(crate::matmul::Rhs),
}

impl<'a> Weight<'a> {
    /// `op(w)` as a `[k,n]` operand in `precision`.
    fn new(w: &'a [f32], op: Op, k: usize, n: usize, precision: Precision) -> Self {
        match precision {
            Precision::F32 => Weight::F32(w, op),
            Precision::Bf16 => Weight::Bf16(crate::matmul::Rhs::new(k, n, w, op)),
        }
    }

    /// `c[m,n] = a[m,k] · op(w)`.
    fn matmul(&self, m: usize, k: usize, n: usize, a: &[f32], c: &mut [f32]) {
        match self {
            Weight::F32(w, op) => {
                matmul(
                    m,
                    k,
                    n,
                    a,
                    Op::N,
                    w,
                    *op,
                    c,
                    false,
                    Par::Pool,
                    Precision::F32,
                );
            }
            Weight::Bf16(rhs) => rhs.matmul(m, a, Op::N, c, false),
        }
    }
}

/// Rows per chunk, so that one chunk of logits is about 4 MiB.
pub fn chunk_rows(vocab: usize) -> usize {
    ((1 << 20) / vocab.max(1)).clamp(8, 512)
}

/// Forward, its matmul in `precision`. `x` is `[rows, dim]`, `w` is `[vocab, dim]`, `targets` has one id per row.
/// Writes `logp`, `entropy` and `lse` (the log-sum-exp of the tempered logits, kept for the
/// backward), one value per row each.
pub fn logprob_entropy(
    x: &[f32],
    w: &[f32],
    dim: usize,
    targets: &[u32],
    temperature: f32,
    logp: &mut [f32],
    entropy: &mut [f32],
    lse: &mut [f32],
    precision: Precision,
) {
    let rows = targets.len();
    let vocab = w.len() / dim;
    assert_eq!(x.len(), rows * dim, "head: x shape");
    assert!(
        logp.len() == rows && entropy.len() == rows && lse.len() == rows,
        "head: outputs"
    );
    assert!(temperature > 0.0, "head: temperature must be positive");
    let c = chunk_rows(vocab);
    let wt = Weight::new(w, Op::T, dim, vocab, precision);
    let mut logits = vec![0.0f32; c * vocab];
    for r0 in (0..rows).step_by(c) {
        let n = c.min(rows - r0);
        let z = &mut logits[..n * vocab];
        wt.matmul(n, dim, vocab, &x[r0 * dim..], z);
        z.par_chunks_mut(vocab)
            .zip(targets[r0..r0 + n].par_iter())
            .zip(logp[r0..r0 + n].par_iter_mut())
            .zip(entropy[r0..r0 + n].par_iter_mut())
            .zip(lse[r0..r0 + n].par_iter_mut())
            .for_each(|((((row, &tgt), lp), ent), l)| {
                let inv_t = 1.0 / temperature;
                let mut max = f32::NEG_INFINITY;
                for v in row.iter_mut() {
                    *v *= inv_t;
                    max = max.max(*v);
                }
                let (sum, dot) = crate::vmath::exp_sum_dot(row, max);
                let lse_v = max + sum.ln();
                *l = lse_v;
                let tgt = tgt as usize;
                assert!(tgt < vocab, "head: target {tgt} >= vocab {vocab}");
                *lp = row[tgt] - lse_v;
                *ent = lse_v - dot / sum;
            });
    }
}

/// Backward: from `d_logp` and `d_entropy` (d loss / d each row's value) writes `dx`
/// (`[rows, dim]`, overwritten) and accumulates `dw` (`[vocab, dim]`).
pub fn logprob_entropy_backward(
    x: &[f32],
    w: &[f32],
    dim: usize,
    targets: &[u32],
    temperature: f32,
    lse: &[f32],
    entropy: &[f32],
    d_logp: &[f32],
    d_entropy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    precision: Precision,
) {
    let rows = targets.len();
    let vocab = w.len() / dim;
    assert!(
        x.len() == rows * dim && dx.len() == rows * dim,
        "head backward: x/dx shape"
    );
    assert!(
        lse.len() == rows
            && entropy.len() == rows
            && d_logp.len() == rows
            && d_entropy.len() == rows
    );
    assert_eq!(dw.len(), w.len(), "head backward: dw shape");
    let c = chunk_rows(vocab);
    let (wt, wn) = (
        Weight::new(w, Op::T, dim, vocab, precision),
        Weight::new(w, Op::N, vocab, dim, precision),
    );
    let mut logits = vec![0.0f32; c * vocab];
    let inv_t = 1.0 / temperature;
    for r0 in (0..rows).step_by(c) {
        let n = c.min(rows - r0);
        let z = &mut logits[..n * vocab];
        wt.matmul(n, dim, vocab, &x[r0 * dim..], z);
        z.par_chunks_mut(vocab).enumerate().for_each(|(i, row)| {
            let r = r0 + i;
            let (l, h, gl, ge) = (lse[r], entropy[r], d_logp[r], d_entropy[r]);
            // d logp_t / dz = 1[t] - p ;  d H / dz = -p (log p + H): with x = log p,
            // dz = e^x · (-gl - ge·H - ge·x) / T.
            for v in row.iter_mut() {
                *v = *v * inv_t - l;
            }
            crate::vmath::exp_affine(row, -gl - ge * h, -ge, inv_t);
            row[targets[r] as usize] += gl * inv_t;
        });
        // dx = dz · W ;  dW += dzᵀ · x
        wn.matmul(n, vocab, dim, z, &mut dx[r0 * dim..(r0 + n) * dim]);
        matmul(
            vocab,
            n,
            dim,
            z,
            Op::T,
            &x[r0 * dim..(r0 + n) * dim],
            Op::N,
            dw,
            true,
            Par::Pool,
            precision,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grad, close, randn};

    fn reference(
        x: &[f64],
        w: &[f64],
        dim: usize,
        tg: &[u32],
        temp: f64,
        cl: &[f32],
        ce: &[f32],
    ) -> (f64, Vec<f64>, Vec<f64>) {
        let vocab = w.len() / dim;
        let (mut lps, mut ents, mut loss) = (vec![], vec![], 0.0);
        for (r, xr) in x.chunks(dim).enumerate() {
            let z: Vec<f64> = (0..vocab)
                .map(|v| {
                    w[v * dim..(v + 1) * dim]
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| a * b)
                        .sum::<f64>()
                        / temp
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            let lp = z[tg[r] as usize] - lse;
            let ent = -z.iter().map(|v| (v - lse).exp() * (v - lse)).sum::<f64>();
            loss += lp * cl[r] as f64 + ent * ce[r] as f64;
            lps.push(lp);
            ents.push(ent);
        }
        (loss, lps, ents)
    }

    #[test]
    fn forward_and_backward_match_an_f64_reference() {
        let (rows, dim, vocab, temp) = (21, 6, 2300, 0.7);
        let x = randn(rows * dim, 21);
        let w = randn(vocab * dim, 22);
        let targets: Vec<u32> = (0..rows as u32).map(|r| (r * 97) % vocab as u32).collect();
        let (cl, ce) = (randn(rows, 23), randn(rows, 24));
        let (mut lp, mut ent, mut lse) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        logprob_entropy(
            &x,
            &w,
            dim,
            &targets,
            temp,
            &mut lp,
            &mut ent,
            &mut lse,
            Precision::F32,
        );
        let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
        let (x64, w64) = (f64s(&x), f64s(&w));
        let (_, rlp, rent) = reference(&x64, &w64, dim, &targets, temp as f64, &cl, &ce);
        close(
            &lp,
            &rlp.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            1e-4,
            "logp",
        );
        close(
            &ent,
            &rent.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            1e-4,
            "entropy",
        );
        let mut dx = vec![0.0; rows * dim];
        let mut dw = vec![0.0; vocab * dim];
        logprob_entropy_backward(
            &x,
            &w,
            dim,
            &targets,
            temp,
            &lse,
            &ent,
            &cl,
            &ce,
            &mut dx,
            &mut dw,
            Precision::F32,
        );
        let t = temp as f64;
        check_grad(&x, &dx, 60, 2e-3, "head dx", &|p| {
            reference(p, &w64, dim, &targets, t, &cl, &ce).0
        });
        check_grad(&w, &dw, 40, 2e-3, "head dw", &|p| {
            reference(&x64, p, dim, &targets, t, &cl, &ce).0
        });
    }
}
