//! [`Plan::new`]: each typed piece built from its part of the schema, checking it on the way.

use super::graph::{GraphSpec, UserNode as GraphNode, expand};
use super::schema::{self, Engine, StageKind, Task, Workflow};
use super::*;
use crate::record::mlflow::MlflowTarget;
use learner::optim::ScheduleKind;
use learner::rl::agg::LossAgg;
use learner::rl::kl::Kl;
use learner::rl::loss::{PolicyLoss, PolicyLossConfig};
use rollout::reward::Scorer;
use rollout::task::{Dataset, Keys, Prompt};

/// Errors of one workflow file.
struct Errs<'a>(&'a str);

impl Errs<'_> {
    fn at(&self, field: impl Into<String>, message: impl Into<String>) -> PlanError {
        PlanError::field(self.0, field, message)
    }
    fn whole(&self, message: impl Into<String>) -> PlanError {
        PlanError::new(self.0, message)
    }
    /// The workflow file's folder, where its programs run (`None`: the current one).
    fn dir(&self) -> Option<PathBuf> {
        Path::new(self.0)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .map(Path::to_path_buf)
    }
}

pub(super) fn plan(mut spec: Workflow, origin: &str) -> Result<Plan, PlanError> {
    let e = Errs(origin);
    if spec.stages.is_empty() {
        return Err(e.whole("`stages` is empty: nothing to run"));
    }
    let order = order(&spec).map_err(|m| e.at("stages", m))?;
    checkpoint_folder(&spec, &e)?;
    let (tokenizer, tokenizer_json) = tokenizer(&spec, &e)?;
    let source = model_source(&spec, &tokenizer, &e)?;
    let mut rollout = rollout(&spec.pools.rollout, &e)?;
    let mut learner = learner(&spec.pools.learner, &e)?;
    colocation(&spec.pools, &mut rollout, &mut learner, &e)?;
    let wants_chat = spec
        .stages
        .iter()
        .any(|s| s.data.as_ref().is_some_and(|d| d.chat_template));
    // The checkpoint's chat template: required by a stage that asks for it, and read when a
    // dataset may hold conversations (which only it renders).
    let chat_field = || {
        let i = spec
            .stages
            .iter()
            .position(|s| s.data.as_ref().is_some_and(|d| d.chat_template))
            .unwrap_or(0);
        format!("stages[{i}].data.chat_template")
    };
    let datasets = spec.stages.iter().any(|s| {
        s.data
            .as_ref()
            .is_some_and(|d| matches!(d.task, Task::Jsonl | Task::Parquet))
    });
    let chat = match (&spec.model.path, wants_chat) {
        (Some(p), true) => Some(Arc::new(
            ChatTemplate::from_tokenizer_config(&p.join("tokenizer_config.json"))
                .map_err(|m| e.at(chat_field(), m.to_string()))?,
        )),
        (None, true) => {
            return Err(e.at(
                chat_field(),
                "needs model.path (a checkpoint whose tokenizer_config.json has a chat_template)",
            ));
        }
        (Some(p), false) if datasets && p.join("tokenizer_config.json").is_file() => {
            ChatTemplate::from_tokenizer_config(&p.join("tokenizer_config.json"))
                .ok()
                .map(Arc::new)
        }
        _ => None,
    };
    // Data, read once: stages with the same `data` share it, and an eval stage without its own
    // takes the one of the stage before it in run order.
    let mut read: Vec<(schema::Data, Arc<DataPlan>)> = Vec::new();
    let mut stages = Vec::with_capacity(order.len());
    let mut last: Option<Arc<DataPlan>> = None;
    for &i in &order {
        let s = &spec.stages[i];
        let at = |field: &str| format!("stages[{i}].{field}");
        let data = match &s.data {
            Some(d) => {
                let shared = read.iter().find(|(r, _)| r == d).map(|(_, p)| p.clone());
                let plan = match shared {
                    Some(p) => p,
                    None => {
                        let prompts = Prompts {
                            tokenizer: &tokenizer,
                            chat: chat.as_deref(),
                            eos: 0,
                        };
                        let p = Arc::new(data_plan(d, spec.seed, &prompts, &at("data"), &e)?);
                        read.push((d.clone(), p.clone()));
                        p
                    }
                };
                Some(plan)
            }
            None if s.kind == StageKind::Eval => last.clone(),
            None => {
                return Err(e.at(
                    format!("stages[{i}]"),
                    format!("(`{}`): a {:?} stage needs `data`", s.id, s.kind),
                ));
            }
        };
        let data = data.ok_or_else(|| {
            e.at(
                format!("stages[{i}]"),
                format!(
                    "(`{}`): an eval stage needs `data`, or a stage before it with data",
                    s.id
                ),
            )
        })?;
        last = Some(data.clone());
        if let Some(epochs) = s.trainer.total_epochs {
            let steps = steps_of_epochs(s, epochs, &data, &at("trainer.total_epochs"), &e)?;
            spec.stages[i].trainer.steps = steps;
        }
        stages.push(stage(&spec.stages[i], i, data, &tokenizer, &e)?);
    }
    let mlflow = mlflow_target(&spec, &e)?;
    Ok(Plan {
        name: spec.name.clone(),
        seed: spec.seed,
        model: ModelPlan {
            source,
            tokenizer,
            tokenizer_json,
            chat,
        },
        rollout,
        learner,
        stages,
        mlflow,
        spec,
    })
}

/// The MLflow server and experiment, when the workflow tracks with MLflow.
fn mlflow_target(spec: &Workflow, e: &Errs<'_>) -> Result<Option<MlflowTarget>, PlanError> {
    let Some(m) = &spec.tracking.mlflow else {
        return Ok(None);
    };
    let uri = match &m.uri {
        Some(u) => u.clone(),
        None => std::env::var("MLFLOW_TRACKING_URI").map_err(|_| {
            e.at(
                "tracking.mlflow.uri",
                "is not set, and neither is MLFLOW_TRACKING_URI",
            )
        })?,
    };
    let uri = uri.trim_end_matches('/').to_string();
    let rest = uri
        .strip_prefix("http://")
        .or_else(|| uri.strip_prefix("https://"));
    if rest.is_none_or(str::is_empty) {
        return Err(e.at(
            "tracking.mlflow.uri",
            format!(
                "`{uri}` is not an http:// or https:// URL of a tracking server (a local folder or databricks URI is not served over the REST API)"
            ),
        ));
    }
    let experiment = m.experiment.clone().unwrap_or_else(|| spec.name.clone());
    if experiment.trim().is_empty() {
        return Err(e.at("tracking.mlflow.experiment", "is empty"));
    }
    Ok(Some(MlflowTarget { uri, experiment }))
}

