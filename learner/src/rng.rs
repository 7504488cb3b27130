//! Seeded randomness helpers over ChaCha (normal draws by Box–Muller).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// A uniform draw in (0, 1].
pub fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

/// Fills `out` with normal(0, std) draws.
pub fn fill_normal(rng: &mut ChaCha8Rng, out: &mut [f32], std: f32) {
    let mut i = 0;
    while i < out.len() {
        let (u1, u2) = (uniform(rng), uniform(rng));
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        out[i] = (r * t.cos()) as f32 * std;
        if i + 1 < out.len() {
            out[i + 1] = (r * t.sin()) as f32 * std;
        }
        i += 2;
    }
}
