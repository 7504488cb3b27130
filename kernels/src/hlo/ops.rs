//! The model's ops in the traced vocabulary, one function per eager kernel of this crate
//! (`linear` ↔ `matmul`, `rmsnorm` ↔ `norm`, `rope` ↔ `rope`, `attention` ↔ `attention`,
//! `swiglu` ↔ `activation`, `logprob_entropy` ↔ `head`, `adamw` ↔ `optim`), with the same
//! semantics; `parity` tests each pair, forward and gradient. Also the host-side tables the
//! traced ops take as inputs (RoPE's cos/sin, the rotate-half matrix, the attention mask).

use super::{Cmp, Graph, Un, V};
use crate::attention::Segments;

/// `x · Wᵀ (+ b)`: `x` is `[n, in]`, `w` is `[out, in]`, `b` is `[out]`; the product in the
/// graph's linear precision.
pub fn linear(g: &mut Graph, x: V, w: V, b: Option<V>) -> V {
    let y = g.linear_dot(x, w, 0, 1, 1);
    match b {
        None => y,
        Some(b) => {
            let dims = g.dims(y);
            let bb = g.broadcast(b, &dims, &[1]);
            g.add(y, bb)
        }
    }
}

/// RMSNorm over the last dimension of `x`, scaled by `w` (`[dim]`).
pub fn rmsnorm(g: &mut Graph, x: V, w: V, eps: f32) -> V {
    let dims = g.dims(x);
    let last = dims.len() - 1;
    let dim = dims[last];
    let sq = g.mul(x, x);
    let ss = g.sum(sq, &[last]);
    let ms = g.scale(ss, 1.0 / dim as f32);
    let e = g.full_like(eps, ms);
    let t = g.add(ms, e);
    let inv = g.un(Un::Rsqrt, t);
    let keep: Vec<usize> = (0..last).collect();
    let invb = g.broadcast(inv, &dims, &keep);
    let wb = g.broadcast(w, &dims, &[last]);
    let y = g.mul(x, invb);
    g.mul(y, wb)
}

/// Rotary embedding of `x` (`[n, heads·d]`) in `rotate_half` layout: `x·cos + rotate_half(x)·sin`
/// with `cos`, `sin` as [`rope_tables`] gives them (`[n, d]`) and `rot` the [`rotate_half`]
/// matrix (`[d, d]`).
pub fn rope(g: &mut Graph, x: V, heads: usize, cos: V, sin: V, rot: V) -> V {
    let [n, hd] = g.dims(x)[..] else {
        panic!("rope: x must be [n, heads·d]")
    };
    let d = hd / heads;
    let flat = g.reshape(x, &[n * heads, d]);
    let r = g.dot(flat, rot, 0, 1, 0);
    let r = g.reshape(r, &[n, heads, d]);
    let x3 = g.reshape(x, &[n, heads, d]);
    let cb = g.broadcast(cos, &[n, heads, d], &[0, 2]);
    let sb = g.broadcast(sin, &[n, heads, d], &[0, 2]);
    let a = g.mul(x3, cb);
    let b = g.mul(r, sb);
    let y = g.add(a, b);
    g.reshape(y, &[n, hd])
}

/// Full-width RoPE tables (`[n, d]` each: each half-table repeated) for [`rope`].
pub fn rope_tables(t: &crate::rope::RopeTable) -> (Vec<f32>, Vec<f32>) {
    let h = t.half;
    let n = t.cos.len() / h.max(1);
    let (mut c, mut s) = (Vec::with_capacity(2 * n * h), Vec::with_capacity(2 * n * h));
    for i in 0..n {
        for _ in 0..2 {
            c.extend_from_slice(&t.cos[i * h..(i + 1) * h]);
            s.extend_from_slice(&t.sin[i * h..(i + 1) * h]);
        }
    }
    (c, s)
}

/// The `[d, d]` matrix `R` with `x·R = rotate_half(x) = [-x₂, x₁]`.
pub fn rotate_half(d: usize) -> Vec<f32> {
    let h = d / 2;
    let mut r = vec![0.0; d * d];
    for j in 0..h {
        r[(j + h) * d + j] = -1.0;
        r[j * d + j + h] = 1.0;
    }
    r
}