/// Stage indices in an order that respects `after` (stable: file order among ready stages).
fn order(wf: &Workflow) -> Result<Vec<usize>, String> {
    let mut seen: Vec<&str> = Vec::new();
    for (i, s) in wf.stages.iter().enumerate() {
        if seen.contains(&s.id.as_str()) {
            return Err(format!("stages[{i}]: duplicate stage id `{}`", s.id));
        }
        for a in &s.after {
            if !wf.stages.iter().any(|t| &t.id == a) {
                return Err(format!(
                    "stages[{i}] (`{}`): `after` names unknown stage `{a}`",
                    s.id
                ));
            }
        }
        seen.push(&s.id);
    }
    let mut done: Vec<usize> = Vec::new();
    while done.len() < wf.stages.len() {
        let ready = (0..wf.stages.len()).find(|&i| {
            !done.contains(&i)
                && wf.stages[i]
                    .after
                    .iter()
                    .all(|a| done.iter().any(|&d| &wf.stages[d].id == a))
        });
        match ready {
            Some(i) => done.push(i),
            None => {
                let stuck: Vec<&str> = (0..wf.stages.len())
                    .filter(|i| !done.contains(i))
                    .map(|i| wf.stages[i].id.as_str())
                    .collect();
                return Err(format!(
                    "the stages' `after` form a cycle among: {}",
                    stuck.join(", ")
                ));
            }
        }
    }
    Ok(done)
}

fn tokenizer(wf: &Workflow, e: &Errs<'_>) -> Result<(Tokenizer, String), PlanError> {
    let (json, origin) = match (&wf.model.tokenizer, &wf.model.path) {
        (Some(t), _) if t == "builtin:arith" => {
            (rollout::task::arith_tokenizer_json(), PathBuf::from(t))
        }
        (Some(t), _) if t == "builtin:tools" => {
            (rollout::task::tools_tokenizer_json(), PathBuf::from(t))
        }
        (Some(t), _) => (
            std::fs::read_to_string(t)
                .map_err(|err| e.at("model.tokenizer", format!("{t}: {err}")))?,
            PathBuf::from(t),
        ),
        (None, Some(p)) => {
            let f = p.join("tokenizer.json");
            let text = std::fs::read_to_string(&f).map_err(|err| {
                e.at(
                    "model.path",
                    format!(
                        "{}: {err} (set model.tokenizer, or put the tokenizer in the checkpoint)",
                        f.display()
                    ),
                )
            })?;
            (text, f)
        }
        (None, None) => {
            return Err(e.at(
                "model.tokenizer",
                "is required with model.init (`builtin:arith`, `builtin:tools`, or a tokenizer.json)",
            ));
        }
    };
    let tok = Tokenizer::from_json(&json, &origin)
        .map_err(|err| e.at("model.tokenizer", err.to_string()))?;
    Ok((tok, json))
}

/// The model is a checkpoint folder or a config, and a folder has its config.
fn checkpoint_folder(wf: &Workflow, e: &Errs<'_>) -> Result<(), PlanError> {
    match (&wf.model.path, &wf.model.init) {
        (None, None) => Err(e.at(
            "model",
            "needs `path` (a checkpoint folder) or `init` (a config)",
        )),
        (Some(_), Some(_)) => Err(e.at("model", "has both `path` and `init`: choose one")),
        (Some(p), None) if !p.join("config.json").is_file() => Err(e.at(
            "model.path",
            format!(
                "`{}` is not a Hugging Face checkpoint folder (no config.json there)",
                p.display()
            ),
        )),
        _ => Ok(()),
    }
}

fn model_source(wf: &Workflow, tok: &Tokenizer, e: &Errs<'_>) -> Result<ModelSource, PlanError> {
    match (&wf.model.path, &wf.model.init) {
        (Some(p), _) => Ok(ModelSource::Checkpoint(p.clone())),
        (None, None) => Err(e.at(
            "model",
            "needs `path` (a checkpoint folder) or `init` (a config)",
        )),
        (None, Some(init)) => {
            let mut init = init.clone();
            let obj = init
                .as_object_mut()
                .ok_or_else(|| e.at("model.init", "must be a map of config fields"))?;
            obj.entry("vocab_size").or_insert(tok.vocab_size().into());
            obj.entry("max_position_embeddings").or_insert(256.into());
            obj.entry("tie_word_embeddings").or_insert(true.into());
            let heads = obj.get("num_attention_heads").cloned().unwrap_or(1.into());
            obj.entry("num_key_value_heads").or_insert(heads);
            if let Some(eos) = tok.token_id("<eos>") {
                obj.entry("eos_token_id").or_insert(eos.into());
            }
            if !obj.contains_key("intermediate_size")
                && let Some(h) = obj.get("hidden_size").and_then(|v| v.as_u64())
            {
                obj.insert(
                    "intermediate_size".into(),
                    (h * 8 / 3).next_multiple_of(16).into(),
                );
            }
            let config = ModelConfig::from_json(init, Path::new("model.init"))
                .map_err(|err| e.at("model.init", err.to_string()))?;
            Ok(ModelSource::Init(config))
        }
    }
}

fn placement(p: schema::Placement) -> Placement {
    match p {
        schema::Placement::Local => Placement::Local,
        schema::Placement::Pack => Placement::Agents(Strategy::Pack),
        schema::Placement::Spread => Placement::Agents(Strategy::Spread),
        // The strategy is the other pool's, set once both are known (`colocation`).
        schema::Placement::Colocate => Placement::Agents(Strategy::Spread),
    }
}

