//! `trellis bench learners`: one policy update of the reference model on one engine in this
//! process, then on `ranks` learner actors in this process and on as many `trellis agent`
//! processes on this host, in the same run — each rank's step time against the one engine's,
//! the all-reduce's rate and share of the step, and the optimiser state a rank keeps with and
//! without ZeRO-1. On the agents the all-reduce runs each way: through the driver, over TCP
//! streams between the ranks (as across hosts), and through shared memory between them. And
//! the hand-over of the one engine's new weights to a native rollout engine in its process:
//! shared (what `trellis train` does) against one copy, same run; and a push of the ranks' new
//! weights to as many rollout engines on the agents — each beside a rank (`placement:
//! colocate`: taken from the rank's memory), then on agents of their own (read from the ranks'
//! outboxes).
//!
//! Owns: the benchmark's set-up and figures. Never: prints (the binary does).

use super::learner::{LearnerPool, LearnerStart};
use super::rollout::{PoolStart, Pulls, RolloutPool};
use super::{Cluster, ClusterHead, PoolError};
use crate::plan::{AllReduce, Device, Placement, RolloutEngine, RolloutPlan};
use actors::{Actor, Head, HeadConfig, Strategy, Token};
use kernels::tensor::WeightSnapshot;
use learner::algo::TokenRows;
use learner::algo::layout::Row;
use learner::algo::policy::{PolicyBatch, PolicyUpdate};
use learner::bench::median;
use learner::engine::Backend;
use learner::optim::{LrSchedule, Optimizer};
use learner::rl::agg::LossAgg;
use learner::{Model, ModelConfig};
use serde::Serialize;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Debug)]
pub struct LearnerBenchOptions {
    /// The `trellis` executable (agents are started from it).
    pub exe: PathBuf,
    /// The model.
    pub config: ModelConfig,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// Rows per update (one optimiser step).
    pub batch: usize,
    /// Tokens per row (half prompt, half response).
    pub seq: usize,
    /// Timed updates (after one warm-up).
    pub steps: usize,
}

/// The figures of one way of running the ranks.
#[derive(Clone, Debug, Serialize)]
pub struct RankFigures {
    /// Where the ranks ran.
    pub placement: String,
    /// ZeRO-1: each rank kept the optimiser state of its shard only.
    pub sharded: bool,
    /// How the ranks summed their gradients.
    pub allreduce: AllReduce,
    /// Optimiser state one rank kept (the largest shard's, with ZeRO-1).
    pub optimizer_bytes_per_rank: usize,
    /// Median seconds of one update.
    pub step_s: f64,
    /// Median seconds of its all-reduce (summing the gradients, handing back the sum).
    pub allreduce_s: f64,
    /// Gradient bytes over the all-reduce's time (the algorithm bandwidth, as NCCL counts it).
    pub allreduce_gbps: f64,
    /// The all-reduce's share of the step.
    pub comm_share: f64,
    /// This step time over the one engine's.
    pub vs_one_engine: f64,
    /// Median seconds to read the weights from the ranks (what a snapshot for the rollout
    /// engines, or a checkpoint, takes first).
    pub weights_read_s: f64,
}

/// A push of the ranks' new weights to rollout engines on agents.
#[derive(Clone, Debug, Serialize)]
pub struct PushFigures {
    /// Where the engines ran.
    pub engines: String,
    /// Median seconds of a push (the driver's read of the weights not included).
    pub push_s: f64,
    /// Engines that read the weights from the ranks' outboxes, at the last push.
    pub from_ranks: usize,
    /// Engines that took them from a rank in their own process, at the last push.
    pub beside: usize,
}

