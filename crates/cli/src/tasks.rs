//! The task commands: `evaluate`, `finetune`, `predict` and `split` (SQuAD and GLUE).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bertkit_tasks::glue::data::Task;
use bertkit_tasks::squad::data::Dataset;
use bertkit_tasks::squad::features::FeatureOptions;
use bertkit_tasks::squad::finetune::{self as squad, PredictOptions};
use bertkit_tasks::squad::postprocess::PostprocessOptions;
use bertkit_tasks::training::TrainSettings;
use clap::{Args, Subcommand};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Subcommand)]
pub enum EvaluateCommand {
    /// SQuAD: v1.1 prints {"exact_match": …, "f1": …} exactly as evaluate-v1.1.py; v2.0 (a
    /// "v2.0" data file, or --version-2) prints what evaluate-v2.0.py prints.
    Squad(EvaluateSquadArgs),
}

#[derive(Args)]
pub struct EvaluateSquadArgs {
    /// The SQuAD JSON the predictions answer (dev-v1.1.json, dev-v2.0.json).
    #[arg(long)]
    data: PathBuf,
    /// Predictions: a JSON object {question id: answer text}.
    #[arg(long)]
    predictions: PathBuf,
    /// Score as SQuAD v2.0 even if the data file does not say "v2.0".
    #[arg(long)]
    version_2: bool,
    /// v2.0: no-answer probabilities (or run_squad's null_odds.json), {question id: number};
    /// adds best_exact/best_f1 and their thresholds.
    #[arg(long)]
    na_prob_file: Option<PathBuf>,
    /// v2.0: predict "no answer" when the probability exceeds this.
    #[arg(long, default_value_t = 1.0)]
    na_prob_thresh: f64,
}

/// The training-loop flags shared by the fine-tuning commands.
#[derive(Args)]
pub struct TrainFlags {
    /// Passes over the training set.
    #[arg(long)]
    epochs: Option<f64>,
    /// Peak learning rate (AdamW, linear warmup and decay).
    #[arg(long)]
    lr: Option<f64>,
    /// Examples per optimiser step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Micro-batches per step (gradient accumulation: batch / accumulation examples per pass).
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    /// Share of steps warming up.
    #[arg(long, default_value_t = 0.1)]
    warmup: f64,
    /// Stop after this many steps (the schedule still spans every epoch).
    #[arg(long)]
    max_steps: Option<usize>,
    /// Shuffling, dropout and head initialisation.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Cased vocabulary.
    #[arg(long)]
    cased: bool,
    /// Weights dtype: f32, or bf16/f16 on CUDA (f32 master weights; f16 scales the loss).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
}

impl TrainFlags {
    fn settings(&self, epochs: f64, lr: f64) -> TrainSettings {
        TrainSettings {
            epochs: self.epochs.unwrap_or(epochs),
            lr: self.lr.unwrap_or(lr),
            batch: self.batch,
            accumulation: self.accumulation,
            warmup: self.warmup,
            seed: self.seed,
            max_steps: self.max_steps,
        }
    }
}

#[derive(Subcommand)]
pub enum FinetuneCommand {
    /// GLUE: MRPC, CoLA, SST-2 or MNLI (train.tsv, then the dev set's metrics).
    Glue(FinetuneGlueArgs),
    /// SQuAD v1.1/v2.0: fine-tune, then (with --dev) predict and score the dev set.
    Squad(FinetuneSquadArgs),
}

#[derive(Args)]
pub struct FinetuneGlueArgs {
    /// mrpc, cola, sst-2 or mnli.
    #[arg(long)]
    task: String,
    /// Model folder: config.json, model.safetensors, vocab.txt.
    #[arg(long)]
    model: PathBuf,
    /// The task folder in the GLUE layout (train.tsv, dev.tsv), e.g. glue_data/MRPC.
    #[arg(long)]
    data: PathBuf,
    /// Where the fine-tuned model goes.
    #[arg(long, short)]
    output: Option<PathBuf>,
    /// Longest encoded sequence.
    #[arg(long, default_value_t = 128)]
    max_seq_length: usize,
    #[command(flatten)]
    train: TrainFlags,
}

