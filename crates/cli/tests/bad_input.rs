//! The bad-input table (BAD_INPUT.md), a test per row: for each input a user hands bertkit,
//! what a truncated file, bad encoding, a wrong schema or shape, an empty file and a missing
//! file do. Each is refused with exit code 1 and one `error:` naming the file and, where the
//! format has one, the position; or it is a counted skip where the table says skipping is the
//! behaviour. Never a panic, never a silent wrong result.

use std::path::{Path, PathBuf};
use std::process::Output;

use bertkit_test_support::{repo_root, require};

use crate::util::{bertkit, book_records, ok, path as p, text};

pub(crate) const ENWIKI: &str =
    "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2";

/// Asserts the run was refused: exit code 1, an `error:` line naming `file` (its path as
/// given, or its name), each of `says`, and no panic. Returns stderr.
pub(crate) fn refused(run: Output, file: &Path, says: &[&str]) -> String {
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
pub(crate) fn counts(stdout: &str) -> serde_json::Value {
    let json = &stdout[stdout.find("counts: ").expect("a counts line") + "counts: ".len()..];
    serde_json::Deserializer::from_str(json)
        .into_iter::<serde_json::Value>()
        .next()
        .unwrap()
        .unwrap()
}

pub(crate) fn write(path: &Path, bytes: impl AsRef<[u8]>) -> PathBuf {
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// The first `n` bytes of a file.
pub(crate) fn head(path: &Path, n: usize) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    bytes[..n.min(bytes.len())].to_vec()
}

/// A file with its second half cut off.
pub(crate) fn cut_in_half(from: &Path, to: &Path) -> PathBuf {
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

/// `text` in UTF-16 little-endian, after its byte-order mark where `bom`.
pub(crate) fn utf16le(text: &str, bom: bool) -> Vec<u8> {
    let mark: &[u8] = if bom { &[0xFF, 0xFE] } else { &[] };
    let units = text.encode_utf16().flat_map(u16::to_le_bytes);
    mark.iter().copied().chain(units).collect()
}

/// A UTF-16 shard (as Windows tools save text), with or without its byte-order mark: refused
/// for its NUL bytes, with a hint, rather than read as text with the NULs dropped.
#[test]
fn shard_utf16() {
    let dir = tempfile::tempdir().unwrap();
    for bom in [false, true] {
        let shard = write(
            &dir.path().join("shard.txt"),
            utf16le("A first sentence.\nA second one.\n", bom),
        );
        refused(
            records(&shard, &require("minilm/vocab.txt"), &dir.path().join("o")),
            &shard,
            &[
                &format!(
                    "line 1 holds a NUL byte (byte offset {} of the decompressed text)",
                    if bom { 3 } else { 1 }
                ),
                "or UTF-16",
                "iconv -f UTF-16 -t UTF-8",
            ],
        );
    }
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
        &["holds a NUL byte", "not text: a binary file"],
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

pub(crate) fn pretrain(data: &Path, run: &Path, extra: &[&str]) -> Output {
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

/// Every test BAD_INPUT.md names in its last column is a test of this binary: a row's claim is
/// checked by the test it cites, not by one renamed or gone.
#[test]
fn every_row_names_a_test_that_exists() {
    let root = bertkit_test_support::repo_root();
    let table = std::fs::read_to_string(root.join("BAD_INPUT.md")).unwrap();
    let mut sources = String::new();
    for entry in std::fs::read_dir(root.join("crates/cli/tests")).unwrap() {
        sources.push_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap());
    }
    let mut cited = 0;
    for row in table.lines().filter(|l| l.starts_with("| ")) {
        let last = row.trim_end_matches('|').rsplit('|').next().unwrap();
        for name in last.split('`').skip(1).step_by(2) {
            assert!(
                sources.contains(&format!("fn {name}(")),
                "BAD_INPUT.md cites `{name}`, which no test in crates/cli/tests defines: {row}"
            );
            cited += 1;
        }
    }
    assert!(cited >= 60, "only {cited} tests cited");
}
