//! Test helpers: seeded random data, closeness checks, and central finite differences in f64.

/// Deterministic pseudo-normal values (sum of uniforms), seeded.
pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| ((next() + next() + next() + next()) - 2.0) as f32 * 1.7)
        .collect()
}

/// Asserts `|a-b| <= tol·(1+|b|)` elementwise.
pub fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

/// Checks an analytic gradient against central differences of `f` (evaluated in f64 around
/// `x`), for `probes` evenly spread coordinates.
pub fn check_grad(
    x: &[f32],
    analytic: &[f32],
    probes: usize,
    tol: f64,
    what: &str,
    f: &dyn Fn(&[f64]) -> f64,
) {
    let base: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let step = (x.len() / probes.max(1)).max(1);
    for i in (0..x.len()).step_by(step) {
        let h = 1e-5 * (1.0 + base[i].abs());
        let mut p = base.clone();
        p[i] += h;
        let fp = f(&p);
        p[i] -= 2.0 * h;
        let fm = f(&p);
        let num = (fp - fm) / (2.0 * h);
        let got = analytic[i] as f64;
        assert!(
            (num - got).abs() <= tol * (1.0 + num.abs()),
            "{what}: d/dx[{i}] analytic {got} vs numeric {num}"
        );
    }
}
