//! f32 matrix multiply on AVX-512 register tiles, for the products the `gemm` crate makes at
//! 40–55 % of an Intel core's FMA peak: `B` is copied into k-major panels of [`NR`] columns,
//! `A` into panels of [`MR`] rows — or, where its rows are contiguous and nothing is rounded,
//! read where it is — and an `MR × NR` tile of `C` held in 24 registers walks `k` with
//! `vfmadd231ps`, in blocks of [`KC`] that keep one `B` panel's block in L1 while a task's `A`
//! panels pass it. The structure of [`crate::bf16`]'s kernel.
//!
//! Packing can round both operands to bf16 on the way ([`Round::Bf16`]): the products of two
//! bf16 values are exact in f32, so that is `torch.autocast`'s bf16 arithmetic at the f32 FMA
//! rate, which beats `vdpbf16ps` on cores that run it at half rate (Sapphire and Emerald
//! Rapids without AMX).
//!
//! Owns the f32 panels and the tile. Never: chooses when it runs (the matmul module does), or
//! keeps anything between calls but each thread's panel buffers. Every `C` value's sum is made
//! in one order, whatever the threads or the rows multiplied beside it.

use rayon::prelude::*;

/// Rows of the register tile (rows of C per A panel).
const MR: usize = 12;
/// Columns of the register tile: two vectors of 16 lanes.
const NR: usize = 32;
/// k per block: one B panel's block (`KC · NR` values, 32 KiB) stays in L1.
const KC: usize = 256;
/// A panels per task (rows of C a task owns: `MB · MR`).
const MB: usize = 8;
/// Products smaller than this (`m·n·k`) run on the calling thread.
const PAR_MIN: usize = 64 * 64 * 64;

/// What packing does to each operand value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    /// Copy it.
    None,
    /// Round it to the nearest bf16 (ties to even).
    Bf16,
}

