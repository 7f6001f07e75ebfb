//! The hot operations, behind one small interface.
//!
//! The model calls LayerNorm, GELU, softmax and attention only through [`Kernels`], so that a
//! fused implementation (a CUDA kernel with its own backward) can replace one without touching
//! the model code. [`Composed`] is the reference implementation: every op is composed of candle
//! primitives that have a backward pass, so gradients flow through all of them. (candle's fused
//! `softmax_last_dim`, `layer_norm`, `rms_norm` and `candle_nn::LayerNorm` have no backward and
//! would silently stop gradients; they are not used where gradients are tracked.) When no input
//! of LayerNorm or softmax tracks gradients (a frozen inference model, see
//! [`crate::params::ParamBuilder::frozen`]), those fused candle ops are used: they are faster
//! and need no intermediates. In half precision, LayerNorm and softmax are computed in f32 and
//! cast back.

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
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let scores = scores.broadcast_add(&mask_bias.to_dtype(scores.dtype())?)?;
        let probs = self.softmax_last_dim(&scores)?;
        let probs = mode.dropout(&probs, dropout)?;
        probs.matmul(v)
    }
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
        x.gelu_erf()
    }

    fn softmax_last_dim(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = if is_half(dtype) {
            x.to_dtype(DType::F32)?
        } else {
            x.clone()
        };
        // Subtracting the (constant) row maximum changes nothing mathematically; detached, it
        // adds no term to the gradient.
        let max = x.max_keepdim(D::Minus1)?.detach();
        let e = x.broadcast_sub(&max)?.exp()?;
        let s = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        s.to_dtype(dtype)
    }
}
