//! What a pre-training run reports: each step's figures (a line of `metrics.jsonl`), the
//! held-out evaluation's, the run's summary, and how long its start-up and checkpoints took.

use std::path::{Path, PathBuf};
use std::time::Instant;

use bertkit_model::BertConfig;
use serde::{Deserialize, Serialize};

use crate::{TrainError, checkpoint};

/// One optimiser step's figures (a line of `metrics.jsonl`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimiser step, from 1.
    pub step: u64,
    /// `mlm_loss + nsp_loss`.
    pub loss: f64,
    /// Masked-LM cross-entropy per masked token.
    pub mlm_loss: f64,
    /// Next-sentence cross-entropy per sequence.
    pub nsp_loss: f64,
    /// Share of masked tokens predicted right.
    pub mlm_accuracy: f64,
    /// Share of next-sentence labels predicted right.
    pub nsp_accuracy: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Loss scale (1 unless fp16).
    pub loss_scale: f64,
    /// Whether the step was skipped (fp16 overflow).
    pub skipped: bool,
    /// Wall seconds of the step (data already loaded; evaluation and checkpoint excluded).
    pub step_seconds: f64,
    /// Of `step_seconds`, those the host waited for the device at the step's read-back
    /// ([`crate::step::StepOutcome::wait_seconds`]): on a GPU, a wait says the device bounds the
    /// pace (the host had launched the step's work and waited for it); none says the host does
    /// (launching, loading). Absent (0) in the metrics of runs before it was kept.
    #[serde(default)]
    pub wait_seconds: f64,
    /// Sequences per second.
    pub seq_per_s: f64,
    /// Real (unpadded) tokens per second.
    pub tokens_per_s: f64,
    /// Model TFLOP/s achieved ([`training_flops_per_sequence`] at each sequence's length: the
    /// model computes nothing for padding), over the whole world.
    pub tflops: f64,
    /// Model FLOP utilisation per device, when a peak is known (configured, or measured on
    /// the CPU: [`RunOptions::measure_peak`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// The held-out evaluation after this step, when one ran (`[eval]`).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalMetrics>,
}

impl StepMetrics {
    /// The figures as TensorBoard scalars: `train/…`, `perf/…`, and `eval/…` after an
    /// evaluation.
    pub fn scalars(&self) -> Vec<(&'static str, f64)> {
        let mut v = vec![
            ("train/loss", self.loss),
            ("train/mlm_loss", self.mlm_loss),
            ("train/nsp_loss", self.nsp_loss),
            ("train/mlm_accuracy", self.mlm_accuracy),
            ("train/nsp_accuracy", self.nsp_accuracy),
            ("train/lr", self.lr),
            ("train/grad_norm", self.grad_norm),
            ("train/loss_scale", self.loss_scale),
            ("train/skipped", f64::from(u8::from(self.skipped))),
            ("perf/step_seconds", self.step_seconds),
            ("perf/wait_seconds", self.wait_seconds),
            ("perf/seq_per_s", self.seq_per_s),
            ("perf/tokens_per_s", self.tokens_per_s),
            ("perf/tflops", self.tflops),
        ];
        if let Some(mfu) = self.mfu {
            v.push(("perf/mfu", mfu));
        }
        if let Some(e) = &self.eval {
            v.extend([
                ("eval/loss", e.eval_loss),
                ("eval/mlm_loss", e.eval_mlm_loss),
                ("eval/nsp_loss", e.eval_nsp_loss),
                ("eval/mlm_accuracy", e.eval_mlm_accuracy),
                ("eval/nsp_accuracy", e.eval_nsp_accuracy),
            ]);
        }
        v
    }
}

/// Held-out figures (`eval_*` in `metrics.jsonl`): the same sequences and masks every time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    /// `eval_mlm_loss + eval_nsp_loss`.
    pub eval_loss: f64,
    /// Masked-LM cross-entropy per masked token.
    pub eval_mlm_loss: f64,
    /// Next-sentence cross-entropy per sequence.
    pub eval_nsp_loss: f64,
    /// Share of masked tokens predicted right.
    pub eval_mlm_accuracy: f64,
    /// Share of next-sentence labels predicted right.
    pub eval_nsp_accuracy: f64,
    /// Sequences evaluated.
    pub eval_sequences: u64,
}

