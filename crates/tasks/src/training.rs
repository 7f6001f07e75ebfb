//! The fine-tuning loop the tasks share (nanoGPT-style: one readable loop).
//!
//! Each epoch visits the examples in a seeded shuffled order, `batch` examples per optimiser
//! step. A step's batch is split into `accumulation` micro-batches; each micro-batch's mean
//! loss is weighted by its share of the batch, so the accumulated gradient is the gradient of
//! the batch mean whatever the split. AdamW (weight decay 0.01 except biases and LayerNorm,
//! global-norm clipping at 1.0) keeps f32 master weights, so the model may run in bf16 or
//! fp16; fp16 scales the loss dynamically and skips steps whose gradients overflow. The
//! learning rate warms up linearly over `warmup` of the steps and then decays linearly to 0.
//! The step itself (accumulation, loss scaling, update) is pre-training's:
//! [`bertkit_train::step`].
//!
//! **Checkpoints** ([`bertkit_train::checkpoint`], as pre-training's): every
//! `checkpoint_every` steps and after the last, `checkpoints/step-N/` in the run folder holds
//! the f32 master weights, the optimiser's moments and the loop's state (step, loss scaler, the
//! settings). The data position and dropout follow from the step (each epoch's order is
//! shuffled from the seed and the epoch; masks are keyed by the step), so a run resumed from a
//! checkpoint goes on exactly as if it had never stopped.
//!
//! **Data parallel**: a step's batch is cut into `ranks × accumulation` micro-batches and rank
//! `r` takes the `r`-th run of `accumulation` of them; the ranks' gradients are summed (each
//! micro-batch's loss already carries its share of the whole batch) and every rank applies the
//! same update. Dropout is keyed by the step and an example's place in the batch, so `N` ranks
//! train exactly like one process with `N` times the accumulation.

use bertkit_model::bert::{BertArchitecture, Loaded};
use bertkit_model::{DropoutSource, Mode, ParamStore};
use bertkit_tokenizer::folder::TokenizerFiles;
use bertkit_train::checkpoint;
use bertkit_train::logs::RunLog;
use bertkit_train::optim::{Optimizer, OptimizerConfig, Rule};
use bertkit_train::run_folder::EarlierRun;
use bertkit_train::scaler::LossScaler;
use bertkit_train::schedule::{Decay, Schedule};
use bertkit_train::step::{GradientReducer, Step};
use candle_core::DType;
use std::path::Path;

use crate::TaskError;

/// Fine-tuning hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSettings {
    /// Passes over the training examples.
    pub epochs: f64,
    /// Peak learning rate.
    pub lr: f64,
    /// Examples per optimiser step.
    pub batch: usize,
    /// Micro-batches per step (gradient accumulation).
    pub accumulation: usize,
    /// Share of the steps spent warming up.
    pub warmup: f64,
    /// Shuffling and dropout.
    pub seed: u64,
    /// Stop after this many steps (short runs); the schedule still spans all epochs.
    pub max_steps: Option<usize>,
    /// Write a checkpoint every this many steps (and after the last).
    pub checkpoint_every: usize,
    /// Checkpoints kept (the newest).
    pub keep_checkpoints: usize,
    /// On CUDA, the feed-forward's form (the memory plan's by default).
    pub feed_forward: bertkit_train::plan::FeedForward,
}

impl TrainSettings {
    /// GLUE's recipe (`run_classifier.py`): 3 epochs at 2e-5, 32 examples per step, 10% warmup.
    pub fn glue() -> Self {
        TrainSettings {
            epochs: 3.0,
            lr: 2e-5,
            batch: 32,
            accumulation: 1,
            warmup: 0.1,
            seed: 42,
            max_steps: None,
            checkpoint_every: 500,
            keep_checkpoints: 2,
            feed_forward: Default::default(),
        }
    }

