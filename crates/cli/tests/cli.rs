//! The `bertkit` binary end to end: arguments, summaries, exit codes and error messages.

use std::path::Path;
use std::process::Command;

use bertkit_test_support::require;

use crate::util::{bertkit, path, text};

const ENWIKI: &str =
    "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2";

#[test]
fn format_wiki_prints_where_output_went_and_rerun_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("wiki");
    let dump = require(ENWIKI);
    let first = bertkit(&[
        "format",
        "wiki",
        "--input",
        path(&dump),
        "--output",
        path(&out),
    ]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let stdout = text(&first.stdout);
    assert!(
        stdout.contains(&format!("output: {}", out.display())),
        "{stdout}"
    );
    assert!(stdout.contains("wiki_00000.txt"), "{stdout}");
    assert!(stdout.contains("\"articles_written\": 97"), "{stdout}");
    // Progress and notes go to stderr, never into the summary.
    assert!(
        text(&first.stderr).contains("single stream"),
        "{}",
        text(&first.stderr)
    );
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("wiki.manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["counts"]["pages_seen"], 206);
    assert_eq!(
        manifest["inputs"][0]["sha256"],
        "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
        "the input hash is the one PROVENANCE.md publishes"
    );

    let again = bertkit(&[
        "format",
        "wiki",
        "--input",
        path(&dump),
        "--output",
        path(&out),
    ]);
    assert!(again.status.success());
    assert!(
        text(&again.stdout).contains("up to date"),
        "{}",
        text(&again.stdout)
    );
}

#[test]
fn format_books_accepts_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("books");
    let run = bertkit(&[
        "format",
        "books",
        "--input",
        path(&require("gutenberg")),
        "--output",
        path(&out),
        "-q",
    ]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert!(text(&run.stdout).contains("\"books_written\": 3"));
    assert!(out.join("books_00000.txt").is_file());
}

#[test]
fn bad_input_fails_with_the_file_name_and_no_panic() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.xml.bz2");
    let run = bertkit(&[
        "format",
        "wiki",
        "--input",
        path(&missing),
        "--output",
        path(&dir.path().join("o")),
    ]);
    assert_eq!(run.status.code(), Some(1));
    let err = text(&run.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("missing.xml.bz2"),
        "{err}"
    );

    let not_xml = dir.path().join("notes.txt");
    std::fs::write(&not_xml, "just some text\n").unwrap();
    let run = bertkit(&[
        "format",
        "wiki",
        "--input",
        path(&not_xml),
        "--output",
        path(&dir.path().join("o")),
    ]);
    assert_eq!(run.status.code(), Some(1));
    assert!(
        text(&run.stderr).contains("notes.txt: not a Wikipedia XML dump"),
        "{}",
        text(&run.stderr)
    );
    assert!(!text(&run.stderr).contains("panicked"));

    let bytes = std::fs::read(require(ENWIKI)).unwrap();
    let cut = dir.path().join("cut.bz2");
    std::fs::write(&cut, &bytes[..100_000]).unwrap();
    let run = bertkit(&[
        "format",
        "wiki",
        "--input",
        path(&cut),
        "--output",
        path(&dir.path().join("o2")),
    ]);
    assert_eq!(run.status.code(), Some(1));
    let err = text(&run.stderr);
    assert!(
        err.contains("cut.bz2: bzip2 data is corrupt or truncated near compressed byte offset"),
        "{err}"
    );
}

#[test]
fn missing_arguments_are_usage_errors() {
    let run = bertkit(&["format", "wiki", "--output", "x"]);
    assert_eq!(run.status.code(), Some(2));
    assert!(text(&run.stderr).contains("--input"));
}

