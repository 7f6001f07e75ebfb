//! A model folder as the tasks read and write it: the transformers layout (`config.json`,
//! `model.safetensors`) plus the tokenizer it was trained with (`vocab.txt`,
//! `tokenizer_config.json`: [`TokenizerFiles`]).
//!
//! Wherever a task takes a model, it takes any folder that stands for one
//! ([`bertkit_train::checkpoint::model_folder`]): a model folder, a checkpoint
//! (`RUN/checkpoints/step-N`), or a pre-training or fine-tuning run folder (its final model,
//! else its newest checkpoint).

use std::path::{Path, PathBuf};

use bertkit_model::bert::{BertArchitecture, Loaded, save};
use bertkit_tokenizer::FullTokenizer;
use bertkit_tokenizer::folder::{TokenizerFiles, lower_case_of};
use bertkit_train::checkpoint::model_folder;
use candle_core::DType;

use crate::TaskError;

/// The model folder `path` stands for (itself, or a run folder's final model or newest
/// checkpoint), or an error saying what `path` is not.
pub fn resolve(path: &Path) -> Result<PathBuf, TaskError> {
    let dir = model_folder(path).ok_or_else(|| {
        let missing = ["config.json", "model.safetensors"]
            .into_iter()
            .map(|f| path.join(f))
            .find(|f| !f.is_file())
            .unwrap_or_else(|| path.into());
        TaskError::Format {
            path: missing,
            message: "not found (a model folder holds config.json and model.safetensors; a run \
                      folder, its final model or checkpoints/step-N)"
                .into(),
        }
    })?;
    // A checkpoint records its files' digests: a damaged one is named, not loaded.
    bertkit_train::checkpoint::verify_model(&dir)?;
    Ok(dir)
}

/// Whether the model `path` stands for is tokenized uncased: as its `tokenizer_config.json`
/// says (uncased where it does not), unless `cased` (the user's `--cased`) says cased.
pub fn lower_case(path: &Path, cased: bool) -> Result<bool, TaskError> {
    if cased {
        return Ok(false);
    }
    let dir = resolve(path)?;
    Ok(lower_case_of(&dir).map_err(folder_error)?.unwrap_or(true))
}

/// The model folder `model`'s `vocab.txt` as Google's tokenizer.
pub fn load_tokenizer(model: &Path, lower_case: bool) -> Result<FullTokenizer, TaskError> {
    let dir = resolve(model)?;
    Ok(FullTokenizer::from_vocab_file(
        &dir.join(bertkit_tokenizer::folder::VOCAB_FILE),
        lower_case,
    )?)
}

/// The tokenizer files a model fine-tuned from `started_from` keeps: its vocabulary, with the
/// casing the run used.
pub fn tokenizer_files(started_from: &Path, lower_case: bool) -> Result<TokenizerFiles, TaskError> {
    let dir = resolve(started_from)?;
    let files = TokenizerFiles::read(&dir).map_err(folder_error)?;
    Ok(TokenizerFiles {
        lower_case,
        ..files
    })
}

/// Saves a fine-tuned `model` to `output` (f32 weights) with the `tokenizer` it was trained
/// with, so `output` is a model folder of its own.
pub fn save_finetuned<M: BertArchitecture>(
    model: &Loaded<M>,
    tokenizer: &TokenizerFiles,
    output: &Path,
) -> Result<(), TaskError> {
    save(model, output, DType::F32)?;
    tokenizer.write_into(output).map_err(folder_error)
}

fn folder_error(e: bertkit_tokenizer::folder::FolderError) -> TaskError {
    use bertkit_tokenizer::folder::FolderError;
    match e {
        FolderError::Io { path, source } => TaskError::Io { path, source },
        FolderError::Config { path, message } => TaskError::Format { path, message },
    }
}
