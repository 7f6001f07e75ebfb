//! Google's TensorFlow checkpoints: `fixtures/google_tf` holds a small BERT saved by
//! TensorFlow's own saver in google-research/bert's variable layout (with Adam slots and a
//! global step) and what Google's graph computes with it (`make_checkpoint.py`, whose README
//! says how it was made). The converted model must compute the same (f32, 2e-5), the way back
//! must give the same tensors bit for bit, every head must survive both ways, and damaged or
//! mismatched checkpoints must fail naming the file and variable.

use std::path::{Path, PathBuf};

use bertkit_model::bert::{
    BertArchitecture, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
    BertModel, init, load_frozen, save,
};
use bertkit_model::google::{GoogleName, convert_from_tf, convert_to_tf, from_google_name};
use bertkit_model::{BertConfig, Inputs, MaskedPositions, Mode};
use bertkit_test_support::repo_root;
use bertkit_tf_checkpoint::{Checkpoint, Writer};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

fn fixture() -> PathBuf {
    repo_root().join("crates/model/tests/fixtures/google_tf")
}

#[derive(Deserialize)]
struct Expected {
    input_ids: Vec<Vec<u32>>,
    input_mask: Vec<Vec<u32>>,
    segment_ids: Vec<Vec<u32>>,
    masked_lm_positions: Vec<Vec<u32>>,
    all_encoder_layers: Vec<Vec<Vec<Vec<f32>>>>,
    pooled_output: Vec<Vec<f32>>,
    masked_lm_logits: Vec<Vec<f32>>,
    next_sentence_logits: Vec<Vec<f32>>,
}

fn convert(out: &Path) -> bertkit_model::google::FromTfSummary {
    let f = fixture();
    convert_from_tf(
        &f.join("bert_model.ckpt"),
        &f.join("bert_config.json"),
        Some(&f.join("vocab.txt")),
        out,
    )
    .unwrap()
}

fn worst(got: &Tensor, want: &[f32]) -> f32 {
    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_converted_google_checkpoint_computes_what_googles_graph_computed() {
    let dir = tempfile::tempdir().unwrap();
    let summary = convert(dir.path());
    assert_eq!(summary.architecture, "BertForPreTraining");
    // 5 embedding tensors, 16 a layer, the pooler, 7 in the heads; each with two Adam slots,
    // and the global step.
    assert_eq!(summary.parameters, 5 + 2 * 16 + 2 + 7);
    assert_eq!(summary.skipped_training_state, 2 * summary.parameters + 1);
    assert!(summary.vocab_copied);
    let config = BertConfig::load(&dir.path().join("config.json")).unwrap();
    assert_eq!(
        config.hidden_act, "gelu_new",
        "Google's GELU is the tanh form"
    );

    let e: Expected =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
            .unwrap();
    let loaded = load_frozen::<BertForPreTraining>(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let (batch, seq) = (e.input_ids.len(), e.input_ids[0].len());
    let flat = |v: &Vec<Vec<u32>>| v.concat();
    let inputs = Inputs::from_host(
        &loaded.config,
        (batch, seq),
        &flat(&e.input_ids),
        Some(&flat(&e.segment_ids)),
        Some(&flat(&e.input_mask)),
        &Device::Cpu,
    )
    .unwrap();
    let out = loaded
        .model
        .bert
        .forward(&inputs, Mode::Eval, true)
        .unwrap();
    let mut report = Vec::new();
    for (layer, want) in e.all_encoder_layers.iter().enumerate() {
        // Compare real tokens only (padding holds whatever each side's mask leaves there).
        let got = &out.hidden_states[layer + 1];
        for (row, mask) in e.input_mask.iter().enumerate() {
            let n = mask.iter().filter(|&&m| m == 1).count();
            let got = got.get(row).unwrap().narrow(0, 0, n).unwrap();
            let w = worst(&got, &want[row][..n].concat());
            report.push(w);
            assert!(w <= 2e-5, "layer {layer} row {row}: {w:e}");
        }
    }
    let pooled = worst(
        out.pooler_output.as_ref().unwrap(),
        &e.pooled_output.concat(),
    );
    assert!(pooled <= 2e-5, "pooled {pooled:e}");
    let positions = MaskedPositions::from_host(
        (batch, e.masked_lm_positions[0].len()),
        &flat(&e.masked_lm_positions),
        seq,
        &Device::Cpu,
    )
    .unwrap();
    let heads = loaded
        .model
        .forward(&inputs, &positions, Mode::Eval)
        .unwrap();
    let mlm = worst(&heads.mlm_logits, &e.masked_lm_logits.concat());
    let nsp = worst(&heads.nsp_logits, &e.next_sentence_logits.concat());
    eprintln!(
        "against Google's graph: layers {:e}, pooled {pooled:e}, MLM {mlm:e}, NSP {nsp:e}",
        report.iter().fold(0f32, |a, &b| a.max(b))
    );
    assert!(mlm <= 2e-5 && nsp <= 2e-5, "MLM {mlm:e}, NSP {nsp:e}");

    // transformers' own converter keeps `gelu` (the exact form): that model drifts from
    // Google's outputs by far more than the tolerance.
    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        text.replace("\"gelu_new\"", "\"gelu\""),
    )
    .unwrap();
    let erf = load_frozen::<BertModel>(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let last = erf.model.forward(&inputs, Mode::Eval, false).unwrap();
    let n = e.input_mask[0].len();
    let drift = worst(
        &last
            .last_hidden_state
            .get(0)
            .unwrap()
            .narrow(0, 0, n)
            .unwrap(),
        &e.all_encoder_layers[1][0].concat(),
    );
    eprintln!("the exact GELU instead: {drift:e}");
    assert!(drift > 1e-4, "{drift:e}");
}

#[test]
fn the_way_back_gives_googles_tensors_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let back = dir.path().join("tf");
    convert(&model);
    let summary = convert_to_tf(&model, &back).unwrap();
    assert!(
        !summary.gelu_changes,
        "a gelu_new model keeps Google's GELU"
    );
    assert!(summary.vocab_copied);
    let original = Checkpoint::open(&fixture()).unwrap();
    let written = Checkpoint::open(&back).unwrap();
    let params: Vec<_> = original
        .entries()
        .iter()
        .filter(|e| matches!(from_google_name(&e.name), Some(GoogleName::Param { .. })))
        .collect();
    assert_eq!(written.entries().len(), params.len());
    assert_eq!(summary.variables, params.len());
    for entry in params {
        let mine = written
            .entry(&entry.name)
            .unwrap_or_else(|| panic!("{} not written", entry.name));
        assert_eq!(mine.shape, entry.shape, "{}", entry.name);
        assert_eq!(
            written.read_bytes(mine).unwrap(),
            original.read_bytes(entry).unwrap(),
            "{}",
            entry.name
        );
    }
    let config = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p.join("bert_config.json")).unwrap()).unwrap()
    };
    assert_eq!(config(&back), config(&fixture()));
    assert_eq!(
        std::fs::read(back.join("vocab.txt")).unwrap(),
        std::fs::read(fixture().join("vocab.txt")).unwrap()
    );
}