/// A run killed in the middle leaves only hidden `.partial` files and no manifest; the next run
/// cleans them up and completes.
#[cfg(unix)]
#[test]
fn killed_run_leaves_nothing_that_looks_finished() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;

    let dir = tempfile::tempdir().unwrap();
    // A plain XML dump long enough to be interrupted: the real chunk's pages, eight times.
    let mut xml = Vec::new();
    bzip2::read::MultiBzDecoder::new(std::fs::File::open(require(ENWIKI)).unwrap())
        .read_to_end(&mut xml)
        .unwrap();
    let dump = String::from_utf8(xml).unwrap();
    let (first, last) = (
        dump.find("<page>").unwrap(),
        dump.rfind("</page>").unwrap() + "</page>".len(),
    );
    let big = format!(
        "{}{}{}",
        &dump[..first],
        dump[first..last].repeat(8),
        &dump[last..]
    );
    let input = dir.path().join("big.xml");
    std::fs::write(&input, big).unwrap();
    let out = dir.path().join("out");
    let args = [
        "format",
        "wiki",
        "--input",
        path(&input),
        "--output",
        path(&out),
        "--max-bytes",
        "200000",
        "-q",
    ];

    let mut child = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(args)
        .spawn()
        .unwrap();
    // Wait until output is being written, then kill.
    let started = std::time::Instant::now();
    let partial_exists = || {
        std::fs::read_dir(&out)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with(".partial"))
            })
            .unwrap_or(false)
    };
    while !partial_exists() {
        assert!(
            started.elapsed().as_secs() < 60,
            "no partial output appeared"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be interrupted"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "the run was not interrupted: {status:?}"
    );
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.is_empty());
    for name in &names {
        assert!(
            name.starts_with('.') && name.ends_with(".partial"),
            "finished-looking file {name} after a kill"
        );
    }

    let rerun = bertkit(&args);
    assert!(rerun.status.success(), "{}", text(&rerun.stderr));
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.ends_with(".partial")), "{names:?}");
    assert!(names.contains(&"wiki.manifest.json".to_string()));
    // The rerun's files are an uninterrupted run's, byte for byte. (Tried: a rerun that keeps
    // the killed run's partial files and appends to them passes the checks above and fails
    // this one.)
    let clean = dir.path().join("clean");
    let mut clean_args = args;
    clean_args[5] = path(&clean);
    assert!(bertkit(&clean_args).status.success());
    let texts = |dir: &Path| -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "txt"))
            .map(|p| {
                let bytes = std::fs::read(&p).unwrap();
                (p.file_name().unwrap().to_string_lossy().into_owned(), bytes)
            })
            .collect();
        files.sort();
        files
    };
    let (rerun_files, clean_files) = (texts(&out), texts(&clean));
    assert!(rerun_files.len() > 1, "{}", rerun_files.len());
    assert!(
        rerun_files == clean_files,
        "the rerun's text differs from a clean run's"
    );
}

/// A formatted corpus for the shard tests: the Gutenberg books formatted by the CLI.
fn formatted_books(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("books");
    let run = bertkit(&[
        "format",
        "books",
        "--input",
        path(&require("gutenberg")),
        "--output",
        path(&out),
        "-q",
    ]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    out
}

#[test]
fn shard_prints_its_shards_and_reruns_as_a_no_op_and_reads_rank_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let books = formatted_books(dir.path());
    let out = dir.path().join("shards");
    let args = [
        "shard",
        "--input",
        path(&books),
        "--output",
        path(&out),
        "--num-train-shards",
        "2",
        "--num-test-shards",
        "1",
        "--test-fraction",
        "0.3",
        "--seed",
        "7",
    ];
    let first = bertkit(&args);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let stdout = text(&first.stdout);
    assert!(stdout.contains("sharded 3 documents"), "{stdout}");
    assert!(
        stdout.contains("train/shard_00000.txt") && stdout.contains("test/shard_00000.txt"),
        "{stdout}"
    );
    assert!(text(&bertkit(&args).stdout).contains("up to date"));

    let ranked = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(args)
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(ranked.status.success(), "{}", text(&ranked.stderr));
    assert!(
        out.join("shard.manifest.rank-00001-of-00002.json")
            .is_file()
    );
    assert!(
        text(&ranked.stdout).contains("1 shard file(s) written by this process"),
        "{}",
        text(&ranked.stdout)
    );

    let bad = bertkit(&[
        "shard",
        "--input",
        path(&books),
        "--output",
        path(&out),
        "--num-train-shards",
        "0",
    ]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(text(&bad.stderr).contains("--num-train-shards must be at least 1"));
}

/// A shard run killed in the middle leaves no manifest and no finished-looking shard; the
/// re-run gives exactly the output of an uninterrupted run.
#[cfg(unix)]
#[test]
fn killed_shard_run_reruns_to_the_same_output() {
    use std::os::unix::process::ExitStatusExt;

    let dir = tempfile::tempdir().unwrap();
    let books = formatted_books(dir.path());
    // 40 marked copies of the books (about 100 MB) so that the run spills many sorted runs.
    let corpus = dir.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    let formatted = std::fs::read_to_string(books.join("books_00000.txt")).unwrap();
    for c in 0..40 {
        let marked: String = formatted
            .split("\n\n")
            .filter(|d| !d.is_empty())
            .map(|d| format!("[copy {c}] {d}\n\n"))
            .collect();
        std::fs::write(corpus.join(format!("copy_{c:03}.txt")), marked).unwrap();
    }
    let args = |out: &Path| {
        vec![
            "shard".to_string(),
            "--input".into(),
            path(&corpus).into(),
            "--output".into(),
            path(out).into(),
            "--num-train-shards".into(),
            "3".into(),
            "--num-test-shards".into(),
            "1".into(),
            "--test-fraction".into(),
            "0.1".into(),
            "--run-mb".into(),
            "2".into(),
            "--compress".into(),
            "zstd".into(),
            "-q".into(),
        ]
    };
    let reference = dir.path().join("reference");
    assert!(
        Command::new(env!("CARGO_BIN_EXE_bertkit"))
            .args(args(&reference))
            .output()
            .unwrap()
            .status
            .success()
    );

    let out = dir.path().join("out");
    let mut child = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(args(&out))
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let spilled = || {
        std::fs::read_dir(out.join(bertkit_shard::TMP_DIR))
            .map(|d| d.flatten().count() >= 2)
            .unwrap_or(false)
    };
    while !spilled() {
        assert!(started.elapsed().as_secs() < 60, "no sorted run appeared");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be interrupted"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    assert_eq!(child.wait().unwrap().signal(), Some(9));
    assert!(!out.join("shard.manifest.json").exists());
    for split in ["train", "test"] {
        if let Ok(entries) = std::fs::read_dir(out.join(split)) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                assert!(
                    name.starts_with('.'),
                    "finished-looking {split}/{name} after a kill"
                );
            }
        }
    }

    let rerun = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(args(&out))
        .output()
        .unwrap();
    assert!(rerun.status.success(), "{}", text(&rerun.stderr));
    let shards = |dir: &Path| -> serde_json::Value {
        let m: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("shard.manifest.json")).unwrap(),
        )
        .unwrap();
        m["shards"].clone()
    };
    assert_eq!(shards(&out), shards(&reference));
    assert!(!out.join(bertkit_shard::TMP_DIR).exists());
}

