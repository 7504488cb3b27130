//! A workflow's `program` node: an external command scores every response. It reads one JSON
//! object per line (`prompt`, `response`, `answer`) on stdin and writes one number per line,
//! under a timeout and an address-space limit; a failed run or an unreadable line scores 0 and
//! is counted (and logged), never failing the step.

use super::{Board, Compute, ExecError, StepCx, Update};
use crate::exec::board::{Group, Write};
use crate::plan::ProgramPlan;
use crate::plan::schema::ScoreMode;
use std::io::{Read, Write as _};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) struct Program(pub Arc<ProgramPlan>);

impl Compute for Program {
    fn compute(&self, _cx: &StepCx<'_, '_>, board: &Board) -> Result<Update, ExecError> {
        let mut u = Update::default();
        let scores = scores(&self.0, &board.groups, &mut u.metrics);
        u.writes.push(Write::Scores(scores));
        Ok(u)
    }
}

/// The program's new scores: its score per response added to the reward times `weight`, or
/// replacing it.
fn scores(p: &ProgramPlan, groups: &[Group], m: &mut learner::rl::Metrics) -> Vec<Vec<f32>> {
    let mut input = String::new();
    for g in groups {
        for t in &g.texts {
            let line = serde_json::json!({"prompt": g.problem.prompt, "response": t, "answer": g.problem.answer});
            input.push_str(&line.to_string());
            input.push('\n');
        }
    }
    let total: usize = groups.iter().map(|g| g.texts.len()).sum();
    let (got, failed) = match run(p, input.into_bytes(), total) {
        Ok(scores) => {
            let failed = scores.iter().filter(|s| s.is_none()).count();
            (scores, failed)
        }
        Err(e) => {
            tracing::warn!(node = %p.name, "reward program failed: {e}; its {total} responses score 0");
            (vec![None; total], total)
        }
    };
    m.insert(format!("reward/{}/failed", p.name), failed as f64);
    let mut it = got.into_iter();
    let mut sum = 0.0;
    let out = groups
        .iter()
        .map(|g| {
            g.scores
                .iter()
                .map(|&base| {
                    let s = it.next().flatten().unwrap_or(0.0);
                    sum += s;
                    let w = (p.weight * s) as f32;
                    match p.mode {
                        ScoreMode::Replace => w,
                        ScoreMode::Add => base + w,
                    }
                })
                .collect()
        })
        .collect();
    m.insert(format!("reward/{}/mean", p.name), sum / total.max(1) as f64);
    out
}

/// Runs the program with `input` on stdin, under its timeout and memory limit; one score per
/// line expected (`None` for a line that is not a finite number).
fn run(p: &ProgramPlan, input: Vec<u8>, expect: usize) -> Result<Vec<Option<f64>>, String> {
    let mut cmd = Command::new(&p.program);
    if let Some(dir) = &p.dir {
        cmd.current_dir(dir);
    }
    cmd.args(&p.args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    rollout::reward::limit_address_space(&mut cmd, p.memory_bytes);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start `{}`: {e}", p.program.display()))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let writer = std::thread::spawn(move || {
        // A program that exits without reading all of its input is not an error by itself.
        let _ = stdin.write_all(&input);
    });
    let mut stdout = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).map(|_| s)
    });
    let mut stderr = child.stderr.take().expect("piped stderr");
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + p.timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {} s", p.timeout.as_secs_f64()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    };
    let _ = writer.join();
    let out = reader
        .join()
        .map_err(|_| "its output reader panicked".to_string())?
        .map_err(|e| format!("reading its output: {e}"))?;
    let err = err_reader.join().unwrap_or_default();
    if !status.success() {
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        return Err(format!("exited with {status}: {tail}"));
    }
    let lines: Vec<&str> = out.lines().collect();
    if lines.len() != expect {
        return Err(format!(
            "wrote {} lines for {expect} responses (one score per line expected)",
            lines.len()
        ));
    }
    Ok(lines
        .iter()
        .map(|l| l.trim().parse::<f64>().ok().filter(|v| v.is_finite()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prog(cmd: &[&str], timeout_s: f64) -> ProgramPlan {
        ProgramPlan {
            name: "p".into(),
            program: cmd[0].into(),
            args: cmd[1..].iter().map(|s| s.to_string()).collect(),
            dir: None,
            timeout: Duration::from_secs_f64(timeout_s),
            memory_bytes: 512 << 20,
            weight: 1.0,
            mode: ScoreMode::Add,
        }
    }

    #[test]
    fn programs_score_time_out_and_fail_cleanly() {
        let input = b"{\"response\":\"1\"}\n{\"response\":\"2\"}\n".to_vec();
        // One score per input line: the length of each line.
        let ok = run(
            &prog(&["sh", "-c", "while read l; do echo ${#l}; done"], 10.0),
            input.clone(),
            2,
        )
        .unwrap();
        assert_eq!(ok, vec![Some(16.0), Some(16.0)]);
        let bad_line = run(
            &prog(&["sh", "-c", "cat >/dev/null; echo 1; echo x"], 10.0),
            input.clone(),
            2,
        )
        .unwrap();
        assert_eq!(bad_line, vec![Some(1.0), None]);
        let t = Instant::now();
        let e = run(&prog(&["sleep", "30"], 0.3), input.clone(), 2).unwrap_err();
        assert!(e.contains("timed out"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        let e = run(
            &prog(&["sh", "-c", "echo boom >&2; exit 3"], 10.0),
            input.clone(),
            2,
        )
        .unwrap_err();
        assert!(e.contains("boom"), "{e}");
        let e = run(
            &prog(&["sh", "-c", "cat >/dev/null; echo 1"], 10.0),
            input.clone(),
            2,
        )
        .unwrap_err();
        assert!(e.contains("1 lines for 2"), "{e}");
        let e = run(&prog(&["/nonexistent/scorer"], 10.0), input, 2).unwrap_err();
        assert!(e.contains("cannot start"), "{e}");
    }

    #[test]
    fn the_memory_limit_applies_to_the_program() {
        // Allocating 1 GiB under a 64 MiB limit fails inside the program. python3 is on every
        // machine this project builds on (`.ci/run` makes its venv with it).
        let mut p = prog(&["python3", "-c", "x = bytearray(1 << 30); print(1)"], 20.0);
        p.memory_bytes = 64 << 20;
        let e = run(&p, Vec::new(), 1).unwrap_err();
        assert!(e.contains("MemoryError") || e.contains("exited"), "{e}");
    }
}
