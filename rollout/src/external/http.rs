//! A small JSON-over-HTTP/1.1 client for the external engine adapters (hyper, already in the
//! build through tonic, so no new HTTP stack).
//!
//! Owns: requests with a deadline, and turning every failure into an [`EngineError`] that names
//! the URL: `Unavailable` when the engine does not answer (refused, reset, timeout, 5xx) so a
//! router can take it out of service, `Protocol` when it answers wrongly (4xx, malformed JSON).
//! Never: retries (the router decides), or speaks TLS (engines sit on the cluster network).

use crate::EngineError;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::time::Duration;

/// What a response that is not 2xx looked like.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    /// HTTP status.
    pub code: u16,
    /// The body, cut to 300 characters.
    pub body: String,
}

/// A client for one engine's base URL (`http://host:port`).
#[derive(Clone)]
pub struct HttpClient {
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HttpClient({})", self.base)
    }
}

impl HttpClient {
    /// A client for `base`; every request gives up after `timeout`. Refuses URLs that are not
    /// `http://host[:port][/prefix]`.
    pub fn new(base: &str, timeout: Duration) -> Result<Self, EngineError> {
        let rest = base.strip_prefix("http://").ok_or_else(|| {
            EngineError::Protocol(format!(
                "endpoint `{base}`: only http:// URLs are supported (engines sit on the cluster network; put a TLS proxy in front otherwise)"
            ))
        })?;
        let base = base.trim_end_matches('/');
        if rest.trim_end_matches('/').is_empty() || base.parse::<hyper::Uri>().is_err() {
            return Err(EngineError::Protocol(format!(
                "endpoint `{base}` is not a URL like http://10.0.0.5:8000"
            )));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout.min(Duration::from_secs(10))));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            base: base.to_string(),
            client,
            timeout,
        })
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
        let msg = format!(
            "{method} {}{path}: HTTP {code}: {}",
            self.base,
            snippet(&bytes)
        );
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
        let req = Request::builder()
            .method(method)
            .uri(&url)
            .header("content-type", "application/json")
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
        let (status, bytes) = tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| {
                EngineError::Unavailable(format!("{url}: no answer within {:.0?}", self.timeout))
            })??;
        Ok((status_code(status), bytes))
    }
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
        let e = HttpClient::new("https://a:1", t).unwrap_err().to_string();
        assert!(e.contains("only http://"), "{e}");
        let e = HttpClient::new("http://", t).unwrap_err().to_string();
        assert!(e.contains("is not a URL"), "{e}");
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
