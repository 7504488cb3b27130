//! The OpenAI routes: `POST /v1/completions` and `POST /v1/chat/completions`, answered whole or
//! as server-sent events (`stream: true`), in the shapes vLLM gives them.
//!
//! Owns: the request bodies (typed; unknown fields and settings this engine lacks are refused
//! by name) and the answers. Never: decides text (`generate` and `text` do).

use crate::generate::{self, Event, Sample, TextJob};
use crate::text::Stops;
use crate::{Answer, HttpError, Shared, State, bad, ok};
use axum::body::{Body, Bytes};
use axum::extract::State as With;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use rollout::SamplingParams;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Settings both routes take.
#[derive(Deserialize, Default)]
struct Common {
    model: Option<String>,
    n: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopStrings>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    include_stop_str_in_output: Option<bool>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// Accepted and ignored, as vLLM does.
    #[allow(dead_code)]
    user: Option<String>,
}

/// The fields of [`Common`], for the unknown-field check.
const COMMON: &[&str] = &[
    "model",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stream",
    "stream_options",
    "user",
];

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
enum StopStrings {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
    #[serde(default)]
    #[allow(dead_code)]
    continuous_usage_stats: bool,
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(flatten)]
    common: Common,
    prompt: Prompt,
    max_tokens: Option<usize>,
    logprobs: Option<u32>,
    echo: Option<bool>,
    return_token_ids: Option<bool>,
    return_tokens_as_token_ids: Option<bool>,
}

const COMPLETION: &[&str] = &[
    "prompt",
    "max_tokens",
    "logprobs",
    "echo",
    "return_token_ids",
    "return_tokens_as_token_ids",
];

#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "text, token ids, or a list of texts or of token-id lists"
)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(flatten)]
    common: Common,
    messages: Vec<ChatMessage>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    add_generation_prompt: Option<bool>,
}

const CHAT: &[&str] = &[
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
];

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "text, or a list of parts like {\"type\": \"text\", \"text\": \"...\"}"
)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

/// The body as `T`, refusing fields outside `known` by name.
fn body<T: serde::de::DeserializeOwned>(bytes: &[u8], known: &[&[&str]]) -> Result<T, HttpError> {
    let v: Value = crate::parse(bytes)?;
    let Value::Object(map) = &v else {
        return Err(bad("the body must be a JSON object"));
    };
    let all = || known.iter().flat_map(|k| k.iter().copied());
    if let Some(k) = map.keys().find(|k| !all().any(|a| a == k.as_str())) {
        let mut names: Vec<&str> = all().collect();
        names.sort_unstable();
        return Err(bad(format!(
            "unknown field `{k}`: this route takes {}",
            names.join(", ")
        )));
    }
    serde_path_to_error::deserialize(v).map_err(|e| bad(format!("`{}`: {}", e.path(), e.inner())))
}

impl Common {
    /// The engine's sampling settings; `max_tokens` as the route decided.
    fn sampling(&self, max_tokens: usize) -> Result<SamplingParams, HttpError> {
        for (name, value, neutral) in [
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ] {
            if value.is_some_and(|v| v != neutral) {
                return Err(bad(format!(
                    "`{name}` is not supported by this engine (only {neutral})"
                )));
            }
        }
        let d = SamplingParams::default();
        let p = SamplingParams {
            n: self.n.unwrap_or(1),
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.map_or(0, |k| usize::try_from(k).unwrap_or(0)),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            max_tokens,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            seed: self.seed,
        };
        p.validate().map_err(bad)?;
        Ok(p)
    }

    fn stops(&self) -> Stops {
        let strings = match &self.stop {
            None => Vec::new(),
            Some(StopStrings::One(s)) => vec![s.clone()],
            Some(StopStrings::Many(v)) => v.clone(),
        };
        Stops::new(strings, self.include_stop_str_in_output.unwrap_or(false))
    }

