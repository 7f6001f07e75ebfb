//! How large a micro-batch fits: an account of a training step's peak memory, calibrated.
//!
//! A step's peak is the run's state (the weights, the embedding tables in f32, the f32 master
//! weights and both moments: 16 bytes a parameter in f32, about 14 in bf16/fp16) plus the larger
//! of two moments: the end of a micro-batch's backward pass (its activations, which candle
//! keeps for every tracked op, and the parameters' gradients) and the optimiser update (the f32
//! gradient accumulator, the flat bucket and the update's temporaries). Activations per
//! sequence are `layers · (s·h·α + a·s²·β) + s·h·γ + predictions·vocab·δ` bytes; with activation
//! checkpointing every `k` layers, a segment input per segment plus one segment recomputed in
//! full. The coefficients were fitted to `bertkit bench memory` (the binary's allocator
//! counting the bytes real steps hold on the CPU: the same graph a GPU runs) and the
//! prediction checked against it for BERT-base and -large, sequences of 128 and 512, with and
//! without checkpointing, in f32, bf16 and fp16 (BENCHMARKS.md). [`plan`] keeps 10% of the
//! memory back for the allocator's fragmentation and the libraries' workspaces.

use bertkit_model::BertConfig;

use crate::TrainError;

/// Compute precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 everywhere.
    F32,
    /// bf16 or fp16 compute with f32 master weights.
    Half,
    /// f64 everywhere (tests): twice f32's bytes.
    F64,
}

impl Precision {
    /// From `f32`, `bf16` or `fp16`.
    pub fn parse(name: &str) -> Result<Self, TrainError> {
        match name {
            "f32" => Ok(Precision::F32),
            "bf16" | "fp16" | "f16" => Ok(Precision::Half),
            "f64" => Ok(Precision::F64),
            other => Err(TrainError::Config(format!(
                "precision {other:?}: expected f32, bf16 or fp16"
            ))),
        }
    }

    fn bytes(self) -> f64 {
        match self {
            Precision::F32 => 4.0,
            Precision::Half => 2.0,
            Precision::F64 => 8.0,
        }
    }
}

/// Parses `12GiB`, `16 GB`, `80000MiB`, `1.5TiB` or a plain number of bytes.
pub fn parse_bytes(text: &str) -> Result<f64, TrainError> {
    let t = text.trim().replace(' ', "");
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| TrainError::Config(format!("{text:?} is not a size like 12GiB")))?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0f64.powi(2),
        "gib" => 1024.0f64.powi(3),
        "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(TrainError::Config(format!(
                "{text:?}: unknown unit {other:?}"
            )));
        }
    };
    Ok(value * scale)
}

/// Parameters of a BERT with pre-training heads.
pub fn parameters(c: &BertConfig) -> usize {
    let h = c.hidden_size;
    let embeddings = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h;
    let layer = 4 * (h * h + h) + 2 * (h * c.intermediate_size) + c.intermediate_size + h + 4 * h;
    let heads = (h * h + h) + 2 * h + c.vocab_size + (h * h + h) + (2 * h + 2);
    embeddings + c.num_hidden_layers * layer + heads
}

/// Parameters in the embedding tables (word, position, token type), kept in f32.
pub fn table_parameters(c: &BertConfig) -> usize {
    (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * c.hidden_size
}

/// One micro-batch's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Padded sequence length.
    pub seq: usize,
    /// Masked-LM slots per sequence.
    pub predictions: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
}

/// Predicted peak bytes of a training step, in three parts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Held for the whole run: the weights (embedding tables in f32, the rest in the compute
    /// dtype), the f32 master weights and both f32 moments.
    pub state_bytes: f64,
    /// The activations a micro-batch's forward pass keeps for backward.
    pub activation_bytes: f64,
    /// What exists at the step's peak besides state and activations: the gradients
    /// (backward's, the f32 accumulator, the flat bucket) and the optimiser's temporaries.
    pub transient_bytes: f64,
}

impl Prediction {
    /// Peak bytes.
    pub fn total(&self) -> f64 {
        self.state_bytes + self.activation_bytes + self.transient_bytes
    }
}

