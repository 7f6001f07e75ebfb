//! Flags of the model and training commands: `pretrain`, `plot`, `plan`, `forward`, `bench`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::RankArgs;

#[derive(Args)]
pub(crate) struct PretrainArgs {
    /// The run config (pipelines/pretrain-phase1.toml, pipelines/tiny.toml, …).
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// Records (.parquet files or folders) instead of the config's.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Held-out records instead of the config's `[eval] records` (with the config's other
    /// `[eval]` settings, or every 1000 steps on 10,000 sequences).
    #[arg(long, conflicts_with = "no_eval")]
    pub(crate) eval_data: Option<PathBuf>,
    /// No held-out evaluation, whatever the config's `[eval]` says.
    #[arg(long)]
    pub(crate) no_eval: bool,
    /// Run folder instead of the config's.
    #[arg(long)]
    pub(crate) output: Option<PathBuf>,
    /// Set a config key, SECTION.KEY=VALUE, over the file's (repeatable): e.g.
    /// `--set model.preset=tiny --set model.init=runs/phase1 --set schedule.lr=4e-3`. The value
    /// is TOML (numbers, true/false, ["lists"]) or else a string.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) set: Vec<String>,
    /// Stop after this many optimiser steps (the schedule still spans the config's).
    #[arg(long)]
    pub(crate) max_steps: Option<u64>,
    #[command(flatten)]
    pub(crate) run_folder: super::RunFolderArgs,
    /// Write no checkpoint, not even the last (a benchmark or smoke test that will not be
    /// resumed: BERT-large's checkpoint is 4 GB); metrics and logs as usual.
    #[arg(long, conflicts_with = "resume")]
    pub(crate) no_checkpoints: bool,
    /// Device instead of the config's: cpu, cuda, cuda:N.
    #[arg(long)]
    pub(crate) device: Option<String>,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
    /// Sequences per micro-batch instead of the config's (accumulation follows).
    #[arg(long)]
    pub(crate) micro_batch: Option<usize>,
    /// Sequences per optimiser step instead of the config's (a smoke test on a small machine;
    /// not the recipe's batch).
    #[arg(long)]
    pub(crate) global_batch: Option<usize>,
    #[command(flatten)]
    pub(crate) ranks: RankArgs,
}

