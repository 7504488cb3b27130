//! Episodes: a request whose samples act in an environment over several turns, run next to the
//! engine that generates them ([`generate`] — inside a rollout actor, or beside an external
//! engine's client). Every turn of every live episode goes to the engine in one call, so the
//! engine batches them as it batches samples.
//!
//! A trajectory is token-faithful: the model's tokens are kept exactly as the engine sampled
//! them (never decoded and encoded again), and only the environment's text is tokenized —
//! through the chat template's continuation after an assistant turn, or in the compact format
//! of the `builtin:tools` tokenizer — and recorded as observation ranges, which never train.
//!
//! Owns: the turn loop, its limits (turns, tokens, a step's time), and what an episode's
//! completion records. Never: scores beyond what the environment says, or trains.

pub mod gateway;

use crate::env::tools::{CALL_END, RESULT, ToolFormat};
use crate::env::{self, EnvError, EnvSpec, Environment, Observation, ToolUse};
use crate::task::Problem;
use crate::{Completion, EngineError, FinishReason, GenerateRequest, InferenceEngine, VersionSpan};
use learner::chat::{ChatTemplate, Message};
use learner::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

/// What an episode runs in, carried by its request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpisodeSpec {
    /// The environment.
    pub env: EnvSpec,
    /// How the model writes tool calls.
    pub format: ToolFormat,
    /// Observations are chat messages rendered by the agent's chat template (the prompt was
    /// rendered by it too).
    pub chat: bool,
    /// The problem's prompt text (what the environment is reset with).
    pub prompt: String,
    /// The problem's answer.
    pub answer: String,
    /// Its limits.
    pub limits: Limits,
}

/// The limits of one episode.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// Model turns at most.
    pub max_turns: usize,
    /// Tokens after the prompt (the model's and the environment's) at most.
    pub max_tokens: usize,
    /// Seconds one environment step may take; a slower one fails its episode.
    pub step_timeout_s: f64,
}

impl Limits {
    /// [`Limits::step_timeout_s`] as a duration (a millisecond at least).
    pub fn step_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.step_timeout_s.max(0.001))
    }
}

/// What an episode did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeStats {
    /// Its score: the sum of its steps' rewards (0 when it failed).
    pub reward: f32,
    /// The steps' rewards that are not 0, each at the index (in the completion's tokens) of the
    /// last token of the turn it answered: where a per-token estimator credits it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turn_rewards: Vec<(usize, f32)>,
    /// Model turns.
    pub turns: usize,
    /// Tool calls, and those that failed (malformed, unknown tool, a failed evaluation).
    pub tool_calls: usize,
    /// See `tool_calls`.
    pub tool_errors: usize,
    /// Tokens the engine prefilled for the turns after the first: each turn's context but what
    /// its prefix cache held.
    pub prefill_tokens: usize,
    /// Tokens of those turns' contexts the engine's prefix cache held (not computed again).
    pub cached_tokens: usize,
    /// Why the environment failed, when it did (the episode ended there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
    /// Which of the episode's trajectories this completion is: 0, the first; an agent program
    /// that rewrote its history made more (see [`gateway`]), which share these stats.
    #[serde(default, skip_serializing_if = "crate::is_zero")]
    pub fork: usize,
}

impl EpisodeStats {
    /// Counts a later turn's prefill: its context of `context` tokens, `cached` of them held by
    /// the engine's prefix cache.
    pub(crate) fn count_prefill(&mut self, context: usize, cached: usize) {
        self.prefill_tokens += context - cached.min(context);
        self.cached_tokens += cached;
    }
}

impl EpisodeStats {
    /// Ends the episode for `e`: it scores 0 (the first failure is the one kept).
    pub(crate) fn fail(&mut self, e: &EnvError) {
        self.failed.get_or_insert_with(|| e.to_string());
        self.reward = 0.0;
        self.turn_rewards.clear();
    }
}

/// One token sequence of an episode: its prompt, then the model's turns as the engine sampled
/// them, with the environment's tokens between them (observations, log-prob 0).
#[derive(Debug)]
pub(crate) struct Trajectory {
    prompt_len: usize,
    /// The prompt and every token since.
    pub context: Vec<u32>,
    logprobs: Vec<f32>,
    observations: Vec<Range<usize>>,
    spans: Vec<VersionSpan>,
    /// How the last model turn ended.
    pub finish: FinishReason,
}

