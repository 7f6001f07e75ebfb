//! Errors of the shard stage; each names the file and, where it applies, the line.

use std::path::PathBuf;

/// Why a shard run failed.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// Reading an input or writing an output or temporary file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An input could not be read as formatted text (unreadable, or a line not UTF-8).
    #[error(transparent)]
    Input(#[from] bertkit_stage_io::text::TextError),
    /// Bad arguments or an empty corpus.
    #[error("{0}")]
    Usage(String),
}

impl ShardError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ShardError::Io {
            path: path.into(),
            source,
        }
    }
}
