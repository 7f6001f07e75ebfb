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
