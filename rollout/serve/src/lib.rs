//! The engine server (`trellis engine serve`): the native engine behind the OpenAI API as vLLM
//! serves it (and SGLang's routes), so OpenAI clients — the `openai` Python package included —
//! can use it and Trellis's own `vllm` and `sglang` adapters are tested against a real server
//! process.
//!
//! Routes. OpenAI: `POST /v1/completions` (text or token-id prompts) and `POST
//! /v1/chat/completions` (messages rendered with the checkpoint's chat template), both with
//! `stop` strings and `stream: true` (server-sent events), `GET /v1/models`. vLLM: `GET
//! /health`, `GET /version`, `GET /metrics` (Prometheus, vLLM's gauge names), `POST
//! /inference/v1/generate` (tokens in, tokens out, with weight-version spans), and the dev-mode
//! control routes `POST /pause?mode=wait|keep|abort`, `/resume`, `GET /is_paused`, `POST
//! /reset_prefix_cache`, `/collective_rpc` (method `reload_weights`), `/update_weight_version`.
//! SGLang: `POST /generate`, `/update_weights_from_disk`, `/pause_generation`,
//! `/continue_generation`, `/flush_cache`, `GET /model_info` (`/get_model_info`).
//!
//! Request bodies are typed: an unknown field, or a setting this engine does not have (a
//! penalty, top log-probs), is a 400 that names it. With an API key, every route but
//! `/health`, `/version` and `/metrics` wants `Authorization: Bearer KEY` (401 otherwise), as
//! vLLM's `--api-key`.
//!
//! Weights: a reload reads a checkpoint folder of the served model's shape. While paused, the new
//! weights wait and are swapped in at `update_weight_version` (with that version) or at resume;
//! otherwise they are swapped in at once as the next version. A version label is the client's to
//! choose (any, as vLLM's `update_weight_version`). A pause waits
//! for the generations in flight (every mode: this engine has no preemption, so `abort` and
//! `keep` wait too), and holds new ones until resume.
//!
//! Owns: HTTP, JSON shapes, text streaming, pause and version bookkeeping. Never: samples (the
//! native engine does) or trains.

mod control;
mod generate;
mod openai;
mod text;
mod tls;
mod tokens;

pub use tls::TlsFiles;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State as With};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use learner::chat::{ChatError, ChatTemplate};
use learner::checkpoint::Checkpoint;
use learner::params::Params;
use learner::tokenizer::Tokenizer;
use learner::{Model, ModelConfig};
use rollout::native::{NativeConfig, NativeEngine};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use tokio::sync::{Mutex, RwLock, watch};

/// Largest request body accepted.
const MAX_BODY: usize = 16 << 20;

/// What `trellis engine serve` serves.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A checkpoint folder (its tokenizer.json, when present, serves text prompts; its
    /// tokenizer_config.json's chat template, chat completions).
    Checkpoint(PathBuf),
    /// A model in memory (e.g. the one a workflow starts from, the shape a run of that workflow
    /// pushes its weights into).
    Loaded(Box<Loaded>),
}

/// A model in memory, its tokenizer, and what to call it.
#[derive(Clone)]
pub struct Loaded {
    /// The model.
    pub model: Model,
    /// Its tokenizer (serves text prompts).
    pub tokenizer: Option<Tokenizer>,
    /// Its chat template (serves chat completions).
    pub chat: Option<Arc<ChatTemplate>>,
    /// Its name (the default model id).
    pub name: String,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("name", &self.name).finish()
    }
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
    /// Wanted as `Authorization: Bearer KEY` on every route but health, version and metrics.
    pub api_key: Option<String>,
    /// A Jinja chat template file, instead of the checkpoint's (vLLM's `--chat-template`).
    pub chat_template: Option<PathBuf>,
    /// Serve HTTPS with this certificate and key.
    pub tls: Option<TlsFiles>,
}

impl EngineServeOptions {
    /// Serving `model` on a free loopback port with the defaults.
    pub fn new(model: ModelSource) -> Self {
        Self {
            model,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            served_model_name: None,
            kv_cache_bytes: 512 << 20,
            completions_only: false,
            raw_logprobs: false,
            api_key: None,
            chat_template: None,
            tls: None,
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineServeError {
    /// The checkpoint does not load.
    #[error(transparent)]
    Model(#[from] learner::Error),
    /// The chat template does not load.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// The address cannot be bound.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    /// A TLS file does not load.
    #[error("{}: {message}", file.display())]
    Tls {
        /// The certificate or key file.
        file: PathBuf,
        /// What is wrong with it.
        message: String,
    },
}

/// The server's state, shared by every request.
struct State {
    engine: NativeEngine,
    completions_only: bool,
    name: String,
    path: String,
    config: ModelConfig,
    tokenizer: Option<Tokenizer>,
    chat: Option<Arc<ChatTemplate>>,
    api_key: Option<String>,
    /// The weights served now (to swap in again under a new version label).
    current: Mutex<Arc<Params>>,
    /// Weights reloaded while paused, swapped in at the version update or the resume.
    pending: Mutex<Option<Params>>,
    paused: watch::Sender<bool>,
    /// Generations hold it shared; a pause takes it exclusively to wait for them.
    inflight: Arc<RwLock<()>>,
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
}

type Shared = Arc<State>;

/// An HTTP error answer: status and message, in vLLM's error shape.
#[derive(Debug)]
struct HttpError(StatusCode, String);

fn bad(msg: impl Into<String>) -> HttpError {
    HttpError(StatusCode::BAD_REQUEST, msg.into())
}

impl HttpError {
    /// The error body (also sent as an event when a stream fails midway).
    fn body(&self) -> Value {
        let HttpError(status, message) = self;
        let kind = match *status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            s if s.is_server_error() => "InternalServerError",
            _ => "BadRequestError",
        };
        json!({"error": {"message": message, "type": kind, "code": status.as_u16()},
            "object": "error", "message": message})
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        let mut r = (self.0, body).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}

type Answer = Result<Response, HttpError>;

fn ok(v: Value) -> Answer {
    let mut r = v.to_string().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(r)
}

/// A JSON body (an empty one is `{}`), as `T`; the error names the field.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, HttpError> {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            bad(format!("the body is not JSON: {inner}"))
        } else if path == "." {
            bad(inner.to_string())
        } else {
            bad(format!("`{path}`: {inner}"))
        }
    })
}

