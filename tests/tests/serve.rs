//! `trellis serve` and its clients, with real processes on loopback: the CLI and the Python
//! client package (pip-installed) submit and watch jobs that run on an agent's pool; a running job is cancelled and resumed; a
//! server killed with -9 mid-job is restarted and finishes it with every step recorded once;
//! calls without the token are refused off loopback; users see and change only their own jobs
//! and the agents' token runs none; TLS, to the agents too; health and reflection answer; 50
//! concurrent submissions all finish.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use trellis_tests::{Killed, PATIENCE, metric_rows, python, run_ok, trellis, without_timings};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-arith.yaml")
}

fn tls_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tls")
}

fn scratch(tag: &str) -> PathBuf {
    trellis_tests::scratch(&format!("serve-{tag}"))
}

/// A running `trellis serve`.
struct Server {
    process: Killed,
    /// `http://127.0.0.1:PORT` (or https://localhost:PORT with TLS).
    url: String,
    data: PathBuf,
}

impl Server {
    fn start(data: &Path, extra: &[&str]) -> Server {
        let mut child = trellis()
            .args(["--log", "warn", "serve", "--listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(data)
            .args(["--agent-wait", "60"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start trellis serve");
        let url = trellis_tests::listening(&mut child);
        Server {
            process: Killed(child),
            url,
            data: data.to_path_buf(),
        }
    }

    fn port(&self) -> &str {
        self.url.rsplit(':').next().unwrap()
    }

    /// `trellis ARGS --server URL`.
    fn cli(&self, args: &[&str]) -> Command {
        let mut c = trellis();
        c.args(args).args(["--server", &self.url]);
        c
    }

    fn job(&self, id: u64) -> Value {
        let out = run_ok(&mut self.cli(&["status", &id.to_string(), "--json"]));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Waits until job `id` satisfies `done`.
    fn wait_for(&self, id: u64, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let t0 = Instant::now();
        loop {
            let j = self.job(id);
            if done(&j) {
                return j;
            }
            assert!(t0.elapsed() < PATIENCE, "job {id} never {what}: {j:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until job `id` is in `state`, asking with the token in `token_file`.
    fn wait_for_with(&self, token_file: &Path, id: u64, state: &str) {
        let t0 = Instant::now();
        loop {
            let out = run_ok(
                self.cli(&["status", &id.to_string(), "--json"])
                    .arg("--token-file")
                    .arg(token_file),
            );
            let j: Value = serde_json::from_slice(&out.stdout).unwrap();
            if j["state"] == state {
                return;
            }
            assert!(t0.elapsed() < PATIENCE, "job {id} never {state}: {j:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every metric row of job `id`, without timings.
    fn metrics(&self, id: u64) -> Vec<Value> {
        let out = run_ok(&mut self.cli(&["logs", &id.to_string(), "--metrics"]));
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| without_timings(serde_json::from_str(l).unwrap()))
            .collect()
    }
}

fn submit(server: &Server, overrides: &[&str]) -> u64 {
    let mut c = server.cli(&["submit"]);
    c.arg(recipe());
    for o in overrides {
        c.args(["-o", o]);
    }
    let out = run_ok(&mut c);
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn agent(server: &Server, name: &str) -> Killed {
    Killed(
        trellis()
            .args(["--log", "warn", "agent", "--head", &server.url])
            .args(["--resources", "cpu=2", "--name", name])
            .arg("--token-file")
            .arg(server.data.join("agent-token"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start trellis agent"),
    )
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn jobs_from_the_cli_run_on_an_agent_and_can_be_cancelled_and_resumed() {
    let dir = scratch("cli");
    let server = Server::start(&dir.join("data"), &[]);
    let _agent = agent(&server, "a1");
    let short = [
        "stages.rl.trainer.steps=4",
        "pools.rollout.placement=spread",
    ];

    // Submit and follow to the end: the job's engine runs on the agent.
    let mut c = server.cli(&["submit", "-f"]);
    c.arg(recipe());
    for o in short {
        c.args(["-o", o]);
    }
    let out = run_ok(&mut c);
    let log = text(&out);
    assert!(log.contains("rollout pool: a1"), "{log}");
    assert!(log.contains("job 1 succeeded"), "{log}");
    let j = server.job(1);
    assert_eq!(j["state"], "succeeded", "{j:#}");
    assert_eq!(
        j["stages_completed"],
        serde_json::json!(["warmup", "rl", "final-eval"])
    );
    assert!(j["workflow"]["name"] == "tiny-arith", "{j:#}");

    // The server's job computes what `trellis train` computes in one process.
    let local = dir.join("local");
    let mut t = trellis();
    t.arg("train")
        .arg(recipe())
        .arg("--quiet")
        .arg("--run-dir")
        .arg(&local);
    t.args(["-o", short[0]]);
    run_ok(&mut t);
    assert_eq!(server.metrics(1), metric_rows(&local));

    // A workflow that does not validate is refused with where and why; nothing is queued.
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "name: bad\nmodel: {init: {hidden_size: 8}, tokenizer: builtin:arith}\nstages:\n  - id: a\n    kind: sft\n    trainer: {stepz: 3}\n",
    )
    .unwrap();
    let out = server.cli(&["submit"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let msg = text(&out);
    assert!(
        msg.contains("bad.yaml:6:") && msg.contains("steps"),
        "{msg}"
    );
    let jobs = run_ok(&mut server.cli(&["jobs", "--json"]));
    assert_eq!(String::from_utf8_lossy(&jobs.stdout).lines().count(), 1);

    // Cancel a running job: it checkpoints its step and ends cancelled; resume finishes it.
    let id = submit(
        &server,
        &[
            "stages.rl.trainer.steps=100",
            "pools.rollout.placement=spread",
        ],
    );
    server.wait_for(id, "reached RL", |j| {
        j["stage"] == "rl" && j["step"].as_u64() >= Some(2)
    });
    let out = run_ok(&mut server.cli(&["cancel", &id.to_string()]));
    assert!(text(&out).contains("stops after its current step"));
    let j = server.wait_for(id, "was cancelled", |j| j["state"] == "cancelled");
    assert_eq!(j["checkpoint_stage"], "rl", "{j:#}");
    let at = j["checkpoint_step"].as_u64().unwrap();
    assert!((2..100).contains(&at), "{j:#}");
    let out = server.cli(&["cancel", &id.to_string()]).output().unwrap();
    assert!(
        !out.status.success() && text(&out).contains("only a pending or running job"),
        "{}",
        text(&out)
    );
    run_ok(&mut server.cli(&["resume", &id.to_string()]));
    let out = run_ok(&mut server.cli(&["logs", "-f", &id.to_string()]));
    assert!(text(&out).contains(&format!("job {id} succeeded")));
    let rows = server.metrics(id);
    let rl: Vec<u64> = rows
        .iter()
        .filter(|r| r["stage"] == "rl")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(rl, (1..=100).collect::<Vec<_>>(), "every RL step once");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_server_killed_mid_job_finishes_it_after_a_restart_losing_nothing() {
    let dir = scratch("kill");
    let data = dir.join("data");
    let server = Server::start(&data, &[]);
    let id = submit(
        &server,
        &[
            "stages.rl.trainer.steps=60",
            "stages.rl.trainer.save_freq=5",
        ],
    );
    // SIGTERM: the job checkpoints its current step and waits in the queue for the next start.
    server.wait_for(id, "started", |j| j["state"] == "running");
    let Server { mut process, .. } = server;
    // SAFETY: signalling a child process we own.
    unsafe { libc::kill(process.0.id() as i32, libc::SIGTERM) };
    let status = process.0.wait().unwrap();
    assert!(
        status.success(),
        "a stopped server exits cleanly: {status:?}"
    );

    let server = Server::start(&data, &[]);
    server.wait_for(id, "checkpointed in RL", |j| {
        j["checkpoint_stage"] == "rl" && j["checkpoint_step"].as_u64() >= Some(5)
    });
    let before = server.metrics(id);
    let Server { mut process, .. } = server;
    process.0.kill().unwrap();
    process.0.wait().unwrap();

    let server = Server::start(&data, &[]);
    let out = run_ok(&mut server.cli(&["logs", "-f", &id.to_string()]));
    let log = text(&out);
    assert!(
        log.contains("the server stopped while this job ran"),
        "{log}"
    );
    let after = server.metrics(id);
    let steps = |stage: &str| -> Vec<u64> {
        after
            .iter()
            .filter(|r| r["stage"] == stage)
            .map(|r| r["step"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(steps("warmup"), (1..=30).collect::<Vec<_>>());
    assert_eq!(
        steps("rl"),
        (1..=60).collect::<Vec<_>>(),
        "none lost or doubled"
    );
    assert_eq!(steps("final-eval"), vec![0]);
    // Every row written before the kill is there, unchanged (steps after the checkpoint were run
    // again and gave the same numbers: a run is a pure function of its seed).
    for row in &before {
        assert!(after.contains(row), "lost or changed: {row}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn off_loopback_calls_need_the_token_and_tls_health_and_reflection_work() {
    let dir = scratch("auth");
    let data = dir.join("data");
    // Every interface, so the token is required; the test still only talks to 127.0.0.1.
    let mut child = trellis()
        .args(["--log", "warn", "serve", "--listen", "0.0.0.0:0"])
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _server = Killed(child);
    let port = line.trim().rsplit(':').next().unwrap().to_string();
    let url = format!("http://127.0.0.1:{port}");
    let token = data.join("token");
    let mode = std::fs::metadata(&token).map(|m| {
        use std::os::unix::fs::PermissionsExt;
        m.permissions().mode() & 0o777
    });
    assert_eq!(mode.unwrap(), 0o600, "the token is for its owner only");
    let out = trellis()
        .args(["jobs", "--server", &url])
        .env_remove("TRELLIS_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out).contains("missing token"), "{}", text(&out));
    // Requests are bounded.
    let big = dir.join("big.yaml");
    std::fs::write(&big, format!("name: big\n# {}\n", "x".repeat(2 << 20))).unwrap();
    let out = trellis()
        .args(["submit", "--server", &url, "--token-file"])
        .arg(&token)
        .arg(&big)
        .output()
        .unwrap();
    assert!(
        !out.status.success() && text(&out).contains("too large"),
        "{}",
        text(&out)
    );
    let wrong = dir.join("wrong-token");
    std::fs::write(&wrong, "0123456789abcdef0123456789abcdef\n").unwrap();
    let out = trellis()
        .args(["jobs", "--server", &url, "--token-file"])
        .arg(&wrong)
        .output()
        .unwrap();
    assert!(text(&out).contains("wrong token"), "{}", text(&out));
    run_ok(
        trellis()
            .args(["jobs", "--server", &url, "--token-file"])
            .arg(&token),
    );

    // Standard gRPC tooling: the health service and reflection answer without a token.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "trellis.v1.JobService".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let mut reflection = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut replies = reflection
            .server_reflection_info(tokio_stream::once(request))
            .await
            .unwrap()
            .into_inner();
        let reply = replies.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
            panic!("not a service list: {reply:?}");
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        for want in ["trellis.v1.JobService", "trellis.v1.Head"] {
            assert!(names.iter().any(|n| n == want), "{names:?}");
        }
    });

    // TLS: a client trusting the certificate gets through; one that does not is told why.
    let tls = Server::start(
        &dir.join("tls-data"),
        &[
            "--tls-cert",
            tls_dir().join("cert.pem").to_str().unwrap(),
            "--tls-key",
            tls_dir().join("key.pem").to_str().unwrap(),
        ],
    );
    assert!(tls.url.starts_with("https://"), "{}", tls.url);
    let https = format!("https://localhost:{}", tls.port());
    let out = trellis()
        .args(["jobs", "--server", &https])
        .env_remove("TRELLIS_TLS_CA")
        .output()
        .unwrap();
    assert!(
        !out.status.success() && text(&out).contains("--tls-ca"),
        "{}",
        text(&out)
    );
    run_ok(
        trellis()
            .args(["jobs", "--server", &https, "--tls-ca"])
            .arg(tls_dir().join("cert.pem")),
    );
    // A head that serves TLS reaches its agents over TLS: an agent without a certificate is
    // refused, saying what it needs; one with a certificate (here the server's, which the head
    // trusts by default) serves TLS and runs a job's engine.
    let agent_token = tls.data.join("agent-token");
    let agent = |name: &str, secure: bool| {
        let mut c = trellis();
        c.args(["--log", "warn", "agent", "--head", &https, "--name", name])
            .args(["--resources", "cpu=2", "--tls-ca"])
            .arg(tls_dir().join("cert.pem"))
            .arg("--token-file")
            .arg(&agent_token);
        if secure {
            c.arg("--tls-cert")
                .arg(tls_dir().join("cert.pem"))
                .arg("--tls-key")
                .arg(tls_dir().join("key.pem"));
        }
        c
    };
    let out = agent("plain", false).output().unwrap();
    assert!(
        !out.status.success() && text(&out).contains("--tls-cert and --tls-key"),
        "{}",
        text(&out)
    );
    let _secure = Killed(
        agent("secure", true)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = run_ok(
        trellis()
            .args(["submit", "-f", "--server", &https, "--tls-ca"])
            .arg(tls_dir().join("cert.pem"))
            .arg(recipe())
            .args(["-o", "pools.rollout.placement=spread"])
            .args(["-o", "stages.rl.trainer.steps=2"]),
    );
    let log = text(&out);
    assert!(
        log.contains("rollout pool: secure") && log.contains("succeeded"),
        "{log}"
    );
    drop(tls);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fifty_concurrent_submissions_all_get_ids_and_all_finish() {
    let dir = scratch("fifty");
    let server = Server::start(&dir.join("data"), &["--max-running", "2"]);
    let tiny = dir.join("tiny.yaml");
    std::fs::write(
        &tiny,
        "name: tiny\nseed: 1\nmodel:\n  init: {arch: qwen2, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 32, max_position_embeddings: 32}\n  tokenizer: builtin:arith\nstages:\n  - id: warmup\n    kind: sft\n    data: {task: arith, digits: 1, ops: \"+\", eval_size: 4}\n    sft: {batch_size: 4}\n    trainer: {steps: 2}\n",
    )
    .unwrap();
    let ids: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..50)
            .map(|_| {
                s.spawn(|| {
                    let out = run_ok(server.cli(&["submit"]).arg(&tiny));
                    String::from_utf8(out.stdout)
                        .unwrap()
                        .trim()
                        .parse::<u64>()
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (1..=50).collect::<Vec<_>>(),
        "one id each, none lost"
    );
    let t0 = Instant::now();
    loop {
        let out = run_ok(&mut server.cli(&["jobs", "--json"]));
        let jobs: Vec<Value> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(jobs.len(), 50);
        assert!(
            jobs.iter().all(|j| j["state"] != "failed"),
            "{:#}",
            Value::Array(jobs.clone())
        );
        if jobs.iter().all(|j| j["state"] == "succeeded") {
            break;
        }
        assert!(t0.elapsed() < PATIENCE, "jobs never finished");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What the test drives through the package's Python API (argv: server URL, recipe, bad
/// workflow): a bad workflow refused with its field; a long job cancelled once it runs, resumed
/// and waited for; its events and metrics. Prints one JSON object.
const PYTHON_API: &str = r#"
import json, sys
from trellis_client import Client, Job, JobState, LogLine, MetricRow, TrellisError

server, recipe, bad = sys.argv[1:4]
out = {}
with Client(server) as c:
    try:
        c.submit(bad)
    except TrellisError as e:
        out["bad"] = [e.code, e.details]
    job = c.submit(recipe, ["stages.rl.trainer.steps=40"])
    out["submitted"] = [job.id, job.name, job.state.value]
    events = c.watch(job.id)
    kinds = set()
    for ev in events:
        kinds.add(type(ev).__name__)
        if isinstance(ev, MetricRow) and ev.stage == "rl":
            break
    c.cancel(job.id)
    for ev in events:
        kinds.add(type(ev).__name__)
        last = ev
    out["cancelled"] = [last.state.value, c.job(job.id).state.value]
    c.resume(job.id)
    done = c.wait(job.id)
    out["resumed"] = [done.state.value, done.stages_completed, done.step]
    rows = c.metrics(job.id)
    out["rows"] = [len(rows), rows[-1].stage, sorted(rows[-1].values)[:3]]
    out["kinds"] = sorted(kinds)
    out["jobs"] = [(j.id, j.state.value) for j in c.jobs()]
print(json.dumps(out))
"#;

#[test]
fn the_python_client_installs_with_pip_and_submits_watches_cancels_and_resumes() {
    let Some(python) = python() else { return };
    let root = trellis_tests::root();
    // The stubs it ships are what proto/ gives.
    let check = Command::new(&python)
        .arg(root.join("clients/python/generate.py"))
        .arg("--check")
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", text(&check));
    // Installed as a user would (a wheel built by pip; no network: the build backend is in the
    // venv), then run from elsewhere so the source tree cannot stand in for it.
    let install = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(["--no-deps", "--no-build-isolation", "--force-reinstall"])
        .arg(root.join("clients/python"))
        .output()
        .unwrap();
    assert!(install.status.success(), "{}", text(&install));
    let dir = scratch("python");
    let server = Server::start(&dir.join("data"), &[]);
    let cli = python.with_file_name("trellis-client");

    // The command line: submit and watch to the end, then the job list as JSON.
    let out = Command::new(&cli)
        .args(["--server", &server.url, "submit"])
        .arg(recipe())
        .args(["-o", "stages.rl.trainer.steps=2", "--watch"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("submitted job 1 (tiny-arith)"), "{log}");
    assert!(log.contains("metrics rl step 2"), "{log}");
    assert!(log.contains("job 1: succeeded"), "{log}");
    assert_eq!(server.job(1)["state"], "succeeded");
    let out = Command::new(&cli)
        .env("TRELLIS_SERVER", &server.url)
        .args(["--json", "jobs"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let line: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["state"], "succeeded", "{line}");
    assert_eq!(line["id"], 1, "{line}");
    let out = Command::new(&cli)
        .args(["--server", &server.url, "watch", "99"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("NOT_FOUND"), "{}", text(&out));

    // The Python API.
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "name: bad\nmodel: {init: {hidden_size: 8}, tokenizer: builtin:arith}\nstages:\n  - id: a\n    kind: sft\n    trainer: {stepz: 3}\n",
    )
    .unwrap();
    let out = Command::new(&python)
        .args(["-c", PYTHON_API, &server.url])
        .arg(recipe())
        .arg(&bad)
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["bad"][0], "INVALID_ARGUMENT", "{got}");
    let why = got["bad"][1].as_str().unwrap();
    assert!(
        why.contains("bad.yaml:6:") && why.contains("steps"),
        "{why}"
    );
    assert_eq!(got["submitted"][0], 2, "{got}");
    assert_eq!(got["submitted"][1], "tiny-arith", "{got}");
    assert_eq!(
        got["cancelled"],
        serde_json::json!(["cancelled", "cancelled"])
    );
    assert_eq!(got["resumed"][0], "succeeded", "{got}");
    assert_eq!(
        got["resumed"][1],
        serde_json::json!(["warmup", "rl", "final-eval"])
    );
    assert_eq!(
        got["kinds"],
        serde_json::json!(["Job", "LogLine", "MetricRow"]),
        "{got}"
    );
    assert_eq!(
        got["jobs"],
        serde_json::json!([[1, "succeeded"], [2, "succeeded"]])
    );
    let rows = server.metrics(2);
    assert_eq!(got["rows"][0], rows.len(), "{got}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn doctor_checks_the_host_and_the_head_and_names_what_fails() {
    let dir = scratch("doctor");
    let server = Server::start(&dir.join("data"), &[]);
    // What a host about to join has: the agents' token.
    let token = server.data.join("agent-token");
    let out = run_ok(
        trellis()
            .args(["doctor", "--json", "--head", &server.url, "--token-file"])
            .arg(&token),
    );
    let checks: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let find = |name: &str| -> &Value {
        checks
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no {name} check: {checks:#?}"))
    };
    for name in [
        "cores",
        "memory",
        "/dev/shm",
        "head",
        "version",
        "clock skew",
    ] {
        assert_ne!(find(name)["level"], "fail", "{:#}", find(name));
    }
    assert!(find("head")["detail"].as_str().unwrap().contains("answers"));
    // What fails is named, with the fix, and the exit status says so.
    let out = trellis()
        .args([
            "doctor",
            "--head",
            "http://127.0.0.1:9",
            "--resources",
            "cpu=1,tpu=64",
        ])
        .args(["--pjrt", "/nonexistent/libtpu.so"])
        .output()
        .unwrap();
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("FAIL  head") && t.contains("127.0.0.1:9"), "{t}");
    assert!(t.contains("/nonexistent/libtpu.so"), "{t}");
    assert!(t.contains("tpu=64") && t.contains("fix:"), "{t}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_job_waiting_for_agents_is_cancelled_at_once() {
    let dir = scratch("waiting");
    let server = Server::start(&dir.join("data"), &[]);
    let id = submit(&server, &["pools.rollout.placement=spread"]);
    server.wait_for(id, "started waiting", |j| j["state"] == "running");
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    run_ok(&mut server.cli(&["cancel", &id.to_string()]));
    let j = server.wait_for(id, "was cancelled", |j| j["state"] == "cancelled");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the 60 s wait for agents was cut short"
    );
    assert!(
        j["error"].as_str().unwrap().contains("waiting for agents"),
        "{j:#}"
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn users_see_and_change_only_their_own_jobs_and_the_agents_token_runs_none() {
    let dir = scratch("users");
    let data = dir.join("data");
    let add_user = |name: &str| -> PathBuf {
        let out = run_ok(
            trellis()
                .args(["user", "add", name, "--data-dir"])
                .arg(&data),
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    };
    // One user made before the server starts, one while it runs (taken at once).
    let alice = add_user("alice");
    let server = Server::start(&data, &["--max-running", "1"]);
    let bob = add_user("bob");
    let (admin, agents) = (data.join("token"), data.join("agent-token"));
    let with = |token: &Path, args: &[&str]| -> Output {
        server
            .cli(args)
            .arg("--token-file")
            .arg(token)
            .env_remove("TRELLIS_TOKEN_FILE")
            .output()
            .unwrap()
    };
    let ok = |token: &Path, args: &[&str]| -> String {
        let out = with(token, args);
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let state = |token: &Path, id: u64| -> Value {
        let j: Value =
            serde_json::from_str(&ok(token, &["status", &id.to_string(), "--json"])).unwrap();
        j["state"].clone()
    };
    let file = recipe().display().to_string();
    let submit_as = |token: &Path, overrides: &[&str]| -> u64 {
        let mut args = vec!["submit", file.as_str()];
        for o in overrides {
            args.extend(["-o", o]);
        }
        ok(token, &args).trim().parse().unwrap()
    };
    let listed = |token: &Path| -> Vec<(u64, Value)> {
        ok(token, &["jobs", "--json"])
            .lines()
            .map(|l| {
                let j: Value = serde_json::from_str(l).unwrap();
                (j["id"].as_u64().unwrap(), j["owner"].clone())
            })
            .collect()
    };

    // A server with users takes no call without a token, even on loopback.
    let out = server
        .cli(&["jobs"])
        .env_remove("TRELLIS_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(
        !out.status.success() && text(&out).contains("this server has users"),
        "{}",
        text(&out)
    );

    // The admin's job waits for an agent and holds the one running slot; alice's and bob's
    // queue behind it.
    let j1 = submit_as(&admin, &["pools.rollout.placement=spread"]);
    let j2 = submit_as(&alice, &[]);
    let j3 = submit_as(&bob, &[]);
    assert_eq!(listed(&alice), vec![(j2, "alice".into())]);
    assert_eq!(listed(&bob), vec![(j3, "bob".into())]);
    assert_eq!(
        listed(&admin),
        vec![(j1, Value::Null), (j2, "alice".into()), (j3, "bob".into())]
    );
    assert!(
        ok(&admin, &["jobs"]).contains("alice"),
        "the table names owners"
    );

    // Bob can neither see, follow, cancel nor resume alice's job.
    let j2s = j2.to_string();
    for args in [
        ["status", &j2s],
        ["logs", &j2s],
        ["cancel", &j2s],
        ["resume", &j2s],
    ] {
        let out = with(&bob, &args);
        assert!(
            !out.status.success() && text(&out).contains(&format!("job {j2} is not yours")),
            "{args:?}: {}",
            text(&out)
        );
    }
    assert_eq!(state(&alice, j2), "pending", "bob's cancel did nothing");
    // Alice cancels her own; the admin cancels anyone's.
    ok(&alice, &["cancel", &j2s]);
    assert_eq!(state(&alice, j2), "cancelled");
    ok(&admin, &["cancel", &j3.to_string()]);
    assert_eq!(state(&bob, j3), "cancelled");
    ok(&admin, &["cancel", &j1.to_string()]);
    server.wait_for_with(&admin, j1, "cancelled");

    // The agents' token submits and sees no job, but reads the cluster (`trellis doctor`,
    // `trellis agents` on a host about to join).
    let out = with(&agents, &["submit", &file]);
    assert!(
        !out.status.success() && text(&out).contains("agents' token cannot submit"),
        "{}",
        text(&out)
    );
    let out = with(&agents, &["jobs"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert_eq!(ok(&agents, &["agents", "--count"]).trim(), "0");
    assert_eq!(listed(&admin).len(), 3, "nothing was queued");

    // A user's token does not make an agent: the head refuses it, and the agent says which
    // token it needs.
    let mut agent = trellis()
        .args([
            "--log",
            "error",
            "agent",
            "--head",
            &server.url,
            "--token-file",
        ])
        .arg(&alice)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = agent.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the agent with a user's token was never refused"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut agent.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        !status.success() && err.contains("agent-token"),
        "{status}: {err}"
    );

    // A removed user's token (bob kept his copy) stops working at once; their jobs stay, for
    // the admin.
    let bob_copy = dir.join("bob.token");
    std::fs::copy(&bob, &bob_copy).unwrap();
    run_ok(
        trellis()
            .args(["user", "remove", "bob", "--data-dir"])
            .arg(&data),
    );
    let out = with(&bob_copy, &["jobs"]);
    assert!(text(&out).contains("wrong token"), "{}", text(&out));
    assert_eq!(state(&admin, j3), "cancelled");
    let users = run_ok(trellis().args(["user", "list", "--data-dir"]).arg(&data));
    assert_eq!(
        String::from_utf8(users.stdout).unwrap(),
        format!("alice\t{}\n", alice.display())
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What no job holds of each agent's CPUs, as `trellis agents --json` says.
fn free_cpus(server: &Server) -> Vec<(String, u64)> {
    let out = run_ok(&mut server.cli(&["agents", "--json"]));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let a: Value = serde_json::from_str(l).unwrap();
            (
                a["name"].as_str().unwrap().to_string(),
                a["free"]["cpu"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Both jobs' engines run on one agent, each job in a process of its own that borrows the
/// server's agent: one process aborts; it fails alone, the server frees what it held on the
/// agent, and it resumes there.
#[test]
fn a_job_whose_process_aborts_fails_alone_and_resumes_from_its_checkpoint() {
    let dir = scratch("isolated");
    let server = Server::start(&dir.join("data"), &["--max-running", "2"]);
    let _agent = agent(&server, "a1");
    let long = [
        "stages.rl.trainer.steps=300",
        "stages.rl.trainer.save_freq=10",
        "pools.rollout.placement=spread",
    ];
    let a = submit(&server, &long);
    let b = submit(&server, &long);
    let log = |id: u64| text(&run_ok(&mut server.cli(&["logs", &id.to_string()])));
    // Both run at once, each in a process of its own, named in its log.
    let pid = |id: u64| -> i32 {
        let l = log(id);
        let (_, rest) = l
            .split_once(&format!("job {id} runs in process "))
            .unwrap_or_else(|| panic!("job {id} names no process: {l}"));
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    server.wait_for(b, "checkpointed in RL", |j| {
        j["checkpoint_stage"] == "rl" && j["state"] == "running"
    });
    assert_eq!(server.job(a)["state"], "running", "both jobs run at once");
    assert_ne!(pid(a), pid(b));
    for id in [a, b] {
        assert!(log(id).contains("rollout pool: a1"), "{}", log(id));
    }
    // Each job holds one of the agent's two CPUs.
    assert_eq!(free_cpus(&server), [("a1".to_string(), 0)]);
    // Job b's process aborts (as a C++ CHECK in a plugin would).
    // SAFETY: signalling a process of the test's own server.
    unsafe { libc::kill(pid(b), libc::SIGABRT) };
    let jb = server.wait_for(b, "failed", |j| j["state"] == "failed");
    assert!(
        jb["error"].as_str().unwrap().contains("SIGABRT"),
        "the error names the abort: {jb:#}"
    );
    assert!(
        log(b).contains("continue it with `trellis resume"),
        "{}",
        log(b)
    );
    // The server and the other job go on.
    server.wait_for(a, "succeeded", |j| j["state"] == "succeeded");
    // Nothing of either job holds the agent any more: the server stopped the engine the aborted
    // process left behind.
    let t0 = Instant::now();
    while free_cpus(&server) != [("a1".to_string(), 2)] {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the agent's CPUs never came back: {:?}",
            free_cpus(&server)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Job b continues from its last checkpoint and ends as the undisturbed job a (the same
    // workflow and seed): no step lost or doubled.
    run_ok(&mut server.cli(&["resume", &b.to_string()]));
    server.wait_for(b, "succeeded after resuming", |j| j["state"] == "succeeded");
    assert_eq!(server.metrics(b), server.metrics(a));
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
