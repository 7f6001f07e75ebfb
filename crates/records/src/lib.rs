//! # bertkit-records: the records stage
//!
//! Turns shards of formatted text into BERT pre-training data. This first part is
//! [`tokenizer`]: WordPiece tokenization identical to Google's `FullTokenizer`. Masked-LM and
//! next-sentence instances and the Parquet output are not written yet (issue 4 is still open).

pub mod tokenizer;

pub use tokenizer::FullTokenizer;
