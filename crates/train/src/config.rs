//! The pre-training run config (TOML): model, data, optimiser, schedule and run settings.
//!
//! ```toml
//! output = "runs/phase1"              # run folder: metrics.jsonl, checkpoints/step-N/
//! [model]
//! preset = "large"                    # base | large | tiny, or config = "path/config.json"
//! init = ""                           # a model folder or an earlier run to start from
//! [data]
//! records = "out/data/records/phase1" # .parquet files or folders
//! micro_batch = 32                    # sequences per forward/backward
//! max_predictions = 20
//! pad_multiple = 8
//! seed = 12345
//! [optimizer]
//! rule = "lamb"                       # lamb | adamw; beta1, beta2, eps, weight_decay, max_grad_norm
//! [schedule]
//! lr = 6e-3
//! warmup = 0.2843
//! total_steps = 7038
//! decay = "poly"                      # poly | linear; power = 0.5
//! [train]
//! global_batch = 65536                # = micro_batch × accumulation × ranks
//! precision = "bf16"                  # f32 | bf16 | fp16
//! device = "cuda"                     # cpu | cuda | cuda:N
//! checkpoint_every = 200
//! keep_checkpoints = 3
//! seed = 42
//! activation_checkpointing = 1        # recompute every layer in backward (0 = off)
//! [eval]                              # optional: held-out evaluation
//! records = ["out/data/records/phase1-heldout"]
//! every = 500                         # steps (and at the last step)
//! sequences = 10000                   # the first this many held-out sequences, stored masks
//! ```

use std::path::{Path, PathBuf};

use bertkit_model::BertConfig;
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::optim::OptimizerConfig;
use crate::schedule::Schedule;

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// `base`, `large` or `tiny` (with the bert-base-uncased vocabulary size unless
    /// `vocab_size` is given).
    pub preset: Option<String>,
    /// A transformers config.json instead of a preset.
    pub config: Option<PathBuf>,
    /// Vocabulary size for a preset.
    pub vocab_size: Option<usize>,
    /// A model folder (config.json + model.safetensors) or an earlier run folder (its newest
    /// checkpoint) whose weights start this run; its schedule and optimiser state are not used.
    #[serde(default)]
    pub init: Option<PathBuf>,
    /// Dropout probabilities override (0 for exact-equality tests).
    pub dropout: Option<f64>,
}

/// `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Records files or folders.
    pub records: Vec<PathBuf>,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Masked-LM slots per sequence.
    pub max_predictions: usize,
    /// Pad lengths to a multiple of this.
    #[serde(default = "default_pad")]
    pub pad_multiple: usize,
    /// Shuffle seed.
    #[serde(default)]
    pub seed: u64,
    /// Re-mask at load time (`[data.dynamic_masking]`, with `prob` and `whole_word`, or empty
    /// for 15% single tokens) instead of the records' static masks. The special ids and words
    /// come from the vocabulary stored in the records.
    #[serde(default)]
    pub dynamic_masking: Option<crate::data::DynamicMasking>,
}

fn default_pad() -> usize {
    8
}

/// `[train]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Sequences per optimiser step over all ranks.
    pub global_batch: usize,
    /// `f32`, `bf16`, `fp16` (or `f64` for tests).
    #[serde(default = "default_precision")]
    pub precision: String,
    /// `cpu`, `cuda`, `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Save a checkpoint every this many steps (and at the end).
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: u64,
    /// Checkpoints kept (older ones are deleted).
    #[serde(default = "default_keep")]
    pub keep_checkpoints: usize,
    /// Seed of initialisation and dropout.
    #[serde(default)]
    pub seed: u64,
    /// fp16: stop after this many skipped (overflowing) steps in a row.
    #[serde(default = "default_max_skipped")]
    pub max_skipped_steps: u64,
    /// Peak dense TFLOP/s of the device, to report model FLOP utilisation.
    pub peak_tflops: Option<f64>,
    /// Activation checkpointing: keep only the input of every `k`-layer segment and recompute
    /// the segment in backward (0 = off, 1 = every layer).
    #[serde(default)]
    pub activation_checkpointing: usize,
    /// On CUDA, the feed-forward's form: `auto` (the memory plan's: the full form where it
    /// fits), `lean` (less memory, its GELU recomputed) or `full`.
    #[serde(default)]
    pub feed_forward: crate::plan::FeedForward,
}

fn default_precision() -> String {
    "f32".into()
}
fn default_device() -> String {
    "cpu".into()
}
fn default_checkpoint_every() -> u64 {
    1000
}
fn default_keep() -> usize {
    3
}
fn default_max_skipped() -> u64 {
    50
}

