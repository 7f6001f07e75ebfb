//! The pre-training loop.
//!
//! Each optimiser step takes `accumulation` micro-batches. Their losses are normalised by the
//! whole step's counts (masked-LM terms by the step's masked tokens, next-sentence terms by its
//! sequences), so the accumulated gradient equals the gradient of one batch of
//! `micro_batch × accumulation` sequences. Gradients accumulate in the optimiser's master dtype
//! (f32). In fp16 the loss is scaled before backward and the gradients unscaled; a step with
//! non-finite gradients is skipped (see [`crate::scaler`]).
//!
//! The run folder holds `metrics.jsonl` (one object per optimiser step), TensorBoard event
//! files with the same figures ([`crate::logs`]), and `checkpoints/step-N/` ([`crate::checkpoint`]:
//! the f32 master weights in the transformers layout, the moments, and `state.json` with the
//! step, data cursor and loss scaler), written atomically every `checkpoint_every` steps, the
//! newest `keep_checkpoints` kept. Resuming loads the newest and continues with the next unseen
//! step and the same dropout masks (keyed by the step), so a resumed run reproduces an
//! uninterrupted one exactly on the CPU.
//!
//! **Data parallel**: with ranks ([`crate::distributed`]), each rank trains on its part of
//! every step's global batch and the step's losses are normalised by the counts of the whole
//! global batch; the ranks' gradients are summed, and every rank applies the same update.
//! Sequences and dropout masks depend only on the step and a sequence's place in the global
//! batch, so a run equals one on another number of ranks with the accumulation changed to
//! match, and resumes on any number of ranks. Rank 0 alone writes `metrics.jsonl` and
//! checkpoints; every rank resumes from the same checkpoint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use bertkit_model::bert::{BertForPreTraining, Loaded, init, load_with};
use bertkit_model::{DropoutSource, Inputs, MaskedPositions, Mode, loss};
use bertkit_stage_io::lock::FolderLock;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::checkpoint;
use crate::config::PretrainConfig;
use crate::data::{Batch, Cursor, DataOptions, Dataset};
use crate::logs::RunLog;
use crate::optim::Optimizer;
use crate::run_folder::{self, EarlierRun};
use crate::scaler::LossScaler;
use crate::step::{GradientReducer, Local, Step};

mod report;

pub use report::{
    CheckpointWrite, EvalMetrics, RunSummary, StartupTimes, StepMetrics,
    training_flops_per_sequence,
};

/// Where a run stands, saved in `state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Optimiser steps done.
    pub step: u64,
    /// The next step's data.
    pub cursor: Cursor,
    /// fp16 loss scaler.
    pub scaler: Option<LossScaler>,
    /// The config the run was started with.
    pub config: PretrainConfig,
}

/// Overrides from the command line.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Stop after this many optimiser steps (the schedule still spans `total_steps`).
    pub max_steps: Option<u64>,
    /// What to do with an earlier run in the run folder: refuse it, resume it, or move it
    /// aside.
    pub earlier: EarlierRun,
    /// The data-parallel world ([`crate::distributed::join`]); [`Local`] for one process.
    pub reducer: Rc<dyn GradientReducer>,
    /// On the CPU without `peak_tflops` in the config: measure the device's matrix-product
    /// rate at start ([`crate::bench::peak_tflops`], about a second) and report MFU against it.
    pub measure_peak: bool,
    /// Only step ([`Trainer::train_step`]), never [`Trainer::run`]: the output folder is left
    /// alone (not made, not held), as [`crate::bench::training_steps`] measures a run that may
    /// be going on in it.
    pub steps_only: bool,
    /// Write checkpoints (every `checkpoint_every` steps and at the end); off for a benchmark
    /// or a smoke test that will not be resumed (BERT-large's is 4 GB): the run folder then
    /// gets its metrics and logs only.
    pub checkpoints: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            max_steps: None,
            earlier: EarlierRun::Refuse,
            reducer: Rc::new(Local),
            measure_peak: false,
            steps_only: false,
            checkpoints: true,
        }
    }
}

