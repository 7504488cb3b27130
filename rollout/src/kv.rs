//! The paged KV cache: a fixed pool of blocks of `block_size` token slots per layer, a block
//! table per sequence, reference counts so the `n` samples of one prompt share the prompt's
//! full blocks, a **prefix cache** (full blocks of finished sequences kept under the chained
//! hash of the tokens up to them, found again by a later prompt with the same prefix — an
//! episode's next turn, a shared system prompt — and evicted least recently used when blocks
//! run short), and the cached attention that generation runs through [`learner::Attend`].
//! Keys and values are kept in f32, or in bf16 ([`KvShape::dtype`]: half the bytes, so twice
//! the tokens in the same budget and half the bytes a decode step's attention streams), widened
//! to f32 as they are read; the attention's arithmetic is f32 either way.

use learner::params::WeightDtype;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};

/// Geometry of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Decoder layers.
    pub layers: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query heads.
    pub heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// The number format keys and values are kept in.
    pub dtype: WeightDtype,
}

impl KvShape {
    fn width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
    /// Bytes of the whole pool.
    pub fn bytes(&self) -> usize {
        2 * self.layers
            * self.num_blocks
            * self.block_size
            * self.width()
            * self.dtype.bytes() as usize
    }
}

/// The keys and values of the whole pool, each `[layers][blocks][block_size][kv_heads·head_dim]`.
enum KvData {
    F32 {
        k: Vec<f32>,
        v: Vec<f32>,
    },
    /// bf16 bit patterns.
    Bf16 {
        k: Vec<u16>,
        v: Vec<u16>,
    },
}

impl KvData {
    fn new(dtype: WeightDtype, n: usize) -> Self {
        match dtype {
            WeightDtype::F32 => Self::F32 {
                k: kernels::mem::zeroed_f32(n),
                v: kernels::mem::zeroed_f32(n),
            },
            WeightDtype::Bf16 => Self::Bf16 {
                k: vec![0; n],
                v: vec![0; n],
            },
        }
    }

    /// Writes a token's key and value at `at` (rounded to bf16 in a bf16 pool).
    fn store(&mut self, at: usize, key: &[f32], value: &[f32]) {
        fn put<E>(dst: &mut [E], src: &[f32], f: impl Fn(f32) -> E) {
            dst.iter_mut().zip(src).for_each(|(d, &x)| *d = f(x));
        }
        let n = key.len();
        match self {
            Self::F32 { k, v } => {
                k[at..at + n].copy_from_slice(key);
                v[at..at + n].copy_from_slice(value);
            }
            Self::Bf16 { k, v } => {
                put(&mut k[at..at + n], key, kernels::bf16::bits);
                put(&mut v[at..at + n], value, kernels::bf16::bits);
            }
        }
    }

    fn copy_within(&mut self, from: std::ops::Range<usize>, to: usize) {
        match self {
            Self::F32 { k, v } => {
                k.copy_within(from.clone(), to);
                v.copy_within(from, to);
            }
            Self::Bf16 { k, v } => {
                k.copy_within(from.clone(), to);
                v.copy_within(from, to);
            }
        }
    }
}

