//! The decoder-only transformer (Llama / Qwen2 / Qwen3), executed eagerly on the CPU kernels:
//! forward to per-token log-probs and entropy (or full logits), and backward from
//! d(loss)/d(log-prob) and d(loss)/d(entropy) per token into parameter gradients.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::params::ParamsIo;
use crate::params::{Layout, Params, Tensor};
use kernels::attention::{AttnShape, Rows, Segments, attention, attention_backward};
use kernels::matmul::{Op, Par, Precision, Rhs, matmul, matmul_new, matmul_nt_many_new};
use kernels::rope::{RopeTable, apply as rope, inv_freq};
use kernels::{activation, embedding, head, norm};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// Segment id given to padding tokens by [`Batch::padded`].
pub const PAD_SEGMENT: u32 = u32::MAX;

/// A batch of token rows, padded to one length (and optionally packed with several segments
/// per row). All vectors have `rows · seq` entries.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Number of rows.
    pub rows: usize,
    /// Tokens per row.
    pub seq: usize,
    /// Input token ids.
    pub tokens: Vec<u32>,
    /// Position id of each token (restarts at 0 in each segment).
    pub positions: Vec<u32>,
    /// Segment id of each token: attention never crosses segments, except into the one
    /// segment `sees` names.
    pub segments: Vec<u32>,
    /// The segment each token also sees (the earlier tokens of a prefix its own segment shares
    /// with others: a GRPO group's prompt, computed once for all its responses); its own
    /// segment where there is none.
    pub sees: Vec<u32>,
    /// Target id whose log-prob is scored at each position (the next token; arbitrary where
    /// the caller masks it out).
    pub targets: Vec<u32>,
    /// The positions whose scores the caller reads (ascending), when not all of them: the model
    /// may then skip what only the others' scores need (the last layer's attention output, MLP
    /// and head at a prompt's positions, whose keys and values are all the later positions
    /// read), and everything of the padding but attention's view of the rows. Scores elsewhere
    /// are then 0, and their gradients must be 0.
    pub scored: Option<Vec<usize>>,
}

impl Batch {
    /// Right-pads `seqs` to the longest; targets are each next token (0 at the last token and
    /// on padding). Padding gets token 0 and segment [`PAD_SEGMENT`].
    pub fn padded(seqs: &[&[u32]]) -> Self {
        let rows = seqs.len();
        let seq = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut b = Self::empty(rows, seq);
        for (r, s) in seqs.iter().enumerate() {
            b.put(r * seq, s, 0);
        }
        b
    }

    /// `rows × seq` positions of padding.
    pub(crate) fn empty(rows: usize, seq: usize) -> Self {
        let n = rows * seq;
        Batch {
            rows,
            seq,
            tokens: vec![0; n],
            positions: vec![0; n],
            segments: vec![PAD_SEGMENT; n],
            sees: vec![PAD_SEGMENT; n],
            targets: vec![0; n],
            scored: None,
        }
    }

    /// Writes sequence `s` from position index `i0` as `segment`: positions from 0, each
    /// token's target the next token (0 at the last).
    fn put(&mut self, i0: usize, s: &[u32], segment: u32) {
        self.put_span(i0, s, 0..s.len(), segment, segment);
    }

    /// Writes the tokens `span` of sequence `s` from position index `i0` as `segment`, which
    /// also sees segment `sees` (the segment of `s[..span.start]`, or `segment` itself):
    /// positions from `span.start`, each token's target the next token of `s` (0 at its last).
    pub(crate) fn put_span(
        &mut self,
        i0: usize,
        s: &[u32],
        span: std::ops::Range<usize>,
        segment: u32,
        sees: u32,
    ) {
        for t in span.clone() {
            let i = i0 + t - span.start;
            self.tokens[i] = s[t];
            self.positions[i] = t as u32;
            self.segments[i] = segment;
            self.sees[i] = sees;
            self.targets[i] = s.get(t + 1).copied().unwrap_or(0);
        }
    }

    /// Packs `seqs` in order into rows of `width` positions (at least the longest sequence):
    /// a sequence goes on the current row if it fits, else starts the next. Each sequence is
    /// its own segment with positions from 0 (attention never crosses segments); the rows'
    /// tails are padding as in [`Batch::padded`]. Returns the batch and where each sequence
    /// starts (its first position's index). Short rows (RL prompts and responses) then cost
    /// their tokens, not the longest row's.
    pub fn packed(seqs: &[&[u32]], width: usize) -> (Self, Vec<usize>) {
        let seq = seqs.iter().map(|s| s.len()).max().unwrap_or(0).max(width);
        // (row, offset) of each sequence, next-fit.
        let mut at = Vec::with_capacity(seqs.len());
        let (mut row, mut used) = (0usize, 0usize);
        for s in seqs {
            if used > 0 && used + s.len() > seq {
                (row, used) = (row + 1, 0);
            }
            at.push((row, used));
            used += s.len();
        }
        let rows = if seqs.is_empty() { 0 } else { row + 1 };
        let mut b = Self::empty(rows, seq);
        let mut starts = Vec::with_capacity(seqs.len());
        for (k, (s, &(r, off))) in seqs.iter().zip(&at).enumerate() {
            let i0 = r * seq + off;
            starts.push(i0);
            b.put(i0, s, k as u32);
        }
        (b, starts)
    }

    /// The batch whose caller reads the scores at `positions` only (see [`Batch::scored`]).
    pub fn scoring_only(mut self, positions: Vec<usize>) -> Self {
        self.scored = Some(positions);
        self
    }

    /// Total positions (`rows · seq`).
    pub fn len(&self) -> usize {
        self.rows * self.seq
    }

    /// Its tokens: the positions that are not padding.
    pub fn tokens(&self) -> usize {
        self.segments.iter().filter(|&&s| s != PAD_SEGMENT).count()
    }

    /// Whether the batch holds no position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Refuses a batch the model cannot run, naming the offending value.
    pub fn validate(&self, config: &ModelConfig) -> Result<()> {
        let n = self.len();
        if n == 0 {
            return Err(Error::Batch("the batch is empty".into()));
        }
        for (what, v) in [
            ("tokens", &self.tokens),
            ("positions", &self.positions),
            ("segments", &self.segments),
            ("sees", &self.sees),
            ("targets", &self.targets),
        ] {
            if v.len() != n {
                return Err(Error::Batch(format!(
                    "`{what}` has {} entries, rows·seq is {n}",
                    v.len()
                )));
            }
        }
        let vocab = config.vocab_size as u32;
        if let Some((i, t)) = self
            .tokens
            .iter()
            .chain(&self.targets)
            .enumerate()
            .find(|(_, t)| **t >= vocab)
        {
            return Err(Error::Batch(format!(
                "token id {t} at index {} is not below vocab_size {vocab}",
                i % n
            )));
        }
        if let Some(scored) = &self.scored {
            if let Some(w) = scored.windows(2).find(|w| w[0] >= w[1]) {
                return Err(Error::Batch(format!(
                    "`scored` positions must ascend: {} is followed by {}",
                    w[0], w[1]
                )));
            }
            if let Some(p) = scored.last().filter(|&&p| p >= n) {
                return Err(Error::Batch(format!(
                    "scored position {p} is beyond the batch's {n} positions"
                )));
            }
        }
        if let Some(p) = self
            .positions
            .iter()
            .find(|&&p| p as usize >= config.max_position_embeddings)
        {
            return Err(Error::Batch(format!(
                "position {p} is beyond the context of {} tokens (max_position_embeddings)",
                config.max_position_embeddings
            )));
        }
        Ok(())
    }
}