/// The model folder `init` names: itself, or an earlier run's newest checkpoint.
/// A checkpoint resumes only the model it was made of: a run config whose `[model]` was
/// changed since (another preset, width or vocabulary) would otherwise go on training the
/// checkpoint's model while the config says another.
fn check_same_model(
    dir: &Path,
    checkpoint: &bertkit_model::BertConfig,
    run: &bertkit_model::BertConfig,
) -> Result<(), TrainError> {
    let shape = |c: &bertkit_model::BertConfig| {
        [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("intermediate_size", c.intermediate_size),
            ("max_position_embeddings", c.max_position_embeddings),
            ("type_vocab_size", c.type_vocab_size),
        ]
    };
    let differences: Vec<String> = shape(checkpoint)
        .iter()
        .zip(shape(run))
        .filter(|(a, b)| a.1 != b.1)
        .map(|((name, saved), (_, wanted))| format!("{name} {saved} (the config says {wanted})"))
        .collect();
    if differences.is_empty() {
        return Ok(());
    }
    Err(TrainError::Checkpoint(format!(
        "{}: the checkpoint's model is not the run config's [model]: {}; resume with the \
         config the run was started with, or start a new run folder",
        dir.join("config.json").display(),
        differences.join(", ")
    )))
}

fn init_dir(init: &Path) -> Result<PathBuf, TrainError> {
    checkpoint::model_folder(init).ok_or_else(|| {
        TrainError::Config(format!(
            "[model] init {}: neither a model folder (config.json + model.safetensors) nor a run with checkpoints",
            init.display()
        ))
    })
}

/// Host batch → device tensors.
struct DeviceBatch {
    inputs: Inputs,
    positions: MaskedPositions,
    labels: Tensor,
    weights: Tensor,
    nsp: Tensor,
}

fn to_device(
    b: &Batch,
    config: &bertkit_model::BertConfig,
    device: &Device,
) -> Result<DeviceBatch, TrainError> {
    let slots = (b.size, b.predictions);
    // Every value is checked on the host (ids, segments, mask, positions, labels) before
    // upload: on CUDA a bad index is a device-side assert, not an error.
    Ok(DeviceBatch {
        inputs: Inputs::from_host(
            config,
            (b.size, b.seq_len),
            &b.input_ids,
            Some(&b.segment_ids),
            Some(&b.attention_mask),
            device,
        )?,
        positions: MaskedPositions::from_host(slots, &b.masked_positions, b.seq_len, device)?,
        labels: loss::labels(&b.masked_ids, config.vocab_size, "masked_lm_ids", device)?,
        weights: Tensor::from_slice(&b.masked_weights, slots, device)?,
        nsp: loss::labels(&b.nsp_labels, 2, "next_sentence_labels", device)?,
    })
}

/// The figures a step tracks on the device ([`Step::track`]), in this order: the masked-LM and
/// next-sentence cross-entropy sums, and the right masked-LM (weighted by their slot's weight)
/// and next-sentence predictions.
const FIGURES: usize = 4;

/// A micro-batch's right predictions (masked tokens weighted by their slot's weight;
/// next-sentence labels), as a `[2]` f32 tensor on the device.
fn hits(out: &bertkit_model::PreTrainingOutput, d: &DeviceBatch) -> Result<Tensor, TrainError> {
    let predicted = out
        .mlm_logits
        .argmax(2)?
        .flatten_all()?
        .to_dtype(DType::U32)?;
    let mlm = predicted
        .eq(&d.labels.flatten_all()?)?
        .to_dtype(DType::F32)?
        .mul(&d.weights.flatten_all()?)?
        .sum_all()?;
    let nsp = out
        .nsp_logits
        .argmax(1)?
        .to_dtype(DType::U32)?
        .eq(&d.nsp)?
        .to_dtype(DType::F32)?
        .sum_all()?;
    Ok(Tensor::stack(&[mlm, nsp], 0)?)
}

/// A step's losses and accuracies: means per masked token and per sequence.
#[derive(Default)]
struct Means {
    mlm: f64,
    nsp: f64,
    mlm_accuracy: f64,
    nsp_accuracy: f64,
}

impl Means {
    /// From the step's tracked sums (see [`FIGURES`]).
    fn of(sums: &[f64], counts: StepCounts) -> Self {
        Means {
            mlm: sums[0] / counts.masked,
            nsp: sums[1] / counts.sequences,
            mlm_accuracy: sums[2] / counts.masked,
            nsp_accuracy: sums[3] / counts.sequences,
        }
    }
}

