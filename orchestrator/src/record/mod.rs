//! The record of a run: every step's metric row and what people follow (progress, notes), sent
//! to sinks behind one interface, [`Recorder`]. The library's sinks are the job store (rows,
//! and log lines for server jobs), `metrics.jsonl`, TensorBoard and MLflow; the command line adds its
//! progress bar. A row reaches the store before any other sink, so a watcher that reads it from
//! the store never sees a row the run lost.
//!
//! Owns: the row format and the progress lines. Never: prints (a sink of the binary does), or
//! decides what is recorded when (the executor does).

pub mod mlflow;
pub mod tensorboard;

use crate::store::{CheckpointRecord, JobStatus, JobStore, Progress, StoreError};
use learner::rl::Metrics;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A sink that could not write.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The job store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A file of the run directory.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// An experiment tracker that cannot be used.
    #[error("{0}")]
    Tracking(String),
}

/// One step's metrics, as every sink gets them.
pub struct Row<'a> {
    /// The stage.
    pub stage: &'a str,
    /// The step (0 for an eval stage).
    pub step: u64,
    /// VeRL-named metrics (non-finite values are left out of the row).
    pub metrics: &'a Metrics,
    /// The row as stored: `stage`, `step` and the finite metrics.
    pub json: serde_json::Value,
}

impl<'a> Row<'a> {
    /// The row of `metrics` at `stage` `step`.
    pub fn new(stage: &'a str, step: u64, metrics: &'a Metrics) -> Self {
        let mut obj = serde_json::Map::new();
        obj.insert("stage".into(), stage.into());
        obj.insert("step".into(), step.into());
        for (k, v) in metrics {
            if v.is_finite() {
                obj.insert(k.clone(), (*v).into());
            }
        }
        Self {
            stage,
            step,
            metrics,
            json: serde_json::Value::Object(obj),
        }
    }
}

/// What people follow of a run.
#[derive(Clone, Copy, Debug)]
pub enum Event<'a> {
    /// A training step finished.
    Step {
        /// The stage.
        stage: &'a str,
        /// The step.
        step: u64,
        /// The stage's steps.
        total: u64,
        /// Its metrics.
        metrics: &'a Metrics,
        /// Estimated time to the end of the stage.
        eta: Duration,
    },
    /// An eval stage finished.
    Eval {
        /// The stage.
        stage: &'a str,
        /// Greedy held-out accuracy.
        accuracy: f64,
    },
    /// A checkpoint was recorded: where the job stands now, and the checkpoints kept.
    Checkpoint {
        /// The job's progress.
        progress: &'a Progress,
        /// The checkpoints the store keeps, oldest first.
        kept: &'a [CheckpointRecord],
    },
    /// Something worth saying (where the engines run, where agents register).
    Note {
        /// The text.
        text: &'a str,
        /// Said even to someone who asked for quiet (agents need the address it names).
        always: bool,
    },
}

impl Event<'_> {
    /// The line people read: `[stage] [####----] step 3/10 loss 0.123 ... eta 12s`.
    pub fn line(&self) -> String {
        match *self {
            Event::Step {
                stage,
                step,
                total,
                metrics,
                eta,
            } => {
                let show = |k: &str, label: &str, digits: usize| {
                    metrics
                        .get(k)
                        .map(|v| format!(" {label} {v:.digits$}"))
                        .unwrap_or_default()
                };
                let width = 20;
                let filled = (step as usize * width) / total.max(1) as usize;
                let bar = format!("{}{}", "#".repeat(filled), "-".repeat(width - filled));
                format!(
                    "[{stage}] [{bar}] step {step}/{total}{}{}{}{} eta {:.0}s",
                    show("sft/loss", "loss", 3),
                    show("critic/score/mean", "reward", 3),
                    show("eval/accuracy", "accuracy", 3),
                    show("perf/throughput", "tokens/s", 0),
                    eta.as_secs_f64(),
                )
            }
            Event::Eval { stage, accuracy } => format!("[{stage}] eval accuracy {accuracy:.3}"),
            Event::Checkpoint { progress, .. } => format!(
                "[{}] checkpoint at step {}: {}",
                progress.stage.as_deref().unwrap_or(""),
                progress.step,
                progress.checkpoint.as_deref().unwrap_or("")
            ),
            Event::Note { text, .. } => text.to_string(),
        }
    }

    /// Whether the line stays on screen (a bar redrawn in place shows only the latest step):
    /// evaluations, a stage's last step, and notes.
    pub fn keep(&self) -> bool {
        match *self {
            Event::Step {
                step,
                total,
                metrics,
                ..
            } => step == total || metrics.contains_key("eval/accuracy"),
            Event::Eval { .. } | Event::Checkpoint { .. } | Event::Note { .. } => true,
        }
    }
}

/// A sink of a run's record.
pub trait Recorder: Send {
    /// A step's metric row.
    fn row(&mut self, row: &Row<'_>) -> Result<(), RecordError> {
        let _ = row;
        Ok(())
    }