impl Trajectory {
    pub(crate) fn new(prompt: Vec<u32>) -> Self {
        Self {
            prompt_len: prompt.len(),
            context: prompt,
            logprobs: Vec::new(),
            observations: Vec::new(),
            spans: Vec::new(),
            finish: FinishReason::Stop,
        }
    }

    /// Tokens after the prompt.
    pub(crate) fn response_len(&self) -> usize {
        self.context.len() - self.prompt_len
    }

    /// The response tokens in `r`.
    fn response(&self, r: &Range<usize>) -> &[u32] {
        &self.context[self.prompt_len + r.start..self.prompt_len + r.end]
    }

    /// Appends the model's turn `c` — its tokens, log-probs, the weight versions that made them
    /// (moved to where they now sit) and how it ended —; its range in the response.
    pub(crate) fn push_turn(&mut self, c: &Completion) -> Range<usize> {
        let start = self.response_len();
        self.spans
            .extend(c.weight_versions.iter().map(|s| VersionSpan {
                version: s.version,
                start: s.start + start,
                end: s.end + start,
            }));
        self.context.extend(&c.token_ids);
        self.logprobs.extend(&c.logprobs);
        self.finish = c.finish_reason;
        start..self.response_len()
    }

    /// Appends the environment's `tokens` as an observation.
    pub(crate) fn push_observation(&mut self, tokens: &[u32]) {
        let start = self.response_len();
        self.context.extend(tokens);
        self.logprobs.extend(std::iter::repeat_n(0.0, tokens.len()));
        self.observations.push(start..self.response_len());
    }

    /// Sample `index` of request `request`, with the episode's `stats`; `own_prompt`: the
    /// completion carries its prompt (it is not the request's).
    pub(crate) fn into_completion(
        self,
        request: usize,
        index: usize,
        stats: EpisodeStats,
        own_prompt: bool,
    ) -> Completion {
        let (prompt, response) = self.context.split_at(self.prompt_len);
        Completion {
            request,
            index,
            token_ids: response.to_vec(),
            logprobs: self.logprobs,
            // An episode's turns may sample at an agent's own settings: its rows are scored.
            entropies: Vec::new(),
            finish_reason: self.finish,
            weight_versions: self.spans,
            observations: self.observations,
            prompt: own_prompt.then(|| prompt.to_vec()),
            cached_tokens: 0,
            episode: Some(stats),
        }
    }
}

/// How an engine's side renders observations: made once per actor from an [`AgentSetup`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentSetup {
    /// The tokenizer, as `tokenizer.json` text.
    pub tokenizer_json: String,
    /// The chat template (source, BOS text, EOS text), when the job renders prompts with one.
    pub chat: Option<(String, String, String)>,
    /// The model's context, in tokens: a turn never asks for more.
    pub max_context: usize,
}

/// An [`AgentSetup`] made ready: the tokenizer and template loaded.
pub struct Agent {
    pub(crate) tokenizer: Tokenizer,
    pub(crate) chat: Option<ChatTemplate>,
    pub(crate) max_context: usize,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("max_context", &self.max_context)
            .finish()
    }
}

impl Agent {
    /// Loads `setup`.
    pub fn new(setup: &AgentSetup) -> Result<Self, String> {
        let tokenizer = Tokenizer::from_json(&setup.tokenizer_json, Path::new("agent tokenizer"))
            .map_err(|e| e.to_string())?;
        let chat = match &setup.chat {
            Some((source, bos, eos)) => {
                Some(ChatTemplate::new(source, bos, eos).map_err(|e| e.to_string())?)
            }
            None => None,
        };
        Ok(Self {
            tokenizer,
            chat,
            max_context: setup.max_context,
        })
    }

    /// The extra stop tokens of a turn in `format` (the compact format's `</call>`).
    fn stops(&self, format: ToolFormat) -> Result<Vec<u32>, String> {
        Ok(match format {
            ToolFormat::Compact => vec![compact_token(&self.tokenizer, CALL_END)?],
            ToolFormat::Hermes => Vec::new(),
        })
    }

