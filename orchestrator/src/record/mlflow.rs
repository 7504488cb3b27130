//! MLflow tracking over its REST API (`/api/2.0/mlflow/...`): a run's curves in an MLflow
//! server, as VeRL's `trainer.logger: [mlflow]` puts them.
//!
//! Layout: the workflow's `tracking.mlflow.experiment` (default: its `name`) holds one parent run
//! per Trellis run (named after the run directory; the resolved workflow as its params, flattened
//! to dotted keys) and one nested child run per stage (tag `mlflow.parentRunId`), whose metrics
//! carry VeRL's keys with the stage's own steps — as TensorBoard gets one run per stage.
//!
//! Every run is tagged with its run directory (`trellis.run_dir`): a resumed run finds its runs
//! on the server and logs into them, each stage after the last step the server holds, so a step
//! logged before a kill — even one killed between the call and anything written here — is not
//! logged twice; and a resumed run first sends the rows it kept, so one a kill caught in the
//! queue is not lost either. The ids are also written to `RUN_DIR/mlflow.json`, for people to
//! find them.
//! Rows go to the server from a thread of their own: training never waits on the tracking server. A server that does not answer
//! keeps the rows queued and retried (a warning says so), and the run ends with what could be
//! sent; only the first contact, when the run starts, must succeed (so a wrong URI stops the run
//! before it trains, naming the URI).
//!
//! Owns: the REST calls and `mlflow.json`. Never: decides what is recorded (the executor does).

use super::{RecordError, Recorder, Row};
use rollout::external::http::{ApiKey, HttpClient};
use serde_json::{Value, json};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

/// Where and under what names a run is tracked.
#[derive(Clone, Debug, PartialEq)]
pub struct MlflowTarget {
    /// The tracking server (`http[s]://host:port`).
    pub uri: String,
    /// The experiment's name.
    pub experiment: String,
}

/// The ids a run logs into (written to `mlflow.json` when its runs are made, for people to find
/// them; never read back: the server's tags are what a resumed run goes by).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
struct Ids {
    uri: String,
    experiment_id: String,
    run_id: String,
    /// The `trellis.run_dir` tag of every run of this run directory.
    run_dir: String,
    /// Per stage: its child run and the last step logged.
    stages: BTreeMap<String, StageRun>,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
struct StageRun {
    run_id: String,
    last_step: Option<u64>,
}

/// What the server holds of a run directory.
#[derive(Default)]
struct Found {
    parent: Option<String>,
    stages: BTreeMap<String, StageRun>,
}

impl Msg {
    /// A row to send now: its finite metrics under names MLflow accepts.
    fn row(stage: &str, step: u64, metrics: impl Iterator<Item = (String, f64)>) -> Self {
        Msg::Row {
            stage: stage.to_string(),
            step,
            metrics: metrics.filter(|(_, v)| v.is_finite()).collect(),
            at_ms: now_ms(),
        }
    }
}

enum Msg {
    Row {
        stage: String,
        step: u64,
        metrics: Vec<(String, f64)>,
        at_ms: u64,
    },
    Finish {
        status: &'static str,
        deadline: Duration,
    },
}

/// The sink: rows to a thread that sends them.
pub struct Mlflow {
    tx: Option<Sender<Msg>>,
    worker: Option<std::thread::JoinHandle<()>>,
    finished: bool,
}

/// Seconds a request may take.
const TIMEOUT: Duration = Duration::from_secs(20);
/// Metrics per `log-batch` call (MLflow's limit is 1000).
const BATCH: usize = 1000;
/// Params per call (MLflow's limit is 100).
const PARAMS: usize = 100;
/// Rows kept while the server does not answer; older ones are dropped past it.
const QUEUE: usize = 100_000;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn err(target: &MlflowTarget, msg: impl std::fmt::Display) -> RecordError {
    RecordError::Tracking(format!("tracking.mlflow ({}): {msg}", target.uri))
}

/// A name MLflow accepts as a metric key: letters, digits, `_ - . : /` and spaces.
fn key(k: &str) -> String {
    k.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-.:/ ".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `params` as dotted keys and text values (MLflow keeps 6000 characters of a value).
pub fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match v {
        Value::Object(m) => m.iter().for_each(|(k, v)| flatten(&join(k), v, out)),
        Value::Array(a) if a.iter().any(|x| x.is_object()) => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| flatten(&join(&i.to_string()), v, out)),
        Value::Null => {}
        Value::String(s) => out.push((key(prefix), s.chars().take(6000).collect())),
        // A setting held as f32 (learning rates) shows as written (`0.0001`), not as its f64
        // widening (`0.00009999999747378752`).
        Value::Number(n) if n.is_f64() => {
            let v = n.as_f64().unwrap_or_default();
            let text = if f64::from(v as f32) == v {
                format!("{}", v as f32)
            } else {
                format!("{v}")
            };
            out.push((key(prefix), text));
        }
        other => out.push((key(prefix), other.to_string().chars().take(6000).collect())),
    }
}