fn rollout(p: &schema::Pool, e: &Errs<'_>) -> Result<RolloutPlan, PlanError> {
    if p.count == 0 {
        return Err(e.at(
            "pools.rollout.count",
            "is 0: a pool needs at least one engine",
        ));
    }
    if p.kv_cache_mib == 0 {
        return Err(e.at(
            "pools.rollout.kv_cache_mib",
            "is 0: engines need room for their KV cache",
        ));
    }
    if p.shard_optimizer.is_some() {
        return Err(e.at(
            "pools.rollout.shard_optimizer",
            "is for the learner pool (its ranks' optimiser state)",
        ));
    }
    if p.allreduce.is_some() {
        return Err(e.at(
            "pools.rollout.allreduce",
            "is for the learner pool (how its ranks sum their gradients)",
        ));
    }
    if p.precision.is_some() {
        return Err(e.at(
            "pools.rollout.precision",
            "is for the learner pool (a rollout pool's weights are `weights_dtype`)",
        ));
    }
    let kv_cache_bytes = p.kv_cache_mib << 20;
    if p.engine != Engine::Native && p.kv_cache_dtype.is_some() {
        return Err(e.at(
            "pools.rollout.kv_cache_dtype",
            format!(
                "is for engine: native, not `{}` ({})",
                engine_name(p.engine),
                if p.engine.is_external() {
                    "an external engine's KV cache is its server's setting, e.g. vLLM's --kv-cache-dtype"
                } else {
                    "the pjrt engine's programs are traced in f32"
                }
            ),
        ));
    }
    if p.engine.is_external() {
        if p.endpoints.is_empty() {
            return Err(e.at(
                "pools.rollout.endpoints",
                format!(
                    "is empty: engine `{}` needs the URLs of its servers (e.g. [http://10.0.0.5:8000])",
                    engine_name(p.engine)
                ),
            ));
        }
        if let Some(url) = p.endpoints.iter().find(|u| {
            let rest = u
                .strip_prefix("http://")
                .or_else(|| u.strip_prefix("https://"));
            rest.is_none_or(|r| r.trim_end_matches('/').is_empty())
        }) {
            return Err(e.at(
                "pools.rollout.endpoints",
                format!("`{url}` is not a URL like http://10.0.0.5:8000 or https://host:8443"),
            ));
        }
        let api_key = match &p.api_key_env {
            None => None,
            Some(var) => {
                let key = std::env::var(var).unwrap_or_default();
                Some(rollout::external::ApiKey::new(key).ok_or_else(|| {
                    e.at(
                        "pools.rollout.api_key_env",
                        format!(
                            "`{var}` is not set (or empty): it must hold the endpoints' API key"
                        ),
                    )
                })?)
            }
        };
        if p.placement != schema::Placement::Local {
            return Err(e.at(
                "pools.rollout.placement",
                format!(
                    "`{}`: engine `{}` runs where its endpoints are; leave placement out",
                    placement_name(p.placement),
                    engine_name(p.engine)
                ),
            ));
        }
        if p.count > 1 && p.count != p.endpoints.len() {
            return Err(e.at(
                "pools.rollout.count",
                format!(
                    "is {} but {} endpoints are listed: an external pool has one engine per endpoint",
                    p.count,
                    p.endpoints.len()
                ),
            ));
        }
        if !(p.timeout_s > 0.0 && p.timeout_s.is_finite()) {
            return Err(e.at(
                "pools.rollout.timeout_s",
                format!("must be a positive number of seconds, got {}", p.timeout_s),
            ));
        }
        let push_timeout_s = p.push_timeout_s.unwrap_or(120.0);
        if !(push_timeout_s > 0.0 && push_timeout_s.is_finite()) {
            return Err(e.at(
                "pools.rollout.push_timeout_s",
                format!("must be a positive number of seconds, got {push_timeout_s}"),
            ));
        }
        let health_check_s = p.health_check_s.unwrap_or(10.0);
        if !(health_check_s >= 0.0 && health_check_s.is_finite()) {
            return Err(e.at(
                "pools.rollout.health_check_s",
                format!("must be a number of seconds (0: never), got {health_check_s}"),
            ));
        }
        if !(p.verify_tolerance > 0.0) {
            return Err(e.at(
                "pools.rollout.verify_tolerance",
                format!("must be positive, got {}", p.verify_tolerance),
            ));
        }
        if p.plugin.is_some() {
            return Err(e.at("pools.rollout.plugin", "is for engine: pjrt"));
        }
        return Ok(RolloutPlan {
            count: p.endpoints.len(),
            engine: RolloutEngine::External(ExternalPlan {
                api: p.engine,
                endpoints: p.endpoints.clone(),
                model: p.model.clone(),
                weights_dir: p.weights_dir.clone(),
                timeout: Duration::from_secs_f64(p.timeout_s),
                push_timeout: Duration::from_secs_f64(push_timeout_s),
                health_check: (health_check_s > 0.0)
                    .then(|| Duration::from_secs_f64(health_check_s)),
                weights_dtype: p.weights_dtype.unwrap_or_default(),
                tolerance: p.verify_tolerance,
                api_key,
            }),
            placement: Placement::Local,
            colocated: false,
        });
    }
    if p.engine == Engine::Pjrt && p.weights_dtype == Some(learner::params::WeightDtype::Bf16) {
        return Err(e.at(
            "pools.rollout.weights_dtype",
            "`bf16` is for engine: native and external engines (the pjrt engine's programs are traced in f32)",
        ));
    }
    // Settings of external engines only.
    for (set, field) in [
        (p.push_timeout_s.is_some(), "push_timeout_s"),
        (p.health_check_s.is_some(), "health_check_s"),
        (p.api_key_env.is_some(), "api_key_env"),
    ] {
        if set {
            return Err(e.at(
                format!("pools.rollout.{field}"),
                format!(
                    "is for external engines (engine: vllm, sglang or served), not `{}`",
                    engine_name(p.engine)
                ),
            ));
        }
    }
    if !p.endpoints.is_empty() {
        return Err(e.at(
            "pools.rollout.endpoints",
            format!(
                "are for external engines (engine: vllm, sglang or served), not `{}`",
                engine_name(p.engine)
            ),
        ));
    }
    let engine = match p.engine {
        Engine::Pjrt => RolloutEngine::Pjrt {
            device: p.device,
            plugin: p.plugin.clone(),
            kv_cache_bytes,
        },
        _ if p.plugin.is_some() => {
            return Err(e.at(
                "pools.rollout.plugin",
                format!("is for engine: pjrt, not `{}`", engine_name(p.engine)),
            ));
        }
        _ if p.device != Device::Cpu => {
            return Err(e.at(
                "pools.rollout",
                format!(
                    "engine `native` on `{}` cannot be placed: this build runs the native engine on cpu; rollout pools also take pjrt on cpu, gpu or tpu, or vllm, sglang or served with endpoints",
                    p.device
                ),
            ));
        }
        _ => RolloutEngine::Native {
            kv_cache_bytes,
            weights_dtype: p.weights_dtype.unwrap_or_default(),
            // The weights' format unless said otherwise (vLLM's `auto`): an engine serving bf16
            // rounds keys and values to bf16 before attending, so an f32 cache would only hold
            // the same values in twice the bytes.
            kv_cache_dtype: p.kv_cache_dtype.or(p.weights_dtype).unwrap_or_default(),
        },
    };
    Ok(RolloutPlan {
        count: p.count,
        engine,
        placement: placement(p.placement),
        colocated: false,
    })
}

