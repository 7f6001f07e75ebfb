//! # bertkit-shard: the shard stage
//!
//! Splits formatted text (the format stage's output: one sentence per line, a blank line
//! between documents; `.txt` or `.txt.zst`, from any number of sources at once) into
//! `train/shard_NNNNN.txt[.zst]` and `test/shard_NNNNN.txt[.zst]`, in the same format, with a
//! manifest. Whatever the corpus size, in bounded memory.
//!
//! ## How
//! 1. **Shuffle, externally** ([`runs`]). Each document gets a pseudo-random key from
//!    `(seed, ordinal)`, where the ordinal is its position across all inputs. Documents are
//!    gathered into runs of at most `run_bytes` (default 64 MiB), each run is sorted by key
//!    and spilled to a temporary file under the output directory, and a k-way merge yields every
//!    document in key order: a seeded random permutation of the corpus. Documents from every
//!    source and topic are therefore interleaved.
//! 2. **Assign** ([`balance`]). The shuffled stream is taken in windows of 32 MiB of new
//!    documents; within a window documents are placed largest first: each goes to the split
//!    that is behind its target share of the sentences (the test split holds `test_fraction`
//!    of the sentences, counted like NVIDIA's recipe), then to the shard of that split whose
//!    sentence and byte loads are lowest relative to the split's mean. The smallest documents
//!    seen so far (up to 64 MiB) are held back as a reserve and placed with later windows, so
//!    that large documents arriving late can still be evened out; the reserve is placed last.
//!    Every document lands whole in exactly one shard. A window is written in shuffled order,
//!    so each shard's documents are in pseudo-random order, except that the reserve (the
//!    corpus's smallest documents, about 64 MiB in all) ends up at the ends of the shards.
//! 3. **Write** ([`output`]). Each shard receives its documents in shuffled order. Shards are
//!    written under hidden `.partial` names, compressed afterwards if asked (one encoder per
//!    worker), and renamed into place only when all are done. The manifest is written last.
//!
//! ## Memory
//! Two phases hold memory, and neither grows with the corpus (BENCHMARKS.md measures it). The
//! library's peak is the larger of the two; the `bertkit` binary's allocator (mimalloc) keeps
//! what the first phase freed, so its resident peak is closer to their sum (181–216 MB on whole
//! enwiki articles with the defaults; a test checks it stays under 256 MiB):
//! - reading: the run being gathered and sorted, `run_bytes` (default 64 MiB) plus about 64
//!   bytes per document;
//! - merging and writing: `FAN_IN (256) × (64 KiB read buffer + one document)`, plus the
//!   32 MiB placement window and the 64 MiB reserve of small documents, plus `shards × 128 KiB`
//!   write buffers, plus `threads ×` one zstd encoder (a few MiB at level 1) while
//!   compressing. A corpus smaller than `run_bytes` is shuffled in memory instead.
//!
//! Measured: 110–131 MB peak RSS from 129 MB to 2 GB of input with 72 shards (BENCHMARKS.md).
//!
//! Temporary disk space is about one copy of the corpus, plus the plain shard text while
//! compressing.
//!
//! ## Determinism and distribution
//! The same inputs (in the same order), parameters and seed give byte-identical shards,
//! whatever the thread count. The assignment depends on the whole corpus, so in a distributed
//! run ([`ShardOptions::rank`], [`ShardOptions::world_size`], or the `RANK` / `WORLD_SIZE`
//! variables that torchrun, srun and mpirun set) every rank reads and shuffles the whole corpus
//! but writes only its own shards: global shard `g` (train shards first, then test) belongs to
//! rank `g % world_size`. The union of all ranks' shards is byte-identical to a single-machine
//! run. This divides the writing and compression, not the reading.
//!
//! ## Restarts
//! Re-running with the same inputs (path and size, and modification time or else contents; see
//! `bertkit_stage_io::InputFile::same_file_as`) and parameters finds the manifest and its
//! files and does nothing. Changed inputs or parameters rebuild. A run that is killed leaves
//! only hidden `.partial` files and the temporary folder, which the next run removes before it
//! starts.

#![deny(missing_docs)]

pub mod balance;
pub mod error;
pub mod manifest;
pub mod output;
pub mod runs;

use std::path::{Path, PathBuf};
use std::time::Instant;

use bertkit_stage_io::InputFile;
use bertkit_stage_io::stage::{Event, Outcome, Reporter};
use serde::{Deserialize, Serialize};

pub use balance::Split;
pub use error::ShardError;
pub use manifest::{ShardFile, ShardManifest, Totals};
pub use output::Compression;

/// The zstd level of compressed shards unless asked otherwise. Shards are intermediate files,
/// read once per records phase: level 1 compresses 1.4x faster than zstd's default 3 (the
/// stage's whole CPU time -27% on 477 MB of text, BENCHMARKS.md) for files 12% larger.
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

