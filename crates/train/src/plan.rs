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
    /// The encoder's backward by hand (over the kernels' tape).
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
            // keys). Over the tape, 8h as listed; under autograd the composition's 7h (both
            // against measured peaks: BENCHMARKS.md).
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
/// with activation checkpointing every `checkpointing` layers (0 = off), for the default
/// kernels ([`bertkit_model::kernels::KernelOptions`]' defaults: on CUDA the lean feed-forward
/// and the one-pass attention where it applies).
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
        [FeedForward::Auto, FeedForward::Lean, FeedForward::Full]
            .into_iter()
            .find(|f| f.name() == value)
            .ok_or_else(|| {
                TrainError::Config(format!("{setting} = {value:?}: {} expected", Self::VALUES))
            })
    }

    /// Its name, as a setting writes it (serde's too: lower case).
    fn name(self) -> &'static str {
        match self {
            FeedForward::Auto => "auto",
            FeedForward::Lean => "lean",
            FeedForward::Full => "full",
        }
    }
}

impl std::fmt::Display for FeedForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
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
mod tests;
