//! The per-row negative log-likelihood every loss of the model is made of, and the composed
//! log-softmax it falls back to: a kernel like the others, with a fused op per device.

use candle_core::{D, DType, Result, Tensor};

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
/// on CUDA its twin where turned on (f32 or bf16 logits as they are); elsewhere composed ops.
pub fn nll_per_row(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(nll) = crate::cuda_nll(logits, labels) {
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
            .apply_op2(&labels, crate::cpu::NegativeLogLikelihood);
    }
    // (Rows of more than one dimension as one: a node for candle's graph only where needed.)
    let logits = match logits.rank() {
        2 => logits,
        _ => logits.reshape(((), logits.dim(D::Minus1)?))?,
    };
    let picked = log_softmax(&logits)?.gather(&labels.to_dtype(DType::U32)?.unsqueeze(1)?, 1)?;
    picked.squeeze(1)?.neg()
}
