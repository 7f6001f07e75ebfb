//! Measuring the trainer: `bertkit bench optimizer` and `bertkit bench memory`.
//!
//! [`optimizer_steps`]: a [`BertForPreTraining`] of the asked size gets fixed pseudo-random gradients (the same every
//! step), and [`Step::finish`] (the reduction, the gradient norm, the finiteness check and the
//! LAMB or AdamW update) is timed over a number of steps. The forward and backward passes are
//! left out: what is measured is the part of a training step that does not depend on the batch.
//!
//! [`training_steps`]: a few real optimiser steps of a run config, for the binary to count the
//! bytes they hold (its allocator counts; this crate only runs the steps).
//!
//! [`gemm_tflops`] and [`peak_tflops`]: the rate of the matrix products a model's linear layers
//! run (`bertkit bench gemm`), what the trainer reports MFU against on the CPU.
//!
//! [`all_reduce`]: the data-parallel reduction of a gradient bucket the size of a model's
//! parameters, as [`Step::finish`] runs it once per step (`bertkit bench allreduce`, under the
//! launcher).

use std::time::Instant;

use bertkit_model::BertConfig;
use bertkit_model::bert::{BertForPreTraining, init};
use candle_core::{DType, Device, Tensor};

use crate::TrainError;
use crate::optim::{Optimizer, OptimizerConfig, Rule};
use crate::step::{GradientReducer, Local, Step};

/// What to time.
#[derive(Debug, Clone)]
pub struct OptimizerBench {
    /// The model's shape.
    pub config: BertConfig,
    /// The update rule.
    pub rule: Rule,
    /// The model's dtype (the optimiser's state is f32 whatever it is).
    pub dtype: DType,
    /// Timed steps (one more runs first, untimed).
    pub steps: usize,
}

/// The timings.
#[derive(Debug, Clone)]
pub struct OptimizerTimes {
    /// Trainable parameters.
    pub parameters: usize,
    /// Seconds of each timed step.
    pub seconds: Vec<f64>,
    /// The same steps' work phase by phase ([`OPTIMIZER_PHASES`]), each timed on its own with
    /// the device synchronised around it, seconds per timed step.
    pub phases: Vec<[f64; 3]>,
}

/// The phases of an optimiser step [`OptimizerTimes::phases`] times: the flat gradient bucket
/// ([`Optimizer::flatten`]), its norm read back to the host ([`Optimizer::squared_norm`]), and
/// the update with the parameters set from the master weights ([`Optimizer::step`]).
pub const OPTIMIZER_PHASES: [&str; 3] =
    ["gradient bucket", "norm, read back", "update + write-back"];

/// Times `bench.steps` optimiser steps on `device`.
pub fn optimizer_steps(
    bench: &OptimizerBench,
    device: &Device,
) -> Result<OptimizerTimes, TrainError> {
    if bench.steps == 0 {
        return Err(TrainError::Config(
            "bench optimizer: at least one timed step".into(),
        ));
    }
    let model = init::<BertForPreTraining>(&bench.config, bench.dtype, device, 7)?;
    let vars = model.params.vars();
    let config = OptimizerConfig {
        rule: bench.rule,
        ..OptimizerConfig::lamb()
    };
    let mut optimizer = Optimizer::new(config, vars)?;
    // One linear loss per parameter, Σ c·w, whose gradient is the fixed tensor c: in each
    // parameter's own dtype (a half-precision model keeps its embedding tables in f32), summed
    // in f32.
    let mut loss = Tensor::zeros((), DType::F32, device)?;
    for (i, var) in vars.values().enumerate() {
        let c = Tensor::randn(0f32, 1e-3, var.shape(), device)?
            .to_dtype(var.dtype())?
            .affine(1.0 + i as f64 * 1e-3, 0.0)?;
        loss = (loss + (var.as_tensor() * c)?.sum_all()?.to_dtype(DType::F32)?)?;
    }
    let mut seconds = Vec::with_capacity(bench.steps);
    for n in 0..=bench.steps {
        let mut step = Step::begin(vars, &optimizer, None);
        step.backward(&loss)?;
        device.synchronize()?;
        let started = Instant::now();
        step.finish(&Local, &mut optimizer, None, 1e-4, n as u64 + 1)?;
        device.synchronize()?;
        if n > 0 {
            seconds.push(started.elapsed().as_secs_f64());
        }
    }
    // The phases, one at a time, on the same gradients (each step's phases timed apart).
    let grads = {
        let store = loss.backward()?;
        let mut grads = std::collections::BTreeMap::new();
        for (name, var) in vars {
            if let Some(g) = store.get(var.as_tensor()) {
                grads.insert(name.clone(), g.clone());
            }
        }
        grads
    };
    let mut phases = Vec::with_capacity(bench.steps);
    for _ in 0..bench.steps {
        let timed = |f: &mut dyn FnMut() -> Result<(), TrainError>| -> Result<f64, TrainError> {
            device.synchronize()?;
            let started = Instant::now();
            f()?;
            device.synchronize()?;
            Ok(started.elapsed().as_secs_f64())
        };
        let mut bucket = None;
        let flatten = timed(&mut || {
            bucket = Some(optimizer.flatten(grads.clone())?);
            Ok(())
        })?;
        let bucket = bucket.expect("set by the timed phase");
        let mut norm = 0f64;
        let read = timed(&mut || {
            norm = optimizer.squared_norm(&bucket)?.to_scalar::<f64>()?.sqrt();
            Ok(())
        })?;
        let clip = optimizer.clip_factor(norm);
        let update = timed(&mut || optimizer.step(&bucket, 1e-4, clip))?;
        phases.push([flatten, read, update]);
    }
    Ok(OptimizerTimes {
        parameters: vars.values().map(|v| v.elem_count()).sum(),
        seconds,
        phases,
    })
}

