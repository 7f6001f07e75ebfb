//! # bertkit-tokenizer: BERT's WordPiece tokenizer and vocabulary trainer
//!
//! [`FullTokenizer`] tokenizes exactly as Google's `FullTokenizer` (google-research/bert
//! `tokenization.py`): basic tokenization (cleaning, CJK spacing, lower-casing and accent
//! stripping for uncased vocabularies, punctuation split), then WordPiece. It is what the
//! records stage tokenizes corpora with and what the tasks encode SQuAD and GLUE with.
//!
//! - [`FullTokenizer::tokenize`] and [`FullTokenizer::tokenize_ids`]: one text, the spec's rules
//!   step by step;
//! - [`FullTokenizer::extend_ids`]: the same ids for bulk work, through a per-thread cache of
//!   word pieces and a fast path over ASCII lines (tested equal to the rules above);
//! - [`basic_tokenize`]: the basic tokenizer alone (SQuAD's answer mapping needs it);
//! - [`jsonl::tokenize_lines`]: a stream of lines to JSON Lines (`bertkit tokenize`);
//! - [`vocab::train_vocab`]: a WordPiece vocabulary trained on a corpus, in BERT's layout;
//! - [`folder::TokenizerFiles`]: a model folder's `vocab.txt` and `tokenizer_config.json`.
//!
//! The fast paths (the WordPiece table, the word cache, the ASCII line scanner) are private
//! modules; their equivalence to the spec is tested inside the crate.

#![deny(missing_docs)]

mod ascii_scan;
pub mod folder;
mod full;
pub mod jsonl;
pub mod vocab;
mod word_cache;
mod wordpiece;

pub use full::{FullTokenizer, MAX_INPUT_CHARS_PER_WORD, VocabError, basic_tokenize};
