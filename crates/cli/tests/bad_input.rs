//! The bad-input table (BAD_INPUT.md), a test per row: for each input a user hands bertkit,
//! what a truncated file, bad encoding, a wrong schema or shape, an empty file and a missing
//! file do. Each is refused with exit code 1 and one `error:` naming the file and, where the
//! format has one, the position; or it is a counted skip where the table says skipping is the
//! behaviour. Never a panic, never a silent wrong result.

use std::path::{Path, PathBuf};
use std::process::Output;

use bertkit_test_support::{repo_root, require};

use crate::util::{bertkit, book_records, ok, path as p, text};

const ENWIKI: &str =
    "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2";

/// Asserts the run was refused: exit code 1, an `error:` line naming `file` (its path as
/// given, or its name), each of `says`, and no panic. Returns stderr.
fn refused(run: Output, file: &Path, says: &[&str]) -> String {
    let err = text(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "not refused with exit 1: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    let name = file.file_name().unwrap().to_string_lossy();
    assert!(
        line.contains(&*file.to_string_lossy()) || line.contains(&*name),
        "the error does not name {}: {err}",
        file.display()
    );
    for s in says {
        assert!(err.contains(s), "expected {s:?} in: {err}");
    }
    err
}

/// The run's summary `counts` (the JSON object format prints after `counts:`).
fn counts(stdout: &str) -> serde_json::Value {
    let json = &stdout[stdout.find("counts: ").expect("a counts line") + "counts: ".len()..];
    serde_json::Deserializer::from_str(json)
        .into_iter::<serde_json::Value>()
        .next()
        .unwrap()
        .unwrap()
}

fn write(path: &Path, bytes: impl AsRef<[u8]>) -> PathBuf {
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// The first `n` bytes of a file.
fn head(path: &Path, n: usize) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    bytes[..n.min(bytes.len())].to_vec()
}

/// A file with its second half cut off.
fn cut_in_half(from: &Path, to: &Path) -> PathBuf {
    let bytes = std::fs::read(from).unwrap();
    write(to, &bytes[..bytes.len() / 2])
}

// --- Wikipedia dumps: `format wiki` -------------------------------------------------------

fn format_wiki(input: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "format",
        "wiki",
        "--input",
        p(input),
        "--output",
        p(out),
        "-q",
    ];
    args.extend_from_slice(extra);
    bertkit(&args)
}

/// A small `<mediawiki>` dump of one article with `text` as its wikitext.
fn one_page_dump(text: &[u8]) -> Vec<u8> {
    let mut xml = b"<mediawiki>\n<page>\n<title>Alpha</title>\n<ns>0</ns>\n<id>1</id>\n\
                    <revision>\n<text xml:space=\"preserve\">"
        .to_vec();
    xml.extend_from_slice(text);
    xml.extend_from_slice(b"</text>\n</revision>\n</page>\n</mediawiki>\n");
    xml
}

#[test]
fn dump_truncated() {
    let dir = tempfile::tempdir().unwrap();
    // Compressed: the bzip2 error with the compressed offset.
    let cut = cut_in_half(&require(ENWIKI), &dir.path().join("cut.xml.bz2"));
    refused(
        format_wiki(&cut, &dir.path().join("o1"), &[]),
        &cut,
        &["bzip2 data is corrupt or truncated near compressed byte offset"],
    );
    // Plain XML cut inside a page: the page named, with the offset where it starts.
    let xml = one_page_dump(b"Alpha is a letter.");
    let cut = write(&dir.path().join("cut.xml"), &xml[..xml.len() - 40]);
    refused(
        format_wiki(&cut, &dir.path().join("o2"), &[]),
        &cut,
        &["byte offset", "not closed"],
    );
    assert!(!dir.path().join("o2/wiki.manifest.json").exists());
}

#[test]
fn dump_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let dump = write(
        &dir.path().join("latin1.xml"),
        one_page_dump(b"Caf\xe9 is not UTF-8 here."),
    );
    // By default: the page is skipped, counted and warned about with its offset.
    let run = format_wiki(&dump, &dir.path().join("o1"), &[]);
    let stderr = text(&run.stderr);
    let stdout = ok(run);
    assert_eq!(counts(&stdout)["invalid_utf8_pages_skipped"], 1);
    assert_eq!(counts(&stdout)["articles_written"], 0);
    assert!(
        stderr.contains("latin1.xml: page 'Alpha' skipped: invalid UTF-8 at byte offset"),
        "{stderr}"
    );
    // --strict: an error at the same offset.
    refused(
        format_wiki(&dump, &dir.path().join("o2"), &["--strict"]),
        &dump,
        &["invalid UTF-8 at byte offset", "in page 'Alpha'"],
    );
}

