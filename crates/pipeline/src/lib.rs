//! # bertkit-pipeline: the data pipeline runner
//!
//! Runs download → format (wiki, books) → shard → records (phase 1 and/or 2) from one TOML
//! config (`pipelines/data.toml`, `pipelines/demo.toml`). Outputs go under the config's
//! `output` folder:
//! `raw/` (downloads), `formatted/wiki/`, `formatted/books/`, `shards/`, `records/phase1/`,
//! `records/phase2/`, and the held-out records pre-training evaluates on,
//! `records/phase1-heldout/` and `records/phase2-heldout/` (from the first test shards). Each step is the stage's own library call, with its own manifest and
//! no-op check, so a re-run skips every step whose inputs and parameters are unchanged. A run
//! killed at any point finishes on the next run: every stage writes atomically and ignores its
//! own leftovers. The runner reports what each step did and how long it took.
//!
//! ## Several processes
//! With [`RunOptions::ranks`] (from `RANK`/`WORLD_SIZE`, `SLURM_PROCID`/`SLURM_NTASKS` or
//! `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`), every rank runs the same config on a shared
//! output folder and takes a disjoint part of each step:
//! - **download**: file `i` of each set (registry order) is rank `i % W`'s;
//! - **format**: the wiki and books jobs are dealt to ranks 0 and 1 (mod W);
//! - **shard**: every rank reads and shuffles the whole corpus and writes shards `g % W == R`
//!   (see the shard crate);
//! - **records**: train shard `i` (sorted by name) is rank `i % W`'s, per phase; so is held-out
//!   shard `i`.
//!
//! A [`merge::MergePoints`] barrier follows each step, since the next one reads what all ranks
//! wrote; the last one (`done`) means the whole output is complete whichever rank exits first.
//! The files are byte-identical to a single-process run (the shard manifests are written per
//! rank, `shard.manifest.rank-R-of-W.json`).

#![deny(missing_docs)]

pub mod merge;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bertkit_stage_io::Ranks;
use bertkit_stage_io::cost::{Cost, Meter};
use bertkit_stage_io::stage::{Event, Outcome, Reporter};
use serde::Deserialize;

use crate::merge::MergePoints;

/// The `[download]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DownloadConfig {
    /// Source sets of `pipelines/sources.toml` to fetch.
    pub sets: Vec<String>,
    /// Template variables (`date`, `repo`, …). Ordered, so every rank's fingerprint of the
    /// config (its `Debug` text) is the same.
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
}

/// The `[format]` table: inputs relative to `<output>/raw`, with `{name}` filled from the
/// download's `vars` (so one `date` names the dump to fetch and to format).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FormatConfig {
    /// Wikipedia dumps.
    #[serde(default)]
    pub wiki: Vec<String>,
    /// Book files or folders.
    #[serde(default)]
    pub books: Vec<String>,
}

/// The `[shard]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardConfig {
    /// Train shards.
    pub num_train_shards: usize,
    /// Test shards.
    #[serde(default)]
    pub num_test_shards: usize,
    /// Share of sentences in the test split.
    #[serde(default)]
    pub test_fraction: f64,
    /// Seed.
    pub seed: u64,
    /// `"zstd"` for compressed shards.
    pub compress: Option<String>,
}

/// The `[records]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordsConfig {
    /// Vocabulary, relative to `<output>/raw` (`{name}` filled from the download's `vars`).
    pub vocab: String,
    /// Passes over the corpus.
    pub dupe_factor: usize,
    /// Seed.
    pub seed: u64,
    /// Which phases to make: 1 (128 / 20) and/or 2 (512 / 80).
    pub phases: Vec<u8>,
    /// Held-out records for pre-training's evaluation, per phase, in
    /// `records/phase{N}-heldout/`: made from the first this many test shards, with a dupe
    /// factor of 1 (0: none).
    #[serde(default = "default_heldout_shards")]
    pub heldout_shards: usize,
}

