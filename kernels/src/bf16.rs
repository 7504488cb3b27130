//! bf16 matrix multiply with f32 accumulation — what `torch.autocast(dtype=bfloat16)` does to
//! a linear layer: both operands rounded to bf16 (round to nearest even), every product summed
//! in f32, the result f32.
//!
//! On CPUs with AVX512-BF16 the products run on `vdpbf16ps` (two bf16 products per f32 lane
//! per instruction, twice the rate of f32 FMA): both operands are rounded while they are packed
//! into panels of k-pairs ([`pack`]), and an `MR × 32` register tile walks the pairs
//! ([`tile`]). [`available`] says whether a machine has it; elsewhere the matmul module rounds
//! the operands ([`round`]) into its f32 GEMM (a product of two bf16 values is exact in f32, so
//! only the summation order differs).
//!
//! Owns the bf16 number ([`Bf16`], [`round`]) and the packed kernel on strided operands. Never:
//! chooses a precision or knows about transposes (the matmul module does), or keeps anything
//! between calls but each thread's buffer for left-operand panels (every product rewrites the
//! part it reads).

use rayon::prelude::*;

/// A bf16 value as stored: the high half of an f32's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// The bf16 nearest to `x` (ties to even).
    pub fn from_f32(x: f32) -> Self {
        Bf16(bits(x))
    }

    /// Its value (exact in f32).
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// `x` rounded to the nearest bf16 (ties to even), as the f32 of the same value. NaN stays NaN.
#[inline]
pub fn round(x: f32) -> f32 {
    f32::from_bits((bits(x) as u32) << 16)
}

/// `xs` rounded to the nearest bf16 values (kept as f32).
pub fn rounded(xs: &[f32]) -> Vec<f32> {
    xs.iter().map(|&x| round(x)).collect()
}

