//! The commands no other test runs through the binary: `vocab`, `download url`, `finetune glue`
//! and `predict glue`, each once, on real data, checking what they print and write. (Tried: a
//! fine-tuned folder saved without its vocab.txt fails the last one.)

use bertkit_test_support::{require, sha256_file};

use crate::util::{bertkit, ok, path, text};

#[test]
fn vocab_writes_a_bert_layout_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("vocab.txt");
    let book = require("gutenberg/austen-emma.txt");
    let stdout = ok(bertkit(&[
        "vocab",
        "--input",
        path(&book),
        "--size",
        "600",
        "--output",
        path(&out),
    ]));
    let lines: Vec<String> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert!(
        stdout.contains(&format!("({} tokens)", lines.len())),
        "{stdout}"
    );
    assert!(lines.len() <= 600 && lines.len() > 300, "{}", lines.len());
    assert_eq!(&lines[..5], ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]);
}

#[test]
fn download_url_copies_verifies_and_reruns_as_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let source = require("squad/dev-v1.1.json");
    let sha = sha256_file(&source);
    let dest = dir.path().join("squad/dev.json");
    let args = [
        "download",
        "url",
        path(&source),
        "-o",
        path(&dest),
        "--sha256",
        &sha,
    ];
    let first = ok(bertkit(&args));
    assert!(
        first.starts_with("copied ") && first.contains("checksum verified"),
        "{first}"
    );
    assert_eq!(sha256_file(&dest), sha);
    let again = ok(bertkit(&args));
    assert!(again.contains("already complete"), "{again}");
    // A wrong checksum fails, names the file, and leaves nothing behind.
    let bad = dir.path().join("bad.json");
    let zeros = "0".repeat(64);
    let run = bertkit(&[
        "download",
        "url",
        path(&source),
        "-o",
        path(&bad),
        "--sha256",
        &zeros,
    ]);
    assert!(!run.status.success());
    assert!(
        text(&run.stderr).contains("dev-v1.1.json"),
        "{}",
        text(&run.stderr)
    );
    assert!(!bad.exists());
}

#[test]
fn finetune_glue_then_predict_glue_with_the_saved_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("mrpc");
    let (minilm, mrpc) = (require("minilm"), require("glue/MRPC"));
    let finetune = |flag: Option<&'static str>| {
        let mut args = vec![
            "finetune",
            "glue",
            "--task",
            "mrpc",
            "--model",
            path(&minilm),
            "--data",
            path(&mrpc),
            "-o",
            path(&model),
            "--max-steps",
            "2",
            "--max-seq-length",
            "64",
        ];
        args.extend(flag);
        bertkit(&args)
    };
    let stdout = ok(finetune(None));
    assert!(stdout.contains("accuracy"), "{stdout}");
    assert!(stdout.contains("MRPC: 2 steps (train loss "), "{stdout}");
    for file in ["config.json", "model.safetensors", "vocab.txt"] {
        assert!(model.join(file).is_file(), "{file}");
    }
    // Resumed once finished: nothing to train, said so (not `train loss NaN -> NaN`), and
    // the dev set scored again.
    let again = finetune(Some("--resume"));
    let stderr = String::from_utf8_lossy(&again.stderr).into_owned();
    let stdout = ok(again);
    assert!(
        stdout.contains("MRPC: nothing left to run (resumed at step 2, where the run ends)")
            && stdout.contains("accuracy")
            && !stdout.contains("NaN"),
        "{stdout}"
    );
    assert!(
        stderr.contains("nothing left to train: the checkpoint is at step 2"),
        "{stderr}"
    );
    // Without --resume the finished run is refused, before any work; with --overwrite it is
    // moved aside whole and a new one made.
    let refused = finetune(None);
    assert!(
        !refused.status.success()
            && text(&refused.stderr).contains(&format!(
                "{} holds an earlier run (checkpoints up to step 2): --resume to continue it, \
                 --overwrite to move it aside",
                model.display()
            )),
        "{}",
        text(&refused.stderr)
    );
    let stderr = text(&finetune(Some("--overwrite")).stderr);
    let aside = dir.path().join("mrpc.earlier-1");
    assert!(
        stderr.contains(&format!("to {}", aside.display())),
        "{stderr}"
    );
    for file in [
        "config.json",
        "model.safetensors",
        "checkpoints/step-2/state.json",
    ] {
        assert!(
            aside.join(file).is_file() && model.join(file).is_file(),
            "{file}"
        );
    }
    let rows = dir.path().join("dev.tsv");
    let stdout = ok(bertkit(&[
        "predict",
        "glue",
        "--task",
        "mrpc",
        "--model",
        path(&model),
        "--data",
        path(&require("glue/MRPC/dev.tsv")),
        "-o",
        path(&rows),
        "--max-seq-length",
        "64",
    ]));
    assert!(stdout.contains("accuracy"), "{stdout}");
    let written = std::fs::read_to_string(&rows).unwrap();
    assert_eq!(written.lines().count(), 409);
    assert!(
        written.starts_with("index\tprediction\n0\t"),
        "{written:.40}"
    );
}

