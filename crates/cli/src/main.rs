//! `bertkit`: the command line over the stage crates. It parses arguments, prints progress and
//! summaries, and maps errors to exit codes; all the work lives in the stage crates.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bertkit_format::{FormatManifest, Observer, Progress, RunOutcome};
use clap::{Args, Parser, Subcommand};

mod tasks;

/// Tensor buffers are large and short-lived: see the workspace Cargo.toml.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (the 16th entry of `mi_option_e`, v2 and v3 alike).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Allocator settings for tensors and records, both measured on 2 cores:
/// - freed memory stays mapped instead of going back to the OS 10 ms later: each training step
///   frees and re-allocates the same large buffers, and purging them cost a page fault per
///   4 KiB on the next step (SQuAD fine-tuning of MiniLM: 60 s -> 31 s for 3 steps);
/// - no transparent huge pages: mimalloc asks for them on its arenas, and each first touch of
///   an arena page then zeroes 2 MiB (`bertkit records` spent a third of its time there;
///   1.29 s -> 1.05 s without, training unchanged within noise). Since the records stage
///   touches less memory, huge pages make its small runs faster (fewer faults) but double its
///   peak RSS and stall it in compaction on larger inputs (BENCHMARKS.md), so they stay off.
///
/// `MIMALLOC_PURGE_DELAY` in the environment still wins over the first; `BERTKIT_THP=1` keeps
/// huge pages.
fn configure_allocator() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets an integer option of the allocator; no memory is touched.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
    #[cfg(target_os = "linux")]
    if std::env::var_os("BERTKIT_THP").is_none_or(|v| v != "1") {
        // SAFETY: a process-wide flag for future page faults; no memory is touched. Failure
        // (an old kernel) only leaves huge pages on.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    }
}

#[derive(Parser)]
#[command(
    name = "bertkit",
    version,
    about = "From raw Wikipedia and book dumps to a pre-trained BERT."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Format raw corpora into one-sentence-per-line text (blank line between documents).
    #[command(subcommand)]
    Format(FormatCommand),
    /// Split formatted text into shuffled, balanced train/test shards in bounded memory.
    Shard(ShardArgs),
    /// WordPiece-tokenize lines from stdin exactly as Google's BERT FullTokenizer; JSONL out.
    Tokenize(TokenizeArgs),
    /// Train a WordPiece vocabulary (vocab.txt) on formatted text or shards.
    Vocab(VocabArgs),
    /// Masked-LM / next-sentence pre-training instances from shards, to Parquet.
    Records(RecordsArgs),
    /// Resumable, retried, checksum-verified downloads.
    #[command(subcommand)]
    Download(DownloadCommand),
    /// Run download → format → shard → records from one config; finished steps are skipped.
    Pipeline(PipelineArgs),
    /// Run a BERT model directory (config.json + model.safetensors) on token ids from a
    /// safetensors file; writes the hidden states and pooler output as transformers names them.
    Forward(ForwardArgs),
    /// Pre-train BERT on records (LAMB, accumulation, mixed precision, checkpoints, resume).
    Pretrain(PretrainArgs),
    /// Draw the curves of a metrics.jsonl (loss, MLM and NSP loss, learning rate) as SVG.
    Plot(PlotArgs),
    /// The largest micro-batch that fits a GPU's memory, per sequence length.
    Plan(PlanArgs),
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
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Forward-pass throughput and latency of a model folder.
    Inference(BenchInferenceArgs),
}

#[derive(Args)]
struct BenchInferenceArgs {
    /// Model folder (config.json + model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,384")]
    seq: Vec<usize>,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batch: Vec<usize>,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Timed seconds per setting (at least five passes).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Use the training path's differentiable (composed) ops instead of the fused inference ops.
    #[arg(long)]
    composed: bool,
}

#[derive(Args)]
struct PretrainArgs {
    /// The run config (pipelines/pretrain-phase1.toml, pipelines/tiny.toml, …).
    #[arg(long)]
    config: PathBuf,
    /// Records (.parquet files or folders) instead of the config's.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Run folder instead of the config's.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Stop after this many optimiser steps (the schedule still spans the config's).
    #[arg(long)]
    max_steps: Option<u64>,
    /// Continue from the newest checkpoint of the run folder.
    #[arg(long)]
    resume: bool,
    /// Device instead of the config's: cpu, cuda, cuda:N.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    ranks: RankArgs,
}

#[derive(Args)]
struct PlotArgs {
    /// A run's metrics.jsonl.
    metrics: PathBuf,
    /// The SVG file to write.
    #[arg(long, short)]
    output: PathBuf,
}

#[derive(Args)]
struct PlanArgs {
    /// A transformers config.json, or base / large.
    #[arg(long)]
    config: String,
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    seq: Vec<usize>,
    /// GPU memory, e.g. 12GiB, 16GiB, 80GB.
    #[arg(long)]
    gpu_mem: String,
    /// f32, bf16 or fp16.
    #[arg(long, default_value = "bf16")]
    precision: String,
    /// Activation checkpointing (keep one layer input per layer, recompute the rest).
    #[arg(long)]
    checkpointing: bool,
    /// Global batch per sequence length, comma-separated (NVIDIA's recipe: 65536,32768).
    #[arg(long, value_delimiter = ',', default_value = "65536,32768")]
    global_batch: Vec<usize>,
    /// Masked-LM predictions per sequence length, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "20,80")]
    predictions: Vec<usize>,
}

