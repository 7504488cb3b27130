//! The paged KV cache: a fixed pool of blocks of `block_size` token slots per layer, a block
//! table per sequence, reference counts so the `n` samples of one prompt share the prompt's
//! full blocks, and the cached attention that generation runs through [`learner::Attend`].

use rayon::prelude::*;

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
        2 * self.layers * self.num_blocks * self.block_size * self.width() * 4
    }
}

/// The pool's memory and bookkeeping.
pub struct BlockPool {
    shape: KvShape,
    /// `[layers][blocks][block_size][kv_heads·head_dim]`
    k: Vec<f32>,
    v: Vec<f32>,
    free: Vec<u32>,
    refs: Vec<u32>,
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
            k: vec![0.0; n],
            v: vec![0.0; n],
            free: (0..shape.num_blocks as u32).rev().collect(),
            refs: vec![0; shape.num_blocks],
        }
    }

    /// Its geometry.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` blocks, or none if fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let out: Vec<u32> = self.free.split_off(self.free.len() - n);
        for &b in &out {
            self.refs[b as usize] = 1;
        }
        Some(out)
    }

    /// Drops a sequence's hold on its blocks; blocks nobody holds return to the pool.
    pub fn release(&mut self, seq: &SeqCache) {
        for &b in &seq.blocks {
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
            self.k.copy_within(a..a + blk, b);
            self.v.copy_within(a..a + blk, b);
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
        let s = self.pool.shape;
        let (w, d, nh) = (s.width(), s.head_dim, s.heads);
        let group = s.heads / s.kv_heads;
        // 1. store this step's keys and values
        let mut row = 0;
        for (seq, &cnt) in self.seqs.iter().zip(&self.counts) {
            for t in 0..cnt {
                let at = self.pool.slot(layer, seq, seq.len + t);
                self.pool.k[at..at + w].copy_from_slice(&k[(row + t) * w..(row + t + 1) * w]);
                self.pool.v[at..at + w].copy_from_slice(&v[(row + t) * w..(row + t + 1) * w]);
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
        let pool = &*self.pool;
        let scale = 1.0 / (d as f32).sqrt();
        let avx512 = simd_available();
        out.par_chunks_mut(nh * d)
            .zip(q.par_chunks(nh * d))
            .zip(owners.par_iter())
            .for_each_init(Vec::new, |scores: &mut Vec<f32>, ((o, qr), &(si, pos))| {
                let seq = self.seqs[si];
                let slots: Vec<usize> = (0..=pos).map(|p| pool.slot(layer, seq, p)).collect();
                let args = OneQuery {
                    pool,
                    slots: &slots,
                    q: qr,
                    out: o,
                    heads: nh,
                    group,
                    head_dim: d,
                    scale,
                };
                if avx512 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the CPU has the features (checked by `simd_available`).
                    unsafe {
                        attend_one_avx512(args, scores);
                    }
                } else {
                    attend_one(args, scores);
                }
            });
        Vec::new()
    }
}

/// One query token's attention over its cached positions, every head.
struct OneQuery<'a> {
    pool: &'a BlockPool,
    slots: &'a [usize],
    q: &'a [f32],
    out: &'a mut [f32],
    heads: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
}

#[inline(always)]
fn attend_one(a: OneQuery<'_>, scores: &mut Vec<f32>) {
    let d = a.head_dim;
    for h in 0..a.heads {
        let g = h / a.group;
        let qh = &a.q[h * d..(h + 1) * d];
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for &sl in a.slots {
            let kh = &a.pool.k[sl + g * d..sl + (g + 1) * d];
            let sc = kernels::dot(qh, kh) * a.scale;
            max = max.max(sc);
            scores.push(sc);
        }
        let mut sum = 0.0;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        let oh = &mut a.out[h * d..(h + 1) * d];
        oh.fill(0.0);
        let inv = 1.0 / sum;
        for (&p, &sl) in scores.iter().zip(a.slots) {
            let vh = &a.pool.v[sl + g * d..sl + (g + 1) * d];
            let wgt = p * inv;
            oh.iter_mut().zip(vh).for_each(|(x, y)| *x += wgt * y);
        }
    }
}

/// [`attend_one`] compiled for AVX-512, so its loops vectorise 16 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn attend_one_avx512(a: OneQuery<'_>, scores: &mut Vec<f32>) {
    attend_one(a, scores);
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

    fn shape() -> KvShape {
        KvShape {
            layers: 2,
            block_size: 4,
            num_blocks: 6,
            kv_heads: 1,
            heads: 2,
            head_dim: 2,
        }
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