#[test]
fn dump_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let rss = write(
        &dir.path().join("feed.xml"),
        "<?xml version=\"1.0\"?>\n<rss><channel><title>News</title></channel></rss>\n",
    );
    refused(
        format_wiki(&rss, &dir.path().join("o1"), &[]),
        &rss,
        &["not a Wikipedia XML dump: the root element is <rss>, not <mediawiki>"],
    );
    let text_file = write(&dir.path().join("notes.txt"), "just some text\n");
    refused(
        format_wiki(&text_file, &dir.path().join("o2"), &[]),
        &text_file,
        &["not a Wikipedia XML dump: expected XML"],
    );
}

#[test]
fn dump_empty() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(&dir.path().join("empty.xml.bz2"), b"");
    refused(
        format_wiki(&empty, &dir.path().join("o"), &[]),
        &empty,
        &["not a Wikipedia XML dump"],
    );
}

#[test]
fn dump_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.xml.bz2");
    refused(
        format_wiki(&missing, &dir.path().join("o"), &[]),
        &missing,
        &["No such file or directory"],
    );
    assert!(!dir.path().join("o/wiki.manifest.json").exists());
}

// --- Books: `format books` ----------------------------------------------------------------

fn format_books(input: &Path, out: &Path) -> Output {
    bertkit(&[
        "format",
        "books",
        "--input",
        p(input),
        "--output",
        p(out),
        "-q",
    ])
}

/// The text of a formatted output folder's files.
fn formatted_text(out: &Path) -> String {
    let mut all = String::new();
    for entry in std::fs::read_dir(out).unwrap().flatten() {
        if entry.path().extension().is_some_and(|e| e == "txt") {
            all.push_str(&std::fs::read_to_string(entry.path()).unwrap());
        }
    }
    all
}

#[test]
fn book_truncated() {
    // A download cut short: the licence header is there, the footer is not. The text is kept
    // to where the file ends (nothing tells a cut book from a whole one without its footer).
    let dir = tempfile::tempdir().unwrap();
    let emma = std::fs::read_to_string(require("gutenberg/austen-emma.txt")).unwrap();
    let body: String = emma.lines().take(300).map(|l| format!("{l}\n")).collect();
    let book = write(
        &dir.path().join("cut.txt"),
        format!("Licence words.\n\n*** START OF THE PROJECT GUTENBERG EBOOK EMMA ***\n\n{body}"),
    );
    let out = dir.path().join("o");
    let stdout = ok(format_books(&book, &out));
    assert_eq!(counts(&stdout)["license_blocks_stripped"], 1);
    assert_eq!(counts(&stdout)["books_written"], 1);
    let written = formatted_text(&out);
    assert!(!written.contains("Licence words"));
    let last_words = body
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap()
        .trim();
    let last_word = last_words.split_whitespace().last().unwrap();
    assert!(written.contains(last_word), "{last_word:?} missing");
}

#[test]
fn book_bad_encoding() {
    // Not UTF-8: read as Windows-1252/Latin-1, warned about and counted.
    let dir = tempfile::tempdir().unwrap();
    let book = write(
        &dir.path().join("latin1.txt"),
        b"The caf\xe9 was full.  The gar\xe7on ran between the tables all morning.\n",
    );
    let out = dir.path().join("o");
    let run = format_books(&book, &out);
    let stderr = text(&run.stderr);
    let stdout = ok(run);
    assert_eq!(counts(&stdout)["latin1_fallbacks"], 1);
    assert!(
        stderr.contains("latin1.txt: not UTF-8; read as Latin-1"),
        "{stderr}"
    );
    assert!(formatted_text(&out).contains("The café was full."));
}

#[test]
fn book_wrong_schema() {
    // Not text at all (weights, an archive): skipped, warned about and counted, instead of a
    // document of noise.
    let dir = tempfile::tempdir().unwrap();
    let book = write(
        &dir.path().join("weights.txt"),
        head(&require("minilm/model.safetensors"), 4096),
    );
    let run = format_books(&book, &dir.path().join("o"));
    let stderr = text(&run.stderr);
    let stdout = ok(run);
    assert_eq!(counts(&stdout)["binary_skipped"], 1);
    assert_eq!(counts(&stdout)["books_written"], 0);
    assert!(
        stderr.contains("weights.txt: not text (a NUL byte at byte offset"),
        "{stderr}"
    );
}

#[test]
fn book_empty() {
    let dir = tempfile::tempdir().unwrap();
    let book = write(&dir.path().join("empty.txt"), b"");
    let run = format_books(&book, &dir.path().join("o"));
    let stderr = text(&run.stderr);
    let stdout = ok(run);
    assert_eq!(counts(&stdout)["empty_books_skipped"], 1);
    assert!(
        stderr.contains("empty.txt: no text left after cleaning; skipped"),
        "{stderr}"
    );
}

#[test]
fn book_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.txt");
    refused(
        format_books(&missing, &dir.path().join("o")),
        &missing,
        &["No such file or directory"],
    );
}

