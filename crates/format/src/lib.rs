//! # bertkit-format: the format stage
//!
//! Turns raw corpora into the text format that BERT pre-training data generators read (Google's
//! `create_pretraining_data.py` and bertkit's shard stage): UTF-8, **one sentence per line, one
//! blank line after every document**, in files `PREFIX_00000.txt`, `PREFIX_00001.txt`, … of at
//! most `max_bytes` each, plus a JSON manifest (`PREFIX.manifest.json`) recording inputs, their
//! hashes, parameters, per-file counts and run counts.
//!
//! Two sources:
//! - [`wiki::format_wiki`]: Wikipedia `pages-articles` XML dumps: plain `.xml`, single-stream
//!   `.bz2` and multistream `.bz2` (decoded in parallel). Main-namespace articles only;
//!   redirects, other namespaces and (by default) disambiguation pages are skipped and counted.
//!   Markup is removed as WikiExtractor does (see [`wiki::markup`]).
//! - [`books::format_books`]: Project Gutenberg plain-text books, one book per document (see
//!   [`books`]).
//!
//! Sentences are split by the rule-based [`sentences::split_sentences`].
//!
//! ## Guarantees
//! - **Deterministic**: the same inputs and options give byte-identical files whatever the
//!   thread count, and a multistream `.bz2` gives the same files as the plain `.xml`.
//! - **Atomic**: files are written under hidden `.partial` names and renamed into place when the
//!   run succeeds; the manifest is written last. An interrupted run leaves no finished-looking
//!   file, and re-running with unchanged inputs and options is a no-op.
//! - **Bounded memory** (wiki): the XML in flight is at most `2 × batch` queued segments plus
//!   `batch` being cleaned, where `batch = 2 × threads`, each segment about 1 MiB or one page if
//!   a page is larger (the largest enwiki pages are a few MB; 256 MiB without a page start is
//!   an error); for multistream input add
//!   `3 × threads` streams being decoded (≈ 0.3–1 MB compressed, ≈ 5× that decoded, each) and the
//!   compressed bytes of the stream being read. With 16 threads that is roughly 200–400 MB,
//!   whatever the size of the dump. Books are read one file per worker at a time, so memory is
//!   bounded by `threads × largest book`.
//! - **Errors name the file and the byte offset** (in the compressed file for bzip2 errors, in
//!   the decompressed XML otherwise). A page whose bytes are not UTF-8 is skipped and counted
//!   (or is an error with `strict`); malformed markup never stops a run (see [`wiki::markup`]).

#![deny(missing_docs)]

pub mod books;
pub mod error;
pub mod manifest;
pub mod output;
mod progress;
mod run;
pub mod sentences;
pub mod spacing;
pub mod wiki;

pub use error::FormatError;
pub use manifest::FormatManifest;
pub use output::{Document, ShardedTextWriter};

/// Default largest output file: 100 MB.
pub const DEFAULT_MAX_BYTES: u64 = 100_000_000;