/// `placement: colocate` on either pool: rollout engine `i` in the agent process of learner
/// rank `i`, both pools placed by the other's strategy (`spread` when both say `colocate`).
fn colocation(
    pools: &schema::Pools,
    rollout: &mut RolloutPlan,
    learner: &mut LearnerPlan,
    e: &Errs<'_>,
) -> Result<(), PlanError> {
    use schema::Placement::{Colocate, Local};
    let (r, l) = (pools.rollout.placement, pools.learner.placement);
    let field = match (r, l) {
        (Colocate, _) => "pools.rollout.placement",
        (_, Colocate) => "pools.learner.placement",
        _ => return Ok(()),
    };
    let pjrt_learner = matches!(learner.engine, LearnerEngine::Pjrt { .. });
    if l == Local || r == Local || pjrt_learner {
        // Beside a pool that runs in the driver process (a pjrt learner always does): both
        // there, on one device — for pjrt engines one client, the weights kept on the device.
        if pjrt_learner && r != Local && r != Colocate {
            return Err(e.at(
                field,
                format!(
                    "the pjrt learner trains in the driver process, so engines beside it run there too, but pools.rollout.placement is `{}`: make it `colocate` or `local`",
                    placement_name(r)
                ),
            ));
        }
        if rollout.device() != learner.device {
            return Err(e.at(
                field,
                format!(
                    "`colocate` runs the rollout engines and the learner on one device in one process, but pools.rollout.device is {} and pools.learner.device {}",
                    rollout.device(),
                    learner.device
                ),
            ));
        }
        if let (RolloutEngine::Pjrt { plugin: a, .. }, LearnerEngine::Pjrt { plugin: b, .. }) =
            (&rollout.engine, &learner.engine)
            && a != b
        {
            return Err(e.at(
                field,
                "`colocate` runs the rollout engines and the learner on one device in one process, through one PJRT plugin, but pools.rollout.plugin and pools.learner.plugin differ",
            ));
        }
        rollout.placement = Placement::Local;
        learner.placement = Placement::Local;
        return Ok(());
    }
    if rollout.count != learner.count {
        return Err(e.at(
            field,
            format!(
                "`colocate` pairs rollout engine i with learner rank i, but pools.rollout.count is {} and pools.learner.count {}: make them equal",
                rollout.count, learner.count
            ),
        ));
    }
    if learner.allreduce == AllReduce::Driver {
        return Err(e.at(
            field,
            "`colocate` engines take the weights from the learner ranks' group, and pools.learner.allreduce: driver forms none: use ranks or streams",
        ));
    }
    // Each pool by the other's strategy; both `colocate`: spread.
    match (r, l) {
        (Colocate, Colocate) => {}
        (Colocate, _) => rollout.placement = learner.placement,
        _ => learner.placement = rollout.placement,
    }
    rollout.colocated = true;
    Ok(())
}

fn learner(p: &schema::Pool, e: &Errs<'_>) -> Result<LearnerPlan, PlanError> {
    if p.count == 0 {
        return Err(e.at(
            "pools.learner.count",
            "is 0: a pool needs at least one engine",
        ));
    }
    if !p.endpoints.is_empty() {
        return Err(e.at(
            "pools.learner.endpoints",
            "are for external rollout engines; the learner trains on native or pjrt",
        ));
    }
    if p.api_key_env.is_some() {
        return Err(e.at(
            "pools.learner.api_key_env",
            "is for external rollout engines; the learner trains on native or pjrt",
        ));
    }
    let engine = match p.engine {
        Engine::Native if p.plugin.is_some() => {
            return Err(e.at("pools.learner.plugin", "is for engine: pjrt, not `native`"));
        }
        Engine::Native if p.device != Device::Cpu => {
            return Err(e.at(
                "pools.learner",
                format!(
                    "engine `native` on `{}` cannot be placed: this build runs the native engine on cpu; the learner also takes engine: pjrt on cpu, gpu or tpu",
                    p.device
                ),
            ));
        }
        Engine::Native => LearnerEngine::Native,
        // `colocate`: beside its engines, in the driver process (checked in `colocation`).
        Engine::Pjrt
            if !matches!(
                p.placement,
                schema::Placement::Local | schema::Placement::Colocate
            ) =>
        {
            return Err(e.at(
                "pools.learner.placement",
                format!(
                    "`{}` cannot be placed: the pjrt learner trains in the driver process (placement: local, or colocate beside its rollout engines), data-parallel over `count` devices of its plugin; engine: native ranks run on agents",
                    placement_name(p.placement)
                ),
            ));
        }
        Engine::Pjrt => LearnerEngine::Pjrt {
            device: p.device,
            plugin: p.plugin.clone(),
        },
        other => {
            return Err(e.at(
                "pools.learner.engine",
                format!(
                    "`{}` serves rollouts only; the learner trains on native or pjrt",
                    engine_name(other)
                ),
            ));
        }
    };
    Ok(LearnerPlan {
        engine,
        shard_optimizer: p.shard_optimizer.unwrap_or(true),
        allreduce: p.allreduce.unwrap_or_default(),
        precision: p.precision.unwrap_or_default(),
        count: p.count,
        placement: placement(p.placement),
        device: p.device,
    })
}

fn engine_name(e: Engine) -> &'static str {
    match e {
        Engine::Native => "native",
        Engine::Pjrt => "pjrt",
        Engine::Vllm => "vllm",
        Engine::Sglang => "sglang",
        Engine::Served => "served",
    }
}

fn placement_name(p: schema::Placement) -> &'static str {
    match p {
        schema::Placement::Local => "local",
        schema::Placement::Pack => "pack",
        schema::Placement::Spread => "spread",
        schema::Placement::Colocate => "colocate",
    }
}