#[derive(Args)]
struct ForwardArgs {
    /// Model directory: config.json and model.safetensors (transformers layout).
    #[arg(long)]
    model: PathBuf,
    /// Safetensors file with int64 `input_ids`, and optionally `attention_mask` and
    /// `token_type_ids`, all [batch, seq].
    #[arg(long)]
    input: PathBuf,
    /// Output safetensors: `last_hidden_state`, `pooler_output` and `hidden_states.0…N` (f32).
    #[arg(long, short)]
    output: PathBuf,
    /// Weights and activations: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, or cuda / cuda:N with a CUDA build.
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// This process's share in a multi-process run. Without the flags, the launcher's variables
/// are read: RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE.
#[derive(Args)]
struct RankArgs {
    /// This process's rank, below --world-size.
    #[arg(long, requires = "world_size")]
    rank: Option<usize>,
    /// Number of processes sharing the work.
    #[arg(long, requires = "rank")]
    world_size: Option<usize>,
}

impl RankArgs {
    fn ranks(&self) -> Result<bertkit_stage_io::Ranks, String> {
        match (self.rank, self.world_size) {
            (Some(r), Some(w)) => bertkit_stage_io::Ranks::new(r, w),
            _ => bertkit_stage_io::Ranks::from_env(),
        }
    }
}

#[derive(Args)]
struct PipelineArgs {
    /// The pipeline config (pipelines/data.toml, pipelines/demo.toml).
    #[arg(long)]
    config: PathBuf,
    /// Fetch every download from this folder or base URL instead.
    #[arg(long)]
    mirror: Option<String>,
    /// The source registry.
    #[arg(long, default_value = "pipelines/sources.toml")]
    registry: PathBuf,
    #[command(flatten)]
    ranks: RankArgs,
    /// How long a rank waits at a merge point for the others, in seconds.
    #[arg(long, default_value_t = 86_400)]
    wait_timeout: u64,
}

#[derive(Subcommand)]
enum DownloadCommand {
    /// Download one URL (http, https, file://) or copy a local path.
    Url(DownloadUrlArgs),
    /// Download a named set of the source registry (pipelines/sources.toml).
    Sources(DownloadSourcesArgs),
}

#[derive(Args)]
struct DownloadSourcesArgs {
    /// The set: demo, wikipedia, gutenberg, squad-v1.1, squad-v2.0, glue, hf, …
    #[arg(long)]
    set: String,
    /// Output folder; every file goes to its registry path under it.
    #[arg(long, short)]
    output: PathBuf,
    /// Fetch the same relative paths from this folder or base URL instead.
    #[arg(long)]
    mirror: Option<String>,
    /// Template variables, e.g. date=20240101 or repo=bert-base-uncased.
    #[arg(long = "var", value_parser = parse_var)]
    vars: Vec<(String, String)>,
    /// The registry file.
    #[arg(long, default_value = "pipelines/sources.toml")]
    registry: PathBuf,
    /// Retries for timeouts, connection errors, 408, 429 and 5xx.
    #[arg(long, default_value_t = 5)]
    retries: u32,
    /// Files in flight at once.
    #[arg(long, default_value_t = 4)]
    jobs: usize,
    /// Files in flight at once from one host.
    #[arg(long, default_value_t = 2)]
    per_host: usize,
    /// Least time between two transfers starting from one host, in milliseconds.
    #[arg(long, default_value_t = 500)]
    interval_ms: u64,
    #[command(flatten)]
    ranks: RankArgs,
}

fn parse_var(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))
}

#[derive(Args)]
struct DownloadUrlArgs {
    /// The source: an http(s):// or file:// URL, or a path.
    url: String,
    /// Destination file.
    #[arg(long, short)]
    output: PathBuf,
    /// Expected SHA-256 (hex).
    #[arg(long, conflicts_with_all = ["sha1", "md5"])]
    sha256: Option<String>,
    /// Expected SHA-1 (hex), as Wikimedia publishes.
    #[arg(long, conflicts_with = "md5")]
    sha1: Option<String>,
    /// Expected MD5 (hex), as Wikimedia publishes.
    #[arg(long)]
    md5: Option<String>,
    /// Retries for timeouts, connection errors, 408, 429 and 5xx.
    #[arg(long, default_value_t = 5)]
    retries: u32,
}

/// Download progress: a bar per transfer with rate and ETA on a terminal, a log line every 10 s
/// otherwise. Transfers run on worker threads, one at a time each, so a transfer is known by the
/// thread that reports it.
struct DownloadProgress {
    terminal: bool,
    multi: indicatif::MultiProgress,
    transfers: Mutex<std::collections::HashMap<std::thread::ThreadId, Transfer>>,
}

struct Transfer {
    name: String,
    bar: Option<indicatif::ProgressBar>,
    logged_at: Instant,
    logged_bytes: u64,
}

impl DownloadProgress {
    fn new() -> Self {
        DownloadProgress {
            terminal: std::io::stderr().is_terminal(),
            multi: indicatif::MultiProgress::new(),
            transfers: Mutex::new(Default::default()),
        }
    }

    fn end(&self, abandon: bool) {
        let transfer = self
            .transfers
            .lock()
            .unwrap()
            .remove(&std::thread::current().id());
        if let Some(bar) = transfer.and_then(|t| t.bar) {
            if abandon {
                bar.abandon();
            } else {
                bar.finish();
            }
        }
    }
}

impl bertkit_download::Progress for DownloadProgress {
    fn start(&self, name: &str, done: u64, total: Option<u64>) {
        let short = name.rsplit('/').next().unwrap_or(name).to_string();
        let bar = if self.terminal {
            let bar = self.multi.add(match total {
                Some(t) => indicatif::ProgressBar::new(t),
                None => indicatif::ProgressBar::new_spinner(),
            });
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_message(short.clone());
            bar.set_position(done);
            Some(bar)
        } else {
            let from = if done > 0 {
                format!(", resuming at {done} bytes")
            } else {
                String::new()
            };
            let size = total.map_or("unknown size".to_string(), |t| format!("{t} bytes"));
            eprintln!("downloading {name} ({size}{from})");
            None
        };
        self.transfers.lock().unwrap().insert(
            std::thread::current().id(),
            Transfer {
                name: short,
                bar,
                logged_at: Instant::now(),
                logged_bytes: done,
            },
        );
    }

