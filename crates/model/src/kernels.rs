//! The hot operations, behind one small interface.
//!
//! The model calls LayerNorm, GELU, softmax and attention only through [`Kernels`], so that a
//! fused implementation (a CUDA kernel with its own backward) can replace one without touching
//! the model code. [`Composed`] is the reference implementation: every op is composed of candle
//! primitives that have a backward pass, so gradients flow through all of them. (candle's fused
//! `softmax_last_dim`, `layer_norm`, `rms_norm` and `candle_nn::LayerNorm` have no backward and
//! would silently stop gradients; they are not used where gradients are tracked.) When no input
//! of LayerNorm or softmax tracks gradients (a frozen inference model, see
//! [`crate::params::ParamBuilder::frozen`]), those fused candle ops are used, on every device
//! alike: they are faster and need no intermediates ([`fused_calls_on_this_thread`] counts
//! them, so a test can tell which path ran). On the CPU in f32, that path also computes
//! attention's scale, padding mask and softmax in one pass of our own instead of three, and
//! GELU with a vectorised error function (`cpu_fused`). In half precision, LayerNorm and softmax are computed in f32
//! and cast back, on either path; f64 (tests) always takes the composed one.

use std::cell::Cell;
use std::fmt::Debug;

use candle_core::{D, DType, Result, Tensor};

use crate::bert::Mode;

/// The hot operations the model uses.
pub trait Kernels: Send + Sync + Debug {
    /// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * weight + bias`.
    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor>;

    /// Exact GELU, `x * Φ(x)` with the error function.
    fn gelu(&self, x: &Tensor) -> Result<Tensor>;

    /// Softmax over the last dimension.
    fn softmax_last_dim(&self, x: &Tensor) -> Result<Tensor>;

    /// Attention probabilities from raw scores `q·kᵀ` (`[batch, heads, q, k]`):
    /// `softmax(scores · scale + mask_bias)` over the keys.
    fn masked_softmax(&self, scores: &Tensor, mask_bias: &Tensor, scale: f64) -> Result<Tensor> {
        composed_masked_softmax(self, scores, mask_bias, scale)
    }

    /// Scaled dot-product attention. `q`, `k`, `v`: `[batch, heads, seq, head_size]`;
    /// `mask_bias`: `[batch, 1, 1, seq]`, 0 for tokens and a large negative number for padding;
    /// `dropout`: probability applied to the attention probabilities in training `mode`.
    /// Returns `[batch, heads, seq, head_size]`.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask_bias: &Tensor,
        mode: Mode,
        dropout: f64,
    ) -> Result<Tensor> {
        let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
        let probs = self.masked_softmax(&q.matmul(&k.t()?)?, mask_bias, scale)?;
        let probs = mode.dropout(&probs, dropout)?;
        probs.matmul(v)
    }
}

/// [`Kernels::masked_softmax`] from separate ops: scale, add the mask, `k`'s softmax.
fn composed_masked_softmax<K: Kernels + ?Sized>(
    k: &K,
    scores: &Tensor,
    mask_bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let mask = mask_bias.to_dtype(scores.dtype())?;
    k.softmax_last_dim(&(scores * scale)?.broadcast_add(&mask)?)
}

thread_local! {
    static FUSED_CALLS: Cell<u64> = const { Cell::new(0) };
}

/// How many LayerNorm and softmax calls on this thread took candle's fused (no-backward) ops.
/// The model's forward pass runs its kernels on the calling thread, so a test can compare the
/// count before and after a forward pass.
pub fn fused_calls_on_this_thread() -> u64 {
    FUSED_CALLS.with(Cell::get)
}

/// Whether the fused ops may replace the composed ones: nothing among `inputs` tracks
/// gradients, and the dtype is one candle's fused kernels take (not f64).
fn may_fuse(inputs: &[&Tensor]) -> bool {
    let fuse = inputs
        .iter()
        .all(|t| !t.track_op() && t.dtype() != DType::F64);
    if fuse {
        FUSED_CALLS.with(|c| c.set(c.get() + 1));
    }
    fuse
}

/// Differentiable kernels composed of candle primitives (CPU and CUDA).
#[derive(Debug, Default, Clone, Copy)]
pub struct Composed;

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

impl Kernels for Composed {
    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = if is_half(dtype) {
            x.to_dtype(DType::F32)?
        } else {
            x.clone()
        };
        if may_fuse(&[&x, weight, bias]) {
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let normed = candle_nn::ops::layer_norm(
                &x.contiguous()?,
                &f32(weight)?,
                &f32(bias)?,
                eps as f32,
            )?;
            return normed.to_dtype(dtype);
        }
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
        let normed = normed.to_dtype(dtype)?;
        normed
            .broadcast_mul(&weight.to_dtype(dtype)?)?
            .broadcast_add(&bias.to_dtype(dtype)?)
    }

    fn gelu(&self, x: &Tensor) -> Result<Tensor> {
        // On the CPU in f32 without gradients: a vectorised error function (`cpu_fused`)
        // instead of the C library's scalar one. (Not counted with the fused LayerNorm and
        // softmax: candle has no fused GELU to stand in for.)
        if x.device().is_cpu() && x.dtype() == DType::F32 && !x.track_op() {
            return x.contiguous()?.apply_op1_no_bwd(&crate::cpu_fused::Gelu);
        }
        x.gelu_erf()
    }

    fn masked_softmax(&self, scores: &Tensor, mask_bias: &Tensor, scale: f64) -> Result<Tensor> {
        // On the CPU in f32 without gradients: scale, mask and softmax in one pass (see
        // `cpu_fused`); counted as the fused softmax it replaces.
        if scores.device().is_cpu() && scores.dtype() == DType::F32 && may_fuse(&[scores]) {
            let mask = mask_bias.to_dtype(DType::F32)?.contiguous()?;
            let op = crate::cpu_fused::MaskedSoftmax {
                scale: scale as f32,
            };
            return scores.contiguous()?.apply_op2_no_bwd(&mask, &op);
        }
        composed_masked_softmax(self, scores, mask_bias, scale)
    }

    fn softmax_last_dim(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = if is_half(dtype) {
            x.to_dtype(DType::F32)?
        } else {
            x.clone()
        };
        if may_fuse(&[&x]) {
            return candle_nn::ops::softmax_last_dim(&x.contiguous()?)?.to_dtype(dtype);
        }
        // Subtracting the (constant) row maximum changes nothing mathematically; detached, it
        // adds no term to the gradient.
        let max = x.max_keepdim(D::Minus1)?.detach();
        let e = x.broadcast_sub(&max)?.exp()?;
        let s = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        s.to_dtype(dtype)
    }
}
