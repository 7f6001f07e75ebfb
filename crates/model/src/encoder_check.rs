//! The encoder's backward pass by hand against candle's autograd, on one device
//! (`bertkit check kernels` reports it beside the kernels).
//!
//! Two encoder layers at a [`CheckShape`]'s widths run on the device in the dtype asked for,
//! with dropout on, twice from the same input and masks: once recorded on the kernels' tape
//! with the backward run by hand ([`BertModel::encode_taped`]), once under candle's autograd
//! over the same kernels. The outputs must be the same and the gradients (the input's and
//! every parameter's) the same up to where a residual's two gradients are added; the kernels
//! themselves are checked against their twins by [`crate::kernels::check`].

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::bert::{BertModel, Inputs, Mode, init};
use crate::dropout::DropoutSource;
use crate::kernels::check::{CheckShape, KernelCheck, device_broken, tolerance, values, worst};
use crate::kernels::{Fused, KernelOptions};
use crate::{BertConfig, ModelError};

/// The name the report gives the check.
pub const NAME: &str = "encoder backward by hand";
/// Its name with the one-pass attention ([`KernelOptions::one_pass_attention`]).
pub const FLASH_NAME: &str = "encoder backward by hand (flash)";

fn model_error(e: ModelError) -> candle_core::Error {
    match e {
        ModelError::Candle(e) => e,
        other => candle_core::Error::Msg(other.to_string()),
    }
}

/// Checks the encoder's backward by hand against autograd on `device` in `dtype` at each of
/// `shapes`: an output line, the input's gradient and the worst of the parameters'. Nothing
/// when the default kernels do not record in `dtype` on `device` (they run under autograd
/// there, so there is nothing to compare). The attention runs around cuBLAS's products; on a
/// CUDA device in bf16 the shapes with heads of 64 are checked a second time with the
/// one-pass attention ([`FLASH_NAME`]).
pub fn check_encoder_backward(
    device: &Device,
    dtype: DType,
    shapes: &[CheckShape],
) -> Result<Vec<KernelCheck>> {
    let kernels = |one_pass_attention| {
        Fused::with(KernelOptions {
            one_pass_attention,
            ..KernelOptions::default()
        })
    };
    let mut checks = Vec::new();
    for shape in shapes {
        match check_shape(device, dtype, shape, NAME, kernels(false), &mut checks) {
            Ok(true) => {}
            Ok(false) => return Ok(Vec::new()),
            Err(e) => {
                if not_run(device, shape, NAME, &e, &mut checks) {
                    return Ok(checks);
                }
            }
        }
        if device.is_cuda() && dtype == DType::BF16 && shape.hidden == 64 * shape.heads {
            let checked = check_shape(device, dtype, shape, FLASH_NAME, kernels(true), &mut checks);
            if let Err(e) = checked
                && not_run(device, shape, FLASH_NAME, &e, &mut checks)
            {
                return Ok(checks);
            }
        }
    }
    Ok(checks)
}

/// Reports `check` at `shape` as not run (`error`); whether the device broke (the check
/// stops).
fn not_run(
    device: &Device,
    shape: &CheckShape,
    check: &'static str,
    error: &candle_core::Error,
    checks: &mut Vec<KernelCheck>,
) -> bool {
    checks.push(KernelCheck::not_run(check.to_string(), shape.name, error));
    device_broken(device).is_some()
}

/// One shape of [`check_encoder_backward`] with `kernels`, reported as `check`: false when the
/// kernels do not record there.
fn check_shape(
    device: &Device,
    dtype: DType,
    shape: &CheckShape,
    check: &'static str,
    kernels: Fused,
    checks: &mut Vec<KernelCheck>,
) -> Result<bool> {
    let Some(both) = both_ways(device, dtype, shape, check, kernels)? else {
        return Ok(false);
    };
    let mut line = |value: &'static str, gradient: bool, worst: f64| {
        checks.push(KernelCheck {
            kernel: check.to_string(),
            shape: shape.name,
            value,
            gradient,
            worst,
            tolerance: tolerance(dtype),
            error: None,
        })
    };
    line("output", false, worst(&both.output.0, &both.output.1)?);
    line("x", true, worst(&both.input.0, &both.input.1)?);
    let (params, farthest) = farthest_off(&both.params);
    line("params", true, params);
    if let Some(last) = checks.last_mut()
        && !last.passed()
    {
        last.kernel = format!("{} (farthest: {farthest})", last.kernel);
    }
    Ok(true)
}

