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
    /// A line of an input is not UTF-8.
    #[error(
        "{path}: line {line} (byte offset {offset} of the decompressed text) is not valid UTF-8"
    )]
    InvalidUtf8 {
        /// The input.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// Byte offset of the line's start in the (decompressed) text.
        offset: u64,
    },
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
