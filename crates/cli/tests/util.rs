//! What the binary's tests share: running `bertkit`, reading its output.

use std::path::Path;
use std::process::{Command, Output};

/// Runs the `bertkit` binary with `args`.
pub fn bertkit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(args)
        .output()
        .expect("bertkit runs")
}

/// Output bytes as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The stdout of a run that must have succeeded (else its stderr is the failure).
pub fn ok(out: Output) -> String {
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

/// A path as an argument.
pub fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Phase-1 records (dupe factor 1, the MiniLM vocabulary) of a book's first 600 lines, made
/// by `bertkit records` in `dir`.
pub fn book_records(dir: &Path) -> std::path::PathBuf {
    use bertkit_test_support::require;
    let text = std::fs::read_to_string(require("gutenberg/chesterton-thursday.txt")).unwrap();
    let input = dir.join("book.txt");
    let lines: String = text.lines().take(600).map(|l| format!("{l}\n")).collect();
    std::fs::write(&input, lines).unwrap();
    let records = dir.join("records.parquet");
    ok(bertkit(&[
        "records",
        "--input",
        path(&input),
        "--vocab",
        path(&require("minilm/vocab.txt")),
        "--output",
        path(&records),
        "--dupe-factor",
        "1",
    ]));
    records
}
