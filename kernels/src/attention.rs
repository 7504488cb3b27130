//! Causal grouped-query attention over a batch of rows, with segment masks for padding and
//! packing.
//!
//! Layout: `q` is `[batch·seq, heads·head_dim]`, `k` and `v` are `[batch·seq,
//! kv_heads·head_dim]`. Query token `i` sees key token `j` of the same row iff `j ≤ i` and
//! `seg[j] == seg[i]`: one segment per row gives a padded batch (give padding its own segment
//! id), several per row a packed one.
//!
//! Memory: the forward keeps only the per-row log-sum-exp (`[batch, heads, seq]`); the
//! backward recomputes the probabilities one head at a time, so nothing of size seq² outlives a
//! single head's computation.

use crate::embedding::SendPtr;
use crate::matmul::{Par, strided};
use rayon::prelude::*;

/// Shape of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Rows in the batch.
    pub batch: usize,
    /// Tokens per row.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` must be a multiple).
    pub kv_heads: usize,
    /// Size of each head's vector.
    pub head_dim: usize,
}

impl AttnShape {
    fn check(&self, q: &[f32], k: &[f32], v: &[f32], seg: &[u32]) {
        let n = self.batch * self.seq;
        assert!(
            self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads),
            "attention: heads"
        );
        assert_eq!(
            q.len(),
            n * self.heads * self.head_dim,
            "attention: q shape"
        );
        assert_eq!(
            k.len(),
            n * self.kv_heads * self.head_dim,
            "attention: k shape"
        );
        assert_eq!(v.len(), k.len(), "attention: v shape");
        assert_eq!(seg.len(), n, "attention: seg shape");
    }
}

/// Scaled, masked scores → probabilities in place (`s` is `[seq, seq]`). Returns nothing;
/// writes each row's log-sum-exp of the scaled scores into `lse` (forward) or uses the given
/// one (`recompute`).
fn softmax_rows(
    s: &mut [f32],
    seq: usize,
    seg: &[u32],
    scale: f32,
    lse: &mut [f32],
    recompute: bool,
) {
    for i in 0..seq {
        let row = &mut s[i * seq..(i + 1) * seq];
        let si = seg[i];
        // Scores past the diagonal never count; the rest count within the segment, as
        // exponents (−∞ outside it) taken together.
        row[i + 1..].fill(0.0);
        let row = &mut row[..=i];
        let shift = if recompute {
            lse[i]
        } else {
            let mut max = f32::NEG_INFINITY;
            for (x, &sj) in row.iter().zip(seg) {
                if sj == si {
                    max = max.max(x * scale);
                }
            }
            max
        };
        for (x, &sj) in row.iter_mut().zip(seg) {
            *x = if sj == si {
                *x * scale - shift
            } else {
                f32::NEG_INFINITY
            };
        }
        let sum = crate::vmath::exp_in_place(row);
        if !recompute {
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|p| *p *= inv);
            lse[i] = shift + sum.ln();
        }
    }
}

/// Row blocks `(r0, r1)` of a causal `[seq × seq]` product: block rows see columns `0..r1`.
fn causal_blocks(seq: usize) -> impl Iterator<Item = (usize, usize)> {
    const ROWS: usize = 64;
    (0..seq)
        .step_by(ROWS)
        .map(move |r0| (r0, (r0 + ROWS).min(seq)))
}

/// `S[r0..r1, 0..r1] = A[r0..r1] · B[0..r1]ᵀ` for every causal block: rows of `A` and `B` hold
/// `d` values at strides `sa` and `sb`; `S` is `[t × t]` row-major.
///
/// # Safety
/// `t` rows of `A` and `B` must be readable at those strides, `s` must hold `t·t` values, and
/// none may alias `s`.
unsafe fn causal_scores(
    t: usize,
    d: usize,
    a: *const f32,
    sa: isize,
    b: *const f32,
    sb: isize,
    s: *mut f32,
) {
    for (r0, r1) in causal_blocks(t) {
        // SAFETY: the caller's contract.
        unsafe {
            strided(
                r1 - r0,
                d,
                r1,
                a.offset(r0 as isize * sa),
                sa,
                1,
                b,
                1,
                sb,
                s.add(r0 * t),
                t as isize,
                false,
                Par::Single,
            );
        }
    }
}

/// `O[r0..r1] = P[r0..r1, 0..r1] · B[0..r1]` for every causal block: `P` is `[t × t]`
/// row-major, rows of `B` and `O` hold `d` values at strides `sb` and `so`.
///
/// # Safety
/// As [`causal_scores`], for `p`, `b` and `o`.
unsafe fn causal_apply(
    t: usize,
    d: usize,
    p: *const f32,
    b: *const f32,
    sb: isize,
    o: *mut f32,
    so: isize,
) {
    for (r0, r1) in causal_blocks(t) {
        // SAFETY: the caller's contract.
        unsafe {
            strided(
                r1 - r0,
                r1,
                d,
                p.add(r0 * t),
                t as isize,
                1,
                b,
                sb,
                1,
                o.offset(r0 as isize * so),
                so,
                false,
                Par::Single,
            );
        }
    }
}