    fn advance(&self, done: u64) {
        let mut transfers = self.transfers.lock().unwrap();
        let Some(t) = transfers.get_mut(&std::thread::current().id()) else {
            return;
        };
        if let Some(bar) = &t.bar {
            bar.set_position(done);
        } else if t.logged_at.elapsed() >= Duration::from_secs(10) {
            let rate = (done - t.logged_bytes) as f64 / t.logged_at.elapsed().as_secs_f64() / 1e6;
            eprintln!("  {}: {:.1} MB ({rate:.1} MB/s)", t.name, done as f64 / 1e6);
            t.logged_at = Instant::now();
            t.logged_bytes = done;
        }
    }

    fn retry(&self, message: &str, wait: Duration) {
        self.end(true);
        let line = format!("warning: {message} in {:.1} s", wait.as_secs_f64());
        if self.terminal {
            let _ = self.multi.println(line);
        } else {
            eprintln!("{line}");
        }
    }

    fn finish(&self) {
        self.end(false);
    }
}

#[derive(Args)]
struct RecordsArgs {
    /// Shards or formatted text: .txt or .txt.zst files, or folders holding them.
    #[arg(long, short, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// WordPiece vocabulary (vocab.txt).
    #[arg(long)]
    vocab: PathBuf,
    /// A .parquet file (all inputs as one corpus) or a folder (one .parquet per input shard).
    #[arg(long, short)]
    output: PathBuf,
    /// Preset: phase 1 = sequences of 128 with 20 predictions, phase 2 = 512 with 80.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    phase: u8,
    /// Maximum sequence length (overrides the phase).
    #[arg(long)]
    max_seq_length: Option<usize>,
    /// Maximum masked positions per sequence (overrides the phase).
    #[arg(long)]
    max_predictions_per_seq: Option<usize>,
    /// Share of tokens to mask.
    #[arg(long, default_value_t = 0.15)]
    masked_lm_prob: f64,
    /// Probability of a shorter target sequence length.
    #[arg(long, default_value_t = 0.1)]
    short_seq_prob: f64,
    /// Passes over the corpus, each with different pairs and masks.
    #[arg(long, default_value_t = 5)]
    dupe_factor: usize,
    /// Seed.
    #[arg(long, default_value_t = 12345)]
    seed: u64,
    /// Mask whole words.
    #[arg(long)]
    whole_word_mask: bool,
    /// `google`: reproduce create_pretraining_data.py exactly, with its generator and call order
    /// (in folder mode every shard is seeded with --seed, as the script run per shard). Default:
    /// the same algorithm with documents in parallel; the output depends on the seed, not on the
    /// thread count.
    #[arg(long, value_parser = ["google"])]
    compat: Option<String>,
    /// Also write the instances as JSONL with the reference script's fields (file mode).
    #[arg(long)]
    jsonl: Option<PathBuf>,
    /// Cased vocabulary.
    #[arg(long)]
    cased: bool,
}

#[derive(Args)]
struct VocabArgs {
    /// Formatted text or shards: .txt or .txt.zst files, or folders holding them.
    #[arg(long, short, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Vocabulary size, special tokens included.
    #[arg(long, default_value_t = 30522)]
    size: usize,
    /// Output vocab.txt.
    #[arg(long, short)]
    output: PathBuf,
    /// Cased: no lower-casing and no accent stripping.
    #[arg(long)]
    cased: bool,
}

#[derive(Args)]
struct TokenizeArgs {
    /// WordPiece vocabulary (vocab.txt, one token per line).
    #[arg(long)]
    vocab: PathBuf,
    /// Cased vocabulary: no lower-casing and no accent stripping.
    #[arg(long)]
    cased: bool,
    /// Each input line is a JSON object with a "text" field (so a text may hold newlines).
    #[arg(long)]
    jsonl_input: bool,
}

#[derive(Args)]
struct ShardArgs {
    /// Formatted text: .txt or .txt.zst files, or folders holding them (read sorted).
    #[arg(long, short, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Output directory: train/, test/ and the manifest go here.
    #[arg(long, short)]
    output: PathBuf,
    /// Number of train shards.
    #[arg(long)]
    num_train_shards: usize,
    /// Number of test shards.
    #[arg(long, default_value_t = 0)]
    num_test_shards: usize,
    /// Share of the sentences that go to the test shards.
    #[arg(long, default_value_t = 0.0)]
    test_fraction: f64,
    /// Seed of the shuffle.
    #[arg(long, default_value_t = 12345)]
    seed: u64,
    /// Compress shards (writes .txt.zst).
    #[arg(long, value_parser = ["zstd"])]
    compress: Option<String>,
    /// zstd level for --compress zstd.
    #[arg(long, default_value_t = 3)]
    zstd_level: i32,
    /// In a multi-process run, each rank writes shards g with g % world-size == rank.
    #[command(flatten)]
    ranks: RankArgs,
    /// Worker threads (default: one per core); the output does not depend on it.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// MiB of documents sorted in memory per run; bounds memory, does not change the output.
    #[arg(long, default_value_t = 64)]
    run_mb: usize,
    /// Print only errors and the final summary.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Subcommand)]
enum FormatCommand {
    /// Wikipedia pages-articles dumps: .xml, .xml.bz2 or multistream .xml.bz2.
    Wiki(WikiArgs),
    /// Project Gutenberg plain-text books (files or directories of .txt files).
    Books(BooksArgs),
}

#[derive(Args)]
struct CommonArgs {
    /// Output directory (created if missing).
    #[arg(long, short)]
    output: PathBuf,
    /// Largest output file in bytes; documents are never split across files.
    #[arg(long, default_value_t = bertkit_format::DEFAULT_MAX_BYTES)]
    max_bytes: u64,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print only errors and the final summary.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args)]