/// Two encoder layers' pass both ways (see the module's documentation), in f64 on the CPU:
/// the output and the input's gradient (by hand, by autograd) and each parameter's gradient.
struct BothWays {
    output: (Tensor, Tensor),
    input: (Tensor, Tensor),
    params: Vec<ParamGradients>,
}

/// [`BothWays`] at `shape`: `None` when the kernels do not record there.
fn both_ways(
    device: &Device,
    dtype: DType,
    shape: &CheckShape,
    check: &str,
    kernels: Fused,
) -> Result<Option<BothWays>> {
    let config = BertConfig {
        vocab_size: 8,
        hidden_size: shape.hidden,
        num_hidden_layers: 2,
        num_attention_heads: shape.heads,
        intermediate_size: shape.intermediate,
        max_position_embeddings: shape.seq,
        ..BertConfig::tiny(8)
    };
    let mut loaded = init::<BertModel>(&config, dtype, device, 21).map_err(model_error)?;
    loaded.model.set_kernels(std::sync::Arc::new(kernels));
    let bert = &loaded.model;
    let (batch, seq) = (shape.lengths.len(), shape.seq);
    let mask = shape.mask();
    let ids = vec![1u32; batch * seq];
    let inputs = Inputs::from_host(&config, (batch, seq), &ids, None, Some(&mask), device)
        .map_err(model_error)?;
    let tokens = shape.tokens();
    let on_device = |t: Tensor| t.to_device(device)?.to_dtype(dtype);
    let x = on_device(values(&[tokens, shape.hidden], 2.0, 7, dtype)?)?;
    let upstream = on_device(values(&[tokens, shape.hidden], 1.0, 8, dtype)?)?;
    let source = DropoutSource::new(5);
    source.start_batch(0, 0);
    let mode = Mode::Train(&source);

    let (y, backward) = bert
        .encode_taped(&x, &inputs, 0..2, mode)
        .map_err(model_error)?;
    if !backward.by_hand() {
        return Ok(None);
    }
    let (grad_x, grads) = backward.backward(&upstream).map_err(model_error)?;

    source.start_batch(0, 0);
    let input = Var::from_tensor(&x)?;
    let reference = bert
        .encode(input.as_tensor(), &inputs, 0..2, mode)
        .map_err(model_error)?;
    let store = crate::bert::backward_from(&reference, &upstream)?;

    let f64_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F64);
    let Some(want) = store.get(input.as_tensor()) else {
        candle_core::bail!("{check}: autograd gave the input no gradient")
    };
    let mut params = Vec::new();
    for (name, var) in loaded.params.vars() {
        if !name.starts_with("encoder.layer.") {
            continue;
        }
        let (Some(ours), Some(theirs)) = (grads.get(var.as_tensor()), store.get(var.as_tensor()))
        else {
            candle_core::bail!("{check}: no gradient for {name}")
        };
        let flat = |t: &Tensor| f64_cpu(t)?.flatten_all()?.to_vec1::<f64>();
        params.push(ParamGradients {
            name: name.clone(),
            rank: var.as_tensor().rank(),
            ours: flat(ours)?,
            theirs: flat(theirs)?,
        });
    }
    Ok(Some(BothWays {
        output: (f64_cpu(&y)?, f64_cpu(&reference)?),
        input: (f64_cpu(&grad_x)?, f64_cpu(want)?),
        params,
    }))
}

/// One parameter's gradient both ways: by hand (`ours`) and by autograd (`theirs`).
struct ParamGradients {
    name: String,
    rank: usize,
    ours: Vec<f64>,
    theirs: Vec<f64>,
}

