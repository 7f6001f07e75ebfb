//! `convert`: Google's TensorFlow checkpoints to and from model folders.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::flags::model::{
    CheckCheckpointArgs, CheckCommand, CheckKernelsArgs, ConvertCommand, TfCheckpointArgs,
    ToTfCheckpointArgs,
};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub(crate) fn convert(command: ConvertCommand) -> Result<()> {
    match command {
        ConvertCommand::TfCheckpoint(args) => from_tf(args),
        ConvertCommand::ToTfCheckpoint(args) => to_tf(args),
    }
}

/// The folder a checkpoint path (prefix, .index or folder) lives in.
fn checkpoint_folder(checkpoint: &Path) -> Result<PathBuf> {
    let prefix = bertkit_tf_checkpoint::resolve_prefix(checkpoint)?;
    Ok(prefix
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".")))
}

fn from_tf(args: TfCheckpointArgs) -> Result<()> {
    let started = Instant::now();
    let folder = checkpoint_folder(&args.checkpoint)?;
    let config = args
        .config
        .unwrap_or_else(|| folder.join("bert_config.json"));
    let vocab = args
        .vocab
        .or_else(|| Some(folder.join("vocab.txt")).filter(|v| v.is_file()));
    let done = bertkit_model::google::convert_from_tf(
        &args.checkpoint,
        &config,
        vocab.as_deref(),
        &args.output,
    )?;
    println!(
        "{}: a {} of {} tensors ({} values, f32, GELU as Google computes it: gelu_new); skipped {} optimizer and step variables ({:.1} s)",
        args.output.display(),
        done.architecture,
        done.parameters,
        done.values,
        done.skipped_training_state,
        started.elapsed().as_secs_f64()
    );
    if !done.vocab_copied {
        eprintln!(
            "warning: no vocab.txt beside {}: put the model's vocabulary in {} (--vocab) before fine-tuning",
            args.checkpoint.display(),
            args.output.display()
        );
    }
    Ok(())
}

fn to_tf(args: ToTfCheckpointArgs) -> Result<()> {
    let started = Instant::now();
    let model = bertkit_tasks::model_dir::resolve(&args.model)?;
    let done = bertkit_model::google::convert_to_tf(&model, &args.output)?;
    println!(
        "{}: {} variables, {:.1} MB, with bert_config.json{} ({:.1} s)",
        done.prefix.display(),
        done.variables,
        done.bytes as f64 / 1e6,
        if done.vocab_copied {
            " and vocab.txt"
        } else {
            ""
        },
        started.elapsed().as_secs_f64()
    );
    if done.gelu_changes {
        eprintln!(
            "note: {} computes the exact GELU; Google's modeling.py computes the tanh form, so its outputs there differ slightly (about 1e-4)",
            args.model.display()
        );
    }
    if !done.vocab_copied {
        eprintln!(
            "warning: {} has no vocab.txt: Google's scripts need one beside the checkpoint",
            args.model.display()
        );
    }
    Ok(())
}

pub(crate) fn check(command: CheckCommand) -> Result<()> {
    match command {
        CheckCommand::Kernels(args) => check_kernels(args),
        CheckCommand::Checkpoint(args) => check_checkpoint(args),
    }
}

fn check_checkpoint(args: CheckCheckpointArgs) -> Result<()> {
    use bertkit_train::checkpoint::{Verified, list, verify};
    let all = list(&args.run);
    if all.is_empty() {
        return Err(format!("{}: no checkpoint (checkpoints/step-N)", args.run.display()).into());
    }
    let mut damaged = Vec::new();
    for (step, dir) in &all {
        match verify(dir) {
            Ok(Verified::Whole(files)) => println!("step {step}: ok ({files} files as recorded)"),
            Ok(Verified::Unrecorded) => {
                println!("step {step}: not checked (written before checkpoints recorded digests)")
            }
            Err(e) => {
                println!("step {step}: damaged: {e}");
                damaged.push(format!("step {step}: {e}"));
            }
        }
    }
    if !damaged.is_empty() {
        return Err(format!(
            "{} of {} checkpoints damaged ({})",
            damaged.len(),
            all.len(),
            damaged.join("; ")
        )
        .into());
    }
    Ok(())
}