/// A kept key or value: f32, or a bf16 bit pattern widened as it is read.
trait KvElem: Copy + Send + Sync {
    /// The value as f32 (exact).
    fn f(self) -> f32;
    /// `q · row`.
    fn dot(q: &[f32], row: &[Self]) -> f32;
    /// Sixteen consecutive values as f32.
    ///
    /// # Safety
    /// `p..p+16` must be readable; AVX-512 F must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
    #[inline(always)]
    fn dot(q: &[f32], row: &[f32]) -> f32 {
        kernels::dot(q, row)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl KvElem for u16 {
    #[inline(always)]
    fn f(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }
    #[inline(always)]
    fn dot(q: &[f32], row: &[u16]) -> f32 {
        q.iter().zip(row).map(|(a, b)| a * b.f()).sum()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (16 u16 are 32 bytes).
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

/// The pool's memory and bookkeeping.
pub struct BlockPool {
    shape: KvShape,
    kv: KvData,
    free: Vec<u32>,
    refs: Vec<u32>,
    prefix: Prefix,
}

/// The prefix cache's bookkeeping. A cached block holds one reference of its own; one that no
/// sequence holds besides is evictable, in `lru` by the tick it was last used.
#[derive(Default)]
struct Prefix {
    /// Chained hash → block.
    blocks: HashMap<u64, u32>,
    /// Per block: its hash and tokens, when cached.
    entry: HashMap<u32, (u64, Vec<u32>)>,
    /// Evictable blocks by last use.
    lru: BTreeMap<u64, u32>,
    /// Per evictable block: its key in `lru`.
    since: HashMap<u32, u64>,
    tick: u64,
}

/// The hash of block `tokens` following the blocks hashed `prev`, under `salt` (the weights).
fn chain(salt: u64, prev: u64, tokens: &[u32]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (salt, prev, tokens).hash(&mut h);
    h.finish()
}

/// A sequence's view of the cache: its blocks, and how many tokens they hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqCache {
    /// Block ids, in position order.
    pub blocks: Vec<u32>,
    /// Tokens cached.
    pub len: usize,
}

impl BlockPool {
    /// Allocates the pool.
    pub fn new(shape: KvShape) -> Self {
        let n = shape.layers * shape.num_blocks * shape.block_size * shape.width();
        Self {
            shape,
            kv: KvData::new(shape.dtype, n),
            free: (0..shape.num_blocks as u32).rev().collect(),
            refs: vec![0; shape.num_blocks],
            prefix: Prefix::default(),
        }
    }

    /// Its geometry.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Blocks no sequence holds: free, or kept by the prefix cache only (taken back when
    /// needed).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.prefix.lru.len()
    }

    /// Blocks the prefix cache keeps.
    pub fn cached_blocks(&self) -> usize {
        self.prefix.entry.len()
    }

    /// Takes `n` blocks (evicting the least recently used cached ones when too few are free),
    /// or none if fewer are to be had.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free_blocks() < n {
            return None;
        }
        while self.free.len() < n {
            let (_, b) = self.prefix.lru.pop_first().expect("counted as free");
            self.prefix.since.remove(&b);
            if let Some((h, _)) = self.prefix.entry.remove(&b) {
                self.prefix.blocks.remove(&h);
            }
            self.refs[b as usize] = 0;
            self.free.push(b);
        }
        let out: Vec<u32> = self.free.split_off(self.free.len() - n);
        for &b in &out {
            self.refs[b as usize] = 1;
        }
        Some(out)
    }

