//! Helpers for Trellis's end-to-end tests (the tests themselves are in `tests/tests/`): they
//! drive the real `trellis` binary and real processes, never in-process shortcuts.
//!
//! Never: used by product code.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// How long a test waits for a child it started (a run, a job, a server) to reach a point: a
/// deadline so that a hang fails, never a speed the test checks. A 2-core machine running the
/// suite's tests side by side under load took more than 2 minutes to reach the calculator run's
/// RL step 4.
pub const PATIENCE: Duration = Duration::from_secs(600);

/// Path to the `trellis` binary built from this workspace's current sources.
///
/// Under cargo, the first call in a test process runs `cargo build -p trellis --bin
/// trellis` with the test's profile (a no-op when it is fresh), so `cargo test -p tests` never
/// runs a stale binary.
pub fn trellis_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        // target/<profile>/deps/<test> (a test) or target/<profile>/<bin> (this crate's
        // binaries, such as `chaos`) → target/<profile>/trellis
        let parent = exe.parent().expect("the executable lives in a folder");
        let profile_dir = if parent.file_name().is_some_and(|n| n == "deps") {
            parent.parent().expect("target/<profile>/deps has a parent")
        } else {
            parent
        };
        let bin = profile_dir.join(format!("trellis{}", std::env::consts::EXE_SUFFIX));
        if let Ok(cargo) = std::env::var("CARGO") {
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "--quiet", "-p", "trellis", "--bin", "trellis"]);
            // Cargo sets these for the running test; build scripts that track them (ring's
            // tracks CARGO_MANIFEST_DIR) would see a change and rebuild half the graph, and the
            // next plain `cargo build` would rebuild it back.
            for (key, _) in std::env::vars_os() {
                let k = key.to_string_lossy();
                if k.starts_with("CARGO_PKG_")
                    || matches!(
                        k.as_ref(),
                        "CARGO_MANIFEST_DIR"
                            | "CARGO_MANIFEST_PATH"
                            | "CARGO_CRATE_NAME"
                            | "CARGO_BIN_NAME"
                            | "CARGO_PRIMARY_PACKAGE"
                            | "CARGO_TARGET_TMPDIR"
                            | "CARGO_RUSTC_CURRENT_DIR"
                            | "OUT_DIR"
                    )
                {
                    cmd.env_remove(&key);
                }
            }
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            let status = cmd
                .status()
                .expect("run cargo build for the trellis binary");
            assert!(status.success(), "building the trellis binary failed");
        }
        assert!(
            bin.exists(),
            "{} is missing: run `cargo build -p trellis`",
            bin.display()
        );
        bin
    })
    .clone()
}

/// The URL a server child (`trellis serve`, `trellis engine serve`, started with piped stdout)
/// prints on its first line, `listening on URL`.
pub fn listening(child: &mut std::process::Child) -> String {
    use std::io::BufRead;
    let mut line = String::new();
    let out = child.stdout.take().expect("the server's stdout is piped");
    std::io::BufReader::new(out)
        .read_line(&mut line)
        .expect("the server says where it listens");
    line.trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("the server said {line:?}"))
        .to_string()
}

/// Waits (up to [`PATIENCE`]) until the run in `dir` has completely written the checkpoint of
/// RL step 4, then kills `child` (the run) with -9 and reaps it; fails at once if the run ends
/// first.
pub fn kill_at_rl_checkpoint(child: &mut std::process::Child, dir: &std::path::Path) {
    wait_for_rl_checkpoint(child, dir);
    child.kill().expect("kill -9 the run");
    child.wait().expect("reap the run");
}