/// Times `repeats` sums of an f32 bucket of `elements` over the reducer's ranks (after one
/// untimed), on `device`: seconds of each. Rank `r` contributes `r + 1` everywhere, and every
/// result is checked against the sum it must be.
pub fn all_reduce(
    reducer: &dyn GradientReducer,
    elements: usize,
    repeats: usize,
    device: &Device,
) -> Result<Vec<f64>, TrainError> {
    if repeats == 0 || elements == 0 {
        return Err(TrainError::Config(
            "bench allreduce: at least one repeat of a non-empty bucket".into(),
        ));
    }
    let ranks = reducer.ranks();
    let contribution = (ranks.rank + 1) as f64;
    let expected = (ranks.world_size * (ranks.world_size + 1) / 2) as f32;
    let mut seconds = Vec::with_capacity(repeats);
    for n in 0..=repeats {
        let mut bucket = (Tensor::ones(elements, DType::F32, device)? * contribution)?;
        device.synchronize()?;
        let started = Instant::now();
        reducer.all_reduce_sum(&mut bucket)?;
        device.synchronize()?;
        let elapsed = started.elapsed().as_secs_f64();
        let (least, most) = (bucket.min(0)?, bucket.max(0)?);
        let (least, most) = (least.to_scalar::<f32>()?, most.to_scalar::<f32>()?);
        if least != expected || most != expected {
            return Err(TrainError::Config(format!(
                "bench allreduce: the sum over {ranks} came out between {least} and {most}, not \
                 {expected}"
            )));
        }
        if n > 0 {
            seconds.push(elapsed);
        }
    }
    Ok(seconds)
}

/// What [`training_steps`] ran: the shapes whose memory was measured.
#[derive(Debug, Clone)]
pub struct TrainingSteps {
    /// The model's configuration.
    pub model: BertConfig,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step.
    pub accumulation: usize,
    /// The longest padded sequence length of the batches run.
    pub seq_len: usize,
    /// Masked-LM slots per sequence.
    pub predictions: usize,
    /// Seconds of each step.
    pub seconds: Vec<f64>,
}

/// Runs `steps` optimiser steps of the run `config` describes (its output folder is not
/// written: no metrics, no checkpoints), for measuring what a step holds in memory.
/// `taken` is called with the steps taken so far: 0 once the model and optimiser are built,
/// before the first step, then after each step.
pub fn training_steps(
    config: crate::config::PretrainConfig,
    steps: usize,
    taken: &mut dyn FnMut(usize),
) -> Result<TrainingSteps, TrainError> {
    if steps == 0 {
        return Err(TrainError::Config("bench memory: at least one step".into()));
    }
    let options = crate::trainer::RunOptions {
        steps_only: true,
        ..Default::default()
    };
    let mut trainer = crate::trainer::Trainer::new(config.clone(), options)?;
    taken(0);
    let mut stream = trainer.dataset().stream(Default::default());
    let mut seq_len = 0;
    let mut seconds = Vec::with_capacity(steps);
    for step in 1..=steps {
        let batches = (0..trainer.accumulation())
            .map(|_| stream.next_batch())
            .collect::<Result<Vec<_>, _>>()?;
        seq_len = batches.iter().map(|b| b.seq_len).fold(seq_len, usize::max);
        let started = Instant::now();
        trainer.train_step(&batches)?;
        seconds.push(started.elapsed().as_secs_f64());
        taken(step);
    }
    Ok(TrainingSteps {
        model: trainer.model().config.clone(),
        micro_batch: config.data.micro_batch,
        accumulation: trainer.accumulation(),
        seq_len,
        predictions: config.data.max_predictions,
        seconds,
    })
}