/// The bf16 bit pattern nearest to `x` (ties to even), as `vcvtneps2bf16` rounds.
#[inline]
pub fn bits(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    let lsb = (u >> 16) & 1;
    (u.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// Whether this CPU multiplies bf16 in hardware (AVX512-BF16, with the AVX-512 F/BW the packing
/// uses); otherwise [`matmul`] rounds the operands and runs the f32 GEMM.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static YES: OnceLock<bool> = OnceLock::new();
        *YES.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Rows of the register tile (rows of C per A panel).
pub(crate) const MR: usize = 12;
/// Columns of the register tile: two vectors of 16 lanes.
pub(crate) const NR: usize = 32;
/// k-pairs per block: a block of one B panel (`KCP · NR` pairs, 16 KiB) stays in L1 while the
/// task's A panels pass it.
const KCP: usize = 128;
/// A panels per task (rows of C a task owns: `MB · MR`).
const MB: usize = 8;

/// A right operand `B` (`[k,n]`, `B[p][j] = b[j·rs + p·cs]`, one of `rs`, `cs` 1) rounded and
/// packed into k-pair panels for [`multiply_packed`]; only where [`available`].
#[cfg(target_arch = "x86_64")]
pub struct PackedB {
    k: usize,
    n: usize,
    pairs: Vec<u32>,
}

#[cfg(target_arch = "x86_64")]
impl PackedB {
    /// Packs `B`; `None` where the CPU has no AVX512-BF16 (or `k` is 0).
    pub fn new(b: &[f32], k: usize, n: usize, rs: usize, cs: usize) -> Option<Self> {
        (available() && k > 0).then(|| Self {
            k,
            n,
            pairs: pack(&b[..k * n], n, k, rs, cs, NR),
        })
    }

    /// `C[m,n] (+)= round(A) · B` with `A[i][p] = a[i·rs + p·cs]` (one of `rs`, `cs` 1), `C`
    /// row-major `m·n`.
    pub fn multiply(
        &self,
        m: usize,
        a: &[f32],
        rs: usize,
        cs: usize,
        c: &mut [f32],
        accumulate: bool,
    ) {
        Self::multiply_many(&[self], m, a, rs, cs, &mut [c], accumulate);
    }

    /// [`PackedB::multiply`] for several right operands `bs[i]` of one `k` read by the same
    /// rows (a layer's q, k and v) into `cs[i]`: `A` is packed once and one parallel pass makes
    /// every product, as a decode step of few rows wants.
    pub fn multiply_many(
        bs: &[&PackedB],
        m: usize,
        a: &[f32],
        rs: usize,
        cs: usize,
        c: &mut [&mut [f32]],
        accumulate: bool,
    ) {
        let Some(k) = bs.first().map(|b| b.k) else {
            return;
        };
        assert!(
            bs.len() == c.len() && bs.iter().all(|b| b.k == k),
            "bf16 multiply_many: one output per operand, one k"
        );
        for (b, c) in bs.iter().zip(c.iter()) {
            assert!(c.len() >= m * b.n, "bf16 multiply_many: C too small");
        }
        if m == 0 {
            return;
        }
        let mut ap = LEFT.take();
        pack_into(&mut ap, &a[..m * k], m, k, rs, cs, MR);
        let outs: Vec<Out<'_>> = bs
            .iter()
            .zip(c.iter_mut())
            .map(|(b, c)| Out {
                pairs: &b.pairs,
                n: b.n,
                c: crate::embedding::SendPtr(c.as_mut_ptr()),
            })
            .collect();
        // SAFETY: a `PackedB` exists only where the features were detected; the panels hold
        // `m`/`n` padded rows of `ceil(k/2)` pairs, each `c` holds `m·n` values (checked).
        unsafe { multiply(m, k.div_ceil(2), &ap, &outs, accumulate) };
        if ap.capacity() <= KEEP_PAIRS {
            LEFT.set(ap);
        }
    }
}

/// One product of [`multiply`]: B's panels, its columns, and where C's `m·n` values go.
#[cfg(target_arch = "x86_64")]
struct Out<'a> {
    pairs: &'a [u32],
    n: usize,
    c: crate::embedding::SendPtr,
}

/// 32 bf16 values seen as 16 u32 pairs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn ints(v: std::arch::x86_64::__m512bh) -> std::arch::x86_64::__m512i {
    // SAFETY: both are 64 plain bytes; every bit pattern is valid for each.
    unsafe { std::mem::transmute(v) }
}

/// 16 u32 pairs seen as 32 bf16 values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn halves(v: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512bh {
    // SAFETY: as [`ints`].
    unsafe { std::mem::transmute(v) }
}

/// Packs a `rows × k` matrix (`M[r][p] = src[r·rs + p·cs]`, one of `rs`, `cs` is 1) into panels
/// of `w` rows: panel `i` holds, for each k-pair `q`, the pair `(M[r][2q], M[r][2q+1])` of each
/// of its rows as one u32 (the first in the low half), bf16-rounded; rows past `rows` and the
/// odd k's missing partner are zero.
///
/// The panels go into `out` (its old values overwritten, grown as needed), so that a caller
/// can keep one buffer between products instead of allocating and zeroing one each time.
#[cfg(target_arch = "x86_64")]
fn pack_into(
    out: &mut Vec<u32>,
    src: &[f32],
    rows: usize,
    k: usize,
    rs: usize,
    cs: usize,
    w: usize,
) {
    let kp = k.div_ceil(2);
    let len = rows.div_ceil(w) * kp * w;
    if out.len() < len {
        out.resize(len, 0);
    }
    out.truncate(len);
    out.par_chunks_mut(kp * w)
        .enumerate()
        .for_each(|(i, panel)| {
            let r0 = i * w;
            // SAFETY: `available()` was checked by the caller; the indices stay inside `src`
            // (rows r0..r0+live, inner 0..k) and `panel` (`kp · w`).
            unsafe { pack_panel(src, r0, w.min(rows - r0), (0, k), (rs, cs), w, panel) };
        });
}

