//! The SGLang adapter: an [`InferenceEngine`] over an SGLang server's HTTP API (and over
//! `trellis engine serve`, which serves these routes too).
//!
//! Generation: `POST /generate` with `input_ids` and `return_logprob: true`, one HTTP request per
//! prompt, all in flight together. A weight push: the weights in a new folder per version, then
//! `/pause_generation` → `/update_weights_from_disk {model_path, weight_version, flush_cache}` →
//! `/continue_generation`.
//!
//! Owns: the JSON shapes of SGLang's API. Never: checks that a push took (the pool probes).

use super::common::{ExternalConfig, Load, fan_out, prometheus_sum, sampling_json};
use super::folders::WeightFolders;
use super::http::{HttpClient, as_u64};
use crate::{Completion, EngineError, FinishReason, GenerateRequest, VersionSpan};
use learner::ModelConfig;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A connected SGLang server.
#[derive(Debug)]
pub struct SglangEngine {
    http: HttpClient,
    version: Arc<AtomicU64>,
    folders: Option<(WeightFolders, ModelConfig)>,
}

impl SglangEngine {
    /// Connects: the server must answer `/health` and, when `cfg.model` is named, serve it
    /// (`/model_info`'s `model_path` or `served_model_name`).
    pub async fn connect(cfg: ExternalConfig) -> Result<Self, EngineError> {
        let http = cfg.client()?;
        http.get_text("/health").await?;
        let info = http.get_json("/model_info").await?;
        if let Some(want) = &cfg.model {
            let names: Vec<&str> = ["served_model_name", "model_path"]
                .iter()
                .filter_map(|k| info[*k].as_str())
                .collect();
            if !names.iter().any(|n| n == want) {
                return Err(EngineError::Protocol(format!(
                    "{}: serves {}, not the model `{want}` the recipe names (pools.rollout.model)",
                    http.base(),
                    names
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(" / ")
                )));
            }
        }
        let version = info["weight_version"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok(Self {
            http,
            version: Arc::new(AtomicU64::new(version)),
            folders: None,
        })
    }

    /// Lets [`InferenceEngine::update_weights`] write folders of `config` under `root`.
    pub fn with_weight_folders(mut self, root: &Path, config: ModelConfig) -> Self {
        self.folders = Some((WeightFolders::new(root), config));
        self
    }

    /// Its base URL.
    pub fn url(&self) -> &str {
        self.http.base()
    }

    /// Generates every request concurrently; completions ordered by request, then sample.
    pub async fn generate_all(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Completion>, EngineError> {
        fan_out(self.url(), reqs, |i, r| {
            let http = self.http.clone();
            let version = self.version.load(Ordering::Acquire);
            async move { generate(&http, version, i, r).await }
        })
        .await
    }

    /// Pause, load `dir` as `version` (flushing the cache), continue.
    pub async fn reload(&self, dir: &Path, version: u64) -> Result<(), EngineError> {
        let h = &self.http;
        let path = dir
            .to_str()
            .ok_or_else(|| EngineError::BadWeights(format!("{} is not UTF-8", dir.display())))?;
        h.post_json("/pause_generation", &json!({"mode": "in_place"}))
            .await?;
        let updated = h
            .post_json(
                "/update_weights_from_disk",
                &json!({"model_path": path, "weight_version": version.to_string(), "flush_cache": true}),
            )
            .await;
        let resumed = h.post_json("/continue_generation", &json!({})).await;
        let answer = updated?;
        resumed?;
        if answer["success"].as_bool() != Some(true) {
            return Err(EngineError::BadWeights(format!(
                "{}/update_weights_from_disk: {}",
                h.base(),
                answer["message"]
                    .as_str()
                    .unwrap_or("no success in the answer")
            )));
        }
        self.version.store(version, Ordering::Release);
        Ok(())
    }

    /// `Ok` when `/health` answers 200.
    pub async fn health(&self) -> Result<(), EngineError> {
        self.http.get_text("/health").await.map(drop)
    }

    /// Queue and KV use from `/metrics` (SGLang exports them with `--enable-metrics`).
    pub async fn load(&self) -> Result<Load, EngineError> {
        let text = self.http.get_text("/metrics").await?;
        let get = |n: &str| prometheus_sum(&text, n).unwrap_or(0.0);
        Ok(Load {
            queue: get("sglang:num_running_reqs") + get("sglang:num_queue_reqs"),
            kv_usage: get("sglang:token_usage"),
        })
    }
}

async fn generate(
    http: &HttpClient,
    version: u64,
    request: usize,
    r: GenerateRequest,
) -> Result<Vec<Completion>, EngineError> {
    let mut sp = sampling_json(&r.params, "max_new_tokens");
    if let Some(o) = sp.as_object_mut() {
        o.remove("logprobs");
        if let Some(seed) = o.remove("seed") {
            o.insert("sampling_seed".into(), seed);
        }
    }
    let body = json!({"input_ids": r.prompt, "sampling_params": sp, "return_logprob": true});
    let v = http.post_json("/generate", &body).await?;
    let bad = |what: &str| {
        EngineError::Protocol(format!(
            "{}/generate: malformed response ({what}): {}",
            http.base(),
            v.to_string().chars().take(300).collect::<String>()
        ))
    };
    // One object for n = 1, a list of n otherwise.
    let outs: Vec<&Value> = match &v {
        Value::Array(a) => a.iter().collect(),
        o => vec![o],
    };
    if outs.len() != r.params.n {
        return Err(bad(&format!(
            "{} outputs for n = {}",
            outs.len(),
            r.params.n
        )));
    }
    let mut done = Vec::with_capacity(outs.len());
    for (index, o) in outs.into_iter().enumerate() {
        let token_ids: Vec<u32> = o["output_ids"]
            .as_array()
            .ok_or_else(|| bad("no `output_ids`"))?
            .iter()
            .map(|t| t.as_u64().map(|t| t as u32))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("a token id is not a number"))?;
        let meta = &o["meta_info"];
        let logprobs: Vec<f32> = meta["output_token_logprobs"]
            .as_array()
            .ok_or_else(|| bad("no `meta_info.output_token_logprobs`"))?
            .iter()
            .map(|e| e[0].as_f64().map(|x| x as f32))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("a logprob is not `[logprob, token_id, text]`"))?;
        if logprobs.len() != token_ids.len() {
            return Err(bad(&format!(
                "{} log-probs for {} tokens",
                logprobs.len(),
                token_ids.len()
            )));
        }
        let reason = &meta["finish_reason"];
        let kind = reason["type"].as_str().or_else(|| reason.as_str());
        let finish_reason = match kind {
            Some("stop") => FinishReason::Stop,
            Some("length") => FinishReason::Length,
            Some("abort") => {
                return Err(EngineError::Unavailable(format!(
                    "{}/generate: the request was aborted",
                    http.base()
                )));
            }
            _ => return Err(bad("`finish_reason` is not stop or length")),
        };
        let served = as_u64(&meta["weight_version"]).unwrap_or(version);
        let weight_versions = if token_ids.is_empty() {
            Vec::new()
        } else {
            vec![VersionSpan {
                version: served,
                start: 0,
                end: token_ids.len(),
            }]
        };
        done.push(Completion {
            request,
            index,
            token_ids,
            logprobs,
            entropies: Vec::new(),
            finish_reason,
            weight_versions,
            observations: Vec::new(),
            prompt: None,
            cached_tokens: 0,
            episode: None,
        });
    }
    Ok(done)
}

super::adapter!(SglangEngine);