struct WikiArgs {
    /// Dump files, read in the order given.
    #[arg(long, short, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    #[command(flatten)]
    common: CommonArgs,
    /// Keep the text of list items (dropped by default, as WikiExtractor does).
    #[arg(long)]
    keep_lists: bool,
    /// Keep disambiguation pages (skipped by default).
    #[arg(long)]
    keep_disambiguation: bool,
    /// Fail on a page that is not valid UTF-8 instead of skipping and counting it.
    #[arg(long)]
    strict: bool,
}

#[derive(Args)]
struct BooksArgs {
    /// Book files, or directories whose .txt files are read (sorted by name).
    #[arg(long, short, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    #[command(flatten)]
    common: CommonArgs,
}

/// Prints progress to stderr: a rewritten line on a terminal, a log line every 10 s otherwise.
struct StderrObserver {
    quiet: bool,
    terminal: bool,
    last: Mutex<Option<Instant>>,
}

impl StderrObserver {
    fn new(quiet: bool) -> Self {
        StderrObserver {
            quiet,
            terminal: std::io::stderr().is_terminal(),
            last: Mutex::new(None),
        }
    }

    fn finish_line(&self) {
        if self.terminal && !self.quiet && self.last.lock().unwrap().is_some() {
            eprintln!();
        }
    }
}

impl Observer for StderrObserver {
    fn progress(&self, p: &Progress) {
        if self.quiet {
            return;
        }
        let every = if self.terminal {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(10)
        };
        let mut last = self.last.lock().unwrap();
        if last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        *last = Some(Instant::now());
        let secs = p.elapsed.as_secs_f64().max(1e-9);
        let line = format!(
            "input {}/{}: {} {} read, {} documents written, {:.1} MB in ({:.1} MB/s), {:.1} MB out",
            p.input + 1,
            p.inputs,
            p.items,
            p.unit,
            p.documents,
            p.input_bytes as f64 / 1e6,
            p.input_bytes as f64 / 1e6 / secs,
            p.output_bytes as f64 / 1e6
        );
        if self.terminal {
            eprint!("\r\x1b[2K{line}");
            let _ = std::io::stderr().flush();
        } else {
            eprintln!("{line}");
        }
    }

    fn message(&self, message: &str) {
        if !self.quiet {
            self.finish_line();
            eprintln!("{message}");
        }
    }

    fn warning(&self, warning: &str) {
        self.finish_line();
        eprintln!("warning: {warning}");
    }
}

fn print_summary(outcome: &RunOutcome, output: &std::path::Path) {
    let manifest: &FormatManifest = outcome.manifest();
    let manifest_path = output.join(FormatManifest::file_name(&manifest.kind));
    match outcome {
        RunOutcome::UpToDate(_) => {
            println!(
                "{} is up to date (same inputs and options); nothing to do.",
                manifest_path.display()
            )
        }
        RunOutcome::Completed(m) => {
            println!(
                "formatted {} input(s) in {:.2} s",
                m.inputs.len(),
                m.elapsed_seconds
            );
        }
    }
    println!(
        "output: {} ({} file(s))",
        output.display(),
        manifest.outputs.len()
    );
    for f in &manifest.outputs {
        println!(
            "  {}  {} bytes, {} documents, {} sentences",
            f.file, f.bytes, f.documents, f.sentences
        );
    }
    println!("manifest: {}", manifest_path.display());
    println!(
        "counts: {}",
        serde_json::to_string_pretty(&manifest.counts).unwrap_or_default()
    );
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Format(FormatCommand::Wiki(args)) => {
            let options = bertkit_format::wiki::WikiOptions {
                clean: bertkit_format::wiki::CleanOptions {
                    keep_lists: args.keep_lists,
                },
                keep_disambiguation: args.keep_disambiguation,
                max_bytes: args.common.max_bytes,
                threads: args.common.threads,
                strict: args.strict,
                ..Default::default()
            };
            report(&args.common, |observer| {
                bertkit_format::wiki::format_wiki(
                    &args.input,
                    &args.common.output,
                    &options,
                    observer,
                )
            })?;
        }
        Command::Format(FormatCommand::Books(args)) => {
            let options = bertkit_format::books::BookOptions {
                max_bytes: args.common.max_bytes,
                threads: args.common.threads,
            };
            report(&args.common, |observer| {
                bertkit_format::books::format_books(
                    &args.input,
                    &args.common.output,
                    &options,
                    observer,
                )
            })?;
        }
        Command::Shard(args) => shard(args)?,
        Command::Tokenize(args) => tokenize(args)?,
        Command::Records(args) => records(args)?,
        Command::Download(DownloadCommand::Url(args)) => download_url(args)?,
        Command::Download(DownloadCommand::Sources(args)) => download_sources(args)?,
        Command::Pipeline(args) => pipeline(args)?,
        Command::Forward(args) => forward(args)?,
        Command::Pretrain(args) => pretrain(args)?,
        Command::Plot(args) => plot(args)?,
        Command::Plan(args) => plan(args)?,
        Command::Evaluate(c) => tasks::evaluate(c)?,
        Command::Finetune(c) => tasks::finetune(c)?,
        Command::Predict(c) => tasks::predict(c)?,
        Command::Split(c) => tasks::split(c)?,
        Command::Bench(BenchCommand::Inference(args)) => bench_inference(args)?,
        Command::Vocab(args) => {
            let n = bertkit_tokenizer::vocab::train_vocab(
                &args.input,
                args.size,
                !args.cased,
                &args.output,
            )?;
            println!("wrote {} ({n} tokens)", args.output.display());
        }
    }
    Ok(())
}

