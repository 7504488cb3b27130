//! An environment of one's own: a program (any language) started for every episode, speaking
//! JSON lines on its standard input and output.
//!
//! Trellis writes `{"op": "reset", "prompt": …, "answer": …}` and then, for every model turn,
//! `{"op": "step", "text": …}`; the program answers each with one line: `{"ok": true}` to the
//! reset, and `{"observation": TEXT or null, "reward": R, "done": B, "role": "tool" | "user",
//! "tool": "ok" | "error" | null}` to a step (`role` default `user`, `reward` 0, `done` false), or
//! `{"error": …}`. Its standard error is discarded (the protocol owns stdout). It runs under an
//! address-space limit; a program that does not answer within the step timeout, dies or answers
//! something else fails its episode only, and is killed.
//!
//! Programs are workers in a pool: one that played an episode without failing waits, idle, for
//! the next reset of the same program (a process start — Python's, tens of milliseconds and more
//! with heavy imports — per episode is what this saves). A reset may come at any time: an episode
//! can end without `done` when its turns or tokens run out. An idle worker that has died is
//! replaced; idle workers end with the process that started them (their standard input closes).

use super::{EnvError, Environment, Observation, Step, ToolUse};
use crate::task::Problem;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// Which program, and how it runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CommandEnv {
    /// Its name (metrics: `env/<name>/failed`).
    pub name: String,
    /// The program and its arguments.
    pub argv: Vec<String>,
    /// Where it runs (the workflow file's folder).
    pub dir: Option<PathBuf>,
    /// Its address-space limit, in bytes.
    pub memory_bytes: u64,
}

/// An agent program: started once per episode, it plays it through the agent gateway
/// ([`crate::episode::gateway`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentProgram {
    /// The program, where it runs, its name (`env/<name>/failed`) and its memory limit.
    pub program: CommandEnv,
    /// Its last line of output is the episode's reward (a number, or `{"reward": R}`); when
    /// false, the stage's reward scores the transcript and the program's output is not read.
    pub printed_reward: bool,
}

/// One episode's program.
pub(super) struct Command {
    spec: CommandEnv,
    timeout: Duration,
    proc: Option<Proc>,
}

struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Alive, and with nothing unread from it (an idle worker worth a reset).
    fn ready(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
            && matches!(
                self.lines.try_recv(),
                Err(std::sync::mpsc::TryRecvError::Empty)
            )
    }
}

/// Idle workers at most, all programs together (more are ended).
const MAX_IDLE: usize = 256;

/// The idle workers, by program.
static IDLE: std::sync::Mutex<Vec<(CommandEnv, Proc)>> = std::sync::Mutex::new(Vec::new());

/// An idle worker of `spec` ready for a reset, if there is one (dead ones are ended).
fn take_idle(spec: &CommandEnv) -> Option<Proc> {
    let mut idle = IDLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    while let Some(i) = idle.iter().rposition(|(s, _)| s == spec) {
        let (_, mut p) = idle.swap_remove(i);
        if p.ready() {
            return Some(p);
        }
    }
    None
}

/// `proc`, healthy after an episode of `spec`, waits for the next one.
fn give_back(spec: CommandEnv, proc: Proc) {
    let mut idle = IDLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if idle.len() < MAX_IDLE {
        idle.push((spec, proc));
    }
}

impl Command {
    pub(super) fn new(spec: CommandEnv, timeout: Duration) -> Self {
        Self {
            spec,
            timeout,
            proc: None,
        }
    }

    fn error(&self, msg: impl Into<String>) -> EnvError {
        EnvError {
            env: self.spec.name.clone(),
            msg: msg.into(),
        }
    }