    /// An event people follow.
    fn event(&mut self, event: &Event<'_>) -> Result<(), RecordError> {
        let _ = event;
        Ok(())
    }

    /// The run finished.
    fn finish(&mut self) -> Result<(), RecordError> {
        Ok(())
    }
}

/// A sink lent to one run of a job (a job recovered in its process runs again with the sinks
/// it started with).
impl<R: Recorder + ?Sized> Recorder for &mut R {
    fn row(&mut self, row: &Row<'_>) -> Result<(), RecordError> {
        (**self).row(row)
    }

    fn event(&mut self, event: &Event<'_>) -> Result<(), RecordError> {
        (**self).event(event)
    }

    fn finish(&mut self) -> Result<(), RecordError> {
        (**self).finish()
    }
}

/// Every sink of a run, written in order.
#[derive(Default)]
pub struct Records<'a> {
    sinks: Vec<Box<dyn Recorder + 'a>>,
}

impl<'a> Records<'a> {
    /// Adds a sink (after the ones already there).
    pub fn push(&mut self, sink: Box<dyn Recorder + 'a>) {
        self.sinks.push(sink);
    }

    /// Records `metrics` as the row of `stage` `step`.
    pub fn row(&mut self, stage: &str, step: u64, metrics: &Metrics) -> Result<(), RecordError> {
        let row = Row::new(stage, step, metrics);
        self.sinks.iter_mut().try_for_each(|s| s.row(&row))
    }

    /// Tells every sink of `event`.
    pub fn event(&mut self, event: Event<'_>) -> Result<(), RecordError> {
        self.sinks.iter_mut().try_for_each(|s| s.event(&event))
    }

    /// Tells every sink that the run finished (a plot sink draws then).
    pub fn finish(&mut self) -> Result<(), RecordError> {
        self.sinks.iter_mut().try_for_each(|s| s.finish())
    }
}

/// The job store: rows always; progress lines as the job's log when `log` (server jobs).
pub struct StoreSink<'s> {
    store: &'s dyn JobStore,
    job: u64,
    log: bool,
}

impl<'s> StoreSink<'s> {
    /// Records job `job` in `store`, its progress lines too when `log`.
    pub fn new(store: &'s dyn JobStore, job: u64, log: bool) -> Self {
        Self { store, job, log }
    }
}

impl Recorder for StoreSink<'_> {
    fn row(&mut self, row: &Row<'_>) -> Result<(), RecordError> {
        self.store.append_metrics(self.job, &row.json)?;
        Ok(())
    }

    fn event(&mut self, event: &Event<'_>) -> Result<(), RecordError> {
        // Checkpoints are the store's own records already.
        if self.log && !matches!(event, Event::Checkpoint { .. }) {
            self.store.append_log(self.job, &event.line())?;
        }
        Ok(())
    }
}

/// `RUN_DIR/status.json`: what the store says of the running job, kept current after every row
/// and checkpoint, so `trellis status` can read it while the run holds the store.
pub struct LiveStatus {
    path: PathBuf,
    status: JobStatus,
}

impl LiveStatus {
    /// Keeps `status` (the store's view when the run started) at `path`.
    pub fn new(path: PathBuf, mut status: JobStatus) -> Result<Self, RecordError> {
        status.live = true;
        let mut sink = Self { path, status };
        sink.write()?;
        Ok(sink)
    }

    fn write(&mut self) -> Result<(), RecordError> {
        self.status.job.updated_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let text = serde_json::to_vec_pretty(&self.status).map_err(|e| RecordError::Io {
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        crate::store::write_atomic(&self.path, &text)
            .map_err(|(path, source)| RecordError::Io { path, source })
    }
}

impl Recorder for LiveStatus {
    fn row(&mut self, _row: &Row<'_>) -> Result<(), RecordError> {
        self.status.metric_rows += 1;
        self.write()
    }

    fn event(&mut self, event: &Event<'_>) -> Result<(), RecordError> {
        let Event::Checkpoint { progress, kept } = event else {
            return Ok(());
        };
        self.status.job.progress = (*progress).clone();
        self.status.checkpoints = kept.to_vec();
        self.write()
    }
}

/// `metrics.jsonl`: one JSON object per row, flushed as written.
pub struct JsonlSink {
    file: std::fs::File,
    path: PathBuf,
}

impl JsonlSink {
    /// Appends to `path` (created when missing).
    pub fn open(path: &Path) -> Result<Self, RecordError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| RecordError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
        })
    }
}

impl Recorder for JsonlSink {
    fn row(&mut self, row: &Row<'_>) -> Result<(), RecordError> {
        writeln!(self.file, "{}", row.json)
            .and_then(|_| self.file.flush())
            .map_err(|source| RecordError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

impl Recorder for tensorboard::TensorBoard {
    fn row(&mut self, row: &Row<'_>) -> Result<(), RecordError> {
        let scalars = row
            .metrics
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (k.clone(), *v));
        match self.scalars(row.stage, row.step, scalars) {
            Ok(_) => Ok(()),
            Err(source) => Err(RecordError::Io {
                path: self.dir().join(row.stage),
                source,
            }),
        }
    }
}