/// One panel of `w` rows from row `r0` (`live` of them in the matrix) over the pairs of `ks`:
/// rows past the matrix zero, the live ones packed by whichever of [`pack_rows`] and
/// [`pack_cols`] the strides call for.
///
/// # Safety
/// AVX512-BF16 must be available; every addressed element must lie inside `src`, and `panel`
/// must hold `ceil(k/2) · w` pairs.
#[cfg(target_arch = "x86_64")]
unsafe fn pack_panel(
    src: &[f32],
    r0: usize,
    live: usize,
    ks: (usize, usize),
    (rs, cs): (usize, usize),
    w: usize,
    panel: &mut [u32],
) {
    if live < w {
        // pack_* write only the live rows.
        panel.fill(0);
    }
    // SAFETY: the caller's contract.
    unsafe {
        if cs == 1 {
            pack_rows(src, r0, live, ks, rs, w, panel);
        } else {
            pack_cols(src, r0, live, ks, cs, w, panel);
        }
    }
}

/// [`pack_into`] a new buffer.
#[cfg(target_arch = "x86_64")]
fn pack(src: &[f32], rows: usize, k: usize, rs: usize, cs: usize, w: usize) -> Vec<u32> {
    let mut out = Vec::new();
    pack_into(&mut out, src, rows, k, rs, cs, w);
    out
}

/// The largest left-operand buffer a thread keeps (16 MiB): a long prefill of a large model
/// packs far more, once, and gives it back.
#[cfg(target_arch = "x86_64")]
const KEEP_PAIRS: usize = 4 << 20;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The left operand's panels of the last [`PackedB::multiply_many`] on this thread, kept
    /// for the next (a training step makes hundreds; a nested call finds it taken and makes
    /// its own).
    static LEFT: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Rows contiguous in `p`: each row's values `p0..k` (`p0` even) are rounded 32 at a time into
/// 16 pairs, which go to that row's slot of 16 consecutive k-pairs (from pair `p0 / 2`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_rows(
    src: &[f32],
    r0: usize,
    live: usize,
    (p0, k): (usize, usize),
    rs: usize,
    w: usize,
    panel: &mut [u32],
) {
    use std::arch::x86_64::*;
    let mut pairs = [0u32; 16];
    for r in 0..live {
        let row = &src[(r0 + r) * rs..(r0 + r) * rs + k];
        let mut p = p0;
        while p < k {
            let left = k - p;
            let lo_m: __mmask16 = if left >= 16 { !0 } else { (1 << left) - 1 };
            let hi_m: __mmask16 = if left >= 32 {
                !0
            } else if left > 16 {
                (1 << (left - 16)) - 1
            } else {
                0
            };
            // SAFETY: the masks keep the loads inside `row`.
            let (lo, hi) = unsafe {
                (
                    _mm512_maskz_loadu_ps(lo_m, row.as_ptr().add(p)),
                    _mm512_maskz_loadu_ps(hi_m, row.as_ptr().add((p + 16).min(k))),
                )
            };
            let v = ints(_mm512_cvtne2ps_pbh(hi, lo));
            // SAFETY: `pairs` holds 16 u32.
            unsafe { _mm512_storeu_si512(pairs.as_mut_ptr().cast(), v) };
            let q0 = p / 2;
            for (j, &pair) in pairs.iter().enumerate().take(left.div_ceil(2).min(16)) {
                panel[(q0 + j) * w + r] = pair;
            }
            p += 32;
        }
    }
}