/// A tiny `M` saved, written as Google's checkpoint, converted back: the same architecture and
/// every tensor bit for bit.
fn round_trip<M: BertArchitecture>(config: &BertConfig) {
    let dir = tempfile::tempdir().unwrap();
    let loaded = init::<M>(config, DType::F32, &Device::Cpu, 7).unwrap();
    save(&loaded, &dir.path().join("a"), DType::F32).unwrap();
    let tf = convert_to_tf(&dir.path().join("a"), &dir.path().join("tf")).unwrap();
    assert!(tf.gelu_changes, "an erf model under Google's tanh GELU");
    let google_config = dir.path().join("tf/bert_config.json");
    let back = convert_from_tf(&tf.prefix, &google_config, None, &dir.path().join("b")).unwrap();
    assert_eq!(back.architecture, M::ARCHITECTURE);
    assert_eq!(back.skipped_training_state, 0);
    let a = candle_core::safetensors::load(dir.path().join("a/model.safetensors"), &Device::Cpu)
        .unwrap();
    let b = candle_core::safetensors::load(dir.path().join("b/model.safetensors"), &Device::Cpu)
        .unwrap();
    let mut names: Vec<_> = a.keys().collect();
    names.sort();
    let mut b_names: Vec<_> = b.keys().collect();
    b_names.sort();
    assert_eq!(names, b_names, "{}", M::ARCHITECTURE);
    for name in names {
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        assert_eq!(bits(&a[name]), bits(&b[name]), "{name}");
    }
}

#[test]
fn every_head_goes_to_google_and_back() {
    let mut config = BertConfig::tiny(40);
    round_trip::<BertModel>(&config);
    round_trip::<BertForPreTraining>(&config);
    round_trip::<BertForQuestionAnswering>(&config);
    config.id2label = Some(
        (0..3)
            .map(|i| (i.to_string(), format!("LABEL_{i}")))
            .collect(),
    );
    round_trip::<BertForSequenceClassification>(&config);
}

/// A copy of the fixture's checkpoint (config, index, data) in a temporary folder.
fn copy_fixture(dir: &Path) -> PathBuf {
    for f in [
        "bert_config.json",
        "bert_model.ckpt.index",
        "bert_model.ckpt.data-00000-of-00001",
    ] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    dir.join("bert_model.ckpt")
}

fn conversion_error(prefix: &Path, config: &Path) -> String {
    let out = prefix.parent().unwrap().join("out");
    let err = convert_from_tf(prefix, config, None, &out)
        .unwrap_err()
        .to_string();
    assert!(!out.join("model.safetensors").exists(), "{err}");
    err
}

