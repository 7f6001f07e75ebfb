//! `bertkit bench`: the all-reduce, a step's memory, the optimiser, the model's products, its
//! graph, its kernels and inference, each a measurement the library makes, printed.

use crate::flags::train::*;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

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
