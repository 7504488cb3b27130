//! One agent program's episode as the gateway keeps it: its trajectories, token-faithful. A
//! call whose messages extend a trajectory's conversation (the same messages, the gateway's own
//! reply last, then new `tool`/`user`/`system` messages) continues it: the model's earlier
//! tokens are reused exactly as sampled, and only the new messages are rendered — the chat
//! template's continuation after an assistant turn — and recorded as observations. A call that
//! extends none (the agent rewrote, cut or summarised its history, or changed its tools) forks:
//! a new trajectory whose prompt is the whole conversation rendered.
//!
//! Owns: reading a request's messages, matching them against the trajectories, and what a
//! trajectory records. Never: serves HTTP or runs the program (`gateway` does).

use crate::env::tools::{Call, split_hermes};
use crate::episode::{Agent, EpisodeStats, Limits, Trajectory, turn_seed};
use crate::{Completion, FinishReason, GenerateRequest, SamplingParams};
use learner::chat::Message;
use serde_json::Value;

/// One message as conversations are compared: its role, its text, and its tool calls (name
/// and arguments as JSON, whatever ids and spelling the client gave them).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Turn {
    pub role: String,
    pub content: String,
    pub tool_calls: Vec<(String, Value)>,
}

/// A request's messages, read: the turns, and the messages as the chat template renders them
/// (content as text; tool-call arguments as objects, as vLLM hands them to templates). Errors
/// name the field.
pub(crate) fn read_messages(messages: &[Value]) -> Result<(Vec<Turn>, Vec<Value>), String> {
    let mut turns = Vec::with_capacity(messages.len());
    let mut rendered = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(obj) = m else {
            return Err(format!("`{at}` must be an object"));
        };
        let role = obj
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("`{at}.role` must be a string"))?
            .to_string();
        let content = match obj.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(format!(
                                "`{at}.content[{j}]`: only text parts are supported, got `{}`",
                                kind.unwrap_or("?")
                            ));
                        }
                    }
                }
                text
            }
            Some(_) => return Err(format!("`{at}.content` must be text or a list of parts")),
        };
        let mut out = obj.clone();
        out.insert("content".into(), Value::String(content.clone()));
        let mut tool_calls = Vec::new();
        match obj.get("tool_calls") {
            None | Some(Value::Null) => {
                out.remove("tool_calls");
            }
            Some(Value::Array(calls)) => {
                let mut fixed = Vec::with_capacity(calls.len());
                for (j, c) in calls.iter().enumerate() {
                    let at = format!("{at}.tool_calls[{j}].function");
                    let f = c
                        .get("function")
                        .ok_or_else(|| format!("`{at}` is missing"))?;
                    let name = f
                        .get("name")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("`{at}.name` must be a string"))?;
                    let arguments = match f.get("arguments") {
                        None | Some(Value::Null) => Value::Object(Default::default()),
                        Some(Value::String(s)) => serde_json::from_str(s)
                            .map_err(|e| format!("`{at}.arguments` is not JSON: {e}"))?,
                        Some(v) => v.clone(),
                    };
                    tool_calls.push((name.to_string(), arguments.clone()));
                    let mut c = c.clone();
                    c["function"]["arguments"] = arguments;
                    fixed.push(c);
                }
                out.insert("tool_calls".into(), Value::Array(fixed));
            }
            Some(_) => return Err(format!("`{at}.tool_calls` must be a list")),
        }
        turns.push(Turn {
            role,
            content,
            tool_calls,
        });
        rendered.push(Value::Object(out));
    }
    Ok((turns, rendered))
}

/// One trajectory, and the conversation it is.
#[derive(Debug)]
struct Branch {
    /// The conversation through the gateway's last reply.
    turns: Vec<Turn>,
    tools: Option<Value>,
    traj: Trajectory,
}

