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
        self.encode_with(text, true)
    }

    /// Token ids of text a chat template rendered, or of text that continues a sequence (an
    /// answer after its prompt): without the post-processing's special tokens (the template
    /// wrote its own), as `apply_chat_template(tokenize=True)` and VeRL's datasets
    /// (`add_special_tokens=False`) do.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, special)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer whose post-processing puts `<s>` first, as Llama's does.
    const WITH_BOS: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null,
      "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"<s>": 0, "hi": 1, "there": 2, "<unk>": 3},
                "unk_token": "<unk>"}
    }"#;

    #[test]
    fn rendered_text_gets_no_second_bos() {
        let t = Tokenizer::from_json(WITH_BOS, Path::new("t.json")).unwrap();
        assert_eq!(t.encode("hi there").unwrap(), [0, 1, 2]);
        // A template that wrote `<s>` itself keeps exactly one.
        assert_eq!(t.encode_rendered("<s> hi there").unwrap(), [0, 1, 2]);
        assert_eq!(t.encode_rendered("hi").unwrap(), [1]);
    }
}
