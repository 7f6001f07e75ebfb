//! # bertkit-tasks: fine-tuning tasks
//!
//! The tasks stage: SQuAD and GLUE, built on the model crate. So far:
//! - [`squad::data`]: the official SQuAD JSON (v1.1 and v2.0);
//! - [`squad::eval`]: the official v1.1 evaluation, equal to `evaluate-v1.1.py` down to the
//!   printed digits;
//! - [`glue`]: GLUE task files (MRPC, CoLA, SST-2, MNLI), metrics (accuracy, F1, Matthews
//!   correlation) and fine-tuning of a checkpoint with AdamW;
//! - [`inference`]: forward-pass throughput and latency (`bertkit bench inference`);
//! - [`pyfloat`]: floats printed as Python's `json.dumps` prints them.

pub mod glue;
pub mod inference;
pub mod pyfloat;
pub mod squad;

use std::path::PathBuf;

/// Why a task step failed.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file is not what it should be.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        message: String,
    },
}
