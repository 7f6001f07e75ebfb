//! The reference kernels, [`Composed`]: every op from candle primitives that have a backward
//! pass, on every device and dtype; and the composed forms of the fused ops, which the
//! trait's defaults and the fused kernels fall back to where they have no fused form.

use candle_core::{D, Result, Tensor};

use super::{Gelu, Kernels, Mode, tape, widened};
use crate::packing::{Packing, RowIndex};

/// [`Kernels::embeddings`] from the kernels' lookups, candle's additions, the kernels'
/// LayerNorm, a cast to the weight's dtype and [`Mode::dropout_tokens`].
pub(super) fn composed_embeddings<K: Kernels + ?Sized>(
    kernels: &K,
    [words, types, positions]: [(&Tensor, &RowIndex); 3],
    packing: &Packing,
    mode: Mode,
    dropout: f64,
    (weight, bias, eps): (&Tensor, &Tensor, f64),
) -> Result<Tensor> {
    tape::unrecorded("the embeddings' sum of candle's ops");
    let gathered = |(table, rows): (&Tensor, &RowIndex)| kernels.gather_rows(table, rows);
    let x = ((gathered(words)? + gathered(types)?)? + gathered(positions)?)?;
    let normed = kernels
        .layer_norm(&x, weight, bias, eps)?
        .to_dtype(weight.dtype())?;
    mode.dropout_tokens(&normed, dropout, packing)
}

/// [`Kernels::linear`] from separate ops: the rows flattened, a product with the transposed
/// weight, the bias broadcast over the rows.
pub(super) fn composed_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    tape::unrecorded("a linear layer of candle's ops");
    // A weight kept in another dtype (a tied f32 table) is cast for the product.
    let weight = &weight.to_dtype(x.dtype())?;
    let dims = x.dims().to_vec();
    let (input, leading) = dims.split_last().expect("a tensor with a last dimension");
    let rows: usize = leading.iter().product();
    let y = x.reshape((rows, *input))?.matmul(&weight.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    *out.last_mut().expect("non-empty") = weight.dim(0)?;
    y.reshape(out)
}

/// [`Kernels::attention`] from separate ops on the padded batch: the tokens padded back to
/// `[batch, heads, seq, head]`, `q·kᵀ`, scale, the padding mask's bias, the kernels' softmax,
/// dropout, `·v`, and the tokens packed again.
pub(super) fn composed_attention<K: Kernels + ?Sized>(
    kernels: &K,
    qkv: &Tensor,
    packing: &Packing,
    heads: usize,
    mode: Mode,
    dropout: f64,
) -> Result<Tensor> {
    tape::unrecorded("attention of candle's ops");
    let (batch, seq) = packing.padded_dims();
    let hidden = qkv.dim(D::Minus1)? / 3;
    let head = hidden / heads.max(1);
    let split = |part: usize| -> Result<Tensor> {
        packing
            .unpack(&qkv.narrow(1, part * hidden, hidden)?.contiguous()?)?
            .reshape((batch, seq, heads, head))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    let scale = 1.0 / (head as f64).sqrt();
    let mask = packing.mask_bias().to_dtype(q.dtype())?;
    let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
    let probs = mode.dropout(&kernels.softmax_last_dim(&scores)?, dropout)?;
    let context = probs
        .matmul(&v)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((batch, seq, hidden))?;
    packing.pack(&context)
}

/// [`Kernels::residual_layer_norm`] from separate ops: the dropout, the addition and the
/// kernels' LayerNorm (`norm`: weight, bias, eps).
pub(super) fn composed_residual_layer_norm<K: Kernels + ?Sized>(
    kernels: &K,
    x: &Tensor,
    residual: &Tensor,
    packing: &Packing,
    mode: Mode,
    dropout: f64,
    (weight, bias, eps): (&Tensor, &Tensor, f64),
) -> Result<Tensor> {
    tape::unrecorded("a residual LayerNorm of candle's ops");
    let dropped = mode.dropout_tokens(x, dropout, packing)?;
    kernels.layer_norm(&(dropped + residual)?, weight, bias, eps)
}

/// The reference kernels: every op composed of candle primitives that have a backward pass
/// (CPU and CUDA, every dtype; in half precision LayerNorm and softmax are computed in f32 and
/// cast back). Nothing fused: the tests compare the fused kernels against these, and
/// `bench inference --composed` measures them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Composed;

impl Kernels for Composed {
    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        tape::unrecorded("a LayerNorm of candle's ops");
        let dtype = x.dtype();
        let x = widened(x)?;
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
        let normed = normed.to_dtype(dtype)?;
        normed
            .broadcast_mul(&weight.to_dtype(dtype)?)?
            .broadcast_add(&bias.to_dtype(dtype)?)
    }

    fn gelu(&self, x: &Tensor, form: Gelu) -> Result<Tensor> {
        tape::unrecorded("a GELU of candle's ops");
        match form {
            Gelu::Erf => x.gelu_erf(),
            // candle's `gelu` is the tanh form, with a backward pass.
            Gelu::Tanh => x.gelu(),
        }
    }

    fn softmax_last_dim(&self, x: &Tensor) -> Result<Tensor> {
        tape::unrecorded("a softmax of candle's ops");
        let dtype = x.dtype();
        let x = widened(x)?;
        // Subtracting the (constant) row maximum changes nothing mathematically; detached, it
        // adds no term to the gradient.
        let max = x.max_keepdim(D::Minus1)?.detach();
        let e = x.broadcast_sub(&max)?.exp()?;
        let s = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        s.to_dtype(dtype)
    }
}
