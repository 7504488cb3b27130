//! Environments that a model acts in over several turns: the [`Environment`] interface (reset
//! with the problem; step with the model's turn → an observation, a reward, whether the episode
//! is over), the built-in ones (`calculator`: a tool-use task; `guess`: a number to find from
//! higher/lower replies), one's own as a program speaking JSON lines ([`command`]), and the
//! tool-call formats they read ([`tools`]).
//!
//! Owns: what an environment says to a turn and what it scores. Never: tokenizes, samples or
//! decides when an episode stops for lack of turns or tokens (the episode loop,
//! [`crate::episode`], does).

pub mod command;
pub mod tools;

use crate::task::Problem;
use command::CommandEnv;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tools::{Call, ToolFormat};

/// Which environment an episode runs in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvSpec {
    /// A tool-use task: the model may call its tools — `calculator`, and `python` (sandboxed) —
    /// any number of times and ends with its answer, scored 1 when its last number equals the
    /// problem's answer.
    Calculator,
    /// A feedback task: find the problem's answer (a whole number) by guessing; every wrong
    /// guess is answered `+` (higher) or `-` (lower); 1 for finding it within the turns.
    Guess,
    /// A program of one's own, started for every episode (see [`command`]).
    Command(CommandEnv),
    /// An agent program of one's own: it runs its own loop against the model through the
    /// agent gateway and is no environment the loop steps.
    Agent(command::AgentProgram),
}

impl EnvSpec {
    /// The tools its model may call, described as OpenAI-style functions (what a chat
    /// template that knows tools is given): the calculator's; none for the others.
    pub fn tools(&self) -> Option<serde_json::Value> {
        match self {
            EnvSpec::Calculator => Some(serde_json::json!([
                {"type": "function", "function": {
                    "name": "calculator",
                    "description": "Evaluates an arithmetic expression of whole numbers: + - * / (exact division only) and parentheses.",
                    "parameters": {"type": "object",
                        "properties": {"expression": {"type": "string", "description": "e.g. 123*456"}},
                        "required": ["expression"]}}},
                {"type": "function", "function": {
                    "name": "python",
                    "description": "Runs Python 3 code without network access and returns what it prints.",
                    "parameters": {"type": "object",
                        "properties": {"code": {"type": "string", "description": "e.g. print(123*456)"}},
                        "required": ["code"]}}}
            ])),
            EnvSpec::Guess | EnvSpec::Command(_) | EnvSpec::Agent(_) => None,
        }
    }

    /// Its name in metrics (`env/<name>/failed`) and workflows.
    pub fn name(&self) -> &str {
        match self {
            EnvSpec::Calculator => "calculator",
            EnvSpec::Guess => "guess",
            EnvSpec::Command(c) => &c.name,
            EnvSpec::Agent(a) => &a.program.name,
        }
    }
}

/// What an environment says back to a turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Observation {
    /// A tool's result (a `tool` message in a chat template; `<result>…</result>` in the
    /// compact format).
    Tool(String),
    /// The environment's own reply (a `user` message in a chat template; the text as it is in
    /// the compact format).
    Reply(String),
}

/// What a tool call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ToolUse {
    /// The turn called no tool.
    #[default]
    None,
    /// A well-formed call that ran.
    Ok,
    /// A malformed call, an unknown tool or a failed evaluation (the observation says which).
    Error,
}

/// One step's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// What the model sees next (nothing when the episode is over).
    pub observation: Option<Observation>,
    /// This step's reward (an episode's score is the sum of its steps').
    pub reward: f32,
    /// The episode is over.
    pub done: bool,
    /// Whether the turn called a tool, and how that went.
    pub tool: ToolUse,
}

/// An environment's failure: the episode ends, counted in `env/<name>/failed`; never the step.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("environment `{env}`: {msg}")]
pub struct EnvError {
    /// The environment's name.
    pub env: String,
    /// What went wrong.
    pub msg: String,
}

/// An environment: one episode's state, stepped by the model's turns.
pub trait Environment: Send {
    /// Starts an episode on `problem` (its prompt is the first observation; the loop encodes it).
    fn reset(&mut self, problem: &Problem) -> Result<(), EnvError>;
    /// The environment's answer to the model's turn `text` (decoded, special tokens skipped).
    fn step(&mut self, text: &str) -> Result<Step, EnvError>;
}

/// The environment `spec` names, reading tool calls in `format`, with `step_timeout` for a
/// program's answers: the one place one is made. An agent program is none (the gateway plays
/// its episodes).
pub fn make(
    spec: &EnvSpec,
    format: ToolFormat,
    step_timeout: Duration,
) -> Result<Box<dyn Environment>, EnvError> {
    Ok(match spec {
        EnvSpec::Calculator => Box::new(Calculator {
            format,
            answer: String::new(),
            sandbox: tools::Sandbox {
                timeout: step_timeout,
                memory_bytes: 1 << 30,
            },
        }),
        EnvSpec::Guess => Box::new(Guess { secret: 0 }),
        EnvSpec::Command(c) => Box::new(command::Command::new(c.clone(), step_timeout)),
        EnvSpec::Agent(a) => {
            return Err(EnvError {
                env: a.program.name.clone(),
                msg:
                    "an agent program runs its own loop through the gateway, not as an environment"
                        .into(),
            });
        }
    })
}

/// The last whole number in `text` (an optional `-` and digits), if any.
fn last_number(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    let end = b.iter().rposition(u8::is_ascii_digit)? + 1;
    let mut start = end;
    while start > 0 && b[start - 1].is_ascii_digit() {
        start -= 1;
    }
    if start > 0 && b[start - 1] == b'-' {
        start -= 1;
    }
    Some(&text[start..end])
}

