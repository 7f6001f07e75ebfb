//! The data stages' memory bounds, as README.md states them, measured on the binary: the
//! child's own peak resident set size (`wait4`'s rusage) on an input several times the bound,
//! so that memory that grows with the input fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use bertkit_test_support::require;

const MIB: u64 = 1 << 20;

/// Runs `cmd` to its end, asserts it succeeded (showing its stderr otherwise) and returns its
/// peak RSS in bytes.
///
/// Through a small Python parent that forks it and reads its rusage: a process's `ru_maxrss`
/// includes the high-water mark of the memory it replaced at exec, which for a child spawned
/// straight from this test binary is the test binary's own (hundreds of MiB once other tests
/// have run in it), not the stage's. Python's own few MiB are the most this can add.
fn peak_rss(cmd: Command, dir: &Path) -> u64 {
    const SCRIPT: &str = "import os, sys
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
";
    let stderr_path = dir.join("stderr.txt");
    let mut wrapped = Command::new("python3");
    wrapped
        .args(["-c", SCRIPT])
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .envs(cmd.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    if let Some(d) = cmd.get_current_dir() {
        wrapped.current_dir(d);
    }
    let out = wrapped.output().expect("python3 runs");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    let fields: Vec<i64> = report
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    assert!(
        out.status.success() && fields.first() == Some(&0),
        "{report}{}",
        std::fs::read_to_string(&stderr_path).unwrap_or_default()
    );
    // ru_maxrss is in KiB on Linux.
    fields[1] as u64 * 1024
}

/// `n` links to the real enwiki chunk (1.7 MB of bzip2, 6.1 MB of XML each) under `dir`.
fn dump_links(dir: &Path, n: usize) -> Vec<PathBuf> {
    let chunk =
        require("wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2");
    (0..n)
        .map(|i| {
            let link = dir.join(format!("part-{i:03}.xml.bz2"));
            if !link.exists() {
                std::os::unix::fs::symlink(&chunk, &link).unwrap();
            }
            link
        })
        .collect()
}

/// `bertkit format wiki` with 2 threads over `inputs`; returns the peak RSS.
fn format_peak(inputs: &[PathBuf], out: &Path, dir: &Path) -> u64 {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bertkit"));
    cmd.args(["format", "wiki", "-q", "--threads", "2", "-o"])
        .arg(out)
        .arg("-i")
        .args(inputs);
    peak_rss(cmd, dir)
}

/// README: formatting holds a bounded number of ~1 MiB segments whatever the dump's size;
/// the whole process stays under 128 MiB with up to 4 threads (measured 58–92 MB from 180 to
/// 490 MB of XML; the peak varies from run to run with what the queues hold). Here 60 parts:
/// 365 MB of XML, 2.9 times the bound. (Tried: keeping a copy of every formatted document, as
/// a writer that buffered its files would, reaches 231 MiB and fails this.)
#[test]
fn formatting_a_dump_stays_under_its_memory_bound_whatever_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let links = dump_links(dir.path(), 60);
    let peak = format_peak(&links, &dir.path().join("out"), dir.path());
    eprintln!("format wiki peak RSS: {} MiB for 60 parts", peak / MIB);
    assert!(peak < 128 * MIB, "{} MiB", peak / MIB);
}

/// `bertkit records` (phase 1, dupe 10) over the folder `input` with `threads` rayon threads;
/// returns the peak RSS.
fn records_peak(input: &Path, out: &Path, threads: usize, dir: &Path) -> u64 {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bertkit"));
    cmd.args(["records", "--dupe-factor", "10", "-i"])
        .arg(input)
        .arg("-o")
        .arg(out)
        .arg("--vocab")
        .arg(require("minilm/vocab.txt"))
        .env("RAYON_NUM_THREADS", threads.to_string());
    peak_rss(cmd, dir)
}

