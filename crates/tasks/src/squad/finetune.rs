//! SQuAD fine-tuning and prediction.
//!
//! Training (as Google's `run_squad.py`): features from [`crate::squad::features`], the QA head
//! on every token (initialised when the checkpoint has none), loss = mean of the start and end
//! cross-entropies against the target positions (`[CLS]` when the answer is not in the window
//! or the question is impossible), the shared loop of [`crate::training`]. Unlike Google's
//! script, padding positions are masked out of the softmax (batches pad to their longest
//! feature, so the loss does not depend on how much padding a batch has).
//!
//! Prediction: features sorted by length and run in batches (frozen weights: fused kernels),
//! logits of the real tokens, then [`crate::squad::postprocess`]. Files written into the output
//! folder, each whole or not at all: `predictions.json` (`{id: answer}`, the official format),
//! `nbest_predictions.json`, and for v2.0 `null_odds.json` (null score − best answer score; give
//! it to the v2.0 evaluation as the no-answer probabilities to find the best threshold).

use std::path::{Path, PathBuf};
use std::time::Instant;

use bertkit_model::bert::{BertForQuestionAnswering, Loaded, load_frozen, load_with};
use bertkit_model::{Mode, loss};
use bertkit_tokenizer::FullTokenizer;
use bertkit_train::run_folder;
use candle_core::{DType, Device, Tensor};

use crate::TaskError;
use crate::batch::pad;
use crate::model_dir::{load_tokenizer, resolve, save_finetuned, tokenizer_files};
use crate::squad::data::Dataset;
use crate::squad::features::{Examples, Feature, FeatureOptions, build_features, read_examples};
use crate::squad::postprocess::{FeatureLogits, PostprocessOptions, Prediction, predict};
use crate::training::{TrainLog, TrainSettings, Watch, checkpoints_of, train};
use bertkit_train::step::GradientReducer;

