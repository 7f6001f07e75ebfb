//! Flags of the task commands: `evaluate`, `finetune`, `predict`, `split` (SQuAD and GLUE).
//! Training defaults are the tasks' recipes ([`TrainSettings::glue`], [`TrainSettings::squad`]).

use std::path::PathBuf;

use bertkit_tasks::squad::features::FeatureOptions;
use bertkit_tasks::squad::finetune::PredictOptions;
use bertkit_tasks::squad::postprocess::PostprocessOptions;
use bertkit_tasks::training::TrainSettings;
use bertkit_train::plan::FeedForward;
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub(crate) enum EvaluateCommand {
    /// SQuAD: v1.1 prints {"exact_match": …, "f1": …} exactly as evaluate-v1.1.py; v2.0 (a
    /// "v2.0" data file, or --version-2) prints what evaluate-v2.0.py prints.
    Squad(EvaluateSquadArgs),
}

#[derive(Args)]
pub(crate) struct EvaluateSquadArgs {
    /// The SQuAD JSON the predictions answer (dev-v1.1.json, dev-v2.0.json).
    #[arg(long)]
    pub(crate) data: PathBuf,
    /// Predictions: a JSON object {question id: answer text}.
    #[arg(long)]
    pub(crate) predictions: PathBuf,
    /// Score as SQuAD v2.0 even if the data file does not say "v2.0".
    #[arg(long)]
    pub(crate) version_2: bool,
    /// v2.0: no-answer probabilities (or run_squad's null_odds.json), {question id: number};
    /// adds best_exact/best_f1 and their thresholds.
    #[arg(long)]
    pub(crate) na_prob_file: Option<PathBuf>,
    /// v2.0: predict "no answer" when the probability exceeds this.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) na_prob_thresh: f64,
}

/// The training-loop flags shared by the fine-tuning commands.
#[derive(Args)]
pub(crate) struct TrainFlags {
    /// Passes over the training set (default: the task's recipe, GLUE 3, SQuAD 2).
    #[arg(long)]
    pub(crate) epochs: Option<f64>,
    /// Peak learning rate, AdamW with linear warmup and decay (default: the task's recipe,
    /// GLUE 2e-5, SQuAD 3e-5).
    #[arg(long)]
    pub(crate) lr: Option<f64>,
    /// Examples per optimiser step.
    #[arg(long, default_value_t = TrainSettings::glue().batch)]
    pub(crate) batch: usize,
    /// Micro-batches per step (gradient accumulation: batch / accumulation examples per pass).
    #[arg(long, default_value_t = TrainSettings::glue().accumulation)]
    pub(crate) accumulation: usize,
    /// Share of steps warming up.
    #[arg(long, default_value_t = TrainSettings::glue().warmup)]
    pub(crate) warmup: f64,
    /// Stop after this many steps (the schedule still spans every epoch).
    #[arg(long)]
    pub(crate) max_steps: Option<usize>,
    /// Shuffling, dropout and head initialisation.
    #[arg(long, default_value_t = TrainSettings::glue().seed)]
    pub(crate) seed: u64,
    /// Write a checkpoint (weights, optimiser, position) into OUTPUT/checkpoints/ every this
    /// many steps, and after the last.
    #[arg(long, default_value_t = TrainSettings::glue().checkpoint_every)]
    pub(crate) checkpoint_every: usize,
    /// Checkpoints kept (the newest).
    #[arg(long, default_value_t = TrainSettings::glue().keep_checkpoints)]
    pub(crate) keep_checkpoints: usize,
    /// On CUDA, the feed-forward's form: auto (the memory plan's: the full form where it
    /// fits), lean (less memory, its GELU recomputed) or full.
    #[arg(long, default_value = "auto", value_parser = feed_forward)]
    pub(crate) feed_forward: FeedForward,
    // --resume: from the newest checkpoint in the output folder (same data and settings), the
    // run ends as if it had not stopped.
    #[command(flatten)]
    pub(crate) run_folder: super::RunFolderArgs,
    /// Cased vocabulary.
    #[arg(long)]
    pub(crate) cased: bool,
    /// Weights dtype: f32, or bf16/f16 on CUDA (f32 master weights; f16 scales the loss).
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
    #[command(flatten)]
    pub(crate) ranks: super::RankArgs,
}

