//! # bertkit-records: the records stage
//!
//! Turns shards of formatted text into BERT pre-training data. Written so far:
//! - [`tokenizer`]: WordPiece tokenization identical to Google's `FullTokenizer`;
//! - [`vocab`]: training a WordPiece vocabulary on a domain corpus.
//!
//! Masked-LM and next-sentence instances and the Parquet output are not written yet (issue 4
//! is still open).

pub mod tokenizer;
pub mod vocab;

pub use tokenizer::FullTokenizer;
