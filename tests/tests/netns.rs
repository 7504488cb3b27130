//! Across hosts, on this machine: network namespaces this test makes (one for the head, one per
//! agent, joined by veth pairs on a bridge in a private test subnet), each agent with its own
//! hostname, so nothing is shared but the kernel. A real job runs across them; one agent's link
//! is cut mid-job (`ip link set … down`): the head declares it lost, restarts its engine on the
//! other agent with the current weights, and the job finishes with the numbers of a run in one
//! process; the link comes back and the agent registers again. Then the policy trains on a
//! learner rank on each host, the ranks summing their gradients over TCP streams between the
//! hosts' addresses, to the numbers of the same ranks in one process. Everything is torn down
//! afterwards, and nothing talks to an address outside the namespaces the test made.
//!
//! Needs root and `ip` (iproute2) and `unshare` (util-linux); without them the test fails
//! saying so, unless `TRELLIS_SKIP_NETNS=1` asks to skip it (CI refuses that).

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use trellis_tests::{Killed, PATIENCE, metric_rows, run_ok, trellis, trellis_bin};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-arith.yaml")
}

/// Whether the test runs: `false` only when `TRELLIS_SKIP_NETNS=1` asks to skip it; a host that
/// cannot make namespaces fails the test.
fn can_run() -> bool {
    if std::env::var_os("TRELLIS_SKIP_NETNS").is_some_and(|v| v == "1") {
        eprintln!("*** SKIPPED: TRELLIS_SKIP_NETNS=1 skips the cross-host test ***");
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let tools = ["ip", "unshare"].iter().all(|t| {
        Command::new(t)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    });
    assert!(
        root && tools,
        "the cross-host test needs root, `ip` (iproute2) and `unshare` (util-linux) to make network namespaces; run as root with them installed, or set TRELLIS_SKIP_NETNS=1 to skip it"
    );
    true
}

/// `ip ARGS`, which must succeed.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces, deleted (with their links) when dropped.
struct Net {
    head: String,
    agents: Vec<String>,
    /// The agent side of each agent's veth pair.
    links: Vec<String>,
    subnet: String,
}

impl Net {
    fn make(agents: usize) -> Net {
        let id = std::process::id() % 100_000;
        let subnet = format!("10.213.{}", 1 + id % 250);
        let head = format!("trh{id}");
        let net = Net {
            agents: (0..agents).map(|i| format!("tra{id}x{i}")).collect(),
            links: (0..agents).map(|i| format!("tr{id}x{i}b")).collect(),
            head,
            subnet,
        };
        for ns in std::iter::once(&net.head).chain(&net.agents) {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        ip(&["-n", &net.head, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &net.head, "link", "set", "br0", "up"]);
        let head_addr = format!("{}.1/24", net.subnet);
        ip(&["-n", &net.head, "addr", "add", &head_addr, "dev", "br0"]);
        for (i, ns) in net.agents.iter().enumerate() {
            let near = format!("tr{id}x{i}a");
            let far = &net.links[i];
            ip(&[
                "link", "add", &near, "netns", &net.head, "type", "veth", "peer", "name", far,
                "netns", ns,
            ]);
            ip(&["-n", &net.head, "link", "set", &near, "master", "br0", "up"]);
            let addr = format!("{}.{}/24", net.subnet, i + 2);
            ip(&["-n", ns, "addr", "add", &addr, "dev", far]);
            ip(&["-n", ns, "link", "set", far, "up"]);
        }
        net
    }

    fn head_ip(&self) -> String {
        format!("{}.1", self.subnet)
    }

    /// `trellis ARGS` in namespace `ns`, with hostname `host` when given.
    fn trellis(&self, ns: &str, host: Option<&str>, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]);
        if let Some(h) = host {
            c.args([
                "unshare",
                "--uts",
                "sh",
                "-c",
                "hostname \"$0\" && exec \"$@\"",
                h,
            ]);
        }
        c.arg(trellis_bin()).args(args);
        c
    }

    fn set_link(&self, agent: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&[
            "-n",
            &self.agents[agent],
            "link",
            "set",
            &self.links[agent],
            state,
        ]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in std::iter::once(&self.head).chain(&self.agents) {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

#[test]
fn a_job_across_namespaces_survives_a_cut_link_and_the_agent_rejoins() {
    if !can_run() {
        return;
    }
    let dir = trellis_tests::scratch("netns");
    let start = Instant::now();
    let mark = |what: &str| eprintln!("[{:5.1} s] {what}", start.elapsed().as_secs_f64());
    let net = Net::make(2);
    let data = dir.join("data");
    let listen = format!("{}:7070", net.head_ip());
    let url = format!("http://{listen}");

    // The head, its stderr collected (it logs agents lost and actors restarted).
    let data_arg = data.display().to_string();
    let mut head = net
        .trellis(
            &net.head,
            Some("head"),
            &[
                "--log",
                "info",
                "serve",
                "--listen",
                &listen,
                "--data-dir",
                &data_arg,
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(head.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(first.trim(), format!("listening on {url}"));
    let (tx, head_log) = mpsc::channel();
    let err = head.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let _head = Killed(head);
    let token = data.join("token");
    let token_arg = token.display().to_string();
    let agent_token_arg = data.join("agent-token").display().to_string();

    // Two agents on their own "hosts"; they find the address the head reaches them at from
    // their route to it.
    let agents: Vec<Killed> = (0..2)
        .map(|i| {
            let name = format!("host{i}");
            Killed(
                net.trellis(
                    &net.agents[i],
                    Some(&name),
                    &[
                        "--log",
                        "warn",
                        "agent",
                        "--head",
                        &url,
                        "--token-file",
                        &agent_token_arg,
                        "--resources",
                        "cpu=2",
                        "--listen",
                        "0.0.0.0:0",
                        "--name",
                        &name,
                    ],
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
            )
        })
        .collect();
    let client = |args: &[&str]| -> Command {
        let mut all = args.to_vec();
        all.extend(["--server", &url, "--token-file", &token_arg]);
        net.trellis(&net.head, None, &all)
    };
    let t0 = Instant::now();
    loop {
        let out = client(&["agents", "--count"]).output().unwrap();
        if String::from_utf8_lossy(&out.stdout).trim() == "2" {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "agents never registered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    mark("agents registered");
    let agents_json = run_ok(&mut client(&["agents", "--json"]));
    let listed = String::from_utf8_lossy(&agents_json.stdout).to_string();
    for i in 0..2 {
        let addr = format!("http://{}.{}:", net.subnet, i + 2);
        assert!(
            listed.contains(&addr),
            "agent {i} advertises its own address: {listed}"
        );
    }

    let overrides = [
        "-o",
        "stages.rl.trainer.steps=40",
        "-o",
        "pools.rollout.count=2",
    ];
    let recipe_path = recipe().display().to_string();
    // A job of the recipe with `overrides` and `more`, submitted to the server.
    let submit = |more: &[&str]| -> u64 {
        let mut submit = vec!["submit", recipe_path.as_str()];
        submit.extend(overrides);
        submit.extend(more);
        let out = run_ok(&mut client(&submit));
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    };
    // Its log, followed to its end, which must be a success.
    let follow = |job: u64| -> String {
        let out = client(&["logs", "-f", &job.to_string()]).output().unwrap();
        let log = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{log}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        log
    };
    // Its rows equal those of the same run in one process (`more` without the placements).
    let same_as_in_process = |job: u64, more: &[&str], name: &str| {
        let local = dir.join(name);
        let mut t = trellis();
        t.arg("train").arg(recipe()).args(overrides).args(more);
        t.args(["--quiet", "--run-dir"]).arg(&local);
        run_ok(&mut t);
        assert_eq!(
            metric_rows(&data.join("jobs").join(job.to_string())),
            metric_rows(&local)
        );
    };
    let job = submit(&["-o", "pools.rollout.placement=spread"]);
    let status = |job: u64| -> Value {
        let out = run_ok(&mut client(&["status", &job.to_string(), "--json"]));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let t0 = Instant::now();
    loop {
        let j = status(job);
        if j["stage"] == "rl" && j["step"].as_u64() >= Some(3) {
            break;
        }
        assert!(j["state"] != "failed", "{j:#}");
        assert!(t0.elapsed() < PATIENCE, "never reached RL: {j:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Cut host0 off mid-job.
    mark("link cut");
    net.set_link(0, false);
    follow(job);
    mark("job finished");
    let head_lines: Vec<String> = head_log.try_iter().collect();
    let head_text = head_lines.join("\n");
    assert!(
        head_text.contains("agent lost") && head_text.contains("host0"),
        "the head saw host0 go: {head_text}"
    );
    assert!(
        head_text.contains("actor died; restarting"),
        "its engine restarted elsewhere: {head_text}"
    );

    // The numbers are those of a run in one process.
    same_as_in_process(job, &[], "local");

    mark("in-process run compared");
    // The link comes back: host0 registers again.
    net.set_link(0, true);
    let t0 = Instant::now();
    loop {
        let out = run_ok(&mut client(&["agents", "--json"]));
        if String::from_utf8_lossy(&out.stdout).contains("\"host0\"") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "host0 never rejoined"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    mark("host0 rejoined");

    // Learner ranks on the two hosts sum their gradients over TCP streams between the hosts'
    // addresses (each rank's outbox served on its agent's), and the job's driver reads their
    // weights the same way: the rows are those of the same ranks in one process, bit for bit.
    let ranks = ["-o", "pools.learner.count=2"];
    let ranked = submit(&[&ranks[..], &["-o", "pools.learner.placement=spread"]].concat());
    let log = follow(ranked);
    assert!(
        ["learner ranks: host0, host1", "learner ranks: host1, host0"]
            .iter()
            .any(|l| log.contains(l)),
        "a rank on each host: {log}"
    );
    mark("ranked job finished");
    same_as_in_process(ranked, &ranks, "local-ranks");
    mark("ranked runs compared");
    drop(agents);
    let _ = std::fs::remove_dir_all(&dir);
}