/// What one optimiser step's losses are normalised by: its masked tokens (at least a tiny
/// positive number, for a step without any) and its sequences.
#[derive(Debug, Clone, Copy)]
struct StepCounts {
    masked: f64,
    sequences: f64,
}

impl StepCounts {
    fn of(batches: &[Batch]) -> Self {
        let masked: f64 = batches
            .iter()
            .map(|b| b.masked_weights.iter().map(|&w| f64::from(w)).sum::<f64>())
            .sum();
        StepCounts {
            masked: masked.max(1e-5),
            sequences: batches.iter().map(|b| b.size as f64).sum(),
        }
    }
}

/// A micro-batch's masked-LM cross-entropy summed over real slots and next-sentence
/// cross-entropy summed over sequences (scalars), and its figures in the order of
/// [`FIGURES`] (an f64 `[4]` tensor on the device).
fn loss_sums(
    out: &bertkit_model::PreTrainingOutput,
    d: &DeviceBatch,
) -> Result<(Tensor, Tensor, Tensor), TrainError> {
    // The logits as the heads give them: a reshape would cost the backward a zeroed tensor
    // and an addition over all of them.
    let mlm_nll = loss::nll_per_row(&out.mlm_logits, &d.labels.flatten_all()?)?;
    let w = d.weights.flatten_all()?.to_dtype(mlm_nll.dtype())?;
    let mlm_sum = (&mlm_nll * &w)?.sum_all()?;
    let nsp_sum = loss::nll_per_row(&out.nsp_logits, &d.nsp)?.sum_all()?;
    let sums = Tensor::stack(&[&mlm_sum, &nsp_sum], 0)?.to_dtype(DType::F64)?;
    let figures = Tensor::cat(&[sums, hits(out, d)?.to_dtype(DType::F64)?], 0)?;
    Ok((mlm_sum, nsp_sum, figures))
}

/// A micro-batch's share of the step's pre-training loss: its masked-LM cross-entropy summed
/// over real slots, over the step's masked tokens, plus its next-sentence cross-entropy over
/// the step's sequences. The two sums and the right predictions are tracked by `step`.
fn objective(
    out: &bertkit_model::PreTrainingOutput,
    d: &DeviceBatch,
    counts: StepCounts,
    step: &mut Step,
) -> Result<Tensor, TrainError> {
    let (mlm_sum, nsp_sum, figures) = loss_sums(out, d)?;
    step.track(&figures)?;
    Ok(((mlm_sum / counts.masked)? + (nsp_sum / counts.sequences)?)?)
}

/// Before the first step: the plan's predicted peak for this run against the device's free
/// memory (after the model and optimiser are built, so free memory is counted without them and
/// they are taken out of the prediction). A run that will not fit stops here with the numbers
/// and the largest micro-batch that fits, not an out-of-memory error an hour in. On CUDA the
/// feed-forward's form is chosen first (the full one where it fits, unless someone chose:
/// [`crate::plan::feed_forward_for`]), the run checked with it, and the choice returned for
/// the caller to set (the process's setting is left alone here).
/// The records agree with the run's settings and with each other: no record holds more masked
/// positions than `[data] max_predictions` takes (the loader would drop the rest; the training
/// records' only where they are not masked anew), and the held-out records were made with the
/// training records' vocabulary (else their ids mean other words).
fn check_records_agree(
    config: &PretrainConfig,
    train: &Dataset,
    eval: Option<&Dataset>,
) -> Result<(), TrainError> {
    let limit = config.data.max_predictions;
    let sets = [
        (
            "[data] records",
            Some(train).filter(|_| config.data.dynamic_masking.is_none()),
        ),
        ("[eval] records", eval),
    ];
    for (name, set) in sets {
        if let Some(masked) = set.and_then(Dataset::max_predictions_per_seq)
            && masked > limit
        {
            return Err(TrainError::Data(format!(
                "{name} hold up to {masked} masked positions a sequence (their \
                 max_predictions_per_seq), more than [data] max_predictions = {limit} takes: \
                 set max_predictions to at least {masked}"
            )));
        }
    }
    if let (Some(train_files), Some(eval_files)) = (
        train.tokenizer_files(),
        eval.and_then(Dataset::tokenizer_files),
    ) && train_files.vocab != eval_files.vocab
    {
        return Err(TrainError::Data(
            "[eval] records were made with another vocabulary than [data] records: their ids \
             would mean other words (make them with the same vocab.txt, or drop [eval])"
                .into(),
        ));
    }
    Ok(())
}