    /// 404 for a model id this server does not serve.
    fn check_model(&self, state: &State) -> Result<(), HttpError> {
        match &self.model {
            Some(m) if *m != state.name => Err(HttpError(
                StatusCode::NOT_FOUND,
                format!(
                    "The model `{m}` does not exist (this server serves `{}`).",
                    state.name
                ),
            )),
            _ => Ok(()),
        }
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

fn encode(state: &State, text: &str) -> Result<Vec<u32>, HttpError> {
    let t = state
        .tokenizer
        .as_ref()
        .ok_or_else(|| bad("this model has no tokenizer.json: send the prompt as token ids"))?;
    t.encode(text).map_err(|e| bad(e.to_string()))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn id(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{nanos:x}")
}

fn usage(prompts: &[Vec<u32>], samples: &[Sample]) -> Value {
    let prompt: usize = prompts.iter().map(Vec::len).sum();
    let completion: usize = samples.iter().map(|s| s.token_ids.len()).sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion})
}

/// `POST /v1/completions`.
pub(crate) async fn completions(With(state): With<Shared>, bytes: Bytes) -> Answer {
    let b: CompletionBody = body(&bytes, &[COMMON, COMPLETION])?;
    b.common.check_model(&state)?;
    if b.echo == Some(true) {
        return Err(bad("`echo` is not supported by this engine"));
    }
    let prompts = match &b.prompt {
        Prompt::Text(s) => vec![encode(&state, s)?],
        Prompt::Ids(ids) => vec![ids.clone()],
        Prompt::Texts(v) => v
            .iter()
            .map(|s| encode(&state, s))
            .collect::<Result<_, _>>()?,
        Prompt::IdLists(v) => v.clone(),
    };
    let params = b.common.sampling(b.max_tokens.unwrap_or(16))?;
    let n = params.n;
    let job = TextJob {
        prompts: prompts.clone(),
        params,
        stops: b.common.stops(),
    };
    generate::check(&state, &job)?;
    let shape = CompletionShape {
        id: id("cmpl"),
        created: now(),
        model: state.name.clone(),
        n,
        logprobs: b.logprobs.is_some(),
        as_ids: b.return_tokens_as_token_ids.unwrap_or(false),
        with_ids: b.return_token_ids.unwrap_or(false),
        include_usage: b.common.include_usage(),
        prompts,
    };
    if b.common.stream.unwrap_or(false) {
        return Ok(sse(state, job, Vec::new(), move |s, e| shape.chunks(s, e)));
    }
    let samples = generate::text(&state, &job).await?;
    ok(shape.whole(&state, &samples))
}

/// What a completion answer looks like.
struct CompletionShape {
    id: String,
    created: u64,
    model: String,
    n: usize,
    logprobs: bool,
    as_ids: bool,
    with_ids: bool,
    include_usage: bool,
    prompts: Vec<Vec<u32>>,
}

impl CompletionShape {
    fn logprobs(&self, state: &State, ids: &[u32], logprobs: &[f32]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let tokens: Vec<String> = ids
            .iter()
            .map(|&t| {
                if self.as_ids {
                    format!("token_id:{t}")
                } else {
                    state.decode(&[t])
                }
            })
            .collect();
        json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": null,
            "text_offset": []})
    }

    fn envelope(&self, choices: Vec<Value>) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model, "choices": choices})
    }

    fn whole(&self, state: &State, samples: &[Sample]) -> Value {
        let choices = samples
            .iter()
            .map(|s| {
                let mut ch = json!({"index": s.request * self.n + s.index, "text": s.text,
                    "finish_reason": s.finish, "stop_reason": null,
                    "logprobs": self.logprobs(state, &s.token_ids, &s.logprobs)});
                if self.with_ids {
                    ch["token_ids"] = json!(s.token_ids);
                    ch["prompt_token_ids"] = json!(self.prompts[s.request]);
                }
                ch
            })
            .collect();
        let mut v = self.envelope(choices);
        v["usage"] = usage(&self.prompts, samples);
        v
    }

    fn chunks(&self, state: &State, e: Event) -> Vec<Value> {
        match e {
            Event::Text {
                request,
                index,
                text,
                token_ids,
                logprobs,
            } => {
                if text.is_empty() && !self.logprobs {
                    return Vec::new();
                }
                vec![self.envelope(vec![json!({"index": request * self.n + index,
                    "text": text, "finish_reason": null,
                    "logprobs": self.logprobs(state, &token_ids, &logprobs)})])]
            }
            Event::Done(samples) => {
                let mut out: Vec<Value> = samples
                    .iter()
                    .map(|s| {
                        let mut ch = json!({"index": s.request * self.n + s.index, "text": "",
                            "finish_reason": s.finish, "stop_reason": null, "logprobs": null});
                        if self.with_ids {
                            ch["token_ids"] = json!(s.token_ids);
                        }
                        self.envelope(vec![ch])
                    })
                    .collect();
                if self.include_usage {
                    let mut u = self.envelope(Vec::new());
                    u["usage"] = usage(&self.prompts, &samples);
                    out.push(u);
                }
                out
            }
            Event::Failed(e) => vec![e.body()],
        }
    }
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(With(state): With<Shared>, bytes: Bytes) -> Answer {
    let b: ChatBody = body(&bytes, &[COMMON, CHAT])?;
    b.common.check_model(&state)?;
    if b.top_logprobs.is_some_and(|k| k > 0) {
        return Err(bad(
            "`top_logprobs` is not supported by this engine (the sampled token's log-prob is, with `logprobs: true`)",
        ));
    }
    let template = state.chat.as_ref().ok_or_else(|| {
        bad("this model has no chat template (no chat_template in its tokenizer_config.json): start the server with --chat-template FILE, or use /v1/completions")
    })?;
    let tok = state
        .tokenizer
        .as_ref()
        .ok_or_else(|| bad("this model has no tokenizer.json"))?;
    let mut messages = Vec::with_capacity(b.messages.len());
    for (i, m) in b.messages.iter().enumerate() {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(bad(format!(
                                "`messages[{i}].content[{j}]`: only text parts are supported, got `{kind}`"
                            )));
                        }
                    }
                }
                text
            }
        };
        messages.push(learner::chat::Message {
            role: m.role.clone(),
            content,
        });
    }
    let rendered = template
        .render(&messages, b.add_generation_prompt.unwrap_or(true))
        .map_err(|e| bad(e.to_string()))?;
    let prompt = tok
        .encode_rendered(&rendered)
        .map_err(|e| bad(e.to_string()))?;
    // Unset: up to the end of the context, as vLLM does.
    let room = state
        .config
        .max_position_embeddings
        .saturating_sub(prompt.len())
        .max(1);
    let max_tokens = b.max_completion_tokens.or(b.max_tokens).unwrap_or(room);
    let params = b.common.sampling(max_tokens)?;
    let n = params.n;
    let prompts = vec![prompt];
    let job = TextJob {
        prompts: prompts.clone(),
        params,
        stops: b.common.stops(),
    };
    generate::check(&state, &job)?;
    let shape = ChatShape {
        id: id("chatcmpl"),
        created: now(),
        model: state.name.clone(),
        logprobs: b.logprobs.unwrap_or(false),
        include_usage: b.common.include_usage(),
        prompts,
    };
    if b.common.stream.unwrap_or(false) {
        // Each choice opens with the assistant's role, as OpenAI's stream does.
        let first = (0..n)
            .map(|i| {
                shape.envelope(vec![json!({"index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null})])
            })
            .collect();
        return Ok(sse(state, job, first, move |s, e| shape.chunks(s, e)));
    }
    let samples = generate::text(&state, &job).await?;
    ok(shape.whole(&state, &samples))
}

/// What a chat answer looks like.
struct ChatShape {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
    prompts: Vec<Vec<u32>>,
}

impl ChatShape {
    fn logprobs(&self, state: &State, ids: &[u32], logprobs: &[f32]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let content: Vec<Value> = ids
            .iter()
            .zip(logprobs)
            .map(|(&t, l)| {
                let text = state.decode(&[t]);
                json!({"token": text, "logprob": l, "bytes": text.as_bytes(),
                    "top_logprobs": []})
            })
            .collect();
        json!({ "content": content })
    }

    fn envelope(&self, choices: Vec<Value>) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": choices})
    }

    fn whole(&self, state: &State, samples: &[Sample]) -> Value {
        let choices: Vec<Value> = samples
            .iter()
            .map(|s| {
                json!({"index": s.index,
                    "message": {"role": "assistant", "content": s.text},
                    "logprobs": self.logprobs(state, &s.token_ids, &s.logprobs),
                    "finish_reason": s.finish, "stop_reason": null})
            })
            .collect();
        json!({"id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": usage(&self.prompts, samples)})
    }

    fn chunks(&self, state: &State, e: Event) -> Vec<Value> {
        match e {
            Event::Text {
                index,
                text,
                token_ids,
                logprobs,
                ..
            } => {
                if text.is_empty() && !self.logprobs {
                    return Vec::new();
                }
                vec![
                    self.envelope(vec![json!({"index": index, "delta": {"content": text},
                    "logprobs": self.logprobs(state, &token_ids, &logprobs),
                    "finish_reason": null})]),
                ]
            }
            Event::Done(samples) => {
                let mut out: Vec<Value> = samples
                    .iter()
                    .map(|s| {
                        self.envelope(vec![json!({"index": s.index, "delta": {},
                            "logprobs": null, "finish_reason": s.finish, "stop_reason": null})])
                    })
                    .collect();
                if self.include_usage {
                    let mut u = self.envelope(Vec::new());
                    u["usage"] = usage(&self.prompts, &samples);
                    out.push(u);
                }
                out
            }
            Event::Failed(e) => vec![e.body()],
        }
    }
}

/// A server-sent-event answer: `first`, then the chunks `shape` makes of each event of the
/// generation as it goes, then `data: [DONE]`. The generation runs on its own task; a client
/// that goes away stops it.
fn sse(
    state: Shared,
    job: TextJob,
    first: Vec<Value>,
    shape: impl Fn(&State, Event) -> Vec<Value> + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(generate::stream_text(
        std::sync::Arc::clone(&state),
        job,
        tx,
    ));
    let line = |v: &Value| Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {v}\n\n")));
    let head = futures_util::stream::iter(first.iter().map(line).collect::<Vec<_>>());
    let events = UnboundedReceiverStream::new(rx).flat_map(move |e| {
        let chunks: Vec<_> = shape(&state, e).iter().map(line).collect();
        futures_util::stream::iter(chunks)
    });
    let done = futures_util::stream::once(async {
        Ok::<_, std::convert::Infallible>(Bytes::from_static(b"data: [DONE]\n\n"))
    });
    let mut r = Body::from_stream(head.chain(events).chain(done)).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
