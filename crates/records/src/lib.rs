//! # bertkit-records: the records stage
//!
//! Turns shards of formatted text into BERT pre-training data. Written so far:
//! - [`tokenizer`]: WordPiece tokenization identical to Google's `FullTokenizer`;
//! - [`vocab`]: training a WordPiece vocabulary on a domain corpus;
//! - [`pyrandom`] and [`instances`]: masked-LM / next-sentence instances exactly as Google's
//!   `create_pretraining_data.py` makes them (same instances, same order, same random draws).
//!
//! Still to come (issue 4 is open): the fast parallel default mode, the Parquet output and the
//! `bertkit records` command.

pub mod draws;
pub mod instances;
pub mod parquet_file;
pub mod pyrandom;
pub mod run;
pub mod tokenizer;
pub mod vocab;

pub use tokenizer::FullTokenizer;