fn check_memory(
    config: &PretrainConfig,
    model: &bertkit_model::BertConfig,
    seq: usize,
    free: u64,
    accumulation: usize,
) -> Result<Option<crate::plan::FeedForwardChoice>, TrainError> {
    let precision = crate::plan::Precision::parse(&config.train.precision)?;
    let every = config.train.activation_checkpointing;
    let shape = crate::plan::Shape {
        seq,
        predictions: config.data.max_predictions,
        micro_batch: config.data.micro_batch,
        accumulation,
    };
    let target = crate::plan::Target::of_device(&config.train.device);
    let mut predicted = crate::plan::predict(model, &shape, precision, every, target);
    // The state (and on CUDA the runtime: context, cuBLAS) is allocated already: what remains
    // to fit is the rest of the peak. Neither depends on the kernels' forms.
    let allocated = predicted.state_bytes
        + match target {
            crate::plan::Target::Cuda => predicted.runtime_bytes,
            crate::plan::Target::Cpu => 0.0,
        };
    let feed_forward = (target == crate::plan::Target::Cuda).then(|| {
        let memory = free as f64 + allocated;
        let setting = config.train.feed_forward;
        crate::plan::feed_forward_for(model, &shape, precision, every, memory, setting)
    });
    if let Some(choice) = &feed_forward {
        predicted = choice.prediction;
    }
    let needed = predicted.total() - allocated;
    if needed <= free as f64 {
        return Ok(feed_forward);
    }
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let largest = crate::plan::plan(
        model,
        seq,
        shape.predictions,
        precision,
        every,
        target,
        free as f64 + allocated,
    );
    let suggestion = match largest.recipe(config.train.global_batch) {
        Some((micro, steps)) => format!(
            "[data] micro_batch = {micro} fits (accumulation {steps} for the global batch {})",
            config.train.global_batch
        ),
        None => "not even one sequence fits".to_string(),
    };
    Err(TrainError::Config(format!(
        "micro-batch {} of {seq}-token sequences (accumulation {accumulation}, {}, activation \
         checkpointing {every}) needs about {:.1} GiB more at its peak than the {:.1} GiB free on \
         {}: {suggestion}{}",
        shape.micro_batch,
        config.train.precision,
        gib(needed),
        gib(free as f64),
        config.train.device,
        if every == 0 {
            "; or set [train] activation_checkpointing = 1"
        } else {
            ""
        }
    )))
}

/// A pre-training run.
pub struct Trainer {
    config: PretrainConfig,
    options: RunOptions,
    model: Loaded<BertForPreTraining>,
    optimizer: Optimizer,
    dataset: Arc<Dataset>,
    device: Device,
    dropout: DropoutSource,
    scaler: Option<LossScaler>,
    accumulation: usize,
    state: RunState,
    /// Dense TFLOP/s of one device that MFU is reported against: the config's `peak_tflops`,
    /// else on the CPU a measured matrix-product rate when the options ask for it.
    peak_tflops: Option<f64>,
    /// The held-out records and how many batches of them each evaluation runs.
    eval: Option<(Arc<Dataset>, u64)>,
    /// Rank 0's hold on the run folder: one writer per run.
    _lock: Option<FolderLock>,
    startup: StartupTimes,
    /// On CUDA, the feed-forward's form the memory check settled.
    feed_forward: Option<crate::plan::FeedForwardChoice>,
}

