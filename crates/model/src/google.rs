//! Google's TensorFlow checkpoints in and out: google-research/bert's variable names mapped onto
//! the model's, and whole checkpoints converted to and from transformers model folders.
//!
//! Google's names are the TF variable scopes of `modeling.py` and its training scripts:
//! `bert/encoder/layer_3/attention/self/query/kernel` (a `[in, out]` kernel, transposed to
//! PyTorch's `[out, in]`), LayerNorm `gamma`/`beta`, `bert/embeddings/word_embeddings` (no
//! suffix), the masked-LM head's `cls/predictions/output_bias`, the next-sentence
//! `cls/seq_relationship/output_weights` (already `[out, in]`), `run_squad.py`'s
//! `cls/squad/output_weights`/`output_bias` and `run_classifier.py`'s top-level
//! `output_weights`/`output_bias`. Training state (`global_step`, the `adam_m`/`adam_v` slots
//! of Google's optimizer, `Adam`/`Adam_1` slots and `beta1_power`/`beta2_power` of TF's own) is
//! skipped and counted; any other name is refused by name.
//!
//! Google's `modeling.py` computes GELU with the tanh approximation whatever its config's
//! `hidden_act: "gelu"` says, so a converted model says `gelu_new` (which bertkit and
//! transformers compute as Google did); written back, `gelu_new` becomes Google's `gelu`.
//!
//! Memory: a conversion holds the model's parameters once, in f32, plus one tensor in flight.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use bertkit_tf_checkpoint::{Checkpoint, Writer};
use candle_core::{DType, Device, Tensor};

use crate::bert::{
    BertArchitecture, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
    BertModel, Loaded,
};
use crate::config::Gelu;
use crate::params::{ParamBuilder, canonical_name};
use crate::{BertConfig, ModelError};

/// What a Google variable is to the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GoogleName {
    /// A parameter: the model's name for it, and whether its 2-D value is transposed.
    Param {
        /// The model's name ([`canonical_name`]'s form).
        name: String,
        /// Whether Google stores it `[in, out]` (a dense layer's kernel).
        transposed: bool,
    },
    /// Training state a model does not keep (step counter, optimizer slots).
    TrainingState,
}

/// The model's name for Google's variable `tf_name`, or `None` for a name this mapping does
/// not know.
pub fn from_google_name(tf_name: &str) -> Option<GoogleName> {
    const SLOTS: [&str; 4] = ["/adam_m", "/adam_v", "/Adam", "/Adam_1"];
    if matches!(tf_name, "global_step" | "beta1_power" | "beta2_power")
        || SLOTS.iter().any(|s| tf_name.ends_with(s))
    {
        return Some(GoogleName::TrainingState);
    }
    let param = |name: &str, transposed: bool| {
        Some(GoogleName::Param {
            name: name.to_string(),
            transposed,
        })
    };
    match tf_name {
        "cls/predictions/output_bias" => return param("cls.predictions.bias", false),
        "cls/seq_relationship/output_weights" => {
            return param("cls.seq_relationship.weight", false);
        }
        "cls/seq_relationship/output_bias" => return param("cls.seq_relationship.bias", false),
        "cls/squad/output_weights" => return param("qa_outputs.weight", false),
        "cls/squad/output_bias" => return param("qa_outputs.bias", false),
        "output_weights" => return param("classifier.weight", false),
        "output_bias" => return param("classifier.bias", false),
        _ => {}
    }
    let path = tf_name.strip_prefix("bert/").or_else(|| {
        tf_name
            .strip_prefix("cls/predictions/transform/")
            .map(|_| tf_name)
    })?;
    let (scope, last) = path.rsplit_once('/')?;
    let scope: Vec<String> = scope
        .split('/')
        .map(|part| match part.strip_prefix("layer_") {
            Some(i) if i.parse::<usize>().is_ok() => format!("layer.{i}"),
            _ => part.to_string(),
        })
        .collect();
    let scope = scope.join(".");
    let (leaf, transposed) = match last {
        "kernel" => ("weight", true),
        "bias" | "beta" => ("bias", false),
        "gamma" => ("weight", false),
        "word_embeddings" | "position_embeddings" | "token_type_embeddings" => {
            return param(&format!("{scope}.{last}.weight"), false);
        }
        _ => return None,
    };
    param(&format!("{scope}.{leaf}"), transposed)
}

