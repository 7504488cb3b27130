//! Causal grouped-query attention over a batch of rows, with segment masks for padding and
//! packing.
//!
//! Layout: `q` is `[tokens, heads·head_dim]`, `k` and `v` are `[tokens, kv_heads·head_dim]`,
//! the tokens `batch·seq` of full rows or, [`Rows::Ragged`], each row's first positions side by
//! side without its padding tail (computed at its own length: a packed batch's rows cost their
//! tokens). Query token `i` sees key token `j` of the same row iff `j ≤ i` and `j`
//! is in `i`'s segment or in the one segment `i` also sees ([`Segments`]): one segment per row
//! gives a padded batch (give padding its own segment id), several per row a packed one, and a
//! segment that several others also see is a prefix they share (a GRPO group's prompt, computed
//! once for all its responses).
//!
//! Precision: in [`Precision::Bf16`] the products' operands (q, k, v, the probabilities, and
//! in the backward dO and dS) are rounded to bf16 and summed in f32, as `torch.autocast` runs
//! attention; the softmax and everything else stay f32. On AVX512-BF16 the products run on
//! `vdpbf16ps` panels packed once per head ([`crate::bf16`]); elsewhere the same operands are
//! rounded into the f32 kernel.
//!
//! Memory: the forward keeps only the per-row log-sum-exp (`[batch, heads, seq]`); the
//! backward recomputes the probabilities one head at a time, so nothing of size seq² outlives a
//! single head's computation.

use crate::bf16::rounded;
use crate::embedding::SendPtr;
use crate::matmul::{Par, Precision, strided};
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

/// Which keys of its row each query sees besides causality (`j ≤ i`): those of its own segment
/// (`ids`), and those of the segment `sees` names for it — a prefix its segment shares with
/// others, or its own id where there is none. Both are per token of the layout (`[tokens]`).
#[derive(Clone, Copy, Debug)]
pub struct Segments<'a> {
    /// Each token's segment.
    pub ids: &'a [u32],
    /// The other segment each token sees.
    pub sees: &'a [u32],
}

impl<'a> Segments<'a> {
    /// Every token sees its own segment only.
    pub fn own(ids: &'a [u32]) -> Self {
        Self { ids, sees: ids }
    }

    /// Whether query `i` sees key `j` (when `j ≤ i`).
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let s = self.ids[j];
        s == self.ids[i] || s == self.sees[i]
    }

    /// The tokens `row0..row0 + t`.
    fn row(&self, row0: usize, t: usize) -> Segments<'a> {
        Segments {
            ids: &self.ids[row0..row0 + t],
            sees: &self.sees[row0..row0 + t],
        }
    }
}

/// Where each row of the batch lies among the tokens of `q`, `k`, `v`, their gradients, the
/// output and the [`Segments`].
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    /// Row `b` is tokens `b·seq..(b + 1)·seq` (`batch·seq` tokens).
    Full,
    /// Row `b` is its first `len` positions — the rest of it padding, which none of them sees —
    /// at tokens `start..start + len`, as `(start, len)` per row (`len ≤ seq`): a batch's rows
    /// without their padding, side by side, computed at their own lengths.
    Ragged(&'a [(usize, usize)]),
}

impl Rows<'_> {
    /// Row `b`'s first token and length.
    fn of(&self, b: usize, seq: usize) -> (usize, usize) {
        match self {
            Rows::Full => (b * seq, seq),
            Rows::Ragged(rows) => rows[b],
        }
    }
}

impl AttnShape {
    /// Checks the operands' shapes against the rows; returns the tokens.
    fn check(&self, rows: Rows<'_>, q: &[f32], k: &[f32], v: &[f32], seg: Segments<'_>) -> usize {
        let n = match rows {
            Rows::Full => self.batch * self.seq,
            Rows::Ragged(r) => {
                let n = q.len() / (self.heads * self.head_dim).max(1);
                assert_eq!(r.len(), self.batch, "attention: one (start, len) per row");
                for &(start, len) in r {
                    assert!(
                        len <= self.seq && start + len <= n,
                        "attention: row ({start}, {len}) outside {n} tokens of rows of {}",
                        self.seq
                    );
                }
                n
            }
        };
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
        assert_eq!(seg.ids.len(), n, "attention: segment shape");
        assert_eq!(seg.sees.len(), n, "attention: `sees` shape");
        n
    }
}

