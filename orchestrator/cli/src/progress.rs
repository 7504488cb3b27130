//! The command line's sinks of a run's record: progress on stderr — on a terminal an `indicatif`
//! bar per stage, with evaluations, notes and log messages printed above the bars instead of
//! gluing to them; otherwise one line per event — and the plot drawn when the run finishes.
//! Every progress line also goes to `RUN_DIR/train.log`.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use orchestrator::record::{Event, RecordError, Recorder};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The bars on stderr (hidden when stderr is not a terminal).
fn bars() -> &'static MultiProgress {
    static BARS: OnceLock<MultiProgress> = OnceLock::new();
    BARS.get_or_init(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()))
}

/// stderr for `tracing`, written with the bars lifted out of the way.
pub struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        bars().suspend(|| std::io::stderr().write_all(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Stderr;
    fn make_writer(&'a self) -> Stderr {
        Stderr
    }
}

/// Progress on stderr. Quiet: only what must be said (where agents register).
pub struct Progress {
    quiet: bool,
    tty: bool,
    /// The current stage's bar and its stage.
    bar: Option<(String, ProgressBar)>,
}

impl Progress {
    /// Progress on this process's stderr.
    pub fn new(quiet: bool) -> Self {
        Self {
            quiet,
            tty: std::io::stderr().is_terminal(),
            bar: None,
        }
    }

    /// A line that stays: above the bars on a terminal.
    fn println(&self, line: &str) {
        if self.tty {
            let _ = bars().println(line);
        } else {
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    }
}

impl Recorder for Progress {
    fn event(&mut self, event: &Event<'_>) -> Result<(), RecordError> {
        let line = event.line();
        crate::logfile::line(&line);
        let always = matches!(event, Event::Note { always: true, .. });
        // Checkpoints are for the log; the terminal shows the steps.
        if (self.quiet && !always) || matches!(event, Event::Checkpoint { .. }) {
            return Ok(());
        }
        let Event::Step {
            stage,
            step,
            total,
            metrics,
            ..
        } = *event
        else {
            self.println(&line);
            return Ok(());
        };
        if !self.tty {
            self.println(&line);
            return Ok(());
        }
        if self.bar.as_ref().is_none_or(|(s, _)| s != stage) {
            if let Some((_, old)) = self.bar.take() {
                old.finish();
            }
            let bar = bars().add(ProgressBar::new(total));
            bar.set_style(
                ProgressStyle::with_template(
                    "[{prefix}] [{bar:20}] step {pos}/{len} {msg} eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#>-"),
            );
            bar.set_prefix(stage.to_string());
            self.bar = Some((stage.to_string(), bar));
        }
        let show = |k: &str, label: &str, digits: usize| {
            metrics
                .get(k)
                .map(|v| format!("{label} {v:.digits$} "))
                .unwrap_or_default()
        };
        if let Some((_, bar)) = &self.bar {
            bar.set_position(step);
            bar.set_message(format!(
                "{}{}{}",
                show("sft/loss", "loss", 3),
                show("critic/score/mean", "reward", 3),
                show("perf/throughput", "tokens/s", 0),
            ));
            if metrics.contains_key("eval/accuracy") {
                // Evaluations stay on screen above the bar.
                bar.println(&line);
            }
            if step == total {
                bar.finish();
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), RecordError> {
        if let Some((_, bar)) = self.bar.take() {
            bar.finish();
        }
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