/// Whether this CPU runs the kernel (AVX-512 F and BW, as every AVX-512 core since Skylake-SP).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static YES: OnceLock<bool> = OnceLock::new();
        *YES.get_or_init(|| {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A right operand `B` (`[k,n]`, `B[p][j] = b[j·rs + p·cs]`, one of `rs`, `cs` 1) packed into
/// column panels once, for a weight several products share; only where [`available`].
pub struct PackedB {
    k: usize,
    n: usize,
    round: Round,
    panels: Panels,
}

/// How a [`PackedB`] keeps its panels.
enum Panels {
    /// As f32.
    F32(Vec<f32>),
    /// bf16-rounded values as their bf16 bits (half the bytes), each `k`'s 32 in the order
    /// that two `vpunpck*wd` with zero widen into f32 columns 0–15 and 16–31 ([`compact`]).
    Bf16(Vec<u16>),
}

impl PackedB {
    /// Packs `B` (rounded as `round` says); `None` where the CPU has no AVX-512 or `k` is 0.
    pub fn new(
        b: &[f32],
        k: usize,
        n: usize,
        (rs, cs): (usize, usize),
        round: Round,
    ) -> Option<Self> {
        (available() && k > 0).then(|| {
            assert!(
                n == 0 || b.len() > (n - 1) * rs + (k - 1) * cs,
                "sgemm: B has {} values, too few for its view",
                b.len()
            );
            let mut panels = Vec::new();
            // SAFETY: AVX-512 is available and the view was just checked.
            unsafe {
                pack_into(
                    &mut panels,
                    Src(b.as_ptr()),
                    n,
                    k,
                    (rs, cs),
                    NR,
                    round,
                    true,
                );
            }
            Self {
                k,
                n,
                round,
                panels: Panels::F32(panels),
            }
        })
    }

    /// [`PackedB::new`] rounded to bf16 and kept in half the bytes (what a decode step of a
    /// few rows streams), for the same products: each value of `C` is the one the f32 panels
    /// give, bit for bit.
    pub fn compact(b: &[f32], k: usize, n: usize, (rs, cs): (usize, usize)) -> Option<Self> {
        let mut packed = Self::new(b, k, n, (rs, cs), Round::Bf16)?;
        if let Panels::F32(f) = &packed.panels {
            packed.panels = Panels::Bf16(compact(f));
        }
        Some(packed)
    }

    /// `C[m,n] (+)= A · B` with `A[i][p] = a[i·rs + p·cs]` (one of `rs`, `cs` 1, rounded as
    /// `B` was), `C` row-major `m·n`.
    pub fn multiply(
        &self,
        m: usize,
        a: &[f32],
        (rs, cs): (usize, usize),
        c: &mut [f32],
        acc: bool,
    ) {
        Self::multiply_many(&[self], m, a, (rs, cs), &mut [c], acc);
    }

    /// [`PackedB::multiply`] for several right operands of one `k` and one rounding read by
    /// the same rows (a layer's q, k and v): `A` is packed once, one parallel pass makes all.
    pub fn multiply_many(
        bs: &[&PackedB],
        m: usize,
        a: &[f32],
        (rs, cs): (usize, usize),
        c: &mut [&mut [f32]],
        acc: bool,
    ) {
        let Some((k, round)) = bs.first().map(|b| (b.k, b.round)) else {
            return;
        };
        assert!(
            bs.len() == c.len() && bs.iter().all(|b| b.k == k && b.round == round),
            "sgemm multiply_many: one output per operand, one k, one rounding"
        );
        for (b, c) in bs.iter().zip(c.iter()) {
            assert!(c.len() >= m * b.n, "sgemm multiply_many: C too small");
        }
        if m == 0 {
            return;
        }
        let par = bs.iter().map(|b| m * b.n * k).sum::<usize>() >= PAR_MIN;
        assert!(
            k == 0 || a.len() > (m - 1) * rs + (k - 1) * cs,
            "sgemm multiply_many: A has {} values, too few for its view",
            a.len()
        );
        let mut ap = LEFT.take();
        let outs: Vec<Out<'_>> = bs
            .iter()
            .zip(c.iter_mut())
            .map(|(b, c)| Out {
                panels: b.panels.view(),
                n: b.n,
                c: crate::embedding::SendPtr(c.as_mut_ptr()),
                ldc: b.n,
            })
            .collect();
        // SAFETY: a `PackedB` exists only where AVX-512 was detected; `A`'s view lies inside
        // `a`; the panels hold `m` and `n` padded rows of `k` values, and each `c` holds `m·n`
        // values (checked).
        unsafe {
            let left = pack_a(&mut ap, Src(a.as_ptr()), m, k, (rs, cs), round, par);
            multiply(m, k, left, &outs, acc, par);
        }
        keep(&LEFT, ap);
    }
}

/// `C[m,n] (+)= A · B` in f32 (rounded as `round` says), `A[i][p] = a[i·a.1 + p·a.2]`,
/// `B[p][j] = b[j·b.1 + p·b.2]` (one stride of each 1), `C` row-major; `par` lets it spread
/// over the pool. Only where [`available`].
pub fn matmul(
    (m, k, n): (usize, usize, usize),
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
    c: &mut [f32],
    acc: bool,
    par: bool,
    round: Round,
) {
    assert!(c.len() >= m * n, "sgemm: C too small");
    check_views((m, k, n), a, b);
    // SAFETY: the views were just checked to lie inside their slices, and `c` is exclusively
    // borrowed.
    unsafe {
        strided(
            (m, k, n),
            (a.0.as_ptr(), a.1, a.2),
            (b.0.as_ptr(), b.1, b.2),
            (c.as_mut_ptr(), n),
            acc,
            par,
            round,
        );
    }
}

/// [`matmul`]'s `C = A · B` as a new row-major `m × n` vector, each value written once by the
/// product (never zeroed first: a fresh activation is as large as the product's operands, and
/// zeroing it is a pass over memory of its own).
pub fn product(
    (m, k, n): (usize, usize, usize),
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
    par: bool,
    round: Round,
) -> Vec<f32> {
    check_views((m, k, n), a, b);
    let mut c = Vec::with_capacity(m * n);
    // SAFETY: the views were just checked; `c` has room for `m·n` values, and `strided` with
    // `acc` false writes every one of them (each tile's live corner in the first block of k,
    // or zeros where k is 0) before `set_len` makes them readable.
    unsafe {
        strided(
            (m, k, n),
            (a.0.as_ptr(), a.1, a.2),
            (b.0.as_ptr(), b.1, b.2),
            (c.as_mut_ptr(), n),
            false,
            par,
            round,
        );
        c.set_len(m * n);
    }
    c
}

/// Asserts that AVX-512 is here and that both operands' views lie inside their slices.
fn check_views(
    (m, k, n): (usize, usize, usize),
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
) {
    assert!(available(), "sgemm: no AVX-512");
    for (name, (v, rs, cs), rows) in [("A", a, m), ("B", b, n)] {
        assert!(
            rows == 0 || k == 0 || v.len() > (rows - 1) * rs + (k - 1) * cs,
            "sgemm: {name} has {} values, too few for its view",
            v.len()
        );
    }
}

/// [`matmul`] on views into larger buffers (attention's heads inside `[tokens, heads·d]`
/// activations): `C[i][j]` at `c.0 + i·c.1 + j`.
///
/// # Safety
/// AVX-512 F must be [`available`]; every addressed element of `A`, `B` and `C` must lie
/// inside its allocation, `A` and `B` must not change during the call, and `C` must not
/// overlap them.
pub unsafe fn strided(
    (m, k, n): (usize, usize, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize, usize),
    (c, ldc): (*mut f32, usize),
    acc: bool,
    par: bool,
    round: Round,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            for i in 0..m {
                // SAFETY: the caller's contract (the row may not be initialised yet: written
                // through the pointer, never read).
                unsafe { c.add(i * ldc).write_bytes(0, n) };
            }
        }
        return;
    }
    let par = par && m * n * k >= PAR_MIN;
    let mut bp = RIGHT.take();
    let mut ap = LEFT.take();
    // SAFETY: the caller's contract; the panels are packed for `m`, `n` and `k`.
    unsafe {
        pack_into(&mut bp, Src(b.0), n, k, (b.1, b.2), NR, round, par);
        let left = pack_a(&mut ap, Src(a.0), m, k, (a.1, a.2), round, par);
        let out = Out {
            panels: PanelsRef::F32(&bp),
            n,
            c: crate::embedding::SendPtr(c),
            ldc,
        };
        multiply(m, k, left, &[out], acc, par);
    }
    keep(&LEFT, ap);
    keep(&RIGHT, bp);
}

