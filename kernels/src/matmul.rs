//! Dense matrix multiply on row-major f32, all transpose combinations: in f32 on AVX-512
//! through [`crate::sgemm`] (elsewhere through the `gemm` crate's runtime dispatch), or with
//! bf16 operands and f32 accumulation on the fastest [`Bf16Kernel`] this CPU has.
//!
//! Owns the choice of kernel for a product. Never: packs or multiplies itself (beyond the
//! fallbacks' copies of rounded operands).

use crate::sgemm::Round;
use gemm_common::Parallelism;

/// How a matrix operand is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Use the matrix as stored (row-major).
    N,
    /// Use its transpose (the stored matrix is row-major with the other shape).
    T,
}

/// Whether a multiply spreads over the rayon pool. Small matmuls inside an already parallel
/// loop (per attention head) must use `Single`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Par {
    /// Use the current rayon pool.
    Pool,
    /// Run on the calling thread.
    Single,
}

/// The arithmetic of a multiply (inputs and outputs are f32 either way); in a workflow,
/// `f32` or `bf16`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 products and sums.
    #[default]
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    /// Operands rounded to bf16, products summed in f32 (`torch.autocast(dtype=bfloat16)`),
    /// on the fastest [`Bf16Kernel`] this CPU has. Always over the pool.
    #[serde(alias = "bfloat16")]
    Bf16,
}

/// Up to this many rows, `A·Bᵀ` goes through [`crate::skinny`].
pub const SKINNY_ROWS: usize = 64;

/// `C[m,n] = op(A)[m,k] · op(B)[k,n]`, or `C += …` when `accumulate`, in `precision`.
///
/// `A` holds `m·k` values (`[m,k]` for `Op::N`, `[k,m]` for `Op::T`), `B` holds `k·n`.
pub fn matmul(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    op_a: Op,
    b: &[f32],
    op_b: Op,
    c: &mut [f32],
    accumulate: bool,
    par: Par,
    precision: Precision,
) {
    assert!(
        a.len() >= m * k,
        "matmul: A has {} values, needs {}",
        a.len(),
        m * k
    );
    assert!(
        b.len() >= k * n,
        "matmul: B has {} values, needs {}",
        b.len(),
        k * n
    );
    assert!(
        c.len() >= m * n,
        "matmul: C has {} values, needs {}",
        c.len(),
        m * n
    );
    match route((m, k), (op_a, op_b), accumulate, par, precision) {
        // Rounded (where bf16) while packed into this thread's panel buffers: nothing to
        // allocate.
        Route::Sgemm(round, par) => {
            on_sgemm((m, k, n), (a, op_a), (b, op_b), c, accumulate, par, round);
        }
        Route::Rhs => Rhs::new(k, n, b, op_b).matmul(m, a, op_a, c, accumulate),
        Route::Skinny => crate::skinny::matmul_nt(m, k, n, a, b, c),
        Route::Portable => {
            let (a_rs, a_cs) = match op_a {
                Op::N => (k as isize, 1),
                Op::T => (1, m as isize),
            };
            let (b_rs, b_cs) = match op_b {
                Op::N => (n as isize, 1),
                Op::T => (1, k as isize),
            };
            // SAFETY: the strides above describe matrices that fit in the asserted slice
            // lengths, and `c` is exclusively borrowed.
            unsafe {
                strided(
                    m,
                    k,
                    n,
                    a.as_ptr(),
                    a_rs,
                    a_cs,
                    b.as_ptr(),
                    b_rs,
                    b_cs,
                    c.as_mut_ptr(),
                    n as isize,
                    accumulate,
                    par,
                );
            }
        }
    }
}

