//! # bertkit-fuzz-targets: what each fuzz target runs on one input
//!
//! Every parser that reads input a user hands bertkit has a target here: a function that takes
//! arbitrary bytes, runs the parser on them as the stage does, and returns normally whatever the
//! bytes are (an error is a fine answer; a panic, a hang or unbounded memory is a finding).
//! `fuzz/` (cargo fuzz, libFuzzer) calls them from its fuzz binaries; this crate's test replays
//! every input in `fuzz/regressions/<target>/` (each crash or slow input found, kept) and the
//! seed corpus, so what was fixed stays fixed under `make test`. FUZZING.md says how to run
//! them and what they found.
//!
//! The parsers that read files get the bytes through a scratch file in the temporary folder
//! (one per process and target), as users' files reach them.

pub mod seeds;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use bertkit_tokenizer::FullTokenizer;

/// A fuzz target: a name (its folder under `fuzz/`) and what it runs.
pub struct Target {
    /// The target's name, as `cargo fuzz run <name>` takes it.
    pub name: &'static str,
    /// Runs the parser on one input.
    pub run: fn(&[u8]),
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "wiki_xml",
        run: wiki_xml,
    },
    Target {
        name: "wikitext",
        run: wikitext,
    },
    Target {
        name: "dump_bz2",
        run: dump_bz2,
    },
    Target {
        name: "sentences",
        run: sentences,
    },
    Target {
        name: "books",
        run: books,
    },
    Target {
        name: "wordpiece",
        run: wordpiece,
    },
    Target {
        name: "records_parquet",
        run: records_parquet,
    },
    Target {
        name: "squad_json",
        run: squad_json,
    },
    Target {
        name: "glue_tsv",
        run: glue_tsv,
    },
    Target {
        name: "configs_toml",
        run: configs_toml,
    },
    Target {
        name: "download_text",
        run: download_text,
    },
    Target {
        name: "tf_checkpoint",
        run: tf_checkpoint,
    },
    Target {
        name: "metrics_plot",
        run: metrics_plot,
    },
    Target {
        name: "model_json",
        run: model_json,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// Where the inputs the fuzzers found are kept, one folder per target (`fuzz/regressions/`).
pub fn regressions_dir() -> PathBuf {
    bertkit_test_support::repo_root()
        .join("fuzz")
        .join("regressions")
}

/// The kept inputs of target `name`: each file of its regression folder, sorted by name.
pub fn regressions(name: &str) -> std::io::Result<Vec<(PathBuf, Vec<u8>)>> {
    let dir = regressions_dir().join(name);
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    paths.retain(|p| p.is_file() && !is_note(p));
    paths.sort();
    paths
        .into_iter()
        .map(|p| std::fs::read(&p).map(|bytes| (p, bytes)))
        .collect()
}

/// A regression folder's README (what each input found), not an input.
fn is_note(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "md")
}

/// `data` written to this process's scratch file `name`, for parsers that read files.
fn scratch_file(name: &str, data: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bertkit-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the temporary folder is writable");
    let path = dir.join(name);
    std::fs::write(&path, data).expect("the scratch file is writable");
    path
}

/// The first byte as a selector and the rest.
fn split_selector(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&first, rest)) => (first, rest),
        None => (0, data),
    }
}

/// The bert-base-uncased vocabulary (the shared data's MiniLM folder), uncased and cased.
fn tokenizer(lower_case: bool) -> &'static FullTokenizer {
    static UNCASED: OnceLock<FullTokenizer> = OnceLock::new();
    static CASED: OnceLock<FullTokenizer> = OnceLock::new();
    let cell = if lower_case { &UNCASED } else { &CASED };
    cell.get_or_init(|| {
        let vocab = bertkit_test_support::require("minilm/vocab.txt");
        FullTokenizer::from_vocab_file(&vocab, lower_case).expect("the shared vocabulary loads")
    })
}

/// A `<mediawiki>` XML segment through the page reader and the wikitext cleaner
/// (`format wiki`'s per-segment work); the first byte picks strict UTF-8 and list keeping.
pub fn wiki_xml(data: &[u8]) {
    use bertkit_format::wiki::{WikiOptions, pages::process_segment};
    let (selector, xml) = split_selector(data);
    let mut options = WikiOptions {
        strict: selector & 1 == 1,
        ..WikiOptions::default()
    };
    options.clean.keep_lists = selector & 2 == 2;
    let _ = process_segment(std::path::Path::new("fuzz.xml"), 0, xml, &options);
}

/// Wikitext (as the page reader hands it over, unescaped) through the cleaner alone.
pub fn wikitext(data: &[u8]) {
    use bertkit_format::wiki::markup::{CleanOptions, CleanStats, wikitext_to_paragraphs};
    let (selector, text) = split_selector(data);
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let options = CleanOptions {
        keep_lists: selector & 1 == 1,
    };
    let _ = wikitext_to_paragraphs(text, &options, &mut CleanStats::default());
}

