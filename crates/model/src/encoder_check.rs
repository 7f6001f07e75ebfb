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
use crate::kernels::check::{
    CheckShape, KernelCheck, device_broken, needing_in, tolerance, values, worst,
};
use crate::{BertConfig, ModelError};

/// The name the report gives the check.
pub const NAME: &str = "encoder backward by hand";
/// Its name with the one-pass attention on ([`crate::kernels::set_cuda_flash_attention`]).
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
/// there, so there is nothing to compare). On a CUDA device this turns every CUDA kernel on
/// for the process, the backward by hand among them
/// (`crate::kernels::turn_cuda_kernels_on`), and in bf16 checks the shapes with heads of 64 a
/// second time with the one-pass attention on ([`FLASH_NAME`]; as it was afterwards).
pub fn check_encoder_backward(
    device: &Device,
    dtype: DType,
    shapes: &[CheckShape],
) -> Result<Vec<KernelCheck>> {
    if device.is_cuda() {
        // What is checked is the CUDA kernels' composition by hand: on, whatever the setting.
        crate::kernels::turn_cuda_kernels_on();
    }
    let flash_before = crate::kernels::cuda_flash_attention();
    let checks = check_shapes(device, dtype, shapes);
    crate::kernels::set_cuda_flash_attention(flash_before);
    checks
}

/// [`check_encoder_backward`]'s shapes, the one-pass attention set for each.
fn check_shapes(device: &Device, dtype: DType, shapes: &[CheckShape]) -> Result<Vec<KernelCheck>> {
    let mut checks = Vec::new();
    for shape in shapes {
        crate::kernels::set_cuda_flash_attention(false);
        match check_shape(device, dtype, shape, NAME, &mut checks) {
            Ok(true) => {}
            Ok(false) => return Ok(Vec::new()),
            Err(e) => {
                if not_run(device, dtype, shape, NAME, &e, &mut checks) {
                    return Ok(checks);
                }
            }
        }
        if device.is_cuda() && dtype == DType::BF16 && shape.hidden == 64 * shape.heads {
            crate::kernels::set_cuda_flash_attention(true);
            let checked = check_shape(device, dtype, shape, FLASH_NAME, &mut checks);
            crate::kernels::set_cuda_flash_attention(false);
            if let Err(e) = checked
                && not_run(device, dtype, shape, FLASH_NAME, &e, &mut checks)
            {
                return Ok(checks);
            }
        }
    }
    Ok(checks)
}

/// The settings still off by default that check `check` runs with: the backward by hand's
/// (its sums, LayerNorm's forms and grid, the column sums, the linear layers' epilogue and
/// ends), and the one-pass attention's where it runs with it.
fn needs(check: &str, dtype: DType) -> Vec<String> {
    use crate::kernels::{
        CUDA_ADD, CUDA_BIAS_ACT_VECTOR, CUDA_COLUMN_SUMS_LANES, CUDA_FLASH_ASYNC_COPIES,
        CUDA_FLASH_ATTENTION, CUDA_FLASH_BATCHED_LOADS, CUDA_FLASH_DELTA_VECTOR,
        CUDA_FLASH_JOINT_BACKWARD, CUDA_FLASH_PAIR_KEYS, CUDA_FLASH_REGISTERS, CUDA_JOIN,
        CUDA_LINEAR_BACKWARD_LT, CUDA_LINEAR_EPILOGUE, CUDA_NORM_VECTOR, CUDA_NORM_WARP_FORWARD,
        CUDA_NORM_WIDE_GRID, CUDA_RESIDUAL_SUM_IN_PRODUCT, CUDA_TAPE,
    };
    // The layers' kernels as every setting has them (on, here): LayerNorm's forms and grid,
    // the column sums, the linear layers' epilogue, the joins of their parameters (whose
    // backward the tape takes as views, autograd through the join's own), the residuals'
    // gradients added by the products (on the tape; autograd adds them apart).
    let mut switches = vec![
        &CUDA_TAPE,
        &CUDA_ADD,
        &CUDA_JOIN,
        &CUDA_RESIDUAL_SUM_IN_PRODUCT,
        &CUDA_NORM_WIDE_GRID,
        &CUDA_NORM_VECTOR,
        &CUDA_NORM_WARP_FORWARD,
        &CUDA_COLUMN_SUMS_LANES,
        &CUDA_LINEAR_EPILOGUE,
        &CUDA_BIAS_ACT_VECTOR,
        &CUDA_LINEAR_BACKWARD_LT,
    ];
    if check == FLASH_NAME {
        // Every setting is on here: the form with the scores in registers, its loads batched
        // and its forward's copies asynchronous, is the one run; its backward the joint one at
        // rows of at most 128 places, else with its delta 16 bytes a thread and its keys'
        // backward over two key tiles a block.
        switches.extend([
            &CUDA_FLASH_ATTENTION,
            &CUDA_FLASH_REGISTERS,
            &CUDA_FLASH_BATCHED_LOADS,
            &CUDA_FLASH_ASYNC_COPIES,
            &CUDA_FLASH_DELTA_VECTOR,
            &CUDA_FLASH_JOINT_BACKWARD,
            &CUDA_FLASH_PAIR_KEYS,
        ]);
    }
    needing_in(dtype, &switches)
}

