//! A training step waits for the device once: the only read-back (`to_vec*`, `to_scalar`, a
//! copy to the CPU) in the code an optimiser step runs is [`bertkit_train::step::Step::finish`]'s
//! single transfer of the loss, the gradient norm and the tracked figures. On CUDA every other
//! read would be a host sync stalling the queue (before the flat optimiser, a BERT-base LAMB
//! step made ~570 of them). This test reads the sources: a read-back added to any of these
//! files fails it until it is listed here with its reason.

use std::collections::BTreeMap;

use bertkit_test_support::repo_root;

/// The files a pre-training or fine-tuning step runs, and the functions in them allowed to
/// read back, with how many reads each holds.
const STEP_CODE: &[(&str, &[(&str, usize)])] = &[
    // The step's one transfer.
    ("crates/train/src/step.rs", &[("finish", 1)]),
    // Checkpoints copy the state to the CPU (every `checkpoint_every` steps, not per step).
    ("crates/train/src/optim.rs", &[("by_name", 1)]),
    // The held-out evaluation reads its summed figures once per evaluation (every
    // `[eval] every` steps), not per step.
    ("crates/train/src/trainer.rs", &[("evaluate", 1)]),
    ("crates/tasks/src/training.rs", &[]),
    // `Inputs::new` takes tensors and reads them back to check them; training builds its
    // inputs from host data (`Inputs::from_host`) instead.
    (
        "crates/model/src/bert/inputs.rs",
        &[("host_integers", 1), ("new", 1)],
    ),
    ("crates/model/src/bert.rs", &[]),
    ("crates/model/src/bert/heads.rs", &[]),
    // The packing of the tokens is computed on the host when the inputs are built.
    ("crates/kernels/src/lib.rs", &[]),
    ("crates/kernels/src/composed.rs", &[]),
    ("crates/kernels/src/packing.rs", &[]),
    ("crates/kernels/src/dropout.rs", &[]),
    ("crates/model/src/loss.rs", &[]),
    ("crates/kernels/src/nll.rs", &[]),
    // The CUDA kernels' launchers and the optimiser's CUDA update.
    ("crates/kernels/src/cuda/mod.rs", &[]),
    ("crates/kernels/src/cuda/attention.rs", &[]),
    ("crates/kernels/src/cuda/linear.rs", &[]),
    ("crates/kernels/src/cuda/lt.rs", &[]),
    ("crates/kernels/src/cuda/bias_act.rs", &[]),
    ("crates/kernels/src/cuda/norm.rs", &[]),
    ("crates/train/src/cuda_update.rs", &[]),
];

const READS: &[&str] = &[
    ".to_vec0",
    ".to_vec1",
    ".to_vec2",
    ".to_vec3",
    ".to_scalar",
    ".to_device(&Device::Cpu)",
    ".to_device(&candle_core::Device::Cpu)",
];

/// (function, read-backs) in a source file's non-test code.
fn reads(source: &str) -> BTreeMap<String, usize> {
    let code = source.split("#[cfg(test)]").next().unwrap_or("");
    let mut found = BTreeMap::new();
    let mut function = String::from("(top level)");
    for line in code.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        let mut signature = trimmed;
        for qualifier in ["pub(crate) ", "pub ", "const ", "unsafe ", "async "] {
            signature = signature.strip_prefix(qualifier).unwrap_or(signature);
        }
        if let Some(rest) = signature.strip_prefix("fn ") {
            function = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
        }
        let n = READS.iter().filter(|r| line.contains(*r)).count();
        if n > 0 {
            *found.entry(function.clone()).or_insert(0) += n;
        }
    }
    found
}

#[test]
fn a_training_step_reads_back_from_the_device_once() {
    for (file, allowed) in STEP_CODE {
        let source = std::fs::read_to_string(repo_root().join(file)).unwrap();
        let found = reads(&source);
        let allowed: BTreeMap<String, usize> =
            allowed.iter().map(|(f, n)| (f.to_string(), *n)).collect();
        assert_eq!(found, allowed, "read-backs in {file}");
    }
}

#[test]
fn the_scan_finds_reads_and_their_functions() {
    let source = "
pub fn finish(&self) -> f64 {
    // a comment: .to_scalar
    let x = t.to_vec1::<f64>()?;
    x[0]
}
fn other() {}
pub(crate) fn copy(t: &Tensor) { t.to_device(&Device::Cpu) }
fn make() { Tensor::from_vec(v, 3, &Device::Cpu) }
#[cfg(test)]
mod tests { fn t() { x.to_scalar() } }
";
    let found = reads(source);
    assert_eq!(
        found,
        BTreeMap::from([("finish".to_string(), 1), ("copy".to_string(), 1)])
    );
}
