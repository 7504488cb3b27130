//! `trellis train`, `trellis resume` and `trellis config show` as a user runs them.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use trellis_tests::{PATIENCE, kill_at_rl_checkpoint, run_ok, trellis};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-arith.yaml")
}

fn run_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trellis-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `sft/loss` of the `warmup` stage's step `step`.
fn sft_loss(m: &[Value], step: u64) -> f64 {
    m.iter()
        .find(|v| v["stage"] == "warmup" && v["step"] == step)
        .unwrap()["sft/loss"]
        .as_f64()
        .unwrap()
}

/// The run's metric rows without what differs between equal runs: timings, throughput, and
/// the count of failed reward calls.
fn comparable(dir: &Path) -> Vec<Value> {
    metrics(dir)
        .into_iter()
        .map(|mut v| {
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| !k.starts_with("timing_s/") && !k.starts_with("perf/"));
            o.remove("reward/failed");
            v
        })
        .collect()
}

fn steps_of(m: &[Value], stage: &str) -> Vec<u64> {
    m.iter()
        .filter(|v| v["stage"] == stage)
        .map(|v| v["step"].as_u64().unwrap())
        .collect()
}

#[test]
fn a_recipe_runs_end_to_end_and_records_everything() {
    let dir = run_dir("e2e");
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .arg("--quiet")
            .arg("--run-dir")
            .arg(&dir),
    );
    let m = metrics(&dir);
    assert_eq!(steps_of(&m, "warmup"), (1..=30).collect::<Vec<_>>());
    assert_eq!(steps_of(&m, "rl"), (1..=12).collect::<Vec<_>>());
    assert_eq!(steps_of(&m, "final-eval"), vec![0]);
    // SFT learns: the loss falls.
    let loss = |s: u64| sft_loss(&m, s);
    assert!(
        loss(30) < 0.8 * loss(1),
        "sft/loss {} → {}",
        loss(1),
        loss(30)
    );
    // RL steps carry VeRL's metric names and move the weight version.
    let rl = m
        .iter()
        .find(|v| v["stage"] == "rl" && v["step"] == 6)
        .unwrap();
    for k in [
        "critic/score/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "response_length/mean",
        "timing_s/gen",
        "eval/accuracy",
    ] {
        assert!(rl.get(k).is_some(), "rl step 6 lacks {k}: {rl}");
    }
    // VeRL's throughput: every token of the batch (8 prompts × 4 samples: prompt and
    // response) a second.
    let f = |k: &str| rl[k].as_f64().unwrap();
    let tokens = 32.0 * (f("prompt_length/mean") + f("response_length/mean"));
    assert!((f("perf/total_num_tokens") - tokens).abs() < 1e-6, "{rl}");
    assert!(
        (f("perf/throughput") - tokens / f("perf/time_per_step")).abs()
            < 1e-9 * f("perf/throughput"),
        "{rl}"
    );
    // TensorBoard event files are written beside metrics.jsonl: a run (folder) per stage, tagged
    // with VeRL's keys.
    let mut runs: Vec<String> = std::fs::read_dir(dir.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    runs.sort();
    assert_eq!(runs, ["final-eval", "rl", "warmup"]);
    let tb: Vec<_> = std::fs::read_dir(dir.join("tensorboard/rl"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(tb.len(), 1);
    assert!(
        tb[0]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")
    );
    let events = std::fs::read(&tb[0]).unwrap();
    let has = |tag: &str| events.windows(tag.len()).any(|w| w == tag.as_bytes());
    assert!(
        has("critic/score/mean") && !has("rl/critic"),
        "tags are the metric keys"
    );
    // ... and the curves as a PNG.
    let png = std::fs::read(dir.join("plot.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    // Every log line is in train.log: the logs and the progress, though the run was quiet.
    let log = std::fs::read_to_string(dir.join("train.log")).unwrap();
    assert!(log.contains("learner on the native engine"), "{log}");
    assert!(
        log.contains("[rl] [####################] step 12/12"),
        "{log}"
    );
    assert!(log.contains("[final-eval] eval accuracy"), "{log}");
    assert!(
        log.contains("checkpoint at step 10: checkpoints/warmup/step_000010"),
        "{log}"
    );
    assert!(
        !dir.join("status.json").exists(),
        "the live status goes with the run"
    );
    // The final model is a loadable Hugging Face checkpoint.
    let out =
        String::from_utf8(run_ok(trellis().arg("status").arg(&dir).arg("--json")).stdout).unwrap();
    let status: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["job"]["state"], "succeeded");
    assert_eq!(
        status["job"]["progress"]["completed"],
        serde_json::json!(["warmup", "rl", "final-eval"])
    );
    assert_eq!(status["metric_rows"].as_u64(), Some(m.len() as u64));
    let ck = dir.join(status["job"]["progress"]["checkpoint"].as_str().unwrap());
    let trainer_state: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(trainer_state["stage"], "final-eval");
    run_ok(
        trellis()
            .args(["score", "--json", "--text", "3+4=7", "--model"])
            .arg(&ck),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn status_is_readable_while_the_run_goes() {
    let dir = run_dir("live");
    let mut child = trellis()
        .arg("train")
        .arg(recipe())
        .args(["--quiet", "-o", "stages.rl.trainer.steps=40", "--run-dir"])
        .arg(&dir)
        .spawn()
        .unwrap();
    // While the run holds the store, status answers from what the run keeps current.
    let t0 = Instant::now();
    let live = loop {
        assert!(t0.elapsed() < PATIENCE, "no live status");
        let out = trellis()
            .arg("status")
            .arg(&dir)
            .arg("--json")
            .output()
            .unwrap();
        if out.status.success() {
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            if v["live"] == true && v["job"]["progress"]["stage"] == "warmup" {
                break v;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(live["job"]["state"], "running", "{live:#}");
    assert!(live["metric_rows"].as_u64().unwrap() >= 10, "{live:#}");
    assert!(
        live["checkpoints"]
            .as_array()
            .is_some_and(|c| !c.is_empty())
    );
    let text = run_ok(trellis().arg("status").arg(&dir)).stdout;
    assert!(String::from_utf8_lossy(&text).contains("the run is going"));
    assert!(child.wait().unwrap().success());
    let done: Value =
        serde_json::from_slice(&run_ok(trellis().arg("status").arg(&dir).arg("--json")).stdout)
            .unwrap();
    assert_eq!(
        (done["live"].as_bool(), done["job"]["state"].as_str()),
        (Some(false), Some("succeeded"))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kill_nine_then_resume_loses_nothing() {
    let dir = run_dir("kill");
    let mut child = trellis()
        .arg("train")
        .arg(recipe())
        .args(["--quiet", "--run-dir"])
        .arg(&dir)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait for a checkpoint inside the RL stage, then kill -9.
    kill_at_rl_checkpoint(&mut child, &dir);
    let out =
        String::from_utf8(run_ok(trellis().arg("status").arg(&dir).arg("--json")).stdout).unwrap();
    let status: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        status["job"]["state"], "running",
        "a killed run is still `running`"
    );
    // The store points at a complete checkpoint whose own record agrees with it.
    let progress = &status["job"]["progress"];
    let ck = dir.join(progress["checkpoint"].as_str().unwrap());
    let trainer_state: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap())
            .unwrap_or_else(|e| panic!("{status:#}: {e}"));
    assert_eq!(trainer_state["stage"], progress["stage"], "{status:#}");
    assert_eq!(trainer_state["step"], progress["step"], "{status:#}");
    assert!(ck.join("model.safetensors").exists(), "{status:#}");
    run_ok(trellis().arg("resume").arg(&dir).arg("--quiet"));
    let m = metrics(&dir);
    assert_eq!(
        steps_of(&m, "warmup"),
        (1..=30).collect::<Vec<_>>(),
        "SFT steps recorded once each"
    );
    assert_eq!(
        steps_of(&m, "rl"),
        (1..=12).collect::<Vec<_>>(),
        "RL steps continue, none lost or doubled"
    );
    assert_eq!(steps_of(&m, "final-eval"), vec![0]);
    // Resuming a finished run does nothing more.
    let again = trellis()
        .arg("resume")
        .arg(&dir)
        .arg("--quiet")
        .output()
        .unwrap();
    assert!(again.status.success());
    assert_eq!(metrics(&dir).len(), m.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn overrides_apply_and_config_show_prints_the_resolved_workflow() {
    let out = run_ok(trellis().arg("config").arg("show").arg(recipe()).args([
        "-o",
        "stages.rl.trainer.steps=3",
        "-o",
        "stages.0.sft.lr=0.01",
    ]));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stages"][1]["trainer"]["steps"], 3);
    assert_eq!(v["stages"][0]["sft"]["lr"], 0.01);
    assert_eq!(
        v["stages"][1]["algorithm"]["clip_ratio"], 0.2,
        "defaults are filled in"
    );
}

#[test]
fn bad_workflows_are_refused_before_anything_runs() {
    // Every check and its message is a unit test of the plan (`orchestrator::plan::tests`);
    // here, that the binary refuses before it makes anything, with exit status 2.
    let base = std::fs::read_to_string(recipe()).unwrap();
    let dir = run_dir("bad");
    let cases: Vec<(String, String)> = vec![
        (
            base.replace("seed: 3", "seed: 3\nsede: 4"),
            "tiny.yaml:4:1: unknown field `sede` (did you mean `seed`?)".into(),
        ),
        (
            base.replace("rollout_n: 4", "rollout_n: four"),
            "stages[1].algorithm.rollout_n: invalid u64".into(),
        ),
        (
            base.replace(
                "tokenizer: builtin:arith",
                "tokenizer: no-such-tokenizer.json",
            ),
            // Relative to the workflow file, as every path in it.
            format!(
                "model.tokenizer: {}: No such file or directory",
                dir.join("no-such-tokenizer.json").display()
            ),
        ),
    ];
    std::fs::create_dir_all(&dir).unwrap();
    for (text, want) in cases {
        let f = dir.join("tiny.yaml");
        std::fs::write(&f, &text).unwrap();
        let out = trellis()
            .arg("train")
            .arg(&f)
            .arg("--run-dir")
            .arg(dir.join("run"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{want:?}: {err}");
        assert!(err.contains(&want), "error for {want:?} was: {err}");
        assert!(
            !dir.join("run").exists(),
            "nothing may run before validation passes"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn runs_are_reproducible() {
    // Same recipe, same seed → the same losses, rewards and accuracies, step for step.
    // A rollout pool of three engines samples the same tokens as one (a prompt's seed decides
    // its samples, whichever engine serves it), so the run is the same too. The eval samples
    // the RL stage writes out (`log_generations`) are the same as well.
    let mut runs = Vec::new();
    let mut samples = Vec::new();
    for (tag, engines) in [("repro-a", 1), ("repro-b", 1), ("repro-pool", 3)] {
        let dir = run_dir(tag);
        run_ok(
            trellis()
                .arg("train")
                .arg(recipe())
                .args(["--quiet", "-o", "stages.rl.trainer.steps=4", "--run-dir"])
                .arg(&dir)
                .args(["-o", &format!("pools.rollout.count={engines}")])
                .args(["-o", "stages.rl.trainer.log_generations=3"]),
        );
        let logged = std::fs::read_to_string(dir.join("generations/rl/step_000004.jsonl")).unwrap();
        let lines: Vec<Value> = logged
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "{logged}");
        for l in &lines {
            for k in ["prompt", "response", "answer", "score"] {
                assert!(l.get(k).is_some(), "{k} missing: {l}");
            }
        }
        assert!(
            !dir.join("generations/warmup").exists(),
            "only the stage that asked logs"
        );
        samples.push(logged);
        let mut rows = comparable(&dir);
        for v in &mut rows {
            if let Some(n) = v.as_object_mut().unwrap().remove("rollout/engines") {
                assert_eq!(n.as_f64(), Some(engines as f64), "{v}");
            }
        }
        runs.push(rows);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    assert_eq!(runs[0], runs[1]);
    // Three engines batch the prompts otherwise, so their log-probs of the same tokens may differ
    // in the last bits: the learner-vs-engine gap agrees to float precision, not bit for bit.
    let gap = |rows: &[Value]| -> Vec<f64> {
        rows.iter()
            .filter_map(|r| r.get("rollout/logprob_diff_mean")?.as_f64())
            .collect()
    };
    let (one, three) = (gap(&runs[0]), gap(&runs[2]));
    assert!(
        !one.is_empty() && one.len() == three.len(),
        "{one:?} {three:?}"
    );
    for (a, b) in one.iter().zip(&three) {
        assert!((a - b).abs() < 1e-5 && *a < 1e-5, "{one:?} {three:?}");
    }
    let without_gap = |rows: &[Value]| -> Vec<Value> {
        rows.iter()
            .map(|r| {
                let mut r = r.clone();
                r.as_object_mut()
                    .unwrap()
                    .retain(|k, _| !k.starts_with("rollout/logprob_diff"));
                r
            })
            .collect()
    };
    assert_eq!(
        without_gap(&runs[0]),
        without_gap(&runs[2]),
        "a pool of 3 engines changed the run"
    );
    assert_eq!(samples[0], samples[1]);
    assert_eq!(samples[0], samples[2]);
}

/// `algorithm.old_logp: engine`: several updates a step (the tiny recipe's two mini-batches
/// and two epochs) take the engine's log-probs as the behaviour policy's instead of a learner
/// pass. The run has no `old_logp` pass (no timing, no learner-vs-engine gap to report), and
/// it trains as the recomputing run does: the same samples at the first step, whose loss
/// differs only by the f32 gap between the engine's and the learner's log-probs.
#[test]
fn old_logp_engine_trains_on_the_engines_log_probs_without_a_pass() {
    let rl_rows = |tag: &str, source: &str| -> Vec<Value> {
        let dir = run_dir(tag);
        run_ok(
            trellis()
                .arg("train")
                .arg(recipe())
                .args(["--quiet", "-o", "stages.rl.trainer.steps=4", "--run-dir"])
                .arg(&dir)
                .args(["-o", &format!("stages.rl.algorithm.old_logp={source}")]),
        );
        let rows: Vec<Value> = metrics(&dir)
            .into_iter()
            .filter(|v| v["stage"] == "rl" && v.get("actor/pg_loss").is_some())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        rows
    };
    let (recomputed, engine) = (
        rl_rows("old-logp-recompute", "recompute"),
        rl_rows("old-logp-engine", "engine"),
    );
    assert_eq!((recomputed.len(), engine.len()), (4, 4));
    for r in &recomputed {
        assert!(r.get("timing_s/old_log_prob").is_some(), "{r}");
        assert!(r.get("rollout/logprob_diff_mean").is_some(), "{r}");
    }
    for r in &engine {
        assert!(r.get("timing_s/old_log_prob").is_none(), "{r}");
        assert!(r.get("rollout/logprob_diff_mean").is_none(), "{r}");
        assert!(
            r["actor/grad_norm"].as_f64().is_some_and(f64::is_finite),
            "{r}"
        );
    }
    let first = |rows: &[Value], k: &str| rows[0][k].as_f64().unwrap();
    assert_eq!(
        first(&recomputed, "critic/score/mean"),
        first(&engine, "critic/score/mean")
    );
    let (a, b) = (
        first(&recomputed, "actor/pg_loss"),
        first(&engine, "actor/pg_loss"),
    );
    assert!(
        (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
        "pg_loss {a} vs {b}"
    );
}

#[test]
fn dapo_dynamic_sampling_and_overlong_shaping_run() {
    let dir = run_dir("dapo");
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .args([
                "--quiet",
                "-o",
                "stages.rl.algorithm.filter_groups=true",
                "-o",
                "stages.rl.algorithm.max_num_gen_batches=3",
            ])
            .args([
                "-o",
                "stages.rl.algorithm.overlong_buffer_len=2",
                "-o",
                "stages.rl.algorithm.clip_ratio_high=0.28",
            ])
            .arg("--run-dir")
            .arg(&dir),
    );
    let m = metrics(&dir);
    let rl: Vec<&Value> = m.iter().filter(|v| v["stage"] == "rl").collect();
    assert_eq!(rl.len(), 12);
    for v in rl {
        let rounds = v["dapo/gen_rounds"].as_f64().unwrap();
        assert!((1.0..=3.0).contains(&rounds), "{v}");
        let kept = v["dapo/kept_groups"].as_f64().unwrap();
        assert!(
            kept <= 8.0 && kept % 4.0 == 0.0,
            "whole mini-batches of groups: {v}"
        );
        assert!(v["dapo/generated_groups"].as_f64().unwrap() >= kept);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn rl_rows(dir: &Path) -> Vec<Value> {
    metrics(dir)
        .into_iter()
        .filter(|v| v["stage"] == "rl")
        .collect()
}

/// The tiny recipe's RL stage as PPO: GAE with a critic, and a KL loss.
const PPO: [&str; 6] = [
    "-o",
    "stages.rl.algorithm.adv_estimator=gae",
    "-o",
    "stages.rl.algorithm.critic_lr=1.0e-3",
    "-o",
    "stages.rl.algorithm.use_kl_loss=true",
];

#[test]
fn ppo_trains_a_critic_with_gae_and_resumes_it() {
    let dir = run_dir("ppo");
    let args = PPO;
    let mut child = trellis()
        .arg("train")
        .arg(recipe())
        .arg("--quiet")
        .args(args)
        .arg("--run-dir")
        .arg(&dir)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !dir.join("checkpoints/rl/step_000008.tmp").exists()
        && !dir.join("checkpoints/rl/step_000008").exists()
    {
        assert!(start.elapsed() < PATIENCE, "no RL checkpoint");
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended before its second RL checkpoint: {status}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // The RL checkpoint holds the critic and its optimiser; the reference policy sits beside.
    let out = run_ok(trellis().arg("status").arg(&dir).arg("--json")).stdout;
    let status: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(status["job"]["progress"]["stage"], "rl");
    let ck = dir.join(status["job"]["progress"]["checkpoint"].as_str().unwrap());
    assert!(ck.join("critic/value_head.safetensors").exists());
    assert!(ck.join("critic/optimizer/state.json").exists());
    assert!(
        dir.join("checkpoints/rl/reference/model.safetensors")
            .exists()
    );
    run_ok(trellis().arg("resume").arg(&dir).arg("--quiet"));
    let rl = rl_rows(&dir);
    assert_eq!(
        rl.iter()
            .map(|v| v["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        (1..=12).collect::<Vec<_>>()
    );
    for v in &rl {
        for k in [
            "critic/vf_loss",
            "critic/values/mean",
            "timing_s/values",
            "timing_s/update_critic",
            "timing_s/ref",
            "actor/kl_loss",
        ] {
            assert!(v.get(k).is_some(), "PPO step lacks {k}: {v}");
        }
    }
    // The critic learns: its values move from 0 towards the returns it is fitted to.
    let vf = |i: usize| rl[i]["critic/vf_loss"].as_f64().unwrap();
    let early = (vf(0) + vf(1)) / 2.0;
    let late = (vf(10) + vf(11)) / 2.0;
    assert!(late < early, "critic/vf_loss {early} → {late}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn async_mode_overlaps_generation_and_bounds_staleness() {
    for (policy, tag) in [("drop", "async-drop"), ("wait", "async-wait")] {
        let dir = run_dir(tag);
        run_ok(
            trellis()
                .arg("train")
                .arg(recipe())
                .arg("--quiet")
                .args(["-o", "stages.rl.trainer.mode=async"])
                .args(["-o", "stages.rl.trainer.max_staleness=1"])
                .args(["-o", &format!("stages.rl.trainer.stale_samples={policy}")])
                .arg("--run-dir")
                .arg(&dir),
        );
        let rl = rl_rows(&dir);
        assert_eq!(rl.len(), 12);
        // Generation runs a step ahead: some samples were made by the previous weights...
        let lagged = rl
            .iter()
            .filter(|v| v["async/staleness_max"].as_f64().unwrap() >= 1.0)
            .count();
        assert!(lagged > 0, "no step trained on samples of older weights");
        for v in &rl {
            // ... but never more than max_staleness behind.
            assert!(v["async/staleness_max"].as_f64().unwrap() <= 1.0, "{v}");
            assert!(v.get("actor/pg_loss").is_some(), "{v}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// `(step, prompt position)` of every sample `rollouts/rl/step_*.jsonl` holds, sorted.
fn trained_prompts(dir: &Path) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for f in std::fs::read_dir(dir.join("rollouts/rl")).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "jsonl") {
            for l in std::fs::read_to_string(&f).unwrap().lines() {
                let v: Value = serde_json::from_str(l).unwrap();
                out.push((v["step"].as_u64().unwrap(), v["index"].as_u64().unwrap()));
            }
        }
    }
    out.sort_unstable();
    out
}

#[test]
fn an_async_run_killed_at_random_moments_trains_on_every_prompt_exactly_once() {
    // Generation runs a step ahead of training; whatever is in flight when the process dies is
    // drawn again on resume, because a step's prompts are a pure function of the step. So the
    // multiset of (step, prompt position) trained on equals an undisturbed run's: 0 skipped, 0
    // doubled (`stale_samples: wait`, so no sample is dropped by the staleness bound).
    let settings = [
        "stages.warmup.trainer.steps=4",
        "stages.rl.trainer.steps=30",
        "stages.rl.trainer.mode=async",
        "stages.rl.trainer.max_staleness=1",
        "stages.rl.trainer.stale_samples=wait",
        "stages.rl.trainer.save_freq=1",
        "stages.rl.trainer.log_rollouts=true",
    ];
    let with = |cmd: &mut std::process::Command| {
        for s in settings {
            cmd.args(["-o", s]);
        }
    };
    let calm = run_dir("exactly-once-calm");
    let mut c = trellis();
    c.arg("train").arg(recipe()).arg("--quiet");
    with(&mut c);
    run_ok(c.arg("--run-dir").arg(&calm));
    let want = trained_prompts(&calm);
    assert_eq!(
        want.len(),
        30 * 8 * 4,
        "30 steps of 8 prompts with 4 samples"
    );

    let dir = run_dir("exactly-once-kills");
    let mut next = trellis_tests::xorshift(0xA51C_2026);
    let mut kills = 0;
    for attempt in 0..5 {
        let mut cmd = trellis();
        if attempt == 0 {
            cmd.arg("train").arg(recipe());
            with(&mut cmd);
            cmd.arg("--run-dir").arg(&dir);
        } else {
            cmd.arg("resume").arg(&dir);
        }
        let mut child = cmd
            .arg("--quiet")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // A few RL steps further than the last attempt got, then a random moment.
        let logged = || {
            std::fs::read_dir(dir.join("rollouts/rl"))
                .map(|d| d.count())
                .unwrap_or(0)
        };
        let target = logged() + 1 + (next() % 5) as usize;
        let t0 = Instant::now();
        while logged() < target && child.try_wait().unwrap().is_none() {
            assert!(t0.elapsed() < PATIENCE, "no RL progress");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_micros(next() % 30_000));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
    }
    run_ok(trellis().arg("resume").arg(&dir).arg("--quiet"));
    assert!(kills >= 3, "only {kills} kills landed");
    assert_eq!(steps_of(&metrics(&dir), "rl"), (1..=30).collect::<Vec<_>>());
    assert_eq!(trained_prompts(&dir), want, "after {kills} kills");
    std::fs::remove_dir_all(&calm).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn workflow_nodes_add_a_reward_program_and_a_filter() {
    let dir = run_dir("nodes");
    // The workflow in a folder of its own with its scorer beside it: a program runs in the
    // workflow's folder, so `[sh, score.sh]` finds it whatever the current directory.
    let folder = dir.with_extension("workflow");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(recipe(), folder.join("tiny.yaml")).unwrap();
    // Scores 1 when the response is one character long, else 0; fails on the word "crash".
    std::fs::write(
        folder.join("score.sh"),
        "while read -r l; do case \"$l\" in *'\"response\":\"'?'\"'*) echo 1;; *) echo 0;; esac; done\n",
    )
    .unwrap();
    run_ok(
        trellis()
            .arg("train")
            .arg(folder.join("tiny.yaml"))
            .arg("--quiet")
            .args([
                "-o",
                "stages.rl.nodes=[{program: {name: short, command: [sh, score.sh], weight: 0.5}}, {filter: {name: informative, min_group_std: 0.01, after: [short]}}]",
            ])
            .arg("--run-dir")
            .arg(&dir),
    );
    let rl = rl_rows(&dir);
    assert_eq!(rl.len(), 12);
    for v in &rl {
        let mean = v["reward/short/mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&mean), "{v}");
        assert_eq!(v["reward/short/failed"].as_f64(), Some(0.0), "{v}");
        assert!(v.get("filter/informative/dropped_groups").is_some(), "{v}");
        assert!(v.get("timing_s/short").is_some(), "{v}");
    }
    // The program's bonus shows in the scores: some step scored above what exact match allows
    // for its accuracy (a half point for each one-character response).
    assert!(
        rl.iter()
            .any(|v| v["reward/short/mean"].as_f64().unwrap() > 0.0)
    );
    // A program that crashes scores its samples as failed and the run goes on.
    let dir2 = run_dir("nodes-crash");
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .arg("--quiet")
            .args(["-o", "stages.rl.trainer.steps=2"])
            .args([
                "-o",
                "stages.rl.nodes=[{program: {name: broken, command: [sh, -c, 'exit 7']}}]",
            ])
            .arg("--run-dir")
            .arg(&dir2),
    );
    let rl = rl_rows(&dir2);
    assert_eq!(rl.len(), 2);
    assert!(rl[0]["reward/broken/failed"].as_f64().unwrap() > 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&folder).unwrap();
    std::fs::remove_dir_all(&dir2).unwrap();
}

#[test]
fn jsonl_datasets_train_and_bad_rows_are_named() {
    let dir = run_dir("jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("sums.jsonl");
    let rows: Vec<String> = (0..100)
        .map(|i| {
            format!(
                "{{\"q\": \"{}+{}=\", \"a\": {}}}",
                i / 10,
                i % 10,
                i / 10 + i % 10
            )
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let spec = format!(
        "{{task: jsonl, path: {}, prompt_key: q, answer_key: a, eval_size: 10}}",
        data.display()
    );
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .args(["--quiet", "-o", "stages.rl.trainer.steps=2"])
            .args(["-o", &format!("stages.warmup.data={spec}")])
            .args(["-o", &format!("stages.rl.data={spec}")])
            .arg("--run-dir")
            .arg(dir.join("run")),
    );
    let m = metrics(&dir.join("run"));
    let loss = |s: u64| sft_loss(&m, s);
    assert!(
        loss(30) < 0.8 * loss(1),
        "sft/loss {} → {}",
        loss(1),
        loss(30)
    );
    assert!(
        m.iter()
            .any(|v| v["stage"] == "rl" && v.get("eval/accuracy").is_some())
    );
    // A row without the answer key stops the run before it starts, naming file:line and key.
    std::fs::write(&data, format!("{}\n{{\"q\": \"1+1=\"}}\n", rows[0])).unwrap();
    let out = trellis()
        .arg("train")
        .arg(recipe())
        .args(["-o", &format!("stages.warmup.data={spec}")])
        .arg("--run-dir")
        .arg(dir.join("run2"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("sums.jsonl:2: no key `a` (keys: q)"), "{err}");
    assert!(!dir.join("run2").exists(), "nothing ran");

    // VeRL's max_prompt_length: an over-long prompt is refused before the run starts, naming
    // its row; with filter_overlong_prompts its rows are dropped, eval rows too (the logged
    // eval samples hold only the short prompts).
    let long = "1+1+1+1+1+1+1+1+1+1=";
    let mixed: Vec<String> = (0..40)
        .map(|i| match i % 4 {
            3 => format!("{{\"q\": \"{long}\", \"a\": 10}}"),
            _ => format!(
                "{{\"q\": \"{}+{}=\", \"a\": {}}}",
                i % 10,
                i % 7,
                i % 10 + i % 7
            ),
        })
        .collect();
    std::fs::write(&data, mixed.join("\n")).unwrap();
    let bounded = |filter: bool| {
        format!(
            "{{task: jsonl, path: {}, prompt_key: q, answer_key: a, eval_size: 8, max_prompt_length: 8, filter_overlong_prompts: {filter}}}",
            data.display()
        )
    };
    let out = trellis()
        .arg("train")
        .arg(recipe())
        .args(["-o", &format!("stages.rl.data={}", bounded(false))])
        .arg("--run-dir")
        .arg(dir.join("run3"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("stages[1].data.max_prompt_length")
            && err.contains("sums.jsonl: row 4: the prompt is 20 tokens, over 8")
            && err.contains("filter_overlong_prompts: true"),
        "{err}"
    );
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .args(["--quiet", "-o", "stages.warmup.trainer.steps=2"])
            .args(["-o", "stages.rl.trainer.steps=2"])
            .args(["-o", "stages.rl.trainer.log_generations=8"])
            .args(["-o", &format!("stages.rl.data={}", bounded(true))])
            .arg("--run-dir")
            .arg(dir.join("run4")),
    );
    let logged =
        std::fs::read_to_string(dir.join("run4/generations/rl/step_000002.jsonl")).unwrap();
    assert_eq!(logged.lines().count(), 8, "{logged}");
    assert!(!logged.contains(long), "{logged}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn parquet_datasets_train_with_a_prompt_template() {
    // GSM8K-shaped rows written by pyarrow (tests/data/parquet), a checkpoint with a real
    // tokenizer, VeRL's way of appending an instruction to each question.
    let dir = run_dir("parquet");
    std::fs::create_dir_all(&dir).unwrap();
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let workflow_with = |answer_key: &str, reward: &str| {
        format!(
            "name: parquet\nseed: 1\nmodel: {{path: {model}}}\nstages:\n  - id: rl\n    kind: rl\n    \
             data: {{task: parquet, path: {train}, eval_path: {eval}, prompt_key: question,\n           \
             answer_key: {answer_key}, prompt_template: \"{{prompt}} Answer after ####.\"}}\n    \
             algorithm: {{rollout_n: 2, train_batch_size: 4, ppo_mini_batch_size: 4, lr: 1.0e-5,\n                \
             max_response_length: 6}}\n    reward: {reward}\n    trainer: {{steps: 2, eval_freq: 2}}\n",
            model = data.join("tiny-qwen2/checkpoint").display(),
            train = data.join("parquet/snappy.parquet").display(),
            eval = data.join("parquet/plain-v2.parquet").display(),
        )
    };
    let workflow = |answer_key: &str| workflow_with(answer_key, "{type: gsm8k}");
    let file = dir.join("parquet.yaml");
    std::fs::write(&file, workflow("answer")).unwrap();
    run_ok(
        trellis()
            .arg("train")
            .arg(&file)
            .args(["--quiet", "--run-dir"])
            .arg(dir.join("run")),
    );
    let m = metrics(&dir.join("run"));
    assert_eq!(m.iter().filter(|v| v["stage"] == "rl").count(), 2);
    assert!(m.iter().any(|v| v.get("eval/accuracy").is_some()));
    // A column the file lacks stops the run before it starts, naming the file and the columns.
    std::fs::write(&file, workflow("solution")).unwrap();
    let out = trellis()
        .arg("train")
        .arg(&file)
        .arg("--run-dir")
        .arg(dir.join("run2"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("snappy.parquet: no column `solution` (columns: question, answer, id"),
        "{err}"
    );

    // The same reward as a VeRL user's Python `compute_score`, beside the workflow and used
    // unchanged: the run equals the built-in reward's row for row.
    std::fs::copy(
        data.join("rewards/gsm8k_reward.py"),
        dir.join("gsm8k_reward.py"),
    )
    .unwrap();
    std::fs::write(
        &file,
        workflow_with(
            "answer",
            "{type: python, path: gsm8k_reward.py, workers: 2}",
        ),
    )
    .unwrap();
    run_ok(
        trellis()
            .arg("train")
            .arg(&file)
            .args(["--quiet", "--run-dir"])
            .arg(dir.join("python")),
    );
    let comparable = |run: &str| comparable(&dir.join(run));
    assert_eq!(comparable("python"), comparable("run"));
    assert!(
        metrics(&dir.join("python"))
            .iter()
            .filter(|v| v["stage"] == "rl")
            .all(|v| v["reward/failed"] == 0.0)
    );
    // A reward that fails on every sample stops the run with Python's traceback (resumable),
    // instead of training on zeros; one that does not import is refused before anything runs.
    std::fs::write(
        dir.join("broken.py"),
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1 / 0\n",
    )
    .unwrap();
    std::fs::write(
        &file,
        workflow_with("answer", "{type: python, path: broken.py}"),
    )
    .unwrap();
    let train_into = |run: &str| {
        let out = trellis()
            .arg("train")
            .arg(&file)
            .arg("--run-dir")
            .arg(dir.join(run))
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = train_into("broken");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("failed on all 8 samples") && err.contains("ZeroDivisionError"),
        "{err}"
    );
    std::fs::write(dir.join("broken.py"), "def compute_score(:\n").unwrap();
    let (code, err) = train_into("broken-import");
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("stages[0].reward") && err.contains("SyntaxError"),
        "{err}"
    );
    assert!(!dir.join("broken-import").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_verl_users_gsm8k_setup_trains_as_it_is() {
    // VeRL's layout: the recipe, data/gsm8k/{train,test}.parquet as VeRL's preprocessing writes
    // them (a chat `prompt`, `reward_model.ground_truth`, `data_source`, `extra_info`; made by
    // tests/data/verl-gsm8k/make.py), a Qwen-style checkpoint whose chat template is in
    // chat_template.jinja, and a custom reward in VeRL's style.
    let dir = run_dir("verl-gsm8k");
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    for sub in ["recipes", "data/gsm8k", "qwen"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let recipe = dir.join("recipes/grpo-gsm8k-verl.yaml");
    std::fs::copy(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes/grpo-gsm8k-verl.yaml"),
        &recipe,
    )
    .unwrap();
    for f in ["train.parquet", "test.parquet"] {
        std::fs::copy(
            data.join("verl-gsm8k").join(f),
            dir.join("data/gsm8k").join(f),
        )
        .unwrap();
    }
    std::fs::copy(data.join("verl-gsm8k/reward.py"), dir.join("reward.py")).unwrap();
    for f in std::fs::read_dir(data.join("tiny-qwen2/checkpoint")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join("qwen").join(f.file_name().unwrap())).unwrap();
    }
    std::fs::write(dir.join("qwen/chat_template.jinja"), QWEN25_TEMPLATE).unwrap();
    // The recipe as it stands, shortened to a tiny model's size.
    let train = |run: &str, more: &[&str]| {
        let mut cmd = trellis();
        cmd.arg("train").arg(&recipe).arg("--quiet");
        cmd.arg("-o")
            .arg(format!("model.path={}", dir.join("qwen").display()));
        for o in [
            "stages.rl.algorithm.train_batch_size=4",
            "stages.rl.algorithm.ppo_mini_batch_size=4",
            "stages.rl.algorithm.rollout_n=2",
            "stages.rl.algorithm.max_response_length=8",
            "stages.rl.trainer.total_epochs=0.2",
            "stages.rl.trainer.eval_freq=2",
        ]
        .iter()
        .chain(more)
        {
            cmd.args(["-o", o]);
        }
        cmd.arg("--run-dir").arg(dir.join(run)).output().unwrap()
    };
    let out = train("builtin", &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = metrics(&dir.join("builtin"));
    assert_eq!(steps_of(&m, "rl"), [1, 2]);
    // The prompt went through the chat template: Qwen's default system message comes first.
    let prompt_len = m[0]["prompt_length/min"].as_f64().unwrap();
    assert!(prompt_len > 150.0, "{prompt_len}");
    let logged =
        std::fs::read_to_string(dir.join("builtin/generations/rl/step_000002.jsonl")).unwrap();
    assert!(logged.contains("Let's think step by step"), "{logged}");
    // The custom reward gets each row's data_source and extra_info (it raises otherwise), and
    // scores as the built-in rule does: the runs are equal row for row.
    let out = train(
        "custom",
        &["stages.rl.reward={type: python, path: ../reward.py, function: compute_score}"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let comparable = |run: &str| comparable(&dir.join(run));
    assert_eq!(comparable("custom"), comparable("builtin"));
    let custom = metrics(&dir.join("custom"));
    assert!(
        custom
            .iter()
            .filter(|v| v["stage"] == "rl")
            .all(|v| v["reward/failed"] == 0.0),
        "{custom:?}"
    );
    // A conversation needs a chat template: without one the run is refused before it starts,
    // naming the file and the row.
    std::fs::remove_file(dir.join("qwen/chat_template.jinja")).unwrap();
    let out = train("no-template", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("stages[0].data.prompt_key: ")
            && err.contains("train.parquet: row 1: the prompt is a conversation"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Qwen2.5-Instruct's chat template, the branch without tools (as shipped).
const QWEN25_TEMPLATE: &str = "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

#[test]
fn chat_templates_render_prompts_from_the_checkpoint() {
    let dir = run_dir("chat");
    // A checkpoint to start from: the tiny recipe's SFT stage, briefly.
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .args(["--quiet", "-o", "stages.warmup.trainer.steps=3"])
            .args(["-o", "stages.rl.trainer.steps=1", "--run-dir"])
            .arg(dir.join("base")),
    );
    let out = run_ok(trellis().arg("status").arg(dir.join("base")).arg("--json")).stdout;
    let status: Value = serde_json::from_slice(&out).unwrap();
    let ck = dir
        .join("base")
        .join(status["job"]["progress"]["checkpoint"].as_str().unwrap());
    // The first SFT loss under three templates: none, the identity, and one that prefixes "00".
    let loss_with = |template: Option<&str>, tag: &str| -> f64 {
        let cfg = match template {
            Some(t) => serde_json::json!({"chat_template": t, "eos_token": "<eos>"}),
            None => serde_json::json!({}),
        };
        std::fs::write(ck.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let wf = format!(
            "name: chat\nmodel: {{path: {}}}\nstages:\n  - id: sft\n    kind: sft\n    data: {{task: arith, digits: 1, eval_size: 5, chat_template: {}}}\n    sft: {{batch_size: 8}}\n    trainer: {{steps: 1}}\n",
            ck.display(),
            template.is_some()
        );
        let f = dir.join(format!("{tag}.yaml"));
        std::fs::write(&f, wf).unwrap();
        run_ok(
            trellis()
                .arg("train")
                .arg(&f)
                .args(["--quiet", "--run-dir"])
                .arg(dir.join(tag)),
        );
        metrics(&dir.join(tag))[0]["sft/loss"].as_f64().unwrap()
    };
    let plain = loss_with(None, "plain");
    let identity = loss_with(Some("{{ messages[0]['content'] }}"), "identity");
    let prefixed = loss_with(
        Some("{% for m in messages %}00{{ m.content.strip() }}{% endfor %}"),
        "prefixed",
    );
    assert_eq!(plain, identity, "the identity template changes nothing");
    assert_ne!(plain, prefixed, "the template's prefix reaches the model");
    // Asking for a template the checkpoint lacks stops the run before it starts.
    std::fs::write(ck.join("tokenizer_config.json"), "{}").unwrap();
    let out = trellis()
        .arg("train")
        .arg(dir.join("identity.yaml"))
        .arg("--run-dir")
        .arg(dir.join("none"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tokenizer_config.json: no chat_template"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_recipe_resolves_and_the_gsm8k_one_finds_its_files() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes");
    for entry in std::fs::read_dir(&root).unwrap() {
        let f = entry.unwrap().path();
        if f.extension().is_some_and(|e| e == "yaml") && !f.to_string_lossy().contains("gsm8k") {
            run_ok(trellis().args(["config", "show"]).arg(&f));
        }
    }
    // The GSM8K recipe, laid out as its header says: a model folder and HF's parquet files
    // beside the recipes folder.
    let dir = run_dir("gsm8k-layout");
    std::fs::create_dir_all(dir.join("recipes")).unwrap();
    let recipe = dir.join("recipes/grpo-gsm8k-qwen2.5-0.5b.yaml");
    std::fs::copy(root.join("grpo-gsm8k-qwen2.5-0.5b.yaml"), &recipe).unwrap();
    let missing = trellis()
        .args(["config", "show"])
        .arg(&recipe)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(
        err.contains("Qwen2.5-0.5B-Instruct` is not a Hugging Face checkpoint folder"),
        "{err}"
    );
    let model = dir.join("models/Qwen2.5-0.5B-Instruct");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}").unwrap();
    // The run needs the checkpoint's tokenizer: the plan reads it before anything runs.
    std::fs::copy(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-qwen2/checkpoint/tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        model.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"}"#,
    )
    .unwrap();
    // HF's GSM8K parquet files, stood in for by GSM8K-shaped files pyarrow wrote (40 and 40
    // rows with `question` and `answer` columns).
    std::fs::create_dir_all(dir.join("data/gsm8k")).unwrap();
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/parquet");
    std::fs::copy(
        fixtures.join("snappy.parquet"),
        dir.join("data/gsm8k/train-00000-of-00001.parquet"),
    )
    .unwrap();
    std::fs::copy(
        fixtures.join("plain-v2.parquet"),
        dir.join("data/gsm8k/test-00000-of-00001.parquet"),
    )
    .unwrap();
    let out = run_ok(trellis().args(["config", "show"]).arg(&recipe)).stdout;
    let v: Value = serde_json::from_slice(&out).unwrap();
    // One epoch of 40 rows at 64 prompts a step.
    assert_eq!(v["stages"][0]["trainer"]["steps"], 1);
    assert!(
        v["stages"][0]["data"]["prompt_template"]
            .as_str()
            .unwrap()
            .starts_with("{prompt} Let's think step by step")
    );
    assert_eq!(v["stages"][0]["reward"]["type"], "gsm8k");

    // The model as a Hub id, VeRL's way: found in the Hugging Face cache where transformers put
    // it (HF_HUB_CACHE here), or refused with how to download it.
    let hub = dir.join("hub");
    let by_id = |cache: &Path| {
        trellis()
            .args([
                "config",
                "show",
                "-o",
                "model.path=Qwen/Qwen2.5-0.5B-Instruct",
            ])
            .arg(&recipe)
            .env("HF_HUB_CACHE", cache)
            .output()
            .unwrap()
    };
    let out = by_id(&hub);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("model.path: `Qwen/Qwen2.5-0.5B-Instruct` is not a folder beside the workflow and is not in the Hugging Face cache")
            && err.contains("hf download Qwen/Qwen2.5-0.5B-Instruct"),
        "{err}"
    );
    let repo = hub.join("models--Qwen--Qwen2.5-0.5B-Instruct");
    let snapshot = repo.join("snapshots/7ae557604adf67be50417f59c2c2f167def9a775");
    std::fs::create_dir_all(snapshot.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(&model, &snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(
        repo.join("refs/main"),
        "7ae557604adf67be50417f59c2c2f167def9a775",
    )
    .unwrap();
    let out = by_id(&hub);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model"]["path"], snapshot.display().to_string());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ctrl_c_checkpoints_the_current_step_and_resume_finishes() {
    // Checkpoints in bf16 (what serving engines load): resuming continues from the f32 weights
    // kept beside the optimiser, so the run equals one that was never stopped.
    let settings = [
        "-o",
        "stages.rl.trainer.steps=40",
        "-o",
        "stages.rl.trainer.save_dtype=bf16",
    ];
    let dir = run_dir("sigint");
    let mut child = trellis()
        .arg("train")
        .arg(recipe())
        .arg("--quiet")
        .args(settings)
        .arg("--run-dir")
        .arg(&dir)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !dir.join("checkpoints/rl").exists() {
        assert!(t0.elapsed() < PATIENCE, "no RL checkpoint");
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended before its first RL checkpoint: {status}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "stopped by the user: {err}");
    assert!(err.contains("stopped on request after rl step"), "{err}");
    let status: Value =
        serde_json::from_slice(&run_ok(trellis().arg("status").arg(&dir).arg("--json")).stdout)
            .unwrap();
    assert_eq!(status["job"]["state"], "cancelled", "{status:#}");
    let at = status["job"]["progress"]["step"].as_u64().unwrap();
    assert_eq!(status["job"]["progress"]["stage"], "rl");
    assert!(
        err.contains(&format!("rl step {at} (checkpointed)")),
        "{err}"
    );
    let ck = dir.join(status["job"]["progress"]["checkpoint"].as_str().unwrap());
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert!(ck.join("optimizer/master.safetensors").is_file());
    run_ok(trellis().arg("resume").arg(&dir).arg("--quiet"));
    let m = metrics(&dir);
    assert_eq!(steps_of(&m, "rl"), (1..=40).collect::<Vec<_>>());
    let straight = run_dir("sigint-straight");
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .arg("--quiet")
            .args(settings)
            .arg("--run-dir")
            .arg(&straight),
    );
    assert_eq!(
        comparable(&dir),
        comparable(&straight),
        "the stop changed the run"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&straight).unwrap();
}

/// Metrics computed from the weights' arithmetic: with the batch cut across learner ranks
/// the gradients add up in another order, so these agree to float precision, not bit for bit.
/// The rest — sampled lengths, scores, rewards, accuracies — must be equal.
fn from_arithmetic(key: &str) -> bool {
    key.starts_with("actor/")
        || key == "sft/loss"
        || key.starts_with("rollout/logprob_diff")
        || ["values", "advantages", "returns", "grad_norm", "vf_"]
            .iter()
            .any(|p| key.starts_with(&format!("critic/{p}")))
}

/// `pools.learner.count: N` trains the policy on N data-parallel learner actors: each
/// mini-batch cut into N shares with the whole mini-batch's normalisers, the ranks' gradients
/// summed (by the ranks among themselves — through shared memory or over TCP streams — or by
/// the driver), one optimiser decision on every rank. So the run is the one-learner run up to the
/// rounding of another summation order, which a whole run carries from step to step — with the
/// optimiser's state sharded across the ranks (ZeRO-1) or replicated on each: the same
/// sampled tokens, rewards and accuracies; GRPO's losses within 1e-5 (its gradient norm, the
/// most sensitive, within 1e-3); PPO — its critic on as many ranks — within 1e-2 (the critic
/// learns from the policy's values, and whitening its advantages divides the difference by
/// their spread). A ranked run killed with -9 resumes from its checkpoint (the optimiser's
/// moments, and PPO's critic with its own, handed back to every rank) to exactly the
/// undisturbed ranked run.
#[test]
fn learner_ranks_train_as_one_learner_and_resume_from_their_checkpoints() {
    let ranked = |dir: &Path, ranks: usize, args: &[&str], more: &[&str]| {
        let mut cmd = trellis();
        cmd.arg("train")
            .arg(recipe())
            .args(["--quiet", "--run-dir"])
            .arg(dir)
            .args(args)
            .args(more)
            .args(["-o", &format!("pools.learner.count={ranks}")]);
        cmd
    };
    // ZeRO-1 (the default) and replicated optimiser state alike; the ranks summing through
    // shared memory (the default on one host), over TCP streams, or the driver summing.
    let replicas = ["-o", "pools.learner.shard_optimizer=false"];
    let streams = ["-o", "pools.learner.allreduce=streams"];
    let driver = ["-o", "pools.learner.allreduce=driver"];
    let grpo_ranks = [
        (2, &[][..]),
        (3, &streams[..]),
        (2, &replicas[..]),
        (2, &driver[..]),
    ];
    for (algo, args, ranks, loss_tol) in [
        ("grpo", &[][..], &grpo_ranks[..], 1e-5),
        ("ppo", &PPO[..], &grpo_ranks[..1], 1e-2),
    ] {
        let one = run_dir(&format!("{algo}-ranks-1"));
        run_ok(&mut ranked(&one, 1, args, &[]));
        let reference = comparable(&one);
        for &(n, more) in ranks {
            let dir = run_dir(&format!("{algo}-ranks-{n}"));
            let out = run_ok(&mut ranked(&dir, n, args, more));
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(
                said.contains(&format!("learner ranks: {}", vec!["local"; n].join(", "))),
                "{said}"
            );
            let rows = comparable(&dir);
            assert_eq!(rows.len(), reference.len());
            for (got, want) in rows.iter().zip(&reference) {
                let (got, want) = (got.as_object().unwrap(), want.as_object().unwrap());
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    want.keys().collect::<Vec<_>>()
                );
                for (k, w) in want {
                    let g = &got[k];
                    if !from_arithmetic(k) {
                        assert_eq!(g, w, "{algo} on {n} ranks: {k} at {want:?}");
                        continue;
                    }
                    let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
                    let tol = if k == "actor/grad_norm" {
                        1e-3
                    } else {
                        loss_tol
                    };
                    assert!(
                        (g - w).abs() <= tol * w.abs().max(1.0),
                        "{algo} on {n} ranks: {k} {g} vs {w} at step {} of {}",
                        want["step"],
                        want["stage"]
                    );
                }
            }
            if n != 2 || !more.is_empty() {
                std::fs::remove_dir_all(&dir).unwrap();
                continue;
            }
            // kill -9 inside the RL stage, then resume: every rank gets the checkpoint's
            // weights and optimiser state back, and the run ends as the undisturbed one did.
            let killed = run_dir(&format!("{algo}-ranks-killed"));
            let mut child = ranked(&killed, 2, args, &[])
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            kill_at_rl_checkpoint(&mut child, &killed);
            run_ok(trellis().arg("resume").arg(&killed).arg("--quiet"));
            assert_eq!(comparable(&killed), rows, "the resumed ranked run");
            for d in [&dir, &killed] {
                std::fs::remove_dir_all(d).unwrap();
            }
        }
        std::fs::remove_dir_all(&one).unwrap();
    }
}
