//! External engines with real processes: `trellis engine serve` behind vLLM's and SGLang's HTTP
//! routes, driven by Trellis's own `vllm` and `sglang` adapters and by `trellis train` with
//! `engine: served | vllm | sglang` — outputs equal to the in-process engine's, a GRPO run whose
//! metrics equal an in-process run's even with an engine killed -9 mid-RL, and the errors for an
//! unreachable URL (then resumed), a wrong model and a malformed response; engines behind an API
//! key and HTTPS; the `openai` Python package streaming chat completions.

use kernels::tensor::WeightSnapshot;
use learner::checkpoint::Checkpoint;
use rollout::external::ExternalConfig;
use rollout::external::http::HttpClient;
use rollout::external::sglang::SglangEngine;
use rollout::external::vllm::VllmEngine;
use rollout::native::NativeEngine;
use rollout::{Completion, GenerateRequest, InferenceEngine, SamplingParams};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use trellis_tests::{Killed, PATIENCE, metric_rows, python, run_ok, trellis};

fn data(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(p)
}

fn scratch(tag: &str) -> PathBuf {
    trellis_tests::scratch(&format!("engines-{tag}"))
}

/// `trellis engine serve ARGS --listen ADDR`, and its URL once it listens.
fn serve(args: &[&str], listen: &str) -> (Killed, String) {
    let mut child = Killed(
        trellis()
            .args(["--log", "warn", "engine", "serve", "--listen", listen])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn trellis engine serve"),
    );
    let url = trellis_tests::listening(&mut child.0);
    (child, url)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn endpoint(url: &str) -> ExternalConfig {
    ExternalConfig {
        timeout: Duration::from_secs(60),
        ..ExternalConfig::new(url)
    }
}

fn requests() -> Vec<GenerateRequest> {
    let sampled = |prompt: Vec<u32>, n, seed| GenerateRequest {
        prompt,
        params: SamplingParams {
            n,
            temperature: 0.8,
            top_k: 50,
            top_p: 0.95,
            max_tokens: 8,
            seed: Some(seed),
            ..Default::default()
        },
        episode: None,
    };
    vec![
        sampled(vec![5, 17, 200, 33], 3, 11),
        GenerateRequest {
            prompt: vec![9, 8, 7],
            params: SamplingParams {
                temperature: 0.0,
                max_tokens: 6,
                stop_token_ids: vec![42],
                ..Default::default()
            },
            episode: None,
        },
        sampled(vec![100, 101], 2, 12),
    ]
}

/// Everything but the log-probs, which are compared within 2e-5: the server batches requests
/// as they arrive, and a decode batch of another size sums in another order, a few f32 ulps per
/// layer of log-probs near 1 (1.03e-5 was seen once; tokens are the
/// seed's whatever the batch).
type Key = (usize, usize, Vec<u32>, String, Vec<u64>);

fn key(cs: &[Completion]) -> Vec<Key> {
    cs.iter()
        .map(|c| {
            (
                c.request,
                c.index,
                c.token_ids.clone(),
                format!("{:?}", c.finish_reason),
                c.weight_versions.iter().map(|s| s.version).collect(),
            )
        })
        .collect()
}

fn same(got: &[Completion], want: &[Completion], name: &str) {
    assert_eq!(
        key(got),
        key(want),
        "{name} differs from the in-process engine"
    );
    for (g, w) in got.iter().zip(want) {
        for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
            assert!((a - b).abs() < 2e-5, "{name}: log-prob {a} vs {b}");
        }
    }
}

