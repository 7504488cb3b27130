//! From text to the resolved [`Workflow`]: YAML with `file:line:column` errors that name the
//! field, did-you-mean for misspelt names, hints for VeRL's names, `-o dotted.key=value`
//! overrides, paths made relative to the workflow file's folder, and a `model.path` given as a
//! Hugging Face Hub id found in the local Hub cache.
//!
//! Owns: reading the schema. Never: opens a file the workflow names (the plan does).

use super::PlanError;
use super::schema::Workflow;
use std::path::Path;

/// Parses `text` (the file `origin`) and applies `overrides` (`dotted.key=value`, the value in
/// YAML syntax).
pub(super) fn resolve(
    text: &str,
    origin: &str,
    overrides: &[String],
) -> Result<Workflow, PlanError> {
    let mut path = None;
    let parsed = serde_saphyr::with_deserializer_from_str(text, |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = Some(e.path().to_string());
            e.into_inner()
        })
    });
    let mut wf: Workflow = parsed.map_err(|e| located(origin, path.as_deref(), &e))?;
    if !overrides.is_empty() {
        let mut tree = serde_json::to_value(&wf)
            .map_err(|e| PlanError::new(origin, format!("cannot apply overrides: {e}")))?;
        for o in overrides {
            let (key, value) = o.split_once('=').ok_or_else(|| {
                PlanError::new(origin, format!("override `{o}`: expected dotted.key=value"))
            })?;
            let value: serde_json::Value = serde_saphyr::from_str(value).map_err(|e| {
                PlanError::field(origin, key, format!("override `{o}`: {}", first_line(&e)))
            })?;
            set_path(&mut tree, key, value)
                .map_err(|m| PlanError::field(origin, key, format!("override `{o}`: {m}")))?;
        }
        wf = serde_path_to_error::deserialize(tree).map_err(|e| {
            let path = e.path().to_string();
            let msg = e.inner().to_string();
            PlanError {
                field: field(&path, &msg),
                ..PlanError::new(
                    origin,
                    format!("{} (after overrides)", explain(&e.inner().to_string())),
                )
            }
        })?;
    }
    // Every path a workflow names (the model, its tokenizer file, weight folders, plugins,
    // datasets) is relative to the workflow file.
    if let Some(base) = Path::new(origin).parent() {
        // A Hub id (`Qwen/Qwen2.5-0.5B-Instruct`) that is not a folder beside the workflow is
        // the snapshot the Hub cache holds, as transformers' from_pretrained finds it.
        if let Some(p) = &mut wf.model.path
            && let Some(id) = p.to_str().filter(|s| learner::hub::is_repo_id(s))
            && !base.join(&*p).exists()
        {
            *p = learner::hub::find(id).ok_or_else(|| {
                PlanError::field(
                    origin,
                    "model.path",
                    format!(
                        "`{id}` is not a folder beside the workflow and is {}",
                        learner::hub::download_hint(id)
                    ),
                )
            })?;
        }
        for p in [
            &mut wf.model.path,
            &mut wf.pools.rollout.weights_dir,
            &mut wf.pools.rollout.plugin,
            &mut wf.pools.learner.plugin,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(t) = &mut wf.model.tokenizer
            && !t.starts_with("builtin:")
            && Path::new(t.as_str()).is_relative()
        {
            *t = base.join(t.as_str()).display().to_string();
        }
        for s in &mut wf.stages {
            if let Some(rollout::reward::Reward::Python { path, python, .. }) = &mut s.reward {
                if path.is_relative() {
                    *path = base.join(&*path);
                }
                // An interpreter named by a path (a venv's bin/python), not looked up on PATH.
                if python.is_relative() && python.components().count() > 1 {
                    *python = base.join(&*python);
                }
            }
            if let Some(d) = &mut s.data {
                for p in [&mut d.path, &mut d.eval_path]
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    if p.is_relative() {
                        *p = base.join(&*p);
                    }
                }
            }
        }
    }
    Ok(wf)
}

/// The field an error is about, from the path the deserializer had reached: the map that holds
/// an unknown field (whose own name the message gives), else the field itself; nothing at the
/// top level.
fn field(path: &str, msg: &str) -> Option<String> {
    let path = if msg.starts_with("unknown field") {
        path.rfind('.').map_or("", |i| &path[..i])
    } else {
        path
    };
    (!path.is_empty() && path != ".").then(|| path.to_string())
}