/// Google's variable name for the model's parameter `name` ([`canonical_name`]'s form), and
/// whether its value is transposed on the way; `None` for a name Google's scripts have no
/// variable for.
pub fn to_google_name(name: &str) -> Option<(String, bool)> {
    let fixed = match name {
        "cls.predictions.bias" => Some("cls/predictions/output_bias"),
        "cls.seq_relationship.weight" => Some("cls/seq_relationship/output_weights"),
        "cls.seq_relationship.bias" => Some("cls/seq_relationship/output_bias"),
        "qa_outputs.weight" => Some("cls/squad/output_weights"),
        "qa_outputs.bias" => Some("cls/squad/output_bias"),
        "classifier.weight" => Some("output_weights"),
        "classifier.bias" => Some("output_bias"),
        _ => None,
    };
    if let Some(fixed) = fixed {
        return Some((fixed.to_string(), false));
    }
    let (scope, leaf) = name.rsplit_once('.')?;
    let under = if scope.starts_with("cls.predictions.transform") {
        String::new()
    } else {
        "bert/".to_string()
    };
    let mut parts: Vec<String> = Vec::new();
    let mut pieces = scope.split('.').peekable();
    while let Some(part) = pieces.next() {
        if part == "layer"
            && let Some(i) = pieces.peek().filter(|i| i.parse::<usize>().is_ok())
        {
            parts.push(format!("layer_{i}"));
            pieces.next();
        } else {
            parts.push(part.to_string());
        }
    }
    let scope = parts.join("/");
    let is_norm = scope.ends_with("LayerNorm");
    let (last, transposed) = match leaf {
        "weight" if scope.ends_with("_embeddings") => {
            return Some((format!("{under}{scope}"), false));
        }
        "weight" if is_norm => ("gamma", false),
        "bias" if is_norm => ("beta", false),
        "weight" => ("kernel", true),
        "bias" => ("bias", false),
        _ => return None,
    };
    Some((format!("{under}{scope}/{last}"), transposed))
}

/// What [`convert_from_tf`] made.
#[derive(Debug, Clone, PartialEq)]
pub struct FromTfSummary {
    /// The architecture written to `config.json` (from the heads the checkpoint holds).
    pub architecture: &'static str,
    /// Parameter tensors converted.
    pub parameters: usize,
    /// Scalar parameters converted.
    pub values: usize,
    /// Training-state tensors skipped (optimizer slots, step counters).
    pub skipped_training_state: usize,
    /// Whether a vocabulary was copied beside the model.
    pub vocab_copied: bool,
}

