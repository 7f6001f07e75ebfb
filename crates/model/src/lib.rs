//! # bertkit-model: BERT in candle
//!
//! The model stage: BERT of any size from a Hugging Face `config.json` (tiny test configs,
//! MiniLM, BERT-base, BERT-large), with Hugging Face–compatible weights and gradients that reach
//! every parameter. It knows nothing of training or tasks: the train and tasks crates build on
//! it.
//!
//! - [`config`]: [`BertConfig`], read from and written to `config.json`.
//! - [`bert`]: the network, one file: embeddings (word + position + token type, LayerNorm,
//!   dropout), encoder layers (multi-head self-attention within each sequence, GELU (exact, or
//!   Google's tanh form),
//!   residuals, LayerNorm), pooler, and the heads: pre-training (masked-LM transform and a decoder
//!   tied to the word embeddings with its own output bias; next sentence), question answering
//!   (start/end logits) and sequence classification. [`bert::load`], [`bert::init`] and
//!   [`bert::save`] read and write transformers model directories.
//! - [`kernels`] (the `bertkit-kernels` crate, re-exported with its [`packing`] and
//!   [`dropout`]): every operation the network calls, behind the [`Kernels`] interface: the
//!   default [`Fused`] kernels per device and the reference [`Composed`] ones, each fused kernel
//!   checked against the reference; the device and its memory pool.
//! - [`params`]: checkpoint names (with or without `bert.`, `gamma`/`beta`), initialisation of
//!   what a checkpoint lacks, and saving in the transformers layout.
//! - [`google`]: google-research/bert's TensorFlow checkpoints converted to and from model
//!   folders (its variable names mapped onto these; the reader is `bertkit-tf-checkpoint`).
//! - [`census`]: the operations and bytes of a training forward pass's graph, per encoder
//!   layer (what each kernel set asks of a device, counted on any device).
//! - [`encoder_check`]: the encoder's backward pass by hand (over the kernels' tape,
//!   [`kernels::tape`]) against candle's autograd on one device, for `bertkit check kernels`.
//! - [`loss`]: masked-LM, next-sentence and cross-entropy losses over the kernels' per-row
//!   negative log-likelihood.
//!
//! Dropout is on in [`Mode::Train`] forward passes, with reproducible masks from a
//! [`DropoutSource`] ([`dropout`]), and off in [`Mode::Eval`].

#![deny(missing_docs)]

pub mod bert;
pub mod census;
pub mod config;
pub mod encoder_check;
pub mod google;
pub mod loss;
pub mod params;

use std::path::PathBuf;

// The kernels, their dropout and batch layout, and the device are the kernels crate's; they
// are re-exported under the names the model's users know.
pub use bertkit_kernels::device::{
    DEFAULT_TF32, device_peak, device_reserved_peak, free_memory, reset_device_peak, set_tf32,
    trace_device_pool,
};
pub use bertkit_kernels::{self as kernels, dropout, packing, vectorised};

pub use bert::{
    BertArchitecture, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
    BertModel, BertOutput, EncoderBackward, EncoderPass, Gradients, Inputs, Loaded,
    MaskedPositions, Mode, PreTrainingOutput,
};
pub use config::{BertConfig, Gelu};
pub use dropout::DropoutSource;
pub use kernels::{Composed, Fused, GradientSink, Kernels};
pub use packing::{Packing, RowIndex};
pub use params::{ParamBuilder, ParamStore};

/// Why the model could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// An unreadable or inconsistent config.
    #[error("config: {0}")]
    Config(String),
    /// A checkpoint that does not fit the config (names the tensor).
    #[error("weights: {0}")]
    Weights(String),
    /// Inputs the model cannot take.
    #[error("input: {0}")]
    Input(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A TensorFlow checkpoint could not be read or written (names the file and variable).
    #[error("weights: {0}")]
    TfCheckpoint(#[from] bertkit_tf_checkpoint::Error),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Parses `f32`, `bf16` or `f16` (also `fp16`, `float32`, …).
pub fn parse_dtype(name: &str) -> Result<candle_core::DType, ModelError> {
    match name {
        "f32" | "float32" => Ok(candle_core::DType::F32),
        "bf16" | "bfloat16" => Ok(candle_core::DType::BF16),
        "f16" | "fp16" | "float16" => Ok(candle_core::DType::F16),
        "f64" => Ok(candle_core::DType::F64),
        other => Err(ModelError::Config(format!(
            "dtype {other:?}: expected f32, bf16 or f16"
        ))),
    }
}

/// Parses `cpu`, `cuda` or `cuda:N` and opens the device
/// ([`bertkit_kernels::device::parse_device`]).
pub fn parse_device(name: &str) -> Result<candle_core::Device, ModelError> {
    bertkit_kernels::device::parse_device(name).map_err(ModelError::Config)
}
