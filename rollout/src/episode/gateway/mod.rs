//! The agent gateway: RL through an agent program of one's own, unmodified. For every episode
//! the program is started with an OpenAI base URL of its own session (`OPENAI_BASE_URL`, which
//! the `openai` package and most agent frameworks read); it runs its own loop against it with
//! any client — `POST /v1/chat/completions` with `tools`, streamed or not — and ends by printing
//! its reward as its last line of output (unless the stage's reward scores the transcript).
//!
//! Every call is served by the engine beside the gateway, in the run's sampling, and recorded
//! token-faithfully ([`session`]): the model's tokens exactly as sampled, with their log-probs
//! and weight versions; the program's new messages rendered by the chat template after the
//! model's turn, as observations; a rewritten history forks a new trajectory. The calls of all
//! live sessions go to the engine together, as the turns of built-in episodes do.
//!
//! What the program gets: `OPENAI_BASE_URL` (`http://127.0.0.1:PORT/s/SESSION/v1`, also as
//! `TRELLIS_GATEWAY_URL`), `OPENAI_API_KEY` (any client wants one; the gateway reads none),
//! `TRELLIS_SESSION`, `TRELLIS_PROMPT` and `TRELLIS_ANSWER` (the problem), and the same as one
//! JSON line on its standard input (`{"prompt", "answer", "session", "base_url"}`).
//!
//! Limits: `max_turns` calls (later ones are answered with no text, `finish_reason: length`),
//! `max_tokens` after a trajectory's prompt (the same), the model's context (a 400), and
//! `step_timeout_s` of the program's own time between calls (and before the first and after
//! the last): over it, the program is killed and its episode fails — as it does when the
//! program exits non-zero or prints no reward it owes; never the step.
//!
//! Owns: the sessions, the programs' lives, and what an episode of one records. Never: decides
//! sampling (the run's settings apply, whatever the call asks) or scores on its own.

mod http;
mod session;

use crate::env::EnvError;
use crate::env::command::AgentProgram;
use crate::episode::{Agent, EpisodeSpec};
use crate::{Completion, EngineError, GenerateRequest, InferenceEngine};
use http::{Call, HttpError, Server};
use session::{Prepared, Reply, Session};
use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// What a program's output keeps at most, in bytes (the end of it).
const OUTPUT_CAP: usize = 64 << 10;

/// How a program ended.
struct Exit {
    session: usize,
    outcome: Result<(), String>,
    stdout: Vec<u8>,
}

/// One episode's program, under way.
struct Live {
    session: Session,
    spec: EpisodeSpec,
    /// Kills the program.
    kill: Option<oneshot::Sender<()>>,
    /// When the program's time since its last answer runs out (`None` while a call is with
    /// the engine, or once it ended).
    deadline: Option<Instant>,
    ended: bool,
}

/// The completions of `reqs` (each with an agent-program episode), every sample an episode
/// played by its own program through a gateway served for this call. Ordered by request, then
/// sample, then trajectory.
pub async fn play(
    engine: &dyn InferenceEngine,
    agent: &Agent,
    reqs: Vec<GenerateRequest>,
) -> Result<Vec<Completion>, EngineError> {
    let invalid = |request: usize, msg: String| EngineError::InvalidRequest { request, msg };
    if agent.chat.is_none() {
        return Err(invalid(
            0,
            "an agent program's calls are chat messages, and the agent setup has no chat template"
                .into(),
        ));
    }
    let (call_tx, mut calls) = mpsc::unbounded_channel::<Call>();
    let server = Server::start(call_tx)
        .await
        .map_err(|e| EngineError::Gateway(format!("cannot listen on a loopback port: {e}")))?;
    let (exit_tx, mut exits) = mpsc::unbounded_channel::<Exit>();
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id();
    let mut live: Vec<Live> = Vec::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    for (r, req) in reqs.iter().enumerate() {
        let Some(spec) = &req.episode else {
            return Err(invalid(r, "not an episode".into()));
        };
        let crate::env::EnvSpec::Agent(program) = &spec.env else {
            return Err(invalid(r, "not an agent program's episode".into()));
        };
        for i in 0..req.params.n {
            let id = format!("{nonce:x}-{r}-{i}");
            let n = live.len();
            let base = format!("http://{}/s/{id}/v1", server.addr);
            let kill = start(program, spec, &id, &base, n, exit_tx.clone());
            let timeout = spec.limits.step_timeout();
            ids.insert(id, n);
            live.push(Live {
                session: Session::new(r, i, spec.limits, &req.params),
                spec: spec.clone(),
                kill: Some(kill),
                deadline: Some(Instant::now() + timeout),
                ended: false,
            });
        }
    }
    drop(exit_tx);
    while live.iter().any(|l| !l.ended) {
        let next = live.iter().filter_map(|l| l.deadline).min();
        let far = Instant::now() + Duration::from_secs(3600);
        tokio::select! {
            Some(call) = calls.recv() => {
                let mut batch = vec![call];
                while let Ok(c) = calls.try_recv() {
                    batch.push(c);
                }
                // A session's calls are served one after another (concurrent ones from the
                // same history each fork after the first).
                while !batch.is_empty() {
                    let mut seen = std::collections::HashSet::new();
                    let (now, later): (Vec<Call>, Vec<Call>) =
                        batch.into_iter().partition(|c| seen.insert(c.session.clone()));
                    serve(engine, agent, &ids, &mut live, now).await?;
                    batch = later;
                }
            }
            Some(exit) = exits.recv() => {
                let l = &mut live[exit.session];
                l.ended = true;
                l.deadline = None;
                l.kill = None;
                finish(l, exit);
            }
            () = tokio::time::sleep_until(next.unwrap_or(far)) => {
                let now = Instant::now();
                for l in live.iter_mut().filter(|l| l.deadline.is_some_and(|d| d <= now)) {
                    l.deadline = None;
                    let secs = l.spec.limits.step_timeout().as_secs_f64();
                    l.session.stats.fail(&EnvError {
                        env: l.spec.env.name().into(),
                        msg: format!("the agent program neither called nor ended within {secs:.1} s"),
                    });
                    if let Some(k) = l.kill.take() {
                        let _ = k.send(());
                    }
                }
            }
        }
    }
    drop(server);
    let mut out: Vec<Completion> = live
        .into_iter()
        .flat_map(|l| l.session.into_completions())
        .collect();
    out.sort_by_key(|c| (c.request, c.index));
    Ok(out)
}