/// SQuAD windowing and answer-extraction flags.
#[derive(Args)]
pub struct SquadFlags {
    /// SQuAD 2.0: questions may have no answer.
    #[arg(long)]
    version_2: bool,
    /// Longest window, in tokens.
    #[arg(long, default_value_t = 384)]
    max_seq_length: usize,
    /// Step between windows over a long context.
    #[arg(long, default_value_t = 128)]
    doc_stride: usize,
    /// Longest question, in tokens.
    #[arg(long, default_value_t = 64)]
    max_query_length: usize,
    /// Answers considered per question.
    #[arg(long, default_value_t = 20)]
    n_best: usize,
    /// Longest answer, in tokens.
    #[arg(long, default_value_t = 30)]
    max_answer_length: usize,
    /// v2.0: answer "" when the null score beats the best answer by more than this.
    #[arg(long, default_value_t = 0.0)]
    null_score_diff_threshold: f64,
    /// Windows per forward pass when predicting.
    #[arg(long, default_value_t = 32)]
    predict_batch: usize,
}

impl SquadFlags {
    fn options(&self, lower_case: bool, device: candle_core::Device) -> PredictOptions {
        PredictOptions {
            features: FeatureOptions {
                max_seq_length: self.max_seq_length,
                doc_stride: self.doc_stride,
                max_query_length: self.max_query_length,
            },
            postprocess: PostprocessOptions {
                n_best: self.n_best,
                max_answer_length: self.max_answer_length,
                lower_case,
                version_2: self.version_2,
                null_score_diff_threshold: self.null_score_diff_threshold,
            },
            batch: self.predict_batch,
            device,
        }
    }
}

#[derive(Args)]
pub struct FinetuneSquadArgs {
    /// Model folder: config.json, model.safetensors, vocab.txt.
    #[arg(long)]
    model: PathBuf,
    /// Training data (train-v1.1.json, or the train half of `bertkit split squad`).
    #[arg(long)]
    train: PathBuf,
    /// Dev data: predicted and scored after training.
    #[arg(long)]
    dev: Option<PathBuf>,
    /// Where the fine-tuned model goes; dev predictions go to OUTPUT/predictions/.
    #[arg(long, short)]
    output: PathBuf,
    #[command(flatten)]
    squad: SquadFlags,
    #[command(flatten)]
    train_flags: TrainFlags,
}

#[derive(Subcommand)]
pub enum PredictCommand {
    /// SQuAD: predictions.json, nbest_predictions.json (and null_odds.json for v2.0).
    Squad(PredictSquadArgs),
    /// GLUE: `index<TAB>prediction` rows for a labelled file, and its metrics.
    Glue(PredictGlueArgs),
}

#[derive(Args)]
pub struct PredictSquadArgs {
    /// A fine-tuned question-answering model folder.
    #[arg(long)]
    model: PathBuf,
    /// SQuAD JSON with the questions.
    #[arg(long)]
    data: PathBuf,
    /// Folder for the prediction files.
    #[arg(long, short)]
    output: PathBuf,
    /// Also score the predictions against the data's answers.
    #[arg(long)]
    evaluate: bool,
    /// Cased vocabulary.
    #[arg(long)]
    cased: bool,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    squad: SquadFlags,
}

#[derive(Args)]
pub struct PredictGlueArgs {
    /// mrpc, cola, sst-2 or mnli.
    #[arg(long)]
    task: String,
    /// A fine-tuned classifier folder (bertkit finetune glue --output).
    #[arg(long)]
    model: PathBuf,
    /// A labelled task file, e.g. glue_data/MRPC/dev.tsv.
    #[arg(long)]
    data: PathBuf,
    /// Where the `index<TAB>prediction` rows go.
    #[arg(long, short)]
    output: Option<PathBuf>,
    /// Longest encoded sequence.
    #[arg(long, default_value_t = 128)]
    max_seq_length: usize,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Cased vocabulary.
    #[arg(long)]
    cased: bool,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Subcommand)]
pub enum SplitCommand {
    /// The first N articles to one file, the rest to another (offline runs on SQuAD dev:
    /// train on the first 38 articles of dev-v1.1.json, evaluate on the last 10).
    Squad(SplitSquadArgs),
}