/// The most XML a `dump_bz2` input may decode to: see [`dump_bz2`].
pub const DUMP_BZ2_MAX_XML_BYTES: u64 = 8 << 20;

/// A dump file (XML, bzip2, or multistream bzip2, recognised from its bytes as `format wiki`
/// does) through the reader that decodes it and cuts it into page-aligned segments.
///
/// bzip2 expands a run of one byte up to about 45,000 times, so a 1 kB input can decode to
/// tens of MB of XML. The reader's work on such an input is linear in what it decodes (a test
/// of the page cutter checks that), but under the fuzzer's instrumentation every byte compared
/// while looking for page starts is traced, so such an input alone passes the 1 s limit. Inputs
/// that decode to more than [`DUMP_BZ2_MAX_XML_BYTES`] are therefore left out (their first bytes
/// are decoded to tell, which the target's other work on them would do anyway).
pub fn dump_bz2(data: &[u8]) {
    use bertkit_format::wiki::source::{SourceMessage, detect, produce};
    if data.starts_with(b"BZh") {
        use std::io::Read;
        let mut decoded = bzip2::read::MultiBzDecoder::new(data).take(DUMP_BZ2_MAX_XML_BYTES + 1);
        if std::io::copy(&mut decoded, &mut std::io::sink())
            .is_ok_and(|n| n > DUMP_BZ2_MAX_XML_BYTES)
        {
            return;
        }
    }
    static POOL: OnceLock<std::sync::Arc<rayon::ThreadPool>> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        std::sync::Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .expect("a thread pool"),
        )
    });
    let path = scratch_file("dump.xml.bz2", data);
    let Ok(kind) = detect(&path) else {
        return;
    };
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    let pool = pool.clone();
    // Small segments, so that short inputs are cut too.
    let producer = std::thread::spawn(move || produce(path, kind, 4096, pool, tx));
    for message in rx {
        if let SourceMessage::Done { .. } | SourceMessage::Failed(_) = message {
            break;
        }
    }
    producer.join().expect("the reader does not panic");
}

/// A paragraph through the sentence splitter.
pub fn sentences(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = bertkit_format::sentences::split_sentences(text);
    }
}

/// A book file (any bytes: UTF-8, Latin-1, licence header and footer) through the books
/// cleaner.
pub fn books(data: &[u8]) {
    let _ = bertkit_format::books::format_book(data);
}

/// Text through Google's basic tokenizer and WordPiece (uncased or cased by the first byte).
pub fn wordpiece(data: &[u8]) {
    let (selector, text) = split_selector(data);
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let tokenizer = tokenizer(selector & 1 == 0);
    let _ = tokenizer.tokenize_ids(text);
    let _ = bertkit_tokenizer::basic_tokenize(text, selector & 1 == 0);
}

/// A records file (Parquet: footer, schema, row groups, the vocabulary in its metadata)
/// through the reader the trainer uses, every row group read.
pub fn records_parquet(data: &[u8]) {
    use bertkit_records::reader::RecordsFile;
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        // The reader turns a panic inside the parquet crate's decoders into an error (they
        // panic on some damaged pages; see `RecordsFile::read_row_group`): such a panic is
        // let unwind to it, silently; every other panic still goes to the hook before (the
        // fuzzer's, which aborts: a finding). One the reader failed to catch would still
        // abort, in libFuzzer's `catch_unwind` around the target.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let in_parquet = info
                .location()
                .is_some_and(|l| l.file().contains("/parquet-") && l.file().contains("/src/"));
            if !in_parquet {
                previous(info);
            }
        }));
    });
    let path = scratch_file("records.parquet", data);
    let Ok(file) = RecordsFile::open(&path) else {
        return;
    };
    let _ = file.vocabulary();
    let _ = file.max_seq_length();
    for group in 0..file.row_group_rows().len() {
        if file.read_row_group(group).is_err() {
            break;
        }
    }
}

/// A SQuAD JSON file through the reader, the examples (training and prediction, v1.1 or
/// v2.0 by the first byte) and the windows of tokens, with small windows.
pub fn squad_json(data: &[u8]) {
    use bertkit_tasks::squad::data::Dataset;
    use bertkit_tasks::squad::features::{FeatureOptions, build_features, read_examples};
    let (selector, json) = split_selector(data);
    let Ok(dataset) = serde_json::from_slice::<Dataset>(json) else {
        return;
    };
    let training = selector & 1 == 1;
    let version_2 = selector & 2 == 2;
    let Ok(examples) = read_examples(&dataset, training, version_2) else {
        return;
    };
    let options = FeatureOptions {
        max_seq_length: 64,
        doc_stride: 16,
        max_query_length: 16,
    };
    let _ = build_features(&examples, tokenizer(true), &options, training);
    let _ = bertkit_tasks::squad::eval::evaluate(&dataset, &Default::default());
}