fn shard(args: ShardArgs) -> Result<(), bertkit_shard::ShardError> {
    let ranks = args
        .ranks
        .ranks()
        .map_err(bertkit_shard::ShardError::Usage)?;
    let options = bertkit_shard::ShardOptions {
        num_train_shards: args.num_train_shards,
        num_test_shards: args.num_test_shards,
        test_fraction: args.test_fraction,
        seed: args.seed,
        compression: match args.compress.as_deref() {
            Some("zstd") => bertkit_shard::Compression::Zstd {
                level: args.zstd_level,
            },
            _ => bertkit_shard::Compression::None,
        },
        rank: ranks.rank,
        world_size: ranks.world_size,
        threads: args.threads,
        run_bytes: args.run_mb.max(1) << 20,
    };
    let quiet = args.quiet;
    let progress = move |line: &str| {
        if !quiet {
            eprintln!("{line}");
        }
    };
    let outcome = bertkit_shard::shard(&args.input, &args.output, &options, &progress)?;
    let m = outcome.manifest();
    let manifest_path = args.output.join(bertkit_shard::ShardManifest::file_name(
        ranks.rank,
        ranks.world_size,
    ));
    match &outcome {
        bertkit_shard::ShardOutcome::UpToDate(_) => {
            println!(
                "{} is up to date (same inputs and parameters); nothing to do.",
                manifest_path.display()
            )
        }
        bertkit_shard::ShardOutcome::Completed(_) => println!(
            "sharded {} documents ({} sentences, {:.1} MB) from {} input(s) in {:.2} s",
            m.totals.documents,
            m.totals.sentences,
            m.totals.bytes as f64 / 1e6,
            m.inputs.len(),
            m.elapsed_seconds
        ),
    }
    let written = m.shards.iter().filter(|s| s.file_bytes.is_some()).count();
    println!(
        "output: {} ({written} shard file(s) written by this process)",
        args.output.display()
    );
    for s in m.shards.iter().filter(|s| s.file_bytes.is_some()) {
        println!(
            "  {}  {} documents, {} sentences, {} bytes",
            s.file, s.documents, s.sentences, s.bytes
        );
    }
    println!(
        "test fraction {:.4} (asked {}), train imbalance {:.2}% of sentences and {:.2}% of bytes",
        m.totals.test_fraction_achieved,
        args.test_fraction,
        m.totals.train_sentence_imbalance * 100.0,
        m.totals.train_byte_imbalance * 100.0
    );
    println!("manifest: {}", manifest_path.display());
    Ok(())
}

/// Reads stdin in batches, tokenizes each batch in parallel, writes JSONL in input order.
fn tokenize(args: TokenizeArgs) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::{BufRead, BufWriter};
    let tokenizer = bertkit_tokenizer::FullTokenizer::from_vocab_file(&args.vocab, !args.cased)?;
    let stdin = std::io::stdin().lock();
    let mut out = BufWriter::new(std::io::stdout().lock());
    let mut lines = stdin.split(b'\n');
    let mut line_number = 0u64;
    loop {
        let mut batch = Vec::with_capacity(4096);
        for raw in lines.by_ref().take(4096) {
            line_number += 1;
            let raw = raw?;
            let text = String::from_utf8(raw)
                .map_err(|_| format!("stdin line {line_number}: not valid UTF-8"))?;
            let text = if args.jsonl_input {
                let value: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| format!("stdin line {line_number}: not JSON: {e}"))?;
                match value.get("text").and_then(|t| t.as_str()) {
                    Some(t) => t.to_string(),
                    None => {
                        return Err(
                            format!("stdin line {line_number}: no string \"text\" field").into(),
                        );
                    }
                }
            } else {
                text
            };
            batch.push(text);
        }
        if batch.is_empty() {
            break;
        }
        for (tokens, ids) in tokenizer.tokenize_batch(&batch) {
            serde_json::to_writer(
                &mut out,
                &serde_json::json!({ "tokens": tokens, "ids": ids }),
            )?;
            out.write_all(b"\n")?;
        }
    }
    out.flush()?;
    Ok(())
}

fn pipeline(args: PipelineArgs) -> Result<(), Box<dyn std::error::Error>> {
    let config = bertkit_pipeline::PipelineConfig::load(&args.config)?;
    let registry = bertkit_download::sources::Registry::load(&args.registry)?;
    println!(
        "pipeline {} into {}",
        args.config.display(),
        config.output.display()
    );
    let options = bertkit_pipeline::RunOptions {
        ranks: args.ranks.ranks()?,
        wait_timeout: Duration::from_secs(args.wait_timeout),
        ..Default::default()
    };
    if options.ranks.world_size > 1 {
        println!("  {} (steps of other ranks are not listed)", options.ranks);
    }
    let started = Instant::now();
    let reports = bertkit_pipeline::run(
        &config,
        &registry,
        args.mirror.as_deref(),
        &options,
        &mut |event| match event {
            bertkit_pipeline::Event::Step(r) => {
                let state = if r.up_to_date { "up to date" } else { "done" };
                println!(
                    "  {:<18} {:<10} {:>7.2} s  {}",
                    r.step, state, r.seconds, r.summary
                );
            }
            bertkit_pipeline::Event::Waiting(message) => eprintln!("  {message}"),
        },
    )?;
    let redone = reports.iter().filter(|r| !r.up_to_date).count();
    println!(
        "{} step(s) run, {} up to date, {:.2} s in all",
        redone,
        reports.len() - redone,
        started.elapsed().as_secs_f64()
    );
    for dir in ["raw", "formatted", "shards", "records"] {
        println!("  {}", config.output.join(dir).display());
    }
    Ok(())
}