impl Trainer {
    /// Sets a run up: the model (fresh, from `[model] init`, or from the newest checkpoint
    /// when resuming), the data and the optimiser.
    pub fn new(config: PretrainConfig, options: RunOptions) -> Result<Self, TrainError> {
        let ranks = options.reducer.ranks();
        config.validate(ranks.world_size)?;
        let accumulation = config.accumulation(ranks.world_size)?;
        let mut startup = StartupTimes::default();
        let mut since = Instant::now();
        // Before anything is read from the run folder: a second run on it must not resume
        // from, or clean up, what the first is writing.
        let lock = if ranks.rank == 0 && !options.steps_only {
            Some(run_folder::take(
                &config.output,
                options.earlier,
                &mut |s| eprintln!("{s}"),
            )?)
        } else {
            None
        };
        startup.lap("lock", &mut since);
        let device = match options.reducer.device() {
            Some(device) => device,
            None => bertkit_model::parse_device(&config.train.device)?,
        };
        startup.lap("device", &mut since);
        let dtype = bertkit_model::parse_dtype(&config.train.precision)?;
        let bert_config = config.bert_config()?;
        let resume_from = if let EarlierRun::Resume { stop_if_damaged } = options.earlier {
            checkpoint::resume_point(&config.output, stop_if_damaged, &mut |w| {
                eprintln!("warning: {w}")
            })?
        } else {
            None
        };
        // The run's dropout setting applies to loaded models too.
        let dropout_override = config.model.dropout;
        let adjust = move |c: &mut bertkit_model::BertConfig| {
            if let Some(p) = dropout_override {
                c.hidden_dropout_prob = p;
                c.attention_probs_dropout_prob = p;
            }
        };
        let mut model = match (&resume_from, &config.model.init) {
            (Some((_, dir)), _) => {
                let loaded = load_with::<BertForPreTraining>(
                    dir,
                    dtype,
                    &device,
                    config.train.seed,
                    &adjust,
                )?;
                if config.model.init.is_none() {
                    check_same_model(dir, &loaded.config, &bert_config)?;
                }
                loaded
            }
            (None, Some(init_path)) => {
                let dir = init_dir(init_path)?;
                load_with::<BertForPreTraining>(&dir, dtype, &device, config.train.seed, &adjust)?
            }
            (None, None) => {
                init::<BertForPreTraining>(&bert_config, dtype, &device, config.train.seed)?
            }
        };
        startup.lap("model", &mut since);
        let mut optimizer = Optimizer::new(config.optimizer.clone(), model.params.vars())?;
        startup.lap("optimizer", &mut since);
        let eval = match &config.eval {
            Some(e) => {
                let micro = e.micro_batch.unwrap_or(config.data.micro_batch);
                let set = Arc::new(Dataset::open(
                    &e.records,
                    DataOptions {
                        micro_batch: micro,
                        global_batch: micro * ranks.world_size,
                        pad_multiple: config.data.pad_multiple,
                        max_predictions: config.data.max_predictions,
                        // One fixed order, whatever the run's seed.
                        seed: 0,
                        ranks,
                        prefetch: 2,
                        dynamic_masking: None,
                        vocab_size: Some(model.config.vocab_size),
                    },
                )?);
                let rounds = (e.sequences.div_ceil(micro * ranks.world_size) as u64)
                    .min(set.steps_per_epoch());
                Some((set, rounds))
            }
            None => None,
        };
        let dataset = Arc::new(Dataset::open(
            &config.data.records,
            DataOptions {
                micro_batch: config.data.micro_batch,
                global_batch: config.train.global_batch,
                pad_multiple: config.data.pad_multiple,
                max_predictions: config.data.max_predictions,
                seed: config.data.seed,
                ranks,
                prefetch: 4,
                dynamic_masking: config.data.dynamic_masking.clone(),
                vocab_size: Some(model.config.vocab_size),
            },
        )?);
        if let Some(vocab) = dataset.vocabulary()
            && vocab.size() > model.config.vocab_size
        {
            return Err(TrainError::Data(format!(
                "the records' vocabulary has {} tokens, more than the model's vocab_size {}: \
                 set [model] vocab_size (or use a config.json) to match the vocabulary",
                vocab.size(),
                model.config.vocab_size
            )));
        }
        check_records_agree(
            &config,
            &dataset,
            eval.as_ref().map(|(set, _)| set.as_ref()),
        )?;
        startup.lap("data", &mut since);
        let mut feed_forward = None;
        if let Some(free) = bertkit_model::free_memory(&device) {
            // The longest sequence the records hold (the files say), else the model's limit.
            let seq = dataset
                .max_seq_length()
                .unwrap_or(model.config.max_position_embeddings)
                .min(model.config.max_position_embeddings);
            feed_forward = check_memory(&config, &model.config, seq, free, accumulation)?;
            if let Some(choice) = &feed_forward {
                model
                    .model
                    .bert
                    .set_kernels(std::sync::Arc::new(choice.kernels()));
            }
            startup.lap("memory check", &mut since);
        }
        // The same source on every rank: masks are keyed by step and place in the global batch.
        let dropout = DropoutSource::new(config.train.seed ^ 0xD50F_0000);
        let mut scaler =
            (dtype == DType::F16).then(|| LossScaler::new(config.train.max_skipped_steps));
        let mut state = RunState {
            step: 0,
            cursor: Cursor::default(),
            scaler: scaler.clone(),
            config: config.clone(),
        };
        if let Some((step, dir)) = &resume_from {
            let saved: RunState = checkpoint::restore(dir, *step, &mut optimizer, &device)?;
            // The final model of the run's last end is stale from the first step on; the
            // checkpoint just read holds its weights, and the run's end writes it anew.
            if lock.is_some() {
                checkpoint::remove_model(&config.output)?;
            }
            scaler = saved.scaler.clone();
            state = RunState {
                config: config.clone(),
                ..saved
            };
            startup.lap("resume", &mut since);
        }
        let peak_tflops = match config.train.peak_tflops {
            Some(peak) => Some(peak),
            None if options.measure_peak && device.is_cpu() => {
                Some(crate::bench::peak_tflops(&model.config, dtype, &device)?)
            }
            None => None,
        };
        if peak_tflops.is_some() && config.train.peak_tflops.is_none() {
            startup.lap("peak", &mut since);
        }
        Ok(Trainer {
            config,
            options,
            model,
            optimizer,
            dataset,
            device,
            dropout,
            scaler,
            accumulation,
            state,
            peak_tflops,
            eval,
            _lock: lock,
            startup,
            feed_forward,
        })
    }