/// The additive attention mask (`[rows, seq, seq]`: 0 where query `i` sees key `j`, that is
/// `j ≤ i` and visible by `seg`, as [`crate::attention`]; a large negative number elsewhere).
pub fn attention_bias(rows: usize, seq: usize, seg: Segments<'_>) -> Vec<f32> {
    assert_eq!(seg.ids.len(), rows * seq, "attention_bias: segments");
    assert_eq!(seg.sees.len(), rows * seq, "attention_bias: `sees`");
    let mut b = vec![-1e30f32; rows * seq * seq];
    for r in 0..rows {
        for i in 0..seq {
            for j in 0..=i {
                if seg.visible(r * seq + i, r * seq + j) {
                    b[(r * seq + i) * seq + j] = 0.0;
                }
            }
        }
    }
    b
}

/// Shape of an attention call (as [`crate::attention::AttnShape`]).
#[derive(Clone, Copy, Debug)]
pub struct Attn {
    pub rows: usize,
    /// Queries per row.
    pub seq: usize,
    /// Keys per row: `seq` within a batch, the cache length over a KV cache.
    pub keys: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Grouped-query attention: `q` `[rows·seq, heads·d]`, `k`, `v` `[rows·keys, kv_heads·d]`,
/// `bias` `[rows, seq, keys]` (from [`attention_bias`] for causal attention within a batch, or
/// a cache mask); returns `[rows·seq, heads·d]`. Query head `h` reads kv head `h / (heads /
/// kv_heads)`, as `transformers`' `repeat_kv`.
pub fn attention(g: &mut Graph, a: Attn, q: V, k: V, v: V, bias: V) -> V {
    let (r, s, l, d, kv) = (a.rows, a.seq, a.keys, a.head_dim, a.kv_heads);
    let grp = a.heads / kv;
    // q: [r, s, kv, grp, d] → [r, kv, grp, s, d] → [r·kv, grp·s, d]
    let q5 = g.reshape(q, &[r, s, kv, grp, d]);
    let q5 = g.transpose(q5, &[0, 2, 3, 1, 4]);
    let q3 = g.reshape(q5, &[r * kv, grp * s, d]);
    // k, v: [r, l, kv, d] → [r, kv, l, d] → [r·kv, l, d]
    let kv3 = |g: &mut Graph, x: V| {
        let x4 = g.reshape(x, &[r, l, kv, d]);
        let x4 = g.transpose(x4, &[0, 2, 1, 3]);
        g.reshape(x4, &[r * kv, l, d])
    };
    let k3 = kv3(g, k);
    let v3 = kv3(g, v);
    // Attention's products in the graph's linear precision (bf16 rounds q, k, v and p, as the
    // native kernel does); the softmax stays f32.
    let scores = g.linear_dot(q3, k3, 1, 2, 2); // [r·kv, grp·s, l]
    let scores = g.scale(scores, a.scale);
    let b5 = g.broadcast(bias, &[r, kv, grp, s, l], &[0, 3, 4]);
    let b3 = g.reshape(b5, &[r * kv, grp * s, l]);
    let z = g.add(scores, b3);
    let p = softmax_last(g, z);
    let o = g.linear_dot(p, v3, 1, 2, 1); // [r·kv, grp·s, d]
    let o5 = g.reshape(o, &[r, kv, grp, s, d]);
    let o5 = g.transpose(o5, &[0, 3, 1, 2, 4]);
    g.reshape(o5, &[r * s, a.heads * d])
}

/// The mask of new tokens over a KV cache (`[rows, new, len]`): query `t` of row `r`, at
/// position `starts[r] + t`, sees cache slots `0..=starts[r] + t`.
pub fn cache_bias(starts: &[usize], new: usize, len: usize) -> Vec<f32> {
    let mut b = vec![-1e30f32; starts.len() * new * len];
    for (r, &s) in starts.iter().enumerate() {
        for t in 0..new {
            let visible = (s + t + 1).min(len);
            b[(r * new + t) * len..(r * new + t) * len + visible].fill(0.0);
        }
    }
    b
}

/// Softmax over the last dimension.
pub fn softmax_last(g: &mut Graph, z: V) -> V {
    let dims = g.dims(z);
    let last = dims.len() - 1;
    let keep: Vec<usize> = (0..last).collect();
    let m = g.max_stop_grad(z, &[last]);
    let mb = g.broadcast(m, &dims, &keep);
    let zs = g.sub(z, mb);
    let e = g.un(Un::Exp, zs);
    let sum = g.sum(e, &[last]);
    let sb = g.broadcast(sum, &dims, &keep);
    g.div(e, sb)
}

/// `silu(gate) · up`.
pub fn swiglu(g: &mut Graph, gate: V, up: V) -> V {
    let sg = g.un(Un::Logistic, gate);
    let silu = g.mul(gate, sg);
    g.mul(silu, up)
}

/// The output head: tempered logits `x·Wᵀ · inv_t` (`x` `[n, dim]`, `w` `[vocab, dim]`,
/// `inv_t` an f32 scalar), their log-softmax, the log-prob of each `targets` (i32 `[n]`) and
/// the entropy. Returns `(logp, entropy)`, `[n]` each.
pub fn logprob_entropy(g: &mut Graph, x: V, w: V, targets: V, inv_t: V) -> (V, V) {
    let logits = g.linear_dot(x, w, 0, 1, 1);
    let dims = g.dims(logits);
    let it = g.broadcast(inv_t, &dims, &[]);
    let z = g.mul(logits, it);
    let m = g.max_stop_grad(z, &[1]);
    let mb = g.broadcast(m, &dims, &[0]);
    let zs = g.sub(z, mb);
    let e = g.un(Un::Exp, zs);
    let sum = g.sum(e, &[1]);
    let ls = g.un(Un::Log, sum);
    let lsb = g.broadcast(ls, &dims, &[0]);
    let logsm = g.sub(zs, lsb);
    let iota = g.iota(&dims, 1);
    let tb = g.broadcast(targets, &dims, &[0]);
    let hit = g.cmp(Cmp::Eq, iota, tb);
    let zero = g.full_like(0.0, logsm);
    let picked = g.select(hit, logsm, zero);
    let logp = g.sum(picked, &[1]);
    let p = g.un(Un::Exp, logsm);
    let plogp = g.mul(p, logsm);
    let s = g.sum(plogp, &[1]);
    let ent = g.un(Un::Neg, s);
    (logp, ent)
}

/// Scalars of one AdamW update, computed on the host as [`crate::optim::AdamW::update`] does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwScalars {
    /// `1 - lr·weight_decay`.
    pub decay: f32,
    /// `lr / (1 - β₁ᵗ)`.
    pub step_size: f32,
    /// `sqrt(1 - β₂ᵗ)`.
    pub bc2_sqrt: f32,
    /// The gradient's clipping factor (1: none).
    pub clip: f32,
}

