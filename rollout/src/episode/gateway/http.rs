//! The gateway's HTTP side: OpenAI's `POST /v1/chat/completions` (whole or streamed) and
//! `GET /v1/models` under `/s/SESSION/`, on a loopback port. A call is read into a [`Call`]
//! and handed to the episode loop, which answers it; this side only shapes JSON.
//!
//! Owns: routes, request reading (typed where the gateway uses a field; any other field —
//! `temperature`, `tool_choice`, `model`… — is accepted and ignored: the run's sampling applies),
//! and answer shapes. Never: tokenizes or samples.

use super::session::Reply;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::net::SocketAddr;
use tokio::sync::{mpsc, oneshot};

/// A call's settings the gateway uses.
#[derive(Debug)]
pub(crate) struct ChatRequest {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub model: String,
    /// Return the sampled tokens' log-probs (`logprobs: true`).
    pub logprobs: bool,
}

/// A call on its way to the episode loop, and where its answer goes.
pub(crate) struct Call {
    pub session: String,
    pub request: ChatRequest,
    pub reply: oneshot::Sender<Result<Reply, HttpError>>,
}

/// An error answer: status and message, in OpenAI's shape.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HttpError(pub StatusCode, pub String);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let HttpError(status, message) = self;
        let kind = if status == StatusCode::NOT_FOUND {
            "NotFoundError"
        } else if status.is_server_error() {
            "InternalServerError"
        } else {
            "BadRequestError"
        };
        let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
        json_response(status, &body)
    }
}

/// `v` as a JSON answer.
fn json_response(status: StatusCode, v: &Value) -> Response {
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn bad(msg: impl Into<String>) -> HttpError {
    HttpError(StatusCode::BAD_REQUEST, msg.into())
}

/// The server: answers until dropped.
pub(crate) struct Server {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    /// Serves on a free loopback port, handing calls to `calls`.
    pub(crate) async fn start(calls: mpsc::UnboundedSender<Call>) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let app = Router::new()
            .route("/s/{session}/v1/chat/completions", post(chat))
            .route("/s/{session}/v1/models", get(models))
            .fallback(|| async {
                HttpError(
                    StatusCode::NOT_FOUND,
                    "the gateway serves POST /s/SESSION/v1/chat/completions and GET /s/SESSION/v1/models".into(),
                )
            })
            .with_state(calls);
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!("the agent gateway stopped: {e}");
            }
        });
        Ok(Self { addr, task })
    }
}

async fn models(Path(_session): Path<String>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "trellis"}]}),
    )
}

/// The model id answers carry when the call names none.
const MODEL: &str = "trellis-policy";

/// The settings of a call's body, checked.
pub(crate) fn read(bytes: &[u8]) -> Result<ChatRequest, HttpError> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(bad("the body must be a JSON object"));
    };
    let messages = match map.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m.clone(),
        Some(Value::Array(_)) => return Err(bad("`messages` is empty")),
        _ => return Err(bad("`messages` must be a list of messages")),
    };
    let tools = match map.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) if t.is_empty() => None,
        Some(t @ Value::Array(_)) => Some(t.clone()),
        Some(_) => return Err(bad("`tools` must be a list")),
    };
    let count = |name: &str| -> Result<Option<usize>, HttpError> {
        match map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad(format!("`{name}` must be a whole number, got {v}"))),
        }
    };
    if count("n")?.is_some_and(|n| n != 1) {
        return Err(bad(
            "`n` must be 1: a session is one episode (the run samples its own groups)",
        ));
    }
    let max_tokens = count("max_completion_tokens")?.or(count("max_tokens")?);
    let flag = |v: Option<&Value>, name: &str| match v {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(format!("`{name}` must be true or false, got {v}"))),
    };
    let stream = flag(map.get("stream"), "stream")?;
    let include_usage = flag(
        map.get("stream_options")
            .and_then(|o| o.get("include_usage")),
        "stream_options.include_usage",
    )?;
    let logprobs = flag(map.get("logprobs"), "logprobs")?;
    if count("top_logprobs")?.is_some_and(|k| k > 0) {
        return Err(bad(
            "`top_logprobs` is not served (the sampled tokens' log-probs are, with `logprobs: true`)",
        ));
    }
    let model = map
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(MODEL)
        .to_string();
    Ok(ChatRequest {
        messages,
        tools,
        max_tokens,
        stream,
        include_usage,
        model,
        logprobs,
    })
}