#[derive(Args)]
pub(crate) struct PlotArgs {
    /// A run's metrics.jsonl.
    pub(crate) metrics: PathBuf,
    /// The SVG file to write.
    #[arg(long, short)]
    pub(crate) output: PathBuf,
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    /// A transformers config.json, or base / large.
    #[arg(long, default_value = "large", conflicts_with = "recipe")]
    pub(crate) config: String,
    /// A run config (pipelines/pretrain-phase1.toml, …): its model, precision, checkpointing,
    /// masked-LM slots, micro-batch and global batch, checked against the memory at --seq.
    #[arg(long)]
    pub(crate) recipe: Option<PathBuf>,
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pub(crate) seq: Vec<usize>,
    /// GPU memory, e.g. 12GiB, 16GiB, 80GB.
    #[arg(long)]
    pub(crate) gpu_mem: String,
    /// The device whose kernels the plan counts: cuda (its fused kernels and its runtime's
    /// memory) or cpu.
    #[arg(long, default_value = "cuda")]
    pub(crate) device: String,
    /// f32, bf16 or fp16.
    #[arg(long, default_value = "bf16")]
    pub(crate) precision: String,
    /// Activation checkpointing every N layers (the flag alone: every layer).
    #[arg(long, num_args = 0..=1, default_value_t = 0, default_missing_value = "1")]
    pub(crate) checkpointing: usize,
    /// Global batch per sequence length, comma-separated (NVIDIA's recipe: 65536,32768).
    #[arg(long, value_delimiter = ',', default_value = "65536,32768")]
    pub(crate) global_batch: Vec<usize>,
    /// Masked-LM predictions per sequence length, comma-separated (0: no masked-LM head, as in
    /// fine-tuning).
    #[arg(long, value_delimiter = ',', default_value = "20,80")]
    pub(crate) predictions: Vec<usize>,
    /// One JSON object per sequence length instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
pub(crate) struct ForwardArgs {
    /// Model directory: config.json and model.safetensors (transformers layout).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Safetensors file with int64 `input_ids`, and optionally `attention_mask` and
    /// `token_type_ids`, all [batch, seq].
    #[arg(long)]
    pub(crate) input: PathBuf,
    /// Output safetensors: `last_hidden_state`, `pooler_output` and `hidden_states.0…N` (f32).
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Weights and activations: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, or cuda / cuda:N with a CUDA build.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
}

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Forward-pass throughput and latency of a model folder.
    Inference(BenchInferenceArgs),
    /// The optimiser step alone (gradient norm and update) on a model of a given size.
    Optimizer(BenchOptimizerArgs),
    /// Peak bytes a few real training steps hold (the allocator's count; on a GPU the device
    /// pool's), beside `plan`'s prediction for the same shapes; on the CPU also the process's
    /// resident peak (the heap with the pages its allocator keeps).
    Memory(BenchMemoryArgs),
    /// The matrix products of a model's linear layers: TFLOP/s per shape and the fastest, the
    /// peak `pretrain` reports MFU against on the CPU (`[train] peak_tflops` to set your own).
    Gemm(BenchGemmArgs),
    /// The operations and activation bytes of a training forward pass, per encoder layer and
    /// outside the layers, with the composed kernels (candle's ops: each operation at least one
    /// kernel launch on CUDA) and the fused ones: what fusion removes, counted on any device.
    Graph(BenchGraphArgs),
    /// Where a training pass's time goes: each kernel's calls and time in the forward pass
    /// and its backward, the rest of each, and the host's time in them (on a GPU, with CUDA
    /// events: what issuing the calls took, against the device's time). On CUDA a training
    /// pass takes the feed-forward `bertkit pretrain` would at its shape, and says which.
    Kernels(BenchKernelsArgs),
    /// The data-parallel gradient all-reduce of a model-sized f32 bucket, run under the
    /// launcher (`mpirun -np N bertkit bench allreduce`): time and bandwidth.
    Allreduce(BenchAllreduceArgs),
}

#[derive(Args)]
pub(crate) struct BenchGemmArgs {
    /// The model whose products to time: base, large, or a transformers config.json.
    #[arg(long, default_value = "base")]
    pub(crate) config: String,
    /// Tokens (rows) per product.
    #[arg(long, default_value_t = 2048)]
    pub(crate) rows: usize,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
    /// Timed seconds per shape.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) seconds: f64,
}