/// `bench graph` on MiniLM's config: a row per kernel set, the fused one with fewer
/// operations and bytes per layer, and the totals made of the per-layer and outside figures.
#[test]
fn bench_graph_counts_what_fusion_removes() {
    let config = require("minilm/config.json");
    let stdout = ok(bertkit(&[
        "bench",
        "graph",
        "--config",
        path(&config),
        "--batch",
        "2",
        "--seq",
        "16",
        "--predictions",
        "2",
    ]));
    let row = |name: &str| -> Vec<f64> {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row: {stdout}"));
        line.split_whitespace()
            .skip(1)
            .map(|v| v.parse().unwrap())
            .collect()
    };
    let (composed, fused) = (row("composed"), row("fused"));
    // ops/layer, nodes/layer, MB/layer, ops elsewhere, MB elsewhere, ops, MB
    assert_eq!(composed.len(), 7, "{stdout}");
    assert!(fused[0] < composed[0] && fused[2] < composed[2], "{stdout}");
    for r in [&composed, &fused] {
        assert!(r[0] <= r[1], "views are nodes too: {stdout}");
        assert_eq!(r[5], r[3] + 6.0 * r[0], "MiniLM has 6 layers: {stdout}");
    }
}

/// `bench kernels` on MiniLM's config: a row per kernel the fused forward calls, with the
/// counts its layers make, and the forward and backward times (each fused op's backward too).
#[test]
fn bench_kernels_times_each_kernel() {
    let config = require("minilm/config.json");
    let stdout = ok(bertkit(&[
        "bench",
        "kernels",
        "--config",
        path(&config),
        "--batch",
        "2",
        "--seq",
        "16",
        "--predictions",
        "2",
        "--passes",
        "1",
    ]));
    let calls = |name: &str| -> u64 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row: {stdout}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    // Six layers: an attention, two sublayer ends and a feed-forward block each; the
    // masked-LM transform's linear layer with GELU.
    assert_eq!(calls("attention"), 6, "{stdout}");
    assert_eq!(calls("residual_layer_norm"), 12, "{stdout}");
    assert_eq!(calls("feed_forward"), 6, "{stdout}");
    assert_eq!(calls("linear_gelu"), 1, "{stdout}");
    for row in ["outside the kernels", "total"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(row)),
            "{row}: {stdout}"
        );
    }
    // Forward and backward columns, the fused ops' backward passes timed in the second, and
    // the rate of a kernel's matrix products between them.
    assert!(
        stdout.contains("forward ms")
            && stdout.contains("backward ms")
            && stdout.contains("TFLOP/s"),
        "{stdout}"
    );
    let attention = stdout.lines().find(|l| l.starts_with("attention")).unwrap();
    let columns: Vec<&str> = attention.split_whitespace().collect();
    assert_eq!(columns.len(), 9, "{attention}");
    let rate: f64 = columns[4].parse().unwrap();
    assert!(rate.is_finite() && rate >= 0.0, "{attention}");
    // The host's time in its calls, forward + backward (on the CPU their whole time: within
    // the time columns' figures, to their rounding).
    let ms = |c: &str| -> f64 { c.parse().unwrap() };
    assert_eq!(columns[7], "+", "{attention}");
    assert!(
        ms(columns[6]) >= 0.0 && ms(columns[6]) <= ms(columns[2]) + 0.01,
        "{attention}"
    );
    assert!(
        ms(columns[8]) >= 0.0 && ms(columns[8]) <= ms(columns[5]) + 0.01,
        "{attention}"
    );
    assert!(stdout.contains("host ms"), "{stdout}");
    // A kernel without products has no rate: eight columns.
    let norm = stdout
        .lines()
        .find(|l| l.starts_with("residual_layer_norm"))
        .unwrap();
    assert_eq!(norm.split_whitespace().count(), 8, "{norm}");
}