/// A call made ready for the engine.
#[derive(Debug)]
pub(crate) struct Pending {
    /// The trajectory it continues (`None`: a new one, whose prompt is `context`).
    branch: Option<usize>,
    /// Tokens of the new messages (after the model's last turn).
    observation: Vec<u32>,
    /// The call's conversation (to which the reply is added).
    turns: Vec<Turn>,
    tools: Option<Value>,
    /// What the engine continues.
    context: Vec<u32>,
    /// Tokens it may sample.
    room: usize,
    /// The call wants its tokens' log-probs back.
    pub logprobs: bool,
}

/// What a call gets: the engine's request, or no turn (the episode's budget is spent).
#[derive(Debug)]
pub(crate) enum Prepared {
    Turn(Pending),
    Spent(&'static str),
}

/// The gateway's answer to a call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Reply {
    /// The text (before the first tool call when there are calls; `None` when that is empty).
    pub content: Option<String>,
    pub calls: Vec<Call>,
    /// OpenAI's `finish_reason`: `stop`, `length` or `tool_calls`.
    pub finish: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Each sampled token's text and log-prob, when the call asked for them.
    pub tokens: Vec<(String, f32)>,
}

impl Reply {
    /// The answer to a call past the episode's budget: no text, `length`.
    pub(crate) fn spent() -> Self {
        Self {
            content: None,
            calls: Vec::new(),
            finish: "length",
            prompt_tokens: 0,
            completion_tokens: 0,
            tokens: Vec::new(),
        }
    }
}

/// One sample's episode.
#[derive(Debug)]
pub(crate) struct Session {
    pub request: usize,
    pub index: usize,
    limits: Limits,
    /// The turns' sampling (one sample; `max_tokens` a turn at most).
    params: SamplingParams,
    branches: Vec<Branch>,
    /// Calls served (model turns).
    calls: usize,
    pub stats: EpisodeStats,
}

impl Session {
    pub(crate) fn new(request: usize, index: usize, limits: Limits, base: &SamplingParams) -> Self {
        let mut params = base.clone();
        params.n = 1;
        Self {
            request,
            index,
            limits,
            params,
            branches: Vec::new(),
            calls: 0,
            stats: EpisodeStats::default(),
        }
    }

    /// The engine's work for a call of `turns` (rendered as `rendered`) with `tools`, asking
    /// `max_tokens` at most: continuing the latest trajectory it extends, or a new one.
    pub(crate) fn prepare(
        &self,
        agent: &Agent,
        turns: Vec<Turn>,
        rendered: &[Value],
        tools: Option<Value>,
        max_tokens: Option<usize>,
    ) -> Result<Prepared, String> {
        if self.calls >= self.limits.max_turns {
            return Ok(Prepared::Spent("the episode's turns are spent"));
        }
        let chat = agent
            .chat
            .as_ref()
            .ok_or("the model has no chat template")?;
        let extends = |b: &Branch| {
            b.tools == tools
                && turns.len() > b.turns.len()
                && turns[..b.turns.len()] == b.turns[..]
                && turns[b.turns.len()..].iter().all(|t| t.role != "assistant")
        };
        let (branch, observation, context, budget) = match self.branches.iter().rposition(extends) {
            Some(i) => {
                let b = &self.branches[i];
                let new: Vec<Message> = turns[b.turns.len()..]
                    .iter()
                    .map(|t| Message {
                        role: t.role.clone(),
                        content: t.content.clone(),
                    })
                    .collect();
                let ended = b.traj.finish == FinishReason::Stop;
                let obs = agent.continue_chat(chat, &new, tools.as_ref(), ended)?;
                let mut context = b.traj.context.clone();
                context.extend(&obs);
                let used = b.traj.response_len() + obs.len();
                (
                    Some(i),
                    obs,
                    context,
                    self.limits.max_tokens.saturating_sub(used),
                )
            }
            None => {
                let text = chat
                    .render_with_tools(rendered, true, tools.as_ref())
                    .map_err(|e| e.to_string())?;
                let prompt = agent
                    .tokenizer
                    .encode_rendered(&text)
                    .map_err(|e| e.to_string())?;
                (None, Vec::new(), prompt, self.limits.max_tokens)
            }
        };
        if context.len() >= agent.max_context {
            return Err(format!(
                "the conversation is {} tokens, and the model's context {}",
                context.len(),
                agent.max_context
            ));
        }
        let room = self
            .params
            .max_tokens
            .min(max_tokens.unwrap_or(usize::MAX))
            .min(budget)
            .min(agent.max_context - context.len());
        if room == 0 {
            return Ok(Prepared::Spent("the episode's tokens are spent"));
        }
        Ok(Prepared::Turn(Pending {
            branch,
            observation,
            turns,
            tools,
            context,
            room,
            logprobs: false,
        }))
    }