/// Rows contiguous across `r` (a transposed operand): for each k-pair from `p0 / 2` (`p0`
/// even) to the last of `k`, 16 rows' values at `p` and at `p+1` are rounded together and
/// interleaved into 16 pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_cols(
    src: &[f32],
    r0: usize,
    live: usize,
    (p0, k): (usize, usize),
    cs: usize,
    w: usize,
    panel: &mut [u32],
) {
    use std::arch::x86_64::*;
    // Lane 2j takes element j of the low half (p), lane 2j+1 element j of the high half (p+1).
    let mut idx = [0i16; 32];
    for (j, x) in idx.iter_mut().enumerate() {
        *x = (j / 2 + 16 * (j % 2)) as i16;
    }
    // SAFETY: `idx` holds 32 i16.
    let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    for q in p0 / 2..k.div_ceil(2) {
        let p = 2 * q;
        let mut r = 0;
        while r < live {
            let n = (live - r).min(16);
            let m: __mmask16 = if n == 16 { !0 } else { (1 << n) - 1 };
            let base = p * cs + r0 + r;
            // SAFETY: the mask keeps the loads inside `src` (rows r0+r..r0+r+n at p, p+1).
            let lo = unsafe { _mm512_maskz_loadu_ps(m, src.as_ptr().add(base)) };
            let hi = if p + 1 < k {
                unsafe { _mm512_maskz_loadu_ps(m, src.as_ptr().add(base + cs)) }
            } else {
                _mm512_setzero_ps()
            };
            let v = ints(_mm512_cvtne2ps_pbh(hi, lo));
            let v = _mm512_permutexvar_epi16(idx, v);
            // SAFETY: slots q·w + r .. + n are inside the panel (r + n <= live <= w).
            unsafe { _mm512_mask_storeu_epi32(panel.as_mut_ptr().add(q * w + r).cast(), m, v) };
            r += 16;
        }
    }
}

/// Every `MR × NR` tile of every product's C from the packed panels: tasks of `MB` row panels
/// by one column panel of one product, each walking k in blocks of `KCP` pairs.
///
/// # Safety
/// AVX512-BF16 must be available; `ap` is [`pack`]ed for `m` rows and each `pairs` for its `n`
/// rows, of `kp` pairs; each `c` holds `m·n` values.
#[cfg(target_arch = "x86_64")]
unsafe fn multiply(m: usize, kp: usize, ap: &[u32], outs: &[Out<'_>], accumulate: bool) {
    let ip = m.div_ceil(MR);
    let ib = ip.div_ceil(MB);
    // The first task of each product, then the number of tasks.
    let mut firsts = vec![0];
    for o in outs {
        firsts.push(firsts[firsts.len() - 1] + ib * o.n.div_ceil(NR));
    }
    (0..firsts[outs.len()]).into_par_iter().for_each(|t| {
        let o = firsts.partition_point(|&f| f <= t) - 1;
        let Out {
            pairs: bp,
            n,
            c: cp,
        } = &outs[o];
        let (t, n) = (t - firsts[o], *n);
        let (bi, j) = (t % ib, t / ib);
        for q0 in (0..kp).step_by(KCP) {
            let kc = KCP.min(kp - q0);
            for i in bi * MB..((bi + 1) * MB).min(ip) {
                let (r0, c0) = (i * MR, j * NR);
                let rows = MR.min(m - r0);
                // SAFETY: the panels hold these pairs; this task alone writes rows
                // r0..r0+MR of columns c0..c0+NR (clipped to m, n).
                unsafe {
                    let (a, b) = (
                        ap.as_ptr().add(i * kp * MR + q0 * MR),
                        bp.as_ptr().add(j * kp * NR + q0 * NR),
                    );
                    let (c, cols, acc) =
                        (cp.0.add(r0 * n + c0), NR.min(n - c0), accumulate || q0 > 0);
                    // As many rows as are live (a decode step of one sequence computes one, not
                    // MR).
                    tile_rows(kc, a, b, c, n, rows, cols, acc);
                }
            }
        }
    });
}

/// Operand panels packed on the calling thread into a buffer kept between calls: what
/// attention multiplies per head (thousands of small products a step, where allocating and
/// spreading over the pool would cost more than the product).
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
pub(crate) struct Panels {
    buf: Vec<u32>,
    kp: usize,
    w: usize,
}

#[cfg(target_arch = "x86_64")]
impl Panels {
    /// Packs the `rows × k` matrix `M[r][p] = src[r·rs + p·cs]` (one of `rs`, `cs` 1) as the
    /// left operand (`lhs`: panels of [`MR`] rows) or as a right operand's transpose (panels of
    /// [`NR`] rows), as [`pack`] does.
    ///
    /// # Safety
    /// AVX512-BF16 must be available; every addressed element must lie inside `src`.
    pub(crate) unsafe fn pack(
        &mut self,
        src: &[f32],
        rows: usize,
        k: usize,
        rs: usize,
        cs: usize,
        lhs: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe { self.pack_part(src, rows, k, (rs, cs), lhs, Part::All) }
    }

    /// [`Panels::pack`] of only the pairs a triangular matrix's products read ([`Part`]); the
    /// others keep whatever they held.
    ///
    /// # Safety
    /// As [`Panels::pack`].
    pub(crate) unsafe fn pack_part(
        &mut self,
        src: &[f32],
        rows: usize,
        k: usize,
        (rs, cs): (usize, usize),
        lhs: bool,
        part: Part,
    ) {
        let w = if lhs { MR } else { NR };
        let kp = k.div_ceil(2);
        let len = rows.div_ceil(w) * kp * w;
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        (self.kp, self.w) = (kp, w);
        for (i, panel) in self.buf[..len].chunks_mut(kp * w).enumerate() {
            let r0 = i * w;
            // `w` is even, so a part starts on a pair.
            let ks = match part {
                Part::All => (0, k),
                Part::Lower => (0, k.min(r0 + w)),
                Part::Upper => (r0.min(k), k),
            };
            // SAFETY: the caller's contract; `panel` holds `kp · w` pairs.
            unsafe { pack_panel(src, r0, w.min(rows - r0), ks, (rs, cs), w, panel) };
        }
    }

    /// Pair `q` of panel `i`.
    fn at(&self, i: usize, q: usize) -> *const u32 {
        self.buf[i * self.kp * self.w + q * self.w..].as_ptr()
    }
}

/// Which pairs of a panel [`Panels::pack_part`] packs: the products of a lower-triangular
/// matrix (attention's probabilities and their gradient) read no more.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// Every pair.
    All,
    /// A lower-triangular matrix's rows: a panel's pairs up to its last row's diagonal.
    Lower,
    /// Its transpose's rows (upper-triangular): a panel's pairs from its first row's diagonal.
    Upper,
}