/// [`matmul`]'s `C = op(A) · op(B)` as a new `[m, n]` vector. On [`crate::sgemm`] each value
/// is written once, never zeroed first (zeroing a fresh activation is a pass over memory as
/// large as the product's output).
#[allow(clippy::too_many_arguments)]
pub fn matmul_new(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    op_a: Op,
    b: &[f32],
    op_b: Op,
    par: Par,
    precision: Precision,
) -> Vec<f32> {
    match route((m, k), (op_a, op_b), false, par, precision) {
        Route::Sgemm(round, par) => {
            let ((a_rs, a_cs), (b_rs, b_cs)) = (a_strides(m, k, op_a), b_strides(k, n, op_b));
            crate::sgemm::product(
                (m, k, n),
                (a, a_rs, a_cs),
                (b, b_rs, b_cs),
                par == Par::Pool,
                round,
            )
        }
        _ => {
            let mut c = vec![0.0; m * n];
            matmul(m, k, n, a, op_a, b, op_b, &mut c, false, par, precision);
            c
        }
    }
}

/// The kernel that makes a product: [`matmul`]'s one dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// [`crate::sgemm`], its operands rounded as said while packed, over the pool or not.
    Sgemm(Round, Par),
    /// A [`Rhs`] packed for the product: bf16 on `vdpbf16ps`, or the portable rounded form.
    Rhs,
    /// [`crate::skinny`]: a few rows times a weight, streamed once.
    Skinny,
    /// The `gemm` crate's f32 kernels.
    Portable,
}

fn route(
    (m, k): (usize, usize),
    (op_a, op_b): (Op, Op),
    accumulate: bool,
    par: Par,
    precision: Precision,
) -> Route {
    if precision == Precision::Bf16 {
        return match Bf16Kernel::fastest() {
            Bf16Kernel::Fma => Route::Sgemm(Round::Bf16, Par::Pool),
            _ => Route::Rhs,
        };
    }
    // A few rows times a weight matrix (decode): stream the weights once instead of packing them.
    if m <= SKINNY_ROWS
        && k > 0
        && op_a == Op::N
        && op_b == Op::T
        && !accumulate
        && par == Par::Pool
        && crate::skinny::available()
    {
        Route::Skinny
    } else if crate::sgemm::available() {
        Route::Sgemm(Round::None, par)
    } else {
        Route::Portable
    }
}

/// A product on [`crate::sgemm`], its operands rounded as `round` says while packed into the
/// thread's panel buffers: for bf16 ([`Bf16Kernel::Fma`]) the values a [`Rhs`] of that kernel
/// gives, bit for bit.
fn on_sgemm(
    (m, k, n): (usize, usize, usize),
    (a, op_a): (&[f32], Op),
    (b, op_b): (&[f32], Op),
    c: &mut [f32],
    accumulate: bool,
    par: Par,
    round: Round,
) {
    let (a_rs, a_cs) = a_strides(m, k, op_a);
    let (b_rs, b_cs) = b_strides(k, n, op_b);
    crate::sgemm::matmul(
        (m, k, n),
        (a, a_rs, a_cs),
        (b, b_rs, b_cs),
        c,
        accumulate,
        par == Par::Pool,
        round,
    );
}

/// `op(A)` (`[m,k]`, `m·k` values) as strides: `A[i][p] = a[i·rs + p·cs]`.
fn a_strides(m: usize, k: usize, op: Op) -> (usize, usize) {
    match op {
        Op::N => (k, 1),
        Op::T => (1, m),
    }
}

/// `op(B)` (`[k,n]`, `k·n` values) as the strides of its transpose: `B[p][j] = b[j·rs + p·cs]`.
fn b_strides(k: usize, n: usize, op: Op) -> (usize, usize) {
    match op {
        Op::N => (1, n),
        Op::T => (k, 1),
    }
}