#[derive(Args)]
pub struct SplitSquadArgs {
    /// The SQuAD JSON to split.
    #[arg(long)]
    input: PathBuf,
    /// Articles in the first (training) part.
    #[arg(long, default_value_t = 38)]
    train_articles: usize,
    /// Folder for train.json and dev.json.
    #[arg(long, short)]
    output: PathBuf,
}

pub fn evaluate(command: EvaluateCommand) -> Result<()> {
    let EvaluateCommand::Squad(args) = command;
    let dataset = Dataset::load(&args.data)?;
    let predictions = bertkit_tasks::squad::eval::read_predictions(&args.predictions)?;
    let scores = score_squad(
        &dataset,
        &predictions,
        args.version_2,
        args.na_prob_file.as_deref(),
        args.na_prob_thresh,
    )?;
    println!("{scores}");
    Ok(())
}

/// The official script's output for `predictions`: v2.0 when asked or when the data file says
/// so (with no-answer probabilities from `na_prob_file`), else v1.1.
fn score_squad(
    dataset: &Dataset,
    predictions: &HashMap<String, String>,
    version_2: bool,
    na_prob_file: Option<&Path>,
    na_prob_thresh: f64,
) -> Result<String> {
    if version_2 || dataset.version.starts_with("v2") || dataset.version.starts_with('2') {
        let na_probs = match na_prob_file {
            Some(path) => Some(bertkit_tasks::squad::eval_v2::read_na_probs(path)?),
            None => None,
        };
        let scores = bertkit_tasks::squad::eval_v2::evaluate_v2(
            dataset,
            predictions,
            na_probs.as_deref(),
            na_prob_thresh,
        );
        for id in &scores.unanswered {
            eprintln!("Missing prediction for {id} (scored 0)");
        }
        return Ok(scores.to_json());
    }
    if dataset.version != "1.1" {
        eprintln!(
            "Evaluation expects v-1.1, but got dataset with v-{}",
            dataset.version
        );
    }
    let scores = bertkit_tasks::squad::eval::evaluate(dataset, predictions);
    for id in &scores.unanswered {
        eprintln!("Unanswered question {id} will receive score 0.");
    }
    Ok(scores.to_json())
}

pub fn finetune(command: FinetuneCommand) -> Result<()> {
    match command {
        FinetuneCommand::Glue(args) => finetune_glue(args),
        FinetuneCommand::Squad(args) => finetune_squad(args),
    }
}

fn finetune_glue(args: FinetuneGlueArgs) -> Result<()> {
    let task = Task::parse(&args.task)?;
    let data = args.data;
    let options = bertkit_tasks::glue::finetune::FinetuneOptions {
        task,
        model: args.model,
        data,
        output: args.output.clone(),
        settings: args.train.settings(3.0, 2e-5),
        max_seq_length: args.max_seq_length,
        lower_case: !args.train.cased,
        dtype: bertkit_model::parse_dtype(&args.train.dtype)?,
        device: bertkit_model::parse_device(&args.train.device)?,
    };
    let report =
        bertkit_tasks::glue::finetune::finetune(&options, &mut |line| eprintln!("{line}"))?;
    let metrics: Vec<String> = report
        .dev
        .metrics
        .iter()
        .map(|(k, v)| format!("{k} {v:.4}"))
        .collect();
    println!(
        "{}: {} steps on {} examples in {:.1} s (train loss {:.4} -> {:.4}); dev ({} examples): loss {:.4}, {}",
        task.folder(),
        report.steps,
        report.train_examples,
        report.seconds,
        report.train_loss.0,
        report.train_loss.1,
        report.dev.examples,
        report.dev.loss,
        metrics.join(", ")
    );
    if let Some(out) = args.output {
        println!("model: {}", out.display());
    }
    Ok(())
}

