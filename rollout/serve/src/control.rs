//! The control routes: pause and resume, weight reloads and version labels, model info,
//! Prometheus metrics.
//!
//! Owns: the pause and version bookkeeping. Never: generates.

use crate::{Answer, HttpError, Shared, State, bad, ok, parse};
use axum::body::Bytes;
use axum::extract::State as With;
use axum::http::{StatusCode, Uri};
use axum::response::IntoResponse;
use kernels::tensor::WeightSnapshot;
use learner::Model;
use learner::params::Params;
use rollout::InferenceEngine;
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(crate) async fn models(With(state): With<Shared>) -> Answer {
    ok(json!({"object": "list", "data": [{
        "id": state.name, "object": "model", "owned_by": "trellis", "root": state.path,
        "max_model_len": state.config.max_position_embeddings}]}))
}

pub(crate) async fn model_info(With(state): With<Shared>) -> Answer {
    ok(json!({
        "model_path": state.path, "served_model_name": state.name, "is_generation": true,
        "weight_version": state.engine.weight_version().to_string()}))
}

pub(crate) async fn is_paused(With(state): With<Shared>) -> Answer {
    ok(json!({"is_paused": *state.paused.borrow()}))
}

fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// `POST /pause?mode=…` (vLLM) and `/pause_generation` (SGLang, `{"mode": …}`): waits for the
/// generations in flight and holds new ones.
pub(crate) async fn pause(With(state): With<Shared>, uri: Uri, bytes: Bytes) -> Answer {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        mode: Option<String>,
    }
    let b: Body = parse(&bytes)?;
    let mode = b
        .mode
        .as_deref()
        .or_else(|| query_param(uri.query().unwrap_or(""), "mode"))
        .unwrap_or("wait");
    if !["wait", "keep", "abort", "in_place", "retract"].contains(&mode) {
        return Err(bad(format!("mode `{mode}`: expected wait, keep or abort")));
    }
    state.paused.send_replace(true);
    // Wait for the generations in flight.
    drop(state.inflight.write().await);
    ok(json!({"status": "paused"}))
}

/// `POST /resume` (vLLM), `/continue_generation` (SGLang): swaps in weights reloaded while
/// paused, then lets generations in.
pub(crate) async fn resume(With(state): With<Shared>) -> Answer {
    if let Some(p) = state.pending.lock().await.take() {
        swap(&state, Arc::new(p), state.engine.weight_version() + 1).await?;
    }
    state.paused.send_replace(false);
    ok(json!({"status": "resumed"}))
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
        .replace_weights(WeightSnapshot::new(version, Arc::clone(&params)))
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

/// A version label: a number, or a string holding one (vLLM's clients send either).
#[derive(Deserialize)]
#[serde(untagged, expecting = "an integer version (a number or a string)")]
enum Version {
    Number(u64),
    Text(String),
}

impl Version {
    fn get(&self, field: &str) -> Result<u64, HttpError> {
        match self {
            Version::Number(n) => Ok(*n),
            Version::Text(s) => s
                .trim()
                .parse()
                .map_err(|_| bad(format!("`{field}` must be an integer version, got `{s}`"))),
        }
    }
}

/// vLLM's `POST /collective_rpc` with method `reload_weights`.
pub(crate) async fn collective_rpc(With(state): With<Shared>, bytes: Bytes) -> Answer {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        method: String,
        #[serde(default)]
        kwargs: Value,
        #[allow(dead_code)]
        timeout: Option<f64>,
        #[allow(dead_code)]
        args: Option<Value>,
    }
    let b: Body = parse(&bytes)?;
    if b.method != "reload_weights" {
        return Err(bad(format!(
            "collective_rpc method `{}` is not supported here (reload_weights is)",
            b.method
        )));
    }
    let dir = b.kwargs["weights_path"]
        .as_str()
        .ok_or_else(|| bad("reload_weights needs kwargs.weights_path (a checkpoint folder)"))?;
    let params = load_params(&state, dir)?;
    stage_weights(&state, params).await?;
    ok(json!({"results": [null]}))
}

/// vLLM's `POST /update_weight_version`: the served weights (or those reloaded while paused)
/// under a new label.
pub(crate) async fn update_version(With(state): With<Shared>, bytes: Bytes) -> Answer {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        new_version: Version,
        #[allow(dead_code)]
        abort_all_requests: Option<bool>,
    }
    let b: Body = parse(&bytes)?;
    let version = b.new_version.get("new_version")?;
    let pending = state.pending.lock().await.take();
    let params = match pending {
        Some(p) => Arc::new(p),
        None if version == state.engine.weight_version() => return ok(json!({})),
        None => Arc::clone(&*state.current.lock().await),
    };
    swap(&state, params, version).await?;
    ok(json!({}))
}

/// SGLang's `POST /update_weights_from_disk`; failures answer `success: false` with the status.
pub(crate) async fn update_from_disk(With(state): With<Shared>, bytes: Bytes) -> Answer {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        model_path: String,
        weight_version: Option<Version>,
        #[allow(dead_code)]
        flush_cache: Option<bool>,
        #[allow(dead_code)]
        abort_all_requests: Option<bool>,
    }
    let result = async {
        let b: Body = parse(&bytes)?;
        let params = load_params(&state, &b.model_path)?;
        match &b.weight_version {
            None => stage_weights(&state, params).await,
            Some(v) => {
                let version = v.get("weight_version")?;
                state.pending.lock().await.take();
                swap(&state, Arc::new(params), version).await
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

/// `GET /metrics`: vLLM's and SGLang's gauge names, and Trellis's counters.
pub(crate) async fn metrics(With(state): With<Shared>) -> axum::response::Response {
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
    (StatusCode::OK, out).into_response()
}