    /// The engine's request for `p` (its own seed: the request's, the sample's and the call's).
    pub(crate) fn request(&self, p: &Pending) -> GenerateRequest {
        let mut params = self.params.clone();
        params.max_tokens = p.room;
        params.seed = turn_seed(self.params.seed, self.index, self.calls);
        GenerateRequest::new(p.context.clone(), params)
    }

    /// Records the engine's turn `c` for `p` and answers the call.
    pub(crate) fn record(
        &mut self,
        agent: &Agent,
        p: Pending,
        c: Completion,
    ) -> Result<Reply, String> {
        let prompt_tokens = p.context.len();
        let i = match p.branch {
            Some(i) => {
                self.branches[i].traj.push_observation(&p.observation);
                i
            }
            None => {
                self.branches.push(Branch {
                    turns: Vec::new(),
                    tools: p.tools,
                    traj: Trajectory::new(p.context),
                });
                self.branches.len() - 1
            }
        };
        if self.calls > 0 {
            self.stats.count_prefill(prompt_tokens, c.cached_tokens);
        }
        self.calls += 1;
        self.stats.turns += 1;
        let b = &mut self.branches[i];
        b.traj.push_turn(&c);
        let text = agent
            .tokenizer
            .decode(&c.token_ids)
            .map_err(|e| e.to_string())?;
        let (content, calls) = split_hermes(&text);
        self.stats.tool_calls += calls.len();
        let finish = match (calls.is_empty(), c.finish_reason) {
            (false, _) => "tool_calls",
            (true, FinishReason::Stop) => "stop",
            (true, FinishReason::Length) => "length",
        };
        b.turns = p.turns;
        b.turns.push(Turn {
            role: "assistant".into(),
            content: content.clone(),
            tool_calls: calls
                .iter()
                .map(|c| (c.name.clone(), c.arguments.clone()))
                .collect(),
        });
        let tokens = if p.logprobs {
            c.token_ids
                .iter()
                .zip(&c.logprobs)
                .map(|(&t, &l)| Ok((agent.tokenizer.decode(&[t])?, l)))
                .collect::<Result<_, learner::Error>>()
                .map_err(|e| e.to_string())?
        } else {
            Vec::new()
        };
        Ok(Reply {
            content: (!content.is_empty() || calls.is_empty()).then_some(content),
            calls,
            finish,
            prompt_tokens,
            completion_tokens: c.token_ids.len(),
            tokens,
        })
    }