    /// Drops a hold on block `b`: one nobody holds returns to the pool, a cached one only the
    /// cache holds becomes evictable.
    fn unref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        } else if *r == 1 && self.prefix.entry.contains_key(&b) {
            self.prefix.tick += 1;
            self.prefix.lru.insert(self.prefix.tick, b);
            self.prefix.since.insert(b, self.prefix.tick);
        }
    }

    /// Drops a sequence's hold on its blocks; blocks nobody holds return to the pool.
    pub fn release(&mut self, seq: &SeqCache) {
        for &b in &seq.blocks {
            self.unref(b);
        }
    }

    /// Keeps `seq`'s full blocks in the prefix cache, under `tokens` (the sequence's tokens
    /// from position 0, at least `seq.len` of them) and `salt` (the weights that computed
    /// them). Blocks already cached, or whose prefix another block holds, are left as they are.
    pub fn remember(&mut self, seq: &SeqCache, tokens: &[u32], salt: u64) {
        let bs = self.shape.block_size;
        let mut h = 0;
        for (i, &b) in seq
            .blocks
            .iter()
            .enumerate()
            .take(seq.len.min(tokens.len()) / bs)
        {
            let block = &tokens[i * bs..(i + 1) * bs];
            h = chain(salt, h, block);
            if self.prefix.entry.contains_key(&b) || self.prefix.blocks.contains_key(&h) {
                continue;
            }
            self.prefix.blocks.insert(h, b);
            self.prefix.entry.insert(b, (h, block.to_vec()));
            self.refs[b as usize] += 1;
        }
    }

    /// The cached blocks holding the longest prefix of `tokens` in whole blocks (never all of
    /// them: the last token is left to compute), held for the caller; `salt` as
    /// [`BlockPool::remember`] got it.
    pub fn lookup(&mut self, tokens: &[u32], salt: u64) -> Vec<u32> {
        let bs = self.shape.block_size;
        let mut out = Vec::new();
        let mut h = 0;
        for block in tokens[..tokens.len().saturating_sub(1)].chunks_exact(bs) {
            h = chain(salt, h, block);
            let Some(&b) = self.prefix.blocks.get(&h) else {
                break;
            };
            if self.prefix.entry.get(&b).is_none_or(|(_, t)| t != block) {
                break;
            }
            if let Some(t) = self.prefix.since.remove(&b) {
                self.prefix.lru.remove(&t);
            }
            self.refs[b as usize] += 1;
            out.push(b);
        }
        out
    }

    /// Forgets every cached block (new weights make them stale): those no sequence holds
    /// return to the pool.
    pub fn forget(&mut self) {
        let mut cached: Vec<u32> = self.prefix.entry.keys().copied().collect();
        cached.sort_unstable();
        self.prefix = Prefix::default();
        for b in cached {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
    }

    /// A copy of `parent` for another sample of the same prompt: full blocks are shared, the
    /// partly filled last block is copied (the samples write different tokens into it), and
    /// `extra` more blocks are added for the tokens the sample may generate. `None` when the
    /// pool lacks the blocks.
    pub fn fork(&mut self, parent: &SeqCache, extra: usize) -> Option<SeqCache> {
        let full = parent.len / self.shape.block_size;
        let partial = !parent.len.is_multiple_of(self.shape.block_size);
        let fresh = self.alloc(partial as usize + extra)?;
        let mut blocks: Vec<u32> = parent.blocks[..full].to_vec();
        for &b in &blocks {
            self.refs[b as usize] += 1;
        }
        let mut fresh = fresh.into_iter();
        if partial {
            let dst = fresh.next().expect("allocated");
            self.copy_block(parent.blocks[full], dst);
            blocks.push(dst);
        }
        blocks.extend(fresh);
        Some(SeqCache {
            blocks,
            len: parent.len,
        })
    }

    fn copy_block(&mut self, src: u32, dst: u32) {
        let s = self.shape;
        let blk = s.block_size * s.width();
        for l in 0..s.layers {
            let base = l * s.num_blocks * blk;
            let (a, b) = (base + src as usize * blk, base + dst as usize * blk);
            self.kv.copy_within(a..a + blk, b);
        }
    }

    fn slot(&self, layer: usize, seq: &SeqCache, pos: usize) -> usize {
        let s = self.shape;
        let block = seq.blocks[pos / s.block_size] as usize;
        ((layer * s.num_blocks + block) * s.block_size + pos % s.block_size) * s.width()
    }
}

/// One forward step over several sequences: `seqs[i]` gets `counts[i]` new tokens (at
/// positions `seq.len..`), laid out one sequence after another. Implements cached attention.
pub struct CachedStep<'a> {
    /// The pool.
    pub pool: &'a mut BlockPool,
    /// Each sequence's cache state before this step.
    pub seqs: Vec<&'a SeqCache>,
    /// New tokens per sequence.
    pub counts: Vec<usize>,
    /// Attention in bf16, as a bf16 learner's ([`learner::Model::is_bf16`]): queries, keys,
    /// values and probabilities rounded to bf16, sums in f32.
    pub bf16: bool,
}

