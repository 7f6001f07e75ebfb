//! # bertkit-tasks: fine-tuning tasks
//!
//! The tasks stage: SQuAD and GLUE, built on the model crate.
//! - [`squad::data`]: the official SQuAD JSON (v1.1 and v2.0);
//! - [`squad::features`]: examples and windows as Google's `run_squad.py`;
//! - [`squad::postprocess`]: n-best answers, `get_final_text`, the v2.0 null threshold;
//! - [`squad::finetune`]: SQuAD fine-tuning and prediction;
//! - [`squad::eval`] and [`squad::eval_v2`]: the official v1.1 and v2.0 evaluations, equal to
//!   `evaluate-v1.1.py` and `evaluate-v2.0.py` down to the printed digits;
//! - [`training`]: the fine-tuning loop (AdamW, warmup + linear decay, accumulation, bf16/fp16);
//! - [`batch`]: padding sequences into model inputs;
//! - [`model_dir`]: which folder `--model` stands for (a model, checkpoint or run folder), its
//!   tokenizer, and saving a fine-tuned model with it;
//! - [`glue`]: GLUE task files (MRPC, CoLA, SST-2, MNLI), metrics (accuracy, F1, Matthews
//!   correlation) and fine-tuning of a checkpoint with AdamW;
//! - [`inference`]: forward-pass throughput and latency (`bertkit bench inference`);
//! - [`features`]: feature extraction as Google's `extract_features.py` (text in, each token's
//!   vectors from chosen layers out, as JSON lines or npy);
//! - [`pyfloat`]: floats printed as Python's `json.dumps` prints them.

#![deny(missing_docs)]

pub mod batch;
pub mod features;
pub mod glue;
pub mod inference;
pub mod model_dir;
pub mod pyfloat;
pub mod squad;
pub mod training;

use std::path::PathBuf;

/// Why a task step failed.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file is not what it should be.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        message: String,
    },
    /// The model refused (a bad checkpoint, a shape, an input).
    #[error("model: {0}")]
    Model(#[from] bertkit_model::ModelError),
    /// A tensor operation failed.
    #[error("model: {0}")]
    Candle(#[from] candle_core::Error),
    /// The training step or optimiser failed (a non-finite loss, a bad setting).
    #[error(transparent)]
    Train(#[from] bertkit_train::TrainError),
    /// A model folder's vocabulary is unusable.
    #[error(transparent)]
    Vocab(#[from] bertkit_tokenizer::VocabError),
    /// Settings that cannot work.
    #[error("settings: {0}")]
    Settings(String),
}
