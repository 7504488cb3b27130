//! `chaos`: kill -9 the head and the agents (or the served engines) of a server's running job at
//! random moments, start them again, and check that the job still finishes with the metric rows
//! of an undisturbed run — the same job on the same cluster left alone — every step recorded
//! once (a sync run is a pure function of its seed). Prints one JSON report; exits 1 when a job
//! failed or its rows differ.
//!
//! ```text
//! cargo run --release -p tests --bin chaos -- [--engines | --learners [--streams]] [--kills N | --minutes M] [--seed S] [--steps RL_STEPS] [--dir DIR]
//! ```
//!
//! `--kills N` (default 4): disturbed jobs until N kills were made (most often one job).
//! `--minutes M`: disturbed jobs one after another, killing all the while, until M minutes
//! passed (each job checked). The cluster: a `trellis serve` head on loopback and two members,
//! `trellis agent`s (`cpu=2`; the rollout pool spread over both, one engine each) or, with
//! `--engines`, two `trellis engine serve`s (the rollout pool's external engines, health-checked
//! after 2 s); a checkpoint every RL step. A killed head comes back on the same port and data dir
//! at once (its running job continues from its checkpoint); a killed member comes back after
//! 0.2–2 s (meanwhile an agent's engine restarts on the other agent or waits for room; an
//! engine is out of service and takes the current weights when it is back). With engines, the
//! pool's own counters (`rollout/…`: engines out of service) are left out of the comparison.
//! With `--learners` the policy trains on two learner ranks spread over the agents too: a killed
//! agent takes a rank's state with it, and the job continues from its last checkpoint on new
//! ranks; the ranks sum through shared memory (one host), or over TCP streams with `--streams`
//! (as ranks on two hosts do), so a kill can land in the middle of a streamed reduce. The e2e
//! test `chaos::…` runs CI-sized versions of all three.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use trellis_tests::{Killed, listening, trellis, without_timings, xorshift};

type Error = Box<dyn std::error::Error>;

struct Options {
    /// Kill served engines (the job's rollout pool) instead of agents.
    engines: bool,
    /// The policy also trains on two learner ranks spread over the agents.
    learners: bool,
    /// The learner ranks sum over TCP streams.
    streams: bool,
    kills: usize,
    minutes: Option<f64>,
    seed: u64,
    steps: u64,
    dir: PathBuf,
}

fn options() -> Result<Options, Error> {
    let mut o = Options {
        engines: false,
        learners: false,
        streams: false,
        kills: 4,
        minutes: None,
        seed: 1,
        steps: 16,
        dir: std::env::temp_dir().join(format!("trellis-chaos-{}", std::process::id())),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--engines" => o.engines = true,
            "--learners" => o.learners = true,
            "--streams" => o.streams = true,
            "--kills" => o.kills = value()?.parse()?,
            "--minutes" => o.minutes = Some(value()?.parse()?),
            "--seed" => o.seed = value()?.parse()?,
            "--steps" => o.steps = value()?.parse()?,
            "--dir" => o.dir = PathBuf::from(value()?),
            _ => {
                return Err(format!(
                    "unknown argument {a}: chaos [--engines | --learners [--streams]] [--kills N | --minutes M] [--seed S] [--steps RL_STEPS] [--dir DIR]"
                )
                .into());
            }
        }
    }
    Ok(o)
}

fn say(text: &str) {
    let _ = writeln!(std::io::stderr(), "chaos: {text}");
}

/// A member of the cluster the chaos kills besides the head.
struct Member {
    name: String,
    /// For an engine, the address it listens on again after a kill.
    listen: Option<String>,
    process: Option<Killed>,
}

/// The head and its members (two agents, or two served engines), each restartable.
struct Cluster {
    dir: PathBuf,
    data: PathBuf,
    listen: String,
    url: String,
    head: Killed,
    members: Vec<Member>,
    /// The members are served engines (`trellis engine serve`), else agents.
    engines: bool,
    /// Jobs train on two learner ranks spread over the agents.
    learners: bool,
    /// The learner ranks sum over TCP streams.
    streams: bool,
}

