//! The command line's flags, one module per command group (as ripgrep keeps its flags apart
//! from what runs them). Defaults come from the libraries.

use clap::{Args, Parser, Subcommand};

pub(crate) mod data;
pub(crate) mod tasks;
pub(crate) mod train;

#[derive(Parser)]
#[command(
    name = "bertkit",
    version,
    about = "From raw Wikipedia and book dumps to a pre-trained BERT."
)]
pub(crate) struct Cli {
    /// f32 matrix products on CUDA without TF32 (full f32 inputs; slower).
    #[arg(long, global = true)]
    pub(crate) no_tf32: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Format raw corpora into one-sentence-per-line text (blank line between documents).
    #[command(subcommand)]
    Format(data::FormatCommand),
    /// Split formatted text into shuffled, balanced train/test shards in bounded memory.
    Shard(data::ShardArgs),
    /// WordPiece-tokenize lines from stdin exactly as Google's BERT FullTokenizer; JSONL out.
    Tokenize(data::TokenizeArgs),
    /// Train a WordPiece vocabulary (vocab.txt) on formatted text or shards.
    Vocab(data::VocabArgs),
    /// Masked-LM / next-sentence pre-training instances from shards, to Parquet.
    Records(data::RecordsArgs),
    /// Resumable, retried, checksum-verified downloads.
    #[command(subcommand)]
    Download(data::DownloadCommand),
    /// Run download → format → shard → records from one config; finished steps are skipped.
    Pipeline(data::PipelineArgs),
    /// Run a BERT model directory (config.json + model.safetensors) on token ids from a
    /// safetensors file; writes the hidden states and pooler output as transformers names them.
    Forward(train::ForwardArgs),
    /// Pre-train BERT on records (LAMB, accumulation, mixed precision, checkpoints, resume).
    Pretrain(train::PretrainArgs),
    /// Draw the curves of a metrics.jsonl (loss, MLM and NSP loss, learning rate) as SVG.
    Plot(train::PlotArgs),
    /// The largest micro-batch that fits a GPU's memory, per sequence length.
    Plan(train::PlanArgs),
    /// Score predictions as the official scripts do.
    #[command(subcommand)]
    Evaluate(tasks::EvaluateCommand),
    /// Fine-tune a checkpoint on a task.
    #[command(subcommand)]
    Finetune(tasks::FinetuneCommand),
    /// Answer questions or classify sentences with a fine-tuned model.
    #[command(subcommand)]
    Predict(tasks::PredictCommand),
    /// Split a data set (SQuAD by articles, for offline runs on a dev set).
    #[command(subcommand)]
    Split(tasks::SplitCommand),
    /// Measure speed.
    #[command(subcommand)]
    Bench(train::BenchCommand),
}

/// This process's share in a multi-process run. Without the flags, the launcher's variables
/// are read: RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE.
#[derive(Args)]
pub(crate) struct RankArgs {
    /// This process's rank, below --world-size.
    #[arg(long, requires = "world_size")]
    pub(crate) rank: Option<usize>,
    /// Number of processes sharing the work.
    #[arg(long, requires = "rank")]
    pub(crate) world_size: Option<usize>,
}

impl RankArgs {
    pub(crate) fn ranks(&self) -> Result<bertkit_stage_io::Ranks, String> {
        match (self.rank, self.world_size) {
            (Some(r), Some(w)) => bertkit_stage_io::Ranks::new(r, w),
            _ => bertkit_stage_io::Ranks::from_env(),
        }
    }
}
