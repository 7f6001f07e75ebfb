//! The bad-input table's rows (BAD_INPUT.md) for what the model, training and task commands
//! read: model folders, run configs, task data, predictions, checkpoints, TensorFlow
//! checkpoints, feature outputs and metrics (the data stages' rows and the helpers in
//! `bad_input`).

use std::path::{Path, PathBuf};
use std::process::Output;

use bertkit_test_support::{repo_root, require};

use crate::bad_input::{cut_in_half, head, pretrain, refused, write};
use crate::util::{bertkit, book_records, ok, path as p, text};

// --- Model folders: `finetune`, `predict`, `forward` ----------------------------------------

/// A copy of the shared MiniLM folder in `dir/model`, with `change` applied.
fn model_copy(dir: &Path, change: impl FnOnce(&Path)) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "vocab.txt", "model.safetensors"] {
        std::fs::copy(require(format!("minilm/{f}")), model.join(f)).unwrap();
    }
    change(&model);
    model
}

fn finetune_glue(model: &Path, out: &Path) -> Output {
    let data = require("glue/MRPC");
    bertkit(&[
        "finetune",
        "glue",
        "--task",
        "mrpc",
        "--model",
        p(model),
        "--data",
        p(&data),
        "-o",
        p(out),
        "--max-steps",
        "1",
    ])
}

#[test]
fn model_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        cut_in_half(
            &require("minilm/model.safetensors"),
            &m.join("model.safetensors"),
        );
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("model.safetensors"),
        &["incomplete metadata"],
    );
}

#[test]
fn model_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        let config = std::fs::read_to_string(m.join("config.json")).unwrap();
        let at = config.find("\"model_type\"").unwrap_or(2);
        let mut bytes = config.as_bytes().to_vec();
        bytes.splice(at..at, b"\"n\\u00e9\": \"\xe9\", ".iter().copied());
        write(&m.join("config.json"), bytes);
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("config.json"),
        &["is not valid UTF-8", "byte offset"],
    );
}

#[test]
fn model_wrong_shape() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        let config = std::fs::read_to_string(m.join("config.json")).unwrap();
        let changed = config.replace("\"intermediate_size\": 1536", "\"intermediate_size\": 1024");
        assert_ne!(config, changed);
        write(&m.join("config.json"), changed);
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("model.safetensors"),
        &[
            "encoder.layer.0.intermediate.dense.weight: the checkpoint has shape [1536, 384], \
           the config needs [1024, 384]",
        ],
    );
}

#[test]
fn model_empty() {
    let dir = tempfile::tempdir().unwrap();
    // An empty folder, and a folder whose weights file is empty.
    let folder = dir.path().join("empty");
    std::fs::create_dir_all(&folder).unwrap();
    refused(
        finetune_glue(&folder, &dir.path().join("o1")),
        &folder.join("config.json"),
        &["not found (a model folder holds config.json and model.safetensors"],
    );
    let model = model_copy(dir.path(), |m| {
        write(&m.join("model.safetensors"), b"");
    });
    refused(
        finetune_glue(&model, &dir.path().join("o2")),
        &model.join("model.safetensors"),
        &["header too small"],
    );
}

#[test]
fn model_missing() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |m| {
        std::fs::remove_file(m.join("model.safetensors")).unwrap();
    });
    refused(
        finetune_glue(&model, &dir.path().join("o")),
        &model.join("model.safetensors"),
        &["not found (a model folder holds config.json and model.safetensors"],
    );
}

// --- Configs: `pretrain --config`, `pipeline --config` --------------------------------------

fn tiny_config() -> String {
    std::fs::read_to_string(repo_root().join("pipelines/tiny.toml")).unwrap()
}

fn pretrain_config(config: &Path) -> Output {
    bertkit(&["pretrain", "--config", p(config), "--max-steps", "1"])
}

fn pipeline_config(config: &Path) -> Output {
    bertkit(&["pipeline", "--config", p(config)])
}

#[test]
fn config_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let cut_at = config.find("[data]").unwrap() + "[data]\nrecords ".len();
    let cut = write(&dir.path().join("cut.toml"), &config[..cut_at]);
    refused(
        pretrain_config(&cut),
        &cut,
        &["TOML parse error at line", "expected `=`"],
    );
    let demo = std::fs::read_to_string(repo_root().join("pipelines/demo.toml")).unwrap();
    let cut_at = demo.find("[shard]").unwrap() + "[shard]\n".len() + 3;
    let cut = write(&dir.path().join("cut-pipeline.toml"), &demo[..cut_at]);
    refused(pipeline_config(&cut), &cut, &["TOML parse error at line"]);
}

