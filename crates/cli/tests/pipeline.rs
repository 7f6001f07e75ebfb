//! The whole data pipeline as users run it (`bertkit pipeline`, the demo config, the shared data
//! folder as a mirror): killed with SIGKILL as each step starts and re-run, it ends with the
//! same files as an uninterrupted run; run as two processes (ranks, as srun starts them), it
//! gives the same files as one.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use bertkit_test_support::{repo_root, shared_data_dir};

/// A copy of pipelines/demo.toml writing under `output`.
fn demo_config(dir: &Path, output: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo_root().join("pipelines/demo.toml")).unwrap();
    let text = text.replace(
        "output = \"out/demo\"",
        &format!("output = {:?}", output.display().to_string()),
    );
    assert!(text.contains(&output.display().to_string()));
    let path = dir.join(format!(
        "{}.toml",
        output.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&path, text).unwrap();
    path
}

fn pipeline(config: &Path, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bertkit"));
    cmd.args(["pipeline", "--config"])
        .arg(config)
        .arg("--mirror")
        .arg(shared_data_dir().unwrap())
        .arg("--registry")
        .arg(repo_root().join("pipelines/sources.toml"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (rank, size) in bertkit_stage_io::RANK_VARIABLES {
        cmd.env_remove(rank).env_remove(size);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// A line of the pipeline's summary table: a step that finished or was up to date.
fn is_step_line(line: &str) -> bool {
    line.starts_with("  ") && (line.contains(" done ") || line.contains(" up to date "))
}

fn finish(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Every output file by relative path, as the bytes that must match between runs. Left out:
/// manifests and run markers (they name the output folder and the ranks). A Parquet file is
/// compared on its data pages (everything before the footer) and its key-value metadata
/// without `bertkit.inputs` (which records the inputs' absolute paths and times).
fn outputs(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if name != ".ranks" && !name.starts_with(".rank-") {
                    stack.push(path);
                }
                continue;
            }
            if name.contains("manifest") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let bytes = std::fs::read(&path).unwrap();
            let comparable = if name.ends_with(".parquet") {
                let n = bytes.len();
                assert_eq!(&bytes[n - 4..], b"PAR1", "{rel}");
                let footer = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().unwrap()) as usize;
                let mut data = bytes[..n - 8 - footer].to_vec();
                let mut meta = bertkit_records::parquet_file::read_metadata(&path).unwrap();
                meta.retain(|(k, _)| k != "bertkit.inputs");
                meta.sort();
                data.extend(format!("{meta:?}").into_bytes());
                data
            } else {
                bytes
            };
            files.insert(rel, comparable);
        }
    }
    files
}

fn assert_same_outputs(expected: &Path, actual: &Path) {
    let (a, b) = (outputs(expected), outputs(actual));
    let names = |m: &BTreeMap<String, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b));
    assert!(a.keys().any(|k| k.ends_with(".parquet")));
    for (name, bytes) in &a {
        assert!(b[name] == *bytes, "{name} differs");
    }
    // No leftovers of interrupted runs.
    for name in b.keys() {
        assert!(
            !name.contains(".partial") && !name.contains("-tmp"),
            "{name}"
        );
    }
}

#[test]
fn killed_as_each_step_starts_and_rerun_it_ends_with_the_files_of_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference");
    let steps = finish(
        pipeline(&demo_config(dir.path(), &reference), &[])
            .spawn()
            .unwrap(),
    )
    .lines()
    .filter(|l| is_step_line(l))
    .count();
    // download, format wiki and books, shard, records phases 1 and 2, held-out records 1 and 2.
    assert_eq!(steps, 8);

    // Run k is killed (SIGKILL) the moment its k-th step line appears, that is as step k + 1
    // starts: each run continues from what the last one left, so the kills land in every step
    // after the first, whatever the machine's speed.
    let killed = dir.path().join("killed");
    let config = demo_config(dir.path(), &killed);
    let mut kills = 0;
    for k in 1..steps {
        let mut child = pipeline(&config, &[]).spawn().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut seen = Vec::new();
        for line in stdout.lines() {
            let line = line.unwrap();
            if is_step_line(&line) {
                seen.push(line);
                if seen.len() == k {
                    break;
                }
            }
        }
        assert_eq!(seen.len(), k, "run {k} ended early: {seen:?}");
        // Every step the last run finished is up to date; the one it was killed in is redone.
        let redone = seen.iter().filter(|l| !l.contains("up to date")).count();
        assert_eq!(redone, 1, "run {k}: {seen:?}");
        child.kill().unwrap();
        let status = child.wait().unwrap();
        // A run whose last steps ended between its line and the kill exits on its own: in
        // practice only the two killed as a held-out step starts (the held-out records are
        // small); every other run has the train records still to make.
        kills += usize::from(status.signal() == Some(9));
    }
    assert!(
        kills >= steps - 3,
        "only {kills} of {} runs were killed",
        steps - 1
    );
    let stdout = finish(pipeline(&config, &[]).spawn().unwrap());
    assert!(stdout.contains("pipeline"), "{stdout}");
    assert_same_outputs(&reference, &killed);

    // And a run after a finished one does nothing.
    let again = finish(pipeline(&config, &[]).spawn().unwrap());
    assert!(again.contains("0 step(s) run"), "{again}");
}

#[test]
fn two_ranks_make_the_files_of_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    finish(
        pipeline(&demo_config(dir.path(), &single), &[])
            .spawn()
            .unwrap(),
    );

    // Two processes on one output folder, ranked the way srun does it.
    let ranked = dir.path().join("ranked");
    let config = demo_config(dir.path(), &ranked);
    let a = pipeline(&config, &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])
        .spawn()
        .unwrap();
    let b = pipeline(&config, &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")])
        .spawn()
        .unwrap();
    let (out_a, out_b) = (finish(a), finish(b));
    assert!(out_a.contains("rank 0 of 2") && out_b.contains("rank 1 of 2"));
    // The work was divided: each rank formatted one corpus and wrote its own records.
    assert!(
        out_a.contains("format wiki") && !out_a.contains("format books"),
        "{out_a}"
    );
    assert!(
        out_b.contains("format books") && !out_b.contains("format wiki"),
        "{out_b}"
    );
    assert_same_outputs(&single, &ranked);
    for rank in 0..2 {
        assert!(
            ranked
                .join(format!(
                    "shards/shard.manifest.rank-{rank:05}-of-00002.json"
                ))
                .is_file()
        );
    }

    // A rank alone waits at the first merge point and gives up with a clear message.
    let lonely = dir.path().join("lonely");
    let out = pipeline(
        &demo_config(dir.path(), &lonely),
        &[("RANK", "0"), ("WORLD_SIZE", "2")],
    )
    .arg("--wait-timeout")
    .arg("1")
    .output()
    .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("waiting for rank(s) [1]"), "{stderr}");
    assert!(stderr.contains("gave up"), "{stderr}");
}
