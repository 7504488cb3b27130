//! Tool calls read from a model's turn, and the built-in tools: `calculator`, and `python` (a
//! sandboxed interpreter: a process of its own with a deadline, a memory limit and no network).
//!
//! Formats: `hermes` — Qwen's and Hermes' `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
//! (what their chat templates teach), also Llama 3's bare `{"name": …, "parameters": {…}}` turn;
//! `compact` — `<call>EXPRESSION</call>`, a calculator call in the `builtin:tools` tokenizer's
//! own tokens, answered `<result>VALUE</result>`.

use serde::{Deserialize, Serialize};
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How tool calls are written in a model's turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolFormat {
    /// `<call>EXPRESSION</call>` (the calculator), results as `<result>VALUE</result>`.
    Compact,
    /// `<tool_call>{json}</tool_call>`, or a turn that is one JSON call (Llama 3).
    Hermes,
}

/// The compact format's tokens.
pub const CALL: &str = "<call>";
/// The end of a compact call: a turn stops there.
pub const CALL_END: &str = "</call>";
/// Around a compact tool result.
pub const RESULT: (&str, &str) = ("<result>", "</result>");

/// A parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// The tool's name.
    pub name: String,
    /// Its arguments (the compact format's are `{"expression": …}`).
    pub arguments: serde_json::Value,
}

/// The call in `text`: `None` when the turn calls no tool, `Some(Err(why))` for a malformed one
/// (an observation says so; never a crash).
pub fn parse(text: &str, format: ToolFormat) -> Option<Result<Call, String>> {
    match format {
        ToolFormat::Compact => {
            let start = text.find(CALL)? + CALL.len();
            let Some(len) = text[start..].find(CALL_END) else {
                return Some(Err(format!("a call without {CALL_END}")));
            };
            Some(Ok(Call {
                name: "calculator".into(),
                arguments: serde_json::json!({"expression": text[start..start + len].trim()}),
            }))
        }
        ToolFormat::Hermes => {
            let json = match text.find("<tool_call>") {
                Some(i) => {
                    let body = &text[i + "<tool_call>".len()..];
                    match body.find("</tool_call>") {
                        Some(j) => body[..j].trim(),
                        None => return Some(Err("a <tool_call> without </tool_call>".into())),
                    }
                }
                // Llama 3: the whole turn is one JSON object naming a tool.
                None => {
                    let t = text.trim();
                    if !(t.starts_with('{') && t.contains("\"name\"")) {
                        return None;
                    }
                    t
                }
            };
            Some(call_of_json(json))
        }
    }
}

/// A Hermes-format turn split as vLLM's `hermes` tool parser splits it: the text before the
/// first `<tool_call>` (trimmed), and every well-formed `<tool_call>{json}</tool_call>` in it.
/// A turn with a malformed call is all text (no calls), so nothing the model wrote is lost.
pub fn split_hermes(text: &str) -> (String, Vec<Call>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let Some(first) = text.find(OPEN) else {
        return (text.to_string(), Vec::new());
    };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(i) = rest.find(OPEN) {
        let body = &rest[i + OPEN.len()..];
        let Some(j) = body.find(CLOSE) else {
            return (text.to_string(), Vec::new());
        };
        match call_of_json(body[..j].trim()) {
            Ok(c) => calls.push(c),
            Err(_) => return (text.to_string(), Vec::new()),
        }
        rest = &body[j + CLOSE.len()..];
    }
    (text[..first].trim().to_string(), calls)
}

fn call_of_json(json: &str) -> Result<Call, String> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("the call is not JSON: {e}"))?;
    let name = v
        .get("name")
        .and_then(|n| n.as_str())
        .ok_or("the call has no \"name\"")?;
    let arguments = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(serde_json::Value::Object(Default::default()));
    // Some models write the arguments as a JSON string.
    let arguments = match arguments {
        serde_json::Value::String(s) => serde_json::from_str(&s)
            .map_err(|e| format!("the arguments are not a JSON object: {e}"))?,
        a => a,
    };
    Ok(Call {
        name: name.to_string(),
        arguments,
    })
}

/// The calculator: `arguments.expression`, whole numbers with `+ - *`, `/` (exact division
/// only) and parentheses.
pub fn calculate(arguments: &serde_json::Value) -> Result<i64, String> {
    let e = arguments
        .get("expression")
        .and_then(|e| e.as_str())
        .ok_or("calculator: no \"expression\" argument")?;
    let mut p = Parser {
        s: e.as_bytes(),
        i: 0,
    };
    let v = p.sum()?;
    p.space();
    if p.i != p.s.len() {
        return Err(format!("calculator: cannot read {e:?} past byte {}", p.i));
    }
    Ok(v)
}