#[test]
fn config_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = tiny_config().into_bytes();
    let at = bytes.len();
    bytes.extend_from_slice(b"# caf\xe9\n");
    let lines = bytes.iter().filter(|&&b| b == b'\n').count();
    let config = write(&dir.path().join("latin1.toml"), bytes);
    refused(
        pretrain_config(&config),
        &config,
        &[&format!(
            "line {lines} (byte offset {}) is not valid UTF-8",
            at + 5
        )],
    );
    refused(pipeline_config(&config), &config, &["is not valid UTF-8"]);
}

#[test]
fn config_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let misspelt = write(
        &dir.path().join("misspelt.toml"),
        tiny_config().replace("micro_batch = 16", "micro_bach = 16"),
    );
    refused(
        pretrain_config(&misspelt),
        &misspelt,
        &["unknown field `micro_bach`", "line 12"],
    );
    let wrong_type = write(
        &dir.path().join("type.toml"),
        tiny_config().replace("micro_batch = 16", "micro_batch = \"sixteen\""),
    );
    refused(
        pretrain_config(&wrong_type),
        &wrong_type,
        &["invalid type: string \"sixteen\", expected usize"],
    );
}

#[test]
fn config_empty() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(&dir.path().join("empty.toml"), b"");
    refused(pretrain_config(&empty), &empty, &["missing field `output`"]);
    refused(pipeline_config(&empty), &empty, &["missing field `output`"]);
}

#[test]
fn config_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("phase1.toml");
    refused(
        pretrain_config(&missing),
        &missing,
        &["No such file or directory"],
    );
    refused(
        pipeline_config(&missing),
        &missing,
        &["No such file or directory"],
    );
}

// --- SQuAD and GLUE files: `finetune squad`, `finetune glue` --------------------------------

fn finetune_squad(train: &Path, out: &Path) -> Output {
    let model = require("minilm");
    bertkit(&[
        "finetune",
        "squad",
        "--model",
        p(&model),
        "--train",
        p(train),
        "-o",
        p(out),
        "--max-steps",
        "1",
    ])
}

/// A GLUE task folder with MRPC's dev file as `dev.tsv` and `train` as `train.tsv`.
fn glue_folder(dir: &Path, train: impl AsRef<[u8]>) -> PathBuf {
    let folder = dir.join("MRPC");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(require("glue/MRPC/dev.tsv"), folder.join("dev.tsv")).unwrap();
    write(&folder.join("train.tsv"), train);
    folder
}

fn finetune_glue_data(data: &Path, out: &Path) -> Output {
    let model = require("minilm");
    bertkit(&[
        "finetune",
        "glue",
        "--task",
        "mrpc",
        "--model",
        p(&model),
        "--data",
        p(data),
        "-o",
        p(out),
        "--max-steps",
        "1",
    ])
}

#[test]
fn task_data_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(
        &dir.path().join("train.json"),
        head(&require("squad/dev-v1.1.json"), 3000),
    );
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["not SQuAD JSON: EOF while parsing", "line 1 column 3000"],
    );
    // A row cut short.
    let train = std::fs::read_to_string(require("glue/MRPC/train.tsv")).unwrap();
    let cut_at = train.match_indices('\n').nth(9).unwrap().0 + 20;
    let folder = glue_folder(dir.path(), &train[..cut_at]);
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["line 11: ", "columns"],
    );
}

#[test]
fn task_data_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(
        &dir.path().join("train.json"),
        b"{\"version\": \"1.1\", \"data\": [{\"title\": \"Caf\xe9\", \"paragraphs\": []}]}",
    );
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["line 1 (byte offset 42) is not valid UTF-8"],
    );
    let train = std::fs::read_to_string(require("glue/MRPC/train.tsv")).unwrap();
    let mut bytes: Vec<u8> = train.lines().take(5).collect::<Vec<_>>().join("\n").into();
    bytes.extend_from_slice(b"\n1\t1\t2\tThe caf\xe9 opened.\tIt opened.\n");
    let folder = glue_folder(dir.path(), bytes);
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["line 6 (byte offset", "is not valid UTF-8"],
    );
    let folder = glue_folder(dir.path(), crate::bad_input::utf16le(&train, true));
    refused(
        finetune_glue_data(&folder, &dir.path().join("o3")),
        &folder.join("train.tsv"),
        &["line 1 holds a NUL byte (byte offset", "or UTF-16"],
    );
}

