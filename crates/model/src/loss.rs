//! The pre-training losses, from differentiable ops (computed in f32 whatever the model dtype).

use candle_core::{Device, Result, Tensor};

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

pub use bertkit_kernels::{log_softmax, nll_per_row};

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
