//! A full disk: each stage and the trainer, stopped by a write that fails, exits with an error
//! naming what it was writing, leaves nothing that looks finished (only hidden `.partial`
//! files, no manifest, no checkpoint folder that `--resume` would take), and a run with room
//! afterwards succeeds.
//!
//! The disk fills through a file-size limit (`RLIMIT_FSIZE`, as `ulimit -f` sets it) with
//! `SIGXFSZ` ignored: a write past the limit then fails with EFBIG as one on a full disk fails
//! with ENOSPC, through the same error paths, without a filesystem to mount.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};

use bertkit_test_support::{repo_root, require};

use crate::util::{bertkit, book_records, ok, path as p, text};

/// Runs `bertkit args` with every file it writes limited to `limit` bytes.
fn bertkit_with_file_limit(args: &[&str], limit: u64) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_bertkit"));
    command.args(args);
    // SAFETY: between fork and exec the closure only calls async-signal-safe functions.
    unsafe {
        command.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let rlimit = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &rlimit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.output().expect("bertkit runs")
}

/// Asserts the run failed cleanly: exit code 1, one `error:` naming the file it was writing
/// (a path under `out`) and the system's reason, no panic.
fn assert_failed_writing(run: &Output, out: &Path) {
    let err = text(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("error: "), "{err}");
    assert!(err.contains("File too large"), "the system's reason: {err}");
    assert!(
        err.contains(&*out.to_string_lossy()),
        "the error names the file being written under {}: {err}",
        out.display()
    );
}

/// Every file under `dir` (recursively), relative.
fn files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(
                    path.strip_prefix(dir)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
    }
    out.sort();
    out
}

/// Asserts that nothing under `dir` looks finished: each file is hidden and `.partial`, or
/// inside such a folder.
fn assert_nothing_finished(dir: &Path) {
    for file in files(dir) {
        let partial = file
            .split('/')
            .any(|part| part.starts_with('.') && part.ends_with(".partial"));
        assert!(partial, "{file} looks finished after a failed run");
    }
}

/// The formatted books (three Gutenberg books) for the shard and records runs.
fn formatted(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("formatted");
    let books = [
        "austen-emma.txt",
        "chesterton-thursday.txt",
        "melville-moby_dick.txt",
    ];
    let input = dir.join("books");
    std::fs::create_dir_all(&input).unwrap();
    for book in books {
        std::fs::copy(require(format!("gutenberg/{book}")), input.join(book)).unwrap();
    }
    ok(bertkit(&[
        "format",
        "books",
        "--input",
        p(&input),
        "--output",
        p(&out),
        "-q",
    ]));
    out
}

#[test]
fn format_on_a_full_disk_fails_cleanly_and_reruns() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let dump =
        require("wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2");
    let args = [
        "format",
        "wiki",
        "--input",
        p(&dump),
        "--output",
        p(&out),
        "-q",
    ];
    let run = bertkit_with_file_limit(&args, 256 * 1024);
    assert_failed_writing(&run, &out);
    assert_nothing_finished(&out);
    ok(bertkit(&args));
    assert!(out.join("wiki.manifest.json").is_file());
}

#[test]
fn shard_on_a_full_disk_fails_cleanly_and_reruns() {
    let dir = tempfile::tempdir().unwrap();
    let input = formatted(dir.path());
    let out = dir.path().join("shards");
    let args = [
        "shard",
        "--input",
        p(&input),
        "--output",
        p(&out),
        "--num-train-shards",
        "4",
        "--num-test-shards",
        "1",
        "--test-fraction",
        "0.05",
        "-q",
    ];
    let run = bertkit_with_file_limit(&args, 256 * 1024);
    assert_failed_writing(&run, &out);
    assert_nothing_finished(&out);
    ok(bertkit(&args));
    assert!(files(&out).iter().any(|f| f.ends_with("manifest.json")));
}

#[test]
fn records_on_a_full_disk_fails_cleanly_and_reruns() {
    let dir = tempfile::tempdir().unwrap();
    let input = formatted(dir.path());
    let out = dir.path().join("records");
    let vocab = require("minilm/vocab.txt");
    let args = [
        "records",
        "--input",
        p(&input),
        "--vocab",
        p(&vocab),
        "--output",
        p(&out),
        "--dupe-factor",
        "1",
    ];
    let run = bertkit_with_file_limit(&args, 256 * 1024);
    assert_failed_writing(&run, &out);
    assert_nothing_finished(&out);
    ok(bertkit(&args));
    assert!(files(&out).iter().any(|f| f.ends_with(".parquet")));
}

#[test]
fn pretrain_on_a_full_disk_fails_cleanly_and_reruns() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let run_dir = dir.path().join("run");
    let config = repo_root().join("pipelines/tiny.toml");
    let args = || {
        vec![
            "pretrain",
            "--config",
            p(&config),
            "--data",
            p(&records),
            "--no-eval",
            "--output",
            p(&run_dir),
            "--max-steps",
            "2",
        ]
    };
    // Room for the metrics and the logs, not for the checkpoint's weights at the last step.
    let run = bertkit_with_file_limit(&args(), 64 * 1024);
    assert_failed_writing(&run, &run_dir);
    let checkpoints = run_dir.join("checkpoints");
    assert_nothing_finished(&checkpoints);
    // The folder holds the failed run's metrics: the run again with --resume (no checkpoint:
    // from step 0); without it the folder is refused as holding an earlier run.
    let again = bertkit(&args());
    assert!(
        text(&again.stderr).contains("holds an earlier run (metrics.jsonl of 2 steps)"),
        "{}",
        text(&again.stderr)
    );
    let mut resume = args();
    resume.push("--resume");
    ok(bertkit(&resume));
    assert!(checkpoints.join("step-2/state.json").is_file());
}
