//! The model's shape and hyper-parameters, in Hugging Face's `config.json` format.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// A BERT configuration (the fields of Hugging Face's `BertConfig` that define the network).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width of every hidden state.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer (`hidden_size` must be a multiple).
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Activation of the feed-forward layer and the masked-LM transform: `gelu` (exact, with
    /// the error function; transformers' BERT checkpoints) or `gelu_new` (the tanh
    /// approximation Google's `modeling.py` computes; also `gelu_pytorch_tanh`). See [`Gelu`].
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Dropout after embeddings, attention output and feed-forward output.
    #[serde(default = "default_dropout")]
    pub hidden_dropout_prob: f64,
    /// Dropout on attention probabilities.
    #[serde(default = "default_dropout")]
    pub attention_probs_dropout_prob: f64,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Segment types (2 for sentence pairs).
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// Standard deviation of the truncated-normal initialisation.
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// The padding token id.
    #[serde(default)]
    pub pad_token_id: usize,
    /// Only `absolute` position embeddings are supported.
    #[serde(default = "default_position_type")]
    pub position_embedding_type: String,
    /// Class names of a sequence-classification model (their count is the number of labels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id2label: Option<std::collections::BTreeMap<String, String>>,
}

pub use bertkit_kernels::Gelu;

fn default_act() -> String {
    "gelu".into()
}
fn default_dropout() -> f64 {
    0.1
}
fn default_type_vocab() -> usize {
    2
}
fn default_init_range() -> f64 {
    0.02
}
fn default_eps() -> f64 {
    1e-12
}
fn default_position_type() -> String {
    "absolute".into()
}

impl BertConfig {
    /// BERT-base (110 M parameters), uncased vocabulary.
    pub fn base() -> Self {
        Self::sized(768, 12, 12, 3072)
    }

    /// BERT-large (340 M parameters), uncased vocabulary.
    pub fn large() -> Self {
        Self::sized(1024, 24, 16, 4096)
    }

    /// `base`, `large`, or the transformers `config.json` at that path.
    pub fn named(name: &str) -> Result<Self, ModelError> {
        match name {
            "base" => Ok(Self::base()),
            "large" => Ok(Self::large()),
            path => Self::load(Path::new(path)),
        }
    }

    /// A tiny model for tests: 2 layers, width 32, a vocabulary of `vocab_size`.
    pub fn tiny(vocab_size: usize) -> Self {
        BertConfig {
            vocab_size,
            max_position_embeddings: 64,
            ..Self::sized(32, 2, 4, 64)
        }
    }

    fn sized(hidden: usize, layers: usize, heads: usize, intermediate: usize) -> Self {
        BertConfig {
            vocab_size: 30522,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: intermediate,
            hidden_act: default_act(),
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            initializer_range: 0.02,
            layer_norm_eps: 1e-12,
            pad_token_id: 0,
            position_embedding_type: default_position_type(),
            id2label: None,
        }
    }

    /// Number of classes of a sequence-classification head (2 unless `id2label` says).
    pub fn num_labels(&self) -> usize {
        self.id2label.as_ref().map_or(2, |m| m.len().max(1))
    }

    /// Reads and checks a `config.json`.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let text = bertkit_stage_io::read_text(path).map_err(|e| ModelError::Io {
            path: path.into(),
            source: e,
        })?;
        let config: BertConfig = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
        config
            .validate()
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
        Ok(config)
    }

    /// Checks that the numbers fit together.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if Gelu::from_hidden_act(&self.hidden_act).is_none() {
            return Err(format!(
                "hidden_act {:?}: only \"gelu\" (erf) and \"gelu_new\" (tanh) are supported",
                self.hidden_act
            ));
        }
        if self.position_embedding_type != "absolute" {
            return Err(format!(
                "position_embedding_type {:?}: only \"absolute\" is supported",
                self.position_embedding_type
            ));
        }
        for (name, p) in [
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                self.attention_probs_dropout_prob,
            ),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(format!("{name} {p} is not in [0, 1)"));
            }
        }
        if self.vocab_size == 0 || self.max_position_embeddings == 0 || self.type_vocab_size == 0 {
            return Err(
                "vocab_size, max_position_embeddings and type_vocab_size must be positive".into(),
            );
        }
        Ok(())
    }

    /// The GELU form `hidden_act` names ([`Gelu::Erf`] for a name [`BertConfig::validate`]
    /// would refuse).
    pub fn gelu(&self) -> Gelu {
        Gelu::from_hidden_act(&self.hidden_act).unwrap_or_default()
    }

    /// Width of one attention head.
    pub fn head_size(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The `config.json` Hugging Face expects for this model with `architecture`
    /// (`BertModel`, `BertForPreTraining`, …).
    pub fn to_hf_json(&self, architecture: &str, extra: &[(&str, serde_json::Value)]) -> String {
        let mut value = serde_json::to_value(self).expect("config serialises");
        let map = value.as_object_mut().expect("an object");
        map.insert("model_type".into(), "bert".into());
        map.insert("architectures".into(), serde_json::json!([architecture]));
        for (k, v) in extra {
            map.insert((*k).into(), v.clone());
        }
        serde_json::to_string_pretty(&value).expect("json") + "\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_checks() {
        assert_eq!(BertConfig::base().head_size(), 64);
        assert_eq!(BertConfig::large().num_hidden_layers, 24);
        let mut bad = BertConfig::tiny(100);
        bad.num_attention_heads = 5;
        assert!(bad.validate().unwrap_err().contains("multiple"));
        let mut bad = BertConfig::tiny(100);
        bad.hidden_act = "relu".into();
        assert!(bad.validate().unwrap_err().contains("gelu_new"));
        let mut tanh = BertConfig::tiny(100);
        tanh.hidden_act = "gelu_new".into();
        assert!(tanh.validate().is_ok());
        assert_eq!(tanh.gelu(), Gelu::Tanh);
        assert_eq!(BertConfig::tiny(100).gelu(), Gelu::Erf);
        assert_eq!(
            Gelu::from_hidden_act(Gelu::Tanh.hidden_act()),
            Some(Gelu::Tanh)
        );
        let json = BertConfig::tiny(100).to_hf_json("BertForPreTraining", &[]);
        let back: BertConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, BertConfig::tiny(100));
        assert!(json.contains("\"model_type\": \"bert\""));
    }
}
