//! Measures this machine's f32 FMA peak and bf16 dot-product peak, the denominators of MFU:
//! every thread of the pool runs independent chains of fused multiply-adds (or `vdpbf16ps`,
//! two bf16 products per f32 lane) in the widest vectors the CPU has.

use std::time::Instant;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    acc.iter().map(|x| _mm512_reduce_add_ps(*x)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut out = [0.0f32; 8];
    let mut s = 0.0;
    for x in acc {
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), x) };
        s += out.iter().sum::<f32>();
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn dpbf16_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999), _mm512_set1_ps(0.999));
    let b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(1e-3));
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, a, b);
        }
    }
    acc.iter().map(|x| _mm512_reduce_add_ps(*x)).sum()
}

/// FLOPs per iteration of one thread's loop, and the loop, for the widest ISA available.
fn kernel() -> (f64, fn(u64) -> f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was just detected.
            return (12.0 * 16.0 * 2.0, |n| unsafe { fma_avx512(n) });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected.
            return (12.0 * 8.0 * 2.0, |n| unsafe { fma_avx2(n) });
        }
    }
    (12.0 * 2.0, |n| {
        let mut acc = [1.0f32; 12];
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = x.mul_add(0.999_999, 1e-7);
            }
        }
        acc.iter().sum()
    })
}

/// Peak f32 GFLOP/s with `threads` threads: the best of several trials of about 0.1 s each,
/// since on a shared machine only the best trial approaches what the cores can do.
pub fn fma_peak_gflops(threads: usize) -> f64 {
    best_of(threads, kernel())
}

/// Peak bf16 GFLOP/s (products and sums of `vdpbf16ps`, f32 accumulation) with `threads`
/// threads, as [`fma_peak_gflops`]; `None` where the CPU has no AVX512-BF16.
pub fn bf16_peak_gflops(threads: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if crate::bf16::available() {
        // SAFETY: the feature was just detected.
        return Some(best_of(
            threads,
            (12.0 * 32.0 * 2.0, |n| unsafe { dpbf16_avx512(n) }),
        ));
    }
    let _ = threads;
    None
}

/// `vdpbf16ps`'s FLOP rate over f32 FMA's on one core, from a few milliseconds of each loop
/// (the best of five short trials of each, interleaved); 0 where the CPU lacks either.
/// [`crate::matmul::Bf16Kernel::fastest`] decides by it: about 2 where bf16 dot products run
/// at the FMA instruction rate, about 1 on Intel cores that run them at half that.
pub fn dot_to_fma() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::bf16::available() {
        let iters = 50_000u64;
        let rate = |flops_per_iter: f64, f: &dyn Fn(u64) -> f32| {
            let start = Instant::now();
            std::hint::black_box(f(std::hint::black_box(iters)));
            flops_per_iter * iters as f64 / start.elapsed().as_secs_f64().max(1e-9)
        };
        let (mut dot, mut fma) = (0.0f64, 0.0f64);
        for _ in 0..5 {
            // SAFETY: AVX512-BF16 (with AVX-512 F) was just detected.
            dot = dot.max(rate(12.0 * 32.0 * 2.0, &|n| unsafe { dpbf16_avx512(n) }));
            // SAFETY: as above.
            fma = fma.max(rate(12.0 * 16.0 * 2.0, &|n| unsafe { fma_avx512(n) }));
        }
        return dot / fma;
    }
    0.0
}

fn best_of(threads: usize, (flops_per_iter, f): (f64, fn(u64) -> f32)) -> f64 {
    let iters = 60_000_000u64;
    let mut best = 0.0f64;
    for _ in 0..7 {
        let start = Instant::now();
        let sink: f32 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads.max(1))
                .map(|_| s.spawn(move || f(std::hint::black_box(iters))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        std::hint::black_box(sink);
        let secs = start.elapsed().as_secs_f64();
        best = best.max(flops_per_iter * iters as f64 * threads.max(1) as f64 / secs / 1e9);
    }
    best
}
