//! Flags of the data commands: `download`, `pipeline`, `format`, `shard`, `vocab`,
//! `tokenize`, `records`. Defaults are the libraries' own.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use bertkit_records::instances::InstanceOptions;
use bertkit_shard::ShardOptions;

use super::RankArgs;

#[derive(Args)]
pub(crate) struct PipelineArgs {
    /// The pipeline config (pipelines/data.toml, pipelines/demo.toml).
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// Fetch every download from this folder or base URL instead.
    #[arg(long)]
    pub(crate) mirror: Option<String>,
    /// The source registry.
    #[arg(long, default_value = "pipelines/sources.toml")]
    pub(crate) registry: PathBuf,
    /// Set a template variable over the config's [download] vars, e.g. date=20261101 (the
    /// Wikipedia dump).
    #[arg(long = "var", value_parser = parse_var)]
    pub(crate) vars: Vec<(String, String)>,
    #[command(flatten)]
    pub(crate) ranks: RankArgs,
    /// How long a rank waits at a merge point for the others, in seconds.
    #[arg(long, default_value_t = bertkit_pipeline::RunOptions::default().wait_timeout.as_secs())]
    pub(crate) wait_timeout: u64,
}

#[derive(Subcommand)]
pub(crate) enum DownloadCommand {
    /// Download one URL (http, https, file://) or copy a local path.
    Url(DownloadUrlArgs),
    /// Download a named set of the source registry (pipelines/sources.toml).
    Sources(DownloadSourcesArgs),
}

#[derive(Args)]
pub(crate) struct DownloadSourcesArgs {
    /// The set: demo, wikipedia, gutenberg, squad-v1.1, squad-v2.0, glue, hf, …
    #[arg(long)]
    pub(crate) set: String,
    /// Output folder; every file goes to its registry path under it.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Fetch the same relative paths from this folder or base URL instead.
    #[arg(long)]
    pub(crate) mirror: Option<String>,
    /// Template variables, e.g. date=20240101 or repo=bert-base-uncased.
    #[arg(long = "var", value_parser = parse_var)]
    pub(crate) vars: Vec<(String, String)>,
    /// The registry file.
    #[arg(long, default_value = "pipelines/sources.toml")]
    pub(crate) registry: PathBuf,
    /// Retries for timeouts, connection errors, 408, 429 and 5xx.
    #[arg(long, default_value_t = bertkit_download::FetchOptions::default().retries)]
    pub(crate) retries: u32,
    /// Files in flight at once.
    #[arg(long, default_value_t = bertkit_download::queue::QueueOptions::default().jobs)]
    pub(crate) jobs: usize,
    /// Files in flight at once from one host.
    #[arg(long, default_value_t = bertkit_download::queue::QueueOptions::default().per_host)]
    pub(crate) per_host: usize,
    /// Least time between two transfers starting from one host, in milliseconds.
    #[arg(long, default_value_t = bertkit_download::queue::QueueOptions::default().min_interval.as_millis() as u64)]
    pub(crate) interval_ms: u64,
    #[command(flatten)]
    pub(crate) ranks: RankArgs,
}

pub(crate) fn parse_var(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))
}

#[derive(Args)]
pub(crate) struct DownloadUrlArgs {
    /// The source: an http(s):// or file:// URL, or a path.
    pub(crate) url: String,
    /// Destination file.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Expected SHA-256 (hex).
    #[arg(long, conflicts_with_all = ["sha1", "md5"])]
    pub(crate) sha256: Option<String>,
    /// Expected SHA-1 (hex), as Wikimedia publishes.
    #[arg(long, conflicts_with = "md5")]
    pub(crate) sha1: Option<String>,
    /// Expected MD5 (hex), as Wikimedia publishes.
    #[arg(long)]
    pub(crate) md5: Option<String>,
    /// Retries for timeouts, connection errors, 408, 429 and 5xx.
    #[arg(long, default_value_t = bertkit_download::FetchOptions::default().retries)]
    pub(crate) retries: u32,
}

#[derive(Args)]
pub(crate) struct RecordsArgs {
    /// Shards or formatted text: .txt or .txt.zst files, or folders holding them.
    #[arg(long, short, required = true, num_args = 1..)]
    pub(crate) input: Vec<PathBuf>,
    /// WordPiece vocabulary (vocab.txt).
    #[arg(long)]
    pub(crate) vocab: PathBuf,
    /// A .parquet file (all inputs as one corpus) or a folder (one .parquet per input shard).
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Preset: phase 1 = sequences of 128 with 20 predictions, phase 2 = 512 with 80.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub(crate) phase: u8,
    /// Maximum sequence length (overrides the phase).
    #[arg(long)]
    pub(crate) max_seq_length: Option<usize>,
    /// Maximum masked positions per sequence (overrides the phase).
    #[arg(long)]
    pub(crate) max_predictions_per_seq: Option<usize>,
    /// Share of tokens to mask.
    #[arg(long, default_value_t = InstanceOptions::phase1().masked_lm_prob)]
    pub(crate) masked_lm_prob: f64,
    /// Probability of a shorter target sequence length.
    #[arg(long, default_value_t = InstanceOptions::phase1().short_seq_prob)]
    pub(crate) short_seq_prob: f64,
    /// Passes over the corpus, each with different pairs and masks.
    #[arg(long, default_value_t = InstanceOptions::phase1().dupe_factor)]
    pub(crate) dupe_factor: usize,
    /// Seed.
    #[arg(long, default_value_t = InstanceOptions::phase1().seed)]
    pub(crate) seed: u64,
    /// Mask whole words.
    #[arg(long)]
    pub(crate) whole_word_mask: bool,
    /// `google`: reproduce create_pretraining_data.py exactly, with its generator and call order
    /// (in folder mode every shard is seeded with --seed, as the script run per shard). Default:
    /// the same algorithm with documents in parallel; the output depends on the seed, not on the
    /// thread count.
    #[arg(long, value_parser = ["google"])]
    pub(crate) compat: Option<String>,
    /// Also write the instances as JSONL with the reference script's fields (file mode).
    #[arg(long)]
    pub(crate) jsonl: Option<PathBuf>,
    /// Cased vocabulary.
    #[arg(long)]
    pub(crate) cased: bool,
}

