//! `trellis bench actors`: call latency and throughput of local and remote actors, and weight
//! snapshot bandwidth in-process, through shared memory and over gRPC, all in one run.
//!
//! Remote figures use a real agent process (the `trellis` binary's `agent` subcommand) on
//! loopback. Owns: measurement only.

use crate::actor::{ActorRef, SpawnOptions, spawn_local};
use crate::auth::Token;
use crate::builtin::{Ping, PingRequest, PingResponse};
use crate::error::ActorError;
use crate::head::{Head, HeadConfig};
use crate::placement::{Demand, Device};
use crate::snapshot::content_crc;
use kernels::tensor::Tensor;
use kernels::tensor::TensorSet;
use kernels::tensor::WeightSnapshot;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The `trellis` executable that runs `agent`.
    pub exe: PathBuf,
    /// Sequential calls timed for the latency percentiles.
    pub calls: usize,
    /// Concurrent callers for the throughput figure.
    pub in_flight: usize,
    /// How long the throughput run lasts.
    pub throughput_for: Duration,
    /// Snapshot size.
    pub snapshot_bytes: usize,
    /// Timed snapshot pushes after the first (their median is reported beside the first's).
    pub snapshot_repeats: usize,
}

/// The figures, in the units the issue asks for.
#[derive(Clone, Debug, Serialize)]
pub struct ActorBench {
    pub local_p50_us: f64,
    pub local_p99_us: f64,
    pub remote_p50_us: f64,
    pub remote_p99_us: f64,
    pub remote_calls_per_s: f64,
    pub in_flight: usize,
    pub snapshot_bytes: usize,
    pub in_process_gbps: Rate,
    pub shm_gbps: Rate,
    pub grpc_gbps: Rate,
    /// Over gRPC with every tensor sent as bf16 (half the bytes), counted in the snapshot's f32
    /// bytes: the rate a bf16-serving engine on another host takes a push at.
    pub grpc_bf16_gbps: Rate,
}

