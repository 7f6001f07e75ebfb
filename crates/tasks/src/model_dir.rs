//! A model folder as the tasks read and write it: the transformers layout (`config.json`,
//! `model.safetensors`) plus the WordPiece `vocab.txt` it was trained with.

use std::path::Path;

use bertkit_model::bert::{BertArchitecture, Loaded, save};
use bertkit_tokenizer::FullTokenizer;
use candle_core::DType;

use crate::TaskError;

/// The folder's `vocab.txt` as Google's tokenizer.
pub fn load_tokenizer(model: &Path, lower_case: bool) -> Result<FullTokenizer, TaskError> {
    Ok(FullTokenizer::from_vocab_file(
        &model.join("vocab.txt"),
        lower_case,
    )?)
}

/// Saves a fine-tuned `model` to `output` (f32 weights) with the `vocab.txt` of the folder it
/// started from, so `output` is a model folder of its own.
pub fn save_finetuned<M: BertArchitecture>(
    model: &Loaded<M>,
    started_from: &Path,
    output: &Path,
) -> Result<(), TaskError> {
    save(model, output, DType::F32)?;
    let copy = output.join("vocab.txt");
    std::fs::copy(started_from.join("vocab.txt"), &copy).map_err(|e| TaskError::Io {
        path: copy,
        source: e,
    })?;
    Ok(())
}
