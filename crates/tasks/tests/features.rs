//! `extract-features` on the real all-MiniLM-L6-v2 against transformers'
//! `output_hidden_states` (`reference/minilm_forward.safetensors`: hidden states of every layer
//! for four sentences), in Google's JSON lines and in the npy folder.

use std::path::Path;

use bertkit_tasks::features::{FeatureFormat, FeatureOptions, extract_features};
use bertkit_test_support::require;
use candle_core::Device;
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    sentences: Vec<String>,
    tokens: Vec<Vec<String>>,
}

#[derive(Deserialize)]
struct Line {
    linex_index: usize,
    features: Vec<Token>,
}

#[derive(Deserialize)]
struct Token {
    token: String,
    layers: Vec<Layer>,
}

#[derive(Deserialize)]
struct Layer {
    index: i64,
    values: Vec<f32>,
}

fn reference() -> (
    Reference,
    std::collections::HashMap<String, candle_core::Tensor>,
) {
    let json = std::fs::read_to_string(require("reference/minilm_forward.json")).unwrap();
    let tensors = candle_core::safetensors::load(
        require("reference/minilm_forward.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    (serde_json::from_str(&json).unwrap(), tensors)
}

fn options(format: FeatureFormat) -> FeatureOptions {
    FeatureOptions {
        layers: vec![-1, -2, -3, -4, -5, -6],
        batch: 3,
        format,
        ..FeatureOptions::new(Device::Cpu)
    }
}

/// Reads an npy file written by the npy output: (shape, little-endian payload).
fn npy(path: &Path) -> (Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + len]).unwrap();
    let shape = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().unwrap())
        .collect();
    (shape, bytes[10 + len..].to_vec())
}

#[test]
fn features_equal_transformers_hidden_states_in_both_layouts() {
    let (reference, tensors) = reference();
    let model = require("minilm");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.txt");
    std::fs::write(&input, reference.sentences.join("\n") + "\n").unwrap();

    let jsonl = dir.path().join("features.jsonl");
    let mut progress = Vec::new();
    let summary = extract_features(
        &model,
        &input,
        &jsonl,
        &options(FeatureFormat::Jsonl),
        &mut |n| progress.push(n),
    )
    .unwrap();
    assert_eq!(summary.lines, 4);
    assert_eq!(progress, [3, 4]);
    assert_eq!(summary.truncated, 0);
    let lines: Vec<Line> = std::fs::read_to_string(&jsonl)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    let mut worst = 0f32;
    for (row, line) in lines.iter().enumerate() {
        assert_eq!(line.linex_index, row);
        let tokens: Vec<&str> = line.features.iter().map(|t| t.token.as_str()).collect();
        assert_eq!(tokens, reference.tokens[row]);
        for (position, token) in line.features.iter().enumerate() {
            let asked: Vec<i64> = token.layers.iter().map(|l| l.index).collect();
            assert_eq!(asked, [-1, -2, -3, -4, -5, -6]);
            for layer in &token.layers {
                // Google's -1 is the last of 6 layers: transformers' hidden_states.6.
                let want = tensors[&format!("hidden_states.{}", 7 + layer.index)]
                    .get(row)
                    .unwrap()
                    .get(position)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                for (a, b) in layer.values.iter().zip(&want) {
                    worst = worst.max((a - b).abs());
                }
            }
        }
    }
    eprintln!("extract-features against transformers: {worst:e}");
    assert!(worst <= 2e-5, "{worst:e}");

    let folder = dir.path().join("npy");
    let summary = extract_features(
        &model,
        &input,
        &folder,
        &options(FeatureFormat::Npy),
        &mut |_| {},
    )
    .unwrap();
    let (shape, offsets) = npy(&folder.join("offsets.npy"));
    assert_eq!(shape, [5]);
    let offsets: Vec<usize> = offsets
        .chunks(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
        .collect();
    let lengths: Vec<usize> = reference.tokens.iter().map(|t| t.len()).collect();
    assert_eq!(offsets[0], 0);
    for i in 0..4 {
        assert_eq!(offsets[i + 1] - offsets[i], lengths[i]);
    }
    assert_eq!(summary.tokens, offsets[4]);
    let (shape, ids) = npy(&folder.join("token_ids.npy"));
    assert_eq!(shape, [summary.tokens]);
    assert_eq!(
        i32::from_le_bytes(ids[..4].try_into().unwrap()),
        101,
        "[CLS]"
    );
    let (shape, last) = npy(&folder.join("layer_-1.npy"));
    assert_eq!(shape, [summary.tokens, 384]);
    let last: Vec<f32> = last
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    // Full precision: equal to the JSON's values up to its 6 decimals.
    for (row, line) in lines.iter().enumerate() {
        for (position, token) in line.features.iter().enumerate() {
            let at = (offsets[row] + position) * 384;
            for (a, b) in token.layers[0].values.iter().zip(&last[at..at + 384]) {
                assert!((a - b).abs() <= 5.1e-7, "{a} {b}");
            }
        }
    }
    let names: Vec<String> = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 6 + 2, "{names:?}");
}

#[test]
fn pairs_truncation_and_bad_input() {
    let model = require("minilm");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.txt");
    let long = "word ".repeat(200);
    std::fs::write(&input, format!("Hello! ||| How are you?\n{long}\n\n")).unwrap();
    let out = dir.path().join("f.jsonl");
    let opts = FeatureOptions {
        layers: vec![-1],
        max_seq_length: Some(16),
        ..FeatureOptions::new(Device::Cpu)
    };
    let summary = extract_features(&model, &input, &out, &opts, &mut |_| {}).unwrap();
    assert_eq!((summary.lines, summary.truncated), (3, 1));
    let lines: Vec<Line> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tokens: Vec<&str> = lines[0].features.iter().map(|t| t.token.as_str()).collect();
    assert_eq!(
        tokens,
        [
            "[CLS]", "hello", "!", "[SEP]", "how", "are", "you", "?", "[SEP]"
        ]
    );
    assert_eq!(lines[1].features.len(), 16);
    // An empty line is an example, as Google reads it.
    assert_eq!(lines[2].features.len(), 2);

    std::fs::write(&input, b"fine\n\xff\xfe bad\n").unwrap();
    let err = extract_features(&model, &input, &out, &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("input.txt") && err.contains("line 2 (byte offset 5) is not valid UTF-8"),
        "{err}"
    );
    let bad_layer = FeatureOptions {
        layers: vec![-7],
        ..opts.clone()
    };
    let err = extract_features(&model, &input, &out, &bad_layer, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer -7") && err.contains("6 encoder layers"),
        "{err}"
    );
}
