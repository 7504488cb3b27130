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
        env.add_filter("tojson", tojson);
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

/// `tojson` as transformers gives it to chat templates: Python's `json.dumps(value,
/// ensure_ascii=False, indent=…, separators=…, sort_keys=…)` — `", "` and `": "` (`","` with an
/// indent), keys in their order, floats as Python's `repr`, nothing escaped for HTML (minijinja's
/// own `tojson` writes compact JSON with `<`, `>`, `&` and `'` escaped).
fn tojson(value: &minijinja::Value, kwargs: minijinja::value::Kwargs) -> Result<String, Error> {
    let bad = |msg: String| Error::new(ErrorKind::InvalidOperation, msg);
    let ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<minijinja::Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut v = serde_json::to_value(value).map_err(|e| bad(format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        v.sort_all_objects();
    }
    let indent = match indent {
        None => None,
        Some(i) if i.is_none() => None,
        Some(i) => match (i.as_usize(), i.as_str()) {
            (Some(n), _) => Some(" ".repeat(n)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(bad(format!(
                    "tojson: indent must be a number or text, got {i}"
                )));
            }
        },
    };
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(other) => {
            return Err(bad(format!(
                "tojson: separators must be (item, key), got {other:?}"
            )));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let f = PyJson {
        item,
        key,
        indent,
        level: 0,
        has_value: false,
        ascii: ascii.unwrap_or(false),
    };
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, f);
    serde::Serialize::serialize(&v, &mut ser).map_err(|e| bad(format!("tojson: {e}")))?;
    String::from_utf8(out).map_err(|e| bad(format!("tojson: {e}")))
}

/// JSON written as Python's `json` module writes it.
struct PyJson {
    item: String,
    key: String,
    indent: Option<String>,
    level: usize,
    has_value: bool,
    ascii: bool,
}

impl PyJson {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(unit) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(unit.as_bytes())?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b)
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b)
    }

    fn element<W: ?Sized + std::io::Write>(&self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(self.item.as_bytes())?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyJson {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.element(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.element(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key.as_bytes())
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, v: f64) -> std::io::Result<()> {
        w.write_all(py_float(v).as_bytes())
    }
    fn write_f32<W: ?Sized + std::io::Write>(&mut self, w: &mut W, v: f32) -> std::io::Result<()> {
        w.write_all(py_float(f64::from(v)).as_bytes())
    }
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        if !self.ascii {
            return w.write_all(fragment.as_bytes());
        }
        for c in fragment.chars() {
            if c.is_ascii() {
                w.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    write!(w, "\\u{u:04x}")?;
                }
            }
        }
        Ok(())
    }
}

/// `v` as Python's `repr(float)` writes it: the shortest digits that read back the same, in
/// positional notation for exponents -4 to 15 (`.0` added to whole numbers), else as `1e-05`.
fn py_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` is the shortest round-tripping digits: `-1.2345e4`.
    let e = format!("{:e}", v.abs());
    let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if v < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let body = if exp < 0 {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        } else {
            let point = exp as usize + 1;
            if digits.len() <= point {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        };
        format!("{sign}{body}")
    } else {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() {
            String::new()
        } else {
            format!(".{tail}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{head}{frac}e{esign}{:02}", exp.abs())
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

    /// Qwen2.5-Instruct's template as shipped, with tools, tool calls and tool results: the text
    /// transformers renders (`tests/data/chat/make_tools.py`), character for character — the
    /// tools' JSON as Python's `json.dumps` writes it (`", "` and `": "`, the keys in their
    /// given order, non-ASCII and `<&>` as they are).
    #[test]
    fn tool_conversations_render_as_transformers_renders_them() {
        let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/chat");
        let source = std::fs::read_to_string(data.join("qwen2.5-tools.jinja")).unwrap();
        let t = ChatTemplate::new(&source, "", "<|im_end|>").unwrap();
        let cases: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(data.join("qwen2.5/tools.json")).unwrap(),
        )
        .unwrap();
        for case in cases.as_array().unwrap() {
            let got = t
                .render_with_tools(
                    &case["messages"],
                    case["add_generation_prompt"].as_bool().unwrap(),
                    Some(&case["tools"]),
                )
                .unwrap();
            assert_eq!(got, case["text"].as_str().unwrap());
        }
    }

    #[test]
    fn tojson_writes_as_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(sort_keys=true, separators=(',', ':')) }}|{{ v | tojson(ensure_ascii=true) }}|{{ n | tojson }}",
            "",
            "",
        )
        .unwrap();
        let v = serde_json::json!({"b": [1, 2.5, true, null], "a": "é<\"\n", "c": {}, "d": []});
        let n = serde_json::json!([1e-5, 1e16, 123456789.0, -0.5, 1e22, 0.0001]);
        let got = t
            .env
            .get_template("chat")
            .unwrap()
            .render(context! { v => v, n => n })
            .unwrap();
        // Each as `json.dumps(v, ensure_ascii=False, …)` writes it.
        let want = [
            r#"{"b": [1, 2.5, true, null], "a": "é<\"\n", "c": {}, "d": []}"#,
            "{\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"a\": \"é<\\\"\\n\",\n  \"c\": {},\n  \"d\": []\n}",
            r#"{"a":"é<\"\n","b":[1,2.5,true,null],"c":{},"d":[]}"#,
            r#"{"b": [1, 2.5, true, null], "a": "\u00e9<\"\n", "c": {}, "d": []}"#,
            "[1e-05, 1e+16, 123456789.0, -0.5, 1e+22, 0.0001]",
        ]
        .join("|");
        assert_eq!(got, want);
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
                "<|im_start|>system\nYou are Qwen.\n\n# Tools\n\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"calculator\"}}\n</tools>"
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
