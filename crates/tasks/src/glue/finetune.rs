//! Fine-tuning a BERT checkpoint on a GLUE task, and evaluating it.
//!
//! Encoding as Google's `run_classifier.py`: WordPiece (the model folder's `vocab.txt`),
//! `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]` with segment ids 0/1, a pair truncated from the
//! longer side to `max_seq_length`. Batches are padded to their longest sequence. Training:
//! cross-entropy on the classification head (initialised as BERT does when the checkpoint has
//! none), AdamW (weight decay 0.01 except biases and LayerNorm, gradient clipping at 1.0), linear
//! warmup over `warmup` of the steps then linear decay, dropout on, examples shuffled per epoch
//! from the seed. The fine-tuned model is saved in the transformers layout.

use std::path::{Path, PathBuf};

use bertkit_model::bert::{BertForSequenceClassification, Loaded, load_with, save};
use bertkit_model::{DropoutSource, Inputs, Mode, loss};
use bertkit_records::FullTokenizer;
use bertkit_train::optim::{Optimizer, OptimizerConfig, Rule};
use bertkit_train::schedule::{Decay, Schedule};
use candle_core::{DType, Device, Tensor};

use crate::glue::data::{Example, Task, read};
use crate::glue::metrics;

/// An encoded example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids with `[CLS]`/`[SEP]`.
    pub ids: Vec<u32>,
    /// Segment ids.
    pub segments: Vec<u32>,
    /// Class index.
    pub label: usize,
}

/// Encodes `example` as Google's `convert_single_example`.
pub fn encode(
    tokenizer: &FullTokenizer,
    example: &Example,
    max_seq_length: usize,
) -> Result<Encoded, String> {
    let cls = tokenizer
        .token_to_id("[CLS]")
        .ok_or("the vocabulary has no [CLS]")?;
    let sep = tokenizer
        .token_to_id("[SEP]")
        .ok_or("the vocabulary has no [SEP]")?;
    let mut a = tokenizer.tokenize_ids(&example.text_a);
    let mut b = example.text_b.as_deref().map(|t| tokenizer.tokenize_ids(t));
    match &mut b {
        Some(b) => {
            let budget = max_seq_length.saturating_sub(3);
            while a.len() + b.len() > budget {
                if a.len() > b.len() {
                    a.pop();
                } else {
                    b.pop();
                }
            }
        }
        None => a.truncate(max_seq_length.saturating_sub(2)),
    }
    let mut ids = vec![cls];
    ids.extend(&a);
    ids.push(sep);
    let mut segments = vec![0; ids.len()];
    if let Some(b) = b {
        ids.extend(&b);
        ids.push(sep);
        segments.resize(ids.len(), 1);
    }
    Ok(Encoded {
        ids,
        segments,
        label: example.label,
    })
}

/// Fine-tuning settings (defaults: BERT's GLUE recipe).
#[derive(Debug, Clone)]
pub struct FinetuneOptions {
    /// The task.
    pub task: Task,
    /// Model folder (config.json, model.safetensors, vocab.txt).
    pub model: PathBuf,
    /// The task's folder (train.tsv, dev.tsv).
    pub data: PathBuf,
    /// Where the fine-tuned model goes (none: not saved).
    pub output: Option<PathBuf>,
    /// Passes over the training set.
    pub epochs: f64,
    /// Peak learning rate.
    pub lr: f64,
    /// Sequences per step.
    pub batch: usize,
    /// Longest encoded sequence.
    pub max_seq_length: usize,
    /// Share of steps warming up.
    pub warmup: f64,
    /// Shuffling, dropout and head initialisation.
    pub seed: u64,
    /// Stop after this many steps (for short runs).
    pub max_steps: Option<usize>,
    /// Uncased vocabulary.
    pub lower_case: bool,
    /// Device.
    pub device: Device,
}

/// Dev-set results.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Examples scored.
    pub examples: usize,
    /// Mean cross-entropy.
    pub loss: f64,
    /// (metric, value): accuracy, and F1 (MRPC) or Matthews correlation (CoLA).
    pub metrics: Vec<(String, f64)>,
}

