//! The learner's error type: every variant names the file, tensor or field at fault.

use std::path::PathBuf;

/// What went wrong in the learner.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` is not what a supported model needs.
    #[error("{path}: {msg}")]
    Config {
        /// The config file (or `<init>` for an inline config).
        path: PathBuf,
        /// What is wrong, naming the field.
        msg: String,
    },
    /// A safetensors file is malformed or truncated.
    #[error("{path}: not a readable safetensors file: {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A tensor the model needs is absent.
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint folder or file searched.
        path: PathBuf,
        /// The tensor's name.
        name: String,
    },
    /// A tensor has the wrong shape or an unsupported dtype.
    #[error("{path}: tensor `{name}`: {msg}")]
    BadTensor {
        /// The file holding it.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// What is wrong with it.
        msg: String,
    },
    /// The PJRT plugin refused or failed a call (its own message, naming the call).
    #[error("pjrt device: {0}")]
    Device(String),
    /// The tokenizer could not be loaded or used.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The library's message.
        msg: String,
    },
    /// A batch handed to the model is invalid (token id out of range, empty, too long).
    #[error("invalid batch: {0}")]
    Batch(String),
    /// Data-parallel ranks disagree or were sent what does not fit their model.
    #[error("learner ranks: {0}")]
    Ranks(String),
    /// An RL formula refused its inputs or settings.
    #[error(transparent)]
    Rl(#[from] crate::rl::RlError),
}

/// Result with the learner's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn config(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Self::Config {
            path: path.into(),
            msg: msg.into(),
        }
    }
}
