//! The op vocabulary traced into StableHLO: a small dataflow graph of tensor ops with shape
//! inference, reverse-mode differentiation ([`Graph::vjp`]) and emission as a StableHLO module in
//! MLIR text ([`Graph::emit`]) that any PJRT plugin compiles (TPU, GPU, the XLA CPU plugin).
//!
//! The ops are the ones the model's eager kernels implement (matmul as `dot_general`, RMSNorm,
//! RoPE, attention, SwiGLU, embedding gather/scatter-add, log-softmax), broken into primitives
//! whose gradients are known; parity with the eager kernels is tested op by op in the learner.
//!
//! Owns: graph building, shapes, gradients of each primitive, the text of the module. Never:
//! runs anything (the `pjrt` engine compiles and executes what this emits) or knows what a
//! model is. Shape mismatches are bugs in the tracing code and panic, like the eager kernels'
//! `assert!`s.

pub mod ops;
#[cfg(test)]
mod parity;

use std::collections::HashMap;
use std::fmt::Write as _;

/// Element type of a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    /// 32-bit float.
    F32,
    /// 32-bit signed integer (token ids, indices).
    I32,
    /// Boolean (comparison results).
    Pred,
}

impl Ty {
    fn mlir(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::I32 => "i32",
            Ty::Pred => "i1",
        }
    }
}

/// Shape and element type of a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Dimensions, outermost first (empty: a scalar).
    pub dims: Vec<usize>,
    /// Element type.
    pub ty: Ty,
}

impl Shape {
    /// An f32 shape.
    pub fn f32(dims: &[usize]) -> Self {
        Self {
            dims: dims.to_vec(),
            ty: Ty::F32,
        }
    }

    /// An i32 shape.
    pub fn i32(dims: &[usize]) -> Self {
        Self {
            dims: dims.to_vec(),
            ty: Ty::I32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn mlir(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            let _ = write!(s, "{d}x");
        }
        s.push_str(self.ty.mlir());
        s.push('>');
        s
    }
}

/// A value in a [`Graph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct V(usize);

/// Elementwise functions of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Un {
    Neg,
    Exp,
    Log,
    Rsqrt,
    Sqrt,
    /// `1 / (1 + exp(-x))`.
    Logistic,
}

/// Elementwise functions of two values of one shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
}

/// Comparison directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Clone, Debug)]
enum Op {
    Arg,
    Const(f32),
    Iota(usize),
    Un(Un, V),
    Bin(Bin, V, V),
    Cmp(Cmp, V, V),
    Select(V, V, V),
    /// `broadcast_in_dim` with the operand's dims mapped (in increasing order) to these.
    Broadcast(V, Vec<usize>),
    /// Sum over dims; `max == true`: max instead (no gradient flows through a max: it is only
    /// used as a numerically stabilising shift that cancels out).
    Reduce {
        x: V,
        dims: Vec<usize>,
        max: bool,
    },
    /// `[B.., a0, a1] · [B.., b0, b1]` contracting one dim of each: result `[B.., a_free, b_free]`;
    /// `bf16`: both operands rounded to bf16, the result summed in f32.
    Dot {
        a: V,
        b: V,
        batch: usize,
        ca: usize,
        cb: usize,
        bf16: bool,
    },
    Reshape(V),
    Transpose(V, Vec<usize>),
    /// Rows of a `[R, C]` table at i32 indices `[n]`: `[n, C]`.
    Gather(V, V),
    /// A `[R, C]` zero table with `[n, C]` updates added at rows `[n]`.
    ScatterAdd(V, V),
    /// `table` (`[R, C]`) with rows `idx` (`[n]`, distinct) replaced by `upd` (`[n, C]`); not
    /// differentiable (KV-cache writes in inference programs).
    ScatterSet(V, V, V),
    Convert(V),
    /// The sum of `x` over all replicas of a replicated program (`stablehlo.all_reduce` over
    /// one group of this many); not differentiable (it sums gradients after the backward).
    AllReduce(V, usize),
}

#[derive(Clone, Debug)]
struct Node {
    op: Op,
    shape: Shape,
}

