//! The model and training commands: `forward`, `pretrain`, `plot`, `plan` (the benchmarks in
//! `bench.rs`).

use std::time::Instant;

use crate::flags::train::*;
use crate::render::TrainProgress;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub(crate) fn forward(args: ForwardArgs) -> Result<()> {
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let device = bertkit_model::parse_device(&args.device)?;
    let started = Instant::now();
    let done = bertkit_tasks::inference::forward_file(
        &args.model,
        &args.input,
        &args.output,
        dtype,
        &device,
    )?;
    if !done.initialised.is_empty() {
        eprintln!(
            "warning: {} has no {}; initialised at random",
            args.model.display(),
            done.initialised.join(", ")
        );
    }
    println!(
        "{}: {} tensors for {} sequence(s) of {} ({}, {:?}, {} layers, {:.2} s)",
        args.output.display(),
        done.tensors,
        done.batch,
        done.seq,
        args.dtype,
        device.location(),
        done.layers,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub(crate) fn pretrain(args: PretrainArgs) -> Result<()> {
    let mut config = bertkit_train::config::PretrainConfig::load_with(&args.config, &args.set)?;
    if let Some(data) = args.data {
        config.data.records = vec![data];
    }
    if let Some(records) = args.eval_data {
        let mut eval = config
            .eval
            .take()
            .unwrap_or_else(|| bertkit_train::config::EvalSection::new(Vec::new()));
        eval.records = vec![records];
        config.eval = Some(eval);
    }
    if args.no_eval {
        config.eval = None;
    }
    if let Some(output) = args.output {
        config.output = output;
    }
    if let Some(device) = args.device {
        // The config's peak_tflops is its device's: MFU on another (a GPU recipe's smoke run
        // on the CPU) is against that device's measured peak instead.
        if device != config.train.device {
            config.train.peak_tflops = None;
        }
        config.train.device = device;
    }
    if let Some(micro) = args.micro_batch {
        config.data.micro_batch = micro;
    }
    if let Some(global) = args.global_batch {
        config.train.global_batch = global;
    }
    let (max_steps, earlier, no_checkpoints) = (
        args.max_steps,
        args.run_folder.earlier(),
        args.no_checkpoints,
    );
    let device = config.train.device.clone();
    super::as_rank(args.ranks.ranks()?, &device, |reducer| {
        let options = bertkit_train::trainer::RunOptions {
            max_steps,
            earlier,
            reducer,
            measure_peak: true,
            steps_only: false,
            checkpoints: !no_checkpoints,
        };
        run_pretraining(config, options, max_steps)
    })
}

fn run_pretraining(
    config: bertkit_train::config::PretrainConfig,
    options: bertkit_train::trainer::RunOptions,
    max_steps: Option<u64>,
) -> Result<()> {
    let ranks = options.reducer.ranks();
    let resume = options.earlier.resumes();
    let mut trainer = bertkit_train::trainer::Trainer::new(config.clone(), options)?;
    let last = max_steps
        .unwrap_or(config.schedule.total_steps)
        .min(config.schedule.total_steps);
    // Rank 0 speaks for the run; the others train quietly.
    let speaks = ranks.rank == 0;
    if speaks {
        println!(
            "pretrain {}: {:.1} M parameters, {} sequences in {} file(s), micro-batch {} x {} accumulation{} = {} per step, steps {}..{} of {}, {} on {}",
            config.output.display(),
            trainer.model().params.count() as f64 / 1e6,
            trainer.dataset().sequences(),
            trainer.dataset().paths().len(),
            config.data.micro_batch,
            trainer.accumulation(),
            if ranks.world_size > 1 {
                format!(" x {} ranks (MPI)", ranks.world_size)
            } else {
                String::new()
            },
            config.train.global_batch,
            trainer.step(),
            last,
            config.schedule.total_steps,
            config.train.precision,
            config.train.device
        );
    }
    if let (true, Some(peak)) = (speaks, trainer.peak_tflops()) {
        let source = if config.train.peak_tflops.is_some() {
            "[train] peak_tflops"
        } else {
            "this device's fastest matrix product of the model, measured now (bench gemm)"
        };
        println!("MFU against {:.1} GFLOP/s per device: {source}", peak * 1e3);
    }
    if speaks {
        println!("{}", startup_line(trainer.startup()));
        if let Some(choice) = trainer.feed_forward() {
            println!("{choice}");
        }
    }
    if speaks && resume && trainer.step() == 0 {
        eprintln!(
            "note: --resume: no checkpoint under {}, so the run starts at step 0",
            config.output.join("checkpoints").display()
        );
    }
    let mut progress = speaks.then(|| TrainProgress::new(trainer.step(), last));
    // The device's memory before the first step (the model, its loading, the optimiser's
    // state) and after it (its activations, and the state the first update allocates): where
    // the pool's spare above its tensors forms.
    let device = trainer.device().clone();
    let setup_memory = PoolPeaks::now(&device);
    let mut first_step_memory = None;
    let started = Instant::now();
    let summary = trainer.run(&mut |m| {
        if first_step_memory.is_none() {
            first_step_memory = PoolPeaks::now(&device);
        }
        if let Some(p) = &mut progress {
            p.step(m)
        }
    })?;
    let Some(progress) = progress else {
        return Ok(());
    };
    progress.finish();
    let loss = |m: Option<&bertkit_train::trainer::StepMetrics>| {
        m.map_or("-".into(), |m| format!("{:.4}", m.loss))
    };
    println!(
        "steps {}..{} in {:.1} s; loss {} -> {}; metrics in {}",
        summary.started_at,
        summary.step,
        started.elapsed().as_secs_f64(),
        loss(summary.metrics.first()),
        loss(summary.metrics.last()),
        config.output.join("metrics.jsonl").display()
    );
    if let Some(line) = step_times_line(&summary.metrics) {
        println!("{line}");
    }
    for w in &summary.checkpoint_writes {
        println!("{w}");
    }
    if config.output.join("vocab.txt").is_file() {
        println!(
            "model at step {}: {} (config.json, model.safetensors, vocab.txt, tokenizer_config.json)",
            summary.step,
            config.output.display()
        );
    } else {
        println!(
            "model at step {}: {} (config.json, model.safetensors; the records store no \
             vocabulary: put their vocab.txt beside it before fine-tuning)",
            summary.step,
            config.output.display()
        );
    }
    if let Some(peak) = bertkit_model::device_peak(trainer.device()) {
        // What PyTorch's `max_memory_allocated` counts; the pool's reserve what its
        // `max_memory_reserved` counts; nvidia-smi adds the CUDA context and cuBLAS's
        // workspaces.
        let reserved = bertkit_model::device_reserved_peak(trainer.device())
            .map(|r| format!(", {} MiB at most held by the pool", r >> 20))
            .unwrap_or_default();
        let marks: Vec<String> = [
            ("before the first step", setup_memory),
            ("after it", first_step_memory),
        ]
        .into_iter()
        .filter_map(|(when, peaks)| peaks.map(|p| format!("{when} {p}")))
        .collect();
        let marks = if marks.is_empty() {
            String::new()
        } else {
            format!(" ({})", marks.join(", "))
        };
        println!(
            "device memory: {} MiB at most in tensors (the CUDA pool's high-water mark){reserved}{marks}",
            peak >> 20
        );
    }
    Ok(())
}

/// The device pool's high-water marks so far: of bytes in tensors, and of bytes it held.
#[derive(Debug, Clone, Copy)]
struct PoolPeaks {
    tensors: u64,
    held: u64,
}

impl PoolPeaks {
    /// The marks now; `None` off a CUDA device.
    fn now(device: &candle_core::Device) -> Option<PoolPeaks> {
        Some(PoolPeaks {
            tensors: bertkit_model::device_peak(device)?,
            held: bertkit_model::device_reserved_peak(device)?,
        })
    }
}

impl std::fmt::Display for PoolPeaks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} and {} MiB", self.tensors >> 20, self.held >> 20)
    }
}

