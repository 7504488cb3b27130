//! Multi-turn episodes end to end: GRPO teaches a tiny model to call its calculator
//! (`recipes/grpo-tool-arith.yaml`) and to play a guessing game better
//! (`recipes/grpo-guess.yaml`); the trajectories it trains on are the model's turns and the
//! tool's results, a run killed with -9 mid-RL resumes to the same rows, PPO's critic trains on
//! episodes too, and an environment written in Python drives episodes as the built-in one.

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
        // A second turn's context (prompt, call, result: over 16 tokens) starts with a block
        // the first turn left in the engine's prefix cache.
        if turns > 1.0 {
            assert!(f(r, "episode/cached_tokens") > 0.0, "{r}");
        }
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

/// A tiny random model guessing one-digit sums for a few RL steps, in the environment `env`
/// (YAML), with an eval at the end.
fn guessing(env: &str) -> String {
    format!(
        "name: guess\nseed: 4\nmodel:\n  init: {{arch: qwen2, hidden_size: 32, num_hidden_layers: 1, \
         num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 40}}\n  \
         tokenizer: builtin:arith\nstages:\n  - id: rl\n    kind: rl\n    data: {{task: arith, \
         digits: 1, ops: \"+\", eval_size: 8, env: {env}}}\n    algorithm: {{rollout_n: 4, \
         train_batch_size: 4, ppo_mini_batch_size: 4, max_response_length: 3}}\n    \
         trainer: {{steps: 3, eval_freq: 3}}\n"
    )
}

fn python_example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/python/guess_env.py")
}

#[test]
fn a_python_environment_drives_episodes_as_the_built_in_one_and_a_broken_one_fails_alone() {
    let root = scratch("episodes-python");
    let run = |name: &str, env: &str| {
        let file = root.join(format!("{name}.yaml"));
        std::fs::write(&file, guessing(env)).unwrap();
        let dir = root.join(name);
        run_ok(
            trellis()
                .arg("train")
                .arg(&file)
                .arg("--run-dir")
                .arg(&dir)
                .arg("--quiet"),
        );
        metric_rows(&dir)
    };
    // examples/python/guess_env.py is the built-in `guess` written in Python: the same episodes,
    // token for token, so the same rows (but for the name of the failure count).
    let builtin = run("builtin", "{type: guess, max_turns: 3}");
    let python = run(
        "python",
        &format!(
            "{{type: command, name: guess, command: [python3, {}], max_turns: 3}}",
            python_example().display()
        ),
    );
    assert_eq!(python, builtin);
    let turns: f64 = builtin
        .iter()
        .filter_map(|r| r["episode/turns/mean"].as_f64())
        .sum();
    assert!(turns > 3.0, "some episodes run past a turn: {turns}");

    // A program that crashes on the answer 7 and hangs on 3 fails those episodes only: the run
    // ends, and counts them.
    let flaky = root.join("flaky.py");
    std::fs::write(
        &flaky,
        format!(
            "import json, runpy, sys, time\n\
             lines = sys.stdin\n\
             class Watch:\n    def __iter__(self):\n        for line in lines:\n            \
             answer = json.loads(line).get('answer')\n            \
             if answer == '7': sys.exit(3)\n            \
             if answer == '3': time.sleep(60)\n            yield line\n\
             sys.stdin = Watch()\nrunpy.run_path({:?}, run_name='__main__')\n",
            python_example().display().to_string()
        ),
    )
    .unwrap();
    let rows = run(
        "flaky",
        &format!(
            "{{type: command, name: flaky, command: [python3, {}], max_turns: 3, step_timeout_s: 1}}",
            flaky.display()
        ),
    );
    let failed: f64 = rows
        .iter()
        .filter_map(|r| r["env/flaky/failed"].as_f64())
        .sum();
    assert!(failed > 0.0, "{rows:?}");
    assert!(rows.iter().any(|r| r["stage"] == "rl" && r["step"] == 3));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn grpo_lifts_the_success_of_a_multi_turn_guessing_game() {
    let dir = scratch("episodes-guess");
    let recipe = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes/grpo-guess.yaml");
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe)
            .arg("--run-dir")
            .arg(&dir)
            .arg("--quiet"),
    );
    let rows = metric_rows(&dir);
    let (before, after) = (eval_accuracy(&rows, "before"), eval_accuracy(&rows, "rl"));
    // Sampled on 500 held-out games: about 0.02 of noise; halving would reach 0.7.
    assert!(
        after - before >= 0.08,
        "held-out success {before} -> {after}: GRPO must lift it"
    );
    for r in rows
        .iter()
        .filter(|r| r["stage"] == "rl" && r.get("episode/turns/mean").is_some())
    {
        // Games of several turns, the replies one token each.
        assert!(r["episode/turns/mean"].as_f64().unwrap() > 1.5, "{r}");
        assert!(
            r["episode/observation_tokens/mean"].as_f64().unwrap() > 0.5,
            "{r}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
