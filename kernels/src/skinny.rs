//! `C[m,n] = A[m,k] · Bᵀ` for few rows `m` (decode steps: one row per sequence), with `B`
//! stored `[n,k]` row-major (a linear layer's weight). Dense GEMM libraries pack `B` on every
//! call, which for a handful of rows doubles the memory traffic of what is a bandwidth-bound
//! product; here each weight row is streamed once. Up to 4 rows, each weight row is dotted with
//! every row of `A` as it streams by ([`block_rows`]); 5–64 rows take outer products against a
//! transposed copy of `A`, one L1-sized k-block at a time ([`block_t`]). Several weights read by
//! the same rows (q, k, v) go through one parallel pass ([`matmul_nt_many`]).

use crate::embedding::SendPtr;
use rayon::prelude::*;

/// Rows of `B` handled per task (a block of outputs).
const N_BLOCK: usize = 48;

/// Columns `n0..n1` of C for `M` ≤ 4 rows of A: each weight row is read once, in order (a task
/// is one sequential stream, which the hardware prefetchers follow at full bandwidth), and
/// dotted with every row of A in `M × 4` vector accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block_rows<const M: usize>(
    a: &[f32],
    k: usize,
    b: &[f32],
    n0: usize,
    n1: usize,
    c: *mut f32,
    n: usize,
) {
    use std::arch::x86_64::*;
    const U: usize = 4;
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    for j in n0..n1 {
        let mut acc = [[_mm512_setzero_ps(); U]; M];
        let mut p = 0;
        // SAFETY (loads): row j < n of B and rows i < M of A hold k floats; p + 16 <= k.
        while p + 16 * U <= k {
            for u in 0..U {
                let bv = unsafe { _mm512_loadu_ps(bp.add(j * k + p + 16 * u)) };
                for (i, acc) in acc.iter_mut().enumerate() {
                    let av = unsafe { _mm512_loadu_ps(ap.add(i * k + p + 16 * u)) };
                    acc[u] = _mm512_fmadd_ps(av, bv, acc[u]);
                }
            }
            p += 16 * U;
        }
        while p + 16 <= k {
            let bv = unsafe { _mm512_loadu_ps(bp.add(j * k + p)) };
            for (i, acc) in acc.iter_mut().enumerate() {
                let av = unsafe { _mm512_loadu_ps(ap.add(i * k + p)) };
                acc[0] = _mm512_fmadd_ps(av, bv, acc[0]);
            }
            p += 16;
        }
        for (i, acc) in acc.iter().enumerate() {
            let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            let mut sum = _mm512_reduce_add_ps(v);
            for q in p..k {
                sum += a[i * k + q] * b[j * k + q];
            }
            // SAFETY: (i, j) is inside C, and this task alone writes its columns.
            unsafe { *c.add(i * n + j) = sum };
        }
    }
}

/// Depth of one k-block of the outer-product path: the block's slice of Aᵀ
/// (`KC · 16·MV` floats, 16 KiB at 64 rows) stays in L1 while every B row of the task passes.
const KC: usize = 64;

/// `ct[jj] (+)= Σ_{p ∈ k0..k1} Aᵀ[p] · B[j+jj, p]` for `NR` rows of B against all (padded)
/// rows of A: an outer product per k with no horizontal reductions. `ct` holds `NR` rows of
/// `16·MV` floats (Cᵀ rows); `first` starts from zero instead of loading them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile_t<const MV: usize, const NR: usize>(
    at: &[f32],
    k: usize,
    k0: usize,
    k1: usize,
    b: &[f32],
    j: usize,
    ct: &mut [f32],
    first: bool,
) {
    use std::arch::x86_64::*;
    let mp = 16 * MV;
    let mut acc = [[_mm512_setzero_ps(); MV]; NR];
    if !first {
        for jj in 0..NR {
            for v in 0..MV {
                // SAFETY: ct holds NR rows of mp floats.
                acc[jj][v] = unsafe { _mm512_loadu_ps(ct.as_ptr().add(jj * mp + 16 * v)) };
            }
        }
    }
    for p in k0..k1 {
        if (p - k0).is_multiple_of(16) {
            for jj in 0..NR {
                // the same rows' next k-block, one line per row per 16 steps, into L2
                let ahead = b.as_ptr().wrapping_add((j + jj) * k + p + KC);
                _mm_prefetch::<_MM_HINT_T1>(ahead.cast());
            }
        }
        let mut av = [_mm512_setzero_ps(); MV];
        for v in 0..MV {
            // SAFETY: `at` holds k rows of mp floats and p < k1 <= k.
            av[v] = unsafe { _mm512_loadu_ps(at.as_ptr().add(p * mp + 16 * v)) };
        }
        for jj in 0..NR {
            // SAFETY: row j+jj of B exists (full tiles only) and p < k.
            let bb = _mm512_set1_ps(unsafe { *b.get_unchecked((j + jj) * k + p) });
            for v in 0..MV {
                acc[jj][v] = _mm512_fmadd_ps(av[v], bb, acc[jj][v]);
            }
        }
    }
    for jj in 0..NR {
        for v in 0..MV {
            // SAFETY: ct holds NR rows of mp floats.
            unsafe { _mm512_storeu_ps(ct.as_mut_ptr().add(jj * mp + 16 * v), acc[jj][v]) };
        }
    }
}