fn default_heldout_shards() -> usize {
    1
}

/// A pipeline config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Output root (relative paths are relative to the current directory).
    pub output: PathBuf,
    /// Downloads.
    pub download: DownloadConfig,
    /// Formatting.
    pub format: FormatConfig,
    /// Sharding.
    pub shard: ShardConfig,
    /// Pre-training records.
    pub records: RecordsConfig,
}

impl PipelineConfig {
    /// Parses a config file.
    pub fn load(path: &Path) -> Result<Self, PipelineError> {
        let text = bertkit_stage_io::read_text(path)
            .map_err(|e| PipelineError::Config(format!("{}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| PipelineError::Config(format!("{}: {e}", path.display())))
    }
}

/// Why a pipeline stopped.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The config is unreadable or inconsistent.
    #[error("{0}")]
    Config(String),
    /// A step's stage failed.
    #[error("step {step}: {source}")]
    Step {
        /// The step.
        step: String,
        /// The stage's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The ranks could not meet after a step.
    #[error("step {step}: {message}")]
    Merge {
        /// The step.
        step: String,
        /// What went wrong, and where.
        message: String,
    },
}

/// What one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The step's name.
    pub step: String,
    /// Whether it was already done (nothing was redone).
    pub up_to_date: bool,
    /// A one-line summary (documents, sentences, instances, bytes).
    pub summary: String,
    /// Wall and CPU time, and the step's peak memory.
    pub cost: Cost,
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// This process's share of the work.
    pub ranks: Ranks,
    /// How long a rank waits at a merge point.
    pub wait_timeout: Duration,
    /// Download concurrency and politeness.
    pub queue: bertkit_download::queue::QueueOptions,
    /// Download retries and timeouts.
    pub fetch: bertkit_download::FetchOptions,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            ranks: Ranks::single(),
            wait_timeout: Duration::from_secs(86_400),
            queue: Default::default(),
            fetch: Default::default(),
        }
    }
}

fn fingerprint(config: &PipelineConfig, mirror: Option<&str>, ranks: Ranks) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    format!("{config:?}").hash(&mut h);
    mirror.hash(&mut h);
    ranks.world_size.hash(&mut h);
    format!("{:016x}", h.finish())
}

fn step_err<E: std::error::Error + Send + Sync + 'static>(
    step: &str,
) -> impl Fn(E) -> PipelineError + '_ {
    move |e| PipelineError::Step {
        step: step.into(),
        source: Box::new(e),
    }
}

