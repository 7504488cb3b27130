//! Each traced op against its eager kernel, forward and gradient, compiled and run by the XLA
//! CPU plugin (fetched by `.ci/setup` the first time; `TRELLIS_SKIP_PJRT=1` skips, saying so);
//! and the primitives' gradients against finite differences.

use super::ops::{self, Attn};
use super::{Bin, Graph, Shape, Un, V};
use crate::testutil::{close, randn};
use libtpu_sys::pjrt::{Buffer, Client};

fn client() -> Option<Client> {
    libtpu_sys::testing::cpu_client()
}

enum In<'a> {
    F(&'a [f32]),
    I(&'a [u32]),
}

/// Compiles `outputs` of `g` and runs it on `inputs` (one per argument, in order).
fn run(c: &Client, g: &Graph, outputs: &[V], inputs: &[In<'_>]) -> Vec<Vec<f32>> {
    let text = g.emit(outputs, &[]);
    let exe = c.compile(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let bufs: Vec<Buffer> = inputs
        .iter()
        .zip(&g.args)
        .map(|(x, &a)| {
            let dims = g.dims(a);
            match x {
                In::F(v) => c.f32(v, &dims).unwrap(),
                In::I(v) => {
                    let v: Vec<i32> = v.iter().map(|&t| t as i32).collect();
                    c.i32(&v, &dims).unwrap()
                }
            }
        })
        .collect();
    let refs: Vec<&Buffer> = bufs.iter().collect();
    exe.run(&refs)
        .unwrap()
        .iter()
        .map(|b| b.to_f32().unwrap())
        .collect()
}

#[test]
fn rmsnorm_and_its_gradient_match_the_kernel() {
    let Some(c) = client() else { return };
    let (n, dim) = (6, 16);
    let (x, w, dy) = (randn(n * dim, 1), randn(dim, 2), randn(n * dim, 3));
    let mut g = Graph::new();
    let (xv, wv, dyv) = (
        g.arg(Shape::f32(&[n, dim])),
        g.arg(Shape::f32(&[dim])),
        g.arg(Shape::f32(&[n, dim])),
    );
    let y = ops::rmsnorm(&mut g, xv, wv, 1e-6);
    let d = g.vjp(&[(y, dyv)], &[xv, wv]);
    let out = run(
        &c,
        &g,
        &[y, d[0], d[1]],
        &[In::F(&x), In::F(&w), In::F(&dy)],
    );
    let (mut ye, mut inv) = (vec![0.0; n * dim], vec![0.0; n]);
    crate::norm::rmsnorm(&x, &w, 1e-6, &mut ye, &mut inv);
    let (mut dx, mut dw) = (vec![0.0; n * dim], vec![0.0; dim]);
    crate::norm::rmsnorm_backward(&x, &w, &inv, &dy, &mut dx, &mut dw);
    close(&out[0], &ye, 1e-5, "rmsnorm y");
    close(&out[1], &dx, 1e-4, "rmsnorm dx");
    close(&out[2], &dw, 1e-4, "rmsnorm dw");
}

#[test]
fn rope_and_its_gradient_match_the_kernel() {
    let Some(c) = client() else { return };
    let (n, heads, d) = (5, 3, 8);
    let positions = [0u32, 1, 7, 30, 2];
    let table = crate::rope::RopeTable::new(&positions, &crate::rope::inv_freq(d, 1e4, None));
    let (cos, sin) = ops::rope_tables(&table);
    let rot = ops::rotate_half(d);
    let (x, dy) = (randn(n * heads * d, 4), randn(n * heads * d, 5));
    let mut g = Graph::new();
    let xv = g.arg(Shape::f32(&[n, heads * d]));
    let cv = g.arg(Shape::f32(&[n, d]));
    let sv = g.arg(Shape::f32(&[n, d]));
    let rv = g.arg(Shape::f32(&[d, d]));
    let dyv = g.arg(Shape::f32(&[n, heads * d]));
    let y = ops::rope(&mut g, xv, heads, cv, sv, rv);
    let dx = g.vjp(&[(y, dyv)], &[xv])[0];
    let out = run(
        &c,
        &g,
        &[y, dx],
        &[In::F(&x), In::F(&cos), In::F(&sin), In::F(&rot), In::F(&dy)],
    );
    let mut ye = x.clone();
    crate::rope::apply(&mut ye, heads, &table, false);
    let mut dxe = dy.clone();
    crate::rope::apply(&mut dxe, heads, &table, true);
    close(&out[0], &ye, 1e-5, "rope y");
    close(&out[1], &dxe, 1e-5, "rope dx");
}

#[test]
fn grouped_query_attention_with_padding_matches_the_kernel() {
    let Some(c) = client() else { return };
    let sh = crate::attention::AttnShape {
        batch: 2,
        seq: 5,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let n = sh.batch * sh.seq;
    let scale = 1.0 / (sh.head_dim as f32).sqrt();
    // Row 0 packs two segments; row 1 has a prefix (3) that two segments see, then padding.
    let ids = [0u32, 0, 1, 1, 1, 3, 3, 4, 5, u32::MAX];
    let sees = [0u32, 0, 1, 1, 1, 3, 3, 3, 3, u32::MAX];
    let seg = crate::attention::Segments {
        ids: &ids,
        sees: &sees,
    };
    let (qd, kd) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    let (q, k, v, dout) = (
        randn(n * qd, 6),
        randn(n * kd, 7),
        randn(n * kd, 8),
        randn(n * qd, 9),
    );
    let bias = ops::attention_bias(sh.batch, sh.seq, seg);
    let mut g = Graph::new();
    let qv = g.arg(Shape::f32(&[n, qd]));
    let kv = g.arg(Shape::f32(&[n, kd]));
    let vv = g.arg(Shape::f32(&[n, kd]));
    let bv = g.arg(Shape::f32(&[sh.batch, sh.seq, sh.seq]));
    let dv = g.arg(Shape::f32(&[n, qd]));
    let a = Attn {
        rows: sh.batch,
        seq: sh.seq,
        keys: sh.seq,
        heads: sh.heads,
        kv_heads: sh.kv_heads,
        head_dim: sh.head_dim,
        scale,
    };
    let o = ops::attention(&mut g, a, qv, kv, vv, bv);
    let d = g.vjp(&[(o, dv)], &[qv, kv, vv]);
    let out = run(
        &c,
        &g,
        &[o, d[0], d[1], d[2]],
        &[In::F(&q), In::F(&k), In::F(&v), In::F(&bias), In::F(&dout)],
    );
    let mut oe = vec![0.0; n * qd];
    let mut lse = vec![0.0; sh.batch * sh.heads * sh.seq];
    crate::attention::attention(
        sh,
        crate::attention::Rows::Full,
        &q,
        &k,
        &v,
        seg,
        scale,
        &mut oe,
        &mut lse,
        crate::matmul::Precision::F32,
    );
    let (mut dq, mut dk, mut dve) = (vec![0.0; n * qd], vec![0.0; n * kd], vec![0.0; n * kd]);
    crate::attention::attention_backward(
        sh,
        crate::attention::Rows::Full,
        &q,
        &k,
        &v,
        seg,
        scale,
        &oe,
        &lse,
        &dout,
        &mut dq,
        &mut dk,
        &mut dve,
        crate::matmul::Precision::F32,
    );
    close(&out[0], &oe, 1e-5, "attention out");
    close(&out[1], &dq, 1e-4, "attention dq");
    close(&out[2], &dk, 1e-4, "attention dk");
    close(&out[3], &dve, 1e-4, "attention dv");
}

#[test]
fn swiglu_linear_and_embedding_match_the_kernels() {
    let Some(c) = client() else { return };
    let (n, inp, out_dim, vocab) = (4, 6, 5, 9);
    let ids = [3u32, 0, 8, 3];
    let (table, w, b) = (
        randn(vocab * inp, 10),
        randn(out_dim * inp, 11),
        randn(out_dim, 12),
    );
    let (up, dy) = (randn(n * out_dim, 13), randn(n * out_dim, 14));
    let mut g = Graph::new();
    let tv = g.arg(Shape::f32(&[vocab, inp]));
    let iv = g.arg(Shape::i32(&[n]));
    let wv = g.arg(Shape::f32(&[out_dim, inp]));
    let bv = g.arg(Shape::f32(&[out_dim]));
    let uv = g.arg(Shape::f32(&[n, out_dim]));
    let dyv = g.arg(Shape::f32(&[n, out_dim]));
    let x = g.gather(tv, iv);
    let gate = ops::linear(&mut g, x, wv, Some(bv));
    let y = ops::swiglu(&mut g, gate, uv);
    let d = g.vjp(&[(y, dyv)], &[tv, wv, bv, uv]);
    let out = run(
        &c,
        &g,
        &[y, d[0], d[1], d[2], d[3]],
        &[
            In::F(&table),
            In::I(&ids),
            In::F(&w),
            In::F(&b),
            In::F(&up),
            In::F(&dy),
        ],
    );
    // Eager: gather, x·Wᵀ + b, swiglu, and back.
    let mut xe = vec![0.0; n * inp];
    crate::embedding::gather(&table, inp, &ids, &mut xe);
    let mut ge = vec![0.0; n * out_dim];
    for r in 0..n {
        for o in 0..out_dim {
            ge[r * out_dim + o] =
                b[o] + crate::dot(&xe[r * inp..(r + 1) * inp], &w[o * inp..(o + 1) * inp]);
        }
    }
    let mut ye = vec![0.0; n * out_dim];
    crate::activation::swiglu(&ge, &up, &mut ye);
    let (mut dg, mut du) = (vec![0.0; n * out_dim], vec![0.0; n * out_dim]);
    crate::activation::swiglu_backward(&ge, &up, &dy, &mut dg, &mut du);
    let (mut dw, mut db, mut dx) = (
        vec![0.0; out_dim * inp],
        vec![0.0; out_dim],
        vec![0.0; n * inp],
    );
    for r in 0..n {
        for o in 0..out_dim {
            let gr = dg[r * out_dim + o];
            db[o] += gr;
            for i in 0..inp {
                dw[o * inp + i] += gr * xe[r * inp + i];
                dx[r * inp + i] += gr * w[o * inp + i];
            }
        }
    }
    let mut dt = vec![0.0; vocab * inp];
    crate::embedding::scatter_add(&mut dt, inp, &ids, &dx);
    close(&out[0], &ye, 1e-5, "swiglu y");
    close(&out[1], &dt, 1e-4, "embedding d_table (id 3 twice)");
    close(&out[2], &dw, 1e-4, "linear dw");
    close(&out[3], &db, 1e-4, "linear db");
    close(&out[4], &du, 1e-4, "swiglu d_up");
}

/// A linear layer traced in bf16 (operands converted to bf16, f32 results) and its gradients
/// equal the bf16 kernel's products — and are not the f32 ones.
#[test]
fn a_bf16_linear_and_its_gradients_match_the_bf16_kernel() {
    use crate::matmul::{Op, Par, Precision, matmul};
    let Some(c) = client() else { return };
    let (n, inp, out_dim) = (7, 37, 19);
    let (x, w, dy) = (
        randn(n * inp, 30),
        randn(out_dim * inp, 31),
        randn(n * out_dim, 32),
    );
    let mut g = Graph::new();
    g.set_linear_precision(Precision::Bf16);
    let xv = g.arg(Shape::f32(&[n, inp]));
    let wv = g.arg(Shape::f32(&[out_dim, inp]));
    let dyv = g.arg(Shape::f32(&[n, out_dim]));
    let y = ops::linear(&mut g, xv, wv, None);
    let d = g.vjp(&[(y, dyv)], &[xv, wv]);
    let out = run(
        &c,
        &g,
        &[y, d[0], d[1]],
        &[In::F(&x), In::F(&w), In::F(&dy)],
    );
    let eager = |p: Precision| {
        let mut ye = vec![0.0; n * out_dim];
        matmul(
            n,
            inp,
            out_dim,
            &x,
            Op::N,
            &w,
            Op::T,
            &mut ye,
            false,
            Par::Pool,
            p,
        );
        let mut dx = vec![0.0; n * inp];
        matmul(
            n,
            out_dim,
            inp,
            &dy,
            Op::N,
            &w,
            Op::N,
            &mut dx,
            false,
            Par::Pool,
            p,
        );
        let mut dw = vec![0.0; out_dim * inp];
        matmul(
            out_dim,
            n,
            inp,
            &dy,
            Op::T,
            &x,
            Op::N,
            &mut dw,
            false,
            Par::Pool,
            p,
        );
        [ye, dx, dw]
    };
    let [ye, dx, dw] = eager(Precision::Bf16);
    close(&out[0], &ye, 1e-5, "bf16 linear y");
    close(&out[1], &dx, 1e-5, "bf16 linear dx");
    close(&out[2], &dw, 1e-5, "bf16 linear dw");
    let [yf, ..] = eager(Precision::F32);
    let gap = out[0]
        .iter()
        .zip(&yf)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(gap > 1e-3, "the traced product is f32's (gap {gap})");
}

#[test]
fn the_head_matches_the_fused_kernel_at_a_temperature() {
    let Some(c) = client() else { return };
    let (n, dim, vocab, t) = (5, 8, 11, 0.7f32);
    let targets = [1u32, 10, 0, 4, 4];
    let (x, w, dl, de) = (
        randn(n * dim, 15),
        randn(vocab * dim, 16),
        randn(n, 17),
        randn(n, 18),
    );
    let mut g = Graph::new();
    let xv = g.arg(Shape::f32(&[n, dim]));
    let wv = g.arg(Shape::f32(&[vocab, dim]));
    let tv = g.arg(Shape::i32(&[n]));
    let it = g.arg(Shape::f32(&[]));
    let dlv = g.arg(Shape::f32(&[n]));
    let dev = g.arg(Shape::f32(&[n]));
    let (lp, ent) = ops::logprob_entropy(&mut g, xv, wv, tv, it);
    let d = g.vjp(&[(lp, dlv), (ent, dev)], &[xv, wv]);
    let out = run(
        &c,
        &g,
        &[lp, ent, d[0], d[1]],
        &[
            In::F(&x),
            In::F(&w),
            In::I(&targets),
            In::F(&[1.0 / t]),
            In::F(&dl),
            In::F(&de),
        ],
    );
    let (mut lpe, mut ente, mut lse) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    crate::head::logprob_entropy(
        &x,
        &w,
        dim,
        &targets,
        t,
        &mut lpe,
        &mut ente,
        &mut lse,
        crate::matmul::Precision::F32,
    );
    let (mut dx, mut dw) = (vec![0.0; n * dim], vec![0.0; vocab * dim]);
    crate::head::logprob_entropy_backward(
        &x,
        &w,
        dim,
        &targets,
        t,
        &lse,
        &ente,
        &dl,
        &de,
        &mut dx,
        &mut dw,
        crate::matmul::Precision::F32,
    );
    close(&out[0], &lpe, 1e-5, "head logp");
    close(&out[1], &ente, 1e-5, "head entropy");
    close(&out[2], &dx, 1e-4, "head dx");
    close(&out[3], &dw, 1e-4, "head dw");
}

#[test]
fn adamw_matches_the_kernel() {
    let Some(c) = client() else { return };
    let n = 37;
    let (p, gr) = (randn(n, 19), randn(n, 20));
    let m = randn(n, 21);
    let v: Vec<f32> = randn(n, 22).iter().map(|x| x * x).collect();
    let hp = crate::optim::AdamW {
        lr: 3e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    let s = ops::AdamwScalars::new(&hp, 7, 0.5);
    let mut g = Graph::new();
    let [pv, gv, mv, vv] = [0; 4].map(|_| g.arg(Shape::f32(&[n])));
    let sv = [0; 4].map(|_| g.arg(Shape::f32(&[])));
    let (p2, m2, v2) = ops::adamw(&mut g, pv, gv, mv, vv, sv, &hp);
    let sc = s.to_vec();
    let out = run(
        &c,
        &g,
        &[p2, m2, v2],
        &[
            In::F(&p),
            In::F(&gr),
            In::F(&m),
            In::F(&v),
            In::F(&sc[0..1]),
            In::F(&sc[1..2]),
            In::F(&sc[2..3]),
            In::F(&sc[3..4]),
        ],
    );
    let (mut pe, mut me, mut ve) = (p.clone(), m.clone(), v.clone());
    let clipped: Vec<f32> = gr.iter().map(|x| x * 0.5).collect();
    hp.update(7, &mut pe, &clipped, &mut me, &mut ve);
    close(&out[0], &pe, 1e-6, "adamw p");
    close(&out[1], &me, 1e-6, "adamw m");
    close(&out[2], &ve, 1e-6, "adamw v");
}

/// The primitives' gradients (every `dot` orientation, transpose, broadcast, div, max, min,
/// sqrt, logistic, log) against central differences of the compiled forward.
#[test]
fn primitive_gradients_match_finite_differences() {
    let Some(c) = client() else { return };
    let mut g = Graph::new();
    let a = g.arg(Shape::f32(&[2, 3, 4]));
    let b = g.arg(Shape::f32(&[2, 5, 3]));
    let w = g.arg(Shape::f32(&[4]));
    let coef = g.arg(Shape::f32(&[2, 4, 5]));
    // [2,3,4]·[2,5,3] contracting 3 with 3 → [2, 4, 5]
    let ab = g.dot(a, b, 1, 1, 2);
    let bt = g.transpose(b, &[0, 2, 1]); // [2,3,5]
    let ab2 = g.dot(a, bt, 1, 1, 1); // [2,4,5], same product another way
    let wb = g.broadcast(w, &[2, 4, 5], &[1]);
    let s = g.add(ab, wb);
    let sq = g.mul(s, s);
    let one = g.full_like(1.0, sq);
    let den = g.add(sq, one);
    let r = g.un(Un::Sqrt, den);
    let q = g.div(ab2, r);
    let l = g.un(Un::Logistic, q);
    let mx = g.bin(Bin::Max, l, s);
    let mn = g.bin(Bin::Min, q, s);
    let lg = g.un(Un::Log, den);
    let t1 = g.add(mx, mn);
    let t2 = g.add(t1, lg);
    let y = g.mul(t2, coef);
    let loss = g.sum(y, &[0, 1, 2]);
    let one_s = g.scalar(1.0);
    let d = g.vjp(&[(loss, one_s)], &[a, b, w]);
    let text = g.emit(&[loss, d[0], d[1], d[2]], &[]);
    let exe = c.compile(&text).unwrap();
    let xa = randn(24, 30);
    let xb = randn(30, 31);
    let xw = randn(4, 32);
    let xc = randn(40, 33);
    let eval = |xa: &[f32], xb: &[f32], xw: &[f32]| {
        let bufs = [
            c.f32(xa, &[2, 3, 4]).unwrap(),
            c.f32(xb, &[2, 5, 3]).unwrap(),
            c.f32(xw, &[4]).unwrap(),
            c.f32(&xc, &[2, 4, 5]).unwrap(),
        ];
        let out = exe.run(&bufs.iter().collect::<Vec<_>>()).unwrap();
        out.iter().map(|b| b.to_f32().unwrap()).collect::<Vec<_>>()
    };
    let base = eval(&xa, &xb, &xw);
    // Directional derivative along a random direction, f32 central differences.
    let (da, db, dw) = (randn(24, 40), randn(30, 41), randn(4, 42));
    let analytic: f64 = [(&base[1], &da), (&base[2], &db), (&base[3], &dw)]
        .iter()
        .map(|(g, d)| {
            g.iter()
                .zip(d.iter())
                .map(|(x, y)| (x * y) as f64)
                .sum::<f64>()
        })
        .sum();
    let h = 1e-3f32;
    let shift = |x: &[f32], d: &[f32], s: f32| -> Vec<f32> {
        x.iter().zip(d).map(|(a, b)| a + s * h * b).collect()
    };
    let plus = eval(
        &shift(&xa, &da, 1.0),
        &shift(&xb, &db, 1.0),
        &shift(&xw, &dw, 1.0),
    )[0][0];
    let minus = eval(
        &shift(&xa, &da, -1.0),
        &shift(&xb, &db, -1.0),
        &shift(&xw, &dw, -1.0),
    )[0][0];
    let numeric = (plus - minus) as f64 / (2.0 * h as f64);
    assert!(
        (numeric - analytic).abs() <= 2e-2 * (1.0 + analytic.abs()),
        "numeric {numeric} vs analytic {analytic}"
    );
}
