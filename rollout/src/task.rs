//! Built-in tasks with verifiable answers. `arith`: seeded arithmetic problems (`37+45=` →
//! `82`), with a character-level tokenizer (`builtin:arith`) that is written out as a Hugging
//! Face `tokenizer.json`, so the embedded default needs no download.

use learner::chat::Message;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// What the model is asked: text, or a conversation (VeRL's `prompt` column: a list of
/// `{role, content}` messages), which is always rendered through the chat template.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Plain text (rendered as one user message when the stage asks for the chat template).
    Text(String),
    /// Messages, rendered by the chat template.
    Chat(Vec<Message>),
}

impl Prompt {
    /// The text a person reads in logs and samples: the text, or the last message's content.
    pub fn display(&self) -> &str {
        match self {
            Prompt::Text(t) => t,
            Prompt::Chat(m) => m.last().map_or("", |m| m.content.as_str()),
        }
    }
}

impl From<&str> for Prompt {
    fn from(t: &str) -> Self {
        Prompt::Text(t.into())
    }
}

/// One problem: the prompt, the exact answer text, and what a VeRL reward function is also given.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Problem {
    /// What the model sees, e.g. `37+45=`.
    pub prompt: Prompt,
    /// What it must produce (before the end-of-sequence token), e.g. `82`; VeRL's
    /// `ground_truth`.
    pub answer: String,
    /// The row's `data_source` (VeRL's `data.reward_fn_key` column), when the dataset has one.
    pub data_source: Option<String>,
    /// The row's `extra_info`, as JSON text, when the dataset has one.
    pub extra_info: Option<String>,
}

impl Problem {
    /// A problem with a text prompt and nothing else.
    pub fn new(prompt: impl Into<String>, answer: impl Into<String>) -> Self {
        Self {
            prompt: Prompt::Text(prompt.into()),
            answer: answer.into(),
            data_source: None,
            extra_info: None,
        }
    }
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
    /// The share of problems answered with a worked episode, for an SFT warm start of an
    /// environment: `arith`, a calculator call (`<call>37*45</call>` then `<result>1665</result>`
    /// then `1665`, in the `builtin:tools` tokenizer's format; the rest answer directly);
    /// `guess`, a whole game (guesses, each answered `+` or `-`, until the secret).
    pub demos: f64,
}

impl Default for ArithTask {
    fn default() -> Self {
        Self {
            digits: 2,
            ops: "+".into(),
            reverse_answer: false,
            demos: 0.0,
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
        if !(0.0..=1.0).contains(&self.demos) {
            return Err(format!("demos must lie in 0..=1, got {}", self.demos));
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
        // Whether this problem is a demonstration: a hash of it, so the stream of problems is
        // the same whatever the share.
        let mut z = (a << 32 ^ b ^ (op as u64) << 60).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        if ((z >> 11) as f64) < self.demos * (1u64 << 53) as f64 {
            answer = format!("<call>{a}{op}{b}</call><result>{v}</result>{answer}");
        }
        Problem::new(format!("{a}{op}{b}="), answer)
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

/// Problems read from a dataset (JSON lines or Parquet): the training rows and the held-out
/// ones (an eval file, or the last `eval_size` rows of a seeded shuffle).
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Training problems, in file order.
    pub train: Vec<Problem>,
    /// Held-out problems.
    pub eval: Vec<Problem>,
}

/// Where a row's fields are. A key names a column (a JSON key), or with dots a field inside one
/// (`reward_model.ground_truth`; a column whose own name has the dots wins).
#[derive(Clone, Copy, Debug)]
pub struct Keys<'a> {
    /// The prompt: text, or a list of `{role, content}` messages.
    pub prompt: &'a str,
    /// The answer (text; another value counts by its JSON text).
    pub answer: &'a str,
    /// The reward's `data_source` (optional in the data).
    pub data_source: &'a str,
}

/// VeRL's column of the reward's extra information (optional in the data).
pub const EXTRA_INFO: &str = "extra_info";

/// Reads the problems of a JSON-lines file: one object per line (errors name the file, the line
/// and the key).
pub fn read_jsonl(path: &std::path::Path, keys: Keys<'_>) -> Result<Vec<Problem>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{}: not JSON: {e}", at()))?;
        let serde_json::Value::Object(row) = v else {
            return Err(format!("{}: not a JSON object", at()));
        };
        out.push(problem_of(&row, keys, &at)?);
    }
    if out.is_empty() {
        return Err(format!("{}: no problems in the file", path.display()));
    }
    Ok(out)
}

/// Reads the problems of a Parquet file, one per row (errors name the file, the row and the
/// column).
pub fn read_parquet(path: &std::path::Path, keys: Keys<'_>) -> Result<Vec<Problem>, String> {
    let names = crate::parquet::columns(path)?;
    // The column of a key: its own name, else the part before the first dot.
    let column = |key: &str| -> String {
        if names.iter().any(|n| n == key) {
            return key.into();
        }
        key.split('.').next().unwrap_or(key).into()
    };
    let mut wanted = vec![column(keys.prompt), column(keys.answer)];
    for optional in [column(keys.data_source), EXTRA_INFO.into()] {
        if names.contains(&optional) {
            wanted.push(optional);
        }
    }
    let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();
    let rows = crate::parquet::read_rows(path, &wanted)?;
    let mut out = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        out.push(problem_of(row, keys, &|| {
            format!("{}: row {}", path.display(), i + 1)
        })?);
    }
    if out.is_empty() {
        return Err(format!("{}: no problems in the file", path.display()));
    }
    Ok(out)
}