/// What a fine-tuning run did.
#[derive(Debug, Clone)]
pub struct FinetuneReport {
    /// Optimiser steps.
    pub steps: usize,
    /// Training examples.
    pub train_examples: usize,
    /// Mean training loss of the first and last 10% of steps.
    pub train_loss: (f64, f64),
    /// Dev results after training.
    pub dev: Evaluation,
    /// Seconds spent training.
    pub seconds: f64,
}

fn batch_tensors(
    batch: &[&Encoded],
    config: &bertkit_model::BertConfig,
    device: &Device,
) -> Result<(Inputs, Tensor), crate::TaskError> {
    let longest = batch.iter().map(|e| e.ids.len()).max().unwrap_or(1);
    let (mut ids, mut segs, mut mask) = (Vec::new(), Vec::new(), Vec::new());
    for e in batch {
        let pad = longest - e.ids.len();
        ids.extend(e.ids.iter().copied().chain(std::iter::repeat_n(0, pad)));
        segs.extend(
            e.segments
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, pad)),
        );
        mask.extend(std::iter::repeat_n(1u32, e.ids.len()).chain(std::iter::repeat_n(0, pad)));
    }
    let shape = (batch.len(), longest);
    let t = |v: Vec<u32>| Tensor::from_vec(v, shape, device);
    let err = |e: String| crate::TaskError::Format {
        path: PathBuf::from("<batch>"),
        message: e,
    };
    let inputs = Inputs::new(
        config,
        &t(ids).map_err(|e| err(e.to_string()))?,
        Some(&t(segs).map_err(|e| err(e.to_string()))?),
        Some(&t(mask).map_err(|e| err(e.to_string()))?),
    )
    .map_err(|e| err(e.to_string()))?;
    let labels: Vec<u32> = batch.iter().map(|e| e.label as u32).collect();
    let labels = Tensor::from_vec(labels, batch.len(), device).map_err(|e| err(e.to_string()))?;
    Ok((inputs, labels))
}

fn model_err(e: impl std::fmt::Display) -> crate::TaskError {
    crate::TaskError::Format {
        path: PathBuf::from("<model>"),
        message: e.to_string(),
    }
}

/// Scores `model` on `examples`.
pub fn evaluate(
    task: Task,
    model: &Loaded<BertForSequenceClassification>,
    examples: &[Encoded],
    device: &Device,
) -> Result<Evaluation, crate::TaskError> {
    let mut predictions = Vec::with_capacity(examples.len());
    let mut loss_sum = 0f64;
    for chunk in examples.chunks(64) {
        let refs: Vec<&Encoded> = chunk.iter().collect();
        let (inputs, labels) = batch_tensors(&refs, &model.config, device)?;
        let logits = model
            .model
            .forward(&inputs, Mode::Eval)
            .map_err(model_err)?;
        let nll = loss::nll_per_row(&logits, &labels).map_err(model_err)?;
        loss_sum += nll
            .to_dtype(DType::F64)
            .and_then(|t| t.sum_all())
            .and_then(|t| t.to_scalar::<f64>())
            .map_err(model_err)?;
        let p: Vec<u32> = logits
            .argmax(1)
            .and_then(|t| t.to_vec1())
            .map_err(model_err)?;
        predictions.extend(p.into_iter().map(|x| x as usize));
    }
    let labels: Vec<usize> = examples.iter().map(|e| e.label).collect();
    let mut m = vec![(
        "accuracy".to_string(),
        metrics::accuracy(&predictions, &labels),
    )];
    match task {
        Task::Mrpc => m.push(("f1".into(), metrics::f1(&predictions, &labels))),
        Task::Cola => m.push(("matthews".into(), metrics::matthews(&predictions, &labels))),
        _ => {}
    }
    Ok(Evaluation {
        examples: examples.len(),
        loss: loss_sum / examples.len().max(1) as f64,
        metrics: m,
    })
}

fn shuffled(n: usize, key: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    // One splitmix64 stream (a counter from `key`), as the MRPC measurement was made with.
    let mut s = key;
    for i in (1..n).rev() {
        let z = bertkit_model::rng::splitmix64(s);
        s = s.wrapping_add(bertkit_model::rng::SPLITMIX_INCREMENT);
        order.swap(i, (z % (i as u64 + 1)) as usize);
    }
    order
}