/// Converts the TensorFlow checkpoint `checkpoint` (a prefix, its `.index`, or its folder)
/// with Google's `bert_config.json` into a transformers model folder `out` (`config.json`,
/// `model.safetensors`, and `vocab.txt` when `vocab` is given), f32. The heads present decide
/// the architecture: `cls/squad` a question-answering model, top-level `output_weights` a
/// sequence classifier, `cls/predictions`/`cls/seq_relationship` the pre-training heads, none
/// the bare encoder. Every parameter of that architecture must be in the checkpoint and every
/// tensor in it must be a parameter or training state.
pub fn convert_from_tf(
    checkpoint: &Path,
    config: &Path,
    vocab: Option<&Path>,
    out: &Path,
) -> Result<FromTfSummary, ModelError> {
    refuse_another_model(out)?;
    let ckpt = Checkpoint::open(checkpoint)?;
    let mut config = BertConfig::load(config)?;
    if config.hidden_act == "gelu" {
        // modeling.py's `gelu` is the tanh approximation.
        config.hidden_act = Gelu::Tanh.hidden_act().to_string();
    }
    let mut tensors = HashMap::new();
    let mut google_names = BTreeMap::new();
    let mut skipped = 0;
    let mut unknown = Vec::new();
    for entry in ckpt.entries() {
        match from_google_name(&entry.name) {
            None => unknown.push(entry.name.clone()),
            Some(GoogleName::TrainingState) => skipped += 1,
            Some(GoogleName::Param { name, transposed }) => {
                let values = ckpt.read_f32(entry)?;
                let mut t = Tensor::from_vec(values, entry.shape.as_slice(), &Device::Cpu)?;
                if transposed {
                    if entry.shape.len() != 2 {
                        return Err(ModelError::Weights(format!(
                            "{}: {}: a kernel of shape {:?} (2 dimensions expected)",
                            ckpt.prefix().display(),
                            entry.name,
                            entry.shape
                        )));
                    }
                    t = t.t()?.contiguous()?;
                }
                google_names.insert(name.clone(), entry.name.clone());
                tensors.insert(name, t);
            }
        }
    }
    if !unknown.is_empty() {
        return Err(ModelError::Weights(format!(
            "{}: {} variable(s) that are neither BERT parameters nor training state: {}",
            ckpt.prefix().display(),
            unknown.len(),
            listed(&unknown)
        )));
    }
    if let Some(classifier) = tensors.get("classifier.weight") {
        let labels = classifier.dim(0)?;
        config.id2label = Some(
            (0..labels)
                .map(|i| (i.to_string(), format!("LABEL_{i}")))
                .collect(),
        );
    }
    let parameters = tensors.len();
    let values = tensors.values().map(|t| t.elem_count()).sum();
    let source = ckpt.prefix().to_path_buf();
    let architecture = match Heads::of(&tensors) {
        Heads::QuestionAnswering => {
            write_model::<BertForQuestionAnswering>(tensors, &config, &google_names, &source, out)?
        }
        Heads::Classification => write_model::<BertForSequenceClassification>(
            tensors,
            &config,
            &google_names,
            &source,
            out,
        )?,
        Heads::PreTraining => {
            write_model::<BertForPreTraining>(tensors, &config, &google_names, &source, out)?
        }
        Heads::Encoder => write_model::<BertModel>(tensors, &config, &google_names, &source, out)?,
    };
    let vocab_copied = match vocab {
        Some(vocab) => {
            copy_atomically(vocab, &out.join("vocab.txt"))?;
            true
        }
        None => false,
    };
    Ok(FromTfSummary {
        architecture,
        parameters,
        values,
        skipped_training_state: skipped,
        vocab_copied,
    })
}

/// The files of a model folder (transformers' and ours): a conversion into a folder holding
/// any would leave another model's files (a tokenizer of another vocabulary) beside its own.
const MODEL_FOLDER_FILES: [&str; 8] = [
    "config.json",
    "model.safetensors",
    "pytorch_model.bin",
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
];

/// Refuses an output folder `out` that already holds a model's files, naming them.
fn refuse_another_model(out: &Path) -> Result<(), ModelError> {
    let held: Vec<&str> = MODEL_FOLDER_FILES
        .into_iter()
        .filter(|f| out.join(f).exists())
        .collect();
    if held.is_empty() {
        return Ok(());
    }
    Err(ModelError::Config(format!(
        "{}: already holds a model's files ({}): convert into a new or empty folder, so that \
         no file of another model stays beside this one",
        out.display(),
        held.join(", ")
    )))
}

/// Which architecture a set of tensors (by our names) is, by the heads they hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heads {
    QuestionAnswering,
    Classification,
    PreTraining,
    Encoder,
}

impl Heads {
    fn of(tensors: &HashMap<String, Tensor>) -> Self {
        let has = |prefix: &str| tensors.keys().any(|k| k.starts_with(prefix));
        if has("qa_outputs.") {
            Heads::QuestionAnswering
        } else if has("classifier.") {
            Heads::Classification
        } else if has("cls.") {
            Heads::PreTraining
        } else {
            Heads::Encoder
        }
    }
}