/// A GLUE TSV file through the task's reader (MRPC, CoLA, SST-2 or MNLI by the first byte).
pub fn glue_tsv(data: &[u8]) {
    use bertkit_tasks::glue::data::{Task, read};
    let (selector, tsv) = split_selector(data);
    let name = ["mrpc", "cola", "sst-2", "mnli"][usize::from(selector % 4)];
    let task = Task::parse(name).expect("a known task");
    let path = scratch_file("glue.tsv", tsv);
    let _ = read(task, &path);
}

/// A TOML file as a pre-training run config (parsed, checked for 1-3 ranks, its model
/// built), a pipeline config or a download registry, by the first byte.
pub fn configs_toml(data: &[u8]) {
    let (selector, toml) = split_selector(data);
    let path = scratch_file("config.toml", toml);
    match selector % 3 {
        0 => {
            if let Ok(config) = bertkit_train::config::PretrainConfig::load(&path) {
                for ranks in 1..=3 {
                    let _ = config.validate(ranks);
                    let _ = config.accumulation(ranks);
                }
                let _ = config.bert_config();
            }
        }
        1 => {
            let _ = bertkit_pipeline::PipelineConfig::load(&path);
        }
        _ => {
            if let Ok(registry) = bertkit_download::sources::Registry::load(&path) {
                let _ = registry.sets();
            }
        }
    }
}

/// What the download stage parses from servers and lists: a checksum file (looked up by
/// name), a URL list, a file name from a URL, and a `Content-Range` header.
pub fn download_text(data: &[u8]) {
    use bertkit_download::sources::{lookup_checksum, name_from_url, parse_url_list};
    use bertkit_download::{Algorithm, ContentRange};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let first_name = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("x");
    for algorithm in [Algorithm::Sha256, Algorithm::Sha1, Algorithm::Md5] {
        let _ = lookup_checksum(text, first_name, algorithm);
    }
    if let Ok(list) = parse_url_list(text, "fuzz.txt") {
        for (url, _) in list {
            let _ = name_from_url(&url);
        }
    }
    for line in text.lines() {
        let _ = ContentRange::parse(line);
    }
}

/// A TensorFlow checkpoint index (`convert tf-checkpoint`'s first read): its table, header and
/// entries parsed, then every entry read and checked against the fixture's data shard (real
/// bytes at whatever offsets and sizes the input claims), as f32 where it is floating point.
/// An even first byte gives the rest as the index file; an odd one as rows (key and value
/// separated by 0xff bytes) put into a well-formed table, so that mutations reach the header
/// and entry decoding past the blocks' checksums.
pub fn tf_checkpoint(data: &[u8]) {
    use bertkit_tf_checkpoint::{Checkpoint, data_path, index_table};
    let (selector, rest) = split_selector(data);
    let built;
    let data = if selector % 2 == 1 {
        let parts: Vec<&[u8]> = rest.split(|&b| b == 0xff).collect();
        let rows: Vec<(&[u8], &[u8])> = parts
            .chunks(2)
            .map(|kv| (kv[0], kv.get(1).copied().unwrap_or(&[])))
            .collect();
        built = index_table(&rows);
        &built[..]
    } else {
        rest
    };
    let index = scratch_file("bert_model.ckpt.index", data);
    let prefix = index.with_extension("");
    let shard = data_path(&prefix, 0, 1);
    if !shard.is_file() {
        let fixture = bertkit_test_support::repo_root()
            .join("crates/model/tests/fixtures/google_tf/bert_model.ckpt.data-00000-of-00001");
        std::fs::copy(fixture, &shard).expect("the scratch folder is writable");
    }
    if let Ok(checkpoint) = Checkpoint::from_index(prefix, data) {
        for entry in checkpoint.entries() {
            let _ = checkpoint.read_bytes(entry);
            let _ = checkpoint.read_f32(entry);
        }
    }
}

/// A run's `metrics.jsonl` through `bertkit plot`: every line parsed, the curves, their ranges
/// and ticks, the SVG written.
pub fn metrics_plot(data: &[u8]) {
    let metrics = scratch_file("metrics.jsonl", data);
    let svg = metrics.with_file_name("metrics.svg");
    let _ = bertkit_train::plot::plot_file(&metrics, &svg);
}

/// The JSON files of a model folder and a checkpoint, by the first byte: a `config.json`
/// (read, checked, written back in transformers' form), a `tokenizer_config.json` (its
/// casing), or a checkpoint's `checksums.json` (the checkpoint verified against it: every
/// file it names read and hashed).
pub fn model_json(data: &[u8]) {
    let (selector, json) = split_selector(data);
    match selector % 3 {
        0 => {
            let path = scratch_file("config.json", json);
            if let Ok(config) = bertkit_model::BertConfig::load(&path) {
                let _ = config.num_labels();
                let _ = config.to_hf_json("BertModel", &[]);
            }
        }
        1 => {
            let path = scratch_file("tokenizer_config.json", json);
            let _ = bertkit_tokenizer::folder::lower_case_of(path.parent().expect("a folder"));
        }
        _ => {
            let path = scratch_file("checksums.json", json);
            let _ = bertkit_train::checkpoint::verify(path.parent().expect("a folder"));
        }
    }
}