/// Columns `n0..n1` (at most [`N_BLOCK`]) of C for 4 < m ≤ 64 through [`tile_t`], one k-block
/// at a time over all of the task's B rows, then written out row by row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block_t<const MV: usize>(
    at: &[f32],
    m: usize,
    k: usize,
    b: &[f32],
    n0: usize,
    n1: usize,
    c: *mut f32,
    n: usize,
) {
    const NR: usize = 6;
    let mp = 16 * MV;
    let mut ct = [0.0f32; N_BLOCK * 64];
    // the first k-block of every row; later blocks are fetched one block ahead by `tile_t`
    for j in n0..n1 {
        for p in (0..KC.min(k)).step_by(16) {
            use std::arch::x86_64::*;
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(j * k + p).cast());
        }
    }
    let mut k0 = 0;
    while k0 < k {
        let k1 = (k0 + KC).min(k);
        let mut j = n0;
        while j < n1 {
            let rows = (n1 - j).min(NR);
            let t = &mut ct[(j - n0) * mp..];
            // SAFETY: feature present; full tiles read NR rows of B, edges one row at a time.
            unsafe {
                if rows == NR {
                    tile_t::<MV, NR>(at, k, k0, k1, b, j, t, k0 == 0);
                } else {
                    for r in 0..rows {
                        tile_t::<MV, 1>(at, k, k0, k1, b, j + r, &mut t[r * mp..], k0 == 0);
                    }
                }
            }
            j += NR;
        }
        k0 = k1;
    }
    for i in 0..m {
        for j in n0..n1 {
            // SAFETY: (i, j) is inside C; this task alone writes columns n0..n1.
            unsafe { *c.add(i * n + j) = ct[(j - n0) * mp + i] };
        }
    }
}

fn block_scalar(
    a: &[f32],
    m: usize,
    k: usize,
    b: &[f32],
    n0: usize,
    n1: usize,
    c: *mut f32,
    n: usize,
) {
    for i in 0..m {
        for j in n0..n1 {
            let s: f32 = a[i * k..(i + 1) * k]
                .iter()
                .zip(&b[j * k..(j + 1) * k])
                .map(|(x, y)| x * y)
                .sum();
            // SAFETY: as in the SIMD path.
            unsafe { *c.add(i * n + j) = s };
        }
    }
}

/// Whether this CPU has the SIMD path (otherwise callers should prefer a GEMM library).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `C = A · Bᵀ`, `A` `[m,k]`, `B` `[n,k]`, `C` `[m,n]` (overwritten).
pub fn matmul_nt(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(
        b.len() >= n * k && c.len() >= m * n,
        "skinny matmul: shapes"
    );
    matmul_nt_many(m, k, a, &[&b[..n * k]], &mut [&mut c[..m * n]]);
}

