//! Dense matrix multiply on row-major f32, all transpose combinations: in f32 through the
//! `gemm` crate (runtime dispatch picks AVX-512 where present), or with bf16 operands and f32
//! accumulation through [`crate::bf16`].

use gemm::Parallelism;

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
    /// Operands rounded to bf16, products summed in f32 (`torch.autocast(dtype=bfloat16)`);
    /// on AVX512-BF16 hardware at twice the f32 rate ([`crate::bf16`]). Always over the pool.
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
    if precision == Precision::Bf16 {
        crate::bf16::matmul(m, k, n, a, op_a, b, op_b, c, accumulate);
        return;
    }
    // A few rows times a weight matrix (decode): stream the weights once instead of packing them.
    if m <= SKINNY_ROWS
        && op_a == Op::N
        && op_b == Op::T
        && !accumulate
        && par == Par::Pool
        && crate::skinny::available()
    {
        crate::skinny::matmul_nt(m, k, n, a, b, c);
        return;
    }
    let (a_rs, a_cs) = match op_a {
        Op::N => (k as isize, 1),
        Op::T => (1, m as isize),
    };
    let (b_rs, b_cs) = match op_b {
        Op::N => (n as isize, 1),
        Op::T => (1, k as isize),
    };
    // SAFETY: the strides above describe matrices that fit in the asserted slice lengths, and
    // `c` is exclusively borrowed.
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

/// `Cᵢ = A · Bᵢᵀ` for several weights read by the same rows (`A` `[m,k]`, `Bᵢ` `[nᵢ,k]`
/// with `nᵢ = Bᵢ.len() / k`, `Cᵢ` `[m,nᵢ]` overwritten): for a few rows one parallel pass over
/// all of them ([`crate::skinny::matmul_nt_many`]), otherwise one [`matmul`] each.
pub fn matmul_nt_many(
    m: usize,
    k: usize,
    a: &[f32],
    bs: &[&[f32]],
    cs: &mut [&mut [f32]],
    precision: Precision,
) {
    assert_eq!(bs.len(), cs.len(), "matmul_nt_many: one output per weight");
    if precision == Precision::F32 && m <= SKINNY_ROWS && k > 0 && crate::skinny::available() {
        crate::skinny::matmul_nt_many(m, k, a, bs, cs);
        return;
    }
    for (b, c) in bs.iter().zip(cs.iter_mut()) {
        let n = b.len().checked_div(k).unwrap_or(0);
        matmul(m, k, n, a, Op::N, b, Op::T, c, false, Par::Pool, precision);
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
    let parallelism = match par {
        Par::Pool if m * n * k >= 64 * 64 * 64 => Parallelism::Rayon(0),
        _ => Parallelism::None,
    };
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm::gemm(
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

    fn naive(m: usize, k: usize, n: usize, a: &[f32], ta: Op, b: &[f32], tb: Op) -> Vec<f32> {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
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
                    s += av as f64 * bv as f64;
                }
                c[i * n + j] = s as f32;
            }
        }
        c
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
}
