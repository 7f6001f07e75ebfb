//! `bertkit pretrain` as scripts use it: --config, --data, --output, --max-steps, --resume; the
//! run folder holds metrics.jsonl and checkpoints/step-N/; `bertkit plot` draws the curves and
//! `bertkit plan` prints a table.

use bertkit_test_support::repo_root;

use crate::util::{bertkit, book_records, ok, path as p};

#[test]
fn pretrain_writes_metrics_and_checkpoints_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    // The shipped tiny config, pointed at these records and a temporary run folder.
    let config = repo_root().join("pipelines/tiny.toml");
    let run = dir.path().join("run");
    let args = |steps: &'static str, resume: bool| {
        let mut a = vec![
            "pretrain",
            "--config",
            p(&config),
            "--data",
            p(&records),
            "--eval-data",
            p(&records),
            "--output",
            p(&run),
            "--max-steps",
            steps,
        ];
        if resume {
            a.push("--resume");
        }
        a
    };
    let first = ok(bertkit(&args("3", false)));
    assert!(first.contains("steps 0..3"), "{first}");
    let second = ok(bertkit(&args("5", true)));
    assert!(second.contains("steps 3..5"), "{second}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        rows.iter()
            .map(|r| r["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5]
    );
    for key in [
        "loss",
        "mlm_loss",
        "nsp_loss",
        "lr",
        "grad_norm",
        "seq_per_s",
    ] {
        assert!(rows[4][key].as_f64().unwrap().is_finite(), "{key}");
    }
    // Every checkpoint is a model folder with the records' tokenizer, and so is the run
    // folder once the run has ended.
    let vocab = std::fs::read_to_string(bertkit_test_support::require("minilm/vocab.txt")).unwrap();
    for step in [3, 5] {
        let c = run.join(format!("checkpoints/step-{step}"));
        for f in [
            "config.json",
            "model.safetensors",
            "optimizer.safetensors",
            "state.json",
            "tokenizer_config.json",
        ] {
            assert!(c.join(f).is_file(), "{}", c.join(f).display());
        }
        assert_eq!(std::fs::read_to_string(c.join("vocab.txt")).unwrap(), vocab);
    }
    assert!(
        second.contains(&format!("model at step 5: {}", run.display())),
        "{second}"
    );
    for f in ["config.json", "model.safetensors", "tokenizer_config.json"] {
        assert!(run.join(f).is_file(), "{}", run.join(f).display());
    }
    assert_eq!(
        std::fs::read_to_string(run.join("vocab.txt")).unwrap(),
        vocab
    );
    let casing: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(casing["do_lower_case"], true);
    // A new run in a folder that holds one is refused, and the old run is untouched.
    let refused = bertkit(&args("5", false));
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains(&format!(
            "{} holds an earlier run (checkpoints up to step 5)",
            run.display()
        )) && stderr.contains("--resume"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(),
        metrics
    );
    // Asked to overwrite, the new run starts afresh and the old one is kept whole beside it.
    let mut overwrite = args("1", false);
    overwrite.push("--overwrite");
    let out = bertkit(&overwrite);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let aside = dir.path().join("run.earlier-1");
    assert!(
        out.status.success()
            && stderr.contains(&format!(
                "moved the earlier run in {} (checkpoints up to step 5) to {}",
                run.display(),
                aside.display()
            )),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(aside.join("metrics.jsonl")).unwrap(),
        metrics
    );
    assert!(aside.join("checkpoints/step-5/model.safetensors").is_file());
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        1
    );
    let svg = dir.path().join("loss.svg");
    assert!(
        ok(bertkit(&[
            "plot",
            p(&aside.join("metrics.jsonl")),
            "-o",
            p(&svg)
        ]))
        .contains("5 steps plotted")
    );
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<polyline"));

    // A config mistake is a clear error, not a panic.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace("global_batch = 16", "global_batch = 20"),
    )
    .unwrap();
    let out = bertkit(&["pretrain", "--config", p(&bad)]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("global_batch 20 is not a multiple of micro_batch 16"),
        "{stderr}"
    );
}