/// `convert_to_tf` of a folder whose config.json disagrees with its tensors (a width, a layer
/// more than the file holds) is refused, naming the file, before anything is written.
#[test]
fn a_folder_whose_config_disagrees_with_its_tensors_is_not_converted() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("a");
    convert(&model);
    let config_path = model.join("config.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    let tf = dir.path().join("tf");
    for (key, says) in [
        ("intermediate_size", "disagrees with its tensors"),
        ("num_hidden_layers", "tensor(s) the file lacks"),
    ] {
        let mut changed = original.clone();
        changed[key] = serde_json::json!(original[key].as_u64().unwrap() + 1);
        std::fs::write(&config_path, changed.to_string()).unwrap();
        let err = convert_to_tf(&model, &tf).unwrap_err().to_string();
        assert!(
            err.contains("model.safetensors") && err.contains(says),
            "{key}: {err}"
        );
        assert!(!tf.exists(), "{key}: written");
    }
}

/// A conversion into a folder that holds another model's files (a tokenizer of another
/// vocabulary) is refused, naming them, and writes nothing there.
#[test]
fn a_conversion_into_another_models_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = copy_fixture(dir.path());
    let config = dir.path().join("bert_config.json");
    let out = dir.path().join("held");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("tokenizer.json"), "{}").unwrap();
    let err = convert_from_tf(&prefix, &config, None, &out)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("already holds a model's files (tokenizer.json)"),
        "{err}"
    );
    assert!(!out.join("model.safetensors").exists());
}

#[test]
fn bad_checkpoints_fail_naming_the_file_and_variable() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = copy_fixture(dir.path());
    let config = dir.path().join("bert_config.json");
    let data = dir.path().join("bert_model.ckpt.data-00000-of-00001");
    let index = dir.path().join("bert_model.ckpt.index");
    let ckpt = Checkpoint::open(&prefix).unwrap();

    // A flipped byte in a parameter's data.
    let pooler = ckpt.entry("bert/pooler/dense/kernel").unwrap();
    let bytes = std::fs::read(&data).unwrap();
    let original = ckpt.read_bytes(pooler).unwrap();
    let at = bytes
        .windows(original.len())
        .position(|w| w == original.as_slice())
        .unwrap();
    let mut damaged = bytes.clone();
    damaged[at + 5] ^= 0x10;
    std::fs::write(&data, &damaged).unwrap();
    let err = conversion_error(&prefix, &config);
    assert!(
        err.contains("bert/pooler/dense/kernel")
            && err.contains("CRC-32C")
            && err.contains(".data-00000-of-00001"),
        "{err}"
    );
    std::fs::write(&data, &bytes).unwrap();

    // A truncated data shard, and a missing one.
    std::fs::write(&data, &bytes[..bytes.len() / 2]).unwrap();
    let err = conversion_error(&prefix, &config);
    assert!(err.contains("truncated"), "{err}");
    std::fs::remove_file(&data).unwrap();
    let err = conversion_error(&prefix, &config);
    assert!(err.contains("data shard 0 of 1"), "{err}");
    std::fs::write(&data, &bytes).unwrap();

    // A truncated index.
    let index_bytes = std::fs::read(&index).unwrap();
    std::fs::write(&index, &index_bytes[..index_bytes.len() - 20]).unwrap();
    let err = conversion_error(&prefix, &config);
    assert!(err.contains("bert_model.ckpt.index"), "{err}");
    std::fs::write(&index, &index_bytes).unwrap();

    // A config whose width is not the checkpoint's.
    let mut google: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    google["intermediate_size"] = 48.into();
    let wide = dir.path().join("wide.json");
    std::fs::write(&wide, google.to_string()).unwrap();
    let err = conversion_error(&prefix, &wide);
    assert!(
        err.contains("intermediate.dense")
            && err.contains("[48, 32]")
            && err.contains("Google's bert/encoder/layer_0/intermediate/dense/kernel"),
        "{err}"
    );

    // A variable that is neither a parameter nor training state, and one missing.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let mut w = Writer::create(&other.join("m.ckpt")).unwrap();
    for e in ckpt.entries() {
        if e.name != "bert/pooler/dense/bias" {
            w.add(&e.name, e.dtype, &e.shape, &ckpt.read_bytes(e).unwrap())
                .unwrap();
        }
    }
    w.add_f32("bert/encoder/layer_0/adapter/weights", &[2], &[1.0, 2.0])
        .unwrap();
    let strange = w.finish().unwrap();
    let err = conversion_error(&strange, &config);
    assert!(
        err.contains("bert/encoder/layer_0/adapter/weights") && err.contains("neither"),
        "{err}"
    );
    let mut w = Writer::create(&other.join("n.ckpt")).unwrap();
    for e in ckpt.entries() {
        if e.name != "bert/pooler/dense/bias" {
            w.add(&e.name, e.dtype, &e.shape, &ckpt.read_bytes(e).unwrap())
                .unwrap();
        }
    }
    let lacking = w.finish().unwrap();
    let err = conversion_error(&lacking, &config);
    assert!(
        err.contains("lacks") && err.contains("bert/pooler/dense/bias"),
        "{err}"
    );
}