#[test]
fn task_data_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(
        &dir.path().join("train.json"),
        r#"{"version": "1.1", "data": [{"title": "x", "paragraphs": [{"text": "no context", "qas": []}]}]}"#,
    );
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["not SQuAD JSON: missing field `context`", "line 1 column"],
    );
    // CoLA's file where MRPC's should be.
    let folder = glue_folder(
        dir.path(),
        std::fs::read(require("glue/CoLA/train.tsv")).unwrap(),
    );
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["line 2: label", "is not one of [\"0\", \"1\"]"],
    );
}

#[test]
fn task_data_empty() {
    let dir = tempfile::tempdir().unwrap();
    let squad = write(&dir.path().join("train.json"), b"");
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["not SQuAD JSON: EOF while parsing a value at line 1 column 0"],
    );
    let header = std::fs::read_to_string(require("glue/MRPC/train.tsv"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    let folder = glue_folder(dir.path(), format!("{header}\n"));
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["no examples: the file is empty or holds only a header"],
    );
}

#[test]
fn task_data_missing() {
    let dir = tempfile::tempdir().unwrap();
    let squad = dir.path().join("train-v1.1.json");
    refused(
        finetune_squad(&squad, &dir.path().join("o1")),
        &squad,
        &["No such file or directory"],
    );
    let folder = dir.path().join("MRPC");
    std::fs::create_dir_all(&folder).unwrap();
    refused(
        finetune_glue_data(&folder, &dir.path().join("o2")),
        &folder.join("train.tsv"),
        &["No such file or directory"],
    );
}

// --- SQuAD predictions: `evaluate squad` ----------------------------------------------------

fn evaluate(predictions: &Path) -> Output {
    let data = require("squad/dev-v1.1.json");
    bertkit(&[
        "evaluate",
        "squad",
        "--data",
        p(&data),
        "--predictions",
        p(predictions),
    ])
}

#[test]
fn predictions_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let cut = write(
        &dir.path().join("predictions.json"),
        head(&require("reference/squad_pred_first_gold.json"), 500),
    );
    refused(
        evaluate(&cut),
        &cut,
        &[
            "not a JSON object of question id to answer text: EOF while parsing",
            "column 500",
        ],
    );
}

#[test]
fn predictions_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        &dir.path().join("predictions.json"),
        b"{\n\"56be4db0acb8001400a502ec\": \"Caf\xe9\"\n}\n",
    );
    refused(
        evaluate(&bad),
        &bad,
        &["line 2 (byte offset 34) is not valid UTF-8"],
    );
}

#[test]
fn predictions_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let list = write(
        &dir.path().join("predictions.json"),
        r#"["Denver Broncos"]"#,
    );
    refused(
        evaluate(&list),
        &list,
        &["invalid type: sequence, expected a map"],
    );
    let number = write(
        &dir.path().join("numbers.json"),
        r#"{"56be4db0acb8001400a502ec": 5}"#,
    );
    refused(
        evaluate(&number),
        &number,
        &["invalid type: integer `5`, expected a string"],
    );
}

#[test]
fn predictions_empty() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(&dir.path().join("predictions.json"), b"");
    refused(
        evaluate(&empty),
        &empty,
        &["EOF while parsing a value at line 1 column 0"],
    );
}

#[test]
fn predictions_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("predictions.json");
    refused(evaluate(&missing), &missing, &["No such file or directory"]);
}

// --- Checkpoints: `pretrain --resume` -------------------------------------------------------

/// A run folder with a whole checkpoint at step 1 (tiny config, the book's records), and the
/// records.
fn checkpointed_run(dir: &Path) -> (PathBuf, PathBuf) {
    let records = book_records(dir);
    let run = dir.join("run");
    ok(pretrain(&records, &run, &[]));
    assert!(run.join("checkpoints/step-1/state.json").is_file());
    (run, records)
}

fn resume(records: &Path, run: &Path) -> Output {
    let config = repo_root().join("pipelines/tiny.toml");
    bertkit(&[
        "pretrain",
        "--config",
        p(&config),
        "--data",
        p(records),
        "--no-eval",
        "--output",
        p(run),
        "--max-steps",
        "2",
        "--resume",
    ])
}

