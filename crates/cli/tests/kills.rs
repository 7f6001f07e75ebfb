//! Training survives SIGKILL: `pretrain` and `finetune squad`, killed at random moments and
//! while a checkpoint is being written, then run again with `--resume` until they finish, end
//! with the same weights (bit for bit, CPU, f32) as a run never interrupted, and log each step
//! once in `metrics.jsonl`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use bertkit_rng::SplitMix64;
use bertkit_test_support::{repo_root, require};

use crate::util::{bertkit, book_records, ok, path as p};

/// Optimiser steps of each run.
const STEPS: u64 = 10;

/// What killing a command over and over did.
#[derive(Debug, Default)]
pub(crate) struct Kills {
    /// Processes killed at a random moment.
    pub(crate) at_random: usize,
    /// Processes killed while a checkpoint folder was being written (a `.step-N.partial`
    /// folder of theirs existed at the kill).
    pub(crate) mid_checkpoint: usize,
}

/// The newest whole checkpoint's step (0: none).
fn newest_checkpoint(run: &Path) -> u64 {
    std::fs::read_dir(run.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("state.json").is_file())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .max()
        .unwrap_or(0)
}

/// Runs `command()` again and again until one run finishes by itself, killing each (its whole
/// process group) with SIGKILL, in turn: at a random moment of a step (after it has finished
/// one), at a random moment from its start (loading included), and as soon as it starts
/// writing a checkpoint under `run/checkpoints`. `step` is about one step's time;
/// `still_running` says whether anything of a killed run is left (waited for before the next
/// start). Panics if a run fails or 100 were not enough.
pub(crate) fn kill_until_done(
    command: &dyn Fn() -> Command,
    still_running: &dyn Fn() -> bool,
    run: &Path,
    step: Duration,
    seed: u64,
) -> Kills {
    let mut random = SplitMix64::new(seed);
    let mut kills = Kills::default();
    // A partial checkpoint folder this process made (an earlier kill's is older).
    let partial_since = |spawned: SystemTime| {
        std::fs::read_dir(run.join("checkpoints"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                e.file_name().to_string_lossy().ends_with(".partial")
                    && e.metadata()
                        .and_then(|m| m.modified())
                        .is_ok_and(|t| t >= spawned)
            })
    };
    for round in 0..100 {
        let at_start = newest_checkpoint(run);
        let spawned = SystemTime::now();
        let mut child = command()
            .process_group(0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("bertkit starts");
        let started = Instant::now();
        let fraction = (random.next_u64() % 1000) as f64 / 1000.0;
        let mut stepped: Option<Instant> = None;
        loop {
            if child.try_wait().unwrap().is_some() {
                let out = child.wait_with_output().unwrap();
                assert!(
                    out.status.success(),
                    "a resumed run failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                return kills;
            }
            let due = match round % 3 {
                0 => {
                    if stepped.is_none() && newest_checkpoint(run) > at_start {
                        stepped = Some(Instant::now());
                    }
                    stepped.is_some_and(|t| t.elapsed() >= step.mul_f64(fraction))
                }
                1 => started.elapsed() >= step.mul_f64(3.0 * fraction),
                _ => partial_since(spawned),
            };
            if due {
                let group = format!("-{}", child.id());
                let killed = Command::new("kill")
                    .args(["-KILL", "--", &group])
                    .status()
                    .unwrap();
                assert!(killed.success(), "kill -KILL -- {group} failed");
                child.wait().unwrap();
                let waiting = Instant::now();
                while still_running() {
                    assert!(
                        waiting.elapsed() < Duration::from_secs(10),
                        "a killed run's processes are still there after 10 s"
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
                if round % 3 == 2 {
                    kills.mid_checkpoint += 1;
                } else {
                    kills.at_random += 1;
                }
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    panic!("100 runs did not finish: {kills:?}");
}

pub(crate) fn bertkit_command(args: &[String]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_bertkit"));
    command.args(args);
    command
}

/// The steps of a run's `metrics.jsonl`, in file order.
pub(crate) fn logged_steps(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// The newest checkpoint's weights.
fn final_weights(run: &Path) -> Vec<u8> {
    let dir = run.join(format!("checkpoints/step-{STEPS}"));
    std::fs::read(dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// A tiny pre-training config (pipelines/tiny.toml's model) checkpointing every step.
pub(crate) fn tiny_config(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo_root().join("pipelines/tiny.toml"))
        .unwrap()
        .replace("checkpoint_every = 100", "checkpoint_every = 1")
        .replace("micro_batch = 16", "micro_batch = 4")
        .replace("global_batch = 16", "global_batch = 8");
    assert!(text.contains("checkpoint_every = 1") && text.contains("global_batch = 8"));
    let config = dir.join("tiny-every-step.toml");
    std::fs::write(&config, text).unwrap();
    config
}

/// Runs `args(folder, resume)` once uninterrupted into `dir/NAME-whole` and again, killed over
/// and over, into `dir/NAME-killed`; checks the killed run logged each step once and ended
/// with the same weights. Returns the two folders.
fn killed_like_whole(
    dir: &Path,
    name: &str,
    args: &dyn Fn(&Path, bool) -> Vec<String>,
    seed: u64,
) -> (PathBuf, PathBuf) {
    let whole = dir.join(format!("{name}-whole"));
    let started = Instant::now();
    ok(bertkit_command(&args(&whole, false)).output().unwrap());
    let step = started.elapsed() / STEPS as u32;
    let killed = dir.join(format!("{name}-killed"));
    let resumed = args(&killed, true);
    let kills = kill_until_done(
        &|| bertkit_command(&resumed),
        &|| false,
        &killed,
        step,
        seed,
    );
    assert!(
        kills.at_random >= 4 && kills.mid_checkpoint >= 2,
        "{name}: {kills:?}"
    );
    assert_eq!(logged_steps(&killed), (1..=STEPS).collect::<Vec<_>>());
    assert!(
        final_weights(&killed) == final_weights(&whole),
        "{name}: the resumed run ended with other weights ({kills:?})"
    );
    (whole, killed)
}

/// Appends `--max-steps STEPS` and, to resume, `--resume`.
fn with_steps(mut args: Vec<String>, resume: bool) -> Vec<String> {
    args.extend(["--max-steps".into(), STEPS.to_string()]);
    if resume {
        args.push("--resume".into());
    }
    args
}

#[test]
fn pretraining_and_squad_fine_tuning_killed_at_random_resume_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = tiny_config(dir.path());
    let pretrain = |run: &Path, resume: bool| {
        let args = [
            "pretrain",
            "--config",
            p(&config),
            "--data",
            p(&records),
            "--no-eval",
            "--output",
            p(run),
        ];
        with_steps(args.map(String::from).to_vec(), resume)
    };
    let (whole, _) = killed_like_whole(dir.path(), "pretrain", &pretrain, 7);

    // A tiny SQuAD model: the pre-trained checkpoint with the vocabulary it was trained with.
    let model = dir.path().join("tiny-model");
    std::fs::create_dir_all(&model).unwrap();
    let checkpoint = whole.join(format!("checkpoints/step-{STEPS}"));
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(checkpoint.join(f), model.join(f)).unwrap();
    }
    std::fs::copy(require("minilm/vocab.txt"), model.join("vocab.txt")).unwrap();
    let split = dir.path().join("squad-split");
    let squad_dev = require("squad/dev-v1.1.json");
    let split_args = [
        "split",
        "squad",
        "--train-articles",
        "1",
        "--input",
        p(&squad_dev),
    ];
    ok(bertkit(&[&split_args[..], &["-o", p(&split)]].concat()));
    let train = split.join("train.json");
    let finetune = |out: &Path, resume: bool| {
        let args = [
            "finetune",
            "squad",
            "--model",
            p(&model),
            "--train",
            p(&train),
            "-o",
            p(out),
            "--max-seq-length",
            "96",
            "--doc-stride",
            "48",
            "--batch",
            "8",
            "--accumulation",
            "2",
            "--lr",
            "1e-3",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "2",
        ];
        with_steps(args.map(String::from).to_vec(), resume)
    };
    let (whole, killed) = killed_like_whole(dir.path(), "squad", &finetune, 11);
    // The fine-tuned model saved at the end is the last checkpoint's weights.
    let saved = std::fs::read(killed.join("model.safetensors")).unwrap();
    assert!(saved == std::fs::read(whole.join("model.safetensors")).unwrap());
    // Keep-K: only the newest two checkpoints remain, and no partial one.
    let mut left: Vec<String> = std::fs::read_dir(killed.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    let mut newest = [format!("step-{}", STEPS - 1), format!("step-{STEPS}")];
    newest.sort();
    assert_eq!(left, newest);

    // A folder with checkpoints is not overwritten by a fresh run, nor resumed with other
    // settings.
    let refused = |args: Vec<String>| {
        let out = bertkit_command(&args).output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let fresh = refused(finetune(&killed, false));
    assert!(fresh.contains("--resume to continue it"), "{fresh}");
    let mut other_lr = finetune(&killed, true);
    let at = other_lr.iter().position(|a| a == "1e-3").unwrap();
    other_lr[at] = "2e-3".into();
    let other = refused(other_lr);
    assert!(
        other.contains("step-10") && other.contains("lr: 0.001 against 0.002"),
        "{other}"
    );
}
