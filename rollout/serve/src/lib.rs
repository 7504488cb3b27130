//! The engine server (`trellis engine serve`): the native engine behind vLLM's HTTP routes and
//! JSON shapes (and
//! SGLang's), so any OpenAI-compatible client can use it and Trellis's own `vllm` and `sglang`
//! adapters are tested against a real server process.
//!
//! Routes. vLLM: `GET /health`, `GET /v1/models`, `GET /version`, `GET /metrics` (Prometheus,
//! vLLM's gauge names), `POST /v1/completions` (text or token-id prompts), `POST
//! /inference/v1/generate` (tokens in, tokens out, with weight-version spans), and the dev-mode
//! control routes `POST /pause?mode=wait|keep|abort`, `/resume`, `GET /is_paused`, `POST
//! /reset_prefix_cache`, `/collective_rpc` (method `reload_weights`), `/update_weight_version`.
//! SGLang: `POST /generate`, `/update_weights_from_disk`, `/pause_generation`,
//! `/continue_generation`, `/flush_cache`, `GET /model_info` (`/get_model_info`).
//!
//! Weights: a reload reads a checkpoint folder of the served model's shape. While paused, the new
//! weights wait and are swapped in at `update_weight_version` (with that version) or at resume;
//! otherwise they are swapped in at once as the next version. A version label is the client's to
//! choose (any, as vLLM's `update_weight_version`). A pause waits
//! for the generations in flight (every mode: this engine has no preemption, so `abort` and
//! `keep` wait too), and holds new ones until resume.
//!
//! Owns: HTTP, JSON shapes, pause and version bookkeeping. Never: samples (the native engine
//! does) or trains.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kernels::tensor::WeightSnapshot;
use learner::checkpoint::Checkpoint;
use learner::params::Params;
use learner::tokenizer::Tokenizer;
use learner::{Model, ModelConfig};
use rollout::native::{NativeConfig, NativeEngine};
use rollout::{Completion, FinishReason, GenerateRequest, InferenceEngine, SamplingParams};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{Mutex, RwLock, watch};

/// Largest request body accepted.
const MAX_BODY: usize = 16 << 20;

/// What `trellis engine serve` serves.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A checkpoint folder (its tokenizer.json, when present, serves text prompts).
    Checkpoint(PathBuf),
    /// A model in memory (e.g. the one a workflow starts from, the shape a run of that workflow
    /// pushes its weights into).
    Loaded(Box<Loaded>),
}

/// A model in memory, its tokenizer, and what to call it.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The model.
    pub model: Model,
    /// Its tokenizer (serves text prompts).
    pub tokenizer: Option<Tokenizer>,
    /// Its name (the default model id).
    pub name: String,
}