    /// Where the start-up time went ([`Trainer::new`], phase by phase).
    pub fn startup(&self) -> &StartupTimes {
        &self.startup
    }

    /// On CUDA, the feed-forward's form the run takes and why (the memory plan's choice unless
    /// the environment made one); `None` on the CPU.
    pub fn feed_forward(&self) -> Option<&crate::plan::FeedForwardChoice> {
        self.feed_forward.as_ref()
    }

    /// The device the run trains on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The model being trained.
    pub fn model(&self) -> &Loaded<BertForPreTraining> {
        &self.model
    }

    /// Where the run's dropout masks come from.
    pub fn dropout(&self) -> &DropoutSource {
        &self.dropout
    }

    /// The dense TFLOP/s of one device that MFU is reported against, if any (see
    /// [`RunOptions::measure_peak`]).
    pub fn peak_tflops(&self) -> Option<f64> {
        self.peak_tflops
    }

    /// Micro-batches per optimiser step on this rank.
    pub fn accumulation(&self) -> usize {
        self.accumulation
    }

    /// The step the run is at.
    pub fn step(&self) -> u64 {
        self.state.step
    }

    /// Forward and backward passes over one optimiser step's micro-batches, their losses
    /// normalised as one batch of all of them; returns the step (gradients accumulated, loss
    /// and accuracy sums tracked).
    fn accumulate(&self, batches: &[Batch], counts: StepCounts) -> Result<Step, TrainError> {
        let mut step = Step::begin(
            self.model.params.vars(),
            &self.optimizer,
            self.scaler.as_ref(),
        );
        for b in batches {
            let d = to_device(b, &self.model.config, &self.device)?;
            // Each micro-batch's masks start a dropout stream keyed by the step and the
            // batch's place in it: a resumed run, or one split over other ranks, draws them as
            // the uninterrupted one did.
            self.dropout
                .start_batch(self.state.step, b.step_offset as u64);
            let model = &self.model.model;
            step.through_encoder(
                &model.bert,
                &d.inputs,
                Mode::Train(&self.dropout),
                self.config.train.activation_checkpointing,
                |top, step| {
                    // The decoder's gradient of the tied word embeddings outside candle's
                    // graph, added to the lookup's by the step.
                    let (out, sink) = model.heads_handing_over(top, &d.inputs, &d.positions)?;
                    step.hand_over(sink);
                    objective(&out, &d, counts, step)
                },
            )?;
        }
        Ok(step)
    }

