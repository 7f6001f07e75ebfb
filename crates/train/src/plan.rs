//! How large a micro-batch fits: an account of a training step's peak memory, calibrated.
//!
//! A step's peak is the run's state (the weights, the embedding tables in f32, the f32 master
//! weights and both moments: 16 bytes a parameter in f32, about 14 in bf16/fp16) plus the larger
//! of two moments: the end of a micro-batch's backward pass (its activations, which candle
//! keeps for every tracked op, and the parameters' gradients) and the optimiser update (the f32
//! gradient accumulator, the flat bucket and the update's temporaries); on a GPU, also what
//! the CUDA runtime holds (context, cuBLAS workspace, loaded kernels).
//!
//! The activations depend on the kernels a device trains with ([`Target`]): the CPU's fused
//! kernels widen half precision to f32 around each op and keep what their backward passes
//! need; CUDA's fused kernels compute in the compute dtype and recompute the attention's
//! probabilities in the backward pass. Per sequence they are `layers · layer + s·h·γ +
//! predictions·vocab·δ` bytes, `layer` being `s·h·α + a·s²·β` on the CPU (fitted to `bertkit
//! bench memory`: the binary's allocator counting the bytes real steps hold) and on CUDA the
//! tensors its kernels keep, counted from their code and checked against the device's peaks
//! (BENCHMARKS.md). With activation checkpointing every `k` layers, a segment input per
//! segment plus one segment recomputed in full. [`plan`] keeps 10% of the memory back for the
//! allocator's fragmentation.

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

/// The device family a step runs on, whose kernels decide what a step keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The CPU's fused kernels (and any device without kernels of its own).
    Cpu,
    /// CUDA's fused kernels, plus the CUDA runtime's own memory.
    Cuda,
}

impl Target {
    /// The family of a device name as the configs spell it (`cpu`, `cuda`, `cuda:1`).
    pub fn of_device(name: &str) -> Self {
        if name.trim().to_ascii_lowercase().starts_with("cuda") {
            Target::Cuda
        } else {
            Target::Cpu
        }
    }
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
    /// Micro-batches a step: from the second on, each backward pass's gradients sit beside
    /// the f32 sums of the ones before.
    pub accumulation: usize,
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
    /// What the device's runtime holds whatever the model (on CUDA: the context, cuBLAS's
    /// workspace, the loaded kernels and the memory pool's slack; on the CPU the loader's
    /// batches and the allocator's pages).
    pub runtime_bytes: f64,
}

impl Prediction {
    /// Peak bytes.
    pub fn total(&self) -> f64 {
        self.state_bytes + self.activation_bytes + self.transient_bytes + self.runtime_bytes
    }
}

/// The CPU's fused kernels: bytes kept per sequence by one encoder layer, `s·h·HIDDEN +
/// a·s²·SCORES`, by compute dtype (f32, then bf16/fp16), fitted to `bertkit bench memory`
/// (BENCHMARKS.md; f32's 62.4 less the 16 bytes of the feed-forward's activation the fused
/// feed-forward stopped keeping, measured after). Half precision keeps more than f32 on the
/// CPU: it runs candle's ops around casts (the fused CPU kernels take f32).
const CPU_LAYER_HIDDEN: [f64; 2] = [46.4, 88.3];
const CPU_LAYER_SCORES: [f64; 2] = [1.05, 1.6];
/// The CPU: bytes per `s·h` kept outside the layers (embeddings, pooler, heads), by dtype (in
/// f32 the fit's figure is within noise of zero).
const CPU_EMBEDDING_HIDDEN: [f64; 2] = [0.0, 242.9];
/// Bytes per `predictions·vocab` the masked-LM head keeps (its logits, their log-softmax's
/// intermediates and gradients), on the CPU, by dtype.
const CPU_HEAD_LOGITS: [f64; 2] = [16.7, 8.46];
/// The CPU: what measured peaks hold beyond this account whatever the micro-batch (0.195 GB
/// at BERT-base's micro-batches of 16 and 32 in f32): the data loader's batches, the
/// optimiser's scratch row, the allocator's pages.
const CPU_RUNTIME_BYTES: f64 = 0.2e9;
/// CUDA: bytes per `s·h` outside the layers: the three f32 embedding rows, their two sums,
/// the LayerNorm, the cast to the compute dtype and dropout (the composed path; the fused
/// embeddings' end keeps its output alone, [`CudaKernels::fused_embeddings`]).
const CUDA_EMBEDDING_HIDDEN: f64 = 32.0;
/// CUDA: bytes per `predictions·vocab` of the masked-LM head (its logits in the compute dtype,
/// then candle's f32 log-softmax and loss: the composed ops of the CPU's first fit).
const CUDA_HEAD_LOGITS: f64 = 25.0;
/// CUDA: what the runtime holds besides the model's tensors (context, cuBLAS workspace, the
/// loaded kernels, the stream-ordered pool's slack): the H200's peaks (nvidia-smi) less the
/// rest of this account were 1.18 GiB at phase 1's shape and 1.20 GiB at phase 2's
/// (BENCHMARKS.md), the same whatever the activations.
const CUDA_RUNTIME_BYTES: f64 = 1.2 * (1u64 << 30) as f64;
/// CUDA's optimiser temporaries, in copies of its largest group (measured: 1.2–1.3), where
/// its update makes a new state a group (not in place).
const OPTIMIZER_TEMPORARIES: f64 = 1.3;

