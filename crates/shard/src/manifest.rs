//! The shard manifest (`shard.manifest.json`, or `shard.manifest.rank-R-of-W.json` for one rank
//! of a distributed run; schema: `schemas/shard-manifest.schema.json`). Written last and
//! atomically: its presence means the run finished.

use std::path::Path;

use bertkit_stage_io::InputFile;
use serde::{Deserialize, Serialize};

use crate::balance::Split;
use crate::error::ShardError;

/// Layout version of the manifest.
pub const MANIFEST_VERSION: u32 = 1;

/// One shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardFile {
    /// Train or test.
    pub split: Split,
    /// Index within the split.
    pub index: usize,
    /// Path relative to the output directory.
    pub file: String,
    /// Documents in the shard.
    pub documents: u64,
    /// Sentences (non-blank lines).
    pub sentences: u64,
    /// Bytes of text (uncompressed).
    pub bytes: u64,
    /// Size of the file on disk (absent for shards another rank writes).
    pub file_bytes: Option<u64>,
    /// SHA-256 of the file on disk (absent for shards another rank writes).
    pub sha256: Option<String>,
    /// SHA-256 of the uncompressed text (absent for shards another rank writes).
    pub content_sha256: Option<String>,
}

/// Corpus-level figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    /// Documents read.
    pub documents: u64,
    /// Sentences read.
    pub sentences: u64,
    /// Bytes of text read (uncompressed).
    pub bytes: u64,
    /// Sentences in the test split.
    pub test_sentences: u64,
    /// `test_sentences / sentences`.
    pub test_fraction_achieved: f64,
    /// Train shards: (max − min) / mean of the sentence counts.
    pub train_sentence_imbalance: f64,
    /// Train shards: (max − min) / mean of the byte counts.
    pub train_byte_imbalance: f64,
    /// Test shards: (max − min) / mean of the sentence counts.
    pub test_sentence_imbalance: f64,
}

/// What a shard run did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardManifest {
    /// Always "shard".
    pub stage: String,
    /// Layout version.
    pub manifest_version: u32,
    /// Version of bertkit-shard.
    pub bertkit_version: String,
    /// Options that determine the output.
    pub parameters: serde_json::Value,
    /// Inputs in the order read.
    pub inputs: Vec<InputFile>,
    /// Every shard, train first; file fields are set for the shards this rank wrote.
    pub shards: Vec<ShardFile>,
    /// Corpus-level figures.
    pub totals: Totals,
    /// Wall-clock seconds.
    pub elapsed_seconds: f64,
}

impl ShardManifest {
    /// File name of the manifest of rank `rank` of `world_size`.
    pub fn file_name(rank: usize, world_size: usize) -> String {
        if world_size == 1 {
            "shard.manifest.json".into()
        } else {
            format!("shard.manifest.rank-{rank:05}-of-{world_size:05}.json")
        }
    }

    /// Reads a manifest, if there is a readable one.
    pub fn read(path: &Path) -> Option<ShardManifest> {
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
    }

    /// Whether this manifest records a finished run of the same inputs and parameters whose
    /// files are in place with their recorded sizes.
    pub fn is_up_to_date(
        &self,
        dir: &Path,
        inputs: &[InputFile],
        parameters: &serde_json::Value,
    ) -> bool {
        self.manifest_version == MANIFEST_VERSION
            && self.bertkit_version == env!("CARGO_PKG_VERSION")
            && &self.parameters == parameters
            && bertkit_stage_io::same_inputs(&self.inputs, inputs)
            && self.shards.iter().all(|s| match s.file_bytes {
                Some(n) => std::fs::metadata(dir.join(&s.file)).is_ok_and(|m| m.len() == n),
                None => true,
            })
    }

    /// Writes the manifest atomically.
    pub fn write(&self, path: &Path) -> Result<(), ShardError> {
        let mut json = serde_json::to_string_pretty(self).expect("manifest serialises");
        json.push('\n');
        bertkit_stage_io::write_atomically(path, json.as_bytes())
            .map_err(|e| ShardError::io(path, e))
    }
}

/// (max − min) / mean, 0 for fewer than two values or a zero mean.
pub fn imbalance(values: impl Iterator<Item = u64>) -> f64 {
    let v: Vec<u64> = values.collect();
    if v.len() < 2 {
        return 0.0;
    }
    let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
    if mean == 0.0 {
        return 0.0;
    }
    let (max, min) = (
        *v.iter().max().expect("non-empty"),
        *v.iter().min().expect("non-empty"),
    );
    (max - min) as f64 / mean
}