/// README: the records stage holds one shard at a time per thread (its text, 4 bytes per
/// token, 32 bytes per instance), so a folder's peak is the thread count times a shard's,
/// however many shards it has. Here 36 shards of 2.6 MB (the formatted enwiki chunk) with 2
/// threads against one shard alone: at most twice the one shard's peak plus 24 MiB of
/// allocator slack (measured 42–44 MB for one; 82–95 MB for 8 to 24 shards, varying with how
/// the two threads' peaks overlap). (Tried: a copy of every shard's tokenized corpus kept to
/// the end reaches 160 MiB and fails this.)
#[test]
fn records_of_a_folder_hold_one_shard_per_thread_whatever_the_shard_count() {
    let dir = tempfile::tempdir().unwrap();
    let formatted = dir.path().join("formatted");
    format_peak(&dump_links(dir.path(), 1), &formatted, dir.path());
    let text = std::fs::read(formatted.join("wiki_00000.txt")).unwrap();
    let (one, many) = (dir.path().join("one"), dir.path().join("many"));
    std::fs::create_dir_all(&one).unwrap();
    std::fs::create_dir_all(&many).unwrap();
    std::fs::write(one.join("shard_00000.txt"), &text).unwrap();
    for i in 0..36 {
        std::fs::write(many.join(format!("shard_{i:05}.txt")), &text).unwrap();
    }
    let single = records_peak(&one, &dir.path().join("out-one"), 2, dir.path());
    let folder = records_peak(&many, &dir.path().join("out-many"), 2, dir.path());
    eprintln!(
        "records peak RSS: {} MiB for one shard, {} MiB for 36 shards with 2 threads",
        single / MIB,
        folder / MIB
    );
    assert!(
        folder < 2 * single + 24 * MIB,
        "{} MiB for 36 shards, {} MiB for one",
        folder / MIB,
        single / MIB
    );
}

/// README: sharding holds the run being sorted, the merge's read buffers, the placement window
/// and the reserve of small documents, never the corpus: under 256 MiB with the default
/// settings whatever the corpus size (documents up to ~100 KB; measured 181–216 MB from 0.4
/// to 2 GB of enwiki articles). Here 1 GB, four times the bound: 400 links to the formatted
/// enwiki chunk (98 articles of 26 KB on average, 91 KB at most). (Tried: every corpus
/// shuffled in memory, as for one smaller than a run, peaks over 1 GB and fails this.)
#[test]
fn sharding_a_large_corpus_stays_under_its_memory_bound() {
    let dir = tempfile::tempdir().unwrap();
    let formatted = dir.path().join("formatted");
    format_peak(&dump_links(dir.path(), 1), &formatted, dir.path());
    let text = formatted.join("wiki_00000.txt");
    let corpus = dir.path().join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    for i in 0..400 {
        std::os::unix::fs::symlink(&text, corpus.join(format!("part_{i:03}.txt"))).unwrap();
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bertkit"));
    cmd.args([
        "shard",
        "-q",
        "--threads",
        "2",
        "--num-train-shards",
        "16",
        "--num-test-shards",
        "2",
        "--test-fraction",
        "0.05",
        "-i",
    ])
    .arg(&corpus)
    .arg("-o")
    .arg(dir.path().join("shards"));
    let peak = peak_rss(cmd, dir.path());
    eprintln!("shard peak RSS: {} MiB for 1 GB", peak / MIB);
    assert!(peak < 256 * MIB, "{} MiB", peak / MIB);
}

/// Held-out evaluation holds no memory past each micro-batch's pass: a tiny model's run
/// evaluating 1,024 sequences peaks where a run's steps do (it held every round's activations
/// to the evaluation's end, ~2.8 MB a sequence: 11 GB for 4,000).
#[test]
fn held_out_evaluation_holds_no_memory_past_its_passes() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(require("gutenberg/austen-emma.txt")).unwrap();
    let input = dir.path().join("emma.txt");
    let lines: String = text.lines().take(6000).map(|l| format!("{l}\n")).collect();
    std::fs::write(&input, lines).unwrap();
    let records = dir.path().join("records.parquet");
    crate::util::ok(crate::util::bertkit(&[
        "records",
        "--input",
        input.to_str().unwrap(),
        "--vocab",
        require("minilm/vocab.txt").to_str().unwrap(),
        "--output",
        records.to_str().unwrap(),
        "--max-seq-length",
        "128",
    ]));
    let config = dir.path().join("run.toml");
    std::fs::write(
        &config,
        format!(
            "output = {run:?}\n[model]\npreset = \"tiny\"\n[data]\nrecords = [{r:?}]\n\
             micro_batch = 16\nmax_predictions = 20\n[optimizer]\nrule = \"lamb\"\n\
             [schedule]\nlr = 1e-3\nwarmup = 0.1\ntotal_steps = 2\ndecay = \"poly\"\n\
             power = 0.5\n[train]\nglobal_batch = 16\n[eval]\nrecords = [{r:?}]\nevery = 1\n\
             sequences = 1024\n",
            run = dir.path().join("run"),
            r = records,
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bertkit"));
    cmd.args([
        "pretrain",
        "--config",
        config.to_str().unwrap(),
        "--max-steps",
        "1",
    ]);
    let peak = peak_rss(cmd, dir.path());
    assert!(peak < 768 * MIB, "{} MiB", peak / MIB);
}