    /// The held-out figures at the current weights (`[eval]`; `None` without it): forward
    /// passes without dropout over the same batches each time, shared out among the ranks and
    /// summed over them.
    pub fn evaluate(&self) -> Result<Option<EvalMetrics>, TrainError> {
        let Some((set, rounds)) = &self.eval else {
            return Ok(None);
        };
        let mut stream = set.stream(Cursor::default());
        let mut figures: Option<Tensor> = None;
        let (mut masked, mut sequences) = (0f64, 0f64);
        for _ in 0..*rounds {
            let b = stream.next_batch()?;
            let counts = StepCounts::of(std::slice::from_ref(&b));
            (masked, sequences) = (masked + counts.masked, sequences + counts.sequences);
            let d = to_device(&b, &self.model.config, &self.device)?;
            let out = self
                .model
                .model
                .forward(&d.inputs, &d.positions, Mode::Eval)?;
            // (Detached: the weights track gradients, and a sum over the rounds' graphs would
            // hold every round's activations to the end of the evaluation.)
            let f = loss_sums(&out, &d)?.2.detach();
            drop(out);
            figures = Some(match figures {
                Some(sum) => (sum + f)?,
                None => f,
            });
        }
        let mut totals = match figures {
            Some(f) => f.to_vec1::<f64>()?,
            None => vec![0.0; FIGURES],
        };
        totals.extend([masked, sequences]);
        self.options.reducer.all_reduce_sum_host(&mut totals)?;
        let counts = StepCounts {
            masked: totals[FIGURES].max(1e-5),
            sequences: totals[FIGURES + 1].max(1.0),
        };
        let means = Means::of(&totals[..FIGURES], counts);
        Ok(Some(EvalMetrics {
            eval_loss: means.mlm + means.nsp,
            eval_mlm_loss: means.mlm,
            eval_nsp_loss: means.nsp,
            eval_mlm_accuracy: means.mlm_accuracy,
            eval_nsp_accuracy: means.nsp_accuracy,
            eval_sequences: totals[FIGURES + 1] as u64,
        }))
    }

    /// Gradients of one step's worth of `batches` at the current weights (no update): for tests
    /// of accumulation equivalence.
    pub fn step_gradients(
        &self,
        batches: &[Batch],
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        self.accumulate(batches, StepCounts::of(batches))?
            .into_gradients()
    }

    /// Applies one optimiser step on `batches` (this rank's `accumulation` micro-batches).
    pub fn train_step(&mut self, batches: &[Batch]) -> Result<StepMetrics, TrainError> {
        let started = Instant::now();
        let reducer = self.options.reducer.clone();
        // The whole step's counts, over every rank: what each rank's losses are normalised by.
        let local = StepCounts::of(batches);
        let (model, predictions) = (&self.model.config, self.config.data.max_predictions);
        let mut totals = [
            local.masked,
            local.sequences,
            batches.iter().map(|b| b.tokens as f64).sum(),
            batches
                .iter()
                .flat_map(|b| b.attention_mask.chunks(b.seq_len.max(1)))
                .map(|row| {
                    let tokens = row.iter().filter(|&&m| m == 1).count();
                    training_flops_per_sequence(model, tokens, predictions)
                })
                .sum(),
        ];
        reducer.all_reduce_sum_host(&mut totals)?;
        let [masked, sequences, tokens, flops] = totals;
        let counts = StepCounts {
            masked: masked.max(1e-5),
            sequences,
        };
        let step = self.accumulate(batches, counts)?;
        let lr = self.config.schedule.lr_at(self.state.step);
        let outcome = step.finish(
            reducer.as_ref(),
            &mut self.optimizer,
            self.scaler.as_mut(),
            lr,
            self.state.step + 1,
        )?;
        debug_assert_eq!(outcome.figures.len(), FIGURES);
        let means = Means::of(&outcome.figures, counts);
        self.state.step += 1;
        self.state.scaler = self.scaler.clone();
        if let Some(last) = batches.last() {
            self.state.cursor = last.next;
        }
        let seconds = started.elapsed().as_secs_f64().max(1e-9);
        let tflops = flops / seconds / 1e12;
        let devices = reducer.ranks().world_size as f64;
        Ok(StepMetrics {
            step: self.state.step,
            loss: outcome.loss,
            mlm_loss: means.mlm,
            nsp_loss: means.nsp,
            mlm_accuracy: means.mlm_accuracy,
            nsp_accuracy: means.nsp_accuracy,
            lr,
            grad_norm: outcome.grad_norm,
            loss_scale: outcome.loss_scale,
            skipped: !outcome.applied,
            step_seconds: seconds,
            wait_seconds: outcome.wait_seconds,
            seq_per_s: sequences / seconds,
            tokens_per_s: tokens / seconds,
            tflops,
            mfu: self.peak_tflops.map(|p| tflops / (p * devices)),
            eval: None,
        })
    }