fn data_plan(
    d: &schema::Data,
    seed: u64,
    prompts: &Prompts<'_>,
    at: &str,
    e: &Errs<'_>,
) -> Result<DataPlan, PlanError> {
    if let Some(t) = &d.prompt_template
        && !t.contains("{prompt}")
    {
        return Err(e.at(
            format!("{at}.prompt_template"),
            format!("`{t}` has no `{{prompt}}` where the prompt goes"),
        ));
    }
    let source = match d.task {
        Task::Arith => {
            d.arith.validate().map_err(|m| e.at(at, m))?;
            Source::Arith(d.arith.clone())
        }
        Task::Guess => {
            d.arith.validate().map_err(|m| e.at(at, m))?;
            if d.arith.reverse_answer {
                return Err(e.at(
                    format!("{at}.reverse_answer"),
                    "is for task: arith (a guessing game's answer is its secret)",
                ));
            }
            Source::Guess(d.arith.clone())
        }
        Task::Jsonl | Task::Parquet => {
            let read = if d.task == Task::Jsonl {
                rollout::task::read_jsonl
            } else {
                rollout::task::read_parquet
            };
            let name = if d.task == Task::Jsonl {
                "jsonl"
            } else {
                "parquet"
            };
            let keys = Keys {
                prompt: &d.prompt_key,
                answer: &d.answer_key,
                data_source: &d.reward_fn_key,
            };
            let files = d.path.as_ref().ok_or_else(|| {
                e.at(
                    format!("{at}.path"),
                    format!("is required with task: {name}"),
                )
            })?;
            // Every file's problems (a list is read in order), templated, each checked against
            // the chat template and `max_prompt_length`.
            let read = |files: &[PathBuf], field: &str| -> Result<Vec<Problem>, PlanError> {
                if files.is_empty() {
                    return Err(e.at(format!("{at}.{field}"), "lists no files"));
                }
                let (mut all, mut dropped) = (Vec::new(), 0);
                for file in files {
                    let mut rows = read(file, keys).map_err(|m| e.at(at, m))?;
                    if let Some(t) = &d.prompt_template {
                        for r in &mut rows {
                            apply_template(&mut r.prompt, t);
                        }
                    }
                    let before = rows.len();
                    prompt_lengths(&mut rows, d, prompts, file, at, e)?;
                    dropped += before - rows.len();
                    all.append(&mut rows);
                }
                if let Some(max) = d.max_prompt_length {
                    if all.is_empty() {
                        let names: Vec<String> =
                            files.iter().map(|f| f.display().to_string()).collect();
                        return Err(e.at(
                            format!("{at}.max_prompt_length"),
                            format!("{}: every prompt is over {max} tokens", names.join(", ")),
                        ));
                    }
                    if dropped > 0 {
                        tracing::info!(
                            "{at}.{field}: dropped {dropped} rows whose prompt is over {max} tokens"
                        );
                    }
                }
                Ok(all)
            };
            let train = read(files, "path")?;
            let eval = match &d.eval_path {
                Some(files) => Some(read(files, "eval_path")?),
                None => None,
            };
            Source::Dataset(Dataset::split(train, eval, d.eval_size, seed))
        }
    };
    if d.filter_overlong_prompts && d.max_prompt_length.is_none() {
        return Err(e.at(
            format!("{at}.filter_overlong_prompts"),
            "needs max_prompt_length (the length over which prompts are dropped)",
        ));
    }
    if matches!(d.task, Task::Arith | Task::Guess)
        && (d.max_prompt_length.is_some() || d.filter_overlong_prompts)
    {
        return Err(e.at(
            format!("{at}.max_prompt_length"),
            "is for jsonl and parquet datasets (arith prompts are a few tokens)",
        ));
    }
    let env = d
        .env
        .as_ref()
        .map(|x| env_plan(x, prompts, &format!("{at}.env"), e))
        .transpose()?;
    let eval_set = source.eval_set(seed, d.eval_size);
    Ok(DataPlan {
        exclude: eval_set.iter().cloned().collect(),
        eval_set,
        source,
        chat_template: d.chat_template,
        env,
    })
}

/// `data.env`, checked: limits that let an episode run, and a tool format the tokenizer can
/// write (the compact one where it has `builtin:tools`' tokens, else Hermes').
fn env_plan(
    x: &schema::EnvConfig,
    prompts: &Prompts<'_>,
    at: &str,
    e: &Errs<'_>,
) -> Result<EnvPlan, PlanError> {
    use rollout::env::tools::{CALL, ToolFormat};
    if x.max_turns == 0 {
        return Err(e.at(format!("{at}.max_turns"), "must be at least 1"));
    }
    if x.max_episode_tokens == Some(0) {
        return Err(e.at(format!("{at}.max_episode_tokens"), "must be at least 1"));
    }
    if !(x.step_timeout_s.is_finite() && x.step_timeout_s > 0.0) {
        return Err(e.at(
            format!("{at}.step_timeout_s"),
            format!(
                "must be a positive number of seconds, got {}",
                x.step_timeout_s
            ),
        ));
    }
    let spec = match (x.kind, &x.command) {
        (schema::EnvKind::Calculator, None) => rollout::env::EnvSpec::Calculator,
        (schema::EnvKind::Guess, None) => rollout::env::EnvSpec::Guess,
        (kind @ (schema::EnvKind::Command | schema::EnvKind::Agent), Some(argv)) => {
            let Some(cmd) = argv.first() else {
                return Err(e.at(format!("{at}.command"), "is empty: name a program"));
            };
            if x.memory_mb == 0 {
                return Err(e.at(format!("{at}.memory_mb"), "must be positive"));
            }
            let dir = e.dir();
            let program = find_program(cmd, dir.as_deref()).ok_or_else(|| {
                e.at(
                    format!("{at}.command"),
                    format!("`{cmd}` is not a program found on PATH (or executable file)"),
                )
            })?;
            let mut argv = argv.clone();
            argv[0] = program.display().to_string();
            let agent = kind == schema::EnvKind::Agent;
            let program = rollout::env::command::CommandEnv {
                name: x
                    .name
                    .clone()
                    .unwrap_or_else(|| if agent { "agent" } else { "command" }.into()),
                argv,
                dir,
                memory_bytes: x.memory_mb.saturating_mul(1 << 20),
            };
            if !agent {
                rollout::env::EnvSpec::Command(program)
            } else if prompts.chat.is_none() {
                return Err(e.at(
                    format!("{at}.type"),
                    "agent needs `data.chat_template: true` and a checkpoint with a chat template \
                     (an agent program's calls are chat messages, which the template renders)",
                ));
            } else {
                // Whether its printed reward counts is the stage's to say (`reward`).
                rollout::env::EnvSpec::Agent(rollout::env::command::AgentProgram {
                    program,
                    printed_reward: true,
                })
            }
        }
        (kind @ (schema::EnvKind::Command | schema::EnvKind::Agent), None) => {
            let kind = if kind == schema::EnvKind::Agent {
                "agent"
            } else {
                "command"
            };
            return Err(e.at(
                format!("{at}.command"),
                format!("is required with type: {kind} (the program and its arguments)"),
            ));
        }
        (_, Some(_)) => {
            return Err(e.at(
                format!("{at}.command"),
                "is for type: command and agent (the built-in environments run in Trellis)",
            ));
        }
    };
    if matches!(spec, rollout::env::EnvSpec::Agent(_)) && x.tool_format == Some(ToolFormat::Compact)
    {
        return Err(e.at(
            format!("{at}.tool_format"),
            "an agent program's tool calls are read as hermes' (the gateway answers them as OpenAI's tool_calls)",
        ));
    }
    let compact_ok = rollout::episode::compact_token(prompts.tokenizer, CALL).is_ok();
    let format = match x.tool_format {
        _ if matches!(spec, rollout::env::EnvSpec::Agent(_)) => ToolFormat::Hermes,
        Some(ToolFormat::Compact) if !compact_ok => {
            return Err(e.at(
                format!("{at}.tool_format"),
                rollout::episode::compact_token(prompts.tokenizer, CALL)
                    .err()
                    .unwrap_or_default(),
            ));
        }
        Some(f) => f,
        None if compact_ok => ToolFormat::Compact,
        None => ToolFormat::Hermes,
    };
    Ok(EnvPlan {
        spec,
        format,
        max_turns: x.max_turns,
        max_episode_tokens: x.max_episode_tokens,
        step_timeout_s: x.step_timeout_s,
    })
}

