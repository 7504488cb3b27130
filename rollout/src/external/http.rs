//! A small JSON-over-HTTP/1.1 client for the external engine adapters (hyper, already in the
//! build through tonic, so no new HTTP stack), over TLS for `https://` endpoints (rustls, as
//! tonic's, trusting the system's certificates or `SSL_CERT_FILE`), with an API key as a
//! bearer token when the engine wants one.
//!
//! Owns: requests with a deadline, and turning every failure into an [`EngineError`] that names
//! the URL: `Unavailable` when the engine does not answer (refused, reset, timeout, 5xx) so a
//! router can take it out of service, `Protocol` when it answers wrongly (4xx, malformed JSON).
//! A call still waiting after the health-check interval checks that the engine is alive (`GET
//! /health`, answered within the same interval, again at every interval while the call waits):
//! a frozen engine or a host gone from the network ends the call within seconds, not at the
//! call's own deadline (which a long generation needs). Never: retries (the router decides).

use crate::EngineError;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// The liveness route every engine serves (vLLM, SGLang, `trellis engine serve`).
const HEALTH: &str = "/health";

/// An engine's API key: sent as `Authorization: Bearer KEY`, never shown (`Debug` prints
/// `ApiKey(…)`).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// A key; `None` when empty.
    pub fn new(key: impl Into<String>) -> Option<Self> {
        let key = key.into();
        (!key.trim().is_empty()).then(|| Self(key.trim().to_string()))
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

/// What a response that is not 2xx looked like.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    /// HTTP status.
    pub code: u16,
    /// The body, cut to 300 characters.
    pub body: String,
}

/// A client for one engine's base URL (`http://host:port` or `https://host:port`).
#[derive(Clone)]
pub struct HttpClient {
    base: String,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
    /// After this long without an answer, and again every as long, a call checks the engine's
    /// `/health` with this deadline; `None`: never.
    health_check: Option<Duration>,
    /// `Bearer KEY`.
    authorization: Option<hyper::header::HeaderValue>,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HttpClient({})", self.base)
    }
}

