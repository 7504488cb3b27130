//! The job API's client side, as the CLI (`trellis submit`, `jobs`, `status`, `logs`, `cancel`,
//! `resume`) uses it: a connection to a server with its token and, for `https://` URLs, the CA
//! to trust.
//!
//! Owns: connecting and authenticating. Never: formats output (the CLI does) or retries calls.

use actors::{Bearer, Token};
use proto::v1::job_service_client::JobServiceClient;
use std::time::Duration;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// Where the server is and how to prove who we are.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// `http://HOST:PORT`, or `https://HOST:PORT` for a server with TLS.
    pub server: String,
    /// The server's token (its `DATA_DIR/token`); required by non-loopback servers.
    pub token: Option<Token>,
    /// PEM certificate(s) to trust for `https://` (a self-signed server's certificate).
    pub tls_ca: Option<Vec<u8>>,
}

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
#[error("server {server}: {message}")]
pub struct ClientError {
    /// The URL.
    pub server: String,
    /// What went wrong.
    pub message: String,
}

/// Adds the bearer token, when there is one.
#[derive(Clone)]
pub struct Auth(Option<Bearer>);

impl Interceptor for Auth {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        match &mut self.0 {
            Some(b) => b.call(request),
            None => Ok(request),
        }
    }
}

/// A connected job API client.
pub type Client = JobServiceClient<InterceptedService<Channel, Auth>>;

/// Connects to the server (fails at once when nothing listens there).
pub async fn connect(opts: &ClientOptions) -> Result<Client, ClientError> {
    let err = |message: String| ClientError {
        server: opts.server.clone(),
        message,
    };
    let mut endpoint = Endpoint::from_shared(opts.server.clone())
        .map_err(|e| err(format!("not a URL: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    if opts.server.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &opts.tls_ca {
            tls = tls.ca_certificate(Certificate::from_pem(ca));
        }
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| err(format!("TLS: {e}")))?;
    }
    let channel = endpoint.connect().await.map_err(|e| {
        let mut msg = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            let text = s.to_string();
            if !msg.contains(&text) {
                msg = format!("{msg}: {text}");
            }
            source = s.source();
        }
        let hint = if msg.contains("UnknownIssuer") {
            "; pass --tls-ca CERT to trust a certificate no public CA signed"
        } else {
            "; is `trellis serve` running there?"
        };
        err(format!("cannot connect ({msg}){hint}"))
    })?;
    let auth = Auth(opts.token.as_ref().map(Token::bearer));
    Ok(JobServiceClient::with_interceptor(channel, auth).max_decoding_message_size(64 << 20))
}
