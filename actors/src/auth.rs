//! The cluster token: agents and the head prove membership to each other with it on every call
//! (`authorization: Bearer <token>`), compared in constant time.
//!
//! Owns: reading, generating and checking tokens. Does not own: TLS (the job API issue's).

use std::path::Path;
use std::sync::Arc;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Request, Status};

/// Why a token could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the cluster token from {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write the cluster token to {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the cluster token{origin} must be 16 to 512 printable ASCII characters without spaces"
    )]
    Malformed { origin: String },
}

/// A shared secret; never printed.
#[derive(Clone)]
pub struct Token {
    secret: Arc<str>,
    header: MetadataValue<Ascii>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(…)")
    }
}

impl Token {
    /// A token from its text (surrounding whitespace, such as a file's newline, is trimmed).
    pub fn new(text: &str) -> Result<Token, TokenError> {
        Token::parse(text, String::new())
    }

    fn parse(text: &str, origin: String) -> Result<Token, TokenError> {
        let secret = text.trim();
        let printable = secret.bytes().all(|b| b.is_ascii_graphic());
        let header = format!("Bearer {secret}").parse::<MetadataValue<Ascii>>();
        match header {
            Ok(header) if printable && (16..=512).contains(&secret.len()) => Ok(Token {
                secret: Arc::from(secret),
                header,
            }),
            _ => Err(TokenError::Malformed { origin }),
        }
    }

    /// Reads a token file.
    pub fn read(path: &Path) -> Result<Token, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Token::parse(&text, format!(" in {}", path.display()))
    }

    /// A fresh random token (32 bytes from the OS, hex).
    pub fn generate() -> Result<Token, TokenError> {
        use std::io::Read;
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|source| TokenError::Read {
                path: "/dev/urandom".into(),
                source,
            })?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Token::new(&hex)
    }

    /// Writes the token to a new file readable only by its owner (mode 0600).
    pub fn write(&self, path: &Path) -> Result<(), TokenError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .and_then(|mut f| {
                use std::os::unix::fs::PermissionsExt;
                // An existing file keeps its mode on open: tighten it before writing.
                f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
                f.write_all(format!("{}\n", self.secret).as_bytes())
            })
            .map_err(|source| TokenError::Write {
                path: path.display().to_string(),
                source,
            })
    }

    /// Whether `given` is this token (constant time).
    pub fn matches(&self, given: &str) -> bool {
        constant_time_eq(given.as_bytes(), self.secret.as_bytes())
    }

    /// The secret itself, for handing to a process of the same user over a private channel
    /// (a borrowing head's loan, a learner group's key); never for logs.
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// Whether `other` is the same token (constant time).
    pub fn matches_token(&self, other: &Token) -> bool {
        self.matches(&other.secret)
    }

    /// An interceptor that adds this token to outgoing calls.
    pub fn bearer(&self) -> Bearer {
        Bearer(self.header.clone())
    }

    /// An interceptor that refuses incoming calls without this token.
    pub fn guard(&self) -> Guard {
        Guard {
            secret: self.secret.clone(),
            required: true,
        }
    }

    /// An interceptor that refuses calls with another token but lets calls without one through
    /// (an API on loopback, where any local user may call).
    pub fn guard_optional(&self) -> Guard {
        Guard {
            secret: self.secret.clone(),
            required: false,
        }
    }
}

/// Adds `authorization: Bearer <token>`.
#[derive(Clone)]
pub struct Bearer(MetadataValue<Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

/// Refuses calls whose bearer token differs (or is missing, when required), with
/// UNAUTHENTICATED.
#[derive(Clone)]
pub struct Guard {
    secret: Arc<str>,
    required: bool,
}

/// The bearer token a call presents (`authorization: Bearer <token>`), if any.
pub fn presented<T>(request: &Request<T>) -> Option<&str> {
    request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

impl tonic::service::Interceptor for Guard {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        match presented(&request) {
            Some(given) if constant_time_eq(given.as_bytes(), self.secret.as_bytes()) => {
                Ok(request)
            }
            Some(_) => Err(Status::unauthenticated("wrong cluster token")),
            None if !self.required => Ok(request),
            None => Err(Status::unauthenticated(
                "missing cluster token (authorization: Bearer …)",
            )),
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn guard_accepts_the_token_and_refuses_others() {
        let token = Token::generate().expect("urandom");
        let other = Token::generate().expect("urandom");
        let mut guard = token.guard();
        let signed = token.bearer().call(Request::new(())).expect("adds header");
        assert!(guard.call(signed).is_ok());
        let forged = other.bearer().call(Request::new(())).expect("adds header");
        let e = guard.call(forged).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert_eq!(e.message(), "wrong cluster token");
        let e = guard.call(Request::new(())).unwrap_err();
        assert!(e.message().contains("missing cluster token"));
        let mut optional = token.guard_optional();
        assert!(optional.call(Request::new(())).is_ok());
        let forged = other.bearer().call(Request::new(())).expect("adds header");
        assert!(optional.call(forged).is_err(), "a wrong token is refused");
    }

    #[test]
    fn malformed_tokens_name_their_file() {
        let dir = std::env::temp_dir().join(format!("trellis-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("token");
        std::fs::write(&path, "short\n").expect("write");
        let e = Token::read(&path).unwrap_err().to_string();
        assert!(
            e.contains(&path.display().to_string()) && e.contains("16 to 512"),
            "{e}"
        );
        let t = Token::generate().expect("urandom");
        t.write(&path).expect("write");
        let mode = std::fs::metadata(&path).map(|m| {
            use std::os::unix::fs::PermissionsExt;
            m.permissions().mode() & 0o777
        });
        assert_eq!(mode.expect("stat"), 0o600);
        assert!(Token::read(&path).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
