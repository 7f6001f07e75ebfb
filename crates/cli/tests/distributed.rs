//! Data-parallel runs under `mpirun` (built with the `mpi` feature, as `make test` builds it):
//! N ranks train exactly like one process with N times the accumulation, resume on another
//! number of processes, fine-tune the same way, and a killed rank stops the run.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use bertkit_test_support::require;

use crate::util::{book_records, ok, path as p};

/// `mpirun -np <ranks> bertkit <args>`, one compute thread per rank (the machine has two
/// cores), `env` passed to every rank, allowed to run as root (CI's user).
fn mpirun(ranks: usize, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "-np",
        &ranks.to_string(),
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args(["-x", "RAYON_NUM_THREADS=1"]);
    for (name, value) in env {
        cmd.args(["-x", name]).env(name, value);
    }
    cmd.arg(env!("CARGO_BIN_EXE_bertkit"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // Containers often forbid the cross-process memory copy Open MPI tries first
        // between local ranks; shared memory alone works everywhere.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    cmd
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// One process with one compute thread, like each rank.
fn single(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("bertkit runs")
}

fn run(mut cmd: Command) -> Output {
    cmd.output().expect("mpirun runs")
}

/// The same command, `args(out, accumulation)`, on 1 process with accumulation 2 and on 2
/// ranks with accumulation 1: each run's output folder and stdout.
fn one_process_and_two_ranks(
    dir: &Path,
    args: impl Fn(&Path, &'static str) -> Vec<String>,
) -> [(PathBuf, String); 2] {
    let (one, two) = (dir.join("one"), dir.join("two"));
    let one_out = ok(single(&strs(&args(&one, "2"))));
    let two_out = ok(run(mpirun(2, &strs(&args(&two, "1")), &[])));
    [(one, one_out), (two, two_out)]
}

/// A tiny BERT, LAMB, 16 sequences a step in micro-batches of 8, dropout on (the preset's 0.1).
fn config(dir: &Path, records: &Path, total_steps: u64) -> PathBuf {
    let path = dir.join("tiny.toml");
    std::fs::write(
        &path,
        format!(
            r#"output = "unused"
[model]
preset = "tiny"
[data]
records = ["{}"]
micro_batch = 8
max_predictions = 20
seed = 7
[optimizer]
rule = "lamb"
[schedule]
lr = 1e-2
warmup = 0.1
total_steps = {total_steps}
[train]
global_batch = 16
precision = "f32"
device = "cpu"
checkpoint_every = 10
keep_checkpoints = 3
seed = 42
[eval]
records = ["{}"]
every = 10
sequences = 32
"#,
            records.display(),
            records.display()
        ),
    )
    .unwrap();
    path
}

fn tensors(file: &Path) -> HashMap<String, Vec<f32>> {
    candle_core::safetensors::load(file, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| {
            let v = v.to_dtype(candle_core::DType::F32).unwrap();
            (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect()
}

/// The largest difference between two weight files' tensors, relative to each tensor's
/// largest magnitude.
fn weight_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(
        a.keys().collect::<std::collections::BTreeSet<_>>(),
        b.keys().collect()
    );
    let mut worst = 0f64;
    for (name, x) in &a {
        let y = &b[name];
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64;
        for (x, y) in x.iter().zip(y) {
            worst = worst.max(f64::from((x - y).abs()) / scale);
        }
    }
    worst
}

/// `(step, loss, grad_norm, held-out loss or 0)` of each line of a run's metrics.jsonl.
fn losses(run: &Path) -> Vec<(u64, f64, f64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap(),
                v["grad_norm"].as_f64().unwrap(),
                v["eval_loss"].as_f64().unwrap_or(0.0),
            )
        })
        .collect()
}

fn assert_same_losses(a: &[(u64, f64, f64, f64)], b: &[(u64, f64, f64, f64)]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0);
        for (u, v) in [(x.1, y.1), (x.2, y.2), (x.3, y.3)] {
            assert!(
                (u - v).abs() <= 1e-6 * u.abs().max(1e-3),
                "step {}: {u} against {v}",
                x.0
            );
        }
    }
}

/// 2 ranks × micro-batch 8 equal 1 process × micro-batch 8 × accumulation 2 (LAMB, dropout
/// on, 20 steps over more than one epoch): every step's loss and gradient norm, the held-out
/// loss, and the final weights within 1e-6; and 2 ranks stopped at a checkpoint and resumed on 1 process equal
/// the uninterrupted run. (Tried: dropout keyed by rank fails it at step 1 by 1.2e-4 relative;
/// each rank's losses normalised by its own counts instead of the whole step's, by 2x.)
#[test]
fn two_ranks_train_like_one_process_with_twice_the_accumulation() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = config(dir.path(), &records, 20);
    let args = |run: &Path, extra: &[&'static str]| -> Vec<String> {
        let mut a = vec![
            "pretrain".to_string(),
            "--config".into(),
            p(&config).into(),
            "--output".into(),
            p(run).into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let one = dir.path().join("one");
    let one_stdout = ok(single(&strs(&args(&one, &[]))));
    assert!(
        one_stdout.contains("micro-batch 8 x 2 accumulation = 16"),
        "{one_stdout}"
    );
    let two = dir.path().join("two");
    let two_stdout = ok(run(mpirun(2, &strs(&args(&two, &[])), &[])));
    assert!(
        two_stdout.contains("micro-batch 8 x 1 accumulation x 2 ranks (MPI) = 16"),
        "{two_stdout}"
    );
    // Rank 0 alone speaks and writes.
    assert_eq!(two_stdout.matches("pretrain ").count(), 1, "{two_stdout}");
    let reference = losses(&one);
    assert_eq!(reference.len(), 20);
    // The held-out figures (shared out between the ranks) after steps 10 and 20.
    let evaluated: Vec<u64> = reference
        .iter()
        .filter(|r| r.3 > 0.0)
        .map(|r| r.0)
        .collect();
    assert_eq!(evaluated, [10, 20]);
    assert_same_losses(&losses(&two), &reference);
    let last = |run: &Path| run.join("checkpoints/step-20/model.safetensors");
    let diff = weight_difference(&last(&one), &last(&two));
    assert!(diff <= 1e-6, "final weights differ by {diff} (relative)");

    // Stopped after the checkpoint at step 10 on 2 ranks, resumed on 1 process.
    let moved = dir.path().join("moved");
    ok(run(mpirun(
        2,
        &strs(&args(&moved, &["--max-steps", "10"])),
        &[],
    )));
    assert!(moved.join("checkpoints/step-10/state.json").is_file());
    let resumed = ok(single(&strs(&args(&moved, &["--resume"]))));
    assert!(resumed.contains("steps 10..20"), "{resumed}");
    assert_same_losses(&losses(&moved), &reference);
    let diff = weight_difference(&last(&one), &last(&moved));
    assert!(diff <= 1e-6, "resumed weights differ by {diff} (relative)");
}

/// MRPC fine-tuning of MiniLM for 10 steps: 2 ranks equal 1 process with accumulation 2
/// (dropout on): the saved weights within 1e-6 and the same dev accuracy.
#[test]
fn mrpc_fine_tuning_on_two_ranks_equals_one_process_with_twice_the_accumulation() {
    let dir = tempfile::tempdir().unwrap();
    let args = |out: &Path, accumulation: &'static str| -> Vec<String> {
        [
            "finetune",
            "glue",
            "--task",
            "mrpc",
            "--model",
            p(&require("minilm")),
            "--data",
            p(&require("glue/MRPC")),
            "-o",
            p(out),
            "--batch",
            "8",
            "--accumulation",
            accumulation,
            "--max-steps",
            "10",
            "--max-seq-length",
            "64",
            "--seed",
            "5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let [(one, one_out), (two, two_out)] = one_process_and_two_ranks(dir.path(), args);
    let accuracy = |out: &str| {
        out.split("accuracy ")
            .nth(1)
            .and_then(|s| s.split([',', ' ', '\n']).next())
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no accuracy in {out}"))
    };
    assert_eq!(accuracy(&one_out), accuracy(&two_out));
    assert!(one_out.contains("10 steps"), "{one_out}");
    let diff = weight_difference(
        &one.join("model.safetensors"),
        &two.join("model.safetensors"),
    );
    assert!(
        diff <= 1e-6,
        "fine-tuned weights differ by {diff} (relative)"
    );
}

/// The pid of the process started with `marker` in its environment and `rank` as its MPI
/// rank.
fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    let wanted = [
        format!("BERTKIT_TEST_MARK={marker}"),
        format!("OMPI_COMM_WORLD_RANK={rank}"),
    ];
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let e = e.ok()?;
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let environ = std::fs::read(e.path().join("environ")).ok()?;
        let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
        wanted
            .iter()
            .all(|w| vars.contains(&w.as_bytes()))
            .then_some(pid)
    })
}