/// One line of `bertkit check kernels`: a kernel's value, its worst difference and the bound;
/// or, where it could not run, its error.
fn print_check(c: &bertkit_model::kernels::check::KernelCheck) {
    let value = if c.gradient {
        format!("d{}", c.value)
    } else {
        c.value.to_string()
    };
    match &c.error {
        Some(error) => println!(
            "  {:<40} {:<9} {:<12} {:>11} {:>10} FAILED: {error}",
            c.kernel, c.shape, value, "", ""
        ),
        None => println!(
            "  {:<40} {:<9} {:<12} {:>11.3e} {:>10.1e} {}",
            c.kernel,
            c.shape,
            value,
            c.worst,
            c.tolerance,
            if c.passed() { "ok" } else { "FAILED" }
        ),
    }
}

fn check_kernels(args: CheckKernelsArgs) -> Result<()> {
    use bertkit_model::kernels::check::{CheckShape, KernelCheck, check_kernels, device_broken};
    let device = bertkit_model::parse_device(&args.device)?;
    let reference = if device.is_cpu() {
        "the composed ops in f64 on the CPU"
    } else {
        "the fused kernels in f32 on the CPU (their twins)"
    };
    let shapes = CheckShape::defaults();
    let mut all = Vec::new();
    let mut dtypes = Vec::new();
    let mut broken = None;
    for name in args
        .dtype
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        let dtype = bertkit_model::parse_dtype(name)?;
        dtypes.push(dtype);
        println!(
            "fused kernels on {} in {name} against {reference}:",
            args.device
        );
        println!(
            "  {:<40} {:<9} {:<12} {:>11} {:>10}",
            "kernel", "shape", "value", "worst", "bound"
        );
        let started = Instant::now();
        // Each group's lines as it ends; where a kernel's error broke the device, the checks
        // stop there (what is left is not run, so not turned on).
        let groups: [&dyn Fn() -> Result<Vec<KernelCheck>>; 3] = [
            &|| Ok(check_kernels(&device, dtype, &shapes)?),
            &|| {
                Ok(bertkit_model::encoder_check::check_encoder_backward(
                    &device, dtype, &shapes,
                )?)
            },
            // The optimiser's state is f32 whatever the model's dtype.
            &|| {
                Ok(if dtype == candle_core::DType::F32 {
                    bertkit_train::check::check_update(&device)?
                } else {
                    Vec::new()
                })
            },
        ];
        for group in groups {
            let checks = group()?;
            let errors = checks.iter().any(|c| c.error.is_some());
            for c in checks {
                print_check(&c);
                all.push(c);
            }
            if errors && let Some(e) = device_broken(&device) {
                broken = Some(e);
                break;
            }
        }
        println!("  ({:.1} s)", started.elapsed().as_secs_f64());
        if let Some(e) = &broken {
            println!(
                "the device failed after the kernel that could not run ({e}): the checks after it did not run"
            );
            break;
        }
    }
    let (checked, failed) = (all.len(), all.iter().filter(|c| !c.passed()).count());
    if failed == 0 {
        println!("all {checked} kernel values within bounds");
    }
    // Not a kernel of ours: which GELU cuBLASLt's epilogue computes (BERT's is the erf form),
    // for the planning of what its gradient's epilogue could take over.
    if device.is_cuda() && broken.is_none() {
        match bertkit_model::kernels::check::cuda_gelu_epilogue(&device) {
            Ok(Some(probe)) => println!(
                "cuBLASLt's GELU epilogue (f32, values in [-6, 6]): {:.1e} from the erf form, {:.1e} from the tanh approximation: {}",
                probe.from_erf,
                probe.from_tanh,
                match probe.form() {
                    Some(bertkit_model::Gelu::Erf) => "the erf form",
                    Some(bertkit_model::Gelu::Tanh) => "the tanh approximation",
                    None => "neither closely",
                }
            ),
            Ok(None) => {}
            Err(e) => println!("cuBLASLt's GELU epilogue: not probed ({e})"),
        }
    }
    if failed > 0 {
        return Err(format!("{failed} of {checked} kernel values out of bounds").into());
    }
    Ok(())
}