/// Bytes the optimiser's update holds beyond its state, the bucket and the gradients settling
/// into it, on `target`: on the CPU one parameter's update (the in-place update's room, the
/// largest parameter's: `crate::bucket`, each group updated in place); on CUDA in place only
/// a few partial sums a group (nothing the plan counts), otherwise copies of its largest group
/// (its update makes a new state a group).
fn optimizer_temporaries(c: &BertConfig, target: Target, kernels: CudaKernels) -> f64 {
    match target {
        Target::Cpu => {
            let (h, i) = (c.hidden_size, c.intermediate_size);
            4.0 * [
                c.vocab_size * h,
                i * h,
                h * h,
                c.max_position_embeddings * h,
            ]
            .into_iter()
            .max()
            .unwrap_or(0) as f64
        }
        Target::Cuda if kernels.update_in_place => 0.0,
        Target::Cuda => OPTIMIZER_TEMPORARIES * 4.0 * largest_group(c),
    }
}

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

/// What the CUDA kernels keep of a step, by the forms that change it: this build's with a
/// run's options ([`CudaKernels::of`]), and (the tests) those of the builds whose measured
/// peaks the account is compared with.
#[derive(Debug, Clone, Copy)]
struct CudaKernels {
    /// [`bertkit_model::kernels::KernelOptions::lean_feed_forward`].
    lean_feed_forward: bool,
    /// [`bertkit_model::kernels::KernelOptions::one_pass_attention`].
    one_pass_attention: bool,
    /// The loss in one kernel, each row's log-sum-exp kept (always, in this build).
    fused_loss: bool,
    /// The optimiser's update in place (always, in this build): the gradients settle into the
    /// flat bucket as on the CPU, and no new state is made.
    update_in_place: bool,
    /// The encoder's backward by hand ([`bertkit_model::kernels::set_cuda_tape`]).
    tape: bool,
    /// The embeddings' end in one op (always, in this build): it keeps its output alone (the
    /// composed path, every intermediate of its graph).
    fused_embeddings: bool,
    /// The one-pass attention's dropout keep bits handed from its forward to its backward: a
    /// bit a probability, in words of a pair of 64-place tiles. Always, where it drops (the
    /// peaks measured before it did, which the tests compare, had none).
    keep_bits: bool,
    /// The sublayer ends' dropout keep bits handed from their forward to their backward: a
    /// byte a 16-byte piece of a row. Always, where they drop (the peaks measured before they
    /// did, which the tests compare, had none).
    norm_keep_bits: bool,
}

impl CudaKernels {
    /// What this build's kernels keep with `options`.
    fn of(options: bertkit_model::kernels::KernelOptions) -> Self {
        CudaKernels {
            lean_feed_forward: options.lean_feed_forward,
            one_pass_attention: options.one_pass_attention,
            fused_loss: true,
            update_in_place: true,
            tape: true,
            fused_embeddings: true,
            keep_bits: true,
            norm_keep_bits: true,
        }
    }

    /// Whether `c`'s attention runs in one pass at `precision`: bf16 (the plan's half
    /// precision; fp16 runs candle's ops on CUDA) with heads of 64.
    fn one_pass(&self, c: &BertConfig, precision: Precision) -> bool {
        self.one_pass_attention
            && precision == Precision::Half
            && c.hidden_size == 64 * c.num_attention_heads
    }
}

/// What one micro-batch keeps for its backward pass on `target`: bytes per sequence by one
/// encoder layer, outside the layers, and (CUDA) bytes per step whatever the micro-batch.
struct Activations {
    layer: f64,
    outside: f64,
    per_step: f64,
}

fn activations(
    c: &BertConfig,
    shape: &Shape,
    b: f64,
    target: Target,
    kernels: CudaKernels,
) -> Activations {
    let half = usize::from(b == 2.0);
    let (s, h, a, i) = (
        shape.seq as f64,
        c.hidden_size as f64,
        c.num_attention_heads as f64,
        c.intermediate_size as f64,
    );
    let (p, v) = (shape.predictions as f64, c.vocab_size as f64);
    // Whatever the micro-batch, on both devices: the query/key/value weights concatenated per
    // layer, and in half precision the decoder's copy of the f32 word embeddings.
    let per_step = c.num_hidden_layers as f64 * 3.0 * (h * h + h) * b
        + if half == 1 { v * h * b } else { 0.0 };
    let feed_forward_kept = if kernels.lean_feed_forward { 1.0 } else { 2.0 };
    match target {
        Target::Cpu => Activations {
            layer: s * h * CPU_LAYER_HIDDEN[half] + a * s * s * CPU_LAYER_SCORES[half],
            outside: s * h * CPU_EMBEDDING_HIDDEN[half] + p * v * CPU_HEAD_LOGITS[half],
            per_step,
        },
        Target::Cuda => Activations {
            // Per token, in the compute dtype: the query/key/value product (3h; the attention
            // keeps only it and recomputes its probabilities in the backward pass), the
            // attention's context (h), its output projection (h) and LayerNorm (h), the
            // intermediate product and its GELU (2i; the product alone with the lean
            // feed-forward, which recomputes the GELU), the output projection (h) and
            // LayerNorm (h): `kernels/cuda/` keeps nothing else (dropout is recomputed from its
            // keys). Over the tape, 8h as listed (the H200's pool peaks at four shapes, 2026-11-27);
            // under autograd the composition's 7h matched the peaks of 2026-11-26.
            layer: s * (if kernels.tape { 8.0 } else { 7.0 } * h + feed_forward_kept * i) * b,
            // Our loss kernel keeps the logits as they are, and its backward writes their
            // gradient beside them: two values a logit in the compute dtype. Over the tape the
            // peak comes in the top layer's backward, every activation still held: its working
            // gradients beside them (the sublayer's end's two, the feed-forward's product's and
            // activation's, the attention's: about 2i + 3h a token).
            outside: s
                * h
                * if kernels.fused_embeddings {
                    b
                } else {
                    CUDA_EMBEDDING_HIDDEN
                }
                + p * v
                    * if kernels.fused_loss {
                        2.0 * b
                    } else {
                        CUDA_HEAD_LOGITS
                    }
                + if kernels.tape {
                    s * (2.0 * i + 3.0 * h) * b
                } else {
                    0.0
                },
            per_step,
        },
    }
}

