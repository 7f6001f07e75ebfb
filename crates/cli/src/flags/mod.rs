//! The command line's flags, one module per command group (as ripgrep keeps its flags apart
//! from what runs them). Defaults come from the libraries.

use clap::{Args, Parser, Subcommand};

pub(crate) mod data;
pub(crate) mod model;
pub(crate) mod tasks;
pub(crate) mod train;

#[derive(Parser)]
#[command(
    name = "bertkit",
    version,
    about = "From raw Wikipedia and book dumps to a pre-trained BERT."
)]
pub(crate) struct Cli {
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
    /// Each token's vectors from chosen layers of a model, for lines of text (or `A ||| B`
    /// pairs), as Google's extract_features.py writes them (JSON lines), or as npy files.
    ExtractFeatures(tasks::ExtractFeaturesArgs),
    /// Convert models: Google's TensorFlow checkpoints to and from model folders.
    #[command(subcommand)]
    Convert(model::ConvertCommand),
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
    /// Check the kernels of this machine's devices against their references.
    #[command(subcommand)]
    Check(model::CheckCommand),
    /// Every command's flags as Markdown (docs/configuration.md's generated part).
    #[command(hide = true)]
    Reference,
}

impl Command {
    /// Whether the command runs f32 matrix products without TF32 (`--no-tf32`, on the
    /// commands that run a model).
    pub(crate) fn no_tf32(&self) -> bool {
        let products = match self {
            Command::Forward(a) => &a.products,
            Command::ExtractFeatures(a) => &a.products,
            Command::Pretrain(a) => &a.products,
            Command::Bench(train::BenchCommand::Inference(a)) => &a.products,
            Command::Bench(train::BenchCommand::Memory(a)) => &a.products,
            Command::Bench(train::BenchCommand::Gemm(a)) => &a.products,
            Command::Bench(train::BenchCommand::Kernels(a)) => &a.products,
            Command::Finetune(tasks::FinetuneCommand::Glue(a)) => &a.train.products,
            Command::Finetune(tasks::FinetuneCommand::Squad(a)) => &a.train_flags.products,
            Command::Predict(tasks::PredictCommand::Squad(a)) => &a.products,
            Command::Predict(tasks::PredictCommand::Glue(a)) => &a.products,
            _ => return false,
        };
        products.no_tf32
    }
}

/// How f32 matrix products run, for the commands that run a model.
#[derive(Args, Clone, Copy)]
pub(crate) struct ProductArgs {
    /// f32 matrix products on CUDA without TF32 (full f32 inputs; slower).
    #[arg(long)]
    pub(crate) no_tf32: bool,
}

/// This process's share in a multi-process run. Without the flags, the launcher's variables
/// are read: RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE.
/// What a training run does with an earlier run in its output folder.
#[derive(Args)]
pub(crate) struct RunFolderArgs {
    /// Continue the run in the output folder from its newest checkpoint that verifies (a
    /// damaged newer one is reported and passed over). Without it (or --overwrite), a folder
    /// holding an earlier run (checkpoints, a final model, metrics) is refused.
    #[arg(long)]
    pub(crate) resume: bool,
    /// With --resume: stop where the newest checkpoint is damaged, rather than resume from an
    /// older one that verifies.
    #[arg(long, requires = "resume")]
    pub(crate) stop_if_damaged: bool,
    /// Move an earlier run in the output folder aside, into a new sibling folder
    /// OUTPUT.earlier-N (nothing deleted), and start afresh.
    #[arg(long, conflicts_with = "resume")]
    pub(crate) overwrite: bool,
}

impl RunFolderArgs {
    pub(crate) fn earlier(&self) -> bertkit_train::run_folder::EarlierRun {
        bertkit_train::run_folder::EarlierRun::from_flags(
            self.resume,
            self.overwrite,
            self.stop_if_damaged,
        )
    }
}

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

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::Parser;

    /// `--no-tf32` is a flag of each command that runs a model, and of no other.
    #[test]
    fn no_tf32_belongs_to_the_commands_that_run_a_model() {
        let model_commands: [&[&str]; 11] = [
            &["bench", "kernels"],
            &["forward", "--model", "m", "--input", "i", "--output", "o"],
            &[
                "extract-features",
                "--model",
                "m",
                "--input",
                "i",
                "--output",
                "o",
            ],
            &["pretrain", "--config", "c"],
            &["bench", "inference", "--model", "m"],
            &["bench", "gemm"],
            &["bench", "memory", "--config", "base"],
            &[
                "finetune", "glue", "--task", "mrpc", "--model", "m", "--data", "d", "--output",
                "o",
            ],
            &[
                "finetune", "squad", "--model", "m", "--train", "t", "--output", "o",
            ],
            &[
                "predict", "squad", "--model", "m", "--data", "d", "--output", "o",
            ],
            &[
                "predict", "glue", "--task", "mrpc", "--model", "m", "--data", "d",
            ],
        ];
        for args in model_commands {
            let parse = |extra: &[&str]| {
                let argv = ["bertkit"].iter().chain(args).chain(extra);
                Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{args:?}: {e}"))
            };
            assert!(!parse(&[]).command.no_tf32(), "{args:?}");
            assert!(parse(&["--no-tf32"]).command.no_tf32(), "{args:?}");
        }
        for data_command in [
            &["format", "wiki", "--input", "i", "--output", "o"][..],
            &["shard", "--input", "i", "--output", "o"],
        ] {
            let argv = ["bertkit"].iter().chain(data_command).chain(&["--no-tf32"]);
            let err = Cli::try_parse_from(argv).err().unwrap().to_string();
            assert!(err.contains("unexpected argument '--no-tf32'"), "{err}");
        }
    }
}
