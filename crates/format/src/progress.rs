//! Progress and warnings, reported to whoever runs a stage (the CLI prints them to stderr).

use std::time::Duration;

use crate::manifest::FormatManifest;

/// A snapshot of a run's progress.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
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
    /// Time since the run started.
    pub elapsed: Duration,
}

/// Receives progress, notes and warnings. All methods default to doing nothing.
pub trait Observer: Sync {
    /// Called after each batch of work.
    fn progress(&self, _progress: &Progress) {}
    /// A note on what the run is doing.
    fn message(&self, _message: &str) {}
    /// A skipped item or other recoverable problem (also counted in the manifest).
    fn warning(&self, _warning: &str) {}
}

/// An observer that ignores everything.
pub struct Silent;

impl Observer for Silent {}

/// How a run ended.
#[derive(Debug, Clone)]
pub enum RunOutcome {
    /// The work was done; here is its manifest.
    Completed(FormatManifest),
    /// The output was already up to date; here is the manifest found.
    UpToDate(FormatManifest),
}

impl RunOutcome {
    /// The manifest, either way.
    pub fn manifest(&self) -> &FormatManifest {
        match self {
            RunOutcome::Completed(m) | RunOutcome::UpToDate(m) => m,
        }
    }
}