/// A rank killed with SIGKILL mid-run: mpirun stops the other and exits non-zero within 60 s,
/// naming the rank and the signal; the run folder keeps only finished checkpoints.
#[test]
fn a_killed_rank_stops_the_run_within_a_minute() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = config(dir.path(), &records, 100_000);
    let run_dir = dir.path().join("run");
    let marker = format!("{}-{}", std::process::id(), dir.path().display());
    let mut child = mpirun(
        2,
        &["pretrain", "--config", p(&config), "--output", p(&run_dir)],
        &[("BERTKIT_TEST_MARK", &marker)],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Wait for a few steps to be written, then kill rank 1.
    let started = Instant::now();
    while std::fs::read_to_string(run_dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
        < 3
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no steps written"
        );
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = rank_pid(&marker, 1).expect("rank 1 is running");
    let killed = Instant::now();
    Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("mpirun still running 60 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("rank 1") && stderr.contains("signal 9"),
        "{stderr}"
    );
    assert!(rank_pid(&marker, 0).is_none(), "rank 0 outlived the run");
    // Nothing half-written looks finished.
    for entry in std::fs::read_dir(run_dir.join("checkpoints"))
        .into_iter()
        .flatten()
    {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with('.') || path.join("state.json").is_file(),
            "{}",
            path.display()
        );
    }
}

