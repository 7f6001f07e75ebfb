//! Two tensors' sum on CUDA ([`crate::add_gradients`]): the tape's gradients where two
//! meet (a residual's and a sublayer's, a layer's input), in one launch that reads and writes 16
//! bytes a thread, each element added in f32 and rounded once (`add_tensors` in `kernels.cu`).
//! candle's addition gives each element a thread of its own (a fifth of the speed, measured in
//! BENCHMARKS.md). The twin is candle's addition on the
//! CPU (bf16 and f16 through f32, rounded once: the same bits).

use super::*;

/// `a + b` by `kernel` (its `B` entry point: `A` and `B` in, `O` out, one shape): a thread per
/// 16 bytes of `b`, grid-stride past 65,535 blocks.
fn sum<A: Element, B: Element, O: Element>(
    op: &str,
    kernel: &str,
    (a, al): (&CudaStorage, &Layout),
    (b, bl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    if al.dims() != bl.dims() {
        bail!("{op}: {:?} and {:?}", al.dims(), bl.dims())
    }
    let n = al.shape().elem_count();
    let (x, y) = (view::<A>(op, "a", a, al)?, view::<B>(op, "b", b, bl)?);
    let dev = &a.device;
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<O>(n)? };
    let threads = n.div_ceil(piece_elements::<B>());
    launch!(
        B,
        dev,
        kernel,
        config(threads.div_ceil(256).min(65_535), 256, 0),
        |bld| {
            bld.arg(&x).arg(&y).arg(&mut out).arg(&n);
        }
    )?;
    Ok((wrap(out, dev), al.shape().clone()))
}

/// `a + b`, both contiguous, of one shape and dtype.
struct AddTensors;

impl CustomOp2 for AddTensors {
    fn name(&self) -> &'static str {
        "bertkit-cuda-add"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &AddTensors,
            a: (&CudaStorage, &Layout),
            b: (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            sum::<T, T, T>(op.name(), "add_tensors", a, b)
        }
        by_dtype!(self.name(), a, run(self, (a, al), (b, bl)))
    }

    fn bwd(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        _sum: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

/// `a + b` through [`AddTensors`] (CUDA tensors of one shape and dtype the kernels take).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op2(&b.contiguous()?, AddTensors)
}