/// Forward. Writes `out` (`[batch·seq, heads·head_dim]`) and `lse` (`[batch, heads, seq]`).
pub fn attention(
    sh: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seg: &[u32],
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
) {
    sh.check(q, k, v, seg);
    assert_eq!(out.len(), q.len(), "attention: out shape");
    assert_eq!(
        lse.len(),
        sh.batch * sh.heads * sh.seq,
        "attention: lse shape"
    );
    let (t, d, nh, nkv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
    let group = nh / nkv;
    let (qs, kvs) = ((nh * d) as isize, (nkv * d) as isize);
    let out_ptr = SendPtr(out.as_mut_ptr());
    lse.par_chunks_mut(t).enumerate().for_each_init(
        || vec![0.0f32; t * t],
        |s, (bh, lse_row)| {
            let (b, h) = (bh / nh, bh % nh);
            let g = h / group;
            let row0 = b * t;
            let seg = &seg[row0..row0 + t];
            let out_ptr = &out_ptr;
            // SAFETY: all views stay inside q/k/v/out (row0+t rows, head offsets < row width);
            // each task writes only its own head's columns of `out`.
            unsafe {
                let qp = q.as_ptr().add(row0 * nh * d + h * d);
                let kp = k.as_ptr().add(row0 * nkv * d + g * d);
                let vp = v.as_ptr().add(row0 * nkv * d + g * d);
                // Causal: rows r0..r1 see keys 0..r1 only, so the blocks above the diagonal
                // are never computed (softmax_rows zeroes what lies past each row's diagonal).
                causal_scores(t, d, qp, qs, kp, kvs, s.as_mut_ptr());
                softmax_rows(s, t, seg, scale, lse_row, false);
                let op = out_ptr.0.add(row0 * nh * d + h * d);
                causal_apply(t, d, s.as_ptr(), vp, kvs, op, qs);
            }
        },
    );
}

/// Backward. Overwrites `dq`, `dk`, `dv` from `d_out`, the forward's inputs, `out` and `lse`.
pub fn attention_backward(
    sh: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seg: &[u32],
    scale: f32,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    sh.check(q, k, v, seg);
    assert!(out.len() == q.len() && d_out.len() == q.len() && dq.len() == q.len());
    assert!(
        dk.len() == k.len() && dv.len() == v.len(),
        "attention_backward: dk/dv shape"
    );
    let (t, d, nh, nkv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
    let group = nh / nkv;
    let (qs, kvs) = ((nh * d) as isize, (nkv * d) as isize);
    let (dq_p, dk_p, dv_p) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    (0..sh.batch * nkv).into_par_iter().for_each_init(
        || (vec![0.0f32; t * t], vec![0.0f32; t * t], vec![0.0f32; t]),
        |(p, dp, lse_buf), bg| {
            let (b, g) = (bg / nkv, bg % nkv);
            let row0 = b * t;
            let seg = &seg[row0..row0 + t];
            let (dq_p, dk_p, dv_p) = (&dq_p, &dk_p, &dv_p);
            for h in g * group..(g + 1) * group {
                let first = h == g * group;
                lse_buf.copy_from_slice(&lse[(b * nh + h) * t..(b * nh + h + 1) * t]);
                // D_i = Σ_c dO[i,c]·O[i,c]
                let mut dsum = vec![0.0f32; t];
                for i in 0..t {
                    let o = (row0 + i) * nh * d + h * d;
                    dsum[i] = (0..d).map(|c| d_out[o + c] * out[o + c]).sum();
                }
                // SAFETY: views inside their buffers as in the forward; task (b, g) alone writes
                // dk/dv columns of kv head g and dq columns of heads in its group.
                unsafe {
                    let qp = q.as_ptr().add(row0 * nh * d + h * d);
                    let kp = k.as_ptr().add(row0 * nkv * d + g * d);
                    let vp = v.as_ptr().add(row0 * nkv * d + g * d);
                    let dop = d_out.as_ptr().add(row0 * nh * d + h * d);
                    causal_scores(t, d, qp, qs, kp, kvs, p.as_mut_ptr());
                    softmax_rows(p, t, seg, scale, lse_buf, true);
                    // dP = dO · Vᵀ, below the diagonal
                    causal_scores(t, d, dop, qs, vp, kvs, dp.as_mut_ptr());
                    for i in 0..t {
                        let (pr, dr) = (&p[i * t..=i * t + i], &mut dp[i * t..(i + 1) * t]);
                        for (x, &pv) in dr.iter_mut().zip(pr) {
                            *x = pv * (*x - dsum[i]) * scale;
                        }
                        dr[i + 1..].fill(0.0);
                    }
                    // dQ = dS · K
                    let dqp = dq_p.0.add(row0 * nh * d + h * d);
                    causal_apply(t, d, dp.as_ptr(), kp, kvs, dqp, qs);
                    // dK (+)= dSᵀ · Q and dV (+)= Pᵀ · dO: keys c0..c1 are seen by rows c0..t.
                    let dkp = dk_p.0.add(row0 * nkv * d + g * d);
                    let dvp = dv_p.0.add(row0 * nkv * d + g * d);
                    for (c0, c1) in causal_blocks(t) {
                        for (src, rhs, out) in [(dp.as_ptr(), qp, dkp), (p.as_ptr(), dop, dvp)] {
                            strided(
                                c1 - c0,
                                t - c0,
                                d,
                                src.add(c0 * t + c0),
                                1,
                                t as isize,
                                rhs.offset(c0 as isize * qs),
                                qs,
                                1,
                                out.offset(c0 as isize * kvs),
                                kvs,
                                !first,
                                Par::Single,
                            );
                        }
                    }
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grad, close, randn};

    /// f64 reference: Σ coef · attention(q, k, v).
    fn reference(
        sh: AttnShape,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        seg: &[u32],
        scale: f64,
        coef: &[f32],
    ) -> (f64, Vec<f64>) {
        let (t, d, nh, nkv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
        let mut out = vec![0.0; q.len()];
        for b in 0..sh.batch {
            for h in 0..nh {
                let g = h / (nh / nkv);
                for i in 0..t {
                    let qi = &q[((b * t + i) * nh + h) * d..][..d];
                    let mut w = vec![f64::NEG_INFINITY; t];
                    for j in 0..=i {
                        if seg[b * t + j] == seg[b * t + i] {
                            let kj = &k[((b * t + j) * nkv + g) * d..][..d];
                            w[j] = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                        }
                    }
                    let m = w.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = w.iter().map(|x| (x - m).exp()).sum();
                    for j in 0..t {
                        let pj = (w[j] - m).exp() / z;
                        let vj = &v[((b * t + j) * nkv + g) * d..][..d];
                        for c in 0..d {
                            out[((b * t + i) * nh + h) * d + c] += pj * vj[c];
                        }
                    }
                }
            }
        }
        let loss = out.iter().zip(coef).map(|(o, c)| o * *c as f64).sum();
        (loss, out)
    }

    #[test]
    fn forward_and_backward_match_an_f64_reference() {
        // Row 0 padded after 5 tokens, row 1 two packed segments; then 150 tokens (three causal
        // blocks, the last one ragged) in two segments.
        let seg7 = [0u32, 0, 0, 0, 0, 9, 9, 1, 1, 1, 2, 2, 2, 2];
        let seg150: Vec<u32> = (0..150).map(|i| u32::from(i >= 100)).collect();
        let cases = [
            (
                AttnShape {
                    batch: 2,
                    seq: 7,
                    heads: 4,
                    kv_heads: 2,
                    head_dim: 5,
                },
                &seg7[..],
            ),
            (
                AttnShape {
                    batch: 1,
                    seq: 150,
                    heads: 2,
                    kv_heads: 1,
                    head_dim: 4,
                },
                &seg150[..],
            ),
        ];
        for (sh, seg) in cases {
            let n = sh.batch * sh.seq;
            let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
            let q = randn(n * qw, 11);
            let k = randn(n * kw, 12);
            let v = randn(n * kw, 13);
            let coef = randn(n * qw, 14);
            let scale = 1.0 / (sh.head_dim as f32).sqrt();
            let mut out = vec![0.0; q.len()];
            let mut lse = vec![0.0; sh.batch * sh.heads * sh.seq];
            attention(sh, &q, &k, &v, seg, scale, &mut out, &mut lse);
            let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let (q64, k64, v64) = (f64s(&q), f64s(&k), f64s(&v));
            let (_, ref_out) = reference(sh, &q64, &k64, &v64, seg, scale as f64, &coef);
            let ref_out: Vec<f32> = ref_out.iter().map(|&x| x as f32).collect();
            close(&out, &ref_out, 1e-5, "attention out");

            let (mut dq, mut dk, mut dv) =
                (vec![9.0; q.len()], vec![9.0; k.len()], vec![9.0; v.len()]);
            attention_backward(
                sh, &q, &k, &v, seg, scale, &out, &lse, &coef, &mut dq, &mut dk, &mut dv,
            );
            let s = scale as f64;
            check_grad(&q, &dq, 140, 1e-3, "attention dq", &|p| {
                reference(sh, p, &k64, &v64, seg, s, &coef).0
            });
            check_grad(&k, &dk, 70, 1e-3, "attention dk", &|p| {
                reference(sh, &q64, p, &v64, seg, s, &coef).0
            });
            check_grad(&v, &dv, 70, 1e-3, "attention dv", &|p| {
                reference(sh, &q64, &k64, p, seg, s, &coef).0
            });
        }
    }
}