/// SQuAD end to end on 2 ranks: fine-tuning (2 steps) equals 1 process with accumulation 2,
/// and the dev set's forward passes, shared out between the ranks and merged on rank 0, give
/// the same predictions file and scores. Train on the first article of SQuAD v1.1 dev, predict
/// the last.
#[test]
fn squad_on_two_ranks_equals_one_process_with_twice_the_accumulation() {
    let dir = tempfile::tempdir().unwrap();
    let all: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(require("squad/dev-v1.1.json")).unwrap())
            .unwrap();
    let articles = all["data"].as_array().unwrap();
    let write = |name: &str, article: &serde_json::Value| {
        let path = dir.path().join(name);
        let one = serde_json::json!({"version": all["version"], "data": [article]});
        std::fs::write(&path, one.to_string()).unwrap();
        path
    };
    let train = write("train.json", &articles[0]);
    let dev = write("dev.json", articles.last().unwrap());
    let args = |out: &Path, accumulation: &'static str| -> Vec<String> {
        [
            "finetune",
            "squad",
            "--model",
            p(&require("minilm")),
            "--train",
            p(&train),
            "--dev",
            p(&dev),
            "-o",
            p(out),
            "--batch",
            "8",
            "--accumulation",
            accumulation,
            "--max-steps",
            "2",
            "--max-seq-length",
            "192",
            "--seed",
            "3",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let [(one, one_out), (two, two_out)] = one_process_and_two_ranks(dir.path(), args);
    let scores = |out: &str| {
        out.lines()
            .find(|l| l.contains("exact_match"))
            .unwrap_or_else(|| panic!("no scores in {out}"))
            .to_string()
    };
    assert_eq!(scores(&one_out), scores(&two_out));
    let predictions =
        |run: &Path| std::fs::read_to_string(run.join("predictions/predictions.json")).unwrap();
    assert_eq!(predictions(&one), predictions(&two));
    let diff = weight_difference(
        &one.join("model.safetensors"),
        &two.join("model.safetensors"),
    );
    assert!(
        diff <= 1e-6,
        "fine-tuned weights differ by {diff} (relative)"
    );
}

/// A global batch the ranks cannot share (8 sequences, micro-batches of 8, 2 ranks) is refused
/// by every rank before any work, with the numbers, and the launcher exits non-zero.
#[test]
fn a_global_batch_the_ranks_cannot_share_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = config(dir.path(), &records, 20);
    let run_dir = dir.path().join("run");
    let out = run(mpirun(
        2,
        &[
            "pretrain",
            "--config",
            p(&config),
            "--output",
            p(&run_dir),
            "--global-batch",
            "8",
        ],
        &[],
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("global_batch 8 is not a multiple of micro_batch 8 × 2 rank(s)"),
        "{stderr}"
    );
    assert!(!run_dir.join("metrics.jsonl").exists());
}

/// A 2-rank run killed whole (launcher and ranks, SIGKILL) at random moments and while
/// writing checkpoints, resumed with `--resume` on 2 ranks until it finishes: the same final
/// weights, bit for bit, as an uninterrupted 2-rank run, and each step once in metrics.jsonl.
#[test]
fn two_ranks_killed_at_random_resume_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = config(dir.path(), &records, 10);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("checkpoint_every = 10", "checkpoint_every = 1");
    std::fs::write(&config, text).unwrap();
    let args = |run: &Path| -> Vec<String> {
        [
            "pretrain",
            "--config",
            p(&config),
            "--no-eval",
            "--resume",
            "--output",
            p(run),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let whole = dir.path().join("whole");
    let started = Instant::now();
    ok(run(mpirun(2, &strs(&args(&whole)), &[])));
    let span = started.elapsed();
    let killed = dir.path().join("killed");
    let killed_args = args(&killed);
    let marker = format!("{}-{}", std::process::id(), dir.path().display());
    let kills = crate::kills::kill_until_done(
        &|| mpirun(2, &strs(&killed_args), &[("BERTKIT_TEST_MARK", &marker)]),
        &|| rank_pid(&marker, 0).is_some() || rank_pid(&marker, 1).is_some(),
        &killed,
        span / 10,
        5,
    );
    assert!(
        kills.at_random >= 3 && kills.mid_checkpoint >= 1,
        "{kills:?}"
    );
    assert_eq!(
        crate::kills::logged_steps(&killed),
        (1..=10).collect::<Vec<u64>>()
    );
    let last =
        |run: &Path| std::fs::read(run.join("checkpoints/step-10/model.safetensors")).unwrap();
    assert!(last(&killed) == last(&whole), "{kills:?}");
}