/// Fine-tunes and evaluates; `progress` hears a line now and then.
pub fn finetune(
    options: &FinetuneOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<FinetuneReport, crate::TaskError> {
    let task = options.task;
    let vocab = options.model.join("vocab.txt");
    let tokenizer = FullTokenizer::from_vocab_file(&vocab, options.lower_case).map_err(|e| {
        crate::TaskError::Format {
            path: vocab.clone(),
            message: e.to_string(),
        }
    })?;
    let encode_all = |path: &Path| -> Result<Vec<Encoded>, crate::TaskError> {
        read(task, path)?
            .iter()
            .map(|e| encode(&tokenizer, e, options.max_seq_length))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|m| crate::TaskError::Format {
                path: path.into(),
                message: m,
            })
    };
    let train = encode_all(&options.data.join("train.tsv"))?;
    let dev = encode_all(&options.data.join(task.dev_file()))?;
    let labels = task.labels();
    let model = load_with::<BertForSequenceClassification>(
        &options.model,
        DType::F32,
        &options.device,
        options.seed,
        &|c| {
            c.id2label = Some(
                labels
                    .iter()
                    .enumerate()
                    .map(|(i, l)| (i.to_string(), l.to_string()))
                    .collect(),
            );
        },
    )
    .map_err(model_err)?;
    if !model.params.initialised.is_empty() {
        progress(&format!(
            "initialised: {}",
            model.params.initialised.join(", ")
        ));
    }
    let steps_per_epoch = train.len().div_ceil(options.batch.max(1));
    let total = ((steps_per_epoch as f64 * options.epochs).ceil() as usize).max(1);
    let steps = options.max_steps.map_or(total, |m| m.min(total));
    let schedule = Schedule {
        lr: options.lr,
        warmup: options.warmup,
        total_steps: total as u64,
        decay: Decay::Linear,
        power: 1.0,
    };
    schedule.validate().map_err(model_err)?;
    let mut optimizer = Optimizer::new(
        OptimizerConfig {
            rule: Rule::Adamw,
            ..OptimizerConfig::lamb()
        },
        model.params.vars(),
    )
    .map_err(model_err)?;
    let dropout = DropoutSource::new(options.seed);
    let started = std::time::Instant::now();
    let mut losses = Vec::with_capacity(steps);
    let mut order = Vec::new();
    for step in 0..steps {
        let epoch = step / steps_per_epoch;
        let within = step % steps_per_epoch;
        if within == 0 {
            order = shuffled(
                train.len(),
                options.seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37),
            );
        }
        let refs: Vec<&Encoded> = order
            [within * options.batch..((within + 1) * options.batch).min(train.len())]
            .iter()
            .map(|&i| &train[i])
            .collect();
        let (inputs, labels) = batch_tensors(&refs, &model.config, &options.device)?;
        let logits = model
            .model
            .forward(&inputs, Mode::Train(&dropout))
            .map_err(model_err)?;
        let l = loss::cross_entropy(&logits, &labels).map_err(model_err)?;
        let grads = l.backward().map_err(model_err)?;
        let grads = model
            .params
            .vars()
            .iter()
            .filter_map(|(n, v)| grads.get(v.as_tensor()).map(|g| (n.clone(), g.clone())))
            .collect();
        optimizer
            .step(&grads, schedule.lr_at(step as u64))
            .map_err(model_err)?;
        let value = l.to_scalar::<f32>().map_err(model_err)? as f64;
        losses.push(value);
        if (step + 1) % 20 == 0 || step + 1 == steps {
            progress(&format!(
                "step {}/{steps} loss {value:.4} lr {:.2e} ({:.1} s)",
                step + 1,
                schedule.lr_at(step as u64),
                started.elapsed().as_secs_f64()
            ));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let dev_eval = evaluate(task, &model, &dev, &options.device)?;
    if let Some(out) = &options.output {
        save(&model, out, DType::F32).map_err(model_err)?;
        std::fs::copy(&vocab, out.join("vocab.txt")).map_err(|e| crate::TaskError::Io {
            path: out.join("vocab.txt"),
            source: e,
        })?;
    }
    let tenth = (losses.len() / 10).max(1);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
    Ok(FinetuneReport {
        steps,
        train_examples: train.len(),
        train_loss: (
            mean(&losses[..tenth]),
            mean(&losses[losses.len() - tenth..]),
        ),
        dev: dev_eval,
        seconds,
    })
}