    /// Writes `checkpoints/step-N/` atomically and deletes all but the newest
    /// `keep_checkpoints`. Returns its folder.
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        let config_json = self.config_json();
        checkpoint::save(
            &self.config.output,
            self.state.step,
            &self.optimizer,
            &config_json,
            self.dataset.tokenizer_files(),
            &self.state,
            self.config.train.keep_checkpoints,
        )
    }

    /// The model's `config.json` as transformers writes it for a pre-training model.
    fn config_json(&self) -> String {
        self.model
            .config
            .to_hf_json("BertForPreTraining", &[("torch_dtype", "float32".into())])
    }

    /// Runs to `total_steps` (or `max_steps`), calling `progress` after each step; rank 0
    /// appends to `metrics.jsonl` and checkpoints every `checkpoint_every` steps and at the
    /// end (unless [`RunOptions::checkpoints`] is off).
    pub fn run(
        &mut self,
        progress: &mut dyn FnMut(&StepMetrics),
    ) -> Result<RunSummary, TrainError> {
        let last = self
            .options
            .max_steps
            .unwrap_or(self.config.schedule.total_steps)
            .min(self.config.schedule.total_steps);
        if self.options.steps_only {
            return Err(TrainError::Config(
                "a trainer set up to take steps only (steps_only) does not run: it holds no \
                 run folder to write"
                    .into(),
            ));
        }
        let started_at = self.state.step;
        // Rank 0 alone writes the run folder.
        let writes = self.options.reducer.ranks().rank == 0;
        let mut log = if writes {
            Some(RunLog::open(&self.config.output, started_at)?)
        } else {
            None
        };
        let mut stream = self.dataset.stream(self.state.cursor);
        let mut metrics = Vec::new();
        let mut checkpoint_writes = Vec::new();
        while self.state.step < last {
            let batches = (0..self.accumulation)
                .map(|_| stream.next_batch())
                .collect::<Result<Vec<_>, _>>()?;
            let mut m = self.train_step(&batches)?;
            if let Some(e) = &self.config.eval
                && (self.state.step.is_multiple_of(e.every) || self.state.step == last)
            {
                m.eval = self.evaluate()?;
            }
            if let Some(log) = &mut log {
                log.write(m.step, &m, &m.scalars())?;
            }
            progress(&m);
            metrics.push(m);
            if writes
                && self.options.checkpoints
                && (self
                    .state
                    .step
                    .is_multiple_of(self.config.train.checkpoint_every)
                    || self.state.step == last)
            {
                checkpoint_writes.push(CheckpointWrite::timed(|| self.save_checkpoint())?);
            }
        }
        if writes {
            checkpoint::write_model(
                &self.config.output,
                &self.optimizer,
                &self.config_json(),
                self.dataset.tokenizer_files(),
            )?;
        }
        Ok(RunSummary {
            started_at,
            step: self.state.step,
            metrics,
            checkpoint_writes,
        })
    }

    /// The data set.
    pub fn dataset(&self) -> &Arc<Dataset> {
        &self.dataset
    }
}

#[cfg(test)]
mod tests;