struct Client {
    http: HttpClient,
    rt: tokio::runtime::Runtime,
    target: MlflowTarget,
}

impl Client {
    fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let path = format!("/api/2.0/mlflow/{path}");
        self.rt
            .block_on(self.http.post_json(&path, body))
            .map_err(|e| e.to_string())
    }

    /// The experiment's id, made when it does not exist.
    fn experiment(&self) -> Result<String, String> {
        let name = &self.target.experiment;
        let path = "/api/2.0/mlflow/experiments/create";
        let (code, body) = self
            .rt
            .block_on(self.http.post_raw(path, &json!({ "name": name })))
            .map_err(|e| e.to_string())?;
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if (200..300).contains(&code) {
            return body["experiment_id"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("experiments/create answered {body}"));
        }
        if body["error_code"] != "RESOURCE_ALREADY_EXISTS" {
            return Err(format!("experiments/create: HTTP {code}: {body}"));
        }
        let got = self
            .rt
            .block_on(self.http.get_json(&format!(
                "/api/2.0/mlflow/experiments/get-by-name?experiment_name={}",
                percent(name)
            )))
            .map_err(|e| e.to_string())?;
        got["experiment"]["experiment_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("experiments/get-by-name answered {got}"))
    }

    fn create_run(
        &self,
        experiment_id: &str,
        name: &str,
        tags: &[(&str, &str)],
    ) -> Result<String, String> {
        let tags: Vec<Value> = tags
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        let got = self.post(
            "runs/create",
            &json!({"experiment_id": experiment_id, "run_name": name, "start_time": now_ms(), "tags": tags}),
        )?;
        got["run"]["info"]["run_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("runs/create answered {got}"))
    }

    /// The runs of `experiment_id` tagged with `run_dir`: the parent, and per stage its run
    /// and the last step it holds.
    fn search(&self, experiment_id: &str, run_dir: &str) -> Result<Found, String> {
        let mut found = Found::default();
        if run_dir.contains('\'') {
            return Ok(found);
        }
        let got = self.post(
            "runs/search",
            &json!({"experiment_ids": [experiment_id], "max_results": 1000,
                    "filter": format!("tags.`trellis.run_dir` = '{run_dir}'")}),
        )?;
        for run in got["runs"].as_array().into_iter().flatten() {
            let Some(id) = run["info"]["run_id"].as_str() else {
                continue;
            };
            let tag = |k: &str| {
                run["data"]["tags"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|t| t["key"] == k)
                    .and_then(|t| t["value"].as_str())
            };
            let last_step = run["data"]["metrics"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| {
                    m["step"]
                        .as_u64()
                        .or_else(|| m["step"].as_str()?.parse().ok())
                })
                .max();
            match tag("trellis.stage") {
                Some(stage) => {
                    found.stages.insert(
                        stage.to_string(),
                        StageRun {
                            run_id: id.to_string(),
                            last_step,
                        },
                    );
                }
                None if found.parent.is_none() => found.parent = Some(id.to_string()),
                None => {}
            }
        }
        Ok(found)
    }

    fn status(&self, run_id: &str, status: &str) -> Result<(), String> {
        let mut body = json!({"run_id": run_id, "status": status});
        if status != "RUNNING" {
            body["end_time"] = now_ms().into();
        }
        self.post("runs/update", &body).map(drop)
    }
}

/// `s` for a URL's query.
fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

impl Mlflow {
    /// Starts tracking the run in `dir` (`run_name` names its parent run; `params` are logged
    /// once, when the run is new): reaches the server and makes or finds the experiment and the
    /// runs, so a server that cannot be used stops the run here.
    pub fn open(
        target: MlflowTarget,
        dir: &Path,
        run_name: &str,
        params: &[(String, String)],
    ) -> Result<Self, RecordError> {
        let token = std::env::var("MLFLOW_TRACKING_TOKEN")
            .ok()
            .and_then(ApiKey::new);
        let http = HttpClient::new(&target.uri, TIMEOUT)
            .map_err(|e| err(&target, e))?
            .with_api_key(token.as_ref());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| err(&target, e))?;
        let client = Client { http, rt, target };
        let file = dir.join("mlflow.json");
        let run_dir = dir.display().to_string();
        let fail = |e: String| err(&client.target, e);
        let experiment_id = client.experiment().map_err(fail)?;
        // The server is the record of what was logged: runs of this run directory found by
        // their tag (a resumed run, or one killed between a call and the next) are reused, and
        // each stage continues after the last step the server holds.
        let found = client.search(&experiment_id, &run_dir).map_err(fail)?;
        let run_id = match found.parent {
            Some(id) => {
                client.status(&id, "RUNNING").map_err(fail)?;
                id
            }
            None => {
                let run_id = client
                    .create_run(&experiment_id, run_name, &[("trellis.run_dir", &run_dir)])
                    .map_err(fail)?;
                for chunk in params.chunks(PARAMS) {
                    let params: Vec<Value> = chunk
                        .iter()
                        .map(|(k, v)| json!({"key": k, "value": v}))
                        .collect();
                    client
                        .post(
                            "runs/log-batch",
                            &json!({"run_id": run_id, "params": params}),
                        )
                        .map_err(fail)?;
                }
                run_id
            }
        };
        // Stage runs are looked up when their first row comes (see `Worker::send`).
        let ids = Ids {
            uri: client.target.uri.clone(),
            experiment_id,
            run_id,
            run_dir,
            stages: BTreeMap::new(),
        };
        save(&file, &ids).map_err(|e| err(&client.target, e))?;
        let (tx, rx) = channel();
        // The rows the run kept (a resumed run's `metrics.jsonl`, already rewound to its
        // checkpoint) go first: the ones a kill caught in the queue reach the server now, and
        // the ones it holds are skipped by their step.
        let kept = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
        for line in kept.lines() {
            let Ok(Value::Object(row)) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let (Some(stage), Some(step)) = (row["stage"].as_str(), row["step"].as_u64()) else {
                continue;
            };
            let metrics = row
                .iter()
                .filter(|(k, _)| *k != "stage" && *k != "step")
                .filter_map(|(k, v)| Some((key(k), v.as_f64()?)));
            let _ = tx.send(Msg::row(stage, step, metrics));
        }
        let worker = std::thread::Builder::new()
            .name("mlflow".into())
            .spawn(move || Worker::new(client, ids, file).run(rx))
            .map_err(|e| RecordError::Tracking(format!("tracking.mlflow: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            worker: Some(worker),
            finished: false,
        })
    }

    fn close(&mut self, status: &'static str, deadline: Duration) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Msg::Finish { status, deadline });
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn save(file: &Path, ids: &Ids) -> std::io::Result<()> {
    let tmp = file.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(ids)?)?;
    std::fs::rename(&tmp, file)
}

impl Recorder for Mlflow {
    fn row(&mut self, row: &Row<'_>) -> Result<(), RecordError> {
        let metrics = row.metrics.iter().map(|(k, v)| (key(k), *v));
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::row(row.stage, row.step, metrics));
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), RecordError> {
        self.finished = true;
        self.close("FINISHED", Duration::from_secs(60));
        Ok(())
    }
}

impl Drop for Mlflow {
    /// A run that stops without finishing (failed, or stopped to resume later) is `KILLED`, after
    /// a short try to send what is queued.
    fn drop(&mut self) {
        if !self.finished {
            self.close("KILLED", Duration::from_secs(10));
        }
    }
}

struct Worker {
    client: Client,
    ids: Ids,
    file: PathBuf,
    queue: VecDeque<Msg>,
    dropped: usize,
    failing: bool,
}

impl Worker {
    fn new(client: Client, ids: Ids, file: PathBuf) -> Self {
        Self {
            client,
            ids,
            file,
            queue: VecDeque::new(),
            dropped: 0,
            failing: false,
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        loop {
            let wait = if self.queue.is_empty() {
                Duration::from_secs(3600)
            } else {
                Duration::from_secs(5)
            };
            match rx.recv_timeout(wait) {
                Ok(Msg::Finish { status, deadline }) => return self.finish(status, deadline),
                Ok(row) => {
                    if self.queue.len() >= QUEUE {
                        self.queue.pop_front();
                        self.dropped += 1;
                    }
                    self.queue.push_back(row);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return self.finish("KILLED", Duration::from_secs(10));
                }
            }
            self.flush();
        }
    }

    /// Sends the queued rows in order, stopping at the first that fails (kept for a retry).
    fn flush(&mut self) -> bool {
        while let Some(msg) = self.queue.pop_front() {
            let Msg::Row {
                stage,
                step,
                metrics,
                at_ms,
            } = &msg
            else {
                continue;
            };
            match self.send(stage, *step, metrics, *at_ms) {
                Ok(()) => {
                    if self.failing {
                        tracing::info!("tracking.mlflow: {} answers again", self.client.target.uri);
                        self.failing = false;
                    }
                }
                Err(e) => {
                    self.queue.push_front(msg);
                    if !self.failing {
                        tracing::warn!(
                            "tracking.mlflow: {e}; {} rows queued, retried every 5 s",
                            self.queue.len()
                        );
                        self.failing = true;
                    }
                    return false;
                }
            }
        }
        true
    }

    fn send(
        &mut self,
        stage: &str,
        step: u64,
        metrics: &[(String, f64)],
        at_ms: u64,
    ) -> Result<(), String> {
        let run = match self.ids.stages.get(stage) {
            Some(r) => r.clone(),
            // Asked when the stage's first row comes, not when the run starts: a call the
            // killed process had in flight has landed on the server by then.
            None => match self
                .client
                .search(&self.ids.experiment_id, &self.ids.run_dir)?
                .stages
                .remove(stage)
            {
                Some(r) => {
                    self.ids.stages.insert(stage.to_string(), r.clone());
                    r
                }
                None => self.create_stage(stage)?,
            },
        };
        // A step logged before a kill and run again after the resume: logged once.
        if run.last_step.is_some_and(|last| step <= last) {
            return Ok(());
        }
        for chunk in metrics.chunks(BATCH) {
            let metrics: Vec<Value> = chunk
                .iter()
                .map(|(k, v)| json!({"key": k, "value": v, "timestamp": at_ms, "step": step}))
                .collect();
            self.client.post(
                "runs/log-batch",
                &json!({"run_id": run.run_id, "metrics": metrics}),
            )?;
        }
        if let Some(r) = self.ids.stages.get_mut(stage) {
            r.last_step = Some(step);
        }
        Ok(())
    }

    /// A new nested run for `stage`, recorded in `mlflow.json`.
    fn create_stage(&mut self, stage: &str) -> Result<StageRun, String> {
        let run_id = self.client.create_run(
            &self.ids.experiment_id,
            stage,
            &[
                ("mlflow.parentRunId", &self.ids.run_id),
                ("trellis.stage", stage),
                ("trellis.run_dir", &self.ids.run_dir),
            ],
        )?;
        let r = StageRun {
            run_id,
            last_step: None,
        };
        self.ids.stages.insert(stage.to_string(), r.clone());
        save(&self.file, &self.ids).map_err(|e| e.to_string())?;
        Ok(r)
    }

    fn finish(mut self, status: &str, deadline: Duration) {
        let until = Instant::now() + deadline;
        while !self.flush() && Instant::now() < until {
            std::thread::sleep(Duration::from_secs(1).min(until - Instant::now()));
        }
        let lost = self.queue.len() + self.dropped;
        if lost > 0 {
            tracing::warn!(
                "tracking.mlflow: {lost} rows could not be sent to {} (metrics.jsonl has them)",
                self.client.target.uri
            );
        }
        // Every stage's run, also those of stages that ended before a resume (no rows since).
        let found = self
            .client
            .search(&self.ids.experiment_id, &self.ids.run_dir)
            .map(|f| f.stages)
            .unwrap_or_default();
        let runs: std::collections::BTreeSet<String> = self
            .ids
            .stages
            .values()
            .chain(found.values())
            .map(|r| r.run_id.clone())
            .chain([self.ids.run_id.clone()])
            .collect();
        for run in runs {
            if let Err(e) = self.client.status(&run, status) {
                tracing::warn!("tracking.mlflow: cannot mark run {run} {status}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workflows_flatten_to_params_and_keys_to_what_mlflow_accepts() {
        let mut out = Vec::new();
        let wf = json!({"name": "x", "stages": [{"id": "rl", "algorithm": {"lr": f64::from(1e-6f32), "clip": 0.1}}],
                        "pools": {"rollout": {"endpoints": ["http://a", "http://b"]}}, "model": {"init": null}});
        flatten("", &wf, &mut out);
        out.sort();
        assert_eq!(
            out,
            [
                ("name".to_string(), "x".to_string()),
                (
                    "pools.rollout.endpoints".into(),
                    r#"["http://a","http://b"]"#.into()
                ),
                ("stages.0.algorithm.clip".into(), "0.1".into()),
                ("stages.0.algorithm.lr".into(), "0.000001".into()),
                ("stages.0.id".into(), "rl".into()),
            ]
        );
        // (key, as sent)
        let cases = [
            ("actor/pg_loss", "actor/pg_loss"),
            ("critic/score/mean", "critic/score/mean"),
            ("eval/accuracy@greedy", "eval/accuracy_greedy"),
        ];
        for (k, want) in cases {
            assert_eq!(key(k), want);
        }
        assert_eq!(percent("my exp/1"), "my%20exp%2F1");
    }
}