/// `start-up 3.2 s: lock 0.00 s, device 0.41 s, model 1.10 s, …`: where the time before the
/// first step went.
fn startup_line(startup: &bertkit_train::trainer::StartupTimes) -> String {
    let phases: Vec<String> = startup
        .phases
        .iter()
        .map(|(name, s)| format!("{name} {s:.2} s"))
        .collect();
    format!("start-up {:.1} s: {}", startup.total(), phases.join(", "))
}

/// `first step 16.0 s, then 0.98 s a step (median of 11), 0.91 s of it waiting on the device`:
/// the first step pays for one-time work (kernel compilation, the allocator's first blocks,
/// cuBLAS's choices); the median of the others is the run's pace, and the median wait at the
/// step's read-back says what bounds it (on a GPU, a wait: the device; none: the host). The
/// wait is left out where there was none to speak of (the CPU).
fn step_times_line(metrics: &[bertkit_train::trainer::StepMetrics]) -> Option<String> {
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let (first, rest) = metrics.split_first()?;
    let mut line = format!("first step {:.2} s", first.step_seconds);
    if !rest.is_empty() {
        let step = median(&mut rest.iter().map(|m| m.step_seconds).collect());
        let wait = median(&mut rest.iter().map(|m| m.wait_seconds).collect());
        line.push_str(&format!(
            ", then {step:.3} s a step (median of {})",
            rest.len()
        ));
        if wait >= 0.001 {
            line.push_str(&format!(", {wait:.3} s of it waiting on the device"));
        }
    }
    Some(line)
}

