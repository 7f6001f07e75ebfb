//! The pre-training losses, from differentiable ops (computed in f32 whatever the model dtype).

use candle_core::{D, DType, Device, Result, Tensor};

use crate::ModelError;

/// Class labels for [`nll_per_row`] and friends, checked on the host to lie in `0..classes`
/// and uploaded as a `[rows]` u32 tensor. On CUDA an out-of-range label would be a
/// device-side assert in the gather, which kills the context; here it is an error naming the
/// label's place (`name[i]`).
pub fn labels(
    values: &[u32],
    classes: usize,
    name: &str,
    device: &Device,
) -> std::result::Result<Tensor, ModelError> {
    if let Some(i) = values.iter().position(|&v| v as usize >= classes) {
        return Err(ModelError::Input(format!(
            "{name}[{i}] is {}, outside 0..{classes}",
            values[i]
        )));
    }
    Ok(Tensor::from_slice(values, values.len(), device)?)
}

/// `log(softmax(x))` over the last dimension; the row maximum is detached (it cancels out).
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&log_sum)
}

/// Per-row negative log-likelihood of `labels` (`[rows]`, u32) under `logits` (`[rows, classes]`,
/// or `[..., classes]` with every dimension but the last a row's: the masked-LM logits as the
/// model gives them, `[batch, predictions, vocabulary]`, with no reshape between them and the
/// loss, which would cost candle's backward a zeroed tensor and an addition over all of them).
/// On the CPU in f32 one fused op of ours (forward and backward each one pass over the logits),
/// on CUDA its twin where turned on ([`crate::kernels::set_cuda_loss`]: f32 or bf16 logits as
/// they are); elsewhere composed ops.
pub fn nll_per_row(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(nll) = crate::kernels::cuda_nll(logits, labels) {
        return nll;
    }
    let logits = if logits.dtype() == DType::F64 {
        logits.clone()
    } else {
        logits.to_dtype(DType::F32)?
    };
    if logits.device().is_cpu() && logits.dtype() == DType::F32 {
        let labels = labels.to_dtype(DType::U32)?.contiguous()?;
        return logits
            .contiguous()?
            .apply_op2(&labels, crate::kernels::cpu::NegativeLogLikelihood);
    }
    // (Rows of more than one dimension as one: a node for candle's graph only where needed.)
    let logits = match logits.rank() {
        2 => logits,
        _ => logits.reshape(((), logits.dim(D::Minus1)?))?,
    };
    let picked = log_softmax(&logits)?.gather(&labels.to_dtype(DType::U32)?.unsqueeze(1)?, 1)?;
    picked.squeeze(1)?.neg()
}

/// Mean cross-entropy of `labels` (`[rows]`) under `logits` (`[rows, classes]`).
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    nll_per_row(logits, labels)?.mean_all()
}

/// The masked-LM loss: cross-entropy at each prediction slot, weighted by `weights`
/// (`[batch, predictions]`: 1 for real masked positions, 0 for padding slots), averaged over
/// the real ones, as Google's BERT computes it.
pub fn masked_lm_loss(mlm_logits: &Tensor, labels: &Tensor, weights: &Tensor) -> Result<Tensor> {
    // `[batch, predictions, vocabulary]`, read as rows as they are.
    mlm_logits.dims3()?;
    let nll = nll_per_row(mlm_logits, &labels.flatten_all()?)?;
    let w = weights.flatten_all()?.to_dtype(nll.dtype())?;
    let total = (nll * &w)?.sum_all()?;
    total.broadcast_div(&(w.sum_all()? + 1e-5)?)
}

/// The pre-training loss: masked-LM loss plus next-sentence cross-entropy.
pub fn pretraining_loss(
    mlm_logits: &Tensor,
    mlm_labels: &Tensor,
    mlm_weights: &Tensor,
    nsp_logits: &Tensor,
    nsp_labels: &Tensor,
) -> Result<Tensor> {
    masked_lm_loss(mlm_logits, mlm_labels, mlm_weights)? + cross_entropy(nsp_logits, nsp_labels)?
}