impl TrainFlags {
    /// The task's `recipe` with the flags given.
    pub(crate) fn settings(&self, recipe: TrainSettings) -> TrainSettings {
        TrainSettings {
            epochs: self.epochs.unwrap_or(recipe.epochs),
            lr: self.lr.unwrap_or(recipe.lr),
            batch: self.batch,
            accumulation: self.accumulation,
            warmup: self.warmup,
            seed: self.seed,
            max_steps: self.max_steps,
            checkpoint_every: self.checkpoint_every,
            keep_checkpoints: self.keep_checkpoints,
            feed_forward: self.feed_forward,
        }
    }
}

/// `--feed-forward`'s value.
pub(crate) fn feed_forward(value: &str) -> Result<FeedForward, String> {
    FeedForward::parse("--feed-forward", value).map_err(|e| e.to_string())
}

#[derive(Subcommand)]
pub(crate) enum FinetuneCommand {
    /// GLUE: MRPC, CoLA, SST-2 or MNLI (train.tsv, then the dev set's metrics).
    Glue(FinetuneGlueArgs),
    /// SQuAD v1.1/v2.0: fine-tune, then (with --dev) predict and score the dev set.
    Squad(FinetuneSquadArgs),
}

#[derive(Args)]
pub(crate) struct FinetuneGlueArgs {
    /// mrpc, cola, sst-2 or mnli.
    #[arg(long)]
    pub(crate) task: String,
    /// Model folder: config.json, model.safetensors, vocab.txt.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// The task folder in the GLUE layout (train.tsv, dev.tsv), e.g. glue_data/MRPC.
    #[arg(long)]
    pub(crate) data: PathBuf,
    /// Where the fine-tuned model goes.
    #[arg(long, short)]
    pub(crate) output: Option<PathBuf>,
    /// Longest encoded sequence.
    #[arg(long, default_value_t = bertkit_tasks::glue::finetune::DEFAULT_MAX_SEQ_LENGTH)]
    pub(crate) max_seq_length: usize,
    #[command(flatten)]
    pub(crate) train: TrainFlags,
}

/// SQuAD windowing and answer-extraction flags.
#[derive(Args)]
pub(crate) struct SquadFlags {
    /// SQuAD 2.0: questions may have no answer.
    #[arg(long)]
    pub(crate) version_2: bool,
    /// Longest window, in tokens.
    #[arg(long, default_value_t = FeatureOptions::default().max_seq_length)]
    pub(crate) max_seq_length: usize,
    /// Step between windows over a long context.
    #[arg(long, default_value_t = FeatureOptions::default().doc_stride)]
    pub(crate) doc_stride: usize,
    /// Longest question, in tokens.
    #[arg(long, default_value_t = FeatureOptions::default().max_query_length)]
    pub(crate) max_query_length: usize,
    /// Answers considered per question.
    #[arg(long, default_value_t = PostprocessOptions::default().n_best)]
    pub(crate) n_best: usize,
    /// Longest answer, in tokens.
    #[arg(long, default_value_t = PostprocessOptions::default().max_answer_length)]
    pub(crate) max_answer_length: usize,
    /// v2.0: answer "" when the null score beats the best answer by more than this.
    #[arg(long, default_value_t = PostprocessOptions::default().null_score_diff_threshold)]
    pub(crate) null_score_diff_threshold: f64,
    /// Windows per forward pass when predicting.
    #[arg(long, default_value_t = bertkit_tasks::squad::finetune::DEFAULT_PREDICT_BATCH)]
    pub(crate) predict_batch: usize,
}