/// `{prompt}` in `template` replaced by the prompt's text (a conversation's last user message).
fn apply_template(prompt: &mut Prompt, template: &str) {
    match prompt {
        Prompt::Text(t) => *t = template.replace("{prompt}", t),
        Prompt::Chat(messages) => {
            if let Some(m) = messages.iter_mut().rev().find(|m| m.role == "user") {
                m.content = template.replace("{prompt}", &m.content);
            }
        }
    }
}

/// Checks the prompts of `file`: a conversation needs the chat template, and over
/// `max_prompt_length` (each prompt rendered once) a row is dropped (`filter_overlong_prompts`)
/// or refused.
fn prompt_lengths(
    rows: &mut Vec<Problem>,
    d: &schema::Data,
    prompts: &Prompts<'_>,
    file: &Path,
    at: &str,
    e: &Errs<'_>,
) -> Result<(), PlanError> {
    let mut keep = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        let row = || format!("{}: row {}", file.display(), i + 1);
        if matches!(r.prompt, Prompt::Chat(_)) && prompts.chat.is_none() {
            return Err(e.at(
                format!("{at}.prompt_key"),
                format!(
                    "{}: the prompt is a conversation (a list of messages), which is rendered by the checkpoint's chat template, and there is none: give model.path a checkpoint whose tokenizer_config.json (or chat_template.jinja) has one",
                    row()
                ),
            ));
        }
        let Some(max) = d.max_prompt_length else {
            keep.push(true);
            continue;
        };
        let n = prompts
            .prompt(&r.prompt, d.chat_template)
            .map_err(|m| e.at(at, format!("{}: {m}", row())))?
            .len();
        if n > max && !d.filter_overlong_prompts {
            let head: String = r.prompt.display().chars().take(60).collect();
            return Err(e.at(
                format!("{at}.max_prompt_length"),
                format!(
                    "{}: the prompt is {n} tokens, over {max} (`{head}…`); set filter_overlong_prompts: true to drop such rows",
                    row()
                ),
            ));
        }
        keep.push(n <= max);
    }
    let mut it = keep.into_iter();
    rows.retain(|_| it.next().unwrap_or(false));
    Ok(())
}

fn steps_of_epochs(
    s: &schema::Stage,
    epochs: f64,
    data: &DataPlan,
    at: &str,
    e: &Errs<'_>,
) -> Result<u64, PlanError> {
    if !(epochs > 0.0 && epochs.is_finite()) {
        return Err(e.at(at, format!("must be positive, got {epochs}")));
    }
    if s.data.is_none() {
        return Err(e.at(at, "needs the stage's own data"));
    }
    let rows = data.source.train_rows().ok_or_else(|| {
        e.at(
            at,
            "the arith task is an endless stream of problems; count steps instead",
        )
    })?;
    let per_step = match s.kind {
        StageKind::Sft => s.sft.batch_size,
        _ => s.algorithm.train_batch_size,
    }
    .max(1);
    Ok(((epochs * rows as f64) / per_step as f64).ceil().max(1.0) as u64)
}

fn positive(v: f64) -> bool {
    v > 0.0 && v.is_finite()
}

fn schedule(
    lr: f32,
    warmup: u64,
    kind: schema::Schedule,
    min_ratio: f32,
    total: u64,
    at: &str,
    e: &Errs<'_>,
) -> Result<LrSchedule, PlanError> {
    if !positive(lr as f64) {
        return Err(e.at(
            format!("{at}.lr"),
            format!("must be a positive learning rate, got {lr}"),
        ));
    }
    if !(0.0..=1.0).contains(&min_ratio) {
        return Err(e.at(
            format!("{at}.min_lr_ratio"),
            format!("must lie in [0, 1], got {min_ratio}"),
        ));
    }
    Ok(LrSchedule {
        warmup_steps: warmup,
        total_steps: total,
        kind: match kind {
            schema::Schedule::Constant => ScheduleKind::Constant,
            schema::Schedule::Cosine => ScheduleKind::Cosine,
        },
        min_lr_ratio: min_ratio,
        ..LrSchedule::constant(lr)
    })
}

