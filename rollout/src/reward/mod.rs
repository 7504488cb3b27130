//! Reward functions over decoded responses (`reward: {type: ...}` in a workflow), with VeRL's
//! semantics where VeRL has the reward:
//!
//! - `exact_match`: 1 when the trimmed response equals the trimmed answer.
//! - `gsm8k`: the number after the last `#### ` in the response (commas and `$` dropped) equals
//!   the answer's (an answer written `... #### 72` counts by its `#### ` part); `format_score`
//!   when a `#### N` is there but wrong; 0 without one.
//! - `math`: the content of the last `\boxed{...}` in the response equals the answer's (the
//!   answer's own last `\boxed{}`, if it has one) after normalisation (spaces, `\left`/`\right`,
//!   `\!`, `$`, `^\circ`, a trailing `.`, `dfrac`/`tfrac`, a leading `x =`); `format_score` when
//!   boxed but wrong.
//! - `regex`: the first capture group of `pattern` (the whole match without groups), searched in
//!   the response, equals the answer; `format_score` when the pattern matches but the text differs.
//! - `format`: `score` when the whole response matches `pattern`, else 0 (a format-only reward).
//! - `python`: a Python function with VeRL's signature, `compute_score(data_source,
//!   solution_str, ground_truth, extra_info)`, called unchanged in a pool of worker processes
//!   ([`python`]).
//!
//! Owns: scoring responses ([`Scorer`]: built-in rewards in this process, Python ones on their
//! workers). Never: runs a workflow's `program` nodes (the orchestrator does).

pub mod python;

use python::{PythonPool, PythonSpec};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// Which reward.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields, tag = "type")]
pub enum Reward {
    /// 1 when the response (trimmed) equals the answer, else 0.
    ExactMatch,
    /// GSM8K's `#### N` answer.
    Gsm8k {
        /// Score of a well-formed but wrong answer.
        #[serde(default)]
        format_score: f32,
    },
    /// The last `\boxed{}`.
    Math {
        /// Score of a boxed but wrong answer.
        #[serde(default)]
        format_score: f32,
    },
    /// An answer extracted by a regular expression.
    Regex {
        /// The expression (Rust `regex` syntax).
        pattern: String,
        /// Score when the pattern matches but the extracted text is wrong.
        #[serde(default)]
        format_score: f32,
    },
    /// The response's format alone.
    Format {
        /// The expression the whole response must match.
        pattern: String,
        /// Score when it does.
        #[serde(default = "one")]
        score: f32,
    },
    /// A Python function with VeRL's `compute_score` signature, returning a number (or a dict
    /// with `score`).
    Python {
        /// The file that defines it (relative to the workflow file).
        path: PathBuf,
        /// The function.
        #[serde(default = "compute_score")]
        function: String,
        /// The interpreter (a venv's `bin/python` for a reward with its own packages).
        #[serde(default = "python3")]
        python: PathBuf,
        /// Worker processes (each imports the file once).
        #[serde(default = "two")]
        workers: usize,
        /// Seconds one call may take; past it the sample scores 0 and its worker is replaced.
        #[serde(default = "thirty")]
        timeout_s: f64,
        /// Address-space limit of a worker, in MiB.
        #[serde(default = "four_gib")]
        memory_mb: u64,
        /// The `data_source` the function is given (VeRL's dataset column; unset: `None`).
        #[serde(default)]
        data_source: Option<String>,
    },
}

fn one() -> f32 {
    1.0
}

fn compute_score() -> String {
    "compute_score".into()
}

fn python3() -> PathBuf {
    "python3".into()
}

fn two() -> usize {
    2
}

fn thirty() -> f64 {
    30.0
}

fn four_gib() -> u64 {
    4096
}