/// Per-token results of a forward pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scores {
    /// log p(target | prefix) at each position, from logits / temperature.
    pub logp: Vec<f32>,
    /// Entropy of the tempered next-token distribution at each position.
    pub entropy: Vec<f32>,
}

/// Qwen3's q and k before their per-head norms, and the norms' inverse RMS.
struct QkPre {
    q: Vec<f32>,
    k: Vec<f32>,
    q_inv: Vec<f32>,
    k_inv: Vec<f32>,
}

/// Activations one layer keeps for its backward.
struct LayerTape {
    x: Vec<f32>,
    inv1: Vec<f32>,
    h1: Vec<f32>,
    /// Qwen3 only: q and k before their norms.
    qk_pre: Option<QkPre>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    lse: Vec<f32>,
    x2: Vec<f32>,
    inv2: Vec<f32>,
    h2: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    m: Vec<f32>,
}

/// What the decoder stack hands to the head.
struct Trunk {
    hidden: Vec<f32>,
    rope: RopeTable,
    layers: Vec<LayerTape>,
    x_last: Vec<f32>,
    inv_final: Vec<f32>,
}

/// Everything a forward pass keeps for its backward.
pub struct Tape {
    /// The batch; its [`Batch::scored`] names the positions the last layer's output, the final
    /// norm and the head were computed at, when not all.
    batch: Batch,
    /// The positions the trunk ran.
    run: Run,
    temperature: f32,
    rope: RopeTable,
    layers: Vec<LayerTape>,
    x_last: Vec<f32>,
    inv_final: Vec<f32>,
    h_final: Vec<f32>,
    lse: Vec<f32>,
    entropy: Vec<f32>,
}

/// How a layer's attention is computed: over the batch itself (training, scoring), or over a
/// KV cache that also keeps this call's keys and values (generation).
pub trait Attend {
    /// `q` is `[n, heads·head_dim]`, `k` and `v` are `[n, kv_heads·head_dim]`, all rotated.
    /// Writes `out` (`[n, heads·head_dim]`) and returns what the backward needs (the
    /// log-sum-exp per head and query; empty when there is no backward).
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Vec<f32>;
}

/// Attention within a padded or packed batch.
struct BatchAttend<'a> {
    shape: AttnShape,
    /// How the positions given lie in the batch's rows, and their segments.
    rows: Rows<'a>,
    segments: Segments<'a>,
    /// Where the positions given must go among the batch's before attention reads them (the
    /// padding put back), when they are not each row's first positions.
    real: Option<&'a [usize]>,
    scale: f32,
    precision: Precision,
}

/// The positions of a batch the trunk runs: all of them, or — when the batch names the
/// positions it reads ([`Batch::scored`]) — its tokens that are not padding (and every scored
/// one), so that the linear layers, norms and MLP never pay for padding, nor attention where
/// each row's positions run are its first ones (the padding at its end, as packing lays a
/// batch out); otherwise attention alone sees the batch's rows, with the padding put back.
struct Run {
    /// The batch index of each position run, ascending (`None`: every position, in order).
    real: Option<Vec<usize>>,
    tokens: Vec<u32>,
    positions: Vec<u32>,
    /// [`Batch::scored`] as indices among the positions run.
    live: Option<Vec<usize>>,
    /// The batch's rows among the positions run, where the positions run of each row are its
    /// first ones (its padding at its end): attention then reads them where they are.
    ragged: Option<Ragged>,
}

/// A batch's rows as attention reads them among the positions run, each without its padding
/// tail ([`Rows::Ragged`]).
struct Ragged {
    /// `(first, len)` of each row among the positions run.
    rows: Vec<(usize, usize)>,
    /// The segment of each position run.
    ids: Vec<u32>,
    /// The segment each position run also sees.
    sees: Vec<u32>,
}

impl Ragged {
    /// `real`'s rows, when each row's positions in it are its first ones.
    fn of(b: &Batch, real: &[usize]) -> Option<Self> {
        let mut rows = vec![(0, 0); b.rows];
        for (k, &i) in real.iter().enumerate() {
            let (row, at) = (i / b.seq, i % b.seq);
            let (first, len) = &mut rows[row];
            if *len == 0 {
                *first = k;
            }
            if at != *len {
                return None;
            }
            *len += 1;
        }
        // A row without positions starts where the next would.
        let mut next = real.len();
        for (first, len) in rows.iter_mut().rev() {
            if *len == 0 {
                *first = next;
            }
            next = *first;
        }
        Some(Ragged {
            rows,
            ids: real.iter().map(|&i| b.segments[i]).collect(),
            sees: real.iter().map(|&i| b.sees[i]).collect(),
        })
    }
}

impl Run {
    /// Every position of `b`, none singled out.
    fn every(b: &Batch) -> Self {
        Run {
            real: None,
            tokens: b.tokens.clone(),
            positions: b.positions.clone(),
            live: None,
            ragged: None,
        }
    }

    fn of(b: &Batch) -> Self {
        let all = || Run {
            live: b.scored.clone(),
            ..Run::every(b)
        };
        let Some(scored) = &b.scored else {
            return all();
        };
        let mut keep: Vec<bool> = b.segments.iter().map(|&s| s != PAD_SEGMENT).collect();
        scored.iter().for_each(|&i| keep[i] = true);
        let real: Vec<usize> = (0..b.len()).filter(|&i| keep[i]).collect();
        if real.len() == b.len() || real.is_empty() {
            return all();
        }
        let mut index = vec![0usize; b.len()];
        real.iter().enumerate().for_each(|(k, &i)| index[i] = k);
        Run {
            tokens: real.iter().map(|&i| b.tokens[i]).collect(),
            positions: real.iter().map(|&i| b.positions[i]).collect(),
            live: Some(scored.iter().map(|&i| index[i]).collect()),
            ragged: Ragged::of(b, &real),
            real: Some(real),
        }
    }

    /// How attention reads the positions run of `b`: their rows and segments, and where
    /// they must first be spread among the batch's positions (when they are not each row's
    /// first ones).
    fn attention_view<'a>(&'a self, b: &'a Batch) -> (Rows<'a>, Segments<'a>, Option<&'a [usize]>) {
        match &self.ragged {
            Some(r) => (
                Rows::Ragged(&r.rows),
                Segments {
                    ids: &r.ids,
                    sees: &r.sees,
                },
                None,
            ),
            None => (
                Rows::Full,
                Segments {
                    ids: &b.segments,
                    sees: &b.sees,
                },
                self.real.as_deref(),
            ),
        }
    }
}

/// Per-position values of the positions run (`width` each) at their batch positions `real`
/// of `len`, zero on the padding; borrowed when there is nowhere to spread them.
fn padded<'v>(real: Option<&[usize]>, v: &'v [f32], width: usize, len: usize) -> Cow<'v, [f32]> {
    match real {
        None => Cow::Borrowed(v),
        Some(real) => Cow::Owned(spread_rows(v, width, real, len)),
    }
}