// --- Shards (formatted text): `records`, `shard` --------------------------------------------

fn records(input: &Path, vocab: &Path, out: &Path) -> Output {
    bertkit(&[
        "records",
        "--input",
        p(input),
        "--vocab",
        p(vocab),
        "--output",
        p(out),
    ])
}

/// Formatted text: the sample text's sentences, documents between blank lines.
fn shard_text() -> String {
    std::fs::read_to_string(require("bert/sample_text.txt")).unwrap()
}

#[test]
fn shard_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let compressed = zstd::encode_all(shard_text().as_bytes(), 3).unwrap();
    let shard = write(
        &dir.path().join("shard_00000.txt.zst"),
        &compressed[..compressed.len() * 3 / 4],
    );
    refused(
        records(&shard, &require("minilm/vocab.txt"), &dir.path().join("o")),
        &shard,
        &["zstd data is corrupt or truncated after byte offset"],
    );
}

#[test]
fn shard_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let shard = write(
        &dir.path().join("shard.txt"),
        b"A first sentence.\nA second one.\n\nCaf\xe9 in the third line.\n",
    );
    refused(
        records(&shard, &require("minilm/vocab.txt"), &dir.path().join("o")),
        &shard,
        &["line 4 (byte offset 33 of the decompressed text) is not valid UTF-8"],
    );
}

#[test]
fn shard_wrong_schema() {
    // A records file handed to the records stage as its text.
    let dir = tempfile::tempdir().unwrap();
    let parquet = book_records(dir.path());
    let shard = dir.path().join("records.txt");
    std::fs::copy(&parquet, &shard).unwrap();
    refused(
        records(&shard, &require("minilm/vocab.txt"), &dir.path().join("o")),
        &shard,
        &["is not valid UTF-8"],
    );
}

#[test]
fn shard_empty() {
    let dir = tempfile::tempdir().unwrap();
    let shard = write(&dir.path().join("shard.txt"), b"\n\n");
    refused(
        records(&shard, &require("minilm/vocab.txt"), &dir.path().join("o")),
        &shard,
        &["no document"],
    );
}

#[test]
fn shard_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("shard_00000.txt");
    refused(
        records(
            &missing,
            &require("minilm/vocab.txt"),
            &dir.path().join("o"),
        ),
        &missing,
        &["No such file or directory"],
    );
}

// --- Vocabularies: `records --vocab`, `tokenize --vocab` -------------------------------------

fn vocab_lines(n: usize) -> String {
    std::fs::read_to_string(require("minilm/vocab.txt"))
        .unwrap()
        .lines()
        .take(n)
        .map(|l| format!("{l}\n"))
        .collect()
}

fn records_with_vocab(dir: &Path, vocab: &Path) -> Output {
    let shard = write(&dir.join("shard.txt"), shard_text());
    records(&shard, vocab, &dir.join("o"))
}

#[test]
fn vocab_truncated() {
    // Cut before its special tokens.
    let dir = tempfile::tempdir().unwrap();
    let vocab = write(&dir.path().join("vocab.txt"), vocab_lines(50));
    refused(
        records_with_vocab(dir.path(), &vocab),
        &vocab,
        &["the vocabulary has no [UNK] token"],
    );
}

#[test]
fn vocab_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = vocab_lines(200).into_bytes();
    bytes.extend_from_slice(b"caf\xe9\n");
    let at = bytes.len() - 2;
    bytes.extend_from_slice(vocab_lines(300)[..].as_bytes());
    let vocab = write(&dir.path().join("vocab.txt"), bytes);
    refused(
        records_with_vocab(dir.path(), &vocab),
        &vocab,
        &[&format!("line 201 (byte offset {at}) is not valid UTF-8")],
    );
}

#[test]
fn vocab_wrong_schema() {
    // A GLUE file where the vocabulary should be.
    let dir = tempfile::tempdir().unwrap();
    let vocab = dir.path().join("dev.tsv");
    std::fs::copy(require("glue/MRPC/dev.tsv"), &vocab).unwrap();
    refused(
        records_with_vocab(dir.path(), &vocab),
        &vocab,
        &["the vocabulary has no [UNK] token"],
    );
}

#[test]
fn vocab_empty() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = write(&dir.path().join("vocab.txt"), b"");
    refused(
        records_with_vocab(dir.path(), &vocab),
        &vocab,
        &["the vocabulary has no [UNK] token"],
    );
}

#[test]
fn vocab_missing() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = dir.path().join("vocab.txt");
    refused(
        records_with_vocab(dir.path(), &vocab),
        &vocab,
        &["No such file or directory"],
    );
}

// --- Records: `pretrain --data` ----------------------------------------------------------