/// `Cᵢ = A · Bᵢᵀ` for several weights read by the same rows (a layer's q, k and v; gate and
/// up), in one parallel pass: `A` `[m,k]`, `Bᵢ` `[nᵢ,k]`, `Cᵢ` `[m,nᵢ]` (overwritten), with
/// `nᵢ = Bᵢ.len() / k`. One pass packs `A` once and balances the threads over every output.
pub fn matmul_nt_many(m: usize, k: usize, a: &[f32], bs: &[&[f32]], cs: &mut [&mut [f32]]) {
    assert!(
        a.len() >= m * k && bs.len() == cs.len() && k > 0,
        "skinny matmul: shapes"
    );
    let ns: Vec<usize> = bs.iter().map(|b| b.len() / k).collect();
    for (i, c) in cs.iter().enumerate() {
        assert!(
            bs[i].len() == ns[i] * k && c.len() >= m * ns[i],
            "skinny matmul: shapes"
        );
    }
    if m == 0 {
        return;
    }
    let simd = available();
    // 5–64 rows: the outer-product path reads Aᵀ, zero-padded to whole vectors ([k, 16·mv]).
    let packed = (simd && m > 4 && m <= 64).then(|| {
        let mp = 16 * m.div_ceil(16);
        let mut at = vec![0.0f32; k * mp];
        // 16 columns of A per task: written in order, the rows' lines stay in L1
        at.par_chunks_mut(16 * mp)
            .enumerate()
            .for_each(|(blk, out)| {
                for (r, dst) in out.chunks_exact_mut(mp).enumerate() {
                    let p = blk * 16 + r;
                    for (i, x) in dst[..m].iter_mut().enumerate() {
                        *x = a[i * k + p];
                    }
                }
            });
        at
    });
    let cps: Vec<SendPtr> = cs.iter_mut().map(|c| SendPtr(c.as_mut_ptr())).collect();
    // Tasks of whole 6-column tiles, at most N_BLOCK columns of one output each, as many per
    // thread; a task's tiles may span the end of one output and the start of the next.
    let starts: Vec<usize> = ns
        .iter()
        .scan(0, |acc, &n| {
            let s = *acc;
            *acc += n.div_ceil(6);
            Some(s)
        })
        .collect();
    let tiles: usize = ns.iter().map(|n| n.div_ceil(6)).sum();
    let threads = rayon::current_num_threads().max(1);
    let tasks = threads * tiles.div_ceil(threads * (N_BLOCK / 6)).max(1);
    (0..tasks).into_par_iter().for_each(|t| {
        let (t0, t1) = (t * tiles / tasks, (t + 1) * tiles / tasks);
        for (o, (&n, &s)) in ns.iter().zip(&starts).enumerate() {
            let (lo, hi) = (t0.max(s), t1.min(s + n.div_ceil(6)));
            if lo >= hi {
                continue;
            }
            let (n0, n1) = (6 * (lo - s), (6 * (hi - s)).min(n));
            let (b, c) = (bs[o], cps[o].0);
            if !simd {
                block_scalar(a, m, k, b, n0, n1, c, n);
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the feature is present; bounds as asserted above; tasks write disjoint
            // columns of each output.
            unsafe {
                match (&packed, m) {
                    (None, 1) => block_rows::<1>(a, k, b, n0, n1, c, n),
                    (None, 2) => block_rows::<2>(a, k, b, n0, n1, c, n),
                    (None, 3) => block_rows::<3>(a, k, b, n0, n1, c, n),
                    (None, _) => block_rows::<4>(a, k, b, n0, n1, c, n),
                    (Some(at), 5..=16) => block_t::<1>(at, m, k, b, n0, n1, c, n),
                    (Some(at), 17..=32) => block_t::<2>(at, m, k, b, n0, n1, c, n),
                    (Some(at), 33..=48) => block_t::<3>(at, m, k, b, n0, n1, c, n),
                    (Some(at), _) => block_t::<4>(at, m, k, b, n0, n1, c, n),
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::{Op, Par, Precision, matmul};
    use crate::testutil::{close, randn};

    #[test]
    fn matches_the_gemm_path_for_ragged_shapes() {
        for (m, k, n) in [
            (1, 37, 70),
            (3, 64, 129),
            (7, 160, 64),
            (64, 17, 5),
            (16, 33, 13),
            (40, 512, 97),
        ] {
            let a = randn(m * k, 1);
            let b = randn(n * k, 2);
            let mut want = vec![0.0; m * n];
            matmul(
                m,
                k,
                n,
                &a,
                Op::N,
                &b,
                Op::T,
                &mut want,
                false,
                Par::Single,
                Precision::F32,
            );
            let mut got = vec![9.0; m * n];
            matmul_nt(m, k, n, &a, &b, &mut got);
            close(&got, &want, 1e-4, "skinny");
        }
    }

    #[test]
    fn several_weights_in_one_pass_match_one_at_a_time() {
        // outputs of 5, 48 and 131 columns: tasks straddle outputs and end in partial tiles
        for (m, k) in [(0, 8), (1, 40), (4, 33), (9, 64), (16, 100), (64, 70)] {
            let a = randn(m * k, 3);
            let ns = [5usize, 48, 131];
            let bs: Vec<Vec<f32>> = ns.iter().map(|&n| randn(n * k, n as u64)).collect();
            let mut got: Vec<Vec<f32>> = ns.iter().map(|&n| vec![9.0; m * n]).collect();
            {
                let b: Vec<&[f32]> = bs.iter().map(|b| &b[..]).collect();
                let mut c: Vec<&mut [f32]> = got.iter_mut().map(|c| &mut c[..]).collect();
                matmul_nt_many(m, k, &a, &b, &mut c);
            }
            for ((b, g), &n) in bs.iter().zip(&got).zip(&ns) {
                let mut want = vec![0.0; m * n];
                matmul(
                    m,
                    k,
                    n,
                    &a,
                    Op::N,
                    b,
                    Op::T,
                    &mut want,
                    false,
                    Par::Single,
                    Precision::F32,
                );
                close(g, &want, 1e-4, &format!("m {m} k {k} n {n}"));
            }
        }
    }
}