/// A traced computation: arguments, ops, and (at emission) its results.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    nodes: Vec<Node>,
    args: Vec<V>,
    /// The arithmetic of the model's matrix products ([`Graph::linear_dot`]).
    linear: crate::matmul::Precision,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// The arithmetic of the products [`Graph::linear_dot`] makes (linear layers, attention's
    /// two products and the output head, as the native kernels' [`crate::matmul::Precision`]):
    /// for bf16, both operands converted to bf16 and the result f32, and so for the gradients'
    /// products. Other dots (RoPE's rotation) stay f32, as in the native engine.
    pub fn set_linear_precision(&mut self, p: crate::matmul::Precision) {
        self.linear = p;
    }

    /// [`Graph::dot`] in the graph's linear precision.
    pub fn linear_dot(&mut self, a: V, b: V, batch: usize, ca: usize, cb: usize) -> V {
        let bf16 = self.linear == crate::matmul::Precision::Bf16;
        self.dot_as(a, b, batch, ca, cb, bf16)
    }

    fn push(&mut self, op: Op, shape: Shape) -> V {
        self.nodes.push(Node { op, shape });
        V(self.nodes.len() - 1)
    }

    /// The shape of `v`.
    pub fn shape(&self, v: V) -> &Shape {
        &self.nodes[v.0].shape
    }

    /// The dimensions of `v`.
    pub fn dims(&self, v: V) -> Vec<usize> {
        self.shape(v).dims.clone()
    }

    /// The next function argument.
    pub fn arg(&mut self, shape: Shape) -> V {
        let v = self.push(Op::Arg, shape);
        self.args.push(v);
        v
    }

    /// Number of arguments so far.
    pub fn num_args(&self) -> usize {
        self.args.len()
    }

    /// An f32 scalar constant.
    pub fn scalar(&mut self, c: f32) -> V {
        self.push(Op::Const(c), Shape::f32(&[]))
    }

    /// `c` broadcast to the shape of `like`.
    pub fn full_like(&mut self, c: f32, like: V) -> V {
        let s = self.scalar(c);
        let dims = self.dims(like);
        self.broadcast(s, &dims, &[])
    }

    /// i32 counting along `dim` of a tensor shaped `dims`.
    pub fn iota(&mut self, dims: &[usize], dim: usize) -> V {
        assert!(dim < dims.len(), "iota: dim {dim} of {dims:?}");
        self.push(Op::Iota(dim), Shape::i32(dims))
    }

    /// An elementwise function.
    pub fn un(&mut self, f: Un, x: V) -> V {
        assert_eq!(self.shape(x).ty, Ty::F32, "{f:?} of a non-f32 value");
        let s = self.shape(x).clone();
        self.push(Op::Un(f, x), s)
    }

    /// An elementwise function of two values of one shape.
    pub fn bin(&mut self, f: Bin, a: V, b: V) -> V {
        assert_eq!(self.shape(a), self.shape(b), "{f:?}: operand shapes");
        let s = self.shape(a).clone();
        self.push(Op::Bin(f, a, b), s)
    }

    /// `a + b`.
    pub fn add(&mut self, a: V, b: V) -> V {
        self.bin(Bin::Add, a, b)
    }

    /// `a - b`.
    pub fn sub(&mut self, a: V, b: V) -> V {
        self.bin(Bin::Sub, a, b)
    }

    /// `a · b`.
    pub fn mul(&mut self, a: V, b: V) -> V {
        self.bin(Bin::Mul, a, b)
    }

    /// `a / b`.
    pub fn div(&mut self, a: V, b: V) -> V {
        self.bin(Bin::Div, a, b)
    }

    /// `x · c` for a constant `c`.
    pub fn scale(&mut self, x: V, c: f32) -> V {
        let k = self.full_like(c, x);
        self.mul(x, k)
    }

    /// Elementwise comparison.
    pub fn cmp(&mut self, c: Cmp, a: V, b: V) -> V {
        assert_eq!(self.shape(a), self.shape(b), "compare: operand shapes");
        let dims = self.dims(a);
        self.push(Op::Cmp(c, a, b), Shape { dims, ty: Ty::Pred })
    }

    /// `p ? a : b` elementwise.
    pub fn select(&mut self, p: V, a: V, b: V) -> V {
        assert_eq!(self.shape(p).ty, Ty::Pred, "select: predicate type");
        assert_eq!(self.shape(p).dims, self.shape(a).dims, "select: shapes");
        assert_eq!(self.shape(a), self.shape(b), "select: shapes");
        let s = self.shape(a).clone();
        self.push(Op::Select(p, a, b), s)
    }

    /// Broadcasts `x` to `dims`, operand dimension `i` becoming result dimension `map[i]`
    /// (increasing; sizes must match).
    pub fn broadcast(&mut self, x: V, dims: &[usize], map: &[usize]) -> V {
        let xs = self.dims(x);
        assert_eq!(xs.len(), map.len(), "broadcast: one target per operand dim");
        assert!(map.windows(2).all(|w| w[0] < w[1]), "broadcast: map order");
        for (i, &m) in map.iter().enumerate() {
            assert_eq!(xs[i], dims[m], "broadcast {xs:?} to {dims:?} via {map:?}");
        }
        let ty = self.shape(x).ty;
        self.push(
            Op::Broadcast(x, map.to_vec()),
            Shape {
                dims: dims.to_vec(),
                ty,
            },
        )
    }

    fn reduce(&mut self, x: V, dims: &[usize], max: bool) -> V {
        let xs = self.dims(x);
        assert!(dims.windows(2).all(|w| w[0] < w[1]), "reduce: dims order");
        assert!(dims.iter().all(|&d| d < xs.len()), "reduce: dims");
        let keep: Vec<usize> = (0..xs.len())
            .filter(|i| !dims.contains(i))
            .map(|i| xs[i])
            .collect();
        self.push(
            Op::Reduce {
                x,
                dims: dims.to_vec(),
                max,
            },
            Shape::f32(&keep),
        )
    }

    /// Sum over `dims`.
    pub fn sum(&mut self, x: V, dims: &[usize]) -> V {
        self.reduce(x, dims, false)
    }

    /// Max over `dims`, as a constant for differentiation (see [`Op::Reduce`]).
    pub fn max_stop_grad(&mut self, x: V, dims: &[usize]) -> V {
        self.reduce(x, dims, true)
    }

    /// Batched matrix product contracting dim `ca` of `a` with dim `cb` of `b`; both have
    /// `batch` leading batch dims and two more. Result: `[batch.., a's other dim, b's other]`.
    pub fn dot(&mut self, a: V, b: V, batch: usize, ca: usize, cb: usize) -> V {
        self.dot_as(a, b, batch, ca, cb, false)
    }

    fn dot_as(&mut self, a: V, b: V, batch: usize, ca: usize, cb: usize, bf16: bool) -> V {
        let (ad, bd) = (self.dims(a), self.dims(b));
        assert!(
            ad.len() == batch + 2 && bd.len() == batch + 2,
            "dot: ranks {ad:?} {bd:?}"
        );
        assert_eq!(ad[..batch], bd[..batch], "dot: batch dims");
        assert!(ca >= batch && cb >= batch && ca < batch + 2 && cb < batch + 2);
        assert_eq!(ad[ca], bd[cb], "dot: contracted dims of {ad:?} and {bd:?}");
        let fa = 2 * batch + 1 - ca;
        let fb = 2 * batch + 1 - cb;
        let mut dims = ad[..batch].to_vec();
        dims.push(ad[fa]);
        dims.push(bd[fb]);
        self.push(
            Op::Dot {
                a,
                b,
                batch,
                ca,
                cb,
                bf16,
            },
            Shape::f32(&dims),
        )
    }

    /// `x` with new dimensions of the same element count.
    pub fn reshape(&mut self, x: V, dims: &[usize]) -> V {
        let s = self.shape(x).clone();
        assert_eq!(
            s.len(),
            dims.iter().product::<usize>(),
            "reshape {:?} to {dims:?}",
            s.dims
        );
        self.push(
            Op::Reshape(x),
            Shape {
                dims: dims.to_vec(),
                ty: s.ty,
            },
        )
    }

    /// Result dimension `i` is operand dimension `perm[i]`.
    pub fn transpose(&mut self, x: V, perm: &[usize]) -> V {
        let s = self.shape(x).clone();
        assert_eq!(perm.len(), s.dims.len(), "transpose: perm rank");
        let dims: Vec<usize> = perm.iter().map(|&p| s.dims[p]).collect();
        self.push(Op::Transpose(x, perm.to_vec()), Shape { dims, ty: s.ty })
    }

    /// Rows `idx` (i32 `[n]`) of `table` (`[R, C]`): `[n, C]`.
    pub fn gather(&mut self, table: V, idx: V) -> V {
        let (t, i) = (self.dims(table), self.shape(idx).clone());
        assert!(
            t.len() == 2 && i.dims.len() == 1 && i.ty == Ty::I32,
            "gather"
        );
        self.push(Op::Gather(table, idx), Shape::f32(&[i.dims[0], t[1]]))
    }

    /// A `[rows, C]` table of zeros with `upd` (`[n, C]`) added at rows `idx` (`[n]`).
    pub fn scatter_add(&mut self, rows: usize, idx: V, upd: V) -> V {
        let u = self.dims(upd);
        assert!(u.len() == 2 && self.dims(idx) == [u[0]], "scatter_add");
        self.push(Op::ScatterAdd(idx, upd), Shape::f32(&[rows, u[1]]))
    }

    /// `table` (`[R, C]`) with its rows `idx` (i32 `[n]`, distinct) replaced by `upd`
    /// (`[n, C]`). Not differentiable: for KV-cache writes in inference programs.
    pub fn scatter_set(&mut self, table: V, idx: V, upd: V) -> V {
        let (t, u) = (self.dims(table), self.dims(upd));
        assert!(
            t.len() == 2 && u.len() == 2 && t[1] == u[1] && self.dims(idx) == [u[0]],
            "scatter_set: {t:?} {u:?}"
        );
        let s = self.shape(table).clone();
        self.push(Op::ScatterSet(table, idx, upd), s)
    }

    /// An i32 value as f32.
    pub fn to_f32(&mut self, x: V) -> V {
        let dims = self.dims(x);
        self.push(Op::Convert(x), Shape::f32(&dims))
    }

    /// The sum of f32 `x` over the `replicas` copies of a program compiled with that many
    /// replicas (one all-reduce group of all of them: data parallelism's gradient sum on the
    /// device's interconnect). Emitted only when `replicas > 1`: one replica is `x` itself.
    pub fn all_reduce(&mut self, x: V, replicas: usize) -> V {
        assert_eq!(self.shape(x).ty, Ty::F32, "all_reduce of a non-f32 value");
        if replicas <= 1 {
            return x;
        }
        let s = self.shape(x).clone();
        self.push(Op::AllReduce(x, replicas), s)
    }

    fn inputs(op: &Op) -> Vec<V> {
        match op {
            Op::Arg | Op::Const(_) | Op::Iota(_) => vec![],
            Op::Un(_, x)
            | Op::Broadcast(x, _)
            | Op::Reduce { x, .. }
            | Op::Reshape(x)
            | Op::Transpose(x, _)
            | Op::Convert(x)
            | Op::AllReduce(x, _) => vec![*x],
            Op::Bin(_, a, b)
            | Op::Cmp(_, a, b)
            | Op::Dot { a, b, .. }
            | Op::Gather(a, b)
            | Op::ScatterAdd(a, b) => vec![*a, *b],
            Op::Select(p, a, b) | Op::ScatterSet(p, a, b) => vec![*p, *a, *b],
        }
    }

    /// Reverse-mode differentiation: given cotangents `seeds` (value, cotangent of the same
    /// shape) of some outputs, returns d(Σ ⟨output, cotangent⟩)/d`wrt` for each of `wrt`
    /// (zeros where no path leads), as new values of this graph.
    pub fn vjp(&mut self, seeds: &[(V, V)], wrt: &[V]) -> Vec<V> {
        let mut adj: HashMap<V, V> = HashMap::new();
        let top = seeds.iter().map(|s| s.0.0).max().unwrap_or(0);
        for &(y, g) in seeds {
            assert_eq!(self.shape(y), self.shape(g), "vjp: seed shape");
            self.accumulate(&mut adj, y, g);
        }
        for i in (0..=top).rev() {
            let v = V(i);
            let Some(&g) = adj.get(&v) else { continue };
            let op = self.nodes[i].op.clone();
            self.backprop(&mut adj, v, op, g);
        }
        wrt.iter()
            .map(|&w| match adj.get(&w) {
                Some(&g) => g,
                None => self.full_like(0.0, w),
            })
            .collect()
    }

    fn accumulate(&mut self, adj: &mut HashMap<V, V>, v: V, g: V) {
        if self.shape(v).ty != Ty::F32 {
            return;
        }
        let sum = match adj.get(&v) {
            Some(&prev) => self.add(prev, g),
            None => g,
        };
        adj.insert(v, sum);
    }

    fn backprop(&mut self, adj: &mut HashMap<V, V>, y: V, op: Op, g: V) {
        match op {
            Op::Arg | Op::Const(_) | Op::Iota(_) | Op::Cmp(..) | Op::Convert(_) => {}
            Op::ScatterSet(..) => panic!("vjp through scatter_set: inference programs only"),
            Op::AllReduce(..) => panic!("vjp through all_reduce: it sums finished gradients"),
            Op::Un(f, x) => {
                let d = match f {
                    Un::Neg => self.un(Un::Neg, g),
                    Un::Exp => self.mul(g, y),
                    Un::Log => self.div(g, x),
                    Un::Sqrt => {
                        // d sqrt(x) = 1 / (2 sqrt(x))
                        let t = self.div(g, y);
                        self.scale(t, 0.5)
                    }
                    Un::Rsqrt => {
                        // d x^-1/2 = -1/2 · y³
                        let y2 = self.mul(y, y);
                        let y3 = self.mul(y2, y);
                        let t = self.mul(g, y3);
                        self.scale(t, -0.5)
                    }
                    Un::Logistic => {
                        let one = self.full_like(1.0, y);
                        let om = self.sub(one, y);
                        let t = self.mul(y, om);
                        self.mul(g, t)
                    }
                };
                self.accumulate(adj, x, d);
            }
            Op::Bin(f, a, b) => match f {
                Bin::Add => {
                    self.accumulate(adj, a, g);
                    self.accumulate(adj, b, g);
                }
                Bin::Sub => {
                    self.accumulate(adj, a, g);
                    let n = self.un(Un::Neg, g);
                    self.accumulate(adj, b, n);
                }
                Bin::Mul => {
                    let da = self.mul(g, b);
                    let db = self.mul(g, a);
                    self.accumulate(adj, a, da);
                    self.accumulate(adj, b, db);
                }
                Bin::Div => {
                    let da = self.div(g, b);
                    let t = self.mul(da, y);
                    let db = self.un(Un::Neg, t);
                    self.accumulate(adj, a, da);
                    self.accumulate(adj, b, db);
                }
                Bin::Max | Bin::Min => {
                    // The gradient goes to the chosen operand (to `a` on ties).
                    let c = if f == Bin::Max { Cmp::Ge } else { Cmp::Le };
                    let p = self.cmp(c, a, b);
                    let z = self.full_like(0.0, g);
                    let da = self.select(p, g, z);
                    let db = self.select(p, z, g);
                    self.accumulate(adj, a, da);
                    self.accumulate(adj, b, db);
                }
            },
            Op::Select(p, a, b) => {
                let z = self.full_like(0.0, g);
                let da = self.select(p, g, z);
                let db = self.select(p, z, g);
                self.accumulate(adj, a, da);
                self.accumulate(adj, b, db);
            }
            Op::Broadcast(x, map) => {
                let n = self.dims(y).len();
                let dims: Vec<usize> = (0..n).filter(|d| !map.contains(d)).collect();
                let d = if dims.is_empty() {
                    g
                } else {
                    self.sum(g, &dims)
                };
                self.accumulate(adj, x, d);
            }
            Op::Reduce { x, dims, max } => {
                if !max {
                    let xd = self.dims(x);
                    let map: Vec<usize> = (0..xd.len()).filter(|d| !dims.contains(d)).collect();
                    let d = self.broadcast(g, &xd, &map);
                    self.accumulate(adj, x, d);
                }
            }
            Op::Dot {
                a,
                b,
                batch,
                ca,
                cb,
                bf16,
            } => {
                let fa = 2 * batch + 1 - ca;
                let fb = 2 * batch + 1 - cb;
                // dA: g [B, a_free, b_free] · b contracting b_free → [B, a_free, K]
                let da = self.dot_as(g, b, batch, batch + 1, fb, bf16);
                let da = if ca == batch + 1 {
                    da
                } else {
                    self.swap_last(da, batch)
                };
                // dB: a · g contracting a_free → [B, K, b_free]
                let db = self.dot_as(a, g, batch, fa, batch, bf16);
                let db = if cb == batch {
                    db
                } else {
                    self.swap_last(db, batch)
                };
                self.accumulate(adj, a, da);
                self.accumulate(adj, b, db);
            }
            Op::Reshape(x) => {
                let xd = self.dims(x);
                let d = self.reshape(g, &xd);
                self.accumulate(adj, x, d);
            }
            Op::Transpose(x, perm) => {
                let mut inv = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                let d = self.transpose(g, &inv);
                self.accumulate(adj, x, d);
            }
            Op::Gather(table, idx) => {
                let rows = self.dims(table)[0];
                let d = self.scatter_add(rows, idx, g);
                self.accumulate(adj, table, d);
            }
            Op::ScatterAdd(idx, upd) => {
                let d = self.gather(g, idx);
                self.accumulate(adj, upd, d);
            }
        }
    }

    fn swap_last(&mut self, x: V, batch: usize) -> V {
        let mut perm: Vec<usize> = (0..batch).collect();
        perm.extend([batch + 1, batch]);
        self.transpose(x, &perm)
    }

    /// The module: `func.func @main` over every argument, returning `outputs`. `donate` pairs
    /// (argument index, output index) whose buffers the plugin may reuse in place (the
    /// argument's buffer is consumed by the call).
    pub fn emit(&self, outputs: &[V], donate: &[(usize, usize)]) -> String {
        // Only what the outputs need.
        let mut live = vec![false; self.nodes.len()];
        for o in outputs {
            live[o.0] = true;
        }
        for i in (0..self.nodes.len()).rev() {
            if live[i] {
                for x in Self::inputs(&self.nodes[i].op) {
                    live[x.0] = true;
                }
            }
        }
        let ty = |v: V| self.shape(v).mlir();
        let mut s = String::from("func.func @main(");
        for (i, a) in self.args.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "%v{}: {}", a.0, ty(*a));
            if let Some((_, o)) = donate.iter().find(|(arg, _)| *arg == i) {
                let _ = write!(s, " {{tf.aliasing_output = {o} : i32}}");
            }
        }
        s.push_str(") -> (");
        s.push_str(
            &outputs
                .iter()
                .map(|&o| ty(o))
                .collect::<Vec<_>>()
                .join(", "),
        );
        s.push_str(") {\n");
        for (i, n) in self.nodes.iter().enumerate() {
            if !live[i] || matches!(n.op, Op::Arg) {
                continue;
            }
            self.emit_node(&mut s, V(i), n);
        }
        let _ = writeln!(
            s,
            "  \"func.return\"({}) : ({}) -> ()\n}}",
            outputs
                .iter()
                .map(|o| format!("%v{}", o.0))
                .collect::<Vec<_>>()
                .join(", "),
            outputs
                .iter()
                .map(|&o| ty(o))
                .collect::<Vec<_>>()
                .join(", ")
        );
        s
    }

    fn emit_node(&self, s: &mut String, v: V, n: &Node) {
        let ty = |v: V| self.shape(v).mlir();
        let out = n.shape.mlir();
        let list = |xs: &[usize]| {
            xs.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let r = v.0;
        match &n.op {
            Op::Arg => {}
            Op::Const(c) => {
                let _ = writeln!(
                    s,
                    "  %v{r} = stablehlo.constant dense<{:.9e}> : tensor<f32>",
                    c
                );
            }
            Op::Iota(d) => {
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.iota\"() {{iota_dimension = {d} : i64}} : () -> {out}"
                );
            }
            Op::Un(f, x) => {
                let name = match f {
                    Un::Neg => "negate",
                    Un::Exp => "exponential",
                    Un::Log => "log",
                    Un::Rsqrt => "rsqrt",
                    Un::Sqrt => "sqrt",
                    Un::Logistic => "logistic",
                };
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.{name}\"(%v{}) : ({}) -> {out}",
                    x.0,
                    ty(*x)
                );
            }
            Op::Bin(f, a, b) => {
                let name = match f {
                    Bin::Add => "add",
                    Bin::Sub => "subtract",
                    Bin::Mul => "multiply",
                    Bin::Div => "divide",
                    Bin::Max => "maximum",
                    Bin::Min => "minimum",
                };
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.{name}\"(%v{}, %v{}) : ({}, {}) -> {out}",
                    a.0,
                    b.0,
                    ty(*a),
                    ty(*b)
                );
            }
            Op::Cmp(c, a, b) => {
                let dir = match c {
                    Cmp::Eq => "EQ",
                    Cmp::Ne => "NE",
                    Cmp::Lt => "LT",
                    Cmp::Le => "LE",
                    Cmp::Gt => "GT",
                    Cmp::Ge => "GE",
                };
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.compare\"(%v{}, %v{}) {{comparison_direction = #stablehlo<comparison_direction {dir}>}} : ({}, {}) -> {out}",
                    a.0,
                    b.0,
                    ty(*a),
                    ty(*b)
                );
            }
            Op::Select(p, a, b) => {
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.select\"(%v{}, %v{}, %v{}) : ({}, {}, {}) -> {out}",
                    p.0,
                    a.0,
                    b.0,
                    ty(*p),
                    ty(*a),
                    ty(*b)
                );
            }
            Op::Broadcast(x, map) => {
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.broadcast_in_dim\"(%v{}) {{broadcast_dimensions = array<i64{}{}>}} : ({}) -> {out}",
                    x.0,
                    if map.is_empty() { "" } else { ": " },
                    list(map),
                    ty(*x)
                );
            }
            Op::Reduce { x, dims, max } => {
                let (init, f) = if *max {
                    ("-3.40282347e+38", "maximum")
                } else {
                    ("0.0", "add")
                };
                let _ = writeln!(
                    s,
                    "  %i{r} = stablehlo.constant dense<{init}> : tensor<f32>\n  %v{r} = \"stablehlo.reduce\"(%v{}, %i{r}) ({{\n  ^bb0(%a{r}: tensor<f32>, %b{r}: tensor<f32>):\n    %c{r} = \"stablehlo.{f}\"(%a{r}, %b{r}) : (tensor<f32>, tensor<f32>) -> tensor<f32>\n    \"stablehlo.return\"(%c{r}) : (tensor<f32>) -> ()\n  }}) {{dimensions = array<i64: {}>}} : ({}, tensor<f32>) -> {out}",
                    x.0,
                    list(dims),
                    ty(*x)
                );
            }
            Op::Dot {
                a,
                b,
                batch,
                ca,
                cb,
                bf16,
            } => {
                let bd: Vec<usize> = (0..*batch).collect();
                let batch_dims = if *batch == 0 {
                    String::new()
                } else {
                    format!(
                        "lhs_batching_dimensions = [{0}], rhs_batching_dimensions = [{0}], ",
                        list(&bd)
                    )
                };
                let (mut ta, mut tb) = (ty(*a), ty(*b));
                let (mut x, mut y) = (format!("%v{}", a.0), format!("%v{}", b.0));
                // HIGHEST: f32 products in f32 (TPUs otherwise multiply f32 in bf16 passes).
                let mut precision = "HIGHEST";
                if *bf16 {
                    let (ha, hb) = (ta.replace("xf32>", "xbf16>"), tb.replace("xf32>", "xbf16>"));
                    let _ = writeln!(
                        s,
                        "  %ha{r} = \"stablehlo.convert\"({x}) : ({ta}) -> {ha}\n  %hb{r} = \"stablehlo.convert\"({y}) : ({tb}) -> {hb}"
                    );
                    (x, y, ta, tb) = (format!("%ha{r}"), format!("%hb{r}"), ha, hb);
                    precision = "DEFAULT";
                }
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.dot_general\"({x}, {y}) {{dot_dimension_numbers = #stablehlo.dot<{batch_dims}lhs_contracting_dimensions = [{ca}], rhs_contracting_dimensions = [{cb}]>, precision_config = [#stablehlo<precision {precision}>, #stablehlo<precision {precision}>]}} : ({ta}, {tb}) -> {out}",
                );
            }
            Op::Reshape(x) => {
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.reshape\"(%v{}) : ({}) -> {out}",
                    x.0,
                    ty(*x)
                );
            }
            Op::Transpose(x, perm) => {
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.transpose\"(%v{}) {{permutation = array<i64: {}>}} : ({}) -> {out}",
                    x.0,
                    list(perm),
                    ty(*x)
                );
            }
            Op::Gather(t, i) => {
                let n = self.dims(*i)[0];
                let c = self.dims(*t)[1];
                let _ = writeln!(
                    s,
                    "  %x{r} = \"stablehlo.reshape\"(%v{}) : ({}) -> tensor<{n}x1xi32>\n  %v{r} = \"stablehlo.gather\"(%v{}, %x{r}) {{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, {c}>, indices_are_sorted = false}} : ({}, tensor<{n}x1xi32>) -> {out}",
                    i.0,
                    ty(*i),
                    t.0,
                    ty(*t)
                );
            }
            Op::ScatterAdd(i, u) => {
                let n = self.dims(*i)[0];
                let _ = writeln!(
                    s,
                    "  %x{r} = \"stablehlo.reshape\"(%v{}) : ({}) -> tensor<{n}x1xi32>\n  %z{r} = stablehlo.constant dense<0.0> : {out}\n  %v{r} = \"stablehlo.scatter\"(%z{r}, %x{r}, %v{}) ({{\n  ^bb0(%a{r}: tensor<f32>, %b{r}: tensor<f32>):\n    %c{r} = \"stablehlo.add\"(%a{r}, %b{r}) : (tensor<f32>, tensor<f32>) -> tensor<f32>\n    \"stablehlo.return\"(%c{r}) : (tensor<f32>) -> ()\n  }}) {{scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false, unique_indices = false}} : ({out}, tensor<{n}x1xi32>, {}) -> {out}",
                    i.0,
                    ty(*i),
                    u.0,
                    ty(*u)
                );
            }
            Op::ScatterSet(t, i, u) => {
                let n = self.dims(*i)[0];
                let _ = writeln!(
                    s,
                    "  %x{r} = \"stablehlo.reshape\"(%v{}) : ({}) -> tensor<{n}x1xi32>\n  %v{r} = \"stablehlo.scatter\"(%v{}, %x{r}, %v{}) ({{\n  ^bb0(%a{r}: tensor<f32>, %b{r}: tensor<f32>):\n    \"stablehlo.return\"(%b{r}) : (tensor<f32>) -> ()\n  }}) {{scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false, unique_indices = true}} : ({out}, tensor<{n}x1xi32>, {}) -> {out}",
                    i.0,
                    ty(*i),
                    t.0,
                    u.0,
                    ty(*u)
                );
            }
            Op::Convert(x) => {
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.convert\"(%v{}) : ({}) -> {out}",
                    x.0,
                    ty(*x)
                );
            }
            Op::AllReduce(x, n) => {
                let group = list(&(0..*n).collect::<Vec<_>>());
                let _ = writeln!(
                    s,
                    "  %v{r} = \"stablehlo.all_reduce\"(%v{}) ({{\n  ^bb0(%a{r}: tensor<f32>, %b{r}: tensor<f32>):\n    %c{r} = \"stablehlo.add\"(%a{r}, %b{r}) : (tensor<f32>, tensor<f32>) -> tensor<f32>\n    \"stablehlo.return\"(%c{r}) : (tensor<f32>) -> ()\n  }}) {{replica_groups = dense<[[{group}]]> : tensor<1x{n}xi64>}} : ({}) -> {out}",
                    x.0,
                    ty(*x)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emission_names_every_live_op_and_drops_dead_ones() {
        let mut g = Graph::new();
        let a = g.arg(Shape::f32(&[2, 3]));
        let b = g.arg(Shape::f32(&[3, 4]));
        let _dead = g.un(Un::Exp, a);
        let c = g.dot(a, b, 0, 1, 0);
        let s = g.emit(&[c], &[(1, 0)]);
        assert!(s.contains("stablehlo.dot_general"), "{s}");
        assert!(!s.contains("exponential"), "{s}");
        assert!(
            s.contains("%v1: tensor<3x4xf32> {tf.aliasing_output = 0 : i32}"),
            "{s}"
        );
        assert!(s.contains("-> (tensor<2x4xf32>)"), "{s}");
    }

    #[test]
    fn a_dot_product_and_its_transposes_have_the_right_shapes() {
        let mut g = Graph::new();
        let a = g.arg(Shape::f32(&[5, 2, 3]));
        let b = g.arg(Shape::f32(&[5, 4, 3]));
        let c = g.dot(a, b, 1, 2, 2);
        assert_eq!(g.dims(c), [5, 2, 4]);
        let seed = g.arg(Shape::f32(&[5, 2, 4]));
        let d = g.vjp(&[(c, seed)], &[a, b]);
        assert_eq!(g.dims(d[0]), [5, 2, 3]);
        assert_eq!(g.dims(d[1]), [5, 4, 3]);
    }
}