fn pretrain(data: &Path, run: &Path, extra: &[&str]) -> Output {
    let config = repo_root().join("pipelines/tiny.toml");
    let mut args = vec![
        "pretrain",
        "--config",
        p(&config),
        "--data",
        p(data),
        "--no-eval",
        "--output",
        p(run),
        "--max-steps",
        "1",
    ];
    args.extend_from_slice(extra);
    bertkit(&args)
}

#[test]
fn records_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let cut = cut_in_half(&book_records(dir.path()), &dir.path().join("cut.parquet"));
    refused(
        pretrain(&cut, &dir.path().join("run"), &[]),
        &cut,
        &["not a Parquet file"],
    );
    assert!(!dir.path().join("run/checkpoints").exists());
}

#[test]
fn records_bad_encoding() {
    // Bytes changed inside the row groups' pages (a bad disk, a bad copy): they would still
    // decode, to other ids (tried: the trainer and pyarrow both read such a file without an
    // error); each group's stored SHA-256 refuses them.
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let mut bytes = std::fs::read(&records).unwrap();
    let n = bytes.len();
    let footer = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().unwrap()) as usize;
    for i in (200..n - 8 - footer).step_by(4096) {
        bytes[i] ^= 0x01;
    }
    let bad = write(&dir.path().join("flipped.parquet"), bytes);
    refused(
        pretrain(&bad, &dir.path().join("run"), &[]),
        &bad,
        &["row group", "does not match its SHA-256 in the metadata"],
    );
}

#[test]
fn records_wrong_schema() {
    // A Parquet file that is not a records file (other columns, no bertkit metadata), written
    // by pyarrow as another tool would (`make test` installs it and sets BERTKIT_PYTHON).
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other.parquet");
    let python = std::env::var("BERTKIT_PYTHON").unwrap_or_else(|_| "python3".into());
    let made = std::process::Command::new(&python)
        .args([
            "-c",
            "import sys, pyarrow as pa, pyarrow.parquet as pq; \
             pq.write_table(pa.table({'text': ['a', 'b'], 'label': [0, 1]}), sys.argv[1])",
            p(&other),
        ])
        .output()
        .expect("python runs");
    assert!(
        made.status.success(),
        "{python} could not write Parquet (make test installs pyarrow and sets \
         BERTKIT_PYTHON): {}",
        text(&made.stderr)
    );
    refused(
        pretrain(&other, &dir.path().join("run"), &[]),
        &other,
        &["not a bertkit records file"],
    );
}

#[test]
fn records_empty() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(&dir.path().join("empty.parquet"), b"");
    refused(
        pretrain(&empty, &dir.path().join("run"), &[]),
        &empty,
        &["not a Parquet file", "too small"],
    );
}

#[test]
fn records_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("phase1");
    refused(
        pretrain(&missing, &dir.path().join("run"), &[]),
        &missing,
        &["No such file or directory"],
    );
}

// --- Model folders: `finetune`, `predict`, `forward` ----------------------------------------

/// A copy of the shared MiniLM folder in `dir/model`, with `change` applied.
fn model_copy(dir: &Path, change: impl FnOnce(&Path)) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "vocab.txt", "model.safetensors"] {
        std::fs::copy(require(format!("minilm/{f}")), model.join(f)).unwrap();
    }
    change(&model);
    model
}

fn finetune_glue(model: &Path, out: &Path) -> Output {
    let data = require("glue/MRPC");
    bertkit(&[
        "finetune",
        "glue",
        "--task",
        "mrpc",
        "--model",
        p(model),
        "--data",
        p(&data),
        "-o",
        p(out),
        "--max-steps",
        "1",
    ])
}

#[test]
fn model_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        cut_in_half(
            &require("minilm/model.safetensors"),
            &m.join("model.safetensors"),
        );
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("model.safetensors"),
        &["incomplete metadata"],
    );
}

#[test]
fn model_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        let config = std::fs::read_to_string(m.join("config.json")).unwrap();
        let at = config.find("\"model_type\"").unwrap_or(2);
        let mut bytes = config.as_bytes().to_vec();
        bytes.splice(at..at, b"\"n\\u00e9\": \"\xe9\", ".iter().copied());
        write(&m.join("config.json"), bytes);
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("config.json"),
        &["is not valid UTF-8", "byte offset"],
    );
}

#[test]
fn model_wrong_shape() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        let config = std::fs::read_to_string(m.join("config.json")).unwrap();
        let changed = config.replace("\"intermediate_size\": 1536", "\"intermediate_size\": 1024");
        assert_ne!(config, changed);
        write(&m.join("config.json"), changed);
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("model.safetensors"),
        &[
            "encoder.layer.0.intermediate.dense.weight: the checkpoint has shape [1536, 384], \
           the config needs [1024, 384]",
        ],
    );
}