/// Start/end logits of every feature (unpadded), `batch` features per forward pass, shortest
/// first, the batches shared out among the `reducer`'s ranks and the logits merged on every
/// rank; `progress` hears a line every 20 batches.
pub fn feature_logits(
    model: &Loaded<BertForQuestionAnswering>,
    features: &[Feature],
    batch: usize,
    device: &Device,
    reducer: &dyn GradientReducer,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<FeatureLogits>, TaskError> {
    let mut order: Vec<usize> = (0..features.len()).collect();
    order.sort_by_key(|&i| features[i].input_ids.len());
    let mut out: Vec<Option<FeatureLogits>> = vec![None; features.len()];
    let batches = order.len().div_ceil(batch.max(1));
    let started = Instant::now();
    let ranks = reducer.ranks();
    for (b, chunk) in order.chunks(batch.max(1)).enumerate() {
        if !ranks.owns(b) {
            continue;
        }
        let seqs: Vec<(&[u32], &[u32])> = chunk.iter().map(|&i| features[i].sequence()).collect();
        let (inputs, _) = pad(&seqs, &model.config, device)?;
        let (start, end) = model.model.forward(&inputs, Mode::Eval)?;
        let rows = |t: Tensor| -> Result<Vec<Vec<f32>>, TaskError> {
            Ok(t.to_dtype(DType::F32)?.to_vec2::<f32>()?)
        };
        let (start, end) = (rows(start)?, rows(end)?);
        for ((&i, s), e) in chunk.iter().zip(start).zip(end) {
            let n = features[i].input_ids.len();
            out[i] = Some(FeatureLogits {
                start: s[..n].to_vec(),
                end: e[..n].to_vec(),
            });
        }
        if (b + 1) % 20 == 0 || b + 1 == batches {
            progress(&format!(
                "predicted {}/{batches} batches ({:.1} s)",
                b + 1,
                started.elapsed().as_secs_f64()
            ));
        }
    }
    if ranks.world_size > 1 {
        merge_logits(&mut out, features, reducer)?;
    }
    Ok(out
        .into_iter()
        .map(|l| l.expect("every feature was run"))
        .collect())
}

/// Every rank's logits in one table (start then end of each feature, in feature order; zeros
/// where another rank ran the feature), summed over the ranks: the whole table on each.
fn merge_logits(
    out: &mut [Option<FeatureLogits>],
    features: &[Feature],
    reducer: &dyn GradientReducer,
) -> Result<(), TaskError> {
    let lengths: Vec<usize> = features.iter().map(|f| f.input_ids.len()).collect();
    let mut table = vec![0f64; 2 * lengths.iter().sum::<usize>()];
    let mut at = 0;
    for (logits, &n) in out.iter().zip(&lengths) {
        if let Some(l) = logits {
            for (slot, &v) in table[at..at + 2 * n]
                .iter_mut()
                .zip(l.start.iter().chain(&l.end))
            {
                *slot = f64::from(v);
            }
        }
        at += 2 * n;
    }
    reducer.all_reduce_sum_host(&mut table)?;
    let mut at = 0;
    for (logits, &n) in out.iter_mut().zip(&lengths) {
        let row: Vec<f32> = table[at..at + 2 * n].iter().map(|&v| v as f32).collect();
        *logits = Some(FeatureLogits {
            start: row[..n].to_vec(),
            end: row[n..].to_vec(),
        });
        at += 2 * n;
    }
    Ok(())
}

/// Windows per forward pass when predicting, unless asked otherwise.
pub const DEFAULT_PREDICT_BATCH: usize = 32;

/// Prediction settings.
#[derive(Debug, Clone)]
pub struct PredictOptions {
    /// Window settings (as in training).
    pub features: FeatureOptions,
    /// n-best, answer length, casing, v2.0 and null threshold.
    pub postprocess: PostprocessOptions,
    /// Features per forward pass.
    pub batch: usize,
    /// Device.
    pub device: Device,
}

/// What a prediction run did.
#[derive(Debug, Clone)]
pub struct PredictReport {
    /// Questions answered.
    pub examples: usize,
    /// Windows run through the model.
    pub features: usize,
    /// Seconds in the model (forward passes).
    pub model_seconds: f64,
    /// The predictions, in file order.
    pub predictions: Vec<Prediction>,
    /// The files written.
    pub files: Vec<PathBuf>,
}

/// `{"key": value, …}` with one entry per line and 4-space indentation (as run_squad writes),
/// keeping the given order.
fn ordered_json(entries: impl Iterator<Item = (String, serde_json::Value)>) -> String {
    let mut out = String::from("{\n");
    let mut first = true;
    for (k, v) in entries {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        out.push_str("    ");
        out.push_str(&serde_json::Value::String(k).to_string());
        out.push_str(": ");
        out.push_str(&v.to_string());
    }
    out.push_str("\n}\n");
    out
}

fn write(path: PathBuf, text: &str, files: &mut Vec<PathBuf>) -> Result<(), TaskError> {
    bertkit_stage_io::write_atomically(&path, text.as_bytes()).map_err(|e| TaskError::Io {
        path: path.clone(),
        source: e,
    })?;
    files.push(path);
    Ok(())
}

/// Writes `predictions.json`, `nbest_predictions.json` and (v2.0) `null_odds.json` into
/// `dir`.
pub fn write_predictions(
    predictions: &[Prediction],
    dir: &Path,
) -> Result<Vec<PathBuf>, TaskError> {
    std::fs::create_dir_all(dir).map_err(|e| TaskError::Io {
        path: dir.into(),
        source: e,
    })?;
    let mut files = Vec::new();
    let answers = ordered_json(
        predictions
            .iter()
            .map(|p| (p.id.clone(), serde_json::Value::String(p.text.clone()))),
    );
    write(dir.join("predictions.json"), &answers, &mut files)?;
    let n_best = ordered_json(predictions.iter().map(|p| {
        let list: Vec<serde_json::Value> = p
            .n_best
            .iter()
            .map(|c| {
                serde_json::json!({
                    "text": c.text,
                    "probability": c.probability,
                    "start_logit": c.start_logit,
                    "end_logit": c.end_logit,
                })
            })
            .collect();
        (p.id.clone(), serde_json::Value::Array(list))
    }));
    write(dir.join("nbest_predictions.json"), &n_best, &mut files)?;
    if predictions.iter().any(|p| p.null_score_diff.is_some()) {
        let odds = ordered_json(predictions.iter().map(|p| {
            let v = p.null_score_diff.unwrap_or(f64::INFINITY);
            // JSON has no infinity: a question with only "no answer" gets a large number.
            let v = if v.is_finite() { v } else { 1e9 };
            (p.id.clone(), serde_json::json!(v))
        }));
        write(dir.join("null_odds.json"), &odds, &mut files)?;
    }
    Ok(files)
}

/// Predicts answers for every question of `dataset` with `model`, writing the prediction
/// files into `output` when given. With several ranks the forward passes are shared out and
/// every rank gets the whole result; give `output` on one rank.
pub fn predict_dataset(
    model: &Loaded<BertForQuestionAnswering>,
    tokenizer: &FullTokenizer,
    dataset: &Dataset,
    options: &PredictOptions,
    output: Option<&Path>,
    reducer: &dyn GradientReducer,
    progress: &mut dyn FnMut(&str),
) -> Result<PredictReport, TaskError> {
    let examples: Examples = read_examples(dataset, false, options.postprocess.version_2)?;
    let features = build_features(&examples, tokenizer, &options.features, false)?;
    progress(&format!(
        "{} questions, {} windows",
        examples.examples.len(),
        features.len()
    ));
    let started = Instant::now();
    let logits = feature_logits(
        model,
        &features,
        options.batch,
        &options.device,
        reducer,
        progress,
    )?;
    let model_seconds = started.elapsed().as_secs_f64();
    let predictions = predict(
        &examples,
        &features,
        &logits,
        tokenizer,
        &options.postprocess,
    );
    let files = match output {
        Some(dir) => write_predictions(&predictions, dir)?,
        None => Vec::new(),
    };
    Ok(PredictReport {
        examples: examples.examples.len(),
        features: features.len(),
        model_seconds,
        predictions,
        files,
    })
}

/// Loads a fine-tuned QA model for prediction (frozen weights).
pub fn load_for_prediction(
    dir: &Path,
    dtype: DType,
    device: &Device,
) -> Result<Loaded<BertForQuestionAnswering>, TaskError> {
    let dir = &resolve(dir)?;
    let model = load_frozen::<BertForQuestionAnswering>(dir, dtype, device)?;
    if !model.params.initialised.is_empty() {
        return Err(TaskError::Format {
            path: dir.into(),
            message: format!(
                "not a question-answering model: it lacks {} (fine-tune it first: bertkit \
                 finetune squad)",
                model.params.initialised.join(", ")
            ),
        });
    }
    Ok(model)
}

/// Fine-tuning settings.
#[derive(Debug, Clone)]
pub struct SquadFinetuneOptions {
    /// Model folder (config.json, model.safetensors, vocab.txt).
    pub model: PathBuf,
    /// Training data.
    pub train: Dataset,
    /// Where the fine-tuned model (and vocab.txt) goes.
    pub output: PathBuf,
    /// The training loop.
    pub settings: TrainSettings,
    /// What to do with an earlier run in `output`: refuse it, resume it from its newest
    /// checkpoint, or move it aside.
    pub earlier: bertkit_train::run_folder::EarlierRun,
    /// Windows, post-processing, prediction batch, device.
    pub predict: PredictOptions,
    /// Weights dtype (f32; bf16 or f16 on CUDA with f32 master weights).
    pub dtype: DType,
    /// The data-parallel world ([`bertkit_train::distributed::join`]; `Local` for one
    /// process). Rank 0 alone saves the model.
    pub reducer: std::rc::Rc<dyn bertkit_train::step::GradientReducer>,
}

/// What fine-tuning did.
#[derive(Debug, Clone)]
pub struct SquadFinetuneReport {
    /// Training questions used.
    pub train_examples: usize,
    /// Training questions skipped (answer text not at its offset).
    pub skipped: usize,
    /// Training windows.
    pub train_features: usize,
    /// The loop's log.
    pub log: TrainLog,
}

/// Fine-tunes `options.model` on SQuAD and saves the result to `options.output`.
pub fn finetune(
    options: &SquadFinetuneOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<SquadFinetuneReport, TaskError> {
    // One writer per run folder, for the whole run (rank 0 writes it).
    let _lock = (options.reducer.ranks().rank == 0)
        .then(|| run_folder::take(&options.output, options.earlier, progress))
        .transpose()?;
    let lower_case = options.predict.postprocess.lower_case;
    let model_dir = resolve(&options.model)?;
    let tokenizer = load_tokenizer(&model_dir, lower_case)?;
    let saved_tokenizer = tokenizer_files(&model_dir, lower_case)?;
    let version_2 = options.predict.postprocess.version_2;
    let examples = read_examples(&options.train, true, version_2)?;
    let features = build_features(&examples, &tokenizer, &options.predict.features, true)?;
    progress(&format!(
        "{} training questions ({} skipped: answer not at its offset), {} windows",
        examples.examples.len(),
        examples.skipped.len(),
        features.len()
    ));
    let device = &options.predict.device;
    let mut model = load_with::<BertForQuestionAnswering>(
        &model_dir,
        options.dtype,
        device,
        options.settings.seed,
        &|_| {},
    )?;
    crate::training::settle_feed_forward(
        &mut model.model.bert,
        &model.config,
        (options.predict.features.max_seq_length, &options.settings),
        options.reducer.as_ref(),
        (options.dtype, device),
        progress,
    );
    let log = train(
        &model.params,
        features.len(),
        &options.settings,
        options.reducer.as_ref(),
        &mut |indices, mode, weight, step| {
            let seqs: Vec<(&[u32], &[u32])> =
                indices.iter().map(|&i| features[i].sequence()).collect();
            let (inputs, mask) = pad(&seqs, &model.config, device)?;
            let window = mask.dim(1)?;
            let positions = |pick: fn(&Feature) -> usize, name: &str| {
                let v: Vec<u32> = indices.iter().map(|&i| pick(&features[i]) as u32).collect();
                loss::labels(&v, window, name, device)
            };
            let starts = positions(|f| f.start_position, "start_positions")?;
            let ends = positions(|f| f.end_position, "end_positions")?;
            let qa = &model.model;
            step.through_encoder(&qa.bert, &inputs, mode, 0, |top, _| {
                let (start, end) = qa.head(top, &inputs)?;
                Ok((qa_loss(&start, &end, &mask, &starts, &ends)? * weight)?)
            })?;
            Ok(())
        },
        Watch {
            dir: Some(&options.output),
            after_epoch: None,
            checkpoints: Some(checkpoints_of(
                &model,
                saved_tokenizer.clone(),
                options.earlier,
            )),
        },
        progress,
    )?;
    if options.reducer.ranks().rank == 0 {
        save_finetuned(&model, &saved_tokenizer, &options.output)?;
    }
    // Every rank waits here until rank 0 has saved the model, which prediction loads next.
    options.reducer.all_reduce_sum_host(&mut [0.0])?;
    Ok(SquadFinetuneReport {
        train_examples: examples.examples.len(),
        skipped: examples.skipped.len(),
        train_features: features.len(),
        log,
    })
}

/// The span loss: mean of the start and end cross-entropies, padding (`mask` 0) excluded.
pub fn qa_loss(
    start: &Tensor,
    end: &Tensor,
    mask: &Tensor,
    starts: &Tensor,
    ends: &Tensor,
) -> candle_core::Result<Tensor> {
    // In f32 (f64 for f64 models); 0 for tokens, -10000 for padding (exp underflows to 0).
    let dtype = if start.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let bias = ((mask.to_dtype(dtype)? - 1.0)? * 10_000.0)?;
    let masked = |t: &Tensor| t.to_dtype(dtype)?.add(&bias);
    let s = loss::cross_entropy(&masked(start)?, starts)?;
    let e = loss::cross_entropy(&masked(end)?, ends)?;
    (s + e)? * 0.5
}