/// Predicts the peak bytes of a training step of `c` on micro-batches of `shape` on `target`,
/// with activation checkpointing every `checkpointing` layers (0 = off), for the kernels this
/// process runs (on CUDA, whether the feed-forward is the lean one,
/// [`bertkit_model::kernels::set_lean_cuda_feed_forward`], and whether attention runs in one
/// pass, [`bertkit_model::kernels::set_cuda_flash_attention`]).
pub fn predict(
    c: &BertConfig,
    shape: &Shape,
    precision: Precision,
    checkpointing: usize,
    target: Target,
) -> Prediction {
    predict_with(
        c,
        shape,
        precision,
        checkpointing,
        target,
        CudaKernels::of(Default::default()),
    )
}

fn predict_with(
    c: &BertConfig,
    shape: &Shape,
    precision: Precision,
    checkpointing: usize,
    target: Target,
    kernels: CudaKernels,
) -> Prediction {
    if precision == Precision::F64 {
        let f32 = predict_with(c, shape, Precision::F32, checkpointing, target, kernels);
        return Prediction {
            state_bytes: 2.0 * f32.state_bytes,
            activation_bytes: 2.0 * f32.activation_bytes,
            transient_bytes: 2.0 * f32.transient_bytes,
            runtime_bytes: f32.runtime_bytes,
        };
    }
    let p = parameters(c) as f64;
    let tables = table_parameters(c) as f64;
    let b = precision.bytes();
    let state = 4.0 * tables + b * (p - tables) + 12.0 * p;
    let (s, h, a) = (
        shape.seq as f64,
        c.hidden_size as f64,
        c.num_attention_heads as f64,
    );
    let kept = activations(c, shape, b, target, kernels);
    let layers = c.num_hidden_layers as f64;
    let encoder = match checkpointing {
        0 => layers * kept.layer,
        every => {
            let segment = every.min(c.num_hidden_layers) as f64;
            // Each segment's input, and one segment recomputed in full during backward.
            (layers / segment).ceil() * s * h * b + segment * kept.layer
        }
    };
    // CUDA's attention backward around cuBLAS recomputes one layer's scores and probabilities
    // and holds their gradients beside them: four `[a, s, s]` tensors a sequence, one layer at
    // a time. In one pass it keeps each query's log-sum-exp instead (`a·s` f32 a layer), and
    // with its keep bits where it drops a bit a probability, rows padded to whole tiles.
    let keep_bits = if kernels.keep_bits && c.attention_probs_dropout_prob > 0.0 {
        let padded = (shape.seq.div_ceil(64) * 64) as f64;
        a * padded * padded / 8.0
    } else {
        0.0
    };
    // The sublayer ends' keep bits where they hand them over: two a layer, a byte a 16-byte
    // piece of a token's row.
    let norm_keep_bits =
        if target == Target::Cuda && kernels.norm_keep_bits && c.hidden_dropout_prob > 0.0 {
            layers * 2.0 * s * h * b / 16.0
        } else {
            0.0
        };
    let recomputed = match target {
        Target::Cuda if kernels.one_pass(c, precision) => layers * (a * s * 4.0 + keep_bits),
        Target::Cuda => 4.0 * a * s * s * b,
        Target::Cpu => 0.0,
    };
    let activations = shape.micro_batch as f64
        * (encoder + kept.outside + recomputed + norm_keep_bits)
        + kept.per_step;
    // At the end of backward: its parameter gradients as made (tables in f32, the rest in the
    // compute dtype; no f32 copies, `crate::bucket`) and, from a step's second micro-batch on,
    // the f32 sums of those before. At the update: the flat f32 bucket with a micro-batch's
    // gradients settling into it, then the update's temporaries (the CPU, and CUDA in place);
    // or, CUDA's update by name, the f32 sums by name beside the bucket and copies of a group.
    // On the CPU in half precision the fused kernels run in f32: the gradients pass through
    // f32 before their cast back (BERT-large bf16, micro-batch 16: 0.72 GiB over the account
    // without these 4 bytes a parameter; BENCHMARKS.md), as the sums do from the second
    // micro-batch on.
    let made = 4.0 * tables + b * (p - tables);
    let f32_beside =
        shape.accumulation > 1 || (target == Target::Cpu && precision == Precision::Half);
    let backward_grads = made + if f32_beside { 4.0 * p } else { 0.0 };
    let temporaries = optimizer_temporaries(c, target, kernels);
    let update = match target {
        Target::Cuda if !kernels.update_in_place => 8.0 * p + temporaries,
        _ => 4.0 * p + made.max(temporaries),
    };
    let (activation_bytes, transient_bytes) = if activations + backward_grads > update {
        (activations, backward_grads)
    } else {
        (0.0, update)
    };
    Prediction {
        state_bytes: state,
        activation_bytes,
        transient_bytes,
        runtime_bytes: match target {
            Target::Cuda => CUDA_RUNTIME_BYTES,
            Target::Cpu => CPU_RUNTIME_BYTES,
        },
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
/// predicted peak on `target` fits in [`USABLE`] of `memory` bytes, in steps of several
/// micro-batches (the recipes' global batches are many micro-batches; a step of one holds 4
/// bytes a parameter less).
pub fn plan(
    c: &BertConfig,
    seq: usize,
    predictions: usize,
    precision: Precision,
    checkpointing: usize,
    target: Target,
    memory: f64,
) -> Plan {
    let at = |micro_batch| {
        predict(
            c,
            &Shape {
                seq,
                predictions,
                micro_batch,
                accumulation: 2,
            },
            precision,
            checkpointing,
            target,
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

/// The feed-forward a CUDA run takes, as a setting (`[train] feed_forward`, fine-tuning's
/// `--feed-forward`): chosen by the memory plan, or the one named
/// ([`bertkit_model::kernels::KernelOptions::lean_feed_forward`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FeedForward {
    /// The full form where the memory plan says its peak fits, else the lean one.
    #[default]
    Auto,
    /// The first product kept alone, its GELU recomputed by the backward pass.
    Lean,
    /// The first product and its GELU both kept.
    Full,
}

impl FeedForward {
    /// The accepted values, as a setting names them.
    pub const VALUES: &str = "auto, lean or full";

    /// The setting `value` names (`auto`, `lean`, `full`); an error naming `setting` and the
    /// accepted values otherwise.
    pub fn parse(setting: &str, value: &str) -> Result<Self, TrainError> {
        match value {
            "auto" => Ok(FeedForward::Auto),
            "lean" => Ok(FeedForward::Lean),
            "full" => Ok(FeedForward::Full),
            other => Err(TrainError::Config(format!(
                "{setting} = {other:?}: {} expected",
                Self::VALUES
            ))),
        }
    }
}

impl std::fmt::Display for FeedForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FeedForward::Auto => "auto",
            FeedForward::Lean => "lean",
            FeedForward::Full => "full",
        })
    }
}