#[test]
fn model_empty() {
    let dir = tempfile::tempdir().unwrap();
    // An empty folder, and a folder whose weights file is empty.
    let folder = dir.path().join("empty");
    std::fs::create_dir_all(&folder).unwrap();
    refused(
        finetune_glue(&folder, &dir.path().join("o1")),
        &folder.join("config.json"),
        &["not found (a model folder holds config.json and model.safetensors"],
    );
    let model = model_copy(dir.path(), |m| {
        write(&m.join("model.safetensors"), b"");
    });
    refused(
        finetune_glue(&model, &dir.path().join("o2")),
        &model.join("model.safetensors"),
        &["header too small"],
    );
}

#[test]
fn model_missing() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        std::fs::remove_file(m.join("model.safetensors")).unwrap();
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("model.safetensors"),
        &["not found (a model folder holds config.json and model.safetensors"],
    );
}

// --- Configs: `pretrain --config`, `pipeline --config` --------------------------------------

fn tiny_config() -> String {
    std::fs::read_to_string(repo_root().join("pipelines/tiny.toml")).unwrap()
}

fn pretrain_config(config: &Path) -> Output {
    bertkit(&["pretrain", "--config", p(config), "--max-steps", "1"])
}

fn pipeline_config(config: &Path) -> Output {
    bertkit(&["pipeline", "--config", p(config)])
}

#[test]
fn config_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let cut_at = config.find("[data]").unwrap() + "[data]\nrecords ".len();
    let cut = write(&dir.path().join("cut.toml"), &config[..cut_at]);
    refused(
        pretrain_config(&cut),
        &cut,
        &["TOML parse error at line", "expected `=`"],
    );
    let demo = std::fs::read_to_string(repo_root().join("pipelines/demo.toml")).unwrap();
    let cut_at = demo.find("[shard]").unwrap() + "[shard]\n".len() + 3;
    let cut = write(&dir.path().join("cut-pipeline.toml"), &demo[..cut_at]);
    refused(pipeline_config(&cut), &cut, &["TOML parse error at line"]);
}

#[test]
fn config_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = tiny_config().into_bytes();
    let at = bytes.len();
    bytes.extend_from_slice(b"# caf\xe9\n");
    let lines = bytes.iter().filter(|&&b| b == b'\n').count();
    let config = write(&dir.path().join("latin1.toml"), bytes);
    refused(
        pretrain_config(&config),
        &config,
        &[&format!(
            "line {lines} (byte offset {}) is not valid UTF-8",
            at + 5
        )],
    );
    refused(pipeline_config(&config), &config, &["is not valid UTF-8"]);
}

#[test]
fn config_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let misspelt = write(
        &dir.path().join("misspelt.toml"),
        tiny_config().replace("micro_batch = 16", "micro_bach = 16"),
    );
    refused(
        pretrain_config(&misspelt),
        &misspelt,
        &["unknown field `micro_bach`", "line 12"],
    );
    let wrong_type = write(
        &dir.path().join("type.toml"),
        tiny_config().replace("micro_batch = 16", "micro_batch = \"sixteen\""),
    );
    refused(
        pretrain_config(&wrong_type),
        &wrong_type,
        &["invalid type: string \"sixteen\", expected usize"],
    );
}

#[test]
fn config_empty() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(&dir.path().join("empty.toml"), b"");
    refused(pretrain_config(&empty), &empty, &["missing field `output`"]);
    refused(pipeline_config(&empty), &empty, &["missing field `output`"]);
}

#[test]
fn config_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("phase1.toml");
    refused(
        pretrain_config(&missing),
        &missing,
        &["No such file or directory"],
    );
    refused(
        pipeline_config(&missing),
        &missing,
        &["No such file or directory"],
    );
}

// --- SQuAD and GLUE files: `finetune squad`, `finetune glue` --------------------------------

fn finetune_squad(train: &Path, out: &Path) -> Output {
    let model = require("minilm");
    bertkit(&[
        "finetune",
        "squad",
        "--model",
        p(&model),
        "--train",
        p(train),
        "-o",
        p(out),
        "--max-steps",
        "1",
    ])
}

/// A GLUE task folder with MRPC's dev file as `dev.tsv` and `train` as `train.tsv`.
fn glue_folder(dir: &Path, train: impl AsRef<[u8]>) -> PathBuf {
    let folder = dir.join("MRPC");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(require("glue/MRPC/dev.tsv"), folder.join("dev.tsv")).unwrap();
    write(&folder.join("train.tsv"), train);
    folder
}

fn finetune_glue_data(data: &Path, out: &Path) -> Output {
    let model = require("minilm");
    bertkit(&[
        "finetune",
        "glue",
        "--task",
        "mrpc",
        "--model",
        p(&model),
        "--data",
        p(data),
        "-o",
        p(out),
        "--max-steps",
        "1",
    ])
}

