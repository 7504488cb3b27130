//! `generate`: `rollout_n` responses per prompt from the rollout engines. In `sync` mode, one
//! batch of prompts (DAPO's dynamic sampling draws more until enough groups carry signal); in
//! `async` mode, generations run up to `max_staleness` steps ahead on their own threads and a
//! step takes its own, dropping or regenerating groups whose tokens lag too many versions.

use super::{Act, Board, ExecError, StepCx, Update};
use crate::exec::board::{Group, OldLogp, Pending, Write, score};
use crate::plan::Mode;
use crate::plan::schema::Stale;
use learner::rl::Metrics;
use learner::rl::dapo::keep_informative_groups;
use rollout::reward::Item;
use rollout::task::Problem;
use rollout::{Completion, GenerateRequest, SamplingParams};
use std::collections::HashSet;

pub(crate) struct Generate;

impl Act for Generate {
    fn act(&self, cx: &mut StepCx<'_, '_>, _board: &Board) -> Result<Update, ExecError> {
        let mut metrics = Metrics::new();
        let groups = match cx.rl.mode {
            Mode::Async {
                max_staleness,
                stale,
            } => ahead(cx, max_staleness, stale, &mut metrics)?,
            Mode::Sync => now(cx, &mut metrics)?,
        };
        let old = cx.rl.engine_logp.then_some(OldLogp::FromRollouts);
        Ok(Update {
            writes: vec![Write::Rollouts(groups, old)],
            metrics,
        })
    }
}

/// Generation rounds a step may take: DAPO's dynamic sampling draws up to
/// `max_num_gen_batches` batches of prompts, otherwise one.
fn rounds(cx: &StepCx<'_, '_>) -> usize {
    cx.rl.dynamic_sampling.unwrap_or(1).max(1)
}

/// Problems, each with its position in the stage's stream of prompts.
type Indexed = Vec<(u64, Problem)>;

/// The problems of `step` (round `round` of dynamic sampling) and their requests.
fn draw(
    cx: &StepCx<'_, '_>,
    step: u64,
    round: usize,
) -> Result<(Indexed, Vec<GenerateRequest>), ExecError> {
    let b = cx.rl.prompts_per_step;
    let data = &cx.stage.data;
    let start = ((step - 1) * rounds(cx) as u64 + round as u64) * b as u64;
    let problems = data
        .source
        .train_batch(cx.seed ^ 0xA11CE, start, b, &data.exclude);
    let s = cx.rl.sampling;
    let mut reqs = Vec::with_capacity(problems.len());
    for (i, p) in problems.iter().enumerate() {
        let seed =
            cx.seed.wrapping_mul(1_000_003) ^ (step << 20) ^ ((round as u64) << 40) ^ i as u64;
        let params = SamplingParams {
            n: s.n,
            temperature: s.temperature,
            top_p: s.top_p,
            max_tokens: s.max_tokens,
            seed: Some(seed),
            ..Default::default()
        };
        reqs.push(cx.stage.request(cx.prompts, p, params)?);
    }
    let indexed = (start..).zip(problems).collect();
    Ok((indexed, reqs))
}

/// The groups of `out`, the completions of `reqs` for `problems` (with their positions).
fn groups_of(
    cx: &StepCx<'_, '_>,
    problems: Indexed,
    reqs: &[GenerateRequest],
    out: Vec<Completion>,
) -> Result<Vec<Group>, ExecError> {
    let mut groups: Vec<Group> = problems
        .into_iter()
        .zip(reqs)
        .map(|((index, problem), r)| Group {
            index,
            problem,
            prompt: r.prompt.clone(),
            completions: Vec::new(),
            texts: Vec::new(),
            scores: Vec::new(),
        })
        .collect();
    for c in out {
        let g = &mut groups[c.request];
        g.texts.push(cx.prompts.decode(&c.token_ids)?);
        g.completions.push(c);
    }
    Ok(groups)
}

