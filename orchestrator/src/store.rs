//! The durable job store: one redb file (`store.redb` in a run directory, or in the server's data
//! dir) holding each job's spec, state, progress (step counter and checkpoint index) and metric
//! rows. Every write is one transaction committed with immediate durability, so a kill -9 at any
//! moment leaves the store as it was after the last commit, never half-written.
//!
//! Owns: the schema and its transactions. Never: runs jobs, reads checkpoints or touches tensors.

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Writes `bytes` to `path` through a temporary file renamed into place: a reader never sees
/// it half-written. Errors name the file that failed.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), (PathBuf, std::io::Error)> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| (tmp.clone(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| (path.to_path_buf(), e))
}

/// Job id → the job as JSON.
const JOBS: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("jobs");
/// (job id, row number) → one metric row as JSON.
const METRICS: TableDefinition<'_, (u64, u64), &[u8]> = TableDefinition::new("metrics");
/// (job id, row number) → one checkpoint record as JSON.
const CHECKPOINTS: TableDefinition<'_, (u64, u64), &[u8]> = TableDefinition::new("checkpoints");
/// (job id, line number) → one log line as JSON.
const LOGS: TableDefinition<'_, (u64, u64), &[u8]> = TableDefinition::new("logs");
/// (job id, table name) → the next row number of that job in that table. Row numbers are never
/// reused, even for rows deleted by a rewind, so a reader's cursor never skips a new row.
const NEXT_ROW: TableDefinition<'_, (u64, &str), u64> = TableDefinition::new("next_row");

/// What can go wrong with the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused (I/O, corruption, another process holding it).
    #[error("job store {path}: {msg}")]
    Db {
        /// The store file.
        path: PathBuf,
        /// redb's message.
        msg: String,
    },
    /// Another process (a running `trellis train` or server) holds the store.
    #[error(
        "job store {path} is in use by another process (a run in progress holds it until it stops)"
    )]
    Busy {
        /// The store file.
        path: PathBuf,
    },
    /// The server holding the store, for a job in a child process, did not answer.
    #[error("job store {path} (through the server): {msg}")]
    Remote {
        /// The server's store file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// A job id the store does not have.
    #[error("job store {path}: no job {id}")]
    NoJob {
        /// The store file.
        path: PathBuf,
        /// The id asked for.
        id: u64,
    },
}

/// Where a job is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Accepted, not started.
    Pending,
    /// Running (or was, when its process died: resuming continues it).
    Running,
    /// Finished every stage.
    Succeeded,
    /// Stopped by an error; resumable from its last checkpoint.
    Failed,
    /// Stopped on request.
    Cancelled,
}

impl JobState {
    /// Its name, as the store and the API write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// Whether the job will not run again by itself.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Cancelled)
    }
}

/// Progress of a job: what resuming needs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Stages finished, in order.
    pub completed: Vec<String>,
    /// The stage of the last checkpoint.
    pub stage: Option<String>,
    /// Last checkpointed step of `stage` (steps count from 1).
    pub step: u64,
    /// The latest checkpoint folder, relative to the run directory.
    pub checkpoint: Option<String>,
    /// Weight version at the checkpoint.
    pub weight_version: u64,
}

/// One job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Its id (from 1).
    pub id: u64,
    /// The workflow's name.
    pub name: String,
    /// The resolved workflow, as JSON.
    pub spec: serde_json::Value,
    /// Its state.
    pub state: JobState,
    /// Why it failed.
    pub error: Option<String>,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// Last change, milliseconds since the Unix epoch.
    pub updated_ms: u64,
    /// Step counter and checkpoint index.
    pub progress: Progress,
    /// The user who submitted it (a server's user name); `None` for the server's admin and for
    /// `trellis train` (stores written before owners existed read as `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// A checkpoint written by a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    /// Stage id.
    pub stage: String,
    /// Step within the stage.
    pub step: u64,
    /// Folder, relative to the run directory.
    pub path: String,
    /// Weight version it holds.
    pub weight_version: u64,
}