/// Limits the address space of the process `cmd` starts to `bytes` (RLIMIT_AS), so a reward
/// that allocates without bound fails alone instead of taking the host's memory.
pub fn limit_address_space(cmd: &mut std::process::Command, bytes: u64) {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec only async-signal-safe calls (setrlimit) are made.
        unsafe {
            cmd.pre_exec(move || {
                let r = libc::rlimit {
                    rlim_cur: bytes as libc::rlim_t,
                    rlim_max: bytes as libc::rlim_t,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// The lines `stdout` (a child's standard output) writes, as they come, read by a thread named
/// `name` that ends with the pipe (or when nobody receives any more).
pub(crate) fn read_lines(
    stdout: std::process::ChildStdout,
    name: &str,
) -> std::io::Result<std::sync::mpsc::Receiver<String>> {
    use std::io::BufRead;
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        })?;
    Ok(lines)
}

/// Why responses could not be scored.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The interpreter does not start.
    #[error("cannot start `{}` for the reward: {message}", python.display())]
    Start {
        /// The interpreter.
        python: PathBuf,
        /// What the OS said.
        message: String,
    },
    /// The reward's file does not import, or has no such function.
    #[error("the reward in {} does not load:\n{traceback}", path.display())]
    Import {
        /// Its file.
        path: PathBuf,
        /// Python's traceback.
        traceback: String,
    },
    /// Every sample of a batch failed: the reward is broken, not the samples.
    #[error("the reward in {} failed on all {count} samples of the batch; the first:\n{first}", path.display())]
    AllFailed {
        /// Its file.
        path: PathBuf,
        /// Samples.
        count: usize,
        /// The first sample's traceback (or timeout).
        first: String,
    },
    /// A bug.
    #[error("reward: {0}")]
    Internal(String),
}

/// One response to score, with what its problem gives a reward function.
#[derive(Clone, Copy, Debug)]
pub struct Item<'a> {
    /// The decoded response (VeRL's `solution_str`).
    pub response: &'a str,
    /// The answer (VeRL's `ground_truth`).
    pub answer: &'a str,
    /// The row's `data_source` (a Python reward's own `data_source` setting stands in when none).
    pub data_source: Option<&'a str>,
    /// The row's `extra_info`, as JSON text.
    pub extra_info: Option<&'a str>,
}

impl<'a> Item<'a> {
    /// `response` to `problem`.
    pub fn new(response: &'a str, problem: &'a crate::task::Problem) -> Self {
        Self {
            response,
            answer: &problem.answer,
            data_source: problem.data_source.as_deref(),
            extra_info: problem.extra_info.as_deref(),
        }
    }

    /// `response` to a problem with only an answer.
    pub fn plain(response: &'a str, answer: &'a str) -> Self {
        Self {
            response,
            answer,
            data_source: None,
            extra_info: None,
        }
    }
}

/// Scores of a batch, and how many samples scored 0 because their reward call failed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scored {
    /// One per item, in order.
    pub scores: Vec<f32>,
    /// Samples whose call raised, timed out or crashed its worker (scored 0).
    pub failed: usize,
}

/// What scores a stage's responses: a built-in reward, or a Python one with its workers
/// (started on first use, stopped when the scorer is dropped).
#[derive(Debug)]
pub struct Scorer {
    reward: Reward,
    python: Option<PythonPool>,
}

impl Scorer {
    /// A scorer for `reward`, checked: a pattern compiles; a Python function imports (in a
    /// worker that then ends).
    pub fn open(reward: Reward) -> Result<Self, String> {
        reward.validate()?;
        let python = match &reward {
            Reward::Python {
                path,
                function,
                python,
                workers,
                timeout_s,
                memory_mb,
                data_source,
            } => {
                let spec = PythonSpec {
                    python: python.clone(),
                    path: path.clone(),
                    function: function.clone(),
                    workers: *workers,
                    timeout: Duration::from_secs_f64(*timeout_s),
                    memory_bytes: memory_mb.saturating_mul(1 << 20),
                    data_source: data_source.clone(),
                };
                PythonPool::check(&spec).map_err(|e| e.to_string())?;
                Some(PythonPool::new(spec))
            }
            _ => None,
        };
        Ok(Self { reward, python })
    }

    /// The reward it scores.
    pub fn reward(&self) -> &Reward {
        &self.reward
    }