    /// SQuAD's recipe (`run_squad.py`): 2 epochs at 3e-5, 32 examples per step, 10% warmup.
    pub fn squad() -> Self {
        TrainSettings {
            epochs: 2.0,
            lr: 3e-5,
            ..Self::glue()
        }
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Settings(m));
        if self.batch == 0 || self.accumulation == 0 {
            return bad("batch and accumulation must be at least 1".into());
        }
        if self.checkpoint_every == 0 || self.keep_checkpoints == 0 {
            return bad("checkpoint-every and keep-checkpoints must be at least 1".into());
        }
        if self.accumulation > self.batch {
            return bad(format!(
                "accumulation {} exceeds the batch {}: each micro-batch needs an example",
                self.accumulation, self.batch
            ));
        }
        if self.epochs.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return bad(format!("epochs must be positive, not {}", self.epochs));
        }
        Ok(())
    }

    /// Optimiser steps per epoch for `examples` examples.
    pub fn steps_per_epoch(&self, examples: usize) -> usize {
        examples.div_ceil(self.batch).max(1)
    }

    /// Steps in the schedule (all epochs).
    pub fn total_steps(&self, examples: usize) -> usize {
        ((self.steps_per_epoch(examples) as f64 * self.epochs).ceil() as usize).max(1)
    }
}

/// What a training run did.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainLog {
    /// The step the run started after (0, or the checkpoint it resumed from).
    pub started_at: usize,
    /// The step it ended at (skipped fp16 steps included).
    pub steps: usize,
    /// Loss of each step this process ran (mean over its batch).
    pub losses: Vec<f64>,
    /// fp16 steps skipped for overflowing gradients.
    pub skipped: usize,
    /// Seconds spent.
    pub seconds: f64,
}

impl TrainLog {
    /// Mean loss of the first and last tenth of the steps this process ran (`None` when it
    /// ran none: a resumed run that had already finished).
    pub fn first_and_last_tenth(&self) -> Option<(f64, f64)> {
        if self.losses.is_empty() {
            return None;
        }
        let tenth = (self.losses.len() / 10).max(1);
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
        Some((
            mean(&self.losses[..tenth]),
            mean(&self.losses[self.losses.len() - tenth..]),
        ))
    }
}

/// On CUDA, the feed-forward's form for fine-tuning `bert` (of `config`) on sequences of up to
/// `seq` tokens in `dtype` (the model loaded, its optimiser not yet made): `settings.batch`
/// examples a step, split over its accumulation and `reducer`'s ranks, as
/// `settings.feed_forward` says (by default as the memory plan chooses for pre-training,
/// [`bertkit_train::plan::settle_feed_forward`]: the activation kept where that fits), given to
/// the model's kernels and said through `progress`. Nothing to choose on the CPU.
pub fn settle_feed_forward(
    bert: &mut bertkit_model::BertModel,
    config: &bertkit_model::BertConfig,
    (seq, settings): (usize, &TrainSettings),
    reducer: &dyn GradientReducer,
    (dtype, device): (DType, &candle_core::Device),
    progress: &mut dyn FnMut(&str),
) {
    let parts = settings.accumulation.max(1) * reducer.ranks().world_size.max(1);
    let micro_batch = settings.batch.div_ceil(parts);
    let shape = (seq, micro_batch, settings.accumulation);
    if let Some(choice) = bertkit_train::plan::settle_feed_forward(
        config,
        shape,
        (dtype, device),
        bertkit_train::plan::WeightsOnDevice::Loaded,
        settings.feed_forward,
    ) {
        bert.set_kernels(std::sync::Arc::new(choice.kernels()));
        progress(&choice.to_string());
    }
}

/// A seeded permutation of `0..n` (one splitmix64 stream from `key`).
pub fn shuffled(n: usize, key: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut stream = bertkit_rng::SplitMix64::new(key);
    for i in (1..n).rev() {
        order.swap(i, (stream.next_u64() % (i as u64 + 1)) as usize);
    }
    order
}

/// A micro-batch's forward and backward passes: `pass(indices, mode, weight, step)` runs the
/// examples at `indices` through the model in `mode` with [`Step::through_encoder`] (the
/// encoder, then the task's head), the head's loss being the examples' mean loss times
/// `weight`, and so adds their gradients to `step`'s.
pub type PassFn<'a> = dyn FnMut(&[usize], Mode, f64, &mut Step) -> Result<(), TaskError> + 'a;