/// The value at `key` of `row`: the field of that name, else the dotted path into it.
fn lookup<'v>(
    row: &'v serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Option<&'v serde_json::Value> {
    if let Some(v) = row.get(key) {
        return Some(v);
    }
    let mut parts = key.split('.');
    let mut v = row.get(parts.next()?)?;
    for p in parts {
        v = match v {
            serde_json::Value::Object(m) => m.get(p)?,
            serde_json::Value::Array(a) => a.get(p.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(v)
}

/// One row's problem; `at` names the row in errors.
fn problem_of(
    row: &serde_json::Map<String, serde_json::Value>,
    keys: Keys<'_>,
    at: &dyn Fn() -> String,
) -> Result<Problem, String> {
    use serde_json::Value;
    let required = |k: &str| -> Result<&Value, String> {
        match lookup(row, k) {
            Some(Value::Null) => Err(format!("{}: `{k}` is null", at())),
            Some(v) => Ok(v),
            None => Err(format!(
                "{}: no key `{k}` (keys: {})",
                at(),
                row.keys().cloned().collect::<Vec<_>>().join(", ")
            )),
        }
    };
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let prompt = match required(keys.prompt)? {
        Value::String(s) => Prompt::Text(s.clone()),
        Value::Array(list) => Prompt::Chat(
            list.iter()
                .enumerate()
                .map(|(j, m)| {
                    let field = |f: &str| m.get(f).and_then(Value::as_str).map(str::to_string);
                    match (field("role"), field("content")) {
                        (Some(role), Some(content)) => Ok(Message { role, content }),
                        _ => Err(format!(
                            "{}: `{}`[{j}] is not a {{role, content}} message: {m}",
                            at(),
                            keys.prompt
                        )),
                    }
                })
                .collect::<Result<_, _>>()?,
        ),
        other => {
            return Err(format!(
                "{}: `{}` is neither text nor a list of {{role, content}} messages: {other}",
                at(),
                keys.prompt
            ));
        }
    };
    if matches!(&prompt, Prompt::Chat(m) if m.is_empty()) {
        return Err(format!(
            "{}: `{}` is an empty conversation",
            at(),
            keys.prompt
        ));
    }
    let answer = text(required(keys.answer)?);
    let data_source = match lookup(row, keys.data_source) {
        None | Some(Value::Null) => None,
        Some(v) => Some(text(v)),
    };
    let extra_info = match lookup(row, EXTRA_INFO) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.to_string()),
    };
    Ok(Problem {
        prompt,
        answer,
        data_source,
        extra_info,
    })
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
    /// The built-in guessing game's secrets (`digits`, `demos` of [`ArithTask`]).
    Guess(ArithTask),
    /// A JSON-lines or Parquet dataset.
    Dataset(Dataset),
}

impl Source {
    /// The held-out problems (`size` of them for `arith`; a dataset's split decided its own).
    pub fn eval_set(&self, seed: u64, size: usize) -> Vec<Problem> {
        match self {
            Source::Arith(a) => a.eval_set(seed, size),
            Source::Guess(g) => guess_problems(g, seed, 1, 0, size),
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
            // A secret is all a problem is (every prompt is the same): the held-out games are
            // their own stream, and nothing can be learnt by heart.
            Source::Guess(g) => guess_problems(g, seed, 0, start, count),
            Source::Dataset(d) => d.train_batch(seed, start, count),
        }
    }

    /// Whether answers are short arithmetic results (eval then needs only a few tokens).
    pub fn is_arith(&self) -> bool {
        matches!(self, Source::Arith(_) | Source::Guess(_))
    }

    /// Training rows of a dataset (`None`: an endless stream).
    pub fn train_rows(&self) -> Option<usize> {
        match self {
            Source::Arith(_) | Source::Guess(_) => None,
            Source::Dataset(d) => Some(d.train.len()),
        }
    }
}

/// The guessing game's prompt: every game starts the same, the secret is the answer.
pub const GUESS_PROMPT: &str = "=";

/// Games `start..start + count` of stream `stream` of `seed`: secrets drawn uniformly from
/// `0..10^digits`; a `demos` share answered with a whole game, played by guessing uniformly
/// among the numbers the replies so far allow (a weak strategy that halving would beat), each
/// guess ended by `<eos>` and answered `+` (higher) or `-` (lower), as an episode writes it.
fn guess_problems(g: &ArithTask, seed: u64, stream: u64, start: u64, count: usize) -> Vec<Problem> {
    let hi = 10u64.pow(g.digits);
    (start..start + count as u64)
        .map(|i| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            rng.set_stream(stream + 2);
            let secret = rng.next_u64() % hi;
            let mut answer = secret.to_string();
            if (rng.next_u64() >> 11) as f64 <= g.demos * (1u64 << 53) as f64 && g.demos > 0.0 {
                let (mut lo, mut top) = (0, hi - 1);
                let mut game = String::new();
                loop {
                    let guess = lo + rng.next_u64() % (top - lo + 1);
                    game.push_str(&guess.to_string());
                    if guess == secret {
                        break;
                    }
                    game.push_str("<eos>");
                    if guess < secret {
                        game.push('+');
                        lo = guess + 1;
                    } else {
                        game.push('-');
                        top = guess - 1;
                    }
                }
                answer = game;
            }
            Problem::new(GUESS_PROMPT, answer)
        })
        .collect()
}

