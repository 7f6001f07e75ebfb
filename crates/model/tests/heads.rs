//! The masked-LM, next-sentence, question-answering and classification heads against
//! transformers on the real MiniLM encoder (`fixtures/heads/heads.json`, made once by
//! `make_reference.py` beside it, whose README says how), and the tensor names bertkit saves
//! against the names transformers saves for each architecture.
//!
//! The checkpoint has no heads; both sides set every head parameter to the shared reference
//! values (`bertkit_test_support::reference_value`).

use std::collections::BTreeMap;
use std::path::Path;

use bertkit_model::bert::{
    BertArchitecture, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
    Loaded, load, save,
};
use bertkit_model::{Inputs, MaskedPositions, Mode};
use bertkit_test_support::{reference_values, repo_root, require};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    lengths: Vec<usize>,
    masked_positions: Vec<Vec<u32>>,
    vocab_columns: Vec<usize>,
    mlm_logits_at_columns: Vec<Vec<Vec<f64>>>,
    mlm_logsumexp: Vec<Vec<f64>>,
    mlm_argmax: Vec<Vec<u32>>,
    nsp_logits: Vec<Vec<f64>>,
    qa_start_logits: Vec<Vec<f64>>,
    qa_end_logits: Vec<Vec<f64>>,
    num_labels: usize,
    classifier_logits: Vec<Vec<f64>>,
    saved_names: BTreeMap<String, Vec<String>>,
}

