//! LayerNorm, and the end of a sublayer: dropout, the residual and LayerNorm in one pass.

use super::linear::add_into;
use super::*;
use crate::dropout::KeepMask;
use crate::host::{contiguous, cpu_slice, same_shape};
use crate::vectorised;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// LayerNorm.

/// LayerNorm over the last dimension of `x`, `(x - mean) / sqrt(var + eps) · weight + bias`,
/// with the (biased) variance of the row; `weight` and `bias` are `[hidden]`.
pub(crate) struct LayerNorm {
    pub(crate) eps: f32,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "bertkit-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, hidden) = super::super::norm_shape(op, x_layout, &[weight_layout, bias_layout])?;
        let x = contiguous(op, "input", x, x_layout)?;
        let weight = contiguous(op, "weight", weight, weight_layout)?;
        let bias = contiguous(op, "bias", bias, bias_layout)?;
        let out = layer_norm_rows(NormInput::Rows(x), hidden, weight, bias, self.eps);
        Ok((CpuStorage::F32(out), x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("layer_norm", grad.device(), || {
            let packed = x.apply_op3_no_bwd(
                weight,
                &grad.contiguous()?,
                &LayerNormBackward { eps: self.eps },
            )?;
            super::super::norm_gradients(&packed, x, weight.elem_count())
        })
    }
}

/// LayerNorm's backward from its input `x`, `weight` and the output's gradient `g`, as one
/// `[rows + 2, hidden]` tensor: the input's gradient (rows), then the weight's and the bias's.
struct LayerNormBackward {
    eps: f32,
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "bertkit-layer-norm-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (rows, hidden) = super::super::norm_shape(op, x_layout, &[weight_layout])?;
        same_shape(op, x_layout, grad_layout)?;
        let x = contiguous(op, "input", x, x_layout)?;
        let weight = contiguous(op, "weight", weight, weight_layout)?;
        let grad = contiguous(op, "gradient", grad, grad_layout)?;
        let mut out = vec![0f32; (rows + 2) * hidden];
        let (grad_x, params) = out.split_at_mut(rows * hidden);
        params.copy_from_slice(&layer_norm_backward_rows(
            NormInput::Rows(x),
            hidden,
            weight,
            grad,
            self.eps,
            grad_x,
        ));
        Ok((CpuStorage::F32(out), Shape::from((rows + 2, hidden))))
    }
}

/// Where a LayerNorm's input rows come from: stored rows, or a sublayer's end recomputing the
/// sum `dropout(x) + residual` a row at a time ([`ResidualLayerNorm`]).
#[derive(Clone, Copy)]
pub(super) enum NormInput<'a> {
    Rows(&'a [f32]),
    Residual(&'a ResidualOperands<'a>),
    /// The embeddings' sum of looked-up rows, recomputed a row at a time.
    Embeddings(&'a super::embeddings::EmbeddingRows<'a>),
}

impl NormInput<'_> {
    /// The input row of `hidden` values starting at element `start` (`scratch` holds a
    /// recomputed one).
    fn row<'s>(&'s self, start: usize, hidden: usize, scratch: &'s mut Vec<f32>) -> &'s [f32] {
        match self {
            NormInput::Rows(x) => &x[start..start + hidden],
            NormInput::Residual(o) => {
                scratch.resize(hidden, 0.0);
                o.sum_row(start, scratch);
                scratch
            }
            NormInput::Embeddings(e) => {
                scratch.resize(hidden, 0.0);
                e.sum_row(start / hidden, scratch);
                scratch
            }
        }
    }
}

/// LayerNorm of every input row (rows of `hidden`), blocks of rows in parallel.
pub(super) fn layer_norm_rows(
    input: NormInput,
    hidden: usize,
    weight: &[f32],
    bias: &[f32],
    eps: f32,
) -> Vec<f32> {
    let len = match input {
        NormInput::Rows(x) => x.len(),
        NormInput::Residual(o) => o.x.len(),
        NormInput::Embeddings(e) => e.tokens() * hidden,
    };
    let task = rows_per_task(hidden) * hidden;
    let mut out = vec![0f32; len];
    out.par_chunks_mut(task)
        .enumerate()
        .for_each_init(Vec::new, |scratch, (t, out)| {
            for (r, out) in out.chunks_mut(hidden).enumerate() {
                let x = input.row(t * task + r * hidden, hidden, scratch);
                layer_norm_row(x, weight, bias, eps, out);
            }
        });
    out
}