    /// Scores responses. A Python call that fails scores its sample 0 and is
    /// counted (its traceback logged); a batch whose every call failed is an error.
    pub fn score_all(&self, items: &[Item<'_>]) -> Result<Scored, RewardError> {
        let Some(pool) = &self.python else {
            return Ok(Scored {
                scores: items
                    .iter()
                    .map(|i| self.reward.score(i.response, i.answer))
                    .collect(),
                failed: 0,
            });
        };
        let outcomes = pool.score(items)?;
        let failed: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
        if let Some(first) = failed.first() {
            if failed.len() == items.len() {
                return Err(RewardError::AllFailed {
                    path: pool.spec().path.clone(),
                    count: items.len(),
                    first: (*first).clone(),
                });
            }
            tracing::warn!(
                failed = failed.len(),
                of = items.len(),
                "reward calls failed (scored 0); the first: {first}"
            );
        }
        Ok(Scored {
            scores: outcomes
                .iter()
                .map(|o| *o.as_ref().unwrap_or(&0.0))
                .collect(),
            failed: failed.len(),
        })
    }
}

impl Reward {
    /// Refuses a reward that cannot score (a pattern that does not compile), naming it.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Reward::Regex { pattern, .. } | Reward::Format { pattern, .. } => {
                regex::Regex::new(pattern)
                    .map(|_| ())
                    .map_err(|e| format!("reward pattern `{pattern}`: {e}"))
            }
            Reward::Python {
                workers,
                timeout_s,
                memory_mb,
                ..
            } => {
                if *workers == 0 || *memory_mb == 0 || !(*timeout_s > 0.0 && timeout_s.is_finite())
                {
                    return Err(format!(
                        "workers, timeout_s and memory_mb must be positive (got {workers}, {timeout_s}, {memory_mb})"
                    ));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Scores one response against its answer (a built-in reward; a Python one scores through
    /// a [`Scorer`], and here gives 0).
    fn score(&self, response: &str, answer: &str) -> f32 {
        let graded = |got: Option<String>, want: String, format_score: f32| match got {
            Some(g) if g == want => 1.0,
            Some(_) => format_score,
            None => 0.0,
        };
        match self {
            Reward::ExactMatch => f32::from(u8::from(response.trim() == answer.trim())),
            Reward::Gsm8k { format_score } => {
                let want = last_hash_answer(answer).unwrap_or_else(|| normalize_number(answer));
                graded(last_hash_answer(response), want, *format_score)
            }
            Reward::Math { format_score } => {
                let want = last_boxed(answer).unwrap_or(answer);
                graded(
                    last_boxed(response).map(normalize_math),
                    normalize_math(want),
                    *format_score,
                )
            }
            Reward::Regex {
                pattern,
                format_score,
            } => {
                let got = with_regex(pattern, |re| {
                    re.captures(response).map(|c| {
                        c.get(1)
                            .or_else(|| c.get(0))
                            .map_or("", |m| m.as_str())
                            .trim()
                            .to_string()
                    })
                })
                .flatten();
                graded(got, answer.trim().to_string(), *format_score)
            }
            Reward::Format { pattern, score } => {
                let anchored = format!("^(?:{pattern})$");
                match with_regex(&anchored, |re| re.is_match(response.trim())) {
                    Some(true) => *score,
                    _ => 0.0,
                }
            }
            Reward::Python { .. } => 0.0,
        }
    }
}

/// Runs `f` with `pattern` compiled (once per thread); `None` when it does not compile
/// (workflows validate patterns before running, see [`Reward::validate`]).
fn with_regex<T>(pattern: &str, f: impl FnOnce(&regex::Regex) -> T) -> Option<T> {
    use std::cell::RefCell;
    use std::collections::HashMap;
    thread_local! {
        static CACHE: RefCell<HashMap<String, regex::Regex>> = RefCell::new(HashMap::new());
    }
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if !c.contains_key(pattern) {
            let re = regex::Regex::new(pattern).ok()?;
            c.insert(pattern.to_string(), re);
        }
        c.get(pattern).map(f)
    })
}

/// The number after the last `#### `, normalised.
fn last_hash_answer(text: &str) -> Option<String> {
    let (_, tail) = text.rsplit_once("####")?;
    let token: String = tail
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '-' | '.' | ',' | '$'))
        .collect();
    let n = normalize_number(&token);
    (!n.is_empty() && n != "-").then_some(n)
}

/// Drops `,` and `$`, a trailing `.`, and a fractional part of zeros (`72.00` → `72`).
fn normalize_number(s: &str) -> String {
    let mut n: String = s
        .trim()
        .chars()
        .filter(|c| !matches!(c, ',' | '$'))
        .collect();
    while n.ends_with('.') {
        n.pop();
    }
    if let Some((int, frac)) = n.split_once('.')
        && frac.chars().all(|c| c == '0')
    {
        n = int.to_string();
    }
    n
}