/// Tokens of the `builtin:arith` tokenizer, by id.
pub const ARITH_VOCAB: &[&str] = &[
    "<pad>", "<eos>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "-", "*", "=", " ",
];

/// Id of `<eos>` in the `builtin:arith` tokenizer.
pub const ARITH_EOS: u32 = 1;

/// The compact tool format's tokens, after [`ARITH_VOCAB`] in the `builtin:tools` tokenizer.
pub const TOOL_TOKENS: &[&str] = &["<call>", "</call>", "<result>", "</result>"];

/// The `builtin:arith` tokenizer as Hugging Face `tokenizer.json` text: one token per
/// character, `<pad>` and `<eos>` special.
pub fn arith_tokenizer_json() -> String {
    char_tokenizer_json(&[])
}

/// The `builtin:tools` tokenizer: `builtin:arith`'s, and the tokens of the compact tool format
/// ([`TOOL_TOKENS`], ids from 17 on) that tool-use episodes write.
pub fn tools_tokenizer_json() -> String {
    char_tokenizer_json(TOOL_TOKENS)
}

/// One token per character of [`ARITH_VOCAB`], then `words` whole.
fn char_tokenizer_json(words: &[&str]) -> String {
    let all: Vec<&str> = ARITH_VOCAB.iter().chain(words).copied().collect();
    let vocab: serde_json::Map<String, serde_json::Value> = all
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i.into()))
        .collect();
    let added = |id: usize, special: bool| {
        serde_json::json!({"id": id, "content": all[id], "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special})
    };
    let mut added_tokens = vec![added(0, true), added(1, true)];
    added_tokens.extend((ARITH_VOCAB.len()..all.len()).map(|id| added(id, false)));
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
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

    const KEYS: Keys<'static> = Keys {
        prompt: "q",
        answer: "a",
        data_source: "data_source",
    };

    #[test]
    fn jsonl_datasets_split_shuffle_and_cycle() {
        let dir = std::env::temp_dir().join(format!("trellis-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("d.jsonl");
        let lines: Vec<String> = (0..10)
            .map(|i| format!("{{\"q\": \"{i}+1=\", \"a\": {}}}", i + 1))
            .collect();
        std::fs::write(&f, lines.join("\n") + "\n\n").unwrap();
        let rows = read_jsonl(&f, KEYS).unwrap();
        assert_eq!(rows[3], Problem::new("3+1=", "4"));
        let d = Dataset::split(rows.clone(), None, 3, 7);
        assert_eq!((d.train.len(), d.eval.len()), (7, 3));
        assert!(d.eval.iter().all(|p| !d.train.contains(p)));
        // Two epochs see every training row twice, in two different orders.
        let b = d.train_batch(1, 0, 14);
        assert_eq!(b, d.train_batch(1, 0, 14), "reproducible");
        let (e0, e1) = (&b[..7], &b[7..]);
        let sorted = |v: &[Problem]| {
            let mut v = v.to_vec();
            v.sort_by(|a, b| a.prompt.display().cmp(b.prompt.display()));
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
        let e = read_jsonl(&f, KEYS).unwrap_err();
        assert!(e.contains("d.jsonl:1: no key `a` (keys: q)"), "{e}");
        std::fs::write(&f, "{\"q\": \"1\", \"a\": 2}\nnot json\n").unwrap();
        assert!(
            read_jsonl(&f, KEYS)
                .unwrap_err()
                .contains("d.jsonl:2: not JSON")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn verl_rows_give_chats_dotted_answers_and_the_rewards_inputs() {
        use serde_json::json;
        let keys = Keys {
            prompt: "prompt",
            answer: "reward_model.ground_truth",
            data_source: "data_source",
        };
        let row = |v: serde_json::Value| v.as_object().unwrap().clone();
        let at = || "f.parquet: row 1".to_string();
        let verl = row(json!({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "1+1?"}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": 0, "split": "train"},
        }));
        let p = problem_of(&verl, keys, &at).unwrap();
        let user = Message {
            role: "user".into(),
            content: "1+1?".into(),
        };
        assert_eq!(p.prompt, Prompt::Chat(vec![user]));
        assert_eq!(p.prompt.display(), "1+1?");
        assert_eq!(p.answer, "2");
        assert_eq!(p.data_source.as_deref(), Some("openai/gsm8k"));
        assert_eq!(
            p.extra_info.as_deref(),
            Some(r#"{"index":0,"split":"train"}"#)
        );
        // A column named with the dots wins over the path; numbers count by their text; a
        // missing data_source or extra_info is none.
        let flat = row(json!({"prompt": "q", "reward_model.ground_truth": 7, "reward_model": {}}));
        let p = problem_of(&flat, keys, &at).unwrap();
        assert_eq!(
            (p.answer.as_str(), p.data_source, p.extra_info),
            ("7", None, None)
        );
        // (row, the error it gives)
        let cases = [
            (
                json!({"prompt": "q"}),
                "f.parquet: row 1: no key `reward_model.ground_truth` (keys: prompt)",
            ),
            (
                json!({"prompt": "q", "reward_model": {"ground_truth": null}}),
                "f.parquet: row 1: `reward_model.ground_truth` is null",
            ),
            (
                json!({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": 1}}),
                "f.parquet: row 1: `prompt`[0] is not a {role, content} message: {\"role\":\"user\"}",
            ),
            (
                json!({"prompt": [], "reward_model": {"ground_truth": 1}}),
                "f.parquet: row 1: `prompt` is an empty conversation",
            ),
            (
                json!({"prompt": 3, "reward_model": {"ground_truth": 1}}),
                "f.parquet: row 1: `prompt` is neither text nor a list of {role, content} messages: 3",
            ),
        ];
        for (r, want) in cases {
            assert_eq!(problem_of(&row(r), keys, &at).unwrap_err(), want);
        }
    }

    #[test]
    fn tool_demonstrations_are_a_share_of_the_same_problems() {
        let plain = ArithTask {
            digits: 3,
            ops: "*".into(),
            ..Default::default()
        };
        let demos = ArithTask {
            demos: 0.3,
            ..plain.clone()
        };
        let (a, b) = (plain.eval_set(3, 400), demos.eval_set(3, 400));
        let mut shown = 0;
        for (p, d) in a.iter().zip(&b) {
            assert_eq!(p.prompt, d.prompt);
            if d.answer != p.answer {
                let call = p.prompt.display().trim_end_matches('=');
                let want = format!("<call>{call}</call><result>{0}</result>{0}", p.answer);
                assert_eq!(d.answer, want);
                shown += 1;
            }
        }
        assert!((90..150).contains(&shown), "{shown} of 400");
        // Every demonstration is one token per character but the tool's tokens.
        let tok = learner::tokenizer::Tokenizer::from_json(
            &tools_tokenizer_json(),
            std::path::Path::new("builtin:tools"),
        )
        .unwrap();
        let ids = tok
            .encode_rendered("<call>12*3</call><result>36</result>36")
            .unwrap();
        assert_eq!(ids, [17, 3, 4, 14, 5, 18, 19, 5, 8, 20, 5, 8]);
        assert_eq!(
            tok.decode(&ids).unwrap(),
            "<call>12*3</call><result>36</result>36"
        );
        assert!(
            ArithTask {
                demos: 1.5,
                ..plain
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn guessing_games_are_seeded_and_their_demonstrations_find_the_secret() {
        let g = ArithTask {
            digits: 1,
            demos: 1.0,
            ..Default::default()
        };
        let plain = ArithTask {
            demos: 0.0,
            ..g.clone()
        };
        let games = Source::Guess(g.clone()).train_batch(5, 10, 50, &HashSet::new());
        assert_eq!(
            games,
            Source::Guess(g.clone()).train_batch(5, 10, 50, &HashSet::new())
        );
        let secrets = Source::Guess(plain).train_batch(5, 10, 50, &HashSet::new());
        let tok = learner::tokenizer::Tokenizer::from_json(
            &arith_tokenizer_json(),
            std::path::Path::new("builtin:arith"),
        )
        .unwrap();
        let mut seen = HashSet::new();
        for (game, secret) in games.iter().zip(&secrets) {
            assert_eq!(game.prompt.display(), GUESS_PROMPT);
            let s: u64 = secret.answer.parse().unwrap();
            seen.insert(s);
            // Every guess is answered truly, and the last one is the secret.
            let turns: Vec<&str> = game.answer.split("<eos>").collect();
            for (k, t) in turns.iter().enumerate() {
                let guess: u64 = t.trim_start_matches(['+', '-']).parse().unwrap();
                if k + 1 == turns.len() {
                    assert_eq!(guess, s);
                } else {
                    let next = turns[k + 1].chars().next().unwrap();
                    assert_eq!(next, if guess < s { '+' } else { '-' }, "{}", game.answer);
                }
            }
            // `<eos>` inside a demonstration is the end-of-sequence token.
            let ids = tok.encode_rendered(&game.answer).unwrap();
            assert_eq!(
                ids.iter().filter(|&&t| t == ARITH_EOS).count(),
                turns.len() - 1
            );
        }
        assert!(seen.len() >= 8, "{seen:?}");
    }

    #[test]
    fn problems_are_seeded_and_correct() {
        let t = ArithTask {
            digits: 2,
            ops: "+-*".into(),
            ..Default::default()
        };
        let a = t.eval_set(7, 50);
        assert_eq!(a, t.eval_set(7, 50));
        for p in &a {
            let body = p.prompt.display().trim_end_matches('=');
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
