//! The books format stage on the real Gutenberg books in the shared data folder.

use std::fs;

use bertkit_format::books::{BookCounts, BookOptions, format_books};

use bertkit_stage_io::stage::{Outcome, Silent};

use bertkit_test_support::require;

#[test]
fn three_gutenberg_books_become_three_clean_documents() {
    let dir = tempfile::tempdir().unwrap();
    let outcome = format_books(
        &[require("gutenberg")],
        dir.path(),
        &BookOptions::default(),
        &Silent,
    )
    .unwrap();
    let Outcome::Ran(manifest) = &outcome else {
        panic!("fresh run")
    };
    let counts: BookCounts = serde_json::from_value(manifest.counts.clone()).unwrap();
    assert_eq!(counts.books_seen, 3);
    assert_eq!(counts.books_written, 3);
    assert_eq!(counts.latin1_fallbacks, 0);
    // Inputs are sorted: austen, chesterton, melville (the CRLF one).
    assert!(manifest.inputs[2].path.ends_with("melville-moby_dick.txt"));
    assert_eq!(manifest.outputs.len(), 1);
    assert_eq!(manifest.outputs[0].documents, 3);

    let text = fs::read_to_string(dir.path().join("books_00000.txt")).unwrap();
    assert!(!text.contains('\r'), "CRLF survived");
    assert!(!text.contains('\u{FEFF}'));
    assert!(!text.contains("\n\n\n") && text.ends_with("\n\n"));
    let docs: Vec<&str> = text.split("\n\n").filter(|d| !d.is_empty()).collect();
    assert_eq!(docs.len(), 3);
    assert!(docs[0].starts_with(
        "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to unite some of the best blessings of existence; and had lived nearly twenty-one years in the world with very little to distress or vex her.\n"
    ));
    assert!(docs[2].contains("\nCall me Ishmael.\nSome years ago--never mind how long precisely--having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world.\n"));
    // Hard-wrapped lines were re-joined: Emma's long paragraphs are one line per sentence.
    assert!(
        docs[0].contains("\nBetween them it was more the intimacy of sisters.\n"),
        "emphasis marks removed"
    );
    assert!(docs[0].contains(
        "\nSixteen years had Miss Taylor been in Mr. Woodhouse's family, less as a governess than a friend, very fond of both daughters, but particularly of Emma.\n"
    ));
    for line in text.lines() {
        assert!(
            !line.starts_with("CHAPTER") && !line.starts_with("VOLUME"),
            "heading kept: {line}"
        );
        assert!(!line.starts_with('['), "marker kept: {line}");
        assert_ne!(line, "Loomings.");
        assert!(!line.contains('_'));
    }
    // Every book keeps nearly all of its text.
    assert!(
        counts.bytes as f64 > 0.95 * counts.input_bytes as f64,
        "{counts:?}"
    );
}

#[test]
fn rerun_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let input = [require("gutenberg/chesterton-thursday.txt")];
    let first = format_books(&input, dir.path(), &BookOptions::default(), &Silent).unwrap();
    assert!(matches!(first, Outcome::Ran(_)));
    let again = format_books(&input, dir.path(), &BookOptions::default(), &Silent).unwrap();
    assert!(matches!(again, Outcome::UpToDate(_)));
}