/// Scaled, masked scores → probabilities in place (`s` is `[seq, seq]`). Returns nothing;
/// writes each row's log-sum-exp of the scaled scores into `lse` (forward) or uses the given
/// one (`recompute`).
fn softmax_rows(
    s: &mut [f32],
    seq: usize,
    seg: Segments<'_>,
    scale: f32,
    lse: &mut [f32],
    recompute: bool,
) {
    for i in 0..seq {
        let row = &mut s[i * seq..(i + 1) * seq];
        let seen = (seg.ids[i], seg.sees[i]);
        // Scores past the diagonal never count; the rest count where visible (the segment and
        // the prefix it sees), as exponents (−∞ elsewhere) taken together.
        row[i + 1..].fill(0.0);
        let row = &mut row[..=i];
        let (shift, sum) = exp_visible(row, &seg.ids[..=i], seen, scale, recompute.then(|| lse[i]));
        if !recompute {
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|p| *p *= inv);
            lse[i] = shift + sum.ln();
        }
    }
}

/// A row of scores (`row[j]` against key `j`, whose segment is `ids[j]`) as the unnormalised
/// terms of its softmax, in place: `e^(x·scale − shift)` where the key is visible (its segment
/// is one of `seen`), 0 elsewhere. `shift` is the one given, or else the largest visible
/// `x·scale`; returns it and the terms' sum.
fn exp_visible(
    row: &mut [f32],
    ids: &[u32],
    seen: (u32, u32),
    scale: f32,
    shift: Option<f32>,
) -> (f32, f32) {
    assert_eq!(
        row.len(),
        ids.len(),
        "attention: a row's scores and segments"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::sgemm::available() {
        // SAFETY: AVX-512 F was just detected; the slices are of one length.
        return unsafe { exp_visible_avx512(row, ids, seen, scale, shift) };
    }
    let visible = |sj: u32| sj == seen.0 || sj == seen.1;
    let shift = shift.unwrap_or_else(|| {
        row.iter()
            .zip(ids)
            .filter(|&(_, &sj)| visible(sj))
            .fold(f32::NEG_INFINITY, |m, (x, _)| m.max(x * scale))
    });
    for (x, &sj) in row.iter_mut().zip(ids) {
        *x = if visible(sj) {
            *x * scale - shift
        } else {
            f32::NEG_INFINITY
        };
    }
    (shift, crate::vmath::exp_in_place(row))
}

/// [`exp_visible`] sixteen keys at a time, in one pass after the maximum's (the same values:
/// the product and the difference are rounded apart, as in the scalar form, and the
/// exponential is [`crate::vmath::exp`]'s).
///
/// # Safety
/// AVX-512 F; `row` and `ids` of one length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_visible_avx512(
    row: &mut [f32],
    ids: &[u32],
    (si, pi): (u32, u32),
    scale: f32,
    shift: Option<f32>,
) -> (f32, f32) {
    use std::arch::x86_64::*;
    let (si, pi, sc) = (
        _mm512_set1_epi32(si as i32),
        _mm512_set1_epi32(pi as i32),
        _mm512_set1_ps(scale),
    );
    let neg = _mm512_set1_ps(f32::NEG_INFINITY);
    let (rp, n) = (row.as_mut_ptr(), row.len());
    // The visible lanes of chunk `i` (inside the row), and the row's values there scaled.
    let chunk = |i: usize, m: u16| {
        // SAFETY: the mask keeps both loads inside the slices.
        unsafe {
            let id = _mm512_maskz_loadu_epi32(m, ids.as_ptr().add(i).cast());
            let vis = m & (_mm512_cmpeq_epi32_mask(id, si) | _mm512_cmpeq_epi32_mask(id, pi));
            let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, rp.add(i)), sc);
            (vis, x)
        }
    };
    let lanes = crate::vmath::lanes(n);
    let shift = shift.unwrap_or_else(|| {
        let mut max = neg;
        for (i, m) in lanes.clone() {
            let (vis, x) = chunk(i, m);
            max = _mm512_mask_max_ps(max, vis, max, x);
        }
        _mm512_reduce_max_ps(max)
    });
    let (sh, mut sum) = (_mm512_set1_ps(shift), _mm512_setzero_ps());
    for (i, m) in lanes {
        let (vis, x) = chunk(i, m);
        let e = crate::vmath::exp16(_mm512_mask_sub_ps(neg, vis, x, sh));
        sum = _mm512_add_ps(sum, e);
        // SAFETY: the mask keeps the store inside the row.
        unsafe { _mm512_mask_storeu_ps(rp.add(i), m, e) };
    }
    (shift, _mm512_reduce_add_ps(sum))
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