impl learner::Attend for CachedStep<'_> {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Vec<f32> {
        let w = self.pool.shape.width();
        // bf16: the operands as the learner's bf16 attention rounds them (f32: as given).
        fn as_used(bf16: bool, x: &[f32]) -> std::borrow::Cow<'_, [f32]> {
            if bf16 {
                kernels::bf16::rounded(x).into()
            } else {
                x.into()
            }
        }
        let b = self.bf16;
        let (q, k, v) = (as_used(b, q), as_used(b, k), as_used(b, v));
        let (q, k, v) = (&q[..], &k[..], &v[..]);
        // 1. store this step's keys and values
        let mut row = 0;
        for (seq, &cnt) in self.seqs.iter().zip(&self.counts) {
            for t in 0..cnt {
                let at = self.pool.slot(layer, seq, seq.len + t);
                let token = (row + t) * w..(row + t + 1) * w;
                self.pool.kv.store(at, &k[token.clone()], &v[token]);
            }
            row += cnt;
        }
        // 2. each new token attends to every cached position up to its own
        let mut owners = Vec::with_capacity(row);
        for (i, &cnt) in self.counts.iter().enumerate() {
            for t in 0..cnt {
                owners.push((i, self.seqs[i].len + t));
            }
        }
        let step = Step {
            pool: &*self.pool,
            seqs: &self.seqs,
            layer,
            owners: &owners,
            bf16: self.bf16,
        };
        match &self.pool.kv {
            KvData::F32 { k, v } => step.attend_all((k, v), q, out),
            KvData::Bf16 { k, v } => step.attend_all((k, v), q, out),
        }
        Vec::new()
    }
}

/// What every new token of a step attends over.
struct Step<'a> {
    pool: &'a BlockPool,
    seqs: &'a [&'a SeqCache],
    layer: usize,
    /// Per new token: its sequence and position.
    owners: &'a [(usize, usize)],
    /// Probabilities rounded to bf16 before they weigh the values.
    bf16: bool,
}

impl Step<'_> {
    /// Each new token's attention over its cached positions (keys and values `kv`), in
    /// parallel over the tokens.
    fn attend_all<E: KvElem>(&self, kv: (&[E], &[E]), q: &[f32], out: &mut [f32]) {
        let s = self.pool.shape;
        let (d, nh) = (s.head_dim, s.heads);
        let scale = 1.0 / (d as f32).sqrt();
        out.par_chunks_mut(nh * d)
            .zip(q.par_chunks(nh * d))
            .zip(self.owners.par_iter())
            .for_each_init(Vec::new, |scores: &mut Vec<f32>, ((o, qr), &(si, pos))| {
                let seq = self.seqs[si];
                let slots: Vec<usize> = (0..=pos)
                    .map(|p| self.pool.slot(self.layer, seq, p))
                    .collect();
                attend(
                    OneQuery {
                        k: kv.0,
                        v: kv.1,
                        slots: &slots,
                        q: qr,
                        out: o,
                        heads: nh,
                        group: s.heads / s.kv_heads,
                        head_dim: d,
                        scale,
                        round_p: self.bf16,
                    },
                    scores,
                );
            });
    }
}

/// One query token's attention, on the AVX-512 kernel where the CPU has it.
fn attend<E: KvElem>(a: OneQuery<'_, E>, scores: &mut Vec<f32>) {
    if simd_available() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has the features (checked by `simd_available`).
        unsafe {
            return attend_one_avx512(a, scores);
        }
    }
    attend_one(a, scores);
}

/// One query token's attention over its cached positions, every head.
struct OneQuery<'a, E> {
    /// The pool's keys and values.
    k: &'a [E],
    v: &'a [E],
    slots: &'a [usize],
    q: &'a [f32],
    out: &'a mut [f32],
    heads: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
    /// Round the probabilities to bf16.
    round_p: bool,
}

