//! Running requests on the engine: the pause gate, the counters, and text generation with stop
//! strings, given out piece by piece to a stream when there is one.
//!
//! Owns: when a generation may start and what it counts. Never: HTTP shapes (the routes do).

use crate::text::{SampleText, Stops};
use crate::{HttpError, Shared, State, bad};
use axum::http::StatusCode;
use rollout::{
    Completion, EngineError, FinishReason, GenerateRequest, InferenceEngine, SamplingParams,
};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use tokio::sync::OwnedRwLockReadGuard;
use tokio::sync::mpsc::UnboundedSender;

fn engine_error(e: EngineError) -> HttpError {
    match e {
        EngineError::InvalidRequest { msg, .. } => bad(msg),
        e => HttpError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

impl State {
    /// Waits while paused; the guard holds a pause off until it is dropped.
    async fn admit(&self, reqs: &[GenerateRequest]) -> OwnedRwLockReadGuard<()> {
        let mut paused = self.paused.subscribe();
        let guard = loop {
            let _ = paused.wait_for(|p| !*p).await;
            let g = std::sync::Arc::clone(&self.inflight).read_owned().await;
            // A pause that came in between: wait for its resume.
            if !*self.paused.borrow() {
                break g;
            }
        };
        self.requests
            .fetch_add(reqs.len() as u64, Ordering::Relaxed);
        let prompt: usize = reqs.iter().map(|r| r.prompt.len()).sum();
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        guard
    }

    fn count_generated(&self, out: &[Completion]) {
        let generated: usize = out.iter().map(|c| c.token_ids.len()).sum();
        self.generation_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// Runs token requests on the engine, waiting while paused.
    pub(crate) async fn run(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Completion>, HttpError> {
        let guard = self.admit(&reqs).await;
        let out = self.engine.generate(reqs).await;
        drop(guard);
        let out = out.map_err(engine_error)?;
        self.count_generated(&out);
        Ok(out)
    }

    /// Decoded text of `ids`.
    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(ids).ok())
            .unwrap_or_default()
    }
}

/// Prompts and settings of a text generation.
pub(crate) struct TextJob {
    pub prompts: Vec<Vec<u32>>,
    pub params: SamplingParams,
    pub stops: Stops,
}

/// A finished sample of a text generation.
pub(crate) struct Sample {
    pub request: usize,
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// `stop` (end of sequence, stop token or stop string) or `length`.
    pub finish: &'static str,
}

/// What a streaming text generation sends as it goes.
pub(crate) enum Event {
    /// New text of a sample, with the tokens (and their log-probs) it covers.
    Text {
        request: usize,
        index: usize,
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<f32>,
    },
    /// Every sample, once all have finished.
    Done(Vec<Sample>),
    /// The generation failed.
    Failed(HttpError),
}

/// Checks `job` as the engine would, so that a bad request is refused before a stream starts.
pub(crate) fn check(state: &State, job: &TextJob) -> Result<(), HttpError> {
    if state.tokenizer.is_none() {
        return Err(bad(
            "this model has no tokenizer.json: text routes need one (/inference/v1/generate takes token ids)",
        ));
    }
    state.engine.check(&requests(job)).map_err(engine_error)
}

fn requests(job: &TextJob) -> Vec<GenerateRequest> {
    job.prompts
        .iter()
        .map(|p| GenerateRequest {
            prompt: p.clone(),
            params: job.params.clone(),
            episode: None,
        })
        .collect()
}

/// Generates `job` as text: each sample's text ends at its first stop string, and the engine
/// stops that sample there.
pub(crate) async fn text(state: &State, job: &TextJob) -> Result<Vec<Sample>, HttpError> {
    run_text(state, job, None).await
}

/// As [`text`], sending every piece of text as it comes, then the samples (or the failure); a
/// closed `events` (the client went away) stops every sample.
pub(crate) async fn stream_text(state: Shared, job: TextJob, events: UnboundedSender<Event>) {
    let last = match run_text(&state, &job, Some(&events)).await {
        Ok(samples) => Event::Done(samples),
        Err(e) => Event::Failed(e),
    };
    let _ = events.send(last);
}

/// A sample's text, and its tokens and log-probs so far.
struct Growing {
    text: SampleText,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
}

async fn run_text(
    state: &State,
    job: &TextJob,
    events: Option<&UnboundedSender<Event>>,
) -> Result<Vec<Sample>, HttpError> {
    let tok = state
        .tokenizer
        .as_ref()
        .ok_or_else(|| bad("this model has no tokenizer.json"))?;
    let reqs = requests(job);
    let guard = state.admit(&reqs).await;
    let (mut stream, done) = state.engine.generate_stream(reqs).map_err(engine_error)?;
    let mut samples: HashMap<(usize, usize), Growing> = HashMap::new();
    let grow = |request: usize| Growing {
        text: SampleText::new(&job.prompts[request]),
        ids: Vec::new(),
        logprobs: Vec::new(),
    };
    let send = |request, index, g: &Growing, piece: crate::text::Piece| {
        events.is_none_or(|tx| {
            (piece.text.is_empty() && piece.tokens.is_empty())
                || tx
                    .send(Event::Text {
                        request,
                        index,
                        text: piece.text,
                        token_ids: g.ids[piece.tokens.clone()].to_vec(),
                        logprobs: g.logprobs[piece.tokens].to_vec(),
                    })
                    .is_ok()
        })
    };
    let mut gone = false;
    while let Some(t) = stream.next().await {
        let g = samples
            .entry((t.request, t.index))
            .or_insert_with(|| grow(t.request));
        if g.text.stopped().is_some() {
            continue;
        }
        g.ids.push(t.token);
        g.logprobs.push(t.logprob);
        let piece = g.text.push(tok, t.token, &job.stops);
        if g.text.stopped().is_some() {
            stream.stop(t.request, t.index);
        }
        if !send(t.request, t.index, g, piece) {
            gone = true;
            break;
        }
    }
    drop(stream);
    let out = done.await;
    drop(guard);
    let out = out.map_err(engine_error)?;
    state.count_generated(&out);
    if gone {
        return Err(bad("the client went away"));
    }
    let mut finished = Vec::with_capacity(out.len());
    for c in out {
        let g = samples
            .entry((c.request, c.index))
            .or_insert_with(|| grow(c.request));
        let rest = g.text.finish(tok, &job.stops);
        send(c.request, c.index, g, rest);
        let (keep, finish) = match (g.text.stopped(), c.finish_reason) {
            (Some(n), _) => (n, "stop"),
            (None, FinishReason::Stop) => (c.token_ids.len(), "stop"),
            (None, FinishReason::Length) => (c.token_ids.len(), "length"),
        };
        let keep = keep.min(c.token_ids.len());
        finished.push(Sample {
            request: c.request,
            index: c.index,
            text: g.text.text().to_string(),
            token_ids: c.token_ids[..keep].to_vec(),
            logprobs: c.logprobs[..keep].to_vec(),
            finish,
        });
    }
    Ok(finished)
}