/// A matrix operand's first element, shared by the threads that pack it.
#[derive(Clone, Copy)]
struct Src(*const f32);

impl Src {
    /// The element `i` places on (only read where the caller's view says).
    fn at(self, i: usize) -> *const f32 {
        self.0.wrapping_add(i)
    }
}

// SAFETY: packing only reads through it, while the caller keeps the operand unchanged.
unsafe impl Send for Src {}
// SAFETY: as above.
unsafe impl Sync for Src {}

/// The largest panel buffer a thread keeps (16 MiB): a long prefill of a large model packs far
/// more, once, and gives it back.
const KEEP: usize = 4 << 20;

thread_local! {
    /// The left operand's panels of the last product on this thread, kept for the next (a
    /// training step makes hundreds; a nested call finds it taken and makes its own).
    static LEFT: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    /// The right operand's panels of the last [`matmul`] on this thread.
    static RIGHT: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

fn keep(slot: &'static std::thread::LocalKey<std::cell::Cell<Vec<f32>>>, buf: Vec<f32>) {
    if buf.capacity() <= KEEP {
        slot.set(buf);
    }
}

/// bf16-valued f32 panels (`NR` values per `k`) as bf16 bits in the order [`tile`] widens:
/// in each 128-bit lane `l` of a `k`'s 64 bytes, words `8l..8l+4` are columns `4l..4l+4` and
/// words `8l+4..8l+8` columns `16+4l..16+4l+4`.
fn compact(panels: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; panels.len()];
    for (src, dst) in panels.chunks_exact(NR).zip(out.chunks_exact_mut(NR)) {
        for l in 0..4 {
            for j in 0..4 {
                dst[8 * l + j] = (src[4 * l + j].to_bits() >> 16) as u16;
                dst[8 * l + 4 + j] = (src[16 + 4 * l + j].to_bits() >> 16) as u16;
            }
        }
    }
    out
}

/// A B panel's values as [`multiply`] reads them.
#[derive(Clone, Copy)]
enum PanelsRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Panels {
    fn view(&self) -> PanelsRef<'_> {
        match self {
            Panels::F32(p) => PanelsRef::F32(p),
            Panels::Bf16(p) => PanelsRef::Bf16(p),
        }
    }
}