#[test]
fn checkpoint_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let optimizer = run.join("checkpoints/step-1/optimizer.safetensors");
    cut_in_half(&optimizer.clone(), &optimizer);
    refused(
        resume(&records, &run),
        &optimizer,
        &[
            "no checkpoint of",
            "its SHA-256 differs from the one the checkpoint recorded",
        ],
    );
    // `bertkit check checkpoint` names it too.
    refused(
        bertkit(&["check", "checkpoint", p(&run)]),
        &optimizer,
        &["1 of 1 checkpoints damaged"],
    );
}

#[test]
fn checkpoint_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let state = run.join("checkpoints/step-1/state.json");
    let mut bytes = std::fs::read(&state).unwrap();
    bytes.insert(3, 0xff);
    write(&state, bytes);
    refused(
        resume(&records, &run),
        &state,
        &["its SHA-256 differs from the one the checkpoint recorded"],
    );
}

#[test]
fn checkpoint_wrong_shape() {
    // Resumed with a config whose model is another (MiniLM's width where the run was tiny).
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let config = write(
        &dir.path().join("wider.toml"),
        tiny_config().replace(
            "preset = \"tiny\"",
            &format!("config = {:?}", p(&require("minilm/config.json"))),
        ),
    );
    let run_args = [
        "pretrain",
        "--config",
        p(&config),
        "--data",
        p(&records),
        "--no-eval",
        "--output",
        p(&run),
        "--max-steps",
        "2",
        "--resume",
    ];
    refused(
        bertkit(&run_args),
        &run.join("checkpoints/step-1/config.json"),
        &[
            "the checkpoint's model is not the run config's [model]",
            "hidden_size 32 (the config says 384)",
        ],
    );
}

/// A damaged newest checkpoint (a flipped byte in its weights): `check checkpoint` names it,
/// and `--resume` warns and goes on from the newest checkpoint that verifies, the run then
/// writing its own checkpoints in place of the damaged one.
#[test]
fn checkpoint_damaged_newest() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let run = dir.path().join("run");
    let config = repo_root().join("pipelines/tiny.toml");
    let args = |steps: &'static str, resume: bool| {
        let mut a = vec![
            "pretrain".to_string(),
            "--config".into(),
            p(&config).into(),
            "--data".into(),
            p(&records).into(),
            "--no-eval".into(),
            "--output".into(),
            p(&run).into(),
            "--max-steps".into(),
            steps.into(),
            "--set".into(),
            "train.checkpoint_every=1".into(),
        ];
        if resume {
            a.push("--resume".into());
        }
        a
    };
    let run_with = |a: Vec<String>| bertkit(&a.iter().map(String::as_str).collect::<Vec<_>>());
    ok(run_with(args("2", false)));
    let weights = run.join("checkpoints/step-2/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x10;
    write(&weights, bytes);
    refused(
        bertkit(&["check", "checkpoint", p(&run)]),
        &weights,
        &[
            "1 of 2 checkpoints damaged",
            "differs from the one the checkpoint recorded",
        ],
    );
    // Asked to stop rather than fall back, the run stops, naming the file.
    let mut strict = args("3", true);
    strict.push("--stop-if-damaged".into());
    refused(
        run_with(strict),
        &weights,
        &[
            "stopped (--stop-if-damaged)",
            "resumes from the newest checkpoint that verifies (step 1)",
        ],
    );
    // Nor is the damaged checkpoint loaded as a model.
    refused(
        bertkit(&[
            "finetune",
            "glue",
            "--task",
            "mrpc",
            "--model",
            p(&run.join("checkpoints/step-2")),
            "--data",
            p(&bertkit_test_support::require("glue/MRPC")),
        ]),
        &weights,
        &["differs from the one the checkpoint recorded"],
    );
    let resumed = run_with(args("3", true));
    let stderr = text(&resumed.stderr);
    let out = ok(resumed);
    assert!(out.contains("steps 1..3"), "{out}");
    assert!(
        stderr.contains("warning:")
            && stderr.contains("resuming from the newest checkpoint that verifies (step 1)"),
        "{stderr}"
    );
    let checked = ok(bertkit(&["check", "checkpoint", p(&run)]));
    assert!(
        checked.contains("step 2: ok") && checked.contains("step 3: ok"),
        "{checked}"
    );
}

