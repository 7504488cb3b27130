//! The actor runtime across real processes on loopback: a head (this test process) and
//! `trellis agent` processes. Spawning and calling, kill -9 of an agent and the restart of its
//! actor on the other agent with its weights re-pushed, 100 MB snapshots through shared memory
//! and over gRPC with matching checksums, a wrong token refused, and clean shutdown.

use actors::builtin::{Ping, PingRequest, PingResponse};
use actors::snapshot::content_crc;
use actors::{ActorError, ActorRef, Head, HeadConfig, PoolSpec, RestartHook, SpawnOptions, Token};
use kernels::tensor::Tensor;
use kernels::tensor::TensorSet as Params;
use kernels::tensor::WeightSnapshot;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    name: String,
}

impl Agent {
    fn start(head: &Head, token_file: &Path, name: &str) -> Agent {
        let child = Command::new(trellis_tests::trellis_bin())
            .args([
                "--log",
                "warn",
                "agent",
                "--head",
                &format!("http://{}", head.address()),
            ])
            .arg("--token-file")
            .arg(token_file)
            .args([
                "--resources",
                "cpu=2",
                "--name",
                name,
                "--labels",
                "role=test",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start trellis agent");
        Agent {
            child,
            name: name.into(),
        }
    }

    fn wait(mut self, within: Duration) -> (std::process::ExitStatus, String) {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                return (status, err);
            }
            assert!(
                t0.elapsed() < within,
                "agent `{}` did not exit within {within:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn scratch(name: &str) -> PathBuf {
    trellis_tests::scratch(&format!("actors-{name}"))
}

fn token_file(dir: &Path, token: &Token) -> PathBuf {
    let path = dir.join("token");
    token.write(&path).expect("write token");
    path
}

fn config(shared_memory: bool) -> HeadConfig {
    let mut c = HeadConfig {
        heartbeat_interval: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_secs(2),
        ..HeadConfig::default()
    };
    c.wire.shared_memory = shared_memory;
    c
}

/// 100 MB of weights in 25 tensors, contents depending on `version`.
fn weights(version: u64) -> WeightSnapshot {
    let per = 1 << 20;
    let tensors = (0..25)
        .map(|i| Tensor {
            name: format!("model.layers.{i}.mlp.weight"),
            shape: vec![1024, per / 1024],
            data: (0..per)
                .map(|j| ((i * 7 + j) % 997) as f32 * 0.01 + version as f32)
                .collect(),
        })
        .collect();
    WeightSnapshot::new(version, Arc::new(Params { tensors }))
}

async fn held(actor: &ActorRef<Ping>) -> (Option<u64>, u64, u32) {
    match actor.call(PingRequest::Weights).await.expect("answers") {
        PingResponse::Weights {
            version,
            bytes,
            crc32c,
            ..
        } => (version, bytes, crc32c),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_host_actors_and_a_killed_agents_actor_restarts_on_the_other_with_its_weights() {
    let dir = scratch("kill");
    let token = Token::generate().expect("urandom");
    let tf = token_file(&dir, &token);
    let head = Head::serve(([127, 0, 0, 1], 0).into(), token, config(true))
        .await
        .expect("head binds");
    let a = Agent::start(&head, &tf, "agent-a");
    let b = Agent::start(&head, &tf, "agent-b");
    let agents = head
        .wait_for_agents(2, Duration::from_secs(60))
        .await
        .expect("both agents register");
    assert!(
        agents
            .iter()
            .all(|i| i.labels.get("role").map(String::as_str) == Some("test"))
    );

    let current = weights(1);
    let pushed = current.clone();
    let hook: RestartHook<Ping> = Arc::new(move |actor| {
        let w = pushed.clone();
        Box::pin(async move { actor.load_weights(w).await })
    });
    let pool = PoolSpec {
        name: "rollout".into(),
        kind: "ping".into(),
        actors: 2,
        device: actors::Device::Cpu,
        per_actor: 1,
        strategy: actors::Strategy::Spread,
        labels: [("role".to_string(), "test".to_string())].into(),
        colocate: None,
    };
    let options = SpawnOptions {
        on_restart: Some(hook),
        ..SpawnOptions::default()
    };
    let pool = head
        .spawn_pool::<Ping>(&pool, |_| (), options)
        .await
        .expect("placed and spawned");
    let mut places: Vec<String> = pool.iter().map(|r| r.location()).collect();
    places.sort();
    assert_eq!(places, ["agent-a", "agent-b"]);
    for r in &pool {
        let echo = r
            .call(PingRequest::Echo(r.name().into()))
            .await
            .expect("answers");
        assert_eq!(echo, PingResponse::Echo(r.name().into()));
        // 100 MB through shared memory: the agent holds exactly these bytes.
        r.load_weights(current.clone()).await.expect("pushed");
        assert_eq!(
            held(r).await,
            (Some(1), 100 << 20, content_crc(current.params().unwrap()))
        );
    }

    // kill -9 agent-a: its actor is detected dead and restarted on agent-b, weights re-pushed.
    let victim = pool
        .iter()
        .find(|r| r.location() == "agent-a")
        .expect("one on a")
        .clone();
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(a.child.id() as i32, libc::SIGKILL) }, 0);
    let t0 = Instant::now();
    let answer = loop {
        match victim.call(PingRequest::Weights).await {
            Err(ActorError::Died { .. }) => tokio::time::sleep(Duration::from_millis(10)).await,
            other => break other.expect("restarted"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no restart after {:?}",
            t0.elapsed()
        );
    };
    eprintln!("kill -9 → restarted actor answering: {:?}", t0.elapsed());
    assert_eq!(victim.location(), "agent-b");
    assert!(
        matches!(answer, PingResponse::Weights { version: Some(1), crc32c, .. } if crc32c == content_crc(current.params().unwrap())),
        "{answer:?}"
    );
    assert_eq!(head.agents().len(), 1);
    drop(a);

    // Job end: the head tells agents to stop; they exit cleanly.
    head.shutdown(true).await;
    let (status, stderr) = b.wait(Duration::from_secs(20));
    assert!(status.success(), "agent-b exited with {status}: {stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_snapshot_crosses_processes_over_grpc_and_a_wrong_token_is_refused() {
    let dir = scratch("grpc");
    let token = Token::generate().expect("urandom");
    let tf = token_file(&dir, &token);
    let head = Head::serve(([127, 0, 0, 1], 0).into(), token, config(false))
        .await
        .expect("head binds");

    let wrong_dir = dir.join("wrong");
    std::fs::create_dir_all(&wrong_dir).expect("dir");
    let wrong = token_file(&wrong_dir, &Token::generate().expect("urandom"));
    let intruder = Agent::start(&head, &wrong, "intruder");
    let (status, stderr) = intruder.wait(Duration::from_secs(30));
    assert!(!status.success());
    assert!(
        stderr.contains("refused this agent: wrong cluster token"),
        "{stderr}"
    );

    let agent = Agent::start(&head, &tf, "agent-c");
    let agents = head
        .wait_for_agents(1, Duration::from_secs(60))
        .await
        .expect("registers");
    assert_eq!(
        agents.len(),
        1,
        "only the agent with the right token joined"
    );
    let ping = head
        .spawn::<Ping>(
            "p",
            (),
            actors::Demand::new("ping", actors::Device::Cpu, 1),
            // Once its only agent is gone, each restart waits `place_wait` for another with
            // room (by default 120 s: 3 restarts held this test for 6 minutes).
            SpawnOptions {
                restart: actors::RestartPolicy {
                    place_wait: Duration::from_secs(1),
                    ..actors::RestartPolicy::default()
                },
                ..SpawnOptions::default()
            },
        )
        .await
        .expect("spawned");
    for version in [4, 5] {
        let w = weights(version);
        ping.load_weights(w.clone()).await.expect("streamed");
        assert_eq!(
            held(&ping).await,
            (Some(version), 100 << 20, content_crc(w.params().unwrap()))
        );
    }
    // An agent stopped by SIGTERM exits cleanly and the head notices.
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(
        unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) },
        0
    );
    let (status, stderr) = agent.wait(Duration::from_secs(20));
    assert!(status.success(), "{status}: {stderr}");
    let e = loop {
        match ping.call(PingRequest::Echo("x".into())).await {
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => break e,
        }
    };
    assert!(
        e.to_string().contains("ping") || e.to_string().contains("`p`"),
        "{e}"
    );
    head.shutdown(false).await;
    let _ = std::fs::remove_dir_all(&dir);
}