/// `trellis bench learners`' figures.
#[derive(Clone, Debug, Serialize)]
pub struct LearnerBench {
    /// Parameters of the model.
    pub params: usize,
    /// Bytes of one gradient (f32).
    pub gradient_bytes: usize,
    /// Ranks.
    pub ranks: usize,
    /// Rows × tokens per update.
    pub batch: usize,
    pub seq: usize,
    /// Median seconds of one update on one engine in this process.
    pub one_engine_step_s: f64,
    /// The one engine's new weights to a native rollout engine in its process after each
    /// update, as the policy hands them over (shared, no copy): median seconds.
    pub handover_shared_s: f64,
    /// The same hand-over as it was before the weights were shared — copied twice (the
    /// policy's snapshot, then the engine's own): median seconds.
    pub handover_copied_s: f64,
    /// Whether the engine served the learner's very memory after a shared hand-over (checked
    /// tensor by tensor).
    pub handover_shares_memory: bool,
    /// The update after a shared hand-over, while the engine holds the weights (its optimiser
    /// step writes to memory of its own: copy on write): median seconds.
    pub step_while_served_s: f64,
    /// The update after a copied hand-over (its step writes in place): median seconds.
    pub step_in_place_s: f64,
    /// The ranks as actors in this process without and with ZeRO-1, then on agents on this
    /// host with it, summing through the driver, over streams and through shared memory.
    pub runs: Vec<RankFigures>,
    /// Pushes to engines beside the ranks, then to engines on agents of their own.
    pub pushes: Vec<PushFigures>,
}