#[test]
fn checkpoint_empty() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let model = run.join("checkpoints/step-1/model.safetensors");
    write(&model, b"");
    refused(
        resume(&records, &run),
        &model,
        &["its SHA-256 differs from the one the checkpoint recorded"],
    );
}

/// A run folder another run is writing (a second terminal, a launcher's retry): refused before
/// anything in it is read or cleaned up, naming the first run's pid and host; once that run
/// has let go, the same command runs.
#[test]
fn checkpoint_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    // A leftover of the first run's checkpoint being written: the second must not delete it.
    let partial = run.join("checkpoints/.step-2.partial");
    std::fs::create_dir_all(&partial).unwrap();
    let first = bertkit_stage_io::lock::FolderLock::acquire(&run).unwrap();
    let pid = format!("pid {} on host ", std::process::id());
    refused(
        resume(&records, &run),
        &run,
        &["is being written by another run", &pid],
    );
    assert!(
        partial.is_dir(),
        "the first run's partial checkpoint was touched"
    );
    // Fine-tuning's output folders too.
    let model = require("minilm");
    let out = dir.path().join("o");
    let held = bertkit_stage_io::lock::FolderLock::acquire(&out).unwrap();
    refused(
        finetune_glue(&model, &out),
        &out,
        &["is being written by another run", &pid],
    );
    drop(held);
    drop(first);
    let out = ok(resume(&records, &run));
    assert!(out.contains("steps 1..2"), "{out}");
}

#[test]
fn checkpoint_missing() {
    let dir = tempfile::tempdir().unwrap();
    let (run, records) = checkpointed_run(dir.path());
    let optimizer = run.join("checkpoints/step-1/optimizer.safetensors");
    std::fs::remove_file(&optimizer).unwrap();
    refused(
        resume(&records, &run),
        &optimizer,
        &["No such file or directory"],
    );
    // No checkpoint at all: --resume starts the run from step 0, and says so.
    let fresh = dir.path().join("fresh");
    let run = resume(&records, &fresh);
    let stderr = text(&run.stderr);
    let out = ok(run);
    assert!(out.contains("steps 0..2"), "{out}");
    assert!(
        stderr.contains("note: --resume: no checkpoint under") && stderr.contains("step 0"),
        "{stderr}"
    );
}

// --- Google's TensorFlow checkpoints: `convert tf-checkpoint` ------------------------------

/// The fixture's checkpoint (Google's layout, written by TensorFlow) copied to `dir`; returns
/// its prefix.
fn tf_checkpoint_copy(dir: &Path) -> PathBuf {
    let fixture = repo_root().join("crates/model/tests/fixtures/google_tf");
    for f in [
        "bert_config.json",
        "vocab.txt",
        "bert_model.ckpt.index",
        "bert_model.ckpt.data-00000-of-00001",
    ] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    dir.join("bert_model.ckpt")
}

fn convert_tf(prefix: &Path, out: &Path) -> Output {
    let run = bertkit(&[
        "convert",
        "tf-checkpoint",
        "--checkpoint",
        p(prefix),
        "-o",
        p(out),
    ]);
    assert!(!out.join("model.safetensors").exists());
    run
}

#[test]
fn tf_checkpoint_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let index = dir.path().join("bert_model.ckpt.index");
    let bytes = std::fs::read(&index).unwrap();
    write(&index, &bytes[..bytes.len() - 100]);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["no table magic number at the end"],
    );
    // A data shard cut short: the first variable past its end is named.
    write(&index, &bytes);
    let data = dir.path().join("bert_model.ckpt.data-00000-of-00001");
    cut_in_half(&data.clone(), &data);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &data,
        &["tensor \"", "run past the file's", "(truncated?)"],
    );
}

#[test]
fn tf_checkpoint_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let data = dir.path().join("bert_model.ckpt.data-00000-of-00001");
    let mut bytes = std::fs::read(&data).unwrap();
    // Inside the first variable, a parameter (TensorFlow writes them in name order; the Adam
    // slots, skipped unread, would not be checked).
    bytes[5] ^= 0x01;
    write(&data, bytes);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &data,
        &[
            "tensor \"bert/embeddings/LayerNorm/beta\"",
            "CRC-32C mismatch",
            "the data file is damaged",
        ],
    );
    let index = dir.path().join("bert_model.ckpt.index");
    std::fs::copy(
        repo_root()
            .join("crates/model/tests/fixtures/google_tf/bert_model.ckpt.data-00000-of-00001"),
        &data,
    )
    .unwrap();
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[40] ^= 0x01;
    write(&index, bytes);
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["data block at byte 0: CRC-32C mismatch"],
    );
}