/// How `trellis engine serve` starts.
#[derive(Clone, Debug)]
pub struct EngineServeOptions {
    /// The model to serve.
    pub model: ModelSource,
    /// Address to listen on (port 0: any).
    pub listen: SocketAddr,
    /// The model id clients name (default: the folder or recipe as given, as vLLM does).
    pub served_model_name: Option<String>,
    /// KV-cache budget in bytes.
    pub kv_cache_bytes: usize,
    /// Answer `/inference/v1/generate` with 403, as vLLM 0.32 started without
    /// `--enable-scale-out` does (clients then fall back to `/v1/completions`).
    pub completions_only: bool,
    /// Report `log_softmax(logits)` of sampled tokens, as vLLM's default `raw_logprobs`
    /// mode does, instead of the sampled distribution's (`processed_logprobs`, the default here).
    pub raw_logprobs: bool,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineServeError {
    /// The checkpoint does not load.
    #[error(transparent)]
    Model(#[from] learner::Error),
    /// The address cannot be bound.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
}

struct State {
    engine: NativeEngine,
    completions_only: bool,
    name: String,
    path: String,
    config: ModelConfig,
    tokenizer: Option<Tokenizer>,
    /// The weights served now (to swap in again under a new version label).
    current: Mutex<Arc<Params>>,
    /// Weights reloaded while paused, swapped in at the version update or the resume.
    pending: Mutex<Option<Params>>,
    paused: watch::Sender<bool>,
    /// Generations hold it shared; a pause takes it exclusively to wait for them.
    inflight: RwLock<()>,
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
}

/// An HTTP error answer: status and message, in vLLM's error shape.
struct HttpError(StatusCode, String);

fn bad(msg: impl Into<String>) -> HttpError {
    HttpError(StatusCode::BAD_REQUEST, msg.into())
}

type Answer = Result<Response<Full<Bytes>>, HttpError>;

/// Loads the model and serves until `shutdown` resolves; `ready` gets the bound address.
pub async fn serve(
    opts: EngineServeOptions,
    ready: impl FnOnce(SocketAddr, &str),
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), EngineServeError> {
    let (model, tokenizer, path) = match &opts.model {
        ModelSource::Checkpoint(dir) => {
            let ckpt = Checkpoint::load(dir)?;
            let tokenizer = ckpt.tokenizer().transpose()?;
            (ckpt.model, tokenizer, dir.display().to_string())
        }
        ModelSource::Loaded(m) => (m.model.clone(), m.tokenizer.clone(), m.name.clone()),
    };
    let config = model.config.clone();
    let current = Arc::new(model.params.clone());
    let engine = NativeEngine::new(
        model,
        NativeConfig {
            kv_cache_bytes: opts.kv_cache_bytes,
            raw_logprobs: opts.raw_logprobs,
            ..Default::default()
        },
    );
    let state = Arc::new(State {
        engine,
        completions_only: opts.completions_only,
        name: opts.served_model_name.unwrap_or_else(|| path.clone()),
        path,
        config,
        tokenizer,
        current: Mutex::new(current),
        pending: Mutex::new(None),
        paused: watch::channel(false).0,
        inflight: RwLock::new(()),
        requests: AtomicU64::new(0),
        prompt_tokens: AtomicU64::new(0),
        generation_tokens: AtomicU64::new(0),
    });
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| EngineServeError::Listen(opts.listen, e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| EngineServeError::Listen(opts.listen, e))?;
    ready(addr, &state.name);
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { Ok::<_, std::convert::Infallible>(handle(&state, req).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
}

async fn handle(state: &State, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(HttpError(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("cannot read the body: {e} (limit {MAX_BODY} bytes)"),
            ));
        }
    };
    let json_body = || -> Result<Value, HttpError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(json!({}));
        }
        serde_json::from_slice(&body).map_err(|e| bad(format!("the body is not JSON: {e}")))
    };
    let answer = match (&method, path.as_str()) {
        (&Method::GET, "/health") => Ok(text(StatusCode::OK, "")),
        (&Method::GET, "/version") => ok(json!({"version": env!("CARGO_PKG_VERSION")})),
        (&Method::GET, "/v1/models") => ok(json!({"object": "list", "data": [{
            "id": state.name, "object": "model", "owned_by": "trellis", "root": state.path,
            "max_model_len": state.config.max_position_embeddings}]})),
        (&Method::GET, "/metrics") => Ok(text(StatusCode::OK, &metrics(state))),
        (&Method::GET, "/is_paused") => ok(json!({"is_paused": *state.paused.borrow()})),
        (&Method::GET, "/model_info" | "/get_model_info") => ok(json!({
            "model_path": state.path, "served_model_name": state.name, "is_generation": true,
            "weight_version": state.engine.weight_version().to_string()})),
        (&Method::POST, "/inference/v1/generate") if state.completions_only => Err(HttpError(
            StatusCode::FORBIDDEN,
            "Scale-out endpoints are disabled (started with --completions-only).".into(),
        )),
        (&Method::POST, "/inference/v1/generate") => match json_body() {
            Ok(b) => tokens_generate(state, &b).await,
            Err(e) => Err(e),
        },
        (&Method::POST, "/v1/completions") => match json_body() {
            Ok(b) => completions(state, &b).await,
            Err(e) => Err(e),
        },
        (&Method::POST, "/generate") => match json_body() {
            Ok(b) => sglang_generate(state, &b).await,
            Err(e) => Err(e),
        },
        (&Method::POST, "/pause" | "/pause_generation") => {
            let mode = query_param(&query, "mode").unwrap_or("wait");
            if !["wait", "keep", "abort", "in_place", "retract"].contains(&mode) {
                Err(bad(format!("mode `{mode}`: expected wait, keep or abort")))
            } else {
                state.paused.send_replace(true);
                // Wait for the generations in flight.
                drop(state.inflight.write().await);
                ok(json!({"status": "paused"}))
            }
        }
        (&Method::POST, "/resume" | "/continue_generation") => resume(state).await,
        (&Method::POST, "/reset_prefix_cache" | "/flush_cache") => ok(json!({"success": true})),
        (&Method::POST, "/collective_rpc") => match json_body() {
            Ok(b) => collective_rpc(state, &b).await,
            Err(e) => Err(e),
        },
        (&Method::POST, "/update_weight_version") => match json_body() {
            Ok(b) => update_version(state, &b["new_version"]).await,
            Err(e) => Err(e),
        },
        (&Method::POST, "/update_weights_from_disk") => match json_body() {
            Ok(b) => update_from_disk(state, &b).await,
            Err(e) => Err(e),
        },
        (_, p) => Err(HttpError(
            StatusCode::NOT_FOUND,
            format!("no route {method} {p}"),
        )),
    };
    answer.unwrap_or_else(error)
}

fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn ok(v: Value) -> Answer {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())));
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    Ok(r)
}

fn error(HttpError(status, message): HttpError) -> Response<Full<Bytes>> {
    let kind = if status == StatusCode::NOT_FOUND {
        "NotFoundError"
    } else if status.is_server_error() {
        "InternalServerError"
    } else {
        "BadRequestError"
    };
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()},
        "object": "error", "message": message});
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// Sampling settings from a JSON object: `max_key` is vLLM's `max_tokens` or SGLang's
/// `max_new_tokens`, `seed_key` `seed` or `sampling_seed`. Every field is checked by name.
fn sampling(v: &Value, max_key: &str, seed_key: &str) -> Result<SamplingParams, HttpError> {
    let d = SamplingParams::default();
    let num = |k: &str| -> Result<Option<f64>, HttpError> {
        match &v[k] {
            Value::Null => Ok(None),
            x => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad(format!("`{k}` must be a number, got {x}"))),
        }
    };
    let count = |k: &str| -> Result<Option<usize>, HttpError> {
        match &v[k] {
            Value::Null => Ok(None),
            x => x
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| bad(format!("`{k}` must be a non-negative integer, got {x}"))),
        }
    };
    let top_k = match num("top_k")? {
        None => 0,
        Some(k) if k <= 0.0 => 0,
        Some(k) => k as usize,
    };
    let stop_token_ids = match &v["stop_token_ids"] {
        Value::Null => Vec::new(),
        Value::Array(a) => a
            .iter()
            .map(|t| t.as_u64().map(|t| t as u32))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("`stop_token_ids` must be token ids"))?,
        x => return Err(bad(format!("`stop_token_ids` must be a list, got {x}"))),
    };
    let p = SamplingParams {
        n: count("n")?.unwrap_or(1),
        temperature: num("temperature")?.map_or(d.temperature, |x| x as f32),
        top_k,
        top_p: num("top_p")?.map_or(d.top_p, |x| x as f32),
        min_p: num("min_p")?.map_or(d.min_p, |x| x as f32),
        max_tokens: count(max_key)?.unwrap_or(d.max_tokens),
        stop_token_ids,
        ignore_eos: v["ignore_eos"].as_bool().unwrap_or(false),
        seed: match &v[seed_key] {
            Value::Null => None,
            x => Some(x.as_u64().ok_or_else(|| {
                bad(format!(
                    "`{seed_key}` must be a non-negative integer, got {x}"
                ))
            })?),
        },
    };
    p.validate().map_err(bad)?;
    Ok(p)
}

fn token_ids(v: &Value, field: &str) -> Result<Vec<u32>, HttpError> {
    v.as_array()
        .and_then(|a| {
            a.iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
        })
        .ok_or_else(|| bad(format!("`{field}` must be a list of token ids")))
}