/// What building a model from a file's tensors found unlike the config.
enum Mismatch {
    /// A parameter of another shape than the config's (the builder's error).
    Shape(ModelError),
    /// Parameters the config needs and the tensors lack.
    Missing(Vec<String>),
    /// Tensors the config's model has no place for.
    Unused(Vec<String>),
}

/// `tensors` (by our names, f32 on the CPU) built into `M` as `config` describes it: every
/// parameter's shape, none missing, none left over; the callers name what is wrong.
fn build_exactly<M: BertArchitecture>(
    tensors: HashMap<String, Tensor>,
    config: &BertConfig,
) -> Result<Loaded<M>, Mismatch> {
    let mut p = ParamBuilder::from_tensors(
        tensors,
        DType::F32,
        &Device::Cpu,
        config.initializer_range,
        0,
    )
    .frozen();
    let model = M::build(config, &mut p).map_err(Mismatch::Shape)?;
    let params = p.finish();
    if !params.initialised.is_empty() {
        return Err(Mismatch::Missing(params.initialised));
    }
    if !params.unused.is_empty() {
        return Err(Mismatch::Unused(params.unused));
    }
    Ok(Loaded {
        model,
        params,
        config: config.clone(),
    })
}

/// Checks that `tensors` (by our names) build `M` as `config` describes it: every parameter's
/// shape, none missing; an error naming `source` otherwise.
fn check_tensors<M: BertArchitecture>(
    tensors: HashMap<String, Tensor>,
    config: &BertConfig,
    source: &Path,
) -> Result<(), ModelError> {
    match build_exactly::<M>(tensors, config) {
        Ok(_) | Err(Mismatch::Unused(_)) => Ok(()),
        Err(Mismatch::Shape(e)) => Err(ModelError::Weights(format!(
            "{}: {e} (the folder's config.json disagrees with its tensors)",
            source.display()
        ))),
        Err(Mismatch::Missing(names)) => Err(ModelError::Weights(format!(
            "{}: a {} as config.json describes it needs {} tensor(s) the file lacks: {}",
            source.display(),
            M::ARCHITECTURE,
            names.len(),
            listed(&names)
        ))),
    }
}

/// Builds `M` from `tensors` (refusing a missing or unused one, named as Google names it) and
/// saves it to `out`.
fn write_model<M: BertArchitecture>(
    tensors: HashMap<String, Tensor>,
    config: &BertConfig,
    google_names: &BTreeMap<String, String>,
    source: &Path,
    out: &Path,
) -> Result<&'static str, ModelError> {
    let google = |names: &[String]| -> Vec<String> {
        names
            .iter()
            .map(|n| {
                google_names
                    .get(n)
                    .cloned()
                    .or_else(|| to_google_name(n).map(|(g, _)| g))
                    .unwrap_or_else(|| n.clone())
            })
            .collect()
    };
    let (names, what) = match build_exactly::<M>(tensors, config) {
        Ok(loaded) => {
            crate::bert::save(&loaded, out, DType::F32)?;
            return Ok(M::ARCHITECTURE);
        }
        Err(Mismatch::Shape(e)) => {
            // A shape unlike the config names the model's parameter: say Google's name too.
            let google = match &e {
                ModelError::Weights(m) => m
                    .split_once(':')
                    .and_then(|(name, _)| google_names.get(name))
                    .map(|g| format!(" (Google's {g})"))
                    .unwrap_or_default(),
                _ => String::new(),
            };
            return Err(ModelError::Weights(format!(
                "{}: {e}{google}",
                source.display()
            )));
        }
        Err(Mismatch::Missing(names)) => (names, "needs {} variable(s) the checkpoint lacks"),
        Err(Mismatch::Unused(names)) => (names, "has no place for {} variable(s)"),
    };
    Err(ModelError::Weights(format!(
        "{}: a {} {}: {}",
        source.display(),
        M::ARCHITECTURE,
        what.replace("{}", &names.len().to_string()),
        listed(&google(&names))
    )))
}

