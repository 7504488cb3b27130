//! TensorBoard event files: every logged metric also goes to
//! `RUN_DIR/tensorboard/<stage>/events.out.tfevents.*` — one TensorBoard run per stage — as a
//! scalar tagged with its key (`critic/score/mean`, VeRL's tags, so a stage's curves overlay a
//! VeRL run's), in TFRecord framing (length and data each guarded by a masked CRC-32C), so
//! `tensorboard --logdir RUN_DIR` shows the curves with no conversion.

use prost::Message;
use proto::tensorboard::{Event, Summary, event::What, summary::Value};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Appends events to one file.
pub struct EventWriter {
    file: std::fs::File,
    path: PathBuf,
}

fn masked_crc(data: &[u8]) -> u32 {
    let c = proto::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl EventWriter {
    /// A new event file in `dir` (each process writes its own, as TensorBoard expects).
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let t = now();
        let path = dir.join(format!(
            "events.out.tfevents.{}.trellis.{}",
            t as u64,
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let mut w = Self { file, path };
        w.write(&Event {
            wall_time: t,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(w)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, e: &Event) -> std::io::Result<()> {
        let data = e.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(&data);
        rec.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file.write_all(&rec)?;
        self.file.flush()
    }

    /// Writes scalars `(tag, value)` at `step`.
    pub fn scalars<'a>(
        &mut self,
        step: u64,
        values: impl IntoIterator<Item = (String, f64)> + 'a,
    ) -> std::io::Result<()> {
        let value: Vec<Value> = values
            .into_iter()
            .map(|(tag, v)| Value {
                tag,
                simple_value: v as f32,
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }
}

/// The run's event files, one folder (a TensorBoard run) per stage, opened as stages log.
pub struct TensorBoard {
    dir: PathBuf,
    stages: std::collections::BTreeMap<String, EventWriter>,
}

impl TensorBoard {
    /// Event files under `dir` (made when the first row comes).
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            stages: Default::default(),
        }
    }

    /// Writes `values` of `stage` at `step`.
    pub fn scalars(
        &mut self,
        stage: &str,
        step: u64,
        values: impl IntoIterator<Item = (String, f64)>,
    ) -> std::io::Result<&Path> {
        let w = match self.stages.entry(stage.to_string()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(EventWriter::create(&self.dir.join(stage))?)
            }
        };
        w.scalars(step, values)?;
        Ok(w.path())
    }

    /// The folder of the event files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Reads back every event of a file, checking the framing CRCs (for tests and tools).
pub fn read_events(path: &Path) -> Result<Vec<Event>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes.get(at..at + 12).ok_or("truncated record header")?;
        let len = u64::from_le_bytes(header[..8].try_into().map_err(|_| "bad length")?) as usize;
        if u32::from_le_bytes(header[8..12].try_into().map_err(|_| "bad crc")?)
            != masked_crc(&header[..8])
        {
            return Err(format!("length CRC mismatch at byte {at}"));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or("truncated record")?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or("truncated record CRC")?;
        if u32::from_le_bytes(crc.try_into().map_err(|_| "bad crc")?) != masked_crc(data) {
            return Err(format!("data CRC mismatch at byte {at}"));
        }
        out.push(Event::decode(data).map_err(|e| e.to_string())?);
        at += 16 + len;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_with_valid_framing() {
        let dir = std::env::temp_dir().join(format!("trellis-tb-{}", std::process::id()));
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalars(7, [("rl/critic/score/mean".to_string(), 0.5)])
            .unwrap();
        let events = read_events(w.path()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("no summary")
        };
        assert_eq!(
            (
                events[1].step,
                s.value[0].tag.as_str(),
                s.value[0].simple_value
            ),
            (7, "rl/critic/score/mean", 0.5)
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn each_stage_is_a_run_and_tags_are_the_metric_keys() {
        let dir = std::env::temp_dir().join(format!("trellis-tb-stages-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut tb = TensorBoard::new(&dir);
        tb.scalars("warmup", 1, [("sft/loss".to_string(), 2.0)])
            .unwrap();
        let rl = tb
            .scalars("rl", 3, [("critic/score/mean".to_string(), 0.25)])
            .unwrap()
            .to_path_buf();
        tb.scalars("rl", 4, [("critic/score/mean".to_string(), 0.5)])
            .unwrap();
        assert!(rl.starts_with(dir.join("rl")));
        let tags: Vec<(i64, String)> = read_events(&rl)
            .unwrap()
            .into_iter()
            .filter_map(|e| match e.what {
                Some(What::Summary(s)) => Some((e.step, s.value[0].tag.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            tags,
            [
                (3, "critic/score/mean".into()),
                (4, "critic/score/mean".into())
            ]
        );
        assert_eq!(std::fs::read_dir(dir.join("warmup")).unwrap().count(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