fn stage(
    s: &schema::Stage,
    i: usize,
    data: Arc<DataPlan>,
    tokenizer: &Tokenizer,
    e: &Errs<'_>,
) -> Result<StagePlan, PlanError> {
    let at = |field: &str| format!("stages[{i}].{field}");
    if data.env.is_some() && s.kind == StageKind::Sft {
        return Err(e.at(
            at("data.env"),
            "is for rl and eval stages (an sft stage trains on the task's answers)",
        ));
    }
    let program = matches!(
        data.env.as_ref().map(|e| &e.spec),
        Some(rollout::env::EnvSpec::Agent(_))
    );
    if data.env.is_some() && s.reward.is_some() && !program {
        return Err(e.at(
            at("reward"),
            "an episode's score is its environment's (data.env): remove `reward`",
        ));
    }
    // An agent program's stage may score the transcripts with its reward instead.
    let scores_episodes = data.env.is_some() && !(program && s.reward.is_some());
    let reward = s
        .reward
        .clone()
        .unwrap_or(rollout::reward::Reward::ExactMatch);
    let reward = Scorer::open(reward).map_err(|m| e.at(at("reward"), m))?;
    let t = s.trainer.eval_temperature;
    if !(t.is_finite() && t >= 0.0) {
        return Err(e.at(
            at("trainer.eval_temperature"),
            format!("must be 0 (greedy) or a positive temperature, got {t}"),
        ));
    }
    if let Some(target) = s.trainer.stop_at_accuracy {
        let why = if s.kind == StageKind::Eval {
            Some("is for a stage that trains (an eval stage has no steps to stop)".to_string())
        } else if !(target > 0.0 && target <= 1.0) {
            Some(format!("must be an accuracy in (0, 1], got {target}"))
        } else if s.trainer.eval_freq == 0 {
            Some("needs `trainer.eval_freq` above 0: the stage checks it at each evaluation".into())
        } else {
            None
        };
        if let Some(why) = why {
            return Err(e.at(at("trainer.stop_at_accuracy"), why));
        }
    }
    if s.trainer.max_ckpt_to_keep == 0 {
        return Err(e.at(
            at("trainer.max_ckpt_to_keep"),
            "is 0: at least the latest checkpoint is kept (resuming needs it)",
        ));
    }
    if s.kind != StageKind::Rl && !s.nodes.is_empty() {
        return Err(e.at(
            at("nodes"),
            format!("apply to rl stages only (`{}` is {:?})", s.id, s.kind),
        ));
    }
    let work = match s.kind {
        StageKind::Eval => Work::Eval,
        StageKind::Sft => {
            if s.sft.batch_size == 0 {
                return Err(e.at(at("sft.batch_size"), "is 0: a step needs problems"));
            }
            Work::Sft(SftPlan {
                batch_size: s.sft.batch_size,
                schedule: schedule(
                    s.sft.lr,
                    s.sft.lr_warmup_steps,
                    s.sft.lr_schedule,
                    s.sft.min_lr_ratio,
                    s.trainer.steps,
                    &at("sft"),
                    e,
                )?,
            })
        }
        StageKind::Rl => Work::Rl(Box::new(rl(s, i, e)?)),
    };
    let eval_tokens = if data.source.is_arith() {
        // In tokens (an answer may hold the tool format's tokens); a turn of an episode may
        // also be a call that restates the problem.
        let tokens = |t: &str| {
            tokenizer
                .encode_rendered(t)
                .map_or(t.len(), |ids| ids.len())
        };
        data.eval_set
            .iter()
            .map(|p| match data.env {
                Some(_) => tokens(&p.answer).max(tokens(p.prompt.display())),
                None => tokens(&p.answer),
            })
            .max()
            .unwrap_or(1)
            + 2
    } else {
        s.algorithm.max_response_length
    };
    Ok(StagePlan {
        id: s.id.clone(),
        steps: if s.kind == StageKind::Eval {
            0
        } else {
            s.trainer.steps
        },
        work,
        data,
        reward,
        scores_episodes,
        eval_freq: s.trainer.eval_freq,
        stop_at_accuracy: s.trainer.stop_at_accuracy,
        save_freq: s.trainer.save_freq,
        save_dtype: s.trainer.save_dtype,
        keep: s.trainer.max_ckpt_to_keep,
        eval_tokens,
        log_generations: s.trainer.log_generations,
        eval_temperature: s.trainer.eval_temperature,
        log_rollouts: s.trainer.log_rollouts,
    })
}

fn rl(s: &schema::Stage, i: usize, e: &Errs<'_>) -> Result<RlPlan, PlanError> {
    let at = |field: &str| format!("stages[{i}].algorithm.{field}");
    let a = &s.algorithm;
    for (name, v) in [
        ("rollout_n", a.rollout_n),
        ("train_batch_size", a.train_batch_size),
        ("ppo_epochs", a.ppo_epochs),
        ("max_response_length", a.max_response_length),
        ("ppo_mini_batch_size", a.ppo_mini_batch_size),
    ] {
        if v == 0 {
            return Err(e.at(at(name), "is 0: it must be positive"));
        }
    }
    if !a.train_batch_size.is_multiple_of(a.ppo_mini_batch_size) {
        return Err(e.at(
            at("ppo_mini_batch_size"),
            format!(
                "({}) must divide train_batch_size ({}); both are counted in prompts",
                a.ppo_mini_batch_size, a.train_batch_size
            ),
        ));
    }
    let rl_err =
        |field: &'static str| move |err: learner::rl::RlError| e.at(at(field), err.to_string());
    let estimator = match a
        .adv_estimator
        .parse::<AdvEstimator>()
        .map_err(rl_err("adv_estimator"))?
    {
        AdvEstimator::Grpo { .. } => AdvEstimator::Grpo {
            norm_by_std: a.norm_adv_by_std_in_grpo,
        },
        AdvEstimator::Gae { .. } => AdvEstimator::Gae {
            gamma: a.gamma,
            lambda: a.lam,
        },
        AdvEstimator::ReinforcePlusPlus { .. } => {
            AdvEstimator::ReinforcePlusPlus { gamma: a.gamma }
        }
        other => other,
    };
    for (name, v) in [("gamma", a.gamma), ("lam", a.lam)] {
        if !(0.0..=1.0).contains(&v) {
            return Err(e.at(at(name), format!("must lie in [0, 1], got {v}")));
        }
    }
    let kl = if a.use_kl_loss {
        let kind = a
            .kl_loss_type
            .parse::<Kl>()
            .map_err(rl_err("kl_loss_type"))?;
        Some((kind, a.kl_loss_coef))
    } else {
        None
    };
    let loss = PolicyLossConfig {
        loss: a
            .policy_loss
            .parse::<PolicyLoss>()
            .map_err(rl_err("policy_loss"))?,
        clip_low: a.clip_ratio_low.unwrap_or(a.clip_ratio),
        clip_high: a.clip_ratio_high.unwrap_or(a.clip_ratio),
        entropy_coeff: a.entropy_coeff,
        kl,
        ..Default::default()
    };
    if !(a.clip_ratio >= 0.0 && a.clip_ratio < 1.0) {
        return Err(e.at(
            at("clip_ratio"),
            format!("must lie in [0, 1), got {}", a.clip_ratio),
        ));
    }
    loss.validate().map_err(|err| match err {
        learner::rl::RlError::InvalidParam { param, value, why } => {
            e.at(at(param), format!("is {value}: it {why}"))
        }
        other => e.at(format!("stages[{i}].algorithm"), other.to_string()),
    })?;
    let agg: LossAgg = a.loss_agg_mode.parse().map_err(rl_err("loss_agg_mode"))?;
    if !(a.temperature > 0.0 && a.temperature.is_finite()) {
        return Err(e.at(
            at("temperature"),
            format!(
                "is {}: RL samples its responses, so the temperature must be positive (0 would be greedy decoding, where every sample of a prompt is the same and log-probs are undefined)",
                a.temperature
            ),
        ));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        return Err(e.at(at("top_p"), format!("must lie in (0, 1], got {}", a.top_p)));
    }
    if !positive(a.grad_clip) {
        return Err(e.at(
            at("grad_clip"),
            format!("must be positive, got {}", a.grad_clip),
        ));
    }
    if a.filter_groups && a.max_num_gen_batches == 0 {
        return Err(e.at(
            at("max_num_gen_batches"),
            "is 0: dynamic sampling needs at least one round",
        ));
    }
    if a.overlong_buffer_len > a.max_response_length {
        return Err(e.at(
            at("overlong_buffer_len"),
            format!(
                "({}) is longer than max_response_length ({})",
                a.overlong_buffer_len, a.max_response_length
            ),
        ));
    }
    let mode = match s.trainer.mode {
        schema::Mode::Sync => Mode::Sync,
        schema::Mode::Async => {
            if a.filter_groups {
                return Err(e.at(
                    format!("stages[{i}]"),
                    "algorithm.filter_groups (DAPO dynamic sampling) needs trainer.mode sync; in async mode, drop uninformative groups with a `filter` node (min_group_std)",
                ));
            }
            if s.trainer.max_staleness == 0 {
                return Err(e.at(
                    format!("stages[{i}].trainer.max_staleness"),
                    "is 0 in async mode: generation could never run ahead (use mode: sync), counted in weight versions",
                ));
            }
            Mode::Async {
                max_staleness: s.trainer.max_staleness,
                stale: s.trainer.stale_samples,
            }
        }
    };
    let update = PolicyUpdate {
        loss,
        agg,
        temperature: a.temperature.max(1e-6),
        epochs: a.ppo_epochs,
        rows_per_update: a.ppo_mini_batch_size * a.rollout_n,
    };
    let calls_per_step =
        (a.ppo_epochs * (a.train_batch_size / a.ppo_mini_batch_size).max(1)) as u64;
    let schedule = schedule(
        a.lr,
        a.lr_warmup_steps,
        a.lr_schedule,
        a.min_lr_ratio,
        s.trainer.steps * calls_per_step,
        &format!("stages[{i}].algorithm"),
        e,
    )?;
    let critic = if estimator.needs_values() {
        if !positive(a.critic_lr as f64) {
            return Err(e.at(
                at("critic_lr"),
                format!("must be a positive learning rate, got {}", a.critic_lr),
            ));
        }
        if !positive(a.cliprange_value) {
            return Err(e.at(
                at("cliprange_value"),
                format!("must be positive, got {}", a.cliprange_value),
            ));
        }
        Some(CriticPlan {
            lr: a.critic_lr,
            update: ValueUpdate {
                cliprange_value: a.cliprange_value,
                agg,
                epochs: a.ppo_epochs,
                rows_per_update: a.ppo_mini_batch_size * a.rollout_n,
            },
        })
    } else {
        None
    };
    let nodes = user_nodes(s, i, e)?;
    let asynchronous = matches!(mode, Mode::Async { .. });
    // Several updates a step need the behaviour policy's log-probs; one update is on policy.
    let engine_logp =
        asynchronous || (calls_per_step > 1 && a.old_logp == schema::OldLogpSource::Engine);
    let graph = expand(GraphSpec {
        critic: critic.is_some(),
        reference: kl.is_some(),
        old_logp: !engine_logp && calls_per_step > 1,
        engine_logp,
        nodes: &nodes,
    })
    .map_err(|m| {
        e.at(
            format!("stages[{i}].nodes"),
            format!("stage `{}`: {m}", s.id),
        )
    })?;
    Ok(RlPlan {
        estimator,
        update,
        sampling: Sampling {
            n: a.rollout_n,
            temperature: a.temperature,
            top_p: a.top_p,
            max_tokens: a.max_response_length,
        },
        prompts_per_step: a.train_batch_size,
        prompts_per_update: a.ppo_mini_batch_size,
        schedule,
        grad_clip: a.grad_clip,
        mode,
        engine_logp,
        dynamic_sampling: a.filter_groups.then_some(a.max_num_gen_batches),
        overlong: (a.overlong_buffer_len > 0).then_some(Overlong {
            buffer: a.overlong_buffer_len,
            factor: a.overlong_penalty_factor,
        }),
        critic,
        graph,
    })
}