/// Records how `l`'s program ended: its reward, or why its episode failed (a kill for time
/// already said why).
fn finish(l: &mut Live, exit: Exit) {
    let crate::env::EnvSpec::Agent(program) = &l.spec.env else {
        return;
    };
    let stats = &mut l.session.stats;
    let failed = match (exit.outcome, program.printed_reward) {
        (Err(why), _) => Some(why),
        (Ok(()), false) => None,
        (Ok(()), true) => match reward_of(&exit.stdout) {
            Ok(r) => {
                stats.reward = r;
                None
            }
            Err(why) => Some(why),
        },
    };
    if let Some(msg) = failed {
        stats.fail(&EnvError {
            env: l.spec.env.name().into(),
            msg,
        });
    }
    if let Some(why) = &stats.failed {
        tracing::warn!(
            request = l.session.request,
            sample = l.session.index,
            "{why}: the episode ends"
        );
    }
}

/// The reward a program printed: its last non-empty line, a number or `{"reward": R}`.
fn reward_of(stdout: &[u8]) -> Result<f32, String> {
    let text = String::from_utf8_lossy(stdout);
    let Some(line) = text.lines().map(str::trim).rfind(|l| !l.is_empty()) else {
        return Err("the agent program printed no reward (its last line of output)".into());
    };
    let value: Option<f64> = line.parse().ok().or_else(|| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("reward").and_then(serde_json::Value::as_f64))
    });
    match value {
        Some(v) if v.is_finite() => Ok(v as f32),
        _ => Err(format!(
            "the agent program's last line is no reward (a number or {{\"reward\": R}}): {:?}",
            line.chars().take(200).collect::<String>()
        )),
    }
}

/// Answers `batch`: every call that gets a turn goes to the engine in one request list.
async fn serve(
    engine: &dyn InferenceEngine,
    agent: &Agent,
    ids: &HashMap<String, usize>,
    live: &mut [Live],
    batch: Vec<Call>,
) -> Result<(), EngineError> {
    let mut work = Vec::new();
    for call in batch {
        let Some(&s) = ids.get(&call.session) else {
            let _ = call.reply.send(Err(HttpError(
                axum::http::StatusCode::NOT_FOUND,
                format!("no session `{}` is playing", call.session),
            )));
            continue;
        };
        let l = &mut live[s];
        if l.ended || l.session.stats.failed.is_some() {
            let _ = call.reply.send(Err(HttpError(
                axum::http::StatusCode::GONE,
                "the episode is over".into(),
            )));
            continue;
        }
        let prepared = session::read_messages(&call.request.messages).and_then(|(turns, json)| {
            l.session.prepare(
                agent,
                turns,
                &json,
                call.request.tools.clone(),
                call.request.max_tokens,
            )
        });
        match prepared {
            Err(msg) => {
                let _ = call
                    .reply
                    .send(Err(HttpError(axum::http::StatusCode::BAD_REQUEST, msg)));
            }
            Ok(Prepared::Spent(why)) => {
                tracing::debug!(session = call.session, "{why}");
                let _ = call.reply.send(Ok(Reply::spent()));
            }
            Ok(Prepared::Turn(mut p)) => {
                p.logprobs = call.request.logprobs;
                l.deadline = None;
                work.push((s, p, call.reply));
            }
        }
    }
    if work.is_empty() {
        return Ok(());
    }
    let reqs: Vec<GenerateRequest> = work
        .iter()
        .map(|(s, p, _)| live[*s].session.request(p))
        .collect();
    let mut outs: Vec<Option<Completion>> = (0..work.len()).map(|_| None).collect();
    for c in engine.generate(reqs).await? {
        let k = c.request;
        outs[k] = Some(c);
    }
    for ((s, p, reply), c) in work.into_iter().zip(outs) {
        let l = &mut live[s];
        l.deadline = Some(Instant::now() + l.spec.limits.step_timeout());
        let answer = match c {
            None => Err("the engine gave no turn".to_string()),
            Some(c) => l.session.record(agent, p, c),
        };
        let _ = reply.send(
            answer.map_err(|msg| HttpError(axum::http::StatusCode::INTERNAL_SERVER_ERROR, msg)),
        );
    }
    Ok(())
}