/// What the store says of one job at one moment. A run that holds the store also keeps it in
/// `RUN_DIR/status.json` (`live`), so it can be read while the run goes on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    /// The job (spec, state, progress).
    pub job: Job,
    /// Checkpoints kept, oldest first.
    pub checkpoints: Vec<CheckpointRecord>,
    /// Metric rows recorded.
    pub metric_rows: usize,
    /// Read from the running process's `status.json` (the store is busy), not the store.
    #[serde(default)]
    pub live: bool,
}

/// A line of a job's log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogRecord {
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The line.
    pub text: String,
}

/// An open store.
pub struct Store {
    db: Database,
    path: PathBuf,
    /// Bumped after every commit: readers that follow a job wait on it.
    changes: tokio::sync::watch::Sender<u64>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Store {
    /// Opens `path`, creating it when absent.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::Busy {
                path: path.to_path_buf(),
            },
            e => StoreError::Db {
                path: path.to_path_buf(),
                msg: e.to_string(),
            },
        })?;
        let store = Self {
            db,
            path: path.to_path_buf(),
            changes: tokio::sync::watch::Sender::new(0),
        };
        // Create the tables so that readers never meet a missing one.
        store.write(|tx| {
            tx.open_table(JOBS)?;
            tx.open_table(METRICS)?;
            tx.open_table(CHECKPOINTS)?;
            tx.open_table(LOGS)?;
            tx.open_table(NEXT_ROW)?;
            Ok(())
        })?;
        Ok(store)
    }

    /// The store file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A receiver that sees a change after every committed write (of any job).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn db_err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Db {
            path: self.path.clone(),
            msg: e.to_string(),
        }
    }

    /// Runs `f` in one write transaction and commits it durably.
    fn write<T>(
        &self,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StoreError> {
        let tx = self.db.begin_write().map_err(|e| self.db_err(e))?;
        let out = f(&tx).map_err(|e| self.db_err(e))?;
        tx.commit().map_err(|e| self.db_err(e))?;
        self.changes.send_modify(|n| *n += 1);
        Ok(out)
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StoreError> {
        let tx = self.db.begin_read().map_err(|e| self.db_err(e))?;
        f(&tx).map_err(|e| self.db_err(e))
    }

    /// Records a new job in `state`, owned by `owner` (see [`Job::owner`]); returns its id.
    pub fn create_job(
        &self,
        name: &str,
        spec: serde_json::Value,
        state: JobState,
        owner: Option<&str>,
    ) -> Result<u64, StoreError> {
        self.write(|tx| {
            let mut jobs = tx.open_table(JOBS)?;
            let id = jobs.last()?.map_or(1, |(k, _)| k.value() + 1);
            let t = now_ms();
            let job = Job {
                id,
                name: name.to_string(),
                spec,
                state,
                error: None,
                created_ms: t,
                updated_ms: t,
                progress: Progress::default(),
                owner: owner.map(str::to_string),
            };
            jobs.insert(id, to_json(&job).as_slice())?;
            Ok(id)
        })
    }

    /// The job `id`.
    pub fn job(&self, id: u64) -> Result<Job, StoreError> {
        let job = self.read(|tx| {
            let jobs = tx.open_table(JOBS)?;
            Ok(jobs.get(id)?.map(|v| from_json::<Job>(v.value())))
        })?;
        match job {
            Some(Ok(j)) => Ok(j),
            Some(Err(e)) => Err(self.db_err(format!("job {id}: {e}"))),
            None => Err(StoreError::NoJob {
                path: self.path.clone(),
                id,
            }),
        }
    }

    /// Every job, by id.
    pub fn jobs(&self) -> Result<Vec<Job>, StoreError> {
        let rows = self.read(|tx| {
            let jobs = tx.open_table(JOBS)?;
            let mut out = Vec::new();
            for row in jobs.iter()? {
                let (_, v) = row?;
                out.push(from_json::<Job>(v.value()));
            }
            Ok(out)
        })?;
        rows.into_iter()
            .map(|r| r.map_err(|e| self.db_err(e)))
            .collect()
    }

    /// Changes job `id` with `f` in one transaction.
    fn update(&self, id: u64, f: impl FnOnce(&mut Job)) -> Result<Job, StoreError> {
        let path = self.path.clone();
        let res = self.write(|tx| update_in(tx, id, f))?;
        res.ok_or(StoreError::NoJob { path, id })
    }

    /// Sets job `id`'s state (and error message, for `Failed`).
    pub fn set_state(
        &self,
        id: u64,
        state: JobState,
        error: Option<String>,
    ) -> Result<Job, StoreError> {
        self.update(id, |j| {
            j.state = state;
            j.error = error;
        })
    }

    /// Appends a metric row to job `id`.
    pub fn append_metrics(&self, id: u64, row: &serde_json::Value) -> Result<u64, StoreError> {
        self.write(|tx| {
            let mut t = tx.open_table(METRICS)?;
            let seq = next_row(tx, &t, "metrics", id)?;
            t.insert((id, seq), to_json(row).as_slice())?;
            Ok(seq)
        })
    }

    /// Appends a line to job `id`'s log; returns its line number.
    pub fn append_log(&self, id: u64, text: &str) -> Result<u64, StoreError> {
        let record = LogRecord {
            time_ms: now_ms(),
            text: text.to_string(),
        };
        self.write(|tx| {
            let mut t = tx.open_table(LOGS)?;
            let seq = next_row(tx, &t, "logs", id)?;
            t.insert((id, seq), to_json(&record).as_slice())?;
            Ok(seq)
        })
    }

    /// Job `id`'s log lines from line `from` on, with their line numbers.
    pub fn logs(&self, id: u64, from: u64) -> Result<Vec<(u64, LogRecord)>, StoreError> {
        self.rows(LOGS, id, from)
    }

    /// Job `id`'s metric rows from row `from` on, with their row numbers.
    pub fn metrics(&self, id: u64, from: u64) -> Result<Vec<(u64, serde_json::Value)>, StoreError> {
        self.rows(METRICS, id, from)
    }

    /// Job `id`'s records of a `(job, row)`-keyed table from row `from` on.
    fn rows<T: for<'de> Deserialize<'de>>(
        &self,
        table: TableDefinition<'_, (u64, u64), &[u8]>,
        id: u64,
        from: u64,
    ) -> Result<Vec<(u64, T)>, StoreError> {
        let rows = self.read(|tx| {
            let t = tx.open_table(table)?;
            let mut out = Vec::new();
            for row in t.range((id, from)..=(id, u64::MAX))? {
                let (k, v) = row?;
                out.push((k.value().1, from_json::<T>(v.value())));
            }
            Ok(out)
        })?;
        rows.into_iter()
            .map(|(s, r)| r.map(|v| (s, v)).map_err(|e| self.db_err(e)))
            .collect()
    }

    /// Job `id`'s latest metric row, if any.
    pub fn last_metrics(&self, id: u64) -> Result<Option<serde_json::Value>, StoreError> {
        let row = self.read(|tx| {
            let t = tx.open_table(METRICS)?;
            let last = t.range((id, 0)..=(id, u64::MAX))?.next_back().transpose()?;
            Ok(last.map(|(_, v)| from_json::<serde_json::Value>(v.value())))
        })?;
        row.transpose().map_err(|e| self.db_err(e))
    }

    /// Records a checkpoint of job `id`, moves its progress there and forgets all but the
    /// latest `keep` checkpoints, in one transaction. Returns the records forgotten (whose
    /// folders the caller deletes).
    pub fn checkpoint(
        &self,
        id: u64,
        progress: &Progress,
        record: &CheckpointRecord,
        keep: usize,
    ) -> Result<Vec<CheckpointRecord>, StoreError> {
        let path = self.path.clone();
        let found = self.write(|tx| {
            if update_in(tx, id, |job| job.progress = progress.clone())?.is_none() {
                return Ok(None);
            }
            let mut ck = tx.open_table(CHECKPOINTS)?;
            let seq = next_row(tx, &ck, "checkpoints", id)?;
            ck.insert((id, seq), to_json(record).as_slice())?;
            let first_kept = (seq + 1).saturating_sub(keep.max(1) as u64);
            let mut forgotten = Vec::new();
            ck.retain_in((id, 0)..(id, first_kept), |_, v| {
                forgotten.extend(from_json::<CheckpointRecord>(v).ok());
                false
            })?;
            Ok(Some(forgotten))
        })?;
        found.ok_or(StoreError::NoJob { path, id })
    }

    /// Job `id`'s checkpoints, oldest first.
    pub fn checkpoints(&self, id: u64) -> Result<Vec<CheckpointRecord>, StoreError> {
        let rows = self.rows(CHECKPOINTS, id, 0)?;
        Ok(rows.into_iter().map(|(_, r)| r).collect())
    }

    /// Deletes job `id`'s metric rows for which `keep` is false (the steps after the checkpoint
    /// a resume starts from, which will be run again); returns how many were deleted.
    pub fn retain_metrics(
        &self,
        id: u64,
        mut keep: impl FnMut(&serde_json::Value) -> bool,
    ) -> Result<usize, StoreError> {
        self.write(|tx| {
            let mut t = tx.open_table(METRICS)?;
            let mut dropped = 0;
            t.retain_in((id, 0)..=(id, u64::MAX), |_, v| {
                let k = from_json::<serde_json::Value>(v).is_ok_and(|row| keep(&row));
                dropped += usize::from(!k);
                k
            })?;
            Ok(dropped)
        })
    }
}

impl Progress {
    /// Whether a metric row survives a resume from this progress: rows of finished stages and of
    /// the checkpointed stage up to its step stay; the steps after it run again.
    pub fn keeps(&self, row: &serde_json::Value) -> bool {
        let stage = row.get("stage").and_then(|s| s.as_str()).unwrap_or("");
        let step = row.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        self.completed.iter().any(|c| c == stage)
            || (Some(stage) == self.stage.as_deref() && step <= self.step)
    }
}

/// What a running job asks of its store — its own record — whether the store is in this
/// process ([`Store`]) or in a server that started the job in a child process
/// (`jobs::worker::Remote`). The methods are [`Store`]'s of the same names.
pub trait JobStore: Send + Sync {
    /// The store file (for messages).
    fn path(&self) -> &Path;
    /// The job `id`.
    fn job(&self, id: u64) -> Result<Job, StoreError>;
    /// Sets job `id`'s state and error.
    fn set_state(&self, id: u64, state: JobState, error: Option<String>)
    -> Result<Job, StoreError>;
    /// Appends a metric row; returns its row number.
    fn append_metrics(&self, id: u64, row: &serde_json::Value) -> Result<u64, StoreError>;
    /// Appends a log line; returns its line number.
    fn append_log(&self, id: u64, text: &str) -> Result<u64, StoreError>;
    /// Metric rows from row `from` on.
    fn metrics(&self, id: u64, from: u64) -> Result<Vec<(u64, serde_json::Value)>, StoreError>;
    /// Checkpoints, oldest first.
    fn checkpoints(&self, id: u64) -> Result<Vec<CheckpointRecord>, StoreError>;
    /// Records a checkpoint and moves the progress there; returns the records forgotten.
    fn checkpoint(
        &self,
        id: u64,
        progress: &Progress,
        record: &CheckpointRecord,
        keep: usize,
    ) -> Result<Vec<CheckpointRecord>, StoreError>;
    /// Deletes the metric rows a resume from `progress` runs again ([`Progress::keeps`]);
    /// returns how many.
    fn rewind(&self, id: u64, progress: &Progress) -> Result<usize, StoreError>;
}

impl JobStore for Store {
    fn path(&self) -> &Path {
        Store::path(self)
    }
    fn job(&self, id: u64) -> Result<Job, StoreError> {
        Store::job(self, id)
    }
    fn set_state(
        &self,
        id: u64,
        state: JobState,
        error: Option<String>,
    ) -> Result<Job, StoreError> {
        Store::set_state(self, id, state, error)
    }
    fn append_metrics(&self, id: u64, row: &serde_json::Value) -> Result<u64, StoreError> {
        Store::append_metrics(self, id, row)
    }
    fn append_log(&self, id: u64, text: &str) -> Result<u64, StoreError> {
        Store::append_log(self, id, text)
    }
    fn metrics(&self, id: u64, from: u64) -> Result<Vec<(u64, serde_json::Value)>, StoreError> {
        Store::metrics(self, id, from)
    }
    fn checkpoints(&self, id: u64) -> Result<Vec<CheckpointRecord>, StoreError> {
        Store::checkpoints(self, id)
    }
    fn checkpoint(
        &self,
        id: u64,
        progress: &Progress,
        record: &CheckpointRecord,
        keep: usize,
    ) -> Result<Vec<CheckpointRecord>, StoreError> {
        Store::checkpoint(self, id, progress, record, keep)
    }
    fn rewind(&self, id: u64, progress: &Progress) -> Result<usize, StoreError> {
        self.retain_metrics(id, |row| progress.keeps(row))
    }
}

/// Changes job `id` with `f` inside transaction `tx`; `None` when there is no such job.
fn update_in(
    tx: &redb::WriteTransaction,
    id: u64,
    f: impl FnOnce(&mut Job),
) -> Result<Option<Job>, redb::Error> {
    let mut jobs = tx.open_table(JOBS)?;
    let Some(mut job) = jobs.get(id)?.and_then(|v| from_json::<Job>(v.value()).ok()) else {
        return Ok(None);
    };
    f(&mut job);
    job.updated_ms = now_ms();
    jobs.insert(id, to_json(&job).as_slice())?;
    Ok(Some(job))
}

/// Takes the next row number of job `id` in the `(job, row)`-keyed table `t` named `name`: past
/// every row it holds and every number handed out before (rows deleted by a rewind included).
fn next_row(
    tx: &redb::WriteTransaction,
    t: &redb::Table<'_, (u64, u64), &[u8]>,
    name: &str,
    id: u64,
) -> Result<u64, redb::Error> {
    let past_last = t
        .range((id, 0)..=(id, u64::MAX))?
        .next_back()
        .transpose()?
        .map_or(0, |(k, _)| k.value().1 + 1);
    let mut counters = tx.open_table(NEXT_ROW)?;
    let handed_out = counters.get((id, name))?.map_or(0, |v| v.value());
    let seq = past_last.max(handed_out);
    counters.insert((id, name), seq + 1)?;
    Ok(seq)
}

fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("store records serialise")
}