    /// Token ids of `obs`, as they follow a model turn of `spec`'s episode (`ended`: the turn
    /// ended with a stop token, not cut at its budget).
    fn observe(
        &self,
        spec: &EpisodeSpec,
        obs: &Observation,
        ended: bool,
    ) -> Result<Vec<u32>, String> {
        let chat = match (spec.chat, &self.chat) {
            (true, Some(t)) => Some(t),
            (true, None) => return Err("a chat episode, and the agent has no chat template".into()),
            (false, _) => None,
        };
        let text = match (chat, obs) {
            (Some(t), Observation::Tool(c) | Observation::Reply(c)) => {
                let role = if matches!(obs, Observation::Tool(_)) {
                    "tool"
                } else {
                    "user"
                };
                let message = Message {
                    role: role.into(),
                    content: c.clone(),
                };
                return self.continue_chat(t, &[message], spec.env.tools().as_ref(), ended);
            }
            (None, Observation::Tool(c)) => match spec.format {
                ToolFormat::Compact => format!("{}{c}{}", RESULT.0, RESULT.1),
                ToolFormat::Hermes => format!("<tool_response>\n{c}\n</tool_response>\n"),
            },
            (None, Observation::Reply(c)) => c.clone(),
        };
        self.tokenizer
            .encode_rendered(&text)
            .map_err(|e| e.to_string())
    }
}

impl Agent {
    /// Token ids of `messages` as `template` renders them after a model turn (with the
    /// conversation's `tools`): its continuation, opened with the template's end of turn when
    /// the turn did not end (`ended`: it stopped at a stop token, not cut at its budget).
    pub(crate) fn continue_chat(
        &self,
        template: &ChatTemplate,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        ended: bool,
    ) -> Result<Vec<u32>, String> {
        let (eos, rest) = template
            .continuation(messages, tools)
            .map_err(|e| e.to_string())?;
        // A turn cut short never wrote its end of turn: the template's closes it.
        let text = if ended { rest } else { format!("{eos}{rest}") };
        self.tokenizer
            .encode_rendered(&text)
            .map_err(|e| e.to_string())
    }
}

/// The id of a compact-format token in `tokenizer`, or why it cannot write that format.
pub fn compact_token(tokenizer: &Tokenizer, token: &str) -> Result<u32, String> {
    tokenizer.token_id(token).ok_or_else(|| {
        format!("the tokenizer has no {token} token, which the compact tool format needs (use builtin:tools)")
    })
}

/// One episode under way.
struct Episode {
    request: usize,
    index: usize,
    spec: EpisodeSpec,
    env: Option<Box<dyn Environment>>,
    /// The sampling of later turns (one sample, its own seed).
    params: crate::SamplingParams,
    traj: Trajectory,
    /// The last turn's tokens (in the response).
    turn: Range<usize>,
    stats: EpisodeStats,
    over: bool,
}

impl Episode {
    /// Appends a model turn.
    fn take_turn(&mut self, c: Completion) {
        if self.stats.turns > 0 {
            self.stats
                .count_prefill(self.traj.context.len(), c.cached_tokens);
        }
        self.turn = self.traj.push_turn(&c);
        self.stats.turns += 1;
    }

    /// Tokens the next turn may sample after `extra` more tokens (0: none, the episode is out
    /// of room).
    fn room(&self, max_context: usize, extra: usize) -> usize {
        let budget = self
            .spec
            .limits
            .max_tokens
            .saturating_sub(self.traj.response_len() + extra);
        let context = max_context.saturating_sub(self.traj.context.len() + extra);
        self.params.max_tokens.min(budget).min(context)
    }

    fn fail(&mut self, e: &EnvError) {
        tracing::warn!(
            request = self.request,
            sample = self.index,
            "{e}: the episode ends"
        );
        self.stats.fail(e);
        self.over = true;
    }

    fn into_completion(self) -> Completion {
        self.traj
            .into_completion(self.request, self.index, self.stats, false)
    }
}