/// The parameters' worst difference and whose it is: each parameter's largest `|ours -
/// theirs|` over the largest `|theirs|` among the parameters of its rank (the biases and
/// LayerNorms' vectors together, the weights together), not over its own. The attention's key
/// bias has a gradient of zero in exact arithmetic (the softmax's backward sums to zero over
/// each query's keys, and the bias adds the same to each of them): both ways it is rounding
/// noise, and over its own largest value any change in where the rounding falls (a residual's
/// gradient added by the product that makes the other, rounded once where the tape rounded
/// twice) reads as a difference of ~100%. A NaN anywhere gives NaN.
fn farthest_off(params: &[ParamGradients]) -> (f64, String) {
    // Each rank's largest `|theirs|`, once.
    let mut largest = std::collections::BTreeMap::<usize, f64>::new();
    for p in params {
        let scale = largest.entry(p.rank).or_insert(f64::MIN_POSITIVE);
        *scale = p.theirs.iter().fold(*scale, |m, v| m.max(v.abs()));
    }
    let mut worst = 0f64;
    let mut name = String::new();
    for p in params {
        let scale = largest[&p.rank];
        let mut diff = 0f64;
        for (a, b) in p.ours.iter().zip(&p.theirs) {
            diff = if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                diff.max((a - b).abs())
            };
        }
        let w = diff / scale;
        if w.is_nan() || w > worst {
            name = p.name.clone();
            worst = w;
        }
        if worst.is_nan() {
            break;
        }
    }
    (worst, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradients(name: &str, rank: usize, ours: &[f64], theirs: &[f64]) -> ParamGradients {
        ParamGradients {
            name: name.to_string(),
            rank,
            ours: ours.to_vec(),
            theirs: theirs.to_vec(),
        }
    }

    /// A gradient that is rounding noise both ways (the key bias's, zero in exact arithmetic)
    /// is measured against its rank's largest, not its own: a change in its noise passes,
    /// while a bias gradient off by a tenth of its rank's largest fails and is named; the
    /// weights have their own scale; a NaN is NaN.
    #[test]
    fn a_gradient_of_noise_is_measured_against_its_ranks_largest() {
        let key = gradients("key.bias", 1, &[1e-6, -2e-6], &[-1e-6, 1e-6]);
        let value = gradients("value.bias", 1, &[0.5, -1.0], &[0.5, -1.0]);
        let weight = gradients("value.weight", 2, &[100.0, 0.0], &[100.0, 0.0]);
        let (worst, _) = farthest_off(&[key, value, weight]);
        assert!(worst < 1e-5, "{worst}");
        let key = gradients("key.bias", 1, &[1e-6, -2e-6], &[-1e-6, 1e-6]);
        let value = gradients("value.bias", 1, &[0.5, -0.9], &[0.5, -1.0]);
        let weight = gradients("value.weight", 2, &[100.0, 0.0], &[100.0, 0.0]);
        let (worst, name) = farthest_off(&[key, value, weight]);
        assert!((worst - 0.1).abs() < 1e-12, "{worst}");
        assert_eq!(name, "value.bias");
        // The weights' scale is theirs: a weight off by 1 of 2 fails though the biases are small.
        let bias = gradients("a.bias", 1, &[1e-3], &[1e-3]);
        let weight = gradients("a.weight", 2, &[1.0, 1.0], &[2.0, 1.0]);
        assert_eq!(farthest_off(&[bias, weight]), (0.5, "a.weight".to_string()));
        let bias = gradients("a.bias", 1, &[f64::NAN], &[1.0]);
        let weight = gradients("a.weight", 2, &[1.0], &[1.0]);
        let (worst, name) = farthest_off(&[bias, weight]);
        assert!(worst.is_nan());
        assert_eq!(name, "a.bias");
    }

    /// What [`farthest_off`] rests on, through the real encoder on the CPU: the attention's
    /// key bias gets a gradient of rounding noise both ways (its exact value is zero; in f32
    /// ~1e-10 of its rank's largest), while every other bias's is far above that (the query's,
    /// the smallest, ~6e-4 at initialisation, where the attention is near uniform).
    #[test]
    fn the_key_bias_gradient_is_rounding_noise() {
        let shape = &CheckShape::defaults()[0];
        let both = both_ways(&Device::Cpu, DType::F32, shape, NAME, Fused::default())
            .unwrap()
            .expect("the CPU's kernels record");
        let largest = |p: &ParamGradients| {
            p.ours
                .iter()
                .chain(&p.theirs)
                .fold(0f64, |m, v| m.max(v.abs()))
        };
        let vectors: Vec<&ParamGradients> = both.params.iter().filter(|p| p.rank == 1).collect();
        let scale = vectors.iter().map(|p| largest(p)).fold(0f64, f64::max);
        let keys: Vec<&&ParamGradients> = vectors
            .iter()
            .filter(|p| p.name.ends_with("attention.self.key.bias"))
            .collect();
        assert_eq!(keys.len(), 2, "one a layer");
        for p in &vectors {
            let share = largest(p) / scale;
            if p.name.ends_with("attention.self.key.bias") {
                assert!(share < 1e-7, "{}: {share}", p.name);
            } else if p.name.ends_with(".bias") {
                assert!(share > 1e-5, "{}: {share}", p.name);
            }
        }
        assert!(farthest_off(&both.params).0 < tolerance(DType::F32));
    }
}
