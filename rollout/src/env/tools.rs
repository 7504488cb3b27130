//! Tool calls read from a model's turn, and the built-in `calculator`.
//!
//! Formats: `hermes` — Qwen's and Hermes' `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
//! (what their chat templates teach), also Llama 3's bare `{"name": …, "parameters": {…}}` turn;
//! `compact` — `<call>EXPRESSION</call>`, a calculator call in the `builtin:tools` tokenizer's
//! own tokens, answered `<result>VALUE</result>`.

use serde::{Deserialize, Serialize};

/// How tool calls are written in a model's turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolFormat {
    /// `<call>EXPRESSION</call>` (the calculator), results as `<result>VALUE</result>`.
    Compact,
    /// `<tool_call>{json}</tool_call>`, or a turn that is one JSON call (Llama 3).
    Hermes,
}

/// The compact format's tokens.
pub const CALL: &str = "<call>";
/// The end of a compact call: a turn stops there.
pub const CALL_END: &str = "</call>";
/// Around a compact tool result.
pub const RESULT: (&str, &str) = ("<result>", "</result>");

/// A parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// The tool's name.
    pub name: String,
    /// Its arguments (the compact format's are `{"expression": …}`).
    pub arguments: serde_json::Value,
}

/// The call in `text`: `None` when the turn calls no tool, `Some(Err(why))` for a malformed one
/// (an observation says so; never a crash).
pub fn parse(text: &str, format: ToolFormat) -> Option<Result<Call, String>> {
    match format {
        ToolFormat::Compact => {
            let start = text.find(CALL)? + CALL.len();
            let Some(len) = text[start..].find(CALL_END) else {
                return Some(Err(format!("a call without {CALL_END}")));
            };
            Some(Ok(Call {
                name: "calculator".into(),
                arguments: serde_json::json!({"expression": text[start..start + len].trim()}),
            }))
        }
        ToolFormat::Hermes => {
            let json = match text.find("<tool_call>") {
                Some(i) => {
                    let body = &text[i + "<tool_call>".len()..];
                    match body.find("</tool_call>") {
                        Some(j) => body[..j].trim(),
                        None => return Some(Err("a <tool_call> without </tool_call>".into())),
                    }
                }
                // Llama 3: the whole turn is one JSON object naming a tool.
                None => {
                    let t = text.trim();
                    if !(t.starts_with('{') && t.contains("\"name\"")) {
                        return None;
                    }
                    t
                }
            };
            Some(call_of_json(json))
        }
    }
}

fn call_of_json(json: &str) -> Result<Call, String> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("the call is not JSON: {e}"))?;
    let name = v
        .get("name")
        .and_then(|n| n.as_str())
        .ok_or("the call has no \"name\"")?;
    let arguments = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(serde_json::Value::Object(Default::default()));
    // Some models write the arguments as a JSON string.
    let arguments = match arguments {
        serde_json::Value::String(s) => serde_json::from_str(&s)
            .map_err(|e| format!("the arguments are not a JSON object: {e}"))?,
        a => a,
    };
    Ok(Call {
        name: name.to_string(),
        arguments,
    })
}

