//! `bertkit check kernels` on the CPU: each fused kernel against the composed ops in f64,
//! values and every input's gradient, through the same code a GPU run takes.

use bertkit_model::kernels::check::{CheckShape, check_kernels, tolerance};
use candle_core::{DType, Device};

#[test]
fn every_fused_cpu_kernel_matches_the_composed_ops_in_f64() {
    let shapes = CheckShape::defaults();
    let checks = check_kernels(&Device::Cpu, DType::F32, &shapes[..1]).unwrap();
    // 11 kernels: an output and each input's gradient (1 + 3 + 3 × 3 + 1 + 5 + 1 + 1 + 1 + 4
    // inputs; the one-pass attention's rows only on CUDA).
    assert_eq!(checks.len(), 11 + 26, "{checks:#?}");
    for c in &checks {
        assert!(c.passed(), "{c:?}");
        if c.kernel == "gather_rows" && !c.gradient {
            // Copied rows: exact in any dtype.
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
