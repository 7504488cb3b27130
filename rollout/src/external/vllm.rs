//! The vLLM adapter: an [`InferenceEngine`] over a vLLM server's HTTP API (and over
//! `trellis engine serve`, which speaks the same routes).
//!
//! Generation is token in, token out: `POST /inference/v1/generate` (vLLM with `--tokens-only`
//! or `--enable-scale-out`), or, when the server answers that route with 404,
//! `POST /v1/completions` with the prompt as token ids. One HTTP request per prompt, all in
//! flight together, so the server batches them and the `n` samples of a prompt share its prefill.
//!
//! A weight push (the route that works on every device): the weights in a new folder per version
//! ([`crate::external::WeightFolders`]), then `/pause?mode=wait` → `/collective_rpc
//! reload_weights` → `/reset_prefix_cache` → `/update_weight_version` → `/resume`; a server
//! without these dev-mode routes (`VLLM_SERVER_DEV_MODE=1`) gets an error that says so.
//!
//! Owns: the JSON shapes of vLLM's API. Never: checks that a push took (the pool probes the
//! engine's log-probs against the learner's after every push).

use super::common::{ExternalConfig, Load, fan_out, prometheus_sum, sampling_json};
use super::folders::WeightFolders;
use super::http::{HttpClient, as_u64};
use crate::{Completion, EngineError, FinishReason, GenerateRequest, VersionSpan};
use learner::ModelConfig;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A connected vLLM server.
#[derive(Debug)]
pub struct VllmEngine {
    http: HttpClient,
    /// The model id it serves (`/v1/models`), sent with completions requests.
    model: String,
    /// False once the server answered `/inference/v1/generate` with 403 or 404.
    tokens_route: Arc<AtomicBool>,
    version: Arc<AtomicU64>,
    /// Where [`InferenceEngine::update_weights`] writes folders, and the model they describe.
    folders: Option<(WeightFolders, ModelConfig)>,
}