/// Forward in `precision`. Writes `out` (`[tokens, heads·head_dim]`, the tokens as `rows`
/// lays them out) and `lse` (`[batch, heads, seq]`; past a ragged row's length, untouched).
pub fn attention(
    sh: AttnShape,
    rows: Rows<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seg: Segments<'_>,
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
    precision: Precision,
) {
    sh.check(rows, q, k, v, seg);
    assert_eq!(out.len(), q.len(), "attention: out shape");
    assert_eq!(
        lse.len(),
        sh.batch * sh.heads * sh.seq,
        "attention: lse shape"
    );
    match precision {
        Precision::F32 => forward(sh, rows, q, k, v, seg, scale, out, lse, false),
        #[cfg(target_arch = "x86_64")]
        Precision::Bf16
            if crate::matmul::Bf16Kernel::fastest() == crate::matmul::Bf16Kernel::Dot =>
        {
            dpbf16::forward(sh, rows, q, k, v, seg, scale, out, lse);
        }
        Precision::Bf16 => {
            let (q, k, v) = (rounded(q), rounded(k), rounded(v));
            forward(sh, rows, &q, &k, &v, seg, scale, out, lse, true);
        }
    }
}

/// Rounds the causal part of a `[t × t]` matrix (row `i`'s first `i + 1` values) to bf16.
fn round_lower(s: &mut [f32], t: usize) {
    for (i, row) in s.chunks_mut(t).enumerate() {
        row[..=i]
            .iter_mut()
            .for_each(|x| *x = crate::bf16::round(*x));
    }
}

/// The f32 forward; `round`: the probabilities are rounded to bf16 before they weigh `v` (the
/// bf16 rule, on operands the caller rounded).
fn forward(
    sh: AttnShape,
    rows: Rows<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seg: Segments<'_>,
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
    round: bool,
) {
    let (seq, d, nh, nkv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
    let group = nh / nkv;
    let (qs, kvs) = ((nh * d) as isize, (nkv * d) as isize);
    let out_ptr = SendPtr(out.as_mut_ptr());
    lse.par_chunks_mut(seq).enumerate().for_each_init(
        || vec![0.0f32; seq * seq],
        |s, (bh, lse_row)| {
            let (b, h) = (bh / nh, bh % nh);
            let g = h / group;
            let (row0, t) = rows.of(b, seq);
            if t == 0 {
                return;
            }
            let (seg, s, lse_row) = (seg.row(row0, t), &mut s[..t * t], &mut lse_row[..t]);
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
                if round {
                    round_lower(s, t);
                }
                let op = out_ptr.0.add(row0 * nh * d + h * d);
                causal_apply(t, d, s.as_ptr(), vp, kvs, op, qs);
            }
        },
    );
}

/// Backward in `precision` (the forward's). Overwrites `dq`, `dk`, `dv` from `d_out`, the
/// forward's inputs, `out` and `lse`.
pub fn attention_backward(
    sh: AttnShape,
    rows: Rows<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seg: Segments<'_>,
    scale: f32,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    precision: Precision,
) {
    sh.check(rows, q, k, v, seg);
    assert!(out.len() == q.len() && d_out.len() == q.len() && dq.len() == q.len());
    assert!(
        dk.len() == k.len() && dv.len() == v.len(),
        "attention_backward: dk/dv shape"
    );
    let g = Grads { dq, dk, dv };
    match precision {
        Precision::F32 => backward(sh, rows, q, k, v, seg, scale, out, lse, d_out, g, false),
        #[cfg(target_arch = "x86_64")]
        Precision::Bf16
            if crate::matmul::Bf16Kernel::fastest() == crate::matmul::Bf16Kernel::Dot =>
        {
            dpbf16::backward(sh, rows, q, k, v, seg, scale, lse, d_out, g);
        }
        Precision::Bf16 => {
            let (q, k, v, d_out) = (rounded(q), rounded(k), rounded(v), rounded(d_out));
            backward(sh, rows, &q, &k, &v, seg, scale, out, lse, &d_out, g, true);
        }
    }
}

/// Where the backward writes.
struct Grads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

/// `D_i = Σ_c dO[i,c]·O[i,c]` over the head columns `col..col + d` of the rows from `row0`
/// (rows `w` wide), one per value of `dsum`.
fn row_dots(
    dsum: &mut [f32],
    d_out: &[f32],
    out: &[f32],
    row0: usize,
    (w, col, d): (usize, usize, usize),
) {
    for (i, x) in dsum.iter_mut().enumerate() {
        let o = (row0 + i) * w + col;
        *x = crate::dot(&d_out[o..o + d], &out[o..o + d]);
    }
}

/// `dP` (below the diagonal of `[t × t]` `dp`) becomes `dS = P ⊙ (dP − D) · scale`, zero past
/// the diagonal, with `D_i` from `dots` (`Σ dO·O`, f32) or else `Σ_j P_ij·dP_ij` (bf16: the
/// gradient of the softmax itself, which `Σ dO·O` equals only when `O` was made of unrounded
/// operands).
fn softmax_grad(p: &[f32], dp: &mut [f32], t: usize, scale: f32, dots: Option<&[f32]>) {
    for i in 0..t {
        let (pr, dr) = (&p[i * t..=i * t + i], &mut dp[i * t..(i + 1) * t]);
        let di = match dots {
            Some(d) => d[i],
            None => pr.iter().zip(&dr[..=i]).map(|(a, b)| a * b).sum(),
        };
        for (x, &pv) in dr.iter_mut().zip(pr) {
            *x = pv * (*x - di) * scale;
        }
        dr[i + 1..].fill(0.0);
    }
}