/// One product of [`multiply`]: B's panels, its columns, and where C's `m × n` values go (row
/// stride `ldc`).
struct Out<'a> {
    panels: PanelsRef<'a>,
    n: usize,
    c: crate::embedding::SendPtr,
    ldc: usize,
}

/// The left operand as [`multiply`] reads it: panels of [`MR`] rows, each walked in blocks of
/// [`KC`] values of k.
#[derive(Clone, Copy)]
struct Left {
    /// Its first value.
    at: Src,
    /// Values from one row panel to the next.
    panel: usize,
    /// Values from a panel's first block to block `p0 / KC`, per `p0`.
    block: usize,
    /// Row-major with rows this many values apart, or (`None`) k-major: each k's [`MR`]
    /// values side by side.
    rows: Option<usize>,
    /// Whether the rows past `m` of the last panel may be read (packed zeros) or not (the
    /// caller's matrix itself).
    padded: bool,
}

/// The left operand `A` (`m × k`, `A[i][p] = src[i·rs + p·cs]`, one of `rs`, `cs` 1) as the
/// tile reads it, laid out as its strides make cheapest: where rows are contiguous (`cs` 1)
/// and nothing is rounded, read where it is; rounded, copied into panels that hold, per block
/// of [`KC`], their rows one after another at stride `KC`; otherwise k-major as
/// [`pack_into`]. The panels go into `out`.
///
/// # Safety
/// AVX-512 F; every element of the view must be readable and unchanged during the call.
unsafe fn pack_a(
    out: &mut Vec<f32>,
    src: Src,
    m: usize,
    k: usize,
    (rs, cs): (usize, usize),
    round: Round,
    par: bool,
) -> Left {
    if cs != 1 || (rs == 1 && m > 1) {
        // SAFETY: the caller's contract.
        unsafe { pack_into(out, src, m, k, (rs, cs), MR, round, par) };
        return Left {
            at: Src(out.as_ptr()),
            panel: k * MR,
            block: MR,
            rows: None,
            padded: true,
        };
    }
    if round == Round::None {
        return Left {
            at: src,
            panel: MR * rs,
            block: 1,
            rows: Some(rs),
            padded: false,
        };
    }
    let per = k.div_ceil(KC) * MR * KC;
    let one = |(i, panel): (usize, &mut [f32])| {
        let r0 = i * MR;
        for (bl, block) in panel.chunks_mut(MR * KC).enumerate() {
            let (p0, p1) = (bl * KC, (bl * KC + KC).min(k));
            for (r, dst) in block.chunks_mut(KC).enumerate() {
                let dst = &mut dst[..p1 - p0];
                if r0 + r < m {
                    let row = src.at((r0 + r) * rs + p0);
                    // SAFETY: the caller's contract: the row's values p0..p1 are readable.
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        match round {
                            Round::None => copy_run::<false>(dst.as_mut_ptr(), row, p1 - p0),
                            Round::Bf16 => copy_run::<true>(dst.as_mut_ptr(), row, p1 - p0),
                        }
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    let _ = row;
                } else {
                    dst.fill(0.0);
                }
            }
        }
    };
    each_panel(out, m.div_ceil(MR), per, par, one);
    Left {
        at: Src(out.as_ptr()),
        panel: per,
        // Block p0 / KC of a panel starts at p0 · MR.
        block: MR,
        rows: Some(KC),
        padded: true,
    }
}

/// Grows `out` to at least `panels` panels of `per` values and runs `one` on each (index,
/// panel), over the pool where `par` and there are several. A kept buffer is never shortened:
/// products of other sizes take turns with it, and each growth is zeroed once, not again at
/// every turn.
fn each_panel(
    out: &mut Vec<f32>,
    panels: usize,
    per: usize,
    par: bool,
    one: impl Fn((usize, &mut [f32])) + Send + Sync,
) {
    let len = panels * per;
    if out.len() < len {
        out.resize(len, 0.0);
    }
    if per == 0 {
        return;
    }
    let out = &mut out[..len];
    if par && panels > 1 {
        out.par_chunks_mut(per).enumerate().for_each(one);
    } else {
        out.chunks_mut(per).enumerate().for_each(one);
    }
}