    fn start(&self) -> Result<Proc, EnvError> {
        let (program, args) = self
            .spec
            .argv
            .split_first()
            .ok_or_else(|| self.error("the command is empty"))?;
        let mut cmd = std::process::Command::new(program);
        cmd.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(dir) = &self.spec.dir {
            cmd.current_dir(dir);
        }
        crate::reward::limit_address_space(&mut cmd, self.spec.memory_bytes);
        let mut child = cmd
            .spawn()
            .map_err(|e| self.error(format!("cannot start `{program}`: {e}")))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(self.error("no pipes to the program"));
        };
        let lines = match crate::reward::read_lines(stdout, "env-reader") {
            Ok(lines) => lines,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(self.error(format!("cannot read the program: {e}")));
            }
        };
        let proc = Proc {
            child,
            stdin,
            lines,
        };
        Ok(proc)
    }

    /// Sends `msg` and waits for the answer (within the step timeout); a failure kills it.
    fn call(&mut self, msg: &Value) -> Result<Value, EnvError> {
        let timeout = self.timeout;
        let Some(p) = self.proc.as_mut() else {
            return Err(self.error("the episode was not reset"));
        };
        let mut line = msg.to_string();
        line.push('\n');
        let sent = p
            .stdin
            .write_all(line.as_bytes())
            .and_then(|()| p.stdin.flush());
        let answer = match sent {
            Err(e) => Err(format!("the program is gone ({e})")),
            Ok(()) => match p.lines.recv_timeout(timeout) {
                Ok(a) => Ok(a),
                Err(RecvTimeoutError::Timeout) => {
                    Err(format!("no answer within {:.1} s", timeout.as_secs_f64()))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = p
                        .child
                        .wait()
                        .map_or_else(|e| e.to_string(), |s| s.to_string());
                    Err(format!("the program ended ({status})"))
                }
            },
        };
        let answer = answer.map_err(|m| {
            self.proc = None;
            self.error(m)
        })?;
        let v: Value = serde_json::from_str(&answer)
            .map_err(|_| self.error(format!("answered {answer:?}, not a JSON object")))?;
        if let Some(e) = v.get("error") {
            let e = e.as_str().map_or_else(|| e.to_string(), str::to_string);
            return Err(self.error(format!("says: {e}")));
        }
        Ok(v)
    }
}

impl Drop for Command {
    fn drop(&mut self) {
        // A worker that did not fail (a failure ended it) plays the next episode.
        if let Some(p) = self.proc.take() {
            give_back(self.spec.clone(), p);
        }
    }
}

impl Environment for Command {
    fn reset(&mut self, problem: &Problem) -> Result<(), EnvError> {
        let reset = json!({
            "op": "reset",
            "prompt": problem.prompt.display(),
            "answer": problem.answer,
        });
        let pooled = self.proc.take().or_else(|| take_idle(&self.spec));
        if let Some(p) = pooled {
            self.proc = Some(p);
            if self.call(&reset).is_ok() {
                return Ok(());
            }
            // A worker that cannot take the reset is ended; a fresh one gets it.
            self.proc = None;
        }
        self.proc = Some(self.start()?);
        self.call(&reset).map(drop)
    }