#[test]
fn plan_prints_a_table_per_sequence_length() {
    let out = ok(bertkit(&[
        "plan",
        "--config",
        "large",
        "--seq",
        "128,512",
        "--gpu-mem",
        "16GiB",
    ]));
    assert!(out.contains("336.2 M parameters"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with("128") || l.trim_start().starts_with("512"))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    let micro = |row: &str| {
        row.split_whitespace()
            .nth(2)
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    assert!(
        micro(rows[0]) > micro(rows[1]) && micro(rows[1]) > 0,
        "{out}"
    );
}

/// With a recipe on CUDA the plan's peak is the feed-forward the run would take: the full one
/// (its activation kept) where it fits, the lean one where only that fits; the recipe's
/// `[train] feed_forward` stands over the plan's.
#[test]
fn plan_of_a_recipe_takes_the_feed_forward_the_run_would() {
    let dir = tempfile::tempdir().unwrap();
    let shipped =
        std::fs::read_to_string(repo_root().join("pipelines/pretrain-phase1.toml")).unwrap();
    let plan = |memory: &str, setting: Option<&str>| {
        let recipe = dir
            .path()
            .join(format!("recipe-{}.toml", setting.unwrap_or("auto")));
        let text = match setting {
            Some(v) => {
                shipped.replacen("[train]\n", &format!("[train]\nfeed_forward = {v:?}\n"), 1)
            }
            None => shipped.clone(),
        };
        assert!(
            setting.is_none() || text != shipped,
            "a [train] section to set"
        );
        std::fs::write(&recipe, text).unwrap();
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_bertkit"));
        command.args([
            "plan",
            "--recipe",
            p(&recipe),
            "--seq",
            "128",
            "--gpu-mem",
            memory,
            "--json",
        ]);
        let out = ok(command.output().expect("bertkit runs"));
        let row: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        (
            row["fits"].as_bool().unwrap(),
            row["lean_feed_forward"].as_bool().unwrap(),
            row["peak_bytes"].as_f64().unwrap(),
        )
    };
    let (fits, lean, full_peak) = plan("80GB", None);
    assert!(fits && !lean);
    let (fits, lean, lean_peak) = plan("34GB", None);
    assert!(fits && lean);
    // One intermediate activation a token a layer more, in bf16, at the recipe's 256 x 128.
    let extra = 256.0 * 128.0 * 24.0 * 4096.0 * 2.0;
    assert!(
        (full_peak - lean_peak - extra).abs() < 1.0,
        "{full_peak} {lean_peak}"
    );
    let (_, lean, peak) = plan("80GB", Some("lean"));
    assert!(lean && peak == lean_peak);
    let (fits, lean, peak) = plan("34GB", Some("full"));
    assert!(!fits && !lean && peak == full_peak);
}

/// `bench memory` takes steps of a run config without touching its output folder: the folder
/// is not made, and a run holding it does not stop the measurement. It reports the process's
/// resident peak beside the heap's.
#[test]
fn bench_memory_leaves_the_run_folder_alone() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let run = dir.path().join("run");
    let config = dir.path().join("tiny.toml");
    let tiny = std::fs::read_to_string(repo_root().join("pipelines/tiny.toml")).unwrap();
    std::fs::write(
        &config,
        tiny.replace(
            "output = \"out/demo/tiny-run\"",
            &format!("output = {:?}", p(&run)),
        ),
    )
    .unwrap();
    let bench = || {
        let out = ok(bertkit(&[
            "bench",
            "memory",
            "--config",
            p(&config),
            "--data",
            p(&records),
            "--steps",
            "1",
            "--json",
        ]));
        let figures: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(figures["micro_batch"], 16, "{out}");
        // On the CPU the process's resident peak beside the heap's (Linux reports it).
        let resident = figures["measured_resident_peak_bytes"].as_u64();
        assert!(resident.is_some_and(|b| b > 1 << 20), "{out}");
    };
    bench();
    assert!(!run.exists(), "bench memory made the run folder");
    let held = bertkit_stage_io::lock::FolderLock::acquire(&run).unwrap();
    bench();
    drop(held);
}
