//! Multi-turn episodes end to end: GRPO teaches a tiny model to call its calculator
//! (`recipes/grpo-tool-arith.yaml`), the trajectories it trains on are the model's turns and
//! the tool's results, a run killed with -9 mid-RL resumes to the same rows, and PPO's critic
//! trains on episodes too.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use trellis_tests::{kill_at_rl_checkpoint, metric_rows, run_ok, scratch, trellis};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes/grpo-tool-arith.yaml")
}

/// The recipe at CI size (20 RL steps, a checkpoint every 4) into `dir`.
fn tool_arith(dir: &Path, more: &[&str]) -> std::process::Command {
    let mut cmd = trellis();
    cmd.arg("train")
        .arg(recipe())
        .arg("--run-dir")
        .arg(dir)
        .arg("--quiet")
        .args(["-o", "stages.rl.trainer.steps=20"])
        .args(["-o", "stages.rl.trainer.save_freq=4"])
        .args(["-o", "stages.rl.trainer.log_rollouts=true"])
        .args(more);
    cmd
}

fn eval_accuracy(rows: &[Value], stage: &str) -> f64 {
    rows.iter()
        .rev()
        .find(|r| r["stage"] == stage && r.get("eval/accuracy").is_some())
        .unwrap_or_else(|| panic!("no eval of `{stage}`"))["eval/accuracy"]
        .as_f64()
        .unwrap()
}

#[test]
fn grpo_teaches_a_tiny_model_to_call_its_calculator_and_a_killed_run_resumes_alike() {
    let root = scratch("episodes");
    let dir = root.join("run");
    run_ok(&mut tool_arith(&dir, &[]));
    let rows = metric_rows(&dir);
    let (before, after) = (eval_accuracy(&rows, "before"), eval_accuracy(&rows, "rl"));
    assert!(
        after - before >= 0.3,
        "held-out success {before} -> {after}: GRPO must lift it by 0.3"
    );
    let steps: Vec<&Value> = rows
        .iter()
        .filter(|r| r["stage"] == "rl" && r.get("episode/turns/mean").is_some())
        .collect();
    assert_eq!(steps.len(), 20);
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no {k} in {r}"));
    for r in &steps {
        assert_eq!(f(r, "env/calculator/failed"), 0.0);
        let turns = f(r, "episode/turns/mean");
        assert!((1.0..=2.0).contains(&turns), "{turns}");
        // Every turn but the last was a call answered by the tool (the last may be a call
        // too, when the turns ran out).
        let calls = f(r, "episode/tool_calls/mean");
        assert!(
            calls >= turns - 1.0 - 1e-9 && calls <= turns,
            "{calls} calls, {turns} turns"
        );
        assert!(f(r, "episode/tool_errors") >= 0.0);
        assert!(f(r, "episode/prefill_tokens") > 0.0);
    }
    let (first, last) = (steps[0], steps[steps.len() - 1]);
    assert!(
        f(last, "episode/tool_calls/mean") > f(first, "episode/tool_calls/mean")
            && f(last, "episode/tool_calls/mean") > 0.8,
        "the model learns to call the tool: {} -> {}",
        f(first, "episode/tool_calls/mean"),
        f(last, "episode/tool_calls/mean")
    );
    // What it trained on: the model's call, the tool's exact result, then its answer.
    let text = std::fs::read_to_string(dir.join("rollouts/rl/step_000020.jsonl")).unwrap();
    let mut called = 0;
    for line in text.lines() {
        let s: Value = serde_json::from_str(line).unwrap();
        let (prompt, response) = (
            s["prompt"].as_str().unwrap(),
            s["response"].as_str().unwrap(),
        );
        let Some(rest) = response.strip_prefix("<call>") else {
            continue;
        };
        let Some((call, rest)) = rest.split_once("</call><result>") else {
            continue;
        };
        let (result, answer) = rest.split_once("</result>").unwrap();
        let value = rollout::env::tools::calculate(&serde_json::json!({"expression": call}));
        assert_eq!(
            result,
            value.map_or_else(|e| format!("error: {e}"), |v| v.to_string())
        );
        if call == prompt.trim_end_matches('=') && answer == s["answer"] {
            assert_eq!(s["score"], 1.0, "{s}");
        }
        called += 1;
    }
    assert!(called > 100, "{called} of 128 episodes called the tool");

    // kill -9 after RL step 4's checkpoint, then resume: the same rows as the undisturbed run.
    let killed = root.join("killed");
    let mut child = tool_arith(&killed, &[])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    kill_at_rl_checkpoint(&mut child, &killed);
    run_ok(trellis().arg("resume").arg(&killed).arg("--quiet"));
    assert_eq!(metric_rows(&killed), rows);

    // PPO: the critic's values and GAE run over the model's tokens of every episode.
    let ppo = root.join("ppo");
    run_ok(&mut tool_arith(
        &ppo,
        &[
            "-o",
            "stages.warmup.trainer.steps=100",
            "-o",
            "stages.rl.trainer.steps=3",
            "-o",
            "stages.rl.algorithm.adv_estimator=gae",
        ],
    ));
    let rows = metric_rows(&ppo);
    let last = rows
        .iter()
        .rfind(|r| r["stage"] == "rl" && r.get("critic/vf_loss").is_some())
        .expect("a critic update on episodes");
    assert!(f(last, "critic/vf_loss").is_finite());
    assert!(f(last, "episode/turns/mean") >= 1.0);
    std::fs::remove_dir_all(&root).unwrap();
}