#[derive(Args)]
pub(crate) struct BenchGraphArgs {
    /// The model: base, large, or a transformers config.json.
    #[arg(long, default_value = "large")]
    pub(crate) config: String,
    /// Sequences per micro-batch (the figures grow in proportion).
    #[arg(long, default_value_t = 8)]
    pub(crate) batch: usize,
    /// Positions per sequence.
    #[arg(long, default_value_t = 128)]
    pub(crate) seq: usize,
    /// Masked-LM predictions per sequence.
    #[arg(long, default_value_t = 20)]
    pub(crate) predictions: usize,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

#[derive(Args)]
pub(crate) struct BenchKernelsArgs {
    #[command(flatten)]
    pub(crate) graph: BenchGraphArgs,
    /// The kernel set: fused (the default; on CUDA the fused CUDA kernels) or composed (the
    /// reference, candle's ops).
    #[arg(long, default_value = "fused")]
    pub(crate) kernels: String,
    /// On CUDA, the fused feed-forward's form in a training pass: auto (the memory plan's, as
    /// `bertkit pretrain` takes it at this shape), lean or full.
    #[arg(long, default_value = "auto", value_parser = super::tasks::feed_forward)]
    pub(crate) feed_forward: bertkit_train::plan::FeedForward,
    /// Timed passes (after one untimed).
    #[arg(long, default_value_t = 3)]
    pub(crate) passes: usize,
    /// Inference's passes instead of training's: parameters that track no gradients, no
    /// dropout, no backward pass.
    #[arg(long)]
    pub(crate) inference: bool,
    /// How each call is timed: events (CUDA events around each call, read after the passes:
    /// the GPU's own time, the host running ahead as in training; on the CPU the host's clock)
    /// or synchronised (the device synchronised around each call, the host's clock: a GPU's
    /// idle time while the host launches, and at each synchronisation the pool's work, count
    /// to the call).
    #[arg(long, default_value = "events")]
    pub(crate) clock: bertkit_model::kernels::Clock,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
}

#[derive(Args)]
pub(crate) struct BenchAllreduceArgs {
    /// The bucket holds this model's parameters: base, large, or a transformers config.json.
    #[arg(long, default_value = "base")]
    pub(crate) config: String,
    /// cpu, cuda or cuda:N (where the bucket lives).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Timed all-reduces (after one untimed).
    #[arg(long, default_value_t = 5)]
    pub(crate) repeats: usize,
    #[command(flatten)]
    pub(crate) ranks: super::RankArgs,
}

#[derive(Args)]
pub(crate) struct BenchMemoryArgs {
    /// The run config (pipelines/pretrain-phase1.toml, …); its output folder is not written.
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// Records instead of the config's.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Model preset instead of the config's: base, large or tiny.
    #[arg(long)]
    pub(crate) preset: Option<String>,
    /// A transformers config.json instead of the config's model.
    #[arg(long, conflicts_with = "preset")]
    pub(crate) model_config: Option<PathBuf>,
    /// Masked-LM slots per sequence instead of the config's.
    #[arg(long)]
    pub(crate) predictions: Option<usize>,
    /// Sequences per micro-batch instead of the config's.
    #[arg(long)]
    pub(crate) micro_batch: Option<usize>,
    /// Micro-batches a step (the step's gradients summed over them; the recipes' global
    /// batches are many).
    #[arg(long, default_value_t = 1)]
    pub(crate) accumulation: usize,
    /// f32, bf16 or fp16 instead of the config's.
    #[arg(long)]
    pub(crate) precision: Option<String>,
    /// Activation checkpointing every N layers instead of the config's (0 = off).
    #[arg(long)]
    pub(crate) checkpointing: Option<usize>,
    /// Device instead of the config's.
    #[arg(long)]
    pub(crate) device: Option<String>,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
    /// Optimiser steps to run.
    #[arg(long, default_value_t = 2)]
    pub(crate) steps: usize,
    /// One JSON object instead of a line of text.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
pub(crate) struct BenchOptimizerArgs {
    /// base, large, or a transformers config.json.
    #[arg(long, default_value = "base")]
    pub(crate) config: String,
    /// lamb or adamw.
    #[arg(long, default_value = "lamb")]
    pub(crate) rule: String,
    /// The model's dtype: f32, bf16 or f16 (the optimiser's state is f32).
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Timed steps (after one untimed).
    #[arg(long, default_value_t = 5)]
    pub(crate) steps: usize,
}

#[derive(Args)]
pub(crate) struct BenchInferenceArgs {
    /// Model folder (config.json + model.safetensors).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,384")]
    pub(crate) seq: Vec<usize>,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub(crate) batch: Vec<usize>,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    #[command(flatten)]
    pub(crate) products: super::ProductArgs,
    /// Timed seconds per setting (at least five passes).
    #[arg(long, default_value_t = 3.0)]
    pub(crate) seconds: f64,
    /// Use the composed reference kernels (candle primitives) instead of the fused ones.
    #[arg(long)]
    pub(crate) composed: bool,
}