impl Attend for BatchAttend<'_> {
    fn attend(
        &mut self,
        _layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Vec<f32> {
        let sh = self.shape;
        let mut lse = vec![0.0; sh.batch * sh.heads * sh.seq];
        let (seg, scale, p) = (self.segments, self.scale, self.precision);
        match self.real {
            None => attention(sh, self.rows, q, k, v, seg, scale, out, &mut lse, p),
            Some(real) => {
                let len = sh.batch * sh.seq;
                let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
                let spread = |x: &[f32], w: usize| spread_rows(x, w, real, len);
                let (q, k, v) = (spread(q, qw), spread(k, kw), spread(v, kw));
                let mut all = vec![0.0; len * qw];
                attention(
                    sh,
                    Rows::Full,
                    &q,
                    &k,
                    &v,
                    seg,
                    scale,
                    &mut all,
                    &mut lse,
                    p,
                );
                out.copy_from_slice(&rows_at(&all, qw, real));
            }
        }
        lse
    }
}

/// A model: config, parameters and the layout that names them.
#[derive(Clone, Debug)]
pub struct Model {
    /// Its configuration.
    pub config: ModelConfig,
    /// Its weights.
    pub params: Params,
    layout: Layout,
    inv_freq: Vec<f64>,
    precision: Precision,
    /// The matrices as a model served in bf16 reads them (`Wᵀ` in bf16, laid out once for
    /// `vdpbf16ps` where the CPU has it), by tensor index; empty unless
    /// [`Model::serve_bf16`].
    served: Vec<Option<Arc<Rhs>>>,
}

/// `y = x · Wᵀ (+ b)` for `n` rows, the product in `p` (or in bf16 on `W`'s served form, when
/// the model is served in bf16).
fn linear(
    x: &[f32],
    n: usize,
    w: &Tensor,
    b: Option<&Tensor>,
    p: Precision,
    served: Option<[&Rhs; 1]>,
) -> Vec<f32> {
    let [y] = linears(x, n, [(w, b)], p, served);
    y
}

/// [`linear`] of several weights over the same input (a layer's q, k, v; gate and up): for the
/// few rows of a decode step one parallel pass over all of them.
fn linears<const N: usize>(
    x: &[f32],
    n: usize,
    ws: [(&Tensor, Option<&Tensor>); N],
    p: Precision,
    served: Option<[&Rhs; N]>,
) -> [Vec<f32>; N] {
    let inp = ws[0].0.shape[1];
    let mut ys = match served {
        // Served in bf16: the inputs are rounded to bf16 too (autocast's rule), on the
        // learner's bf16 kernel whatever the row count, so a row's products are the
        // learner's and do not depend on the batch it was decoded in.
        Some(rhs) => {
            let mut ys = ws.map(|(w, _)| vec![0.0f32; n * w.shape[0]]);
            let mut cs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
            Rhs::matmul_many(&rhs, n, x, &mut cs);
            ys
        }
        None => {
            let bs: Vec<&[f32]> = ws.iter().map(|(w, _)| &w.data[..]).collect();
            let mut ys = matmul_nt_many_new(n, inp, x, &bs, p).into_iter();
            ws.map(|_| ys.next().expect("one output per weight"))
        }
    };
    for (y, (w, b)) in ys.iter_mut().zip(ws) {
        if let Some(b) = b {
            for r in y.chunks_mut(w.shape[0]) {
                r.iter_mut().zip(&b.data).for_each(|(v, b)| *v += b);
            }
        }
    }
    ys
}

/// A linear layer's input `[n, inp]` as its weight gradient (`dW += dYᵀ·X`) reads it: in bf16
/// rounded and packed once for every linear that shares it (q, k and v; gate and up), the
/// values one product each would give.
struct Input<'a> {
    x: &'a [f32],
    packed: Option<Rhs>,
}

impl<'a> Input<'a> {
    fn new(x: &'a [f32], n: usize, inp: usize, p: Precision) -> Self {
        // On `vdpbf16ps` packing once saves re-rounding into k-pairs; the FMA kernel rounds
        // while it copies into buffers each thread keeps, cheaper than a new allocation.
        let once = kernels::matmul::Bf16Kernel::fastest() == kernels::matmul::Bf16Kernel::Dot;
        let packed = (p == Precision::Bf16 && n > 0 && once).then(|| Rhs::new(n, inp, x, Op::N));
        Self { x, packed }
    }
}

/// Backward of [`linear`]: `dW += dyᵀ·x`, `db += Σ dy`, and `dx = dy·W` returned, the
/// products in `p`.
fn linear_backward(
    dy: &[f32],
    n: usize,
    x: &Input<'_>,
    w: &Tensor,
    (dw, db): (&mut [f32], Option<&mut [f32]>),
    p: Precision,
) -> Vec<f32> {
    weight_grads(dy, n, x, w, (dw, db), p);
    let (out, inp) = (w.shape[0], w.shape[1]);
    matmul_new(n, out, inp, dy, Op::N, &w.data, Op::N, Par::Pool, p)
}

/// [`linear_backward`] with `dx += dy·W` (a second linear reading the same input).
fn linear_backward_add(
    dy: &[f32],
    n: usize,
    x: &Input<'_>,
    w: &Tensor,
    (dw, db): (&mut [f32], Option<&mut [f32]>),
    dx: &mut [f32],
    p: Precision,
) {
    weight_grads(dy, n, x, w, (dw, db), p);
    let (out, inp) = (w.shape[0], w.shape[1]);
    matmul(
        n,
        out,
        inp,
        dy,
        Op::N,
        &w.data,
        Op::N,
        dx,
        true,
        Par::Pool,
        p,
    );
}

/// `dW += dyᵀ·x` and `db += Σ dy` of a [`linear`].
fn weight_grads(
    dy: &[f32],
    n: usize,
    x: &Input<'_>,
    w: &Tensor,
    (dw, db): (&mut [f32], Option<&mut [f32]>),
    p: Precision,
) {
    let (out, inp) = (w.shape[0], w.shape[1]);
    match &x.packed {
        Some(xp) => xp.matmul(out, dy, Op::T, dw, true),
        None => matmul(out, n, inp, dy, Op::T, x.x, Op::N, dw, true, Par::Pool, p),
    }
    if let Some(db) = db {
        for r in dy.chunks(out) {
            db.iter_mut().zip(r).for_each(|(a, b)| *a += b);
        }
    }
}