/// Bytes kept per sequence by one encoder layer: `s·h·HIDDEN + a·s²·SCORES`, by compute dtype
/// (f32, then bf16/fp16), calibrated against `bertkit bench memory` (BENCHMARKS.md).
const LAYER_HIDDEN: [f64; 2] = [202.0, 126.0];
const LAYER_SCORES: [f64; 2] = [57.0, 42.0];
/// Bytes per `s·h` kept outside the layers (embeddings, pooler, heads), by compute dtype.
const EMBEDDING_HIDDEN: [f64; 2] = [158.0, 51.0];
/// Bytes per `predictions·vocab` the masked-LM head keeps (its f32 logits, their
/// log-softmax's intermediates and gradients).
const HEAD_LOGITS: f64 = 25.0;
/// The optimiser's temporaries, in copies of its largest group (measured: 1.2–1.3).
const OPTIMIZER_TEMPORARIES: f64 = 1.3;

/// Elements of the optimiser's largest group (see [`crate::optim`]: parameters of one shape,
/// at most [`crate::optim::GROUP_ELEMENTS`] elements a group unless one parameter is larger).
fn largest_group(c: &BertConfig) -> f64 {
    let (h, i, l) = (c.hidden_size, c.intermediate_size, c.num_hidden_layers);
    // Shapes by count: [h, h] (query, key, value, output per layer; pooler; head transform),
    // [i, h] and [h, i] (one each per layer), and the word embeddings.
    [
        (h * h, 4 * l + 2),
        (i * h, l),
        (h * i, l),
        (c.vocab_size * h, 1),
    ]
    .iter()
    .map(|&(numel, count)| {
        let per_group = (crate::optim::GROUP_ELEMENTS / numel).max(1);
        numel * count.min(per_group)
    })
    .max()
    .unwrap_or(0) as f64
}

/// Predicts the peak bytes of a training step of `c` on micro-batches of `shape`, with
/// activation checkpointing every `checkpointing` layers (0 = off).
pub fn predict(
    c: &BertConfig,
    shape: &Shape,
    precision: Precision,
    checkpointing: usize,
) -> Prediction {
    if precision == Precision::F64 {
        let f32 = predict(c, shape, Precision::F32, checkpointing);
        return Prediction {
            state_bytes: 2.0 * f32.state_bytes,
            activation_bytes: 2.0 * f32.activation_bytes,
            transient_bytes: 2.0 * f32.transient_bytes,
        };
    }
    let p = parameters(c) as f64;
    let tables = table_parameters(c) as f64;
    let b = precision.bytes();
    let k = usize::from(precision == Precision::Half);
    let state = 4.0 * tables + b * (p - tables) + 12.0 * p;
    let (s, h, a) = (
        shape.seq as f64,
        c.hidden_size as f64,
        c.num_attention_heads as f64,
    );
    let layer = s * h * LAYER_HIDDEN[k] + a * s * s * LAYER_SCORES[k];
    let layers = c.num_hidden_layers as f64;
    let encoder = match checkpointing {
        0 => layers * layer,
        every => {
            let segment = every.min(c.num_hidden_layers) as f64;
            // Each segment's input, and one segment recomputed in full during backward.
            (layers / segment).ceil() * s * h * b + segment * layer
        }
    };
    let embeddings = s * h * EMBEDDING_HIDDEN[k];
    let head = shape.predictions as f64 * c.vocab_size as f64 * HEAD_LOGITS;
    let activations = shape.micro_batch as f64 * (encoder + embeddings + head);
    // At the end of backward: backward's parameter gradients (tables in f32, the rest in the
    // compute dtype) and, in half precision, their f32 copies in the accumulator. At the
    // update: the accumulator and the flat bucket (f32 each) and the optimiser's temporaries.
    let backward_grads = 4.0 * tables + b * (p - tables) + if k == 1 { 4.0 * p } else { 0.0 };
    let update = 8.0 * p + OPTIMIZER_TEMPORARIES * 4.0 * largest_group(c);
    let (activation_bytes, transient_bytes) = if activations + backward_grads > update {
        (activations, backward_grads)
    } else {
        (0.0, update)
    };
    Prediction {
        state_bytes: state,
        activation_bytes,
        transient_bytes,
    }
}

/// The plan for one sequence length.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Largest micro-batch that fits (0: not even one sequence).
    pub micro_batch: usize,
    /// The predicted peak at that micro-batch (at one sequence when none fits).
    pub prediction: Prediction,
}