    fn step(&mut self, text: &str) -> Result<Step, EnvError> {
        let v = self.call(&json!({"op": "step", "text": text}))?;
        let bad = |what: &str| self.error(format!("answered {v} ({what})"));
        let reward = match v.get("reward") {
            None | Some(Value::Null) => 0.0,
            Some(r) => {
                r.as_f64()
                    .filter(|r| r.is_finite())
                    .ok_or_else(|| bad("`reward` is not a finite number"))? as f32
            }
        };
        let done = match v.get("done") {
            None | Some(Value::Null) => false,
            Some(d) => d
                .as_bool()
                .ok_or_else(|| bad("`done` is not true or false"))?,
        };
        let observation = match v.get("observation") {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) => Some(match v.get("role").and_then(Value::as_str) {
                Some("tool") => Observation::Tool(text.clone()),
                None | Some("user") => Observation::Reply(text.clone()),
                Some(_) => return Err(bad("`role` is neither \"tool\" nor \"user\"")),
            }),
            Some(_) => return Err(bad("`observation` is not text")),
        };
        if !done && observation.is_none() {
            return Err(bad("not done, and no observation"));
        }
        let tool = match v.get("tool").and_then(Value::as_str) {
            Some("ok") => ToolUse::Ok,
            Some("error") => ToolUse::Error,
            _ => ToolUse::None,
        };
        if done && let Some(p) = self.proc.take() {
            give_back(self.spec.clone(), p);
        }
        Ok(Step {
            observation,
            reward,
            done,
            tool,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(name: &str, script: &str) -> Command {
        Command::new(
            CommandEnv {
                name: name.into(),
                argv: vec!["sh".into(), "-c".into(), script.into()],
                dir: None,
                memory_bytes: 1 << 30,
            },
            Duration::from_millis(500),
        )
    }

    #[test]
    fn a_program_steps_an_episode_over_json_lines() {
        // Answers the reset, then one tool result, then done with reward 1.
        let mut env = sh(
            "echo",
            r#"read r; echo '{"ok": true}'; read s; echo '{"observation": "4", "role": "tool", "tool": "ok"}'; read s; echo '{"reward": 1, "done": true}'"#,
        );
        env.reset(&Problem::new("2+2=", "4")).unwrap();
        let s = env.step("<call>2+2</call>").unwrap();
        assert_eq!(s.observation, Some(Observation::Tool("4".into())));
        assert_eq!((s.tool, s.done), (ToolUse::Ok, false));
        let s = env.step("4").unwrap();
        assert_eq!((s.reward, s.done, s.observation), (1.0, true, None));
    }

    #[test]
    fn a_worker_plays_episode_after_episode_and_a_failed_one_is_replaced() {
        // Each step is done, its reward the worker's process id.
        let script = r#"while read l; do case "$l" in *reset*) echo '{"ok": true}';; *die*) exit 1;; *) echo "{\"reward\": $$, \"done\": true}";; esac; done"#;
        let play = |text: &str| {
            let mut env = sh("pool", script);
            env.reset(&Problem::new("q", "a"))?;
            env.step(text).map(|s| s.reward)
        };
        let first = play("x").unwrap();
        assert_eq!(play("x").unwrap(), first, "the same worker");
        // An episode that ends without `done` gives its worker back too.
        let mut env = sh("pool", script);
        env.reset(&Problem::new("q", "a")).unwrap();
        drop(env);
        assert_eq!(play("x").unwrap(), first);
        // A worker that dies fails its episode and is not reused.
        assert!(play("die").is_err());
        let next = play("x").unwrap();
        assert_ne!(next, first);
        assert_eq!(play("x").unwrap(), next);
    }

    #[test]
    fn a_program_that_fails_says_how() {
        let cases = [
            ("read r; exit 3", "the program ended (exit status: 3)"),
            ("read r; sleep 5", "no answer within 0.5 s"),
            (
                "read r; echo nonsense",
                "answered \"nonsense\", not a JSON object",
            ),
            (
                "read r; echo '{\"error\": \"no such task\"}'",
                "says: no such task",
            ),
        ];
        for (script, want) in cases {
            let e = sh("bad", script)
                .reset(&Problem::new("q", "a"))
                .unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("environment `bad`: {want}"),
                "{script}"
            );
        }
        let mut env = sh(
            "odd",
            r#"read r; echo '{}'; read s; echo '{"reward": "high"}'"#,
        );
        env.reset(&Problem::new("q", "a")).unwrap();
        assert!(
            env.step("x")
                .unwrap_err()
                .to_string()
                .contains("`reward` is not a finite number")
        );
        let e = sh("none", "").reset(&Problem::new("q", "a"));
        assert!(e.is_err());
        let e = Command::new(
            CommandEnv {
                name: "missing".into(),
                argv: vec!["/no/such/program".into()],
                dir: None,
                memory_bytes: 1 << 30,
            },
            Duration::from_secs(1),
        )
        .reset(&Problem::new("q", "a"))
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("environment `missing`: cannot start `/no/such/program`"),
            "{e}"
        );
    }
}