/// `Cᵢ = A · Bᵢᵀ` for several weights read by the same rows (`A` `[m,k]`, `Bᵢ` `[nᵢ,k]`
/// with `nᵢ = Bᵢ.len() / k`, `Cᵢ` `[m,nᵢ]` overwritten): for a few rows one parallel pass over
/// all of them ([`crate::skinny::matmul_nt_many`]); in bf16 `A` rounded and packed once for
/// all of them ([`Rhs::matmul_many`], the same values as one [`matmul`] each); otherwise one
/// [`matmul`] each.
pub fn matmul_nt_many(
    m: usize,
    k: usize,
    a: &[f32],
    bs: &[&[f32]],
    cs: &mut [&mut [f32]],
    precision: Precision,
) {
    assert_eq!(bs.len(), cs.len(), "matmul_nt_many: one output per weight");
    match Many::of(m, k, precision) {
        Many::Skinny => crate::skinny::matmul_nt_many(m, k, a, bs, cs),
        Many::PackedOnce => {
            let rhs: Vec<Rhs> = bs
                .iter()
                .map(|b| Rhs::new(k, b.len() / k, b, Op::T))
                .collect();
            let rhs: Vec<&Rhs> = rhs.iter().collect();
            Rhs::matmul_many(&rhs, m, a, cs);
        }
        Many::Each => {
            for (b, c) in bs.iter().zip(cs.iter_mut()) {
                let n = b.len().checked_div(k).unwrap_or(0);
                matmul(m, k, n, a, Op::N, b, Op::T, c, false, Par::Pool, precision);
            }
        }
    }
}

/// [`matmul_nt_many`] into new vectors, written once where each product is its own
/// ([`matmul_new`]).
pub fn matmul_nt_many_new(
    m: usize,
    k: usize,
    a: &[f32],
    bs: &[&[f32]],
    precision: Precision,
) -> Vec<Vec<f32>> {
    let n = |b: &[f32]| b.len().checked_div(k).unwrap_or(0);
    match Many::of(m, k, precision) {
        Many::Each => bs
            .iter()
            .map(|b| matmul_new(m, k, n(b), a, Op::N, b, Op::T, Par::Pool, precision))
            .collect(),
        _ => {
            let mut out: Vec<Vec<f32>> = bs.iter().map(|b| vec![0.0; m * n(b)]).collect();
            let mut cs: Vec<&mut [f32]> = out.iter_mut().map(|c| &mut c[..]).collect();
            matmul_nt_many(m, k, a, bs, &mut cs, precision);
            out
        }
    }
}

/// How [`matmul_nt_many`] makes its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Many {
    /// A few f32 rows: one parallel pass over all the weights ([`crate::skinny`]).
    Skinny,
    /// bf16 on `vdpbf16ps` (or the portable rounded form): `A` rounded and packed once for
    /// all of them ([`Rhs::matmul_many`]), the same values as one [`matmul`] each.
    PackedOnce,
    /// One [`matmul`] each (on the FMA kernel bf16 operands are rounded while packed).
    Each,
}

impl Many {
    fn of(m: usize, k: usize, precision: Precision) -> Self {
        match precision {
            _ if k == 0 => Many::Each,
            Precision::F32 if m <= SKINNY_ROWS && crate::skinny::available() => Many::Skinny,
            Precision::Bf16 if Bf16Kernel::fastest() != Bf16Kernel::Fma => Many::PackedOnce,
            _ => Many::Each,
        }
    }
}

/// How this machine multiplies bf16 operands ([`Precision::Bf16`]); every way rounds both
/// operands to bf16 and sums their (exact) products in f32, so they differ only in the order of
/// the sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// `vdpbf16ps` on k-pairs ([`crate::bf16`]): where it is at least about as fast as f32 FMA.
    Dot,
    /// The operands rounded while they are packed for the f32 AVX-512 kernel
    /// ([`crate::sgemm`]): where `vdpbf16ps` runs at half rate (Intel cores without AMX), or
    /// is missing.
    Fma,
    /// The operands rounded into copies for the portable f32 GEMM.
    Emulated,
}

