//! # bertkit-records: the records stage
//!
//! Turns shards of formatted text into BERT pre-training data, tokenized with
//! [`bertkit_tokenizer::FullTokenizer`]:
//! - [`corpus`]: tokenized documents in flat buffers;
//! - [`pyrandom`] and [`instances`]: masked-LM / next-sentence instances exactly as Google's
//!   `create_pretraining_data.py` makes them (same instances, same order, same random draws),
//!   or the same algorithm in parallel over documents; the two modes' draws differ only behind
//!   one trait (a private module);
//! - [`masking`]: the one masked-LM masking (also the trainer's dynamic masking);
//! - [`parquet_file`] (its column encoding in a private module) and [`run`]: the Parquet
//!   output and the stage's file and folder modes;
//! - [`reader`]: memory-mapped reading of the Parquet files, a row group at a time (the
//!   trainer's input), with the vocabulary each file stores; the footer, and a group's page
//!   headers in their column chunk, are walked as the parquet crate reads them (a private
//!   module) before it reads them, so that a hostile file cannot lead it into long loops.

#![deny(missing_docs)]

pub mod corpus;
mod draws;
pub mod instances;
pub mod masking;
mod parquet_chunks;
pub mod parquet_file;
pub mod pyrandom;
pub mod reader;
pub mod run;
mod thrift_walk;
