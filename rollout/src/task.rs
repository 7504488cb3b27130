//! Built-in tasks with verifiable answers. `arith`: seeded arithmetic problems (`37+45=` →
//! `82`), with a character-level tokenizer (`builtin:arith`) that is written out as a Hugging
//! Face `tokenizer.json`, so the embedded default needs no download.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// One problem: the prompt text and the exact answer text.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Problem {
    /// What the model sees, e.g. `37+45=`.
    pub prompt: String,
    /// What it must produce (before the end-of-sequence token), e.g. `82`.
    pub answer: String,
}

/// Settings of the arithmetic task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArithTask {
    /// Digits per operand (operands are drawn uniformly from `0..10^digits`).
    pub digits: u32,
    /// Operators to draw from: any of `+`, `-`, `*`.
    pub ops: String,
    /// Write the answer least-significant digit first (`37+45=` → `28`), the order in which
    /// addition is computed; an easier target for small models.
    pub reverse_answer: bool,
}

impl Default for ArithTask {
    fn default() -> Self {
        Self {
            digits: 2,
            ops: "+".into(),
            reverse_answer: false,
        }
    }
}

impl ArithTask {
    /// Refuses settings the task cannot draw from.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=9).contains(&self.digits) {
            return Err(format!("digits must lie in 1..=9, got {}", self.digits));
        }
        if self.ops.is_empty() || self.ops.chars().any(|c| !"+-*".contains(c)) {
            return Err(format!(
                "ops must be a non-empty string of + - *, got {:?}",
                self.ops
            ));
        }
        Ok(())
    }

    fn draw(&self, rng: &mut ChaCha8Rng) -> Problem {
        let hi = 10u64.pow(self.digits);
        let (a, b) = (rng.next_u64() % hi, rng.next_u64() % hi);
        let ops: Vec<char> = self.ops.chars().collect();
        let op = ops[(rng.next_u64() % ops.len() as u64) as usize];
        let v: i64 = match op {
            '+' => (a + b) as i64,
            '-' => a as i64 - b as i64,
            _ => (a * b) as i64,
        };
        let mut answer = v.unsigned_abs().to_string();
        if self.reverse_answer {
            answer = answer.chars().rev().collect();
        }
        if v < 0 {
            answer.insert(0, '-');
        }
        Problem {
            prompt: format!("{a}{op}{b}="),
            answer,
        }
    }

    /// The held-out evaluation set: `size` problems from stream 1 of `seed`.
    pub fn eval_set(&self, seed: u64, size: usize) -> Vec<Problem> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(1);
        (0..size).map(|_| self.draw(&mut rng)).collect()
    }

    /// Training problems `start..start+count` of the stream of `seed`, never one of `exclude`
    /// (the eval set). The same arguments always give the same problems, so a resumed run sees
    /// the data it would have seen.
    pub fn train_batch(
        &self,
        seed: u64,
        start: u64,
        count: usize,
        exclude: &HashSet<Problem>,
    ) -> Vec<Problem> {
        (0..count as u64)
            .map(|i| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(2);
                rng.set_word_pos(((start + i) as u128) << 12);
                loop {
                    let p = self.draw(&mut rng);
                    if !exclude.contains(&p) {
                        return p;
                    }
                }
            })
            .collect()
    }
}

/// Tokens of the `builtin:arith` tokenizer, by id.
pub const ARITH_VOCAB: &[&str] = &[
    "<pad>", "<eos>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "-", "*", "=", " ",
];

/// Id of `<eos>` in the `builtin:arith` tokenizer.
pub const ARITH_EOS: u32 = 1;

/// The `builtin:arith` tokenizer as Hugging Face `tokenizer.json` text: one token per
/// character, `<pad>` and `<eos>` special.
pub fn arith_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = ARITH_VOCAB
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i.into()))
        .collect();
    let special = |id: usize| {
        serde_json::json!({"id": id, "content": ARITH_VOCAB[id], "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0), special(1)],
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<pad>"}
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_seeded_and_correct() {
        let t = ArithTask {
            digits: 2,
            ops: "+-*".into(),
            reverse_answer: false,
        };
        let a = t.eval_set(7, 50);
        assert_eq!(a, t.eval_set(7, 50));
        for p in &a {
            let body = p.prompt.trim_end_matches('=');
            let op = body.chars().find(|c| "+-*".contains(*c)).unwrap();
            let (x, y) = body.split_once(op).unwrap();
            let (x, y): (i64, i64) = (x.parse().unwrap(), y.parse().unwrap());
            let want = match op {
                '+' => x + y,
                '-' => x - y,
                _ => x * y,
            };
            assert_eq!(p.answer, want.to_string(), "{p:?}");
        }
        let rev = ArithTask {
            reverse_answer: true,
            ..Default::default()
        };
        let p = &rev.train_batch(1, 0, 1, &HashSet::new())[0];
        let plain = &ArithTask::default().train_batch(1, 0, 1, &HashSet::new())[0];
        assert_eq!(p.answer, plain.answer.chars().rev().collect::<String>());
    }

    #[test]
    fn training_batches_avoid_the_eval_set_and_are_reproducible() {
        let t = ArithTask {
            digits: 1,
            ..Default::default()
        };
        let eval: HashSet<Problem> = t.eval_set(3, 40).into_iter().collect();
        let b = t.train_batch(3, 100, 64, &eval);
        assert!(b.iter().all(|p| !eval.contains(p)));
        assert_eq!(b[10..], t.train_batch(3, 110, 54, &eval)[..]);
        assert!(
            ArithTask {
                ops: "/".into(),
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }
}
