//! `pools.learner.engine: pjrt` as a user runs it: `trellis train` with the learner compiled to
//! StableHLO and run by the XLA CPU plugin (`xla-cpu-pjrt`, which `.ci/setup` fetches under
//! target/pjrt the first time a test needs it; `TRELLIS_SKIP_PJRT=1` skips these tests, saying
//! so).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use trellis_tests::{run_ok, trellis};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-arith.yaml")
}

fn run_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trellis-pjrt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn have_plugin() -> bool {
    libtpu_sys::testing::cpu_plugin().is_some()
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {v}"))
}

const PJRT: [&str; 4] = [
    "-o",
    "pools.learner.engine=pjrt",
    "-o",
    "pools.rollout.engine=pjrt",
];
const SHORT: [&str; 4] = [
    "-o",
    "stages.rl.trainer.steps=8",
    "-o",
    "stages.rl.trainer.save_freq=2",
];

/// The same recipe on native engines and on pjrt engines (learner and rollout): the same SFT
/// losses and gradient norms, the same rewards in RL (weights and logits agree so closely that
/// sampling picks the same tokens), the same eval accuracy; the pjrt learner data-parallel on
/// two devices of the plugin (`pools.learner.count: 2`: each batch's rows split over them,
/// gradients summed by the program's all-reduce) follows the one-device run; then a pjrt run
/// killed -9 inside RL and resumed (moments restored from the checkpoint onto the device) ends
/// where the uninterrupted one did.
#[test]
fn a_run_on_pjrt_engines_equals_the_native_run_and_resumes_after_kill_9() {
    if !have_plugin() {
        return;
    }
    let (native, pjrt, killed) = (run_dir("native"), run_dir("pjrt"), run_dir("killed"));
    let two = run_dir("two-devices");
    // The recipe, shortened, with `args`, into `dir`.
    let train = |args: &[&str], dir: &Path| {
        run_ok(
            trellis()
                .arg("train")
                .arg(recipe())
                .arg("--quiet")
                .args(SHORT)
                .args(args)
                .arg("--run-dir")
                .arg(dir),
        )
    };
    train(&[], &native);
    let out = train(&PJRT, &pjrt);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("learner on the pjrt engine") && err.contains("rollout engine on pjrt"),
        "{err}"
    );
    // One PJRT client in the process, the learner's and the rollout engine's (as one process
    // owns a TPU host's chips).
    let serial = |line: &str, after: &str| -> String {
        let at = err
            .lines()
            .find(|l| l.contains(line))
            .and_then(|l| l.split(after).nth(1))
            .unwrap_or_else(|| panic!("no `{line}` with `{after}` in {err}"));
        at.chars().take_while(char::is_ascii_digit).collect()
    };
    assert_eq!(
        serial("learner on the pjrt engine", "pjrt client "),
        serial("rollout engine on pjrt", "client="),
        "{err}"
    );
    let (mn, mp) = (metrics(&native), metrics(&pjrt));
    assert_eq!(mn.len(), mp.len());
    // Every RL update's new weights went to the engine on the learner's device, never read
    // to the host; the native run's engine shares the learner's host memory instead.
    let on_device = |rows: &[Value]| {
        rows.iter()
            .filter(|r| r.get("actor/pg_loss").is_some())
            .map(|r| r.get("perf/weight_sync_on_device").and_then(Value::as_f64))
            .collect::<Vec<_>>()
    };
    assert!(on_device(&mp).iter().all(|v| *v == Some(1.0)), "{mp:?}");
    assert!(on_device(&mn).iter().all(Option::is_none), "{mn:?}");
    assert!(!on_device(&mp).is_empty());
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * (1.0 + b.abs());
    for (n, p) in mn.iter().zip(&mp) {
        assert_eq!((&n["stage"], &n["step"]), (&p["stage"], &p["step"]));
        for k in ["sft/loss", "actor/grad_norm", "actor/pg_loss"] {
            if n.get(k).is_some() {
                assert!(
                    close(num(p, k), num(n, k), 1e-3),
                    "{k}: pjrt {p} vs native {n}"
                );
            }
        }
        for k in ["critic/score/mean", "eval/accuracy"] {
            if n.get(k).is_some() {
                assert_eq!(num(p, k), num(n, k), "{k}: pjrt {p} vs native {n}");
            }
        }
    }
    // Two devices: the same run to the rounding of the gradient sums' order; the engine placed
    // as a user who wants it on the learner's device says it (`colocate`: in its process).
    let out = train(
        &[
            &PJRT[..],
            &["-o", "pools.learner.count=2"],
            &["-o", "pools.rollout.placement=colocate"],
        ]
        .concat(),
        &two,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("data-parallel on 2 devices"), "{err}");
    let m2 = metrics(&two);
    assert_eq!(m2.len(), mp.len());
    assert_eq!(
        on_device(&m2),
        on_device(&mp),
        "2 devices: weights on the device"
    );
    for (t, p) in m2.iter().zip(&mp) {
        for k in [
            "sft/loss",
            "actor/grad_norm",
            "actor/pg_loss",
            "actor/entropy",
        ] {
            if p.get(k).is_some() {
                // The order's rounding compounds over the steps: 1.7e-4 on `actor/grad_norm`
                // at SFT step 28 with the XLA CPU plugin on an AVX2 EPYC.
                assert!(
                    close(num(t, k), num(p, k), 1e-3),
                    "{k}: 2 devices {t} vs 1 {p}"
                );
            }
        }
        for k in ["critic/score/mean", "eval/accuracy", "response_length/mean"] {
            if p.get(k).is_some() {
                assert_eq!(num(t, k), num(p, k), "{k}: 2 devices {t} vs 1 {p}");
            }
        }
    }
    // Kill -9 after an RL checkpoint, resume on the device, compare.
    let mut child = trellis()
        .arg("train")
        .arg(recipe())
        .arg("--quiet")
        .args(SHORT)
        .args(PJRT)
        .arg("--run-dir")
        .arg(&killed)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    trellis_tests::kill_at_rl_checkpoint(&mut child, &killed);
    // The device's moments were copied into the checkpoint's optimiser state.
    let m = std::fs::metadata(killed.join("checkpoints/rl/step_000004/optimizer/m.safetensors"))
        .unwrap();
    assert!(m.len() > 1000);
    run_ok(trellis().arg("resume").arg(&killed).arg("--quiet"));
    let mk = metrics(&killed);
    assert_eq!(mk.len(), mp.len(), "no step lost or doubled");
    let strip = |v: &Value| {
        let mut v = v.clone();
        v.as_object_mut()
            .unwrap()
            .retain(|k, _| !k.starts_with("timing_s/") && !k.starts_with("perf/"));
        v
    };
    for (k, p) in mk.iter().zip(&mp) {
        let (k, p) = (strip(k), strip(p));
        for (key, want) in p.as_object().unwrap() {
            match (want.as_f64(), k[key].as_f64()) {
                (Some(w), Some(g)) => assert!(close(g, w, 1e-4), "{key}: resumed {k} vs {p}"),
                _ => assert_eq!(&k[key], want, "{key}"),
            }
        }
    }
    for d in [native, pjrt, killed, two] {
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn a_learner_device_that_cannot_be_had_is_refused_before_the_run_starts() {
    if !have_plugin() {
        return;
    }
    let dir = run_dir("bad");
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "-o",
                "pools.learner.engine=pjrt",
                "-o",
                "pools.learner.plugin=/nonexistent/libtpu.so",
            ],
            "/nonexistent/libtpu.so",
        ),
        (
            &[
                "-o",
                "pools.learner.engine=pjrt",
                "-o",
                "pools.learner.device=tpu",
            ],
            "runs on `cpu`",
        ),
        (
            &[
                "-o",
                "pools.rollout.engine=pjrt",
                "-o",
                "pools.rollout.device=tpu",
            ],
            "pools.rollout: the device is tpu",
        ),
        (
            &["-o", "pools.learner.plugin=/x.so"],
            "pools.learner.plugin: is for engine: pjrt",
        ),
    ];
    for (args, want) in cases {
        // The CPU plugin is found for `device: tpu` only through TRELLIS_PJRT_PLUGIN.
        let plugin = libtpu_sys::testing::cpu_plugin().unwrap();
        let out = trellis()
            .arg("train")
            .arg(recipe())
            .arg("--quiet")
            .args(args)
            .arg("--run-dir")
            .arg(&dir)
            .env("TRELLIS_PJRT_PLUGIN", &plugin)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!dir.exists(), "{args:?}: nothing may run");
    }
}

/// `trellis bench train --engine pjrt` as a user runs it (a small model): the pjrt step beside
/// the native one, and the trained weights handed to a rollout engine on the device both ways —
/// through the host, as a push did before, and on the device, as `trellis train` does now.
#[test]
fn bench_train_times_the_pjrt_step_and_the_hand_over_both_ways() {
    if !have_plugin() {
        return;
    }
    let plugin = libtpu_sys::testing::cpu_plugin().unwrap();
    let out = run_ok(
        trellis()
            .args(["--log", "warn", "bench", "train", "--engine", "pjrt"])
            .args([
                "--hidden", "64", "--layers", "2", "--heads", "2", "--vocab", "256",
            ])
            .args(["--batch", "2", "--seq", "16", "--steps", "2", "--json"])
            .arg("--plugin")
            .arg(plugin),
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = &r["pjrt"];
    assert_eq!(p["platform"], "cpu", "{r}");
    for key in [
        "step_seconds_median",
        "tokens_per_second",
        "handover_via_host_seconds",
        "handover_on_device_seconds",
    ] {
        assert!(p[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {r}");
    }
    assert!(r["tokens_per_second"].as_f64().unwrap() > 0.0, "{r}");
}