const _: () = assert!(MR.is_multiple_of(2) && NR.is_multiple_of(2));

/// `C (+)= A·B` for the `rows × cols` block of A's panel `i` and B's panel `j` over the pairs
/// `q0..q0 + kc` (C row stride `ldc`); in blocks of [`KCP`] pairs.
///
/// # Safety
/// AVX512-BF16 must be available; both panels must hold those pairs, `rows ≤ MR`, `cols ≤ NR`,
/// and `c` must address `rows` rows of `cols` values at stride `ldc`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn block(
    a: &Panels,
    i: usize,
    b: &Panels,
    j: usize,
    (q0, kc): (usize, usize),
    c: *mut f32,
    ldc: usize,
    (rows, cols): (usize, usize),
    accumulate: bool,
) {
    debug_assert!(a.w == MR && b.w == NR && q0 + kc <= a.kp.min(b.kp));
    for q in (q0..q0 + kc).step_by(KCP) {
        let n = KCP.min(q0 + kc - q);
        // SAFETY: the caller's contract.
        unsafe {
            tile_rows(
                n,
                a.at(i, q),
                b.at(j, q),
                c,
                ldc,
                rows,
                cols,
                accumulate || q > q0,
            );
        }
    }
    if kc == 0 && !accumulate {
        for r in 0..rows {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), cols).fill(0.0) };
        }
    }
}

/// [`tile`] with as many register rows as `rows` needs: each row's sums are the same whichever
/// tile makes them.
///
/// # Safety
/// As [`tile`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_rows(
    kc: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    acc: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match rows {
            1 => tile::<1>(kc, a, b, c, ldc, rows, cols, acc),
            2 => tile::<2>(kc, a, b, c, ldc, rows, cols, acc),
            3 | 4 => tile::<4>(kc, a, b, c, ldc, rows, cols, acc),
            5..=8 => tile::<8>(kc, a, b, c, ldc, rows, cols, acc),
            _ => tile::<MR>(kc, a, b, c, ldc, rows, cols, acc),
        }
    }
}