/// LayerNorm's backward for every input row, from the output's gradient `g`: the input's
/// gradient into `grad_x`, and the weight's then the bias's gradient returned (`2 · hidden`
/// values), summed per [`ROWS_PER_PARTIAL`] rows and the partial sums added in order.
pub(super) fn layer_norm_backward_rows(
    input: NormInput,
    hidden: usize,
    weight: &[f32],
    g: &[f32],
    eps: f32,
    grad_x: &mut [f32],
) -> Vec<f32> {
    let task = ROWS_PER_PARTIAL * hidden;
    let partials: Vec<Vec<f32>> = grad_x
        .par_chunks_mut(task)
        .zip(g.par_chunks(task))
        .enumerate()
        .map(|(t, (grad_x, g))| {
            let mut partial = vec![0f32; 2 * hidden];
            let (grad_weight, grad_bias) = partial.split_at_mut(hidden);
            let mut scratch = Vec::new();
            for (r, (gx, g)) in grad_x.chunks_mut(hidden).zip(g.chunks(hidden)).enumerate() {
                let x = input.row(t * task + r * hidden, hidden, &mut scratch);
                layer_norm_backward_row(x, weight, g, eps, gx, grad_weight, grad_bias);
            }
            partial
        })
        .collect();
    let mut params = vec![0f32; 2 * hidden];
    for partial in &partials {
        add_into(&mut params, partial);
    }
    params
}

/// A row's mean and `1 / sqrt(var + eps)`, the variance from the centred values (two passes:
/// no cancellation for rows far from zero).
#[inline(always)]
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len();
    let mean = lane_sum(n, |i| x[i]) / n as f32;
    let var = lane_sum(n, |i| (x[i] - mean) * (x[i] - mean)) / n as f32;
    (mean, 1.0 / (var + eps).sqrt())
}

vectorised! {
    /// One row of LayerNorm.
    fn layer_norm_row(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) = layer_norm_row_portable
}

#[inline(always)]
fn layer_norm_row_portable(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    let n = out.len();
    let (x, weight, bias) = (&x[..n], &weight[..n], &bias[..n]);
    let (mean, rstd) = row_stats(x, eps);
    for i in 0..n {
        out[i] = (x[i] - mean) * rstd * weight[i] + bias[i];
    }
}

vectorised! {
    /// One row of LayerNorm's backward: the input's gradient into `grad_x`, the weight's and
    /// bias's added to `grad_weight` and `grad_bias`.
    fn layer_norm_backward_row(
        x: &[f32],
        weight: &[f32],
        g: &[f32],
        eps: f32,
        grad_x: &mut [f32],
        grad_weight: &mut [f32],
        grad_bias: &mut [f32]
    ) = layer_norm_backward_row_portable
}

/// With `x̂ = (x - mean) · rstd` and `gy = g · weight`:
/// `dx = rstd · (gy - mean(gy) - x̂ · mean(gy · x̂))`, `dweight += g · x̂`, `dbias += g`.
#[inline(always)]
fn layer_norm_backward_row_portable(
    x: &[f32],
    weight: &[f32],
    g: &[f32],
    eps: f32,
    grad_x: &mut [f32],
    grad_weight: &mut [f32],
    grad_bias: &mut [f32],
) {
    let n = grad_x.len();
    let (x, weight, g) = (&x[..n], &weight[..n], &g[..n]);
    let (grad_weight, grad_bias) = (&mut grad_weight[..n], &mut grad_bias[..n]);
    let (mean, rstd) = row_stats(x, eps);
    let mean_gy = lane_sum(n, |i| g[i] * weight[i]) / n as f32;
    let mean_gy_xhat = lane_sum(n, |i| g[i] * weight[i] * (x[i] - mean) * rstd) / n as f32;
    for i in 0..n {
        let xhat = (x[i] - mean) * rstd;
        grad_x[i] = rstd * (g[i] * weight[i] - mean_gy - xhat * mean_gy_xhat);
        grad_weight[i] += g[i] * xhat;
        grad_bias[i] += g[i];
    }
}

// ---------------------------------------------------------------------------------------------
// The end of a sublayer: dropout, the residual connection and LayerNorm.

/// `LayerNorm(dropout(x) + residual)` over the last dimension, for `x` and `residual`
/// `[..., hidden]` and `params` `[2, hidden]` (the norm's weight, then its bias), the dropout
/// by a mask of keep bytes as [`KeepMask`]'s (or none). One pass where the composition takes
/// three (dropout, the addition, the norm, each writing a tensor), and one backward where
/// theirs take three, each with a gradient buffer of its own. The sum is not kept: the
/// backward recomputes it a row at a time. Values are the composition's to the bit (the same
/// f32 operations in the same order).
pub(crate) struct ResidualLayerNorm {
    pub(crate) eps: f32,
    /// The dropout's keep bytes and the scale of a kept element.
    pub(crate) keep: Option<(Arc<Vec<u8>>, f32)>,
}

/// The operands of a [`ResidualLayerNorm`]: `x`, `residual`, the weight and the bias, with the
/// mask (if any) checked against them; and the hidden size.
pub(super) struct ResidualOperands<'a> {
    x: &'a [f32],
    residual: &'a [f32],
    weight: &'a [f32],
    bias: &'a [f32],
    keep: Option<(&'a [u8], f32)>,
    hidden: usize,
}

