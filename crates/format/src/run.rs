//! The life of a format run, the same for every source: skip when up to date, start the
//! worker pool and the atomic writer, record warnings, and finish by committing the files and
//! writing the manifest last.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::error::FormatError;
use crate::manifest::{FormatManifest, InputFile, MAX_RECORDED_WARNINGS, stat_input};
use crate::output::ShardedTextWriter;
use bertkit_stage_io::stage::{Event, Outcome, Reporter};

/// A run that has work to do.
pub(crate) struct Run {
    kind: &'static str,
    started: Instant,
    output_dir: PathBuf,
    parameters: serde_json::Value,
    /// The inputs, in order; sources fill in each `sha256` as they read the file.
    pub inputs: Vec<InputFile>,
    /// Where documents go.
    pub writer: ShardedTextWriter,
    /// Worker threads for this run.
    pub pool: Arc<rayon::ThreadPool>,
    /// Number of worker threads.
    pub threads: usize,
    warnings: Vec<String>,
}

impl Run {
    /// Starts a run of `kind` over `files`, or returns the manifest of an up-to-date earlier run.
    pub fn begin(
        kind: &'static str,
        files: &[PathBuf],
        output_dir: &Path,
        parameters: serde_json::Value,
        threads: usize,
        max_bytes: u64,
    ) -> Result<Result<Run, FormatManifest>, FormatError> {
        let started = Instant::now();
        let inputs = files
            .iter()
            .map(|p| stat_input(p))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(existing) = FormatManifest::read(output_dir, kind)
            && existing.is_up_to_date(output_dir, &inputs, &parameters)
        {
            return Ok(Err(existing));
        }
        std::fs::create_dir_all(output_dir).map_err(|e| FormatError::io(output_dir, e))?;
        FormatManifest::remove(output_dir, kind)?;
        let threads = if threads == 0 {
            rayon::current_num_threads()
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("bertkit-format-{i}"))
            .build()
            .map_err(|e| {
                FormatError::Usage(format!("cannot start {threads} worker threads: {e}"))
            })?;
        let writer = ShardedTextWriter::new(output_dir, kind, max_bytes)?;
        Ok(Ok(Run {
            kind,
            started,
            output_dir: output_dir.to_path_buf(),
            parameters,
            inputs,
            writer,
            pool: Arc::new(pool),
            threads,
            warnings: Vec::new(),
        }))
    }

    /// Reports a warning and keeps the first [`MAX_RECORDED_WARNINGS`] for the manifest.
    pub fn warn(&mut self, reporter: &dyn Reporter, warning: String) {
        reporter.report(&Event::Warning(&warning));
        if self.warnings.len() < MAX_RECORDED_WARNINGS {
            self.warnings.push(warning);
        }
    }

    /// Renames the files into place and writes the manifest.
    pub fn finish(self, counts: impl Serialize) -> Result<Outcome<FormatManifest>, FormatError> {
        let elapsed = self.started.elapsed().as_secs_f64();
        let outputs = self.writer.commit()?;
        let manifest = FormatManifest::new(
            self.kind,
            self.parameters,
            self.inputs,
            outputs,
            counts,
            self.warnings,
            elapsed,
        );
        manifest.write(&self.output_dir)?;
        Ok(Outcome::Ran(manifest))
    }
}