/// Share of the memory a plan fills; the rest is for fragmentation and workspaces.
pub const USABLE: f64 = 0.9;

/// The largest micro-batch of `seq`-long sequences with `predictions` masked slots whose
/// predicted peak fits in [`USABLE`] of `memory` bytes.
pub fn plan(
    c: &BertConfig,
    seq: usize,
    predictions: usize,
    precision: Precision,
    checkpointing: usize,
    memory: f64,
) -> Plan {
    let at = |micro_batch| {
        predict(
            c,
            &Shape {
                seq,
                predictions,
                micro_batch,
            },
            precision,
            checkpointing,
        )
    };
    let fits = |micro_batch| at(micro_batch).total() <= USABLE * memory;
    if !fits(1) {
        return Plan {
            micro_batch: 0,
            prediction: at(1),
        };
    }
    // The peak grows with the micro-batch: double, then bisect.
    let (mut low, mut high) = (1, 2);
    while fits(high) {
        low = high;
        high *= 2;
    }
    while high - low > 1 {
        let mid = (low + high) / 2;
        if fits(mid) {
            low = mid;
        } else {
            high = mid;
        }
    }
    Plan {
        micro_batch: low,
        prediction: at(low),
    }
}

impl Plan {
    /// The micro-batch to run and the accumulation steps for a recipe's `global_batch`: the
    /// largest power of two that fits (powers of two divide the recipes' global batches
    /// exactly), and the micro-batches per step. `None` when not even one sequence fits.
    pub fn recipe(&self, global_batch: usize) -> Option<(usize, usize)> {
        if self.micro_batch == 0 {
            return None;
        }
        let micro = 1usize << self.micro_batch.ilog2();
        Some((micro, global_batch.div_ceil(micro)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_known_parameter_counts() {
        assert_eq!(parse_bytes("12GiB").unwrap(), 12.0 * 1024f64.powi(3));
        assert_eq!(parse_bytes("80 GB").unwrap(), 80e9);
        assert!(parse_bytes("12 apples").is_err());
        // BERT-base with heads: 110 M in the paper (109.5 M encoder + pooler, plus heads).
        let base = parameters(&BertConfig::base()) as f64 / 1e6;
        assert!((base - 110.1).abs() < 0.5, "{base}");
        let large = parameters(&BertConfig::large()) as f64 / 1e6;
        assert!((large - 336.2).abs() < 1.0, "{large}");
    }

    #[test]
    fn more_memory_checkpointing_and_shorter_sequences_fit_more() {
        let c = BertConfig::large();
        let gib = 1024f64.powi(3);
        let p12 = plan(&c, 128, 20, Precision::Half, 0, 12.0 * gib);
        let p80 = plan(&c, 128, 20, Precision::Half, 0, 80.0 * gib);
        let ck = plan(&c, 128, 20, Precision::Half, 1, 12.0 * gib);
        let long = plan(&c, 512, 80, Precision::Half, 0, 80.0 * gib);
        assert!(p12.micro_batch > 0);
        assert!(p80.micro_batch > 5 * p12.micro_batch);
        assert!(ck.micro_batch > 2 * p12.micro_batch);
        assert!(long.micro_batch < p80.micro_batch / 4);
        // The largest micro-batch is the largest: one more does not fit.
        for p in [&p12, &p80, &ck, &long] {
            assert!(
                p.prediction.total()
                    <= USABLE * if p == &p12 || p == &ck { 12.0 } else { 80.0 } * gib
            );
        }
        let one_more = predict(
            &c,
            &Shape {
                seq: 128,
                predictions: 20,
                micro_batch: p80.micro_batch + 1,
            },
            Precision::Half,
            0,
        );
        assert!(one_more.total() > USABLE * 80.0 * gib);
        // BERT-large's state in bf16: weights (tables f32), f32 master weights and moments.
        let state = p12.prediction.state_bytes / gib;
        assert!((state - 4.44).abs() < 0.02, "{state}");
        let none = plan(&c, 128, 20, Precision::F32, 0, 4.0 * gib);
        assert_eq!(none.micro_batch, 0);
        assert_eq!(none.recipe(65536), None);
        let fits = Plan {
            micro_batch: 100,
            ..none
        };
        assert_eq!(fits.recipe(65536), Some((64, 1024)));
        assert_eq!(fits.recipe(100), Some((64, 2)));
    }
}