impl Bf16Kernel {
    /// The fastest this CPU has, chosen once per process: where it has both `vdpbf16ps` and
    /// AVX-512 F, [`Bf16Kernel::Dot`] unless a short measurement ([`crate::peak::dot_to_fma`])
    /// finds `vdpbf16ps` under 3/4 of the f32 FMA rate.
    pub fn fastest() -> Self {
        use std::sync::OnceLock;
        static CHOICE: OnceLock<Bf16Kernel> = OnceLock::new();
        *CHOICE.get_or_init(
            || match (crate::bf16::available(), crate::sgemm::available()) {
                (true, true) if crate::peak::dot_to_fma() < 0.75 => Bf16Kernel::Fma,
                (true, _) => Bf16Kernel::Dot,
                (false, true) => Bf16Kernel::Fma,
                (false, false) => Bf16Kernel::Emulated,
            },
        )
    }

    /// What a report calls it.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernel::Dot => "vdpbf16ps",
            Bf16Kernel::Fma => "rounded f32 FMA",
            Bf16Kernel::Emulated => "emulated",
        }
    }
}

/// The right operand `op(B)` (`[k,n]`) of bf16 products ([`Precision::Bf16`]), rounded and laid
/// out once, for a weight that several products share (every row chunk of the output head,
/// every decode step of an engine serving bf16).
pub struct Rhs {
    k: usize,
    n: usize,
    form: Form,
}

impl std::fmt::Debug for Rhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rhs")
            .field("k", &self.k)
            .field("n", &self.n)
            .finish_non_exhaustive()
    }
}

enum Form {
    /// Packed k-pairs for `vdpbf16ps`.
    #[cfg(target_arch = "x86_64")]
    Pairs(crate::bf16::PackedB),
    /// Rounded column panels for the f32 AVX-512 kernel.
    Panels(crate::sgemm::PackedB),
    /// bf16-valued f32 as given, for the f32 GEMM.
    Rounded(Vec<f32>, Op),
}

impl Rhs {
    /// `op(B)` of `k·n` values in `b` (`[k,n]` for `Op::N`, `[n,k]` for `Op::T`), for this
    /// machine's [`Bf16Kernel::fastest`].
    pub fn new(k: usize, n: usize, b: &[f32], op_b: Op) -> Self {
        Self::on(Bf16Kernel::fastest(), k, n, b, op_b, false)
    }

    /// As [`Rhs::new`] — the same kernel, so the same values, bit for bit — in the form that
    /// keeps the fewest bytes: bf16 k-pairs for [`Bf16Kernel::Dot`], bf16 bits for
    /// [`Bf16Kernel::Fma`] (half of what a decode step streams, which is what a few rows'
    /// product costs).
    pub fn compact(k: usize, n: usize, b: &[f32], op_b: Op) -> Self {
        Self::on(Bf16Kernel::fastest(), k, n, b, op_b, true)
    }

    /// As [`Rhs::new`], for `kernel` where the CPU has it, else for the emulation; `compact`:
    /// the FMA kernel's panels kept as bf16 bits ([`Rhs::compact`]).
    fn on(kernel: Bf16Kernel, k: usize, n: usize, b: &[f32], op_b: Op, compact: bool) -> Self {
        assert!(
            b.len() >= k * n,
            "bf16 rhs: B has {} values, needs {}",
            b.len(),
            k * n
        );
        // B is packed as its transpose: rows j, inner p, B[p][j] = b[j·rs + p·cs].
        let (rs, cs) = b_strides(k, n, op_b);
        let form = match kernel {
            #[cfg(target_arch = "x86_64")]
            Bf16Kernel::Dot => crate::bf16::PackedB::new(b, k, n, rs, cs).map(Form::Pairs),
            Bf16Kernel::Fma if compact => {
                crate::sgemm::PackedB::compact(b, k, n, (rs, cs)).map(Form::Panels)
            }
            Bf16Kernel::Fma => {
                crate::sgemm::PackedB::new(b, k, n, (rs, cs), Round::Bf16).map(Form::Panels)
            }
            _ => None,
        };
        let form = form.unwrap_or_else(|| Form::Rounded(crate::bf16::rounded(&b[..k * n]), op_b));
        Self { k, n, form }
    }