pub(crate) fn plot(args: PlotArgs) -> Result<()> {
    let steps = bertkit_train::plot::plot_file(&args.metrics, &args.output)?;
    println!("{}: {steps} steps plotted", args.output.display());
    Ok(())
}

pub(crate) fn plan(args: PlanArgs) -> Result<()> {
    use bertkit_train::plan::{Precision, Shape, parse_bytes, plan, predict};
    let memory = parse_bytes(&args.gpu_mem)?;
    // A list shorter than --seq repeats its last value.
    let nth =
        |list: &[usize], i: usize, default: usize| *list.get(i).or(list.last()).unwrap_or(&default);
    let recipe = match &args.recipe {
        Some(path) => Some(bertkit_train::config::PretrainConfig::load(path)?),
        None => None,
    };
    let (config, precision_name, every) = match &recipe {
        Some(r) => (
            r.bert_config()?,
            r.train.precision.clone(),
            r.train.activation_checkpointing,
        ),
        None => (
            bertkit_model::BertConfig::named(&args.config)?,
            args.precision.clone(),
            args.checkpointing,
        ),
    };
    let target = bertkit_train::plan::Target::of_device(&args.device);
    let precision = Precision::parse(&precision_name)?;
    let gib = |b: f64| b / (1u64 << 30) as f64;
    if !args.json {
        println!(
            "{} layers, hidden {}, {:.1} M parameters; {} of memory on {}, {precision_name}, activation checkpointing {}",
            config.num_hidden_layers,
            config.hidden_size,
            bertkit_train::plan::parameters(&config) as f64 / 1e6,
            args.gpu_mem,
            args.device,
            if every == 0 {
                "off".to_string()
            } else {
                format!("every {every} layer(s)")
            }
        );
        println!(
            "{:>6} {:>10} {:>12} {:>12} {:>14} {:>12} {:>10}",
            "seq", "fits", "micro-batch", "peak GiB", "global batch", "accumulate", "recipe"
        );
    }
    for (i, &seq) in args.seq.iter().enumerate() {
        let (predictions, global) = match &recipe {
            Some(r) => (r.data.max_predictions, r.train.global_batch),
            None => (
                nth(&args.predictions, i, 20),
                nth(&args.global_batch, i, 256),
            ),
        };
        let largest = plan(&config, seq, predictions, precision, every, target, memory);
        let (micro, accumulate) = match &recipe {
            Some(r) => (
                r.data.micro_batch,
                Some(r.accumulation(1)?).filter(|_| r.data.micro_batch > 0),
            ),
            None => match largest.recipe(global) {
                Some((micro, steps)) => (micro, Some(steps)),
                None => (0, None),
            },
        };
        let shape = Shape {
            seq,
            predictions,
            micro_batch: micro.max(1),
            accumulation: accumulate.unwrap_or(2),
        };
        // A recipe's run on CUDA picks its feed-forward as its setting says (by default the
        // plan, `bertkit pretrain`'s memory check): the peak is the form it would take.
        let feed_forward = recipe
            .as_ref()
            .filter(|_| target == bertkit_train::plan::Target::Cuda)
            .map(|r| {
                let setting = r.train.feed_forward;
                bertkit_train::plan::feed_forward_for(
                    &config, &shape, precision, every, memory, setting,
                )
            });
        let at = match &feed_forward {
            Some(choice) => choice.prediction,
            None => predict(&config, &shape, precision, every, target),
        };
        let lean = feed_forward.is_some_and(|c| c.lean);
        let fits = micro > 0 && at.total() <= bertkit_train::plan::USABLE * memory;
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "seq": seq,
                    "predictions": predictions,
                    "precision": precision_name,
                    "checkpointing": every,
                    "memory_bytes": memory,
                    "largest_micro_batch": largest.micro_batch,
                    "micro_batch": micro,
                    "accumulation": accumulate,
                    "global_batch": global,
                    "peak_bytes": at.total(),
                    "state_bytes": at.state_bytes,
                    "activation_bytes": at.activation_bytes,
                    "transient_bytes": at.transient_bytes,
                    "runtime_bytes": at.runtime_bytes,
                    "device": args.device,
                    "fits": fits,
                    "lean_feed_forward": feed_forward.map(|c| c.lean),
                })
            );
        } else {
            println!(
                "{seq:>6} {:>10} {micro:>12} {:>12.2} {global:>14} {:>12} {:>10}",
                largest.micro_batch,
                gib(at.total()),
                accumulate.map_or("-".to_string(), |a| a.to_string()),
                if recipe.is_some() {
                    match (fits, lean) {
                        (true, false) => "fits",
                        (true, true) => "fits, lean",
                        (false, _) => "TOO BIG",
                    }
                } else {
                    ""
                }
            );
        }
    }
    if !args.json {
        println!(
            "(peak = the run's state + the larger of a micro-batch's activations with its gradients and the optimiser update; calibrated against measured training steps, see BENCHMARKS.md; {:.0}% of the memory is kept back; on CUDA a recipe's run keeps the feed-forward's activation where that fits, else recomputes it: \"fits, lean\")",
            (1.0 - bertkit_train::plan::USABLE) * 100.0
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(step: u64, seconds: f64, wait: f64) -> bertkit_train::trainer::StepMetrics {
        serde_json::from_value(serde_json::json!({
            "step": step, "loss": 1.0, "mlm_loss": 0.5, "nsp_loss": 0.5, "mlm_accuracy": 0.0,
            "nsp_accuracy": 0.5, "lr": 1e-4, "grad_norm": 1.0, "loss_scale": 1.0,
            "skipped": false, "step_seconds": seconds, "wait_seconds": wait, "seq_per_s": 1.0,
            "tokens_per_s": 1.0, "tflops": 1.0,
        }))
        .unwrap()
    }

    /// The pace is the median of the steps after the first, and so is the wait at the
    /// read-back, said only where there was one to speak of.
    #[test]
    fn the_step_line_gives_the_median_step_and_its_wait() {
        let run = [
            metrics(1, 2.0, 1.5),
            metrics(2, 0.10, 0.08),
            metrics(3, 0.30, 0.02),
            metrics(4, 0.12, 0.07),
        ];
        assert_eq!(
            step_times_line(&run).unwrap(),
            "first step 2.00 s, then 0.120 s a step (median of 3), 0.070 s of it waiting on the device"
        );
        let cpu: Vec<_> = run
            .iter()
            .map(|m| metrics(m.step, m.step_seconds, 0.0))
            .collect();
        assert_eq!(
            step_times_line(&cpu).unwrap(),
            "first step 2.00 s, then 0.120 s a step (median of 3)"
        );
        assert_eq!(step_times_line(&run[..1]).unwrap(), "first step 2.00 s");
        assert!(step_times_line(&[]).is_none());
    }
}
