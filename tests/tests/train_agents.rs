//! `trellis train` with its rollout pool on `trellis agent` processes (loopback): the run's
//! results equal an in-process run's, and an agent killed with -9 mid-run costs nothing but a
//! restart of its engine on the other agent; episodes play beside an engine on an agent.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use trellis_tests::{Killed, PATIENCE, metric_rows, run_ok, trellis};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-arith.yaml")
}

fn scratch(tag: &str) -> PathBuf {
    trellis_tests::scratch(&format!("agents-{tag}"))
}

fn agent(url: &str, token: &Path, name: &str) -> Killed {
    Killed(
        trellis()
            .args([
                "--log",
                "warn",
                "agent",
                "--head",
                url,
                "--resources",
                "cpu=2",
            ])
            .arg("--token-file")
            .arg(token)
            .args(["--name", name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start trellis agent"),
    )
}

const ROLLOUTS_ON_AGENTS: [&str; 6] = [
    "-o",
    "pools.rollout.count=2",
    "-o",
    "stages.rl.trainer.steps=8",
    "-o",
    "pools.rollout.placement=spread",
];

/// Starts `trellis train` with `args` listening for agents; returns it, the agents' URL, and
/// its stderr lines as they come.
fn train_on_agents(
    dir: &Path,
    token: &Path,
    args: &[&str],
) -> (Killed, String, mpsc::Receiver<String>) {
    let mut child = trellis()
        .arg("train")
        .arg(recipe())
        .args(args)
        .args(["--quiet", "--run-dir"])
        .arg(dir.join("run"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--agent-wait",
            "60",
            "--token-file",
        ])
        .arg(token)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let t0 = Instant::now();
    let url = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("trellis train says where agents register");
        if let Some(i) = line.find("http://") {
            break line[i..].trim().to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
    };
    (Killed(child), url, rx)
}

/// Fails the test, with what the run said, if `train` has already ended.
fn ended_early(train: &mut Killed, lines: &mpsc::Receiver<String>) {
    if let Some(status) = train.0.try_wait().unwrap() {
        std::thread::sleep(Duration::from_millis(200));
        let said: Vec<String> = lines.try_iter().collect();
        panic!("the run ended early: {status}\n{}", said.join("\n"));
    }
}

fn wait_ok(child: &mut Killed, lines: &mpsc::Receiver<String>) -> Vec<String> {
    let status = child.0.wait().unwrap();
    let said: Vec<String> = lines.try_iter().collect();
    assert!(
        status.success(),
        "trellis train failed:\n{}",
        said.join("\n")
    );
    said
}

#[test]
fn a_rollout_pool_on_two_agents_trains_like_one_in_process_and_survives_a_killed_agent() {
    let dir = scratch("pool");
    // The in-process reference.
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .args(&ROLLOUTS_ON_AGENTS[..4])
            .args(["--quiet", "--run-dir"])
            .arg(dir.join("local")),
    );
    let reference = metric_rows(&dir.join("local"));
    let token = dir.join("cluster.token");

    // Two agents, one engine on each (spread); the run is step for step the in-process one.
    let (mut train, url, lines) = train_on_agents(&dir, &token, &ROLLOUTS_ON_AGENTS);
    let _a1 = agent(&url, &token, "a1");
    let _a2 = agent(&url, &token, "a2");
    let said = wait_ok(&mut train, &lines);
    let placed = said
        .iter()
        .find(|l| l.starts_with("rollout pool:") && !l.contains("waiting"))
        .unwrap_or_else(|| panic!("no placement line in {said:?}"));
    assert!(
        placed.contains("a1") && placed.contains("a2"),
        "spread over both agents: {placed}"
    );
    assert_eq!(metric_rows(&dir.join("run")), reference);
    std::fs::remove_dir_all(dir.join("run")).unwrap();

    // kill -9 one agent during the RL stage: its engine restarts on the other agent with the
    // current weights, the lost call is made again, and nothing about the run changes.
    let (mut train, url, lines) = train_on_agents(&dir, &token, &ROLLOUTS_ON_AGENTS);
    let mut a1 = agent(&url, &token, "a1");
    let _a2 = agent(&url, &token, "a2");
    let t0 = Instant::now();
    while !dir.join("run/checkpoints/rl").exists() {
        assert!(t0.elapsed() < PATIENCE, "the RL stage never started");
        ended_early(&mut train, &lines);
        std::thread::sleep(Duration::from_millis(2));
    }
    a1.0.kill().unwrap();
    a1.0.wait().unwrap();
    let said = wait_ok(&mut train, &lines);
    assert!(
        said.iter()
            .any(|l| l.contains("actor restarted") && l.contains("rollout-0")),
        "the killed agent's engine was restarted:\n{}",
        said.join("\n")
    );
    assert_eq!(metric_rows(&dir.join("run")), reference);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Waits for the RL stage's checkpoint of step 4, then kills `victim` with -9.
fn kill_in_rl(dir: &Path, train: &mut Killed, lines: &mpsc::Receiver<String>, victim: &mut Killed) {
    let t0 = Instant::now();
    while !dir
        .join("checkpoints/rl/step_000004/trainer_state.json")
        .exists()
    {
        assert!(t0.elapsed() < PATIENCE, "the RL stage never checkpointed");
        ended_early(train, lines);
        std::thread::sleep(Duration::from_millis(2));
    }
    victim.0.kill().unwrap();
    victim.0.wait().unwrap();
}

/// Pools that cannot be placed together are refused before anything starts. The policy's
/// learner ranks on two agents (`pools.learner.placement: spread`) train as the same ranks in
/// the process do, bit for bit — summing over TCP streams between the agents as through shared
/// memory; kill -9 of an agent holding a rank mid-RL is
/// found within the step, and the job continues by itself from its last checkpoint with new
/// ranks — on the agent that is left — to the undisturbed run's metrics; so does a frozen one,
/// within its heartbeat timeout.
#[test]
fn learner_ranks_on_two_agents_train_as_in_process_ones_and_recover_from_a_killed_agent() {
    let dir = scratch("learners");
    let ranks = ["-o", "pools.learner.count=2"];
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .args(ranks)
            .args(["--quiet", "--run-dir"])
            .arg(dir.join("local")),
    );
    let reference = metric_rows(&dir.join("local"));
    let token = dir.join("cluster.token");
    let args = [ranks[0], ranks[1], "-o", "pools.learner.placement=spread"];

    // Pools that cannot be placed together are refused before either starts, naming what is
    // missing: one agent of 2 CPUs for an engine and 3 ranks.
    let cramped = [
        "-o",
        "pools.learner.count=3",
        "-o",
        "pools.learner.placement=spread",
        "-o",
        "pools.rollout.placement=spread",
    ];
    let mut train = trellis()
        .arg("train")
        .arg(recipe())
        .args(cramped)
        .args(["--quiet", "--run-dir"])
        .arg(dir.join("cramped"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--agent-wait",
            "10",
            "--token-file",
        ])
        .arg(&token)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = BufReader::new(train.stderr.take().unwrap());
    let mut said = Vec::new();
    let mut only = None;
    for line in err.lines().map_while(Result::ok) {
        if only.is_none()
            && let Some(i) = line.find("http://")
        {
            only = Some(agent(line[i..].trim(), &token, "only"));
        }
        said.push(line);
    }
    assert!(!train.wait().unwrap().success(), "{said:?}");
    let said = said.join("\n");
    assert!(
        said.contains("cannot place pool `learner`") && said.contains("1 of 3 placed"),
        "{said}"
    );
    assert!(!said.contains("spawned"), "nothing started: {said}");
    drop(only);

    // Over TCP streams between the agents, as ranks on two hosts sum; the rollout engine on
    // an agent too, taking every new version of the weights from the ranks (each rank serving
    // its shard, or the rank in its own process) instead of from the driver.
    let streams = [
        &args[..],
        &["-o", "pools.learner.allreduce=streams"],
        &["-o", "pools.rollout.placement=spread"],
    ]
    .concat();
    let (mut train, url, lines) = train_on_agents(&dir, &token, &streams);
    let _a1 = agent(&url, &token, "a1");
    let _a2 = agent(&url, &token, "a2");
    let said = wait_ok(&mut train, &lines);
    assert!(
        said.iter()
            .any(|l| l == "learner ranks: a1, a2" || l == "learner ranks: a2, a1"),
        "one rank on each agent:\n{}",
        said.join("\n")
    );
    assert_eq!(metric_rows(&dir.join("run")), reference);
    let rows = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    // The engine shares an agent with a rank: it takes the weights from that rank's memory
    // (`beside`) where it can, else reads them from the ranks' outboxes.
    let from_ranks = rows
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| {
            let took = |k: &str| r[k].as_f64().unwrap_or(0.0);
            took("perf/weight_sync_from_ranks") + took("perf/weight_sync_beside") == 1.0
        })
        .count();
    let trained = reference
        .iter()
        .filter(|r| r.get("actor/grad_norm").is_some())
        .count();
    assert_eq!(
        from_ranks, trained,
        "after every update the engine took the weights from the ranks"
    );
    std::fs::remove_dir_all(dir.join("run")).unwrap();

    // Colocated: two engines, each in the agent process of a rank (the pairs spread over the
    // agents), taking every new version from that rank's memory — shared, nothing read.
    let colocated = [
        &args[..],
        &["-o", "pools.rollout.count=2"],
        &["-o", "pools.rollout.placement=colocate"],
    ]
    .concat();
    let (mut train, url, lines) = train_on_agents(&dir, &token, &colocated);
    let _a1 = agent(&url, &token, "a1");
    let _a2 = agent(&url, &token, "a2");
    let said = wait_ok(&mut train, &lines);
    let where_ = |prefix: &str| {
        let line = said.iter().find_map(|l| l.strip_prefix(prefix));
        line.unwrap_or_else(|| panic!("no `{prefix}` line:\n{}", said.join("\n")))
    };
    let engines = where_("rollout pool: ");
    assert!(
        engines == where_("learner ranks: ") && (engines == "a1, a2" || engines == "a2, a1"),
        "engine i beside rank i, a pair on each agent:\n{}",
        said.join("\n")
    );
    // Two engines batch the prompts otherwise than one: their log-probs (so the gap to the
    // learner's) differ in the last bits; the rest is equal.
    let engines_aside = |rows: Vec<serde_json::Value>, engines: f64| -> Vec<serde_json::Value> {
        rows.into_iter()
            .map(|mut r| {
                let r_ = r.as_object_mut().unwrap();
                if let Some(n) = r_.remove("rollout/engines") {
                    assert_eq!(n.as_f64(), Some(engines));
                }
                r_.retain(|k, _| !k.starts_with("rollout/logprob_diff"));
                r
            })
            .collect()
    };
    assert_eq!(
        engines_aside(metric_rows(&dir.join("run")), 2.0),
        engines_aside(reference.clone(), 1.0)
    );
    let rows = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let beside = rows
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["perf/weight_sync_beside"].as_f64() == Some(2.0))
        .count();
    assert_eq!(
        beside, trained,
        "after every update both engines took the weights from the rank beside them"
    );
    std::fs::remove_dir_all(dir.join("run")).unwrap();

    let (mut train, url, lines) = train_on_agents(&dir, &token, &args);
    let mut a1 = agent(&url, &token, "a1");
    let _a2 = agent(&url, &token, "a2");
    kill_in_rl(&dir.join("run"), &mut train, &lines, &mut a1);
    let said = wait_ok(&mut train, &lines);
    assert!(
        said.iter()
            .any(|l| l.contains("learner rank lost") && l.contains("recovery 1 of 3")),
        "the lost rank was recovered from the checkpoint:\n{}",
        said.join("\n")
    );
    assert!(
        said.iter().any(|l| l == "learner ranks: a2, a2"),
        "new ranks on the agent left:\n{}",
        said.join("\n")
    );
    assert_eq!(metric_rows(&dir.join("run")), reference);
    std::fs::remove_dir_all(dir.join("run")).unwrap();

    // A frozen agent (SIGSTOP: its connection stays open) is lost when its heartbeats stop,
    // and the calls waiting on its rank fail then, not when the transport gives up.
    let (mut train, url, lines) = train_on_agents(&dir, &token, &args);
    let a1 = agent(&url, &token, "a1");
    let _a2 = agent(&url, &token, "a2");
    let mut frozen_at = None;
    let t0 = Instant::now();
    while frozen_at.is_none() {
        if dir
            .join("run/checkpoints/rl/step_000004/trainer_state.json")
            .exists()
        {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(a1.0.id() as i32, libc::SIGSTOP) };
            frozen_at = Some(Instant::now());
        }
        assert!(t0.elapsed() < PATIENCE, "no RL checkpoint");
        ended_early(&mut train, &lines);
        std::thread::sleep(Duration::from_millis(2));
    }
    let said = wait_ok(&mut train, &lines);
    // SAFETY: as above; the agent is killed when dropped.
    unsafe { libc::kill(a1.0.id() as i32, libc::SIGCONT) };
    assert!(
        said.iter()
            .any(|l| l.contains("learner rank lost") && l.contains("no heartbeat")),
        "the frozen agent's rank was lost by its heartbeats:\n{}",
        said.join("\n")
    );
    assert_eq!(metric_rows(&dir.join("run")), reference);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `trellis bench learners` as a user runs it: one engine, then the ranks as actors in the
