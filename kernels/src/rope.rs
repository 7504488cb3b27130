//! Rotary position embeddings in Hugging Face's `rotate_half` layout: the first and second
//! halves of each head's vector form the rotated pairs.

use rayon::prelude::*;

/// Llama-3 style frequency scaling (`rope_scaling.rope_type: llama3`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// Overall factor applied to low frequencies.
    pub factor: f64,
    /// Wavelengths longer than `original_max / low_freq_factor` are fully scaled.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_max / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was trained with.
    pub original_max_position_embeddings: f64,
}

/// Inverse frequencies for a head of size `head_dim` (`head_dim / 2` values).
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<Llama3Scaling>) -> Vec<f64> {
    let half = head_dim / 2;
    (0..half)
        .map(|i| {
            // As transformers computes it: base ** (2i / dim) in f32, then its reciprocal.
            let f = 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32) as f64;
            match scaling {
                None => f,
                Some(s) => {
                    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (s.original_max_position_embeddings / wavelen
                            - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

/// Per-token cos and sin tables (`[tokens, head_dim/2]` each) for the given positions, shared
/// by q and k and by every layer of one forward pass.
#[derive(Clone, Debug, Default)]
pub struct RopeTable {
    /// cos(position · inv_freq), row per token.
    pub cos: Vec<f32>,
    /// sin(position · inv_freq), row per token.
    pub sin: Vec<f32>,
    /// `head_dim / 2`.
    pub half: usize,
}

impl RopeTable {
    /// Tables for `positions` under `inv_freq`.
    pub fn new(positions: &[u32], inv_freq: &[f64]) -> Self {
        let half = inv_freq.len();
        let top = positions.iter().max().map_or(0, |&p| p as usize + 1);
        if top < positions.len() {
            // Positions repeat (every packed sequence starts at 0): each one's row is made
            // once and copied.
            let rows = Self::new(&(0..top as u32).collect::<Vec<_>>(), inv_freq);
            let gather = |t: &[f32]| -> Vec<f32> {
                positions
                    .iter()
                    .flat_map(|&p| &t[p as usize * half..(p as usize + 1) * half])
                    .copied()
                    .collect()
            };
            return Self {
                cos: gather(&rows.cos),
                sin: gather(&rows.sin),
                half,
            };
        }
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in inv_freq {
                // transformers forms the angle in f32.
                let angle = (p as f32 * f as f32) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self { cos, sin, half }
    }
}

/// Rotates `x` (`[tokens, heads, 2·half]`) in place. `inverse` rotates by the negative angle,
/// which is the backward of the forward rotation.
pub fn apply(x: &mut [f32], heads: usize, table: &RopeTable, inverse: bool) {
    let half = table.half;
    let d = 2 * half;
    assert_eq!(
        x.len(),
        table.cos.len() / half.max(1) * heads * d,
        "rope: x shape"
    );
    let sign = if inverse { -1.0 } else { 1.0 };
    x.par_chunks_mut(heads * d)
        .zip(table.cos.par_chunks(half))
        .zip(table.sin.par_chunks(half))
        .for_each(|((row, cos), sin)| {
            for head in row.chunks_mut(d) {
                let (x1, x2) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    let s = sign * sin[i];
                    x1[i] = a * cos[i] - b * s;
                    x2[i] = b * cos[i] + a * s;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grad, randn};

    #[test]
    fn backward_is_the_inverse_rotation() {
        let (tokens, heads, d) = (4, 3, 8);
        let positions = [0u32, 5, 9, 200];
        let table = RopeTable::new(&positions, &inv_freq(d, 10000.0, None));
        let x = randn(tokens * heads * d, 7);
        let coef = randn(tokens * heads * d, 8);
        // loss = Σ coef · rope(x); d loss / dx = rope⁻¹(coef)
        let mut grad = coef.clone();
        apply(&mut grad, heads, &table, true);
        let inv = inv_freq(d, 10000.0, None);
        let f = |p: &[f64]| {
            let mut loss = 0.0;
            for t in 0..tokens {
                for h in 0..heads {
                    for i in 0..d / 2 {
                        let ang = positions[t] as f64 * inv[i];
                        let base = (t * heads + h) * d;
                        let (a, b) = (p[base + i], p[base + i + d / 2]);
                        loss += (a * ang.cos() - b * ang.sin()) * coef[base + i] as f64;
                        loss += (b * ang.cos() + a * ang.sin()) * coef[base + i + d / 2] as f64;
                    }
                }
            }
            loss
        };
        check_grad(&x, &grad, 96, 1e-3, "rope dx", &f);
        let mut y = x.clone();
        apply(&mut y, heads, &table, false);
        apply(&mut y, heads, &table, true);
        crate::testutil::close(&y, &x, 1e-5, "rope round trip");
    }

    /// Tables for repeated positions (packed sequences) hold, row for row, what each position
    /// alone gets.
    #[test]
    fn repeated_positions_get_the_rows_each_gets_alone() {
        let f = inv_freq(8, 10_000.0, None);
        let positions = [0, 1, 2, 0, 1, 5, 0, 0];
        let t = RopeTable::new(&positions, &f);
        assert_eq!((t.cos.len(), t.half), (positions.len() * 4, 4));
        for (i, &p) in positions.iter().enumerate() {
            let one = RopeTable::new(&[p], &f);
            assert_eq!(t.cos[i * 4..(i + 1) * 4], one.cos[..], "cos at {i}");
            assert_eq!(t.sin[i * 4..(i + 1) * 4], one.sin[..], "sin at {i}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_scales_low_frequencies() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let plain = inv_freq(128, 500000.0, None);
        let scaled = inv_freq(128, 500000.0, Some(s));
        assert_eq!(plain[0], scaled[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-15);
    }
}