/// Whole mini-batches only (batch sizes are counted in prompts).
fn whole_mini_batches(cx: &StepCx<'_, '_>, groups: &mut Vec<Group>) {
    let per = cx.rl.prompts_per_update;
    groups.truncate(groups.len() / per * per);
}

/// `sync` mode: generate now (DAPO's dynamic sampling: keep drawing prompts until a step's
/// worth of groups carry signal — scores not all equal — or the rounds are spent).
fn now(cx: &StepCx<'_, '_>, m: &mut Metrics) -> Result<Vec<Group>, ExecError> {
    let b = cx.rl.prompts_per_step;
    let filter = cx.rl.dynamic_sampling.is_some();
    let mut kept = Vec::new();
    let mut generated = 0usize;
    let mut rounds_run = 0usize;
    for round in 0..rounds(cx) {
        rounds_run += 1;
        let (problems, reqs) = draw(cx, cx.step, round)?;
        let out = cx.rollouts.generate(reqs.clone())?;
        for g in groups_of(cx, problems, &reqs, out)? {
            generated += 1;
            let keep = !filter || {
                let items: Vec<Item<'_>> =
                    g.texts.iter().map(|t| Item::new(t, &g.problem)).collect();
                let s = score(cx.stage, &g.completions, &items)?.scores;
                keep_informative_groups(&vec![0; s.len()], &s)[0]
            };
            if keep {
                kept.push(g);
            }
        }
        if kept.len() >= b {
            break;
        }
    }
    kept.truncate(b);
    whole_mini_batches(cx, &mut kept);
    episode_metrics(cx, &kept, m);
    if filter {
        m.insert("dapo/kept_groups".into(), kept.len() as f64);
        m.insert("dapo/generated_groups".into(), generated as f64);
        m.insert("dapo/gen_rounds".into(), rounds_run as f64);
    }
    Ok(kept)
}

/// Starts the generation of `step` on a thread of its own.
fn launch(cx: &StepCx<'_, '_>, step: u64) -> Result<Pending, ExecError> {
    let (problems, reqs) = draw(cx, step, 0)?;
    let rollouts = cx.rollouts.clone();
    let r = reqs.clone();
    let handle = std::thread::Builder::new()
        .name(format!("generate-{step}"))
        .spawn(move || rollouts.generate(r))
        .map_err(|e| ExecError::Internal(format!("cannot start a generation thread: {e}")))?;
    Ok(Pending {
        step,
        problems,
        reqs,
        handle,
    })
}

/// `async` mode: keep generation `max_staleness` steps ahead of training, and take this step's.
fn ahead(
    cx: &mut StepCx<'_, '_>,
    max_staleness: u64,
    stale_policy: Stale,
    m: &mut Metrics,
) -> Result<Vec<Group>, ExecError> {
    let step = cx.step;
    let last = (step + max_staleness).min(cx.stage.steps);
    let mut next = cx.queue.back().map_or(step, |p| p.step + 1);
    while next <= last {
        let p = launch(cx, next)?;
        cx.queue.push_back(p);
        next += 1;
    }
    let p = cx
        .queue
        .pop_front()
        .filter(|p| p.step == step)
        .ok_or_else(|| ExecError::Internal(format!("async queue lost step {step}")))?;
    let out = p
        .handle
        .join()
        .map_err(|_| ExecError::Internal("a generation thread panicked".into()))??;
    let mut groups = groups_of(cx, p.problems, &p.reqs, out)?;
    // Staleness: weight versions between the oldest token of a group and the learner.
    let version = *cx.version;
    let mut stale = Vec::new();
    let mut lag_sum = 0u64;
    let mut lag_max = 0u64;
    for (i, g) in groups.iter().enumerate() {
        let oldest = g
            .completions
            .iter()
            .flat_map(|c| c.weight_versions.iter().map(|s| s.version))
            .min()
            .unwrap_or(version);
        let lag = version.saturating_sub(oldest);
        lag_sum += lag;
        lag_max = lag_max.max(lag);
        if lag > max_staleness {
            stale.push(i);
        }
    }
    m.insert(
        "async/staleness_mean".into(),
        lag_sum as f64 / groups.len().max(1) as f64,
    );
    m.insert("async/staleness_max".into(), lag_max as f64);
    m.insert("async/stale_groups".into(), stale.len() as f64);
    if !stale.is_empty() {
        match stale_policy {
            Stale::Wait => {
                // Generate those prompts again, on the current weights.
                let reqs: Vec<GenerateRequest> = stale.iter().map(|&i| p.reqs[i].clone()).collect();
                let probs: Indexed = stale
                    .iter()
                    .map(|&i| (groups[i].index, groups[i].problem.clone()))
                    .collect();
                let out = cx.rollouts.generate(reqs.clone())?;
                for (k, g) in groups_of(cx, probs, &reqs, out)?.into_iter().enumerate() {
                    groups[stale[k]] = g;
                }
            }
            Stale::Drop => {
                let drop: HashSet<usize> = stale.into_iter().collect();
                groups = groups
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| !drop.contains(i))
                    .map(|(_, g)| g)
                    .collect();
            }
        }
    }
    whole_mini_batches(cx, &mut groups);
    episode_metrics(cx, &groups, m);
    Ok(groups)
}