/// The feed-forward form a CUDA run takes, and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FeedForwardChoice {
    /// Whether the lean form runs (the GELU recomputed by the backward pass).
    pub lean: bool,
    /// The setting it was chosen by ([`FeedForward::Auto`]: the plan chose).
    pub setting: FeedForward,
    /// The full form's predicted peak.
    pub full_peak: f64,
    /// What a plan may fill: [`USABLE`] of the memory.
    pub usable: f64,
    /// The step's predicted peak with the form chosen.
    pub prediction: Prediction,
}

impl FeedForwardChoice {
    /// The fused kernels with the form chosen, for the run's model
    /// (`BertModel::set_kernels`).
    pub fn kernels(&self) -> bertkit_model::Fused {
        bertkit_model::Fused::with(bertkit_model::kernels::KernelOptions {
            lean_feed_forward: self.lean,
            ..Default::default()
        })
    }
}

/// `feed-forward: full, its activation kept (34.1 GiB predicted at the peak, within the 64.1
/// GiB usable; ...)`: the form and why, as a run's start-up prints it.
impl std::fmt::Display for FeedForwardChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        let form = if self.lean {
            "lean, its activation recomputed in the backward pass"
        } else {
            "full, its activation kept"
        };
        write!(f, "feed-forward: {form} (")?;
        match (self.setting, self.lean) {
            (FeedForward::Lean | FeedForward::Full, _) => {
                write!(f, "as feed_forward = {} chose", self.setting)?
            }
            (FeedForward::Auto, false) => write!(
                f,
                "{:.1} GiB predicted at the peak, within the {:.1} GiB usable; feed_forward = \
                 lean keeps less",
                gib(self.full_peak),
                gib(self.usable)
            )?,
            (FeedForward::Auto, true) => write!(
                f,
                "the full form's predicted {:.1} GiB would not fit the {:.1} GiB usable",
                gib(self.full_peak),
                gib(self.usable)
            )?,
        }
        write!(f, ")")
    }
}

/// Whether the model's weights hold device memory already when its feed-forward is chosen
/// ([`settle_feed_forward`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightsOnDevice {
    /// On the device (fine-tuning, the model loaded): counted beside the free bytes.
    Loaded,
    /// Not yet (`bertkit bench kernels`, which builds its own): still among the free bytes,
    /// not counted again.
    NotYet,
}