/// Runs requests on the engine, waiting while paused and counting them.
async fn run(state: &State, reqs: Vec<GenerateRequest>) -> Result<Vec<Completion>, HttpError> {
    let mut paused = state.paused.subscribe();
    let guard = loop {
        let _ = paused.wait_for(|p| !*p).await;
        let g = state.inflight.read().await;
        // A pause that came in between: wait for its resume.
        if !*state.paused.borrow() {
            break g;
        }
    };
    state
        .requests
        .fetch_add(reqs.len() as u64, Ordering::Relaxed);
    let prompt: usize = reqs.iter().map(|r| r.prompt.len()).sum();
    state
        .prompt_tokens
        .fetch_add(prompt as u64, Ordering::Relaxed);
    let out = state.engine.generate(reqs).await;
    drop(guard);
    let out = out.map_err(|e| match e {
        rollout::EngineError::InvalidRequest { msg, .. } => bad(msg),
        e => HttpError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    })?;
    let generated: usize = out.iter().map(|c| c.token_ids.len()).sum();
    state
        .generation_tokens
        .fetch_add(generated as u64, Ordering::Relaxed);
    Ok(out)
}

fn finish(c: &Completion) -> &'static str {
    match c.finish_reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn decode(state: &State, ids: &[u32]) -> String {
    state
        .tokenizer
        .as_ref()
        .and_then(|t| t.decode(ids).ok())
        .unwrap_or_default()
}

async fn tokens_generate(state: &State, b: &Value) -> Answer {
    let prompt = token_ids(&b["token_ids"], "token_ids")?;
    let params = sampling(&b["sampling_params"], "max_tokens", "seed")?;
    let out = run(state, vec![GenerateRequest { prompt, params }]).await?;
    let choices: Vec<Value> = out
        .iter()
        .map(|c| {
            json!({"index": c.index, "token_ids": c.token_ids, "finish_reason": finish(c),
                "logprobs": {"content": c.token_ids.iter().zip(&c.logprobs)
                    .map(|(t, l)| json!({"token_id": t, "logprob": l})).collect::<Vec<_>>()},
                "weight_versions": c.weight_versions})
        })
        .collect();
    ok(json!({"choices": choices}))
}

async fn completions(state: &State, b: &Value) -> Answer {
    if let Some(m) = b["model"].as_str()
        && m != state.name
    {
        return Err(HttpError(
            StatusCode::NOT_FOUND,
            format!(
                "The model `{m}` does not exist (this server serves `{}`).",
                state.name
            ),
        ));
    }
    let encode = |s: &str| -> Result<Vec<u32>, HttpError> {
        let t = state
            .tokenizer
            .as_ref()
            .ok_or_else(|| bad("this model has no tokenizer.json: send the prompt as token ids"))?;
        t.encode(s).map_err(|e| bad(e.to_string()))
    };
    // A string, a list of ids, a list of strings, or a list of lists of ids.
    let prompts: Vec<Vec<u32>> = match &b["prompt"] {
        Value::String(s) => vec![encode(s)?],
        Value::Array(a) if a.iter().all(Value::is_number) => {
            vec![token_ids(&b["prompt"], "prompt")?]
        }
        Value::Array(a) => a
            .iter()
            .map(|p| match p {
                Value::String(s) => encode(s),
                ids => token_ids(ids, "prompt"),
            })
            .collect::<Result<_, _>>()?,
        x => return Err(bad(format!("`prompt` must be text or token ids, got {x}"))),
    };
    let params = sampling(b, "max_tokens", "seed")?;
    let want_logprobs = !b["logprobs"].is_null();
    let as_ids = b["return_tokens_as_token_ids"].as_bool().unwrap_or(false);
    let with_ids = b["return_token_ids"].as_bool().unwrap_or(false);
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .map(|p| GenerateRequest {
            prompt: p.clone(),
            params: params.clone(),
        })
        .collect();
    let out = run(state, reqs).await?;
    let n = params.n;
    let choices: Vec<Value> = out
        .iter()
        .map(|c| {
            let mut ch = json!({"index": c.request * n + c.index, "text": decode(state, &c.token_ids),
                "finish_reason": finish(c), "logprobs": null});
            if with_ids {
                ch["token_ids"] = json!(c.token_ids);
                ch["prompt_token_ids"] = json!(prompts[c.request]);
            }
            if want_logprobs {
                let tokens: Vec<String> = c
                    .token_ids
                    .iter()
                    .map(|&t| {
                        if as_ids {
                            format!("token_id:{t}")
                        } else {
                            decode(state, &[t])
                        }
                    })
                    .collect();
                ch["logprobs"] = json!({"tokens": tokens, "token_logprobs": c.logprobs,
                    "top_logprobs": null, "text_offset": []});
            }
            ch
        })
        .collect();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let completion_tokens: usize = out.iter().map(|c| c.token_ids.len()).sum();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    ok(
        json!({"id": format!("cmpl-{}", state.requests.load(Ordering::Relaxed)),
        "object": "text_completion", "created": created, "model": state.name, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}}),
    )
}