/// One query token's attention over its cached positions, every head. Positions are walked in
/// order, reading each cached key (then value) row once for all heads: a row is one contiguous
/// `kv_heads · head_dim` run and a block's rows follow each other, so the cache streams.
#[inline(always)]
fn attend_one<E: KvElem>(a: OneQuery<'_, E>, scores: &mut Vec<f32>) {
    let (d, nh, np) = (a.head_dim, a.heads, a.slots.len());
    let w = d * (nh / a.group);
    // scores[h · np + p]
    scores.clear();
    scores.resize(nh * np, 0.0);
    for (p, &sl) in a.slots.iter().enumerate() {
        // keys a few rows ahead into L1, this row's values into L2 for the second walk
        if let Some(&ahead) = a.slots.get(p + 4) {
            prefetch_row(&a.k[ahead..ahead + w], false);
        }
        prefetch_row(&a.v[sl..sl + w], true);
        let krow = &a.k[sl..sl + w];
        for h in 0..nh {
            let g = h / a.group;
            scores[h * np + p] =
                E::dot(&a.q[h * d..(h + 1) * d], &krow[g * d..(g + 1) * d]) * a.scale;
        }
    }
    softmax_rows(scores, np, a.round_p);
    a.out.fill(0.0);
    for (p, &sl) in a.slots.iter().enumerate() {
        let vrow = &a.v[sl..sl + w];
        for h in 0..nh {
            let g = h / a.group;
            let wgt = scores[h * np + p];
            a.out[h * d..(h + 1) * d]
                .iter_mut()
                .zip(&vrow[g * d..(g + 1) * d])
                .for_each(|(x, y)| *x += wgt * y.f());
        }
    }
}

/// Each row of `np` scores becomes its softmax (rounded to bf16 when `round`).
#[inline(always)]
fn softmax_rows(scores: &mut [f32], np: usize, round: bool) {
    for row in scores.chunks_exact_mut(np) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0;
        for x in row.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|x| *x *= inv);
        if round {
            row.iter_mut().for_each(|x| *x = kernels::bf16::round(*x));
        }
    }
}

/// [`attend_one`] for `head_dim = 16·DV` in AVX-512 registers: a head's key dot is `DV` fused
/// multiply-adds, and the value walk keeps the outputs of `16 / DV` heads in registers while
/// it passes over the positions (instead of adding into memory per position).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_one_zmm<const DV: usize, E: KvElem>(a: OneQuery<'_, E>, scores: &mut Vec<f32>) {
    use std::arch::x86_64::*;
    let (d, nh, np) = (a.head_dim, a.heads, a.slots.len());
    debug_assert_eq!(d, 16 * DV);
    let w = d * (nh / a.group);
    scores.clear();
    scores.resize(nh * np, 0.0);
    let (q, k, v) = (a.q.as_ptr(), a.k.as_ptr(), a.v.as_ptr());
    for (p, &sl) in a.slots.iter().enumerate() {
        if let Some(&ahead) = a.slots.get(p + 4) {
            prefetch_row(&a.k[ahead..ahead + w], false);
        }
        prefetch_row(&a.v[sl..sl + w], true);
        for h in 0..nh {
            let g = h / a.group;
            let mut acc = _mm512_setzero_ps();
            for u in 0..DV {
                // SAFETY: `q` holds `nh·d` values; slot `sl` starts a row of `w` cached values.
                unsafe {
                    let qv = _mm512_loadu_ps(q.add(h * d + 16 * u));
                    let kv = E::load16(k.add(sl + g * d + 16 * u));
                    acc = _mm512_fmadd_ps(qv, kv, acc);
                }
            }
            scores[h * np + p] = _mm512_reduce_add_ps(acc) * a.scale;
        }
    }
    softmax_rows(scores, np, a.round_p);
    let hc = 16 / DV;
    for h0 in (0..nh).step_by(hc) {
        let h1 = (h0 + hc).min(nh);
        let mut acc = [_mm512_setzero_ps(); 16];
        for (p, &sl) in a.slots.iter().enumerate() {
            for h in h0..h1 {
                let (g, hh) = (h / a.group, h - h0);
                let wgt = _mm512_set1_ps(scores[h * np + p]);
                for u in 0..DV {
                    // SAFETY: as for the keys.
                    let vv = unsafe { E::load16(v.add(sl + g * d + 16 * u)) };
                    acc[hh * DV + u] = _mm512_fmadd_ps(wgt, vv, acc[hh * DV + u]);
                }
            }
        }
        for h in h0..h1 {
            for u in 0..DV {
                // SAFETY: `out` holds `nh·d` values.
                unsafe {
                    _mm512_storeu_ps(
                        a.out.as_mut_ptr().add(h * d + 16 * u),
                        acc[(h - h0) * DV + u],
                    );
                }
            }
        }
    }
}