fn log_file(dir: &Path, name: &str) -> Result<std::fs::File, Error> {
    Ok(std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))?)
}

fn recipe() -> PathBuf {
    trellis_tests::root().join("tests/data/tiny-arith.yaml")
}

impl Cluster {
    fn start(dir: &Path, engines: bool) -> Result<Cluster, Error> {
        let data = dir.join("data");
        let (head, url) = Cluster::head(dir, &data, "127.0.0.1:0")?;
        let listen = url.trim_start_matches("http://").to_string();
        let mut c = Cluster {
            dir: dir.to_path_buf(),
            data,
            listen,
            url,
            head,
            members: Vec::new(),
            engines,
            learners: false,
            streams: false,
        };
        for name in ["m1", "m2"] {
            let mut m = Member {
                name: name.to_string(),
                listen: engines.then(|| "127.0.0.1:0".to_string()),
                process: None,
            };
            let (process, url) = c.member(&m)?;
            if engines {
                m.listen = url.map(|u| u.trim_start_matches("http://").to_string());
            }
            m.process = Some(process);
            c.members.push(m);
        }
        Ok(c)
    }

    fn head(dir: &Path, data: &Path, listen: &str) -> Result<(Killed, String), Error> {
        let mut child = trellis()
            .args([
                "--log",
                "warn,actors=info,orchestrator::jobs=info",
                "serve",
                "--listen",
                listen,
                "--data-dir",
            ])
            .arg(data)
            .args(["--agent-wait", "120"])
            .stdout(Stdio::piped())
            .stderr(log_file(dir, "head")?)
            .spawn()?;
        let url = listening(&mut child);
        Ok((Killed(child), url))
    }

    /// Starts member `m`: an agent of the head, or an engine serving the recipe's model on
    /// its address (and then its URL).
    fn member(&self, m: &Member) -> Result<(Killed, Option<String>), Error> {
        let log = log_file(&self.dir, &m.name)?;
        match &m.listen {
            Some(listen) => {
                let mut child = trellis()
                    .args(["--log", "warn", "engine", "serve", "--listen", listen])
                    .arg("--recipe")
                    .arg(recipe())
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(log)
                    .spawn()?;
                let url = listening(&mut child);
                Ok((Killed(child), Some(url)))
            }
            None => Ok((
                Killed(
                    trellis()
                        .args(["--log", "warn", "agent", "--head", &self.url])
                        .args(["--resources", "cpu=2", "--name", &m.name, "--token-file"])
                        .arg(self.data.join("agent-token"))
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(log)
                        .spawn()?,
                ),
                None,
            )),
        }
    }

    fn revive(&mut self, i: usize) {
        let result = self.member(&self.members[i]);
        match result {
            Ok((process, _)) => self.members[i].process = Some(process),
            Err(e) => say(&format!("{} did not start: {e}", self.members[i].name)),
        }
    }

    /// `trellis ARGS --server URL --token-file ADMIN`.
    fn cli(&self, args: &[&str]) -> Command {
        let mut c = trellis();
        c.args(args)
            .args(["--server", &self.url, "--token-file"])
            .arg(self.data.join("token"));
        c
    }

    fn submit(&self, steps: u64) -> Result<u64, Error> {
        let steps = format!("stages.rl.trainer.steps={steps}");
        let mut cmd = self.cli(&["submit"]);
        cmd.arg(recipe())
            .args(["-o", &steps])
            .args(["-o", "stages.rl.trainer.save_freq=1"]);
        if self.engines {
            let urls: Vec<String> = self
                .members
                .iter()
                .filter_map(|m| Some(format!("http://{}", m.listen.as_ref()?)))
                .collect();
            cmd.args(["-o", "pools.rollout.engine=served"])
                .arg("-o")
                .arg(format!("pools.rollout.endpoints=[{}]", urls.join(",")))
                .args(["-o", "pools.rollout.timeout_s=60"])
                .args(["-o", "pools.rollout.health_check_s=2"]);
        } else {
            cmd.args(["-o", "pools.rollout.placement=spread"])
                .args(["-o", "pools.rollout.count=2"]);
        }
        if self.learners {
            cmd.args(["-o", "pools.learner.placement=spread"])
                .args(["-o", "pools.learner.count=2"]);
            if self.streams {
                cmd.args(["-o", "pools.learner.allreduce=streams"]);
            }
        }
        let out = cmd.output()?;
        if !out.status.success() {
            return Err(format!("submit: {}", String::from_utf8_lossy(&out.stderr)).into());
        }
        Ok(String::from_utf8(out.stdout)?.trim().parse()?)
    }