impl HttpClient {
    /// A client for `base`; every request gives up after `timeout`. Refuses URLs that are not
    /// `http[s]://host[:port][/prefix]`, and `https://` ones when no CA certificate can be
    /// read.
    pub fn new(base: &str, timeout: Duration) -> Result<Self, EngineError> {
        let (rest, tls) = match (base.strip_prefix("http://"), base.strip_prefix("https://")) {
            (Some(rest), _) => (rest, false),
            (None, Some(rest)) => (rest, true),
            (None, None) => {
                return Err(EngineError::Protocol(format!(
                    "endpoint `{base}` is not an http:// or https:// URL"
                )));
            }
        };
        let base = base.trim_end_matches('/');
        if rest.trim_end_matches('/').is_empty() || base.parse::<hyper::Uri>().is_err() {
            return Err(EngineError::Protocol(format!(
                "endpoint `{base}` is not a URL like http://10.0.0.5:8000"
            )));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // A host that vanished (power, network) is noticed on an idle connection too.
        connector.set_keepalive(Some(Duration::from_secs(10)));
        connector.set_keepalive_interval(Some(Duration::from_secs(2)));
        connector.set_keepalive_retries(Some(3));
        connector.enforce_http(false);
        connector.set_connect_timeout(Some(timeout.min(Duration::from_secs(10))));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(base, tls)?)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            base: base.to_string(),
            client,
            timeout,
            health_check: None,
            authorization: None,
        })
    }

    /// Checks the engine's `/health` while a call waits longer than `every` (see the module).
    pub fn with_health_check(mut self, every: Option<Duration>) -> Self {
        self.health_check = every.filter(|d| !d.is_zero());
        self
    }

    /// Sends `key` as a bearer token with every request.
    pub fn with_api_key(mut self, key: Option<&ApiKey>) -> Self {
        self.authorization = key.and_then(|k| {
            let mut v = hyper::header::HeaderValue::from_str(&format!("Bearer {}", k.0)).ok()?;
            v.set_sensitive(true);
            Some(v)
        });
        self
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET path`, the body parsed as JSON.
    pub async fn get_json(&self, path: &str) -> Result<Value, EngineError> {
        let bytes = self.ok(Method::GET, path, None).await?;
        self.parse(path, &bytes)
    }

    /// `GET path`, the body as text.
    pub async fn get_text(&self, path: &str) -> Result<String, EngineError> {
        let bytes = self.ok(Method::GET, path, None).await?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `POST path` with a JSON body; the answer parsed as JSON (an empty body is `null`).
    pub async fn post_json(&self, path: &str, body: &Value) -> Result<Value, EngineError> {
        let bytes = self.ok(Method::POST, path, Some(body)).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        self.parse(path, &bytes)
    }

    /// `POST path` with a JSON body; the status and raw body whatever the status.
    pub async fn post_raw(&self, path: &str, body: &Value) -> Result<(u16, Bytes), EngineError> {
        self.send(Method::POST, path, Some(body)).await
    }

    fn parse(&self, path: &str, bytes: &[u8]) -> Result<Value, EngineError> {
        serde_json::from_slice(bytes).map_err(|e| {
            EngineError::Protocol(format!(
                "{}{path}: malformed response ({e}): {}",
                self.base,
                snippet(bytes)
            ))
        })
    }

    /// A request whose status must be 2xx: 5xx is `Unavailable`, anything else `Protocol`.
    async fn ok(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Bytes, EngineError> {
        let (code, bytes) = self.send(method.clone(), path, body).await?;
        if (200..300).contains(&code) {
            return Ok(bytes);
        }
        let mut msg = format!(
            "{method} {}{path}: HTTP {code}: {}",
            self.base,
            snippet(&bytes)
        );
        if code == 401 {
            msg.push_str(match self.authorization {
                None => {
                    "; the engine wants an API key and none was sent (a workflow names the variable holding it in pools.rollout.api_key_env)"
                }
                Some(_) => "; the engine refused the API key sent",
            });
        }
        Err(if code >= 500 {
            EngineError::Unavailable(msg)
        } else {
            EngineError::Protocol(msg)
        })
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Bytes), EngineError> {
        let url = format!("{}{path}", self.base);
        let payload = match body {
            Some(v) => Bytes::from(serde_json::to_vec(v).expect("JSON values serialise")),
            None => Bytes::new(),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(&url)
            .header("content-type", "application/json");
        if let Some(auth) = &self.authorization {
            req = req.header(hyper::header::AUTHORIZATION, auth.clone());
        }
        let req = req
            .body(Full::new(payload))
            .map_err(|e| EngineError::Protocol(format!("{url}: {e}")))?;
        let work = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| EngineError::Unavailable(format!("{url}: {}", chain(&e))))?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| EngineError::Unavailable(format!("{url}: reading the body: {e}")))?
                .to_bytes();
            Ok::<_, EngineError>((status, bytes))
        };
        let watched = async {
            match self.health_check {
                Some(every) if path != HEALTH => {
                    let waited = std::time::Instant::now();
                    let watchdog = async {
                        loop {
                            tokio::time::sleep(every).await;
                            if let Err(why) = self.alive(every).await {
                                return why;
                            }
                        }
                    };
                    tokio::select! {
                        r = work => r,
                        why = watchdog => Err(EngineError::Unavailable(format!(
                            "{url}: no answer after {:.0?}, and the engine stopped answering its health check: {why}",
                            waited.elapsed()
                        ))),
                    }
                }
                _ => work.await,
            }
        };
        // A health check itself gets the health-check deadline, not a generation's.
        let deadline = match self.health_check {
            Some(every) if path == HEALTH => every,
            _ => self.timeout,
        };
        let (status, bytes) = tokio::time::timeout(deadline, watched)
            .await
            .map_err(|_| {
                EngineError::Unavailable(format!("{url}: no answer within {deadline:.0?}"))
            })??;
        Ok((status_code(status), bytes))
    }

    /// `GET /health` answered 2xx within `deadline`; else what happened instead.
    async fn alive(&self, deadline: Duration) -> Result<(), String> {
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(format!("{}{HEALTH}", self.base));
        if let Some(auth) = &self.authorization {
            req = req.header(hyper::header::AUTHORIZATION, auth.clone());
        }
        let req = req
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(deadline, self.client.request(req)).await {
            Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
            Ok(Ok(resp)) => Err(format!("{HEALTH} answered HTTP {}", resp.status().as_u16())),
            Ok(Err(e)) => Err(format!("{HEALTH}: {}", chain(&e))),
            Err(_) => Err(format!("{HEALTH} did not answer within {deadline:.0?}")),
        }
    }
}

/// rustls with the system's CA certificates (and `SSL_CERT_FILE` / `SSL_CERT_DIR`) for an
/// `https://` endpoint; an empty trust store for `http://` ones, which never use it.
fn tls_config(base: &str, tls: bool) -> Result<rustls::ClientConfig, EngineError> {
    let mut roots = rustls::RootCertStore::empty();
    if tls {
        let found = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err(EngineError::Protocol(format!(
                "endpoint `{base}`: no CA certificate to check its TLS certificate against ({}); install the system's CA bundle or point SSL_CERT_FILE at a PEM file",
                found
                    .errors
                    .first()
                    .map_or("none found".to_string(), |e| e.to_string())
            )));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| EngineError::Protocol(format!("endpoint `{base}`: TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

fn status_code(s: StatusCode) -> u16 {
    s.as_u16()
}

/// The error and its sources on one line ("client error (Connect): tcp connect error:
/// Connection refused").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

fn snippet(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let t = text.trim();
    match t.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &t[..i]),
        None if t.is_empty() => "(empty body)".into(),
        None => t.to_string(),
    }
}

/// Reads a JSON number or a numeric string (engines disagree on which a version is).
pub fn as_u64(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_str()?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        let t = Duration::from_secs(1);
        assert!(HttpClient::new("http://127.0.0.1:8000/", t).is_ok());
        let e = HttpClient::new("ftp://a:1", t).unwrap_err().to_string();
        assert!(e.contains("not an http:// or https:// URL"), "{e}");
        assert!(format!("{:?}", ApiKey::new("s3cret").unwrap()) == "ApiKey(…)");
        assert!(ApiKey::new("  ").is_none());
        let e = HttpClient::new("http://", t).unwrap_err().to_string();
        assert!(e.contains("is not a URL"), "{e}");
    }

    /// A server on loopback that answers `/health` after `health` (never, for `None`) and
    /// everything else after `work`.
    fn slow_server(health: Option<Duration>, work: Duration) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    let n = conn.read(&mut buf).unwrap_or(0);
                    let is_health = buf[..n].starts_with(b"GET /health");
                    let wait = if is_health { health } else { Some(work) };
                    let Some(wait) = wait else {
                        // Accepted, and then nothing, as a frozen process.
                        std::thread::sleep(Duration::from_secs(30));
                        return;
                    };
                    std::thread::sleep(wait);
                    let _ = conn.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
                    );
                });
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn a_waiting_call_ends_when_the_engine_stops_answering_its_health_check() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let every = Some(Duration::from_millis(200));
        // A frozen engine: the call ends after about two intervals, not at its 30 s deadline.
        let frozen = slow_server(None, Duration::from_secs(30));
        let c = HttpClient::new(&frozen, Duration::from_secs(30))
            .unwrap()
            .with_health_check(every);
        let t0 = std::time::Instant::now();
        let e = rt
            .block_on(c.post_json("/v1/completions", &Value::Null))
            .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(matches!(e, EngineError::Unavailable(_)), "{e}");
        assert!(
            e.to_string().contains("stopped answering its health check"),
            "{e}"
        );
        // A busy engine that answers its health check keeps its call, however long it takes.
        let busy = slow_server(Some(Duration::ZERO), Duration::from_millis(1500));
        let c = HttpClient::new(&busy, Duration::from_secs(30))
            .unwrap()
            .with_health_check(every);
        assert_eq!(
            rt.block_on(c.post_json("/v1/completions", &Value::Null))
                .unwrap(),
            serde_json::json!({})
        );
        // Off: only the call's own deadline.
        let c = HttpClient::new(&frozen, Duration::from_millis(800))
            .unwrap()
            .with_health_check(Some(Duration::ZERO));
        let e = rt
            .block_on(c.post_json("/v1/completions", &Value::Null))
            .unwrap_err();
        assert!(e.to_string().contains("no answer within"), "{e}");
    }

    #[test]
    fn a_refused_connection_is_unavailable_and_names_the_url() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let c =
            HttpClient::new(&format!("http://127.0.0.1:{port}"), Duration::from_secs(2)).unwrap();
        let e = rt.block_on(c.get_json("/health")).unwrap_err();
        assert!(matches!(e, EngineError::Unavailable(_)), "{e}");
        assert!(
            e.to_string().contains(&format!("127.0.0.1:{port}/health")),
            "{e}"
        );
    }

    #[test]
    fn versions_parse_from_numbers_and_strings() {
        assert_eq!(as_u64(&serde_json::json!(3)), Some(3));
        assert_eq!(as_u64(&serde_json::json!("7")), Some(7));
        assert_eq!(as_u64(&serde_json::json!("default")), None);
    }
}
