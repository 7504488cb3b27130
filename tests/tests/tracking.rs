//! Experiment trackers as their users run them: a real MLflow tracking server (`mlflow server`
//! from PyPI, in the venv `.ci/setup trackers` makes) receives a run's curves — one parent run,
//! a child run per stage, every metric of `metrics.jsonl` once per step, across a kill -9 and a
//! resume — and an unusable tracker stops the run before it trains.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use trellis_tests::{run_ok, trellis};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-arith.yaml")
}

/// An `mlflow server` on a free port, stopped when dropped.
struct Server {
    child: Child,
    uri: String,
}

impl Server {
    fn start(python: &Path, dir: &Path) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        std::fs::create_dir_all(dir).unwrap();
        let child = Command::new(python)
            .args([
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--workers",
                "1",
            ])
            .args(["--port", &port.to_string()])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("server.log")).unwrap())
            .spawn()
            .unwrap();
        let server = Self {
            child,
            uri: format!("http://127.0.0.1:{port}"),
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "mlflow server did not start: {}",
                std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the server holds for `experiment`, read with MLflow's own client: each run's name,
/// parent, status, params, and every metric's history as `[step, value]`.
fn read_back(python: &Path, uri: &str, experiment: &str) -> Vec<Value> {
    let script = r#"
import json, sys
from mlflow import MlflowClient
c = MlflowClient(sys.argv[1])
e = c.get_experiment_by_name(sys.argv[2])
out = []
for r in c.search_runs([e.experiment_id]):
    hist = {k: [[m.step, m.value] for m in sorted(c.get_metric_history(r.info.run_id, k), key=lambda m: m.step)]
            for k in r.data.metrics}
    out.append({"id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
                "parent": r.data.tags.get("mlflow.parentRunId"), "params": r.data.params, "metrics": hist})
print(json.dumps(out))
"#;
    let out = Command::new(python)
        .args(["-c", script, uri, experiment])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn metrics_reach_a_real_mlflow_server_once_each_across_a_kill_and_resume() {
    let Some(python) = trellis_tests::trackers() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("trellis-mlflow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server = Server::start(&python, &dir.join("server"));
    let run = dir.join("run");
    let tracked = |cmd: &mut Command| {
        cmd.args(["-o", &format!("tracking.mlflow.uri={}", server.uri)])
            .args(["-o", "tracking.mlflow.experiment=trellis e2e"]);
    };
    let mut train = trellis();
    train
        .arg("train")
        .arg(recipe())
        .args(["--quiet", "--run-dir"])
        .arg(&run);
    tracked(&mut train);
    let mut child = train.stderr(Stdio::null()).spawn().unwrap();
    // Kill -9 inside the RL stage, after a checkpoint (steps after it run again on resume).
    let start = Instant::now();
    while !run
        .join("checkpoints/rl/step_000004/trainer_state.json")
        .exists()
    {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no RL checkpoint"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    child.kill().unwrap();
    child.wait().unwrap();
    run_ok(trellis().arg("resume").arg(&run).arg("--quiet"));

    let runs = read_back(&python, &server.uri, "trellis e2e");
    let parents: Vec<&Value> = runs.iter().filter(|r| r["parent"].is_null()).collect();
    assert_eq!(parents.len(), 1, "one parent run, resumed into: {runs:#?}");
    let parent = parents[0];
    assert_eq!(parent["name"], "run");
    assert_eq!(parent["status"], "FINISHED");
    assert_eq!(parent["params"]["name"], "tiny-arith");
    assert_eq!(parent["params"]["stages.1.algorithm.lr"], "0.0001");
    let rows: Vec<Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for stage in ["warmup", "rl", "final-eval"] {
        let child: Vec<&Value> = runs.iter().filter(|r| r["name"] == stage).collect();
        assert_eq!(child.len(), 1, "{stage}: one run");
        let child = child[0];
        assert_eq!(child["parent"], parent["id"], "{stage}");
        assert_eq!(child["status"], "FINISHED", "{stage}");
        let stage_rows: Vec<&Value> = rows.iter().filter(|r| r["stage"] == stage).collect();
        let keys: std::collections::BTreeSet<&String> = stage_rows
            .iter()
            .flat_map(|r| r.as_object().unwrap().keys())
            .filter(|k| *k != "stage" && *k != "step")
            .collect();
        assert_eq!(
            child["metrics"].as_object().unwrap().len(),
            keys.len(),
            "{stage}: every key"
        );
        for k in keys {
            // Every step once; the values the run recorded (timings differ between the run
            // before the kill and after it, so only their steps are compared).
            let want: Vec<Value> = stage_rows
                .iter()
                .filter(|r| r.get(k.as_str()).is_some())
                .map(|r| serde_json::json!([r["step"], r[k.as_str()]]))
                .collect();
            let got = child["metrics"][k.as_str()].as_array().unwrap();
            if k.starts_with("timing_s/") || k.starts_with("perf/") {
                let steps = |v: &[Value]| v.iter().map(|p| p[0].clone()).collect::<Vec<_>>();
                assert_eq!(steps(got), steps(&want), "{stage} {k}");
            } else {
                assert_eq!(got, &want, "{stage} {k}");
            }
        }
    }

    // A tracker that cannot be used stops the run before it trains, naming it.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let out = trellis()
        .arg("train")
        .arg(recipe())
        .args(["-o", &format!("tracking.mlflow.uri={dead}")])
        .arg("--run-dir")
        .arg(dir.join("dead"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&format!("tracking.mlflow ({dead})")), "{err}");
    assert!(
        !dir.join("dead/metrics.jsonl").exists()
            || std::fs::read_to_string(dir.join("dead/metrics.jsonl"))
                .unwrap()
                .is_empty()
    );
    // Not an HTTP server: refused when the workflow is read.
    let out = trellis()
        .args(["config", "show"])
        .arg(recipe())
        .args(["-o", "tracking.mlflow.uri=file:///tmp/mlruns"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("tracking.mlflow.uri: `file:///tmp/mlruns` is not an http:// or https:// URL"),
        "{err}"
    );
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