#[test]
fn tf_checkpoint_wrong_schema() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    // A config of another width than the checkpoint's.
    let config = dir.path().join("bert_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    write(
        &config,
        text.replace("\"intermediate_size\": 64", "\"intermediate_size\": 48"),
    );
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &prefix,
        &[
            "encoder.layer.0.intermediate.dense",
            "the config needs [48, 32]",
        ],
    );
    // Not a checkpoint index at all (a vocabulary given as one).
    let index = dir.path().join("bert_model.ckpt.index");
    std::fs::copy(dir.path().join("vocab.txt"), &index).unwrap();
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["not a checkpoint index"],
    );
}

#[test]
fn tf_checkpoint_empty() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let index = write(&dir.path().join("bert_model.ckpt.index"), b"");
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["0 bytes, shorter than a table's 48-byte footer"],
    );
}

#[test]
fn tf_checkpoint_missing() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_checkpoint_copy(dir.path());
    let data = dir.path().join("bert_model.ckpt.data-00000-of-00001");
    std::fs::remove_file(&data).unwrap();
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &data,
        &["data shard 0 of 1", "No such file or directory"],
    );
    let index = dir.path().join("bert_model.ckpt.index");
    std::fs::remove_file(&index).unwrap();
    refused(
        convert_tf(&prefix, &dir.path().join("o")),
        &index,
        &["No such file or directory"],
    );
}

// --- Text for `extract-features` ------------------------------------------------------------

#[test]
fn features_text_bad_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(&dir.path().join("lines.txt"), b"fine\nbad \xff here\n");
    let out = dir.path().join("f.jsonl");
    let model = require("minilm");
    let extract = || {
        bertkit(&[
            "extract-features",
            "--model",
            p(&model),
            "--input",
            p(&input),
            "-o",
            p(&out),
        ])
    };
    refused(
        extract(),
        &input,
        &["line 2 (byte offset 9) is not valid UTF-8"],
    );
    assert!(!out.exists());
    // Nothing left behind, not even the hidden partial file.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    // A UTF-16 file is valid UTF-8 where its text is ASCII, a NUL beside each letter: refused
    // for its NULs, not read with them dropped.
    std::fs::write(&input, crate::bad_input::utf16le("fine\nlines\n", false)).unwrap();
    refused(
        extract(),
        &input,
        &["line 1 holds a NUL byte (byte offset 1)", "or UTF-16"],
    );
}

#[test]
fn features_output_wrong_kind() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(&dir.path().join("lines.txt"), b"fine\n");
    let folder = dir.path().join("out");
    std::fs::create_dir(&folder).unwrap();
    let file = write(&dir.path().join("out.npy"), b"");
    let model = require("minilm");
    for (output, format, says) in [
        (
            &folder,
            "jsonl",
            "the output is a folder: --format jsonl writes a file",
        ),
        (
            &file,
            "npy",
            "the output is a file: --format npy writes a folder",
        ),
    ] {
        refused(
            bertkit(&[
                "extract-features",
                "--model",
                p(&model),
                "--input",
                p(&input),
                "--format",
                format,
                "-o",
                p(output),
            ]),
            output,
            &[says],
        );
    }
    // Refused before any work: nothing new beside them.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0);
}

// --- Metrics for `plot` -------------------------------------------------------------------------

/// Curves whose values span almost nothing (a loss of 0 then 1e-323) or the whole of f64's
/// range are drawn, not a panic in the axis's ticks.
#[test]
fn metrics_degenerate_span() {
    let dir = tempfile::tempdir().unwrap();
    for (name, values) in [("tiny", [0.0, 1e-323]), ("huge", [-f64::MAX, f64::MAX])] {
        let rows: String = values
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{{\"step\": {}, \"loss\": {v:e}, \"lr\": {v:e}}}\n", i + 1))
            .collect();
        let metrics = write(&dir.path().join(format!("{name}.jsonl")), rows.as_bytes());
        let svg = dir.path().join(format!("{name}.svg"));
        let out = bertkit(&["plot", p(&metrics), "-o", p(&svg)]);
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        assert!(
            std::fs::read_to_string(&svg).unwrap().contains("<polyline"),
            "{name}"
        );
    }
}