fn first_line(e: &serde_saphyr::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// A parse error with its location, the field it is in, and the parser's snippet.
fn located(origin: &str, path: Option<&str>, e: &serde_saphyr::Error) -> PlanError {
    let text = e.to_string();
    // serde-saphyr's message is `error: line L column C: MSG` then a source snippet.
    let mut lines = text.lines();
    let first = lines.next().unwrap_or_default();
    let msg = first
        .split_once(": ")
        .map_or(first, |(_, rest)| rest)
        .split_once(": ")
        .filter(|(head, _)| head.starts_with("line "))
        .map_or(first, |(_, m)| m);
    let snippet: Vec<String> = lines
        .map(|l| match l.find("^ ") {
            // The caret line repeats the message: keep the caret.
            Some(i) => l[..=i].to_string(),
            None => l.replace("<input>", origin),
        })
        .collect();
    PlanError {
        file: origin.to_string(),
        at: e
            .location()
            .map(|l| (l.line() as usize, l.column() as usize)),
        field: path.and_then(|p| field(p, msg)),
        message: explain(msg),
        snippet: (!snippet.is_empty()).then(|| snippet.join("\n")),
    }
}

/// VeRL's names for what is named otherwise here (its key, where VeRL has it, what to write
/// here), so that a VeRL user's first try gets the right name.
const VERL_NAMES: &[(&str, &str, &str)] = &[
    (
        "n",
        "actor_rollout_ref.rollout.n",
        "`rollout_n` in a stage's `algorithm`",
    ),
    (
        "test_freq",
        "trainer.test_freq",
        "`eval_freq` in a stage's `trainer`",
    ),
    (
        "log_val_generations",
        "trainer.log_val_generations",
        "`log_generations` in a stage's `trainer`",
    ),
    (
        "total_training_steps",
        "trainer.total_training_steps",
        "`steps` in a stage's `trainer`",
    ),
    (
        "max_actor_ckpt_to_keep",
        "trainer.max_actor_ckpt_to_keep",
        "`max_ckpt_to_keep` in a stage's `trainer`",
    ),
    (
        "warmup_style",
        "actor_rollout_ref.actor.optim.warmup_style",
        "`lr_schedule` in a stage's `algorithm` (or `sft`)",
    ),
    (
        "lr_warmup_steps_ratio",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "`lr_warmup_steps` (a count of optimiser steps) in a stage's `algorithm` (or `sft`)",
    ),
    (
        "response_length",
        "actor_rollout_ref.rollout.response_length",
        "`max_response_length` in a stage's `algorithm`",
    ),
    (
        "train_files",
        "data.train_files",
        "`path` in a stage's `data`",
    ),
    (
        "val_files",
        "data.val_files",
        "`eval_path` in a stage's `data`",
    ),
    (
        "kl_coef",
        "algorithm.kl_ctrl.kl_coef",
        "`kl_loss_coef` (with `use_kl_loss: true`) in a stage's `algorithm`",
    ),
    (
        "experiment_name",
        "trainer.experiment_name",
        "the top-level `name`",
    ),
    (
        "project_name",
        "trainer.project_name",
        "the top-level `name`",
    ),
    (
        "ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "nothing: a mini-batch trains as one batch (leave it out)",
    ),
    (
        "log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "nothing: log-probs are taken a mini-batch at a time (leave it out)",
    ),
    (
        "logger",
        "trainer.logger",
        "`tracking: {mlflow: {uri: ..., experiment: ...}}` at the top level, or `trellis-client wandb RUN_DIR` for wandb (every run also writes metrics.jsonl and TensorBoard events)",
    ),
    (
        "rollout_data_dir",
        "trainer.rollout_data_dir",
        "`log_rollouts: true` in a stage's `trainer` (RUN_DIR/rollouts/<stage>/step_<N>.jsonl)",
    ),
    (
        "adv_estimator_type",
        "algorithm.adv_estimator",
        "`adv_estimator` in a stage's `algorithm`",
    ),
];

/// Rewrites serde's `unknown field `x`, expected one of a, b, ...` (or `unknown variant`) with
/// what was meant: VeRL's name for it, else the closest valid name
/// (`unknown field `x` (did you mean `a`?); expected one of ...`).
fn explain(msg: &str) -> String {
    let Some((head, list)) = msg.split_once(", expected one of ") else {
        return msg.to_string();
    };
    let Some(bad) = head.rsplit('`').nth(1) else {
        return msg.to_string();
    };
    if head.starts_with("unknown field")
        && let Some((_, verl, here)) = VERL_NAMES.iter().find(|(k, _, _)| *k == bad)
    {
        return format!("{head}: VeRL's `{verl}` is {here}; expected one of {list}");
    }
    let valid: Vec<&str> = list
        .split(", ")
        .map(|v| v.trim_matches('`').trim_end_matches(['.', ' ']))
        .collect();
    let best = valid
        .iter()
        .map(|v| (edit_distance(bad, v), *v))
        .min()
        .filter(|(d, v)| *d <= (v.len().max(bad.len()) / 3).max(2));
    match best {
        Some((_, v)) => format!("{head} (did you mean `{v}`?); expected one of {list}"),
        None => msg.to_string(),
    }
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// Sets `key` (dots separate fields; a number selects a list item; a stage may also be named by
/// its id, as in `stages.rl.trainer.steps`; an unset field on the way becomes a map, as
/// `tracking.mlflow.uri=...` makes `tracking.mlflow`).
fn set_path(
    tree: &mut serde_json::Value,
    key: &str,
    value: serde_json::Value,
) -> Result<(), String> {
    let mut node = tree;
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        node = match node {
            serde_json::Value::Array(items) => {
                let idx = match part.parse::<usize>() {
                    Ok(n) => n,
                    Err(_) => items
                        .iter()
                        .position(|s| s.get("id").and_then(|v| v.as_str()) == Some(part))
                        .ok_or_else(|| format!("no item `{part}` in `{}`", parts[..i].join(".")))?,
                };
                let len = items.len();
                items
                    .get_mut(idx)
                    .ok_or_else(|| format!("index {idx} out of range ({len} items)"))?
            }
            serde_json::Value::Object(map) => {
                if last {
                    map.insert(part.to_string(), value);
                    return Ok(());
                }
                // A field left unset (null) becomes a map the next part goes into.
                let next = map
                    .entry(part.to_string())
                    .or_insert_with(|| serde_json::json!({}));
                if next.is_null() {
                    *next = serde_json::json!({});
                }
                next
            }
            _ => return Err(format!("`{}` is not a map or list", parts[..i].join("."))),
        };
        if last {
            *node = value;
            return Ok(());
        }
    }
    Ok(())
}