fn user_nodes(s: &schema::Stage, i: usize, e: &Errs<'_>) -> Result<Vec<GraphNode>, PlanError> {
    let mut out = Vec::with_capacity(s.nodes.len());
    for (j, n) in s.nodes.iter().enumerate() {
        let at = format!("stages[{i}].nodes[{j}]");
        let (op, name, after, before) = match n {
            schema::UserNode::Program(p) => {
                let Some((cmd, args)) = p.command.split_first() else {
                    return Err(e.at(format!("{at}.command"), format!("(`{}`) is empty", p.name)));
                };
                if !(positive(p.timeout_s)) || p.memory_mb == 0 {
                    return Err(e.at(
                        at.clone(),
                        format!(
                            "(`{}`): timeout_s (seconds) and memory_mb (MiB) must be positive",
                            p.name
                        ),
                    ));
                }
                let dir = e.dir();
                let program = find_program(cmd, dir.as_deref()).ok_or_else(|| {
                    e.at(
                        format!("{at}.command"),
                        format!(
                            "(`{}`): `{cmd}` is not a program{}",
                            p.name,
                            if cmd.contains('/') {
                                " (no executable file there)"
                            } else {
                                " found on PATH"
                            }
                        ),
                    )
                })?;
                let plan = ProgramPlan {
                    name: p.name.clone(),
                    program,
                    args: args.to_vec(),
                    dir,
                    timeout: Duration::from_secs_f64(p.timeout_s),
                    memory_bytes: p.memory_mb.saturating_mul(1 << 20),
                    weight: p.weight,
                    mode: p.mode,
                };
                (Op::Program(Arc::new(plan)), &p.name, &p.after, &p.before)
            }
            schema::UserNode::Filter(f) => {
                if !(f.min_group_std >= 0.0) {
                    return Err(e.at(
                        format!("{at}.min_group_std"),
                        format!("must not be negative, got {}", f.min_group_std),
                    ));
                }
                let plan = FilterPlan {
                    name: f.name.clone(),
                    min_group_std: f.min_group_std,
                    drop_truncated: f.drop_truncated,
                };
                (Op::Filter(Arc::new(plan)), &f.name, &f.after, &f.before)
            }
        };
        out.push(GraphNode {
            op,
            name: name.clone(),
            after: after.clone(),
            before: before.clone(),
        });
    }
    Ok(out)
}

/// The program `cmd` names: a path (with a `/`; relative ones start at `dir`) to an executable
/// file, or an executable file in a folder of `PATH`.
fn find_program(cmd: &str, dir: Option<&Path>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if cmd.contains('/') {
        let p = match dir {
            Some(d) => d.join(cmd),
            None => PathBuf::from(cmd),
        };
        return executable(&p).then_some(p);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(cmd))
        .find(|p| executable(p))
}
