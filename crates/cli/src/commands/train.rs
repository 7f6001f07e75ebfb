//! The model and training commands: `forward`, `pretrain`, `plot`, `plan`, `bench inference`.

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
    let (max_steps, resume, no_checkpoints) = (args.max_steps, args.resume, args.no_checkpoints);
    let device = config.train.device.clone();
    super::as_rank(args.ranks.ranks()?, &device, |reducer| {
        let options = bertkit_train::trainer::RunOptions {
            max_steps,
            resume,
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
    let resume = options.resume;
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

pub(crate) fn bench(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Inference(args) => bench_inference(args),
        BenchCommand::Optimizer(args) => bench_optimizer(args),
        BenchCommand::Gemm(args) => bench_gemm(args),
        BenchCommand::Graph(args) => bench_graph(args),
        BenchCommand::Kernels(args) => bench_kernels(args),
        BenchCommand::Memory(args) => bench_memory(args),
        BenchCommand::Allreduce(args) => bench_allreduce(args),
    }
}

fn bench_allreduce(args: BenchAllreduceArgs) -> Result<()> {
    let config = bertkit_model::BertConfig::named(&args.config)?;
    let elements = bertkit_train::plan::parameters(&config);
    let ranks = args.ranks.ranks()?;
    if ranks.world_size < 2 {
        return Err(
            "bench allreduce measures several ranks: start it with the launcher, \
                    `mpirun -np 2 bertkit bench allreduce` (a build with --features mpi)"
                .into(),
        );
    }
    super::as_rank(ranks, &args.device, |reducer| {
        let device = super::rank_device(reducer.as_ref(), &args.device)?;
        let seconds =
            bertkit_train::bench::all_reduce(reducer.as_ref(), elements, args.repeats, &device)?;
        if ranks.rank != 0 {
            return Ok(());
        }
        let mut sorted = seconds.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let bytes = elements as f64 * 4.0;
        // NCCL's convention: the algorithm bandwidth is the bucket over the time; the bus
        // bandwidth scales it by 2(n-1)/n, what each link carries in a ring all-reduce.
        let algorithm = bytes / median / 1e9;
        let n = ranks.world_size as f64;
        println!(
            "{} bucket: {} f32 ({:.0} MB) over {} ranks on {}: {} repeats, median {:.3} s, least {:.3} s; algorithm bandwidth {:.2} GB/s, bus bandwidth {:.2} GB/s",
            args.config,
            elements,
            bytes / 1e6,
            ranks.world_size,
            args.device,
            sorted.len(),
            median,
            sorted[0],
            algorithm,
            algorithm * 2.0 * (n - 1.0) / n
        );
        Ok(())
    })
}

fn bench_memory(args: BenchMemoryArgs) -> Result<()> {
    let mut config = bertkit_train::config::PretrainConfig::load(&args.config)?;
    if let Some(data) = args.data {
        config.data.records = vec![data];
    }
    if let Some(preset) = args.preset {
        config.model.preset = Some(preset);
        config.model.config = None;
    }
    if let Some(path) = args.model_config {
        config.model.config = Some(path);
        config.model.preset = None;
    }
    if let Some(predictions) = args.predictions {
        config.data.max_predictions = predictions;
    }
    if let Some(micro) = args.micro_batch {
        config.data.micro_batch = micro;
    }
    config.train.global_batch = config.data.micro_batch * args.accumulation.max(1);
    // Training steps alone: no held-out evaluation.
    config.eval = None;
    if let Some(precision) = args.precision {
        config.train.precision = precision;
    }
    if let Some(every) = args.checkpointing {
        config.train.activation_checkpointing = every;
    }
    if let Some(device) = args.device {
        config.train.device = device;
    }
    config.validate(1)?;
    // On a GPU the device's pool counts (its high-water mark of bytes in use); on the CPU the
    // binary's allocator.
    let device = bertkit_model::parse_device(&config.train.device)?;
    let on_device = bertkit_model::device_peak(&device).is_some();
    bertkit_model::reset_device_peak(&device);
    crate::alloc::start_counting();
    // On the CPU also the process's resident peak (what an out-of-memory killer sees: the heap
    // with the pages the allocator keeps), from here where the system lets it be reset.
    let resident = (!on_device).then(bertkit_stage_io::cost::Meter::start);
    let mut state = 0;
    // On a GPU, the pool's high-water marks of tensors and of memory held after each step:
    // whether its spare above the tensors forms at the first step or grows over later ones.
    let mut after_steps = Vec::new();
    let run = bertkit_train::bench::training_steps(config.clone(), args.steps, &mut |taken| {
        if taken == 0 {
            state = bertkit_model::device_peak(&device).unwrap_or(crate::alloc::peak_and_live().1);
        } else if let (Some(tensors), Some(held)) = (
            bertkit_model::device_peak(&device),
            bertkit_model::device_reserved_peak(&device),
        ) {
            after_steps.push((tensors, held));
        }
    })?;
    let peak = bertkit_model::device_peak(&device).unwrap_or(crate::alloc::peak_and_live().0);
    let resident = resident.map(|meter| meter.finish()).and_then(|cost| {
        let since = if cost.peak_is_own {
            "over the steps"
        } else {
            "since the process started"
        };
        cost.peak_rss_bytes.map(|bytes| (bytes, since))
    });
    // The pool's spare above its tensors (what nvidia-smi counts besides them and the context).
    let held = bertkit_model::device_reserved_peak(&device);
    let counted = if on_device {
        "the device pool's high-water mark"
    } else {
        "the heap"
    };
    let predicted = bertkit_train::plan::predict(
        &run.model,
        &bertkit_train::plan::Shape {
            seq: run.seq_len,
            predictions: run.predictions,
            micro_batch: run.micro_batch,
            accumulation: run.accumulation,
        },
        bertkit_train::plan::Precision::parse(&config.train.precision)?,
        config.train.activation_checkpointing,
        bertkit_train::plan::Target::of_device(&config.train.device),
    );
    // A device pool does not hold the runtime's own memory (context, cuBLAS workspace): what
    // it counts is compared with the prediction less that part. The CPU's heap holds it all.
    let not_counted = if on_device {
        predicted.runtime_bytes
    } else {
        0.0
    };
    let predicted_peak = predicted.total() - not_counted;
    let seconds = run.seconds.iter().copied().fold(f64::INFINITY, f64::min);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "layers": run.model.num_hidden_layers,
                "hidden": run.model.hidden_size,
                "seq": run.seq_len,
                "predictions": run.predictions,
                "micro_batch": run.micro_batch,
                "accumulation": run.accumulation,
                "precision": config.train.precision,
                "checkpointing": config.train.activation_checkpointing,
                "measured_peak_bytes": peak,
                "measured_by": counted,
                "measured_state_bytes": state,
                "measured_pool_held_bytes": held,
                "measured_resident_peak_bytes": resident.map(|(bytes, _)| bytes),
                "pool_marks_after_each_step": after_steps
                    .iter()
                    .map(|&(tensors, held)| serde_json::json!({"tensors_bytes": tensors, "held_bytes": held}))
                    .collect::<Vec<_>>(),
                "predicted_peak_bytes": predicted_peak,
                "predicted": {
                    "state_bytes": predicted.state_bytes,
                    "activation_bytes": predicted.activation_bytes,
                    "transient_bytes": predicted.transient_bytes,
                    "runtime_bytes": predicted.runtime_bytes,
                    "runtime_bytes_not_counted": not_counted,
                },
                "least_step_seconds": seconds,
            })
        );
    } else {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        println!(
            "{} layers x {}, seq {}, micro-batch {}{}, {}, checkpointing {}: peak {:.3} GiB measured ({:.3} GiB before the first step; {counted}{}), {:.3} GiB predicted ({:+.1}%), least step {:.1} s",
            run.model.num_hidden_layers,
            run.model.hidden_size,
            run.seq_len,
            run.micro_batch,
            if run.accumulation > 1 {
                format!(" x {} a step", run.accumulation)
            } else {
                String::new()
            },
            config.train.precision,
            config.train.activation_checkpointing,
            gib(peak as f64),
            gib(state as f64),
            held.map(|h| format!(
                "; the pool held {:.3} GiB at most (tensors / held after each step: {})",
                gib(h as f64),
                after_steps
                    .iter()
                    .map(|&(t, h)| format!("{:.3}/{:.3}", gib(t as f64), gib(h as f64)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .unwrap_or_default()
                + &resident
                    .map(|(bytes, since)| format!(
                        "; resident peak {:.3} GiB, {since}",
                        gib(bytes as f64)
                    ))
                    .unwrap_or_default(),
            gib(predicted_peak),
            (predicted_peak / peak as f64 - 1.0) * 100.0,
            seconds
        );
    }
    Ok(())
}

fn bench_optimizer(args: BenchOptimizerArgs) -> Result<()> {
    let rule = match args.rule.as_str() {
        "lamb" => bertkit_train::optim::Rule::Lamb,
        "adamw" => bertkit_train::optim::Rule::Adamw,
        other => return Err(format!("--rule {other:?}: expected lamb or adamw").into()),
    };
    let bench = bertkit_train::bench::OptimizerBench {
        config: bertkit_model::BertConfig::named(&args.config)?,
        rule,
        dtype: bertkit_model::parse_dtype(&args.dtype)?,
        steps: args.steps,
    };
    let device = bertkit_model::parse_device(&args.device)?;
    let times = bertkit_train::bench::optimizer_steps(&bench, &device)?;
    let mut sorted = times.seconds.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    println!(
        "{} {:.1} M parameters, {} ({}, {}): {} steps, median {:.1} ms, least {:.1} ms",
        args.config,
        times.parameters as f64 / 1e6,
        args.rule,
        args.dtype,
        args.device,
        sorted.len(),
        median * 1e3,
        sorted[0] * 1e3
    );
    let phase_medians: Vec<String> = bertkit_train::bench::OPTIMIZER_PHASES
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut t: Vec<f64> = times.phases.iter().map(|p| p[i]).collect();
            t.sort_by(f64::total_cmp);
            format!(
                "{name} {:.1} ms",
                t.get(t.len() / 2).copied().unwrap_or(0.0) * 1e3
            )
        })
        .collect();
    println!(
        "phase by phase (each timed apart, the device synchronised around it; medians): {}",
        phase_medians.join(", ")
    );
    Ok(())
}

fn bench_gemm(args: BenchGemmArgs) -> Result<()> {
    let config = bertkit_model::BertConfig::named(&args.config)?;
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let device = bertkit_model::parse_device(&args.device)?;
    println!(
        "{} linear-layer products at {} rows ({}, {}, {} threads)",
        args.config,
        args.rows,
        args.dtype,
        args.device,
        candle_core::utils::get_num_threads()
    );
    let mut peak = 0f64;
    for shape in bertkit_train::bench::model_gemm_shapes(&config, args.rows) {
        let tflops = bertkit_train::bench::gemm_tflops(shape, dtype, &device, args.seconds)?;
        let (m, k, n) = shape;
        println!(
            "  {m:>6} x {k:>5} by {k:>5} x {n:>5}: {:>8.1} GFLOP/s",
            tflops * 1e3
        );
        peak = peak.max(tflops);
    }
    println!(
        "peak {:.4} TFLOP/s ([train] peak_tflops; pretrain measures it itself on the CPU)",
        peak
    );
    Ok(())
}

fn bench_graph(args: BenchGraphArgs) -> Result<()> {
    use bertkit_model::census::{CensusBatch, pretraining};
    let config = bertkit_model::BertConfig::named(&args.config)?;
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let device = bertkit_model::parse_device(&args.device)?;
    let shape = CensusBatch {
        batch: args.batch,
        seq: args.seq,
        predictions: args.predictions,
    };
    println!(
        "{} ({} layers), a pre-training forward pass and loss in training mode, batch {} x {} positions, {} predictions a sequence, {} on {}",
        args.config,
        config.num_hidden_layers,
        args.batch,
        args.seq,
        args.predictions,
        args.dtype,
        args.device
    );
    println!(
        "{:<9} {:>10} {:>10} {:>10} {:>14} {:>12} {:>8} {:>10}",
        "kernels",
        "ops/layer",
        "of nodes",
        "MB/layer",
        "ops elsewhere",
        "MB elsewhere",
        "ops",
        "MB"
    );
    let sets: [(&str, std::sync::Arc<dyn bertkit_model::Kernels>); 2] = [
        ("composed", std::sync::Arc::new(bertkit_model::Composed)),
        (
            "fused",
            std::sync::Arc::new(bertkit_model::Fused::default()),
        ),
    ];
    for (name, kernels) in sets {
        let c = pretraining(&config, kernels, dtype, &device, shape)?;
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "{name:<9} {:>10} {:>10} {:>10.1} {:>14} {:>12.1} {:>8} {:>10.1}",
            c.layer.ops,
            c.layer.nodes,
            mb(c.layer.bytes),
            c.outside_layers.ops,
            mb(c.outside_layers.bytes),
            c.total.ops,
            mb(c.total.bytes)
        );
    }
    println!(
        "(nodes: of the autograd graph; ops: those that write a buffer of their own, not views: on CUDA, kernel launches; MB: those buffers, held until the backward pass)"
    );
    Ok(())
}