/// Reports `check` at `shape` as not run (`error`); whether the device broke (the check
/// stops).
fn not_run(
    device: &Device,
    dtype: DType,
    shape: &CheckShape,
    check: &'static str,
    error: &candle_core::Error,
    checks: &mut Vec<KernelCheck>,
) -> bool {
    checks.push(KernelCheck::not_run(
        check.to_string(),
        shape.name,
        needs(check, dtype),
        error,
    ));
    device_broken(device).is_some()
}

/// One shape of [`check_encoder_backward`], reported as `check`: false when the kernels do not
/// record there.
fn check_shape(
    device: &Device,
    dtype: DType,
    shape: &CheckShape,
    check: &'static str,
    checks: &mut Vec<KernelCheck>,
) -> Result<bool> {
    let config = BertConfig {
        vocab_size: 8,
        hidden_size: shape.hidden,
        num_hidden_layers: 2,
        num_attention_heads: shape.heads,
        intermediate_size: shape.intermediate,
        max_position_embeddings: shape.seq,
        ..BertConfig::tiny(8)
    };
    let loaded = init::<BertModel>(&config, dtype, device, 21).map_err(model_error)?;
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
        return Ok(false);
    }
    let (grad_x, grads) = backward.backward(&upstream).map_err(model_error)?;

    source.start_batch(0, 0);
    let input = Var::from_tensor(&x)?;
    let reference = bert
        .encode(input.as_tensor(), &inputs, 0..2, mode)
        .map_err(model_error)?;
    let store = crate::bert::backward_from(&reference, &upstream)?;

    let f64_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F64);
    let needs = needs(check, dtype);
    let mut line = |value: &'static str, gradient: bool, worst: f64| {
        checks.push(KernelCheck {
            kernel: check.to_string(),
            shape: shape.name,
            value,
            gradient,
            worst,
            tolerance: tolerance(dtype),
            needs: needs.clone(),
            error: None,
        })
    };
    line(
        "output",
        false,
        worst(&f64_cpu(&y)?, &f64_cpu(&reference)?)?,
    );
    let Some(want) = store.get(input.as_tensor()) else {
        candle_core::bail!("{check}: autograd gave the input no gradient")
    };
    line("x", true, worst(&f64_cpu(&grad_x)?, &f64_cpu(want)?)?);
    let mut params = 0f64;
    for (name, var) in loaded.params.vars() {
        if !name.starts_with("encoder.layer.") {
            continue;
        }
        let (Some(ours), Some(theirs)) = (grads.get(var.as_tensor()), store.get(var.as_tensor()))
        else {
            candle_core::bail!("{check}: no gradient for {name}")
        };
        // A NaN stays a NaN (f64::max would drop it).
        let w = worst(&f64_cpu(ours)?, &f64_cpu(theirs)?)?;
        params = if w.is_nan() || params.is_nan() {
            f64::NAN
        } else {
            params.max(w)
        };
    }
    line("params", true, params);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::kernels::cpu::offer_for_tests::{ON, TAKEN};

    /// The tape's offer of an input's gradient so far reaches a real encoder's linear layers
    /// whose input also went to a residual (the QKV projection and the feed-forward's first:
    /// two a layer), and a layer that takes it and adds it as the tape would leaves every
    /// gradient of the backward by hand as it was, to the bit (the CUDA linear layers take it
    /// into their product; the CPU's take it here only under test).
    #[test]
    fn the_offer_reaches_the_residuals_linear_layers_and_changes_nothing() {
        let shapes = &CheckShape::defaults()[..1];
        let worst_of =
            |checks: Vec<KernelCheck>| -> Vec<f64> { checks.iter().map(|c| c.worst).collect() };
        let without = worst_of(check_encoder_backward(&Device::Cpu, DType::F32, shapes).unwrap());
        ON.store(true, Ordering::SeqCst);
        let before = TAKEN.load(Ordering::SeqCst);
        let with = check_encoder_backward(&Device::Cpu, DType::F32, shapes);
        ON.store(false, Ordering::SeqCst);
        let taken = TAKEN.load(Ordering::SeqCst) - before;
        let with = worst_of(with.unwrap());
        assert!(!without.is_empty() && without.iter().all(|w| *w < tolerance(DType::F32)));
        // Two layers, two offers taken each (other tests' CPU layers may take some too).
        assert!(taken >= 4, "{taken} offers taken");
        assert_eq!(with, without);
    }
}