    /// The episode's completions: one per trajectory, each with its own prompt and the
    /// episode's stats (`fork` numbering them); one empty completion when the program made no
    /// call.
    pub(crate) fn into_completions(self) -> Vec<Completion> {
        let Session {
            request,
            index,
            branches,
            stats,
            ..
        } = self;
        if branches.is_empty() {
            return vec![Trajectory::new(Vec::new()).into_completion(request, index, stats, false)];
        }
        branches
            .into_iter()
            .enumerate()
            .map(|(fork, b)| {
                let stats = EpisodeStats {
                    fork,
                    ..stats.clone()
                };
                b.traj.into_completion(request, index, stats, true)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VersionSpan;
    use crate::episode::AgentSetup;
    use learner::chat::ChatTemplate;
    use serde_json::json;

    fn data(file: &str) -> String {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data");
        std::fs::read_to_string(dir.join(file)).unwrap()
    }

    /// The fixture's Qwen tokenizer and Qwen2.5's chat template as shipped (with tools).
    fn setup() -> (Agent, ChatTemplate, learner::tokenizer::Tokenizer) {
        let template = data("chat/qwen2.5-tools.jinja");
        let tokenizer_json = data("tiny-qwen2/checkpoint/tokenizer.json");
        let agent = Agent::new(&AgentSetup {
            tokenizer_json: tokenizer_json.clone(),
            chat: Some((template.clone(), String::new(), "<|im_end|>".into())),
            max_context: 1000,
        })
        .unwrap();
        let tok =
            learner::tokenizer::Tokenizer::from_json(&tokenizer_json, std::path::Path::new("t"))
                .unwrap();
        (
            agent,
            ChatTemplate::new(&template, "", "<|im_end|>").unwrap(),
            tok,
        )
    }

    fn sampled(tokens: Vec<u32>, finish: FinishReason) -> Completion {
        Completion {
            request: 0,
            index: 0,
            logprobs: vec![-0.5; tokens.len()],
            entropies: Vec::new(),
            weight_versions: vec![VersionSpan {
                version: 7,
                start: 0,
                end: tokens.len(),
            }],
            token_ids: tokens,
            finish_reason: finish,
            observations: Vec::new(),
            cached_tokens: 0,
            episode: None,
            prompt: None,
        }
    }

    fn turn(s: &Session, agent: &Agent, messages: &Value, tools: &Value) -> Pending {
        let (turns, rendered) = read_messages(messages.as_array().unwrap()).unwrap();
        match s
            .prepare(agent, turns, &rendered, Some(tools.clone()), Some(30))
            .unwrap()
        {
            Prepared::Turn(p) => p,
            Prepared::Spent(why) => panic!("{why}"),
        }
    }

    #[test]
    fn calls_that_extend_a_conversation_reuse_its_tokens_and_rewrites_fork() {
        let (agent, template, tok) = setup();
        let enc = |t: &str| tok.encode_rendered(t).unwrap();
        let tools = json!([{"type": "function", "function": {"name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]);
        let base = SamplingParams {
            n: 4,
            max_tokens: 40,
            seed: Some(3),
            ..Default::default()
        };
        let limits = Limits {
            max_turns: 3,
            max_tokens: 200,
            step_timeout_s: 5.0,
        };
        let mut s = Session::new(0, 1, limits, &base);

        // The first call: a new trajectory, its prompt the conversation rendered with its tools.
        let first = json!([{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "6*7?"}]);
        let p = turn(&s, &agent, &first, &tools);
        let prompt = enc(&template
            .render_with_tools(&first, true, Some(&tools))
            .unwrap());
        assert_eq!((p.branch, &p.context, p.room), (None, &prompt, 30));
        let r = s.request(&p);
        assert_eq!(
            (r.params.n, r.params.max_tokens, r.params.seed),
            (1, 30, turn_seed(Some(3), 1, 0))
        );
        let call = enc(
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"6*7\"}}\n</tool_call><|im_end|>",
        );
        let reply = s
            .record(&agent, p, sampled(call.clone(), FinishReason::Stop))
            .unwrap();
        assert_eq!(
            reply,
            Reply {
                content: None,
                calls: vec![Call {
                    name: "calculator".into(),
                    arguments: json!({"expression": "6*7"})
                }],
                finish: "tool_calls",
                prompt_tokens: prompt.len(),
                completion_tokens: call.len(),
                tokens: Vec::new(),
            }
        );

        // The reply sent back as the openai client does (content null, arguments a string, an
        // id), and the tool's result: the same trajectory, only the new message rendered.
        let mut second = first.as_array().unwrap().clone();
        second.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_9",
            "type": "function", "function": {"name": "calculator",
            "arguments": "{\"expression\": \"6*7\"}"}}]}),
        );
        second.push(json!({"role": "tool", "tool_call_id": "call_9", "content": "42"}));
        let p = turn(&s, &agent, &Value::Array(second.clone()), &tools);
        let tool = Message {
            role: "tool".into(),
            content: "42".into(),
        };
        let (_, rest) = template.continuation(&[tool], Some(&tools)).unwrap();
        let obs = enc(&rest);
        assert_eq!(p.branch, Some(0));
        assert_eq!(p.observation, obs);
        let whole: Vec<u32> = [&prompt[..], &call, &obs].concat();
        assert_eq!(p.context, whole);
        let answer = enc("It is 42.<|im_end|>");
        let mut p = p;
        p.logprobs = true;
        let reply = s
            .record(&agent, p, sampled(answer.clone(), FinishReason::Stop))
            .unwrap();
        assert_eq!(
            (reply.content.as_deref(), reply.finish),
            (Some("It is 42."), "stop")
        );
        // Asked for: every sampled token's text and log-prob (the end of turn's text is a
        // special token's, skipped).
        let texts: String = reply.tokens.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(texts, "It is 42.");
        assert_eq!(reply.tokens.len(), answer.len());
        assert!(reply.tokens.iter().all(|&(_, l)| l == -0.5));

        // A rewritten history (the tool exchange dropped) forks a new trajectory.
        let third = json!([{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "6*7? No tools."}]);
        let p = turn(&s, &agent, &third, &tools);
        assert_eq!(p.branch, None);
        let forked = p.context.clone();
        s.record(&agent, p, sampled(enc("42<|im_end|>"), FinishReason::Stop))
            .unwrap();
        // The turns are spent.
        let (turns, rendered) = read_messages(third.as_array().unwrap()).unwrap();
        assert!(matches!(
            s.prepare(&agent, turns, &rendered, Some(tools.clone()), None),
            Ok(Prepared::Spent(_))
        ));

        let out = s.into_completions();
        assert_eq!(out.len(), 2);
        let c = &out[0];
        assert_eq!(c.prompt.as_deref(), Some(&prompt[..]));
        assert_eq!(c.token_ids, [&call[..], &obs, &answer].concat());
        assert_eq!(c.observations, vec![call.len()..call.len() + obs.len()]);
        assert!(
            c.logprobs[call.len()..call.len() + obs.len()]
                .iter()
                .all(|&l| l == 0.0)
        );
        assert_eq!(c.logprobs.len(), c.token_ids.len());
        // Weight versions cover the model's tokens only.
        assert_eq!(
            c.weight_versions
                .iter()
                .map(|s| (s.start, s.end))
                .collect::<Vec<_>>(),
            vec![(0, call.len()), (call.len() + obs.len(), c.token_ids.len())]
        );
        let stats = c.episode.as_ref().unwrap();
        assert_eq!((stats.turns, stats.tool_calls, stats.fork), (3, 1, 0));
        assert_eq!(out[1].prompt.as_deref(), Some(&forked[..]));
        assert_eq!(out[1].episode.as_ref().unwrap().fork, 1);
    }

    #[test]
    fn messages_are_read_with_errors_that_name_the_field() {
        let ok = json!([{"role": "user", "content": [{"type": "text", "text": "a"},
            {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"function":
                {"name": "f", "arguments": {"x": 1}}}]}]);
        let (turns, rendered) = read_messages(ok.as_array().unwrap()).unwrap();
        assert_eq!(turns[0].content, "ab");
        assert_eq!(
            turns[1].tool_calls,
            vec![("f".to_string(), json!({"x": 1}))]
        );
        assert_eq!(rendered[1]["content"], json!(""));
        for (bad, want) in [
            (json!([1]), "`messages[0]` must be an object"),
            (
                json!([{"content": "x"}]),
                "`messages[0].role` must be a string",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image_url"}]}]),
                "`messages[0].content[0]`: only text parts are supported, got `image_url`",
            ),
            (
                json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                    "arguments": "{"}}]}]),
                "`messages[0].tool_calls[0].function.arguments` is not JSON",
            ),
        ] {
            let e = read_messages(bad.as_array().unwrap()).unwrap_err();
            assert!(e.starts_with(want), "{e}");
        }
    }
}