/// Loads the model and serves until `shutdown` resolves; `ready` gets the bound address.
pub async fn serve(
    opts: EngineServeOptions,
    ready: impl FnOnce(SocketAddr, &str),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), EngineServeError> {
    let tls = opts.tls.as_ref().map(tls::acceptor).transpose()?;
    let (model, tokenizer, chat, path) = match &opts.model {
        ModelSource::Checkpoint(dir) => {
            let ckpt = Checkpoint::load(dir)?;
            let tokenizer = ckpt.tokenizer().transpose()?;
            let chat = ChatTemplate::find(dir, opts.chat_template.as_deref())?.map(Arc::new);
            (ckpt.model, tokenizer, chat, dir.display().to_string())
        }
        ModelSource::Loaded(m) => {
            let chat = match &opts.chat_template {
                Some(file) => Some(Arc::new(ChatTemplate::from_file(file)?)),
                None => m.chat.clone(),
            };
            (m.model.clone(), m.tokenizer.clone(), chat, m.name.clone())
        }
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
        chat,
        api_key: opts.api_key.filter(|k| !k.is_empty()),
        current: Mutex::new(current),
        pending: Mutex::new(None),
        paused: watch::channel(false).0,
        inflight: Arc::new(RwLock::new(())),
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
    let served = match tls {
        Some(acceptor) => {
            axum::serve(tls::TlsListener::new(listener, acceptor), router(state))
                .with_graceful_shutdown(shutdown)
                .await
        }
        None => {
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(listener, router(state))
                .with_graceful_shutdown(shutdown)
                .await
        }
    };
    served.map_err(|e| EngineServeError::Listen(addr, e))
}

fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(|| async { "" }))
        .route(
            "/version",
            get(|| async { ok(json!({"version": env!("CARGO_PKG_VERSION")})) }),
        )
        .route("/metrics", get(control::metrics))
        .route("/v1/models", get(control::models))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/inference/v1/generate", post(tokens::vllm_generate))
        .route("/generate", post(tokens::sglang_generate))
        .route("/is_paused", get(control::is_paused))
        .route("/model_info", get(control::model_info))
        .route("/get_model_info", get(control::model_info))
        .route("/pause", post(control::pause))
        .route("/pause_generation", post(control::pause))
        .route("/resume", post(control::resume))
        .route("/continue_generation", post(control::resume))
        .route(
            "/reset_prefix_cache",
            post(|| async { ok(json!({"success": true})) }),
        )
        .route(
            "/flush_cache",
            post(|| async { ok(json!({"success": true})) }),
        )
        .route("/collective_rpc", post(control::collective_rpc))
        .route("/update_weight_version", post(control::update_version))
        .route("/update_weights_from_disk", post(control::update_from_disk))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            auth,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

async fn not_found(req: Request) -> HttpError {
    HttpError(
        StatusCode::NOT_FOUND,
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}

async fn not_allowed(req: Request) -> HttpError {
    HttpError(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not a method of {}", req.method(), req.uri().path()),
    )
}

/// Refuses calls without the API key (when there is one), but to the probes' routes.
async fn auth(With(state): With<Shared>, req: Request, next: Next) -> Response {
    let open = matches!(req.uri().path(), "/health" | "/version" | "/metrics");
    if let (Some(key), false) = (&state.api_key, open) {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same_key(g.trim(), key)) {
            return HttpError(
                StatusCode::UNAUTHORIZED,
                "a valid API key is needed: Authorization: Bearer KEY".into(),
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// Compares keys in time that does not depend on where they differ.
fn same_key(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_whole() {
        assert!(same_key("abc", "abc"));
        assert!(!same_key("abc", "abd"));
        assert!(!same_key("abc", "abcd"));
        assert!(!same_key("", "a"));
    }

    #[test]
    fn bodies_are_parsed_with_the_field_named() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct B {
            n: Option<u32>,
            inner: Option<Inner>,
        }
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Inner {
            max_tokens: u32,
        }
        let e = |s: &str| parse::<B>(s.as_bytes()).unwrap_err().1;
        assert!(parse::<B>(b"  ").is_ok());
        assert!(e("{").starts_with("the body is not JSON"));
        assert!(
            e(r#"{"n": "x"}"#).starts_with("`n`: invalid type"),
            "{}",
            e(r#"{"n": "x"}"#)
        );
        let m = e(r#"{"inner": {"max_token": 1}}"#);
        assert!(
            m.starts_with("`inner.max_token`: unknown field `max_token`, expected `max_tokens`"),
            "{m}"
        );
        let m = e(r#"{"nn": 1}"#);
        assert!(
            m.contains("unknown field `nn`, expected `n` or `inner`"),
            "{m}"
        );
    }
}