/// Model FLOPs of one sequence of `seq` tokens in a pre-training step, forward and backward (3x
/// the forward's products): the encoder's linear layers and attention's two products, the
/// masked-LM transform and decoder at `predictions` slots, the pooler and the next-sentence
/// head. Embedding look-ups, element-wise work and the optimiser are not counted, as usual for
/// MFU.
pub fn training_flops_per_sequence(c: &BertConfig, seq: usize, predictions: usize) -> f64 {
    let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
    let (layers, vocab, s) = (c.num_hidden_layers as f64, c.vocab_size as f64, seq as f64);
    // Per token and layer: q, k, v and output projections, the feed-forward pair, q·kᵀ and ·v.
    let layer = 2.0 * (4.0 * h * h + 2.0 * h * i) + 2.0 * 2.0 * s * h;
    let heads = predictions as f64 * 2.0 * (h * h + h * vocab) + 2.0 * h * h + 2.0 * h * 2.0;
    3.0 * (s * layers * layer + heads)
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Step the run started from (0, or the resumed checkpoint's).
    pub started_at: u64,
    /// Step it ended at.
    pub step: u64,
    /// Metrics of the steps run.
    pub metrics: Vec<StepMetrics>,
    /// Every checkpoint this run wrote, with what it cost.
    pub checkpoint_writes: Vec<CheckpointWrite>,
}

impl RunSummary {
    /// The last checkpoint this run wrote.
    pub fn last_checkpoint(&self) -> Option<&Path> {
        self.checkpoint_writes.last().map(|w| w.dir.as_path())
    }
}

/// A checkpoint written during a run.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointWrite {
    /// Its folder.
    pub dir: PathBuf,
    /// Bytes of its files.
    pub bytes: u64,
    /// Wall seconds from the start of the write to the rename into place.
    pub seconds: f64,
}

impl CheckpointWrite {
    /// Runs `write` (a [`checkpoint::save`], returning the checkpoint's folder) and measures it.
    pub fn timed(
        write: impl FnOnce() -> Result<PathBuf, TrainError>,
    ) -> Result<CheckpointWrite, TrainError> {
        let started = Instant::now();
        let dir = write()?;
        Ok(CheckpointWrite {
            seconds: started.elapsed().as_secs_f64(),
            bytes: checkpoint::bytes(&dir),
            dir,
        })
    }
}

impl std::fmt::Display for CheckpointWrite {
    /// `checkpoint run/checkpoints/step-30: 4.03 GB in 5.80 s (695 MB/s)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let size = if self.bytes >= 1_000_000_000 {
            format!("{:.2} GB", self.bytes as f64 / 1e9)
        } else {
            format!("{:.1} MB", self.bytes as f64 / 1e6)
        };
        write!(
            f,
            "checkpoint {}: {size} in {:.2} s ({:.0} MB/s)",
            self.dir.display(),
            self.seconds,
            self.bytes as f64 / 1e6 / self.seconds.max(1e-9)
        )
    }
}

/// Where a run's start-up time went, phase by phase, in the order the phases ran (wall
/// seconds): what `bertkit pretrain` prints before its first step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StartupTimes {
    /// `(phase, seconds)`: `lock`, `device` (opening it: on CUDA, the context), `model`
    /// (initialised or loaded onto the device), `optimizer` (its f32 state), `data` (the
    /// records opened), `memory check`, `resume` (a checkpoint's state read back), `peak`
    /// (the matrix-product rate measured for MFU).
    pub phases: Vec<(&'static str, f64)>,
}

impl StartupTimes {
    /// Ends the phase that began at `*since` (and starts the next one).
    pub(crate) fn lap(&mut self, name: &'static str, since: &mut Instant) {
        let now = Instant::now();
        self.phases.push((name, (now - *since).as_secs_f64()));
        *since = now;
    }

    /// Seconds of all phases.
    pub fn total(&self) -> f64 {
        self.phases.iter().map(|(_, s)| s).sum()
    }
}