#[test]
fn task_data_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(
        &dir.path().join("train.json"),
        head(&require("squad/dev-v1.1.json"), 3000),
    );
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["not SQuAD JSON: EOF while parsing", "line 1 column 3000"],
    );
    // A row cut short.
    let train = std::fs::read_to_string(require("glue/MRPC/train.tsv")).unwrap();
    let cut_at = train.match_indices('\n').nth(9).unwrap().0 + 20;
    let folder = glue_folder(dir.path(), &train[..cut_at]);
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["line 11: ", "columns"],
    );
}

#[test]
fn task_data_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(
        &dir.path().join("train.json"),
        b"{\"version\": \"1.1\", \"data\": [{\"title\": \"Caf\xe9\", \"paragraphs\": []}]}",
    );
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["line 1 (byte offset 42) is not valid UTF-8"],
    );
    let train = std::fs::read_to_string(require("glue/MRPC/train.tsv")).unwrap();
    let mut bytes: Vec<u8> = train.lines().take(5).collect::<Vec<_>>().join("\n").into();
    bytes.extend_from_slice(b"\n1\t1\t2\tThe caf\xe9 opened.\tIt opened.\n");
    let folder = glue_folder(dir.path(), bytes);
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["line 6 (byte offset", "is not valid UTF-8"],
    );
}

#[test]
fn task_data_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(
        &dir.path().join("train.json"),
        r#"{"version": "1.1", "data": [{"title": "x", "paragraphs": [{"text": "no context", "qas": []}]}]}"#,
    );
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["not SQuAD JSON: missing field `context`", "line 1 column"],
    );
    // CoLA's file where MRPC's should be.
    let folder = glue_folder(
        dir.path(),
        std::fs::read(require("glue/CoLA/train.tsv")).unwrap(),
    );
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["line 2: label", "is not one of [\"0\", \"1\"]"],
    );
}

#[test]
fn task_data_empty() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(&dir.path().join("train.json"), b"");
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["not SQuAD JSON: EOF while parsing a value at line 1 column 0"],
    );
    let header = std::fs::read_to_string(require("glue/MRPC/train.tsv"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    let folder = glue_folder(dir.path(), format!("{header}\n"));
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["no examples: the file is empty or holds only a header"],
    );
}

#[test]
fn task_data_missing() {
    let dir = tempfile::tempdir().unwrap();
    let squad = dir.path().join("train-v1.1.json");
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["No such file or directory"],
    );
    let folder = dir.path().join("MRPC");
    std::fs::create_dir_all(&folder).unwrap();
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["No such file or directory"],
    );
}

// --- SQuAD predictions: `evaluate squad` ----------------------------------------------------

fn evaluate(predictions: &Path) -> Output {
    let data = require("squad/dev-v1.1.json");
    bertkit(&[
        "evaluate",
        "squad",
        "--data",
        p(&data),
        "--predictions",
        p(predictions),
    ])
}

#[test]
fn predictions_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let cut = write(
        &dir.path().join("predictions.json"),
        head(&require("reference/squad_pred_first_gold.json"), 500),
    );
    refused(
        evaluate(&cut),
        &cut,
        &[
            "not a JSON object of question id to answer text: EOF while parsing",
            "column 500",
        ],
    );
}

#[test]
fn predictions_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        &dir.path().join("predictions.json"),
        b"{\n\"56be4db0acb8001400a502ec\": \"Caf\xe9\"\n}\n",
    );
    refused(
        evaluate(&bad),
        &bad,
        &["line 2 (byte offset 34) is not valid UTF-8"],
    );
}

#[test]
fn predictions_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let list = write(
        &dir.path().join("predictions.json"),
        r#"["Denver Broncos"]"#,
    );
    refused(
        evaluate(&list),
        &list,
        &["invalid type: sequence, expected a map"],
    );
    let number = write(
        &dir.path().join("numbers.json"),
        r#"{"56be4db0acb8001400a502ec": 5}"#,
    );
    refused(
        evaluate(&number),
        &number,
        &["invalid type: integer `5`, expected a string"],
    );
}

#[test]
fn predictions_empty() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(&dir.path().join("predictions.json"), b"");
    refused(
        evaluate(&empty),
        &empty,
        &["EOF while parsing a value at line 1 column 0"],
    );
}

#[test]
fn predictions_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("predictions.json");
    refused(evaluate(&missing), &missing, &["No such file or directory"]);
}

// --- Checkpoints: `pretrain --resume` -------------------------------------------------------

/// A run folder with a whole checkpoint at step 1 (tiny config, the book's records), and the
/// records.
fn checkpointed_run(dir: &Path) -> (PathBuf, PathBuf) {
    let records = book_records(dir);
    let run = dir.join("run");
    ok(pretrain(&records, &run, &[]));
    assert!(run.join("checkpoints/step-1/state.json").is_file());
    (run, records)
}

