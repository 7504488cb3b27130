//! `exp` over slices, sixteen lanes at a time: the softmaxes of attention and of the output
//! head take one exponential per score (tens of millions a training step), and SwiGLU's gate
//! one per hidden unit and token ([`sigmoid`]), which libm computes one at a time.
//!
//! Owns one exponential ([`exp`]: Cody–Waite range reduction and a degree-6 polynomial, within
//! 2 ulp of the correctly rounded value over f32's range; `exp(-inf) = 0`), used the same on
//! every AVX-512 lane (a slice's last values in a masked vector) and by the scalar [`exp`], so
//! a value never depends on where in a slice it sits; CPUs without AVX-512 take libm's `expf` for the slices. Never: allocates or spreads
//! work over threads (callers run it inside their own tasks).

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this, `exp` is 0 (the smallest normal's log is −87.34); above `HI`, infinity.
const LO: f32 = -87.336_55;
const HI: f32 = 88.722_84;
/// Taylor-like coefficients of e^r on |r| ≤ ln2/2 (Cephes' `expf`).
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5e-1,
];

/// e^x (0 below −87.34, where f32 leaves normal numbers; ∞ above 88.72; NaN stays NaN).
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < LO {
        return 0.0;
    }
    if x > HI {
        return f32::INFINITY;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = (p * r).mul_add(r, r) + 1.0;
    // 2^n for n in −126..=128, in two factors so that n = 128 does not overflow the exponent.
    let h = n as i32 / 2;
    y * f32::from_bits(((h + 127) as u32) << 23)
        * f32::from_bits(((n as i32 - h + 127) as u32) << 23)
}

/// `x ← e^x` for every value; returns their sum.
pub fn exp_in_place(xs: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the feature was just detected.
        return unsafe { exp_in_place_avx512(xs) };
    }
    xs.iter_mut()
        .map(|x| {
            *x = x.exp();
            *x
        })
        .sum()
}

/// `Σ e^(x−shift)` and `Σ e^(x−shift)·x` over `xs` (the normaliser and the mean of a softmax)
/// without writing them.
pub fn exp_sum_dot(xs: &[f32], shift: f32) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the feature was just detected.
        return unsafe { exp_sum_dot_avx512(xs, shift) };
    }
    xs.iter().fold((0.0, 0.0), |(s, d), &x| {
        let e = (x - shift).exp();
        (s + e, d + e * x)
    })
}

/// `x ← e^x · (a + b·x) · c` for every value (the softmax head's backward: `x` the log-prob).
pub fn exp_affine(xs: &mut [f32], a: f32, b: f32, c: f32) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the feature was just detected.
        return unsafe { exp_affine_avx512(xs, a, b, c) };
    }
    for x in xs {
        *x = x.exp() * (a + b * *x) * c;
    }
}