/// The content of the last `\boxed{...}` (or `\fbox{...}`), braces balanced.
fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    let open = start + text[start..].find('{')?;
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[open + 1..open + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// A subset of VeRL's `strip_string`: what makes two renderings of one answer differ.
fn normalize_math(s: &str) -> String {
    let mut t = s.replace("\\left", "").replace("\\right", "");
    for (from, to) in [
        ("\\!", ""),
        ("\\$", ""),
        ("$", ""),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\%", ""),
        ("dfrac", "frac"),
        ("tfrac", "frac"),
        (" .", " 0."),
        ("{.", "{0."),
    ] {
        t = t.replace(from, to);
    }
    let mut t: String = t.chars().filter(|c| !c.is_whitespace()).collect();
    if let Some(rest) = t.strip_prefix("x=").or_else(|| t.strip_prefix("y=")) {
        t = rest.to_string();
    }
    while t.ends_with('.') {
        t.pop();
    }
    if t.starts_with('.') {
        t.insert(0, '0');
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_match() {
        assert_eq!(Reward::ExactMatch.score(" 82", "82"), 1.0);
        assert_eq!(Reward::ExactMatch.score("820", "82"), 0.0);
    }

    #[test]
    fn gsm8k_reads_the_last_hash_answer() {
        let r = Reward::Gsm8k { format_score: 0.1 };
        let answer = "Natalia sold 48/2 = 24 clips in May.\n#### 72";
        assert_eq!(r.score("so 48 + 24 = 72\n#### 72", answer), 1.0);
        assert_eq!(r.score("#### 1,000", "#### 1000"), 1.0);
        assert_eq!(r.score("#### $72.00", "72"), 1.0);
        assert_eq!(r.score("#### 12 then #### 72.", answer), 1.0);
        assert_eq!(r.score("#### 71", answer), 0.1);
        assert_eq!(r.score("the answer is 72", answer), 0.0);
        assert_eq!(r.score("#### -3", "#### -3"), 1.0);
    }

    #[test]
    fn math_compares_the_last_box_normalised() {
        let r = Reward::Math { format_score: 0.0 };
        assert_eq!(r.score("so \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}"), 1.0);
        assert_eq!(r.score("\\boxed{x = 5}", "The answer is $\\boxed{5}$"), 1.0);
        assert_eq!(r.score("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"), 1.0);
        assert_eq!(r.score("\\boxed{1} then \\boxed{3}", "3"), 1.0);
        assert_eq!(r.score("\\boxed{90^\\circ}", "90"), 1.0);
        assert_eq!(r.score("\\boxed{4}", "5"), 0.0);
        assert_eq!(r.score("no box: 5", "5"), 0.0);
        assert_eq!(r.score("\\boxed{5", "5"), 0.0, "unbalanced braces");
    }

    #[test]
    fn regex_and_format() {
        let r = Reward::Regex {
            pattern: r"answer:\s*(-?\d+)".into(),
            format_score: 0.2,
        };
        assert_eq!(r.score("work... answer: 42", "42"), 1.0);
        assert_eq!(r.score("answer: 41", "42"), 0.2);
        assert_eq!(r.score("42", "42"), 0.0);
        let f = Reward::Format {
            pattern: r"<think>.*</think>\d+".into(),
            score: 0.5,
        };
        assert_eq!(f.score("<think>hm</think>7", ""), 0.5);
        assert_eq!(f.score("7 <think>hm</think>7", ""), 0.0);
        assert!(
            Reward::Format {
                pattern: "(".into(),
                score: 1.0
            }
            .validate()
            .unwrap_err()
            .contains("`(`")
        );
    }

    #[test]
    fn rewards_read_from_yaml_names() {
        let r: Reward = serde_json::from_str(r#"{"type":"gsm8k","format_score":0.1}"#).unwrap();
        assert_eq!(r, Reward::Gsm8k { format_score: 0.1 });
        let r: Reward = serde_json::from_str(r#"{"type":"exact_match"}"#).unwrap();
        assert_eq!(r, Reward::ExactMatch);
    }
}
