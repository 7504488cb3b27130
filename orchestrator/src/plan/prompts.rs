//! Problems to token ids: the prompt (through the chat template when the stage asks for it) and
//! the answer followed by end-of-sequence. Only a plain prompt, which starts a sequence, gets the
//! tokenizer's special tokens (Llama's BOS); a rendered prompt has the template's own, and an
//! answer continues the prompt.

use learner::chat::{ChatError, ChatTemplate};
use learner::tokenizer::Tokenizer;
use rollout::task::{Problem, Prompt};

/// Why a problem could not become tokens.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The tokenizer refused the text.
    #[error(transparent)]
    Tokenizer(#[from] learner::Error),
    /// The chat template could not render it.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// A conversation, and no chat template to render it.
    #[error("the prompt is a conversation and the checkpoint has no chat template")]
    NoChatTemplate,
}

/// How a job's problems become tokens (the plan checks prompt lengths with it; the executor
/// encodes every problem with it).
pub struct Prompts<'a> {
    /// The tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The checkpoint's chat template, when some stage uses it.
    pub chat: Option<&'a ChatTemplate>,
    /// The end-of-sequence token.
    pub eos: u32,
}

impl Prompts<'_> {
    /// Token ids of `p`'s prompt (see [`Prompts::prompt`]), and of its answer followed by
    /// end-of-sequence.
    pub fn encode(&self, p: &Problem, chat: bool) -> Result<(Vec<u32>, Vec<u32>), PromptError> {
        self.encode_with_tools(p, chat, None)
    }

    /// [`Prompts::encode`], a chat template also given the tools the model may call.
    pub fn encode_with_tools(
        &self,
        p: &Problem,
        chat: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<(Vec<u32>, Vec<u32>), PromptError> {
        let prompt = self.prompt_with_tools(&p.prompt, chat, tools)?;
        let mut answer = self.tokenizer.encode_rendered(&p.answer)?;
        answer.push(self.eos);
        Ok((prompt, answer))
    }

    /// Token ids of a prompt: a conversation through the chat template, text as a user message
    /// through it when `chat`, else as it is.
    pub fn prompt(&self, prompt: &Prompt, chat: bool) -> Result<Vec<u32>, PromptError> {
        self.prompt_with_tools(prompt, chat, None)
    }

    /// [`Prompts::prompt`], a chat template also given the tools the model may call.
    pub fn prompt_with_tools(
        &self,
        prompt: &Prompt,
        chat: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, PromptError> {
        let user = |text: &str| {
            [learner::chat::Message {
                role: "user".into(),
                content: text.into(),
            }]
        };
        Ok(match (prompt, self.chat, chat) {
            (Prompt::Chat(messages), Some(t), _) => self
                .tokenizer
                .encode_rendered(&t.render_with_tools(messages, true, tools)?)?,
            (Prompt::Chat(_), None, _) => return Err(PromptError::NoChatTemplate),
            (Prompt::Text(text), Some(t), true) => self
                .tokenizer
                .encode_rendered(&t.render_with_tools(&user(text), true, tools)?)?,
            (Prompt::Text(text), _, _) => self.tokenizer.encode(text)?,
        })
    }

    /// Decoded text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, PromptError> {
        Ok(self.tokenizer.decode(ids)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Llama-3's shape: the post-processor puts `<|begin_of_text|>` first.
    const LLAMA_LIKE: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null,
      "added_tokens": [{"id": 0, "content": "<|begin_of_text|>", "single_word": false,
                        "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
      "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [0],
                                                  "tokens": ["<|begin_of_text|>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "unk_token": "?",
                "vocab": {"<|begin_of_text|>": 0, "1": 1, "+": 2, "=": 3, "2": 4, "?": 5, "</s>": 6}}
    }"#;

    #[test]
    fn only_a_plain_prompt_starts_with_bos_and_answers_never_do() {
        let tokenizer = Tokenizer::from_json(LLAMA_LIKE, Path::new("t.json")).unwrap();
        let chat = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
            "<|begin_of_text|>",
            "</s>",
        )
        .unwrap();
        let prompts = Prompts {
            tokenizer: &tokenizer,
            chat: Some(&chat),
            eos: 6,
        };
        let p = Problem::new("1 + 1 =", "2");
        // (chat, prompt ids): one BOS either way, the template's or the tokenizer's.
        let cases = [(false, vec![0, 1, 2, 1, 3]), (true, vec![0, 1, 2, 1, 3])];
        for (chat, want) in cases {
            let (prompt, answer) = prompts.encode(&p, chat).unwrap();
            assert_eq!(prompt, want, "chat: {chat}");
            assert_eq!(answer, [4, 6], "chat: {chat}");
        }
    }
}