fn bench_kernels(args: BenchKernelsArgs) -> Result<()> {
    use bertkit_model::census::{CensusBatch, profile};
    let g = &args.graph;
    let config = bertkit_model::BertConfig::named(&g.config)?;
    let dtype = bertkit_model::parse_dtype(&g.dtype)?;
    let device = bertkit_model::parse_device(&g.device)?;
    if !matches!(args.kernels.as_str(), "fused" | "composed") {
        return Err(format!("--kernels {:?}: fused or composed", args.kernels).into());
    }
    let shape = CensusBatch {
        batch: g.batch,
        seq: g.seq,
        predictions: g.predictions,
    };
    // A training pass on CUDA takes the feed-forward `bertkit pretrain` would at this shape
    // (the plan's, unless --feed-forward names one), so its profile is the step's.
    let feed_forward = (!args.inference)
        .then(|| {
            bertkit_train::plan::settle_feed_forward(
                &config,
                (g.seq, g.batch, 1),
                (dtype, &device),
                bertkit_train::plan::WeightsOnDevice::NotYet,
                args.feed_forward,
            )
        })
        .flatten();
    let kernels: std::sync::Arc<dyn bertkit_model::Kernels> = match args.kernels.as_str() {
        "composed" => std::sync::Arc::new(bertkit_model::Composed),
        _ => match &feed_forward {
            Some(choice) => std::sync::Arc::new(choice.kernels()),
            None => std::sync::Arc::new(bertkit_model::Fused::default()),
        },
    };
    let p = profile(
        &config,
        kernels,
        dtype,
        &device,
        shape,
        args.passes,
        args.inference,
        args.clock,
    )?;
    println!(
        "{} ({} layers), {} kernels, {} at batch {} x {} positions, {} predictions a sequence, {} on {}, mean of {} passes",
        g.config,
        config.num_hidden_layers,
        args.kernels,
        if args.inference {
            "an inference pass (forward and loss, nothing tracked)"
        } else {
            "a training pass (forward, loss, backward)"
        },
        g.batch,
        g.seq,
        g.predictions,
        g.dtype,
        g.device,
        args.passes.max(1)
    );
    if let Some(choice) = feed_forward {
        println!("{choice}");
    }
    println!(
        "{:<22} {:>8} {:>12} {:>12} {:>11} {:>13} {:>13}",
        "", "calls", "forward ms", "of forward", "TFLOP/s", "backward ms", "host ms"
    );
    let ms = |s: f64| s * 1e3;
    let share = |s: f64| 100.0 * s / p.forward_seconds.max(1e-12);
    let mut names: Vec<&str> = p
        .kernels
        .keys()
        .chain(p.backward_kernels.keys())
        .copied()
        .collect();
    names.sort_by(|a, b| {
        let time = |n: &str| {
            p.kernels.get(n).map_or(0.0, |t| t.seconds)
                + p.backward_kernels.get(n).map_or(0.0, |t| t.seconds)
        };
        time(b).total_cmp(&time(a)).then(a.cmp(b))
    });
    names.dedup();
    let cell = |t: Option<&bertkit_model::kernels::KernelTime>| {
        t.map_or("".to_string(), |t| format!("{:.2}", ms(t.seconds)))
    };
    let host_cell = |f: Option<&bertkit_model::kernels::KernelTime>,
                     b: Option<&bertkit_model::kernels::KernelTime>| {
        let host = |t: Option<&bertkit_model::kernels::KernelTime>| {
            t.map(|t| format!("{:.2}", ms(t.host_seconds)))
        };
        match (host(f), host(b)) {
            (Some(f), Some(b)) => format!("{f} + {b}"),
            (Some(f), None) => format!("{f} +"),
            (None, Some(b)) => format!("+ {b}"),
            (None, None) => String::new(),
        }
    };
    for name in &names {
        let forward = p.kernels.get(name);
        let backward = p.backward_kernels.get(name);
        let calls = forward.or(backward).map_or(0, |t| t.calls);
        println!(
            "{name:<22} {calls:>8} {:>12} {:>12} {:>11} {:>13} {:>13}",
            cell(forward),
            forward.map_or("".to_string(), |t| format!("{:.1}%", share(t.seconds))),
            forward.filter(|t| t.flops > 0.0 && t.seconds > 0.0).map_or(
                "".to_string(),
                |t| format!("{:.2}", t.flops / t.seconds / 1e12)
            ),
            cell(backward),
            host_cell(forward, backward),
        );
    }
    let in_kernels: f64 = p.kernels.values().map(|t| t.seconds).sum();
    let in_backwards: f64 = p.backward_kernels.values().map(|t| t.seconds).sum();
    let host_in = |t: &std::collections::BTreeMap<&str, bertkit_model::kernels::KernelTime>| {
        t.values().map(|t| t.host_seconds).sum::<f64>()
    };
    let (host_forward, host_backward) = p.host_seconds;
    println!(
        "{:<22} {:>8} {:>12.2} {:>11.1}% {:>11} {:>13.2} {:>13}",
        "outside the kernels",
        "",
        ms(p.forward_seconds - in_kernels),
        share(p.forward_seconds - in_kernels),
        "",
        ms(p.backward_seconds - in_backwards),
        format!(
            "{:.2} + {:.2}",
            ms(host_forward - host_in(&p.kernels)),
            ms(host_backward - host_in(&p.backward_kernels))
        ),
    );
    let flops: f64 = p.kernels.values().map(|t| t.flops).sum();
    println!(
        "{:<22} {:>8} {:>12.2} {:>12} {:>11.2} {:>13.2} {:>13}",
        "total",
        "",
        ms(p.forward_seconds),
        "",
        flops / p.forward_seconds.max(1e-12) / 1e12,
        ms(p.backward_seconds),
        format!("{:.2} + {:.2}", ms(host_forward), ms(host_backward)),
    );
    println!(
        "(each kernel call and each fused op's backward timed {}; TFLOP/s: the kernel's matrix products (the linear layers', attention's within each sequence) over its time, the whole forward pass's over the pass; outside the kernels: forward, the embeddings, gathers, heads and loss; backward, the encoder's gradients added where two meet (a residual) and the embeddings', heads' and loss's backward in candle's autograd; where the kernels do not record, the encoder's too: a zeroed gradient and an addition per graph edge; host ms: the host's time in the calls, forward + backward, {})",
        match p.clock {
            bertkit_model::kernels::Clock::Synchronised =>
                "with the device synchronised around it (the host's clock)",
            bertkit_model::kernels::Clock::Events =>
                "by events on the device's stream (its own time, the host launching ahead; on the CPU the host's clock)",
        },
        match (p.clock, device.is_cuda()) {
            (bertkit_model::kernels::Clock::Events, true) =>
                "issuing them (launches, allocations, the ops' host work): a part whose host time nears the device's is bound by the host",
            _ => "their whole time (the host waits for each)",
        }
    );
    Ok(())
}

fn bench_inference(args: BenchInferenceArgs) -> Result<()> {
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let device = bertkit_model::parse_device(&args.device)?;
    println!("{} ({}, {})", args.model.display(), args.dtype, args.device);
    println!(
        "{:>6} {:>6} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "seq", "batch", "runs", "seq/s", "p50 ms", "p90 ms", "p99 ms", "issue ms"
    );
    let settings = bertkit_tasks::inference::BenchSettings {
        seqs: args.seq.clone(),
        batches: args.batch.clone(),
        dtype,
        min_seconds: args.seconds,
        composed: args.composed,
    };
    bertkit_tasks::inference::bench(&args.model, &settings, &device, &mut |r| {
        println!(
            "{:>6} {:>6} {:>6} {:>10.1} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            r.seq,
            r.batch,
            r.runs,
            r.sequences_per_s,
            r.latency_ms[0],
            r.latency_ms[1],
            r.latency_ms[2],
            r.issue_ms
        )
    })?;
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