/// Packs a `rows × k` matrix (`M[r][p] = src[r·rs + p·cs]`, one of `rs`, `cs` 1) into panels
/// of `w` rows, each holding for every `p` its rows' `M[r][p]` side by side (rounded as `round`
/// says); rows past `rows` are zero. The panels go into `out`, its old values overwritten.
///
/// # Safety
/// As [`pack_a`].
#[allow(clippy::too_many_arguments)]
unsafe fn pack_into(
    out: &mut Vec<f32>,
    src: Src,
    rows: usize,
    k: usize,
    (rs, cs): (usize, usize),
    w: usize,
    round: Round,
    par: bool,
) {
    let one = |(i, panel): (usize, &mut [f32])| {
        let r0 = i * w;
        let live = w.min(rows - r0);
        assert!(
            w <= 32 && panel.len() >= k * w,
            "sgemm pack: panel too small"
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract; the panel holds `k·w` values.
        unsafe {
            let (src, panel) = (src.at(0), panel.as_mut_ptr());
            match round {
                Round::None => pack_panel::<false>(src, r0, live, k, (rs, cs), w, panel),
                Round::Bf16 => pack_panel::<true>(src, r0, live, k, (rs, cs), w, panel),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (src, r0, live, panel);
    };
    each_panel(out, rows.div_ceil(w), k * w, par, one);
}

/// One panel of `w` rows from row `r0` (`live` of them in the matrix): for each `p`, the panel's `w` values (in one or two vectors)
/// loaded as a run where the matrix is transposed (`rs` 1), else gathered from `live` rows.
///
/// # Safety
/// AVX-512 F; `live ≤ w ≤ 32`; `src` holds every `(r0 + r)·rs + p·cs` for `r < live`,
/// `p < k`, and `panel` `k·w` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_panel<const ROUND: bool>(
    src: *const f32,
    r0: usize,
    live: usize,
    k: usize,
    (rs, cs): (usize, usize),
    w: usize,
    panel: *mut f32,
) {
    use std::arch::x86_64::*;
    let lanes = |from: usize, to: usize| -> __mmask16 {
        let n = to.saturating_sub(from).min(16);
        if n == 16 { !0 } else { (1 << n) - 1 }
    };
    let idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(rs as i32),
    );
    for p in 0..k {
        for g in (0..w).step_by(16) {
            let (live_m, w_m) = (lanes(g, live), lanes(g, w));
            // Row r0 + g at p (only read where a row of the group is live).
            let base = src.wrapping_add((r0 + g) * rs + p * cs);
            // SAFETY: the masks keep every access to the live rows and the panel's `w`.
            unsafe {
                let v = if live_m == 0 {
                    _mm512_setzero_ps()
                } else if rs == 1 {
                    _mm512_maskz_loadu_ps(live_m, base)
                } else {
                    _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), live_m, idx, base.cast())
                };
                let v = if ROUND { round16(v) } else { v };
                _mm512_mask_storeu_ps(panel.add(p * w + g), w_m, v);
            }
        }
    }
}

/// 16 values rounded to the nearest bf16 (ties to even), NaN kept NaN: [`crate::bf16::round`]
/// in a vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn round16(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let u = _mm512_castps_si512(v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(u), _mm512_set1_epi32(1));
    let up = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let r = _mm512_mask_or_epi32(up, nan, u, _mm512_set1_epi32(0x0040_0000));
    _mm512_castsi512_ps(_mm512_and_si512(
        r,
        _mm512_set1_epi32(0xffff_0000u32 as i32),
    ))
}

/// `dst = src` rounded as `ROUND` says, 16 values at a time.
///
/// # Safety
/// AVX-512 F; both hold `len` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn copy_run<const ROUND: bool>(dst: *mut f32, src: *const f32, len: usize) {
    use std::arch::x86_64::*;
    for i in (0..len).step_by(16) {
        let n = (len - i).min(16);
        let m: __mmask16 = if n == 16 { !0 } else { (1 << n) - 1 };
        // SAFETY: the mask keeps both inside `len`.
        unsafe {
            let v = _mm512_maskz_loadu_ps(m, src.add(i));
            let v = if ROUND { round16(v) } else { v };
            _mm512_mask_storeu_ps(dst.add(i), m, v);
        }
    }
}