/// process (replicated optimiser state, then ZeRO-1) and on agents it starts (the driver
/// summing, then the ranks over streams and through shared memory), each with a step time, an
/// all-reduce rate and the optimiser state a rank keeps; then pushes of the ranks' weights to
/// rollout engines beside them and on agents of their own.
#[test]
fn bench_learners_times_ranks_in_the_process_and_on_agents() {
    let out = run_ok(trellis().args([
        "--log", "warn", "bench", "learners", "--ranks", "2", "--batch", "2", "--seq", "8",
        "--steps", "1", "--hidden", "64", "--layers", "1", "--json",
    ]));
    let b: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(b["ranks"], 2, "{b}");
    assert!(b["one_engine_step_s"].as_f64().unwrap() > 0.0, "{b}");
    let runs = b["runs"].as_array().unwrap();
    let places: Vec<(&str, bool, &str)> = runs
        .iter()
        .map(|r| {
            (
                r["placement"].as_str().unwrap(),
                r["sharded"].as_bool().unwrap(),
                r["allreduce"].as_str().unwrap(),
            )
        })
        .collect();
    let (here, agents) = ("actors in this process", "agents on this host");
    assert_eq!(
        places,
        [
            (here, false, "ranks"),
            (here, true, "ranks"),
            (agents, true, "driver"),
            (agents, true, "streams"),
            (agents, true, "ranks")
        ]
    );
    // ZeRO-1 halves a rank's optimiser state (its shard is at most one value longer).
    let bytes = |i: usize| runs[i]["optimizer_bytes_per_rank"].as_u64().unwrap() as i64;
    assert!(
        (2 * bytes(1) - bytes(0)).abs() <= 8,
        "{} vs {}",
        bytes(1),
        bytes(0)
    );
    assert_eq!(bytes(0), 2 * b["gradient_bytes"].as_i64().unwrap());
    for r in runs {
        for k in [
            "step_s",
            "allreduce_s",
            "allreduce_gbps",
            "comm_share",
            "weights_read_s",
        ] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
        }
    }
    // The hand-over in a process shares the learner's memory; engines beside the ranks take
    // the weights from them, engines on agents of their own read them.
    assert_eq!(b["handover_shares_memory"], true, "{b}");
    let pushes = b["pushes"].as_array().unwrap();
    let took: Vec<(&str, u64, u64)> = pushes
        .iter()
        .map(|p| {
            assert!(p["push_s"].as_f64().unwrap() > 0.0, "{p}");
            let n = |k: &str| p[k].as_u64().unwrap();
            (p["engines"].as_str().unwrap(), n("beside"), n("from_ranks"))
        })
        .collect();
    assert_eq!(
        took,
        [("beside the ranks", 2, 0), ("on agents of their own", 0, 2)]
    );
    // Bad input is refused before anything runs.
    let refused = trellis()
        .args(["bench", "learners", "--ranks", "1"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--ranks needs at least 2"));
}

#[test]
fn episodes_play_beside_an_engine_on_an_agent_as_in_process() {
    let dir = scratch("episodes");
    // The RL stage's problems (one-digit sums) as guessing games, three turns each; the final
    // eval plays them too.
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/python/guess_env.py");
    let builtin = "stages.rl.data.env={type: guess, max_turns: 3}".to_string();
    let program = format!(
        "stages.rl.data.env={{type: command, name: guess, max_turns: 3, command: [python3, {}]}}",
        python.display()
    );
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe())
            .args(["-o", &builtin, "-o", "stages.rl.trainer.steps=4"])
            .args(["--quiet", "--run-dir"])
            .arg(dir.join("local")),
    );
    let reference = metric_rows(&dir.join("local"));
    assert!(
        reference
            .iter()
            .any(|r| r["episode/turns/mean"].as_f64().is_some_and(|t| t > 1.0)),
        "games of more than one turn"
    );
    // The engine on an agent plays the episodes there — the Python environment's processes
    // start on the agent's host — and the run is the in-process one.
    let token = dir.join("cluster.token");
    let (mut train, url, lines) = train_on_agents(
        &dir,
        &token,
        &[
            "-o",
            &program,
            "-o",
            "stages.rl.trainer.steps=4",
            "-o",
            "pools.rollout.placement=spread",
        ],
    );
    let _a1 = agent(&url, &token, "a1");
    wait_ok(&mut train, &lines);
    assert_eq!(metric_rows(&dir.join("run")), reference);
    std::fs::remove_dir_all(&dir).unwrap();
}
