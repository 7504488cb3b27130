//! The chaos tests, CI-sized: `chaos` (tests/src/bin/chaos.rs) kills the head and the agents —
//! or the served engines — of a server's running job with -9 at seeded random moments and starts
//! them again; the job must finish with the rows of the same job left alone, every step once.
//! The long version is the same binary with `--minutes N` (docs/jobs.md).

use std::process::Command;

/// Runs `chaos ARGS --kills 5`; returns its report after checking it.
fn chaos(tag: &str, args: &[&str]) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!("trellis-chaos-{tag}-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(args)
        .args(["--kills", "5", "--steps", "48", "--dir"])
        .arg(&dir)
        .output()
        .expect("run chaos");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "chaos failed:\n{err}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {err}"));
    eprintln!("{report}");
    let kills = &report["kills"];
    assert_eq!(
        kills["head"].as_u64().unwrap() + kills["member"].as_u64().unwrap(),
        5,
        "{report}"
    );
    assert!(
        kills["head"].as_u64() >= Some(1),
        "the seed kills the head: {report}"
    );
    assert!(
        kills["member"].as_u64() >= Some(1),
        "and a member: {report}"
    );
    for job in report["jobs"].as_array().unwrap() {
        assert_eq!(job["state"], "succeeded", "{report}");
        assert_eq!(job["rows_equal"], true, "{report}");
    }
    // warmup (30 rows and its evals) + 48 RL steps + evals: the comparison is not of nothing.
    assert!(report["reference_rows"].as_u64() > Some(78), "{report}");
    let _ = std::fs::remove_dir_all(&dir);
    report
}

#[test]
fn a_job_whose_head_and_agents_are_killed_at_random_finishes_as_if_undisturbed() {
    let report = chaos("agents", &["--seed", "11"]);
    assert_eq!(report["members"], "agents");
}

/// Learner ranks on the agents too, summing over TCP streams (as on two hosts; the agents test
/// kills one summing through shared memory): an agent killed with a rank on it — in the middle
/// of a streamed reduce, as it happens — costs the job its ranks' state, and the job continues
/// from its last checkpoint on new ranks, to the same rows.
#[test]
fn a_job_with_learner_ranks_on_agents_killed_at_random_finishes_as_if_undisturbed() {
    let report = chaos("learners", &["--learners", "--streams", "--seed", "11"]);
    assert_eq!(
        (&report["learner_ranks"], &report["allreduce"]),
        (&2.into(), &"streams".into())
    );
    let recovered: u64 = report["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["learner_recoveries"].as_u64().unwrap())
        .sum();
    assert!(recovered >= 1, "a killed agent took a rank: {report}");
}

#[test]
fn a_job_whose_head_and_served_engines_are_killed_at_random_finishes_as_if_undisturbed() {
    let report = chaos("engines", &["--engines", "--seed", "3"]);
    assert_eq!(report["members"], "engines");
}