async fn sglang_generate(state: &State, b: &Value) -> Answer {
    let prompt = match (&b["input_ids"], &b["text"]) {
        (Value::Null, Value::String(s)) => state
            .tokenizer
            .as_ref()
            .ok_or_else(|| bad("this model has no tokenizer.json: send input_ids"))?
            .encode(s)
            .map_err(|e| bad(e.to_string()))?,
        (ids, _) => token_ids(ids, "input_ids")?,
    };
    let params = sampling(&b["sampling_params"], "max_new_tokens", "sampling_seed")?;
    let plen = prompt.len();
    let logprob = b["return_logprob"].as_bool().unwrap_or(false);
    let out = run(state, vec![GenerateRequest { prompt, params }]).await?;
    let many = out.len() > 1;
    let items: Vec<Value> = out
        .iter()
        .map(|c| {
            let version = c
                .weight_versions
                .last()
                .map_or(state.engine.weight_version(), |s| s.version);
            let mut meta = json!({"prompt_tokens": plen, "completion_tokens": c.token_ids.len(),
                "finish_reason": {"type": finish(c)}, "weight_version": version.to_string()});
            if logprob {
                meta["output_token_logprobs"] = c
                    .token_ids
                    .iter()
                    .zip(&c.logprobs)
                    .map(|(t, l)| json!([l, t, null]))
                    .collect();
            }
            json!({"text": decode(state, &c.token_ids), "output_ids": c.token_ids, "meta_info": meta})
        })
        .collect();
    if many {
        ok(Value::Array(items))
    } else {
        ok(items.into_iter().next().unwrap_or(Value::Null))
    }
}

/// Reads a checkpoint folder of the served model's shape.
fn load_params(state: &State, dir: &str) -> Result<Params, HttpError> {
    let dir = Path::new(dir);
    if !dir.is_absolute() {
        return Err(bad(format!(
            "`{}`: give an absolute path (the server's working directory is not the caller's)",
            dir.display()
        )));
    }
    Model::load_weights(state.config.clone(), dir)
        .map(|m| m.params)
        .map_err(|e| bad(format!("cannot load weights: {e}")))
}

/// Serves `params` as `version` (any version: clients own the labels, as with vLLM; a trainer
/// that restarts from an older checkpoint pushes an older version).
async fn swap(state: &State, params: Arc<Params>, version: u64) -> Result<(), HttpError> {
    state
        .engine
        .replace_weights(WeightSnapshot {
            version,
            params: Arc::clone(&params),
        })
        .await
        .map_err(|e| bad(e.to_string()))?;
    *state.current.lock().await = params;
    Ok(())
}

/// Swaps freshly read weights in: now as the next version, or at the version update / resume
/// when paused.
async fn stage_weights(state: &State, params: Params) -> Result<(), HttpError> {
    if *state.paused.borrow() {
        *state.pending.lock().await = Some(params);
        Ok(())
    } else {
        swap(state, Arc::new(params), state.engine.weight_version() + 1).await
    }
}

async fn collective_rpc(state: &State, b: &Value) -> Answer {
    match b["method"].as_str() {
        Some("reload_weights") => {
            let dir = b["kwargs"]["weights_path"].as_str().ok_or_else(|| {
                bad("reload_weights needs kwargs.weights_path (a checkpoint folder)")
            })?;
            let params = load_params(state, dir)?;
            stage_weights(state, params).await?;
            ok(json!({"results": [null]}))
        }
        Some(m) => Err(bad(format!(
            "collective_rpc method `{m}` is not supported here (reload_weights is)"
        ))),
        None => Err(bad("collective_rpc needs `method`")),
    }
}