/// An agent process, killed when dropped.
struct AgentProcess(Child);

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `trellis agent` `name` with `cpus` CPUs for `head`.
fn start_agent(
    exe: &std::path::Path,
    head: &Head,
    token_file: &std::path::Path,
    name: &str,
    cpus: u32,
) -> Result<AgentProcess, PoolError> {
    let child = Command::new(exe)
        .args(["--log", "warn", "agent", "--head"])
        .arg(format!("http://{}", head.address()))
        .arg("--token-file")
        .arg(token_file)
        .args(["--listen", "127.0.0.1:0", "--resources"])
        .arg(format!("cpu={cpus}"))
        .args(["--name", name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| PoolError::Runtime(format!("cannot start {} agent: {e}", exe.display())))?;
    Ok(AgentProcess(child))
}

/// `o.ranks` ranks on agents (ZeRO-1, summing among themselves) and as many native rollout
/// engines — on `beside`'s agents, rank and engine `i` on agent `i`, or (`None`) spread — and
/// the engines' median time to take the ranks' new weights after each update.
fn push(
    o: &LearnerBenchOptions,
    cluster: &Cluster,
    weights: &WeightSnapshot,
    (batch, cfg): (PolicyBatch<'_>, &PolicyUpdate),
    beside: Option<Vec<String>>,
) -> Result<PushFigures, PoolError> {
    let spread = Placement::Agents(Strategy::Spread);
    let mut note = |_: &str| {};
    let mut ranks = LearnerPool::start(LearnerStart {
        count: o.ranks,
        placement: spread,
        device: Device::Cpu,
        cluster: Some(cluster),
        stop: &|| false,
        note: &mut note,
        config: &o.config,
        weights: weights.clone(),
        assets: Vec::new(),
        shard_optimizer: true,
        allreduce: AllReduce::Ranks,
        precision: kernels::matmul::Precision::F32,
        role: crate::kinds::learner::RankRole::Policy,
        beside: beside.clone(),
    })?;
    let plan = RolloutPlan {
        count: o.ranks,
        engine: RolloutEngine::Native {
            kv_cache_bytes: 1 << 20,
            weights_dtype: Default::default(),
            kv_cache_dtype: Default::default(),
        },
        placement: spread,
        colocated: beside.is_some(),
    };
    let engines = RolloutPool::new(PoolStart {
        plan: &plan,
        config: &o.config,
        weights: weights.clone(),
        cluster: Some(cluster),
        stop: &|| false,
        run_dir: &std::env::temp_dir(),
        needs_processed: false,
        note: &mut note,
        agent: None,
        beside: beside.clone(),
    })?;
    ranks.begin_stage(LrSchedule::constant(1e-5), 1.0, None)?;
    let (mut times, mut pulls) = (Vec::new(), Pulls::default());
    for i in 0..=o.steps {
        ranks.update(batch, cfg)?;
        let snapshot = ranks.snapshot(i as u64 + 1)?;
        let t = Instant::now();
        pulls = engines.update_weights_from(snapshot, ranks.weight_source())?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(PushFigures {
        engines: match beside {
            Some(_) => "beside the ranks".into(),
            None => "on agents of their own".into(),
        },
        push_s: median(&times),
        from_ranks: pulls.from_ranks,
        beside: pulls.beside,
    })
}

/// Runs the benchmark.
pub fn run(o: &LearnerBenchOptions) -> Result<LearnerBench, PoolError> {
    let model = Model::init(o.config.clone(), 1);
    let params = model.params.numel();
    // Any tokens and advantages do (as `trellis bench train`'s: spread over the vocabulary).
    let vocab = o.config.vocab_size;
    let half = (o.seq / 2).max(1);
    let seqs: Vec<Vec<u32>> = (0..o.batch)
        .map(|r| {
            (0..2 * half)
                .map(|t| ((r * 7919 + t * 104_729) % vocab) as u32)
                .collect()
        })
        .collect();
    let rows = TokenRows::new(seqs.iter().enumerate().map(|(i, s)| Row {
        prompt: &s[..half],
        response: &s[half..],
        group: i as u64,
        observed: &[],
    }));
    let advantages: Vec<f32> = (0..rows.shape.len())
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let batch = PolicyBatch {
        rows: &rows,
        advantages: &advantages,
        old_logp: None,
        ref_logp: None,
        entropy: None,
    };
    let cfg = PolicyUpdate {
        loss: Default::default(),
        agg: LossAgg::TokenMean,
        temperature: 1.0,
        epochs: 1,
        rows_per_update: o.batch,
    };
    let schedule = LrSchedule::constant(1e-5);

    let mut engine = learner::engine::open(model.clone(), Backend::Native)?;
    let mut opt = Optimizer::new(&model.params, Default::default(), schedule, Some(1.0));
    let mut times = Vec::new();
    for i in 0..=o.steps {
        let t = Instant::now();
        learner::algo::policy::update(&mut *engine, &mut opt, batch, &cfg)?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let one = median(&times);

    // Hand-overs to a rollout engine in this process, each after an update, as an RL step's.
    let rollout = rollout::native::NativeEngine::new(
        model.clone(),
        rollout::native::NativeConfig {
            kv_cache_bytes: 1 << 20,
            ..Default::default()
        },
    );
    let (mut shared, mut copied) = (Vec::new(), Vec::new());
    let (mut served_steps, mut in_place_steps) = (Vec::new(), Vec::new());
    let mut shares_memory = true;
    for i in 1..=2 * o.steps as u64 + 1 {
        let t = Instant::now();
        learner::algo::policy::update(&mut *engine, &mut opt, batch, &cfg)?;
        let step_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let params = if i % 2 == 0 {
            engine.share_weights()?
        } else {
            // As before sharing: the policy's snapshot was a copy, and the engine took one of
            // its own (the pool keeps the snapshot for restarts).
            let copy = |set: &learner::Params| learner::Params {
                tensors: (set.tensors.iter())
                    .map(|t| kernels::tensor::Tensor {
                        name: t.name.clone(),
                        shape: t.shape.clone(),
                        data: t.data.to_vec().into(),
                    })
                    .collect(),
            };
            copy(&copy(&engine.model()?.params))
        };
        rollout.update_weights_blocking(WeightSnapshot::new(i, Arc::new(params)))?;
        let handover_s = t.elapsed().as_secs_f64();
        if i % 2 == 0 {
            // This update followed a copied hand-over.
            in_place_steps.push(step_s);
            shared.push(handover_s);
            let served = rollout.served_blocking()?;
            let trained = &engine.model()?.params;
            shares_memory &= (served.params.tensors.iter())
                .zip(&trained.tensors)
                .all(|(s, t)| s.data.same_memory(&t.data));
        } else {
            copied.push(handover_s);
            // This update followed a shared hand-over (or, the first, none).
            if i > 1 {
                served_steps.push(step_s);
            }
        }
    }
    drop((engine, rollout));

    let weights = WeightSnapshot::new(0, Arc::new(model.params));
    let gradient_bytes = params * 4;
    let mut runs = Vec::new();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| PoolError::Runtime(format!("cannot start a runtime: {e}")))?;
    let token = Token::generate().map_err(|e| PoolError::Runtime(e.to_string()))?;
    let head = rt
        .block_on(Head::serve(
            "127.0.0.1:0".parse().expect("an address"),
            token.clone(),
            HeadConfig::default(),
        ))
        .map_err(|e| PoolError::Runtime(format!("cannot start a head: {e}")))?;
    let token_file =
        std::env::temp_dir().join(format!("trellis-bench-{}.token", std::process::id()));
    token
        .write(&token_file)
        .map_err(|e| PoolError::Runtime(e.to_string()))?;
    let mut agents = Vec::new();
    for i in 0..o.ranks {
        // Room for a rank and a rollout engine beside it.
        agents.push(start_agent(
            &o.exe,
            &head,
            &token_file,
            &format!("bench-{i}"),
            2,
        )?);
    }
    let cluster = Cluster {
        head: ClusterHead::Shared(head.clone()),
        wait: Duration::from_secs(60),
    };
    let agents_here = Placement::Agents(Strategy::Spread);
    for (name, placement, sharded, allreduce) in [
        (
            "actors in this process",
            Placement::Local,
            false,
            AllReduce::Ranks,
        ),
        (
            "actors in this process",
            Placement::Local,
            true,
            AllReduce::Ranks,
        ),
        ("agents on this host", agents_here, true, AllReduce::Driver),
        ("agents on this host", agents_here, true, AllReduce::Streams),
        ("agents on this host", agents_here, true, AllReduce::Ranks),
    ] {
        let mut note = |_: &str| {};
        let mut pool = LearnerPool::start(LearnerStart {
            count: o.ranks,
            placement,
            device: Device::Cpu,
            cluster: Some(&cluster),
            stop: &|| false,
            note: &mut note,
            config: &o.config,
            weights: weights.clone(),
            assets: Vec::new(),
            shard_optimizer: sharded,
            allreduce,
            precision: kernels::matmul::Precision::F32,
            role: crate::kinds::learner::RankRole::Policy,
            beside: None,
        })?;
        pool.begin_stage(schedule, 1.0, None)?;
        let (mut steps, mut reduces, mut reads) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..=o.steps {
            let (t, r) = (Instant::now(), pool.reduce_seconds());
            pool.update(batch, &cfg)?;
            if i > 0 {
                steps.push(t.elapsed().as_secs_f64());
                reduces.push(pool.reduce_seconds() - r);
                let t = Instant::now();
                pool.snapshot(i as u64)?;
                reads.push(t.elapsed().as_secs_f64());
            }
        }
        let (step_s, allreduce_s) = (median(&steps), median(&reduces));
        runs.push(RankFigures {
            placement: name.into(),
            sharded,
            allreduce,
            optimizer_bytes_per_rank: pool.optimizer_bytes_per_rank()?,
            step_s,
            allreduce_s,
            allreduce_gbps: gradient_bytes as f64 / allreduce_s / 1e9,
            comm_share: allreduce_s / step_s,
            vs_one_engine: step_s / one,
            weights_read_s: median(&reads),
        });
    }
    let colocated = {
        let pair = |name: &str, kind: &str| {
            let mut spec = super::agent_spec(name, kind, o.ranks, Device::Cpu, Strategy::Spread);
            spec.colocate = Some("pairs".into());
            spec
        };
        let specs = [
            pair("rollout", crate::kinds::rollout::RolloutActor::KIND),
            pair("learner", crate::kinds::learner::LearnerActor::KIND),
        ];
        // The last run's actors give their room back as the agents report it.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match super::pairs(&head, &specs) {
                Ok(pairs) => break pairs,
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    };
    let beside = push(o, &cluster, &weights, (batch, &cfg), Some(colocated))?;
    // Engines on agents of their own: as many more agents, each taking one (spread: the ranks
    // and the engines each go to agents with no actor yet).
    for i in 0..o.ranks {
        agents.push(start_agent(
            &o.exe,
            &head,
            &token_file,
            &format!("bench-e{i}"),
            1,
        )?);
    }
    rt.block_on(head.wait_for_agents(2 * o.ranks, Duration::from_secs(60)))?;
    let apart = push(o, &cluster, &weights, (batch, &cfg), None)?;
    // The head first: agents it still knows are not reported lost.
    rt.block_on(head.shutdown(false));
    drop(agents);
    let _ = std::fs::remove_file(&token_file);
    Ok(LearnerBench {
        params,
        gradient_bytes,
        ranks: o.ranks,
        batch: o.batch,
        seq: o.seq,
        one_engine_step_s: one,
        pushes: vec![beside, apart],
        handover_shared_s: median(&shared),
        handover_copied_s: median(&copied),
        handover_shares_memory: shares_memory,
        step_while_served_s: median(&served_steps),
        step_in_place_s: median(&in_place_steps),
        runs,
    })
}