/// What [`convert_to_tf`] made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToTfSummary {
    /// The checkpoint's prefix (`<out>/bert_model.ckpt`).
    pub prefix: PathBuf,
    /// Variables written.
    pub variables: usize,
    /// Bytes of the data file.
    pub bytes: u64,
    /// The model computed the exact GELU, which Google's `modeling.py` does not have: its
    /// outputs under Google's code differ slightly (~1e-3 at most per activation).
    pub gelu_changes: bool,
    /// Whether the model folder's `vocab.txt` was copied.
    pub vocab_copied: bool,
}

/// Writes the transformers model folder `model` (`config.json`, `model.safetensors`) as a
/// TensorFlow checkpoint that google-research/bert's scripts load: `<out>/bert_model.ckpt.*`,
/// Google's `bert_config.json`, a `checkpoint` file naming it, and `vocab.txt` if the folder
/// has one. Values are written in f32.
pub fn convert_to_tf(model: &Path, out: &Path) -> Result<ToTfSummary, ModelError> {
    let (config_path, weights) = crate::bert::model_files(model);
    let config = BertConfig::load(&config_path)?;
    if !weights.is_file() {
        return Err(ModelError::Weights(format!(
            "{}: not found (a model directory holds config.json and model.safetensors)",
            weights.display()
        )));
    }
    let raw = candle_core::safetensors::load(&weights, &Device::Cpu)
        .map_err(|e| ModelError::Weights(format!("{}: {e}", weights.display())))?;
    let mut named = BTreeMap::new();
    let mut canonical_tensors = HashMap::new();
    for (name, tensor) in raw {
        let Some(canonical) = canonical_name(&name) else {
            continue;
        };
        canonical_tensors.insert(canonical.clone(), tensor.clone());
        let Some((google, transposed)) = to_google_name(&canonical) else {
            return Err(ModelError::Weights(format!(
                "{}: {name}: Google's BERT has no variable for it",
                weights.display()
            )));
        };
        if named.insert(google.clone(), (tensor, transposed)).is_some() {
            return Err(ModelError::Weights(format!(
                "{}: two tensors map to {google} (with and without the bert. prefix?)",
                weights.display()
            )));
        }
    }
    // The tensors are the model its config.json describes (shapes, and nothing missing: the
    // pooler, say), before anything is written: Google's reader would refuse it.
    let (tensors, source) = (canonical_tensors, weights.as_path());
    match Heads::of(&tensors) {
        Heads::QuestionAnswering => {
            check_tensors::<BertForQuestionAnswering>(tensors, &config, source)?
        }
        Heads::Classification => {
            check_tensors::<BertForSequenceClassification>(tensors, &config, source)?
        }
        Heads::PreTraining => check_tensors::<BertForPreTraining>(tensors, &config, source)?,
        Heads::Encoder => check_tensors::<BertModel>(tensors, &config, source)?,
    }
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let prefix = out.join("bert_model.ckpt");
    let mut writer = Writer::create(&prefix)?;
    let mut bytes = 0u64;
    for (google, (tensor, transposed)) in &named {
        let mut t = tensor.to_dtype(DType::F32)?;
        if *transposed {
            t = t.t()?.contiguous()?;
        }
        let values = t.flatten_all()?.to_vec1::<f32>()?;
        writer.add_f32(google, t.dims(), &values)?;
        bytes += 4 * values.len() as u64;
    }
    writer.finish()?;
    let google_config = serde_json::json!({
        "attention_probs_dropout_prob": config.attention_probs_dropout_prob,
        "hidden_act": "gelu",
        "hidden_dropout_prob": config.hidden_dropout_prob,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "type_vocab_size": config.type_vocab_size,
        "vocab_size": config.vocab_size,
    });
    let text = serde_json::to_string_pretty(&google_config).expect("json") + "\n";
    write_file(&out.join("bert_config.json"), text.as_bytes())?;
    write_file(
        &out.join("checkpoint"),
        b"model_checkpoint_path: \"bert_model.ckpt\"\nall_model_checkpoint_paths: \"bert_model.ckpt\"\n",
    )?;
    let vocab = model.join("vocab.txt");
    let vocab_copied = vocab.is_file();
    if vocab_copied {
        copy_atomically(&vocab, &out.join("vocab.txt"))?;
    }
    Ok(ToTfSummary {
        prefix,
        variables: named.len(),
        bytes,
        gelu_changes: config.gelu() == Gelu::Erf,
        vocab_copied,
    })
}