#[derive(Args)]
pub(crate) struct VocabArgs {
    /// Formatted text or shards: .txt or .txt.zst files, or folders holding them.
    #[arg(long, short, required = true, num_args = 1..)]
    pub(crate) input: Vec<PathBuf>,
    /// Vocabulary size, special tokens included.
    #[arg(long, default_value_t = bertkit_tokenizer::vocab::BERT_VOCAB_SIZE)]
    pub(crate) size: usize,
    /// Output vocab.txt.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Cased: no lower-casing and no accent stripping.
    #[arg(long)]
    pub(crate) cased: bool,
}

#[derive(Args)]
pub(crate) struct TokenizeArgs {
    /// WordPiece vocabulary (vocab.txt, one token per line).
    #[arg(long)]
    pub(crate) vocab: PathBuf,
    /// Cased vocabulary: no lower-casing and no accent stripping.
    #[arg(long)]
    pub(crate) cased: bool,
    /// Each input line is a JSON object with a "text" field (so a text may hold newlines).
    #[arg(long)]
    pub(crate) jsonl_input: bool,
}

#[derive(Args)]
pub(crate) struct ShardArgs {
    /// Formatted text: .txt or .txt.zst files, or folders holding them (read sorted).
    #[arg(long, short, required = true, num_args = 1..)]
    pub(crate) input: Vec<PathBuf>,
    /// Output directory: train/, test/ and the manifest go here.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Number of train shards.
    #[arg(long)]
    pub(crate) num_train_shards: usize,
    /// Number of test shards.
    #[arg(long, default_value_t = ShardOptions::default().num_test_shards)]
    pub(crate) num_test_shards: usize,
    /// Share of the sentences that go to the test shards.
    #[arg(long, default_value_t = ShardOptions::default().test_fraction)]
    pub(crate) test_fraction: f64,
    /// Seed of the shuffle.
    #[arg(long, default_value_t = ShardOptions::default().seed)]
    pub(crate) seed: u64,
    /// Compress shards (writes .txt.zst).
    #[arg(long, value_parser = ["zstd"])]
    pub(crate) compress: Option<String>,
    /// zstd level for --compress zstd.
    #[arg(long, default_value_t = bertkit_shard::DEFAULT_ZSTD_LEVEL)]
    pub(crate) zstd_level: i32,
    /// In a multi-process run, each rank writes shards g with g % world-size == rank.
    #[command(flatten)]
    pub(crate) ranks: RankArgs,
    /// Worker threads (default: one per core); the output does not depend on it.
    #[arg(long, default_value_t = ShardOptions::default().threads)]
    pub(crate) threads: usize,
    /// MiB of documents sorted in memory per run; bounds memory, does not change the output.
    #[arg(long, default_value_t = ShardOptions::default().run_bytes >> 20)]
    pub(crate) run_mb: usize,
    /// Print only errors and the final summary.
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

#[derive(Subcommand)]
pub(crate) enum FormatCommand {
    /// Wikipedia pages-articles dumps: .xml, .xml.bz2 or multistream .xml.bz2.
    Wiki(WikiArgs),
    /// Project Gutenberg plain-text books (files or directories of .txt files).
    Books(BooksArgs),
}

#[derive(Args)]
pub(crate) struct CommonArgs {
    /// Output directory (created if missing).
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Largest output file in bytes; documents are never split across files.
    #[arg(long, default_value_t = bertkit_format::DEFAULT_MAX_BYTES)]
    pub(crate) max_bytes: u64,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// Print only errors and the final summary.
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

#[derive(Args)]
pub(crate) struct WikiArgs {
    /// Dump files, read in the order given.
    #[arg(long, short, required = true, num_args = 1..)]
    pub(crate) input: Vec<PathBuf>,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// Keep the text of list items (dropped by default, as WikiExtractor does).
    #[arg(long)]
    pub(crate) keep_lists: bool,
    /// Keep disambiguation pages (skipped by default).
    #[arg(long)]
    pub(crate) keep_disambiguation: bool,
    /// Fail on a page that is not valid UTF-8 instead of skipping and counting it.
    #[arg(long)]
    pub(crate) strict: bool,
}

#[derive(Args)]
pub(crate) struct BooksArgs {
    /// Book files, or directories whose .txt files are read (sorted by name).
    #[arg(long, short, required = true, num_args = 1..)]
    pub(crate) input: Vec<PathBuf>,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
}
