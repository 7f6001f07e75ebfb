//! The optimiser's update checked against its reference (`bertkit check kernels`): the CUDA
//! update against the CPU's, the CPU's against the composed update in f64. Outside the step's
//! code: it reads its results back to compare them.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, Var};

use crate::TrainError;
use crate::bucket::StepGradients;
use crate::optim::{Optimizer, OptimizerConfig, Rule};

/// The optimiser update on `device` against its reference, as `bertkit check kernels` reports
/// kernels ([`bertkit_model::kernels::check`]): two steps of LAMB and of AdamW (the second
/// clipped) over parameters with and without weight decay, one spanning several of the CUDA
/// kernels' blocks, one without a gradient at the first step, from the same weights and
/// gradients (two micro-batches a step, summed at a loss scale as a step sums them); each
/// step's squared gradient norm, and the weights, both moments and the parameters after them,
/// against the reference's. On a CUDA device the reference is the CPU's one-pass update in f32
/// (the twin), which the CUDA update (the bucket gathered and the parameters set by its
/// kernels) is checked against with f32 and bf16 parameters and gradients, with the bucket and
/// without it ([`Optimizer::hold_gradients`]: one micro-batch a step, its gradients read where
/// they are held, against the reference's bucket of the same one); on the CPU it is the
/// composed update in f64, which the CPU's update with and without a bucket is checked against.
pub fn check_update(
    device: &candle_core::Device,
) -> Result<Vec<bertkit_model::kernels::check::KernelCheck>, TrainError> {
    use bertkit_model::kernels::check::{KernelCheck, device_broken, tolerance, values, worst};
    const SHAPE: &str = "4 params";
    use candle_core::Device;
    let shapes: [(&str, &[usize]); 4] = [
        ("encoder.layer.0.attention.self.query.weight", &[64, 48]),
        ("encoder.layer.0.attention.self.query.bias", &[48]),
        ("encoder.layer.0.attention.output.LayerNorm.weight", &[48]),
        ("encoder.layer.0.intermediate.dense.weight", &[300, 512]),
    ];
    // Two steps on `device` in `dtype` of `micro_batches` each (`held`: one, its gradients
    // read without the bucket): the state afterwards, by name, in f64 on the CPU.
    let run = |rule: Rule,
               device: &Device,
               dtype: DType,
               micro_batches: u64,
               held: bool|
     -> Result<BTreeMap<String, Tensor>, TrainError> {
        let mut vars = BTreeMap::new();
        for (i, (name, dims)) in shapes.iter().enumerate() {
            let w = values(dims, 0.5, i as u64, DType::F32)?
                .to_dtype(dtype)?
                .to_device(device)?;
            vars.insert(name.to_string(), Var::from_tensor(&w)?);
        }
        let config = OptimizerConfig {
            rule,
            ..OptimizerConfig::lamb()
        };
        let mut optimizer = Optimizer::new(config, &vars)?;
        optimizer.hold_gradients(held);
        let mut norms = Vec::new();
        for (step, clip) in [(0u64, 1.0), (1, 0.5)] {
            // The micro-batches' gradients at a loss scale of 4, as a step sums them.
            let mut sums = optimizer.gradient_sums(4.0);
            for micro in 0..micro_batches {
                for (i, (name, dims)) in shapes.iter().enumerate() {
                    if step == 0 && i == 2 {
                        continue; // no gradient: zeros in the bucket
                    }
                    let seed = 100 + 10 * step + 5 * micro + i as u64;
                    let g = values(dims, 0.4, seed, DType::F32)?;
                    sums.add(name, &g.to_dtype(dtype)?.to_device(device)?)?;
                }
            }
            let gradients = optimizer.step_gradients(sums, optimizer.holds_gradients())?;
            if held != matches!(gradients, StepGradients::Held { .. }) {
                return Err(TrainError::Config(format!(
                    "check_update: the gradients {}held, where the form says {held}",
                    if held { "not " } else { "" }
                )));
            }
            norms.push(
                optimizer
                    .squared_norm_of(&gradients)?
                    .to_device(&Device::Cpu)?,
            );
            optimizer.update(&gradients, 1e-2, clip)?;
        }
        let mut state = optimizer.master_tensors()?;
        state.insert("norm".into(), Tensor::stack(&norms, 0)?);
        state.extend(optimizer.moment_tensors()?);
        for (name, var) in &vars {
            state.insert(
                format!("param.{name}"),
                var.as_tensor().to_device(&Device::Cpu)?,
            );
        }
        state
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_dtype(DType::F64)?)))
            .collect()
    };
    let mut checks = Vec::new();
    // (the gradients held, the row's name, the parameters' dtype)
    let forms: &[(bool, &str, DType)] = if device.is_cuda() {
        &[
            (false, "", DType::F32),
            (false, ", bf16", DType::BF16),
            (true, " without a bucket", DType::F32),
            (true, " without a bucket, bf16", DType::BF16),
        ]
    } else {
        &[
            (false, "", DType::F32),
            (true, " without a bucket", DType::F32),
        ]
    };
    for (rule, name) in [(Rule::Lamb, "LAMB"), (Rule::Adamw, "AdamW")] {
        for &(held, form, dtype) in forms {
            let kernel = format!("optimizer update{form} ({name})");
            // The CPU's f32 update (the twin) on CUDA, the composed one in f64 on the CPU.
            let lines = || -> Result<Vec<KernelCheck>, TrainError> {
                // (The reference with the bucket, as many micro-batches a step.)
                let micro_batches = if held { 1 } else { 2 };
                let want = run(
                    rule,
                    &Device::Cpu,
                    if device.is_cpu() { DType::F64 } else { dtype },
                    micro_batches,
                    false,
                )?;
                let got = run(rule, device, dtype, micro_batches, held)?;
                let mut lines = Vec::new();
                for (value, prefix) in [
                    ("weights", ""),
                    ("m", "m."),
                    ("v", "v."),
                    ("parameters", "param."),
                ] {
                    // Every parameter's values side by side: one comparison over all of them.
                    let side = |state: &BTreeMap<String, Tensor>| -> Result<Tensor, TrainError> {
                        let mut parts = Vec::with_capacity(shapes.len());
                        for (name, _) in &shapes {
                            let key = format!("{prefix}{name}");
                            let Some(t) = state.get(&key) else {
                                return Err(TrainError::Config(format!("check_update: no {key}")));
                            };
                            parts.push(t.flatten_all()?);
                        }
                        Ok(Tensor::cat(&parts, 0)?)
                    };
                    lines.push(KernelCheck {
                        kernel: kernel.clone(),
                        shape: SHAPE,
                        value,
                        gradient: false,
                        worst: worst(&side(&got)?, &side(&want)?)?,
                        tolerance: tolerance(if prefix == "param." {
                            dtype
                        } else {
                            DType::F32
                        }),
                        error: None,
                    });
                }
                // The squared gradient norm of each step's bucket.
                lines.push(KernelCheck {
                    kernel: kernel.clone(),
                    shape: SHAPE,
                    value: "squared norm",
                    gradient: false,
                    worst: worst(&got["norm"], &want["norm"])?,
                    tolerance: tolerance(DType::F32),
                    error: None,
                });
                Ok(lines)
            };
            match lines() {
                Ok(lines) => checks.extend(lines),
                Err(e) => {
                    checks.push(KernelCheck::not_run(kernel, SHAPE, &e));
                    if device_broken(device).is_some() {
                        return Ok(checks);
                    }
                }
            }
        }
    }
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `check_update` on the CPU: the one-pass f32 update against the composed one in f64,
    /// weights, both moments, the parameters and the gradient norms after two steps of each
    /// rule; close, but not equal (not vacuous).
    #[test]
    fn the_update_check_passes_on_the_cpu() {
        let checks = check_update(&candle_core::Device::Cpu).unwrap();
        assert_eq!(checks.len(), 20, "{checks:?}");
        for c in &checks {
            assert!(c.passed() && !c.gradient, "{c:?}");
            assert!(c.worst > 0.0 && c.worst < c.tolerance / 10.0, "{c:?}");
        }
    }
}