fn resume(records: &Path, run: &Path) -> Output {
    let config = repo_root().join("pipelines/tiny.toml");
    bertkit(&[
        "pretrain",
        "--config",
        p(&config),
        "--data",
        p(records),
        "--no-eval",
        "--output",
        p(run),
        "--max-steps",
        "2",
        "--resume",
    ])
}

#[test]
fn checkpoint_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let optimizer = run.join("checkpoints/step-1/optimizer.safetensors");
    cut_in_half(&optimizer.clone(), &optimizer);
    refused(resume(&records, &run), &optimizer, &["incomplete metadata"]);
}

#[test]
fn checkpoint_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let state = run.join("checkpoints/step-1/state.json");
    let mut bytes = std::fs::read(&state).unwrap();
    bytes.insert(3, 0xff);
    write(&state, bytes);
    refused(
        resume(&records, &run),
        &state,
        &["line 2 (byte offset 3) is not valid UTF-8"],
    );
}

#[test]
fn checkpoint_wrong_shape() {
    // Resumed with a config whose model is another (MiniLM's width where the run was tiny).
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let config = write(
        &dir.path().join("wider.toml"),
        tiny_config().replace(
            "preset = \"tiny\"",
            &format!("config = {:?}", p(&require("minilm/config.json"))),
        ),
    );
    let run_args = [
        "pretrain",
        "--config",
        p(&config),
        "--data",
        p(&records),
        "--no-eval",
        "--output",
        p(&run),
        "--max-steps",
        "2",
        "--resume",
    ];
    refused(
        bertkit(&run_args),
        &run.join("checkpoints/step-1/config.json"),
        &[
            "the checkpoint's model is not the run config's [model]",
            "hidden_size 32 (the config says 384)",
        ],
    );
}

#[test]
fn checkpoint_empty() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let model = run.join("checkpoints/step-1/model.safetensors");
    write(&model, b"");
    refused(resume(&records, &run), &model, &["header too small"]);
}

/// A run folder another run is writing (a second terminal, a launcher's retry): refused before
/// anything in it is read or cleaned up, naming the first run's pid and host; once that run
/// has let go, the same command runs.
#[test]
fn checkpoint_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    // A leftover of the first run's checkpoint being written: the second must not delete it.
    let partial = run.join("checkpoints/.step-2.partial");
    std::fs::create_dir_all(&partial).unwrap();
    let first = bertkit_stage_io::lock::FolderLock::acquire(&run).unwrap();
    let pid = format!("pid {} on host ", std::process::id());
    refused(
        resume(&records, &run),
        &run,
        &["is being written by another run", &pid],
    );
    assert!(
        partial.is_dir(),
        "the first run's partial checkpoint was touched"
    );
    // Fine-tuning's output folders too.
    let model = require("minilm");
    let out = dir.path().join("o");
    let held = bertkit_stage_io::lock::FolderLock::acquire(&out).unwrap();
    refused(
        finetune_glue(&model, &out),
        &out,
        &["is being written by another run", &pid],
    );
    drop(held);
    drop(first);
    let out = ok(resume(&records, &run));
    assert!(out.contains("steps 1..2"), "{out}");
}

#[test]
fn checkpoint_missing() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let optimizer = run.join("checkpoints/step-1/optimizer.safetensors");
    std::fs::remove_file(&optimizer).unwrap();
    refused(
        resume(&records, &run),
        &optimizer,
        &["No such file or directory"],
    );
    // No checkpoint at all: --resume starts the run from step 0, and says so.
    let fresh = dir.path().join("fresh");
    let run = resume(&records, &fresh);
    let stderr = text(&run.stderr);
    let out = ok(run);
    assert!(out.contains("steps 0..2"), "{out}");
    assert!(
        stderr.contains("note: --resume: no checkpoint under") && stderr.contains("step 0"),
        "{stderr}"
    );
}

// --- Google's TensorFlow checkpoints: `convert tf-checkpoint` ------------------------------

/// The fixture's checkpoint (Google's layout, written by TensorFlow) copied to `dir`; returns
/// its prefix.
fn tf_checkpoint_copy(dir: &Path) -> PathBuf {
    let fixture = repo_root().join("crates/model/tests/fixtures/google_tf");
    for f in [
        "bert_config.json",
        "vocab.txt",
        "bert_model.ckpt.index",
        "bert_model.ckpt.data-00000-of-00001",
    ] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    dir.join("bert_model.ckpt")
}

fn convert_tf(prefix: &Path, out: &Path) -> Output {
    let run = bertkit(&[
        "convert",
        "tf-checkpoint",
        "--checkpoint",
        p(prefix),
        "-o",
        p(out),
    ]);
    assert!(!out.join("model.safetensors").exists());
    run
}