impl ResidualLayerNorm {
    fn operands<'a>(
        &'a self,
        x: &'a [f32],
        x_layout: &Layout,
        residual: &'a [f32],
        residual_layout: &Layout,
        params: &'a [f32],
        params_layout: &Layout,
    ) -> Result<ResidualOperands<'a>> {
        let op = "bertkit-residual-layer-norm";
        let (_, hidden) =
            super::super::residual_norm_shape(op, x_layout, residual_layout, params_layout)?;
        let keep = match &self.keep {
            Some((keep, _)) if keep.len() != x.len() => bail!(
                "{op}: a dropout mask of {} elements for {} values",
                keep.len(),
                x.len()
            ),
            Some((keep, scale)) => Some((keep.as_slice(), *scale)),
            None => None,
        };
        let (weight, bias) = params.split_at(hidden);
        Ok(ResidualOperands {
            x,
            residual,
            weight,
            bias,
            keep,
            hidden,
        })
    }
}

impl ResidualOperands<'_> {
    /// The sum `dropout(x) + residual` of the rows starting at element `start`, one row into
    /// `sum`.
    fn sum_row(&self, start: usize, sum: &mut [f32]) {
        let at = start..start + self.hidden;
        let keep = self.keep.map(|(keep, scale)| (&keep[at.clone()], scale));
        residual_sum_row(&self.x[at.clone()], &self.residual[at], keep, sum);
    }
}

vectorised! {
    /// One row of `x · (keep · scale) + residual` (without a mask, `x + residual`): the
    /// dropout's and the addition's arithmetic, in their order.
    fn residual_sum_row(x: &[f32], residual: &[f32], keep: Option<(&[u8], f32)>, sum: &mut [f32]) = residual_sum_row_portable
}

#[inline(always)]
fn residual_sum_row_portable(
    x: &[f32],
    residual: &[f32],
    keep: Option<(&[u8], f32)>,
    sum: &mut [f32],
) {
    let n = sum.len();
    let (x, residual) = (&x[..n], &residual[..n]);
    match keep {
        Some((keep, scale)) => {
            let keep = &keep[..n];
            for i in 0..n {
                sum[i] = x[i] * (f32::from(keep[i]) * scale) + residual[i];
            }
        }
        None => {
            for i in 0..n {
                sum[i] = x[i] + residual[i];
            }
        }
    }
}

impl CustomOp3 for ResidualLayerNorm {
    fn name(&self) -> &'static str {
        "bertkit-residual-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        residual: &CpuStorage,
        residual_layout: &Layout,
        params: &CpuStorage,
        params_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let x = contiguous(op, "input", x, x_layout)?;
        let residual = contiguous(op, "residual", residual, residual_layout)?;
        let params = contiguous(op, "parameters", params, params_layout)?;
        let o = self.operands(
            x,
            x_layout,
            residual,
            residual_layout,
            params,
            params_layout,
        )?;
        let out = layer_norm_rows(
            NormInput::Residual(&o),
            o.hidden,
            o.weight,
            o.bias,
            self.eps,
        );
        Ok((CpuStorage::F32(out), x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        residual: &Tensor,
        params: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("residual_layer_norm", grad.device(), || {
            let op = self.name();
            let grad = grad.contiguous()?;
            let (grad_sum, grad_params) = {
                let (x_storage, x_layout) = x.storage_and_layout();
                let (r_storage, r_layout) = residual.storage_and_layout();
                let (p_storage, p_layout) = params.storage_and_layout();
                let (g_storage, g_layout) = grad.storage_and_layout();
                same_shape(op, x_layout, g_layout)?;
                let o = self.operands(
                    cpu_slice(op, "input", &x_storage, x_layout)?,
                    x_layout,
                    cpu_slice(op, "residual", &r_storage, r_layout)?,
                    r_layout,
                    cpu_slice(op, "parameters", &p_storage, p_layout)?,
                    p_layout,
                )?;
                let g = cpu_slice(op, "gradient", &g_storage, g_layout)?;
                let mut grad_sum = vec![0f32; o.x.len()];
                let input = NormInput::Residual(&o);
                let grad_params =
                    layer_norm_backward_rows(input, o.hidden, o.weight, g, self.eps, &mut grad_sum);
                (grad_sum, grad_params)
            };
            let device = x.device();
            let grad_residual = Tensor::from_vec(grad_sum, x.shape(), device)?;
            // The dropout's backward: the same mask on the sum's gradient. Without one, `x` and
            // the residual share the one gradient.
            let grad_x = match &self.keep {
                Some((keep, scale)) => grad_residual.apply_op1_no_bwd(&KeepMask {
                    keep: Arc::clone(keep),
                    scale: *scale,
                })?,
                None => grad_residual.clone(),
            };
            let grad_params = Tensor::from_vec(grad_params, params.shape(), device)?;
            Ok((Some(grad_x), Some(grad_residual), Some(grad_params)))
        })
    }
}