async fn chat(
    State(calls): State<mpsc::UnboundedSender<Call>>,
    Path(session): Path<String>,
    bytes: Bytes,
) -> Response {
    let request = match read(&bytes) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let (stream, include_usage, model) =
        (request.stream, request.include_usage, request.model.clone());
    let (tx, rx) = oneshot::channel();
    let call = Call {
        session: session.clone(),
        request,
        reply: tx,
    };
    let gone = || {
        HttpError(
            StatusCode::SERVICE_UNAVAILABLE,
            "the episode is over".into(),
        )
        .into_response()
    };
    if calls.send(call).is_err() {
        return gone();
    }
    let reply = match rx.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return e.into_response(),
        Err(_) => return gone(),
    };
    let shape = Shape {
        id: format!("chatcmpl-{session}-{}", unique()),
        created: now(),
        model,
        session,
    };
    if stream {
        shape.stream(&reply, include_usage)
    } else {
        json_response(StatusCode::OK, &shape.whole(&reply))
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What an answer looks like.
struct Shape {
    id: String,
    created: u64,
    model: String,
    session: String,
}

impl Shape {
    /// OpenAI's `tool_calls` of `r` (arguments as a JSON string).
    fn tool_calls(&self, r: &Reply, with_index: bool) -> Option<Value> {
        if r.calls.is_empty() {
            return None;
        }
        Some(Value::Array(
            r.calls
                .iter()
                .enumerate()
                .map(|(k, c)| {
                    let mut v = json!({"id": format!("call_{}_{}", self.session, unique()),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments.to_string()}});
                    if with_index {
                        v["index"] = json!(k);
                    }
                    v
                })
                .collect(),
        ))
    }

    /// OpenAI's `logprobs` of a choice: the sampled tokens', or null when not asked for.
    fn logprobs(r: &Reply) -> Value {
        if r.tokens.is_empty() {
            return Value::Null;
        }
        let content: Vec<Value> = r
            .tokens
            .iter()
            .map(|(t, l)| json!({"token": t, "logprob": l, "bytes": t.as_bytes(), "top_logprobs": []}))
            .collect();
        json!({ "content": content })
    }

    fn usage(r: &Reply) -> Value {
        json!({"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens})
    }

    fn whole(&self, r: &Reply) -> Value {
        let mut message = json!({"role": "assistant", "content": r.content});
        if let Some(calls) = self.tool_calls(r, false) {
            message["tool_calls"] = calls;
        }
        json!({"id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.model, "choices": [{"index": 0, "message": message,
                "logprobs": Self::logprobs(r), "finish_reason": r.finish}],
            "usage": Self::usage(r)})
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": choices})
    }

    /// The answer as server-sent events (the turn is whole when it is answered, so it goes in
    /// one content chunk and one tool-calls chunk).
    fn stream(&self, r: &Reply, include_usage: bool) -> Response {
        let mut events = vec![self.chunk(json!([{"index": 0,
            "delta": {"role": "assistant", "content": ""}, "logprobs": null,
            "finish_reason": null}]))];
        let logprobs = Self::logprobs(r);
        let text = r.content.as_deref().unwrap_or("");
        if !text.is_empty() || !logprobs.is_null() {
            events.push(self.chunk(json!([{"index": 0, "delta": {"content": text},
                "logprobs": logprobs, "finish_reason": null}])));
        }
        if let Some(calls) = self.tool_calls(r, true) {
            events.push(
                self.chunk(json!([{"index": 0, "delta": {"tool_calls": calls},
                "logprobs": null, "finish_reason": null}])),
            );
        }
        events.push(
            self.chunk(json!([{"index": 0, "delta": {}, "logprobs": null,
            "finish_reason": r.finish}])),
        );
        if include_usage {
            let mut u = self.chunk(json!([]));
            u["usage"] = Self::usage(r);
            events.push(u);
        }
        let mut text = String::new();
        for e in &events {
            text.push_str(&format!("data: {e}\n\n"));
        }
        text.push_str("data: [DONE]\n\n");
        let mut resp = Body::from(text).into_response();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_read_or_refused_by_field() {
        let ok = read(br#"{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "tool_choice": "auto", "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}"#).unwrap();
        assert_eq!(
            (
                ok.max_tokens,
                ok.stream,
                ok.include_usage,
                ok.model.as_str()
            ),
            (Some(8), true, true, "gpt-4o")
        );
        for (body, want) in [
            (&br#"[1]"#[..], "the body must be a JSON object"),
            (br#"{"messages": []}"#, "`messages` is empty"),
            (br#"{"messages": "hi"}"#, "`messages` must be a list"),
            (
                br#"{"messages": [{}], "n": 2}"#,
                "`n` must be 1: a session is one episode",
            ),
            (
                br#"{"messages": [{}], "max_tokens": -1}"#,
                "`max_tokens` must be a whole number, got -1",
            ),
            (
                br#"{"messages": [{}], "tools": {}}"#,
                "`tools` must be a list",
            ),
            (
                br#"{"messages": [{}], "stream": "yes"}"#,
                "`stream` must be true or false",
            ),
            (
                br#"{"messages": [{}], "logprobs": true, "top_logprobs": 2}"#,
                "`top_logprobs` is not served",
            ),
        ] {
            let e = read(body).unwrap_err();
            assert_eq!(e.0, StatusCode::BAD_REQUEST);
            assert!(
                e.1.starts_with(want),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.1
            );
        }
    }
}
