//! Fault injection: each file of a run's newest checkpoint damaged in turn (a flipped byte,
//! cut to half, removed), for pre-training and for fine-tuning; `--resume` goes on from the
//! newest state that verifies and the run ends as an undamaged one does (the same weights, bit
//! for bit on the CPU; each step once in `metrics.jsonl`): nothing lost but the steps redone.

use std::path::{Path, PathBuf};

use bertkit_test_support::require;

use crate::kills::{bertkit_command, logged_steps, tiny_config};
use crate::util::{book_records, path as p, text};

/// Steps of the undamaged run; the damaged one stops after `STEPS - 1` (its checkpoints at
/// `STEPS - 2` and `STEPS - 1`), then resumes to `STEPS`.
const STEPS: u64 = 3;

/// Ways a file is damaged.
const DAMAGES: [&str; 3] = ["flip", "truncate", "remove"];

fn damage(file: &Path, how: &str) {
    let bytes = std::fs::read(file).unwrap();
    match how {
        "flip" => {
            let mut b = bytes;
            let at = b.len() / 2;
            b[at] ^= 0x01;
            std::fs::write(file, b).unwrap();
        }
        "truncate" => std::fs::write(file, &bytes[..bytes.len() / 2]).unwrap(),
        _ => std::fs::remove_file(file).unwrap(),
    }
}

/// A copy of the folder `from` at `to` (the lock file too: it holds no lock once copied).
fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_folder(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// `args` as strings, then `--max-steps steps` and, to resume, `--resume`.
fn with_steps(args: &[&str], steps: u64, resume: bool) -> Vec<String> {
    let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    a.extend(["--max-steps".to_string(), steps.to_string()]);
    if resume {
        a.push("--resume".into());
    }
    a
}

fn run_ok(args: &[String]) -> String {
    let out = bertkit_command(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stderr)
}

/// With `args(run, steps, resume)` a training command: runs it undamaged to `STEPS`, and to
/// `STEPS - 1` once; then, for each file of that run's newest checkpoint and each damage, a
/// copy of it damaged so and resumed to `STEPS`, which must end with the undamaged run's
/// `final_weights` and log each step once. Returns the cases tried.
fn each_damage_resumes_whole(
    dir: &Path,
    name: &str,
    args: &dyn Fn(&Path, u64, bool) -> Vec<String>,
    final_weights: &dyn Fn(&Path) -> PathBuf,
) -> usize {
    let whole = dir.join(format!("{name}-whole"));
    run_ok(&args(&whole, STEPS, false));
    let want = std::fs::read(final_weights(&whole)).unwrap();
    let stopped = dir.join(format!("{name}-stopped"));
    run_ok(&args(&stopped, STEPS - 1, false));
    let newest = format!("checkpoints/step-{}", STEPS - 1);
    let mut files: Vec<String> = std::fs::read_dir(stopped.join(&newest))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert!(
        files.len() >= 6 && files.contains(&"checksums.json".to_string()),
        "{files:?}"
    );
    let mut cases = 0;
    for file in &files {
        for how in DAMAGES {
            let case = dir.join(format!("{name}-{how}-{file}"));
            copy_folder(&stopped, &case);
            damage(&case.join(&newest).join(file), how);
            let stderr = run_ok(&args(&case, STEPS, true));
            // A file the checksums name is caught and the older checkpoint taken; the record
            // itself removed leaves a checkpoint with nothing to check (as one written before
            // checksums), whose files are whole.
            let unrecorded = file == "checksums.json" && how == "remove";
            let fell_back = stderr.contains(&format!(
                "resuming from the newest checkpoint that verifies (step {})",
                STEPS - 2
            ));
            assert!(unrecorded != fell_back, "{name} {how} {file}: {stderr}");
            assert_eq!(
                logged_steps(&case),
                (1..=STEPS).collect::<Vec<_>>(),
                "{name} {how} {file}"
            );
            assert!(
                std::fs::read(final_weights(&case)).unwrap() == want,
                "{name} {how} {file}: other weights than the undamaged run's"
            );
            std::fs::remove_dir_all(&case).unwrap();
            cases += 1;
        }
    }
    cases
}

#[test]
fn a_damaged_newest_checkpoint_loses_nothing_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = tiny_config(dir.path());
    let pretrain = |run: &Path, steps: u64, resume: bool| {
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
        with_steps(&args, steps, resume)
    };
    let newest = |run: &Path| run.join(format!("checkpoints/step-{STEPS}/model.safetensors"));
    let cases = each_damage_resumes_whole(dir.path(), "pretrain", &pretrain, &newest);
    assert!(cases >= 18, "{cases}");

    // Fine-tuning GLUE's MRPC from the tiny pre-trained model (its run folder is a model
    // folder), a checkpoint every step.
    let model = dir.path().join("pretrain-whole");
    let mrpc = require("glue/MRPC");
    let finetune = |out: &Path, steps: u64, resume: bool| {
        let args = [
            "finetune",
            "glue",
            "--task",
            "mrpc",
            "--model",
            p(&model),
            "--data",
            p(&mrpc),
            "-o",
            p(out),
            "--max-seq-length",
            "32",
            "--batch",
            "8",
            "--lr",
            "1e-3",
            "--checkpoint-every",
            "1",
        ];
        with_steps(&args, steps, resume)
    };
    let saved = |out: &Path| out.join("model.safetensors");
    let cases = each_damage_resumes_whole(dir.path(), "glue", &finetune, &saved);
    assert!(cases >= 18, "{cases}");
}