/// Starts episode `session`'s program (id `id`, gateway `base`); how it ends goes to `exits`.
/// The returned sender kills it.
fn start(
    program: &AgentProgram,
    spec: &EpisodeSpec,
    id: &str,
    base: &str,
    session: usize,
    exits: mpsc::UnboundedSender<Exit>,
) -> oneshot::Sender<()> {
    let (kill, killed) = oneshot::channel();
    let c = &program.program;
    let line = serde_json::json!({"prompt": spec.prompt, "answer": spec.answer,
        "session": id, "base_url": base})
    .to_string()
        + "\n";
    let mut cmd = match c.argv.split_first() {
        Some((prog, args)) => {
            let mut cmd = std::process::Command::new(prog);
            cmd.args(args);
            cmd
        }
        None => {
            let _ = exits.send(Exit {
                session,
                outcome: Err("the command is empty".into()),
                stdout: Vec::new(),
            });
            return kill;
        }
    };
    cmd.env("OPENAI_BASE_URL", base)
        .env("TRELLIS_GATEWAY_URL", base)
        .env("OPENAI_API_KEY", format!("trellis-{id}"))
        .env("TRELLIS_SESSION", id)
        .env("TRELLIS_PROMPT", &spec.prompt)
        .env("TRELLIS_ANSWER", &spec.answer)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(dir) = &c.dir {
        cmd.current_dir(dir);
    }
    crate::reward::limit_address_space(&mut cmd, c.memory_bytes);
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    let name = c.argv.first().cloned().unwrap_or_default();
    tokio::spawn(async move {
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                let _ = exits.send(Exit {
                    session,
                    outcome: Err(format!("cannot start `{name}`: {e}")),
                    stdout: Vec::new(),
                });
                return;
            }
        };
        if let Some(mut stdin) = child.stdin.take() {
            // A program that never reads its standard input is fine.
            let _ = stdin.write_all(line.as_bytes()).await;
        }
        let stdout = child.stdout.take().map(|o| tokio::spawn(tail(o)));
        let stderr = child.stderr.take().map(|o| tokio::spawn(tail(o)));
        let outcome = tokio::select! {
            status = child.wait() => match status {
                Ok(s) if s.success() => Ok(()),
                Ok(s) => Err(format!("the agent program ended with {s}")),
                Err(e) => Err(format!("the agent program was lost: {e}")),
            },
            _ = killed => {
                let _ = child.kill().await;
                Err("the agent program was killed".into())
            }
        };
        // Output a lingering grandchild still holds open is not waited for long.
        let collect = |h: Option<tokio::task::JoinHandle<Vec<u8>>>| async move {
            match h {
                Some(h) => tokio::time::timeout(Duration::from_secs(2), h)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or_default(),
                None => Vec::new(),
            }
        };
        let stdout = collect(stdout).await;
        let stderr = collect(stderr).await;
        let outcome = outcome.map_err(|why| {
            let err = String::from_utf8_lossy(&stderr);
            let err = err.trim();
            if err.is_empty() {
                why
            } else {
                let start = err.len().saturating_sub(600);
                let start = (start..err.len())
                    .find(|&i| err.is_char_boundary(i))
                    .unwrap_or(err.len());
                format!("{why}; it wrote: {}", &err[start..])
            }
        });
        let _ = exits.send(Exit {
            session,
            outcome,
            stdout,
        });
    });
    kill
}

/// The last [`OUTPUT_CAP`] bytes `r` gives until it ends.
async fn tail(mut r: impl AsyncRead + Unpin) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return out,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if out.len() > OUTPUT_CAP {
                    out.drain(..out.len() - OUTPUT_CAP);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_programs_reward_is_its_last_line() {
        for (out, want) in [
            (&b"thinking\n0.5\n"[..], Ok(0.5)),
            (b"1\n\n  \n", Ok(1.0)),
            (b"{\"reward\": -2}", Ok(-2.0)),
        ] {
            assert_eq!(reward_of(out), want);
        }
        for (out, want) in [
            (&b""[..], "printed no reward"),
            (b"0.5\ndone", "last line is no reward"),
            (b"nan", "last line is no reward"),
        ] {
            let e = reward_of(out).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }
}