/// Bytes of new shuffled documents placed together (largest first). Part of the algorithm, so a
/// constant: memory settings never change the output.
pub const WINDOW_BYTES: usize = 32 << 20;

/// Bytes of the smallest documents held back from each window for later ones (a reserve of
/// filler that evens out the large documents of later windows, the last one included). The
/// repair this allows is about `RESERVE_BYTES / shards` per shard, so it needs to be of the
/// order of (shards × the largest document); a constant, like the window.
pub const RESERVE_BYTES: usize = 64 << 20;

/// Name of the temporary folder inside the output directory (of a single-process run; each
/// rank of a multi-process run has its own, see [`tmp_dir_name`]).
pub const TMP_DIR: &str = ".shard-tmp";

/// The temporary folder of `rank` of `world_size`: ranks sharing an output folder on a shared
/// file system must not clear each other's runs.
pub fn tmp_dir_name(rank: usize, world_size: usize) -> String {
    if world_size == 1 {
        TMP_DIR.to_string()
    } else {
        format!("{TMP_DIR}.rank-{rank:05}")
    }
}

/// Options of a shard run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardOptions {
    /// Number of train shards (at least 1).
    pub num_train_shards: usize,
    /// Number of test shards (at least 1 when `test_fraction > 0`).
    pub num_test_shards: usize,
    /// Share of the sentences that go to the test split, in `[0, 1)`.
    pub test_fraction: f64,
    /// Seed of the shuffle.
    pub seed: u64,
    /// Output compression.
    pub compression: Compression,
    /// This process's rank in a distributed run.
    #[serde(skip)]
    pub rank: usize,
    /// Number of processes in a distributed run.
    pub world_size: usize,
    /// Worker threads (0: one per core); does not change the output.
    #[serde(skip)]
    pub threads: usize,
    /// Bytes of documents gathered per sorted run; does not change the output.
    #[serde(skip)]
    pub run_bytes: usize,
}

impl Default for ShardOptions {
    fn default() -> Self {
        ShardOptions {
            num_train_shards: 1,
            num_test_shards: 0,
            test_fraction: 0.0,
            seed: 12345,
            compression: Compression::None,
            rank: 0,
            world_size: 1,
            threads: 0,
            run_bytes: 64 << 20,
        }
    }
}

fn validate(options: &ShardOptions) -> Result<(), ShardError> {
    let usage = |m: &str| Err(ShardError::Usage(m.into()));
    if options.num_train_shards == 0 {
        return usage("--num-train-shards must be at least 1");
    }
    if !(0.0..1.0).contains(&options.test_fraction) {
        return usage("--test-fraction must be at least 0 and below 1");
    }
    if options.test_fraction > 0.0 && options.num_test_shards == 0 {
        return usage("--test-fraction is above 0 but --num-test-shards is 0");
    }
    if options.test_fraction == 0.0 && options.num_test_shards > 0 {
        return usage(
            "--num-test-shards is above 0 but --test-fraction is 0: the test shards would be empty",
        );
    }
    if options.world_size == 0 || options.rank >= options.world_size {
        return usage("--rank must be below --world-size");
    }
    if let Compression::Zstd { level } = options.compression
        && !(1..=19).contains(&level)
    {
        return usage("--zstd-level must be between 1 and 19");
    }
    Ok(())
}