impl AdamwScalars {
    /// The values [`adamw`] takes, in its argument order.
    pub fn to_vec(self) -> [f32; 4] {
        [self.decay, self.step_size, self.bc2_sqrt, self.clip]
    }

    /// As [`crate::optim::AdamW::update`] computes them for update number `step` (from 1).
    pub fn new(hp: &crate::optim::AdamW, step: u64, clip: f32) -> Self {
        let bc1 = 1.0 - (hp.beta1 as f64).powf(step as f64);
        let bc2 = 1.0 - (hp.beta2 as f64).powf(step as f64);
        Self {
            decay: 1.0 - hp.lr * hp.weight_decay,
            step_size: (hp.lr as f64 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            clip,
        }
    }
}

/// One AdamW update of a parameter `p` with gradient `grad` and moments `m`, `v`, with `hp`'s
/// β₁, β₂, ε baked in and the per-step scalars as f32 scalar values (`s` = decay, step size,
/// sqrt(1-β₂ᵗ), clip factor). Returns `(p', m', v')`, as [`crate::optim::AdamW::update`].
pub fn adamw(
    g: &mut Graph,
    p: V,
    grad: V,
    m: V,
    v: V,
    s: [V; 4],
    hp: &crate::optim::AdamW,
) -> (V, V, V) {
    let (beta1, beta2, eps) = (hp.beta1, hp.beta2, hp.eps);
    let dims = g.dims(p);
    let [decay, step, bc2s, clip] = s.map(|x| g.broadcast(x, &dims, &[]));
    let gr = g.mul(grad, clip);
    let pd = g.mul(p, decay);
    let m1 = g.scale(m, beta1);
    let gm = g.scale(gr, 1.0 - beta1);
    let m2 = g.add(m1, gm);
    let v1 = g.scale(v, beta2);
    let g2 = g.mul(gr, gr);
    let gv = g.scale(g2, 1.0 - beta2);
    let v2 = g.add(v1, gv);
    let sq = g.un(Un::Sqrt, v2);
    let den = g.div(sq, bc2s);
    let e = g.full_like(eps, den);
    let den = g.add(den, e);
    let upd = g.div(m2, den);
    let upd = g.mul(upd, step);
    let p2 = g.sub(pd, upd);
    (p2, m2, v2)
}

/// `Σ x²` over all of `x`, as an f32 scalar.
pub fn sum_sq(g: &mut Graph, x: V) -> V {
    let sq = g.mul(x, x);
    let all: Vec<usize> = (0..g.dims(x).len()).collect();
    if all.is_empty() { sq } else { g.sum(sq, &all) }
}