fn reference() -> Reference {
    let path = repo_root().join("crates/model/tests/fixtures/heads/heads.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The logits' tolerance: transformers' encoder output and ours differ by up to 3.9e-6 (f32);
/// the heads add one or two matrix products. Measured worst: see the test's output.
const TOL: f64 = 2e-5;

/// The reference inputs (`[4, 33]`, padded) of `reference/minilm_forward.safetensors`.
fn inputs<M>(loaded: &Loaded<M>) -> Inputs {
    let t = candle_core::safetensors::load(
        require("reference/minilm_forward.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    Inputs::new(
        &loaded.config,
        &t["input_ids"],
        Some(&t["token_type_ids"]),
        Some(&t["attention_mask"]),
    )
    .unwrap()
}

/// `dir`'s model with every head parameter set to the reference values.
fn with_reference_heads<M: BertArchitecture>(dir: &Path) -> Loaded<M> {
    let loaded = load::<M>(dir, DType::F32, &Device::Cpu, 0).unwrap();
    let mut set = 0;
    for (name, var) in loaded.params.vars() {
        if ["cls.", "qa_outputs.", "classifier."]
            .iter()
            .any(|h| name.starts_with(h))
        {
            let values = reference_values(name, var.elem_count());
            let t = Tensor::from_vec(values, var.dims(), &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            var.set(&t).unwrap();
            set += 1;
        }
    }
    assert!(set >= 2, "no head parameters found");
    loaded
}

fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64).unwrap().to_vec2().unwrap()
}

/// Largest |a - b| over the first `lengths[r]` values of each row (all when `lengths` is None).
fn max_diff(ours: &[Vec<f64>], theirs: &[Vec<f64>], lengths: Option<&[usize]>) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    let mut worst = 0f64;
    for (r, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(a.len(), b.len());
        let n = lengths.map_or(a.len(), |l| l[r]);
        for (x, y) in a[..n].iter().zip(&b[..n]) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

#[test]
fn pre_training_heads_match_transformers() {
    let r = reference();
    let loaded = with_reference_heads::<BertForPreTraining>(&require("minilm"));
    let batch = r.lengths.len();
    let predictions = r.masked_positions[0].len();
    let flat: Vec<u32> = r.masked_positions.concat();
    let seq = 33;
    let positions =
        MaskedPositions::from_host((batch, predictions), &flat, seq, &Device::Cpu).unwrap();
    let out = loaded
        .model
        .forward(&inputs(&loaded), &positions, Mode::Eval)
        .unwrap();
    let logits: Vec<Vec<Vec<f64>>> = out
        .mlm_logits
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec3()
        .unwrap();
    let mut worst = 0f64;
    let mut worst_lse = 0f64;
    for (b, slots) in logits.iter().enumerate() {
        for (p, row) in slots.iter().enumerate() {
            let picked: Vec<f64> = r.vocab_columns.iter().map(|&c| row[c]).collect();
            worst = worst.max(max_diff(
                &[picked],
                &[r.mlm_logits_at_columns[b][p].clone()],
                None,
            ));
            // The whole vocabulary row, through its log-sum-exp (a wrong decoder bias or an
            // untied decoder moves it).
            let max = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            worst_lse = worst_lse.max((lse - r.mlm_logsumexp[b][p]).abs());
            let argmax = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0;
            assert_eq!(argmax as u32, r.mlm_argmax[b][p], "row {b} slot {p}");
        }
    }
    let nsp = max_diff(&rows(&out.nsp_logits), &r.nsp_logits, None);
    eprintln!("masked-LM logits {worst:.2e}, log-sum-exp {worst_lse:.2e}, next sentence {nsp:.2e}");
    assert!(worst < TOL, "masked-LM logits differ by {worst}");
    assert!(
        worst_lse < TOL,
        "masked-LM log-sum-exp differs by {worst_lse}"
    );
    assert!(nsp < TOL, "next-sentence logits differ by {nsp}");
}

#[test]
fn question_answering_head_matches_transformers() {
    let r = reference();
    let loaded = with_reference_heads::<BertForQuestionAnswering>(&require("minilm"));
    let (start, end) = loaded.model.forward(&inputs(&loaded), Mode::Eval).unwrap();
    // Padded positions hold whatever each side's additive mask gives: compare real tokens.
    let lengths = Some(r.lengths.as_slice());
    let s = max_diff(&rows(&start), &r.qa_start_logits, lengths);
    let e = max_diff(&rows(&end), &r.qa_end_logits, lengths);
    eprintln!("start logits {s:.2e}, end logits {e:.2e}");
    assert!(s < TOL && e < TOL, "start {s}, end {e}");
}

/// MiniLM's folder with a config of `labels` classes.
fn minilm_with_labels(dir: &Path, labels: usize) {
    let minilm = require("minilm");
    std::fs::copy(
        minilm.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(minilm.join("config.json")).unwrap())
            .unwrap();
    let id2label: serde_json::Map<String, serde_json::Value> = (0..labels)
        .map(|i| (i.to_string(), format!("LABEL_{i}").into()))
        .collect();
    config["id2label"] = id2label.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

#[test]
fn classification_head_matches_transformers() {
    let r = reference();
    let dir = tempfile::tempdir().unwrap();
    minilm_with_labels(dir.path(), r.num_labels);
    let loaded = with_reference_heads::<BertForSequenceClassification>(dir.path());
    let logits = loaded.model.forward(&inputs(&loaded), Mode::Eval).unwrap();
    let d = max_diff(&rows(&logits), &r.classifier_logits, None);
    eprintln!("class logits {d:.2e}");
    assert!(d < TOL, "class logits differ by {d}");
}

/// The names in a saved `model.safetensors`, sorted.
fn saved_names<M: BertArchitecture>(loaded: &Loaded<M>) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    save(loaded, dir.path(), DType::F32).unwrap();
    let mut names: Vec<String> =
        candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu)
            .unwrap()
            .into_keys()
            .collect();
    names.sort();
    names
}

#[test]
fn saved_models_hold_exactly_the_tensors_transformers_saves() {
    let r = reference();
    let minilm = require("minilm");
    let dir = tempfile::tempdir().unwrap();
    minilm_with_labels(dir.path(), r.num_labels);
    let ours = [
        (
            "BertForPreTraining",
            saved_names(&load::<BertForPreTraining>(&minilm, DType::F32, &Device::Cpu, 0).unwrap()),
        ),
        (
            "BertForQuestionAnswering",
            saved_names(
                &load::<BertForQuestionAnswering>(&minilm, DType::F32, &Device::Cpu, 0).unwrap(),
            ),
        ),
        (
            "BertForSequenceClassification",
            saved_names(
                &load::<BertForSequenceClassification>(dir.path(), DType::F32, &Device::Cpu, 0)
                    .unwrap(),
            ),
        ),
    ];
    for (architecture, names) in ours {
        assert_eq!(
            names, r.saved_names[architecture],
            "{architecture}: bertkit's saved names (left) against transformers' (right)"
        );
    }
}

#[test]
fn the_fixtures_carry_their_sha256_in_their_readmes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    assert_eq!(bertkit_test_support::check_fixture_digests(&root), 2);
}
