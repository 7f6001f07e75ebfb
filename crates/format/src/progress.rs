//! A format run's progress as the stages' shared events ([`bertkit_stage_io::stage`]).

use bertkit_stage_io::stage::{Event, Progress, Reporter};

/// A snapshot of a run's counts, reported as the progress of input `input` of `inputs`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Snapshot {
    /// Index of the input being read.
    pub input: usize,
    /// Number of inputs.
    pub inputs: usize,
    /// Pages (wiki) or books read so far.
    pub items: u64,
    /// What `items` counts: "pages" or "books".
    pub unit: &'static str,
    /// Documents written so far.
    pub documents: u64,
    /// Input bytes processed (decompressed XML or book bytes).
    pub input_bytes: u64,
    /// Text bytes written.
    pub output_bytes: u64,
}

impl Snapshot {
    /// Reports the snapshot: input bytes are the progress, the other counts its detail.
    pub fn report(&self, reporter: &dyn Reporter) {
        let task = format!("input {}/{}", self.input + 1, self.inputs);
        let detail = format!(
            "{} {} read, {} documents written, {:.1} MB out",
            self.items,
            self.unit,
            self.documents,
            self.output_bytes as f64 / 1e6
        );
        reporter.report(&Event::Progress(&Progress {
            task: &task,
            done: self.input_bytes,
            total: None,
            unit: "bytes",
            detail: &detail,
        }));
    }
}