fn download_sources(args: DownloadSourcesArgs) -> Result<(), Box<dyn std::error::Error>> {
    let registry = bertkit_download::sources::Registry::load(&args.registry)?;
    let vars = args.vars.into_iter().collect();
    let options = bertkit_download::sources::SetOptions {
        fetch: bertkit_download::FetchOptions {
            retries: args.retries,
            ..Default::default()
        },
        queue: bertkit_download::queue::QueueOptions {
            jobs: args.jobs,
            per_host: args.per_host,
            min_interval: Duration::from_millis(args.interval_ms),
        },
        ranks: args.ranks.ranks()?,
    };
    let progress = DownloadProgress::new();
    let started = Instant::now();
    let done = bertkit_download::sources::download_set(
        &registry,
        &args.set,
        &vars,
        &args.output,
        args.mirror.as_deref(),
        &options,
        &progress,
    )?;
    let fetched = done
        .iter()
        .filter(|(_, o)| !matches!(o, bertkit_download::Outcome::AlreadyPresent { .. }))
        .count();
    let bytes: u64 = done
        .iter()
        .map(|(_, o)| match o {
            bertkit_download::Outcome::Downloaded { bytes, .. }
            | bertkit_download::Outcome::Copied { bytes }
            | bertkit_download::Outcome::AlreadyPresent { bytes } => *bytes,
        })
        .sum();
    if fetched == 0 {
        println!(
            "{}: set {:?} is complete ({} files, {bytes} bytes); nothing to do.",
            args.output.display(),
            args.set,
            done.len()
        );
        return Ok(());
    }
    println!(
        "set {:?}: {fetched} of {} file(s) fetched{} into {} ({bytes} bytes, {:.1} s)",
        args.set,
        done.len(),
        args.mirror
            .as_ref()
            .map(|m| format!(" from {m}"))
            .unwrap_or_default(),
        args.output.display(),
        started.elapsed().as_secs_f64()
    );
    for (path, outcome) in &done {
        let how = match outcome {
            bertkit_download::Outcome::AlreadyPresent { .. } => "already present",
            bertkit_download::Outcome::Copied { .. } => "copied",
            bertkit_download::Outcome::Downloaded { .. } => "downloaded",
        };
        println!("  {path}  {how}");
    }
    Ok(())
}

fn download_url(args: DownloadUrlArgs) -> Result<(), Box<dyn std::error::Error>> {
    let checksum = bertkit_download::Checksum::from_one_of(
        args.sha256.as_deref(),
        args.sha1.as_deref(),
        args.md5.as_deref(),
    )?;
    let options = bertkit_download::FetchOptions {
        retries: args.retries,
        ..Default::default()
    };
    let progress = DownloadProgress::new();
    let outcome = bertkit_download::fetch(
        &args.url,
        &args.output,
        checksum.as_ref(),
        &options,
        &progress,
    )?;
    let verified = if checksum.is_some() {
        ", checksum verified"
    } else {
        ""
    };
    match outcome {
        bertkit_download::Outcome::AlreadyPresent { bytes } => {
            println!(
                "{} is already complete ({bytes} bytes{verified}); nothing to do.",
                args.output.display()
            )
        }
        bertkit_download::Outcome::Copied { bytes } => {
            println!(
                "copied {} to {} ({bytes} bytes{verified})",
                args.url,
                args.output.display()
            )
        }
        bertkit_download::Outcome::Downloaded {
            bytes,
            resumed_from,
            attempts,
        } => {
            let resumed = if resumed_from > 0 {
                format!(", resumed at {resumed_from}")
            } else {
                String::new()
            };
            println!(
                "downloaded {} to {} ({bytes} bytes{verified}{resumed}, {attempts} request(s))",
                args.url,
                args.output.display()
            )
        }
    }
    Ok(())
}

fn records(args: RecordsArgs) -> Result<(), Box<dyn std::error::Error>> {
    use bertkit_records::instances::InstanceOptions;
    use bertkit_records::run::{Compat, RecordsOptions};
    let preset = if args.phase == 2 {
        InstanceOptions::phase2()
    } else {
        InstanceOptions::phase1()
    };
    let options = RecordsOptions {
        instances: InstanceOptions {
            max_seq_length: args.max_seq_length.unwrap_or(preset.max_seq_length),
            max_predictions_per_seq: args
                .max_predictions_per_seq
                .unwrap_or(preset.max_predictions_per_seq),
            masked_lm_prob: args.masked_lm_prob,
            short_seq_prob: args.short_seq_prob,
            dupe_factor: args.dupe_factor,
            whole_word_mask: args.whole_word_mask,
            seed: args.seed,
        },
        lower_case: !args.cased,
        compat: if args.compat.is_some() {
            Compat::Google
        } else {
            Compat::None
        },
    };
    if options.instances.max_seq_length < 5 {
        return Err("--max-seq-length must be at least 5".into());
    }
    let started = std::time::Instant::now();
    let summaries = if args.output.extension().is_some_and(|e| e == "parquet") {
        vec![bertkit_records::run::records_to_file(
            &args.input,
            &args.vocab,
            &args.output,
            args.jsonl.as_deref(),
            &options,
        )?]
    } else {
        if args.jsonl.is_some() {
            return Err("--jsonl needs a .parquet output (file mode)".into());
        }
        let report = |s: &bertkit_records::run::FileSummary| {
            if s.skipped {
                eprintln!("{}: up to date, skipped", s.output.display());
            } else {
                eprintln!(
                    "{}: {} instances from {} documents",
                    s.output.display(),
                    s.instances,
                    s.documents
                );
            }
        };
        bertkit_records::run::records_to_dir(
            &args.input,
            &args.vocab,
            &args.output,
            &options,
            &report,
        )?
    };
    let instances: usize = summaries.iter().map(|s| s.instances).sum();
    let tokens: usize = summaries.iter().map(|s| s.tokens).sum();
    let skipped = summaries.iter().filter(|s| s.skipped).count();
    let secs = started.elapsed().as_secs_f64();
    if skipped == summaries.len() {
        println!(
            "{} is up to date (same inputs, vocabulary and parameters); nothing to do.",
            args.output.display()
        );
        return Ok(());
    }
    println!(
        "wrote {} file(s) ({} up to date): {instances} instances, {tokens} tokens in {secs:.2} s ({:.0} instances/s)",
        summaries.len() - skipped,
        skipped,
        instances as f64 / secs.max(1e-9)
    );
    for s in summaries.iter().filter(|s| !s.skipped) {
        println!(
            "  {}  {} instances (tokenize {:.3} s, instances {:.3} s, write {:.3} s)",
            s.output.display(),
            s.instances,
            s.seconds.tokenize,
            s.seconds.instances,
            s.seconds.write
        );
    }
    Ok(())
}

