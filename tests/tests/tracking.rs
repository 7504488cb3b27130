//! Experiment trackers as their users run them: a real MLflow tracking server (`mlflow server`
//! from PyPI, in the venv `.ci/setup trackers` makes) receives a run's curves — one parent run,
//! a child run per stage, every metric of `metrics.jsonl` once per step, across a kill -9 and a
//! resume — and an unusable tracker stops the run before it trains.

use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use trellis_tests::{PATIENCE, run_ok, trellis};

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
            // No background job runner (ten worker processes the test does not use).
            .env("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
            // Its own process group, so that the server's processes (uvicorn under the mlflow
            // command) end with it.
            .process_group(0)
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
                start.elapsed() < PATIENCE,
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
        // SAFETY: signalling the process group this test started.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
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
    json_of(python, script, &[uri.as_ref(), experiment.as_ref()])
}

/// What the Python `script`, run with `args`, prints as JSON.
fn json_of(python: &Path, script: &str, args: &[&std::ffi::OsStr]) -> Vec<Value> {
    let out = Command::new(python)
        .args(["-c", script])
        .args(args)
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
    trellis_tests::wait_for_rl_checkpoint(&mut child, &run);
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
        assert_eq!(child.len(), 1, "{stage}: one run: {runs:#?}");
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
            "{stage}: every key: {runs:#?}"
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

/// The offline runs wandb wrote under `wandb_dir` (what `wandb sync` uploads), read from their
/// transaction logs (`run-*.wandb`: LevelDB log framing of wandb's protobuf records): each run's
/// name, group, job type, config and history rows.
fn wandb_runs(python: &Path, wandb_dir: &Path) -> Vec<Value> {
    let script = r#"
import glob, json, struct, sys
from wandb.proto import wandb_internal_pb2 as pb

def records(path):
    b = open(path, "rb").read()
    ident, magic, _ = struct.unpack("<4sHB", b[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    pos, buf = 7, b""
    while pos + 7 <= len(b):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", b[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        data = b[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind == 1:
            yield data
        elif kind == 2:
            buf = data
        elif kind == 3:
            buf += data
        elif kind == 4:
            yield buf + data

out = []
for f in sorted(glob.glob(sys.argv[1] + "/wandb/offline-run-*/run-*.wandb")):
    run = {"history": []}
    for data in records(f):
        r = pb.Record()
        r.ParseFromString(data)
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run.update(id=r.run.run_id, name=r.run.display_name, group=r.run.run_group,
                       job_type=r.run.job_type,
                       config={u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "history":
            run["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in r.history.item})
    out.append(run)
print(json.dumps(out))
"#;
    json_of(python, script, &[wandb_dir.as_os_str()])
}

/// The offline wandb runs `runs` hold the rows of `metrics` (a `metrics.jsonl`): one run per
/// stage of the tiny recipe in `group`, the workflow as config, every step once with its values.
fn assert_wandb_holds(runs: &[Value], metrics: &Path, group: &str) {
    let rows: Vec<Value> = std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(runs.len(), 3, "{runs:#?}");
    for stage in ["warmup", "rl", "final-eval"] {
        let r: Vec<&Value> = runs.iter().filter(|r| r["name"] == stage).collect();
        assert_eq!(r.len(), 1, "{stage}");
        let r = r[0];
        assert_eq!(
            (&r["group"], &r["job_type"]),
            (&group.into(), &stage.into())
        );
        assert_eq!(
            r["config"]["name"], "tiny-arith",
            "the workflow is the config"
        );
        let stage_rows: Vec<&Value> = rows.iter().filter(|v| v["stage"] == stage).collect();
        let history = r["history"].as_array().unwrap();
        assert_eq!(history.len(), stage_rows.len(), "{stage}: every step once");
        for (h, row) in history.iter().zip(&stage_rows) {
            assert_eq!(h["_step"], row["step"], "{stage}");
            for (k, v) in row.as_object().unwrap() {
                if k != "stage" && k != "step" {
                    assert_eq!(
                        h[k].as_f64(),
                        v.as_f64(),
                        "{stage} step {} {k}",
                        row["step"]
                    );
                }
            }
        }
    }
}

/// `python -m trellis_client ARGS` from this checkout, with wandb offline into `dir`.
fn client(python: &Path, dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(python);
    cmd.args(["-m", "trellis_client"])
        .args(args)
        .env(
            "PYTHONPATH",
            trellis_tests::root().join("clients/python/src"),
        )
        .env("WANDB_MODE", "offline")
        .env("WANDB_DIR", dir)
        .env("WANDB_SILENT", "true")
        .current_dir(dir);
    cmd
}

#[test]
fn the_wandb_sidecar_follows_a_run_and_logs_every_step_once() {
    let Some(python) = trellis_tests::trackers() else {
        return;
    };
    let dir = trellis_tests::scratch("wandb");
    let run = dir.join("run");
    let sidecar = |follow: bool| {
        let mut cmd = client(&python, &dir, &["--json", "wandb"]);
        cmd.arg(&run).args(["--project", "trellis-e2e"]);
        if follow {
            cmd.arg("--follow");
        }
        cmd
    };
    let mut train = trellis()
        .arg("train")
        .arg(recipe())
        .args(["--quiet", "--run-dir"])
        .arg(&run)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Started while the run goes, the sidecar follows it to its end.
    let start = Instant::now();
    while !run.join("status.json").exists() {
        assert!(start.elapsed() < PATIENCE, "the run did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    let follower = sidecar(true)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(train.wait().unwrap().success());
    let out = follower.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let logged: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        logged["logged"],
        serde_json::json!({"warmup": 30, "rl": 12, "final-eval": 1})
    );
    assert_wandb_holds(
        &wandb_runs(&python, &dir),
        &run.join("metrics.jsonl"),
        "run",
    );
    // Syncing again logs nothing twice; a folder that is no run is refused by name.
    let again = sidecar(false).output().unwrap();
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let logged: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(logged["logged"], serde_json::json!({}));
    assert_eq!(wandb_runs(&python, &dir).len(), 3);
    let out = client(&python, &dir, &["wandb"])
        .arg(dir.join("nowhere"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("nowhere: no such run directory"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_wandb_sidecar_follows_a_server_job_through_the_api() {
    let Some(python) = trellis_tests::trackers() else {
        return;
    };
    let dir = trellis_tests::scratch("wandb-job");
    let data = dir.join("data");
    let mut server = trellis_tests::Killed(
        trellis()
            .args([
                "--log",
                "warn",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
            ])
            .arg(&data)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = trellis_tests::listening(&mut server.0);
    let out = run_ok(trellis().args(["submit", "--server", &url]).arg(recipe()));
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    // Followed from the moment it is submitted until it ends.
    let out = client(
        &python,
        &dir,
        &["--server", &url, "--json", "wandb", "--job", &id],
    )
    .args(["--project", "trellis-e2e", "--follow"])
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let logged: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        logged["logged"],
        serde_json::json!({"warmup": 30, "rl": 12, "final-eval": 1})
    );
    let job_dir = data.join("jobs").join(&id);
    assert_wandb_holds(
        &wandb_runs(&python, &dir),
        &job_dir.join("metrics.jsonl"),
        &format!("job-{id}"),
    );
    assert!(dir.join(format!("trellis-wandb-job-{id}.json")).is_file());
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
