//! `bertkit forward` on the real MiniLM checkpoint and transformers' reference inputs: the
//! output file has the reference's names and shapes, and its values match on unpadded positions.

use std::process::Command;

use bertkit_test_support::require;
use candle_core::{DType, Device, Tensor};

#[test]
fn forward_writes_what_transformers_computes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let reference_path = require("reference/minilm_forward.safetensors");
    let run = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["forward", "--model"])
        .arg(require("minilm"))
        .arg("--input")
        .arg(&reference_path)
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains("9 tensors for 4 sequence(s) of 33"),
        "{stdout}"
    );

    let reference = candle_core::safetensors::load(&reference_path, &Device::Cpu).unwrap();
    let got = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    let mask = reference["attention_mask"].to_dtype(DType::F32).unwrap();
    let mut names: Vec<&String> = got.keys().collect();
    names.sort();
    assert_eq!(names.len(), 9);
    for name in names {
        let want = &reference[name];
        let have = &got[name];
        assert_eq!(have.dims(), want.dims(), "{name}");
        assert_eq!(have.dtype(), DType::F32);
        let diff = (have - want).unwrap().abs().unwrap();
        let diff: Tensor = if diff.rank() == 3 {
            diff.broadcast_mul(&mask.unsqueeze(2).unwrap()).unwrap()
        } else {
            diff
        };
        let max = diff.max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(max <= 1e-4, "{name}: {max}");
    }

    // Inputs without input_ids: a clear error naming the file.
    let bad = dir.path().join("bad.safetensors");
    let mut only_mask = std::collections::HashMap::new();
    only_mask.insert(
        "attention_mask".to_string(),
        reference["attention_mask"].clone(),
    );
    candle_core::safetensors::save(&only_mask, &bad).unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["forward", "--model"])
        .arg(require("minilm"))
        .arg("--input")
        .arg(&bad)
        .arg("--output")
        .arg(dir.path().join("x.safetensors"))
        .output()
        .unwrap();
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("bad.safetensors: no input_ids"), "{stderr}");
    assert!(!dir.path().join("x.safetensors").exists());
}

/// A user's path from Google's checkpoint: `convert tf-checkpoint` on the TensorFlow-written
/// fixture (folder given; config and vocabulary found beside it), `extract-features` on the
/// converted folder, `convert to-tf-checkpoint` back: each command's summary and files.
#[test]
fn from_a_google_checkpoint_to_features_and_back() {
    use crate::util::{bertkit, ok, path as p};
    let dir = tempfile::tempdir().unwrap();
    let fixture = bertkit_test_support::repo_root().join("crates/model/tests/fixtures/google_tf");
    let model = dir.path().join("model");
    let out = ok(bertkit(&[
        "convert",
        "tf-checkpoint",
        "--checkpoint",
        p(&fixture),
        "-o",
        p(&model),
    ]));
    assert!(
        out.contains("a BertForPreTraining of 46 tensors")
            && out.contains("skipped 93 optimizer and step variables"),
        "{out}"
    );
    for f in ["config.json", "model.safetensors", "vocab.txt"] {
        assert!(model.join(f).is_file(), "{f}");
    }
    let input = dir.path().join("lines.txt");
    std::fs::write(&input, "w01 w02 w03\nw04 ||| w05 w06\n").unwrap();
    let features = dir.path().join("f.jsonl");
    let out = ok(bertkit(&[
        "extract-features",
        "--model",
        p(&model),
        "--input",
        p(&input),
        "-o",
        p(&features),
        "--layers",
        "-1,0",
    ]));
    assert!(
        out.contains("2 lines, 11 tokens, layers [-1, 0] of width 32"),
        "{out}"
    );
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&features)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first["features"][1]["token"], "w01");
    assert_eq!(first["features"][1]["layers"][1]["index"], 0);
    assert_eq!(
        first["features"][1]["layers"][0]["values"]
            .as_array()
            .unwrap()
            .len(),
        32
    );
    let back = dir.path().join("tf");
    let run = bertkit(&[
        "convert",
        "to-tf-checkpoint",
        "--model",
        p(&model),
        "-o",
        p(&back),
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    let out = ok(run);
    assert!(
        out.contains("46 variables") && out.contains("and vocab.txt"),
        "{out}"
    );
    assert!(
        !stderr.contains("GELU"),
        "a gelu_new model needs no GELU note: {stderr}"
    );
    for f in [
        "bert_model.ckpt.index",
        "bert_model.ckpt.data-00000-of-00001",
        "bert_config.json",
        "checkpoint",
        "vocab.txt",
    ] {
        assert!(back.join(f).is_file(), "{f}");
    }
}