fn add_into(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

/// The rows `at` of `[_, width]` values.
fn rows_at(v: &[f32], width: usize, at: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(at.len() * width);
    for &r in at {
        out.extend_from_slice(&v[r * width..(r + 1) * width]);
    }
    out
}

/// `[at.len(), width]` values as rows `at` of `[len, width]` zeros.
fn spread_rows(v: &[f32], width: usize, at: &[usize], len: usize) -> Vec<f32> {
    let mut out = vec![0.0; len * width];
    add_rows(&mut out, v, width, Some(at));
    out
}

/// Adds `[at.len(), width]` values to rows `at` of `dst` (to every row in order when `at` is
/// `None`).
fn add_rows(dst: &mut [f32], v: &[f32], width: usize, at: Option<&[usize]>) {
    match at {
        None => add_into(dst, v),
        Some(at) => {
            for (&r, src) in at.iter().zip(v.chunks(width)) {
                add_into(&mut dst[r * width..(r + 1) * width], src);
            }
        }
    }
}

impl Model {
    /// A model with the given weights (their names and shapes must follow `config`).
    pub fn new(config: ModelConfig, params: Params) -> Result<Self> {
        let (layout, specs) = Layout::new(&config);
        if specs.len() != params.tensors.len() {
            return Err(Error::config(
                "<params>",
                format!(
                    "{} tensors given, the config needs {}",
                    params.tensors.len(),
                    specs.len()
                ),
            ));
        }
        for ((name, shape), t) in specs.iter().zip(&params.tensors) {
            if *name != t.name
                || *shape != t.shape
                || t.data.len() != shape.iter().product::<usize>()
            {
                return Err(Error::BadTensor {
                    path: "<params>".into(),
                    name: t.name.clone(),
                    msg: format!("expected `{name}` with shape {shape:?}"),
                });
            }
        }
        let inv_freq = inv_freq(config.head_dim, config.rope_theta, config.rope_scaling);
        Ok(Self {
            config,
            params,
            layout,
            inv_freq,
            precision: Precision::F32,
            served: Vec::new(),
        })
    }

    /// Seeded random initialisation from a config (normal(0, 0.02) as `transformers` does).
    pub fn init(config: ModelConfig, seed: u64) -> Self {
        let (_, specs) = Layout::new(&config);
        let params = Params::init(&specs, 0.02, seed);
        Self::new(config, params).expect("init follows the layout")
    }

    /// Loads weights for `config` from a checkpoint folder.
    pub fn load_weights(config: ModelConfig, dir: &Path) -> Result<Self> {
        let (_, specs) = Layout::new(&config);
        let params = Params::load(dir, &specs)?;
        Self::new(config, params)
    }

    /// The arithmetic of its matmuls (linear layers, attention's products and the head; norms,
    /// softmax and the loss stay f32): f32 unless [`Model::set_precision`] says otherwise.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// What attention's products use: bf16 under `precision: bf16` and when served in bf16, so
    /// that an engine serving the model computes them as a bf16 learner does.
    fn inner_precision(&self) -> Precision {
        if self.is_bf16() {
            Precision::Bf16
        } else {
            self.precision
        }
    }

    /// Runs its matmuls in `p` from now on (weights stay f32: bf16 rounds them per product, as
    /// `torch.autocast` does, so f32 master weights need no second copy).
    pub fn set_precision(&mut self, p: Precision) {
        self.precision = p;
    }

    /// Serves the model's products in bf16, as the learner computes them under `precision:
    /// bf16`: the matrices the linear layers and the head read are kept in bf16, laid out once
    /// for bf16 products ([`Rhs::compact`]: `vdpbf16ps` k-pairs where the CPU has them, half
    /// the bytes a decode step streams); each product rounds its input to bf16 too and sums in
    /// f32 (`torch.autocast`'s rule). The embedding rows, norms and biases
    /// stay f32 as the learner's, and so do softmax and log-probs; attention rounds its operands
    /// as the learner's does: an engine serving this model gives a bf16 learner's log-probs.
    pub fn serve_bf16(&mut self) {
        let mut matrices = self.layout.products();
        if self.layout.lm_head.is_none() {
            matrices.push(self.layout.embed);
        }
        self.served = vec![None; self.params.tensors.len()];
        for i in matrices {
            let t = &self.params.tensors[i];
            let (out, inp) = (t.shape[0], t.shape[1]);
            self.served[i] = Some(Arc::new(Rhs::compact(inp, out, &t.data, Op::T)));
        }
    }

    /// Whether [`Model::serve_bf16`] made its products bf16.
    pub fn is_bf16(&self) -> bool {
        !self.served.is_empty()
    }

    /// The bf16 forms of tensors `ids`, when the model is served in bf16.
    fn served_of<const N: usize>(&self, ids: [usize; N]) -> Option<[&Rhs; N]> {
        if self.served.is_empty() {
            return None;
        }
        let forms: Vec<&Rhs> = ids
            .iter()
            .map(|&i| self.served[i].as_deref())
            .collect::<Option<_>>()?;
        forms.try_into().ok()
    }

    /// Where each role's tensor is in `params`.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn t(&self, i: usize) -> &Tensor {
        &self.params.tensors[i]
    }

    fn head_weight(&self) -> &Tensor {
        self.t(self.layout.lm_head.unwrap_or(self.layout.embed))
    }

    fn attn_shape(&self, b: &Batch) -> AttnShape {
        AttnShape {
            batch: b.rows,
            seq: b.seq,
            heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Runs the decoder stack on `run`'s positions of `b`; returns the final normed hidden
    /// states (at `run.live`'s positions only, when given) and, when `keep`, the tape.
    fn trunk(&self, b: &Batch, run: &Run, keep: bool) -> Trunk {
        let (rows, segments, real) = run.attention_view(b);
        let mut attn = BatchAttend {
            shape: self.attn_shape(b),
            rows,
            segments,
            real,
            scale: 1.0 / (self.config.head_dim as f32).sqrt(),
            precision: self.inner_precision(),
        };
        self.layers(
            &run.tokens,
            &run.positions,
            &mut attn,
            keep,
            run.live.as_deref(),
        )
    }

    /// The final normed hidden states (`[tokens, hidden]`) of `tokens` at `positions`, with
    /// attention computed by `attn` (a KV cache, for generation). Token ids and positions must
    /// be valid for the config (generation validates requests before they get here).
    pub fn forward_hidden(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attn: &mut dyn Attend,
    ) -> Vec<f32> {
        assert_eq!(
            tokens.len(),
            positions.len(),
            "forward_hidden: one position per token"
        );
        self.layers(tokens, positions, attn, false, None).hidden
    }

    /// Logits (`[rows, vocab]`) of final hidden states (`[rows, hidden]`).
    pub fn logits_of_hidden(&self, hidden: &[f32]) -> Vec<f32> {
        linear(
            hidden,
            hidden.len() / self.config.hidden_size,
            self.head_weight(),
            None,
            self.precision,
            self.served_of([self.layout.lm_head.unwrap_or(self.layout.embed)]),
        )
    }

    fn layers(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attn: &mut dyn Attend,
        keep: bool,
        live: Option<&[usize]>,
    ) -> Trunk {
        let c = &self.config;
        let (n, h, d) = (tokens.len(), c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let table = RopeTable::new(positions, &self.inv_freq);
        let mut x = vec![0.0f32; n * h];
        embedding::gather(&self.t(self.layout.embed).data, h, tokens, &mut x);
        let mut tapes = Vec::new();
        let last = self.layout.layers.len().saturating_sub(1);
        for (layer, ids) in self.layout.layers.iter().enumerate() {
            // The rows this layer's attention output, MLP and residual are computed for: all,
            // except at the last layer when only `live`'s scores are read (every position's
            // keys and values are still made: later positions attend to them).
            let part = live.filter(|_| layer == last);
            let rows = part.map_or(n, <[usize]>::len);
            let mut h1 = vec![0.0; n * h];
            let mut inv1 = vec![0.0; n];
            norm::rmsnorm(
                &x,
                &self.t(ids.ln1).data,
                c.rms_norm_eps,
                &mut h1,
                &mut inv1,
            );
            let [mut q, mut k, v] = linears(
                &h1,
                n,
                [
                    (self.t(ids.q), ids.q_bias.map(|i| self.t(i))),
                    (self.t(ids.k), ids.k_bias.map(|i| self.t(i))),
                    (self.t(ids.v), ids.v_bias.map(|i| self.t(i))),
                ],
                self.precision,
                self.served_of([ids.q, ids.k, ids.v]),
            );
            let qk_pre = match (ids.q_norm, ids.k_norm) {
                (Some(qn), Some(kn)) => {
                    let (q_pre, k_pre) = (q.clone(), k.clone());
                    let mut q_inv = vec![0.0; n * nh];
                    let mut k_inv = vec![0.0; n * nkv];
                    norm::rmsnorm(&q_pre, &self.t(qn).data, c.rms_norm_eps, &mut q, &mut q_inv);
                    norm::rmsnorm(&k_pre, &self.t(kn).data, c.rms_norm_eps, &mut k, &mut k_inv);
                    Some(QkPre {
                        q: q_pre,
                        k: k_pre,
                        q_inv,
                        k_inv,
                    })
                }
                _ => None,
            };
            rope(&mut q, nh, &table, false);
            rope(&mut k, nkv, &table, false);
            let mut o = vec![0.0; n * nh * d];
            let lse = attn.attend(layer, &q, &k, &v, &mut o);
            let x2 = {
                let (o_in, x_in) = match part {
                    Some(at) => (
                        Cow::Owned(rows_at(&o, nh * d, at)),
                        Cow::Owned(rows_at(&x, h, at)),
                    ),
                    None => (Cow::Borrowed(&o[..]), Cow::Borrowed(&x[..])),
                };
                let mut x2 = linear(
                    &o_in,
                    rows,
                    self.t(ids.o),
                    ids.o_bias.map(|i| self.t(i)),
                    self.precision,
                    self.served_of([ids.o]),
                );
                add_into(&mut x2, &x_in);
                x2
            };
            let mut h2 = vec![0.0; rows * h];
            let mut inv2 = vec![0.0; rows];
            norm::rmsnorm(
                &x2,
                &self.t(ids.ln2).data,
                c.rms_norm_eps,
                &mut h2,
                &mut inv2,
            );
            let [g, u] = linears(
                &h2,
                rows,
                [(self.t(ids.gate), None), (self.t(ids.up), None)],
                self.precision,
                self.served_of([ids.gate, ids.up]),
            );
            let mut m = vec![0.0; g.len()];
            activation::swiglu(&g, &u, &mut m);
            let f = linear(
                &m,
                rows,
                self.t(ids.down),
                None,
                self.precision,
                self.served_of([ids.down]),
            );
            let mut x3 = f;
            add_into(&mut x3, &x2);
            if keep {
                tapes.push(LayerTape {
                    x,
                    inv1,
                    h1,
                    qk_pre,
                    q,
                    k,
                    v,
                    o,
                    lse,
                    x2,
                    inv2,
                    h2,
                    g,
                    u,
                    m,
                });
            }
            x = x3;
        }
        if let (Some(at), true) = (live, self.layout.layers.is_empty()) {
            x = rows_at(&x, h, at);
        }
        let rows = x.len() / h.max(1);
        let mut hf = vec![0.0; rows * h];
        let mut invf = vec![0.0; rows];
        norm::rmsnorm(
            &x,
            &self.t(self.layout.norm).data,
            c.rms_norm_eps,
            &mut hf,
            &mut invf,
        );
        Trunk {
            hidden: hf,
            rope: table,
            layers: tapes,
            x_last: x,
            inv_final: invf,
        }
    }

    /// Full logits `[rows·seq, vocab]` (no temperature). For tests and small batches: it
    /// materialises the whole matrix.
    pub fn logits(&self, b: &Batch) -> Result<Vec<f32>> {
        b.validate(&self.config)?;
        let run = Run::every(b);
        let hidden = self.trunk(b, &run, false).hidden;
        Ok(linear(
            &hidden,
            b.len(),
            self.head_weight(),
            None,
            self.precision,
            self.served_of([self.layout.lm_head.unwrap_or(self.layout.embed)]),
        ))
    }

    /// Log-probs of `b.targets` and entropies, under logits / `temperature`, without a tape.
    pub fn score(&self, b: &Batch, temperature: f32) -> Result<Scores> {
        Ok(self.forward_impl(b, temperature, false)?.0)
    }

    /// Forward keeping what the backward needs.
    pub fn forward(&self, b: &Batch, temperature: f32) -> Result<(Scores, Tape)> {
        let (s, tape) = self.forward_impl(b, temperature, true)?;
        Ok((s, tape.expect("kept")))
    }

    fn forward_impl(
        &self,
        b: &Batch,
        temperature: f32,
        keep: bool,
    ) -> Result<(Scores, Option<Tape>)> {
        b.validate(&self.config)?;
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(Error::Batch(format!(
                "temperature must be positive, got {temperature}"
            )));
        }
        let n = b.len();
        let run = Run::of(b);
        let Trunk {
            hidden: hf,
            rope,
            layers,
            x_last,
            inv_final,
        } = self.trunk(b, &run, keep);
        let targets = targets_at(b, b.scored.as_deref());
        let rows = targets.len();
        let (mut logp, mut entropy, mut lse) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        let w = self.head_weight();
        head::logprob_entropy(
            &hf,
            &w.data,
            self.config.hidden_size,
            &targets,
            temperature,
            &mut logp,
            &mut entropy,
            &mut lse,
            self.precision,
        );
        let scores = match &b.scored {
            None => Scores {
                logp,
                entropy: entropy.clone(),
            },
            Some(at) => {
                let mut s = Scores {
                    logp: vec![0.0; n],
                    entropy: vec![0.0; n],
                };
                for (k, &i) in at.iter().enumerate() {
                    (s.logp[i], s.entropy[i]) = (logp[k], entropy[k]);
                }
                s
            }
        };
        let tape = keep.then(|| Tape {
            batch: b.clone(),
            run,
            temperature,
            rope,
            layers,
            x_last,
            inv_final,
            h_final: hf,
            lse,
            entropy,
        });
        Ok((scores, tape))
    }

    /// Backward from d(loss)/d(logp) and d(loss)/d(entropy) per position; accumulates into
    /// `grads` (same layout as `params`).
    pub fn backward(&self, tape: Tape, d_logp: &[f32], d_entropy: &[f32], grads: &mut Params) {
        let c = &self.config;
        let b = &tape.batch;
        let (n, h) = (b.len(), c.hidden_size);
        assert!(
            d_logp.len() == n && d_entropy.len() == n,
            "backward: gradient length"
        );
        let (d_logp, d_entropy) = match &b.scored {
            None => (Cow::Borrowed(d_logp), Cow::Borrowed(d_entropy)),
            Some(at) => {
                let mut live = vec![false; n];
                at.iter().for_each(|&i| live[i] = true);
                assert!(
                    (0..n).all(|i| live[i] || (d_logp[i] == 0.0 && d_entropy[i] == 0.0)),
                    "backward: a gradient at a position the batch does not score"
                );
                let pick = |v: &[f32]| -> Vec<f32> { at.iter().map(|&i| v[i]).collect() };
                (Cow::Owned(pick(d_logp)), Cow::Owned(pick(d_entropy)))
            }
        };
        let targets = targets_at(b, b.scored.as_deref());
        let head_id = self.layout.lm_head.unwrap_or(self.layout.embed);
        let mut dh = vec![0.0; targets.len() * h];
        head::logprob_entropy_backward(
            &tape.h_final,
            &self.t(head_id).data,
            h,
            &targets,
            tape.temperature,
            &tape.lse,
            &tape.entropy,
            &d_logp,
            &d_entropy,
            &mut dh,
            &mut grads.tensors[head_id].data,
            self.precision,
        );
        self.backward_hidden(tape, &dh, grads);
    }

    /// Final normed hidden states of a batch (`[positions, hidden]`, the positions of
    /// [`Batch::scored`] when it is set, in its order), keeping what [`Model::backward_hidden`]
    /// needs: the trunk of a model whose head is not the LM head (a critic's value head).
    pub fn forward_hidden_tape(&self, b: &Batch) -> Result<(Vec<f32>, Tape)> {
        b.validate(&self.config)?;
        let run = Run::of(b);
        let Trunk {
            hidden,
            rope,
            layers,
            x_last,
            inv_final,
        } = self.trunk(b, &run, true);
        let tape = Tape {
            batch: b.clone(),
            run,
            temperature: 1.0,
            rope,
            layers,
            x_last,
            inv_final,
            h_final: Vec::new(),
            lse: Vec::new(),
            entropy: Vec::new(),
        };
        Ok((hidden, tape))
    }

    /// Backward from d(loss)/d(final hidden states) (`[positions, hidden]`, the positions
    /// [`Model::forward_hidden_tape`] gave) through the decoder stack and the embedding; accumulates into the first tensors of `grads` (same layout as
    /// `params`; tensors after them, such as a value head's, are left alone).
    pub fn backward_hidden(&self, tape: Tape, dh: &[f32], grads: &mut Params) {
        let c = &self.config;
        let b = &tape.batch;
        let run = &tape.run;
        let (n, h, d) = (run.tokens.len(), c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let live = run.live.as_deref();
        let rows = live.map_or(n, <[usize]>::len);
        assert_eq!(dh.len(), rows * h, "backward_hidden: gradient length");
        let sh = self.attn_shape(b);
        let scale = 1.0 / (d as f32).sqrt();
        let mut dx = vec![0.0; rows * h];
        norm::rmsnorm_backward(
            &tape.x_last,
            &self.t(self.layout.norm).data,
            &tape.inv_final,
            dh,
            &mut dx,
            &mut grads.tensors[self.layout.norm].data,
        );
        let last = self.layout.layers.len().saturating_sub(1);
        for (layer, (ids, lt)) in self.layout.layers.iter().zip(tape.layers).enumerate().rev() {
            // The rows the forward computed this layer's attention output and MLP at.
            let part = live.filter(|_| layer == last);
            let rows = part.map_or(n, <[usize]>::len);
            // MLP: x3 = x2 + down(swiglu(gate(h2), up(h2)))
            let dm = linear_backward(
                &dx,
                rows,
                &Input::new(&lt.m, rows, self.t(ids.down).shape[1], self.precision),
                self.t(ids.down),
                (&mut grads.tensors[ids.down].data, None),
                self.precision,
            );
            let (mut dg, mut du) = (vec![0.0; dm.len()], vec![0.0; dm.len()]);
            activation::swiglu_backward(&lt.g, &lt.u, &dm, &mut dg, &mut du);
            drop(dm);
            let h2 = Input::new(&lt.h2, rows, h, self.precision);
            let mut dh2 = linear_backward(
                &dg,
                rows,
                &h2,
                self.t(ids.gate),
                (&mut grads.tensors[ids.gate].data, None),
                self.precision,
            );
            linear_backward_add(
                &du,
                rows,
                &h2,
                self.t(ids.up),
                (&mut grads.tensors[ids.up].data, None),
                &mut dh2,
                self.precision,
            );
            let mut dx2 = vec![0.0; rows * h];
            norm::rmsnorm_backward(
                &lt.x2,
                &self.t(ids.ln2).data,
                &lt.inv2,
                &dh2,
                &mut dx2,
                &mut grads.tensors[ids.ln2].data,
            );
            add_into(&mut dx2, &dx);
            // Attention: x2 = x + o_proj(attn(rope(q), rope(k), v))
            let d_o = {
                let o_in = match part {
                    Some(at) => Cow::Owned(rows_at(&lt.o, nh * d, at)),
                    None => Cow::Borrowed(&lt.o[..]),
                };
                let d_o = linear_backward(
                    &dx2,
                    rows,
                    &Input::new(&o_in, rows, self.t(ids.o).shape[1], self.precision),
                    self.t(ids.o),
                    two_mut(&mut grads.tensors, ids.o, ids.o_bias),
                    self.precision,
                );
                match part {
                    Some(at) => {
                        let mut all = vec![0.0; lt.o.len()];
                        add_rows(&mut all, &d_o, nh * d, Some(at));
                        all
                    }
                    None => d_o,
                }
            };
            // Attention reads the positions run where they are, or (when they are not each
            // row's first) on the batch's rows: the padding put back, then taken out.
            let (rows, segments, real) = run.attention_view(b);
            let (qw, kw) = (nh * d, nkv * d);
            let len = real.map_or(n, |_| b.len());
            let (mut dq, mut dk, mut dv) = (
                vec![0.0; len * qw],
                vec![0.0; len * kw],
                vec![0.0; len * kw],
            );
            attention_backward(
                sh,
                rows,
                &padded(real, &lt.q, qw, len),
                &padded(real, &lt.k, kw, len),
                &padded(real, &lt.v, kw, len),
                segments,
                scale,
                &padded(real, &lt.o, qw, len),
                &lt.lse,
                &padded(real, &d_o, qw, len),
                &mut dq,
                &mut dk,
                &mut dv,
                self.inner_precision(),
            );
            let gathered = |v: Vec<f32>, w: usize| match real {
                None => v,
                Some(real) => rows_at(&v, w, real),
            };
            let (mut dq, mut dk, dv) = (gathered(dq, qw), gathered(dk, kw), gathered(dv, kw));
            drop(d_o);
            rope(&mut dq, nh, &tape.rope, true);
            rope(&mut dk, nkv, &tape.rope, true);
            if let (
                Some(QkPre {
                    q: q_pre,
                    k: k_pre,
                    q_inv,
                    k_inv,
                }),
                Some(qn),
                Some(kn),
            ) = (&lt.qk_pre, ids.q_norm, ids.k_norm)
            {
                let mut dq_pre = vec![0.0; dq.len()];
                norm::rmsnorm_backward(
                    q_pre,
                    &self.t(qn).data,
                    q_inv,
                    &dq,
                    &mut dq_pre,
                    &mut grads.tensors[qn].data,
                );
                dq = dq_pre;
                let mut dk_pre = vec![0.0; dk.len()];
                norm::rmsnorm_backward(
                    k_pre,
                    &self.t(kn).data,
                    k_inv,
                    &dk,
                    &mut dk_pre,
                    &mut grads.tensors[kn].data,
                );
                dk = dk_pre;
            }
            let h1 = Input::new(&lt.h1, n, h, self.precision);
            let mut dh1 = linear_backward(
                &dq,
                n,
                &h1,
                self.t(ids.q),
                two_mut(&mut grads.tensors, ids.q, ids.q_bias),
                self.precision,
            );
            linear_backward_add(
                &dk,
                n,
                &h1,
                self.t(ids.k),
                two_mut(&mut grads.tensors, ids.k, ids.k_bias),
                &mut dh1,
                self.precision,
            );
            linear_backward_add(
                &dv,
                n,
                &h1,
                self.t(ids.v),
                two_mut(&mut grads.tensors, ids.v, ids.v_bias),
                &mut dh1,
                self.precision,
            );
            let mut dx1 = vec![0.0; n * h];
            norm::rmsnorm_backward(
                &lt.x,
                &self.t(ids.ln1).data,
                &lt.inv1,
                &dh1,
                &mut dx1,
                &mut grads.tensors[ids.ln1].data,
            );
            add_rows(&mut dx1, &dx2, h, part);
            dx = dx1;
        }
        if let (Some(at), true) = (live, self.layout.layers.is_empty()) {
            let mut all = vec![0.0; n * h];
            add_rows(&mut all, &dx, h, Some(at));
            dx = all;
        }
        embedding::scatter_add(
            &mut grads.tensors[self.layout.embed].data,
            h,
            &run.tokens,
            &dx,
        );
    }
}

/// The targets at positions `at` (all of them when `None`).
fn targets_at<'b>(b: &'b Batch, at: Option<&[usize]>) -> Cow<'b, [u32]> {
    match at {
        None => Cow::Borrowed(&b.targets),
        Some(at) => Cow::Owned(at.iter().map(|&i| b.targets[i]).collect()),
    }
}

/// Mutable access to a weight's gradient and, when present, its bias's.
fn two_mut(t: &mut [Tensor], w: usize, b: Option<usize>) -> (&mut [f32], Option<&mut [f32]>) {
    match b {
        None => (&mut t[w].data, None),
        Some(bi) => {
            assert!(bi > w, "bias tensors follow their weights in the layout");
            let (lo, hi) = t.split_at_mut(bi);
            (&mut lo[w].data, Some(&mut hi[0].data))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny(arch: &str, extra: serde_json::Value) -> Model {
        let mut cfg = json!({"model_type": arch, "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 64});
        for (k, v) in extra.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        let config = ModelConfig::from_json(cfg, Path::new("test")).unwrap();
        let mut m = Model::init(config, 7);
        // Wider weights than the 0.02 init, so every path carries signal; norms away from 1.
        for (i, t) in m.params.tensors.iter_mut().enumerate() {
            let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(i as u64);
            let mut noise = vec![0.0; t.data.len()];
            crate::rng::fill_normal(&mut rng, &mut noise, 0.3);
            t.data.iter_mut().zip(noise).for_each(|(v, n)| *v += n);
        }
        m
    }

    /// loss = Σ c1·logp + c2·entropy over a padded batch; the directional derivative along a
    /// random direction must match the analytic gradient (f32 central differences).
    fn directional_check(m: &Model) {
        let batch = Batch::padded(&[&[1u32, 5, 9, 13, 2, 7][..], &[3, 4, 11][..]]);
        let n = batch.len();
        let c1: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
        let c2: Vec<f32> = (0..n).map(|i| ((i * 3 % 4) as f32 - 1.5) * 0.2).collect();
        let loss = |m: &Model| -> f64 {
            let s = m.score(&batch, 0.8).unwrap();
            (0..n)
                .map(|i| (c1[i] * s.logp[i] + c2[i] * s.entropy[i]) as f64)
                .sum()
        };
        let (_, tape) = m.forward(&batch, 0.8).unwrap();
        let mut grads = m.params.zeros_like();
        m.backward(tape, &c1, &c2, &mut grads);
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(99);
        let mut dir = m.params.zeros_like();
        for t in &mut dir.tensors {
            crate::rng::fill_normal(&mut rng, &mut t.data, 1.0);
        }
        let analytic: f64 = grads
            .tensors
            .iter()
            .zip(&dir.tensors)
            .map(|(g, d)| {
                g.data
                    .iter()
                    .zip(&d.data)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>()
            })
            .sum();
        let h = 1e-3f32;
        let shifted = |sign: f32| {
            let mut p = m.clone();
            for (t, d) in p.params.tensors.iter_mut().zip(&dir.tensors) {
                t.data
                    .iter_mut()
                    .zip(&d.data)
                    .for_each(|(v, dv)| *v += sign * h * dv);
            }
            loss(&p)
        };
        let numeric = (shifted(1.0) - shifted(-1.0)) / (2.0 * h as f64);
        assert!(
            (numeric - analytic).abs() <= 2e-2 * (1.0 + analytic.abs()),
            "numeric {numeric} vs analytic {analytic}"
        );
    }

    #[test]
    fn qwen3_with_tied_embeddings_backward_matches_finite_differences() {
        directional_check(&tiny("qwen3", json!({"tie_word_embeddings": true})));
    }

    #[test]
    fn llama_with_attention_bias_and_rope_scaling_backward_matches_finite_differences() {
        directional_check(&tiny(
            "llama",
            json!({"attention_bias": true, "rope_scaling":
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 32}}),
        ));
    }

    #[test]
    fn padding_does_not_change_a_rows_scores() {
        let m = tiny("qwen2", json!({}));
        let alone = m.score(&Batch::padded(&[&[3u32, 4, 11][..]]), 1.0).unwrap();
        let padded = m
            .score(
                &Batch::padded(&[&[3u32, 4, 11][..], &[1, 5, 9, 13, 2, 7][..]]),
                1.0,
            )
            .unwrap();
        for i in 0..2 {
            assert!((alone.logp[i] - padded.logp[i]).abs() < 1e-5);
        }
    }

    /// Sequences packed several to a row score as each does alone in a padded batch, in either
    /// precision, and the packing itself: segments, positions from 0, next-fit rows.
    #[test]
    fn packing_does_not_change_a_sequences_scores() {
        let seqs: [&[u32]; 4] = [&[3, 4, 11], &[1, 5, 9, 13, 2, 7], &[8, 6], &[2, 2, 2, 2, 2]];
        let (b, starts) = Batch::packed(&seqs, 8);
        // Rows of 8, next-fit in order: [3 4 11 · pad…] (3 + 6 > 8), [1 5 9 13 2 7 · 8 6],
        // [2 2 2 2 2 · pad pad pad].
        assert_eq!((b.rows, b.seq, starts.clone()), (3, 8, vec![0, 8, 14, 16]));
        assert_eq!(b.segments[8..16], [1, 1, 1, 1, 1, 1, 2, 2]);
        assert_eq!(b.positions[14..21], [0, 1, 0, 1, 2, 3, 4]);
        assert_eq!(b.targets[14..16], [6, 0]);
        assert_eq!(b.segments[21..], [PAD_SEGMENT; 3]);
        for p in [Precision::F32, Precision::Bf16] {
            let mut m = tiny("qwen2", json!({}));
            m.set_precision(p);
            let packed = m.score(&b, 1.0).unwrap();
            for (s, &at) in seqs.iter().zip(&starts) {
                let alone = m.score(&Batch::padded(&[s]), 1.0).unwrap();
                for t in 0..s.len() - 1 {
                    let (a, b) = (alone.logp[t], packed.logp[at + t]);
                    assert!((a - b).abs() < 1e-5, "{p:?} {s:?}[{t}]: {a} vs {b}");
                    let (a, b) = (alone.entropy[t], packed.entropy[at + t]);
                    assert!((a - b).abs() < 1e-5, "{p:?} {s:?}[{t}] entropy: {a} vs {b}");
                }
            }
            // The same loss on every sequence's positions gives the same gradients packed as
            // padded.
            let padded = Batch::padded(&seqs);
            let coef = |s: usize, t: usize| ((s * 5 + t * 3) % 7) as f32 * 0.1 - 0.3;
            let grads = |b: &Batch, at: &dyn Fn(usize, usize) -> usize| {
                let (mut dl, mut de) = (vec![0.0; b.len()], vec![0.0; b.len()]);
                for (i, s) in seqs.iter().enumerate() {
                    for t in 0..s.len() - 1 {
                        dl[at(i, t)] = coef(i, t);
                        de[at(i, t)] = 0.1 * coef(t, i);
                    }
                }
                let (_, tape) = m.forward(b, 0.9).unwrap();
                let mut g = m.params.zeros_like();
                m.backward(tape, &dl, &de, &mut g);
                g
            };
            let gp = grads(&padded, &|i, t| i * padded.seq + t);
            let gk = grads(&b, &|i, t| starts[i] + t);
            for (x, y) in gp.tensors.iter().zip(&gk.tensors) {
                let scale = x.data.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let worst = x
                    .data
                    .iter()
                    .zip(y.data.iter())
                    .fold(0.0f32, |a, (u, v)| a.max((u - v).abs()));
                assert!(
                    worst <= 1e-5 * (1.0 + scale),
                    "{p:?} grad {}: {worst}",
                    x.name
                );
            }
        }
    }

    /// The largest difference between two gradients' tensors, relative to the first's largest
    /// value in that tensor.
    fn worst_gap(a: &Params, b: &Params) -> (f32, String) {
        let mut worst = (0.0f32, String::new());
        for (x, y) in a.tensors.iter().zip(&b.tensors) {
            let scale = x.data.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let gap = x
                .data
                .iter()
                .zip(&y.data)
                .fold(0.0f32, |a, (u, v)| a.max((u - v).abs()))
                / scale.max(f32::MIN_POSITIVE);
            if gap >= worst.0 {
                worst = (gap, x.name.clone());
            }
        }
        worst
    }

    #[test]
    fn scoring_some_positions_gives_their_scores_and_gradients_as_the_whole_pass() {
        let seqs: [&[u32]; 4] = [
            &[3, 4, 11],
            &[1, 5, 9, 13, 2, 7, 8],
            &[8, 6],
            &[2, 2, 2, 2, 2],
        ];
        let (full, _) = Batch::packed(&seqs, 8);
        // Some positions in every row, none of some sequences, not the padding.
        let scored: Vec<usize> = (0..full.len())
            .filter(|&i| full.segments[i] != PAD_SEGMENT && i % 3 != 1 && full.segments[i] != 2)
            .collect();
        let part = full.clone().scoring_only(scored.clone());
        let models = [
            tiny("qwen2", json!({})),
            tiny("qwen3", json!({"tie_word_embeddings": true})),
            tiny("llama", json!({"attention_bias": true})),
        ];
        for (m, p) in models
            .into_iter()
            .flat_map(|m| [Precision::F32, Precision::Bf16].map(|p| (m.clone(), p)))
        {
            let mut m = m;
            m.set_precision(p);
            let arch = &m.config.arch;
            let tol = if p == Precision::F32 { 1e-5 } else { 1e-4 };
            let (a, b) = (m.score(&full, 0.9).unwrap(), m.score(&part, 0.9).unwrap());
            for i in 0..full.len() {
                let (want_l, want_e) = match scored.binary_search(&i) {
                    Ok(_) => (a.logp[i], a.entropy[i]),
                    Err(_) => (0.0, 0.0),
                };
                assert!(
                    (b.logp[i] - want_l).abs() <= tol && (b.entropy[i] - want_e).abs() <= tol,
                    "{arch:?} {p:?} position {i}: {} {} vs {want_l} {want_e}",
                    b.logp[i],
                    b.entropy[i]
                );
            }
            let (mut dl, mut de) = (vec![0.0; full.len()], vec![0.0; full.len()]);
            for (k, &i) in scored.iter().enumerate() {
                dl[i] = ((k * 5) % 7) as f32 * 0.1 - 0.3;
                de[i] = ((k * 3) % 4) as f32 * 0.05 - 0.1;
            }
            let grads = |b: &Batch| {
                let (_, tape) = m.forward(b, 0.9).unwrap();
                let mut g = m.params.zeros_like();
                m.backward(tape, &dl, &de, &mut g);
                g
            };
            let (gap, name) = worst_gap(&grads(&full), &grads(&part));
            let tol = if p == Precision::F32 { 1e-5 } else { 1e-3 };
            assert!(gap <= tol, "{arch:?} {p:?} grad {name}: {gap}");
        }
    }

    #[test]
    #[should_panic(expected = "a position the batch does not score")]
    fn a_gradient_where_nothing_is_scored_is_refused() {
        let m = tiny("qwen2", json!({}));
        let b = Batch::padded(&[&[1u32, 5, 9, 13][..]]).scoring_only(vec![1, 2]);
        let (_, tape) = m.forward(&b, 1.0).unwrap();
        let mut g = m.params.zeros_like();
        m.backward(tape, &[0.5, 0.0, 0.0, 0.0], &[0.0; 4], &mut g);
    }

    #[test]
    fn bad_batches_are_refused_naming_the_value() {
        let m = tiny("qwen2", json!({}));
        let e = m
            .score(&Batch::padded(&[&[3u32, 50][..]]), 1.0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("token id 50") && e.contains("vocab_size 50"),
            "{e}"
        );
        let e = m.score(&Batch::padded(&[]), 1.0).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        let long: Vec<u32> = vec![1; 65];
        let e = m
            .score(&Batch::padded(&[&long[..]]), 1.0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("position 64") && e.contains("max_position_embeddings"),
            "{e}"
        );
        let e = m
            .score(&Batch::padded(&[&[1u32][..]]), 0.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("temperature"), "{e}");
        let b = Batch::padded(&[&[1u32, 5, 9][..]]);
        let e = m
            .score(&b.clone().scoring_only(vec![2, 1]), 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("must ascend: 2 is followed by 1"), "{e}");
        let e = m
            .score(&b.scoring_only(vec![0, 3]), 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("scored position 3 is beyond"), "{e}");
    }
}