fn io(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.into(),
        source,
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    bertkit_stage_io::write_atomically(path, bytes).map_err(|e| io(path, e))
}

fn copy_atomically(from: &Path, to: &Path) -> Result<(), ModelError> {
    let bytes = std::fs::read(from).map_err(|e| io(from, e))?;
    write_file(to, &bytes)
}

/// Up to ten names, then how many more.
fn listed(names: &[String]) -> String {
    let mut text = names
        .iter()
        .take(10)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 10 {
        text += &format!(" and {} more", names.len() - 10);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_name_maps_there_and_back() {
        let mut config = BertConfig::tiny(50);
        config.id2label = Some(
            [
                ("0".into(), "a".into()),
                ("1".into(), "b".into()),
                ("2".into(), "c".into()),
            ]
            .into(),
        );
        let mut names: Vec<String> = Vec::new();
        names.extend(
            crate::bert::init::<BertForPreTraining>(&config, DType::F32, &Device::Cpu, 1)
                .unwrap()
                .params
                .vars()
                .keys()
                .cloned(),
        );
        names.extend(
            crate::bert::init::<BertForQuestionAnswering>(&config, DType::F32, &Device::Cpu, 1)
                .unwrap()
                .params
                .vars()
                .keys()
                .cloned(),
        );
        names.extend(
            crate::bert::init::<BertForSequenceClassification>(
                &config,
                DType::F32,
                &Device::Cpu,
                1,
            )
            .unwrap()
            .params
            .vars()
            .keys()
            .cloned(),
        );
        names.sort();
        names.dedup();
        assert!(names.len() > 40);
        for name in &names {
            let (google, transposed) = to_google_name(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(
                from_google_name(&google),
                Some(GoogleName::Param {
                    name: name.clone(),
                    transposed
                }),
                "{name} -> {google}"
            );
        }
        for (google, model, transposed) in [
            (
                "bert/embeddings/word_embeddings",
                "embeddings.word_embeddings.weight",
                false,
            ),
            (
                "bert/embeddings/LayerNorm/gamma",
                "embeddings.LayerNorm.weight",
                false,
            ),
            (
                "bert/encoder/layer_11/attention/self/query/kernel",
                "encoder.layer.11.attention.self.query.weight",
                true,
            ),
            (
                "bert/encoder/layer_0/output/LayerNorm/beta",
                "encoder.layer.0.output.LayerNorm.bias",
                false,
            ),
            ("bert/pooler/dense/kernel", "pooler.dense.weight", true),
            (
                "cls/predictions/transform/dense/kernel",
                "cls.predictions.transform.dense.weight",
                true,
            ),
            (
                "cls/predictions/transform/LayerNorm/gamma",
                "cls.predictions.transform.LayerNorm.weight",
                false,
            ),
            (
                "cls/seq_relationship/output_weights",
                "cls.seq_relationship.weight",
                false,
            ),
            ("cls/squad/output_bias", "qa_outputs.bias", false),
            ("output_weights", "classifier.weight", false),
        ] {
            assert_eq!(
                from_google_name(google),
                Some(GoogleName::Param {
                    name: model.into(),
                    transposed
                }),
                "{google}"
            );
        }
        for state in [
            "global_step",
            "bert/pooler/dense/kernel/adam_m",
            "cls/squad/output_bias/adam_v",
            "bert/embeddings/word_embeddings/Adam_1",
            "beta1_power",
        ] {
            assert_eq!(
                from_google_name(state),
                Some(GoogleName::TrainingState),
                "{state}"
            );
        }
        for unknown in [
            "bert/encoder/layer_0/attention/self/query/weights",
            "foo",
            "cls/other/output_weights",
            "loss_scale",
        ] {
            assert_eq!(from_google_name(unknown), None, "{unknown}");
        }
    }
}
