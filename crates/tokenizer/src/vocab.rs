//! Training a WordPiece vocabulary on a domain corpus, with the `tokenizers` crate's
//! `WordPieceTrainer`.
//!
//! Words come from the same basic tokenizer as [`crate::FullTokenizer`] (cleaning, lower-casing and
//! accent stripping for uncased, punctuation split), so the vocabulary fits the tokenizer that
//! will use it. The inputs are formatted text or shards (`.txt` / `.txt.zst`, files or
//! folders), read on a separate thread and streamed to the trainer one document at a time. Memory
//! grows with the number of distinct words, not with the corpus. The output is a `vocab.txt` in
//! BERT's layout: `[PAD]` first, then `[UNK] [CLS] [SEP] [MASK]`, then the learned pieces, written
//! atomically.

use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;

use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainer};
use tokenizers::{AddedToken, Model, Trainer};

use crate::full::basic_tokenize;

/// The size of BERT's English vocabularies (bert-base-uncased and the others), special tokens
/// included: the default size of a trained vocabulary.
pub const BERT_VOCAB_SIZE: usize = 30522;

/// The special tokens a BERT vocabulary starts with, in order.
pub const SPECIAL_TOKENS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// Why training failed.
#[derive(Debug, thiserror::Error)]
pub enum VocabTrainError {
    /// Reading the corpus failed.
    #[error(transparent)]
    Read(#[from] bertkit_stage_io::text::TextError),
    /// Writing the vocabulary failed.
    #[error("{path}: {source}")]
    Write {
        /// The output file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The trainer failed, or the corpus was empty.
    #[error("{0}")]
    Train(String),
}

/// Trains a vocabulary of at most `size` tokens on `inputs` and writes it to `output`. Returns
/// the number of tokens written.
pub fn train_vocab(
    inputs: &[PathBuf],
    size: usize,
    lower_case: bool,
    output: &Path,
) -> Result<usize, VocabTrainError> {
    let files = bertkit_stage_io::text::expand_text_inputs(inputs)?;
    let (tx, rx) = sync_channel::<Result<String, bertkit_stage_io::text::TextError>>(256);
    let reader = std::thread::spawn(move || {
        for path in files {
            let mut docs = match bertkit_stage_io::text::DocumentReader::open(&path) {
                Ok(d) => d,
                Err(e) => return tx.send(Err(e)).ok(),
            };
            loop {
                match docs.next_document() {
                    Ok(Some(doc)) => {
                        let text = String::from_utf8(doc.text).expect("the reader checked UTF-8");
                        if tx.send(Ok(text)).is_err() {
                            return None;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return tx.send(Err(e)).ok(),
                }
            }
        }
        Some(())
    });
    // The trainer takes an iterator of texts; a read error stops it and is reported below.
    let failure = std::sync::Mutex::new(None);
    let documents = rx.into_iter().map_while(|r| match r {
        Ok(text) => Some(text),
        Err(e) => {
            *failure.lock().expect("no panic holds this lock") = Some(e);
            None
        }
    });
    let mut trainer = WordPieceTrainer::builder()
        .vocab_size(size)
        .special_tokens(
            SPECIAL_TOKENS
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .continuing_subword_prefix("##".into())
        .show_progress(false)
        .build();
    trainer
        .feed(documents, |text| Ok(basic_tokenize(text, lower_case)))
        .map_err(|e| VocabTrainError::Train(e.to_string()))?;
    let _ = reader.join();
    if let Some(e) = failure.into_inner().expect("no panic holds this lock") {
        return Err(e.into());
    }
    let mut model = WordPiece::default();
    trainer
        .train(&mut model)
        .map_err(|e| VocabTrainError::Train(e.to_string()))?;
    let mut vocab: Vec<(String, u32)> = model.get_vocab().into_iter().collect();
    vocab.sort_by_key(|(_, id)| *id);
    if vocab.len() <= SPECIAL_TOKENS.len() {
        return Err(VocabTrainError::Train("the corpus holds no words".into()));
    }
    let mut text = String::new();
    for (token, _) in &vocab {
        text.push_str(token);
        text.push('\n');
    }
    bertkit_stage_io::write_atomically(output, text.as_bytes()).map_err(|e| {
        VocabTrainError::Write {
            path: output.into(),
            source: e,
        }
    })?;
    Ok(vocab.len())
}
