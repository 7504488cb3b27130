//! Text ↔ token ids through a Hugging Face `tokenizer.json` (the `tokenizers` crate).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// A loaded tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Ok(Self {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Loads from JSON text (`origin` names it in errors).
    pub fn from_json(json: &str, origin: &Path) -> Result<Self> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| Error::Tokenizer {
                path: origin.to_path_buf(),
                msg: e.to_string(),
            })?;
        Ok(Self {
            inner,
            path: origin.to_path_buf(),
        })
    }

    /// Token ids of `text`, with the tokenizer's post-processing (special tokens) applied, as
    /// `transformers`' default call does.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer {
            path: self.path.clone(),
            msg: e.to_string(),
        })
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}