#[test]
fn the_served_engine_answers_the_vllm_and_sglang_adapters_like_the_in_process_engine() {
    let model_dir = data("tiny-qwen2/checkpoint");
    let dir_arg = model_dir.to_str().unwrap();
    let (_a, tokens_url) = serve(&["--model", dir_arg], "127.0.0.1:0");
    let (_b, completions_url) = serve(&["--model", dir_arg, "--completions-only"], "127.0.0.1:0");
    let ckpt = Checkpoint::load(&model_dir).unwrap();
    let config = ckpt.model.config.clone();
    let local = NativeEngine::new(ckpt.model, Default::default());
    let want = local.generate_blocking(requests()).unwrap();
    let rt = runtime();

    // vLLM adapter, token route; vLLM adapter falling back to /v1/completions; SGLang adapter.
    let vllm = rt
        .block_on(VllmEngine::connect(endpoint(&tokens_url)))
        .unwrap();
    assert_eq!(
        vllm.model(),
        dir_arg,
        "the model id defaults to --model as given"
    );
    let fallback = rt
        .block_on(VllmEngine::connect(endpoint(&completions_url)))
        .unwrap();
    let sglang = rt
        .block_on(SglangEngine::connect(endpoint(&tokens_url)))
        .unwrap();
    let got = [
        rt.block_on(vllm.generate(requests())).unwrap(),
        rt.block_on(fallback.generate(requests())).unwrap(),
        rt.block_on(sglang.generate(requests())).unwrap(),
    ];
    for (name, g) in ["vllm", "vllm via completions", "sglang"].iter().zip(&got) {
        same(g, &want, name);
    }

    // Greedy through /v1/completions with token ids equals transformers' greedy (the fixture).
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(data("tiny-qwen2/reference.json")).unwrap())
            .unwrap();
    let http = HttpClient::new(&tokens_url, Duration::from_secs(60)).unwrap();
    for (ids, greedy) in reference["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .zip(reference["greedy"].as_array().unwrap())
    {
        let v = rt
            .block_on(http.post_json(
                "/v1/completions",
                &json!({"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                        "return_token_ids": true}),
            ))
            .unwrap();
        assert_eq!(&v["choices"][0]["token_ids"], greedy, "{v}");
    }
    // A text prompt is tokenized with the checkpoint's tokenizer, as `trellis generate` does.
    let v = rt
        .block_on(http.post_json(
            "/v1/completions",
            &json!({"model": dir_arg, "prompt": "Hello", "max_tokens": 5, "temperature": 0}),
        ))
        .unwrap();
    let cli = run_ok(trellis().args([
        "generate",
        "--model",
        dir_arg,
        "--prompt",
        "Hello",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
    ]));
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        String::from_utf8_lossy(&cli.stdout).trim_end_matches('\n')
    );
    let wrong = rt
        .block_on(http.post_raw("/v1/completions", &json!({"model": "gpt-9", "prompt": [1]})))
        .unwrap();
    assert_eq!(wrong.0, 404);

    // A weight push through each adapter's HTTP path (new folder, pause, reload, version,
    // resume): the served engines answer as the in-process engine on the same weights.
    let mut params = local_params(&model_dir);
    for t in &mut params.tensors {
        for (i, x) in t.data.iter_mut().enumerate() {
            *x *= 1.0 + 0.05 * ((i % 7) as f32 - 3.0) / 3.0;
        }
    }
    let snap = |v| WeightSnapshot::new(v, Arc::new(params.clone()));
    local.update_weights_blocking(snap(3)).unwrap();
    let want = local.generate_blocking(requests()).unwrap();
    let root = scratch("push");
    let vllm = vllm.with_weight_folders(&root.join("vllm"), config.clone());
    rt.block_on(vllm.update_weights(snap(3))).unwrap();
    assert_eq!(vllm.weight_version(), 3);
    same(
        &rt.block_on(vllm.generate(requests())).unwrap(),
        &want,
        "vllm after a push",
    );
    let sglang = rt
        .block_on(SglangEngine::connect(endpoint(&completions_url)))
        .unwrap()
        .with_weight_folders(&root.join("sglang"), config);
    rt.block_on(sglang.update_weights(snap(3))).unwrap();
    same(
        &rt.block_on(sglang.generate(requests())).unwrap(),
        &want,
        "sglang after a push",
    );
    let metrics = rt.block_on(http.get_text("/metrics")).unwrap();
    assert!(
        metrics.contains("trellis:weight_version{model_name=") && metrics.contains("} 3\n"),
        "{metrics}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

fn local_params(dir: &Path) -> learner::Params {
    Checkpoint::load(dir).unwrap().model.params
}

fn rl_rows(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"stage\":\"rl\""))
        .count()
}

/// The tiny recipe with `steps` run in process into `dir/local`: its comparable rows.
fn in_process(dir: &Path, steps: &str) -> Vec<Value> {
    run_ok(
        trellis()
            .arg("train")
            .arg(data("tiny-arith.yaml"))
            .args(["--quiet", "-o", steps, "--run-dir"])
            .arg(dir.join("local")),
    );
    comparable(&dir.join("local"))
}

/// Metric rows without timings and without the pool's own counters (`rollout/…`).
fn comparable(dir: &Path) -> Vec<Value> {
    metric_rows(dir)
        .into_iter()
        .map(|mut v| {
            v.as_object_mut()
                .unwrap()
                .retain(|k, _| !k.starts_with("rollout/"));
            v
        })
        .collect()
}

#[test]
fn a_grpo_run_on_two_keyed_served_engines_one_over_https_trains_like_in_process_and_routes_around_a_killed_one()
 {
    let dir = scratch("grpo");
    let recipe = data("tiny-arith.yaml");
    let steps = "stages.rl.trainer.steps=16";
    let reference = in_process(&dir, steps);
    let recipe_arg = recipe.to_str().unwrap();
    // Both engines want an API key; b serves HTTPS (a certificate for 127.0.0.1 that the run
    // trusts through SSL_CERT_FILE).
    let keyed = ["--recipe", recipe_arg, "--api-key", "k3y-of-the-engines"];
    let (_a, url_a) = serve(&keyed, "127.0.0.1:0");
    let tls = [data("tls/cert.pem"), data("tls/key.pem")];
    let tls_args = [
        "--ssl-certfile",
        tls[0].to_str().unwrap(),
        "--ssl-keyfile",
        tls[1].to_str().unwrap(),
    ];
    let (mut b, url_b) = serve(&[&keyed[..], &tls_args[..]].concat(), "127.0.0.1:0");
    assert!(url_b.starts_with("https://"), "{url_b}");
    let run = dir.join("run");
    let mut train = Killed(
        trellis()
            .arg("train")
            .arg(&recipe)
            .env("SSL_CERT_FILE", &tls[0])
            .env("TRELLIS_TEST_ENGINE_KEY", "k3y-of-the-engines")
            .args(["-o", "pools.rollout.api_key_env=TRELLIS_TEST_ENGINE_KEY"])
            // A call the killed engine never answers costs 10 s, not the default 300 (once in
            // CI a call stalled until its timeout after the kill; the run was right all the same).
            .args(["-o", steps, "-o", "pools.rollout.engine=served"])
            .args(["-o", "pools.rollout.timeout_s=10", "-o"])
            .arg(format!("pools.rollout.endpoints=[{url_a},{url_b}]"))
            .arg("--run-dir")
            .arg(&run)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stderr = train.0.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    // Kill engine b -9 once RL is under way.
    let deadline = Instant::now() + PATIENCE;
    while rl_rows(&run) < 3 {
        assert!(Instant::now() < deadline, "the run made no RL progress");
        assert!(train.0.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    b.0.kill().unwrap();
    b.0.wait().unwrap();
    let status = train.0.wait().unwrap();
    let log = log.join().unwrap();
    assert!(status.success(), "the run failed:\n{log}");
    assert!(log.contains("out of service"), "{log}");
    assert_eq!(
        comparable(&run),
        reference,
        "metrics differ from the in-process run"
    );
    let rows = metric_rows(&run);
    let rl: Vec<&Value> = rows.iter().filter(|r| r["stage"] == "rl").collect();
    assert!(rl.iter().all(|r| r["rollout/engines"] == json!(2.0)));
    // Out of service from the kill on (nothing restarts engine b).
    assert_eq!(rl.last().unwrap()["rollout/engines_down"], json!(1.0));
    // The surviving engine serves the last version; each prompt was prefilled once for all
    // its samples; only the last two weight folders are kept.
    let rt = runtime();
    let http = HttpClient::new(&url_a, Duration::from_secs(10)).unwrap();
    let m = rt.block_on(http.get_text("/metrics")).unwrap();
    let get = |name: &str| rollout::external::prometheus_sum(&m, name).unwrap();
    let version = rows
        .iter()
        .filter_map(|r| r["weight_version"].as_f64())
        .fold(0.0, f64::max);
    assert_eq!(get("trellis:weight_version"), version, "{m}");
    assert_eq!(
        get("trellis:prefill_tokens_total"),
        get("vllm:prompt_tokens_total")
    );
    let mut folders: Vec<String> = std::fs::read_dir(run.join("engine-weights"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    folders.sort();
    assert_eq!(folders.len(), 2, "{folders:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A port nobody listens on (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server that speaks HTTP and answers each request by `answer(request line)`: status and
/// body.
fn fake_server(answer: fn(&str) -> (u16, &'static str)) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // Headers, then the body by content-length.
            let (head_end, len) = loop {
                let n = s.read(&mut chunk).unwrap_or(0);
                if n == 0 {
                    break (0, 0);
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0usize);
                    break (i + 4, len);
                }
            };
            while buf.len() < head_end + len {
                let n = s.read(&mut chunk).unwrap_or(0);
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let request = String::from_utf8_lossy(&buf);
            let (status, body) = answer(request.lines().next().unwrap_or(""));
            let _ = write!(
                s,
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://{addr}")
}

/// A proxy to `upstream` that forwards every request but the ones starting with `stall`, which
/// it holds: the connection stays open and nothing answers (an engine that accepted the call
/// and then hung).
fn stalling_proxy(upstream: &str, stall: &'static str) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let up = upstream.trim_start_matches("http://").to_string();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { continue };
            let up = up.clone();
            std::thread::spawn(move || {
                let Ok(server) = std::net::TcpStream::connect(&up) else {
                    return;
                };
                let (mut c_read, mut s_write) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (mut s_read, mut c_write) = (server, client);
                std::thread::spawn(move || std::io::copy(&mut s_read, &mut c_write));
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = c_read.read(&mut buf).unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    if buf[..n].starts_with(stall.as_bytes()) {
                        // Held until the client gives up.
                        while c_read.read(&mut buf).unwrap_or(0) > 0 {}
                        return;
                    }
                    if s_write.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// `trellis train` of the tiny recipe for `steps` on the served engines at `endpoints`, with
/// the pool settings `pool` (`key=value` under `pools.rollout`), into `run`.
fn served_run(run: &Path, steps: &str, endpoints: &[&str], pool: &[&str]) -> std::process::Command {
    let mut c = trellis();
    c.arg("train")
        .arg(data("tiny-arith.yaml"))
        .args(["--quiet", "-o", steps, "-o", "pools.rollout.engine=served"])
        .arg("-o")
        .arg(format!("pools.rollout.endpoints=[{}]", endpoints.join(",")));
    for p in pool {
        c.arg("-o").arg(format!("pools.rollout.{p}"));
    }
    c.arg("--run-dir").arg(run);
    c
}

/// A run that lost one of its two engines: it succeeded within `within`, said `said` and that
/// the engine is out of service, trained as in process, and ended with one engine down.
fn lost_one_engine(
    run: &Path,
    ok: bool,
    log: &str,
    said: &str,
    took: Duration,
    within: Duration,
    reference: &[Value],
) {
    assert!(ok, "{log}");
    assert!(
        log.contains(said) && log.contains("out of service"),
        "{log}"
    );
    assert!(took < within, "{took:?}\n{log}");
    assert_eq!(comparable(run), reference);
    let rows = metric_rows(run);
    let last = rows.iter().rfind(|r| r["stage"] == "rl").unwrap();
    assert_eq!(last["rollout/engines_down"], json!(1.0));
}

#[test]
fn an_engine_that_hangs_in_a_weight_push_is_out_of_service_at_the_push_deadline() {
    // Engine b accepts every call, but its weight reload never answers. The pushes run at once
    // and b's is cut off at push_timeout_s (2 s), not at the call timeout (60 s): the run goes
    // on with engine a and trains as in process.
    let dir = scratch("stall");
    let recipe = data("tiny-arith.yaml");
    let steps = "stages.rl.trainer.steps=6";
    let reference = in_process(&dir, steps);
    let recipe_arg = recipe.to_str().unwrap();
    let (_a, url_a) = serve(&["--recipe", recipe_arg], "127.0.0.1:0");
    let (_b, url_b) = serve(&["--recipe", recipe_arg], "127.0.0.1:0");
    let hung = stalling_proxy(&url_b, "POST /collective_rpc");
    let run = dir.join("run");
    let started = Instant::now();
    let out = served_run(
        &run,
        steps,
        &[&url_a, &hung],
        &["timeout_s=60", "push_timeout_s=2"],
    )
    .output()
    .unwrap();
    // One stalled call at its own timeout would have taken 60 s.
    lost_one_engine(
        &run,
        out.status.success(),
        &String::from_utf8_lossy(&out.stderr),
        "did not finish within 2s (pools.rollout.push_timeout_s)",
        started.elapsed(),
        Duration::from_secs(60),
        &reference,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_engine_that_freezes_mid_run_is_out_of_service_within_seconds() {
    // Engine b's process is stopped (SIGSTOP) once the RL stage runs: it still accepts
    // connections (the kernel does) but answers nothing, as a hung engine or a vanished host.
    // The call waiting on it checks /health after 2 s (pools.rollout.health_check_s), gets no
    // answer within 2 s, and b is out of service — long before the call's own 120 s deadline:
    // the run goes on with engine a and trains as in process.
    let dir = scratch("frozen");
    let recipe = data("tiny-arith.yaml");
    let steps = "stages.rl.trainer.steps=40";
    let reference = in_process(&dir, steps);
    let recipe_arg = recipe.to_str().unwrap();
    let (_a, url_a) = serve(&["--recipe", recipe_arg], "127.0.0.1:0");
    let (b, url_b) = serve(&["--recipe", recipe_arg], "127.0.0.1:0");
    let run = dir.join("run");
    let mut train = Killed(
        served_run(
            &run,
            steps,
            &[&url_a, &url_b],
            &["timeout_s=120", "health_check_s=2"],
        )
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let t0 = Instant::now();
    let metrics = run.join("metrics.jsonl");
    while !std::fs::read_to_string(&metrics).is_ok_and(|m| m.contains("\"stage\":\"rl\"")) {
        assert!(t0.elapsed() < PATIENCE, "the RL stage never started");
        if let Some(status) = train.0.try_wait().unwrap() {
            panic!("the run ended early: {status}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: signalling the engine process this test started.
    unsafe { libc::kill(b.0.id() as i32, libc::SIGSTOP) };
    let frozen = Instant::now();
    let status = train.0.wait().unwrap();
    let took = frozen.elapsed();
    let mut log = String::new();
    std::io::Read::read_to_string(&mut train.0.stderr.take().unwrap(), &mut log).unwrap();
    // SAFETY: as above; the engine is killed when `b` drops.
    unsafe { libc::kill(b.0.id() as i32, libc::SIGCONT) };
    // One frozen call at its own deadline would have taken 120 s.
    lost_one_engine(
        &run,
        status.success(),
        &log,
        "stopped answering its health check",
        took,
        Duration::from_secs(60),
        &reference,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_endpoints_are_named_and_a_run_that_could_not_reach_its_engine_resumes() {
    let dir = scratch("errors");
    let recipe = data("tiny-arith.yaml");
    let train = |run: &str, extra: &[String]| {
        let out = trellis()
            .arg("train")
            .arg(&recipe)
            .args(["--quiet", "-o", "stages.rl.trainer.steps=2", "--run-dir"])
            .arg(dir.join(run))
            .args(extra.iter().flat_map(|o| ["-o", o.as_str()]))
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let endpoint = |engine: &str, url: &str| {
        vec![
            format!("pools.rollout.engine={engine}"),
            format!("pools.rollout.endpoints=[{url}]"),
        ]
    };

    // Nobody listens: the error names the endpoint; once an engine listens there, the run
    // resumes and finishes.
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let (ok, err) = train("unreachable", &endpoint("vllm", &url));
    assert!(!ok);
    assert!(
        err.contains("pools.rollout.endpoints[0]") && err.contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
    let (_engine, _) = serve(
        &["--recipe", recipe.to_str().unwrap()],
        &format!("127.0.0.1:{port}"),
    );
    let resumed = run_ok(
        trellis()
            .args(["resume", "--quiet"])
            .arg(dir.join("unreachable")),
    );
    assert!(resumed.status.success());
    assert!(rl_rows(&dir.join("unreachable")) >= 2);

    // The wrong model: both names are in the message.
    let mut wrong = endpoint("vllm", &url);
    wrong.push("pools.rollout.model=Qwen/Qwen2.5-0.5B-Instruct".into());
    let (ok, err) = train("wrong-model", &wrong);
    assert!(!ok);
    assert!(
        err.contains("Qwen/Qwen2.5-0.5B-Instruct") && err.contains("tiny-arith"),
        "{err}"
    );

    // A malformed answer: named as such, with the route.
    let malformed = fake_server(|line| match line {
        l if l.starts_with("GET /v1/models") => (200, r#"{"data":[{"id":"m"}]}"#),
        l if l.starts_with("POST /inference/v1/generate") => {
            (200, r#"{"choices":[{"token_ids":"seven"}]}"#)
        }
        _ => (200, "{}"),
    });
    let (ok, err) = train("malformed", &endpoint("vllm", &malformed));
    assert!(!ok);
    assert!(
        err.contains("/inference/v1/generate: malformed response"),
        "{err}"
    );

    // A vLLM without the dev-mode routes cannot take pushes: the message says how to start it.
    let no_dev_mode = fake_server(|line| match line {
        l if l.starts_with("GET /v1/models") => (200, r#"{"data":[{"id":"m"}]}"#),
        l if l.starts_with("POST /pause") => (404, r#"{"detail":"Not Found"}"#),
        _ => (200, "{}"),
    });
    let (ok, err) = train("no-dev-mode", &endpoint("vllm", &no_dev_mode));
    assert!(!ok);
    assert!(err.contains("VLLM_SERVER_DEV_MODE=1"), "{err}");

    // An engine reporting raw log-probs: refused when the run trains on the engine's log-probs
    // (async), accepted with a warning when the learner recomputes them (sync).
    let (_raw, raw_url) = serve(
        &[
            "--recipe",
            recipe.to_str().unwrap(),
            "--logprobs-mode",
            "raw_logprobs",
        ],
        "127.0.0.1:0",
    );
    let mut asynchronous = endpoint("served", &raw_url);
    asynchronous.push("stages.rl.trainer.mode=async".into());
    let (ok, err) = train("raw-async", &asynchronous);
    assert!(!ok);
    assert!(
        err.contains("raw log-probs") && err.contains("--logprobs-mode processed_logprobs"),
        "{err}"
    );
    let (ok, err) = train("raw-sync", &endpoint("served", &raw_url));
    assert!(ok, "{err}");

    // An engine that wants an API key: without one, and with the wrong one, the run stops
    // before training and says so; an HTTPS engine whose certificate nobody signed is refused
    // by name.
    let tls = [data("tls/cert.pem"), data("tls/key.pem")];
    let (_keyed, keyed_url) = serve(
        &[
            "--recipe",
            recipe.to_str().unwrap(),
            "--api-key",
            "right",
            "--ssl-certfile",
            tls[0].to_str().unwrap(),
            "--ssl-keyfile",
            tls[1].to_str().unwrap(),
        ],
        "127.0.0.1:0",
    );
    let (ok, err) = train("untrusted", &endpoint("served", &keyed_url));
    assert!(!ok);
    assert!(
        err.contains(&keyed_url) && err.contains("invalid peer certificate"),
        "{err}"
    );
    let keyed_train = |run: &str, key: Option<&str>| {
        let mut cmd = trellis();
        cmd.arg("train")
            .arg(&recipe)
            .env("SSL_CERT_FILE", &tls[0])
            .args(["--quiet", "-o", "stages.rl.trainer.steps=2", "--run-dir"])
            .arg(dir.join(run))
            .args(
                endpoint("served", &keyed_url)
                    .iter()
                    .flat_map(|o| ["-o", o.as_str()]),
            );
        if let Some(key) = key {
            cmd.env("TRELLIS_TEST_ENGINE_KEY", key)
                .args(["-o", "pools.rollout.api_key_env=TRELLIS_TEST_ENGINE_KEY"]);
        }
        let out = cmd.output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (status, err) = keyed_train("no-key", None);
    assert!(!status.success());
    assert!(
        err.contains("HTTP 401") && err.contains("pools.rollout.api_key_env"),
        "{err}"
    );
    let (status, err) = keyed_train("wrong-key", Some("wrong"));
    assert!(!status.success());
    assert!(err.contains("refused the API key"), "{err}");
    let (status, err) = keyed_train("unset-key", Some(""));
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("pools.rollout.api_key_env: `TRELLIS_TEST_ENGINE_KEY` is not set"),
        "{err}"
    );

    // Validation: an external engine without endpoints.
    let (ok, err) = train("no-endpoints", &["pools.rollout.engine=sglang".to_string()]);
    assert!(!ok);
    assert!(err.contains("pools.rollout.endpoints: is empty"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Qwen-style chat template (the tiny checkpoint has the tokens but ships no template).
const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// What the test asks of `trellis engine serve` through the `openai` package (argv: base URL,
/// model id). Prints one JSON object.
const OPENAI_CLIENT: &str = r#"
import json, sys
import openai

base, model = sys.argv[1:3]
out = {}
try:
    openai.OpenAI(base_url=base, api_key="wrong").models.list()
except openai.AuthenticationError as e:
    out["wrong_key"] = e.status_code
c = openai.OpenAI(base_url=base, api_key="sk-test")
msgs = [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+2="}]
kw = dict(model=model, messages=msgs, max_tokens=24, temperature=1.0, seed=7)
full = c.chat.completions.create(**kw)
out["full"] = [full.choices[0].message.role, full.choices[0].message.content,
               full.choices[0].finish_reason, full.usage.prompt_tokens, full.usage.completion_tokens]
chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
out["stream"] = [deltas[0].role, "".join(d.content or "" for d in deltas),
                 [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason],
                 chunks[-1].usage.completion_tokens if chunks[-1].usage else None,
                 sum(1 for d in deltas if d.content)]
# The same conversation as a text completion of the rendered template.
rendered = "<|im_start|>system\nYou add.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
text = c.completions.create(model=model, prompt=rendered, max_tokens=24, temperature=1.0, seed=7)
out["completion"] = text.choices[0].text
streamed = c.completions.create(model=model, prompt=rendered, max_tokens=24, temperature=1.0, seed=7, stream=True)
out["completion_stream"] = "".join(ch.choices[0].text for ch in streamed if ch.choices)
# A stop string from the middle of the text ends it there.
content = full.choices[0].message.content
stop = content[len(content) // 2:][:2]
cut = c.chat.completions.create(stop=[stop], **kw)
out["stop"] = [stop, cut.choices[0].message.content, cut.choices[0].finish_reason]
cut_stream = c.chat.completions.create(stop=[stop], stream=True, **kw)
out["stop_stream"] = "".join(ch.choices[0].delta.content or "" for ch in cut_stream if ch.choices)
# What the server does not do is refused by name, not ignored.
for name, extra in [("presence_penalty", {"presence_penalty": 0.5}), ("no_such_field", {"extra_body": {"no_such_field": 1}})]:
    try:
        c.chat.completions.create(**kw, **extra)
    except openai.BadRequestError as e:
        out[name] = [e.status_code, name in str(e)]
print(json.dumps(out))
"#;

#[test]
fn the_openai_python_package_streams_chat_completions_from_engine_serve() {
    let Some(python) = python() else { return };
    let dir = scratch("openai");
    let template = dir.join("chat.jinja");
    std::fs::write(&template, CHAT_TEMPLATE).unwrap();
    let model_dir = data("tiny-qwen2/checkpoint");
    let (_server, url) = serve(
        &[
            "--model",
            model_dir.to_str().unwrap(),
            "--served-model-name",
            "tiny",
            "--chat-template",
            template.to_str().unwrap(),
            "--api-key",
            "sk-test",
        ],
        "127.0.0.1:0",
    );
    // Health stays open; everything else wants the key.
    let rt = runtime();
    let http = HttpClient::new(&url, Duration::from_secs(30)).unwrap();
    assert!(rt.block_on(http.get_text("/health")).is_ok());
    let (code, _) = rt
        .block_on(http.post_raw("/v1/completions", &json!({"prompt": "1", "max_tokens": 1})))
        .unwrap();
    assert_eq!(code, 401);

    let out = std::process::Command::new(&python)
        .args(["-c", OPENAI_CLIENT, &format!("{url}/v1"), "tiny"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["wrong_key"], 401, "{got}");
    let full = &got["full"];
    assert_eq!(full[0], "assistant", "{got}");
    let content = full[1].as_str().unwrap();
    assert!(content.chars().count() >= 4, "too short to cut: {got}");
    // Streamed: a role chunk first, pieces that add up to the same text, one finish reason, the
    // usage chunk last.
    let stream = &got["stream"];
    assert_eq!(stream[0], "assistant", "{got}");
    assert_eq!(stream[1], full[1], "{got}");
    assert_eq!(stream[2], json!([full[2]]), "{got}");
    assert_eq!(stream[3], full[4], "{got}");
    assert!(
        stream[4].as_u64().unwrap() > 1,
        "one chunk is not a stream: {got}"
    );
    // The chat template was applied: the same text as completing the rendered conversation.
    assert_eq!(got["completion"], full[1], "{got}");
    assert_eq!(got["completion_stream"], full[1], "{got}");
    let stop = got["stop"][0].as_str().unwrap();
    let want = &content[..content.find(stop).unwrap()];
    assert_eq!(got["stop"][1], want, "{got}");
    assert_eq!(got["stop"][2], "stop", "{got}");
    assert_eq!(got["stop_stream"], want, "{got}");
    assert_eq!(got["presence_penalty"], json!([400, true]), "{got}");
    assert_eq!(got["no_such_field"], json!([400, true]), "{got}");
    std::fs::remove_dir_all(&dir).unwrap();
}
