//! A run folder's logs, for pre-training and fine-tuning alike ([`RunLog`]): `metrics.jsonl`,
//! one JSON object per optimiser step, and TensorBoard event files with the same figures as
//! scalars, so that `tensorboard --logdir runs/` shows every run's curves.
//!
//! The event files' format is TensorFlow's record file: each record is its length (u64, little-endian), the
//! masked CRC-32C of those 8 bytes, the data, and the masked CRC-32C of the data; the data is
//! an `Event` protocol buffer (`wall_time`, `step`, and a `Summary` of `simple_value`s, or the
//! `file_version` header, or a `SessionLog`). The few fields written are encoded here by hand:
//! no protobuf or TensorFlow dependency.
//!
//! A run that resumes after step `s` starts a new file with a `SessionLog` START at `s + 1`,
//! which tells TensorBoard to drop the points past `s` that the interrupted run had written.

use std::io::Write;
use std::path::{Path, PathBuf};

use bertkit_stage_io::crc32c::{crc32c, mask};
use serde::Serialize;

use crate::{TrainError, io_err};

/// The masked CRC TensorFlow's records carry (so that a CRC of CRCs is not trivially valid).
fn masked_crc(bytes: &[u8]) -> u32 {
    mask(crc32c(bytes))
}

/// One record: length, its masked CRC, the data, the data's masked CRC.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field.
fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// An `Event` with its wall time and step, and `body` (already-encoded further fields).
fn event(wall_time: f64, step: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 20);
    out.push(1 << 3 | 1); // wall_time: double
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(2 << 3); // step: int64
    varint(&mut out, step);
    out.extend_from_slice(body);
    out
}

/// The body of an event holding scalar summaries: `Summary { repeated Value value = 1 }`,
/// `Value { string tag = 1; float simple_value = 2 }`.
fn scalars_body(values: &[(&str, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, value) in values {
        let mut v = Vec::new();
        bytes_field(&mut v, 1, tag.as_bytes());
        v.push(2 << 3 | 5); // simple_value: float
        v.extend_from_slice(&(*value as f32).to_le_bytes());
        bytes_field(&mut summary, 1, &v);
    }
    let mut body = Vec::new();
    bytes_field(&mut body, 5, &summary);
    body
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An event file being appended to.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Starts a new event file in `dir` for a run (re)starting after step `step`: the version
    /// header, and when resuming a `SessionLog` START at `step + 1`, the first step it writes
    /// (TensorBoard drops what earlier files hold from there on).
    pub fn create(dir: &Path, step: u64) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        // TensorBoard reads a folder's event files in name order: a later file's time stamp
        // must be later, even for runs within the same second.
        let latest = std::fs::read_dir(dir)
            .map_err(io_err(dir))?
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("events.out.tfevents.")?
                    .split('.')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        let stamp = latest.map_or(now() as u64, |l| (now() as u64).max(l + 1));
        let path = dir.join(format!(
            "events.out.tfevents.{stamp}.{host}.{}.bertkit",
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .map_err(io_err(&path))?;
        let mut writer = EventWriter { path, file };
        let mut header = Vec::new();
        bytes_field(&mut header, 3, b"brain.Event:2");
        writer.write(&event(now(), 0, &header))?;
        if step > 0 {
            // session_log (field 7): SessionLog { status (field 1) = START (1) }.
            let mut body = Vec::new();
            bytes_field(&mut body, 7, &[1 << 3, 1]);
            writer.write(&event(now(), step + 1, &body))?;
        }
        Ok(writer)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, event: &[u8]) -> Result<(), TrainError> {
        self.file
            .write_all(&record(event))
            .map_err(io_err(&self.path))
    }

    /// Appends scalars `(tag, value)` at `step`; non-finite values are left out.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<(), TrainError> {
        let finite: Vec<(&str, f64)> = values
            .iter()
            .copied()
            .filter(|(_, v)| v.is_finite())
            .collect();
        if finite.is_empty() {
            return Ok(());
        }
        self.write(&event(now(), step, &scalars_body(&finite)))
    }
}

/// A run folder's `metrics.jsonl` and event file, being appended to (by rank 0 alone).
pub struct RunLog {
    metrics_path: PathBuf,
    metrics: std::fs::File,
    events: EventWriter,
}

impl RunLog {
    /// Opens the logs of the run in `dir` (re)starting after step `started_at`: the lines of
    /// `metrics.jsonl` past it (written by a run that did not checkpoint them) are dropped, and
    /// a new event file starts (see [`EventWriter::create`]).
    pub fn open(dir: &Path, started_at: u64) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let metrics_path = dir.join("metrics.jsonl");
        let kept: Vec<String> = std::fs::read_to_string(&metrics_path)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s <= started_at)
            })
            .map(str::to_string)
            .collect();
        let mut text = kept.join("\n");
        if !text.is_empty() {
            text.push('\n');
        }
        bertkit_stage_io::write_atomically(&metrics_path, text.as_bytes())
            .map_err(io_err(&metrics_path))?;
        let metrics = std::fs::OpenOptions::new()
            .append(true)
            .open(&metrics_path)
            .map_err(io_err(&metrics_path))?;
        Ok(RunLog {
            metrics_path,
            metrics,
            events: EventWriter::create(dir, started_at)?,
        })
    }

    /// Appends `line` (an object with a `step`) to `metrics.jsonl` and `scalars` at `step` to
    /// the event file.
    pub fn write(
        &mut self,
        step: u64,
        line: &impl Serialize,
        scalars: &[(&str, f64)],
    ) -> Result<(), TrainError> {
        let text = serde_json::to_string(line).expect("metrics serialise");
        writeln!(self.metrics, "{text}").map_err(io_err(&self.metrics_path))?;
        self.events.scalars(step, scalars)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C's published check value, and the masked CRC and framing TensorFlow's record
    /// writer gives an empty record. (Tried: CRC-32's polynomial instead fails both.)
    #[test]
    fn crc_and_framing_match_tensorflows() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        let r = record(b"");
        assert_eq!(&r[..8], &[0; 8]);
        assert_eq!(
            u32::from_le_bytes(r[8..12].try_into().unwrap()),
            masked_crc(&[0; 8])
        );
        // Masking: rotate right by 15, add the constant.
        assert_eq!(masked_crc(b""), 0xA282_EAD8);
    }

    #[test]
    fn scalars_encode_as_summary_values() {
        let body = scalars_body(&[("loss", 2.5)]);
        // summary (field 5, 13 bytes) → value (field 1, 11 bytes) → tag (field 1, "loss"),
        // simple_value (field 2, an f32).
        let mut expected = vec![0x2A, 13, 0x0A, 11, 0x0A, 4];
        expected.extend_from_slice(b"loss");
        expected.push(0x15);
        expected.extend_from_slice(&2.5f32.to_le_bytes());
        assert_eq!(body, expected);
    }
}
