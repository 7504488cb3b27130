//! Chat templates: a checkpoint's `tokenizer_config.json` `chat_template`, rendered with
//! minijinja the way `transformers`' `apply_chat_template(messages, add_generation_prompt=True)`
//! renders it (Python string methods through minijinja-contrib's `pycompat`,
//! `raise_exception`, `bos_token`/`eos_token`), for stages whose data asks for it
//! (`data.chat_template: true`): the prompt becomes one user message.
//!
//! Owns: reading and rendering the template. Never: tokenizes (the caller encodes the text).

use minijinja::{Environment, Error, ErrorKind, context};
use std::path::Path;

/// Why a chat template cannot be read or rendered (names the file where there is one).
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// `tokenizer_config.json` cannot be read or is not JSON.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The template does not compile.
    #[error("chat_template: {0}")]
    Compile(String),
    /// A prompt the template cannot render.
    #[error("rendering the chat template: {0}")]
    Render(String),
}

/// One message of a conversation, as chat templates read it (`message.role`,
/// `message['content']`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` (the template decides which it accepts).
    pub role: String,
    /// The text.
    pub content: String,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
}

/// A special token as `tokenizer_config.json` writes it: text, or `{"content": text}`.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// transformers' file for a checkpoint's chat template (beside `tokenizer_config.json`).
const JINJA: &str = "chat_template.jinja";

impl ChatTemplate {
    /// Reads `chat_template` (a string, or the `default` of a list of named templates) from a
    /// `tokenizer_config.json`, or from the `chat_template.jinja` beside it (transformers'
    /// newer layout, which wins when both are there, as in transformers).
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, ChatError> {
        let jinja = path.parent().map(|d| d.join(JINJA)).filter(|f| f.is_file());
        Self::read_config(path, jinja.as_deref())?.ok_or_else(|| ChatError::Config {
            path: path.to_path_buf(),
            message: "no chat_template".into(),
        })
    }

