//! DAPO's pieces: overlong reward shaping and the group filter of dynamic sampling.

use std::collections::HashMap;

/// The soft overlong penalty added to a response's reward:
/// `min(−(len − (max_len − buffer)) / buffer · factor, 0)`.
pub fn overlong_penalty(len: usize, max_response_len: usize, buffer: usize, factor: f64) -> f64 {
    if buffer == 0 {
        return 0.0;
    }
    let expected = max_response_len as f64 - buffer as f64;
    (-(len as f64 - expected) / buffer as f64 * factor).min(0.0)
}

/// Which rows to keep under dynamic sampling: groups whose scores are not all equal (they carry
/// no gradient otherwise); singletons are kept, as VeRL does.
pub fn keep_informative_groups(group: &[u64], scores: &[f32]) -> Vec<bool> {
    let mut stats: HashMap<u64, (f32, f32, usize)> = HashMap::new();
    for (&g, &s) in group.iter().zip(scores) {
        let e = stats
            .entry(g)
            .or_insert((f32::INFINITY, f32::NEG_INFINITY, 0));
        e.0 = e.0.min(s);
        e.1 = e.1.max(s);
        e.2 += 1;
    }
    group
        .iter()
        .map(|g| {
            let (lo, hi, n) = stats[g];
            n == 1 || hi > lo
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_penalty_by_hand() {
        // max 20, buffer 4: lengths up to 16 are free, 18 costs half the factor, 20 all of it.
        assert_eq!(overlong_penalty(10, 20, 4, 1.0), 0.0);
        assert_eq!(overlong_penalty(16, 20, 4, 1.0), 0.0);
        assert_eq!(overlong_penalty(18, 20, 4, 1.0), -0.5);
        assert_eq!(overlong_penalty(20, 20, 4, 2.0), -2.0);
        assert_eq!(overlong_penalty(20, 20, 0, 2.0), 0.0);
    }

    #[test]
    fn filter_drops_uniform_groups() {
        let keep = keep_informative_groups(&[0, 0, 1, 1, 2], &[1.0, 1.0, 0.0, 1.0, 0.0]);
        assert_eq!(keep, vec![false, false, true, true, true]);
    }
}
