//! Python rewards as VeRL writes them: `compute_score(data_source, solution_str, ground_truth,
//! extra_info)` from a user's file, called unchanged in a pool of long-lived worker processes
//! (each imports the file once), with a deadline per call and an address-space limit per worker.
//!
//! Owns: the workers (started on first use, restarted after a timeout or a crash), the line
//! protocol with them, and telling a sample that failed from a reward that cannot work. Never:
//! decides what a failed sample scores (the [`super::Scorer`] does) or installs packages (the
//! reward runs on the `python` the workflow names, with whatever it has).

use super::{Item, RewardError};
use serde_json::{Value, json};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// The worker: imports the function, says `ready` (or sends the import's traceback), then
/// answers one JSON line per request. The user's prints go to stderr so they cannot break the
/// protocol on stdout.
const DRIVER: &str = r#"
import importlib.util, json, math, os, sys, traceback
proto, sys.stdout = sys.stdout, sys.stderr
path, name = sys.argv[1], sys.argv[2]
def say(obj):
    proto.write(json.dumps(obj) + "\n")
    proto.flush()
try:
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location("trellis_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"`{name}` in {path} is not a function")
except BaseException:
    say({"error": traceback.format_exc()})
    sys.exit(1)
say({"ready": True})
for line in sys.stdin:
    req = json.loads(line)
    try:
        r = fn(req["data_source"], req["solution_str"], req["ground_truth"], req["extra_info"])
        if isinstance(r, dict):
            r = r["score"]
        r = float(r)
        if not math.isfinite(r):
            raise ValueError(f"the reward is {r}")
        say({"score": r})
    except BaseException:
        say({"error": traceback.format_exc()})
"#;

/// Where a Python reward lives and how it runs.
#[derive(Clone, Debug, PartialEq)]
pub struct PythonSpec {
    /// The interpreter (`python3`, or a venv's `bin/python` with the reward's packages).
    pub python: PathBuf,
    /// The file defining the function.
    pub path: PathBuf,
    /// The function's name.
    pub function: String,
    /// Worker processes.
    pub workers: usize,
    /// Deadline of one call.
    pub timeout: Duration,
    /// Address-space limit of a worker, in bytes.
    pub memory_bytes: u64,
    /// What `data_source` the function gets.
    pub data_source: Option<String>,
}

/// One sample's result: its score, or why it has none (a traceback, a timeout, a crash).
pub type Outcome = Result<f32, String>;

/// A started worker.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Worker {
    fn start(spec: &PythonSpec) -> Result<Worker, RewardError> {
        let mut cmd = Command::new(&spec.python);
        cmd.args(["-u", "-c", DRIVER])
            .arg(&spec.path)
            .arg(&spec.function)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        super::limit_address_space(&mut cmd, spec.memory_bytes);
        let mut child = cmd.spawn().map_err(|e| RewardError::Start {
            python: spec.python.clone(),
            message: e.to_string(),
        })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(RewardError::Start {
                python: spec.python.clone(),
                message: "no pipes to the worker".into(),
            });
        };
        let lines = match super::read_lines(stdout, "reward-worker-reader") {
            Ok(lines) => lines,
            Err(e) => {
                // Not left running without anyone reading it.
                let _ = child.kill();
                let _ = child.wait();
                return Err(RewardError::Start {
                    python: spec.python.clone(),
                    message: e.to_string(),
                });
            }
        };
        let mut w = Worker {
            child,
            stdin,
            lines,
        };
        // Importing the user's module may take a while (numpy, sympy): a generous deadline.
        match w
            .lines
            .recv_timeout(spec.timeout.max(Duration::from_secs(60)))
        {
            Ok(line) => match serde_json::from_str::<Value>(&line) {
                Ok(v) if v["ready"] == true => Ok(w),
                Ok(v) => Err(RewardError::Import {
                    path: spec.path.clone(),
                    traceback: v["error"].as_str().unwrap_or(&line).to_string(),
                }),
                Err(_) => Err(RewardError::Import {
                    path: spec.path.clone(),
                    traceback: line,
                }),
            },
            Err(_) => {
                let status = w.stop();
                Err(RewardError::Import {
                    path: spec.path.clone(),
                    traceback: format!("the worker ended before it was ready ({status})"),
                })
            }
        }
    }

    /// One call: the score, or why there is none; `Err` also when the worker must be replaced.
    fn call(&mut self, request: &Value, timeout: Duration) -> (Outcome, bool) {
        let mut line = request.to_string();
        line.push('\n');
        if let Err(e) = self
            .stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
        {
            let status = self.stop();
            return (Err(format!("the worker is gone ({e}; {status})")), true);
        }
        match self.lines.recv_timeout(timeout) {
            Ok(answer) => match serde_json::from_str::<Value>(&answer) {
                Ok(v) => match (v["score"].as_f64(), v["error"].as_str()) {
                    (Some(s), _) => (Ok(s as f32), false),
                    (None, Some(tb)) => (Err(tb.to_string()), false),
                    _ => (Err(format!("the worker answered {answer}")), false),
                },
                Err(_) => (Err(format!("the worker answered {answer}")), false),
            },
            Err(RecvTimeoutError::Timeout) => {
                self.stop();
                (Err(format!("no score within {timeout:.0?}")), true)
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.stop();
                (
                    Err(format!(
                        "the worker died ({status}; past its memory limit?)"
                    )),
                    true,
                )
            }
        }
    }

    /// Kills the worker and says how it ended.
    fn stop(&mut self) -> String {
        let _ = self.child.kill();
        match self.child.wait() {
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The workers of one reward, started on first use.
pub struct PythonPool {
    spec: PythonSpec,
    workers: Vec<Mutex<Option<Worker>>>,
}

impl std::fmt::Debug for PythonPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PythonPool")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl PythonPool {
    /// A pool of `spec.workers` workers (none started yet).
    pub fn new(spec: PythonSpec) -> Self {
        let workers = (0..spec.workers.max(1)).map(|_| Mutex::new(None)).collect();
        Self { spec, workers }
    }

    /// The reward's spec.
    pub fn spec(&self) -> &PythonSpec {
        &self.spec
    }

    /// Checks that the function imports, in a worker that then ends.
    pub fn check(spec: &PythonSpec) -> Result<(), RewardError> {
        if !spec.path.is_file() {
            return Err(RewardError::Import {
                path: spec.path.clone(),
                traceback: "no such file".into(),
            });
        }
        Worker::start(spec).map(drop)
    }

    /// Scores responses on every worker at once, in order. A sample whose call
    /// raised, timed out or crashed its worker gets its reason; a worker that cannot start
    /// again is an error.
    pub fn score(&self, items: &[Item<'_>]) -> Result<Vec<Outcome>, RewardError> {
        let next = AtomicUsize::new(0);
        let results: Vec<Mutex<Option<Outcome>>> = items.iter().map(|_| Mutex::new(None)).collect();
        let failure: Mutex<Option<RewardError>> = Mutex::new(None);
        std::thread::scope(|s| {
            for slot in &self.workers {
                s.spawn(|| {
                    let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return;
                        };
                        if guard.is_none() {
                            match Worker::start(&self.spec) {
                                Ok(w) => *guard = Some(w),
                                Err(e) => {
                                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                                    return;
                                }
                            }
                        }
                        let extra_info = item
                            .extra_info
                            .and_then(|t| serde_json::from_str::<Value>(t).ok())
                            .unwrap_or(Value::Null);
                        let request = json!({
                            "data_source": item.data_source.or(self.spec.data_source.as_deref()),
                            "solution_str": item.response,
                            "ground_truth": item.answer,
                            "extra_info": extra_info,
                        });
                        let Some(worker) = guard.as_mut() else { return };
                        let (outcome, replace) = worker.call(&request, self.spec.timeout);
                        if replace {
                            *guard = None;
                        }
                        *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
                    }
                });
            }
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        results
            .into_iter()
            .map(|r| {
                r.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .ok_or_else(|| RewardError::Internal("a sample was not scored".into()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Item, Reward, RewardError, Scorer};
    use std::path::{Path, PathBuf};

    /// A reward in VeRL's style with ways to misbehave on request.
    const REWARD: &str = r#"
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    print("rewards may print; the protocol does not mind")
    if solution_str == "raise":
        raise ValueError("a broken sample")
    if solution_str == "sleep":
        time.sleep(30)
    if solution_str == "hog":
        hog = bytearray(8 << 30)
    if solution_str == "dict":
        return {"score": 0.25, "acc": True}
    if solution_str == "pid":
        return float(os.getpid())
    if solution_str == "source":
        return 1.0 if data_source == "openai/gsm8k" and extra_info is None else 0.0
    if solution_str == "row":
        return 1.0 if data_source == "lighteval/MATH" and extra_info["index"] == 7 else 0.0
    return 1.0 if solution_str.strip() == ground_truth else 0.0
"#;

    fn file(tag: &str, text: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("trellis-pyreward-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("reward.py");
        std::fs::write(&f, text).unwrap();
        f
    }

    fn plain<'a>(pairs: &[(&'a str, &'a str)]) -> Vec<Item<'a>> {
        pairs.iter().map(|&(r, a)| Item::plain(r, a)).collect()
    }

    fn reward(path: &Path, workers: usize) -> Reward {
        Reward::Python {
            path: path.to_path_buf(),
            function: "compute_score".into(),
            python: "python3".into(),
            workers,
            timeout_s: 2.0,
            memory_mb: 1024,
            data_source: Some("openai/gsm8k".into()),
        }
    }

    #[test]
    fn samples_score_fail_alone_and_workers_come_back() {
        let f = file("ok", REWARD);
        let scorer = Scorer::open(reward(&f, 2)).unwrap();
        // (response, answer, score, failed)
        let cases = [
            ("72", "72", 1.0, false),
            (" 72 ", "72", 1.0, false),
            ("71", "72", 0.0, false),
            ("dict", "x", 0.25, false),
            ("source", "x", 1.0, false),
            ("raise", "x", 0.0, true),
            ("sleep", "x", 0.0, true),
            ("hog", "x", 0.0, true),
        ];
        let mut items: Vec<Item<'_>> = cases.iter().map(|c| Item::plain(c.0, c.1)).collect();
        // A row's own data_source and extra_info reach the function (the setting stands in
        // only when the row has none).
        items.push(Item {
            data_source: Some("lighteval/MATH"),
            extra_info: Some(r#"{"index": 7, "split": "test"}"#),
            ..Item::plain("row", "x")
        });
        let got = scorer.score_all(&items).unwrap();
        let mut want: Vec<f32> = cases.iter().map(|c| c.2).collect();
        want.push(1.0);
        assert_eq!(got.scores, want);
        assert_eq!(got.failed, cases.iter().filter(|c| c.3).count());
        // The timed-out and crashed workers were replaced: the next batch scores.
        let again = scorer
            .score_all(&plain(&[("72", "72"), ("1", "2")]))
            .unwrap();
        assert_eq!(again.scores, [1.0, 0.0]);
        std::fs::remove_dir_all(f.parent().unwrap()).unwrap();
    }

    #[test]
    fn workers_live_across_batches() {
        let f = file("pid", REWARD);
        let scorer = Scorer::open(reward(&f, 1)).unwrap();
        let a = scorer.score_all(&plain(&[("pid", "")])).unwrap().scores;
        let b = scorer
            .score_all(&plain(&[("pid", ""), ("pid", "")]))
            .unwrap()
            .scores;
        assert_eq!(
            [a[0], a[0]],
            [b[0], b[1]],
            "one process imported the file once"
        );
        std::fs::remove_dir_all(f.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_reward_that_cannot_work_says_why_with_its_traceback() {
        let broken = file("bad", REWARD);
        let scorer = Scorer::open(reward(&broken, 2)).unwrap();
        let e = scorer
            .score_all(&plain(&[("raise", "1"), ("raise", "2")]))
            .unwrap_err();
        assert!(matches!(e, RewardError::AllFailed { count: 2, .. }), "{e}");
        assert!(e.to_string().contains("ValueError: a broken sample"), "{e}");
        // Nothing to import, a syntax error, a missing function: refused when opened.
        let cases = [
            ("def compute_score(:\n", "SyntaxError"),
            ("def other(a, b, c, d):\n    return 1\n", "AttributeError"),
            ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
        ];
        for (text, want) in cases {
            let f = file("import", text);
            let e = Scorer::open(reward(&f, 1)).unwrap_err();
            assert!(e.contains(want) && e.contains("does not load"), "{e}");
        }
        let e = Scorer::open(reward(Path::new("/no/such/reward.py"), 1)).unwrap_err();
        assert!(
            e.contains("/no/such/reward.py") && e.contains("no such file"),
            "{e}"
        );
        let mut r = reward(&broken, 1);
        if let Reward::Python { python, .. } = &mut r {
            *python = "/no/such/python3".into();
        }
        let e = Scorer::open(r).unwrap_err();
        assert!(e.contains("cannot start `/no/such/python3`"), "{e}");
        let imports = file("import", "");
        std::fs::remove_dir_all(imports.parent().unwrap()).unwrap();
        std::fs::remove_dir_all(broken.parent().unwrap()).unwrap();
    }
}
