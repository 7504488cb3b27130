//! The writer of the store's kill -9 stress test (`e2e`'s `store::…`): writes what a run writes —
//! a metric row, then a checkpoint record that moves the job's progress — step after step into
//! the job store at `argv[1]`, continuing from the progress stored there, and prints each step
//! once its checkpoint transaction has committed (acknowledged). The test kills it at random
//! moments and checks that no acknowledged step is ever lost.

use orchestrator::store::{CheckpointRecord, JobState, Progress, Store};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args_os()
        .nth(1)
        .ok_or("usage: store-writer STORE_FILE")?;
    let store = Store::open(std::path::Path::new(&path))?;
    let id = match store.jobs()?.first() {
        Some(job) => job.id,
        None => store.create_job("stress", serde_json::json!({}), JobState::Running, None)?,
    };
    let mut step = store.job(id)?.progress.step;
    let mut out = std::io::stdout().lock();
    loop {
        step += 1;
        store.append_metrics(id, &serde_json::json!({"stage": "s", "step": step}))?;
        let ck = format!("checkpoints/s/step_{step:06}");
        let progress = Progress {
            completed: Vec::new(),
            stage: Some("s".into()),
            step,
            checkpoint: Some(ck.clone()),
            weight_version: step,
        };
        let record = CheckpointRecord {
            stage: "s".into(),
            step,
            path: ck,
            weight_version: step,
        };
        store.checkpoint(id, &progress, &record, 2)?;
        writeln!(out, "{step}")?;
        out.flush()?;
    }
}