fn finetune_squad(args: FinetuneSquadArgs) -> Result<()> {
    let lower_case = !args.train_flags.cased;
    let device = bertkit_model::parse_device(&args.train_flags.device)?;
    let options = squad::SquadFinetuneOptions {
        model: args.model.clone(),
        train: Dataset::load(&args.train)?,
        output: args.output.clone(),
        settings: args.train_flags.settings(2.0, 3e-5),
        predict: args.squad.options(lower_case, device.clone()),
        dtype: bertkit_model::parse_dtype(&args.train_flags.dtype)?,
    };
    let report = squad::finetune(&options, &mut |line| eprintln!("{line}"))?;
    let (first, last) = report.log.first_and_last_tenth();
    println!(
        "squad: {} steps on {} windows ({} questions, {} skipped) in {:.1} s (train loss {first:.4} -> {last:.4}{})",
        report.log.steps,
        report.train_features,
        report.train_examples,
        report.skipped,
        report.log.seconds,
        if report.log.skipped > 0 {
            format!(", {} fp16 steps skipped", report.log.skipped)
        } else {
            String::new()
        }
    );
    println!("model: {}", args.output.display());
    if let Some(dev) = &args.dev {
        predict_squad(PredictSquadArgs {
            model: args.output.clone(),
            data: dev.clone(),
            output: args.output.join("predictions"),
            evaluate: true,
            cased: args.train_flags.cased,
            dtype: "f32".into(),
            device: args.train_flags.device.clone(),
            squad: args.squad,
        })?;
    }
    Ok(())
}

pub fn predict(command: PredictCommand) -> Result<()> {
    match command {
        PredictCommand::Squad(args) => predict_squad(args),
        PredictCommand::Glue(args) => predict_glue(args),
    }
}

fn predict_squad(args: PredictSquadArgs) -> Result<()> {
    let device = bertkit_model::parse_device(&args.device)?;
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let model = squad::load_for_prediction(&args.model, dtype, &device)?;
    let tokenizer = bertkit_tasks::model_dir::load_tokenizer(&args.model, !args.cased)?;
    let dataset = Dataset::load(&args.data)?;
    let options = args.squad.options(!args.cased, device);
    let report = squad::predict_dataset(
        &model,
        &tokenizer,
        &dataset,
        &options,
        Some(&args.output),
        &mut |line| eprintln!("{line}"),
    )?;
    println!(
        "predicted {} questions ({} windows) in {:.1} s ({:.1} windows/s)",
        report.examples,
        report.features,
        report.model_seconds,
        report.features as f64 / report.model_seconds.max(1e-9)
    );
    for f in &report.files {
        println!("wrote {}", f.display());
    }
    if args.evaluate {
        let predictions: HashMap<String, String> = report
            .predictions
            .iter()
            .map(|p| (p.id.clone(), p.text.clone()))
            .collect();
        let null_odds = args.output.join("null_odds.json");
        let scores = score_squad(
            &dataset,
            &predictions,
            args.squad.version_2,
            args.squad.version_2.then_some(null_odds.as_path()),
            1.0,
        )?;
        println!("{scores}");
    }
    Ok(())
}

fn predict_glue(args: PredictGlueArgs) -> Result<()> {
    let task = Task::parse(&args.task)?;
    let data = args.data;
    let evaluation = bertkit_tasks::glue::finetune::predict_file(
        &bertkit_tasks::glue::finetune::GluePredictOptions {
            task,
            model: args.model,
            data: data.clone(),
            output: args.output.clone(),
            max_seq_length: args.max_seq_length,
            lower_case: !args.cased,
            batch: args.batch,
            device: bertkit_model::parse_device(&args.device)?,
        },
    )?;
    let metrics: Vec<String> = evaluation
        .metrics
        .iter()
        .map(|(k, v)| format!("{k} {v:.4}"))
        .collect();
    println!(
        "{}: {} examples of {}: loss {:.4}, {}",
        task.folder(),
        evaluation.examples,
        data.display(),
        evaluation.loss,
        metrics.join(", ")
    );
    if let Some(out) = args.output {
        println!("wrote {}", out.display());
    }
    Ok(())
}

pub fn split(command: SplitCommand) -> Result<()> {
    let SplitCommand::Squad(args) = command;
    let dataset = Dataset::load(&args.input)?;
    let (train, dev) = dataset.split_articles(args.train_articles)?;
    std::fs::create_dir_all(&args.output).map_err(|e| format!("{}: {e}", args.output.display()))?;
    for (name, part) in [("train.json", &train), ("dev.json", &dev)] {
        let path = args.output.join(name);
        part.save(&path)?;
        println!(
            "{}: {} articles, {} questions",
            path.display(),
            part.data.len(),
            part.question_count()
        );
    }
    Ok(())
}
