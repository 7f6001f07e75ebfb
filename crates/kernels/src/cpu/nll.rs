//! The negative log-likelihood of rows of logits, and its backward.

use super::*;
use crate::host::{contiguous, cpu_slice};
use crate::vectorised;

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// Cross-entropy.

/// The negative log-likelihood of each row's label, `log Σ exp(x) - x[label]`, for `logits`
/// `[..., classes]` (f32; every dimension but the last a row's) and `labels` `[rows]` (u32).
/// The backward recomputes each row's softmax from the logits: `g · (softmax(x) -
/// onehot(label))`, one pass.
pub(crate) struct NegativeLogLikelihood;

impl NegativeLogLikelihood {
    fn operands<'a>(
        op: &str,
        logits: &'a CpuStorage,
        logits_layout: &Layout,
        labels: &'a CpuStorage,
        labels_layout: &Layout,
    ) -> Result<(&'a [f32], &'a [u32], usize)> {
        let (_, classes) = crate::nll_rows(op, logits_layout.dims(), labels_layout.dims())?;
        let logits = contiguous(op, "logits", logits, logits_layout)?;
        let (CpuStorage::U32(labels), Some((start, end))) =
            (labels, labels_layout.contiguous_offsets())
        else {
            bail!("{op}: contiguous u32 labels expected")
        };
        let labels = &labels[start..end];
        if let Some(i) = labels.iter().position(|&l| l as usize >= classes) {
            bail!(
                "{op}: label {} of row {i} is outside 0..{classes}",
                labels[i]
            )
        }
        Ok((logits, labels, classes))
    }
}

impl CustomOp2 for NegativeLogLikelihood {
    fn name(&self) -> &'static str {
        "bertkit-nll"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        labels: &CpuStorage,
        labels_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (logits, labels, classes) =
            Self::operands(self.name(), logits, logits_layout, labels, labels_layout)?;
        let nll: Vec<f32> = logits
            .par_chunks(classes)
            .zip(labels.par_iter())
            .map(|(row, &label)| log_sum_exp(row) - row[label as usize])
            .collect();
        Ok((CpuStorage::F32(nll), Shape::from(labels.len())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _nll: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("loss", grad.device(), || {
            let op = "bertkit-nll-backward";
            let grad = grad.contiguous()?;
            let grad_logits = {
                let (l_storage, l_layout) = logits.storage_and_layout();
                let (y_storage, y_layout) = labels.storage_and_layout();
                let (g_storage, g_layout) = grad.storage_and_layout();
                let (candle_core::Storage::Cpu(l_storage), candle_core::Storage::Cpu(y_storage)) =
                    (&*l_storage, &*y_storage)
                else {
                    bail!("{op}: CPU tensors expected")
                };
                let (x, labels, classes) =
                    Self::operands(op, l_storage, l_layout, y_storage, y_layout)?;
                let grad = cpu_slice(op, "gradient", &g_storage, g_layout)?;
                if grad.len() != labels.len() {
                    bail!(
                        "{op}: a gradient of {} values for {} rows",
                        grad.len(),
                        labels.len()
                    )
                }
                let mut out = vec![0f32; x.len()];
                out.par_chunks_mut(classes)
                    .zip(x.par_chunks(classes))
                    .zip(labels.par_iter().zip(grad.par_iter()))
                    .for_each(|((out, row), (&label, &g))| {
                        softmax_times(row, log_sum_exp(row), g, out);
                        out[label as usize] -= g;
                    });
                out
            };
            Ok((
                Some(Tensor::from_vec(
                    grad_logits,
                    logits.shape(),
                    logits.device(),
                )?),
                None,
            ))
        })
    }
}

vectorised! {
    /// `log Σ exp(row)`, the row's maximum taken out first.
    fn log_sum_exp(row: &[f32]) -> f32 = log_sum_exp_portable
}

#[inline(always)]
fn log_sum_exp_portable(row: &[f32]) -> f32 {
    // The sum of [`lane_sum`] in its order, but with the exponentials computed a block at a
    // time into a buffer first: a plain loop over a slice is vectorised, while `exp` inside
    // `lane_sum`'s closure is not (it compiles to one lane at a time).
    const BLOCK: usize = 64 * LANES;
    let max = lane_max(row);
    let n = row.len();
    let whole = n - n % LANES;
    let mut lanes = [0f32; LANES];
    let mut buffer = [0f32; BLOCK];
    for block in row[..whole].chunks(BLOCK) {
        let exps = &mut buffer[..block.len()];
        for (e, &x) in exps.iter_mut().zip(block) {
            *e = exp(x - max);
        }
        for chunk in exps.chunks_exact(LANES) {
            for l in 0..LANES {
                lanes[l] += chunk[l];
            }
        }
    }
    let mut sum = 0f32;
    for lane in lanes {
        sum += lane;
    }
    for &x in &row[whole..] {
        sum += exp(x - max);
    }
    max + sum.ln()
}

vectorised! {
    /// `out = g · exp(row - log_sum_exp)`: the row's softmax times `g`.
    fn softmax_times(row: &[f32], log_sum_exp: f32, g: f32, out: &mut [f32]) = softmax_times_portable
}

#[inline(always)]
fn softmax_times_portable(row: &[f32], log_sum_exp: f32, g: f32, out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(row) {
        *o = g * exp(x - log_sum_exp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn log_sum_exp_sums_in_lane_order_and_matches_f64() {
        // Lengths below a lane, across the block boundary, and a BERT vocabulary's row.
        for n in [1, 15, 16, 1023, 1024, 1025, 1037, 30_522] {
            let row: Vec<f32> = Tensor::randn(0f32, 4.0, n, &Device::Cpu)
                .unwrap()
                .to_vec1()
                .unwrap();
            let max = lane_max(&row);
            let in_lane_order = max + lane_sum(n, |i| exp(row[i] - max)).ln();
            assert_eq!(
                log_sum_exp(&row).to_bits(),
                in_lane_order.to_bits(),
                "n = {n}"
            );
            let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let f64_sum: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            let reference = m + f64_sum.ln();
            assert!(
                (log_sum_exp(&row) as f64 - reference).abs() < 1e-5,
                "n = {n}"
            );
        }
    }
}
