//! The job store under kill -9: a writer process (`store-writer`, writing what a run writes —
//! a metric row, then the checkpoint transaction that moves progress) is killed at a random
//! moment, many times over, each time continuing from what the store holds; no step the writer
//! acknowledged (printed after its commit returned) is ever missing, and what is there is whole.

use orchestrator::store::Store;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn no_acknowledged_commit_is_lost_to_kill_nine() {
    let dir = trellis_tests::scratch("store-stress");
    let path = dir.join("store.redb");
    // Seeded kill delays, so a failure can be replayed.
    let mut next = trellis_tests::xorshift(0x5EED_2026);
    let kills = 40;
    let mut acked_total = 0;
    for round in 0..kills {
        let mut child = Command::new(env!("CARGO_BIN_EXE_store-writer"))
            .arg(&path)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .filter_map(|l| l.trim().parse::<u64>().ok())
                .max()
        });
        // Anywhere from before the store is open to many commits in.
        std::thread::sleep(Duration::from_micros(next() % 60_000));
        child.kill().unwrap();
        let status = child.wait().unwrap();
        let acked = reader.join().unwrap();
        assert!(
            status.code().is_none(),
            "round {round}: the writer ended by itself ({status}): {}",
            std::io::read_to_string(child.stderr.take().unwrap()).unwrap_or_default()
        );
        let store = Store::open(&path).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let Some(job) = store.jobs().unwrap().into_iter().next() else {
            assert_eq!(
                acked, None,
                "round {round}: a step was acknowledged with no job"
            );
            continue;
        };
        let at = job.progress.step;
        if let Some(a) = acked {
            assert!(
                at >= a,
                "round {round}: progress {at} after step {a} was acknowledged"
            );
            acked_total += 1;
        }
        // Whole: the latest checkpoint record is the progress, every step up to it has its
        // metric row once (a row past it is a step killed before its checkpoint).
        let cks = store.checkpoints(job.id).unwrap();
        if at > 0 {
            let last = cks.last().unwrap();
            assert_eq!(
                (last.step, job.progress.checkpoint.as_deref()),
                (at, Some(last.path.as_str()))
            );
        }
        let steps: Vec<u64> = store
            .metrics(job.id, 0)
            .unwrap()
            .into_iter()
            .map(|(_, r)| r["step"].as_u64().unwrap())
            .collect();
        assert!(
            steps.iter().take_while(|s| **s <= at).copied().eq(1..=at),
            "round {round}: metric steps {steps:?} with progress {at}"
        );
        // A resumed run drops the rows past its checkpoint (as `trellis resume` does).
        store
            .retain_metrics(job.id, |r| r["step"].as_u64().is_some_and(|s| s <= at))
            .unwrap();
    }
    assert!(
        acked_total >= kills / 2,
        "too few rounds got a commit in: {acked_total}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