/// The calculator: `arguments.expression`, whole numbers with `+ - *`, `/` (exact division
/// only) and parentheses.
pub fn calculate(arguments: &serde_json::Value) -> Result<i64, String> {
    let e = arguments
        .get("expression")
        .and_then(|e| e.as_str())
        .ok_or("calculator: no \"expression\" argument")?;
    let mut p = Parser {
        s: e.as_bytes(),
        i: 0,
    };
    let v = p.sum()?;
    p.space();
    if p.i != p.s.len() {
        return Err(format!("calculator: cannot read {e:?} past byte {}", p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn space(&mut self) {
        while self.s.get(self.i) == Some(&b' ') {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.s.get(self.i).copied()
    }

    fn sum(&mut self) -> Result<i64, String> {
        let mut v = self.product()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.i += 1;
            let r = self.product()?;
            v = if op == b'+' {
                v.checked_add(r)
            } else {
                v.checked_sub(r)
            }
            .ok_or("calculator: overflow")?;
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<i64, String> {
        let mut v = self.atom()?;
        while let Some(op @ (b'*' | b'/')) = self.peek() {
            self.i += 1;
            let r = self.atom()?;
            v = if op == b'*' {
                v.checked_mul(r).ok_or("calculator: overflow")?
            } else if r == 0 || v % r != 0 {
                return Err(format!("calculator: {v}/{r} is not a whole number"));
            } else {
                v / r
            };
        }
        Ok(v)
    }

    fn atom(&mut self) -> Result<i64, String> {
        match self.peek() {
            Some(b'(') => {
                self.i += 1;
                let v = self.sum()?;
                if self.peek() != Some(b')') {
                    return Err("calculator: a `(` without `)`".into());
                }
                self.i += 1;
                Ok(v)
            }
            Some(b'-') => {
                self.i += 1;
                Ok(-self.atom()?)
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[start..self.i])
                    .ok()
                    .and_then(|t| t.parse().ok())
                    .ok_or_else(|| "calculator: a number out of range".into())
            }
            Some(c) => Err(format!(
                "calculator: unexpected {:?} at byte {}",
                c as char, self.i
            )),
            None => Err("calculator: the expression ends too soon".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_calculator_evaluates_or_says_why_not() {
        for (e, want) in [
            ("123*456", Ok(56088)),
            ("2+3*4", Ok(14)),
            ("(2+3)*4", Ok(20)),
            (" 10 - -3 ", Ok(13)),
            ("8/2/2", Ok(2)),
            ("7/2", Err("calculator: 7/2 is not a whole number")),
            ("1+", Err("calculator: the expression ends too soon")),
            ("(1", Err("calculator: a `(` without `)`")),
            ("2 x", Err("calculator: cannot read \"2 x\" past byte 2")),
        ] {
            assert_eq!(
                calculate(&json!({"expression": e})),
                want.map_err(String::from),
                "{e}"
            );
        }
        assert!(calculate(&json!({})).is_err());
        assert!(calculate(&json!({"expression": "9999999999*9999999999"})).is_err());
    }

    #[test]
    fn calls_are_read_in_each_format() {
        let calc = |e: &str| Call {
            name: "calculator".into(),
            arguments: json!({"expression": e}),
        };
        assert_eq!(
            parse("<call>12*3</call>", ToolFormat::Compact),
            Some(Ok(calc("12*3")))
        );
        assert_eq!(parse("36", ToolFormat::Compact), None);
        assert!(matches!(
            parse("<call>12", ToolFormat::Compact),
            Some(Err(_))
        ));
        let hermes = "I will compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*3\"}}\n</tool_call>";
        assert_eq!(parse(hermes, ToolFormat::Hermes), Some(Ok(calc("12*3"))));
        let stringly = "<tool_call>{\"name\": \"calculator\", \"arguments\": \"{\\\"expression\\\": \\\"1+1\\\"}\"}</tool_call>";
        assert_eq!(parse(stringly, ToolFormat::Hermes), Some(Ok(calc("1+1"))));
        let llama = "{\"name\": \"calculator\", \"parameters\": {\"expression\": \"12*3\"}}";
        assert_eq!(parse(llama, ToolFormat::Hermes), Some(Ok(calc("12*3"))));
        assert_eq!(parse("The answer is 36.", ToolFormat::Hermes), None);
        assert!(matches!(
            parse("<tool_call>{not json}</tool_call>", ToolFormat::Hermes),
            Some(Err(m)) if m.starts_with("the call is not JSON")
        ));
        assert!(matches!(
            parse("<tool_call>{\"arguments\": {}}</tool_call>", ToolFormat::Hermes),
            Some(Err(m)) if m.contains("no \"name\"")
        ));
    }
}