    /// The job's state, or `None` while the head does not answer.
    fn state(&self, id: u64) -> Option<String> {
        let out = self
            .cli(&["status", &id.to_string(), "--json"])
            .output()
            .ok()?;
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        j["state"].as_str().map(str::to_string)
    }

    /// How many times job `id` continued from its checkpoint after losing a learner rank (the
    /// lines its log says it with).
    fn recoveries(&self, id: u64) -> Result<usize, Error> {
        let out = self.cli(&["logs", &id.to_string()]).output()?;
        Ok(String::from_utf8(out.stdout)?
            .lines()
            .filter(|l| l.contains("learner rank lost"))
            .count())
    }

    fn rows(&self, id: u64) -> Result<Vec<serde_json::Value>, Error> {
        let out = self.cli(&["logs", &id.to_string(), "--metrics"]).output()?;
        let mut rows = Vec::new();
        for line in String::from_utf8(out.stdout)?.lines() {
            if line.starts_with('{') {
                let mut row = without_timings(serde_json::from_str(line)?);
                if self.engines
                    && let Some(o) = row.as_object_mut()
                {
                    // The pool's own counters (engines out of service) tell the kills apart.
                    o.retain(|k, _| !k.starts_with("rollout/"));
                }
                rows.push(row);
            }
        }
        Ok(rows)
    }