/// How the `python` tool runs a call's code.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sandbox {
    /// Wall-clock limit.
    pub timeout: Duration,
    /// Address-space limit, in bytes.
    pub memory_bytes: u64,
}

/// What the `python` tool prints of a call at most, in bytes.
const PYTHON_OUTPUT: usize = 2000;

/// The `python` tool: `arguments.code` run by `python3 -I` (isolated: no user site, no
/// environment variables) in a fresh folder, without network (a network namespace of its own,
/// refused where none can be made), under `sandbox`'s limits. What it printed (standard output,
/// then standard error), or why it failed.
pub fn python(arguments: &serde_json::Value, sandbox: Sandbox) -> Result<String, String> {
    let code = arguments
        .get("code")
        .and_then(|c| c.as_str())
        .ok_or("python: no \"code\" argument")?;
    let dir = std::env::temp_dir().join(format!(
        "trellis-python-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("python: {e}"))?;
    let out = run_sandboxed(code, &dir, sandbox);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn run_sandboxed(code: &str, dir: &std::path::Path, sandbox: Sandbox) -> Result<String, String> {
    let mut cmd = Command::new("python3");
    cmd.args(["-I", "-c", code])
        .current_dir(dir)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    crate::reward::limit_address_space(&mut cmd, sandbox.memory_bytes);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec only async-signal-safe calls (unshare) are made.
        unsafe {
            cmd.pre_exec(|| {
                // A network namespace of its own: only a loopback interface, down. Privileged
                // hosts make one directly, others inside a user namespace.
                if libc::unshare(libc::CLONE_NEWNET) == 0
                    || libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) == 0
                {
                    return Ok(());
                }
                Err(std::io::Error::last_os_error())
            });
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("python: cannot start python3 without network access ({e})"))?;
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    let out = std::thread::spawn(move || read_capped(stdout));
    let err = std::thread::spawn(move || read_capped(stderr));
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if start.elapsed() < sandbox.timeout => {
                std::thread::sleep(Duration::from_millis(5));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "python: the code ran past {:.1} s",
                    sandbox.timeout.as_secs_f64()
                ));
            }
        }
    };
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    let (out, err) = (
        text(out.join().unwrap_or_default()),
        text(err.join().unwrap_or_default()),
    );
    let mut all = out;
    if !err.is_empty() {
        all.push_str(&err);
    }
    if all.len() > PYTHON_OUTPUT {
        let mut cut = PYTHON_OUTPUT;
        while !all.is_char_boundary(cut) {
            cut -= 1;
        }
        all.truncate(cut);
        all.push('…');
    }
    if status.success() {
        Ok(all.trim_end().to_string())
    } else {
        Err(format!("python: {status}\n{}", all.trim_end()))
    }
}