/// Shards `inputs` (files or folders of formatted text) into `output_dir`.
///
/// `reporter` hears what the run is doing now and then.
pub fn shard(
    inputs: &[PathBuf],
    output_dir: &Path,
    options: &ShardOptions,
    reporter: &dyn Reporter,
) -> Result<Outcome<ShardManifest>, ShardError> {
    let started = Instant::now();
    validate(options)?;
    let files = bertkit_stage_io::text::expand_text_inputs(inputs)?;
    let mut input_files = files
        .iter()
        .map(|p| InputFile::stat(p).map_err(|e| ShardError::io(p, e)))
        .collect::<Result<Vec<_>, _>>()?;
    let parameters = serde_json::to_value(options).expect("options serialise");
    let manifest_path = output_dir.join(ShardManifest::file_name(options.rank, options.world_size));
    if let Some(existing) = ShardManifest::read(&manifest_path)
        && existing.is_up_to_date(output_dir, &input_files, &parameters)
    {
        return Ok(Outcome::UpToDate(existing));
    }
    std::fs::create_dir_all(output_dir).map_err(|e| ShardError::io(output_dir, e))?;
    match std::fs::remove_file(&manifest_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(ShardError::io(&manifest_path, e));
        }
        _ => {}
    }
    let tmp = output_dir.join(tmp_dir_name(options.rank, options.world_size));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| ShardError::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| ShardError::io(&tmp, e))?;
    let threads = if options.threads == 0 {
        rayon::current_num_threads()
    } else {
        options.threads
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| ShardError::Usage(format!("cannot start {threads} worker threads: {e}")))?;

    // 1. Read every document, key it, and gather sorted runs.
    let mut runs = runs::RunWriter::new(&tmp, options.run_bytes, &pool);
    let (mut documents, mut sentences, mut bytes) = (0u64, 0u64, 0u64);
    for (i, path) in files.iter().enumerate() {
        reporter.report(&Event::Message(&format!(
            "reading {} ({} documents so far)",
            path.display(),
            documents
        )));
        let mut reader = bertkit_stage_io::text::DocumentReader::open(path)?;
        while let Some(doc) = reader.next_document()? {
            sentences += u64::from(doc.sentences);
            bytes += doc.text.len() as u64 + 1;
            runs.push(runs::Keyed {
                key: runs::shuffle_key(options.seed, documents),
                ordinal: documents,
                doc,
            })?;
            documents += 1;
        }
        input_files[i].sha256 = reader.finish()?;
    }
    if documents == 0 {
        return Err(ShardError::Usage(format!(
            "the inputs hold no document (no non-blank line): {}",
            files
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    reporter.report(&Event::Message(&format!(
        "shuffling {documents} documents ({:.1} MB)",
        bytes as f64 / 1e6
    )));
    let shuffled = runs.finish()?;

    // 2 and 3. Assign in shuffled order and write.
    let world = options.world_size;
    let rank = options.rank;
    let mut shards = output::ShardSet::create(
        output_dir,
        options.num_train_shards,
        options.num_test_shards,
        options.compression,
        |global| global % world == rank,
    )?;
    let mut balancer = balance::Balancer::new(
        options.num_train_shards,
        options.num_test_shards,
        options.test_fraction,
    );
    // Windows of the shuffled stream are placed largest first; the smallest documents seen so
    // far (up to RESERVE_BYTES) wait for later windows, so that every window, the last
    // included, has small documents to even out its large ones.
    let defer_bytes = RESERVE_BYTES as u64;
    let mut window: Vec<runs::Keyed> = Vec::new();
    // New bytes since the last placement (the reserve carried over is not counted).
    let mut window_bytes = 0usize;
    let mut place_window =
        |window: &mut Vec<runs::Keyed>, defer_bytes: u64| -> Result<(), ShardError> {
            let sizes: Vec<(u64, u64)> = window
                .iter()
                .map(|k| (u64::from(k.doc.sentences), k.doc.text.len() as u64 + 1))
                .collect();
            let placements = balancer.place_window(&sizes, defer_bytes);
            let mut carried = Vec::new();
            for (k, place) in window.drain(..).zip(placements) {
                match place {
                    Some(p) => {
                        shards.write(p.split, p.shard, &k.doc.text, u64::from(k.doc.sentences))?
                    }
                    None => {
                        carried.push(k);
                    }
                }
            }
            *window = carried;
            Ok(())
        };
    runs::for_each_in_order(shuffled, &tmp, |k| {
        window_bytes += k.doc.text.len() + std::mem::size_of::<runs::Keyed>();
        window.push(k);
        if window_bytes >= WINDOW_BYTES {
            place_window(&mut window, defer_bytes)?;
            window_bytes = 0;
        }
        Ok(())
    })?;
    place_window(&mut window, 0)?;
    reporter.report(&Event::Message("writing shards"));
    let records = shards.commit(&pool)?;
    std::fs::remove_dir_all(&tmp).map_err(|e| ShardError::io(&tmp, e))?;

    let of = |split: Split| records.iter().filter(move |r| r.split == split);
    let test_sentences: u64 = of(Split::Test).map(|r| r.sentences).sum();
    let totals = Totals {
        documents,
        sentences,
        bytes,
        test_sentences,
        test_fraction_achieved: test_sentences as f64 / sentences as f64,
        train_sentence_imbalance: manifest::imbalance(of(Split::Train).map(|r| r.sentences)),
        train_byte_imbalance: manifest::imbalance(of(Split::Train).map(|r| r.bytes)),
        test_sentence_imbalance: manifest::imbalance(of(Split::Test).map(|r| r.sentences)),
    };
    let manifest = ShardManifest {
        stage: "shard".into(),
        manifest_version: manifest::MANIFEST_VERSION,
        bertkit_version: env!("CARGO_PKG_VERSION").into(),
        parameters,
        inputs: input_files,
        shards: records,
        totals,
        elapsed_seconds: started.elapsed().as_secs_f64(),
    };
    manifest.write(&manifest_path)?;
    Ok(Outcome::Ran(manifest))
}