    fn kill_head(&mut self) -> Result<(), Error> {
        let _ = self.head.0.kill();
        let _ = self.head.0.wait();
        // Back at once, on the same port and data dir (the agents find it there again).
        let t0 = Instant::now();
        loop {
            match Cluster::head(&self.dir, &self.data, &self.listen) {
                Ok((head, _)) => {
                    self.head = head;
                    return Ok(());
                }
                Err(e) if t0.elapsed() < Duration::from_secs(30) => {
                    say(&format!("the head did not come back yet: {e}"));
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Waits for job `id` to end; while `disturb` (given the kills so far) says so, kills a random
/// member every 0.3–1.5 s.
/// Returns the final state, the seconds it took and the kills by target.
fn run_job(
    c: &mut Cluster,
    id: u64,
    rng: &mut impl FnMut() -> u64,
    mut disturb: impl FnMut(usize) -> bool,
    kills: &mut [usize; 2],
) -> Result<(String, f64), Error> {
    let t0 = Instant::now();
    let mut next_kill: Option<Instant> = None;
    let mut revive: Vec<(usize, Instant)> = Vec::new();
    loop {
        if t0.elapsed() > Duration::from_secs(900) {
            return Err(format!("job {id} did not end within 15 minutes").into());
        }
        let state = c.state(id);
        match state.as_deref() {
            Some(s @ ("succeeded" | "failed" | "cancelled")) => {
                for (i, _) in revive.drain(..) {
                    c.revive(i);
                }
                return Ok((s.to_string(), t0.elapsed().as_secs_f64()));
            }
            Some("running") if next_kill.is_none() => {
                next_kill = Some(Instant::now() + Duration::from_millis(300 + rng() % 1200));
            }
            _ => {}
        }
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = revive.into_iter().partition(|&(_, at)| at <= now);
        revive = later;
        for (i, _) in due {
            c.revive(i);
        }
        if next_kill.is_some_and(|at| at <= now) && disturb(kills[0] + kills[1]) {
            // The head, or a member that is up (a down one counts as the head).
            let target = (rng() % 3) as usize;
            match target
                .checked_sub(1)
                .and_then(|i| Some((i, c.members[i].process.take()?)))
            {
                Some((i, mut member)) => {
                    say(&format!("kill -9 {} (job {id})", c.members[i].name));
                    let _ = member.0.kill();
                    let _ = member.0.wait();
                    revive.push((
                        i,
                        Instant::now() + Duration::from_millis(200 + rng() % 1800),
                    ));
                    kills[1] += 1;
                }
                None => {
                    say(&format!("kill -9 the head (job {id})"));
                    c.kill_head()?;
                    kills[0] += 1;
                }
            }
            next_kill = Some(Instant::now() + Duration::from_millis(300 + rng() % 1200));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn main() -> Result<(), Error> {
    let o = options()?;
    let _ = std::fs::remove_dir_all(&o.dir);
    std::fs::create_dir_all(&o.dir)?;
    let mut rng = xorshift(o.seed);
    if o.engines && o.learners {
        return Err("--engines and --learners: learner ranks run on agents, not engines".into());
    }
    if o.streams && !o.learners {
        return Err("--streams: how learner ranks sum; it needs --learners".into());
    }
    let mut c = Cluster::start(&o.dir, o.engines)?;
    c.learners = o.learners;
    c.streams = o.streams;
    let mut kills = [0usize; 2];

    // The undisturbed run: the same job on the same cluster, left alone.
    let reference_id = c.submit(o.steps)?;
    let (state, undisturbed_s) = run_job(&mut c, reference_id, &mut rng, |_| false, &mut kills)?;
    if state != "succeeded" {
        return Err(format!("the undisturbed job {state}: see {}", o.dir.display()).into());
    }
    let reference = c.rows(reference_id)?;
    say(&format!(
        "undisturbed job: {undisturbed_s:.1} s, {} rows",
        reference.len()
    ));

    let started = Instant::now();
    let mut jobs = Vec::new();
    let mut ok = true;
    loop {
        let id = c.submit(o.steps)?;
        let before = kills;
        let (state, seconds) = match o.minutes {
            Some(m) => {
                let end = started + Duration::from_secs_f64(m * 60.0);
                run_job(&mut c, id, &mut rng, |_| Instant::now() < end, &mut kills)?
            }
            None => run_job(&mut c, id, &mut rng, |n| n < o.kills, &mut kills)?,
        };
        let rows = c.rows(id)?;
        let recoveries = c.recoveries(id)?;
        let equal = state == "succeeded" && rows == reference;
        ok &= equal;
        say(&format!(
            "job {id}: {state} in {seconds:.1} s, kills head {} members {}, rows equal: {equal}",
            kills[0] - before[0],
            kills[1] - before[1]
        ));
        jobs.push(serde_json::json!({
            "job": id, "state": state, "seconds": seconds, "rows": rows.len(), "rows_equal": equal,
            "learner_recoveries": recoveries,
            "kills": {"head": kills[0] - before[0], "member": kills[1] - before[1]},
        }));
        // Jobs until the time is up, or until the kills were all made (a short job may end
        // before them).
        let more = match o.minutes {
            Some(m) => started.elapsed() < Duration::from_secs_f64(m * 60.0),
            None => kills[0] + kills[1] < o.kills,
        };
        if !more || !equal {
            break;
        }
    }
    let disturbed_s: f64 = jobs.iter().filter_map(|j| j["seconds"].as_f64()).sum();
    let report = serde_json::json!({
        "seed": o.seed,
        "rl_steps": o.steps,
        "members": if o.engines { "engines" } else { "agents" },
        "learner_ranks": if o.learners { 2 } else { 1 },
        "allreduce": if o.streams { "streams" } else { "ranks" },
        "kills": {"head": kills[0], "member": kills[1]},
        "undisturbed_s": undisturbed_s,
        "disturbed_s_mean": disturbed_s / jobs.len().max(1) as f64,
        "reference_rows": reference.len(),
        "jobs": jobs,
        "ok": ok,
    });
    writeln!(std::io::stdout().lock(), "{report}")?;
    // The head and members go before the verdict (an early exit would leave them running).
    drop(c);
    if !ok {
        return Err(format!("rows differ or a job failed: see {}", o.dir.display()).into());
    }
    let _ = std::fs::remove_dir_all(&o.dir);
    Ok(())
}