    /// A Jinja template file (as vLLM's `--chat-template`), without special tokens.
    pub fn from_file(path: &Path) -> Result<Self, ChatError> {
        let source = std::fs::read_to_string(path).map_err(|e| ChatError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::new(&source, "", "").map_err(|e| ChatError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// The template a checkpoint folder serves with: the file `template` when given, else its
    /// `chat_template.jinja`, else its `tokenizer_config.json`'s `chat_template` (its
    /// `bos_token` and `eos_token` either way); `None` when there is none.
    pub fn find(dir: &Path, template: Option<&Path>) -> Result<Option<Self>, ChatError> {
        let jinja = dir.join(JINJA);
        let template = template.or_else(|| jinja.is_file().then_some(jinja.as_path()));
        let config = dir.join("tokenizer_config.json");
        if config.exists() {
            return Self::read_config(&config, template);
        }
        template.map(Self::from_file).transpose()
    }

    /// A `tokenizer_config.json`'s template (or the file `template`) and special tokens.
    fn read_config(path: &Path, template: Option<&Path>) -> Result<Option<Self>, ChatError> {
        let config = |message: String| ChatError::Config {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| config(e.to_string()))?;
        let cfg: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| config(e.to_string()))?;
        let source = match (template, cfg.get("chat_template")) {
            (Some(file), _) => std::fs::read_to_string(file).map_err(|e| ChatError::Config {
                path: file.to_path_buf(),
                message: e.to_string(),
            })?,
            (None, Some(serde_json::Value::String(s))) => s.clone(),
            (None, Some(serde_json::Value::Array(list))) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .ok_or_else(|| config("chat_template lists no `default` template".into()))?
                .to_string(),
            (None, _) => return Ok(None),
        };
        Self::new(
            &source,
            &token_text(cfg.get("bos_token")),
            &token_text(cfg.get("eos_token")),
        )
        .map(Some)
        .map_err(|e| config(e.to_string()))
    }

    /// Compiles `source`.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ChatError::Compile(e.to_string()))?;
        Ok(Self {
            env,
            source: source.into(),
            bos: bos.into(),
            eos: eos.into(),
        })
    }

    /// What it was made from: the template, the BOS and the EOS text (to make it again in
    /// another process with [`ChatTemplate::new`]).
    pub fn parts(&self) -> (&str, &str, &str) {
        (&self.source, &self.bos, &self.eos)
    }

    /// The text that follows an assistant's turn when `messages` (`tool` results, a `user`
    /// reply) come next, through the next assistant turn's opening: what a multi-turn
    /// conversation appends after the model's own tokens, so that those are never rendered
    /// again. It starts after the template's end-of-sequence text (the token a model ends its
    /// turn with); `.0` is that text, for a turn cut short before writing it. `tools` are the
    /// conversation's (templates that describe them in the system turn render the same text
    /// after it). Refused when the template does not render the messages there (a template
    /// without `tool` messages, or one whose earlier text changes with what follows).
    pub fn continuation(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
    ) -> Result<(String, String), ChatError> {
        const TURN: &str = "@@trellis-turn@@";
        let base = [
            Message {
                role: "user".into(),
                content: "?".into(),
            },
            Message {
                role: "assistant".into(),
                content: TURN.into(),
            },
        ];
        let before = self.render_with_tools(&base[..], false, tools)?;
        let mut all = base.to_vec();
        all.extend_from_slice(messages);
        let after = self.render_with_tools(&all[..], true, tools)?;
        let roles = || {
            let mut r: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
            r.dedup();
            r.join("`/`")
        };
        let rest = match after.strip_prefix(&before) {
            Some(rest) if messages.iter().all(|m| rest.contains(&m.content)) => rest,
            Some(_) => {
                return Err(ChatError::Render(format!(
                    "the chat template does not render a `{}` message after the assistant's turn",
                    roles()
                )));
            }
            None => {
                return Err(ChatError::Render(format!(
                    "the chat template renders the conversation before a `{}` message differently \
                     once it follows",
                    roles()
                )));
            }
        };
        // What the template writes after the turn's text: its end-of-sequence text (the
        // model's own last token), then what closes the turn.
        let tail = before.rfind(TURN).map_or("", |i| &before[i + TURN.len()..]);
        let closing = match tail.strip_prefix(self.eos.as_str()) {
            Some(t) if !self.eos.is_empty() => t,
            _ => tail,
        };
        Ok((self.eos.clone(), format!("{closing}{rest}")))
    }

    /// The text of one user message followed by the assistant's turn.
    pub fn render_user(&self, prompt: &str) -> Result<String, ChatError> {
        self.render(
            &[Message {
                role: "user".into(),
                content: prompt.into(),
            }],
            true,
        )
    }

    /// The text of a conversation, followed by the assistant's turn when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// [`ChatTemplate::render`] with the tools the model may call (`tools`: OpenAI-style
    /// function descriptions, as `apply_chat_template(tools=…)` takes them; templates that
    /// know tools describe them, Qwen's and Llama 3's in the system turn).
    /// `messages` may be any serializable list (an OpenAI request's messages, with their
    /// `tool_calls`, as JSON).
    pub fn render_with_tools<M: serde::Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Render(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
            tools => tools,
        })
        .map_err(|e| ChatError::Render(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-Instruct's template (the branch without tools, as shipped).
    const QWEN25: &str = "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    #[test]
    fn qwen_renders_as_transformers_does() {
        let t = ChatTemplate::new(QWEN25, "", "<|im_end|>").unwrap();
        assert_eq!(
            t.render_user("What is 2+2?").unwrap(),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tools_reach_a_template_that_describes_them() {
        // Qwen2.5-Instruct's system turn when tools are given, as shipped.
        let qwen_tools = concat!(
            "{%- if tools %}{{- '<|im_start|>system\\nYou are Qwen.' }}",
            "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}",
            "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}",
            "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        );
        let t = ChatTemplate::new(qwen_tools, "", "<|im_end|>").unwrap();
        let user = [Message {
            role: "user".into(),
            content: "2+2?".into(),
        }];
        let tools = serde_json::json!([{"type": "function", "function": {"name": "calculator"}}]);
        let with = t.render_with_tools(&user, true, Some(&tools)).unwrap();
        assert!(
            with.starts_with(
                "<|im_start|>system\nYou are Qwen.\n\n# Tools\n\n<tools>\n{\"function\":{\"name\":\"calculator\"},\"type\":\"function\"}\n</tools>"
            ),
            "{with}"
        );
        assert_eq!(
            t.render(&user, true).unwrap(),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_reply_continues_the_assistants_turn() {
        let t = ChatTemplate::new(QWEN25, "", "<|im_end|>").unwrap();
        let user = Message {
            role: "user".into(),
            content: "higher".into(),
        };
        // The model ended its turn with `<|im_end|>`; the newline after it is the template's.
        assert_eq!(
            t.continuation(std::slice::from_ref(&user), None).unwrap(),
            (
                "<|im_end|>".to_string(),
                "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n".to_string()
            )
        );
        // This branch of Qwen's template has no `tool` messages: refused, not dropped.
        let tool = Message {
            role: "tool".into(),
            content: "42".into(),
        };
        assert!(t.continuation(&[tool], None).is_err());
    }

    #[test]
    fn python_methods_bos_and_raise_exception_work() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m['content'].strip().upper() }}{% endfor %}{% if not add_generation_prompt %}{{ raise_exception('no') }}{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(t.render_user("  hi ").unwrap(), "<s>HI");
        let t = ChatTemplate::new("{{ raise_exception('only system and user') }}", "", "").unwrap();
        assert!(
            t.render_user("x")
                .unwrap_err()
                .to_string()
                .contains("only system and user")
        );
    }

    #[test]
    fn tokenizer_configs_are_read_with_clear_errors() {
        let dir = std::env::temp_dir().join(format!("trellis-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("tokenizer_config.json");
        std::fs::write(
            &f,
            r#"{"chat_template": [{"name": "default", "template": "[{{ messages[0].content }}]"}], "eos_token": {"content": "</s>"}}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&f).unwrap();
        assert_eq!(t.render_user("q").unwrap(), "[q]");
        assert_eq!(t.eos, "</s>");
        std::fs::write(&f, "{}").unwrap();
        let e = ChatTemplate::from_tokenizer_config(&f)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.ends_with("tokenizer_config.json: no chat_template"),
            "{e}"
        );
        std::fs::write(&f, r#"{"chat_template": "{% for %}"}"#).unwrap();
        let e = ChatTemplate::from_tokenizer_config(&f)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("chat_template: "), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_chat_template_jinja_beside_the_config_is_read_and_wins() {
        let dir = std::env::temp_dir().join(format!("trellis-jinja-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("tokenizer_config.json");
        std::fs::write(
            &f,
            r#"{"chat_template": "old {{ messages[0].content }}", "bos_token": "<s>"}"#,
        )
        .unwrap();
        std::fs::write(
            dir.join(JINJA),
            "{{ bos_token }}new {{ messages[0].content }}",
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&f).unwrap();
        assert_eq!(t.render_user("q").unwrap(), "<s>new q");
        let t = ChatTemplate::find(&dir, None).unwrap().unwrap();
        assert_eq!(t.render_user("q").unwrap(), "<s>new q");
        // Only the .jinja file: found, without special tokens.
        std::fs::remove_file(&f).unwrap();
        let t = ChatTemplate::find(&dir, None).unwrap().unwrap();
        assert_eq!(t.render_user("q").unwrap(), "new q");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