/// An agent process, killed when dropped.
struct AgentProcess(Child);

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_agent(
    exe: &Path,
    head: &Head,
    token_file: &Path,
    name: &str,
) -> Result<AgentProcess, ActorError> {
    Command::new(exe)
        .args(["agent", "--head", &format!("http://{}", head.address())])
        .arg("--token-file")
        .arg(token_file)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--resources",
            "cpu=2",
            "--name",
            name,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .args(["--log", "warn"])
        .spawn()
        .map(AgentProcess)
        .map_err(|e| ActorError::Agent {
            agent: name.to_string(),
            message: format!("cannot start {} agent: {e}", exe.display()),
        })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn latencies(actor: &ActorRef<Ping>, calls: usize) -> Result<(f64, f64), ActorError> {
    for _ in 0..calls.min(1000) {
        actor.call(PingRequest::Echo(String::new())).await?;
    }
    let mut us = Vec::with_capacity(calls);
    for _ in 0..calls {
        let t = Instant::now();
        actor.call(PingRequest::Echo(String::new())).await?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    Ok((percentile(&us, 0.5), percentile(&us, 0.99)))
}

async fn throughput(
    actor: &ActorRef<Ping>,
    in_flight: usize,
    duration: Duration,
) -> Result<f64, ActorError> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let actor = actor.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while start.elapsed() < duration {
                actor.call(PingRequest::Echo(String::new())).await?;
                n += 1;
            }
            Ok::<u64, ActorError>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.map_err(|e| ActorError::Died {
            actor: "bench".into(),
            reason: e.to_string(),
        })??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// Weights of about `bytes` bytes in 64 MiB tensors, with deterministic contents.
fn weights(bytes: usize) -> Arc<TensorSet> {
    let per = (64 << 20) / 4;
    let total = (bytes / 4).max(1);
    let tensors = (0..total.div_ceil(per))
        .map(|i| {
            let n = per.min(total - i * per);
            Tensor {
                name: format!("model.layers.{i}.weight"),
                shape: vec![n],
                data: (0..n)
                    .map(|j| ((i * per + j) % 1021) as f32 * 0.5)
                    .collect(),
            }
        })
        .collect();
    Arc::new(TensorSet { tensors })
}

/// GB/s of the first push (buffers and shared memory allocated on the way) and the median of
/// the later ones (every RL step after the first).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Rate {
    pub cold: f64,
    pub warm: f64,
}

/// Pushes `params` `repeats + 1` times (the tensors `bf16` marks as bf16), then checks that
/// the actor holds exactly what was sent (their bf16 rounding, for those).
async fn push_rate(
    actor: &ActorRef<Ping>,
    params: &Arc<TensorSet>,
    repeats: usize,
    bf16: Option<&[bool]>,
) -> Result<Rate, ActorError> {
    let bytes = params.numel() as f64 * 4.0;
    let mut rates = Vec::new();
    for r in 0..=repeats.max(1) {
        let next = WeightSnapshot::new(1 + r as u64, params.clone());
        let t = Instant::now();
        actor.load_weights_as(next, bf16).await?;
        rates.push(bytes / t.elapsed().as_secs_f64() / 1e9);
    }
    let mut sent = (**params).clone();
    for (t, &m) in sent.tensors.iter_mut().zip(bf16.unwrap_or(&[])) {
        if m {
            t.data = kernels::bf16::rounded(&t.data).into();
        }
    }
    let expect = content_crc(&sent);
    match actor.call(PingRequest::Weights).await? {
        PingResponse::Weights { crc32c, .. } if crc32c == expect => {}
        other => {
            return Err(ActorError::Snapshot {
                actor: actor.name().to_string(),
                message: format!("holds {other:?}, expected CRC-32C {expect:#010x}"),
            });
        }
    }
    let cold = rates.remove(0);
    rates.sort_by(f64::total_cmp);
    Ok(Rate {
        cold,
        warm: rates.get(rates.len() / 2).copied().unwrap_or(cold),
    })
}

/// Runs every measurement.
pub async fn run(options: &BenchOptions) -> Result<ActorBench, ActorError> {
    let local = spawn_local::<Ping>("bench-local", (), SpawnOptions::default()).await?;
    let (local_p50_us, local_p99_us) = latencies(&local, options.calls).await?;
    let weights = weights(options.snapshot_bytes);
    let in_process_gbps = push_rate(&local, &weights, options.snapshot_repeats, None).await?;
    local.stop();

    let token = Token::generate().map_err(|e| ActorError::Agent {
        agent: "bench".into(),
        message: e.to_string(),
    })?;
    let dir = std::env::temp_dir().join(format!("trellis-bench-actors-{}", std::process::id()));
    let io = |e: std::io::Error| ActorError::Agent {
        agent: "bench".into(),
        message: format!("{}: {e}", dir.display()),
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let token_file = dir.join("token");
    token.write(&token_file).map_err(|e| ActorError::Agent {
        agent: "bench".into(),
        message: e.to_string(),
    })?;

    let (mut latency, mut calls_per_s) = ((0.0, 0.0), 0.0);
    let (mut shm_gbps, mut grpc_gbps, mut grpc_bf16_gbps) = Default::default();
    for shared_memory in [true, false] {
        let mut config = HeadConfig::default();
        config.wire.shared_memory = shared_memory;
        let head = Head::serve(([127, 0, 0, 1], 0).into(), token.clone(), config)
            .await
            .map_err(io)?;
        let _agent = spawn_agent(&options.exe, &head, &token_file, "bench-agent")?;
        head.wait_for_agents(1, Duration::from_secs(30)).await?;
        let remote = head
            .spawn::<Ping>(
                "bench-remote",
                (),
                Demand::new("ping", Device::Cpu, 1),
                SpawnOptions::default(),
            )
            .await?;
        let rate = push_rate(&remote, &weights, options.snapshot_repeats, None).await?;
        if shared_memory {
            latency = latencies(&remote, options.calls).await?;
            calls_per_s = throughput(&remote, options.in_flight, options.throughput_for).await?;
            shm_gbps = rate;
        } else {
            grpc_gbps = rate;
            let all = vec![true; weights.tensors.len()];
            grpc_bf16_gbps =
                push_rate(&remote, &weights, options.snapshot_repeats, Some(&all)).await?;
        }
        remote.stop();
        head.shutdown(true).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ActorBench {
        local_p50_us,
        local_p99_us,
        remote_p50_us: latency.0,
        remote_p99_us: latency.1,
        remote_calls_per_s: calls_per_s,
        in_flight: options.in_flight,
        snapshot_bytes: weights.numel() * 4,
        in_process_gbps,
        shm_gbps,
        grpc_gbps,
        grpc_bf16_gbps,
    })
}