/// The f32 backward; `round`: the probabilities and dS are rounded to bf16 before they enter
/// a product (the bf16 rule, on operands the caller rounded).
fn backward(
    sh: AttnShape,
    rows: Rows<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seg: Segments<'_>,
    scale: f32,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    Grads { dq, dk, dv }: Grads<'_>,
    round: bool,
) {
    let (seq, d, nh, nkv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
    let group = nh / nkv;
    let (qs, kvs) = ((nh * d) as isize, (nkv * d) as isize);
    let (dq_p, dk_p, dv_p) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    (0..sh.batch * nkv).into_par_iter().for_each_init(
        || {
            (
                vec![0.0f32; seq * seq],
                vec![0.0f32; seq * seq],
                vec![0.0f32; seq],
            )
        },
        |(p, dp, lse_buf), bg| {
            let (b, g) = (bg / nkv, bg % nkv);
            let (row0, t) = rows.of(b, seq);
            if t == 0 {
                return;
            }
            let (p, dp, lse_buf) = (&mut p[..t * t], &mut dp[..t * t], &mut lse_buf[..t]);
            let seg = seg.row(row0, t);
            let (dq_p, dk_p, dv_p) = (&dq_p, &dk_p, &dv_p);
            for h in g * group..(g + 1) * group {
                let first = h == g * group;
                lse_buf.copy_from_slice(&lse[(b * nh + h) * seq..][..t]);
                let mut dsum = vec![0.0f32; t];
                row_dots(&mut dsum, d_out, out, row0, (nh * d, h * d, d));
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
                    softmax_grad(p, dp, t, scale, (!round).then_some(&dsum[..]));
                    if round {
                        round_lower(p, t);
                        round_lower(dp, t);
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

/// The bf16 products on `vdpbf16ps`: each head's operands are packed once into panels
/// ([`crate::bf16::Panels`]) and the causal products walk register tiles of [`MR`] query rows,
/// so a tile computes only the columns its rows can see.
#[cfg(target_arch = "x86_64")]
mod dpbf16 {
    use super::Segments;
    use super::{AttnShape, Grads, Rows, softmax_grad, softmax_rows};
    use crate::bf16::{MR, NR, Panels, Part, block};
    use crate::embedding::SendPtr;
    use rayon::prelude::*;

    /// `S[i][j] = Σ A[i]·B[j]` for `j ≤ i` (at least; up to the tile's last row) of a `[t × t]`
    /// row-major `s`: `a` holds the `t` query rows, `b` the `t` key rows, both over `kp` pairs.
    ///
    /// # Safety
    /// AVX512-BF16 must be available; `s` must hold `t·t` values.
    unsafe fn causal_scores(t: usize, kp: usize, a: &Panels, b: &Panels, s: *mut f32) {
        for i in 0..t.div_ceil(MR) {
            let (r0, rows) = (i * MR, MR.min(t - i * MR));
            let seen = r0 + rows;
            for j in 0..seen.div_ceil(NR) {
                let cols = NR.min(seen - j * NR);
                // SAFETY: rows r0.. and columns j·NR.. of the `t × t` `s`.
                unsafe {
                    block(
                        a,
                        i,
                        b,
                        j,
                        (0, kp),
                        s.add(r0 * t + j * NR),
                        t,
                        (rows, cols),
                        false,
                    );
                }
            }
        }
    }

    /// `O[i] = Σ_{p ≤ i} P[i][p]·B[p]`: `a` holds `P`'s `t` rows (zero past the diagonal), `b`
    /// the `d` columns of `B` over its `t` rows; `O` rows at stride `so`.
    ///
    /// # Safety
    /// AVX512-BF16 must be available; `o` must address `t` rows of `d` values at stride `so`.
    unsafe fn causal_apply(t: usize, d: usize, a: &Panels, b: &Panels, o: *mut f32, so: usize) {
        for i in 0..t.div_ceil(MR) {
            let (r0, rows) = (i * MR, MR.min(t - i * MR));
            let kc = (r0 + rows).div_ceil(2);
            for j in 0..d.div_ceil(NR) {
                // SAFETY: rows r0.. of `o`, columns j·NR.. of its `d`.
                unsafe {
                    let c = o.add(r0 * so + j * NR);
                    block(
                        a,
                        i,
                        b,
                        j,
                        (0, kc),
                        c,
                        so,
                        (rows, NR.min(d - j * NR)),
                        false,
                    );
                }
            }
        }
    }

    /// `O[c] (+)= Σ_{i ≥ c} M[i][c]·B[i]` for a lower-triangular `[t × t]` `M` (dS or P): `a`
    /// holds `Mᵀ`'s `t` rows (row `c` is zero before column `c`), `b` the `d` columns of `B`
    /// over its `t` rows; a tile skips the pairs before its first row.
    ///
    /// # Safety
    /// As [`causal_apply`].
    unsafe fn causal_apply_t(
        t: usize,
        d: usize,
        a: &Panels,
        b: &Panels,
        o: *mut f32,
        so: usize,
        accumulate: bool,
    ) {
        let kp = t.div_ceil(2);
        for i in 0..t.div_ceil(MR) {
            let (c0, rows) = (i * MR, MR.min(t - i * MR));
            // MR is even, so pair c0/2 starts at column c0.
            let q0 = c0 / 2;
            for j in 0..d.div_ceil(NR) {
                // SAFETY: rows c0.. of `o`, columns j·NR.. of its `d`.
                unsafe {
                    let c = o.add(c0 * so + j * NR);
                    let shape = (rows, NR.min(d - j * NR));
                    block(a, i, b, j, (q0, kp - q0), c, so, shape, accumulate);
                }
            }
        }
    }

    /// Panels of one task: query-side and key-side operands, reused between tasks.
    #[derive(Default)]
    struct Work {
        s: Vec<f32>,
        ds: Vec<f32>,
        a: Panels,
        a2: Panels,
        b: Panels,
        b2: Panels,
        b3: Panels,
        lse: Vec<f32>,
    }

    impl Work {
        fn new(t: usize) -> Self {
            Self {
                s: vec![0.0; t * t],
                ds: vec![0.0; t * t],
                lse: vec![0.0; t],
                ..Self::default()
            }
        }
    }

    /// [`super::attention`] in bf16 on `vdpbf16ps` (the caller checked the CPU and shapes).
    pub(super) fn forward(
        sh: AttnShape,
        rows: Rows<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        seg: Segments<'_>,
        scale: f32,
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        let (seq, d, nh, nkv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
        let group = nh / nkv;
        let (qs, kvs) = (nh * d, nkv * d);
        let out_ptr = SendPtr(out.as_mut_ptr());
        lse.par_chunks_mut(seq).enumerate().for_each_init(
            || Work::new(seq),
            |w, (bh, lse_row)| {
                let (b, h) = (bh / nh, bh % nh);
                let g = h / group;
                let (row0, t) = rows.of(b, seq);
                if t == 0 {
                    return;
                }
                let (seg, lse_row) = (seg.row(row0, t), &mut lse_row[..t]);
                let out_ptr = &out_ptr;
                let (qh, kg, vg) = (
                    &q[row0 * qs + h * d..],
                    &k[row0 * kvs + g * d..],
                    &v[row0 * kvs + g * d..],
                );
                // SAFETY: `available()` was checked by the caller; the views hold `t` rows at
                // their strides (the batch has row0 + t rows); this task alone writes its
                // head's columns of `out`.
                unsafe {
                    w.a.pack(qh, t, d, qs, 1, true);
                    w.b.pack(kg, t, d, kvs, 1, false);
                    causal_scores(t, d.div_ceil(2), &w.a, &w.b, w.s.as_mut_ptr());
                    softmax_rows(&mut w.s[..t * t], t, seg, scale, lse_row, false);
                    w.a.pack_part(&w.s, t, t, (t, 1), true, Part::Lower);
                    w.b.pack(vg, d, t, 1, kvs, false);
                    let o = out_ptr.0.add(row0 * qs + h * d);
                    causal_apply(t, d, &w.a, &w.b, o, qs);
                }
            },
        );
    }

    /// [`super::attention_backward`] in bf16 on `vdpbf16ps` (the caller checked the CPU and
    /// shapes); the forward's output is not needed (`D` comes from the probabilities).
    pub(super) fn backward(
        sh: AttnShape,
        rows: Rows<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        seg: Segments<'_>,
        scale: f32,
        lse: &[f32],
        d_out: &[f32],
        Grads { dq, dk, dv }: Grads<'_>,
    ) {
        let (seq, d, nh, nkv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
        let group = nh / nkv;
        let (qs, kvs) = (nh * d, nkv * d);
        let (dq_p, dk_p, dv_p) = (
            SendPtr(dq.as_mut_ptr()),
            SendPtr(dk.as_mut_ptr()),
            SendPtr(dv.as_mut_ptr()),
        );
        (0..sh.batch * nkv).into_par_iter().for_each_init(
            || Work::new(seq),
            |w, bg| {
                let (b, g) = (bg / nkv, bg % nkv);
                let (row0, t) = rows.of(b, seq);
                if t == 0 {
                    return;
                }
                let seg = seg.row(row0, t);
                let (dq_p, dk_p, dv_p) = (&dq_p, &dk_p, &dv_p);
                let (kg, vg) = (&k[row0 * kvs + g * d..], &v[row0 * kvs + g * d..]);
                // SAFETY: as below.
                unsafe {
                    w.b.pack(kg, t, d, kvs, 1, false);
                    w.b2.pack(vg, t, d, kvs, 1, false);
                }
                for h in g * group..(g + 1) * group {
                    let first = h == g * group;
                    w.lse[..t].copy_from_slice(&lse[(b * nh + h) * seq..][..t]);
                    let (qh, doh) = (&q[row0 * qs + h * d..], &d_out[row0 * qs + h * d..]);
                    // SAFETY: as in the forward; task (b, g) alone writes dk/dv columns of kv
                    // head g and dq columns of the heads in its group.
                    unsafe {
                        // P, recomputed from the forward's log-sum-exp.
                        w.a.pack(qh, t, d, qs, 1, true);
                        causal_scores(t, d.div_ceil(2), &w.a, &w.b, w.s.as_mut_ptr());
                        softmax_rows(&mut w.s[..t * t], t, seg, scale, &mut w.lse[..t], true);
                        // dP = dO · Vᵀ, then dS = P ⊙ (dP − D) · scale below the diagonal.
                        w.a2.pack(doh, t, d, qs, 1, true);
                        causal_scores(t, d.div_ceil(2), &w.a2, &w.b2, w.ds.as_mut_ptr());
                        softmax_grad(&w.s[..t * t], &mut w.ds[..t * t], t, scale, None);
                        // dQ = dS · K
                        w.a.pack_part(&w.ds, t, t, (t, 1), true, Part::Lower);
                        w.b3.pack(kg, d, t, 1, kvs, false);
                        let dqh = dq_p.0.add(row0 * qs + h * d);
                        causal_apply(t, d, &w.a, &w.b3, dqh, qs);
                        // dK (+)= dSᵀ · Q and dV (+)= Pᵀ · dO
                        let dkg = dk_p.0.add(row0 * kvs + g * d);
                        let dvg = dv_p.0.add(row0 * kvs + g * d);
                        w.a.pack_part(&w.ds, t, t, (1, t), true, Part::Upper);
                        w.b3.pack(qh, d, t, 1, qs, false);
                        causal_apply_t(t, d, &w.a, &w.b3, dkg, kvs, !first);
                        w.a.pack_part(&w.s, t, t, (1, t), true, Part::Upper);
                        w.b3.pack(doh, d, t, 1, qs, false);
                        causal_apply_t(t, d, &w.a, &w.b3, dvg, kvs, !first);
                    }
                }
            },
        );
    }
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
        seg: Segments<'_>,
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
                        if seg.visible(b * t + i, b * t + j) {
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

    /// Forward and backward of one shape in `p`, checked against the f64 reference (of the
    /// bf16-rounded inputs, to bf16's tolerance, in bf16); returns (out, dq, dk, dv).
    fn check_shape(sh: AttnShape, seg: Segments<'_>, p: Precision, probes: usize) -> [Vec<f32>; 4] {
        let n = sh.batch * sh.seq;
        let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
        let (q, k, v) = (randn(n * qw, 11), randn(n * kw, 12), randn(n * kw, 13));
        let coef = randn(n * qw, 14);
        let scale = 1.0 / (sh.head_dim as f32).sqrt();
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; sh.batch * sh.heads * sh.seq];
        attention(
            sh,
            Rows::Full,
            &q,
            &k,
            &v,
            seg,
            scale,
            &mut out,
            &mut lse,
            p,
        );
        // What the products see: bf16 rounds the inputs (and the probabilities, which the
        // reference does not: that is within the tolerance).
        let (tol_out, tol_grad) = match p {
            Precision::F32 => (1e-5, 1e-3),
            Precision::Bf16 => (2e-2, 3e-2),
        };
        let seen = |x: &[f32]| -> Vec<f64> {
            x.iter()
                .map(|&v| match p {
                    Precision::F32 => v as f64,
                    Precision::Bf16 => crate::bf16::round(v) as f64,
                })
                .collect()
        };
        let (q64, k64, v64) = (seen(&q), seen(&k), seen(&v));
        let s = scale as f64;
        let (_, ref_out) = reference(sh, &q64, &k64, &v64, seg, s, &coef);
        let ref_out: Vec<f32> = ref_out.iter().map(|&x| x as f32).collect();
        close(&out, &ref_out, tol_out, &format!("{p:?} attention out"));

        let (mut dq, mut dk, mut dv) = (vec![9.0; q.len()], vec![9.0; k.len()], vec![9.0; v.len()]);
        attention_backward(
            sh,
            Rows::Full,
            &q,
            &k,
            &v,
            seg,
            scale,
            &out,
            &lse,
            &coef,
            &mut dq,
            &mut dk,
            &mut dv,
            p,
        );
        let f32s = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let what = |x: &str| format!("{p:?} attention {x}");
        check_grad(&f32s(&q64), &dq, 2 * probes, tol_grad, &what("dq"), &|x| {
            reference(sh, x, &k64, &v64, seg, s, &coef).0
        });
        check_grad(&f32s(&k64), &dk, probes, tol_grad, &what("dk"), &|x| {
            reference(sh, &q64, x, &v64, seg, s, &coef).0
        });
        check_grad(&f32s(&v64), &dv, probes, tol_grad, &what("dv"), &|x| {
            reference(sh, &q64, &k64, x, seg, s, &coef).0
        });
        [out, dq, dk, dv]
    }

    #[test]
    fn forward_and_backward_match_an_f64_reference_in_either_precision() {
        // Row 0 padded after 5 tokens, row 1 two packed segments (head_dim odd); then 150
        // tokens (three causal blocks, the last one ragged) in two segments; then a row of a
        // shared prefix (segment 5) that two segments (6 and 7) also see, and padding; then 150
        // tokens of which the last two segments share the first 100 as their prefix (across
        // causal blocks); then 300 tokens (bf16: more pairs than one k block) with a head of
        // one and a partial column panel.
        let seg7 = [0u32, 0, 0, 0, 0, 9, 9, 1, 1, 1, 2, 2, 2, 2];
        let seg150: Vec<u32> = (0..150).map(|i| u32::from(i >= 100)).collect();
        let tree12 = [5u32, 5, 5, 6, 6, 6, 7, 7, 7, 7, 9, 9];
        let sees12 = [5u32, 5, 5, 5, 5, 5, 5, 5, 5, 5, 9, 9];
        let tree150: Vec<u32> = (0..150)
            .map(|i| (i >= 100) as u32 + (i >= 125) as u32)
            .collect();
        let sees150 = vec![0u32; 150];
        let seg300: Vec<u32> = (0..300).map(|i| u32::from(i >= 280)).collect();
        let shape = |batch, seq, heads, kv_heads, head_dim| AttnShape {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim,
        };
        let shared = |ids, sees| Segments { ids, sees };
        let cases = [
            (shape(2, 7, 4, 2, 5), Segments::own(&seg7), 70),
            (shape(1, 150, 2, 1, 4), Segments::own(&seg150), 70),
            (shape(1, 12, 2, 2, 3), shared(&tree12[..], &sees12[..]), 70),
            (
                shape(1, 150, 2, 1, 4),
                shared(&tree150[..], &sees150[..]),
                70,
            ),
            (shape(1, 300, 2, 1, 40), Segments::own(&seg300), 12),
        ];
        for (sh, seg, probes) in cases {
            check_shape(sh, seg, Precision::F32, probes);
            let bf16 = check_shape(sh, seg, Precision::Bf16, probes);
            // Without AVX512-BF16 `Bf16` is the rounding path itself; with it, the rounding
            // path gives what `vdpbf16ps` gives, up to the f32 sums' order (which can move a
            // probability across a bf16 rounding boundary: hence not 1e-6).
            if crate::bf16::available() {
                let n = sh.batch * sh.seq;
                let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
                let r = |x: Vec<f32>| rounded(&x);
                let (q, k, v) = (
                    r(randn(n * qw, 11)),
                    r(randn(n * kw, 12)),
                    r(randn(n * kw, 13)),
                );
                let coef = randn(n * qw, 14);
                let scale = 1.0 / (sh.head_dim as f32).sqrt();
                let mut out = vec![0.0; q.len()];
                let mut lse = vec![0.0; n * sh.heads];
                forward(
                    sh,
                    Rows::Full,
                    &q,
                    &k,
                    &v,
                    seg,
                    scale,
                    &mut out,
                    &mut lse,
                    true,
                );
                let (mut dq, mut dk, mut dv) =
                    (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
                let g = Grads {
                    dq: &mut dq,
                    dk: &mut dk,
                    dv: &mut dv,
                };
                let d_out = r(coef);
                backward(
                    sh,
                    Rows::Full,
                    &q,
                    &k,
                    &v,
                    seg,
                    scale,
                    &out,
                    &lse,
                    &d_out,
                    g,
                    true,
                );
                for (name, hw, emu) in [
                    ("out", &bf16[0], &out),
                    ("dq", &bf16[1], &dq),
                    ("dk", &bf16[2], &dk),
                    ("dv", &bf16[3], &dv),
                ] {
                    close(
                        hw,
                        emu,
                        5e-3,
                        &format!("{sh:?} vdpbf16ps vs rounding: {name}"),
                    );
                }
            }
        }
    }

    /// Rows without their padding tails, side by side ([`Rows::Ragged`]), give each real
    /// token's output and gradients bit for bit as the padded batch does, in either precision;
    /// the log-sum-exp too, where a row has a token.
    #[test]
    fn ragged_rows_are_the_padded_batch_without_its_padding() {
        const PAD: u32 = u32::MAX;
        let sh = AttnShape {
            batch: 4,
            seq: 70,
            heads: 2,
            kv_heads: 1,
            head_dim: 24,
        };
        // Real lengths: a full row, a packed row with a tail of padding, an empty row, and a
        // row past one causal block.
        let lens = [70usize, 33, 0, 66];
        let (mut ids, mut sees) = (Vec::new(), Vec::new());
        for (b, &len) in lens.iter().enumerate() {
            for i in 0..sh.seq {
                let (id, seen) = match i {
                    _ if i >= len => (PAD, PAD),
                    _ if i < 10 => (10 * b as u32, 10 * b as u32),
                    _ => (10 * b as u32 + 1 + (i % 3 == 0) as u32, 10 * b as u32),
                };
                ids.push(id);
                sees.push(seen);
            }
        }
        let n = sh.batch * sh.seq;
        let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
        let (q, k, v, d_out) = (
            randn(n * qw, 21),
            randn(n * kw, 22),
            randn(n * kw, 23),
            randn(n * qw, 24),
        );
        let real: Vec<usize> = (0..n).filter(|&i| i % sh.seq < lens[i / sh.seq]).collect();
        let pick = |x: &[f32], w: usize| -> Vec<f32> {
            real.iter()
                .flat_map(|&i| x[i * w..][..w].to_vec())
                .collect()
        };
        let pick_u32 = |x: &[u32]| -> Vec<u32> { real.iter().map(|&i| x[i]).collect() };
        let mut rows = Vec::new();
        let mut start = 0;
        for &len in &lens {
            rows.push((start, len));
            start += len;
        }
        let (rids, rsees) = (pick_u32(&ids), pick_u32(&sees));
        // One kernel (its outputs: out, dq, dk, dv, lse) on the padded batch and on its ragged
        // rows, compared at the real tokens.
        type Kernel<'k> = dyn Fn(Rows<'_>, Segments<'_>, [&[f32]; 4]) -> [Vec<f32>; 5] + 'k;
        let check = |what: &str, kernel: &Kernel<'_>| {
            let full = kernel(
                Rows::Full,
                Segments {
                    ids: &ids,
                    sees: &sees,
                },
                [&q, &k, &v, &d_out],
            );
            let (rq, rk, rv, rd) = (pick(&q, qw), pick(&k, kw), pick(&v, kw), pick(&d_out, qw));
            let ragged = kernel(
                Rows::Ragged(&rows),
                Segments {
                    ids: &rids,
                    sees: &rsees,
                },
                [&rq, &rk, &rv, &rd],
            );
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
                let w = if i < 2 { qw } else { kw };
                assert_eq!(bits(&pick(&full[i], w)), bits(&ragged[i]), "{what} {name}");
            }
            for (bh, (f, r)) in full[4]
                .chunks(sh.seq)
                .zip(ragged[4].chunks(sh.seq))
                .enumerate()
            {
                let len = lens[bh / sh.heads];
                assert_eq!(bits(&f[..len]), bits(&r[..len]), "{what} lse of row {bh}");
            }
        };
        let lse_len = sh.batch * sh.heads * sh.seq;
        for p in [Precision::F32, Precision::Bf16] {
            check(&format!("{p:?}"), &|rows, seg, [q, k, v, d_out]| {
                let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; lse_len]);
                attention(sh, rows, q, k, v, seg, 0.3, &mut out, &mut lse, p);
                let (mut dq, mut dk, mut dv) =
                    (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
                attention_backward(
                    sh, rows, q, k, v, seg, 0.3, &out, &lse, d_out, &mut dq, &mut dk, &mut dv, p,
                );
                [out, dq, dk, dv, lse]
            });
        }
        // The `vdpbf16ps` kernels too, where this CPU has them but bf16 takes the FMA path.
        #[cfg(target_arch = "x86_64")]
        if crate::bf16::available() {
            check("vdpbf16ps", &|rows, seg, [q, k, v, d_out]| {
                let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; lse_len]);
                dpbf16::forward(sh, rows, q, k, v, seg, 0.3, &mut out, &mut lse);
                let (mut dq, mut dk, mut dv) =
                    (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
                let g = Grads {
                    dq: &mut dq,
                    dk: &mut dk,
                    dv: &mut dv,
                };
                dpbf16::backward(sh, rows, q, k, v, seg, 0.3, &lse, d_out, g);
                [out, dq, dk, dv, lse]
            });
        }
    }
}