/// A turn's request: the context so far, one sample, the turn's stops and room.
fn turn_request(prompt: Vec<u32>, base: &crate::SamplingParams, room: usize) -> GenerateRequest {
    let mut params = base.clone();
    params.max_tokens = room;
    GenerateRequest::new(prompt, params)
}

/// A later turn's seed: the request's, the sample and the turn mixed (a pure function, so an
/// episode replays exactly).
pub(crate) fn turn_seed(seed: Option<u64>, index: usize, turn: usize) -> Option<u64> {
    seed.map(|s| {
        let mut z = s ^ ((index as u64) << 32) ^ (turn as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z ^ (z >> 31)
    })
}

/// Completions of `reqs` from `engine`, ordered by request, then sample: requests without an
/// episode are generated as they are; each sample of a request with one is an episode, played
/// turn by turn against its environment (every live episode's turn in one engine call), or by
/// its agent program through the gateway ([`gateway`]; an episode may then have several
/// trajectories, each a completion).
pub async fn generate(
    engine: &dyn InferenceEngine,
    agent: Option<&Agent>,
    reqs: Vec<GenerateRequest>,
) -> Result<Vec<Completion>, EngineError> {
    let program =
        |r: &GenerateRequest| matches!(r.episode.as_ref().map(|e| &e.env), Some(EnvSpec::Agent(_)));
    let Some(first) = reqs.iter().position(program) else {
        return play_turns(engine, agent, reqs).await;
    };
    let agent = agent.ok_or_else(|| EngineError::InvalidRequest {
        request: first,
        msg:
            "an agent program's episode, and this engine's actor was started without an agent setup"
                .into(),
    })?;
    let (programs, rest): (Vec<usize>, Vec<usize>) =
        (0..reqs.len()).partition(|&i| program(&reqs[i]));
    let pick = |idx: &[usize]| idx.iter().map(|&i| reqs[i].clone()).collect::<Vec<_>>();
    let mut out = Vec::with_capacity(reqs.len());
    if !rest.is_empty() {
        for mut c in play_turns(engine, Some(agent), pick(&rest)).await? {
            c.request = rest[c.request];
            out.push(c);
        }
    }
    for mut c in gateway::play(engine, agent, pick(&programs)).await? {
        c.request = programs[c.request];
        out.push(c);
    }
    out.sort_by_key(|c| (c.request, c.index));
    Ok(out)
}

/// [`generate`] of requests none of whose episodes is an agent program's.
async fn play_turns(
    engine: &dyn InferenceEngine,
    agent: Option<&Agent>,
    reqs: Vec<GenerateRequest>,
) -> Result<Vec<Completion>, EngineError> {
    let Some(first) = reqs.iter().position(|r| r.episode.is_some()) else {
        return engine.generate(reqs).await;
    };
    let agent = agent.ok_or_else(|| EngineError::InvalidRequest {
        request: first,
        msg: "an episode, and this engine's actor was started without an agent setup".into(),
    })?;
    // Each episode's sampling: one sample a turn, stopping at the format's end of a call.
    let mut bases = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        let mut base = r.params.clone();
        if let Some(e) = &r.episode {
            let stops = agent
                .stops(e.format)
                .map_err(|msg| EngineError::InvalidRequest { request: i, msg })?;
            base.stop_token_ids.extend(stops);
        }
        bases.push(base);
    }
    // The first turn of every episode, with the plain requests, in one call.
    let first_turns: Vec<GenerateRequest> = reqs
        .iter()
        .zip(&bases)
        .map(|(r, base)| match &r.episode {
            None => r.clone(),
            Some(e) => {
                let room = r.params.max_tokens.min(e.limits.max_tokens);
                turn_request(r.prompt.clone(), base, room)
            }
        })
        .collect();
    let mut done = Vec::new();
    let mut live = Vec::new();
    for c in engine.generate(first_turns).await? {
        let r = &reqs[c.request];
        let Some(spec) = &r.episode else {
            done.push(c);
            continue;
        };
        let mut params = bases[c.request].clone();
        params.n = 1;
        let mut e = Episode {
            request: c.request,
            index: c.index,
            spec: spec.clone(),
            env: None,
            params,
            traj: Trajectory::new(r.prompt.clone()),
            turn: 0..0,
            stats: EpisodeStats::default(),
            over: false,
        };
        e.take_turn(c);
        live.push(e);
    }
    loop {
        // Every live episode's last turn to its environment, at once.
        let steps = futures_util::future::join_all(
            live.iter_mut().filter(|e| !e.over).map(|e| step(agent, e)),
        );
        steps.await;
        let next: Vec<usize> = (0..live.len()).filter(|&i| !live[i].over).collect();
        if next.is_empty() {
            break;
        }
        let turns: Vec<GenerateRequest> = next
            .iter()
            .map(|&i| {
                let e = &mut live[i];
                let mut base = e.params.clone();
                base.seed = turn_seed(e.params.seed, e.index, e.stats.turns);
                turn_request(e.traj.context.clone(), &base, e.room(agent.max_context, 0))
            })
            .collect();
        for c in engine.generate(turns).await? {
            live[next[c.request]].take_turn(c);
        }
    }
    done.extend(live.into_iter().map(Episode::into_completion));
    done.sort_by_key(|c| (c.request, c.index));
    Ok(done)
}

