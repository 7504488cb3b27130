//! The token-in, token-out routes trainers use: vLLM's `POST /inference/v1/generate` (with
//! weight-version spans) and SGLang's `POST /generate`.
//!
//! Owns: their typed request bodies and answers. Never: text streaming (the OpenAI routes).

use crate::{Answer, HttpError, Shared, bad, ok, parse};
use axum::body::Bytes;
use axum::extract::State as With;
use axum::http::StatusCode;
use rollout::{Completion, FinishReason, GenerateRequest, SamplingParams};
use serde::Deserialize;
use serde_json::{Value, json};

/// `sampling_params` of both routes (SGLang's names as aliases).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Sampling {
    n: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    #[serde(alias = "max_new_tokens")]
    max_tokens: Option<usize>,
    #[serde(alias = "sampling_seed")]
    seed: Option<u64>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    /// Log-probs of the sampled tokens always come back; accepted for vLLM's clients.
    #[allow(dead_code)]
    logprobs: Option<u32>,
}

impl Sampling {
    fn params(&self) -> Result<SamplingParams, HttpError> {
        let d = SamplingParams::default();
        let p = SamplingParams {
            n: self.n.unwrap_or(1),
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.map_or(0, |k| usize::try_from(k).unwrap_or(0)),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            max_tokens: self.max_tokens.unwrap_or(d.max_tokens),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            seed: self.seed,
        };
        p.validate().map_err(bad)?;
        Ok(p)
    }
}

/// `POST /inference/v1/generate`'s body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VllmBody {
    token_ids: Vec<u32>,
    #[serde(default)]
    sampling_params: Sampling,
    /// Tokens are what this route returns.
    #[allow(dead_code)]
    output_mode: Option<String>,
    #[allow(dead_code)]
    model: Option<String>,
    #[allow(dead_code)]
    request_id: Option<String>,
}

fn finish(c: &Completion) -> &'static str {
    match c.finish_reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// `POST /inference/v1/generate`: tokens in, tokens out with their log-probs and the weight
/// versions that produced them.
pub(crate) async fn vllm_generate(With(state): With<Shared>, bytes: Bytes) -> Answer {
    if state.completions_only {
        return Err(HttpError(
            StatusCode::FORBIDDEN,
            "Scale-out endpoints are disabled (started with --completions-only).".into(),
        ));
    }
    let b: VllmBody = parse(&bytes)?;
    let params = b.sampling_params.params()?;
    let out = state
        .run(vec![GenerateRequest {
            prompt: b.token_ids,
            params,
            episode: None,
        }])
        .await?;
    let choices: Vec<Value> = out
        .iter()
        .map(|c| {
            json!({"index": c.index, "token_ids": c.token_ids, "finish_reason": finish(c),
                "logprobs": {"content": c.token_ids.iter().zip(&c.logprobs)
                    .map(|(t, l)| json!({"token_id": t, "logprob": l})).collect::<Vec<_>>()},
                "weight_versions": c.weight_versions})
        })
        .collect();
    ok(json!({ "choices": choices }))
}

/// SGLang's `POST /generate` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SglangBody {
    input_ids: Option<Vec<u32>>,
    text: Option<String>,
    #[serde(default)]
    sampling_params: Sampling,
    #[serde(default)]
    return_logprob: bool,
    #[allow(dead_code)]
    rid: Option<String>,
}

/// SGLang's `POST /generate`: token ids (or text) in; text, ids and metadata out — one object,
/// or a list when `n` > 1.
pub(crate) async fn sglang_generate(With(state): With<Shared>, bytes: Bytes) -> Answer {
    let b: SglangBody = parse(&bytes)?;
    let prompt = match (b.input_ids, &b.text) {
        (Some(ids), _) => ids,
        (None, Some(s)) => state
            .tokenizer
            .as_ref()
            .ok_or_else(|| bad("this model has no tokenizer.json: send input_ids"))?
            .encode(s)
            .map_err(|e| bad(e.to_string()))?,
        (None, None) => return Err(bad("give `input_ids` or `text`")),
    };
    let params = b.sampling_params.params()?;
    let plen = prompt.len();
    let out = state
        .run(vec![GenerateRequest {
            prompt,
            params,
            episode: None,
        }])
        .await?;
    let many = out.len() > 1;
    let items: Vec<Value> = out
        .iter()
        .map(|c| {
            let version = c
                .weight_versions
                .last()
                .map_or(rollout::InferenceEngine::weight_version(&state.engine), |s| {
                    s.version
                });
            let mut meta = json!({"prompt_tokens": plen, "completion_tokens": c.token_ids.len(),
                "finish_reason": {"type": finish(c)}, "weight_version": version.to_string()});
            if b.return_logprob {
                meta["output_token_logprobs"] = c
                    .token_ids
                    .iter()
                    .zip(&c.logprobs)
                    .map(|(t, l)| json!([l, t, null]))
                    .collect();
            }
            json!({"text": state.decode(&c.token_ids), "output_ids": c.token_ids, "meta_info": meta})
        })
        .collect();
    if many {
        ok(Value::Array(items))
    } else {
        ok(items.into_iter().next().unwrap_or(Value::Null))
    }
}
