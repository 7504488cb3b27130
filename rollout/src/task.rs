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

/// Problems read from a JSON-lines file: one object per line, the prompt and the answer under
/// configurable keys (an answer that is a JSON number or other value counts by its JSON text).
/// The held-out set is an eval file, or the last `eval_size` rows of a seeded shuffle.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Training problems, in file order.
    pub train: Vec<Problem>,
    /// Held-out problems.
    pub eval: Vec<Problem>,
}

/// Reads the problems of `path` (errors name the file, the line and the key).
pub fn read_jsonl(
    path: &std::path::Path,
    prompt_key: &str,
    answer_key: &str,
) -> Result<Vec<Problem>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{}: not JSON: {e}", at()))?;
        let field = |k: &str| -> Result<String, String> {
            match v.get(k) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(serde_json::Value::Null) | None => Err(format!(
                    "{}: no key `{k}` (keys: {})",
                    at(),
                    v.as_object()
                        .map(|o| o.keys().cloned().collect::<Vec<_>>().join(", "))
                        .unwrap_or_default()
                )),
                Some(other) => Ok(other.to_string()),
            }
        };
        out.push(Problem {
            prompt: field(prompt_key)?,
            answer: field(answer_key)?,
        });
    }
    if out.is_empty() {
        return Err(format!("{}: no problems in the file", path.display()));
    }
    Ok(out)
}

/// Reads the problems of a Parquet file: the columns `prompt_key` and `answer_key` (text, or
/// numbers and booleans by their JSON text), one problem per row (errors name the file, the row
/// and the column).
pub fn read_parquet(
    path: &std::path::Path,
    prompt_key: &str,
    answer_key: &str,
) -> Result<Vec<Problem>, String> {
    let rows = crate::parquet::read_columns(path, &[prompt_key, answer_key])?;
    let mut out = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        let mut cells = row.into_iter();
        let mut next = |key: &str| match cells.next() {
            Some(crate::parquet::Cell::Null) | None => Err(format!(
                "{}: row {}: `{key}` is null",
                path.display(),
                i + 1
            )),
            Some(c) => Ok(c.to_string()),
        };
        out.push(Problem {
            prompt: next(prompt_key)?,
            answer: next(answer_key)?,
        });
    }
    if out.is_empty() {
        return Err(format!("{}: no problems in the file", path.display()));
    }
    Ok(out)
}

/// A permutation of `0..n` drawn from `seed`.
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

impl Dataset {
    /// Train and eval problems: `eval` when given, else the last `eval_size` of `train` shuffled
    /// with `seed` (at least one problem stays for training).
    pub fn split(
        train: Vec<Problem>,
        eval: Option<Vec<Problem>>,
        eval_size: usize,
        seed: u64,
    ) -> Self {
        match eval {
            Some(mut eval) => {
                eval.truncate(eval_size.max(1));
                Self { train, eval }
            }
            None => {
                let order = permutation(train.len(), seed ^ 0x5EED_5EED);
                let keep = train.len().saturating_sub(eval_size).max(1);
                let (t, e) = order.split_at(keep.min(order.len()));
                Self {
                    eval: e.iter().map(|&i| train[i].clone()).collect(),
                    train: t.iter().map(|&i| train[i].clone()).collect(),
                }
            }
        }
    }

    /// Training problems `start..start+count` of the run: epoch after epoch over the training
    /// rows, each epoch in its own order drawn from `seed`.
    pub fn train_batch(&self, seed: u64, start: u64, count: usize) -> Vec<Problem> {
        let n = self.train.len() as u64;
        let mut order: Option<(u64, Vec<usize>)> = None;
        (start..start + count as u64)
            .map(|i| {
                let epoch = i / n;
                if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    order = Some((epoch, permutation(n as usize, seed.wrapping_add(epoch))));
                }
                let p = &order.as_ref().expect("set above").1;
                self.train[p[(i % n) as usize]].clone()
            })
            .collect()
    }
}

/// Where a stage's problems come from: the arithmetic task, or a dataset read once.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// The built-in arithmetic task.
    Arith(ArithTask),
    /// A JSON-lines or Parquet dataset.
    Dataset(Dataset),
}

impl Source {
    /// The held-out problems (`size` of them for `arith`; a dataset's split decided its own).
    pub fn eval_set(&self, seed: u64, size: usize) -> Vec<Problem> {
        match self {
            Source::Arith(a) => a.eval_set(seed, size),
            Source::Dataset(d) => d.eval.clone(),
        }
    }

    /// Training problems `start..start+count` (never one of `exclude`, for `arith`; a dataset's
    /// split keeps its eval rows out by construction).
    pub fn train_batch(
        &self,
        seed: u64,
        start: u64,
        count: usize,
        exclude: &HashSet<Problem>,
    ) -> Vec<Problem> {
        match self {
            Source::Arith(a) => a.train_batch(seed, start, count, exclude),
            Source::Dataset(d) => d.train_batch(seed, start, count),
        }
    }

    /// Whether answers are short arithmetic results (eval then needs only a few tokens).
    pub fn is_arith(&self) -> bool {
        matches!(self, Source::Arith(_))
    }

    /// Training rows of a dataset (`None`: an endless stream).
    pub fn train_rows(&self) -> Option<usize> {
        match self {
            Source::Arith(_) => None,
            Source::Dataset(d) => Some(d.train.len()),
        }
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
    fn jsonl_datasets_split_shuffle_and_cycle() {
        let dir = std::env::temp_dir().join(format!("trellis-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("d.jsonl");
        let lines: Vec<String> = (0..10)
            .map(|i| format!("{{\"q\": \"{i}+1=\", \"a\": {}}}", i + 1))
            .collect();
        std::fs::write(&f, lines.join("\n") + "\n\n").unwrap();
        let rows = read_jsonl(&f, "q", "a").unwrap();
        assert_eq!(
            rows[3],
            Problem {
                prompt: "3+1=".into(),
                answer: "4".into()
            }
        );
        let d = Dataset::split(rows.clone(), None, 3, 7);
        assert_eq!((d.train.len(), d.eval.len()), (7, 3));
        assert!(d.eval.iter().all(|p| !d.train.contains(p)));
        // Two epochs see every training row twice, in two different orders.
        let b = d.train_batch(1, 0, 14);
        assert_eq!(b, d.train_batch(1, 0, 14), "reproducible");
        let (e0, e1) = (&b[..7], &b[7..]);
        let sorted = |v: &[Problem]| {
            let mut v = v.to_vec();
            v.sort_by(|a, b| a.prompt.cmp(&b.prompt));
            v
        };
        assert_eq!(sorted(e0), sorted(&d.train));
        assert_eq!(sorted(e1), sorted(&d.train));
        assert_ne!(e0, e1);
        assert_eq!(
            d.train_batch(1, 5, 4),
            b[5..9].to_vec(),
            "positions are absolute"
        );
        std::fs::write(&f, "{\"q\": \"1\"}\n").unwrap();
        let e = read_jsonl(&f, "q", "a").unwrap_err();
        assert!(e.contains("d.jsonl:1: no key `a` (keys: q)"), "{e}");
        std::fs::write(&f, "{\"q\": \"1\", \"a\": 2}\nnot json\n").unwrap();
        assert!(
            read_jsonl(&f, "q", "a")
                .unwrap_err()
                .contains("d.jsonl:2: not JSON")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