/// Waits (up to [`PATIENCE`]) until the run in `dir` has completely written the checkpoint of
/// RL step 4; fails at once if `child` (the run) ends first.
pub fn wait_for_rl_checkpoint(child: &mut std::process::Child, dir: &std::path::Path) {
    let done = dir.join("checkpoints/rl/step_000004/trainer_state.json");
    let start = std::time::Instant::now();
    while !done.exists() {
        assert!(
            start.elapsed() < PATIENCE,
            "no RL checkpoint appeared in {}",
            dir.display()
        );
        if let Some(status) = child.try_wait().expect("poll the run") {
            panic!(
                "the run in {} ended before RL step 4's checkpoint: {status}",
                dir.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Runs `cmd` to completion and returns its output, failing the test with its stderr if it
/// did not succeed.
pub fn run_ok(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().expect("spawn the command");
    assert!(
        out.status.success(),
        "{:?} failed:\n{}",
        cmd,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// An empty folder for one test, `TMP/trellis-NAME-PID`, made anew (what an earlier run of the
/// same name left is removed).
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trellis-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

/// A `Command` for the `trellis` binary.
pub fn trellis() -> Command {
    Command::new(trellis_bin())
}

/// A child process, killed (-9) and reaped when dropped, so a failing test leaves none behind.
pub struct Killed(pub std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A metric row without its timings (`timing_s/…`, `perf/…`), which differ run to run.
pub fn without_timings(mut row: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = row.as_object_mut() {
        obj.retain(|k, _| !k.starts_with("timing_s/") && !k.starts_with("perf/"));
    }
    row
}

/// The rows of `dir/metrics.jsonl`, without timings.
pub fn metric_rows(dir: &std::path::Path) -> Vec<serde_json::Value> {
    let path = dir.join("metrics.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| without_timings(serde_json::from_str(l).expect("a JSON metric row")))
        .collect()
}

/// The workspace's root folder.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python interpreter of the Python tests, with grpcio, grpcio-tools, flit_core and `openai`:
/// `TRELLIS_PYTHON`, or the venv `.ci/setup python` makes (`target/pyenv`), made here the first
/// time. `None` (the test is skipped, saying so) only when `TRELLIS_SKIP_PYTHON=1` asks for it;
/// a venv that cannot be made fails the test with the command that makes it.
pub fn python() -> Option<PathBuf> {
    static PYTHON: OnceLock<Option<PathBuf>> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            venv(
                "python",
                "pyenv",
                "import grpc, grpc_tools, flit_core, openai",
                Some("TRELLIS_PYTHON"),
                "clients/python/requirements-test.txt",
            )
        })
        .clone()
}

/// The Python interpreter with the experiment trackers the tracking tests run (`mlflow`, whose
/// server they start; `wandb` and `grpcio` for the trellis-client sidecar): the venv `.ci/setup trackers` makes (`target/trackers`), made here the
/// first time. `None` only when `TRELLIS_SKIP_PYTHON=1` asks for it.
pub fn trackers() -> Option<PathBuf> {
    static PYTHON: OnceLock<Option<PathBuf>> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            venv(
                "trackers",
                "trackers",
                "import mlflow, wandb, grpc",
                None,
                "tests/requirements-trackers.txt",
            )
        })
        .clone()
}

/// A venv's interpreter that can `check`: `variable`'s, or `target/DIR`'s, made by `.ci/setup
/// KIND` when it cannot.
fn venv(
    kind: &str,
    dir: &str,
    check: &str,
    variable: Option<&str>,
    requirements: &str,
) -> Option<PathBuf> {
    #[allow(clippy::print_stderr)]
    if std::env::var_os("TRELLIS_SKIP_PYTHON").is_some_and(|v| v == "1") {
        eprintln!("*** SKIPPED: TRELLIS_SKIP_PYTHON=1 skips the Python tests ***");
        return None;
    }
    let usable = |p: &std::path::Path| {
        Command::new(p)
            .args(["-c", check])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Some(p) = variable.and_then(std::env::var_os).map(PathBuf::from) {
        assert!(
            usable(&p),
            "{} {} cannot `{check}` (pip install -r {requirements})",
            variable.unwrap_or_default(),
            p.display()
        );
        return Some(p);
    }
    let venv = root().join("target").join(dir).join("bin/python");
    if !usable(&venv) {
        let setup = root().join(".ci/setup");
        let ran = Command::new(&setup).arg(kind).status();
        assert!(
            usable(&venv),
            "no Python that can `{check}` and `{} {kind}` could not make one ({ran:?}): run it by hand (python3 with venv and pip, and PyPI), or set TRELLIS_SKIP_PYTHON=1 to skip the Python tests",
            setup.display()
        );
    }
    Some(venv)
}

/// A seeded pseudo-random sequence (xorshift64) for the moments chaos tests pick, so a failing
/// run can be replayed with its seed.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.max(1);
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}