/// What `pipe` gives, up to a few times what the tool shows (the rest is left unread: a
/// process that prints without end is stopped by its deadline).
fn read_capped(pipe: Option<impl Read>) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Some(p) = pipe {
        let _ = p.take(PYTHON_OUTPUT as u64 * 4).read_to_end(&mut buf);
    }
    buf
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn space(&mut self) {
        while self.s.get(self.i) == Some(&b' ') {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.s.get(self.i).copied()
    }

    fn sum(&mut self) -> Result<i64, String> {
        let mut v = self.product()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.i += 1;
            let r = self.product()?;
            v = if op == b'+' {
                v.checked_add(r)
            } else {
                v.checked_sub(r)
            }
            .ok_or("calculator: overflow")?;
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<i64, String> {
        let mut v = self.atom()?;
        while let Some(op @ (b'*' | b'/')) = self.peek() {
            self.i += 1;
            let r = self.atom()?;
            v = if op == b'*' {
                v.checked_mul(r).ok_or("calculator: overflow")?
            } else if r == 0 || v % r != 0 {
                return Err(format!("calculator: {v}/{r} is not a whole number"));
            } else {
                v / r
            };
        }
        Ok(v)
    }

    fn atom(&mut self) -> Result<i64, String> {
        match self.peek() {
            Some(b'(') => {
                self.i += 1;
                let v = self.sum()?;
                if self.peek() != Some(b')') {
                    return Err("calculator: a `(` without `)`".into());
                }
                self.i += 1;
                Ok(v)
            }
            Some(b'-') => {
                self.i += 1;
                Ok(-self.atom()?)
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[start..self.i])
                    .ok()
                    .and_then(|t| t.parse().ok())
                    .ok_or_else(|| "calculator: a number out of range".into())
            }
            Some(c) => Err(format!(
                "calculator: unexpected {:?} at byte {}",
                c as char, self.i
            )),
            None => Err("calculator: the expression ends too soon".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_calculator_evaluates_or_says_why_not() {
        for (e, want) in [
            ("123*456", Ok(56088)),
            ("2+3*4", Ok(14)),
            ("(2+3)*4", Ok(20)),
            (" 10 - -3 ", Ok(13)),
            ("8/2/2", Ok(2)),
            ("7/2", Err("calculator: 7/2 is not a whole number")),
            ("1+", Err("calculator: the expression ends too soon")),
            ("(1", Err("calculator: a `(` without `)`")),
            ("2 x", Err("calculator: cannot read \"2 x\" past byte 2")),
        ] {
            assert_eq!(
                calculate(&json!({"expression": e})),
                want.map_err(String::from),
                "{e}"
            );
        }
        assert!(calculate(&json!({})).is_err());
        assert!(calculate(&json!({"expression": "9999999999*9999999999"})).is_err());
    }

    #[test]
    fn hermes_turns_split_into_text_and_calls_as_vllm_splits_them() {
        let calc = |e: &str| Call {
            name: "calculator".into(),
            arguments: json!({"expression": e}),
        };
        let two = "Let me see.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+1\"}}\n</tool_call>\n<tool_call>{\"name\": \"calculator\", \"arguments\": \"{\\\"expression\\\": \\\"2*3\\\"}\"}</tool_call>";
        for (text, want) in [
            ("42", ("42".to_string(), vec![])),
            (
                two,
                ("Let me see.".to_string(), vec![calc("1+1"), calc("2*3")]),
            ),
            // Malformed: all of it stays text.
            (
                "a <tool_call>{\"name\": 1}</tool_call>",
                ("a <tool_call>{\"name\": 1}</tool_call>".to_string(), vec![]),
            ),
            (
                "<tool_call>{\"name\": \"x\"}",
                ("<tool_call>{\"name\": \"x\"}".to_string(), vec![]),
            ),
        ] {
            assert_eq!(split_hermes(text), want, "{text}");
        }
    }

    #[test]
    fn the_python_tool_runs_code_within_its_limits_and_without_network() {
        let sandbox = Sandbox {
            timeout: Duration::from_secs(5),
            memory_bytes: 512 << 20,
        };
        let run = |code: &str| python(&json!({"code": code}), sandbox);
        assert_eq!(run("print(123 * 456)"), Ok("56088".into()));
        let e = run("raise ValueError('no')").unwrap_err();
        assert!(e.contains("ValueError: no"), "{e}");
        let e = run("x = bytearray(4 << 30)").unwrap_err();
        assert!(e.contains("MemoryError"), "{e}");
        let e =
            run("import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)").unwrap_err();
        assert!(e.contains("Network is unreachable"), "{e}");
        let quick = Sandbox {
            timeout: Duration::from_millis(300),
            ..sandbox
        };
        let e = python(&json!({"code": "while True: pass"}), quick).unwrap_err();
        assert_eq!(e, "python: the code ran past 0.3 s");
        let long = run("print('x' * 5000)").unwrap();
        assert!(long.len() <= PYTHON_OUTPUT + 3 && long.ends_with('…'));
        assert!(
            run("import os; print(os.getcwd())")
                .unwrap()
                .contains("trellis-python-")
        );
        assert!(python(&json!({}), sandbox).is_err());
    }

    #[test]
    fn calls_are_read_in_each_format() {
        let calc = |e: &str| Call {
            name: "calculator".into(),
            arguments: json!({"expression": e}),
        };
        assert_eq!(
            parse("<call>12*3</call>", ToolFormat::Compact),
            Some(Ok(calc("12*3")))
        );
        assert_eq!(parse("36", ToolFormat::Compact), None);
        assert!(matches!(
            parse("<call>12", ToolFormat::Compact),
            Some(Err(_))
        ));
        let hermes = "I will compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*3\"}}\n</tool_call>";
        assert_eq!(parse(hermes, ToolFormat::Hermes), Some(Ok(calc("12*3"))));
        let stringly = "<tool_call>{\"name\": \"calculator\", \"arguments\": \"{\\\"expression\\\": \\\"1+1\\\"}\"}</tool_call>";
        assert_eq!(parse(stringly, ToolFormat::Hermes), Some(Ok(calc("1+1"))));
        let llama = "{\"name\": \"calculator\", \"parameters\": {\"expression\": \"12*3\"}}";
        assert_eq!(parse(llama, ToolFormat::Hermes), Some(Ok(calc("12*3"))));
        assert_eq!(parse("The answer is 36.", ToolFormat::Hermes), None);
        assert!(matches!(
            parse("<tool_call>{not json}</tool_call>", ToolFormat::Hermes),
            Some(Err(m)) if m.starts_with("the call is not JSON")
        ));
        assert!(matches!(
            parse("<tool_call>{\"arguments\": {}}</tool_call>", ToolFormat::Hermes),
            Some(Err(m)) if m.contains("no \"name\"")
        ));
    }
}
