//! Errors of the format stage. Every variant names the file, and where it applies the byte
//! offset (in the compressed file for bzip2 errors, in the decompressed XML otherwise).

use std::path::PathBuf;

/// Why a format run failed.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Reading an input or writing an output failed.
    #[error("{path}: {source}")]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The bzip2 data is corrupt or ends early.
    #[error(
        "{path}: bzip2 data is corrupt or truncated near compressed byte offset {offset}: {message}"
    )]
    Bzip2 {
        /// The compressed input.
        path: PathBuf,
        /// Byte offset in the compressed file (start of the failing stream for multistream input).
        offset: u64,
        /// What the decoder said.
        message: String,
    },
    /// The XML is not well-formed (or ends in the middle of an element).
    #[error("{path}: malformed XML at byte offset {offset} of the decompressed XML: {message}")]
    Xml {
        /// The input file.
        path: PathBuf,
        /// Byte offset in the decompressed XML.
        offset: u64,
        /// What is wrong.
        message: String,
    },
    /// Text that is not UTF-8, in `--strict` mode (otherwise the page is skipped and counted).
    #[error("{path}: invalid UTF-8 at byte offset {offset} of the decompressed XML{context}")]
    InvalidUtf8 {
        /// The input file.
        path: PathBuf,
        /// Byte offset in the decompressed XML.
        offset: u64,
        /// The page it is in, when known.
        context: String,
    },
    /// The input is not something this stage reads.
    #[error("{path}: {message}")]
    Unsupported {
        /// The input.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// Bad arguments (no inputs, zero max-bytes, ...).
    #[error("{0}")]
    Usage(String),
}

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }
}
