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

use bertkit_model::bert::{BertForSequenceClassification, Loaded, load_with};
use bertkit_model::{Inputs, Mode, loss};
use bertkit_tokenizer::FullTokenizer;
use bertkit_train::run_folder;
use bertkit_train::step::GradientReducer;
use candle_core::{DType, Device, Tensor};

use crate::model_dir::{load_tokenizer, resolve, save_finetuned, tokenizer_files};
use crate::training::{TrainSettings, Watch, checkpoints_of, train};

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

/// Reads and encodes a labelled task file.
fn encode_file(
    task: Task,
    tokenizer: &FullTokenizer,
    path: &Path,
    max_seq_length: usize,
) -> Result<Vec<Encoded>, crate::TaskError> {
    read(task, path)?
        .iter()
        .map(|e| encode(tokenizer, e, max_seq_length))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|m| crate::TaskError::Format {
            path: path.into(),
            message: m,
        })
}

/// The longest encoded GLUE sequence unless asked otherwise (`run_classifier.py`'s).
pub const DEFAULT_MAX_SEQ_LENGTH: usize = 128;

/// Sequences per forward pass when predicting, unless asked otherwise.
pub const DEFAULT_PREDICT_BATCH: usize = 64;

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
    /// The training loop's settings (the seed also initialises the head).
    pub settings: TrainSettings,
    /// What to do with an earlier run in `output`: refuse it, resume it from its newest
    /// checkpoint, or move it aside.
    pub earlier: bertkit_train::run_folder::EarlierRun,
    /// Longest encoded sequence.
    pub max_seq_length: usize,
    /// Uncased vocabulary.
    pub lower_case: bool,
    /// Weights dtype (f32; bf16 or f16 on CUDA, with f32 master weights).
    pub dtype: DType,
    /// Device.
    pub device: Device,
    /// The data-parallel world ([`bertkit_train::distributed::join`]; `Local` for one
    /// process). Rank 0 alone saves the model.
    pub reducer: std::rc::Rc<dyn bertkit_train::step::GradientReducer>,
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
    /// The predicted class of each example, in order.
    pub predictions: Vec<usize>,
}

/// What a fine-tuning run did.
#[derive(Debug, Clone)]
pub struct FinetuneReport {
    /// The step training started after (0, or the checkpoint it resumed from).
    pub started_at: usize,
    /// The step it ended at.
    pub steps: usize,
    /// Training examples.
    pub train_examples: usize,
    /// Mean training loss of the first and last 10% of the steps this run ran (`None`: it ran
    /// none, resuming a finished run).
    pub train_loss: Option<(f64, f64)>,
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
    let seqs: Vec<(&[u32], &[u32])> = batch
        .iter()
        .map(|e| (e.ids.as_slice(), e.segments.as_slice()))
        .collect();
    let (inputs, _) = crate::batch::pad(&seqs, config, device)?;
    let labels: Vec<u32> = batch.iter().map(|e| e.label as u32).collect();
    let labels = bertkit_model::loss::labels(&labels, config.num_labels(), "labels", device)?;
    Ok((inputs, labels))
}

/// Scores `model` on `examples`.
pub fn evaluate(
    task: Task,
    model: &Loaded<BertForSequenceClassification>,
    examples: &[Encoded],
    batch: usize,
    device: &Device,
    reducer: &dyn GradientReducer,
) -> Result<Evaluation, crate::TaskError> {
    // Batches are dealt to the ranks round-robin; each fills its batches' loss sums and
    // predictions into its copy of one table and the sum over the ranks (each slot written
    // by one rank, zeros elsewhere) is the whole table on every rank.
    let chunks: Vec<&[Encoded]> = examples.chunks(batch.max(1)).collect();
    let mut table = vec![0f64; chunks.len() + examples.len()];
    let (loss_sums, predicted) = table.split_at_mut(chunks.len());
    let ranks = reducer.ranks();
    for (c, chunk) in chunks.iter().enumerate() {
        if !ranks.owns(c) {
            continue;
        }
        let refs: Vec<&Encoded> = chunk.iter().collect();
        let (inputs, labels) = batch_tensors(&refs, &model.config, device)?;
        let logits = model.model.forward(&inputs, Mode::Eval)?;
        let nll = loss::nll_per_row(&logits, &labels)?;
        loss_sums[c] = nll
            .to_dtype(DType::F64)
            .and_then(|t| t.sum_all())
            .and_then(|t| t.to_scalar::<f64>())?;
        let p: Vec<u32> = logits.argmax(1).and_then(|t| t.to_vec1())?;
        let first = c * batch.max(1);
        for (slot, p) in predicted[first..first + p.len()].iter_mut().zip(p) {
            *slot = f64::from(p);
        }
    }
    reducer.all_reduce_sum_host(&mut table)?;
    let (loss_sums, predicted) = table.split_at(chunks.len());
    let loss_sum: f64 = loss_sums.iter().sum();
    let predictions: Vec<usize> = predicted.iter().map(|&p| p as usize).collect();
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
        predictions,
    })
}

