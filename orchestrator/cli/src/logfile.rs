//! `RUN_DIR/train.log`: every log line of a `trellis train` or `resume` — the `tracing` events
//! and the progress lines, quiet or not — appended to the run directory's log once the command
//! knows which run it is. Before that, and for other commands, nothing is written.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

static FILE: Mutex<Option<std::fs::File>> = Mutex::new(None);

fn file() -> std::sync::MutexGuard<'static, Option<std::fs::File>> {
    FILE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Appends this process's log lines to `dir/train.log` from now on (the folder is made).
pub fn open(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("train.log"))?;
    *file() = Some(f);
    Ok(())
}

/// Appends one line (a progress line) with the time.
pub fn line(text: &str) {
    if let Some(f) = file().as_mut() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        // A log that cannot be written is no reason to stop a run.
        let _ = writeln!(f, "{now:.3} {text}");
    }
}

/// The log file as a `tracing` writer (nothing until [`open`]).
pub struct Writer;

impl Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match file().as_mut() {
            Some(f) => f.write(buf),
            None => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match file().as_mut() {
            Some(f) => f.flush(),
            None => Ok(()),
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Writer {
    type Writer = Writer;
    fn make_writer(&'a self) -> Writer {
        Writer
    }
}