#[test]
fn tf_checkpoint_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let index = dir.path().join("bert_model.ckpt.index");
    let bytes = std::fs::read(&index).unwrap();
    write(&index, &bytes[..bytes.len() - 100]);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["no table magic number at the end"],
    );
    // A data shard cut short: the first variable past its end is named.
    write(&index, &bytes);
    let data = dir.path().join("bert_model.ckpt.data-00000-of-00001");
    cut_in_half(&data.clone(), &data);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &data,
        &["tensor \"", "run past the file's", "(truncated?)"],
    );
}

#[test]
fn tf_checkpoint_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let data = dir.path().join("bert_model.ckpt.data-00000-of-00001");
    let mut bytes = std::fs::read(&data).unwrap();
    // Inside the first variable, a parameter (TensorFlow writes them in name order; the Adam
    // slots, skipped unread, would not be checked).
    bytes[5] ^= 0x01;
    write(&data, bytes);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &data,
        &[
            "tensor \"bert/embeddings/LayerNorm/beta\"",
            "CRC-32C mismatch",
            "the data file is damaged",
        ],
    );
    let index = dir.path().join("bert_model.ckpt.index");
    std::fs::copy(
        repo_root()
            .join("crates/model/tests/fixtures/google_tf/bert_model.ckpt.data-00000-of-00001"),
        &data,
    )
    .unwrap();
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[40] ^= 0x01;
    write(&index, bytes);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["data block at byte 0: CRC-32C mismatch"],
    );
}

#[test]
fn tf_checkpoint_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    // A config of another width than the checkpoint's.
    let config = dir.path().join("bert_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    write(
        &config,
        text.replace("\"intermediate_size\": 64", "\"intermediate_size\": 48"),
    );
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &prefix,
        &[
            "encoder.layer.0.intermediate.dense",
            "the config needs [48, 32]",
        ],
    );
    // Not a checkpoint index at all (a vocabulary given as one).
    let index = dir.path().join("bert_model.ckpt.index");
    std::fs::copy(dir.path().join("vocab.txt"), &index).unwrap();
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["not a checkpoint index"],
    );
}

#[test]
fn tf_checkpoint_empty() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let index = write(&dir.path().join("bert_model.ckpt.index"), b"");
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["0 bytes, shorter than a table's 48-byte footer"],
    );
}

#[test]
fn tf_checkpoint_missing() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let data = dir.path().join("bert_model.ckpt.data-00000-of-00001");
    std::fs::remove_file(&data).unwrap();
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &data,
        &["data shard 0 of 1", "No such file or directory"],
    );
    let index = dir.path().join("bert_model.ckpt.index");
    std::fs::remove_file(&index).unwrap();
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["No such file or directory"],
    );
}

// --- Text for `extract-features` ------------------------------------------------------------

#[test]
fn features_text_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(&dir.path().join("lines.txt"), b"fine\nbad \xff here\n");
    let out = dir.path().join("f.jsonl");
    let model = require("minilm");
    refused(
        bertkit(&[
            "extract-features",
            "--model",
            p(&model),
            "--input",
            p(&input),
            "-o",
            p(&out),
        ]),
        &input,
        &["line 2 (byte offset 9) is not valid UTF-8"],
    );
    assert!(!out.exists());
    // Nothing left behind, not even the hidden partial file.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn features_output_wrong_kind() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(&dir.path().join("lines.txt"), b"fine\n");
    let folder = dir.path().join("out");
    std::fs::create_dir(&folder).unwrap();
    let file = write(&dir.path().join("out.npy"), b"");
    let model = require("minilm");
    for (output, format, says) in [
        (
            &folder,
            "jsonl",
            "the output is a folder: --format jsonl writes a file",
        ),
        (
            &file,
            "npy",
            "the output is a file: --format npy writes a folder",
        ),
    ] {
        refused(
            bertkit(&[
                "extract-features",
                "--model",
                p(&model),
                "--input",
                p(&input),
                "--format",
                format,
                "-o",
                p(output),
            ]),
            output,
            &[says],
        );
    }
    // Refused before any work: nothing new beside them.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0);
}

// --- Metrics for `plot` -------------------------------------------------------------------------

/// Curves whose values span almost nothing (a loss of 0 then 1e-323) or the whole of f64's
/// range are drawn, not a panic in the axis's ticks.
#[test]
fn metrics_degenerate_span() {
    let dir = tempfile::tempdir().unwrap();
    for (name, values) in [("tiny", [0.0, 1e-323]), ("huge", [-f64::MAX, f64::MAX])] {
        let rows: String = values
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{{\"step\": {}, \"loss\": {v:e}, \"lr\": {v:e}}}\n", i + 1))
            .collect();
        let metrics = write(&dir.path().join(format!("{name}.jsonl")), rows.as_bytes());
        let svg = dir.path().join(format!("{name}.svg"));
        let out = bertkit(&["plot", p(&metrics), "-o", p(&svg)]);
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        assert!(
            std::fs::read_to_string(&svg).unwrap().contains("<polyline"),
            "{name}"
        );
    }
}
