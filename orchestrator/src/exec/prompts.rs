//! Problems to token ids: the prompt (through the chat template when the stage asks for it) and
//! the answer followed by end-of-sequence.

use super::ExecError;
use learner::chat::ChatTemplate;
use learner::tokenizer::Tokenizer;
use rollout::task::Problem;

/// How a job's problems become tokens.
pub struct Prompts<'a> {
    /// The tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The checkpoint's chat template, when some stage uses it.
    pub chat: Option<&'a ChatTemplate>,
    /// The end-of-sequence token.
    pub eos: u32,
}

impl Prompts<'_> {
    /// Token ids of `p`'s prompt (rendered as a user message when `chat`), and of its answer
    /// followed by end-of-sequence.
    pub fn encode(&self, p: &Problem, chat: bool) -> Result<(Vec<u32>, Vec<u32>), ExecError> {
        let prompt = match (self.chat, chat) {
            (Some(t), true) => self.tokenizer.encode_rendered(&t.render_user(&p.prompt)?)?,
            _ => self.tokenizer.encode(&p.prompt)?,
        };
        let mut answer = self.tokenizer.encode(&p.answer)?;
        answer.push(self.eos);
        Ok((prompt, answer))
    }

    /// Decoded text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ExecError> {
        Ok(self.tokenizer.decode(ids)?)
    }
}
