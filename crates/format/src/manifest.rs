//! The JSON manifest written beside formatted text (`wiki.manifest.json` or
//! `books.manifest.json`; schema: `schemas/format-manifest.schema.json`).
//!
//! The manifest is written last, atomically, so its presence means the run completed. It records
//! the inputs (path, size, modification time, SHA-256), the parameters, the output files with
//! their counts and hashes, and the run's counts. A later run with the same inputs (same path
//! and size, and the same modification time or else the same SHA-256; see
//! `bertkit_stage_io::InputFile::same_file_as`) and parameters finds the manifest and its
//! outputs in place and does nothing.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::FormatError;

/// Version of the manifest layout.
pub const MANIFEST_VERSION: u32 = 1;

/// One input file's fingerprint (shared by every stage).
pub use bertkit_stage_io::InputFile;

/// Stats an input file for a manifest (the hash is filled in after it has been read).
pub fn stat_input(path: &Path) -> Result<InputFile, FormatError> {
    InputFile::stat(path).map_err(|e| FormatError::io(path, e))
}

/// One output file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputFile {
    /// File name inside the output directory.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the file.
    pub sha256: String,
    /// Documents in the file.
    pub documents: u64,
    /// Sentences (lines that are not blank) in the file.
    pub sentences: u64,
}

/// What a format run did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FormatManifest {
    /// Always "format".
    pub stage: String,
    /// "wiki" or "books".
    pub kind: String,
    /// Layout version of this manifest.
    pub manifest_version: u32,
    /// Version of the bertkit-format crate that wrote it.
    pub bertkit_version: String,
    /// The run's parameters (what changes the output).
    pub parameters: serde_json::Value,
    /// Inputs in the order they were read.
    pub inputs: Vec<InputFile>,
    /// Outputs in order; concatenated they are the whole corpus.
    pub outputs: Vec<OutputFile>,
    /// Counts (see the wiki and books counters).
    pub counts: serde_json::Value,
    /// The first warnings and skipped-item messages (at most [`MAX_RECORDED_WARNINGS`]).
    pub warnings: Vec<String>,
    /// Wall-clock seconds the run took.
    pub elapsed_seconds: f64,
}

/// How many warning messages a manifest keeps (all are counted).
pub const MAX_RECORDED_WARNINGS: usize = 100;

impl FormatManifest {
    /// A manifest for a finished run of this crate.
    pub fn new(
        kind: &str,
        parameters: serde_json::Value,
        inputs: Vec<InputFile>,
        outputs: Vec<OutputFile>,
        counts: impl Serialize,
        warnings: Vec<String>,
        elapsed_seconds: f64,
    ) -> Self {
        FormatManifest {
            stage: "format".into(),
            kind: kind.into(),
            manifest_version: MANIFEST_VERSION,
            bertkit_version: env!("CARGO_PKG_VERSION").into(),
            parameters,
            inputs,
            outputs,
            counts: serde_json::to_value(counts).expect("counts serialise"),
            warnings,
            elapsed_seconds,
        }
    }

    /// File name of the manifest for a kind of output.
    pub fn file_name(kind: &str) -> String {
        format!("{kind}.manifest.json")
    }

    /// Reads the manifest of `kind` in `dir`, if there is a readable one.
    pub fn read(dir: &Path, kind: &str) -> Option<FormatManifest> {
        let text = fs::read_to_string(dir.join(Self::file_name(kind))).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Whether this manifest describes a finished run of the same inputs and parameters whose
    /// outputs are all still in place with their recorded sizes.
    pub fn is_up_to_date(
        &self,
        dir: &Path,
        inputs: &[InputFile],
        parameters: &serde_json::Value,
    ) -> bool {
        self.manifest_version == MANIFEST_VERSION
            && self.bertkit_version == env!("CARGO_PKG_VERSION")
            && &self.parameters == parameters
            && self.inputs.len() == inputs.len()
            && self
                .inputs
                .iter()
                .zip(inputs)
                .all(|(a, b)| a.same_file_as(b))
            && self
                .outputs
                .iter()
                .all(|o| fs::metadata(dir.join(&o.file)).is_ok_and(|m| m.len() == o.bytes))
    }

    /// Removes the manifest of `kind` in `dir` (before a rebuild, so that an interrupted rebuild
    /// is not mistaken for a finished one).
    pub fn remove(dir: &Path, kind: &str) -> Result<(), FormatError> {
        let path = dir.join(Self::file_name(kind));
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(FormatError::io(path, e)),
            _ => Ok(()),
        }
    }

    /// Writes the manifest atomically (temporary file, then rename).
    pub fn write(&self, dir: &Path) -> Result<PathBuf, FormatError> {
        let path = dir.join(Self::file_name(&self.kind));
        let mut json = serde_json::to_string_pretty(self).expect("manifest serialises");
        json.push('\n');
        bertkit_stage_io::write_atomically(&path, json.as_bytes())
            .map_err(|e| FormatError::io(&path, e))?;
        Ok(path)
    }
}