    /// `Cᵢ = round(A) · rhsᵢ` for several right operands of one `k` read by the same rows
    /// (`A` `[m,k]`; a layer's q, k and v): on the packed kernels `A` is rounded once and one
    /// parallel pass makes them all; each row's values are those [`Rhs::matmul`] gives.
    pub fn matmul_many(rhs: &[&Rhs], m: usize, a: &[f32], cs: &mut [&mut [f32]]) {
        assert_eq!(
            rhs.len(),
            cs.len(),
            "bf16 matmul_many: one output per operand"
        );
        let k = rhs.first().map_or(0, |r| r.k);
        if k > 0 && rhs.iter().all(|r| r.k == k) {
            assert!(
                a.len() >= m * k,
                "bf16 matmul_many: A has {} values",
                a.len()
            );
            let panels: Option<Vec<&crate::sgemm::PackedB>> = rhs
                .iter()
                .map(|r| match &r.form {
                    Form::Panels(p) => Some(p),
                    _ => None,
                })
                .collect();
            if let Some(bs) = panels {
                crate::sgemm::PackedB::multiply_many(&bs, m, a, (k, 1), cs, false);
                return;
            }
            #[cfg(target_arch = "x86_64")]
            {
                let pairs: Option<Vec<&crate::bf16::PackedB>> = rhs
                    .iter()
                    .map(|r| match &r.form {
                        Form::Pairs(p) => Some(p),
                        _ => None,
                    })
                    .collect();
                if let Some(bs) = pairs {
                    crate::bf16::PackedB::multiply_many(&bs, m, a, k, 1, cs, false);
                    return;
                }
            }
        }
        for (r, c) in rhs.iter().zip(cs.iter_mut()) {
            r.matmul(m, a, Op::N, c, false);
        }
    }

    /// `C[m,n] (+)= round(op(A)) · self` (`A` `m·k` values, `C` `m·n`).
    pub fn matmul(&self, m: usize, a: &[f32], op_a: Op, c: &mut [f32], accumulate: bool) {
        let (k, n) = (self.k, self.n);
        assert!(
            a.len() >= m * k && c.len() >= m * n,
            "bf16 matmul: A has {}, C {} values for {m}×{k}×{n}",
            a.len(),
            c.len()
        );
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            if !accumulate {
                c[..m * n].fill(0.0);
            }
            return;
        }
        match &self.form {
            #[cfg(target_arch = "x86_64")]
            Form::Pairs(bp) => {
                let (rs, cs) = match op_a {
                    Op::N => (k, 1),
                    Op::T => (1, m),
                };
                bp.multiply(m, a, rs, cs, c, accumulate);
            }
            Form::Panels(bp) => bp.multiply(m, a, a_strides(m, k, op_a), c, accumulate),
            Form::Rounded(br, op_b) => {
                let ar = crate::bf16::rounded(&a[..m * k]);
                matmul(
                    m,
                    k,
                    n,
                    &ar,
                    op_a,
                    br,
                    *op_b,
                    c,
                    accumulate,
                    Par::Pool,
                    Precision::F32,
                );
            }
        }
    }
}