/// Before the optimiser's state is made (the model's weights on `device` or not yet, as
/// `weights` says): the CUDA feed-forward for micro-batches of `micro_batch` sequences of up
/// to `seq` tokens (`accumulation` a step) in `dtype`, chosen as `bertkit pretrain`'s memory
/// check chooses ([`feed_forward_for`] by `setting`, in the device's free memory plus what the
/// runtime and loaded weights already hold), for the caller to give the model
/// ([`FeedForwardChoice::kernels`]). `None` off CUDA: nothing to choose.
pub fn settle_feed_forward(
    c: &BertConfig,
    (seq, micro_batch, accumulation): (usize, usize, usize),
    (dtype, device): (candle_core::DType, &candle_core::Device),
    weights: WeightsOnDevice,
    setting: FeedForward,
) -> Option<FeedForwardChoice> {
    if !device.is_cuda() {
        return None;
    }
    let free = bertkit_model::free_memory(device)? as f64;
    let precision = match dtype {
        candle_core::DType::F32 => Precision::F32,
        candle_core::DType::F64 => Precision::F64,
        _ => Precision::Half,
    };
    let shape = Shape {
        seq,
        predictions: 0,
        micro_batch: micro_batch.max(1),
        accumulation: accumulation.max(1),
    };
    Some(feed_forward_before_state(
        c, &shape, precision, free, weights, setting,
    ))
}

/// [`feed_forward_for`] with `free` bytes left on the device before the optimiser's state is
/// made: the memory is the free bytes, the runtime's and, where they are on the device
/// already, the weights' (the f32 master weights and both moments, 12 bytes a parameter, are
/// still to come and are in the prediction, as the weights are).
fn feed_forward_before_state(
    c: &BertConfig,
    shape: &Shape,
    precision: Precision,
    free: f64,
    weights: WeightsOnDevice,
    setting: FeedForward,
) -> FeedForwardChoice {
    // Neither the state nor the runtime depends on the kernels' forms.
    let probe = predict(c, shape, precision, 0, Target::Cuda);
    let loaded = match weights {
        WeightsOnDevice::Loaded => probe.state_bytes - 12.0 * parameters(c) as f64,
        WeightsOnDevice::NotYet => 0.0,
    };
    let memory = free + loaded + probe.runtime_bytes;
    feed_forward_for(c, shape, precision, 0, memory, setting)
}