/// Dev-set figures to log after an epoch: `(name, value)`, logged as `dev_<name>`.
pub type EpochEval<'a> = dyn FnMut() -> Result<Vec<(String, f64)>, TaskError> + 'a;

/// What a run logs and where.
pub struct Watch<'a> {
    /// The run folder: it gets `metrics.jsonl`, TensorBoard event files and, with
    /// `checkpoints`, `checkpoints/step-N/` (rank 0 writes; `None`: nothing is written).
    pub dir: Option<&'a Path>,
    /// Called on every rank after each epoch's last step and after the run's last step; its
    /// figures join that step's line (`None`: nothing is evaluated during training).
    pub after_epoch: Option<&'a mut EpochEval<'a>>,
    /// Checkpoints in `dir` (`None`: none written or read).
    pub checkpoints: Option<Checkpoints>,
}

impl Watch<'_> {
    /// Logs nothing, evaluates nothing.
    pub fn none() -> Self {
        Watch {
            dir: None,
            after_epoch: None,
            checkpoints: None,
        }
    }
}

/// Checkpointing a fine-tuning run.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    /// The model's `config.json` text, saved beside its weights (a checkpoint is a model
    /// folder).
    pub config_json: String,
    /// The tokenizer the model is fine-tuned with, saved beside its weights too.
    pub tokenizer: TokenizerFiles,
    /// What to do with an earlier run in the run folder: resume from its newest checkpoint
    /// (none: start at step 0), refuse it, or move it aside (done by the caller, under the
    /// folder's lock: [`bertkit_train::run_folder::take`]). A folder holding checkpoints is never mixed with
    /// a new run's.
    pub earlier: EarlierRun,
}

/// Checkpointing for a run fine-tuning `model`.
pub fn checkpoints_of<M: BertArchitecture>(
    model: &Loaded<M>,
    tokenizer: TokenizerFiles,
    earlier: EarlierRun,
) -> Checkpoints {
    Checkpoints {
        config_json: model
            .config
            .to_hf_json(M::ARCHITECTURE, &[("torch_dtype", "float32".into())]),
        tokenizer,
        earlier,
    }
}

/// What identifies a run: a checkpoint resumes only a run with the same.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct RunIdentity {
    examples: usize,
    epochs: f64,
    lr: f64,
    batch: usize,
    warmup: f64,
    seed: u64,
}

impl RunIdentity {
    /// What differs from `other`, as `name: ours against theirs`.
    fn differences(&self, other: &RunIdentity) -> Vec<String> {
        let mut out = Vec::new();
        let mut compare = |name: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{name}: {a} against {b}"));
            }
        };
        compare(
            "examples",
            self.examples.to_string(),
            other.examples.to_string(),
        );
        compare("epochs", self.epochs.to_string(), other.epochs.to_string());
        compare("lr", self.lr.to_string(), other.lr.to_string());
        compare("batch", self.batch.to_string(), other.batch.to_string());
        compare("warmup", self.warmup.to_string(), other.warmup.to_string());
        compare("seed", self.seed.to_string(), other.seed.to_string());
        out
    }
}

/// A fine-tuning checkpoint's `state.json`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct LoopState {
    /// Optimiser steps done.
    step: u64,
    /// fp16 loss scaler.
    scaler: Option<LossScaler>,
    /// The run it belongs to.
    run: RunIdentity,
}

/// One optimiser step's line of a fine-tuning run's `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepLine {
    /// Optimiser step, from 1.
    pub step: u64,
    /// Epoch (fractional: steps done over steps per epoch).
    pub epoch: f64,
    /// The step's mean training loss.
    pub loss: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the step was skipped (fp16 overflow).
    pub skipped: bool,
    /// Seconds since the run started.
    pub seconds: f64,
    /// Dev figures after an epoch, as `dev_<name>`.
    #[serde(flatten)]
    pub dev: std::collections::BTreeMap<String, f64>,
}