/// `out[i] = 1 / (1 + e^(−x[i]))` (SwiGLU's gate), as [`exp`] makes it on every lane; CPUs without AVX-512 take libm's `expf`.
pub fn sigmoid(xs: &[f32], out: &mut [f32]) {
    assert_eq!(xs.len(), out.len(), "sigmoid: shapes");
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the feature was just detected.
        return unsafe { sigmoid_avx512(xs, out) };
    }
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = 1.0 / (1.0 + (-x).exp());
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// [`exp`] on sixteen lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    let low = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LO));
    let high = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(HI));
    let xc = _mm512_min_ps(x, _mm512_set1_ps(HI));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(P[0]);
    for c in &P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
        _mm512_set1_ps(1.0),
    );
    // y · 2^n, exact for the whole range (scalef does not overflow at n = 128 before scaling).
    let e = _mm512_scalef_ps(y, n);
    let e = _mm512_maskz_mov_ps(!low, e);
    let e = _mm512_mask_mov_ps(e, high, _mm512_set1_ps(f32::INFINITY));
    _mm512_mask_mov_ps(e, nan, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_in_place_avx512(xs: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut sum = _mm512_setzero_ps();
    for (i, m) in lanes(xs.len()) {
        // SAFETY: the mask keeps both inside `xs`; lanes past its end are e^−∞ = 0.
        unsafe {
            let p = xs.as_mut_ptr().add(i);
            let e = exp16(_mm512_mask_loadu_ps(
                _mm512_set1_ps(f32::NEG_INFINITY),
                m,
                p,
            ));
            _mm512_mask_storeu_ps(p, m, e);
            sum = _mm512_add_ps(sum, e);
        }
    }
    _mm512_reduce_add_ps(sum)
}

/// Each 16-value chunk of a slice of `len`: its start and the mask of its lanes inside.
#[cfg(target_arch = "x86_64")]
pub(crate) fn lanes(len: usize) -> impl Iterator<Item = (usize, u16)> + Clone {
    (0..len).step_by(16).map(move |i| {
        (
            i,
            if len - i >= 16 {
                !0
            } else {
                (1u16 << (len - i)) - 1
            },
        )
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_dot_avx512(xs: &[f32], shift: f32) -> (f32, f32) {
    use std::arch::x86_64::*;
    let (mut sum, mut dot) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let s = _mm512_set1_ps(shift);
    for (i, m) in lanes(xs.len()) {
        // SAFETY: the mask keeps the load inside `xs`; lanes past its end add nothing.
        let v = unsafe { _mm512_maskz_loadu_ps(m, xs.as_ptr().add(i)) };
        let e = exp16(_mm512_sub_ps(v, s));
        sum = _mm512_mask_add_ps(sum, m, sum, e);
        dot = _mm512_mask3_fmadd_ps(e, v, dot, m);
    }
    (_mm512_reduce_add_ps(sum), _mm512_reduce_add_ps(dot))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_affine_avx512(xs: &mut [f32], a: f32, b: f32, c: f32) {
    use std::arch::x86_64::*;
    let (av, bv, cv) = (_mm512_set1_ps(a), _mm512_set1_ps(b), _mm512_set1_ps(c));
    for (i, m) in lanes(xs.len()) {
        // SAFETY: the mask keeps both inside `xs`.
        unsafe {
            let p = xs.as_mut_ptr().add(i);
            let x = _mm512_maskz_loadu_ps(m, p);
            let y = _mm512_mul_ps(_mm512_mul_ps(exp16(x), _mm512_fmadd_ps(bv, x, av)), cv);
            _mm512_mask_storeu_ps(p, m, y);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sigmoid_avx512(xs: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let one = _mm512_set1_ps(1.0);
    for (i, m) in lanes(xs.len()) {
        // SAFETY: the mask keeps both inside their slices (of one length).
        unsafe {
            let x = _mm512_maskz_loadu_ps(m, xs.as_ptr().add(i));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            let y = _mm512_div_ps(one, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, y);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ulps between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// The gate is within 4 ulp of the f64 logistic where e^(−x) is finite, 0 below (where the
    /// logistic is subnormal), and a value does not depend on where in the slice it sits.
    #[test]
    fn sigmoid_matches_the_logistic_on_every_lane_and_tail() {
        let xs: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) * 0.05).collect();
        let mut out = vec![0.0; xs.len()];
        sigmoid(&xs, &mut out);
        for (&x, &y) in xs.iter().zip(&out) {
            let want = if x < -HI {
                0.0
            } else {
                (1.0 / (1.0 + (-(x as f64)).exp())) as f32
            };
            assert!(ulps(y, want) <= 4, "sigmoid({x}) = {y}, want {want}");
        }
        let mut shifted = vec![0.0; xs.len() - 3];
        sigmoid(&xs[3..], &mut shifted);
        assert_eq!(&shifted[..], &out[3..], "a value moved with its lane");
        let mut ends = [0.0; 3];
        sigmoid(&[-200.0, 200.0, f32::NAN], &mut ends);
        assert_eq!(ends[..2], [0.0, 1.0]);
        assert!(ends[2].is_nan());
    }

    /// Every 24 832nd f32 bit pattern of the range exp maps to normal numbers, and the edges:
    /// within 2 ulp of the f64 exponential rounded to f32, and on AVX-512 the lanes and the
    /// scalar tails agree bit for bit.
    #[test]
    fn exp_is_within_two_ulp_everywhere_and_the_same_on_every_lane() {
        let mut xs: Vec<f32> = (0..(1u32 << 31))
            .step_by(97 * 256)
            .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
            .filter(|x| (LO..=HI).contains(x))
            .collect();
        xs.extend([0.0, -0.0, LO, HI, 1.0, -1.0, 0.5 * std::f32::consts::LN_2]);
        let mut v = xs.clone();
        exp_in_place(&mut v);
        #[cfg(target_arch = "x86_64")]
        let lanes = avx512();
        #[cfg(not(target_arch = "x86_64"))]
        let lanes = false;
        for (&x, &got) in xs.iter().zip(&v) {
            let want = (x as f64).exp() as f32;
            assert!(ulps(got, want) <= 2, "exp({x:e}) = {got:e}, want {want:e}");
            assert!(ulps(exp(x), want) <= 2, "scalar exp({x:e}) = {}", exp(x));
            if lanes {
                assert_eq!(got.to_bits(), exp(x).to_bits(), "lanes vs scalar at {x:e}");
            }
        }
        // The edges in a full vector and in a tail.
        let edges = [f32::NEG_INFINITY, -100.0, 100.0, f32::INFINITY, 0.0];
        let mut e = edges.repeat(4);
        exp_in_place(&mut e);
        for (got, x) in e.iter().zip(edges.iter().cycle()) {
            if lanes {
                assert_eq!(got.to_bits(), exp(*x).to_bits(), "exp({x})");
            } else {
                assert_eq!(got.to_bits(), x.exp().to_bits(), "exp({x})");
            }
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        let mut nan = [f32::NAN; 16];
        exp_in_place(&mut nan);
        assert!(nan.iter().all(|x| x.is_nan()));
    }

    #[test]
    fn the_fused_forms_equal_their_definitions() {
        let xs: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        let (s, d) = exp_sum_dot(&xs, 1.5);
        let (ws, wd) = xs.iter().fold((0.0f64, 0.0f64), |(s, d), &x| {
            let e = (x as f64 - 1.5).exp();
            (s + e, d + e * x as f64)
        });
        assert!(((s as f64 - ws) / ws).abs() < 1e-6, "{s} vs {ws}");
        assert!(((d as f64 - wd) / wd.abs()).abs() < 1e-6, "{d} vs {wd}");
        let mut v = xs.clone();
        exp_affine(&mut v, 0.3, -0.7, 2.0);
        for (&x, &got) in xs.iter().zip(&v) {
            let want = (x as f64).exp() * (0.3 - 0.7 * x as f64) * 2.0;
            assert!(
                (got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
        }
        let mut w = xs.clone();
        let sum = exp_in_place(&mut w);
        let want: f64 = xs.iter().map(|&x| (x as f64).exp()).sum();
        assert!(((sum as f64 - want) / want).abs() < 1e-6);
    }
}
