//! The format stage's hand-off: the files and manifest that the shard stage (and Google's
//! `create_pretraining_data.py`) read. Every figure in the manifest must match the files.

use std::fs;
use std::path::Path;

use bertkit_format::FormatManifest;
use bertkit_format::books::{BookOptions, format_books};
use bertkit_format::wiki::{WikiOptions, format_wiki};
use bertkit_stage_io::stage::Silent;
use bertkit_test_support::require;
use bertkit_test_support::sha256_hex;

fn check_against_files(dir: &Path, manifest: &FormatManifest) {
    assert!(!manifest.outputs.is_empty());
    let on_disk = FormatManifest::read(dir, &manifest.kind).expect("manifest on disk");
    assert_eq!(&on_disk, manifest);
    let (mut documents, mut sentences, mut bytes) = (0, 0, 0);
    for f in &manifest.outputs {
        let raw = fs::read(dir.join(&f.file)).unwrap();
        let sha = sha256_hex(&raw);
        assert_eq!(sha, f.sha256, "{}", f.file);
        assert_eq!(raw.len() as u64, f.bytes, "{}", f.file);
        let text = String::from_utf8(raw).expect("output is UTF-8");
        assert!(!text.contains('\r') && !text.contains('\t') && !text.contains('\u{0}'));
        assert!(text.ends_with("\n\n") && !text.contains("\n\n\n") && !text.starts_with('\n'));
        let docs: Vec<&str> = text.strip_suffix("\n\n").unwrap().split("\n\n").collect();
        assert_eq!(docs.len() as u64, f.documents, "{}", f.file);
        let lines = text.lines().filter(|l| !l.is_empty()).count() as u64;
        assert_eq!(lines, f.sentences, "{}", f.file);
        documents += f.documents;
        sentences += f.sentences;
        bytes += f.bytes;
    }
    let counts = &manifest.counts;
    let written = counts
        .get("articles_written")
        .or_else(|| counts.get("books_written"))
        .unwrap();
    assert_eq!(written.as_u64(), Some(documents));
    assert_eq!(counts["sentences"].as_u64(), Some(sentences));
    assert_eq!(counts["bytes"].as_u64(), Some(bytes));
    for input in &manifest.inputs {
        let raw = fs::read(&input.path).unwrap();
        let sha = sha256_hex(&raw);
        assert_eq!(sha, input.sha256, "{}", input.path);
        assert_eq!(raw.len() as u64, input.bytes);
    }
}

#[test]
fn wiki_and_books_outputs_match_their_manifests() {
    let dir = tempfile::tempdir().unwrap();
    let wiki_dir = dir.path().join("wiki");
    let wiki = format_wiki(
        &[
            require(
                "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
            ),
            require("wikipedia/enwiki-table-markup.xml.bz2"),
        ],
        &wiki_dir,
        &WikiOptions {
            max_bytes: 1_000_000,
            ..Default::default()
        },
        &Silent,
    )
    .unwrap();
    assert!(wiki.summary().outputs.len() >= 3);
    assert_eq!(wiki.summary().counts["pages_seen"], 211);
    check_against_files(&wiki_dir, wiki.summary());

    let books_dir = dir.path().join("books");
    let books = format_books(
        &[require("gutenberg")],
        &books_dir,
        &BookOptions::default(),
        &Silent,
    )
    .unwrap();
    check_against_files(&books_dir, books.summary());
}
