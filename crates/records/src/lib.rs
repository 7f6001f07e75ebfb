//! # bertkit-records: the records stage
//!
//! Turns shards of formatted text into BERT pre-training data:
//! - [`tokenizer`]: WordPiece tokenization identical to Google's `FullTokenizer`, with a
//!   [`wordpiece`] splitting straight to ids, and for bulk work a [`word_cache`] and an
//!   [`ascii_scan`] of lines;
//! - [`vocab`]: training a WordPiece vocabulary on a domain corpus;
//! - [`corpus`]: tokenized documents in flat buffers;
//! - [`pyrandom`], [`draws`] and [`instances`]: masked-LM / next-sentence instances exactly as
//!   Google's `create_pretraining_data.py` makes them (same instances, same order, same random
//!   draws), or the same algorithm in parallel over documents;
//! - [`masking`]: the one masked-LM masking (also the trainer's dynamic masking);
//! - [`parquet_file`] (with [`parquet_chunks`], its column encoding) and [`run`]: the Parquet
//!   output and the stage's file and folder modes;
//! - [`prefetch`]: the memory hint the writer and the word cache use;
//! - [`reader`]: memory-mapped reading of the Parquet files, a row group at a time (the
//!   trainer's input).

pub mod ascii_scan;
pub mod corpus;
pub mod draws;
pub mod instances;
pub mod masking;
pub mod parquet_chunks;
pub mod parquet_file;
pub mod prefetch;
pub mod pyrandom;
pub mod reader;
pub mod run;
pub mod tokenizer;
pub mod vocab;
pub mod word_cache;
pub mod wordpiece;

pub use tokenizer::FullTokenizer;