/// `[eval]`: held-out evaluation during pre-training. The same sequences each time (the
/// first `sequences` of the records in a fixed order) with the masks the records store, so
/// the figures of two evaluations differ only by what the model learnt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSection {
    /// Held-out records files or folders (the pipeline's `records/phase1-heldout/`).
    pub records: Vec<PathBuf>,
    /// Evaluate after every this many optimiser steps, and after the run's last step.
    #[serde(default = "default_eval_every")]
    pub every: u64,
    /// Sequences evaluated (whole batches of `micro_batch` per rank; fewer when the records
    /// hold fewer).
    #[serde(default = "default_eval_sequences")]
    pub sequences: usize,
    /// Sequences per forward pass (default: `[data] micro_batch`).
    pub micro_batch: Option<usize>,
}

impl EvalSection {
    /// Evaluation on `records` with the defaults.
    pub fn new(records: Vec<PathBuf>) -> Self {
        EvalSection {
            records,
            every: default_eval_every(),
            sequences: default_eval_sequences(),
            micro_batch: None,
        }
    }
}

fn default_eval_every() -> u64 {
    1000
}
fn default_eval_sequences() -> usize {
    10_000
}

/// Sets `section.key=value` in a config's table (see [`PretrainConfig::load_with`]).
fn apply_override(table: &mut toml::Table, setting: &str) -> Result<(), TrainError> {
    let bad = |why: &str| TrainError::Config(format!("--set {setting:?}: {why}"));
    let (key, value) = setting
        .split_once('=')
        .ok_or_else(|| bad("not KEY=VALUE (e.g. model.preset=tiny or schedule.lr=4e-3)"))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.iter().any(|part| part.is_empty()) || path.len() > 2 {
        return Err(bad("the key is a top-level key or section.key"));
    }
    let value = value.trim();
    let value = match toml::from_str::<toml::Table>(&format!("v = {value}")) {
        Ok(mut parsed) => parsed.remove("v").expect("the one key parsed"),
        Err(_) => toml::Value::String(value.to_string()),
    };
    let (last, sections) = path.split_last().expect("at least one part");
    let mut place = table;
    for section in sections {
        place = place
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| bad(&format!("{section} is a value, not a section")))?;
    }
    place.insert(last.to_string(), value);
    Ok(())
}

/// A whole pre-training config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PretrainConfig {
    /// Run folder.
    pub output: PathBuf,
    /// The model.
    pub model: ModelSection,
    /// The data.
    pub data: DataSection,
    /// The optimiser.
    pub optimizer: OptimizerConfig,
    /// The learning-rate schedule.
    pub schedule: Schedule,
    /// Run settings.
    pub train: TrainSection,
    /// Held-out evaluation (none without the section).
    #[serde(default)]
    pub eval: Option<EvalSection>,
}

impl PretrainConfig {
    /// Reads and checks a config file; relative paths in it are taken from the current folder.
    pub fn load(path: &Path) -> Result<Self, TrainError> {
        Self::load_with(path, &[])
    }

    /// [`PretrainConfig::load`] with `overrides` applied first, each `section.key=value` (or
    /// `key=value` for a top-level key such as `output`), the value in TOML's syntax (`4e-3`,
    /// `true`, `["a", "b"]`) or else a bare string (`model.preset=tiny`). A key the config does
    /// not know is an error naming it and the keys there are.
    pub fn load_with(path: &Path, overrides: &[String]) -> Result<Self, TrainError> {
        let text = bertkit_stage_io::read_text(path).map_err(crate::io_err(path))?;
        let in_file =
            |e: &dyn std::fmt::Display| TrainError::Config(format!("{}: {e}", path.display()));
        // Without overrides, straight from the text: its errors then give the line.
        let config: PretrainConfig = if overrides.is_empty() {
            toml::from_str(&text).map_err(|e| in_file(&e))?
        } else {
            let mut table: toml::Table = toml::from_str(&text).map_err(|e| in_file(&e))?;
            for setting in overrides {
                apply_override(&mut table, setting)?;
            }
            table
                .try_into()
                .map_err(|e| in_file(&format!("{e} (with --set {})", overrides.join(" --set "))))?
        };
        config.validate(1).map_err(|e| in_file(&e))?;
        Ok(config)
    }