/// What the step's episodes did (a stage with an environment): turns, tool calls and their
/// errors, tokens (the model's and the environment's), the environment's failures, and for
/// turns after the first the tokens prefilled and those the engines' prefix caches held.
fn episode_metrics(cx: &StepCx<'_, '_>, groups: &[Group], m: &mut Metrics) {
    let Some(env) = &cx.stage.data.env else {
        return;
    };
    let all: Vec<(&Completion, &rollout::episode::EpisodeStats)> = groups
        .iter()
        .flat_map(|g| g.completions.iter())
        .filter_map(|c| c.episode.as_ref().map(|e| (c, e)))
        .collect();
    // Tokens are per trajectory (a trained row each); the rest per episode, counted once (its
    // first trajectory: an agent program's forks share its stats).
    let forks = all.iter().filter(|(_, e)| e.fork > 0).count();
    let rows = all.len().max(1) as f64;
    let per_row = |f: &dyn Fn(&Completion) -> usize| {
        all.iter().map(|(c, _)| f(c)).sum::<usize>() as f64 / rows
    };
    m.insert(
        "episode/tokens/mean".into(),
        per_row(&|c| c.token_ids.len()),
    );
    m.insert(
        "episode/observation_tokens/mean".into(),
        per_row(&|c| c.observations.iter().map(|r| r.len()).sum()),
    );
    let stats: Vec<_> = all.iter().filter(|(_, e)| e.fork == 0).copied().collect();
    if matches!(env.spec, rollout::env::EnvSpec::Agent(_)) {
        m.insert("episode/forks".into(), forks as f64);
    }
    let n = stats.len().max(1) as f64;
    let mean = |f: &dyn Fn(&(&Completion, &rollout::episode::EpisodeStats)) -> usize| {
        stats.iter().map(f).sum::<usize>() as f64 / n
    };
    m.insert("episode/turns/mean".into(), mean(&|(_, e)| e.turns));
    m.insert(
        "episode/tool_calls/mean".into(),
        mean(&|(_, e)| e.tool_calls),
    );
    m.insert(
        "episode/tool_errors".into(),
        stats.iter().map(|(_, e)| e.tool_errors).sum::<usize>() as f64,
    );
    m.insert(
        "episode/prefill_tokens".into(),
        stats.iter().map(|(_, e)| e.prefill_tokens).sum::<usize>() as f64,
    );
    m.insert(
        "episode/cached_tokens".into(),
        stats.iter().map(|(_, e)| e.cached_tokens).sum::<usize>() as f64,
    );
    m.insert(
        format!("env/{}/failed", env.spec.name()),
        stats.iter().filter(|(_, e)| e.failed.is_some()).count() as f64,
    );
}
