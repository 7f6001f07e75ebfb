//! Flags of the model-format commands (`convert`).

use std::path::PathBuf;

use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub(crate) enum ConvertCommand {
    /// A google-research/bert TensorFlow checkpoint (bert_model.ckpt.index + .data-*, with its
    /// bert_config.json) to a model folder bertkit and transformers load. No TensorFlow needed.
    TfCheckpoint(TfCheckpointArgs),
    /// A model folder to a TensorFlow checkpoint Google's run_classifier.py, run_squad.py and
    /// extract_features.py load (bert_model.ckpt.*, bert_config.json, vocab.txt).
    ToTfCheckpoint(ToTfCheckpointArgs),
}

#[derive(Args)]
pub(crate) struct TfCheckpointArgs {
    /// The checkpoint: its prefix (…/bert_model.ckpt), its .index file, or its folder.
    #[arg(long)]
    pub(crate) checkpoint: PathBuf,
    /// Google's bert_config.json [default: the one beside the checkpoint].
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// The vocabulary to put beside the model [default: vocab.txt beside the checkpoint, if there].
    #[arg(long)]
    pub(crate) vocab: Option<PathBuf>,
    /// The model folder to write (config.json, model.safetensors, vocab.txt).
    #[arg(long, short)]
    pub(crate) output: PathBuf,
}

#[derive(Args)]
pub(crate) struct ToTfCheckpointArgs {
    /// Model folder: config.json and model.safetensors (transformers layout), vocab.txt.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// The folder to write the checkpoint to.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
}

#[derive(Subcommand)]
pub(crate) enum CheckCommand {
    /// Each fused kernel (LayerNorm, a sublayer's end with dropout, linear + bias, + GELU,
    /// attention with and without dropout) on a device against its twin, values and
    /// gradients: on CUDA the CPU's fused kernels in f32, on the CPU the composed ops in f64.
    /// A line per kernel and value with its worst difference; fails if one is out of bounds.
    Kernels(CheckKernelsArgs),
    /// Each checkpoint of a run folder (pre-training or fine-tuning) against the SHA-256 of
    /// its files it recorded when written: a line per checkpoint; fails if one is damaged.
    Checkpoint(CheckCheckpointArgs),
}

#[derive(Args)]
pub(crate) struct CheckCheckpointArgs {
    /// The run folder (its checkpoints are under `checkpoints/`).
    pub(crate) run: PathBuf,
}

#[derive(Args)]
pub(crate) struct CheckKernelsArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// The dtypes to check, comma-separated: f32, bf16.
    #[arg(long, default_value = "f32,bf16")]
    pub(crate) dtype: String,
}