/// The `(m, k, n)` products of a model's linear layers at `rows` tokens: the attention
/// projections (hidden to hidden) and the feed-forward pair (hidden to intermediate and back).
pub fn model_gemm_shapes(config: &BertConfig, rows: usize) -> Vec<(usize, usize, usize)> {
    let (h, i) = (config.hidden_size, config.intermediate_size);
    vec![(rows, h, h), (rows, h, i), (rows, i, h)]
}

/// The rate of `m×k` by `k×n` products in `dtype` on `device`, in TFLOP/s (`2·m·k·n` per
/// product): the fastest of the products timed over about `seconds` (after one untimed),
/// through candle's product (on the CPU the gemm library the model's fused kernels call too).
pub fn gemm_tflops(
    (m, k, n): (usize, usize, usize),
    dtype: DType,
    device: &Device,
    seconds: f64,
) -> Result<f64, TrainError> {
    if m == 0 || k == 0 || n == 0 {
        return Err(TrainError::Config(format!(
            "bench gemm: an empty product {m}x{k} by {k}x{n}"
        )));
    }
    let a = Tensor::randn(0f32, 1.0, (m, k), device)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (k, n), device)?.to_dtype(dtype)?;
    let mut fastest = f64::INFINITY;
    let started = Instant::now();
    for run in 0.. {
        let t = Instant::now();
        let c = a.matmul(&b)?;
        device.synchronize()?;
        let elapsed = t.elapsed().as_secs_f64();
        drop(c);
        if run > 0 {
            fastest = fastest.min(elapsed);
        }
        if run >= 3 && started.elapsed().as_secs_f64() >= seconds {
            break;
        }
    }
    Ok(2.0 * (m * k * n) as f64 / fastest / 1e12)
}

/// Tokens per product when the trainer calibrates: a micro-batch of 16 sequences of 128.
const CALIBRATION_ROWS: usize = 2048;

/// The fastest rate among `config`'s linear-layer products ([`model_gemm_shapes`] at 2048
/// tokens), each timed for about a third of a second: the peak the trainer reports MFU
/// against when the config gives none.
pub fn peak_tflops(config: &BertConfig, dtype: DType, device: &Device) -> Result<f64, TrainError> {
    let mut peak = 0f64;
    for shape in model_gemm_shapes(config, CALIBRATION_ROWS) {
        peak = peak.max(gemm_tflops(shape, dtype, device, 0.3)?);
    }
    Ok(peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every precision a run can take: a half-precision model keeps its embedding tables in
    /// f32, so the bench's fixed gradients follow each parameter's dtype (bf16 once failed
    /// with a dtype mismatch on every device).
    #[test]
    fn the_optimizer_bench_runs_in_every_precision_and_rule() {
        let config = BertConfig::tiny(100);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for rule in [Rule::Lamb, Rule::Adamw] {
                let bench = OptimizerBench {
                    config: config.clone(),
                    rule,
                    dtype,
                    steps: 2,
                };
                let times = optimizer_steps(&bench, &Device::Cpu)
                    .unwrap_or_else(|e| panic!("{dtype:?} {rule:?}: {e}"));
                assert_eq!(times.parameters, crate::plan::parameters(&config));
                assert_eq!(times.seconds.len(), 2);
                assert!(times.seconds.iter().all(|s| s.is_finite() && *s > 0.0));
                // Each timed step's phases, each timed.
                assert_eq!(times.phases.len(), 2);
                assert!(
                    times
                        .phases
                        .iter()
                        .flatten()
                        .all(|s| s.is_finite() && *s > 0.0)
                );
            }
        }
    }
}
