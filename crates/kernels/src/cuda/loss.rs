//! The negative log-likelihood of rows of logits on CUDA (`loss.cu`), the twin of the CPU's
//! `NegativeLogLikelihood`: f32 or bf16 logits read as they are, each row's log-sum-exp handed
//! from the forward to the backward, which writes the logits' gradient in one pass.
//!
//! Where candle's ops took the `[slots, vocabulary]` logits to f32 and through a log-softmax
//! and a gather (about six passes forward, and in autograd each intermediate kept: ~25 bytes a
//! logit at BERT-large's phase 1, BENCHMARKS.md), this keeps nothing but the row's
//! log-sum-exp.

use super::*;

/// `[rows]` f32: each row's `log Σ exp(x) - x[label]`, for `logits` `[..., classes]` (f32 or
/// bf16) and `labels` `[rows]` u32 (checked on the host by `loss::labels`).
pub(crate) fn nll(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let op = Nll {
        lse: Handoff::empty(),
    };
    logits.contiguous()?.apply_op2(&labels.contiguous()?, op)
}

/// The rows and classes of `[..., classes]` logits with `[rows]` labels
/// ([`crate::nll_rows`]).
fn nll_dims(name: &str, logits: &Layout, labels: &Layout) -> Result<(usize, usize)> {
    crate::nll_rows(name, logits.dims(), labels.dims())
}

/// The kernels' launch: a block per row, rows strided past 65,535.
fn row_config(rows: usize, classes: usize) -> LaunchConfig {
    config(rows.min(65_535), row_threads(classes), 0)
}

struct Nll {
    lse: Handoff<CudaSlice<f32>>,
}

impl CustomOp2 for Nll {
    fn name(&self) -> &'static str {
        "bertkit-cuda-nll"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        y: &CudaStorage,
        yl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &Nll,
            (x, xl): (&CudaStorage, &Layout),
            (y, yl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let (rows, classes) = nll_dims(name, xl, yl)?;
            let logits = view::<T>(name, "logits", x, xl)?;
            let labels = view::<u32>(name, "labels", y, yl)?;
            let dev = &x.device;
            // SAFETY: the kernel writes every row's loss and log-sum-exp.
            let mut nll = unsafe { dev.alloc::<f32>(rows)? };
            let mut lse = unsafe { dev.alloc::<f32>(rows)? };
            let (rows_i, classes_i) = (rows as i32, classes as i32);
            let cfg = row_config(rows, classes);
            launch!(T, dev, "nll_forward", cfg, |b| {
                b.arg(&logits).arg(&labels).arg(&mut nll).arg(&mut lse);
                b.arg(&rows_i).arg(&classes_i);
            })?;
            op.lse.put(name, lse)?;
            Ok((
                CudaStorage::wrap_cuda_slice(nll, dev.clone()),
                Shape::from(rows),
            ))
        }
        by_dtype!(self.name(), x, run(self, (x, xl), (y, yl)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _nll: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("loss", grad.device(), || {
            let lse = self.lse.take(self.name())?;
            let grad = grad.to_dtype(DType::F32)?.contiguous()?;
            let op = NllBackward { lse };
            let grad_logits = logits.apply_op3_no_bwd(labels, &grad, &op)?;
            Ok((Some(grad_logits), None))
        })
    }
}

/// The backward from the logits, the labels and the rows' gradients: the logits' gradient.
struct NllBackward {
    lse: CudaSlice<f32>,
}

impl CustomOp3 for NllBackward {
    fn name(&self) -> &'static str {
        "bertkit-cuda-nll-backward"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        y: &CudaStorage,
        yl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &NllBackward,
            (x, xl): (&CudaStorage, &Layout),
            (y, yl): (&CudaStorage, &Layout),
            (g, gl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let (rows, classes) = nll_dims(name, xl, yl)?;
            if gl.dims() != [rows] {
                bail!("{name}: [{rows}] gradients expected, got {:?}", gl.dims())
            }
            let logits = view::<T>(name, "logits", x, xl)?;
            let labels = view::<u32>(name, "labels", y, yl)?;
            let grad = view::<f32>(name, "gradient", g, gl)?;
            let dev = &x.device;
            // SAFETY: the kernel writes every element.
            let mut out = unsafe { dev.alloc::<T>(rows * classes)? };
            let (rows_i, classes_i) = (rows as i32, classes as i32);
            let cfg = row_config(rows, classes);
            launch!(T, dev, "nll_backward", cfg, |b| {
                b.arg(&logits).arg(&labels).arg(&op.lse).arg(&grad);
                b.arg(&mut out).arg(&rows_i).arg(&classes_i);
            })?;
            Ok((wrap(out, dev), xl.shape().clone()))
        }
        by_dtype!(self.name(), x, run(self, (x, xl), (y, yl), (g, gl)))
    }
}