/// Runs this rank's part of the pipeline. `registry` is the source registry; `mirror`, if
/// given, replaces every download URL. `reporter` hears of each step this rank finished
/// ([`Event::Finished`], named by the step), of waits at merge points, and of the stages'
/// progress and warnings. Returns the reports of this rank's steps: up to date when every one
/// of them was.
pub fn run(
    config: &PipelineConfig,
    registry: &bertkit_download::sources::Registry,
    mirror: Option<&str>,
    options: &RunOptions,
    reporter: &dyn Reporter,
) -> Result<Outcome<Vec<StepReport>>, PipelineError> {
    let root = &config.output;
    let raw = root.join("raw");
    // The paths under raw/ are resolved before anything runs, so a variable the config lacks
    // stops the run before a download.
    let vars: HashMap<String, String> = config.download.vars.clone().into_iter().collect();
    let raw_paths = |paths: &[String]| -> Result<Vec<PathBuf>, PipelineError> {
        paths
            .iter()
            .map(|p| {
                bertkit_download::sources::fill(p, &vars)
                    .map(|p| raw.join(p))
                    .map_err(|e| PipelineError::Config(format!("{p}: {e}")))
            })
            .collect()
    };
    let wiki_inputs = raw_paths(&config.format.wiki)?;
    let books_inputs = raw_paths(&config.format.books)?;
    let vocab = raw_paths(std::slice::from_ref(&config.records.vocab))?.remove(0);
    let ranks = options.ranks;
    let merge = MergePoints::new(
        root,
        fingerprint(config, mirror, ranks),
        ranks,
        options.wait_timeout,
    );
    let mut reports = Vec::new();
    let emit = |r: StepReport, reports: &mut Vec<StepReport>| {
        reporter.report(&Event::Finished {
            task: &r.step,
            summary: &format!("{} ({})", r.summary, r.cost.describe()),
            up_to_date: r.up_to_date,
        });
        reports.push(r);
    };
    let arrive = |step: &str| merge.arrive(step, &mut |m| reporter.report(&Event::Message(m)));
    // The stages' progress and warnings reach the caller; their own notes and per-file lines
    // give way to one line per step.
    let stage_reporter = |e: &Event<'_>| {
        if matches!(e, Event::Progress(_) | Event::Warning(_)) {
            reporter.report(e)
        }
    };

    // Download.
    for set in &config.download.sets {
        let step = format!("download {set}");
        let meter = Meter::start();
        let done = bertkit_download::sources::download_set(
            registry,
            set,
            &vars,
            &raw,
            mirror,
            &bertkit_download::sources::SetOptions {
                fetch: options.fetch.clone(),
                queue: options.queue.clone(),
                ranks,
            },
            &stage_reporter,
        )
        .map_err(step_err(&step))?;
        let up_to_date = done.is_up_to_date();
        let done = done.into_summary();
        let fetched = done
            .iter()
            .filter(|(_, f)| !matches!(f, bertkit_download::Fetched::AlreadyPresent { .. }))
            .count();
        emit(
            StepReport {
                step,
                up_to_date,
                summary: format!("{} files, {fetched} fetched", done.len()),
                cost: meter.finish(),
            },
            &mut reports,
        );
    }
    arrive("download")?;

    // Format: the wiki and books jobs, dealt to ranks.
    let mut formatted = Vec::new();
    let format_step =
        |kind: &str, outcome: Outcome<bertkit_format::FormatManifest>, meter: Meter| {
            let m = outcome.summary();
            let written = m
                .counts
                .get("articles_written")
                .or_else(|| m.counts.get("books_written"));
            StepReport {
                step: format!("format {kind}"),
                up_to_date: outcome.is_up_to_date(),
                summary: format!(
                    "{} documents, {} sentences, {} bytes",
                    written.and_then(|v| v.as_u64()).unwrap_or(0),
                    m.counts["sentences"],
                    m.counts["bytes"]
                ),
                cost: meter.finish(),
            }
        };
    let mut format_jobs = 0;
    let mut owns_next = || {
        format_jobs += 1;
        ranks.owns(format_jobs - 1)
    };
    if !config.format.wiki.is_empty() && owns_next() {
        let meter = Meter::start();
        let inputs = wiki_inputs;
        let out = root.join("formatted/wiki");
        let outcome =
            bertkit_format::wiki::format_wiki(&inputs, &out, &Default::default(), &stage_reporter)
                .map_err(step_err("format wiki"))?;
        emit(format_step("wiki", outcome, meter), &mut reports);
    }
    if !config.format.wiki.is_empty() {
        formatted.push(root.join("formatted/wiki"));
    }
    if !config.format.books.is_empty() && owns_next() {
        let meter = Meter::start();
        let inputs = books_inputs;
        let out = root.join("formatted/books");
        let outcome = bertkit_format::books::format_books(
            &inputs,
            &out,
            &Default::default(),
            &stage_reporter,
        )
        .map_err(step_err("format books"))?;
        emit(format_step("books", outcome, meter), &mut reports);
    }
    if !config.format.books.is_empty() {
        formatted.push(root.join("formatted/books"));
    }
    if formatted.is_empty() {
        return Err(PipelineError::Config(
            "[format] lists no wiki or books inputs".into(),
        ));
    }
    arrive("format")?;

    // Shard.
    let meter = Meter::start();
    let shards = root.join("shards");
    let s = &config.shard;
    let options = bertkit_shard::ShardOptions {
        num_train_shards: s.num_train_shards,
        num_test_shards: s.num_test_shards,
        test_fraction: s.test_fraction,
        seed: s.seed,
        compression: bertkit_shard::Compression::from_name(
            s.compress.as_deref(),
            bertkit_shard::DEFAULT_ZSTD_LEVEL,
        )
        .map_err(|e| PipelineError::Config(format!("[shard] compress: {e}")))?,
        rank: ranks.rank,
        world_size: ranks.world_size,
        ..Default::default()
    };
    let outcome = bertkit_shard::shard(&formatted, &shards, &options, &stage_reporter)
        .map_err(step_err("shard"))?;
    let m = outcome.summary();
    emit(
        StepReport {
            step: "shard".into(),
            up_to_date: outcome.is_up_to_date(),
            summary: format!(
                "{} documents into {} shards, test fraction {:.4}, train imbalance {:.2}%",
                m.totals.documents,
                m.shards.len(),
                m.totals.test_fraction_achieved,
                m.totals.train_sentence_imbalance * 100.0
            ),
            cost: meter.finish(),
        },
        &mut reports,
    );
    arrive("shard")?;

    // Records, per phase, from this rank's train shards, then the held-out records from its
    // share of the first test shards.
    let train_shards = ranks.share(
        bertkit_stage_io::text::expand_text_inputs(&[shards.join("train")])
            .map_err(step_err("records"))?,
    );
    let heldout_shards = ranks.share(
        bertkit_stage_io::text::expand_text_inputs(&[shards.join("test")])
            .map_err(step_err("records"))?
            .into_iter()
            .take(config.records.heldout_shards),
    );
    let jobs = [
        ("", &train_shards, config.records.dupe_factor),
        ("-heldout", &heldout_shards, 1),
    ];
    for ((suffix, inputs, dupe_factor), &phase) in jobs
        .iter()
        .flat_map(|job| config.records.phases.iter().map(move |p| (job, p)))
    {
        let (inputs, dupe_factor) = (*inputs, *dupe_factor);
        let step = if suffix.is_empty() {
            format!("records phase {phase}")
        } else {
            format!("records phase {phase} held-out")
        };
        let preset = bertkit_records::instances::InstanceOptions::phase(phase)
            .ok_or_else(|| PipelineError::Config(format!("[records] phases: no phase {phase}")))?;
        let options = bertkit_records::run::RecordsOptions {
            instances: bertkit_records::instances::InstanceOptions {
                dupe_factor,
                seed: config.records.seed,
                ..preset
            },
            lower_case: true,
            compat: bertkit_records::run::Compat::None,
        };
        let meter = Meter::start();
        let out = root.join(format!("records/phase{phase}{suffix}"));
        if inputs.is_empty() {
            continue;
        }
        let summaries =
            bertkit_records::run::records_to_dir(inputs, &vocab, &out, &options, &stage_reporter)
                .map_err(step_err(&step))?;
        let summaries = summaries.into_summary();
        let written: Vec<_> = summaries.iter().filter(|s| !s.skipped).collect();
        emit(
            StepReport {
                step,
                up_to_date: written.is_empty(),
                summary: format!(
                    "{} files, {} instances, {} tokens written",
                    summaries.len(),
                    written.iter().map(|s| s.instances).sum::<usize>(),
                    written.iter().map(|s| s.tokens).sum::<usize>()
                ),
                cost: meter.finish(),
            },
            &mut reports,
        );
    }
    arrive("done")?;
    Ok(if reports.iter().all(|r| r.up_to_date) {
        Outcome::UpToDate(reports)
    } else {
        Outcome::Ran(reports)
    })
}
