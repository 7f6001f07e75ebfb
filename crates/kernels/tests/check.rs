//! `bertkit check kernels` on the CPU: each fused kernel against the composed ops in f64,
//! values and every input's gradient, through the same code a GPU run takes.

use bertkit_kernels::check::{CheckShape, check_kernels, tolerance};
use candle_core::{DType, Device};

#[test]
fn every_fused_cpu_kernel_matches_the_composed_ops_in_f64() {
    let shapes = CheckShape::defaults();
    let checks = check_kernels(&Device::Cpu, DType::F32, &shapes[..1]).unwrap();
    // 19 kernels: an output and each input's gradient (1 + 5 + 3 + 2 + 2 + 1 + 3 + 4 × 4 + 1 +
    // 5 + 1 + 1 + 1 + 4 inputs; the one-pass attention's rows and LayerNorm's other forms only
    // on CUDA).
    assert_eq!(checks.len(), 19 + 46, "{checks:#?}");
    for c in &checks {
        assert!(c.passed(), "{c:?}");
        if (c.kernel == "gather_rows" && !c.gradient)
            || (c.kernel == "add" && c.gradient)
            || c.kernel.starts_with("join")
        {
            // Copied rows, a sum's gradient passed through, joined rows and their gradients'
            // views: exact in any dtype.
            assert_eq!(c.worst, 0.0, "{c:?}");
            continue;
        }
        // Not vacuous: f32 against f64 differs somewhere, and well inside the bound.
        assert!(
            c.worst > 0.0 && c.worst < tolerance(DType::F32) / 10.0,
            "{c:?}"
        );
    }
    let kernels: std::collections::BTreeSet<&str> =
        checks.iter().map(|c| c.kernel.as_str()).collect();
    for k in [
        "gather_rows",
        "embeddings",
        "layer_norm",
        "attention (dropout)",
        "residual_layer_norm (dropout)",
        "linear_gelu (tanh)",
        "feed_forward (erf)",
        "nll",
    ] {
        assert!(kernels.contains(k), "{k} not checked");
    }
}

/// A kernel that fails to run (here attention, given a width its heads do not divide) is a
/// failed line with its error; the kernels after it are still checked.
#[test]
fn a_kernel_that_fails_to_run_is_a_failed_line_and_the_check_goes_on() {
    let shape = CheckShape {
        name: "odd-heads",
        heads: 5,
        ..CheckShape::defaults().remove(0)
    };
    let checks = check_kernels(&Device::Cpu, DType::F32, &[shape]).unwrap();
    let errors: Vec<_> = checks.iter().filter(|c| c.error.is_some()).collect();
    assert_eq!(
        errors.iter().map(|c| c.kernel.as_str()).collect::<Vec<_>>(),
        ["attention (eval)", "attention (dropout)"],
        "{checks:#?}"
    );
    for c in &errors {
        assert!(!c.passed(), "{c:?}");
        assert!(c.error.as_deref().is_some_and(|e| !e.is_empty()), "{c:?}");
    }
    // The kernels before and after attention ran and passed.
    for kernel in ["layer_norm", "nll", "residual_layer_norm (dropout)"] {
        assert!(
            checks
                .iter()
                .any(|c| c.kernel == kernel && c.passed() && c.error.is_none()),
            "{kernel}: {checks:#?}"
        );
    }
    assert!(bertkit_kernels::check::device_broken(&Device::Cpu).is_none());
}

/// In bf16 on the CPU (candle's products, our kernels computing in f32 elsewhere) every
/// kernel passes at every shape `bertkit check kernels` runs, and the bias gradients of the
/// linear layers, summed over up to 778 rows, keep to half precision's rounding: candle's
/// sums of a bf16 tensor in bf16 were off by up to 7.3e-2 of the largest magnitude (1.1e-2
/// at the small shape's 58 rows).
#[test]
fn in_bf16_on_the_cpu_the_bias_gradients_are_summed_in_f32() {
    let checks = check_kernels(&Device::Cpu, DType::BF16, &CheckShape::defaults()).unwrap();
    for c in &checks {
        assert!(c.passed(), "{c:?}");
    }
    let biases: Vec<_> = checks
        .iter()
        .filter(|c| c.value.starts_with("bias") && c.gradient)
        .filter(|c| c.kernel != "layer_norm" && c.kernel != "embeddings")
        .filter(|c| !c.kernel.starts_with("join"))
        .filter(|c| !c.kernel.starts_with("residual_layer_norm"))
        .collect();
    // linear, linear (wide), linear (f32 weight), linear_gelu (erf, tanh) and feed_forward's
    // two, at three shapes.
    assert_eq!(biases.len(), 21, "{biases:#?}");
    for c in biases {
        assert!(c.worst < 8e-3, "{c:?}");
    }
}
