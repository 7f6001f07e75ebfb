//! # bertkit-train: BERT pre-training
//!
//! The train stage: pre-trains a [`bertkit_model::BertForPreTraining`] on the records stage's
//! Parquet files, NVIDIA's two-phase LAMB recipe made practical on any device size.
//!
//! - [`data`]: memory-mapped Parquet reading, seeded shuffling across files and row groups,
//!   partitioning by rank, padding, a background prefetch thread and a data cursor.
//! - [`optim`]: LAMB and AdamW with f32 master weights, gradient clipping, decoupled weight decay.
//! - [`schedule`]: warmup + polynomial (NVIDIA's PolyWarmUp) or linear decay.
//! - [`scaler`]: dynamic loss scaling for fp16.
//! - [`checkpoint`]: a run's atomic checkpoints (weights, moments, the loop's state), for
//!   pre-training and fine-tuning.
//! - [`step`]: one optimiser step (a micro-batch's forward and backward passes through the
//!   encoder and a head, the encoder's backward by hand over the kernels' tape where they
//!   record; accumulation, loss scaling, the data-parallel reducer, the update), shared by
//!   pre-training and fine-tuning.
//! - [`distributed`]: the data-parallel world a launcher started (MPI with the `mpi` feature)
//!   and its gradient reducer.
//! - [`logs`]: a run's `metrics.jsonl` and TensorBoard event files, for pre-training and
//!   fine-tuning.
//! - [`plan`]: the largest micro-batch per sequence length for a device's memory (estimate).
//! - [`plot`]: training curves from `metrics.jsonl` as SVG.
//! - [`bench`](mod@bench): timing the optimiser step alone (`bertkit bench optimizer`).
//! - [`config`]: the run config (`pipelines/pretrain-phase1.toml`, …).
//! - [`trainer`]: the loop — gradient accumulation, mixed precision, metrics, atomic
//!   checkpoints and exact resume.

#![deny(missing_docs)]

pub mod bench;
mod bucket;
pub mod check;
pub mod checkpoint;
pub mod config;
mod cpu_update;
#[cfg(feature = "cuda")]
mod cuda_update;
pub mod data;
pub mod distributed;
pub mod logs;
pub mod optim;
pub mod plan;
pub mod plot;
pub mod run_folder;
pub mod scaler;
pub mod schedule;
pub mod step;
pub mod trainer;

use std::path::PathBuf;

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A config value that cannot work.
    #[error("config: {0}")]
    Config(String),
    /// Unreadable or unsuitable training data.
    #[error("data: {0}")]
    Data(String),
    /// A checkpoint that cannot be written or resumed from.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The data-parallel world broke up.
    #[error("data parallel: {0}")]
    World(String),
    /// The loss or gradients stopped being finite.
    #[error("diverged: {0}")]
    Diverged(String),
    /// A records file could not be read.
    #[error("data: {0}")]
    Records(#[from] bertkit_records::run::RecordsError),
    /// The model refused.
    #[error(transparent)]
    Model(#[from] bertkit_model::ModelError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The run folder is being written by another run.
    #[error(transparent)]
    Lock(#[from] bertkit_stage_io::lock::LockError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

pub(crate) fn io_err(path: &std::path::Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.into(),
        source,
    }
}