/// Strided multiply for views into larger buffers (attention heads inside a `[tokens, heads·d]`
/// activation). `C[i,j] (+)= Σ_p A[i·a_rs + p·a_cs] · B[p·b_rs + j·b_cs]`, `C` row stride `c_rs`.
///
/// # Safety
/// Every addressed element must lie inside its allocation, and `c` must not alias `a` or `b`.
pub unsafe fn strided(
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    a_rs: isize,
    a_cs: isize,
    b: *const f32,
    b_rs: isize,
    b_cs: isize,
    c: *mut f32,
    c_rs: isize,
    accumulate: bool,
    par: Par,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Where each operand has a unit stride, as every caller's views do, on the packed kernel.
    let unit = |rs: isize, cs: isize| rs >= 0 && cs >= 0 && (rs == 1 || cs == 1);
    if crate::sgemm::available() && unit(a_rs, a_cs) && unit(b_rs, b_cs) && c_rs >= 0 {
        // SAFETY: forwarded from the caller's contract (`B[p][j]` is `b[j·b_cs + p·b_rs]`).
        unsafe {
            crate::sgemm::strided(
                (m, k, n),
                (a, a_rs as usize, a_cs as usize),
                (b, b_cs as usize, b_rs as usize),
                (c, c_rs as usize),
                accumulate,
                par == Par::Pool,
                Round::None,
            );
        }
        return;
    }
    let parallelism = match par {
        Par::Pool if m * n * k >= 64 * 64 * 64 => Parallelism::Rayon(0),
        _ => Parallelism::None,
    };
    // SAFETY: forwarded from the caller's contract. (`gemm::gemm` for f32 is this call.)
    unsafe {
        gemm_f32::gemm::f32::get_gemm_fn()(
            m,
            n,
            k,
            c,
            1,
            c_rs,
            accumulate,
            a,
            a_cs,
            a_rs,
            b,
            b_cs,
            b_rs,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{close, randn};

    /// f64 sums of `each(a) · each(b)` over the operands' layouts: the references below.
    #[allow(clippy::too_many_arguments)]
    fn exact(
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        ta: Op,
        b: &[f32],
        tb: Op,
        each: fn(f32) -> f32,
    ) -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| {
                        let av = if ta == Op::N {
                            a[i * k + p]
                        } else {
                            a[p * m + i]
                        };
                        let bv = if tb == Op::N {
                            b[p * n + j]
                        } else {
                            b[j * k + p]
                        };
                        each(av) as f64 * each(bv) as f64
                    })
                    .sum();
            }
        }
        c
    }

    fn naive(m: usize, k: usize, n: usize, a: &[f32], ta: Op, b: &[f32], tb: Op) -> Vec<f32> {
        exact(m, k, n, a, ta, b, tb, |x| x)
            .into_iter()
            .map(|x| x as f32)
            .collect()
    }

    #[test]
    fn all_transpose_combinations_match_naive() {
        let (m, k, n) = (37, 29, 41);
        let a = randn(m * k, 1);
        let b = randn(k * n, 2);
        for ta in [Op::N, Op::T] {
            for tb in [Op::N, Op::T] {
                let mut c = vec![0.0; m * n];
                matmul(
                    m,
                    k,
                    n,
                    &a,
                    ta,
                    &b,
                    tb,
                    &mut c,
                    false,
                    Par::Pool,
                    Precision::F32,
                );
                close(&c, &naive(m, k, n, &a, ta, &b, tb), 1e-4, "matmul");
                // accumulate adds onto what is there
                matmul(
                    m,
                    k,
                    n,
                    &a,
                    ta,
                    &b,
                    tb,
                    &mut c,
                    true,
                    Par::Single,
                    Precision::F32,
                );
                let twice: Vec<f32> = naive(m, k, n, &a, ta, &b, tb)
                    .iter()
                    .map(|x| 2.0 * x)
                    .collect();
                close(&c, &twice, 1e-4, "matmul accumulate");
            }
        }
    }
    /// A new product's values are the ones [`matmul`] writes over any `C`, bit for bit, on
    /// every route: empty shapes, k = 0, the skinny rows, the packed kernel, each layout and
    /// precision; the C it is compared with starts as NaN, so a value `matmul` leaves
    /// unwritten would show.
    #[test]
    fn new_products_are_the_products_matmul_writes() {
        for (m, k, n) in [
            (0, 5, 7),
            (6, 0, 9),
            (3, 17, 0),
            (5, 33, 40),
            (64, 20, 30),
            (65, 20, 30),
            (97, 300, 45),
        ] {
            let (a, b) = (randn(m * k, 3), randn(k * n, 4));
            for precision in [Precision::F32, Precision::Bf16] {
                for (ta, tb) in [
                    (Op::N, Op::N),
                    (Op::N, Op::T),
                    (Op::T, Op::N),
                    (Op::T, Op::T),
                ] {
                    for par in [Par::Pool, Par::Single] {
                        let mut c = vec![f32::NAN; m * n];
                        matmul(m, k, n, &a, ta, &b, tb, &mut c, false, par, precision);
                        let new = matmul_new(m, k, n, &a, ta, &b, tb, par, precision);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&new),
                            bits(&c),
                            "{m}×{k}×{n} {ta:?}{tb:?} {par:?} {precision:?}"
                        );
                    }
                }
                let ws = [randn(n * k, 5), randn(2 * n * k, 6)];
                let bs: Vec<&[f32]> = ws.iter().map(|w| &w[..]).collect();
                let mut cs: Vec<Vec<f32>> = ws
                    .iter()
                    .map(|w| vec![f32::NAN; m * w.len().checked_div(k).unwrap_or(0)])
                    .collect();
                let mut outs: Vec<&mut [f32]> = cs.iter_mut().map(|c| &mut c[..]).collect();
                matmul_nt_many(m, k, &a, &bs, &mut outs, precision);
                let new = matmul_nt_many_new(m, k, &a, &bs, precision);
                if k > 0 {
                    assert_eq!(new, cs, "many {m}×{k}×{n} {precision:?}");
                } else {
                    // No weight has a width when k is 0: nothing to write.
                    assert!(new.iter().all(Vec::is_empty), "many with k = 0");
                }
            }
        }
    }

    /// f64 sums of the bf16-rounded operands: what an exact accumulator would give.
    fn rounded_reference(
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        ta: Op,
        b: &[f32],
        tb: Op,
    ) -> Vec<f64> {
        exact(m, k, n, a, ta, b, tb, crate::bf16::round)
    }

    type Bf16Path = fn(usize, usize, usize, &[f32], Op, &[f32], Op, &mut [f32], bool);

    /// The bf16 paths this machine can run: the emulation always, `vdpbf16ps` and the FMA
    /// kernel's panels (rounded f32 and compact bf16 bits) where present.
    fn bf16_paths() -> Vec<(&'static str, Bf16Path)> {
        let mut v: Vec<(&'static str, Bf16Path)> =
            vec![("emulated", |m, k, n, a, ta, b, tb, c, acc| {
                Rhs::on(Bf16Kernel::Emulated, k, n, b, tb, false).matmul(m, a, ta, c, acc);
            })];
        if crate::bf16::available() {
            v.push(("vdpbf16ps", |m, k, n, a, ta, b, tb, c, acc| {
                let rhs = Rhs::on(Bf16Kernel::Dot, k, n, b, tb, false);
                #[cfg(target_arch = "x86_64")]
                assert!(matches!(rhs.form, Form::Pairs(_)));
                rhs.matmul(m, a, ta, c, acc);
            }));
        }
        if crate::sgemm::available() {
            v.push(("rounded panels", |m, k, n, a, ta, b, tb, c, acc| {
                let rhs = Rhs::on(Bf16Kernel::Fma, k, n, b, tb, false);
                assert!(k == 0 || matches!(rhs.form, Form::Panels(_)));
                rhs.matmul(m, a, ta, c, acc);
            }));
            v.push(("compact panels", |m, k, n, a, ta, b, tb, c, acc| {
                let rhs = Rhs::on(Bf16Kernel::Fma, k, n, b, tb, true);
                assert!(k == 0 || matches!(rhs.form, Form::Panels(_)));
                rhs.matmul(m, a, ta, c, acc);
            }));
        }
        v
    }

    /// bf16: every transpose combination, shapes with ragged tiles, odd k, k over one block,
    /// and accumulation, against f64 sums of the rounded operands — only f32 summation error
    /// remains — on the hardware path and on the emulation.
    #[test]
    fn bf16_layouts_match_an_f64_reference_of_the_rounded_operands() {
        for (name, mm) in bf16_paths() {
            for (m, k, n) in [(1, 1, 1), (13, 7, 33), (37, 301, 65), (96, 258, 31)] {
                let a = randn(m * k, 3);
                let b = randn(k * n, 4);
                for ta in [Op::N, Op::T] {
                    for tb in [Op::N, Op::T] {
                        let want = rounded_reference(m, k, n, &a, ta, &b, tb);
                        let tol = 2e-6 * (k as f64).sqrt() * 8.0;
                        let mut c = vec![7.0f32; m * n];
                        mm(m, k, n, &a, ta, &b, tb, &mut c, false);
                        for (i, (&got, &w)) in c.iter().zip(&want).enumerate() {
                            assert!(
                                (got as f64 - w).abs() <= tol * (1.0 + w.abs()),
                                "{name} {m}x{k}x{n} {ta:?}{tb:?}[{i}]: {got} vs {w}"
                            );
                        }
                        mm(m, k, n, &a, ta, &b, tb, &mut c, true);
                        for (i, (&got, &w)) in c.iter().zip(&want).enumerate() {
                            assert!(
                                (got as f64 - 2.0 * w).abs() <= 2.0 * tol * (1.0 + w.abs()),
                                "{name} accumulate {m}x{k}x{n} {ta:?}{tb:?}[{i}]: {got}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A row's products do not depend on the rows multiplied with it (how many, or where it
    /// sits among them), alone or with other operands in one pass: bit for bit on
    /// `vdpbf16ps` and on the rounded panels — so an engine serving bf16 gives a sequence the
    /// same values in a batch of any size, and the learner's — and to f32 summation noise on
    /// the emulation (whose f32 paths make no bitwise promise).
    #[test]
    fn bf16_rows_are_the_same_in_a_batch_of_any_size() {
        let (k, n, rows) = (300, 70, 40);
        let (a, b) = (randn(rows * k, 3), randn(n * k, 4));
        let mut kernels = vec![(Bf16Kernel::Emulated, false)];
        if crate::bf16::available() {
            kernels.push((Bf16Kernel::Dot, false));
        }
        if crate::sgemm::available() {
            kernels.extend([(Bf16Kernel::Fma, false), (Bf16Kernel::Fma, true)]);
        }
        for (kernel, compact) in kernels {
            let bitwise = kernel != Bf16Kernel::Emulated;
            let rhs = Rhs::on(kernel, k, n, &b, Op::T, compact);
            let other = Rhs::on(kernel, k, 9, &b[..9 * k], Op::T, compact);
            let mut all = vec![0.0f32; rows * n];
            rhs.matmul(rows, &a, Op::N, &mut all, false);
            for m in (1..=14).chain([25]) {
                for first in [0, 5, rows - m] {
                    let mut c = vec![0.0f32; m * n];
                    rhs.matmul(m, &a[first * k..], Op::N, &mut c, false);
                    let (mut c2, mut o) = (vec![0.0f32; m * n], vec![0.0f32; m * 9]);
                    Rhs::matmul_many(&[&other, &rhs], m, &a[first * k..], &mut [&mut o, &mut c2]);
                    let same = |c: &[f32]| {
                        c.iter().zip(&all[first * n..]).all(|(&x, &y)| {
                            if bitwise {
                                x.to_bits() == y.to_bits()
                            } else {
                                (x - y).abs() <= 1e-5 * (1.0 + y.abs())
                            }
                        })
                    };
                    assert!(
                        same(&c) && same(&c2),
                        "{kernel:?} (compact: {compact}): rows {first}..{} alone",
                        first + m
                    );
                }
            }
        }
    }

    /// The products really are bf16: an operand below bf16's resolution vanishes, as it does
    /// in `torch.autocast`.
    #[test]
    fn bf16_operands_are_rounded() {
        let a = [1.0 + 1.0 / 512.0, 1.0];
        let b = [1.0, 1.0];
        for (name, mm) in bf16_paths() {
            let mut c = [0.0f32];
            mm(1, 2, 1, &a, Op::N, &b, Op::N, &mut c, false);
            assert_eq!(c[0], 2.0, "{name}");
        }
    }
}
