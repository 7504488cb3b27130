//! The command line's sinks of a run's record: the progress bar on stderr, and the plot drawn
//! when the run finishes.

use orchestrator::record::{Event, RecordError, Recorder};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

/// Progress lines on stderr: on a terminal, one bar redrawn in place (kept for evaluations and
/// a stage's last step); otherwise one line per event. Quiet: only what must be said (where
/// agents register).
pub struct ProgressBar {
    quiet: bool,
    tty: bool,
}

impl ProgressBar {
    /// A bar on this process's stderr.
    pub fn new(quiet: bool) -> Self {
        Self {
            quiet,
            tty: std::io::stderr().is_terminal(),
        }
    }
}

impl Recorder for ProgressBar {
    fn event(&mut self, event: &Event<'_>) -> Result<(), RecordError> {
        let always = matches!(event, Event::Note { always: true, .. });
        if self.quiet && !always {
            return Ok(());
        }
        let line = event.line();
        let mut err = std::io::stderr().lock();
        // A terminal that went away is no reason to stop a run.
        let _ = if !self.tty {
            writeln!(err, "{line}")
        } else if event.keep() {
            writeln!(err, "\r\x1b[2K{line}")
        } else {
            write!(err, "\r\x1b[2K{line}").and_then(|_| err.flush())
        };
        Ok(())
    }
}

/// Draws `RUN_DIR/plot.png` from `metrics.jsonl` when the run finishes.
pub struct PlotSink {
    dir: PathBuf,
}

impl PlotSink {
    /// The plot of the run in `dir`.
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }
}

impl Recorder for PlotSink {
    fn finish(&mut self) -> Result<(), RecordError> {
        let out = self.dir.join("plot.png");
        crate::plot::plot(&self.dir, &out).map_err(|msg| RecordError::Io {
            path: out,
            source: std::io::Error::other(msg),
        })
    }
}
