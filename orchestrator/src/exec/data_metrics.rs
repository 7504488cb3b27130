//! The batch's data metrics under VeRL's names (`compute_data_metrics`): per sequence, the
//! score and the prompt and response lengths (mean, max, min); per response token, the
//! advantages, returns and values (mean, max, min over the response mask).
//!
//! Owns: those statistics. Never: timing or throughput (the step measures them).

use learner::algo::TokenRows;
use learner::rl::Metrics;

/// Mean, max and min of `xs` under `name/…`; nothing for no values.
fn stats(m: &mut Metrics, name: &str, xs: impl Iterator<Item = f64>) {
    let (mut n, mut sum, mut max, mut min) = (0usize, 0.0, f64::NEG_INFINITY, f64::INFINITY);
    for x in xs {
        n += 1;
        sum += x;
        max = max.max(x);
        min = min.min(x);
    }
    if n > 0 {
        m.insert(format!("{name}/mean"), sum / n as f64);
        m.insert(format!("{name}/max"), max);
        m.insert(format!("{name}/min"), min);
    }
}

/// Per-token values of `v` (`[rows, cols]`) where the response mask is set.
fn masked<'a>(rows: &'a TokenRows, v: &'a [f32]) -> impl Iterator<Item = f64> + 'a {
    v.iter()
        .zip(&rows.mask)
        .filter(|(_, k)| **k > 0.0)
        .map(|(x, _)| f64::from(*x))
}

/// The metrics of one batch: `scores` per row; `advantages`, `returns`, `values` in the rows'
/// `[rows, cols]` layout when the step has them.
pub(crate) fn data_metrics(
    rows: &TokenRows,
    scores: &[f32],
    advantages: Option<&[f32]>,
    returns: Option<&[f32]>,
    values: Option<&[f32]>,
) -> Metrics {
    let mut m = Metrics::new();
    stats(&mut m, "critic/score", scores.iter().map(|&s| f64::from(s)));
    stats(
        &mut m,
        "response_length",
        rows.seqs.iter().map(|(p, s)| (s.len() - p) as f64),
    );
    stats(
        &mut m,
        "prompt_length",
        rows.seqs.iter().map(|(p, _)| *p as f64),
    );
    for (name, v) in [
        ("critic/advantages", advantages),
        ("critic/returns", returns),
        ("critic/values", values),
    ] {
        if let Some(v) = v {
            stats(&mut m, name, masked(rows, v));
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use learner::algo::layout::Row;

    #[test]
    fn statistics_follow_verl_per_sequence_and_per_masked_token() {
        // Two rows: prompt 3 + response 2, prompt 1 + response 1 (one padded column).
        let rows = TokenRows::new([
            Row {
                prompt: &[1, 2, 3],
                response: &[4, 5],
                group: 0,
                observed: &[],
            },
            Row {
                prompt: &[6],
                response: &[7],
                group: 0,
                observed: &[],
            },
        ]);
        let adv = [0.5, -1.0, 2.0, 99.0]; // 99 sits on padding: never counted
        let ret = [1.0, 2.0, 3.0, -99.0];
        let m = data_metrics(&rows, &[1.0, 0.0], Some(&adv), Some(&ret), None);
        let want = [
            ("critic/score/mean", 0.5),
            ("critic/score/max", 1.0),
            ("critic/score/min", 0.0),
            ("response_length/mean", 1.5),
            ("response_length/max", 2.0),
            ("response_length/min", 1.0),
            ("prompt_length/mean", 2.0),
            ("prompt_length/max", 3.0),
            ("prompt_length/min", 1.0),
            ("critic/advantages/mean", 0.5),
            ("critic/advantages/max", 2.0),
            ("critic/advantages/min", -1.0),
            ("critic/returns/mean", 2.0),
            ("critic/returns/max", 3.0),
            ("critic/returns/min", 1.0),
        ];
        for (k, v) in want {
            assert_eq!(m.get(k), Some(&v), "{k}: {m:?}");
        }
        assert_eq!(m.len(), want.len(), "{m:?}");
    }
}