impl VllmEngine {
    /// Connects: the server must answer `/health` and serve `cfg.model` when one is named.
    pub async fn connect(cfg: ExternalConfig) -> Result<Self, EngineError> {
        let http = cfg.client()?;
        http.get_text("/health").await?;
        let models = http.get_json("/v1/models").await?;
        let ids: Vec<String> = models["data"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let model = match &cfg.model {
            Some(want) if ids.iter().any(|id| id == want) => want.clone(),
            Some(want) => {
                return Err(EngineError::Protocol(format!(
                    "{}: serves {}, not the model `{want}` the recipe names (pools.rollout.model)",
                    http.base(),
                    list(&ids)
                )));
            }
            None => ids.first().cloned().ok_or_else(|| {
                EngineError::Protocol(format!(
                    "{}/v1/models: no model listed in {}",
                    http.base(),
                    models
                ))
            })?,
        };
        Ok(Self {
            http,
            model,
            tokens_route: Arc::new(AtomicBool::new(true)),
            version: Arc::new(AtomicU64::new(0)),
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

    /// The model id it serves.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Generates every request concurrently; completions ordered by request, then sample.
    pub async fn generate_all(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Completion>, EngineError> {
        fan_out(self.url(), reqs, |i, r| {
            let call = Call {
                http: self.http.clone(),
                model: self.model.clone(),
                tokens_route: Arc::clone(&self.tokens_route),
                version: self.version.load(Ordering::Acquire),
            };
            async move { call.generate(i, r).await }
        })
        .await
    }

    /// Pause, reload from `dir`, reset the prefix cache, set the version, resume.
    pub async fn reload(&self, dir: &Path, version: u64) -> Result<(), EngineError> {
        let h = &self.http;
        match h.post_raw("/pause?mode=wait", &json!({})).await? {
            (404, _) => {
                return Err(EngineError::Protocol(format!(
                    "{}/pause: not found: the server lacks the dev-mode routes that weight pushes need; start vLLM with VLLM_SERVER_DEV_MODE=1",
                    h.base()
                )));
            }
            (c, body) if !(200..300).contains(&c) => {
                return Err(EngineError::Protocol(format!(
                    "{}/pause: HTTP {c}: {}",
                    h.base(),
                    String::from_utf8_lossy(&body)
                )));
            }
            _ => {}
        }
        let steps = async {
            let path = dir.to_str().ok_or_else(|| {
                EngineError::BadWeights(format!("{} is not UTF-8", dir.display()))
            })?;
            h.post_json(
                "/collective_rpc",
                &json!({"method": "reload_weights", "kwargs": {"weights_path": path}}),
            )
            .await?;
            h.post_json("/reset_prefix_cache", &json!({})).await?;
            h.post_json(
                "/update_weight_version",
                &json!({"new_version": version.to_string()}),
            )
            .await?;
            Ok::<_, EngineError>(())
        }
        .await;
        // Resumed whatever happened: a paused server would hang every later call.
        let resumed = h.post_json("/resume", &json!({})).await;
        steps?;
        resumed?;
        self.version.store(version, Ordering::Release);
        Ok(())
    }

    /// `Ok` when `/health` answers 200.
    pub async fn health(&self) -> Result<(), EngineError> {
        self.http.get_text("/health").await.map(drop)
    }

    /// Queue and KV use from `/metrics`.
    pub async fn load(&self) -> Result<Load, EngineError> {
        let text = self.http.get_text("/metrics").await?;
        let get = |n: &str| prometheus_sum(&text, n).unwrap_or(0.0);
        Ok(Load {
            queue: get("vllm:num_requests_running") + get("vllm:num_requests_waiting"),
            kv_usage: prometheus_sum(&text, "vllm:kv_cache_usage_perc")
                .or_else(|| prometheus_sum(&text, "vllm:gpu_cache_usage_perc"))
                .unwrap_or(0.0),
        })
    }
}

/// What one generation request needs (owned, to run on its own task).
struct Call {
    http: HttpClient,
    model: String,
    tokens_route: Arc<AtomicBool>,
    version: u64,
}

impl Call {
    async fn generate(
        &self,
        request: usize,
        r: GenerateRequest,
    ) -> Result<Vec<Completion>, EngineError> {
        if self.tokens_route.load(Ordering::Relaxed) {
            let body = json!({
                "token_ids": r.prompt,
                "sampling_params": sampling_json(&r.params, "max_tokens"),
                "output_mode": "tokens",
            });
            match self.http.post_raw("/inference/v1/generate", &body).await? {
                // 404: an older vLLM; 403: vLLM 0.32 without --enable-scale-out/--tokens-only.
                (403 | 404, _) => {
                    tracing::info!(
                        url = self.http.base(),
                        "no /inference/v1/generate; using /v1/completions with token ids"
                    );
                    self.tokens_route.store(false, Ordering::Relaxed);
                }
                (code, bytes) => {
                    let v = self.body("/inference/v1/generate", code, &bytes)?;
                    return self.parse(request, &r, &v, "/inference/v1/generate");
                }
            }
        }
        let mut body = sampling_json(&r.params, "max_tokens");
        body["model"] = json!(self.model);
        body["prompt"] = json!(r.prompt);
        body["logprobs"] = json!(0);
        body["return_token_ids"] = json!(true);
        body["return_tokens_as_token_ids"] = json!(true);
        let (code, bytes) = self.http.post_raw("/v1/completions", &body).await?;
        let v = self.body("/v1/completions", code, &bytes)?;
        self.parse(request, &r, &v, "/v1/completions")
    }

    fn body(&self, route: &str, code: u16, bytes: &[u8]) -> Result<Value, EngineError> {
        let text = String::from_utf8_lossy(bytes);
        let msg = format!("{}{route}: HTTP {code}: {}", self.http.base(), text.trim());
        match code {
            200..=299 => serde_json::from_slice(bytes).map_err(|e| {
                EngineError::Protocol(format!(
                    "{}{route}: malformed response ({e}): {}",
                    self.http.base(),
                    text.chars().take(300).collect::<String>()
                ))
            }),
            500.. => Err(EngineError::Unavailable(msg)),
            _ => Err(EngineError::Protocol(msg)),
        }
    }

    /// Reads the `choices` of either route into completions.
    fn parse(
        &self,
        request: usize,
        r: &GenerateRequest,
        v: &Value,
        route: &str,
    ) -> Result<Vec<Completion>, EngineError> {
        let bad = |what: &str| {
            EngineError::Protocol(format!(
                "{}{route}: malformed response ({what}): {}",
                self.http.base(),
                v.to_string().chars().take(300).collect::<String>()
            ))
        };
        let choices = v["choices"].as_array().ok_or_else(|| bad("no `choices`"))?;
        if choices.len() != r.params.n {
            return Err(bad(&format!(
                "{} choices for n = {}",
                choices.len(),
                r.params.n
            )));
        }
        let mut out = Vec::with_capacity(choices.len());
        for (k, c) in choices.iter().enumerate() {
            let index = c["index"].as_u64().map_or(k, |i| i as usize);
            let lp = &c["logprobs"];
            let token_ids: Vec<u32> = match c["token_ids"].as_array() {
                Some(a) => a
                    .iter()
                    .map(|t| t.as_u64().map(|t| t as u32))
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("a token id is not a number"))?,
                None => lp["tokens"]
                    .as_array()
                    .ok_or_else(|| bad("no `token_ids`"))?
                    .iter()
                    .map(|t| t.as_str()?.strip_prefix("token_id:")?.parse::<u32>().ok())
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("tokens are not `token_id:N`"))?,
            };
            let logprobs: Vec<f32> = if let Some(content) = lp["content"].as_array() {
                content
                    .iter()
                    .map(|e| e["logprob"].as_f64().map(|x| x as f32))
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("a logprob is not a number"))?
            } else if let Some(list) = lp["token_logprobs"].as_array() {
                list.iter()
                    .map(|x| x.as_f64().map(|x| x as f32))
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("a logprob is not a number"))?
            } else {
                return Err(bad("no log-probs (`logprobs` was asked for)"));
            };
            if logprobs.len() != token_ids.len() {
                return Err(bad(&format!(
                    "{} log-probs for {} tokens",
                    logprobs.len(),
                    token_ids.len()
                )));
            }
            let finish_reason = match c["finish_reason"].as_str() {
                Some("stop") => FinishReason::Stop,
                Some("length") => FinishReason::Length,
                Some("abort") => {
                    return Err(EngineError::Unavailable(format!(
                        "{}{route}: the request was aborted (the server paused or is shutting down)",
                        self.http.base()
                    )));
                }
                _ => return Err(bad("`finish_reason` is not stop or length")),
            };
            let weight_versions = match c["weight_versions"].as_array() {
                Some(spans) => spans
                    .iter()
                    .map(|s| {
                        Some(VersionSpan {
                            // vLLM labels weights it loaded itself "default": the version this
                            // adapter last pushed (0 before any push).
                            version: as_u64(&s["version"]).unwrap_or(self.version),
                            start: s["start"].as_u64()? as usize,
                            end: s["end"].as_u64()? as usize,
                        })
                    })
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("a weight version span is malformed"))?,
                None if token_ids.is_empty() => Vec::new(),
                None => vec![VersionSpan {
                    version: self.version,
                    start: 0,
                    end: token_ids.len(),
                }],
            };
            out.push(Completion {
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
        Ok(out)
    }
}

fn list(ids: &[String]) -> String {
    if ids.is_empty() {
        "no model".into()
    } else {
        ids.iter()
            .map(|i| format!("`{i}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

super::adapter!(VllmEngine);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingParams;

    /// An answer of a real vLLM 0.32 (`/inference/v1/generate`, CPU build, n = 2), trimmed of
    /// fields the adapter ignores; its weights were never pushed, so versions read "default".
    const VLLM_0_32: &str = r#"{"request_id":"generate-tokens-83fe21c104fa6e5f","model":"/tmp/vllm/model",
        "usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2},"output_mode":"tokens",
        "choices":[{"index":0,"finish_reason":"stop","stop_reason":1,"token_ids":[1],
          "weight_versions":[{"version":"default","start":0,"end":1}],
          "logprobs":{"content":[{"token_id":1,"logprob":-0.08182555437088013,"rank":1,
            "top_logprobs":[{"token_id":1,"logprob":-0.08182555437088013,"rank":1}]}]}},
         {"index":1,"finish_reason":"length","token_ids":[4,1],
          "weight_versions":[{"version":"7","start":0,"end":2}],
          "logprobs":{"content":[{"token_id":4,"logprob":-1.5,"rank":2},{"token_id":1,"logprob":-0.25,"rank":1}]}}]}"#;

    #[test]
    fn a_real_vllm_answer_parses_with_default_versions_as_the_last_push() {
        let call = Call {
            http: HttpClient::new("http://127.0.0.1:9", std::time::Duration::from_secs(1)).unwrap(),
            model: "m".into(),
            tokens_route: Arc::new(AtomicBool::new(true)),
            version: 5,
        };
        let req = GenerateRequest {
            prompt: vec![2, 3, 4],
            params: SamplingParams {
                n: 2,
                ..Default::default()
            },
            episode: None,
        };
        let v: Value = serde_json::from_str(VLLM_0_32).unwrap();
        let out = call.parse(3, &req, &v, "/inference/v1/generate").unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].request, out[0].index), (3, 0));
        assert_eq!(out[0].token_ids, [1]);
        assert_eq!(out[0].logprobs, [-0.08182555437088013f64 as f32]);
        assert_eq!(out[0].finish_reason, FinishReason::Stop);
        assert_eq!(out[0].weight_versions[0].version, 5);
        assert_eq!(out[1].token_ids, [4, 1]);
        assert_eq!(out[1].finish_reason, FinishReason::Length);
        assert_eq!(out[1].weight_versions[0].version, 7);
        // n = 3 asked, 2 answered: refused, naming the route.
        let three = GenerateRequest {
            params: SamplingParams {
                n: 3,
                ..Default::default()
            },
            ..req
        };
        let e = call
            .parse(0, &three, &v, "/inference/v1/generate")
            .unwrap_err();
        assert!(e.to_string().contains("2 choices for n = 3"), "{e}");
    }
}