async fn update_version(state: &State, v: &Value) -> Answer {
    let version = rollout::external::http::as_u64(v)
        .ok_or_else(|| bad(format!("`new_version` must be an integer version, got {v}")))?;
    let pending = state.pending.lock().await.take();
    let params = match pending {
        Some(p) => Arc::new(p),
        None if version == state.engine.weight_version() => return ok(json!({})),
        None => Arc::clone(&*state.current.lock().await),
    };
    swap(state, params, version).await?;
    ok(json!({}))
}

async fn resume(state: &State) -> Answer {
    if let Some(p) = state.pending.lock().await.take() {
        swap(state, Arc::new(p), state.engine.weight_version() + 1).await?;
    }
    state.paused.send_replace(false);
    ok(json!({"status": "resumed"}))
}

async fn update_from_disk(state: &State, b: &Value) -> Answer {
    let result = async {
        let dir = b["model_path"]
            .as_str()
            .ok_or_else(|| bad("update_weights_from_disk needs `model_path`"))?;
        let params = load_params(state, dir)?;
        match &b["weight_version"] {
            Value::Null => stage_weights(state, params).await,
            v => {
                let version = rollout::external::http::as_u64(v).ok_or_else(|| {
                    bad(format!(
                        "`weight_version` must be an integer version, got {v}"
                    ))
                })?;
                state.pending.lock().await.take();
                swap(state, Arc::new(params), version).await
            }
        }
    }
    .await;
    match result {
        Ok(()) => ok(json!({"success": true, "message": "Succeeded to update model weights."})),
        Err(HttpError(status, msg)) => {
            let mut r = ok(json!({"success": false, "message": msg}))?;
            *r.status_mut() = status;
            Ok(r)
        }
    }
}

fn metrics(state: &State) -> String {
    let s = state.engine.stats();
    let kv = s.kv_usage(state.engine.kv_shape().num_blocks);
    let name = state.name.replace('\\', "\\\\").replace('"', "\\\"");
    let gauges = [
        (
            "vllm:num_requests_running",
            "Sequences decoding.",
            s.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Requests waiting for KV-cache blocks.",
            s.waiting as f64,
        ),
        ("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1.", kv),
        (
            "sglang:num_running_reqs",
            "Sequences decoding.",
            s.running as f64,
        ),
        (
            "sglang:num_queue_reqs",
            "Requests waiting.",
            s.waiting as f64,
        ),
        ("sglang:token_usage", "KV-cache usage, 0..1.", kv),
        (
            "trellis:weight_version",
            "Weight version served.",
            state.engine.weight_version() as f64,
        ),
    ];
    let counters = [
        (
            "vllm:prompt_tokens_total",
            "Prompt tokens received.",
            state.prompt_tokens.load(Ordering::Relaxed),
        ),
        (
            "vllm:generation_tokens_total",
            "Tokens generated.",
            state.generation_tokens.load(Ordering::Relaxed),
        ),
        (
            "vllm:request_success_total",
            "Requests served.",
            state.requests.load(Ordering::Relaxed),
        ),
        (
            "trellis:prefill_tokens_total",
            "Prompt tokens run through the model (once per prompt, whatever n).",
            s.prefill_tokens,
        ),
        (
            "trellis:prefill_passes_total",
            "Forward passes over prompts (prompts admitted together share one).",
            s.prefill_passes,
        ),
        (
            "trellis:decode_steps_total",
            "Decode steps.",
            s.decode_steps,
        ),
    ];
    let mut out = String::new();
    for (n, help, v) in gauges {
        out.push_str(&format!(
            "# HELP {n} {help}\n# TYPE {n} gauge\n{n}{{model_name=\"{name}\"}} {v}\n"
        ));
    }
    for (n, help, v) in counters {
        out.push_str(&format!(
            "# HELP {n} {help}\n# TYPE {n} counter\n{n}{{model_name=\"{name}\"}} {v}\n"
        ));
    }
    out
}