/// Fine-tunes and evaluates; `progress` hears a line now and then.
pub fn finetune(
    options: &FinetuneOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<FinetuneReport, crate::TaskError> {
    let task = options.task;
    // One writer per run folder, for the whole run (rank 0 writes it).
    let _lock = match &options.output {
        Some(dir) if options.reducer.ranks().rank == 0 => {
            Some(run_folder::take(dir, options.earlier, progress)?)
        }
        _ => None,
    };
    let model_dir = resolve(&options.model)?;
    let tokenizer = load_tokenizer(&model_dir, options.lower_case)?;
    let saved_tokenizer = tokenizer_files(&model_dir, options.lower_case)?;
    let encode_all = |path: &Path| encode_file(task, &tokenizer, path, options.max_seq_length);
    let train_set = encode_all(&options.data.join("train.tsv"))?;
    let dev = encode_all(&options.data.join(task.dev_file()))?;
    let labels = task.labels();
    let mut model = load_with::<BertForSequenceClassification>(
        &model_dir,
        options.dtype,
        &options.device,
        options.settings.seed,
        &|c| {
            c.id2label = Some(
                labels
                    .iter()
                    .enumerate()
                    .map(|(i, l)| (i.to_string(), l.to_string()))
                    .collect(),
            );
        },
    )?;
    crate::training::settle_feed_forward(
        &mut model.model.bert,
        &model.config,
        (options.max_seq_length, &options.settings),
        options.reducer.as_ref(),
        (options.dtype, &options.device),
        progress,
    );
    // The dev set after every epoch (and after the last step): logged, and the last one is
    // the report's.
    let evaluate_dev = || {
        evaluate(
            task,
            &model,
            &dev,
            64,
            &options.device,
            options.reducer.as_ref(),
        )
    };
    let mut last_dev: Option<Evaluation> = None;
    let mut dev_after_epoch = || -> Result<Vec<(String, f64)>, crate::TaskError> {
        let e = evaluate_dev()?;
        let mut figures = vec![("loss".to_string(), e.loss)];
        figures.extend(e.metrics.iter().cloned());
        last_dev = Some(e);
        Ok(figures)
    };
    let log = train(
        &model.params,
        train_set.len(),
        &options.settings,
        options.reducer.as_ref(),
        &mut |indices, mode, weight, step| {
            let refs: Vec<&Encoded> = indices.iter().map(|&i| &train_set[i]).collect();
            let (inputs, labels) = batch_tensors(&refs, &model.config, &options.device)?;
            let classifier = &model.model;
            step.through_encoder(&classifier.bert, &inputs, mode, 0, |top, _| {
                let logits = classifier.head(top, &inputs, mode)?;
                Ok((loss::cross_entropy(&logits, &labels)? * weight)?)
            })?;
            Ok(())
        },
        Watch {
            dir: options.output.as_deref(),
            after_epoch: Some(&mut dev_after_epoch),
            checkpoints: options
                .output
                .is_some()
                .then(|| checkpoints_of(&model, saved_tokenizer.clone(), options.earlier)),
        },
        progress,
    )?;
    let dev_eval = match last_dev {
        Some(e) => e,
        // No step ran (max_steps 0): the model as loaded.
        None => evaluate_dev()?,
    };
    if let Some(out) = &options.output
        && options.reducer.ranks().rank == 0
    {
        save_finetuned(&model, &saved_tokenizer, out)?;
    }
    Ok(FinetuneReport {
        started_at: log.started_at,
        steps: log.steps,
        train_examples: train_set.len(),
        train_loss: log.first_and_last_tenth(),
        dev: dev_eval,
        seconds: log.seconds,
    })
}

/// What to predict with a fine-tuned classifier.
#[derive(Debug, Clone)]
pub struct GluePredictOptions {
    /// The task.
    pub task: Task,
    /// The fine-tuned model folder.
    pub model: PathBuf,
    /// A labelled task file.
    pub data: PathBuf,
    /// Where `index<TAB>prediction` rows go (label names, the GLUE submission format).
    pub output: Option<PathBuf>,
    /// Longest encoded sequence.
    pub max_seq_length: usize,
    /// Uncased vocabulary.
    pub lower_case: bool,
    /// Sequences per forward pass.
    pub batch: usize,
    /// Device.
    pub device: Device,
}

/// Predicts and scores a labelled GLUE file with a fine-tuned model (frozen weights).
pub fn predict_file(options: &GluePredictOptions) -> Result<Evaluation, crate::TaskError> {
    let GluePredictOptions {
        task,
        model,
        data,
        output,
        ..
    } = options;
    let task = *task;
    let model_dir = &resolve(model)?;
    let tokenizer = load_tokenizer(model_dir, options.lower_case)?;
    let model = bertkit_model::bert::load_frozen::<BertForSequenceClassification>(
        model_dir,
        DType::F32,
        &options.device,
    )?;
    if !model.params.initialised.is_empty() || model.config.num_labels() != task.labels().len() {
        return Err(crate::TaskError::Format {
            path: model_dir.into(),
            message: format!(
                "not a {} classifier ({} labels{}): fine-tune it first (bertkit finetune glue)",
                task.folder(),
                model.config.num_labels(),
                if model.params.initialised.is_empty() {
                    String::new()
                } else {
                    format!(", no {}", model.params.initialised.join(", "))
                }
            ),
        });
    }
    let encoded = encode_file(task, &tokenizer, data, options.max_seq_length)?;
    let evaluation = evaluate(
        task,
        &model,
        &encoded,
        options.batch,
        &options.device,
        &bertkit_train::step::Local,
    )?;
    if let Some(out) = output {
        let mut text = String::from("index\tprediction\n");
        for (i, p) in evaluation.predictions.iter().enumerate() {
            text.push_str(&format!("{i}\t{}\n", task.labels()[*p]));
        }
        bertkit_stage_io::write_atomically(out, text.as_bytes()).map_err(|e| {
            crate::TaskError::Io {
                path: out.into(),
                source: e,
            }
        })?;
    }
    Ok(evaluation)
}