/// The tool-use task (see [`EnvSpec::Calculator`]).
struct Calculator {
    format: ToolFormat,
    answer: String,
    /// How the `python` tool runs.
    sandbox: tools::Sandbox,
}

impl Environment for Calculator {
    fn reset(&mut self, problem: &Problem) -> Result<(), EnvError> {
        self.answer = problem.answer.trim().to_string();
        Ok(())
    }

    fn step(&mut self, text: &str) -> Result<Step, EnvError> {
        let (observation, tool) = match tools::parse(text, self.format) {
            None => {
                let right = last_number(text) == Some(self.answer.as_str());
                return Ok(Step {
                    observation: None,
                    reward: if right { 1.0 } else { 0.0 },
                    done: true,
                    tool: ToolUse::None,
                });
            }
            Some(Err(msg)) => (format!("error: {msg}"), ToolUse::Error),
            Some(Ok(Call { name, arguments })) => {
                let out = match name.as_str() {
                    "calculator" => tools::calculate(&arguments).map(|v| v.to_string()),
                    "python" => tools::python(&arguments, self.sandbox),
                    _ => Err(format!("no tool `{name}` (tools: calculator, python)")),
                };
                match out {
                    Ok(v) => (v, ToolUse::Ok),
                    Err(msg) => (format!("error: {msg}"), ToolUse::Error),
                }
            }
        };
        Ok(Step {
            observation: Some(Observation::Tool(observation)),
            reward: 0.0,
            done: false,
            tool,
        })
    }
}

/// The feedback task (see [`EnvSpec::Guess`]).
struct Guess {
    secret: i64,
}

impl Environment for Guess {
    fn reset(&mut self, problem: &Problem) -> Result<(), EnvError> {
        self.secret = problem.answer.trim().parse().map_err(|_| EnvError {
            env: "guess".into(),
            msg: format!("the answer {:?} is not a whole number", problem.answer),
        })?;
        Ok(())
    }

    fn step(&mut self, text: &str) -> Result<Step, EnvError> {
        let guess = last_number(text).and_then(|n| n.parse::<i64>().ok());
        let (reply, done) = match guess {
            Some(g) if g == self.secret => {
                return Ok(Step {
                    observation: None,
                    reward: 1.0,
                    done: true,
                    tool: ToolUse::None,
                });
            }
            Some(g) if g < self.secret => ("+", false),
            Some(_) => ("-", false),
            // No number: the episode cannot go on.
            None => ("", true),
        };
        Ok(Step {
            observation: (!done).then(|| Observation::Reply(reply.into())),
            reward: 0.0,
            done,
            tool: ToolUse::None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(spec: EnvSpec, format: ToolFormat, answer: &str, turns: &[&str]) -> Vec<Step> {
        let mut env = make(&spec, format, Duration::from_secs(1)).unwrap();
        env.reset(&Problem::new("q", answer)).unwrap();
        turns.iter().map(|t| env.step(t).unwrap()).collect()
    }

    #[test]
    fn the_calculator_answers_calls_and_scores_the_final_answer() {
        let s = run(
            EnvSpec::Calculator,
            ToolFormat::Compact,
            "56088",
            &["<call>123*456</call>", "<call>1+</call>", "56088"],
        );
        assert_eq!(s[0].observation, Some(Observation::Tool("56088".into())));
        assert_eq!((s[0].tool, s[0].done), (ToolUse::Ok, false));
        assert_eq!(s[1].tool, ToolUse::Error);
        assert!(
            matches!(&s[1].observation, Some(Observation::Tool(t)) if t.starts_with("error: "))
        );
        assert_eq!((s[2].reward, s[2].done), (1.0, true));
        let wrong = run(EnvSpec::Calculator, ToolFormat::Compact, "56088", &["5608"]);
        assert_eq!((wrong[0].reward, wrong[0].done), (0.0, true));
        let hermes = run(
            EnvSpec::Calculator,
            ToolFormat::Hermes,
            "7",
            &[
                "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>",
                "The answer is 7.",
            ],
        );
        assert!(
            matches!(&hermes[0].observation, Some(Observation::Tool(t)) if t.contains("no tool `search`"))
        );
        assert_eq!(hermes[1].reward, 1.0);
        let py = run(
            EnvSpec::Calculator,
            ToolFormat::Hermes,
            "56088",
            &[
                "<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"print(123*456)\"}}</tool_call>",
                "56088",
            ],
        );
        assert_eq!(py[0].observation, Some(Observation::Tool("56088".into())));
        assert_eq!((py[0].tool, py[1].reward), (ToolUse::Ok, 1.0));
    }

    #[test]
    fn guess_says_higher_or_lower_until_found() {
        let s = run(
            EnvSpec::Guess,
            ToolFormat::Compact,
            "37",
            &["50", "25", "37"],
        );
        assert_eq!(s[0].observation, Some(Observation::Reply("-".into())));
        assert_eq!(s[1].observation, Some(Observation::Reply("+".into())));
        assert_eq!((s[2].reward, s[2].done), (1.0, true));
        let lost = run(EnvSpec::Guess, ToolFormat::Compact, "3", &["none"]);
        assert_eq!((lost[0].reward, lost[0].done), (0.0, true));
        let mut env = make(&EnvSpec::Guess, ToolFormat::Compact, Duration::from_secs(1)).unwrap();
        assert!(env.reset(&Problem::new("q", "x")).is_err());
    }

    #[test]
    fn last_numbers() {
        for (text, want) in [
            ("42", Some("42")),
            ("a 1 b -23.", Some("-23")),
            ("none", None),
            ("7-3", Some("-3")),
        ] {
            assert_eq!(last_number(text), want, "{text}");
        }
    }
}