/// Steps `e`'s environment with its last turn and appends what it says, or ends the episode
/// (done, out of turns or room, or a failure).
async fn step(agent: &Agent, e: &mut Episode) {
    let text = match agent.tokenizer.decode(e.traj.response(&e.turn)) {
        Ok(t) => t,
        Err(err) => {
            e.fail(&EnvError {
                env: e.spec.env.name().into(),
                msg: format!("cannot decode the turn: {err}"),
            });
            return;
        }
    };
    let timeout = e.spec.limits.step_timeout();
    // The environment is made and reset with the first step, on the blocking pool like every
    // step (a program's start runs beside the others').
    let (mut env, problem) = match e.env.take() {
        Some(env) => (env, None),
        None => match env::make(&e.spec.env, e.spec.format, timeout) {
            Ok(env) => (
                env,
                Some(Problem::new(e.spec.prompt.clone(), e.spec.answer.clone())),
            ),
            Err(err) => {
                e.fail(&err);
                return;
            }
        },
    };
    let name = e.spec.env.name().to_string();
    let run = tokio::task::spawn_blocking(move || {
        let s = match &problem {
            Some(p) => env.reset(p).and_then(|()| env.step(&text)),
            None => env.step(&text),
        };
        (env, s)
    });
    // A program enforces the timeout on its own answers; this bounds a built-in's step (and a
    // program's start).
    let bound = timeout * 2 + Duration::from_secs(5);
    let outcome = match tokio::time::timeout(bound, run).await {
        Err(_) => Err(format!("a step took over {:.1} s", bound.as_secs_f64())),
        Ok(Err(join)) => Err(format!("a step panicked: {join}")),
        Ok(Ok((env, s))) => {
            e.env = Some(env);
            s.map_err(|err| err.msg)
        }
    };
    let s = match outcome {
        Ok(s) => s,
        Err(msg) => {
            e.fail(&EnvError {
                env: name.clone(),
                msg,
            });
            return;
        }
    };
    e.stats.reward += s.reward;
    if s.reward != 0.0 {
        e.stats
            .turn_rewards
            .push((e.turn.end.saturating_sub(1), s.reward));
    }
    match s.tool {
        ToolUse::None => {}
        ToolUse::Ok => e.stats.tool_calls += 1,
        ToolUse::Error => {
            e.stats.tool_calls += 1;
            e.stats.tool_errors += 1;
        }
    }
    let Some(obs) = s.observation.filter(|_| !s.done) else {
        e.over = true;
        return;
    };
    if e.stats.turns >= e.spec.limits.max_turns {
        e.over = true;
        return;
    }
    let ended = e.traj.finish == FinishReason::Stop;
    let tokens = match agent.observe(&e.spec, &obs, ended) {
        Ok(t) => t,
        Err(msg) => {
            e.fail(&EnvError {
                env: name.clone(),
                msg,
            });
            return;
        }
    };
    if e.room(agent.max_context, tokens.len()) == 0 {
        // No room for another turn after the observation: the episode ends where the model
        // stopped, cut short.
        e.traj.finish = FinishReason::Length;
        e.over = true;
        return;
    }
    e.traj.push_observation(&tokens);
}
