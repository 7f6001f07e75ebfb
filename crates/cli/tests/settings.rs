//! Settings a run cannot mean are refused before any work, the error naming the setting, the
//! value and what is accepted (issue 68's list): the records stage's generation parameters and
//! a pre-training schedule's decay power.

use bertkit_test_support::{repo_root, require};

use crate::util::{bertkit, book_records, path as p, text};

/// The error line of a refused run (exit 1, no panic).
fn refused(args: &[&str]) -> String {
    let out = bertkit(args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn nonsense_records_settings_name_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("book.txt");
    std::fs::write(
        &input,
        "One sentence here.\nAnother one there.\n\nA second document.\n",
    )
    .unwrap();
    let vocab = require("minilm/vocab.txt");
    let output = dir.path().join("out.parquet");
    for (flag, value, says) in [
        (
            "--masked-lm-prob",
            "5",
            "masked_lm_prob (--masked-lm-prob) is 5",
        ),
        (
            "--masked-lm-prob",
            "nan",
            "masked_lm_prob (--masked-lm-prob) is NaN",
        ),
        ("--dupe-factor", "0", "dupe_factor (--dupe-factor) is 0"),
        (
            "--max-predictions-per-seq",
            "0",
            "max_predictions_per_seq (--max-predictions-per-seq) is 0",
        ),
        (
            "--max-seq-length",
            "100000",
            "max_seq_length (--max-seq-length) is 100000",
        ),
        (
            "--short-seq-prob",
            "1.5",
            "short_seq_prob (--short-seq-prob) is 1.5",
        ),
    ] {
        let err = refused(&[
            "records",
            "--input",
            p(&input),
            "--vocab",
            p(&vocab),
            "--output",
            p(&output),
            flag,
            value,
        ]);
        assert!(err.contains(says), "{flag} {value}: {err}");
        assert!(!output.exists(), "{flag} {value}: an output was written");
    }
}

#[test]
fn a_decay_power_that_does_not_decay_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = repo_root().join("pipelines/tiny.toml");
    let run = dir.path().join("run");
    let err = refused(&[
        "pretrain",
        "--config",
        p(&config),
        "--data",
        p(&records),
        "--no-eval",
        "--output",
        p(&run),
        "--set",
        "schedule.power=-2",
    ]);
    assert!(
        err.contains("[schedule] power -2 must be positive"),
        "{err}"
    );
    assert!(!run.join("metrics.jsonl").exists());
}