fn from_json<T: for<'de> Deserialize<'de>>(b: &[u8]) -> Result<T, String> {
    serde_json::from_slice(b).map_err(|e| format!("unreadable record: {e}"))
}

/// A checkpoint of stage `rl` at `step` holding `weight_version`, and the progress that points
/// at it (for tests here and of the store's remote face).
#[cfg(test)]
pub(crate) fn rl_checkpoint(step: u64, weight_version: u64) -> (Progress, CheckpointRecord) {
    let path = format!("checkpoints/rl/step_{step:06}");
    let progress = Progress {
        stage: Some("rl".into()),
        step,
        checkpoint: Some(path.clone()),
        ..Progress::default()
    };
    let record = CheckpointRecord {
        stage: "rl".into(),
        step,
        path,
        weight_version,
    };
    (progress, record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A store file in a fresh folder of its own, removed with the folder when dropped.
    struct Tmp(PathBuf);

    impl std::ops::Deref for Tmp {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Tmp {
        fn drop(&mut self) {
            if let Some(d) = self.0.parent() {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }

    fn tmp(tag: &str) -> Tmp {
        let d = std::env::temp_dir().join(format!("trellis-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Tmp(d.join("store.redb"))
    }

    /// Metric values come back bit for bit: JSON parsing that is not correctly rounded changed
    /// the last bit of some (`actor/lr` 1e-4 as an f32 came back as …512 instead of …513).
    #[test]
    fn metric_values_survive_the_store_bit_for_bit() {
        let p = tmp("bits");
        let s = Store::open(&p).unwrap();
        let id = s
            .create_job("a", json!({}), JobState::Running, None)
            .unwrap();
        // Seeded values across magnitudes, and f32s widened to f64 (what learning rates are).
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut want = vec![f64::from(1.0e-4_f32), f64::from(3.0e-3_f32), 0.1 + 0.2];
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = f64::from_bits(x >> 2);
            if v.is_finite() {
                want.push(v);
                want.push(f64::from(v as f32));
            }
        }
        let row: serde_json::Map<String, Value> = want
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("v{i}"), json!(v)))
            .collect();
        s.append_metrics(id, &Value::Object(row)).unwrap();
        let got = &s.metrics(id, 0).unwrap()[0].1;
        let wrong: Vec<String> = want
            .iter()
            .enumerate()
            .filter_map(|(i, v)| {
                let g = got[format!("v{i}")].as_f64().unwrap();
                (g.to_bits() != v.to_bits()).then(|| format!("{v:e} came back as {g:e}"))
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "{} of {}: {:?}",
            wrong.len(),
            want.len(),
            &wrong[..wrong.len().min(5)]
        );
    }

    #[test]
    fn jobs_metrics_and_checkpoints_survive_reopening() {
        let p = tmp("reopen");
        {
            let s = Store::open(&p).unwrap();
            let a = s
                .create_job("a", json!({"x": 1}), JobState::Running, Some("alice"))
                .unwrap();
            let b = s
                .create_job("b", json!({}), JobState::Pending, None)
                .unwrap();
            assert_eq!((a, b), (1, 2));
            for step in 1..=3u64 {
                s.append_metrics(a, &json!({"stage": "rl", "step": step}))
                    .unwrap();
            }
            s.append_metrics(b, &json!({"stage": "x", "step": 1}))
                .unwrap();
            let (progress, rec) = rl_checkpoint(2, 7);
            assert!(s.checkpoint(a, &progress, &rec, 2).unwrap().is_empty());
            let later = CheckpointRecord {
                step: 3,
                ..rec.clone()
            };
            assert!(s.checkpoint(a, &progress, &later, 2).unwrap().is_empty());
            let forgotten = s
                .checkpoint(
                    a,
                    &progress,
                    &CheckpointRecord {
                        step: 4,
                        ..rec.clone()
                    },
                    2,
                )
                .unwrap();
            assert_eq!(forgotten, vec![rec]);
            s.set_state(b, JobState::Failed, Some("boom".into()))
                .unwrap();
        }
        let s = Store::open(&p).unwrap();
        let jobs = s.jobs().unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].progress.step, 2);
        assert_eq!(jobs[0].spec, json!({"x": 1}));
        assert_eq!(
            (jobs[0].owner.as_deref(), jobs[1].owner.as_deref()),
            (Some("alice"), None)
        );
        assert_eq!(jobs[1].state, JobState::Failed);
        assert_eq!(jobs[1].error.as_deref(), Some("boom"));
        assert_eq!(s.metrics(1, 0).unwrap().len(), 3);
        assert_eq!(s.metrics(1, 2).unwrap()[0].0, 2);
        assert_eq!(s.metrics(2, 0).unwrap().len(), 1);
        let kept: Vec<u64> = s.checkpoints(1).unwrap().iter().map(|c| c.step).collect();
        assert_eq!(kept, vec![3, 4]);
        let dropped = s
            .retain_metrics(1, |r| r["step"].as_u64() <= Some(2))
            .unwrap();
        assert_eq!(dropped, 1);
        assert_eq!(s.metrics(1, 0).unwrap().len(), 2);
        assert_eq!(s.metrics(2, 0).unwrap().len(), 1, "other jobs untouched");
        // Rows appended after a rewind continue the numbering without reusing a number, so a
        // reader's cursor never skips them.
        assert_eq!(s.append_metrics(1, &json!({"step": 3})).unwrap(), 3);
        assert_eq!(s.append_log(1, "a").unwrap(), 0);
        assert_eq!(s.append_log(1, "b").unwrap(), 1);
        let logs = s.logs(1, 1).unwrap();
        assert_eq!((logs.len(), logs[0].1.text.as_str()), (1, "b"));
        assert!(matches!(s.job(9), Err(StoreError::NoJob { id: 9, .. })));
    }

    #[test]
    fn a_job_recorded_before_owners_existed_reads_as_the_admins() {
        let old = br#"{"id":1,"name":"a","spec":{},"state":"pending","error":null,"created_ms":1,"updated_ms":1,"progress":{"completed":[],"stage":null,"step":0,"checkpoint":null,"weight_version":0}}"#;
        let job: Job = from_json(old).unwrap();
        assert_eq!((job.id, job.owner), (1, None));
    }

    #[test]
    fn a_second_process_cannot_open_a_store_in_use() {
        let p = tmp("busy");
        let _s = Store::open(&p).unwrap();
        let e = Store::open(&p).err().expect("second open refused");
        assert!(matches!(e, StoreError::Busy { .. }), "{e}");
        assert!(e.to_string().contains("store.redb is in use"), "{e}");
    }
}
