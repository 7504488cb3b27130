//! Jobs in child processes: a server runs each job in a process of its own (the same binary's
//! `job-worker`), so a job that aborts, panics or is killed by the OOM killer fails alone — the
//! server and the other jobs go on, and the job can be resumed from its last checkpoint like any
//! failed job.
//!
//! The server keeps the one store. The child reaches its job's record through [`Remote`], a
//! [`JobStore`] whose every call is one JSON line to the server and one JSON line back, over
//! pipes, answered by [`serve`] against the real store; so the lifecycle, the executor and every
//! sink run unchanged in the child, and the store's invariants (one transaction moves the
//! progress to a complete checkpoint; a watcher that sees a final state has every row) hold as
//! for a job on a thread. A job the child leaves without an ending (killed, aborted) is failed by
//! the server, naming the signal or exit status.
//!
//! The server also keeps the one head its agents register with. A job with pools on agents
//! borrows them ([`actors::head::lend`]): [`Remote`] is also the child's [`Lender`] — the
//! server's agents, room and death notices over the same pipes — while spawns, calls and weight
//! pushes go from the child to the agents directly. When the child ends, the server stops what
//! it left on the agents.
//!
//! Owns: the protocol between the server and a job's process, both ends. Does not own: starting
//! the process (the queue, with the binary's command) or how a job runs (`run`).

use crate::store::{CheckpointRecord, Job, JobState, JobStore, Progress, Store, StoreError};
use actors::{Demand, Head, Lender, Lent, Loan};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One call of a job's process to its record.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Job {
        id: u64,
    },
    SetState {
        id: u64,
        state: JobState,
        error: Option<String>,
    },
    AppendMetrics {
        id: u64,
        row: serde_json::Value,
    },
    AppendLog {
        id: u64,
        text: String,
    },
    Metrics {
        id: u64,
        from: u64,
    },
    Checkpoints {
        id: u64,
    },
    Checkpoint {
        id: u64,
        progress: Progress,
        record: CheckpointRecord,
        keep: usize,
    },
    Rewind {
        id: u64,
        progress: Progress,
    },
    /// What the child's head needs to borrow the server's agents.
    Loan,
    /// The server's live agents and the child's actors' deaths since the last poll.
    Agents,
    Reserve {
        agent: String,
        actor_id: String,
        demand: Demand,
    },
    Release {
        agent: String,
        actor_id: String,
    },
}

/// The server's head, lent to one job's process (`borrower` names the job in its ledger).
pub struct Lending<'a> {
    pub head: &'a Head,
    pub borrower: String,
}

/// The answer: the call's result as JSON, or the store's error.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply {
    Ok(serde_json::Value),
    /// No such job (kept apart so the child sees [`StoreError::NoJob`]).
    NoJob(u64),
    Err(String),
}

/// Answers a job process's calls (JSON lines from `from`, answers to `to`) against `store` and,
/// with `lending`, the server's head, until the process closes its end. Returns the I/O error
/// that ended it early, if any.
pub fn serve(
    store: &Store,
    lending: Option<&Lending<'_>>,
    from: impl BufRead,
    mut to: impl Write,
) -> std::io::Result<()> {
    for line in from.lines() {
        let line = line?;
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(request) => answer(store, lending, request),
            Err(e) => Reply::Err(format!("unreadable call from the job's process: {e}")),
        };
        let mut text = serde_json::to_string(&reply)
            .unwrap_or_else(|e| format!("{{\"err\":\"cannot encode the answer: {e}\"}}"));
        text.push('\n');
        to.write_all(text.as_bytes())?;
        to.flush()?;
    }
    Ok(())
}

fn answer(store: &Store, lending: Option<&Lending<'_>>, request: Request) -> Reply {
    fn ok<T: Serialize>(r: Result<T, StoreError>) -> Reply {
        match r.map(|v| serde_json::to_value(v)) {
            Ok(Ok(v)) => Reply::Ok(v),
            Ok(Err(e)) => Reply::Err(e.to_string()),
            Err(StoreError::NoJob { id, .. }) => Reply::NoJob(id),
            Err(e) => Reply::Err(e.to_string()),
        }
    }
    match request {
        Request::Job { id } => ok(store.job(id)),
        Request::SetState { id, state, error } => ok(store.set_state(id, state, error)),
        Request::AppendMetrics { id, row } => ok(store.append_metrics(id, &row)),
        Request::AppendLog { id, text } => ok(store.append_log(id, &text)),
        Request::Metrics { id, from } => ok(store.metrics(id, from)),
        Request::Checkpoints { id } => ok(store.checkpoints(id)),
        Request::Checkpoint {
            id,
            progress,
            record,
            keep,
        } => ok(store.checkpoint(id, &progress, &record, keep)),
        Request::Rewind { id, progress } => ok(JobStore::rewind(store, id, &progress)),
        Request::Loan => lend(lending, |l| encode(l.head.loan())),
        Request::Agents => lend(lending, |l| encode(l.head.lend(&l.borrower))),
        Request::Reserve {
            agent,
            actor_id,
            demand,
        } => lend(lending, |l| {
            l.head.lend_room(&l.borrower, &agent, &actor_id, &demand)?;
            Ok(serde_json::Value::Null)
        }),
        Request::Release { agent, actor_id } => lend(lending, |l| {
            l.head.lend_release(&agent, &actor_id);
            Ok(serde_json::Value::Null)
        }),
    }
}