#[test]
fn tokenize_matches_the_reference_in_jsonl_mode_and_reads_plain_lines() {
    use std::io::Write;
    let vocab = require("minilm/vocab.txt");
    let reference =
        std::fs::read_to_string(require("reference/wordpiece_reference.jsonl")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["tokenize", "--vocab", path(&vocab), "--jsonl-input"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = reference.clone();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()).unwrap());
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(output.status.success(), "{}", text(&output.stderr));
    let got: Vec<serde_json::Value> = text(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let expected: Vec<serde_json::Value> = reference
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(got.len(), 3031);
    for (g, e) in got.iter().zip(&expected) {
        assert_eq!(g["tokens"], e["tokens"], "{}", e["text"]);
        assert_eq!(g["ids"], e["ids"], "{}", e["text"]);
    }

    let mut child = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["tokenize", "--vocab", path(&vocab)])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all("Hello, [CLS] world!\r\nnaïve café\n".as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let lines: Vec<serde_json::Value> = text(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    let tokens =
        |i: usize| -> Vec<String> { serde_json::from_value(lines[i]["tokens"].clone()).unwrap() };
    // "[CLS]" in text is not a special token; the CR of a CRLF line is whitespace.
    assert_eq!(tokens(0).first().map(String::as_str), Some("hello"));
    assert!(!tokens(0).contains(&"[CLS]".to_string()));
    assert_eq!(
        tokens(0).iter().filter(|t| *t == "[" || *t == "]").count(),
        2
    );
    assert_eq!(tokens(0).last().map(String::as_str), Some("!"));
    assert_eq!(
        tokens(1),
        vec!["naive", "cafe"],
        "accents stripped for an uncased vocabulary"
    );
    assert_eq!(lines[1]["ids"].as_array().unwrap().len(), 2);
}

#[test]
fn records_compat_google_writes_the_reference_instances_and_folders_skip_finished_files() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = require("minilm/vocab.txt");
    let parquet = dir.path().join("sample.parquet");
    let jsonl = dir.path().join("sample.jsonl");
    let run = bertkit(&[
        "records",
        "--input",
        path(&require("bert/sample_text.txt")),
        "--vocab",
        path(&vocab),
        "--output",
        path(&parquet),
        "--phase",
        "1",
        "--dupe-factor",
        "3",
        "--compat",
        "google",
        "--jsonl",
        path(&jsonl),
    ]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert!(
        text(&run.stdout).contains("38 instances"),
        "{}",
        text(&run.stdout)
    );
    let ours: Vec<serde_json::Value> = std::fs::read_to_string(&jsonl)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let reference: Vec<serde_json::Value> =
        std::fs::read_to_string(require("reference/cpd_sample_text_msl128/instances.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    assert_eq!(ours.len(), reference.len());
    for (a, b) in ours.iter().zip(&reference) {
        assert_eq!(a["tokens"], b["tokens"]);
        assert_eq!(a["masked_lm_positions"], b["masked_lm_positions"]);
    }

    // Folder mode: one file per input; a second run has nothing to do.
    let books = formatted_books(dir.path());
    let out = dir.path().join("phase2");
    let args = [
        "records",
        "--input",
        path(&books),
        "--vocab",
        path(&vocab),
        "--output",
        path(&out),
        "--phase",
        "2",
        "--dupe-factor",
        "1",
    ];
    let first = bertkit(&args);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(out.join("books_00000.parquet").is_file());
    assert!(text(&bertkit(&args).stdout).contains("up to date"));
    let bad = bertkit(&[
        "records",
        "--input",
        path(&books),
        "--vocab",
        path(&vocab),
        "--output",
        path(&out),
        "--phase",
        "3",
    ]);
    assert_eq!(bad.status.code(), Some(2), "phase 3 is a usage error");
}