    /// Checks values (for `world_size` ranks).
    pub fn validate(&self, world_size: usize) -> Result<(), TrainError> {
        self.optimizer.validate()?;
        self.schedule.validate()?;
        self.accumulation(world_size)?;
        if !matches!(
            self.train.precision.as_str(),
            "f32" | "bf16" | "fp16" | "f64"
        ) {
            return Err(TrainError::Config(format!(
                "[train] precision {:?}: expected f32, bf16 or fp16",
                self.train.precision
            )));
        }
        if self.train.checkpoint_every == 0 || self.train.keep_checkpoints == 0 {
            return Err(TrainError::Config(
                "[train] checkpoint_every and keep_checkpoints must be at least 1".into(),
            ));
        }
        if let Some(eval) = &self.eval
            && (eval.records.is_empty()
                || eval.every == 0
                || eval.sequences == 0
                || eval.micro_batch == Some(0))
        {
            return Err(TrainError::Config(
                "[eval] needs records, and every, sequences and micro_batch of at least 1".into(),
            ));
        }
        if self.data.max_predictions == 0 || self.data.records.is_empty() {
            return Err(TrainError::Config(
                "[data] needs records and max_predictions of at least 1".into(),
            ));
        }
        if let Some(p) = self.model.dropout
            && !(0.0..1.0).contains(&p)
        {
            return Err(TrainError::Config(format!(
                "[model] dropout {p} is not in [0, 1)"
            )));
        }
        self.bert_config()?;
        Ok(())
    }

    /// Micro-batches per optimiser step: `global_batch / (micro_batch × world_size)`, which must
    /// divide exactly.
    pub fn accumulation(&self, world_size: usize) -> Result<usize, TrainError> {
        let per_step = self.data.micro_batch * world_size;
        if self.data.micro_batch == 0 || self.train.global_batch == 0 {
            return Err(TrainError::Config(
                "[data] micro_batch and [train] global_batch must be at least 1".into(),
            ));
        }
        if !self.train.global_batch.is_multiple_of(per_step) {
            return Err(TrainError::Config(format!(
                "[train] global_batch {} is not a multiple of micro_batch {} × {world_size} rank(s)",
                self.train.global_batch, self.data.micro_batch
            )));
        }
        Ok(self.train.global_batch / per_step)
    }

    /// The model's config (from the preset or file, with the dropout override).
    pub fn bert_config(&self) -> Result<BertConfig, TrainError> {
        let mut config = match (&self.model.preset, &self.model.config) {
            (Some(p), None) => {
                let mut c = match p.as_str() {
                    "base" => BertConfig::base(),
                    "large" => BertConfig::large(),
                    "tiny" => {
                        let mut c = BertConfig::tiny(30522);
                        c.max_position_embeddings = 512;
                        c
                    }
                    other => {
                        return Err(TrainError::Config(format!(
                            "[model] preset {other:?}: expected base, large or tiny"
                        )));
                    }
                };
                if let Some(v) = self.model.vocab_size {
                    c.vocab_size = v;
                }
                c
            }
            (None, Some(path)) => BertConfig::load(path)?,
            _ => {
                return Err(TrainError::Config(
                    "[model] needs exactly one of preset and config".into(),
                ));
            }
        };
        if let Some(p) = self.model.dropout {
            config.hidden_dropout_prob = p;
            config.attention_probs_dropout_prob = p;
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_recipe() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../pipelines/tiny.toml")
    }

    #[test]
    fn set_overrides_a_key_of_a_section_or_the_top() {
        let sets = [
            "model.preset=base",
            "schedule.lr=4e-3",
            "model.init=runs/phase1",
            "output=elsewhere",
            "data.records=[\"a\", \"b\"]",
        ]
        .map(String::from);
        let config = PretrainConfig::load_with(&tiny_recipe(), &sets).unwrap();
        assert_eq!(config.model.preset.as_deref(), Some("base"));
        assert_eq!(config.schedule.lr, 4e-3);
        assert_eq!(config.model.init, Some(PathBuf::from("runs/phase1")));
        assert_eq!(config.output, PathBuf::from("elsewhere"));
        assert_eq!(
            config.data.records,
            [PathBuf::from("a"), PathBuf::from("b")]
        );
    }

    #[test]
    fn a_bad_set_names_the_setting() {
        let err = |set: &str| {
            PretrainConfig::load_with(&tiny_recipe(), &[set.to_string()])
                .unwrap_err()
                .to_string()
        };
        let unknown = err("model.presets=base");
        assert!(
            unknown.contains("presets") && unknown.contains("preset") && unknown.contains("--set"),
            "{unknown}"
        );
        assert!(err("model.preset").contains("not KEY=VALUE"));
        assert!(err("a.b.c=1").contains("section.key"));
        assert!(err("output.x=1").contains("output is a value"));
        let typed = err("schedule.lr=fast");
        assert!(
            typed.contains("lr") || typed.contains("invalid type"),
            "{typed}"
        );
    }
}