impl SquadFlags {
    /// Prediction options from the flags.
    pub(crate) fn options(&self, lower_case: bool, device: candle_core::Device) -> PredictOptions {
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
pub(crate) struct FinetuneSquadArgs {
    /// Model folder: config.json, model.safetensors, vocab.txt.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Training data (train-v1.1.json, or the train half of `bertkit split squad`).
    #[arg(long)]
    pub(crate) train: PathBuf,
    /// Dev data: predicted and scored after training.
    #[arg(long)]
    pub(crate) dev: Option<PathBuf>,
    /// Where the fine-tuned model goes; dev predictions go to OUTPUT/predictions/.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    #[command(flatten)]
    pub(crate) squad: SquadFlags,
    #[command(flatten)]
    pub(crate) train_flags: TrainFlags,
}

#[derive(Subcommand)]
pub(crate) enum PredictCommand {
    /// SQuAD: predictions.json, nbest_predictions.json (and null_odds.json for v2.0).
    Squad(PredictSquadArgs),
    /// GLUE: `index<TAB>prediction` rows for a labelled file, and its metrics.
    Glue(PredictGlueArgs),
}

#[derive(Args)]
pub(crate) struct PredictSquadArgs {
    /// A fine-tuned question-answering model folder.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// SQuAD JSON with the questions.
    #[arg(long)]
    pub(crate) data: PathBuf,
    /// Folder for the prediction files.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Also score the predictions against the data's answers.
    #[arg(long)]
    pub(crate) evaluate: bool,
    /// Cased vocabulary.
    #[arg(long)]
    pub(crate) cased: bool,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
    #[command(flatten)]
    pub(crate) squad: SquadFlags,
}

#[derive(Args)]
pub(crate) struct PredictGlueArgs {
    /// mrpc, cola, sst-2 or mnli.
    #[arg(long)]
    pub(crate) task: String,
    /// A fine-tuned classifier folder (bertkit finetune glue --output).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// A labelled task file, e.g. glue_data/MRPC/dev.tsv.
    #[arg(long)]
    pub(crate) data: PathBuf,
    /// Where the `index<TAB>prediction` rows go.
    #[arg(long, short)]
    pub(crate) output: Option<PathBuf>,
    /// Longest encoded sequence.
    #[arg(long, default_value_t = bertkit_tasks::glue::finetune::DEFAULT_MAX_SEQ_LENGTH)]
    pub(crate) max_seq_length: usize,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = bertkit_tasks::glue::finetune::DEFAULT_PREDICT_BATCH)]
    pub(crate) batch: usize,
    /// Cased vocabulary.
    #[arg(long)]
    pub(crate) cased: bool,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
}

#[derive(Subcommand)]
pub(crate) enum SplitCommand {
    /// The first N articles to one file, the rest to another (offline runs on SQuAD dev:
    /// train on the first 38 articles of dev-v1.1.json, evaluate on the last 10).
    Squad(SplitSquadArgs),
}

#[derive(Args)]
pub(crate) struct SplitSquadArgs {
    /// The SQuAD JSON to split.
    #[arg(long)]
    pub(crate) input: PathBuf,
    /// Articles in the first (training) part.
    #[arg(long, default_value_t = bertkit_tasks::squad::data::Dataset::OFFLINE_TRAIN_ARTICLES)]
    pub(crate) train_articles: usize,
    /// Folder for train.json and dev.json.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
}

#[derive(Args)]
pub(crate) struct ExtractFeaturesArgs {
    /// Model folder: config.json, model.safetensors, vocab.txt.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Text, one example a line; `A ||| B` is a sentence pair.
    #[arg(long)]
    pub(crate) input: PathBuf,
    /// The JSON-lines file (--format jsonl) or the folder of .npy files (--format npy).
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Encoder layers, Google's indexing: -1 is the last, 0 the first.
    #[arg(long, default_value = "-1,-2,-3,-4", allow_hyphen_values = true)]
    pub(crate) layers: String,
    /// Longest sequence in tokens, [CLS] and [SEP] included; longer lines are cut [default:
    /// 128, or the model's max_position_embeddings if shorter].
    #[arg(long)]
    pub(crate) max_seq_length: Option<usize>,
    /// Lines per forward pass.
    #[arg(long, default_value_t = bertkit_tasks::features::DEFAULT_BATCH)]
    pub(crate) batch_size: usize,
    /// jsonl (Google's layout, values rounded to 6 decimals) or npy (a folder: layer_<i>.npy
    /// [tokens, hidden] f32, token_ids.npy, offsets.npy).
    #[arg(long, default_value = "jsonl")]
    pub(crate) format: String,
    /// Cased vocabulary.
    #[arg(long)]
    pub(crate) cased: bool,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
}