/// Trains the parameters in `params` on `examples` examples, this process being one of the
/// `reducer`'s ranks. `pass` runs a micro-batch's forward and backward passes ([`PassFn`]);
/// `progress` hears which parameters the checkpoint lacked (initialised fresh), then
/// a line every 20 steps.
pub fn train(
    params: &ParamStore,
    examples: usize,
    settings: &TrainSettings,
    reducer: &dyn GradientReducer,
    pass: &mut PassFn,
    watch: Watch,
    progress: &mut dyn FnMut(&str),
) -> Result<TrainLog, TaskError> {
    let Watch {
        dir,
        mut after_epoch,
        checkpoints,
    } = watch;
    settings.validate()?;
    let ranks = reducer.ranks();
    let parts = settings.accumulation * ranks.world_size;
    if parts > settings.batch {
        return Err(TaskError::Settings(format!(
            "accumulation {} on {} rank(s) cuts a batch of {} into more micro-batches than it \
             has examples",
            settings.accumulation, ranks.world_size, settings.batch
        )));
    }
    if examples == 0 {
        return Err(TaskError::Settings("no training examples".into()));
    }
    let steps_per_epoch = settings.steps_per_epoch(examples);
    let total = settings.total_steps(examples);
    let steps = settings.max_steps.map_or(total, |m| m.min(total));
    let schedule = Schedule {
        lr: settings.lr,
        warmup: settings.warmup,
        total_steps: total as u64,
        decay: Decay::Linear,
        power: 1.0,
    };
    schedule.validate()?;
    let mut optimizer = Optimizer::new(
        OptimizerConfig {
            rule: Rule::Adamw,
            ..OptimizerConfig::lamb()
        },
        params.vars(),
    )?;
    let fp16 = params.vars().values().any(|v| v.dtype() == DType::F16);
    let mut scaler = fp16.then(|| LossScaler::new(50));
    let identity = RunIdentity {
        examples,
        epochs: settings.epochs,
        lr: settings.lr,
        batch: settings.batch,
        warmup: settings.warmup,
        seed: settings.seed,
    };
    let checkpoints = match (dir, checkpoints) {
        (Some(dir), Some(c)) => Some((dir, c)),
        (None, Some(_)) => {
            return Err(TaskError::Settings(
                "checkpoints need an output folder".into(),
            ));
        }
        _ => None,
    };
    let mut started_at = 0;
    if let Some((dir, c)) = &checkpoints {
        let newest = if let EarlierRun::Resume { stop_if_damaged } = c.earlier {
            checkpoint::resume_point(dir, stop_if_damaged, &mut |w| {
                progress(&format!("warning: {w}"))
            })?
        } else {
            checkpoint::newest(dir)
        };
        match newest {
            Some((step, found)) if c.earlier.resumes() => {
                let device = params
                    .vars()
                    .values()
                    .next()
                    .map_or(candle_core::Device::Cpu, |v| v.device().clone());
                let saved: LoopState = checkpoint::restore(&found, step, &mut optimizer, &device)?;
                if saved.run != identity {
                    return Err(TaskError::Settings(format!(
                        "{} was written by a run with other data or settings ({}, the \
                         checkpoint's against this run's): resume with the same, or write to \
                         another folder",
                        found.display(),
                        saved.run.differences(&identity).join(", ")
                    )));
                }
                started_at = saved.step as usize;
                scaler = saved.scaler;
                progress(&format!("resumed from {} (step {step})", found.display()));
            }
            Some((_, found)) => {
                return Err(TaskError::Settings(format!(
                    "{} holds a checkpoint of an earlier run ({}): --resume to continue it, \
                     --overwrite to move it aside, or write to another folder",
                    dir.display(),
                    found.display()
                )));
            }
            None if c.earlier.resumes() => {
                progress("no checkpoint to resume from: starting at step 0")
            }
            None => {}
        }
    }
    if started_at >= steps {
        progress(&format!(
            "nothing left to train: the checkpoint is at step {steps}, where this run ends"
        ));
    }
    if started_at == 0 && !params.initialised.is_empty() {
        progress(&format!("initialised: {}", params.initialised.join(", ")));
    }
    let mut run_log = match dir {
        Some(dir) if ranks.rank == 0 => Some(RunLog::open(dir, started_at as u64)?),
        _ => None,
    };
    let dropout = DropoutSource::new(settings.seed);
    let started = std::time::Instant::now();
    let mut log = TrainLog {
        started_at,
        steps: started_at,
        losses: Vec::with_capacity(steps.saturating_sub(started_at)),
        skipped: 0,
        seconds: 0.0,
    };
    let mut order = Vec::new();
    for step_index in started_at..steps {
        let epoch = step_index / steps_per_epoch;
        let within = step_index % steps_per_epoch;
        if within == 0 || step_index == started_at {
            order = shuffled(
                examples,
                settings.seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37),
            );
        }
        let batch = &order[within * settings.batch..((within + 1) * settings.batch).min(examples)];
        let micro = batch.len().div_ceil(parts);
        let mut step = Step::begin(params.vars(), &optimizer, scaler.as_ref());
        let mine = ranks.rank * settings.accumulation;
        for (c, part) in batch
            .chunks(micro)
            .enumerate()
            .skip(mine)
            .take(settings.accumulation)
        {
            // Each micro-batch's mean loss, weighted by its share of the batch: the gradients
            // add up (over micro-batches and ranks) to the batch mean's.
            let weight = part.len() as f64 / batch.len() as f64;
            dropout.start_batch(step_index as u64, (c * micro) as u64);
            pass(part, Mode::Train(&dropout), weight, &mut step)?;
        }
        let lr = schedule.lr_at(step_index as u64);
        let outcome = step.finish(
            reducer,
            &mut optimizer,
            scaler.as_mut(),
            lr,
            step_index as u64 + 1,
        )?;
        let step_loss = outcome.loss;
        log.skipped += usize::from(!outcome.applied);
        log.losses.push(step_loss);
        log.steps += 1;
        let epoch_done = (step_index + 1) % steps_per_epoch == 0 || step_index + 1 == steps;
        let dev = match &mut after_epoch {
            Some(eval) if epoch_done => eval()?
                .into_iter()
                .map(|(k, v)| (format!("dev_{k}"), v))
                .collect(),
            _ => std::collections::BTreeMap::new(),
        };
        if let Some(run_log) = &mut run_log {
            let line = StepLine {
                step: step_index as u64 + 1,
                epoch: (step_index + 1) as f64 / steps_per_epoch as f64,
                loss: step_loss,
                lr,
                grad_norm: outcome.grad_norm,
                skipped: !outcome.applied,
                seconds: started.elapsed().as_secs_f64(),
                dev,
            };
            let mut scalars = vec![
                ("train/loss".to_string(), line.loss),
                ("train/lr".to_string(), line.lr),
                ("train/grad_norm".to_string(), line.grad_norm),
                ("train/epoch".to_string(), line.epoch),
            ];
            scalars.extend(
                line.dev
                    .iter()
                    .map(|(k, v)| (format!("dev/{}", &k[4..]), *v)),
            );
            let scalars: Vec<(&str, f64)> = scalars.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            run_log.write(line.step, &line, &scalars)?;
        }
        if let Some((dir, c)) = &checkpoints
            && ranks.rank == 0
            && ((step_index + 1) % settings.checkpoint_every == 0 || step_index + 1 == steps)
        {
            let state = LoopState {
                step: step_index as u64 + 1,
                scaler: scaler.clone(),
                run: identity.clone(),
            };
            // Said apart from the steps: the step lines' times include it.
            let write = bertkit_train::trainer::CheckpointWrite::timed(|| {
                checkpoint::save(
                    dir,
                    state.step,
                    &optimizer,
                    &c.config_json,
                    Some(&c.tokenizer),
                    &state,
                    settings.keep_checkpoints,
                )
            })?;
            progress(&write.to_string());
        }
        if (step_index + 1) % 20 == 0 || step_index + 1 == steps {
            progress(&format!(
                "step {}/{steps} loss {step_loss:.4} lr {lr:.2e} ({:.1} s)",
                step_index + 1,
                started.elapsed().as_secs_f64()
            ));
        }
    }
    log.seconds = started.elapsed().as_secs_f64();
    Ok(log)
}