/// Asks for every cache line of `row`: into L1, or into L2 when `far`.
#[inline(always)]
fn prefetch_row<E>(row: &[E], far: bool) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(64 / std::mem::size_of::<E>()) {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        // SAFETY: prefetching is a hint; the address is inside `row`.
        unsafe {
            if far {
                _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
            } else {
                _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (row, far);
}

/// [`attend_one`] compiled for AVX-512, so its loops vectorise 16 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn attend_one_avx512<E: KvElem>(a: OneQuery<'_, E>, scores: &mut Vec<f32>) {
    // SAFETY (all arms): the caller checked the features.
    match a.head_dim {
        16 => unsafe { attend_one_zmm::<1, E>(a, scores) },
        32 => unsafe { attend_one_zmm::<2, E>(a, scores) },
        64 => unsafe { attend_one_zmm::<4, E>(a, scores) },
        128 => unsafe { attend_one_zmm::<8, E>(a, scores) },
        _ => attend_one(a, scores),
    }
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 kernel gives the plain one's attention, over f32 keys and values and over
    /// bf16 ones; a bf16 pool attends exactly as an f32 pool holding the rounded values.
    #[test]
    fn the_register_kernel_matches_the_plain_one_in_either_format() {
        // head dims of each register width and one the plain path takes; with and without GQA
        for (head_dim, heads, kv_heads, positions) in [
            (16, 4, 2, 5),
            (32, 2, 2, 17),
            (64, 8, 8, 40),
            (128, 4, 1, 33),
            (24, 2, 1, 9),
        ] {
            let mut x = 0.37f32;
            let mut next = || {
                x = (x * 3.7 + 0.13).fract();
                x - 0.5
            };
            let n = 4 * 16 * kv_heads * head_dim;
            let (keys, values): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (next(), next())).unzip();
            let q: Vec<f32> = (0..heads * head_dim).map(|_| next()).collect();
            let round = kernels::bf16::rounded;
            let mut outs = Vec::new();
            for (dtype, rounded) in [
                (WeightDtype::F32, false),
                (WeightDtype::Bf16, false),
                (WeightDtype::F32, true),
            ] {
                let shape = KvShape {
                    layers: 1,
                    block_size: 16,
                    num_blocks: 4,
                    kv_heads,
                    heads,
                    head_dim,
                    dtype,
                };
                let mut pool = BlockPool::new(shape);
                if rounded {
                    pool.kv.store(0, &round(&keys), &round(&values));
                } else {
                    pool.kv.store(0, &keys, &values);
                }
                let seq = SeqCache {
                    blocks: vec![2, 0, 3],
                    len: positions,
                };
                let slots: Vec<usize> = (0..positions).map(|p| pool.slot(0, &seq, p)).collect();
                let run = |simd: bool| match &pool.kv {
                    KvData::F32 { k, v } => one(k, v, &slots, &q, simd, shape),
                    KvData::Bf16 { k, v } => one(k, v, &slots, &q, simd, shape),
                };
                let plain = run(false);
                if simd_available() {
                    let fast = run(true);
                    for (a, b) in fast.iter().zip(&plain) {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "{dtype:?} head_dim {head_dim}: {a} vs {b}"
                        );
                    }
                }
                outs.push(plain);
            }
            // bf16 keys and values: close to f32's, not equal; exactly the rounded values.
            let gap = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max)
            };
            let (g, r) = (gap(&outs[0], &outs[1]), gap(&outs[2], &outs[1]));
            assert!(g > 0.0 && g < 1e-2, "head_dim {head_dim}: bf16 gap {g}");
            assert!(r < 1e-6, "head_dim {head_dim}: bf16 vs rounded f32 {r}");
        }
    }

    /// One query's attention over `slots` of `k`, `v`, on the AVX-512 kernel or the plain one.
    fn one<E: KvElem>(
        k: &[E],
        v: &[E],
        slots: &[usize],
        q: &[f32],
        simd: bool,
        s: KvShape,
    ) -> Vec<f32> {
        let mut out = vec![9.0; s.heads * s.head_dim];
        let args = OneQuery {
            k,
            v,
            slots,
            q,
            out: &mut out,
            heads: s.heads,
            group: s.heads / s.kv_heads,
            head_dim: s.head_dim,
            scale: 0.125,
            round_p: false,
        };
        let mut scores = Vec::new();
        if simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller checked the features.
            unsafe {
                attend_one_avx512(args, &mut scores);
            };
        } else {
            attend_one(args, &mut scores);
        }
        out
    }

    fn shape() -> KvShape {
        KvShape {
            layers: 2,
            block_size: 4,
            num_blocks: 6,
            kv_heads: 1,
            heads: 2,
            head_dim: 2,
            dtype: WeightDtype::F32,
        }
    }

    #[test]
    fn the_prefix_cache_keeps_full_blocks_finds_them_and_evicts_the_oldest() {
        // Blocks of 4 tokens, 6 in the pool.
        let mut pool = BlockPool::new(shape());
        let tokens: Vec<u32> = (0..11).collect();
        let seq = SeqCache {
            blocks: pool.alloc(3).unwrap(),
            len: 10,
        };
        pool.remember(&seq, &tokens, 7);
        // Two full blocks are kept (the third holds only 2 of its 4 tokens).
        assert_eq!(pool.cached_blocks(), 2);
        pool.release(&seq);
        assert_eq!(
            pool.free_blocks(),
            6,
            "cached blocks nobody holds count as free"
        );
        // A prompt continuing the sequence finds both blocks; one that differs in its second
        // block finds the first; other weights find nothing; the last token is always left.
        let hit = pool.lookup(&[tokens.clone(), vec![40, 41]].concat(), 7);
        assert_eq!(hit, seq.blocks[..2]);
        assert_eq!(pool.free_blocks(), 4, "held again");
        pool.release(&SeqCache {
            blocks: hit,
            len: 8,
        });
        let other: Vec<u32> = [&tokens[..4], &[9, 9, 9, 9, 1][..]].concat();
        let one = pool.lookup(&other, 7);
        assert_eq!(one, seq.blocks[..1]);
        pool.release(&SeqCache {
            blocks: one,
            len: 4,
        });
        assert!(pool.lookup(&tokens, 8).is_empty());
        assert_eq!(
            pool.lookup(&tokens[..8], 7).len(),
            1,
            "8 tokens: the last is left"
        );
        pool.release(&SeqCache {
            blocks: vec![seq.blocks[0]],
            len: 4,
        });
        // Allocating past the free blocks evicts the least recently used cached block first:
        // the second (released before the first was used again).
        let taken = pool.alloc(5).unwrap();
        assert_eq!(pool.cached_blocks(), 1);
        assert_eq!(pool.lookup(&tokens, 7), seq.blocks[..1]);
        assert!(
            pool.alloc(1).is_none(),
            "the held cached block is not evictable"
        );
        pool.release(&SeqCache {
            blocks: taken,
            len: 0,
        });
        // New weights: everything cached is forgotten, and the pool is whole again.
        pool.release(&SeqCache {
            blocks: seq.blocks[..1].to_vec(),
            len: 4,
        });
        pool.forget();
        assert_eq!((pool.cached_blocks(), pool.free_blocks()), (0, 6));
        assert_eq!(pool.free.len(), 6);
    }

    #[test]
    fn fork_shares_full_blocks_and_copies_the_partial_one() {
        let mut pool = BlockPool::new(shape());
        let parent = SeqCache {
            blocks: pool.alloc(2).unwrap(),
            len: 6,
        };
        assert_eq!(pool.free_blocks(), 4);
        let child = pool.fork(&parent, 1).unwrap();
        assert_eq!(child.blocks[0], parent.blocks[0]);
        assert_ne!(child.blocks[1], parent.blocks[1]);
        assert_eq!(pool.free_blocks(), 2);
        pool.release(&parent);
        // the shared block is still held by the child
        assert_eq!(pool.free_blocks(), 3);
        pool.release(&child);
        assert_eq!(pool.free_blocks(), 6);
        assert!(pool.alloc(7).is_none());
    }
}