/// Every `MR × NR` tile of every product's C from the packed panels: tasks of `MB` row panels
/// by one column panel of one product (a task's row panels stay in L2 while its next tasks
/// pass the other column panels), each walking k in blocks of `KC`.
///
/// # Safety
/// AVX-512 F must be available; `left` is [`pack_a`]'s for `m` rows of `k` values (its panels
/// alive and unchanged), each `panels` packed for its `n` rows; each `c` holds `m·n` values.
unsafe fn multiply(m: usize, k: usize, left: Left, outs: &[Out<'_>], acc: bool, par: bool) {
    let ip = m.div_ceil(MR);
    let ib = ip.div_ceil(MB);
    // The first task of each product, then the number of tasks.
    let mut firsts = vec![0];
    for o in outs {
        firsts.push(firsts[firsts.len() - 1] + ib * o.n.div_ceil(NR));
    }
    let task = |t: usize| {
        let o = firsts.partition_point(|&f| f <= t) - 1;
        let Out {
            panels: bp,
            n,
            c: cp,
            ldc,
        } = &outs[o];
        let (t, n) = (t - firsts[o], *n);
        let jn = n.div_ceil(NR);
        let (bi, j) = (t / jn, t % jn);
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            for i in bi * MB..((bi + 1) * MB).min(ip) {
                let (r0, c0) = (i * MR, j * NR);
                // SAFETY: the panels hold these values; this task alone writes rows
                // r0..r0+MR of columns c0..c0+NR (clipped to m, n).
                unsafe {
                    let a = left.at.at(i * left.panel + p0 * left.block);
                    let at = j * k * NR + p0 * NR;
                    let b = match bp {
                        PanelsRef::F32(bp) => (bp.as_ptr().add(at).cast(), false),
                        PanelsRef::Bf16(bp) => (bp.as_ptr().add(at).cast(), true),
                    };
                    let c = cp.0.add(r0 * ldc + c0);
                    let live = (MR.min(m - r0), NR.min(n - c0));
                    tile_rows(kc, (a, left), b, (c, *ldc), live, acc || p0 > 0);
                }
            }
        }
    };
    let tasks = firsts[outs.len()];
    if par {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// [`tile`] with as many register rows as `live.0` needs (each row's sums are the same whichever
/// tile makes them), for A's layout and B's values (`b.1`: bf16 bits). Where A's rows past
/// the live ones may not be read, the rows go in tiles of exactly 8, 4, 2 and 1.
///
/// # Safety
/// As [`tile`], with `a` block `p0 / KC` of one of `left`'s panels.
#[inline(always)]
unsafe fn tile_rows(
    kc: usize,
    (a, left): (*const f32, Left),
    (b, b16): (*const u8, bool),
    (c, ldc): (*mut f32, usize),
    (rows, cols): (usize, usize),
    acc: bool,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract.
    unsafe {
        let lda = left.rows.unwrap_or(0);
        let go = |r: usize, part: usize| {
            let (a, c) = (a.add(r * lda), (c.add(r * ldc), ldc));
            let live = (part, cols);
            match (left.rows.is_some(), b16) {
                (false, false) => tile_r::<false, false>(kc, (a, lda), b, c, live, acc),
                (false, true) => tile_r::<false, true>(kc, (a, lda), b, c, live, acc),
                (true, false) => tile_r::<true, false>(kc, (a, lda), b, c, live, acc),
                (true, true) => tile_r::<true, true>(kc, (a, lda), b, c, live, acc),
            }
        };
        if left.padded || rows == MR {
            go(0, rows);
        } else {
            let mut r = 0;
            for part in [8, 4, 2, 1] {
                if rows - r >= part {
                    go(r, part);
                    r += part;
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kc, a, left, b, b16, c, ldc, rows, cols, acc);
}

/// [`tile_rows`] for one layout of each operand.
///
/// # Safety
/// As [`tile`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_r<const ROWS: bool, const B16: bool>(
    kc: usize,
    a: (*const f32, usize),
    b: *const u8,
    c: (*mut f32, usize),
    live: (usize, usize),
    acc: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match live.0 {
            1 => tile::<1, ROWS, B16>(kc, a, b, c, live, acc),
            2 => tile::<2, ROWS, B16>(kc, a, b, c, live, acc),
            3 | 4 => tile::<4, ROWS, B16>(kc, a, b, c, live, acc),
            5..=8 => tile::<8, ROWS, B16>(kc, a, b, c, live, acc),
            _ => tile::<MR, ROWS, B16>(kc, a, b, c, live, acc),
        }
    }
}

/// One `R × NR` register tile (the first `R` ≤ `MR` rows of an A panel: row-major at stride
/// `a.1` where `ROWS`, else k-major at stride [`MR`]) over `kc` values of k, B's `NR` values
/// per k as f32, or where `B16` as bf16 bits widened in registers ([`compact`]'s order):
/// `C[r][j] (+)= Σ_p A[r][p]·B[p][j]`, `C` at row stride `ldc`, only its live `rows × cols`
/// corner touched. Each sum starts from C's value when `acc` and adds the products in order of
/// `p`, for any `R`.
///
/// # Safety
/// AVX-512 F must be available; both panels must hold the `kc` values, `rows ≤ R`,
/// `cols ≤ NR`, and `c` must address `rows` rows of `cols` values at stride `ldc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile<const R: usize, const ROWS: bool, const B16: bool>(
    kc: usize,
    (a, lda): (*const f32, usize),
    b: *const u8,
    (c, ldc): (*mut f32, usize),
    (rows, cols): (usize, usize),
    acc: bool,
) {
    use std::arch::x86_64::*;
    let m0: __mmask16 = if cols >= 16 { !0 } else { (1 << cols) - 1 };
    let m1: __mmask16 = if cols >= 32 {
        !0
    } else if cols > 16 {
        (1 << (cols - 16)) - 1
    } else {
        0
    };
    // Rows past `rows` get empty masks: every loop over the tile's rows runs to the constant
    // `R`, so the sums live in registers from the first load to the last store.
    let masks = |r: usize| if r < rows { (m0, m1) } else { (0, 0) };
    let mut sums = [[_mm512_setzero_ps(); 2]; R];
    if acc {
        for (r, s) in sums.iter_mut().enumerate() {
            let (k0, k1) = masks(r);
            let p = c.wrapping_add(r * ldc);
            // SAFETY: the masks keep row r's loads inside its `cols` live columns, and a row
            // past `rows` loads nothing.
            unsafe {
                *s = [
                    _mm512_maskz_loadu_ps(k0, p),
                    _mm512_maskz_loadu_ps(k1, p.wrapping_add(16)),
                ];
            }
        }
    }
    // Pointers step through the panels (no index arithmetic to check in a test build).
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        // SAFETY: value p of both panels is inside them (caller's contract).
        unsafe {
            let (b0, b1) = if B16 {
                let raw = _mm512_loadu_si512(b.cast());
                let zero = _mm512_setzero_si512();
                (
                    _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw)),
                    _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw)),
                )
            } else {
                let b = b.cast::<f32>();
                (_mm512_loadu_ps(b), _mm512_loadu_ps(b.add(16)))
            };
            for (r, s) in sums.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(if ROWS { r * lda } else { r }));
                s[0] = _mm512_fmadd_ps(av, b0, s[0]);
                s[1] = _mm512_fmadd_ps(av, b1, s[1]);
            }
            a = a.add(if ROWS { 1 } else { MR });
            b = b.add(NR * if B16 { 2 } else { 4 });
        }
    }
    for (r, s) in sums.iter().enumerate() {
        let (k0, k1) = masks(r);
        let p = c.wrapping_add(r * ldc);
        // SAFETY: as the loads.
        unsafe {
            _mm512_mask_storeu_ps(p, k0, s[0]);
            _mm512_mask_storeu_ps(p.wrapping_add(16), k1, s[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::randn;

    /// f64 sums of `A·B` for the strided views the kernel takes (rounded as `round` says).
    fn reference(
        (m, k, n): (usize, usize, usize),
        a: (&[f32], usize, usize),
        b: (&[f32], usize, usize),
        round: Round,
    ) -> Vec<f64> {
        let f = |x: f32| match round {
            Round::None => x as f64,
            Round::Bf16 => crate::bf16::round(x) as f64,
        };
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| f(a.0[i * a.1 + p * a.2]) * f(b.0[j * b.1 + p * b.2]))
                    .sum();
            }
        }
        c
    }

    /// Ragged tiles of every height, k past one block, both layouts of each operand (A's rows
    /// also inside a wider matrix), both roundings, on one thread and on the pool, with and without accumulation: within f32
    /// summation error of an f64 reference.
    #[test]
    fn products_match_an_f64_reference_for_every_layout() {
        if !available() {
            // Without AVX-512 the kernel refuses to pack, and matmul takes the `gemm` crate.
            assert!(PackedB::new(&[1.0], 1, 1, (1, 1), Round::None).is_none());
            return;
        }
        for (m, k, n) in [
            (1, 1, 1),
            (3, 5, 17),
            (13, 300, 33),
            (100, 517, 70),
            (7, 64, 97),
        ] {
            // A's rows also as a view into a wider matrix (read where they are).
            let (a, b) = (randn(m * (k + 3), 1), randn(k * n, 2));
            for (a_rs, a_cs) in [(k, 1), (k + 3, 1), (1, m)] {
                for (b_rs, b_cs) in [(k, 1), (1, n)] {
                    for round in [Round::None, Round::Bf16] {
                        let av = (&a[..], a_rs, a_cs);
                        let bv = (&b[..], b_rs, b_cs);
                        let want = reference((m, k, n), av, bv, round);
                        let tol = 1e-6 * (k as f64).sqrt() * 8.0;
                        for par in [false, true] {
                            let mut c = vec![3.0f32; m * n];
                            matmul((m, k, n), av, bv, &mut c, false, par, round);
                            let mut c2 = c.clone();
                            matmul((m, k, n), av, bv, &mut c2, true, par, round);
                            for (i, w) in want.iter().enumerate() {
                                let at = format!(
                                    "{m}x{k}x{n} a({a_rs},{a_cs}) b({b_rs},{b_cs}) {round:?} par {par} [{i}]"
                                );
                                assert!(
                                    (c[i] as f64 - w).abs() <= tol * (1.0 + w.abs()),
                                    "{at}: {} vs {w}",
                                    c[i]
                                );
                                assert!(
                                    (c2[i] as f64 - 2.0 * w).abs() <= 2.0 * tol * (1.0 + w.abs()),
                                    "{at} accumulate: {}",
                                    c2[i]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A row's values do not depend on the rows multiplied beside it or the threads, alone or
    /// in one pass with other operands, bit for bit.
    ///
    /// Also: bf16 panels kept as bits ([`PackedB::compact`]) give the values of bf16-rounded
    /// f32 panels, bit for bit, for every row count.
    #[test]
    fn rows_are_the_same_in_a_batch_of_any_size() {
        if !available() {
            assert!(PackedB::compact(&[1.0], 1, 1, (1, 1)).is_none());
            return;
        }
        let (k, n, rows) = (600, 70, 40);
        let (a, b) = (randn(rows * k, 3), randn(n * k, 4));
        let packed = PackedB::new(&b, k, n, (k, 1), Round::None).expect("available");
        let other = PackedB::new(&b[..9 * k], k, 9, (k, 1), Round::None).expect("available");
        let mut all = vec![0.0f32; rows * n];
        packed.multiply(rows, &a, (k, 1), &mut all, false);
        for m in (1..=14).chain([25]) {
            for first in [0, 5, rows - m] {
                let a = &a[first * k..];
                let mut c = vec![0.0f32; m * n];
                matmul(
                    (m, k, n),
                    (a, k, 1),
                    (&b, k, 1),
                    &mut c,
                    false,
                    false,
                    Round::None,
                );
                let (mut c2, mut o) = (vec![0.0f32; m * n], vec![0.0f32; m * 9]);
                PackedB::multiply_many(
                    &[&other, &packed],
                    m,
                    a,
                    (k, 1),
                    &mut [&mut o, &mut c2],
                    false,
                );
                let same = |c: &[f32]| {
                    c.iter()
                        .zip(&all[first * n..])
                        .all(|(x, y)| x.to_bits() == y.to_bits())
                };
                assert!(same(&c) && same(&c2), "rows {first}..{} alone", first + m);
            }
        }
        // The compact form against the f32 panels of the same rounded values, with a ragged
        // last panel (n 70) and k over one block.
        let rounded = PackedB::new(&b, k, n, (k, 1), Round::Bf16).expect("available");
        let compact = PackedB::compact(&b, k, n, (k, 1)).expect("available");
        assert!(matches!(compact.panels, Panels::Bf16(_)));
        for m in [1, 3, 12, 40] {
            let (mut want, mut got) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
            rounded.multiply(m, &a, (k, 1), &mut want, false);
            compact.multiply(m, &a, (k, 1), &mut got, false);
            let same = want
                .iter()
                .zip(&got)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "compact panels, {m} rows");
        }
    }
}