/// Answers a call to the server's head, which only a job with a lending server may make.
fn lend(
    lending: Option<&Lending<'_>>,
    f: impl FnOnce(&Lending<'_>) -> Result<serde_json::Value, String>,
) -> Reply {
    match lending.map(f) {
        Some(Ok(v)) => Reply::Ok(v),
        Some(Err(e)) => Reply::Err(e),
        None => Reply::Err("this server lends no agents to its jobs".into()),
    }
}

fn encode<T: Serialize>(v: T) -> Result<serde_json::Value, String> {
    serde_json::to_value(v).map_err(|e| format!("cannot encode the answer: {e}"))
}

/// The store of a server, as its job's process sees it: each call one round trip over the
/// pipes the server gave the process.
pub struct Remote {
    path: PathBuf,
    io: Mutex<(Box<dyn BufRead + Send>, Box<dyn Write + Send>)>,
}

impl Remote {
    /// Calls go to `to`, answers come from `from`; `path` is the server's store file (for
    /// messages).
    pub fn new(
        path: PathBuf,
        from: impl BufRead + Send + 'static,
        to: impl Write + Send + 'static,
    ) -> Remote {
        Remote {
            path,
            io: Mutex::new((Box::new(from), Box::new(to))),
        }
    }

    fn err(&self, msg: String) -> StoreError {
        StoreError::Remote {
            path: self.path.clone(),
            msg,
        }
    }

    fn call<T: for<'de> Deserialize<'de>>(&self, request: &Request) -> Result<T, StoreError> {
        let mut line = serde_json::to_string(request)
            .map_err(|e| self.err(format!("cannot encode the call: {e}")))?;
        line.push('\n');
        let mut io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        let (from, to) = &mut *io;
        let lost = |e: std::io::Error| self.err(format!("the server is gone: {e}"));
        to.write_all(line.as_bytes()).map_err(lost)?;
        to.flush().map_err(lost)?;
        let mut answer = String::new();
        if from.read_line(&mut answer).map_err(lost)? == 0 {
            return Err(self.err("the server is gone (its end of the pipe closed)".into()));
        }
        match serde_json::from_str::<Reply>(&answer) {
            Ok(Reply::Ok(v)) => serde_json::from_value(v)
                .map_err(|e| self.err(format!("an answer that does not fit: {e}"))),
            Ok(Reply::NoJob(id)) => Err(StoreError::NoJob {
                path: self.path.clone(),
                id,
            }),
            Ok(Reply::Err(msg)) => Err(self.err(msg)),
            Err(e) => Err(self.err(format!("an unreadable answer: {e}"))),
        }
    }
}

impl Remote {
    /// What this process's head needs to borrow the server's agents.
    pub fn loan(&self) -> Result<Loan, StoreError> {
        self.call(&Request::Loan)
    }
}

/// The server's head, as a job's process borrows it.
impl Lender for Remote {
    fn poll(&self) -> Result<Lent, String> {
        self.call(&Request::Agents).map_err(|e| e.to_string())
    }
    fn reserve(&self, agent: &str, actor_id: &str, demand: &Demand) -> Result<(), String> {
        self.call(&Request::Reserve {
            agent: agent.into(),
            actor_id: actor_id.into(),
            demand: demand.clone(),
        })
        .map_err(|e| match e {
            StoreError::Remote { msg, .. } => msg,
            other => other.to_string(),
        })
    }
    fn release(&self, agent: &str, actor_id: &str) -> Result<(), String> {
        self.call(&Request::Release {
            agent: agent.into(),
            actor_id: actor_id.into(),
        })
        .map_err(|e| e.to_string())
    }
}

impl JobStore for Remote {
    fn path(&self) -> &Path {
        &self.path
    }
    fn job(&self, id: u64) -> Result<Job, StoreError> {
        self.call(&Request::Job { id })
    }
    fn set_state(
        &self,
        id: u64,
        state: JobState,
        error: Option<String>,
    ) -> Result<Job, StoreError> {
        self.call(&Request::SetState { id, state, error })
    }
    fn append_metrics(&self, id: u64, row: &serde_json::Value) -> Result<u64, StoreError> {
        self.call(&Request::AppendMetrics {
            id,
            row: row.clone(),
        })
    }
    fn append_log(&self, id: u64, text: &str) -> Result<u64, StoreError> {
        self.call(&Request::AppendLog {
            id,
            text: text.to_string(),
        })
    }
    fn metrics(&self, id: u64, from: u64) -> Result<Vec<(u64, serde_json::Value)>, StoreError> {
        self.call(&Request::Metrics { id, from })
    }
    fn checkpoints(&self, id: u64) -> Result<Vec<CheckpointRecord>, StoreError> {
        self.call(&Request::Checkpoints { id })
    }
    fn checkpoint(
        &self,
        id: u64,
        progress: &Progress,
        record: &CheckpointRecord,
        keep: usize,
    ) -> Result<Vec<CheckpointRecord>, StoreError> {
        self.call(&Request::Checkpoint {
            id,
            progress: progress.clone(),
            record: record.clone(),
            keep,
        })
    }
    fn rewind(&self, id: u64, progress: &Progress) -> Result<usize, StoreError> {
        self.call(&Request::Rewind {
            id,
            progress: progress.clone(),
        })
    }
}

/// How a job's process ended without recording an ending, in words for the job's error.
pub fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (_, Some(sig)) => {
            let name = match sig {
                6 => " (SIGABRT: it aborted)",
                9 => " (SIGKILL: killed, e.g. by the out-of-memory killer)",
                11 => " (SIGSEGV: a crash)",
                7 => " (SIGBUS)",
                15 => " (SIGTERM)",
                _ => "",
            };
            format!("its process was killed by signal {sig}{name}")
        }
        (Some(code), None) => {
            format!("its process exited with status {code} without recording an ending")
        }
        (None, None) => "its process ended without recording an ending".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A `Remote` over in-memory pipes to a thread serving a real store: every call answers
    /// what the store itself answers.
    #[test]
    fn a_remote_store_answers_as_the_store_does() {
        let dir = std::env::temp_dir().join(format!("trellis-worker-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = std::sync::Arc::new(Store::open(&dir.join("store.redb")).unwrap());
        let id = store
            .create_job("j", json!({"name": "j"}), JobState::Running, Some("ann"))
            .unwrap();
        let (calls_r, calls_w) = std::io::pipe().unwrap();
        let (answers_r, answers_w) = std::io::pipe().unwrap();
        let server = {
            let store = store.clone();
            std::thread::spawn(move || {
                serve(&store, None, std::io::BufReader::new(calls_r), answers_w)
            })
        };
        let remote = Remote::new(
            store.path().to_path_buf(),
            std::io::BufReader::new(answers_r),
            calls_w,
        );
        let r: &dyn JobStore = &remote;
        assert_eq!(r.job(id).unwrap(), store.job(id).unwrap());
        assert!(matches!(r.job(9), Err(StoreError::NoJob { id: 9, .. })));
        // Floats come back bit for bit.
        let x = 0.000_100_000_004_749_745_13_f64;
        for step in 1..=4u64 {
            assert_eq!(
                r.append_metrics(id, &json!({"stage": "rl", "step": step, "lr": x}))
                    .unwrap(),
                step - 1
            );
        }
        assert_eq!(r.append_log(id, "hello").unwrap(), 0);
        let (progress, record) = crate::store::rl_checkpoint(2, 2);
        assert!(r.checkpoint(id, &progress, &record, 1).unwrap().is_empty());
        assert_eq!(r.checkpoints(id).unwrap(), vec![record]);
        assert_eq!(
            r.rewind(id, &progress).unwrap(),
            2,
            "steps 3 and 4 run again"
        );
        let rows = r.metrics(id, 0).unwrap();
        assert_eq!(rows, store.metrics(id, 0).unwrap());
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].1["lr"].as_f64().unwrap().to_bits(), x.to_bits());
        let done = r.set_state(id, JobState::Succeeded, None).unwrap();
        assert_eq!(done.state, store.job(id).unwrap().state);
        assert_eq!(store.job(id).unwrap().owner.as_deref(), Some("ann"));
        // The child's end closing ends the server's loop.
        drop(remote);
        server.join().unwrap().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_job_process_that_died_is_described_by_its_signal() {
        use std::os::unix::process::ExitStatusExt;
        let table = [
            (6, "signal 6 (SIGABRT: it aborted)"),
            (9, "signal 9 (SIGKILL"),
            (11, "SIGSEGV"),
        ];
        for (sig, want) in table {
            let got = describe_exit(std::process::ExitStatus::from_raw(sig));
            assert!(got.contains(want), "{sig}: {got}");
        }
        let got = describe_exit(std::process::ExitStatus::from_raw(3 << 8));
        assert!(got.contains("exited with status 3"), "{got}");
    }
}
