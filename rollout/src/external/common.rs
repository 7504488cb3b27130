//! What the external-engine adapters share: how to reach an engine, the load a router scores,
//! the Prometheus parsing behind it, vLLM-style sampling parameters, and the fan-out of one call
//! per request.

use super::http::{ApiKey, HttpClient};
use crate::{Completion, EngineError, GenerateRequest, SamplingParams};
use serde_json::{Value, json};
use std::time::Duration;

/// How to reach an external engine.
#[derive(Clone, Debug)]
pub struct ExternalConfig {
    /// Base URL (`http://host:port` or `https://host:port`).
    pub url: String,
    /// The model the recipe expects the server to serve (its served name or path); `None`:
    /// whatever it serves.
    pub model: Option<String>,
    /// Deadline of one HTTP request (a generation call included).
    pub timeout: Duration,
    /// A call waiting longer than this checks the engine's `/health` (answered within as long,
    /// again every as long): a frozen or vanished engine ends the call then; `None`: never.
    pub health_check: Option<Duration>,
    /// Sent as `Authorization: Bearer KEY` (vLLM's and `trellis engine serve`'s `--api-key`,
    /// SGLang's `--api-key`).
    pub api_key: Option<ApiKey>,
}

impl ExternalConfig {
    /// A config for `url` with the default deadline (10 minutes), health checks after 10 s,
    /// any model, no API key.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            model: None,
            timeout: Duration::from_secs(600),
            health_check: Some(Duration::from_secs(10)),
            api_key: None,
        }
    }

    pub(crate) fn client(&self) -> Result<HttpClient, EngineError> {
        Ok(HttpClient::new(&self.url, self.timeout)?
            .with_api_key(self.api_key.as_ref())
            .with_health_check(self.health_check))
    }
}

/// How busy an engine is, as a router scores it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// Requests running plus waiting.
    pub queue: f64,
    /// Share of the KV cache in use, 0..=1.
    pub kv_usage: f64,
}

/// Sums every sample of the Prometheus metric `name` (any labels) in `text`; `None` when absent.
pub fn prometheus_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let rest = match rest.chars().next() {
            Some('{') => rest.split_once('}').map(|(_, r)| r),
            Some(' ') => Some(rest),
            _ => None,
        };
        if let Some(v) = rest.and_then(|r| r.split_whitespace().next()?.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Runs `call(i, request)` for every request at once, one task each (so a server batches
/// them), and gathers the completions ordered by request, then sample.
pub(crate) async fn fan_out<F, Fut>(
    url: &str,
    reqs: Vec<GenerateRequest>,
    call: F,
) -> Result<Vec<Completion>, EngineError>
where
    F: Fn(usize, GenerateRequest) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<Completion>, EngineError>> + Send + 'static,
{
    if let Some(request) = reqs.iter().position(|r| r.episode.is_some()) {
        return Err(EngineError::InvalidRequest {
            request,
            msg: "an episode runs through rollout::episode::generate, not an engine".into(),
        });
    }
    let mut calls = tokio::task::JoinSet::new();
    for (i, r) in reqs.into_iter().enumerate() {
        calls.spawn(call(i, r));
    }
    let mut all = Vec::new();
    while let Some(done) = calls.join_next().await {
        all.extend(
            done.map_err(|e| EngineError::Unavailable(format!("a call to {url} was lost: {e}")))??,
        );
    }
    all.sort_by_key(|c| (c.request, c.index));
    Ok(all)
}

/// vLLM's `sampling_params` for `p` (`max_key`: `max_tokens`, or SGLang's `max_new_tokens`).
pub(crate) fn sampling_json(p: &SamplingParams, max_key: &str) -> Value {
    let mut v = json!({
        "n": p.n,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": if p.top_k == 0 { -1 } else { p.top_k as i64 },
        "min_p": p.min_p,
        "stop_token_ids": p.stop_token_ids,
        "ignore_eos": p.ignore_eos,
        "logprobs": 1,
    });
    v[max_key] = json!(p.max_tokens);
    if let Some(seed) = p.seed {
        v["seed"] = json!(seed);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_samples_are_summed_over_labels() {
        let text = "# HELP vllm:num_requests_running x\n\
            vllm:num_requests_running{model_name=\"a\",engine=\"0\"} 3.0\n\
            vllm:num_requests_running{model_name=\"a\",engine=\"1\"} 2\n\
            vllm:num_requests_running_total 9\n\
            vllm:kv_cache_usage_perc 0.25\n";
        assert_eq!(prometheus_sum(text, "vllm:num_requests_running"), Some(5.0));
        assert_eq!(prometheus_sum(text, "vllm:kv_cache_usage_perc"), Some(0.25));
        assert_eq!(prometheus_sum(text, "vllm:num_requests_waiting"), None);
    }
}