/// Runs a format stage with progress on stderr, then prints its summary on stdout.
fn report(
    common: &CommonArgs,
    stage: impl FnOnce(&StderrObserver) -> Result<RunOutcome, bertkit_format::FormatError>,
) -> Result<(), bertkit_format::FormatError> {
    let observer = StderrObserver::new(common.quiet);
    let outcome = stage(&observer)?;
    observer.finish_line();
    print_summary(&outcome, &common.output);
    Ok(())
}

fn main() -> ExitCode {
    configure_allocator();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn forward(args: ForwardArgs) -> Result<(), Box<dyn std::error::Error>> {
    use bertkit_model::bert::{BertModel, load_frozen};
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let device = bertkit_model::parse_device(&args.device)?;
    let started = Instant::now();
    let loaded = load_frozen::<BertModel>(&args.model, dtype, &device)?;
    if !loaded.params.initialised.is_empty() {
        eprintln!(
            "warning: {} has no {}; initialised at random",
            args.model.display(),
            loaded.params.initialised.join(", ")
        );
    }
    let inputs = candle_core::safetensors::load(&args.input, &device)
        .map_err(|e| format!("{}: {e}", args.input.display()))?;
    let input_ids = inputs
        .get("input_ids")
        .ok_or_else(|| format!("{}: no input_ids tensor", args.input.display()))?;
    let model_inputs = bertkit_model::Inputs::new(
        &loaded.config,
        input_ids,
        inputs.get("token_type_ids"),
        inputs.get("attention_mask"),
    )
    .map_err(|e| format!("{}: {e}", args.input.display()))?;
    let out = loaded
        .model
        .forward(&model_inputs, bertkit_model::Mode::Eval, true)?;
    let f32 = |t: &candle_core::Tensor| -> Result<candle_core::Tensor, candle_core::Error> {
        t.to_dtype(candle_core::DType::F32)?
            .to_device(&candle_core::Device::Cpu)
    };
    let mut tensors = std::collections::HashMap::new();
    tensors.insert(
        "last_hidden_state".to_string(),
        f32(&out.last_hidden_state)?,
    );
    if let Some(p) = &out.pooler_output {
        tensors.insert("pooler_output".to_string(), f32(p)?);
    }
    for (i, h) in out.hidden_states.iter().enumerate() {
        tensors.insert(format!("hidden_states.{i}"), f32(h)?);
    }
    let partial = bertkit_stage_io::partial_path(&args.output);
    candle_core::safetensors::save(&tensors, &partial)?;
    std::fs::rename(&partial, &args.output)?;
    let (batch, seq) = input_ids.dims2()?;
    println!(
        "{}: {} tensors for {batch} sequence(s) of {seq} ({}, {:?}, {} layers, {:.2} s)",
        args.output.display(),
        tensors.len(),
        args.dtype,
        device.location(),
        loaded.config.num_hidden_layers,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn pretrain(args: PretrainArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut config = bertkit_train::config::PretrainConfig::load(&args.config)?;
    if let Some(data) = args.data {
        config.data.records = vec![data];
    }
    if let Some(output) = args.output {
        config.output = output;
    }
    if let Some(device) = args.device {
        config.train.device = device;
    }
    let options = bertkit_train::trainer::RunOptions {
        max_steps: args.max_steps,
        resume: args.resume,
        ranks: args.ranks.ranks()?,
    };
    let mut trainer = bertkit_train::trainer::Trainer::new(config.clone(), options)?;
    let last = args
        .max_steps
        .unwrap_or(config.schedule.total_steps)
        .min(config.schedule.total_steps);
    let params = trainer.model().params.count();
    println!(
        "pretrain {}: {:.1} M parameters, {} sequences in {} file(s), micro-batch {} x {} accumulation = {} per step, steps {}..{} of {}, {} on {}",
        config.output.display(),
        params as f64 / 1e6,
        trainer.dataset().sequences(),
        trainer.dataset().paths().len(),
        config.data.micro_batch,
        trainer.accumulation(),
        config.train.global_batch,
        trainer.step(),
        last,
        config.schedule.total_steps,
        config.train.precision,
        config.train.device
    );
    let terminal = std::io::stderr().is_terminal();
    let bar = indicatif::ProgressBar::new(last);
    bar.set_position(trainer.step());
    if terminal {
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} ETA {eta} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let started = Instant::now();
    let mut last_log = Instant::now();
    let summary = trainer.run(&mut |m| {
        let line = format!(
            "step {} loss {:.4} (mlm {:.4}, nsp {:.4}) acc {:.3}/{:.3} lr {:.3e} |g| {:.3} {:.1} seq/s {:.0} tok/s {:.3} TFLOP/s{}{}",
            m.step,
            m.loss,
            m.mlm_loss,
            m.nsp_loss,
            m.mlm_accuracy,
            m.nsp_accuracy,
            m.lr,
            m.grad_norm,
            m.seq_per_s,
            m.tokens_per_s,
            m.tflops,
            m.mfu.map(|u| format!(" MFU {:.1}%", u * 100.0)).unwrap_or_default(),
            if m.skipped { format!(" skipped (loss scale {})", m.loss_scale) } else { String::new() },
        );
        bar.set_position(m.step);
        if terminal {
            bar.set_message(format!("loss {:.3}", m.loss));
        }
        if !terminal && (last_log.elapsed() >= Duration::from_secs(10) || m.step == last) {
            eprintln!("{line}");
            last_log = Instant::now();
        } else if terminal && m.step % 50 == 0 {
            bar.println(line);
        }
    })?;
    bar.finish_and_clear();
    let first = summary.metrics.first();
    let end = summary.metrics.last();
    println!(
        "steps {}..{} in {:.1} s; loss {} -> {}; metrics in {}",
        summary.started_at,
        summary.step,
        started.elapsed().as_secs_f64(),
        first.map_or("-".into(), |m| format!("{:.4}", m.loss)),
        end.map_or("-".into(), |m| format!("{:.4}", m.loss)),
        config.output.join("metrics.jsonl").display()
    );
    if let Some(c) = summary.checkpoint {
        println!("checkpoint: {}", c.display());
    }
    Ok(())
}

fn plot(args: PlotArgs) -> Result<(), Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(&args.metrics)
        .map_err(|e| format!("{}: {e}", args.metrics.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: {e}", args.metrics.display(), i + 1))?;
        rows.push(v);
    }
    let svg = bertkit_train::plot::svg(&rows)?;
    let partial = bertkit_stage_io::partial_path(&args.output);
    std::fs::write(&partial, svg)?;
    std::fs::rename(&partial, &args.output)?;
    println!("{}: {} steps plotted", args.output.display(), rows.len());
    Ok(())
}

fn plan(args: PlanArgs) -> Result<(), Box<dyn std::error::Error>> {
    let config = match args.config.as_str() {
        "base" => bertkit_model::BertConfig::base(),
        "large" => bertkit_model::BertConfig::large(),
        path => bertkit_model::BertConfig::load(std::path::Path::new(path))?,
    };
    let memory = bertkit_train::plan::parse_bytes(&args.gpu_mem)?;
    let precision = bertkit_train::plan::Precision::parse(&args.precision)?;
    println!(
        "{} layers, hidden {}, {:.1} M parameters; {} GPU memory, {}, activation checkpointing {}",
        config.num_hidden_layers,
        config.hidden_size,
        bertkit_train::plan::parameters(&config) as f64 / 1e6,
        args.gpu_mem,
        args.precision,
        if args.checkpointing { "on" } else { "off" }
    );
    println!(
        "{:>6} {:>10} {:>12} {:>12} {:>14} {:>14} {:>12}",
        "seq", "fits", "micro-batch", "state GiB", "act GiB/seq", "global batch", "accumulate"
    );
    for (i, &seq) in args.seq.iter().enumerate() {
        let predictions = *args
            .predictions
            .get(i)
            .or(args.predictions.last())
            .unwrap_or(&20);
        let global = *args
            .global_batch
            .get(i)
            .or(args.global_batch.last())
            .unwrap_or(&256);
        let p = bertkit_train::plan::plan(
            &config,
            seq,
            predictions,
            precision,
            args.checkpointing,
            memory,
        );
        let gib = |b: f64| b / (1u64 << 30) as f64;
        // A power of two divides the recipe's global batches exactly.
        let micro = if p.micro_batch == 0 {
            0
        } else {
            1usize << p.micro_batch.ilog2()
        };
        let accumulate = if micro == 0 {
            "-".to_string()
        } else {
            global.div_ceil(micro).to_string()
        };
        println!(
            "{seq:>6} {:>10} {micro:>12} {:>12.2} {:>14.3} {global:>14} {accumulate:>12}",
            p.micro_batch,
            gib(p.state_bytes),
            gib(p.activation_bytes_per_sequence),
        );
    }
    println!(
        "(an analytic estimate: weights, gradients, optimiser state, activations, 10% reserve; not yet calibrated on a GPU)"
    );
    Ok(())
}

fn bench_inference(args: BenchInferenceArgs) -> Result<(), Box<dyn std::error::Error>> {
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let device = bertkit_model::parse_device(&args.device)?;
    println!("{} ({}, {})", args.model.display(), args.dtype, args.device);
    println!(
        "{:>6} {:>6} {:>6} {:>10} {:>9} {:>9} {:>9}",
        "seq", "batch", "runs", "seq/s", "p50 ms", "p90 ms", "p99 ms"
    );
    let settings = bertkit_tasks::inference::BenchSettings {
        seqs: args.seq.clone(),
        batches: args.batch.clone(),
        dtype,
        min_seconds: args.seconds,
        composed: args.composed,
    };
    bertkit_tasks::inference::bench(&args.model, &settings, &device, &mut |r| {
        println!(
            "{:>6} {:>6} {:>6} {:>10.1} {:>9.2} {:>9.2} {:>9.2}",
            r.seq,
            r.batch,
            r.runs,
            r.sequences_per_s,
            r.latency_ms[0],
            r.latency_ms[1],
            r.latency_ms[2]
        )
    })?;
    Ok(())
}