/// The feed-forward for a CUDA step of `shape` in `memory` bytes (the device's, state and
/// runtime included), with the step's peak predicted for it: the form `setting` names, or
/// ([`FeedForward::Auto`]) the full one (its activation kept: the faster pass) when its
/// predicted peak fits in [`USABLE`] of `memory`, the lean one (BERT-large: 1.4 GiB less a
/// micro-batch of 64 at seq 128) when it does not.
pub fn feed_forward_for(
    c: &BertConfig,
    shape: &Shape,
    precision: Precision,
    checkpointing: usize,
    memory: f64,
    setting: FeedForward,
) -> FeedForwardChoice {
    let with = |lean_feed_forward| {
        let kernels = CudaKernels::of(bertkit_model::kernels::KernelOptions {
            lean_feed_forward,
            ..Default::default()
        });
        predict_with(c, shape, precision, checkpointing, Target::Cuda, kernels)
    };
    let full_peak = with(false).total();
    let usable = USABLE * memory;
    let lean = match setting {
        FeedForward::Auto => full_peak > usable,
        FeedForward::Lean => true,
        FeedForward::Full => false,
    };
    FeedForwardChoice {
        lean,
        setting,
        full_peak,
        usable,
        prediction: with(lean),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fine-tuning's choice counts the weights (on the device already) and the runtime as
    /// memory beside the free bytes, and the state still to come as part of the peak: SQuAD on
    /// BERT-large in bf16 (32 windows of 384) keeps the activation with 70 GiB free, not where
    /// the memory would hold the full form's peak only without the 10% the plan keeps back.
    /// Before the model is loaded (`bench kernels`) the weights are among the free bytes.
    #[test]
    fn fine_tuning_counts_the_weights_as_held() {
        let c = BertConfig::large();
        let shape = Shape {
            seq: 384,
            predictions: 0,
            micro_batch: 32,
            accumulation: 1,
        };
        let gib = (1u64 << 30) as f64;
        let loaded = WeightsOnDevice::Loaded;
        let auto = FeedForward::Auto;
        let roomy =
            feed_forward_before_state(&c, &shape, Precision::Half, 70.0 * gib, loaded, auto);
        assert!(!roomy.lean, "{roomy:?}");
        // A setting that names the form takes it, whatever the memory.
        let named = FeedForward::Lean;
        let lean =
            feed_forward_before_state(&c, &shape, Precision::Half, 70.0 * gib, loaded, named);
        assert!(lean.lean && lean.setting == named, "{lean:?}");
        let p = parameters(&c) as f64;
        let weights = roomy.prediction.state_bytes - 12.0 * p;
        let memory = 70.0 * gib + weights + roomy.prediction.runtime_bytes;
        assert!((roomy.usable - USABLE * memory).abs() < 1.0);
        // Free bytes that hold the full form's peak but not with the 10% kept back.
        let tight = roomy.full_peak - weights - roomy.prediction.runtime_bytes;
        let lean = feed_forward_before_state(&c, &shape, Precision::Half, tight, loaded, auto);
        assert!(
            lean.lean && lean.prediction.total() < lean.full_peak,
            "{lean:?}"
        );
        // Before the model is loaded its weights are among the free bytes: the same free
        // bytes are less memory, and the tight free bytes plus the weights hold the full
        // form's peak there as the tight ones did with the weights loaded.
        let unloaded = WeightsOnDevice::NotYet;
        let before =
            feed_forward_before_state(&c, &shape, Precision::Half, 70.0 * gib, unloaded, auto);
        assert!(!before.lean && (before.usable - USABLE * (memory - weights)).abs() < 1.0);
        let before_tight =
            feed_forward_before_state(&c, &shape, Precision::Half, tight + weights, unloaded, auto);
        assert!(before_tight.lean, "{before_tight:?}");
    }

    /// The feed-forward's line says the form and why: the plan's figures, or the setting.
    #[test]
    fn the_feed_forward_line_says_why() {
        let gib = (1u64 << 30) as f64;
        let prediction = Prediction {
            state_bytes: 0.0,
            activation_bytes: 0.0,
            transient_bytes: 0.0,
            runtime_bytes: 0.0,
        };
        let mut choice = FeedForwardChoice {
            lean: false,
            setting: FeedForward::Auto,
            full_peak: 31.25 * gib,
            usable: 64.0 * gib,
            prediction,
        };
        assert_eq!(
            choice.to_string(),
            "feed-forward: full, its activation kept (31.2 GiB predicted at the peak, within the \
             64.0 GiB usable; feed_forward = lean keeps less)"
        );
        choice.lean = true;
        choice.usable = 28.8 * gib;
        assert_eq!(
            choice.to_string(),
            "feed-forward: lean, its activation recomputed in the backward pass (the full \
             form's predicted 31.2 GiB would not fit the 28.8 GiB usable)"
        );
        choice.setting = FeedForward::Lean;
        assert_eq!(
            choice.to_string(),
            "feed-forward: lean, its activation recomputed in the backward pass (as \
             feed_forward = lean chose)"
        );
        assert_eq!(
            FeedForward::parse("--feed-forward", "full").unwrap(),
            FeedForward::Full
        );
        let err = FeedForward::parse("--feed-forward", "half")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--feed-forward = \"half\": auto, lean or full"),
            "{err}"
        );
    }

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

    /// The CUDA account against the peaks measured on an H200 (BENCHMARKS.md; BERT-large, bf16):
    /// phase 1's shape and phase 2's, whose activations differ by half. The final build of
    /// 2026-11-26 (the fused kernels, nothing else; nvidia-smi's peaks, runtime included) at the
    /// micro-batches of 64 and 8, and the kernels on by default since 2026-11-27 (the device
    /// pool's high-water mark, runtime not included) at those and at the recipes' 256 and 64.
    #[test]
    fn the_cuda_account_matches_the_h200_peaks() {
        let c = BertConfig::large();
        let mib = 1024f64.powi(2);
        let before = CudaKernels {
            lean_feed_forward: false,
            one_pass_attention: false,
            fused_loss: false,
            update_in_place: false,
            tape: false,
            fused_embeddings: false,
            keep_bits: false,
            norm_keep_bits: false,
        };
        let now = CudaKernels {
            lean_feed_forward: true,
            one_pass_attention: true,
            fused_loss: true,
            update_in_place: true,
            tape: true,
            fused_embeddings: false,
            keep_bits: false,
            norm_keep_bits: false,
        };
        // (seq, predictions, micro-batch, micro-batches a step, kernels, pool only, measured).
        for (seq, predictions, micro_batch, accumulation, kernels, pool_only, measured_gib) in [
            // The build of 2026-11-26 held each gradient's f32 copy beside the backward pass's
            // (4 bytes a parameter, as a step of several micro-batches holds the sums so far
            // now).
            (128, 20, 64, 2, before, false, 15_023.0 / 1024.0),
            (512, 80, 8, 2, before, false, 11_695.0 / 1024.0),
            (128, 20, 64, 1, now, true, 10.039),
            (128, 20, 256, 1, now, true, 25.259),
            (128, 20, 64, 2, now, true, 11.246),
            (512, 80, 8, 1, now, true, 7.566),
            (512, 80, 64, 1, now, true, 25.485),
        ] {
            let shape = Shape {
                seq,
                predictions,
                micro_batch,
                accumulation,
            };
            let at = predict_with(&c, &shape, Precision::Half, 0, Target::Cuda, kernels);
            let counted = if pool_only { at.runtime_bytes } else { 0.0 };
            let predicted = (at.total() - counted) / (1024.0 * mib);
            let error = predicted / measured_gib - 1.0;
            // Within 2% under (the plan keeps 10% back), 5% over.
            assert!(
                (-0.02..0.05).contains(&error),
                "seq {seq} x {micro_batch}: {predicted:.3} GiB predicted against {measured_gib:.3}"
            );
        }
        // The CPU's kernels keep more in half precision (they widen to f32 around each op).
        let shape = Shape {
            seq: 128,
            predictions: 20,
            micro_batch: 64,
            accumulation: 1,
        };
        let cpu = predict(&c, &shape, Precision::Half, 0, Target::Cpu);
        let cuda = predict(&c, &shape, Precision::Half, 0, Target::Cuda);
        assert!(cpu.activation_bytes > 1.5 * cuda.activation_bytes);
        assert!(cpu.runtime_bytes < cuda.runtime_bytes);
        assert_eq!(Target::of_device("cuda:1"), Target::Cuda);
        assert_eq!(Target::of_device("cpu"), Target::Cpu);
    }

    /// Our loss kernel keeps two bf16 values a logit where candle's ops kept 25 bytes: at
    /// BERT-large's phase 1 (64 x 20 slots, 30,522 words) 0.76 GiB less.
    #[test]
    fn the_fused_loss_keeps_less_of_the_logits() {
        let c = BertConfig::large();
        let shape = Shape {
            seq: 128,
            predictions: 20,
            micro_batch: 64,
            accumulation: 1,
        };
        let peak = |fused_loss| {
            let kernels = CudaKernels {
                lean_feed_forward: false,
                one_pass_attention: false,
                fused_loss,
                update_in_place: false,
                tape: false,
                fused_embeddings: false,
                keep_bits: false,
                norm_keep_bits: false,
            };
            predict_with(&c, &shape, Precision::Half, 0, Target::Cuda, kernels).total()
        };
        let logits = 64.0 * 20.0 * 30522.0;
        let saved = peak(false) - peak(true);
        assert!((saved - logits * (25.0 - 4.0)).abs() < 1.0, "{saved}");
    }

    /// The one-pass attention keeps no `[a, s, s]` tensor: phase 2's micro-batch of 8 needs
    /// four of BERT-large's bf16 `[16, 512, 512]` less (each query's log-sum-exp instead), in
    /// bf16 with heads of 64 only.
    #[test]
    fn one_pass_attention_drops_the_recomputed_scores() {
        let c = BertConfig::large();
        let shape = Shape {
            seq: 512,
            predictions: 80,
            micro_batch: 8,
            accumulation: 1,
        };
        let kernels = |one_pass_attention| CudaKernels {
            lean_feed_forward: false,
            one_pass_attention,
            fused_loss: false,
            update_in_place: false,
            tape: false,
            fused_embeddings: false,
            keep_bits: false,
            norm_keep_bits: false,
        };
        let peak = |precision, one_pass, c: &BertConfig| {
            predict_with(c, &shape, precision, 0, Target::Cuda, kernels(one_pass)).total()
        };
        let (a, s) = (16.0, 512.0);
        let dropped = 8.0 * (4.0 * a * s * s * 2.0 - 24.0 * a * s * 4.0);
        let saved = peak(Precision::Half, false, &c) - peak(Precision::Half, true, &c);
        assert!((saved - dropped).abs() < 1.0, "{saved} against {dropped}");
        assert_eq!(
            peak(Precision::F32, false, &c),
            peak(Precision::F32, true, &c)
        );
        let heads_of_32 = BertConfig {
            num_attention_heads: 32,
            ..BertConfig::large()
        };
        assert_eq!(
            peak(Precision::Half, false, &heads_of_32),
            peak(Precision::Half, true, &heads_of_32)
        );
    }

    /// The one-pass attention's keep bits: a bit a probability of every layer, rows padded
    /// to whole 64-place tiles (phase 1's micro-batch of 64: 2 MiB a BERT-large layer; a
    /// 500-place row counts 512); none without the one-pass attention or without dropout.
    #[test]
    fn the_keep_bits_hold_a_bit_a_probability() {
        let large = BertConfig::large();
        let shape = |seq| Shape {
            seq,
            predictions: 20,
            micro_batch: 64,
            accumulation: 1,
        };
        let kernels = |one_pass_attention, keep_bits| CudaKernels {
            lean_feed_forward: true,
            one_pass_attention,
            fused_loss: true,
            update_in_place: true,
            tape: true,
            fused_embeddings: true,
            keep_bits,
            norm_keep_bits: false,
        };
        let held = |seq, one_pass, c: &BertConfig| {
            let peak = |bits| {
                predict_with(
                    c,
                    &shape(seq),
                    Precision::Half,
                    0,
                    Target::Cuda,
                    kernels(one_pass, bits),
                )
                .total()
            };
            peak(true) - peak(false)
        };
        let mib = 1024f64.powi(2);
        assert!((held(128, true, &large) - 24.0 * 2.0 * mib).abs() < 1.0);
        let want = 24.0 * 64.0 * 16.0 * 512.0 * 512.0 / 8.0;
        assert!((held(500, true, &large) - want).abs() < 1.0);
        assert_eq!(held(128, false, &large), 0.0);
        let no_dropout = BertConfig {
            attention_probs_dropout_prob: 0.0,
            ..BertConfig::large()
        };
        assert_eq!(held(128, true, &no_dropout), 0.0);
    }

    /// The sublayer ends' keep bits: a bit an element in bf16 (a byte a 16-byte piece), two a
    /// layer: at phase 1's micro-batch of 64, 2 MiB a BERT-large layer; none without dropout.
    #[test]
    fn the_sublayer_ends_keep_bits_hold_a_bit_an_element() {
        let shape = Shape {
            seq: 128,
            predictions: 20,
            micro_batch: 64,
            accumulation: 1,
        };
        let held = |c: &BertConfig| {
            let peak = |norm_keep_bits| {
                let kernels = CudaKernels {
                    lean_feed_forward: true,
                    one_pass_attention: true,
                    fused_loss: true,
                    update_in_place: true,
                    tape: true,
                    fused_embeddings: true,
                    keep_bits: true,
                    norm_keep_bits,
                };
                predict_with(c, &shape, Precision::Half, 0, Target::Cuda, kernels).total()
            };
            peak(true) - peak(false)
        };
        let mib = 1024f64.powi(2);
        assert!((held(&BertConfig::large()) - 24.0 * 2.0 * mib).abs() < 1.0);
        let no_dropout = BertConfig {
            hidden_dropout_prob: 0.0,
            ..BertConfig::large()
        };
        assert_eq!(held(&no_dropout), 0.0);
    }

    /// The fused embeddings' end keeps its output alone: 2 bytes a token's hidden value in
    /// bf16 where the composed path's graph kept 32 (three f32 rows, two sums, the norm, the
    /// cast, the dropout's mask and product), at phase 1's shape 30 · 64 · 128 · 1024 bytes.
    #[test]
    fn the_fused_embeddings_keep_their_output_alone() {
        let c = BertConfig::large();
        let shape = Shape {
            seq: 128,
            predictions: 20,
            micro_batch: 64,
            accumulation: 1,
        };
        let peak = |fused_embeddings| {
            let kernels = CudaKernels {
                lean_feed_forward: false,
                one_pass_attention: true,
                fused_loss: true,
                update_in_place: true,
                tape: true,
                fused_embeddings,
                keep_bits: false,
                norm_keep_bits: false,
            };
            predict_with(&c, &shape, Precision::Half, 0, Target::Cuda, kernels).total()
        };
        let saved = peak(false) - peak(true);
        let want = 30.0 * 64.0 * 128.0 * 1024.0;
        assert!((saved - want).abs() < 1.0, "{saved} against {want}");
    }

    /// Where the update is the peak (BERT-large, bf16, checkpointing every layer, one
    /// sequence), CUDA's update in place holds the bucket and the gradients settling into it
    /// (f32 tables, bf16 the rest), where its update by name held the f32 sums by name beside
    /// the bucket and 1.3 copies of the largest group. A step of several micro-batches holds
    /// the f32 sums beside each backward pass's gradients; one micro-batch a step does not.
    #[test]
    fn the_update_in_place_and_one_micro_batch_a_step_hold_less() {
        let c = BertConfig::large();
        let shape = |accumulation| Shape {
            seq: 128,
            predictions: 20,
            micro_batch: 1,
            accumulation,
        };
        let kernels = |update_in_place| CudaKernels {
            lean_feed_forward: false,
            one_pass_attention: false,
            fused_loss: false,
            update_in_place,
            tape: false,
            fused_embeddings: false,
            keep_bits: false,
            norm_keep_bits: false,
        };
        let at = |in_place, accumulation| {
            predict_with(
                &c,
                &shape(accumulation),
                Precision::Half,
                1,
                Target::Cuda,
                kernels(in_place),
            )
        };
        let (p, tables) = (parameters(&c) as f64, table_parameters(&c) as f64);
        let (by_name, in_place) = (at(false, 1), at(true, 1));
        assert_eq!(by_name.activation_bytes, 0.0, "{by_name:?}");
        assert_eq!(in_place.activation_bytes, 0.0, "{in_place:?}");
        let made = 4.0 * tables + 2.0 * (p - tables);
        let group = OPTIMIZER_TEMPORARIES * 4.0 * largest_group(&c);
        let saved = by_name.total() - in_place.total();
        assert!(
            (saved - (4.0 * p + group - made)).abs() < 1.0,
            "{saved}: {by_name:?} {in_place:?}"
        );
        // At micro-batch 64 the activations make the peak: the sums so far add 4 bytes a
        // parameter there.
        let big = |accumulation| Shape {
            micro_batch: 64,
            ..shape(accumulation)
        };
        let peak = |accumulation| {
            predict_with(
                &c,
                &big(accumulation),
                Precision::Half,
                0,
                Target::Cuda,
                kernels(true),
            )
        };
        assert!(peak(1).activation_bytes > 0.0);
        assert!((peak(2).total() - peak(1).total() - 4.0 * p).abs() < 1.0);
        assert_eq!(peak(2).total(), peak(8).total());
    }

    #[test]
    fn more_memory_checkpointing_and_shorter_sequences_fit_more() {
        let c = BertConfig::large();
        let gib = 1024f64.powi(3);
        let cuda = Target::Cuda;
        let p12 = plan(&c, 128, 20, Precision::Half, 0, cuda, 12.0 * gib);
        let p80 = plan(&c, 128, 20, Precision::Half, 0, cuda, 80.0 * gib);
        let ck = plan(&c, 128, 20, Precision::Half, 1, cuda, 12.0 * gib);
        let long = plan(&c, 512, 80, Precision::Half, 0, cuda, 80.0 * gib);
        assert!(p12.micro_batch > 0);
        assert!(p80.micro_batch > 5 * p12.micro_batch);
        assert!(ck.micro_batch > 2 * p12.micro_batch);
        // Four times the tokens: at most a quarter (the one-pass attention keeps no scores, so
        // no less than that).
        assert!(long.micro_batch <= p80.micro_batch / 4);
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
                accumulation: 2,
            },
            Precision::Half,
            0,
            cuda,
        );
        assert!(one_more.total() > USABLE * 80.0 * gib);
        // BERT-large's state in bf16: weights (tables f32), f32 master weights and moments.
        let state = p12.prediction.state_bytes / gib;
        assert!((state - 4.44).abs() < 0.02, "{state}");
        let none = plan(&c, 128, 20, Precision::F32, 0, cuda, 4.0 * gib);
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