/// One `R × NR` register tile (the first `R` ≤ `MR` rows of an A panel) over `kc` pairs:
/// `C[r][j] (+)= Σ_q A·B` with `vdpbf16ps`; only the live `rows × cols` corner is written.
/// Every row's sums are made in the same order for any `R`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const R: usize>(
    kc: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for q in 0..kc {
        // SAFETY: pair q of both panels is inside them (caller's contract).
        unsafe {
            let b0 = halves(_mm512_loadu_si512(b.add(q * NR).cast()));
            let b1 = halves(_mm512_loadu_si512(b.add(q * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = halves(_mm512_set1_epi32(*a.add(q * MR + r) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
    }
    let m0: __mmask16 = if cols >= 16 { !0 } else { (1 << cols) - 1 };
    let m1: __mmask16 = if cols >= 32 {
        !0
    } else if cols > 16 {
        (1 << (cols - 16)) - 1
    } else {
        0
    };
    for (r, acc) in acc.iter().enumerate().take(rows) {
        // SAFETY: the masks keep row r's accesses inside its `cols` live columns.
        unsafe {
            let p = c.add(r * ldc);
            let (mut v0, mut v1) = (acc[0], acc[1]);
            if accumulate {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, p));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, p.add(16)));
            }
            _mm512_mask_storeu_ps(p, m0, v0);
            _mm512_mask_storeu_ps(p.add(16), m1, v1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packing a matrix from its rows (the register transpose) and from its transpose's rows
    /// (the interleave) gives the same panels, bit for bit, for ragged shapes of both widths.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_packings_give_the_same_panels() {
        if !available() {
            return;
        }
        for w in [MR, NR] {
            for rows in [1, 5, 12, 13, 17, 31, 33, 40] {
                for k in [1, 2, 31, 32, 33, 64, 67] {
                    let m: Vec<f32> = crate::testutil::randn(rows * k, (rows * 100 + k) as u64);
                    let t: Vec<f32> = (0..k * rows)
                        .map(|i| m[(i % rows) * k + i / rows])
                        .collect();
                    let by_rows = pack(&m, rows, k, k, 1, w);
                    let by_cols = pack(&t, rows, k, 1, rows, w);
                    assert!(by_rows == by_cols, "w {w} rows {rows} k {k}");
                    let mut reused = Panels::default();
                    // SAFETY: `available()`; the views hold the matrix.
                    unsafe {
                        reused.pack(&t, 40, 67, 1, 40, w == MR);
                        reused.pack(&m, rows, k, k, 1, w == MR);
                    }
                    assert!(
                        reused.buf[..by_rows.len()] == by_rows[..],
                        "reused w {w} rows {rows} k {k}"
                    );
                }
            }
        }
    }

    #[test]
    fn rounding_is_to_nearest_even_as_the_hardware_rounds() {
        // (input, bf16 value): exact, halfway down to even, halfway up to even, above half.
        let cases = [
            (1.0f32, 1.0f32),
            (f32::from_bits(0x3f80_8000), 1.0),
            (f32::from_bits(0x3f81_8000), f32::from_bits(0x3f82_0000)),
            (f32::from_bits(0x3f80_8001), f32::from_bits(0x3f81_0000)),
            (-2.5, -2.5),
            (f32::INFINITY, f32::INFINITY),
            (f32::MAX, f32::INFINITY),
        ];
        for (x, want) in cases {
            assert_eq!(round(x).to_bits(), want.to_bits(), "round({x:e})");
            assert_eq!(Bf16::from_f32(x).to_f32().to_bits(), want.to_bits());
        }
        assert!(round(f32::NAN).is_nan());
    }
}
